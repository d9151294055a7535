"""The code's shape holds: no import cycle among the packages, small functions in the core.

That each timing rule is written once is tests/test_rule_homes.py's check.

docs/architecture.md describes the layering: the engine core (simulator/core/) below the
runner, the runner below sweeps, plots and validation, every import one way. These checks
read the sources (imports at any level, except those only a type checker sees).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("daopsim", "simulator", "policies")
#: the longest a function of the engine core may be (lines, decorators included)
CORE_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    """Every module by the name it imports by: the folders simulator/ and policies/ are the
    packages daopsim.simulator and daopsim.policies (pyproject.toml's package-dir)."""
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts if pkg == "daopsim" else ("daopsim", *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports (not under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(x)
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING"
        for stmt in n.body
        for x in ast.walk(stmt)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found & known


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_module_imports_another_that_imports_it_back() -> None:
    mods = _modules()
    graph = {m: _imports(p, set(mods)) - {m} for m, p in mods.items()}
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_core_imports_nothing_above_it() -> None:
    """The engine core uses the policy API, the boundary's checks and the host tier's state;
    never the runner, serving, results, sweeps or the reference engine. Two modules outside
    it serve it from below: the generic keyed heap its queues are (simulator/heap.py, a data
    structure like ``heapq``), and the reading of a finished run's state into ``RunStats``
    (simulator/runstats.py: reporting, which imports nothing of the core but for types)."""
    mods = _modules()
    allowed = ("daopsim.simulator.core", "daopsim.policies.base", "daopsim.policies._mypyc",
               "daopsim.simulator.boundary", "daopsim.simulator.hosttier",
               "daopsim.simulator.errors", "daopsim.simulator.heap",
               "daopsim.simulator.runstats")  # fmt: skip
    for name, path in mods.items():
        if name.startswith("daopsim.simulator.core"):
            bad = {m for m in _imports(path, set(mods)) if not m.startswith(allowed)}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_no_function_of_the_core_is_longer_than_80_lines() -> None:
    for path in sorted((REPO / "simulator" / "core").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = (node.end_lineno or node.lineno) - first + 1
                assert length <= CORE_FUNCTION_LINES, f"{path.name}:{node.name} {length} lines"


#: the longest a function of ``simulator/`` or ``policies/`` may be: lines from its ``def`` to
#: its last line (decorators, such as a command's click options, are declarations and do not
#: count)
FUNCTION_LINES = 80


def _function_lengths(path: Path) -> dict[str, int]:
    """Each function of ``path`` (methods and nested functions too) by qualified name: its
    length in lines from ``def`` to its end."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                out[name] = (child.end_lineno or child.lineno) - child.lineno + 1
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return out


def test_no_function_of_the_simulator_or_the_policies_is_longer_than_80_lines() -> None:
    """A function does one thing a reader holds in mind at once; a longer one is split by
    idea into named helpers."""
    long: dict[str, int] = {}
    for pkg in ("simulator", "policies"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for name, n in _function_lengths(path).items():
                if n > FUNCTION_LINES:
                    long[f"{rel}:{name}"] = n
    assert not long, f"functions over {FUNCTION_LINES} lines: {long}"
