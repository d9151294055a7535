"""How much of the engine core the reference-equivalence tests execute.

The reference engine (simulator/reference/) re-implements the timing rules; the equivalence
tests (marked ``reference``) compare it with the engine core (simulator/core/). They check
only the core's code they run, so this tool runs them under ``coverage`` on the interpreted
core (``DAOPSIM_PURE_PYTHON=1``: compiled code reports no lines) and reports, for every entry
of :data:`MEASURED`, the share of its executable lines that ran:

    .venv/bin/python tests/reference_coverage.py                 # the report, exit 1 below 95 %
    .venv/bin/python tests/reference_coverage.py --fail-under 0  # the report only
    .venv/bin/python tests/reference_coverage.py -- -k chaos     # extra pytest arguments

(``make reference-coverage`` runs the first.) The share counts the lines of :data:`MEASURED`
but those of :data:`NOT_GENERAL` (the figure with them is printed too).
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: what is measured: a module (``path``), a class or a function in it (``path:Name`` or
#: ``path:Class.method``), relative to the repository: the engine core
MEASURED: tuple[str, ...] = (
    "simulator/core/ops.py",
    "simulator/core/resources.py",
    "simulator/core/machine.py",
    "simulator/core/apply.py",
    "simulator/core/executor.py",
    "simulator/core/loop.py",
)

#: functions inside MEASURED left out of the share (none: the core is all general path)
NOT_GENERAL: tuple[str, ...] = ()

#: the reference-equivalence tests: every test marked ``reference``
MARKER = "reference"


def _span(path: Path, name: str) -> tuple[int, int]:
    """First and last line of ``Class``, ``function`` or ``Class.method`` in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in name.split("."):
        node = next(
            (
                n
                for n in body
                if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and n.name == part
            ),
            None,
        )
        if node is None:
            raise SystemExit(f"reference_coverage: {name} is not in {path}; update MEASURED")
        body = getattr(node, "body", [])
    assert node is not None
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return first, node.end_lineno or node.lineno


def measure(
    data_file: Path, leave_out: tuple[str, ...] = NOT_GENERAL
) -> list[tuple[str, int, int, list[int]]]:
    """(entry, executable lines, lines run, lines not run) for every entry of MEASURED,
    without the lines of the functions in ``leave_out``."""
    import coverage

    cov = coverage.Coverage(data_file=str(data_file))
    cov.load()
    out = []
    for entry in MEASURED:
        rel, _, name = entry.partition(":")
        path = REPO / rel
        _, statements, _, missing, _ = cov.analysis2(str(path))
        lo, hi = _span(path, name) if name else (1, 10**9)
        skip: set[int] = set()
        for other in leave_out:
            orel, _, oname = other.partition(":")
            if orel == rel:
                a, b = _span(path, oname)
                skip.update(range(a, b + 1))
        lines = [n for n in statements if lo <= n <= hi and n not in skip]
        miss = [n for n in missing if lo <= n <= hi and n not in skip]
        out.append((entry, len(lines), len(lines) - len(miss), miss))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the equivalence tests under coverage and print the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fail-under", type=float, default=95.0, help="percent (default 95)")
    ap.add_argument("--show-missing", action="store_true", help="list the lines not run")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "coverage"
        sources = sorted({str(REPO / e.partition(":")[0]) for e in MEASURED})
        cmd = [
            sys.executable, "-m", "coverage", "run", f"--data-file={data}",
            f"--include={','.join(sources)}", "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "-m", MARKER, *args.pytest_args,
        ]  # fmt: skip
        # the interpreted core: a compiled one reports no lines
        env = {**os.environ, "DAOPSIM_PURE_PYTHON": "1"}
        res = subprocess.run(cmd, cwd=REPO, env=env)
        if res.returncode != 0:
            print("reference_coverage: the equivalence tests failed", file=sys.stderr)
            return res.returncode
        rows = measure(data)
        raw = measure(data, ())
    width = max(len(r[0]) for r in rows)
    for entry, n, k, miss in rows:
        print(f"{entry:<{width}}  {k:5d}/{n:<5d} {100 * k / max(1, n):6.1f} %")
        if args.show_missing and miss:
            print(f"{'':<{width}}  not run: {', '.join(map(str, miss))}")
    share = _total(rows, width, "total")
    if NOT_GENERAL:
        _total(raw, width, f"(with the {len(NOT_GENERAL)} NOT_GENERAL functions)")
    return 0 if share >= args.fail_under else 1


def _total(rows: list[tuple[str, int, int, list[int]]], width: int, label: str) -> float:
    total = sum(r[1] for r in rows)
    ran = sum(r[2] for r in rows)
    share = 100 * ran / max(1, total)
    print(f"{label:<{width}}  {ran:5d}/{total:<5d} {share:6.1f} %")
    return share


if __name__ == "__main__":
    sys.exit(main())
