"""ZeRO-3's streamed non-expert weights (``ResourceSpec.nonexpert_streamed``).

A policy that declares them moves each layer's non-expert weights (above the persistence
threshold) over the host-to-device link before that layer's non-expert part, and the input
embedding and the output matrix once per forward pass; the tests check the bytes, the time it
costs when the link is the bottleneck, that no non-expert part starts before its weights land
(also under random plans that keep the link busy), and that both executors agree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pandas as pd
import pytest

from daopsim.policies.base import ResourceSpec
from daopsim.simulator.core.loop import Engine
from daopsim.simulator.costs import cost_model
from daopsim.simulator.errors import UserError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.models import get_model
from daopsim.simulator.recorder import Recorder
from daopsim.simulator.reference import ReferenceEngine
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import ChaosPolicy, random_routing, tiny_model

TOL = 1e-9


def _run(**kw: Any) -> Any:
    base: dict[str, Any] = {
        "policy": "stream-all",
        "hw": "a6000-pcie4",
        "trace": "ci-small",
        "sequences": 1,
        "record": True,
    }
    return simulate(**{**base, **kw})


def test_mixtral_bytes_per_layer_and_per_pass() -> None:
    """Mixtral-8x7B by hand: 1.61e9 non-expert parameters less the embedding and lm_head
    (2 x 32000 x 4096) over 32 layers is 42,120,500 per layer; the router (4096 x 8 = 32,768
    elements) is under 1e5 and stays; bf16 doubles it. The embedding is 262,144,000 bytes."""
    costs = cost_model(load_profile("a6000-pcie4"), get_model("mixtral-8x7b"))
    assert costs.streamed_layer_weight_bytes(100_000) == (42_120_500 - 32_768) * 2
    assert costs.streamed_embedding_bytes(100_000) == 32000 * 4096 * 2
    # a threshold below the router's size streams it too; one above the embedding keeps it
    assert costs.streamed_layer_weight_bytes(1000) == 42_120_500 * 2
    assert costs.streamed_embedding_bytes(32000 * 4096) == 0
    # dtype-aware: int8 non-expert weights move half the bytes
    m8 = get_model("mixtral-8x7b").with_precision(nonexpert_dtype="int8")
    c8 = cost_model(load_profile("a6000-pcie4"), m8)
    assert c8.streamed_layer_weight_bytes(100_000) == 42_120_500 - 32_768


@pytest.mark.parametrize("gather", ["leaf", "layer", "selected"])
def test_extra_bytes_and_time_per_pass(gather: str) -> None:
    """Declared: exactly (L x layer bytes + 2 x embedding bytes) more per forward pass, and
    slower by at least those bytes over the link's bandwidth (stream-all is link-bound)."""
    opts = {"gather": gather}
    on = _run(policy_options={**opts, "stream_nonexpert": True})
    off = _run(policy_options={**opts, "stream_nonexpert": False})
    costs = cost_model(load_profile("a6000-pcie4"), get_model("mixtral-8x7b"))
    per_pass = 32 * costs.streamed_layer_weight_bytes(100_000) + 2 * costs.streamed_embedding_bytes(
        100_000
    )
    tl = on.timeline
    passes = tl[tl["kind"] == "nonexpert"].groupby(["seq", "token"]).ngroups
    assert passes >= 2  # a prompt pass and decode tokens
    extra = on.metrics["h2d_bytes"] - off.metrics["h2d_bytes"]
    assert extra == passes * per_pass
    moved = tl[tl["kind"].isin(["weights", "embedding"])]
    assert int(moved["bytes"].sum()) == extra
    assert len(moved) == passes * (32 + 2)
    gbs = load_profile("a6000-pcie4").link.h2d_pinned_gbs
    assert on.metrics["e2e_s"] - off.metrics["e2e_s"] >= extra / (gbs * 1e9) - 1e-9


def _check_order(tl: pd.DataFrame) -> int:
    """No non-expert part starts before its layer's weights (and, at layer 0, the embedding)
    have landed; the output matrix lands after the pass's last non-expert part; the h2d lane
    holds one copy at a time. Returns how many non-expert parts were checked."""
    tl = tl.astype({"resource": str, "kind": str})
    ne = tl[tl["kind"] == "nonexpert"]
    w = tl[tl["kind"] == "weights"].set_index(["seq", "token", "layer"])["end"]
    emb = tl[tl["kind"] == "embedding"]
    n = 0
    for row in ne.itertuples():
        key = (row.seq, row.token, row.layer)
        assert key in w.index, f"no weight copy before {key}"
        assert row.start >= w.loc[key] - TOL
        if row.layer == 0:
            first = emb[(emb["seq"] == row.seq) & (emb["token"] == row.token) & (emb["layer"] == 0)]
            assert len(first) == 1 and row.start >= float(first["end"].iloc[0]) - TOL
        n += 1
    for lane, rows in tl[tl["resource"].isin(["h2d", "copy"])].groupby("resource"):
        r = rows.sort_values("start")
        assert (r["start"].to_numpy()[1:] >= r["end"].to_numpy()[:-1] - TOL).all(), lane
    return n


