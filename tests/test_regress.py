"""``daopsim regress``: exact ints, tolerant floats, NaN == NaN, new/missing configurations,
--update, --json, custom grids, and the committed baseline matching the code."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from simulator.cli import main
from simulator.regress import (
    DEFAULT_PROFILES,
    DEFAULT_RATIOS,
    RegressGrid,
    builtin_policies,
    compare,
    config_key,
    run_one,
    same,
)
from simulator.testing import make_trace

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "baselines" / "policy-metrics.json"


def cli(*args: object) -> Result:
    return CliRunner().invoke(main, ["regress", "--no-progress", *map(str, args)])


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small grid file (tiny trace, 2 policies, 1 machine, 2 ratios) and its fresh baseline."""
    root = tmp_path_factory.mktemp("regress")
    make_trace(root / "tiny.parquet", sequences=3, prefill=3, decode=4, seed=2)
    grid = root / "grid.toml"
    grid.write_text(
        'trace = "tiny.parquet"\npolicies = ["lru", "lfu"]\nprofiles = ["a6000-pcie4"]\n'
        'cache_ratios = [0.25, 0.5]\nbaseline = "base.json"\n'
    )
    res = cli("--grid", grid, "--update")
    assert res.exit_code == 0, res.output + res.stderr
    return grid, root / "base.json"


def edited(base: Path, tmp_path: Path, edit) -> Path:
    doc = json.loads(base.read_text())
    edit(doc["configurations"])
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(doc))
    return out


def test_same_rules() -> None:
    assert same(3, 3, 0.5) and not same(3, 4, 0.5)  # ints exact whatever the tolerance
    assert same(1.0, 1.0 + 1e-9, 1e-6) and not same(1.0, 1.001, 1e-6)
    assert same(None, None, 1e-6) and not same(None, 0.0, 1e-6)
    assert same(math.nan, math.nan, 1e-6)
    assert not same(True, 1, 1e-6) and same("x", "x", 0) and not same("x", "y", 0)


def test_unchanged_passes(setup: tuple[Path, Path]) -> None:
    grid, base = setup
    res = cli("--grid", grid)
    assert res.exit_code == 0, res.output
    assert "nothing moved" in res.output and "4 configurations" in res.output
    doc = json.loads(base.read_text())
    assert set(doc["configurations"]) == {
        config_key(p, "a6000-pcie4", r) for p in ("lru", "lfu") for r in (0.25, 0.5)
    }
    # NaN metrics (no prefetches: precision undefined) are stored as null and compare equal
    assert (
        doc["configurations"]["lru | a6000-pcie4 | 0.25"]["metrics"]["prefetch_precision"] is None
    )


def test_moved_int_fails_with_table(setup: tuple[Path, Path], tmp_path: Path) -> None:
    grid, base = setup

    def bump(c: dict) -> None:
        c["lru | a6000-pcie4 | 0.5"]["metrics"]["fetches"] += 1

    res = cli("--grid", grid, "--baseline", edited(base, tmp_path, bump))
    assert res.exit_code == 1
    line = next(x for x in res.output.splitlines() if "metrics.fetches" in x)
    assert line.startswith("lru | a6000-pcie4 | 0.5") and "%" in line
    assert "FAILED" in res.output and "--update" in res.output


def test_float_within_tolerance_passes_beyond_fails(setup: tuple[Path, Path], tmp_path: Path):
    grid, base = setup

    def scale(f: float):
        def edit(c: dict) -> None:
            c["lfu | a6000-pcie4 | 0.25"]["metrics"]["e2e_s"] *= f

        return edit

    assert cli("--grid", grid, "--baseline", edited(base, tmp_path, scale(1 + 1e-9))).exit_code == 0
    moved = edited(base, tmp_path, scale(1.002))
    res = cli("--grid", grid, "--baseline", moved)
    assert res.exit_code == 1 and "metrics.e2e_s" in res.output and "-0.200%" in res.output
    assert cli("--grid", grid, "--baseline", moved, "--tolerance-time", "0.01").exit_code == 0


def test_new_and_missing_configurations_fail(setup: tuple[Path, Path], tmp_path: Path) -> None:
    grid, base = setup

    def edit(c: dict) -> None:
        del c["lfu | a6000-pcie4 | 0.5"]
        c["gone | a6000-pcie4 | 0.5"] = {"error": "was here"}

    res = cli("--grid", grid, "--baseline", edited(base, tmp_path, edit), "--json")
    assert res.exit_code == 1
    doc = json.loads(res.output)
    assert not doc["ok"]
    got = {(c["config"], c["status"]) for c in doc["changes"]}
    assert got == {("lfu | a6000-pcie4 | 0.5", "new"), ("gone | a6000-pcie4 | 0.5", "missing")}


def test_update_rewrites_and_prints_diff(setup: tuple[Path, Path], tmp_path: Path) -> None:
    grid, base = setup

    def bump(c: dict) -> None:
        c["lru | a6000-pcie4 | 0.25"]["metrics"]["evictions"] += 5

    target = edited(base, tmp_path, bump)
    res = cli("--grid", grid, "--baseline", target, "--update")
    assert res.exit_code == 0 and "metrics.evictions" in res.output and "updated" in res.output
    assert json.loads(target.read_text()) == json.loads(base.read_text())
    assert not list(tmp_path.glob(".*.tmp"))
    assert cli("--grid", grid, "--baseline", target).exit_code == 0


def test_failing_configuration_is_an_outcome(tmp_path: Path) -> None:
    """A budget that does not fit is recorded (and compared) as its one-line error."""
    grid = RegressGrid(policies=["lru"], profiles=["rtx4090-pcie4"], cache_ratios=[0.5])
    rec = run_one(grid, "lru", "rtx4090-pcie4", 0.5)
    assert "do not fit" in rec["error"] and "metrics" not in rec
    other = dict(rec, error=rec["error"].replace("55", "56"))
    key = config_key("lru", "rtx4090-pcie4", 0.5)
    assert [c.field for c in compare({key: other}, {key: rec}, 1e-6)] == ["error"]


def test_committed_baseline_covers_the_default_grid() -> None:
    doc = json.loads(COMMITTED.read_text())
    expected = {
        config_key(p, hw, r)
        for p in builtin_policies()
        for hw in DEFAULT_PROFILES
        for r in DEFAULT_RATIOS
    }
    # a new built-in policy fails `daopsim regress` as "new" until the baseline is updated
    assert set(doc["configurations"]) == expected


@pytest.mark.parametrize(
    ("policy", "hw", "ratio"),
    [
        ("lru", "a6000-pcie4", 0.375),
        ("daop", "rtx4090-pcie4", 0.1875),
        ("fiddler", "rtx4090-pcie4", 0.375),
    ],
)
def test_committed_baseline_matches_the_code(policy: str, hw: str, ratio: float) -> None:
    """A few cells of the committed baseline, re-run (the full check is `make test`'s regress)."""
    doc = json.loads(COMMITTED.read_text())
    key = config_key(policy, hw, ratio)
    current = run_one(RegressGrid(), policy, hw, ratio)
    assert compare({key: doc["configurations"][key]}, {key: current}, 1e-6) == []
