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

import heapq

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import Plan, SetupContext, Slot, View
from daopsim.policies.caching import GlobalCachingPolicy
from daopsim.policies.lfu import LFUCounts
from daopsim.policies.registry import register


@mypyc_attr(allow_interpreted_subclasses=True)
class GlobalLFUPolicy(GlobalCachingPolicy):
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

    stats: LFUCounts
    heap: list[tuple[int, int, int, int]]

    def init_state(self, ctx: SetupContext) -> None:
        """The LFU statistics and the victim heap."""
        self.stats = LFUCounts(ctx.model.moe_layers, ctx.model.experts)
        self.heap = []

    def decode_layer(self, view: View) -> Plan:
        """Count this layer's accesses, then serve them as the cache base class does."""
        experts: list[int] = view.experts.tolist()
        self.stats.count(view.layer, experts, view.counts)
        return self.serve(view, experts)

    def _push(self, layer: int, expert: int) -> None:
        heap = self.heap
        stats = self.stats
        if len(heap) > 64 + 8 * self.capacity:  # mostly stale: rebuild from the live slots
            freq, last = stats.freq, stats.last
            mask = self.cached
            heap[:] = [
                (freq[lay][e], last[lay][e], lay, e)
                for lay, row in enumerate(mask.tolist())
                for e, on in enumerate(row)
                if on and (lay, e) != (layer, expert)
            ]
            heapq.heapify(heap)
        heapq.heappush(heap, (stats.freq[layer][expert], stats.last[layer][expert], layer, expert))

    def touch(self, layer: int, expert: int, step: int, weight: int) -> None:
        """Record recency; the slot's heap entry is renewed."""
        self.stats.stamp(layer, expert)
        self._push(layer, expert)

    def inserted(self, layer: int, expert: int, step: int) -> None:
        """A new entry is as recent as now."""
        self.stats.stamp(layer, expert)
        self._push(layer, expert)

    def choose_victim(self, layer: int, protected: set[int], step: int) -> Slot:
        """Fewest accesses over all layers; ties by least recent use (ticks are unique): the
        smallest live heap entry outside ``protected``."""
        heap = self.heap
        freq, last = self.stats.freq, self.stats.last
        kept = []  # live entries of protected slots, pushed back afterwards
        victim: Slot | None = None
        while heap:
            entry = heapq.heappop(heap)
            f, tick, lay, e = entry
            if not self.is_resident(lay, e) or last[lay][e] != tick or freq[lay][e] != f:
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


register(GlobalLFUPolicy)
