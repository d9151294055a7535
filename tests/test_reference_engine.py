"""The fast engine and the plain-SimPy reference engine give identical timelines.

Both time the same plans under the queueing rule of docs/policy-api.md. For every built-in
policy on three bundled traces (Mixtral via ``ci-small``, OLMoE top-8, Phi-3.5-MoE) at two
budgets, every operation (resource, kind, layer, expert, start, end) and every counter must
match, each policy with the runtime profile it declares (its host thread: dispatch and
syncs). Further cases: every runtime profile, a dispatch-bound one, a profile with one copy
engine, a second profile, the shared host CPU
(several worker threads, partial socket shares) and unified memory (CPU calls re-timed by
copies and GPU kernels taking DRAM), random legal plans
(the chaos policy, with write-back and staging buffers), whole layers on the CPU
(llama-cpp-layers: a CPU-resident layer's non-expert part and experts, the split's copy and
the prompt's weight copies), batched serving steps (static and
continuous batching, docs/serving.md), and a hand-built out-of-order case
where a request decided later is submitted earlier than one booked ahead of it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.base import Action, Plan, Policy, ResourceSpec, SetupContext, Slot, View
from policies.registry import available, get_policy_class
from simulator.costs import cost_model
from simulator.data import resolve_trace
from simulator.engine import Engine, EngineBase
from simulator.errors import PolicyError
from simulator.hardware import HardwareProfile, load_profile
from simulator.recorder import Recorder
from simulator.reference import ReferenceEngine
from simulator.runner import Oracle, calibration_counts, simulate, split_sequences
from simulator.runtime_profiles import RuntimeProfile, get_runtime, runtime_names, with_costs
from simulator.serving import Request, Serving, ServingConfig, dense, step_oracle, trim
from simulator.testing import (
    ChaosPolicy,
    random_routing,
    roomy,
    routing_from_experts,
    tiny_model,
)
from simulator.trace import SequenceRouting, iter_sequences, read_meta, sequence_ids

TOL = 1e-9
BUILTIN = sorted(n for n, c in available().items() if c.__module__.startswith("policies."))
TRACES = ("ci-small", "olmoe-1b-7b", "phi-3.5-moe")
RATIOS = (0.125, 0.375)
DECODE = 10  # decode tokens kept per sequence (keeps the test fast)


def _cut(r: SequenceRouting, decode: int) -> SequenceRouting:
    """The sequence's prompt and its first ``decode`` generated tokens."""
    n = r.n_prefill + decode
    arrays = {
        f.name: getattr(r, f.name)[:n]
        for f in dataclasses.fields(r)
        if isinstance(getattr(r, f.name), np.ndarray)
    }
    return dataclasses.replace(r, **arrays)


@functools.cache
def _inputs(trace: str) -> tuple[Any, list[SequenceRouting], np.ndarray, np.ndarray]:
    """Model, two cut evaluation sequences and calibration counts of a bundled trace."""
    path = resolve_trace(trace)
    meta = read_meta(path)
    ev, cal = split_sequences(meta, sequence_ids(path), None, False)
    seqs = [_cut(r, DECODE) for r in iter_sequences(path, meta, sequences=set(ev[:2]))]
    dec, pre = calibration_counts(path, meta, cal, _EAMS.setdefault(trace, []))
    return meta.model, seqs, dec, pre


#: per-sequence calibration matrices of each trace (filled by _inputs)
_EAMS: dict[str, list[np.ndarray]] = {}


def _run(
    cls: type[EngineBase],
    make: Any,
    model: Any,
    hw: HardwareProfile,
    budget: int,
    seqs: list[SequenceRouting],
    calib: tuple[np.ndarray, np.ndarray] | tuple[None, None] = (None, None),
    runtime: str | RuntimeProfile | None = None,
    eams: tuple[np.ndarray, ...] | None = None,
) -> tuple[pd.DataFrame, Any, EngineBase]:
    pol = make()
    rt = get_runtime(pol.runtime_profile if runtime is None else runtime)
    if pol.resources().unlimited_memory:
        budget = model.total_experts
    oracle = None
    if pol.clairvoyant:
        oracle = Oracle(model.moe_layers, model.experts)
        for r in seqs:
            oracle.add(r)
    rec = Recorder()
    eng = cls(
        pol, model, cost_model(hw, model), budget, calib[0], calib[1], oracle, rec,
        runtime=rt, calibration_sequences=eams,
    )  # fmt: skip
    if isinstance(pol, ChaosPolicy):
        pol.engine = eng
    stats = eng.run(iter(seqs))
    return rec.timeline(), stats, eng


def assert_same(a: pd.DataFrame, b: pd.DataFrame, sa: Any, sb: Any) -> None:
    """Identical operations (within TOL seconds), counters and busy times."""
    key = ["resource", "kind", "seq", "token", "layer", "expert", "start"]
    a = a.astype({"resource": str, "kind": str}).sort_values(key, kind="stable")
    b = b.astype({"resource": str, "kind": str}).sort_values(key, kind="stable")
    assert len(a) == len(b)
    cols = ["resource", "kind", "seq", "token", "layer", "expert", "bytes"]
    assert (a[cols].to_numpy() == b[cols].to_numpy()).all()
    np.testing.assert_allclose(a["start"].to_numpy(), b["start"].to_numpy(), rtol=0, atol=TOL)
    np.testing.assert_allclose(a["end"].to_numpy(), b["end"].to_numpy(), rtol=0, atol=TOL)
    ca, cb = dataclasses.asdict(sa.counters), dataclasses.asdict(sb.counters)
    for k, va in ca.items():
        np.testing.assert_allclose(np.asarray(va, float), np.asarray(cb[k], float), atol=TOL)
    assert sa.e2e == pytest.approx(sb.e2e, abs=TOL, rel=0)
    assert sa.busy == pytest.approx(sb.busy, abs=1e-6, rel=0)


