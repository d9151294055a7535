"""CUDA-graph decode (docs/cost-model.md, "CUDA-graph decode"): llama.cpp replays a whole-GPU
one-token step as a graph, so its kernels cost ``graph_kernel_us`` instead of the eager
``gpu.launch_overhead_us`` (device) and ``dispatch_us`` (host); every other run is unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from daopsim.policies.base import ResourceSpec
from daopsim.simulator.costs import NONEXPERT_KERNELS_PER_BLOCK, cost_model, expert_kernels
from daopsim.simulator.errors import UserError
from daopsim.simulator.models import get_model
from daopsim.simulator.run_costs import graph_replays
from daopsim.simulator.runner import simulate
from daopsim.simulator.runtime_profiles import get_runtime, parse_runtime, with_costs
from daopsim.simulator.serving_config import ServingConfig

US = 1e-6
MODEL = get_model("mixtral-8x7b").with_precision("q4_k_m", "q4_k_m", "q4_k_m")
RUN = dict(
    policy="llama-cpp-layers", trace="ci-small", hw="a6000-pcie4", dtype="q4_k_m", sequences=1
)


def _eager_llama_cpp():
    return with_costs(get_runtime("llama.cpp"), graph_kernel_us=0.0, graph_step_us=0.0)


def test_llama_cpp_replays_graphs_and_says_where_the_figures_come_from() -> None:
    rt = get_runtime("llama.cpp")
    assert rt.replays_graphs
    assert 0 < rt.graph_kernel_us < get_runtime("llama.cpp").dispatch_us
    for field in ("graph_kernel_us", "graph_step_us"):
        assert "ocannl" in rt.sources[field]
    # runtimes that never replay graphs keep the field at 0
    assert not get_runtime("hf-eager").replays_graphs


def test_graph_replayed_profile_swaps_the_host_costs_and_refuses_without_graphs() -> None:
    rt = get_runtime("llama.cpp")
    g = rt.graph_replayed()
    assert g.dispatch_us == rt.graph_kernel_us
    assert g.step_us == pytest.approx(rt.step_us + rt.graph_step_us)
    assert g.sync_us == rt.sync_us and g.nonexpert_kernels == rt.nonexpert_kernels
    with pytest.raises(ValueError, match="replays no CUDA graphs"):
        get_runtime("ideal").graph_replayed()


def test_a_negative_graph_field_is_a_one_line_error() -> None:
    with pytest.raises(UserError, match="graph_kernel_us"):
        parse_runtime({"name": "x", "graph_kernel_us": -1.0}, "x.toml")
    with pytest.raises(ValueError, match="graph_kernel_us"):
        cost_model("a6000-pcie4", MODEL, "ggml", -0.5)


def test_one_token_kernels_pay_the_graph_node_and_prompts_the_eager_launch() -> None:
    eager = cost_model("a6000-pcie4", MODEL, "ggml")
    graph = cost_model("a6000-pcie4", MODEL, "ggml", 0.58)
    delta = eager.hw.gpu.launch_overhead_us * US - 0.58 * US
    assert graph.kernel_s(1) == pytest.approx(0.58 * US)
    assert graph.kernel_s(2) == eager.kernel_s(2) == eager.kernel_s(1)
    blocks = MODEL.layers / MODEL.moe_layers
    got = eager.nonexpert_layer_s(1, 100) - graph.nonexpert_layer_s(1, 100)
    assert got == pytest.approx(NONEXPERT_KERNELS_PER_BLOCK * blocks * delta, rel=1e-9)
    assert eager.gpu_expert_s(1) - graph.gpu_expert_s(1) == pytest.approx(
        expert_kernels(MODEL) * delta, rel=1e-9
    )
    # a prompt (or a batch of sequences) launches eagerly: nothing moves
    assert graph.nonexpert_layer_s(64, 0) == eager.nonexpert_layer_s(64, 0)
    assert graph.nonexpert_batch_layer_s(4, 400) == eager.nonexpert_batch_layer_s(4, 400)
    assert graph.gpu_expert_s(16) == eager.gpu_expert_s(16)
    # the graph can only remove launch cost, never add any
    assert graph.fused_moe_layer_s() < eager.fused_moe_layer_s()


@pytest.mark.parametrize(
    "change",
    [
        {"n_cpu_layers": 1},
        {"budget": 255},
        {"spec": ResourceSpec()},  # no whole-layer split (--cpu-moe, HOBBIT, ...)
        {"mg": object()},
        {"serving": ServingConfig(batch=2)},
        {"rt": get_runtime("ktransformers")},  # replays no graphs on the device
        {"rt": get_runtime("cuda-graph"), "budget": 255},  # vLLM/SGLang, experts move
    ],
)
def test_only_a_whole_gpu_single_sequence_run_replays(change: dict) -> None:
    base = dict(
        rt=get_runtime("llama.cpp"),
        spec=ResourceSpec(gpu_blocks=-1),
        n_cpu_layers=0,
        budget=256,
        total=256,
        mg=None,
        serving=None,
    )
    assert graph_replays(**base)
    assert not graph_replays(**{**base, **change})


def test_a_whole_gpu_decode_is_faster_with_graphs_and_a_cpu_split_is_not_touched() -> None:
    graph = simulate(**RUN, policy_options={"ngl": -1}, record=False)
    eager = simulate(**RUN, policy_options={"ngl": -1}, runtime=_eager_llama_cpp(), record=False)
    assert graph.config["runtime"]["dispatch_us"] == get_runtime("llama.cpp").graph_kernel_us
    assert graph.metrics["decode_tokens_per_s"] > eager.metrics["decode_tokens_per_s"]
    # GPU-bound here: the decode saves at most every launch's eager-minus-graph difference
    rt = get_runtime("llama.cpp")
    per_token = (
        (NONEXPERT_KERNELS_PER_BLOCK + 5)
        * MODEL.moe_layers
        * (cost_model("a6000-pcie4", MODEL).hw.gpu.launch_overhead_us - rt.graph_kernel_us)
        * US
    )
    saved = 1 / eager.metrics["decode_tokens_per_s"] - 1 / graph.metrics["decode_tokens_per_s"]
    assert 0 < saved <= per_token * (1 + 1e-9)
    # with CPU layers the graph changes every call: llama.cpp launches eagerly, bit for bit
    split = simulate(**RUN, policy_options={"ngl": 16}, record=False)
    split_eager = simulate(
        **RUN, policy_options={"ngl": 16}, runtime=_eager_llama_cpp(), record=False
    )
    for key in ("decode_tokens_per_s", "ttft_s", "e2e_s", "gpu_busy_frac", "dispatch_stall_s"):
        assert split.metrics[key] == split_eager.metrics[key]
    assert split.config["runtime"]["dispatch_us"] == get_runtime("llama.cpp").dispatch_us


def test_the_graph_figure_replaces_the_profile_launch_cost_not_the_roofline() -> None:
    """With a zero launch cost on the device the graph can only add its node cost."""
    hw = cost_model("a6000-pcie4", MODEL).hw
    free = dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, launch_overhead_us=0.0))
    eager = cost_model(free, MODEL, "ggml")
    graph = cost_model(free, MODEL, "ggml", 0.58)
    assert graph.nonexpert_layer_s(1, 10) > eager.nonexpert_layer_s(1, 10)
    assert graph.nonexpert_layer_s(1, 10) - eager.nonexpert_layer_s(1, 10) == pytest.approx(
        NONEXPERT_KERNELS_PER_BLOCK * MODEL.layers / MODEL.moe_layers * 0.58 * US, rel=1e-9
    )


def test_cuda_graph_replays_every_policy_whose_experts_stay_on_the_gpu() -> None:
    """Issue 30: vLLM and SGLang capture decode steps as graphs whatever the policy's split
    (``graph_all_policies``), so their device pays graph-node costs as llama.cpp's does."""
    base = dict(
        rt=get_runtime("cuda-graph"),
        spec=ResourceSpec(),
        n_cpu_layers=0,
        budget=256,
        total=256,
        mg=None,
        serving=None,
    )
    assert graph_replays(**base)
    assert not graph_replays(**{**base, "spec": ResourceSpec(), "rt": get_runtime("llama.cpp")})
    assert not graph_replays(**{**base, "serving": ServingConfig(batch=2)})
