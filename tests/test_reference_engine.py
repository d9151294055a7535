"""The fast engine and the independent reference engine (simulator/reference/) agree.

The reference re-implements plans into operations, residency and slots, the shared CPU, the
host thread, the SSD tier, several GPUs and the serving loop as its own SimPy processes; it
shares only the cost model, the policy API, the workload, the recorder and the result
containers with the fast engine (docs/architecture.md, "The reference engine"). Every test
here runs one configuration on both and requires the same operations (resource, kind, layer,
expert, start and end within 1e-9 s), counters and busy times:

every built-in policy on three bundled traces (Mixtral via ``ci-small``, OLMoE top-8,
Phi-3.5-MoE) at two budgets, each with the runtime profile it declares; every runtime profile
and a dispatch-bound one; one copy engine and a second machine; the shared host CPU (several
workers, partial socket shares) and unified memory; random legal plans (write-back, staging
slots, one stream, the SSD tier); CPU-resident layers; batched, continuous, chunked and
preempting serving steps; runs without a recorder; and hand-built cases (a later decision
submitted earlier, an in-use victim beside a CPU expert, refusals). Tests marked ``reference``
are what ``tests/reference_coverage.py`` measures.

The grid of built-in policies, traces and budgets is pairwise (a covering array): each policy
meets each trace and each budget, and each trace each budget, but not every triple. The other
grids (runtimes, serving hosts, runs without a recorder) have two factors, where every pair is
the full product, so they stay whole.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from equivalence import (
    ENGINES,
    SLOW_HOST,
    TOL,
    assert_same,
    both,
    chaos,
    chaos_both,
    engines_per_direction,
    host_tier,
    in_flight_both,
    inputs,
    one_copy_engine,
    run_engine,
    serving_run,
    slow_cpu,
    slow_link,
    wide_socket,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daopsim.policies.base import Action, Plan, Policy, ResourceSpec, SetupContext, Slot, View
from daopsim.policies.registry import available, get_policy_class
from daopsim.simulator.core.loop import Engine
from daopsim.simulator.costs import CostModel, cost_model
from daopsim.simulator.errors import PolicyError, UserError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.recorder import Recorder
from daopsim.simulator.reference import ReferenceEngine
from daopsim.simulator.runner import simulate
from daopsim.simulator.runtime_profiles import RuntimeProfile, runtime_names
from daopsim.simulator.serving import Serving
from daopsim.simulator.serving_config import ServingConfig
from daopsim.simulator.serving_requests import Request, dense
from daopsim.simulator.testing import (
    ChaosPolicy,
    random_routing,
    roomy,
    routing_from_experts,
    tiny_model,
)

pytestmark = pytest.mark.reference

BUILTIN = sorted(n for n, c in available().items() if c.__module__.startswith("daopsim.policies."))
TRACES = ("ci-small", "olmoe-1b-7b", "phi-3.5-moe")
RATIOS = (0.125, 0.375)
A6000 = load_profile("a6000-pcie4")


# -- built-in policies ---------------------------------------------------------------------
#: every policy on every trace; the budget takes turns, so each policy meets both budgets (on
#: different traces) and each trace both budgets (with different policies): every pair of
#: (policy, trace, budget) values occurs, not every triple
POLICY_GRID = [
    (p, t, RATIOS[(i + j) % len(RATIOS)])
    for i, p in enumerate(BUILTIN)
    for j, t in enumerate(TRACES)
]


@pytest.mark.parametrize(("policy", "trace", "ratio"), POLICY_GRID)
def test_fast_engine_matches_reference(policy: str, trace: str, ratio: float) -> None:
    both(policy, trace, ratio, A6000)


@pytest.mark.parametrize("runtime", [*runtime_names(), SLOW_HOST])
@pytest.mark.parametrize(
    ("policy", "trace"),
    [
        ("daop", "ci-small"),
        ("fiddler", "ci-small"),
        ("mixtral-offloading", "phi-3.5-moe"),
        ("lru", "olmoe-1b-7b"),
        ("ktransformers", "phi-3.5-moe"),
        ("all-gpu", "olmoe-1b-7b"),
    ],
)
def test_runtime_profiles_time_identically(
    policy: str, trace: str, runtime: str | RuntimeProfile
) -> None:
    assert len(both(policy, trace, 0.25, A6000, runtime))  # type: ignore[arg-type]


def test_both_engines_take_activation_bytes_from_the_cost_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An activation's bytes are the cost model's (``CostModel.activation_bytes``) in both
    engines: with three bytes per hidden value instead of two, both engines move, record and
    count the new size and still agree (an engine with its own figure would not)."""
    model, _, _, _ = inputs("ci-small")
    tl = both("fiddler", "ci-small", 0.25, A6000)
    assert tl is not None
    act = tl[tl["kind"] == "activation"]
    assert len(act) and (act["bytes"] % (model.hidden * 2) == 0).all()
    monkeypatch.setattr(
        CostModel, "activation_bytes", lambda self, n: int(n) * self.model.hidden * 3
    )
    wide = both("fiddler", "ci-small", 0.25, A6000)
    assert wide is not None
    act3 = wide[wide["kind"] == "activation"]
    assert len(act3) == len(act)
    assert act3["bytes"].sum() * 2 == act["bytes"].sum() * 3


