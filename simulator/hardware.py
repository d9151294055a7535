"""Hardware profiles: one TOML file per machine (GPU, host link, CPU, power, measured constants).

A profile holds facts, never formulas: the cost model (simulator/costs.py) turns them into seconds.
Every key is validated on load; a mistake raises :class:`ProfileError` naming the file and the key
(``gpu.mem_bw_gbs``), so the CLI prints one line and exits 2. The format is documented in
docs/hardware-profiles.md.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from daopsim.simulator.data import non_regular_kind, profiles_dir, read_toml
from daopsim.simulator.errors import ProfileError, UserError, did_you_mean

LINK_KINDS = ("pcie", "unified")
#: how two GPUs of one machine exchange activations (docs/hardware-profiles.md, "[gpus] and [peer]")
PEER_KINDS = ("nvlink", "pcie-p2p", "host")
LOAD_PATHS = ("pageable", "pinned")


@dataclass(frozen=True)
class GpuSpec:
    """The accelerator: memory, sustained bandwidth and tensor throughput, launch cost."""

    name: str
    memory_gb: float  # decimal GB (1e9 bytes); a "48 GB" NVIDIA card has 48 GiB = 51.54 GB
    usable_fraction: float  # share of memory_gb the runtime can allocate (context, fragmentation)
    mem_bw_gbs: float  # sustained device-memory bandwidth, GB/s
    bf16_tflops: float  # dense BF16 (FP32-accumulate) tensor throughput, TFLOPS
    #: device-visible cost of one eager kernel launch, µs (0 for a device driven by the host
    #: thread itself, whose kernels' call costs are its runtime's host costs)
    launch_overhead_us: float
    workspace_gb: float  # activations and allocator reserve kept free of weights, GB
    #: the vendor's (spec) memory bandwidth, GB/s, where ``mem_bw_gbs`` is a measured rate below
    #: it; None: ``mem_bw_gbs`` is the spec figure itself. A runtime's ``gpu_stream_efficiency``
    #: is a share of this figure (docs/cost-model.md, "GPU stream efficiency")
    spec_mem_bw_gbs: float | None = None
    #: the device memory's technology (``gddr6x``, ``lpddr5x``, ...; None: not stated): a runtime
    #: calibrated on that memory streams at its own share of the spec bandwidth
    #: (``RuntimeProfile.gpu_stream_efficiency_by_memory``, docs/cost-model.md)
    memory_type: str | None = None
    #: TFLOPS ggml's prompt kernels (llama.cpp's MMQ / cuBLAS / hipBLAS products) reach on this
    #: card: llama-bench pp512 of a dense 7B Q4_0 model (one 512-token micro-batch) times its
    #: FLOPs per prompt token, from llama.cpp's per-backend scoreboards (docs/cost-model.md,
    #: "GEMM at prompt shapes"); None: not stated, ggml runtimes use ``bf16_tflops``. Not
    #: inherited by a profile that names another card
    ggml_prompt_tflops: float | None = None

    @property
    def spec_bw_gbs(self) -> float:
        """The vendor's memory bandwidth, GB/s: ``spec_mem_bw_gbs``, else ``mem_bw_gbs``."""
        return self.mem_bw_gbs if self.spec_mem_bw_gbs is None else self.spec_mem_bw_gbs

    @property
    def usable_bytes(self) -> float:
        """Bytes the runtime may fill with weights, KV cache and workspace."""
        return self.memory_gb * 1e9 * self.usable_fraction


@dataclass(frozen=True)
class LinkSpec:
    """Host-to-device path: PCIe (DMA over the bus) or unified memory (DRAM-to-DRAM copies)."""

    kind: str  # "pcie" | "unified"
    h2d_pinned_gbs: float
    d2h_pinned_gbs: float
    h2d_pageable_gbs: float
    d2h_pageable_gbs: float
    copy_overhead_us: float  # fixed cost per copy call
    copy_engines: int  # async copy engines; H2D and D2H overlap when >= 2
    #: unified memory only: the one DRAM's bandwidth that copies and CPU experts share, GB/s
    #: (None: the GPU's ``mem_bw_gbs``)
    dram_bw_gbs: float | None = None
    #: copy engines each direction uses at once (cudaDeviceProp.asyncEngineCount bounds the
    #: total; docs/hardware-profiles.md): each serves one copy at a time, every copy in the
    #: profile's per-copy time. More than 1 needs ``copy_engines >= 2 x`` this
    copy_engines_per_direction: int = 1

    @property
    def unified(self) -> bool:
        """True when CPU and GPU share one memory (no bus; one bandwidth for both)."""
        return self.kind == "unified"


#: GPU memory technologies a profile may name (``gpu.memory_type``)
MEMORY_TYPES = ("gddr6", "gddr6x", "gddr7", "hbm2", "hbm2e", "hbm3", "hbm3e", "lpddr5", "lpddr5x")
#: CPU kernel families whose weight stream a profile states (``[cpu.core_stream_gbs]``,
#: ``[cpu.stream_gbs]``): PyTorch's eager CPU kernels at each weight precision, and ggml's
#: (llama.cpp and the systems built on it), which stream every format they run alike
#: (docs/cost-model.md, "CPU weight stream").
CPU_STREAM_FAMILIES = ("torch_fp32", "torch_bf16", "torch_fp16", "torch_int8", "ggml")
#: A family a profile does not state takes this one's value (documented assumptions:
#: PyTorch dequantises or converts other precisions into bf16-like passes; ggml has its own).
CPU_STREAM_FALLBACK = {
    "torch_fp32": "torch_bf16",
    "torch_fp16": "torch_bf16",
    "torch_int8": "torch_bf16",
}


