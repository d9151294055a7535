"""The leaderboard: every built-in policy on one fixed grid, one table and two figures.

A leaderboard file (``kind = "leaderboard"``; the bundled one is experiments/leaderboard.toml)
names machines, models (a bundled trace, or a catalogue model whose synthetic trace is
generated into the cache folder) and, per model, memory budgets in resident experts per MoE
layer. :func:`run_leaderboard` runs every policy at every (model, machine, budget) point
through the sweep machinery (``daopsim.simulator.sweep.run_sweep``: process pool or Dask,
resumable, one store per model under ``runs``), and :func:`leaderboard_table` turns the sweep
rows into the leaderboard: each row's tokens/s relative to the best realisable policy with
exact routing at the same point (its *cell*), the routing fidelity beside it, the all-GPU and
Belady bounds as rows of their own. :func:`markdown` writes the table as Markdown (a pure
function of the table, so the committed Markdown can be checked against the committed
Parquet); the figures are :func:`heatmap_figure` (relative tokens/s per cell) and
:func:`pareto_figure` (score against routing fidelity), drawn with simulator/plots.py's
helpers. docs/leaderboard.md.
"""

from __future__ import annotations

import difflib
import math
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from daopsim.simulator.data import check_input_file, resolve_trace
from daopsim.simulator.errors import UserError
from daopsim.simulator.output import output_dir, safe_name, write_figure, write_file, write_text

#: Keys of a leaderboard file and of each ``[[models]]`` table.
LEADERBOARD_KEYS = ("name", "kind", "description", "hw", "sequences", "policies", "models")
MODEL_KEYS = ("trace", "model", "synth", "experts_per_layer", "sequences")
SYNTH_KEYS = ("sequences", "prompt_tokens", "output_tokens", "seed")
#: The files a leaderboard folder holds (swapped in as one set).
LEADERBOARD_FILES = {
    "parquet": "leaderboard.parquet",
    "markdown": "leaderboard.md",
    "heatmap": "relative.png",
    "pareto": "pareto.png",
}
#: Columns of the leaderboard table, in order.
COLUMNS = (
    "model",
    "trace",
    "hw",
    "budget",
    "experts_per_layer",
    "gpu_experts",
    "policy",
    "bound",
    "status",
    "error",
    "tokens_per_s",
    "relative",
    "best",
    "gate_mass_preserved",
    "hit_rate",
    "decode_tokens_per_s",
    "ttft_s",
    "bound_tokens_per_s",
    "runtime",
    "sequences",
)
#: Columns of the table that hold numbers (float64; missing: NaN).
FLOAT_COLUMNS = (
    "tokens_per_s",
    "relative",
    "gate_mass_preserved",
    "hit_rate",
    "decode_tokens_per_s",
    "ttft_s",
    "bound_tokens_per_s",
    "experts_per_layer",
)
#: Routing fidelity at or above which a run counts as exact (plots.EXACT_FIDELITY).
EXACT = 0.9995


@dataclass(frozen=True)
class ModelEntry:
    """One model of the grid: its trace (bundled or a path) or a generated one, its budgets."""

    label: str
    experts_per_layer: tuple[float, ...]
    trace: str | None = None
    synth: tuple[tuple[str, Any], ...] | None = None
    #: evaluation sequences per run (None: the leaderboard's)
    sequences: int | None = None

    def trace_label(self) -> str:
        """The trace as the table names it: a bundled name or path as given, or what a
        generated trace is (its file name is a cache key)."""
        if self.trace is not None:
            return self.trace
        spec = dict(self.synth or ())
        return (
            f"synthetic {self.label} ({spec.get('sequences', 8)} x "
            f"{spec.get('prompt_tokens', 256)}+{spec.get('output_tokens', 512)} tokens, "
            f"seed {spec.get('seed', 0)})"
        )

    def trace_path(self) -> Path:
        """The trace file (generated into the cache folder on first use for a ``synth``
        entry: the same file every time, daopsim.simulator.trace_cache)."""
        if self.trace is not None:
            return resolve_trace(self.trace)
        from daopsim.simulator.trace_cache import synth_trace

        return synth_trace({"model": self.label, **dict(self.synth or ())})


