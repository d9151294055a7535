"""Per-format kernel costs (docs/cost-model.md, "Kernel efficiency"), checked by hand.

GGUF experts stream at 0.87 of bf16's GPU bandwidth; HQQ experts launch 18 more kernels and move
24 more bytes per group (their scales and zero points are dequantised to fp16 before each fused
GEMM, on every call); bf16 and int8 CPU experts get
the AMX compute roof on a profile that has one, above 4 tokens only, and no other format does.
"""

from __future__ import annotations

import dataclasses

import pytest

from daopsim.simulator.costs import (
    ACT_BYTES,
    cost_model,
    dequant_bytes_per_weight,
    dequant_kernels,
    gpu_kernel_efficiency,
)
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.models import get_model
from daopsim.simulator.runner import simulate
from daopsim.simulator.runtime_profiles import get_runtime, runtime_names


def _gpu_by_hand(hw, model, n: int, eff: float, kernels: int, dq: float = 0.0) -> float:
    moved = model.expert_bytes() + dq * model.params_per_expert + 2 * n * model.hidden * ACT_BYTES
    # a format's share is of the spec bandwidth, capped at the profile's (measured) rate
    rate = hw.gpu.mem_bw_gbs if eff == 1.0 else min(hw.gpu.mem_bw_gbs, eff * hw.gpu.spec_bw_gbs)
    roof = max(
        moved / (rate * 1e9),
        2.0 * model.params_per_expert * n / (hw.gpu.bf16_tflops * 1e12),
    )
    return roof + kernels * hw.gpu.launch_overhead_us * 1e-6


@pytest.mark.parametrize(
    ("dtype", "eff", "extra", "dq"),
    [
        ("bf16", 1.0, 0, 0.0),
        ("int4_g128", 1.0, 0, 0.0),
        ("q4_k_m", 0.78, 0, 0.0),
        # HQQ: 3 linears x (scale, zero) x (cast, subtract, multiply); 24 B per group of 16 / 64
        ("hqq2_g16", 1.0, 18, 24 / 16),
        ("hqq4_g64", 1.0, 18, 24 / 64),
    ],
)
def test_gpu_expert_time_by_format(dtype: str, eff: float, extra: int, dq: float) -> None:
    hw = load_profile("rtx4090-pcie4")
    model = get_model("mixtral-8x7b").with_dtype(dtype)
    assert gpu_kernel_efficiency(dtype) == eff and dequant_kernels(dtype) == extra
    assert dequant_bytes_per_weight(dtype) == dq
    cm = cost_model(hw, model)
    for n in (1, 64):
        expected = _gpu_by_hand(hw, model, n, eff, 5 + extra, dq)  # gated FFN: 5 eager kernels
        assert cm.gpu_expert_s(n) == pytest.approx(expected, rel=1e-12)


def test_hqq_call_moves_more_than_its_stored_bytes() -> None:
    """Per-call dequantisation can only add traffic: an HQQ expert call is slower than a call
    that streams the same stored bytes once, and a finer group costs more per weight."""
    hw = load_profile("t4-pcie3")
    hqq = cost_model(hw, get_model("mixtral-8x7b").with_dtype("hqq2_g16"))
    stored = hqq.expert_bytes / (hw.gpu.mem_bw_gbs * 1e9)
    dequant = 1.5 * hqq.model.params_per_expert / (hw.gpu.mem_bw_gbs * 1e9)
    assert hqq.gpu_expert_s(1) > stored + dequant
    assert dequant_bytes_per_weight("hqq2_g16") > dequant_bytes_per_weight("hqq3_g64") > 0
    assert dequant_bytes_per_weight("q4_k_m") == 0.0


def test_a_slower_format_never_runs_faster() -> None:
    """At equal bytes the GGUF kernel is the slower one (an efficiency below 1 cannot speed up)."""
    hw = load_profile("rtx4090-pcie4")
    q40 = cost_model(hw, get_model("mixtral-8x7b").with_dtype("q4_0"))
    int4 = get_model("mixtral-8x7b").with_dtype("int4_g128")
    same_bytes = dataclasses.replace(int4, expert_extra_params=0)
    assert q40.gpu_expert_s(1) > cost_model(hw, same_bytes).gpu_expert_s(1) * (4.5 / 4.15625)


def test_amx_roof_only_for_amx_formats_above_four_tokens() -> None:
    hw = load_profile("rtx4090-xeon6454s-pcie4")
    assert hw.cpu.amx_bf16_gflops == 12000.0
    bf16 = cost_model(hw, get_model("mixtral-8x7b"))
    flops = 2.0 * bf16.model.params_per_expert
    stream = bf16.host_expert_bytes / (bf16.cpu_stream_gbs("bf16") * 1e9)
    for n, peak in ((4, hw.cpu.bf16_gflops), (5, 12000.0), (512, 12000.0)):
        assert bf16.cpu_expert_s(n) == pytest.approx(max(stream, flops * n / (peak * 1e9)))
    gguf = cost_model(hw, get_model("mixtral-8x7b").with_dtype("q4_k_m"))
    n = 512
    gguf_stream = gguf.host_expert_bytes / (gguf.cpu_stream_gbs("q4_k_m") * 1e9)
    expected = max(gguf_stream, flops * n / (hw.cpu.bf16_gflops * 1e9))
    assert gguf.cpu_expert_s(n) == pytest.approx(expected)
    # the same machine without AMX: the roof falls back to bf16_gflops at every size
    no_amx = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, amx_bf16_gflops=None))
    slow = cost_model(no_amx, get_model("mixtral-8x7b"))
    assert slow.cpu_expert_s(n) > bf16.cpu_expert_s(n)
    assert slow.cpu_expert_s(1) == bf16.cpu_expert_s(1)


