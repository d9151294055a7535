"""What ``daopsim advise`` answers: its rows (``AdviceRow``), each machine's answer to a target
(``MachineAnswer``) and the whole answer (``Advice``), with how a row's figures are read: its
bottleneck, whether its precision is exact, its fidelity (docs/advise.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class AdviceRow:
    """One configuration of the search, with its metrics and the command that reproduces it."""

    rank: int | None
    hw: str
    policy: str
    runtime: str
    dtype: str
    cache_ratio: float | None
    #: the budget the run was given, and the most experts it kept resident at once
    gpu_experts: int
    resident_experts: int
    options: dict[str, Any]
    tokens_per_s: float
    ttft_s: float
    #: routing fidelity: the share of the true gate mass in the route used
    gate_mass_preserved: float | None
    #: the share of the true gate mass computed exactly, at the trace's own precision: 0 for
    #: experts at a lossy precision (docs/advise.md, "Fidelity")
    fidelity: float | None
    hit_rate: float
    tokens_per_kj: float | None
    bottleneck: str
    reference: bool
    command: str
    #: the row's all-GPU bound (docs/metrics.md, "Bounds"): tokens/s and the runtime it ran on
    bound_tokens_per_s: float | None = None
    bound_runtime: str | None = None
    #: other configurations with exactly this row's results, and why they tie
    tied: list[dict[str, Any]] = field(default_factory=list)
    tie_reason: str | None = None

    @property
    def of_bound(self) -> float | None:
        """``tokens_per_s`` as a share of the all-GPU bound (at most 1)."""
        if not self.bound_tokens_per_s:
            return None
        return self.tokens_per_s / self.bound_tokens_per_s

    @property
    def options_text(self) -> str:
        """The options that differ from their defaults as ``k=v`` (``-`` for none)."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.options.items())) or "-"


@dataclass
class MachineAnswer:
    """One machine's best configuration, against the target when there is one."""

    hw: str
    best_tokens_per_s: float | None
    best_rank: int | None
    best_command: str | None
    meets_target: bool | None
    price: float | None
    tokens_per_kj: float | None


@dataclass
class Advice:
    """The ranked table (``rows``), bound reference lines and what was left out."""

    model: str
    #: the machines searched, as given (comma-joined, as on the command line)
    hw: str
    trace: str
    sequences: int
    min_gate_mass: float | None
    #: how to get the trace on another machine: ``None`` for a bundled trace or a file the user
    #: gave, else the ``daopsim synth`` command that writes the same synthetic trace
    trace_synth: str | None = None
    runtimes: list[str] | None = None
    min_tokens_per_s: float | None = None
    rows: list[AdviceRow] = field(default_factory=list)
    references: list[AdviceRow] = field(default_factory=list)
    #: per precision (and machine), the rank of its best row
    best_per_precision: list[dict[str, Any]] = field(default_factory=list)
    machines: list[MachineAnswer] = field(default_factory=list)
    #: the machine the target question is answered with (None without a target or when no
    #: machine reaches it), and how machines were ordered
    answer: str | None = None
    order: str | None = None
    notes: list[str] = field(default_factory=list)
    runs: int = 0
    skipped: int = 0
    failed: int = 0
    below_floor: int = 0
    below_target: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``daopsim advise --json``)."""
        return asdict(self)


def bottleneck(row: dict[str, Any], unified: bool) -> str:
    """The busiest of the host link, the CPU and the GPU (docs/advise.md, "Bottleneck").

    On a unified-memory machine the "link" is a copy inside the one DRAM, so it is "memory".
    """
    busy = {
        "link": float(row.get("h2d_busy_frac") or 0.0),
        "CPU": float(row.get("cpu_busy_frac") or 0.0),
        "GPU": float(row.get("gpu_busy_frac") or 0.0),
    }
    name = max(busy, key=lambda k: (busy[k], k == "GPU"))
    if name == "link" and unified:
        return "memory"
    return name


def exact_precision(dtype: str, reference: str) -> bool:
    """Whether experts at ``dtype`` compute what the trace's model (at ``reference``) does:
    a floating-point format of at least as many bits. Anything else (fp8, int8, int4, GGUF,
    MXFP4, HQQ) is lossy, and how much it loses is not modelled."""
    from daopsim.simulator.precisions import DTYPES

    d, ref = DTYPES.get(dtype), DTYPES.get(reference)
    if d is None or ref is None:
        return dtype == reference
    return d.kind == "float" and d.bits >= ref.bits


def fidelity(row: dict[str, Any], reference_dtype: str) -> float | None:
    """The share of the true gate mass computed exactly (docs/advise.md, "Fidelity"): the
    routing's preserved gate mass less the part computed from low-bit copies, and 0 when the
    experts' precision is lossy against the trace's own."""
    kept = _float_or_none(row.get("gate_mass_preserved"))
    if kept is None:
        return None
    if not exact_precision(str(row["dtype"]), reference_dtype):
        return 0.0
    return max(0.0, kept - (_float_or_none(row.get("low_precision_gate_mass")) or 0.0))


def _float_or_none(value: Any) -> float | None:
    if value is None or (isinstance(value, float) and value != value):
        return None
    return float(value)
