"""CPU-hybrid policies: llama-cpp-cpu-moe and ktransformers, their core rules by hand.

llama-cpp-cpu-moe: which layers keep their experts on the CPU for ``n_cpu_moe=N``, every expert
of a GPU layer resident and hit, every routed expert of a CPU layer run on the CPU in decode,
and the prompt-batch threshold for copying a CPU layer's experts in prefill. ktransformers: the
four placement strategies on a hand-made calibration matrix, and its per-expert split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from daopsim.policies.base import Action, Plan, SetupContext, View
from daopsim.policies.ktransformers import KTransformersPolicy, place_gpu_experts
from daopsim.policies.llama_cpp_cpu_moe import LlamaCppCpuMoePolicy, cpu_moe_layers
from daopsim.simulator.cli import main
from daopsim.simulator.errors import DoesNotFit, UserError
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import decode_view, setup_context

GPU, TEMP, CPU = Action.GPU, Action.TEMP, Action.CPU


def _ctx(
    layers: int, moe_layers: int, experts: int, budget: int, calibration: Any = None
) -> SetupContext:
    return setup_context(moe_layers, experts, budget, calibration, layers=layers)


def _view(layer: int, experts: list[int], n_tokens: int = 1, resident: Any = None) -> View:
    return decode_view(layer, experts, resident, n_tokens)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Qwen3-30B-A3B trace (48 MoE layers, 128 experts, top-8), made with synth."""
    path = tmp_path_factory.mktemp("qwen3") / "qwen3.parquet"
    res = CliRunner().invoke(
        main,
        [
            "synth",
            "--model",
            "qwen3-30b-a3b",
            "--sequences",
            "2",
            "--prompt-tokens",
            "40",
            "--output-tokens",
            "6",
            "--seed",
            "3",
            "-o",
            str(path),
        ],
    )
    assert res.exit_code == 0, res.output
    return path


# --- llama-cpp-cpu-moe ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "layers", "moe_layers", "expected"),
    [
        (-1, 48, 48, 48),  # --cpu-moe: every layer
        (0, 48, 48, 0),
        (20, 48, 48, 20),  # blocks 0..19
        (60, 48, 48, 48),  # more blocks than the model has
        (2, 27, 26, 1),  # one leading dense block (DeepSeek-V2-Lite shape): blk.0 has no experts
        (1, 27, 26, 0),
    ],
)
def test_cpu_layers_count_blocks_from_the_first(
    n: int, layers: int, moe_layers: int, expected: int
) -> None:
    assert cpu_moe_layers(n, layers, moe_layers) == expected


def test_gpu_layers_are_whole_and_cpu_layers_empty() -> None:
    pol = LlamaCppCpuMoePolicy(n_cpu_moe=2)
    placed = list(pol.setup(_ctx(4, 4, 3, budget=6)))
    assert sorted(placed) == [(2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 2)]


def test_too_few_cpu_layers_names_the_smallest_n_that_fits() -> None:
    pol = LlamaCppCpuMoePolicy(n_cpu_moe=1)
    with pytest.raises(UserError, match=r"n_cpu_moe >= 2 "):
        pol.setup(_ctx(4, 4, 3, budget=7))  # 7 slots hold 2 whole layers of 3 experts


def test_decode_cpu_layers_run_on_the_cpu_gpu_layers_all_hit() -> None:
    pol = LlamaCppCpuMoePolicy(n_cpu_moe=2)
    pol.setup(_ctx(4, 4, 3, budget=6))
    assert pol.decode_layer(_view(1, [2, 0])).actions == {2: CPU, 0: CPU}
    # all resident: the shared all-on-the-GPU plan (a FrozenPlan; its copy is a new Plan)
    assert pol.decode_layer(_view(2, [2, 0])).copy() == Plan()


