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

import numpy as np

from policies.base import Slot
from policies.caching import GlobalCachingPolicy
from policies.lfu import LFUCounts
from policies.registry import register

_NEVER = np.iinfo(np.int64).max


@register
class GlobalLFUPolicy(LFUCounts, GlobalCachingPolicy):
    """Evict the resident expert of any layer with the fewest accesses so far."""

    name = "global-lfu"
    summary = "one LFU cache over all layers' experts (persistent counts, LRU tie-break)"
    source = "generic cross-layer LFU (the per-layer lfu without its quota)"

    def choose_victim(self, layer: int, protected: set[int], step: int) -> Slot:
        """Fewest accesses over all layers; ties by least recent use (ticks are unique)."""
        cand = self.cached.copy()
        cand[layer, list(protected)] = False
        freq = np.where(cand, self.freq, _NEVER)
        lowest = cand & (freq == freq.min())
        flat = int(np.argmin(np.where(lowest, self.last, _NEVER)))
        victim = divmod(flat, self.cached.shape[1])
        if not cand[victim]:
            raise AssertionError("caller guarantees an unprotected resident expert")
        return victim
