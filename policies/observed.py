"""A per-layer cache whose victims are chosen from observed features (no policy of its own).

:class:`ObservedCache` is the shared base of the ``learned`` policy (a trained scorer picks the
victim) and of the Gymnasium environment (``daopsim.gym``: an external agent picks it). It
serves every layer exactly as ``lru``, ``lfu`` and ``belady`` do (:class:`CachingPolicy`'s
rule: hits first, then each miss fetched over a victim that is never one of the token's own
experts, or through a temporary buffer when the quota cannot hold them), and keeps the
statistics those policies read, so an agent that sees them can make any of their choices:

- recency: a tick per touch or insertion, as ``lru``'s order and ``lfu``'s tie-break count
  them (``lru_ranks``: 0 is the least recently used resident expert);
- frequency: every access of the layer, hit or miss, a prefill pass adding its token count
  (``lfu``'s counts), and the same counts decayed with a half-life of :data:`HALF_LIFE` steps;
- the step of each expert's last use, and the router's view of this layer and the next.

Only the victim is delegated (:meth:`ObservedCache.decide`); the rest of the rule is fixed.
:data:`FEATURES` are the per-expert numbers a scorer reads (docs/learned-policies.md).
"""

from __future__ import annotations

import math
import sys
from typing import Any, NamedTuple

import numpy as np

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import Plan, SetupContext, View
from daopsim.policies.caching import CachingPolicy

#: steps after which a decayed access count has halved
HALF_LIFE = 32.0
_DECAY = 0.5 ** (1.0 / HALF_LIFE)
_FLOAT_MAX = sys.float_info.max
#: steps apart up to which the decay factors and log ages are remembered (a few hundred kB
#: at most; a longer gap is computed each time)
DECAY_TABLE = 1 << 14

#: the per-expert features a scorer reads, in column order (docs/learned-policies.md)
FEATURES = (
    "lru_rank",  # rank in the layer's recency order / (resident - 1): 0 = least recently used
    "log_age",  # log(1 + steps since the last use)
    "freq_share",  # share of the layer's accesses so far x experts (1 = an even share)
    "recent_share",  # the same with counts decayed over HALF_LIFE steps
    "router_prob",  # this layer's router probability x experts (1 = uniform)
    "prefill",  # 1 in a prefill pass, else 0
    "layer_frac",  # layer / (layers - 1)
    "quota_frac",  # the layer's quota / experts
)


