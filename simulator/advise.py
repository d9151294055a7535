"""``daopsim advise``: for a model on one or several machines, search policies, their options,
memory budgets, precisions and (on request) runtimes; rank what it finds.

The search (docs/advise.md, "The search") is a set of ordinary sweep configurations
(simulator/sweep.py) run in one pool, so ``--workers`` and Dask work as they do for ``daopsim
sweep`` and every row is the ``simulate()`` call its printed ``daopsim run`` command makes.

- Every policy runs with every option at its default, and with each other value of an option
  that ``daopsim policies list`` lists (the choices, both values of a bool), one option at a
  time, at the largest budget that fits.
- An option with a searched range (``Param.search``: llama.cpp's ``n_cpu_moe`` and ``ngl``,
  KTransformers' GPU experts per layer, vLLM's offloaded layers) is tried over its whole range
  on a coarse grid, then every value around the best is tried (:func:`_refine`), at the
  largest budget and at a quarter of the experts; the other options' values are then tried at
  the best value found.
- Bounds (clairvoyant, all-GPU) run at the largest budget as reference lines, never ranked.

Rows with identical results are grouped with the reason (:func:`tie_reason`); rows are ranked
by tokens/s; the best row of each precision and, with a ``min_tokens_per_s`` target, each
machine's best and the cheapest machine that reaches it are reported.

This module is the entry (:func:`advise`: the inputs checked, the trace found, the search run
and ranked) and the public names of its parts: ``advise_answer`` (the rows and the answer),
``advise_search`` (the search), ``advise_rank`` (ties and ranking), ``advise_render`` (text
and CSV).
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from daopsim.simulator.advise_answer import (
    Advice,
    AdviceRow,
    MachineAnswer,
    bottleneck,
    exact_precision,
    fidelity,
)
from daopsim.simulator.advise_rank import _rank, tie_reason
from daopsim.simulator.advise_render import DEFAULT_TOP, DEFAULT_WIDTH, render, to_csv
from daopsim.simulator.advise_search import (
    COARSE_POINTS,
    REFINE_ALL,
    REFINE_PASSES,
    _Point,
    _Search,
    _search_coarse,
    _search_other_options,
    _search_refined,
    coarse,
    command_for,
    is_bound,
    listed_values,
    one_at_a_time,
    range_of,
)
from daopsim.simulator.errors import UserError, did_you_mean

#: Smaller cache ratios tried beside the largest budget that fits.
SMALL_RATIOS = (0.25,)
#: Precisions tried when ``--dtype`` is not given (the trace's own one is added first).
DEFAULT_DTYPES = ("q4_k_m",)
#: Evaluation sequences per run (a small, fast search).
SEQUENCES = 2


def find_trace(model: str, trace: str | None) -> tuple[str, list[str]]:
    """The trace to search on, and the ``daopsim run`` arguments that name it as a user would
    on any machine: ``--trace NAME`` for a bundled trace, ``--trace PATH`` as given for a file,
    ``--model M`` for the model's synthetic trace (``run --model`` makes the same file)."""
    from daopsim.simulator.data import bundled_traces, resolve_trace
    from daopsim.simulator.synth_params import PRESETS
    from daopsim.simulator.trace_cache import model_trace
    from daopsim.simulator.trace_read import read_meta

    if trace is not None:
        path = resolve_trace(trace)
        got = read_meta(path).model.name
        if got != model:
            raise UserError(f"--trace {trace}: records model {got!r}, not {model!r}")
        return str(path), ["--trace", trace]
    bundled = bundled_traces()
    if model in bundled:  # the trace named after the model first (not the small CI one)
        return str(bundled[model]), ["--trace", model]
    for name, path in bundled.items():
        if read_meta(path).model.name == model:
            return str(path), ["--trace", name]
    if not [p for p in PRESETS.values() if p.model == model]:
        raise UserError(
            f"no bundled trace or synth preset for model {model!r}; give --trace PATH "
            "(record one with `daopsim capture` or make one with `daopsim synth`)"
        )
    return model_trace(model, None), ["--model", model]


def synth_command(model: str) -> str:
    """The ``daopsim synth`` command that writes the synthetic trace ``--model M`` runs on."""
    from daopsim.simulator.trace_cache import MODEL_TRACE

    return shlex.join(
        [
            "daopsim",
            "synth",
            "--model",
            model,
            "--sequences",
            str(MODEL_TRACE["sequences"]),
            "--prompt-tokens",
            str(MODEL_TRACE["prompt_tokens"]),
            "--output-tokens",
            str(MODEL_TRACE["output_tokens"]),
            "--seed",
            str(MODEL_TRACE["seed"]),
            "-o",
            f"{model}.parquet",
        ]
    )


