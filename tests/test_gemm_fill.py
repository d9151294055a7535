"""GEMM at prompt shapes (docs/cost-model.md): a runtime's GPU matrix product over n tokens runs
at ``n / (n + gpu_gemm_half_tokens)`` of its peak above ``GEMV_MAX_TOKENS`` tokens; the peak is
``gpu.bf16_tflops``, or under ggml's kernels the rate that puts a 512-token product at the
profile's ``gpu.ggml_prompt_tflops`` (llama.cpp's scoreboard figure for the card).

Checked against the measurement the llama.cpp runtimes' constant is read from (ggml-org/llama.cpp
PR #7676: an RTX 4090's prompt rate by micro-batch size), and against invariants a wrong rule
would break (the full rate for vector-sized calls, never faster with fewer tokens per product,
nothing changes for runtimes that do not state it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from daopsim.simulator.costs import GEMV_MAX_TOKENS, GGML_PROMPT_TOKENS, cost_model
from daopsim.simulator.hardware import ProfileError, list_profiles, load_profile
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
    # the sweep's own card rate (the half point's derivation), not the scoreboard's
    cm = cost_model(hw, get_model("mixtral-8x7b"), gpu_gemm_half_tokens=rt.gpu_gemm_half_tokens)
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
    assert hw.gpu.ggml_prompt_tflops is not None
    ggml_peak = hw.gpu.ggml_prompt_tflops * 1e12 * (512 + 68) / 512
    for n in range(1, GEMV_MAX_TOKENS + 1):
        assert ggml.gpu_gemm_flops(n) == pytest.approx(ggml_peak, rel=1e-12)
    for name in runtime_names():
        rt = get_runtime(name)
        if rt.gpu_gemm_half_tokens == 0 and rt.gpu_kernels == "default":
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
        assert prev_rate < rate < cm.gpu_gemm_flops(GEMV_MAX_TOKENS)
        per_token = cm.gpu_expert_s(n) / n
        assert per_token <= prev_per_token * (1 + 1e-12)
        prev_rate, prev_per_token = rate, per_token


def test_a_moe_prompt_is_slowed_where_few_tokens_reach_an_expert() -> None:
    """A 512-token prompt of Qwen3-30B-A3B gives each of 128 experts 32 tokens on average
    (top-8): its products run at 32 / 100 of the rate, so a compute-bound expert call takes
    100 / 32 of the unfilled roofline's compute time; the non-expert part (512 tokens) 580 / 512."""
    hw = load_profile("framework-desktop-395")  # no ggml_prompt_tflops: bf16_tflops is the peak
    assert hw.gpu.ggml_prompt_tflops is None
    model = get_model("qwen3-30b-a3b").with_dtype("q8_0")
    filled = runtime_cost_model(hw, model, get_runtime("llama.cpp"))
    half = filled.gpu_gemm_half_tokens
    assert half == pytest.approx(68.0)
    assert filled.gpu_gemm_source == "gpu.bf16_tflops"
    assert filled.gpu_gemm_flops(32) == pytest.approx(hw.gpu.bf16_tflops * 1e12 * 32 / 100)
    assert filled.gpu_gemm_flops(512) == pytest.approx(hw.gpu.bf16_tflops * 1e12 * 512 / 580)


def test_ggml_runtimes_multiply_at_the_cards_scoreboard_rate() -> None:
    """Hand-derived: the RTX 4090's scoreboard row (Llama 2 7B Q4_0 pp512 11992.70 t/s x 13.09
    GFLOP per token = 156.9 TFLOPS). Under llama.cpp a 512-token product runs at exactly that
    rate, a 256-token one (an expert's share of a 2048-token gpt-oss prompt) at 156.9 x 580/512
    x 256/324 = 140.4 TFLOPS, and a PyTorch runtime on the same card keeps bf16_tflops."""
    hw = load_profile("rtx4090-pcie4")
    assert hw.gpu.ggml_prompt_tflops == pytest.approx(11992.70 * 13.0865e9 / 1e12, abs=0.05)
    model = get_model("gpt-oss-20b")
    ggml = runtime_cost_model(hw, model, get_runtime("llama.cpp"))
    assert ggml.gpu_gemm_source == "gpu.ggml_prompt_tflops"
    assert ggml.gpu_gemm_flops(GGML_PROMPT_TOKENS) == pytest.approx(156.9e12)
    assert ggml.gpu_gemm_flops(256) == pytest.approx(156.9e12 * 580 / 512 * 256 / 324)
    assert round(ggml.gpu_gemm_flops(256) / 1e12, 1) == 140.4
    torch = runtime_cost_model(hw, model, get_runtime("hf-eager"))
    assert torch.gpu_gemm_source == "gpu.bf16_tflops"
    assert torch.gpu_gemm_flops(4096) == hw.gpu.bf16_tflops * 1e12


