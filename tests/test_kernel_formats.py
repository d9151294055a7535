"""Per-format kernel costs (docs/cost-model.md, "Kernel efficiency"), checked by hand.

GGUF experts stream at 0.87 of bf16's GPU bandwidth; HQQ experts launch 18 more kernels and move
24 more bytes per group (their scales and zero points are dequantised to fp16 before each fused
GEMM, on every call); bf16 and int8 CPU experts get
the AMX compute roof on a profile that has one, above 4 tokens only, and no other format does.
"""

from __future__ import annotations

import dataclasses

import pytest

from simulator.costs import (
    ACT_BYTES,
    cost_model,
    dequant_bytes_per_weight,
    dequant_kernels,
    gpu_kernel_efficiency,
)
from simulator.hardware import load_profile
from simulator.models import get_model


def _gpu_by_hand(hw, model, n: int, eff: float, kernels: int, dq: float = 0.0) -> float:
    moved = model.expert_bytes() + dq * model.params_per_expert + 2 * n * model.hidden * ACT_BYTES
    roof = max(
        moved / (hw.gpu.mem_bw_gbs * 1e9 * eff),
        2.0 * model.params_per_expert * n / (hw.gpu.bf16_tflops * 1e12),
    )
    return roof + kernels * hw.gpu.launch_overhead_us * 1e-6


@pytest.mark.parametrize(
    ("dtype", "eff", "extra", "dq"),
    [
        ("bf16", 1.0, 0, 0.0),
        ("int4_g128", 1.0, 0, 0.0),
        ("q4_k_m", 0.87, 0, 0.0),
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
    stream = bf16.host_expert_bytes / (hw.cpu.mem_bw_gbs * 1e9)
    for n, peak in ((4, hw.cpu.bf16_gflops), (5, 12000.0), (512, 12000.0)):
        assert bf16.cpu_expert_s(n) == pytest.approx(max(stream, flops * n / (peak * 1e9)))
    gguf = cost_model(hw, get_model("mixtral-8x7b").with_dtype("q4_k_m"))
    n = 512
    gguf_stream = gguf.host_expert_bytes / (hw.cpu.mem_bw_gbs * 1e9)
    expected = max(gguf_stream, flops * n / (hw.cpu.bf16_gflops * 1e9))
    assert gguf.cpu_expert_s(n) == pytest.approx(expected)
    # the same machine without AMX: the roof falls back to bf16_gflops at every size
    no_amx = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, amx_bf16_gflops=None))
    slow = cost_model(no_amx, get_model("mixtral-8x7b"))
    assert slow.cpu_expert_s(n) > bf16.cpu_expert_s(n)
    assert slow.cpu_expert_s(1) == bf16.cpu_expert_s(1)
