"""DAOP policy: each rule of DAOP's code (docs/daop.md) pinned on hand-made routing.

DAOP's numbers on the bundled traces (defaults, ``exact_fallback``, ``persist_placement=false``)
live in the golden store with every other policy's (tests/test_golden.py, docs/regression.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from daopsim.policies.base import Action, Plan, SetupContext, View
from daopsim.policies.daop import DAOPPolicy, swap_pairs
from daopsim.simulator.core.loop import Engine
from daopsim.simulator.costs import cost_model
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.models import get_model
from daopsim.simulator.testing import make_trace, routing_from_experts, tiny_model


def calib_first_four(n_layers: int = 2, n_exp: int = 8) -> np.ndarray:
    """Calibration counts that make experts 0..3 of every layer the most popular."""
    cal = np.zeros((n_layers, n_exp), dtype=np.int64)
    cal[:, :4] = [[40, 30, 20, 10]] * n_layers
    return cal


class Spy(DAOPPolicy):
    """DAOP that keeps every plan it returns: (phase, seq, token, layer, plan)."""

    name = "daop"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.log: list[tuple[str, int, int, int, Plan]] = []
        self._seq = -1

    def on_sequence_start(self, seq_id: int, n_prefill: int) -> None:
        self._seq = seq_id
        super().on_sequence_start(seq_id, n_prefill)

    def prefill_layer(self, view: View) -> Plan:
        plan = super().prefill_layer(view)
        self.log.append(("prefill", self._seq, view.token, view.layer, plan))
        return plan

    def decode_layer(self, view: View) -> Plan:
        plan = super().decode_layer(view)
        self.log.append(("decode", self._seq, view.token, view.layer, plan))
        return plan


def run_engine(
    policy: DAOPPolicy, routings: list[Any], n_layers: int = 2, budget: int | None = None
) -> Engine:
    """Replay hand-made routings through the engine on the A6000 profile."""
    model = tiny_model(moe_layers=n_layers)
    costs = cost_model(load_profile("a6000-pcie4"), model)
    eng = Engine(
        policy,
        model,
        costs,
        budget if budget is not None else 4 * n_layers,
        calibration=calib_first_four(n_layers),
    )
    eng.run(routings)
    return eng


def prompt_with_counts(counts: dict[int, int]) -> list[list[int]]:
    """Top-2 token rows whose per-expert counts are ``counts`` (sum even, max <= half)."""
    left = dict(counts)
    rows = []
    while any(left.values()):
        a, b = sorted((e for e in left if left[e] > 0), key=lambda e: (-left[e], e))[:2]
        rows.append([a, b])
        left[a] -= 1
        left[b] -= 1
    return rows


def routing(prefill_l0: list[list[int]], decode: list[list[list[int]]], seq: int = 0, **kw: Any):
    """Layer 0 prompt rows as given, layer 1 prompt rows [0, 1]; decode rows as given."""
    model = tiny_model(moe_layers=2)
    rows = [[r, [0, 1]] for r in prefill_l0] + decode
    return routing_from_experts(model, rows, n_prefill=len(prefill_l0), seq_id=seq, **kw)


# -- prefill swaps ---------------------------------------------------------------------------------
ON_GPU = np.array([True] * 4 + [False] * 4)


def counts_of(values: dict[int, int]) -> np.ndarray:
    out = np.zeros(8, dtype=np.int64)
    for e, c in values.items():
        out[e] = c
    return out


def test_swap_threshold_is_strict_6_vs_5_swaps_5_vs_5_does_not() -> None:
    """6 > 1.05 x 5 = 5.25 swaps; 5 > 5.25 does not."""
    base = {0: 5, 1: 9, 2: 9, 3: 9, 5: 1, 6: 1, 7: 1}
    assert swap_pairs(counts_of({**base, 4: 6}), ON_GPU, 1, 1.05, 20) == [(4, 0)]
    assert swap_pairs(counts_of({**base, 4: 5}), ON_GPU, 1, 1.05, 20) == []


def test_ineligible_pairs_are_skipped_not_stopping_the_scan() -> None:
    """A CPU expert no prompt token chose ranks coldest in the code's masked list: skipped."""
    c = counts_of({0: 2, 1: 5, 2: 6, 3: 7, 4: 0, 5: 10, 6: 9, 7: 1})
    # code lists: hot [5, 6], cold [4 (CPU, score 0), 0]; pair (5, 4) is ineligible
    assert swap_pairs(c, ON_GPU, 2, 1.05, 20, "code") == [(6, 0)]
    assert swap_pairs(c, ON_GPU, 2, 1.05, 20, "filtered") == [(5, 0), (6, 1)]
    # fewer CPU experts than swap_num: the padding pairs (GPU expert as hot) are skipped
    gpu6 = np.array([True] * 6 + [False] * 2)
    c2 = counts_of({0: 1, 1: 1, 2: 9, 3: 9, 4: 9, 5: 9, 6: 8, 7: 7})
    assert swap_pairs(c2, gpu6, 4, 1.05, 20, "code") == [(6, 0), (7, 1)]


