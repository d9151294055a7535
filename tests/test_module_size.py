"""No module of simulator/ or policies/ over 800 lines holds more than one idea.

A long module is allowed only when it holds one idea that does not split: it is then listed in
``ONE_IDEA`` below with that idea stated, in a sentence a reviewer can check against the file.
Any other module over ``MODULE_LINES`` lines fails with its name and size: split it by idea into
modules named by their idea (a package with submodules when that reads better; docs/architecture.md,
"Module by module").

``PENDING`` names the modules being split at the moment, with who splits them; it is meant to be
empty, and a module leaves it in the commit that splits it.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the longest a module of ``simulator/`` or ``policies/`` may be without a stated single idea
MODULE_LINES = 800

#: module (path from the repository root) -> the one idea it holds, why it stays whole
ONE_IDEA: dict[str, str] = {
    "simulator/costs.py": (
        "the cost arithmetic: every duration and byte count of a run as pure functions of the "
        "profile and the model, in one place so that no cost is written twice (both engines, "
        "the bounds and advise read it)"
    ),
    "simulator/reference/engine.py": (
        "the independent reference engine: the timing rules written again as plain SimPy "
        "processes, kept in one file so that it shares nothing with the core it checks"
    ),
}

#: module -> who is splitting it now (to be emptied; see the module docstring)
PENDING: dict[str, str] = {}


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _sizes() -> dict[str, int]:
    """Every module of simulator/ and policies/ by its path from the root: its length in lines."""
    return {
        p.relative_to(REPO).as_posix(): _lines(p)
        for pkg in ("simulator", "policies")
        for p in sorted((REPO / pkg).rglob("*.py"))
    }


def _oversized(sizes: dict[str, int]) -> dict[str, int]:
    """The modules over ``MODULE_LINES`` lines that neither list names."""
    allowed = set(ONE_IDEA) | set(PENDING)
    return {m: n for m, n in sizes.items() if n > MODULE_LINES and m not in allowed}


def test_no_module_over_800_lines_holds_more_than_one_idea() -> None:
    big = _oversized(_sizes())
    assert not big, (
        f"modules over {MODULE_LINES} lines: "
        + ", ".join(f"{m} ({n} lines)" for m, n in sorted(big.items()))
        + "; split each by idea, or state its one idea in tests/test_module_size.py ONE_IDEA"
    )


def test_the_lists_name_only_modules_that_need_them() -> None:
    """A listed module that no longer exists or has shrunk under the limit leaves the list, so
    the list stays short and says only what is true."""
    sizes = _sizes()
    stale = [m for m in (*ONE_IDEA, *PENDING) if m not in sizes or sizes[m] <= MODULE_LINES]
    assert not stale, f"listed but not over {MODULE_LINES} lines (or gone): {stale}"
    assert not set(ONE_IDEA) & set(PENDING)
    for module, idea in ONE_IDEA.items():
        assert len(idea.split()) >= 8, f"{module}: state its one idea in a sentence"


def test_a_new_long_module_is_caught() -> None:
    sizes = {"simulator/new_thing.py": MODULE_LINES + 1, "simulator/small.py": MODULE_LINES}
    assert _oversized(sizes) == {"simulator/new_thing.py": MODULE_LINES + 1}
    assert _oversized({"simulator/costs.py": 5000}) == {}
