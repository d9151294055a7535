"""Budgets that mean what they say: the run header tells the experts a policy kept resident
from the budget it was given, a policy whose options fix its placement is never refused for a
budget it does not use (in a run or a sweep), multi-GPU fits are labelled per GPU, and a budget
of at most top-k experts per layer carries a note that per-layer caches cannot differ there."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pandas as pd
import pytest
from cli_checks import one_error

import daopsim
from daopsim.simulator.errors import DoesNotFit

#: ci-small records Mixtral-8x7B (32 MoE layers, 8 experts, top-2); an A6000 holds 123 bf16
#: experts beside the rest of the model, so a 0.9 cache ratio (230 experts) does not fit.
TRACE = ["--trace", "ci-small", "--sequences", "1", "--no-progress"]


def _run(cli: Callable[..., Any], *args: str) -> dict[str, Any]:
    res = cli("run", *TRACE, "--no-bounds", "--json", *args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.mark.parametrize(
    ("policy", "options"),
    [
        ("llama-cpp-cpu-moe", []),  # n_cpu_moe=-1: every layer's experts on the CPU
        ("llama-cpp-cpu-moe", ["--policy-opt", "n_cpu_moe=32"]),  # all 32 blocks: the same
        ("llama-cpp-mmap", []),
        ("ktransformers", []),  # no GPU experts by default
        ("llama-cpp-layers", ["--policy-opt", "ngl=0"]),  # every layer on the CPU
    ],
)
def test_a_policy_that_keeps_none_is_not_refused_for_a_budget_it_does_not_use(
    cli: Callable[..., Any], policy: str, options: list[str]
) -> None:
    doc = _run(cli, "--policy", policy, "--cache-ratio", "0.9", *options)
    assert doc["gpu_experts"] == 230 and doc["max_gpu_experts"] < 230
    assert doc["fixed_residency"] == 0
    assert doc["metrics"]["max_slots_held"] == 0
    assert doc["metrics"]["hit_rate"] == 0
    # the same run at a budget that fits gives the same results: the budget is not used
    fits = _run(cli, "--policy", policy, "--cache-ratio", "0.25", *options)
    for key in ("tokens_per_s", "ttft_s", "h2d_bytes", "cpu_busy_frac"):
        assert doc["metrics"][key] == fits["metrics"][key], key


def test_what_a_policy_keeps_must_still_fit(cli: Callable[..., Any]) -> None:
    """n_cpu_moe=16 keeps 16 layers x 8 = 128 experts on the GPU: more than the 123 that fit,
    whatever the budget asked for."""
    for budget in ([], ["--cache-ratio", "0.9"]):
        res = cli("run", *TRACE, "--policy", "llama-cpp-cpu-moe", "--policy-opt", "n_cpu_moe=16",
                  *budget)  # fmt: skip
        one_error(res, 2, "n_cpu_moe")
    with pytest.raises(DoesNotFit):
        daopsim.simulate(
            policy="llama-cpp-cpu-moe",
            trace="ci-small",
            sequences=1,
            policy_options={"n_cpu_moe": 16},
            record=False,
        )


def test_a_budget_the_policy_fills_is_still_checked(cli: Callable[..., Any]) -> None:
    one_error(cli("run", *TRACE, "--policy", "lru", "--cache-ratio", "0.9"), 2, "do not fit")


def test_the_header_tells_resident_experts_from_the_budget(cli: Callable[..., Any]) -> None:
    res = cli("run", *TRACE, "--policy", "llama-cpp-cpu-moe", "--no-bounds")
    assert res.exit_code == 0, res.output
    line = res.stdout.splitlines()[1]
    assert line.startswith("GPU experts: 0 resident at most, budget 123 of 256")
    assert "options fix 0 resident experts" in line
    res = cli("run", *TRACE, "--policy", "lru", "--no-bounds")
    line = res.stdout.splitlines()[1]
    assert line.startswith("GPU experts: 123 resident at most, budget 123 of 256")
    assert "options fix" not in line


def test_multi_gpu_fit_is_labelled_per_gpu(cli: Callable[..., Any]) -> None:
    res = cli("run", *TRACE, "--policy", "lru", "--gpus", "2", "--hw", "2x-rtx3090-nvlink")
    assert res.exit_code == 0, res.output
    line = res.stdout.splitlines()[1]
    doc = _run(cli, "--policy", "lru", "--gpus", "2", "--hw", "2x-rtx3090-nvlink")
    per_gpu = doc["max_gpu_experts"]
    assert doc["gpu_experts"] == 2 * per_gpu  # the budget is the total over both GPUs
    assert f"budget {2 * per_gpu} of 256 over 2 GPUs" in line
    assert f"{per_gpu} fit in each GPU" in line


def test_sweep_runs_what_the_run_runs(tmp_path: Any) -> None:
    df = daopsim.sweep(
        {
            "policies": ["llama-cpp-cpu-moe", "lru"],
            "traces": ["ci-small"],
            "cache_ratios": [0.25, 0.9],
            "sequences": 1,
        },
        workers=1,
    )
    got = {(r.policy, r.cache_ratio): r.status for r in df.itertuples()}
    assert got[("llama-cpp-cpu-moe", 0.9)] == "ok"
    assert got[("lru", 0.9)] == "skipped"
    row = df[(df.policy == "llama-cpp-cpu-moe") & (df.cache_ratio == 0.9)].iloc[0]
    assert row.expert_memory_gb == 0  # the memory its experts take, not the budget's


def _hits(policy: str, budget: int) -> tuple[float, float]:
    r = daopsim.simulate(
        policy=policy, trace="ci-small", sequences=2, gpu_experts=budget, record=False
    )
    return r.metrics["hit_rate"], r.metrics["tokens_per_s"]


@pytest.mark.parametrize("budget", [32, 48, 64])
def test_at_most_top_k_per_layer_every_per_layer_cache_is_belady(budget: int) -> None:
    """The note's claim, tried: at 1 and 2 experts per layer (top-2) every per-layer cache
    gives Belady's hits and time; at 3 per layer they differ (checked below)."""
    best = _hits("belady", budget)
    for policy in ("lru", "lfu", "round-robin", "learned"):
        assert _hits(policy, budget) == best, policy


