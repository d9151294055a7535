"""belady: clairvoyant MIN replacement per layer, the caching bound.

Source: Belady's MIN (evict the item whose next use lies farthest in the future), the bound the
expert-caching literature reports beside LRU (docs/references.md#baselines; "Cacheable by
Design?", arXiv 2608.18261: LRU 65.9 %, Belady 79.1 %; CECAR's Belady bounds). Same cache model as
``lru`` (per-layer quota, fetch on miss, a token's other experts never evicted), but the victim
is chosen with the oracle of future accesses: ``ctx.oracle.next_use(layer, expert, step)``.
Results are marked ``"bound": true``; no real runtime can do this.

Ties (several residents never used again, or used at the same future step) go to the lowest
expert id.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_right
from typing import Any

import numpy as np

from policies.base import ALL_GPU_PLAN, Action, Plan, SetupContext, View
from policies.caching import CachingPolicy
from policies.registry import register

GPU, FETCH, TEMP = Action.GPU, Action.FETCH, Action.TEMP
INF = float("inf")

# decode_layer builds its Plan positionally (cheaper than a keyword): actions comes first
if dataclasses.fields(Plan)[0].name != "actions":  # pragma: no cover
    raise ImportError("policies.belady: Plan's first field is no longer 'actions'")


@register
class BeladyPolicy(CachingPolicy):
    """Evict the resident expert whose next use is farthest away (clairvoyant)."""

    name = "belady"
    summary = "clairvoyant MIN replacement per layer (caching bound)"
    source = "Belady's MIN (IBM Systems Journal 1966); the bound caching studies report"
    clairvoyant = True

    def init_state(self, ctx: SetupContext) -> None:
        """Keep the oracle (only clairvoyant policies receive one)."""
        if ctx.oracle is None:
            raise AssertionError("belady is clairvoyant: the engine must pass the oracle")
        self.oracle: Any = ctx.oracle
        from simulator.runner import Oracle  # here: the runner imports the policies

        #: the run's per-slot access steps when the oracle is the runner's own (the decode
        #: loop reads them as ``Oracle.next_use`` does); None: ask the oracle
        self._steps = ctx.oracle.steps if type(ctx.oracle) is Oracle else None
        #: decode_layer's flat byte view of the residency mask it was handed last
        self._mask: object = None
        self._mask_bytes: memoryview | None = None

    def decode_layer(self, view: View) -> Plan:
        """``CachingPolicy.serve`` with this class's victim choice written out, for a decode
        token: the same hits (read from the residency mask), fetches, victims and temporary
        copies; the residency read through a flat byte view of the mask instead of numpy
        scalars, and the oracle's step lists read as ``Oracle.next_use`` does. A token whose
        experts all hit gets the shared all-on-the-GPU plan (the same plan for the engine).
        Prefill and batched views, other oracles and subclasses take the base class's method.
        """
        steps = self._steps
        if view.counts is not None or steps is None or self.__class__ is not BeladyPolicy:
            return super().decode_layer(view)
        resident = view.resident
        if resident is not self._mask:
            self._mask = resident
            self._mask_bytes = (
                memoryview(resident).cast("B")
                if resident.__class__ is np.ndarray
                and resident.dtype == np.bool_
                and resident.ndim == 2
                and resident.flags.c_contiguous
                else None
            )
        mb = self._mask_bytes
        if mb is None:
            return super().decode_layer(view)
        layer = view.layer
        experts = view.experts.tolist()
        lo = layer * resident.shape[1]
        misses = None
        for e in experts:
            if not mb[lo + e]:
                if misses is None:
                    misses = [e]
                else:
                    misses.append(e)
        if misses is None:
            return ALL_GPU_PLAN
        actions = {e: GPU for e in experts if e not in misses}
        plan = Plan(actions)  # positional: actions is Plan's first field
        cache = self.cache[layer]
        capacity = self.quota[layer]
        step = view.step
        lsteps = steps[layer]
        for e in misses:
            if len(cache) < capacity:
                actions[e] = FETCH
            else:
                guard: Any = experts
                for x in cache:
                    if x not in experts:
                        break
                else:  # no unprotected resident
                    if not self.evicts_in_use:
                        actions[e] = TEMP  # the quota cannot hold all the token's experts
                        continue
                    guard = ()  # swap out an expert this token already uses
                    if not cache:
                        actions[e] = TEMP
                        continue
                # choose_victim: the farthest next use, ties to the lowest expert id
                best, best_t = -1, -1.0
                for x in sorted(cache):
                    if x in guard:
                        continue
                    lst = lsteps[x]
                    i = bisect_right(lst, step)
                    t = lst[i] if i < len(lst) else INF
                    if t > best_t:
                        best, best_t = x, t
                cache.remove(best)
                actions[e] = FETCH
                plan.victims[e] = (layer, best)
            cache.append(e)
        return plan

    def choose_victim(self, layer: int, protected: set[int], step: int) -> int:
        """Farthest next use after this step; ties by lowest expert id."""
        best, best_t = -1, -1.0
        for e in sorted(self.cache[layer]):
            if e in protected:
                continue
            t = self.oracle.next_use(layer, e, step)
            if t > best_t:
                best, best_t = e, t
        if best < 0:
            raise AssertionError("caller guarantees an unprotected resident expert")
        return best
