"""The oracle of clairvoyant policies: for each (layer, expert), the steps at which it is used,
so a policy can ask when an expert is next needed (Belady's MIN).
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np


class Oracle:
    """Future accesses for clairvoyant policies: the step of an expert's next use.

    Steps count one per prefill pass and one per decode token, in evaluation order (the
    engine's ``View.step``).
    """

    def __init__(self, n_layers: int, n_experts: int) -> None:
        self.steps: list[list[list[int]]] = [
            [[] for _ in range(n_experts)] for _ in range(n_layers)
        ]
        self.n_steps = 0

    def add(self, r: Any) -> None:
        """Append one sequence's accesses."""
        p = r.n_prefill
        if p:
            for layer in range(r.experts.shape[1]):
                for e in np.unique(r.experts[:p, layer, :]).tolist():
                    self.steps[layer][e].append(self.n_steps)
            self.n_steps += 1
        dec = r.experts[p:]
        n_dec, n_layers, k = dec.shape
        if n_dec:
            # each slot's decode steps in (step, layer, rank) order, as a loop over the
            # tokens appending them would: a stable sort of the slots of the flattened rows
            n_exp = len(self.steps[0])
            slot = (np.arange(n_layers)[None, :, None] * n_exp + dec).reshape(-1)
            order = np.argsort(slot, kind="stable")
            steps = (order // (n_layers * k) + self.n_steps).tolist()
            pos = 0
            for i, n in enumerate(np.bincount(slot, minlength=n_layers * n_exp).tolist()):
                if n:
                    self.steps[i // n_exp][i % n_exp].extend(steps[pos : pos + n])
                    pos += n
        self.n_steps += n_dec

    def next_use(self, layer: int, expert: int, after: int) -> float:
        """First step > ``after`` at which (layer, expert) is used, or infinity."""
        lst = self.steps[layer][expert]
        i = bisect.bisect_right(lst, after)
        return float(lst[i]) if i < len(lst) else float("inf")