def test_prefill_swap_fetches_hot_evicts_cold_and_persists_across_sequences() -> None:
    """Swap in seq 0's prefill; seq 1 hits the swapped-in expert without new copies."""
    counts = {0: 5, 1: 10, 2: 9, 3: 9, 4: 6, 5: 1, 6: 1, 7: 1}
    seq0 = routing(prompt_with_counts(counts), [[[4, 1], [0, 1]]], seq=0)
    seq1 = routing([[1, 2], [2, 3]], [[[4, 1], [0, 1]]], seq=1)
    pol = Spy(swap_num=1)
    eng = run_engine(pol, [seq0, seq1])
    assert eng.resident[0, 4] and not eng.resident[0, 0]
    assert pol.swaps == [(0, 4, 0)]
    pre0 = next(p for ph, s, _, layer, p in pol.log if ph == "prefill" and s == 0 and layer == 0)
    assert pre0.actions[4] == Action.FETCH and pre0.evict == [(0, 0)]
    assert pre0.actions[0] == Action.CPU  # the cold expert's 5 tokens: below break-even
    # the cold expert goes back to the host (.to("cpu")) before the hot one comes up
    assert eng.c.fetches == 1 and eng.c.d2h_expert_copies == 1
    dec1 = next(p for ph, s, _, layer, p in pol.log if ph == "decode" and s == 1 and layer == 0)
    assert dec1.actions[4] == Action.GPU


def test_no_persist_restores_initial_placement_at_next_sequence() -> None:
    """persist_placement off: seq 1's prefill copies the initial expert back."""
    counts = {0: 5, 1: 10, 2: 9, 3: 9, 4: 6, 5: 1, 6: 1, 7: 1}
    seq0 = routing(prompt_with_counts(counts), [[[4, 1], [0, 1]]], seq=0)
    seq1 = routing([[1, 2], [2, 3]], [[[4, 1], [0, 1]]], seq=1)
    pol = Spy(swap_num=1, persist_placement=False)
    eng = run_engine(pol, [seq0, seq1])
    assert eng.resident[0, 0] and not eng.resident[0, 4]
    assert eng.c.h2d_expert_copies == 2  # the swap, then the restore
    dec1 = next(p for ph, s, _, layer, p in pol.log if ph == "decode" and s == 1 and layer == 0)
    assert dec1.actions[4] == Action.CPU


def make_policy(**options: Any) -> DAOPPolicy:
    """A DAOP policy set up on the tiny model (2 layers, experts 0..3 resident)."""
    pol = DAOPPolicy(**options)
    model = tiny_model(moe_layers=2)
    costs = cost_model(load_profile("a6000-pcie4"), model)
    ctx = SetupContext(model, 8, costs, calib_first_four(), None)
    pol.setup(ctx)
    return pol


def view_for(pol: DAOPPolicy, layer: int, **fields: Any) -> View:
    v = View()
    v.layer = layer
    resident = np.zeros((pol.n_layers, pol.n_experts), dtype=bool)
    resident[:, :4] = True
    v.resident = resident
    for k, val in fields.items():
        setattr(v, k, val)
    return v


def test_prefill_cpu_below_breakeven_temp_copy_at_or_above() -> None:
    """count x T_cpu < T_load runs on the CPU; otherwise a temporary copy."""
    pol = make_policy(swap_num=0)
    n_even = pol.t_load / pol.t_cpu
    below = int(np.ceil(n_even)) - 1
    above = int(np.ceil(n_even)) if np.ceil(n_even) > n_even else int(n_even)
    assert below * pol.t_cpu < pol.t_load <= above * pol.t_cpu
    counts = counts_of({0: 1, 4: below, 5: above})
    v = view_for(pol, 0, phase="prefill", counts=counts, experts=np.array([5, 4, 0]))
    v.n_tokens = above
    plan = pol.prefill_layer(v)
    assert plan.actions == {5: Action.TEMP, 4: Action.CPU, 0: Action.GPU}


