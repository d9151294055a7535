"""moe-infinity's rules against independent oracles and hand-computed cases.

* matching: the code's ``find_most_similar`` (EfficientMoE/MoE-Infinity 87eacf7,
  memory/expert_tracer.py) transcribed literally (overwrite layers <= l, normalise rows, cosine
  with eps, mean over layers, argmin) picks the same entry as the policy's incremental match
  at every layer of every token;
* prefetch order: the matched entry's counts x ``1 - (x - l) / (L + 1)``, hand-computed;
* eviction: the lowest ``count x (1 - l / L)`` of the current request goes, hand-computed;
  the sorted-list victim search returns the former lazy heap's victim (kept here) in random
  cases, ties, in-flight copies and the predicted-experts scan limit included;
* prefetch timing: the code's one copy thread takes the next queued prefetch once a layer's
  misses have landed, so a layer with a miss still prefetches when its copy outlasts the gap;
* end to end: it prefetches on a bundled trace, and a run without calibration refuses.
"""

from __future__ import annotations

import heapq
from bisect import insort
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from daopsim.policies.base import SetupContext, View
from daopsim.policies.moe_infinity import MoEInfinityPolicy
from daopsim.simulator.costs import cost_model
from daopsim.simulator.errors import UserError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import tiny_model

HW = load_profile("a6000-pcie4")


def make(model: Any, coll: np.ndarray, budget: int, **opts: Any) -> MoEInfinityPolicy:
    """A set-up policy whose EAM collection is ``coll``."""
    pol = MoEInfinityPolicy(**opts)
    calib = coll.sum(axis=0).astype(np.int64)
    ctx = SetupContext(
        model, budget, cost_model(HW, model), calib, None, calibration_sequences=tuple(coll)
    )
    pol.setup(ctx)
    pol.on_sequence_start(0, 0)
    return pol


def view(model: Any, layer: int, experts: list[int], now: float, copy_free: float = 0.0) -> View:
    """A decode view of one layer (the policy reads experts, weights, layer, now, the landing
    times and the copy lane): nothing in flight, the lane free from ``copy_free``, one expert
    copy taking the cost model's pinned copy time."""
    v = View()
    v.model = model
    v.layer = layer
    v.experts = np.asarray(experts, dtype=np.int64)
    v.weights = np.full(len(experts), 1.0 / len(experts), dtype=np.float32)
    v.resident = np.zeros((model.moe_layers, model.experts), dtype=bool)
    v.ready = np.zeros((model.moe_layers, model.experts))
    v._copy_free_times = lambda k: [copy_free]
    v._copy_seconds = [cost_model(HW, model).h2d_expert_s(pinned=True)]
    v.now = now
    return v


def code_match(coll: np.ndarray, matrix: np.ndarray, layer: int) -> int:
    """``ExpertTracer.find_most_similar`` in numpy, step by step as the code does it."""
    c = coll.astype(np.float64).copy()
    c[:, : layer + 1, :] = 1e-9
    c /= c.sum(axis=2, keepdims=True)
    m = matrix.astype(np.float64).copy()
    with np.errstate(invalid="ignore", divide="ignore"):
        m /= m.sum(axis=1, keepdims=True)
    m = np.nan_to_num(m)
    # torch.nn.CosineSimilarity(dim=2, eps=1e-6): x.y / max(|x| |y|, eps)
    num = (c * m[None]).sum(axis=2)
    den = np.maximum(np.linalg.norm(c, axis=2) * np.linalg.norm(m, axis=1)[None], 1e-6)
    dist = 1.0 - (num / den).mean(axis=1)
    return int(np.argmin(dist))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_match_equals_the_codes_find_most_similar(seed: int) -> None:
    rng = np.random.default_rng(seed)
    model = tiny_model(experts=8, top_k=2, moe_layers=6)
    n_layers, n_exp = model.moe_layers, model.experts
    coll = rng.integers(0, 20, size=(7, n_layers, n_exp))
    pol = make(model, coll, budget=10, prefetch=False)
    matrix = np.zeros((n_layers, n_exp), dtype=np.int64)
    now = 0.0
    checked = 0
    for _token in range(12):
        for layer in range(n_layers):
            experts = rng.choice(n_exp, size=2, replace=False).tolist()
            matrix[layer, experts] += 1  # update_entry runs before the match
            now += 1e-3
            pol.decode_layer(view(model, layer, experts, now))
            if layer < n_layers - 1:
                assert pol.best[layer] == code_match(coll, matrix, layer), (_token, layer)
                checked += 1
    assert checked == 12 * (n_layers - 1)
    assert len(set(pol.best[:-1])) > 1 or seed != 0  # the match does move between entries


