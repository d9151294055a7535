"""belady: clairvoyant MIN replacement per layer, the caching bound.

Source: Belady's MIN (evict the item whose next use lies farthest in the future), the bound the
expert-caching literature reports beside LRU (docs/references.md#baselines; "Cacheable by
Design?", arXiv 2608.18261: LRU 65.9 %, Belady 79.1 %; CECAR's Belady bounds). Same cache model as
``lru`` (per-layer quota, fetch on miss, a token's other experts never evicted), but the victim
is chosen with the oracle of future accesses: ``ctx.oracle.next_use(layer, expert, step)``.
Results are marked ``"bound": true``; no real runtime can do this.

Ties (several residents never used again, or used at the same future step) go to the lowest
expert id.
"""

from __future__ import annotations

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import FutureAccesses, SetupContext
from daopsim.policies.caching import CachingPolicy
from daopsim.policies.registry import register


@mypyc_attr(allow_interpreted_subclasses=True)
class BeladyPolicy(CachingPolicy):
    """Evict the resident expert whose next use is farthest away (clairvoyant)."""

    name = "belady"
    summary = "clairvoyant MIN replacement per layer (caching bound)"
    source = "Belady's MIN (IBM Systems Journal 1966); the bound caching studies report"
    clairvoyant = True

    oracle: FutureAccesses

    def init_state(self, ctx: SetupContext) -> None:
        """Keep the oracle (only clairvoyant policies receive one)."""
        if ctx.oracle is None:
            raise AssertionError("belady is clairvoyant: the engine must pass the oracle")
        self.oracle = ctx.oracle

    def choose_victim(self, layer: int, protected: set[int], step: int) -> int:
        """Farthest next use after this step; ties by lowest expert id."""
        best, best_t = -1, -1.0
        next_use = self.oracle.next_use
        for e in self.residents(layer):
            if e in protected:
                continue
            t = next_use(layer, e, step)
            if t > best_t:
                best, best_t = e, t
        if best < 0:
            raise AssertionError("caller guarantees an unprotected resident expert")
        return best


register(BeladyPolicy)
