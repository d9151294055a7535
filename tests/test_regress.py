"""``daopsim regress``: exact ints, tolerant floats, NaN == NaN, new/missing configurations,
--update, --only, --json, and grid files (one block or several, variants, per-layer budgets).

The committed golden store and the built-in grid are checked by tests/test_golden.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from daopsim.simulator.cli import main
from daopsim.simulator.regress import run_cell
from daopsim.simulator.regress_compare import compare, same
from daopsim.simulator.regress_grid import (
    Budget,
    Cell,
    GridBlock,
    PolicySpec,
    config_key,
    load_grid,
)
from daopsim.simulator.testing import make_trace


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
        config_key("tiny.parquet", p, "a6000-pcie4", f"{r:g}")
        for p in ("lru", "lfu")
        for r in (0.25, 0.5)
    }
    # the store records the trace's bytes, so a regenerated trace is reported as such
    assert len(doc["grid"]["blocks"][0]["trace_sha256"]) == 64
    # NaN metrics (no prefetches: precision undefined) are stored as null and compare equal
    lru = doc["configurations"]["tiny.parquet | lru | a6000-pcie4 | 0.25"]
    assert lru["metrics"]["prefetch_precision"] is None
    assert isinstance(lru["metrics"]["decode_hits"], int)


def test_moved_int_fails_with_table(setup: tuple[Path, Path], tmp_path: Path) -> None:
    grid, base = setup

    def bump(c: dict) -> None:
        c["tiny.parquet | lru | a6000-pcie4 | 0.5"]["metrics"]["fetches"] += 1

    res = cli("--grid", grid, "--baseline", edited(base, tmp_path, bump))
    assert res.exit_code == 1
    line = next(x for x in res.output.splitlines() if "metrics.fetches" in x)
    assert line.startswith("tiny.parquet | lru | a6000-pcie4 | 0.5") and "%" in line
    assert "FAILED" in res.output and "--update" in res.output


def test_float_within_tolerance_passes_beyond_fails(setup: tuple[Path, Path], tmp_path: Path):
    grid, base = setup

    def scale(f: float):
        def edit(c: dict) -> None:
            c["tiny.parquet | lfu | a6000-pcie4 | 0.25"]["metrics"]["e2e_s"] *= f

        return edit

    assert cli("--grid", grid, "--baseline", edited(base, tmp_path, scale(1 + 1e-9))).exit_code == 0
    moved = edited(base, tmp_path, scale(1.002))
    res = cli("--grid", grid, "--baseline", moved)
    assert res.exit_code == 1 and "metrics.e2e_s" in res.output and "-0.200%" in res.output
    assert cli("--grid", grid, "--baseline", moved, "--tolerance-time", "0.01").exit_code == 0


def test_new_and_missing_configurations_fail(setup: tuple[Path, Path], tmp_path: Path) -> None:
    grid, base = setup

    def edit(c: dict) -> None:
        del c["tiny.parquet | lfu | a6000-pcie4 | 0.5"]
        c["tiny.parquet | gone | a6000-pcie4 | 0.5"] = {"error": "was here"}

    res = cli("--grid", grid, "--baseline", edited(base, tmp_path, edit), "--json")
    assert res.exit_code == 1
    doc = json.loads(res.output)
    assert not doc["ok"]
    got = {(c["config"], c["status"]) for c in doc["changes"]}
    assert got == {
        ("tiny.parquet | lfu | a6000-pcie4 | 0.5", "new"),
        ("tiny.parquet | gone | a6000-pcie4 | 0.5", "missing"),
    }


def test_update_rewrites_and_prints_diff(setup: tuple[Path, Path], tmp_path: Path) -> None:
    grid, base = setup

    def bump(c: dict) -> None:
        c["tiny.parquet | lru | a6000-pcie4 | 0.25"]["metrics"]["evictions"] += 5

    target = edited(base, tmp_path, bump)
    res = cli("--grid", grid, "--baseline", target, "--update")
    assert res.exit_code == 0 and "metrics.evictions" in res.output and "updated" in res.output
    assert json.loads(target.read_text()) == json.loads(base.read_text())
    assert not list(tmp_path.glob(".*.tmp"))
    assert cli("--grid", grid, "--baseline", target).exit_code == 0


def test_failing_configuration_is_an_outcome() -> None:
    """A budget that does not fit is recorded (and compared) as its one-line error."""
    block = GridBlock(trace="ci-small", policies=["lru"], sequences=1)
    cell = Cell(block, PolicySpec("lru"), "rtx4090-pcie4", Budget(0.5))
    rec = run_cell(cell)
    assert "do not fit" in rec["error"] and "metrics" not in rec
    other = dict(rec, error=rec["error"].replace("55", "56"))
    assert [c.field for c in compare({cell.key: other}, {cell.key: rec}, 1e-6)] == ["error"]


def test_trace_change_is_reported_first(setup: tuple[Path, Path], tmp_path: Path) -> None:
    grid, base = setup
    doc = json.loads(base.read_text())
    doc["grid"]["blocks"][0]["trace_sha256"] = "0" * 64
    moved = tmp_path / "sha.json"
    moved.write_text(json.dumps(doc))
    res = cli("--grid", grid, "--baseline", moved)
    assert res.exit_code == 1
    assert res.output.splitlines()[1].startswith("(grid) tiny.parquet  trace_sha256")


def test_only_runs_and_compares_a_subset(setup: tuple[Path, Path], tmp_path: Path) -> None:
    grid, base = setup

    def bump(c: dict) -> None:
        c["tiny.parquet | lru | a6000-pcie4 | 0.5"]["metrics"]["decode_hits"] += 1

    target = edited(base, tmp_path, bump)
    res = cli("--grid", grid, "--baseline", target, "--only", "* | lfu | *")
    assert res.exit_code == 0 and "2 configurations (--only)" in res.output, res.output
    res = cli("--grid", grid, "--baseline", target, "--only", "*lru*0.5")
    assert res.exit_code == 1 and "metrics.decode_hits" in res.output
    res = cli("--grid", grid, "--baseline", target, "--only", "*nope*")
    assert res.exit_code == 2 and "matches no configuration" in res.stderr
    res = cli("--grid", grid, "--baseline", target, "--only", "*lru*", "--update")
    assert res.exit_code == 2 and "--update rewrites every configuration" in res.stderr
    assert (
        json.loads(target.read_text())["configurations"]
        != json.loads(base.read_text())["configurations"]
    )


def test_blocks_variants_and_per_layer_budgets(tmp_path: Path) -> None:
    """Top-level keys are defaults for each [[block]]; variants get their own keys."""
    make_trace(tmp_path / "a.parquet", sequences=3, prefill=3, decode=4, seed=2)
    make_trace(tmp_path / "b.parquet", sequences=3, prefill=3, decode=4, seed=3)
    (tmp_path / "grid.toml").write_text(
        'profiles = ["a6000-pcie4"]\nexperts_per_layer = [3]\nbaseline = "store.json"\n'
        '[[block]]\ntrace = "a.parquet"\npolicies = ["lru"]\n'
        'variants = [{ policy = "lru", initial = "popular" }]\n'
        '[[block]]\ntrace = "b.parquet"\npolicies = ["lfu"]\nexperts_per_layer = [3, 4]\n'
    )
    grid = load_grid(tmp_path / "grid.toml")
    assert [c.key for c in grid.cells()] == [
        "a.parquet | lru | a6000-pcie4 | 3/layer",
        "a.parquet | lru(initial=popular) | a6000-pcie4 | 3/layer",
        "b.parquet | lfu | a6000-pcie4 | 3/layer",
        "b.parquet | lfu | a6000-pcie4 | 4/layer",
    ]
    res = cli("--grid", tmp_path / "grid.toml", "--update")
    assert res.exit_code == 0, res.output + res.stderr
    doc = json.loads((tmp_path / "store.json").read_text())
    recs = doc["configurations"]
    lru = recs["a.parquet | lru | a6000-pcie4 | 3/layer"]
    pop = recs["a.parquet | lru(initial=popular) | a6000-pcie4 | 3/layer"]
    assert lru["gpu_experts"] == 3 * 4 and pop["policy_options"] == {"initial": "popular"}
    assert doc["grid"]["blocks"][0]["variants"] == [{"policy": "lru", "initial": "popular"}]
    assert cli("--grid", tmp_path / "grid.toml").exit_code == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[block]]\ntrace = "t.parquet"\nfoo = 1\n', "[[block]] #1: unknown key 'foo'"),
        ('trace = "t.parquet"\nvariants = [{ policy = "lru" }]\n', "at least one option"),
        ('trace = "t.parquet"\nexperts_per_layer = [0]\n', "not a positive integer"),
        ('trace = "t.parquet"\nexperts_per_layer = [9]\n', "exceeds the 8 experts per layer"),
        (
            'trace = "t.parquet"\npolicies = ["lru"]\n[[block]]\n[[block]]\n',
            "appears twice in the grid",
        ),
        (
            'trace = "t.parquet"\n[[block]]\nsequences = 1\n[[block]]\nsequences = 2\n',
            "different files, sequences or seeds",
        ),
        ('trace = "t.parquet"\nvariants = [{ policy = "lru", bogus = 1 }]\n', "no option 'bogus'"),
    ],
)
def test_grid_file_mistakes_are_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    make_trace(tmp_path / "t.parquet", sequences=2, prefill=2, decode=2, seed=1)
    (tmp_path / "grid.toml").write_text(text)
    res = cli("--grid", tmp_path / "grid.toml", "--baseline", tmp_path / "s.json", "--update")
    assert res.exit_code == 2 and message in res.stderr, res.stderr
    assert res.stderr.startswith("error: ") and "Traceback" not in res.stderr


def test_old_or_foreign_store_is_rejected(setup: tuple[Path, Path], tmp_path: Path) -> None:
    grid, _ = setup
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "daopsim-regress/1", "grid": {}, "configurations": {}}))
    res = cli("--grid", grid, "--baseline", old)
    assert res.exit_code == 2 and "regress --update" in res.stderr
    res = cli("--grid", grid, "--baseline", old, "--update")
    assert res.exit_code == 0 and "no readable store to compare with" in res.output
    assert cli("--grid", grid, "--baseline", old).exit_code == 0


def test_trace_option_needs_a_one_block_grid(setup: tuple[Path, Path], tmp_path: Path) -> None:
    res = cli("--trace", "ci-small", "--baseline", tmp_path / "x.json")
    assert res.exit_code == 2 and "one-block grid" in res.stderr
    grid, _ = setup
    other = make_trace(tmp_path / "other.parquet", sequences=3, prefill=3, decode=4, seed=9)
    res = cli("--grid", grid, "--trace", other, "--baseline", tmp_path / "o.json", "--update")
    assert res.exit_code == 0, res.output + res.stderr
    keys = json.loads((tmp_path / "o.json").read_text())["configurations"]
    assert all(k.startswith(f"{other} | ") for k in keys)
