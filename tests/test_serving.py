"""Serving (simulator/serving.py): batched and continuous decoding, arrivals, KV memory, SLOs.

The invariants are attacked directly: a batch's union is fetched and computed once per step
with the batch's token count, KV cache plus expert slots never exceed GPU memory, every request
finishes exactly once, time never goes back; and one request at a time through the serving
loop reproduces the golden unbatched numbers exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import daopsim.simulator.runner as runner_mod
from daopsim.policies.lru import LRUPolicy
from daopsim.policies.registry import available
from daopsim.simulator.arrivals import poisson_arrivals, read_arrivals
from daopsim.simulator.cli import main
from daopsim.simulator.core.loop import Engine
from daopsim.simulator.costs import cost_model
from daopsim.simulator.errors import UserError
from daopsim.simulator.fit import policy_buffers
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.recorder import Recorder
from daopsim.simulator.regress import default_store, run_cell
from daopsim.simulator.regress_compare import compare
from daopsim.simulator.regress_grid import default_grid
from daopsim.simulator.regress_store import load_baseline
from daopsim.simulator.runner import simulate
from daopsim.simulator.serving import Serving
from daopsim.simulator.serving_config import ServingConfig, serving_config
from daopsim.simulator.serving_requests import Request, dense
from daopsim.simulator.testing import ChaosPolicy, routing_from_experts, tiny_model

TRACE = "ci-small"
BUILTIN = sorted(n for n, c in available().items() if c.__module__.startswith("daopsim.policies."))


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


# -- B = 1 is today's single-sequence run -------------------------------------------------------


def _ci_small_cells() -> list[Any]:
    """The golden grid's ci-small cells, one per policy spec and machine (first that ran)."""
    try:
        confs = load_baseline(default_store())["configurations"]
    except UserError:
        return []
    chosen: dict[tuple[str, str], Any] = {}
    for cell in default_grid().cells():
        if cell.block.label != TRACE or "metrics" not in confs.get(cell.key, {}):
            continue
        chosen.setdefault((cell.spec.label, cell.hw), cell)
    return list(chosen.values())


@pytest.mark.parametrize("cell", _ci_small_cells(), ids=lambda c: c.key)
def test_batch_one_reproduces_the_golden_numbers(cell: Any, monkeypatch: Any) -> None:
    """Every policy through the serving loop at --batch 1 gives the unbatched golden metrics."""
    store = load_baseline(default_store())
    batched = functools.partial(runner_mod.simulate, serving=ServingConfig(batch=1))
    monkeypatch.setattr(runner_mod, "simulate", batched)
    got = run_cell(cell)
    assert "metrics" in got, got.get("error")
    changes = compare({cell.key: store["configurations"][cell.key]}, {cell.key: got}, 1e-9)
    assert not changes, changes


def test_golden_cells_cover_every_builtin_policy() -> None:
    names = {c.spec.name for c in _ci_small_cells()}
    assert set(BUILTIN) <= names, set(BUILTIN) - names


# -- the batch union ----------------------------------------------------------------------------


def _serve(
    seqs: list[Any],
    config: ServingConfig,
    budget: int = 2,
    arrivals: list[float] | None = None,
    policy: Any = None,
    kv_capacity: int | None = None,
    model: Any = None,
) -> tuple[pd.DataFrame, Any, Serving, Any]:
    """Serve ``seqs`` (one request each) on the fast engine with a recorder."""
    model = model or tiny_model()
    costs = cost_model(load_profile("a6000-pcie4"), model)
    rec = Recorder()
    eng = Engine(policy or LRUPolicy(), model, costs, budget, recorder=rec)
    if isinstance(policy, ChaosPolicy):
        policy.engine = eng
    times = arrivals or [0.0] * len(seqs)
    reqs = [
        Request(int(r.seq_id), int(r.seq_id), t, r.n_prefill, r.n_decode, dense(r, model.experts))
        for r, t in zip(seqs, times, strict=True)
    ]
    plan = Serving(reqs, config, kv_capacity)
    eng.serving = plan
    stats = eng.run(iter(()))
    return rec.timeline(), stats, plan, costs


def test_an_expert_shared_by_three_sequences_is_fetched_once_and_computed_with_three_tokens():
    model = tiny_model()
    n = model.moe_layers
    # three sequences, one decode token each: all use expert 5 at every layer, plus one own
    seqs = [
        routing_from_experts(model, [[[5, own]] * n], seq_id=i) for i, own in enumerate((1, 2, 3))
    ]
    tl, stats, plan, costs = _serve(
        seqs, ServingConfig(batch=3), budget=16, policy=LRUPolicy(initial="empty")
    )
    assert plan.batch_steps == 1
    assert stats.counters.decode_tokens == 3
    for layer in range(n):
        at = tl[tl["layer"] == layer]
        fetched = at[at["kind"] == "fetch"]["expert"].tolist()
        assert sorted(fetched) == [1, 2, 3, 5]  # expert 5 once, not three times
        gpu = at[(at["kind"] == "expert") & (at["expert"] == 5)]
        assert len(gpu) == 1
        assert (gpu["end"] - gpu["start"]).iloc[0] == pytest.approx(costs.gpu_expert_s(3))
        own = at[(at["kind"] == "expert") & (at["expert"] == 1)]
        assert (own["end"] - own["start"]).iloc[0] == pytest.approx(costs.gpu_expert_s(1))
    # accesses: the union, once per step and layer
    assert stats.counters.decode_accesses == 4 * n
    # the batched rows name the step's requests
    batched = tl[tl["seq"] == -1]
    assert set(batched["requests"]) == {"0,1,2"}


def test_the_policy_sees_the_batch_counts() -> None:
    model = tiny_model()
    n = model.moe_layers
    seen: list[tuple[int, list[int], list[int]]] = []

    class Spy(LRUPolicy):
        name = "spy"

        def batch_layer(self, view: Any) -> Any:
            seen.append((view.n_tokens, view.experts.tolist(), view.counts.tolist()))
            return super().batch_layer(view)

    seqs = [routing_from_experts(model, [[[5, own]] * n], seq_id=i) for i, own in enumerate((1, 2))]
    _serve(seqs, ServingConfig(batch=2), budget=8, policy=Spy())
    assert len(seen) == n
    tokens, experts, counts = seen[0]
    assert tokens == 2 and experts == [5, 1, 2]
    assert counts[5] == 2 and counts[1] == counts[2] == 1 and sum(counts) == 4


