"""The 2025-2026 policies: hybrimoe, dali, least-stale, cache-conditional and slicemoe.

Each rule on a hand-checkable case (the schedule, the greedy, Minus Recent Score, the biased
routes), each cache against an independent counter or its own ablation (an option that turns a
mechanism off gives the baseline's numbers exactly), SliceMoE's slot accounting against the
memory it is given, the low-bit slots on both engines, and each policy's variants on both
engines. (Every policy's defaults also run on both engines in tests/test_reference_engine.py,
its hooks in tests/test_policy_hooks.py and its bound in tests/test_conformance.py.)
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from equivalence import both

from daopsim.policies.base import Plan, View
from daopsim.policies.dali import greedy_assign
from daopsim.policies.hybrimoe import hybrid_schedule
from daopsim.policies.registry import get_policy_class
from daopsim.simulator.costs import cost_model
from daopsim.simulator.errors import PolicyError, UserError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import make_meta, routing_from_experts, setup_context, tiny_model
from daopsim.simulator.trace_write import write_trace

A6000 = load_profile("a6000-pcie4")
NEW = ("hybrimoe", "dali", "least-stale", "cache-conditional", "slicemoe")


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal metrics (NaN equal to NaN)."""
    return a.keys() == b.keys() and all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in a)


def _run(policy: str, trace: str | Path, **kw: Any) -> dict[str, Any]:
    kw.setdefault("record", False)
    return simulate(policy, trace=trace, **kw).metrics


# -- least-stale ---------------------------------------------------------------------------------
def _cyclic_trace(path: Path, tokens: int = 12) -> Path:
    """Every decode token routes each of 4 layers to its experts 0 and 1 (8 slots a token)."""
    model = tiny_model(experts=8, top_k=2, moe_layers=4)
    ex = np.zeros((tokens, 4, 2), dtype=np.int16)
    ex[:, :, 1] = 1
    seqs = [routing_from_experts(model, ex, seq_id=0)]
    return write_trace(path, make_meta(model), seqs)


def _global_counter(steps: list[list[list[int]]], capacity: int, stale_first: bool) -> int:
    """Decode hits of one cache over all layers (plain Python): hits judged first, a miss
    inserted evicting the least recently used slot (with ``stale_first``: the least recently
    used of a layer at or before the deciding one first), never one of the token's experts
    of the layer; the initial contents are the per-layer placement of ``first``."""
    order: OrderedDict[tuple[int, int], None] = OrderedDict()
    base, extra = divmod(capacity, 4)
    for layer in range(4):
        for e in range(base + (1 if layer < extra else 0)):
            order[(layer, e)] = None
    hits = 0
    for step in steps:
        for layer, need in enumerate(step):
            for e in need:
                if (layer, e) in order:
                    hits += 1
                    order.move_to_end((layer, e))
            for e in need:
                if (layer, e) in order:
                    continue
                if len(order) >= capacity:
                    cands = [s for s in order if not (s[0] == layer and s[1] in need)]
                    if not cands:
                        continue  # every slot holds this token's experts: a temporary copy
                    stale = [s for s in cands if s[0] <= layer] if stale_first else cands
                    del order[(stale or cands)[0]]
                order[(layer, e)] = None
    return hits


def test_least_stale_keeps_what_the_pass_still_needs(tmp_path: Path) -> None:
    """On a loop over layers that needs 8 slots with 6, one LRU cache over all layers evicts
    the expert needed next every time; Least-Stale evicts one the pass has gone past. Both
    runs equal the plain counter."""
    path = _cyclic_trace(tmp_path / "cyclic.parquet")
    steps = [[[0, 1]] * 4 for _ in range(12)]
    lru = _run("global-lru", path, gpu_experts=6, hw="a6000-pcie4")
    ls = _run("least-stale", path, gpu_experts=6, hw="a6000-pcie4")
    assert lru["decode_hits"] == _global_counter(steps, 6, stale_first=False)
    assert ls["decode_hits"] == _global_counter(steps, 6, stale_first=True)
    assert lru["decode_hits"] <= 6  # the initial placement's hits at most
    assert ls["decode_hits"] > 6 * 11 // 2  # most of a token's 8 accesses hit after the first


