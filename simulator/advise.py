"""``daopsim advise``: for one model on one machine, search policies, budgets and precisions.

The search is an ordinary sweep (simulator/sweep.py), one grid per precision, so ``--workers``
and Dask work as they do for ``daopsim sweep``. Budgets that do not fit are skipped rows.
Clairvoyant and all-GPU bounds (``Policy.bound``) run too, but as reference lines, never as
recommendations. Each row carries the exact ``daopsim run`` command that reproduces it.
The rules (search space, bottleneck) are in docs/advise.md.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from simulator.errors import UserError

#: Smaller cache ratios tried beside the largest budget that fits.
SMALL_RATIOS = (0.25,)
#: Precisions tried when ``--dtype`` is not given (the trace's own one is added first).
DEFAULT_DTYPES = ("q4_k_m",)
#: Evaluation sequences per run (a small, fast search).
SEQUENCES = 2
#: The synthetic trace made when no bundled one matches the model (docs/advise.md).
SYNTH = {"sequences": 3, "prompt_tokens": 32, "output_tokens": 48, "seed": 1}
#: Most values an option with ``choices`` contributes to the search.
MAX_CHOICES = 3
#: In :data:`OPTION_HINTS`: search the option's declared ``choices`` (at most MAX_CHOICES).
CHOICES = "choices"

#: The policy options the search varies, per policy: a function of the model shape giving the
#: values, or :data:`CHOICES`. Every other option keeps its default (a product over every
#: option with choices would be hundreds of runs of near-identical rows).
OPTION_HINTS: dict[str, dict[str, Callable[[Any], list[Any]] | str]] = {
    "static": {"host_memory": CHOICES},
    "llama-cpp-cpu-moe": {
        "n_cpu_moe": lambda m: sorted({m.layers, (3 * m.layers) // 4, m.layers // 2}),
    },
    "llama-cpp-layers": {
        "ngl": lambda m: sorted({0, m.layers // 4, m.layers // 2}),
    },
}


@dataclass
class AdviceRow:
    """One configuration of the search, with its metrics and the command that reproduces it."""

    rank: int | None
    policy: str
    dtype: str
    cache_ratio: float | None
    gpu_experts: int
    options: dict[str, Any]
    tokens_per_s: float
    ttft_s: float
    gate_mass_preserved: float
    hit_rate: float
    bottleneck: str
    reference: bool
    command: str


@dataclass
class Advice:
    """The ranked table (``rows``), bound reference lines and what was left out."""

    model: str
    hw: str
    trace: str
    sequences: int
    min_gate_mass: float | None
    rows: list[AdviceRow] = field(default_factory=list)
    references: list[AdviceRow] = field(default_factory=list)
    skipped: int = 0
    failed: int = 0
    below_floor: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``daopsim advise --json``)."""
        return asdict(self)


def bottleneck(row: dict[str, Any], unified: bool) -> str:
    """The busiest of the host link, the CPU and the GPU (docs/advise.md, "Bottleneck").

    On a unified-memory machine the "link" is a copy inside the one DRAM, so it is "memory".
    """
    busy = {
        "link": float(row.get("h2d_busy_frac") or 0.0),
        "CPU": float(row.get("cpu_busy_frac") or 0.0),
        "GPU": float(row.get("gpu_busy_frac") or 0.0),
    }
    name = max(busy, key=lambda k: (busy[k], k == "GPU"))
    if name == "link" and unified:
        return "memory"
    return name


def find_trace(model: str, trace: str | None) -> tuple[str, str]:
    """The trace to search on and the name or path a ``daopsim run`` command gives for it."""
    from simulator.data import bundled_traces, resolve_trace
    from simulator.synth import PRESETS
    from simulator.trace import read_meta
    from simulator.validation import synth_trace

    if trace is not None:
        path = resolve_trace(trace)
        got = read_meta(path).model.name
        if got != model:
            raise UserError(f"--trace {trace}: records model {got!r}, not {model!r}")
        return str(path), trace if trace in bundled_traces() else str(path.resolve())
    bundled = bundled_traces()
    if model in bundled:  # the trace named after the model first (not the small CI one)
        return str(bundled[model]), model
    for name, path in bundled.items():
        if read_meta(path).model.name == model:
            return str(path), name
    presets = [p for p in PRESETS.values() if p.model == model]
    if not presets:
        raise UserError(
            f"no bundled trace or synth preset for model {model!r}; give --trace PATH "
            "(record one with `daopsim capture` or make one with `daopsim synth`)"
        )
    path = synth_trace({"preset": presets[0].name, **SYNTH})
    return str(path), str(path)


