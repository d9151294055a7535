"""Runtime profiles: the host thread's arithmetic, both engines, the CLI and the bundled data.

Layer times are checked against the rule of docs/cost-model.md ("Runtime profiles") written
out by hand for a two-layer model whose experts are all resident: a dispatch-bound layer, a
GPU-bound layer, routing and expert syncs, and a profile with no costs, which must reproduce
the timeline of a machine without a host thread.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from daopsim.policies.all_gpu import AllGPUPolicy
from daopsim.policies.registry import get_policy_class
from daopsim.simulator.cli import main
from daopsim.simulator.core.loop import Engine
from daopsim.simulator.core.resources import HostThread
from daopsim.simulator.costs import cost_model
from daopsim.simulator.errors import UserError
from daopsim.simulator.grid import Grid
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.recorder import Recorder
from daopsim.simulator.reference import ReferenceEngine
from daopsim.simulator.runtime_profiles import (
    FIELDS,
    RuntimeProfile,
    get_runtime,
    parse_runtime,
    runtime_names,
    runtimes_dir,
)
from daopsim.simulator.sweep_expand import expand
from daopsim.simulator.testing import routing_from_experts, tiny_model

US = 1e-6


def test_segment_is_gpu_bound_first_kernel_bound_or_dispatch_bound() -> None:
    host = HostThread(RuntimeProfile("t", dispatch_us=10.0, nonexpert_kernels=4))
    # GPU-bound: 4 kernels of 100 us each issued every 10 us keep the stream busy
    end, decision = host.nonexpert(0.0, 400 * US, first_layer=False)
    assert end == pytest.approx(10 * US + 400 * US)  # waits only for the first kernel
    assert decision == end and host.t == pytest.approx(40 * US)
    # dispatch-bound: 4 kernels of 1 us each; the last one is issued at h + 40 us
    host.t = 0.0
    end, _ = host.nonexpert(0.0, 4 * US, first_layer=False)
    assert end == pytest.approx(40 * US + 1 * US)
    # a stream busy with earlier work until 1 ms: the GPU side decides
    host.t = 0.0
    end, _ = host.nonexpert(1e-3, 4 * US, first_layer=False)
    assert end == pytest.approx(1e-3 + 4 * US)


def test_syncs_wait_for_the_gpu_then_pay_their_cost() -> None:
    prof = RuntimeProfile("t", dispatch_us=1.0, sync_us=5.0, nonexpert_kernels=2, routing_syncs=1)
    host = HostThread(prof)
    end, decision = host.nonexpert(0.0, 100 * US, first_layer=False)
    assert end == pytest.approx(101 * US)  # first kernel issued at 1 us, then 100 us of GPU
    assert decision == pytest.approx(101 * US + 5 * US)  # the host waited for the router
    assert host.t == decision and host.syncs == 1
    # an expert sync: the host waits for the stream's earlier work (drained at 300 us)
    host = HostThread(RuntimeProfile("t", dispatch_us=2.0, sync_us=5.0, expert_kernels=3,
                                     expert_syncs=2))  # fmt: skip
    end = host.expert(300 * US, 300 * US, 30 * US)
    # issued from 310 us (two syncs): first kernel at 312 us, then 30 us of GPU
    assert end == pytest.approx(312 * US + 30 * US)
    assert host.t == pytest.approx(316 * US) and host.syncs == 2


def test_a_forward_pass_waits_for_the_previous_one_then_pays_sync_and_step() -> None:
    prof = RuntimeProfile("t", dispatch_us=1.0, sync_us=3.0, step_us=15.0, nonexpert_kernels=1)
    host = HostThread(prof)
    host.t = 5 * US  # the host ran ahead; the previous token ends on the GPU at 100 us
    end, _ = host.nonexpert(100 * US, 1 * US, first_layer=True)
    assert end == pytest.approx(100 * US + 3 * US + 15 * US + 1 * US + 1 * US)
    assert host.syncs == 1
    end2, _ = host.nonexpert(end, 1 * US, first_layer=False)
    assert end2 == pytest.approx(end + 1 * US)  # host at 119 us, stream free at 120 us
    assert host.syncs == 1


# -- both engines, hand-computed -------------------------------------------------------------
MODEL = tiny_model(experts=4, top_k=2, moe_layers=2)
HW = load_profile("a6000-pcie4")


def _gpu_s(eng: Any) -> Any:
    """An engine's bound GPU expert time per token count (the fast engine's machine holds it)."""
    return eng.machine.gpu_s if isinstance(eng, Engine) else eng.gpu_s


def _nonexpert_s(eng: Any) -> Any:
    """An engine's bound non-expert time per (tokens, context)."""
    return eng.machine.nonexpert_s if isinstance(eng, Engine) else eng.nonexpert_s


