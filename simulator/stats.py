"""Routing statistics of a trace: popularity, temporal locality, gate sharpness, look-ahead.

``trace_stats`` streams a trace sequence by sequence and keeps only per-layer accumulators, so
memory does not grow with the file; the one exception is the LRU/Belady hit-rate replay of
``daopsim.simulator.reuse``, which keeps the stored expert ids (2 bytes per expert per row) until
the end (``curves=False`` turns it off). Every quantity is defined in docs/trace-format.md
("Statistics", "Reuse statistics") exactly as computed here; ``uniform_baseline`` gives the
values independent uniform top-k routing would have, to read real numbers against.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from daopsim.simulator.reuse import ReuseAccumulator
from daopsim.simulator.trace_format import SequenceRouting, TraceMeta
from daopsim.simulator.trace_read import iter_sequences, read_meta

#: The per-layer statistics, in the order they are reported.
STAT_KEYS = (
    "entropy_bits",
    "max_share",
    "consecutive_overlap",
    "top1_repeat",
    "same_set",
    "any_shared",
    "mean_top1_weight",
    "lookahead_precision",
    "prefill_decode_cosine",
)
PHASE_CHOICES = ("decode", "prefill", "all")
#: Tokens handled at once when comparing token pairs (bounds memory for very long sequences).
_CHUNK_TOKENS = 4096


def uniform_baseline(experts: int, top_k: int) -> dict[str, float]:
    """Chance values under independent uniform top-k routing (each k-subset equally likely)."""
    n, k = experts, top_k
    sets = math.comb(n, k)
    return {
        "entropy_bits": math.log2(n),
        "max_share": 1.0 / n,
        "consecutive_overlap": k / n,
        "top1_repeat": 1.0 / n,
        "same_set": 1.0 / sets,
        "any_shared": 1.0 - math.comb(n - k, k) / sets,
    }


@dataclass
class _Acc:
    """Per-layer running sums; every statistic is a ratio of two of these."""

    layers: int
    experts: int
    counts: np.ndarray = field(init=False)
    tokens: np.ndarray = field(init=False)
    top1_weight: np.ndarray = field(init=False)
    pairs: np.ndarray = field(init=False)
    overlap: np.ndarray = field(init=False)
    top1_repeat: np.ndarray = field(init=False)
    same_set: np.ndarray = field(init=False)
    any_shared: np.ndarray = field(init=False)
    look_n: np.ndarray = field(init=False)
    look_hits: np.ndarray = field(init=False)
    cos_sum: np.ndarray = field(init=False)
    cos_n: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.counts = np.zeros((self.layers, self.experts), dtype=np.int64)
        for name in ("tokens", "pairs", "top1_repeat", "same_set", "any_shared", "look_n", "cos_n"):
            setattr(self, name, np.zeros(self.layers, dtype=np.int64))
        for name in ("top1_weight", "overlap", "look_hits", "cos_sum"):
            setattr(self, name, np.zeros(self.layers, dtype=np.float64))


def _layer_counts(experts: np.ndarray, n_exp: int) -> np.ndarray:
    """Selections per (layer, expert) of ``experts`` shaped ``[T, L, k]`` -> ``[L, E]``."""
    _t, n_layers, _k = experts.shape
    flat = (np.arange(n_layers, dtype=np.int64)[None, :, None] * n_exp + experts).ravel()
    return np.bincount(flat, minlength=n_layers * n_exp).reshape(n_layers, n_exp)


def _shared(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How many of each row's experts in ``a`` also appear in ``b`` (``[..., k]`` -> ``[...]``).

    Ids within one top-k are distinct (validation guarantees it), so this is |A ∩ B|.
    """
    return (a[..., :, None] == b[..., None, :]).any(axis=-1).sum(axis=-1)


