"""The recorder: one row per operation on a resource, plus slot-occupancy samples.

Rows are appended as tuples (cheap in the hot path) and turned into a pandas DataFrame once,
at the end. Columns: resource, kind, seq, token, layer, expert, start, end, bytes. Times are
simulated seconds. A serving run (simulator/serving.py) adds a ``requests`` column: the
request ids of each row's step (one id, or several comma-separated for a batched step, whose
rows carry seq -1 and the step number as token).
"""

from __future__ import annotations

import pandas as pd

COLUMNS = ("resource", "kind", "seq", "token", "layer", "expert", "start", "end", "bytes")


class Recorder:
    """Collects operation rows and occupancy samples during a run."""

    __slots__ = ("_occ", "batches", "rows")

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self._occ: list[tuple[float, int]] = []
        #: serving runs: step number -> request ids of a batched step (None: not serving)
        self.batches: dict[int, str] | None = None

    def op(
        self,
        resource: str,
        kind: str,
        seq: int,
        token: int,
        layer: int,
        expert: int,
        start: float,
        end: float,
        nbytes: int,
    ) -> None:
        """Record one operation on a resource."""
        self.rows.append((resource, kind, seq, token, layer, expert, start, end, nbytes))

    def occupancy(self, time: float, slots: int) -> None:
        """Record the number of GPU expert slots held from ``time`` on."""
        self._occ.append((time, slots))

    def timeline(self) -> pd.DataFrame:
        """All operations as a DataFrame sorted by start time (stable)."""
        df = pd.DataFrame.from_records(self.rows, columns=list(COLUMNS))
        df = df.astype(
            {
                "resource": "category",
                "kind": "category",
                "seq": "int32",
                "token": "int32",
                "layer": "int16",
                "expert": "int16",
                "start": "float64",
                "end": "float64",
                "bytes": "int64",
            }
        )
        if self.batches is not None:
            batches = self.batches
            df["requests"] = [
                batches.get(tok, "") if seq == -1 else str(seq)
                for seq, tok in zip(df["seq"].tolist(), df["token"].tolist(), strict=True)
            ]
        return df.sort_values(["start", "end"], kind="stable").reset_index(drop=True)

    def occupancy_frame(self) -> pd.DataFrame:
        """Slot occupancy samples (time, slots) sorted by time."""
        df = pd.DataFrame.from_records(self._occ, columns=["time", "slots"])
        return df.sort_values("time", kind="stable").reset_index(drop=True)