@dataclass
class Leaderboard:
    """A parsed leaderboard file."""

    name: str
    description: str
    hw: list[str]
    sequences: int
    models: list[ModelEntry]
    #: None: every built-in policy (:func:`builtin_policies`)
    policies: list[str] | None
    path: Path


def file_kind(path: Path) -> str:
    """The ``kind`` of an experiment file ("comparison" when it has none); "" when it cannot
    be read as TOML (the experiment loader reports that)."""
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return ""
    kind = doc.get("kind", "comparison")
    return kind if isinstance(kind, str) else ""


def _unknown(path: Path, where: str, keys: Any, known: tuple[str, ...]) -> None:
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(f"{path}: {where}unknown key {key!r}{hint} (valid: {', '.join(known)})")


def _positive_int(path: Path, where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"{path}: {where} must be a positive integer, got {value!r}")
    return value


def _model_entry(path: Path, i: int, m: Any) -> ModelEntry:
    where = f"models[{i}]"
    if not isinstance(m, dict):
        raise UserError(f"{path}: {where} must be a table")
    _unknown(path, f"{where}: ", m, MODEL_KEYS)
    trace, model = m.get("trace"), m.get("model")
    if (trace is None) == (model is None):
        raise UserError(f"{path}: {where} needs a 'trace' or a 'model' (with 'synth'), not both")
    per = m.get("experts_per_layer")
    if not isinstance(per, list) or not per:
        raise UserError(f"{path}: {where}.experts_per_layer must be a non-empty list")
    for x in per:
        if isinstance(x, bool) or not isinstance(x, int | float) or not x > 0:
            raise UserError(f"{path}: {where}.experts_per_layer: {x!r} is not a positive number")
    budgets = tuple(float(x) for x in per)
    seqs = m.get("sequences")
    if seqs is not None:
        _positive_int(path, f"{where}.sequences", seqs)
    if trace is not None:
        if not isinstance(trace, str):
            raise UserError(f"{path}: {where}.trace must be a string")
        if "synth" in m:
            raise UserError(f"{path}: {where}: 'synth' goes with 'model', not 'trace'")
        return ModelEntry(label="", experts_per_layer=budgets, trace=trace, sequences=seqs)
    if not isinstance(model, str):
        raise UserError(f"{path}: {where}.model must be a string")
    from daopsim.simulator.models import get_model

    name = get_model(model).name
    spec = m.get("synth", {})
    if not isinstance(spec, dict):
        raise UserError(f"{path}: {where}.synth must be a table")
    _unknown(path, f"{where}.synth: ", spec, SYNTH_KEYS)
    for key, value in spec.items():
        if key == "seed":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UserError(f"{path}: {where}.synth.seed must be a non-negative integer")
        else:
            _positive_int(path, f"{where}.synth.{key}", value)
    synth = tuple(sorted(spec.items()))
    return ModelEntry(label=name, experts_per_layer=budgets, synth=synth, sequences=seqs)


