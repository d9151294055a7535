"""belady-global: clairvoyant MIN over every (layer, expert) slot, the global caching bound.

Source: Belady's MIN (IBM Systems Journal 1966), applied to one cache over all layers' experts:
the bound for ``global-lru`` and ``global-lfu`` as ``belady`` is for the per-layer caches. Same
serving rule (fetch on miss, a token's other experts of this layer never evicted); the victim
is the resident slot whose next use lies farthest in the access order. Results are marked
``"bound": true``.

Access order: layer ``l`` of step ``s`` (a prefill pass or a decode token, ``View.step``) comes
after every layer of earlier steps and before layer ``l + 1`` of step ``s``, so a slot's next
use is the pair (step, layer) of its next access: the oracle's ``next_use(layer, expert, step)``
with the slot's own layer. Deciding at layer 3 of step 10, expert 5 of layer 7 used at step 10
is nearer than expert 5 of layer 1 used at step 11.

Ties: slots never used again come first, among them the lowest layer, then the lowest expert
id; two slots of one layer next used at the same step go to the lower expert id.

A slot's next use changes only when it is accessed, so it is computed on each hit and insertion
and kept in a heap (stale entries skipped), not recomputed for every resident slot per miss.
"""

from __future__ import annotations

import heapq

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import FutureAccesses, SetupContext, Slot
from daopsim.policies.caching import GlobalCachingPolicy
from daopsim.policies.registry import register

#: heap key: (-next step, -its layer, layer, expert); never used again: -inf and layer 0
Key = tuple[float, int, int, int]


@mypyc_attr(allow_interpreted_subclasses=True)
class BeladyGlobalPolicy(GlobalCachingPolicy):
    """Evict the resident expert of any layer whose next use is farthest away (clairvoyant)."""

    name = "belady-global"
    summary = "clairvoyant MIN over all layers' experts (global caching bound)"
    source = "Belady's MIN (IBM Systems Journal 1966) over one cross-layer cache"
    clairvoyant = True

    oracle: FutureAccesses
    #: each cached slot's current heap key (an entry that differs from it is stale)
    key: dict[Slot, Key]
    heap: list[Key]

    def init_state(self, ctx: SetupContext) -> None:
        """Keep the oracle (only clairvoyant policies receive one) and an empty heap."""
        if ctx.oracle is None:
            raise AssertionError("belady-global is clairvoyant: the engine must pass the oracle")
        self.oracle = ctx.oracle
        self.key = {}
        self.heap = []

    def _renew(self, layer: int, expert: int, step: int) -> None:
        t = self.oracle.next_use(layer, expert, step)
        key = (-t, 0 if t == float("inf") else -layer, layer, expert)
        self.key[layer, expert] = key
        heapq.heappush(self.heap, key)
        if len(self.heap) > 4 * len(self.key) + 64:
            # drop the stale entries so the heap stays the size of the cache
            self.heap = list(self.key.values())
            heapq.heapify(self.heap)

    def touch(self, layer: int, expert: int, step: int, weight: int) -> None:
        """Accessed now: its next use moves on."""
        self._renew(layer, expert, step)

    def inserted(self, layer: int, expert: int, step: int) -> None:
        """A new slot's next use (from setup, step -1: its first use)."""
        self._renew(layer, expert, step)

    def removed(self, layer: int, expert: int) -> None:
        """Its heap entry becomes stale."""
        del self.key[layer, expert]

    def choose_victim(self, layer: int, protected: set[int], step: int) -> Slot:
        """Farthest next use over all layers (ties: see the module docstring)."""
        held: list[Key] = []
        victim: Slot | None = None
        while self.heap:
            key = heapq.heappop(self.heap)
            slot = (key[2], key[3])
            if self.key.get(slot) != key:
                continue  # stale: evicted, or accessed since
            if slot[0] == layer and slot[1] in protected:
                held.append(key)
                continue
            victim = slot  # its entry is dropped: removed() follows
            break
        for key in held:
            heapq.heappush(self.heap, key)
        if victim is None:
            raise AssertionError("caller guarantees an unprotected resident expert")
        return victim


register(BeladyGlobalPolicy)
