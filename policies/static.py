"""static: popularity placement, a miss is copied into a temporary buffer, run and dropped.

This is DAOP's MoE-OnDemand baseline (docs/references.md#baselines): DAOP's initial
placement (per-layer quota plus global fill from a calibration ranking), exact routing, a miss
is copied synchronously into one temporary GPU buffer from pageable host memory (the DAOP code
loads with load_state_dict), used and dropped; no replacement, no prefetch.
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
from daopsim.policies.placement import global_top, quota_then_global
from daopsim.policies.registry import register


@mypyc_attr(allow_interpreted_subclasses=True)
class StaticPolicy(StaticPlacementPolicy):
    """Fixed placement by calibration popularity; misses stream through a temporary buffer."""

    name = "static"
    summary = "popularity placement; misses copied to a temp buffer, run, dropped (on-demand)"
    source = "DAOP's MoE-OnDemand baseline (arXiv 2501.10375)"
    # DAOP's baseline, run in DAOP's HF eager harness
    runtime_profile = "hf-eager"
    needs_calibration = True
    params = {
        "placement": Param(
            str,
            "quota",
            "'quota' (DAOP: per-layer floor(B/L) then global) or 'global' (Fiddler: global top-B)",
            choices=("quota", "global"),
        ),
        "host_memory": Param(
            str, "pageable", "host memory the copies come from", choices=("pageable", "pinned")
        ),
    }

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.host_memory = str(self.options["host_memory"])

    def resources(self) -> ResourceSpec:
        """The ``host_memory`` option's copies, one temporary buffer."""
        return ResourceSpec(host_memory=self.host_memory)

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """Most popular experts by decode-time calibration counts."""
        assert ctx.calibration is not None
        self.new_placement()
        if self.options["placement"] == "global":
            return global_top(ctx.calibration, ctx.budget)
        return quota_then_global(ctx.calibration, ctx.budget)

    def static_plan(self, view: View, experts: list[int]) -> Plan:
        """Resident experts on the GPU, the others through the temporary buffer (made once
        per layer and experts: temporary copies never change the residency); all resident in
        a decode step: the shared all-on-the-GPU plan (the same plan for the engine)."""
        resident = view.resident[view.layer]
        actions = {e: (Action.GPU if resident[e] else Action.TEMP) for e in experts}
        if Action.TEMP in actions.values() or view.counts is not None:
            return Plan(actions=actions)
        return ALL_GPU_PLAN


register(StaticPolicy)
