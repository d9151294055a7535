"""Each built-in policy's own rules on hand-written routing (exact victims, actions and bytes)."""

from __future__ import annotations

import ast
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from daopsim.policies.base import SetupContext
from daopsim.policies.registry import available, make_policy
from daopsim.simulator.core.loop import Engine
from daopsim.simulator.core.ops import Counters
from daopsim.simulator.costs import cost_model
from daopsim.simulator.errors import UserError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.models import get_model
from daopsim.simulator.oracle import Oracle
from daopsim.simulator.recorder import Recorder
from daopsim.simulator.testing import random_routing, routing_from_experts, tiny_model
from daopsim.simulator.trace_format import SequenceRouting

HW = load_profile("a6000-pcie4")


def run(
    policy: str,
    model: Any,
    routings: Sequence[SequenceRouting],
    budget: int,
    options: dict[str, Any] | None = None,
    calibration: np.ndarray | None = None,
) -> tuple[Counters, pd.DataFrame, Engine]:
    """Run a policy on explicit routings; returns counters, timeline and engine."""
    pol = make_policy(policy, options)
    oracle = None
    if pol.clairvoyant:
        oracle = Oracle(model.moe_layers, model.experts)
        for r in routings:
            oracle.add(r)
    if pol.uses_calibration() and calibration is None:
        calibration = np.zeros((model.moe_layers, model.experts), dtype=np.int64)
    rec = Recorder()
    eng = Engine(pol, model, cost_model(HW, model), budget, calibration, calibration, oracle, rec)
    c = eng.run(iter(routings)).counters
    return c, rec.timeline(), eng


def one_layer(experts: int = 5, k: int = 1) -> Any:
    return tiny_model(experts=experts, top_k=k, moe_layers=1)


def fetched(tl: pd.DataFrame) -> list[int]:
    return tl[tl["kind"] == "fetch"]["expert"].tolist()


def evicted_order(policy: str, seq: list[int], budget: int = 2) -> list[int]:
    """The resident set after each decode token of a 1-layer top-1 trace."""
    m = one_layer()
    r = routing_from_experts(m, [[[e]] for e in seq])
    _c, _tl, eng = run(policy, m, [r], budget)
    return sorted(np.flatnonzero(eng.resident[0]).tolist())


def _class_docstring(cls: type) -> str | None:
    """The class's docstring as written in its source (a compiled class keeps no __doc__)."""
    from daopsim.simulator.native import module_source

    path = module_source(sys.modules[cls.__module__]) or Path()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return ast.get_docstring(node)
    return None


def test_every_policy_is_documented() -> None:
    for name, cls in available().items():
        if not cls.__module__.startswith("daopsim.policies."):
            continue
        assert cls.summary and cls.source and _class_docstring(cls), name
        for key, p in cls.params.items():
            assert p.help and isinstance(p.default, p.type), (name, key)
            if p.choices:
                assert p.default in p.choices, (name, key)


def test_lru_lfu_and_round_robin_pick_different_victims() -> None:
    # capacity 2 starting with {0, 1}; expert 0 is hot, then 2 arrives
    assert evicted_order("lru", [0, 0, 0, 1, 2]) == [1, 2]  # 0 is least recent
    assert evicted_order("lfu", [0, 0, 0, 1, 2]) == [0, 2]  # 0 has most uses
    assert evicted_order("round-robin", [0, 0, 0, 1, 2]) == [1, 2]  # slot 0 whatever its use
    assert evicted_order("lru", [1, 1, 0, 2]) == [0, 2]
    assert evicted_order("round-robin", [1, 1, 0, 2]) == [1, 2]  # blind: hot 0 sits in slot 0


@pytest.mark.parametrize("policy", ["lru", "lfu", "belady"])
def test_initial_popular_starts_from_the_calibration_counts(policy: str) -> None:
    """initial=popular asks the runner for calibration counts and starts with the top ones."""
    assert not make_policy(policy, {}).uses_calibration()
    assert make_policy(policy, {"initial": "popular"}).uses_calibration()
    m = one_layer()
    calib = np.array([[0, 1, 0, 9, 5]])  # experts 3 and 4 are the popular ones
    r = routing_from_experts(m, [[[3]], [[4]]])
    c, _tl, eng = run(policy, m, [r], 2, {"initial": "popular"}, calibration=calib)
    assert (c.decode_hits, c.fetches) == (2, 0)
    assert sorted(np.flatnonzero(eng.resident[0]).tolist()) == [3, 4]
    c, _tl, _eng = run(policy, m, [r], 2, {"initial": "first"})
    assert (c.decode_hits, c.fetches) == (0, 2)


