"""hobbit: per-layer LRU cache with HOBBIT's mixed-precision loading of less important misses.

Source: Tang et al., "HOBBIT: A Mixed Precision Expert Offloading System for Fast MoE
Inference" (arXiv 2411.01433), token-level dynamic expert loading; facts in
docs/references.md#hobbit. HOBBIT's insight: a cache-miss expert that contributes little to the
token's output can be loaded as a low-precision copy (fewer bytes over the link) instead of the
full one, at a small accuracy cost.

The rule, per decode token and layer, over the token's top-k experts in rank order: an expert's
importance is measured by the gate mass of the experts ranked above it, as a share of the
token's top-k mass (``c = sum of higher-ranked weights / sum of top-k weights``; the top expert
has ``c = 0``). A resident expert runs as usual. A missed expert

* with ``c <= low_bit_threshold`` (0.6) is fetched in full precision into the cache (LRU, as
  ``lru``);
* with ``low_bit_threshold < c <= skip_threshold`` (0.9) is copied as its ``low_bit`` copy
  into a temporary buffer, run in low precision and dropped: the copy moves
  ``expert_bytes(low_bit)`` (simulator/costs.py ``h2d_low_bit_expert_s``), and its gate
  weight counts in the ``low_precision_gate_mass`` metric (docs/metrics.md);
* with ``c > skip_threshold`` is skipped: the route drops it, and it counts as a degraded
  replacement in the routing-fidelity metrics (``skip_threshold=1`` never skips).

Modelling choices (not from HOBBIT): the low-precision copy is not cached (HOBBIT keeps a
separate low-precision pool); a low-precision expert takes the same GPU time as a full one
(the cost model's GPU roofline for the model's dtype); the cache is a per-layer LRU, not
HOBBIT's sequence-level multidimensional policy (a weighted mix of LRU, LFU, least
high-precision used and layer distance) nor its layer-level prefetch. ``low_bit`` defaults to
``q4_0``, llama.cpp's 4-bit block format (HOBBIT is built on llama.cpp and uses 4-bit or
2-bit low-precision experts). A prefill pass or a batched step (many tokens per expert, no
per-token gate weights) follows plain LRU. Runtime: ``llama.cpp`` (the paper's section 4: HOBBIT
is 8,000 lines of C/C++ on top of llama.cpp); the host work its expert scorer and loader add to
llama.cpp's loop is not modelled (docs/cost-model.md, "Runtime profiles").
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import Action, Plan, ResourceSpec, SetupContext, Slot, View
from daopsim.policies.lru import LRUPolicy
from daopsim.policies.options import Param
from daopsim.policies.registry import register
from daopsim.simulator.errors import UserError
from daopsim.simulator.precisions import DTYPES

TEMP: Final = Action.TEMP


@mypyc_attr(allow_interpreted_subclasses=True)
class HobbitPolicy(LRUPolicy):
    """Per-layer LRU; a less important miss loads a low-bit copy (or is skipped)."""

    name = "hobbit"
    summary = (
        "per-layer LRU; a miss whose higher-ranked gate mass share exceeds low_bit_threshold "
        "loads a low-bit copy through a temp buffer, above skip_threshold it is skipped"
    )
    source = "HOBBIT (arXiv 2411.01433), token-level dynamic expert loading"
    #: HOBBIT is built on llama.cpp (arXiv 2411.01433, abstract and section 4)
    runtime_profile = "llama.cpp"
    params = {
        **LRUPolicy.params,
        "low_bit": Param(
            str,
            "q4_0",
            "precision of the low-bit copies (a dtype name, fewer bytes than the host's)",
        ),
        "low_bit_threshold": Param(
            float,
            0.6,
            "a miss loads the low-bit copy when the gate mass share of higher-ranked experts "
            "exceeds this",
        ),
        "skip_threshold": Param(
            float, 0.9, "a miss is skipped when that share exceeds this (1: never skip)"
        ),
    }

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o = self.options
        if o["low_bit"] not in DTYPES:
            raise UserError(
                f"policy 'hobbit': option 'low_bit' must be a dtype name "
                f"({', '.join(sorted(DTYPES))}), got {o['low_bit']!r}"
            )
        low_t, skip_t = o["low_bit_threshold"], o["skip_threshold"]
        if not 0.0 <= low_t <= skip_t <= 1.0:
            raise UserError(
                "policy 'hobbit': options need 0 <= low_bit_threshold <= skip_threshold <= 1, "
                f"got {low_t} and {skip_t}"
            )
        self.low_t = float(low_t)
        self.skip_t = float(skip_t)

    def resources(self) -> ResourceSpec:
        """Pinned copies like ``lru``; the host also holds every expert at ``low_bit``."""
        return ResourceSpec(host_memory="pinned", low_bit_dtype=str(self.options["low_bit"]))

    def setup(self, ctx: SetupContext) -> list[Slot]:
        """``lru``'s placement, once the low-bit copy is known to be smaller than the host's."""
        low = str(self.options["low_bit"])
        if ctx.model.expert_bytes(low) >= ctx.model.host_expert_bytes():
            raise UserError(
                f"policy 'hobbit': low_bit={low} is not smaller than the host copy "
                f"({ctx.model.host_precision})"
            )
        return list(super().setup(ctx))

    def classify(
        self, experts: list[int], weights: list[float], resident: Any
    ) -> tuple[list[int], list[int]]:
        """The token's misses that load a low-bit copy, and those it skips (rank order);
        ``resident`` is the layer's residency row (a list or an array: ``resident[e]`` is true
        when expert e is resident)."""
        total = sum(weights)
        if total <= 0.0:
            return [], []
        low: list[int] = []
        skip: list[int] = []
        above = 0.0
        for e, w in zip(experts, weights, strict=False):
            share = above / total
            above += w
            if resident[e]:
                continue
            if share > self.skip_t:
                skip.append(e)
            elif share > self.low_t:
                low.append(e)
        return low, skip

    def decode_layer(self, view: View) -> Plan:
        """Full-precision service for hits and important misses; low-bit copies or skips for
        the others (see the module doc)."""
        experts: list[int] = view.experts.tolist()
        if view.counts is not None:  # prefill or a batched step: plain LRU
            return self.serve(view, experts)
        resident: list[bool] = view.resident[view.layer].tolist()
        low, skip = self.classify(experts, view.weights.tolist(), resident)
        if not low and not skip:
            return self.serve(view, experts)
        plan = self.serve(view, [e for e in experts if e not in low and e not in skip])
        actions = plan.actions
        assert actions is not None
        for e in low:
            actions[e] = TEMP
        if low:
            plan.low_bit = frozenset(low)
        if skip:
            plan.route = np.asarray([e for e in experts if e not in skip], dtype=np.int64)
            plan.raw_route = np.asarray(experts, dtype=np.int64)
        return plan


register(HobbitPolicy)
