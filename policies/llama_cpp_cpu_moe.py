"""llama-cpp-cpu-moe: llama.cpp's ``--cpu-moe`` / ``--n-cpu-moe N`` expert split.

Source: llama.cpp (ggml-org/llama.cpp PR #15077), ``common/arg.cpp`` and ``common/common.h``
(commit 145b628), ``ggml/src/ggml-cuda/ggml-cuda.cu`` and ``ggml/src/ggml-backend.cpp``
(commit f6d77a1); the mechanism in docs/references.md#llama-cpp-cpu-moe.

- Placement: ``--n-cpu-moe N`` adds one tensor-buffer override per block ``blk.0`` ..
  ``blk.N-1`` matching that block's routed-expert tensors (``ffn_{up,down,gate}_exps``), so the
  routed experts of the first N transformer blocks stay in host memory. Shared-expert tensors
  (``ffn_*_shexp``), attention and routers do not match and stay on the GPU (they are the
  non-expert part here). ``--cpu-moe`` matches every block: option ``n_cpu_moe=-1``. N counts
  transformer blocks, dense ones included; daopsim's models do not record where their dense
  blocks are, so they are taken to lead (as in DeepSeek-V2/V3 and Kimi-K2).
- Every routed expert of every other MoE layer is resident on the GPU, placed once, never
  evicted; they must fit the GPU budget (else a one-line error naming the smallest N that fits).
- Decode: a GPU layer runs all its experts on the GPU; a CPU layer ships its activations to the
  host, runs its selected experts on the CPU (one worker: ggml's threads all work on one
  operation) and ships the result back. No prefetch, no caching.
- Prefill: the CUDA backend asks for any expert matrix product whose batch (tokens in the
  micro-batch) is at least 32 (``GGML_OP_OFFLOAD_MIN_BATCH``), so a CPU layer's experts are
  then copied to the GPU and run there; the scheduler copies only the experts the batch uses.
  Modelled as one temporary copy (``TEMP``) per used expert when the prompt has at least
  ``offload_min_batch`` tokens, else the CPU runs them. ``prefill_offload=false`` turns the
  copies off (as a huge ``GGML_OP_OFFLOAD_MIN_BATCH`` does). The prompt is one batch here;
  llama.cpp repeats the copies once per micro-batch (``-ub``, 512 by default).
- Host memory: pinned (the GPU's host buffer type) unless ``host_memory=pageable``: builds of
  April 2025 put tensors overridden with ``-ot ...=CPU`` in the plain CPU buffer type (mapped
  from the file, or allocated with ``--no-mmap``), so the prompt's copies read pageable memory
  (docs/cost-model.md, "CPU-resident layers").
"""

from __future__ import annotations

from collections.abc import Iterable

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import (
    ALL_GPU_PLAN,
    Action,
    Plan,
    ResourceSpec,
    SetupContext,
    Slot,
    StaticPlacementPolicy,
    View,
)
from daopsim.policies.options import Param
from daopsim.policies.registry import register
from daopsim.simulator.errors import DoesNotFit, UserError
from daopsim.simulator.models import ModelShape

#: ggml-cuda.cu (commit f6d77a1): the CUDA backend offloads an operation whose batch is at
#: least this many tokens unless the ``GGML_OP_OFFLOAD_MIN_BATCH`` environment variable says
#: otherwise.
OFFLOAD_MIN_BATCH = 32


def cpu_moe_layers(n_cpu_moe: int, layers: int, moe_layers: int) -> int:
    """How many MoE layers (from the first) keep their experts on the CPU for ``n_cpu_moe``.

    ``n_cpu_moe`` counts transformer blocks from block 0; the ``layers - moe_layers`` dense
    blocks are taken to come first. ``-1`` means every layer (``--cpu-moe``).
    """
    if n_cpu_moe < 0:
        return moe_layers
    dense = layers - moe_layers
    return max(0, min(moe_layers, n_cpu_moe - dense))


@mypyc_attr(allow_interpreted_subclasses=True)
class LeadingCpuLayers(StaticPlacementPolicy):
    """The plans of llama.cpp's two splits (``--n-cpu-moe`` and ``-ngl``): the routed experts of
    the first ``n_cpu_layers`` MoE layers run on the CPU, except that a prompt of at least
    ``min_batch`` tokens copies them to the GPU when ``offload`` is set (op offload); the
    other layers keep every expert resident. Subclasses set the three in ``__init__``/``setup``."""

    n_cpu_layers: int
    offload: bool
    min_batch: int

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.n_cpu_layers = 0
        self.offload = False
        self.min_batch = OFFLOAD_MIN_BATCH

    def decode_layer(self, view: View) -> Plan:
        """A GPU layer: all on the GPU (the shared plan, without a look-up); a CPU layer: the
        memoised plan of its experts on the CPU."""
        if view.layer >= self.n_cpu_layers:
            return ALL_GPU_PLAN
        return super().decode_layer(view)

    def static_plan(self, view: View, experts: list[int]) -> Plan:
        """A CPU layer's experts on the CPU."""
        return Plan(actions=dict.fromkeys(experts, Action.CPU))

    def prefill_layer(self, view: View) -> Plan:
        """A CPU layer's experts are copied to the GPU when the prompt reaches the batch floor."""
        if view.layer >= self.n_cpu_layers:
            return Plan()
        on_gpu = self.offload and view.n_tokens >= self.min_batch
        return Plan(
            actions=dict.fromkeys(view.experts.tolist(), Action.TEMP if on_gpu else Action.CPU)
        )


