"""Model presets and `daopsim models list|show`."""

from __future__ import annotations

import json

import pytest

from simulator.errors import UserError
from simulator.models import PRESETS, get_model

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
    ],
)
def test_expert_bytes_match_reference(name: str, mb: float) -> None:
    """bf16 bytes per expert agree with docs/references.md#models to its printed precision."""
    assert get_model(name).expert_bytes("bf16") / 1e6 == pytest.approx(mb, abs=0.06)


def test_mxfp4_gpt_oss() -> None:
    """GPT-OSS experts are 13.2 MB in MXFP4 as shipped (docs/references.md#models)."""
    assert get_model("gpt-oss-20b").expert_bytes("mxfp4") / 1e6 == pytest.approx(13.2, abs=0.05)


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
    table = cli("models", "show", "Phi-3.5-MoE")
    assert table.exit_code == 0 and "157,286,400" in table.stdout


def test_models_show_unknown(cli) -> None:
    """An unknown model exits 2 with one line."""
    result = cli("models", "show", "nope")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: unknown model")
