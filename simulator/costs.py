"""The cost model: seconds and bytes of every operation the engine times. Pure functions, no SimPy.

This is the one place where cost arithmetic lives. A :class:`CostModel` binds a hardware profile to
a model shape (whose ``dtype`` is the GPU expert precision, ``host_dtype`` the host copy's and
``nonexpert_dtype`` the rest's) and answers questions such as "how long does one expert take on
the GPU for n tokens" or "how long does one expert copy take from pinned memory". Every byte count
is at the precision's real size, scales included (daopsim.simulator.precisions.DTYPES). Formulas
(docs/cost-model.md has them with worked examples):

* GPU expert: roofline ``max(bytes / gpu.mem_bw, flops / gpu.bf16_tflops)`` plus one launch
  overhead per kernel of the expert's eager forward; ``gpu.mem_bw`` is scaled by the lower of
  the format's kernel efficiency and the runtime's GPU stream efficiency.
* CPU expert for n tokens: one batched call, ``max(weight stream, 2 x params x n / cpu throughput)``
  where the weight stream is the profile's measured one-token time for this model and dtype
  (``cpu_expert_ms``) when it has one, else ``host expert bytes / stream``, the stream of the
  run's CPU kernel family (PyTorch's at the weight precision, or ggml's under a ggml runtime):
  measured on all cores where the profile says, else ``min(cores x per-core stream, socket
  bound)`` (:func:`cpu_family_stream_gbs`). Linear ``n x cpu_expert_ms`` is a decision rule of
  DAOP and Fiddler, not how a batched call runs.
* Copies: ``copy_overhead + bytes / rate`` for the direction and host-memory kind, at the host
  precision; when the GPU holds another precision the copy also pays one GPU conversion pass. A
  measured load time is a policy's decision input (:meth:`CostModel.decision_load_s`); it
  replaces the copy's execution time only where the profile says so explicitly
  (``load_overrides_link = true``).
* Non-expert part of one MoE layer: roofline over the per-layer share of the non-expert weights
  (read once per call) and the KV cache (read for the context, written for the new tokens), at
  ``gpu.mem_bw x`` the runtime's GPU stream efficiency, plus launches.

Units: seconds out, bytes as ints, rates from the profile in GB/s (1e9), TFLOPS and GFLOPS.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from daopsim.simulator.errors import UserError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.hardware_spec import (
    CPU_STREAM_FALLBACK,
    CpuSpec,
    HardwareProfile,
    MeasuredModel,
)
from daopsim.simulator.models import ModelShape, get_model
from daopsim.simulator.precisions import DTYPES, dtype_bytes

#: Bytes per activation element: hidden states travel and are computed in bf16.
ACT_BYTES = 2
#: Eager kernels of one transformer block's non-expert part: 2 norms, q/k/v/o projections, RoPE,
#: attention, 2 residual adds, router GEMM, softmax, top-k, renormalise and a few small copies.
NONEXPERT_KERNELS_PER_BLOCK = 20
#: Context length the CLI reports ``nonexpert_layer_ms`` at.
DEFAULT_CONTEXT = 512
#: Device-memory bytes per attention score (one head, one query-key pair) that transformers'
#: eager attention moves on a bf16 model (docs/cost-model.md, "Eager attention"; a lower bound):
#: QK^T writes the bf16 score (2), the 1/sqrt(d) scaling reads and writes it (4), the mask add
#: too (4; the mask's own reads not counted), softmax(dtype=float32) on a bf16 input first
#: converts it to fp32 (2 + 4: ATen's fused half-to-float softmax is for fp16 only) then reads
#: and writes fp32 once (8), ``.to(bf16)`` reads fp32 and writes bf16 (6), and the PV matmul
#: reads the bf16 weights (2): 32 B. Dropout is a no-op at inference.
EAGER_ATTENTION_BYTES_PER_SCORE = 32

# --- per-format kernels (docs/cost-model.md, "Quantisation", "Kernel efficiency") -----------------
#: Share of the GPU's SPEC bandwidth (``gpu.spec_mem_bw_gbs``, else ``gpu.mem_bw_gbs``) a GPU expert
#: kernel streams weights at, by weight format kind
#: (``daopsim.simulator.precisions.DTYPES[...].kind``), capped at ``gpu.mem_bw_gbs``; formats not
#: listed stream like bf16 (at ``gpu.mem_bw_gbs``). GGUF: llama.cpp's Q4_K_M decode on an RTX 4080
#: moves at least 561 GB/s, 0.78 of the card's 716.8 GB/s spec (a lower bound). Until issue 30 this
#: was 0.87 of ``gpu.mem_bw_gbs`` (0.78 over a plain copy's 0.90 of spec), which discounted a
#: profile whose ``mem_bw_gbs`` is the spec figure by the copy's share a second time.
GPU_KERNEL_EFFICIENCY: dict[str, float] = {"gguf": 0.78}
#: Extra GPU kernels one expert call launches to dequantise its quantised scales and zero
#: points, by weight format kind. HQQ in Mixtral-offloading: on every forward, each of the 3
#: linears dequantises its 8-bit scales and its 8-bit zero points in PyTorch before the fused
#: Triton GEMM, three element-wise kernels each (HQQ's ``Quantizer.dequantize``: cast to fp16,
#: subtract the zero, multiply by the scale): 3 x 2 x 3 = 18.
DEQUANT_KERNELS: dict[str, int] = {"hqq": 18}
#: Extra bytes one expert call moves per quantisation group to dequantise its metadata, by
#: weight format kind (the 8-bit scale and zero are already in the format's bytes). HQQ: for the
#: scale and for the zero point, the fp16 cast writes 2 B, the subtraction reads and writes 2 B
#: each, the multiplication too (2 x 10 B), and the fused GEMM reads the fp16 scale and zero
#: back (4 B, a lower bound: each is read once): 24 B per group of weights.
DEQUANT_BYTES_PER_GROUP: dict[str, int] = {"hqq": 24}
#: GPU kernels of one layer's fused MoE call under a runtime with ``fused_moe`` (vLLM's and
#: SGLang's Triton ``fused_moe``; docs/cost-model.md, "Fused MoE"): the block alignment of the
#: routed tokens by expert, the grouped gate/up GEMM over every selected expert, the activation,
#: the grouped down GEMM, and the sum over the top-k outputs. Router kernels (softmax, top-k,
#: renormalise) are part of the non-expert launches. Quantised weights are dequantised inside
#: the grouped GEMMs, so no extra kernels.
FUSED_MOE_KERNELS = 5
#: Extra fixed device time of one fused MoE call at one token, by expert weight format, beyond
#: the runtime's ``fused_moe_call_us`` (measured on bf16 weights): an FP8 (w8a8) call also
#: quantises the routed tokens' activations before each grouped GEMM. vLLM's
#: benchmark_moe.py on an H100 SXM (3350 GB/s spec) times Qwen3-30B-A3B's fused MoE in
#: fp8_w8a8 at batch 1 at 44.54 us (vllm-project/vllm PR #24700, main's default config); the
#: bf16 rule (22.8 us + 37.75 MB of FP8 weights at 0.562 x 3350 GB/s) gives 42.85 us, 1.7 us
#: short (docs/cost-model.md, "Fused MoE at one token").
FUSED_MOE_FORMAT_EXTRA_US: dict[str, float] = {"fp8": 1.7}
#: Weight formats Intel AMX tiles multiply (BF16 and INT8); with ``cpu.amx_bf16_gflops`` their
#: CPU experts get the AMX compute roof when a call has more than ``AMX_MAX_AVX512_TOKENS``
#: tokens (kTransformers' AMX backend switches to AVX-512 kernels at 4 tokens or fewer).
AMX_DTYPES = frozenset({"bf16", "int8"})
AMX_MAX_AVX512_TOKENS = 4
#: Weight formats ggml stores and streams on the CPU (its kernel family applies to them on a
#: runtime with ``cpu_kernels = "ggml"``): its block formats (GGUF kinds, MXFP4) and its float
#: types; ggml has no CPU type for fp8, bare int8/int4, AWQ/GPTQ or HQQ, which keep PyTorch's.
GGML_CPU_KINDS = frozenset({"gguf", "mx"})
GGML_CPU_DTYPES = frozenset({"fp32", "fp16", "bf16"})
#: Largest token count ggml's CUDA backend multiplies with its vector kernels (``mul_mat_vec_q``,
#: ``MMVQ_MAX_BATCH_SIZE`` in ggml-org/llama.cpp ``ggml/src/ggml-cuda/mmvq.cuh``): a product over
#: more tokens runs as a tiled matrix product (``mul_mat_q``), the runtime's
#: ``gpu_gemm_half_tokens`` applies to it (docs/cost-model.md, "GEMM at prompt shapes")
GEMV_MAX_TOKENS = 8
#: Bytes of one logit on its way to the host: llama.cpp's ``llama_decode`` copies the output
#: tensor's ``n_outputs x n_vocab`` fp32 values into its pinned output buffer
#: (``ggml_backend_tensor_get_async`` in ``src/llama-context.cpp``; docs/cost-model.md, "Logits
#: to the host")
LOGIT_BYTES = 4
#: Tokens of the product ``gpu.ggml_prompt_tflops`` is measured at: llama-bench's pp512 runs a
#: 512-token prompt as one micro-batch (its default ``n_ubatch``), so under a runtime's fill
#: curve a dense product over this many tokens runs at that rate (docs/cost-model.md, "GEMM at
#: prompt shapes")
GGML_PROMPT_TOKENS = 512
#: PyTorch's kernel family by weight precision (``CpuSpec.core_stream_gbs`` keys); formats it
#: dequantises into bf16 passes (fp8, int4, AWQ/GPTQ, HQQ, GGUF without ggml) are ``torch_bf16``.
TORCH_CPU_FAMILY = {"fp32": "torch_fp32", "fp16": "torch_fp16", "int8": "torch_int8"}


def cpu_stream_family(cpu_kernels: str, dtype: str) -> str:
    """The CPU kernel family that streams weights stored at ``dtype`` under a runtime's CPU
    kernels (``default``: PyTorch's; ``ggml``: llama.cpp's for the formats ggml runs)."""
    if cpu_kernels == "ggml" and (dtype in GGML_CPU_DTYPES or DTYPES[dtype].kind in GGML_CPU_KINDS):
        return "ggml"
    return TORCH_CPU_FAMILY.get(dtype, "torch_bf16")


def cpu_family_stream_gbs(cpu: CpuSpec, family: str) -> float:
    """GB/s at which kernel family ``family`` streams weights on all ``cpu.cores_used`` cores
    (docs/cost-model.md, "CPU weight stream"). Precedence: a measured all-core stream
    (``cpu.stream_gbs``; the legacy ``cpu.ggml_stream_gbs`` for ggml and ``cpu.mem_bw_gbs`` for
    every PyTorch family), capped at a measured ``cpu.socket_bw_gbs``; else the mechanism
    ``min(cores_used x core_stream_gbs, socket bound)``, the socket bound being
    ``cpu.socket_bw_gbs`` or ``dram_gbs x dram_efficiency``. A PyTorch family the profile does not
    state takes ``torch_bf16``'s figures (``CPU_STREAM_FALLBACK``); a family with no figure at all
    is a :class:`UserError` naming the field to set."""
    measured = dict(cpu.stream_gbs)
    per_core = dict(cpu.core_stream_gbs)
    names = (family, CPU_STREAM_FALLBACK[family]) if family in CPU_STREAM_FALLBACK else (family,)
    for name in names:
        bw = measured.get(name)
        if bw is None:
            bw = cpu.ggml_stream_gbs if name == "ggml" else cpu.mem_bw_gbs
        if bw is not None:
            return min(bw, cpu.socket_bw_gbs) if cpu.socket_bw_gbs is not None else bw
        core = per_core.get(name)
        if core is not None:
            bound = cpu.socket_bound_gbs
            assert bound is not None  # read_profile refuses a per-core rate without a bound
            return min(cpu.cores_used * core, bound)
    raise UserError(
        f"the profile's CPU ({cpu.name}) states no weight stream for {family} kernels: set "
        f"cpu.core_stream_gbs.{family} (GB/s per core) or a measured all-core "
        f"cpu.stream_gbs.{family} (docs/hardware-profiles.md, [cpu])"
    )


def gpu_kernel_efficiency(dtype: str) -> float:
    """Share of the GPU's spec bandwidth a GPU expert kernel at ``dtype`` streams at (1.0: the
    profile's ``gpu.mem_bw_gbs``, like bf16)."""
    return GPU_KERNEL_EFFICIENCY.get(DTYPES[dtype].kind, 1.0)


