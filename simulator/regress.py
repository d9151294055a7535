"""Policy-metric regression checks: run a fixed grid, compare with a committed baseline.

``run_grid`` simulates every (policy, machine, cache ratio) of a :class:`RegressGrid` in
process (``record=False``); ``compare`` sets the outcome beside a baseline file and lists every
value that moved: counts and bytes (integers) must match exactly, times and rates (floats) within
a relative tolerance, NaN (stored as null) equals NaN. A configuration that fails with a user
error (e.g. the budget does not fit the machine) is an outcome too: its one-line message is
recorded and compared. See docs/regression.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulator.data import CI_TRACE, bundled_dir, bundled_traces, resolve_trace
from simulator.errors import PolicyError, UserError

#: The bundled baseline ``daopsim regress`` compares with (baselines/policy-metrics.json).
DEFAULT_BASELINE = str(bundled_dir("baselines") / "policy-metrics.json")
#: Cache ratios of the built-in grid. Mixtral-8x7B on ci-small has 256 experts: 32, 48 and 96
#: resident experts (1, 1-2 and 3 per layer). 0.375 does not fit an RTX 4090 (55 fit), so that
#: cell records the "does not fit" outcome, which guards the memory model too.
DEFAULT_RATIOS = (0.125, 0.1875, 0.375)
DEFAULT_PROFILES = ("a6000-pcie4", "rtx4090-pcie4")
#: Relative tolerance for float metrics. The engine is deterministic and sums in a fixed order,
#: so on one platform results are bit-identical; the tolerance only absorbs last-digit
#: differences between numpy/libm builds (~1e-15 per operation, ~1e-12 after long sums). A real
#: change (one extra expert copy in a run) moves times by 1e-4 or more, far above it.
DEFAULT_TOLERANCE = 1e-6
#: Floats this close to each other count as equal whatever their size (values near zero).
ABS_TOLERANCE = 1e-12
FORMAT = "daopsim-regress/1"
GRID_KEYS = {
    "trace",
    "policies",
    "cache_ratios",
    "profiles",
    "sequences",
    "seed",
    "tolerance_time",
    "baseline",
    "policy_options",
}


def builtin_policies() -> list[str]:
    """Policies shipped in the ``policies`` package (third-party plugins excluded), sorted."""
    from policies.registry import available

    return [n for n, cls in available().items() if cls.__module__.startswith("policies.")]


@dataclass
class RegressGrid:
    """What ``daopsim regress`` runs: every policy x profile x cache ratio on one trace."""

    trace: str = CI_TRACE
    policies: list[str] | None = None  #: None means every built-in policy
    cache_ratios: list[float] = field(default_factory=lambda: list(DEFAULT_RATIOS))
    profiles: list[str] = field(default_factory=lambda: list(DEFAULT_PROFILES))
    sequences: int | None = None
    seed: int = 0
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    tolerance_time: float | None = None  #: from a grid file; the CLI flag wins
    baseline: str | None = None  #: from a grid file; the CLI flag wins

    def policy_names(self) -> list[str]:
        """The policies to run (the grid's list, or every built-in one)."""
        return list(self.policies) if self.policies is not None else builtin_policies()

    def describe(self) -> dict[str, Any]:
        """The grid as stored in the baseline (with the trace's content hash)."""
        path = resolve_trace(self.trace)
        return {
            "trace": self.trace,
            "trace_sha256": _sha256(path),
            "policies": self.policy_names(),
            "cache_ratios": list(self.cache_ratios),
            "profiles": list(self.profiles),
            "sequences": self.sequences,
            "seed": self.seed,
            "policy_options": self.policy_options,
        }


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_grid(path: str | Path) -> RegressGrid:
    """A grid from a TOML file; relative trace and baseline paths are relative to the file."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such grid file")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{p}: not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{p}: cannot read: {exc}") from None
    for key in data:
        if key not in GRID_KEYS:
            raise UserError(f"{p}: unknown key {key!r} (valid: {', '.join(sorted(GRID_KEYS))})")

    def strings(key: str) -> list[str] | None:
        v = data.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
            raise UserError(f"{p}: key {key!r} must be a non-empty list of strings")
        return list(v)

    grid = RegressGrid()
    if "trace" in data:
        t = data["trace"]
        if not isinstance(t, str) or not t:
            raise UserError(f"{p}: key 'trace' must be a bundled trace name or a path")
        near = p.parent / t
        grid.trace = str(near) if t not in bundled_traces() and near.exists() else t
    grid.policies = strings("policies")
    grid.profiles = strings("profiles") or grid.profiles
    if "cache_ratios" in data:
        r = data["cache_ratios"]
        if not isinstance(r, list) or not r:
            raise UserError(f"{p}: key 'cache_ratios' must be a non-empty list of numbers")
        for x in r:
            ok = isinstance(x, int | float) and not isinstance(x, bool)
            if not ok or not 0 < x <= 1:
                raise UserError(f"{p}: key 'cache_ratios': {x!r} is not a number in (0, 1]")
        grid.cache_ratios = [float(x) for x in r]
    if "sequences" in data:
        s = data["sequences"]
        if not isinstance(s, int) or isinstance(s, bool) or s <= 0:
            raise UserError(f"{p}: key 'sequences' must be a positive integer, got {s!r}")
        grid.sequences = s
    if "seed" in data:
        if not isinstance(data["seed"], int) or isinstance(data["seed"], bool):
            raise UserError(f"{p}: key 'seed' must be an integer, got {data['seed']!r}")
        grid.seed = data["seed"]
    if "tolerance_time" in data:
        grid.tolerance_time = check_tolerance(data["tolerance_time"], f"{p}: key 'tolerance_time'")
    if "baseline" in data:
        if not isinstance(data["baseline"], str) or not data["baseline"]:
            raise UserError(f"{p}: key 'baseline' must be a path")
        grid.baseline = str(p.parent / data["baseline"])
    opts = data.get("policy_options", {})
    if not isinstance(opts, dict) or not all(isinstance(v, dict) for v in opts.values()):
        raise UserError(f"{p}: key 'policy_options' must hold one table per policy")
    grid.policy_options = {str(k): dict(v) for k, v in opts.items()}
    return grid


def check_tolerance(value: Any, where: str = "--tolerance-time") -> float:
    """A relative tolerance: a finite number >= 0."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise UserError(f"{where} must be a finite number >= 0, got {value!r}")
    return float(value)


def config_key(policy: str, hw: str, ratio: float) -> str:
    """The baseline key of one configuration, e.g. ``lru | a6000-pcie4 | 0.125``."""
    return f"{policy} | {hw} | {ratio:g}"


def validate_grid(grid: RegressGrid) -> None:
    """Unknown trace, policy, profile or policy option: a UserError before anything runs."""
    from policies.registry import get_policy_class
    from simulator.hardware import load_profile
    from simulator.trace import read_meta

    read_meta(resolve_trace(grid.trace))
    names = grid.policy_names()
    if not names:
        raise UserError("the regression grid has no policies")
    for name in names:
        get_policy_class(name)
    for name, opts in grid.policy_options.items():
        if name not in names:
            raise UserError(f"policy_options: policy {name!r} is not in the grid")
        get_policy_class(name).resolve_options(opts)
    for hw in grid.profiles:
        load_profile(hw)
    if not grid.cache_ratios:
        raise UserError("the regression grid has no cache ratios")


def run_one(grid: RegressGrid, policy: str, hw: str, ratio: float) -> dict[str, Any]:
    """One configuration's outcome: its metrics, or the one-line error it ends with."""
    from simulator.runner import simulate

    rec: dict[str, Any] = {"policy": policy, "hw": hw, "cache_ratio": ratio}
    try:
        res = simulate(
            policy=policy,
            hw=hw,
            trace=grid.trace,
            cache_ratio=ratio,
            sequences=grid.sequences,
            policy_options=grid.policy_options.get(policy),
            seed=grid.seed,
            record=False,
        )
    except (UserError, PolicyError) as exc:
        rec["error"] = str(exc)
        return rec
    doc = json.loads(res.to_json())  # the same JSON-safe values `run --json` prints
    for k in ("gpu_experts", "max_gpu_experts", "bound", "policy_options"):
        rec[k] = doc[k]
    rec["metrics"] = doc["metrics"]
    rec["per_layer_hit_rate"] = doc["per_layer_hit_rate"]
    return rec


def run_grid(
    grid: RegressGrid, progress: Callable[[str], None] | None = None
) -> dict[str, dict[str, Any]]:
    """Every configuration's outcome, keyed by :func:`config_key`, in grid order."""
    validate_grid(grid)
    out: dict[str, dict[str, Any]] = {}
    for policy in grid.policy_names():
        for hw in grid.profiles:
            for ratio in grid.cache_ratios:
                key = config_key(policy, hw, ratio)
                if progress is not None:
                    progress(key)
                out[key] = run_one(grid, policy, hw, ratio)
    return out


# --- comparison -------------------------------------------------------------------------------


@dataclass
class Change:
    """One value that differs from the baseline (or a configuration that appeared/vanished)."""

    config: str
    field: str
    status: str  #: "moved", "new" or "missing"
    baseline: Any = None
    current: Any = None

    @property
    def rel_change(self) -> float | None:
        """(current - baseline) / |baseline| for numbers, else None."""
        b, c = self.baseline, self.current
        if _num(b) and _num(c) and b != 0:
            return (c - b) / abs(b)
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON form for ``regress --json``."""
        return {
            "config": self.config,
            "field": self.field,
            "status": self.status,
            "baseline": self.baseline,
            "current": self.current,
            "rel_change": self.rel_change,
        }


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def flatten(rec: dict[str, Any]) -> dict[str, Any]:
    """One configuration's record as ``field -> scalar`` (metrics.X, per_layer_hit_rate[i])."""
    flat: dict[str, Any] = {}
    for k, v in rec.items():
        if k in ("policy", "hw", "cache_ratio"):
            continue
        if k == "metrics":
            flat.update({f"metrics.{m}": x for m, x in v.items()})
        elif k == "per_layer_hit_rate":
            flat.update({f"per_layer_hit_rate[{i}]": x for i, x in enumerate(v)})
        elif isinstance(v, dict | list):
            flat[k] = json.dumps(v, sort_keys=True)
        else:
            flat[k] = v
    return flat


def same(a: Any, b: Any, rel: float) -> bool:
    """Exact for ints, strings and bools; ``rel`` tolerance for floats; None (NaN) == None."""
    if a is None or b is None:
        return a is None and b is None
    if _num(a) and _num(b):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        fa, fb = float(a), float(b)
        if math.isnan(fa) or math.isnan(fb):
            return math.isnan(fa) and math.isnan(fb)
        return math.isclose(fa, fb, rel_tol=rel, abs_tol=ABS_TOLERANCE)
    return type(a) is type(b) and a == b


def compare(
    baseline: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]], rel: float
) -> list[Change]:
    """Every difference between two outcome maps (baseline order, then new configurations)."""
    changes: list[Change] = []
    for key, old in baseline.items():
        new = current.get(key)
        if new is None:
            changes.append(Change(key, "(configuration)", "missing"))
            continue
        fo, fn = flatten(old), flatten(new)
        for f in list(fo) + [f for f in fn if f not in fo]:
            if f not in fo:
                changes.append(Change(key, f, "new", None, fn[f]))
            elif f not in fn:
                changes.append(Change(key, f, "missing", fo[f], None))
            elif not same(fo[f], fn[f], rel):
                changes.append(Change(key, f, "moved", fo[f], fn[f]))
    for key in current:
        if key not in baseline:
            changes.append(Change(key, "(configuration)", "new"))
    return changes


