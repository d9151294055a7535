"""Checks for output paths given on the command line: fail early, and as one line.

``check_output_file`` runs before any work (an output that can never be written should not cost
a long run first); ``output_errors`` turns an ``OSError`` while writing into a ``UserError``
naming the option and the path, so a full disk or a read-only folder is never a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from simulator.errors import UserError


def _nearest_existing(p: Path) -> Path:
    probe = p
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe


def check_output_file(path: str | os.PathLike[str], flag: str) -> None:
    """The output file's folder exists or can be created, is a folder and is writable."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {p}: is a directory, expected a file path")
    probe = _nearest_existing(p.parent)
    if not probe.is_dir():
        raise UserError(f"{flag} {p}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {p}: {probe} is not writable")


@contextmanager
def output_errors(path: str | os.PathLike[str], flag: str) -> Iterator[None]:
    """Re-raise an OSError from the block as a one-line UserError about ``path``."""
    try:
        yield
    except OSError as exc:
        detail = exc.strerror or str(exc) or type(exc).__name__
        if exc.filename is not None and str(exc.filename) != str(path):
            detail += f" ({exc.filename})"
        raise UserError(f"{flag} {path}: cannot write: {detail}") from None
