"""A sweep's grid: its keys (the declared run parameters' grid keys, simulator/run_params.py,
plus ``options`` and ``out``), read from Python, a dict, a TOML grid file or the bundled grids,
each value checked against its declaration with a one-line error naming the key
(docs/sweeps.md, "Grid files").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from daopsim.simulator.data import (
    bundled_traces,
    check_input_file,
    read_toml,
)
from daopsim.simulator.errors import (
    UserError,
    did_you_mean,
    parse_key_values,
)
from daopsim.simulator.run_params import OTHER_GRID_KEYS, RunParam, grid_params


def grid_keys() -> set[str]:
    """The keys of a grid file or dict: the declared run parameters' grid keys
    (simulator/run_params.py), ``options`` and ``out``."""
    return {str(p.grid) for p in grid_params()} | set(OTHER_GRID_KEYS)


class Grid:
    """The axes of a sweep; every combination is one configuration.

    Its attributes are the declared run parameters' grid keys (simulator/run_params.py,
    ``grid_params()``): a list for an axis (``policies``, ``traces``, ``cache_ratios``, ...),
    one value for the others (``sequences``, ``dtype``, ...); an absent one takes the declared
    default.

    ``options`` maps an option name to its values: ``"swap_num"`` applies to every policy in
    the grid that declares that option, ``"daop.swap_num"`` to one policy only. Several values
    make an axis. ``cache_ratios`` and ``gpu_experts`` are both memory points (their union);
    with neither, each run uses as many experts as fit on the machine. Policies that ignore the
    budget (all-gpu) run once per machine and trace, whatever the memory points. ``variants``
    (from Python only; ``daopsim advise`` varies one option at a time this way): per policy,
    explicit option sets run instead of the product of ``options`` axes.
    """

    def __init__(
        self,
        policies: list[str],
        options: dict[str, list[Any]] | None = None,
        variants: dict[str, list[dict[str, Any]]] | None = None,
        **axes: Any,
    ) -> None:
        declared = {str(p.grid_attr): p for p in grid_params() if p.grid_attr != "policies"}
        unknown = sorted(set(axes) - set(declared))
        if unknown:
            raise TypeError(f"Grid() got an unexpected keyword argument {unknown[0]!r}")
        self.policies = list(policies)
        for attr, p in declared.items():
            setattr(self, attr, axes[attr] if attr in axes else p.grid_empty())
        self.options = dict(options or {})
        self.variants = dict(variants or {})

    def __repr__(self) -> str:
        return f"Grid({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Grid) and vars(self) == vars(other)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "grid") -> Grid:
        """A grid from a plain mapping (a parsed TOML file or a notebook dict); each key is
        checked against its declaration (one-line errors naming the key)."""
        _check_keys(data, source)
        given: dict[str, Any] = {}
        for p in grid_params():
            value = _grid_list(data, p, source) if p.axis else _grid_scalar(data, p, source)
            if value is not None:
                given[str(p.grid_attr)] = value
        return cls(options=_grid_options(data, source), **given)


def _check_keys(data: Mapping[str, Any], source: str) -> None:
    """An unknown key (with a hint at the plural of a list key), or no ``policies``."""
    keys = grid_keys()
    unknown = sorted(set(data) - keys)
    if unknown:
        key = unknown[0]
        hint = did_you_mean(key, keys)
        plural = f"{key[:-1]}ies" if key.endswith("y") else f"{key}s"
        if plural in keys:  # cache_ratio, policy, trace, seed, runtime
            hint = (
                f"; did you mean {plural!r}? (a grid key names a list, also for one "
                f"value: {plural} = [...])"
            )
        raise UserError(f"{source}: unknown key {key!r}{hint} (valid: {', '.join(sorted(keys))})")
    if "policies" not in data:
        raise UserError(f"{source}: missing key 'policies'")


def _grid_list(data: Mapping[str, Any], p: RunParam, source: str) -> list[Any] | None:
    """An axis key's values (one value stands for a list of one); None when absent."""
    key, kind = str(p.grid), p.kind or str
    if key not in data:
        return None
    raw = data[key]
    if isinstance(raw, str | int | float) and not isinstance(raw, bool):
        raw = [raw]
    if not isinstance(raw, list | tuple):
        raise UserError(f"{source}: key {key!r} must be a list")
    if not raw:
        # an empty list given is a mistake, never the default the key has when absent
        hint = "" if key == "policies" else ", or leave the key out for its default"
        raise UserError(f"{source}: key {key!r} is an empty list; give at least one value{hint}")
    out = []
    for v in raw:
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise UserError(f"{source}: key {key!r}: {v!r} is not a {kind.__name__}")
        out.append(v)
    return out


