"""Residency: one flat store shown as numpy arrays, and each GPU's slots with their waiters."""

from __future__ import annotations

import numpy as np

from daopsim.simulator.core.ops import FETCH, Op
from daopsim.simulator.core.resources import INF, Residency


def test_the_flat_state_and_the_arrays_policies_read_are_one_memory() -> None:
    """A change through the engine's flat index shows in the [layers, experts] arrays a
    policy reads, and a write through an array shows in the flat store."""
    res = Residency(3, 4, budget=5, caps=[6])
    op = Op(FETCH, "fetch", 1, 0, 0, 2, 1)
    res.insert(2 * 4 + 1, op)
    assert res.resident[2, 1] and res.n_resident == 1
    assert res.ready_at[2, 1] == INF and res.copying[9] is op
    res.copied(9, op, 0.25)
    assert res.ready_at[2, 1] == 0.25 and 9 not in res.copying
    assert res.remove(9, 0.5) == (0.0, None)  # its copy landed at 0.25: nothing in flight
    assert not res.resident.any() and res.n_resident == 0
    res.resident[0, 3] = True
    assert res.mask[3] == 1
    assert res.resident.shape == res.ready_at.shape == (3, 4)


def test_a_full_gpu_hands_its_next_released_slot_to_the_first_waiter() -> None:
    """Slots are per GPU: a take beyond a GPU's cap fails (the caller queues the fetch), a
    release passes the slot to the first waiting fetch (occupancy unchanged), and only a
    release with nobody waiting frees it; the peak counts every GPU together."""
    res = Residency(2, 4, budget=3, caps=[2, 1])
    res.place([(0, 0)], [[0, 0, 1, 1], [0, 0, 1, 1]])
    assert res.held == [1, 0] and res.occupancy == 1
    assert res.take(0, 0.1) and not res.take(0, 0.2)  # GPU 0 is full
    assert res.take(1, 0.2) and not res.take(1, 0.3)
    waiting = [Op(FETCH, "fetch", i, 0, 0, 0, 1) for i in range(2)]
    res.waiters[0].extend(waiting)
    assert res.release(0, 0.5) is waiting[0]  # the slot passes on: nothing freed
    assert res.held == [2, 1] and res.occupancy == 3 and res.max_occupancy == 3
    assert res.release(0, 0.6) is waiting[1]
    assert res.release(0, 0.7) is None and res.held == [1, 1] and res.occupancy == 2
    assert res.peak == [2, 1]


def test_the_recorder_hears_every_change_of_occupancy() -> None:
    class Rec:
        def __init__(self) -> None:
            self.samples: list[tuple[float, int]] = []

        def occupancy(self, t: float, n: int) -> None:
            self.samples.append((t, n))

    rec = Rec()
    res = Residency(1, 4, budget=2, caps=[2], recorder=rec)
    res.place([(0, 0)], None)
    res.take(0, 1.0)
    res.release(0, 2.0)
    assert rec.samples == [(0.0, 1), (1.0, 2), (2.0, 1)]
    assert np.array_equal(res.resident[0], [True, False, False, False])