def load_leaderboard(name_or_path: str | os.PathLike[str]) -> Leaderboard:
    """A bundled leaderboard by name or a TOML path; a UserError names the file and key."""
    from daopsim.simulator.data import bundled_dir

    text = str(name_or_path)
    bundled = {p.stem: p for p in bundled_dir("experiments").glob("*.toml")}
    path = bundled.get(text) or Path(text)
    check_input_file(path, "leaderboard")
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read: {exc}") from None
    _unknown(path, "", doc, LEADERBOARD_KEYS)
    if doc.get("kind") != "leaderboard":
        raise UserError(f'{path}: not a leaderboard file (kind = "leaderboard")')
    hw = doc.get("hw")
    if not isinstance(hw, list) or not hw or not all(isinstance(h, str) for h in hw):
        raise UserError(f"{path}: 'hw' must be a non-empty list of machine names")
    policies = doc.get("policies", "builtin")
    if policies == "builtin":
        pols = None
    elif isinstance(policies, list) and policies and all(isinstance(p, str) for p in policies):
        pols = list(policies)
    else:
        raise UserError(f"{path}: 'policies' must be \"builtin\" or a list of policy names")
    models = doc.get("models")
    if not isinstance(models, list) or not models:
        raise UserError(f"{path}: no [[models]] (give at least one)")
    entries = []
    for i, m in enumerate(models):
        entry = _model_entry(path, i, m)
        if entry.trace is not None:  # the label is the model the trace records
            from daopsim.simulator.trace import read_meta

            label = read_meta(resolve_trace(entry.trace)).model.name
            entry = ModelEntry(
                label, entry.experts_per_layer, trace=entry.trace, sequences=entry.sequences
            )
        entries.append(entry)
    labels = [e.label for e in entries]
    if len(set(labels)) != len(labels):
        raise UserError(f"{path}: a model is listed twice ({', '.join(labels)})")
    name = doc.get("name", path.stem)
    if not isinstance(name, str):
        raise UserError(f"{path}: key 'name' must be a string")
    return Leaderboard(
        name=safe_name(name, f"{path}: leaderboard name"),
        description=str(doc.get("description", "")),
        hw=list(hw),
        sequences=_positive_int(path, "'sequences'", doc.get("sequences", 2)),
        models=entries,
        policies=pols,
        path=path,
    )


def builtin_policies() -> list[str]:
    """Every built-in policy in the registry (the modules of ``daopsim.policies``), by name:
    a policy added to the package joins the leaderboard without an edit here."""
    from daopsim.policies.registry import available

    return sorted(
        n for n, cls in available().items() if cls.__module__.startswith("daopsim.policies.")
    )


def budgets(entry: ModelEntry, layers: int) -> list[int]:
    """The entry's budgets as resident experts over the whole model."""
    return [max(1, round(x * layers)) for x in entry.experts_per_layer]


@dataclass
class LeaderboardResult:
    """The leaderboard's table and what its sweeps did."""

    leaderboard: Leaderboard
    table: pd.DataFrame
    summaries: dict[str, Any] = field(default_factory=dict)

    def markdown(self) -> str:
        """The table as Markdown (:func:`markdown`)."""
        return markdown(self.table, self.leaderboard.name)

    def write(self, out_dir: str | os.PathLike[str], flag: str | None = None) -> dict[str, Path]:
        """leaderboard.parquet, leaderboard.md, relative.png and pareto.png, as one set
        swapped in whole (simulator/output.py); ``out_dir`` may hold only these files."""
        import matplotlib

        matplotlib.use("Agg")
        target = Path(out_dir)
        tab = self.table
        with output_dir(target, tuple(LEADERBOARD_FILES.values()), flag=flag) as stage:
            write_file(stage / LEADERBOARD_FILES["parquet"], lambda t: write_parquet(tab, t))
            write_text(stage / LEADERBOARD_FILES["markdown"], self.markdown())
            write_figure(heatmap_figure(tab), stage / LEADERBOARD_FILES["heatmap"], dpi=100)
            write_figure(pareto_figure(tab), stage / LEADERBOARD_FILES["pareto"], dpi=100)
        return {k: target / v for k, v in LEADERBOARD_FILES.items()}


def write_parquet(table: pd.DataFrame, path: Path) -> None:
    """The table as Parquet without pandas' index metadata (the same bytes for the same
    table)."""
    table.to_parquet(path, index=False)


# -- figures (drawn with simulator/plots.py's helpers) -------------------------------------------
def _leaderboard_cells(table: pd.DataFrame) -> list[tuple[str, str, int]]:
    """The table's cells, (model, machine, budget), in the table's order."""
    cells = table[["model", "hw", "budget"]].drop_duplicates()
    return [(str(m), str(h), int(b)) for m, h, b in cells.itertuples(index=False)]