def test_batched_steps_amortise_copies() -> None:
    """Eight sequences in a batch move fewer bytes than the same sequences one at a time."""
    one = simulate(policy="lru", trace=TRACE, record=False)
    eight = simulate(policy="lru", trace=TRACE, record=False, serving=ServingConfig(batch=8))
    assert eight.metrics["decode_tokens"] == one.metrics["decode_tokens"]
    assert eight.metrics["h2d_bytes"] < one.metrics["h2d_bytes"]
    assert eight.metrics["decode_tokens_per_s"] > one.metrics["decode_tokens_per_s"]
    assert eight.serving["mean_batch"] > 1


# -- GPU memory ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "opts"),
    [
        ("lru", {"serving": ServingConfig(batch=8)}),
        ("lru", {"serving": ServingConfig(batch=4, kv_cache_gb=0.5)}),
        ("fiddler", {"serving": ServingConfig(batch=2, continuous=True, arrival_rate=1.0)}),
        ("lru", {"serving": ServingConfig(batch=8), "gpu_experts": 16}),
        ("mixtral-offloading", {"serving": ServingConfig(batch=3, kv_cache_gb=2.0)}),
        ("lru", {"serving": ServingConfig(batch=8, continuous=True, preempt=True)}),
        ("fiddler", {"serving": ServingConfig(batch=4, prefill_chunk=8, preempt=True)}),
        ("lru", {"serving": ServingConfig(batch=6, prefill_chunk=5, kv_cache_gb=0.05)}),
    ],
)
def test_kv_cache_plus_slots_never_exceed_gpu_memory(policy: str, opts: dict[str, Any]) -> None:
    res = simulate(policy=policy, trace=TRACE, record=False, **opts)
    from daopsim.policies.registry import make_policy
    from daopsim.simulator.data import resolve_trace
    from daopsim.simulator.trace_read import read_meta

    model = read_meta(resolve_trace(TRACE)).model
    hw = load_profile(res.config["hw"])
    costs = cost_model(hw, model)
    sv = res.serving
    kv = sv["kv_cache_tokens"] * model.kv_bytes_per_token
    buffers = policy_buffers(make_policy(policy))
    slots = (res.config["gpu_experts"] + buffers) * costs.expert_bytes
    used = hw.gpu.workspace_gb * 1e9 + model.non_expert_bytes() + kv + slots
    assert used <= hw.gpu.usable_bytes
    assert sv["kv_peak_tokens"] <= sv["kv_cache_tokens"]
    if opts["serving"].kv_cache_gb is not None:
        assert kv <= opts["serving"].kv_cache_gb * 1e9


def test_a_small_kv_cache_limits_the_batch() -> None:
    big = simulate(policy="lru", trace=TRACE, record=False, serving=ServingConfig(batch=8))
    # room for two of ci-small's requests at a time
    longest = int(big.requests.eval("prompt_tokens + output_tokens").max())
    gb = 2.5 * longest * 131072 / 1e9
    small = simulate(
        policy="lru",
        trace=TRACE,
        record=False,
        serving=ServingConfig(batch=8, continuous=True, kv_cache_gb=gb),
    )
    assert small.serving["kv_peak_tokens"] <= small.serving["kv_cache_tokens"]
    assert small.serving["mean_batch"] < big.serving["mean_batch"]
    assert small.requests["queue_s"].max() > 0


def test_a_request_longer_than_the_kv_cache_is_refused() -> None:
    with pytest.raises(UserError, match=r"request 0 .* KV-cache tokens .*--kv-cache-gb"):
        simulate(
            policy="lru",
            trace=TRACE,
            record=False,
            serving=ServingConfig(batch=2, kv_cache_gb=0.001),
        )


# -- chunked prefill ----------------------------------------------------------------------------


def test_a_mixed_step_runs_the_union_of_prompt_chunk_and_decode_tokens() -> None:
    """Request 0 decodes while request 1's 6-token prompt joins in chunks of 4: the first
    mixed step runs 4 prompt tokens and 1 decode token, each shared expert once."""
    model = tiny_model()
    n = model.moe_layers
    dec = routing_from_experts(model, [[[5, 1]] * n] * 4, seq_id=0)  # no prompt, 4 tokens
    pre = routing_from_experts(model, [[[5, 2]] * n] * 7, n_prefill=6, seq_id=1)
    tl, stats, plan, costs = _serve(
        [dec, pre],
        ServingConfig(batch=2, continuous=True, prefill_chunk=4),
        budget=16,
        arrivals=[0.0, 1e-9],
        policy=LRUPolicy(initial="empty"),
    )
    assert plan.mixed_steps == 2  # chunks of 4 and 2 rows, each beside request 0's token
    step = tl[(tl["seq"] == -1) & (tl["requests"] == "1,0")]
    first = step[step["token"] == step["token"].min()]
    for layer in range(n):
        at = first[first["layer"] == layer]
        e5 = at[(at["kind"] == "expert") & (at["expert"] == 5)]
        assert len(e5) == 1  # once, over the chunk's 4 tokens and the decode token
        assert (e5["end"] - e5["start"]).iloc[0] == pytest.approx(costs.gpu_expert_s(5))
        e2 = at[(at["kind"] == "expert") & (at["expert"] == 2)]
        assert (e2["end"] - e2["start"]).iloc[0] == pytest.approx(costs.gpu_expert_s(4))
        ne = at[at["kind"] == "nonexpert"]
        # request 0 is at its second token (position 1: 2 KV tokens once written)
        assert (ne["end"] - ne["start"]).iloc[0] == pytest.approx(
            costs.nonexpert_mixed_layer_s(4, 0, 1, 2)
        )
    assert stats.counters.prefill_tokens == 6
    assert stats.counters.decode_tokens == 4 + 1
    q1 = plan.requests[1]
    assert q1.prefilled == 6 and q1.first_token <= q1.finish


