"""Comparing a run of the regression grid with a store: every value that moved (:class:`Change`),
counts and bytes exactly, times and rates within a relative tolerance, NaN equal to NaN, and the
changes as text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: Relative tolerance for float metrics. The engine is deterministic and sums in a fixed order,
#: so on one platform results are bit-identical; the tolerance only absorbs last-digit
#: differences between numpy/libm builds (~1e-15 per operation, ~1e-12 after long sums). A real
#: change (one extra expert copy in a run) moves times by 1e-4 or more, far above it.
DEFAULT_TOLERANCE = 1e-6
#: Floats this close to each other count as equal whatever their size (values near zero).
ABS_TOLERANCE = 1e-12


# --- comparison -------------------------------------------------------------------------------


@dataclass
class Change:
    """One value that differs from the store (or a configuration that appeared/vanished)."""

    config: str
    field: str
    status: str  #: "moved", "new" or "missing"
    baseline: Any = None
    current: Any = None

    @property
    def rel_change(self) -> float | None:
        """(current - baseline) / |baseline| for numbers, else None."""
        b, c = self.baseline, self.current
        if _num(b) and _num(c) and b != 0:
            return (c - b) / abs(b)
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON form for ``regress --json``."""
        return {
            "config": self.config,
            "field": self.field,
            "status": self.status,
            "baseline": self.baseline,
            "current": self.current,
            "rel_change": self.rel_change,
        }


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


#: Record keys that name the configuration (they are in its key) rather than describe an outcome
_NAMING = ("trace", "policy", "hw", "budget")


def flatten(rec: dict[str, Any]) -> dict[str, Any]:
    """One configuration's record as ``field -> scalar`` (metrics.X, per_layer_hit_rate[i])."""
    flat: dict[str, Any] = {}
    for k, v in rec.items():
        if k in _NAMING:
            continue
        if k == "metrics":
            flat.update({f"metrics.{m}": x for m, x in v.items()})
        elif k == "per_layer_hit_rate":
            flat.update({f"per_layer_hit_rate[{i}]": x for i, x in enumerate(v)})
        elif isinstance(v, dict | list):
            flat[k] = json.dumps(v, sort_keys=True)
        else:
            flat[k] = v
    return flat


def same(a: Any, b: Any, rel: float) -> bool:
    """Exact for ints, strings and bools; ``rel`` tolerance for floats; None (NaN) == None."""
    if a is None or b is None:
        return a is None and b is None
    if _num(a) and _num(b):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        fa, fb = float(a), float(b)
        if math.isnan(fa) or math.isnan(fb):
            return math.isnan(fa) and math.isnan(fb)
        return math.isclose(fa, fb, rel_tol=rel, abs_tol=ABS_TOLERANCE)
    return type(a) is type(b) and a == b


def compare(
    baseline: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]], rel: float
) -> list[Change]:
    """Every difference between two outcome maps (baseline order, then new configurations)."""
    changes: list[Change] = []
    for key, old in baseline.items():
        new = current.get(key)
        if new is None:
            changes.append(Change(key, "(configuration)", "missing"))
            continue
        fo, fn = flatten(old), flatten(new)
        for f in list(fo) + [f for f in fn if f not in fo]:
            if f not in fo:
                changes.append(Change(key, f, "new", None, fn[f]))
            elif f not in fn:
                changes.append(Change(key, f, "missing", fo[f], None))
            elif not same(fo[f], fn[f], rel):
                changes.append(Change(key, f, "moved", fo[f], fn[f]))
    for key in current:
        if key not in baseline:
            changes.append(Change(key, "(configuration)", "new"))
    return changes


def _trace_facts(grid: dict[str, Any]) -> dict[str, dict[str, Any]]:
    blocks = grid.get("blocks")
    if not isinstance(blocks, list):
        return {}
    return {
        str(b.get("trace")): {k: b.get(k) for k in ("trace_sha256", "sequences", "seed")}
        for b in blocks
        if isinstance(b, dict)
    }


def compare_grids(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """A different trace (bytes), sequence count or seed explains every moved metric: say so."""
    before, after = _trace_facts(old), _trace_facts(new)
    return [
        Change(f"(grid) {trace}", k, "moved", before[trace][k], v)
        for trace, facts in after.items()
        if trace in before
        for k, v in facts.items()
        if before[trace][k] != v
    ]


def _show(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    text = str(v)
    return text if len(text) <= 60 else text[:57] + "..."


def render_changes(changes: Iterable[Change]) -> str:
    """A table of what moved: configuration, field, baseline, current, relative change."""
    rows = [("configuration", "field", "baseline", "current", "change")]
    for c in changes:
        rel = c.rel_change
        if c.status != "moved":
            how = c.status
        elif rel is not None:
            how = f"{rel:+.3%}"
        else:
            how = "changed"
        rows.append((c.config, c.field, _show(c.baseline), _show(c.current), how))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