def test_decision_constants_are_options_not_execution_times() -> None:
    """DAOP decides with its own constants; the engine's copy time is the link's."""
    mixtral = get_model("mixtral-8x7b")
    costs = cost_model(load_profile("a6000-x299-pcie3"), mixtral)
    calib = np.ones((mixtral.moe_layers, mixtral.experts), dtype=np.int64)

    def constants(**opt: Any) -> tuple[float, float]:
        pol = DAOPPolicy(**opt)
        pol.setup(SetupContext(mixtral, 120, costs, calib, None))
        return pol.t_cpu, pol.t_load

    # default: DAOP's measured table for the A6000 (8.5 ms, 210 ms): break-even about 25 tokens
    assert constants() == pytest.approx((8.5e-3, 210e-3))
    # 'model': what the simulator itself would charge (a Gen3 pageable copy)
    t_cpu, t_load = constants(constants="model")
    assert t_cpu == pytest.approx(costs.cpu_expert_s(1))
    assert t_load == pytest.approx(costs.h2d_expert_s(pinned=False)) and t_load < 0.1
    assert constants(t_cpu_ms=5.0, t_load_ms=40.0) == pytest.approx((5e-3, 40e-3))
    # the engine never charges the 210 ms: copies are timed by the link
    assert costs.h2d_expert_s(pinned=False) == pytest.approx(6e-6 + 352_321_536 / 6.9e9)


# -- decode ----------------------------------------------------------------------------------------
def test_degradation_picks_best_gpu_expert_by_router_probability() -> None:
    """Both predicted experts on the CPU: the lower one gives way to the best GPU expert."""
    pol = make_policy(first_predict_layer=1)
    probs = np.array([0.05, 0.02, 0.12, 0.01, 0.05, 0.40, 0.30, 0.05])
    v0 = view_for(
        pol,
        0,
        experts=np.array([0, 1]),
        next_experts=np.array([5, 6]),
        next_probs=probs,
    )
    plan0 = pol.decode_layer(v0)
    assert plan0.precalc == [(1, 5)]  # expert 6 dropped, GPU expert 2 needs no pre-calc
    v1 = view_for(pol, 1, experts=np.array([5, 6]))
    plan1 = pol.decode_layer(v1)
    assert plan1.route.tolist() == [5, 2]
    assert plan1.raw_route.tolist() == [5, 6]
    assert plan1.actions == {5: Action.PRECOMPUTED, 2: Action.GPU}


def test_without_degradation_both_cpu_experts_are_precalculated() -> None:
    pol = make_policy(first_predict_layer=1, graceful_degradation=False)
    probs = np.array([0.05, 0.02, 0.12, 0.01, 0.05, 0.40, 0.30, 0.05])
    v0 = view_for(pol, 0, experts=np.array([0, 1]), next_experts=np.array([5, 6]), next_probs=probs)
    assert pol.decode_layer(v0).precalc == [(1, 5), (1, 6)]


def _decode_pair(
    pol: DAOPPolicy, resident: np.ndarray, nxt: list[int], probs: np.ndarray
) -> tuple[Plan, Plan]:
    """Layer 0 predicting layer 1 as ``nxt``, then layer 1 consuming it, on ``resident``."""
    v0 = view_for(pol, 0, experts=np.array([0, 1]), next_experts=np.array(nxt), next_probs=probs)
    v0.resident = resident
    p0 = pol.decode_layer(v0)
    v1 = view_for(pol, 1, experts=np.array(nxt))
    v1.resident = resident
    return p0, pol.decode_layer(v1)


