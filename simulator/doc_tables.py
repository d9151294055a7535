"""The docs' generated tables: each is the text between two markers of a docs page, rewritten
from the declaration it lists, so a page never lists by hand what the code declares.

- docs/metrics.md: one table per section of the metric registry (simulator/metrics.py,
  :func:`~daopsim.simulator.metrics.section_table`), between
  ``<!-- metrics-table:SECTION:start -->`` and its end marker (:func:`render_metrics`);
- docs/sweeps.md: the keys of a sweep grid and a ``run --config`` file, from the run
  declaration (simulator/run_params.py, :func:`~daopsim.simulator.run_params.grid_table`),
  between ``<!-- grid-keys:start -->`` and ``<!-- grid-keys:end -->``.

``make docs-metrics`` (``python -m daopsim.simulator.doc_tables``) rewrites every page;
tests/test_run_declaration.py checks that the committed pages equal what is generated.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def replace_block(text: str, name: str, body: str, page: str) -> str:
    """``text`` with the block between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``
    replaced by ``body``; a ValueError names the page and the missing markers."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        raise ValueError(f"{page}: no {start} ... {end} block")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def render_metrics(text: str) -> str:
    """docs/metrics.md with each section's table generated from the metric registry; every
    section of the registry must have its markers (a ValueError names the missing one)."""
    from daopsim.simulator.metrics import METRICS, section_table

    for section in dict.fromkeys(m.section for m in METRICS):
        text = replace_block(
            text, f"metrics-table:{section}", section_table(section), "docs/metrics.md"
        )
    return text


def render_sweeps(text: str) -> str:
    """docs/sweeps.md with its grid-key table generated from the run declaration."""
    from daopsim.simulator.run_params import grid_table

    return replace_block(text, "grid-keys", grid_table(), "docs/sweeps.md")


#: every page with generated tables (relative to the repository) and its renderer
PAGES: dict[str, Callable[[str], str]] = {
    "docs/metrics.md": render_metrics,
    "docs/sweeps.md": render_sweeps,
}


def main(argv: list[str]) -> int:
    """``python -m daopsim.simulator.doc_tables [ROOT]``: rewrite the generated tables of
    every page in :data:`PAGES` under ROOT (default: the current folder)."""
    from daopsim.simulator.output import write_text

    root = Path(argv[0] if argv else ".")
    for page, render in PAGES.items():
        path = root / page
        old = path.read_text(encoding="utf-8")
        new = render(old)
        if new != old:
            write_text(path, new)
        print(f"{path}: {'rewritten' if new != old else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