def heatmap_figure(table: pd.DataFrame) -> Any:
    """The leaderboard's heat map: one row per policy (ranked by score, the bounds last), one
    column per cell (model, machine, budget), coloured by tokens/s relative to the cell's best
    realisable policy with exact routing (1 = the best); above 1 (approximate routing, bounds)
    in the colour bar's end colour, a run that did not finish grey and crossed."""
    import matplotlib

    from daopsim.simulator.plots import _mpl, _title

    plt = _mpl()

    rk = ranking(table)
    pols = list(rk["policy"])
    n_real = int((~rk["bound"]).sum())
    cells = _leaderboard_cells(table)
    col = {c: j for j, c in enumerate(cells)}
    row = {p: i for i, p in enumerate(pols)}
    mat = np.full((len(pols), len(cells)), np.nan)
    failed: list[tuple[int, int]] = []
    for r in table.itertuples(index=False):
        i, j = row[r.policy], col[(r.model, r.hw, int(r.budget))]
        if r.status == "ok":
            mat[i, j] = r.relative
        else:
            failed.append((i, j))
    width = min(24.0, max(8.0, 3.2 + 0.22 * len(cells)))
    height = 1.9 + 0.24 * len(pols)
    fig, ax = plt.subplots(figsize=(width, height), layout="constrained")
    cmap = matplotlib.colormaps["viridis"].with_extremes(over="#f03b20", bad="0.88")
    im = ax.imshow(
        np.ma.masked_invalid(mat), aspect="auto", vmin=0.0, vmax=1.0, cmap=cmap,
        interpolation="none",
    )  # fmt: skip
    for i, j in failed:
        ax.plot([j - 0.4, j + 0.4], [i - 0.4, i + 0.4], color="0.4", lw=0.8)
        ax.plot([j - 0.4, j + 0.4], [i + 0.4, i - 0.4], color="0.4", lw=0.8)
    ax.set_yticks(range(len(pols)), pols, fontsize=8)
    ax.set_xticks(range(len(cells)), [f"{h} {b}" for _, h, b in cells], rotation=90, fontsize=6)
    if n_real < len(pols):  # the bounds under a line
        ax.axhline(n_real - 0.5, color="white", lw=2.0)
    models = list(dict.fromkeys(m for m, _, _ in cells))
    for m in models:  # each model's columns, named above them, split by a line
        js = [j for j, c in enumerate(cells) if c[0] == m]
        ax.text((js[0] + js[-1]) / 2, -0.7, m, ha="center", va="bottom", fontsize=8)
        if js[0] > 0:
            ax.axvline(js[0] - 0.5, color="white", lw=2.0)
    ax.set_xlabel("cell: machine, budget (1, 2, 3: fewest to most resident experts)")
    fig.colorbar(
        im, ax=ax, extend="max", fraction=0.025, pad=0.01,
        label="relative tokens/s",
    )  # fmt: skip
    _title(
        fig,
        "Tokens/s relative to each cell's best exact-routing policy",
        "red: above 1 (approximate routing, bounds); grey, crossed: did not run",
    )
    return fig


