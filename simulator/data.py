"""Where bundled data lives (package data, so an installed wheel finds it) and name lookup."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from simulator.errors import UserError

#: The bundled trace ``daopsim run`` uses when ``--trace`` is not given.
DEFAULT_TRACE = "mixtral-8x7b"
#: The small bundled trace that golden tests and ``daopsim regress`` use.
CI_TRACE = "ci-small"


def profiles_dir() -> Path:
    """Folder of the bundled hardware profiles (hardware_profiles/*.toml)."""
    return Path(str(resources.files("hardware_profiles")))


def traces_dir() -> Path:
    """Folder of the bundled traces (traces/*.parquet)."""
    return Path(str(resources.files("traces")))


def bundled_traces() -> dict[str, Path]:
    """Bundled traces by short name (file stem)."""
    return {p.stem: p for p in sorted(traces_dir().glob("*.parquet"))}


def resolve_trace(name_or_path: str | os.PathLike[str] | None) -> Path:
    """A bundled trace's short name, or a path; a clear error listing bundled names."""
    if name_or_path is None:
        name_or_path = DEFAULT_TRACE
    text = str(name_or_path)
    bundled = bundled_traces()
    if text in bundled:
        return bundled[text]
    path = Path(text).expanduser()
    if path.exists() or text.endswith(".parquet") or os.sep in text:
        if not path.exists():
            raise UserError(f"{path}: no such trace file")
        return path
    names = ", ".join(bundled) or "(none)"
    raise UserError(f"unknown trace {text!r}: not a file and not a bundled trace ({names})")
