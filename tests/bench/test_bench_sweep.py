"""Sweep scaling (run by `make bench`): with 2 local worker processes a 16-configuration sweep
runs at least 1.6x faster than with 1 (which runs in-process). Needs 2 free cores."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pandas.testing as pdt
import pytest

from daopsim.simulator.grid import Grid
from daopsim.simulator.sweep import sweep
from daopsim.simulator.testing import make_trace

pytestmark = pytest.mark.bench

TARGET_SPEEDUP = 1.6


def test_two_workers_speedup(tmp_path: Path) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs at least 2 CPU cores")
    trace = make_trace(
        tmp_path / "bench.parquet", model="mixtral-8x7b", sequences=4, prefill=16, decode=1536
    )
    # 2 policies x 2 machines x 4 cache ratios = 16 configurations, each one to two seconds
    grid = Grid(
        policies=["lru", "static"],
        hw=["a6000-pcie4", "a100-80g-pcie4"],
        traces=[str(trace)],
        cache_ratios=[0.125, 0.1875, 0.25, 0.3125],
    )
    t0 = time.perf_counter()
    one = sweep(grid, workers=1, progress=False)
    t1 = time.perf_counter()
    two = sweep(grid, workers=2, progress=False)
    t2 = time.perf_counter()
    assert len(one) == 16 and (one["status"] == "ok").all()
    pdt.assert_frame_equal(one, two)
    serial, parallel = t1 - t0, t2 - t1
    ratio = serial / parallel
    print(f"\nsweep of 16: 1 worker {serial:.2f} s, 2 workers {parallel:.2f} s: {ratio:.2f}x")
    assert ratio >= TARGET_SPEEDUP, f"2 workers only {ratio:.2f}x faster (target {TARGET_SPEEDUP})"
