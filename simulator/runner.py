"""``simulate()``: one run of one policy on one machine over a trace, as used by the CLI,
notebooks and sweeps.

It resolves the trace, profile and policy, splits the trace into evaluation and calibration
sequences, computes the GPU expert budget, builds calibration statistics (and the oracle for
clairvoyant policies), runs the engine and returns a :class:`~daopsim.simulator.results.RunResult`.
"""

from __future__ import annotations

import bisect
import hashlib
import inspect
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from daopsim.policies.base import Policy, ResourceSpec
from daopsim.policies.placement import low_bit_slots_per_expert
from daopsim.policies.registry import get_policy_class
from daopsim.simulator.boundary import check_declarations, construct_policy
from daopsim.simulator.core.loop import Engine
from daopsim.simulator.costs import CostModel, DeviceHostCosts, cost_model
from daopsim.simulator.data import resolve_trace
from daopsim.simulator.errors import DoesNotFit, UserError, check_seed
from daopsim.simulator.hardware import HardwareProfile, load_profile
from daopsim.simulator.hosttier import host_tier_config
from daopsim.simulator.output import check_output_file
from daopsim.simulator.recorder import Recorder
from daopsim.simulator.results import RunResult, compute_metrics, host_tier_metrics
from daopsim.simulator.run_params import RunRequest, docstring_lines, make_request
from daopsim.simulator.runtime_profiles import RuntimeProfile, get_runtime
from daopsim.simulator.serving import (
    Arrival,
    Request,
    Serving,
    ServingConfig,
    dense,
    poisson_arrivals,
    read_arrivals,
    request_table,
    step_oracle,
    summarise,
    trim,
)
from daopsim.simulator.trace import (
    SequenceRouting,
    TraceMeta,
    checked_sequence_ids,
    iter_sequences,
    previous_token_view,
    read_meta,
    sequence_ids,  # noqa: F401  (re-exported: runner.sequence_ids stays importable)
)
from daopsim.simulator.trace_cache import model_trace

#: ``calibration=`` values that are not paths (see docs/metrics.md, "Calibration").
CALIBRATION_MODES = ("none", "self")
#: a trace of at most this many rows has its evaluation sequences assembled by the calibration
#: read and kept in memory for the run (a few tens of MB at most), instead of read twice
_STASH_ROWS = 1 << 20
#: ``lookahead=`` choices: the trace's recorded view, or the previous-token stand-in.
LOOKAHEAD_CHOICES = ("recorded", "previous-token")


def select_sequences(pool: list[int], n_eval: int | None, seed: int) -> list[int]:
    """``n_eval`` ids of ``pool`` chosen by ``seed``, in file order.

    Seed 0 takes the first ``n_eval`` (the selection before seeds selected anything); another
    seed takes a seeded random sample without replacement. ``None`` takes the whole pool.
    """
    if n_eval is None:
        return list(pool)
    if n_eval <= 0:
        raise UserError(f"--sequences must be positive, got {n_eval}")
    if n_eval > len(pool):
        raise UserError(
            f"--sequences {n_eval}: the trace has only {len(pool)} evaluation sequences"
        )
    if seed == 0 or n_eval == len(pool):
        return pool[:n_eval]
    picked = np.random.default_rng(seed).choice(len(pool), size=n_eval, replace=False)
    return [pool[i] for i in sorted(picked.tolist())]


