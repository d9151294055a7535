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
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from daopsim.simulator.colors import policy_color
from daopsim.simulator.errors import UserError
from daopsim.simulator.output import write_figure

#: The plot kinds of ``daopsim plot --kind``.
KINDS = ("throughput", "hit-rate", "breakdown", "heatmap", "pareto", "latency-load")
ALL_GPU = "all-gpu"
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
_STYLES = ["-", "-.", (0, (5, 1)), (0, (1, 1))]
#: z-order of bounds (under) and of policies (over): a policy on a bound stays visible
_Z_BOUND, _Z_POLICY = 1.5, 3.0
#: Above this many times the best run, the all-GPU bound is a note, not a line.
FAR_ABOVE = 1.6
#: Characters per line of the notes under a panel.
_NOTE_CHARS = 62


def _title(fig: Any, text: str, note: str | None = None) -> None:
    """A figure title wrapped to the figure's width (never cut off), an optional smaller note."""
    width_chars = max(30, int(fig.get_figwidth() * 9))
    lines = textwrap.wrap(text, width_chars)
    if note:
        lines += textwrap.wrap(note, width_chars)
    fig.suptitle("\n".join(lines), fontsize=11 if len(lines) == 1 else 10)


def _mpl() -> Any:
    # the backend is the caller's choice (inline in Jupyter; the CLI picks Agg)
    import matplotlib.pyplot as plt

    return plt


def _table(df: pd.DataFrame | str | os.PathLike[str]) -> pd.DataFrame:
    if isinstance(df, pd.DataFrame):
        return df
    from daopsim.simulator.sweep_table import read_table

    return read_table(df)


def _trace_rows(
    df: pd.DataFrame | str | os.PathLike[str], trace: str | None
) -> tuple[pd.DataFrame, str]:
    """Every row of one trace (default: the table's first), labelled, and the trace's name."""
    df = _table(df)
    if df.empty:
        raise UserError("the results table is empty")
    traces = list(dict.fromkeys(df["trace"].astype(str)))
    if trace is None:
        trace = traces[0]
    elif trace not in traces:
        raise UserError(f"trace {trace!r} is not in the results (have: {', '.join(traces)})")
    rows = df[df["trace"].astype(str) == trace].copy()
    rows["label"] = _labels(rows)
    return rows, trace


def select(
    df: pd.DataFrame | str | os.PathLike[str], trace: str | None = None
) -> tuple[pd.DataFrame, str]:
    """The successful rows of one trace (default: the table's first trace) and its name."""
    rows, trace = _trace_rows(df, trace)
    sub = rows[rows["status"] == "ok"]
    if sub.empty:
        raise UserError(f"no successful runs for trace {trace!r} in the results")
    return sub, trace


def _labels(df: pd.DataFrame) -> pd.Series:
    """Policy name, plus the option values that vary within that policy in this table."""
    opt_cols = [c for c in df.columns if c.startswith("opt.")]
    labels = df["policy"].astype(str).copy()
    for pol, grp in df.groupby("policy", sort=False):
        varying = [c for c in opt_cols if grp[c].astype(str).nunique(dropna=False) > 1]
        if not varying:
            continue
        for idx, row in grp.iterrows():
            parts = [f"{c[4:]}={row[c]}" for c in varying]
            labels[idx] = f"{pol} ({', '.join(parts)})"
    return labels


def _name(trace: str) -> str:
    """A trace for titles: its file name when it is a path."""
    return Path(trace).name if ("/" in trace or os.sep in trace) else trace


def _styles(rows: pd.DataFrame) -> dict[str, tuple[str, Any, str]]:
    """Colour, line style and marker per label: the policy's colour; variants of one policy
    (different options) differ in line style and marker."""
    out: dict[str, tuple[str, Any, str]] = {}
    for pol, grp in rows.groupby("policy", sort=True):
        for i, label in enumerate(sorted(set(grp["label"].astype(str)))):
            out[label] = (
                policy_color(str(pol)),
                _STYLES[i % len(_STYLES)],
                _MARKERS[i % len(_MARKERS)],
            )
    return out


