"""The all-GPU throughput bound of a run: every expert resident, on the run's own machine and
precisions, under the fastest runtime that could run it (docs/metrics.md, "Bounds").

A run's throughput depends on three things the bound must share with it: the machine (its
GPU, link and CPU), the precisions (GPU experts, host copies, non-expert weights) and the
runtime (the host's dispatch and sync costs, fused MoE calls, CUDA-graph replay, the GPU's
achieved stream rate). A bound run on a slower runtime than the run's is beaten by it (a
cuda-graph run of ``lru`` with every expert resident is about twice as fast as ``all-gpu`` on
``ideal``, because fused MoE kernels pay fewer launches than one kernel set per expert). So the
bound is the fastest ``all-gpu`` run over the run's own runtime and every bundled runtime that
no other candidate beats on every cost (:func:`bound_runtimes`); it names the runtime it took.

For each runtime ``R`` no policy on ``R`` is faster than ``all-gpu`` on ``R`` (every expert is
resident from the start and nothing else is on the GPU's, the link's or the host's way), so the
maximum over the runtimes is a bound for a run on any of them. tests/test_bounds.py checks it
across every built-in policy, machine class, runtime and precision.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

from daopsim.simulator.runtime_profiles import (
    HOST_DEVICE_FIELDS,
    RuntimeProfile,
    get_runtime,
    runtime_names,
)

#: The policy whose run is the bound.
ALL_GPU = "all-gpu"
#: Costs of a runtime profile where less is never slower (host time per kernel, per sync, per
#: step; kernels and syncs issued per layer and per expert).
_LOWER_IS_FASTER = (
    "dispatch_us",
    "sync_us",
    "step_us",
    "nonexpert_kernels",
    "expert_kernels",
    "routing_syncs",
    "expert_syncs",
    "idle_expert_kernels",
    "idle_expert_syncs",
    "gpu_gemm_half_tokens",
    "gpu_moe_tile_tokens",
    # a device on the host thread (host_device): host time added to the device's
    *HOST_DEVICE_FIELDS,
)
#: Metrics the bound reports, and whether more is faster.
_METRICS = {"tokens_per_s": True, "decode_tokens_per_s": True, "tpot_p50_s": False, "e2e_s": False}


@dataclass(frozen=True)
class AllGpuBound:
    """The all-GPU bound of a run (docs/metrics.md, "Bounds")."""

    tokens_per_s: float
    decode_tokens_per_s: float
    tpot_p50_s: float
    e2e_s: float
    #: the runtime and expert precision of the fastest all-GPU run (``tokens_per_s``'s)
    runtime: str
    dtype: str
    #: the run's own runtime, and the all-GPU throughput under it
    own_runtime: str
    own_tokens_per_s: float
    #: every ``"RUNTIME DTYPE"`` tried, with its all-GPU tokens/s
    tried: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the ``all-gpu`` entry of ``run --json``'s ``bounds``)."""
        return asdict(self)


def _never_slower(a: RuntimeProfile, b: RuntimeProfile) -> bool:
    """True when an all-GPU run on ``a`` is at least as fast as on ``b``: ``a`` costs no more
    on every field that can slow such a run, and is the same kind of runtime otherwise."""
    if any(getattr(a, f) > getattr(b, f) for f in _LOWER_IS_FASTER):
        return False
    memories = {m for m, _ in a.gpu_stream_efficiency_by_memory + b.gpu_stream_efficiency_by_memory}
    if any(
        a.gpu_stream_efficiency_on(m) < b.gpu_stream_efficiency_on(m) for m in (None, *memories)
    ):
        return False
    if a.attention != b.attention and a.attention != "fused":
        return False
    if a.logits_to_host and not b.logits_to_host:  # its passes end with a copy b does not make
        return False
    # fused MoE calls and CUDA-graph replay change which costs apply rather than their size:
    # runtimes differing in them are not compared
    if a.fused_moe != b.fused_moe or a.replays_graphs != b.replays_graphs:
        return False
    if a.replays_graphs and (a.graph_kernel_us, a.graph_step_us) > (
        b.graph_kernel_us,
        b.graph_step_us,
    ):
        return False
    # ggml's GPU prompt rate (gpu.ggml_prompt_tflops) may lie above or below gpu.bf16_tflops
    return a.cpu_kernels == b.cpu_kernels and a.gpu_kernels == b.gpu_kernels


def bound_runtimes(own: str | RuntimeProfile) -> list[RuntimeProfile]:
    """The runtimes an all-GPU bound runs on: the run's own (``own``, always: its number is
    reported beside the bound), then every bundled one that no other candidate is never slower
    than (the others cannot be faster)."""
    own_rt = get_runtime(own)
    pool = [own_rt] + [r for r in map(get_runtime, runtime_names()) if r != own_rt]
    keep: list[RuntimeProfile] = [own_rt]  # always run: the table reports it beside the bound
    for i, r in enumerate(pool):
        if i == 0:
            continue
        # dominated by another candidate: drop it (the first of two equal ones stays)
        beaten = any(
            j != i and _never_slower(o, r) and (j < i or not _never_slower(r, o))
            for j, o in enumerate(pool)
        )
        if not beaten:
            keep.append(r)
    return keep


