"""When the requests of a serving run arrive: a seeded Poisson process (``--arrival-rate``)
or the rows of an arrival file (``--arrivals``: CSV or Parquet, checked row by row; docs/serving.md,
"Arrival file").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from daopsim.simulator.errors import UserError

#: Columns of an arrival file (docs/serving.md, "Arrival file").
ARRIVAL_COLUMNS = ("request_id", "arrival_s", "prompt_tokens", "output_tokens", "sequence")


@dataclass
class Arrival:
    """One row of an arrival file."""

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    sequence: int
    row: int  #: 1-based data row, for error messages


#: The latest arrival time a run takes, s (about 11.6 days). The simulated clock is one float:
#: below this its resolution is 1.2e-10 s, so microsecond events keep their length to 1e-4;
#: epoch times (1.7e9 s) would round every event to 2.4e-7 s, and 1e14 s to 0.016 s.
MAX_CLOCK_S = 1e6


_BEYOND_CLOCK = (
    f"beyond the simulated clock's range of {MAX_CLOCK_S:g} s (about 11.6 days; past it, times "
    "lose their precision)"
)


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """``n`` arrival times of a Poisson process of ``rate`` per second (seeded; first > 0);
    a UserError when the last lies beyond :data:`MAX_CLOCK_S`."""
    gaps = np.random.default_rng([seed, 17]).exponential(1.0 / rate, size=n)
    times = np.cumsum(gaps)
    if n and times[-1] > MAX_CLOCK_S:
        raise UserError(
            f"--arrival-rate {rate:g}: the {n} requests arrive over {times[-1]:.4g} s, "
            f"{_BEYOND_CLOCK}; give a higher rate"
        )
    return times


def _int_field(path: Path, row: int, name: str, value: Any, low: int) -> int:
    if isinstance(value, float | np.floating) and float(value).is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise UserError(f"{path}: row {row}: field {name}: expected an integer, got {value!r}")
    if value < low:
        raise UserError(f"{path}: row {row}: field {name}: must be >= {low}, got {value}")
    return int(value)


def read_arrivals(path: str | Path) -> list[Arrival]:
    """Read and validate an arrival file (CSV or Parquet), sorted by arrival time then row."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".csv", ".parquet"):
        raise UserError(f"{p}: arrival file must end in .csv or .parquet")
    try:
        df = pd.read_csv(p) if suffix == ".csv" else pd.read_parquet(p)
    except FileNotFoundError:
        raise UserError(f"{p}: no such arrival file") from None
    except Exception as exc:  # unreadable: say so in one line
        text = " ".join(str(exc).split())
        raise UserError(f"{p}: cannot read arrival file: {type(exc).__name__}: {text}") from None
    missing = [c for c in ARRIVAL_COLUMNS if c not in df.columns]
    if missing:
        raise UserError(
            f"{p}: missing column {missing[0]!r} (an arrival file has {', '.join(ARRIVAL_COLUMNS)})"
        )
    if df.empty:
        raise UserError(f"{p}: arrival file has no rows")
    out: list[Arrival] = []
    seen: dict[int, int] = {}
    records = df[list(ARRIVAL_COLUMNS)].to_dict("records")
    for i, rec in enumerate(records, start=1):
        for name in ARRIVAL_COLUMNS:
            v = rec[name]
            if v is None or (isinstance(v, float) and math.isnan(v)):
                raise UserError(f"{p}: row {i}: field {name}: empty")
        rid = _int_field(p, i, "request_id", rec["request_id"], 0)
        if rid in seen:
            raise UserError(f"{p}: row {i}: field request_id: {rid} repeats row {seen[rid]}'s id")
        seen[rid] = i
        t = rec["arrival_s"]
        try:
            t = float(t)
        except (TypeError, ValueError):
            raise UserError(f"{p}: row {i}: field arrival_s: not a number: {t!r}") from None
        if not math.isfinite(t) or t < 0:
            raise UserError(f"{p}: row {i}: field arrival_s: must be finite and >= 0, got {t}")
        if t > MAX_CLOCK_S:
            raise UserError(
                f"{p}: row {i}: field arrival_s: {t:.4g} s is {_BEYOND_CLOCK}; give times "
                "relative to the first request"
            )
        out.append(
            Arrival(
                request_id=rid,
                arrival_s=t,
                prompt_tokens=_int_field(p, i, "prompt_tokens", rec["prompt_tokens"], 0),
                output_tokens=_int_field(p, i, "output_tokens", rec["output_tokens"], 1),
                sequence=_int_field(p, i, "sequence", rec["sequence"], 0),
                row=i,
            )
        )
    out.sort(key=lambda a: a.arrival_s)  # stable: file order on ties
    return out
