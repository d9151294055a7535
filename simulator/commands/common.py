"""Small helpers shared by the CLI commands: JSON output (progress bars:
daopsim.simulator.progress)."""

from __future__ import annotations

import json
import math
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
