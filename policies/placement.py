"""Initial placements from selection counts, and how a budget splits over layers: the
helpers the static policies and the caches place their experts with."""

from __future__ import annotations

import numpy as np

#: (layer, expert)
Slot = tuple[int, int]


def popularity_ranking(counts: np.ndarray) -> list[Slot]:
    """(layer, expert) pairs by descending count; ties broken by layer then expert (stable)."""
    _n_layers, n_exp = counts.shape
    flat = counts.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat))
    return [(int(i // n_exp), int(i % n_exp)) for i in order]


def global_top(counts: np.ndarray, budget: int) -> list[Slot]:
    """Fiddler's placement: the globally most popular ``budget`` experts."""
    return popularity_ranking(counts)[:budget]


def quota_then_global(counts: np.ndarray, budget: int) -> list[Slot]:
    """DAOP's placement: floor(B/L) per layer by popularity, the rest by global rank."""
    n_layers, _ = counts.shape
    per = budget // n_layers
    chosen: list[Slot] = []
    taken: set[Slot] = set()
    for layer in range(n_layers):
        order = np.lexsort((np.arange(counts.shape[1]), -counts[layer]))
        for e in order[:per]:
            chosen.append((layer, int(e)))
            taken.add((layer, int(e)))
    for slot in popularity_ranking(counts):
        if len(chosen) >= budget:
            break
        if slot not in taken:
            chosen.append(slot)
            taken.add(slot)
    return chosen


def per_layer_quota(budget: int, n_layers: int) -> list[int]:
    """Split a budget over layers as evenly as possible (earlier layers get the remainder)."""
    base, extra = divmod(budget, n_layers)
    return [base + (1 if layer < extra else 0) for layer in range(n_layers)]


def low_bit_slots_per_expert(expert_bytes: int, low_bit_bytes: int) -> float:
    """How many low-bit slots one full-precision expert's memory holds (``B / B_low``), for a
    spec with ``low_bit_slots``: the run gives the engine ``floor(budget x`` this ``)`` slots,
    and a policy keeps ``ceil`` of it free per full-precision expert it holds."""
    return expert_bytes / max(1, low_bit_bytes)