@mypyc_attr(allow_interpreted_subclasses=True)
class ObservedCache(CachingPolicy):
    """Per-layer fetch-on-miss cache whose victim :meth:`decide` picks from its statistics."""

    def init_state(self, ctx: SetupContext) -> None:
        """Recency ticks, last-use steps and (decayed) access counts of every expert."""
        n_layers, n_exp = ctx.model.moe_layers, ctx.model.experts
        self.n_layers, self.n_experts = n_layers, n_exp
        self.tick = 0
        self.last_tick: list[list[int]] = [[-1] * n_exp for _ in range(n_layers)]
        self.last_step: list[list[int]] = [[-1] * n_exp for _ in range(n_layers)]
        self.freq: list[list[int]] = [[0] * n_exp for _ in range(n_layers)]
        self.freq_sum = [0] * n_layers
        self.recent: list[list[float]] = [[0.0] * n_exp for _ in range(n_layers)]
        self.recent_step: list[list[int]] = [[0] * n_exp for _ in range(n_layers)]
        #: ``decay_factor(d)`` for d = 0, 1, ... as far as it was asked (extended on demand)
        self.decay_table: list[float] = []
        #: ``log_age(a)`` for a = 0, 1, ... likewise
        self.log_table: list[float] = []
        #: what every eviction of one layer's service reads (:meth:`now`): its layer and step
        #: (layer -1: none yet), the decayed counts, ``experts / their sum`` and the router
        #: probabilities x experts
        self.now_layer = -1
        self.now_step = -1
        self.now_decayed: list[float] = []
        self.now_scale = 0.0
        self.now_router: list[float] = []
        #: the view of the layer being served (the engine reuses one object: read it only
        #: during a decision)
        self.view: View | None = None
        #: routed accesses found resident so far (``CachingPolicy``'s hits)
        self.hits = 0

    def touch(self, layer: int, expert: int, step: int, weight: int) -> None:
        """A use: the most recent tick and step."""
        self.tick += 1
        self.last_tick[layer][expert] = self.tick
        self.last_step[layer][expert] = step

    def inserted(self, layer: int, expert: int, step: int) -> None:
        """A new entry is as recent as now."""
        self.tick += 1
        self.last_tick[layer][expert] = self.tick
        self.last_step[layer][expert] = step

    def decay_factor(self, d: int) -> float:
        """The decay over ``d`` steps, ``math.pow(_DECAY, d)`` (remembered by ``d``: the same
        float, without a ``pow`` per expert and decision)."""
        table = self.decay_table
        if d < len(table) and d >= 0:
            return table[d]
        if d < 0 or d >= DECAY_TABLE:
            return math.pow(_DECAY, float(d))
        for k in range(len(table), d + 1):
            table.append(math.pow(_DECAY, float(k)))
        return table[d]

    def log_age(self, a: int) -> float:
        """``math.log1p(a)`` of an age in steps (remembered by ``a``: the compiled build has no
        C call for ``log1p``, so each would be a call through Python)."""
        table = self.log_table
        if a < len(table) and a >= 0:
            return table[a]
        if a < 0 or a >= DECAY_TABLE:
            return math.log1p(a)
        for k in range(len(table), a + 1):
            table.append(math.log1p(k))
        return table[a]

    def decode_layer(self, view: View) -> Plan:
        """Count the layer's accesses (every routed expert), then serve them."""
        layer, step = view.layer, view.step
        # typed, so that the compiled build runs the loop on C integers
        experts: list[int] = view.experts.tolist()
        counts = view.counts
        freq, recent, rstep = self.freq[layer], self.recent[layer], self.recent_step[layer]
        row: list[bool] = view.resident[layer].tolist()
        total = 0
        for e in experts:
            w = 1 if counts is None else int(counts[e])
            freq[e] += w
            total += w
            recent[e] = recent[e] * self.decay_factor(step - rstep[e]) + w
            rstep[e] = step
            if row[e]:
                self.hits += 1
        self.freq_sum[layer] += total
        self.now_layer = -1  # a new view, new decayed counts
        self.view = view
        try:
            return self.serve(view, experts)
        finally:
            self.view = None

    def choose_victim(self, layer: int, protected: set[int], step: int) -> int:
        """Ask :meth:`decide` among the resident experts outside ``protected`` (by id)."""
        candidates = [e for e in self.residents(layer) if e not in protected]
        return self.decide(layer, candidates)

    def decide(self, layer: int, candidates: list[int]) -> int:
        """The victim among ``candidates`` (resident, evictable, ascending ids)."""
        raise NotImplementedError

    # -- what a decision can read ---------------------------------------------------------------
    def recency_order(self, layer: int) -> list[int]:
        """The layer's resident experts, least recently used first."""
        ticks = self.last_tick[layer]
        return sorted(self.residents(layer), key=ticks.__getitem__)

    def lru_ranks(self, layer: int) -> np.ndarray:
        """Each expert's rank in the layer's recency order (0 = least recently used; the
        non-resident ones get the number of resident experts)."""
        ranks = np.full(self.n_experts, self.occupied(layer), dtype=np.int64)
        order = self.recency_order(layer)
        ranks[order] = np.arange(len(order))
        return ranks

    def decayed(self, layer: int, step: int) -> list[float]:
        """Every expert's access count decayed with a half-life of HALF_LIFE steps, at
        ``step``."""
        rstep = self.recent_step[layer]
        # (an expert never used stays 0)
        return [
            r * self.decay_factor(step - rstep[e]) if r else 0.0
            for e, r in enumerate(self.recent[layer])
        ]

    def now(self, view: View, layer: int) -> None:
        """Compute, once for every decision of the layer being served, the numbers its
        features read over all experts: :attr:`now_decayed` (:meth:`decayed`),
        :attr:`now_scale` and :attr:`now_router`."""
        step: int = view.step
        if layer == self.now_layer and step == self.now_step:
            return
        n_exp = self.n_experts
        recent = self.decayed(layer, step)
        total = 0.0
        for r in recent:
            total += r
        self.now_decayed = recent
        self.now_scale = n_exp / max(1e-12, total)
        # (one tolist, not a NumPy call per expert: the same floats as ``item``)
        probs: list[float] = view.probs.tolist()
        self.now_router = [finite_value(p) * n_exp for p in probs]
        self.now_layer, self.now_step = layer, step

    def layer_stats(self, layer: int) -> LayerStats:
        """The layer's recency ranks, ages, access counts and decayed counts, now."""
        view = self.view
        assert view is not None, "statistics are read during a decision"
        step = view.step
        return LayerStats(
            self.lru_ranks(layer),
            step - np.array(self.last_step[layer], dtype=np.float64),
            np.array(self.freq[layer], dtype=np.float64),
            np.array(self.decayed(layer, step), dtype=np.float64),
        )

    def features(self, layer: int, experts: list[int]) -> list[list[float]]:
        """The :data:`FEATURES` of ``experts`` of the layer being served, one row each
        (:meth:`feed` into a list)."""
        rows = Rows()
        self.feed(layer, experts, rows)
        return rows.rows

    def feed(self, layer: int, experts: list[int], sink: FeatureSink) -> None:
        """Hand the :data:`FEATURES` of ``experts`` of the layer being served to ``sink``: the
        three that every expert of the layer shares once (:meth:`FeatureSink.layer`), then
        each expert's five in the order of ``experts`` (:meth:`FeatureSink.expert`). Typed
        loops over the policy's own statistics; the compiled build runs them as C and passes
        the numbers as C doubles, so a scorer reads them without a row of Python floats."""
        view = self.view
        assert view is not None, "features are read during a decision"
        step: int = view.step
        n_exp = self.n_experts
        cache = self.residents(layer)
        n_res = len(cache)
        ticks = self.last_tick[layer]
        rank_div = float(max(1, n_res - 1))
        freq_scale = n_exp / max(1, self.freq_sum[layer])
        self.now(view, layer)
        recent, router = self.now_decayed, self.now_router
        recent_scale = self.now_scale
        last, freq = self.last_step[layer], self.freq[layer]
        # the same for every expert of the layer
        prefill = 1.0 if view.is_prefill else 0.0
        layer_frac = layer / max(1, self.n_layers - 1)
        quota_frac = self.quota[layer] / n_exp
        sink.layer(prefill, layer_frac, quota_frac)
        for e in experts:
            rank = n_res  # a resident expert's: how many resident ones were used before it
            if e in cache:
                t = ticks[e]
                rank = 0
                for c in cache:
                    if ticks[c] < t:
                        rank += 1
            sink.expert(
                rank / rank_div,
                self.log_age(step - last[e]),
                freq[e] * freq_scale,
                recent[e] * recent_scale,
                router[e],
            )

    def feature_matrix(self, layer: int) -> np.ndarray:
        """The ``[experts, len(FEATURES)]`` features of every expert of the layer being
        served (:meth:`features`)."""
        rows = self.features(layer, list(range(self.n_experts)))
        return np.array(rows, dtype=np.float64).reshape(self.n_experts, len(FEATURES))


