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

This module runs a grid and reports (:func:`regress`, :func:`run_grid`, the guard on updating
the golden store) and holds the public names of its parts: ``regress_grid`` (the grid: blocks,
cells, the built-in grid, grid files), ``regress_compare`` (what moved, within which tolerance)
and ``regress_store`` (reading and writing a store).
"""

from __future__ import annotations

import fnmatch
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from daopsim.simulator.data import (
    bundled_dir,
    resolve_trace,
)
from daopsim.simulator.errors import PolicyError, UserError
from daopsim.simulator.regress_compare import (
    ABS_TOLERANCE,
    DEFAULT_TOLERANCE,
    Change,
    compare,
    compare_grids,
    flatten,
    render_changes,
    same,
)
from daopsim.simulator.regress_grid import (
    BLOCK_KEYS,
    BUDGET_FREE_POLICIES,
    BUDGET_POLICIES,
    BUILTIN_VARIANTS,
    DEFAULT_PROFILES,
    DEFAULT_RATIOS,
    GRID_KEYS,
    Budget,
    Cell,
    GridBlock,
    PolicySpec,
    RegressGrid,
    builtin_policies,
    check_tolerance,
    config_key,
    default_grid,
    load_grid,
    validate_grid,
)
from daopsim.simulator.regress_store import (
    FORMAT,
    baseline_text,
    check_store_target,
    load_baseline,
    write_baseline,
)


def default_store() -> Path:
    """The golden store: the bundled ``baselines/policy-metrics.json``.

    Found through the installed packages (in a source checkout or an editable install, the
    repository's own file), never the working directory.
    """
    return bundled_dir("baselines") / "policy-metrics.json"


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


__all__ = [
    "ABS_TOLERANCE",
    "BLOCK_KEYS",
    "BUDGET_FREE_POLICIES",
    "BUDGET_POLICIES",
    "BUILTIN_VARIANTS",
    "DEFAULT_PROFILES",
    "DEFAULT_RATIOS",
    "DEFAULT_TOLERANCE",
    "FORMAT",
    "GRID_KEYS",
    "Budget",
    "Cell",
    "Change",
    "GridBlock",
    "PolicySpec",
    "RegressGrid",
    "RegressReport",
    "baseline_text",
    "builtin_policies",
    "check_golden_update",
    "check_store_target",
    "check_tolerance",
    "compare",
    "compare_grids",
    "config_key",
    "default_grid",
    "default_store",
    "flatten",
    "load_baseline",
    "load_grid",
    "regress",
    "render_changes",
    "run_cell",
    "run_grid",
    "same",
    "select",
    "validate_grid",
    "with_trace",
    "write_baseline",
]