def test_prefetch_order_is_count_times_layer_proximity() -> None:
    model = tiny_model(experts=4, top_k=1, moe_layers=4)
    entry = np.zeros((4, 4), dtype=np.int64)
    entry[0, 0] = 1
    entry[1, 0], entry[1, 1] = 5, 1  # x 0.8 -> 4.0, 0.8
    entry[2, 2], entry[2, 3] = 10, 5  # x 0.6 -> 6.0, 3.0
    entry[3, 0] = 9  # x 0.4 -> 3.6
    pol = make(model, entry[None], budget=16)

    def order(p: MoEInfinityPolicy, layer: int) -> list[tuple[int, int]]:
        queue, keep, flat = p._queue(0, layer)
        assert keep == frozenset(flat) == frozenset(x * 4 + e for x, e, _ in queue)
        assert flat == [i for *_, i in queue]
        return [(x, e) for x, e, _ in queue]

    assert order(pol, 0) == [(2, 2), (1, 0), (3, 0), (2, 3), (1, 1)]
    # from layer 1 the decay restarts: (2,2) 10 x 0.8, (2,3) 5 x 0.8 = 4.0, (3,0) 9 x 0.6 = 5.4
    assert order(pol, 1) == [(2, 2), (3, 0), (2, 3)]
    shallow = make(model, entry[None], budget=16, prefetch_depth=1)
    assert order(shallow, 0) == [(1, 0), (1, 1)]
    # with an idle link the first decision prefetches the head of the queue that is not
    # cached, evicting the lowest-priority expert that is not predicted: (3, 1), not (3, 0)
    full = make(model, entry[None], budget=8)  # experts 0 and 1 of every layer
    plan = full.decode_layer(view(model, 0, [0], 0.0))
    assert plan.prefetch[0] == (2, 2, (3, 1))


def test_a_layer_with_a_miss_prefetches_once_its_misses_land() -> None:
    """Mixtral-sized experts: a copy outlasts a layer's gap. The layer with a miss runs only
    when the miss lands, and the copy thread then takes the queue's head, so one prefetch is
    issued behind the miss (FIFO); a decision whose link is busy past its gap issues none."""
    model = replace(tiny_model(experts=4, top_k=1, moe_layers=4), hidden=4096, expert_ffn=14336)
    entry = np.zeros((4, 4), dtype=np.int64)
    entry[1, 2], entry[2, 3], entry[3, 1] = 5, 4, 3
    pol = make(model, entry[None], budget=8)  # experts 0 and 1 of every layer
    first = view(model, 0, [3], 0.0)
    copy = first.copy_s
    assert copy > 2 * pol.next_decision_gap  # the case where the layer's own wait decides
    plan = pol.decode_layer(first)
    assert plan.actions[3].name == "FETCH"
    assert [p[:2] for p in plan.prefetch] == [(1, 2)]  # one copy: then busy past the horizon
    assert first.copy_end(2) == pytest.approx(2 * copy)  # it lands behind the miss
    # the next decision comes before the prefetch lands and hits: the lane (both copies on
    # it) is busy past its gap
    later = view(model, 1, [0], copy + pol.next_decision_gap, copy_free=2 * copy)
    assert not pol.decode_layer(later).prefetch
    # with the lane idle by then it would prefetch the head of its queue
    assert pol.decode_layer(view(model, 1, [0], 3 * copy, copy_free=2 * copy)).prefetch


def test_eviction_takes_the_lowest_count_times_layer_weight() -> None:
    model = tiny_model(experts=4, top_k=1, moe_layers=4)  # weights 1, 0.75, 0.5, 0.25
    coll = np.ones((1, 4, 4), dtype=np.int64)
    pol = make(model, coll, budget=2, prefetch=False, initial="empty")
    now = 0.0

    def step(layer: int, e: int) -> tuple[int, int] | None:
        nonlocal now
        now += 1.0
        plan = pol.decode_layer(view(model, layer, [e], now))
        return plan.victims.get(e) if plan.actions else None

    # token 0: expert 0 everywhere; the cache holds two
    assert [step(layer, 0) for layer in range(4)] == [None, None, (1, 0), (2, 0)]
    # now (0,0): 1 x 1 = 1.0 and (3,0): 1 x 0.25; token 1 hits (0,0) (2.0), then misses
    assert step(0, 0) is None
    assert step(1, 1) == (3, 0)  # 0.25 < 2.0
    assert step(2, 1) == (1, 1)  # (1,1): 1 x 0.75 < (0,0): 2.0
    # a new request resets the counts: every expert is back to 0, ties go to the deeper layer
    pol.on_sequence_start(1, 0)
    assert step(3, 3) == (2, 1)


def test_runs_and_prefetches_on_a_bundled_trace() -> None:
    r = simulate(policy="moe-infinity", trace="ci-small", sequences=1, record=False)
    assert r.metrics["prefetches"] > 0
    assert 0 < r.metrics["prefetch_precision"] <= 1
    assert r.config["calibration"] == "held-out"
    off = simulate(
        policy="moe-infinity",
        trace="ci-small",
        sequences=1,
        record=False,
        policy_options={"prefetch": False},
    )
    assert off.metrics["prefetches"] == 0


def test_needs_calibration_sequences() -> None:
    with pytest.raises(UserError, match="calibration"):
        simulate(policy="moe-infinity", trace="ci-small", sequences=1, calibration="none")
    with pytest.raises(UserError, match="eamc_capacity"):
        MoEInfinityPolicy(eamc_capacity=0)


