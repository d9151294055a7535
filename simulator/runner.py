"""``simulate()``: one run of one policy on one machine over a trace, as used by the CLI,
notebooks and sweeps: a pipeline of named stages (docs/architecture.md, "The path of one run").

It resolves the trace, profile and policy, chooses the evaluated and calibration sequences
(simulator/calibration.py), sizes the run (simulator/fit.py: the GPU expert budget, CPU-resident
layers; simulator/run_costs.py: its cost model), reads calibration counts, the serving plan and
a clairvoyant policy's oracle, runs the engine and collects a
:class:`~daopsim.simulator.results.RunResult` (metrics, configuration, notes).
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from daopsim.policies.base import Policy
from daopsim.policies.placement import low_bit_slots_per_expert
from daopsim.policies.registry import get_policy_class
from daopsim.simulator.arrivals import Arrival, read_arrivals
from daopsim.simulator.boundary import check_declarations, construct_policy
from daopsim.simulator.calibration import (
    CALIBRATION_MODES,
    calibration_counts,
    routing_digest,
    same_content,
    small_trace,
    split_sequences,
)
from daopsim.simulator.core.loop import Engine
from daopsim.simulator.costs import CostModel
from daopsim.simulator.data import resolve_trace
from daopsim.simulator.errors import DoesNotFit, UserError
from daopsim.simulator.fit import (
    ExpertFit,
    _buffers,
    check_fit,
    cpu_resident_layers,
    expert_fit,
    fixed_residency,
    options_text,
    policy_buffers,
    requested_budget,
    serving_kv_reserve,
    trace_context,
)
from daopsim.simulator.hardware import HardwareProfile, load_profile
from daopsim.simulator.hosttier import host_tier_config
from daopsim.simulator.oracle import Oracle
from daopsim.simulator.output import check_output_file
from daopsim.simulator.recorder import Recorder
from daopsim.simulator.results import RunResult, compute_metrics, host_tier_metrics
from daopsim.simulator.run_costs import graph_replays, runtime_cost_model
from daopsim.simulator.run_notes import cpu_layers_note, run_notes, small_budget_note
from daopsim.simulator.run_params import (
    RunRequest,
    declared_values,
    docstring_lines,
    make_request,
)
from daopsim.simulator.runtime_profiles import RuntimeProfile, get_runtime
from daopsim.simulator.scheduler import step_oracle
from daopsim.simulator.serving import Serving, serving_plan
from daopsim.simulator.serving_summary import request_table, summarise
from daopsim.simulator.trace import (
    SequenceRouting,
    TraceMeta,
    checked_sequence_ids,
    iter_sequences,
    previous_token_view,
    read_meta,
)
from daopsim.simulator.trace_cache import model_trace


def _engine_class(name: str, several_gpus: bool = False) -> Any:
    """The engine class for ``--engine``: the core (``fast``) or the SimPy reference."""
    if name == "fast":
        return Engine
    if name == "reference":
        from daopsim.simulator.reference import MultiGpuReference, ReferenceEngine

        return MultiGpuReference if several_gpus else ReferenceEngine
    raise UserError(f"unknown engine {name!r} (choose 'fast' or 'reference')")


def _multi_gpu_config(
    profile: HardwareProfile,
    gpus: int,
    mode: str | None,
    pol: Policy,
    rt: RuntimeProfile,
    placement: str | None = None,
) -> Any:
    """The run's multi-GPU setting (None for one GPU); refuses what it does not model."""
    from daopsim.simulator.multigpu import check_config

    mg = check_config(profile, gpus, mode, placement)
    if mg is None:
        return None
    if profile.link.unified:
        raise UserError(
            f"profile {profile.name!r} has unified memory: --gpus > 1 needs a multi-GPU PCIe "
            "profile (--hw), or give --gpus 1"
        )
    return mg


def _resolve_hw(hw: str | os.PathLike[str] | HardwareProfile) -> HardwareProfile:
    return hw if isinstance(hw, HardwareProfile) else load_profile(str(hw))


