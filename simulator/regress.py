"""The golden store and ``daopsim regress``: run a fixed grid, compare with the committed store.

A grid is a list of blocks; each block runs every policy (and option variant) x machine x
expert budget on one trace. :func:`default_grid` is the built-in grid, chosen so that it tells
the policies apart (budgets above top-k, Mixtral and OLMoE/Phi traces, the non-default options,
a machine with one copy engine). Its outcomes live in ONE file, the golden store
(``baselines/policy-metrics.json``): ``daopsim regress`` compares a run with it, the golden tests
(tests/test_golden.py) re-run cells of it exactly, and ``daopsim regress --update`` rewrites it.

``compare`` lists every value that moved: counts and bytes (integers) must match exactly, times
and rates (floats) within a relative tolerance, NaN (stored as null) equals NaN. A configuration
that fails with a user error (e.g. the budget does not fit the machine) is an outcome too: its
one-line message is recorded and compared. See docs/regression.md.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from daopsim.simulator.data import (
    CI_TRACE,
    bundled_dir,
    bundled_traces,
    check_input_file,
    read_toml,
    resolve_trace,
)
from daopsim.simulator.errors import PolicyError, UserError

#: Cache ratios and machines of a grid file block that names neither (the old built-in grid's).
DEFAULT_RATIOS = (0.125, 0.1875, 0.375)
DEFAULT_PROFILES = ("a6000-pcie4", "rtx4090-pcie4")
#: Relative tolerance for float metrics. The engine is deterministic and sums in a fixed order,
#: so on one platform results are bit-identical; the tolerance only absorbs last-digit
#: differences between numpy/libm builds (~1e-15 per operation, ~1e-12 after long sums). A real
#: change (one extra expert copy in a run) moves times by 1e-4 or more, far above it.
DEFAULT_TOLERANCE = 1e-6
#: Floats this close to each other count as equal whatever their size (values near zero).
ABS_TOLERANCE = 1e-12
FORMAT = "daopsim-regress/2"
#: Keys of one block (at the top level of a grid file they are defaults for every [[block]]).
BLOCK_KEYS = {
    "trace",
    "policies",
    "variants",
    "cache_ratios",
    "experts_per_layer",
    "profiles",
    "sequences",
    "seed",
    "policy_options",
}
GRID_KEYS = BLOCK_KEYS | {"tolerance_time", "baseline", "block"}


def default_store() -> Path:
    """The golden store: the bundled ``baselines/policy-metrics.json``.

    Found through the installed packages (in a source checkout or an editable install, the
    repository's own file), never the working directory.
    """
    return bundled_dir("baselines") / "policy-metrics.json"


def builtin_policies() -> list[str]:
    """Policies shipped in the ``policies`` package (third-party plugins excluded), sorted."""
    from daopsim.policies.registry import available

    return [n for n, cls in available().items() if cls.__module__.startswith("daopsim.policies.")]


def _show_option(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


@dataclass(frozen=True)
class PolicySpec:
    """A policy with option overrides; its label names it in configuration keys."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()  #: sorted (key, value) pairs

    @classmethod
    def of(cls, name: str, **options: Any) -> PolicySpec:
        """A spec from keyword options (sorted, so equal specs compare equal)."""
        return cls(name, tuple(sorted(options.items())))

    @property
    def label(self) -> str:
        """``lru``, or ``daop(exact_fallback=true)`` for a variant."""
        if not self.options:
            return self.name
        return f"{self.name}({','.join(f'{k}={_show_option(v)}' for k, v in self.options)})"

    def describe(self) -> dict[str, Any]:
        """JSON form stored in the grid description."""
        return {"policy": self.name, **dict(self.options)}


@dataclass(frozen=True)
class Budget:
    """How many experts stay resident: a share of all experts, or a count per MoE layer."""

    value: float | int
    per_layer: bool = False

    @property
    def label(self) -> str:
        """``0.125`` (cache ratio) or ``3/layer``."""
        return f"{self.value}/layer" if self.per_layer else f"{self.value:g}"

    def run_args(self, moe_layers: int) -> dict[str, Any]:
        """The ``simulate`` keyword for this budget."""
        if self.per_layer:
            return {"gpu_experts": int(self.value) * moe_layers}
        return {"cache_ratio": float(self.value)}


@dataclass
class GridBlock:
    """Every policy spec x machine x budget on one trace."""

    trace: str = CI_TRACE
    policies: list[str] | None = None  #: None means every built-in policy
    variants: list[PolicySpec] = field(default_factory=list)
    budgets: list[Budget] = field(default_factory=lambda: [Budget(r) for r in DEFAULT_RATIOS])
    profiles: list[str] = field(default_factory=lambda: list(DEFAULT_PROFILES))
    sequences: int | None = None
    seed: int = 0
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: how the trace is named in configuration keys (a grid file's relative path, as written)
    trace_label: str | None = None

    @property
    def label(self) -> str:
        """The trace as configuration keys name it."""
        return self.trace_label or self.trace

    def specs(self) -> list[PolicySpec]:
        """The policies to run (defaults first, then the variants)."""
        names = list(self.policies) if self.policies is not None else builtin_policies()
        return [PolicySpec(n) for n in names] + list(self.variants)

    def options_for(self, spec: PolicySpec) -> dict[str, Any]:
        """The block's ``policy_options`` for this policy, overridden by the spec's own."""
        return {**self.policy_options.get(spec.name, {}), **dict(spec.options)}

    def describe(self) -> dict[str, Any]:
        """The block as stored in the golden store (with the trace's content hash)."""
        return {
            "trace": self.label,
            "trace_sha256": _sha256(resolve_trace(self.trace)),
            "sequences": self.sequences,
            "seed": self.seed,
            "policies": [s.name for s in self.specs() if not s.options],
            "variants": [s.describe() for s in self.variants],
            "profiles": list(self.profiles),
            "budgets": [b.label for b in self.budgets],
            "policy_options": self.policy_options,
        }


@dataclass(frozen=True)
class Cell:
    """One configuration of the grid."""

    block: GridBlock
    spec: PolicySpec
    hw: str
    budget: Budget

    @property
    def key(self) -> str:
        """The store key, e.g. ``ci-small | lru | a6000-pcie4 | 3/layer``."""
        return config_key(self.block.label, self.spec.label, self.hw, self.budget.label)


@dataclass
class RegressGrid:
    """What ``daopsim regress`` runs: a list of blocks (one trace each)."""

    blocks: list[GridBlock] = field(default_factory=lambda: [GridBlock()])
    tolerance_time: float | None = None  #: from a grid file; the CLI flag wins
    baseline: str | None = None  #: from a grid file; the CLI flag wins

    def cells(self) -> Iterator[Cell]:
        """Every configuration, in grid order (block, policy spec, machine, budget)."""
        for block in self.blocks:
            for spec in block.specs():
                for hw in block.profiles:
                    for budget in block.budgets:
                        yield Cell(block, spec, hw, budget)

    def describe(self) -> dict[str, Any]:
        """The grid as stored in the golden store."""
        return {"blocks": [b.describe() for b in self.blocks]}


#: Options that are off by default and change what a policy does; the built-in grid runs each.
BUILTIN_VARIANTS = (
    PolicySpec.of("daop", exact_fallback=True),
    PolicySpec.of("daop", persist_placement=False),
    PolicySpec.of("mixtral-offloading", prefetch=True),
    PolicySpec.of("lru", initial="popular"),
    PolicySpec.of("lfu", initial="popular"),
    PolicySpec.of("belady", initial="popular"),
    PolicySpec.of("global-lfu", initial="popular"),
    PolicySpec.of("static", placement="global"),
    PolicySpec.of("stream-all", gather="selected"),
    PolicySpec.of("llama-cpp-cpu-moe", n_cpu_moe=16),
    PolicySpec.of("llama-cpp-cpu-moe", n_cpu_moe=16, prefill_offload=False),
    PolicySpec.of("llama-cpp-layers", ngl=16),
    PolicySpec.of("llama-cpp-layers", ngl=16, prefill_offload=False),
    PolicySpec.of("ktransformers", gpu_experts_per_layer=2, placement="frequency"),
    PolicySpec.of("ktransformers", gpu_experts_ratio=0.25, placement="front-loading"),
    PolicySpec.of("vllm-cpu-offload", offload_layers=24),
    PolicySpec.of("moe-infinity", prefetch=False),
    PolicySpec.of("hobbit", skip_threshold=1.0),
    PolicySpec.of(
        "ktransformers", gpu_experts_ratio=0.25, placement="front-loading", prefill="gpu"
    ),
    PolicySpec.of("least-stale", prefetch=True),
    PolicySpec.of("cache-conditional", method="max-rank"),
    PolicySpec.of("hybrimoe", schedule="cpu"),
    PolicySpec.of("dali", assign="cpu"),
    PolicySpec.of("slicemoe", warmup=False),
)
#: Built-in policies whose outcome does not depend on the GPU budget, and why; they run on the
#: Mixtral blocks only. Every other built-in policy belongs in BUDGET_POLICIES (tests/test_golden.py
#: checks both lists against the registry and against the store's numbers).
BUDGET_FREE_POLICIES = {
    "all-gpu": "every expert stays on the GPU",
    "ktransformers": "its options fix the GPU experts; the budget only has to hold them",
    "llama-cpp-cpu-moe": "n_cpu_moe fixes the GPU layers; the budget only has to hold them",
    "llama-cpp-mmap": "every expert runs on the CPU from the page cache",
    # its default gather (auto) streams whole layers whenever the budget holds 2E slots, as
    # every budget of the grid does; below that it streams the routed experts only
    "stream-all": "every expert is streamed each visit; nothing stays resident",
}
#: Policies whose placement depends on the budget; they also run on the OLMoE and Phi blocks.
#: llama-cpp-layers' default ngl (-1) puts on the GPU as many layers as the budget holds.
BUDGET_POLICIES = [
    "accelerate",
    "belady",
    "belady-global",
    "cache-conditional",
    "daop",
    "dali",
    "fiddler",
    "global-lfu",
    "global-lru",
    "hobbit",
    "hybrimoe",
    "learned",
    "least-stale",
    "lfu",
    "llama-cpp-layers",
    "lru",
    "mixtral-offloading",
    "moe-infinity",
    "round-robin",
    "slicemoe",
    "static",
    "vllm-cpu-offload",
]


def default_grid() -> RegressGrid:
    """The built-in grid, whose outcomes are the golden store (docs/regression.md).

    Budgets are experts per layer above top-k: at <= k per layer every replacement policy keeps
    the same experts. Few sequences keep the whole grid at about 35 s on one core.
    """
    per_layer = [Budget(n, per_layer=True) for n in (3, 4, 5, 6)]
    var_budget = [v for v in BUILTIN_VARIANTS if v.name in BUDGET_POLICIES]
    return RegressGrid(
        blocks=[
            # Mixtral-8x7B (8 experts, top-2) at 3-6 per layer: 6 x 32 experts need an 80 GB GPU
            GridBlock(
                trace=CI_TRACE,
                variants=list(BUILTIN_VARIANTS),
                budgets=per_layer,
                profiles=["a100-80g-pcie4"],
                sequences=2,
            ),
            # DAOP's platform (measured costs) with two copy engines and with one; 4 per layer
            # does not fit a 48 GB card, so those cells pin the memory model's refusal
            GridBlock(
                trace=CI_TRACE,
                variants=list(BUILTIN_VARIANTS),
                budgets=per_layer[:2],
                profiles=["a6000-pcie4", "a6000-1ce-pcie4"],
                sequences=2,
            ),
            # OLMoE (64 experts, top-8): a wide router, budgets of 1.5x to 4x top-k
            GridBlock(
                trace="olmoe-1b-7b",
                policies=BUDGET_POLICIES,
                variants=var_budget,
                budgets=[Budget(n, per_layer=True) for n in (12, 16, 32)],
                profiles=["a6000-pcie4"],
                sequences=1,
            ),
            # Phi-3.5-MoE (16 experts, top-2) on DAOP's platform (measured Phi costs)
            GridBlock(
                trace="phi-3.5-moe",
                policies=BUDGET_POLICIES,
                budgets=[Budget(4, per_layer=True)],
                profiles=["a6000-pcie4"],
                sequences=1,
            ),
            # The SSD tier (docs/serving.md, "An SSD tier"): the profile's 64 GB of host memory
            # hold about two thirds of Mixtral's experts at bf16, the rest are read from its
            # NVMe drive through the page cache
            GridBlock(
                trace=CI_TRACE,
                policies=["lru", "fiddler", "llama-cpp-mmap"],
                budgets=[Budget(0.2)],
                profiles=["rtx4090-990pro-pcie4"],
                sequences=2,
            ),
        ]
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --- grid files -------------------------------------------------------------------------------


def load_grid(path: str | Path) -> RegressGrid:
    """A grid from a TOML file; relative trace and baseline paths are relative to the file.

    Without ``[[block]]`` tables the file's top level is the one block; with them, the
    top-level block keys are defaults that each block may override.
    """
    p = check_input_file(path, "grid")
    data = read_toml(p, "grid")
    for key in data:
        if key not in GRID_KEYS:
            raise UserError(f"{p}: unknown key {key!r} (valid: {', '.join(sorted(GRID_KEYS))})")
    grid = RegressGrid()
    if "tolerance_time" in data:
        grid.tolerance_time = check_tolerance(data["tolerance_time"], f"{p}: key 'tolerance_time'")
    if "baseline" in data:
        if not isinstance(data["baseline"], str) or not data["baseline"]:
            raise UserError(f"{p}: key 'baseline' must be a path")
        grid.baseline = str(p.parent / data["baseline"])
    defaults = {k: v for k, v in data.items() if k in BLOCK_KEYS}
    tables = data.get("block")
    if tables is None:
        grid.blocks = [_block(p, "", defaults)]
        return grid
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise UserError(f"{p}: 'block' must be one or more [[block]] tables")
    grid.blocks = []
    for i, table in enumerate(tables, 1):
        where = f"[[block]] #{i}: "
        for key in table:
            if key not in BLOCK_KEYS:
                valid = ", ".join(sorted(BLOCK_KEYS))
                raise UserError(f"{p}: {where}unknown key {key!r} (valid: {valid})")
        grid.blocks.append(_block(p, where, {**defaults, **table}))
    return grid


def _block(p: Path, where: str, data: dict[str, Any]) -> GridBlock:
    """One block from its (merged) TOML keys."""

    def bad(key: str, what: str) -> UserError:
        return UserError(f"{p}: {where}key {key!r} {what}")

    def strings(key: str) -> list[str] | None:
        v = data.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
            raise bad(key, "must be a non-empty list of strings")
        return list(v)

    block = GridBlock()
    if "trace" in data:
        t = data["trace"]
        if not isinstance(t, str) or not t:
            raise bad("trace", "must be a bundled trace name or a path")
        near = p.parent / t
        block.trace = str(near) if t not in bundled_traces() and near.exists() else t
        block.trace_label = t
    block.policies = strings("policies")
    block.profiles = strings("profiles") or block.profiles
    budgets: list[Budget] = []
    if "cache_ratios" in data:
        r = data["cache_ratios"]
        if not isinstance(r, list) or not r:
            raise bad("cache_ratios", "must be a non-empty list of numbers")
        for x in r:
            if not _num(x) or not 0 < x <= 1:
                raise bad("cache_ratios", f"has {x!r}, not a number in (0, 1]")
            budgets.append(Budget(float(x)))
    if "experts_per_layer" in data:
        r = data["experts_per_layer"]
        if not isinstance(r, list) or not r:
            raise bad("experts_per_layer", "must be a non-empty list of integers")
        for x in r:
            if not isinstance(x, int) or isinstance(x, bool) or x <= 0:
                raise bad("experts_per_layer", f"has {x!r}, not a positive integer")
            budgets.append(Budget(x, per_layer=True))
    if budgets:
        block.budgets = budgets
    if "sequences" in data:
        s = data["sequences"]
        if not isinstance(s, int) or isinstance(s, bool) or s <= 0:
            raise bad("sequences", f"must be a positive integer, got {s!r}")
        block.sequences = s
    if "seed" in data:
        if not isinstance(data["seed"], int) or isinstance(data["seed"], bool):
            raise bad("seed", f"must be an integer, got {data['seed']!r}")
        block.seed = data["seed"]
    opts = data.get("policy_options", {})
    if not isinstance(opts, dict) or not all(isinstance(v, dict) for v in opts.values()):
        raise bad("policy_options", "must hold one table per policy")
    block.policy_options = {str(k): dict(v) for k, v in opts.items()}
    variants = data.get("variants", [])
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
        raise bad("variants", 'must be a list of tables like { policy = "daop", x = true }')
    for v in variants:
        name = v.get("policy")
        if not isinstance(name, str) or not name or len(v) < 2:
            raise bad("variants", f"entry {v!r} needs 'policy' and at least one option")
        block.variants.append(PolicySpec.of(name, **{k: x for k, x in v.items() if k != "policy"}))
    return block


def check_tolerance(value: Any, where: str = "--tolerance-time") -> float:
    """A relative tolerance: a finite number >= 0."""
    if not _num(value) or not math.isfinite(value) or value < 0:
        raise UserError(f"{where} must be a finite number >= 0, got {value!r}")
    return float(value)


def config_key(trace: str, policy: str, hw: str, budget: str) -> str:
    """The store key of one configuration, e.g. ``ci-small | lru | a6000-pcie4 | 3/layer``."""
    return f"{trace} | {policy} | {hw} | {budget}"


def validate_grid(grid: RegressGrid) -> None:
    """Unknown trace, policy, profile or option, or an ambiguous grid: a UserError up front."""
    from daopsim.policies.registry import get_policy_class
    from daopsim.simulator.hardware import load_profile
    from daopsim.simulator.trace_read import read_meta

    if not grid.blocks:
        raise UserError("the regression grid has no blocks")
    facts: dict[str, tuple[str, int | None, int]] = {}
    for block in grid.blocks:
        meta = read_meta(resolve_trace(block.trace))
        seen = facts.setdefault(block.label, (block.trace, block.sequences, block.seed))
        if seen != (block.trace, block.sequences, block.seed):
            raise UserError(
                f"trace {block.label!r} appears in two blocks with different files, "
                "sequences or seeds; configuration keys could not tell them apart"
            )
        specs = block.specs()
        if not specs:
            raise UserError(f"trace {block.label!r}: the block has no policies")
        names = {s.name for s in specs}
        for spec in specs:
            get_policy_class(spec.name).resolve_options(block.options_for(spec))
        for name in block.policy_options:
            if name not in names:
                raise UserError(f"policy_options: policy {name!r} is not in the grid")
        for hw in block.profiles:
            load_profile(hw)
        if not block.budgets:
            raise UserError(f"trace {block.label!r}: the block has no budgets")
        for b in block.budgets:
            if b.per_layer and int(b.value) > meta.model.experts:
                raise UserError(
                    f"trace {block.label!r}: experts_per_layer {b.value} exceeds the "
                    f"{meta.model.experts} experts per layer of {meta.model.name}"
                )
    keys = [c.key for c in grid.cells()]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise UserError(f"configuration {dup!r} appears twice in the grid")


def run_cell(cell: Cell) -> dict[str, Any]:
    """One configuration's outcome: its metrics, or the one-line error it ends with."""
    from daopsim.simulator.runner import simulate
    from daopsim.simulator.trace_read import read_meta

    block = cell.block
    rec: dict[str, Any] = {
        "trace": block.label,
        "policy": cell.spec.name,
        "hw": cell.hw,
        "budget": cell.budget.label,
    }
    path = resolve_trace(block.trace)
    try:
        res = simulate(
            policy=cell.spec.name,
            hw=cell.hw,
            trace=path,
            sequences=block.sequences,
            policy_options=block.options_for(cell.spec),
            seed=block.seed,
            record=False,
            **cell.budget.run_args(read_meta(path).model.moe_layers),
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


def select(grid: RegressGrid, only: Iterable[str] = ()) -> list[Cell]:
    """The grid's cells whose key matches one of the ``only`` globs (all cells without any)."""
    patterns = list(only)
    cells = list(grid.cells())
    if not patterns:
        return cells
    chosen = [c for c in cells if any(fnmatch.fnmatchcase(c.key, g) for g in patterns)]
    if not chosen:
        raise UserError(
            f"--only {' '.join(patterns)!r} matches no configuration (keys look like "
            f"{cells[0].key!r})"
        )
    return chosen


def run_grid(
    grid: RegressGrid,
    progress: Callable[[str], None] | None = None,
    only: Iterable[str] = (),
) -> dict[str, dict[str, Any]]:
    """Every (selected) configuration's outcome, keyed by :func:`config_key`, in grid order."""
    validate_grid(grid)
    out: dict[str, dict[str, Any]] = {}
    for cell in select(grid, only):
        if progress is not None:
            progress(cell.key)
        out[cell.key] = run_cell(cell)
    return out


# --- comparison -------------------------------------------------------------------------------


@dataclass
class Change:
    """One value that differs from the store (or a configuration that appeared/vanished)."""

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


#: Record keys that name the configuration (they are in its key) rather than describe an outcome
_NAMING = ("trace", "policy", "hw", "budget")


def flatten(rec: dict[str, Any]) -> dict[str, Any]:
    """One configuration's record as ``field -> scalar`` (metrics.X, per_layer_hit_rate[i])."""
    flat: dict[str, Any] = {}
    for k, v in rec.items():
        if k in _NAMING:
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


def _trace_facts(grid: dict[str, Any]) -> dict[str, dict[str, Any]]:
    blocks = grid.get("blocks")
    if not isinstance(blocks, list):
        return {}
    return {
        str(b.get("trace")): {k: b.get(k) for k in ("trace_sha256", "sequences", "seed")}
        for b in blocks
        if isinstance(b, dict)
    }


def compare_grids(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """A different trace (bytes), sequence count or seed explains every moved metric: say so."""
    before, after = _trace_facts(old), _trace_facts(new)
    return [
        Change(f"(grid) {trace}", k, "moved", before[trace][k], v)
        for trace, facts in after.items()
        if trace in before
        for k, v in facts.items()
        if before[trace][k] != v
    ]


# --- the store file ---------------------------------------------------------------------------


def load_baseline(path: str | Path) -> dict[str, Any]:
    """Read and check a store file; a clear one-line error when it is missing or damaged."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{p}: is a directory, not a baseline file")
    if not p.exists():
        raise UserError(f"{p}: no such baseline file (create it with `daopsim regress --update`)")
    check_input_file(p, "baseline")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{p}: not a readable JSON baseline ({first})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UserError(
            f"{p}: not a daopsim regress baseline of format {FORMAT!r} "
            "(an older store is rewritten by `daopsim regress --update`)"
        )
    confs = doc.get("configurations")
    if not isinstance(confs, dict) or not all(isinstance(v, dict) for v in confs.values()):
        raise UserError(f"{p}: key 'configurations' must map names to objects")
    if not isinstance(doc.get("grid"), dict):
        raise UserError(f"{p}: key 'grid' must be an object")
    return doc


def check_store_target(path: str | Path) -> None:
    """``--update`` may write ``path``: a ``.json`` name, and an existing file there is a store
    of this command (any version of the format, damaged numbers included), never another file
    (``--baseline results.parquet`` would replace a table with the store)."""
    from daopsim.simulator.errors import OutputError
    from daopsim.simulator.output import output_format

    output_format(path, {".json": "json"}, "--baseline")
    p = Path(path)
    if not p.is_file():
        return
    try:
        doc = json.loads(p.read_bytes())
    except OSError:
        return  # unreadable: the write reports it
    except ValueError:
        doc = None
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if not (isinstance(fmt, str) and fmt.startswith("daopsim-regress/")):
        raise OutputError(
            f"--baseline {p}: exists and is not a daopsim regress store (a JSON object with "
            '"format": "daopsim-regress/N"); refusing to replace it'
        )


def baseline_text(grid: dict[str, Any], outcomes: dict[str, dict[str, Any]]) -> str:
    """The store's text: deterministic, one value per line so diffs stay readable."""
    doc = {"format": FORMAT, "grid": grid, "configurations": outcomes}
    return json.dumps(doc, indent=1, sort_keys=False, allow_nan=False) + "\n"


def write_baseline(path: str | Path, grid: dict[str, Any], outcomes: dict[str, Any]) -> Path:
    """Rewrite the store atomically (temporary file in the same folder, then rename)."""
    from daopsim.simulator.output import check_output_file, write_text

    check_output_file(path, "--baseline")
    return write_text(path, baseline_text(grid, outcomes), "--baseline")


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
    #: with ``updated``: there was no readable store of this format to diff against
    fresh: bool = False

    @property
    def ok(self) -> bool:
        """No value moved and no configuration is new or missing."""
        return not self.changes

    def to_dict(self) -> dict[str, Any]:
        """JSON form for ``regress --json``."""
        return {
            "ok": self.ok,
            "updated": self.updated,
            "fresh": self.fresh,
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
    only: Iterable[str] = (),
    inputs: Iterable[str | os.PathLike[str] | None] = (),
) -> RegressReport:
    """Run the grid and compare with (or, with ``update``, rewrite) the store.

    ``only`` (globs over configuration keys) runs a subset and compares just those cells; it
    cannot be combined with ``update``, which always rewrites every cell. ``inputs`` (the grid
    file) are never the store ``update`` writes; nor is the golden store ever rewritten from
    a grid other than the built-in one.
    """
    only = list(only)
    if update and only:
        raise UserError("--update rewrites every configuration; it cannot be combined with --only")
    t0 = time.perf_counter()
    old: dict[str, Any] | None = None
    if update:
        from daopsim.simulator.output import check_output_file

        # before reading it or running the grid
        traces = [_trace_path(b.trace) for b in grid.blocks]
        check_output_file(baseline, "--baseline", inputs=[*inputs, *traces])
        check_store_target(baseline)
        check_golden_update(grid, baseline)
    if Path(baseline).is_dir():
        raise UserError(f"{baseline}: is a directory, not a baseline file")
    if not update:
        old = load_baseline(baseline)
    elif Path(baseline).exists():
        try:
            old = load_baseline(baseline)
        except UserError:
            old = None  # --update repairs a damaged store; there is nothing to diff against
    current = run_grid(grid, progress=progress, only=only)
    changes: list[Change] = []
    if old is not None:
        desc = grid.describe()
        if only:
            used = {rec["trace"] for rec in current.values()}
            desc = {"blocks": [b for b in desc["blocks"] if b["trace"] in used]}
            stored = {k: v for k, v in old["configurations"].items() if k in current}
        else:
            stored = old["configurations"]
        changes = compare_grids(old["grid"], desc) + compare(stored, current, tolerance)
    compared = sum(len(flatten(r)) for r in current.values())
    if update:
        write_baseline(baseline, grid.describe(), current)
    return RegressReport(
        baseline=str(baseline),
        configurations=len(current),
        compared=compared,
        tolerance_time=tolerance,
        seconds=time.perf_counter() - t0,
        changes=changes,
        updated=update,
        fresh=update and old is None,
    )


def _trace_path(trace: str) -> str:
    """The file behind a block's trace (a bundled name resolves), or the text as given."""
    try:
        return str(resolve_trace(trace))
    except UserError:
        return trace


def check_golden_update(grid: RegressGrid, baseline: str | os.PathLike[str]) -> None:
    """A UserError when ``--update`` would rewrite the golden store from another grid.

    The golden store holds the built-in grid's outcomes (docs/regression.md); a custom grid
    (``--grid`` without a ``baseline``, or ``--trace``) writes its own store instead.
    """
    golden = default_store()
    try:
        same = os.path.samefile(baseline, golden)
    except OSError:
        same = Path(baseline).absolute() == golden.absolute()
    if same and grid.describe() != default_grid().describe():
        raise UserError(
            f"--update would replace the golden store {golden} (the built-in grid's "
            "configurations) with a custom grid's; give --baseline FILE, or a 'baseline' key "
            "in the grid file, for this grid's own store"
        )


def with_trace(grid: RegressGrid, trace: str) -> RegressGrid:
    """The grid on another trace (``--trace``); only for a grid of one block."""
    if len(grid.blocks) != 1:
        raise UserError(
            "--trace replaces the trace of a one-block grid; the built-in grid has "
            f"{len(grid.blocks)} blocks (write a grid file, see docs/regression.md)"
        )
    return replace(grid, blocks=[replace(grid.blocks[0], trace=trace, trace_label=None)])


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
