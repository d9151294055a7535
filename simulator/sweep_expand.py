"""A grid expanded into configurations: every combination in a fixed order (trace, machine,
policy, option values, memory point, the other axes), each checked as declared and given a key,
a SHA-256 over what it names by content (the trace's bytes, the profile's resolved content, the
policy's code and options, the calibration, the daopsim version and the simulator's source) and
each declared parameter by its rule (docs/sweeps.md, "Configuration keys").
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import itertools
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daopsim.simulator.boundary import construct_policy
from daopsim.simulator.data import (
    bundled_traces,
    resolve_trace,
)
from daopsim.simulator.errors import (
    UserError,
)
from daopsim.simulator.fingerprints import daopsim_version, file_sha256, profile_sha256
from daopsim.simulator.grid import Grid
from daopsim.simulator.native import module_source
from daopsim.simulator.run_params import grid_params, run_params
from daopsim.simulator.runtime_profiles import get_runtime


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
        from daopsim.simulator.serving_config import serving_config

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
