"""`make test`'s passes: the pure and measure passes collect only the files that name their
marker as ``mark.NAME`` (the Makefile greps for it), so a test carrying the marker in a file
the grep does not find must fail collection (tests/conftest.py) instead of never running."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import OWN_PASS_MARKERS, own_pass_misses

REPO = Path(__file__).resolve().parents[1]


@dataclass
class _Item:
    """What own_pass_misses reads of a collected test."""

    path: Path
    nodeid: str
    markers: tuple[str, ...]

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.markers else None


@pytest.mark.parametrize("marker", OWN_PASS_MARKERS, ids=lambda m: f"{m}-pass")
def test_a_marker_the_grep_cannot_see_is_reported(marker: str, tmp_path: Path) -> None:
    # the marker's name is put together here so that this file is none of the grep's
    seen = tmp_path / "test_seen.py"
    seen.write_text(f"import pytest\n\n@pytest.mark.{marker}\ndef test_a(): pass\n")
    hidden = tmp_path / "test_hidden.py"
    hidden.write_text(
        f"import pytest\n\nP = getattr(pytest.mark, {marker!r})\n@P\ndef test_b(): pass\n"
    )
    items = [
        _Item(seen, "test_seen.py::test_a", (marker,)),
        _Item(hidden, "test_hidden.py::test_b", (marker,)),
        _Item(hidden, "test_hidden.py::test_c", ()),
    ]
    assert own_pass_misses(items) == [
        f"test_hidden.py::test_b: marker {marker!r} not written as `mark.{marker}`"
    ]
    assert own_pass_misses(items[:1]) == []


@pytest.mark.parametrize("marker", OWN_PASS_MARKERS, ids=lambda m: f"{m}-pass")
def test_the_makefile_passes_name_the_files_of_each_marker(marker: str) -> None:
    """`make -n test` runs the marker's pass on exactly the files that name it."""
    res = subprocess.run(
        ["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, check=True
    )
    (line,) = [ln for ln in res.stdout.splitlines() if f'-m "{marker} and not bench"' in ln]
    named = sorted(f for f in line.split() if f.startswith("tests/"))
    want = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").glob("test_*.py")
        if f"mark.{marker}" in p.read_text(encoding="utf-8")
    )
    assert named == want and want