def _both(
    policy: str,
    trace: str,
    ratio: float,
    hw: HardwareProfile,
    runtime: str | RuntimeProfile | None = None,
    **opts: Any,
) -> pd.DataFrame:
    model, seqs, dec, pre = _inputs(trace)
    budget = max(1, round(ratio * model.total_experts))
    make = functools.partial(get_policy_class(policy), **opts)
    eams = tuple(_EAMS[trace])
    ta, sa, _ = _run(Engine, make, model, hw, budget, seqs, (dec, pre), runtime, eams)
    tb, sb, _ = _run(ReferenceEngine, make, model, hw, budget, seqs, (dec, pre), runtime, eams)
    assert_same(ta, tb, sa, sb)
    return ta


#: a runtime whose host thread is the bottleneck: dispatch far slower than the GPU kernels
SLOW_HOST = with_costs(get_runtime("hf-eager"), name="slow-host", dispatch_us=60.0, sync_us=40.0)


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
    tl = _both(policy, trace, 0.25, load_profile("a6000-pcie4"), runtime)
    assert len(tl)


def test_a_slow_host_moves_the_timeline() -> None:
    # the override reaches the engines: the same run is slower when the host is the bottleneck
    model, seqs, dec, pre = _inputs("olmoe-1b-7b")
    hw = load_profile("a6000-pcie4")
    make = get_policy_class("all-gpu")
    _, fast, _ = _run(Engine, make, model, hw, model.total_experts, seqs, (dec, pre), "ideal")
    _, slow, _ = _run(Engine, make, model, hw, model.total_experts, seqs, (dec, pre), SLOW_HOST)
    assert slow.e2e > fast.e2e
    assert slow.counters.dispatch_stall > 0 and slow.counters.host_syncs > 0


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("policy", BUILTIN)
def test_fast_engine_matches_reference(policy: str, trace: str, ratio: float) -> None:
    _both(policy, trace, ratio, load_profile("a6000-pcie4"))


def one_copy_engine(name: str) -> HardwareProfile:
    """A bundled profile with both copy directions on one engine."""
    hw = load_profile(name)
    return dataclasses.replace(hw, link=dataclasses.replace(hw.link, copy_engines=1))


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
    tl = _both(policy, "ci-small", 0.25, one_copy_engine("a6000-pcie4"), None, **opts)
    assert "copy" in set(tl["resource"].astype(str))
    _both(policy, "ci-small", 0.125, load_profile("rtx4090-pcie4"), None, **opts)


