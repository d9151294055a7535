"""One declaration of a run's parameters, from which every surface that names them is derived.

A run's parameters are the fields of :class:`RunRequest` (the keywords of ``simulate()``) and
of the serving declarations: :class:`ServingOptions` (the options a run's
:class:`~daopsim.simulator.serving_config.ServingConfig` inherits and holds as given) and
:class:`ServingRequest` (adds how a batch is formed). Each field is declared once with
:func:`param`: its default, a doc line, its value type and choices, its ``daopsim run`` flag,
its key in a sweep grid (whether that key is an axis of several values, must not be empty, or
is expanded apart from the plain product), whether the bounds beside a run take it, and a check
of a value. From the declaration come:

- ``simulate()``'s keywords, signature and value checks (simulator/runner.py builds a
  :class:`RunRequest` from what it is given; :func:`check_declared`),
- the options of ``daopsim run`` and their help text (simulator/commands/run_cmd.py), and
  the run options its configuration (``run --json``) reports (:func:`declared_values`),
- the keys of ``run --config`` and of a sweep grid (``Grid``, ``daopsim sweep``'s grid flags;
  :func:`grid_params`) and docs/sweeps.md's table of them (:func:`grid_table`),
- the arguments of every bounds run beside a result (:func:`bound_params`,
  :func:`bound_arguments`),
- the fields of ``ServingConfig`` and the keywords of ``serving_config``.

:data:`RUN_PARAMS` lists them in order; the code that derives a surface reads it when it runs,
so a field added here reaches every surface (tests/test_run_declaration.py adds one).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from daopsim.simulator.data import DEFAULT_TRACE
from daopsim.simulator.errors import UserError, check_seed

if TYPE_CHECKING:
    from daopsim.policies.base import Policy
    from daopsim.simulator.hardware_spec import HardwareProfile
    from daopsim.simulator.recorder import Recorder
    from daopsim.simulator.runtime_profiles import RuntimeProfile
    from daopsim.simulator.serving_config import ServingConfig

#: a check of one value: raises a one-line UserError naming ``label`` (a flag or a grid key)
Check = Callable[[Any, str], None]


@dataclass(frozen=True)
class RunParam:
    """One declared run parameter (a field of :class:`RunRequest` or :class:`ServingRequest`)."""

    #: the ``simulate()`` keyword (``part == "run"``) or ``serving_config`` keyword
    name: str
    default: Any
    #: one line: the ``--help`` text of its flag, and its line in ``simulate()``'s docstring
    doc: str
    #: the value type of the flag and of a grid value (None: not a plain value)
    kind: type | None = None
    #: ``daopsim run``'s flag (None: from Python only, or an option ``run`` builds itself)
    flag: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    show_default: bool = False
    #: the key in a sweep grid and a ``run --config`` file (None: not a grid key)
    grid: str | None = None
    #: several values in a grid make an axis (a list key); else the key takes one value
    axis: bool = False
    #: the ``Grid`` attribute when it differs from the key (``arrival_rate`` -> ``arrival_rates``)
    attr: str | None = None
    #: a grid's value when the key is absent (None: the default, as a one-value list for an axis)
    grid_default: Any = None
    #: how a sweep configuration's key names the value: ``"given"`` (only when not the
    #: default, so the keys of earlier sweeps stay valid), ``"always"``, or ``"content"``
    #: (the sweep keys it by what it names: a file's bytes, a profile's content)
    key: str = "given"
    #: the bounds beside a run take it: ``"given"`` (as the run was asked) or ``"result"``
    #: (as the result's configuration resolved it); None: the bounds choose their own
    bounds: str | None = None
    #: a check of one value, beyond its type (raises a one-line UserError naming the label)
    check: Check | None = None
    #: it names an input file (a path is checked never to be an output of the command)
    input: bool = False
    #: ``"run"``: a ``simulate()`` keyword; ``"serving"``: part of the serving configuration
    part: str = "run"
    #: a sweep needs at least one value of this axis (an empty one is an error naming it)
    required: bool = False
    #: how a sweep expands the axis when not as a plain product: ``"where"`` (the outer loops:
    #: trace, machine, policy with its options), ``"memory"`` (the memory points: the union of
    #: ``cache_ratios`` and ``gpu_experts``), ``"gpus"`` (GPU counts, each above 1 with its
    #: placements); None: one factor of the product
    group: str | None = None

    @property
    def grid_attr(self) -> str | None:
        """The ``Grid`` attribute holding the key's value(s)."""
        return self.attr or self.grid

    @property
    def sweep_flag(self) -> str | None:
        """``daopsim sweep``'s flag for the key (an axis takes comma-separated values)."""
        attr = self.grid_attr
        return None if attr is None else "--" + attr.replace("_", "-")

    def grid_empty(self) -> Any:
        """The grid's value when the key is absent."""
        if self.grid_default is not None:
            return list(self.grid_default) if self.axis else self.grid_default
        if self.axis:
            return [] if self.default is None else [self.default]
        return self.default

    @property
    def label(self) -> str:
        """How a one-line error names the parameter: its ``daopsim run`` flag, else its name."""
        return self.flag or self.name

    def checked(self, value: Any, label: str) -> Any:
        """``value`` once its declared choices and check pass (the error names ``label``); a
        check may return the value normalised (a seed as a Python int)."""
        if value is None:
            return value
        if self.choices is not None and value not in self.choices:
            raise UserError(f"{label} must be one of {', '.join(self.choices)}, got {value!r}")
        if self.check is not None:
            out = self.check(value, label)
            if out is not None:
                return out
        return value