@mypyc_attr(allow_interpreted_subclasses=True)
class LlamaCppCpuMoePolicy(LeadingCpuLayers):
    """Routed experts of the first N layers on the CPU, the other layers' experts all resident."""

    name = "llama-cpp-cpu-moe"
    summary = "llama.cpp --n-cpu-moe: first N layers' experts on the CPU, the rest resident"
    source = "llama.cpp --cpu-moe/--n-cpu-moe (ggml-org/llama.cpp PR #15077)"
    runtime_profile = "llama.cpp"
    prefill_note = "prompt batches >= 32 tokens copy the CPU layers' experts to the GPU"
    params = {
        "n_cpu_moe": Param(
            int,
            -1,
            "blocks whose routed experts stay on the CPU, counted from block 0 "
            "(-1 = all, --cpu-moe)",
            search="layers",
        ),
        "prefill_offload": Param(
            bool,
            True,
            "copy a CPU layer's used experts to the GPU for prompts of >= offload_min_batch "
            "tokens (llama.cpp's op offload); false = the CPU runs them",
        ),
        "offload_min_batch": Param(
            int,
            OFFLOAD_MIN_BATCH,
            "tokens from which a prompt's expert products go to the GPU",
            minimum=1,
        ),
        "host_memory": Param(
            str,
            "pinned",
            "where the CPU layers' experts live, which sets the rate of the prompt's op-offload "
            "copies: 'pinned' (the GPU's host buffer type) or 'pageable' (the CPU buffer type: a "
            "memory-mapped file or plain allocation, as -ot ...=CPU gives in builds of April "
            "2025)",
            choices=("pinned", "pageable"),
        ),
    }

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.n_cpu_moe = int(self.options["n_cpu_moe"])
        if self.n_cpu_moe < -1:
            raise UserError(
                f"policy {self.name!r}: option 'n_cpu_moe' must be -1 (all) or >= 0, "
                f"got {self.n_cpu_moe}"
            )
        self.min_batch = int(self.options["offload_min_batch"])
        self.offload = bool(self.options["prefill_offload"])
        self.host_memory = str(self.options.get("host_memory", "pinned"))

    def resources(self) -> ResourceSpec:
        """Host memory of option ``host_memory`` (pinned: llama.cpp's CUDA host buffers), one
        copy buffer, one CPU worker; each tensor held once, in the buffer of the device that
        runs it (llama.cpp's loader: ``host_copies = "offloaded"``)."""
        return ResourceSpec(
            host_memory=self.host_memory, temp_buffers=1, cpu_workers=1, host_copies="offloaded"
        )

    def fixed_residency(self, model: ModelShape) -> int | None:
        """Every expert of the GPU layers: ``n_cpu_moe`` fixes them, not the budget."""
        cpu = cpu_moe_layers(self.n_cpu_moe, model.layers, model.moe_layers)
        return (model.moe_layers - cpu) * model.experts

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """Every expert of every GPU layer (the layers after the first N)."""
        m = ctx.model
        self.n_cpu_layers = cpu_moe_layers(self.n_cpu_moe, m.layers, m.moe_layers)
        gpu_layers = m.moe_layers - self.n_cpu_layers
        need = gpu_layers * m.experts
        if need > ctx.budget:
            fits = ctx.budget // m.experts
            smallest = m.moe_layers - fits + (m.layers - m.moe_layers)
            raise DoesNotFit(
                ctx.budget,
                f"policy {self.name!r}: with n_cpu_moe={self.n_cpu_moe} the experts of "
                f"{gpu_layers} GPU layers ({need}) do not fit in the budget of {ctx.budget} "
                f"experts ({fits} whole layers); use n_cpu_moe >= {smallest} or a larger "
                "--cache-ratio/--gpu-experts",
            )
        return [
            (layer, e) for layer in range(self.n_cpu_layers, m.moe_layers) for e in range(m.experts)
        ]


register(LlamaCppCpuMoePolicy)
