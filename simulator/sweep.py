"""Parameter sweeps: a grid of ``simulate()`` runs, in parallel, resumable, as one tidy table.

A :class:`Grid` (from Python, a dict, a TOML file or the ``daopsim sweep`` flags) expands into
configurations in a fixed order (trace, machine, policy, option values, memory point, seed).
Each configuration gets a key: a SHA-256 over the trace file's bytes, the machine profile's
resolved content, the policy, the source files of its code and its resolved options, the memory
point, sequences, seed, calibration, the daopsim version and the source of the simulator
package (so an edited cost model or engine re-runs rows). Finished rows are stored one JSON
file per key in ``RESULTS.parquet.parts/`` (written atomically as each run completes), so a
sweep killed at any moment and run again skips what is done (and re-runs a policy whose code
changed); the consolidated table is written atomically at the end.

Executors: ``local`` (a process pool; ``workers=1`` runs in this process) and ``dask``
(``dask.distributed``: a ``LocalCluster`` or a scheduler address). ``simulate(record=False)`` is
deterministic, so the table does not depend on the executor. See docs/sweeps.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from daopsim.simulator.boundary import construct_policy
from daopsim.simulator.data import (
    bundled_traces,
    check_input_file,
    read_toml,
    resolve_trace,
)
from daopsim.simulator.errors import (
    DoesNotFit,
    PolicyError,
    UserError,
    debug_enabled,
    debug_traceback,
    did_you_mean,
    parse_key_values,
)
from daopsim.simulator.fingerprints import daopsim_version, file_sha256, profile_sha256
from daopsim.simulator.metrics import metric_keys, optional_metric_keys
from daopsim.simulator.native import module_source
from daopsim.simulator.output import (
    TABLE_FORMATS,
    check_output_file,
    output_format,
    value_paths,
    write_text,
)
from daopsim.simulator.output import write_table as _write_any_table
from daopsim.simulator.progress import Progress
from daopsim.simulator.run_params import OTHER_GRID_KEYS, RunParam, grid_params, run_params
from daopsim.simulator.runtime_profiles import get_runtime
from daopsim.simulator.watchdog import watch_parent

if TYPE_CHECKING:
    pass

#: Columns every sweep table has before the option and metric columns, in this order.
BASE_COLUMNS = (
    "policy",
    "hw",
    "trace",
    "cache_ratio",
    "gpu_experts",
    "sequences",
    "seed",
    "runtime",
    "bound",
    "status",
    "error",
    "key",
)
#: Columns after the metrics: model facts for plots, and the per-layer decode hit rates.
EXTRA_COLUMNS = (
    "model",
    "dtype",
    "total_experts",
    "max_gpu_experts",
    "expert_bytes",
    "expert_memory_gb",
    "per_layer_hit_rate",
    "sequence_ids",
    "calibration",
)
#: The all-GPU bound of each row (docs/metrics.md, "Bounds"): its tokens/s and the runtime it
#: ran on; empty for rows that did not finish, serving rows and multi-GPU rows (whose
#: throughput a one-sequence, one-GPU bound does not cap).
BOUND_COLUMNS = ("bound_tokens_per_s", "bound_runtime")
#: Columns of serving sweeps (an ``arrival_rate`` axis; docs/serving.md), after the metrics.
SERVING_COLUMNS = (
    "arrival_rate",
    "max_batch",
    "throughput_tokens_per_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "req_tpot_p50_s",
    "req_tpot_p90_s",
    "req_tpot_p99_s",
    "latency_p50_s",
    "latency_p90_s",
    "latency_p99_s",
    "slo_attainment",
    "goodput_requests_per_s",
)
EXECUTORS = ("local", "dask")


def grid_keys() -> set[str]:
    """The keys of a grid file or dict: the declared run parameters' grid keys
    (simulator/run_params.py), ``options`` and ``out``."""
    return {str(p.grid) for p in grid_params()} | set(OTHER_GRID_KEYS)


# --- grid -------------------------------------------------------------------------------------


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


# --- configurations ---------------------------------------------------------------------------


def _distribution_version(module: str) -> str | None:
    """``name==version`` of the installed distribution that provides ``module``, if any."""
    top = module.partition(".")[0]
    for dist in importlib.metadata.packages_distributions().get(top, []):
        try:
            return f"{dist}=={importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def policy_code_sha256(cls: type) -> str:
    """SHA-256 naming the code of a policy class: the source files of every module in its class
    hierarchy up to ``Policy`` (so an edit to a shared base such as ``policies/caching.py``
    counts too). A module without a readable source file (a compiled or zipped plugin) is named
    by its distribution's version instead."""
    from daopsim.policies.base import Policy

    parts: dict[str, str] = {}
    for klass in cls.__mro__:
        if not (isinstance(klass, type) and issubclass(klass, Policy)):
            continue
        mod = klass.__module__
        if mod in parts:
            continue
        module = sys.modules.get(mod)
        src = None if module is None else module_source(module)
        if src is not None and src.is_file():
            parts[mod] = "sha256:" + file_sha256(src)
        else:
            parts[mod] = _distribution_version(mod) or f"unknown:{daopsim_version()}"
    text = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def simulator_code_sha256() -> str:
    """SHA-256 naming the simulator's code: the source of every module of the ``simulator``
    package and its subpackages (the engine core, the reference, the cost model, the runner,
    the metrics). Part of every key, so a
    sweep resumed after an edit to any of them re-runs its rows instead of reusing rows the
    old code computed (policies are keyed by their own code, :func:`policy_code_sha256`)."""
    here = Path(__file__).resolve().parent
    parts = {p.relative_to(here).as_posix(): file_sha256(p) for p in sorted(here.rglob("*.py"))}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Config:
    """One configuration of a sweep (picklable: it travels to worker processes).

    ``values`` holds the configuration's value of every declared grid parameter
    (simulator/run_params.py), read as attributes: ``cfg.policy``, ``cfg.hw`` and ``cfg.trace``
    (as the grid names them), ``cfg.cache_ratio``, ``cfg.seed``, ``cfg.runtime`` (None: the
    policy's declared one), ``cfg.gpus``, ``cfg.multi_gpu`` (None: expert parallel), ...
    """

    index: int
    key: str
    options: tuple[tuple[str, Any], ...]
    hw_sha: str
    trace_path: str
    trace_bundled: bool
    trace_sha: str
    values: tuple[tuple[str, Any], ...] = ()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "values":  # (unpickling looks these up first)
            raise AttributeError(name)
        for k, v in self.values:
            if k == name:
                return v
        raise AttributeError(f"Config has no attribute {name!r}")

    def run_args(self) -> dict[str, Any]:
        """The configuration's ``simulate()`` keywords among the declared grid parameters."""
        return {p.name: getattr(self, p.name) for p in grid_params() if p.part == "run"}

    def serving(self) -> Any:
        """The run's ``ServingConfig`` (continuous batching at ``arrival_rate``), or None."""
        from daopsim.simulator.serving import serving_config

        given = dict(self.values)
        return serving_config(
            **{p.name: given.get(p.name, p.default) for p in run_params("serving")}
        )


