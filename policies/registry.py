"""Policy registry: built-in policies register with ``@register``; plugins via entry points.

Every module in the ``policies`` package is imported on first lookup, so a new built-in policy is
one file plus its ``@register`` line. Third-party packages add policies through the entry-point
group ``daopsim.policies`` (``name = "package.module:PolicyClass"``).

Plugins load one at a time. One that fails to import, is not a :class:`Policy` subclass, or takes
a name that is already registered is recorded as a :class:`PluginFailure` and left out; everything
else keeps working. ``daopsim policies list`` shows each failure, and asking for a broken plugin by
name gives one line naming the plugin and why it failed.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import pkgutil
from dataclasses import dataclass
from typing import TypeVar

from policies.base import Policy
from simulator.errors import UserError

ENTRY_POINT_GROUP = "daopsim.policies"
_REGISTRY: dict[str, type[Policy]] = {}
_FAILED: dict[str, PluginFailure] = {}
_LOADED = False
_SKIP = {"base", "registry", "caching"}

P = TypeVar("P", bound=type[Policy])


@dataclass(frozen=True)
class PluginFailure:
    """A policy plugin that could not be registered, and why."""

    name: str  #: the entry point's name
    target: str  #: what the entry point points at, ``module:attribute``
    distribution: str | None  #: the installed package that declares it, when known
    error: str  #: one line: what went wrong

    def message(self) -> str:
        """One line naming the plugin and its failure."""
        where = self.target
        if self.distribution:
            where += f" from {self.distribution}"
        return f"policy plugin {self.name!r} ({where}) {self.error}"

    def to_dict(self) -> dict[str, str | None]:
        """The failure as a plain dict (``policies list --json``)."""
        return {
            "name": self.name,
            "target": self.target,
            "distribution": self.distribution,
            "error": self.error,
        }


def register(cls: P) -> P:
    """Class decorator: add a policy under its ``name``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a non-empty class attribute 'name'")
    existing = _REGISTRY.get(cls.name)
    if existing is not None and existing is not cls:
        raise TypeError(f"two policies named {cls.name!r}: {existing} and {cls}")
    _REGISTRY[cls.name] = cls
    return cls


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _load_plugin(ep: md.EntryPoint) -> None:
    """Register one entry point, or record why it cannot be; the registry is left as before."""
    dist = getattr(ep, "dist", None)
    dist_name = dist.metadata["Name"] if dist is not None else None

    def fail(error: str) -> None:
        _REGISTRY.clear()
        _REGISTRY.update(before)
        _FAILED.setdefault(ep.name, PluginFailure(ep.name, ep.value, dist_name, error))

    before = dict(_REGISTRY)
    try:
        cls = ep.load()
    except (Exception, SystemExit) as exc:  # any import-time failure stays with this plugin
        fail(f"failed to load: {_one_line(exc)}")
        return
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        fail(f"is not a Policy subclass (got {cls!r})")
        return
    name = cls.name or ep.name
    taken = before.get(name)
    if taken is not None and taken is not cls:
        fail(f"cannot use the name {name!r}: it is taken by {_qualname(taken)}")
        return
    if not cls.name:
        cls.name = ep.name
    _REGISTRY[name] = cls


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    _FAILED.clear()
    import policies

    for info in pkgutil.iter_modules(policies.__path__):
        if info.name not in _SKIP and not info.name.startswith("_"):
            importlib.import_module(f"policies.{info.name}")
    for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value)):
        _load_plugin(ep)


def available() -> dict[str, type[Policy]]:
    """All registered policies by name (built-ins and working plugins), sorted."""
    _load()
    return dict(sorted(_REGISTRY.items()))


def failed_plugins() -> dict[str, PluginFailure]:
    """Plugins that could not be registered, by entry-point name, sorted."""
    _load()
    return dict(sorted(_FAILED.items()))


def get_policy_class(name: str) -> type[Policy]:
    """A policy class by name; a clear error naming a broken plugin or listing the valid names."""
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        pass
    failure = _FAILED.get(name)
    if failure is not None:
        raise UserError(failure.message())
    raise UserError(f"unknown policy {name!r}; available: {', '.join(sorted(_REGISTRY))}")


def make_policy(name: str, options: dict[str, object] | None = None) -> Policy:
    """Instantiate a policy with validated options."""
    return get_policy_class(name)(**(options or {}))
