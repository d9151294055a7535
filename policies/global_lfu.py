"""global-lfu: one least-frequently-used cache over every (layer, expert) slot, fetch on miss.

Source: a generic policy, the cross-layer counterpart of ``lfu`` (the LFU expert-cache
baselines in docs/references.md#baselines keep per-layer caches). Same counting and tie rules as
``lfu``: every access of a layer counts, hit or miss (a prefill pass adds the number of prompt
tokens that chose the expert); counts persist for the whole run (through eviction and sequence
boundaries); ties go to the least recently used (one recency tick over all slots). The victim is
the resident expert of ANY layer with the fewest accesses, never one the same token needs in
this layer. Counts of different layers are comparable because every layer routes the same
tokens to the same number of experts.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

from policies.base import ALL_GPU_PLAN, Plan, SetupContext, Slot, View
from policies.caching import FETCH, GPU, TEMP, GlobalCachingPolicy, flat_bool_view
from policies.lfu import LFUCounts
from policies.registry import register

# decode_layer builds its Plan positionally (cheaper than a keyword): actions comes first
if dataclasses.fields(Plan)[0].name != "actions":  # pragma: no cover
    raise ImportError("policies.global_lfu: Plan's first field is no longer 'actions'")


@register
class GlobalLFUPolicy(LFUCounts, GlobalCachingPolicy):
    """Evict the resident expert of any layer with the fewest accesses so far.

    The victim search keeps a heap of ``(count, tick, layer, expert)`` entries, one pushed
    whenever a cached slot is touched or inserted (both give it a new, unique tick); an entry
    whose slot has left the cache or got a newer tick since is stale and dropped when it
    surfaces. The smallest live entry is the unprotected cached slot with the fewest accesses,
    ties to the least recently used (ticks are unique), as a scan of every slot would give.
    """

    name = "global-lfu"
    summary = "one LFU cache over all layers' experts (persistent counts, LRU tie-break)"
    source = "generic cross-layer LFU (the per-layer lfu without its quota)"

    def init_state(self, ctx: SetupContext) -> None:
        """The LFU statistics and the victim heap."""
        super().init_state(ctx)
        self.heap: list[tuple[int, int, int, int]] = []
        # a plain-list mirror of ``self.cached`` for the per-layer loops (numpy's per-element
        # reads cost more than the rest of a layer's bookkeeping); set() fills it
        self._on: list[list[bool]] = [[False] * ctx.model.experts for _ in self.freq]
        #: decode_layer's flat byte view of ``self.cached`` (made again if it is replaced)
        self._cached_bytes: Any = None
        self._cached_of: object = None

    def setup(self, ctx: SetupContext) -> list[Slot]:
        """Place the initial contents as the base class does; mirror them in plain lists."""
        slots = list(super().setup(ctx))
        for layer, e in slots:
            self._on[layer][e] = True
        return slots

    def _push(self, layer: int, expert: int) -> None:
        heap = self.heap
        if len(heap) > 64 + 8 * self.capacity:  # mostly stale: rebuild from the live slots
            freq, last, cached = self.freq, self.last, self.cached
            heap[:] = [
                (freq[lay][e], last[lay][e], lay, e)
                for lay, row in enumerate(cached.tolist())
                for e, on in enumerate(row)
                if on and (lay, e) != (layer, expert)
            ]
            heapq.heapify(heap)
        heapq.heappush(heap, (self.freq[layer][expert], self.last[layer][expert], layer, expert))

    def touch(self, layer: int, expert: int, step: int, weight: int) -> None:
        """Record recency; the slot's heap entry is renewed."""
        super().touch(layer, expert, step, weight)
        self._push(layer, expert)

    def inserted(self, layer: int, expert: int, step: int) -> None:
        """A new entry is as recent as now."""
        super().inserted(layer, expert, step)
        self._on[layer][expert] = True
        self._push(layer, expert)

    def removed(self, layer: int, expert: int) -> None:
        """Keep the plain-list mirror in step with ``self.cached``."""
        super().removed(layer, expert)
        self._on[layer][expert] = False

    def decode_layer(self, view: View) -> Plan:
        """Count, then serve like ``LFUCounts`` + ``GlobalCachingPolicy``, fused into one loop.

        The same decisions, counts, ticks and victims as the two base classes' methods called
        in turn (hits touched first, then each miss inserted and touched, a victim chosen from
        the heap); only the per-call overhead is gone. The heap entry the base ``inserted``
        pushes just before ``touch`` pushes a newer one is skipped: it is stale at once, and
        stale entries never change which live entry is smallest.
        """
        layer = view.layer
        experts = view.experts.tolist()
        counts = view.counts
        freq, last, on = self.freq[layer], self.last[layer], self._on[layer]
        heap = self.heap
        limit = 64 + 8 * self.capacity
        push = heapq.heappush
        if counts is None:
            for e in experts:
                freq[e] += 1
        else:
            for e in experts:
                freq[e] += int(counts[e])
        actions: dict = {}
        misses = []
        tick = self.tick
        for e in experts:
            if on[e]:
                actions[e] = GPU
                tick += 1
                last[e] = tick
                if len(heap) > limit:
                    self.tick = tick
                    self._push(layer, e)
                else:
                    push(heap, (freq[e], tick, layer, e))
            else:
                misses.append(e)
        self.tick = tick
        if not misses:
            # a decode token whose experts all hit: the shared all-on-the-GPU plan (the same
            # plan for the engine)
            return ALL_GPU_PLAN if counts is None else Plan(actions=actions)
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
                actions[e] = TEMP  # every resident slot holds an expert this token needs
                continue
            else:
                victim = self._victim(layer, protected)
                vl, ve = victim
                cm[vl * n_exp + ve] = 0
                self._on[vl][ve] = False
                plan.victims[e] = victim
            actions[e] = FETCH
            cm[lo + e] = 1
            on[e] = True
            tick = self.tick + 2  # inserted, then touched: one tick each
            self.tick = tick
            last[e] = tick
            if len(heap) > limit:
                self._push(layer, e)
            else:
                push(heap, (freq[e], tick, layer, e))
        return plan

    def _victim(self, layer: int, protected: set[int]) -> Slot:
        """The smallest live heap entry outside ``protected``, read on the plain-list mirror."""
        heap, freq, last, on = self.heap, self.freq, self.last, self._on
        pop = heapq.heappop
        kept = []  # live entries of protected slots, pushed back afterwards
        victim = None
        while heap:
            entry = pop(heap)
            f, tick, lay, e = entry
            if not on[lay][e] or last[lay][e] != tick or freq[lay][e] != f:
                continue  # stale
            if lay == layer and e in protected:
                kept.append(entry)
                continue
            victim = (lay, e)
            break
        for entry in kept:
            heapq.heappush(heap, entry)
        if victim is None:
            raise AssertionError("caller guarantees an unprotected resident expert")
        return victim

    def choose_victim(self, layer: int, protected: set[int], step: int) -> Slot:
        """Fewest accesses over all layers; ties by least recent use (ticks are unique)."""
        return self._victim(layer, protected)
