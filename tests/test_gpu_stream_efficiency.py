"""A runtime's GPU stream efficiency (docs/cost-model.md, "GPU stream efficiency").

``gpu_stream_efficiency`` scales the bandwidth of the memory-bound term of GPU work (expert
weights, the non-expert part's weights and KV cache); compute roofs, launches and copies keep
their cost. The default 1.0 must leave every cost as it was, a value outside (0, 1] is refused
with one line, and the fast and reference engines must agree on a run that uses it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from daopsim.simulator.costs import cost_model
from daopsim.simulator.errors import ProfileError, UserError
from daopsim.simulator.hardware import list_profiles, load_profile
from daopsim.simulator.run_costs import runtime_cost_model
from daopsim.simulator.runner import simulate
from daopsim.simulator.runtime_profiles import get_runtime, parse_runtime, runtime_names, with_costs

TRACE = "ci-small"


def _costs(c, n: int, ctx: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Every GPU cost the efficiency could touch, at ``n`` tokens over ``ctx`` of context."""
    return [
        c.gpu_expert_s(n),
        c.fused_gpu_expert_s(n),
        c.nonexpert_layer_s(n, ctx),
        c.nonexpert_batch_layer_s(n, n * (ctx + 1)),
        c.nonexpert_mixed_layer_s(n, ctx, 3, 3 * ctx),
        c.nonexpert_prefill_batch_layer_s(2, n),
        c.h2d_expert_s(True),
        c.d2h_expert_s(True),
        c.activation_copy_s(n),
    ]


def test_only_graph_replaying_runtimes_set_an_efficiency() -> None:
    """Every bundled runtime but llama.cpp and cuda-graph (vLLM/SGLang) keeps 1.0: the two
    efficiencies were derived with graph-node launch costs, and they are the runtimes whose
    one-token steps replay CUDA graphs (docs/cost-model.md, "GPU stream efficiency").
    llama.cpp-eager runs llama.cpp's kernels without graphs: it keeps their efficiency; the
    ik_llama.cpp profiles are llama.cpp's GPU side with the fork's CPU matrix products."""
    for name in runtime_names():
        rt = get_runtime(name)
        assert 0.0 < rt.gpu_stream_efficiency <= 1.0
        if name == "llama.cpp-eager":
            eager, graphed = rt, get_runtime("llama.cpp")
            assert eager.gpu_stream_efficiency == graphed.gpu_stream_efficiency
            assert eager.graph_kernel_us == 0 and not eager.replays_graphs
        elif name not in ("llama.cpp", "ik_llama.cpp", "ik_llama.cpp-rtr", "cuda-graph"):
            assert rt.gpu_stream_efficiency == 1.0, name
        else:
            assert rt.gpu_stream_efficiency < 1.0 and rt.graph_kernel_us > 0, name


@pytest.mark.parametrize("model", ["mixtral-8x7b", "deepseek-v2-lite"])
def test_default_efficiency_changes_no_cost(model: str) -> None:
    """An explicit 1.0 gives the cost model built without the argument, on every profile and
    for bf16 and GGUF experts (the GGUF format rule still applies on its own)."""
    for hw in list_profiles():
        for dtype in ("bf16", "q4_0"):
            base = cost_model(hw, model)
            shape = base.model.with_dtype(dtype)
            a = cost_model(hw, shape)
            b = cost_model(hw, shape, gpu_stream_efficiency=1.0)
            for n, ctx in ((1, 0), (1, 700), (8, 64), (512, 0)):
                assert _costs(a, n, ctx) == _costs(b, n, ctx), (hw, dtype, n, ctx)


