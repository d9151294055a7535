"""llama-cpp-layers: llama.cpp's ``-ngl N`` (``--n-gpu-layers``) whole-layer split.

Source: llama.cpp (ggml-org/llama.cpp), ``src/llama-model.cpp`` (``load_tensors``: the layer
to device assignment), ``ggml/src/ggml-cuda/ggml-cuda.cu`` and ``ggml/src/ggml-backend.cpp``
(the scheduler's op offload); the mechanism in docs/references.md#llama-cpp-layers.

- Placement: llama.cpp counts the output layer as one of the N offloaded layers and puts the
  last ones on the GPU: repeating block ``il`` goes to the GPU when
  ``il >= n_layer + 1 - N`` (``i_gpu_start``), the output layer whenever N >= 1, and the
  input embedding always stays in host memory. So N puts the last ``N - 1`` transformer blocks
  on the GPU (every block with N > n_layer). A GPU block holds everything: attention, router,
  KV cache and all its routed experts, placed once and never evicted. A CPU block keeps its
  weights and its KV cache in host memory and runs wholly on the CPU.
- Default (``ngl=-1``): as many blocks on the GPU as their experts fit once the CPU blocks'
  non-expert weights and KV cache have moved to host memory (the runner sizes it; Ollama picks
  its ``num_gpu`` layer count from free VRAM the same way, by layer).
- Memory: llama.cpp's compute buffers (about 0.24 GB for Mixtral at a 512-token context)
  replace the profile's PyTorch workspace (``ResourceSpec.workspace_gb``).
- Decode: a CPU layer runs its non-expert part and its selected experts on the CPU from host
  memory (one worker: ggml's threads all work on one operation at a time), with no activation
  copies; the hidden states cross the link once, at the split. A GPU layer runs all on the GPU.
- Prefill: the CUDA backend takes over any weight product whose batch is at least 32 tokens
  (``GGML_OP_OFFLOAD_MIN_BATCH``), copying the weights from host memory for it. A CPU layer
  then copies its non-expert weights to the GPU and runs its part there, and copies each
  expert the prompt uses (``TEMP``). ``prefill_offload=false`` keeps prefill on the CPU. The
  prompt is one batch here; llama.cpp repeats the copies once per micro-batch (``-ub``, 512).
"""

from __future__ import annotations

from collections.abc import Iterable

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import ResourceSpec, SetupContext, Slot
from daopsim.policies.llama_cpp_cpu_moe import OFFLOAD_MIN_BATCH, LeadingCpuLayers
from daopsim.policies.options import Param
from daopsim.policies.registry import register
from daopsim.simulator.errors import DoesNotFit, UserError
from daopsim.simulator.models import ModelShape

#: GPU memory llama.cpp keeps beside the weights for one context, GB: its load log for
#: Mixtral-8x7B at n_ctx 512 (ggml-org/llama.cpp issue #4381) reports a 117.85 MiB compute
#: buffer and a 114.54 MiB scratch buffer (the KV cache, 64 MiB there, is counted apart)
LLAMA_CPP_WORKSPACE_GB = (117.85 + 114.54) * 2**20 / 1e9


def gpu_blocks_for_ngl(ngl: int) -> int:
    """Transformer blocks llama.cpp puts on the GPU for ``-ngl ngl`` (-1: choose to fit).

    ``i_gpu_start = n_layer + 1 - ngl``: the output layer takes one of the ``ngl`` places.
    """
    if ngl < 0:
        return -1
    return max(0, ngl - 1)


@mypyc_attr(allow_interpreted_subclasses=True)
class LlamaCppLayersPolicy(LeadingCpuLayers):
    """The first layers wholly on the CPU, the last ``ngl - 1`` wholly on the GPU."""

    name = "llama-cpp-layers"
    summary = "llama.cpp -ngl: the last N layers wholly on the GPU, the first ones on the CPU"
    source = "llama.cpp --n-gpu-layers (src/llama-model.cpp load_tensors, ggml-backend op offload)"
    runtime_profile = "llama.cpp"
    prefill_note = (
        "prompt batches >= 32 tokens copy the CPU layers' weights and used experts to the GPU"
    )
    params = {
        "ngl": Param(
            int,
            -1,
            "llama.cpp's --n-gpu-layers: the output layer plus the last ngl-1 blocks on the "
            "GPU (-1 = as many as fit)",
            search="layers+1",
        ),
        "prefill_offload": Param(
            bool,
            True,
            "copy a CPU layer's weights and used experts to the GPU for prompts of >= "
            "offload_min_batch tokens (llama.cpp's op offload); false = the CPU runs them",
        ),
        "offload_min_batch": Param(
            int,
            OFFLOAD_MIN_BATCH,
            "tokens from which a prompt's weight products go to the GPU",
            minimum=1,
        ),
    }

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.ngl = int(self.options["ngl"])
        if self.ngl < -1:
            raise UserError(
                f"policy {self.name!r}: option 'ngl' must be -1 (fit) or >= 0, got {self.ngl}"
            )
        self.min_batch = int(self.options["offload_min_batch"])
        self.offload = bool(self.options["prefill_offload"])

    def resources(self) -> ResourceSpec:
        """Pinned host memory, one copy buffer, one CPU worker, the whole-layer split and
        llama.cpp's own compute-buffer workspace; each tensor held once, in the buffer of the
        device that runs it (llama.cpp's loader: ``host_copies = "offloaded"``)."""
        return ResourceSpec(
            host_memory="pinned",
            temp_buffers=1,
            cpu_workers=1,
            gpu_blocks=gpu_blocks_for_ngl(self.ngl),
            cpu_layer_offload_batch=self.min_batch if self.offload else 0,
            workspace_gb=LLAMA_CPP_WORKSPACE_GB,
            host_copies="offloaded",
        )

    def fixed_residency(self, model: ModelShape) -> int | None:
        """Every expert of the last ``ngl - 1`` layers; ``ngl=-1`` fills the budget instead."""
        blocks = gpu_blocks_for_ngl(self.ngl)
        if blocks < 0:
            return None
        return min(model.moe_layers, blocks) * model.experts

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """Every expert of every GPU layer (the layers after the CPU-resident ones)."""
        m = ctx.model
        self.n_cpu_layers = ctx.cpu_layers
        gpu_layers = m.moe_layers - self.n_cpu_layers
        need = gpu_layers * m.experts
        if need > ctx.budget:
            fits = ctx.budget // m.experts
            raise DoesNotFit(
                ctx.budget,
                f"policy {self.name!r}: the experts of {gpu_layers} GPU layers ({need}) do not "
                f"fit in the budget of {ctx.budget} experts ({fits} whole layers); use a "
                "smaller ngl (or ngl=-1 to fit)",
            )
        return [
            (layer, e) for layer in range(self.n_cpu_layers, m.moe_layers) for e in range(m.experts)
        ]


register(LlamaCppLayersPolicy)
