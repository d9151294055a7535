"""fiddler: popularity placement, the CPU runs every non-resident expert (Kamahori et al.).

Source: Fiddler, ICLR 2025 (arXiv 2402.07033), code efeslab/fiddler@227715b
``src/fiddler/mixtral.py``; its mechanism and break-even rule in docs/references.md#fiddler.

- Placement: the globally most popular ``budget`` (layer, expert) pairs of a calibration ranking
  (``daopsim.policies.placement.global_top``); no per-layer minimum, never changed afterwards.
- Routing is exact; no prediction, no prefetch, no replacement.
- Decode: a resident selected expert runs on the GPU; every other selected expert runs on the
  CPU (activations to the host and back). Fiddler does this synchronously within the layer:
  its CPU experts run one after another on the thread that drives the GPU, and the layer's
  output needs them all, so nothing overlaps across layers. Modelled with ``cpu_serial`` and
  ``cpu_first`` (the code enqueues the GPU experts first and then blocks on the CPU ones; a
  layer takes the sum either way).
- Prefill: per non-resident expert with ``count`` prompt tokens, Fiddler's rule: CPU when
  ``count x cpu_time(1 token) < load time``, otherwise its weights are copied into the one
  placeholder GPU buffer, run and dropped (``TEMP``). The code compares exactly these two
  numbers (``latency_cpu x tokens`` against a constant ``latency_gpu``). They are decision
  inputs: by default the code's own constants (7 and 70, relative units, so the CPU wins below
  10 tokens); option ``constants`` picks the profile's measured constants or the cost model
  instead. The engine times what really runs from the cost model either way.
- Host memory: pageable. The experts Fiddler does not place stay in the ordinary CPU tensors
  ``from_pretrained`` created, and a copy is ``expert_placeholder.load_state_dict(...)`` from
  them; nothing is pinned (DAOP, a fork of Fiddler, loads the same way:
  docs/references.md#expert-times). One placeholder, so one temporary buffer; one CPU worker
  (the expert uses all torch threads).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import (
    Action,
    Plan,
    ResourceSpec,
    SetupContext,
    Slot,
    StaticPlacementPolicy,
    View,
)
from daopsim.policies.options import Param
from daopsim.policies.placement import global_top
from daopsim.policies.registry import register

GPU: Final = Action.GPU
TEMP: Final = Action.TEMP
CPU: Final = Action.CPU
#: efeslab/fiddler src/fiddler/mixtral.py (commit 227715b): ``self.latency_cpu = 7`` and
#: ``self.latency_gpu = 70``, relative units with a TODO to calibrate them per device.
CODE_LATENCY_CPU = 7.0
CODE_LATENCY_GPU = 70.0


@mypyc_attr(allow_interpreted_subclasses=True)
class FiddlerPolicy(StaticPlacementPolicy):
    """Global top-B placement; misses run on the CPU; prefill by the break-even rule."""

    name = "fiddler"
    summary = "global popularity placement; CPU runs non-resident experts; prefill break-even"
    source = "Fiddler (ICLR'25, arXiv 2402.07033), efeslab/fiddler mixtral.py"
    # Fiddler's mixtral.py drives HF transformers' Mixtral in eager mode
    runtime_profile = "hf-eager"
    needs_calibration = True
    prefill_note = "prefill break-even rule (CPU or temporary copy)"
    params = {
        "constants": Param(
            str,
            "code",
            "what the prefill rule (count x cpu < load) believes: 'code' = Fiddler's constants "
            "7 and 70; 'measured' = the profile's measured constants, else the cost model; "
            "'model' = the cost model's one-token CPU time and pageable copy",
            choices=("code", "measured", "model"),
        ),
    }

    def resources(self) -> ResourceSpec:
        """Pageable host memory, one placeholder buffer, one CPU worker (see module doc)."""
        return ResourceSpec(host_memory="pageable", temp_buffers=1, cpu_workers=1)

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """The globally most popular experts by decode-time calibration counts."""
        assert ctx.calibration is not None
        self.new_placement()
        choice = self.options["constants"]
        if choice == "code":
            self.t_cpu1, self.t_load = CODE_LATENCY_CPU, CODE_LATENCY_GPU
        else:
            self.t_cpu1, self.t_load = ctx.costs.decision_times(choice == "measured")
        return global_top(ctx.calibration, ctx.budget)

    def static_plan(self, view: View, experts: list[int]) -> Plan:
        """Resident experts on the GPU, the rest on the CPU, synchronously (a decode step's
        plan, made once per layer and experts: the residency never changes after setup)."""
        resident = view.resident[view.layer]
        actions = {e: (GPU if resident[e] else CPU) for e in experts}
        return Plan(actions=actions, cpu_serial=True, cpu_first=True)

    def prefill_layer(self, view: View) -> Plan:
        """Per non-resident expert: CPU if count x cpu(1) < load time, else a temporary copy."""
        resident = view.resident[view.layer]
        counts = view.counts
        assert counts is not None
        actions: dict[int, Action] = {}
        for e in view.experts.tolist():
            if resident[e]:
                actions[e] = GPU
            else:
                actions[e] = CPU if int(counts[e]) * self.t_cpu1 < self.t_load else TEMP
        return Plan(actions=actions, cpu_serial=True, cpu_first=True)


register(FiddlerPolicy)
