"""``daopsim advise``: the search space, the ranked table, ties, fidelity, runtimes, several
machines and a target, reproducible commands, JSON/CSV and errors."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from cli_checks import one_error

from daopsim.simulator.advise import advise, find_trace
from daopsim.simulator.advise_answer import Advice, AdviceRow, bottleneck, exact_precision
from daopsim.simulator.advise_render import render, to_csv
from daopsim.simulator.advise_search import coarse
from daopsim.simulator.errors import UserError
from daopsim.simulator.sweep_table import fidelity_floor

#: A small search: Mixtral on the A6000 (it holds about half the experts in bf16, all of them
#: in q4_k_m), the small bundled trace, three per-layer caches, DAOP, llama.cpp's --n-cpu-moe
#: (a searched range) and two bounds.
POLICIES = ["lru", "lfu", "round-robin", "daop", "llama-cpp-cpu-moe", "all-gpu", "belady"]
SMALL = ["--model", "mixtral-8x7b", "--hw", "a6000-pcie4", "--trace", "ci-small"]
SMALL += ["--policies", ",".join(POLICIES), "--dtype", "bf16,q4_k_m", "--sequences", "1"]
SMALL += ["--workers", "1", "--no-progress"]


def _small_search(**kw: Any) -> Advice:
    """The search of SMALL, from Python."""
    return advise(
        "mixtral-8x7b",
        "a6000-pcie4",
        trace="ci-small",
        dtypes=["bf16", "q4_k_m"],
        policies=POLICIES,
        workers=1,
        sequences=1,
        **kw,
    )


@pytest.fixture(scope="module")
def small() -> Advice:
    """The small search, run once."""
    return _small_search()


def _members(a: Advice) -> list[dict[str, Any]]:
    """Every ranked configuration, tie groups expanded: policy, options, ratio, command."""
    out = []
    for r in a.rows:
        out.append(
            {
                "policy": r.policy,
                "options": r.options,
                "cache_ratio": r.cache_ratio,
                "command": r.command,
                "dtype": r.dtype,
            }
        )
        out += [{**t, "dtype": r.dtype} for t in r.tied]
    return out


def test_ranked_by_tokens_per_s(small: Advice) -> None:
    rates = [r.tokens_per_s for r in small.rows]
    assert len(rates) >= 10
    assert rates == sorted(rates, reverse=True)
    assert [r.rank for r in small.rows] == list(range(1, len(rates) + 1))
    assert {r.dtype for r in small.rows} == {"bf16", "q4_k_m"}
    # both memory points were searched where the budget matters (bf16: 123 of 256 fit)
    lru = [r for r in _members(small) if r["policy"] == "lru" and r["dtype"] == "bf16"]
    assert {m["cache_ratio"] for m in lru} == {None, 0.25}


def test_bounds_are_reference_lines_not_advice(small: Advice) -> None:
    assert all(m["policy"] not in ("all-gpu", "belady") for m in _members(small))
    assert {r.policy for r in small.references} == {"all-gpu", "belady"}
    assert all(r.rank is None and r.reference for r in small.references)
    assert all(r.tokens_per_s <= r.bound_tokens_per_s * (1 + 1e-12) for r in small.rows)


def test_every_default_and_listed_value_is_searched(small: Advice) -> None:
    """Each option's default and each value `policies list` lists, one option at a time."""
    from daopsim.policies.registry import get_policy_class
    from daopsim.simulator.advise_search import listed_values

    for policy in ("lru", "daop"):
        cls = get_policy_class(policy)
        found = [m["options"] for m in _members(small) if m["policy"] == policy]
        found += [{}] if policy == "lru" else []  # lru's defaults may tie into another policy
        for name, param in cls.params.items():
            for value in listed_values(param):
                assert {name: value} in found, (policy, name, value)
        assert {} in found or any(
            t["policy"] == policy and not t["options"] for r in small.rows for t in r.tied
        )