def heap_victim(
    heap: list[tuple[float, float, int, int]],
    cached: list[list[bool]],
    cnt: list[list[int]],
    inflight: dict[tuple[int, int], float],
    ready: np.ndarray | None,
    now: float,
    layer: int,
    protect: set[int],
    keep: frozenset[tuple[int, int]] | None,
) -> tuple[int, int] | None:
    """The policy's former victim search, a lazy min-heap, kept here as the oracle."""
    skipped = []
    found = None
    while heap:
        item = heapq.heappop(heap)
        key, w, e, vl = item
        if not cached[vl][e]:
            continue
        now_key = cnt[vl][e] * w
        if now_key != key:
            heapq.heappush(heap, (now_key, w, e, vl))
            continue
        if vl == layer and e in protect:
            skipped.append(item)
            continue
        slot = (vl, e)
        if inflight.get(slot, -1.0) > now:
            skipped.append(item)
            continue
        if ready is not None and ready[vl, e] > now:
            skipped.append(item)
            continue
        if keep is not None and slot in keep:
            skipped.append(item)
            if len(skipped) > 8:
                break
            continue
        found = slot
        break
    for item in skipped:
        heapq.heappush(heap, item)
    return found


@pytest.mark.parametrize("seed", range(6))
def test_victim_search_equals_the_lazy_heap(seed: int) -> None:
    """Random counts, fills, in-flight copies, runtime ready times, protected and predicted
    sets (many ties: small counts, few layers): the sorted-list search returns the heap's
    victim every time and holds the heap's entries."""
    rng = np.random.default_rng(seed)
    n_layers, n_exp = 4, 6
    model = tiny_model(experts=n_exp, top_k=2, moe_layers=n_layers)
    coll = np.ones((1, n_layers, n_exp), dtype=np.int64)
    budget = int(rng.integers(4, 16))
    pol = make(model, coll, budget=budget, prefetch=False, initial="first")
    w = pol.weight
    cached = [[pol.cached[x * n_exp + e] for e in range(n_exp)] for x in range(n_layers)]
    cnt = [[0] * n_exp for _ in range(n_layers)]
    heap = [(0.0, w[x], e, x) for x in range(n_layers) for e in range(n_exp) if cached[x][e]]
    heapq.heapify(heap)
    inflight: dict[tuple[int, int], float] = {}
    found = {"some": 0, "none": 0}
    for step in range(400):
        now = float(step)
        op = rng.random()
        if op < 0.3:  # counts grow (a routed expert, cached or not)
            for _ in range(int(rng.integers(1, 4))):
                x, e = int(rng.integers(n_layers)), int(rng.integers(n_exp))
                cnt[x][e] += int(rng.integers(1, 3))
                pol.activations[x * n_exp + e] = cnt[x][e]
            continue
        if op < 0.35:  # a new request: every count back to 0
            pol.on_sequence_start(step, 0)
            cnt = [[0] * n_exp for _ in range(n_layers)]
            heap = [
                (0.0, w[x], e, x) for x in range(n_layers) for e in range(n_exp) if cached[x][e]
            ]
            heapq.heapify(heap)
            continue
        layer = int(rng.integers(n_layers))
        protect = set(rng.choice(n_exp, size=2, replace=False).tolist())
        keep = None
        if rng.random() < 0.6:
            slots = [(int(x), int(e)) for x in range(n_layers) for e in range(n_exp)]
            pick = rng.random(len(slots)) < rng.uniform(0.3, 0.95)
            keep = frozenset(s for s, p in zip(slots, pick, strict=True) if p)
        ready = None
        if rng.random() < 0.3:
            ready = rng.choice([0.0, now + 1.0], size=(n_layers, n_exp), p=[0.8, 0.2])
        # the engine's landing times: those, and the prefetches still in flight
        landing = np.zeros((n_layers, n_exp)) if ready is None else ready.copy()
        for (x, e), t in inflight.items():
            landing[x, e] = max(landing[x, e], t)
        pol.ready = landing
        keep_flat = None if keep is None else frozenset(x * n_exp + e for x, e in keep)
        want = heap_victim(heap, cached, cnt, inflight, ready, now, layer, protect, keep)
        got = pol._victim(now, layer, protect, keep_flat)
        assert got == want, step
        found["none" if got is None else "some"] += 1
        if got is not None:  # evict it, and cache an uncached expert in its place
            cached[got[0]][got[1]] = False
            pol.cached[got[0] * n_exp + got[1]] = False
            free = [(x, e) for x in range(n_layers) for e in range(n_exp) if not cached[x][e]]
            x, e = free[int(rng.integers(len(free)))]
            cached[x][e] = True
            i = x * n_exp + e
            pol.cached[i] = True
            heapq.heappush(heap, (cnt[x][e] * w[x], w[x], e, x))
            insort(pol.order, (cnt[x][e] * w[x], w[x], e, x, i))
            if rng.random() < 0.4:  # a prefetch copy still in flight
                inflight[(x, e)] = now + float(rng.integers(1, 4))
        # the same entries: the list is the heap in sorted order
        assert [t[:4] for t in pol.order] == sorted(heap), step
    assert found["some"] > 50 and found["none"] > 5
