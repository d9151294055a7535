"""A policy's options: how each is declared (:class:`Param`), checked and converted
(:func:`coerce_option`), and the integer ranges ``daopsim advise`` searches
(:data:`SEARCH_RANGES`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from daopsim.simulator.errors import UserError
from daopsim.simulator.models import ModelShape


@dataclass(frozen=True)
class Param:
    """A policy option: type, default and one line of help (shown by ``daopsim policies``)."""

    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    # bounds are checked once here, so a policy's __init__ does not repeat them
    minimum: float | None = None
    maximum: float | None = None
    #: an integer range ``daopsim advise`` searches (besides the default): ``"layers"``
    #: (0..the model's layers), ``"layers+1"`` (0..layers + 1), ``"moe_layers"`` or
    #: ``"experts"`` (0..experts per layer); :data:`SEARCH_RANGES`. None: only the default
    #: and the ``choices`` (both values of a bool) are tried.
    search: str | None = None
    #: a value outside the bounds that means "not set" (daop's ``t_load_ms = -1``: from the
    #: constants); any other value outside them is refused, never read as this one
    unset: Any = None


#: ``Param.search`` names and the integer range each one means for a model
SEARCH_RANGES: dict[str, str] = {
    "layers": "0..layers",
    "layers+1": "0..layers+1",
    "moe_layers": "0..moe_layers",
    "experts": "0..experts per layer",
}


def search_range(name: str, model: ModelShape) -> tuple[int, int]:
    """The inclusive integer range a ``Param.search`` name means for ``model``."""
    if name == "layers":
        return 0, model.layers
    if name == "layers+1":
        return 0, model.layers + 1
    if name == "moe_layers":
        return 0, model.moe_layers
    if name == "experts":
        return 0, model.experts
    raise UserError(f"unknown Param.search {name!r} (known: {', '.join(SEARCH_RANGES)})")


def coerce_option(policy: str, key: str, param: Param, value: Any) -> Any:
    """Convert a CLI string (or check a Python value) to the option's type."""
    typ = param.type
    try:
        if isinstance(value, str) and typ is bool:
            low = value.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(value)
            value = low in ("1", "true", "yes", "on")
        elif isinstance(value, str) and typ is not str:
            value = typ(value)
        elif typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise TypeError(value)
    except (TypeError, ValueError):
        raise UserError(
            f"policy {policy!r}: option {key!r} must be {typ.__name__}, got {value!r}"
        ) from None
    if typ is float and not math.isfinite(value):
        # NaN passes every range comparison and inf every lower bound: refuse both
        raise UserError(f"policy {policy!r}: option {key!r} must be a finite number, got {value!r}")
    if param.unset is not None and value == param.unset:
        return value
    if param.choices is not None and value not in param.choices:
        raise UserError(
            f"policy {policy!r}: option {key!r} must be one of {list(param.choices)}, got {value!r}"
        )
    if param.minimum is not None and value < param.minimum:
        unset = "" if param.unset is None else f" (or {param.unset!r}: not set)"
        raise UserError(
            f"policy {policy!r}: option {key!r} must be >= {param.minimum:g}{unset}, got {value!r}"
        )
    if param.maximum is not None and value > param.maximum:
        raise UserError(
            f"policy {policy!r}: option {key!r} must be <= {param.maximum:g}, got {value!r}"
        )
    return value
