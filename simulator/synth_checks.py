"""Checks at the boundary of the synthetic-trace generator (simulator/synth.py).

:func:`check_synth_params` refuses parameter values the generator cannot turn into a valid
trace: non-finite numbers, magnitudes that overflow the router logits, seeds NumPy rejects.
:func:`write_validated` is the safety net behind it: the trace is generated into a temporary
file beside the output, read back through ``validate_trace`` (the check ``daopsim trace
validate`` runs), and only then renamed into place (``daopsim.simulator.trace.write_valid_trace``,
shared with ``trace import`` and ``capture``), so ``synth`` never leaves a trace that
validation would reject. The ranges are documented in docs/synthetic-traces.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from daopsim.simulator.errors import UserError

if TYPE_CHECKING:
    from daopsim.simulator.synth_params import SynthParams

T = TypeVar("T")

#: Inclusive (low, high) bounds of every numeric generator parameter. The logit scales
#: (temperature, biases) are bounded so that logits stay far from float overflow; the rest are
#: shares and retentions (0..1), multipliers, or sizes. Lower bounds of ``temperature`` and
#: ``drift_tau`` are exclusive (they divide).
PARAM_BOUNDS: dict[str, tuple[float, float]] = {
    "latent_dim": (1, 4096),
    "temperature": (0.0, 1000.0),
    "bias_std": (0.0, 100.0),
    "bias_first": (0.0, 100.0),
    "drift": (0.0, 1.0),
    "drift_first": (0.0, 1.0),
    "drift_tau": (0.0, 1000.0),
    "drift_last": (0.0, 1.0),
    "token_corr": (0.0, 1.0),
    "temporal_share": (0.0, 1.0),
    "temporal_first": (0.0, 100.0),
    "temporal_last": (0.0, 100.0),
    "topic_share": (0.0, 1.0),
    "phase_keep": (0.0, 1.0),
    "prefill_bias": (0.0, 100.0),
    "model_seed": (0, 2**63 - 1),
    "top_m": (1, 65536),
}
#: Parameters whose lower bound is excluded (zero would divide).
EXCLUSIVE_LOW = frozenset({"temperature", "drift_tau"})


def check_synth_params(params: SynthParams, where: str | None = None) -> None:
    """Raise a one-line UserError naming the first parameter that is not finite or out of range."""
    pre = f"{where}: " if where else ""
    for name, (low, high) in PARAM_BOUNDS.items():
        value = getattr(params, name, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UserError(f"{pre}synth parameter {name}={value!r} is not a number")
        if not math.isfinite(value):
            raise UserError(f"{pre}synth parameter {name}={value} must be finite")
        low_ok = value > low if name in EXCLUSIVE_LOW else value >= low
        if not low_ok or value > high:
            lo = f"({_num(low)}" if name in EXCLUSIVE_LOW else f"[{_num(low)}"
            raise UserError(
                f"{pre}synth parameter {name}={_num(value)} is outside {lo}, {_num(high)}]"
            )


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def write_validated(path: str | os.PathLike[str], write: Callable[[Path], T]) -> T:
    """Run ``write(tmp)`` into a temporary sibling of ``path``, validate it, then rename it.

    The synthetic generator's use of :func:`daopsim.simulator.trace.write_valid_trace` (shared with
    ``trace import`` and ``capture``): a trace that fails validation is deleted and reported
    as a UserError; ``path`` is left as it was. Returns what ``write`` returned.
    """
    from daopsim.simulator.trace import write_valid_trace

    return write_valid_trace(
        path, write, flag=None, what="generated", hint=" (check the --param values)"
    )