def test_memoised_predictions_follow_the_residency_and_the_probabilities() -> None:
    """The same top-k gives the same plans while the residency stays, other plans once it
    changes (the memo is dropped), and a degraded top-k follows the probabilities each time."""
    pol = make_policy(first_predict_layer=1)
    fresh = make_policy(first_predict_layer=1)  # one call each, nothing memoised before
    res = np.zeros((2, 8), dtype=bool)
    res[:, :4] = True
    probs = np.array([0.05, 0.02, 0.12, 0.01, 0.05, 0.40, 0.30, 0.05])
    # not degraded (expert 1 on the GPU): the second call is served from the memo
    a0, a1 = _decode_pair(pol, res, [5, 1], probs)
    b0, b1 = _decode_pair(pol, res, [5, 1], probs)
    assert a0.precalc == b0.precalc == [(1, 5)] and a1.actions == b1.actions
    assert b1.actions == {5: Action.PRECOMPUTED, 1: Action.GPU} and b1.route.tolist() == [5, 1]
    # expert 5 moves to the GPU (a prefill swap would do this): no pre-calculation any more
    res2 = res.copy()
    res2[1, 5] = True
    c0, c1 = _decode_pair(pol, res2, [5, 1], probs)
    f0, f1 = _decode_pair(fresh, res2, [5, 1], probs)
    assert c0.precalc == f0.precalc == []
    assert c1.actions == f1.actions == {5: Action.GPU, 1: Action.GPU}
    # degraded: both predicted on the CPU; the GPU expert picked follows the probabilities
    d0, d1 = _decode_pair(pol, res, [5, 6], probs)
    assert d1.route.tolist() == [5, 2] and d0.precalc == [(1, 5)]
    probs2 = probs.copy()
    probs2[3] = 0.2
    e0, e1 = _decode_pair(pol, res, [5, 6], probs2)
    assert e1.route.tolist() == [5, 3] and e1.raw_route.tolist() == [5, 6]
    assert e0.precalc == [(1, 5)] and e1.actions == {5: Action.PRECOMPUTED, 3: Action.GPU}


@pytest.mark.parametrize(
    ("gpu_probs", "picked"),
    [
        ([0.1, 0.3, 0.3, 0.2], 1),  # a tie: the first of the best
        ([np.nan, -0.5, -0.2, -0.1], 0),  # NaN counts as 0, above the negatives
        ([0.1, np.inf, 0.2, np.inf], 1),  # +inf is the largest float; first of two
        ([-np.inf, -np.inf, np.nan, -1.0], 2),  # -inf below everything, NaN -> 0
    ],
)
def test_degradation_argmax_matches_numpy(gpu_probs: list[float], picked: int) -> None:
    """The GPU expert chosen is np.argmax(np.nan_to_num(p, nan=0.0)) over GPU experts."""
    probs = np.array([*gpu_probs, 0.0, 0.0, 0.0, 0.0])
    assert int(np.argmax(np.nan_to_num(probs[:4], nan=0.0))) == picked
    pol = make_policy(first_predict_layer=1)
    res = np.zeros((2, 8), dtype=bool)
    res[:, :4] = True
    for _ in range(2):  # the second time through the memo
        _, plan1 = _decode_pair(pol, res, [5, 6], probs)
        assert plan1.route.tolist() == [5, picked]


def test_prediction_is_the_routing_from_first_predict_layer_on() -> None:
    """Layer >= first_predict_layer uses the early view; below it routes exactly."""
    model = tiny_model(moe_layers=4)
    true = [[[0, 4]] * 4] * 2 + [[[0, 4], [1, 5], [2, 6], [3, 7]]]
    early = [[[0, 4]] * 4] * 2 + [[[0, 4], [1, 5], [2, 6], [3, 6]]]  # layer 3 predicted wrong
    r = routing_from_experts(model, true, n_prefill=2, early_experts=early)
    pol = Spy(first_predict_layer=2, swap_num=0)
    eng = run_engine(pol, [r], n_layers=4, budget=16)
    dec = {layer: p for ph, _, _, layer, p in pol.log if ph == "decode"}
    assert dec[0].route is None and dec[1].route is None
    assert dec[0].actions == {0: Action.GPU, 4: Action.CPU}
    assert dec[2].route.tolist() == [2, 6] and dec[3].route.tolist() == [3, 6]
    assert dec[3].actions == {3: Action.GPU, 6: Action.PRECOMPUTED}
    assert dec[1].precalc == [(2, 6)] and dec[2].precalc == [(3, 6)]
    c = eng.c
    assert (c.replaced_mispredicted, c.replaced_degraded, c.true_accesses) == (1, 0, 8)
    assert c.cpu_precalc_evals == 2 and c.precalc_wasted == 0


def test_last_layer_quirk_drops_the_cpu_expert_and_wastes_its_precalc() -> None:
    model = tiny_model(moe_layers=4)
    rows = [[[0, 4]] * 4] * 2 + [[[0, 4], [1, 5], [2, 6], [3, 7]]]
    r = routing_from_experts(model, rows, n_prefill=2)
    pol = Spy(first_predict_layer=2, swap_num=0, last_layer_quirk=True)
    eng = run_engine(pol, [r], n_layers=4, budget=16)
    last = next(p for ph, _, _, layer, p in pol.log if ph == "decode" and layer == 3)
    assert last.route.tolist() == [3] and last.actions == {3: Action.GPU}
    assert eng.c.precalc_wasted == 1 and eng.c.replaced_degraded == 1


