"""Routing statistics: chance values on uniform routing, exact values on hand-made traces."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from daopsim.simulator.stats import STAT_KEYS, trace_stats, uniform_baseline
from daopsim.simulator.testing import make_meta, make_trace, routing_from_experts, tiny_model
from daopsim.simulator.trace_write import write_trace


def test_uniform_baseline_matches_reference() -> None:
    # docs/references.md#routing: random top-2 of 8
    base = uniform_baseline(8, 2)
    assert base["consecutive_overlap"] == pytest.approx(0.25)
    assert base["top1_repeat"] == pytest.approx(0.125)
    assert base["same_set"] == pytest.approx(0.036, abs=5e-4)
    assert base["any_shared"] == pytest.approx(0.464, abs=5e-4)
    assert base["entropy_bits"] == pytest.approx(3.0)
    assert base["max_share"] == pytest.approx(0.125)


@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (16, 4)])
def test_uniform_random_routing_sits_at_chance(tmp_path: Path, experts: int, top_k: int) -> None:
    model = tiny_model(experts=experts, top_k=top_k)
    path = make_trace(
        tmp_path / "u.parquet", model=model, sequences=3, prefill=50, decode=1500, seed=42
    )
    s = trace_stats(path)
    n = experts
    sets = math.comb(n, top_k)
    assert s["consecutive_overlap"] == pytest.approx(top_k / n, abs=0.012)
    assert s["top1_repeat"] == pytest.approx(1 / n, abs=0.012)
    assert s["same_set"] == pytest.approx(1 / sets, abs=0.007)
    assert s["any_shared"] == pytest.approx(1 - math.comb(n - top_k, top_k) / sets, abs=0.018)
    assert s["entropy_bits"] == pytest.approx(math.log2(n), abs=0.01)
    assert s["max_share"] == pytest.approx(1 / n, abs=0.012)
    assert s["decode_tokens"] == 4500 and s["prefill_tokens"] == 150
    assert s["token_pairs"] == 3 * 1499
    # the generator's early view is a noisy copy of the real router: well above chance
    assert top_k / n + 0.1 < s["lookahead_precision"] < 1.0
    assert s["per_layer"][0]["lookahead_precision"] is None


# Hand-made: 2 MoE layers, 8 experts, top-2; 2 prefill tokens then 4 decode tokens.
PREFILL = [
    [[0, 1], [5, 6]],
    [[0, 1], [7, 5]],
]
DECODE = [
    [[0, 1], [5, 6]],
    [[1, 2], [6, 5]],
    [[1, 2], [7, 0]],
    [[3, 4], [7, 0]],
]
EARLY_DECODE_L1 = [[5, 6], [5, 1], [1, 2], [0, 3]]


def _entropy(counts: list[int]) -> float:
    total = sum(counts)
    return -sum(c / total * math.log2(c / total) for c in counts if c)


@pytest.fixture
def hand_trace(tmp_path: Path) -> Path:
    model = tiny_model(moe_layers=2)
    experts = np.array(PREFILL + DECODE)
    weights = np.empty(experts.shape, dtype=np.float32)
    weights[:, 0] = [0.6, 0.2]
    weights[:, 1] = [0.5, 0.5]
    early = experts.copy()
    early[2:, 1] = EARLY_DECODE_L1
    early[:2, 1] = [[2, 3], [2, 3]]  # prefill look-ahead misses: must not count in decode stats
    routing = routing_from_experts(
        model, experts, n_prefill=2, weights=weights, early_experts=early
    )
    return write_trace(tmp_path / "hand.parquet", make_meta(model), [routing])


def test_hand_made_trace_exact(hand_trace: Path) -> None:
    s = trace_stats(hand_trace)
    l0, l1 = s["per_layer"]
    assert (l0["layer"], l1["layer"]) == (0, 1)
    # layer 0 decode: pairs (01,12) share 1, (12,12) share 2 with same top-1, (12,34) none
    assert l0["consecutive_overlap"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert l0["top1_repeat"] == pytest.approx(1 / 3)
    assert l0["same_set"] == pytest.approx(1 / 3)
    assert l0["any_shared"] == pytest.approx(2 / 3)
    assert l0["max_share"] == pytest.approx(3 / 8)
    assert l0["entropy_bits"] == pytest.approx(_entropy([1, 3, 2, 1, 1]))
    assert l0["mean_top1_weight"] == pytest.approx(0.75, abs=1e-6)
    assert l0["lookahead_precision"] is None
    # layer 1 decode: (56,65) same set but top-1 differs, (65,70) none, (70,70) identical
    assert l1["consecutive_overlap"] == pytest.approx((1 + 0 + 1) / 3)
    assert l1["top1_repeat"] == pytest.approx(1 / 3)
    assert l1["same_set"] == pytest.approx(2 / 3)
    assert l1["any_shared"] == pytest.approx(2 / 3)
    assert l1["max_share"] == pytest.approx(0.25)
    assert l1["entropy_bits"] == pytest.approx(2.0)
    assert l1["mean_top1_weight"] == pytest.approx(0.5)
    assert l1["lookahead_precision"] == pytest.approx((1 + 0.5 + 0 + 0.5) / 4)
    # prefill vs decode count vectors, per layer
    cos0 = (2 * 1 + 2 * 3) / (math.sqrt(8) * math.sqrt(1 + 9 + 4 + 1 + 1))
    cos1 = (2 * 2 + 1 * 2 + 1 * 2) / (math.sqrt(4 + 1 + 1) * math.sqrt(4 * 4))
    assert l0["prefill_decode_cosine"] == pytest.approx(cos0)
    assert l1["prefill_decode_cosine"] == pytest.approx(cos1)
    # top level = mean over layers (look-ahead: layers >= 1 only)
    for key in STAT_KEYS:
        values = [r[key] for r in (l0, l1) if r[key] is not None]
        assert s[key] == pytest.approx(sum(values) / len(values)), key
    assert s["lookahead_precision"] == pytest.approx(0.5)
    assert (s["sequences"], s["prefill_tokens"], s["decode_tokens"]) == (1, 2, 4)
    assert s["token_pairs"] == 3


def test_phase_all_includes_the_prefill_boundary(hand_trace: Path) -> None:
    s = trace_stats(hand_trace, phase="all")
    l0 = s["per_layer"][0]
    # pairs: (01,01) (01,01) (01,12) (12,12) (12,34)
    assert s["token_pairs"] == 5
    assert l0["consecutive_overlap"] == pytest.approx((1 + 1 + 0.5 + 1 + 0) / 5)
    assert l0["top1_repeat"] == pytest.approx(3 / 5)
    assert l0["max_share"] == pytest.approx(5 / 12)
    # prefill look-ahead at layer 1 misses entirely: 2 zeros join the 4 decode tokens
    assert s["per_layer"][1]["lookahead_precision"] == pytest.approx(2 / 6)
    pre = trace_stats(hand_trace, phase="prefill")
    assert pre["token_pairs"] == 1
    assert pre["per_layer"][0]["same_set"] == pytest.approx(1.0)
    assert pre["per_layer"][1]["top1_repeat"] == pytest.approx(0.0)


def test_no_pairs_across_sequences_and_undefined_is_none(tmp_path: Path) -> None:
    model = tiny_model(moe_layers=2)
    seqs = [
        routing_from_experts(model, [[[0, 1], [2, 3]]], n_prefill=0, seq_id=i) for i in range(3)
    ]
    s = trace_stats(seqs, make_meta(model))
    assert s["token_pairs"] == 0
    for key in (
        "consecutive_overlap",
        "top1_repeat",
        "same_set",
        "any_shared",
        "prefill_decode_cosine",
    ):
        assert s[key] is None, key
    assert s["max_share"] == pytest.approx(0.5)
    assert s["entropy_bits"] == pytest.approx(1.0)
    assert s["sequences"] == 3


def test_cosine_is_averaged_over_sequences(tmp_path: Path) -> None:
    model = tiny_model(moe_layers=1, top_k=1)
    same = routing_from_experts(model, [[[0]], [[0]]], n_prefill=1, seq_id=0)
    other = routing_from_experts(model, [[[0]], [[1]]], n_prefill=1, seq_id=1)
    s = trace_stats([same, other], make_meta(model))
    assert s["prefill_decode_cosine"] == pytest.approx((1.0 + 0.0) / 2)


def test_max_sequences_and_needs_meta(tmp_path: Path) -> None:
    path = make_trace(tmp_path / "t.parquet", sequences=3, prefill=2, decode=5, seed=2)
    assert trace_stats(path, max_sequences=2)["sequences"] == 2
    assert trace_stats(path)["decode_tokens"] == 15
    with pytest.raises(ValueError, match="needs meta"):
        trace_stats([])
    with pytest.raises(ValueError, match="phase"):
        trace_stats(path, phase="train")


def test_top_m_trace_stats(tmp_path: Path) -> None:
    model = tiny_model(experts=200, top_k=4, moe_layers=2)
    path = make_trace(tmp_path / "big.parquet", model=model, sequences=1, prefill=3, decode=20)
    s = trace_stats(path)
    assert s["experts"] == 200 and len(s["per_layer"]) == 2
    assert 0 < s["max_share"] <= 1


def test_cli_stats_json_and_text(hand_trace: Path, cli: Callable[..., Any]) -> None:
    result = cli("trace", "stats", hand_trace, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    api = trace_stats(hand_trace)
    for key in STAT_KEYS:
        assert key in data
        assert data[key] == pytest.approx(api[key]) if api[key] is not None else data[key] is None
    assert [row["layer"] for row in data["per_layer"]] == [0, 1]
    assert data["per_layer"][0]["lookahead_precision"] is None
    assert {"sequences", "prefill_tokens", "decode_tokens"} <= set(data)
    text = cli("trace", "stats", hand_trace)
    assert text.exit_code == 0
    assert "mean" in text.stdout and "chance" in text.stdout
    assert "0.500" in text.stdout  # mean look-ahead precision


def test_cli_stats_sequences_option(tmp_path: Path, cli: Callable[..., Any]) -> None:
    path = make_trace(tmp_path / "t.parquet", sequences=3, prefill=2, decode=4, seed=9)
    data = json.loads(cli("trace", "stats", path, "--json", "--sequences", "1").stdout)
    assert data["sequences"] == 1 and data["decode_tokens"] == 4
    bad = cli("trace", "stats", path, "--sequences", "0")
    assert bad.exit_code == 2
