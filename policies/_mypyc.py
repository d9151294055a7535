"""``mypyc_attr`` for the policy classes, without making mypy_extensions a dependency.

The policy modules are written so that mypyc can compile them (docs/policy-api.md, "Compiled
policies"). A class that users may subclass carries ``@mypyc_attr(allow_interpreted_subclasses=
True)``: mypyc reads the decorator at compile time (through the name mypy resolves here) and a
compiled module never calls it. In an uncompiled run it is this no-op, or mypy_extensions' own
when that is installed (also a no-op). This module itself is never compiled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr
else:
    try:
        from mypy_extensions import mypyc_attr
    except ImportError:

        def mypyc_attr(*attrs: Any, **kwattrs: Any) -> Any:
            """Without mypy_extensions: leave the class as it is."""
            return lambda cls: cls


__all__ = ["mypyc_attr"]