def test_the_rate_moves_a_compute_bound_prompt_by_its_ratio() -> None:
    """A compute-bound prompt part slows by the ratio of the rates: on the RTX PRO 4000
    Blackwell SFF ggml's 512-token rate (33.4 TFLOPS, a rule from its 140 W sibling) is 0.40 of
    the spec curve's (95.8 x 512/580), so a 2048-token non-expert part takes more than twice as
    long; a one-token expert call is memory-bound and does not move."""
    hw = load_profile("rtxpro4000sff-pcie5")
    model = get_model("gpt-oss-20b").with_precision("mxfp4", None, "q8_0")
    spec = cost_model(hw, model, gpu_gemm_half_tokens=68.0)
    ggml = cost_model(hw, model, gpu_gemm_half_tokens=68.0, gpu_kernels="ggml")
    assert ggml.gpu_gemm_flops(2048) / spec.gpu_gemm_flops(2048) == pytest.approx(
        33.4 * (580 / 512) / 95.8
    )
    assert ggml.nonexpert_layer_s(2048, 0) > 2.0 * spec.nonexpert_layer_s(2048, 0)
    assert ggml.gpu_expert_s(256) > spec.gpu_expert_s(256)
    # one token is memory-bound: the same under both rates
    assert ggml.gpu_expert_s(1) == spec.gpu_expert_s(1)


def test_a_card_without_the_field_falls_back_to_bf16_tflops() -> None:
    """Every bundled profile: under llama.cpp the peak is the scoreboard figure where the
    profile states one and bf16_tflops otherwise, and the same rule holds at every n."""
    rt = get_runtime("llama.cpp")
    model = get_model("qwen3-30b-a3b")
    for hw in list_profiles():
        cm = runtime_cost_model(hw, model, rt)
        rate = hw.gpu.ggml_prompt_tflops
        at_512 = cm.gpu_gemm_flops(GGML_PROMPT_TOKENS)
        if rate is None:
            assert at_512 == pytest.approx(hw.gpu.bf16_tflops * 1e12 * 512 / 580), hw.name
        else:
            assert at_512 == pytest.approx(rate * 1e12), hw.name


def test_a_profile_naming_another_card_does_not_inherit_the_rate(tmp_path: Path) -> None:
    """The scoreboard figure belongs to its card: a profile that extends the RTX 4090's and
    keeps its card inherits it; one naming another card does not (unless it states its own)."""
    same = tmp_path / "same.toml"
    head = 'extends = "rtx4090-pcie4"\ndescription = "d"\n'
    same.write_text(head + 'name = "same"\n')
    other = tmp_path / "other.toml"
    other.write_text(head + 'name = "other"\n[gpu]\nname = "Another card"\n')
    own = tmp_path / "own.toml"
    own.write_text(head + 'name = "own"\n[gpu]\nname = "Another card"\nggml_prompt_tflops = 50.0\n')
    assert load_profile(str(same)).gpu.ggml_prompt_tflops == pytest.approx(156.9)
    assert load_profile(str(other)).gpu.ggml_prompt_tflops is None
    assert load_profile(str(own)).gpu.ggml_prompt_tflops == 50.0
    bad = tmp_path / "bad.toml"
    bad.write_text(head + 'name = "bad"\n[gpu]\nggml_prompt_tflops = -1\n')
    with pytest.raises(ProfileError) as err:
        load_profile(str(bad))
    assert "ggml_prompt_tflops" in str(err.value)


def test_a_runtime_states_its_gpu_kernels() -> None:
    """The four ggml runtimes declare ggml's GPU kernels; the PyTorch ones do not; a bad value
    is a one-line error naming the field."""
    from daopsim.simulator.errors import UserError
    from daopsim.simulator.runtime_profiles import parse_runtime

    for name in ("llama.cpp", "llama.cpp-eager", "ik_llama.cpp", "ik_llama.cpp-rtr"):
        assert get_runtime(name).gpu_kernels == "ggml", name
    for name in ("hf-eager", "cuda-graph", "moe-infinity", "ktransformers"):
        assert get_runtime(name).gpu_kernels == "default", name
    with pytest.raises(UserError, match="gpu_kernels"):
        parse_runtime({"name": "x", "gpu_kernels": "cublas"}, "x.toml")


