"""round-robin: placement and replacement in round-robin order, blind to the data.

Source: the data-blind baseline of the placement studies (docs/references.md#baselines:
MoE-Infinity's open runtime spreads expert parameters round-robin across devices; kTransformers'
"uniform" GPU-expert placement). It answers "how much do recency, frequency or popularity buy
over knowing nothing?".

Placement: experts are dealt round-robin over the layers, expert 0 of every layer first, then
expert 1, and so on, until the budget is used (so every layer gets its per-layer quota of its
lowest-numbered experts, earlier layers the remainder). Replacement: each layer's slots form a
ring with a hand; a miss replaces the occupant of the slot under the hand (skipping experts the
same token needs) and the hand moves on. The hand never looks at usage.
"""

from __future__ import annotations

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import SetupContext
from daopsim.policies.caching import CachingPolicy
from daopsim.policies.registry import register


@mypyc_attr(allow_interpreted_subclasses=True)
class RoundRobinPolicy(CachingPolicy):
    """Replace the expert in the next slot of the layer's ring, whatever its use."""

    name = "round-robin"
    summary = "round-robin placement and slot replacement (data-blind)"
    source = "data-blind baseline (MoE-Infinity round-robin spread; kTransformers 'uniform')"
    params = {}  # the data-blind placement is the policy, so no 'initial' option

    def init_state(self, ctx: SetupContext) -> None:
        """One ring of slot positions and a hand per layer."""
        n_layers = ctx.model.moe_layers
        self.ring: list[list[int]] = [[] for _ in range(n_layers)]
        self.hand = [0] * n_layers
        self.free_pos: list[int] = [-1] * n_layers

    def inserted(self, layer: int, expert: int, step: int) -> None:
        """A new expert takes the slot its victim left, or the next empty one."""
        pos = self.free_pos[layer]
        if pos >= 0:
            self.ring[layer][pos] = expert
            self.free_pos[layer] = -1
        else:
            self.ring[layer].append(expert)

    def removed(self, layer: int, expert: int) -> None:
        """Remember which slot was freed."""
        self.free_pos[layer] = self.ring[layer].index(expert)

    def choose_victim(self, layer: int, protected: set[int], step: int) -> int:
        """The occupant under the hand (the next unprotected one); the hand advances past it."""
        ring = self.ring[layer]
        n = len(ring)
        for i in range(n):
            pos = (self.hand[layer] + i) % n
            if ring[pos] not in protected:
                self.hand[layer] = (pos + 1) % n
                return ring[pos]
        raise AssertionError("caller guarantees an unprotected resident expert")


register(RoundRobinPolicy)