# -- a static batch's prompts prefill together --------------------------------------------------


def _prompted(model: Any, prompts: list[list[list[int]]], decode: int = 1) -> list[Any]:
    """One sequence per prompt (``[prompt tokens][k]`` experts at every layer), each followed by
    ``decode`` decode tokens on experts 0 and 1."""
    n = model.moe_layers
    out = []
    for i, rows in enumerate(prompts):
        ex = [[row] * n for row in rows] + [[[0, 1]] * n] * decode
        out.append(routing_from_experts(model, ex, n_prefill=len(rows), seq_id=i))
    return out


def test_a_static_batch_prefills_in_one_step_each_expert_once_with_its_token_count() -> None:
    model = tiny_model()
    n = model.moe_layers
    # prompts of 3, 1 and 2 tokens: expert 5 chosen by four prompt tokens of three requests
    prompts = [[[5, 1], [5, 2], [3, 4]], [[5, 6]], [[5, 7], [6, 1]]]
    tl, stats, plan, costs = _serve(
        _prompted(model, prompts),
        ServingConfig(batch=3),
        budget=n * model.experts,
        policy=LRUPolicy(initial="empty"),
    )
    assert plan.batched_prefills == 1
    assert stats.counters.prefill_tokens == 6
    first = tl[tl["requests"] == "0,1,2"]["token"].min()
    step = tl[(tl["seq"] == -1) & (tl["token"] == first)]
    counts = {5: 4, 1: 2, 2: 1, 3: 1, 4: 1, 6: 2, 7: 1}
    for layer in range(n):
        at = step[step["layer"] == layer]
        fetched = at[at["kind"] == "fetch"]["expert"].tolist()
        assert sorted(fetched) == sorted(counts)  # the union, each expert once
        for e, k in counts.items():
            run = at[(at["kind"] == "expert") & (at["expert"] == e)]
            assert len(run) == 1
            assert (run["end"] - run["start"]).iloc[0] == pytest.approx(costs.gpu_expert_s(k))
        ne = at[at["kind"] == "nonexpert"]
        # the prompts padded to the longest (3 rows each), in one pass over the weights
        assert len(ne) == 1
        assert (ne["end"] - ne["start"]).iloc[0] == pytest.approx(
            costs.nonexpert_prefill_batch_layer_s(3, 3)
        )
    # every request's first token is the batched prefill's end
    end = step["end"].max()
    assert [q.first_token for q in plan.requests] == [pytest.approx(end)] * 3
    # and the decode tokens come after it, batched
    assert tl[tl["token"] > first]["start"].min() >= end - 1e-12
    assert plan.batch_steps == 1


def test_per_request_static_prefill_keeps_the_old_schedule() -> None:
    model = tiny_model()
    prompts = [[[5, 1], [5, 2]], [[5, 6]], [[5, 7], [6, 1]]]
    seqs = _prompted(model, prompts)
    _, _, per, _ = _serve(seqs, ServingConfig(batch=3, static_prefill="per-request"), 8)
    _, _, bat, _ = _serve(seqs, ServingConfig(batch=3), 8)
    assert per.batched_prefills == 0 and bat.batched_prefills == 1
    # one prefill after the other: the first tokens are distinct and in admission order
    per_first = [q.first_token for q in per.requests]
    assert per_first == sorted(per_first) and len(set(per_first)) == 3
    assert len({q.first_token for q in bat.requests}) == 1
    assert max(q.first_token for q in bat.requests) < max(per_first)


def test_a_batched_prefill_wider_than_the_budget_keeps_every_invariant() -> None:
    """Prompts that route to every expert of every layer, two slots: the union cannot be
    resident at once; each expert still runs exactly once per layer in the prefill step."""
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    prompts = [[[0, 1], [2, 3]], [[4, 5], [0, 2]], [[1, 3], [4, 0], [5, 2]]]
    seqs = _prompted(model, prompts, decode=2)
    for seed in range(4):
        rng = np.random.default_rng(seed)
        pol = ChaosPolicy(rng, 1, 1, writeback=bool(seed % 2))
        tl, stats, plan, _ = _serve(seqs, ServingConfig(batch=3), 2, None, pol, model=model)
        _check_invariants(plan.requests, plan, stats, tl, 3, None)
        assert plan.batched_prefills == 1
        first = tl[tl["requests"] == "0,1,2"]["token"].min()
        step = tl[(tl["seq"] == -1) & (tl["token"] == first)]
        run = step[step["kind"].isin(["expert", "cpu_expert"])]
        for layer in range(model.moe_layers):
            assert sorted(run[run["layer"] == layer]["expert"]) == list(range(6))
        assert [q.first_token for q in plan.requests] == [pytest.approx(step["end"].max())] * 3


def test_stream_all_streams_one_pass_for_a_batched_prefill() -> None:
    """ZeRO-3 (stream-all, gather=leaf) moves the same bytes every pass: a static batch of
    three makes 1 + decode passes batched, 3 + decode one prompt at a time."""
    runs = {
        sp: simulate(
            policy="stream-all",
            policy_options={"gather": "leaf"},
            trace=TRACE,
            sequences=3,
            record=False,
            serving=ServingConfig(batch=3, static_prefill=sp),
        )
        for sp in ("batched", "per-request")
    }
    decode = int(runs["batched"].requests["output_tokens"].max())
    bat = runs["batched"].metrics["h2d_bytes"]
    per = runs["per-request"].metrics["h2d_bytes"]
    one_pass = (per - bat) / 2  # the two prefill passes batching saves
    assert one_pass > 0
    assert bat == pytest.approx((1 + decode) * one_pass, rel=1e-9)
    assert per == pytest.approx((3 + decode) * one_pass, rel=1e-9)
    assert runs["batched"].serving["static_prefill"] == "batched"
    assert runs["batched"].serving["batched_prefills"] == 1


