"""``daopsim compare``: several policies (and machines) on one trace, side by side.

The configurations are an ordinary sweep (simulator/sweep.py: one pool, ``--workers``), one per
(machine, policy), at one memory point, precision and runtime. The result is one table with a
column per configuration and a row per metric (:data:`ROWS`), and one figure: tokens/s against
each machine's all-GPU bound, and the decode hit rate (docs/cli.md, "Comparing policies").
"""

from __future__ import annotations

import os
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from daopsim.simulator.errors import UserError

#: (metric, label, scale, unit) rows of the side-by-side table, in order
ROWS: tuple[tuple[str, str, float, str], ...] = (
    ("tokens_per_s", "tokens/s", 1.0, ""),
    ("bound_tokens_per_s", "all-GPU bound tokens/s", 1.0, ""),
    ("ttft_s", "time to first token", 1.0, " s"),
    ("tpot_p50_s", "per-token latency p50", 1e3, " ms"),
    ("hit_rate", "GPU hit rate (decode)", 1.0, ""),
    ("gpu_experts", "expert budget", 1.0, ""),
    ("max_slots_held", "experts resident at most", 1.0, ""),
    ("h2d_bytes", "host-to-device", 1e-9, " GB"),
    ("gpu_busy_frac", "GPU busy", 1.0, ""),
    ("cpu_busy_frac", "CPU busy", 1.0, ""),
    ("h2d_busy_frac", "H2D link busy", 1.0, ""),
    ("gate_mass_preserved", "gate mass preserved", 1.0, ""),
    ("tokens_per_kj", "tokens per kJ", 1.0, ""),
)


@dataclass
class Comparison:
    """The configurations compared (``columns``: one dict each) and the common settings."""

    trace: str
    sequences: int | None
    dtype: str | None
    cache_ratio: float | None
    gpu_experts: int | None
    runtime: str | None
    columns: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> int:
        """Columns whose run failed (status ``error``; ``skipped`` ones did not fit)."""
        return sum(c["status"] == "error" for c in self.columns)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``daopsim compare --json``)."""
        return asdict(self)


def compare(
    policies: list[str],
    hw: list[str] | str = "a6000-pcie4",
    trace: str | None = None,
    model: str | None = None,
    sequences: int | None = None,
    cache_ratio: float | None = None,
    gpu_experts: int | None = None,
    dtype: str | None = None,
    runtime: str | None = None,
    options: dict[str, list[Any]] | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> Comparison:
    """Run each policy on each machine over one trace; one column per configuration.

    ``options`` maps ``policy.option`` (or an option every listed policy that declares it
    takes) to one value, as a sweep grid's ``options``. A budget a machine cannot hold is a
    column with status ``skipped``; a failed run one with status ``error``.
    """
    from daopsim.simulator.data import DEFAULT_TRACE
    from daopsim.simulator.grid import Grid
    from daopsim.simulator.sweep import run_configs
    from daopsim.simulator.sweep_expand import expand

    hws = [hw] if isinstance(hw, str) else list(hw)
    _check_inputs(policies, hws, sequences, cache_ratio, gpu_experts, dtype, options)
    trace_args: list[str]
    if model is not None:
        if trace is not None:
            raise UserError("give --trace or --model, not both")
        from daopsim.simulator.trace_cache import model_trace

        path = str(model_trace(model, None))
        trace_args = ["--model", model]
    else:
        path = trace if trace is not None else DEFAULT_TRACE
        trace_args = ["--trace", path] if trace is not None else []
    grid = Grid(
        policies=list(policies),
        hw=hws,
        traces=[path],
        cache_ratios=[cache_ratio] if cache_ratio is not None else [],
        gpu_experts=[gpu_experts] if gpu_experts is not None else [],
        sequences=sequences,
        options=dict(options or {}),
        dtype=dtype,
        runtimes=[runtime] if runtime is not None else [],
    )
    configs = expand(grid)
    rows = run_configs(configs, workers=workers, progress=progress, label="compare")
    out = Comparison(
        trace=model if model is not None else (trace or DEFAULT_TRACE),
        sequences=sequences,
        dtype=dtype,
        cache_ratio=cache_ratio,
        gpu_experts=gpu_experts,
        runtime=runtime,
    )
    for cfg, row in zip(configs, rows, strict=True):
        out.columns.append(_column(cfg, row, trace_args))
    _note_small_budget(out, rows)
    return out


def _check_inputs(
    policies: list[str],
    hws: list[str],
    sequences: int | None,
    cache_ratio: float | None,
    gpu_experts: int | None,
    dtype: str | None,
    options: dict[str, list[Any]] | None,
) -> None:
    """Refuse what no column could run: a policy or machine given twice, both budgets, an
    option with several values, a bad sequence count, precision or budget."""
    if not policies:
        raise UserError("--policies: no policy given")
    if len(set(policies)) != len(policies):
        dup = next(p for p in policies if policies.count(p) > 1)
        raise UserError(f"--policies: policy {dup!r} given twice")
    if len(set(hws)) != len(hws):
        dup = next(h for h in hws if hws.count(h) > 1)
        raise UserError(f"--hw: machine {dup!r} given twice")
    if cache_ratio is not None and gpu_experts is not None:
        raise UserError("give --cache-ratio or --gpu-experts, not both")
    for k, v in (options or {}).items():
        if len(v) != 1:
            raise UserError(f"--policy-opt {k}: one value per option in a comparison")
    # what every column shares is checked once, before any run (a sweep would record the
    # same mistake in every row)
    if sequences is not None and (isinstance(sequences, bool) or sequences < 1):
        raise UserError(f"--sequences must be positive, got {sequences}")
    if dtype is not None:
        from daopsim.simulator.errors import did_you_mean
        from daopsim.simulator.precisions import DTYPES

        if dtype not in DTYPES:
            raise UserError(f"--dtype: unknown precision {dtype!r}{did_you_mean(dtype, DTYPES)}")
    from daopsim.simulator.fit import requested_budget

    requested_budget(cache_ratio, gpu_experts, 1 << 62)  # the ranges, before the model is known


def _column(cfg: Any, row: dict[str, Any], trace_args: list[str]) -> dict[str, Any]:
    """One configuration's column: what it ran, its status, its metrics and its command."""
    col: dict[str, Any] = {
        "policy": row["policy"],
        "hw": row["hw"],
        "runtime": row.get("runtime"),
        "status": row["status"],
        "error": row.get("error"),
        "options": {k: v for k, v in cfg.options if _changed(cfg.policy, k, v)},
        "metrics": {k: _clean(row.get(k)) for k, _, _, _ in ROWS},
        "command": _command(cfg, trace_args),
    }
    col["metrics"]["total_experts"] = _clean(row.get("total_experts"))
    return col


