"""What the benches share: the results file they write and a measurement in a fresh
interpreter (its own peak memory, its own imports: the compiled core or the fallback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_name("results.json")


def save(key: str, value: object) -> None:
    """Record ``value`` under ``key`` in tests/bench/results.json (not committed)."""
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[key] = value
    RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def child_json(code: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter (one BLAS thread, ``env`` on top of this
    process's environment) and return the JSON object its last output line prints."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=full
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result
