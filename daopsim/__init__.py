"""daopsim: a trace-driven discrete-event simulator for MoE expert-offloading policies.

This package is the stable public API: every workflow of the README, docs/ and the notebooks
is reachable from here. The subpackages ``daopsim.simulator``, ``daopsim.policies``,
``daopsim.hardware_profiles`` and ``daopsim.traces`` (the repository's top-level folders of those
names) are the implementation (they may move between releases); import from ``daopsim``.

>>> import daopsim
>>> r = daopsim.simulate(policy="lru", hw="a6000-pcie4", trace="ci-small", sequences=1)
>>> sorted(daopsim.policies())[:3]
['all-gpu', 'belady', 'daop']

Running: :func:`simulate` (one run, a :class:`RunResult`), :func:`all_gpu_bound` (its all-GPU
bound), :func:`sweep` (a grid as a DataFrame), :func:`run_sweep` and :class:`Grid` (the same
with a :class:`SweepSummary`, resumable), :func:`read_table`, :func:`seed_summary`,
:func:`advise`, :func:`compare` (several policies side by side), :class:`ServingConfig`
(``simulate(serving=...)``, docs/serving.md).

Plots of a sweep table: :func:`plot` (by kind, :data:`PLOT_KINDS`), :func:`plot_throughput`,
:func:`plot_hit_rate`, :func:`plot_breakdown`, :func:`plot_heatmap`, :func:`plot_pareto`,
:func:`plot_latency_load`, :func:`pareto_front`, :func:`realisable`, :func:`policy_color`,
:func:`save_figure`.

Traces: :func:`bundled_traces`, :func:`trace_path`, :func:`read_meta`, :func:`iter_sequences`,
:func:`validate_trace`, :func:`write_trace`, :class:`TraceWriter`, :func:`trace_stats`,
:func:`import_trace` (:class:`ImportOptions`), :func:`make_trace` (a small random trace),
:func:`synth` (a calibrated synthetic trace; :class:`SynthParams`, :func:`write_synthetic`,
:func:`synth_presets`). Capture (the ``capture`` extra: torch and transformers):
:func:`capture_model`, :func:`run_capture`, :class:`CaptureConfig`,
:class:`GenerationSettings`, :class:`Prompt`, :func:`load_prompts`.

Machines, models and costs: :func:`load_profile`, :func:`list_profiles`, :func:`get_runtime`,
:func:`runtime_names`, :func:`get_model`, :data:`DTYPES`, :func:`cost_model`,
:func:`runtime_cost_model` (with a runtime's per-call costs), :func:`expert_fit`. Writing a policy:
:class:`Policy` (or :class:`CachingPolicy`), :func:`register`, :func:`policy_class`,
:func:`load_policy_file`, :class:`Plan` (:class:`FrozenPlan`, :data:`ALL_GPU_PLAN`),
:class:`Action`, :class:`View`, :class:`SetupContext`, :class:`ResourceSpec`, :class:`Param`;
``policies()`` lists them. Writing outputs safely: :func:`output_dir`, :func:`write_text`,
:func:`write_file`, :func:`check_output_file`. Errors: :class:`UserError`, :class:`PolicyError`.

Learning a policy: the submodule ``daopsim.gym`` (the ``gym`` extra) is a Gymnasium environment
over the simulator and trains the ``learned`` policy (docs/learned-policies.md).

Nothing heavy is imported until a name is first used, so ``import daopsim`` is fast.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real objects, for type checkers and IDEs
    from daopsim.policies.base import (
        ALL_GPU_PLAN,
        Action,
        FrozenPlan,
        Plan,
        Policy,
        ResourceSpec,
        SetupContext,
        View,
    )
    from daopsim.policies.caching import CachingPolicy
    from daopsim.policies.options import Param
    from daopsim.policies.registry import get_policy_class as policy_class
    from daopsim.policies.registry import load_policy_file, register
    from daopsim.simulator.advise import advise
    from daopsim.simulator.bounds import all_gpu_bound
    from daopsim.simulator.capture import CaptureConfig, capture_model, run_capture
    from daopsim.simulator.capture_generate import GenerationSettings, Prompt, load_prompts
    from daopsim.simulator.compare import compare
    from daopsim.simulator.costs import cost_model
    from daopsim.simulator.data import bundled_traces
    from daopsim.simulator.data import resolve_trace as trace_path
    from daopsim.simulator.errors import PolicyError, UserError
    from daopsim.simulator.fit import expert_fit
    from daopsim.simulator.grid import Grid
    from daopsim.simulator.hardware import list_profiles, load_profile
    from daopsim.simulator.importers import import_trace
    from daopsim.simulator.importers_common import ImportOptions
    from daopsim.simulator.models import get_model
    from daopsim.simulator.output import check_output_file, output_dir, write_file, write_text
    from daopsim.simulator.plots import (
        plot,
        plot_breakdown,
        plot_heatmap,
        plot_hit_rate,
        plot_latency_load,
        plot_throughput,
        policy_color,
        save_figure,
    )
    from daopsim.simulator.plots_common import KINDS as PLOT_KINDS
    from daopsim.simulator.plots_common import realisable
    from daopsim.simulator.plots_pareto import pareto_front, plot_pareto
    from daopsim.simulator.precisions import DTYPES
    from daopsim.simulator.results import RunResult
    from daopsim.simulator.run_costs import runtime_cost_model
    from daopsim.simulator.runner import simulate
    from daopsim.simulator.runtime_profiles import get_runtime, runtime_names
    from daopsim.simulator.serving_config import ServingConfig
    from daopsim.simulator.stats import trace_stats
    from daopsim.simulator.sweep import SweepSummary, run_sweep, sweep
    from daopsim.simulator.sweep_table import read_table, seed_summary
    from daopsim.simulator.synth import synth, write_synthetic
    from daopsim.simulator.synth_params import PRESETS as synth_presets
    from daopsim.simulator.synth_params import SynthParams
    from daopsim.simulator.testing import make_trace
    from daopsim.simulator.trace_read import iter_sequences, read_meta, validate_trace
    from daopsim.simulator.trace_write import TraceWriter, write_trace

try:
    __version__ = metadata.version("daopsim")
except metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH, never installed
    __version__ = "0+unknown"


def _names(module: str, *names: str) -> dict[str, tuple[str, str | None]]:
    """``public name -> (module, attribute)`` for names that keep their attribute name."""
    return {n: (module, n) for n in names}


#: public name -> (module, attribute; None for the module itself), imported on first use
_LAZY: dict[str, tuple[str, str | None]] = {
    # running
    **_names("daopsim.simulator.runner", "simulate"),
    **_names("daopsim.simulator.fit", "expert_fit"),
    **_names("daopsim.simulator.serving_config", "ServingConfig"),
    **_names("daopsim.simulator.results", "RunResult"),
    **_names("daopsim.simulator.bounds", "all_gpu_bound"),
    **_names("daopsim.simulator.sweep", "sweep", "run_sweep", "SweepSummary"),
    **_names("daopsim.simulator.grid", "Grid"),
    **_names("daopsim.simulator.sweep_table", "read_table", "seed_summary"),
    **_names("daopsim.simulator.advise", "advise"),
    **_names("daopsim.simulator.compare", "compare"),
    # plots of a sweep table
    **_names(
        "daopsim.simulator.plots",
        "plot",
        "plot_throughput",
        "plot_hit_rate",
        "plot_breakdown",
        "plot_heatmap",
        "plot_pareto",
        "plot_latency_load",
        "pareto_front",
        "realisable",
        "policy_color",
        "save_figure",
    ),
    "PLOT_KINDS": ("daopsim.simulator.plots", "KINDS"),
    # traces
    **_names("daopsim.simulator.data", "bundled_traces"),
    "trace_path": ("daopsim.simulator.data", "resolve_trace"),
    **_names("daopsim.simulator.trace_read", "read_meta", "iter_sequences", "validate_trace"),
    **_names("daopsim.simulator.trace_write", "write_trace", "TraceWriter"),
    **_names("daopsim.simulator.stats", "trace_stats"),
    **_names("daopsim.simulator.importers", "import_trace", "ImportOptions"),
    **_names("daopsim.simulator.testing", "make_trace"),
    **_names("daopsim.simulator.synth", "synth", "write_synthetic"),
    **_names("daopsim.simulator.synth_params", "SynthParams"),
    "synth_presets": ("daopsim.simulator.synth_params", "PRESETS"),
    # capture (the `capture` extra)
    **_names("daopsim.simulator.capture", "capture_model", "run_capture", "CaptureConfig"),
    **_names("daopsim.simulator.capture_generate", "GenerationSettings", "Prompt", "load_prompts"),
    # machines, models, runtimes and costs
    **_names("daopsim.simulator.hardware", "load_profile", "list_profiles"),
    **_names("daopsim.simulator.runtime_profiles", "get_runtime", "runtime_names"),
    **_names("daopsim.simulator.models", "get_model"),
    **_names("daopsim.simulator.precisions", "DTYPES"),
    **_names("daopsim.simulator.costs", "cost_model"),
    **_names("daopsim.simulator.run_costs", "runtime_cost_model"),
    # writing a policy
    **_names(
        "daopsim.policies.base",
        "Policy",
        "Plan",
        "FrozenPlan",
        "ALL_GPU_PLAN",
        "Action",
        "View",
        "SetupContext",
        "ResourceSpec",
    ),
    **_names("daopsim.policies.options", "Param"),
    **_names("daopsim.policies.caching", "CachingPolicy"),
    **_names("daopsim.policies.registry", "register", "load_policy_file"),
    # the subpackage daopsim.policies, callable: daopsim.policies() lists the policies
    "policies": ("daopsim.policies", None),
    "policy_class": ("daopsim.policies.registry", "get_policy_class"),
    # outputs and errors
    **_names(
        "daopsim.simulator.output", "output_dir", "write_text", "write_file", "check_output_file"
    ),
    **_names("daopsim.simulator.errors", "UserError", "PolicyError"),
}

__all__ = [
    "ALL_GPU_PLAN",
    "DTYPES",
    "PLOT_KINDS",
    "Action",
    "CachingPolicy",
    "CaptureConfig",
    "FrozenPlan",
    "GenerationSettings",
    "Grid",
    "ImportOptions",
    "Param",
    "Plan",
    "Policy",
    "PolicyError",
    "Prompt",
    "ResourceSpec",
    "RunResult",
    "ServingConfig",
    "SetupContext",
    "SweepSummary",
    "SynthParams",
    "TraceWriter",
    "UserError",
    "View",
    "__version__",
    "advise",
    "all_gpu_bound",
    "bundled_traces",
    "capture_model",
    "check_output_file",
    "compare",
    "cost_model",
    "expert_fit",
    "get_model",
    "get_runtime",
    "import_trace",
    "iter_sequences",
    "list_profiles",
    "load_policy_file",
    "load_profile",
    "load_prompts",
    "make_trace",
    "output_dir",
    "pareto_front",
    "plot",
    "plot_breakdown",
    "plot_heatmap",
    "plot_hit_rate",
    "plot_latency_load",
    "plot_pareto",
    "plot_throughput",
    "policies",
    "policy_class",
    "policy_color",
    "read_meta",
    "read_table",
    "realisable",
    "register",
    "run_capture",
    "run_sweep",
    "runtime_cost_model",
    "runtime_names",
    "save_figure",
    "seed_summary",
    "simulate",
    "sweep",
    "synth",
    "synth_presets",
    "trace_path",
    "trace_stats",
    "validate_trace",
    "write_file",
    "write_synthetic",
    "write_text",
    "write_trace",
]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'daopsim' has no attribute {name!r}") from None
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return list(__all__)