def provenance(trace_path: Path, profile: HardwareProfile) -> dict[str, str]:
    """What a result was made from: the daopsim version and the trace and profile SHA-256."""
    from daopsim.simulator.fingerprints import daopsim_version, file_sha256, profile_sha256

    return {
        "daopsim_version": daopsim_version(),
        "trace_sha256": file_sha256(trace_path),
        "profile_sha256": profile_sha256(profile),
    }


def _recorder(record: bool | str | os.PathLike[str] | Recorder) -> Recorder | None:
    """The run's recorder for ``simulate(record=...)``: None, in memory, or streaming to a
    file (checked before the run: a bad destination fails at once)."""
    if isinstance(record, Recorder):
        return record
    if isinstance(record, bool):
        return Recorder() if record else None
    return Recorder(check_output_file(record, "record"))


def _finish_timeline(recorder: Recorder | None) -> Any:
    """The timeline for ``RunResult``: a DataFrame, or the path of a streamed one."""
    if recorder is None:
        return None
    if recorder.path is not None:
        return recorder.finish()
    return recorder.timeline()


def simulate(*args: Any, **kwargs: Any) -> RunResult:
    """Run one policy on one machine over a trace; see docs/metrics.md for the result.

    The keywords are the declared run parameters (simulator/run_params.py, ``RunRequest``;
    ``simulate("lru", "a6000-pcie4", "ci-small")`` gives the first ones by position):

    {params}

    ``calibration``: None (held-out sequences of the trace, for a policy that uses calibration
    counts), ``"none"``, ``"self"`` (in-sample) or the path of another trace. ``seed`` picks the
    evaluated sequences when ``sequences`` is fewer than the pool. ``engine="reference"`` is
    the plain-SimPy model of the same rules (docs/architecture.md). Experts that do not fit the
    host-memory budget are read from the profile's NVMe drive (docs/serving.md, "An SSD
    tier"). With ``gpus`` > 1 the budget (``cache_ratio``, ``gpu_experts`` or what fits) is per
    GPU. ``record`` given a path streams the timeline to that Parquet file (memory stays flat;
    ``RunResult.timeline`` reads it back when asked; simulator/recorder.py).
    """
    req = make_request(args, kwargs)
    inp = resolve_inputs(req)
    size = size_run(inp)
    data = load_data(inp, size)
    run = build_run(inp, size, data)
    stats, timeline = execute(inp, data, run)
    return collect(inp, size, data, run, stats, timeline)


def _signature() -> inspect.Signature:
    """``simulate()``'s signature as the declaration gives it (for help() and notebooks)."""
    params = inspect.signature(RunRequest).parameters.values()
    return inspect.Signature(list(params), return_annotation="RunResult")


simulate.__signature__ = _signature()  # type: ignore[attr-defined]


simulate.__doc__ = (simulate.__doc__ or "").replace("    {params}", docstring_lines())


# -- the stages of a run ---------------------------------------------------------------------
@dataclass
class RunInputs:
    """The run's inputs resolved (stage 1): the trace and its sequences, the model at its
    precisions, the machine, the policy, its runtime and cost model, the host tier and the
    GPUs, and where calibration data comes from."""

    req: RunRequest
    trace_path: Path
    meta: TraceMeta
    model: Any
    profile: HardwareProfile
    pol: Policy
    rt: RuntimeProfile
    costs: CostModel
    host_tier: Any
    mg: Any
    #: ``held-out``, ``none``, ``self`` or a path; the external calibration trace, if any
    mode: str = "none"
    ext_cal: Path | None = None
    arrivals: list[Arrival] | None = None
    eval_ids: list[int] = field(default_factory=list)
    cal_ids: list[int] = field(default_factory=list)
    wants_cal: bool = False
    wants_pop: bool = False
    uses_view: bool = False
    stand_in: bool = False