def _option_axes(grid: Grid, policy_classes: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per policy, the list of option dicts to run (product of its option axes)."""
    used: set[str] = set()
    out: dict[str, list[dict[str, Any]]] = {}
    for pol, cls in policy_classes.items():
        axes: list[tuple[str, list[Any]]] = []
        for name, values in grid.options.items():
            scope, dot, opt = name.rpartition(".")
            if dot and scope == pol:
                axes.append((opt, values))
                used.add(name)
            elif not dot and name in cls.params:
                axes.append((name, values))
                used.add(name)
        combos = []
        if pol in grid.variants:
            seen: set[str] = set()
            for given in grid.variants[pol]:
                opts = cls.resolve_options(dict(given))
                ident = json.dumps(opts, sort_keys=True, default=str)
                if ident not in seen:  # two variants resolving to the same options run once
                    seen.add(ident)
                    combos.append(opts)
            out[pol] = combos
            continue
        for vals in itertools.product(*(v for _, v in axes)):
            given = {k: v for (k, _), v in zip(axes, vals, strict=True)}
            combos.append(cls.resolve_options(given))  # type-checks; UserError on bad values
        out[pol] = combos
    for name in grid.options:
        if name not in used:
            scope, dot, opt = name.rpartition(".")
            if dot and scope not in policy_classes:
                raise UserError(f"option {name!r}: policy {scope!r} is not in the sweep")
            if dot:
                policy_classes[scope].resolve_options({opt: grid.options[name][0]})
            raise UserError(
                f"option {name!r}: no policy in the sweep has it ({', '.join(policy_classes)})"
            )
    return out


def _check_grid(grid: Grid) -> None:
    """Every value of the grid checked as its parameter declares, before any run."""
    for p in grid_params():
        if p.required and not getattr(grid, str(p.grid_attr)):
            raise UserError(f"the sweep has no {p.grid} ({p.sweep_flag})")
    from daopsim.simulator.multigpu import check_mode_has_gpus

    check_mode_has_gpus(bool(grid.multi_gpu), max(grid.gpus, default=1))
    for p in grid_params():
        value = getattr(grid, str(p.grid_attr))
        for v in value if p.axis else [value]:
            p.checked(v, str(p.sweep_flag))
    # the serving parameters of one value mean something only beside arrival rates
    extra = [p.grid for p in grid_params() if p.part == "serving" and not p.axis]
    given = [k for k in extra if getattr(grid, str(k)) is not None]
    if given and not grid.arrival_rates:
        raise UserError(f"{given[0]} needs an arrival_rate axis")
    for name in grid.runtimes:
        get_runtime(name)  # an unknown name fails before any run


def _point_axes(grid: Grid) -> list[list[dict[str, Any]]]:
    """The inner axes of the product, each a list of value dicts: memory points, then the
    other declared axes (serving ones first), then GPU counts with their placements."""
    memory = [{"cache_ratio": r, "gpu_experts": None} for r in grid.cache_ratios]
    memory += [{"cache_ratio": None, "gpu_experts": n} for n in grid.gpu_experts]
    axes = [memory or [{"cache_ratio": None, "gpu_experts": None}]]
    # the axes a configuration takes apart from the plain product are declared with a group
    # (RunParam.group: where it runs, the memory points, the GPU counts)
    plain = [p for p in grid_params() if p.axis and p.group is None]
    for p in sorted(plain, key=lambda p: p.part != "serving"):  # arrival rates vary slowest
        values = list(dict.fromkeys(getattr(grid, str(p.grid_attr)))) or [p.default]
        axes.append([{p.name: v} for v in values])
    modes: list[str | None] = list(dict.fromkeys(grid.multi_gpu)) or [None]
    axes.append(
        [
            {"gpus": g, "multi_gpu": m}
            for g in dict.fromkeys(grid.gpus or [1])
            for m in (modes if g > 1 else [None])
        ]
    )
    return axes


def _scalars(grid: Grid, serving: bool) -> dict[str, Any]:
    """The grid's one-value parameters; the serving ones only in a configuration that serves
    (one with an arrival rate)."""
    return {
        p.name: getattr(grid, str(p.grid_attr)) if serving or p.part != "serving" else None
        for p in grid_params()
        if not p.axis
    }


def config_key(values: Mapping[str, Any], content: Mapping[str, Any]) -> str:
    """A configuration's key: SHA-256 over what it names by content (trace bytes, profile
    content, code, options, calibration, runtime) and each declared parameter by its rule
    (``RunParam.key``: always, or only when not the default so earlier keys stay valid)."""
    ident = dict(content)
    for p in grid_params():
        v = values[p.name]
        if p.key == "always" or (p.key == "given" and v != p.default):
            ident[p.name] = v
    if values["gpus"] > 1:  # only then: earlier keys stay valid
        ident["multi_gpu"] = values["multi_gpu"] or "expert"
    text = json.dumps(ident, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class _Sources:
    """What the configurations of a grid are keyed by: content hashes of its traces, machines,
    policies' code and calibration, and the daopsim version and simulator code."""

    traces: dict[str, tuple[Path, str]]
    hw_sha: dict[str, str]
    code_sha: dict[str, str]
    cal_sha: str | None
    version: str = field(default_factory=daopsim_version)
    code: str = field(default_factory=lambda: simulator_code_sha256())

    @classmethod
    def of(cls, grid: Grid, classes: dict[str, Any]) -> _Sources:
        traces = {}
        for t in dict.fromkeys(grid.traces):
            path = resolve_trace(t)
            traces[t] = (path, file_sha256(path))
        cal_sha = None
        if grid.calibration in ("none", "self"):
            cal_sha = grid.calibration  # a mode, not a file (docs/metrics.md)
        elif grid.calibration is not None:
            cal_sha = file_sha256(resolve_trace(grid.calibration))
        return cls(
            traces=traces,
            hw_sha={h: profile_sha256(h) for h in dict.fromkeys(grid.hw)},
            code_sha={p: policy_code_sha256(c) for p, c in classes.items()},
            cal_sha=cal_sha,
        )