@dataclass(frozen=True)
class CpuSpec:
    """The host CPU as the expert kernels see it (achieved, not peak, figures).

    The weight stream of a kernel family ``f`` is, in this order of precedence (docs/cost-model.md,
    "CPU weight stream"): ``stream_gbs[f]`` (measured on all ``cores_used`` cores); the legacy
    measured overrides ``ggml_stream_gbs`` (ggml) and ``mem_bw_gbs`` (every PyTorch family); else
    ``min(cores_used x core_stream_gbs[f], socket bound)`` with the socket bound
    ``socket_bw_gbs`` (measured) or ``dram_gbs x dram_efficiency``. The arithmetic is
    ``daopsim.simulator.costs.cpu_family_stream_gbs``.
    """

    name: str
    cores_used: int
    bf16_gflops: float  # achieved BF16 GEMM throughput over cores_used, GFLOPS
    fp32_gflops: float  # achieved FP32 GEMM throughput over cores_used, GFLOPS
    #: measured all-core weight stream of PyTorch's expert kernels, GB/s (None: not measured;
    #: the mechanism of ``core_stream_gbs`` applies)
    mem_bw_gbs: float | None = None
    #: DRAM bandwidth all of the CPU's threads together can stream (an all-core STREAM-like
    #: measurement), GB/s; None: ``dram_gbs x dram_efficiency`` bounds a stream, and concurrent
    #: CPU experts share the one call's stream (docs/cost-model.md, "Shared host CPU")
    socket_bw_gbs: float | None = None
    #: installed host memory, GB (decimal); None: not stated, so host memory is not modelled
    #: unless ``--host-memory-gb`` gives a budget (docs/serving.md, "An SSD tier")
    memory_gb: float | None = None
    #: achieved BF16 GEMM throughput of Intel AMX tile kernels over cores_used, GFLOPS (None: no
    #: AMX); CPU experts in AMX formats use it as their compute roof (docs/cost-model.md)
    amx_bf16_gflops: float | None = None
    #: theoretical DRAM bandwidth of one socket (channels x MT/s x 8 B), GB/s (None: not stated)
    dram_gbs: float | None = None
    #: share of ``dram_gbs`` an all-core read stream reaches on this platform (None: not stated)
    dram_efficiency: float | None = None
    #: GB/s ONE core streams weights at, per kernel family (``CPU_STREAM_FAMILIES``), as sorted
    #: (family, GB/s) pairs
    core_stream_gbs: tuple[tuple[str, float], ...] = ()
    #: measured all-core weight stream per kernel family, as sorted (family, GB/s) pairs
    stream_gbs: tuple[tuple[str, float], ...] = ()
    #: ggml's weight stream measured on this host (a llama.cpp CPU-only token-generation figure:
    #: weight bytes read per token x tokens/s), GB/s (None: not measured); a legacy spelling of
    #: ``stream_gbs.ggml``
    ggml_stream_gbs: float | None = None
    #: ggml's achieved matrix-multiply rate for its block formats measured on this host (a
    #: llama.cpp-family CPU prompt-processing figure: FLOPs per token x tokens/s), GFLOPS (None:
    #: not measured). Where given, CPU work on GGUF/MX weights under a ggml runtime takes it as
    #: its compute roof instead of ``bf16_gflops`` (docs/cost-model.md, "Kernel efficiency")
    ggml_gemm_gflops: float | None = None

    @property
    def socket_bound_gbs(self) -> float | None:
        """What the socket's DRAM gives all cores together: the measured ``socket_bw_gbs``, else
        ``dram_gbs x dram_efficiency`` (None when neither is stated)."""
        if self.socket_bw_gbs is not None:
            return self.socket_bw_gbs
        if self.dram_gbs is not None and self.dram_efficiency is not None:
            return self.dram_gbs * self.dram_efficiency
        return None


@dataclass(frozen=True)
class SsdSpec:
    """An NVMe drive that holds the experts host memory cannot (docs/serving.md, "An SSD tier")."""

    name: str
    seq_read_gbps: float  # sequential read, GB/s (decimal; data sheets quote MB/s)
    rand4k_read_iops: float  # 4 KiB random reads per second at the queue depth below
    queue_depth: int  # the queue depth the IOPS figure is quoted at
    read_latency_us: float  # one read's fixed cost (command, completion), µs


#: A GPU holding a CUDA context sits one DVFS step above bare idle: 26-66 W across the GPUs
#: measured in arXiv 2605.23918 (A100 53.7 -> 80.0 W, H100 71.8 -> 121.7 W, L40S 35.6 -> 102.1 W).
#: Without a measured ``gpu_active_idle_w`` a profile assumes a step of 40 W, at most half of its
#: idle-to-busy span (small cards).
CONTEXT_STEP_W = 40.0
#: 80 PLUS Gold requires 90 % efficiency at 50 % load (115 V internal), the default for the wall.
DEFAULT_PSU_EFFICIENCY = 0.90
#: Assumptions where no measurement was found: the rest of the box (board, fans, storage) and the
#: DRAM of a workstation with about four DIMMs at about 2.5 W each while in use.
DEFAULT_PLATFORM_W = 30.0
DEFAULT_DRAM_W = 10.0
#: How long a CPU worker thread keeps spinning after its work ends before it sleeps, ms (the
#: package stays at its busy power meanwhile): GNU libgomp, which PyTorch's Linux wheels run
#: their intra-op threads on, busy-waits GOMP_SPINCOUNT = 300,000 iterations of its PAUSE loop
#: before blocking when OMP_WAIT_POLICY is unset (GCC libgomp manual, "GOMP_SPINCOUNT"), and one
#: PAUSE takes about 140 cycles on Intel cores since Skylake (about 10 before, 10 to 50 on AMD;
#: MariaDB commit 042fc29, citing Intel): 300,000 x 140 / 3.0 GHz = 14 ms.
DEFAULT_CPU_SPIN_MS = 300_000 * 140 / 3.0e9 * 1e3


