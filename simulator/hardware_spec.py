"""What a hardware profile holds: the GPU, the host link, the CPU, the SSD, power, several GPUs
and the measured per-model constants, one frozen dataclass each, with their defaults
(docs/hardware-profiles.md says where each figure comes from).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

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
