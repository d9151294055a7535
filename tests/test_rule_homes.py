"""Each timing rule of a run has one home: a second definition anywhere fails this test.

A rule is recognised in the source by what only it does: the state it writes (a lane's
``free_at``, the transfer-stall counter, a running CPU call's remaining work), the call that
applies it (holding several lanes, registering a DRAM share, the shared CPU's wake-up) or its
distinctive arithmetic (an activation's bytes from the hidden size). The test reads the
engine core and the modules that take part in a run with it (``ENGINE``: serving, the host
tier, several GPUs, run statistics, the boundary, the heap; for the activation bytes also
the cost model and the reference engine, which must ask the cost model) and requires each
rule's marks to occur in its home function only. Moving a rule means moving its home here;
writing it out a second time is what this test exists to catch. It replaces a cap on the
core's line count, which counted lines but not copies of a rule.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SIM = REPO / "simulator"

#: a mark finder: the AST nodes of a function body that show the rule
Finder = Callable[[ast.AST], bool]


def _writes_attr(*names: str) -> Finder:
    """Assignments (plain, augmented, annotated) to an attribute named one of ``names``."""

    def found(node: ast.AST) -> bool:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for x in node.targets for t in _flat(x)]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = list(_flat(node.target))
        return any(isinstance(t, ast.Attribute) and t.attr in names for t in targets)

    return found


def _flat(target: ast.expr) -> Iterator[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        for x in target.elts:
            yield from _flat(x)
    else:
        yield target


def _calls(*names: str, on: str | None = None) -> Finder:
    """Calls of a method or function named one of ``names`` (with ``on``: of an attribute or
    variable of that name, ``x.on.name(...)`` or ``on.name(...)``)."""

    def found(node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        if name not in names:
            return False
        if on is None:
            return True
        if not isinstance(f, ast.Attribute):
            return False
        owner = f.value
        return (isinstance(owner, ast.Attribute) and owner.attr == on) or (
            isinstance(owner, ast.Name) and owner.id == on
        )

    return found


def _mutates_list(*names: str) -> Finder:
    """``x.<name>.append(...)`` / ``.extend(...)``: adding to a list attribute ``name``."""

    def found(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "extend")
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr in names
        )

    return found


def _factors(node: ast.expr) -> Iterator[ast.expr]:
    """The factors of a product ``a * b * c`` (the node itself if it is no product)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        yield from _factors(node.left)
        yield from _factors(node.right)
    else:
        yield node


def _activation_bytes_arithmetic(node: ast.AST) -> bool:
    """``<x>.hidden * 2`` or ``... * ACT_BYTES``: one token's hidden state in bytes."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return False
    factors = list(_factors(node))
    hidden = any(isinstance(f, ast.Attribute) and f.attr == "hidden" for f in factors)
    two = any(
        (isinstance(f, ast.Constant) and f.value == 2)
        or (isinstance(f, ast.Name) and f.id == "ACT_BYTES")
        for f in factors
    )
    return hidden and two


def _creates_op_of_kind(kind: str) -> Finder:
    """``Op(<kind>, ...)``: an operation of that kind is made."""

    def found(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "Op"
            and bool(node.args)
            and getattr(node.args[0], "id", None) == kind
        )

    return found


@dataclass(frozen=True)
class Rule:
    """A timing rule, how its definition shows, where it lives and what the scan covers."""

    name: str
    find: Finder
    #: ``file:Qualified.name`` of every function allowed to show the mark
    homes: tuple[str, ...]
    #: also scan the cost model and the reference engine's modules (they must share this home)
    with_reference: bool = False


RULES = (
    Rule(
        "lane service: a lane's state (when it is free, its busy time) changes only as the "
        "lane primitive serves, holds, runs or blocks it (the shared CPU ends its workers' calls)",
        _writes_attr("free_at", "busy", "pending"),
        (
            "core/resources.py:Lane.__init__",
            "core/resources.py:Lanes.serve",
            "core/resources.py:Lanes.hold",
            "core/resources.py:Lanes.run",
            "core/resources.py:Lanes.settle",
            "core/resources.py:Lanes.block",
            "core/resources.py:SharedCpu.wake",
        ),
    ),
    Rule(
        "copy wait: a GPU stream waiting for a copy counts transfer stall",
        _writes_attr("transfer_stall"),
        ("core/executor.py:Executor.copy_wait",),
    ),
    Rule(
        "CPU wake-up: the shared CPU's next event is scheduled in one place",
        _creates_op_of_kind("WAKE"),
        ("core/executor.py:Executor.cpu_next",),
    ),
    Rule(
        "CPU progress: running calls progress at the common rate",
        _writes_attr("rem"),
        ("core/resources.py:CpuJob.__init__", "core/resources.py:SharedCpu._progress"),
    ),
    Rule(
        "write-back: an evicted expert's copy holds both copy directions together",
        _calls("hold"),
        ("core/executor.py:Executor._write_back",),
    ),
    Rule(
        "DRAM share: a copy's or a kernel's share of the unified DRAM is computed once",
        _calls("copy_share", "kernel_share", "copy_dram_share", "gpu_dram_share", "dram_share"),
        ("core/resources.py:Lanes._traffic",),
    ),
    Rule(
        "DRAM share: loads are registered with the shared CPU in one place",
        _calls("load", on="cpu"),
        ("core/resources.py:Lanes.load",),
    ),
    Rule(
        "activation transfer: a token's hidden-state bytes come from the cost model (in the "
        "engine core and the reference engine alike)",
        _activation_bytes_arithmetic,
        ("costs.py:CostModel.hidden_state_bytes",),
        with_reference=True,
    ),
    Rule(
        "latency and TTFT accounting: a step's latency and a sequence's time to first token "
        "are counted in one place",
        _mutates_list("ttft", "token_latency"),
        ("core/ops.py:Counters.first_token", "core/ops.py:Counters.decoded"),
    ),
    Rule(
        "decode time accounting: decode seconds and tokens are summed in one place",
        _writes_attr("decode_time", "decode_tokens"),
        ("core/ops.py:Counters.decoded",),
    ),
)


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) of every function and of the module's top level."""
    yield "<module>", tree

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, f"{name}.")

    yield from walk(tree, "")


