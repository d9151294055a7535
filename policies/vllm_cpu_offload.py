"""vllm-cpu-offload: vLLM's ``--cpu-offload-gb``: the first layers' weights stream every pass.

Source: vllm-project/vllm ``vllm/model_executor/models/utils.py`` (``set_cpu_offload_max_bytes``
and ``maybe_offload_to_cpu``, the version before UVA offloading); docs/references.md#vllm.

- Which weights. ``make_layers`` builds the decoder layers in order and passes each through
  ``maybe_offload_to_cpu``, which moves the layer's parameters one by one into pinned CPU memory
  until ``--cpu-offload-gb`` bytes are offloaded. So the offloaded weights are those of the
  first layers (a fused MoE layer's experts are one tensor per projection: all E experts go
  together). Here whole MoE layers are offloaded: the first ``offload_layers`` of them (0, the
  default: the fewest that let the rest fit beside the streaming buffers; at least 3 when any
  are, so a layer's buffer slots are reused only after the next streamed layer has run, and
  never by the layer itself on the next token).
- When they move. The offloaded module's ``forward`` is replaced by one that copies its whole
  state dict to the GPU (``v.to(device, non_blocking=True)`` from pinned memory) and runs the
  original forward on those copies (``torch.func.functional_call``); the copies are dropped
  afterwards. Every pass (a decode token or a prefill) moves all E experts of every offloaded
  layer, routed or not, and nothing is kept.
- How it is modelled: like ``stream-all``'s whole-layer gather, on the offloaded layers only.
  The routed experts are fetched into buffer slots and the layer's other experts are copied
  beside them (counted as wasted prefetches); two layers of buffer slots (2E) hold the copies,
  so a layer's copies never overwrite the previous layer's while it may still run. The other
  layers are resident with all their experts. Copies come from pinned memory.
- Not modelled: an offloaded layer's attention weights also stream (the engine keeps
  non-expert weights resident), and the byte quota may end inside a layer (per-parameter
  granularity); ``offload_layers`` rounds it to whole layers. The fused MoE kernel reads the
  whole expert tensor, so the real layer waits for all E copies; here it waits for its routed
  experts' copies, and the other copies (queued behind them on the link) may overlap its
  compute: at most one layer's compute is hidden per offloaded block.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

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
from daopsim.policies.options import Param
from daopsim.policies.registry import register
from daopsim.simulator.errors import DoesNotFit

FETCH: Final = Action.FETCH


@mypyc_attr(allow_interpreted_subclasses=True)
class VllmCpuOffloadPolicy(Policy):
    """The first layers' experts live in pinned host memory and are copied at every pass."""

    name = "vllm-cpu-offload"
    summary = (
        "vLLM --cpu-offload-gb: the first layers' weights stream from pinned memory every pass"
    )
    source = "vllm-project/vllm model_executor/models/utils.py maybe_offload_to_cpu"
    # vLLM replays decode steps as CUDA graphs by default (enforce_eager=False)
    runtime_profile = "cuda-graph"
    params = {
        "offload_layers": Param(
            int,
            0,
            "MoE layers whose experts live in pinned host memory (0: the fewest that fit; "
            "more than the model has: all)",
            minimum=0,
            search="moe_layers",
        ),
    }

    def resources(self) -> ResourceSpec:
        """Pinned host memory; copies land in buffer slots (no temporary buffer)."""
        return ResourceSpec(host_memory="pinned", temp_buffers=0)

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """Offload the leading layers; the others are resident with every expert."""
        n_layers, n_exp = ctx.model.moe_layers, ctx.model.experts
        want = self.options["offload_layers"]
        # like a --cpu-offload-gb above the model's size: every layer is offloaded
        want = min(want, n_layers)
        if ctx.budget >= n_layers * n_exp and want == 0:
            self.offload = 0
        else:
            # the streamed layers need two layers of buffer slots beside the resident ones
            fits = max(0, (ctx.budget - 2 * n_exp) // n_exp)
            need = n_layers - min(fits, n_layers)
            if ctx.budget < 2 * n_exp or (want and want < need):
                raise DoesNotFit(
                    ctx.budget,
                    f"policy {self.name!r}: {n_layers - max(want, 1)} resident layers and "
                    f"2 layers of streaming buffers do not fit in {ctx.budget} GPU expert slots"
                    + (f" (offload at least {max(need, 3)} layers)" if need < n_layers else ""),
                )
            # at least three: the buffer rotation frees a layer's slots two streamed layers
            # later, when its copies are known to be done, and that layer must not be the one
            # running (with two, a token's first streamed layer would reuse its own slots from
            # the token before while this token needs some of the same experts)
            self.offload = min(n_layers, max(want, need, 3))
        self.n_layers, self.n_exp = n_layers, n_exp
        self.live: list[int] = []  # streamed layers whose copies hold buffer slots, oldest first
        # each layer's (layer, expert) slots and prefetch entries, built once (tuples are
        # immutable, so plans may share them)
        # typed Any: a compiled build would rebuild a typed tuple at each read, and the engine
        # recognises the items of a plan it has seen before by their identity
        self._slots: list[list[Any]] = [[(ll, e) for e in range(n_exp)] for ll in range(n_layers)]
        self._entries: list[list[Any]] = [
            [(ll, e, None) for e in range(n_exp)] for ll in range(n_layers)
        ]
        return [(layer, e) for layer in range(self.offload, n_layers) for e in range(n_exp)]

    def decode_layer(self, view: View) -> Plan:
        """A resident layer runs; an offloaded one copies all its experts, runs the routed ones."""
        layer = view.layer
        if layer >= self.offload:
            return ALL_GPU_PLAN
        evict: list[Slot] = []
        live = self.live
        if len(live) >= 2:
            old = live.pop(0)
            res_old = view.resident[old].tolist()
            evict = [s for s, r in zip(self._slots[old], res_old, strict=True) if r]
        live.append(layer)
        routed = view.experts.tolist()
        want = set(routed)
        return Plan(
            actions=dict.fromkeys(routed, FETCH),
            evict=evict,
            prefetch=[t for t in self._entries[layer] if t[1] not in want],
        )


register(VllmCpuOffloadPolicy)