@dataclass(frozen=True)
class PowerSpec:
    """Power states of GPU, CPU package, DRAM and the platform, watts (for energy metrics).

    ``gpu_idle_w``/``cpu_idle_w`` are bare idle; during a run the GPU holds a CUDA context and
    waits at ``gpu_active_idle_w``, and the CPU package drives the GPU (threads spinning, the
    Python thread dispatching) at ``cpu_wait_w``. Optional fields default by the rules in
    :meth:`resolved` (documented in docs/hardware-profiles.md).
    """

    gpu_idle_w: float
    gpu_busy_w: float
    cpu_idle_w: float
    cpu_busy_w: float
    gpu_active_idle_w: float | None = None
    cpu_wait_w: float | None = None
    dram_w: float | None = None
    platform_w: float | None = None
    psu_efficiency: float | None = None
    cpu_spin_ms: float | None = None

    def resolved(self, cores_used: int) -> PowerSpec:
        """A copy with every optional field filled by its documented default rule."""
        gpu_active = self.gpu_active_idle_w
        if gpu_active is None:
            gpu_active = self.gpu_idle_w + min(
                CONTEXT_STEP_W, (self.gpu_busy_w - self.gpu_idle_w) / 2
            )
        cpu_wait = self.cpu_wait_w
        if cpu_wait is None:
            # two of the used cores active: the thread driving the GPU and one spinning worker
            share = min(1.0, 2.0 / max(1, cores_used))
            cpu_wait = self.cpu_idle_w + (self.cpu_busy_w - self.cpu_idle_w) * share
        return PowerSpec(
            gpu_idle_w=self.gpu_idle_w,
            gpu_busy_w=self.gpu_busy_w,
            cpu_idle_w=self.cpu_idle_w,
            cpu_busy_w=self.cpu_busy_w,
            gpu_active_idle_w=gpu_active,
            cpu_wait_w=cpu_wait,
            dram_w=DEFAULT_DRAM_W if self.dram_w is None else self.dram_w,
            platform_w=DEFAULT_PLATFORM_W if self.platform_w is None else self.platform_w,
            psu_efficiency=(
                DEFAULT_PSU_EFFICIENCY if self.psu_efficiency is None else self.psu_efficiency
            ),
            cpu_spin_ms=DEFAULT_CPU_SPIN_MS if self.cpu_spin_ms is None else self.cpu_spin_ms,
        )


@dataclass(frozen=True)
class MeasuredModel:
    """Per-model constants measured on this machine.

    ``cpu_expert_ms`` is an execution time: it anchors the CPU cost curve at one token.
    ``load_expert_ms`` is what the measuring system's policy uses to DECIDE (DAOP's and Fiddler's
    break-even rules); copies themselves are timed by the link model, unless
    ``load_overrides_link`` says explicitly that this measured time is the copy's execution time
    on ``load_path`` (give the reason in ``source``).
    """

    cpu_expert_ms: float  # one expert, one token, on the CPU
    load_expert_ms: float  # one expert host -> device as measured, on ``load_path``
    load_path: str  # "pageable" | "pinned": the host memory the load was measured from
    source: str
    dtype: str = "bf16"  # expert precision the measurement was taken at
    load_overrides_link: bool = False  # time copies on load_path with load_expert_ms
    #: one expert device -> host as measured; with ``load_overrides_link`` it times write-backs
    #: (None: the link's d2h rate)
    writeback_expert_ms: float | None = None
    #: with ``load_overrides_link``: the copy into, and the write-back out of, the slot of an
    #: expert the same layer computed (an in-use victim's: on a CPU standing in for a GPU that
    #: slot is still in the caches); None: the two above
    load_warm_expert_ms: float | None = None
    writeback_warm_expert_ms: float | None = None
    #: device times measured for this model's own module shapes (``daopsim probe --model``):
    #: at each token count of ``device_tokens`` (strictly increasing, from 1), one routed
    #: expert call (``device_expert_ms``) and one MoE layer's non-expert part at context 0 with
    #: its share of the output head (``device_layer_ms``); kernel launches included. They
    #: replace the roofline of those parts for this model at ``dtype`` (docs/cost-model.md,
    #: "Measured module times")
    device_tokens: tuple[int, ...] | None = None
    device_expert_ms: tuple[float, ...] | None = None
    device_layer_ms: tuple[float, ...] | None = None
    #: the same expert call right after its copy into a slot (its weights then in whatever
    #: cache the copy left them; ``gpu_expert_after_copy_s``)
    device_copied_expert_ms: tuple[float, ...] | None = None


@dataclass(frozen=True)
class MultiGpuSpec:
    """Several identical GPUs in one machine (``[gpus]``) and the path between them (``[peer]``).

    Each GPU is a copy of ``[gpu]`` with its own host uplink of ``[link]``'s figures, unless
    ``shared_uplink`` (the GPUs sit behind one PCIe switch or chipset link and take turns on
    it). ``peer_kind``: ``nvlink`` and ``pcie-p2p`` move activations directly at
    ``peer_gbs`` per direction plus ``peer_latency_us``; ``host`` (no peer access) stages them
    through host memory (a D2H copy on the sender's uplink, then an H2D copy on the
    receiver's). ``peer_pairs``: the GPU pairs the direct path joins (None: every pair);
    other pairs go through the host.
    """

    count: int
    shared_uplink: bool
    peer_kind: str
    peer_gbs: float | None = None
    peer_latency_us: float | None = None
    peer_pairs: tuple[tuple[int, int], ...] | None = None

    def direct(self, a: int, b: int) -> bool:
        """True when GPUs ``a`` and ``b`` exchange data over the direct peer path."""
        if self.peer_kind == "host":
            return False
        if self.peer_pairs is None:
            return True
        return (min(a, b), max(a, b)) in self.peer_pairs


