"""``daopsim advise``: for a model on one or several machines, search policies, their options,
memory budgets, precisions and (on request) runtimes; rank what it finds.

The search (docs/advise.md, "The search") is a set of ordinary sweep configurations
(simulator/sweep.py) run in one pool, so ``--workers`` and Dask work as they do for ``daopsim
sweep`` and every row is the ``simulate()`` call its printed ``daopsim run`` command makes.

- Every policy runs with every option at its default, and with each other value of an option
  that ``daopsim policies list`` lists (the choices, both values of a bool), one option at a
  time, at the largest budget that fits.
- An option with a searched range (``Param.search``: llama.cpp's ``n_cpu_moe`` and ``ngl``,
  KTransformers' GPU experts per layer, vLLM's offloaded layers) is tried over its whole range
  on a coarse grid, then every value around the best is tried (:func:`_refine`), at the
  largest budget and at a quarter of the experts; the other options' values are then tried at
  the best value found.
- Bounds (clairvoyant, all-GPU) run at the largest budget as reference lines, never ranked.

Rows with identical results are grouped with the reason (:func:`tie_reason`); rows are ranked
by tokens/s; the best row of each precision and, with a ``min_tokens_per_s`` target, each
machine's best and the cheapest machine that reaches it are reported.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from daopsim.simulator.errors import UserError, did_you_mean

#: Smaller cache ratios tried beside the largest budget that fits.
SMALL_RATIOS = (0.25,)
#: Precisions tried when ``--dtype`` is not given (the trace's own one is added first).
DEFAULT_DTYPES = ("q4_k_m",)
#: Evaluation sequences per run (a small, fast search).
SEQUENCES = 2
#: At most this many values of a searched range on the coarse grid (the ends included).
COARSE_POINTS = 9
#: A bracket around the best value with at most this many untried values is tried whole;
#: a wider one gets this many evenly spaced values, and is narrowed again (up to
#: :data:`REFINE_PASSES` passes).
REFINE_ALL = 12
REFINE_PASSES = 3


@dataclass
class AdviceRow:
    """One configuration of the search, with its metrics and the command that reproduces it."""

    rank: int | None
    hw: str
    policy: str
    runtime: str
    dtype: str
    cache_ratio: float | None
    #: the budget the run was given, and the most experts it kept resident at once
    gpu_experts: int
    resident_experts: int
    options: dict[str, Any]
    tokens_per_s: float
    ttft_s: float
    #: routing fidelity: the share of the true gate mass in the route used
    gate_mass_preserved: float | None
    #: the share of the true gate mass computed exactly, at the trace's own precision: 0 for
    #: experts at a lossy precision (docs/advise.md, "Fidelity")
    fidelity: float | None
    hit_rate: float
    tokens_per_kj: float | None
    bottleneck: str
    reference: bool
    command: str
    #: the row's all-GPU bound (docs/metrics.md, "Bounds"): tokens/s and the runtime it ran on
    bound_tokens_per_s: float | None = None
    bound_runtime: str | None = None
    #: other configurations with exactly this row's results, and why they tie
    tied: list[dict[str, Any]] = field(default_factory=list)
    tie_reason: str | None = None

    @property
    def of_bound(self) -> float | None:
        """``tokens_per_s`` as a share of the all-GPU bound (at most 1)."""
        if not self.bound_tokens_per_s:
            return None
        return self.tokens_per_s / self.bound_tokens_per_s

    @property
    def options_text(self) -> str:
        """The options that differ from their defaults as ``k=v`` (``-`` for none)."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.options.items())) or "-"


@dataclass
class MachineAnswer:
    """One machine's best configuration, against the target when there is one."""

    hw: str
    best_tokens_per_s: float | None
    best_rank: int | None
    best_command: str | None
    meets_target: bool | None
    price: float | None
    tokens_per_kj: float | None


@dataclass
class Advice:
    """The ranked table (``rows``), bound reference lines and what was left out."""

    model: str
    #: the machines searched, as given (comma-joined, as on the command line)
    hw: str
    trace: str
    sequences: int
    min_gate_mass: float | None
    #: how to get the trace on another machine: ``None`` for a bundled trace or a file the user
    #: gave, else the ``daopsim synth`` command that writes the same synthetic trace
    trace_synth: str | None = None
    runtimes: list[str] | None = None
    min_tokens_per_s: float | None = None
    rows: list[AdviceRow] = field(default_factory=list)
    references: list[AdviceRow] = field(default_factory=list)
    #: per precision (and machine), the rank of its best row
    best_per_precision: list[dict[str, Any]] = field(default_factory=list)
    machines: list[MachineAnswer] = field(default_factory=list)
    #: the machine the target question is answered with (None without a target or when no
    #: machine reaches it), and how machines were ordered
    answer: str | None = None
    order: str | None = None
    notes: list[str] = field(default_factory=list)
    runs: int = 0
    skipped: int = 0
    failed: int = 0
    below_floor: int = 0
    below_target: int = 0

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


