"""llama-cpp-layers (llama.cpp's ``-ngl``): the layer split, and its timing worked out by hand.

A two-layer toy on a machine with round numbers: with ``ngl=2`` (the output layer and one
block on the GPU) layer 0 runs wholly on the CPU and layer 1 wholly on the GPU, so one decode
token costs the CPU layer's non-expert part and expert (weights over the CPU's bandwidth), the
hidden state's copy at the split, and the GPU layer's non-expert part and expert, in sequence.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from daopsim.policies.llama_cpp_layers import LlamaCppLayersPolicy, gpu_blocks_for_ngl
from daopsim.simulator.core.loop import Engine, cpu_layers_for
from daopsim.simulator.costs import cost_model
from daopsim.simulator.errors import PolicyError, UserError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.recorder import Recorder
from daopsim.simulator.reference import ReferenceEngine
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import routing_from_experts, tiny_model

US = 1e-6


def _round_machine():
    """A bundled profile with round numbers: GPU 100 GB/s, CPU and link 10 GB/s, no fixed
    costs, compute never the bound."""
    hw = load_profile("rtx4090-pcie4")
    return dataclasses.replace(
        hw,
        gpu=dataclasses.replace(hw.gpu, mem_bw_gbs=100.0, bf16_tflops=1e6, launch_overhead_us=0.0),
        cpu=dataclasses.replace(
            hw.cpu, mem_bw_gbs=10.0, bf16_gflops=1e9, fp32_gflops=1e9, socket_bw_gbs=None
        ),
        link=dataclasses.replace(
            hw.link,
            h2d_pinned_gbs=10.0,
            d2h_pinned_gbs=10.0,
            copy_overhead_us=0.0,
            kind="pcie",
            dram_bw_gbs=None,
        ),
        measured={},
    )


def _toy():
    # 2 MoE layers, 4 experts, top-1; hidden 64, expert_ffn 128, 3 matrices, bf16:
    # one expert = 3 x 64 x 128 x 2 B = 49,152 B; non-expert 100,000 params = 200,000 B,
    # 100,000 B per layer; KV 1,024 B per token = 512 B per layer
    return dataclasses.replace(tiny_model(experts=4, top_k=1, moe_layers=2), name="toy")


def _engine(cls, ngl: int, seq, **opts):
    model = _toy()
    costs = cost_model(_round_machine(), model)
    rec = Recorder()
    eng = cls(LlamaCppLayersPolicy(ngl=ngl, **opts), model, costs, 8, recorder=rec)
    stats = eng.run(iter([seq]))
    return eng, stats, rec.timeline()


@pytest.mark.parametrize(("ngl", "blocks"), [(-1, -1), (0, 0), (1, 0), (2, 1), (33, 32)])
def test_the_output_layer_takes_one_of_the_ngl_places(ngl: int, blocks: int) -> None:
    assert gpu_blocks_for_ngl(ngl) == blocks


def test_cpu_layers_lead_and_auto_fills_the_budget_by_whole_layers() -> None:
    model = tiny_model(experts=4, top_k=1, moe_layers=6)
    spec = LlamaCppLayersPolicy(ngl=3).resources()
    assert cpu_layers_for(spec, model, budget=24) == 4  # 2 GPU blocks, whatever the budget
    auto = LlamaCppLayersPolicy().resources()
    assert cpu_layers_for(auto, model, budget=9) == 4  # 9 slots hold 2 whole layers of 4
    assert cpu_layers_for(auto, model, budget=24) == 0


def test_one_decode_token_by_hand() -> None:
    seq = routing_from_experts(_toy(), np.array([[[1], [2]]]))  # one token, no prompt
    eng, stats, tl = _engine(Engine, 2, seq)
    assert eng.n_cpu_layers == 1
    cpu_ne = (100_000 + 512) / 10e9  # layer 0's weights and KV over the CPU's 10 GB/s
    cpu_expert = 49_152 / 10e9  # expert 1 of layer 0 from host memory, no copies
    split = 64 * 2 / 10e9  # one bf16 hidden state over the 10 GB/s link
    gpu_ne = (100_000 + 512) / 100e9
    gpu_expert = (49_152 + 2 * 64 * 2) / 100e9  # weights, activations in and out
    expected = cpu_ne + cpu_expert + split + gpu_ne + gpu_expert
    assert stats.counters.token_latency == [pytest.approx(expected, rel=1e-12)]
    assert stats.counters.cpu_nonexpert_busy == pytest.approx(cpu_ne, rel=1e-12)
    assert stats.counters.cpu_expert_evals == 1
    assert stats.counters.h2d_bytes == 128 and stats.counters.d2h_bytes == 0
    # nothing of layer 0 ran on the GPU, nothing of layer 1 on the CPU
    gpu = tl[tl["resource"].astype(str) == "gpu"]
    assert set(gpu["layer"]) == {1}
    cpu = tl[tl["resource"].astype(str) == "cpu0"]
    assert set(cpu["layer"]) == {0}


def test_all_layers_on_the_gpu_pay_no_cpu() -> None:
    seq = routing_from_experts(_toy(), np.array([[[1], [2]]]))
    _, stats, _ = _engine(Engine, 3, seq)
    gpu_ne = (100_000 + 512) / 100e9
    gpu_expert = (49_152 + 256) / 100e9
    assert stats.counters.token_latency == [pytest.approx(2 * (gpu_ne + gpu_expert), rel=1e-12)]
    assert stats.counters.cpu_nonexpert_busy == 0.0 and stats.busy["cpu"] == 0.0


def test_prompt_op_offload_copies_the_cpu_layers_weights() -> None:
    """A 32-token prompt: layer 0's non-expert weights (100,000 B) and its one used expert
    cross the link before the GPU runs them; no hidden state crosses (all on the GPU)."""
    ex = np.zeros((33, 2, 1), dtype=np.int16)
    seq = routing_from_experts(_toy(), ex, n_prefill=32)
    _, stats, tl = _engine(Engine, 2, seq)
    weights = tl[tl["kind"].astype(str) == "weights"]
    assert len(weights) == 1 and int(weights["bytes"].iloc[0]) == 100_000
    dur = float(weights["end"].iloc[0] - weights["start"].iloc[0])
    assert dur == pytest.approx(100_000 / 10e9, rel=1e-12)
    assert stats.counters.cpu_layer_weight_copies == 1
    assert stats.counters.temp_copies == 1  # layer 0's expert 0, copied for the batch
    # a 31-token prompt stays on the CPU: no weight copy, the split is crossed instead
    seq = routing_from_experts(_toy(), ex[:32], n_prefill=31)
    _, stats, tl = _engine(Engine, 2, seq)
    assert stats.counters.cpu_layer_weight_copies == 0 and stats.counters.temp_copies == 0


@pytest.mark.parametrize("opts", [{}, {"prefill_offload": False}])
def test_the_cpu_never_runs_two_things_at_once(opts: dict) -> None:
    """Physical invariant: a CPU layer's non-expert part and its experts share one CPU lane
    one after another, on both engines (which must agree)."""
    rng = np.random.default_rng(0)
    ex = rng.integers(0, 4, size=(40, 2, 1)).astype(np.int16)
    seq = routing_from_experts(_toy(), ex, n_prefill=32)
    for cls in (Engine, ReferenceEngine):
        _, stats, tl = _engine(cls, 2, seq, **opts)
        cpu = tl[tl["resource"].astype(str) == "cpu0"].sort_values("start")
        assert len(cpu) > 0
        assert (cpu["start"].to_numpy()[1:] >= cpu["end"].to_numpy()[:-1] - 1e-15).all()
        assert stats.busy["cpu"] == pytest.approx(float((cpu["end"] - cpu["start"]).sum()))


def test_background_work_is_refused_with_cpu_layers() -> None:
    from daopsim.policies.base import Plan

    class Prefetching(LlamaCppLayersPolicy):
        name = "llama-cpp-layers-prefetching"

        def decode_layer(self, view):  # type: ignore[no-untyped-def]
            plan = super().decode_layer(view)
            return Plan(actions=plan.actions, precalc=[(1, 0)] if view.layer == 0 else [])

    model = _toy()
    seq = routing_from_experts(model, np.array([[[1], [2]]]))
    eng = Engine(Prefetching(ngl=2), model, cost_model(_round_machine(), model), 4)
    with pytest.raises(PolicyError, match="gpu_blocks"):
        eng.run(iter([seq]))


def test_cli_run_names_the_split() -> None:
    res = simulate(
        policy="llama-cpp-layers",
        trace="ci-small",
        hw="rtx4090-pcie4",
        dtype="q4_k_m",
        sequences=1,
        policy_options={"ngl": 16},
        record=False,
    )
    assert any("MoE layers 0-16 wholly on the CPU" in n for n in res.config["notes"])
    assert res.metrics["decode_tokens_per_s"] > 0


def test_bad_ngl_is_a_one_line_error() -> None:
    with pytest.raises(UserError, match="ngl"):
        LlamaCppLayersPolicy(ngl=-2)


def test_batched_serving_runs_cpu_layers_and_batch_one_is_the_plain_run() -> None:
    """Batch 1 goes through the per-token pass (the plain run's numbers); a batched step of
    fewer than 32 tokens runs the CPU layers on the CPU, one CPU non-expert part per layer."""
    from daopsim.simulator.serving_config import ServingConfig

    kw = dict(
        policy="llama-cpp-layers",
        trace="ci-small",
        hw="rtx4090-pcie4",
        dtype="q4_k_m",
        sequences=1,
        policy_options={"ngl": 16},
        record=True,
    )
    one = simulate(**kw, serving=ServingConfig(batch=1))
    plain = simulate(**kw)
    assert one.metrics["decode_tokens_per_s"] == pytest.approx(
        plain.metrics["decode_tokens_per_s"], rel=1e-9
    )
    # prompts one by one (each is offloaded to the GPU): only decode steps are batched
    two = simulate(
        **{**kw, "sequences": 2}, serving=ServingConfig(batch=2, static_prefill="per-request")
    )
    assert two.serving["batched_steps"] > 0
    tl = two.timeline
    cpu_ne = tl[(tl["resource"].astype(str) == "cpu0") & (tl["kind"].astype(str) == "nonexpert")]
    gpu_ne = tl[(tl["resource"].astype(str) == "gpu") & (tl["kind"].astype(str) == "nonexpert")]
    step_ops = gpu_ne[gpu_ne["seq"] == -1]  # the batched decode steps'
    assert len(step_ops) > 0
    assert set(cpu_ne["layer"]) == set(range(17))  # ngl=16: MoE layers 0-16 on the CPU
    assert set(step_ops["layer"]) == set(range(17, 32))
    # the default static batch prefills both prompts in one (offloaded) step: that step runs
    # every layer's non-expert part on the GPU, the decode steps only layers 17-31
    both = simulate(**{**kw, "sequences": 2}, serving=ServingConfig(batch=2))
    assert both.serving["batched_prefills"] == 1
    tl = both.timeline
    gpu_ne = tl[(tl["resource"].astype(str) == "gpu") & (tl["kind"].astype(str) == "nonexpert")]
    steps = gpu_ne[gpu_ne["seq"] == -1]
    first = steps["token"].min()  # the batched prefill is the batch's first step
    assert set(steps[steps["token"] == first]["layer"]) == set(range(32))
    assert set(steps[steps["token"] > first]["layer"]) == set(range(17, 32))


def test_chunked_prefill_with_cpu_layers_is_refused_and_preemption_runs() -> None:
    """A mixed step times its non-expert part on the GPU only, so CPU-resident layers with
    --prefill-chunk are a one-line user error; preemption alone uses the per-layer CPU rules."""
    from daopsim.simulator.serving_config import ServingConfig

    kw = dict(
        policy="llama-cpp-layers",
        trace="ci-small",
        hw="rtx4090-pcie4",
        dtype="q4_k_m",
        sequences=2,
        policy_options={"ngl": 16},
        record=False,
    )
    with pytest.raises(UserError, match="--prefill-chunk is not modelled with CPU-resident") as e:
        simulate(**kw, serving=ServingConfig(batch=2, prefill_chunk=8))
    assert "\n" not in str(e.value)
    res = simulate(**kw, serving=ServingConfig(batch=2, preempt=True))
    assert res.metrics["decode_tokens_per_s"] > 0
    # every layer on the GPU (an 80 GB card holds them): chunked prefill is fine
    whole = {**kw, "hw": "h100-pcie5", "policy_options": {"ngl": -1}}
    ok = simulate(**whole, serving=ServingConfig(batch=2, prefill_chunk=8))
    assert ok.serving["mixed_steps"] > 0
