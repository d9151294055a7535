"""Policy registry: built-in policies register with ``@register``; plugins via entry points.

Every module in the ``policies`` package is imported on first lookup, so a new built-in policy is
one file plus its ``@register`` line. Third-party packages add policies through the entry-point
group ``daopsim.policies`` (``name = "package.module:PolicyClass"``).
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import pkgutil
from typing import TypeVar

from policies.base import Policy
from simulator.errors import UserError

ENTRY_POINT_GROUP = "daopsim.policies"
_REGISTRY: dict[str, type[Policy]] = {}
_LOADED = False
_SKIP = {"base", "registry", "caching"}

P = TypeVar("P", bound=type[Policy])


def register(cls: P) -> P:
    """Class decorator: add a policy under its ``name``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a non-empty class attribute 'name'")
    existing = _REGISTRY.get(cls.name)
    if existing is not None and existing is not cls:
        raise TypeError(f"two policies named {cls.name!r}: {existing} and {cls}")
    _REGISTRY[cls.name] = cls
    return cls


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import policies

    for info in pkgutil.iter_modules(policies.__path__):
        if info.name not in _SKIP and not info.name.startswith("_"):
            importlib.import_module(f"policies.{info.name}")
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as exc:  # a broken plugin must not break the built-ins
            raise UserError(
                f"policy plugin {ep.name!r} ({ep.value}) failed to load: {exc}"
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise UserError(f"policy plugin {ep.name!r} ({ep.value}) is not a Policy subclass")
        if not cls.name:
            cls.name = ep.name
        _REGISTRY.setdefault(cls.name, cls)


def available() -> dict[str, type[Policy]]:
    """All registered policies by name (built-ins and plugins), sorted."""
    _load()
    return dict(sorted(_REGISTRY.items()))


def get_policy_class(name: str) -> type[Policy]:
    """A policy class by name; a clear error listing the valid names."""
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UserError(
            f"unknown policy {name!r}; available: {', '.join(sorted(_REGISTRY))}"
        ) from None


def make_policy(name: str, options: dict[str, object] | None = None) -> Policy:
    """Instantiate a policy with validated options."""
    return get_policy_class(name)(**(options or {}))
