"""belady-global: clairvoyant MIN over every (layer, expert) slot, the global caching bound.

Source: Belady's MIN (IBM Systems Journal 1966), applied to one cache over all layers' experts:
the bound for ``global-lru`` and ``global-lfu`` as ``belady`` is for the per-layer caches. Same
serving rule (fetch on miss, a token's other experts of this layer never evicted); the victim
is the resident slot whose next use lies farthest in the access order. Results are marked
``"bound": true``.

Access order: layer ``l`` of step ``s`` (a prefill pass or a decode token, ``View.step``) comes
after every layer of earlier steps and before layer ``l + 1`` of step ``s``, so a slot's next
use is the pair (step, layer) of its next access: the oracle's ``next_use(layer, expert, step)``
with the slot's own layer. Deciding at layer 3 of step 10, expert 5 of layer 7 used at step 10
is nearer than expert 5 of layer 1 used at step 11.

Ties: slots never used again come first, among them the lowest layer, then the lowest expert
id; two slots of one layer next used at the same step go to the lower expert id.

A slot's next use changes only when it is accessed, so it is computed on each hit and insertion
and kept in a heap (stale entries skipped), not recomputed for every resident slot per miss.
"""

from __future__ import annotations

import dataclasses
import heapq
from bisect import bisect_right
from typing import Any

from policies.base import ALL_GPU_PLAN, Action, Plan, SetupContext, Slot, View
from policies.caching import GlobalCachingPolicy, flat_bool_view
from policies.registry import register

# decode_layer builds its Plan positionally (cheaper than a keyword): actions comes first
if dataclasses.fields(Plan)[0].name != "actions":  # pragma: no cover
    raise ImportError("policies.belady_global: Plan's first field is no longer 'actions'")

#: heap key: (-next step, -its layer, layer, expert); never used again: -inf and layer 0
Key = tuple[float, int, int, int]


