"""``daopsim advise``: the ranked table, reproducible commands, the fidelity floor, JSON, errors."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from daopsim.simulator.advise import Advice, AdviceRow, advise, bottleneck, find_trace
from daopsim.simulator.errors import UserError
from daopsim.simulator.sweep import fidelity_floor

#: A small search: Mixtral on the A6000 (it holds about half the experts in bf16), the small
#: bundled trace, a caching policy, the approximate DAOP and the all-GPU bound.
SMALL = ["--model", "mixtral-8x7b", "--hw", "a6000-pcie4", "--trace", "ci-small"]
SMALL += ["--policies", "lru,daop,all-gpu", "--dtype", "bf16,int4_g128", "--workers", "1"]


def _small_search(min_gate_mass: float | None = None) -> Advice:
    """The search of SMALL, from Python."""
    return advise(
        "mixtral-8x7b",
        "a6000-pcie4",
        trace="ci-small",
        dtypes=["bf16", "int4_g128"],
        policies=["lru", "daop", "all-gpu"],
        workers=1,
        min_gate_mass=min_gate_mass,
    )


@pytest.fixture(scope="module")
def small() -> Advice:
    """The small search, run once."""
    return _small_search()


def test_ranked_by_tokens_per_s(small: Advice) -> None:
    rates = [r.tokens_per_s for r in small.rows]
    assert len(rates) >= 4
    assert rates == sorted(rates, reverse=True)
    assert [r.rank for r in small.rows] == list(range(1, len(rates) + 1))
    # both precisions and both memory points were searched
    assert {r.dtype for r in small.rows} == {"bf16", "int4_g128"}
    assert len({(r.dtype, r.gpu_experts) for r in small.rows}) >= 3


def test_bounds_are_reference_lines_not_advice(small: Advice) -> None:
    assert all(r.policy != "all-gpu" for r in small.rows)
    assert {r.policy for r in small.references} == {"all-gpu"}
    assert all(r.rank is None and r.reference for r in small.references)


def test_every_command_reproduces_its_row(small: Advice, cli: Callable[..., Any]) -> None:
    for row in [*small.rows, *small.references]:
        args = shlex.split(row.command)
        assert args[:2] == ["daopsim", "run"]
        res = cli(*args[1:], "--json", "--no-bounds")
        assert res.exit_code == 0, res.output
        m = json.loads(res.stdout)["metrics"]
        assert m["tokens_per_s"] == pytest.approx(row.tokens_per_s, rel=1e-12), row.command
        assert m["ttft_s"] == pytest.approx(row.ttft_s, rel=1e-12)
        assert m["gate_mass_preserved"] == pytest.approx(row.gate_mass_preserved, rel=1e-12)


def test_fidelity_floor_drops_approximate_rows(small: Advice) -> None:
    daop = [r for r in small.rows if r.policy == "daop"]
    assert daop and all(r.gate_mass_preserved < 1 for r in daop)  # DAOP replaces routing
    floor = max(r.gate_mass_preserved for r in daop) + 1e-6
    kept = _small_search(min_gate_mass=floor)
    assert not [r for r in kept.rows if r.policy == "daop"]
    assert kept.below_floor == len(daop)
    assert [r.command for r in kept.rows] == [r.command for r in small.rows if r.policy != "daop"]


def test_json_schema(cli: Callable[..., Any]) -> None:
    res = cli("advise", *SMALL, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(doc) == {
        "model",
        "hw",
        "trace",
        "trace_synth",
        "sequences",
        "min_gate_mass",
        "rows",
        "references",
        "skipped",
        "failed",
        "below_floor",
    }
    fields = set(AdviceRow.__dataclass_fields__)
    assert doc["rows"] and all(set(r) == fields for r in doc["rows"] + doc["references"])
    assert doc["model"] == "mixtral-8x7b" and doc["hw"] == "a6000-pcie4"
    assert {r["bottleneck"] for r in doc["rows"]} <= {"link", "CPU", "GPU", "memory"}
    assert all(r["bound_tokens_per_s"] >= r["tokens_per_s"] for r in doc["rows"])
    text = cli("advise", *SMALL, "--top", "0")
    assert text.exit_code == 0
    # the text lists the same rows' commands, in the same order (wrapped with continuations)
    assert [shlex.join(shlex.split(c)) for c in _text_commands(text.stdout)] == [
        r["command"] for r in doc["rows"] + doc["references"]
    ]


def _text_commands(text: str) -> list[str]:
    """The commands under ``commands:`` in advise's text, continuation lines joined."""
    body = text.split("\ncommands:\n", 1)[1]
    joined = body.replace(" \\\n", " ")
    return [ln.split(None, 1)[1] for ln in joined.splitlines() if ln.strip()]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "no-such-model", "--hw", "a6000-pcie4"], "unknown model"),
        (["--model", "mixtral-8x7b", "--hw", "no-such-machine"], "no-such-machine"),
        (["--model", "qwen3-30b-a3b", "--hw", "a6000-pcie4", "--trace", "ci-small"], "records"),
        ([*SMALL[:6], "--policies", "nope"], "unknown policy"),
        ([*SMALL[:6], "--dtype", "bf17"], "bf17"),
        ([*SMALL[:6], "--min-gate-mass", "1.5"], "min-gate-mass"),
    ],
)
def test_bad_input_is_one_error_line(cli: Callable[..., Any], args: list[str], needle: str) -> None:
    res = cli("advise", *args)
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in res.output


