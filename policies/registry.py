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

import hashlib
import importlib
import importlib.metadata as md
import importlib.util
import pkgutil
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from daopsim.policies.base import Policy
from daopsim.policies.options import Param
from daopsim.simulator.errors import UserError, did_you_mean

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


#: class attributes a policy may set, and the types they must have (:func:`class_problem`)
_CLASS_ATTRIBUTES: tuple[tuple[str, type | tuple[type, ...], str], ...] = (
    ("name", str, "a non-empty string"),
    ("summary", str, "a string"),
    ("source", str, "a string"),
    ("prefill_note", str, "a string"),
    ("runtime_profile", str, "a runtime profile's name (a string)"),
    ("params", dict, "a dict of option names to Param"),
    ("clairvoyant", bool, "True or False"),
    ("bound", bool, "True or False"),
    ("needs_calibration", bool, "True or False"),
)


def class_problem(cls: type[Policy]) -> str | None:
    """What is wrong with a policy class's attributes (``name = 5``, ``params = 5``), in one
    line, or None: checked when a file or plugin is loaded, before anything uses them."""
    for attr, kind, what in _CLASS_ATTRIBUTES:
        value = getattr(cls, attr, None)
        if not isinstance(value, kind) or (attr == "name" and not value):
            return f"class attribute {attr!r} must be {what}, got {value!r}"
    for key, param in cls.params.items():
        if not isinstance(key, str) or not isinstance(param, Param):
            return f"class attribute 'params' maps {key!r} to {param!r}, not to a Param"
    return None


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
    except BaseException as exc:  # any import-time failure stays with this plugin
        if isinstance(exc, KeyboardInterrupt):
            raise
        fail(f"failed to load: {_one_line(exc)}")
        return
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        fail(f"is not a Policy subclass (got {cls!r})")
        return
    if not cls.name and isinstance(cls.name, str):
        cls.name = ep.name  # an entry point names a policy that does not name itself
    problem = class_problem(cls)
    if problem is not None:
        fail(problem)
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
    # the modules beside this one (not through the package: daopsim.policies() calls this)
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name not in _SKIP and not info.name.startswith("_"):
            importlib.import_module(f"daopsim.policies.{info.name}")
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


def is_policy_file(name: str) -> bool:
    """True for a ``PATH.py:CLASS`` policy name (a one-file policy, :func:`load_policy_file`)."""
    path, sep, cls = name.rpartition(":")
    return bool(sep) and path.endswith(".py") and cls.isidentifier()


def load_policy_file(spec: str) -> type[Policy]:
    """The policy class ``CLASS`` of the Python file ``PATH`` (``spec`` is ``PATH.py:CLASS``),
    imported once per process and registered under its ``name`` (``--policy PATH.py:CLASS``).

    The file needs no package and no ``@register`` line (one is harmless). A missing file or
    class, an import error, a class that is not a :class:`Policy` or a name already taken by
    another policy is a one-line :class:`UserError`."""
    path_text, _, cls_name = spec.rpartition(":")
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise UserError(f"--policy {spec}: no such file {path_text!r}")
    path = path.resolve()
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    mod_name = f"daopsim_policy_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}_{digest}"
    module = sys.modules.get(mod_name)
    if module is None:
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise UserError(f"{path}: not an importable Python file")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module  # before running it: dataclasses and pickling look here
        _load()  # built-ins first, so a file taking a built-in's name is refused below
        try:
            loader_spec.loader.exec_module(module)
        except BaseException as exc:  # sys.exit() or a bare BaseException at import too
            if isinstance(exc, KeyboardInterrupt):
                raise
            del sys.modules[mod_name]
            raise UserError(f"{path}: failed to import: {_one_line(exc)}") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        found = [
            k
            for k, v in vars(module).items()
            if isinstance(v, type) and issubclass(v, Policy) and v.__module__ == mod_name
        ]
        raise UserError(
            f"{path}: no class {cls_name!r}" + (did_you_mean(cls_name, found) if found else "")
        )
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise UserError(f"{path}: {cls_name} is not a Policy subclass (got {cls!r})")
    if not cls.name:
        raise UserError(f"{path}: {cls_name} needs a class attribute 'name'")
    problem = class_problem(cls)
    if problem is not None:
        raise UserError(f"{path}: {cls_name}: {problem}")
    _load()
    taken = _REGISTRY.get(cls.name)
    if taken is not None and taken is not cls:
        raise UserError(
            f"{path}: {cls_name} takes the name {cls.name!r}, which {_qualname(taken)} has"
        )
    _REGISTRY[cls.name] = cls
    return cls


def get_policy_class(name: str) -> type[Policy]:
    """A policy class by name (or ``PATH.py:CLASS``, :func:`load_policy_file`); a clear error
    naming a broken plugin, or the closest valid names."""
    if is_policy_file(name):
        return load_policy_file(name)
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        pass
    failure = _FAILED.get(name)
    if failure is not None:
        raise UserError(failure.message())
    file_hint = _policy_file_hint(name)
    if file_hint:
        raise UserError(file_hint)
    hint = did_you_mean(name, _REGISTRY)
    raise UserError(f"unknown policy {name!r}{hint}; available: {', '.join(sorted(_REGISTRY))}")


def _policy_file_hint(name: str) -> str:
    """The error for a policy file named without its class (``bugs.py`` or ``bugs.py:``):
    the ``PATH.py:CLASS`` form, with the classes the file defines (read, not imported);
    "" when ``name`` does not look like a file."""
    import ast

    path_text, sep, cls = name.rpartition(":")
    if not sep:
        path_text = name
    if not path_text.endswith(".py"):
        return ""
    form = f"--policy {name}: give the policy class as PATH.py:CLASS"
    path = Path(path_text).expanduser()
    if not path.is_file():
        return f"{form}; no such file {path_text!r}"
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return form
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    if sep and cls:
        return f"{form} ({cls!r} is not a class name)"
    if not classes:
        return f"{form} (the file defines no class)"
    return f"{form}, e.g. --policy {path_text}:{classes[-1]} (classes in the file: " + (
        ", ".join(classes) + ")"
    )


def make_policy(name: str, options: dict[str, object] | None = None) -> Policy:
    """Instantiate a policy with validated options (a fault of its ``__init__`` or of the
    methods a run reads first is a PolicyError naming it: ``construct_policy``)."""
    from daopsim.simulator.boundary import construct_policy

    return construct_policy(get_policy_class(name), dict(options or {}))
