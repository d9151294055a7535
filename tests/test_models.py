"""Model presets and `daopsim models list|show`."""

from __future__ import annotations

import json

import pytest

from daopsim.simulator.errors import UserError
from daopsim.simulator.models import PRESETS, get_model

REQUIRED = {
    "mixtral-8x7b",
    "mixtral-8x22b",
    "phi-3.5-moe",
    "olmoe-1b-7b",
    "qwen1.5-moe-a2.7b",
    "qwen3-30b-a3b",
    "deepseek-v2-lite",
    "deepseek-v3",
    "gpt-oss-20b",
    "gpt-oss-120b",
    "switch-base-128",
    "switch-large-128",
    "switch-large-128-decoder",
    "deepseek-v2",
    "qwen2-57b-a14b",
    "qwen3-235b-a22b",
    "qwen3-next-80b-a3b",
    "llama-4-scout",
    "llama-4-maverick",
    "kimi-k2",
}

#: config.json sizes of the issue-16 presets: (layers, MoE layers, first MoE layer, hidden,
#: expert FFN, routed experts, top-k, shared experts, shared FFN), docs/references.md#models.
CONFIGS = {
    "deepseek-v2": (60, 59, 1, 5120, 1536, 160, 6, 2, 1536),
    "deepseek-v3": (61, 58, 3, 7168, 2048, 256, 8, 1, 2048),
    "qwen2-57b-a14b": (28, 28, 0, 3584, 2560, 64, 8, 1, 20480),
    "qwen3-235b-a22b": (94, 94, 0, 4096, 1536, 128, 8, 0, 0),
    "qwen3-next-80b-a3b": (48, 48, 0, 2048, 512, 512, 10, 1, 512),
    "llama-4-scout": (48, 48, 0, 5120, 8192, 16, 1, 1, 8192),
    "llama-4-maverick": (48, 24, 1, 5120, 8192, 128, 1, 1, 8192),
    "gpt-oss-20b": (24, 24, 0, 2880, 2880, 32, 4, 0, 0),
    "gpt-oss-120b": (36, 36, 0, 2880, 2880, 128, 4, 0, 0),
    "kimi-k2": (61, 60, 1, 7168, 2048, 384, 8, 1, 2048),
    # flaxformer switch_large.gin: 24 + 24 blocks, every other FFN sparse, 1024 / 4096, 128 x top-1
    "switch-large-128": (48, 24, 0, 1024, 4096, 128, 1, 0, 0),
    "switch-large-128-decoder": (24, 12, 0, 1024, 4096, 128, 1, 0, 0),
}
#: Published total parameters (billions) and the tolerance the preset must meet: the model
#: cards' and papers' figures (docs/references.md#models). Llama-4-Scout's 109 B includes its
#: vision encoder, which the text-only preset leaves out.
PUBLISHED_TOTAL_B = {
    "deepseek-v2": (236.0, 0.01),
    "deepseek-v3": (671.0, 0.01),
    "qwen2-57b-a14b": (57.0, 0.01),
    "qwen3-235b-a22b": (235.0, 0.01),
    "qwen3-next-80b-a3b": (79.674391296, 0.001),
    "llama-4-scout": (109.0, 0.02),
    "llama-4-maverick": (400.0, 0.01),
    "gpt-oss-20b": (20.9, 0.01),
    "gpt-oss-120b": (116.8, 0.01),
    "kimi-k2": (1040.0, 0.02),
}


def test_required_presets() -> None:
    """Every model the issue names has a preset."""
    assert set(PRESETS) >= REQUIRED


@pytest.mark.parametrize(
    ("name", "mb"),
    [  # bf16 MB per expert, docs/references.md#models
        ("mixtral-8x7b", 352.3),
        ("mixtral-8x22b", 604.0),
        ("phi-3.5-moe", 157.3),
        ("olmoe-1b-7b", 12.6),
        ("qwen1.5-moe-a2.7b", 17.3),
        ("qwen3-30b-a3b", 9.4),
        ("deepseek-v2-lite", 17.3),
        ("deepseek-v3", 88.1),
        ("gpt-oss-20b", 49.8),
        ("switch-base-128", 9.4),
        ("switch-large-128", 16.8),
        ("switch-large-128-decoder", 16.8),
    ],
)
def test_expert_bytes_match_reference(name: str, mb: float) -> None:
    """bf16 bytes per expert agree with docs/references.md#models to its printed precision."""
    assert get_model(name).expert_bytes("bf16") / 1e6 == pytest.approx(mb, abs=0.06)