def test_least_stale_without_its_rule_is_global_lru() -> None:
    kw = {"trace": "ci-small", "gpu_experts": 96, "sequences": 1, "hw": "a6000-pcie4"}
    off = simulate("least-stale", policy_options={"stale_first": False}, record=False, **kw)
    lru = simulate("global-lru", record=False, **kw)
    assert _same(off.metrics, lru.metrics)
    on = simulate("least-stale", record=False, **kw)
    assert on.metrics["decode_hits"] != lru.metrics["decode_hits"]


def test_least_stale_prefetch_predicts_and_keeps_copies_in_flight() -> None:
    """The layer-early prefetch raises the hit rate on ci-small and every prefetched expert
    waits out its copy (no eviction of one in flight: the plan checks would stop the run)."""
    kw = {"trace": "olmoe-1b-7b", "cache_ratio": 0.05, "sequences": 1, "hw": "a6000-pcie4"}
    plain = _run("least-stale", **kw)
    pre = _run("least-stale", policy_options={"prefetch": True}, **kw)
    assert pre["prefetches"] > 0 and pre["hit_rate"] > plain["hit_rate"]
    assert 0 < pre["prefetch_precision"] <= 1


# -- cache-conditional ---------------------------------------------------------------------------
def _view(probs: list[float], experts: list[int], resident: list[bool]) -> View:
    v = View()
    v.layer = 0
    v.experts = np.asarray(experts, dtype=np.int64)
    v.probs = np.asarray(probs, dtype=np.float32)
    v.weights = np.asarray([probs[e] for e in experts], dtype=np.float32)
    v.resident = np.asarray([resident], dtype=bool)
    return v


@pytest.mark.parametrize(
    ("options", "route"),
    [
        # the range of z = log p is log(0.5/0.05) = 2.303; expert 1's z is -1.204 and cached
        # expert 2's -1.897 + lam x 2.303: below it at lam = 0.2 (-1.436), above at 0.5 (-0.746)
        ({"lam": 0.2}, [0, 1]),
        ({"lam": 0.5}, [0, 2]),
        ({"lam": 0.5, "keep_top": 0}, [0, 2]),
        ({"lam": 3.0, "keep_top": 0}, [2, 0]),  # 2 then 0: -1.897 + 6.9 > -0.693 > ...
        ({"method": "max-rank", "max_rank": 4}, [0, 3]),  # cached expert 3 is within rank 4
        ({"method": "max-rank", "max_rank": 3}, [0, 1]),  # ... but not within rank 3
    ],
)
def test_cache_conditional_routes_by_hand(options: dict[str, Any], route: list[int]) -> None:
    cls = get_policy_class("cache-conditional")
    pol = cls(**options)
    pol.setup(setup_context(1, 4, budget=1, top_k=2))
    probs = [0.5, 0.3, 0.15, 0.05]
    if options.get("method") == "max-rank":
        resident = [False, False, False, True]
    else:
        resident = [False, False, True, False]
    assert pol.route(_view(probs, [0, 1], resident), [0, 1]) == route


@pytest.mark.parametrize("options", [{"lam": 0.0}, {"min_gate_mass": 1.0}])
def test_cache_conditional_without_a_bias_is_lru(options: dict[str, Any]) -> None:
    """lam = 0, or a gate-mass floor no substitution can meet, is the unmodified routing."""
    kw = {"trace": "phi-3.5-moe", "cache_ratio": 0.25, "sequences": 1, "hw": "a6000-pcie4"}
    cc = _run("cache-conditional", policy_options=options, **kw)
    lru = _run("lru", **kw)
    assert _same(cc, lru)


