"""The fast engine's held-back write-back slot releases (``Engine._releases``).

``_plain_fetches`` keeps the slot release of each write-back it issues in a queue until the
next decision instead of pushing it on the request heap; ``_due`` then frees the due slots in
the heap's order when nothing else is pending, or pushes the queue on the heap with the same
keys. These tests run the same policies with the queue and with every release on the heap
(the queue switched off) and require every result to be the same, and check that both ways
out of the queue (settled at the next decision, pushed on the heap) are really taken.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from simulator import simulate
from simulator.engine import Engine


def _result(record: bool, runtime: str | None, **opts: Any) -> tuple[Any, ...]:
    # copies on a side stream unless a case asks for the default (one stream, whose recorded
    # runs never take _plain_fetches, which holds the releases back)
    r = simulate(
        policy="mixtral-offloading",
        trace="ci-small",
        hw="a6000-pcie4",
        cache_ratio=0.25,
        policy_options={"copy_stream": "side", **opts},
        record=record,
        runtime=runtime,
    )
    metrics = {k: repr(v) for k, v in r.metrics.items()}
    timeline = None if r.timeline is None else pickle.dumps(r.timeline.to_dict("list"))
    occupancy = pickle.dumps(r.occupancy)
    return metrics, timeline, occupancy, r.token_latency.tolist(), r.ttft.tolist()


CASES = [
    (False, None, {}),
    (True, None, {}),
    (True, "ideal", {}),
    # one slot per layer for top-2: in-use victims' write-backs wait on the heap beside the
    # held-back releases, so the queue is pushed on the heap
    (True, None, {"experts_per_layer": 1}),
    # prefetch plans take the general one-pass path, whose write-backs go on the heap
    (False, None, {"prefetch": True}),
    # one stream without a recorder: the same paths, timed by Engine._one_stream_gpu (an
    # in-use victim's write-back is served there and its release goes on the heap)
    (False, None, {"copy_stream": "default"}),
    (False, "ideal", {"copy_stream": "default", "experts_per_layer": 1}),
    (False, None, {"copy_stream": "default", "prefetch": True}),
]


@pytest.mark.parametrize(("record", "runtime", "opts"), CASES)
def test_held_back_releases_change_no_result(
    record: bool, runtime: str | None, opts: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Metrics, timeline, occupancy and latencies are the same with every release on the
    heap, and the queue was used."""
    calls = {"settle": 0, "flush": 0}
    settle, flush = Engine._settle_releases, Engine._flush_releases

    def counting_settle(self: Engine, now: float) -> None:
        calls["settle"] += 1
        settle(self, now)

    def counting_flush(self: Engine) -> None:
        calls["flush"] += 1
        flush(self)

    monkeypatch.setattr(Engine, "_settle_releases", counting_settle)
    monkeypatch.setattr(Engine, "_flush_releases", counting_flush)
    held = _result(record, runtime, **opts)
    if not opts.get("experts_per_layer"):  # (there nearly every miss has an in-use victim)
        assert calls["settle"] > 0, "no release was held back"
    monkeypatch.setattr(Engine, "_releases", lambda self: None)
    calls["settle"] = 0
    on_heap = _result(record, runtime, **opts)
    assert calls["settle"] == 0
    assert held == on_heap


def test_both_ways_out_of_the_queue_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the cases above, some decisions settle the queue themselves and some push it on
    the heap because other requests are pending (else the second way would be untested)."""
    seen = {"settled": 0, "pushed": 0}
    settle = Engine._settle_releases

    def counting_settle(self: Engine, now: float) -> None:
        held = len(self._rel)
        pending = bool(self._heap or self.res.waiters)
        settle(self, now)
        if held and pending:
            seen["pushed"] += 1
            assert not self._rel
        elif held:
            seen["settled"] += 1

    monkeypatch.setattr(Engine, "_settle_releases", counting_settle)
    for record, runtime, opts in CASES:
        _result(record, runtime, **opts)
    assert seen["settled"] > 0
    assert seen["pushed"] > 0