def test_a_searched_range_is_covered_and_refined(small: Advice) -> None:
    """n_cpu_moe (0..32 blocks) on the coarse grid, then every value next to the best: at
    q4_k_m everything fits, so 0 (no block on the CPU) is best and 1..3 were tried too."""
    tried = {
        m["options"].get("n_cpu_moe", -1)
        for m in _members(small)
        if m["policy"] == "llama-cpp-cpu-moe" and m["dtype"] == "q4_k_m"
        and m["cache_ratio"] is None
    }  # fmt: skip
    assert set(coarse(0, 32)) <= tried | {32}  # 32 blocks = -1 (all): the same row, tied
    assert {0, 1, 2, 3, 4} <= tried
    best = next(r for r in small.rows if r.policy == "llama-cpp-cpu-moe" and r.dtype == "q4_k_m")
    assert best.options.get("n_cpu_moe") == 0
    assert coarse(0, 48) == [0, 6, 12, 18, 24, 30, 36, 42, 48]
    assert coarse(0, 5) == [0, 1, 2, 3, 4, 5]


def test_ties_are_grouped_with_a_reason(small: Advice) -> None:
    """At q4_k_m every expert fits the A6000: lru, lfu and round-robin keep all 256 resident
    and give one result, printed once with the reason."""
    top = next(r for r in small.rows if r.dtype == "q4_k_m" and r.policy in ("lru", "lfu"))
    names = {top.policy} | {t["policy"] for t in top.tied}
    assert {"lru", "lfu", "round-robin"} <= names
    assert top.tie_reason == "every expert fits and stays resident: the policy does not matter"
    assert top.resident_experts == 256
    keys = [
        (r.hw, r.dtype, r.runtime, r.tokens_per_s, r.ttft_s, r.gate_mass_preserved)
        for r in small.rows
    ]
    assert len(keys) == len(set(keys))  # no two ranked rows alike
    text = render(small, top=0, width=100)
    assert f"{top.policy} +{len(top.tied)}" in text
    assert "tied with" in text and "the policy does not matter" in text


def test_fidelity_counts_quantisation(small: Advice) -> None:
    assert exact_precision("bf16", "bf16") and exact_precision("fp32", "bf16")
    assert not exact_precision("q8_0", "bf16") and not exact_precision("fp8", "bf16")
    assert not exact_precision("int4_g128", "bf16")
    for r in small.rows:
        if r.dtype == "q4_k_m":
            assert r.fidelity == 0.0 and r.gate_mass_preserved and r.gate_mass_preserved > 0.5
        else:
            assert r.fidelity == pytest.approx(r.gate_mass_preserved)
    # at equal speed the exact row ranks first; DAOP replaces routing: below 1 even in bf16
    assert any(r.policy == "daop" and r.dtype == "bf16" and r.fidelity < 1 for r in small.rows)
    text = render(small, top=0, width=100)
    assert "~1.000" in text and "lossy precision" in text


def test_best_row_per_precision(small: Advice) -> None:
    best = {b["dtype"]: b for b in small.best_per_precision}
    assert set(best) == {"bf16", "q4_k_m"}
    for dtype, b in best.items():
        first = next(r for r in small.rows if r.dtype == dtype)
        assert (b["rank"], b["command"], b["tokens_per_s"]) == (
            first.rank,
            first.command,
            first.tokens_per_s,
        )
    assert "best per precision:" in render(small)


def test_every_command_reproduces_its_row(small: Advice, cli: Callable[..., Any]) -> None:
    """The whole printed top 10, its tied configurations and the reference lines."""
    shown = small.rows[:10]
    commands = [(r.command, r) for r in [*shown, *small.references]]
    commands += [(t["command"], r) for r in shown for t in r.tied]
    for command, row in commands:
        _check_reproduces(cli, command, row)


def _check_reproduces(cli: Callable[..., Any], command: str, row: AdviceRow) -> None:
    args = shlex.split(command)
    assert args[:2] == ["daopsim", "run"]
    res = cli(*args[1:], "--json", "--no-bounds", "--no-progress")
    assert res.exit_code == 0, (command, res.output)
    doc = json.loads(res.stdout)
    m = doc["metrics"]
    assert m["tokens_per_s"] == row.tokens_per_s, command
    assert m["ttft_s"] == row.ttft_s, command
    assert m["gate_mass_preserved"] == row.gate_mass_preserved, command
    assert doc["runtime"]["name"] == row.runtime and doc["dtype"] == row.dtype