@pytest.mark.parametrize("gather", ["leaf", "layer", "selected"])
def test_nonexpert_never_starts_before_its_weights(gather: str) -> None:
    """gather=layer leaves the layer's unused prefetches in flight when the layer ends: the
    next layer's weights queue behind them, and its non-expert part waits for them."""
    res = _run(policy_options={"gather": gather}, sequences=1)
    assert _check_order(res.timeline) > 0
    if gather == "layer":  # the weights did wait for the link somewhere
        tl = res.timeline
        w = tl[tl["kind"] == "weights"]
        prev_end = tl[tl["kind"] == "expert"].groupby(["token", "layer"])["end"].max()
        waited = 0
        for row in w.itertuples():
            if row.layer > 0 and (row.token, row.layer - 1) in prev_end.index:
                waited += row.start > prev_end.loc[(row.token, row.layer - 1)] + 1e-6
        assert waited > 0


def _chaos(cls: type[Any], seed: int, record: bool = True) -> tuple[Any, Any]:
    model = dataclasses.replace(
        tiny_model(experts=6, top_k=2, moe_layers=3), non_expert_params=2_000_000,
        embedding_params=300_000,
    )  # fmt: skip
    hw = load_profile("a6000-1ce-pcie4" if seed % 2 else "a6000-pcie4")
    rng = np.random.default_rng(seed)
    seqs = [random_routing(model, s, 3, 5, rng) for s in range(2)]
    pol = ChaosPolicy(rng, 2, 2, writeback=bool(seed % 2), staging_buffers=seed % 2)
    pol.spec = dataclasses.replace(pol.spec, nonexpert_streamed=True)
    rec = Recorder() if record else None
    eng = cls(pol, model, cost_model(hw, model), 8, None, None, None, rec)
    pol.engine = eng
    stats = eng.run(seqs)
    return (rec.timeline() if rec is not None else None), stats


@pytest.mark.reference
@pytest.mark.parametrize("seed", range(4))
def test_random_plans_with_streamed_weights(seed: int) -> None:
    """Random legal plans (prefetches, write-backs, CPU experts keeping the links busy):
    the order holds and both executors give the same timeline and counters."""
    ta, sa = _chaos(Engine, seed)
    tb, sb = _chaos(ReferenceEngine, seed)
    assert _check_order(ta) > 0
    key = ["resource", "kind", "seq", "token", "layer", "expert", "start"]
    a = ta.astype({"resource": str, "kind": str}).sort_values(key, kind="stable")
    b = tb.astype({"resource": str, "kind": str}).sort_values(key, kind="stable")
    assert len(a) == len(b)
    np.testing.assert_allclose(a["start"].to_numpy(), b["start"].to_numpy(), rtol=0, atol=TOL)
    np.testing.assert_allclose(a["end"].to_numpy(), b["end"].to_numpy(), rtol=0, atol=TOL)
    assert sa.counters.h2d_bytes == sb.counters.h2d_bytes
    assert sa.counters.nonexpert_weight_copies == sb.counters.nonexpert_weight_copies > 0
    assert sa.e2e == pytest.approx(sb.e2e, abs=TOL, rel=0)


def test_refusals() -> None:
    """One-line errors: a negative threshold, streaming beside CPU-resident layers or on one
    stream with the kernels, and several GPUs."""
    with pytest.raises(UserError, match="nonexpert_persist_numel"):
        ResourceSpec(nonexpert_streamed=True, nonexpert_persist_numel=-1)
    with pytest.raises(UserError, match="gpu_blocks"):
        ResourceSpec(nonexpert_streamed=True, gpu_blocks=4)
    with pytest.raises(UserError, match="one_stream cannot be combined"):
        ResourceSpec(nonexpert_streamed=True, one_stream=True)
    with pytest.raises(UserError, match="--gpus 1"):
        _run(hw="2x-rtx4090-pcie4", gpus=2, multi_gpu="pipeline", gpu_experts=40, record=False)
