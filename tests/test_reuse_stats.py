"""Reuse statistics: exact values on hand-made traces, and the LRU/Belady hit-rate curves
checked against the engine's own lru and belady runs at every per-layer capacity."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from daopsim.simulator.models import ModelShape
from daopsim.simulator.reuse import LAGS, ReuseAccumulator
from daopsim.simulator.runner import simulate
from daopsim.simulator.stats import trace_stats
from daopsim.simulator.synth import write_synthetic
from daopsim.simulator.synth_params import SynthParams
from daopsim.simulator.testing import make_meta, routing_from_experts, tiny_model
from daopsim.simulator.trace_read import iter_sequences, read_meta, sequence_ids
from daopsim.simulator.trace_write import write_trace

#: The sequences both sides use: the engine evaluates exactly these (``evaluate=``), in file
#: order, and the statistics read the same ones.
EVAL_IDS = [0, 1, 2]


def _engine_rates(
    path: Path, policy: str, capacity: int, layers: int, hw: str = "a6000-pcie4"
) -> tuple[float, list]:
    res = simulate(
        policy,
        hw=hw,
        trace=path,
        gpu_experts=capacity * layers,
        evaluate=EVAL_IDS,
        record=False,
    )
    return res.metrics["hit_rate"], res.per_layer_hit_rate


def _eval_stats(path: Path) -> dict:
    """Stats over the sequences the engine runs evaluate, in their order."""
    meta = read_meta(path)
    assert set(EVAL_IDS) <= set(sequence_ids(path))
    seqs = list(iter_sequences(path, meta, sequences=set(EVAL_IDS)))
    return trace_stats(seqs, meta=meta)


@pytest.mark.parametrize(
    ("experts", "top_k", "layers", "params"),
    [
        (8, 2, 3, SynthParams(token_corr=0.9, temporal_share=0.5)),
        (12, 3, 2, SynthParams(bias_std=0.8, temporal_share=0.2)),
    ],
)
def test_curves_equal_engine_runs(
    tmp_path: Path, experts: int, top_k: int, layers: int, params: SynthParams
) -> None:
    model = tiny_model(experts=experts, top_k=top_k, moe_layers=layers)
    path = tmp_path / "t.parquet"
    write_synthetic(path, model, params, sequences=4, prompt_tokens=12, output_tokens=40, seed=3)
    s = _eval_stats(path)
    assert len(s["lru_curve"]) == experts and len(s["belady_curve"]) == experts
    # capacity E (every expert resident) is left out: the engine keeps one slot of the
    # memory for the temporary buffer, so E x layers does not fit; its hit rate is 1
    for capacity in range(1, experts):
        for policy in ("lru", "belady"):
            rate, per_layer = _engine_rates(path, policy, capacity, layers)
            assert s[f"{policy}_curve"][capacity - 1] == pytest.approx(rate, abs=1e-9)
            for layer in range(layers):
                got = s["per_layer"][layer][f"{policy}_curve"][capacity - 1]
                assert got == pytest.approx(per_layer[layer], abs=1e-9), (policy, capacity)
    assert s["lru_curve"][-1] == 1.0 and s["belady_curve"][-1] == 1.0
    # the clairvoyant victim choice pays off somewhere above k
    assert any(b > a for a, b in zip(s["lru_curve"], s["belady_curve"], strict=True))


# 1 layer, 6 experts, top-2; prefill [0,1],[0,2]; decode tokens below
DECODE = [[0, 1], [2, 3], [0, 1], [4, 5], [0, 2], [0, 1]]


def _hand(tmp_path: Path) -> tuple[Path, ModelShape]:
    model = tiny_model(experts=6, top_k=2, moe_layers=1)
    experts = np.array([[[0, 1]], [[0, 2]]] + [[d] for d in DECODE])
    r = routing_from_experts(model, experts, n_prefill=2)
    return write_trace(tmp_path / "h.parquet", make_meta(model), [r]), model


def test_hand_made_reuse_values(tmp_path: Path) -> None:
    path, _ = _hand(tmp_path)
    s = trace_stats(path)
    lag = s["overlap_by_lag"]
    # lag 1 pairs: (01,23) 0, (23,01) 0, (01,45) 0, (45,02) 0, (02,01) 1/2
    assert lag["1"] == pytest.approx(0.5 / 5)
    # lag 2: (01,01) 1, (23,45) 0, (01,02) 1/2, (45,01) 0
    assert lag["2"] == pytest.approx(1.5 / 4)
    # lag 4: (01,02) 1/2, (23,01) 0
    assert lag["4"] == pytest.approx(0.5 / 2)
    assert lag["8"] is None and set(lag) == {str(x) for x in LAGS}
    rd = s["reuse_distance"]
    # reuses (gap in tokens): expert 0 at t2 (2), t4 (2), t5 (1); expert 1 at t2 (2), t5 (3);
    # expert 2 at t4 (3); six first uses of 12 accesses
    assert rd["first_use"] == pytest.approx(6 / 12)
    assert rd["share"][:3] == pytest.approx([1 / 12, 3 / 12, 2 / 12])
    assert sum(rd["share"]) + rd["first_use"] == pytest.approx(1.0)
    assert rd["mean"] == pytest.approx(13 / 6)
    assert rd["p50"] == 2.0
    # windows of 8 tokens do not fit in 6 decode tokens
    assert s["working_set"]["8"] is None


def test_hand_made_lru_curve(tmp_path: Path) -> None:
    path, _ = _hand(tmp_path)
    s = trace_stats(path)
    # capacity 2: starts {0,1}; prefill {0,1,2} by count: 0 (2), 1, 2 -> 2 is a temp copy
    # decode 01 hit hit; 23 miss miss -> {2,3}; 01 miss miss; 45 miss miss; 02 0 miss 2 miss
    # -> {0,2}; 01: 0 hit, 1 miss -> 3 hits of 12
    assert s["lru_curve"][1] == pytest.approx(3 / 12)
    # capacity 1 holds one of the token's experts at most: the second always goes to a temp
    assert 0 <= s["lru_curve"][0] <= 0.5
    assert s["lru_curve"][5] == 1.0


def test_no_curves_option(tmp_path: Path) -> None:
    path, _ = _hand(tmp_path)
    s = trace_stats(path, curves=False)
    assert s["lru_curve"] is None and s["overlap_by_lag"]["1"] is not None


def test_accumulator_without_decode_tokens() -> None:
    acc = ReuseAccumulator(layers=2, experts=4, top_k=1)
    out = acc.finish()
    assert out["lru_curve"] is None
    assert all(v is None for v in out["overlap_by_lag"].values())


def test_cli_stats_prints_reuse_and_skips_curves(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from daopsim.simulator.cli import main

    path, _ = _hand(tmp_path)
    res = CliRunner().invoke(main, ["trace", "stats", str(path)])
    assert res.exit_code == 0, res.output
    assert "reuse over decode tokens" in res.output and "LRU hit rate" in res.output
    res = CliRunner().invoke(main, ["trace", "stats", str(path), "--no-curves", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["lru_curve"] is None and data["overlap_by_lag"]["2"] == pytest.approx(1.5 / 4)
    assert data["per_layer"][0]["reuse_distance"]["first_use"] == pytest.approx(0.5)


def test_curves_at_chosen_capacities_only(tmp_path: Path) -> None:
    path, _ = _hand(tmp_path)
    full = trace_stats(path)
    some = trace_stats(path, curves=("lru",), capacities=(2, 5))
    assert some["belady_curve"] is None
    assert some["lru_curve"][1] == full["lru_curve"][1]
    assert some["lru_curve"][4] == full["lru_curve"][4]
    assert some["lru_curve"][0] is None and some["lru_curve"][5] is None
    with pytest.raises(ValueError, match="capacities"):
        trace_stats(path, capacities=(0,))


@pytest.mark.parametrize("policy", ["lru", "belady"])
def test_curves_equal_engine_on_bundled_ci_trace(policy: str) -> None:
    """The bundled CI trace (Mixtral shape, 32 prompt tokens using all experts per layer)."""
    from daopsim.simulator.data import resolve_trace

    path = resolve_trace("ci-small")
    s = _eval_stats(path)
    for capacity in (1, 3, 5):  # 5 x 32 Mixtral experts fit in 80 GB
        rate, _ = _engine_rates(path, policy, capacity, 32, hw="a100-80g-pcie4")
        assert s[f"{policy}_curve"][capacity - 1] == pytest.approx(rate, abs=1e-9), capacity
