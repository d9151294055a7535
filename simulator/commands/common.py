"""Small helpers shared by the CLI commands: JSON output and progress bars."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click


def _clean(obj: Any) -> Any:
    """JSON-safe copy: NaN and infinities become null, numpy scalars become Python numbers."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "shape", None) == ():
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def dumps(obj: Any) -> str:
    """Deterministic JSON text (sorted keys, no NaN)."""
    return json.dumps(_clean(obj), indent=2, sort_keys=True)


def echo_json(obj: Any) -> None:
    """Print one JSON document to stdout."""
    click.echo(dumps(obj))


json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


@contextlib.contextmanager
def lazy_progress(label: str, enabled: bool) -> Iterator[Callable[..., None]]:
    """A ``progress(done, total, *info)`` callback drawing a bar on stderr, opened on first use.

    The bar appears only once the total is known (the first call) and is closed on exit,
    also when the work raises.
    """
    bar = None

    def progress(done: int, total: int, *_info: object) -> None:
        nonlocal bar
        if not enabled:
            return
        if bar is None:
            bar = click.progressbar(length=total, label=label, file=sys.stderr, show_eta=True)
            bar.__enter__()
        bar.update(1)

    try:
        yield progress
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