def _option_values(policy: str, cls: Any, model: Any) -> dict[str, list[Any]]:
    """The option axes searched for one policy (:data:`OPTION_HINTS`; none for a bound)."""
    axes: dict[str, list[Any]] = {}
    if is_bound(cls):
        return axes
    for name, how in OPTION_HINTS.get(policy, {}).items():
        param = cls.params.get(name)
        if param is None:
            continue  # an older or newer version of the policy without it
        if callable(how):
            axes[name] = list(how(model))
        elif param.choices:
            vals = [param.default] + [c for c in param.choices if c != param.default]
            axes[name] = vals[:MAX_CHOICES]
    return axes


def _declared_type(typ: type, value: Any) -> Any:
    """A table cell back as the option's declared Python type (int, float, bool or str)."""
    if typ is bool:
        return bool(value)
    if typ is int:
        return int(value)
    if typ is float:
        return float(value)
    return str(value)


def is_bound(cls: Any) -> bool:
    """A clairvoyant or otherwise unrealisable policy: a reference line, not advice."""
    return bool(getattr(cls, "clairvoyant", False) or getattr(cls, "bound", False))


def command_for(row: dict[str, Any], hw: str, trace_arg: str, sequences: int) -> str:
    """The ``daopsim run`` command that reproduces one sweep row."""
    parts = ["daopsim", "run", "--policy", row["policy"], "--hw", hw, "--trace", trace_arg]
    parts += ["--sequences", str(sequences), "--dtype", str(row["dtype"])]
    if row.get("_ratio") is not None:
        parts += ["--cache-ratio", repr(float(row["_ratio"]))]
    for k, v in sorted(row.get("_options", {}).items()):
        parts += ["--policy-opt", f"{k}={v}"]
    return shlex.join(parts)


def advise(
    model: str,
    hw: str,
    trace: str | None = None,
    dtypes: list[str] | None = None,
    min_gate_mass: float | None = None,
    policies: list[str] | None = None,
    executor: str = "local",
    workers: int | None = None,
    scheduler: str | None = None,
    progress: bool = False,
) -> Advice:
    """Search policies, budgets, options and precisions; the rows ranked by tokens/s.

    ``policies`` narrows the search to those names (default: every registered policy).
    """
    from policies.registry import available
    from simulator.hardware import load_profile
    from simulator.models import DTYPES, get_model
    from simulator.runner import keeps_nothing_resident
    from simulator.sweep import Grid, check_fidelity_floor, run_sweep
    from simulator.trace import read_meta

    shape = get_model(model)
    profile = load_profile(hw)
    check_fidelity_floor(min_gate_mass)
    path, trace_arg = find_trace(shape.name, trace)
    own = read_meta(path).model.dtype
    for d in dtypes or []:
        if d not in DTYPES:
            raise UserError(f"--dtype: unknown precision {d!r} (known: {', '.join(DTYPES)})")
    search_dtypes = list(dict.fromkeys(dtypes or [own, *DEFAULT_DTYPES]))
    registered = available()
    unknown = [p for p in policies or [] if p not in registered]
    if unknown:
        raise UserError(f"--policies: unknown policy {unknown[0]!r} (see `daopsim policies list`)")
    classes = {p: registered[p] for p in policies} if policies else dict(registered)
    unified = profile.link.unified
    advice = Advice(shape.name, hw, trace_arg, SEQUENCES, min_gate_mass)
    rows: list[AdviceRow] = []
    for dtype in search_dtypes:
        for ratio in (None, *SMALL_RATIOS):
            options: dict[str, list[Any]] = {}
            for pol, cls in classes.items():
                for k, v in _option_values(pol, cls, shape).items():
                    options[f"{pol}.{k}"] = v
            names = list(classes)
            if ratio is not None:
                # bounds are reference lines, and a policy that keeps nothing resident does
                # not use the budget: both run at the largest budget only
                names = [
                    p
                    for p in names
                    if not is_bound(classes[p]) and not keeps_nothing_resident(classes[p])
                ]
                options = {k: v for k, v in options.items() if k.split(".")[0] in names}
            if not names:
                continue
            grid = Grid(
                policies=names,
                hw=[hw],
                traces=[path],
                cache_ratios=[ratio] if ratio is not None else [],
                sequences=SEQUENCES,
                options=options,
                dtype=dtype,
            )
            df, summary = run_sweep(
                grid, executor=executor, workers=workers, progress=progress, scheduler=scheduler
            )
            advice.skipped += summary.skipped
            advice.failed += summary.failed
            rows += _rows(df, ratio, hw, trace_arg, unified, classes, shape)
    # the largest budget and a ratio can land on the same expert count: keep the first
    seen: set[tuple[Any, ...]] = set()
    unique = []
    for r in rows:
        ident = (r.policy, r.dtype, r.gpu_experts, tuple(sorted(r.options.items())))
        if ident not in seen:
            seen.add(ident)
            unique.append(r)
    if min_gate_mass is not None:
        kept = [r for r in unique if r.reference or r.gate_mass_preserved >= min_gate_mass]
        advice.below_floor = len(unique) - len(kept)
        unique = kept
    ranked = sorted(
        (r for r in unique if not r.reference),
        key=lambda r: (
            -r.tokens_per_s,
            -r.gate_mass_preserved,
            r.ttft_s,
            r.gpu_experts,
            r.policy,
            r.dtype,
            sorted(r.options.items()),
        ),
    )
    for i, r in enumerate(ranked, 1):
        r.rank = i
    advice.rows = ranked
    advice.references = sorted(
        (r for r in unique if r.reference), key=lambda r: (-r.tokens_per_s, r.policy, r.dtype)
    )
    return advice