def test_fidelity_floor_drops_approximate_routing(small: Advice) -> None:
    daop = [m for m in _members(small) if m["policy"] == "daop"]
    kept = _small_search(min_gate_mass=0.999)
    assert kept.below_floor > 0
    assert all(r.gate_mass_preserved >= 0.999 for r in kept.rows)
    survivors = [m for m in _members(kept) if m["policy"] == "daop"]
    # only DAOP configurations that keep the routing exact (exact_fallback=True) survive
    assert daop and all(m["options"].get("exact_fallback") for m in survivors)


def test_runtime_compares_policies_under_one_runtime(cli: Callable[..., Any]) -> None:
    a = advise(
        "mixtral-8x7b",
        "a6000-pcie4",
        trace="ci-small",
        dtypes=["q4_k_m"],
        policies=["lru", "llama-cpp-cpu-moe", "daop"],
        runtimes=["cuda-graph"],
        workers=1,
        sequences=1,
    )
    assert {r.runtime for r in a.rows} == {"cuda-graph"}
    assert all("--runtime cuda-graph" in r.command for r in a.rows)
    assert a.runtimes == ["cuda-graph"]
    for r in a.rows[:3]:
        _check_reproduces(cli, r.command, r)


@pytest.mark.slow
def test_several_machines_and_a_target(cli: Callable[..., Any]) -> None:
    kw: dict[str, Any] = {
        "trace": "ci-small", "dtypes": ["bf16"], "policies": ["lru", "llama-cpp-layers"],
        "workers": 1, "sequences": 1,
    }  # fmt: skip
    both = advise("mixtral-8x7b", ["a6000-pcie4", "rtx4090-pcie4"], **kw)
    assert {r.hw for r in both.rows} == {"a6000-pcie4", "rtx4090-pcie4"}
    assert all(f"--hw {r.hw} " in r.command for r in both.rows)
    best = {m.hw: m.best_tokens_per_s for m in both.machines}
    for h, tps in best.items():
        assert tps == max(r.tokens_per_s for r in both.rows if r.hw == h)
    # a target between the two machines' bests: one reaches it
    lo, hi = sorted(best.values())
    target = (lo + hi) / 2
    a = advise("mixtral-8x7b", ["a6000-pcie4", "rtx4090-pcie4"], min_tokens_per_s=target, **kw)
    faster = max(best, key=lambda h: best[h])
    assert a.answer == faster
    assert all(r.tokens_per_s >= target for r in a.rows) and a.below_target > 0
    assert [m.meets_target for m in a.machines] == [True, False]
    text = render(a)
    assert f"cheapest machine that reaches it: {faster}" in text and "energy per" in text
    # a target both reach: by --price when every machine has one, the cheaper first
    prices = {faster: 2000.0, min(best, key=lambda h: best[h]): 1000.0}
    a = advise("mixtral-8x7b", ["a6000-pcie4", "rtx4090-pcie4"], min_tokens_per_s=lo / 2,
               prices=prices, **kw)  # fmt: skip
    assert a.answer == min(prices, key=lambda h: prices[h]) and a.order == "price (--price)"
    # nobody reaches it
    a = advise("mixtral-8x7b", ["a6000-pcie4"], min_tokens_per_s=1e6, **kw)
    assert a.answer is None and not a.rows and "no machine reaches the target" in render(a)


