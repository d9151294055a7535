"""The simulator's implementation: engine, costs, trace I/O, runs, sweeps and the CLI.

Installed as ``daopsim.simulator`` (the only name it imports by; the repository's simulator/
folder is the package through pyproject.toml's package-dir). This package is internal (its
modules may move); the stable Python API is ``import daopsim``.
For convenience it still exposes ``simulate``, ``run_sweep``/``Grid``, ``plots``,
``load_profile``, ``get_model``, ``read_meta`` and ``iter_sequences``, imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

if __name__ != "daopsim.simulator":  # one name per module: never two copies
    raise ImportError(
        f"{__name__!r} is the package daopsim.simulator: import it by that name "
        "(the folder simulator/ installs only inside daopsim)"
    )

from daopsim.simulator import native as _native

# the engine core runs compiled when a current build is present, else from its sources
_native.install()

__version__ = "0.1.0"

__all__ = [
    "Grid",
    "RunResult",
    "__version__",
    "get_model",
    "iter_sequences",
    "load_profile",
    "plots",
    "read_meta",
    "run_sweep",
    "simulate",
]

#: name -> (module, attribute or None for the module itself), imported on first use
_LAZY = {
    "simulate": ("daopsim.simulator.runner", "simulate"),
    "RunResult": ("daopsim.simulator.results", "RunResult"),
    "run_sweep": ("daopsim.simulator.sweep", "run_sweep"),
    "Grid": ("daopsim.simulator.grid", "Grid"),
    "plots": ("daopsim.simulator.plots", None),
    "load_profile": ("daopsim.simulator.hardware", "load_profile"),
    "get_model": ("daopsim.simulator.models", "get_model"),
    "read_meta": ("daopsim.simulator.trace", "read_meta"),
    "iter_sequences": ("daopsim.simulator.trace", "iter_sequences"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    mod = importlib.import_module(module)
    return mod if attr is None else getattr(mod, attr)
