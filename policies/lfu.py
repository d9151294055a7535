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

import numpy as np

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import Plan, SetupContext, View
from daopsim.policies.caching import CachingPolicy
from daopsim.policies.registry import register


class LFUCounts:
    """The LFU statistics ``lfu`` and ``global-lfu`` share.

    ``freq``: accesses per (layer, expert), counted by :meth:`count` before a layer is served;
    ``last``: a tick of the last hit or insertion (:meth:`stamp`), for the least-recent
    tie-break. Both are per-layer lists of plain ints: they are read and written a few times
    per layer, where numpy's per-call cost would dominate.
    """

    def __init__(self, n_layers: int, n_experts: int) -> None:
        self.freq: list[list[int]] = [[0] * n_experts for _ in range(n_layers)]
        self.last: list[list[int]] = [[-1] * n_experts for _ in range(n_layers)]
        self.tick = 0

    def count(self, layer: int, experts: list[int], counts: np.ndarray | None) -> None:
        """Count a layer's accesses: one per routed expert, or (``counts``, a prefill pass or
        a batched step) the tokens that chose it."""
        freq = self.freq[layer]
        if counts is None:
            for e in experts:
                freq[e] += 1
        else:
            for e in experts:
                freq[e] += int(counts[e])

    def stamp(self, layer: int, expert: int) -> None:
        """A hit or an insertion: the slot becomes the most recent (a new, unique tick)."""
        self.tick += 1
        self.last[layer][expert] = self.tick


@mypyc_attr(allow_interpreted_subclasses=True)
class LFUPolicy(CachingPolicy):
    """Evict the resident expert of the layer with the fewest accesses so far."""

    name = "lfu"
    summary = "per-layer LFU cache (persistent counts, LRU tie-break), fetch on miss"
    source = "LFU expert-cache baseline (LFU study arXiv 2511.05814; malmong/CECAR baselines)"

    stats: LFUCounts

    def init_state(self, ctx: SetupContext) -> None:
        """Access counts and last-use ticks of every (layer, expert)."""
        self.stats = LFUCounts(ctx.model.moe_layers, ctx.model.experts)

    def decode_layer(self, view: View) -> Plan:
        """Count this layer's accesses, then serve them as the cache base class does."""
        experts: list[int] = view.experts.tolist()
        self.stats.count(view.layer, experts, view.counts)
        return self.serve(view, experts)

    def touch(self, layer: int, expert: int, step: int, weight: int) -> None:
        """Record recency for the tie-break (counting happens in decode_layer)."""
        self.stats.stamp(layer, expert)

    def inserted(self, layer: int, expert: int, step: int) -> None:
        """A new entry is as recent as now."""
        self.stats.stamp(layer, expert)

    def choose_victim(self, layer: int, protected: set[int], step: int) -> int:
        """Fewest accesses; ties by least recent use."""
        freq, last = self.stats.freq[layer], self.stats.last[layer]
        best = -1
        for e in self.residents(layer):
            if e in protected:
                continue
            if best < 0 or (freq[e], last[e]) < (freq[best], last[best]):
                best = e
        if best < 0:
            raise AssertionError("caller guarantees an unprotected resident expert")
        return best


register(LFUPolicy)
