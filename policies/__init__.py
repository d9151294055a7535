"""The built-in policies, one module each, and the registry (docs/policy-api.md).

Installed as ``daopsim.policies`` (the only name it imports by; the repository's policies/ folder
is the package through pyproject.toml's package-dir). The package is callable:
``daopsim.policies()`` lists the registered policies by name (:func:`registry.available`), the
public API's ``policies()``, which this subpackage of the same name would otherwise replace.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING

if __name__ != "daopsim.policies":  # one name per module: never two copies
    raise ImportError(
        f"{__name__!r} is the package daopsim.policies: import it by that name "
        "(the folder policies/ installs only inside daopsim)"
    )

from daopsim.simulator import native as _native

if TYPE_CHECKING:
    from daopsim.policies.base import Policy

# the compiled policies run only with a current compiled build (simulator/native.py)
_native.install()


class _Package(types.ModuleType):
    """``daopsim.policies``, which is also the public ``daopsim.policies()``."""

    def __call__(self) -> dict[str, type[Policy]]:
        """All registered policies by name (built-ins and working plugins), sorted."""
        from daopsim.policies.registry import available

        return available()


sys.modules[__name__].__class__ = _Package