def expand(grid: Grid) -> list[Config]:
    """Every configuration of the grid, in grid order (trace, machine, policy, option values,
    then the inner axes of :func:`_point_axes`); bad names and values are UserErrors."""
    from daopsim.policies.registry import get_policy_class

    _check_grid(grid)
    classes = {p: get_policy_class(p) for p in dict.fromkeys(grid.policies)}
    option_sets = _option_axes(grid, classes)
    src = _Sources.of(grid, classes)
    bundled = bundled_traces()
    inner = _point_axes(grid)
    configs: list[Config] = []
    seen: dict[str, Config] = {}
    for (t, (path, tsha)), (hw, hsha), (pol, cls) in itertools.product(
        src.traces.items(), src.hw_sha.items(), classes.items()
    ):
        for opts in option_sets[pol]:
            # a policy that places every expert ignores the memory axis
            unlimited = construct_policy(cls, opts).resources().unlimited_memory
            axes = (
                [[{"cache_ratio": None, "gpu_experts": None}], *inner[1:]] if unlimited else inner
            )
            for parts in itertools.product(*axes):
                values: dict[str, Any] = {"trace": t, "hw": hw, "policy": pol}
                for part in parts:
                    values.update(part)
                values.update(_scalars(grid, values.get("arrival_rate") is not None))
                rt = get_runtime(values["runtime"] or cls.runtime_profile)
                content = {
                    "trace_sha256": tsha,
                    "profile_sha256": hsha,
                    "policy_code_sha256": src.code_sha[pol],
                    "options": opts,
                    "calibration_sha256": src.cal_sha,
                    "daopsim": src.version,
                    "simulator_code_sha256": src.code,
                    # the profile's values, not its name: editing it re-runs the points
                    "runtime": rt.to_dict(),
                }
                cfg = Config(
                    index=len(configs),
                    key=config_key(values, content),
                    options=tuple(sorted(opts.items())),
                    hw_sha=hsha,
                    trace_path=str(path.resolve()),
                    trace_bundled=t in bundled,
                    trace_sha=tsha,
                    values=tuple((p.name, values[p.name]) for p in grid_params()),
                )
                if cfg.key in seen:
                    raise _duplicate(seen[cfg.key], cfg)
                seen[cfg.key] = cfg
                configs.append(cfg)
    return configs


def _duplicate(first: Config, again: Config) -> UserError:
    """The one-line error for two requested configurations with one key (the same run)."""
    # the axes (with the flag that sets each) and the options name a configuration
    labels = [(p.name, str(p.sweep_flag)) for p in grid_params() if p.axis]
    differ = [
        f"{flag} {getattr(first, name)!r} and {getattr(again, name)!r}"
        for name, flag in [*labels, ("options", "--policy-opt")]
        if getattr(first, name) != getattr(again, name)
    ]
    what = "; ".join(differ) if differ else f"{again.policy} on {again.hw}, {again.trace}, twice"
    return UserError(
        f"the sweep asks for the same configuration twice ({what}): the same trace bytes, "
        "profile content, policy, options and point; give it once"
    )


