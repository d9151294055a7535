"""GEMM at prompt shapes (docs/cost-model.md): a runtime's GPU matrix product over n tokens runs
at ``n / (n + gpu_gemm_half_tokens)`` of ``gpu.bf16_tflops`` above ``GEMV_MAX_TOKENS`` tokens.

Checked against the measurement the llama.cpp runtimes' constant is read from (ggml-org/llama.cpp
PR #7676: an RTX 4090's prompt rate by micro-batch size), and against invariants a wrong rule
would break (the full rate for vector-sized calls, never faster with fewer tokens per product,
nothing changes for runtimes that do not state it)."""

from __future__ import annotations

import pytest

from daopsim.simulator.costs import GEMV_MAX_TOKENS, cost_model
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.models import get_model
from daopsim.simulator.run_costs import runtime_cost_model
from daopsim.simulator.runtime_profiles import get_runtime, runtime_names

#: PR #7676, RTX 4090, llama 8B Q4_0 pp512 by micro-batch size (the PR's kernels), t/s
PR_7676 = {16: 1937.21, 32: 3427.61, 64: 5420.06, 128: 7443.66, 256: 9601.53, 512: 10358.75}
GFLOP_PER_TOKEN = 14.09  # LLaMA-3(.1)-8B prompt token (docs/references.md, "CPUs")
WEIGHTS_GB = 3.93  # its 6.98 G layer weights at Q4_0's 4.5 bits


def test_the_half_point_reproduces_the_micro_batch_sweep() -> None:
    """With the RTX 4090's 165.2 TFLOPS and llama.cpp's one-token stream (0.58 of 1008 GB/s),
    the rule gives each micro-batch's time within -13 % (16 tokens, partly memory-bound) and +4 %
    of the measured one."""
    hw = load_profile("rtx4090-pcie4")
    rt = get_runtime("llama.cpp")
    cm = runtime_cost_model(hw, get_model("mixtral-8x7b"), rt)
    mem = WEIGHTS_GB * 1e9 / (rt.gpu_stream_efficiency * hw.gpu.spec_bw_gbs * 1e9)
    for n, tps in PR_7676.items():
        measured = n / tps
        model = max(mem, n * GFLOP_PER_TOKEN * 1e9 / cm.gpu_gemm_flops(n))
        assert -0.14 <= model / measured - 1 <= 0.04, n


def test_vector_sized_calls_and_runtimes_without_it_keep_the_full_rate() -> None:
    hw = load_profile("rtx4080-pcie4")
    model = get_model("qwen3-30b-a3b")
    peak = hw.gpu.bf16_tflops * 1e12
    ggml = runtime_cost_model(hw, model, get_runtime("llama.cpp"))
    for n in range(1, GEMV_MAX_TOKENS + 1):
        assert ggml.gpu_gemm_flops(n) == peak
    for name in runtime_names():
        rt = get_runtime(name)
        if rt.gpu_gemm_half_tokens == 0:
            cm = runtime_cost_model(hw, model, rt)
            assert cm.gpu_gemm_flops(4096) == peak, name
    # and a cost model built without the argument is the same as one with 0
    a, b = cost_model(hw, model), cost_model(hw, model, gpu_gemm_half_tokens=0.0)
    assert a.gpu_expert_s(512) == b.gpu_expert_s(512)


def test_more_tokens_per_product_never_make_a_token_slower() -> None:
    """The rate grows with n toward the peak, and the time per token of an expert call never
    grows with n (fewer tokens per product cannot be cheaper per token)."""
    hw = load_profile("rtx4080-pcie4")
    cm = runtime_cost_model(hw, get_model("qwen3-30b-a3b"), get_runtime("llama.cpp"))
    prev_rate, prev_per_token = 0.0, float("inf")
    for n in (9, 16, 32, 64, 128, 512, 2048, 65536):
        rate = cm.gpu_gemm_flops(n)
        assert prev_rate < rate < hw.gpu.bf16_tflops * 1e12
        per_token = cm.gpu_expert_s(n) / n
        assert per_token <= prev_per_token * (1 + 1e-12)
        prev_rate, prev_per_token = rate, per_token


def test_a_moe_prompt_is_slowed_where_few_tokens_reach_an_expert() -> None:
    """A 512-token prompt of Qwen3-30B-A3B gives each of 128 experts 32 tokens on average
    (top-8): its products run at 32 / 100 of the rate, so a compute-bound expert call takes
    100 / 32 of the unfilled roofline's compute time; the non-expert part (512 tokens) 580 / 512."""
    hw = load_profile("dgx-spark-gb10")
    model = get_model("qwen3-30b-a3b").with_dtype("q8_0")
    filled = runtime_cost_model(hw, model, get_runtime("llama.cpp"))
    half = filled.gpu_gemm_half_tokens
    assert half == pytest.approx(68.0)
    assert filled.gpu_gemm_flops(32) == pytest.approx(hw.gpu.bf16_tflops * 1e12 * 32 / 100)
    assert filled.gpu_gemm_flops(512) == pytest.approx(hw.gpu.bf16_tflops * 1e12 * 512 / 580)
