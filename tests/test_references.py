"""The repository is self-contained: facts cite docs/references.md or a primary source.

No tracked file (code, docs, profiles, notebooks, the bundled traces' metadata) may point at
files outside the repository or at how the work was commissioned, and every pointer into
docs/references.md (``refs#section`` in profiles and docstrings, ``references.md#section`` in
docs) must name a section that exists.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCES = REPO / "docs" / "references.md"
#: byte patterns that must not occur anywhere in the repository's files (spelled in two parts so
#: that this file, and a grep of the repository for them, stays clean too)
FORBIDDEN = (b"shared" + b"/reference", b"task" + b" brief")
#: names that explain the notation ("refs#X", "refs#SECTION") rather than point somewhere
_PLACEHOLDERS = {"X", "SECTION", "section"}
_SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "build", "out"}


def _tracked_files() -> list[Path]:
    """The files git tracks; without git, every file outside caches and build output."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
        ).stdout
        names = [n for n in out.decode().split("\0") if n]
        if names:
            return [REPO / n for n in names if (REPO / n).is_file()]
    except (OSError, subprocess.SubprocessError):
        pass
    return [
        p
        for p in REPO.rglob("*")
        if p.is_file() and not _SKIP_DIRS & set(p.relative_to(REPO).parts)
    ]


def _anchors(text: str) -> set[str]:
    """GitHub-style heading anchors plus explicit ``<a id=...>`` targets."""
    found = set(re.findall(r'<a id="([^"]+)">', text))
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def test_no_file_points_outside_the_repository() -> None:
    files = _tracked_files()
    assert any(p.suffix == ".parquet" for p in files)  # binary files are checked too
    offenders = [
        f"{p.relative_to(REPO)}: {pattern.decode()!r}"
        for p in files
        for pattern in FORBIDDEN
        if pattern in p.read_bytes()
    ]
    assert offenders == []


def test_every_reference_pointer_names_a_section() -> None:
    anchors = _anchors(REFERENCES.read_text(encoding="utf-8"))
    assert {"models", "gpus", "links", "daop", "baselines", "routing", "fiddler"} <= anchors
    bad = []
    for p in _tracked_files():
        if p.suffix not in {".py", ".md", ".toml", ".ipynb"}:
            continue
        text = p.read_text(encoding="utf-8")
        for name in re.findall(r"(?:\brefs|references\.md)#([A-Za-z0-9_\-]+)", text):
            if name not in anchors and name not in _PLACEHOLDERS:
                bad.append(f"{p.relative_to(REPO)}: #{name}")
    assert bad == []


def test_readme_lists_the_references_page() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "[docs/references.md](docs/references.md)" in readme
