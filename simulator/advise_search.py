"""The search of ``daopsim advise`` (docs/advise.md, "The search"): the space of each policy's
options (listed values one at a time, searched ranges on a coarse grid then refined around the
best), and running it as ordinary sweep configurations in one pool (``_Search``), each row with
the ``daopsim run`` command that reproduces it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from daopsim.simulator.advise_answer import AdviceRow, _float_or_none, bottleneck, fidelity

#: At most this many values of a searched range on the coarse grid (the ends included).
COARSE_POINTS = 9
#: A bracket around the best value with at most this many untried values is tried whole;
#: a wider one gets this many evenly spaced values, and is narrowed again (up to
#: :data:`REFINE_PASSES` passes).
REFINE_ALL = 12
REFINE_PASSES = 3


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
        from daopsim.simulator.grid import Grid

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


def _search_coarse(
    search: _Search, points: list[_Point], classes: dict[str, Any], shape: Any
) -> None:
    """Stage 1: each policy's defaults, its listed values one at a time and its ranges at
    coarse steps on every point; a bound only at the largest budget."""
    from daopsim.simulator.fit import keeps_nothing_resident

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
