"""Shared machinery for replacement-cache policies (LRU, LFU, round-robin, Belady, ...).

A caching policy keeps, per layer, a set of resident experts of fixed capacity (a per-layer
quota of the budget). On a miss it fetches the expert into a slot, evicting a victim that the
subclass picks with :meth:`CachingPolicy.choose_victim`; a victim is never one of the experts
the same token needs in that layer (so the k experts of a token are served together). A layer
whose quota is smaller than the experts it needs at once serves the overflow from a temporary
buffer. Subclasses implement ``choose_victim`` and, if they keep statistics, ``touch``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from policies.base import Action, Param, Plan, Policy, SetupContext, Slot, View, per_layer_quota
from simulator.errors import UserError

GPU, FETCH, TEMP = Action.GPU, Action.FETCH, Action.TEMP


class CachingPolicy(Policy):
    """Per-layer fetch-on-miss cache; subclasses choose victims."""

    params = {
        "initial": Param(
            str,
            "first",
            "initial contents: 'first' experts of each layer "
            "(data-blind) or 'popular' by calibration counts",
            choices=("first", "popular", "empty"),
        ),
    }

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        # the runner builds calibration counts only for a policy that asks for them
        self.needs_calibration = self.options.get("initial") == "popular"  # type: ignore[misc]

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """Fill each layer's quota with its first (or most popular) experts."""
        self.model = ctx.model
        self.evicts_in_use = self.resources().evicts_in_use
        n_layers, n_exp = ctx.model.moe_layers, ctx.model.experts
        self.quota = per_layer_quota(ctx.budget, n_layers)
        self.cache: list[list[int]] = [[] for _ in range(n_layers)]
        self.init_state(ctx)
        mode = self.options.get("initial", "first")
        if mode == "empty":
            return []
        if mode == "popular" and ctx.calibration is None:
            raise UserError(f"policy {self.name!r}: initial='popular' needs calibration counts")
        slots: list[Slot] = []
        for layer in range(n_layers):
            q = min(self.quota[layer], n_exp)
            if mode == "popular" and ctx.calibration is not None:
                order = np.lexsort((np.arange(n_exp), -ctx.calibration[layer]))[:q]
            else:
                order = np.arange(q)
            for e in order.tolist():
                self.cache[layer].append(int(e))
                self.inserted(layer, int(e), -1)
                slots.append((layer, int(e)))
        return slots

    def init_state(self, ctx: SetupContext) -> None:
        """Create per-policy statistics (called once by setup)."""

    def touch(self, layer: int, expert: int, step: int, weight: int) -> None:
        """A resident expert was used (``weight`` tokens)."""

    def inserted(self, layer: int, expert: int, step: int) -> None:
        """An expert entered the cache."""

    def removed(self, layer: int, expert: int) -> None:
        """An expert left the cache."""

    def choose_victim(self, layer: int, protected: set[int], step: int) -> int:
        """The resident expert of ``layer`` to evict (never one in ``protected``)."""
        raise NotImplementedError

    def unevictable(self, layer: int) -> set[int] | None:
        """Resident experts of ``layer`` that must not be evicted now (e.g. still in flight)."""
        return None

    def decode_layer(self, view: View) -> Plan:
        """Hits run on the GPU; misses are fetched (evicting a victim) or use a temp buffer."""
        layer = view.layer
        experts = view.experts.tolist()
        cache = self.cache[layer]
        step = view.step
        counts = view.counts
        resident = view.resident[layer]
        actions: dict[int, Action] = {}
        misses = []
        for e in experts:
            if resident[e]:
                actions[e] = GPU
                self.touch(layer, e, step, 1 if counts is None else int(counts[e]))
            else:
                misses.append(e)
        if not misses:
            return Plan(actions=actions)
        plan = Plan(actions=actions)
        protected = set(experts)
        extra = self.unevictable(layer)
        if extra:
            protected |= extra
        capacity = self.quota[layer]
        for e in misses:
            if len(cache) < capacity:
                actions[e] = FETCH
            else:
                candidates = [x for x in cache if x not in protected]
                guard = protected
                if not candidates and self.evicts_in_use and counts is None:
                    # swap out an expert this token already uses (computed before it leaves)
                    guard = set(extra) if extra else set()
                    candidates = [x for x in cache if x not in guard]
                if not candidates:
                    actions[e] = TEMP  # the quota cannot hold all experts this token needs
                    continue
                victim = self.choose_victim(layer, guard, step)
                cache.remove(victim)
                self.removed(layer, victim)
                actions[e] = FETCH
                plan.victims[e] = (layer, victim)
            cache.append(e)
            self.inserted(layer, e, step)
            self.touch(layer, e, step, 1 if counts is None else int(counts[e]))
        return plan