@register
class BeladyGlobalPolicy(GlobalCachingPolicy):
    """Evict the resident expert of any layer whose next use is farthest away (clairvoyant)."""

    name = "belady-global"
    summary = "clairvoyant MIN over all layers' experts (global caching bound)"
    source = "Belady's MIN (IBM Systems Journal 1966) over one cross-layer cache"
    clairvoyant = True

    def init_state(self, ctx: SetupContext) -> None:
        """Keep the oracle (only clairvoyant policies receive one) and an empty heap."""
        if ctx.oracle is None:
            raise AssertionError("belady-global is clairvoyant: the engine must pass the oracle")
        self.oracle: Any = ctx.oracle
        from simulator.runner import Oracle  # here: the runner imports the policies

        #: the run's per-slot access steps when the oracle is the runner's own (the decode
        #: loop reads them as ``Oracle.next_use`` does); None: ask the oracle
        self._steps = ctx.oracle.steps if type(ctx.oracle) is Oracle else None
        self.key: dict[Slot, Key] = {}
        self.heap: list[Key] = []
        # a plain-list mirror of ``self.cached`` for the decode loop (numpy's per-element
        # reads cost more than the rest of a layer's bookkeeping); inserted/removed keep it
        self._on: list[list[bool]] = [
            [False] * ctx.model.experts for _ in range(ctx.model.moe_layers)
        ]
        #: decode_layer's flat byte view of ``self.cached`` (made again if it is replaced)
        self._cached_bytes: Any = None
        self._cached_of: object = None

    def _renew(self, layer: int, expert: int, step: int) -> None:
        t = self.oracle.next_use(layer, expert, step)
        key = (-t, 0 if t == float("inf") else -layer, layer, expert)
        self.key[layer, expert] = key
        heapq.heappush(self.heap, key)
        if len(self.heap) > 4 * len(self.key) + 64:
            # drop the stale entries so the heap stays the size of the cache
            self.heap = list(self.key.values())
            heapq.heapify(self.heap)

    def touch(self, layer: int, expert: int, step: int, weight: int) -> None:
        """Accessed now: its next use moves on."""
        self._renew(layer, expert, step)

    def inserted(self, layer: int, expert: int, step: int) -> None:
        """A new slot's next use (from setup, step -1: its first use)."""
        self._on[layer][expert] = True
        self._renew(layer, expert, step)

    def removed(self, layer: int, expert: int) -> None:
        """Its heap entry becomes stale."""
        self._on[layer][expert] = False
        del self.key[layer, expert]

    def decode_layer(self, view: View) -> Plan:
        """``GlobalCachingPolicy.decode_layer`` with this class's hooks written out, for a
        decode token: the same hits, victims, heap pushes (one per touch and insertion, in
        the same order) and rebuilds; the residency read from the plain-list mirror. A token
        whose experts all hit gets the shared all-on-the-GPU plan (the same plan for the
        engine). Prefill and batched views, and subclasses, take the base class's method.
        """
        if (
            view.counts is not None
            or self._steps is None
            or self.__class__ is not BeladyGlobalPolicy
        ):
            return super().decode_layer(view)
        layer = view.layer
        experts = view.experts.tolist()
        step = view.step
        on = self._on[layer]
        steps = self._steps[layer]
        keys = self.key
        inf = float("inf")
        push = heapq.heappush
        misses = []
        heap = self.heap
        limit = 4 * len(keys) + 64  # a hit's slot has its key already: the size holds
        for e in experts:
            if on[e]:  # a hit: touch() -> _renew()
                lst = steps[e]
                i = bisect_right(lst, step)
                t = float(lst[i]) if i < len(lst) else inf
                key = (-t, 0 if t == inf else -layer, layer, e)
                keys[layer, e] = key
                push(heap, key)
                if len(heap) > limit:
                    heap = self.heap = list(keys.values())
                    heapq.heapify(heap)
            else:
                misses.append(e)
        if not misses:
            return ALL_GPU_PLAN
        gpu = Action.GPU
        actions = {e: gpu for e in experts if e not in misses}
        plan = Plan(actions)  # positional: actions is Plan's first field
        protected = set(experts)
        n_protected = len(protected)  # more resident slots than this: one is not protected
        # ``self.cached`` written through a flat byte view (the same 0/1 values as numpy's
        # scalar stores, at a fraction of their cost)
        cached = self.cached
        cm = self._cached_bytes
        if self._cached_of is not cached:
            self._cached_of = cached
            cm = self._cached_bytes = flat_bool_view(cached)
        n_exp = len(on)
        lo = layer * n_exp
        for e in misses:
            if self.size < self.capacity:
                self.size += 1
            elif self.size <= n_protected and self.size == sum(1 for x in protected if on[x]):
                actions[e] = Action.TEMP  # every resident slot holds an expert this token needs
                continue
            else:
                victim = self.choose_victim(layer, protected, step)
                cm[victim[0] * n_exp + victim[1]] = 0
                self.removed(*victim)
                plan.victims[e] = victim
            actions[e] = Action.FETCH
            cm[lo + e] = 1
            on[e] = True
            # inserted() then touch(): two _renew() calls, the same key pushed twice
            lst = steps[e]
            i = bisect_right(lst, step)
            t = float(lst[i]) if i < len(lst) else inf
            key = (-t, 0 if t == inf else -layer, layer, e)
            for _ in range(2):
                keys[layer, e] = key
                push(self.heap, key)
                if len(self.heap) > 4 * len(keys) + 64:
                    self.heap = list(keys.values())
                    heapq.heapify(self.heap)
        return plan

    def choose_victim(self, layer: int, protected: set[int], step: int) -> Slot:
        """Farthest next use over all layers (ties: see the module docstring)."""
        held: list[Key] = []
        victim: Slot | None = None
        while self.heap:
            key = heapq.heappop(self.heap)
            slot = (key[2], key[3])
            if self.key.get(slot) != key:
                continue  # stale: evicted, or accessed since
            if slot[0] == layer and slot[1] in protected:
                held.append(key)
                continue
            victim = slot  # its entry is dropped: removed() follows
            break
        for key in held:
            heapq.heappush(self.heap, key)
        if victim is None:
            raise AssertionError("caller guarantees an unprotected resident expert")
        return victim