def _add_sequence(acc: _Acc, r: SequenceRouting, phase: str) -> None:
    t = r.n_tokens
    if t == 0:
        return
    ex = r.experts.astype(np.int64)
    k = ex.shape[2]
    tok = np.arange(t)
    if phase == "decode":
        mask = tok >= r.n_prefill
    elif phase == "prefill":
        mask = tok < r.n_prefill
    else:
        mask = np.ones(t, dtype=bool)
    if mask.any():
        sel = ex[mask]
        acc.counts += _layer_counts(sel, acc.experts)
        w = r.weights[mask].astype(np.float64)
        total = w.sum(axis=-1)
        ok = total > 0
        acc.tokens += ok.sum(axis=0)
        acc.top1_weight += np.where(ok, w[..., 0] / np.where(ok, total, 1.0), 0.0).sum(axis=0)
    # token pairs (t-1, t) with both tokens in the phase; chunked to bound memory
    later = np.flatnonzero(mask[1:] & mask[:-1]) + 1
    for c in range(0, later.size, _CHUNK_TOKENS):
        idx = later[c : c + _CHUNK_TOKENS]
        cur, prev = ex[idx], ex[idx - 1]
        inter = _shared(prev, cur)
        acc.pairs += idx.size
        acc.overlap += inter.sum(axis=0) / k
        acc.top1_repeat += (cur[..., 0] == prev[..., 0]).sum(axis=0)
        acc.same_set += (inter == k).sum(axis=0)
        acc.any_shared += (inter > 0).sum(axis=0)
    # one-layer-early view against the real top-k (layers >= 1 carry a view)
    own = np.flatnonzero(mask)
    for c in range(0, own.size, _CHUNK_TOKENS):
        idx = own[c : c + _CHUNK_TOKENS]
        early = r.early_experts[idx].astype(np.int64)
        valid = (early >= 0).all(axis=-1)
        valid[:, 0] = False
        hits = _shared(early, ex[idx]) / k
        acc.look_n += valid.sum(axis=0)
        acc.look_hits += np.where(valid, hits, 0.0).sum(axis=0)
    # prefill vs decode expert-count vectors of this sequence, per layer
    if 0 < r.n_prefill < t:
        cp = _layer_counts(ex[: r.n_prefill], acc.experts).astype(np.float64)
        cd = _layer_counts(ex[r.n_prefill :], acc.experts).astype(np.float64)
        acc.cos_sum += (cp * cd).sum(axis=1) / (
            np.linalg.norm(cp, axis=1) * np.linalg.norm(cd, axis=1)
        )
        acc.cos_n += 1


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def _finish(acc: _Acc) -> dict[str, np.ndarray]:
    total = acc.counts.sum(axis=1)
    share = acc.counts / np.where(total > 0, total, 1)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(share > 0, share * np.log2(np.where(share > 0, share, 1.0)), 0.0)
    return {
        "entropy_bits": np.where(total > 0, -plogp.sum(axis=1), np.nan),
        "max_share": np.where(total > 0, share.max(axis=1), np.nan),
        "consecutive_overlap": _ratio(acc.overlap, acc.pairs),
        "top1_repeat": _ratio(acc.top1_repeat, acc.pairs),
        "same_set": _ratio(acc.same_set, acc.pairs),
        "any_shared": _ratio(acc.any_shared, acc.pairs),
        "mean_top1_weight": _ratio(acc.top1_weight, acc.tokens),
        "lookahead_precision": _ratio(acc.look_hits, acc.look_n),
        "prefill_decode_cosine": _ratio(acc.cos_sum, acc.cos_n),
    }


def _num(x: float) -> float | None:
    """A float for JSON, or None where the statistic is undefined (no data)."""
    x = float(x)
    return x if math.isfinite(x) else None


def trace_stats(
    source: str | os.PathLike[str] | Iterable[SequenceRouting],
    meta: TraceMeta | None = None,
    max_sequences: int | None = None,
    phase: str = "decode",
    reuse: bool = True,
    curves: bool | tuple[str, ...] = True,
    capacities: tuple[int, ...] | None = None,
    curve_rules: tuple[str, ...] = ("warm", "cold"),
    stack_distance: bool = True,
) -> dict[str, Any]:
    """Routing statistics per layer and their mean over layers (see docs/trace-format.md).

    ``source`` is a trace path (streamed and validated row by row as it is read) or an
    iterable of ``SequenceRouting`` (then ``meta`` is required). ``max_sequences`` stops after
    that many sequences. ``phase`` picks the tokens the popularity, pair, weight and look-ahead
    statistics use: ``decode`` (default), ``prefill`` or ``all``; ``prefill_decode_cosine``
    always compares the two phases. Undefined values (no tokens or pairs) are None.
    ``reuse`` adds the reuse statistics of ``daopsim.simulator.reuse`` (always over decode tokens,
    with the sequences in the order given), and ``curves`` their LRU/Belady hit-rate curves (True
    for both, or a tuple of ``"lru"``/``"belady"``) at ``capacities`` (default 1..E; others
    are None), by the counting rules in ``curve_rules``: ``warm`` (``lru_curve``: pooled, one
    cache carried across the sequences) and ``cold`` (``lru_curve_cold``: each sequence from
    an empty cache, averaged over sequences and layers). ``stack_distance=False`` skips the
    LRU stack-distance histogram (a loop over tokens; ``stack_distance`` is then None).
    """
    if phase not in PHASE_CHOICES:
        raise ValueError(f"phase must be one of {PHASE_CHOICES}, got {phase!r}")
    if isinstance(source, str | os.PathLike):
        meta = meta or read_meta(source)
        routings: Iterable[SequenceRouting] = iter_sequences(source, meta)
    else:
        if meta is None:
            raise ValueError("trace_stats needs meta when given sequences")
        routings = source
    model = meta.model
    acc = _Acc(model.moe_layers, model.experts)
    reuse_acc = ReuseAccumulator(
        model.moe_layers,
        model.experts,
        model.top_k,
        curves=curves,
        capacities=capacities,
        rules=curve_rules,
        stack=stack_distance,
    )
    counts, phase_tokens, filled = _accumulate(
        routings, acc, reuse_acc if reuse else None, phase, max_sequences
    )
    per_layer, out = _per_layer_stats(acc, meta)
    out.update(counts)
    out.update(
        {
            "phase": phase,
            "model": model.name,
            "layers": model.moe_layers,
            "experts": model.experts,
            "top_k": model.top_k,
            "phase_tokens": phase_tokens,
            "token_pairs": int(acc.pairs[0]) if model.moe_layers else 0,
            "missing_token_layers": filled,
            "not_recorded": [
                name
                for name, ok in (
                    ("lookahead", meta.early_view_recorded),
                    ("weights", meta.weights_recorded),
                    ("probs", meta.probs_recorded),
                )
                if not ok
            ],
            "uniform_baseline": uniform_baseline(model.experts, model.top_k),
            "per_layer": per_layer,
        }
    )
    if reuse:
        extra = reuse_acc.finish()
        for row, more in zip(per_layer, extra.pop("per_layer"), strict=True):
            row.update(more)
        out.update(extra)
    return out