def test_cache_conditional_may_pass_the_bound_of_unmodified_routing() -> None:
    """Routing toward the cache can beat Belady of the true routing; the run says what it
    cost: the replaced experts (all degradation) and the gate mass kept."""
    from daopsim.simulator.commands.run_cmd import REPLACED_ROUTING_NOTE, compute_bounds

    kw = {"trace": "phi-3.5-moe", "cache_ratio": 0.25, "sequences": 2, "hw": "a6000-pcie4"}
    res = simulate("cache-conditional", record=False, **kw)
    m = res.metrics
    bounds = compute_bounds(res, hw="a6000-pcie4", trace="phi-3.5-moe", sequences=2)
    assert m["hit_rate"] > bounds["belady"]["hit_rate"]
    assert bounds["belady"]["routing"] == REPLACED_ROUTING_NOTE
    assert 0 < m["routing_replaced_frac"] == m["replaced_degraded_frac"]
    assert 0.5 < m["gate_mass_preserved"] < 1
    lru = simulate("lru", record=False, **kw)
    assert (
        "routing"
        not in compute_bounds(lru, hw="a6000-pcie4", trace="phi-3.5-moe", sequences=2)["belady"]
    )


# -- hybrimoe ------------------------------------------------------------------------------------
def test_hybrid_schedule_by_hand() -> None:
    """a cached; b, c not. GPU 1, CPU 3, copy 2. a to the GPU (1 <= 3); b to the GPU once its
    copy lands (at 2, then 1: 3 <= 3); c: GPU at 5 (its copy queued behind b's) vs CPU at 3."""
    cpu, gpu, span = hybrid_schedule(
        [0], [1, 2], lambda e: 1, lambda n: 1.0, lambda n: 3.0, [2.0, 4.0], 0.0
    )
    assert (cpu, gpu, span) == ([2], [0, 1], 3.0)
    # loads order each side: the heaviest cached expert first on the GPU, the lightest
    # uncached one first on the CPU
    loads = {0: 1, 1: 9, 2: 2, 3: 5}
    cpu, gpu, _ = hybrid_schedule(
        [0, 1], [2, 3], loads.__getitem__, lambda n: 1.0, lambda n: float(n), [10.0, 20.0], 0.0
    )
    assert gpu[:2] == [1, 0] and cpu[0] == 2
    # an expert landing late (ready) keeps the GPU waiting
    _, _, span = hybrid_schedule([0], [], lambda e: 1, lambda n: 1.0, lambda n: 9.0, [], 0.0,
                                 ready={0: 4.0})  # fmt: skip
    assert span == 5.0


def test_minus_recent_score_by_hand() -> None:
    cls = get_policy_class("hybrimoe")
    pol = cls()
    pol.setup(setup_context(1, 4, budget=2, top_k=1))  # top_p = 2k = 2
    for _ in range(2):
        pol.update_scores(0, [0.1, 0.6, 0.3, 0.0])
    assert pol.score[0] == pytest.approx([0.0, 0.45, 0.225, 0.0])
    pol.update_scores(0, [0.0, 0.0, 0.4, 0.6])  # 1 decays to 0.225, 2 to 0.3125, 3 to 0.3
    assert pol.score[0] == pytest.approx([0.0, 0.225, 0.3125, 0.3])
    # resident 0 and 1 (the first experts); the lowest score goes, ties to the least recent
    assert pol.choose_victim(0, set(), 0) == 0
    assert pol.choose_victim(0, {0}, 0) == 1


def test_hybrimoe_cpu_schedule_never_changes_the_cache() -> None:
    """schedule = cpu without prefetch: every miss runs on the CPU, so nothing is copied and
    every access outside the first experts of each layer is a CPU evaluation."""
    res = _run(
        "hybrimoe",
        "ci-small",
        policy_options={"schedule": "cpu", "prefetch": 0},
        cache_ratio=0.25,
        sequences=1,
        hw="a6000-xeon5220r-pcie3",
    )
    accesses = res["decode_accesses"] + res["prefill_accesses"]
    hits = res["decode_hits"] + res["prefill_hits"]
    assert res["fetches"] == res["prefetches"] == res["temp_copies"] == 0
    assert res["cpu_expert_evals"] == accesses - hits > 0