def test_mxfp4_gpt_oss() -> None:
    """GPT-OSS experts are 13.2 MB in MXFP4 as shipped (docs/references.md#models)."""
    assert get_model("gpt-oss-20b").expert_bytes("mxfp4") / 1e6 == pytest.approx(13.2, abs=0.05)
    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        model = get_model(name)
        assert (model.dtype, model.nonexpert_dtype) == ("mxfp4", "bf16")
        assert model.expert_bytes() == model.expert_bytes("mxfp4")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_sizes(name: str) -> None:
    """Each preset carries its config.json's layer, width, expert and routing sizes."""
    m = get_model(name)
    got = (
        m.layers,
        m.moe_layers,
        m.first_moe_layer,
        m.hidden,
        m.expert_ffn,
        m.experts,
        m.top_k,
        m.shared_experts,
        m.shared_expert_ffn,
    )
    assert got == CONFIGS[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTAL_B))
def test_total_params_match_the_published_total(name: str) -> None:
    """Routed experts plus non-expert parameters come within 1-2 % of the published total."""
    total, tol = PUBLISHED_TOTAL_B[name]
    assert get_model(name).total_params / 1e9 == pytest.approx(total, rel=tol)


def test_shared_experts_are_counted_in_the_non_expert_part() -> None:
    """A shared expert runs for every token: its weights are in the per-token non-expert bytes."""
    for model in PRESETS.values():
        shared = model.shared_expert_params * model.moe_layers
        assert shared <= model.non_expert_params - model.embedding_params
    v3 = get_model("deepseek-v3")
    assert v3.shared_expert_params == 3 * 7168 * 2048
    maverick = get_model("llama-4-maverick")
    assert maverick.shared_expert_params == 3 * 5120 * 8192
    # one decode token reads the shared experts of all 24 MoE layers
    assert maverick.non_expert_bytes_read_per_token("bf16") > 2 * 24 * 3 * 5120 * 8192


def test_qwen3_next_active_params() -> None:
    """Qwen3-Next-80B-A3B: 3.87 B active (10 routed + 1 shared expert of FFN 512 per layer)."""
    assert get_model("qwen3-next-80b-a3b").active_params / 1e9 == pytest.approx(3.875, abs=0.01)


def test_unknown_model() -> None:
    """An unknown name lists the presets."""
    with pytest.raises(UserError, match="mixtral-8x7b"):
        get_model("mixtral")


def test_models_list_json(cli) -> None:
    """`models list --json` returns every preset's summary."""
    result = cli("models", "list", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert {r["name"] for r in rows} == set(PRESETS)
    mix = next(r for r in rows if r["name"] == "mixtral-8x7b")
    assert mix["expert_bytes"]["bf16"] == 352_321_536


def test_models_list_table(cli) -> None:
    """`models list` prints a header and one row per preset."""
    result = cli("models", "list")
    assert result.exit_code == 0
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("NAME") and len(lines) == 1 + len(PRESETS)


def test_models_show(cli) -> None:
    """`models show NAME --json` is ModelShape.summary(); the table names the fields."""
    result = cli("models", "show", "phi-3.5-moe", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == json.loads(json.dumps(get_model("phi-3.5-moe").summary()))
    assert json.loads(result.stdout)["attention_heads"] == 32  # shown although metadata omits it
    table = cli("models", "show", "Phi-3.5-MoE")
    assert table.exit_code == 0 and "157,286,400" in table.stdout


def test_models_show_unknown(cli) -> None:
    """An unknown model exits 2 with one line."""
    result = cli("models", "show", "nope")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: unknown model")


def test_switch_large_decoder_is_the_decoder_half() -> None:
    """The decode-time preset: the same experts, half the MoE layers, less of the rest."""
    whole, dec = get_model("switch-large-128"), get_model("switch-large-128-decoder")
    assert dec.expert_bytes() == whole.expert_bytes()
    assert 2 * dec.total_experts == whole.total_experts
    # the decoder holds the embedding and more attention (self + cross) than the encoder
    assert whole.non_expert_params / 2 < dec.non_expert_params < whole.non_expert_params
    assert dec.kv_bytes_per_token == whole.kv_bytes_per_token
