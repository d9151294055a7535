"""cache-conditional: routing biased toward the experts already cached (Skliar et al.).

Source: Skliar, van Rozendaal, Lepert, Boinovski, van Baalen, Nagel, Whatmough, Ehteshami
Bejnordi, "Mixture of Cache-Conditional Experts for Efficient Mobile Device Inference" (arXiv
2412.00099, TMLR 2025); facts in docs/references.md#cache-conditional-routing. Read: the
abstract (v2) and public summaries of the method; the paper's body was not reachable. The paper
keeps an LRU cache of experts in DRAM (its llama.cpp implementation adds "LRU caching for
experts") and changes the *routing* so that a token prefers cached experts when that costs
little: three training-free rules (Max Rank, Cumulative Probability Threshold, Cache-Prior),
Cache-Prior being the one it recommends. Reported: cache miss rates cut by over 50 % at a
perplexity cost of 0.1-3 % and < 0.1 % on downstream accuracy, up to 2x on-device speed-up,
and hit rates above the oracle (Belady) bound of unmodified routing.

- Cache: ``lru``'s per-layer LRU cache (fetch on miss into the layer's quota, pinned, no
  write-back).
- ``method = "cache-prior"`` (default): the router's logits ``z = log p`` (the trace's dense
  probabilities; experts with p = 0 are never chosen) get ``lam x Delta x m`` added, where ``m``
  is 1 for a resident expert and ``Delta`` the layer's running mean, over the decode tokens so
  far, of the logit range ``max z - min z`` of a token (over experts with p > 0). The route is
  the top-k of the biased logits (ties: the higher true probability, then the lower id).
  ``lam = 0`` is the unmodified routing and ``lam = 1`` routes to any cached expert first. The
  default ``lam = 0.2`` is our choice, fixed before any comparison with the paper; the paper
  sweeps the parameter.
- ``method = "max-rank"``: the paper's Max Rank rule: keep the true top-``keep_top`` experts,
  fill each other place with the highest-ranked resident expert within the top ``max_rank``
  ranks (0: ``2k``), else with the next expert of the true ranking.
- Quality bounds, both options: ``keep_top`` (default 1) true top experts are always kept;
  ``min_gate_mass`` (default 0, off): a route keeping less than this share of the token's true
  top-k gate mass is not used, the true routing is. The gate weights of the new route are
  renormalised by the model (not simulated); the run reports how much of the true gate mass
  the used routes kept (``gate_mass_preserved``) and the share of replaced experts
  (``routing_replaced_frac``, all counted as degradation).
- Only decode tokens are re-routed; a prompt is routed as the trace says (the engine refuses a
  replaced route in prefill), so prefill and batched steps are ``lru``.

Because the routing changes, the hit rate may exceed the Belady bound the run prints, which
is for the unmodified routing (the bound's note and docs/policies.md say so). The quality cost
is not simulated: ``gate_mass_preserved`` is the proxy.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import Plan, SetupContext, Slot, View
from daopsim.policies.lru import LRUPolicy
from daopsim.policies.options import Param
from daopsim.policies.registry import register
from daopsim.simulator.errors import UserError


@mypyc_attr(allow_interpreted_subclasses=True)
class CacheConditionalPolicy(LRUPolicy):
    """Per-layer LRU cache; decode routing biased toward the cached experts."""

    name = "cache-conditional"
    summary = (
        "per-layer LRU; decode routing biased toward cached experts (Cache-Prior or Max Rank), "
        "bounded by kept top experts and a gate-mass floor"
    )
    source = "Mixture of Cache-Conditional Experts (arXiv 2412.00099), Cache-Prior routing"
    params = {
        **LRUPolicy.params,
        "method": Param(
            str,
            "cache-prior",
            "'cache-prior': top-k of logits + lam x mean logit range for cached experts; "
            "'max-rank': cached experts within the top max_rank ranks fill the places after "
            "keep_top",
            choices=("cache-prior", "max-rank"),
        ),
        "lam": Param(
            float,
            0.2,
            "Cache-Prior strength (0: unmodified routing, 1: cache first)",
            minimum=0,
            maximum=10,
        ),
        "max_rank": Param(
            int, 0, "Max Rank: the ranks searched for cached experts (0: 2k)", minimum=0
        ),
        "keep_top": Param(int, 1, "true top experts always kept (quality bound)", minimum=0),
        "min_gate_mass": Param(
            float,
            0.0,
            "use the true routing when a biased route keeps less than this share of the "
            "token's true top-k gate mass (0: off)",
            minimum=0,
            maximum=1,
        ),
    }
    prefill_note = ""

    #: per layer: sum and count of the decode tokens' logit ranges (Cache-Prior's Delta)
    range_sum: list[float]
    range_n: list[int]

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o = self.options
        self.prior = o["method"] == "cache-prior"
        self.lam = float(o["lam"])
        self.max_rank_opt = int(o["max_rank"])
        self.keep = int(o["keep_top"])
        self.floor = float(o["min_gate_mass"])
        self.k = 0
        self.max_rank = 0

    def setup(self, ctx: SetupContext) -> list[Slot]:
        """``lru``'s placement; the routing statistics start empty."""
        self.k = ctx.model.top_k
        if self.keep > self.k:
            raise UserError(
                f"policy {self.name!r}: keep_top={self.keep} is more than the model's top-k "
                f"({self.k})"
            )
        self.max_rank = self.max_rank_opt or 2 * self.k
        n = ctx.model.moe_layers
        self.range_sum = [0.0] * n
        self.range_n = [0] * n
        return list(super().setup(ctx))

    def prefill_layer(self, view: View) -> Plan:
        """A prompt keeps its routing: ``lru``'s service."""
        return self.serve(view, view.experts.tolist())

    def route(self, view: View, experts: list[int]) -> list[int]:
        """The route of this decode token at this layer (``experts`` is the true top-k)."""
        probs: list[float] = np.asarray(view.probs, dtype=np.float64).tolist()
        resident: list[bool] = view.resident[view.layer].tolist()
        keep = experts[: self.keep]
        if self.prior:
            return self._prior(view.layer, probs, resident, keep, experts)
        return self._max_rank(probs, resident, experts, keep)

    def _prior(
        self,
        layer: int,
        probs: list[float],
        resident: list[bool],
        keep: list[int],
        true: list[int],
    ) -> list[int]:
        """Cache-Prior: top-k of ``log p + lam x Delta x resident``, the kept experts first;
        the true experts keep their own logits (a resident one gets the bias too)."""
        z: list[float] = []
        hi = -math.inf
        lo = math.inf
        for p in probs:
            if p > 0.0:
                v = math.log(p)
                z.append(v)
                if v > hi:
                    hi = v
                if v < lo:
                    lo = v
            else:
                z.append(-math.inf)
        if hi > lo:
            self.range_sum[layer] += hi - lo
        self.range_n[layer] += 1
        boost = self.lam * self.range_sum[layer] / self.range_n[layer]
        kept = set(keep)
        # the true experts and the resident ones compete (an expert neither routed nor cached
        # gains nothing from the bias); ties go to a true expert, then the higher probability
        cand = [
            (z[e] + boost if resident[e] else z[e], 1, probs[e], -e) for e in true if e not in kept
        ]
        cand += [
            (z[e] + boost, 0, probs[e], -e)
            for e in range(len(probs))
            if resident[e] and e not in kept and e not in true and probs[e] > 0.0
        ]
        cand.sort(reverse=True)
        return keep + [-c[3] for c in cand[: self.k - len(keep)]]

    def _max_rank(
        self, probs: list[float], resident: list[bool], experts: list[int], keep: list[int]
    ) -> list[int]:
        """Max Rank: after the kept experts, resident experts within the top ``max_rank``
        ranks in rank order, then the true ranking's next experts."""
        ranked = sorted(
            (e for e in range(len(probs)) if probs[e] > 0.0), key=lambda e: (-probs[e], e)
        )[: self.max_rank]
        out = list(keep)
        for e in ranked:
            if len(out) >= self.k:
                break
            if resident[e] and e not in out:
                out.append(e)
        for e in [*experts, *ranked]:
            if len(out) >= self.k:
                break
            if e not in out:
                out.append(e)
        return out

    def decode_layer(self, view: View) -> Plan:
        """The biased route served by the LRU cache (the true one when it is not changed or
        keeps too little of the gate mass)."""
        if view.counts is not None:  # a batched step: routing as recorded
            return self.serve(view, view.experts.tolist())
        experts: list[int] = view.experts.tolist()
        route = self.route(view, experts)
        if set(route) == set(experts):
            return self.serve(view, experts)
        if self.floor > 0.0:
            weights: list[float] = view.weights.tolist()
            total = sum(weights)
            used = set(route)
            kept = sum(w for e, w in zip(experts, weights, strict=False) if e in used)
            if total > 0.0 and kept < self.floor * total:
                return self.serve(view, experts)
        plan = self.serve(view, route)
        plan.route = np.asarray(route, dtype=np.int64)
        plan.raw_route = np.asarray(experts, dtype=np.int64)
        return plan


register(CacheConditionalPolicy)