def _is_bound(df: pd.DataFrame) -> pd.Series:
    if "bound" not in df:  # an older experiment table: bounds by name
        return df["policy"].isin([ALL_GPU, "belady"])
    return df["bound"].fillna(False).astype(bool)


def realisable(df: pd.DataFrame) -> pd.DataFrame:
    """Successful runs of realisable policies (no bounds such as all-gpu or belady)."""
    return df[(df["status"] == "ok") & ~_is_bound(df)]


def _model(df: pd.DataFrame) -> str:
    """`` (model)`` for a title: the models of the rows that name one (none: "")."""
    models = [str(m) for m in dict.fromkeys(df.get("model", pd.Series(dtype=str)).dropna())]
    return f" ({', '.join(models)})" if models else ""


def _panels(plt: Any, n: int, width: float = 5.2, height: float = 3.8) -> tuple[Any, list[Any]]:
    fig, axes = plt.subplots(
        1, max(1, n), figsize=(width * max(1, n) + 0.6, height), squeeze=False, layout="constrained"
    )
    return fig, list(axes[0])


# --- what is not drawn ------------------------------------------------------------------------


def _point(row: pd.Series) -> str:
    """A row as ``label @ ratio`` (``@ max``: as many experts as fit)."""
    ratio = row.get("cache_ratio")
    at = "max" if ratio is None or ratio != ratio else f"{float(ratio):.3g}"
    return f"{row['label']} @ {at}"


def missing_points(rows: pd.DataFrame) -> list[str]:
    """One line per kind of row that is not drawn: the skipped points (the budget does not fit)
    and each failed point with its error."""
    lines: list[str] = []
    skipped = rows[rows["status"] == "skipped"]
    why = skipped.get("error", pd.Series(index=skipped.index, dtype=object))
    for reason, grp in skipped.groupby(why.fillna("does not fit").astype(str), sort=True):
        pts = ", ".join(dict.fromkeys(_point(r) for _, r in grp.iterrows()))
        lines.append(f"skipped, {reason}: {pts}")
    failed = rows[~rows["status"].isin(["ok", "skipped"])]
    for _, r in failed.iterrows():
        err = str(r.get("error") or r["status"])
        lines.append(f"failed: {_point(r)}: {err}")
    return lines


def _note_under(ax: Any, lines: list[str]) -> None:
    """Notes under a panel (below its x label), wrapped to the panel; in the layout."""
    if not lines:
        return
    text = "\n".join(
        textwrap.fill(ln, _NOTE_CHARS, subsequent_indent="  ", break_on_hyphens=False)
        for ln in lines
    )
    fig = ax.figure
    fig._daopsim_note_lines = max(getattr(fig, "_daopsim_note_lines", 0), text.count("\n") + 1)
    ax.annotate(
        text,
        xy=(0.0, 0.0),
        # left edge of the axes, just under the x label (the tick labels may hang lower)
        xycoords=("axes fraction", ax.xaxis.label),
        xytext=(0, -4),
        textcoords="offset points",
        ha="left",
        va="top",
        fontsize=7,
        color="0.25",
    )


def _empty(ax: Any, what: str, rows: pd.DataFrame) -> None:
    """A panel with nothing to draw: why, in its middle, and no meaningless axes."""
    lines = missing_points(rows) or ["no rows"]
    text = f"nothing to draw ({what}):\n" + "\n".join(
        textwrap.fill(ln, 48, subsequent_indent="  ", break_on_hyphens=False) for ln in lines
    )
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=8, transform=ax.transAxes, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_color("0.8")


# --- axes -------------------------------------------------------------------------------------


def fit_axis(values: Any, floor: float | None = 0.0) -> tuple[float, float] | None:
    """Limits around ``values`` that read: a margin of 6 % of the span, and at least +-50 % of
    the value (or 0.5) when the values are (nearly) one number, so a single point does not sit
    on an axis a few thousandths wide. Never below ``floor``. None without a finite value."""
    arr = np.asarray(pd.to_numeric(pd.Series(values), errors="coerce"), dtype=float)
    arr = arr[np.isfinite(arr)]
    if arr.size == 0:
        return None
    lo, hi = float(arr.min()), float(arr.max())
    span = hi - lo
    scale = max(abs(hi), abs(lo))
    pad = 0.06 * span
    if span < 0.2 * scale or span == 0:
        pad = max(pad, 0.5 * scale if scale > 0 else 0.5)
    low, high = lo - pad, hi + pad
    if floor is not None:
        low = max(floor, low)
    return low, high


