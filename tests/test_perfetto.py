"""The Perfetto export (simulator/perfetto.py) against the plain one-dict-per-event builder.

The export assembles event text block by block; the oracle
(``daopsim.simulator.testing.perfetto_reference``) builds every event as a dict over all rows at
once and lets ``json.dumps`` write it. They must give the same events, and the same text.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from daopsim.simulator.perfetto import write_events
from daopsim.simulator.results import RunResult, _json_safe
from daopsim.simulator.runner import simulate
from daopsim.simulator.serving_config import serving_config
from daopsim.simulator.testing import perfetto_reference


def _meta(r: RunResult) -> dict[str, Any]:
    return _json_safe({k: v for k, v in r.config.items() if k != "cost_sources"})


def _text(source: Any, r: RunResult, batch_rows: int) -> bytes:
    out = io.BytesIO()
    write_events(out, source, r.occupancy, _meta(r), batch_rows=batch_rows)
    return out.getvalue()


@pytest.fixture(scope="module")
def runs() -> dict[str, RunResult]:
    return {
        "daop": simulate(policy="daop", trace="ci-small", sequences=1),
        "served": simulate(
            policy="fiddler",
            trace="ci-small",
            sequences=4,
            serving=serving_config(batch=4),
        ),
        "two-gpus": simulate(
            policy="lru",
            hw="2x-rtx4090-pcie4",
            gpus=2,
            gpu_experts=40,
            trace="ci-small",
            sequences=1,
        ),
    }


@pytest.mark.parametrize("name", ["daop", "served", "two-gpus"])
@pytest.mark.parametrize("batch_rows", [3, 1000, 1 << 16])
def test_events_and_text_match_the_plain_builder(
    runs: dict[str, RunResult], name: str, batch_rows: int
) -> None:
    """Any block size gives the oracle's document: equal parsed events, equal bytes."""
    r = runs[name]
    want = perfetto_reference(r.timeline, r.occupancy, _meta(r))
    got = _text(r.timeline, r, batch_rows)
    assert json.loads(got) == want
    assert got == json.dumps(want, separators=(",", ":")).encode()
    clipped = [e for e in want["traceEvents"] if e["ph"] == "X"]
    assert len(clipped) == len(r.timeline)


def test_rows_out_of_timeline_order_are_clipped_as_the_builder_does(
    runs: dict[str, RunResult],
) -> None:
    """A timeline whose rows were reordered (a user's edit) still gets each track's slices
    clipped against the next slice on that track, events in the frame's order."""
    r = runs["daop"]
    rng = np.random.default_rng(3)
    shuffled = r.timeline.iloc[rng.permutation(len(r.timeline))].reset_index(drop=True)
    want = perfetto_reference(shuffled, r.occupancy, _meta(r))
    assert json.loads(_text(shuffled, r, 500)) == want


def test_slices_on_a_track_never_overlap_after_clipping(runs: dict[str, RunResult]) -> None:
    """The clipping is real: some slices are shortened and none overlaps the next on its
    track (what the oracle guarantees, checked on the export's own events)."""
    r = runs["daop"]
    events = json.loads(_text(r.timeline, r, 700))["traceEvents"]
    spans = pd.DataFrame([(e["tid"], e["ts"], e["dur"]) for e in events if e["ph"] == "X"],
                         columns=["tid", "ts", "dur"])  # fmt: skip
    spans = spans.sort_values(["tid", "ts", "dur"], kind="stable")
    same = spans["tid"].to_numpy()[1:] == spans["tid"].to_numpy()[:-1]
    ends = (spans["ts"] + spans["dur"]).to_numpy()[:-1]
    assert (ends[same] <= spans["ts"].to_numpy()[1:][same]).all()


def test_to_perfetto_from_a_streamed_file_is_the_same_trace(tmp_path: Path) -> None:
    """A streamed run exports from its file, block by block, the same trace; ``.gz`` is
    gzip, anything else plain JSON."""
    mem = simulate(policy="lru", trace="ci-small", sequences=1)
    streamed = simulate(policy="lru", trace="ci-small", sequences=1, record=tmp_path / "t.parquet")
    a = mem.to_perfetto(tmp_path / "a.json.gz")
    b = streamed.to_perfetto(tmp_path / "b.json.gz")
    c = streamed.to_perfetto(tmp_path / "c.json")
    assert "_timeline" in streamed.__dict__ and isinstance(streamed.__dict__["_timeline"], Path)
    assert gzip.decompress(a.read_bytes()) == gzip.decompress(b.read_bytes()) == c.read_bytes()
    want = perfetto_reference(mem.timeline, mem.occupancy, _meta(mem))
    assert json.loads(c.read_bytes()) == want
