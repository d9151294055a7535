"""Determinism: the same inputs give byte-identical metrics JSON across processes (different
PYTHONHASHSEED), with and without the timeline recorder, and across sweep executors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import make_trace

SCRIPT = """
import sys
from daopsim.simulator.runner import simulate
for policy in ("daop", "lfu", "belady"):
    r = simulate(policy=policy, trace=sys.argv[1], cache_ratio=0.25, record=False)
    sys.stdout.write(r.to_json() + "\\n")
"""


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("determinism") / "t.parquet"
    return make_trace(path, sequences=4, prefill=5, decode=12, seed=4)


def _run(trace: Path, hashseed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(trace)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout


def test_identical_across_processes_and_hash_seeds(trace: Path) -> None:
    a, b = _run(trace, "1"), _run(trace, "4242")
    assert a == b
    assert a.count('"metrics"') == 3


@pytest.mark.parametrize("policy", ["daop", "lru", "fiddler", "stream-all"])
def test_identical_with_and_without_recording(trace: Path, policy: str) -> None:
    on = simulate(policy=policy, trace=trace, cache_ratio=0.25, record=True)
    off = simulate(policy=policy, trace=trace, cache_ratio=0.25, record=False)
    assert on.timeline is not None and off.timeline is None
    assert on.to_json() == off.to_json()


def _sweep_metrics(trace: Path, tmp: Path, **kw: object) -> list[str]:
    from daopsim.simulator.results import METRIC_KEYS
    from daopsim.simulator.sweep import run_sweep

    grid = {"policies": ["daop", "lru"], "traces": [str(trace)], "cache_ratios": [0.25, 0.5]}
    df, summary = run_sweep(grid, progress=False, out=tmp / "s.parquet", **kw)
    assert summary.failed == 0
    rows = sorted(df.to_dict("records"), key=lambda r: (r["policy"], r["cache_ratio"]))
    return [
        json.dumps({k: r.get(k) for k in METRIC_KEYS}, sort_keys=True, default=str) for r in rows
    ]


def test_sweep_identical_across_workers_and_executors(trace: Path, tmp_path: Path) -> None:
    one = _sweep_metrics(trace, tmp_path / "a", workers=1)
    two = _sweep_metrics(trace, tmp_path / "b", workers=2)
    dask = _sweep_metrics(trace, tmp_path / "c", workers=2, executor="dask")
    assert one == two == dask
    # and the sweep's numbers are simulate()'s numbers
    direct = simulate(policy="daop", trace=trace, cache_ratio=0.25, record=False)
    assert json.loads(one[0])["e2e_s"] == direct.metrics["e2e_s"]