def split_sequences(
    meta: TraceMeta,
    seq_ids: list[int],
    n_eval: int | None,
    external_calibration: bool,
    hold_out: bool = True,
    seed: int = 0,
) -> tuple[list[int], list[int]]:
    """Evaluation ids (file order) and held-out calibration ids (disjoint).

    With ``hold_out`` (a policy that uses calibration counts from this trace), the trace's
    declared ``calibration_sequences`` are never evaluated; without a declaration the last
    quarter of the sequences (at least one, when there are two or more) is held out, unless
    an external calibration trace is given. Without ``hold_out`` every sequence is in the
    evaluation pool. ``n_eval`` and ``seed`` then pick from the pool (:func:`select_sequences`).
    """
    declared = [s for s in meta.calibration_sequences if s in set(seq_ids)]
    if not hold_out or external_calibration:
        calib = []
    elif declared:
        calib = declared
    elif len(seq_ids) < 2:
        calib = []
    else:
        calib = seq_ids[-max(1, len(seq_ids) // 4) :]
    held = set(calib)
    evaluation = select_sequences([s for s in seq_ids if s not in held], n_eval, seed)
    if not evaluation:
        raise UserError("the trace has no evaluation sequences (all are calibration)")
    return evaluation, calib


def calibration_counts(
    path: Path,
    meta: TraceMeta,
    ids: list[int],
    per_sequence: list[np.ndarray] | None = None,
    keep: dict[int, SequenceRouting] | None = None,
    keep_ids: set[int] | None = None,
    digests: set[bytes] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Decode-time and prefill-time selection counts [layers, experts] over ``ids``.

    With ``per_sequence`` (a list), each sequence's own counts (prompt and decode together,
    file order) are appended to it: the request-level activation matrices of MoE-Infinity.
    With ``keep`` and ``keep_ids``, the sequences of ``keep_ids`` are stored in ``keep`` as
    this read assembles them (file order): the same pass over the file serves a later read
    of them (the evaluation sequences of a small trace; see ``_STASH_ROWS``). With
    ``digests``, each counted sequence's :func:`routing_digest` is added to it.
    """
    n_layers, n_exp = meta.model.moe_layers, meta.model.experts
    dec = np.zeros((n_layers, n_exp), dtype=np.int64)
    pre = np.zeros((n_layers, n_exp), dtype=np.int64)
    wanted = set(ids)
    kept = keep_ids if keep is not None and keep_ids else set()
    for r in iter_sequences(path, meta, sequences=wanted | kept):
        sid = int(r.seq_id)
        if sid in kept:
            assert keep is not None
            keep[sid] = r
        if sid not in wanted:
            continue
        if digests is not None:
            digests.add(routing_digest(r))
        own = np.zeros((n_layers, n_exp), dtype=np.int64)
        for counts, part in ((pre, r.experts[: r.n_prefill]), (dec, r.experts[r.n_prefill :])):
            if part.size == 0:
                continue
            flat = (np.arange(n_layers)[None, :, None] * n_exp + part).reshape(-1)
            sel = np.bincount(flat, minlength=n_layers * n_exp).reshape(n_layers, n_exp)
            counts += sel
            own += sel
        if per_sequence is not None:
            per_sequence.append(own)
    return dec, pre


class Oracle:
    """Future accesses for clairvoyant policies: the step of an expert's next use.

    Steps count one per prefill pass and one per decode token, in evaluation order (the
    engine's ``View.step``).
    """

    def __init__(self, n_layers: int, n_experts: int) -> None:
        self.steps: list[list[list[int]]] = [
            [[] for _ in range(n_experts)] for _ in range(n_layers)
        ]
        self.n_steps = 0

    def add(self, r: Any) -> None:
        """Append one sequence's accesses."""
        p = r.n_prefill
        if p:
            for layer in range(r.experts.shape[1]):
                for e in np.unique(r.experts[:p, layer, :]).tolist():
                    self.steps[layer][e].append(self.n_steps)
            self.n_steps += 1
        dec = r.experts[p:]
        n_dec, n_layers, k = dec.shape
        if n_dec:
            # each slot's decode steps in (step, layer, rank) order, as a loop over the
            # tokens appending them would: a stable sort of the slots of the flattened rows
            n_exp = len(self.steps[0])
            slot = (np.arange(n_layers)[None, :, None] * n_exp + dec).reshape(-1)
            order = np.argsort(slot, kind="stable")
            steps = (order // (n_layers * k) + self.n_steps).tolist()
            pos = 0
            for i, n in enumerate(np.bincount(slot, minlength=n_layers * n_exp).tolist()):
                if n:
                    self.steps[i // n_exp][i % n_exp].extend(steps[pos : pos + n])
                    pos += n
        self.n_steps += n_dec

    def next_use(self, layer: int, expert: int, after: int) -> float:
        """First step > ``after`` at which (layer, expert) is used, or infinity."""
        lst = self.steps[layer][expert]
        i = bisect.bisect_right(lst, after)
        return float(lst[i]) if i < len(lst) else float("inf")


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


def run_notes(
    pol: Policy, meta: TraceMeta, no_prefill: int, evaluated: int, stand_in: bool
) -> list[str]:
    """One line per way this trace limits what the run models (shown with the results)."""
    notes = []
    if no_prefill:
        which = (
            "has no prefill"
            if no_prefill == evaluated
            else (f"has {no_prefill} of {evaluated} sequences without prefill")
        )
        does_prefill = type(pol).prefill_layer is not Policy.prefill_layer
        what = pol.prefill_note or ("prefill_layer" if does_prefill else "")
        if what:
            notes.append(f"trace {which}: {pol.name}'s {what} did not run for those sequences")
        else:
            notes.append(f"trace {which}: time to first token covers no prompt")
    if stand_in:
        notes.append(
            "look-ahead stand-in: the one-layer-early view is the previous token's experts at "
            "the same layer (--lookahead previous-token)"
        )
    if not meta.weights_recorded:
        notes.append(
            "trace has no gate weights: policies saw 1/k per expert; gate mass not available"
        )
    return notes


def fixed_residency(policy: Policy, model: Any) -> int | None:
    """:meth:`Policy.fixed_residency` of ``policy`` for ``model``, checked: a count, or None
    when the policy fills its budget. A hook that raises or answers something else is the
    policy's fault (a one-line ``PolicyError``)."""
    from daopsim.simulator.boundary import Hooks

    hooks = Hooks(policy)
    got = hooks.call("fixed_residency", policy.fixed_residency, model)
    if got is None:
        return None
    if isinstance(got, bool) or not isinstance(got, int | np.integer) or got < 0:
        raise hooks.error(f"fixed_residency returned {got!r}, expected a count >= 0 or None")
    return int(got)


def options_text(policy: Policy) -> str:
    """The options of ``policy`` that differ from their defaults, as ``k=v`` (or "defaults")."""
    changed = [
        f"{k}={v}"
        for k, v in sorted(policy.options.items())
        if k in policy.params and v != policy.params[k].default
    ]
    return ", ".join(changed) or "its defaults"


def policy_buffers(policy: Policy) -> int:
    """Expert-sized GPU buffers a policy keeps beside its resident experts (temporary buffers
    for TEMP copies plus staging slots for fetches); they come out of the same memory."""
    spec = policy.resources()
    return int(spec.temp_buffers) + int(spec.staging_buffers)


def keeps_nothing_resident(policy: Policy | type[Policy]) -> bool:
    """True for a policy that keeps no expert on the GPU between uses (stream-all): its
    memory budget is scratch space, so a cache ratio means nothing to it."""
    return bool(getattr(policy, "keeps_nothing_resident", False))


def trace_context(meta: TraceMeta) -> int:
    """KV-cache tokens a run reserves: the trace's mean tokens per sequence (at least 1)."""
    tokens = meta.counts.get("prefill_tokens", 0) + meta.counts.get("decode_tokens", 0)
    return int(max(1, tokens) / max(1, meta.counts.get("sequences", 1)))


@dataclass(frozen=True)
class ExpertFit:
    """How many resident experts fit on a machine for a model, a policy and a KV context."""

    model: str
    total_experts: int
    expert_bytes: int
    free_bytes: float  #: GPU bytes left after non-expert weights, workspace and KV cache
    buffers: int  #: the policy's expert-sized buffers, taken from ``free_bytes`` first
    context_tokens: int
    #: unified memory: the host's holdings already taken from ``free_bytes`` (0 otherwise)
    host_bytes: int = 0
    #: unified memory: the host bytes one GPU-resident expert frees, for a system that holds
    #: each expert once (0: the host keeps its copy beside the GPU's; always 0 on a bus)
    refund: int = 0

    def room(self, experts: int, extra: float = 0.0) -> float:
        """Bytes left with ``experts`` resident beside the buffers (``extra`` bytes freed
        elsewhere); negative when they do not fit."""
        used = (self.buffers + experts) * self.expert_bytes - experts * self.refund
        return self.free_bytes + extra - used

    def fits(self, experts: int, extra: float = 0.0) -> bool:
        """Whether ``experts`` resident experts and the buffers fit (``extra`` bytes freed)."""
        if not self.refund:  # whole expert-sized slots, as :attr:`slots` counts them
            return math.floor((self.free_bytes + extra) / self.expert_bytes) - self.buffers >= (
                experts
            )
        return self.room(experts, extra) >= 0

    @property
    def slots(self) -> int:
        """Expert-sized slots in the free memory (negative when the weights do not fit)."""
        return math.floor(self.free_bytes / self.expert_bytes)

    @property
    def max_experts(self) -> int:
        """Resident experts that fit beside the buffers (0 when even those do not fit)."""
        if not self.refund:
            return max(0, min(self.total_experts, self.slots - self.buffers))
        slot = self.expert_bytes - self.refund
        if slot <= 0:  # a resident expert frees at least what it takes: all or none fit
            return self.total_experts if self.fits(self.total_experts) else 0
        left = self.free_bytes - self.buffers * self.expert_bytes
        return max(0, min(self.total_experts, math.floor(left / slot)))

    def weights_fit(self) -> bool:
        """Whether the run can hold its weights at all (buffers aside) with some number of
        resident experts (the room is linear in that number: its best is at 0 or all)."""
        best = max(self.room(0), self.room(self.total_experts))
        return best + self.buffers * self.expert_bytes >= 0

    def max_ratio(self, digits: int = 3) -> float:
        """The largest cache ratio (``digits`` decimals) whose budget fits, or 0 if none does."""
        scale = 10**digits
        k = math.floor((self.max_experts + 0.5) / self.total_experts * scale)
        # checked the way simulate() turns a ratio into a budget: round(ratio x total)
        while k > 0 and round(k / scale * self.total_experts) > self.max_experts:
            k -= 1
        return max(0, k) / scale


def expert_fit(
    costs: CostModel, buffers: int, context_tokens: int, spec: ResourceSpec | None = None
) -> ExpertFit:
    """The one place that decides how many experts fit (``run``, sweeps, ``profiles show``).

    ``spec`` (the policy's resources) says what the host holds on a unified-memory machine: a
    copy of every expert (and HOBBIT's low-bit copies) that the GPU copies come from, or each
    expert once (``ResourceSpec.experts_held_once``); None is the former.
    """
    low = None if spec is None else spec.low_bit_dtype
    host = costs.unified_host_bytes(low)
    return ExpertFit(
        model=costs.model.name,
        total_experts=costs.model.total_experts,
        expert_bytes=costs.expert_bytes,
        free_bytes=costs.free_expert_bytes(context_tokens, host),
        buffers=buffers,
        context_tokens=context_tokens,
        host_bytes=host,
        refund=costs.unified_refund_bytes(spec is not None and spec.experts_held_once),
    )


def cpu_resident_layers(spec: ResourceSpec, costs: CostModel, fit: ExpertFit, kv: int) -> int:
    """Leading MoE layers a spec runs wholly on the CPU (``ResourceSpec.gpu_blocks``).

    N >= 0 GPU blocks leave the first ``moe_layers - N`` MoE layers on the CPU (dense blocks
    are taken to lead, so the last blocks are MoE ones). -1: the fewest CPU layers such that
    every GPU layer's experts fit beside the policy's buffers, once the CPU layers' non-expert
    weights and KV cache (``kv`` tokens) have moved to the host.
    """
    m = costs.model
    g = spec.gpu_blocks
    if g is None:
        return 0
    if g >= 0:
        return m.moe_layers - min(m.moe_layers, g)
    per_layer = costs.cpu_layer_freed_bytes(kv)
    for n in range(m.moe_layers + 1):
        if fit.fits((m.moe_layers - n) * m.experts, n * per_layer):
            return n
    return m.moe_layers


def runtime_cost_model(
    profile: HardwareProfile, model: Any, rt: RuntimeProfile, graph: bool = False
) -> CostModel:
    """The run's cost model: the profile and model with the runtime's CPU kernels, GPU stream
    efficiency (its calibration for the GPU's memory type where it has one), fixed CPU costs,
    fused-MoE constants, GEMM rates (GPU half point, CPU shares of dense and expert products)
    and (``graph``) its CUDA-graph node cost."""
    return cost_model(
        profile,
        model,
        rt.cpu_kernels,
        rt.graph_kernel_us if graph else 0.0,
        rt.gpu_stream_efficiency_on(profile.gpu.memory_type),
        rt.cpu_expert_call_us,
        rt.cpu_layer_us if rt.cpu_kernels == "ggml" else 0.0,
        rt.fused_moe_call_us if rt.fused_moe else 0.0,
        rt.fused_moe_stream_efficiency if rt.fused_moe else 0.0,
        rt.gpu_gemm_half_tokens,
        rt.cpu_gemm_share if rt.cpu_kernels == "ggml" else (),
        device_host(rt),
        rt.cpu_expert_gemm_share if rt.cpu_kernels == "ggml" else (),
    )


def device_host(rt: RuntimeProfile) -> DeviceHostCosts | None:
    """The host time a ``host_device`` runtime adds to its device's work (None otherwise)."""
    if not rt.host_device:
        return None
    return DeviceHostCosts(rt.step_host_us, rt.block_host_us, rt.expert_host_us)


def graph_replays(
    rt: RuntimeProfile,
    spec: ResourceSpec,
    n_cpu_layers: int,
    budget: int,
    total: int,
    mg: object | None,
    serving: object | None,
) -> bool:
    """Whether a run's one-token steps are CUDA-graph replays (docs/cost-model.md, "CUDA-graph
    decode"): a runtime that replays graphs, every layer and expert on one GPU (so the forward
    pass is one GPU split whose graph does not change between tokens), one sequence at a time
    (no serving batch), and either a whole-layer split (llama.cpp ``-ngl``), a runtime that
    graphs every policy's decode (``graph_all_policies``: vLLM, SGLang), or the all-GPU bound
    (``unlimited_memory``: every expert resident, nothing ever moves)."""
    return (
        rt.replays_graphs
        and (spec.gpu_blocks is not None or rt.graph_all_policies or spec.unlimited_memory)
        and n_cpu_layers == 0
        and budget >= total
        and mg is None
        and serving is None
    )


def small_budget_note(pol: Policy, model: Any, budget: int) -> str:
    """The run note of a per-layer cache whose budget holds at most one token's experts per
    layer: every such cache then keeps exactly the last token's experts, so LRU, LFU, Belady
    and the others give the same hits ("" for a larger budget or another kind of policy)."""
    from daopsim.policies.caching import CachingPolicy

    per_layer = budget // max(1, model.moe_layers)
    if not isinstance(pol, CachingPolicy) or per_layer > model.top_k:
        return ""
    return (
        f"budget of {budget} experts is {per_layer} per layer, at most top-k ({model.top_k}): "
        "a per-layer cache then holds only the last token's experts, so every per-layer "
        "caching policy (lru, lfu, belady, ...) gives the same hits here; compare them from "
        f"{(model.top_k + 1) * model.moe_layers} experts ({model.top_k + 1} per layer)"
    )


def cpu_layers_note(model: Any, n_cpu: int) -> str:
    """The run note naming a whole-layer split (``ResourceSpec.gpu_blocks``)."""
    n = model.moe_layers
    if n_cpu == 0:
        return f"layer split: all {n} MoE layers wholly on the GPU"
    if n_cpu == n:
        return f"layer split: all {n} MoE layers wholly on the CPU (non-expert part and experts)"
    return (
        f"layer split: MoE layers 0-{n_cpu - 1} wholly on the CPU (non-expert part and "
        f"experts), {n_cpu}-{n - 1} wholly on the GPU; hidden states cross the link at layer "
        f"{n_cpu}"
    )


def routing_digest(r: SequenceRouting) -> bytes:
    """A digest of a sequence's routing (its prompt length and every token's experts): two
    sequences with equal digests route identically, whatever their ids or files."""
    h = hashlib.sha256(f"{r.n_prefill}:{r.experts.shape}:{r.experts.dtype}".encode())
    h.update(np.ascontiguousarray(r.experts).tobytes())
    return h.digest()


def same_content(a: Path, b: Path) -> bool:
    """Whether two trace files hold the same bytes (a copy under another name counts)."""
    from daopsim.simulator.fingerprints import file_sha256

    if os.path.getsize(a) != os.path.getsize(b):
        return False
    return file_sha256(a) == file_sha256(b)


def check_fit(fit: ExpertFit, machine: str, budget: int | None, by_ratio: bool = False) -> None:
    """Raise :class:`DoesNotFit` when the weights, the buffers or ``budget`` experts do not fit.

    ``budget=None`` asks only whether the run can start at all (non-expert weights, workspace,
    KV cache and the policy's buffers).
    """
    gb = fit.expert_bytes / 1e9
    once = fit.refund > 0  # unified memory, each expert held once
    if once:
        host = (
            f", with every expert held once ({fit.host_bytes / 1e9:.1f} GB at the host's "
            "precision) in the same unified memory"
        )
    elif fit.host_bytes:
        host = (
            f", beside the host's expert copies ({fit.host_bytes / 1e9:.1f} GB) in the same "
            "unified memory"
        )
    else:
        host = ""
    if not fit.weights_fit():
        short = -(max(fit.room(0), fit.room(fit.total_experts)) + fit.buffers * fit.expert_bytes)
        raise DoesNotFit(
            0,
            f"{machine}'s GPU cannot hold {fit.model}'s non-expert weights, workspace and KV "
            f"cache for {fit.context_tokens} tokens{host} ({short / 1e9:.1f} GB short), so no "
            "expert fits",
        )
    if not (fit.fits(0) or fit.fits(fit.total_experts)):
        raise DoesNotFit(
            0,
            f"{machine}'s GPU has room for {fit.slots} {fit.model} experts "
            f"({gb:.2f} GB each) after the non-expert weights, workspace and KV cache{host}, "
            f"fewer than the policy's {_buffers(fit.buffers)}",
        )
    if budget is not None and (budget > fit.max_experts or not fit.fits(budget)):
        limit = (
            f"--cache-ratio <= {fit.max_ratio():.3f}"
            if by_ratio
            else f"--gpu-experts <= {fit.max_experts}"
        )
        raise DoesNotFit(
            fit.max_experts,
            f"{budget} resident experts of {fit.model} ({budget * gb:.1f} GB) do not fit in "
            f"{machine}'s GPU memory: at most {fit.max_experts} experts fit ({limit}) after "
            f"non-expert weights, KV cache and {_buffers(fit.buffers)}{host}",
        )


def serving_kv_reserve(serving: ServingConfig, model: Any, context: int) -> int:
    """KV-cache tokens reserved before the expert slots are sized (docs/serving.md, "GPU
    memory"): ``--kv-cache-gb`` of them, else one mean-length sequence per batch place."""
    per_token = model.kv_bytes_per_token
    if serving.kv_cache_gb is not None:
        if per_token <= 0:
            raise UserError(f"--kv-cache-gb: model {model.name} has no KV-cache size per token")
        return int(serving.kv_cache_gb * 1e9 // per_token)
    return serving.batch * context


def serving_plan(
    serving: ServingConfig,
    trace_path: Path,
    meta: TraceMeta,
    eval_ids: list[int],
    arrivals: list[Arrival] | None,
    fit: ExpertFit,
    budget: int,
    kv_reserve: int,
    unlimited: bool,
    stand_in: bool,
    seed: int,
) -> Serving:
    """The requests of a serving run, their arrival times and the KV-cache capacity.

    KV capacity: ``--kv-cache-gb`` exactly; otherwise the memory the expert slots and the
    policy's buffers leave (at least the reserve); unbounded for a policy whose memory is not
    modelled (all-gpu). Any request longer than the cache is refused before the run.
    """
    model = meta.model
    routes: dict[int, SequenceRouting] = {}
    for r in iter_sequences(trace_path, meta, sequences=set(eval_ids)):
        r = previous_token_view(r) if stand_in else r
        routes[int(r.seq_id)] = dense(r, model.experts)
    reqs: list[Request] = []
    if arrivals is not None:
        for a in arrivals:
            r = routes[a.sequence]
            for name, got, have in (
                ("prompt_tokens", a.prompt_tokens, r.n_prefill),
                ("output_tokens", a.output_tokens, r.n_decode),
            ):
                if got > have:
                    raise UserError(
                        f"{serving.arrivals}: row {a.row}: field {name}: {got} is more than "
                        f"sequence {a.sequence} has ({have})"
                    )
            reqs.append(
                Request(
                    a.request_id,
                    a.sequence,
                    a.arrival_s,
                    a.prompt_tokens,
                    a.output_tokens,
                    trim(r, a.prompt_tokens, a.output_tokens, a.request_id),
                )
            )
    else:
        times = (
            poisson_arrivals(len(eval_ids), serving.arrival_rate, seed).tolist()
            if serving.arrival_rate is not None
            else [0.0] * len(eval_ids)
        )
        for sid, t in zip(eval_ids, times, strict=True):
            r = routes[sid]
            reqs.append(Request(sid, sid, t, r.n_prefill, r.n_decode, r))
    per_token = model.kv_bytes_per_token
    capacity: int | None
    if unlimited or per_token <= 0:
        capacity = None
    elif serving.kv_cache_gb is not None:
        capacity = kv_reserve
    else:
        left = fit.room(budget)
        capacity = kv_reserve + max(0, int(left // per_token))
    if capacity is not None:
        fix = (
            "raise --kv-cache-gb"
            if serving.kv_cache_gb is not None
            else "lower the expert budget or give --kv-cache-gb"
        )
        for q in reqs:
            if q.kv_tokens > capacity:
                raise UserError(
                    f"request {q.rid} (sequence {q.seq_id}) needs {q.kv_tokens} KV-cache tokens "
                    f"({q.kv_tokens * per_token / 1e9:.2f} GB), more than the cache holds "
                    f"({capacity} tokens); {fix}"
                )
    return Serving(reqs, serving, capacity)


def _buffers(n: int) -> str:
    return f"{n} buffer" if n == 1 else f"{n} buffers"


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
    if req.lookahead not in LOOKAHEAD_CHOICES:
        raise UserError(
            f"--lookahead must be one of {list(LOOKAHEAD_CHOICES)}, got {req.lookahead!r}"
        )
    req.seed = check_seed(req.seed)
    _engine_class(req.engine)  # an unknown engine fails before any work
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
    if inp.mg is not None:
        _check_several_gpus(pol, n_cpu)
    return RunSize(kv_reserve, model.total_experts, fit, budget, n_cpu, rt, costs, fixed)


def requested_budget(cache_ratio: float | None, gpu_experts: int | None, total: int) -> int | None:
    """The expert budget asked for (None: the most that fits), its range checked."""
    if cache_ratio is not None and gpu_experts is not None:
        raise UserError("give --cache-ratio or --gpu-experts, not both")
    if cache_ratio is not None:
        if not 0 < cache_ratio <= 1:
            raise UserError(f"--cache-ratio must be in (0, 1], got {cache_ratio}")
        return round(cache_ratio * total)
    if gpu_experts is not None:
        if not 0 <= gpu_experts <= total:
            raise UserError(f"--gpu-experts must be in 0..{total}, got {gpu_experts}")
        return gpu_experts
    return None


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
        if inp.req.serving is None and _small(inp.meta):
            data.stash = {}  # this pass also assembles the evaluation sequences
        data.calib, data.calib_pre = calibration_counts(
            inp.trace_path, inp.meta, inp.cal_ids, data.cal_eams, data.stash, set(inp.eval_ids)
        )
    else:
        raise UserError(
            f"policy {pol.name!r} needs calibration data: the trace has no "
            "calibration sequences; pass --calibration PATH or --calibration self"
        )


def _small(meta: TraceMeta) -> bool:
    """A trace small enough to keep its evaluation sequences in memory for the run."""
    return meta.counts.get("rows", _STASH_ROWS + 1) <= _STASH_ROWS


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
    if data.stash is None and _small(inp.meta):
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