def test_round_robin_ignores_use() -> None:
    # slots [0, 1], hand at slot 0: 2 replaces 0, 3 replaces 1, 0 replaces 2 (slot 0 again)
    assert evicted_order("round-robin", [2, 3, 0]) == [0, 3]
    assert evicted_order("round-robin", [2, 3, 2, 0]) == [0, 3]  # the re-use of 2 is ignored
    assert evicted_order("lru", [2, 3, 2, 0]) == [0, 2]


def test_lfu_counts_persist_and_ties_go_to_the_least_recent() -> None:
    # worked by hand: evictions 0 (tie, older), 1 (tie, older), 3 (fewer), 2 (fewer), 0 (tie)
    assert evicted_order("lfu", [0, 0, 1, 1, 2, 2, 3, 0, 0, 1, 1, 4]) == [1, 4]
    assert evicted_order("lfu", [2, 3]) == [2, 3]  # all counts 0: oldest insertion goes first


def test_belady_evicts_the_farthest_next_use() -> None:
    m = one_layer()
    # cache {0,1}; 2 arrives; next uses: 0 at step 3, 1 at step 1 -> evict 0
    r = routing_from_experts(m, [[[2]], [[1]], [[2]], [[0]]])
    c, tl, _ = run("belady", m, [r], 2)
    assert fetched(tl) == [2, 0]
    lru_c, _, _ = run("lru", m, [r], 2)
    assert c.decode_hits >= lru_c.decode_hits


def test_belady_is_clairvoyant_and_others_are_not() -> None:
    assert available()["belady"].clairvoyant
    for name in ("lru", "lfu", "round-robin", "fiddler", "mixtral-offloading", "stream-all"):
        assert not available()[name].clairvoyant


def test_fiddler_runs_misses_on_cpu_and_prefill_by_break_even() -> None:
    model = get_model("mixtral-8x7b")
    # Fiddler's code constants decide: count x 7 < 70, so the CPU takes fewer than 10 tokens
    n_even = 9  # count * t1 < load  <=>  count <= 9
    # prefill: expert 0 chosen by every token, expert 1 by n_even tokens, expert 2 by the rest
    p = n_even + 3
    pre = [[[0, 1 if i < n_even else 2]] * model.moe_layers for i in range(p)]
    dec = [[[3, 4]] * model.moe_layers, [[5, 6]] * model.moe_layers]
    r = routing_from_experts(model, pre + dec, n_prefill=p)
    calib = np.zeros((model.moe_layers, model.experts), dtype=np.int64)
    calib[:, 5] = 10  # the globally most popular experts: expert 5 of every layer
    c, tl, _ = run("fiddler", model, [r], model.moe_layers, calibration=calib)
    pf = tl[tl["token"] == 0]
    assert set(pf[pf["kind"] == "temp"]["expert"]) == {0}
    assert set(pf[pf["kind"] == "cpu_expert"]["expert"]) == {1, 2}
    dl = tl[tl["token"] > 0]
    assert set(dl[dl["kind"] == "cpu_expert"]["expert"]) == {3, 4, 6}
    assert set(dl[(dl["kind"] == "expert")]["expert"]) == {5}
    assert c.fetches == 0 and c.d2h_expert_copies == 0
    assert make_policy("fiddler").resources().host_memory == "pageable"


def test_fiddler_cpu_work_is_synchronous() -> None:
    model = get_model("mixtral-8x7b")
    r = routing_from_experts(model, [[[0, 1]] * model.moe_layers])
    _c, tl, _ = run("fiddler", model, [r], 0)
    cpu = tl[tl["kind"] == "cpu_expert"].sort_values("start")
    assert len(cpu) == 2 * model.moe_layers
    # one after another, never two experts of a layer at once, and the next layer waits
    assert (cpu["start"].to_numpy()[1:] >= cpu["end"].to_numpy()[:-1] - 1e-12).all()


def test_mixtral_offloading_writes_back_and_respects_experts_per_layer() -> None:
    m = tiny_model(experts=8, top_k=2, moe_layers=2)
    rng = np.random.default_rng(0)
    rs = [random_routing(m, s, 3, 12, rng) for s in range(2)]
    c, tl, eng = run("mixtral-offloading", m, rs, 8, {"experts_per_layer": 3})
    assert c.evictions > 0
    assert c.d2h_expert_copies == c.evictions
    assert c.d2h_bytes >= c.evictions * eng.ex.expert_bytes
    assert (tl[tl["kind"] == "writeback"]["resource"] == "d2h").all()
    assert int(eng.resident.sum()) <= 6  # 3 per layer, not the budget of 8
    with pytest.raises(UserError, match="experts_per_layer"):
        run("mixtral-offloading", m, rs, 4, {"experts_per_layer": 3})
    pol = make_policy("mixtral-offloading")
    spec = pol.resources()
    assert spec.writeback and spec.host_memory == "pinned" and spec.staging_buffers == 4