def pareto_figure(table: pd.DataFrame) -> Any:
    """Score against routing fidelity, one panel per model: each realisable policy's geometric
    mean relative tokens/s over the model's cells against its mean routing fidelity (gate mass
    preserved), and the front of policies no other beats on both."""
    from daopsim.simulator.plots import (
        _Z_BOUND,
        _Z_POLICY,
        EXACT_FIDELITY,
        _finish,
        _fit_y0,
        _mpl,
        _note_under,
        _title,
        place_labels,
        policy_color,
    )

    plt = _mpl()
    models = list(dict.fromkeys(table["model"]))
    n = len(models)
    ncols = 2 if n > 1 else 1
    nrows = math.ceil(n / ncols)
    fig, grid = plt.subplots(
        nrows, ncols, figsize=(6.0 * ncols, 4.2 * nrows), squeeze=False, layout="constrained"
    )
    axes = [a for rowax in grid for a in rowax]
    for ax in axes[n:]:
        ax.set_visible(False)
    labelled: list[tuple[Any, pd.DataFrame]] = []
    for ax, m in zip(axes, models, strict=False):
        sub = table[(table["model"] == m) & ~table["bound"] & (table["status"] == "ok")]
        rk = ranking(table[table["model"] == m])
        rk = rk[~rk["bound"] & rk["score"].notna()]
        fid = sub.groupby("policy")["gate_mass_preserved"].mean()
        pts = pd.DataFrame({"policy": rk["policy"], "score": rk[m].to_numpy()})
        pts["fidelity"] = [float(fid.get(p, np.nan)) for p in pts["policy"]]
        pts = pts.dropna()
        for p in pts.itertuples(index=False):
            ax.scatter(p.fidelity, p.score, color=policy_color(p.policy), s=30,
                       zorder=_Z_POLICY, edgecolors="black", linewidths=0.4)  # fmt: skip
        order = pts.sort_values(["fidelity", "score"], ascending=[False, False], kind="stable")
        front, best = [], -np.inf
        for p in order.itertuples(index=False):
            if p.score > best:
                front.append(p)
                best = p.score
        # the edge of what the front dominates: down from each point, then on to the next
        # (by fidelity, lowest first)
        edge = front[::-1]
        ax.step([p.fidelity for p in edge], [p.score for p in edge], where="pre",
                color="black", lw=1.0, zorder=_Z_BOUND)  # fmt: skip
        lo = float(pts["fidelity"].min()) if len(pts) else 1.0
        ax.set_xlim(min(lo, 1.0) - max(0.01, 0.08 * (1.0 - lo)), 1.0 + max(0.005, 0.04 * (1 - lo)))
        _fit_y0(ax, pts["score"])
        ax.set_xlabel("routing fidelity (gate mass preserved, mean over cells)")
        ax.set_ylabel("score (geometric mean of relative tokens/s)")
        ax.set_title(m, fontsize=10)
        ax.grid(alpha=0.3)
        exact = pts[pts["fidelity"] >= EXACT_FIDELITY].sort_values("score", ascending=False)
        notes = ["front: " + ", ".join(p.policy for p in front)] if front else []
        if len(exact) > 3:  # a column of points at fidelity 1: named in order under the axes
            notes.append(
                "exact routing (fidelity 1), by score: "
                + ", ".join(f"{p.policy} {p.score:.2f}" for p in exact.itertuples(index=False))
            )
        _note_under(ax, notes)
        # named beside them: the front, the approximate ones, the best three exact ones
        named = {p.policy for p in front} | set(exact["policy"][:3])
        named |= set(pts[pts["fidelity"] < EXACT_FIDELITY]["policy"])
        labelled.append((ax, pts[pts["policy"].isin(named)]))
    _title(fig, "Leaderboard: speed against routing fidelity, per model")
    _finish(fig, 4.2 * nrows)  # the final size first: the labels are placed in display space
    for ax, pts in labelled:  # each point named beside it (more policies than colours)
        place_labels(ax, pts["fidelity"].tolist(), pts["score"].tolist(), list(pts["policy"]))
    return fig


def run_leaderboard(
    lb: Leaderboard | str | os.PathLike[str],
    runs: str | os.PathLike[str],
    extra_policies: list[str] | None = None,
    policies: list[str] | None = None,
    hw: list[str] | None = None,
    models: list[str] | None = None,
    sequences: int | None = None,
    executor: str = "local",
    workers: int | None = None,
    scheduler: str | None = None,
    progress: bool = True,
    on_model: Callable[[str], None] | None = None,
) -> LeaderboardResult:
    """Run the grid (or the subset ``policies``/``hw``/``models`` names) through the sweep
    machinery, one resumable store per model in the folder ``runs``, and make the table.

    ``extra_policies`` adds policies (a plugin, a policy under test) to the built-in ones;
    rows already in ``runs`` are not simulated again (a key is the run's content)."""
    from daopsim.policies.registry import get_policy_class
    from daopsim.simulator.grid import Grid
    from daopsim.simulator.sweep import run_sweep
    from daopsim.simulator.trace import read_meta

    board = lb if isinstance(lb, Leaderboard) else load_leaderboard(lb)
    names = list(policies) if policies else (board.policies or builtin_policies())
    for p in extra_policies or []:
        if p not in names:
            names.append(p)
    for p in names:
        get_policy_class(p)  # an unknown name fails before any run
    machines = _subset(hw, board.hw, "--hw", "machines")
    labels = _subset(models, [m.label for m in board.models], "--models", "models")
    entries = [m for m in board.models if m.label in labels]
    folder = Path(runs)
    frames = []
    summaries: dict[str, Any] = {}
    for entry in entries:
        if on_model is not None:
            on_model(entry.label)
        path = entry.trace_path()
        layers = read_meta(path).model.moe_layers
        grid = Grid(
            policies=names,
            hw=machines,
            traces=[str(path)],
            gpu_experts=budgets(entry, layers),
            sequences=sequences or entry.sequences or board.sequences,
        )
        df, summary = run_sweep(
            grid,
            executor=executor,
            workers=workers,
            out=folder / f"{entry.label}.parquet",
            progress=progress,
            scheduler=scheduler,
        )
        summaries[entry.label] = summary.to_dict()
        df = df.assign(trace=entry.trace_label(), model_label=entry.label)
        frames.append(_with_budgets(df, entry, layers))
    table = leaderboard_table(pd.concat(frames, ignore_index=True))
    return LeaderboardResult(board, table, summaries)


