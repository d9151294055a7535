"""Eager attention (runtime profiles with ``attention = "eager"``) and the measured GEMM rate.

transformers' eager attention writes every head's ``n x (context + n)`` scores to device memory
and passes over them several times (docs/cost-model.md, "Eager attention"); a fused runtime never
does. These tests try to break the charge: it must be exactly the documented bytes when the
non-expert part is memory-bound, quadratic in the prompt, never negative, and only where the
runtime says so.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daopsim.simulator.core.machine import Machine
from daopsim.simulator.costs import EAGER_ATTENTION_BYTES_PER_SCORE, CostModel, cost_model
from daopsim.simulator.errors import UserError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.models import PRESETS, ModelShape, get_model
from daopsim.simulator.runtime_profiles import get_runtime, parse_runtime, runtime_names

MIXTRAL = get_model("mixtral-8x7b")


def _memory_bound(hw: str = "rtx6000ada-pcie4") -> CostModel:
    """The profile with a compute roof so high that every non-expert call is memory-bound."""
    prof = load_profile(hw)
    gpu = dataclasses.replace(prof.gpu, bf16_tflops=1e9)
    return CostModel(dataclasses.replace(prof, gpu=gpu), MIXTRAL)


@pytest.mark.parametrize("n, context", [(1, 0), (256, 0), (4096, 0), (1, 4095), (512, 1024)])
def test_eager_adds_the_documented_bytes(n: int, context: int) -> None:
    """Memory-bound, eager minus fused is heads x n x (context + n) x 32 B over the bandwidth."""
    cm = _memory_bound()
    extra = cm.nonexpert_layer_s(n, context, eager_attention=True) - cm.nonexpert_layer_s(
        n, context
    )
    blocks = MIXTRAL.layers / MIXTRAL.moe_layers
    scores = MIXTRAL.attention_heads * n * (context + n) * blocks
    assert EAGER_ATTENTION_BYTES_PER_SCORE == 32  # the op-by-op count in costs.py and the docs
    want = scores * EAGER_ATTENTION_BYTES_PER_SCORE / (cm.hw.gpu.mem_bw_gbs * 1e9)
    assert extra == pytest.approx(want, rel=1e-9)


def test_eager_prefill_is_quadratic() -> None:
    """Doubling a prompt (no context) quadruples the eager score traffic when memory-bound."""
    cm = _memory_bound()

    def extra(n: int) -> float:
        return cm.nonexpert_layer_s(n, 0, eager_attention=True) - cm.nonexpert_layer_s(n, 0)

    assert extra(8192) / extra(4096) == pytest.approx(4.0, rel=1e-6)
    assert extra(4096) / extra(2048) == pytest.approx(4.0, rel=1e-6)


def test_eager_4096_prompt_on_ada() -> None:
    """A 4096-token Mixtral prefill on the RTX 6000 Ada: 32 heads x 4096^2 scores x 32 B = 17.2 GB
    per layer, 17.9 ms at 960 GB/s: the layer turns memory-bound, about 0.57 s over 32 layers
    (plus the weights and KV), against ~0.05 s fused (compute-bound)."""
    cm = cost_model("rtx6000ada-pcie4", MIXTRAL)
    fused = 32 * cm.nonexpert_layer_s(4096, 0)
    eager = 32 * cm.nonexpert_layer_s(4096, 0, eager_attention=True)
    assert fused < 0.06
    assert eager == pytest.approx(32 * 32 * 4096**2 * 32 / 960e9, rel=0.05)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=20_000),
    context=st.integers(min_value=0, max_value=50_000),
    hw=st.sampled_from(["rtx6000ada-pcie4", "a6000-pcie4", "l4-pcie4", "h100-sxm5"]),
)
def test_eager_never_cheaper(n: int, context: int, hw: str) -> None:
    """Eager attention never costs less than fused, and grows with the context."""
    cm = cost_model(hw, MIXTRAL)
    eager = cm.nonexpert_layer_s(n, context, eager_attention=True)
    assert eager >= cm.nonexpert_layer_s(n, context)
    assert cm.nonexpert_layer_s(n, context + 1000, eager_attention=True) > eager


def test_eager_needs_the_head_count() -> None:
    """A model without ``attention_heads`` cannot be charged eager attention (no silent 0)."""
    headless = dataclasses.replace(MIXTRAL, name="headless", attention_heads=0)
    cm = CostModel(load_profile("a6000-pcie4"), headless)
    assert cm.nonexpert_layer_s(16, 0) > 0  # fused needs no head count
    with pytest.raises(UserError, match="attention_heads"):
        cm.nonexpert_layer_s(16, 0, eager_attention=True)


def test_machine_charges_eager_only_under_an_eager_runtime() -> None:
    """The machine's non-expert time follows its runtime's ``attention`` field."""
    from daopsim.policies.base import ResourceSpec

    cm = cost_model("rtx6000ada-pcie4", MIXTRAL)
    spec = ResourceSpec()
    eager = Machine(cm, spec, get_runtime("hf-eager-attn"))
    fused = Machine(cm, spec, get_runtime("hf-eager"))
    none = Machine(cm, spec, None)
    assert eager.nonexpert_s(2048, 0) == cm.nonexpert_layer_s(2048, 0, eager_attention=True)
    assert fused.nonexpert_s(2048, 0) == cm.nonexpert_layer_s(2048, 0)
    assert none.nonexpert_s(2048, 0) == fused.nonexpert_s(2048, 0)
    assert eager.nonexpert_s(2048, 0) > 5 * fused.nonexpert_s(2048, 0)


def test_runtime_attention_field() -> None:
    """Only hf-eager-attn declares eager attention; it keeps hf-eager's host costs and says why."""
    eager = {n for n in runtime_names() if get_runtime(n).attention == "eager"}
    assert eager == {"hf-eager-attn"}
    prof, base = get_runtime("hf-eager-attn"), get_runtime("hf-eager")
    for f in ("dispatch_us", "sync_us", "expert_kernels", "routing_syncs", "expert_syncs"):
        assert getattr(prof, f) == getattr(base, f)
    assert prof.nonexpert_kernels == base.nonexpert_kernels - 1 + 7  # SDPA -> 7 eager ops
    assert "4.36.1" in prof.sources["attention"]
    assert prof.to_dict()["attention"] == "eager"
    with pytest.raises(UserError, match="attention"):
        parse_runtime({"name": "x", "attention": "flash"}, "x.toml")


