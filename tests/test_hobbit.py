"""hobbit: HOBBIT's mixed-precision loading rule, the low-bit copy's timing and its fidelity.

The rule and the numbers are computed by hand here: which misses load a low-bit copy or are
skipped (gate mass share of higher-ranked experts against 0.6 and 0.9), what the low-bit copy
moves and costs over the link (bytes of the dtype, copy overhead + bytes / pinned rate, from
the profile's own fields), and the share of gate mass computed in low precision.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest

from daopsim.policies.base import Action, Plan, Policy, ResourceSpec
from daopsim.policies.hobbit import HobbitPolicy
from daopsim.simulator.core.loop import Engine
from daopsim.simulator.core.ops import Counters
from daopsim.simulator.costs import cost_model
from daopsim.simulator.errors import PolicyError, UserError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.precisions import DTYPE_BYTES
from daopsim.simulator.recorder import Recorder
from daopsim.simulator.reference import ReferenceEngine
from daopsim.simulator.results import compute_metrics
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import routing_from_experts, tiny_model

HW = load_profile("a6000-pcie4")


def run(
    pol: Policy, model: Any, experts: list[Any], weights: list[Any], budget: int
) -> tuple[Counters, pd.DataFrame, dict[str, Any]]:
    """Run ``pol`` on one decode-only sequence; counters, timeline and metrics."""
    r = routing_from_experts(model, experts, weights=weights)
    rec = Recorder()
    eng = Engine(pol, model, cost_model(HW, model), budget, recorder=rec)
    stats = eng.run(iter([r]))
    return stats.counters, rec.timeline(), compute_metrics(stats, HW)


def test_classify_by_the_gate_mass_of_higher_ranked_experts() -> None:
    pol = HobbitPolicy()
    none = np.zeros(4, dtype=bool)
    # shares of the experts ranked above: 0, 0.5, 0.8, 0.95 -> full, full, low, skip
    assert pol.classify([0, 1, 2, 3], [0.5, 0.3, 0.15, 0.05], none) == ([2], [3])
    # unnormalised weights give the same shares; a resident expert is never touched
    res = np.array([False, False, True, False])
    assert pol.classify([0, 1, 2, 3], [1.0, 0.6, 0.3, 0.1], res) == ([], [3])
    # the boundaries are exclusive: a share of exactly 0.6 still loads the full copy
    assert pol.classify([0, 1], [0.6, 0.4], none) == ([], [])
    strict = HobbitPolicy(low_bit_threshold=0.5, skip_threshold=1.0)
    assert strict.classify([0, 1, 2, 3], [0.5, 0.3, 0.15, 0.05], none) == ([2, 3], [])


def test_low_bit_copy_moves_and_costs_the_low_bit_bytes() -> None:
    model = tiny_model(experts=4, top_k=2, moe_layers=1)
    # budget 1: expert 0 resident; token 0's expert 1 (share 0.7) loads its q4_0 copy; token
    # 1's expert 2 (share 0) is fetched in full, evicting expert 0, and expert 3 (share 0.45)
    # also needs full precision but the one slot holds expert 2: a full temporary copy
    c, tl, m = run(HobbitPolicy(), model, [[[0, 1]], [[2, 3]]], [[[0.7, 0.3]], [[0.45, 0.55]]], 1)
    temp = tl[tl["kind"] == "temp"]
    assert temp["expert"].tolist() == [1, 3]
    low_bytes = round(model.params_per_expert * DTYPE_BYTES["q4_0"])
    full = model.expert_bytes()
    assert temp["bytes"].tolist() == [low_bytes, full]
    assert low_bytes < full / 3  # 4.5 of 16 bits
    link = HW.link
    rate = link.h2d_pinned_gbs * 1e9
    took = (temp["end"] - temp["start"]).tolist()
    assert took[0] == pytest.approx(link.copy_overhead_us * 1e-6 + low_bytes / rate, rel=1e-12)
    assert took[1] == pytest.approx(link.copy_overhead_us * 1e-6 + full / rate, rel=1e-12)
    fetch = tl[tl["kind"] == "fetch"]
    assert fetch["expert"].tolist() == [2]
    assert fetch["bytes"].tolist() == [full]
    assert c.h2d_bytes == low_bytes + 2 * full
    assert c.low_bit_copies == 1 and m["low_bit_copies"] == 1
    assert c.temp_copies == 2
    # gate mass in low precision: 0.3 of the 2.0 the two tokens carry
    assert m["low_precision_gate_mass"] == pytest.approx(0.3 / 2.0)
    assert m["gate_mass_preserved"] == pytest.approx(1.0)


def test_skipped_expert_counts_as_degraded_routing() -> None:
    model = tiny_model(experts=4, top_k=2, moe_layers=1)
    c, tl, m = run(HobbitPolicy(), model, [[[0, 1]]], [[[0.95, 0.05]]], 1)
    assert tl[tl["kind"].isin(["temp", "fetch"])].empty  # expert 1 was skipped
    assert c.replaced_degraded == 1 and c.replaced_mispredicted == 0
    assert m["gate_mass_preserved"] == pytest.approx(0.95)
    assert m["low_precision_gate_mass"] == 0.0


@pytest.mark.reference
def test_both_engines_time_low_bit_copies_alike() -> None:
    model = tiny_model(experts=8, top_k=2, moe_layers=3)
    rng = np.random.default_rng(3)
    ex = [[rng.choice(8, 2, replace=False).tolist() for _ in range(3)] for _ in range(30)]
    w = [[[0.62, 0.38] for _ in range(3)] for _ in range(30)]
    r = routing_from_experts(model, ex, weights=w)
    out = []
    for cls in (Engine, ReferenceEngine):
        rec = Recorder()
        stats = cls(HobbitPolicy(), model, cost_model(HW, model), 4, recorder=rec).run(iter([r]))
        out.append((rec.timeline(), stats.counters))
    (ta, ca), (tb, cb) = out
    assert ca.low_bit_copies > 0 and ca.low_bit_copies == cb.low_bit_copies
    assert ca.gate_mass_low_bit == pytest.approx(cb.gate_mass_low_bit)
    cols = ["resource", "kind", "layer", "expert", "bytes", "start", "end"]
    key = ["start", "resource", "expert"]
    a = ta[cols].astype({"resource": str, "kind": str}).sort_values(key).reset_index(drop=True)
    b = tb[cols].astype({"resource": str, "kind": str}).sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b, check_exact=False, atol=1e-12, rtol=0)


class _LowBitOnHit(Policy):
    """Names a resident expert as a low-bit copy (refused)."""

    name = "low-bit-on-hit"

    def __init__(self, dtype: str | None = "int4", **options: Any) -> None:
        super().__init__(**options)
        self.dtype = dtype

    def resources(self) -> ResourceSpec:
        return ResourceSpec(low_bit_dtype=self.dtype)

    def setup(self, ctx: Any) -> list[tuple[int, int]]:
        return [(0, 0), (0, 1)]

    def decode_layer(self, view: Any) -> Plan:
        experts = view.experts.tolist()
        return Plan(actions={e: Action.GPU for e in experts}, low_bit=frozenset(experts[:1]))


@pytest.mark.parametrize("dtype", ["int4", None])
def test_plan_low_bit_must_name_temp_copies_of_a_low_bit_system(dtype: str | None) -> None:
    model = tiny_model(experts=4, top_k=2, moe_layers=1)
    r = routing_from_experts(model, [[[0, 1]]])
    eng = Engine(_LowBitOnHit(dtype), model, cost_model(HW, model), 2)
    with pytest.raises(PolicyError, match="low-bit"):
        eng.run(iter([r]))


def test_bad_options_are_one_line_errors() -> None:
    with pytest.raises(UserError, match="low_bit"):
        HobbitPolicy(low_bit="int3")
    with pytest.raises(UserError, match="threshold"):
        HobbitPolicy(low_bit_threshold=0.9, skip_threshold=0.6)
    with pytest.raises(UserError, match="not smaller"):
        simulate(policy="hobbit", trace="ci-small", sequences=1, dtype="int4", record=False)


def test_runs_on_a_bundled_trace_with_fewer_bytes_than_lru() -> None:
    kw: dict[str, Any] = {"trace": "ci-small", "sequences": 1, "cache_ratio": 0.25}
    lru = simulate(policy="lru", record=False, **kw)
    hob = simulate(policy="hobbit", record=False, **kw)
    assert hob.metrics["low_bit_copies"] > 0
    assert 0 < hob.metrics["low_precision_gate_mass"] < 0.5
    assert hob.metrics["h2d_bytes"] < lru.metrics["h2d_bytes"]
    assert lru.metrics["low_precision_gate_mass"] == 0.0
