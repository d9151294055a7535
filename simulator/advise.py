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

from daopsim.simulator.errors import UserError

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
    #: the row's all-GPU bound (docs/metrics.md, "Bounds"): tokens/s and the runtime it ran on
    bound_tokens_per_s: float | None = None
    bound_runtime: str | None = None

    @property
    def of_bound(self) -> float | None:
        """``tokens_per_s`` as a share of the all-GPU bound (at most 1)."""
        if not self.bound_tokens_per_s:
            return None
        return self.tokens_per_s / self.bound_tokens_per_s

    @property
    def options_text(self) -> str:
        """The searched options as ``k=v`` (``-`` for none)."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.options.items())) or "-"


@dataclass
class Advice:
    """The ranked table (``rows``), bound reference lines and what was left out."""

    model: str
    hw: str
    trace: str
    sequences: int
    min_gate_mass: float | None
    #: how to get the trace on another machine: ``None`` for a bundled trace or a file the user
    #: gave, else the ``daopsim synth`` command that writes the same synthetic trace
    trace_synth: str | None = None
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


def find_trace(model: str, trace: str | None) -> tuple[str, list[str]]:
    """The trace to search on, and the ``daopsim run`` arguments that name it as a user would
    on any machine: ``--trace NAME`` for a bundled trace, ``--trace PATH`` as given for a file,
    ``--model M`` for the model's synthetic trace (``run --model`` makes the same file)."""
    from daopsim.simulator.data import bundled_traces, resolve_trace
    from daopsim.simulator.synth import PRESETS
    from daopsim.simulator.trace import read_meta
    from daopsim.simulator.trace_cache import model_trace

    if trace is not None:
        path = resolve_trace(trace)
        got = read_meta(path).model.name
        if got != model:
            raise UserError(f"--trace {trace}: records model {got!r}, not {model!r}")
        return str(path), ["--trace", trace]
    bundled = bundled_traces()
    if model in bundled:  # the trace named after the model first (not the small CI one)
        return str(bundled[model]), ["--trace", model]
    for name, path in bundled.items():
        if read_meta(path).model.name == model:
            return str(path), ["--trace", name]
    if not [p for p in PRESETS.values() if p.model == model]:
        raise UserError(
            f"no bundled trace or synth preset for model {model!r}; give --trace PATH "
            "(record one with `daopsim capture` or make one with `daopsim synth`)"
        )
    return model_trace(model, None), ["--model", model]


def synth_command(model: str) -> str:
    """The ``daopsim synth`` command that writes the synthetic trace ``--model M`` runs on."""
    from daopsim.simulator.trace_cache import MODEL_TRACE

    return shlex.join(
        [
            "daopsim",
            "synth",
            "--model",
            model,
            "--sequences",
            str(MODEL_TRACE["sequences"]),
            "--prompt-tokens",
            str(MODEL_TRACE["prompt_tokens"]),
            "--output-tokens",
            str(MODEL_TRACE["output_tokens"]),
            "--seed",
            str(MODEL_TRACE["seed"]),
            "-o",
            f"{model}.parquet",
        ]
    )


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


def command_for(row: dict[str, Any], hw: str, trace_args: list[str], sequences: int) -> str:
    """The ``daopsim run`` command that reproduces one sweep row."""
    parts = ["daopsim", "run", "--policy", row["policy"], "--hw", hw, *trace_args]
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
    from daopsim.policies.registry import available
    from daopsim.simulator.hardware import load_profile
    from daopsim.simulator.models import DTYPES, get_model
    from daopsim.simulator.runner import keeps_nothing_resident
    from daopsim.simulator.sweep import Grid, check_fidelity_floor, run_sweep
    from daopsim.simulator.trace import read_meta

    shape = get_model(model)
    profile = load_profile(hw)
    check_fidelity_floor(min_gate_mass)
    path, trace_args = find_trace(shape.name, trace)
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
    advice = Advice(
        shape.name,
        hw,
        trace_args[1] if trace_args[0] == "--trace" else f"synthetic ({shape.name})",
        SEQUENCES,
        min_gate_mass,
        trace_synth=synth_command(shape.name) if trace_args[0] == "--model" else None,
    )
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
            rows += _rows(df, ratio, hw, trace_args, unified, classes, shape)
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
    trace_args: list[str],
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
                command=command_for(rec, hw, trace_args, SEQUENCES),
                bound_tokens_per_s=_float_or_none(rec.get("bound_tokens_per_s")),
                bound_runtime=rec.get("bound_runtime"),
            )
        )
    return out


def _float_or_none(value: Any) -> float | None:
    if value is None or (isinstance(value, float) and value != value):
        return None
    return float(value)


#: Ranked rows ``daopsim advise`` prints unless ``--top`` says otherwise.
DEFAULT_TOP = 10
#: Width of the text table when the terminal's is not known.
DEFAULT_WIDTH = 100


