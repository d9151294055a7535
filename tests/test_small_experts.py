"""Per-call costs that do not shrink with an expert (issue 30): a PyTorch CPU expert's module
calls and op dispatch, and ggml's per-node barrier on a CPU-resident layer."""

from __future__ import annotations

import dataclasses

import pytest

from daopsim.simulator.costs import cost_model
from daopsim.simulator.models import get_model
from daopsim.simulator.run_costs import runtime_cost_model
from daopsim.simulator.runtime_profiles import get_runtime

US = 1e-6


def test_eager_cpu_expert_pays_its_call_cost_on_the_formula_path() -> None:
    """hf-eager's 36.3 us per CPU expert call (pytorch/pytorch PR #50431: three Linear modules,
    the MLP and activation modules, two elementwise ops) is added to the weight stream; it is
    most of a small expert's extra cost and a fraction of a percent of a Mixtral one's."""
    rt = get_runtime("hf-eager")
    assert rt.cpu_expert_call_us == pytest.approx(
        3 * 9.74 + (3.08 - 0.91) + 3.08 + 2 * 0.91, abs=0.01
    )
    for name, low, high in (("olmoe-1b-7b", 0.08, 0.20), ("mixtral-8x7b", 0.0, 0.01)):
        plain = cost_model("rtx4090-pcie4", name)
        eager = runtime_cost_model(plain.hw, get_model(name), rt)
        extra = eager.cpu_expert_s(1) - plain.cpu_expert_s(1)
        assert extra == pytest.approx(36.3 * US)
        assert low <= extra / eager.cpu_expert_s(1) <= high, name
        # a batched call pays it once, whatever its token count
        assert eager.cpu_expert_s(256) - plain.cpu_expert_s(256) == pytest.approx(36.3 * US)


def test_a_measured_cpu_expert_time_already_holds_the_call_cost() -> None:
    """DAOP's measured 8.5 ms per Mixtral expert on its host is the call, fixed costs included."""
    model = get_model("mixtral-8x7b")
    plain = cost_model("a6000-pcie4", model)
    eager = runtime_cost_model(plain.hw, model, get_runtime("hf-eager"))
    assert eager.cpu_expert_s(1) == plain.cpu_expert_s(1) == pytest.approx(8.5e-3)
    assert eager.cpu_share(1) == plain.cpu_share(1)


def test_ggml_cpu_layer_pays_a_barrier_per_graph_node() -> None:
    """llama.cpp's CPU backend passes a barrier after each graph node: a CPU-resident layer pays
    cpu_node_us x nonexpert_kernels (1.04 us x 31) per forward pass, decode or prompt alike;
    other runtimes' CPU work pays none."""
    model = get_model("deepseek-v2-lite").with_precision("q4_0", None, "q4_0")
    rt = get_runtime("llama.cpp")
    hw = cost_model("rtx4080-pcie4", model, "ggml").hw
    ggml = runtime_cost_model(hw, model, rt)
    # the same runtime without the barrier (its GEMM shares and stream unchanged)
    plain = runtime_cost_model(hw, model, dataclasses.replace(rt, cpu_node_us=0.0))
    assert rt.cpu_layer_us == pytest.approx(1.04 * 31) and plain.cpu_layer_us == 0.0
    for n, ctx in ((1, 0), (1, 4096), (512, 0)):
        extra = ggml.cpu_nonexpert_layer_s(n, ctx) - plain.cpu_nonexpert_layer_s(n, ctx)
        assert extra == pytest.approx(1.04 * 31 * US)
    torch = runtime_cost_model(hw, model, get_runtime("ktransformers"))
    assert torch.cpu_layer_us == 0.0 and torch.cpu_call_us == 0.0


def test_fixed_costs_weigh_more_the_smaller_the_expert() -> None:
    """Across expert sizes on one host the fixed share of a CPU expert call falls as the expert
    grows: the call cost does not scale with the bytes (the issue's small-expert symptom)."""
    rt = get_runtime("hf-eager")
    shares = []
    for name in ("olmoe-1b-7b", "deepseek-v2-lite", "phi-3.5-moe", "mixtral-8x7b"):
        model = get_model(name)
        cm = runtime_cost_model(cost_model("rtx4090-pcie4", model).hw, model, rt)
        shares.append(36.3 * US / cm.cpu_expert_s(1))
    assert shares == sorted(shares, reverse=True)