@pytest.mark.parametrize(("low_t", "skip_t"), [(0.0, 1.0), (0.0, 0.0), (0.3, 0.5), (0.0, 0.4)])
def test_low_bit_copies_and_skips_on_the_one_pass_path(
    low_t: float, skip_t: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hobbit's low-bit temporary copies and skipped experts (Plan.low_bit, a substituted
    route) are timed and counted on the fast engine's one-pass paths as the reference engine
    times them (the low-bit copy's own time and bytes, the gate-mass accounting), with a
    cache of a fifth of the experts on the default machine and on one copy engine with a
    slow host; the fast engine must really take the one-pass path (only prefill layers go
    through the general path's _apply)."""
    general = [0]
    apply = Engine._apply

    def counted(self: Engine, *args: Any, **kwargs: Any) -> Any:
        general[0] += 1
        return apply(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "_apply", counted)
    opts = {"low_bit_threshold": low_t, "skip_threshold": skip_t}
    for hw, runtime in (
        (load_profile("a6000-pcie4"), None),
        (one_copy_engine("a6000-pcie4"), SLOW_HOST),
    ):
        tl = _both("hobbit", "ci-small", 0.2, hw, runtime, **opts)
        kind = tl["kind"].astype(str)
        decode = tl[(tl["resource"].astype(str) == "gpu") & (kind == "expert")]
        temps = tl[kind == "temp"]
        if skip_t > low_t:
            assert len(temps), "no low-bit copy was made"
    n_decode_layers = len(decode.groupby(["seq", "token", "layer"]))
    assert general[0] < n_decode_layers, "the one-pass path was not taken"


def test_in_use_victims_and_one_pass_layers() -> None:
    """One slot per layer and top-2 routing: a layer's second miss evicts the expert it has
    just run (write-back deferred until that computation ends), on the fast engine's one-pass
    path (Engine._copies_only) as on the reference engine."""
    for hw in (load_profile("a6000-pcie4"), one_copy_engine("a6000-pcie4")):
        tl = _both("mixtral-offloading", "ci-small", 0.375, hw, experts_per_layer=1)
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
        tl = _both("stream-all", "ci-small", 0.25, load_profile("rtx6000ada-pcie4"), runtime,
                   gather="leaf" if barrier else "layer")  # fmt: skip
        kind = tl["kind"].astype(str)
        copies = tl[kind.isin(["fetch", "prefetch"])]
        last = copies.groupby(["seq", "token", "layer"])["end"].max().rename("landed")
        gpu = tl[(tl["resource"].astype(str) == "gpu") & (kind == "expert")]
        joined = gpu.join(last, on=["seq", "token", "layer"], how="inner")
        assert len(joined) > 100
        early = joined["start"] < joined["landed"] - TOL
        assert not early.any() if barrier else early.any()


def wide_socket(name: str, factor: float = 1.7) -> HardwareProfile:
    """A bundled profile whose socket streams ``factor`` x what one CPU call takes (partial
    shares: concurrent calls overlap before they slow each other down)."""
    hw = load_profile(name)
    return dataclasses.replace(
        hw, cpu=dataclasses.replace(hw.cpu, socket_bw_gbs=hw.cpu.mem_bw_gbs * factor)
    )


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
    _both(policy, "ci-small", 0.25, wide_socket("a6000-pcie4"), None, **opts)
    # bf16 models do not fit the 64 GB device with its host copies: the same machine, roomier
    tl = _both(policy, "ci-small", 0.25, roomy("jetson-orin-64g"), None, **opts)
    assert len(tl)
    _both(
        policy, "phi-3.5-moe", 0.125, roomy(wide_socket("jetson-orin-64g", 1.3)), SLOW_HOST, **opts
    )


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
    """Random legal plans (every action, prefetch, eviction, pre-calculation) on both, on a
    bus-attached and a unified-memory host, with whole and partial socket shares."""
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    hw = load_profile(host) if socket is None else wide_socket(host, socket)
    # a slow CPU so that calls overlap each other, copies and GPU kernels
    hw = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, mem_bw_gbs=hw.cpu.mem_bw_gbs / 50))
    hw = dataclasses.replace(hw, link=dataclasses.replace(hw.link, copy_engines=copy_engines))
    budget = round(budget_frac * 18)
    out = []
    for cls in (Engine, ReferenceEngine):
        rng = np.random.default_rng(seed)
        workers, bufs = int(rng.integers(1, 3)), int(rng.integers(1, 3))
        seqs = [random_routing(model, s, 3, 5, rng) for s in range(2)]

        def make(rng: np.random.Generator = rng, w: int = workers, b: int = bufs) -> Policy:
            return ChaosPolicy(rng, w, b, writeback=writeback, staging_buffers=staging)

        out.append(_run(cls, make, model, hw, budget, seqs, runtime=runtime))
    (ta, sa, _), (tb, sb, _) = out
    assert_same(ta, tb, sa, sb)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("copy_engines", [1, 2])
@pytest.mark.parametrize("runtime", ["ideal", SLOW_HOST])
def test_one_stream_random_plans_time_identically(
    seed: int, copy_engines: int, runtime: str | RuntimeProfile
) -> None:
    """A one-stream spec (ResourceSpec.one_stream: copies and kernels in issue order) under
    random legal plans (fetches with victims, temporary copies into few buffers, prefetches,
    evictions, with and without write-back and staging slots): both engines give the same
    timeline, with kernels waiting for copies and copies for kernels."""
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    hw = load_profile("a6000-pcie4")
    hw = dataclasses.replace(hw, link=dataclasses.replace(hw.link, copy_engines=copy_engines))
    out = []
    for cls in (Engine, ReferenceEngine):
        rng = np.random.default_rng(seed)
        bufs = int(rng.integers(1, 3))
        seqs = [random_routing(model, s, 3, 5, rng) for s in range(2)]

        def make(rng: np.random.Generator = rng, b: int = bufs) -> Policy:
            return ChaosPolicy(
                rng, 1, b, writeback=bool(seed % 2), staging_buffers=seed % 3, one_stream=True
            )

        out.append(_run(cls, make, model, hw, 2 + 3 * seed, seqs, runtime=runtime))
    (ta, sa, _), (tb, sb, _) = out
    assert sa.counters.h2d_expert_copies > 0
    assert_same(ta, tb, sa, sb)


def _run_serving(
    cls: type[EngineBase],
    policy: str,
    hw: HardwareProfile,
    config: ServingConfig,
    arrivals: list[float],
    options: dict[str, Any] | None = None,
) -> tuple[pd.DataFrame, Any, EngineBase]:
    """Batched steps (ci-small's two cut sequences, each replayed twice) on one engine."""
    model, seqs, dec, pre = _inputs("ci-small")
    pol = get_policy_class(policy)(**(options or {}))
    budget = model.total_experts if pol.resources().unlimited_memory else model.total_experts // 4
    reqs = [
        Request(
            i,
            int(r.seq_id),
            t,
            r.n_prefill,
            r.n_decode,
            trim(dense(r, model.experts), r.n_prefill, r.n_decode, i),
        )
        for i, (r, t) in enumerate(zip(seqs * 2, arrivals, strict=True))
    ]
    oracle = None
    if pol.clairvoyant:
        oracle = step_oracle(
            reqs, config.batch, config.continuous, None, Oracle(model.moe_layers, model.experts)
        )
    rec = Recorder()
    rt = get_runtime(pol.runtime_profile)  # the host thread in batched steps too
    eng = cls(
        pol, model, cost_model(hw, model), budget, dec, pre, oracle, rec,
        runtime=rt, calibration_sequences=tuple(_EAMS["ci-small"]),
    )  # fmt: skip
    eng.serving = Serving(reqs, config, None)
    stats = eng.run(iter(()))
    return rec.timeline(), stats, eng


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
        ta, sa, ea = _run_serving(Engine, policy, hw, config, arrivals)
        tb, sb, _ = _run_serving(ReferenceEngine, policy, hw, config, arrivals)
        assert ea.serving.batch_steps > 0
        assert_same(ta, tb, sa, sb)