def test_the_clairvoyant_oracle_follows_the_batched_prefill() -> None:
    """The oracle's steps are the engine's: one step for a static batch's prompts."""
    from daopsim.simulator.scheduler import schedule_steps

    model = tiny_model()
    prompts = [[[5, 1], [5, 2]], [[5, 6]], [[5, 7], [6, 1]], [[3, 4]]]
    seqs = _prompted(model, prompts, decode=2)
    for cfg in (ServingConfig(batch=3), ServingConfig(batch=3, static_prefill="per-request")):
        rec = Recorder()
        eng = Engine(LRUPolicy(), model, cost_model(load_profile("a6000-pcie4"), model), 8,
                     recorder=rec)  # fmt: skip
        reqs = [
            Request(int(r.seq_id), int(r.seq_id), 0.0, r.n_prefill, r.n_decode, r) for r in seqs
        ]
        fresh = [dataclasses.replace(q) for q in reqs]
        eng.serving = Serving(reqs, cfg, None)
        eng.run(iter(()))
        steps = list(schedule_steps(fresh, 3, False, None, cfg.batched_prefill))
        assert len(steps) == eng.step
        prefills = [s for s in steps if all(t == -1 for _, t in s)]
        want = [[0, 1, 2], [3]] if cfg.batched_prefill else [[0], [1], [2], [3]]
        assert [[q.rid for q, _ in s] for s in prefills] == want


def test_the_batched_prefill_cost_reduces_to_one_prompt_and_reads_the_weights_once() -> None:
    from daopsim.simulator.data import resolve_trace
    from daopsim.simulator.trace_read import read_meta

    model = read_meta(resolve_trace(TRACE)).model
    c = cost_model(load_profile("a6000-pcie4"), model)
    for length in (1, 64, 512):
        assert c.nonexpert_prefill_batch_layer_s(1, length) == pytest.approx(
            c.nonexpert_layer_s(length, 0), rel=1e-12
        )
        if model.attention_heads > 0:
            assert c.nonexpert_prefill_batch_layer_s(1, length, True) == pytest.approx(
                c.nonexpert_layer_s(length, 0, eager_attention=True), rel=1e-12
            )
        assert c.cpu_nonexpert_prefill_batch_layer_s(1, length) == pytest.approx(
            c.cpu_nonexpert_layer_s(length, 0), rel=1e-12
        )
        batch = c.nonexpert_prefill_batch_layer_s(16, length)
        assert c.nonexpert_layer_s(length, 0) < batch < 16 * c.nonexpert_layer_s(length, 0)
    with pytest.raises(ValueError):
        c.nonexpert_prefill_batch_layer_s(-1, 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch": 2, "static_prefill": "whole"}, "must be one of"),
        ({"batch": 2, "continuous": True, "static_prefill": "batched"}, "static batches"),
        ({"batch": 2, "prefill_chunk": 4, "static_prefill": "batched"}, "not modelled"),
        ({"batch": 2, "preempt": True, "static_prefill": "batched"}, "not modelled"),
    ],
)
def test_bad_static_prefill_is_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(UserError, match=match):
        ServingConfig(**kwargs)


def test_static_prefill_cli(tmp_path: Path) -> None:
    r = _cli(
        "run",
        "--policy",
        "lru",
        "--trace",
        TRACE,
        "--sequences",
        "2",
        "--static-prefill",
        "batched",
        "--no-progress",
    )
    assert r.exit_code != 0 and "needs static batches" in r.output
    r = _cli(
        "run",
        "--policy",
        "lru",
        "--trace",
        TRACE,
        "--sequences",
        "2",
        "--batch",
        "2",
        "--static-prefill",
        "per-request",
        "--json",
        "--no-progress",
    )
    assert r.exit_code == 0, r.output
    sv = json.loads(r.output)["serving"]
    assert sv["static_prefill"] == "per-request" and sv["batched_prefills"] == 0


def test_the_mixed_cost_reduces_to_prefill_and_to_batched_decode() -> None:
    from daopsim.simulator.data import resolve_trace
    from daopsim.simulator.trace_read import read_meta

    model = read_meta(resolve_trace(TRACE)).model
    c = cost_model(load_profile("a6000-pcie4"), model)
    for chunk, ctx in ((1, 0), (32, 0), (16, 48)):
        assert c.nonexpert_mixed_layer_s(chunk, ctx, 0, 0) == pytest.approx(
            c.nonexpert_layer_s(chunk, ctx), rel=1e-12
        )
    assert c.nonexpert_mixed_layer_s(0, 0, 8, 800) == pytest.approx(
        c.nonexpert_batch_layer_s(8, 800), rel=1e-12
    )
    # one pass over the weights for both is cheaper than two steps
    both = c.nonexpert_mixed_layer_s(16, 0, 8, 800)
    assert both < c.nonexpert_layer_s(16, 0) + c.nonexpert_batch_layer_s(8, 800)
    with pytest.raises(ValueError):
        c.nonexpert_mixed_layer_s(-1, 0, 0, 0)


def test_chunked_prefill_bounds_the_stall_of_running_requests() -> None:
    """A long prompt joining stalls a decoding request for its whole prefill; in chunks, each
    of the decoding request's steps carries at most one chunk."""
    model = tiny_model()
    n = model.moe_layers
    rng = np.random.default_rng(1)
    dec = _random_seq(model, rng, 0, tokens=12, max_prompt=0)
    long = routing_from_experts(
        model,
        [[rng.permutation(model.experts)[:2] for _ in range(n)] for _ in range(41)],
        n_prefill=40,
        seq_id=1,
    )

    def longest_gap(chunk: int | None) -> tuple[float, float]:
        cfg = ServingConfig(batch=2, continuous=True, prefill_chunk=chunk)
        tl, _, plan, _ = _serve([dec, long], cfg, 16, [0.0, 1e-6], LRUPolicy())
        # the start of each step that carries a token of request 0
        ne = tl[(tl["kind"] == "nonexpert") & (tl["layer"] == 0)]
        mine = ne[[("0" in ids.split(",")) for ids in ne["requests"]]]
        starts = np.sort(mine["start"].to_numpy())
        return float(np.diff(starts).max()), plan.requests[0].tpot

    (whole, whole_tpot), (chunked, chunked_tpot) = longest_gap(None), longest_gap(4)
    assert chunked < whole
    # the price: every chunk reads the layer's weights and experts again, so request 0's
    # mean time per token grows (Sarathi-Serve's chunk-size trade-off)
    assert chunked_tpot > whole_tpot