def render(advice: Advice, top: int | None = DEFAULT_TOP, width: int | None = None) -> str:
    """The ranked table as text: the best ``top`` rows (``None`` or 0: all), then the reference
    lines and each row's command, at most ``width`` characters a line (default: the
    terminal's). ``--json``/``--csv`` have every row and column."""
    import shutil
    import textwrap

    width = max(80, width or shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)
    shown = advice.rows[:top] if top else list(advice.rows)
    listed = [*shown, *advice.references]

    def share(r: AdviceRow) -> str:
        return f"{r.of_bound:.0%}" if r.of_bound is not None else "n/a"

    # (header, width, alignment, cell): the policy and dtype columns as wide as their values
    cols: list[tuple[str, int, str, Callable[[AdviceRow], str]]] = [
        ("tokens/s", 9, ">", lambda r: f"{r.tokens_per_s:.2f}"),
        ("%bound", 6, ">", share),
        ("TTFT s", 7, ">", lambda r: f"{r.ttft_s:.3f}"),
        ("fidelity", 8, ">", lambda r: f"{r.gate_mass_preserved:.3f}"),
        ("bottleneck", 10, "<", lambda r: r.bottleneck),
        ("policy", max([6, *(len(r.policy) for r in listed)]), "<", lambda r: r.policy),
        ("dtype", max([5, *(len(r.dtype) for r in listed)]), "<", lambda r: r.dtype),
        ("experts", 7, ">", lambda r: str(r.gpu_experts)),
    ]
    min_options = 12
    for drop in ("TTFT s", "bottleneck"):  # narrow terminals: --json/--csv keep them
        if 5 + sum(w + 2 for _, w, _, _ in cols) + min_options <= width:
            break
        cols = [c for c in cols if c[0] != drop]
    opt_width = max(min_options, width - 5 - sum(w + 2 for _, w, _, _ in cols))

    def cut(text: str, n: int) -> str:
        return text if len(text) <= n else text[: n - 1] + "~"

    def row_text(tag: str, cells: list[str], options: str) -> str:
        parts = [f"{tag:>3}"] + [
            f"{cut(c, w):{a}{w}}" for c, (_, w, a, _) in zip(cells, cols, strict=True)
        ]
        return ("  ".join(parts) + "  " + cut(options, opt_width)).rstrip()

    def line(tag: str, r: AdviceRow) -> str:
        return row_text(tag, [f(r) for _, _, _, f in cols], r.options_text)

    trace = advice.trace if advice.trace_synth else Path(advice.trace).name
    lines = textwrap.wrap(
        f"advise: {advice.model} on {advice.hw}, trace {trace}, {advice.sequences} sequences "
        "each, ranked by tokens/s (simulated); % bound: share of the all-GPU bound at the same "
        "precision (docs/metrics.md)",
        width,
    )
    lines.append(row_text("#", [h for h, _, _, _ in cols], "options"))
    lines += [line(str(r.rank), r) for r in shown]
    if not advice.rows:
        lines.append("  (no configuration fits this machine or passes the fidelity floor)")
    hidden = len(advice.rows) - len(shown)
    if hidden:
        lines += textwrap.wrap(
            f"  ... {_count(hidden, 'more ranked row')} (--top 0 shows all; --json or --csv "
            "has every row)",
            width,
        )
    if advice.references:
        lines.append("reference lines (bounds, not realisable):")
        lines += [line("-", r) for r in advice.references]
    bounds = {}
    for r in [*advice.rows, *advice.references]:
        if r.bound_tokens_per_s is not None:
            bounds.setdefault(r.dtype, (r.bound_tokens_per_s, r.bound_runtime))
    for dtype, (tps, rt) in bounds.items():
        lines += textwrap.wrap(
            f"all-GPU bound at {dtype}: {tps:.2f} tokens/s (every expert resident, runtime {rt})",
            width,
        )
    notes = [f"{_count(advice.skipped, 'budget')} skipped (do not fit)"]
    if advice.below_floor:
        notes.append(f"{advice.below_floor} below --min-gate-mass {advice.min_gate_mass}")
    if advice.failed:
        notes.append(f"{advice.failed} failed")
    lines += textwrap.wrap("; ".join(notes), width)
    if advice.trace_synth:
        lines += textwrap.wrap(
            f"the trace is synthetic: `--model {advice.model}` (in the commands below) makes "
            "the same one on any machine; to write it to a file:",
            width,
        )
        lines += _wrap_command("    ", advice.trace_synth, width)
    lines.append("commands:")
    for tag, r in [*((str(r.rank), r) for r in shown), *(("-", r) for r in advice.references)]:
        lines += _wrap_command(f"{tag:>3}  ", r.command, width)
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _wrap_command(prefix: str, command: str, width: int) -> list[str]:
    """A shell command over several lines (``\\`` continuations), each at most ``width``
    characters when its pieces allow; an option stays on the line of its value."""
    words = [shlex.quote(w) for w in shlex.split(command)]
    pieces: list[str] = []
    for w in words:
        if pieces and pieces[-1].startswith("--") and " " not in pieces[-1] and w[0] != "-":
            pieces[-1] += " " + w
        else:
            pieces.append(w)
    out: list[str] = []
    cur = prefix
    indent = " " * (len(prefix) + 4)
    for piece in pieces:
        if cur.strip() and cur not in (prefix, indent) and len(cur) + len(piece) + 2 > width:
            out.append(cur.rstrip() + " \\")
            cur = indent
        cur += piece + " "
    out.append(cur.rstrip())
    return out


def to_csv(advice: Advice) -> str:
    """Every row (ranked, then the reference lines) as CSV, every column (``advise --csv``)."""
    import io

    cols = [f for f in AdviceRow.__dataclass_fields__ if f not in ("options",)]
    recs = []
    for r in [*advice.rows, *advice.references]:
        rec = {c: getattr(r, c) for c in cols}
        rec["options"] = r.options_text if r.options else ""
        rec["of_bound"] = r.of_bound
        recs.append(rec)
    buf = io.StringIO()
    pd.DataFrame(recs, columns=[*cols, "options", "of_bound"]).to_csv(buf, index=False)
    return buf.getvalue()
