"""The regression grid: blocks of policies (and option variants) x machines x expert budgets on one
trace, their cells, the built-in grid (:func:`default_grid`) and grid files (:func:`load_grid`,
checked by :func:`validate_grid`; docs/regression.md).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daopsim.simulator.data import (
    CI_TRACE,
    bundled_traces,
    check_input_file,
    read_toml,
    resolve_trace,
)
from daopsim.simulator.errors import UserError
from daopsim.simulator.regress_compare import _num

#: Cache ratios and machines of a grid file block that names neither (the old built-in grid's).
DEFAULT_RATIOS = (0.125, 0.1875, 0.375)
DEFAULT_PROFILES = ("a6000-pcie4", "rtx4090-pcie4")
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