def test_half_efficiency_doubles_a_memory_bound_expert() -> None:
    """At 0.5 a one-token bf16 expert's roof (memory-bound) doubles; its launches do not."""
    base = cost_model("a6000-pcie4", "mixtral-8x7b")
    half = cost_model("a6000-pcie4", "mixtral-8x7b", gpu_stream_efficiency=0.5)
    gpu = base.hw.gpu
    # the one-token call is memory-bound (else the test would prove nothing)
    assert base.expert_bytes / (gpu.mem_bw_gbs * 1e9) > base.expert_flops(1) / (
        gpu.bf16_tflops * 1e12
    )
    assert half.fused_gpu_expert_s(1) == pytest.approx(2 * base.fused_gpu_expert_s(1), rel=1e-12)
    launches = base.gpu_expert_s(1) - base.fused_gpu_expert_s(1)
    assert half.gpu_expert_s(1) - half.fused_gpu_expert_s(1) == pytest.approx(launches)
    # the non-expert part's memory-bound decode term doubles too (launches aside)
    kern = base.nonexpert_layer_s(1, 100) - base.nonexpert_layer_s(1, 0)
    assert kern > 0  # the KV read is part of the scaled term
    assert half.nonexpert_layer_s(1, 100) - half.nonexpert_layer_s(1, 0) == pytest.approx(2 * kern)


def test_half_efficiency_leaves_compute_bound_prefill_alone() -> None:
    """A 4096-token prompt pass is compute-bound even at half the bandwidth: unchanged."""
    base = cost_model("a6000-pcie4", "mixtral-8x7b")
    half = cost_model("a6000-pcie4", "mixtral-8x7b", gpu_stream_efficiency=0.5)
    n = 4096
    m, gpu = base.model, base.hw.gpu
    flops = 2.0 * (m.non_expert_params - m.embedding_params) / m.moe_layers * n
    moved = base.nonexpert_layer_bytes + m.kv_bytes_per_token / m.moe_layers * n
    assert flops / (gpu.bf16_tflops * 1e12) > moved / (0.5 * gpu.mem_bw_gbs * 1e9)
    assert half.nonexpert_layer_s(n, 0) == base.nonexpert_layer_s(n, 0)
    assert half.fused_gpu_expert_s(n) == base.fused_gpu_expert_s(n)
    # copies over the link are not GPU kernels: unchanged at any efficiency
    assert half.h2d_expert_s(True) == base.h2d_expert_s(True)


def test_lower_of_format_rule_and_runtime_efficiency() -> None:
    """A GGUF expert streams at min(0.78, efficiency) of the spec, never at their product."""
    gguf = cost_model("a6000-pcie4", "mixtral-8x7b").model.with_dtype("q4_0")
    at = {e: cost_model("a6000-pcie4", gguf, gpu_stream_efficiency=e) for e in (1.0, 0.95, 0.5)}
    assert at[0.95].fused_gpu_expert_s(1) == at[1.0].fused_gpu_expert_s(1)  # 0.78 binds
    ratio = at[0.5].fused_gpu_expert_s(1) / at[1.0].fused_gpu_expert_s(1)
    assert ratio == pytest.approx(0.78 / 0.5, rel=1e-12)


@pytest.mark.parametrize("bad", [0, 0.0, -0.2, 1.01, 2, math.nan, math.inf, "0.5", True])
def test_bad_efficiency_is_refused_in_one_line(bad: object) -> None:
    """A profile file with an efficiency outside (0, 1] is a one-line UserError naming it."""
    with pytest.raises(UserError) as err:
        parse_runtime({"name": "x", "gpu_stream_efficiency": bad}, "x.toml")
    msg = str(err.value)
    assert "gpu_stream_efficiency" in msg and "\n" not in msg and "(0, 1]" in msg


@pytest.mark.parametrize("bad", [0.0, -1.0, 1.5, math.nan])
def test_cost_model_refuses_bad_efficiency(bad: float) -> None:
    """The cost model's own guard (direct API users)."""
    with pytest.raises(ValueError, match="gpu_stream_efficiency"):
        cost_model("a6000-pcie4", "mixtral-8x7b", gpu_stream_efficiency=bad)