def dequant_kernels(dtype: str) -> int:
    """Extra GPU kernel launches per expert call to dequantise ``dtype``'s scales (0 if none)."""
    return DEQUANT_KERNELS.get(DTYPES[dtype].kind, 0)


def dequant_bytes_per_weight(dtype: str) -> float:
    """Extra bytes per weight one expert call moves to dequantise ``dtype``'s scales (0 if none).

    The group size is the ``_g<N>`` of the format's name (``hqq2_g16``: 16 weights per group).
    """
    per_group = DEQUANT_BYTES_PER_GROUP.get(DTYPES[dtype].kind, 0)
    if not per_group:
        return 0.0
    m = re.search(r"_g(\d+)$", dtype)
    if m is None:
        raise ValueError(f"dtype {dtype!r} has per-group dequantisation but no _g<N> group size")
    return per_group / int(m.group(1))


def expert_kernels(model: ModelShape) -> int:
    """Eager kernel launches of one expert call: a GEMM per matrix plus the element-wise ops.

    Gated FFN (3 matrices): w1, w3, activation, multiply, w2 = 5.
    Plain FFN (2 matrices): w_in, activation, w_out = 3.
    """
    return 2 * model.expert_matrices - 1


@dataclass(frozen=True)
class DeviceHostCosts:
    """Host time a runtime whose device is the host thread itself (``RuntimeProfile.
    host_device``: PyTorch eager on the CPU) adds to the device's work, µs (docs/cost-model.md,
    "A device on the host thread"). On such a device an op's host time and its arithmetic run
    one after the other on one thread, so they add up."""

    #: per forward pass (spread evenly over its MoE layers' non-expert parts, as the output
    #: head's bytes are)
    step_us: float = 0.0
    #: per transformer block outside its routed experts (attention, norms, router, the block's
    #: own code)
    block_us: float = 0.0
    #: per routed expert call
    expert_us: float = 0.0


def _interp(tokens: tuple[int, ...], values: tuple[float, ...], n: float) -> float:
    """A measured per-token-count table at ``n`` tokens, in seconds: linear between the
    measured counts, the first value below the first count (a call costs at least its one-token
    time), the last segment's slope (at least 0) beyond the last count."""
    if n <= tokens[0]:
        return values[0] * 1e-3
    for i in range(1, len(tokens)):
        if n <= tokens[i]:
            a, b = tokens[i - 1], tokens[i]
            return (values[i - 1] + (values[i] - values[i - 1]) * (n - a) / (b - a)) * 1e-3
    if len(tokens) == 1:
        return values[0] * 1e-3
    slope = max(0.0, (values[-1] - values[-2]) / (tokens[-1] - tokens[-2]))
    return (values[-1] + slope * (n - tokens[-1])) * 1e-3


def _check_tokens(n_tokens: float, what: str = "n_tokens") -> None:
    if n_tokens < 0 or not math.isfinite(n_tokens):
        raise ValueError(f"{what} must be a finite number >= 0, got {n_tokens}")