def _fit_x(ax: Any, values: Any) -> None:
    lim = fit_axis(values)
    if lim is not None:
        ax.set_xlim(*lim)


def _fit_y0(ax: Any, values: Any, extra: float | None = None) -> None:
    """A y axis from 0 to a little above the data (and ``extra``, a line to show)."""
    arr = np.asarray(pd.to_numeric(pd.Series(values), errors="coerce"), dtype=float)
    arr = arr[np.isfinite(arr)]
    top = float(arr.max()) if arr.size else 0.0
    if extra is not None and math.isfinite(extra):
        top = max(top, extra)
    ax.set_ylim(0, top * 1.12 if top > 0 else 1.0)


def _legend(fig: Any, axes: list[Any]) -> None:
    """One legend for the figure, under the panels: never over the data."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if not lab.startswith("_"):
                seen.setdefault(lab, h)
    if not seen:
        return
    longest = max(len(lab) for lab in seen)
    ncol = max(1, min(len(seen), int(fig.get_figwidth() * 72 / (6 * longest + 40))))
    fig.legend(
        list(seen.values()), list(seen.keys()), loc="outside lower center", ncol=ncol, fontsize=8
    )
    fig._daopsim_legend_rows = math.ceil(len(seen) / ncol)


def _finish(fig: Any, height: float) -> Any:
    """Grow the figure by what the notes, the legend and the title take, so the panels keep
    ``height`` inches (constrained layout would shrink them instead)."""
    notes = getattr(fig, "_daopsim_note_lines", 0)
    legend = getattr(fig, "_daopsim_legend_rows", 0)
    title = fig._suptitle.get_text().count("\n") + 1 if fig._suptitle is not None else 0
    fig.set_figheight(height + 0.12 * notes + 0.24 * legend + 0.2 * title)
    return fig


# --- lines and bounds -------------------------------------------------------------------------


def _policy_lines(ax: Any, rows: pd.DataFrame, metric: str) -> None:
    """One line per policy label: ``metric`` averaged per cache ratio; a bound is dashed and
    drawn under the policies (a policy that reaches it stays visible).

    Each policy keeps its colour (``policy_color``). With several seeds the line is the mean
    over seeds and a bar spans +- one standard deviation (sample, ddof=1) at each point.
    """
    styles = _styles(rows)
    for label, grp in rows.groupby("label", sort=False):
        agg = grp.groupby("cache_ratio")[metric].agg(["mean", "std"]).sort_index()
        dashed = bool(_is_bound(grp).all())
        color, style, marker = styles[str(label)]
        ax.plot(
            agg.index,
            agg["mean"].values,
            marker=marker,
            ls="--" if dashed else style,
            lw=1.2 if dashed else 1.6,
            ms=4 if dashed else 6,
            color=color,
            zorder=_Z_BOUND if dashed else _Z_POLICY,
            label=(f"{label} (bound)" if dashed else str(label)) + fidelity_note(grp),
        )
        if metric == "tokens_per_s":
            _ring_approximate(ax, grp, "cache_ratio", metric, color)
        if "seed" in grp and grp["seed"].nunique() > 1:
            ax.errorbar(
                agg.index,
                agg["mean"].values,
                yerr=agg["std"].fillna(0).values,
                fmt="none",
                ecolor=color,
                capsize=3,
                zorder=_Z_POLICY,
            )


#: Below this ``gate_mass_preserved`` a run is marked as approximate (it changed the routing).
EXACT_FIDELITY = 0.9995


def fidelity_note(rows: pd.DataFrame) -> str:
    """`` (fidelity 0.937)`` when the rows' mean routing fidelity is below exact, else ``""``."""
    if "gate_mass_preserved" not in rows or rows["gate_mass_preserved"].isna().all():
        return ""
    fid = float(rows["gate_mass_preserved"].mean())
    return f" (fidelity {fid:.3f})" if fid < EXACT_FIDELITY else ""