def param(default: Any, doc: str, **meta: Any) -> Any:
    """A declared dataclass field: its default, doc line and :class:`RunParam` metadata."""
    return field(default=default, metadata={"doc": doc, **meta})


# -- checks ------------------------------------------------------------------------------------
def _unit_ratio(value: Any, label: str) -> None:
    if not 0 < value <= 1:
        raise UserError(f"{label}: cache ratio {value} is not in (0, 1]")


def _not_negative(value: Any, label: str) -> None:
    if value < 0:
        raise UserError(
            f"{label}: gpu experts {value} is negative (0 up to the model's expert count)"
        )


def _positive_rate(value: Any, label: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{label}: arrival rate {value} is not a positive number")


def _positive_gb(value: Any, label: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{label} must be a positive number, got {value}")


def _positive_count(value: Any, label: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{label} must be a positive integer (at least 1), got {value!r}")


def _gpu_count(value: Any, label: str) -> None:
    if value < 1:
        raise UserError(f"{label} must be >= 1, got {value}")


def _seed(value: Any, label: str) -> int:
    return check_seed(value, label)


def _seconds(value: Any, label: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{label} must be a number of seconds")
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{label} must be a positive number of seconds, got {value}")


def _multi_gpu_mode(value: Any, label: str) -> None:
    from daopsim.simulator.multigpu import MODES

    if value not in MODES:
        raise UserError(f"{label} must be one of {list(MODES)}, got {value!r}")


def _expert_placement(value: Any, label: str) -> None:
    from daopsim.simulator.multigpu import EXPERT_PLACEMENTS

    if value not in EXPERT_PLACEMENTS:
        raise UserError(f"{label} must be one of {list(EXPERT_PLACEMENTS)}, got {value!r}")


# -- the declaration ---------------------------------------------------------------------------
@dataclass
class RunRequest:
    """What :func:`~daopsim.simulator.runner.simulate` was asked for: its arguments, as given
    (positional order: ``simulate("lru", "a6000-pcie4", "ci-small")``)."""

    policy: str | Policy = param(
        "daop", "Policy name (see `daopsim policies list`).", kind=str, flag="--policy",
        show_default=True, grid="policies", axis=True, key="always", required=True,
        group="where", grid_default=[],
    )  # fmt: skip
    hw: str | os.PathLike[str] | HardwareProfile = param(
        "a6000-pcie4", "Hardware profile name or path to a profile TOML.", kind=str,
        flag="--hw", show_default=True, grid="hw", axis=True, bounds="given", key="content",
        input=True, required=True, group="where",
    )  # fmt: skip
    trace: str | os.PathLike[str] | None = param(
        None, "Bundled trace name or path (default: the bundled Mixtral-8x7B trace).",
        kind=str, flag="--trace", grid="traces", axis=True, bounds="given", key="content",
        input=True, required=True, group="where",
        grid_default=[DEFAULT_TRACE],
    )  # fmt: skip
    cache_ratio: float | None = param(
        None, "Fraction of all experts resident on the GPU (DAOP's ECR), in (0, 1].",
        kind=float, flag="--cache-ratio", grid="cache_ratios", axis=True, check=_unit_ratio,
        key="always", group="memory",
    )  # fmt: skip
    gpu_experts: int | None = param(
        None, "Resident expert slots (default: what fits in GPU memory).", kind=int,
        flag="--gpu-experts", grid="gpu_experts", axis=True, check=_not_negative, key="always",
        group="memory",
    )  # fmt: skip
    sequences: int | None = param(
        None, "Evaluate N sequences of the evaluation pool (seed 0: the first N; else a "
        "seeded sample).", kind=int, flag="--sequences", grid="sequences",
        check=_positive_count, key="always",
    )  # fmt: skip
    calibration: str | os.PathLike[str] | None = param(
        None, "Popularity data for policies that use it: none, self (the evaluated "
        "sequences, in-sample) or a trace PATH (default: held-out sequences of the trace).",
        kind=str, flag="--calibration", metavar="none|self|PATH", grid="calibration",
        key="content", input=True,
    )  # fmt: skip
    policy_options: dict[str, Any] | None = param(
        None, "The policy's options (`daopsim run --policy-opt KEY=VALUE`, grid `options`)."
    )
    seed: int = param(
        0, "Seed: which sequences --sequences N evaluates (0: the first N), and random "
        "choices.", kind=int, flag="--seed", show_default=True, grid="seeds", axis=True,
        bounds="given", check=_seed, key="always", required=True,
    )  # fmt: skip
    dtype: str | None = param(
        None, "GPU expert precision (bf16, int4_g128, q4_k_m, mxfp4, ...).", kind=str,
        flag="--dtype", grid="dtype", bounds="given", key="always",
    )  # fmt: skip
    record: bool | str | os.PathLike[str] | Recorder = param(
        True, "The timeline: True keeps it in memory, False records none, a path streams it to "
        "that Parquet file as the run goes, a Recorder is used as given.",
    )  # fmt: skip
    host_dtype: str | None = param(
        None, "Precision of the host's expert copies: CPU compute and link bytes (default: "
        "--dtype).", kind=str, flag="--host-dtype", grid="host_dtype", bounds="result",
    )  # fmt: skip
    nonexpert_dtype: str | None = param(
        None, "Precision of the non-expert weights (default: bf16).", kind=str,
        flag="--nonexpert-dtype", grid="nonexpert_dtype", bounds="result",
    )  # fmt: skip
    progress: Callable[[int, int], None] | None = param(
        None, "Called with (sequences done, sequences) as the run goes."
    )
    lookahead: str = param(
        "recorded", "One-layer-early view for policies that read it: the trace's, or the "
        "previous token's experts at the same layer (a stand-in for traces that do not "
        "record it).", kind=str, flag="--lookahead", choices=("recorded", "previous-token"),
        show_default=True, grid="lookahead",
    )  # fmt: skip
    evaluate: list[int] | None = param(
        None, "Explicit sequence ids to evaluate (the bounds evaluate another run's ids)."
    )
    engine: str = param(
        "fast", "Timing engine: the fast one, or the plain-SimPy reference (same rules, "
        "slower).", kind=str, flag="--engine", choices=("fast", "reference"),
        show_default=True,
    )  # fmt: skip
    serving: ServingConfig | None = param(
        None, "Requests batched and arriving over time (docs/serving.md); None runs the "
        "sequences one after another (`daopsim run` builds it from its serving options).",
    )  # fmt: skip
    runtime: str | RuntimeProfile | None = param(
        None, "Runtime profile (host dispatch and sync overheads; `daopsim runtimes list`). "
        "Default: the one the policy declares.", kind=str, flag="--runtime", metavar="NAME",
        grid="runtimes", axis=True, key="content",
    )  # fmt: skip
    host_memory_gb: float | None = param(
        None, "Host memory budget, GB: the non-expert weights and the experts that fit; the "
        "rest are read from the profile's NVMe drive (default: the profile's cpu.memory_gb, "
        "or unlimited).", kind=float, flag="--host-memory-gb",
    )  # fmt: skip
    ssd_path: str | None = param(
        None, "How experts are read from the SSD: through the OS page cache (default) or "
        "GPUDirect Storage (NVMe to GPU, no host copy).", kind=str, flag="--ssd-path",
        metavar="page-cache|gds",
    )  # fmt: skip
    model: str | None = param(
        None, "Without --trace: generate (and cache) a small synthetic trace of this "
        "catalogue model (`daopsim models list`).", kind=str, flag="--model",
    )  # fmt: skip
    gpus: int = param(
        1, "GPUs of a multi-GPU profile to use (docs/serving.md, 'Multiple GPUs'); the "
        "expert budget (--cache-ratio, --gpu-experts) is then per GPU.", kind=int,
        flag="--gpus", show_default=True, grid="gpus", axis=True, check=_gpu_count,
        grid_default=[], group="gpus",
    )  # fmt: skip
    multi_gpu: str | None = param(
        None, "With --gpus > 1: 'expert' (expert e on GPU e mod N, attention on GPU 0; "
        "default) or 'pipeline' (contiguous layer stages).", kind=str, flag="--multi-gpu",
        grid="multi_gpu", axis=True, check=_multi_gpu_mode, key="content", group="gpus",
    )  # fmt: skip
    expert_placement: str | None = param(
        None, "With --multi-gpu expert: 'mod' (expert e on GPU e mod N; default) or "
        "'balanced' (calibration popularity spread evenly: largest first onto the "
        "least-loaded GPU).", kind=str, flag="--expert-placement", check=_expert_placement,
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_declared(self)


@dataclass(frozen=True, kw_only=True)
class ServingOptions:
    """The serving options a run's serving configuration holds as they were given: the part
    of :class:`ServingRequest` that
    :class:`~daopsim.simulator.serving_config.ServingConfig` inherits (docs/serving.md). Each
    value is checked as declared when the object is made."""

    arrival_rate: float | None = param(
        None, "Requests arrive by a Poisson process of R per second (seeded by --seed).",
        kind=float, flag="--arrival-rate", grid="arrival_rate", axis=True,
        attr="arrival_rates", check=_positive_rate,
    )  # fmt: skip
    arrivals: str | None = param(
        None, "Arrival file (CSV/Parquet: request_id, arrival_s, prompt_tokens, "
        "output_tokens, sequence).", kind=str, flag="--arrivals", metavar="FILE", input=True,
    )  # fmt: skip
    kv_cache_gb: float | None = param(
        None, "GPU memory reserved for the KV cache before expert slots are sized (default: "
        "one mean-length sequence per batch place, plus what the slots leave).", kind=float,
        flag="--kv-cache-gb", check=_positive_gb,
    )  # fmt: skip
    slo_ttft: float | None = param(
        None, "Time-to-first-token SLO (s).", kind=float, flag="--slo-ttft", grid="slo_ttft",
        check=_seconds,
    )  # fmt: skip
    slo_tpot: float | None = param(
        None, "Time-per-output-token SLO (s).", kind=float, flag="--slo-tpot",
        grid="slo_tpot", check=_seconds,
    )  # fmt: skip
    prefill_chunk: int | None = param(
        None, "Chunked prefill: each step carries up to N prompt tokens of a joining request "
        "beside the running requests' decode tokens.", kind=int, flag="--prefill-chunk",
        metavar="N", check=_positive_count,
    )  # fmt: skip
    preempt: bool = param(
        False, "Allocate the KV cache as tokens are written and preempt the newest request "
        "(recompute) when it runs out, instead of reserving prompt + output at admission.",
        kind=bool, flag="--preempt",
    )  # fmt: skip
    static_prefill: str | None = param(
        None, "With --batch: a batch's prompts prefill together in one step (batched, the "
        "default, as Hugging Face generate runs a batch) or each in a step of its own "
        "(per-request).", kind=str, flag="--static-prefill",
        choices=("batched", "per-request"),
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_declared(self)


@dataclass(frozen=True, kw_only=True)
class ServingRequest(ServingOptions):
    """The serving options of ``daopsim run``: how big a batch is and how it is formed, then
    the options :class:`ServingOptions` declares (``serving.serving_config`` turns them into
    the run's :class:`~daopsim.simulator.serving_config.ServingConfig`; docs/serving.md)."""

    batch: int | None = param(
        None, "Static batches of up to B requests (a batch starts when the previous one is "
        "done).", kind=int, flag="--batch", check=_positive_count,
    )  # fmt: skip
    max_batch: int | None = param(
        None, "Continuous batching of up to B requests (requests join and leave between "
        "steps).", kind=int, flag="--max-batch", grid="max_batch", check=_positive_count,
    )  # fmt: skip


def _declared(cls: type, part: str) -> tuple[RunParam, ...]:
    out = []
    for f in fields(cls):
        meta: Mapping[str, Any] = f.metadata
        default = f.default if f.default is not MISSING else None
        extra = {k: v for k, v in meta.items() if k != "doc"}
        out.append(RunParam(name=f.name, default=default, doc=meta["doc"], part=part, **extra))
    return tuple(out)


#: every declared run parameter: ``simulate()``'s keywords in order, then the serving options
RUN_PARAMS: tuple[RunParam, ...] = (
    *_declared(RunRequest, "run"),
    *_declared(ServingRequest, "serving"),
)


def check_declared(obj: Any) -> None:
    """Check each declared field of ``obj`` (a :class:`RunRequest` or a serving declaration)
    as its :class:`RunParam` says: a one-line UserError naming its flag; a normalised value
    (a seed) is stored back."""
    by_name = {p.name: p for p in RUN_PARAMS}
    for f in fields(obj):
        p = by_name.get(f.name)
        if p is None:
            continue
        value = getattr(obj, f.name)
        out = p.checked(value, p.label)
        if out is not value:
            object.__setattr__(obj, f.name, out)


def run_params(part: str | None = None) -> tuple[RunParam, ...]:
    """The declared parameters (of one part: ``"run"`` or ``"serving"``), read when called."""
    return tuple(p for p in RUN_PARAMS if part is None or p.part == part)


def grid_params() -> tuple[RunParam, ...]:
    """The parameters a sweep grid and a ``run --config`` file name (in declaration order)."""
    return tuple(p for p in RUN_PARAMS if p.grid is not None)


def make_request(args: tuple[Any, ...], kwargs: dict[str, Any]) -> RunRequest:
    """``simulate()``'s arguments as a :class:`RunRequest`; an argument the declaration does
    not have is a TypeError naming it, as for any Python function."""
    try:
        return RunRequest(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(str(exc).replace("RunRequest.__init__()", "simulate()")) from None


def request_param(name: str) -> RunParam:
    """The declared parameter of one ``simulate()`` keyword or serving option."""
    return next(p for p in RUN_PARAMS if p.name == name)


def request_field(name: str) -> Field[Any]:
    """The dataclass field of one ``simulate()`` keyword."""
    return next(f for f in fields(RunRequest) if f.name == name)


def bound_params() -> tuple[RunParam, ...]:
    """The ``simulate()`` keywords the bounds beside a run share with it (declared with
    ``bounds``), read when called."""
    return tuple(p for p in run_params("run") if p.bounds is not None)


def bound_arguments(given: Mapping[str, Any], result_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``simulate()`` keywords the bounds beside a run share with it: each parameter
    declared with ``bounds``, as given to the run or as its result resolved it."""
    out: dict[str, Any] = {}
    for p in bound_params():
        if p.bounds == "given":
            out[p.name] = given.get(p.name, p.default)
        elif p.bounds == "result":
            out[p.name] = result_config.get(p.name)
    return out


def declared_values(req: RunRequest, config: Mapping[str, Any]) -> dict[str, Any]:
    """The run options (declared with a ``daopsim run`` flag) a run's configuration does not
    report yet, as given (a path or profile as text); None values are left out."""
    out: dict[str, Any] = {}
    for p in run_params("run"):
        value = getattr(req, p.name, None)
        if p.flag is None or p.name in config or value is None:
            continue
        plain = isinstance(value, str | int | float | bool)
        out[p.name] = value if plain else str(value)
    return out


def docstring_lines() -> str:
    """One line per ``simulate()`` keyword, for its docstring."""
    return "\n".join(f"    ``{p.name}``: {p.doc}" for p in run_params("run"))


#: the keys of a sweep grid and a ``run --config`` file that are not run parameters, with
#: their meaning (docs/sweeps.md)
OTHER_GRID_KEYS: dict[str, str] = {
    "options": "the policies' options: `KEY = [values]` for every policy that declares KEY, "
    "`[options.POLICY]` for one policy; several values make an axis (`--policy-opt`)",
    "out": "the results table of a sweep (`--out`), the output folder of `run --config`",
}

_KIND_NAMES = {str: "string", int: "integer", float: "number", bool: "true or false"}


def _grid_values(p: RunParam) -> str:
    """What a grid key takes, and its value when absent."""
    kind = _KIND_NAMES.get(p.kind, "value") if p.kind is not None else "value"
    if p.choices:
        kind = " or ".join(f"`{c}`" for c in p.choices)
    what = f"list of {kind}{'' if p.choices else 's'} (an axis)" if p.axis else f"one {kind}"
    empty = p.grid_empty()
    if empty in (None, []):
        return what
    shown = ", ".join(map(str, empty)) if isinstance(empty, list) else str(empty)
    return f"{what}; default `{shown}`"


def grid_table() -> str:
    """The Markdown table of every grid key (docs/sweeps.md, generated): what it takes, its
    ``daopsim sweep`` flag, its ``daopsim run`` option and its doc line; then the keys that
    are not run parameters."""
    lines = [
        "| key | values | `daopsim sweep` | `daopsim run` | meaning |",
        "|---|---|---|---|---|",
    ]
    for p in grid_params():
        sweep = f"`{p.sweep_flag} A,B`" if p.axis else f"`{p.sweep_flag}`"
        run = f"`{p.flag}`" if p.flag else ""
        doc = p.doc.replace("|", "\\|")
        lines.append(f"| `{p.grid}` | {_grid_values(p)} | {sweep} | {run} | {doc} |")
    for key, doc in OTHER_GRID_KEYS.items():
        lines.append(f"| `{key}` | | | | {doc} |")
    return "\n".join(lines)
