"""Build hook: compile the engine core and the policies with mypyc when a C compiler is present.

Everything else about the package is in pyproject.toml. Which modules compile and how each
one's pure-Python fallback is chosen at import are in simulator/native.py; without a compiler,
with ``DAOPSIM_PURE_PYTHON=1`` at build time, or if compiling fails, the package installs
uncompiled (wholly or in part) and runs the same sources.

mypyc names a module after its path, so it compiles a copy of the sources laid out as installed
(``build/stage/daopsim/simulator/core/ops.py`` compiles as ``daopsim.simulator.core.ops``).
Each module is a group of its own (``separate=True``): an edited module, or a policy added since
the build, runs interpreted alone (with the compiled modules that import it) while the rest stays
compiled. A module mypyc cannot compile (a type error in a new policy) is left out, with what
imports it, instead of failing the build. The C extensions build in parallel (one job per core
unless ``-j`` says otherwise), each announced on stderr as it finishes.

``make native`` runs ``setup.py build_ext --inplace``: the extensions land beside their sources
(setuptools maps ``daopsim.simulator`` to simulator/), where an editable install imports them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
native = runpy.run_path(str(HERE / "simulator" / "native.py"))
#: where the sources are staged and mypyc writes its C files (relative to this folder)
STAGE = Path("build") / "stage"
C_DIR = Path("build") / "mypyc-c"


def _say(msg: str) -> None:
    print(f"daopsim build: {msg}", file=sys.stderr, flush=True)


#: a comma-separated list of the modules to compile (default: all of native.candidates()); the
#: others are recorded as left out and run from their sources
SELECT = "DAOPSIM_COMPILE"


def _selected() -> tuple[list[str], dict[str, str]]:
    """The modules to compile, and those left out by ``DAOPSIM_COMPILE`` (with why)."""
    modules = native["candidates"](HERE)
    wanted = {m.strip() for m in os.environ.get(SELECT, "").split(",") if m.strip()}
    if not wanted:
        return modules, {}
    unknown = wanted - set(modules)
    if unknown:
        sys.exit(f"{SELECT}: not a compiled module: {', '.join(sorted(unknown))}")
    core = set(native["CORE_GROUP"])
    if wanted & core and not core <= wanted:
        # the core group's classes are subclassed across its modules (ops' jobs are heap
        # items): an interpreted subclass of a compiled class fails, so it compiles whole
        _say(f"{SELECT}: the core group compiles whole ({len(core)} modules)")
        wanted |= core
    left = {m: f"left out by {SELECT}" for m in modules if m not in wanted}
    return [m for m in modules if m in wanted], left


def _wanted() -> bool:
    if os.environ.get(native["ENV"], "") not in ("", "0"):
        return False
    if any(shutil.which(c) for c in (os.environ.get("CC", ""), "cc", "gcc", "clang") if c):
        return True
    _say("no C compiler (cc, gcc or clang): the package stays pure Python")
    return False


def _rel(path: Path) -> str:
    """A path as mypyc should see it: relative to the current directory when below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


#: a mypy error line: ``build/stage/daopsim/policies/x.py:12: error: ...``
_ERROR = re.compile(r"^(?P<path>[^:\n]+\.py):\d+(?::\d+)?: error:", re.MULTILINE)


def _module_of(path: str, stage: Path) -> str | None:
    try:
        rel = (Path.cwd() / path).resolve().relative_to(stage.resolve())
    except ValueError:
        return None
    return ".".join(rel.with_suffix("").parts)


def _dependents(bad: set[str], deps: dict[str, list[str]]) -> set[str]:
    """``bad`` and every module that imports one of them, directly or not."""
    out = set(bad)
    changed = True
    while changed:
        changed = False
        for m, ds in deps.items():
            if m not in out and out.intersection(ds):
                out.add(m)
                changed = True
    return out