@dataclass
class RunSize:
    """What fits (stage 2): KV tokens reserved, the expert budget, CPU-resident layers, and
    the runtime and cost model once CUDA-graph replay is known."""

    kv_reserve: int
    total: int
    fit: ExpertFit
    budget: int
    n_cpu_layers: int
    rt: RuntimeProfile
    costs: CostModel
    #: experts the policy keeps resident whatever the budget (None: it fills the budget)
    fixed: int | None = None

    @property
    def memory_experts(self) -> int:
        """Resident experts the GPU memory holds: the policy's fixed count, else the budget."""
        return self.budget if self.fixed is None else min(self.fixed, self.budget)


@dataclass
class RunData:
    """What the run reads before it starts (stage 3): calibration counts, the serving plan,
    the oracle of a clairvoyant policy, and the evaluation sequences when a small trace's
    earlier read already assembled them."""

    inp: RunInputs
    calib: np.ndarray | None = None
    calib_pre: np.ndarray | None = None
    cal_eams: list[np.ndarray] = field(default_factory=list)
    in_sample: bool = False
    #: routing digests of another trace's calibration sequences, and the evaluated sequences
    #: found among them (an overlap makes the calibration partly in-sample)
    cal_digests: set[bytes] | None = None
    cal_overlap: set[int] = field(default_factory=set)
    stash: dict[int, SequenceRouting] | None = None
    plan: Serving | None = None
    oracle: Oracle | None = None

    def sequences(self) -> Iterator[SequenceRouting]:
        """The evaluation sequences in file order (the arrays are only read); each is checked
        against another trace's calibration sequences when there are some."""
        inp = self.inp
        if self.stash is not None:  # read (and checked) by an earlier pass
            yield from self.stash.values()
            return
        for r in iter_sequences(inp.trace_path, inp.meta, sequences=set(inp.eval_ids)):
            if self.cal_digests and routing_digest(r) in self.cal_digests:
                self.cal_overlap.add(int(r.seq_id))
            yield r


@dataclass
class Run:
    """The engine built for the run (stage 4), with its policy (one instance per GPU behind a
    ``ShardedPolicy`` on several GPUs), its budget and its recorder; ``done`` and
    ``no_prefill`` count the sequences as they finish."""

    engine: Any
    pol: Policy
    budget: int
    recorder: Recorder | None
    done: int = 0
    no_prefill: int = 0


def resolve_inputs(req: RunRequest) -> RunInputs:
    """Stage 1: the trace, the model at its precisions, the machine, the policy and its
    runtime, the cost model, the host tier, the GPUs; then the sequences."""
    # each value was checked as declared when the request was made (run_params.check_declared)
    trace = model_trace(req.model, req.trace) if req.model is not None else req.trace
    trace_path = resolve_trace(trace)
    meta = read_meta(trace_path)
    model = meta.model.with_precision(req.dtype, req.host_dtype, req.nonexpert_dtype)
    profile = _resolve_hw(req.hw)
    if isinstance(req.policy, Policy):
        pol = req.policy
        if req.policy_options:
            raise UserError("policy_options cannot be combined with a policy instance")
        check_declarations(pol)
    else:
        pol = construct_policy(get_policy_class(req.policy), req.policy_options)
    rt = get_runtime(pol.runtime_profile if req.runtime is None else req.runtime)
    costs: CostModel = runtime_cost_model(profile, model, rt)
    host_tier = host_tier_config(
        profile, costs, req.host_memory_gb, req.ssd_path, pol.resources().ssd_access
    )
    mg = _multi_gpu_config(profile, req.gpus, req.multi_gpu, pol, rt, req.expert_placement)
    if mg is not None and host_tier is not None:
        raise UserError(
            "a host-memory budget (--host-memory-gb or the profile's cpu.memory_gb: the SSD "
            "tier) with --gpus > 1 is not supported yet; give --gpus 1 or a profile without "
            "cpu.memory_gb"
        )
    inp = RunInputs(req, trace_path, meta, model, profile, pol, rt, costs, host_tier, mg)
    choose_sequences(inp)
    return inp