# -- dali ----------------------------------------------------------------------------------------
def test_dali_greedy_by_hand() -> None:
    """Expert 0 resident saves 3 on the GPU, 1 and 2 save 1 (their copy counted). 0 to the GPU
    (1 <= 4), 1 to the GPU after its copy (3 <= 4), 2: GPU at 5 (copy queued) vs CPU at 4."""
    cpu, gpu = greedy_assign(
        [0, 1, 2], [1, 1, 1], [True, False, False], [1.0] * 3, [4.0] * 3, 2.0, [2.0, 4.0]
    )
    assert (cpu, gpu) == ([2], [0, 1])
    # a cheap CPU takes every miss; an expensive one leaves them all to the GPU
    assert greedy_assign([0, 1], [1, 1], [False, False], [1.0] * 2, [0.5] * 2, 2.0, [2.0, 4.0]) == (
        [0, 1],
        [],
    )
    assert greedy_assign(
        [0, 1], [1, 1], [False, False], [1.0] * 2, [99.0] * 2, 2.0, [2.0, 4.0]
    ) == (
        [],
        [0, 1],
    )


def test_dali_replacement_only_at_window_ends() -> None:
    """Without a window and a prefetch the placement never changes; with them experts are
    swapped in (as background copies), never as demand fetches."""
    kw = {"trace": "ci-small", "cache_ratio": 0.25, "sequences": 1, "hw": "a6000-pcie4"}
    static = _run("dali", policy_options={"window": 0, "prefetch": 0}, **kw)
    assert static["fetches"] == static["prefetches"] == static["evictions"] == 0
    swap = _run("dali", policy_options={"window": 1, "prefetch": 0}, **kw)
    assert swap["fetches"] == 0 and swap["prefetches"] == swap["evictions"] > 0
    assert swap["hit_rate"] > static["hit_rate"]


# -- slicemoe ------------------------------------------------------------------------------------
def test_slicemoe_holds_no_more_than_its_memory() -> None:
    """The engine is given floor(budget x B / B_low) slots; the policy's full-precision
    experts take ceil(B / B_low) of them; the engine's residents never exceed what the
    policy counts, nor the policy's count the slots."""
    seen: list[tuple[int, int, int]] = []
    cls = get_policy_class("slicemoe")

    class Watched(cls):  # type: ignore[misc, valid-type]
        def decode_layer(self, view: View) -> Plan:
            plan = super().decode_layer(view)
            seen.append((int(view.resident.sum()), len(self.entries), self.used))
            assert self.used == sum(self.size_of(f) for f in self.entries.values())
            return plan

    pol = Watched()
    res = simulate(pol, "a6000-pcie4", "ci-small", gpu_experts=40, sequences=1, record=False)
    costs = cost_model(A6000, "mixtral-8x7b")
    full, low = costs.expert_bytes, costs.low_bit_expert_bytes("int4")
    assert res.config["gpu_experts"] == 40
    assert pol.units == math.floor(40 * full / low) == 160 and pol.full_units == 4
    assert seen and all(used <= pol.units for _, _, used in seen)
    # residents before the decision are at most the policy's entries after it
    assert max(r for r, _, _ in seen) <= pol.units
    assert any(n > 40 for _, n, _ in seen)  # more experts than whole ones would fit