def _own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``fn``'s own body (not of functions or classes nested in it)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


#: the modules a run of the engine core goes through, besides simulator/core/
ENGINE = (
    "serving.py",
    "scheduler.py",
    "serving_requests.py",
    "serving_summary.py",
    "hosttier.py",
    "multigpu.py",
    "runstats.py",
    "boundary.py",
    "heap.py",
)


def sources(with_reference: bool) -> dict[str, str]:
    """The engine's modules by their path under simulator/ (with ``with_reference`` also the
    cost model and the reference engine)."""
    paths = sorted((SIM / "core").glob("*.py")) + [SIM / m for m in ENGINE]
    if with_reference:
        paths += [SIM / "costs.py", *sorted((SIM / "reference").glob("*.py"))]
    return {p.relative_to(SIM).as_posix(): p.read_text(encoding="utf-8") for p in paths}


def where(rule: Rule, texts: dict[str, str]) -> set[str]:
    """The functions (``file:Qualified.name``) that show ``rule``'s mark."""
    found = set()
    for rel, text in texts.items():
        for name, fn in _functions(ast.parse(text)):
            if any(rule.find(node) for node in _own_nodes(fn)):
                found.add(f"{rel}:{name}")
    return found


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name.split(":")[0])
def test_each_rule_lives_in_its_home_only(rule: Rule) -> None:
    found = where(rule, sources(rule.with_reference))
    stray = found - set(rule.homes)
    assert not stray, f"{rule.name}: defined outside its home {rule.homes} in {sorted(stray)}"
    # every home still holds the rule (a stale home would let a move go unnoticed)
    assert found == set(rule.homes), f"{rule.name}: no longer in {sorted(set(rule.homes) - found)}"


@pytest.mark.parametrize(
    ("rule_name", "extra"),
    [
        ("lane service", "def f(lane):\n    lane.free_at = 3.0\n"),
        ("lane service", "def f(st, d):\n    st.lane.busy += d\n"),
        ("copy wait", "def f(c, a, b):\n    c.transfer_stall += a - b\n"),
        ("CPU wake-up", "def f():\n    return Op(WAKE, 'wake', -1, 0, 0, 0, 0)\n"),
        ("write-back", "def f(lanes, g):\n    lanes.hold([g, g], 0.0, 1.0, 'x', 0, 0, 0, 0, 1)\n"),
        ("DRAM share", "def f(m, n):\n    return m.costs.copy_dram_share(n, 1.0)\n"),
        (
            "activation transfer",
            "class E:\n    def f(self, model):\n        return model.hidden * 2\n",
        ),
        ("latency and TTFT accounting", "def f(c, t):\n    c.ttft.append(t)\n"),
        ("decode time accounting", "def f(c, t):\n    c.decode_time += t\n"),
    ],
)
def test_a_second_definition_is_caught(rule_name: str, extra: str) -> None:
    """The scan is not vacuous: the same mark written in another module is reported."""
    rule = next(r for r in RULES if r.name.startswith(rule_name))
    texts = sources(rule.with_reference)
    texts["serving.py"] += "\n\n" + extra
    assert where(rule, texts) - set(rule.homes) == {
        "serving.py:" + ("E.f" if extra.startswith("class") else "f")
    }


def test_no_code_outside_the_lane_primitive_writes_a_lane() -> None:
    """The lane state (``free_at``, ``busy``, ``pending``) is written only in
    simulator/core/resources.py, whatever the function (the rule above names which)."""
    rule = RULES[0]
    assert {home.split(":")[0] for home in rule.homes} == {"core/resources.py"}
    outside = {f for f in where(rule, sources(True)) if not f.startswith("core/resources.py:")}
    # the reference engine keeps its own lanes (its own state, written by its own code)
    assert {f for f in outside if not f.startswith("reference/")} == set()