def test_mixtral_offloading_prefetch_with_a_perfect_view_turns_misses_into_hits() -> None:
    m = tiny_model(experts=8, top_k=2, moe_layers=3)
    rng = np.random.default_rng(1)
    ex = [[sorted(rng.choice(8, 2, replace=False).tolist()) for _ in range(3)] for _ in range(30)]
    r = routing_from_experts(m, ex)  # early view = the true routing
    off, _, _ = run("mixtral-offloading", m, [r], 9)
    on, tl, _ = run("mixtral-offloading", m, [r], 9, {"prefetch": True})
    assert on.prefetches > 0
    assert on.decode_hits > off.decode_hits
    assert on.prefetch_used > 0
    assert set(tl[tl["kind"] == "prefetch"]["layer"]) <= {1, 2}


@pytest.mark.parametrize("per_layer", [1, 2, 3])
def test_mixtral_offloading_prefetch_never_breaks_the_engine(per_layer: int) -> None:
    """Noisy early views and tight groups: no eviction of in-flight or needed experts."""
    m = tiny_model(experts=6, top_k=2, moe_layers=3)
    rng = np.random.default_rng(per_layer)
    rs = [random_routing(m, s, 4, 25, rng) for s in range(3)]
    opts = {"prefetch": True, "experts_per_layer": per_layer, "prefetch_k": 2}
    c, _tl, _ = run("mixtral-offloading", m, rs, 3 * per_layer, opts)
    assert c.prefetches > 0
    assert c.max_occupancy <= 3 * per_layer + 4


def test_stream_all_streams_whole_layers_or_selected_experts() -> None:
    m = tiny_model(experts=4, top_k=2, moe_layers=3)
    rng = np.random.default_rng(2)
    rs = [random_routing(m, 0, 0, 5, rng)]
    c, _tl, eng = run("stream-all", m, rs, 8)
    assert eng.policy.options["gather"] == "layer"
    assert c.decode_hits == 0
    assert c.h2d_expert_copies == 5 * 3 * 4  # every expert of every layer, every token
    assert c.cpu_expert_evals == 0
    c2, _, eng2 = run("stream-all", m, rs, 0)
    assert eng2.policy.options["gather"] == "selected"
    assert c2.temp_copies == c2.h2d_expert_copies == 5 * 3 * 2
    assert c2.decode_hits == 0
    with pytest.raises(UserError, match="gather=layer"):
        run("stream-all", m, rs, 7, {"gather": "layer"})
    assert make_policy("stream-all").resources().host_memory == "pinned"


def test_fiddler_decision_constants_option() -> None:
    """Fiddler's prefill rule uses its code's 7/70 by default, or the profile/cost model."""
    model = get_model("mixtral-8x7b")
    costs = cost_model(HW, model)
    calib = np.ones((model.moe_layers, model.experts), dtype=np.int64)

    def constants(choice: str) -> tuple[float, float]:
        pol = make_policy("fiddler", {"constants": choice})
        pol.setup(SetupContext(model, 64, costs, calib, None))
        return pol.t_cpu1, pol.t_load

    assert constants("code") == (7.0, 70.0)
    assert constants("measured") == pytest.approx((8.5e-3, 210e-3))
    assert constants("model") == pytest.approx(
        (costs.cpu_expert_s(1), costs.h2d_expert_s(pinned=False))
    )
    with pytest.raises(UserError, match="constants"):
        make_policy("fiddler", {"constants": "guess"})


_BOUNDED = [
    (name, key, p)
    for name, cls in sorted(available().items())
    for key, p in cls.params.items()
    if p.minimum is not None or p.maximum is not None
]


def test_the_bounded_options_are_the_ones_the_policies_need() -> None:
    """The declared bounds cover the options whose __init__ used to check them by hand."""
    got = {(n, k) for n, k, _ in _BOUNDED}
    for want in [
        ("daop", "cpu_workers"),
        ("daop", "first_predict_layer"),
        ("moe-infinity", "eamc_capacity"),
        ("ktransformers", "gpu_experts_ratio"),
        ("vllm-cpu-offload", "offload_layers"),
        ("mixtral-offloading", "prefetch_k"),
    ]:
        assert want in got


@pytest.mark.parametrize(
    ("name", "key", "param"), _BOUNDED, ids=[f"{n}-{k}" for n, k, _ in _BOUNDED]
)
def test_an_option_outside_its_bounds_is_a_one_line_user_error(name: str, key: str, param) -> None:
    """Just outside a bound is refused, naming the policy and option; the bound itself is fine."""
    for bound, step, word in ((param.minimum, -1, ">="), (param.maximum, 1, "<=")):
        if bound is None:
            continue
        bad = param.type(bound + step) if param.type is int else bound + 0.5 * step
        with pytest.raises(
            UserError, match=rf"policy '{name}': option '{key}' must be {word}"
        ) as e:
            make_policy(name, {key: bad})
        assert "\n" not in str(e.value)
        make_policy(name, {key: param.type(bound)})