def _host_thread(eng: Any) -> Any:
    """The engine's model of the runtime's host thread (None: the runtime costs nothing)."""
    return eng.machine.host if isinstance(eng, Engine) else eng.thread


def _engine(cls: type[Any], runtime: RuntimeProfile | None) -> tuple[Any, object]:
    r = routing_from_experts(MODEL, [[[0, 1], [2, 3]]], seq_id=0, n_prefill=0)
    rec = Recorder()
    eng = cls(AllGPUPolicy(), MODEL, cost_model(HW, MODEL), MODEL.total_experts, recorder=rec,
              runtime=runtime)  # fmt: skip
    stats = eng.run(iter([r]))
    return eng, (stats, rec.timeline(), int(r.positions[0]))


def _by_hand(prof: RuntimeProfile, d_ne: float, d_e: float) -> float:
    """Two layers, two resident experts each, one decode token, written out step by step."""
    disp, sync = prof.dispatch_us * US, prof.sync_us * US
    k_ne, k_e = prof.nonexpert_kernels, prof.expert_kernels
    g = h = 0.0
    for layer in range(2):
        if layer == 0:  # the pass waits for the previous token, then syncs and steps
            h = max(h, g) + sync + prof.step_us * US
        ne_end = max(g + d_ne, h + disp + d_ne, h + k_ne * disp + d_ne / k_ne)
        h += k_ne * disp
        g = ne_end
        if prof.routing_syncs:
            h = max(h, ne_end) + prof.routing_syncs * sync
            g = h  # the experts are issued once the routing is on the host
        if prof.idle_expert_kernels or prof.idle_expert_syncs:
            # the loop over the E - k experts with no token: ops and syncs, no GPU work
            ready = g
            if prof.idle_expert_syncs:
                h = max(h, ready)
            idle = MODEL.experts - MODEL.top_k
            h += idle * (prof.idle_expert_kernels * disp + prof.idle_expert_syncs * sync)
            g = max(h, ready)
        for _ in range(2):
            if prof.expert_syncs:
                h = max(h, g) + prof.expert_syncs * sync
            g = max(g + d_e, h + disp + d_e, h + k_e * disp + d_e / k_e)
            h += k_e * disp
    return g


DISPATCH_BOUND = RuntimeProfile(
    "dispatch-bound", dispatch_us=50.0, sync_us=20.0, nonexpert_kernels=40, expert_kernels=10,
    routing_syncs=1, expert_syncs=2,
)  # fmt: skip
GPU_BOUND = RuntimeProfile("gpu-bound", dispatch_us=0.01, nonexpert_kernels=2, expert_kernels=1)
#: a MoE loop over every expert, once with routing syncs and once without (hf-eager-all-experts)
IDLE_LOOP = RuntimeProfile(
    "idle-loop", dispatch_us=7.0, sync_us=11.0, nonexpert_kernels=5, expert_kernels=3,
    routing_syncs=1, expert_syncs=1, idle_expert_kernels=13, idle_expert_syncs=2,
)  # fmt: skip