def any_approximate(rows: pd.DataFrame) -> bool:
    """True when some row changed the routing (fidelity below 1)."""
    if "gate_mass_preserved" not in rows:
        return False
    return bool((rows["gate_mass_preserved"] < EXACT_FIDELITY).any())


def _ring_approximate(ax: Any, rows: pd.DataFrame, x: str, y: str, color: str) -> None:
    """A hollow ring around each point whose routing was approximate (fidelity below 1)."""
    if "gate_mass_preserved" not in rows:
        return
    approx = rows[rows["gate_mass_preserved"] < EXACT_FIDELITY]
    if len(approx):
        ax.scatter(
            approx[x],
            approx[y],
            s=160,
            facecolors="none",
            edgecolors=color,
            linewidths=1.2,
            zorder=_Z_POLICY,
        )


def panel_bound(rows: pd.DataFrame, hw: str, trace: str, compute: bool) -> tuple[float, str] | None:
    """The all-GPU bound of one machine's rows and how it ran (``runtime R``): the table's
    ``bound_tokens_per_s`` (each row's bound at its precisions; the panel takes the largest),
    else computed the same way from the rows (when ``compute``), else the table's all-gpu rows
    (which ran on one runtime only: labelled as such, not as the bound)."""
    own = rows[(rows["hw"] == hw) & (rows["status"] == "ok")]
    if "bound_tokens_per_s" in own and own["bound_tokens_per_s"].notna().any():
        best = own.loc[own["bound_tokens_per_s"].idxmax()]
        rt = best.get("bound_runtime")
        return float(best["bound_tokens_per_s"]), f"all-GPU bound (runtime {rt})"
    if compute and len(own):
        got = _compute_bound(own, hw, trace)
        if got is not None:
            return got
    ag = own[own["policy"] == ALL_GPU]
    if len(ag):
        rt = ag["runtime"].iloc[0] if "runtime" in ag else None
        return float(ag["tokens_per_s"].mean()), f"all-gpu run (runtime {rt or 'ideal'})"
    return None


def _compute_bound(rows: pd.DataFrame, hw: str, trace: str) -> tuple[float, str] | None:
    """The all-GPU bound of a table without the bound column (an older sweep)."""
    from daopsim.simulator.bounds import all_gpu_bound

    best: tuple[float, str] | None = None
    keys = {}
    for _, r in rows.iterrows():
        ids = r.get("sequence_ids")
        if not isinstance(ids, str) or not ids:
            return None
        dtype = r.get("dtype") if isinstance(r.get("dtype"), str) else None
        rt = r.get("runtime") if isinstance(r.get("runtime"), str) else "ideal"
        keys[(ids, dtype, rt)] = None
    for ids, dtype, rt in keys:
        try:
            b = all_gpu_bound(hw, trace, [int(x) for x in ids.split(",")], rt, dtype=dtype)
        except Exception:  # the trace or profile may not be available where the plot is drawn
            return None
        if best is None or b.tokens_per_s > best[0]:
            best = (b.tokens_per_s, f"all-GPU bound (runtime {b.runtime})")
    return best


def _all_gpu_bound(ax: Any, bound: float, label: str, rows: pd.DataFrame) -> str | None:
    """The all-GPU bound as a dotted line under the policies when it is near them; far above
    them (a line would squash every policy into the bottom strip) a note (returned) instead."""
    top = float(rows["tokens_per_s"].max()) if len(rows) else float("nan")
    if not np.isfinite(top) or bound <= FAR_ABOVE * top:
        ax.axhline(bound, color="black", ls=":", lw=1.5, label=label, zorder=_Z_BOUND)
        return None
    return (
        f"{label}: {bound:,.4g} tokens/s, {bound / top:.1f}x the best run shown "
        "(off the scale; docs/metrics.md, Bounds)"
    )


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
    "KINDS",
    "breakdown_table",
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
