"""A sweep's results table: its columns, the finished rows stored one JSON file per key beside
the table (so a killed sweep resumes), the table built from them and written atomically, read
back with its columns typed, and the summaries drawn from it (seeds, the fidelity floor, small
budgets; docs/sweeps.md, "The table", "Resuming").
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from daopsim.simulator.data import (
    check_input_file,
)
from daopsim.simulator.errors import (
    UserError,
)
from daopsim.simulator.metrics import metric_keys, optional_metric_keys
from daopsim.simulator.output import (
    TABLE_FORMATS,
    output_format,
    write_text,
)
from daopsim.simulator.output import write_table as _write_any_table
from daopsim.simulator.run_params import grid_params
from daopsim.simulator.sweep_row import _one_line

#: Columns every sweep table has before the option and metric columns, in this order.
BASE_COLUMNS = (
    "policy",
    "hw",
    "trace",
    "cache_ratio",
    "gpu_experts",
    "sequences",
    "seed",
    "runtime",
    "bound",
    "status",
    "error",
    "key",
)


#: Columns after the metrics: model facts for plots, and the per-layer decode hit rates.
EXTRA_COLUMNS = (
    "model",
    "dtype",
    "total_experts",
    "max_gpu_experts",
    "expert_bytes",
    "expert_memory_gb",
    "per_layer_hit_rate",
    "sequence_ids",
    "calibration",
)


#: The all-GPU bound of each row (docs/metrics.md, "Bounds"): its tokens/s and the runtime it
#: ran on; empty for rows that did not finish, serving rows and multi-GPU rows (whose
#: throughput a one-sequence, one-GPU bound does not cap).
BOUND_COLUMNS = ("bound_tokens_per_s", "bound_runtime")


#: Columns of serving sweeps (an ``arrival_rate`` axis; docs/serving.md), after the metrics.
SERVING_COLUMNS = (
    "arrival_rate",
    "max_batch",
    "throughput_tokens_per_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "req_tpot_p50_s",
    "req_tpot_p90_s",
    "req_tpot_p99_s",
    "latency_p50_s",
    "latency_p90_s",
    "latency_p99_s",
    "slo_attainment",
    "goodput_requests_per_s",
)


def parts_dir(out: str | os.PathLike[str]) -> Path:
    """The sidecar folder holding one finished row per configuration key."""
    p = Path(out)
    return p.with_name(p.name + ".parts")


def _load_parts(folder: Path, keys: set[str]) -> dict[str, dict[str, Any]]:
    done: dict[str, dict[str, Any]] = {}
    if not folder.is_dir():
        return done
    for f in folder.glob("*.json"):
        if f.stem not in keys:
            continue
        try:
            row = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # cannot happen with atomic writes; a damaged part is simply re-run
        if isinstance(row, dict) and row.get("key") == f.stem:
            done[f.stem] = row
    return done


def _save_part(folder: Path, row: dict[str, Any]) -> None:
    write_text(folder / f"{row['key']}.json", json.dumps(row, sort_keys=True))


@contextlib.contextmanager
def _lock(folder: Path, out: Path) -> Iterator[None]:
    """Exclusive lock on the results file for the whole sweep (released if the process dies)."""
    folder.mkdir(parents=True, exist_ok=True)
    fh = open(folder / ".lock", "a+")  # noqa: SIM115 (held open for the whole sweep)
    try:
        try:
            import fcntl

            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # not POSIX: no cross-process lock
            pass
        except BlockingIOError:
            raise UserError(
                f"{out}: another sweep is writing this results file "
                f"(lock {folder / '.lock'} is held); wait for it or choose another --out"
            ) from None
        yield
    finally:
        fh.close()


def to_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Rows (in grid order) as the tidy sweep table with a stable column order."""
    opt_cols = sorted({k for r in rows for k in r if k.startswith("opt.")})
    # dict.fromkeys: "sequences" is both a configuration column and a metric
    serving = [c for c in SERVING_COLUMNS if any(c in r for r in rows)]
    # a gpus axis: the columns appear, one-GPU rows read gpus = 1
    multi = ["gpus", "multi_gpu", "gpu_experts_per_gpu"] if any("gpus" in r for r in rows) else []
    optional = optional_metric_keys()
    metrics = [k for k in metric_keys() if k not in optional or any(k in r for r in rows)]
    # the other declared axes (simulator/run_params.py) last, where some row has them
    axes = [p.name for p in grid_params() if p.axis and any(p.name in r for r in rows)]
    first = [*BASE_COLUMNS, *opt_cols, *multi, *metrics, *BOUND_COLUMNS, *serving]
    cols = list(dict.fromkeys([*first, *EXTRA_COLUMNS, *axes]))
    df = pd.DataFrame([{c: r.get(c) for c in cols} for r in rows], columns=cols)
    if multi:
        df["gpus"] = df["gpus"].fillna(1).astype("int64")
        # one GPU's budget: a one-GPU row's is its budget
        one = df["gpus"] == 1
        per = pd.to_numeric(df["gpu_experts_per_gpu"], errors="coerce")
        per[one] = pd.to_numeric(df.loc[one, "gpu_experts"], errors="coerce")
        df["gpu_experts_per_gpu"] = per.astype("Int64")
    for c in serving:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    ints = ("gpu_experts", "sequences", "seed", "total_experts", "max_gpu_experts")
    for c in metrics:
        if c in ints:
            continue
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    for c in ("cache_ratio", "expert_memory_gb", "bound_tokens_per_s"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    for c in ints:
        df[c] = pd.array(df[c].tolist(), dtype="Int64")
    df["expert_bytes"] = pd.array(df["expert_bytes"].tolist(), dtype="Int64")
    df["bound"] = pd.array(df["bound"].tolist(), dtype="boolean")
    for c in opt_cols:
        kinds = {type(v) for v in df[c] if v is not None and not _isnan(v)}
        if len(kinds) > 1:  # one option name, different types in different policies
            df[c] = [None if v is None else str(v) for v in df[c]]
    return df


def seed_summary(
    df: pd.DataFrame, metrics: tuple[str, ...] = ("tokens_per_s", "hit_rate")
) -> pd.DataFrame:
    """Mean, sample standard deviation and count over seeds of each configuration.

    Rows that differ only in ``seed`` (and ``key``) form one group; failed rows are left out.
    Columns: the configuration columns, ``seeds`` (how many), and ``METRIC_mean`` /
    ``METRIC_std`` for each metric present.
    """
    ok = df[df["status"] == "ok"] if "status" in df else df
    present = [m for m in metrics if m in ok]
    keys = [
        c
        for c in ("trace", "hw", "policy", "cache_ratio", "gpu_experts", "sequences", "gpus")
        if c in ok
    ] + sorted(c for c in ok.columns if c.startswith("opt."))
    grouped = ok.groupby(keys, dropna=False, sort=False)
    out = grouped["seed"].nunique().rename("seeds").to_frame()
    for m in present:
        out[f"{m}_mean"] = grouped[m].mean()
        out[f"{m}_std"] = grouped[m].std()
    return out.reset_index()


def _isnan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def check_fidelity_floor(min_gate_mass: float | None) -> None:
    """A routing-fidelity floor is a fraction of the gate mass: in [0, 1]."""
    if min_gate_mass is not None and not 0 <= min_gate_mass <= 1:
        raise UserError(f"--min-gate-mass must be in [0, 1], got {min_gate_mass}")


def fidelity_floor(df: pd.DataFrame, min_gate_mass: float | None) -> tuple[pd.DataFrame, int]:
    """Drop the finished rows whose routing fidelity (``gate_mass_preserved``) is below the
    floor; skipped and failed rows stay. Returns the table and how many rows were dropped."""
    check_fidelity_floor(min_gate_mass)
    if min_gate_mass is None:
        return df, 0
    if "gate_mass_preserved" not in df.columns:
        return df, 0
    below = (df["status"] == "ok") & (df["gate_mass_preserved"] < min_gate_mass)
    return df[~below].reset_index(drop=True), int(below.sum())


def small_budget_note(df: pd.DataFrame) -> str:
    """One line when finished rows of per-layer caching policies have at most top-k experts
    per layer, where those policies cannot differ (docs/metrics.md, "Budget and residency");
    "" otherwise."""
    from daopsim.policies.caching import CachingPolicy
    from daopsim.policies.registry import get_policy_class
    from daopsim.simulator.models import get_model

    if df.empty or "model" not in df:
        return ""
    hits: list[str] = []
    for r in df[df["status"] == "ok"].itertuples():
        try:
            cls = get_policy_class(str(r.policy))
            model = get_model(str(r.model))
        except UserError:
            continue
        gpus = int(getattr(r, "gpus", 1) or 1)
        per_layer = int(r.gpu_experts) // gpus // max(1, model.moe_layers)
        if issubclass(cls, CachingPolicy) and per_layer <= model.top_k:
            hits.append(f"{r.policy} at {int(r.gpu_experts)}")
    if not hits:
        return ""
    shown = ", ".join(dict.fromkeys(hits))
    return (
        f"{len(hits)} row(s) of per-layer caching policies have at most top-k experts per layer "
        f"({shown}): there every per-layer cache holds only the last token's experts, so they "
        "cannot differ (docs/metrics.md, 'Budget and residency')"
    )


def write_table(df: pd.DataFrame, out: str | os.PathLike[str]) -> Path:
    """Write the sweep table atomically: Parquet, or CSV for a ``.csv`` path."""
    return _write_any_table(df, out, "--out")


def read_table(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Read a results table (a sweep's or an experiment's, Parquet or CSV); a clear error when
    the file is missing or not a results table."""
    p = check_input_file(path, "results")
    fmt = output_format(p, TABLE_FORMATS)
    try:
        df = pd.read_csv(p) if fmt == "csv" else pd.read_parquet(p)
    except Exception as exc:
        raise UserError(f"{p}: not a readable {fmt} file ({_one_line(exc)})") from None
    missing = [c for c in ("policy", "hw", "trace", "status", "tokens_per_s") if c not in df]
    if missing:
        raise UserError(f"{p}: not a results table (missing column {missing[0]!r})")
    if fmt == "csv" and "per_layer_hit_rate" in df:
        df["per_layer_hit_rate"] = [_list_cell(v) for v in df["per_layer_hit_rate"]]
    for col in [c for c in (*metric_keys(), *_NUMBER_COLUMNS) if c in df]:
        if df[col].dtype.kind in "biuf":
            continue
        # empty cells (a failed row's metrics) are NaN; anything else must be a number
        values = pd.to_numeric(df[col], errors="coerce")
        bad = values.isna() & df[col].notna()
        if bad.any():
            i = int(bad.to_numpy().argmax())
            raise UserError(
                f"{p}: row {i + 1}: column {col!r}: {df[col].iloc[i]!r} is not a number"
            )
        df[col] = values
    return df


#: Columns of a results table that hold numbers besides the metrics (checked on reading)
_NUMBER_COLUMNS = (
    "cache_ratio",
    "gpu_experts",
    "sequences",
    "seed",
    "total_experts",
    "max_gpu_experts",
    "expert_bytes",
    "expert_memory_gb",
    *BOUND_COLUMNS[:1],
    *SERVING_COLUMNS,
)


def _list_cell(value: Any) -> list[float] | None:
    """A list column read back from CSV (written as ``[0.1, 0.2]``)."""
    if not isinstance(value, str):
        return None
    try:
        return [float(x) for x in json.loads(value.replace("nan", "NaN"))]
    except (ValueError, TypeError):
        return None
