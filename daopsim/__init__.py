"""daopsim: a trace-driven discrete-event simulator for MoE expert-offloading policies.

This package is the stable public API. The modules under ``simulator``, ``policies``,
``hardware_profiles`` and ``traces`` are the implementation (see README, "Python API"); import
from ``daopsim`` so code keeps working when they move.

>>> import daopsim
>>> r = daopsim.simulate(policy="lru", hw="a6000-pcie4", trace="ci-small", sequences=1)
>>> sorted(daopsim.policies())[:3]
['all-gpu', 'belady', 'daop']

Running: :func:`simulate` (one run, a :class:`RunResult`), :func:`sweep` (a grid as a DataFrame),
:func:`run_sweep` and :class:`Grid` (the same with a summary, resumable), :class:`ServingConfig`
(batched and continuous serving for ``simulate(serving=...)``, docs/serving.md). Writing a policy:
:class:`Policy` (or :class:`CachingPolicy` for fetch-on-miss caches), :func:`register`,
:class:`Plan`, :class:`Action`, :class:`View`, :class:`SetupContext`, :class:`ResourceSpec`,
:class:`Param`. Looking up: :func:`policies`, :func:`load_profile`, :func:`get_model`. Nothing
heavy is imported until a name is first used, so ``import daopsim`` is fast. Learning a policy:
the submodule ``daopsim.gym`` (the ``gym`` extra) is a Gymnasium environment over the simulator
and trains the ``learned`` policy (docs/learned-policies.md).
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real objects, for type checkers and IDEs
    from policies.base import Action, Param, Plan, Policy, ResourceSpec, SetupContext, View
    from policies.caching import CachingPolicy
    from policies.registry import available as policies
    from policies.registry import register
    from simulator.hardware import load_profile
    from simulator.models import get_model
    from simulator.results import RunResult
    from simulator.runner import simulate
    from simulator.serving import ServingConfig
    from simulator.sweep import Grid, run_sweep, sweep

try:
    __version__ = metadata.version("daopsim")
except metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH, never installed
    __version__ = "0+unknown"

#: public name -> (module, attribute), imported on first use
_LAZY: dict[str, tuple[str, str]] = {
    "simulate": ("simulator.runner", "simulate"),
    "ServingConfig": ("simulator.serving", "ServingConfig"),
    "RunResult": ("simulator.results", "RunResult"),
    "sweep": ("simulator.sweep", "sweep"),
    "run_sweep": ("simulator.sweep", "run_sweep"),
    "Grid": ("simulator.sweep", "Grid"),
    "Policy": ("policies.base", "Policy"),
    "CachingPolicy": ("policies.caching", "CachingPolicy"),
    "Plan": ("policies.base", "Plan"),
    "Action": ("policies.base", "Action"),
    "View": ("policies.base", "View"),
    "SetupContext": ("policies.base", "SetupContext"),
    "ResourceSpec": ("policies.base", "ResourceSpec"),
    "Param": ("policies.base", "Param"),
    "register": ("policies.registry", "register"),
    "policies": ("policies.registry", "available"),
    "load_profile": ("simulator.hardware", "load_profile"),
    "get_model": ("simulator.models", "get_model"),
}

__all__ = [
    "Action",
    "CachingPolicy",
    "Grid",
    "Param",
    "Plan",
    "Policy",
    "ResourceSpec",
    "RunResult",
    "ServingConfig",
    "SetupContext",
    "View",
    "__version__",
    "get_model",
    "load_profile",
    "policies",
    "register",
    "run_sweep",
    "simulate",
    "sweep",
]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'daopsim' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return list(__all__)
