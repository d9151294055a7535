"""A run's cost model under its runtime profile: the profile and model with the runtime's CPU
kernels, stream efficiency, fixed costs, fused-MoE constants and GEMM rates, and whether its
one-token steps replay as a CUDA graph (docs/cost-model.md, "Runtime profiles", "CUDA-graph
decode").
"""

from __future__ import annotations

from typing import Any

from daopsim.policies.base import ResourceSpec
from daopsim.simulator.costs import CostModel, DeviceHostCosts, cost_model
from daopsim.simulator.hardware import HardwareProfile
from daopsim.simulator.runtime_profiles import RuntimeProfile


def runtime_cost_model(
    profile: HardwareProfile, model: Any, rt: RuntimeProfile, graph: bool = False
) -> CostModel:
    """The run's cost model: the profile and model with the runtime's CPU kernels, GPU stream
    efficiency (its calibration for the GPU's memory type where it has one), fixed CPU costs,
    fused-MoE constants, GEMM rates (GPU kernels and half point, CPU shares of dense and expert
    products) and (``graph``) its CUDA-graph node cost."""
    return cost_model(
        profile,
        model,
        rt.cpu_kernels,
        rt.graph_kernel_us if graph else 0.0,
        rt.gpu_stream_efficiency_on(profile.gpu.memory_type),
        rt.cpu_expert_call_us,
        rt.cpu_layer_us if rt.cpu_kernels == "ggml" else 0.0,
        rt.fused_moe_call_us if rt.fused_moe else 0.0,
        rt.fused_moe_stream_efficiency if rt.fused_moe else 0.0,
        rt.gpu_gemm_half_tokens,
        rt.cpu_gemm_share if rt.cpu_kernels == "ggml" else (),
        device_host(rt),
        rt.cpu_expert_gemm_share if rt.cpu_kernels == "ggml" else (),
        rt.gpu_kernels,
        rt.gpu_moe_tile_tokens if rt.gpu_kernels == "ggml" else 0.0,
    )


def device_host(rt: RuntimeProfile) -> DeviceHostCosts | None:
    """The host time a ``host_device`` runtime adds to its device's work (None otherwise)."""
    if not rt.host_device:
        return None
    return DeviceHostCosts(rt.step_host_us, rt.block_host_us, rt.expert_host_us)


def graph_replays(
    rt: RuntimeProfile,
    spec: ResourceSpec,
    n_cpu_layers: int,
    budget: int,
    total: int,
    mg: object | None,
    serving: object | None,
) -> bool:
    """Whether a run's one-token steps are CUDA-graph replays (docs/cost-model.md, "CUDA-graph
    decode"): a runtime that replays graphs, every layer and expert on one GPU (so the forward
    pass is one GPU split whose graph does not change between tokens), one sequence at a time
    (no serving batch), and either a whole-layer split (llama.cpp ``-ngl``), a runtime that
    graphs every policy's decode (``graph_all_policies``: vLLM, SGLang), or the all-GPU bound
    (``unlimited_memory``: every expert resident, nothing ever moves)."""
    return (
        rt.replays_graphs
        and (spec.gpu_blocks is not None or rt.graph_all_policies or spec.unlimited_memory)
        and n_cpu_layers == 0
        and budget >= total
        and mg is None
        and serving is None
    )
