"""accelerate: Hugging Face accelerate's ``device_map`` CPU offload through per-module hooks.

Source: huggingface/accelerate ``src/accelerate/hooks.py`` (commit 05daa80): ``AlignDevicesHook``
and ``attach_align_device_hook``; the placement rule of ``infer_auto_device_map``
(``src/accelerate/utils/modeling.py``); docs/references.md#accelerate.

- Placement. ``device_map="auto"`` fills the GPU with whole decoder layers in model order and
  keeps room for the largest offloaded layer (the execution buffer); the remaining layers stay
  in CPU memory. Here: the first ``budget // E - 1`` MoE layers are resident with all their
  experts (every layer when the whole model fits), the others are offloaded.
- Per-module hooks. ``attach_align_device_hook`` puts one ``AlignDevicesHook(offload=True)`` on
  every submodule of an offloaded layer that holds tensors of its own (each expert's linears,
  the attention projections), not on the layer as a whole. ``pre_forward`` copies that
  module's weights from the CPU state dict (plain, pageable tensors) to the GPU with
  ``set_module_tensor_to_device`` before the module runs, and ``post_forward`` puts them back
  on the ``meta`` device: nothing stays resident. So an offloaded expert is copied only when
  the model calls it. Transformers' Mixtral block calls only the routed experts in 4.37-4.39
  (it skips experts with no tokens) and again from the ``expert_hit`` loop (by 4.54); 4.40 to
  at least 4.51 call all 8 (docs/references.md#accelerate). This policy copies the routed
  experts.
- Timing. A copy from pageable memory goes through the driver's staging buffer and returns to
  the host only when done, and the module runs after it: one expert is copied, run and dropped
  before the next one's copy starts (one temporary buffer, pageable host memory).
- Not modelled: the offloaded layers' attention weights are copied on every pass as well
  (about 84 MB per Mixtral layer in fp16, against 2 x 352 MB of routed experts); the engine
  keeps non-expert weights resident. A transformers version whose MoE loop calls every expert
  (Mixtral under 4.40-4.51, or a fused experts module) would copy all E experts of each
  offloaded layer; the engine has no copy without compute to model that.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import (
    ALL_GPU_PLAN,
    Action,
    Plan,
    Policy,
    ResourceSpec,
    SetupContext,
    Slot,
    View,
)
from daopsim.policies.registry import register

TEMP: Final = Action.TEMP


@mypyc_attr(allow_interpreted_subclasses=True)
class AcceleratePolicy(Policy):
    """Leading layers resident; offloaded layers copy each called expert (pageable) and drop it."""

    name = "accelerate"
    summary = (
        "HF accelerate device_map offload: leading layers resident, per-module pageable copies"
    )
    source = "huggingface/accelerate hooks.py AlignDevicesHook (commit 05daa80)"
    # accelerate's hooks run inside an HF transformers model in PyTorch eager mode
    runtime_profile = "hf-eager"

    def resources(self) -> ResourceSpec:
        """Pageable host memory (plain CPU state dict), one module's copy at a time."""
        return ResourceSpec(host_memory="pageable", temp_buffers=1)

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """The leading layers that fit beside one layer's execution buffer, all experts each."""
        n_layers, n_exp = ctx.model.moe_layers, ctx.model.experts
        whole = ctx.budget // n_exp
        self.gpu_layers = n_layers if whole >= n_layers else max(0, whole - 1)
        return [(layer, e) for layer in range(self.gpu_layers) for e in range(n_exp)]

    def decode_layer(self, view: View) -> Plan:
        """A resident layer runs on the GPU; an offloaded one copies each routed expert."""
        if view.layer < self.gpu_layers:
            return ALL_GPU_PLAN
        return Plan(actions=dict.fromkeys(view.experts.tolist(), TEMP))


register(AcceleratePolicy)
