"""The metric names agree everywhere: what a run computes, METRIC_KEYS, and docs/metrics.md.

``run --json``, sweep tables and the golden store keep only the keys in ``METRIC_KEYS`` (the
registry in simulator/metrics.py), so a metric computed but not registered would vanish from all
three without an error; one listed but never computed would be an empty column. The runs here are
real ones (both engines, with and without the SSD tier, whose keys are optional), and the docs'
metric tables must define exactly the listed keys.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from daopsim.simulator.results import METRIC_KEYS, OPTIONAL_METRIC_KEYS
from daopsim.simulator.runner import simulate

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"

#: (engine, profile): the rtx4090-990pro-pcie4 profile's host memory (64 GB) holds about two
#: thirds of Mixtral's experts, which turns on the SSD tier and its optional keys
RUNS = {
    "fast": ("fast", "a6000-pcie4"),
    "reference": ("reference", "a6000-pcie4"),
    "fast-ssd": ("fast", "rtx4090-990pro-pcie4"),
    "reference-ssd": ("reference", "rtx4090-990pro-pcie4"),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_a_run_reports_exactly_the_listed_metrics(run: str) -> None:
    """Every key a run computes is in METRIC_KEYS, and every listed key is computed (the
    optional ones exactly when their mechanism, the SSD tier, is on); ``run --json`` carries
    all of them."""
    engine, hw = RUNS[run]
    res = simulate(
        policy="lru",
        trace="ci-small",
        hw=hw,
        cache_ratio=0.2,
        sequences=1,
        engine=engine,
        record=False,
    )
    got = set(res.metrics)
    unlisted = got - set(METRIC_KEYS)
    assert not unlisted, f"computed but not in METRIC_KEYS (dropped from JSON): {unlisted}"
    ssd = "ssd" in run
    want = set(METRIC_KEYS) if ssd else set(METRIC_KEYS) - OPTIONAL_METRIC_KEYS
    assert got == want, f"listed but not computed: {sorted(want - got)}"
    assert set(res.to_dict()["metrics"]) == got


def _metric_tables(text: str) -> list[str]:
    """The keys named in the first cell of each row of the docs' ``| metric |`` tables."""
    keys: list[str] = []
    in_table = False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "metric":
            in_table = True
        elif in_table and not set(cells[0]) <= set("-: "):
            keys += re.findall(r"`([a-z0-9_]+)`", cells[0])
    return keys


def test_the_metrics_glossary_defines_exactly_the_listed_metrics() -> None:
    """docs/metrics.md has a table row for each metric in METRIC_KEYS, once, and no other."""
    keys: list[Any] = _metric_tables(DOC.read_text(encoding="utf-8"))
    missing = [k for k in METRIC_KEYS if k not in keys]
    assert not missing, f"docs/metrics.md has no metric-table row for {missing}"
    unknown = sorted(set(keys) - set(METRIC_KEYS))
    assert not unknown, f"docs/metrics.md defines metrics no run reports: {unknown}"
    twice = sorted({k for k in keys if keys.count(k) > 1})
    assert not twice, f"docs/metrics.md defines {twice} more than once"