@pytest.mark.parametrize("cls", [Engine, ReferenceEngine])
@pytest.mark.parametrize(
    "prof",
    [DISPATCH_BOUND, GPU_BOUND, IDLE_LOOP, get_runtime("hf-eager"),
     get_runtime("hf-eager-all-experts"), get_runtime("moe-infinity"),
     get_runtime("moe-infinity-2024")],
)  # fmt: skip
def test_layer_times_match_the_hand_computation(cls: type[Any], prof: RuntimeProfile) -> None:
    eng, (stats, _, ctx) = _engine(cls, prof)
    d_ne = _nonexpert_s(eng)(1, ctx)
    d_e = _gpu_s(eng)(1)
    assert stats.e2e == pytest.approx(_by_hand(prof, d_ne, d_e), rel=1e-12)
    idle = (MODEL.experts - MODEL.top_k) * prof.idle_expert_syncs
    syncs = 1 + 2 * (prof.routing_syncs + idle + 2 * prof.expert_syncs)
    assert stats.counters.host_syncs == syncs


def test_the_loop_over_idle_experts_costs_the_host_their_ops_and_syncs() -> None:
    """Each expert with no token adds its ops and syncs to the layer; no idle cost, no change."""
    no_idle = RuntimeProfile("n", dispatch_us=4.0, sync_us=3.0, nonexpert_kernels=2)
    idle = RuntimeProfile("i", dispatch_us=4.0, sync_us=3.0, nonexpert_kernels=2,
                          idle_expert_kernels=11, idle_expert_syncs=1)  # fmt: skip
    h0, h1 = HostThread(no_idle, idle_experts=120), HostThread(idle, idle_experts=120)
    end0, dec0 = h0.nonexpert(0.0, 50 * US, first_layer=False)
    end1, dec1 = h1.nonexpert(0.0, 50 * US, first_layer=False)
    assert end1 == end0 and dec0 == end0  # the non-expert part itself is unchanged
    # the first idle sync waits for the router's GPU work, then 120 x (11 ops + 1 sync)
    assert dec1 == pytest.approx(end0 + 120 * (11 * 4.0 + 3.0) * US)
    assert h1.syncs == 120 and h0.syncs == 0
    # no expert left idle (E = k): nothing to pay even with the fields set
    h2 = HostThread(idle, idle_experts=0)
    assert h2.nonexpert(0.0, 50 * US, first_layer=False) == (end0, dec0)


def test_hf_eager_all_experts_is_slower_than_hf_eager_on_many_experts() -> None:
    """Mixtral (ci-small: 8 experts, top-2) all on the GPU: the loop over the 6 idle experts
    per layer costs more than hf-eager's hit-only loop saves in routing syncs."""
    from daopsim.simulator.runner import simulate

    kw = {"policy": "all-gpu", "hw": "h20-pcie5", "trace": "ci-small", "sequences": 1}
    hit = simulate(**kw, runtime="hf-eager").metrics["tpot_mean_s"]
    loop = simulate(**kw, runtime="hf-eager-all-experts").metrics["tpot_mean_s"]
    assert loop > hit


def test_moe_infinity_costs_the_host_more_per_expert_call_than_hf_eager() -> None:
    """MoE-Infinity's block runs the router like HF's and then, per routed expert, a masked
    gather in the dispatcher, the expert's forward with a stream sync, and three masked reads
    and writes: more ops and syncs per expert call than HF's loop, so an all-GPU run of OLMoE
    (eight expert calls per layer) is slower with it."""
    from daopsim.simulator.runner import simulate

    mi, hf = get_runtime("moe-infinity"), get_runtime("hf-eager")
    assert mi.expert_syncs > hf.expert_syncs and mi.expert_kernels > hf.expert_kernels
    assert (mi.dispatch_us, mi.sync_us) == (hf.dispatch_us, hf.sync_us)  # same framework
    kw = {"policy": "all-gpu", "hw": "a6000-pcie4", "trace": "olmoe-1b-7b", "sequences": 1}
    tpot = {
        r: simulate(**kw, runtime=r).metrics["tpot_mean_s"] for r in ("hf-eager", "moe-infinity")
    }
    assert tpot["moe-infinity"] > tpot["hf-eager"]


