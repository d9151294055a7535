"""Mutation check of the golden store: ``daopsim regress`` must fail on each known mutant.

Each mutant is one exact edit of the source (file, old snippet, new snippet) that a plausible
bug would make. The test copies the source packages to a temporary folder, applies one mutant,
and runs ``daopsim regress`` from the copy (``PYTHONPATH`` pointing at it) against the real
golden store, on the configurations that concern the mutant. Regress must exit 1 and report
moved values; the unmutated copy must pass on the same configurations, so the check can fail.

A mutant whose old snippet is no longer in its file fails loudly: after a refactor, retarget
the snippet at the code that now holds the rule rather than letting the mutant pass silently.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from simulator.regress import default_store

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    """One edit of the source and the store configurations that must catch it."""

    name: str
    file: str  #: relative to the repository root
    old: str
    new: str
    only: tuple[str, ...]  #: ``regress --only`` globs


MUTANTS = (
    Mutant(
        "lru-evicts-most-recent",
        "policies/lru.py",
        "        for e in self.order[layer]:\n            if e not in protected:",
        "        for e in reversed(self.order[layer]):\n            if e not in protected:",
        ("* | lru | *",),
    ),
    # the copy lanes are built by the Machine (one lane for both directions with one engine)
    Mutant(
        "copy-engines-ignored",
        "simulator/machine.py",
        "        if costs.hw.link.copy_engines >= 2:",
        "        if True:  # mutant: always two copy lanes",
        ("* | * | a6000-1ce-pcie4 | *",),
    ),
    Mutant(
        "daop-exact-fallback-ignored",
        "policies/daop.py",
        'self.exact_fallback = bool(o["exact_fallback"])',
        "self.exact_fallback = False",
        ("* | daop(exact_fallback=true) | *",),
    ),
    Mutant(
        "mixtral-offloading-prefetch-ignored",
        "policies/mixtral_offloading.py",
        'self.do_prefetch = bool(self.options["prefetch"])',
        "self.do_prefetch = False",
        ("* | mixtral-offloading(prefetch=true) | *",),
    ),
)


def _copy_file(src: str, dst: str) -> None:
    # traces are large read-only data: link them instead of copying megabytes per mutant
    if src.endswith(".parquet"):
        os.symlink(src, dst)
    else:
        shutil.copy2(src, dst)


def source_copy(dest: Path) -> Path:
    """Every top-level Python package of the repository (tests excluded), copied to ``dest``."""
    dest.mkdir()
    for pkg in sorted(p.parent for p in REPO.glob("*/__init__.py")):
        if pkg.name != "tests":
            shutil.copytree(
                pkg,
                dest / pkg.name,
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                copy_function=_copy_file,
            )
    return dest


def apply(root: Path, mutant: Mutant) -> None:
    """Edit the copy; fail loudly when the snippet is missing or ambiguous."""
    path = root / mutant.file
    if not path.is_file():
        pytest.fail(f"mutant {mutant.name}: {mutant.file} does not exist; retarget the mutant")
    text = path.read_text(encoding="utf-8")
    n = text.count(mutant.old)
    if n != 1:
        pytest.fail(
            f"mutant {mutant.name}: the old snippet occurs {n} times in {mutant.file} (must be "
            f"exactly once); retarget it at the code that now holds the rule:\n{mutant.old}"
        )
    path.write_text(text.replace(mutant.old, mutant.new), encoding="utf-8")


def regress(root: Path, only: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """``daopsim regress`` run from the copy against the real golden store."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    args = [sys.executable, "-m", "simulator.cli", "regress", "--no-progress"]
    args += ["--baseline", str(default_store()), *(f"--only={g}" for g in only)]
    return subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_mutant_snippet_is_in_the_source(mutant: Mutant) -> None:
    """Fast and loud: a refactor that moves a rule must retarget its mutant."""
    text = (REPO / mutant.file).read_text(encoding="utf-8")
    assert text.count(mutant.old) == 1, f"mutant {mutant.name}: retarget {mutant.file}"


def test_unmutated_copy_passes(tmp_path: Path) -> None:
    """The copy is what runs, and without a mutant regress passes on every mutant's cells."""
    root = source_copy(tmp_path / "src")
    probe = subprocess.run(
        [sys.executable, "-c", "import simulator, policies; print(simulator.__file__)"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(probe.stdout.strip()).is_relative_to(root)
    res = regress(root, tuple(g for m in MUTANTS for g in m.only))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "nothing moved" in res.stdout


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_regress_kills_the_mutant(mutant: Mutant, tmp_path: Path) -> None:
    root = source_copy(tmp_path / "src")
    apply(root, mutant)
    res = regress(root, mutant.only)
    assert res.returncode == 1, f"mutant {mutant.name} survived:\n{res.stdout}{res.stderr}"
    assert "regress FAILED" in res.stdout and "metrics." in res.stdout, res.stdout
