"""The compiled build of the engine core and the built-in policies, and its pure-Python fallback.

The modules :func:`candidates` lists (the engine core, its heap, the policy boundary and every
policy module in ``policies/`` but the registry) are typed for mypyc, which compiles each of them
to a C extension of its own when the package is built on a machine with a C compiler
(``setup.py``, ``make native``). The same sources always run uncompiled too. The build records,
beside the extensions, each compiled module's SHA-256 and the compiled modules it imports
(:data:`MANIFEST`); at the first import of ``daopsim.simulator`` or ``daopsim.policies`` every
compiled module is checked against it, and one runs from its ``.py`` source instead of its
extension when

* the environment sets ``DAOPSIM_PURE_PYTHON=1`` (every module: to check or debug the fallback),
* its source changed since the build, or its extension is missing (a stale extension never
  runs), or
* it imports, directly or through other compiled modules, a module that runs from its source:
  a compiled module calls the compiled code of the modules it imports directly (their C
  functions and class layouts), so it cannot run beside a source it was not compiled against.

A module in ``policies/`` that the build does not know (a policy added since) runs from its
source and changes nothing else. Both builds give identical results to the last bit
(tests/test_compiled.py); :func:`status` tells what runs and why, :func:`announcement` is the
one line every command prints on stderr when part of the build is stale or missing.

This module imports nothing outside the standard library: ``setup.py`` runs it at build time
(from the repository, where the package's folders are the top-level folders ``simulator/`` and
``policies/``), and it may be run as a script to lay the sources out as installed
(``python simulator/native.py stage DEST``, what ``make typecheck`` checks).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

#: the folder holding ``simulator/`` and ``policies/``: the installed ``daopsim`` package, or the
#: repository root in a checkout (its folders are the packages ``daopsim.simulator`` ...) and
#: when setup.py runs this file
_BASE = Path(__file__).absolute().parent.parent
#: the engine core and what it imports natively: always compiled when anything is
CORE = (
    "daopsim.simulator.heap",
    "daopsim.simulator.core.ops",
    "daopsim.simulator.core.resources",
    "daopsim.simulator.core.machine",
    "daopsim.simulator.core.executor",
    "daopsim.simulator.boundary",
    "daopsim.simulator.core.apply",
    "daopsim.simulator.core.loop",
)
#: compiled as one library (mypyc group): the core and the policy API it calls at every layer, so
#: that their calls to each other are direct C calls (every other module is a library of its
#: own). Editing one of them takes the others out of the compiled build with it, as their
#: imports of each other mostly would anyway.
CORE_GROUP = (
    *CORE,
    "daopsim.policies.base",
    "daopsim.policies.options",
    "daopsim.policies.placement",
)
#: the core group's library: ``daopsim/simulator/core/native__mypyc.<ext>``
GROUP = "daopsim.simulator.core.native"
#: policy modules that stay interpreted: the package, the registry (plugins, entry points) and
#: the mypyc shim
INTERPRETED_POLICIES = ("__init__", "_mypyc", "registry")
#: the build's record (beside ``native.py``): each compiled module's SHA-256 and imports
MANIFEST = "native-build.json"
#: set to 1 to run the pure-Python sources even when a compiled build is present
ENV = "DAOPSIM_PURE_PYTHON"
#: folders of the package that are the repository's top-level folders of the same name
FOLDERS = ("simulator", "policies")
#: the command that rebuilds the compiled modules in a checkout
REBUILD = "make native"


def candidates(base: Path = _BASE) -> list[str]:
    """The modules the build compiles: :data:`CORE`, then every policy module of the tree at
    ``base`` (``policies/*.py`` but :data:`INTERPRETED_POLICIES`), sorted."""
    policies = sorted(
        f"daopsim.policies.{p.stem}"
        for p in (base / "policies").glob("*.py")
        if p.stem not in INTERPRETED_POLICIES
    )
    return [*CORE, *policies]


def source_path(module: str, base: Path = _BASE) -> Path:
    """The ``.py`` source of a module of ``daopsim.simulator`` or ``daopsim.policies``
    (``daopsim.simulator.core.ops`` is ``simulator/core/ops.py`` under ``base``)."""
    package, _, rest = module.partition(".")
    if package != "daopsim" or rest.partition(".")[0] not in FOLDERS:
        raise ValueError(f"not a module of daopsim.simulator or daopsim.policies: {module!r}")
    return base.joinpath(*rest.split(".")).with_suffix(".py")


def short(module: str) -> str:
    """A module's file as the repository names it: ``policies/lru.py``."""
    return source_path(module, Path()).as_posix()


def module_source(module: ModuleType) -> Path | None:
    """The ``.py`` source of a loaded module, compiled or not (a compiled module's
    ``__file__`` names its extension); None when it has no source file."""
    file = getattr(module, "__file__", None)
    if file and file.endswith(".py"):
        return Path(file)
    try:
        path = source_path(module.__name__)
    except ValueError:
        return None
    return path if path.is_file() else None


def sha256(path: Path) -> str:
    """SHA-256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def imports(path: Path, module: str, universe: Iterable[str]) -> list[str]:
    """The modules of ``universe`` that the source at ``path`` (the module ``module``) imports
    anywhere: at the top, in functions, under ``TYPE_CHECKING`` (a type named only for the
    checker is still compiled against), relative or absolute, sorted."""
    names = set(universe)
    found: set[str] = set()
    package = module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            mods = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for m in mods:
            # `import a.b.c` imports a.b too; `from a import b` may name the module a.b
            parts = m.split(".")
            found.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)))
    found.discard(module)
    return sorted(found & names)


def library(module: str) -> str:
    """The extension module holding a compiled module's code (mypyc's group library; the
    module's own extension is a shim that loads it): :data:`GROUP` for the core group's
    modules, ``<module>__mypyc`` beside the module for every other."""
    return (GROUP if module in CORE_GROUP else module) + "__mypyc"


def extension_path(name: str, base: Path = _BASE) -> Path | None:
    """The file of an extension module of the package, if built: a compiled module's own
    (``simulator/core/ops.cpython-311-x86_64-linux-gnu.so``) or a library (:func:`library`)."""
    folder = source_path(name.rpartition(".")[0] + ".x", base).parent
    stem = name.rpartition(".")[2]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = folder / (stem + suffix)
        if p.exists():
            return p
    return None


def manifest_path(base: Path = _BASE) -> Path:
    """Where the build's record lies: beside this file (``simulator/native-build.json``)."""
    return base / "simulator" / MANIFEST


#: the reasons of modules that run from their sources only because another one does
_KNOCK_ON = ("imports ", "is compiled with ")


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class Build:
    """What runs in this process: which modules run compiled and which from their sources.

    ``state`` is ``"compiled"`` (every module the build knows runs compiled, and none is new),
    ``"partial"`` (some run from their sources: ``interpreted`` says which and why), ``"pure"``
    (no compiled build is present) or ``"off"`` (``DAOPSIM_PURE_PYTHON`` is set).
    """

    state: str
    compiled: frozenset[str] = frozenset()
    #: module -> why it runs from its source, for the modules a partial build does not run
    interpreted: dict[str, str] = field(default_factory=dict)
    #: why there is no compiled module at all (state ``pure`` or ``off``)
    reason: str = ""
    #: modules whose extension exists but must not be imported (they run from their sources)
    bypass: frozenset[str] = frozenset()

    @property
    def core_compiled(self) -> bool:
        """Whether the engine core's loop runs compiled (then its classes cannot be patched)."""
        return "daopsim.simulator.core.loop" in self.compiled

    def describe(self) -> str:
        """One line: which build runs (``daopsim --version`` prints it)."""
        n = len(self.compiled)
        if self.state == "compiled":
            return f"compiled (mypyc): all {n} compiled modules current"
        if self.state == "partial":
            parts = [f"{short(m)} ({why})" for m, why in self.interpreted.items()]
            return f"partial: {n} modules compiled, interpreted: " + ", ".join(parts)
        return f"pure Python ({self.reason})"

    def announcement(self) -> str | None:
        """The one line every command prints on stderr when part of the build is stale or
        missing; None when the build is whole or deliberately absent."""
        if not self.interpreted or self.state == "off":
            return None
        own = [m for m, why in self.interpreted.items() if not why.startswith(_KNOCK_ON)]
        dependents = len(self.interpreted) - len(own)
        what = ", ".join(f"{short(m)} {self.interpreted[m]}" for m in own[:3])
        if len(own) > 3:
            what += f" and {len(own) - 3} more"
        tail = f" (and {dependents} modules compiled against them)" if dependents else ""
        return (
            f"daopsim: compiled build partly stale: {what}{tail} run interpreted; "
            f"`{REBUILD}` recompiles (`daopsim --version` lists them)"
        )


class _Listing:
    """The file names of the package's folders, each listed once (a decision at every start of
    ``daopsim`` looks for a few dozen extensions: one ``listdir`` per folder, not a stat each)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.folders: dict[Path, frozenset[str]] = {}

    def has_extension(self, name: str) -> bool:
        folder = source_path(name.rpartition(".")[0] + ".x", self.base).parent
        if folder not in self.folders:
            try:
                self.folders[folder] = frozenset(os.listdir(folder))
            except OSError:
                self.folders[folder] = frozenset()
        stem = name.rpartition(".")[2]
        names = self.folders[folder]
        return any(stem + suffix in names for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def decide(base: Path = _BASE, environ: dict[str, str] | None = None) -> Build:
    """Which modules run compiled, and why the others do not (no side effects)."""
    env = os.environ if environ is None else environ
    listing = _Listing(base)
    known = candidates(base)
    built = frozenset(m for m in known if listing.has_extension(m))
    if env.get(ENV, "") not in ("", "0"):
        return Build("off", reason=f"{ENV} is set", bypass=built)
    path = manifest_path(base)
    if not path.exists():
        why = f"no compiled build; `{REBUILD}` compiles the core"
        return Build("pure", reason=why, bypass=built)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        modules: dict[str, dict] = record["modules"]
        skipped: dict[str, str] = record.get("skipped", {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return Build("pure", reason=f"the build's record {path} is unreadable", bypass=built)
    why: dict[str, str] = {}
    present: set[str] = set()
    for mod, rec in modules.items():
        try:
            digest = sha256(source_path(mod, base))
        except OSError:
            continue  # removed since the build: nothing imports it any more
        present.add(mod)
        if not all(listing.has_extension(e) for e in (mod, rec.get("library", library(mod)))):
            why[mod] = "has no extension"
        elif digest != rec.get("sha256"):
            why[mod] = "edited since the build"
    for mod in known:
        if mod not in modules:
            why[mod] = f"not compiled: {skipped[mod]}" if mod in skipped else "new since the build"
    # a compiled module runs only beside the compiled code of everything it imports, and of the
    # modules compiled into the same library (their calls to each other are direct); the core
    # group runs compiled only whole, even if a build compiled part of it: its modules subclass
    # each other's classes, and an interpreted class cannot inherit from a compiled one
    core_out = next((m for m in CORE_GROUP if m in why), None)
    if core_out is not None:
        for mod in CORE_GROUP:
            if mod in modules and mod not in why:
                why[mod] = f"is compiled with {short(core_out)}"
    changed = True
    while changed:
        changed = False
        for mod, rec in modules.items():
            if mod in why:
                continue
            dep = next((d for d in rec.get("imports", ()) if d in why), None)
            mate = next((m for m, r in modules.items() if m in why
                         and r.get("library") == rec.get("library")), None)  # fmt: skip
            if dep is not None:
                why[mod] = f"imports {short(dep)}"
            elif mate is not None:
                why[mod] = f"is compiled with {short(mate)}"
            else:
                continue
            changed = True
    compiled = frozenset(m for m in present if m not in why)
    bypass = frozenset(m for m in modules if m in why and listing.has_extension(m))
    if not compiled:
        why_not = f"every compiled module is stale; `{REBUILD}` recompiles"
        return Build("pure", interpreted=why, reason=why_not, bypass=bypass | built)
    order = {m: i for i, m in enumerate(_unique([*known, *modules]))}
    ordered = dict(sorted(why.items(), key=lambda kv: order.get(kv[0], len(order))))
    return Build("partial" if ordered else "compiled", compiled, ordered, bypass=bypass)


_choice: Build | None = None


def status() -> Build:
    """What runs in this process (decided once, at the first import of the package)."""
    global _choice
    if _choice is None:
        _choice = decide()
    return _choice


def announcement() -> str | None:
    """The one-line notice of a stale or partial build, or None (see :meth:`Build.announcement`)."""
    return status().announcement()


class _PureFinder(importlib.abc.MetaPathFinder):
    """Imports from their sources the built modules that do not run compiled."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in status().bypass:
            return None  # compiled, or no extension to bypass: the normal import finds it
        return importlib.util.spec_from_file_location(fullname, source_path(fullname))


def install() -> None:
    """Put the fallback's finder ahead of the default import machinery (once)."""
    if not any(isinstance(f, _PureFinder) for f in sys.meta_path):
        status()
        sys.meta_path.insert(0, _PureFinder())


# -- build time (setup.py) ---------------------------------------------------------------------


def stage(base: Path, dest: Path) -> Path:
    """Lay the package's Python sources out as installed, under ``dest``: ``daopsim/``'s own
    modules and the folders ``simulator/`` and ``policies/`` as ``daopsim/simulator/`` ...
    (the names mypy and mypyc give a module come from its path). Files are copied only when
    changed (their times kept, so mypy's cache and the C build stay incremental); files no
    longer in the sources are removed. Returns ``dest``."""
    wanted: dict[Path, Path] = {}
    for src in (base / "daopsim").glob("*"):
        if src.suffix in (".py", ".typed"):
            wanted[Path("daopsim") / src.name] = src
    for folder in FOLDERS:
        for src in (base / folder).rglob("*"):
            if src.suffix in (".py", ".typed") and "__pycache__" not in src.parts:
                wanted[Path("daopsim", folder) / src.relative_to(base / folder)] = src
    for rel, src in wanted.items():
        out = dest / rel
        st = src.stat()
        try:
            same = out.stat().st_mtime_ns == st.st_mtime_ns and out.stat().st_size == st.st_size
        except OSError:
            same = False
        if not same:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out)
    if (dest / "daopsim").is_dir():
        for out in (dest / "daopsim").rglob("*"):
            if out.is_file() and out.relative_to(dest) not in wanted:
                out.unlink()
    return dest


def record(base: Path, modules: Iterable[str], skipped: dict[str, str]) -> dict:
    """The build's record of the modules compiled from the tree at ``base``: each one's SHA-256,
    its library and the compiled modules it imports; ``skipped``: candidates left uncompiled,
    and why."""
    mods = list(modules)
    return {
        "modules": {
            m: {"sha256": sha256(source_path(m, base)), "library": library(m),
                "imports": imports(source_path(m, base), m, mods)}
            for m in mods
        },
        "skipped": dict(skipped),
    }  # fmt: skip


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "stage":
        print(stage(_BASE, Path(argv[1])))
        return 0
    print("usage: python simulator/native.py stage DEST", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
