"""The compiled build of the engine core, and its pure-Python fallback.

The modules in :data:`COMPILED` are typed for mypyc, which compiles them to C extensions when
the package is built on a machine with a C compiler (``setup.py``; as mypy and black ship
themselves). The same sources always run uncompiled too: an import of one of them takes its
``.py`` source instead of the extension when

* the environment sets ``DAOPSIM_PURE_PYTHON=1`` (to check or debug the fallback), or
* the build did not produce every extension, or a source changed since the build (the
  recorded SHA-256 of each source no longer matches), so a stale extension never runs.

Both give identical results to the last bit (tests/test_compiled.py). The choice is made once
per process, for all the modules together; :func:`status` tells which one was made and why.
This module imports nothing outside the standard library: ``setup.py`` reads it at build time.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

#: the folder holding ``simulator/`` and ``policies/``: the ``daopsim`` package when this module is
#: imported as ``daopsim.simulator.native`` (installed, or through a checkout's symlinks
#: daopsim/simulator -> ../simulator), the repository root when setup.py reads this file. Not
#: resolved: the symlinks are how a checkout's files get their ``daopsim.`` names.
_BASE = Path(__file__).absolute().parent.parent
#: policy modules that stay interpreted: the registry (plugins, entry points) and the shim
_INTERPRETED_POLICIES = ("__init__", "_mypyc", "registry")
#: the modules mypyc compiles, in one group (their extension shares one runtime library): the
#: engine core (first: the build's record lies beside the first module), the heap its queues
#: use, the policy boundary and every built-in policy with the policy API they share
COMPILED = (
    "daopsim.simulator.core.ops",
    "daopsim.simulator.core.resources",
    "daopsim.simulator.core.machine",
    "daopsim.simulator.core.executor",
    "daopsim.simulator.core.apply",
    "daopsim.simulator.core.loop",
    "daopsim.simulator.heap",
    "daopsim.simulator.boundary",
    *sorted(
        f"daopsim.policies.{p.stem}"
        for p in (_BASE / "policies").glob("*.py")
        if p.stem not in _INTERPRETED_POLICIES
    ),
)
#: the group's shared library (a module inside the package, so the wheel adds no top name)
GROUP = "daopsim.simulator.core.native"
#: the build's record of each compiled source's SHA-256, beside the extensions
MANIFEST = "native-build.json"
#: set to 1 to run the pure-Python sources even when a compiled build is present
ENV = "DAOPSIM_PURE_PYTHON"

_choice: tuple[bool, str] | None = None


def source_path(module: str) -> Path:
    """The ``.py`` source of a compiled module (``daopsim.simulator.core.ops`` is
    ``simulator/core/ops.py`` inside the ``daopsim`` package or the repository)."""
    package, _, rest = module.partition(".")
    if package != "daopsim":
        raise ValueError(f"not a daopsim module: {module!r}")
    return _BASE.joinpath(*rest.split(".")).with_suffix(".py")


def module_source(module: ModuleType) -> Path | None:
    """The ``.py`` source of a loaded module, compiled or not (a compiled module's
    ``__file__`` names its build group's library); None when it has no file."""
    if module.__name__ in COMPILED:
        return source_path(module.__name__)
    file = getattr(module, "__file__", None)
    return Path(file) if file and file.endswith(".py") else None


def source_hashes() -> dict[str, str]:
    """SHA-256 of each compiled module's source, as the build records them."""
    return {m: hashlib.sha256(source_path(m).read_bytes()).hexdigest() for m in COMPILED}


def _extension(module: str) -> Path | None:
    parent = source_path(module).parent
    stem = module.rsplit(".", 1)[1]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = parent / (stem + suffix)
        if p.exists():
            return p
    return None


def _decide() -> tuple[bool, str]:
    """Whether to import the extensions, and why (or why not)."""
    if os.environ.get(ENV, "") not in ("", "0"):
        return False, f"{ENV} is set"
    manifest = source_path(COMPILED[0]).parent / MANIFEST
    if not manifest.exists():
        return False, "no compiled build (pure Python)"
    missing = [m for m in (*COMPILED, GROUP + "__mypyc") if _extension(m) is None]
    if missing:
        return False, f"compiled build incomplete (no extension for {missing[0]})"
    try:
        recorded = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return False, "compiled build record unreadable"
    if recorded != source_hashes():
        return False, "sources changed since the compiled build (run `make native`)"
    return True, "compiled (mypyc)"


def status() -> tuple[bool, str]:
    """(whether the compiled extensions run, a short reason), decided once per process."""
    global _choice
    if _choice is None:
        _choice = _decide()
    return _choice


class _PureFinder(importlib.abc.MetaPathFinder):
    """Imports the compiled modules from their sources when the extensions are not used."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED or status()[0]:
            return None
        return importlib.util.spec_from_file_location(fullname, source_path(fullname))


def install() -> None:
    """Put the fallback's finder ahead of the default import machinery (once)."""
    if not any(isinstance(f, _PureFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PureFinder())
