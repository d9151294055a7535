"""On a unified-memory machine one DRAM holds the GPU's allocations and the host's copies
(docs/cost-model.md, "Unified memory"). What a run keeps, counted the way the modelled system
holds it, never exceeds the usable memory; a refusal happens only when even the smallest
placement would exceed it; and a system that holds each expert once (llama.cpp) runs models
that a cache, which keeps a host copy of every expert beside its GPU copies, cannot hold whole.

The tally here is written from the systems' sources, not from the fit code: llama.cpp's loader
puts each tensor in one device buffer, Mixtral-offloading swaps experts between a GPU slot and
a host slot, HOBBIT's host also holds a low-bit copy of every expert, and a cache (LRU) copies
from a host copy it keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from daopsim.policies.base import ResourceSpec
from daopsim.policies.registry import make_policy
from daopsim.simulator.costs import cost_model
from daopsim.simulator.errors import DoesNotFit, UserError
from daopsim.simulator.fit import expert_fit, policy_buffers
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.models import get_model
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import make_trace

#: systems whose sources show each expert held once (the rest keep a host copy of every one)
HELD_ONCE = {"llama-cpp-layers", "llama-cpp-cpu-moe", "mixtral-offloading"}

#: (model, expert precision): sizes near the edges of the unified profiles below (gpt-oss-120b
#: MXFP4 experts 60.9 GB: once fits dgx-spark-gb10's 116.8 GB, twice does not; Mixtral q4_k_m
#: about 26 GB and Qwen3-30B-A3B q8_0 about 30 GB against jetson-orin-64g's 51.5 GB)
MODELS = [("gpt-oss-120b", "mxfp4"), ("mixtral-8x7b", "q4_k_m"), ("qwen3-30b-a3b", "q8_0")]
POLICIES: list[tuple[str, dict[str, Any]]] = [
    ("lru", {}),
    ("hobbit", {}),
    ("mixtral-offloading", {}),
    ("llama-cpp-layers", {"ngl": 99}),
    ("llama-cpp-layers", {"ngl": -1}),
    ("llama-cpp-cpu-moe", {"n_cpu_moe": 4}),
]


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """A two-sequence trace per model (one evaluated, one held out for calibration)."""
    root = tmp_path_factory.mktemp("unified")
    return {
        (name, dtype): make_trace(
            root / f"{name}.parquet",
            get_model(name).with_precision(dtype),
            sequences=2,
            prefill=4,
            decode=3,
        )
        for name, dtype in MODELS
    }


def held_bytes(
    hw_name: str, name: str, dtype: str, policy: str, opts: dict[str, Any], gpu_experts: int
) -> float:
    """Bytes the one memory holds with ``gpu_experts`` experts resident, from the system's
    own storage: workspace, non-expert weights once, the KV cache of the run's mean sequence,
    the policy's expert-sized buffers, the GPU's experts and the host's copies."""
    hw = load_profile(hw_name)
    model = get_model(name).with_precision(dtype)
    pol = make_policy(policy, opts)
    spec = pol.resources()
    ws = hw.gpu.workspace_gb if spec.workspace_gb is None else spec.workspace_gb
    kv_tokens = 4 + 3  # the traces' mean sequence: 4 prompt + 3 generated tokens
    total, e_gpu, e_host = model.total_experts, model.expert_bytes(), model.host_expert_bytes()
    host = (total - gpu_experts) * e_host if policy in HELD_ONCE else total * e_host
    if policy == "hobbit":
        host += total * model.expert_bytes(str(pol.options["low_bit"]))
    return (
        ws * 1e9
        + model.non_expert_bytes()
        + model.kv_bytes_per_token * kv_tokens
        + (policy_buffers(pol) + gpu_experts) * e_gpu
        + host
    )