@pytest.mark.parametrize(
    "options", [{"ngl": 8}, {"ngl": 8, "prefill_offload": False}], ids=["offload", "on-cpu"]
)
def test_a_static_batch_prefill_with_cpu_layers_times_identically(options: dict[str, Any]) -> None:
    """A static batch's prompts in one prefill step, with CPU-resident layers (run on the CPU,
    or on the GPU after their weights are copied): both engines time it the same."""
    hw = load_profile("a6000-pcie4")
    config = ServingConfig(batch=3)
    ta, sa, ea = _run_serving(Engine, "llama-cpp-layers", hw, config, [0.0] * 4, options)
    tb, sb, _ = _run_serving(ReferenceEngine, "llama-cpp-layers", hw, config, [0.0] * 4, options)
    assert ea.n_cpu_layers > 0 and ea.serving.batched_prefills == 1
    assert_same(ta, tb, sa, sb)


@pytest.mark.parametrize("seed", range(6))
def test_random_plans_in_batched_steps_time_identically(seed: int) -> None:
    """The chaos policy's random legal plans over continuous batches with staggered arrivals
    (write-back on odd seeds; a unified-memory host on seeds >= 3)."""
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    hw = load_profile("jetson-orin-64g" if seed >= 3 else "a6000-pcie4")
    hw = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, mem_bw_gbs=hw.cpu.mem_bw_gbs / 50))
    out = []
    for cls in (Engine, ReferenceEngine):
        rng = np.random.default_rng(seed)
        seqs = [random_routing(model, s, 2, int(rng.integers(2, 6)), rng) for s in range(5)]
        times = sorted(float(x) for x in rng.uniform(0, 2e-3, size=5))
        reqs = [
            Request(s, s, t, r.n_prefill, r.n_decode, dense(r, model.experts))
            for s, (r, t) in enumerate(zip(seqs, times, strict=True))
        ]
        pol = ChaosPolicy(rng, 2, 2, writeback=bool(seed % 2), staging_buffers=seed % 2)
        rec = Recorder()
        runtime = SLOW_HOST if seed % 3 == 0 else None  # a dispatch-bound host on some seeds
        eng = cls(pol, model, cost_model(hw, model), 8, None, None, None, rec, runtime=runtime)
        pol.engine = eng
        eng.serving = Serving(reqs, ServingConfig(batch=3, continuous=True), None)
        out.append((rec, eng.run(iter(())), eng))
    (ra, sa, ea), (rb, sb, _) = out
    assert ea.serving.batch_steps > 0
    assert_same(ra.timeline(), rb.timeline(), sa, sb)


class LateReturn(Policy):
    """Layer 0 pre-calculates (1, 3) on the CPU; layer 1 fetches expert 1 while it runs.

    The pre-calculation's return copy is decided at layer 0 but submitted only when the CPU
    result exists; layer 1's fetch is decided later but submitted first, so it goes first.
    """

    name = "late-return"

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        return [(0, 0), (0, 1)]

    def decode_layer(self, view: View) -> Plan:
        layer = view.layer
        if layer == 0:
            return Plan(actions={0: Action.GPU, 1: Action.GPU}, precalc=[(1, 3)])
        return Plan(actions={1: Action.FETCH, 3: Action.PRECOMPUTED})


def test_a_later_decision_submitted_earlier_goes_first() -> None:
    model = tiny_model(experts=4, top_k=2, moe_layers=2)
    r = routing_from_experts(model, [[[0, 1], [1, 3]]], seq_id=0, n_prefill=0)
    hw = load_profile("a6000-pcie4")
    # a slow CPU: the pre-calculation outlasts layer 1's decision
    hw = dataclasses.replace(
        hw, cpu=dataclasses.replace(hw.cpu, mem_bw_gbs=hw.cpu.mem_bw_gbs / 1e4)
    )
    ta, sa, _ = _run(Engine, LateReturn, model, hw, 3, [r])
    tb, sb, _ = _run(ReferenceEngine, LateReturn, model, hw, 3, [r])
    assert_same(ta, tb, sa, sb)
    tl = ta.astype({"resource": str, "kind": str})
    fetch = tl[tl["kind"] == "fetch"].iloc[0]
    ret = tl[(tl["kind"] == "activation") & (tl["resource"] == "h2d")].iloc[0]
    cpu = tl[tl["kind"] == "precalc"].iloc[0]
    decision1 = tl[(tl["kind"] == "nonexpert") & (tl["layer"] == 1)].iloc[0]["end"]
    assert decision1 < cpu["end"]  # the fetch is submitted before the CPU result exists
    assert fetch["start"] == pytest.approx(decision1)  # ... and starts at once
    assert ret["start"] == pytest.approx(max(cpu["end"], fetch["end"]))  # the return queues