def exact_precision(dtype: str, reference: str) -> bool:
    """Whether experts at ``dtype`` compute what the trace's model (at ``reference``) does:
    a floating-point format of at least as many bits. Anything else (fp8, int8, int4, GGUF,
    MXFP4, HQQ) is lossy, and how much it loses is not modelled."""
    from daopsim.simulator.models import DTYPES

    d, ref = DTYPES.get(dtype), DTYPES.get(reference)
    if d is None or ref is None:
        return dtype == reference
    return d.kind == "float" and d.bits >= ref.bits


def fidelity(row: dict[str, Any], reference_dtype: str) -> float | None:
    """The share of the true gate mass computed exactly (docs/advise.md, "Fidelity"): the
    routing's preserved gate mass less the part computed from low-bit copies, and 0 when the
    experts' precision is lossy against the trace's own."""
    kept = _float_or_none(row.get("gate_mass_preserved"))
    if kept is None:
        return None
    if not exact_precision(str(row["dtype"]), reference_dtype):
        return 0.0
    return max(0.0, kept - (_float_or_none(row.get("low_precision_gate_mass")) or 0.0))


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


def is_bound(cls: Any) -> bool:
    """A clairvoyant or otherwise unrealisable policy: a reference line, not advice."""
    return bool(getattr(cls, "clairvoyant", False) or getattr(cls, "bound", False))


# -- the search space -------------------------------------------------------------------------
def listed_values(param: Any) -> list[Any]:
    """The values of an option ``daopsim policies list`` lists besides its default: its
    choices, or the other value of a bool (a searched range is apart: :func:`range_of`)."""
    if param.choices:
        return [c for c in param.choices if c != param.default]
    if param.type is bool:
        return [not param.default]
    return []


def range_of(param: Any, model: Any) -> tuple[int, int] | None:
    """The inclusive integer range of a searched option (``Param.search``) for ``model``."""
    name = getattr(param, "search", None)
    if not name:
        return None
    from daopsim.policies.options import search_range

    return search_range(name, model)


def coarse(lo: int, hi: int, points: int = COARSE_POINTS) -> list[int]:
    """At most ``points`` values from ``lo`` to ``hi``, both ends included, evenly spaced."""
    if hi - lo + 1 <= points:
        return list(range(lo, hi + 1))
    step = (hi - lo) / (points - 1)
    return sorted({lo + round(i * step) for i in range(points)} | {hi})


