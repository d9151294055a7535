"""The routing statistics a synthetic trace is calibrated against and ``daopsim synth fit`` fits
to, computed in memory through the same code as ``daopsim trace stats``: the per-layer
statistics, the held-out popularity hit rates and the traffic concentration.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from daopsim.simulator.models import ModelShape
from daopsim.simulator.stats import heldout_popularity_hit, trace_stats
from daopsim.simulator.trace_format import (
    SequenceRouting,
    TraceMeta,
)

STAT_KEYS = (
    "entropy_bits",
    "max_share",
    "consecutive_overlap",
    "top1_repeat",
    "mean_top1_weight",
    "lookahead_precision",
    "prefill_decode_cosine",
)
#: Extra statistics ``routing_stats`` adds to ``trace_stats`` (fit targets only when asked for).
EXTRA_STAT_KEYS = ("traffic95_experts", "popularity_hit_56", "popularity_hit_125")
#: Budgets of the held-out popularity-placement statistics, as a share of all (layer, expert)
#: pairs: Fiddler's two environments, 56 and 125 of Mixtral's 256 experts.
POPULARITY_BUDGETS = {"popularity_hit_56": 56 / 256, "popularity_hit_125": 125 / 256}
#: Fraction of selections the concentration statistic covers (the "95 % of traffic" figure).
TRAFFIC_SHARE = 0.95


# --------------------------------------------------------------------------------------------
# Statistics (in memory, through the same code as `daopsim trace stats`)
# --------------------------------------------------------------------------------------------


def traffic_concentration(
    model: ModelShape, seqs: list[SequenceRouting], share: float = TRAFFIC_SHARE
) -> np.ndarray:
    """Per layer, the fraction of experts that carries ``share`` of the decode selections.

    Selections of all sequences' decode tokens are pooled per layer; experts are ranked by
    their count and the smallest number whose counts reach ``share`` of the total is divided
    by the number of experts. This is how "95 % of traffic through 52.5 % of experts" is read.
    """
    n_layers, n_exp = model.moe_layers, model.experts
    counts = np.zeros((n_layers, n_exp), dtype=np.int64)
    offsets = np.arange(n_layers, dtype=np.int64)[None, :, None] * n_exp
    for r in seqs:
        ex = r.experts[r.n_prefill :].astype(np.int64)
        if ex.size:
            flat = (offsets + ex).ravel()
            counts += np.bincount(flat, minlength=n_layers * n_exp).reshape(n_layers, n_exp)
    ranked = -np.sort(-counts, axis=1)
    total = ranked.sum(axis=1, keepdims=True)
    cum = np.cumsum(ranked, axis=1) / np.where(total > 0, total, 1)
    needed = (cum < share - 1e-12).sum(axis=1) + 1
    return np.where(total[:, 0] > 0, needed / n_exp, np.nan)


def routing_stats(
    model: ModelShape,
    seqs: list[SequenceRouting],
    reuse: bool = True,
    curves: Any = False,
    capacities: tuple[int, ...] | None = None,
    curve_rules: tuple[str, ...] = ("warm", "cold"),
    stack_distance: bool = True,
) -> dict[str, Any]:
    """``trace_stats`` of in-memory sequences (no file round trip), plus ``traffic95_experts``
    (mean over layers of ``traffic_concentration``, also given per layer) and the held-out
    popularity-placement hit rates ``popularity_hit_56`` / ``popularity_hit_125``
    (``stats.heldout_popularity_hit`` with groups of 4 evaluation + 2 calibration sequences, the
    split of the bundled 8-sequence trace; None with fewer than 6 sequences). ``reuse``,
    ``curves`` and ``capacities`` are passed to ``trace_stats``; the hit-rate curves are off
    by default here (they are the slow part for many-expert models)."""
    meta = TraceMeta(model=model, probs_stored=seqs[0].probs.shape[2] if seqs else 1)
    stats = trace_stats(
        seqs,
        meta=meta,
        reuse=reuse,
        curves=curves,
        capacities=capacities,
        curve_rules=curve_rules,
        stack_distance=stack_distance,
    )
    conc = traffic_concentration(model, seqs)
    finite = conc[np.isfinite(conc)]
    stats["traffic95_experts"] = float(finite.mean()) if finite.size else None
    for row, v in zip(stats["per_layer"], conc, strict=True):
        row["traffic95_experts"] = float(v) if math.isfinite(v) else None
    pairs = model.moe_layers * model.experts
    budgets = {key: max(1, round(share * pairs)) for key, share in POPULARITY_BUDGETS.items()}
    hits = heldout_popularity_hit(seqs, model.experts, set(budgets.values()))
    for key, b in budgets.items():
        stats[key] = hits[b]
    return stats