def _rows(
    df: pd.DataFrame,
    ratio: float | None,
    hw: str,
    trace_arg: str,
    unified: bool,
    classes: dict[str, Any],
    shape: Any,
) -> list[AdviceRow]:
    """The ok rows of one sweep as advice rows."""
    out = []
    for rec in df[df["status"] == "ok"].to_dict("records"):
        opts = {
            k[4:]: v
            for k, v in rec.items()
            if k.startswith("opt.") and not (isinstance(v, float) and v != v)
        }
        # only the options the search set (the rest are defaults; the command stays short)
        cls = classes[rec["policy"]]
        searched = _option_values(rec["policy"], cls, shape)
        # a table column mixes policies, so pandas widens an int option to float: restore the
        # option's declared type, or the reproduce command would say n_cpu_moe=24.0
        opts = {k: _declared_type(cls.params[k].type, v) for k, v in opts.items() if k in searched}
        rec["_ratio"], rec["_options"] = ratio, opts
        out.append(
            AdviceRow(
                rank=None,
                policy=rec["policy"],
                dtype=str(rec["dtype"]),
                cache_ratio=float(rec["cache_ratio"]),
                gpu_experts=int(rec["gpu_experts"]),
                options=opts,
                tokens_per_s=float(rec["tokens_per_s"]),
                ttft_s=float(rec["ttft_s"]),
                gate_mass_preserved=float(rec["gate_mass_preserved"]),
                hit_rate=float(rec["hit_rate"]),
                bottleneck=bottleneck(rec, unified),
                reference=is_bound(classes[rec["policy"]]),
                command=command_for(rec, hw, trace_arg, SEQUENCES),
            )
        )
    return out


def render(advice: Advice) -> str:
    """The ranked table as text."""
    head = (
        f"{'#':>3}  {'tokens/s':>9}  {'TTFT s':>7}  {'fidelity':>8}  {'bottleneck':<10}  "
        f"{'policy':<20} {'dtype':<10} {'experts':>7}  command"
    )
    lines = [
        f"advise: {advice.model} on {advice.hw}, trace {Path(advice.trace).name}, "
        f"{advice.sequences} sequences (ranked by tokens/s)",
        head,
    ]

    def line(tag: str, r: AdviceRow) -> str:
        return (
            f"{tag:>3}  {r.tokens_per_s:>9.2f}  {r.ttft_s:>7.3f}  {r.gate_mass_preserved:>8.3f}  "
            f"{r.bottleneck:<10}  {r.policy:<20} {r.dtype:<10} {r.gpu_experts:>7}  {r.command}"
        )

    lines += [line(str(r.rank), r) for r in advice.rows]
    if not advice.rows:
        lines.append("  (no configuration fits this machine or passes the fidelity floor)")
    if advice.references:
        lines.append("reference lines (bounds, not realisable):")
        lines += [line("-", r) for r in advice.references]
    notes = [f"{advice.skipped} budgets skipped (do not fit)"]
    if advice.below_floor:
        notes.append(f"{advice.below_floor} below --min-gate-mass {advice.min_gate_mass}")
    if advice.failed:
        notes.append(f"{advice.failed} failed")
    lines.append("; ".join(notes))
    return "\n".join(lines)