def choose_sequences(inp: RunInputs) -> None:
    """The evaluated sequences and where calibration counts come from (held-out sequences,
    none, the evaluated ones, or another trace); the arrival file's sequences; the
    one-layer-early view the policy may need."""
    req, meta, pol = inp.req, inp.meta, inp.pol
    # the metadata counts feed the memory budget: check them against the rows first
    ids = checked_sequence_ids(inp.trace_path, meta)
    inp.wants_cal = pol.uses_calibration()
    # a balanced expert placement needs popularity counts: held-out sequences by default
    inp.wants_pop = inp.mg is not None and inp.mg.placement == "balanced"
    cal = req.calibration
    mode = "none" if cal is None and not (inp.wants_cal or inp.wants_pop) else cal
    inp.mode = "held-out" if mode is None else str(mode)
    inp.ext_cal = None if inp.mode in ("held-out", *CALIBRATION_MODES) else Path(inp.mode)
    serving = req.serving
    if serving is not None and serving.arrivals is not None:
        if req.sequences is not None:
            raise UserError("give --sequences or --arrivals, not both (the file names them)")
        inp.arrivals = read_arrivals(serving.arrivals)
    if req.evaluate is not None:
        missing = sorted(set(req.evaluate) - set(ids))
        if missing:
            raise UserError(f"{inp.trace_path}: no sequence {missing[0]} to evaluate")
        inp.eval_ids, inp.cal_ids = [s for s in ids if s in set(req.evaluate)], []
    else:
        inp.eval_ids, inp.cal_ids = split_sequences(
            meta, ids, req.sequences, inp.ext_cal is not None,
            hold_out=inp.mode == "held-out", seed=req.seed,
        )  # fmt: skip
    if inp.arrivals is not None:  # the file names the evaluated sequences
        assert serving is not None
        known, held = set(ids), set(inp.cal_ids)
        for a in inp.arrivals:
            if a.sequence not in known or a.sequence in held:
                why = "is held out for calibration" if a.sequence in held else "is not in the trace"
                raise UserError(
                    f"{serving.arrivals}: row {a.row}: field sequence: sequence {a.sequence} {why}"
                )
        inp.eval_ids = sorted({a.sequence for a in inp.arrivals})
    if inp.mode == "self":
        inp.cal_ids = list(inp.eval_ids)
    inp.uses_view = pol.uses_lookahead()
    if inp.uses_view and req.lookahead == "recorded" and not meta.early_view_recorded:
        raise UserError(
            f"{inp.trace_path}: the trace does not record the one-layer-early view, which "
            f"policy {pol.name!r} needs; pass --lookahead previous-token to use the previous "
            "token's experts at the same layer instead"
        )
    inp.stand_in = inp.uses_view and req.lookahead == "previous-token"


