"""LRU: per-layer least-recently-used expert cache, fetch on miss (Mixtral-offloading's core).

Source: Eliseev & Mazur, arXiv 2312.17238 (per-layer LRU "eviction groups"); see
docs/references.md#baselines. This plain version copies from pinned host memory
and does not write evicted experts back (the host keeps a copy); ``mixtral-offloading`` adds
its buffers, write-back and optional speculative prefetch.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

from policies.base import ALL_GPU_PLAN, Action, Plan, SetupContext
from policies.caching import CachingPolicy
from policies.registry import register

GPU, FETCH, TEMP = Action.GPU, Action.FETCH, Action.TEMP

# serve_token builds its Plan positionally (half the cost of a keyword): actions comes first
if dataclasses.fields(Plan)[0].name != "actions":  # pragma: no cover
    raise ImportError("policies.lru: Plan's first field is no longer 'actions'")


@register
class LRUPolicy(CachingPolicy):
    """Evict the expert of the layer used least recently."""

    name = "lru"
    summary = "per-layer LRU cache, fetch on miss"
    source = "Mixtral-offloading (arXiv 2312.17238), per-layer LRU"

    def init_state(self, ctx: SetupContext) -> None:
        """One recency order per layer (oldest first)."""
        self.order: list[OrderedDict[int, None]] = [
            OrderedDict() for _ in range(ctx.model.moe_layers)
        ]

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

    def serve_token(
        self, layer: int, experts: list[int], row: Any, shared_hit_plan: bool = False
    ) -> Plan:
        """:meth:`serve` for one decode token (no per-expert counts) with this class's hooks
        written out: the same plan and the same cache, recency and victim choices, in the same
        order (the decode path of ``hobbit`` and ``mixtral-offloading``, which do not override
        the hooks). ``row`` is the layer's residency row. ``shared_hit_plan``: when every
        expert is resident, return the shared ``ALL_GPU_PLAN`` (actions None, the same plan as
        one naming each expert GPU) instead of a new one; only for a caller that does not
        change the plan afterwards."""
        # why not serve(): its per-expert hook calls and candidate lists were a large part of
        # these policies' run time (docs/performance.md); the order's keys are the cache's
        # experts, so its first unprotected one is the victim choose_victim returns, and none
        # exists exactly when serve() finds no candidate
        order = self.order[layer]
        move = order.move_to_end
        actions: dict[int, Action] = {}
        misses = []
        for e in experts:
            if row[e]:
                actions[e] = GPU
                move(e)
            else:
                misses.append(e)
        if not misses:
            return ALL_GPU_PLAN if shared_hit_plan else Plan(actions)
        plan = Plan(actions)  # positional: cheaper than a keyword (actions is Plan's first field)
        extra = self.unevictable(layer)
        # the token's experts (a short list: membership as in a set, without building one)
        protected: Any = experts
        if extra:
            protected = set(experts)
            protected |= extra
        cache = self.cache[layer]
        capacity = self.quota[layer]
        victims = plan.victims
        for e in misses:
            if len(cache) < capacity:
                actions[e] = FETCH
            else:
                victim = -1
                for x in order:
                    if x not in protected:
                        victim = x
                        break
                if victim < 0 and self.evicts_in_use:
                    # swap out an expert this token already uses (computed before it leaves)
                    guard = extra or ()
                    for x in order:
                        if x not in guard:
                            victim = x
                            break
                if victim < 0:
                    actions[e] = TEMP  # the quota cannot hold all experts this token needs
                    continue
                cache.remove(victim)
                del order[victim]
                actions[e] = FETCH
                victims[e] = (layer, victim)
            cache.append(e)
            order[e] = None  # a new key goes last: the most recently used
        return plan