def _changed(policy: str, key: str, value: Any) -> bool:
    from daopsim.policies.registry import get_policy_class

    param = get_policy_class(policy).params.get(key)
    return param is None or value != param.default


def _clean(value: Any) -> Any:
    if isinstance(value, float) and value != value:
        return None
    if hasattr(value, "item"):  # numpy scalars from a table
        return value.item()
    return value


def _command(cfg: Any, trace_args: list[str]) -> str:
    """The ``daopsim run`` command of one column."""
    parts = ["daopsim", "run", "--policy", cfg.policy, "--hw", cfg.hw, *trace_args]
    if cfg.sequences is not None:
        parts += ["--sequences", str(cfg.sequences)]
    if cfg.dtype is not None:
        parts += ["--dtype", cfg.dtype]
    if cfg.cache_ratio is not None:
        parts += ["--cache-ratio", repr(cfg.cache_ratio)]
    if cfg.gpu_experts is not None:
        parts += ["--gpu-experts", str(cfg.gpu_experts)]
    if cfg.runtime is not None:
        parts += ["--runtime", cfg.runtime]
    for k, v in cfg.options:
        if _changed(cfg.policy, k, v):
            parts += ["--policy-opt", f"{k}={v}"]
    return shlex.join(parts)


def _note_small_budget(out: Comparison, rows: list[dict[str, Any]]) -> None:
    """The run note of a budget of at most top-k experts per layer, once for the table."""
    from daopsim.policies.caching import CachingPolicy
    from daopsim.policies.registry import get_policy_class
    from daopsim.simulator.runner import small_budget_note
    from daopsim.simulator.trace_read import read_meta

    for row in rows:
        if row.get("status") != "ok" or not row.get("model"):
            continue
        cls = get_policy_class(row["policy"])
        if not issubclass(cls, CachingPolicy):
            continue
        from daopsim.simulator.data import resolve_trace

        model = read_meta(resolve_trace(row["trace"])).model
        note = small_budget_note(cls(), model, int(row["gpu_experts"]))
        if note and note not in out.notes:
            out.notes.append(note)


