"""Residency and slots: which experts are on the GPU, when their copies end, who holds a slot.

One :class:`Residency` per run. The policy-visible state (the ``resident`` mask, experts in
flight counting as resident) changes at decision time; the timed state (``ready_at``, slot
occupancy) changes when the engine serves the copies. Both engines share it.

Slots: ``budget`` resident experts plus ``staging`` expert-sized buffers. A fetch claims a slot
when one is free, else waits (first come, first served) for the next write-back to end: an
evicted expert keeps its slot until it is back on the host.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from policies.base import Slot
from simulator.recorder import Recorder

INF = float("inf")


class Residency:
    """Resident mask, copy-end times and slot occupancy of one run."""

    __slots__ = (
        "budget",
        "cap",
        "copying",
        "max_occupancy",
        "n_experts",
        "n_layers",
        "n_resident",
        "occupancy",
        "prefetched",
        "ready_at",
        "recorder",
        "resident",
        "waiters",
    )

    def __init__(
        self,
        n_layers: int,
        n_experts: int,
        budget: int,
        staging: int,
        recorder: Recorder | None = None,
    ) -> None:
        self.n_layers, self.n_experts = n_layers, n_experts
        self.budget = int(budget)
        self.cap = int(budget) + int(staging)
        self.resident = np.zeros((n_layers, n_experts), dtype=bool)
        #: when each resident expert's copy ends (INF while its copy has not started)
        self.ready_at = np.zeros((n_layers, n_experts), dtype=np.float64)
        self.prefetched = np.zeros((n_layers, n_experts), dtype=bool)
        #: experts whose copy into a slot has been issued but not yet started -> the copy
        self.copying: dict[Slot, Any] = {}
        self.n_resident = 0
        #: slots held: resident experts whose copy has its slot, plus evicted ones being
        #: written back
        self.occupancy = 0
        self.max_occupancy = 0
        #: fetches waiting for a slot, first come first served (fast engine)
        self.waiters: deque[Any] = deque()
        self.recorder = recorder

    def place(self, slots: list[Slot]) -> None:
        """The initial placement (already checked): resident and ready at time 0."""
        for slot in slots:
            self.resident[slot] = True
        self.n_resident = self.occupancy = self.max_occupancy = len(slots)
        if self.recorder is not None:
            self.recorder.occupancy(0.0, self.occupancy)

    def insert(self, slot: Slot, copy: Any) -> None:
        """An expert is now resident (its copy issued, not yet started)."""
        self.resident[slot] = True
        self.ready_at[slot] = INF
        self.copying[slot] = copy
        self.n_resident += 1

    def remove(self, slot: Slot) -> None:
        """An expert is no longer resident (its slot may still be held by a write-back)."""
        self.resident[slot] = False
        self.n_resident -= 1

    def copied(self, slot: Slot, end: float) -> None:
        """The copy into ``slot`` has started and ends at ``end``."""
        self.ready_at[slot] = end
        self.copying.pop(slot, None)

    def take(self, t: float) -> bool:
        """Claim a free slot at ``t``; False when none is free (the caller waits)."""
        occ = self.occupancy
        if occ >= self.cap:
            return False
        self.occupancy = occ = occ + 1
        if occ > self.max_occupancy:
            self.max_occupancy = occ
        if self.recorder is not None:
            self.recorder.occupancy(t, occ)
        return True

    def swap_slots(self, freed: int, taken: int) -> None:
        """Without a recorder: ``freed`` slots released, then ``taken`` taken one by one (each
        a :meth:`take` the caller has checked there is room for), in one step. The occupancy
        only grows while they are taken, so its peak is the final value."""
        occ = self.occupancy = self.occupancy - freed + taken
        if taken and occ > self.max_occupancy:
            self.max_occupancy = occ

    def free(self, t: float) -> None:
        """A slot is released at ``t`` (no waiter takes it)."""
        self.occupancy -= 1
        if self.recorder is not None:
            self.recorder.occupancy(t, self.occupancy)
