"""Build hook: compile the engine core with mypyc when a C compiler is present.

Everything else about the package is in pyproject.toml. The modules compiled and how the
pure-Python fallback is chosen at import are in simulator/native.py; without a compiler, with
``DAOPSIM_PURE_PYTHON=1`` at build time, or if compiling fails, the package installs uncompiled
and runs the same sources.

mypyc names a module after its path (up through the folders with an ``__init__.py``), so it is
given the paths through the package's symlinks: ``daopsim/simulator/core/ops.py`` compiles as
``daopsim.simulator.core.ops``, the name it is imported by.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
native = runpy.run_path(str(HERE / "simulator" / "native.py"))


def _wanted() -> bool:
    if os.environ.get(native["ENV"], "") not in ("", "0"):
        return False
    return any(shutil.which(c) for c in (os.environ.get("CC", ""), "cc", "gcc", "clang") if c)


def _extensions() -> list:
    if not _wanted():
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        return []
    # daopsim.simulator.core.ops -> daopsim/simulator/core/ops.py (a path through the symlinks)
    paths = [str(Path(*m.split(".")).with_suffix(".py")) for m in native["COMPILED"]]
    exts = mypycify(paths, opt_level="3", group_name=native["GROUP"])
    for ext in exts:
        ext.optional = True  # a failed compile leaves the pure-Python package working
    return exts


class BuildExt(build_ext):
    """build_ext that records the compiled sources' hashes beside the extensions, so a
    source edited after the build makes the import take the pure-Python fallback."""

    def run(self) -> None:
        super().run()
        if not self.extensions:
            return
        inplace = self.inplace or getattr(self, "editable_mode", False)
        root = HERE if inplace else Path(self.build_lib)
        built = [root / self.get_ext_filename(e.name) for e in self.extensions]
        manifest = root / "daopsim" / "simulator" / "core" / native["MANIFEST"]
        if all(p.exists() for p in built):
            manifest.parent.mkdir(parents=True, exist_ok=True)
            manifest.write_text(json.dumps(native["source_hashes"](), indent=1) + "\n")
        elif manifest.exists():
            manifest.unlink()


# mypyc runs only for the commands that build extensions, not for metadata
BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "install", "develop"}
setup(
    ext_modules=_extensions() if BUILDS & set(sys.argv[1:]) else [],
    cmdclass={"build_ext": BuildExt},
)
