"""daopsim: a trace-driven discrete-event simulator for MoE expert-offloading policies.

The notebook-facing API: ``simulate`` (one run), ``sweep`` (a grid, locally or on Dask),
``load_profile``, ``get_model``, ``read_meta``/``iter_sequences`` (traces).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "Grid",
    "RunResult",
    "__version__",
    "get_model",
    "iter_sequences",
    "load_profile",
    "read_meta",
    "plots",
    "run_sweep",
    "simulate",
    "sweep",
]


def __getattr__(name: str) -> Any:
    # lazy, so `import simulator` (and the CLI's start-up) stays cheap
    if name == "simulate":
        from simulator.runner import simulate

        return simulate
    if name == "RunResult":
        from simulator.results import RunResult

        return RunResult
    if name in ("sweep", "run_sweep", "Grid"):
        from simulator import sweep as _sweep

        return getattr(_sweep, name)
    if name == "plots":
        from simulator import plots

        return plots
    if name == "load_profile":
        from simulator.hardware import load_profile

        return load_profile
    if name == "get_model":
        from simulator.models import get_model

        return get_model
    if name in ("read_meta", "iter_sequences"):
        from simulator import trace

        return getattr(trace, name)
    raise AttributeError(f"module 'simulator' has no attribute {name!r}")