#: what a one-value key of each type must be, for its error line
_KIND_WORDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


def _grid_scalar(data: Mapping[str, Any], p: RunParam, source: str) -> Any:
    """A one-value key's value, type-checked and checked as declared; None when absent."""
    value = data.get(str(p.grid))
    if value is None:
        return None
    label = f"{source}: key {p.grid!r}"
    if p.kind is str and not isinstance(value, str):
        raise UserError(f"{label} must be a string")
    if p.check is not None:
        p.check(value, label)
    elif p.kind is not None and p.kind is not str and not _is_kind(value, p.kind):
        raise UserError(f"{label} must be {_KIND_WORDS[p.kind]}, got {value!r}")
    if p.choices is not None and value not in p.choices:
        names = " or ".join(repr(c) for c in p.choices)
        raise UserError(f"{label} must be {names}, got {value!r}")
    return value


def _is_kind(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int | float) if kind is float else isinstance(value, kind)


def _grid_options(data: Mapping[str, Any], source: str) -> dict[str, list[Any]]:
    """The ``options`` table: ``name = values`` or ``[options.<policy>]`` tables."""
    opts_raw = data.get("options", {}) or {}
    if not isinstance(opts_raw, Mapping):
        raise UserError(f"{source}: key 'options' must be a table")
    options: dict[str, list[Any]] = {}
    for name, value in opts_raw.items():
        if isinstance(value, Mapping):  # [options.<policy>] table
            for k, v in value.items():
                options[f"{name}.{k}"] = list(v) if isinstance(v, list | tuple) else [v]
        else:
            options[str(name)] = list(value) if isinstance(value, list | tuple) else [value]
    for k, v in options.items():
        if not v:
            raise UserError(f"{source}: option {k!r} has no values")
    return options


def _relative_to(base: Path, value: str) -> str:
    """Paths in a grid file are relative to the file; bundled trace names stay names."""
    if value in bundled_traces() or Path(value).expanduser().is_absolute():
        return value
    if value.endswith(".parquet") or os.sep in value:
        return str(base / value)
    return value


def bundled_grids() -> dict[str, Path]:
    """Grid files bundled with daopsim, by name (``example-grid``): ``sweep NAME`` runs one."""
    from daopsim.simulator.data import bundled_dir

    return {p.stem: p for p in sorted(bundled_dir("experiments").glob("*grid*.toml"))}


def load_grid_file(path: str | os.PathLike[str]) -> tuple[Grid, str | None]:
    """A grid TOML file and its optional ``out`` (both relative to the file's folder), or a
    bundled grid by name (``example-grid``), whose relative paths are relative to the current
    folder (the bundled copy's folder is inside the installed package)."""
    text = str(path)
    bundled = bundled_grids()
    if not Path(text).exists() and text.removesuffix(".toml") in bundled:
        grid, out = _read_grid(bundled[text.removesuffix(".toml")], Path.cwd())
        return grid, out
    p = check_input_file(path, "grid")
    return _read_grid(p, p.parent)


def _read_grid(p: Path, base: Path) -> tuple[Grid, str | None]:
    data = read_toml(p, "grid")
    grid = Grid.from_dict(data, source=str(p))
    grid.traces = [_relative_to(base, t) for t in grid.traces]
    if grid.calibration is not None and grid.calibration not in ("none", "self"):
        grid.calibration = _relative_to(base, grid.calibration)
    out = data.get("out")
    if out is not None:
        if not isinstance(out, str):
            raise UserError(f"{p}: key 'out' must be a string")
        out = str(base / out) if not Path(out).is_absolute() else out
    return grid, out


def parse_option_items(items: list[str] | tuple[str, ...]) -> dict[str, list[str]]:
    """``--policy-opt [policy.]key=v1[,v2...]`` items as an options mapping."""
    form = "[POLICY.]KEY=VALUE[,VALUE...]"
    pairs = parse_key_values(items, "--policy-opt", form=form, allow_empty=False)
    return {name: [v.strip() for v in values.split(",")] for name, values in pairs.items()}
