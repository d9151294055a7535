"""LRU: per-layer least-recently-used expert cache, fetch on miss (Mixtral-offloading's core).

Source: Eliseev & Mazur, arXiv 2312.17238 (per-layer LRU "eviction groups"); see
docs/references.md#baselines. This plain version copies from pinned host memory
and does not write evicted experts back (the host keeps a copy); ``mixtral-offloading`` adds
its buffers, write-back and optional speculative prefetch.
"""

from __future__ import annotations

from collections import OrderedDict

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import SetupContext
from daopsim.policies.caching import CachingPolicy
from daopsim.policies.registry import register


@mypyc_attr(allow_interpreted_subclasses=True)
class LRUPolicy(CachingPolicy):
    """Evict the expert of the layer used least recently."""

    name = "lru"
    summary = "per-layer LRU cache, fetch on miss"
    source = "Mixtral-offloading (arXiv 2312.17238), per-layer LRU"

    #: per layer, its cached experts from least to most recently used
    order: list[OrderedDict[int, None]]

    def init_state(self, ctx: SetupContext) -> None:
        """One recency order per layer (oldest first)."""
        self.order = [OrderedDict() for _ in range(ctx.model.moe_layers)]

    def touch(self, layer: int, expert: int, step: int, weight: int) -> None:
        """Most recently used moves to the end."""
        self.order[layer].move_to_end(expert)

    def inserted(self, layer: int, expert: int, step: int) -> None:
        """New entries start most recent."""
        self.order[layer][expert] = None

    def removed(self, layer: int, expert: int) -> None:
        """Forget an evicted expert."""
        del self.order[layer][expert]

    def choose_victim(self, layer: int, protected: set[int], step: int) -> int:
        """Oldest expert not needed by this token."""
        for e in self.order[layer]:
            if e not in protected:
                return e
        raise AssertionError("caller guarantees an unprotected resident expert")


register(LRUPolicy)
