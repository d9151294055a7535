"""stream-all: DeepSpeed ZeRO-3 style, nothing resident, experts streamed at every use.

Source: DAOP's "DeepSpeed-MII" baseline, which is ZeRO-3 inference with parameter offload, so
every parameter streams from the host on every forward pass (docs/references.md#baselines), and
Fiddler's baseline script (efeslab/fiddler ``benchmarks/eval-baseline.py``):
ZeRO stage 3 with ``offload_param = {device: cpu, pin_memory: true}`` and
``deepspeed.utils.set_z3_leaf_modules(model, [MixtralSparseMoeBlock])``.

What ZeRO-3 streams. The leaf-module setting makes ZeRO-3 gather a whole MoE block, i.e. all E
experts of the layer, before the block runs, not just the routed ones. The measurements agree:
Fiddler's logs give DS-MII 0.20-0.23 tok/s on the A6000 (docs/references.md, "Published
measurements"). Streaming only the 2 routed experts per layer would move 64 x 352 MB = 22.5 GB
per token (>= 1.1 tok/s at the 26.2 GB/s pinned rate); streaming whole layers moves 256 x 352 MB
= 90 GB (about 0.29 tok/s), the right magnitude; the rest is ZeRO bookkeeping this simulator does
not model.

How it is modelled (``gather`` option):
- ``layer``: per layer, the routed experts are fetched into slots and the layer's other experts
  are copied too (as prefetches into the same layer, never used: they show up as wasted prefetch
  bytes); the slots of the layer two back are freed first. The slots are ZeRO-3's live-parameter
  memory (two layers of experts, 2E slots, so a layer's copies never overlap the reuse of their
  slots); nothing is kept from one visit of a layer to the next, so the hit rate is 0.
- ``selected``: only the routed experts, each through a temporary buffer (TEMP), budget unused.
- ``auto`` (default): ``layer`` when the budget has 2E slots and the model at least 3 MoE
  layers, else ``selected`` (the chosen mode is recorded in the run's policy options).
``gather=leaf`` (not the default, so earlier results stand) is ``layer`` with the gather timed
as ZeRO-3 runs it: ``PartitionedParameterCoordinator.fetch_sub_module`` (deepspeed/runtime/zero/
partitioned_param_coordinator.py) issues the all-gather of every parameter of the module being
entered, a leaf MoE block's included, and makes the compute stream wait for all of them before
the module's forward runs; only then does it prefetch the next parameters in the recorded
order, at most ``prefetch_bucket_size`` elements (default 50 M, less than one Mixtral expert's
w1 of 58.7 M). So no expert of the block starts before the whole block has landed: with
``gather=leaf`` the layer's GPU experts wait for every copy into the layer
(``Plan.barrier``), instead of each starting when its own copy lands.
Copies come from pinned memory (``pin_memory: true`` above).

The non-expert weights (``stream_nonexpert``, default true, in every gather mode: each mode is
ZeRO-3's expert traffic, and ZeRO-3 partitions every parameter, not only the leaf block's). ZeRO-3
keeps on the GPU only parameters of at most ``stage3_param_persistence_threshold`` elements
(default 1e5: norms, Mixtral's 32,768-element routers) and fetches every other one in its
module's pre-forward hook on every forward pass. So the policy declares
``ResourceSpec(nonexpert_streamed=True)``: the engine copies each layer's non-expert weights
(Mixtral: the attention projections, 84.2 MB in bf16) over the host-to-device link before the
layer's non-expert part, and the input embedding and the output matrix (262.1 MB each) once per
forward pass; 3.22 GB per pass for Mixtral, about 3.6 % of the whole-layer expert bytes
(docs/cost-model.md, "Streamed non-expert weights (ZeRO-3)"; sources in
docs/references.md#deepspeed-zero-3-parameter-offload). Not modelled: the prefetch bucket's early
fetch, during a layer's attention, of the first expert matrix of its MoE block (at most one
matrix per layer, so slightly pessimistic there). ``stream_nonexpert=false`` keeps them resident
(the model before this mechanism; runs on several GPUs need it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import Action, Plan, Policy, ResourceSpec, SetupContext, Slot, View
from daopsim.policies.options import Param
from daopsim.policies.registry import register
from daopsim.simulator.errors import UserError

FETCH: Final = Action.FETCH
TEMP: Final = Action.TEMP


@mypyc_attr(allow_interpreted_subclasses=True)
class StreamAllPolicy(Policy):
    """Nothing stays on the GPU; every use of a layer streams its experts from the host."""

    name = "stream-all"
    summary = "DeepSpeed ZeRO-3 style: every expert streamed every time (nothing resident)"
    source = "DeepSpeed ZeRO-3 param offload as run by DAOP/Fiddler (DS-MII baseline)"
    # DeepSpeed ZeRO-3 wraps the HF model; it runs in eager mode
    runtime_profile = "hf-eager"
    #: nothing stays on the GPU between uses: experiments run it once, not per cache ratio
    keeps_nothing_resident = True
    params = {
        "gather": Param(
            str,
            "auto",
            "'layer': all E experts of a layer per use (ZeRO-3 leaf MoE block); "
            "'leaf': as layer, and the experts start only once the whole gather has landed; "
            "'selected': only the routed ones; 'auto': layer if 2E slots fit",
            choices=("auto", "layer", "leaf", "selected"),
        ),
        "stream_nonexpert": Param(
            bool,
            True,
            "the non-expert weights live in host memory and are copied in before each layer "
            "(and embedding/lm_head once per pass), as ZeRO-3 does; false keeps them on the GPU",
        ),
    }

    def resources(self) -> ResourceSpec:
        """Pinned host memory (``pin_memory: true``), one temporary buffer, and the
        non-expert weights streamed from the host on every forward pass (ZeRO-3 partitions
        every parameter above ``stage3_param_persistence_threshold``, 1e5 elements)."""
        return ResourceSpec(
            host_memory="pinned",
            temp_buffers=1,
            nonexpert_streamed=self.options["stream_nonexpert"],
        )

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """No initial placement; pick the gather mode."""
        n_layers, n_exp = ctx.model.moe_layers, ctx.model.experts
        fits = ctx.budget >= 2 * n_exp and n_layers >= 3
        mode = self.options["gather"]
        if mode == "auto":
            mode = "layer" if fits else "selected"
        elif mode in ("layer", "leaf") and not fits:
            raise UserError(
                f"policy {self.name!r}: gather={mode} needs {2 * n_exp} GPU expert slots and at "
                f"least 3 MoE layers (budget {ctx.budget}, {n_layers} layers); "
                "use --policy-opt gather=selected"
            )
        self.options = {**self.options, "gather": mode}
        self.layer_mode = mode in ("layer", "leaf")
        self.barrier = mode == "leaf"
        self.n_layers, self.n_exp = n_layers, n_exp
        # each layer's (layer, expert) slots and prefetch entries, built once (tuples are
        # immutable, so plans may share them)
        # typed Any: a compiled build would rebuild a typed tuple at each read
        self._slots: list[list[Any]] = [[(ll, e) for e in range(n_exp)] for ll in range(n_layers)]
        self._entries: list[list[Any]] = [
            [(ll, e, None) for e in range(n_exp)] for ll in range(n_layers)
        ]
        #: (layer, routed experts) -> that layer's prefetch entries (decode_layer)
        self._prefetch_lists: dict[tuple[int, ...], list[Any]] = {}
        #: (layer, routed experts) -> the plan made when every expert of the victim layer was
        #: resident (each visit streams a whole layer in, so that is every visit but the first
        #: two layers' first): the same decisions every time, so one plan object is returned
        #: again (the engine never changes a plan; it checks each one it is given)
        self._plans: dict[tuple[int, ...], Plan] = {}
        #: each layer's victim layer, the one two back (its slots are freed first)
        self._victim_layer = [(ll - 2) % n_layers for ll in range(n_layers)]
        return []

    def decode_layer(self, view: View) -> Plan:
        """Stream this layer's experts (routed ones for compute)."""
        routed = view.experts.tolist()
        if not self.layer_mode:
            return Plan(actions=dict.fromkeys(routed, TEMP))
        layer = view.layer
        old = self._victim_layer[layer]
        res_old = view.resident[old].tolist()
        key = (layer, *routed)
        full = False not in res_old  # every expert of that layer resident
        if full:
            plan = self._plans.get(key)
            if plan is not None:
                return plan
            evict = self._slots[old][:]
        else:
            evict = [s for s, r in zip(self._slots[old], res_old, strict=True) if r]
        # the prefetch list depends on the layer and its routed experts only: made once each
        prefetch = self._prefetch_lists.get(key)
        if prefetch is None:
            want = set(routed)
            prefetch = [t for t in self._entries[layer] if t[1] not in want]
            self._prefetch_lists[key] = prefetch
        plan = Plan(
            actions=dict.fromkeys(routed, FETCH),
            evict=evict,
            prefetch=prefetch[:],  # a list of the plan's own
            barrier=self.barrier,
        )
        if full:
            self._plans[key] = plan
        return plan


register(StreamAllPolicy)