@pytest.mark.parametrize("hw_name", ["jetson-orin-64g", "dgx-spark-gb10"])
@pytest.mark.parametrize(("name", "dtype"), MODELS)
@pytest.mark.parametrize(("policy", "opts"), POLICIES)
def test_what_runs_fits_the_one_memory(
    traces: dict[tuple[str, str], Path],
    hw_name: str,
    name: str,
    dtype: str,
    policy: str,
    opts: dict[str, Any],
) -> None:
    usable = load_profile(hw_name).gpu.usable_bytes
    try:
        r = simulate(
            policy, hw_name, traces[(name, dtype)], sequences=1, policy_options=opts,
            dtype=dtype, record=False,
        )  # fmt: skip
    except (DoesNotFit, UserError) as exc:
        # refused: even nothing resident beside the buffers would overflow the memory
        smallest = min(
            held_bytes(hw_name, name, dtype, policy, opts, g)
            for g in (0, get_model(name).total_experts)
        )
        assert smallest > usable, (str(exc), smallest / 1e9, usable / 1e9)
        return
    held = int(r.metrics["max_slots_held"])
    assert held > 0
    assert held_bytes(hw_name, name, dtype, policy, opts, held) <= usable
    if policy not in HELD_ONCE and r.config["max_gpu_experts"] < get_model(name).total_experts:
        # and the fit is tight: one more expert than it allows would not fit
        more = held_bytes(hw_name, name, dtype, policy, opts, r.config["max_gpu_experts"] + 1)
        assert more > usable


def test_llama_cpp_runs_what_a_cache_cannot_hold(traces: dict[tuple[str, str], Path]) -> None:
    """gpt-oss-120b at MXFP4 on the DGX Spark: llama.cpp holds each tensor once and runs it
    wholly on the GPU (llama.cpp's own DGX Spark page does, with -ngl 99 --mmap 0); an LRU cache
    that keeps a host copy of every expert cannot keep them all on the GPU too."""
    trace = traces[("gpt-oss-120b", "mxfp4")]
    total = get_model("gpt-oss-120b").total_experts
    common: dict[str, Any] = {"sequences": 1, "dtype": "mxfp4", "record": False}
    r = simulate("llama-cpp-layers", "dgx-spark-gb10", trace, policy_options={"ngl": 99}, **common)
    assert r.config["max_gpu_experts"] == total
    assert r.metrics["max_slots_held"] == total
    with pytest.raises(DoesNotFit, match="unified memory"):
        simulate("lru", "dgx-spark-gb10", trace, gpu_experts=total, **common)


def test_a_cpu_layer_frees_nothing_on_unified_memory() -> None:
    """Moving layers to the CPU moves their weights within the same DRAM: ngl=-1 (as many GPU
    layers as fit) keeps every layer on the GPU when the model fits, and cannot make a model
    fit that does not (Kimi-K2 at q4_k_m on a 64 GB Jetson)."""
    hw = load_profile("jetson-orin-64g")
    for name, dtype, fits in (("qwen3-30b-a3b", "q8_0", True), ("kimi-k2", "q4_k_m", False)):
        costs = cost_model(hw, get_model(name).with_precision(dtype))
        spec = make_policy("llama-cpp-layers", {"ngl": -1}).resources()
        fit = expert_fit(costs, policy_buffers(make_policy("llama-cpp-layers")), 64, spec)
        assert costs.cpu_layer_freed_bytes(64) == 0.0
        assert fit.weights_fit() is fits
        assert fit.max_experts == (costs.model.total_experts if fits else 0)


def test_bus_attached_hosts_keep_their_own_memory() -> None:
    """On a PCIe machine the host's copies live in host memory: how a system holds its
    experts does not change what fits on the GPU."""
    costs = cost_model("rtx4090-pcie4", get_model("qwen3-30b-a3b").with_precision("q4_k_m"))
    every = expert_fit(costs, 1, 128, ResourceSpec())
    once = expert_fit(costs, 1, 128, ResourceSpec(host_copies="offloaded"))
    assert every == once and every.host_bytes == 0 and once.refund == 0


def test_an_unknown_host_copies_value_is_one_line() -> None:
    with pytest.raises(UserError, match="host_copies must be one of all, offloaded"):
        ResourceSpec(host_copies="some")
