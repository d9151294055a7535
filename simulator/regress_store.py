"""A regression store on disk (the golden store is ``baselines/policy-metrics.json``): its format,
reading it with a one-line error for a damaged or foreign file, where one may be written, and
writing it atomically.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from daopsim.simulator.data import (
    check_input_file,
)
from daopsim.simulator.errors import UserError

FORMAT = "daopsim-regress/2"


# --- the store file ---------------------------------------------------------------------------


def load_baseline(path: str | Path) -> dict[str, Any]:
    """Read and check a store file; a clear one-line error when it is missing or damaged."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{p}: is a directory, not a baseline file")
    if not p.exists():
        raise UserError(f"{p}: no such baseline file (create it with `daopsim regress --update`)")
    check_input_file(p, "baseline")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{p}: not a readable JSON baseline ({first})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UserError(
            f"{p}: not a daopsim regress baseline of format {FORMAT!r} "
            "(an older store is rewritten by `daopsim regress --update`)"
        )
    confs = doc.get("configurations")
    if not isinstance(confs, dict) or not all(isinstance(v, dict) for v in confs.values()):
        raise UserError(f"{p}: key 'configurations' must map names to objects")
    if not isinstance(doc.get("grid"), dict):
        raise UserError(f"{p}: key 'grid' must be an object")
    return doc


def check_store_target(path: str | Path) -> None:
    """``--update`` may write ``path``: a ``.json`` name, and an existing file there is a store
    of this command (any version of the format, damaged numbers included), never another file
    (``--baseline results.parquet`` would replace a table with the store)."""
    from daopsim.simulator.errors import OutputError
    from daopsim.simulator.output import output_format

    output_format(path, {".json": "json"}, "--baseline")
    p = Path(path)
    if not p.is_file():
        return
    try:
        doc = json.loads(p.read_bytes())
    except OSError:
        return  # unreadable: the write reports it
    except ValueError:
        doc = None
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if not (isinstance(fmt, str) and fmt.startswith("daopsim-regress/")):
        raise OutputError(
            f"--baseline {p}: exists and is not a daopsim regress store (a JSON object with "
            '"format": "daopsim-regress/N"); refusing to replace it'
        )


def baseline_text(grid: dict[str, Any], outcomes: dict[str, dict[str, Any]]) -> str:
    """The store's text: deterministic, one value per line so diffs stay readable."""
    doc = {"format": FORMAT, "grid": grid, "configurations": outcomes}
    return json.dumps(doc, indent=1, sort_keys=False, allow_nan=False) + "\n"


def write_baseline(path: str | Path, grid: dict[str, Any], outcomes: dict[str, Any]) -> Path:
    """Rewrite the store atomically (temporary file in the same folder, then rename)."""
    from daopsim.simulator.output import check_output_file, write_text

    check_output_file(path, "--baseline")
    return write_text(path, baseline_text(grid, outcomes), "--baseline")