@pytest.mark.parametrize(
    ("tokens", "options", "action"),
    [
        (31, {}, CPU),
        (32, {}, TEMP),  # GGML_OP_OFFLOAD_MIN_BATCH: a batch of 32 goes to the GPU
        (500, {"prefill_offload": False}, CPU),
        (8, {"offload_min_batch": 8}, TEMP),
    ],
)
def test_prefill_copies_cpu_layer_experts_from_the_batch_floor(
    tokens: int, options: dict, action: Action
) -> None:
    pol = LlamaCppCpuMoePolicy(n_cpu_moe=1, **options)
    pol.setup(_ctx(2, 2, 3, budget=3))
    assert pol.prefill_layer(_view(0, [1, 2], n_tokens=tokens)).actions == {1: action, 2: action}
    assert pol.prefill_layer(_view(1, [1, 2], n_tokens=tokens)) == Plan()


def test_bad_options_are_one_line_errors() -> None:
    with pytest.raises(UserError, match="n_cpu_moe"):
        LlamaCppCpuMoePolicy(n_cpu_moe=-2)
    with pytest.raises(UserError, match="offload_min_batch"):
        LlamaCppCpuMoePolicy(offload_min_batch=0)


def test_engine_runs_every_routed_expert_of_a_cpu_layer_on_the_cpu(qwen3: Path) -> None:
    """Decode CPU work is exactly tokens x CPU layers x top-k; prompts of 40 copy instead."""
    runs = {
        n: simulate(
            policy="llama-cpp-cpu-moe",
            policy_options={"n_cpu_moe": n},
            hw="rtx4090-pcie4",
            trace=qwen3,
            dtype="q4_k_m",
            record=False,
        )
        for n in (12, 24)
    }
    for n, r in runs.items():
        m = r.metrics
        decode_accesses = m["cpu_expert_evals"]  # the prompt went to the GPU: all decode
        assert decode_accesses % (n * 8) == 0
        assert m["temp_copies"] > 0  # the 40-token prompts reach the batch floor
    per_layer = [runs[n].metrics["cpu_expert_evals"] // n for n in (12, 24)]
    assert per_layer[0] == per_layer[1]  # the same decode tokens, top-8 on each CPU layer
    assert runs[12].metrics["hit_rate"] == pytest.approx(36 / 48)  # GPU layers always hit


def test_pageable_host_memory_slows_the_prompt_copies_and_only_them(qwen3: Path) -> None:
    """``host_memory = pageable`` (llama.cpp's CPU buffer type: an -ot ...=CPU override in
    builds of April 2025): the prompt's op-offload copies run at the link's pageable rate, so
    the prompt pass takes longer by at least their extra link time; the decode (CPU experts, no
    copies) is unchanged, and the same bytes cross the link."""
    runs = {
        mem: simulate(
            policy="llama-cpp-cpu-moe",
            policy_options={"n_cpu_moe": 12, "host_memory": mem},
            hw="rtx4090-pcie4",
            trace=qwen3,
            dtype="q4_k_m",
            record=False,
        ).metrics
        for mem in ("pinned", "pageable")
    }
    pinned, pageable = runs["pinned"], runs["pageable"]
    assert pageable["h2d_bytes"] == pinned["h2d_bytes"]
    assert pageable["temp_copies"] == pinned["temp_copies"] > 0
    assert pageable["ttft_s"] > pinned["ttft_s"]
    assert pageable["cpu_expert_evals"] == pinned["cpu_expert_evals"]
    with pytest.raises(UserError, match="host_memory"):
        LlamaCppCpuMoePolicy(host_memory="mapped")


def test_done_criterion_command_runs(qwen3: Path) -> None:
    res = CliRunner().invoke(
        main,
        [
            "run",
            "--no-progress",
            "--policy",
            "llama-cpp-cpu-moe",
            "--policy-opt",
            "n_cpu_moe=20",
            "--hw",
            "rtx4090-pcie4",
            "--trace",
            str(qwen3),
            "--dtype",
            "q4_k_m",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "llama-cpp-cpu-moe" in res.output


# --- ktransformers --------------------------------------------------------------------------

CAL = np.array(
    [
        [1, 9, 0, 4],  # layer 0
        [7, 2, 8, 3],  # layer 1
        [0, 0, 5, 6],  # layer 2
    ]
)


def test_frequency_takes_the_global_top_across_layers() -> None:
    assert sorted(place_gpu_experts("frequency", 4, 3, 4, CAL)) == [(0, 1), (1, 0), (1, 2), (2, 3)]


def test_uniform_spreads_evenly_lowest_ids_first() -> None:
    assert place_gpu_experts("uniform", 4, 3, 4) == [(0, 0), (0, 1), (1, 0), (2, 0)]
    assert place_gpu_experts("uniform", 6, 3, 4) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_front_loading_fills_from_the_first_layer() -> None:
    assert place_gpu_experts("front-loading", 6, 3, 4) == [
        (0, 0),
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 0),
        (1, 1),
    ]


def test_random_is_fixed_and_distinct() -> None:
    a = place_gpu_experts("random", 5, 3, 4)
    assert a == place_gpu_experts("random", 5, 3, 4)
    assert len(set(a)) == 5
    assert all(0 <= layer < 3 and 0 <= e < 4 for layer, e in a)


def test_ratio_overrides_per_layer_and_budget_is_checked() -> None:
    pol = KTransformersPolicy(gpu_experts_per_layer=1, gpu_experts_ratio=0.5, placement="uniform")
    assert len(list(pol.setup(_ctx(3, 3, 4, budget=12)))) == 6
    with pytest.raises(UserError, match="do not fit in the budget of 5 "):
        pol.setup(_ctx(3, 3, 4, budget=5))


def test_only_frequency_with_gpu_experts_uses_calibration() -> None:
    assert not KTransformersPolicy().uses_calibration()
    assert not KTransformersPolicy(placement="frequency").uses_calibration()
    assert KTransformersPolicy(gpu_experts_per_layer=2, placement="frequency").uses_calibration()


def test_resident_on_gpu_others_on_cpu_concurrently() -> None:
    pol = KTransformersPolicy()
    resident = np.array([[False, True, False, True]])
    plan = pol.decode_layer(_view(0, [3, 0, 1], resident=resident))  # 1 and 3 resident
    assert plan.actions == {3: GPU, 0: CPU, 1: GPU}
    assert not plan.cpu_first and not plan.cpu_serial  # the layer takes the longer side


def test_ktransformers_runs_on_qwen3(qwen3: Path) -> None:
    none = simulate(policy="ktransformers", hw="rtx4090-pcie4", trace=qwen3, dtype="q4_k_m")
    some = simulate(
        policy="ktransformers",
        policy_options={"gpu_experts_per_layer": 32, "placement": "front-loading"},
        hw="rtx4090-pcie4",
        trace=qwen3,
        dtype="q4_k_m",
    )
    assert none.metrics["hit_rate"] == 0
    assert 0 < some.metrics["hit_rate"] < 1
    assert some.metrics["cpu_expert_evals"] < none.metrics["cpu_expert_evals"]


def test_bounds_beside_a_policy_without_a_temporary_buffer(
    qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A policy with no temporary buffer may hold one expert more than Belady (which keeps one):
    the bound then runs at what fits and records that budget."""
    import daopsim.simulator.runner as runner
    from daopsim.simulator.commands.run_cmd import compute_bounds

    args = {"hw": "rtx4090-pcie4", "trace": str(qwen3), "dtype": "q4_k_m", "seed": 0}
    result = runner.simulate(policy="ktransformers", record=False, **args)
    full = result.config["gpu_experts"]
    real = runner.simulate

    def tight(**kw):  # a machine with room for exactly the policy's experts and no buffer
        if kw.get("policy") == "belady" and kw.get("gpu_experts") == full:
            raise DoesNotFit(full - 1, f"{full} resident experts do not fit")
        return real(**kw)

    monkeypatch.setattr(runner, "simulate", tight)
    bounds = compute_bounds(result, hw=args["hw"], trace=args["trace"], dtype="q4_k_m")
    assert bounds["belady_per_layer"]["gpu_experts"] == full - 1
    assert bounds["belady_per_layer"]["hit_rate"] > 0