def test_synthetic_trace_for_a_model_without_a_bundled_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DAOPSIM_CACHE", str(tmp_path))
    path, args = find_trace("qwen3-30b-a3b", None)
    # the command names the model, not the cache file: `run --model` makes the same trace
    assert Path(path).is_relative_to(tmp_path) and args == ["--model", "qwen3-30b-a3b"]
    from daopsim.simulator.trace_cache import model_trace

    assert model_trace("qwen3-30b-a3b", None) == path
    assert find_trace("qwen3-30b-a3b", None) == (path, args)  # cached: the same file
    assert find_trace("mixtral-8x7b", None)[1] == ["--trace", "mixtral-8x7b"]
    from daopsim.simulator.models import PRESETS as MODELS
    from daopsim.simulator.synth import PRESETS

    bare = sorted(set(MODELS) - {p.model for p in PRESETS.values()})
    if bare:  # a model with neither a bundled trace nor a synth preset: a clear error
        with pytest.raises(UserError, match="no bundled trace or synth preset"):
            find_trace(bare[0], None)


def test_bottleneck_rule() -> None:
    row = {"h2d_busy_frac": 0.9, "cpu_busy_frac": 0.2, "gpu_busy_frac": 0.3}
    assert bottleneck(row, unified=False) == "link"
    assert bottleneck(row, unified=True) == "memory"
    assert bottleneck({**row, "cpu_busy_frac": 0.95}, unified=False) == "CPU"
    assert (
        bottleneck({"h2d_busy_frac": 0.0, "cpu_busy_frac": 0.0, "gpu_busy_frac": 0.0}, False)
        == "GPU"
    )


def test_sweep_floor_keeps_skipped_and_failed_rows() -> None:
    df = pd.DataFrame(
        {
            "status": ["ok", "ok", "skipped", "error"],
            "gate_mass_preserved": [1.0, 0.9, None, None],
        }
    )
    kept, dropped = fidelity_floor(df, 0.95)
    assert dropped == 1 and list(kept["status"]) == ["ok", "skipped", "error"]
    assert fidelity_floor(df, None)[1] == 0
    with pytest.raises(UserError, match="min-gate-mass"):
        fidelity_floor(df, -0.1)


def test_integer_options_keep_their_type_in_commands(cli: Callable[..., Any]) -> None:
    """A table column shared by several policies comes back as float; commands must not."""
    found = advise(
        "mixtral-8x7b",
        "a6000-pcie4",
        trace="ci-small",
        dtypes=["bf16"],
        policies=["static", "llama-cpp-cpu-moe"],
        workers=1,
    )
    rows = [r for r in found.rows if r.policy == "llama-cpp-cpu-moe"]
    assert rows
    for row in rows:
        assert isinstance(row.options["n_cpu_moe"], int)
        assert f"n_cpu_moe={row.options['n_cpu_moe']}" in row.command
        assert ".0" not in row.command.split("n_cpu_moe=")[1].split()[0]
        res = cli(*shlex.split(row.command)[1:], "--json", "--no-bounds")
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["metrics"]["tokens_per_s"] == pytest.approx(
            row.tokens_per_s, rel=1e-12
        )


def test_a_readable_table(small: Advice, cli: Callable[..., Any]) -> None:
    """--top (default 10, 0: all), an options column, lines that fit the width, every row in
    --csv; the synth command of a synthetic trace is one a user can run anywhere."""
    from daopsim.simulator.advise import DEFAULT_TOP, render, to_csv

    text = render(small, top=2, width=90)
    lines = text.splitlines()
    head = next(ln for ln in lines if "tokens/s" in ln and "options" in ln)
    start = lines.index(head)
    table = lines[start : start + 3]
    assert [ln.split()[0] for ln in table[1:]] == ["1", "2"]
    assert all(len(ln) <= 90 for ln in lines if not ln.startswith("     "))
    assert f"{len(small.rows) - 2} more ranked rows" in text and "--top 0" in text
    assert DEFAULT_TOP == 10
    assert all(r.command not in text for r in small.rows[2:])
    csv = to_csv(small)
    assert len(csv.strip().splitlines()) == 1 + len(small.rows) + len(small.references)
    assert "options" in csv.splitlines()[0] and "bound_tokens_per_s" in csv.splitlines()[0]
    res = cli("advise", *SMALL, "--csv")
    assert res.exit_code == 0 and res.stdout == csv


def test_options_tell_rows_apart() -> None:
    found = advise(
        "mixtral-8x7b",
        "a6000-pcie4",
        trace="ci-small",
        dtypes=["bf16"],
        policies=["llama-cpp-cpu-moe"],
        workers=1,
    )
    from daopsim.simulator.advise import render

    texts = [r.options_text for r in found.rows]
    # rows differing only in an option read apart: no two shown rows alike
    shown = [(r.options_text, r.dtype, r.gpu_experts) for r in found.rows]
    assert len(set(texts)) >= 2 and len(set(shown)) == len(shown)
    assert all(t.startswith("n_cpu_moe=") for t in texts)
    table = render(found, top=0)
    for t in texts:
        assert t in table
