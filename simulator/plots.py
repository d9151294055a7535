"""Plots of a sweep table (``simulator.sweep``): throughput, hit rate, latency breakdown,
per-layer hit-rate heatmap and the GPU-memory vs throughput Pareto front.

Each ``plot_*`` function takes the table (a DataFrame or a Parquet path), draws the rows of one
trace (the first one in the table unless ``trace`` is given) and returns a matplotlib Figure;
``save_figure`` writes it atomically (PNG, PDF or SVG by the suffix). Only rows with status
"ok" are drawn. Repeated configurations (several seeds) are averaged. Every policy has one
colour in every plot (``policy_color``). Bounds are black: ``belady`` (or any other
clairvoyant policy) a dashed curve, ``all-gpu`` a dotted line, or a note in the corner when it
is so far above the policies that a line would squash them into the bottom strip. The table
may be a sweep's or an experiment's (results.parquet), Parquet or CSV.
"""

from __future__ import annotations

import hashlib
import os
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from simulator.errors import UserError
from simulator.output import write_figure

#: The plot kinds of ``daopsim plot --kind``.
KINDS = ("throughput", "hit-rate", "breakdown", "heatmap", "pareto", "latency-load")
ALL_GPU = "all-gpu"
#: One colour per built-in policy, the same in every plot (bounds are black: belady dashed,
#: all-gpu dotted). Other policies get a colour from ``_EXTRA`` by a hash of their name, so a
#: plugin policy also keeps its colour from plot to plot.
POLICY_COLORS = {
    "daop": "#d62728",
    "fiddler": "#1f77b4",
    "lru": "#2ca02c",
    "lfu": "#ff7f0e",
    "mixtral-offloading": "#9467bd",
    "static": "#8c564b",
    "round-robin": "#e377c2",
    "stream-all": "#7f7f7f",
    "belady": "#000000",
    ALL_GPU: "#000000",
}
_EXTRA = ["#17becf", "#bcbd22", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2"]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
_STYLES = ["-", "-.", (0, (5, 1)), (0, (1, 1))]


def policy_color(policy: str) -> str:
    """The fixed colour of a policy in every daopsim plot."""
    if policy in POLICY_COLORS:
        return POLICY_COLORS[policy]
    digest = hashlib.sha256(policy.encode()).digest()
    return _EXTRA[digest[0] % len(_EXTRA)]


def _title(fig: Any, text: str, note: str | None = None) -> None:
    """A figure title wrapped to the figure's width (never cut off), an optional smaller note."""
    width_chars = max(30, int(fig.get_figwidth() * 9))
    lines = textwrap.wrap(text, width_chars)
    if note:
        lines.append(note)
    fig.suptitle("\n".join(lines), fontsize=11 if len(lines) == 1 else 10)


def _mpl() -> Any:
    # the backend is the caller's choice (inline in Jupyter; the CLI picks Agg)
    import matplotlib.pyplot as plt

    return plt


def _table(df: pd.DataFrame | str | os.PathLike[str]) -> pd.DataFrame:
    if isinstance(df, pd.DataFrame):
        return df
    from simulator.sweep import read_table

    return read_table(df)


def select(
    df: pd.DataFrame | str | os.PathLike[str], trace: str | None = None
) -> tuple[pd.DataFrame, str]:
    """The successful rows of one trace (default: the table's first trace) and its name."""
    df = _table(df)
    if df.empty:
        raise UserError("the results table is empty")
    traces = list(dict.fromkeys(df["trace"].astype(str)))
    if trace is None:
        trace = traces[0]
    elif trace not in traces:
        raise UserError(f"trace {trace!r} is not in the results (have: {', '.join(traces)})")
    sub = df[(df["trace"].astype(str) == trace) & (df["status"] == "ok")].copy()
    if sub.empty:
        raise UserError(f"no successful runs for trace {trace!r} in the results")
    sub["label"] = _labels(sub)
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
    models = [str(m) for m in dict.fromkeys(df.get("model", pd.Series(dtype=str)).dropna())]
    return ", ".join(models)


def _panels(
    plt: Any, n: int, width: float = 5.2, height: float = 3.8, layout: str | None = None
) -> tuple[Any, list[Any]]:
    fig, axes = plt.subplots(1, n, figsize=(width * n + 0.6, height), squeeze=False, layout=layout)
    return fig, list(axes[0])


def _all_gpu_rate(df_all: pd.DataFrame, hw: str, trace: str, compute: bool) -> float | None:
    """all-gpu tokens/s for one machine: from the table, else simulated now (if allowed)."""
    rows = df_all[(df_all["policy"] == ALL_GPU) & (df_all["hw"] == hw)]
    if len(rows):
        return float(rows["tokens_per_s"].mean())
    if not compute:
        return None
    from simulator.runner import simulate

    seqs = df_all.loc[df_all["hw"] == hw, "sequences"].dropna()
    try:
        r = simulate(
            ALL_GPU,
            hw,
            trace,
            sequences=int(seqs.iloc[0]) if len(seqs) else None,
            record=False,
        )
    except Exception:  # the trace or profile may not be available where the plot is drawn
        return None
    return float(r.metrics["tokens_per_s"])


def _policy_lines(ax: Any, rows: pd.DataFrame, metric: str) -> None:
    """One line per policy label: ``metric`` averaged per cache ratio; a bound is dashed.

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
            color=color,
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
        ax.scatter(approx[x], approx[y], s=160, facecolors="none", edgecolors=color, linewidths=1.2)


def _all_gpu_bound(ax: Any, bound: float, rows: pd.DataFrame) -> None:
    """The all-gpu throughput as a dotted line when it is near the policies; far above them
    (which would squash every policy into the bottom strip) as a note in the corner."""
    top = float(rows["tokens_per_s"].max()) if len(rows) else float("nan")
    if not np.isfinite(top) or bound <= 1.6 * top:
        ax.axhline(bound, color="black", ls=":", lw=1.5, label="all-gpu (bound)")
        ax.set_ylim(0, max(ax.get_ylim()[1], bound * 1.08))  # the line inside, not on the edge
        return
    ax.set_ylim(0, top * 1.25)
    ax.annotate(
        f"all-gpu bound: {bound:,.3g} tokens/s\n({bound / top:.1f}x the best run shown), "
        "off the scale",
        xy=(0.02, 0.97),
        xycoords="axes fraction",
        va="top",
        fontsize=8,
        bbox={"boxstyle": "round", "fc": "white", "ec": "0.6"},
    )


def plot_throughput(
    df: pd.DataFrame | str | os.PathLike[str],
    trace: str | None = None,
    compute_bound: bool = True,
) -> Any:
    """Tokens/s against cache ratio, one line per policy, one panel per machine.

    The all-gpu bound is a horizontal line: from an all-gpu row of the table, or simulated on
    the fly (same trace and sequence count) when the table has none and ``compute_bound``.
    """
    plt = _mpl()
    sub, trace = select(df, trace)
    hws = list(dict.fromkeys(sub["hw"]))
    fig, axes = _panels(plt, len(hws))
    for ax, hw in zip(axes, hws, strict=True):
        rows = sub[(sub["hw"] == hw) & (sub["policy"] != ALL_GPU)]
        _policy_lines(ax, rows, "tokens_per_s")
        ax.set_ylim(bottom=0)
        bound = _all_gpu_rate(sub, hw, trace, compute_bound)
        if bound is not None:
            _all_gpu_bound(ax, bound, rows)
        ax.set_title(f"{hw}")
        ax.set_xlabel("cache ratio (resident experts / all experts)")
        ax.set_ylabel("throughput (generated tokens/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    _title(
        fig,
        f"Throughput vs expert cache size: trace {_name(trace)} ({_model(sub)})",
        "ringed points: approximate routing (gate mass preserved < 1)"
        if any_approximate(sub)
        else None,
    )
    fig.tight_layout()
    return fig


def plot_hit_rate(df: pd.DataFrame | str | os.PathLike[str], trace: str | None = None) -> Any:
    """Decode hit rate against cache ratio, one line per policy; belady dashed as the bound."""
    plt = _mpl()
    sub, trace = select(df, trace)
    sub = sub[sub["policy"] != ALL_GPU]
    if sub.empty:
        raise UserError(f"no runs with a memory budget for trace {_name(trace)!r}")
    hws = list(dict.fromkeys(sub["hw"]))
    fig, axes = _panels(plt, len(hws))
    has_belady = bool((sub["policy"] == "belady").any())
    for ax, hw in zip(axes, hws, strict=True):
        rows = sub[sub["hw"] == hw]
        _policy_lines(ax, rows, "hit_rate")
        ax.set_title(hw)
        ax.set_xlabel("cache ratio (resident experts / all experts)")
        ax.set_ylabel("expert hit rate (decode)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    note = None if has_belady else "(the belady bound is not in this sweep)"
    _title(fig, f"Expert-cache hit rate: trace {_name(trace)} ({_model(sub)})", note)
    fig.tight_layout()
    return fig


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
    sub, trace = select(df, trace)
    if cache_ratio is not None:
        keep = np.isclose(sub["cache_ratio"].astype(float), cache_ratio) | (
            sub["policy"] == ALL_GPU
        )
        sub = sub[keep]
        if sub.empty:
            raise UserError(f"no successful runs at cache ratio {cache_ratio} for {trace!r}")
    hws = list(dict.fromkeys(sub["hw"]))
    n_bars = max(len(sub[sub["hw"] == h].groupby(["label", "cache_ratio"])) for h in hws)
    fig, axes = _panels(plt, len(hws), width=max(5.2, 0.55 * n_bars + 1.5), height=4.4)
    for ax, hw in zip(axes, hws, strict=True):
        rows = sub[sub["hw"] == hw]
        parts = breakdown_table(rows)
        parts["label"], parts["cache_ratio"] = rows["label"], rows["cache_ratio"]
        agg = parts.groupby(["label", "cache_ratio"], sort=False).mean()
        agg = agg.sort_index(level=1, sort_remaining=False, kind="stable")
        x = np.arange(len(agg))
        bottom = np.zeros(len(agg))
        for name, color, _ in BREAKDOWN:
            vals = agg[name].to_numpy(dtype=float)
            ax.bar(x, vals, bottom=bottom, color=color, label=name, width=0.7)
            bottom += np.nan_to_num(vals)
        ticks = [
            f"{lab} @ {'all' if lab.startswith(ALL_GPU) else f'{r:.3g}'}" for lab, r in agg.index
        ]
        ax.set_xticks(x, ticks, fontsize=7, rotation=40, ha="right", rotation_mode="anchor")
        ax.set_xlabel("policy / cache ratio")
        ax.set_ylabel("latency (ms per generated token)")
        ax.set_title(hw)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    _title(fig, f"Where the time goes: trace {_name(trace)} ({_model(sub)})")
    fig.tight_layout()
    return fig


def plot_heatmap(
    df: pd.DataFrame | str | os.PathLike[str],
    trace: str | None = None,
    hw: str | None = None,
) -> Any:
    """Per-layer decode hit rate: one row per policy and cache ratio, one column per MoE layer."""
    plt = _mpl()
    sub, trace = select(df, trace)
    sub = sub[(sub["policy"] != ALL_GPU) & sub["per_layer_hit_rate"].notna()]
    hws = list(dict.fromkeys(sub["hw"]))
    if hw is not None:
        if hw not in hws:
            raise UserError(f"machine {hw!r} is not in the results for {trace!r}")
        hws = [hw]
    if not hws:
        raise UserError(f"no per-layer hit rates for trace {_name(trace)!r}")
    mats, rows_lab = [], []
    for h in hws:
        rows = sub[sub["hw"] == h].sort_values(["label", "cache_ratio"], kind="stable")
        rates: dict[tuple[str, float], list[np.ndarray]] = {}
        for _, r in rows.iterrows():
            key = (str(r["label"]), float(r["cache_ratio"]))
            rates.setdefault(key, []).append(np.asarray(r["per_layer_hit_rate"], dtype=float))
        mats.append(np.array([np.mean(v, axis=0) for v in rates.values()]))
        rows_lab.append([f"{lab} @ {ratio:.3g}" for lab, ratio in rates])
    height = max(3.0, 0.32 * max(m.shape[0] for m in mats) + 1.6)
    fig, axes = _panels(plt, len(hws), width=5.6, height=height, layout="constrained")
    im = None
    for ax, h, mat, labels in zip(axes, hws, mats, rows_lab, strict=True):
        im = ax.imshow(mat, aspect="auto", vmin=0, vmax=1, cmap="viridis", interpolation="none")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        step = max(1, mat.shape[1] // 16)
        ax.set_xticks(range(0, mat.shape[1], step))
        ax.set_xlabel("MoE layer")
        ax.set_title(h)
    fig.colorbar(im, ax=axes, label="decode hit rate")
    _title(fig, f"Per-layer expert hit rate: trace {_name(trace)} ({_model(sub)})")
    return fig


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


def plot_pareto(df: pd.DataFrame | str | os.PathLike[str], trace: str | None = None) -> Any:
    """GPU memory for resident experts against tokens/s: every run, and the Pareto front."""
    plt = _mpl()
    sub, trace = select(df, trace)
    sub = sub[~_is_bound(sub)]
    if sub.empty:
        raise UserError(f"no realisable (non-bound) runs for trace {_name(trace)!r}")
    fig, ax = plt.subplots(figsize=(8.0, 5.0))
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
    )
    for _, r in front.iterrows():
        fid = r.get("gate_mass_preserved")
        approx = fid is not None and fid == fid and fid < EXACT_FIDELITY
        ax.annotate(
            f"{r['label']}, {r['hw']}" + (f", fidelity {fid:.3f}" if approx else ""),
            (r["expert_memory_gb"], r["tokens_per_s"]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=7,
        )
    ax.set_xlabel("GPU memory for resident experts (GB)")
    ax.set_ylabel("throughput (generated tokens/s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    ringed = "; ringed: approximate routing (gate mass preserved < 1)"
    title = f"Memory vs throughput: trace {_name(trace)} ({_model(sub)})"
    ax.set_title(textwrap.fill(title + (ringed if any_approximate(sub) else ""), 80))
    fig.tight_layout()
    return fig


def plot_latency_load(
    df: pd.DataFrame | str | os.PathLike[str], trace: str | None = None, percentile: int = 90
) -> Any:
    """Per-request latency against load (a sweep with an ``arrival_rate`` axis): time to first
    token, time per output token and goodput against the arrival rate, one line per policy
    (and machine, when the table has several)."""
    plt = _mpl()
    sub, trace = select(df, trace)
    sub = sub[sub["arrival_rate"].notna()].copy()
    if sub.empty:
        raise UserError("latency-load needs serving rows (a sweep with --arrival-rates)")
    if sub["hw"].nunique() > 1:
        sub["label"] = sub["label"] + " on " + sub["hw"].astype(str)
    styles = _styles(sub)
    panels = (
        (f"ttft_p{percentile}_s", f"time to first token p{percentile} (s)"),
        (f"req_tpot_p{percentile}_s", f"time per output token p{percentile} (s)"),
        ("goodput_requests_per_s", "goodput (requests/s meeting the SLOs)"),
    )
    fig, axes = _panels(plt, len(panels), width=4.6)
    for ax, (metric, ylabel) in zip(axes, panels, strict=True):
        for label, grp in sub.groupby("label", sort=False):
            agg = grp.groupby("arrival_rate")[metric].mean().sort_index()
            color, style, marker = styles[str(label)]
            ax.plot(agg.index, agg.values, marker=marker, ls=style, color=color, label=label)
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    _title(fig, f"Latency vs load: trace {_name(trace)} ({_model(sub)})")
    fig.tight_layout()
    return fig


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
    "pareto_front",
    "plot",
    "plot_breakdown",
    "plot_heatmap",
    "plot_hit_rate",
    "plot_pareto",
    "plot_throughput",
    "policy_color",
    "realisable",
    "save_figure",
    "select",
]