def _mypycify(modules: list[str], stage: Path) -> tuple[list[dict], dict[str, str]]:
    """mypyc's extensions for ``modules`` (as keyword arguments of ``Extension``); a module
    with type errors is left out (with every module that imports it) and the rest compiled.
    Returns (extensions, {left out: why}). Runs in the child process (:func:`_child`)."""
    from mypyc.build import mypycify

    deps = {m: native["imports"](native["source_path"](m, stage / "daopsim"), m, modules)
            for m in modules}  # fmt: skip
    skipped: dict[str, str] = {}
    todo = list(modules)
    fresh = False  # whether mypy's incremental cache was already dropped once
    while todo:
        paths = [_rel(native["source_path"](m, stage / "daopsim")) for m in todo]
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exts = mypycify(paths, opt_level="3", separate=_groups(todo, stage),
                                target_dir=_rel(C_DIR))  # fmt: skip
        except Exception as exc:
            # mypyc's code generator can fail on state read back from mypy's incremental cache
            # after an edit (seen: ValueError in emit_undefined_attr_check); once, start afresh
            if fresh:
                raise
            fresh = True
            shutil.rmtree(HERE / ".mypy_cache", ignore_errors=True)
            _say(f"mypyc failed on its incremental cache ({type(exc).__name__}); from scratch")
            continue
        except SystemExit:
            text = out.getvalue()
            bad = {m for p in _ERROR.findall(text) if (m := _module_of(p, stage)) in todo}
            if bad & set(native["CORE_GROUP"]):  # one library: it compiles whole or not at all
                bad |= set(native["CORE_GROUP"]) & set(todo)
            if not bad:
                print(text, file=sys.stderr)
                return [], {m: "mypyc failed" for m in modules}
            for m in sorted(_dependents(bad, deps) & set(todo)):
                n = sum(1 for p in _ERROR.findall(text) if _module_of(p, stage) == m)
                why = f"{n} type errors" if n else f"imports {native['short'](min(bad))}"
                skipped[m] = why
                _say(f"{native['short'](m)} left interpreted ({why}; see `make typecheck`)")
            todo = [m for m in todo if m not in skipped]
            continue
        keys = ("name", "sources", "include_dirs", "depends", "extra_compile_args")
        return [{k: getattr(e, k) for k in keys} for e in exts], skipped
    return [], skipped


def _groups(modules: list[str], stage: Path) -> list[tuple[list[str], str | None]]:
    """mypyc's ``separate``: the core group's modules as one library, every other its own."""
    core = [_rel(native["source_path"](m, stage / "daopsim"))
            for m in modules if m in native["CORE_GROUP"]]  # fmt: skip
    return [(core, native["GROUP"])] if core else []


#: the argument that makes this script the child that runs mypyc (:func:`_child`)
CHILD = "--daopsim-mypyc-child"


def _child(out: str) -> None:
    """Run mypyc (its type check and C code generation) and write what to build to ``out``.

    mypyc holds gigabytes of the type checker's objects; a separate process gives them back at
    once (``os._exit``, as mypy itself exits) instead of collecting them for minutes at exit.
    """
    stage = native["stage"](HERE, HERE / STAGE)
    modules, left = _selected()
    exts, skipped = _mypycify(modules, stage)
    skipped.update(left)
    Path(out).write_text(json.dumps({"extensions": exts, "skipped": skipped}), encoding="utf-8")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _extensions() -> list:
    if not _wanted():
        return []
    try:
        import mypyc.build  # noqa: F401
    except ImportError:
        _say("mypy (mypyc) is not installed; installing the pure-Python package")
        return []
    from setuptools import Extension

    if sys.platform == "darwin":  # what mypycify does to the compiler's settings there
        from mypyc.build import setup_mypycify_vars

        setup_mypycify_vars()
    modules = _selected()[0]
    _say(f"mypyc: type-checking {len(modules)} modules and writing their C code")
    t0 = time.monotonic()
    out = HERE / "build" / "mypyc-extensions.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    res = subprocess.run([sys.executable, str(HERE / "setup.py"), CHILD, str(out)], cwd=Path.cwd())
    if res.returncode != 0 or not out.exists():
        _say("mypyc failed; installing the pure-Python package")
        return []
    plan = json.loads(out.read_text(encoding="utf-8"))
    _say(f"mypyc: done in {time.monotonic() - t0:.0f} s")
    exts = [Extension(**kw) for kw in plan["extensions"]]
    for ext in exts:
        ext.optional = True  # a failed compile leaves that module (and its importers) interpreted
    BuildExt.skipped = plan["skipped"]
    BuildExt.modules = [m for m in native["candidates"](HERE) if m not in plan["skipped"]]
    return exts