def test_above_top_k_per_layer_the_caches_differ() -> None:
    rates = {p: _hits(p, 96)[0] for p in ("belady", "lru", "lfu")}
    assert rates["belady"] > max(rates["lru"], rates["lfu"])
    assert rates["lru"] != rates["lfu"]


def test_a_budget_at_top_k_per_layer_gets_a_note(cli: Callable[..., Any]) -> None:
    low = _run(cli, "--policy", "lru", "--gpu-experts", "64")
    assert any("at most top-k (2)" in n and "96 experts" in n for n in low["notes"])
    assert not any(
        "top-k" in n for n in _run(cli, "--policy", "lru", "--gpu-experts", "96")["notes"]
    )
    # not a per-layer cache: no note (a global cache can still differ there)
    assert not any(
        "top-k" in n for n in _run(cli, "--policy", "global-lru", "--gpu-experts", "64")["notes"]
    )
    res = cli("run", *TRACE, "--policy", "lfu", "--gpu-experts", "48", "--no-bounds")
    assert "note: budget of 48 experts is 1 per layer, at most top-k (2)" in res.stdout


BAD_FIXED = """
from daopsim.policies.lru import LRUPolicy

class Bad(LRUPolicy):
    name = "bad-fixed"

    def fixed_residency(self, model):
        return {value}
"""


@pytest.mark.parametrize("value", ["-1", "'3'", "1.5", "True", "1 // 0"])
def test_a_bad_fixed_residency_is_the_policy_s_fault(
    cli: Callable[..., Any], tmp_path: Any, value: str
) -> None:
    path = tmp_path / "bad.py"
    path.write_text(BAD_FIXED.format(value=value))
    line = one_error(cli("run", *TRACE, "--policy", f"{path}:Bad"), 2, "bad-fixed")
    assert "fixed_residency" in line


def test_a_multi_gpu_sweep_labels_per_gpu_and_total() -> None:
    df = daopsim.sweep(
        {"policies": ["lru"], "hw": ["2x-rtx3090-nvlink"], "traces": ["ci-small"],
         "gpu_experts": [40, 80], "gpus": [1, 2], "sequences": 1},
        workers=1,
        progress=False,
    )  # fmt: skip
    got = [
        (r.gpus, r.status, None if r.gpu_experts is pd.NA else int(r.gpu_experts),
         int(r.gpu_experts_per_gpu))
        for r in df.itertuples()
    ]  # fmt: skip
    # the budget asked is per GPU; the total is what two GPUs hold; a point that does not fit
    # has no total (it is not known) and never shows its per-GPU figure as one
    assert got == [(1, "ok", 40, 40), (2, "ok", 80, 40), (1, "skipped", 80, 80),
                   (2, "skipped", None, 80)]  # fmt: skip
    assert set(df["max_gpu_experts"]) == {55}  # per GPU


def test_a_sweep_at_top_k_per_layer_says_so(cli: Callable[..., Any], tmp_path: Any) -> None:
    out = tmp_path / "s.parquet"
    grid = ["--policies", "lru,daop", "--traces", "ci-small", "--gpu-experts", "48,96"]
    res = cli("sweep", *grid, "--sequences", "1", "--no-progress", "--workers", "1", "-o", out)
    assert res.exit_code == 0, res.output
    notes = [ln for ln in res.stdout.splitlines() if ln.startswith("note:")]
    # lru at 48 (one per layer) is named; lru at 96 and daop (not a per-layer cache) are not
    assert len(notes) == 1 and "(lru at 48)" in notes[0] and "cannot differ" in notes[0]