def compare_grids(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """A different trace (name or bytes) explains every moved metric: say so first."""
    return [
        Change("(grid)", k, "moved", old.get(k), new.get(k))
        for k in ("trace", "trace_sha256", "sequences", "seed")
        if old.get(k) != new.get(k)
    ]


# --- baseline file ----------------------------------------------------------------------------


def load_baseline(path: str | Path) -> dict[str, Any]:
    """Read and check a baseline file; a clear one-line error when it is missing or damaged."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{p}: is a directory, not a baseline file")
    if not p.exists():
        raise UserError(f"{p}: no such baseline file (create it with `daopsim regress --update`)")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{p}: not a readable JSON baseline ({first})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UserError(f"{p}: not a daopsim regress baseline (expected format {FORMAT!r})")
    confs = doc.get("configurations")
    if not isinstance(confs, dict) or not all(isinstance(v, dict) for v in confs.values()):
        raise UserError(f"{p}: key 'configurations' must map names to objects")
    if not isinstance(doc.get("grid"), dict):
        raise UserError(f"{p}: key 'grid' must be an object")
    return doc


def baseline_text(grid: dict[str, Any], outcomes: dict[str, dict[str, Any]]) -> str:
    """The baseline file's text: deterministic, one value per line so diffs stay readable."""
    doc = {"format": FORMAT, "grid": grid, "configurations": outcomes}
    return json.dumps(doc, indent=1, sort_keys=False, allow_nan=False) + "\n"


def write_baseline(path: str | Path, grid: dict[str, Any], outcomes: dict[str, Any]) -> Path:
    """Rewrite the baseline atomically (temporary file in the same folder, then rename)."""
    from simulator.results import atomic_write_text

    p = Path(path)
    if p.is_dir():
        raise UserError(f"{p}: is a directory, not a baseline file")
    try:
        return atomic_write_text(p, baseline_text(grid, outcomes))
    except OSError as exc:
        raise UserError(f"{p}: cannot write the baseline ({exc.strerror or exc})") from None


# --- one check --------------------------------------------------------------------------------


@dataclass
class RegressReport:
    """The outcome of ``daopsim regress``: what moved, how much was compared, how long it took."""

    baseline: str
    configurations: int
    compared: int
    tolerance_time: float
    seconds: float
    changes: list[Change]
    updated: bool = False

    @property
    def ok(self) -> bool:
        """No value moved and no configuration is new or missing."""
        return not self.changes

    def to_dict(self) -> dict[str, Any]:
        """JSON form for ``regress --json``."""
        return {
            "ok": self.ok,
            "updated": self.updated,
            "baseline": self.baseline,
            "configurations": self.configurations,
            "compared": self.compared,
            "tolerance_time": self.tolerance_time,
            "seconds": round(self.seconds, 3),
            "changes": [c.to_dict() for c in self.changes],
        }


def regress(
    grid: RegressGrid,
    baseline: str | Path,
    tolerance: float = DEFAULT_TOLERANCE,
    update: bool = False,
    progress: Callable[[str], None] | None = None,
) -> RegressReport:
    """Run the grid and compare with (or, with ``update``, rewrite) the baseline."""
    t0 = time.perf_counter()
    old: dict[str, Any] | None = None
    if Path(baseline).is_dir():
        raise UserError(f"{baseline}: is a directory, not a baseline file")
    if not update:
        old = load_baseline(baseline)
    elif Path(baseline).exists():
        try:
            old = load_baseline(baseline)
        except UserError:
            old = None  # --update repairs a damaged baseline; there is nothing to diff against
    desc = grid.describe()
    current = run_grid(grid, progress=progress)
    changes: list[Change] = []
    if old is not None:
        changes = compare_grids(old["grid"], desc) + compare(
            old["configurations"], current, tolerance
        )
    compared = sum(len(flatten(r)) for r in current.values())
    if update:
        write_baseline(baseline, desc, current)
    return RegressReport(
        baseline=str(baseline),
        configurations=len(current),
        compared=compared,
        tolerance_time=tolerance,
        seconds=time.perf_counter() - t0,
        changes=changes,
        updated=update,
    )


def _show(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    text = str(v)
    return text if len(text) <= 60 else text[:57] + "..."


def render_changes(changes: Iterable[Change]) -> str:
    """A table of what moved: configuration, field, baseline, current, relative change."""
    rows = [("configuration", "field", "baseline", "current", "change")]
    for c in changes:
        rel = c.rel_change
        if c.status != "moved":
            how = c.status
        elif rel is not None:
            how = f"{rel:+.3%}"
        else:
            how = "changed"
        rows.append((c.config, c.field, _show(c.baseline), _show(c.current), how))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