@pytest.fixture(scope="module")
def random_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("daop") / "t.parquet"
    return make_trace(path, sequences=4, prefill=12, decode=12, seed=5)


def test_exact_fallback_keeps_routing_fidelity_at_one(random_trace: Path) -> None:
    from daopsim.simulator.runner import simulate

    base = simulate(
        "daop",
        trace=random_trace,
        cache_ratio=0.25,
        record=False,
        policy_options={"first_predict_layer": 1},
    ).metrics
    exact = simulate(
        "daop",
        trace=random_trace,
        cache_ratio=0.25,
        record=False,
        policy_options={"first_predict_layer": 1, "exact_fallback": True},
    ).metrics
    assert base["routing_replaced_frac"] > 0 and base["gate_mass_preserved"] < 1
    assert exact["routing_replaced_frac"] == 0 and exact["gate_mass_preserved"] == 1.0
    assert exact["cpu_precalc_evals"] == base["cpu_precalc_evals"]


def test_bad_options_are_user_errors() -> None:
    from daopsim.simulator.errors import UserError

    with pytest.raises(UserError, match="first_predict_layer"):
        DAOPPolicy(first_predict_layer=0)
    with pytest.raises(UserError, match="cpu_workers"):
        DAOPPolicy(cpu_workers=0)


# -- the paper's experiment (tiny version) ---------------------------------------------------------
def test_experiment_cli_tiny(tmp_path: Path, cli: Any) -> None:
    """The daop-paper machinery on ci-small: table, skipped point, speed-ups, files."""
    src = (Path(__file__).parent.parent / "experiments" / "daop-paper.toml").read_text()
    small = src.split("[[models]]")[0].replace(
        "cache_ratios = [0.25, 0.375, 0.46875, 0.5, 0.625]", "cache_ratios = [0.25, 0.625]"
    )
    small += '[[models]]\ntrace = "ci-small"\n'
    small += 'fixed = { "mixtral-offloading" = { experts_per_layer = 3 } }\n\n'
    small += "[policies" + src.split("[policies", 1)[1]
    exp = tmp_path / "tiny.toml"
    exp.write_text(small)
    out = tmp_path / "out"
    res = cli("experiment", str(exp), "--sequences", "1", "--out", str(out), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    pols = {(r["policy"], round(r["cache_ratio"], 4)) for r in doc["rows"]}
    for p in ("daop", "fiddler", "static"):
        assert (p, 0.25) in pols
    assert ("mixtral-offloading", 0.375) in pols
    assert {s["cache_ratio"] for s in doc["skipped"]} == {0.625}
    # stream-all keeps nothing resident: one run with the memory that fits, never skipped
    stream = [r for r in doc["rows"] if r["policy"] == "stream-all"]
    assert len(stream) == 1 and stream[0]["fixed"] and stream[0]["gpu_experts"] > 0
    assert "stream-all" not in {s["policy"] for s in doc["skipped"]}
    assert doc["speedups"][0]["vs_stream-all"] > 0
    assert all("do not fit" in s["reason"] for s in doc["skipped"])
    sp = doc["speedups"][0]
    daop = next(r for r in doc["rows"] if r["policy"] == "daop")
    fid = next(r for r in doc["rows"] if r["policy"] == "fiddler")
    assert sp["vs_fiddler"] == pytest.approx(daop["tokens_per_s"] / fid["tokens_per_s"])
    for name in ("results.csv", "results.parquet", "speedups.csv", "tokens_per_s.png"):
        assert (out / name).stat().st_size > 0
    # the routing cost beside the speed-up: DAOP's replaced routing, the exact baselines
    fidelity = doc["min_gate_mass_preserved"]
    assert fidelity["daop"] < 1 and fidelity["fiddler"] == 1
    assert fidelity["daop"] == min(
        r["gate_mass_preserved"] for r in doc["rows"] if r["policy"] == "daop"
    )
    assert "routing fidelity (gate mass preserved)" in (out / "summary.txt").read_text()


def test_experiment_unknown_policy_fails_clearly(tmp_path: Path, cli: Any) -> None:
    exp = tmp_path / "bad.toml"
    exp.write_text(
        'hw = "a6000-pcie4"\ncache_ratios = [0.25]\ntarget = "daop"\n'
        '[[models]]\ntrace = "ci-small"\n[policies.daop]\n[policies.no-such-policy]\n'
    )
    res = cli("experiment", str(exp))
    assert res.exit_code == 2 and "no-such-policy" in res.stderr