def _check_inputs(
    model: str,
    hws: list[str],
    dtypes: list[str] | None,
    policies: list[str] | None,
    runtimes: list[str] | None,
    min_tokens_per_s: float | None,
    prices: dict[str, float] | None,
    sequences: int,
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Every name and number checked before any run: the model, the machines (their
    profiles), the precisions, policies, runtimes, target and prices."""
    from daopsim.policies.registry import available, get_policy_class
    from daopsim.simulator.hardware import load_profile
    from daopsim.simulator.models import get_model
    from daopsim.simulator.precisions import DTYPES
    from daopsim.simulator.runtime_profiles import get_runtime

    shape = get_model(model)
    if not hws:
        raise UserError("--hw: no machine given")
    if len(set(hws)) != len(hws):
        dup = next(h for h in hws if hws.count(h) > 1)
        raise UserError(f"--hw: machine {dup!r} given twice")
    profiles = {h: load_profile(h) for h in hws}
    for d in dtypes or []:
        if d not in DTYPES:
            raise UserError(f"--dtype: unknown precision {d!r}{did_you_mean(d, DTYPES)}")
    registered = available()
    classes: dict[str, Any] = {}
    for p in policies or list(registered):
        if p not in registered:
            try:
                classes[p] = get_policy_class(p)  # PATH.py:CLASS, or a clear unknown-name error
            except UserError as exc:
                raise UserError(f"--policies: {exc}") from None
        else:
            classes[p] = registered[p]
    for r in runtimes or []:
        get_runtime(r)
    if min_tokens_per_s is not None and not (
        math.isfinite(min_tokens_per_s) and min_tokens_per_s > 0
    ):
        raise UserError(f"--min-tokens-per-s must be a positive number, got {min_tokens_per_s}")
    for h, v in (prices or {}).items():
        if h not in profiles:
            raise UserError(f"--price: machine {h!r} is not searched{did_you_mean(h, profiles)}")
        if not (math.isfinite(v) and v >= 0):
            raise UserError(f"--price {h}: must be a non-negative number, got {v}")
    if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 1:
        raise UserError(f"--sequences must be a positive integer, got {sequences!r}")
    return shape, profiles, classes


def advise(
    model: str,
    hw: str | list[str],
    trace: str | None = None,
    dtypes: list[str] | None = None,
    min_gate_mass: float | None = None,
    policies: list[str] | None = None,
    executor: str = "local",
    workers: int | None = None,
    scheduler: str | None = None,
    progress: bool = True,
    runtimes: list[str] | None = None,
    min_tokens_per_s: float | None = None,
    prices: dict[str, float] | None = None,
    sequences: int = SEQUENCES,
) -> Advice:
    """Search policies, options, budgets, precisions (and ``runtimes``) on each machine of
    ``hw``; the rows ranked by tokens/s (docs/advise.md).

    ``policies`` narrows the search (default: every registered policy); ``runtimes`` runs
    every policy under each of these runtimes instead of its own; ``min_tokens_per_s`` is a
    target: rows below it are left out and each machine is judged against it, the cheapest
    that reaches it (by ``prices``, name -> amount, else by energy per token) named.
    """
    from daopsim.simulator.sweep_table import check_fidelity_floor
    from daopsim.simulator.trace_read import read_meta

    hws = [hw] if isinstance(hw, str) else list(hw)
    shape, profiles, classes = _check_inputs(
        model, hws, dtypes, policies, runtimes, min_tokens_per_s, prices, sequences
    )
    check_fidelity_floor(min_gate_mass)
    path, trace_args = find_trace(shape.name, trace)
    own = read_meta(path).model.dtype
    search_dtypes = list(dict.fromkeys(dtypes or [own, *DEFAULT_DTYPES]))
    rts: list[str | None] = list(dict.fromkeys(runtimes)) if runtimes else [None]
    advice = Advice(
        shape.name,
        ",".join(hws),
        trace_args[1] if trace_args[0] == "--trace" else f"synthetic ({shape.name})",
        sequences,
        min_gate_mass,
        trace_synth=synth_command(shape.name) if trace_args[0] == "--model" else None,
        runtimes=list(runtimes) if runtimes else None,
        min_tokens_per_s=min_tokens_per_s,
    )
    search = _Search(path, sequences, shape, classes, executor, workers, scheduler, progress)
    points = [
        _Point(h, d, r, rt)
        for h in hws
        for d in search_dtypes
        for r in (None, *SMALL_RATIOS)
        for rt in rts
    ]
    _search_coarse(search, points, classes, shape)
    _search_refined(search, points, classes, shape)
    _search_other_options(search, points, classes, shape)
    rows = search.rows(hws, trace_args, profiles, own, sequences, runtimes)
    advice.runs = search.n_runs
    advice.skipped = search.skipped
    advice.failed = search.failed
    _rank(advice, rows, min_gate_mass, min_tokens_per_s, prices, shape)
    return advice


__all__ = [
    "COARSE_POINTS",
    "DEFAULT_DTYPES",
    "DEFAULT_TOP",
    "DEFAULT_WIDTH",
    "REFINE_ALL",
    "REFINE_PASSES",
    "SEQUENCES",
    "SMALL_RATIOS",
    "Advice",
    "AdviceRow",
    "MachineAnswer",
    "advise",
    "bottleneck",
    "coarse",
    "command_for",
    "exact_precision",
    "fidelity",
    "find_trace",
    "is_bound",
    "listed_values",
    "one_at_a_time",
    "range_of",
    "render",
    "synth_command",
    "tie_reason",
    "to_csv",
]