@dataclass(frozen=True)
class HardwareProfile:
    """One machine: GPU, link, CPU, optional power, measured per-model constants."""

    name: str
    description: str
    gpu: GpuSpec
    link: LinkSpec
    cpu: CpuSpec
    power: PowerSpec | None = None
    measured: dict[str, MeasuredModel] = field(default_factory=dict)
    path: str = ""
    #: the NVMe drive of the SSD tier (None: the profile has no ``[ssd]`` table)
    ssd: SsdSpec | None = None
    #: several GPUs (``[gpus]`` and ``[peer]``); None: one GPU
    multi: MultiGpuSpec | None = None

    def __hash__(self) -> int:  # the dict field is not hashable; cost_model() caches on profiles
        return hash(
            (
                self.name,
                self.description,
                self.gpu,
                self.link,
                self.cpu,
                self.power,
                tuple(sorted(self.measured.items())),
                self.path,
                self.ssd,
                self.multi,
            )
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON output)."""
        return asdict(self)


# --- schema -------------------------------------------------------------------------------------
# (key, type) per section. "pos" = positive number (int or float), "nonneg" = number >= 0,
# "frac" = number in (0, 1], "int+" = positive integer, "str" = non-empty string, "tokens" = a
# list of token counts (1, then strictly increasing), "posarray" = a list of positive numbers,
# or a tuple of allowed strings.
_Schema = dict[str, Any]

_TOP: _Schema = {"name": "str", "description": "str"}
_GPU: _Schema = {
    "name": "str",
    "memory_gb": "pos",
    "usable_fraction": "frac",
    "mem_bw_gbs": "pos",
    "bf16_tflops": "pos",
    "launch_overhead_us": "nonneg",
    "workspace_gb": "pos",
    "spec_mem_bw_gbs": "pos",
    "memory_type": MEMORY_TYPES,
    "ggml_prompt_tflops": "pos",
}
_GPU_OPTIONAL = {"spec_mem_bw_gbs", "memory_type", "ggml_prompt_tflops"}
_LINK: _Schema = {
    "kind": LINK_KINDS,
    "h2d_pinned_gbs": "pos",
    "d2h_pinned_gbs": "pos",
    "h2d_pageable_gbs": "pos",
    "d2h_pageable_gbs": "pos",
    "copy_overhead_us": "pos",
    "copy_engines": "int+",
    "dram_bw_gbs": "pos",
    "copy_engines_per_direction": "int+",
}
_LINK_OPTIONAL = {"dram_bw_gbs", "copy_engines_per_direction"}
_CPU: _Schema = {
    "name": "str",
    "cores_used": "int+",
    "mem_bw_gbs": "pos",
    "dram_efficiency": "frac",
    "core_stream_gbs": "streams",
    "stream_gbs": "streams",
    "bf16_gflops": "pos",
    "fp32_gflops": "pos",
    "socket_bw_gbs": "pos",
    "memory_gb": "pos",
    "amx_bf16_gflops": "pos",
    "dram_gbs": "pos",
    "ggml_stream_gbs": "pos",
    "ggml_gemm_gflops": "pos",
}
_CPU_OPTIONAL = {
    "mem_bw_gbs",
    "dram_efficiency",
    "core_stream_gbs",
    "stream_gbs",
    "socket_bw_gbs",
    "memory_gb",
    "amx_bf16_gflops",
    "dram_gbs",
    "ggml_stream_gbs",
    "ggml_gemm_gflops",
}
_SSD: _Schema = {
    "name": "str",
    "seq_read_gbps": "pos",
    "rand4k_read_iops": "pos",
    "queue_depth": "int+",
    "read_latency_us": "pos",
}
_POWER: _Schema = {
    "gpu_idle_w": "pos",
    "gpu_busy_w": "pos",
    "cpu_idle_w": "pos",
    "cpu_busy_w": "pos",
    "gpu_active_idle_w": "pos",
    "cpu_wait_w": "pos",
    "dram_w": "pos",
    "platform_w": "pos",
    "psu_efficiency": "frac",
    "cpu_spin_ms": "pos",
}
_POWER_OPTIONAL = {
    "gpu_active_idle_w",
    "cpu_wait_w",
    "dram_w",
    "platform_w",
    "psu_efficiency",
    "cpu_spin_ms",
}
_MEASURED: _Schema = {
    "cpu_expert_ms": "pos",
    "load_expert_ms": "pos",
    "load_path": LOAD_PATHS,
    "source": "str",
    "dtype": "str",
    "load_overrides_link": "bool",
    "writeback_expert_ms": "pos",
    "load_warm_expert_ms": "pos",
    "writeback_warm_expert_ms": "pos",
    "device_tokens": "tokens",
    "device_expert_ms": "posarray",
    "device_layer_ms": "posarray",
    "device_copied_expert_ms": "posarray",
}
_MEASURED_OPTIONAL = {
    "dtype",
    "load_overrides_link",
    "writeback_expert_ms",
    "load_warm_expert_ms",
    "writeback_warm_expert_ms",
    "device_tokens",
    "device_expert_ms",
    "device_layer_ms",
    "device_copied_expert_ms",
}

#: Largest accepted value per key: generous physical bounds, an order of magnitude or more above
#: any machine built so far (docs/hardware-profiles.md, "Ranges"), so a typo such as
#: ``memory_gb = 1e300`` is a one-line error instead of overflowing the cost model later.
#: Measured constants are keyed ``measured.<field>`` whatever the model.
MAX_VALUES: dict[str, float] = {
    "gpu.memory_gb": 10_000,
    "gpu.mem_bw_gbs": 100_000,
    "gpu.spec_mem_bw_gbs": 100_000,
    "gpu.bf16_tflops": 100_000,
    "gpu.ggml_prompt_tflops": 100_000,
    "gpu.launch_overhead_us": 10_000,
    "gpu.workspace_gb": 10_000,
    "link.h2d_pinned_gbs": 10_000,
    "link.d2h_pinned_gbs": 10_000,
    "link.h2d_pageable_gbs": 10_000,
    "link.d2h_pageable_gbs": 10_000,
    "link.copy_overhead_us": 100_000,
    "link.copy_engines": 8,
    "link.copy_engines_per_direction": 4,
    "cpu.cores_used": 4096,
    "cpu.mem_bw_gbs": 10_000,
    "cpu.bf16_gflops": 1_000_000,
    "cpu.fp32_gflops": 1_000_000,
    "cpu.amx_bf16_gflops": 10_000_000,
    "cpu.dram_gbs": 10_000,
    "cpu.ggml_stream_gbs": 10_000,
    "cpu.core_stream_gbs": 10_000,
    "cpu.stream_gbs": 10_000,
    "cpu.ggml_gemm_gflops": 1_000_000,
    "power.gpu_idle_w": 100_000,
    "power.gpu_busy_w": 100_000,
    "power.cpu_idle_w": 100_000,
    "power.cpu_busy_w": 100_000,
    "power.gpu_active_idle_w": 100_000,
    "power.cpu_wait_w": 100_000,
    "power.dram_w": 100_000,
    "power.platform_w": 100_000,
    "power.cpu_spin_ms": 10_000,
    "cpu.memory_gb": 1_000_000,
    "ssd.seq_read_gbps": 1_000,
    "ssd.rand4k_read_iops": 1e9,
    "ssd.queue_depth": 65_536,
    "ssd.read_latency_us": 1e6,
    "measured.cpu_expert_ms": 1_000_000,
    "measured.load_expert_ms": 1_000_000,
    "measured.writeback_expert_ms": 1_000_000,
    "measured.load_warm_expert_ms": 1_000_000,
    "measured.writeback_warm_expert_ms": 1_000_000,
}


#: Smallest accepted value per rate (bandwidths, throughputs): generous bounds two orders of
#: magnitude or more below any machine's (a USB 2.0 link moves 0.06 GB/s), so a typo such as
#: ``h2d_pinned_gbs = 1e-9`` is a one-line error instead of a run whose clock reaches 1e10 s
#: (docs/hardware-profiles.md, "Ranges").
MIN_VALUES: dict[str, float] = {
    "gpu.mem_bw_gbs": 1.0,
    "gpu.spec_mem_bw_gbs": 1.0,
    "gpu.bf16_tflops": 0.01,
    "gpu.ggml_prompt_tflops": 0.01,
    "link.h2d_pinned_gbs": 0.01,
    "link.d2h_pinned_gbs": 0.01,
    "link.h2d_pageable_gbs": 0.01,
    "link.d2h_pageable_gbs": 0.01,
    "link.dram_bw_gbs": 0.1,
    "cpu.mem_bw_gbs": 0.1,
    "cpu.socket_bw_gbs": 0.1,
    "cpu.dram_gbs": 0.1,
    "cpu.ggml_stream_gbs": 0.1,
    "cpu.bf16_gflops": 0.1,
    "cpu.fp32_gflops": 0.1,
    "cpu.amx_bf16_gflops": 0.1,
    "cpu.ggml_gemm_gflops": 0.1,
    "ssd.seq_read_gbps": 0.001,
    "ssd.rand4k_read_iops": 10,
    "peer.bandwidth_gbs": 0.01,
}


def _check_range(path: Path, key: str, value: Any) -> None:
    """A number above its key's physical bound (MAX_VALUES), or a rate below its bound
    (MIN_VALUES), is a ProfileError."""
    parts = key.split(".")
    limit = MAX_VALUES.get(key)
    if limit is None and len(parts) == 3 and parts[0] == "cpu":
        limit = MAX_VALUES.get(f"cpu.{parts[1]}")
    if limit is None and parts[0] == "measured":
        limit = MAX_VALUES.get(f"measured.{parts[-1]}")
    if limit is not None and value > limit:
        raise ProfileError(path, f"{value:g} is above the physical bound {limit:g}", key)
    low = MIN_VALUES.get(key)
    if low is not None and value < low:
        raise ProfileError(path, f"{value:g} is below the physical bound {low:g}", key)


_SECTIONS = {"gpu", "link", "cpu", "power", "measured", "ssd", "gpus", "peer"}
_GPUS: _Schema = {"count": "int+", "shared_uplink": "bool"}
_PEER: _Schema = {"kind": PEER_KINDS, "bandwidth_gbs": "pos", "latency_us": "pos", "pairs": "pairs"}
_PEER_OPTIONAL = {"bandwidth_gbs", "latency_us", "pairs"}
MAX_VALUES.update({"gpus.count": 64, "peer.bandwidth_gbs": 10_000, "peer.latency_us": 100_000})


def _check_value(path: Path, key: str, kind: Any, value: Any) -> Any:
    """One value against its schema type; returns it (ints widened to float for numbers)."""
    if isinstance(kind, tuple):
        if not isinstance(value, str) or value not in kind:
            raise ProfileError(path, f"must be one of {', '.join(kind)}; got {value!r}", key)
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ProfileError(path, f"must be a string; got {type(value).__name__}", key)
        if not value.strip():
            raise ProfileError(path, "must not be empty", key)
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ProfileError(path, f"must be true or false; got {value!r}", key)
        return value
    if kind == "pairs":
        ok = isinstance(value, list) and all(
            isinstance(x, list)
            and len(x) == 2
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x)
            and x[0] != x[1]
            for x in value
        )
        if not ok:
            raise ProfileError(path, "must be a list of GPU index pairs, e.g. [[0, 1]]", key)
        return tuple(sorted((min(a, b), max(a, b)) for a, b in value))
    if kind == "streams":
        if not isinstance(value, dict) or not value:
            raise ProfileError(
                path,
                f"must be a table of kernel family = GB/s ({', '.join(CPU_STREAM_FAMILIES)})",
                key,
            )
        pairs = []
        for fam, v in value.items():
            if fam not in CPU_STREAM_FAMILIES:
                raise ProfileError(
                    path,
                    f"unknown kernel family (known: {', '.join(CPU_STREAM_FAMILIES)})",
                    f"{key}.{fam}",
                )
            number = _check_value(path, f"{key}.{fam}", "pos", v)
            _check_range(path, f"{key}.{fam}", number)
            pairs.append((fam, number))
        return tuple(sorted(pairs))
    if kind in ("tokens", "posarray"):
        return _check_array(path, key, kind, value)
    if kind == "int+":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProfileError(path, f"must be an integer; got {type(value).__name__}", key)
        if value <= 0:
            raise ProfileError(path, f"must be a positive integer; got {value}", key)
        return value
    # numbers
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProfileError(path, f"must be a number; got {type(value).__name__}", key)
    number = float(value)
    if kind == "nonneg":
        if not math.isfinite(number) or number < 0:
            raise ProfileError(path, f"must be a finite number >= 0; got {value}", key)
        return number
    if not math.isfinite(number) or number <= 0:
        raise ProfileError(path, f"must be a positive number; got {value}", key)
    if kind == "frac" and number > 1:
        raise ProfileError(path, f"must be in (0, 1]; got {value}", key)
    return number


def _check_array(path: Path, key: str, kind: str, value: Any) -> tuple[Any, ...]:
    """A non-empty list: ``tokens`` strictly increasing positive integers starting at 1,
    ``posarray`` positive finite numbers (at most the key's bound)."""
    if not isinstance(value, list) or not value:
        raise ProfileError(path, "must be a non-empty list of numbers", key)
    if kind == "tokens":
        if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise ProfileError(path, "must be a list of integers", key)
        if value[0] != 1 or any(b <= a for a, b in itertools.pairwise(value)):
            raise ProfileError(path, "must start at 1 and increase strictly", key)
        return tuple(value)
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ProfileError(path, f"must be a list of numbers; got {v!r}", key)
        if not math.isfinite(v) or v <= 0 or v > 1_000_000:
            raise ProfileError(path, f"must hold positive numbers up to 1e6; got {v!r}", key)
        out.append(float(v))
    return tuple(out)


def _section(
    path: Path,
    data: Any,
    schema: _Schema,
    prefix: str,
    optional: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Validate one table: no unknown keys, no missing keys, each value typed and in range."""
    if not isinstance(data, dict):
        raise ProfileError(path, f"must be a table; got {type(data).__name__}", prefix.rstrip("."))
    for key in data:
        if key not in schema:
            hint = ""
            if isinstance(data[key], dict):  # [measured.phi-3.5-moe] splits at the dots
                hint = '; quote table names that contain dots, e.g. [measured."phi-3.5-moe"]'
            hint = did_you_mean(str(key), schema) + hint
            raise ProfileError(
                path, f"unknown key{hint} (known: {', '.join(schema)})", f"{prefix}{key}"
            )
    out: dict[str, Any] = {}
    for key, kind in schema.items():
        if key not in data:
            if key in optional:
                continue
            raise ProfileError(path, "missing key", f"{prefix}{key}")
        out[key] = _check_value(path, f"{prefix}{key}", kind, data[key])
        if not isinstance(out[key], str | tuple | bool):
            _check_range(path, f"{prefix}{key}", out[key])
    return out


def parse_profile(data: dict[str, Any], path: str | os.PathLike[str]) -> HardwareProfile:
    """Validate a parsed TOML document and build the profile; ProfileError names file and key."""
    p = Path(path)
    for key in data:
        if key not in _TOP and key not in _SECTIONS:
            known = ", ".join([*_TOP, *sorted(_SECTIONS)])
            hint = did_you_mean(str(key), [*_TOP, *_SECTIONS])
            raise ProfileError(p, f"unknown key{hint} (known: {known})", key)
    top = {}
    for key, kind in _TOP.items():
        if key not in data:
            raise ProfileError(p, "missing key", key)
        top[key] = _check_value(p, key, kind, data[key])
    for sect in ("gpu", "link", "cpu"):
        if sect not in data:
            raise ProfileError(p, "missing section", sect)
    gpu = GpuSpec(**_section(p, data["gpu"], _GPU, "gpu.", _GPU_OPTIONAL))
    # a measured rate cannot beat the vendor's figure it is measured against
    if gpu.spec_mem_bw_gbs is not None and gpu.spec_mem_bw_gbs < gpu.mem_bw_gbs:
        raise ProfileError(
            p,
            f"must be >= gpu.mem_bw_gbs ({gpu.mem_bw_gbs:g}): the vendor figure bounds a "
            f"measured rate; got {gpu.spec_mem_bw_gbs:g}",
            "gpu.spec_mem_bw_gbs",
        )
    link = LinkSpec(**_section(p, data["link"], _LINK, "link.", _LINK_OPTIONAL))
    per = link.copy_engines_per_direction
    if per > 1 and link.copy_engines < 2 * per:
        raise ProfileError(
            p,
            f"needs link.copy_engines >= {2 * link.copy_engines_per_direction} (that many "
            f"engines in each direction); got copy_engines = {link.copy_engines}",
            "link.copy_engines_per_direction",
        )
    cpu = CpuSpec(**_section(p, data["cpu"], _CPU, "cpu.", _CPU_OPTIONAL))
    _check_cpu_stream(p, cpu)
    power = (
        PowerSpec(**_section(p, data["power"], _POWER, "power.", _POWER_OPTIONAL))
        if "power" in data
        else None
    )
    if power is not None:
        if power.gpu_busy_w < power.gpu_idle_w:
            raise ProfileError(p, "busy power below idle power", "power.gpu_busy_w")
        if power.cpu_busy_w < power.cpu_idle_w:
            raise ProfileError(p, "busy power below idle power", "power.cpu_busy_w")
        r = power.resolved(cpu.cores_used)
        assert r.gpu_active_idle_w is not None and r.cpu_wait_w is not None
        if not power.gpu_idle_w <= r.gpu_active_idle_w <= power.gpu_busy_w:
            raise ProfileError(
                p, "must lie between gpu_idle_w and gpu_busy_w", "power.gpu_active_idle_w"
            )
        if not power.cpu_idle_w <= r.cpu_wait_w <= power.cpu_busy_w:
            raise ProfileError(p, "must lie between cpu_idle_w and cpu_busy_w", "power.cpu_wait_w")
    measured: dict[str, MeasuredModel] = {}
    raw = data.get("measured", {})
    if not isinstance(raw, dict):
        raise ProfileError(p, f"must be a table; got {type(raw).__name__}", "measured")
    for model_name, table in raw.items():
        fields = _section(p, table, _MEASURED, f"measured.{model_name}.", _MEASURED_OPTIONAL)
        if "dtype" in fields:
            _check_dtype(p, f"measured.{model_name}.dtype", fields["dtype"])
        _check_device_tables(p, f"measured.{model_name}.", fields)
        measured[model_name.lower()] = MeasuredModel(**fields)
    ssd = SsdSpec(**_section(p, data["ssd"], _SSD, "ssd.")) if "ssd" in data else None
    multi = _multi(p, data)
    return HardwareProfile(
        name=top["name"],
        description=top["description"],
        gpu=gpu,
        link=link,
        cpu=cpu,
        power=power,
        measured=measured,
        path=str(p),
        ssd=ssd,
        multi=multi,
    )


def _check_cpu_stream(p: Path, cpu: CpuSpec) -> None:
    """The CPU's weight-stream fields are consistent: no achieved stream above the DRAM's
    theoretical bandwidth, a per-core rate only with a socket bound to cap it, and a PyTorch
    stream (``torch_bf16``: measured, or per core) for the CPU experts every runtime may run."""
    if cpu.dram_gbs is not None:
        for key in ("mem_bw_gbs", "socket_bw_gbs", "ggml_stream_gbs"):
            got = getattr(cpu, key)
            if got is not None and got > cpu.dram_gbs:
                raise ProfileError(p, "must not exceed cpu.dram_gbs (theoretical)", f"cpu.{key}")
        for fam, got in cpu.stream_gbs:
            if got > cpu.dram_gbs:
                raise ProfileError(
                    p, "must not exceed cpu.dram_gbs (theoretical)", f"cpu.stream_gbs.{fam}"
                )
    if cpu.dram_efficiency is not None and cpu.dram_gbs is None:
        raise ProfileError(p, "needs cpu.dram_gbs (it is a share of it)", "cpu.dram_efficiency")
    if cpu.core_stream_gbs and cpu.socket_bound_gbs is None:
        raise ProfileError(
            p,
            "a per-core stream needs the socket's bound: cpu.dram_gbs with cpu.dram_efficiency, "
            "or cpu.socket_bw_gbs",
            "cpu.core_stream_gbs",
        )
    families = dict(cpu.core_stream_gbs) | dict(cpu.stream_gbs)
    if cpu.mem_bw_gbs is None and "torch_bf16" not in families:
        raise ProfileError(
            p,
            "missing: give cpu.core_stream_gbs.torch_bf16 (GB/s per core, with cpu.dram_gbs and "
            "cpu.dram_efficiency) or a measured cpu.mem_bw_gbs",
            "cpu.core_stream_gbs.torch_bf16",
        )


def _multi(p: Path, data: dict[str, Any]) -> MultiGpuSpec | None:
    """The ``[gpus]`` and ``[peer]`` tables, checked together (both or neither)."""
    if "gpus" not in data and "peer" not in data:
        return None
    for sect in ("gpus", "peer"):
        if sect not in data:
            raise ProfileError(p, "missing section (give [gpus] and [peer] together)", sect)
    gpus = _section(p, data["gpus"], _GPUS, "gpus.")
    peer = _section(p, data["peer"], _PEER, "peer.", _PEER_OPTIONAL)
    if gpus["count"] < 2:
        raise ProfileError(p, "a multi-GPU profile has at least 2 GPUs", "gpus.count")
    if peer["kind"] != "host":
        for key in ("bandwidth_gbs", "latency_us"):
            if key not in peer:
                raise ProfileError(
                    p, f"missing key (needed for kind {peer['kind']!r})", f"peer.{key}"
                )
    pairs = peer.get("pairs")
    if pairs is not None and any(b >= gpus["count"] for _, b in pairs):
        raise ProfileError(p, f"names a GPU beyond gpus.count = {gpus['count']}", "peer.pairs")
    return MultiGpuSpec(
        count=gpus["count"],
        shared_uplink=gpus["shared_uplink"],
        peer_kind=peer["kind"],
        peer_gbs=peer.get("bandwidth_gbs"),
        peer_latency_us=peer.get("latency_us"),
        peer_pairs=pairs,
    )


def _check_device_tables(path: Path, prefix: str, fields: dict[str, Any]) -> None:
    """``device_expert_ms`` and ``device_layer_ms`` need ``device_tokens``, one value each."""
    tokens = fields.get("device_tokens")
    for key in ("device_expert_ms", "device_layer_ms", "device_copied_expert_ms"):
        table = fields.get(key)
        if table is None:
            continue
        if tokens is None:
            raise ProfileError(path, "needs device_tokens (the token counts it was measured at)",
                               f"{prefix}{key}")  # fmt: skip
        if len(table) != len(tokens):
            raise ProfileError(
                path, f"has {len(table)} values for {len(tokens)} device_tokens", f"{prefix}{key}"
            )


def _check_dtype(path: Path, key: str, dtype: str) -> None:
    from daopsim.simulator.models import DTYPE_BYTES

    if dtype not in DTYPE_BYTES:
        raise ProfileError(path, f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}", key)


def _read_toml(p: Path) -> dict[str, Any]:
    kind = non_regular_kind(p)
    if kind is not None:  # reading a FIFO or a device would block or never end
        raise ProfileError(p, f"is {kind}, not a regular profile file")
    if not p.is_file():
        raise ProfileError(p, "no such profile file")
    try:
        return read_toml(p, "profile")
    except UserError as exc:  # the shared reader's message, as a ProfileError
        raise ProfileError(p, str(exc).removeprefix(f"{p}: ")) from None


def _base_path(p: Path, base: Any) -> Path:
    """The file ``extends = NAME`` names: a bundled profile, or a path relative to ``p``."""
    if not isinstance(base, str) or not base.strip():
        raise ProfileError(p, f"must name a profile; got {base!r}", "extends")
    bundled = bundled_profiles()
    if base in bundled:
        return bundled[base]
    candidate = Path(base).expanduser()
    if not candidate.is_absolute():
        candidate = p.parent / candidate
    if candidate.suffix != ".toml":
        candidate = candidate.with_suffix(".toml")
    if not candidate.is_file():
        raise ProfileError(
            p, f"extends unknown profile {base!r} (not bundled, no file {candidate})", "extends"
        )
    return candidate


def _resolved(p: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The TOML document with its ``extends`` chain merged in (child keys win, table by table)."""
    data = _read_toml(p)
    if "extends" not in data:
        return data
    base_path = _base_path(p, data.pop("extends"))
    if base_path.resolve() in seen or base_path.resolve() == p.resolve():
        raise ProfileError(p, f"extends chain loops back to {base_path}", "extends")
    base = _resolved(base_path, (*seen, p.resolve()))
    merged: dict[str, Any] = {k: v for k, v in base.items() if k not in ("name", "description")}
    gpu_base, gpu_child = merged.get("gpu"), data.get("gpu")
    if (
        isinstance(gpu_base, dict)
        and isinstance(gpu_child, dict)
        and "mem_bw_gbs" in gpu_child
        and "spec_mem_bw_gbs" not in gpu_child
    ):
        # the spec figure qualifies the base's own mem_bw_gbs: a child naming another card's
        # bandwidth (rtx4080-pcie4 over rtx4090-pcie4) must not inherit it
        merged["gpu"] = {k: v for k, v in gpu_base.items() if k != "spec_mem_bw_gbs"}
    gpu_base = merged.get("gpu")
    if (
        isinstance(gpu_base, dict)
        and isinstance(gpu_child, dict)
        and "name" in gpu_child
        and gpu_child["name"] != gpu_base.get("name")
        and "ggml_prompt_tflops" not in gpu_child
    ):
        # a prompt rate measured on one card belongs to that card: a child naming another
        # card (rtx4080-pcie4 over rtx4090-pcie4) states its own or has none
        merged["gpu"] = {k: v for k, v in gpu_base.items() if k != "ggml_prompt_tflops"}
    for key, value in data.items():
        old = merged.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            # one level deep: for [measured], a child's model table replaces the base's whole;
            # the CPU's stream tables ([cpu.core_stream_gbs], [cpu.stream_gbs]) merge family by
            # family, so a child can restate one kernel family
            both = {**old, **value}
            if key == "cpu":
                for sub in ("core_stream_gbs", "stream_gbs"):
                    a, b = old.get(sub), value.get(sub)
                    if isinstance(a, dict) and isinstance(b, dict):
                        both[sub] = {**a, **b}
            merged[key] = both
        else:
            merged[key] = value
    return merged


def read_profile(path: str | os.PathLike[str]) -> HardwareProfile:
    """Load and validate one TOML file (following ``extends = "NAME"`` to its base profile)."""
    p = Path(path)
    return parse_profile(_resolved(p), p)


def bundled_profiles() -> dict[str, Path]:
    """Bundled profile files by name (file stem), sorted."""
    return {p.stem: p for p in sorted(profiles_dir().glob("*.toml"))}


def load_profile(name_or_path: str | os.PathLike[str]) -> HardwareProfile:
    """A bundled profile by name (``a6000-pcie4``) or a user TOML path."""
    text = str(name_or_path)
    bundled = bundled_profiles()
    if text in bundled:
        return read_profile(bundled[text])
    if text.lower() in bundled:
        return read_profile(bundled[text.lower()])
    if text.endswith(".toml") or os.sep in text or Path(text).expanduser().exists():
        return read_profile(Path(text).expanduser())
    raise UserError(
        f"unknown hardware profile {text!r}: not a file and not a bundled profile"
        f"{did_you_mean(text, bundled)} (valid: {', '.join(bundled) or '(none)'})"
    )


def list_profiles() -> list[HardwareProfile]:
    """Every bundled profile, loaded and validated, sorted by name."""
    return [read_profile(p) for p in bundled_profiles().values()]