def test_model_heads_round_trip() -> None:
    """Preset trace metadata stays byte-identical (no new key) and round-trips to the preset,
    metadata written before the field gets the preset's heads, and a custom count survives."""
    for m in PRESETS.values():
        d = m.to_dict()
        assert "attention_heads" not in d
        assert ModelShape.from_dict(d) == m
    assert ModelShape.from_dict(MIXTRAL.to_dict()).attention_heads == 32
    custom = dataclasses.replace(MIXTRAL, attention_heads=16)
    assert custom.to_dict()["attention_heads"] == 16
    assert ModelShape.from_dict(custom.to_dict()) == custom
    other = dataclasses.replace(MIXTRAL, name="not-a-preset")
    assert ModelShape.from_dict(other.to_dict()).attention_heads == 32


def test_runtimes_show_prints_the_attention_field() -> None:
    """``runtimes show`` prints the attention implementation and its source; JSON carries it."""
    import json

    from click.testing import CliRunner

    from daopsim.simulator.cli import main

    res = CliRunner().invoke(main, ["runtimes", "show", "hf-eager-attn"])
    assert res.exit_code == 0
    line = next(x for x in res.output.splitlines() if x.split()[:1] == ["attention"])
    assert line.split()[1] == "eager"
    assert "4.36.1" in res.output
    res = CliRunner().invoke(main, ["runtimes", "show", "hf-eager", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["attention"] == "fused"


#: ``num_attention_heads`` (T5-style configs: ``num_heads``) of each preset's config.json, as
#: docs/references.md ("Models", Query heads) cites them; a new preset must be added here
CONFIG_QUERY_HEADS = {
    "mixtral-8x7b": 32,
    "mixtral-8x22b": 48,
    "phi-3.5-moe": 32,
    "olmoe-1b-7b": 16,
    "qwen1.5-moe-a2.7b": 16,
    "qwen3-30b-a3b": 32,
    "deepseek-v2-lite": 16,
    "deepseek-v3": 128,
    "deepseek-v2": 128,
    "qwen2-57b-a14b": 28,
    "qwen3-235b-a22b": 64,
    "qwen3-next-80b-a3b": 16,
    "llama-4-scout": 40,
    "llama-4-maverick": 40,
    "kimi-k2": 64,
    "gpt-oss-20b": 64,
    "gpt-oss-120b": 64,
    "switch-base-128": 12,
    "switch-large-128": 16,
    "switch-large-128-decoder": 16,
}


def test_every_preset_has_its_configs_query_heads() -> None:
    """Every catalogue model records a positive head count, its config's, that splits its hidden
    size into whole heads (GPT-OSS and Qwen3 set head_dim apart, but it still divides)."""
    assert set(PRESETS) == set(CONFIG_QUERY_HEADS)
    for name, m in PRESETS.items():
        assert m.attention_heads == CONFIG_QUERY_HEADS[name] > 0, name
        assert m.hidden % m.attention_heads == 0, name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_an_eager_runtime_charges_every_preset(name: str) -> None:
    """No preset is refused or charged nothing: a 512-token prompt's eager scores are exactly
    heads x n x n per block, and the eager non-expert part is slower than the fused one.
    MLA models (DeepSeek, Kimi) included: each query head still scores every key."""
    m = get_model(name)
    prof = load_profile("a100-80g-pcie4")
    cm = CostModel(prof, m)
    blocks = m.layers / m.moe_layers
    assert cm.eager_attention_scores(512, 0) == pytest.approx(
        m.attention_heads * 512 * 512 * blocks
    )
    assert cm.nonexpert_layer_s(512, 0, eager_attention=True) > cm.nonexpert_layer_s(512, 0)


def test_trace_metadata_written_before_the_heads_gets_the_presets() -> None:
    """A DeepSeek-V3 shape written without the field (every trace before it) loads with the
    preset's 128 heads, and the preset still writes no new key (committed traces unchanged)."""
    dsv3 = get_model("deepseek-v3")
    old = {k: v for k, v in dsv3.to_dict().items() if k != "attention_heads"}
    assert "attention_heads" not in dsv3.to_dict()
    assert ModelShape.from_dict(old).attention_heads == 128
    assert ModelShape.from_dict(old) == dsv3


def test_mixtral_offloading_defaults_to_eager_attention_on_any_catalogue_trace(tmp_path) -> None:
    """mixtral-offloading declares hf-eager-attn (transformers 4.36.1, its pin) and so runs on a
    non-Mixtral trace (DeepSeek-V2-Lite: MLA, 64 experts) without an error; the same run on the
    fused hf-eager pays less for the prompt, since only the attention charge differs."""
    from daopsim.policies.registry import get_policy_class
    from daopsim.simulator.runner import simulate
    from daopsim.simulator.testing import make_trace

    assert get_policy_class("mixtral-offloading").runtime_profile == "hf-eager-attn"
    path = make_trace(tmp_path / "dsv2lite.parquet", "deepseek-v2-lite", prefill=64, decode=4)
    kw = dict(policy="mixtral-offloading", hw="a6000-pcie4", trace=path, gpu_experts=26 * 8,
              calibration="none", record=False)  # fmt: skip
    eager = simulate(**kw)
    assert eager.config["runtime"]["name"] == "hf-eager-attn"
    fused = simulate(**kw, runtime="hf-eager")
    assert eager.metrics["ttft_s"] > fused.metrics["ttft_s"]
    assert eager.metrics["gpu_nonexpert_s"] > fused.metrics["gpu_nonexpert_s"]


def test_mixtral_offloading_on_a_headless_trace_is_one_line_error(tmp_path) -> None:
    """A trace whose model records no heads (hand-built, or captured before the field) is refused
    by mixtral-offloading's eager default with one error line naming the field, exit 2; the
    fused runtime still runs it."""
    from click.testing import CliRunner

    from daopsim.simulator.cli import main
    from daopsim.simulator.testing import make_trace, tiny_model

    headless = dataclasses.replace(tiny_model(), name="headless", attention_heads=0)
    path = str(make_trace(tmp_path / "headless.parquet", headless))
    args = ["run", "--policy", "mixtral-offloading", "--trace", path, "--no-bounds"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2
    assert "attention_heads" in res.output and "Traceback" not in res.output
    assert len([ln for ln in res.output.splitlines() if ln.startswith("error")]) == 1
    assert CliRunner().invoke(main, [*args, "--runtime", "hf-eager"]).exit_code == 0


#: each preset config.json's query/key and value head widths (``head_dim``; DeepSeek-V2/V3 and
#: Kimi-K2's MLA: ``qk_nope_head_dim + qk_rope_head_dim`` and ``v_head_dim``; T5's ``d_kv``),
#: as docs/references.md ("Models") cites them
CONFIG_HEAD_DIMS = {
    "mixtral-8x7b": (128, 128),
    "mixtral-8x22b": (128, 128),
    "phi-3.5-moe": (128, 128),
    "olmoe-1b-7b": (128, 128),
    "qwen1.5-moe-a2.7b": (128, 128),
    "qwen3-30b-a3b": (128, 128),
    "deepseek-v2-lite": (192, 128),
    "deepseek-v3": (192, 128),
    "deepseek-v2": (192, 128),
    "qwen2-57b-a14b": (128, 128),
    "qwen3-235b-a22b": (128, 128),
    "qwen3-next-80b-a3b": (256, 256),
    "llama-4-scout": (128, 128),
    "llama-4-maverick": (128, 128),
    "kimi-k2": (192, 128),
    "gpt-oss-20b": (64, 64),
    "gpt-oss-120b": (64, 64),
    "switch-base-128": (64, 64),
    "switch-large-128": (64, 64),
    "switch-large-128-decoder": (64, 64),
}


def test_every_preset_has_its_configs_head_widths() -> None:
    """The attention width is the mean of the query/key and value widths over the heads:
    Qwen3's 32 heads of 128 are twice its hidden size, GPT-OSS's 64 of 64 exceed its 2880."""
    assert set(PRESETS) == set(CONFIG_HEAD_DIMS)
    for name, m in PRESETS.items():
        qk, v = CONFIG_HEAD_DIMS[name]
        assert (m.head_dim, m.v_head_dim or m.head_dim) == (qk, v), name
        assert m.attention_width == m.attention_heads * (qk + v) / 2, name
    assert get_model("qwen3-30b-a3b").attention_width == 2 * 2048
    assert get_model("deepseek-v2-lite").attention_width == 16 * (192 + 128) / 2
    assert get_model("mixtral-8x7b").attention_width == 4096  # its heads fill its hidden size
    # a hand-built shape without widths keeps the hidden size
    assert dataclasses.replace(MIXTRAL, head_dim=0).attention_width == MIXTRAL.hidden


def test_a_prompts_attention_flops_use_the_head_widths() -> None:
    """A compute-bound prompt's non-expert part: Qwen3-30B-A3B's 4096-wide attention costs
    exactly ``4 x (4096 - 2048) x pairs`` FLOPs more than a 2048-wide one would (hand-derived
    from the formula of docs/cost-model.md, "The costs")."""
    qwen = get_model("qwen3-30b-a3b")
    narrow = dataclasses.replace(qwen, name="qwen3-narrow", head_dim=64)  # 32 x 64 = hidden
    assert narrow.attention_width == 2048
    prof = load_profile("a100-80g-pcie4")
    wide, thin = CostModel(prof, qwen), CostModel(prof, narrow)
    n = 4096
    pairs = n * (n + 1) / 2
    extra = 4.0 * (4096 - 2048) * pairs / (prof.gpu.bf16_tflops * 1e12)  # one block per layer
    assert wide.nonexpert_layer_s(n, 0) - thin.nonexpert_layer_s(n, 0) == pytest.approx(extra)
    # the same on the CPU (ggml-free default kernels: the profile's bf16 rate)
    cpu = extra * prof.gpu.bf16_tflops * 1e12 / (wide.cpu_peak_gflops("bf16") * 1e9)
    assert wide.cpu_nonexpert_layer_s(n, 0) - thin.cpu_nonexpert_layer_s(n, 0) == pytest.approx(cpu)


def test_model_head_widths_round_trip() -> None:
    """Preset metadata carries no width key (bundled and cached traces stay byte-identical),
    metadata written before the fields reads back the preset's widths, a custom width
    survives."""
    for m in PRESETS.values():
        d = m.to_dict()
        assert "head_dim" not in d and "v_head_dim" not in d
        assert ModelShape.from_dict(d) == m
    old = {k: v for k, v in get_model("qwen3-30b-a3b").to_dict().items()}
    assert ModelShape.from_dict(old).attention_width == 4096
    custom = dataclasses.replace(get_model("qwen3-30b-a3b"), head_dim=96)
    assert custom.to_dict()["head_dim"] == 96
    assert ModelShape.from_dict(custom.to_dict()) == custom
