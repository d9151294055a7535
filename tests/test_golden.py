"""The golden store (baselines/policy-metrics.json): exact numbers, and a grid that discriminates.

The store is the one file of expected numbers. These tests re-run every cell of its grid, one
test per trace, machine and budget (so pytest-xdist spreads them), with a tight tolerance
(integers exact: hit counts, accesses, bytes moved, copies; floats such as simulated time to a
relative 1e-9).
They are ``make test``'s one check of the store; ``daopsim regress`` is the same check from
the command line (floats to a relative 1e-6). They also check that the store was made from the
built-in grid on the bundled traces (their SHA-256), and that the grid can tell the policies
and options apart: a cell where two policies agree on everything proves nothing about either.

A changed number is a changed behaviour. When the change is intended, rewrite the store with
``daopsim regress --update`` and commit it in the same commit as the change, saying in the
commit message which numbers moved and why (docs/regression.md).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

import pytest

from daopsim.simulator.data import resolve_trace
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.regress import default_store, run_cell
from daopsim.simulator.regress_compare import compare, render_changes
from daopsim.simulator.regress_grid import (
    BUDGET_FREE_POLICIES,
    BUDGET_POLICIES,
    BUILTIN_VARIANTS,
    Cell,
    builtin_policies,
    default_grid,
)
from daopsim.simulator.regress_store import load_baseline
from daopsim.simulator.trace_read import read_meta

#: Floats re-run in-process on the same platform are bit-identical; 1e-9 only forgives the
#: last digits a different numpy/libm build could change.
TIGHT = 1e-9
#: Replacement and placement policies; every pair must differ in decode hits somewhere.
CACHING = (
    "lru",
    "lfu",
    "learned",
    "round-robin",
    "belady",
    "global-lru",
    "global-lfu",
    "belady-global",
    "static",
    "fiddler",
    "daop",
)
FIX = "run `daopsim regress --update` and commit the store with the reason"
GRID = default_grid()


@pytest.fixture(scope="module")
def store() -> dict[str, Any]:
    """The committed golden store."""
    return load_baseline(default_store())


def test_store_was_made_from_the_builtin_grid(store: dict[str, Any]) -> None:
    """Same blocks, policies, machines, budgets, sequences and trace bytes as default_grid()."""
    for block in GRID.blocks:
        want = block.describe()["trace_sha256"]
        got = {b["trace"]: b["trace_sha256"] for b in store["grid"]["blocks"]}.get(block.label)
        assert got == want, f"bundled trace {block.label!r} changed since the store was made; {FIX}"
    assert store["grid"] == GRID.describe(), f"the built-in grid changed; {FIX}"
    assert list(store["configurations"]) == [c.key for c in GRID.cells()], FIX


def _groups() -> dict[str, list[Cell]]:
    """The grid's cells by trace, machine and budget: a test each."""
    out: dict[str, list[Cell]] = {}
    for cell in GRID.cells():
        out.setdefault(f"{cell.block.label} | {cell.hw} | {cell.budget.label}", []).append(cell)
    return out


GROUPS = _groups()


@pytest.mark.slow
@pytest.mark.parametrize("group", list(GROUPS))
def test_every_cell_matches_the_store_exactly(group: str, store: dict[str, Any]) -> None:
    cells = GROUPS[group]
    missing = [c.key for c in cells if c.key not in store["configurations"]]
    assert not missing, f"{missing}: not in the store; {FIX}"
    want = {c.key: store["configurations"][c.key] for c in cells}
    changes = compare(want, {c.key: run_cell(c) for c in cells}, TIGHT)
    assert not changes, f"{FIX}\n{render_changes(changes)}"


def _by_situation(store: dict[str, Any]) -> dict[tuple[str, str, str], dict[str, dict]]:
    """(trace, machine, budget) -> policy label -> metrics, for cells that ran."""
    out: dict[tuple[str, str, str], dict[str, dict]] = defaultdict(dict)
    for cell in GRID.cells():
        rec = store["configurations"][cell.key]
        if "metrics" in rec:
            out[(cell.block.label, cell.hw, cell.budget.label)][cell.spec.label] = rec["metrics"]
    return out


