"""Runtime profiles: a framework's host-side overheads (``--runtime hf-eager`` and friends).

A runtime profile says what the host thread that drives the GPU pays, not what the machine
has: how long it takes to issue one kernel, how many kernels it issues per MoE layer and per
GPU expert call, and where it blocks until the GPU has drained (a *sync*). It is data: one
TOML file per profile in ``hardware_profiles/runtimes/``, each field with its source
(docs/cost-model.md, "Runtime profiles"). A policy declares the runtime of the system it
models (``Policy.runtime_profile``); ``--runtime NAME`` overrides it.

The host thread itself is a resource of the machine: the engine core's
``daopsim.simulator.core.resources.HostThread`` (and the reference engine's own ``IssueThread``)
time it from these fields. A profile with no costs builds no host thread, and the timeline is
exactly the one of a machine without it.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from daopsim.simulator.data import profiles_dir, read_toml
from daopsim.simulator.errors import UserError, did_you_mean


def runtimes_dir() -> Path:
    """Folder of the bundled runtime profiles (hardware_profiles/runtimes/*.toml)."""
    return profiles_dir() / "runtimes"


#: numeric fields of a profile: (name, type, meaning)
FIELDS: tuple[tuple[str, type, str], ...] = (
    ("dispatch_us", float, "host time to issue one kernel (framework dispatch + launch call)"),
    ("sync_us", float, "host time from the GPU draining to the host thread running again"),
    ("step_us", float, "host time once per forward pass (e.g. a CUDA-graph replay's fixed cost)"),
    ("nonexpert_kernels", int, "kernels of one layer's non-expert part and router"),
    ("expert_kernels", int, "kernels of one GPU expert call"),
    ("routing_syncs", int, "syncs per layer once the router has run (routing to the host)"),
    ("expert_syncs", int, "syncs per GPU expert call, before its kernels are issued"),
    ("idle_expert_kernels", int, "ops issued per expert the MoE loop visits with no token"),
    ("idle_expert_syncs", int, "syncs per expert the MoE loop visits with no token"),
    (
        "graph_kernel_us",
        float,
        "device-visible cost of one kernel node when a whole-GPU one-token step is replayed "
        "as a CUDA graph (0: the runtime replays no graph)",
    ),
    ("graph_step_us", float, "fixed cost of one CUDA-graph replay (with graph_kernel_us)"),
    (
        "cpu_expert_call_us",
        float,
        "fixed host time of one CPU expert call beyond its weight stream and FLOPs (PyTorch's "
        "module calls and op dispatch for an eager expert on the CPU)",
    ),
    (
        "cpu_node_us",
        float,
        "host time per graph node the CPU backend runs (ggml's thread barrier), charged "
        "nonexpert_kernels times per CPU-resident layer and forward pass",
    ),
    (
        "fused_moe_call_us",
        float,
        "device time of one layer's fused MoE call in a graph-replayed step beyond its weight "
        "stream (0: the call's kernels cost one graph node each)",
    ),
    (
        "fused_moe_stream_efficiency",
        float,
        "share of the GPU's spec bandwidth the fused MoE kernels stream expert weights at, at "
        "most 1 (0: the runtime's gpu_stream_efficiency)",
    ),
    (
        "gpu_gemm_half_tokens",
        float,
        "tokens at which one of the runtime's GPU matrix products over more than "
        "GEMV_MAX_TOKENS tokens reaches half of gpu.bf16_tflops: a product over n tokens runs "
        "at n / (n + this) of it (0: every product at the full rate)",
    ),
    (
        "gpu_moe_tile_tokens",
        float,
        "token width of the tile ggml's GPU MoE product (MUL_MAT_ID on MMQ) gives each expert, "
        "chosen by the whole micro-batch: an expert's product over n tokens of a ggml block "
        "format costs the work of this width times ceil(n / this) tokens (0: its n tokens)",
    ),
    (
        "step_host_us",
        float,
        "host_device: host time of one forward pass outside its blocks (the model's call, "
        "embedding lookup, positions, mask, rotary tables, final norm, output head call, token "
        "pick)",
    ),
    (
        "attention_host_us",
        float,
        "host_device: host time of one attention module call (projections, rotary, cache "
        "update, attention kernel, output projection) beyond its arithmetic",
    ),
    ("norm_host_us", float, "host_device: host time of one RMSNorm module call (two per block)"),
    (
        "router_host_us",
        float,
        "host_device: host time of one router call (gate, softmax, top-k, renormalisation)",
    ),
    (
        "layer_glue_host_us",
        float,
        "host_device: host time of a block's own code outside its modules (the decoder layer's "
        "call and residual adds, the MoE block's call, one-hot, hit list and output buffer)",
    ),
    (
        "expert_host_us",
        float,
        "host_device: host time of one routed expert call in the MoE loop (token gather, the "
        "expert's linears and activation, routing weight, scatter-add) beyond its arithmetic",
    ),
)
#: fields a runtime may set only with ``host_device = true``: on an asynchronous device the
#: host's time is ``kernels x dispatch_us`` on the host thread, beside the device's
HOST_DEVICE_FIELDS = (
    "step_host_us",
    "attention_host_us",
    "norm_host_us",
    "router_host_us",
    "layer_glue_host_us",
    "expert_host_us",
)
#: norm modules of one transformer block (the input and post-attention RMSNorms of a pre-norm
#: block: every family of the catalogue; Qwen3's per-head q/k norms are inside its attention)
NORMS_PER_BLOCK = 2
_NUMERIC = {name: typ for name, typ, _ in FIELDS}
#: meaning of ``gpu_stream_efficiency`` (a share in (0, 1], default 1: not one of the
#: zero-default ``FIELDS``)
STREAM_EFFICIENCY_MEANING = (
    "share of the GPU's spec bandwidth (gpu.spec_mem_bw_gbs, else gpu.mem_bw_gbs) the "
    "runtime's GPU kernels stream weights and KV cache at, capped at gpu.mem_bw_gbs "
    "(1: the profile's bandwidth)"
)
#: meaning of the two share tables (``[cpu_gemm_share]``, ``[gpu_stream_efficiency_by_memory]``)
CPU_GEMM_SHARE_MEANING = (
    "share of the host's measured ggml GEMM rate (cpu.ggml_gemm_gflops, ik_llama.cpp's "
    "repacked kernels) the runtime's CPU matrix products reach, per weight precision "
    "(key 'default' for the others; no table: 1)"
)
MEMORY_EFFICIENCY_MEANING = (
    "gpu_stream_efficiency on a GPU whose memory is of this type (gpu.memory_type), where a "
    "calibration of the runtime on that memory exists"
)
#: values of a profile's ``attention`` field
ATTENTION_KINDS = ("fused", "eager")
#: CPU kernels a runtime can declare (``cpu_kernels``): ``default`` (PyTorch's eager CPU
#: kernels, the ``torch_*`` stream families of a profile) or ``ggml`` (ggml's CPU backend:
#: llama.cpp and the systems built on it; docs/cost-model.md, "CPU weight stream")
CPU_KERNELS = ("default", "ggml")
#: GPU kernels a runtime can declare (``gpu_kernels``): ``default`` (its GPU matrix products
#: run at ``gpu.bf16_tflops``) or ``ggml`` (ggml's CUDA/HIP prompt kernels: at the profile's
#: ``gpu.ggml_prompt_tflops`` where it states one; docs/cost-model.md, "GEMM at prompt shapes")
GPU_KERNELS = ("default", "ggml")


@dataclass(frozen=True)
class RuntimeProfile:
    """A framework's overhead profile (docs/cost-model.md, "Runtime profiles")."""

    name: str
    summary: str = ""
    dispatch_us: float = 0.0
    sync_us: float = 0.0
    step_us: float = 0.0
    nonexpert_kernels: int = 0
    expert_kernels: int = 0
    routing_syncs: int = 0
    expert_syncs: int = 0
    #: a MoE block that loops over every expert of the layer (HF transformers 4.51's
    #: Qwen3-MoE) also issues ops and syncs for the experts no token was routed to
    idle_expert_kernels: int = 0
    idle_expert_syncs: int = 0
    #: llama.cpp-family CUDA graphs (docs/cost-model.md, "CUDA-graph decode"): when the whole
    #: model runs on one GPU, its one-token decode steps are captured once and replayed, so each
    #: kernel costs the device (and the host) ``graph_kernel_us`` instead of the profile's
    #: ``gpu.launch_overhead_us`` and ``dispatch_us``, plus ``graph_step_us`` per replay; 0: no
    #: graph replay
    graph_kernel_us: float = 0.0
    graph_step_us: float = 0.0
    #: with ``graph_kernel_us``: every one-token step whose experts all stay on one GPU is a
    #: replay, whatever the policy's split (vLLM and SGLang capture decode steps as graphs by
    #: default); false: only llama.cpp's whole-layer split with every layer on the GPU
    graph_all_policies: bool = False
    #: fixed host time of one CPU expert call beyond its stream and FLOPs (docs/cost-model.md,
    #: "Per-call costs of a CPU expert"); a measured ``cpu_expert_ms`` already holds it
    cpu_expert_call_us: float = 0.0
    #: host time per graph node of the CPU backend (ggml's per-node thread barrier): a
    #: CPU-resident layer pays ``nonexpert_kernels`` of them per forward pass
    cpu_node_us: float = 0.0
    #: with ``fused_moe``: the device time of one layer's fused MoE call at one token in a
    #: graph-replayed step beyond streaming its experts' weights (routing, block alignment, the
    #: grouped GEMMs' fixed part, activation, sum; docs/cost-model.md, "Fused MoE at one token"),
    #: and the share of the spec bandwidth its grouped GEMMs stream the weights at (0: the
    #: runtime's ``gpu_stream_efficiency``)
    fused_moe_call_us: float = 0.0
    fused_moe_stream_efficiency: float = 0.0
    #: share of the GPU's spec bandwidth (``gpu.spec_mem_bw_gbs``, else ``gpu.mem_bw_gbs``) the
    #: runtime's GPU kernels stream weights and KV bytes at, in (0, 1] (docs/cost-model.md,
    #: "GPU stream efficiency"): the memory-bound term of its GPU work divides by
    #: ``min(gpu.mem_bw_gbs, gpu_stream_efficiency x spec)``; 1.0 leaves it as it was
    gpu_stream_efficiency: float = 1.0
    #: field -> where its value comes from
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    #: the GPU experts of a layer run as one fused MoE call (vLLM/SGLang ``fused_moe``,
    #: llama.cpp ``mul_mat_id``): the device pays that call's launches once per layer that runs
    #: a GPU expert, not each expert's eager kernels
    fused_moe: bool = False
    #: the runtime copies every forward pass's logits to host memory and samples there
    #: (llama.cpp's ``llama_decode``): a pass whose output matrix ran on the GPU ends with that
    #: copy (``CostModel.logits_copy_s``; docs/cost-model.md, "Logits to the host")
    logits_to_host: bool = False
    #: how the framework runs attention: ``"fused"`` (SDPA / flash kernels: the scores never
    #: reach device memory) or ``"eager"`` (transformers' eager attention: the scores of every
    #: head are written to device memory and passed over several times; docs/cost-model.md,
    #: "Eager attention")
    attention: str = "fused"
    #: the kernels the runtime runs CPU work with (one of ``CPU_KERNELS``): ``ggml`` streams
    #: CPU weights at ggml's rate (``daopsim.simulator.costs.CostModel.cpu_stream_gbs``)
    cpu_kernels: str = "default"
    #: the kernels the runtime runs GPU matrix products with (one of ``GPU_KERNELS``): ``ggml``
    #: multiplies at the profile's ``gpu.ggml_prompt_tflops`` where it states one
    #: (``daopsim.simulator.costs.CostModel.gpu_gemm_flops``)
    gpu_kernels: str = "default"
    #: a GPU matrix product over n > ``GEMV_MAX_TOKENS`` tokens runs at ``n / (n + this)`` of
    #: ``gpu.bf16_tflops`` (the kernel's tiles filled by n tokens; docs/cost-model.md, "GEMM at
    #: prompt shapes"); 0: at the full rate
    gpu_gemm_half_tokens: float = 0.0
    #: tokens per expert of the tile ggml's GPU MoE product gives each expert (chosen by the
    #: whole micro-batch, not by the expert's tokens): a product over n tokens of a ggml block
    #: format costs ``this x ceil(n / this)`` tokens of work (docs/cost-model.md, "GEMM at prompt
    #: shapes"); 0: its n tokens
    gpu_moe_tile_tokens: float = 0.0
    #: share of the host's measured ggml GEMM rate (``cpu.ggml_gemm_gflops``) the runtime's CPU
    #: matrix products reach, by weight precision, as sorted (dtype or ``"default"``, share)
    #: pairs; empty: 1 for every precision (docs/cost-model.md, "CPU GEMM by runtime")
    cpu_gemm_share: tuple[tuple[str, float], ...] = ()
    #: the same shares for the runtime's CPU expert products (the MoE layer's grouped product,
    #: ggml's ``MUL_MAT_ID``) where they run other kernels than its dense products, as sorted
    #: (dtype, share) pairs; a precision not listed takes ``cpu_gemm_share`` (docs/cost-model.md,
    #: "CPU GEMM by runtime")
    cpu_expert_gemm_share: tuple[tuple[str, float], ...] = ()
    #: ``gpu_stream_efficiency`` on a GPU of a given memory type (``gpu.memory_type``), as sorted
    #: (memory type, share) pairs; a type not listed takes ``gpu_stream_efficiency``
    #: (docs/cost-model.md, "GPU stream efficiency")
    gpu_stream_efficiency_by_memory: tuple[tuple[str, float], ...] = ()

    def cpu_gemm_share_of(self, dtype: str) -> float:
        """Share of the host's measured ggml GEMM rate this runtime's CPU kernels reach on
        weights stored at ``dtype`` (1 when the profile has no table)."""
        table = dict(self.cpu_gemm_share)
        return table.get(dtype, table.get("default", 1.0))

    def gpu_stream_efficiency_on(self, memory_type: str | None) -> float:
        """The runtime's GPU stream efficiency on a GPU with memory of ``memory_type``: its
        calibration for that memory where the profile has one, else ``gpu_stream_efficiency``."""
        if memory_type is None:
            return self.gpu_stream_efficiency
        return dict(self.gpu_stream_efficiency_by_memory).get(
            memory_type, self.gpu_stream_efficiency
        )

    #: the device is the host CPU itself, driven by the host thread (PyTorch eager on the CPU:
    #: the closed loop's stand-in for a GPU, docs/cost-model.md "A device on the host
    #: thread"): every op's host time and its arithmetic run one after the other on one thread,
    #: so the ``*_host_us`` fields are added to the device time of the parts they belong to and
    #: no host thread runs beside the device (``dispatch_us``, ``sync_us`` and ``step_us`` are 0)
    host_device: bool = False
    #: host_device: per forward pass, per module call and per routed expert call (µs; see
    #: ``FIELDS``); 0 in every other profile
    step_host_us: float = 0.0
    attention_host_us: float = 0.0
    norm_host_us: float = 0.0
    router_host_us: float = 0.0
    layer_glue_host_us: float = 0.0
    expert_host_us: float = 0.0

    @property
    def free(self) -> bool:
        """True when the host thread costs nothing: the engines then skip it entirely."""
        return self.dispatch_us == 0.0 and self.step_us == 0.0 and self.sync_us == 0.0

    @property
    def block_host_us(self) -> float:
        """host_device: host µs of one transformer block outside its experts: the attention,
        ``NORMS_PER_BLOCK`` norms, the router and the block's own code."""
        return (
            self.attention_host_us
            + NORMS_PER_BLOCK * self.norm_host_us
            + self.router_host_us
            + self.layer_glue_host_us
        )

    @property
    def replays_graphs(self) -> bool:
        """True when the runtime replays whole-GPU one-token steps as CUDA graphs."""
        return self.graph_kernel_us > 0.0

    def graph_replayed(self) -> RuntimeProfile:
        """The profile of a run whose steps are graph replays: the host pays each kernel node
        ``graph_kernel_us`` (not ``dispatch_us``) and each forward pass ``graph_step_us``."""
        if not self.replays_graphs:
            raise ValueError(f"runtime {self.name!r} replays no CUDA graphs (graph_kernel_us = 0)")
        return dataclasses.replace(
            self, dispatch_us=self.graph_kernel_us, step_us=self.step_us + self.graph_step_us
        )

    def with_logits_copy(self, seconds: float) -> RuntimeProfile:
        """The profile of a run whose forward passes end with the logits' copy to the host
        (``seconds`` each, ``CostModel.logits_copy_s``): the host thread, which waits for the
        previous pass's output before the next pass, pays it with the per-pass ``step_us``."""
        return dataclasses.replace(self, step_us=self.step_us + seconds * 1e6)

    def to_dict(self) -> dict[str, Any]:
        """The profile as plain data (``run --json`` key ``runtime``, ``runtimes show``)."""
        out: dict[str, Any] = {"name": self.name, "summary": self.summary}
        for name, _, _ in FIELDS:
            out[name] = getattr(self, name)
        out["gpu_stream_efficiency"] = self.gpu_stream_efficiency
        out["sources"] = dict(self.sources)
        out["fused_moe"] = self.fused_moe
        out["graph_all_policies"] = self.graph_all_policies
        out["attention"] = self.attention
        out["cpu_kernels"] = self.cpu_kernels
        out["gpu_kernels"] = self.gpu_kernels
        out["cpu_gemm_share"] = dict(self.cpu_gemm_share)
        out["cpu_expert_gemm_share"] = dict(self.cpu_expert_gemm_share)
        out["gpu_stream_efficiency_by_memory"] = dict(self.gpu_stream_efficiency_by_memory)
        out["host_device"] = self.host_device
        out["logits_to_host"] = self.logits_to_host
        return out

    @property
    def cpu_layer_us(self) -> float:
        """Fixed µs of one CPU-resident layer's graph on the CPU backend per forward pass:
        ``cpu_node_us`` per node, ``nonexpert_kernels`` nodes (the layer's graph nodes)."""
        return self.cpu_node_us * self.nonexpert_kernels


def parse_runtime(data: dict[str, Any], where: str) -> RuntimeProfile:
    """A profile from a TOML table; a bad field is a one-line ``UserError`` naming it."""
    others = (
        "fused_moe",
        "graph_all_policies",
        "attention",
        "cpu_kernels",
        "gpu_kernels",
        "gpu_stream_efficiency",
        "cpu_gemm_share",
        "cpu_expert_gemm_share",
        "gpu_stream_efficiency_by_memory",
        "host_device",
        "logits_to_host",
    )
    known = {"name", "summary", "source", *others, *_NUMERIC}
    for key in data:
        if key not in known:
            raise UserError(f"{where}: unknown field {key!r} (known: {', '.join(sorted(known))})")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise UserError(f"{where}: field 'name' must be a non-empty string")
    values: dict[str, Any] = {}
    for key, typ in _NUMERIC.items():
        v = data.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int | float) or (typ is int and v != int(v)):
            raise UserError(f"{where}: field {key!r} must be a {typ.__name__}, got {v!r}")
        if not math.isfinite(v) or v < 0:
            raise UserError(f"{where}: field {key!r} must be a finite number >= 0, got {v!r}")
        values[key] = typ(v)
    sources = data.get("source", {})
    if not isinstance(sources, dict) or not all(isinstance(s, str) for s in sources.values()):
        raise UserError(f"{where}: [source] must map field names to strings")
    for key in sources:
        if key not in _NUMERIC and key not in others:
            raise UserError(f"{where}: [source] names unknown field {key!r}")
    for flag in ("fused_moe", "graph_all_policies", "host_device", "logits_to_host"):
        v = data.get(flag, False)
        if not isinstance(v, bool):
            raise UserError(f"{where}: field {flag!r} must be true or false, got {v!r}")
        values[flag] = v
    _check_host_device(values, where)
    if values["fused_moe_stream_efficiency"] > 1.0:
        raise UserError(
            f"{where}: field 'fused_moe_stream_efficiency' must be at most 1, "
            f"got {values['fused_moe_stream_efficiency']!r}"
        )
    if values["graph_all_policies"] and not values["graph_kernel_us"]:
        raise UserError(f"{where}: field 'graph_all_policies' needs graph_kernel_us > 0")
    values.update(_parse_kernel_choices(data, where))
    values["cpu_gemm_share"] = _share_table(data, "cpu_gemm_share", where, _dtype_keys())
    values["cpu_expert_gemm_share"] = _share_table(
        data, "cpu_expert_gemm_share", where, _dtype_keys()
    )
    values["gpu_stream_efficiency_by_memory"] = _share_table(
        data, "gpu_stream_efficiency_by_memory", where, None
    )
    summary = data.get("summary", "")
    if not isinstance(summary, str):
        raise UserError(f"{where}: field 'summary' must be a string")
    return RuntimeProfile(name=name, summary=summary, sources=dict(sources), **values)


def _parse_kernel_choices(data: dict[str, Any], where: str) -> dict[str, Any]:
    """A runtime table's kernel choices: its attention kind, its CPU kernels and the share of
    the GPU's stream bandwidth its kernels reach; a bad one is a one-line ``UserError``."""
    values: dict[str, Any] = {}
    attention = data.get("attention", "fused")
    if attention not in ATTENTION_KINDS:
        raise UserError(
            f"{where}: field 'attention' must be one of {', '.join(ATTENTION_KINDS)}, "
            f"got {attention!r}"
        )
    values["attention"] = attention
    kernels = data.get("cpu_kernels", "default")
    if kernels not in CPU_KERNELS:
        raise UserError(
            f"{where}: field 'cpu_kernels' must be one of {', '.join(CPU_KERNELS)}, got {kernels!r}"
        )
    values["cpu_kernels"] = kernels
    gkernels = data.get("gpu_kernels", "default")
    if gkernels not in GPU_KERNELS:
        raise UserError(
            f"{where}: field 'gpu_kernels' must be one of {', '.join(GPU_KERNELS)}, "
            f"got {gkernels!r}"
        )
    values["gpu_kernels"] = gkernels
    eff = data.get("gpu_stream_efficiency", 1.0)
    if (
        isinstance(eff, bool)
        or not isinstance(eff, int | float)
        or not math.isfinite(eff)
        or not 0.0 < eff <= 1.0
    ):
        raise UserError(
            f"{where}: field 'gpu_stream_efficiency' must be a number in (0, 1], got {eff!r}"
        )
    values["gpu_stream_efficiency"] = float(eff)
    return values


def _dtype_keys() -> frozenset[str]:
    """Keys a ``[cpu_gemm_share]`` table may use: the catalogue's weight precisions and
    ``default``."""
    from daopsim.simulator.precisions import DTYPES

    return frozenset(DTYPES) | {"default"}


def _share_table(
    data: dict[str, Any], key: str, where: str, allowed: frozenset[str] | None
) -> tuple[tuple[str, float], ...]:
    """A table of name = share in (0, 1] (``allowed``: the names it may use), as sorted pairs;
    a bad entry is a one-line ``UserError`` naming ``key.name``."""
    table = data.get(key, {})
    if not isinstance(table, dict):
        raise UserError(f"{where}: [{key}] must be a table of name = share in (0, 1]")
    out = []
    for name, v in table.items():
        if allowed is not None and name not in allowed:
            raise UserError(
                f"{where}: field '{key}.{name}': unknown weight precision "
                f"(known: {', '.join(sorted(allowed))})"
            )
        if (
            isinstance(v, bool)
            or not isinstance(v, int | float)
            or not math.isfinite(v)
            or not 0.0 < v <= 1.0
        ):
            raise UserError(f"{where}: field '{key}.{name}' must be a number in (0, 1], got {v!r}")
        out.append((str(name), float(v)))
    return tuple(sorted(out))


def _check_host_device(values: dict[str, Any], where: str) -> None:
    """A ``host_device`` runtime charges host time with the device's (no host thread beside
    it); an asynchronous one cannot state host time per module."""
    if values["host_device"]:
        for key in ("dispatch_us", "sync_us", "step_us", "graph_kernel_us"):
            if values[key]:
                raise UserError(
                    f"{where}: field {key!r} must be 0 with host_device = true (the device is "
                    "the host thread: its host costs are the *_host_us fields)"
                )
        if values["fused_moe"]:
            raise UserError(f"{where}: field 'fused_moe' cannot be combined with host_device")
        return
    for key in HOST_DEVICE_FIELDS:
        if values[key]:
            raise UserError(
                f"{where}: field {key!r} needs host_device = true (an asynchronous runtime "
                "states its host time as kernels x dispatch_us)"
            )


def read_runtime(path: str | Path) -> RuntimeProfile:
    """A runtime profile from a TOML file of one's own (``daopsim probe`` writes one); a
    missing or malformed file is a one-line ``UserError`` naming it."""
    p = Path(path).expanduser()
    data = read_toml(p, "runtime profile")  # one reader for every text input (data.py)
    return parse_runtime(data, str(p))


@cache
def _bundled() -> dict[str, RuntimeProfile]:
    out: dict[str, RuntimeProfile] = {}
    for path in sorted(runtimes_dir().glob("*.toml")):
        with path.open("rb") as f:
            prof = parse_runtime(tomllib.load(f), str(path.name))
        if prof.name != path.stem:
            raise UserError(f"{path.name}: name {prof.name!r} differs from the file name")
        out[prof.name] = prof
    return out


def runtime_names() -> list[str]:
    """Names of the bundled runtime profiles."""
    return list(_bundled())


def get_runtime(name: str | RuntimeProfile) -> RuntimeProfile:
    """A bundled profile by name, or a TOML file of one's own by path (``*.toml``, or any path
    that exists; a profile passes through); unknown names are a UserError."""
    if isinstance(name, RuntimeProfile):
        return name
    prof = _bundled().get(name)
    if prof is None and (str(name).endswith(".toml") or Path(str(name)).expanduser().is_file()):
        return read_runtime(name)
    if prof is None:
        hint = did_you_mean(name, runtime_names())
        raise UserError(f"unknown runtime {name!r}{hint} (known: {', '.join(runtime_names())})")
    return prof


def with_costs(profile: RuntimeProfile, **changes: Any) -> RuntimeProfile:
    """A copy of ``profile`` with some fields changed (tests, what-if studies)."""
    return dataclasses.replace(profile, **changes)