def test_batch_one_with_whole_prompt_chunks_or_preemption_reproduces_the_plain_run() -> None:
    """The extended schedule with one request at a time, a chunk longer than any prompt and
    an unbounded cache runs the same work in the same order as an unbatched run."""
    for policy in ("lru", "fiddler", "daop", "belady"):
        plain = simulate(policy=policy, trace=TRACE, record=False).metrics
        for cfg in (
            ServingConfig(batch=1, prefill_chunk=10**6),
            ServingConfig(batch=1, preempt=True),
        ):
            got = simulate(policy=policy, trace=TRACE, record=False, serving=cfg).metrics
            for key, want in plain.items():
                if isinstance(want, float) and math.isnan(want):
                    assert math.isnan(got[key]), key
                else:
                    assert got[key] == want, (policy, cfg, key)


def test_clairvoyant_oracle_follows_the_chunked_schedule() -> None:
    from daopsim.simulator.scheduler import extended_schedule_steps

    cfg = ServingConfig(batch=4, prefill_chunk=8, preempt=True, kv_cache_gb=0.04)
    res = simulate(policy="belady", trace=TRACE, record=True, serving=cfg)
    tl = res.timeline
    ne0 = tl[(tl["kind"] == "nonexpert") & (tl["layer"] == 0)]
    reqs = [
        Request(
            int(r.request_id),
            int(r.sequence),
            0.0,
            int(r.prompt_tokens),
            int(r.output_tokens),
            None,
        )  # type: ignore[arg-type]
        for r in res.requests.itertuples()
    ]
    # the oracle's schedule has as many steps as the run (one layer-0 non-expert row each)
    # and preempts as often
    n_steps = len(list(extended_schedule_steps(reqs, cfg, res.serving["kv_cache_tokens"])))
    assert n_steps == len(ne0)
    assert res.serving["preemptions"] > 0


# -- preemption under KV pressure ---------------------------------------------------------------


def test_a_tiny_kv_cache_forces_preemption_and_keeps_every_invariant() -> None:
    model = tiny_model()
    rng = np.random.default_rng(7)
    seqs = [_random_seq(model, rng, i, tokens=6, max_prompt=2) for i in range(5)]
    kv = 8  # a request needs at most 6; two decoding together soon run out
    for chunk in (None, 1, 3):
        cfg = ServingConfig(batch=4, continuous=True, prefill_chunk=chunk, preempt=True)
        tl, stats, plan, _ = _serve(seqs, cfg, 4, None, LRUPolicy(), kv)
        _check_invariants(plan.requests, plan, stats, tl, 4, kv)
        assert plan.sched.preemptions > 0
        assert sum(q.preemptions for q in plan.requests) == plan.sched.preemptions
        # recompute: the freed tokens are prefilled again, no decode token is generated twice
        first = sum(q.prompt for q in plan.requests)
        assert stats.counters.prefill_tokens == first + plan.sched.preempted_kv_tokens


def test_the_newest_request_is_the_one_preempted() -> None:
    from daopsim.simulator.scheduler import Scheduler, plan_steps

    model = tiny_model()
    rng = np.random.default_rng(2)
    seqs = [_random_seq(model, rng, i, tokens=6, max_prompt=2) for i in range(4)]
    reqs = [Request(i, i, 0.0, r.n_prefill, r.n_decode, r) for i, r in enumerate(seqs)]
    sched = Scheduler(reqs, 4, True, 9, incremental=True)
    victims = 0
    admitted: list[Request] = []  # admission order, readmissions at the end
    for kind, x in plan_steps(sched, None, lambda: 0.0):
        if kind == "admit":
            admitted = [o for o in admitted if o is not x] + [x]
        elif kind == "preempt":
            victims += 1
            # the last admitted of those running, now waiting at the head of the queue
            live = [o for o in admitted if o is x or o in sched.running]
            assert live[-1] is x and sched.queue[0] is x and x.held == 0
            assert sched.kv_used == sum(o.held for o in sched.running) <= 9
    assert all(q.finished == 0 and q.done == q.output for q in reqs)


def test_a_request_larger_than_the_kv_cache_is_refused_at_admission() -> None:
    model = tiny_model()
    rng = np.random.default_rng(4)
    seqs = [_random_seq(model, rng, i, tokens=6, max_prompt=2) for i in range(2)]
    with pytest.raises(
        UserError, match=r"request 0 needs 6 KV tokens .* whole KV cache holds \(5\)"
    ):
        _serve(seqs, ServingConfig(batch=2, preempt=True), 4, None, LRUPolicy(), 5)


def test_preemption_counts_reach_the_request_table_and_the_summary() -> None:
    big = simulate(policy="lru", trace=TRACE, record=False, serving=ServingConfig(batch=8))
    longest = int(big.requests.eval("prompt_tokens + output_tokens").max())
    gb = 1.3 * longest * 131072 / 1e9
    cfg = ServingConfig(batch=8, continuous=True, kv_cache_gb=gb, preempt=True)
    res = simulate(policy="lru", trace=TRACE, record=False, serving=cfg)
    sv = res.serving
    assert sv["preemptions"] > 0 and sv["preemptions"] == res.requests["preemptions"].sum()
    assert sv["kv_peak_tokens"] <= sv["kv_cache_tokens"]
    assert res.metrics["decode_tokens"] == res.requests["output_tokens"].sum()
    # reserving whole requests never preempts, and batches less
    whole = simulate(
        policy="lru",
        trace=TRACE,
        record=False,
        serving=dataclasses.replace(cfg, preempt=False),
    )
    assert whole.serving["preemptions"] == 0 and whole.requests["preemptions"].eq(0).all()
    assert sv["mean_batch"] > whole.serving["mean_batch"]