def test_slicemoe_slices_move_and_count_their_own_bytes() -> None:
    """With every decode miss loaded as its slice (high_share = 1) and the prompt through
    temporary full copies, every decode expert runs in low precision, and the bytes copied
    are the slices' plus the full copies'."""
    opts = {"high_share": 1.0, "warmup": False}
    res = simulate("slicemoe", "a6000-pcie4", "ci-small", gpu_experts=40, sequences=1,
                   policy_options=opts, record=False)  # fmt: skip
    m = res.metrics
    costs = cost_model(A6000, "mixtral-8x7b")
    full, low = costs.expert_bytes, costs.low_bit_expert_bytes("int4")
    assert m["low_precision_gate_mass"] == pytest.approx(1.0)
    assert m["fetches"] == m["low_bit_copies"] > 0
    assert m["h2d_bytes"] == m["low_bit_copies"] * low + m["temp_copies"] * full
    whole = _run("slicemoe", "ci-small", gpu_experts=40, sequences=1, hw="a6000-pcie4",
                 policy_options={"high_share": 0.01, "warmup": False})  # fmt: skip
    assert whole["low_bit_copies"] < m["low_bit_copies"]
    assert whole["low_precision_gate_mass"] < 1


def test_slicemoe_refusals() -> None:
    with pytest.raises(UserError, match="not smaller than the GPU precision"):
        simulate("slicemoe", "a6000-pcie4", "ci-small", gpu_experts=40, sequences=1,
                 dtype="int4", policy_options={"low_bit": "int8"}, record=False)  # fmt: skip
    with pytest.raises(UserError, match="--gpus 1"):
        simulate("slicemoe", "2x-rtx4090-pcie4", "ci-small", sequences=1, gpus=2, record=False)
    with pytest.raises(UserError, match="dtype name"):
        get_policy_class("slicemoe")(low_bit="int3")


def test_low_bit_fetches_need_low_bit_slots(tmp_path: Path) -> None:
    """A FETCH or GPU expert named in Plan.low_bit is refused on a spec without
    low_bit_slots (HOBBIT's low-bit copies are temporary only)."""
    hobbit = get_policy_class("hobbit")

    class Bad(hobbit):  # type: ignore[misc, valid-type]
        name = "bad-low-bit"

        def decode_layer(self, view: View) -> Plan:
            plan = self.serve(view, view.experts.tolist())
            plan.low_bit = frozenset(view.experts.tolist())
            return plan

    with pytest.raises(PolicyError, match="not a TEMP copy"):
        simulate(Bad(), "a6000-pcie4", "ci-small", gpu_experts=64, sequences=1, record=False)


# -- every policy, its variants, both engines ----------------------------------------------------
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("least-stale", {"prefetch": True}),
    ("least-stale", {"stale_first": False}),
    ("cache-conditional", {"method": "max-rank"}),
    ("cache-conditional", {"min_gate_mass": 0.8}),
    ("hybrimoe", {"constants": "code"}),
    ("hybrimoe", {"schedule": "gpu", "cache": "lru"}),
    ("hybrimoe", {"schedule": "cpu"}),
    ("dali", {"assign": "cpu", "window": 1}),
    ("slicemoe", {"warmup": False, "high_share": 0.3}),
    ("slicemoe", {"low_bit": "q4_0"}),
]


@pytest.mark.parametrize(("policy", "options"), VARIANTS)
@pytest.mark.parametrize("trace", ["ci-small", "olmoe-1b-7b"])
def test_variants_time_identically_on_both_engines(
    policy: str, options: dict[str, Any], trace: str
) -> None:
    both(policy, trace, 0.25, A6000, **options)


@pytest.mark.parametrize("policy", NEW)
@pytest.mark.parametrize(
    ("hw", "model"),
    [
        ("rtx4090-pcie4", "qwen3-30b-a3b"),
        ("jetson-orin-64g", "deepseek-v2-lite"),
        ("rtx3060-pcie3", "phi-3.5-moe"),
    ],
)
def test_each_runs_on_other_machines_and_models(policy: str, hw: str, model: str) -> None:
    """A catalogue model on a generated trace, on a desktop, an edge device (unified memory)
    and a small card, at a budget that fits."""
    m = simulate(policy, hw, model=model, sequences=1, cache_ratio=0.05, record=False).metrics
    assert m["tokens_per_s"] > 0 and m["decode_tokens"] > 0