# --- one run ----------------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, UserError | PolicyError):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _base_row(cfg: Config) -> dict[str, Any]:
    row: dict[str, Any] = {
        "policy": cfg.policy,
        "hw": cfg.hw,
        "trace": cfg.trace,
        "cache_ratio": cfg.cache_ratio,
        "gpu_experts": cfg.gpu_experts,
        "sequences": cfg.sequences,
        "seed": cfg.seed,
        "runtime": cfg.runtime,
        "bound": None,
        "status": "error",
        "error": None,
        "key": cfg.key,
    }
    for k, v in cfg.options:
        row[f"opt.{k}"] = v
    for p in grid_params():  # another declared axis: its column, where not at its default
        if p.axis and p.name not in row and getattr(cfg, p.name) != p.default:
            row[p.name] = getattr(cfg, p.name)
    if cfg.gpus > 1:  # multi-GPU columns (absent from single-GPU sweeps)
        row["gpus"] = cfg.gpus
        row["multi_gpu"] = cfg.multi_gpu or "expert"
        # a budget asked for is per GPU; `gpu_experts` is the total, known once the run sized it
        row["gpu_experts_per_gpu"] = cfg.gpu_experts
        row["gpu_experts"] = None
    if cfg.arrival_rate is not None:
        row["arrival_rate"] = cfg.arrival_rate
        row["max_batch"] = cfg.serving().batch
    return row


def _labels(cfg: Config) -> dict[str, Any]:
    """The columns of a row that name what was asked for rather than what ran."""
    return {"hw": cfg.hw, "trace": cfg.trace, "runtime": cfg.runtime}


def run_config(cfg: Config) -> dict[str, Any]:
    """Run one configuration and return its row.

    A failure becomes a row with status "error"; a memory point the machine cannot hold a row
    with status "skipped" and error "does not fit (at most N)".
    """
    from daopsim.simulator.runner import simulate

    row = _base_row(cfg)
    try:
        path = _worker_trace(cfg)
        result = simulate(
            **{**cfg.run_args(), "trace": path},
            policy_options=dict(cfg.options),
            record=False,
            serving=cfg.serving(),
        )
    except DoesNotFit as exc:  # the machine is too small for this point: not a failure
        row["status"] = "skipped"
        row["error"] = f"does not fit (at most {exc.max_experts})"
        row["max_gpu_experts"] = exc.max_experts
        return row
    except Exception as exc:  # recorded, not raised: one bad configuration must not sink others
        row["error"] = _one_line(exc)
        if debug_enabled():  # --debug / DAOPSIM_DEBUG=1: the traceback behind the row's error
            sys.stderr.write(
                f"debug: {cfg.policy} on {cfg.hw}, {cfg.trace}: {row['error']}\n"
                + debug_traceback(exc)
            )
        return row
    row.update(_finished_row(cfg, path, result))
    return row


def _worker_trace(cfg: Config) -> Path:
    """The configuration's trace on this worker: a worker on another machine resolves bundled
    traces by name; the trace's bytes and the profile's content must be those planned."""
    path = resolve_trace(cfg.trace) if cfg.trace_bundled else Path(cfg.trace_path)
    if not path.exists():
        raise UserError(f"{path}: no such trace file on this worker")
    if file_sha256(path) != cfg.trace_sha:
        raise UserError(f"{path}: trace differs from the one the sweep was planned with")
    if profile_sha256(cfg.hw) != cfg.hw_sha:
        raise UserError(f"profile {cfg.hw}: differs from the one the sweep was planned with")
    return path


def _finished_row(cfg: Config, path: Path, result: Any) -> dict[str, Any]:
    """A finished run's columns: what it ran with, its metrics (the registry's,
    simulator/metrics.py), model facts and, in a serving run, the serving summary."""
    from daopsim.simulator.trace import read_meta

    c = result.config
    model = read_meta(path).model.with_precision(cfg.dtype, cfg.host_dtype, cfg.nonexpert_dtype)
    expert_bytes = int(model.expert_bytes())
    row: dict[str, Any] = {
        "cache_ratio": cfg.cache_ratio if cfg.cache_ratio is not None else c["cache_ratio"],
        "gpu_experts": int(c["gpu_experts"]),
        "sequences": int(c["sequences"]),
    }
    if c.get("gpu_experts_per_gpu") is not None:
        row["gpu_experts_per_gpu"] = int(c["gpu_experts_per_gpu"])
    row.update(
        sequence_ids=",".join(map(str, c["sequence_ids"])),
        calibration=c["calibration"],
        runtime=c["runtime"]["name"],
        bound=bool(c["bound"]),
        status="ok",
    )
    metrics = result.to_dict()["metrics"]
    row.update({k: metrics[k] for k in metric_keys() if k in metrics})
    row.update(
        model=c["model"],
        dtype=c["dtype"],
        total_experts=int(c["total_experts"]),
        max_gpu_experts=int(c["max_gpu_experts"]),
        expert_bytes=expert_bytes,
        # the memory the experts take: what the policy's options fix, else its budget
        expert_memory_gb=int(
            c["gpu_experts"] if c.get("fixed_residency") is None else c["fixed_residency"]
        )
        * expert_bytes
        / 1e9,
        per_layer_hit_rate=[float(x) for x in result.per_layer_hit_rate],
    )
    if result.serving is not None:
        row.update(serving_row(result.serving))
    return row


def add_bounds(rows: list[dict[str, Any]], configs: list[Config]) -> None:
    """Fill each finished one-sequence-at-a-time, one-GPU row's all-GPU bound (in place).

    The bound runs on the row's machine, trace, evaluated sequences and precisions, under the
    fastest of its runtime and the bundled ones (:func:`daopsim.simulator.bounds.all_gpu_bound`,
    which caches: rows sharing all of these cost one set of runs)."""
    from daopsim.simulator.bounds import all_gpu_bound
    from daopsim.simulator.run_params import bound_params

    for row, cfg in zip(rows, configs, strict=True):
        row["bound_tokens_per_s"], row["bound_runtime"] = None, None
        if row.get("status") != "ok" or cfg.arrival_rate is not None or cfg.gpus > 1:
            continue
        ids = [int(x) for x in str(row["sequence_ids"]).split(",") if x]
        path = resolve_trace(cfg.trace) if cfg.trace_bundled else Path(cfg.trace_path)
        values = dict(cfg.values)
        shared = {
            p.name: values.get(p.name, p.default)
            for p in bound_params()
            if p.name not in ("hw", "trace")
        }
        b = all_gpu_bound(cfg.hw, path, ids, str(row["runtime"]), **shared)
        row["bound_tokens_per_s"], row["bound_runtime"] = b.tokens_per_s, b.runtime