def _fmt(value: Any, scale: float, unit: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int) and scale == 1.0:
        return f"{value:,}{unit}"
    v = value * scale
    return f"{v:,.1f}{unit}" if abs(v) >= 100 else f"{v:.4g}{unit}"


def render(comp: Comparison) -> str:
    """The side-by-side table: a column per configuration, a row per metric."""
    several = len({c["hw"] for c in comp.columns}) > 1
    heads = []
    for c in comp.columns:
        opts = ",".join(f"{k}={v}" for k, v in sorted(c["options"].items()))
        head = [c["policy"] + (f" ({opts})" if opts else "")]
        if several:
            head.append(c["hw"])
        head.append(str(c["runtime"] or "-"))
        heads.append(head)
    label_w = max(len(label) for _, label, _, _ in ROWS)
    cells: list[list[str]] = []
    for c in comp.columns:
        if c["status"] != "ok":
            cells.append([c["status"]] + [""] * (len(ROWS) - 1))
            continue
        cells.append([_fmt(c["metrics"][k], s, u) for k, _, s, u in ROWS])
    widths = [max(len(x) for x in [*h, *col]) for h, col in zip(heads, cells, strict=True)]
    setting = [f"trace {comp.trace}"]
    if comp.sequences is not None:
        setting.append(f"{comp.sequences} sequence" + ("s" if comp.sequences != 1 else ""))
    if comp.dtype is not None:
        setting.append(f"experts at {comp.dtype}")
    if comp.cache_ratio is not None:
        setting.append(f"cache ratio {comp.cache_ratio}")
    elif comp.gpu_experts is not None:
        setting.append(f"{comp.gpu_experts} GPU experts")
    else:
        setting.append("the largest budget that fits")
    if comp.runtime is not None:
        setting.append(f"runtime {comp.runtime}")
    lines = ["compare: " + ", ".join(setting) + " (simulated)"]
    for i in range(len(heads[0])):
        lines.append(
            f"  {'':<{label_w}}  "
            + "  ".join(f"{h[i]:>{w}}" for h, w in zip(heads, widths, strict=True))
        )
    for j, (_, label, _, _) in enumerate(ROWS):
        lines.append(
            f"  {label:<{label_w}}  "
            + "  ".join(f"{col[j]:>{w}}" for col, w in zip(cells, widths, strict=True))
        )
    for c in comp.columns:
        if c["status"] != "ok":
            lines.append(f"{c['policy']} on {c['hw']}: {c['status']}: {c['error']}")
    for note in comp.notes:
        lines.append(f"note: {note}")
    lines.append("commands:")
    lines += [f"  {c['command']}" for c in comp.columns]
    return "\n".join(lines)


def figure(comp: Comparison) -> Any:
    """One figure: tokens/s per configuration against its machine's all-GPU bound, and the
    decode hit rate."""
    from daopsim.simulator.colors import policy_color
    from daopsim.simulator.plots_common import _mpl

    plt = _mpl()
    ok = [c for c in comp.columns if c["status"] == "ok"]
    if not ok:
        raise UserError("compare: no configuration finished, nothing to plot")
    several = len({c["hw"] for c in comp.columns}) > 1
    labels = [c["policy"] + (f"\n{c['hw']}" if several else "") for c in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(7.0, 1.3 * len(ok) + 3), 3.8))
    xs = list(range(len(ok)))
    colors = [policy_color(c["policy"]) for c in ok]
    ax1.bar(xs, [c["metrics"]["tokens_per_s"] for c in ok], color=colors)
    bounds = [c["metrics"]["bound_tokens_per_s"] for c in ok]
    if any(b is not None for b in bounds):
        ax1.scatter(
            xs, [b if b is not None else float("nan") for b in bounds],
            marker="_", s=600, color="black", label="all-GPU bound",
        )  # fmt: skip
        ax1.legend(loc="best", fontsize=8)
    ax1.set_ylabel("tokens/s (simulated)")
    ax2.bar(xs, [c["metrics"]["hit_rate"] for c in ok], color=colors)
    ax2.set_ylabel("GPU hit rate (decode)")
    ax2.set_ylim(0, 1)
    for ax in (ax1, ax2):
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    fig.suptitle(f"compare on {comp.trace}", fontsize=10)
    fig.tight_layout()
    return fig


def write_figure(comp: Comparison, path: str | os.PathLike[str]) -> Any:
    """The figure of :func:`figure`, written atomically to ``path`` (PNG, PDF or SVG)."""
    from daopsim.simulator.plots import save_figure

    return save_figure(figure(comp), path)