def test_moe_infinity_2024_pays_for_every_expert_of_the_layer() -> None:
    """The 2024 release loops in Python over every expert (two syncs even without a token) and
    runs the EAM predictor each layer; the 2025 release hands only the routed experts to its C++
    dispatcher. All on the GPU, the 2024 runtime is slower, and more so with more idle experts
    per layer: OLMoE (64 experts, top-8: 56 idle) against Mixtral-shaped ci-small (8, top-2)."""
    from daopsim.simulator.runner import simulate

    old, new = get_runtime("moe-infinity-2024"), get_runtime("moe-infinity")
    assert old.idle_expert_syncs > 0 and new.idle_expert_syncs == 0
    assert old.routing_syncs > new.routing_syncs
    assert (old.dispatch_us, old.sync_us) == (new.dispatch_us, new.sync_us)  # same framework
    excess = {}
    for trace in ("ci-small", "olmoe-1b-7b"):
        kw = {"policy": "all-gpu", "hw": "a6000-pcie4", "trace": trace, "sequences": 1}
        t = {r: simulate(**kw, runtime=r).metrics["tpot_mean_s"] for r in (old.name, new.name)}
        assert t[old.name] > t[new.name]
        excess[trace] = t[old.name] / t[new.name]
    assert excess["olmoe-1b-7b"] > excess["ci-small"]


def test_dispatch_bound_is_slower_and_gpu_bound_is_not() -> None:
    _, (ideal, _, _) = _engine(Engine, None)
    _, (slow, _, _) = _engine(Engine, DISPATCH_BOUND)
    _, (fast, _, _) = _engine(Engine, GPU_BOUND)
    assert slow.e2e > ideal.e2e + 2 * 40 * 50 * US  # at least the non-expert dispatch
    assert slow.counters.dispatch_stall > 0
    assert fast.e2e == pytest.approx(ideal.e2e + 0.01 * US, rel=0, abs=1e-12)


@pytest.mark.parametrize("cls", [Engine, ReferenceEngine])
def test_a_profile_with_no_costs_reproduces_the_timeline(cls: type[Any]) -> None:
    _, (base, tl0, _) = _engine(cls, None)
    free = RuntimeProfile("free", nonexpert_kernels=49, expert_kernels=11, routing_syncs=1)
    for prof in (get_runtime("ideal"), free):
        eng, (stats, tl, _) = _engine(cls, prof)
        assert _host_thread(eng) is None  # nothing to pay: no host thread at all
        assert stats.e2e == base.e2e
        assert tl.equals(tl0)


# -- simulate, run --json and --runtime ------------------------------------------------------
def _run_json(*args: str) -> tuple[int, dict]:
    res = CliRunner().invoke(
        main, ["run", "--trace", "ci-small", "--sequences", "1", "--cache-ratio", "0.25",
               "--no-bounds", "--json", *args],
    )  # fmt: skip
    return res.exit_code, json.loads(res.output)


def test_run_json_reports_the_declared_runtime_and_the_override() -> None:
    code, doc = _run_json("--policy", "fiddler")
    assert code == 0
    assert doc["runtime"]["name"] == "hf-eager"
    assert doc["runtime"]["dispatch_us"] == get_runtime("hf-eager").dispatch_us
    assert doc["runtime"]["sources"]["dispatch_us"]
    assert doc["metrics"]["host_syncs"] > 0
    code, over = _run_json("--policy", "fiddler", "--runtime", "ideal")
    assert code == 0 and over["runtime"]["name"] == "ideal"
    assert over["metrics"]["host_syncs"] == 0 and over["metrics"]["dispatch_stall_s"] == 0
    assert over["metrics"]["e2e_s"] < doc["metrics"]["e2e_s"]


