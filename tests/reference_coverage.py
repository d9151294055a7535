"""How much of the fast engine the reference-equivalence tests execute.

The reference engine (simulator/reference/) re-implements the timing rules; the equivalence
tests (marked ``reference``) compare it with the fast engine. They check only the fast
engine's code they run, so this tool runs them under ``coverage`` and reports, for every
entry of :data:`MEASURED`, the share of its executable lines that ran:

    .venv/bin/python tests/reference_coverage.py                 # the report, exit 1 below 95 %
    .venv/bin/python tests/reference_coverage.py --fail-under 0  # the report only
    .venv/bin/python tests/reference_coverage.py -- -k chaos     # extra pytest arguments

(``make reference-coverage`` runs the first.) The share counts the lines of :data:`MEASURED`
but those of :data:`NOT_GENERAL` (the figure with them is printed too). When the engine moves
(the core rewrite), point :data:`MEASURED` at the new modules and functions (and empty
:data:`NOT_GENERAL`): they are the lists to change.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: what is measured: a module (``path``), a class or a function in it (``path:Name`` or
#: ``path:Class.method``), relative to the repository; the fast engine's general path
MEASURED: tuple[str, ...] = (
    "simulator/engine.py:EngineBase",
    "simulator/engine.py:Engine._layer",
    "simulator/engine.py:Engine._serve_op",
    "simulator/engine.py:Engine._cpu_stage",
    "simulator/engine.py:Engine._resolve",
    "simulator/engine.py:Engine._gather_barrier",
    "simulator/engine.py:Engine._weights_copy",
    "simulator/machine.py:SharedCpu",
    "simulator/machine.py:Lane",
    "simulator/residency.py",
    "simulator/runtime_profiles.py:HostThread",
)

#: functions inside MEASURED that are not today's general path, left out of the share: the
#: base class's stubs the fast engine overrides, SharedCpu's written-out copies of its own
#: arithmetic for the one-pass paths, and Residency methods nothing calls any more
NOT_GENERAL: tuple[str, ...] = (
    "simulator/engine.py:EngineBase.run",
    "simulator/engine.py:EngineBase._due",
    "simulator/engine.py:EngineBase._hits_only",
    "simulator/engine.py:EngineBase._precalc_layer",
    "simulator/engine.py:EngineBase._copies_only",
    "simulator/engine.py:EngineBase._cpu_layer_decode",
    "simulator/engine.py:EngineBase._gpu_cpu_layer",
    "simulator/engine.py:EngineBase._free_slot",
    "simulator/engine.py:EngineBase._rearm",
    "simulator/engine.py:EngineBase._weights_now",
    "simulator/machine.py:SharedCpu.submit_next",
    "simulator/machine.py:SharedCpu.arrive_then_end",
    "simulator/machine.py:SharedCpu.wake_next",
    "simulator/machine.py:SharedCpu.run_alone",
    "simulator/machine.py:SharedCpu.run_queue",
    "simulator/machine.py:SharedCpu._lone_rate",
    "simulator/residency.py:Residency.insert",
    "simulator/residency.py:Residency.remove",
    "simulator/residency.py:Residency.copied",
    "simulator/residency.py:Residency.swap_slots",
)

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
        res = subprocess.run(cmd, cwd=REPO)
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
    share = _total(rows, width, "total (general path)")
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
