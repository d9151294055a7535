"""Residency's bulk slot move against its one-slot methods."""

from __future__ import annotations

import numpy as np
import pytest

from simulator.residency import Residency


@pytest.mark.parametrize("seed", range(4))
def test_swap_slots_equals_frees_then_takes_one_by_one(seed: int) -> None:
    """``swap_slots(freed, taken)`` leaves the occupancy and its peak where ``freed`` calls
    of ``free`` and then ``taken`` calls of ``take`` leave them, from random states (peaks
    above, at and below the current occupancy included)."""
    rng = np.random.default_rng(seed)
    for _ in range(300):
        budget = int(rng.integers(1, 12))
        a = Residency(2, 8, budget, 2)
        b = Residency(2, 8, budget, 2)
        occ = int(rng.integers(0, a.cap + 1))
        peak = max(0, occ + int(rng.integers(-2, 3)))
        for r in (a, b):
            r.occupancy, r.max_occupancy = occ, peak
        freed = int(rng.integers(0, occ + 1))
        taken = int(rng.integers(0, a.cap - (occ - freed) + 1))
        for _ in range(freed):
            a.free(0.0)
        for _ in range(taken):
            assert a.take(0.0)
        b.swap_slots(freed, taken)
        assert (b.occupancy, b.max_occupancy) == (a.occupancy, a.max_occupancy)