@dataclass(frozen=True)
class CostModel:
    """Costs of one model's operations on one machine; built (and cached) by :func:`cost_model`.

    ``model.dtype`` is the GPU expert precision and ``model.host_precision`` the host copy's:
    expert bytes scale with them, compute uses the same roofline (weights are dequantised into
    bf16 GEMMs, so the bf16 throughput applies; fp32 experts use the fp32 throughput on the CPU).
    """

    hw: HardwareProfile
    model: ModelShape
    #: the runtime's CPU kernels (``RuntimeProfile.cpu_kernels``): ``ggml`` streams CPU weights
    #: in ggml's kernel family (:meth:`cpu_stream_gbs`), ``default`` in PyTorch's
    cpu_kernels: str = "default"
    #: device-visible µs of one kernel node in a CUDA-graph replay (``RuntimeProfile.
    #: graph_kernel_us``) when the run's one-token steps are replayed as graphs; 0: every
    #: kernel costs ``gpu.launch_overhead_us`` (docs/cost-model.md, "CUDA-graph decode")
    graph_kernel_us: float = 0.0
    #: share of the GPU's spec bandwidth (``gpu.spec_mem_bw_gbs``, else ``gpu.mem_bw_gbs``) the
    #: runtime's GPU kernels stream weights and KV cache at (``RuntimeProfile.
    #: gpu_stream_efficiency``, docs/cost-model.md "GPU stream efficiency"): the memory-bound
    #: term of every GPU expert call and non-expert part divides by ``min(gpu.mem_bw_gbs,
    #: this x spec)``; 1.0 leaves it unchanged
    gpu_stream_efficiency: float = 1.0
    #: fixed host seconds of one CPU expert call beyond its weight stream and FLOPs, on the
    #: formula path (``RuntimeProfile.cpu_expert_call_us``: PyTorch's module calls and op
    #: dispatch for an eager expert); a measured ``cpu_expert_ms`` already holds it
    cpu_call_us: float = 0.0
    #: fixed seconds of one CPU-resident layer's graph on the CPU backend, per forward pass
    #: (``RuntimeProfile.cpu_node_us`` x its nodes per layer: ggml's per-node thread barrier)
    cpu_layer_us: float = 0.0
    #: device µs of one layer's fused MoE call in a graph-replayed step beyond its weight
    #: stream (``RuntimeProfile.fused_moe_call_us``; docs/cost-model.md, "Fused MoE at one
    #: token"); 0: ``FUSED_MOE_KERNELS`` graph nodes
    fused_moe_call_us: float = 0.0
    #: share of the spec bandwidth a fused MoE call's grouped GEMMs stream expert weights at
    #: (``RuntimeProfile.fused_moe_stream_efficiency``); 0: ``gpu_stream_efficiency``
    fused_moe_stream_efficiency: float = 0.0
    #: tokens at which one of the runtime's GPU matrix products over more than
    #: ``GEMV_MAX_TOKENS`` tokens reaches half of ``gpu.bf16_tflops`` (``RuntimeProfile.
    #: gpu_gemm_half_tokens``; docs/cost-model.md, "GEMM at prompt shapes"); 0: the full rate
    gpu_gemm_half_tokens: float = 0.0
    #: the runtime's GPU kernels (``RuntimeProfile.gpu_kernels``): ``ggml`` multiplies at the
    #: profile's ``gpu.ggml_prompt_tflops`` where it states one (:meth:`gpu_gemm_flops`)
    gpu_kernels: str = "default"
    #: token width of the tile ggml's GPU MoE product gives each expert
    #: (``RuntimeProfile.gpu_moe_tile_tokens``, :meth:`gpu_expert_gemm_s`); 0: none
    gpu_moe_tile_tokens: float = 0.0
    #: share of ``cpu.ggml_gemm_gflops`` the runtime's CPU matrix products reach, by weight
    #: precision (``RuntimeProfile.cpu_gemm_share``; docs/cost-model.md, "CPU GEMM by
    #: runtime"); empty: 1
    cpu_gemm_share: tuple[tuple[str, float], ...] = ()
    #: the shares of the runtime's CPU expert products (``RuntimeProfile.
    #: cpu_expert_gemm_share``: ggml's ``MUL_MAT_ID``, which mainline llama.cpp runs with its
    #: row-by-row dot products where a dense product of the same precision takes llamafile's
    #: tiled kernels; docs/cost-model.md, "CPU GEMM by runtime"); empty: ``cpu_gemm_share``
    cpu_expert_gemm_share: tuple[tuple[str, float], ...] = ()
    #: a runtime whose device is the host thread (``RuntimeProfile.host_device``): the host
    #: time it adds to the device's work (None: the device runs beside the host thread)
    device_host: DeviceHostCosts | None = None

    # --- sizes -----------------------------------------------------------------------------------
    @cached_property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert as the GPU holds it (``model.dtype``)."""
        return self.model.expert_bytes()

    @cached_property
    def host_expert_bytes(self) -> int:
        """Bytes of one routed expert as the host holds it (``model.host_precision``)."""
        return self.model.host_expert_bytes()

    @property
    def link_expert_bytes(self) -> int:
        """Bytes one expert copy moves over the link: the host's copy, in either direction."""
        return self.host_expert_bytes

    @property
    def split_precision(self) -> bool:
        """True when the GPU and the host hold experts at different precisions."""
        return self.model.host_precision != self.model.dtype

    @cached_property
    def nonexpert_layer_bytes(self) -> int:
        """Non-expert weight bytes one call of one MoE layer reads (lm_head spread over layers)."""
        return round(self.model.non_expert_bytes_read_per_token() / self._moe)

    @property
    def _moe(self) -> int:
        return self.model.moe_layers

    def expert_flops(self, n_tokens: float) -> float:
        """FLOPs of one expert for n tokens: one multiply-add per parameter per token."""
        return 2.0 * self.model.params_per_expert * n_tokens

    @cached_property
    def hidden_state_bytes(self) -> int:
        """Bytes of one token's hidden state (``hidden`` values of ``ACT_BYTES`` each)."""
        return self.model.hidden * ACT_BYTES

    def activation_bytes(self, n_tokens: int) -> int:
        """Bytes of n hidden-state vectors (one direction)."""
        return int(n_tokens) * self.hidden_state_bytes

    # --- measured constants ----------------------------------------------------------------------
    @cached_property
    def measured(self) -> MeasuredModel | None:
        """The profile's measured constants for this model at this dtype, if any."""
        m = self.hw.measured.get(self.model.name.lower())
        if m is None or m.dtype != self.model.dtype or m.dtype != self.model.host_precision:
            return None
        return m

    @cached_property
    def device_tables(self) -> MeasuredModel | None:
        """The profile's measured device times of this model's modules (``device_tokens``
        with ``device_expert_ms`` / ``device_layer_ms``), at this dtype; None without."""
        m = self.measured
        if m is None or m.device_tokens is None:
            return None
        return m

    @cached_property
    def _host_block_s(self) -> float:
        """host_device: host seconds one MoE layer's non-expert part adds (its blocks, and its
        share of the forward pass's own host time); 0 otherwise."""
        h = self.device_host
        if h is None:
            return 0.0
        m = self.model
        return (h.block_us * m.layers / m.moe_layers + h.step_us / m.moe_layers) * 1e-6

    @cached_property
    def _host_expert_s(self) -> float:
        """host_device: host seconds one routed expert call adds; 0 otherwise."""
        return 0.0 if self.device_host is None else self.device_host.expert_us * 1e-6

    def _measured_load(self, pinned: bool) -> MeasuredModel | None:
        """The measured load that times copies on this path (only with an explicit override)."""
        m = self.measured
        if m is None or not m.load_overrides_link:
            return None
        if m.load_path != ("pinned" if pinned else "pageable"):
            return None
        return m

    # --- decision inputs (what a policy believes, not what the engine charges) ------------------
    def decision_cpu_expert_s(self) -> float:
        """One expert, one token on the CPU as a policy sees it (measured, else modelled)."""
        m = self.measured
        return m.cpu_expert_ms * 1e-3 if m is not None else self._cpu_expert(1)

    def decision_load_s(self) -> float:
        """One expert load as a policy sees it: measured (any path), else the pageable copy."""
        m = self.measured
        return m.load_expert_ms * 1e-3 if m is not None else self.h2d_expert_s(pinned=False)

    def decision_times(self, measured: bool) -> tuple[float, float]:
        """What a CPU-or-copy rule (DAOP's, Fiddler's prefill rule) believes one expert takes
        on the CPU for one token (``T_cpu``) and to load (``T_load``), in seconds: with
        ``measured`` the decision constants above, else the modelled one-token CPU expert and
        pageable copy. Inputs of a decision, not execution times."""
        if measured:
            return self.decision_cpu_expert_s(), self.decision_load_s()
        return self.cpu_expert_s(1), self.h2d_expert_s(pinned=False)

    def decision_split_times(self, n_tokens: int) -> tuple[float, float]:
        """What a CPU/GPU split of a layer's experts (HybriMoE's, DALI's) believes an expert
        with ``n_tokens`` tokens takes: on the GPU (:meth:`gpu_expert_s`) and on the CPU with
        its activations' trip to the host and back (:meth:`cpu_expert_s` plus two
        :meth:`activation_copy_s`). Inputs of a decision (the systems profile them at
        warm-up), not execution times; a copy's time comes from the engine's lane
        (``View.copy_s``, ``View.copy_lands``)."""
        return self.gpu_expert_s(n_tokens), (
            self.cpu_expert_s(n_tokens) + 2 * self.activation_copy_s(n_tokens)
        )

    # --- GPU -------------------------------------------------------------------------------------
    def kernel_s(self, n_tokens: float) -> float:
        """Device-visible seconds of one kernel over ``n_tokens``: a graph replay's node cost
        for one-token calls of a graph-replayed run, else ``gpu.launch_overhead_us``."""
        if self.graph_kernel_us > 0.0 and n_tokens <= 1:
            return self.graph_kernel_us * 1e-6
        return self.hw.gpu.launch_overhead_us * 1e-6

    def _gpu_expert(self, n: float) -> float:
        if n <= 0:
            return 0.0
        t = self.device_tables
        if t is not None and t.device_expert_ms is not None:
            assert t.device_tokens is not None
            # measured on this model's own shapes, launches included
            return _interp(t.device_tokens, t.device_expert_ms, n) + self._host_expert_s
        return (
            self._gpu_expert_roof(n)
            + self._gpu_expert_kernels * self.kernel_s(n)
            + self._host_expert_s
        )

    def _gpu_expert_roof(self, n: float) -> float:
        """Roofline of one GPU expert over n tokens: its weights streamed, its GEMM FLOPs."""
        moved = self._gpu_expert_moved(n)
        return max(moved / self._gpu_expert_bw, self.gpu_expert_gemm_s(n))

    def gpu_expert_gemm_s(self, n_tokens: float) -> float:
        """Seconds of one GPU expert's matrix products over ``n_tokens`` tokens, compute only:
        its FLOPs at :meth:`gpu_gemm_flops` of its tokens; under a runtime that states
        ``gpu_moe_tile_tokens`` (J) and a ggml block format (MMQ's ``MUL_MAT_ID``), above
        ``GEMV_MAX_TOKENS`` tokens, the work of ``m = J x ceil(n / J)`` tokens (the tiles its
        tokens occupy, each costing its full width) at the rate of a product over m tokens:
        ``peak x n / (m + h)`` of useful FLOPs (docs/cost-model.md, "GEMM at prompt shapes")."""
        flops = self.expert_flops(n_tokens)
        tile = self.gpu_moe_tile_tokens
        if tile <= 0.0 or n_tokens <= GEMV_MAX_TOKENS or not self._gpu_expert_tiled:
            return flops / self.gpu_gemm_flops(n_tokens)
        padded = tile * math.ceil(n_tokens / tile)
        return flops * (padded / n_tokens) / self.gpu_gemm_flops(padded)

    @cached_property
    def _gpu_expert_tiled(self) -> bool:
        """Whether the experts' weights are a ggml block format (GGUF kinds, MXFP4), the types
        ggml multiplies with MMQ; float types go through cuBLAS/hipBLAS per expert."""
        return DTYPES[self.model.dtype].kind in GGML_CPU_KINDS

    def gpu_gemm_flops(self, n_tokens: float) -> float:
        """FLOP/s of one of the runtime's GPU matrix products over ``n_tokens`` tokens:
        ``gpu.bf16_tflops``, times ``n / (n + gpu_gemm_half_tokens)`` above ``GEMV_MAX_TOKENS``
        tokens when the runtime states the half point (a tiled product whose tiles the tokens
        fill only partly; docs/cost-model.md, "GEMM at prompt shapes")."""
        peak = self._gpu_gemm_peak
        half = self.gpu_gemm_half_tokens
        if half <= 0.0 or n_tokens <= GEMV_MAX_TOKENS:
            return peak
        return peak * n_tokens / (n_tokens + half)

    @cached_property
    def _gpu_gemm_peak(self) -> float:
        """FLOP/s the runtime's GPU matrix products approach as their tokens grow:
        ``gpu.bf16_tflops``; under ggml's GPU kernels on a profile that states
        ``gpu.ggml_prompt_tflops``, the rate that puts a product over ``GGML_PROMPT_TOKENS``
        tokens at that measured rate on the runtime's fill curve (``x (512 + h) / 512``;
        docs/cost-model.md, "GEMM at prompt shapes")."""
        gpu = self.hw.gpu
        if self.gpu_kernels != "ggml" or gpu.ggml_prompt_tflops is None:
            return gpu.bf16_tflops * 1e12
        fill = GGML_PROMPT_TOKENS / (GGML_PROMPT_TOKENS + self.gpu_gemm_half_tokens)
        return gpu.ggml_prompt_tflops * 1e12 / fill

    @property
    def gpu_gemm_source(self) -> str:
        """The profile field the GPU matrix products' rate comes from."""
        if self.gpu_kernels == "ggml" and self.hw.gpu.ggml_prompt_tflops is not None:
            return "gpu.ggml_prompt_tflops"
        return "gpu.bf16_tflops"

    def _gpu_stream_bw(self, format_share: float) -> float:
        """Bytes/s GPU work streams at: ``min(gpu.mem_bw_gbs, share x spec)`` with ``share``
        the lower of the format's share (GGUF's 0.78) and the runtime's
        ``gpu_stream_efficiency``, both shares of the spec bandwidth
        (``HardwareProfile.gpu.spec_bw_gbs``) as they were derived (docs/cost-model.md, "GPU
        stream efficiency"), so a profile whose ``mem_bw_gbs`` is a measured rate is not
        discounted twice. With both 1.0 the cap never binds (spec >= mem_bw_gbs) and the rate
        is the profile's, bit for bit. Not the product of the two: the runtime's figure was
        measured end to end on the framework's own kernels, so it already holds the format's
        share where its source ran that format."""
        gpu = self.hw.gpu
        own = gpu.mem_bw_gbs * 1e9
        share = min(format_share, self.gpu_stream_efficiency)
        if share == 1.0:
            return own
        return min(own, gpu.spec_bw_gbs * 1e9 * share)

    @cached_property
    def _gpu_expert_bw(self) -> float:
        """Bytes/s a GPU expert call streams at: the lower of the format's share (GGUF 0.78)
        and the runtime's, of the spec bandwidth, capped at ``gpu.mem_bw_gbs``."""
        return self._gpu_stream_bw(gpu_kernel_efficiency(self.model.dtype))

    @cached_property
    def _nonexpert_bw(self) -> float:
        """Bytes/s a layer's non-expert part streams weights and KV cache at."""
        return self._gpu_stream_bw(1.0)

    @cached_property
    def _gpu_expert_kernels(self) -> int:
        """Kernel launches of one GPU expert call: its eager forward plus any dequantisation."""
        return expert_kernels(self.model) + dequant_kernels(self.model.dtype)

    def _gpu_expert_moved(self, n: float) -> float:
        """Bytes one GPU expert call moves: weights, any per-call dequantisation of their
        scales, activations in and out."""
        return self.expert_bytes + self._dequant_bytes + 2.0 * n * self.hidden_state_bytes

    @cached_property
    def _dequant_bytes(self) -> float:
        """Bytes one GPU expert call moves to dequantise its scales and zeros (HQQ; else 0)."""
        return self.model.params_per_expert * dequant_bytes_per_weight(self.model.dtype)

    def gpu_expert_s(self, n_tokens: int) -> float:
        """Seconds for one GPU-resident expert to process n tokens (0 tokens: 0 s)."""
        _check_tokens(n_tokens)
        return self._gpu_expert(n_tokens)

    @cached_property
    def has_after_copy(self) -> bool:
        """Whether the profile measured this model's expert calls right after their copy
        (``device_copied_expert_ms``): then :meth:`gpu_expert_after_copy_s` differs from
        :meth:`gpu_expert_s`."""
        t = self.device_tables
        return t is not None and t.device_copied_expert_ms is not None

    def gpu_expert_after_copy_s(self, n_tokens: int) -> float:
        """Seconds of a GPU expert for n tokens whose weights the same layer has just copied
        in (a fetch or a temporary copy): the profile's measured ``device_copied_expert_ms``
        (on a CPU standing in for a GPU the copy leaves an expert that fits in the caches
        there, so its call reads them from the cache, not from DRAM; docs/cost-model.md,
        "A device on the host thread"), else :meth:`gpu_expert_s`."""
        _check_tokens(n_tokens)
        t = self.device_tables
        if n_tokens <= 0 or t is None or t.device_copied_expert_ms is None:
            return self._gpu_expert(n_tokens)
        assert t.device_tokens is not None
        return _interp(t.device_tokens, t.device_copied_expert_ms, n_tokens) + self._host_expert_s

    def fused_gpu_expert_s(self, n_tokens: int) -> float:
        """One GPU expert's share of a fused MoE call over n tokens: its roofline only (its
        weights are still streamed, at the fused kernels' own share of the spec bandwidth when
        the runtime states one); the call's fixed cost is :meth:`fused_moe_layer_s`."""
        _check_tokens(n_tokens)
        if n_tokens <= 0:
            return 0.0
        if self.fused_moe_stream_efficiency <= 0.0:
            return self._gpu_expert_roof(n_tokens)
        moved = self._gpu_expert_moved(n_tokens)
        return max(moved / self._fused_expert_bw, self.gpu_expert_gemm_s(n_tokens))

    @cached_property
    def _fused_expert_bw(self) -> float:
        """Bytes/s a fused MoE call's grouped GEMMs stream expert weights at: the lower of the
        format's share and ``fused_moe_stream_efficiency``, of the spec bandwidth, capped at
        ``gpu.mem_bw_gbs`` (the rule of :meth:`_gpu_stream_bw` with the fused kernels' share
        in place of the runtime's)."""
        gpu = self.hw.gpu
        share = min(gpu_kernel_efficiency(self.model.dtype), self.fused_moe_stream_efficiency)
        return min(gpu.mem_bw_gbs * 1e9, gpu.spec_bw_gbs * 1e9 * share)

    def fused_moe_layer_s(self) -> float:
        """Device-visible fixed cost of one layer's fused MoE call, paid once per layer that
        runs a GPU expert, whatever their number. In a graph-replayed run with a measured
        ``fused_moe_call_us`` it is that figure (docs/cost-model.md, "Fused MoE at one
        token"); otherwise ``FUSED_MOE_KERNELS`` launches, each a graph node
        (:meth:`kernel_s` of one token) in a graph-replayed run. The engines add this one
        figure to every step, the prompt pass too (docs/cost-model.md, "CUDA-graph decode").
        An FP8 call adds its activation quantisation (``FUSED_MOE_FORMAT_EXTRA_US``)."""
        if self.graph_kernel_us > 0.0 and self.fused_moe_call_us > 0.0:
            extra = FUSED_MOE_FORMAT_EXTRA_US.get(self.model.dtype, 0.0)
            return (self.fused_moe_call_us + extra) * 1e-6
        return FUSED_MOE_KERNELS * self.kernel_s(1)

    # --- CPU -------------------------------------------------------------------------------------
    def _cpu_expert(self, n: float) -> float:
        if n <= 0:
            return 0.0
        m = self.measured
        peak = self._cpu_expert_peak(n)
        compute = self.expert_flops(n) / (peak * 1e9)
        if m is not None:
            # the measured one-token time holds the call's fixed costs already
            return max(m.cpu_expert_ms * 1e-3, compute)
        stream = self.host_expert_bytes / (self.cpu_stream_gbs(self.model.host_precision) * 1e9)
        return self.cpu_call_us * 1e-6 + max(stream, compute)

    def _cpu_expert_peak(self, n: float) -> float:
        """GFLOPS of a CPU expert call over n tokens: the host precision's kernels, with the AMX
        roof for AMX formats above kTransformers' AVX-512 cut-off when the profile gives one."""
        dtype = self.model.host_precision
        amx = self.hw.cpu.amx_bf16_gflops
        if amx is not None and dtype in AMX_DTYPES and n > AMX_MAX_AVX512_TOKENS:
            return amx
        return self.cpu_peak_gflops(dtype, expert=True)

    def cpu_stream_family(self, dtype: str) -> str:
        """The CPU kernel family that streams weights at ``dtype`` under this run's runtime."""
        return cpu_stream_family(self.cpu_kernels, dtype)

    def cpu_stream_gbs(self, dtype: str) -> float:
        """GB/s at which the host CPU's kernels stream weights stored at ``dtype``: the family's
        measured all-core stream where the profile has one, else ``min(cores_used x per-core
        stream, the socket's bound)`` (:func:`cpu_family_stream_gbs`)."""
        return cpu_family_stream_gbs(self.hw.cpu, self.cpu_stream_family(dtype))

    def cpu_expert_s(self, n_tokens: int) -> float:
        """Seconds for one expert on the CPU for n tokens: one batched call (roofline, anchored)."""
        _check_tokens(n_tokens)
        return self._cpu_expert(n_tokens)

    def cpu_share(self, n_tokens: int) -> float:
        """Fraction of the host socket one CPU expert call over n tokens uses while it runs alone.

        The larger of its weight stream over the socket's bandwidth (``cpu.socket_bw_gbs``,
        default the call's own weight-stream rate, :meth:`cpu_stream_gbs`) and its FLOP/s over
        ``cpu.<dtype>_gflops``, at most 1.
        Concurrent calls progress at ``min(1, 1 / sum of shares)`` of their alone speed
        (docs/cost-model.md, "Shared host CPU").
        """
        d = self.cpu_expert_s(n_tokens)
        if d <= 0:
            return 0.0
        cpu = self.hw.cpu
        # the call's fixed host time is neither bandwidth nor FLOPs: the shares use the rest
        d -= 0.0 if self.measured is not None else self.cpu_call_us * 1e-6
        bw = (cpu.socket_bw_gbs or self.cpu_stream_gbs(self.model.host_precision)) * 1e9
        peak = self._cpu_expert_peak(n_tokens) * 1e9
        share = max(self.host_expert_bytes / (d * bw), self.expert_flops(n_tokens) / (d * peak))
        return min(1.0, share)

    @property
    def dram_bw_gbs(self) -> float:
        """Unified memory: the one DRAM's bandwidth (``link.dram_bw_gbs``, else the GPU's)."""
        return self.hw.link.dram_bw_gbs or self.hw.gpu.mem_bw_gbs

    def cpu_dram_share(self, n_tokens: int) -> float:
        """Unified memory: the fraction of the DRAM one CPU expert call streams alone (else 0)."""
        d = self.cpu_expert_s(n_tokens)
        if not self.unified_memory or d <= 0:
            return 0.0
        return min(1.0, self.host_expert_bytes / (d * self.dram_bw_gbs * 1e9))

    def copy_dram_share(self, nbytes: float, seconds: float) -> float:
        """Unified memory: the fraction of the DRAM a copy of ``nbytes`` over ``seconds`` takes.

        A DRAM-to-DRAM copy reads and writes every byte: ``2 x nbytes / seconds / dram_bw``
        (at most 1). 0 on a bus link, where a copy does not touch the host's DRAM budget here.
        """
        if not self.unified_memory or seconds <= 0:
            return 0.0
        return min(1.0, 2.0 * nbytes / (seconds * self.dram_bw_gbs * 1e9))

    # --- copies ----------------------------------------------------------------------------------
    def _copy(self, nbytes: float, gbs: float) -> float:
        return self.hw.link.copy_overhead_us * 1e-6 + nbytes / (gbs * 1e9)

    def convert_expert_s(self) -> float:
        """Seconds to convert one expert between host and GPU precision on the GPU (0 if equal).

        One kernel reads one format and writes the other at the GPU's memory bandwidth.
        """
        if not self.split_precision:
            return 0.0
        gpu = self.hw.gpu
        moved = self.host_expert_bytes + self.expert_bytes
        return moved / (gpu.mem_bw_gbs * 1e9) + gpu.launch_overhead_us * 1e-6

    def h2d_expert_s(self, pinned: bool) -> float:
        """Seconds to copy one expert host -> device from pinned or pageable memory."""
        m = self._measured_load(pinned)
        if m is not None:
            return m.load_expert_ms * 1e-3
        link = self.hw.link
        rate = link.h2d_pinned_gbs if pinned else link.h2d_pageable_gbs
        return self._copy(self.link_expert_bytes, rate) + self.convert_expert_s()

    def h2d_expert_warm_s(self, pinned: bool) -> float:
        """Seconds of a copy into the slot of an expert the same layer computed (an in-use
        victim's slot): the profile's measured ``load_warm_expert_ms`` on this path (on a CPU
        standing in for a GPU that slot is still in the caches), else :meth:`h2d_expert_s`."""
        m = self._measured_load(pinned)
        if m is not None and m.load_warm_expert_ms is not None:
            return m.load_warm_expert_ms * 1e-3
        return self.h2d_expert_s(pinned)

    def d2h_expert_warm_s(self, pinned: bool = True) -> float:
        """Seconds of the write-back of an expert the same layer computed: the measured
        ``writeback_warm_expert_ms`` on this path, else :meth:`d2h_expert_s`."""
        m = self._measured_load(pinned)
        if m is not None and m.writeback_warm_expert_ms is not None:
            return m.writeback_warm_expert_ms * 1e-3
        return self.d2h_expert_s(pinned)

    def low_bit_expert_bytes(self, dtype: str) -> int:
        """Bytes of one expert's low-precision host copy (HOBBIT's mixed-precision loading)."""
        return self.model.expert_bytes(dtype)

    def h2d_low_bit_expert_s(self, dtype: str, pinned: bool) -> float:
        """Seconds to copy one expert's ``dtype`` copy host -> device (run as stored: no
        conversion kernel; the measured load constants are for the full copy, so never used)."""
        link = self.hw.link
        rate = link.h2d_pinned_gbs if pinned else link.h2d_pageable_gbs
        return self._copy(self.low_bit_expert_bytes(dtype), rate)

    def d2h_expert_s(self, pinned: bool = True) -> float:
        """Seconds to copy one expert device -> host into pinned or pageable memory (a measured
        ``writeback_expert_ms`` with ``load_overrides_link`` on this path replaces it)."""
        m = self._measured_load(pinned)
        if m is not None and m.writeback_expert_ms is not None:
            return m.writeback_expert_ms * 1e-3
        link = self.hw.link
        rate = link.d2h_pinned_gbs if pinned else link.d2h_pageable_gbs
        return self._copy(self.link_expert_bytes, rate) + self.convert_expert_s()

    @property
    def vocab(self) -> int:
        """Rows of the output matrix: the input embedding's rows (``embedding_params / hidden``,
        the catalogue counts the output matrix as the embedding's size; 0 when not recorded)."""
        return self.model.embedding_params // self.model.hidden

    def logits_copy_s(self) -> float:
        """Seconds to copy one token's logits (``vocab`` fp32 values) device -> host into pinned
        memory: what a runtime that samples on the host (llama.cpp's ``llama_decode``) waits
        for at the end of every forward pass whose output matrix ran on the GPU
        (docs/cost-model.md, "Logits to the host"). 0 without a recorded vocabulary."""
        if self.vocab == 0:
            return 0.0
        return self._copy(self.vocab * LOGIT_BYTES, self.hw.link.d2h_pinned_gbs)

    def activation_copy_s(self, n_tokens: int) -> float:
        """Seconds to move n hidden-state vectors one way (either direction costs the same)."""
        _check_tokens(n_tokens)
        if n_tokens == 0:
            return 0.0
        link = self.hw.link
        return self._copy(
            self.activation_bytes(n_tokens), min(link.h2d_pinned_gbs, link.d2h_pinned_gbs)
        )

    def peer_activation_s(self, n_tokens: int) -> float:
        """Seconds to move n hidden-state vectors between two GPUs over the profile's direct
        peer path (``[peer]``: its latency plus the bytes at its per-direction bandwidth)."""
        _check_tokens(n_tokens)
        multi = self.hw.multi
        if multi is None or multi.peer_gbs is None or multi.peer_latency_us is None:
            raise ValueError(f"{self.hw.name}: no direct peer path between GPUs")
        if n_tokens == 0:
            return 0.0
        return multi.peer_latency_us * 1e-6 + self.activation_bytes(n_tokens) / (
            multi.peer_gbs * 1e9
        )

    # --- non-expert part -------------------------------------------------------------------------
    def nonexpert_layer_s(
        self, n_tokens: int, context: int, eager_attention: bool = False
    ) -> float:
        """Seconds of one MoE layer's non-expert part on the GPU for n new tokens.

        ``context`` counts the tokens already in the KV cache before this call (decode at position
        p: n_tokens=1, context=p; a prefill of S tokens: n_tokens=S, context=0).
        ``eager_attention``: the runtime materialises the scores (a runtime profile with
        ``attention = "eager"``): every head's ``n x (context + n)`` scores, the masked half
        included, cost :data:`EAGER_ATTENTION_BYTES_PER_SCORE` bytes each and their FLOPs.
        """
        _check_tokens(n_tokens)
        _check_tokens(context, "context")
        if n_tokens == 0:
            return 0.0
        t = self.device_tables
        if t is not None and t.device_layer_ms is not None:
            assert t.device_tokens is not None
            # measured at context 0 on this model's shapes; the cached context is read on top
            m = self.model
            kv = m.kv_bytes_per_token / m.moe_layers * context
            measured = _interp(t.device_tokens, t.device_layer_ms, n_tokens)
            return measured + kv / self._nonexpert_bw + self._host_block_s
        moved = self._nonexpert_moved(n_tokens, context)
        if eager_attention:
            scores = self.eager_attention_scores(n_tokens, context)
            moved += scores * EAGER_ATTENTION_BYTES_PER_SCORE
            attn_pairs = n_tokens * (context + n_tokens)  # the full rectangle is computed
        else:
            attn_pairs = n_tokens * context + n_tokens * (n_tokens + 1) / 2  # causal pairs
        return self._nonexpert_roof(n_tokens, moved, attn_pairs)

    def eager_attention_scores(self, n_tokens: int, context: int) -> float:
        """Scores one MoE layer's eager attention writes for n new tokens at ``context``: per
        transformer block, every query head scores each new token against every key,
        ``heads x n x (context + n)`` (the causal mask is added to the full matrix)."""
        m = self.model
        if m.attention_heads <= 0:
            raise UserError(
                f"model {m.name!r} has no attention_heads: a runtime with eager attention needs "
                "its query-head count (set it on the model shape)"
            )
        blocks = m.layers / m.moe_layers
        return m.attention_heads * n_tokens * (context + n_tokens) * blocks

    def _nonexpert_roof(self, n_tokens: int, moved: float, attn_pairs: float) -> float:
        """Roofline of one layer's non-expert part moving ``moved`` bytes, plus launches."""
        m = self.model
        blocks = m.layers / m.moe_layers  # transformer blocks per MoE layer (dense ones too)
        params = (m.non_expert_params - m.embedding_params) / m.moe_layers
        flops = 2.0 * params * n_tokens + 4.0 * attn_pairs * m.attention_width * blocks
        roof = max(moved / self._nonexpert_bw, flops / self.gpu_gemm_flops(n_tokens))
        launches = NONEXPERT_KERNELS_PER_BLOCK * blocks * self.kernel_s(n_tokens)
        return roof + launches + self._host_block_s

    def nonexpert_batch_layer_s(self, n_tokens: int, kv_tokens: int) -> float:
        """Seconds of one MoE layer's non-expert part for a batched decode step: ``n_tokens``
        sequences, one new token each, whose KV caches hold ``kv_tokens`` tokens in all once
        the new ones are written (the sum of each sequence's context + 1).

        Weights are read once for the batch; each new token attends only to its own sequence,
        so the KV bytes read and the query-key pairs both scale with ``kv_tokens``. With one
        sequence this equals :meth:`nonexpert_layer_s` (1, context).
        """
        _check_tokens(n_tokens)
        _check_tokens(kv_tokens, "kv_tokens")
        if n_tokens == 0:
            return 0.0
        moved = self._nonexpert_moved(0, kv_tokens)  # kv_tokens: cached and new, all sequences
        return self._nonexpert_roof(n_tokens, moved, kv_tokens)

    def nonexpert_mixed_layer_s(
        self, chunk: int, chunk_context: int, n_decode: int, decode_kv: int
    ) -> float:
        """Seconds of one MoE layer's non-expert part for a step that carries ``chunk`` prompt
        tokens of one request (``chunk_context`` of its tokens already cached) beside one new
        token of each of ``n_decode`` decoding requests, whose caches hold ``decode_kv`` tokens
        in all once the new ones are written (chunked prefill, docs/serving.md).

        Weights are read once for all ``chunk + n_decode`` tokens; the KV bytes and query-key
        pairs are the prefill chunk's (causal, over its context) plus the decode tokens'. With
        no decode tokens this is :meth:`nonexpert_layer_s` (chunk, chunk_context); with no
        chunk, :meth:`nonexpert_batch_layer_s` (n_decode, decode_kv).
        """
        _check_tokens(chunk, "chunk")
        _check_tokens(chunk_context, "chunk_context")
        _check_tokens(n_decode, "n_decode")
        _check_tokens(decode_kv, "decode_kv")
        n = chunk + n_decode
        if n == 0:
            return 0.0
        m = self.model
        kv = m.kv_bytes_per_token / m.moe_layers * (chunk_context + chunk + decode_kv)
        pairs = chunk * chunk_context + chunk * (chunk + 1) / 2 + decode_kv
        return self._nonexpert_roof(n, self.nonexpert_layer_bytes + kv, pairs)

    def nonexpert_prefill_batch_layer_s(
        self, n_seqs: int, length: int, eager_attention: bool = False
    ) -> float:
        """Seconds of one MoE layer's non-expert part for a static batch's prefill: ``n_seqs``
        prompts padded to ``length`` rows each, in one forward pass (Hugging Face ``generate``
        over a ``n_seqs x length`` input, docs/serving.md "Static batches prefill together").

        Weights are read once for all ``n_seqs x length`` rows (padding included: the kernels
        run over the padded tensor); each prompt writes ``length`` KV rows and attends causally
        within itself only. ``eager_attention`` as in :meth:`nonexpert_layer_s`, per prompt.
        With one prompt this is :meth:`nonexpert_layer_s` (length, 0).
        """
        _check_tokens(n_seqs, "n_seqs")
        _check_tokens(length, "length")
        n = n_seqs * length
        if n == 0:
            return 0.0
        moved = self._nonexpert_moved(n, 0)
        if eager_attention:
            moved += (
                n_seqs * self.eager_attention_scores(length, 0) * EAGER_ATTENTION_BYTES_PER_SCORE
            )
            pairs = n_seqs * length * length
        else:
            pairs = n_seqs * length * (length + 1) / 2
        return self._nonexpert_roof(n, moved, pairs)

    def cpu_nonexpert_prefill_batch_layer_s(self, n_seqs: int, length: int) -> float:
        """:meth:`cpu_nonexpert_layer_s` for a static batch's prefill (the bytes and query-key
        pairs of :meth:`nonexpert_prefill_batch_layer_s`)."""
        _check_tokens(n_seqs, "n_seqs")
        _check_tokens(length, "length")
        n = n_seqs * length
        if n == 0:
            return 0.0
        moved = self._nonexpert_moved(n, 0)
        return self._cpu_nonexpert_roof(n, moved, n_seqs * length * (length + 1) / 2)

    def _nonexpert_moved(self, n_tokens: int, context: int) -> float:
        """Bytes one layer's non-expert part moves: its weights and the KV cache it touches."""
        m = self.model
        kv = m.kv_bytes_per_token / m.moe_layers * (context + n_tokens)
        return self.nonexpert_layer_bytes + kv

    def gpu_dram_share(self, n_tokens: int, context: int | None = None) -> float:
        """Unified memory: the fraction of the DRAM a GPU kernel takes while it runs (else 0).

        An expert call over n tokens (``context`` None) or one layer's non-expert part: its bytes
        over its duration over ``dram_bw_gbs``, at most 1.
        """
        if not self.unified_memory or n_tokens <= 0:
            return 0.0
        if context is None:
            moved, d = self._gpu_expert_moved(n_tokens), self._gpu_expert(n_tokens)
        else:
            moved, d = (
                self._nonexpert_moved(n_tokens, context),
                self.nonexpert_layer_s(n_tokens, context),
            )
        return min(1.0, moved / (d * self.dram_bw_gbs * 1e9))

    # --- CPU-resident layers (llama.cpp's -ngl split) ---------------------------------------------
    @cached_property
    def cpu_layer_weight_bytes(self) -> int:
        """Non-expert weight bytes one MoE layer's transformer blocks hold themselves: the
        non-expert part without the input embedding and the output matrix (taken to be the
        embedding's size), spread over the MoE layers."""
        m = self.model
        params = max(0, m.non_expert_params - 2 * m.embedding_params)
        return round(params / m.moe_layers * dtype_bytes(m.nonexpert_dtype))

    def cpu_layer_host_bytes(self, kv_tokens: int) -> float:
        """GPU bytes one CPU-resident layer leaves in host memory: its non-expert weights and
        its share of the KV cache for ``kv_tokens`` (llama.cpp keeps a layer's KV cache on
        the layer's device)."""
        m = self.model
        return self.cpu_layer_weight_bytes + m.kv_bytes_per_token / m.moe_layers * kv_tokens

    def cpu_nonexpert_layer_s(self, n_tokens: int, context: int) -> float:
        """Seconds of one MoE layer's non-expert part on the host CPU for n new tokens.

        The GPU formula's bytes and FLOPs (:meth:`nonexpert_layer_s`) over the CPU's roofline:
        ``max(bytes / cpu stream, flops / cpu peak)`` with the weight-stream rate
        (:meth:`cpu_stream_gbs`) and the peak of the non-expert precision's CPU kernels
        (:meth:`cpu_peak_gflops`); no kernel launches.
        """
        _check_tokens(n_tokens)
        _check_tokens(context, "context")
        if n_tokens == 0:
            return 0.0
        moved = self._nonexpert_moved(n_tokens, context)
        attn_pairs = n_tokens * context + n_tokens * (n_tokens + 1) / 2
        return self._cpu_nonexpert_roof(n_tokens, moved, attn_pairs)

    def cpu_nonexpert_batch_layer_s(self, n_tokens: int, kv_tokens: int) -> float:
        """:meth:`cpu_nonexpert_layer_s` for a batched decode step (the bytes and query-key
        pairs of :meth:`nonexpert_batch_layer_s`)."""
        _check_tokens(n_tokens)
        _check_tokens(kv_tokens, "kv_tokens")
        if n_tokens == 0:
            return 0.0
        moved = self._nonexpert_moved(0, kv_tokens)  # kv_tokens: cached and new, all sequences
        return self._cpu_nonexpert_roof(n_tokens, moved, kv_tokens)

    def _cpu_nonexpert_roof(self, n_tokens: int, moved: float, attn_pairs: float) -> float:
        """The CPU roofline of one layer's non-expert part moving ``moved`` bytes."""
        m = self.model
        blocks = m.layers / m.moe_layers
        params = (m.non_expert_params - m.embedding_params) / m.moe_layers
        flops = 2.0 * params * n_tokens + 4.0 * attn_pairs * m.attention_width * blocks
        peak = self.cpu_peak_gflops(m.nonexpert_dtype)
        bw = self.cpu_stream_gbs(m.nonexpert_dtype)
        return self.cpu_layer_us * 1e-6 + max(moved / (bw * 1e9), flops / (peak * 1e9))

    def cpu_peak_gflops(self, dtype: str, expert: bool = False) -> float:
        """The host CPU's achieved GEMM throughput for weights stored at ``dtype``, GFLOPS:
        under a ggml runtime, for every format ggml runs, the host's measured ggml rate
        (``cpu.ggml_gemm_gflops``, ik_llama.cpp's repacked kernels, where the profile has one)
        times the runtime's share for that precision (``cpu_gemm_share``, or for an expert
        product, ``expert``, ``cpu_expert_gemm_share`` where it lists the precision;
        docs/cost-model.md, "CPU GEMM by runtime"); otherwise ``cpu.fp32_gflops`` for fp32,
        else ``cpu.bf16_gflops``."""
        cpu = self.hw.cpu
        if cpu.ggml_gemm_gflops is not None and self.cpu_stream_family(dtype) == "ggml":
            table = dict(self.cpu_gemm_share)
            if expert:
                table.update(self.cpu_expert_gemm_share)
            return cpu.ggml_gemm_gflops * table.get(dtype, table.get("default", 1.0))
        return cpu.fp32_gflops if dtype == "fp32" else cpu.bf16_gflops

    def cpu_layer_weights_h2d_s(self) -> float:
        """Seconds to copy one CPU-resident layer's non-expert weights to the GPU from pinned
        memory (llama.cpp's op offload of a prompt batch: once per micro-batch)."""
        return self._copy(self.cpu_layer_weight_bytes, self.hw.link.h2d_pinned_gbs)

    # --- streamed non-expert weights (DeepSpeed ZeRO-3 parameter offload) -------------------
    def streamed_layer_weight_bytes(self, persist_numel: int) -> int:
        """Non-expert weight bytes ZeRO-3 copies to the GPU before one MoE layer's non-expert
        part (ResourceSpec.nonexpert_streamed): the layer's share of the non-expert part
        without the input embedding and the output matrix (:attr:`cpu_layer_weight_bytes`'s
        share), less the router when it has at most ``persist_numel`` elements (ZeRO-3 keeps
        a parameter that small on the GPU; norms and biases, as small, are not in the
        catalogue's counts), at the non-expert precision."""
        m = self.model
        params = max(0, m.non_expert_params - 2 * m.embedding_params) / m.moe_layers
        router = m.hidden * m.experts
        if router <= persist_numel:
            params = max(0.0, params - router)
        return round(params * dtype_bytes(m.nonexpert_dtype))

    def streamed_embedding_bytes(self, persist_numel: int) -> int:
        """Bytes of the input embedding ZeRO-3 copies to the GPU once per forward pass (the
        output matrix, taken to be its size, likewise); 0 when it has at most
        ``persist_numel`` elements (kept on the GPU)."""
        m = self.model
        if m.embedding_params <= persist_numel:
            return 0
        return round(m.embedding_params * dtype_bytes(m.nonexpert_dtype))

    def weights_h2d_s(self, nbytes: int, pinned: bool) -> float:
        """Seconds of one host-to-device copy of ``nbytes`` of weights from pinned or
        pageable memory (the link's rate and per-copy overhead); 0 for no bytes."""
        if nbytes <= 0:
            return 0.0
        link = self.hw.link
        return self._copy(nbytes, link.h2d_pinned_gbs if pinned else link.h2d_pageable_gbs)

    # --- decisions -------------------------------------------------------------------------------
    def breakeven_tokens(self, pinned: bool = False) -> float:
        """Tokens per expert at which copying it (then running it on the GPU) beats the CPU.

        The real n where ``cpu(n) = h2d(pinned) + gpu(n)``; below it the CPU is faster. 0.0 when a
        copy wins at any count; ``inf`` when the CPU always wins.
        """
        copy = self.h2d_expert_s(pinned)

        def gap(n: float) -> float:
            return self._cpu_expert(n) - copy - self._gpu_expert(n)

        lo = 1e-9
        if gap(lo) >= 0:
            return 0.0
        hi = 1.0
        while gap(hi) < 0:
            hi *= 2.0
            if hi > 1e12:
                return math.inf
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            if gap(mid) < 0:
                lo = mid
            else:
                hi = mid
        return hi

    def free_expert_bytes(self, kv_tokens: int = 0, host_bytes: int | None = None) -> float:
        """GPU bytes left for experts and expert-sized buffers after the non-expert weights,
        workspace and KV cache (negative when those alone do not fit); on unified memory also
        after ``host_bytes`` that the host holds in the same DRAM (default:
        :meth:`unified_host_bytes`, a host copy of every expert)."""
        gpu = self.hw.gpu
        host = self.unified_host_bytes() if host_bytes is None else host_bytes
        return (
            gpu.usable_bytes
            - gpu.workspace_gb * 1e9
            - self.model.non_expert_bytes()
            - self.model.kv_bytes_per_token * kv_tokens
            - host
        )

    def unified_host_bytes(self, low_bit_dtype: str | None = None) -> int:
        """What the host side holds in the one memory of a unified-memory machine while no
        expert is resident on the GPU: a copy of every routed expert at the host's precision,
        plus, for a system whose host also keeps a lower-precision copy of every expert
        (``low_bit_dtype``, HOBBIT), those. Each GPU-resident expert then adds its GPU copy
        (a system that keeps every host copy) or replaces its host copy
        (:meth:`unified_refund_bytes`, a system that holds each expert once). The non-expert
        weights are held once, on the GPU side: loaders put each tensor in the buffer of the
        device that runs it (docs/cost-model.md, "Unified memory"). 0 on a bus-attached host,
        whose host memory is separate (``cpu.memory_gb``, ``--host-memory-gb``)."""
        if not self.unified_memory:
            return 0
        m = self.model
        low = 0 if low_bit_dtype is None else m.expert_bytes(low_bit_dtype)
        return m.total_experts * (self.host_expert_bytes + low)

    def unified_refund_bytes(self, held_once: bool) -> int:
        """Host bytes one GPU-resident expert frees on a unified-memory machine: its host copy
        when the system holds each expert once (``ResourceSpec.experts_held_once``), else 0
        (the host keeps its copy beside the GPU's; always 0 on a bus-attached host)."""
        return self.host_expert_bytes if self.unified_memory and held_once else 0

    def cpu_layer_freed_bytes(self, kv_tokens: int) -> float:
        """GPU memory one CPU-resident layer frees: :meth:`cpu_layer_host_bytes` on a
        bus-attached host; nothing on unified memory, where its non-expert weights and KV cache
        move to a host buffer in the same DRAM."""
        if self.unified_memory:
            return 0.0
        return self.cpu_layer_host_bytes(kv_tokens)

    def gpu_expert_slots(self, kv_tokens: int = 0) -> int:
        """Expert-sized slots in the free GPU memory, capped at the model's experts.

        Policy buffers are not subtracted here; ``daopsim.simulator.fit.expert_fit`` does that
        and is what ``run``, sweeps and ``profiles show`` report.
        """
        free = self.free_expert_bytes(kv_tokens)
        return max(0, min(self.model.total_experts, int(free // self.expert_bytes)))

    @property
    def unified_memory(self) -> bool:
        """CPU and GPU share one memory: copies are DRAM-to-DRAM and contend with both."""
        return self.hw.link.unified

    # --- provenance ------------------------------------------------------------------------------
    def uses_measured(self) -> dict[str, bool]:
        """Which costs come from the profile's measured constants (the rest are formulas)."""
        t = self.device_tables

        def wb(pinned: bool) -> bool:
            m = self._measured_load(pinned)
            return m is not None and m.writeback_expert_ms is not None

        return {
            "gpu_expert": t is not None and t.device_expert_ms is not None,
            "cpu_expert": self.measured is not None,
            "h2d_expert_pinned": self._measured_load(True) is not None,
            "h2d_expert_pageable": self._measured_load(False) is not None,
            "d2h_expert_pinned": wb(True),
            "d2h_expert_pageable": wb(False),
            "activation_copy": False,
            "nonexpert_layer": t is not None and t.device_layer_ms is not None,
        }

    # --- the SSD tier (docs/serving.md, "An SSD tier") ------------------------------------------
    def ssd_expert_s(self, access: str = "read") -> float:
        """Seconds the NVMe drive takes to read one host-precision expert.

        ``access="read"``: one large read (a file read into the page cache, or a GPUDirect
        Storage read), at the drive's sequential read rate. ``access="mmap"``: the expert is
        faulted in page by page through a memory map, at the 4 KiB random-read rate (IOPS x
        4 KiB, never above the sequential rate). Both add one read command's latency.
        """
        ssd = self.hw.ssd
        if ssd is None:
            raise ValueError(f"profile {self.hw.name} has no [ssd] table")
        rate = ssd.seq_read_gbps * 1e9
        if access == "mmap":
            rate = min(rate, ssd.rand4k_read_iops * 4096.0)
        elif access != "read":
            raise ValueError(f"unknown SSD access {access!r}")
        return ssd.read_latency_us * 1e-6 + self.host_expert_bytes / rate

    @property
    def host_nonexpert_bytes(self) -> int:
        """Host memory the non-expert weights take (the loader keeps them there)."""
        return self.model.non_expert_bytes()

    def _cpu_stream_source(self, dtype: str) -> str:
        """Which profile fields give the CPU weight stream of ``dtype`` (``sources()``)."""
        cpu = self.hw.cpu
        fam = self.cpu_stream_family(dtype)
        names = (fam, CPU_STREAM_FALLBACK[fam]) if fam in CPU_STREAM_FALLBACK else (fam,)
        cap = " (at most cpu.socket_bw_gbs)" if cpu.socket_bw_gbs is not None else ""
        for name in names:
            if name in dict(cpu.stream_gbs):
                return f"cpu.stream_gbs.{name} (measured){cap}"
            if name == "ggml" and cpu.ggml_stream_gbs is not None:
                return f"cpu.ggml_stream_gbs (measured){cap}"
            if name != "ggml" and cpu.mem_bw_gbs is not None:
                return f"cpu.mem_bw_gbs (measured){cap}"
            if name in dict(cpu.core_stream_gbs):
                bound = (
                    "cpu.socket_bw_gbs"
                    if cpu.socket_bw_gbs is not None
                    else ("cpu.dram_gbs x cpu.dram_efficiency")
                )
                return f"min(cpu.cores_used x cpu.core_stream_gbs.{name}, {bound})"
        return f"(no cpu stream for {fam})"

    def sources(self) -> dict[str, str]:
        """For each cost, the formula or measured constant that produced it."""
        gpu_expert, nonexpert = self._gpu_sources()
        return {
            "gpu_expert": gpu_expert,
            "cpu_expert": self._cpu_source(),
            "h2d_expert_pinned": self._h2d_source(True),
            "h2d_expert_pageable": self._h2d_source(False),
            "d2h_expert_pinned": self._d2h_source(True),
            "d2h_expert_pageable": self._d2h_source(False),
            "activation_copy": (
                "link: copy_overhead_us + n x hidden x 2 B / min(link.h2d_pinned_gbs, "
                "link.d2h_pinned_gbs)"
            ),
            "nonexpert_layer": nonexpert,
        }

    def _host_bytes_source(self) -> tuple[str, str]:
        """The size copies and the CPU use, and the conversion a host/GPU precision split
        adds."""
        # with a host/GPU precision split, copies and the CPU use the host copy's size
        host_b = "host_expert_bytes" if self.split_precision else "expert_bytes"
        conv = " + conversion on the GPU" if self.split_precision else ""
        return host_b, conv

    def _cpu_source(self) -> str:
        """Where a CPU expert's time comes from: the anchored roofline, or the runtime's call
        cost plus the roofline."""
        m = self.measured
        peak_key = "fp32" if self.model.host_precision == "fp32" else "bf16"
        stream_key = self._cpu_stream_source(self.model.host_precision)
        host_b, _ = self._host_bytes_source()
        return (
            f"anchored roofline: max({m.cpu_expert_ms} ms measured at one token "
            f"(measured.{self.model.name}.cpu_expert_ms; {m.source}), "
            f"2 x params x n / cpu.{peak_key}_gflops)"
            if m is not None
            else (
                f"{self.cpu_call_us:g} us per call (runtime cpu_expert_call_us) + "
                f"roofline: max({host_b} / {stream_key}, "
                f"2 x params x n / cpu.{peak_key}_gflops)"
            )
        )

    def _h2d_source(self, pinned: bool) -> str:
        """Where an expert's host-to-device copy time comes from."""
        host_b, conv = self._host_bytes_source()
        mm = self._measured_load(pinned)
        if mm is not None:
            return (
                f"measured override: {mm.load_expert_ms} ms (measured.{self.model.name}."
                f"load_expert_ms, load_overrides_link = true, {mm.load_path} path; {mm.source})"
            )
        rate = "h2d_pinned_gbs" if pinned else "h2d_pageable_gbs"
        return f"link: copy_overhead_us + {host_b} / link.{rate}{conv}"

    def _d2h_source(self, pinned: bool) -> str:
        """Where an expert's write-back (device-to-host) time comes from."""
        host_b, conv = self._host_bytes_source()
        mm = self._measured_load(pinned)
        if mm is not None and mm.writeback_expert_ms is not None:
            return (
                f"measured override: {mm.writeback_expert_ms} ms (measured.{self.model.name}."
                f"writeback_expert_ms, load_overrides_link = true; {mm.source})"
            )
        rate = "d2h_pinned_gbs" if pinned else "d2h_pageable_gbs"
        return f"link: copy_overhead_us + {host_b} / link.{rate}{conv}"

    def _gpu_sources(self) -> tuple[str, str]:
        """Where a GPU expert's and a layer's non-expert part's times come from: the measured
        device tables, or the roofline on the stream's bandwidth plus launches and host time."""
        share = gpu_kernel_efficiency(self.model.dtype)
        eff = self.gpu_stream_efficiency

        def stream(own: float) -> str:
            low = min(own, eff)
            if low == 1.0:
                return "gpu.mem_bw_gbs"
            spec = "gpu.spec_mem_bw_gbs" if self.hw.gpu.spec_mem_bw_gbs is not None else "spec"
            return f"min(gpu.mem_bw_gbs, {low} x {spec})"

        bw_s, ne_bw_s = stream(share), stream(1.0)
        k = self._gpu_expert_kernels
        dq = dequant_bytes_per_weight(self.model.dtype)
        dq_s = f" + {dq:g} B x params (scale dequantisation)" if dq else ""
        host = self.device_host
        ex_host = f" + {host.expert_us:g} us host (runtime expert_host_us)" if host else ""
        ne_host = (
            f" + host: block_host_us x blocks/layer + step_host_us / moe_layers "
            f"({self._host_block_s * 1e6:.1f} us)"
            if host
            else ""
        )
        t = self.device_tables
        mname = f"measured.{self.model.name}"
        gpu_expert = (
            f"measured: {mname}.device_expert_ms at device_tokens, interpolated{ex_host}"
            if t is not None and t.device_expert_ms is not None
            else (
                f"roofline: max((expert_bytes{dq_s} + activations) / {bw_s}, 2 x params x n / "
                f"{self.gpu_gemm_source}) + {k} x gpu.launch_overhead_us{ex_host}"
            )
        )
        nonexpert = (
            f"measured: {mname}.device_layer_ms at device_tokens, interpolated, + KV bytes x "
            f"context / {ne_bw_s}{ne_host}"
            if t is not None and t.device_layer_ms is not None
            else (
                "roofline: max((non-expert bytes / moe_layers + KV bytes x (context + n)) / "
                f"{ne_bw_s}, flops / {self.gpu_gemm_source}) + "
                f"{NONEXPERT_KERNELS_PER_BLOCK} x blocks/layer x gpu.launch_overhead_us{ne_host}"
            )
        )
        return gpu_expert, nonexpert

    # --- report ----------------------------------------------------------------------------------
    def summary(self, context_tokens: int = DEFAULT_CONTEXT) -> dict[str, Any]:
        """Derived costs as ``daopsim profiles show`` prints them (milliseconds)."""
        ms = 1e3
        return {
            "model": self.model.name,
            "dtype": self.model.dtype,
            "host_dtype": self.model.host_precision,
            "nonexpert_dtype": self.model.nonexpert_dtype,
            "expert_bytes": self.expert_bytes,
            "host_expert_bytes": self.host_expert_bytes,
            "context_tokens": context_tokens,
            "costs": {
                "h2d_expert_ms_pinned": self.h2d_expert_s(True) * ms,
                "h2d_expert_ms_pageable": self.h2d_expert_s(False) * ms,
                "d2h_expert_ms_pinned": self.d2h_expert_s(True) * ms,
                "gpu_expert_ms": self.gpu_expert_s(1) * ms,
                "cpu_expert_ms": self.cpu_expert_s(1) * ms,
                "activation_copy_ms": self.activation_copy_s(1) * ms,
                "nonexpert_layer_ms": self.nonexpert_layer_s(1, context_tokens) * ms,
                "breakeven_tokens": self.breakeven_tokens(pinned=False),
                "breakeven_tokens_pinned": self.breakeven_tokens(pinned=True),
            },
            "measured": self.uses_measured(),
            "sources": self.sources(),
        }


@lru_cache(maxsize=256)
def _cached(
    hw: HardwareProfile,
    model: ModelShape,
    cpu_kernels: str,
    graph_kernel_us: float,
    gpu_stream_efficiency: float,
    cpu_call_us: float,
    cpu_layer_us: float,
    fused_moe_call_us: float,
    fused_moe_stream_efficiency: float,
    gpu_gemm_half_tokens: float,
    cpu_gemm_share: tuple[tuple[str, float], ...],
    device_host: DeviceHostCosts | None,
    cpu_expert_gemm_share: tuple[tuple[str, float], ...],
    gpu_kernels: str,
    gpu_moe_tile_tokens: float,
) -> CostModel:
    return CostModel(
        hw=hw,
        model=model,
        cpu_kernels=cpu_kernels,
        graph_kernel_us=graph_kernel_us,
        gpu_stream_efficiency=gpu_stream_efficiency,
        cpu_call_us=cpu_call_us,
        cpu_layer_us=cpu_layer_us,
        fused_moe_call_us=fused_moe_call_us,
        fused_moe_stream_efficiency=fused_moe_stream_efficiency,
        gpu_gemm_half_tokens=gpu_gemm_half_tokens,
        cpu_gemm_share=cpu_gemm_share,
        device_host=device_host,
        cpu_expert_gemm_share=cpu_expert_gemm_share,
        gpu_kernels=gpu_kernels,
        gpu_moe_tile_tokens=gpu_moe_tile_tokens,
    )


def _checked_shares(
    cpu_gemm_share: tuple[tuple[str, float], ...],
    cpu_expert_gemm_share: tuple[tuple[str, float], ...],
    device_host: DeviceHostCosts | None,
) -> tuple[tuple[tuple[str, float], ...], tuple[tuple[str, float], ...]]:
    """The CPU GEMM share tables of :func:`cost_model`, sorted and checked (each in (0, 1]),
    and its ``device_host`` costs checked (each a finite number >= 0)."""
    shares = tuple(sorted((str(k), float(v)) for k, v in cpu_gemm_share))
    expert_shares = tuple(sorted((str(k), float(v)) for k, v in cpu_expert_gemm_share))
    for what, table in (("cpu_gemm_share", shares), ("cpu_expert_gemm_share", expert_shares)):
        for k, v in table:
            if not math.isfinite(v) or not 0.0 < v <= 1.0:
                raise ValueError(f"{what}[{k!r}] must be in (0, 1], got {v}")
    if device_host is not None:
        for name, v in (
            ("step_us", device_host.step_us),
            ("block_us", device_host.block_us),
            ("expert_us", device_host.expert_us),
        ):
            if v < 0 or not math.isfinite(v):
                raise ValueError(f"device_host.{name} must be a finite number >= 0, got {v}")
    return shares, expert_shares


def cost_model(
    hw: HardwareProfile | str,
    model: ModelShape | str,
    cpu_kernels: str = "default",
    graph_kernel_us: float = 0.0,
    gpu_stream_efficiency: float = 1.0,
    cpu_call_us: float = 0.0,
    cpu_layer_us: float = 0.0,
    fused_moe_call_us: float = 0.0,
    fused_moe_stream_efficiency: float = 0.0,
    gpu_gemm_half_tokens: float = 0.0,
    cpu_gemm_share: tuple[tuple[str, float], ...] = (),
    device_host: DeviceHostCosts | None = None,
    cpu_expert_gemm_share: tuple[tuple[str, float], ...] = (),
    gpu_kernels: str = "default",
    gpu_moe_tile_tokens: float = 0.0,
) -> CostModel:
    """The cost model of a profile (or its name/path) and a model shape (or preset name), with
    the runtime's CPU kernels (``RuntimeProfile.cpu_kernels``), for a run whose one-token
    steps are CUDA-graph replays the graph's per-kernel cost, the runtime's GPU stream
    efficiency (``RuntimeProfile.gpu_stream_efficiency``), its fixed host time per CPU expert
    call and per CPU-resident layer (``RuntimeProfile.cpu_call_s``/``cpu_layer_s``, µs) and
    its fused MoE call's fixed device time and stream share (``RuntimeProfile.
    fused_moe_call_us``/``fused_moe_stream_efficiency``), its GPU GEMM half point
    (``gpu_gemm_half_tokens``) and GPU kernels (``gpu_kernels``: ``ggml`` multiplies at
    ``gpu.ggml_prompt_tflops`` where the profile states it) and the tile width its GPU MoE
    product gives each expert (``gpu_moe_tile_tokens``), its CPU GEMM shares
    (``cpu_gemm_share``, and ``cpu_expert_gemm_share`` for its expert products where they
    differ) and, for a runtime whose device is the host thread, the host time it adds to the
    device's work (``device_host``); cached."""
    profile = load_profile(hw) if isinstance(hw, str) else hw
    shape = get_model(model) if isinstance(model, str) else model
    dtype_bytes(shape.dtype)
    for name, kernels in (("cpu_kernels", cpu_kernels), ("gpu_kernels", gpu_kernels)):
        if kernels not in ("default", "ggml"):
            raise ValueError(f"{name} must be 'default' or 'ggml', got {kernels!r}")
    eff = gpu_stream_efficiency
    if not math.isfinite(eff) or not 0.0 < eff <= 1.0:
        raise ValueError(f"gpu_stream_efficiency must be in (0, 1], got {eff}")
    for name, v in (
        ("graph_kernel_us", graph_kernel_us),
        ("cpu_call_us", cpu_call_us),
        ("cpu_layer_us", cpu_layer_us),
        ("fused_moe_call_us", fused_moe_call_us),
        ("gpu_gemm_half_tokens", gpu_gemm_half_tokens),
        ("gpu_moe_tile_tokens", gpu_moe_tile_tokens),
    ):
        if v < 0 or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number >= 0, got {v}")
    fe = fused_moe_stream_efficiency
    if not math.isfinite(fe) or not 0.0 <= fe <= 1.0:
        raise ValueError(f"fused_moe_stream_efficiency must be in [0, 1], got {fe}")
    shares, expert_shares = _checked_shares(cpu_gemm_share, cpu_expert_gemm_share, device_host)
    return _cached(
        profile,
        shape,
        cpu_kernels,
        float(graph_kernel_us),
        float(eff),
        float(cpu_call_us),
        float(cpu_layer_us),
        float(fused_moe_call_us),
        float(fe),
        float(gpu_gemm_half_tokens),
        shares,
        device_host,
        expert_shares,
        gpu_kernels,
        float(gpu_moe_tile_tokens),
    )