def test_an_unknown_runtime_is_one_line_and_exit_2() -> None:
    args = ["run", "--policy", "lru", "--trace", "ci-small", "--runtime", "pytorch-nightly"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines == [
        "error: unknown runtime 'pytorch-nightly' (known: " + ", ".join(runtime_names()) + ")"
    ]


def test_runtimes_list_and_show() -> None:
    res = CliRunner().invoke(main, ["runtimes", "list", "--json"])
    assert res.exit_code == 0
    rows = {r["name"]: r for r in json.loads(res.output)}
    assert {"ideal", "hf-eager", "cuda-graph", "llama.cpp", "ktransformers"} <= set(rows)
    assert "daop" in rows["hf-eager"]["policies"]
    res = CliRunner().invoke(main, ["runtimes", "show", "llama.cpp"])
    assert res.exit_code == 0 and "source:" in res.output and "llama-cpp-cpu-moe" in res.output
    res = CliRunner().invoke(main, ["runtimes", "show", "nope"])
    assert res.exit_code == 2


def test_policies_declare_the_runtime_of_the_system_they_model() -> None:
    declared = {
        "daop": "hf-eager",
        "fiddler": "hf-eager",
        "mixtral-offloading": "hf-eager-attn",
        "stream-all": "hf-eager",
        "accelerate": "hf-eager",
        "vllm-cpu-offload": "cuda-graph",
        "llama-cpp-cpu-moe": "llama.cpp",
        "ktransformers": "ktransformers",
        "hobbit": "llama.cpp",
        "moe-infinity": "moe-infinity",
        "lru": "ideal",
        "belady": "ideal",
        "all-gpu": "ideal",
    }
    for policy, runtime in declared.items():
        assert get_policy_class(policy).runtime_profile == runtime
        get_runtime(runtime)


def test_sweep_runtime_axis_multiplies_the_configurations() -> None:
    one = expand(Grid(policies=["lru"], traces=["ci-small"], cache_ratios=[0.25]))
    two = expand(
        Grid(policies=["lru"], traces=["ci-small"], cache_ratios=[0.25],
             runtimes=["ideal", "hf-eager"])
    )  # fmt: skip
    assert len(one) == 1 and [c.runtime for c in two] == ["ideal", "hf-eager"]
    assert len({c.key for c in two}) == 2
    with pytest.raises(UserError, match="unknown runtime"):
        expand(Grid(policies=["lru"], traces=["ci-small"], runtimes=["nope"]))


# -- the bundled data ------------------------------------------------------------------------
@pytest.mark.parametrize("name", runtime_names())
def test_every_cost_in_a_bundled_profile_names_its_source(name: str) -> None:
    prof = get_runtime(name)
    for field, _, _ in FIELDS:
        if getattr(prof, field):
            assert prof.sources.get(field), f"{name}: {field} has no source"


def test_bad_profile_fields_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="field 'dispatch_us' must be a finite number >= 0"):
        parse_runtime({"name": "x", "dispatch_us": -1}, "x.toml")
    with pytest.raises(UserError, match="unknown field 'dispatch'"):
        parse_runtime({"name": "x", "dispatch": 1}, "x.toml")
    with pytest.raises(UserError, match="'expert_kernels' must be a int"):
        parse_runtime({"name": "x", "expert_kernels": 1.5}, "x.toml")
    with open(runtimes_dir() / "hf-eager.toml", "rb") as f:
        assert parse_runtime(tomllib.load(f), "hf-eager.toml") == get_runtime("hf-eager")