def test_json_schema(cli: Callable[..., Any]) -> None:
    res = cli("advise", *SMALL[:6], "--policies", "lru,all-gpu", "--dtype", "bf16",
              "--sequences", "1", "--workers", "1", "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(doc) == set(Advice.__dataclass_fields__)
    fields = set(AdviceRow.__dataclass_fields__)
    assert doc["rows"] and all(set(r) == fields for r in doc["rows"] + doc["references"])
    assert doc["model"] == "mixtral-8x7b" and doc["hw"] == "a6000-pcie4"
    assert {r["bottleneck"] for r in doc["rows"]} <= {"link", "CPU", "GPU", "memory"}
    assert all(r["bound_tokens_per_s"] >= r["tokens_per_s"] for r in doc["rows"])
    text = cli("advise", *SMALL[:6], "--policies", "lru,all-gpu", "--dtype", "bf16",
               "--sequences", "1", "--workers", "1", "--top", "0")  # fmt: skip
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
        (["--model", "mixtral-8x7b", "--hw", "a6000-pcie"], "did you mean 'a6000-pcie4'"),
        (["--model", "mixtral-8x7b", "--hw", "a6000-pcie4,a6000-pcie4"], "given twice"),
        (["--model", "mixtral-8x7b", "--hw", ","], "--hw"),
        (["--model", "qwen3-30b-a3b", "--hw", "a6000-pcie4", "--trace", "ci-small"], "records"),
        ([*SMALL[:6], "--policies", "lur"], "did you mean 'lru'"),
        ([*SMALL[:6], "--dtype", "bf17"], "did you mean 'bf16'"),
        ([*SMALL[:6], "--runtime", "cuda-grph"], "cuda-grph"),
        ([*SMALL[:6], "--min-gate-mass", "1.5"], "min-gate-mass"),
        ([*SMALL[:6], "--min-tokens-per-s", "-1"], "--min-tokens-per-s"),
        ([*SMALL[:6], "--min-tokens-per-s", "nan"], "--min-tokens-per-s"),
        ([*SMALL[:6], "--min-tokens-per-s", "1", "--price", "rtx4090-pcie4=5"], "not searched"),
        ([*SMALL[:6], "--price", "a6000-pcie4=cheap"], "must be a number"),
        ([*SMALL[:6], "--price", "a6000-pcie4"], "NAME=AMOUNT"),
        ([*SMALL[:6], "--sequences", "0"], "--sequences"),
        ([*SMALL[:6], "--json", "--csv"], "not both"),
    ],
)
def test_bad_input_is_one_error_line(cli: Callable[..., Any], args: list[str], needle: str) -> None:
    res = cli("advise", *args)
    if "--json" in args:
        assert res.exit_code == 2 and needle in json.loads(res.stdout)["error"]
        return
    one_error(res, 2, needle)


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
    from daopsim.simulator.synth_params import PRESETS

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


def test_integer_options_keep_their_type_in_commands(small: Advice) -> None:
    """A table column shared by several policies comes back as float; commands must not."""
    rows = [m for m in _members(small) if m["policy"] == "llama-cpp-cpu-moe" and m["options"]]
    assert rows
    for m in rows:
        if "n_cpu_moe" in m["options"]:
            assert isinstance(m["options"]["n_cpu_moe"], int)
            assert f"n_cpu_moe={m['options']['n_cpu_moe']}" in m["command"]
            assert ".0" not in m["command"].split("n_cpu_moe=")[1].split()[0]


def test_a_readable_table(small: Advice, cli: Callable[..., Any]) -> None:
    """--top (default 10, 0: all), separate policy and runtime columns, options never cut,
    lines within the width, every row in --csv."""
    from daopsim.simulator.advise_render import DEFAULT_TOP

    text = render(small, top=2, width=90)
    lines = text.splitlines()
    head = next(ln for ln in lines if "tokens/s" in ln and "options" in ln)
    assert head.split()[:1] == ["#"] and "policy" in head and "runtime" in head
    ranked = [ln for ln in lines[lines.index(head) + 1 :] if ln[:3].strip().isdigit()][:2]
    assert [ln.split()[0] for ln in ranked] == ["1", "2"]
    assert all(len(ln) <= 90 for ln in lines if not ln.startswith("     "))
    assert f"{len(small.rows) - 2} more ranked rows" in text and "--top 0" in text
    assert DEFAULT_TOP == 10
    assert all(r.command not in text for r in small.rows[2:])
    assert "~" not in "".join(r.options_text for r in small.rows)
    for r in small.rows:  # every option of a shown row is printed whole
        for opt in r.options_text.split(","):
            assert opt in render(small, top=0, width=80), opt
    csv = to_csv(small)
    assert len(pd.read_csv(__import__("io").StringIO(csv))) == len(small.rows) + len(
        small.references
    )
    assert "runtime" in csv.splitlines()[0] and "bound_tokens_per_s" in csv.splitlines()[0]
    res = cli("advise", *SMALL, "--csv")
    assert res.exit_code == 0 and res.stdout == csv