def test_every_builtin_policy_has_golden_numbers_where_its_budget_matters(
    store: dict[str, Any],
) -> None:
    """Each registered built-in policy is declared budget-dependent or budget-free, and the
    store's numbers agree: a budget-free policy gives the same metrics at every budget of a
    trace and machine, a budget-dependent one differs somewhere and has numbers on every trace
    of the grid (the OLMoE and Phi blocks run BUDGET_POLICIES only)."""
    names = set(builtin_policies())
    dep, free = set(BUDGET_POLICIES), set(BUDGET_FREE_POLICIES)
    assert not dep & free, f"in both lists: {sorted(dep & free)}"
    assert names <= dep | free, (
        f"{sorted(names - dep - free)}: add to BUDGET_POLICIES (or, if the budget cannot change "
        f"its numbers, BUDGET_FREE_POLICIES) in simulator/regress.py; {FIX}"
    )
    assert dep | free <= names, f"{sorted(dep | free - names)}: not a built-in policy"
    # policy -> (trace, machine) -> budget -> metrics, default options only
    runs: dict[str, dict[tuple[str, str], dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for (trace, hw, budget), by_policy in _by_situation(store).items():
        for label, metrics in by_policy.items():
            if label in names:
                runs[label][(trace, hw)][budget] = metrics
    # the traces every budget-dependent policy is meant to run on (not the SSD block's subset)
    traces = {b.label for b in GRID.blocks if b.policies is None or set(b.policies) >= dep}
    assert len(traces) >= 3, traces
    for name in sorted(names):
        seen = runs[name]
        assert seen, f"{name}: no golden numbers; {FIX}"
        varies = [
            k for k, per_budget in seen.items() if len(set(map(repr, per_budget.values()))) > 1
        ]
        if name in free:
            assert not varies, (
                f"{name} is in BUDGET_FREE_POLICIES but its numbers move with the budget: {varies}"
            )
        else:
            assert varies, f"{name}: its numbers never move with the budget; BUDGET_FREE_POLICIES?"
            missing = traces - {t for t, _ in seen}
            assert not missing, f"{name}: no golden numbers on {sorted(missing)}; {FIX}"


def test_budgets_are_above_top_k() -> None:
    """At <= k experts per layer every replacement policy keeps the same experts.

    The SSD-tier block is the exception: its profiles' host memory and drive are what it pins
    (docs/serving.md, "An SSD tier"), and its 24 GB GPU holds under two Mixtral experts per
    layer at bf16; its policies differ in placement, not in replacement.
    """
    ssd_blocks = 0
    for block in GRID.blocks:
        if all(load_profile(hw).ssd is not None for hw in block.profiles):
            ssd_blocks += 1
            continue
        k = read_meta(resolve_trace(block.trace)).model.top_k
        for b in block.budgets:
            assert b.per_layer and b.value > k, (block.label, b.label)
    assert ssd_blocks == 1


def test_grid_spans_models_options_and_one_copy_engine() -> None:
    """Mixtral plus OLMoE or Phi, every built-in variant, a machine with one copy engine."""
    from daopsim.simulator.hardware import load_profile

    models = {read_meta(resolve_trace(b.trace)).model.name for b in GRID.blocks}
    assert "mixtral-8x7b" in models and models & {"olmoe-1b-7b", "phi-3.5-moe"}
    specs = {s for b in GRID.blocks for s in b.specs()}
    assert set(BUILTIN_VARIANTS) <= specs
    labels = {s.label for s in specs}
    for must in ("daop(exact_fallback=true)", "mixtral-offloading(prefetch=true)"):
        assert must in labels
    assert any(s.options == (("initial", "popular"),) for s in specs)
    engines = {load_profile(hw).link.copy_engines for b in GRID.blocks for hw in b.profiles}
    assert engines >= {1, 2}


def test_grid_tells_caching_policies_apart(store: dict[str, Any]) -> None:
    """Every pair of caching policies differs in decode hits in at least one cell."""
    cells = _by_situation(store).values()
    for a, b in itertools.combinations(CACHING, 2):
        assert any(
            m[a]["decode_hits"] != m[b]["decode_hits"] for m in cells if a in m and b in m
        ), f"{a} and {b} have the same hit count in every cell"
    # mixtral-offloading replaces like lru (per-layer LRU); its write-back tells them apart
    assert any(
        m["lru"]["d2h_bytes"] != m["mixtral-offloading"]["d2h_bytes"]
        for m in cells
        if "lru" in m and "mixtral-offloading" in m
    )


def test_every_option_variant_changes_its_policy(store: dict[str, Any]) -> None:
    """A variant equal to its defaults in every cell would not pin the option."""
    cells = _by_situation(store).values()
    for v in BUILTIN_VARIANTS:
        assert any(m[v.label] != m[v.name] for m in cells if v.label in m and v.name in m), (
            f"{v.label} gives the same numbers as {v.name} in every cell"
        )


def test_one_copy_engine_changes_some_timing(store: dict[str, Any]) -> None:
    """Same machine but one copy engine: some policy (DAOP's overlapped copies) gets slower."""
    one, two = "a6000-1ce-pcie4", "a6000-pcie4"
    by = _by_situation(store)
    slower = [
        (trace, budget, p)
        for (trace, hw, budget), m in by.items()
        if hw == one
        for p, x in m.items()
        if x["e2e_s"] > by[(trace, two, budget)][p]["e2e_s"]
    ]
    assert slower
    faster = [
        p
        for (trace, hw, budget), m in by.items()
        if hw == one
        for p, x in m.items()
        if x["e2e_s"] < by[(trace, two, budget)][p]["e2e_s"] * (1 - TIGHT)
    ]
    assert not faster, f"one copy engine made these faster: {faster}"


def test_bounds_and_outcomes_are_sane(store: dict[str, Any]) -> None:
    """all-gpu is fastest and hits everything; stream-all moves the most bytes; a refusal."""
    for m in _by_situation(store).values():
        if "all-gpu" in m:
            assert m["all-gpu"]["e2e_s"] == min(x["e2e_s"] for x in m.values())
            assert m["all-gpu"]["decode_hits"] == m["all-gpu"]["decode_accesses"]
        if "stream-all" in m:
            assert m["stream-all"]["h2d_bytes"] == max(x["h2d_bytes"] for x in m.values())
    errors = [r["error"] for r in store["configurations"].values() if "error" in r]
    assert errors and all("do not fit" in e for e in errors)