def _subset(asked: list[str] | None, have: list[str], flag: str, what: str) -> list[str]:
    if not asked:
        return list(have)
    unknown = [a for a in asked if a not in have]
    if unknown:
        raise UserError(
            f"{flag}: {unknown[0]!r} is not one of the leaderboard's {what} ({', '.join(have)})"
        )
    return [h for h in have if h in asked]


def _with_budgets(df: pd.DataFrame, entry: ModelEntry, layers: int) -> pd.DataFrame:
    """Each sweep row with its budget's index and experts per layer; a row that ignores the
    budget (all-gpu runs once per machine) copied into every budget of its machine."""
    points = budgets(entry, layers)
    by_count = {n: i for i, n in enumerate(points)}
    out = []
    for _, row in df.iterrows():
        n = row["gpu_experts"]
        if row["policy"] == "all-gpu" or pd.isna(n) or int(n) not in by_count:
            idxs = list(range(len(points)))  # the bound holds every expert, whatever the point
        else:
            idxs = [by_count[int(n)]]
        for i in idxs:
            r = row.to_dict()
            r["budget"] = i + 1
            r["experts_per_layer"] = entry.experts_per_layer[i]
            r["gpu_experts"] = points[i] if r["policy"] != "all-gpu" else r["gpu_experts"]
            out.append(r)
    return pd.DataFrame(out)


