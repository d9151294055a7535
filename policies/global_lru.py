"""global-lru: one least-recently-used cache over every (layer, expert) slot, fetch on miss.

Source: a generic policy, the cross-layer counterpart of ``lru``: the expert-offloading
runtimes with an LRU expert cache keep one per layer (Mixtral-offloading's "eviction groups",
docs/references.md#baselines), so this asks what dropping the per-layer quota buys. Same
serving rule as ``lru`` (hits judged before the layer's insertions, a token's other experts of
the layer never evicted, pinned copies, no write-back); the victim is the least recently used
resident expert of ANY layer. Recency is one order over all slots: a hit or an insertion makes
a slot the most recent; the initial contents start in placement order (layer by layer).
"""

from __future__ import annotations

from collections import OrderedDict

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import SetupContext, Slot
from daopsim.policies.caching import GlobalCachingPolicy
from daopsim.policies.registry import register


@mypyc_attr(allow_interpreted_subclasses=True)
class GlobalLRUPolicy(GlobalCachingPolicy):
    """Evict the least recently used resident expert of any layer."""

    name = "global-lru"
    summary = "one LRU cache over all layers' experts (no per-layer quota), fetch on miss"
    source = "generic cross-layer LRU (the per-layer lru without its quota)"

    def init_state(self, ctx: SetupContext) -> None:
        """One recency order over all slots (oldest first)."""
        self.order: OrderedDict[Slot, None] = OrderedDict()

    def touch(self, layer: int, expert: int, step: int, weight: int) -> None:
        """Most recently used moves to the end."""
        self.order.move_to_end((layer, expert))

    def inserted(self, layer: int, expert: int, step: int) -> None:
        """New entries start most recent."""
        self.order[layer, expert] = None

    def removed(self, layer: int, expert: int) -> None:
        """Forget an evicted slot."""
        del self.order[layer, expert]

    def choose_victim(self, layer: int, protected: set[int], step: int) -> Slot:
        """Oldest slot that is not one of this token's experts in this layer."""
        for slot in self.order:
            if slot[0] != layer or slot[1] not in protected:
                return slot
        raise AssertionError("caller guarantees an unprotected resident expert")


register(GlobalLRUPolicy)
