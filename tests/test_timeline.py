"""Recording the timeline: in memory, or streamed to Parquet as the run goes.

A streamed timeline (``simulate(record=path)``, ``daopsim run --out``) must be the in-memory
one row for row, however its rows fall into chunks and sorted runs, and a run that fails must
leave no file behind (simulator/recorder.py).
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from daopsim.policies.base import Plan, View
from daopsim.policies.registry import get_policy_class
from daopsim.simulator.errors import OutputError, PolicyError
from daopsim.simulator.recorder import Recorder, read_timeline
from daopsim.simulator.runner import simulate
from daopsim.simulator.serving_config import serving_config

SETTINGS: dict[str, dict[str, Any]] = {
    "daop": {"policy": "daop", "sequences": 2},
    "lru-2-gpus-pipeline": {
        "policy": "lru",
        "hw": "2x-rtx3090-nvlink",
        "gpus": 2,
        "multi_gpu": "pipeline",
        "gpu_experts": 40,
        "sequences": 1,
    },
    "fiddler-batched": {
        "policy": "fiddler",
        "sequences": 4,
        "serving": serving_config(batch=4),
    },
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_streamed_timeline_is_the_in_memory_one_row_for_row(name: str, tmp_path: Path) -> None:
    """Small chunks and runs (dozens of sorted runs merged) give the same rows, in the same
    order, with the same dtypes, as the timeline kept in memory; so does the file itself."""
    kw = {"trace": "ci-small", **SETTINGS[name]}
    mem = simulate(**kw)
    path = tmp_path / "timeline.parquet"
    streamed = simulate(record=Recorder(path, chunk_rows=64, run_rows=512), **kw)
    assert streamed.timeline_file == path and mem.timeline_file is None
    assert len(mem.timeline) > 1000
    pd.testing.assert_frame_equal(streamed.timeline, mem.timeline)
    pd.testing.assert_frame_equal(streamed.occupancy, mem.occupancy)
    # read with plain pandas, the file is what writing the in-memory timeline gives
    mem.timeline.to_parquet(tmp_path / "mem.parquet", index=False)
    pd.testing.assert_frame_equal(pd.read_parquet(path), pd.read_parquet(tmp_path / "mem.parquet"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mem.parquet", "timeline.parquet"]


def test_default_chunks_stream_the_same_rows(tmp_path: Path) -> None:
    """With the default chunk and run sizes (one run here) the streamed rows are the same."""
    mem = simulate(policy="lru", trace="ci-small", sequences=1)
    streamed = simulate(policy="lru", trace="ci-small", sequences=1, record=tmp_path / "t.parquet")
    pd.testing.assert_frame_equal(streamed.timeline, mem.timeline)
    pd.testing.assert_frame_equal(streamed.occupancy, mem.occupancy)


class _FailsLate(get_policy_class("lru")):  # type: ignore[misc,valid-type]
    """LRU that raises once the run has recorded a few thousand rows."""

    name = "lru"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.calls = 0

    def decode_layer(self, view: View) -> Plan:
        self.calls += 1
        if self.calls > 600:
            raise RuntimeError("policy failed")
        return super().decode_layer(view)


def test_a_failed_run_leaves_no_timeline_file(tmp_path: Path) -> None:
    """The sorted runs already written are removed and nothing appears at the destination."""
    path = tmp_path / "timeline.parquet"
    rec = Recorder(path, chunk_rows=50, run_rows=200)
    with pytest.raises(PolicyError, match="policy failed"):
        simulate(policy=_FailsLate(), trace="ci-small", sequences=1, record=rec)
    assert rec.rows_recorded > 1000  # runs had been spilled to a temporary file
    assert list(tmp_path.iterdir()) == []


def test_record_to_a_folder_is_refused_before_the_run(tmp_path: Path) -> None:
    """A destination that cannot become a file fails at once, in one line."""
    with pytest.raises(OutputError, match="is a directory"):
        simulate(policy="lru", trace="ci-small", sequences=1, record=tmp_path)


def test_a_streamed_run_writes_the_same_output_set(tmp_path: Path) -> None:
    """``RunResult.write`` of a streamed run (its timeline never loaded) gives the files a run
    in memory gives: the timeline, the Perfetto trace and the Gantt chart; afterwards the
    result reads its timeline from the set written."""
    kw = {"policy": "fiddler", "trace": "ci-small", "sequences": 1}
    mem = simulate(**kw)
    streamed = simulate(record=tmp_path / "scratch" / "timeline.parquet", **kw)
    mem.write(tmp_path / "a")
    streamed.write(tmp_path / "b")
    assert "_timeline" not in streamed.__dict__ or isinstance(streamed.__dict__["_timeline"], Path)
    pd.testing.assert_frame_equal(
        read_timeline(tmp_path / "a" / "timeline.parquet"),
        read_timeline(tmp_path / "b" / "timeline.parquet"),
    )
    for name in ("gantt.png", "hit_rate.png", "metrics.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    a = gzip.decompress((tmp_path / "a" / "trace.perfetto.json.gz").read_bytes())
    b = gzip.decompress((tmp_path / "b" / "trace.perfetto.json.gz").read_bytes())
    assert a == b
    assert streamed.timeline_file == tmp_path / "b" / "timeline.parquet"
    pd.testing.assert_frame_equal(streamed.timeline, mem.timeline)