# --- ggml's CPU kernels (their weight stream: tests/test_cpu_stream.py) ---------------------


def test_ggml_stream_keeps_the_compute_roof() -> None:
    """A faster weight stream cannot lift the CPU's FLOP roof: a large call stays compute-bound
    at cpu.bf16_gflops, and no call gets slower than under the default CPU kernels. (The
    profile's measured ggml GEMM rate, a different roof, is set aside here: see
    tests/test_ggml_gemm_rate.py.)"""
    hw = load_profile("rtx3090-3700x-pcie4")  # ggml 34.7 GB/s, PyTorch bf16 18.4
    hw = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, ggml_gemm_gflops=None))
    model = get_model("gpt-oss-20b")
    fast, slow = cost_model(hw, model, "ggml"), cost_model(hw, model)
    for n in (1, 2, 8, 64, 512):
        assert fast.cpu_expert_s(n) <= slow.cpu_expert_s(n)
    flops = 2.0 * model.params_per_expert * 512
    assert fast.cpu_expert_s(512) == pytest.approx(flops / (hw.cpu.bf16_gflops * 1e9))
    assert fast.cpu_expert_s(512) == slow.cpu_expert_s(512)
    # the decision input a policy reads follows the same rate
    assert fast.decision_cpu_expert_s() == fast.cpu_expert_s(1) < slow.decision_cpu_expert_s()
    assert "ggml_stream_gbs (measured)" in fast.sources()["cpu_expert"]
    assert "core_stream_gbs.torch_bf16" in slow.sources()["cpu_expert"]


def test_ggml_stream_times_cpu_layers() -> None:
    """llama.cpp's CPU-resident layers: GGUF and bf16 non-expert weights stream at the ggml
    family's rate under ggml, at PyTorch's bf16 rate under the default kernels (the profile's
    16 cores x per-core rate, capped at 0.97 x 83.2 GB/s)."""
    hw = load_profile("rtx4090-pcie4")
    bound = 0.97 * 83.2
    for ne in ("q8_0", "bf16"):
        model = get_model("gpt-oss-20b").with_precision(nonexpert_dtype=ne)
        for kernels, bw in (("ggml", min(16 * 30.4, bound)), ("default", min(16 * 4.5, bound))):
            c = cost_model(hw, model, kernels)
            moved = c.nonexpert_layer_bytes + c.model.kv_bytes_per_token / c.model.moe_layers * 17
            assert c.cpu_nonexpert_layer_s(1, 16) == pytest.approx(moved / (bw * 1e9)), kernels


def test_unknown_cpu_kernels_are_refused() -> None:
    with pytest.raises(ValueError, match="cpu_kernels"):
        cost_model("rtx4090-pcie4", "mixtral-8x7b", "llamafile")


@pytest.mark.parametrize("runtime", ["llama.cpp", "hf-eager"])
def test_the_runner_takes_the_cpu_kernels_from_the_runtime(runtime: str) -> None:
    """A run's CPU experts stream by the rule only under a runtime that declares ggml kernels:
    llama.cpp's --cpu-moe on the 7950X box is faster under llama.cpp than under hf-eager."""
    assert get_runtime("llama.cpp").cpu_kernels == "ggml"
    assert {get_runtime(n).cpu_kernels for n in runtime_names()} == {"default", "ggml"}
    res = {
        rt: simulate(
            "llama-cpp-cpu-moe",
            hw="rtx4080-pcie4",
            model="gpt-oss-20b",
            sequences=1,
            runtime=rt,
            policy_options={"n_cpu_moe": -1},
        )
        for rt in ("llama.cpp", runtime)
    }
    fast = res["llama.cpp"].metrics["decode_tokens_per_s"]
    other = res[runtime].metrics["decode_tokens_per_s"]
    if runtime == "llama.cpp":
        assert fast == other
    else:
        # every routed expert runs on the CPU: MXFP4 streams in ggml's family (62.1 GB/s);
        # PyTorch dequantises it in bf16 passes at its own rate, capped at the same 62.1
        assert fast >= other


def test_gguf_share_is_of_the_spec_bandwidth_on_spec_and_measured_profiles() -> None:
    """Issue 30: GGUF's 0.78 was read against the RTX 4080's spec bandwidth, so it is a share of
    the spec figure wherever a profile's mem_bw_gbs is a measurement (the 4090's 912 of 1008)
    and of mem_bw_gbs where that is the spec (the 4080's 716.8): never discounted twice."""
    for name in ("rtx4080-pcie4", "rtx4090-pcie4"):
        hw = load_profile(name)
        cm = cost_model(hw, get_model("mixtral-8x7b").with_dtype("q4_k_m"))
        rate = cm.expert_bytes / (cm.gpu_expert_s(1) - 5 * hw.gpu.launch_overhead_us * 1e-6)
        act = 2 * cm.model.hidden * ACT_BYTES  # one token in and out
        spec = hw.gpu.spec_bw_gbs * 1e9
        assert rate == pytest.approx(0.78 * spec * cm.expert_bytes / (cm.expert_bytes + act))