def leaderboard_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The leaderboard from labelled sweep rows: one row per (model, machine, budget, policy),
    with ``relative`` = tokens/s over the best realisable exact-routing policy of its cell
    (``best`` names it) and ``bound`` marking the all-GPU and clairvoyant bounds."""
    df = rows.copy()
    df["model"] = df.pop("model_label")
    df["bound"] = df["bound"].fillna(False).astype(bool) | (df["policy"] == "all-gpu")
    df["error"] = df["error"].fillna("").astype(str)
    ok = (df["status"] == "ok") & ~df["bound"]
    exact = ok & (df["gate_mass_preserved"].fillna(1.0) >= EXACT)
    cell = ["model", "hw", "budget"]
    best_tps = df[exact].groupby(cell)["tokens_per_s"].max()
    best_pol = (
        df[exact]
        .sort_values(["tokens_per_s", "policy"], ascending=[False, True], kind="stable")
        .groupby(cell)["policy"]
        .first()
    )
    keys = list(zip(df["model"], df["hw"], df["budget"], strict=True))
    df["best"] = [best_pol.get(k, "") for k in keys]
    ref = np.array([best_tps.get(k, np.nan) for k in keys], dtype=np.float64)
    tps = pd.to_numeric(df["tokens_per_s"], errors="coerce").to_numpy(dtype=np.float64)
    df["relative"] = np.where(df["status"] == "ok", tps / ref, np.nan)
    for c in COLUMNS:
        if c not in df:
            df[c] = None
    df = df[list(COLUMNS)]
    models = list(dict.fromkeys(df["model"]))
    hws = list(dict.fromkeys(df["hw"]))
    df = df.assign(
        _m=df["model"].map(models.index),
        _h=df["hw"].map(hws.index),
        _b=~df["bound"],
    )
    df = df.sort_values(
        ["_m", "_h", "budget", "_b", "policy"],
        ascending=[True, True, True, False, True],
        kind="stable",
    )
    df = df.drop(columns=["_m", "_h", "_b"]).reset_index(drop=True)
    for c in FLOAT_COLUMNS:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    for c in ("budget", "gpu_experts", "sequences"):
        df[c] = pd.array(df[c].tolist(), dtype="Int64")
    for c in ("model", "trace", "hw", "policy", "status", "error", "best", "runtime"):
        df[c] = df[c].fillna("").astype(str)
    return df


# -- the ranking and the Markdown ----------------------------------------------------------------
def _geomean(x: pd.Series) -> float:
    v = x.dropna()
    v = v[v > 0]
    return float(np.exp(np.log(v).mean())) if len(v) else math.nan


def ranking(table: pd.DataFrame) -> pd.DataFrame:
    """One row per policy: its score (the geometric mean over the cells it ran of its
    relative tokens/s), the same per model, the cells it was best in, its lowest routing
    fidelity, and how many cells it ran; realisable policies ranked by score, then the bounds."""
    models = list(dict.fromkeys(table["model"]))
    n_cells = len(table[["model", "hw", "budget"]].drop_duplicates())
    rows = []
    for pol, g in table.groupby("policy", sort=False):
        ok = g[g["status"] == "ok"]
        row: dict[str, Any] = {
            "policy": pol,
            "bound": bool(g["bound"].any()),
            "score": _geomean(ok["relative"]),
            "best_in": int((ok["best"] == pol).sum()),
            "fidelity": float(ok["gate_mass_preserved"].min()) if len(ok) else math.nan,
            "cells": len(ok),
            "of": n_cells,
        }
        for m in models:
            row[m] = _geomean(ok[ok["model"] == m]["relative"])
        rows.append(row)
    out = pd.DataFrame(rows)
    out["_s"] = out["score"].fillna(-1.0)
    out = out.sort_values(["bound", "_s", "policy"], ascending=[True, False, True], kind="stable")
    return out.drop(columns="_s").reset_index(drop=True)


def _f(x: Any, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _per_layer(x: float) -> str:
    return f"{x:g}"


def markdown(table: pd.DataFrame, name: str = "leaderboard") -> str:
    """The leaderboard as Markdown: the grid, the ranking, every cell, and the runs that did
    not finish. A function of the table alone (no clock, no version)."""
    models = list(dict.fromkeys(table["model"]))
    hws = list(dict.fromkeys(table["hw"]))
    per = {
        m: sorted(table[table["model"] == m]["experts_per_layer"].dropna().unique()) for m in models
    }
    seqs = sorted({int(s) for s in table["sequences"].dropna()})
    out = [
        f"# The {name}",
        "",
        f"Generated by `daopsim experiment {name}` (docs/leaderboard.md explains the method); do "
        "not edit by hand.",
        "",
        f"- Models: {', '.join(models)}.",
        f"- Machines: {', '.join(hws)}.",
        "- Budgets (resident experts per MoE layer): "
        + "; ".join(f"{m} {', '.join(_per_layer(x) for x in per[m])}" for m in models)
        + ".",
        f"- Evaluation sequences per run: {', '.join(map(str, seqs)) or '—'}; bf16; each "
        "policy on the runtime of the system it models.",
        "- A *cell* is one (model, machine, budget). *Relative* is a run's tokens/s over the "
        "best realisable policy with exact routing in its cell (1.000: the best); a policy "
        "that changes the routing can exceed 1, and its routing fidelity (gate mass "
        "preserved) says at what cost. The *score* is the geometric mean of a policy's "
        "relative tokens/s over the cells it ran.",
        "",
        "## Ranking",
        "",
    ]
    rk = ranking(table)
    out += _ranking_lines(rk, models)
    out += _cell_lines(table, rk, models, hws)
    out += _unfinished_lines(table)
    return "\n".join(out).rstrip("\n") + "\n"


def _ranking_lines(rk: pd.DataFrame, models: list[str]) -> list[str]:
    """The ranking table (policies by score, with their relative tokens/s per model), then
    the bounds, not ranked."""
    out: list[str] = []
    head = ["rank", "policy", "score", *models, "best in", "fidelity (min)", "cells"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rank = 0
    for _, r in rk.iterrows():
        if r["bound"]:
            continue
        rank += 1
        cells = [str(rank), f"`{r['policy']}`", _f(r["score"], ".3f")]
        cells += [_f(r[m], ".3f") for m in models]
        cells += [str(r["best_in"]), _f(r["fidelity"], ".3f"), f"{r['cells']}/{r['of']}"]
        out.append("| " + " | ".join(cells) + " |")
    bounds = rk[rk["bound"]]
    if len(bounds):
        out += ["", "Bounds (not ranked: all-gpu holds every expert, belady and belady-global "
                "know the future):", ""]  # fmt: skip
        head = ["bound", "relative (geometric mean)", *models, "cells"]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for _, r in bounds.iterrows():
            cells = [f"`{r['policy']}`", _f(r["score"], ".3f"), *(_f(r[m], ".3f") for m in models)]
            out.append("| " + " | ".join([*cells, f"{r['cells']}/{r['of']}"]) + " |")
    return out


def _cell_lines(
    table: pd.DataFrame, rk: pd.DataFrame, models: list[str], hws: list[str]
) -> list[str]:
    """A table per (model, machine): each policy's tokens/s at each budget, in ranking
    order."""
    out = ["", "## Every cell", "", "Tokens/s (simulated, prefill included) and, in brackets, "
           "relative to the cell's best; an asterisk marks approximate routing (fidelity "
           "below 1).", ""]  # fmt: skip
    order = list(rk["policy"])
    for m in models:
        for h in hws:
            sub = table[(table["model"] == m) & (table["hw"] == h)]
            if sub.empty:
                continue
            pts = sorted(sub["budget"].dropna().unique())
            per_layer = {b: sub[sub["budget"] == b]["experts_per_layer"].iloc[0] for b in pts}
            out += [f"### {m} on {h}", ""]
            head = ["policy", *(f"{_per_layer(per_layer[b])} per layer" for b in pts)]
            out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for pol in order:
                prow = sub[sub["policy"] == pol]
                if prow.empty:
                    continue
                cells = [f"`{pol}`"]
                for b in pts:
                    r = prow[prow["budget"] == b]
                    cells.append(_cell(r.iloc[0]) if len(r) else "")
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
    return out


def _unfinished_lines(table: pd.DataFrame) -> list[str]:
    """The runs that did not finish, grouped by policy, status and error."""
    out: list[str] = []
    bad = table[table["status"] != "ok"]
    if len(bad):
        out += ["## Runs that did not finish", ""]
        for (pol, status, err), g in bad.groupby(["policy", "status", "error"], sort=True):
            where = ", ".join(
                f"{m} on {h} at {_per_layer(x)}"
                for m, h, x in zip(g["model"], g["hw"], g["experts_per_layer"], strict=True)
            )
            out.append(f"- `{pol}` ({status}): {err or 'no reason recorded'} ({where})")
        out.append("")
    return out


def _cell(r: pd.Series) -> str:
    if r["status"] != "ok":
        return "skipped" if r["status"] == "skipped" else "failed"
    approx = r["gate_mass_preserved"] == r["gate_mass_preserved"] and (
        r["gate_mass_preserved"] < EXACT
    )
    rel = "" if r["relative"] != r["relative"] else f" ({r['relative']:.3f})"
    return f"{r['tokens_per_s']:.4g}{rel}{'*' if approx else ''}"


__all__ = [
    "LEADERBOARD_FILES",
    "Leaderboard",
    "LeaderboardResult",
    "builtin_policies",
    "file_kind",
    "heatmap_figure",
    "leaderboard_table",
    "load_leaderboard",
    "markdown",
    "pareto_figure",
    "ranking",
    "run_leaderboard",
]