def _run(engine: str, eff: float, **kw: object):  # type: ignore[no-untyped-def]
    rt = with_costs(get_runtime("llama.cpp"), gpu_stream_efficiency=eff)
    return simulate(
        policy="llama-cpp-layers",
        hw="a6000-pcie4",
        trace=TRACE,
        sequences=1,
        dtype="q4_0",
        runtime=rt,
        engine=engine,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("opts", [{"ngl": -1}, {"ngl": 20}])
def test_engines_agree_under_an_efficiency(opts: dict[str, int]) -> None:
    """Fast and reference engines give the same timeline at 0.3 (whole-GPU graph replay and
    a CPU/GPU layer split)."""
    fast = _run("fast", 0.3, policy_options=opts)
    ref = _run("reference", 0.3, policy_options=opts)
    keys = ["resource", "start", "end", "kind", "layer", "expert", "token"]
    a = fast.timeline.sort_values(keys).reset_index(drop=True)
    b = ref.timeline.sort_values(keys).reset_index(drop=True)
    assert len(a) == len(b) > 0
    assert (a["resource"] == b["resource"]).all() and (a["kind"] == b["kind"]).all()
    assert np.abs(a["start"] - b["start"]).max() < 1e-9
    assert np.abs(a["end"] - b["end"]).max() < 1e-9
    assert fast.metrics["e2e_s"] == pytest.approx(ref.metrics["e2e_s"], abs=1e-9)


def test_lower_efficiency_never_speeds_a_run_up() -> None:
    """Physical invariant: streaming slower cannot make decode faster (whole-GPU run)."""
    tps = [
        _run("fast", e, record=False, policy_options={"ngl": -1}).metrics["decode_tokens_per_s"]
        for e in (1.0, 0.58, 0.3)
    ]
    assert tps[0] > tps[1] > tps[2]


# --- the efficiency by memory technology (a runtime's calibration on LPDDR5X) --------------------


def test_the_lpddr5x_calibration_applies_where_the_profile_names_that_memory() -> None:
    """llama.cpp's one-token kernels stream 0.82 of the GB10's 273 GB/s (the largest dense model
    of llama.cpp's DGX Spark page: Qwen2.5-Coder-7B Q8_0 at 29.30 t/s, 7.52 GB a token, after
    the graph's 0.39 ms); a card that names no memory type keeps the RTX 4090's 0.58."""
    rt = get_runtime("llama.cpp")
    assert rt.gpu_stream_efficiency_on("lpddr5x") == pytest.approx(
        7.52 / (1 / 29.30 - (28 * 23 + 4) * 0.58e-6 - 15e-6) / 273, abs=0.005
    )
    spark = load_profile("dgx-spark-gb10")
    assert spark.gpu.memory_type == "lpddr5x"
    model = cost_model(spark, "qwen3-30b-a3b").model
    assert runtime_cost_model(spark, model, rt).gpu_stream_efficiency == pytest.approx(0.82)
    desk = load_profile("rtx4090-pcie4")
    assert desk.gpu.memory_type is None
    assert runtime_cost_model(desk, model, rt).gpu_stream_efficiency == pytest.approx(0.58)
    # a runtime with no table keeps its one figure on any memory
    assert get_runtime("cuda-graph").gpu_stream_efficiency_on("lpddr5x") == pytest.approx(0.34)


def test_a_bad_memory_type_or_share_is_a_one_line_error(tmp_path) -> None:
    p = tmp_path / "p.toml"
    p.write_text(
        'extends = "rtx4090-pcie4"\nname = "x"\ndescription = "x"\n[gpu]\nmemory_type = "dram"\n'
    )
    with pytest.raises(ProfileError, match=r"gpu\.memory_type"):
        load_profile(str(p))
    with pytest.raises(UserError, match=r"gpu_stream_efficiency_by_memory\.lpddr5x"):
        parse_runtime({"name": "x", "gpu_stream_efficiency_by_memory": {"lpddr5x": 0}}, "x.toml")