def serving_row(sv: dict[str, Any]) -> dict[str, Any]:
    """A serving run's summary as flat sweep columns (``SERVING_COLUMNS``)."""
    out = {
        "throughput_tokens_per_s": sv["throughput_tokens_per_s"],
        "slo_attainment": sv["slo_attainment"],
        "goodput_requests_per_s": sv["goodput_requests_per_s"],
    }
    for name, key in (("ttft", "ttft_s"), ("req_tpot", "tpot_s"), ("latency", "latency_s")):
        for p, v in sv[key].items():
            out[f"{name}_{p}_s"] = v
    return out


# --- storage ----------------------------------------------------------------------------------


def parts_dir(out: str | os.PathLike[str]) -> Path:
    """The sidecar folder holding one finished row per configuration key."""
    p = Path(out)
    return p.with_name(p.name + ".parts")


def _load_parts(folder: Path, keys: set[str]) -> dict[str, dict[str, Any]]:
    done: dict[str, dict[str, Any]] = {}
    if not folder.is_dir():
        return done
    for f in folder.glob("*.json"):
        if f.stem not in keys:
            continue
        try:
            row = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # cannot happen with atomic writes; a damaged part is simply re-run
        if isinstance(row, dict) and row.get("key") == f.stem:
            done[f.stem] = row
    return done


def _save_part(folder: Path, row: dict[str, Any]) -> None:
    write_text(folder / f"{row['key']}.json", json.dumps(row, sort_keys=True))


@contextlib.contextmanager
def _lock(folder: Path, out: Path) -> Iterator[None]:
    """Exclusive lock on the results file for the whole sweep (released if the process dies)."""
    folder.mkdir(parents=True, exist_ok=True)
    fh = open(folder / ".lock", "a+")  # noqa: SIM115 (held open for the whole sweep)
    try:
        try:
            import fcntl

            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # not POSIX: no cross-process lock
            pass
        except BlockingIOError:
            raise UserError(
                f"{out}: another sweep is writing this results file "
                f"(lock {folder / '.lock'} is held); wait for it or choose another --out"
            ) from None
        yield
    finally:
        fh.close()


