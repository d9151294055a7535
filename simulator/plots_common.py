"""What every plot of a sweep table shares: the rows of one trace it draws (averaged over seeds)
and those it names as not drawn, each policy's colour, marker and line style, the panels, axes
that fit the data, one legend under the panels, notes under a panel, and the bounds (Belady,
the all-GPU bound, or a note when it is far above) with approximate rows ringed.
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from daopsim.simulator.colors import policy_color
from daopsim.simulator.errors import UserError

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
