"""Plots of a sweep table (``daopsim.simulator.sweep``): throughput, hit rate, latency breakdown,
per-layer hit-rate heatmap, the GPU-memory vs throughput Pareto front, latency against load.

Each ``plot_*`` function takes the table (a DataFrame or a Parquet/CSV path), draws the rows of
one trace (the first one in the table unless ``trace`` is given) and returns a matplotlib Figure;
``save_figure`` writes it atomically (PNG, PDF or SVG by the suffix). The table may be a sweep's
or an experiment's (results.parquet).

What a figure shows, and says:

- Rows with status "ok" are drawn; repeated configurations (several seeds) are averaged. The
  rows that are not drawn (status "skipped": the budget does not fit; "error": the run failed)
  are named under their panel with the reason, and a panel with nothing to draw says why in
  its middle instead of being left empty.
- Every policy has one colour in every plot (``policy_color``); bounds are black and drawn
  under the policies (``belady`` dashed, the all-GPU bound dotted), so a policy that reaches a
  bound stays visible on top of it.
- The all-GPU bound is the table's ``bound_tokens_per_s`` (the fastest all-GPU run at the rows'
  precisions, docs/metrics.md "Bounds"), or computed the same way for an older table; when it is
  so far above the policies that a line would squash them, it is a note under the panel.
- Axes fit the data (a single cache ratio gets a readable range around it, throughput starts
  at 0), every axis names its unit, and legends and labels sit outside the data area: one
  legend under the panels, Pareto-front points numbered beside their marker (placed where they
  overlap nothing) with the numbers explained under the axes.

This module is the figure kinds (``plot_*``, :func:`plot`, :func:`save_figure`) and the public
names of its parts: ``plots_common`` (what every figure shares: the rows it draws, each
policy's style, panels, axes, legend, the notes, the bounds) and ``plots_pareto`` (the Pareto
front and its labels).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from daopsim.simulator.colors import policy_color
from daopsim.simulator.errors import UserError
from daopsim.simulator.output import write_figure
from daopsim.simulator.plots_common import (
    _Z_POLICY,
    ALL_GPU,
    EXACT_FIDELITY,
    FAR_ABOVE,
    KINDS,
    _all_gpu_bound,
    _empty,
    _finish,
    _fit_x,
    _fit_y0,
    _legend,
    _model,
    _mpl,
    _name,
    _note_under,
    _panels,
    _policy_lines,
    _styles,
    _table,
    _title,
    _trace_rows,
    any_approximate,
    fidelity_note,
    fit_axis,
    missing_points,
    panel_bound,
    realisable,
    select,
)
from daopsim.simulator.plots_pareto import pareto_front, place_labels, plot_pareto


def plot_throughput(
    df: pd.DataFrame | str | os.PathLike[str],
    trace: str | None = None,
    compute_bound: bool = True,
) -> Any:
    """Tokens/s against cache ratio, one line per policy, one panel per machine.

    The all-GPU bound is a dotted line (:func:`panel_bound`: the table's bound column, else
    computed from the rows when ``compute_bound``, else the table's all-gpu rows).
    """
    plt = _mpl()
    rows, trace = _trace_rows(df, trace)
    hws = list(dict.fromkeys(rows["hw"]))
    fig, axes = _panels(plt, len(hws))
    for ax, hw in zip(axes, hws, strict=True):
        mine = rows[rows["hw"] == hw]
        ok = mine[(mine["status"] == "ok") & (mine["policy"] != ALL_GPU)]
        ax.set_title(f"{hw}")
        ax.set_xlabel("cache ratio (resident experts / all experts)")
        ax.set_ylabel("throughput (tokens/s, simulated)")
        if ok.empty:
            _empty(ax, "no finished run", mine)
            continue
        _policy_lines(ax, ok, "tokens_per_s")
        notes = missing_points(mine)
        bound = panel_bound(rows, hw, trace, compute_bound)
        drawn = None
        if bound is not None:
            note = _all_gpu_bound(ax, bound[0], bound[1], ok)
            if note:
                notes.append(note)
            else:
                drawn = bound[0]
        _fit_x(ax, ok["cache_ratio"])
        _fit_y0(ax, ok["tokens_per_s"], drawn)
        ax.grid(alpha=0.3)
        _note_under(ax, notes)
    _legend(fig, axes)
    _title(
        fig,
        f"Throughput vs expert cache size: trace {_name(trace)}{_model(rows)}",
        "ringed points: approximate routing (gate mass preserved < 1)"
        if any_approximate(rows[rows["status"] == "ok"])
        else None,
    )
    return _finish(fig, 3.8)


def plot_hit_rate(df: pd.DataFrame | str | os.PathLike[str], trace: str | None = None) -> Any:
    """Decode hit rate against cache ratio, one line per policy; belady dashed as the bound."""
    plt = _mpl()
    rows, trace = _trace_rows(df, trace)
    rows = rows[rows["policy"] != ALL_GPU]
    if rows.empty:
        raise UserError(f"no runs with a memory budget for trace {_name(trace)!r}")
    hws = list(dict.fromkeys(rows["hw"]))
    fig, axes = _panels(plt, len(hws))
    has_belady = bool((rows["policy"] == "belady").any())
    for ax, hw in zip(axes, hws, strict=True):
        mine = rows[rows["hw"] == hw]
        ok = mine[mine["status"] == "ok"]
        ax.set_title(hw)
        ax.set_xlabel("cache ratio (resident experts / all experts)")
        ax.set_ylabel("expert hit rate, decode (share of accesses)")
        if ok.empty:
            _empty(ax, "no finished run", mine)
            continue
        _policy_lines(ax, ok, "hit_rate")
        _fit_x(ax, ok["cache_ratio"])
        ax.set_ylim(0, 1.04)
        ax.grid(alpha=0.3)
        _note_under(ax, missing_points(mine))
    _legend(fig, axes)
    note = None if has_belady else "(the belady bound is not in this sweep)"
    _title(fig, f"Expert-cache hit rate: trace {_name(trace)}{_model(rows)}", note)
    return _finish(fig, 3.8)


#: (label, colour, function of a row -> seconds) for the stacked latency breakdown.
BREAKDOWN = (
    ("GPU compute", "#2f6fb0", lambda r: r["gpu_expert_s"] + r["gpu_nonexpert_s"]),
    ("CPU wait", "#16a085", lambda r: r["cpu_wait_s"]),
    ("transfer stall", "#d9822b", lambda r: r["transfer_stall_s"]),
    (
        "other",
        "#9aa5b1",
        lambda r: (
            r["e2e_s"]
            - r["gpu_expert_s"]
            - r["gpu_nonexpert_s"]
            - r["cpu_wait_s"]
            - r["transfer_stall_s"]
        ).clip(lower=0),
    ),
)


def breakdown_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per row, the breakdown components in milliseconds per generated token."""
    per_tok = 1e3 / df["decode_tokens"].where(df["decode_tokens"] > 0)
    out = pd.DataFrame(index=df.index)
    for name, _, fn in BREAKDOWN:
        out[name] = fn(df) * per_tok
    return out


def plot_breakdown(
    df: pd.DataFrame | str | os.PathLike[str],
    trace: str | None = None,
    cache_ratio: float | None = None,
) -> Any:
    """Stacked bars per policy (and cache ratio): GPU compute, CPU wait, transfer stall, other,
    in ms per generated token; one panel per machine."""
    plt = _mpl()
    rows, trace = _trace_rows(df, trace)
    if cache_ratio is not None:
        keep = np.isclose(rows["cache_ratio"].astype(float), cache_ratio) | (
            rows["policy"] == ALL_GPU
        )
        rows = rows[keep]
        if rows.empty:
            raise UserError(f"no runs at cache ratio {cache_ratio} for {trace!r}")
    hws = list(dict.fromkeys(rows["hw"]))
    ok_all = rows[rows["status"] == "ok"]
    n_bars = max(
        [
            len(ok_all[ok_all["hw"] == h].groupby(["label", "cache_ratio"], dropna=False))
            for h in hws
        ]
    )
    fig, axes = _panels(plt, len(hws), width=max(5.2, 0.55 * n_bars + 1.5), height=4.6)
    for ax, hw in zip(axes, hws, strict=True):
        mine = rows[rows["hw"] == hw]
        ok = mine[mine["status"] == "ok"]
        ax.set_title(hw)
        ax.set_xlabel("policy @ cache ratio (resident experts / all experts)")
        ax.set_ylabel("latency (ms per generated token)")
        if ok.empty:
            _empty(ax, "no finished run", mine)
            continue
        parts = breakdown_table(ok)
        parts["label"], parts["cache_ratio"] = ok["label"], ok["cache_ratio"]
        agg = parts.groupby(["label", "cache_ratio"], sort=False, dropna=False).mean()
        agg = agg.sort_index(level=1, sort_remaining=False, kind="stable")
        x = np.arange(len(agg))
        bottom = np.zeros(len(agg))
        for name, color, _ in BREAKDOWN:
            vals = agg[name].to_numpy(dtype=float)
            ax.bar(x, vals, bottom=bottom, color=color, label=name, width=0.7)
            bottom += np.nan_to_num(vals)
        ticks = [
            f"{lab} @ {'all' if lab.startswith(ALL_GPU) or r != r else f'{r:.3g}'}"
            for lab, r in agg.index
        ]
        ax.set_xticks(x, ticks, fontsize=7, rotation=40, ha="right", rotation_mode="anchor")
        ax.set_xlim(-0.6, len(agg) - 0.4)
        _fit_y0(ax, bottom)
        ax.grid(alpha=0.3, axis="y")
        _note_under(ax, missing_points(mine))
    _legend(fig, axes)
    _title(fig, f"Where the time goes: trace {_name(trace)}{_model(rows)}")
    return _finish(fig, 4.6)


def plot_heatmap(
    df: pd.DataFrame | str | os.PathLike[str],
    trace: str | None = None,
    hw: str | None = None,
) -> Any:
    """Per-layer decode hit rate: one row per policy and cache ratio, one column per MoE layer."""
    plt = _mpl()
    rows, trace = _trace_rows(df, trace)
    rows = rows[rows["policy"] != ALL_GPU]
    hws = list(dict.fromkeys(rows["hw"]))
    if hw is not None:
        if hw not in hws:
            raise UserError(f"machine {hw!r} is not in the results for {trace!r}")
        hws = [hw]
    if not hws:
        raise UserError(f"no runs with a memory budget for trace {_name(trace)!r}")
    mats: list[np.ndarray | None] = []
    rows_lab: list[list[str]] = []
    for h in hws:
        ok = rows[(rows["hw"] == h) & (rows["status"] == "ok")]
        ok = ok[ok["per_layer_hit_rate"].notna()]
        ok = ok.sort_values(["label", "cache_ratio"], kind="stable")
        rates: dict[tuple[str, float], list[np.ndarray]] = {}
        for _, r in ok.iterrows():
            key = (str(r["label"]), float(r["cache_ratio"]))
            rates.setdefault(key, []).append(np.asarray(r["per_layer_hit_rate"], dtype=float))
        mats.append(np.array([np.mean(v, axis=0) for v in rates.values()]) if rates else None)
        rows_lab.append([f"{lab} @ {ratio:.3g}" for lab, ratio in rates])
    n_rows = max([m.shape[0] for m in mats if m is not None] or [1])
    fig, axes = _panels(plt, len(hws), width=5.6, height=max(3.0, 0.32 * n_rows + 1.8))
    im = None
    for ax, h, mat, labels in zip(axes, hws, mats, rows_lab, strict=True):
        ax.set_title(h)
        ax.set_xlabel("MoE layer (index)")
        mine = rows[rows["hw"] == h]
        if mat is None:
            _empty(ax, "no finished run with per-layer hit rates", mine)
            continue
        im = ax.imshow(mat, aspect="auto", vmin=0, vmax=1, cmap="viridis", interpolation="none")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        step = max(1, mat.shape[1] // 16)
        ax.set_xticks(range(0, mat.shape[1], step))
        _note_under(ax, missing_points(mine))
    if im is not None:
        fig.colorbar(im, ax=axes, label="decode hit rate (share of accesses)")
    _title(fig, f"Per-layer expert hit rate: trace {_name(trace)}{_model(rows)}")
    return _finish(fig, max(3.0, 0.32 * n_rows + 1.8))


def plot_latency_load(
    df: pd.DataFrame | str | os.PathLike[str], trace: str | None = None, percentile: int = 90
) -> Any:
    """Per-request latency against load (a sweep with an ``arrival_rate`` axis): time to first
    token, time per output token and goodput against the arrival rate, one line per policy
    (and machine, when the table has several)."""
    plt = _mpl()
    rows, trace = _trace_rows(df, trace)
    rows = rows[rows["arrival_rate"].notna()].copy()
    if rows.empty:
        raise UserError("latency-load needs serving rows (a sweep with --arrival-rates)")
    if rows["hw"].nunique() > 1:
        rows["label"] = rows["label"] + " on " + rows["hw"].astype(str)
    sub = rows[rows["status"] == "ok"]
    styles = _styles(sub)
    panels = (
        (f"ttft_p{percentile}_s", f"time to first token p{percentile} (s, simulated)"),
        (f"req_tpot_p{percentile}_s", f"time per output token p{percentile} (s, simulated)"),
        ("goodput_requests_per_s", "goodput (requests/s meeting the SLOs)"),
    )
    fig, axes = _panels(plt, len(panels), width=4.6)
    for ax, (metric, ylabel) in zip(axes, panels, strict=True):
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(ylabel)
        if sub.empty:
            _empty(ax, "no finished run", rows)
            continue
        for label, grp in sub.groupby("label", sort=False):
            agg = grp.groupby("arrival_rate")[metric].mean().sort_index()
            color, style, marker = styles[str(label)]
            ax.plot(
                agg.index,
                agg.values,
                marker=marker,
                ls=style,
                color=color,
                label=label,
                zorder=_Z_POLICY,
            )
        _fit_x(ax, sub["arrival_rate"])
        _fit_y0(ax, sub[metric])
        ax.grid(alpha=0.3)
    _note_under(axes[0], missing_points(rows.assign(cache_ratio=rows["arrival_rate"])))
    _legend(fig, axes)
    _title(fig, f"Latency vs load: trace {_name(trace)}{_model(rows)}")
    return _finish(fig, 3.8)


_PLOTTERS: dict[str, Callable[..., Any]] = {
    "throughput": plot_throughput,
    "hit-rate": plot_hit_rate,
    "breakdown": plot_breakdown,
    "heatmap": plot_heatmap,
    "pareto": plot_pareto,
    "latency-load": plot_latency_load,
}


def plot(df: pd.DataFrame | str | os.PathLike[str], kind: str, **kwargs: Any) -> Any:
    """Draw one plot kind (see ``KINDS``); extra keyword arguments go to that plot function."""
    if kind not in _PLOTTERS:
        raise UserError(f"unknown plot kind {kind!r} (valid: {', '.join(KINDS)})")
    df = _table(df)
    missing = [c for c in _NEEDS.get(kind, ()) if c not in df]
    if missing:
        raise UserError(
            f"plot kind {kind!r} needs column {missing[0]!r}, which this results table does not "
            "have (an experiment table has throughput and hit rate; a sweep table has all)"
        )
    rows, trace = _trace_rows(df, kwargs.get("trace"))
    if not (rows["status"] == "ok").any():
        # a figure of empty panels is no result: say what the rows are instead
        counts = rows["status"].astype(str).value_counts()
        have = ", ".join(f"{n} {status}" for status, n in counts.items())
        reasons = [str(e) for e in rows.get("error", pd.Series(dtype=object)) if e and e == e]
        why = f"; first: {' '.join(reasons[0].split())}" if reasons else ""
        raise UserError(f"no successful runs for trace {trace!r} in the results ({have}{why}); "
                        "nothing to draw")  # fmt: skip
    return _PLOTTERS[kind](df, **kwargs)


#: Columns a plot kind needs beyond the basic ones every results table has.
_NEEDS = {
    "hit-rate": ("hit_rate", "cache_ratio"),
    "throughput": ("cache_ratio",),
    "breakdown": ("gpu_expert_s", "gpu_nonexpert_s", "cpu_wait_s", "transfer_stall_s", "e2e_s"),
    "heatmap": ("per_layer_hit_rate",),
    "pareto": ("expert_memory_gb",),
    "latency-load": ("arrival_rate", "ttft_p90_s", "req_tpot_p90_s", "goodput_requests_per_s"),
}


def save_figure(fig: Any, path: str | os.PathLike[str], dpi: int = 120) -> Path:
    """Write a figure atomically (PNG, PDF or SVG by the suffix) and close it."""
    return write_figure(fig, path, dpi)


__all__ = [
    "ALL_GPU",
    "BREAKDOWN",
    "EXACT_FIDELITY",
    "FAR_ABOVE",
    "KINDS",
    "any_approximate",
    "breakdown_table",
    "fidelity_note",
    "fit_axis",
    "missing_points",
    "panel_bound",
    "pareto_front",
    "place_labels",
    "plot",
    "plot_breakdown",
    "plot_heatmap",
    "plot_hit_rate",
    "plot_latency_load",
    "plot_pareto",
    "plot_throughput",
    "policy_color",
    "realisable",
    "save_figure",
    "select",
]
