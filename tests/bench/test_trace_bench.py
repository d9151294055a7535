"""Trace reading at scale (run with `make bench`): 10 million rows, flat memory, seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from daopsim.simulator.testing import make_trace

# Mixtral shape: 32 MoE layers, so 312,600 tokens make 10,003,200 rows.
_PROBE = """
import json, resource, sys, time
from daopsim.simulator.trace import validate_trace
from daopsim.simulator.stats import trace_stats
path, what = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if what == "validate":
    rows = validate_trace(path).counts["rows"]
else:  # the streaming statistics; the hit-rate curves are a replay, timed separately
    rows = trace_stats(path, curves=what == "curves")["sequences"]
from daopsim.simulator.testing import peak_rss_bytes
print(json.dumps({"s": time.perf_counter() - t, "rss_mb": peak_rss_bytes() / 2**20, "n": rows}))
"""


def _probe(path: Path, what: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path), what], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("bench")
    small = make_trace(folder / "1m.parquet", "mixtral-8x7b", sequences=30, prefill=500, decode=542)
    big = make_trace(folder / "10m.parquet", "mixtral-8x7b", sequences=300, prefill=500, decode=542)
    return small, big


@pytest.mark.bench
def test_validate_10m_rows_fast_and_flat(traces: tuple[Path, Path]) -> None:
    small, big = traces
    a, b = _probe(small, "validate"), _probe(big, "validate")
    assert b["n"] == 10_003_200
    assert b["s"] < 20.0, f"validate took {b['s']:.1f} s"
    # ten times the rows must not mean (much) more memory: streaming by row group
    assert b["rss_mb"] < a["rss_mb"] + 100, (a, b)


@pytest.mark.bench
def test_stats_10m_rows_fast_and_flat(traces: tuple[Path, Path]) -> None:
    small, big = traces
    a, b = _probe(small, "stats"), _probe(big, "stats")
    assert b["n"] == 300
    assert b["s"] < 30.0, f"stats took {b['s']:.1f} s"
    assert b["rss_mb"] < a["rss_mb"] + 100, (a, b)


@pytest.mark.bench
def test_stats_with_curves_on_the_bundled_mixtral_trace_in_seconds() -> None:
    """`trace stats` default (LRU and Belady curves at every capacity) on 8 x 768 tokens."""
    from daopsim.simulator.data import resolve_trace

    b = _probe(resolve_trace("mixtral-8x7b"), "curves")
    assert b["n"] == 8
    assert b["s"] < 15.0, f"stats with curves took {b['s']:.1f} s"