def test_a_slow_host_moves_the_timeline() -> None:
    # the override reaches the engines: the same run is slower when the host is the bottleneck
    model, seqs, _, _ = inputs("olmoe-1b-7b")
    make = get_policy_class("all-gpu")
    for cls in ENGINES:
        _, fast, _ = run_engine(cls, make, model, A6000, model.total_experts, seqs, runtime="ideal")
        _, slow, _ = run_engine(cls, make, model, A6000, model.total_experts, seqs,
                                runtime=SLOW_HOST)  # fmt: skip
        assert slow.e2e > fast.e2e
        assert slow.counters.dispatch_stall > 0 and slow.counters.host_syncs > 0


@pytest.mark.parametrize(
    ("policy", "opts"),
    [
        ("daop", {}),
        ("fiddler", {}),
        ("mixtral-offloading", {"prefetch": True}),
        ("stream-all", {}),
        ("stream-all", {"gather": "leaf"}),
        ("lru", {}),
        ("moe-infinity", {}),
        ("hobbit", {}),
        ("llama-cpp-layers", {"ngl": 3, "prefill_offload": False}),
    ],
)
def test_one_copy_engine_and_another_profile(policy: str, opts: dict[str, Any]) -> None:
    tl = both(policy, "ci-small", 0.25, one_copy_engine("a6000-pcie4"), None, **opts)
    assert tl is not None and "copy" in set(tl["resource"].astype(str))
    both(policy, "ci-small", 0.125, load_profile("rtx4090-pcie4"), None, **opts)


@pytest.mark.parametrize(("low_t", "skip_t"), [(0.0, 1.0), (0.0, 0.0), (0.3, 0.5), (0.0, 0.4)])
def test_low_bit_copies_and_skipped_experts(low_t: float, skip_t: float) -> None:
    """hobbit's low-bit temporary copies and skipped experts (Plan.low_bit, a substituted
    route): the low-bit copy's own time and bytes and the gate-mass accounting, on the default
    machine and on one copy engine with a slow host."""
    opts = {"low_bit_threshold": low_t, "skip_threshold": skip_t}
    for hw, runtime in ((A6000, None), (one_copy_engine("a6000-pcie4"), SLOW_HOST)):
        tl = both("hobbit", "ci-small", 0.2, hw, runtime, **opts)
        assert tl is not None
        if skip_t > low_t:
            assert (tl["kind"].astype(str) == "temp").any(), "no low-bit copy was made"


def test_in_use_victims_are_written_back_after_their_computation() -> None:
    """One slot per layer and top-2 routing: a layer's second miss evicts the expert it has
    just run; its write-back starts once that computation ends."""
    for hw in (A6000, one_copy_engine("a6000-pcie4")):
        tl = both("mixtral-offloading", "ci-small", 0.375, hw, experts_per_layer=1)
        assert tl is not None
        wb = tl[tl["kind"].astype(str) == "writeback"]
        gpu = tl[(tl["resource"].astype(str) == "gpu") & (tl["kind"].astype(str) == "expert")]
        same = wb.merge(gpu, on=["seq", "token", "layer", "expert"], suffixes=("_wb", "_gpu"))
        assert len(same), "no expert was evicted in the layer that used it"
        assert (same["start_wb"] >= same["end_gpu"] - TOL).all()


@pytest.mark.parametrize("runtime", [None, SLOW_HOST])
def test_a_gather_barrier_holds_every_expert_until_the_layer_has_landed(
    runtime: RuntimeProfile | None,
) -> None:
    """stream-all gather=leaf (ZeRO-3's pre-forward gather): no GPU expert of a layer starts
    before the last copy into that layer ends, in prefill and decode, on both engines; with
    gather=layer some do (a routed expert runs while the rest of its layer is copied)."""
    for barrier in (True, False):
        tl = both("stream-all", "ci-small", 0.25, load_profile("rtx6000ada-pcie4"), runtime,
                  gather="leaf" if barrier else "layer")  # fmt: skip
        assert tl is not None
        kind = tl["kind"].astype(str)
        copies = tl[kind.isin(["fetch", "prefetch"])]
        last = copies.groupby(["seq", "token", "layer"])["end"].max().rename("landed")
        gpu = tl[(tl["resource"].astype(str) == "gpu") & (kind == "expert")]
        joined = gpu.join(last, on=["seq", "token", "layer"], how="inner")
        assert len(joined) > 100
        early = joined["start"] < joined["landed"] - TOL
        assert not early.any() if barrier else early.any()