def all_gpu_bound(
    hw: Any,
    trace: Any,
    evaluate: list[int],
    runtime: str | RuntimeProfile = "ideal",
    **shared: Any,
) -> AllGpuBound:
    """The all-GPU bound for a run of ``evaluate`` (sequence ids) of ``trace`` on ``hw`` whose
    runtime is ``runtime`` (a name or a profile). ``shared``: the run's other ``simulate()``
    keywords the declaration gives the bounds (simulator/run_params.py, ``bounds=``: ``dtype``,
    ``host_dtype``, ``nonexpert_dtype``, ``seed``, ...); another keyword is a TypeError.

    The experts run at the run's GPU precision and, when its host copies have another one, at
    that precision too (a run that computes experts on the host at a smaller precision can beat
    every expert on the GPU at a larger one): the faster counts."""
    from daopsim.simulator.run_params import bound_params

    known = {p.name for p in bound_params()} - {"hw", "trace"}
    unknown = sorted(set(shared) - known)
    if unknown:
        raise TypeError(f"all_gpu_bound() got an unexpected keyword argument {unknown[0]!r}")
    own = get_runtime(runtime)
    dtype, host_dtype = shared.get("dtype"), shared.get("host_dtype")
    precisions = [(dtype, host_dtype)]
    if host_dtype is not None and host_dtype != dtype:
        precisions.append((host_dtype, host_dtype))
    runs: dict[tuple[str, str | None], dict[str, Any]] = {}
    for r in bound_runtimes(own):
        for gpu_dtype, host in precisions:
            args = {**shared, "dtype": gpu_dtype, "host_dtype": host}
            runs[r.name, gpu_dtype] = _all_gpu_metrics(
                _hashable(hw),
                str(trace) if trace is not None else None,
                tuple(int(s) for s in evaluate),
                r,
                tuple(sorted(args.items())),
            )
    best = max(runs, key=lambda k: (runs[k]["tokens_per_s"], k == (own.name, dtype)))
    out: dict[str, float] = {}
    for key, more in _METRICS.items():
        vals = [m[key] for m in runs.values()]
        out[key] = max(vals) if more else min(vals)
    return AllGpuBound(
        **out,
        runtime=best[0],
        dtype=runs[best]["dtype"],
        own_runtime=own.name,
        own_tokens_per_s=runs[own.name, dtype]["tokens_per_s"],
        tried={f"{n} {runs[n, d]['dtype']}": m["tokens_per_s"] for (n, d), m in runs.items()},
    )


def bound_for_result(result: Any, hw: Any, trace: Any, **run_args: Any) -> AllGpuBound:
    """The all-GPU bound of a :class:`~daopsim.simulator.results.RunResult` (its sequences,
    runtime and the values of the parameters declared for the bounds: precisions, seed, ...),
    on ``hw`` and ``trace`` as the run was given them; ``run_args``, the run's other
    ``simulate()`` keywords, win over what its configuration recorded."""
    from daopsim.simulator.run_params import bound_arguments, bound_params

    c = result.config
    given = {p.name: c[p.name] for p in bound_params() if p.name in c}
    shared = bound_arguments({**given, **run_args, "hw": hw, "trace": trace}, c)
    del shared["hw"], shared["trace"]
    rt = c.get("runtime") or {}
    return all_gpu_bound(hw, trace, c["sequence_ids"], _runtime_from_config(rt), **shared)


def _runtime_from_config(rt: dict[str, Any]) -> RuntimeProfile | str:
    """The run's runtime profile from its config: the bundled one of that name when the run
    used it as bundled (a graph-replayed run records the replayed costs, which the bound's own
    run applies again), else the recorded values."""
    name = rt.get("name", "ideal")
    if name in runtime_names():
        return name
    from daopsim.simulator.runtime_profiles import parse_runtime

    data = {k: v for k, v in rt.items() if k != "sources"}
    return parse_runtime(data, f"runtime {name!r}")


def _hashable(hw: Any) -> Any:
    from daopsim.simulator.hardware_spec import HardwareProfile

    if isinstance(hw, HardwareProfile):
        return _ProfileKey(hw)
    return str(hw)


class _ProfileKey:
    """A hardware profile as an lru_cache key (by its content)."""

    def __init__(self, profile: Any) -> None:
        from daopsim.simulator.fingerprints import profile_sha256

        self.profile = profile
        self.sha = profile_sha256(profile)

    def __hash__(self) -> int:
        return hash(self.sha)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ProfileKey) and other.sha == self.sha


@functools.lru_cache(maxsize=256)
def _all_gpu_metrics(
    hw: Any,
    trace: str | None,
    evaluate: tuple[int, ...],
    runtime: RuntimeProfile,
    shared: tuple[tuple[str, Any], ...],
) -> dict[str, Any]:
    """The bound's metrics of one all-GPU run (cached: a sweep asks once per group of rows);
    ``shared``: the run's declared bound parameters as sorted (name, value) pairs."""
    from daopsim.simulator.runner import simulate

    r = simulate(
        policy=ALL_GPU,
        hw=hw.profile if isinstance(hw, _ProfileKey) else hw,
        trace=trace,
        evaluate=list(evaluate),
        runtime=runtime,
        record=False,
        **dict(shared),
    )
    out: dict[str, Any] = {k: float(r.metrics[k]) for k in _METRICS}
    out["dtype"] = r.config["dtype"]
    return out