def test_ggml_moe_products_pay_for_whole_tiles_hand_derived() -> None:
    """Hand-derived: ggml's CUDA MoE product gives each expert a 128-token tile chosen by the
    micro-batch (llama.cpp PR #26977; docs/references.md, "ggml MoE product tiles"). On the RTX
    4080 (scoreboard 105.1 TFLOPS, so peak 105.1 x 580/512 = 119.06 with h = 68), an MXFP4
    gpt-oss-20b expert over 32 tokens does the work of 128 at 128/196 of the peak: 32 useful
    tokens at 119.06 x 32/196 = 19.44 TFLOPS (the dense curve gave 119.06 x 32/100 = 38.10);
    over 129 tokens two tiles, 119.06 x 129/324 = 47.40; over 128 or 512 the dense curve's rate."""
    hw = load_profile("rtx4080-pcie4")
    model = get_model("gpt-oss-20b").with_precision("mxfp4", None, "bf16")
    tiled = runtime_cost_model(hw, model, get_runtime("llama.cpp"))
    assert tiled.gpu_moe_tile_tokens == 128.0
    peak = 105.1e12 * 580 / 512

    def useful(n: int) -> float:
        return tiled.expert_flops(n) / tiled.gpu_expert_gemm_s(n)

    assert useful(32) == pytest.approx(peak * 32 / 196, rel=2e-3)
    assert round(useful(32) / 1e12, 1) == 19.4
    assert useful(129) == pytest.approx(peak * 129 / 324, rel=2e-3)
    for n in (128, 256, 512):
        assert useful(n) == pytest.approx(tiled.gpu_gemm_flops(n))
    # at or below the vector-kernel size nothing is tiled
    assert useful(GEMV_MAX_TOKENS) == pytest.approx(tiled.gpu_gemm_flops(GEMV_MAX_TOKENS))


def test_one_tile_costs_the_same_whatever_it_holds() -> None:
    """Trying to break the tile rule: every expert call from 9 to 128 tokens costs exactly one
    tile's compute, no call is ever cheaper than on the dense curve, and more tokens never make
    a call cheaper."""
    hw = load_profile("dgx-spark-gb10")
    model = get_model("qwen3-30b-a3b").with_dtype("q8_0")
    dense = cost_model(hw, model, gpu_gemm_half_tokens=68.0, gpu_kernels="ggml")
    tiled = cost_model(
        hw, model, gpu_gemm_half_tokens=68.0, gpu_kernels="ggml", gpu_moe_tile_tokens=128.0
    )
    one_tile = tiled.gpu_expert_gemm_s(128)
    prev = 0.0
    for n in range(GEMV_MAX_TOKENS + 1, 1025):
        t = tiled.gpu_expert_gemm_s(n)
        if n <= 128:
            assert t == pytest.approx(one_tile, rel=1e-12)
        assert t >= dense.gpu_expert_gemm_s(n) * (1 - 1e-12)
        assert t >= prev * (1 - 1e-12)
        prev = t
        # the whole call (weights streamed too) is never cheaper either
        assert tiled.gpu_expert_s(n) >= dense.gpu_expert_s(n) * (1 - 1e-12)


def test_float_experts_and_dense_parts_keep_the_dense_curve() -> None:
    """Float experts go through cuBLAS/hipBLAS per expert, not MMQ tiles; a layer's non-expert
    products are dense products of the pass's tokens. Neither moves with the tile width."""
    hw = load_profile("rtx4080-pcie4")
    rt = get_runtime("llama.cpp")
    for dtype, moves in (("bf16", False), ("q4_0", True)):
        model = get_model("deepseek-v2-lite").with_dtype(dtype)
        tiled = runtime_cost_model(hw, model, rt)
        dense = cost_model(hw, model, gpu_gemm_half_tokens=68.0, gpu_kernels="ggml")
        assert (tiled.gpu_expert_gemm_s(48) > dense.gpu_expert_gemm_s(48)) is moves
        assert tiled.nonexpert_layer_s(1024, 0) == dense.nonexpert_layer_s(1024, 0)


def test_only_the_mainline_ggml_runtimes_state_the_tile() -> None:
    """The tile comes from mainline llama.cpp's CUDA/HIP code; ik_llama.cpp's MoE path was not
    read, and a runtime on default kernels has no MMQ; a negative width is refused."""
    assert get_runtime("llama.cpp").gpu_moe_tile_tokens == 128.0
    assert get_runtime("llama.cpp-eager").gpu_moe_tile_tokens == 128.0
    for name in runtime_names():
        rt = get_runtime(name)
        if rt.gpu_kernels != "ggml" or name.startswith("ik_llama"):
            assert rt.gpu_moe_tile_tokens == 0.0, name
    with pytest.raises(ValueError, match="gpu_moe_tile_tokens"):
        cost_model("rtx4080-pcie4", "gpt-oss-20b", gpu_moe_tile_tokens=-1.0)