def to_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Rows (in grid order) as the tidy sweep table with a stable column order."""
    opt_cols = sorted({k for r in rows for k in r if k.startswith("opt.")})
    # dict.fromkeys: "sequences" is both a configuration column and a metric
    serving = [c for c in SERVING_COLUMNS if any(c in r for r in rows)]
    # a gpus axis: the columns appear, one-GPU rows read gpus = 1
    multi = ["gpus", "multi_gpu", "gpu_experts_per_gpu"] if any("gpus" in r for r in rows) else []
    optional = optional_metric_keys()
    metrics = [k for k in metric_keys() if k not in optional or any(k in r for r in rows)]
    # the other declared axes (simulator/run_params.py) last, where some row has them
    axes = [p.name for p in grid_params() if p.axis and any(p.name in r for r in rows)]
    first = [*BASE_COLUMNS, *opt_cols, *multi, *metrics, *BOUND_COLUMNS, *serving]
    cols = list(dict.fromkeys([*first, *EXTRA_COLUMNS, *axes]))
    df = pd.DataFrame([{c: r.get(c) for c in cols} for r in rows], columns=cols)
    if multi:
        df["gpus"] = df["gpus"].fillna(1).astype("int64")
        # one GPU's budget: a one-GPU row's is its budget
        one = df["gpus"] == 1
        per = pd.to_numeric(df["gpu_experts_per_gpu"], errors="coerce")
        per[one] = pd.to_numeric(df.loc[one, "gpu_experts"], errors="coerce")
        df["gpu_experts_per_gpu"] = per.astype("Int64")
    for c in serving:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    ints = ("gpu_experts", "sequences", "seed", "total_experts", "max_gpu_experts")
    for c in metrics:
        if c in ints:
            continue
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    for c in ("cache_ratio", "expert_memory_gb", "bound_tokens_per_s"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    for c in ints:
        df[c] = pd.array(df[c].tolist(), dtype="Int64")
    df["expert_bytes"] = pd.array(df["expert_bytes"].tolist(), dtype="Int64")
    df["bound"] = pd.array(df["bound"].tolist(), dtype="boolean")
    for c in opt_cols:
        kinds = {type(v) for v in df[c] if v is not None and not _isnan(v)}
        if len(kinds) > 1:  # one option name, different types in different policies
            df[c] = [None if v is None else str(v) for v in df[c]]
    return df


def seed_summary(
    df: pd.DataFrame, metrics: tuple[str, ...] = ("tokens_per_s", "hit_rate")
) -> pd.DataFrame:
    """Mean, sample standard deviation and count over seeds of each configuration.

    Rows that differ only in ``seed`` (and ``key``) form one group; failed rows are left out.
    Columns: the configuration columns, ``seeds`` (how many), and ``METRIC_mean`` /
    ``METRIC_std`` for each metric present.
    """
    ok = df[df["status"] == "ok"] if "status" in df else df
    present = [m for m in metrics if m in ok]
    keys = [
        c
        for c in ("trace", "hw", "policy", "cache_ratio", "gpu_experts", "sequences", "gpus")
        if c in ok
    ] + sorted(c for c in ok.columns if c.startswith("opt."))
    grouped = ok.groupby(keys, dropna=False, sort=False)
    out = grouped["seed"].nunique().rename("seeds").to_frame()
    for m in present:
        out[f"{m}_mean"] = grouped[m].mean()
        out[f"{m}_std"] = grouped[m].std()
    return out.reset_index()


def _isnan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def check_fidelity_floor(min_gate_mass: float | None) -> None:
    """A routing-fidelity floor is a fraction of the gate mass: in [0, 1]."""
    if min_gate_mass is not None and not 0 <= min_gate_mass <= 1:
        raise UserError(f"--min-gate-mass must be in [0, 1], got {min_gate_mass}")


def fidelity_floor(df: pd.DataFrame, min_gate_mass: float | None) -> tuple[pd.DataFrame, int]:
    """Drop the finished rows whose routing fidelity (``gate_mass_preserved``) is below the
    floor; skipped and failed rows stay. Returns the table and how many rows were dropped."""
    check_fidelity_floor(min_gate_mass)
    if min_gate_mass is None:
        return df, 0
    if "gate_mass_preserved" not in df.columns:
        return df, 0
    below = (df["status"] == "ok") & (df["gate_mass_preserved"] < min_gate_mass)
    return df[~below].reset_index(drop=True), int(below.sum())


def small_budget_note(df: pd.DataFrame) -> str:
    """One line when finished rows of per-layer caching policies have at most top-k experts
    per layer, where those policies cannot differ (docs/metrics.md, "Budget and residency");
    "" otherwise."""
    from daopsim.policies.caching import CachingPolicy
    from daopsim.policies.registry import get_policy_class
    from daopsim.simulator.models import get_model

    if df.empty or "model" not in df:
        return ""
    hits: list[str] = []
    for r in df[df["status"] == "ok"].itertuples():
        try:
            cls = get_policy_class(str(r.policy))
            model = get_model(str(r.model))
        except UserError:
            continue
        gpus = int(getattr(r, "gpus", 1) or 1)
        per_layer = int(r.gpu_experts) // gpus // max(1, model.moe_layers)
        if issubclass(cls, CachingPolicy) and per_layer <= model.top_k:
            hits.append(f"{r.policy} at {int(r.gpu_experts)}")
    if not hits:
        return ""
    shown = ", ".join(dict.fromkeys(hits))
    return (
        f"{len(hits)} row(s) of per-layer caching policies have at most top-k experts per layer "
        f"({shown}): there every per-layer cache holds only the last token's experts, so they "
        "cannot differ (docs/metrics.md, 'Budget and residency')"
    )


def write_table(df: pd.DataFrame, out: str | os.PathLike[str]) -> Path:
    """Write the sweep table atomically: Parquet, or CSV for a ``.csv`` path."""
    return _write_any_table(df, out, "--out")


def read_table(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Read a results table (a sweep's or an experiment's, Parquet or CSV); a clear error when
    the file is missing or not a results table."""
    p = check_input_file(path, "results")
    fmt = output_format(p, TABLE_FORMATS)
    try:
        df = pd.read_csv(p) if fmt == "csv" else pd.read_parquet(p)
    except Exception as exc:
        raise UserError(f"{p}: not a readable {fmt} file ({_one_line(exc)})") from None
    missing = [c for c in ("policy", "hw", "trace", "status", "tokens_per_s") if c not in df]
    if missing:
        raise UserError(f"{p}: not a results table (missing column {missing[0]!r})")
    if fmt == "csv" and "per_layer_hit_rate" in df:
        df["per_layer_hit_rate"] = [_list_cell(v) for v in df["per_layer_hit_rate"]]
    for col in [c for c in (*metric_keys(), *_NUMBER_COLUMNS) if c in df]:
        if df[col].dtype.kind in "biuf":
            continue
        # empty cells (a failed row's metrics) are NaN; anything else must be a number
        values = pd.to_numeric(df[col], errors="coerce")
        bad = values.isna() & df[col].notna()
        if bad.any():
            i = int(bad.to_numpy().argmax())
            raise UserError(
                f"{p}: row {i + 1}: column {col!r}: {df[col].iloc[i]!r} is not a number"
            )
        df[col] = values
    return df


#: Columns of a results table that hold numbers besides the metrics (checked on reading)
_NUMBER_COLUMNS = (
    "cache_ratio",
    "gpu_experts",
    "sequences",
    "seed",
    "total_experts",
    "max_gpu_experts",
    "expert_bytes",
    "expert_memory_gb",
    *BOUND_COLUMNS[:1],
    *SERVING_COLUMNS,
)


def _list_cell(value: Any) -> list[float] | None:
    """A list column read back from CSV (written as ``[0.1, 0.2]``)."""
    if not isinstance(value, str):
        return None
    try:
        return [float(x) for x in json.loads(value.replace("nan", "NaN"))]
    except (ValueError, TypeError):
        return None


# --- executors --------------------------------------------------------------------------------


