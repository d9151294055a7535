"""all-gpu: every expert resident on the GPU. The upper bound no offloading policy can beat.

It ignores the memory budget (every expert is placed, and the run reports all of them as GPU
experts), so it answers "how fast if memory were not the problem?" on the same cost model.
"""

from __future__ import annotations

from collections.abc import Iterable

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import ALL_GPU_PLAN, Plan, Policy, ResourceSpec, SetupContext, Slot, View
from daopsim.policies.registry import register


@mypyc_attr(allow_interpreted_subclasses=True)
class AllGPUPolicy(Policy):
    """All experts resident: every access is a hit."""

    name = "all-gpu"
    summary = "every expert resident on the GPU (upper bound)"
    source = "bound: no offloading"
    bound = True

    def resources(self) -> ResourceSpec:
        """Every expert placed whatever the budget; no temporary buffer needed."""
        return ResourceSpec(unlimited_memory=True, temp_buffers=0)

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """Place every expert of every layer."""
        return [
            (layer, e) for layer in range(ctx.model.moe_layers) for e in range(ctx.model.experts)
        ]

    def decode_layer(self, view: View) -> Plan:
        """Everything runs on the GPU."""
        return ALL_GPU_PLAN


register(AllGPUPolicy)