def test_simulate_and_cli_select_the_reference_engine(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from simulator.cli import main
    from simulator.testing import make_trace

    trace = make_trace(tmp_path / "t.parquet", sequences=3, prefill=3, decode=4, seed=2)
    a = simulate(policy="lru", trace=trace, gpu_experts=8, engine="fast")
    b = simulate(policy="lru", trace=trace, gpu_experts=8, engine="reference")
    assert b.config["engine"] == "reference"
    assert a.metrics == pytest.approx(b.metrics, rel=1e-12, nan_ok=True)
    args = ["run", "--policy", "lru", "--trace", str(trace), "--gpu-experts", "8"]
    res = CliRunner().invoke(main, [*args, "--engine", "reference", "--no-bounds", "--json"])
    assert res.exit_code == 0, res.output
    assert '"engine": "reference"' in res.output


@pytest.mark.parametrize("seed", range(4))
def test_chunked_prefill_and_preemption_time_identically(seed: int) -> None:
    """Mixed steps (prompt chunks beside decode tokens) and recompute preemption under a tight
    KV cache, with the chaos policy's random legal plans: both engines time them the same."""
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    hw = load_profile("jetson-orin-64g" if seed >= 2 else "a6000-pcie4")
    config = ServingConfig(batch=3, continuous=True, prefill_chunk=1 + seed % 3, preempt=True)
    out = []
    for cls in (Engine, ReferenceEngine):
        rng = np.random.default_rng(100 + seed)
        seqs = [random_routing(model, s, 4, int(rng.integers(2, 6)), rng) for s in range(5)]
        times = sorted(float(x) for x in rng.uniform(0, 2e-3, size=5))
        reqs = [
            Request(s, s, t, r.n_prefill, r.n_decode, dense(r, model.experts))
            for s, (r, t) in enumerate(zip(seqs, times, strict=True))
        ]
        kv = max(q.kv_tokens for q in reqs) + 2  # room for little more than one request
        pol = ChaosPolicy(rng, 2, 2, writeback=bool(seed % 2))
        rec = Recorder()
        eng = cls(pol, model, cost_model(hw, model), 8, None, None, None, rec)
        pol.engine = eng
        eng.serving = Serving(reqs, config, kv)
        out.append((rec, eng.run(iter(())), eng))
    (ra, sa, ea), (rb, sb, _) = out
    assert ea.serving.mixed_steps > 0 and ea.serving.sched.preemptions > 0
    assert_same(ra.timeline(), rb.timeline(), sa, sb)


@pytest.mark.parametrize(
    ("policy", "helper", "ratio", "opts"),
    [
        ("stream-all", "_whole_layer_copies", 0.25, {}),
        ("vllm-cpu-offload", "_whole_layer_copies", 0.25, {}),
        ("lru", "_plain_fetches", 0.25, {}),
        ("hobbit", "_plain_fetches", 0.25, {}),  # low-bit temporary copies beside fetches
        ("moe-infinity", "_plain_fetches", 0.25, {}),  # victims of other layers
        # write-backs (on a side stream: a recorded one-stream run takes the general path)
        ("mixtral-offloading", "_plain_fetches", 0.25, {"copy_stream": "side"}),
        ("static", "_victim_fetches", 0.125, {}),
        ("fiddler", "_gpu_cpu_layer", 0.25, {}),  # resident and CPU experts only
        ("ktransformers", "_gpu_cpu_layer", 0.25, {"gpu_experts_per_layer": 1}),
        ("llama-cpp-cpu-moe", "_gpu_cpu_layer", 0.25, {}),
        ("daop", "_precalc_layer", 0.25, {}),
        # one slot per layer for top-2: in-use victims, which _plain_fetches leaves alone
        (
            "mixtral-offloading",
            "_victim_fetches",
            0.25,
            {"experts_per_layer": 1, "copy_stream": "side"},
        ),
    ],
)
def test_bulk_one_pass_paths_are_taken_and_time_identically(
    policy: str, helper: str, ratio: float, opts: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast engine's narrower one-pass helpers (a whole layer streamed in; hits, fetches
    with victims, temporary copies and CPU experts; the commonest of those without CPU
    experts; resident experts beside CPU experts and pre-calculations, with a substituted
    route) are really taken by the policies they are for, with and without a costly host
    thread, and time exactly as the reference engine."""
    taken: list[float] = []
    orig = getattr(Engine, helper)

    def counting(self: Engine, *args: Any) -> float | None:
        end = orig(self, *args)
        if end is not None:
            taken.append(end)
        return end

    monkeypatch.setattr(Engine, helper, counting)
    for runtime in (None, SLOW_HOST):
        taken.clear()
        _both(policy, "ci-small", ratio, load_profile("a6000-pcie4"), runtime, **opts)
        assert taken, f"{policy} never took Engine.{helper}"


@pytest.mark.parametrize("policy", ["lru", "hobbit", "fiddler", "llama-cpp-cpu-moe"])
def test_plain_fetches_probe_limit_changes_no_result(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_copies_only`` stops offering plans to ``_plain_fetches`` in a run where its first
    probes were all refused; whether it is asked never (0 probes), briefly (3) or always, every
    metric is the same, so the limit only trades speed."""
    import simulator.engine as engine_module

    runs = []
    for probes in (0, 3, 10**9):
        monkeypatch.setattr(engine_module, "_PLAIN_PROBES", probes)
        r = simulate(policy=policy, trace="ci-small", hw="a6000-pcie4", cache_ratio=0.25)
        runs.append({k: repr(v) for k, v in r.metrics.items()})
    assert runs[0] == runs[1] == runs[2]


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
    """A plan with CPU experts and an in-use victim: its CPU calls are timed (the one-pass
    copy paths leave it to the general path) exactly as on the reference engine."""
    model = tiny_model(experts=6, top_k=3, moe_layers=2)
    tokens = [[[0, 1, 2]] * 2, [[1, 0, 2]] * 2] * 3
    seqs = [routing_from_experts(model, tokens)]
    hw = load_profile("a6000-pcie4")
    out = [_run(cls, InUseVictimBesideCpu, model, hw, 4, seqs) for cls in (Engine, ReferenceEngine)]
    (ta, sa, _), (tb, sb, _) = out
    assert_same(ta, tb, sa, sb)
    assert sa.counters.cpu_expert_evals == 12
    assert (ta["kind"].astype(str) == "writeback").sum() == 12


def _run_unrecorded(
    cls: type[EngineBase], make: Any, model: Any, hw: HardwareProfile, budget: int, seqs: list
) -> Any:
    """``_run`` without a recorder (the fast engine's recorder-less one-pass paths)."""
    pol = make()
    eng = cls(pol, model, cost_model(hw, model), budget, runtime=get_runtime(pol.runtime_profile))
    return eng.run(iter(seqs))


@pytest.mark.parametrize(
    ("policy", "opts", "trace"),
    [
        ("stream-all", {}, "olmoe-1b-7b"),
        ("stream-all", {}, "phi-3.5-moe"),
        ("vllm-cpu-offload", {}, "phi-3.5-moe"),
        ("llama-cpp-layers", {"ngl": 3}, "ci-small"),
        ("llama-cpp-layers", {"ngl": 0, "prefill_offload": False}, "olmoe-1b-7b"),
    ],
)
def test_recorderless_paths_match_recorded_and_reference(
    policy: str, opts: dict[str, Any], trace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a recorder the fast engine streams whole layers through
    Engine._whole_layer_repeat (flat views of the residency, checks by identity with what it
    checked before) and times CPU-resident layers' experts through Engine._cpu_layer_decode;
    its counters, token latencies and end are bit-identical to a recorded run (which checks
    each plan item by item) and agree with the reference engine. The repeat path must really
    be taken."""
    repeats = [0]
    repeat = Engine._whole_layer_repeat

    def counted(self: Engine, *args: Any) -> Any:
        repeats[0] += 1
        return repeat(self, *args)

    monkeypatch.setattr(Engine, "_whole_layer_repeat", counted)
    model, seqs, _, _ = _inputs(trace)
    budget = max(2 * model.experts, round(0.5 * model.total_experts))
    hw = load_profile("a6000-pcie4")
    make = functools.partial(get_policy_class(policy), **opts)
    quiet = _run_unrecorded(Engine, make, model, hw, budget, seqs)
    _, loud, _ = _run(Engine, make, model, hw, budget, seqs)
    _, ref, _ = _run(ReferenceEngine, make, model, hw, budget, seqs)
    cq, cl = dataclasses.asdict(quiet.counters), dataclasses.asdict(loud.counters)
    for k, v in cq.items():
        assert repr(np.asarray(v).tolist()) == repr(np.asarray(cl[k]).tolist()), k
    assert quiet.e2e == loud.e2e and quiet.busy == loud.busy
    cr = dataclasses.asdict(ref.counters)  # the reference engine: within TOL, as above
    for k, v in cq.items():
        np.testing.assert_allclose(np.asarray(v, float), np.asarray(cr[k], float), atol=TOL)
    assert quiet.e2e == pytest.approx(ref.e2e, abs=TOL, rel=0)
    if policy != "llama-cpp-layers":
        assert repeats[0] > 0


def _assert_quiet_matches(quiet: Any, loud: Any, ref: Any) -> None:
    """A run without a recorder has bit-identical counters, end and busy times to the
    recorded run, and agrees with the reference engine within TOL."""
    cq, cl = dataclasses.asdict(quiet.counters), dataclasses.asdict(loud.counters)
    for k, v in cq.items():
        assert repr(np.asarray(v).tolist()) == repr(np.asarray(cl[k]).tolist()), k
    assert quiet.e2e == loud.e2e and quiet.busy == loud.busy
    cr = dataclasses.asdict(ref.counters)
    for k, v in cq.items():
        np.testing.assert_allclose(np.asarray(v, float), np.asarray(cr[k], float), atol=TOL)
    assert quiet.e2e == pytest.approx(ref.e2e, abs=TOL, rel=0)


def _run_quiet_and_recorded(
    policy: str, trace: str, ratio: float, runtime: str | RuntimeProfile | None, **opts: Any
) -> tuple[Any, Any, Any]:
    """One policy's run on the fast engine without and with a recorder, and on the reference
    engine (calibration counts and, for a clairvoyant policy, the oracle as ``_run`` gives
    them)."""
    model, seqs, dec, pre = _inputs(trace)
    budget = max(1, round(ratio * model.total_experts))
    hw = load_profile("a6000-pcie4")
    make = functools.partial(get_policy_class(policy), **opts)
    pol = make()
    rt = get_runtime(pol.runtime_profile if runtime is None else runtime)
    oracle = None
    if pol.clairvoyant:
        oracle = Oracle(model.moe_layers, model.experts)
        for r in seqs:
            oracle.add(r)
    eng = Engine(pol, model, cost_model(hw, model), budget, dec, pre, oracle, runtime=rt,
                 calibration_sequences=tuple(_EAMS[trace]))  # fmt: skip
    quiet = eng.run(iter(seqs))
    _, loud, _ = _run(
        Engine, make, model, hw, budget, seqs, (dec, pre), runtime, tuple(_EAMS[trace])
    )
    _, ref, _ = _run(
        ReferenceEngine, make, model, hw, budget, seqs, (dec, pre), runtime, tuple(_EAMS[trace])
    )
    return quiet, loud, ref


@pytest.mark.parametrize(
    ("policy", "helper", "trace", "ratio", "opts"),
    [
        ("lfu", "_copy_layer_wb", "olmoe-1b-7b", 0.25, {}),
        ("global-lfu", "_copy_layer_wb", "ci-small", 0.25, {}),  # victims of other layers
        ("belady-global", "_copy_layer_wb", "phi-3.5-moe", 0.25, {}),
        ("static", "_copy_layer_wb", "ci-small", 0.25, {}),  # temporary copies
        ("lru", "_copy_layer_wb", "ci-small", 0.25, {"initial": "empty"}),  # fills, no victim
        ("ktransformers", "_gpu_cpu_layer", "phi-3.5-moe", 0.25, {"gpu_experts_per_layer": 1}),
        ("fiddler", "_gpu_cpu_layer", "ci-small", 0.25, {}),  # one after another
        ("llama-cpp-cpu-moe", "_gpu_cpu_layer", "olmoe-1b-7b", 0.25, {}),
    ],
)
@pytest.mark.parametrize("runtime", [None, "ideal", SLOW_HOST])
def test_narrow_recorderless_paths_match_recorded_and_reference(
    policy: str,
    helper: str,
    trace: str,
    ratio: float,
    opts: dict[str, Any],
    runtime: str | RuntimeProfile | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Engine._gpu_cpu_layer (resident and CPU experts) and Engine._copy_layer_wb (resident
    experts, fetches with or without victims, temporary copies; no recorder) are really
    taken, and a run without a recorder has bit-identical counters, token latencies, end and
    busy times to a recorded run (which takes the other one-pass paths) and agrees with the
    reference engine."""
    taken = [0]
    orig = getattr(Engine, helper)

    def counting(self: Engine, *args: Any) -> float | None:
        end = orig(self, *args)
        if end is not None:
            taken[0] += 1
        return end

    monkeypatch.setattr(Engine, helper, counting)
    quiet, loud, ref = _run_quiet_and_recorded(policy, trace, ratio, runtime, **opts)
    assert taken[0] > 0, f"{policy} never took Engine.{helper}"
    _assert_quiet_matches(quiet, loud, ref)


@pytest.mark.parametrize(
    ("policy", "trace", "ratio", "opts"),
    [
        # write-backs, held-back releases (on a side stream; one stream's layers:
        # test_one_stream_miss_layers_take_the_one_pass_paths)
        ("mixtral-offloading", "ci-small", 0.25, {"copy_stream": "side"}),
        (
            "mixtral-offloading",
            "phi-3.5-moe",
            0.25,
            {"experts_per_layer": 3, "copy_stream": "side"},
        ),
        ("hobbit", "ci-small", 0.25, {"low_bit_threshold": 0.2, "skip_threshold": 0.7}),
        ("hobbit", "olmoe-1b-7b", 0.25, {"low_bit_threshold": 0.3, "skip_threshold": 1.0}),
    ],
)
@pytest.mark.parametrize("runtime", [None, "ideal", SLOW_HOST])
def test_write_back_and_low_bit_layers_take_copy_layer_wb(
    policy: str,
    trace: str,
    ratio: float,
    opts: dict[str, Any],
    runtime: str | RuntimeProfile | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Engine._copy_layer_wb takes mixtral-offloading's miss layers (each victim written
    back) and hobbit's low-bit copies without a recorder, and those runs are bit-identical to
    recorded runs (which go through _plain_fetches' numpy-row code and _timed_gpu_one) and
    agree with the reference engine; the write-backs and low-bit copies really happen."""
    taken = {"wb": 0, "low": 0}
    orig = Engine._copy_layer_wb

    def counting(self: Engine, layer: int, routed: list[int], plan: Plan, now: float) -> Any:
        end = orig(self, layer, routed, plan, now)
        if end is not None:
            if plan.victims and self._wb:
                taken["wb"] += 1
            if plan.low_bit:
                taken["low"] += 1
        return end

    monkeypatch.setattr(Engine, "_copy_layer_wb", counting)
    quiet, loud, ref = _run_quiet_and_recorded(policy, trace, ratio, runtime, **opts)
    if policy == "mixtral-offloading":
        assert taken["wb"] > 0 and quiet.counters.d2h_expert_copies > 0
    else:
        assert taken["low"] > 0 and quiet.counters.low_bit_copies > 0
    _assert_quiet_matches(quiet, loud, ref)


@pytest.mark.parametrize(
    ("trace", "ratio", "opts", "kind"),
    [
        # victims written back, none in use: _plain_fetches' _copy_layer_wb
        ("ci-small", 0.25, {}, "plain"),
        ("olmoe-1b-7b", 0.125, {}, "plain"),  # top-8: eight copies before the first kernel
        # one slot per layer for top-2: in-use victims' write-backs (_victim_fetches)
        ("phi-3.5-moe", 0.25, {"experts_per_layer": 1}, "late"),
        # prefetches for the next layer on the same stream (_copies_only's general check)
        ("ci-small", 0.25, {"prefetch": True}, "prefetch"),
    ],
)
@pytest.mark.parametrize("runtime", [None, "ideal", SLOW_HOST])
def test_one_stream_miss_layers_take_the_one_pass_paths(
    trace: str,
    ratio: float,
    opts: dict[str, Any],
    kind: str,
    runtime: str | RuntimeProfile | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a recorder, mixtral-offloading's miss layers on one stream (its default,
    ResourceSpec.one_stream) go through the one-pass copy paths and Engine._one_stream_gpu
    (or its loop written out in _copy_layer_wb; a recorded run leaves them to _layer's
    general one-stream loop), and the runs are bit-identical to recorded runs and agree with
    the reference engine."""
    seen = {"plain": 0, "late": 0, "prefetch": 0}
    gpu, copies, cwb = Engine._one_stream_gpu, Engine._copies_only, Engine._copy_layer_wb

    def counting_gpu(self: Engine, jobs: Any, late: Any, now: float) -> float:
        seen["late" if late else "plain"] += 1
        return gpu(self, jobs, late, now)

    def counting_cwb(self: Engine, layer: int, routed: Any, plan: Plan, now: float) -> Any:
        end = cwb(self, layer, routed, plan, now)
        if end is not None and self._one_stream and plan.victims:
            seen["plain"] += 1  # written back and timed on the one stream in one pass
        return end

    def counting_copies(self: Engine, layer: int, routed: Any, plan: Plan, now: float) -> Any:
        end = copies(self, layer, routed, plan, now)
        if end is not None and plan.prefetch:
            seen["prefetch"] += 1
        return end

    monkeypatch.setattr(Engine, "_one_stream_gpu", counting_gpu)
    monkeypatch.setattr(Engine, "_copies_only", counting_copies)
    monkeypatch.setattr(Engine, "_copy_layer_wb", counting_cwb)
    quiet, loud, ref = _run_quiet_and_recorded("mixtral-offloading", trace, ratio, runtime, **opts)
    assert seen[kind] > 0, f"no one-stream {kind} layer took the one-pass paths"
    assert quiet.counters.d2h_expert_copies > 0 and quiet.counters.transfer_stall > 0
    _assert_quiet_matches(quiet, loud, ref)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("copy_engines", [1, 2])
def test_one_stream_random_plans_without_a_recorder(
    seed: int, copy_engines: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random legal one-stream plans (fetches with victims, evictions, temporary copies into
    few buffers, prefetches, with and without write-back and staging slots) on the fast
    engine without a recorder, where Engine._one_stream_gpu times the layers the one-pass
    paths take, give bit-identical counters, end and busy times to the recorded run (the
    general path throughout) and agree with the reference engine."""
    taken = [0]
    gpu = Engine._one_stream_gpu

    def counting(self: Engine, jobs: Any, late: Any, now: float) -> float:
        taken[0] += 1
        return gpu(self, jobs, late, now)

    monkeypatch.setattr(Engine, "_one_stream_gpu", counting)
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    hw = load_profile("a6000-pcie4")
    hw = dataclasses.replace(hw, link=dataclasses.replace(hw.link, copy_engines=copy_engines))
    budget = 2 + 3 * (seed % 4)
    out = []
    for recorded, cls in ((False, Engine), (True, Engine), (True, ReferenceEngine)):
        rng = np.random.default_rng(seed)
        bufs = int(rng.integers(1, 3))
        seqs = [random_routing(model, s, 3, 6, rng) for s in range(2)]
        pol = ChaosPolicy(
            rng, 1, bufs, writeback=bool(seed % 2), staging_buffers=seed % 3, one_stream=True
        )
        eng = cls(pol, model, cost_model(hw, model), budget, None, None, None,
                  Recorder() if recorded else None, runtime=get_runtime(SLOW_HOST))  # fmt: skip
        pol.engine = eng
        out.append(eng.run(iter(seqs)))
    quiet, loud, ref = out
    assert taken[0] > 0, "no layer took Engine._one_stream_gpu"
    assert quiet.counters.h2d_expert_copies > 0
    _assert_quiet_matches(quiet, loud, ref)


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


def test_a_reused_plan_changed_in_place_is_refused_as_on_the_general_path() -> None:
    """The repeat path proves a reused plan's items by identity, not equality: an evict entry
    replaced in place by an equal pair of other types is refused with the general check's
    message, with or without a recorder and on the reference engine (every token routes
    alike, so the plans are reused)."""
    model = tiny_model(experts=4, top_k=2, moe_layers=4)
    seqs = [routing_from_experts(model, [[[0, 1]] * 4] * 12)]
    hw = load_profile("a6000-pcie4")
    msgs = []
    for run in (
        lambda: _run_unrecorded(Engine, MutatingStreamAll, model, hw, 8, seqs),
        lambda: _run(Engine, MutatingStreamAll, model, hw, 8, seqs),
        lambda: _run(ReferenceEngine, MutatingStreamAll, model, hw, 8, seqs),
    ):
        MutatingStreamAll.calls = 0
        with pytest.raises(PolicyError) as err:
            run()
        msgs.append(str(err.value))
    assert "malformed plan" in msgs[0]
    assert msgs[0] == msgs[1] == msgs[2]