def size_run(inp: RunInputs) -> RunSize:
    """Stage 2: what fits on the GPU (the budget asked for, or the most that fits), the
    CPU-resident layers, and CUDA-graph replay of one-GPU one-sequence runs."""
    req, pol, costs, model = inp.req, inp.pol, inp.costs, inp.model
    kv_reserve = trace_context(inp.meta)  # KV tokens reserved before the slots are sized
    if req.serving is not None:
        kv_reserve = serving_kv_reserve(req.serving, model, kv_reserve)
    budget = requested_budget(req.cache_ratio, req.gpu_experts, model.total_experts)
    spec = pol.resources()
    fit = expert_fit(costs, policy_buffers(pol), kv_reserve, spec)
    if spec.workspace_gb is not None:  # the runtime's own compute buffers replace the profile's
        freed = (inp.profile.gpu.workspace_gb - spec.workspace_gb) * 1e9
        fit = replace(fit, free_bytes=fit.free_bytes + freed)
    n_cpu = cpu_resident_layers(spec, costs, fit, kv_reserve)
    if n_cpu:  # a CPU-resident layer's non-expert weights and KV cache live in host memory
        freed = n_cpu * costs.cpu_layer_freed_bytes(kv_reserve)
        fit = replace(fit, free_bytes=fit.free_bytes + freed)
    fixed = fixed_residency(pol, model)
    if spec.unlimited_memory:
        budget = model.total_experts  # the all-GPU bound: memory is not modelled
    elif fixed is not None:
        # the policy's options fix what it keeps resident: a budget it does not fill need
        # not fit the machine, only what it keeps (and the run must start at all)
        check_fit(fit, inp.profile.name, None)
        if fixed > fit.max_experts:
            raise DoesNotFit(
                fit.max_experts,
                f"policy {pol.name!r} keeps {fixed} experts of {model.name} resident by its "
                f"options ({options_text(pol)}); they do not fit in {inp.profile.name}'s GPU "
                f"memory (at most {fit.max_experts} after non-expert weights, KV cache and "
                f"{_buffers(fit.buffers)})",
            )
        budget = fit.max_experts if budget is None else budget
    else:
        check_fit(fit, inp.profile.name, budget, by_ratio=req.cache_ratio is not None)
        budget = fit.max_experts if budget is None else budget
    if spec.gpu_blocks == -1:
        # as many whole GPU layers as fit: a given expert budget can hold fewer than memory
        n_cpu = max(n_cpu, model.moe_layers - budget // model.experts)
    rt = inp.rt
    if graph_replays(rt, spec, n_cpu, budget, model.total_experts, inp.mg, req.serving):
        # one GPU split, one sequence: the one-token step is captured as a CUDA graph
        costs = runtime_cost_model(inp.profile, model, rt, graph=True)
        rt = rt.graph_replayed()
    if rt.logits_to_host and n_cpu == 0:
        # the output matrix runs on the GPU (llama.cpp puts it there only with every layer):
        # each pass ends with its logits' copy to the host (docs/cost-model.md)
        rt = rt.with_logits_copy(costs.logits_copy_s())
    if inp.mg is not None:
        _check_several_gpus(pol, n_cpu)
    return RunSize(kv_reserve, model.total_experts, fit, budget, n_cpu, rt, costs, fixed)


def _check_several_gpus(pol: Policy, n_cpu_layers: int) -> None:
    """What several GPUs do not model, refused before any work."""
    if n_cpu_layers:
        raise UserError(
            f"policy {pol.name!r} keeps {n_cpu_layers} layers on the CPU, which --gpus > 1 does "
            "not support yet; give --gpus 1, or --gpu-experts / --cache-ratio for every layer "
            "where they fit"
        )
    if pol.resources().nonexpert_streamed:
        off = " or --policy-opt stream_nonexpert=false" if "stream_nonexpert" in pol.params else ""
        raise UserError(
            f"policy {pol.name!r} streams its non-expert weights from the host (ZeRO-3), which "
            f"--gpus > 1 does not model; give --gpus 1{off}"
        )
    if pol.resources().one_stream:
        raise UserError(
            f"policy {pol.name!r} issues its copies on its kernels' stream (one_stream), which "
            "the multi-GPU executors do not model"
        )
    if pol.resources().low_bit_slots:
        raise UserError(
            f"policy {pol.name!r} caches experts in slots of their low-bit copy's size "
            "(low_bit_slots), which the multi-GPU executors do not model; give --gpus 1"
        )


def load_data(inp: RunInputs, size: RunSize) -> RunData:
    """Stage 3: calibration counts, the serving plan and a clairvoyant policy's oracle."""
    data = RunData(inp)
    calibrate(data)
    req = inp.req
    if req.serving is not None:
        data.plan = serving_plan(
            req.serving, inp.trace_path, inp.meta, inp.eval_ids, inp.arrivals, size.fit,
            size.memory_experts, size.kv_reserve, inp.pol.resources().unlimited_memory,
            inp.stand_in, req.seed,
        )  # fmt: skip
    if inp.pol.clairvoyant:
        data.oracle = make_oracle(data)
    return data


def calibrate(data: RunData) -> None:
    """Calibration counts for a policy that uses them: from the held-out sequences (a small
    trace's read also assembling the evaluation sequences), or from another trace."""
    inp = data.inp
    pol, model = inp.pol, inp.model
    if not inp.wants_cal:
        return
    if inp.mode == "none":
        raise UserError(
            f"policy {pol.name!r}"
            + (f" with initial={pol.options['initial']}" if "initial" in pol.options else "")
            + " uses calibration data and --calibration none gives none; use held-out "
            "sequences (the default), --calibration self or --calibration PATH"
        )
    if inp.ext_cal is not None:
        cal_path = resolve_trace(inp.ext_cal)
        data.in_sample = same_content(cal_path, inp.trace_path)
        cal_meta = read_meta(cal_path)
        if (cal_meta.model.moe_layers, cal_meta.model.experts) != (model.moe_layers, model.experts):
            raise UserError(
                f"{cal_path}: calibration trace is for {cal_meta.model.name}, "
                f"the evaluated trace for {model.name}"
            )
        ids = checked_sequence_ids(cal_path, cal_meta)
        # the same bytes are in-sample as a whole; otherwise look for shared sequences
        data.cal_digests = None if data.in_sample else set()
        data.calib, data.calib_pre = calibration_counts(
            cal_path, cal_meta, ids, data.cal_eams, digests=data.cal_digests
        )
    elif inp.cal_ids:
        if inp.req.serving is None and small_trace(inp.meta):
            data.stash = {}  # this pass also assembles the evaluation sequences
        data.calib, data.calib_pre = calibration_counts(
            inp.trace_path, inp.meta, inp.cal_ids, data.cal_eams, data.stash, set(inp.eval_ids)
        )
    else:
        raise UserError(
            f"policy {pol.name!r} needs calibration data: the trace has no "
            "calibration sequences; pass --calibration PATH or --calibration self"
        )


def make_oracle(data: RunData) -> Oracle:
    """The future accesses a clairvoyant policy may read: of the serving plan's steps, or of
    the evaluation sequences (a small trace's read keeping them for the run)."""
    inp = data.inp
    oracle = Oracle(inp.model.moe_layers, inp.model.experts)
    plan, serving = data.plan, inp.req.serving
    if plan is not None:
        if serving is not None and serving.timed_arrivals:
            raise UserError(
                f"policy {inp.pol.name!r} is clairvoyant: with requests arriving over time the "
                "step order depends on timing, so it has no oracle; use --batch without "
                "--arrival-rate/--arrivals"
            )
        step_oracle(plan.requests, plan.config.batch, plan.config.continuous,
                    plan.sched.kv_capacity, oracle, plan.config)  # fmt: skip
        return oracle
    if data.stash is None and small_trace(inp.meta):
        # one pass over the file instead of two, as the calibration read does
        data.stash = {int(r.seq_id): r for r in data.sequences()}
    for r in data.sequences():
        oracle.add(r)
    return oracle


def build_run(inp: RunInputs, size: RunSize, data: RunData) -> Run:
    """Stage 4: the engine over the machine, with the policy (one instance per GPU on several
    GPUs), its calibration, oracle, recorder and serving plan."""
    pol, budget, multi_kw = inp.pol, size.budget, {}
    several = inp.mg is not None
    if several:
        from daopsim.simulator import multigpu

        placement = multigpu.Placement(
            inp.mg, inp.model.moe_layers, inp.model.experts, popularity(data)
        )
        budgets = multigpu.split_budget(placement, budget)
        budget = sum(budgets)
        pol = multigpu.ShardedPolicy(pol, placement, budgets)
        multi_kw = {"placement": placement, "budgets": budgets}
    slots, spec = budget, pol.resources()
    if spec.low_bit_slots and spec.low_bit_dtype is not None:  # one GPU (checked in size_run)
        # slots of the low-bit copy's size in the same memory (SliceMoE's bit slices); the
        # run still reports the budget in full-precision experts
        low = size.costs.low_bit_expert_bytes(spec.low_bit_dtype)
        slots = math.floor(budget * low_bit_slots_per_expert(size.costs.expert_bytes, low))
    recorder = _recorder(inp.req.record)
    engine = _engine_class(inp.req.engine, several)(
        pol, inp.model, size.costs, slots,
        calibration=data.calib, calibration_prefill=data.calib_pre,
        calibration_sequences=tuple(data.cal_eams) if inp.wants_cal else None,
        oracle=data.oracle, recorder=recorder, seed=inp.req.seed, runtime=size.rt,
        host_tier=inp.host_tier, cpu_layers=size.n_cpu_layers, **multi_kw,
    )  # fmt: skip
    engine.serving = data.plan
    return Run(engine, pol, budget, recorder)


def popularity(data: RunData) -> np.ndarray | None:
    """Selection counts per (layer, expert), prompt and decode together, for a balanced
    expert placement (the policy's calibration counts, or counted here); None otherwise."""
    inp = data.inp
    if not inp.wants_pop:
        return None
    pop, pop_pre = data.calib, data.calib_pre
    if pop is None:  # the policy itself takes no calibration: count them here only
        if inp.ext_cal is not None:
            p_path = resolve_trace(inp.ext_cal)
            p_meta = read_meta(p_path)
            pop, pop_pre = calibration_counts(p_path, p_meta, checked_sequence_ids(p_path, p_meta))
        elif inp.cal_ids:
            pop, pop_pre = calibration_counts(inp.trace_path, inp.meta, inp.cal_ids)
    if pop is None:
        return None
    total: np.ndarray = (pop + (0 if pop_pre is None else pop_pre)).sum(axis=0)
    return total


def execute(inp: RunInputs, data: RunData, run: Run) -> tuple[Any, Any]:
    """Stage 5: the run, streaming the evaluation sequences in file order; returns its
    statistics and the timeline (a failed run leaves no timeline file)."""
    progress = inp.req.progress

    def seqs() -> Iterator[SequenceRouting]:
        for r in data.sequences():
            yield previous_token_view(r) if inp.stand_in else r

    def tick(r: SequenceRouting) -> None:
        run.done += 1
        run.no_prefill += r.n_prefill == 0
        if progress is not None:
            progress(run.done, len(inp.eval_ids))

    try:
        stats = run.engine.run(seqs(), on_sequence=tick)
        timeline = _finish_timeline(run.recorder)
    except BaseException:
        if run.recorder is not None:
            run.recorder.discard()  # a failed run leaves no timeline file, nor its parts
        raise
    return stats, timeline


def collect(
    inp: RunInputs, size: RunSize, data: RunData, run: Run, stats: Any, timeline: Any
) -> RunResult:
    """Stage 6: metrics, the run's configuration and notes, serving tables, the result."""
    counters, model, recorder = stats.counters, inp.model, run.recorder
    metrics = compute_metrics(stats, inp.profile, stats.after, stats.servers)
    if stats.host_tier is not None:
        metrics.update(host_tier_metrics(stats, stats.after.get("ssd", 0.0)))
    if not inp.meta.weights_recorded:
        # the trace has no gate weights: the 1/k stand-in would make this look measured
        metrics["gate_mass_preserved"] = None
        metrics["low_precision_gate_mass"] = None
    serving_doc = requests = None
    plan = data.plan
    if plan is not None:
        serving_doc = summarise(plan, stats.e2e, plan.sched.kv_capacity, model.kv_bytes_per_token)
        requests = request_table(plan.requests, plan.config)
    return RunResult(
        serving=serving_doc,
        requests=requests,
        config=run_config(inp, size, data, run),
        metrics=metrics,
        per_layer_hit_rate=(
            counters.hits_per_layer / np.maximum(1, counters.accesses_per_layer)
        ).tolist(),
        timeline=timeline,
        occupancy=recorder.occupancy_frame() if recorder is not None else None,
        token_latency=np.asarray(counters.token_latency),
        ttft=np.asarray(counters.ttft),
    )


def run_config(inp: RunInputs, size: RunSize, data: RunData, run: Run) -> dict[str, Any]:
    """The run's configuration as ``RunResult.config`` reports it (docs/metrics.md)."""
    req, pol, model, trace_path = inp.req, run.pol, inp.model, inp.trace_path
    notes = run_notes(pol, inp.meta, run.no_prefill, len(inp.eval_ids), inp.stand_in)
    if pol.resources().gpu_blocks is not None:
        notes.append(cpu_layers_note(model, size.n_cpu_layers))
    low = small_budget_note(inp.pol, model, run.budget)
    if low:
        notes.append(low)
    cal_label = calibration_label(inp, data, notes)
    uses_view = inp.uses_view
    config = {
        "policy": pol.name,
        "policy_options": dict(pol.options),
        "hw": inp.profile.name,
        "model": model.name,
        "dtype": model.dtype,
        "host_dtype": model.host_precision,
        "nonexpert_dtype": model.nonexpert_dtype,
        "trace": str(trace_path.stem if trace_path.parent.name == "traces" else trace_path),
        "gpu_experts": run.budget,
        "cache_ratio": run.budget / size.total,
        "total_experts": size.total,
        "max_gpu_experts": size.fit.max_experts,
        # experts the policy keeps resident whatever the budget (None: it fills the budget)
        "fixed_residency": size.fixed,
        "sequences": len(inp.eval_ids),
        "sequence_ids": list(inp.eval_ids),
        "calibration_sequences": (
            len(inp.cal_ids) if inp.ext_cal is None and inp.wants_cal else None
        ),
        "calibration": cal_label,
        "lookahead": (
            ("previous-token (stand-in)" if inp.stand_in else "recorded")
            if uses_view
            else "not used"
        ),
        "notes": notes,
        "seed": req.seed,
        "engine": req.engine,
        "batch": req.serving.batch if req.serving is not None else None,
        "runtime": size.rt.to_dict(),
        # a system with unlimited memory (every expert placed) is not realisable, whoever
        # declares it
        "bound": bool(pol.clairvoyant or pol.bound or pol.resources().unlimited_memory),
        "clairvoyant": bool(pol.clairvoyant),
        "cost_sources": size.costs.sources(),
        "gpus": req.gpus,
        "multi_gpu": run.engine.multi_metrics() if inp.mg is not None else None,
        # with several GPUs `gpu_experts` is the total; this is one GPU's budget
        "gpu_experts_per_gpu": size.budget if inp.mg is not None else None,
        **provenance(trace_path, inp.profile),
    }
    config.update(declared_values(req, config))
    tier = inp.host_tier
    if tier is not None:  # only then: runs without a host budget keep their config
        config["host_memory_gb"] = tier.budget_bytes / 1e9
        config["ssd_path"] = tier.path
        config["host_expert_capacity"] = tier.capacity
        config["ssd"] = inp.profile.ssd.name if inp.profile.ssd is not None else None
    return config


def calibration_label(inp: RunInputs, data: RunData, notes: list[str]) -> str:
    """What the run's calibration counts came from, for the config (in-sample named)."""
    if not inp.wants_cal:
        return "none" if inp.req.calibration == "none" else "not used"
    if inp.mode == "self":
        return "self (in-sample)"
    if data.in_sample:
        # the "other" trace is this trace's bytes: its counts include the evaluated sequences
        notes.append(
            f"--calibration {inp.ext_cal} has the evaluated trace's content: its counts include "
            "the evaluated sequences (in-sample, like --calibration self)"
        )
        return f"{inp.ext_cal} (in-sample: the evaluated trace itself)"
    if data.cal_overlap:
        n, first = len(data.cal_overlap), min(data.cal_overlap)
        notes.append(
            f"--calibration {inp.ext_cal} holds {n} of the evaluated sequences (the first: "
            f"sequence {first}) with the same routing: its counts include them (partly "
            "in-sample)"
        )
        return f"{inp.ext_cal} (partly in-sample: {n} evaluated sequence{'s' * (n != 1)})"
    return str(inp.ext_cal) if inp.ext_cal is not None else inp.mode
