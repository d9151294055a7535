"""least-stale: SpecMD's Least-Stale eviction over one cache of every layer's experts.

Source: Hoang, Jaiswal, Samragh, Cho, "SpecMD: A Comprehensive Study On Speculative Expert
Prefetching" (Apple, arXiv 2602.03921, ICML 2026); facts in docs/references.md#specmd. What
could be read of the paper is its abstract and the opening of its introduction: MoE expert
access "is not consistent with temporal locality assumptions (e.g. LRU, LFU)", and Least-Stale
"exploits MoE's predictable expert access patterns to reduce collision misses by up to 85x
over LRU", reaching over 88 % hit rates with up to 34.7 % lower time to first token on OLMoE
with a cache of 5 % of the experts (0.6 GB). The section that defines the policy was not
reachable; the rule below is our reading of those sentences and of two public
re-implementations' descriptions (both: experts a forward pass has already gone past are
evicted before the ones still ahead of it, least recently used first within each group). It
is not checked against the paper's own code, which is not public.

The predictable pattern is the forward pass itself: layers run 0, 1, ..., L-1 for every token,
so when layer ``l`` of a pass decides, a resident expert of a layer ``j <= l`` cannot be used
again before the next pass reaches ``j`` (it is *stale* for this pass), while one of a layer
``j > l`` may still be used in this pass (it is *fresh*). On a cache shared by all layers, LRU
evicts the oldest slot, which in a loop over layers is an expert of the layer about to run
(docs/policies.md, "Per-layer and global caches"); Least-Stale evicts a stale one first.

- One cache over every ``(layer, expert)`` slot (``GlobalCachingPolicy``: hits judged before the
  layer's insertions, a token's experts of the layer never evicted, pinned copies, no
  write-back).
- Victim: among the stale residents (layer at or before the deciding one), the least recently
  used; only when every candidate is fresh, the least recently used fresh one
  (``stale_first=false``: plain LRU over all slots, the ablation of the rule).
- ``prefetch`` (default off): SpecMD's subject is speculative prefetching; with it on, at each
  decode layer the one-layer-early view's top ``prefetch_k`` experts of layer ``l+1`` that are
  not resident are copied in, each evicting the Least-Stale victim among the slots that are
  not in that view and whose copy has landed (``View.ready``: what a runtime knows from its
  copies' events; at most ``capacity - 2k`` slots are ever pending, so a demand miss always
  finds a victim).
  The one-layer-early view is layer ``l+1``'s router applied to layer ``l``'s router input;
  SpecMD's own predictors are not reproduced.

Runtime: ``ideal`` (a cache algorithm measured alone, like ``global-lru``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import Plan, SetupContext, Slot, View
from daopsim.policies.caching import PendingCopies
from daopsim.policies.global_lru import GlobalLRUPolicy
from daopsim.policies.options import Param
from daopsim.policies.registry import register


@mypyc_attr(allow_interpreted_subclasses=True)
class LeastStalePolicy(GlobalLRUPolicy):
    """One cache over all layers; evict an expert the forward pass has already gone past
    (global-lru's recency order, its own victim rule)."""

    name = "least-stale"
    summary = (
        "one cache over all layers; evicts the least recently used expert of a layer the "
        "forward pass has passed (SpecMD's Least-Stale), optional layer-early prefetch"
    )
    source = "SpecMD (arXiv 2602.03921), Least-Stale eviction"
    params = {
        **GlobalLRUPolicy.params,
        "stale_first": Param(
            bool,
            True,
            "evict experts of layers the pass has gone past first (false: plain LRU, the ablation)",
        ),
        "prefetch": Param(bool, False, "speculatively load layer l+1's experts at layer l"),
        "prefetch_k": Param(
            int,
            0,
            "experts of the one-layer-early view to prefetch (0: the model's top-k)",
            minimum=0,
        ),
    }

    #: the prefetched slots whose copy is still in flight
    copies: PendingCopies
    #: slots a prefetch's victim must not be (the deciding layer's routed experts)
    hold: set[Slot]

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.stale_first = bool(self.options["stale_first"])
        self.do_prefetch = bool(self.options["prefetch"])
        self.k_opt = int(self.options["prefetch_k"])
        self.k_pre = 0
        self.copies = PendingCopies()
        self.hold = set()

    def uses_lookahead(self) -> bool:
        """Only the optional prefetch reads the one-layer-early view."""
        return self.do_prefetch

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """The shared cache's initial contents (``initial``), recency in placement order."""
        self.k_pre = self.k_opt or ctx.model.top_k
        self.copies = PendingCopies()
        return super().setup(ctx)

    def removed(self, layer: int, expert: int) -> None:
        """Forget an evicted slot, and its prefetch."""
        super().removed(layer, expert)
        self.copies.forget((layer, expert))

    def choose_victim(self, layer: int, protected: set[int], step: int) -> Slot:
        """The least recently used stale slot (its layer at or before ``layer``), else the least
        recently used fresh one; never this token's experts of ``layer``, a copy in flight or
        (for a prefetch) the deciding layer's routed experts."""
        pending = self.copies.pending
        hold = self.hold
        fresh: Slot | None = None
        for slot in self.order:
            sl = slot[0]
            if sl == layer and slot[1] in protected:
                continue
            if (pending and slot in pending) or (hold and slot in hold):
                continue
            if sl <= layer or not self.stale_first:
                return slot
            if fresh is None:
                fresh = slot
        if fresh is not None:
            return fresh
        # only pending copies remain: the oldest (the cap on pending slots keeps this rare)
        for slot in self.order:
            if slot[0] != layer or slot[1] not in protected:
                return slot
        raise AssertionError("caller guarantees an unprotected resident expert")

    def decode_layer(self, view: View) -> Plan:
        """The shared cache's service, then (optionally) the prefetch for layer+1."""
        if not self.do_prefetch:
            return self.serve(view, view.experts.tolist())
        experts: list[int] = view.experts.tolist()
        self.copies.begin(view)
        plan = self.serve(view, experts)
        ahead = view.next_experts
        if ahead is not None and view.counts is None:
            self._prefetch(view, plan, [int(e) for e in ahead.tolist() if e >= 0], experts)
        return plan

    def _prefetch_victim(
        self, nl: int, keep: set[int], running: set[int], step: int
    ) -> Slot | None:
        """:meth:`choose_victim` for a prefetch into layer ``nl`` (stale: the layers up to
        it), keeping the view's experts of ``nl`` and the deciding layer's routed experts
        (computed now); None when only those, or copies in flight, remain."""
        hold = {(nl - 1, e) for e in running}
        if all(
            (s[0] == nl and s[1] in keep) or s in hold or s in self.copies.pending
            for s in self.order
        ):
            return None
        self.hold = hold
        try:
            return self.choose_victim(nl, keep, step)
        finally:
            self.hold = set()

    def _prefetch(self, view: View, plan: Plan, ahead: list[int], now: list[int]) -> None:
        """Copy the layer-early view's top ``prefetch_k`` experts of layer+1 in, each evicting
        the Least-Stale victim outside that view and outside the pending copies."""
        nl = view.layer + 1
        row = self._row(nl)
        keep = set(ahead)
        running = set(now)
        limit = self.capacity - 2 * self.model.top_k
        for e in ahead[: self.k_pre]:
            if row[e] or len(self.copies.pending) >= limit:
                continue
            victim: Slot | None = None
            if self.size() >= self.capacity:
                victim = self._prefetch_victim(nl, keep, running, view.step)
                if victim is None:
                    break
                self._evict(victim)
            self._admit(nl, e, view.step)
            self.copies.prefetch((nl, e))
            plan.prefetch.append((nl, e, victim))


register(LeastStalePolicy)