def pool_context() -> Any:
    """The multiprocessing context of the local executor.

    On Linux, ``fork``: a worker starts as a copy of the sweep process, so it never re-runs the
    calling script (``spawn`` and ``forkserver`` import ``__main__`` again in every worker, and a
    script that calls ``sweep()`` at top level, without an ``if __name__ == "__main__":`` guard,
    would then start a sweep inside each worker and fail). The copy also keeps policies
    registered by the script or notebook. The pool starts all its workers before its manager
    thread (``ProcessPoolExecutor`` does so for ``fork``), and a run is deterministic
    (``simulate(record=False)``), so the table is the same as with one worker. Elsewhere (macOS,
    Windows: ``fork`` is unsafe or missing) ``spawn``, which needs the guard in scripts.
    """
    import multiprocessing as mp

    if sys.platform.startswith("linux") and "fork" in mp.get_all_start_methods():
        return mp.get_context("fork")
    return mp.get_context("spawn")


def _run_local(todo: list[Config], workers: int, on_row: Callable[[dict[str, Any]], None]) -> None:
    if workers <= 1 or len(todo) <= 1:
        for cfg in todo:
            on_row(run_config(cfg))
        return
    import concurrent.futures as cf

    ctx = pool_context()
    with cf.ProcessPoolExecutor(
        max_workers=min(workers, len(todo)),
        mp_context=ctx,
        initializer=watch_parent,
        initargs=(os.getpid(),),
    ) as pool:
        futures = [pool.submit(run_config, cfg) for cfg in todo]
        try:
            for fut in cf.as_completed(futures):
                on_row(fut.result())
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def _run_dask(
    todo: list[Config],
    workers: int,
    scheduler: str | None,
    on_row: Callable[[dict[str, Any]], None],
) -> None:
    try:
        from distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise UserError(
            "--executor dask needs dask.distributed: pip install 'daopsim[dask]'"
        ) from None
    import logging

    cluster = None
    if scheduler:
        try:
            client = Client(scheduler, timeout="20s")
        except (OSError, TimeoutError) as exc:
            raise UserError(f"cannot reach the Dask scheduler at {scheduler}: {exc}") from None
    else:
        cluster = LocalCluster(
            n_workers=max(1, workers),
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=logging.ERROR,
        )
        client = Client(cluster)
        # the cluster's nannies and workers end themselves when this process dies
        from daopsim.simulator.dask_watchdog import WatchdogNannyPlugin, WatchdogWorkerPlugin

        client.register_plugin(WatchdogNannyPlugin(os.getpid()))
        client.register_plugin(WatchdogWorkerPlugin(os.getpid()))
    try:
        futures = [client.submit(run_config, cfg, pure=False) for cfg in todo]
        for fut in as_completed(futures):
            on_row(fut.result())
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


# --- the sweep --------------------------------------------------------------------------------


def run_configs(
    configs: list[Config],
    executor: str = "local",
    workers: int | None = None,
    scheduler: str | None = None,
    progress: bool = False,
    bounds: bool = True,
    label: str = "runs",
) -> list[dict[str, Any]]:
    """Run configurations (from :func:`expand` of one or several grids) in one pool; returns
    their rows in the order given. A configuration given twice (the same key) runs once.
    Nothing is written: this is the core of a sweep without its table file (``advise``)."""
    if executor not in EXECUTORS:
        raise UserError(f"unknown executor {executor!r} (valid: {', '.join(EXECUTORS)})")
    n_workers = workers if workers is not None else (os.cpu_count() or 1)
    unique = list({c.key: c for c in configs}.values())
    done: dict[str, dict[str, Any]] = {}
    bar = Progress(len(unique), label, enabled=progress)

    def on_row(row: dict[str, Any]) -> None:
        done[row["key"]] = row
        bar.update(1)

    with bar:
        if executor == "dask":
            _run_dask(unique, n_workers, scheduler, on_row)
        else:
            _run_local(unique, n_workers, on_row)
    if bounds:
        add_bounds([done[c.key] for c in unique], unique)
    # the names asked for (a profile path, a trace name); a finished row keeps the runtime it
    # ran on when none was asked for
    return [
        {**done[c.key], **{k: v for k, v in _labels(c).items() if v is not None}} for c in configs
    ]


