"""The GPU-memory vs throughput Pareto figure: the front of a sweep table's realisable rows, and
its points numbered beside their markers where the numbers overlap nothing, explained under the
axes.
"""

from __future__ import annotations

import os
import textwrap
from typing import Any

import numpy as np
import pandas as pd

from daopsim.simulator.errors import UserError
from daopsim.simulator.plots_common import (
    _MARKERS,
    _Z_BOUND,
    _Z_POLICY,
    ALL_GPU,
    EXACT_FIDELITY,
    _empty,
    _finish,
    _fit_x,
    _fit_y0,
    _is_bound,
    _legend,
    _model,
    _mpl,
    _name,
    _note_under,
    _point,
    _ring_approximate,
    _styles,
    _trace_rows,
    any_approximate,
    fidelity_note,
    missing_points,
)


def pareto_front(
    df: pd.DataFrame, x: str = "expert_memory_gb", y: str = "tokens_per_s"
) -> pd.DataFrame:
    """Rows not dominated by another (less or equal ``x`` with strictly more ``y``), by ``x``."""
    pts = df.dropna(subset=[x, y]).sort_values([x, y], ascending=[True, False], kind="stable")
    keep, best = [], -np.inf
    for idx, val in zip(pts.index, pts[y], strict=True):
        if val > best:
            keep.append(idx)
            best = val
    return pts.loc[keep]


#: Offsets (points) tried for a label beside its marker, in order.
_LABEL_OFFSETS = ((5, 5), (5, -11), (-11, 5), (-11, -11), (8, -3), (-14, -3), (-3, 8), (-3, -14))


def place_labels(ax: Any, xs: list[float], ys: list[float], texts: list[str]) -> list[Any]:
    """Small labels beside points, each at the first offset where it overlaps no other label
    and stays inside the axes (the last offset tried when none does); returns the Text objects.
    Needs a figure that can be drawn (any matplotlib canvas with a renderer)."""
    fig = ax.figure
    try:
        fig.canvas.draw()  # the layout settles, so the positions found below hold
        renderer = fig.canvas.get_renderer()
    except Exception:  # a canvas without a renderer: the first offset for every label
        renderer = None
    placed: list[Any] = []
    boxes: list[Any] = []
    for x, y, text in zip(xs, ys, texts, strict=True):
        ann = None
        for dx, dy in _LABEL_OFFSETS:
            if ann is not None:
                ann.remove()
            ann = ax.annotate(
                text,
                (x, y),
                textcoords="offset points",
                xytext=(dx, dy),
                fontsize=7,
                zorder=_Z_POLICY + 1,
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8},
            )
            if renderer is None:
                break
            box = ann.get_window_extent(renderer)
            inside = ax.bbox.contains(box.x0, box.y0) and ax.bbox.contains(box.x1, box.y1)
            if inside and not any(box.overlaps(b) for b in boxes):
                break
        assert ann is not None
        if renderer is not None:
            boxes.append(ann.get_window_extent(renderer))
        placed.append(ann)
    return placed


def plot_pareto(df: pd.DataFrame | str | os.PathLike[str], trace: str | None = None) -> Any:
    """GPU memory for resident experts against tokens/s: every run, and the Pareto front (its
    points numbered, the numbers explained under the axes)."""
    plt = _mpl()
    rows, trace = _trace_rows(df, trace)
    rows = rows[~_is_bound(rows) | (rows["status"] != "ok")]
    rows = rows[rows["policy"] != ALL_GPU]
    if rows.empty:
        raise UserError(f"no realisable (non-bound) runs for trace {_name(trace)!r}")
    sub = rows[rows["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(8.0, 5.4), layout="constrained")
    ax.set_xlabel("GPU memory for resident experts (GB, 10^9 bytes)")
    ax.set_ylabel("throughput (tokens/s, simulated)")
    ringed = "; ringed: approximate routing (gate mass preserved < 1)"
    title = f"Memory vs throughput: trace {_name(trace)}{_model(rows)}"
    ax.set_title(textwrap.fill(title + (ringed if any_approximate(sub) else ""), 80))
    if sub.empty:
        _empty(ax, "no finished run", rows)
        return _finish(fig, 5.0)
    styles = _styles(sub)
    hws = list(dict.fromkeys(sub["hw"]))
    markers = {h: _MARKERS[i % len(_MARKERS)] for i, h in enumerate(hws)}
    for (label, h), grp in sub.groupby(["label", "hw"], sort=False):
        ax.scatter(
            grp["expert_memory_gb"],
            grp["tokens_per_s"],
            color=styles[str(label)][0],
            marker=markers[h],
            s=42,
            label=f"{label} on {h}{fidelity_note(grp)}",
            alpha=0.85,
            zorder=_Z_POLICY,
        )
        _ring_approximate(ax, grp, "expert_memory_gb", "tokens_per_s", styles[str(label)][0])
    front = pareto_front(sub)
    ax.step(
        front["expert_memory_gb"],
        front["tokens_per_s"],
        where="post",
        color="black",
        lw=1.2,
        label="Pareto front",
        zorder=_Z_BOUND,
    )
    _fit_x(ax, sub["expert_memory_gb"])
    _fit_y0(ax, sub["tokens_per_s"])
    ax.grid(alpha=0.3)
    keys = []
    for i, (_, r) in enumerate(front.iterrows(), 1):
        fid = r.get("gate_mass_preserved")
        approx = fid is not None and fid == fid and fid < EXACT_FIDELITY
        keys.append(
            f"{i} = {_point(r)} on {r['hw']}: {r['expert_memory_gb']:.3g} GB, "
            f"{r['tokens_per_s']:.4g} tokens/s" + (f", fidelity {fid:.3f}" if approx else "")
        )
    _legend(fig, [ax])
    _note_under(
        ax, [*(["Pareto front: " + "; ".join(keys)] if keys else []), *missing_points(rows)]
    )
    _finish(fig, 5.0)  # the final size first: the labels are placed in display space
    place_labels(
        ax,
        front["expert_memory_gb"].tolist(),
        front["tokens_per_s"].tolist(),
        [str(i) for i in range(1, len(front) + 1)],
    )
    return fig
