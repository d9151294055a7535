"""LFU: per-layer least-frequently-used expert cache, fetch on miss.

Source: the LFU baselines of the expert-caching literature (docs/references.md#baselines: an
LFU study, arXiv 2511.05814, reports LFU beating LRU on an A6000; kTransformers' cache was LFU
before HybriMoE's MRS; CECAR ships LRU/LFU baselines). Same cache model as ``lru`` (per-layer
quota, hits judged before insertions, a token's other experts never evicted).

Frequency: every access of a layer counts, hit or miss, resident or not (a prefill pass adds the
number of prompt tokens that chose the expert). Counts persist for the whole run: they survive
eviction and sequence boundaries (no decay, no reset).

Ties: among the unprotected residents with the lowest count, the least recently used goes
(recency = the step of the last access, then insertion order); this makes LFU degrade to LRU
when counts are equal instead of to an arbitrary id order.
"""

from __future__ import annotations

from policies.base import ALL_GPU_PLAN, Action, Plan, Policy, SetupContext, View
from policies.caching import CachingPolicy
from policies.registry import register


class LFUCounts(Policy):
    """The LFU statistics ``lfu`` and ``global-lfu`` share (listed before the cache base class).

    ``freq``: accesses per (layer, expert), counted in ``decode_layer`` before serving;
    ``last``: a tick of the last hit or insertion, for the least-recent tie-break. Both are
    per-layer lists of plain ints: they are read and written a few times per layer, where
    numpy's per-call cost would dominate.
    """

    def init_state(self, ctx: SetupContext) -> None:
        """Access counts and last-use ticks of every (layer, expert)."""
        n_layers, n_exp = ctx.model.moe_layers, ctx.model.experts
        self.freq: list[list[int]] = [[0] * n_exp for _ in range(n_layers)]
        self.last: list[list[int]] = [[-1] * n_exp for _ in range(n_layers)]
        self.tick = 0

    def decode_layer(self, view: View) -> Plan:
        """Count this layer's accesses, then serve them like the cache base class does."""
        freq = self.freq[view.layer]
        counts = view.counts
        if counts is None:
            for e in view.experts.tolist():
                freq[e] += 1
        else:
            for e in view.experts.tolist():
                freq[e] += int(counts[e])
        return super().decode_layer(view)

    def touch(self, layer: int, expert: int, step: int, weight: int) -> None:
        """Record recency for the tie-break (counting happens in decode_layer)."""
        self.tick += 1
        self.last[layer][expert] = self.tick

    def inserted(self, layer: int, expert: int, step: int) -> None:
        """A new entry is as recent as now."""
        self.tick += 1
        self.last[layer][expert] = self.tick


@register
class LFUPolicy(LFUCounts, CachingPolicy):
    """Evict the resident expert of the layer with the fewest accesses so far."""

    name = "lfu"
    summary = "per-layer LFU cache (persistent counts, LRU tie-break), fetch on miss"
    source = "LFU expert-cache baseline (LFU study arXiv 2511.05814; malmong/CECAR baselines)"

    def decode_layer(self, view: View) -> Plan:
        """Count, then serve like ``LFUCounts`` + ``CachingPolicy.serve``, fused into one loop.

        The same decisions, counts, ticks and victims as the base classes' methods called in
        turn (hits touched first, then each miss inserted and touched, the victim the first
        resident with the smallest (count, tick) outside the token's experts); only the
        per-call overhead is gone. A decode token whose experts all hit gets the shared
        all-on-the-GPU plan (the same plan for the engine). Prefill and batched views, and
        subclasses, take the base classes' methods.
        """
        if view.counts is not None or self.__class__ is not LFUPolicy:
            return super().decode_layer(view)
        layer = view.layer
        experts = view.experts.tolist()
        freq, last = self.freq[layer], self.last[layer]
        for e in experts:
            freq[e] += 1
        resident = view.resident[layer]
        tick = self.tick
        misses = []
        for e in experts:
            if resident[e]:
                tick += 1  # touch
                last[e] = tick
            else:
                misses.append(e)
        if not misses:
            self.tick = tick
            return ALL_GPU_PLAN
        gpu = Action.GPU
        actions = {e: gpu for e in experts if e not in misses}
        plan = Plan(actions=actions)
        cache = self.cache[layer]
        capacity = self.quota[layer]
        for e in misses:
            if len(cache) < capacity:
                actions[e] = Action.FETCH
            else:
                # choose_victim over the unprotected residents; with none, and in-use
                # evictions allowed, over every resident (serve's fallback, nothing guarded)
                best = -1
                fb = lb = 0
                for x in cache:
                    if x in experts:
                        continue
                    fx, lx = freq[x], last[x]
                    if best < 0 or fx < fb or (fx == fb and lx < lb):
                        best, fb, lb = x, fx, lx
                if best < 0 and self.evicts_in_use:
                    for x in cache:
                        fx, lx = freq[x], last[x]
                        if best < 0 or fx < fb or (fx == fb and lx < lb):
                            best, fb, lb = x, fx, lx
                if best < 0:
                    actions[e] = Action.TEMP  # the quota cannot hold all the token's experts
                    continue
                cache.remove(best)
                actions[e] = Action.FETCH
                plan.victims[e] = (layer, best)
            cache.append(e)
            tick += 2  # inserted, then touched: one tick each
            last[e] = tick
        self.tick = tick
        return plan

    def choose_victim(self, layer: int, protected: set[int], step: int) -> int:
        """Fewest accesses; ties by least recent use."""
        freq, last = self.freq[layer], self.last[layer]
        best = -1
        for e in self.cache[layer]:
            if e in protected:
                continue
            if best < 0 or (freq[e], last[e]) < (freq[best], last[best]):
                best = e
        if best < 0:
            raise AssertionError("caller guarantees an unprotected resident expert")
        return best
