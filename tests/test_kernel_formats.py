"""Per-format kernel costs (docs/cost-model.md, "Kernel efficiency"), checked by hand.

GGUF experts stream at 0.87 of bf16's GPU bandwidth; HQQ experts launch 18 more kernels and move
24 more bytes per group (their scales and zero points are dequantised to fp16 before each fused
GEMM, on every call); bf16 and int8 CPU experts get
the AMX compute roof on a profile that has one, above 4 tokens only, and no other format does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from simulator.costs import (
    ACT_BYTES,
    cost_model,
    dequant_bytes_per_weight,
    dequant_kernels,
    gpu_kernel_efficiency,
)
from simulator.errors import ProfileError
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


# --- ggml's CPU weight stream (cpu.ggml_bw_gbs) -----------------------------------------------


def test_ggml_stream_times_block_formats_only() -> None:
    """On the RTX 4080 box (ik_llama.cpp's machine) GGUF and MXFP4 CPU experts stream at the
    measured ggml rate; bf16 and int4_g128 keep cpu.mem_bw_gbs, and a profile without the field
    times every format at cpu.mem_bw_gbs."""
    hw, plain = load_profile("rtx4080-pcie4"), load_profile("rtx4090-pcie4")
    assert hw.cpu.ggml_bw_gbs == 62.1 and plain.cpu.ggml_bw_gbs is None
    assert hw.cpu.mem_bw_gbs == plain.cpu.mem_bw_gbs == 33.3
    cases = [
        ("gpt-oss-20b", "mxfp4", 62.1),
        ("mixtral-8x7b", "q4_k_m", 62.1),
        ("mixtral-8x7b", "q8_0", 62.1),
        ("mixtral-8x7b", "bf16", 33.3),
        ("mixtral-8x7b", "int4_g128", 33.3),
    ]
    for name, dtype, bw in cases:
        model = get_model(name).with_dtype(dtype)
        c = cost_model(hw, model)
        assert c.cpu_expert_s(1) == pytest.approx(c.host_expert_bytes / (bw * 1e9)), dtype
        base = cost_model(plain, model)
        assert base.cpu_expert_s(1) == pytest.approx(base.host_expert_bytes / 33.3e9), dtype
        # alone, one call takes the whole socket whatever rate times it
        assert c.cpu_share(1) == pytest.approx(1.0) and base.cpu_share(1) == pytest.approx(1.0)
        key = "ggml_bw_gbs" if bw == 62.1 else "mem_bw_gbs"
        assert f"cpu.{key}" in c.sources()["cpu_expert"]


def test_ggml_stream_keeps_the_compute_roof() -> None:
    """A faster weight stream cannot lift the CPU's FLOP roof: a large call stays compute-bound
    at cpu.bf16_gflops, and no call gets slower than on the same box without the field."""
    hw = load_profile("rtx4080-pcie4")
    no_ggml = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, ggml_bw_gbs=None))
    model = get_model("gpt-oss-20b")
    fast, slow = cost_model(hw, model), cost_model(no_ggml, model)
    for n in (1, 2, 8, 64, 512):
        assert fast.cpu_expert_s(n) <= slow.cpu_expert_s(n)
    flops = 2.0 * model.params_per_expert * 512
    assert fast.cpu_expert_s(512) == pytest.approx(flops / (hw.cpu.bf16_gflops * 1e9))
    assert fast.cpu_expert_s(512) == slow.cpu_expert_s(512)
    # the decision input a policy reads follows the same rate
    assert fast.decision_cpu_expert_s() == fast.cpu_expert_s(1) < slow.decision_cpu_expert_s()


def test_ggml_stream_times_cpu_layers_of_block_formats() -> None:
    """llama.cpp's CPU-resident layers: GGUF non-expert weights stream at the ggml rate, bf16
    ones at cpu.mem_bw_gbs (a decode token is bandwidth-bound either way)."""
    hw = load_profile("rtx4080-pcie4")
    q8 = cost_model(hw, get_model("gpt-oss-20b").with_precision(nonexpert_dtype="q8_0"))
    bf = cost_model(hw, get_model("gpt-oss-20b"))
    for c, bw in ((q8, 62.1), (bf, 33.3)):
        moved = c.nonexpert_layer_bytes + c.model.kv_bytes_per_token / c.model.moe_layers * 17
        assert c.cpu_nonexpert_layer_s(1, 16) == pytest.approx(moved / (bw * 1e9))


def test_ggml_stream_is_validated(tmp_path: Path) -> None:
    """The ggml rate is positive and, one call already using every thread, never above the
    socket's all-core bandwidth when the profile gives one."""
    base = 'extends = "rtx4090-pcie4"\nname = "bad"\ndescription = "x"\n[cpu]\n'
    for body in ("ggml_bw_gbs = -1\n", "ggml_bw_gbs = 70.0\nsocket_bw_gbs = 60.0\n"):
        p = tmp_path / "bad.toml"
        p.write_text(base + body)
        with pytest.raises(ProfileError, match="ggml_bw_gbs"):
            load_profile(str(p))
    ok = tmp_path / "ok.toml"
    ok.write_text(base + "ggml_bw_gbs = 60.0\nsocket_bw_gbs = 60.0\n")
    assert load_profile(str(ok)).cpu.ggml_bw_gbs == 60.0