class FeatureSink:
    """What :meth:`ObservedCache.feed` hands a decision's :data:`FEATURES` to."""

    def layer(self, prefill: float, layer_frac: float, quota_frac: float) -> None:
        """The last three features, the same for every expert of the decision's layer."""

    def expert(
        self,
        lru_rank: float,
        log_age: float,
        freq_share: float,
        recent_share: float,
        router_prob: float,
    ) -> None:
        """The first five features of the next expert."""


class Rows(FeatureSink):
    """The features as rows of :data:`FEATURES` (:meth:`ObservedCache.features`)."""

    def __init__(self) -> None:
        self.rows: list[list[float]] = []
        self.prefill = self.layer_frac = self.quota_frac = 0.0

    def layer(self, prefill: float, layer_frac: float, quota_frac: float) -> None:
        """Remember the layer's three."""
        self.prefill, self.layer_frac, self.quota_frac = prefill, layer_frac, quota_frac

    def expert(
        self,
        lru_rank: float,
        log_age: float,
        freq_share: float,
        recent_share: float,
        router_prob: float,
    ) -> None:
        """One row: the expert's five, then the layer's three."""
        self.rows.append(
            [
                lru_rank,
                log_age,
                freq_share,
                recent_share,
                router_prob,
                self.prefill,
                self.layer_frac,
                self.quota_frac,
            ]
        )


class LayerStats(NamedTuple):
    """One layer's per-expert statistics at a decision (arrays over its experts)."""

    lru_rank: np.ndarray  #: recency rank, 0 = least recently used (non-resident: resident count)
    age: np.ndarray  #: steps since the last use (since the run's start: never used)
    freq: np.ndarray  #: accesses so far (``lfu``'s counts)
    recent: np.ndarray  #: accesses decayed with a half-life of HALF_LIFE steps


def finite(x: Any) -> np.ndarray:
    """A router row as float64 with NaN (not recorded) as 0."""
    a = np.asarray(x, dtype=np.float64)
    return a if np.isfinite(a).all() else np.nan_to_num(a)


def finite_value(x: float) -> float:
    """One router probability as :func:`finite` reads it: NaN (not recorded) as 0, an
    infinity as the largest finite float of its sign."""
    # (isnan and isinf are C calls in the compiled build; isfinite would go through Python)
    if math.isnan(x):
        return 0.0
    if math.isinf(x):
        return _FLOAT_MAX if x > 0 else -_FLOAT_MAX
    return x


def as_probs(x: Any, n: int) -> np.ndarray:
    """A router row as float32 probabilities in [0, 1] (zeros when absent; NaN, not recorded,
    as 0)."""
    if x is None or np.shape(x) != (n,):
        return np.zeros(n, dtype=np.float32)
    out = finite(x).astype(np.float32)
    return np.minimum(np.maximum(out, 0.0, out=out), 1.0, out=out)