# -- requests and time --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        ServingConfig(batch=3),
        ServingConfig(batch=3, continuous=True),
        ServingConfig(batch=4, continuous=True, arrival_rate=0.2),
        ServingConfig(batch=2, arrival_rate=5.0),
    ],
    ids=["static", "continuous", "poisson-continuous", "poisson-static"],
)
def test_every_request_finishes_exactly_once_and_time_never_goes_back(
    config: ServingConfig,
) -> None:
    res = simulate(policy="daop", trace=TRACE, record=True, serving=config)
    req = res.requests
    assert req["request_id"].is_unique
    assert len(req) == res.metrics["sequences"] == res.config["sequences"]
    assert (req["admitted_s"] >= req["arrival_s"]).all()
    assert (req["first_token_s"] >= req["admitted_s"]).all()
    assert (req["finish_s"] >= req["first_token_s"]).all()
    assert req["finish_s"].max() == pytest.approx(res.metrics["e2e_s"])
    assert res.metrics["decode_tokens"] == req["output_tokens"].sum()
    tl = res.timeline
    assert (tl["end"] >= tl["start"]).all() and (tl["start"] >= 0).all()
    # each serial lane serves one request at a time, in time order
    for lane in ("gpu", "h2d"):
        rows = tl[tl["resource"] == lane].sort_values("start", kind="stable")
        assert (rows["start"].to_numpy()[1:] >= rows["end"].to_numpy()[:-1] - 1e-12).all()
    # the non-expert part of consecutive layers never goes back in time
    ne = tl[tl["kind"] == "nonexpert"]["start"].to_numpy()
    assert (np.diff(ne) >= 0).all()
    # every row names its requests; a batched step's rows name all of them
    assert (tl["requests"] != "").all()


def _random_seq(
    model: Any, rng: np.random.Generator, sid: int, tokens: int = 0, max_prompt: int = 1
) -> Any:
    """A sequence of 2..6 tokens (distinct experts per token), up to ``max_prompt`` of them
    prompt tokens."""
    t = tokens or int(rng.integers(2, 7))
    ex = np.stack(
        [[rng.permutation(model.experts)[:2] for _ in range(model.moe_layers)] for _ in range(t)]
    )
    prompt = min(t, int(rng.integers(0, max_prompt + 1)))
    return routing_from_experts(model, ex, n_prefill=prompt, seq_id=sid)


def test_finish_counts_are_exactly_one() -> None:
    model = tiny_model()
    rng = np.random.default_rng(3)
    seqs = [_random_seq(model, rng, i) for i in range(7)]
    arrivals = sorted(float(x) for x in rng.uniform(0, 1e-3, size=len(seqs)))
    _, stats, plan, _ = _serve(seqs, ServingConfig(batch=3, continuous=True), 4, arrivals)
    assert [q.finished for q in plan.requests] == [1] * len(seqs)
    assert stats.counters.sequences == len(seqs)
    assert not plan.sched.running and not plan.sched.queue and plan.sched.kv_used == 0


def test_continuous_batching_admits_between_steps_static_does_not() -> None:
    model = tiny_model()
    rng = np.random.default_rng(5)
    seqs = [_random_seq(model, rng, i, tokens) for i, tokens in enumerate((3, 9, 4, 8, 2))]
    _, _, cont, _ = _serve(seqs, ServingConfig(batch=2, continuous=True), 4)
    _, _, stat, _ = _serve(seqs, ServingConfig(batch=2), 4)
    # continuous batching refills a freed place at once; static batching waits for the batch
    c_adm = np.array([q.admitted for q in cont.requests])
    s_adm = np.array([q.admitted for q in stat.requests])
    assert (c_adm[2:] < s_adm[2:]).all()
    for plan in (cont, stat):
        for q in plan.requests:  # nobody is admitted while the batch is full
            running = [o for o in plan.requests if o.admitted < q.admitted < o.finish]
            assert len(running) < 2
    # static: a later batch starts only when every request of the one before has finished
    for q in stat.requests:
        before = [o for o in stat.requests if o.admitted < q.admitted]
        assert all(o.finish <= q.admitted for o in before)


def test_poisson_arrivals_are_seeded() -> None:
    a, b = poisson_arrivals(50, 2.0, 1), poisson_arrivals(50, 2.0, 1)
    assert (a == b).all() and (np.diff(a) > 0).all() and a[0] > 0
    assert not (a == poisson_arrivals(50, 2.0, 2)).all()
    assert 50 / a[-1] == pytest.approx(2.0, rel=0.5)
    cfg = ServingConfig(batch=4, continuous=True, arrival_rate=0.5)
    x = simulate(policy="lru", trace=TRACE, record=False, serving=cfg, seed=3)
    y = simulate(policy="lru", trace=TRACE, record=False, serving=cfg, seed=3)
    assert x.to_json() == y.to_json()
    assert x.requests.equals(y.requests)


def test_slo_goodput_definitions() -> None:
    cfg = ServingConfig(batch=4, continuous=True, arrival_rate=0.5)
    base = simulate(policy="lru", trace=TRACE, record=False, serving=cfg)
    req = base.requests
    ttft = float(req["ttft_s"].median())
    tpot = float(req["tpot_s"].max()) * 2
    slo = ServingConfig(batch=4, continuous=True, arrival_rate=0.5, slo_ttft=ttft, slo_tpot=tpot)
    res = simulate(policy="lru", trace=TRACE, record=False, serving=slo)
    good = (res.requests["ttft_s"] <= ttft) & (res.requests["tpot_s"] <= tpot)
    assert res.serving["slo_attainment"] == pytest.approx(good.mean())
    assert 0 < res.serving["slo_attainment"] < 1
    assert res.serving["goodput_requests_per_s"] == pytest.approx(good.sum() / res.metrics["e2e_s"])
    p = res.serving["ttft_s"]
    assert p["p50"] <= p["p90"] <= p["p99"]
    assert p["p50"] == pytest.approx(np.percentile(res.requests["ttft_s"], 50))


def test_clairvoyant_policies_need_a_fixed_schedule() -> None:
    ok = simulate(policy="belady", trace=TRACE, record=False, serving=ServingConfig(batch=4))
    assert ok.serving["batched_steps"] > 0
    with pytest.raises(UserError, match="clairvoyant"):
        simulate(
            policy="belady",
            trace=TRACE,
            record=False,
            serving=ServingConfig(batch=4, continuous=True, arrival_rate=1.0),
        )


@pytest.mark.parametrize("policy", BUILTIN)
def test_every_builtin_policy_runs_batched(policy: str) -> None:
    res = simulate(policy=policy, trace=TRACE, record=False, serving=ServingConfig(batch=8))
    assert res.serving["batched_steps"] > 0
    assert res.metrics["decode_tokens"] == res.requests["output_tokens"].sum()