def _accumulate(
    routings: Iterable[SequenceRouting],
    acc: _Acc,
    reuse_acc: ReuseAccumulator | None,
    phase: str,
    max_sequences: int | None,
) -> tuple[dict[str, int], int, int]:
    """Add each sequence (at most ``max_sequences``) to the accumulators; the counts of
    sequences and tokens, the tokens of ``phase``, and the token-layers the trace filled in."""
    counts = {"sequences": 0, "prefill_tokens": 0, "decode_tokens": 0}
    phase_tokens = 0
    filled = 0
    for r in routings:
        if max_sequences is not None and counts["sequences"] >= max_sequences:
            break
        _add_sequence(acc, r, phase)
        filled += 0 if r.filled is None else int(np.count_nonzero(r.filled))
        if reuse_acc is not None:
            reuse_acc.add(r)
        phase_tokens += {"decode": r.n_decode, "prefill": r.n_prefill}.get(phase, r.n_tokens)
        counts["sequences"] += 1
        counts["prefill_tokens"] += r.n_prefill
        counts["decode_tokens"] += r.n_decode
    return counts, phase_tokens, filled


def _per_layer_stats(acc: _Acc, meta: TraceMeta) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each layer's statistics, and their mean over the layers where they are defined; what
    the trace did not record is None, never computed from a stand-in."""
    per = _finish(acc)
    if not meta.weights_recorded:
        per["mean_top1_weight"][:] = np.nan
    if not meta.early_view_recorded:
        per["lookahead_precision"][:] = np.nan
    per_layer = []
    for layer in range(meta.model.moe_layers):
        row: dict[str, Any] = {"layer": layer}
        row.update({key: _num(per[key][layer]) for key in STAT_KEYS})
        per_layer.append(row)
    out: dict[str, Any] = {}
    for key in STAT_KEYS:
        values = per[key][np.isfinite(per[key])]
        out[key] = _num(values.mean()) if values.size else None
    return per_layer, out


def heldout_popularity_hit(
    routings: Iterable[SequenceRouting],
    experts: int,
    budgets: Iterable[int],
    calibration: int = 2,
    evaluation: int = 4,
) -> dict[int, float | None]:
    """Decode hit rate of global top-B popularity placement learned on held-out sequences.

    Sequences are taken in order in groups of ``evaluation + calibration``; in each group the
    last ``calibration`` sequences' decode selections rank the (layer, expert) pairs (ties by
    layer, then expert, as Fiddler's placement breaks them), the top ``B`` are "resident", and
    the hit rate is the share of the first ``evaluation`` sequences' decode selections that
    fall on them. The result is the mean over complete groups (None when there is none). This
    is the measurement of ``daopsim validate``'s Fiddler rows on a bundled trace (calibration =
    the last quarter) repeated over many groups, so it says whether popularity persists from
    one set of sequences to the next.
    """
    size = evaluation + calibration
    budgets = list(budgets)
    hits: dict[int, list[float]] = {b: [] for b in budgets}
    group: list[np.ndarray] = []
    for r in routings:
        group.append(_layer_counts(r.experts[r.n_prefill :].astype(np.int64), experts))
        if len(group) < size:
            continue
        ev = np.sum(group[:evaluation], axis=0).reshape(-1)
        cal = np.sum(group[evaluation:], axis=0).reshape(-1)
        group = []
        total = ev.sum()
        if total == 0:
            continue
        order = np.lexsort((np.arange(cal.size), -cal))
        for b in budgets:
            hits[b].append(float(ev[order[: max(0, min(b, cal.size))]].sum() / total))
    return {b: (float(np.mean(v)) if v else None) for b, v in hits.items()}