# -- fused MoE (docs/cost-model.md, "Fused MoE") ---------------------------------------------
@pytest.mark.parametrize("cls", [Engine, ReferenceEngine])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_fused_runtime_charges_one_launch_set_per_layer_an_eager_one_per_expert(
    cls: type[Any], k: int
) -> None:
    # k resident experts per layer, one decode token, no host costs: the GPU stream alone
    model = tiny_model(experts=4, top_k=k, moe_layers=2)
    costs = cost_model(HW, model)
    launch = HW.gpu.launch_overhead_us * US
    k_e = 2 * model.expert_matrices - 1  # the eager forward: one GEMM per matrix + element-wise
    moved = model.expert_bytes() + 2 * model.hidden * 2  # weights, activation in and out
    roof = max(
        moved / (HW.gpu.mem_bw_gbs * 1e9),
        2.0 * model.params_per_expert / (HW.gpu.bf16_tflops * 1e12),
    )

    def run(fused: bool) -> tuple[Any, float]:
        r = routing_from_experts(model, [[list(range(k)), list(range(k))]], seq_id=0, n_prefill=0)
        prof = RuntimeProfile("fused" if fused else "eager", fused_moe=fused)
        eng = cls(AllGPUPolicy(), model, costs, model.total_experts, runtime=prof)
        return eng, eng.run(iter([r])).e2e

    eager, t_eager = run(False)
    fused, t_fused = run(True)
    assert _gpu_s(eager)(1) == pytest.approx(roof + k_e * launch, rel=1e-12)
    assert _gpu_s(fused)(1) == pytest.approx(roof, rel=1e-12)  # weights still streamed
    ctx = 0
    ne = costs.nonexpert_layer_s(1, ctx)
    # the fused call is charged with the layer's first GPU expert, not its non-expert part
    assert _nonexpert_s(fused)(1, ctx) == pytest.approx(ne, rel=1e-12)
    # per layer: the eager runtime launches k x k_e kernels, the fused one 5 whatever k is
    assert t_eager - t_fused == pytest.approx(2 * (k * k_e - 5) * launch, rel=1e-9)
    assert t_fused == pytest.approx(2 * (ne + 5 * launch + k * roof), rel=1e-9)


@pytest.mark.parametrize("cls", [Engine, ReferenceEngine])
@pytest.mark.parametrize("k", [1, 2])
def test_a_layer_without_a_gpu_expert_launches_no_fused_call(cls: type[Any], k: int) -> None:
    # llama-cpp-cpu-moe: layer 0's experts run on the CPU, layer 1's on the GPU (decode)
    model = tiny_model(experts=4, top_k=k, moe_layers=2)
    costs = cost_model(HW, model)
    launch = HW.gpu.launch_overhead_us * US
    k_e = 2 * model.expert_matrices - 1
    policy = get_policy_class("llama-cpp-cpu-moe")

    def e2e(fused: bool, n_cpu_moe: int) -> float:
        r = routing_from_experts(model, [[list(range(k)), list(range(k))]], seq_id=0, n_prefill=0)
        prof = RuntimeProfile("fused" if fused else "eager", fused_moe=fused)
        eng = cls(policy(n_cpu_moe=n_cpu_moe), model, costs, model.total_experts, runtime=prof)
        return eng.run(iter([r])).e2e

    # one GPU layer: it alone swaps k x k_e expert launches for the fused call's 5
    assert e2e(False, 1) - e2e(True, 1) == pytest.approx((k * k_e - 5) * launch, rel=1e-9)
    # no GPU layer: nothing is fused, nothing is launched for the experts on the GPU
    assert e2e(True, 2) == pytest.approx(e2e(False, 2), rel=1e-12)


def test_only_the_cuda_graph_and_llama_cpp_profiles_are_fused_and_say_why() -> None:
    fused = {n for n in runtime_names() if get_runtime(n).fused_moe}
    ggml = {"llama.cpp", "llama.cpp-eager", "ik_llama.cpp", "ik_llama.cpp-rtr"}
    assert fused == {"cuda-graph"} | ggml
    assert "fused_moe.py" in get_runtime("cuda-graph").sources["fused_moe"]
    assert "ggml_cuda_mul_mat_id" in get_runtime("llama.cpp").sources["fused_moe"]
    assert get_runtime("cuda-graph").to_dict()["fused_moe"] is True


def test_fused_moe_must_be_a_boolean() -> None:
    with pytest.raises(UserError, match="'fused_moe' must be true or false"):
        parse_runtime({"name": "x", "fused_moe": 1}, "x.toml")
    assert parse_runtime({"name": "x", "fused_moe": True}, "x.toml").fused_moe