# -- arrival files ------------------------------------------------------------------------------


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def _row(**kw: Any) -> dict[str, Any]:
    row = {"request_id": 1, "arrival_s": 0.5, "prompt_tokens": 4, "output_tokens": 3, "sequence": 0}
    row.update(kw)
    return row


def test_an_arrival_file_drives_the_run(tmp_path: Path) -> None:
    f = _write(
        tmp_path / "a.csv",
        [_row(request_id=7, arrival_s=1.0), _row(request_id=3, arrival_s=0.0, sequence=1)],
    )
    res = simulate(
        policy="lru",
        trace=TRACE,
        record=False,
        serving=ServingConfig(batch=2, continuous=True, arrivals=str(f)),
    )
    req = res.requests.set_index("request_id")
    assert list(res.requests["request_id"]) == [3, 7]  # by arrival
    assert req.loc[7, "arrival_s"] == 1.0 and req.loc[7, "output_tokens"] == 3
    assert req.loc[3, "sequence"] == 1 and res.metrics["decode_tokens"] == 6
    pq = tmp_path / "a.parquet"
    pd.read_csv(f).to_parquet(pq)
    assert [a.request_id for a in read_arrivals(pq)] == [3, 7]


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([_row(output_tokens=0)], r"row 1: field output_tokens: must be >= 1"),
        ([_row(), _row()], r"row 2: field request_id: 1 repeats row 1"),
        ([_row(arrival_s=-1)], r"row 1: field arrival_s: must be finite"),
        ([_row(arrival_s="soon")], r"row 1: field arrival_s: not a number"),
        ([_row(prompt_tokens=1.5)], r"row 1: field prompt_tokens: expected an integer"),
        ([_row(sequence=999)], r"row 1: field sequence: sequence 999 is not in the trace"),
        ([_row(output_tokens=10**6)], r"row 1: field output_tokens: 1000000 is more than"),
        ([{"request_id": 1}], r"missing column 'arrival_s'"),
    ],
)
def test_a_bad_arrival_file_is_one_line_naming_row_and_field(
    tmp_path: Path, rows: list[dict[str, Any]], match: str
) -> None:
    f = _write(tmp_path / "bad.csv", rows)
    r = _cli("run", "--policy", "lru", "--trace", TRACE, "--arrivals", str(f), "--no-progress")
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(f) in lines[0]
    import re

    assert re.search(match, lines[0]), lines[0]


# -- CLI ----------------------------------------------------------------------------------------


def test_run_json_has_a_serving_object_and_writes_the_request_table(tmp_path: Path) -> None:
    out = tmp_path / "req.csv"
    r = _cli(
        "run",
        "--policy",
        "fiddler",
        "--trace",
        TRACE,
        "--arrival-rate",
        "0.5",
        "--slo-tpot",
        "0.5",
        "--requests-out",
        str(out),
        "--json",
        "--no-progress",
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    sv = doc["serving"]
    assert sv["mode"] == "continuous" and sv["slo_tpot_s"] == 0.5
    assert set(sv["tpot_s"]) == {"p50", "p90", "p99"}
    assert 0 <= sv["slo_attainment"] <= 1 and "bounds" not in doc
    table = pd.read_csv(out)
    assert len(table) == sv["requests"] and "meets_slo" in table.columns
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def test_single_sequence_run_has_no_serving_object() -> None:
    r = _cli("run", "--policy", "lru", "--trace", TRACE, "--no-bounds", "--json")
    assert "serving" not in json.loads(r.output)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--batch", "2", "--max-batch", "2"], "not both"),
        (["--batch", "0"], "at least 1"),
        (["--arrival-rate", "-1"], "positive"),
        (["--slo-ttft", "0"], "positive"),
        (["--requests-out", "x.csv"], "needs a serving run"),
        (["--batch", "2", "--requests-out", "x.txt"], "suffix"),
    ],
)
def test_bad_serving_options_are_one_line(args: list[str], match: str) -> None:
    r = _cli("run", "--policy", "lru", "--trace", TRACE, "--no-progress", *args)
    assert r.exit_code == 2 and r.output.startswith("error: ") and match in r.output


def test_serving_config_rules() -> None:
    assert serving_config() is None
    assert serving_config(batch=4).continuous is False
    assert serving_config(max_batch=4).continuous is True
    timed = serving_config(arrival_rate=0.5, slo_tpot=0.5)
    assert timed is not None and timed.continuous and timed.batch == 8
    only_slo = serving_config(slo_ttft=1.0)
    assert only_slo is not None and only_slo.batch == 1 and not only_slo.continuous
    assert math.isnan(Request(0, 0, 0.0, 0, 1, None).tpot)  # type: ignore[arg-type]


# -- sweeps and the latency-vs-load plot --------------------------------------------------------


def test_an_arrival_rate_sweep_and_its_latency_load_plot(tmp_path: Path) -> None:
    from daopsim.simulator.grid import Grid
    from daopsim.simulator.plots import plot_latency_load
    from daopsim.simulator.sweep import run_sweep
    from daopsim.simulator.sweep_expand import expand

    grid = Grid(
        policies=["lru"],
        traces=[TRACE],
        arrival_rates=[0.05, 1.0],
        max_batch=4,
        slo_tpot=1.2,
        sequences=3,
    )
    configs = expand(grid)
    assert [c.arrival_rate for c in configs] == [0.05, 1.0]
    plain = expand(Grid(policies=["lru"], traces=[TRACE], sequences=3))
    assert plain[0].key not in {c.key for c in configs}  # serving keys differ from plain ones
    df, _ = run_sweep(grid, workers=1, out=tmp_path / "s.parquet", progress=False)
    assert list(df["arrival_rate"]) == [0.05, 1.0] and set(df["max_batch"]) == {4}
    direct = simulate(
        policy="lru",
        trace=TRACE,
        sequences=3,
        record=False,
        serving=ServingConfig(batch=4, continuous=True, arrival_rate=1.0, slo_tpot=1.2),
    )
    assert df["ttft_p90_s"].iloc[1] == pytest.approx(direct.serving["ttft_s"]["p90"])
    assert df["goodput_requests_per_s"].iloc[1] == pytest.approx(
        direct.serving["goodput_requests_per_s"]
    )
    # higher load: requests wait longer for their first token
    assert df["ttft_p90_s"].iloc[1] > df["ttft_p90_s"].iloc[0]
    fig = plot_latency_load(df)
    assert len(fig.axes) == 3 and all(len(ax.lines) == 1 for ax in fig.axes)
    out = tmp_path / "ll.png"
    r = _cli("plot", str(tmp_path / "s.parquet"), "--kind", "latency-load", "-o", str(out))
    assert r.exit_code == 0 and out.stat().st_size > 0