@dataclass
class SweepSummary:
    """What a sweep did: counts and the failed configurations.

    ``skipped`` counts configurations whose memory budget does not fit the machine (status
    "skipped"); they are not failures.
    """

    out: str | None
    configurations: int
    ok: int
    skipped: int
    failed: int
    resumed: int
    elapsed_s: float
    errors: list[dict[str, Any]]
    below_floor: int = 0  #: finished rows dropped by ``min_gate_mass``

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``daopsim sweep --json``)."""
        return dict(self.__dict__)


def _as_grid(grid: Grid | Mapping[str, Any] | str | os.PathLike[str]) -> tuple[Grid, str | None]:
    if isinstance(grid, Grid):
        return grid, None
    if isinstance(grid, Mapping):
        g = Grid.from_dict(grid)
        return g, grid.get("out")
    return load_grid_file(grid)


def run_sweep(
    grid: Grid | Mapping[str, Any] | str | os.PathLike[str],
    executor: str = "local",
    workers: int | None = None,
    out: str | os.PathLike[str] | None = None,
    progress: bool = True,
    scheduler: str | None = None,
    retry_errors: bool = False,
    min_gate_mass: float | None = None,
    bounds: bool = True,
) -> tuple[pd.DataFrame, SweepSummary]:
    """Run a sweep; returns the table and a summary (``sweep()`` returns just the table).

    ``min_gate_mass`` leaves out of the table the finished rows below that routing fidelity
    (their parts stay, so a later run with another floor does not simulate them again).
    ``bounds``: fill the all-GPU bound columns (:data:`BOUND_COLUMNS`; a few all-GPU runs per
    machine, trace, sequences and precision, in this process)."""
    g, grid_out = _as_grid(grid)
    if out is None and grid_out is not None:
        out = grid_out
    if executor not in EXECUTORS:
        raise UserError(f"unknown executor {executor!r} (valid: {', '.join(EXECUTORS)})")
    if workers is not None and workers < 1:
        raise UserError(f"workers must be at least 1, got {workers}")
    if scheduler and executor != "dask":
        raise UserError("a scheduler address needs executor='dask'")
    n_workers = workers if workers is not None else (os.cpu_count() or 1)
    check_fidelity_floor(min_gate_mass)  # before any run, not after
    configs = expand(g)
    t0 = time.perf_counter()
    folder = _results_folder(g, configs, out)
    lock = _lock(folder, Path(str(out))) if folder is not None else contextlib.nullcontext()
    with lock:
        done = _load_parts(folder, {c.key for c in configs}) if folder is not None else {}
        if retry_errors:
            done = {k: r for k, r in done.items() if r.get("status") != "error"}
        resumed = len(done)
        todo = [c for c in configs if c.key not in done]
        _run_into(done, todo, len(configs), folder, executor, n_workers, scheduler, progress)
        if bounds:
            add_bounds([done[c.key] for c in configs], configs)
        # a stored row keeps its numbers but takes this request's labels (a key is content: the
        # same run may have been asked for under another file name or profile name before)
        rows = [{**done[c.key], **_labels(c)} for c in configs]
        df, below_floor = fidelity_floor(to_frame(rows), min_gate_mass)
        if out is not None:
            write_table(df, out)
    elapsed = time.perf_counter() - t0
    return df, _summary(df, out, len(configs), resumed, below_floor, elapsed)


def _results_folder(
    g: Grid, configs: list[Config], out: str | os.PathLike[str] | None
) -> Path | None:
    """The parts folder of the results table (None without one), once the table's path is
    checked: a table format, never one of the sweep's inputs."""
    if out is None:
        return None
    output_format(out, TABLE_FORMATS, "--out")
    inputs = {c.trace_path for c in configs}  # the traces as resolved
    for p in grid_params():  # the other declared parameters that name an input file
        if p.input and p.name != "trace":
            value = getattr(g, str(p.grid_attr))
            inputs |= set(value) if p.axis else {value}
    inputs |= set(value_paths(g.options))  # a policy option naming a file (model=FILE)
    check_output_file(out, "--out", inputs=sorted(str(i) for i in inputs if i))
    return parts_dir(out)


def _run_into(
    done: dict[str, dict[str, Any]],
    todo: list[Config],
    total: int,
    folder: Path | None,
    executor: str,
    n_workers: int,
    scheduler: str | None,
    progress: bool,
) -> None:
    """Run ``todo`` into ``done`` (by key), saving each row's part as it finishes, under a
    progress bar over all ``total`` configurations that counts the failures."""
    bar = Progress(total, "sweep", initial=len(done), enabled=progress)
    n_failed = [sum(1 for r in done.values() if r.get("status") == "error")]

    def on_row(row: dict[str, Any]) -> None:
        done[row["key"]] = row
        if folder is not None:
            _save_part(folder, row)
        n_failed[0] += row.get("status") == "error"
        bar.update(1, f"{n_failed[0]} failed" if n_failed[0] else None)

    with bar:
        if executor == "dask":
            _run_dask(todo, n_workers, scheduler, on_row)
        else:
            _run_local(todo, n_workers, on_row)


def _summary(
    df: pd.DataFrame,
    out: str | os.PathLike[str] | None,
    configurations: int,
    resumed: int,
    below_floor: int,
    elapsed: float,
) -> SweepSummary:
    """The sweep's counts and its failed configurations, from its table."""
    failed = df[df["status"] == "error"]
    return SweepSummary(
        out=str(out) if out is not None else None,
        configurations=configurations,
        ok=int((df["status"] == "ok").sum()) + below_floor,
        skipped=int((df["status"] == "skipped").sum()),
        failed=len(failed),
        resumed=resumed,
        elapsed_s=round(elapsed, 3),
        below_floor=below_floor,
        errors=[
            {
                k: (None if _isnan(v) else v)
                for k, v in r.items()
                if k in ("key", "policy", "hw", "trace", "cache_ratio", "gpu_experts", "error")
            }
            for r in failed.to_dict("records")
        ],
    )


def sweep(
    grid: Grid | Mapping[str, Any] | str | os.PathLike[str],
    executor: str = "local",
    workers: int | None = None,
    out: str | os.PathLike[str] | None = None,
    progress: bool = True,
    scheduler: str | None = None,
    retry_errors: bool = False,
    bounds: bool = True,
) -> pd.DataFrame:
    """Run every configuration of ``grid`` and return one tidy row per configuration.

    ``grid`` is a :class:`Grid`, a dict with the same keys, or a TOML grid file. With ``out``
    the sweep is resumable (see docs/sweeps.md). Failed configurations have status "error",
    memory points that do not fit the machine status "skipped". ``bounds``: fill each row's
    all-GPU bound (``bound_tokens_per_s``, ``bound_runtime``; docs/metrics.md, "Bounds").
    """
    df, _ = run_sweep(
        grid,
        executor=executor,
        workers=workers,
        out=out,
        progress=progress,
        scheduler=scheduler,
        retry_errors=retry_errors,
        bounds=bounds,
    )
    return df


__all__ = [
    "Config",
    "Grid",
    "SweepSummary",
    "check_fidelity_floor",
    "expand",
    "fidelity_floor",
    "load_grid_file",
    "read_table",
    "run_config",
    "run_configs",
    "run_sweep",
    "sweep",
]