def one_at_a_time(cls: Any, base: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """``base`` (default: every option at its default) and, for each option that is not a
    searched range, ``base`` with that option at each of its other listed values."""
    start = dict(base or {})
    out = [start]
    for name, param in cls.params.items():
        if getattr(param, "search", None):
            continue
        for value in listed_values(param):
            if start.get(name, param.default) != value:
                out.append({**start, name: value})
    return out


def _refine(tried: dict[int, float | None], lo: int, hi: int) -> list[int]:
    """Values to try next around the best of ``tried`` (value -> tokens/s, None: did not fit or
    failed): every untried integer between the best one's tried neighbours when there are at
    most :data:`REFINE_ALL`, else that many evenly spaced. Empty when the best is resolved."""
    ok = {v: t for v, t in tried.items() if t is not None}
    if not ok:
        return []
    best = max(ok, key=lambda v: (ok[v], -v))
    below = [v for v in tried if v < best]
    above = [v for v in tried if v > best]
    left = max(below) if below else lo
    right = min(above) if above else hi
    gap = [v for v in range(left, right + 1) if v not in tried]
    if len(gap) <= REFINE_ALL:
        return gap
    step = (len(gap) - 1) / (REFINE_ALL - 1)
    return sorted({gap[round(i * step)] for i in range(REFINE_ALL)})


@dataclass
class _Point:
    """One searched (machine, precision, memory point, runtime)."""

    hw: str
    dtype: str
    ratio: float | None
    runtime: str | None

    def grid(self, path: str, sequences: int, variants: dict[str, list[dict[str, Any]]]) -> Any:
        from daopsim.simulator.sweep import Grid

        return Grid(
            policies=list(variants),
            hw=[self.hw],
            traces=[path],
            cache_ratios=[self.ratio] if self.ratio is not None else [],
            sequences=sequences,
            dtype=self.dtype,
            runtimes=[self.runtime] if self.runtime is not None else [],
            variants=variants,
        )


def _check_inputs(
    model: str,
    hws: list[str],
    dtypes: list[str] | None,
    policies: list[str] | None,
    runtimes: list[str] | None,
    min_tokens_per_s: float | None,
    prices: dict[str, float] | None,
    sequences: int,
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Every name and number checked before any run: the model, the machines (their
    profiles), the precisions, policies, runtimes, target and prices."""
    from daopsim.policies.registry import available, get_policy_class
    from daopsim.simulator.hardware import load_profile
    from daopsim.simulator.models import DTYPES, get_model
    from daopsim.simulator.runtime_profiles import get_runtime

    shape = get_model(model)
    if not hws:
        raise UserError("--hw: no machine given")
    if len(set(hws)) != len(hws):
        dup = next(h for h in hws if hws.count(h) > 1)
        raise UserError(f"--hw: machine {dup!r} given twice")
    profiles = {h: load_profile(h) for h in hws}
    for d in dtypes or []:
        if d not in DTYPES:
            raise UserError(f"--dtype: unknown precision {d!r}{did_you_mean(d, DTYPES)}")
    registered = available()
    classes: dict[str, Any] = {}
    for p in policies or list(registered):
        if p not in registered:
            try:
                classes[p] = get_policy_class(p)  # PATH.py:CLASS, or a clear unknown-name error
            except UserError as exc:
                raise UserError(f"--policies: {exc}") from None
        else:
            classes[p] = registered[p]
    for r in runtimes or []:
        get_runtime(r)
    if min_tokens_per_s is not None and not (
        math.isfinite(min_tokens_per_s) and min_tokens_per_s > 0
    ):
        raise UserError(f"--min-tokens-per-s must be a positive number, got {min_tokens_per_s}")
    for h, v in (prices or {}).items():
        if h not in profiles:
            raise UserError(f"--price: machine {h!r} is not searched{did_you_mean(h, profiles)}")
        if not (math.isfinite(v) and v >= 0):
            raise UserError(f"--price {h}: must be a non-negative number, got {v}")
    if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 1:
        raise UserError(f"--sequences must be a positive integer, got {sequences!r}")
    return shape, profiles, classes


def advise(
    model: str,
    hw: str | list[str],
    trace: str | None = None,
    dtypes: list[str] | None = None,
    min_gate_mass: float | None = None,
    policies: list[str] | None = None,
    executor: str = "local",
    workers: int | None = None,
    scheduler: str | None = None,
    progress: bool = True,
    runtimes: list[str] | None = None,
    min_tokens_per_s: float | None = None,
    prices: dict[str, float] | None = None,
    sequences: int = SEQUENCES,
) -> Advice:
    """Search policies, options, budgets, precisions (and ``runtimes``) on each machine of
    ``hw``; the rows ranked by tokens/s (docs/advise.md).

    ``policies`` narrows the search (default: every registered policy); ``runtimes`` runs
    every policy under each of these runtimes instead of its own; ``min_tokens_per_s`` is a
    target: rows below it are left out and each machine is judged against it, the cheapest
    that reaches it (by ``prices``, name -> amount, else by energy per token) named.
    """
    from daopsim.simulator.sweep import check_fidelity_floor
    from daopsim.simulator.trace import read_meta

    hws = [hw] if isinstance(hw, str) else list(hw)
    shape, profiles, classes = _check_inputs(
        model, hws, dtypes, policies, runtimes, min_tokens_per_s, prices, sequences
    )
    check_fidelity_floor(min_gate_mass)
    path, trace_args = find_trace(shape.name, trace)
    own = read_meta(path).model.dtype
    search_dtypes = list(dict.fromkeys(dtypes or [own, *DEFAULT_DTYPES]))
    rts: list[str | None] = list(dict.fromkeys(runtimes)) if runtimes else [None]
    advice = Advice(
        shape.name,
        ",".join(hws),
        trace_args[1] if trace_args[0] == "--trace" else f"synthetic ({shape.name})",
        sequences,
        min_gate_mass,
        trace_synth=synth_command(shape.name) if trace_args[0] == "--model" else None,
        runtimes=list(runtimes) if runtimes else None,
        min_tokens_per_s=min_tokens_per_s,
    )
    search = _Search(path, sequences, shape, classes, executor, workers, scheduler, progress)
    points = [
        _Point(h, d, r, rt)
        for h in hws
        for d in search_dtypes
        for r in (None, *SMALL_RATIOS)
        for rt in rts
    ]
    _search_coarse(search, points, classes, shape)
    _search_refined(search, points, classes, shape)
    _search_other_options(search, points, classes, shape)
    rows = search.rows(hws, trace_args, profiles, own, sequences, runtimes)
    advice.runs = search.n_runs
    advice.skipped = search.skipped
    advice.failed = search.failed
    _rank(advice, rows, min_gate_mass, min_tokens_per_s, prices, shape)
    return advice


def _search_coarse(
    search: _Search, points: list[_Point], classes: dict[str, Any], shape: Any
) -> None:
    """Stage 1: each policy's defaults, its listed values one at a time and its ranges at
    coarse steps on every point; a bound only at the largest budget."""
    from daopsim.simulator.runner import keeps_nothing_resident

    for pt in points:
        for pol, cls in classes.items():
            if is_bound(cls):
                if pt.ratio is None:
                    search.add(pt, pol, {})
                continue
            if pt.ratio is not None and keeps_nothing_resident(cls):
                continue  # its budget is scratch space: one memory point is enough
            ranges = {k: range_of(p, shape) for k, p in cls.params.items()}
            for variant in one_at_a_time(cls) if pt.ratio is None else [{}]:
                search.add(pt, pol, variant)
            for name, rng in ranges.items():
                if rng is not None:
                    for v in coarse(*rng):
                        search.add(pt, pol, {name: v})
    search.run()


def _search_refined(
    search: _Search, points: list[_Point], classes: dict[str, Any], shape: Any
) -> None:
    """Stage 2: values around the best of each range, pass after pass until a pass adds
    nothing new (at most ``REFINE_PASSES``)."""
    for _ in range(REFINE_PASSES):
        added = 0
        for pt in points:
            for pol, cls in classes.items():
                if is_bound(cls):
                    continue
                for name, param in cls.params.items():
                    rng = range_of(param, shape)
                    if rng is None:
                        continue
                    for v in _refine(search.tried(pt, pol, name), *rng):
                        added += search.add(pt, pol, {name: v})
        if not added:
            break
        search.run()


def _search_other_options(
    search: _Search, points: list[_Point], classes: dict[str, Any], shape: Any
) -> None:
    """Stage 3, at the largest budget: each policy's other options one at a time, with a
    ranged option held at its best value."""
    for pt in points:
        if pt.ratio is not None:
            continue
        for pol, cls in classes.items():
            for name, param in cls.params.items():
                rng = range_of(param, shape)
                best = None if rng is None else search.best(pt, pol, name)
                if best is not None:
                    for variant in one_at_a_time(cls, {name: best})[1:]:
                        search.add(pt, pol, variant)
    search.run()


class _Search:
    """The configurations of a search, run batch by batch in one pool each, and their rows."""

    def __init__(
        self,
        path: str,
        sequences: int,
        shape: Any,
        classes: dict[str, Any],
        executor: str,
        workers: int | None,
        scheduler: str | None,
        progress: bool,
    ) -> None:
        self.path, self.sequences, self.shape, self.classes = path, sequences, shape, classes
        self.executor, self.workers, self.scheduler = executor, workers, scheduler
        self.progress = progress
        #: per point and policy, the option variants asked for (in order) and their rows
        self.pending: dict[tuple[int, str], list[dict[str, Any]]] = {}
        self.points: list[_Point] = []
        self.results: list[tuple[_Point, dict[str, Any], dict[str, Any]]] = []
        self.seen: set[tuple[Any, ...]] = set()
        self.n_runs = self.skipped = self.failed = 0

    def _pt(self, pt: _Point) -> int:
        if pt not in self.points:
            self.points.append(pt)
        return self.points.index(pt)

    def add(self, pt: _Point, policy: str, variant: dict[str, Any]) -> int:
        """Ask for ``policy`` with the options ``variant`` at ``pt`` (1 if new, else 0)."""
        cls = self.classes[policy]
        resolved = cls.resolve_options(dict(variant))
        ident = (pt.hw, pt.dtype, pt.ratio, pt.runtime, policy, _key(resolved))
        if ident in self.seen:
            return 0
        self.seen.add(ident)
        self.pending.setdefault((self._pt(pt), policy), []).append(dict(variant))
        return 1

    def run(self) -> None:
        """Run every configuration asked for since the last call, in one pool."""
        from daopsim.simulator.sweep import expand, run_configs

        if not self.pending:
            return
        configs: list[Any] = []
        owners: list[_Point] = []
        by_point: dict[int, dict[str, list[dict[str, Any]]]] = {}
        for (i, pol), variants in self.pending.items():
            by_point.setdefault(i, {})[pol] = variants
        for i, variants in by_point.items():
            pt = self.points[i]
            got = expand(pt.grid(self.path, self.sequences, variants))
            configs += got
            owners += [pt] * len(got)
        self.pending = {}
        rows = run_configs(
            configs,
            executor=self.executor,
            workers=self.workers,
            scheduler=self.scheduler,
            progress=self.progress,
            label="advise",
        )
        for pt, cfg, row in zip(owners, configs, rows, strict=True):
            self.n_runs += 1
            self.skipped += row.get("status") == "skipped"
            self.failed += row.get("status") == "error"
            self.results.append((pt, dict(cfg.options), row))

    def tried(self, pt: _Point, policy: str, name: str) -> dict[int, float | None]:
        """Values of the range option ``name`` tried at ``pt`` with every other option at its
        default: value -> tokens/s (None when it did not fit or failed)."""
        cls = self.classes[policy]
        defaults = cls.resolve_options({})
        out: dict[int, float | None] = {}
        for p, opts, row in self.results:
            if p != pt or row["policy"] != policy:
                continue
            if any(v != defaults[k] for k, v in opts.items() if k != name):
                continue
            value = int(opts[name])
            if value == defaults[name] and value < 0:
                continue  # the default's own meaning (-1: all, or as many as fit)
            ok = row.get("status") == "ok"
            out[value] = float(row["tokens_per_s"]) if ok else None
        return out

    def best(self, pt: _Point, policy: str, name: str) -> int | None:
        """The range value with the most tokens/s at ``pt`` (others at their defaults)."""
        ok = {v: t for v, t in self.tried(pt, policy, name).items() if t is not None}
        return max(ok, key=lambda v: (ok[v], -v)) if ok else None

    def rows(
        self,
        hws: list[str],
        trace_args: list[str],
        profiles: dict[str, Any],
        own: str,
        sequences: int,
        runtimes: list[str] | None,
    ) -> list[AdviceRow]:
        """Every finished configuration as an advice row."""
        out = []
        for pt, opts, row in self.results:
            if row.get("status") != "ok":
                continue
            cls = self.classes[row["policy"]]
            changed = {
                k: _declared_type(cls.params[k].type, v)
                for k, v in opts.items()
                if k in cls.params and v != cls.params[k].default
            }
            out.append(
                AdviceRow(
                    rank=None,
                    hw=pt.hw,
                    policy=str(row["policy"]),
                    runtime=str(row["runtime"]),
                    dtype=str(row["dtype"]),
                    cache_ratio=pt.ratio,
                    gpu_experts=int(row["gpu_experts"]),
                    resident_experts=int(row.get("max_slots_held") or 0),
                    options=changed,
                    tokens_per_s=float(row["tokens_per_s"]),
                    ttft_s=float(row["ttft_s"]),
                    gate_mass_preserved=_float_or_none(row.get("gate_mass_preserved")),
                    fidelity=fidelity(row, own),
                    hit_rate=float(row["hit_rate"]),
                    tokens_per_kj=_float_or_none(row.get("tokens_per_kj")),
                    bottleneck=bottleneck(row, profiles[pt.hw].link.unified),
                    reference=is_bound(cls),
                    command=command_for(
                        row["policy"], pt, changed, trace_args, sequences, runtimes
                    ),
                    bound_tokens_per_s=_float_or_none(row.get("bound_tokens_per_s")),
                    bound_runtime=row.get("bound_runtime"),
                )
            )
        return out


def _key(options: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, repr(v)) for k, v in options.items()))


def _declared_type(typ: type, value: Any) -> Any:
    """A table cell back as the option's declared Python type (int, float, bool or str)."""
    if typ is bool:
        return bool(value)
    if typ is int:
        return int(value)
    if typ is float:
        return float(value)
    return str(value)


def command_for(
    policy: str,
    pt: _Point,
    options: dict[str, Any],
    trace_args: list[str],
    sequences: int,
    runtimes: list[str] | None = None,
) -> str:
    """The ``daopsim run`` command that reproduces one row."""
    parts = ["daopsim", "run", "--policy", policy, "--hw", pt.hw, *trace_args]
    parts += ["--sequences", str(sequences), "--dtype", pt.dtype]
    if pt.ratio is not None:
        parts += ["--cache-ratio", repr(float(pt.ratio))]
    if pt.runtime is not None:
        parts += ["--runtime", pt.runtime]
    for k, v in sorted(options.items()):
        parts += ["--policy-opt", f"{k}={v}"]
    return shlex.join(parts)


# -- ranking, ties, the target ----------------------------------------------------------------
def _result_key(r: AdviceRow) -> tuple[Any, ...]:
    """What two rows must share to tie: machine, precision, runtime and every result shown."""
    return (r.hw, r.dtype, r.runtime, r.tokens_per_s, r.ttft_s, r.gate_mass_preserved, r.fidelity)


def tie_reason(group: list[AdviceRow], shape: Any) -> str:
    """Why the configurations of ``group`` (identical results) tie, in one line."""
    from daopsim.policies.caching import CachingPolicy
    from daopsim.policies.registry import get_policy_class

    total = shape.total_experts
    one_policy = len({r.policy for r in group}) == 1
    if all(r.resident_experts >= total for r in group):
        what = "these option values do not matter" if one_policy else "the policy does not matter"
        return f"every expert fits and stays resident: {what}"
    per_layer = min(r.gpu_experts for r in group) // max(1, shape.moe_layers)
    caches = all(
        issubclass(get_policy_class(r.policy), CachingPolicy) for r in group if _is_name(r.policy)
    )
    if caches and per_layer <= shape.top_k:
        return (
            f"at most top-k ({shape.top_k}) experts per layer: per-layer caches hold only the "
            "last token's experts, so they cannot differ"
        )
    if one_policy:
        return "these option values do not change this policy's decisions here"
    return "these policies make the same decisions here"


def _is_name(policy: str) -> bool:
    from daopsim.policies.registry import is_policy_file

    return not is_policy_file(policy)


def _rank(
    advice: Advice,
    rows: list[AdviceRow],
    min_gate_mass: float | None,
    min_tokens_per_s: float | None,
    prices: dict[str, float] | None,
    shape: Any,
) -> None:
    """Floors, ranking, tie groups, the best row per precision, the machines' answers."""
    refs = [r for r in rows if r.reference]
    ranked = _unique_rows(rows)
    if min_gate_mass is not None:
        kept = [r for r in ranked if (r.gate_mass_preserved or 0.0) >= min_gate_mass]
        advice.below_floor = len(ranked) - len(kept)
        ranked = kept
    everything = list(ranked)
    if min_tokens_per_s is not None:
        kept = [r for r in ranked if r.tokens_per_s >= min_tokens_per_s]
        advice.below_target = len(ranked) - len(kept)
        ranked = kept
    ranked.sort(key=_rank_order)
    leaders = _tie_groups(ranked, shape)
    leaders.sort(key=_rank_order)
    for i, r in enumerate(leaders, 1):
        r.rank = i
    advice.rows = leaders
    advice.references = sorted(refs, key=lambda r: (r.hw, -r.tokens_per_s, r.policy, r.dtype))
    advice.best_per_precision.extend(_best_per_precision(leaders))
    _machines(advice, everything, leaders, min_tokens_per_s, prices)
    _notes(advice, leaders, shape)


def _unique_rows(rows: list[AdviceRow]) -> list[AdviceRow]:
    """The searched rows (not the references), one per distinct result of a configuration: a
    budget the policy does not use gives the largest budget's results again, and that one is
    kept."""
    # the largest budget first: its row stands for a smaller budget that changes nothing
    ranked = sorted((r for r in rows if not r.reference), key=lambda r: r.cache_ratio is not None)
    unique: dict[tuple[Any, ...], AdviceRow] = {}
    for r in ranked:
        ident = (r.hw, r.policy, r.runtime, r.dtype, r.options_text, _result_key(r))
        unique.setdefault(ident, r)
    return list(unique.values())


def _rank_order(r: AdviceRow) -> tuple[Any, ...]:
    """The ranking key: tokens/s first, then fidelity, gate mass, TTFT, fewer resident experts;
    among equal results the shortest command leads (fewer options, the default budget)."""
    return (
        -r.tokens_per_s,
        -(r.fidelity if r.fidelity is not None else -1.0),
        -(r.gate_mass_preserved if r.gate_mass_preserved is not None else -1.0),
        r.ttft_s,
        r.resident_experts,
        len(r.options),
        r.cache_ratio is not None,
        r.hw,
        r.policy,
        r.runtime,
        r.dtype,
        r.options_text,
    )


def _tie_groups(ranked: list[AdviceRow], shape: Any) -> list[AdviceRow]:
    """The leader of each group of rows with the same results (in ``ranked``'s order), the
    others listed on it as tied, with the reason they tie."""
    groups: dict[tuple[Any, ...], list[AdviceRow]] = {}
    for r in ranked:
        groups.setdefault(_result_key(r), []).append(r)
    leaders = []
    for group in groups.values():
        lead = group[0]
        if len(group) > 1:
            lead.tied = [
                {
                    "policy": r.policy,
                    "options": r.options,
                    "cache_ratio": r.cache_ratio,
                    "command": r.command,
                }
                for r in group[1:]
            ]
            lead.tie_reason = tie_reason(group, shape)
        leaders.append(lead)
    return leaders


def _best_per_precision(leaders: list[AdviceRow]) -> list[dict[str, Any]]:
    """The best ranked row of each (machine, precision), in rank order."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()
    for r in leaders:
        if (r.hw, r.dtype) not in seen:
            seen.add((r.hw, r.dtype))
            out.append(
                {
                    "hw": r.hw,
                    "dtype": r.dtype,
                    "rank": r.rank,
                    "tokens_per_s": r.tokens_per_s,
                    "fidelity": r.fidelity,
                    "gate_mass_preserved": r.gate_mass_preserved,
                    "policy": r.policy,
                    "runtime": r.runtime,
                    "command": r.command,
                }
            )
    return out


def _machines(
    advice: Advice,
    everything: list[AdviceRow],
    leaders: list[AdviceRow],
    target: float | None,
    prices: dict[str, float] | None,
) -> None:
    """Each machine's best row and, with a target, the cheapest machine that reaches it."""
    prices = prices or {}
    ranks = {id(r): r.rank for r in leaders}
    for h in advice.hw.split(","):
        mine = [r for r in everything if r.hw == h]
        best = max(mine, key=lambda r: r.tokens_per_s, default=None)
        advice.machines.append(
            MachineAnswer(
                hw=h,
                best_tokens_per_s=best.tokens_per_s if best else None,
                best_rank=ranks.get(id(best)) if best else None,
                best_command=best.command if best else None,
                meets_target=None if target is None else bool(best and best.tokens_per_s >= target),
                price=prices.get(h),
                tokens_per_kj=best.tokens_per_kj if best else None,
            )
        )
    if target is None:
        return
    if prices and len(prices) == len(advice.machines):
        advice.order = "price (--price)"
        key: Callable[[MachineAnswer], Any] = lambda m: (m.price, -(m.best_tokens_per_s or 0))  # noqa: E731
    else:
        advice.order = (
            "energy per generated token, tokens/kJ; --price for every machine orders by price"
        )
        key = lambda m: (-(m.tokens_per_kj or 0.0), -(m.best_tokens_per_s or 0))  # noqa: E731
    meeting = sorted((m for m in advice.machines if m.meets_target), key=key)
    rest = sorted(
        (m for m in advice.machines if not m.meets_target),
        key=lambda m: -(m.best_tokens_per_s or 0.0),
    )
    advice.machines = meeting + rest
    advice.answer = meeting[0].hw if meeting else None


def _notes(advice: Advice, leaders: list[AdviceRow], shape: Any) -> None:
    """One-line notes on what the ranking says and does not say."""
    top = leaders[:3]
    resident = bool(top) and all(r.resident_experts >= shape.total_experts for r in top)
    if resident and advice.runtimes is None and len({r.runtime for r in top}) > 1:
        advice.notes.append(
            "the best rows keep every expert resident: they differ by runtime, not by "
            "policy; --runtime NAME compares the policies under one runtime"
        )
    lossy = [r for r in leaders if r.fidelity == 0.0]
    if lossy:
        advice.notes.append(
            "fidelity 0 marked ~: experts at a lossy precision compute approximately (how much "
            "accuracy that costs is not modelled); ~ shows the routing's gate mass kept"
        )


def _float_or_none(value: Any) -> float | None:
    if value is None or (isinstance(value, float) and value != value):
        return None
    return float(value)


# -- text -------------------------------------------------------------------------------------
#: Ranked rows ``daopsim advise`` prints unless ``--top`` says otherwise.
DEFAULT_TOP = 10
#: Width of the text table when the terminal's is not known.
DEFAULT_WIDTH = 100


def _fidelity_text(exact: float | None, kept: float | None) -> str:
    """A fidelity cell: the exact share, or ``~`` and the routing's kept gate mass for
    experts at a lossy precision (docs/advise.md, "Fidelity")."""
    if exact is None:
        return "n/a"
    if exact == 0.0 and kept:
        return f"~{kept:.3f}"
    return f"{exact:.3f}"


def render(advice: Advice, top: int | None = DEFAULT_TOP, width: int | None = None) -> str:
    """The ranked table as text: the best ``top`` rows (``None`` or 0: all) with their tie
    groups, the reference lines, bounds, the best row per precision, the machines against
    the target, and each row's command, at most ``width`` characters a line where the
    pieces allow (default: the terminal's). ``--json``/``--csv`` have every row and column."""
    import shutil
    import textwrap

    width = max(80, width or shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)
    shown = advice.rows[:top] if top else list(advice.rows)
    several = "," in advice.hw
    table = _Table.fit([*shown, *advice.references], several, width)
    trace = advice.trace if advice.trace_synth else Path(advice.trace).name
    lines = textwrap.wrap(
        f"advise: {advice.model} on {advice.hw.replace(',', ', ')}, trace {trace}, "
        f"{advice.sequences} sequence{'s' * (advice.sequences != 1)} each, "
        f"{advice.runs} runs, ranked by tokens/s (simulated); %bound: share of the all-GPU "
        "bound at the same precision (docs/metrics.md); experts: the most kept resident",
        width,
    )
    lines += table.row("#", [h for h, _, _, _ in table.cols], "options")
    for r in shown:
        lines += table.entry(str(r.rank), r)
    if not advice.rows:
        lines.append("  (no configuration fits, passes the floors or reaches the target)")
    hidden = len(advice.rows) - len(shown)
    if hidden:
        lines += textwrap.wrap(
            f"  ... {_count(hidden, 'more ranked row')} (--top 0 shows all; --json or --csv "
            "has every row)",
            width,
        )
    if advice.references:
        lines.append("reference lines (bounds, not realisable):")
        for r in advice.references:
            lines += table.entry("-", r)
    lines += _bound_lines(advice, several, width)
    if advice.min_tokens_per_s is not None:
        lines += _target_lines(advice, width)
    lines += _closing_lines(advice, shown, width)
    return "\n".join(lines)


@dataclass
class _Table:
    """The ranked table's columns as they fit a terminal ``width`` characters wide, and its
    rows as lines."""

    #: (header, width, alignment, cell) per column
    cols: list[tuple[str, int, str, Callable[[AdviceRow], str]]]
    #: the options column's start and width
    lead: int
    opt_width: int
    width: int

    @classmethod
    def fit(cls, listed: list[AdviceRow], several: bool, width: int) -> _Table:
        """The columns for the rows ``listed`` (the name columns as wide as their values), the
        least needed dropped in turn while the options column would be under 12 characters."""

        def share(r: AdviceRow) -> str:
            return f"{r.of_bound:.0%}" if r.of_bound is not None else "n/a"

        def pol(r: AdviceRow) -> str:
            return r.policy + (f" +{len(r.tied)}" if r.tied else "")

        cols: list[tuple[str, int, str, Callable[[AdviceRow], str]]] = [
            ("tokens/s", 9, ">", lambda r: f"{r.tokens_per_s:.2f}"),
            ("%bound", 6, ">", share),
            ("TTFT s", 7, ">", lambda r: f"{r.ttft_s:.3f}"),
            ("fidelity", 8, ">", lambda r: _fidelity_text(r.fidelity, r.gate_mass_preserved)),
            ("bottleneck", 10, "<", lambda r: r.bottleneck),
        ]
        if several:
            cols.append(("machine", max([7, *(len(r.hw) for r in listed)]), "<", lambda r: r.hw))
        cols += [
            ("policy", max([6, *(len(pol(r)) for r in listed)]), "<", pol),
            ("runtime", max([7, *(len(r.runtime) for r in listed)]), "<", lambda r: r.runtime),
            ("dtype", max([5, *(len(r.dtype) for r in listed)]), "<", lambda r: r.dtype),
            ("experts", 7, ">", lambda r: str(r.resident_experts)),
        ]
        min_options = 12
        for drop in ("TTFT s", "bottleneck", "%bound"):  # narrow terminals: --json/--csv keep them
            if 5 + sum(w + 2 for _, w, _, _ in cols) + min_options <= width:
                break
            cols = [c for c in cols if c[0] != drop]
        lead = 5 + sum(w + 2 for _, w, _, _ in cols)
        return cls(cols, lead, max(min_options, width - lead), width)

    def row(self, tag: str, cells: list[str], options: str) -> list[str]:
        """One row's lines: its cells, then its options, never cut: the ones that do not fit
        go on lines of their own, under the options column."""
        parts = [f"{tag:>3}"] + [
            f"{c:{a}{w}}" for c, (_, w, a, _) in zip(cells, self.cols, strict=True)
        ]
        head = "  ".join(parts) + "  "
        pieces = options.split(",")
        out, cur = [], ""
        for i, piece in enumerate(pieces):
            piece += "," if i < len(pieces) - 1 else ""
            if cur and len(cur) + len(piece) > self.opt_width:
                out.append(cur)
                cur = ""
            cur += piece
        out.append(cur)
        lines = [(head + out[0]).rstrip() if len(out[0]) <= self.opt_width else head.rstrip()]
        for i, o in enumerate(out):
            if len(o) > self.opt_width:  # wider than the column: a line of its own, indented
                lines.append(" " * 8 + o)
            elif i:
                lines.append(" " * self.lead + o)
        return lines

    def entry(self, tag: str, r: AdviceRow) -> list[str]:
        """A result row's lines, with the rows tied with it and why."""
        import textwrap

        out = self.row(tag, [f(r) for _, _, _, f in self.cols], r.options_text)
        if r.tied:
            names = [_tie_label(t) for t in r.tied]
            out += textwrap.wrap(
                f"tied with {', '.join(names)}: {r.tie_reason}",
                self.width,
                initial_indent="      = ",
                subsequent_indent="        ",
            )
        return out


def _bound_lines(advice: Advice, several: bool, width: int) -> list[str]:
    """The all-GPU bound of each (machine, precision), and the best row of each precision
    when there are several."""
    import textwrap

    lines: list[str] = []
    bounds: dict[tuple[str, str], tuple[float, Any]] = {}
    for r in [*advice.rows, *advice.references]:
        if r.bound_tokens_per_s is not None:
            bounds.setdefault((r.hw, r.dtype), (r.bound_tokens_per_s, r.bound_runtime))
    for (h, dtype), (tps, rt) in bounds.items():
        on = f" on {h}" if several else ""
        lines += textwrap.wrap(
            f"all-GPU bound at {dtype}{on}: {tps:.2f} tokens/s (every expert resident, "
            f"runtime {rt})",
            width,
        )
    if len(advice.best_per_precision) > 1:
        lines.append("best per precision:")
        for b in advice.best_per_precision:
            on = f" on {b['hw']}" if several else ""
            fid = _fidelity_text(b["fidelity"], b["gate_mass_preserved"])
            lines.append(
                f"  {b['dtype']}{on}: #{b['rank']} {b['tokens_per_s']:.2f} tokens/s "
                f"({b['policy']}, fidelity {fid})"
            )
    return lines


def _closing_lines(advice: Advice, shown: list[AdviceRow], width: int) -> list[str]:
    """What was left out and why, the notes, how to make a synthetic trace, and each shown
    row's command."""
    import textwrap

    notes = [f"{_count(advice.skipped, 'run')} skipped (do not fit)"]
    if advice.below_floor:
        notes.append(f"{advice.below_floor} below --min-gate-mass {advice.min_gate_mass}")
    if advice.below_target:
        notes.append(f"{advice.below_target} below --min-tokens-per-s {advice.min_tokens_per_s}")
    if advice.failed:
        notes.append(f"{advice.failed} failed")
    lines = textwrap.wrap("; ".join(notes), width)
    for note in advice.notes:
        lines += textwrap.wrap(f"note: {note}", width, subsequent_indent="  ")
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
    return lines


def _tie_label(t: dict[str, Any]) -> str:
    opts = ",".join(f"{k}={v}" for k, v in sorted(t["options"].items()))
    label = t["policy"] + (f" ({opts})" if opts else "")
    if t.get("cache_ratio") is not None:
        label += f" at ratio {t['cache_ratio']}"
    return label


def _target_lines(advice: Advice, width: int) -> list[str]:
    import textwrap

    target = advice.min_tokens_per_s
    meeting = [m for m in advice.machines if m.meets_target]
    lines = [
        f"target {target} tokens/s: {len(meeting)} of {_count(len(advice.machines), 'machine')} "
        "reach it"
    ]
    for m in advice.machines:
        best = (
            "no configuration fits"
            if m.best_tokens_per_s is None
            else (f"best {m.best_tokens_per_s:.2f} tokens/s")
        )
        extra = []
        if m.price is not None:
            extra.append(f"price {m.price:g}")
        if m.tokens_per_kj is not None:
            extra.append(f"{m.tokens_per_kj:.1f} tokens/kJ")
        mark = "yes" if m.meets_target else "no "
        rank = f" (#{m.best_rank})" if m.best_rank is not None else ""
        lines.append(f"  {mark} {m.hw}: {best}{rank}" + (f", {', '.join(extra)}" if extra else ""))
    if advice.answer is not None:
        lines += textwrap.wrap(
            f"cheapest machine that reaches it: {advice.answer} (machines ordered by "
            f"{advice.order})",
            width,
        )
    else:
        lines.append("no machine reaches the target")
    return lines


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

    skip = ("options", "tied")
    cols = [f for f in AdviceRow.__dataclass_fields__ if f not in skip]
    recs = []
    for r in [*advice.rows, *advice.references]:
        rec = {c: getattr(r, c) for c in cols}
        rec["options"] = r.options_text if r.options else ""
        rec["of_bound"] = r.of_bound
        rec["tied"] = ";".join(_tie_label(t) for t in r.tied)
        recs.append(rec)
    buf = io.StringIO()
    pd.DataFrame(recs, columns=[*cols, "options", "of_bound", "tied"]).to_csv(buf, index=False)
    return buf.getvalue()
