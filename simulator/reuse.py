"""Reuse statistics of a trace: overlap against lag, reuse distances, working sets, and the
per-layer LRU and Belady hit-rate curves under the engine's serving rule.

``ReuseAccumulator`` takes sequences in order (the order ``daopsim run`` evaluates them) and
keeps per-layer state, so ``daopsim.simulator.stats.trace_stats`` can stream a trace through it.
Every quantity is defined in docs/trace-format.md ("Reuse statistics").

The hit-rate curves replay the rule of ``daopsim.policies.caching.CachingPolicy`` exactly, for every
per-layer capacity 1..E at once: one cache per (layer, capacity), starting with experts
0..c-1 resident (the policies' default ``initial=first``), carried across sequences, updated by
one prefill step per sequence (the experts its prompt tokens chose, in descending count order)
and one step per decode token. In a step, hits are judged before any insertion; misses are
fetched in routing order into a free slot or over a victim that this step does not need, and
are served from a temporary buffer (not inserted) when every resident expert is needed. LRU's
victim is the least recently touched (hits are touched in routing order before the misses are
inserted); Belady's is the resident expert whose next use (the next step that routes to it at
that layer) lies farthest ahead, ties to the lowest id.

Why not one Mattson stack: with that rule the cache *contents* still nest across capacities
(the inclusion property holds), but the recency order inside a step depends on which of its
experts were hits, and a prefill step touches its hits in count order, so LRU is not a stack
algorithm here and one stack-distance pass would not reproduce the engine's hit counts exactly.
The pass below advances all capacities together instead: one pass over the steps, vectorised
over layers and capacities (cost per step proportional to layers x capacities x E log E). The
plain LRU stack distance (distinct experts since the last use) is reported too, as
``stack_distance``: it is Mattson's quantity and gives the curve of a textbook per-access LRU
without the serving rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from daopsim.simulator.trace_format import SequenceRouting

#: Lags of ``overlap_by_lag`` (tokens back, same sequence and layer, decode tokens).
LAGS = (1, 2, 4, 8, 16, 32, 64)
#: Window lengths (decode tokens) of ``working_set``.
WINDOWS = (8, 32, 128)
#: Upper bin edges of the reuse-distance histogram (tokens); the last bin is open.
DISTANCE_BINS = (1, 2, 4, 8, 16, 32, 64, 128)
_QUANTILES = (0.25, 0.5, 0.75, 0.9)
_NEVER = np.iinfo(np.int64).max // 4
_NEVER32 = np.iinfo(np.int32).max  # "never used again" in the next-use arrays
CURVE_POLICIES = ("lru", "belady")
#: The two counting rules of the hit-rate curves: ``warm`` (one cache per layer carried across
#: the sequences in order, pooled) and ``cold`` (each sequence alone from an empty cache,
#: averaged over sequences); docs/trace-format.md, "Reuse statistics".
CURVE_RULES = ("warm", "cold")


def _membership(experts: np.ndarray, n_exp: int) -> np.ndarray:
    """``[T, L, k]`` expert ids -> ``[T, L, E]`` booleans."""
    t, n_layers, _k = experts.shape
    out = np.zeros((t, n_layers, n_exp), dtype=bool)
    np.put_along_axis(out, experts.astype(np.int64), True, axis=2)
    return out


def _bin_labels() -> list[str]:
    labels, lo = [], 1
    for hi in DISTANCE_BINS:
        labels.append(str(hi) if hi == lo else f"{lo}-{hi}")
        lo = hi + 1
    labels.append(f">{DISTANCE_BINS[-1]}")
    return labels


def _quantile(hist: np.ndarray, q: float) -> float | None:
    """The q-quantile (lower) of a histogram of integer values 0..len-1."""
    total = hist.sum()
    if total == 0:
        return None
    cum = np.cumsum(hist)
    return float(np.searchsorted(cum, q * total - 1e-9 * total, side="left"))


def _num(x: float) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _listed(values: np.ndarray) -> list[float | None]:
    return [_num(v) for v in values]


def _layer_mean(values: np.ndarray) -> np.ndarray:
    """Mean over layers (axis 0) of the finite values; NaN where a column has none."""
    ok = np.isfinite(values)
    n = ok.sum(axis=0)
    total = np.where(ok, values, 0.0).sum(axis=0)
    return np.where(n > 0, total / np.maximum(n, 1), np.nan)


@dataclass
class _Caches:
    """One simulated cache per (layer, capacity) for one replacement rule."""

    policy: str
    layers: int
    experts: int
    capacities: tuple[int, ...] = ()  # per-layer capacities to simulate (default 1..E)
    cold: bool = False  # start empty (the cold-start rule) instead of experts 0..c-1 resident
    resident: np.ndarray = field(init=False)  # [L, C, E]
    key: np.ndarray = field(init=False)  # [L, C, E] LRU recency (larger = more recent)
    count: np.ndarray = field(init=False)  # [L, C] residents
    hits: np.ndarray = field(init=False)  # [L, C] decode hits
    clock: int = 0

    def __post_init__(self) -> None:
        n_exp = self.experts
        cap = np.array(self.capacities or range(1, n_exp + 1), dtype=np.int64)
        n_cap = cap.size
        self.cap = cap[None, :]
        ids = np.arange(n_exp)
        # initial=first: experts 0..c-1 resident, inserted in id order (0 the oldest); cold:
        # nothing resident
        first = (ids[None, :] < cap[:, None]) & (not self.cold)  # [C, E]
        self.resident = np.broadcast_to(first, (self.layers, n_cap, n_exp)).copy()
        self.key = np.broadcast_to(ids - n_exp, (self.layers, n_cap, n_exp)).astype(np.int64)
        self.count = self.resident.sum(axis=2)
        self.hits = np.zeros((self.layers, n_cap), dtype=np.int64)
        self._lay = np.arange(self.layers)[:, None, None]
        self._caps = np.arange(n_cap)[None, :, None]
        self._lay1 = np.arange(self.layers)[:, None]
        self._ids = ids

    def step(
        self, order: np.ndarray, valid: np.ndarray | None, nxt: np.ndarray | None, decode: bool
    ) -> None:
        """Serve one step: ``order`` [L, w] expert ids in routing order, ``valid`` [L, w]
        (None: all of them are used); ``nxt`` [L, E] is each expert's next use (Belady).

        The engine handles a step's misses one by one; this does them at once, which gives
        the same result: the first misses (routing order) take the free slots, each later
        one evicts one candidate (a resident this step does not need), and the candidates go
        in the order the policy's victim rule ranks them, since inserted experts are needed
        by the step and so never become candidates. Misses beyond free slots plus candidates
        are temporary copies.
        """
        width = order.shape[1]
        res, key = self.resident, self.key
        lay, caps = self._lay, self._caps
        idx = order[:, None, :]
        partial = valid is not None and not valid.all()
        hit = res[lay, caps, idx]  # [L, C, w]
        if partial:
            hit &= valid[:, None, :]
        if decode:
            self.hits += hit.sum(axis=2)
        base = self.clock
        self.clock += 2 * width
        lru = self.policy == "lru"
        if lru:
            # hits are touched in routing order, before any insertion
            key[lay, caps, idx] = np.where(hit, base + np.arange(width), key[lay, caps, idx])
        miss = ~hit
        if partial:
            miss &= valid[:, None, :]
        n_miss = miss.sum(axis=2)
        if not n_miss.any():
            return
        free_slots = self.cap - self.count
        # a step's ids are distinct (a decode top-k, or a permutation of all experts in
        # prefill with the unused ones marked invalid)
        needed = np.zeros((order.shape[0], self.experts), dtype=bool)
        needed[self._lay1, order] = True if valid is None else valid
        cand = res & ~needed[:, None, :]
        n_evict = np.minimum(np.maximum(n_miss - free_slots, 0), cand.sum(axis=2))
        if n_evict.any():
            if lru:
                score = np.where(cand, key, _NEVER)
            else:
                assert nxt is not None
                # farthest next use first, ties to the lowest id (stable sort)
                score = np.where(cand, -nxt[:, None, :], _NEVER)
            ranked = np.argsort(score, axis=2, kind="stable")
            rank = np.empty_like(ranked)
            np.put_along_axis(rank, ranked, np.broadcast_to(self._ids, ranked.shape), axis=2)
            evict = cand & (rank < n_evict[:, :, None])
            res &= ~evict
        inserted = miss & (np.cumsum(miss, axis=2) <= (free_slots + n_evict)[:, :, None])
        res[lay, caps, idx] |= inserted
        if lru:
            key[lay, caps, idx] = np.where(
                inserted, base + width + np.arange(width), key[lay, caps, idx]
            )
        self.count += inserted.sum(axis=2) - n_evict


class ReuseAccumulator:
    """Reuse statistics over sequences given in order (decode tokens; see module doc)."""

    def __init__(
        self,
        layers: int,
        experts: int,
        top_k: int,
        curves: bool | tuple[str, ...] = True,
        capacities: tuple[int, ...] | None = None,
        rules: tuple[str, ...] = ("warm", "cold"),
        stack: bool = True,
    ) -> None:
        self.layers, self.experts, self.top_k = layers, experts, top_k
        #: whether to count LRU stack distances (a loop over tokens; a fit needs none)
        self.stack = stack
        #: the counting rules the curves are computed by (``warm``, ``cold``; both by default)
        self.rules = tuple(rules)
        if not set(self.rules) <= set(CURVE_RULES):
            raise ValueError(f"curve rules must be among {CURVE_RULES}, got {rules!r}")
        self.lag_sum = np.zeros((layers, len(LAGS)))
        self.lag_n = np.zeros(len(LAGS), dtype=np.int64)
        self.dist_hist = np.zeros((layers, 1), dtype=np.int64)  # reuse distance in tokens
        self.stack_hist = np.zeros((layers, experts), dtype=np.int64)  # distinct experts between
        self.first_use = np.zeros(layers, dtype=np.int64)
        self.accesses = np.zeros(layers, dtype=np.int64)
        self.ws_sum = np.zeros((layers, len(WINDOWS)))
        self.ws_n = np.zeros(len(WINDOWS), dtype=np.int64)
        self.decode_tokens = 0
        #: which hit-rate curves to compute (True: all of CURVE_POLICIES)
        self.curves = CURVE_POLICIES if curves is True else tuple(curves or ())
        #: capacities the curves are computed at (others are None); default every one, 1..E
        self.capacities = tuple(sorted(set(capacities or range(1, experts + 1))))
        if not all(1 <= c <= experts for c in self.capacities):
            raise ValueError(f"curve capacities must be within 1..{experts}")
        self._seqs: list[tuple[int, np.ndarray]] = []  # (prefill tokens, experts)

    def add(self, r: SequenceRouting) -> None:
        """One sequence (in evaluation order)."""
        dec = r.experts[r.n_prefill :].astype(np.int64)
        t = dec.shape[0]
        self.decode_tokens += t
        if t:
            member = _membership(dec, self.experts)
            k = dec.shape[2]
            for i, lag in enumerate(LAGS):
                if t > lag:
                    shared = (member[lag:] & member[:-lag]).sum(axis=2)  # [T-lag, L]
                    self.lag_sum[:, i] += shared.sum(axis=0) / k
                    self.lag_n[i] += t - lag
            self._distances(member)
            cum = np.concatenate(
                [np.zeros((1, *member.shape[1:]), np.int32), member.cumsum(0, dtype=np.int32)]
            )
            for i, w in enumerate(WINDOWS):
                if t >= w:
                    distinct = ((cum[w:] - cum[:-w]) > 0).sum(axis=2)  # [T-w+1, L]
                    self.ws_sum[:, i] += distinct.sum(axis=0)
                    self.ws_n[i] += t - w + 1
        if self.curves:
            # the caches need every step's next use (Belady): keep the sequences, replay later
            self._seqs.append((r.n_prefill, r.experts))

    def _distances(self, member: np.ndarray) -> None:
        t, n_layers, n_exp = member.shape
        self.accesses += member.sum(axis=(0, 2))
        # reuse distance in tokens: gap to the previous use at the same layer (this sequence)
        lay, exp, tok = np.nonzero(member.transpose(1, 2, 0))  # sorted by (layer, expert, token)
        again = (lay[1:] == lay[:-1]) & (exp[1:] == exp[:-1])
        gaps = (tok[1:] - tok[:-1])[again]
        glay = lay[1:][again]
        np.add.at(self.first_use, lay[np.concatenate([[True], ~again])], 1)
        if gaps.size:
            width = int(gaps.max()) + 1
            if width > self.dist_hist.shape[1]:
                grown = np.zeros((n_layers, width), dtype=np.int64)
                grown[:, : self.dist_hist.shape[1]] = self.dist_hist
                self.dist_hist = grown
            np.add.at(self.dist_hist, (glay, gaps), 1)
        if not self.stack:
            return
        # stack distance: distinct other experts of the layer used since the previous use
        seen = np.full((n_layers, n_exp), -1, dtype=np.int64)  # last token each expert was used
        for i in range(t):
            cur = member[i]
            prev = np.where(cur, seen, -1)
            # experts used in (prev, i) for each (layer, expert) with prev >= 0
            depth = (seen[:, None, :] > prev[:, :, None]).sum(axis=2)  # [L, E(access)]
            ok = cur & (prev >= 0)
            lay_i, exp_i = np.nonzero(ok)
            np.add.at(self.stack_hist, (lay_i, depth[lay_i, exp_i]), 1)
            seen[cur] = i

    def _steps(
        self, p: int, experts: np.ndarray
    ) -> list[tuple[np.ndarray, np.ndarray | None, bool]]:
        """One sequence's cache steps: (ids in routing order [L, w], which are used [L, w] or
        None for all, decode step): its prompt as one step (experts in descending count), then
        one step per decode token."""
        n_layers, n_exp = self.layers, self.experts
        steps: list[tuple[np.ndarray, np.ndarray | None, bool]] = []
        if p:
            counts = np.zeros((n_layers, n_exp), dtype=np.int64)
            lay = np.broadcast_to(np.arange(n_layers)[None, :, None], experts[:p].shape)
            np.add.at(counts, (lay.ravel(), experts[:p].astype(np.int64).ravel()), 1)
            # descending count, ties by id (the engine's stable sort of the used ids)
            order = np.argsort(-counts, axis=1, kind="stable")
            steps.append((order, np.take_along_axis(counts, order, axis=1) > 0, False))
        dec = experts[p:]  # stored ids (int16): no widened copy of the whole trace
        steps.extend((dec[i], None, True) for i in range(dec.shape[0]))
        return steps

    def _replay(
        self,
        policy: str,
        steps: list[tuple[np.ndarray, np.ndarray | None, bool]],
        cold: bool,
        rows: int | None = None,
    ) -> np.ndarray:
        """Decode hits [rows, C] of one cache per (row, capacity) replaying ``steps``; a row is
        a layer (``rows`` None) or, for the cold rule's batched replay, a (sequence, layer)."""
        caches = _Caches(policy, rows or self.layers, self.experts, self.capacities, cold)
        if policy == "belady":
            self._replay_belady(caches, steps)
        else:
            for order, valid, decode in steps:
                caches.step(order, valid, None, decode)
        return caches.hits

    def _cold(self, policy: str) -> np.ndarray | None:
        """Per-layer cold-start hit rates [L, C], averaged over the sequences with decode
        tokens (None without any). Sequences of the same shape (a prompt or not, the same
        decode length) replay together, each (sequence, layer) its own cache row, so the
        replay costs one pass per shape rather than one per sequence."""
        n_layers, k = self.layers, self.top_k
        groups: dict[tuple[bool, int], list[int]] = {}
        for i, (p, experts) in enumerate(self._seqs):
            n_dec = experts.shape[0] - p
            if n_dec > 0:
                groups.setdefault((p > 0, n_dec), []).append(i)
        if not groups:
            return None
        total = np.zeros((n_layers, len(self.capacities)))
        count = 0
        for (_, n_dec), members in groups.items():
            per = [self._steps(*self._seqs[i]) for i in members]
            stacked: list[tuple[np.ndarray, np.ndarray | None, bool]] = []
            for j, (_, valid, decode) in enumerate(per[0]):
                order = np.concatenate([seq[j][0] for seq in per])
                used = None
                if valid is not None:
                    used = np.concatenate([np.asarray(seq[j][1]) for seq in per])
                stacked.append((order, used, decode))
            hits = self._replay(policy, stacked, cold=True, rows=len(members) * n_layers)
            # a decode token routes to k distinct experts per layer
            rates = hits.reshape(len(members), n_layers, -1) / (n_dec * k)
            total += rates.sum(axis=0)
            count += len(members)
        return total / count

    def _curves(self) -> dict[str, np.ndarray]:
        """Per-layer decode hit rates [L, E] of LRU and Belady at capacities 1..E (NaN at
        capacities not asked for), by the counting rules asked for: ``<policy>`` is the warm,
        pooled rule (one cache per layer carried across the sequences in order, starting with
        experts 0..c-1 resident, hits over all decode accesses), ``<policy>_cold`` the
        per-sequence cold-start rule (each sequence alone from an empty cache, its prompt step
        first; the hit rate of each sequence and layer, averaged over the sequences)."""
        n_layers, n_exp = self.layers, self.experts
        out = {}
        accesses = np.maximum(1, self.accesses)[:, None]
        caps = np.array(self.capacities) - 1
        for policy in self.curves:
            if "warm" in self.rules:
                steps = [st for p, experts in self._seqs for st in self._steps(p, experts)]
                rates = np.full((n_layers, n_exp), np.nan)
                rates[:, caps] = self._replay(policy, steps, cold=False) / accesses
                out[policy] = rates
            if "cold" in self.rules:
                cold = self._cold(policy)
                if cold is not None:
                    rates = np.full((n_layers, n_exp), np.nan)
                    rates[:, caps] = cold
                    out[f"{policy}_cold"] = rates
        return out

    def _replay_belady(
        self, caches: _Caches, steps: list[tuple[np.ndarray, np.ndarray | None, bool]]
    ) -> None:
        """Belady needs each resident's next use: per access, the next step that uses the
        same (layer, expert), found in one backward pass (memory: one int32 per access).
        A row of ``caches`` is a layer, or a (sequence, layer) of the cold rule's batch."""
        rows = caches.layers
        lay1 = np.arange(rows)[:, None]
        upcoming = np.full((rows, self.experts), _NEVER32, dtype=np.int32)
        after: list[np.ndarray] = [upcoming] * len(steps)
        for s in range(len(steps) - 1, -1, -1):
            order, valid, _ = steps[s]
            now = upcoming[lay1, order]
            after[s] = now
            upcoming[lay1, order] = s if valid is None else np.where(valid, s, now)
        next_use = upcoming.astype(np.int64)  # first use of each (layer, expert)
        for s, (order, valid, decode) in enumerate(steps):
            # the step's own experts move on to their following use; the others keep theirs
            if valid is None:
                next_use[lay1, order] = after[s]
            else:
                next_use[lay1, order] = np.where(valid, after[s], next_use[lay1, order])
            caches.step(order, valid, next_use, decode)

    def finish(self) -> dict[str, Any]:
        """The reuse statistics: top-level values and a ``per_layer`` list of rows."""
        n_layers = self.layers
        lags = self.lag_sum / np.where(self.lag_n > 0, self.lag_n, 1)[None, :]
        lags[:, self.lag_n == 0] = np.nan
        ws = self.ws_sum / np.where(self.ws_n > 0, self.ws_n, 1)[None, :]
        ws[:, self.ws_n == 0] = np.nan
        per: list[dict[str, Any]] = [{} for _ in range(n_layers)]
        out: dict[str, Any] = {}

        def lag_dict(row: np.ndarray) -> dict[str, float | None]:
            return {str(lag): _num(v) for lag, v in zip(LAGS, row, strict=True)}

        out["overlap_by_lag"] = lag_dict(_layer_mean(lags))
        out["working_set"] = {
            str(w): _num(v) for w, v in zip(WINDOWS, _layer_mean(ws), strict=True)
        }
        out["reuse_distance"] = self._distance_summary(
            self.dist_hist.sum(0), self.first_use.sum(), self.accesses.sum()
        )
        out["stack_distance"] = (
            self._stack_summary(self.stack_hist.sum(0), self.first_use.sum(), self.accesses.sum())
            if self.stack
            else None
        )
        for layer in range(n_layers):
            row = per[layer]
            row["overlap_by_lag"] = lag_dict(lags[layer])
            row["working_set"] = {str(w): _num(v) for w, v in zip(WINDOWS, ws[layer], strict=True)}
            row["reuse_distance"] = self._distance_summary(
                self.dist_hist[layer], self.first_use[layer], self.accesses[layer]
            )
        curves = self._curves() if self.curves and self.decode_tokens else {}
        for policy in CURVE_POLICIES:
            for suffix in ("", "_cold"):
                rates = curves.get(policy + suffix)
                key = f"{policy}_curve{suffix}"
                out[key] = None if rates is None else _listed(rates.mean(axis=0))
                for layer in range(n_layers):
                    per[layer][key] = None if rates is None else _listed(rates[layer])
        out["per_layer"] = per
        return out

    @staticmethod
    def _distance_summary(hist: np.ndarray, first: int, accesses: int) -> dict[str, Any]:
        """Shares of decode accesses by reuse distance bin, plus quantiles of the distance."""
        total = max(1, int(accesses))
        shares, lo = [], 1
        for hi in DISTANCE_BINS:
            shares.append(float(hist[lo : hi + 1].sum()) / total)
            lo = hi + 1
        shares.append(float(hist[lo:].sum()) / total)
        reused = hist.sum()
        mean = float((hist * np.arange(hist.size)).sum() / reused) if reused else None
        return {
            "bins": _bin_labels(),
            "share": shares if accesses else None,
            "first_use": float(first) / total if accesses else None,
            "mean": mean,
            **{f"p{round(q * 100)}": _quantile(hist, q) for q in _QUANTILES},
        }

    @staticmethod
    def _stack_summary(hist: np.ndarray, first: int, accesses: int) -> dict[str, Any]:
        total = max(1, int(accesses))
        return {
            "share": [float(v) / total for v in hist] if accesses else None,
            "first_use": float(first) / total if accesses else None,
        }