@pytest.mark.parametrize(
    ("policy", "opts"),
    [
        ("daop", {"cpu_workers": 2}),
        ("daop", {"cpu_workers": 3}),
        ("fiddler", {}),
        ("stream-all", {}),
        ("stream-all", {"gather": "leaf"}),
        ("lru", {}),
        ("hobbit", {}),
        ("llama-cpp-layers", {}),
    ],
)
def test_shared_cpu_and_unified_memory(policy: str, opts: dict[str, Any]) -> None:
    both(policy, "ci-small", 0.25, wide_socket("a6000-pcie4"), None, **opts)
    # bf16 models do not fit the 64 GB device with its host copies: the same machine, roomier
    tl = both(policy, "ci-small", 0.25, roomy("jetson-orin-64g"), None, **opts)
    assert tl is not None and len(tl)
    both(
        policy, "phi-3.5-moe", 0.125, roomy(wide_socket("jetson-orin-64g", 1.3)), SLOW_HOST, **opts
    )


# -- random legal plans --------------------------------------------------------------------
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(
    seed=st.integers(0, 2**31 - 1),
    budget_frac=st.floats(0.0, 1.0),
    writeback=st.booleans(),
    staging=st.integers(0, 2),
    copy_engines=st.sampled_from([1, 2]),
    host=st.sampled_from(["a6000-pcie4", "jetson-orin-64g"]),
    socket=st.sampled_from([None, 1.5]),
    runtime=st.sampled_from(["ideal", "hf-eager", "llama.cpp", SLOW_HOST]),
)
def test_random_plans_time_identically(
    seed: int,
    budget_frac: float,
    writeback: bool,
    staging: int,
    copy_engines: int,
    host: str,
    socket: float | None,
    runtime: str | RuntimeProfile,
) -> None:
    """Random legal plans (every action, prefetch, eviction, pre-calculation) on a
    bus-attached and a unified-memory host, with whole and partial socket shares, a slow CPU
    so that calls overlap each other, copies and GPU kernels."""
    hw = slow_cpu(load_profile(host) if socket is None else wide_socket(host, socket))
    hw = dataclasses.replace(hw, link=dataclasses.replace(hw.link, copy_engines=copy_engines))
    chaos_both(seed, hw, round(budget_frac * 18), runtime=runtime, writeback=writeback,
               staging_buffers=staging)  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("copy_engines", [1, 2])
@pytest.mark.parametrize("runtime", ["ideal", SLOW_HOST])
def test_one_stream_random_plans_time_identically(
    seed: int, copy_engines: int, runtime: str | RuntimeProfile
) -> None:
    """A one-stream spec (ResourceSpec.one_stream: copies and kernels in issue order) under
    random legal plans (fetches with victims, temporary copies into few buffers, prefetches,
    evictions, with and without write-back and staging slots)."""
    hw = dataclasses.replace(A6000, link=dataclasses.replace(A6000.link, copy_engines=copy_engines))
    stats = chaos_both(seed, hw, 2 + 3 * seed, runtime=runtime, writeback=bool(seed % 2),
                       staging_buffers=seed % 3, one_stream=True)  # fmt: skip
    assert stats.counters.h2d_expert_copies > 0


# -- two copy engines per direction --------------------------------------------------------
def _second_engine_rows(tl: Any) -> int:
    """Rows on a copy direction's second engine (``h2d.1``, ``d2h.1``, ``h2d0.1`` ...)."""
    return int(tl["resource"].astype(str).str.endswith(".1").sum())


@pytest.mark.parametrize(
    ("policy", "opts"),
    [
        ("lru", {}),
        ("daop", {}),
        ("mixtral-offloading", {"prefetch": True}),
        ("stream-all", {}),
        ("moe-infinity", {}),
        ("fiddler", {}),
    ],
)
def test_two_copy_engines_per_direction_time_identically(policy: str, opts: dict[str, Any]) -> None:
    """A profile with two copy engines in each direction (``link.copy_engines_per_direction =
    2``): copies in one direction overlap, one per engine, on both engines alike, and the
    second engines carry copies (on a slow link, where copies queue) unless the policy issues
    copies on one stream (then one engine per direction serves them)."""
    hw = engines_per_direction(slow_link(A6000, 5.0))
    tl = both(policy, "ci-small", 0.25, hw, **opts)
    assert tl is not None
    spec = get_policy_class(policy)(**opts).resources()
    if spec.one_stream:
        assert _second_engine_rows(tl) == 0
    elif policy != "fiddler":  # fiddler copies nothing but activations, one at a time
        assert _second_engine_rows(tl) > 0