def test_serving_grid_keys_are_checked() -> None:
    from daopsim.simulator.grid import Grid
    from daopsim.simulator.sweep_expand import expand

    with pytest.raises(UserError, match="max_batch needs an arrival_rate axis"):
        expand(Grid(policies=["lru"], traces=[TRACE], max_batch=4))
    with pytest.raises(UserError, match=r"arrival rate -1\.0"):
        expand(Grid(policies=["lru"], traces=[TRACE], arrival_rates=[-1.0]))
    with pytest.raises(UserError, match="max_batch"):
        Grid.from_dict({"policies": ["lru"], "arrival_rate": [1.0], "max_batch": 0})
    g = Grid.from_dict({"policies": ["lru"], "arrival_rate": 0.5, "slo_ttft": 2})
    assert g.arrival_rates == [0.5] and g.slo_ttft == 2


def test_run_out_writes_the_request_table_and_a_timeline_with_request_ids(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = _cli(
        "run",
        "--policy",
        "lru",
        "--trace",
        TRACE,
        "--sequences",
        "3",
        "--max-batch",
        "2",
        "--out",
        str(out),
        "--no-progress",
    )
    assert r.exit_code == 0, r.output
    req = pd.read_parquet(out / "requests.parquet")
    assert sorted(req["request_id"]) == [0, 1, 2]
    tl = pd.read_parquet(out / "timeline.parquet")
    ids = {i for cell in tl["requests"] for i in cell.split(",")}
    assert ids == {"0", "1", "2"}
    assert (tl.loc[tl["seq"] >= 0, "requests"] == tl.loc[tl["seq"] >= 0, "seq"].astype(str)).all()
    # the Perfetto trace's slices carry the same request ids
    import gzip

    doc = json.loads(gzip.decompress((out / "trace.perfetto.json.gz").read_bytes()))
    slices = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert len(slices) == len(tl)
    assert sorted(e["args"]["requests"] for e in slices) == sorted(tl["requests"])


# -- random attacks -----------------------------------------------------------------------------


def _check_invariants(
    reqs: list[Request], plan: Serving, stats: Any, tl: pd.DataFrame, batch: int, kv: int | None
) -> None:
    """What must hold after any serving run (attacked by the random and the preemption tests)."""
    # every request finishes exactly once, after it arrived, was admitted and got a token
    assert [q.finished for q in reqs] == [1] * len(reqs)
    for q in reqs:
        assert q.arrival <= q.admitted <= q.first_token <= q.finish
    assert stats.counters.sequences == len(reqs)
    assert stats.counters.decode_tokens == sum(q.output for q in reqs)
    assert not plan.sched.running and not plan.sched.queue and plan.sched.kv_used == 0
    # the KV cache and the batch size are never exceeded
    if kv is not None:
        assert plan.sched.kv_peak <= kv
    tl = tl.astype({"resource": str, "kind": str})
    steps = tl[(tl["seq"] == -1)].drop_duplicates("token")
    assert all(len(ids.split(",")) <= batch for ids in steps["requests"])
    if not plan.config.preempt:  # requests are never readmitted
        for q in reqs:
            running = [o for o in reqs if o.admitted <= q.admitted < o.finish]
            assert len(running) <= batch
    # within a batched or mixed step each expert of a layer is computed exactly once
    done = tl[tl["kind"].isin(["expert", "cpu_expert"]) & (tl["seq"] == -1)]
    assert not done.duplicated(["token", "layer", "expert"]).any()
    # time never goes back: serial lanes serve one thing at a time
    for lane in ("gpu", "h2d", "d2h"):
        rows = tl[tl["resource"] == lane].sort_values("start", kind="stable")
        assert (rows["start"].to_numpy()[1:] >= rows["end"].to_numpy()[:-1] - 1e-12).all()
    assert stats.e2e == pytest.approx(max(q.finish for q in reqs))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 4),
    continuous=st.booleans(),
    spread=st.sampled_from([0.0, 1e-4, 1e-2]),
    kv_slack=st.sampled_from([None, 0, 5, 40]),
    writeback=st.booleans(),
    chunk=st.sampled_from([None, 1, 2, 5]),
    preempt=st.booleans(),
)
def test_random_plans_and_schedules_keep_every_invariant(
    seed: int,
    batch: int,
    continuous: bool,
    spread: float,
    kv_slack: int | None,
    writeback: bool,
    chunk: int | None,
    preempt: bool,
) -> None:
    """Random legal plans (the chaos policy: every action, prefetches, evictions,
    pre-calculations) over random requests, arrivals, batch sizes, KV caches, prefill chunks
    and preemption."""
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    rng = np.random.default_rng(seed)
    seqs = [_random_seq(model, rng, i, max_prompt=4) for i in range(int(rng.integers(1, 7)))]
    arrivals = sorted(float(x) for x in rng.uniform(0, spread, size=len(seqs)))
    longest = max(s.n_tokens for s in seqs)
    kv = None if kv_slack is None else longest + kv_slack
    pol = ChaosPolicy(rng, int(rng.integers(1, 3)), int(rng.integers(1, 3)), writeback=writeback)
    config = ServingConfig(batch=batch, continuous=continuous, prefill_chunk=chunk, preempt=preempt)
    tl, stats, plan, _ = _serve(
        seqs, config, int(rng.integers(2, 10)), arrivals, pol, kv, model=model
    )
    _check_invariants(plan.requests, plan, stats, tl, batch, kv)
