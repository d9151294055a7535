"""slicemoe: SliceMoE's bit-sliced expert cache: experts held at full precision or as their
high-order slice alone, the precision chosen when an expert is loaded.

Source: Choi, Kim, Oh, Park, Kim, Yoo, "SliceMoE: Bit-Sliced Expert Caching under Miss-Rate
Constraints for Efficient MoE Inference" (arXiv 2512.12990, DAC 2026); facts in
docs/references.md#slicemoe. Read: the abstract and public summaries; the paper's body, its
rules and constants were not reachable, and no code is public. What the abstract states:
Dynamic Bit-Sliced Caching (DBSC) "caches experts at slice-level granularity and assigns
precision on demand to expand effective expert capacity"; Calibration-Free Asymmetric Matryoshka
Quantization (AMAT) makes the low-bit expert a truncation (the high-order bits) of the high-bit
one, so a low-bit slice needs no second copy; Predictive Cache Warmup (PCW) "reshapes cache
contents during prefill" to cut early-decode cold misses; a public note adds that the cache is
one cache across layers.

How it is modelled (``ResourceSpec.low_bit_slots``, docs/policy-api.md):

- An expert at the run's GPU precision (the high-bit expert, ``B`` bytes) is its high-order
  slice, the ``low_bit`` precision (default ``int4``, ``B_low`` bytes), plus the rest. The run
  gives the engine ``floor(budget x B / B_low)`` slots of ``B_low`` bytes in the memory of
  ``budget`` full experts. A resident expert holds one slot; one resident at full precision
  also takes ``ceil(B / B_low) - 1`` more, which this policy keeps free (the engine counts
  slots, not bytes: ``tests/test_policies_2025.py`` checks it never holds more than the
  memory). A slot's copy moves ``B_low`` bytes (``Plan.low_bit`` on a ``FETCH``); a full
  expert's copy moves ``B``. A slice-only expert runs in low precision: its gate weight counts
  in ``low_precision_gate_mass``, and its GPU time is the full expert's (the cost model has one
  GPU time per precision, HOBBIT's precedent).
- One cache over every layer's experts, least recently used first (the victim rule is ours;
  the paper's was not read); a token's experts of the layer are never evicted.
- Precision on demand: a missed expert whose share of the token's top-k gate mass is at least
  ``high_share`` (default ``1/k``: an above-average weight; ours) is loaded at full
  precision, the others as their high-order slice; when the room for a full expert cannot be
  freed, its slice is loaded, and when not even that, it is copied at full precision into a
  temporary buffer.
- Not modelled: completing a slice-only expert to full precision in place (the engine has no
  copy into part of a resident expert; such an expert runs in low precision until evicted), the
  paper's miss-rate constraint (how it sets the precision split), and AMAT's accuracy.
- ``warmup`` (PCW, default on): a prompt's missed experts are loaded into the cache by the
  same rule, with the share of the prompt's tokens routed to it as its importance, so decoding
  starts from a cache shaped by the prompt; off: a prompt's misses go through a temporary
  buffer at full precision and leave the cache as it was. Batched steps take the prompt rule.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Final

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import Action, Plan, Policy, ResourceSpec, SetupContext, Slot, View
from daopsim.policies.options import Param
from daopsim.policies.placement import low_bit_slots_per_expert
from daopsim.policies.registry import register
from daopsim.simulator.errors import UserError
from daopsim.simulator.precisions import DTYPES

GPU: Final = Action.GPU
FETCH: Final = Action.FETCH
TEMP: Final = Action.TEMP


@mypyc_attr(allow_interpreted_subclasses=True)
class SliceMoEPolicy(Policy):
    """One cache of bit slices over all layers; full or high-order-slice loads on demand."""

    name = "slicemoe"
    summary = (
        "SliceMoE: one cache over all layers holding experts at full precision or as their "
        "high-order bit slice (low_bit), the precision chosen per miss by gate weight"
    )
    source = "SliceMoE (arXiv 2512.12990), dynamic bit-sliced caching"
    params = {
        "low_bit": Param(str, "int4", "precision of the high-order slice (a dtype name)"),
        "high_share": Param(
            float,
            0.0,
            "a miss with at least this share of the token's top-k gate mass (a prompt: of its "
            "tokens) loads at full precision (0: 1/k)",
            minimum=0,
            maximum=1,
        ),
        "warmup": Param(bool, True, "a prompt's misses shape the cache (PCW)"),
    }

    #: resident (layer, expert) -> True when held at full precision, oldest use first
    entries: OrderedDict[Slot, bool]

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o = self.options
        if o["low_bit"] not in DTYPES:
            raise UserError(
                f"policy {self.name!r}: option 'low_bit' must be a dtype name "
                f"({', '.join(sorted(DTYPES))}), got {o['low_bit']!r}"
            )
        self.low = str(o["low_bit"])
        self.share_opt = float(o["high_share"])
        self.warmup = bool(o["warmup"])
        self.units = 0
        self.full_units = 1
        self.used = 0
        self.share = 0.0
        self.entries = OrderedDict()

    def resources(self) -> ResourceSpec:
        """Pinned copies, slots of the slice's size, one buffer for the full-precision
        copies that find no room."""
        return ResourceSpec(
            host_memory="pinned", low_bit_dtype=self.low, low_bit_slots=True, temp_buffers=1
        )

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """An empty cache of ``ctx.budget`` slice slots."""
        full = ctx.costs.expert_bytes
        low = ctx.costs.low_bit_expert_bytes(self.low)
        if low >= full:
            raise UserError(
                f"policy {self.name!r}: low_bit={self.low} is not smaller than the GPU "
                f"precision ({ctx.model.dtype})"
            )
        self.units = int(ctx.budget)
        self.full_units = math.ceil(low_bit_slots_per_expert(full, low))
        self.used = 0
        self.share = self.share_opt or 1.0 / ctx.model.top_k
        self.entries = OrderedDict()
        return []

    # -- the cache -----------------------------------------------------------------------------
    def size_of(self, full: bool) -> int:
        """Slots an entry takes."""
        return self.full_units if full else 1

    def make_room(self, need: int, layer: int, protected: set[int], evict: list[Slot]) -> bool:
        """Free ``need`` slots by evicting least recently used entries outside ``protected``
        (this token's experts of ``layer``); the victims go to ``evict``. False, evicting
        nothing, when that many cannot be freed."""
        free = self.units - self.used
        if free >= need:
            return True
        victims: list[Slot] = []
        for slot, full in self.entries.items():
            if slot[0] == layer and slot[1] in protected:
                continue
            victims.append(slot)
            free += self.size_of(full)
            if free >= need:
                break
        if free < need:
            return False
        for slot in victims:
            self.used -= self.size_of(self.entries.pop(slot))
            evict.append(slot)
        return True

    def serve(self, view: View, experts: list[int], importance: list[float], cache: bool) -> Plan:
        """Hits on the GPU (a slice-only one in low precision); each miss at full precision
        when its ``importance`` reaches ``high_share``, else as its slice; ``cache=False``
        sends misses through a temporary buffer at full precision instead."""
        layer = view.layer
        resident: list[bool] = view.resident[layer].tolist()
        actions: dict[int, Action] = {}
        low: set[int] = set()
        plan = Plan(actions=actions)
        misses: list[tuple[int, float]] = []
        for e, imp in zip(experts, importance, strict=True):
            if resident[e]:
                actions[e] = GPU
                slot = (layer, e)
                if not self.entries[slot]:
                    low.add(e)
                self.entries.move_to_end(slot)
            else:
                misses.append((e, imp))
        protected = set(experts)
        for e, imp in misses:
            if not cache:
                actions[e] = TEMP
                continue
            full = imp >= self.share
            if full and not self.make_room(self.full_units, layer, protected, plan.evict):
                full = False
            if not full and not self.make_room(1, layer, protected, plan.evict):
                actions[e] = TEMP
                continue
            actions[e] = FETCH
            if not full:
                low.add(e)
            self.entries[(layer, e)] = full
            self.used += self.size_of(full)
        if low:
            plan.low_bit = frozenset(low)
        return plan

    # -- hooks -----------------------------------------------------------------------------------
    def decode_layer(self, view: View) -> Plan:
        """Importance = each expert's share of the token's top-k gate mass."""
        if view.counts is not None:
            return self.prefill_layer(view)
        experts: list[int] = view.experts.tolist()
        weights: list[float] = view.weights.tolist()
        total = sum(weights)
        if total > 0.0:
            imp = [w / total for w in weights]
        else:
            imp = [1.0 / len(experts)] * len(experts)
        return self.serve(view, experts, imp, True)

    def prefill_layer(self, view: View) -> Plan:
        """Importance = the share of the prompt's (or batch's) tokens routed to the expert;
        misses cached only with ``warmup``."""
        experts: list[int] = view.experts.tolist()
        counts = view.counts
        assert counts is not None
        tokens = max(1, int(view.n_tokens))
        imp = [float(counts[e]) / tokens for e in experts]
        return self.serve(view, experts, imp, self.warmup)


register(SliceMoEPolicy)