@pytest.mark.parametrize("seed", range(8))
def test_random_plans_on_two_copy_engines_per_direction_time_identically(seed: int) -> None:
    """Random legal plans (write-backs holding an engine of each direction, temporary copies,
    prefetches, CPU activations, copies evicted in flight, every plan flag) on two engines per
    direction, a slow link so that copies queue; an SSD tier on odd seeds."""
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    host = ("a6000-pcie4", "rtx4090-990pro-pcie4")[seed % 2]
    hw = engines_per_direction(slow_cpu(slow_link(load_profile(host), 8.0)))
    tier = host_tier(model, hw, 2 + seed % 3, ("page-cache", "gds")[seed // 2 % 2])
    stats = chaos_both(seed, hw, 3 + seed, runtime=("ideal", "hf-eager", SLOW_HOST)[seed % 3],
                       host_tier=tier if seed % 2 else None, writeback=seed % 4 < 2,
                       staging_buffers=seed % 3, flags=seed % 3 == 1,
                       in_flight=seed % 4 == 3)  # fmt: skip
    assert stats.counters.h2d_expert_copies > 0


def test_a_second_engine_per_direction_shortens_a_copy_bound_run() -> None:
    """More engines per direction never slow a run down, and on a copy-bound run (a slow link,
    LRU at a small budget) they speed it up."""
    model, seqs, dec, pre = inputs("ci-small")
    make = get_policy_class("lru")
    budget = round(0.125 * model.total_experts)
    hw = slow_link(A6000, 5.0)
    e2e = [run_engine(cls, make, model, h, budget, seqs, (dec, pre), record=False)[1].e2e
           for h in (hw, engines_per_direction(hw)) for cls in ENGINES]  # fmt: skip
    assert e2e[0] == pytest.approx(e2e[1], abs=TOL) and e2e[2] == pytest.approx(e2e[3], abs=TOL)
    assert e2e[2] < e2e[0]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("path", ["page-cache", "gds"])
def test_random_plans_on_an_ssd_tier_time_identically(seed: int, path: str) -> None:
    """Random legal plans with most experts on the drive (docs/serving.md, "An SSD tier"):
    drive reads in issue order, an expert read once while its read is in flight, write-backs
    landing host copies, GPUDirect reads replacing copies; one stream on odd seeds."""
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    hw = slow_cpu(load_profile("rtx4090-990pro-pcie4"))
    tier = host_tier(model, hw, 1 + seed % 5, path)
    stats = chaos_both(seed, hw, 3 + seed, runtime=["ideal", "hf-eager", SLOW_HOST][seed % 3],
                       host_tier=tier, writeback=seed % 3 == 0, staging_buffers=seed % 2,
                       one_stream=bool(seed % 2))  # fmt: skip
    assert stats.host_tier["ssd_reads"] > 0


@pytest.mark.parametrize("seed", range(8))
def test_random_plans_with_every_flag_time_identically(seed: int) -> None:
    """Random legal plans that also draw ``cpu_serial``, ``cpu_first``, ``barrier``,
    ``actions=None``, a second pre-calculation and numpy-integer slots, on hosts that vary
    with the seed: write-back, staging slots, two copy engines or one, unified memory, a wide
    socket, three CPU workers, an SSD tier, one stream."""
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    host = ("a6000-pcie4", "jetson-orin-64g", "rtx4090-990pro-pcie4")[seed % 3]
    hw = slow_cpu(wide_socket(host, 1.4) if seed % 4 == 1 else load_profile(host))
    if seed % 4 == 3:
        hw = dataclasses.replace(hw, link=dataclasses.replace(hw.link, copy_engines=1))
    tier = host_tier(model, hw, 3, "gds" if seed % 2 else "page-cache") if seed % 3 == 2 else None
    chaos_both(seed, hw, 4 + 2 * seed, runtime=(SLOW_HOST, "hf-eager", "ideal")[seed % 3],
               host_tier=tier, flags=True, writeback=seed % 2 == 0, staging_buffers=seed % 3,
               one_stream=seed == 5, workers=3 if seed % 4 == 2 else None)  # fmt: skip


@pytest.mark.parametrize("seed", range(8))
def test_random_plans_evicting_copies_in_flight_time_identically(seed: int) -> None:
    """Victims whose copy is still in flight (issued by an earlier plan, or earlier in the
    same one; docs/policy-api.md, "Timing rules"): the copy goes on, and the slot is released,
    or the expert written back, when it lands. On a slow link (copies outlast layers), with
    and without write-back, on an SSD tier (both paths), one stream, every plan flag."""
    stats = in_flight_both(seed)
    assert stats.counters.evictions_in_flight > 0


def test_a_host_budget_that_holds_every_expert_reads_nothing() -> None:
    """With a host-memory budget that holds every expert the drive is never read, and both
    engines report the same host-tier figures (no reads, the whole model's peak)."""
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    hw = load_profile("rtx4090-990pro-pcie4")
    stats = chaos_both(3, hw, 8, host_tier=host_tier(model, hw, 18, "page-cache"),
                       writeback=True)  # fmt: skip
    assert stats.host_tier["ssd_reads"] == 0 and stats.busy["ssd"] == 0.0


# -- serving -------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["a6000-pcie4", "jetson-orin-64g"])
@pytest.mark.parametrize("policy", BUILTIN)
def test_batched_and_continuous_serving_time_identically(policy: str, host: str) -> None:
    """Static batches (all requests at 0) and continuous batching with staggered arrivals:
    batched steps (the union of the batch's experts) time the same on both engines."""
    hw = load_profile(host)
    cases = [(ServingConfig(batch=3), [0.0] * 4)]
    if not get_policy_class(policy).clairvoyant:
        cases.append((ServingConfig(batch=3, continuous=True), [0.0, 0.01, 0.5, 2.0]))
    for config, arrivals in cases:
        ta, sa, ea = serving_run(Engine, policy, hw, config, arrivals)
        tb, sb, _ = serving_run(ReferenceEngine, policy, hw, config, arrivals)
        assert ea.serving.batch_steps > 0
        assert_same(ta, tb, sa, sb)


@pytest.mark.parametrize(
    "options", [{"ngl": 8}, {"ngl": 8, "prefill_offload": False}], ids=["offload", "on-cpu"]
)
def test_a_static_batch_prefill_with_cpu_layers_times_identically(options: dict[str, Any]) -> None:
    """A static batch's prompts in one prefill step, with CPU-resident layers (run on the CPU,
    or on the GPU after their weights are copied)."""
    config = ServingConfig(batch=3)
    ta, sa, ea = serving_run(Engine, "llama-cpp-layers", A6000, config, [0.0] * 4, options)
    tb, sb, _ = serving_run(ReferenceEngine, "llama-cpp-layers", A6000, config, [0.0] * 4, options)
    assert ea.n_cpu_layers > 0 and ea.serving.batched_prefills == 1
    assert_same(ta, tb, sa, sb)


def _chaos_serving(seed: int, config: ServingConfig, kv_room: int | None, hw: Any) -> None:
    """The chaos policy's random legal plans over requests arriving within 2 ms."""
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    out = []
    for cls in ENGINES:
        rng = np.random.default_rng(seed)
        prompt = 4 if config.extended else 2
        seqs = [random_routing(model, s, prompt, int(rng.integers(2, 6)), rng) for s in range(5)]
        times = sorted(float(x) for x in rng.uniform(0, 2e-3, size=5))
        reqs = [
            Request(s, s, t, r.n_prefill, r.n_decode, dense(r, model.experts))
            for s, (r, t) in enumerate(zip(seqs, times, strict=True))
        ]
        kv = None if kv_room is None else max(q.kv_tokens for q in reqs) + kv_room
        pol = ChaosPolicy(rng, 2, 2, writeback=bool(seed % 2), staging_buffers=seed % 2)
        rec = Recorder()
        runtime = SLOW_HOST if seed % 3 == 0 else None  # a dispatch-bound host on some seeds
        eng = cls(pol, model, cost_model(hw, model), 8, None, None, None, rec, runtime=runtime)
        pol.engine = eng
        eng.serving = Serving(reqs, config, kv)
        stats = eng.run(iter(()))
        out.append((rec.timeline(), stats, eng))
    (ta, sa, ea), (tb, sb, eb) = out
    assert ea.serving.batch_steps > 0
    assert ea.serving.batch_steps == eb.serving.batch_steps
    assert_same(ta, tb, sa, sb)
    for qa, qb in zip(ea.serving.requests, eb.serving.requests, strict=True):
        assert (qa.first_token, qa.finish) == pytest.approx((qb.first_token, qb.finish), abs=TOL)


@pytest.mark.parametrize("seed", range(6))
def test_random_plans_in_batched_steps_time_identically(seed: int) -> None:
    """Continuous batches with staggered arrivals (write-back on odd seeds; a unified-memory
    host on seeds >= 3)."""
    hw = slow_cpu(load_profile("jetson-orin-64g" if seed >= 3 else "a6000-pcie4"))
    _chaos_serving(seed, ServingConfig(batch=3, continuous=True), None, hw)


@pytest.mark.parametrize("seed", range(4))
def test_chunked_prefill_and_preemption_time_identically(seed: int) -> None:
    """Mixed steps (prompt chunks beside decode tokens) and recompute preemption under a tight
    KV cache, with random legal plans."""
    hw = load_profile("jetson-orin-64g" if seed >= 2 else "a6000-pcie4")
    config = ServingConfig(batch=3, continuous=True, prefill_chunk=1 + seed % 3, preempt=True)
    _chaos_serving(100 + seed, config, 2, hw)


@pytest.mark.parametrize("seed", range(3))
def test_random_plans_with_streamed_weights_in_batched_steps(seed: int) -> None:
    """ZeRO-3's streamed non-expert weights in batched and mixed steps, with random legal
    plans keeping the H2D lane busy; the embedding is small enough to stay on the GPU
    (ResourceSpec.nonexpert_persist_numel), so only the layers' weights cross."""
    model = dataclasses.replace(tiny_model(experts=6, top_k=2, moe_layers=3),
                                non_expert_params=2_000_000, embedding_params=50_000)  # fmt: skip
    config = ServingConfig(batch=3, continuous=True, prefill_chunk=2 if seed else None)
    out = []
    for cls in ENGINES:
        rng = np.random.default_rng(seed)
        seqs = [random_routing(model, s, 3, int(rng.integers(2, 5)), rng) for s in range(4)]
        reqs = [Request(s, s, 1e-4 * s, r.n_prefill, r.n_decode, dense(r, model.experts))
                for s, r in enumerate(seqs)]  # fmt: skip
        pol = ChaosPolicy(rng, 2, 1, writeback=bool(seed % 2), flags=True)
        pol.spec = dataclasses.replace(pol.spec, nonexpert_streamed=True)
        rec = Recorder()
        eng = cls(pol, model, cost_model(A6000, model), 8, None, None, None, rec,
                  runtime=SLOW_HOST)  # fmt: skip
        pol.engine = eng
        eng.serving = Serving(reqs, config, None)
        stats = eng.run(iter(()))
        out.append((rec.timeline(), stats))
    (ta, sa), (tb, sb) = out
    assert (ta["kind"].astype(str) == "weights").any()
    assert not (ta["kind"].astype(str) == "embedding").any()
    assert_same(ta, tb, sa, sb)


def test_streamed_weights_in_serving_steps_time_identically() -> None:
    """stream-all (ZeRO-3's streamed non-expert weights) in static and continuous batches:
    each step's layer weights and the embedding matrices queue on the H2D lane."""
    for config, arrivals in (
        (ServingConfig(batch=3), [0.0] * 4),
        (ServingConfig(batch=2, continuous=True, prefill_chunk=3), [0.0, 0.001, 0.3, 0.4]),
    ):
        ta, sa, _ = serving_run(Engine, "stream-all", A6000, config, arrivals)
        tb, sb, _ = serving_run(ReferenceEngine, "stream-all", A6000, config, arrivals)
        assert (ta["kind"].astype(str) == "weights").any()
        assert_same(ta, tb, sa, sb)


# -- runs without a recorder ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("policy", "trace", "opts"),
    [
        ("stream-all", "olmoe-1b-7b", {}),
        ("vllm-cpu-offload", "phi-3.5-moe", {}),
        ("llama-cpp-layers", "ci-small", {"ngl": 3}),
        ("lfu", "olmoe-1b-7b", {}),
        ("global-lfu", "ci-small", {}),
        ("static", "ci-small", {}),
        ("ktransformers", "phi-3.5-moe", {"gpu_experts_per_layer": 1}),
        ("fiddler", "ci-small", {}),
        ("daop", "ci-small", {}),
        ("mixtral-offloading", "ci-small", {}),
        ("mixtral-offloading", "phi-3.5-moe", {"experts_per_layer": 1}),
        ("mixtral-offloading", "ci-small", {"prefetch": True, "copy_stream": "side"}),
        ("hobbit", "olmoe-1b-7b", {"low_bit_threshold": 0.3, "skip_threshold": 1.0}),
    ],
)
@pytest.mark.parametrize("runtime", [None, SLOW_HOST])
def test_runs_without_a_recorder_agree(
    policy: str, trace: str, opts: dict[str, Any], runtime: RuntimeProfile | None
) -> None:
    """Without a recorder (how sweeps and benchmarks run) the fast engine agrees with the
    reference on every counter, the token latencies, the end and the busy times."""
    both(policy, trace, 0.25, A6000, runtime, record=False, **opts)


@pytest.mark.parametrize("seed", range(4))
def test_random_plans_without_a_recorder_agree(seed: int) -> None:
    """Random legal plans, one stream on even seeds, without a recorder."""
    hw = slow_cpu(one_copy_engine("a6000-pcie4") if seed % 2 else A6000)
    spec = {"writeback": bool(seed % 2), "staging_buffers": seed % 3, "one_stream": seed % 2 == 0}
    chaos_both(seed, hw, 2 + 3 * seed, runtime=SLOW_HOST, record=False, **spec)


# -- hand-built cases ----------------------------------------------------------------------
class LateReturn(Policy):
    """Layer 0 pre-calculates (1, 3) on the CPU; layer 1 fetches expert 1 while it runs.

    The pre-calculation's return copy is decided at layer 0 but submitted only when the CPU
    result exists; layer 1's fetch is decided later but submitted first, so it goes first.
    """

    name = "late-return"

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        return [(0, 0), (0, 1)]

    def decode_layer(self, view: View) -> Plan:
        if view.layer == 0:
            return Plan(actions={0: Action.GPU, 1: Action.GPU}, precalc=[(1, 3)])
        return Plan(actions={1: Action.FETCH, 3: Action.PRECOMPUTED})


def test_a_later_decision_submitted_earlier_goes_first() -> None:
    model = tiny_model(experts=4, top_k=2, moe_layers=2)
    r = routing_from_experts(model, [[[0, 1], [1, 3]]], seq_id=0, n_prefill=0)
    hw = slow_cpu(A6000, 1e4)  # the pre-calculation outlasts layer 1's decision
    (ta, sa, _), (tb, sb, _) = (run_engine(cls, LateReturn, model, hw, 3, [r]) for cls in ENGINES)
    assert_same(ta, tb, sa, sb)
    assert ta is not None
    tl = ta.astype({"resource": str, "kind": str})
    fetch = tl[tl["kind"] == "fetch"].iloc[0]
    ret = tl[(tl["kind"] == "activation") & (tl["resource"] == "h2d")].iloc[0]
    cpu = tl[tl["kind"] == "precalc"].iloc[0]
    decision1 = tl[(tl["kind"] == "nonexpert") & (tl["layer"] == 1)].iloc[0]["end"]
    assert decision1 < cpu["end"]  # the fetch is submitted before the CPU result exists
    assert fetch["start"] == pytest.approx(decision1)  # ... and starts at once
    assert ret["start"] == pytest.approx(max(cpu["end"], fetch["end"]))  # the return queues


class InUseVictimBesideCpu(Policy):
    """Each layer: a hit on the GPU, a miss fetched over that hit (an in-use victim, written
    back after its computation) and a miss on the CPU, all in one plan."""

    name = "in-use-victim-beside-cpu"

    def resources(self) -> ResourceSpec:
        return ResourceSpec(writeback=True, evicts_in_use=True, cpu_workers=1, staging_buffers=2)

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        return [(layer, e) for layer in range(ctx.model.moe_layers) for e in (0, 3)]

    def decode_layer(self, view: View) -> Plan:
        layer = view.layer
        res = view.resident[layer]
        routed = view.experts.tolist()
        hit = next(e for e in routed if res[e])
        fetch, cpu = (e for e in routed if not res[e])
        return Plan(
            actions={hit: Action.GPU, fetch: Action.FETCH, cpu: Action.CPU},
            victims={fetch: (layer, hit)},
        )


def test_an_in_use_victim_beside_a_cpu_expert() -> None:
    model = tiny_model(experts=6, top_k=3, moe_layers=2)
    tokens = [[[0, 1, 2]] * 2, [[1, 0, 2]] * 2] * 3
    seqs = [routing_from_experts(model, tokens)]
    out = [run_engine(cls, InUseVictimBesideCpu, model, A6000, 4, seqs) for cls in ENGINES]
    (ta, sa, _), (tb, sb, _) = out
    assert_same(ta, tb, sa, sb)
    assert sa.counters.cpu_expert_evals == 12
    assert ta is not None and (ta["kind"].astype(str) == "writeback").sum() == 12


class MutatingStreamAll(get_policy_class("stream-all")):  # type: ignore[misc]
    """stream-all that, after a while, changes the plans it keeps returning in place: one
    evict entry becomes an equal pair of other types (``(layer, True)`` for ``(layer, 1)``),
    which makes the plan malformed."""

    calls = 0

    def decode_layer(self, view: View) -> Plan:
        MutatingStreamAll.calls += 1
        if MutatingStreamAll.calls == 20:
            for plan in self._plans.values():
                for i, (vl, ve) in enumerate(plan.evict):
                    if ve == 1:
                        plan.evict[i] = (vl, True)
        return super().decode_layer(view)


class Faulty(Policy):
    """Refused decisions, one per mode: a hook that raises, a route substituted in prefill,
    a fetch of an expert fetched before, a pre-calculation for a past layer."""

    name = "faulty"

    def __init__(self, mode: str = "raise") -> None:
        super().__init__()
        self.mode = mode

    def prefill_layer(self, view: View) -> Plan:
        if self.mode == "prefill-route":
            return Plan(route=np.array(view.experts[:1]))
        return Plan(actions=dict.fromkeys(view.experts.tolist(), Action.TEMP))

    def decode_layer(self, view: View) -> Plan:
        experts = view.experts.tolist()
        if self.mode == "fetch-resident":  # the second token fetches what the first did
            return Plan(actions=dict.fromkeys(experts, Action.FETCH))
        if view.token < 2:
            return Plan(actions=dict.fromkeys(experts, Action.TEMP))
        if self.mode == "raise":
            raise ValueError("no plan today")
        if self.mode == "user-error":  # a UserError passes through the seam unchanged
            raise UserError("option 'x' is wrong")
        return Plan(actions=dict.fromkeys(experts, Action.TEMP), precalc=[(0, 2)])


def test_refusals_are_the_same_on_both_engines() -> None:
    """A malformed plan changed in place, a hook that raises, a route in prefill, a fetch of a
    resident expert and a pre-calculation for a layer not to come are refused with the same
    one-line PolicyError (the policy seam's checks, simulator/boundary.py)."""
    model = tiny_model(experts=4, top_k=2, moe_layers=4)
    seqs = [routing_from_experts(model, [[[0, 1]] * 4] * 12)]
    cases: list[tuple[Any, str]] = [(MutatingStreamAll, "malformed plan")]
    cases += [(functools.partial(Faulty, mode), word) for mode, word in (
        ("raise", "no plan today"), ("fetch-resident", "already resident"),
        ("user-error", "option 'x' is wrong"),
        ("precalc-past", "coming layer"),
    )]  # fmt: skip
    pre = [routing_from_experts(model, [[[0, 1]] * 4] * 4, n_prefill=2)]
    cases.append((functools.partial(Faulty, "prefill-route"), "during prefill"))
    for make, word in cases:
        msgs = []
        for record in (False, True):
            for cls in ENGINES:
                MutatingStreamAll.calls = 0
                runs = pre if "prefill" in word else seqs
                with pytest.raises((PolicyError, UserError)) as err:
                    run_engine(cls, make, model, A6000, 8, runs, record=record)
                msgs.append(str(err.value))
        assert word in msgs[0]
        assert len(set(msgs)) == 1, msgs


def test_simulate_and_cli_select_the_reference_engine(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from daopsim.simulator.cli import main
    from daopsim.simulator.testing import make_trace

    trace = make_trace(tmp_path / "t.parquet", sequences=3, prefill=3, decode=4, seed=2)
    a = simulate(policy="lru", trace=trace, gpu_experts=8, engine="fast")
    b = simulate(policy="lru", trace=trace, gpu_experts=8, engine="reference")
    assert b.config["engine"] == "reference"
    assert a.metrics == pytest.approx(b.metrics, rel=1e-12, nan_ok=True)
    args = ["run", "--policy", "lru", "--trace", str(trace), "--gpu-experts", "8"]
    res = CliRunner().invoke(main, [*args, "--engine", "reference", "--no-bounds", "--json"])
    assert res.exit_code == 0, res.output
    assert '"engine": "reference"' in res.output


def test_the_reference_engine_imports_none_of_the_fast_engines_timing() -> None:
    """Independence (docs/architecture.md, "The reference engine"): the reference's modules
    import only the cost model, the policy API and seam, the workload, the recorder and the
    result containers; never the fast engine's executor, residency, machine or host thread."""
    import ast
    import pkgutil

    import daopsim.simulator.reference as ref

    allowed = {
        "daopsim.policies.base": None,
        "daopsim.simulator.boundary": None,
        "daopsim.simulator.costs": None,
        "daopsim.simulator.core.ops": {"Counters"},
        "daopsim.simulator.errors": None,
        "daopsim.simulator.hosttier": {"HostTierConfig"},
        "daopsim.simulator.models": None,
        "daopsim.simulator.multigpu": {"Placement"},
        "daopsim.simulator.recorder": None,
        "daopsim.simulator.runtime_profiles": {"RuntimeProfile"},
        "daopsim.simulator.runstats": {"RunStats"},
        "daopsim.simulator.scheduler": None,
        "daopsim.simulator.serving": {"Serving"},
        "daopsim.simulator.serving_requests": None,
        "daopsim.simulator.trace": None,
        "daopsim.simulator.trace_format": None,
        "daopsim.simulator.trace_read": None,
    }
    for info in pkgutil.iter_modules(ref.__path__):
        path = Path(ref.__path__[0]) / f"{info.name}.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = {a.name for a in node.names}
                assert not {
                    n for n in names if n.startswith(("daopsim.simulator", "daopsim.policies"))
                }, path
            elif isinstance(node, ast.ImportFrom) and node.module:
                mod = node.module
                if mod.startswith("daopsim.simulator.reference") or not mod.startswith(
                    ("daopsim.simulator", "daopsim.policies")
                ):
                    continue
                assert mod in allowed, f"{path.name} imports {mod}"
                names = {a.name for a in node.names}
                ok = allowed[mod]
                assert ok is None or names <= ok, f"{path.name} imports {names - ok} from {mod}"


def test_a_chaos_run_replays_the_same_plans_on_both_engines() -> None:
    """The chaos policy's plans depend on what it reads from the engine (copies landed, CPU
    results pending): identical plan streams on both engines mean identical state too."""
    hw = slow_cpu(A6000)
    plans = []
    for cls in ENGINES:
        _, _, eng = chaos(cls, 7, hw, 9, writeback=True, staging_buffers=1)
        plans.append(eng.policy.precomputed)
    assert plans[0] == plans[1] and len(plans[0]) > 0


class SerialCpuLayers(Policy):
    """Two CPU-resident layers whose experts run as one serial CPU task, then a GPU layer
    whose experts are copied into a temporary buffer."""

    name = "serial-cpu-layers"

    def resources(self) -> ResourceSpec:
        return ResourceSpec(gpu_blocks=1, cpu_workers=1, temp_buffers=1)

    def decode_layer(self, view: View) -> Plan:
        experts = view.experts.tolist()
        if view.layer < 2:
            return Plan(actions=dict.fromkeys(experts, Action.CPU), cpu_serial=True)
        return Plan(actions=dict.fromkeys(experts, Action.TEMP))


def test_a_serial_cpu_task_on_a_cpu_layer_waits_for_its_drive_reads() -> None:
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    rng = np.random.default_rng(5)
    seqs = [random_routing(model, 0, 0, 6, rng)]
    hw = load_profile("rtx4090-990pro-pcie4")
    tier = host_tier(model, hw, 2, "page-cache")
    out = [run_engine(cls, SerialCpuLayers, model, hw, 18, seqs, host_tier=tier) for cls in ENGINES]
    (ta, sa, _), (tb, sb, _) = out
    assert sa.host_tier["ssd_reads"] > 0
    assert_same(ta, tb, sa, sb)
