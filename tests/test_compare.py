"""``daopsim compare``: several policies (and machines) on one trace, side by side: the table's
numbers are the runs' own, each column's command reproduces it, one figure, --json, errors."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_checks import one_error

import daopsim
from daopsim.simulator.compare import ROWS, render

ARGS = ["--trace", "ci-small", "--sequences", "1", "--workers", "1", "--no-progress"]


@pytest.fixture(scope="module")
def two_machines() -> Any:
    """lru, lfu and DAOP on two machines at a budget only the larger GPU holds."""
    return daopsim.compare(
        ["lru", "lfu", "daop"],
        ["a6000-pcie4", "rtx4090-pcie4"],
        trace="ci-small",
        sequences=1,
        cache_ratio=0.375,
        workers=1,
        progress=False,
    )


def test_one_column_per_configuration(two_machines: Any) -> None:
    cols = two_machines.columns
    assert [(c["hw"], c["policy"]) for c in cols] == [
        (h, p) for h in ("a6000-pcie4", "rtx4090-pcie4") for p in ("lru", "lfu", "daop")
    ]
    # 96 experts fit the 48 GB A6000, not the 24 GB RTX 4090 (at most 55)
    assert {c["status"] for c in cols if c["hw"] == "a6000-pcie4"} == {"ok"}
    skipped = [c for c in cols if c["hw"] == "rtx4090-pcie4"]
    assert {c["status"] for c in skipped} == {"skipped"}
    assert all("does not fit" in c["error"] for c in skipped)


def test_the_numbers_are_the_runs_own(two_machines: Any) -> None:
    for c in two_machines.columns:
        if c["status"] != "ok":
            continue
        r = daopsim.simulate(
            policy=c["policy"], hw=c["hw"], trace="ci-small", sequences=1, cache_ratio=0.375,
            record=False,
        )  # fmt: skip
        for key in ("tokens_per_s", "ttft_s", "hit_rate", "h2d_bytes", "max_slots_held"):
            assert c["metrics"][key] == r.metrics[key], key
        assert c["metrics"]["tokens_per_s"] <= c["metrics"]["bound_tokens_per_s"]
        assert c["runtime"] == r.config["runtime"]["name"]


def test_the_table_is_side_by_side(two_machines: Any) -> None:
    text = render(two_machines)
    lines = text.splitlines()
    assert lines[0].startswith("compare: trace ci-small, 1 sequence, cache ratio 0.375")
    labels = [label for _, label, _, _ in ROWS]
    body = [ln for ln in lines if any(ln.strip().startswith(lb) for lb in labels)]
    assert len(body) == len(ROWS)
    tps = next(ln for ln in body if ln.strip().startswith("tokens/s"))
    assert tps.split()[1:4] == [
        f"{c['metrics']['tokens_per_s']:.4g}" for c in two_machines.columns[:3]
    ]
    assert tps.split()[4:] == ["skipped"] * 3
    assert "rtx4090-pcie4: skipped: does not fit (at most 55)" in text


def test_each_command_reproduces_its_column(two_machines: Any, cli: Callable[..., Any]) -> None:
    for c in two_machines.columns:
        res = cli(*shlex.split(c["command"])[1:], "--json", "--no-bounds", "--no-progress")
        if c["status"] == "skipped":
            assert res.exit_code == 2
            continue
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["metrics"]["tokens_per_s"] == c["metrics"]["tokens_per_s"]


def test_cli_json_and_one_figure(cli: Callable[..., Any], tmp_path: Path) -> None:
    plot = tmp_path / "cmp.png"
    res = cli("compare", "--policies", "lru,belady", *ARGS, "--gpu-experts", "96",
              "--plot", plot, "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [c["policy"] for c in doc["columns"]] == ["lru", "belady"]
    assert doc["gpu_experts"] == 96
    hits = [c["metrics"]["hit_rate"] for c in doc["columns"]]
    assert hits[1] >= hits[0]  # Belady is the per-layer bound of LRU at the same budget
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = daopsim.simulator.compare.figure(daopsim.simulator.compare.Comparison(**{
        k: doc[k] for k in ("trace", "sequences", "dtype", "cache_ratio", "gpu_experts", "runtime")
    }, columns=doc["columns"]))  # fmt: skip
    assert len(fig.axes) == 2
    assert [len(ax.patches) for ax in fig.axes] == [2, 2]  # a bar per configuration


def test_a_small_budget_carries_the_note(cli: Callable[..., Any]) -> None:
    res = cli("compare", "--policies", "lru,lfu", *ARGS, "--gpu-experts", "64")
    assert res.exit_code == 0, res.output
    assert "note: budget of 64 experts is 2 per layer, at most top-k (2)" in res.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--policies", "lru,lru"], "given twice"),
        (["--policies", "lur"], "did you mean 'lru'"),
        (["--policies", ","], "no values"),
        (["--policies", "lru", "--hw", "a6000-pcie4,a6000-pcie4"], "given twice"),
        (["--policies", "lru", "--cache-ratio", "0.3", "--gpu-experts", "3"], "not both"),
        (["--policies", "lru", "--plot", "x.txt"], "--plot"),
        (["--policies", "lru", "--policy-opt", "lru.initial=nope"], "initial"),
    ],
)
def test_bad_input_is_one_line(cli: Callable[..., Any], args: list[str], needle: str) -> None:
    one_error(cli("compare", *args, *ARGS), 2, needle)


def test_run_with_several_policies_points_to_compare(cli: Callable[..., Any]) -> None:
    one_error(cli("run", "--policy", "lru,lfu", *ARGS[:4]), 2, "daopsim compare --policies lru,lfu")