class BuildExt(build_ext):
    """build_ext that builds in parallel with a line per finished module, then records each
    compiled source's SHA-256 and imports beside the extensions (simulator/native.py)."""

    modules: list[str] = []
    skipped: dict[str, str] = {}

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None or self.parallel is True:
            self.parallel = os.cpu_count() or 1
        self._lock = threading.Lock()
        self._done = 0

    def build_extensions(self) -> None:
        # the biggest first, so the last to finish is a small one
        def size(ext: object) -> int:
            return -sum(os.path.getsize(s) for s in ext.sources if os.path.exists(s))

        self.extensions.sort(key=size)
        self._libraries = sum(1 for e in self.extensions if e.name.endswith("__mypyc"))
        if self.extensions:
            _say(f"compiling {len(self.modules)} modules into {self._libraries} libraries "
                 f"on {self.parallel} cores")  # fmt: skip
        super().build_extensions()

    def build_extension(self, ext: object) -> None:
        t0 = time.monotonic()
        path = self.get_ext_fullpath(ext.name)
        fresh = os.path.exists(path) and not self.force and not _newer(ext, path)
        super().build_extension(ext)
        if not ext.name.endswith("__mypyc"):
            return  # a module's shim: a second; its library is the work
        with self._lock:
            self._done += 1
            what = "up to date" if fresh else f"{time.monotonic() - t0:.0f} s"
            members = _members(ext.name, self.modules)
            one = len(members) == 1
            label = native["short"](members[0]) if one else f"the core ({len(members)} modules)"
            _say(f"[{self._done:>2}/{self._libraries}] {label} ({what})")

    def run(self) -> None:
        super().run()
        if not self.extensions:
            return
        # native.py's folder (in place: simulator/; otherwise under build_lib)
        folder = Path(self.get_ext_fullpath("daopsim.simulator.native")).parent
        built = [m for m in self.modules
                 if all(os.path.exists(self.get_ext_fullpath(e))
                        for e in (m, native["library"](m)))]  # fmt: skip
        failed = {m: "its C compile failed" for m in self.modules if m not in built}
        for m, why in failed.items():
            _say(f"{native['short'](m)} left interpreted ({why})")
        # the hashes of the copies compiled (a source edited during the build stays stale)
        record = native["record"](HERE / STAGE / "daopsim", built, {**self.skipped, **failed})
        # what mypyc links each library against: the libraries of the groups it calls into
        for ext in self.extensions:
            if not ext.name.endswith("__mypyc"):
                continue
            linked = {m for lib in _links(ext) for m in _members(lib, built)}
            for m in _members(ext.name, built):
                rec = record["modules"][m]
                rec["imports"] = sorted(set(rec["imports"]) | (linked - {m}))
        if self.inplace:
            _remove_orphans(built)
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / native["MANIFEST"]
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(out)
        _say(f"{len(built)} of {len(self.modules) + len(self.skipped)} modules compiled")


def _remove_orphans(modules: list[str]) -> None:
    """Remove libraries an earlier in-place build left that no module uses any more (a module
    now compiled into another library)."""
    used = {native["library"](m) for m in modules}
    for m in modules:
        own = m + "__mypyc"
        path = native["extension_path"](own, HERE)
        if own not in used and path is not None:
            path.unlink()


def _members(library: str, modules: list[str]) -> list[str]:
    """The modules (of ``modules``) whose code a library holds."""
    name = library if library.endswith("__mypyc") else library + "__mypyc"
    return [m for m in modules if native["library"](m) == name]


def _newer(ext: object, target: str) -> bool:
    mtime = os.path.getmtime(target)
    return any(os.path.getmtime(s) > mtime for s in [*ext.sources, *ext.depends]
               if os.path.exists(s))  # fmt: skip


_LINK = re.compile(r'PyImport_ImportModuleLevel\("(?P<lib>[\w.]+__mypyc)"')


def _links(ext: object) -> set[str]:
    """The modules whose group libraries a group's C code imports (mypyc's group deps)."""
    found: set[str] = set()
    for src in ext.sources:
        if src.endswith(".c") and os.path.exists(src):
            with open(src, encoding="utf-8") as f:
                found.update(m.group("lib") for m in _LINK.finditer(f.read()))
    return found


if sys.argv[1:2] == [CHILD]:
    _child(sys.argv[2])

# mypyc runs only for the commands that build extensions, not for metadata or an sdist
BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "install", "develop"}
setup(
    ext_modules=_extensions() if BUILDS & set(sys.argv[1:]) else [],
    cmdclass={"build_ext": BuildExt},
)
