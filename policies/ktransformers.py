"""ktransformers: routed experts on the CPU, optional GPU-resident experts, both at once.

Source: kTransformers (kvcache-ai/ktransformers), ``doc/en/kt-kernel/experts-sched-Tutorial.md``
(commit 15c624d) and ``kt-kernel/python/experts_base.py`` (commit 842ce66); the mechanism in
docs/references.md#ktransformers.

- Attention (MLA), routers and shared experts run on the GPU (the non-expert part here); routed
  experts run on the CPU with kTransformers' AVX-512/AMX kernels, one operation per layer that
  uses every core: one CPU worker. The CPU expert time is the cost model's CPU curve (there is
  no per-kernel CPU efficiency hook in the cost model, so AMX is not credited separately).
- Optional GPU experts, placed once at load and never moved (``--kt-num-gpu-experts`` per layer,
  or ``--kt-gpu-experts-ratio`` of all experts), by ``--kt-expert-placement-strategy``:
  ``frequency`` (the globally most activated experts of calibration data, across layers:
  ``generate_gpu_experts_masks`` takes the top-k of the flattened counts), ``uniform`` (the same
  number in every layer; the default), ``front-loading`` (layer 0's experts first, then layer
  1's, ...) or ``random`` (a fixed seed). Within a layer, ``uniform`` and ``front-loading`` take
  the lowest expert ids (the tutorial does not say which; any fixed choice is equivalent for
  routing that does not favour low ids).
- Decode and prefill: a selected GPU expert runs on the GPU, every other selected expert on the
  CPU, concurrently: the CPU work is submitted before the GPU experts and joined at the end of
  the layer, so the layer takes the longer of the two. Dynamic expert update is not modelled.
- ``prefill = "gpu"``: a prompt's non-resident experts are copied into a temporary buffer and
  run on the GPU instead (``prefill_device: "cuda"``, ``prefill_op: "KExpertsTorch"`` for every
  layer's experts, as HybriMoE's repository configures kTransformers for its comparison:
  PKU-SEC-Lab/HybriMoE ``optimize_rules/Mixtral-25%.yaml`` and its siblings, commit 17a1107).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

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
from daopsim.policies.placement import global_top, per_layer_quota
from daopsim.policies.registry import register
from daopsim.simulator.errors import DoesNotFit
from daopsim.simulator.models import ModelShape

#: experts-sched-Tutorial.md: the ``random`` strategy "randomly selects experts with fixed seed
#: (42)"; daopsim's generator differs from torch's, so the same seed picks other experts.
RANDOM_SEED = 42
PLACEMENTS = ("uniform", "frequency", "front-loading", "random")


def place_gpu_experts(
    placement: str, total: int, n_layers: int, n_experts: int, counts: np.ndarray | None = None
) -> list[Slot]:
    """The ``total`` (layer, expert) pairs a placement strategy puts on the GPU."""
    if total <= 0:
        return []
    if placement == "frequency":
        assert counts is not None
        return global_top(counts, total)
    if placement == "uniform":
        quota = per_layer_quota(total, n_layers)
        return [(layer, e) for layer in range(n_layers) for e in range(quota[layer])]
    if placement == "front-loading":
        return [(i // n_experts, i % n_experts) for i in range(total)]
    rng = np.random.default_rng(RANDOM_SEED)
    picked = np.sort(rng.choice(n_layers * n_experts, size=total, replace=False))
    return [(int(i) // n_experts, int(i) % n_experts) for i in picked]


@mypyc_attr(allow_interpreted_subclasses=True)
class KTransformersPolicy(StaticPlacementPolicy):
    """CPU experts with GPU-resident experts placed by a strategy; both run concurrently."""

    name = "ktransformers"
    summary = "routed experts on the CPU, optional GPU experts by strategy, run concurrently"
    source = "kTransformers (kvcache-ai/ktransformers), experts-sched tutorial, kt-kernel"
    runtime_profile = "ktransformers"
    params = {
        "gpu_experts_per_layer": Param(
            int,
            0,
            "GPU-resident experts per MoE layer (--kt-num-gpu-experts)",
            minimum=0,
            search="experts",
        ),
        "gpu_experts_ratio": Param(
            float,
            0.0,
            "share of all experts on the GPU (--kt-gpu-experts-ratio); > 0 overrides "
            "gpu_experts_per_layer",
            minimum=0,
            maximum=1,
        ),
        "placement": Param(
            str,
            "uniform",
            "which experts (--kt-expert-placement-strategy)",
            choices=PLACEMENTS,
        ),
        "prefill": Param(
            str,
            "cpu",
            "a prompt's non-resident experts: 'cpu' (the decode rule) or 'gpu' (copied into a "
            "temporary buffer and run there, KExpertsTorch)",
            choices=("cpu", "gpu"),
        ),
    }

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.per_layer = int(self.options["gpu_experts_per_layer"])
        self.ratio = float(self.options["gpu_experts_ratio"])

    def uses_calibration(self) -> bool:
        """Only the ``frequency`` placement of some GPU experts reads calibration counts."""
        wants_gpu = self.per_layer > 0 or self.ratio > 0
        return wants_gpu and self.options["placement"] == "frequency"

    def resources(self) -> ResourceSpec:
        """Pinned host memory, one CPU worker (the kernel uses all cores); a temporary buffer
        only for ``prefill = "gpu"``."""
        buffers = 1 if self.options["prefill"] == "gpu" else 0
        return ResourceSpec(host_memory="pinned", temp_buffers=buffers, cpu_workers=1)

    def gpu_expert_count(self, moe_layers: int, experts: int) -> int:
        """Total GPU experts the options ask for on a model of this shape."""
        if self.ratio > 0:
            return round(self.ratio * moe_layers * experts)
        return min(self.per_layer, experts) * moe_layers

    def fixed_residency(self, model: ModelShape) -> int | None:
        """The strategy's GPU experts: the options fix how many, not the budget."""
        return self.gpu_expert_count(model.moe_layers, model.experts)

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """The strategy's GPU experts; they must fit the budget."""
        m = ctx.model
        self.new_placement()
        total = self.gpu_expert_count(m.moe_layers, m.experts)
        if total > ctx.budget:
            raise DoesNotFit(
                ctx.budget,
                f"policy {self.name!r}: the {total} GPU experts requested do not fit in the "
                f"budget of {ctx.budget} ({ctx.budget // m.moe_layers} per layer); lower "
                "gpu_experts_per_layer/gpu_experts_ratio or raise --cache-ratio/--gpu-experts",
            )
        return place_gpu_experts(
            str(self.options["placement"]), total, m.moe_layers, m.experts, ctx.calibration
        )

    def static_plan(self, view: View, experts: list[int]) -> Plan:
        """Resident experts on the GPU, the others on the CPU, concurrently (made once per
        layer and experts: the residency never changes after setup)."""
        resident = view.resident[view.layer]
        return Plan(actions={e: (Action.GPU if resident[e] else Action.CPU) for e in experts})

    def prefill_layer(self, view: View) -> Plan:
        """The decode rule, or (``prefill = "gpu"``) every non-resident expert through a
        temporary buffer on the GPU."""
        if self.options["prefill"] != "gpu":
            return self.decode_layer(view)
        resident = view.resident[view.layer]
        return Plan(
            actions={e: (Action.GPU if resident[e] else Action.TEMP) for e in view.experts.tolist()}
        )


register(KTransformersPolicy)
