"""The engine: replays sequences through one host under one policy.

The work is split along seams (docs/architecture.md has the map):

* :mod:`simulator.boundary`: policy hooks are called through one wrapper and every plan is
  checked before anything is applied;
* :mod:`simulator.residency`: which experts are resident, when their copies end, slot holding;
* :mod:`simulator.machine`: the named resources (GPU stream, copy links, CPU pool, buffers)
  and their cost functions;
* this module: the step loop shared by prefill and decode (:class:`EngineBase`), which turns a
  checked plan into a :class:`LayerWork` (operations in issue order), and the fast executor
  (:class:`Engine`) that times them;
* :mod:`simulator.reference`: the same executor written as plain SimPy processes.

Timing follows one queueing rule (docs/policy-api.md, "Timing rules"): every serial resource
serves requests in the order they are submitted in simulated time, ties broken by issue order,
without preemption. The fast executor keeps submitted requests in a heap keyed by (submission
time, issue number) and serves them in that order, lazily: only as far as a layer needs a
result, so a layer with nothing pending costs no heap work at all.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from itertools import count
from operator import is_
from typing import Any

import numpy as np

from policies.base import _LAZY, Action, Plan, Policy, SetupContext, Slot, View
from simulator.boundary import Hooks, check_placement, check_plan, check_route
from simulator.costs import CostModel
from simulator.errors import PolicyError, UserError
from simulator.hosttier import HostTier, HostTierConfig
from simulator.machine import CpuJob, Machine
from simulator.models import ModelShape
from simulator.recorder import Recorder
from simulator.residency import INF, Residency
from simulator.runtime_profiles import RuntimeProfile
from simulator.trace import SequenceRouting

_GPU, _FETCH, _TEMP, _CPU, _PRE = (int(a) for a in Action)
#: plans ``_copies_only`` offers ``_plain_fetches`` before giving up on it for a run in which
#: it has served none (its refusal changes nothing, so when it stops being asked only speed
#: changes)
_PLAIN_PROBES = 512

# operation kinds (LayerOp.kind); WAKE is the shared CPU's next event, not an operation
WRITEBACK, FETCH, TEMP, CPU, WAKE = range(5)
# what a plan issues, as Engine._copies_only lists it (besides FETCH)
_EVICT, _DEFER, _PREFETCH = -1, -2, -3


@dataclass
class Counters:
    """Accumulators the metrics are computed from (no timeline needed)."""

    decode_accesses: int = 0
    decode_hits: int = 0
    prefill_accesses: int = 0
    prefill_hits: int = 0
    hits_per_layer: np.ndarray | None = None
    accesses_per_layer: np.ndarray | None = None
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_expert_copies: int = 0
    d2h_expert_copies: int = 0
    gpu_expert_busy: float = 0.0
    gpu_nonexpert_busy: float = 0.0
    transfer_stall: float = 0.0
    cpu_wait: float = 0.0
    #: GPU stream idle because the runtime's host thread had not issued the kernels yet
    dispatch_stall: float = 0.0
    cpu_expert_evals: int = 0
    cpu_precalc_evals: int = 0
    fetches: int = 0
    temp_copies: int = 0
    evictions: int = 0
    prefetches: int = 0
    prefetch_used: int = 0
    prefetch_wasted_bytes: int = 0
    precalc_wasted: int = 0
    true_accesses: int = 0
    replaced_mispredicted: int = 0
    replaced_degraded: int = 0
    gate_mass_total: float = 0.0
    gate_mass_kept: float = 0.0
    #: decode gate mass of experts computed from a low-precision copy (HOBBIT)
    gate_mass_low_bit: float = 0.0
    low_bit_copies: int = 0
    ttft: list[float] = field(default_factory=list)
    token_latency: list[float] = field(default_factory=list)
    decode_time: float = 0.0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    sequences: int = 0
    max_occupancy: int = 0
    #: blocking host syncs of the runtime's host thread
    host_syncs: int = 0
    #: seconds the host CPU ran CPU-resident layers' non-expert parts (ResourceSpec.gpu_blocks)
    cpu_nonexpert_busy: float = 0.0
    #: copies of a CPU-resident layer's non-expert weights to the GPU (prompt op offload)
    cpu_layer_weight_copies: int = 0
    #: streamed non-expert weights (ResourceSpec.nonexpert_streamed): copies and their bytes
    #: (also counted in ``h2d_bytes``)
    nonexpert_weight_copies: int = 0
    nonexpert_weight_bytes: int = 0


@dataclass
class RunStats:
    """What a run returns to results.py: counters, end-to-end time and busy time per resource."""

    counters: Counters
    #: simulated seconds until the last token is out (background work does not extend it)
    e2e: float
    #: busy seconds per named resource: ``gpu``, each link (``h2d``, ``d2h``), each pool (``cpu``)
    busy: dict[str, float]
    #: workers per pool (``cpu``)
    workers: dict[str, int]
    #: with a host-memory budget: the SSD tier's totals (ssd_bytes, ssd_reads, ssd_stall_s,
    #: host_memory_peak_bytes, host_evictions); None when host memory is not modelled
    host_tier: dict[str, float] | None = None


class LayerOp:
    """One operation a plan asks for: a write-back, a copy or a CPU job.

    ``seq`` is its issue number (the tie-break of the queueing rule). ``end`` is set once the
    executor has timed it. CPU jobs of a serial chain point to the next one with ``chain``.
    """

    __slots__ = (
        "buf",
        "chain",
        "end",
        "expert",
        "gds",
        "gpu",
        "kind",
        "layer",
        "local",
        "low",
        "n",
        "rkind",
        "seq",
        "sid",
        "ssd_at",
        "ssd_read",
        "stage",
        "token",
    )

    def __init__(
        self, kind: int, rkind: str, seq: int, sid: int, token: int, layer: int, expert: int
    ) -> None:
        self.kind = kind
        self.rkind = rkind  # the timeline's "kind" column
        self.seq = seq
        self.sid = sid
        self.token = token
        self.layer = layer
        self.expert = expert
        self.n = 1
        self.low = False  # a TEMP copy of the low-precision host copy (Plan.low_bit)
        self.buf = -1
        self.gpu = False  # a GPU computation of the current layer waits for this copy
        self.chain: LayerOp | None = None
        self.end: float | None = None
        self.stage = 0
        #: the SSD tier: its first stage is submitted no earlier than this (its drive read ends)
        self.ssd_at = 0.0
        #: the SSD tier: a GPUDirect Storage read already put the weights in GPU memory
        self.gds = False
        #: the SSD tier: this operation issued the drive read it waits for (else it found a
        #: host copy, maybe one still being read for an earlier operation)
        self.ssd_read = False
        self.local = False  # a CPU job of a CPU-resident layer: no activation copies


class LayerWork:
    """A checked plan as operations: everything one layer submits at its decision time."""

    __slots__ = (
        "barrier",
        "counts",
        "cpu_first",
        "deferred",
        "gpu",
        "layer",
        "now",
        "ops",
        "results",
        "sid",
        "sync",
        "token",
    )

    def __init__(self, now: float, layer: int, sid: int, token: int, counts: Any) -> None:
        self.now = now
        self.layer = layer
        self.sid = sid
        self.token = token
        self.counts = counts  # prefill: tokens per expert; decode: None (one token)
        #: operations submitted at ``now``, in issue order
        self.ops: list[LayerOp] = []
        #: GPU computations: (expert, ready time or the copy it waits for)
        self.gpu: list[tuple[int, Any]] = []
        #: in-use victims: expert -> its write-back, submitted when its computation ends
        self.deferred: dict[int, LayerOp] = {}
        #: this layer's CPU experts (``cpu_first`` waits for them before the GPU starts)
        self.sync: list[LayerOp] = []
        #: CPU results the layer needs (its CPU experts and consumed pre-calculations)
        self.results: list[LayerOp] = []
        self.cpu_first = False
        #: the GPU experts wait for every copy into this layer's slots (Plan.barrier)
        self.barrier = False


class WeightCopy:
    """Non-expert weights the step loop copies to the GPU before a layer's non-expert part
    (ResourceSpec.nonexpert_streamed): submitted at ``t`` with issue number ``seq``, it queues
    on the host-to-device lane behind everything submitted before it. The step loop yields it;
    the executor times it and sends back when it lands."""

    __slots__ = ("dur", "layer", "nbytes", "rkind", "seq", "sid", "t", "token")

    def __init__(
        self, t: float, seq: int, nbytes: int, dur: float, rkind: str, sid: int, token: int,
        layer: int,
    ) -> None:  # fmt: skip
        self.t = t
        self.seq = seq
        self.nbytes = nbytes
        self.dur = dur
        self.rkind = rkind  # the timeline's "kind": "weights" (a layer's) or "embedding"
        self.sid = sid
        self.token = token
        self.layer = layer


class _Wake:
    """The shared CPU's next event in the request heap: ``n`` is the CPU's version when it
    was scheduled (a later change makes it stale). Only ``kind`` and ``n`` are read."""

    __slots__ = ("n",)
    kind = WAKE

    def __init__(self, n: int) -> None:
        self.n = n


def cpu_layers_for(spec: Any, model: ModelShape, budget: int) -> int:
    """Leading MoE layers a spec runs wholly on the CPU when the run did not size them from
    memory (the runner does, :func:`simulator.runner.cpu_resident_layers`): N GPU blocks
    leave ``moe_layers - N``; -1 leaves the fewest whose GPU layers' experts fit ``budget``."""
    g = spec.gpu_blocks
    if g is None:
        return 0
    if g >= 0:
        return model.moe_layers - min(model.moe_layers, g)
    return max(0, model.moe_layers - budget // model.experts)


class EngineBase:
    """The step loop shared by both executors: views, hooks, checks, plans into operations.

    Subclasses implement :meth:`run`, driving :meth:`steps`: it yields a float (advance the
    clock to this decision time, serving everything submitted before it) or a
    :class:`LayerWork` (time it; send back the time the layer ends).
    """

    def __init__(
        self,
        policy: Policy,
        model: ModelShape,
        costs: CostModel,
        budget: int,
        calibration: np.ndarray | None = None,
        calibration_prefill: np.ndarray | None = None,
        oracle: Any = None,
        recorder: Recorder | None = None,
        seed: int = 0,
        runtime: RuntimeProfile | None = None,
        calibration_sequences: tuple[np.ndarray, ...] | None = None,
        host_tier: HostTierConfig | None = None,
        cpu_layers: int | None = None,
    ) -> None:
        self.policy = policy
        self.hooks = Hooks(policy)
        self.spec = self.hooks.call("resources", policy.resources)
        self.model = model
        self.costs = costs
        self.budget = int(budget)
        self.n_layers = model.moe_layers
        self.n_experts = model.experts
        self.recorder = recorder
        self.machine = Machine(costs, self.spec, runtime)
        self.res = Residency(
            self.n_layers, self.n_experts, self.budget, self.spec.staging_buffers, recorder
        )
        #: submitted CPU pre-calculations not consumed yet: (layer, expert) -> the job
        self.precalc: dict[Slot, LayerOp] = {}
        self.c = Counters(
            hits_per_layer=np.zeros(self.n_layers, dtype=np.int64),
            accesses_per_layer=np.zeros(self.n_layers, dtype=np.int64),
        )
        self._wb = self.spec.writeback
        self._hits = [0] * self.n_layers
        self._acc = [0] * self.n_layers
        self.expert_bytes = costs.link_expert_bytes  # what one copy moves (host precision)
        self.act_bytes = model.hidden * 2
        self.now = 0.0
        self.step = 0
        self._seq = 0
        #: a ``simulator.serving.Serving`` when requests are batched (set by the runner)
        self.serving: Any = None
        v = self.view = View()
        v.model = model
        v.costs = costs
        v.budget = self.budget
        v.calibration = calibration
        v.resident = self.res.resident.view()
        v.resident.flags.writeable = False
        #: the SSD tier's configuration (None: host memory not modelled) and, when some
        #: experts live on the drive, its state (docs/serving.md, "An SSD tier")
        self._ssd_cfg = host_tier
        self._ssd: HostTier | None = None
        if host_tier is not None:
            tier = HostTier(host_tier, costs, self.n_layers, self.n_experts,
                            self.spec.ssd_access, recorder)  # fmt: skip
            v.host_resident = tier.host.view()
            v.host_resident.flags.writeable = False
            if host_tier.uses_ssd:
                self._ssd = tier
                self.machine.drives[tier.lane.name] = tier.lane
        n_cpu = cpu_layers_for(self.spec, model, self.budget) if cpu_layers is None else cpu_layers
        ctx = SetupContext(
            model=model,
            budget=self.budget,
            costs=costs,
            calibration=calibration,
            calibration_prefill=calibration_prefill,
            oracle=oracle if policy.clairvoyant else None,
            seed=seed,
            calibration_sequences=calibration_sequences,
            cpu_layers=n_cpu,
        )
        #: leading MoE layers run wholly on the CPU (ResourceSpec.gpu_blocks, resolved)
        self.n_cpu_layers = n_cpu
        #: the current layer runs on the CPU: its CPU experts need no activation copies
        self._cpu_layer_here = False
        placed = self.hooks.call("setup", policy.setup, ctx)
        slots = check_placement(self.hooks, placed, self.n_layers, self.n_experts, self.budget)
        self.res.place(slots)

    # -- compatibility views of the state (tests and tools read these) -----------------------
    @property
    def ready_at(self) -> np.ndarray:
        """When each resident expert's copy ends (inf while not started)."""
        return self.res.ready_at

    @property
    def resident(self) -> np.ndarray:
        """The residency mask."""
        return self.res.resident

    def run(
        self, sequences: Iterable[SequenceRouting], on_sequence: Callable[[Any], None] | None = None
    ) -> RunStats:
        """Simulate the sequences back to back."""
        raise NotImplementedError

    def stats(self, e2e: float) -> RunStats:
        """The run's statistics once it is over."""
        self.c.max_occupancy = self.res.max_occupancy
        self.c.hits_per_layer = np.array(self._hits, dtype=np.int64)
        self.c.accesses_per_layer = np.array(self._acc, dtype=np.int64)
        m = self.machine
        self.c.host_syncs = m.host.syncs if m.host is not None else 0
        stats = RunStats(counters=self.c, e2e=e2e, busy=m.busy(), workers=m.workers())
        if self._ssd_cfg is not None:
            stats.host_tier = self._ssd_totals(stats.busy)
        return stats

    def _ssd_totals(self, busy: dict[str, float]) -> dict[str, float]:
        """The SSD tier's totals for the metrics (and the drive's busy time)."""
        cfg, tier = self._ssd_cfg, self._ssd
        assert cfg is not None
        if tier is None:  # every expert fits: the host holds them all, the drive is idle
            peak = cfg.nonexpert_bytes + cfg.total * cfg.expert_bytes
            out = {"ssd_bytes": 0, "ssd_reads": 0, "ssd_stall_s": 0.0, "host_evictions": 0}
            busy["ssd"] = 0.0
        else:
            peak = tier.peak_bytes
            out = {
                "ssd_bytes": tier.ssd_bytes,
                "ssd_reads": tier.ssd_reads,
                "ssd_stall_s": tier.ssd_stall,
                "host_evictions": tier.host_evictions,
            }
            busy["ssd"] = tier.lane.busy
        out["host_memory_peak_bytes"] = peak
        out["host_memory_budget_bytes"] = cfg.budget_bytes
        return out

    def _ssd_stage(self, w: LayerWork) -> None:
        """The SSD tier: each operation of ``w`` that reads an expert's host copy (a copy to
        the GPU, a CPU expert) gets the time its weights are there, reading them from the
        drive when host memory does not hold them; write-backs land host copies."""
        tier = self._ssd
        assert tier is not None
        now = wait = w.now
        for head in w.ops:
            op: LayerOp | None = head
            while op is not None:
                kind = op.kind
                if kind == WRITEBACK:
                    tier.written_back(op, now)
                else:
                    op.ssd_at, op.gds = at, _ = tier.read(op, now, kind != CPU)
                    op.ssd_read = tier.issued
                    if at > wait and op.rkind != "prefetch" and op.rkind != "precalc":
                        wait = at  # a routed expert of this layer waits for the drive
                op = op.chain
        for op in w.deferred.values():
            tier.written_back(op, now)
        # the layer's SSD stall: from the decision until its last routed expert is readable
        tier.ssd_stall += wait - now

    #: several GPUs: each layer's home GPU lane (simulator/multigpu.py); None for one GPU
    _peer_home: list[Any] | None = None

    def _due(self, now: float) -> bool:
        """Whether the executor must advance its clock to ``now`` before the decision."""
        return True

    def _hits_only(
        self, layer: int, routed: list[int], actions: dict[int, Any] | None, now: float
    ) -> float | None:
        """Check, apply and time a decode plan that only runs resident experts whose copies
        are timed, in one pass; returns when the layer ends, or None to take the general path
        (the plan is then untouched). This executor always takes the general path."""
        return None

    #: whether ``_pass`` offers plans with a substituted route or low-bit copies to the
    #: one-pass paths (``_hits_only``, ``_copies_only``); the general path otherwise
    _one_pass_low_bit_or_skips = False

    #: whether ``_pass`` offers decode plans to ``_precalc_layer`` before the general path
    _one_pass_cpu_plans = False

    def _precalc_layer(
        self, layer: int, experts: np.ndarray, plan: Plan, now: float, w_t: Any, ws_t: list[float]
    ) -> float | None:
        """Check, apply and time in one pass a decode plan of resident experts, CPU experts
        and pre-calculations; returns when the layer ends, or None to take the general path
        (the plan is then untouched). This executor always takes the general path."""
        return None

    def _copies_only(self, layer: int, routed: list[int], plan: Plan, now: float) -> float | None:
        """Check, apply and time in one pass a decode plan made of resident experts, fetches,
        temporary copies, evictions and prefetches (no CPU work, no write-backs); returns when
        the layer ends, or None to take the general path (the plan is then untouched). This
        executor always takes the general path."""
        return None

    def _cpu_layer_decode(
        self, layer: int, routed: list[int], plan: Plan, now: float
    ) -> float | None:
        """Check, apply and time in one pass a CPU-resident layer's decode plan that runs
        every routed expert on the CPU; returns when the layer ends, or None to take the
        general path (the plan is then untouched). This executor always takes the general
        path."""
        return None

    #: ``_gpu_cpu_layer`` has served a plan of this run / refused one (see ``_pass``)
    _split_taken = False
    _split_refused = 0

    def _gpu_cpu_layer(self, layer: int, routed: list[int], plan: Plan, now: float) -> float | None:
        """Check, apply and time in one pass a decode plan of resident experts and CPU
        experts only; returns when the layer ends, or None to take the general path (the plan
        is then untouched). This executor always takes the general path."""
        return None

    def _free_slot(self, t: float) -> None:
        """An evicted expert's slot (no write-back) is free at ``t``."""
        raise NotImplementedError

    def _rearm(self) -> None:
        """The shared CPU changed outside the executor: schedule its next event again."""
        raise NotImplementedError

    # -- the step loop ----------------------------------------------------------------------
    def steps(
        self, sequences: Iterable[SequenceRouting], on_sequence: Callable[[Any], None] | None
    ) -> Generator[Any, float | None, None]:
        """Every sequence: a prefill pass, then one step per decode token (see class doc)."""
        if self.serving is not None:  # batched or continuous serving: its own loop
            yield from self.serving.steps(self, sequences, on_sequence)
            return
        hooks, pol, c = self.hooks, self.policy, self.c
        where = hooks.where
        for r in sequences:
            sid = int(r.seq_id)
            where.seq, where.token, where.layer = sid, None, None
            self.view.seq_id = sid
            hooks.call("on_sequence_start", pol.on_sequence_start, sid, r.n_prefill)
            t0 = self.now
            if r.n_prefill:
                yield from self._pass(r, True)
            c.ttft.append(self.now - t0)
            yield from self._pass(r, False)
            where.token = None
            hooks.call("on_sequence_end", pol.on_sequence_end, sid)
            # CPU pre-calculations nobody consumed (e.g. DAOP's last-layer quirk)
            c.precalc_wasted += len(self.precalc)
            self.precalc.clear()
            c.sequences += 1
            if on_sequence is not None:
                on_sequence(r)

    def _pass(
        self, r: SequenceRouting, prefill: bool, base: int = 0
    ) -> Generator[Any, float | None, None]:
        """The prefill pass (all prompt tokens per layer) or the decode steps, layer by layer.

        ``base`` is added to decode token numbers (serving passes one token at a time).
        """
        v, c, rec, m = self.view, self.c, self.recorder, self.machine
        hooks = self.hooks
        where = hooks.where
        n_layers = self.n_layers
        n_exp = self.n_experts
        sid = where.seq
        if prefill:
            p = r.n_prefill
            v.phase = "prefill"
            v.n_tokens = p
            v.context = 0
            v.position = int(r.positions[0])
            v.next_experts = v.next_probs = None
            decide = self.policy.prefill_layer
            hook = "prefill_layer"
            tokens: Iterable[int] = (0,)
        else:
            v.phase = "decode"
            v.n_tokens = 1
            v.counts = None
            decide = self.policy.decode_layer
            hook = "decode_layer"
            full = r.prob_ids is not None
            probs = r.full_probs(n_exp) if full else r.probs
            eprobs = r.full_probs(n_exp, early=True) if full else r.early_probs
            wsums = r.weights.sum(axis=2).tolist()  # true gate mass per token-layer
            tokens = range(r.n_prefill, r.n_tokens)
        nonexpert_s = m.nonexpert_s
        gpu_lane = m.gpu
        peer_home = self._peer_home
        unified = m.unified
        host = m.host
        # the host thread's non-expert step (_host_nonexpert without its own call)
        host_ne = host.nonexpert_start if host is not None else None
        streamed = m.streamed  # ZeRO-3's streamed non-expert weights, or None
        # the executor's own timing of those copies (Engine._weights_now), or None: each is
        # then yielded to the executor (_weights_in)
        weights_now = self._weights_now if streamed is not None and self._weights_inline else None
        n_cpu = self.n_cpu_layers
        if n_cpu and prefill and 0 < self.spec.cpu_layer_offload_batch <= p:
            n_cpu_run = 0  # op offload: the CPU layers' parts run on the GPU, weights copied
        else:
            n_cpu_run = n_cpu
        for t in tokens:
            t0 = self.now
            where.token = v.token = t + base
            v.step = self.step
            if prefill:
                context = 0
                d_ne = nonexpert_s(p, 0)
            else:
                v.position = context = int(r.positions[t])  # tokens already in the KV cache
                v.context = context
                ex_t, w_t, p_t = r.experts[t], r.weights[t], probs[t]
                ee_t, ep_t = r.early_experts[t], eprobs[t]
                v._rows = (w_t, p_t, ee_t, ep_t)  # the rows a policy reads (View's properties)
                ws_t = wsums[t]
                d_ne = nonexpert_s(1, context)
            for layer in range(n_layers):
                start = self.now
                cpu_here = self._cpu_layer_here = layer < n_cpu_run
                if cpu_here:  # a CPU-resident layer (ResourceSpec.gpu_blocks)
                    now = self._cpu_layer_nonexpert(start, layer, p if prefill else 1, context)
                else:
                    if peer_home is not None:  # several GPUs: the layer's home GPU (multigpu.py)
                        gpu_lane = peer_home[layer]
                    if n_cpu and layer < n_cpu:  # op offload: this layer's weights come first
                        start = self._cpu_layer_weights_in(start, layer)
                    elif layer and layer == n_cpu_run:  # the split: hidden states to the GPU
                        start = self._cpu_layer_split(start, layer, p if prefill else 1, True)
                    if streamed is not None:  # the layer's weights land first (ZeRO-3)
                        if weights_now is not None:
                            start = weights_now(start, layer, streamed)
                        else:
                            start = yield from self._weights_in(start, layer, streamed)
                    if host_ne is None:
                        now = start + d_ne
                    else:  # the host thread issues the part's kernels, maybe syncs on routing
                        start, now = host_ne(start, d_ne, layer == 0, c)
                    if rec is not None:
                        rec.op(
                            gpu_lane.name, "nonexpert", sid, t, layer, -1, start, start + d_ne, 0
                        )
                    c.gpu_nonexpert_busy += d_ne
                    gpu_lane.busy += d_ne
                    if unified:
                        m.gpu_load(start, start + d_ne, p if prefill else 1, context)
                        if m.cpu.active:
                            self._rearm()
                if self._due(now):
                    yield now  # serve everything submitted before the decision
                v.layer = where.layer = layer
                v.now = now
                counts = None
                if prefill:
                    sel = r.experts[:p, layer, :]
                    counts = np.bincount(sel.reshape(-1), minlength=n_exp)
                    experts = np.flatnonzero(counts)
                    experts = experts[np.argsort(-counts[experts], kind="stable")]
                    v.experts = experts
                    v.counts = counts
                    v.weights = r.weights[:p, layer, :].mean(axis=0)
                    v.probs = r.probs[:p, layer, :].mean(axis=0)
                else:
                    experts = ex_t[layer]
                    v.experts = experts
                    # the other rows are built only when the policy reads them (lazy views:
                    # stream-all reads none of them, daop two of four)
                    v._weights = v._probs = v._next_experts = v._next_probs = _LAZY
                try:  # Hooks.call, inlined on the per-layer path
                    plan = decide(v)
                except (PolicyError, UserError):
                    raise
                except Exception as exc:
                    raise hooks.fault(hook, exc) from exc
                if (
                    cpu_here
                    and not prefill
                    and plan.__class__ is Plan
                    and plan.route is None
                    and not plan.precalc
                    and not plan.low_bit
                ):
                    # a CPU-resident layer running its experts on the CPU (llama-cpp-layers)
                    end = self._cpu_layer_decode(layer, experts.tolist(), plan, now)
                    if end is not None:
                        c.true_accesses += len(experts)
                        ws = ws_t[layer]
                        c.gate_mass_total += ws
                        c.gate_mass_kept += ws
                        self.now = end
                        continue
                if (
                    not prefill
                    and not cpu_here
                    and plan.__class__ is Plan
                    and plan.route is None
                    and not plan.precalc
                    and not plan.low_bit
                ):
                    routed = experts.tolist()
                    end = None
                    if not (plan.evict or plan.prefetch or plan.victims):
                        # the common decode case: every routed expert resident, on the GPU
                        end = self._hits_only(layer, routed, plan.actions, now)
                    if (
                        end is None
                        and plan.cpu_first
                        and self._one_pass_cpu_plans
                        and (self._heap or not self._host.idle)
                    ):
                        # CPU experts the GPU waits for, with CPU work pending: the one-pass
                        # copy paths would refuse them (daop's first layers)
                        end = self._precalc_layer(layer, experts, plan, now, w_t, ws_t)
                        if end is not None:
                            self.now = end
                            continue
                    if end is None and (self._split_taken or self._split_refused < _PLAIN_PROBES):
                        # resident experts with CPU experts, or with fetches and temporary
                        # copies (ktransformers, fiddler, the caching policies' misses); a run
                        # whose first such plans never qualify stops probing
                        end = self._gpu_cpu_layer(layer, routed, plan, now)
                        if end is None:
                            self._split_refused += 1
                        else:
                            self._split_taken = True
                    if end is None:
                        # copies, evictions and resident experts, nothing else pending
                        end = self._copies_only(layer, routed, plan, now)
                    if end is not None:
                        c.true_accesses += len(experts)
                        ws = ws_t[layer]
                        c.gate_mass_total += ws
                        c.gate_mass_kept += ws
                        self.now = end
                        continue
                elif (
                    not prefill
                    and not cpu_here
                    and plan.__class__ is Plan
                    and not plan.precalc
                    and self._one_pass_low_bit_or_skips
                    # a consumed pre-calculation (daop): these paths refuse it, _precalc_layer
                    # below takes it
                    and (plan.actions.__class__ is not dict or _PRE not in plan.actions.values())
                ):
                    # low-bit temporary copies or skipped experts (hobbit): the same one-pass
                    # paths, then the general path's gate-mass accounting in its order
                    route = check_route(hooks, plan, n_exp, layer)
                    routed = experts.tolist() if route is None else route
                    end = None
                    if not (plan.low_bit or plan.evict or plan.prefetch or plan.victims):
                        end = self._hits_only(layer, routed, plan.actions, now)
                    if end is None:
                        end = self._copies_only(layer, routed, plan, now)
                    if end is not None:
                        if route is None:  # the trace's routing: all its gate mass is kept
                            c.true_accesses += len(experts)
                            ws = ws_t[layer]
                            c.gate_mass_total += ws
                            c.gate_mass_kept += ws
                        else:
                            self._fidelity(plan, route, experts, w_t[layer], ws_t[layer])
                        if plan.low_bit:
                            self._low_bit_mass(plan.low_bit, experts, w_t[layer])
                        self.now = end
                        continue
                if not prefill and not cpu_here and self._one_pass_cpu_plans:
                    # resident experts, CPU experts and pre-calculations (daop's decode plans)
                    end = self._precalc_layer(layer, experts, plan, now, w_t, ws_t)
                    if end is not None:
                        self.now = end
                        continue
                if prefill:
                    if plan.__class__ is Plan and plan.route is not None:
                        raise hooks.error(
                            "substitutes routing during prefill (not supported)", layer
                        )
                    routed = experts.tolist()
                else:
                    route = None
                    if plan.__class__ is Plan or isinstance(plan, Plan):
                        route = check_route(hooks, plan, n_exp, layer)
                    routed = experts.tolist() if route is None else route
                order = check_plan(
                    hooks, plan, layer, routed, self.res, self.spec, self.precalc, now
                )
                if not prefill:
                    if route is None:  # the trace's routing: all its gate mass is kept
                        c.true_accesses += len(experts)
                        ws = ws_t[layer]
                        c.gate_mass_total += ws
                        c.gate_mass_kept += ws
                    else:
                        self._fidelity(plan, route, experts, w_t[layer], ws_t[layer])
                    if plan.low_bit:
                        self._low_bit_mass(plan.low_bit, experts, w_t[layer])
                work = self._apply(plan, layer, order, routed, counts, now, prefill)
                end = yield work
                assert end is not None
                self.now = end
            if streamed is not None:  # the output matrix, after the last layer (ZeRO-3)
                if weights_now is not None:
                    self.now = weights_now(self.now, -1, streamed)
                else:
                    self.now = yield from self._weights_in(self.now, -1, streamed)
            self.step += 1
            if prefill:
                c.prefill_tokens += p
            else:
                # a pre-calculation is for a coming layer of the same token: one nobody consumed
                # by the token's end is wasted (e.g. DAOP's discarded last-layer result)
                if self.precalc:
                    c.precalc_wasted += len(self.precalc)
                    self.precalc.clear()
                lat = self.now - t0
                c.token_latency.append(lat)
                c.decode_time += lat
                c.decode_tokens += 1

    def _weights_in(
        self, start: float, layer: int, streamed: tuple[tuple[int, float], tuple[int, float]]
    ) -> Generator[Any, float | None, float]:
        """ZeRO-3's streamed non-expert weights (ResourceSpec.nonexpert_streamed,
        docs/cost-model.md "Streamed non-expert weights"): the copies issued at ``start``
        before ``layer``'s non-expert part (at layer 0 the input embedding's first), or with
        ``layer`` -1 the output matrix's after the last layer; returns when the last lands.
        Each is yielded to the executor, which queues it on the host-to-device lane behind
        everything submitted before it."""
        c = self.c
        w = self.hooks.where
        sid, token = w.seq or 0, w.token or 0
        (lb, ls), (eb, es) = streamed
        if layer < 0:
            items = [("embedding", eb, es, self.n_layers - 1)]
        elif layer == 0:
            items = [("embedding", eb, es, 0), ("weights", lb, ls, 0)]
        else:
            items = [("weights", lb, ls, layer)]
        end = start
        for rkind, nbytes, dur, ll in items:
            if nbytes <= 0:
                continue
            op = WeightCopy(start, self._seq, nbytes, dur, rkind, sid, token, ll)
            self._seq += 1
            c.h2d_bytes += nbytes
            c.nonexpert_weight_copies += 1
            c.nonexpert_weight_bytes += nbytes
            landed = yield op  # type: ignore[misc]
            assert landed is not None
            end = landed
        return end

    #: whether ``_pass`` times the streamed weight copies itself through ``_weights_now``
    #: instead of yielding each one to the executor (``_weights_in``)
    _weights_inline = False

    def _weights_now(
        self, start: float, layer: int, streamed: tuple[tuple[int, float], tuple[int, float]]
    ) -> float:
        """``_weights_in`` timed by the executor without a generator round trip (an executor
        that sets ``_weights_inline`` overrides it)."""
        raise NotImplementedError

    def _host_nonexpert(self, start: float, d_ne: float, first: bool) -> tuple[float, float]:
        """With a host thread: when a layer's non-expert part (GPU time ``d_ne``, stream free
        from ``start``) starts on the GPU, and the decision time (docs/cost-model.md,
        "Runtime profiles"). ``first``: the first layer of a forward pass."""
        return self.machine.host.nonexpert_start(start, d_ne, first, self.c)  # type: ignore[union-attr]

    # -- CPU-resident layers (llama.cpp's -ngl split; docs/cost-model.md) ----------------------
    def _cpu_layer_nonexpert(
        self, start: float, layer: int, n: int, context: int, d: float | None = None
    ) -> float:
        """A CPU-resident layer's non-expert part on the host CPU from ``start``; returns when
        its routing is known (the decision time). CPU layers lead, so the hidden states are on
        the host already (the token's embedding is looked up there). Timed here, in the step
        loop both engines share: nothing else runs on the CPU or the links at a layer's start
        (a spec with ``gpu_blocks`` has no write-backs, its plans no prefetches or
        pre-calculations)."""
        m = self.machine
        if d is None:  # (a batched step passes its own duration)
            d = m.cpu_layer_nonexpert_s(n, context)
        lane = m.cpu.lanes[0]
        lane.busy += d
        lane.free_at = start + d
        self.c.cpu_nonexpert_busy += d
        if self.recorder is not None:
            w = self.hooks.where
            self.recorder.op(lane.name, "nonexpert", w.seq or 0, w.token or 0, layer, -1,
                             start, start + d, 0)  # fmt: skip
        return start + d

    def _cpu_layer_split(self, start: float, layer: int, n: int, to_gpu: bool) -> float:
        """The hidden states of ``n`` tokens cross the link at the split; returns their arrival."""
        m = self.machine
        link = m.links["h2d" if to_gpu else "d2h"]
        d = link.activation_s(n)
        nbytes = self.act_bytes * n
        link.lane.busy += d
        link.lane.free_at = start + d
        if to_gpu:
            self.c.h2d_bytes += nbytes
        else:
            self.c.d2h_bytes += nbytes
        if self.recorder is not None:
            w = self.hooks.where
            self.recorder.op(link.lane.name, "activation", w.seq or 0, w.token or 0, layer, -1,
                             start, start + d, nbytes)  # fmt: skip
        return start + d

    def _cpu_layer_weights_in(self, start: float, layer: int) -> float:
        """Op offload of a prompt batch: a CPU-resident layer's non-expert weights are copied
        to the GPU before its part runs there; returns when they have arrived."""
        m = self.machine
        link = m.links["h2d"]
        d = m.cpu_layer_weights_s
        nbytes = self.costs.cpu_layer_weight_bytes
        link.lane.busy += d
        link.lane.free_at = start + d
        self.c.h2d_bytes += nbytes
        self.c.cpu_layer_weight_copies += 1
        if self.recorder is not None:
            w = self.hooks.where
            self.recorder.op(link.lane.name, "weights", w.seq or 0, w.token or 0, layer, -1,
                             start, start + d, nbytes)  # fmt: skip
        return start + d

    def _fidelity(
        self, plan: Plan, route: list[int] | None, true_e: np.ndarray, true_w: Any, wsum: float
    ) -> None:
        """Count how much of the true routing a substituted route kept or replaced."""
        c = self.c
        c.true_accesses += true_e.shape[0]
        c.gate_mass_total += wsum
        if route is None:
            c.gate_mass_kept += wsum
            return
        used = set(route)
        raw = set(np.asarray(plan.raw_route).tolist()) if plan.raw_route is not None else set()
        for e, w in zip(true_e.tolist(), true_w.tolist(), strict=False):
            if e in used:
                c.gate_mass_kept += w
            elif e in raw:
                c.replaced_degraded += 1
            else:
                c.replaced_mispredicted += 1

    def _low_bit_mass(self, low: Any, true_e: np.ndarray, true_w: Any) -> None:
        """The true gate weight of experts computed from a low-precision copy."""
        c = self.c
        for e, w in zip(true_e.tolist(), true_w.tolist(), strict=False):
            if e in low:
                c.gate_mass_low_bit += w

    def _accesses(self, layer: int, n_routed: int, n_hits: int, prefill: bool) -> None:
        """Count a layer's expert accesses and hits (per phase; per layer for decode)."""
        c = self.c
        if prefill:
            c.prefill_accesses += n_routed
            c.prefill_hits += n_hits
        else:
            c.decode_accesses += n_routed
            c.decode_hits += n_hits
            # plain lists on the hot path; the counters' arrays are filled in by stats()
            self._hits[layer] += n_hits
            self._acc[layer] += n_routed

    # -- a checked plan into operations ----------------------------------------------------
    def _op(self, kind: int, rkind: str, layer: int, expert: int, w: LayerWork) -> LayerOp:
        self._seq += 1
        return LayerOp(kind, rkind, self._seq, w.sid, w.token, layer, expert)

    def _evict(self, slot: Any, needed: set[int], w: LayerWork) -> None:
        """Free a slot; with write-back the slot stays held until its D2H copy ends."""
        res, c = self.res, self.c
        vl, ve = slot
        if vl.__class__ is not int or ve.__class__ is not int:  # numpy integers (checked)
            vl, ve = int(vl), int(ve)
        slot = (vl, ve)
        res.resident[slot] = False  # Residency.remove, inlined
        res.n_resident -= 1
        c.evictions += 1
        if vl == w.layer and ve in needed:
            # the victim still runs in this layer: written back after its computation
            w.deferred[ve] = self._writeback(slot, w)
            return
        prefetched = res.prefetched
        if prefetched[slot]:
            prefetched[slot] = False
            c.prefetch_wasted_bytes += self.expert_bytes
        if self._wb:
            w.ops.append(self._writeback(slot, w))
        else:  # the slot is free at once (nothing ever waits for one without write-back)
            self._free_slot(w.now)

    def _writeback(self, slot: Slot, w: LayerWork) -> LayerOp:
        c = self.c
        c.d2h_bytes += self.expert_bytes
        c.d2h_expert_copies += 1
        return self._op(WRITEBACK, "writeback", slot[0], slot[1], w)

    def _fetch(self, slot: Slot, kind: str, victim: Any, needed: set[int], w: LayerWork) -> LayerOp:
        if victim is not None:
            self._evict(victim, needed, w)
        self._seq = seq = self._seq + 1
        op = LayerOp(FETCH, kind, seq, w.sid, w.token, slot[0], slot[1])
        res = self.res
        res.resident[slot] = True  # Residency.insert, inlined
        res.ready_at[slot] = INF
        res.copying[slot] = op
        res.n_resident += 1
        c = self.c
        c.h2d_bytes += self.expert_bytes
        c.h2d_expert_copies += 1
        w.ops.append(op)
        return op

    def _cpu(self, layer: int, expert: int, n: int, kind: str, w: LayerWork) -> LayerOp:
        op = self._op(CPU, kind, layer, expert, w)
        op.n = n
        if self._cpu_layer_here:  # the hidden states are already on the host
            op.local = True
            return op
        act = self.act_bytes * n
        c = self.c
        c.d2h_bytes += act
        c.h2d_bytes += act
        return op

    def _apply(
        self,
        plan: Plan,
        layer: int,
        order: list[int],
        routed: list[int],
        counts: np.ndarray | None,
        now: float,
        prefill: bool,
    ) -> LayerWork:
        """A checked plan as operations in issue order (see docs/policy-api.md)."""
        res, c = self.res, self.c
        w = LayerWork(now, layer, self.hooks.where.seq or 0, self.hooks.where.token or 0, counts)
        actions = plan.actions
        ready_at = res.ready_at
        gpu = w.gpu
        if (
            order is routed
            and not (plan.evict or plan.prefetch or plan.precalc)
            and (actions is None or all(actions[e] == _GPU for e in routed))
        ):
            # every routed expert resident and on the GPU (check_plan's common case)
            pre, row = res.prefetched[layer], ready_at[layer]
            for e in routed:
                if pre[e]:
                    pre[e] = False
                    c.prefetch_used += 1
                ready = row[e]
                gpu.append((e, float(ready) if ready != INF else res.copying[(layer, e)]))
            self._accesses(layer, len(routed), len(routed), prefill)
            w.cpu_first = plan.cpu_first
            w.barrier = plan.barrier
            return w
        if actions is None:
            needed = set(routed)
        else:
            needed = {e for e in routed if actions[e] in (_GPU, _FETCH)}
        for slot in plan.evict:
            self._evict(slot, needed, w)
        temps: list[int] = []
        cpu_jobs: list[int] = []
        n_hits = 0
        prefetched = res.prefetched
        for e in order:
            a = _GPU if actions is None else actions[e]
            if a == _GPU:
                if prefetched[layer, e]:
                    prefetched[layer, e] = False
                    c.prefetch_used += 1
                n_hits += 1
                ready = ready_at[layer, e]
                gpu.append((e, float(ready) if ready != INF else res.copying[(layer, e)]))
            elif a == _FETCH:
                op = self._fetch((layer, e), "fetch", plan.victims.get(e), needed, w)
                c.fetches += 1
                gpu.append((e, op))
            elif a == _TEMP:
                temps.append(e)
            elif a == _CPU:
                cpu_jobs.append(e)
            else:  # PRECOMPUTED
                w.results.append(self.precalc.pop((layer, e)))
        self._accesses(layer, len(routed), n_hits, prefill)
        low = plan.low_bit
        for e in temps:
            op = self._op(TEMP, "temp", layer, e, w)
            c.temp_copies += 1
            if low and e in low:
                op.low = True
                c.low_bit_copies += 1
                c.h2d_bytes += self.machine.low_bit_bytes
            else:
                c.h2d_bytes += self.expert_bytes
            c.h2d_expert_copies += 1
            w.ops.append(op)
            gpu.append((e, op))
        for pl, pe, victim in plan.prefetch:
            slot = (int(pl), int(pe))
            self._fetch(slot, "prefetch", victim, needed, w)
            prefetched[slot] = True
            c.prefetches += 1
        serial = plan.cpu_serial
        prev: LayerOp | None = None
        for e in cpu_jobs:
            op = self._cpu(layer, e, int(counts[e]) if counts is not None else 1, "cpu_expert", w)
            c.cpu_expert_evals += 1
            w.sync.append(op)
            w.results.append(op)
            if serial and prev is not None:
                prev.chain = op
            else:
                w.ops.append(op)
            prev = op
        prev = None
        for pl, pe in plan.precalc:
            slot = (int(pl), int(pe))
            op = self._cpu(slot[0], slot[1], 1, "precalc", w)
            c.cpu_precalc_evals += 1
            self.precalc[slot] = op
            if serial and prev is not None:
                prev.chain = op
            else:
                w.ops.append(op)
            prev = op
        w.cpu_first = plan.cpu_first
        w.barrier = plan.barrier
        if self._ssd is not None:
            self._ssd_stage(w)
        return w


class Engine(EngineBase):
    """The fast executor: a heap of submitted requests served lazily in queueing-rule order."""

    _one_pass_low_bit_or_skips = True
    _one_pass_cpu_plans = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        m = self.machine
        self._h2d = m.links["h2d"]
        self._d2h = m.links["d2h"]
        self._host = m.cpu
        self._unified = m.unified
        self._heap: list[tuple[float, int, int, LayerOp]] = []
        self._uid = count()
        self._gheap: list[tuple[float, int, int]] = []
        self._waiting = 0
        self._tempq: deque[LayerOp] = deque()
        #: copies and kernels share one stream (ResourceSpec.one_stream): _layer serializes
        #: them; of the one-pass paths only _copies_only's copy paths take such a plan (timed
        #: by _one_stream_gpu, without a recorder and with nothing pending)
        self._one_stream = self.spec.one_stream
        self._held_wake = _Wake(0)

    def run(
        self, sequences: Iterable[SequenceRouting], on_sequence: Callable[[Any], None] | None = None
    ) -> RunStats:
        """Simulate the sequences back to back; returns the run's statistics."""
        gen = self.steps(sequences, on_sequence)
        heap = self._heap
        try:
            item = next(gen)
            while True:
                if item.__class__ is float:
                    while heap and heap[0][0] <= item:
                        self._serve()
                    item = gen.send(None)
                elif item.__class__ is WeightCopy:
                    item = gen.send(self._weights_copy(item))
                else:
                    item = gen.send(self._layer(item))
        except StopIteration:
            pass
        e2e = self.now
        if self._rel:
            self._flush_releases()
        while heap:  # background work still running when the last token is out
            self._serve()
        return self.stats(e2e)

    def _weights_copy(self, op: WeightCopy) -> float:
        """Time a streamed weight copy (``EngineBase._weights_in``): everything submitted
        before it is served first (so the lane's ledger holds every earlier copy), then it
        takes the host-to-device lane after them; returns when it lands."""
        t = op.t
        self._due(t)
        link = self._h2d
        lane = link.lane
        s = t if t > lane.free_at else lane.free_at
        e = lane.free_at = s + op.dur
        lane.busy += op.dur
        if self._unified:
            self._mem(s, e, op.nbytes)
        if self.recorder is not None:
            self.recorder.op(lane.name, op.rkind, op.sid, op.token, op.layer, -1, s, e, op.nbytes)
        return e

    _weights_inline = True

    def _weights_now(
        self, start: float, layer: int, streamed: tuple[tuple[int, float], tuple[int, float]]
    ) -> float:
        """``_weights_in`` and ``_weights_copy`` fused (the step loop's streamed weights,
        ResourceSpec.nonexpert_streamed): the same copies with the same issue numbers and
        counters, each timed as ``run`` times the yielded copy (``_due`` serves everything
        submitted before it, then it takes the host-to-device lane), in the same order, with
        no generator round trip; returns when the last lands."""
        c = self.c
        if layer > 0:  # the common case: one layer's weights
            lb, ls = streamed[0]
            if lb <= 0:
                return start
            self._seq += 1
            c.h2d_bytes += lb
            c.nonexpert_weight_copies += 1
            c.nonexpert_weight_bytes += lb
            heap = self._heap
            if self._rel or (heap and heap[0][0] <= start):
                self._due(start)
            lane = self._h2d.lane
            free = lane.free_at
            s = start if start > free else free
            e = lane.free_at = s + ls
            lane.busy += ls
            if self._unified:
                self._mem(s, e, lb)
            if self.recorder is not None:
                w = self.hooks.where
                self.recorder.op(lane.name, "weights", w.seq or 0, w.token or 0, layer, -1, s, e,
                                 lb)  # fmt: skip
            return e
        (lb, ls), (eb, es) = streamed
        if layer < 0:
            items: tuple[tuple[str, int, float, int], ...] = (
                ("embedding", eb, es, self.n_layers - 1),
            )
        else:
            items = (("embedding", eb, es, 0), ("weights", lb, ls, 0))
        end = start
        for rkind, nbytes, dur, ll in items:
            if nbytes <= 0:
                continue
            op = WeightCopy(start, self._seq, nbytes, dur, rkind, 0, 0, ll)
            w = self.hooks.where
            op.sid, op.token = w.seq or 0, w.token or 0
            self._seq += 1
            c.h2d_bytes += nbytes
            c.nonexpert_weight_copies += 1
            c.nonexpert_weight_bytes += nbytes
            end = self._weights_copy(op)
        return end

    def _due(self, now: float) -> bool:
        # serves here what run() would serve for the yielded time (the same requests in the
        # same order), sparing the step loop a generator round trip per layer
        if self._rel:
            self._settle_releases(now)
        heap = self._heap
        if heap and heap[0][0] <= now:
            plain = self._plain_ok
            if plain is None:  # the run's fixed conditions, looked up once
                plain = self._plain_ok = self._plain_heap()
            if plain:
                self._serve_plain(None, now)
            else:
                while heap and heap[0][0] <= now:
                    self._serve()
        return False

    #: ``_plain_heap()`` once known (it depends on the run's fixed set-up only)
    _plain_ok: bool | None = None

    def _plain_heap(self) -> bool:
        """Whether ``_serve_plain`` may serve the heap: one GPU, no unified memory, no SSD
        tier."""
        return not self._unified and self._ssd is None and self._peer_home is None

    #: ``_serve_plain``'s one-token CPU call: (work, share, dram, activations out, back)
    _plain_cfg: tuple[float, float, float, float, float] | None = None

    def _plain_config(self) -> tuple[float, float, float, float, float]:
        """``_plain_cfg``, looked up once (the memoised one-token call and copies)."""
        cfg = self._plain_cfg
        if cfg is None:
            work, share, dram = self._one_token_cpu_job()
            one = self._one_token_cpu
            assert one is not None
            cfg = self._plain_cfg = (work, share, dram, one[1], one[2])
        return cfg

    #: ``_serve_plain``'s fixed locals: ``_plain_cfg``, the request heap, the shared CPU, the
    #: push counter and the D2H and H2D lanes
    _plain_locals: tuple[Any, ...] | None = None

    #: the wake-up ``_serve_plain`` holds (see there)
    _held_wake: _Wake

    def _plain_locals_init(self) -> tuple[Any, ...]:
        """``_plain_locals``, gathered once (none of these objects is ever replaced)."""
        v = self._plain_locals = (
            *(self._plain_cfg or self._plain_config()),
            self._heap,
            self._host,
            self._uid,
            self._d2h.lane,
            self._h2d.lane,
        )
        return v

    def _serve_plain(self, op: LayerOp | None, limit: float) -> None:
        """``_serve`` in a loop, until ``op`` has its end time (``op`` given) or while a
        request is submitted at or before ``limit``, with a one-token CPU call's stages and
        the shared CPU's wake-ups served inline (``_cpu_stage``, ``_cpu_wake`` and
        ``_cpu_next`` without unified memory or an SSD tier: the same lanes, the same
        arithmetic, the same records and pushes in the same order); any other request goes to
        ``_serve_op``. Only when :meth:`_plain_heap` holds.

        The request pushed last is held beside the heap (``cx``) and served from there when
        it comes first anyway, sparing a push and a pop; it enters the heap when another push
        comes or the loop ends, unless it is a wake-up made stale meanwhile (which the heap
        would skip). Why this is exact: the heap's order is (time, issue number,
        push number), and two requests never share a time and an issue number (an issue
        number is one request's, and a request waits in one place at a time) except two
        wake-ups of the shared CPU, of which at most one is current (the other is skipped
        whichever comes first); so the push number never decides, and a later push changes
        nothing."""
        work, share, dram, a_out, a_in, heap, host, uid, d2h, h2d = (
            self._plain_locals or self._plain_locals_init()
        )
        push, pop = heapq.heappush, heapq.heappop
        rec = self.recorder
        # a held wake-up is this engine's one reusable _Wake, its version set when it is
        # held (one is held at a time; a copy enters the heap when it must)
        held_wake = self._held_wake
        cx: Any = None  # the held request (time ct, issue number cs), or None
        ct = 0.0
        cs = 0
        while True:
            if op is not None:
                if op.end is not None:
                    break
                if not heap and cx is None:
                    raise RuntimeError(f"engine: operation {op.rkind} can never complete")
            elif cx is None:
                if not heap or heap[0][0] > limit:
                    return
            elif ct > limit and (not heap or heap[0][0] > limit):
                break
            if cx is not None and (
                not heap or ct < (h0 := heap[0])[0] or (ct == h0[0] and cs < h0[1])
            ):
                t, x = ct, cx
                cx = None
            else:
                t, _, _, x = pop(heap)
            kind = x.kind
            if kind == CPU and x.n == 1 and not x.local:
                stage = x.stage
                if stage == 0:  # the activations to the host (Lane.serve, inlined)
                    s = t if t > d2h.free_at else d2h.free_at
                    e = d2h.free_at = s + a_out
                    d2h.busy += a_out
                    if rec is not None:
                        rec.op(d2h.name, "activation", x.sid, x.token, x.layer, x.expert, s, e,
                               self.act_bytes)  # fmt: skip
                    x.stage = 1
                    if cx is not None and (cs != -1 or cx.n == host.version):
                        push(heap, (ct, cs, next(uid), cx if cs != -1 else _Wake(cx.n)))
                    ct, cs, cx = e, x.seq, x
                    continue
                if stage != 1:  # the result back
                    s = t if t > h2d.free_at else h2d.free_at
                    e = h2d.free_at = s + a_in
                    h2d.busy += a_in
                    if rec is not None:
                        rec.op(h2d.name, "activation", x.sid, x.token, x.layer, x.expert, s, e,
                               self.act_bytes)  # fmt: skip
                    x.end = e
                    nxt = x.chain
                    if nxt is not None:
                        if cx is not None and (cs != -1 or cx.n == host.version):
                            push(heap, (ct, cs, next(uid), cx if cs != -1 else _Wake(cx.n)))
                        ct = e if e >= nxt.ssd_at else nxt.ssd_at
                        cs, cx = nxt.seq, nxt
                    continue
                # submit, then _cpu_next's next_event, in one call
                nt = host.submit_next(t, CpuJob(x, x.seq, t, work, share, dram))
            elif kind == WAKE:
                if x.n != host.version:
                    continue  # a later change re-timed it
                done, nt = host.wake_next(t)  # wake, then _cpu_next's next_event
                for job in done:
                    j = job.op
                    if rec is not None:
                        rec.op(host.lanes[job.worker].name, j.rkind, j.sid, j.token, j.layer,
                               j.expert, job.start, t, 0)  # fmt: skip
                    j.stage = 2
                    if cx is not None and (cs != -1 or cx.n == host.version):
                        push(heap, (ct, cs, next(uid), cx if cs != -1 else _Wake(cx.n)))
                    ct, cs, cx = t, j.seq, j
            else:
                self._serve_op(t, x)
                continue
            if nt != INF:
                if cx is not None and cs != -1:  # a held wake-up is stale by now
                    push(heap, (ct, cs, next(uid), cx))
                held_wake.n = host.version
                ct, cs, cx = nt, -1, held_wake
        if cx is not None and (cs != -1 or cx.n == host.version):
            push(heap, (ct, cs, next(uid), cx if cs != -1 else _Wake(cx.n)))

    def _hits_only(
        self, layer: int, routed: list[int], actions: dict[int, Any] | None, now: float
    ) -> float | None:
        # check_plan's common case, _apply's all-hit branch and _layer's all-timed branch,
        # fused: nothing is submitted, so nothing touches the heap
        if actions is not None:
            if actions.__class__ is not dict or len(actions) != len(routed):
                return None
            for e in routed:  # before any row is read: most refusals are here (a miss)
                if actions.get(e) != _GPU:
                    return None
        res = self.res
        # the residency, ready times and prefetched flags through _repeat_rows' flat views
        # (a fraction of a numpy row view and scalar each)
        views = self._repeat_views
        if (
            views is None
            or views[0] is not res.resident
            or views[1] is not res.ready_at
            or views[2] is not res.prefetched
        ):
            views = self._repeat_rows()
        mres, mready, mpre = views[3], views[4], views[5]
        lo = layer * self.n_experts
        jobs = []
        for e in routed:
            if not mres[lo + e]:
                return None  # the general check words the error
            ready = mready[lo + e]
            if ready == INF:
                return None  # its copy is not timed yet
            jobs.append((ready, e))
        c = self.c
        for e in routed:
            if mpre[lo + e]:
                mpre[lo + e] = 0
                c.prefetch_used += 1
        n = len(routed)
        self._accesses(layer, n, n, False)
        if self.recorder is None and not self._unified:
            return self._repeat_gpu(jobs, now)  # _timed_gpu's sums without its branches
        where = self.hooks.where
        return self._timed_gpu(jobs, now, None, where.seq or 0, where.token or 0, layer)

    #: ``_plain_fetches`` has served a plan of this run / refused one (see ``_copies_only``)
    _plain_taken = False
    _plain_refused = 0
    #: ``_prefetch_layer`` likewise
    _pf_taken = False
    _pf_refused = 0

    #: ``_copies_only`` goes straight to ``_whole_layer_repeat`` (set once that path has
    #: served a plan with the probes before it spent and never taken, and the run's fixed
    #: conditions for it: no unified memory, SSD tier, write-back or single stream)
    _wlr_direct = False

    def _copies_only(self, layer: int, routed: list[int], plan: Plan, now: float) -> float | None:
        tried = False  # _whole_layer_repeat has refused this plan already
        if self._wlr_direct:
            # the checks the path below makes before _whole_layer_repeat, less the run's
            # fixed ones and the spent probes (which it would skip); a refusal continues
            # below without calling it again
            actions = plan.actions
            pf = plan.prefetch
            if (
                pf.__class__ is list
                and plan.evict.__class__ is list
                and plan.victims.__class__ is dict
                and actions.__class__ is dict
                and len(actions) == len(routed)
                and plan.evict
                and pf
                and not plan.barrier
                and not plan.low_bit
                and not self.res.waiters
                and len(pf) + len(routed) == self.n_experts
            ):
                end = self._whole_layer_repeat(layer, routed, plan, now)
                if end is not None:
                    return end
                tried = True
        one = self._one_stream
        if one and (self.recorder is not None or self._heap):
            # one stream (ResourceSpec.one_stream): the paths below time it
            # (_one_stream_gpu) only without a recorder and with nothing pending
            return None
        # Why this is exact: without unified memory, such a plan's requests submitted at ``now``
        # are copies (and write-backs). Everything submitted earlier has been served, and what
        # is still pending was submitted later, so the general path serves this layer's
        # requests at once in issue order (write-backs and fetches as the plan's evictions and
        # routed fetches come, temporary copies, prefetches) and then runs the GPU experts by
        # (ready time, expert), exactly as below; a write-back's slot release and an in-use
        # victim's deferred write-back still go through the heap. A temporary copy waiting
        # for a buffer, and CPU calls, are submitted after ``now``: they are only taken here
        # when nothing else is pending at all (the heap then has nothing to serve first).
        # The host thread of a runtime profile (per-expert dispatch and syncs) only touches the
        # GPU experts, which _timed_gpu and _gpu_jobs time as _layer does (in the same order,
        # from the same stream and host clocks), so it needs nothing more here.
        probe = self._plain_taken or self._plain_refused < _PLAIN_PROBES
        if probe:
            # the commonest plans first; a run whose first plans never qualify (CPU experts
            # in every layer: fiddler, llama-cpp-cpu-moe) stops paying for the probe.
            # On one stream it refuses, changing nothing, every plan the check below refuses
            # (a victim it fetches is a routed expert), so that check can wait for a refusal
            end = self._plain_fetches(layer, routed, plan, now)
            if end is not None:
                self._plain_taken = True
                return end
        if one:
            victims, actions = plan.victims, plan.actions
            if victims and victims.__class__ is dict and actions.__class__ is dict:
                for v in victims.values():
                    if (
                        v.__class__ is tuple
                        and len(v) == 2
                        and v[0] == layer
                        and actions.get(v[1]) == _FETCH
                    ):
                        # a victim this very plan fetches (top-2 with one slot per layer):
                        # every check below refuses it, after its work; the general path
                        # times it
                        return None
        if probe:
            self._plain_refused += 1
        if plan.prefetch and not one and (self._pf_taken or self._pf_refused < _PLAIN_PROBES):
            # hits, fetches and prefetches without write-backs (moe-infinity), probed alike
            end = self._prefetch_layer(layer, routed, plan, now)
            if end is not None:
                self._pf_taken = True
                return end
            self._pf_refused += 1
        actions = plan.actions
        res = self.res
        if (
            self._unified
            or self._ssd is not None  # copies wait for drive reads: the general path times them
            or res.waiters
            or actions.__class__ is not dict
            or len(actions) != len(routed)
            or plan.evict.__class__ is not list
            or plan.prefetch.__class__ is not list
            or plan.victims.__class__ is not dict
            or plan.barrier  # a gather barrier is timed by the general path only
        ):
            return None
        if not (plan.evict or plan.prefetch):
            # hits and fetches with victims (the caching policies' miss layers)
            end = self._victim_fetches(layer, routed, plan, now)
            if end is not None:
                return end
        if plan.low_bit:
            return None  # the general one-pass check below times full-precision copies only
        elif (
            not tried
            and not self._wb
            and not one
            and len(plan.prefetch) + len(routed) == self.n_experts
        ):
            # maybe a whole layer streamed in (stream-all, vllm-cpu-offload)
            end = self._whole_layer_repeat(layer, routed, plan, now)
            if end is not None:
                if (
                    not self._plain_taken
                    and self._plain_refused >= _PLAIN_PROBES
                    and not self._pf_taken
                    and self._pf_refused >= _PLAIN_PROBES
                ):
                    self._wlr_direct = True  # (the run's fixed conditions held here)
                return end
        resident, ready_at = res.resident, res.ready_at
        row = resident[layer]
        n_layers, n_exp = self.n_layers, self.n_experts
        wb = self._wb
        in_use_ok = wb and self.spec.evicts_in_use
        # -- the check: check_plan's rules in its order, against this plan's own changes;
        # anything it would refuse (or that is unusual) returns None before any change
        needed: set[int] = set()
        cpu: list[int] = []
        for e in routed:
            a = actions.get(e)
            if a in (_GPU, _FETCH):
                needed.add(e)
            elif a == _CPU:
                cpu.append(e)
            elif a != _TEMP:
                return None  # a pre-calculation or a malformed action
        if cpu and (one or self._heap or not self._host.idle):
            # CPU calls that could queue behind or share with pending work (a one-stream
            # spec's CPU experts: the general path words the refusal)
            return None
        gone: set[Slot] = set()  # slots evicted by this plan
        added: set[Slot] = set()  # slots filled by this plan
        #: what the plan issues, in _apply's order: (kind, slot); kind EVICT, DEFER (an in-use
        #: victim, written back after its computation), FETCH or PREFETCH
        issue: list[tuple[int, Slot]] = []
        n_evs = 0
        n_res = res.n_resident

        def evict(item: Any) -> bool:
            nonlocal n_res
            if item.__class__ is not tuple or len(item) != 2:
                return False
            vl, ve = item
            if vl.__class__ is not int or ve.__class__ is not int:
                return False
            if not (0 <= vl < n_layers and 0 <= ve < n_exp):
                return False
            if item in gone or item in added or not resident[item]:
                return False
            if vl == layer and ve in needed:
                if not in_use_ok:
                    return False
                issue.append((_DEFER, item))
            elif ready_at[item] > now:
                return False  # still being copied
            else:
                issue.append((_EVICT, item))
            gone.add(item)
            n_res -= 1
            return True

        def fill(slot: Slot, victim: Any, kind: int) -> bool:
            nonlocal n_res
            if victim is not None and not evict(victim):
                return False
            if n_res >= budget:
                return False  # all slots full and no victim
            added.add(slot)
            issue.append((kind, slot))
            n_res += 1
            return True

        budget = res.budget
        for item in plan.evict:
            if not evict(item):
                return None
        hits: list[int] = []
        for e in routed:
            if actions[e] == _GPU:
                if not row[e] or (layer, e) in gone or ready_at[layer, e] == INF:
                    return None
                hits.append(e)
        victims = plan.victims
        temps: list[int] = []
        n_fetch = 0
        for e in routed:
            a = actions[e]
            if a in (_GPU, _CPU):
                continue
            slot = (layer, e)
            if slot in added or (row[e] and slot not in gone):
                return None
            if a == _TEMP:
                temps.append(e)
                continue
            if not fill(slot, victims.get(e), FETCH):
                return None
            n_fetch += 1
        n_routed_issue = len(issue)  # temporary copies are issued here
        for item in plan.prefetch:
            if item.__class__ is not tuple or len(item) != 3:
                return None
            pl, pe, v = item
            if pl.__class__ is not int or pe.__class__ is not int:
                return None
            slot = (pl, pe)
            if not (0 <= pl < n_layers and 0 <= pe < n_exp) or slot in added:
                return None
            if (resident[slot] and slot not in gone) or not fill(slot, v, _PREFETCH):
                return None
        n_temp = self.machine.buffers["temp"]
        deferred = in_use_ok and any(k == _DEFER for k, _ in issue)
        if temps and (
            n_temp < 1 or (len(temps) > n_temp and (one or self._heap or cpu or deferred))
        ):
            return None  # (one stream: a copy waiting for a buffer is _layer's to time)
        if cpu and deferred:
            return None  # the GPU loop below with in-use victims does not time CPU experts
        n_evs = len(gone)
        n_copies = len(added)
        # without write-backs an evicted slot is free at once, else when its write-back ends
        if res.occupancy - (0 if wb else n_evs) + n_copies > res.cap:
            return None  # a fetch would wait for a slot
        # -- apply, in _apply's order: residency, counters and issue numbers
        c = self.c
        rec = self.recorder
        eb = self.expert_bytes
        pre = res.prefetched
        where = self.hooks.where
        sid, token = where.seq or 0, where.token or 0
        late: dict[int, LayerOp] = {}  # in-use victims' write-backs by expert
        ops: list[tuple[Any, ...]]  # (kind, slot[, issue number]) in issue order
        if not wb:
            # evictions free their slots at once and issue nothing; the copies are numbered
            for kind, slot in issue:
                if kind == _EVICT:
                    resident[slot] = False
                    if pre[slot]:
                        pre[slot] = False
                        c.prefetch_wasted_bytes += eb
                    if rec is None:
                        res.occupancy -= 1
                    else:
                        res.free(now)
            self._seq += n_copies + len(temps) + len(cpu)
            ops = issue  # _EVICT entries are skipped when serving
            temps_at = n_routed_issue
        else:
            seq = self._seq
            ops = []
            temps_at = -1  # where the temporary copies come in ``ops``
            for i, (kind, slot) in enumerate(issue):
                if i == n_routed_issue:
                    seq += len(temps)  # the temporary copies' issue numbers
                    temps_at = len(ops)
                seq += 1
                if kind == _EVICT:
                    resident[slot] = False
                    if pre[slot]:
                        pre[slot] = False
                        c.prefetch_wasted_bytes += eb
                    ops.append((WRITEBACK, slot, seq))
                elif kind == _DEFER:
                    resident[slot] = False
                    late[slot[1]] = LayerOp(WRITEBACK, "writeback", seq, sid, token, *slot)
                else:
                    ops.append((kind, slot, seq))
            if temps_at < 0:
                seq += len(temps)
                temps_at = len(ops)
            self._seq = seq + len(cpu)
        res.n_resident = n_res
        if n_evs:
            c.evictions += n_evs
            if wb:
                c.d2h_bytes += eb * n_evs
                c.d2h_expert_copies += n_evs
        jobs: list[tuple[float, int, int]] = []
        prow = pre[layer]
        ready_row = ready_at[layer]
        for e in hits:
            if prow[e]:
                prow[e] = False
                c.prefetch_used += 1
            jobs.append((float(ready_row[e]), e, -1))
        n = len(routed)
        self._accesses(layer, n, len(hits), False)
        n_copies += len(temps)
        c.h2d_bytes += eb * n_copies
        c.h2d_expert_copies += n_copies
        c.fetches += n_fetch
        c.temp_copies += len(temps)
        c.prefetches += len(added) - n_fetch
        # -- serve this layer's requests at ``now`` in issue order
        h2d = self._h2d.lane
        dur = self._h2d.expert_s
        serve = h2d.serve
        for i, op in enumerate(ops):
            if i == temps_at and temps:
                self._temp_copies(temps[:n_temp], jobs, now, sid, token, layer)
            kind, slot = op[0], op[1]
            if kind == _EVICT:
                continue
            if kind == WRITEBACK:
                op = LayerOp(WRITEBACK, "writeback", op[2], sid, token, *slot)
                self._serve_op(now, op)  # holds both lanes; its slot is released at its end
                continue
            occ = res.occupancy = res.occupancy + 1  # Residency.take, inlined
            if occ > res.max_occupancy:
                res.max_occupancy = occ
            if rec is not None:
                rec.occupancy(now, occ)
            s, end = serve(now, dur)
            resident[slot] = True
            ready_at[slot] = end
            if kind == FETCH:
                jobs.append((end, slot[1], -1))
            else:
                pre[slot] = True
            if rec is not None:
                rec.op(h2d.name, "fetch" if kind == FETCH else "prefetch", sid, token, *slot,
                       s, end, eb)  # fmt: skip
        if temps_at == len(ops) and temps:
            self._temp_copies(temps[:n_temp], jobs, now, sid, token, layer)
        if one:
            return self._one_stream_gpu([(r, e) for r, e, _ in jobs], late, now)
        if len(temps) > n_temp or late:
            return self._gpu_jobs(jobs, deque(temps[n_temp:]), late, now, sid, token, layer)
        if not cpu:
            return self._timed_gpu([(r, e) for r, e, _ in jobs], now, None, sid, token, layer)
        if plan.cpu_serial or len(cpu) == 1:
            done = self._cpu_calls(cpu, now, sid, token, layer)
        else:
            done = self._cpu_parallel(cpu, now, sid, token, layer)
        g = now
        if plan.cpu_first and done > now:  # the GPU experts wait for the CPU ones
            c.cpu_wait += done - now
            g = done
        end = self._timed_gpu([(r, e) for r, e, _ in jobs], g, None, sid, token, layer)
        if done > end:
            c.cpu_wait += done - end
            end = done
        return end

    def _victim_fetches(
        self, layer: int, routed: list[int], plan: Plan, now: float
    ) -> float | None:
        """``_copies_only`` for a plan of resident experts, fetches (each with or without a
        victim, written back or not, in use or not), temporary copies and CPU experts, with
        no evict list and no prefetches: the same checks in the same order, applied and timed
        as ``_copies_only`` does, without its general bookkeeping; returns when the layer
        ends, or None (nothing changed) to let ``_copies_only`` go on."""
        actions = plan.actions
        assert actions is not None
        res = self.res
        resident, ready_at = res.resident, res.ready_at
        row = resident[layer]
        hits: list[int] = []
        fetch: list[int] = []
        cpu: list[int] = []
        temps: list[int] = []
        for e in routed:
            a = actions.get(e)
            if a == _GPU:
                hits.append(e)
            elif a == _FETCH:
                fetch.append(e)
            elif a == _CPU:
                cpu.append(e)
            elif a == _TEMP:
                temps.append(e)
            else:
                return None
        one = self._one_stream
        if cpu and (one or self._heap or not self._host.idle):
            return None  # CPU calls that could queue behind or share with pending work
        n_temp = self.machine.buffers["temp"]
        if temps:
            if n_temp < 1 or (len(temps) > n_temp and (one or self._heap or cpu)):
                return None  # as _copies_only: a copy waiting for a buffer needs a quiet heap
            for e in temps:
                if row[e]:
                    return None  # a temporary copy of a resident expert
        low = plan.low_bit
        if low:
            # check_plan's _check_low_bit: routed TEMP copies on a system with low-bit copies
            if self.spec.low_bit_dtype is None or len(temps) > n_temp:
                return None  # (a copy waiting for a buffer: the general path times it)
            for e in low:
                if e not in temps:
                    return None
        ready_row = ready_at[layer]
        for e in hits:  # resident and timed (no evictions come before them)
            if not row[e] or ready_row[e] == INF:
                return None
        victims = plan.victims
        n_layers, n_exp = self.n_layers, self.n_experts
        n_res = res.n_resident
        budget = res.budget
        wb = self._wb
        in_use_ok = wb and self.spec.evicts_in_use
        gone: list[Slot] = []  # victims, in issue order
        #: with write-back, what the plan issues in order: (kind, slot), kind _EVICT, _DEFER
        #: (an in-use victim, written back after its computation) or FETCH
        issue: list[tuple[int, Slot]] = []
        n_defer = 0
        if len(fetch) > 1 and len(set(fetch)) != len(fetch):
            return None  # an expert fetched twice
        for e in fetch:
            if row[e]:
                return None  # already resident
            v = victims.get(e)
            if v is not None:
                # _copies_only's evict(): a resident, timed expert nobody uses in this layer,
                # or with in-use evictions one of this layer's hits
                if v.__class__ is not tuple or len(v) != 2:
                    return None
                vl, ve = v
                if vl.__class__ is not int or ve.__class__ is not int:
                    return None
                if not (0 <= vl < n_layers and 0 <= ve < n_exp) or v in gone:
                    return None
                if not resident[v]:
                    return None
                if vl == layer and ve in routed:
                    if not (in_use_ok and ve in hits):
                        return None  # in use without in-use evictions (or not a hit)
                    kind = _DEFER
                    n_defer += 1
                elif ready_at[v] > now:
                    return None  # still being copied
                else:
                    kind = _EVICT
                gone.append(v)
                if wb:
                    issue.append((kind, v))
                n_res -= 1
            if n_res >= budget:
                return None  # all slots full and no victim
            n_res += 1
            if wb:
                issue.append((FETCH, (layer, e)))
        n_evs = len(gone)
        n_copies = len(fetch)
        if n_defer and len(temps) > n_temp:
            return None  # as _copies_only: a copy waiting for a buffer needs a quiet heap
        if n_defer and cpu:
            return None  # CPU experts beside an in-use victim: the general path times both
        if n_defer and low:
            return None  # low-bit copies beside an in-use victim: the general path times both
        # without write-backs an evicted slot is free at once, else when its write-back ends
        if res.occupancy - (0 if wb else n_evs) + n_copies > res.cap:
            return None  # a fetch would wait for a slot
        # -- apply, as _copies_only: residency, counters and issue numbers
        c = self.c
        rec = self.recorder
        eb = self.expert_bytes
        pre = res.prefetched
        where = self.hooks.where
        sid, token = where.seq or 0, where.token or 0
        late: dict[int, LayerOp] = {}  # in-use victims' write-backs by expert
        wbs: dict[Slot, int] = {}  # write-backs' issue numbers by slot
        if not wb:  # evictions free their slots at once and issue nothing
            for v in gone:
                resident[v] = False
                if pre[v]:
                    pre[v] = False
                    c.prefetch_wasted_bytes += eb
                if rec is None:
                    res.occupancy -= 1
                else:
                    res.free(now)
            self._seq += n_copies + len(temps) + len(cpu)
        else:
            seq = self._seq
            for kind, slot in issue:
                seq += 1
                if kind == _EVICT:
                    resident[slot] = False
                    if pre[slot]:
                        pre[slot] = False
                        c.prefetch_wasted_bytes += eb
                    wbs[slot] = seq
                elif kind == _DEFER:
                    resident[slot] = False
                    late[slot[1]] = LayerOp(WRITEBACK, "writeback", seq, sid, token, *slot)
            self._seq = seq + len(temps) + len(cpu)
        res.n_resident = n_res
        if n_evs:
            c.evictions += n_evs
            if wb:
                c.d2h_bytes += eb * n_evs
                c.d2h_expert_copies += n_evs
        jobs: list[tuple[float, int]] = []
        prow = pre[layer]
        for e in hits:
            if prow[e]:
                prow[e] = False
                c.prefetch_used += 1
            jobs.append((float(ready_row[e]), e))
        n = len(routed)
        n_hits = len(hits)
        self._accesses(layer, n, n_hits, False)
        n_h2d = n_copies + len(temps)
        if low:  # as _apply: a low-bit copy moves the host's low-precision copy
            n_low = sum(1 for e in temps if e in low)
            c.low_bit_copies += n_low
            c.h2d_bytes += eb * (n_h2d - n_low) + self.machine.low_bit_bytes * n_low
        else:
            c.h2d_bytes += eb * n_h2d
        c.h2d_expert_copies += n_h2d
        c.fetches += n_copies
        c.temp_copies += len(temps)
        if wbs:
            # write-backs and fetches interleaved in issue order: a write-back holds both
            # lanes and releases its slot (through the heap) when it ends
            lane = self._h2d.lane
            dur = self._h2d.expert_s
            for kind, slot in issue:
                if kind == _EVICT:
                    op = LayerOp(WRITEBACK, "writeback", wbs[slot], sid, token, *slot)
                    self._serve_op(now, op)
                elif kind == FETCH:
                    e = slot[1]
                    occ = res.occupancy = res.occupancy + 1  # Residency.take, inlined
                    if occ > res.max_occupancy:
                        res.max_occupancy = occ
                    if rec is not None:
                        rec.occupancy(now, occ)
                    s = now if now > lane.free_at else lane.free_at  # Lane.serve, inlined
                    end = lane.free_at = s + dur
                    lane.busy += dur
                    row[e] = True
                    ready_row[e] = end
                    jobs.append((end, e))
                    if rec is not None:
                        rec.op(lane.name, "fetch", sid, token, layer, e, s, end, eb)
            fetch = []  # served
        if fetch:
            lane = self._h2d.lane
            dur = self._h2d.expert_s
            for e in fetch:
                occ = res.occupancy = res.occupancy + 1  # Residency.take, inlined
                if occ > res.max_occupancy:
                    res.max_occupancy = occ
                if rec is not None:
                    rec.occupancy(now, occ)
                s = now if now > lane.free_at else lane.free_at  # Lane.serve, inlined
                end = lane.free_at = s + dur
                lane.busy += dur
                row[e] = True
                ready_row[e] = end
                jobs.append((end, e))
                if rec is not None:
                    rec.op(lane.name, "fetch", sid, token, layer, e, s, end, eb)
        if temps and not late and len(temps) <= n_temp:
            # issued after the routed fetches, one buffer each (_temp_copies, inlined)
            lane = self._h2d.lane
            dur = self._h2d.expert_s
            for e in temps:
                if low and e in low:  # as _serve_op: the low-bit copy's bytes and time
                    m = self.machine
                    s, end = lane.serve(now, m.low_bit_s)
                    if rec is not None:
                        rec.op(lane.name, "temp", sid, token, layer, e, s, end, m.low_bit_bytes)
                else:
                    s, end = lane.serve(now, dur)
                    if rec is not None:
                        rec.op(lane.name, "temp", sid, token, layer, e, s, end, eb)
                jobs.append((end, e))
        elif temps or late:
            # temporary copies are issued after the routed fetches, one buffer each
            tjobs = [(r, e, -1) for r, e in jobs]
            if temps:
                self._temp_copies(temps[:n_temp], tjobs, now, sid, token, layer)
            if (len(temps) > n_temp or late) and not one:
                return self._gpu_jobs(tjobs, deque(temps[n_temp:]), late, now, sid, token, layer)
            jobs = [(r, e) for r, e, _ in tjobs]
        if one:
            return self._one_stream_gpu(jobs, late, now)
        if not cpu:
            return self._timed_gpu(jobs, now, None, sid, token, layer)
        # the CPU experts, as _copies_only times them
        if plan.cpu_serial or len(cpu) == 1:
            done = self._cpu_calls(cpu, now, sid, token, layer)
        else:
            done = self._cpu_parallel(cpu, now, sid, token, layer)
        g = now
        if plan.cpu_first and done > now:  # the GPU experts wait for the CPU ones
            c.cpu_wait += done - now
            g = done
        end = self._timed_gpu(jobs, g, None, sid, token, layer)
        if done > end:
            c.cpu_wait += done - end
            end = done
        return end

    def _plain_fetches(self, layer: int, routed: list[int], plan: Plan, now: float) -> float | None:
        """``_copies_only`` by way of ``_victim_fetches`` for their commonest plans, without
        ``_copies_only``'s preamble and ``_victim_fetches``' rarer branches: resident experts,
        fetches (each with or without a victim that no routed expert is, written back or not)
        and at most one temporary copy per buffer (maybe low-bit); no CPU experts, evict list,
        prefetches or barrier (the moe-infinity, hobbit and mixtral-offloading miss layers).
        The checks are theirs (anything else, or anything they would refuse, returns None
        before any change, and ``_copies_only`` goes on as before); the plan is applied and
        timed as ``_victim_fetches`` does it: the same issue numbers, counters and sums in the
        same order. Without a recorder ``_copy_layer_wb`` does the same through flat views."""
        evict, prefetch = plan.evict, plan.prefetch
        if evict or prefetch or plan.barrier:
            return None
        actions = plan.actions
        res = self.res
        victims = plan.victims
        if (
            actions.__class__ is not dict
            or len(actions) != len(routed)
            or victims.__class__ is not dict
            or evict.__class__ is not list
            or prefetch.__class__ is not list
            or res.waiters
            or self._unified
            or self._ssd is not None
        ):
            return None
        if self.recorder is None:
            # the same rules through flat views (write-backs and low-bit copies included)
            return self._copy_layer_wb(layer, routed, plan, now)
        resident, ready_at = res.resident, res.ready_at
        row = resident[layer]
        ready_row = ready_at[layer]
        hits: list[int] = []
        fetch: list[int] = []
        temps: list[int] = []
        for e in routed:
            a = actions.get(e)
            if a == _GPU:
                if not row[e] or ready_row[e] == INF:
                    return None  # not resident, or its copy not timed yet
                hits.append(e)
            elif a == _FETCH:
                if row[e]:
                    return None  # already resident
                fetch.append(e)
            elif a == _TEMP:
                if row[e]:
                    return None  # a temporary copy of a resident expert
                temps.append(e)
            else:
                return None  # CPU experts, pre-calculations, malformed actions
        n_temp = self.machine.buffers["temp"]
        if len(temps) > n_temp:
            return None  # a copy waiting for a buffer (or no buffer at all)
        low = plan.low_bit
        if low:
            # check_plan's _check_low_bit: routed TEMP copies on a system with low-bit copies
            if self.spec.low_bit_dtype is None:
                return None
            for e in low:
                if e not in temps:
                    return None
        wb = self._wb
        n_copies = len(fetch)
        gone: list[Slot] = []  # victims, in issue order
        #: with write-back, what the plan issues in order: (_EVICT, victim) or (FETCH, slot)
        issue: list[tuple[int, Slot]] = []
        if n_copies:
            if n_copies > 1 and len(set(fetch)) != n_copies:
                return None  # an expert fetched twice
            n_layers, n_exp = self.n_layers, self.n_experts
            n_res = res.n_resident
            budget = res.budget
            for e in fetch:
                v = victims.get(e)
                if v is not None:
                    if v.__class__ is not tuple or len(v) != 2:
                        return None
                    vl, ve = v
                    if vl.__class__ is not int or ve.__class__ is not int:
                        return None
                    if not (0 <= vl < n_layers and 0 <= ve < n_exp) or v in gone:
                        return None
                    if vl == layer:  # (the layer's rows: cheaper to index)
                        if ve in routed:
                            return None  # an in-use victim: _victim_fetches decides
                        if not row[ve] or ready_row[ve] > now:
                            return None  # not resident, or still being copied
                    elif not resident[v] or ready_at[v] > now:
                        return None  # not resident, or still being copied
                    gone.append(v)
                    if wb:
                        issue.append((_EVICT, v))
                    n_res -= 1
                if n_res >= budget:
                    return None  # all slots full and no victim
                n_res += 1
                if wb:
                    issue.append((FETCH, (layer, e)))
            # without write-backs an evicted slot is free at once, else when its write-back ends
            if res.occupancy - (0 if wb else len(gone)) + n_copies > res.cap:
                return None  # a fetch would wait for a slot
            res.n_resident = n_res
        # -- apply, as _victim_fetches: residency, counters and issue numbers
        c = self.c
        rec = self.recorder
        eb = self.expert_bytes
        pre = res.prefetched
        where = self.hooks.where
        sid, token = where.seq or 0, where.token or 0
        n_evs = len(gone)
        wbs: dict[Slot, int] = {}  # write-backs' issue numbers by slot
        if not wb:  # evictions free their slots at once and issue nothing
            for v in gone:
                resident[v] = False
                if pre[v]:
                    pre[v] = False
                    c.prefetch_wasted_bytes += eb
                if rec is None:
                    res.occupancy -= 1
                else:
                    res.free(now)
            self._seq += n_copies + len(temps)
        else:
            seq = self._seq
            for kind, slot in issue:
                seq += 1
                if kind == _EVICT:
                    resident[slot] = False
                    if pre[slot]:
                        pre[slot] = False
                        c.prefetch_wasted_bytes += eb
                    wbs[slot] = seq
            self._seq = seq + len(temps)
        if n_evs:
            c.evictions += n_evs
            if wb:
                c.d2h_bytes += eb * n_evs
                c.d2h_expert_copies += n_evs
        jobs: list[tuple[float, int]] = []
        prow = pre[layer]
        for e in hits:
            if prow[e]:
                prow[e] = False
                c.prefetch_used += 1
            jobs.append((float(ready_row[e]), e))
        n = len(routed)
        n_hits = len(hits)
        self._accesses(layer, n, n_hits, False)
        n_h2d = n_copies + len(temps)
        if low:  # as _apply: a low-bit copy moves the host's low-precision copy
            n_low = len(low)  # each low-bit expert is one of the temporary copies (distinct)
            c.low_bit_copies += n_low
            c.h2d_bytes += eb * (n_h2d - n_low) + self.machine.low_bit_bytes * n_low
        else:
            c.h2d_bytes += eb * n_h2d
        c.h2d_expert_copies += n_h2d
        c.fetches += n_copies
        c.temp_copies += len(temps)
        lane = self._h2d.lane
        dur = self._h2d.expert_s
        if wbs:
            # write-backs and fetches interleaved in issue order: a write-back holds both
            # lanes and releases its slot (through the heap) when it ends (_serve_op's first
            # stage of a write-back and _push, inlined: no unified memory here)
            d2h = self._d2h.lane
            wb_s = self._d2h.expert_s
            heap = self._heap
            uid = self._uid
            # None: slot releases go through the heap
            rel = self._rel if self._rel_ok else self._releases()
            for kind, slot in issue:
                if kind == _EVICT:
                    s = lane.free_at
                    if d2h.free_at > s:
                        s = d2h.free_at
                    if now > s:
                        s = now  # max(now, both lanes' free times)
                    end = s + wb_s
                    lane.free_at = d2h.free_at = end
                    d2h.busy += wb_s
                    if rec is not None:
                        rec.op(d2h.name, "writeback", sid, token, *slot, s, end, eb)
                    if rel is not None and (not rel or rel[-1][0] <= end):
                        # its slot release, held back until the next decision (see _releases)
                        rel.append((end, wbs[slot], sid, token, *slot))
                        continue
                    op = LayerOp(WRITEBACK, "writeback", wbs[slot], sid, token, *slot)
                    op.end = end
                    op.stage = 1
                    heapq.heappush(heap, (end, op.seq, next(uid), op))
                else:
                    e = slot[1]
                    occ = res.occupancy = res.occupancy + 1  # Residency.take, inlined
                    if occ > res.max_occupancy:
                        res.max_occupancy = occ
                    if rec is not None:
                        rec.occupancy(now, occ)
                    s = now if now > lane.free_at else lane.free_at  # Lane.serve, inlined
                    end = lane.free_at = s + dur
                    lane.busy += dur
                    row[e] = True
                    ready_row[e] = end
                    jobs.append((end, e))
                    if rec is not None:
                        rec.op(lane.name, "fetch", sid, token, layer, e, s, end, eb)
        else:
            for e in fetch:
                occ = res.occupancy = res.occupancy + 1  # Residency.take, inlined
                if occ > res.max_occupancy:
                    res.max_occupancy = occ
                if rec is not None:
                    rec.occupancy(now, occ)
                s = now if now > lane.free_at else lane.free_at  # Lane.serve, inlined
                end = lane.free_at = s + dur
                lane.busy += dur
                row[e] = True
                ready_row[e] = end
                jobs.append((end, e))
                if rec is not None:
                    rec.op(lane.name, "fetch", sid, token, layer, e, s, end, eb)
        # issued after the routed fetches, one buffer each (_temp_copies, inlined)
        for e in temps:
            if low and e in low:  # as _serve_op: the low-bit copy's bytes and time
                m = self.machine
                s, end = lane.serve(now, m.low_bit_s)
                if rec is not None:
                    rec.op(lane.name, "temp", sid, token, layer, e, s, end, m.low_bit_bytes)
            else:
                s, end = lane.serve(now, dur)
                if rec is not None:
                    rec.op(lane.name, "temp", sid, token, layer, e, s, end, eb)
            jobs.append((end, e))
        m = self.machine
        if m.host_experts is not None:  # (no unified memory here)
            return self._timed_gpu_one(jobs, now, sid, token, layer)
        if rec is not None:
            return self._timed_gpu(jobs, now, None, sid, token, layer)
        # _timed_gpu without a recorder, host thread or unified memory, written out: the
        # experts by (ready time, expert) on the GPU stream, the same sums in the same order
        jobs.sort()
        g = now
        busy = 0.0
        d1 = m.gpu_s(1)
        fused = m.fused_launch_s  # the layer's fused call, with its first expert
        for ready, _e in jobs:
            if ready > g:
                c.transfer_stall += ready - g
                g = ready
            d = d1 + fused
            fused = 0.0
            g += d
            busy += d
        c.gpu_expert_busy += busy
        m.gpu.busy += busy
        return g

    def _timed_gpu_one(
        self, jobs: list[tuple[float, int]], now: float, sid: int, token: int, layer: int
    ) -> float:
        """``_timed_gpu`` for one decode token without unified memory (no per-expert counts,
        no DRAM sharing): the same host-thread calls, records and sums in the same order."""
        jobs.sort()
        c = self.c
        g = now
        busy = 0.0
        rec = self.recorder
        m = self.machine
        host = m.host_experts
        d1 = m.gpu_s(1)  # one decode token per expert
        fused = m.fused_launch_s  # the layer's fused call, with its first expert
        for ready, e in jobs:
            drained = g
            if ready > g:
                c.transfer_stall += ready - g
                g = ready
            d = d1 + fused
            fused = 0.0
            if host is not None:  # the stream may wait for the host thread to issue it
                wait = host.expert(drained, g, d) - d - g
                if wait > 0.0:
                    c.dispatch_stall += wait
                    g += wait  # the same sum as the reference engine's timeout
            if rec is not None:
                rec.op("gpu", "expert", sid, token, layer, e, g, g + d, 0)
            g += d
            busy += d
        c.gpu_expert_busy += busy
        m.gpu.busy += busy
        return g

    # -- write-backs' slot releases without the heap (mixtral-offloading's miss layers) ---------
    #: write-back slot releases ``_plain_fetches`` has not put on the heap, in heap order:
    #: (end, issue number, sid, token, layer, expert); empty outside a decode layer's gap
    _rel: deque[tuple[float, int, int, int, int, int]] | tuple[()] = ()
    #: whether this run may hold releases back (None: not decided yet)
    _rel_ok: bool | None = None

    def _releases(self) -> deque[tuple[float, int, int, int, int, int]] | None:
        """The queue of held-back slot releases, or None when this run must push them on the
        heap. Why holding them back is exact: a release is the heap's second stage of a
        write-back, served at its end time as ``_release``. Between the layer that issues it
        and the next decision nothing reads the heap or the slots (one GPU, no unified memory
        or SSD tier, no CPU-resident layers, no serving loop: only the step loop's own
        arithmetic runs there), and the next decision's ``_due`` settles the queue first:
        with nothing else pending it releases the due slots in the heap's (end, issue number)
        order through the same ``_release``, else it pushes every entry on the heap with the
        same key, so any later serving sees exactly the heap it would have seen. Entries are
        appended with non-decreasing ends (the write-backs share the copy stream) and issue
        numbers, so the queue's order is the heap's; an entry that would break that order
        goes on the heap instead (``_plain_fetches``)."""
        ok = self._rel_ok
        if ok is None:
            ok = self._rel_ok = (
                self.serving is None
                and self._plain_heap()
                and not self.n_cpu_layers
                and self.__class__ is Engine
            )
            if ok:
                self._rel = deque()
        return self._rel if ok else None  # type: ignore[return-value]

    def _settle_releases(self, now: float) -> None:
        """Before the decision at ``now``: serve the held-back releases due by then as the
        heap would (in order, each through ``_release``) when nothing else is pending; else,
        or for any entry not yet due, put them on the heap with their heap keys."""
        rel: deque[Any] = self._rel  # type: ignore[assignment]
        res = self.res
        if not (self._heap or res.waiters):
            if res.recorder is None:  # Residency.free without a recorder: one slot each
                n = 0
                while rel and rel[0][0] <= now:
                    rel.popleft()
                    n += 1
                res.occupancy -= n
            else:
                free = res.free  # _release with no waiter (releasing one adds none)
                while rel and rel[0][0] <= now:
                    free(rel.popleft()[0])
            if not rel:
                return
        self._flush_releases()

    def _flush_releases(self) -> None:
        """Put every held-back release on the heap as the write-back's second stage, with
        the key ``_plain_fetches`` would have pushed it with (end, issue number)."""
        rel: deque[Any] = self._rel  # type: ignore[assignment]
        heap, uid = self._heap, self._uid
        for end, seq, sid, token, layer, expert in rel:
            op = LayerOp(WRITEBACK, "writeback", seq, sid, token, layer, expert)
            op.end = end
            op.stage = 1
            heapq.heappush(heap, (end, seq, next(uid), op))
        rel.clear()

    #: per layer, its (layer, expert) slots and (layer, expert, None) prefetch entries in
    #: expert order (built on first use by _whole_layer_copies)
    _whole_layer_lists: tuple[list[list[Slot]], list[list[tuple[int, int, None]]]] | None = None

    def _whole_layer_copies(
        self, layer: int, routed: list[int], plan: Plan, now: float
    ) -> float | None:
        """``_copies_only`` for a plan that streams a whole layer in (no write-back): it evicts
        every resident expert of one other layer (expert order), fetches the routed experts
        and prefetches all the others (expert order, no victims) into a layer with nothing
        resident. Checked in bulk against rows of the residency, applied and timed exactly as
        ``_copies_only`` does item by item (same issue order, same sums); returns when the
        layer ends, or None (nothing changed) to let ``_copies_only`` check item by item."""
        actions = plan.actions
        assert actions is not None
        if plan.victims:
            return None
        for e in routed:
            if actions[e] != _FETCH:
                return None
        n_layers, n_exp = self.n_layers, self.n_experts
        lists = self._whole_layer_lists
        if lists is None:
            lists = self._whole_layer_lists = (
                [[(ll, e) for e in range(n_exp)] for ll in range(n_layers)],
                [[(ll, e, None) for e in range(n_exp)] for ll in range(n_layers)],
            )
        res = self.res
        resident, ready_at = res.resident, res.ready_at
        if True in resident[layer].tolist():
            return None
        want = set(routed)
        pf = plan.prefetch
        if pf != [t for t in lists[1][layer] if t[1] not in want]:
            return None
        for item in pf:  # equal values; the general check also wants these exact types
            if item.__class__ is not tuple or item[1].__class__ is not int or item[2] is not None:
                return None
        if layer.__class__ is not int or (pf and pf[0][0].__class__ is not int):
            return None
        ev = plan.evict
        vl = -1
        if ev:
            first = ev[0]
            if first.__class__ is not tuple or len(first) != 2:
                return None
            vl = first[0]
            if vl.__class__ is not int or not 0 <= vl < n_layers or vl == layer:
                return None
            rrow = resident[vl].tolist()
            if ev != [s for s, r in zip(lists[0][vl], rrow, strict=True) if r]:
                return None
            arow = ready_at[vl].tolist()
            for item in ev:
                if item.__class__ is not tuple or item[0].__class__ is not int:
                    return None
                ve = item[1]
                if ve.__class__ is not int or arow[ve] > now:
                    return None  # still being copied (or not a plain int)
        n_ev = len(ev)
        n_copies = n_exp
        n_res = res.n_resident - n_ev + n_copies
        if n_res > res.budget or res.occupancy - n_ev + n_copies > res.cap:
            return None  # a fill with all slots full, or a fetch waiting for a slot
        # -- apply, as _copies_only: evictions free their slots at once (no write-back)
        c = self.c
        rec = self.recorder
        eb = self.expert_bytes
        pre = res.prefetched
        if ev:
            rrow_v = resident[vl]
            prow_v = pre[vl]
            plist = prow_v.tolist()
            if n_ev == n_exp:  # the whole row goes (one call instead of one write each)
                rrow_v.fill(False)
            for _, ve in ev:
                if n_ev != n_exp:
                    rrow_v[ve] = False
                if plist[ve]:
                    prow_v[ve] = False
                    c.prefetch_wasted_bytes += eb
                if rec is not None:
                    res.free(now)
            if rec is None:
                res.occupancy -= n_ev
            c.evictions += n_ev
        self._seq += n_copies
        res.n_resident = n_res
        n = len(routed)
        self._accesses(layer, n, 0, False)  # no hit
        c.h2d_bytes += eb * n_copies
        c.h2d_expert_copies += n_copies
        c.fetches += n
        c.prefetches += n_copies - n
        where = self.hooks.where
        sid, token = where.seq or 0, where.token or 0
        # -- serve the copies at ``now`` in issue order: the routed fetches, the prefetches
        link = self._h2d
        lane = link.lane
        dur = link.expert_s
        free, busy = lane.free_at, lane.busy
        rrow, arow_w, prow = resident[layer], ready_at[layer], pre[layer]
        occ, max_occ = res.occupancy, res.max_occupancy
        jobs: list[tuple[float, int]] = []
        kind = "fetch"
        rrow.fill(True)  # every expert of the layer is copied in below
        for e in [*routed, *(t[1] for t in pf)]:
            occ += 1
            if rec is not None:
                rec.occupancy(now, occ)
            s = now if now > free else free  # Lane.serve, inlined
            free = s + dur
            busy += dur
            arow_w[e] = free
            if e in want:
                jobs.append((free, e))
            else:
                prow[e] = True
                kind = "prefetch"
            if rec is not None:
                rec.op(lane.name, kind, sid, token, layer, e, s, free, eb)
        lane.free_at, lane.busy = free, busy
        res.occupancy = occ
        if occ > max_occ:
            res.max_occupancy = occ
        return self._timed_gpu(jobs, now, None, sid, token, layer)

    #: _whole_layer_repeat's memo of plan items already checked by _whole_layer_copies:
    #: (layer, routed experts) -> (the prefetch list's tuples, the routed experts' actions,
    #: the prefetched experts in issue order), and victim layer -> its full evict list's slot
    #: tuples (kept alive, so identity proves them)
    _repeat_prefetch: dict[tuple[int, ...], tuple[list[Any], dict[int, Any], list[int]]] | None
    _repeat_prefetch = None
    _repeat_evict: dict[int, list[Any]] | None = None
    #: _whole_layer_repeat's flat views of the residency arrays and its two row patterns
    #: (see _repeat_rows)
    _repeat_views: tuple[Any, ...] | None = None

    def _repeat_rows(self) -> tuple[Any, ...]:
        """Flat memoryviews of the residency mask (bytes), the ready times (doubles) and the
        prefetched flags (bytes), row ``l`` at ``[l * E, (l + 1) * E)``, and a row of zero
        and of one bytes: reading a row, or writing one element, through them costs a
        fraction of a numpy row view. They alias the arrays (made again if the arrays were
        ever replaced)."""
        res = self.res
        v = self._repeat_views
        if (
            v is None
            or v[0] is not res.resident
            or v[1] is not res.ready_at
            or v[2] is not res.prefetched
        ):
            n = self.n_experts
            v = self._repeat_views = (
                res.resident,
                res.ready_at,
                res.prefetched,
                memoryview(res.resident).cast("B"),
                memoryview(res.ready_at).cast("B").cast("d"),
                memoryview(res.prefetched).cast("B"),
                bytes(n),
                bytes((1,)) * n,
            )
        return v

    def _whole_layer_repeat(
        self, layer: int, routed: list[int], plan: Plan, now: float
    ) -> float | None:
        """``_whole_layer_copies`` for a plan made of the very objects of one it has already
        checked (stream-all builds each layer's plan from the same tuples every token): the
        item-by-item value and type checks are proven by identity with the memo, the rest
        (the routed experts' actions, residency rows, victims' ready times, slot budget) is
        checked as there, and it is applied with the same issue order and sums, through flat
        views of the residency arrays (``_repeat_rows``). Without a recorder only; anything
        else (a first sight, a partial evict list) goes to ``_whole_layer_copies``, whose
        successful checks fill the memo."""
        pf = plan.prefetch
        ev = plan.evict
        if self.recorder is not None or plan.victims:
            return self._whole_layer_copies(layer, routed, plan, now)
        memo_pf, memo_ev = self._repeat_prefetch, self._repeat_evict
        if memo_pf is None or memo_ev is None:
            memo_pf, memo_ev = self._repeat_prefetch, self._repeat_evict = {}, {}
        key = (layer, *routed)
        known = memo_pf.get(key)
        n_exp = self.n_experts
        vl = -1
        if ev:
            first = ev[0]
            if first.__class__ is tuple and len(first) == 2:
                vl = first[0]
            known_ev = memo_ev.get(vl) if vl.__class__ is int else None
            if known_ev is None or len(ev) != n_exp or not all(map(is_, ev, known_ev)):
                return self._whole_layer_copies_memo(layer, routed, plan, now, key)
        if (
            known is None
            or layer.__class__ is not int
            or len(pf) != len(known[0])
            or not all(map(is_, pf, known[0]))
        ):
            return self._whole_layer_copies_memo(layer, routed, plan, now, key)
        # every routed expert is a FETCH (the same comparisons as _whole_layer_copies'; a
        # dict naming other experts is not equal either)
        if plan.actions != known[1]:
            return None
        res = self.res
        views = self._repeat_views
        if (
            views is None
            or views[0] is not res.resident
            or views[1] is not res.ready_at
            or views[2] is not res.prefetched
        ):
            views = self._repeat_rows()
        _, _, _, mres, mready, mpre, none, every = views
        lo = layer * n_exp
        hi = lo + n_exp
        # the mask's bytes, copied once: two bytes slices compare faster than two
        # memoryview slices (the same bytes either way)
        rb = mres.tobytes()
        if rb[lo:hi] != none:
            return None  # something of the layer is resident
        vlo = vhi = 0
        if ev:
            if not 0 <= vl < self.n_layers or vl == layer:
                return self._whole_layer_copies_memo(layer, routed, plan, now, key)
            vlo = vl * n_exp
            vhi = vlo + n_exp
            if rb[vlo:vhi] != every:  # not every expert of the victim layer is resident
                return self._whole_layer_copies_memo(layer, routed, plan, now, key)
            # (no ready time is NaN: they are sums of finite durations, or inf)
            if max(mready[vlo:vhi]) > now:
                return None  # still being copied
        n_ev = len(ev)
        n_res = res.n_resident - n_ev + n_exp
        if n_res > res.budget or res.occupancy - n_ev + n_exp > res.cap:
            return None  # a fill with all slots full, or a fetch waiting for a slot
        # -- apply, as _whole_layer_copies with every resident expert of layer vl evicted
        c = self.c
        eb = self.expert_bytes
        if ev:
            mres[vlo:vhi] = none
            n_wasted = mpre.tobytes().count(1, vlo, vhi)
            if n_wasted:
                mpre[vlo:vhi] = none
                c.prefetch_wasted_bytes += eb * n_wasted  # whole numbers: any order
            res.occupancy -= n_ev
            c.evictions += n_ev
        self._seq += n_exp
        res.n_resident = n_res
        n = len(routed)
        # _accesses(layer, n, 0, False), written out (no hit: the hit counts stay)
        c.decode_accesses += n
        self._acc[layer] += n
        c.h2d_bytes += eb * n_exp
        c.h2d_expert_copies += n_exp
        c.fetches += n
        c.prefetches += n_exp - n
        # -- serve the copies at ``now`` in issue order, the routed fetches then the
        # prefetches, back to back on the lane (Lane.serve's sums: once the first has
        # started, no earlier than ``now``, each starts when the one before it ends)
        lane = self._h2d.lane
        dur = self._h2d.expert_s
        free, busy = lane.free_at, lane.busy
        if now > free:
            free = now
        readies: list[float] = []
        for e in routed:
            free += dur
            busy += dur
            mready[lo + e] = free
            readies.append(free)
        for e in known[2]:
            free += dur
            busy += dur
            mready[lo + e] = free
            mpre[lo + e] = 1
        lane.free_at, lane.busy = free, busy
        mres[lo:hi] = every
        occ = res.occupancy + n_exp
        res.occupancy = occ
        if occ > res.max_occupancy:
            res.max_occupancy = occ
        # -- the GPU experts (_repeat_gpu's sums; the routed copies land back to back, so
        # their ready times never decrease and come in (ready, expert) order already)
        ds = self._repeat_d
        if ds is None:
            m = self.machine
            d1 = m.gpu_s(1)
            ds = self._repeat_d = (d1 + m.fused_launch_s, d1 + 0.0)
        d, rest = ds
        m = self.machine
        host = m.host_experts  # None when GPU expert calls cost the host nothing
        if host is not None:  # the host thread's calls in one loop
            g, busy = host.experts_run(readies, now, d, rest, c)
        else:
            g = now
            busy = 0.0
            for ready in readies:
                if ready > g:
                    c.transfer_stall += ready - g
                    g = ready
                g += d
                busy += d
                d = rest
        c.gpu_expert_busy += busy
        m.gpu.busy += busy
        return g

    #: _repeat_gpu's GPU time of a layer's first one-token expert call (with the layer's
    #: fused launches) and of the others, as _timed_gpu sums them
    _repeat_d: tuple[float, float] | None = None

    def _repeat_gpu(self, jobs: list[tuple[float, int]], now: float) -> float:
        """``_timed_gpu(jobs, now, None, ...)`` for ``_whole_layer_repeat``: one token per
        expert, no recorder and no unified memory (``_copies_only`` leaves unified memory to
        the general path), so the same sums in the same order without their branches."""
        jobs.sort()
        ds = self._repeat_d
        if ds is None:
            m = self.machine
            d1 = m.gpu_s(1)
            ds = self._repeat_d = (d1 + m.fused_launch_s, d1 + 0.0)
        d, rest = ds
        c = self.c
        host = self.machine.host_experts  # None when GPU expert calls cost the host nothing
        if host is not None:  # the host thread's calls in one loop (HostThread.experts_run)
            g, busy = host.experts_run([r for r, _ in jobs], now, d, rest, c)
        else:
            g = now
            busy = 0.0
            for ready, _ in jobs:
                if ready > g:
                    c.transfer_stall += ready - g
                    g = ready
                g += d
                busy += d
                d = rest
        c.gpu_expert_busy += busy
        self.machine.gpu.busy += busy
        return g

    def _whole_layer_copies_memo(
        self, layer: int, routed: list[int], plan: Plan, now: float, key: tuple[int, ...]
    ) -> float | None:
        """``_whole_layer_copies``, remembering the plan's items for ``_whole_layer_repeat``
        when its checks pass (a full evict list only)."""
        ev = plan.evict
        full_row = False
        if ev:
            f = ev[0]
            if f.__class__ is tuple and len(f) == 2:
                vl = f[0]
                if vl.__class__ is int and 0 <= vl < self.n_layers:
                    full_row = False not in self.res.resident[vl].tolist()
        end = self._whole_layer_copies(layer, routed, plan, now)
        if end is not None:
            assert self._repeat_prefetch is not None and self._repeat_evict is not None
            self._repeat_prefetch[key] = (
                list(plan.prefetch),
                dict.fromkeys(routed, Action.FETCH),
                [t[1] for t in plan.prefetch],
            )
            if full_row and len(ev) == self.n_experts:
                self._repeat_evict[vl] = list(ev)
        return end

    def _cpu_layer_decode(
        self, layer: int, routed: list[int], plan: Plan, now: float
    ) -> float | None:
        # A CPU-resident layer (ResourceSpec.gpu_blocks) whose plan runs every routed expert on
        # the CPU, nothing else (llama-cpp-layers' and llama-cpp-cpu-moe's LeadingCpuLayers).
        # check_plan accepts such a plan as it is (every action is CPU, one per routed expert).
        # The general path submits one local call per expert at ``now`` in issue order (no
        # activation copies: the hidden states are on the host) and serves the heap until the
        # last one returns; with nothing pending and an idle one-worker CPU that is the shared
        # CPU's run_queue over calls all submitted at ``now``, with the same arithmetic. The
        # layer has no GPU expert, so it ends when the last call does.
        actions = plan.actions
        host = self._host
        if (
            not routed
            or actions.__class__ is not dict
            or len(actions) != len(routed)
            or plan.evict
            or plan.prefetch
            or plan.victims
            or (plan.cpu_serial and len(routed) > 1)  # a chain: each call waits for the last
            or self._heap
            or self._unified
            or self._ssd is not None
            or self._peer_home is not None
            or len(host.lanes) != 1
            or not host.idle
            or host.t > now
        ):
            return None
        for e in routed:
            if actions.get(e) != _CPU:
                return None
        c = self.c
        n = len(routed)
        self._seq += n  # one issue number per call, as _apply's
        c.cpu_expert_evals += n
        self._accesses(layer, n, 0, False)  # no hit
        work, share, dram = self._one_token_cpu_job()
        jobs = [CpuJob(e, i, now, work, share, dram) for i, e in enumerate(routed)]
        host.run_queue(jobs)
        rec = self.recorder
        end = now
        for job in jobs:  # one worker, first come first served: they end in issue order
            if rec is not None:
                where = self.hooks.where
                rec.op(host.lanes[0].name, "cpu_expert", where.seq or 0, where.token or 0,
                       layer, job.op, job.start, job.end, 0)  # fmt: skip
            if job.end > end:
                end = job.end
        if end > now:  # _layer's wait for the results, with no GPU expert before them
            c.cpu_wait += end - now
        return end

    #: ``_copy_layer_wb`` has taken a plan offered by ``_gpu_cpu_layer`` / refused one
    _cwb_taken = False
    _cwb_refused = 0

    def _gpu_cpu_layer(self, layer: int, routed: list[int], plan: Plan, now: float) -> float | None:
        """``_copies_only`` by way of ``_victim_fetches`` for a decode plan of resident, timed
        experts and CPU experts only (at least one), nothing else (ktransformers, fiddler,
        llama-cpp-cpu-moe and -mmap): the same checks in the same order (anything else, or
        anything they would refuse, returns None before any change and the general chain goes
        on as before), applied and timed as ``_victim_fetches`` with
        ``_cpu_calls``/``_cpu_parallel`` and ``_timed_gpu`` do it: the same issue numbers,
        counters and sums in the same order. A plan of resident experts, fetches and
        temporary copies goes to ``_copy_layer_wb`` without a recorder."""
        if self._one_stream:
            return None  # one stream (ResourceSpec.one_stream): only _layer serializes it
        if plan.prefetch and self._pf_taken:
            # with prefetches: _prefetch_layer at once (None: _copies_only asks it again, as
            # it would have anyway, and goes on)
            return self._prefetch_layer(layer, routed, plan, now)
        actions = plan.actions
        res = self.res
        if (
            actions.__class__ is not dict
            or len(actions) != len(routed)
            or plan.evict.__class__ is not list
            or plan.prefetch.__class__ is not list
            or plan.victims.__class__ is not dict
            or plan.evict
            or plan.prefetch
            or plan.barrier
            or self._unified
            or self._ssd is not None
            or self._peer_home is not None  # several GPUs: the general path times each stream
            or res.waiters
        ):
            return None
        if self.recorder is None and (self._cwb_taken or self._cwb_refused < _PLAIN_PROBES):
            # a plan of resident experts, fetches and temporary copies goes to _copy_layer_wb
            # at once (and one of resident experts alone as by way of _copies_only and
            # _plain_fetches); a plan it refuses goes on below. A
            # run whose first plans all have CPU experts (ktransformers) stops trying.
            end = self._copy_layer_wb(layer, routed, plan, now)
            if end is not None:
                self._cwb_taken = True
                return end
            self._cwb_refused += 1
        hits: list[int] = []
        cpu: list[int] = []
        copies = False
        for e in routed:
            a = actions.get(e)
            if a == _GPU:
                hits.append(e)
            elif a == _CPU:
                cpu.append(e)
            elif a in (_FETCH, _TEMP):
                copies = True
            else:
                return None
        if copies:
            if cpu or self.recorder is not None:
                return None
            return self._copy_layer_wb(layer, routed, plan, now)
        host = self._host
        if not cpu or plan.victims or self._heap or not host.idle:
            return None  # all on the GPU, or CPU calls that could queue behind pending work
        if res.occupancy > res.cap:
            return None  # _victim_fetches' slot check (no copy here)
        if hits:
            row = res.resident[layer]
            ready_row = res.ready_at[layer]
            for e in hits:
                if not row[e] or ready_row[e] == INF:
                    return None
        # -- apply, as _victim_fetches: issue numbers, counters (no copy, no eviction)
        c = self.c
        n_cpu = len(cpu)
        self._seq += n_cpu
        jobs: list[tuple[float, int]] = []
        if hits:
            prow = res.prefetched[layer]
            for e in hits:
                if prow[e]:
                    prow[e] = False
                    c.prefetch_used += 1
                jobs.append((float(ready_row[e]), e))
        n = len(routed)
        n_hits = len(hits)
        self._accesses(layer, n, n_hits, False)
        rec = self.recorder
        serial = plan.cpu_serial or n_cpu == 1
        if rec is not None or not (serial or len(host.lanes) == 1):
            # recorded runs and several workers: the calls as _victim_fetches makes them
            where = self.hooks.where
            sid, token = where.seq or 0, where.token or 0
            if serial:
                done = self._cpu_calls(cpu, now, sid, token, layer)
            else:
                done = self._cpu_parallel(cpu, now, sid, token, layer)
        else:
            # _count_cpu, then _cpu_calls' or _cpu_parallel's one-worker branch with
            # _activation_out, _result_back and Lane.serve written out (no recorder)
            act = self.act_bytes * n_cpu
            c.cpu_expert_evals += n_cpu
            c.d2h_bytes += act
            c.h2d_bytes += act
            work, share, dram = self._one_token_cpu_job()
            one = self._one_token_cpu
            assert one is not None
            d_out, d_back = one[1], one[2]
            d2h = self._d2h.lane
            h2d = self._h2d.lane
            if serial:  # each call's three stages, one after another
                t = now
                for _ in cpu:
                    if d2h.free_at > t:
                        t = d2h.free_at
                    t = d2h.free_at = t + d_out
                    d2h.busy += d_out
                    job = CpuJob(None, 0, t, work, share, dram)
                    t = host.run_alone(t, job)
                    if h2d.free_at > t:
                        t = h2d.free_at
                    t = h2d.free_at = t + d_back
                    h2d.busy += d_back
                done = t
            else:  # one worker, first come first served
                sent: list[CpuJob] = []
                for i, e in enumerate(cpu):
                    t = now if now > d2h.free_at else d2h.free_at
                    t = d2h.free_at = t + d_out
                    d2h.busy += d_out
                    sent.append(CpuJob(e, i, t, work, share, dram))
                host.run_queue(sent)
                done = now
                for job in sent:  # they end in issue order, so do their results
                    t = job.end
                    if h2d.free_at > t:
                        t = h2d.free_at
                    done = h2d.free_at = t + d_back
                    h2d.busy += d_back
        g = now
        if plan.cpu_first and done > now:  # the GPU experts wait for the CPU ones
            c.cpu_wait += done - now
            g = done
        if rec is None:
            end = self._repeat_gpu(jobs, g)
        else:
            end = self._timed_gpu(jobs, g, None, sid, token, layer)
        if done > end:
            c.cpu_wait += done - end
            end = done
        return end

    def _prefetch_layer(
        self, layer: int, routed: list[int], plan: Plan, now: float
    ) -> float | None:
        """``_copies_only``'s general one-pass path for a decode plan of resident experts,
        fetches and prefetches (each with or without a victim), with no evict list, temporary
        copies, CPU experts, low-bit copies or barrier, without a recorder, write-backs,
        unified memory, SSD tier or several GPUs (moe-infinity's layers that prefetch): its
        checks in its order (anything else, or anything it would refuse, returns None before
        any change and ``_copies_only`` goes on as before), applied and timed as it does (the
        same issue numbers, counters and sums in the same order), reading and writing the
        residency, ready times and prefetched flags through ``_repeat_rows``' flat views."""
        if (
            self.recorder is not None
            or self._wb
            or self._unified
            or self._ssd is not None
            or self._peer_home is not None
        ):
            return None
        actions = plan.actions
        victims = plan.victims
        prefetch = plan.prefetch
        res = self.res
        if (
            actions.__class__ is not dict
            or len(actions) != len(routed)
            or victims.__class__ is not dict
            or prefetch.__class__ is not list
            or plan.evict.__class__ is not list
            or plan.evict
            or plan.barrier
            or plan.low_bit
            or res.waiters
        ):
            return None
        views = self._repeat_views
        if (
            views is None
            or views[0] is not res.resident
            or views[1] is not res.ready_at
            or views[2] is not res.prefetched
        ):
            views = self._repeat_rows()
        _, _, _, mres, mready, mpre, _, _ = views
        n_layers, n_exp = self.n_layers, self.n_experts
        lo = layer * n_exp
        # -- the check: _copies_only's rules (the routed actions, the hits, the fetches with
        # their victims, the prefetches with theirs), on flat indices. Every refusal returns
        # before any change, so a fetch's copy is checked where the routed loop meets it: the
        # copies are still checked in issue order (the routed fetches, then the prefetches).
        hits: list[int] = []
        gone: list[int] = []  # victims' flat indices, in issue order
        added: list[int] = []  # copies' flat indices, in issue order
        n_res = res.n_resident
        budget = res.budget
        get = actions.get
        vget = victims.get
        # a victim is checked as _copies_only's evict() does without write-backs (one in use
        # is refused); the routed fetches' and the prefetches' copies are checked alike, in
        # issue order
        copies: list[tuple[int, Any]] = []  # (flat index, victim) per copy
        for e in routed:
            a = get(e)
            if a == _GPU:
                i = lo + e
                if not mres[i] or mready[i] == INF:
                    return None  # not resident, or its copy not timed yet
                hits.append(e)
                continue
            if a != _FETCH:
                return None  # temporary copies, CPU experts, pre-calculations: the general path
            copies.append((lo + e, vget(e)))
        n_fetch = len(copies)
        for item in prefetch:
            if item.__class__ is not tuple or len(item) != 3:
                return None
            pl, pe, v = item
            if (
                pl.__class__ is not int
                or pe.__class__ is not int
                or not (0 <= pl < n_layers and 0 <= pe < n_exp)
            ):
                return None
            copies.append((pl * n_exp + pe, v))
        for i, v in copies:
            if i in added or (mres[i] and i not in gone):
                return None
            if v is not None:
                if v.__class__ is not tuple or len(v) != 2:
                    return None
                vl, ve = v
                if (
                    vl.__class__ is not int
                    or ve.__class__ is not int
                    or not (0 <= vl < n_layers and 0 <= ve < n_exp)
                ):
                    return None
                j = vl * n_exp + ve
                if j in gone or j in added or not mres[j]:
                    return None
                if vl == layer and ve in routed:
                    return None  # in use (every routed expert is a hit or a fetch here)
                if mready[j] > now:
                    return None  # still being copied
                gone.append(j)
                n_res -= 1
            if n_res >= budget:
                return None  # all slots full and no victim
            added.append(i)
            n_res += 1
        n_evs = len(gone)
        n_copies = len(added)
        # without write-backs an evicted slot is free at once
        occ = res.occupancy - n_evs + n_copies
        if occ > res.cap:
            return None  # a copy would wait for a slot
        # -- apply, as _copies_only: residency, counters and issue numbers
        c = self.c
        eb = self.expert_bytes
        for i in gone:  # evictions free their slots at once and issue nothing
            mres[i] = 0
            if mpre[i]:
                mpre[i] = 0
                c.prefetch_wasted_bytes += eb
        self._seq += n_copies
        res.n_resident = n_res
        if n_evs:
            c.evictions += n_evs
        jobs: list[tuple[float, int]] = []
        for e in hits:
            i = lo + e
            if mpre[i]:
                mpre[i] = 0
                c.prefetch_used += 1
            jobs.append((mready[i], e))
        self._accesses(layer, len(routed), len(hits), False)
        c.h2d_bytes += eb * n_copies
        c.h2d_expert_copies += n_copies
        c.fetches += n_fetch
        c.prefetches += n_copies - n_fetch
        # -- this layer's copies at ``now`` in issue order (the routed fetches, then the
        # prefetches; evictions issue nothing); Residency.swap_slots, inlined
        res.occupancy = occ
        if n_copies and occ > res.max_occupancy:
            res.max_occupancy = occ
        lane = self._h2d.lane
        dur = self._h2d.expert_s
        free, busy = lane.free_at, lane.busy
        for k, i in enumerate(added):
            s = now if now > free else free  # Lane.serve, inlined (the same sums)
            end = free = s + dur
            busy += dur
            mres[i] = 1
            mready[i] = end
            if k < n_fetch:
                jobs.append((end, i - lo))
            else:
                mpre[i] = 1
        lane.free_at, lane.busy = free, busy
        return self._repeat_gpu(jobs, now)

    def _copy_layer_wb(self, layer: int, routed: list[int], plan: Plan, now: float) -> float | None:
        """``_plain_fetches`` without a recorder, with write-backs and low-bit temporary copies
        too (the miss layers of the caching policies, mixtral-offloading and hobbit):
        its checks in its order (anything else, or anything it would refuse, returns None
        before any change), applied and timed as it does (the same issue numbers, counters,
        held-back or heap slot releases and sums in the same order), reading and writing the
        residency, ready times and prefetched flags through ``_repeat_rows``' flat views
        instead of numpy scalars. Its callers (``_plain_fetches``, ``_gpu_cpu_layer``) have
        checked the plan's shape: dict actions, one per routed expert, dict victims, no evict
        list, prefetch or barrier, no unified memory, SSD tier or slot waiter."""
        actions = plan.actions
        victims = plan.victims
        res = self.res
        views = self._repeat_views
        if (
            views is None
            or views[0] is not res.resident
            or views[1] is not res.ready_at
            or views[2] is not res.prefetched
        ):
            views = self._repeat_rows()
        mres, mready, mpre = views[3], views[4], views[5]
        n_exp = self.n_experts
        lo = layer * n_exp
        hits: list[int] = []
        fetch: list[int] = []
        temps: list[int] = []
        get = actions.get
        for e in routed:
            a = get(e)
            i = lo + e
            if a == _GPU:
                if not mres[i] or mready[i] == INF:
                    return None  # not resident, or its copy not timed yet
                hits.append(e)
            elif a == _FETCH:
                if mres[i]:
                    return None  # already resident
                fetch.append(e)
            elif a == _TEMP:
                if mres[i]:
                    return None  # a temporary copy of a resident expert
                temps.append(e)
            else:
                return None  # CPU experts, pre-calculations, malformed actions
        m = self.machine
        if temps and len(temps) > m.buffers["temp"]:
            return None  # a copy waiting for a buffer (or no buffer at all)
        low = plan.low_bit
        if low:
            # check_plan's _check_low_bit: routed TEMP copies on a system with low-bit copies
            if self.spec.low_bit_dtype is None:
                return None
            for e in low:
                if e not in temps:
                    return None
        wb = self._wb
        n_copies = len(fetch)
        gone: list[int] = []  # victims' flat indices, in issue order
        #: the victim's flat index issued before each fetch (-1: none), in fetch order
        before: list[int] = []
        if n_copies:
            if n_copies > 1 and (
                fetch[0] == fetch[1] if n_copies == 2 else len(set(fetch)) != n_copies
            ):
                return None  # an expert fetched twice
            n_layers = self.n_layers
            n_res = res.n_resident
            budget = res.budget
            for e in fetch:
                v = victims.get(e)
                if v is not None:
                    if v.__class__ is not tuple or len(v) != 2:
                        return None
                    vl, ve = v
                    if vl.__class__ is not int or ve.__class__ is not int:
                        return None
                    if not (0 <= vl < n_layers and 0 <= ve < n_exp):
                        return None
                    i = vl * n_exp + ve
                    if i in gone:
                        return None
                    if vl == layer and ve in routed:
                        return None  # an in-use victim: _victim_fetches decides
                    if not mres[i] or mready[i] > now:
                        return None  # not resident, or still being copied
                    gone.append(i)
                    before.append(i)
                    n_res -= 1
                else:
                    before.append(-1)
                if n_res >= budget:
                    return None  # all slots full and no victim
                n_res += 1
            # without write-backs an evicted slot is free at once, else when its write-back ends
            if res.occupancy - (0 if wb else len(gone)) + n_copies > res.cap:
                return None  # a fetch would wait for a slot
            res.n_resident = n_res
        # -- apply, as _plain_fetches: residency, counters and issue numbers
        c = self.c
        eb = self.expert_bytes
        n_evs = len(gone)
        if not wb:  # evictions free their slots at once and issue nothing
            for i in gone:
                mres[i] = 0
                if mpre[i]:
                    mpre[i] = 0
                    c.prefetch_wasted_bytes += eb
        # (with write-backs the victims' slots are freed when their write-backs end);
        # Residency.swap_slots written out (the same sums)
        occ = res.occupancy = res.occupancy - (0 if wb else n_evs) + n_copies
        if n_copies and occ > res.max_occupancy:
            res.max_occupancy = occ
        if not (wb and n_evs):  # one issue number per copy (write-backs: below)
            self._seq += n_copies + len(temps)
        if n_evs:
            c.evictions += n_evs
            if wb:
                c.d2h_bytes += eb * n_evs
                c.d2h_expert_copies += n_evs
        jobs: list[tuple[float, int]] = []
        for e in hits:
            i = lo + e
            if mpre[i]:
                mpre[i] = 0
                c.prefetch_used += 1
            jobs.append((mready[i], e))
        # _accesses for a decode layer, written out (the same sums)
        n = len(routed)
        n_hits = len(hits)
        c.decode_accesses += n
        c.decode_hits += n_hits
        self._hits[layer] += n_hits
        self._acc[layer] += n
        n_h2d = n_copies + len(temps)
        if low:  # as _apply: a low-bit copy moves the host's low-precision copy
            n_low = len(low)  # each low-bit expert is one of the temporary copies (distinct)
            c.low_bit_copies += n_low
            c.h2d_bytes += eb * (n_h2d - n_low) + m.low_bit_bytes * n_low
        else:
            c.h2d_bytes += eb * n_h2d
        c.h2d_expert_copies += n_h2d
        c.fetches += n_copies
        if temps:
            c.temp_copies += len(temps)
        lane = self._h2d.lane
        dur = self._h2d.expert_s
        if wb and n_evs:
            # write-backs and fetches interleaved in issue order, as _plain_fetches: each
            # victim's write-back takes the issue number before its fetch, frees the slot's
            # residency, holds both lanes, and its slot release is held back (_releases) or
            # pushed on the heap (the victims are never routed experts: checked above)
            d2h = self._d2h.lane
            wb_s = self._d2h.expert_s
            rel = self._rel if self._rel_ok else self._releases()
            where = self.hooks.where
            sid, token = where.seq or 0, where.token or 0
            seq = self._seq
            # the lanes' free times as locals (h2d's last: with one copy engine both are one
            # lane, whose free time is then h2d's, never below d2h's local)
            hf, df = lane.free_at, d2h.free_at
            for e, i in zip(fetch, before, strict=False):
                seq += 1
                if i >= 0:  # the victim's write-back (issue number ``seq``), then the fetch
                    mres[i] = 0
                    if mpre[i]:
                        mpre[i] = 0
                        c.prefetch_wasted_bytes += eb
                    s = hf
                    if df > s:
                        s = df
                    if now > s:
                        s = now  # max(now, both lanes' free times)
                    hf = df = end = s + wb_s
                    d2h.busy += wb_s
                    vl, ve = divmod(i, n_exp)
                    if rel is not None and (not rel or rel[-1][0] <= end):
                        rel.append((end, seq, sid, token, vl, ve))
                    else:
                        op = LayerOp(WRITEBACK, "writeback", seq, sid, token, vl, ve)
                        op.end = end
                        op.stage = 1
                        heapq.heappush(self._heap, (end, seq, next(self._uid), op))
                    seq += 1
                s = now if now > hf else hf  # Lane.serve, inlined
                hf = end = s + dur
                lane.busy += dur
                mres[lo + e] = 1
                mready[lo + e] = end
                jobs.append((end, e))
            if not temps and self._one_stream:
                # _one_stream_gpu with late None, written out: the lanes are free from
                # max(hf, df), each expert holds both, and the layer ends once they are free
                self._seq = seq
                jobs.sort()
                ds = self._repeat_d
                if ds is None:
                    d1 = m.gpu_s(1)
                    ds = self._repeat_d = (d1 + m.fused_launch_s, d1 + 0.0)
                d, rest = ds
                host = m.host_experts
                lanes = hf if hf > df else df
                g = now
                busy = 0.0
                for ready, _ in jobs:
                    drained = g
                    if lanes > ready:
                        ready = lanes
                    if g > ready:
                        ready = g
                    if ready > g:
                        c.transfer_stall += ready - g
                        g = ready
                    if host is not None:
                        wait = host.expert(drained, g, d) - d - g
                        if wait > 0.0:
                            c.dispatch_stall += wait
                            g += wait
                    g += d
                    busy += d
                    d = rest
                    lanes = g
                d2h.free_at = lane.free_at = lanes
                if lanes > g:
                    c.transfer_stall += lanes - g
                    g = lanes
                c.gpu_expert_busy += busy
                m.gpu.busy += busy
                return g
            d2h.free_at = df
            lane.free_at = hf
            self._seq = seq + len(temps)
            fetch = []  # issued
        if fetch or temps:
            free, busy = lane.free_at, lane.busy
            for e in fetch:
                s = now if now > free else free  # Lane.serve, inlined (the same sums)
                end = free = s + dur
                busy += dur
                mres[lo + e] = 1
                mready[lo + e] = end
                jobs.append((end, e))
            # issued after the routed fetches, one buffer each (_temp_copies, inlined)
            for e in temps:
                d = m.low_bit_s if low and e in low else dur  # as _serve_op: a low-bit copy
                s = now if now > free else free
                end = free = s + d
                busy += d
                jobs.append((end, e))
            lane.free_at, lane.busy = free, busy
        if self._one_stream:  # copies and kernels on one stream (ResourceSpec.one_stream)
            return self._one_stream_gpu(jobs, None, now)
        # _repeat_gpu (_timed_gpu_one's sums without a recorder) with the host thread's
        # HostThread.expert and issue written out: the same sums in the same order
        jobs.sort()
        ds = self._repeat_d
        if ds is None:
            d1 = m.gpu_s(1)
            ds = self._repeat_d = (d1 + m.fused_launch_s, d1 + 0.0)
        d, rest = ds
        host = m.host_experts
        g = now
        busy = 0.0
        if host is None:
            for ready, _ in jobs:
                if ready > g:
                    c.transfer_stall += ready - g
                    g = ready
                g += d
                busy += d
                d = rest
        else:
            for ready, _ in jobs:
                drained = g
                if ready > g:
                    c.transfer_stall += ready - g
                    g = ready
                # the stream may wait for the host thread to issue it
                end = host.expert(drained, g, d)
                wait = end - d - g
                if wait > 0.0:
                    c.dispatch_stall += wait
                    g += wait
                g += d
                busy += d
                d = rest
        c.gpu_expert_busy += busy
        m.gpu.busy += busy
        return g

    def _cpu_parallel(
        self, experts: list[int], now: float, sid: int, token: int, layer: int
    ) -> float:
        """A decode layer's CPU experts submitted together to an idle CPU with nothing else
        pending: the activations go out in issue order, then the shared CPU's own
        ``submit``/``wake`` run in the order the request heap would call them (a wake-up
        before a submission at the same moment), each result coming back when its call ends;
        returns when the last result is back."""
        host = self._host
        self._count_cpu(len(experts))
        work, share, dram = self._one_token_cpu_job()
        sent: list[tuple[float, CpuJob]] = []
        for i, e in enumerate(experts):
            t = self._activation_out(now, e, sid, token, layer)
            sent.append((t, CpuJob(e, i, t, work, share, dram)))  # its op is its expert here
        done = now
        if len(host.lanes) == 1:  # first come first served, each call alone on the CPU
            host.run_queue([job for _, job in sent])
            for _, job in sent:  # the calls end in issue order, so do their results
                done = self._result_back(job, job.op, sid, token, layer)
            return done
        i, n = 0, len(sent)
        while True:
            nxt = host.next_event()
            if i < n and sent[i][0] < nxt:
                host.submit(*sent[i])
                i += 1
            elif nxt != INF:
                for job in host.wake(nxt):
                    t = self._result_back(job, job.op, sid, token, layer)
                    if t > done:
                        done = t
            else:
                return done

    def _cpu_calls(self, experts: list[int], now: float, sid: int, token: int, layer: int) -> float:
        """A decode layer's CPU experts run one after another (a serial chain, or a single
        call) on an idle CPU with nothing else pending: each call's three stages (activations
        to the host, the call, the result back) are timed directly, as the request heap would
        serve them with nothing else in it; returns when the last result is back."""
        self._count_cpu(len(experts))
        t = now
        work, share, dram = self._one_token_cpu_job()
        for e in experts:
            t = self._activation_out(t, e, sid, token, layer)
            job = CpuJob(None, 0, t, work, share, dram)
            self._host.run_alone(t, job)
            t = self._result_back(job, e, sid, token, layer)
        return t

    #: a one-token CPU expert call's (work, share, dram) and the activations' D2H and H2D
    #: seconds, from the machine's memoised costs (built on first use)
    _one_token_cpu: tuple[tuple[float, float, float], float, float] | None = None

    def _one_token_cpu_job(self) -> tuple[float, float, float]:
        """What ``Machine.cpu_job`` gives a one-token call: (work, share, dram)."""
        one = self._one_token_cpu
        if one is None:
            job = self.machine.cpu_job(None, 0, 0.0, 1)
            one = self._one_token_cpu = (
                (job.work, job.share, job.dram),
                self._d2h.activation_s(1),
                self._h2d.activation_s(1),
            )
        return one[0]

    def _count_cpu(self, n: int) -> None:
        """Count ``n`` one-token CPU expert calls (their activations go out and back)."""
        c = self.c
        c.cpu_expert_evals += n
        c.d2h_bytes += self.act_bytes * n
        c.h2d_bytes += self.act_bytes * n

    def _activation_out(self, t: float, e: int, sid: int, token: int, layer: int) -> float:
        """A CPU call's activations to the host, submitted at ``t``; returns when they arrive."""
        d2h = self._d2h
        one = self._one_token_cpu  # set by _one_token_cpu_job before any call comes here
        s, end = d2h.lane.serve(t, d2h.activation_s(1) if one is None else one[1])
        if self.recorder is not None:
            self.recorder.op(d2h.lane.name, "activation", sid, token, layer, e, s, end,
                             self.act_bytes)  # fmt: skip
        return end

    def _result_back(self, job: CpuJob, e: int, sid: int, token: int, layer: int) -> float:
        """A CPU call that has ended (recorded) sends its result back; returns when it is on
        the GPU."""
        rec = self.recorder
        h2d = self._h2d
        if rec is not None:
            rec.op(self._host.lanes[job.worker].name, "cpu_expert", sid, token, layer, e,
                   job.start, job.end, 0)  # fmt: skip
        one = self._one_token_cpu
        s, end = h2d.lane.serve(job.end, h2d.activation_s(1) if one is None else one[2])
        if rec is not None:
            rec.op(h2d.lane.name, "activation", sid, token, layer, e, s, end, self.act_bytes)
        return end

    def _temp_copies(
        self,
        temps: list[int],
        jobs: list[tuple[float, int, int]],
        now: float,
        sid: int,
        token: int,
        layer: int,
    ) -> None:
        """Serve temporary copies submitted at ``now`` on the H2D lane, one buffer each
        (buffers 0, 1, ...), and add their GPU jobs."""
        rec = self.recorder
        lane = self._h2d.lane
        dur = self._h2d.expert_s
        for buf, e in enumerate(temps):
            s, end = lane.serve(now, dur)
            if rec is not None:
                rec.op(lane.name, "temp", sid, token, layer, e, s, end, self.expert_bytes)
            jobs.append((end, e, buf))

    def _gpu_jobs(
        self,
        jobs: list[tuple[float, int, int]],
        waiting: deque[int],
        late: dict[int, LayerOp],
        now: float,
        sid: int,
        token: int,
        layer: int,
    ) -> float:
        """The GPU experts of a decode layer by (ready time, expert), as ``_layer`` runs them:
        an in-use victim's write-back (``late``) is submitted when its computation ends, and
        a temporary copy waiting for a buffer (``waiting``) is copied when a computation frees
        one, which is exact only when nothing else is pending (the copy then starts as the
        heap would start it)."""
        heapq.heapify(jobs)
        c = self.c
        rec = self.recorder
        link = self._h2d
        lane = link.lane
        d1 = self.machine.gpu_s(1)
        fused = self.machine.fused_launch_s  # the layer's fused call, with its first expert
        host = self.machine.host_experts  # None when GPU expert calls cost the host nothing
        g = now
        busy = 0.0
        while jobs:
            ready, e, buf = heapq.heappop(jobs)
            d = d1 + fused
            fused = 0.0
            drained = g
            if ready > g:
                c.transfer_stall += ready - g
                g = ready
            if host is not None:  # the stream may wait for the host thread to issue it
                wait = host.expert(drained, g, d) - d - g
                if wait > 0.0:
                    c.dispatch_stall += wait
                    g += wait  # the same sum as _layer's
            if rec is not None:
                rec.op("gpu", "expert", sid, token, layer, e, g, g + d, 0)
            g += d
            busy += d
            if late:
                wb = late.pop(e, None)
                if wb is not None:
                    self._push(g, wb)
            if buf >= 0 and waiting:
                nxt = waiting.popleft()
                s, end = lane.serve(g, link.expert_s)
                if rec is not None:
                    rec.op(lane.name, "temp", sid, token, layer, nxt, s, end,
                           self.expert_bytes)  # fmt: skip
                heapq.heappush(jobs, (end, nxt, buf))
        c.gpu_expert_busy += busy
        self.machine.gpu.busy += busy
        return g

    def _one_stream_gpu(
        self, jobs: list[tuple[float, int]], late: dict[int, LayerOp] | None, now: float
    ) -> float:
        """The GPU experts of a decode layer on one stream (ResourceSpec.one_stream), for the
        one-pass copy paths once they have served the layer's copies at ``now``, with no
        recorder, unified memory, CPU experts or copy waiting for a buffer, and nothing
        pending but slot releases: ``_layer``'s one-stream loop with the same sums in the same
        order. Each expert by (ready time, expert) starts once its weights are there, the
        stream is free and both copy lanes are (every copy submitted before it has ended),
        and holds the lanes while it runs; an in-use victim's write-back (``late``) is served
        when its computation ends, before the next expert, as ``_layer`` serves it from the
        heap (the releases pending beside it touch no lane and are due to no waiter, so
        serving them later changes nothing); the layer ends once the last copy it issued
        has, the wait counted as transfer stall. Returns when the layer ends."""
        jobs.sort()
        m = self.machine
        ds = self._repeat_d
        if ds is None:
            d1 = m.gpu_s(1)
            ds = self._repeat_d = (d1 + m.fused_launch_s, d1 + 0.0)
        d, rest = ds  # the first expert with the layer's fused call, then one token each
        c = self.c
        host = m.host_experts  # None when GPU expert calls cost the host nothing
        h2d, d2h = self._h2d.lane, self._d2h.lane
        # when both copy lanes are free: an expert holds them (sets both), so one local
        # stands for both until a write-back reads them or the loop ends
        lanes = h2d.free_at if h2d.free_at > d2h.free_at else d2h.free_at
        g = now
        busy = 0.0
        for ready, e in jobs:
            drained = g
            if lanes > ready:
                ready = lanes
            if g > ready:
                ready = g  # max(ready, stream, lanes): the same float as _layer's
            if ready > g:
                c.transfer_stall += ready - g
                g = ready
            if host is not None:  # the stream may wait for the host thread to issue it
                wait = host.expert(drained, g, d) - d - g
                if wait > 0.0:
                    c.dispatch_stall += wait
                    g += wait
            g += d
            busy += d
            d = rest
            lanes = g
            if late:
                wb = late.pop(e, None)
                if wb is not None:  # evicted while in use: written back after its compute
                    h2d.free_at = d2h.free_at = g
                    self._serve_op(g, wb)  # it holds both lanes
                    lanes = h2d.free_at
        if jobs:
            h2d.free_at = d2h.free_at = lanes
        # every copy of the layer has ended by the lanes' free time (the last expert set
        # it, a write-back after it moved it on)
        if lanes > g:
            c.transfer_stall += lanes - g
            g = lanes
        c.gpu_expert_busy += busy
        m.gpu.busy += busy
        return g

    def _timed_gpu(
        self,
        jobs: list[tuple[float, int]],
        now: float,
        counts: np.ndarray | None,
        sid: int,
        token: int,
        layer: int,
    ) -> float:
        """Run a layer's experts on the GPU stream by (ready time, expert) when every copy is
        already timed and nothing else is pending; returns when the last one ends."""
        jobs.sort()
        c = self.c
        g = now
        busy = 0.0
        rec = self.recorder
        gpu_s = self.machine.gpu_s
        unified = self._unified
        host = self.machine.host_experts  # None when GPU expert calls cost the host nothing
        d1 = gpu_s(1)  # one decode token per expert
        fused = self.machine.fused_launch_s  # the layer's fused call, with its first expert
        for ready, e in jobs:
            drained = g
            if ready > g:
                c.transfer_stall += ready - g
                g = ready
            n = 1
            if counts is not None:
                n = int(counts[e])
                d = gpu_s(n) + fused
            else:
                d = d1 + fused
            fused = 0.0
            if host is not None:  # the stream may wait for the host thread to issue it
                wait = host.expert(drained, g, d) - d - g
                if wait > 0.0:
                    c.dispatch_stall += wait
                    g += wait  # the same sum as the reference engine's timeout
            if rec is not None:
                rec.op("gpu", "expert", sid, token, layer, e, g, g + d, 0)
            if unified:  # the expert's weight reads share DRAM bandwidth with CPU experts
                self._gpu_mem(g, g + d, n)
            g += d
            busy += d
        c.gpu_expert_busy += busy
        self.machine.gpu.busy += busy
        return g

    # -- decode plans with CPU experts and pre-calculations (daop) ------------------------------
    #: whether this run's fixed conditions let ``_precalc_layer`` take a plan (None: not
    #: looked up yet)
    _precalc_ok: bool | None = None
    #: the current token's gate weights (its ``[layers, k]`` row) and the same as lists
    _w_lists: tuple[Any, list[list[float]]] | None = None

    def _precalc_layer(
        self, layer: int, experts: np.ndarray, plan: Plan, now: float, w_t: Any, ws_t: list[float]
    ) -> float | None:
        # check_route, check_plan (its _simple_actions and _check_precalc), _fidelity, _apply
        # and _layer fused for a plan of resident experts whose copies are timed, CPU experts
        # and consumed pre-calculations, maybe with a substituted route and new
        # pre-calculations: the same rules in the same order, the same issue numbers, the
        # same sums, the CPU work submitted to the request heap exactly as _layer submits it.
        # Anything unusual, or anything a check would refuse, returns None before any change
        # (the general path then words the error).
        if plan.__class__ is not Plan or self._one_stream:
            # (one stream, ResourceSpec.one_stream: only _layer serializes it)
            return None  # the general check words what it is
        actions = plan.actions
        evict = plan.evict
        prefetch = plan.prefetch
        items = plan.precalc
        if (
            actions.__class__ is not dict
            or evict.__class__ is not list
            or evict
            or prefetch.__class__ is not list
            or prefetch
            or items.__class__ is not list
            or plan.low_bit
            or plan.barrier
        ):
            return None
        ok = self._precalc_ok
        if ok is None:  # the run's fixed conditions, looked up once
            ok = self._precalc_ok = self._plain_heap() and self.spec.gpu_blocks is None
        if not ok:
            return None
        n_exp = self.n_experts
        route = plan.route
        if route is None:
            routed = experts.tolist()
        else:  # check_route's rules
            if route.__class__ is not np.ndarray or route.ndim != 1:
                return None
            if route.size and route.dtype.kind not in "iu":
                return None
            routed = route.tolist()
            # (expert ids in range are checked in the loop below, before any row is read)
            n = len(routed)
            if n > 1 and (routed[0] == routed[1] if n == 2 else len(set(routed)) != n):
                return None  # a repeated expert
            raw = plan.raw_route
            if raw is not None and (raw.__class__ is not np.ndarray or raw.ndim != 1):
                return None
        n = len(routed)
        if len(actions) != n:
            return None
        res = self.res
        # the residency, ready times and prefetched flags through _repeat_rows' flat views
        views = self._repeat_views
        if (
            views is None
            or views[0] is not res.resident
            or views[1] is not res.ready_at
            or views[2] is not res.prefetched
        ):
            views = self._repeat_rows()
        mres, mready = views[3], views[4]
        lo = layer * n_exp
        pc = self.precalc
        jobs: list[tuple[float, int]] = []
        gpu: list[int] = []
        cpu: list[int] = []
        pre: list[int] = []
        for e in routed:
            if not 0 <= e < n_exp:
                return None  # check_route's range rule (a trace's own ids are in range)
            a = actions.get(e)
            if a == _GPU:
                if not mres[lo + e]:
                    return None
                ready = mready[lo + e]  # a float, as float(ready_at[layer, e])
                if ready == INF:
                    return None  # its copy is not timed yet
                jobs.append((ready, e))
                gpu.append(e)
            elif a == _CPU:
                cpu.append(e)
            elif a == _PRE:
                if (layer, e) not in pc:
                    return None
                pre.append(e)
            else:
                return None
        if items:  # _check_precalc's rules
            n_layers = self.n_layers
            for item in items:
                if item.__class__ is not tuple or len(item) != 2:
                    return None
                pl, pe = item
                if pl.__class__ is not int or pe.__class__ is not int:
                    return None
                if not (layer < pl < n_layers and 0 <= pe < n_exp) or item in pc:
                    return None
            if len(items) > 1 and len(set(items)) != len(items):
                return None  # an item twice in the plan
        # -- the plan is accepted: _fidelity, then _apply
        c = self.c
        if route is None:
            c.true_accesses += len(experts)
            ws = ws_t[layer]
            c.gate_mass_total += ws
            c.gate_mass_kept += ws
        else:  # _fidelity, with list lookups in place of its sets (k is small)
            c.true_accesses += len(experts)
            c.gate_mass_total += ws_t[layer]
            raw_l = None
            # the token's gate weights as lists, made once per token (the same floats as a
            # row's tolist())
            wl = self._w_lists
            if wl is None or wl[0] is not w_t:
                wl = self._w_lists = (w_t, w_t.tolist())
            ex_l, w_l = experts.tolist(), wl[1][layer]
            # zip's strict keyword only when it matters (the keyword alone costs more than the
            # loop; the trace gives as many weights as experts)
            if len(ex_l) == len(w_l):
                if ex_l == routed:  # the route is the trace's (the loop's every test holds)
                    for w in w_l:
                        c.gate_mass_kept += w
                    pairs = ()
                else:
                    pairs = zip(ex_l, w_l)  # noqa: B905 (equal lengths: strict changes nothing)
            else:
                pairs = zip(ex_l, w_l, strict=True)
            for e, w in pairs:
                if e in routed:
                    c.gate_mass_kept += w
                else:
                    if raw_l is None:  # read only when an expert was replaced
                        raw = plan.raw_route
                        raw_l = raw.tolist() if raw is not None else ()
                    if e in raw_l:
                        c.replaced_degraded += 1
                    else:
                        c.replaced_mispredicted += 1
        mpre = views[5]
        for e in gpu:
            if mpre[lo + e]:
                mpre[lo + e] = 0
                c.prefetch_used += 1
        results: list[LayerOp] = []
        for e in pre:
            results.append(pc.pop((layer, e)))
        n_hits = len(gpu)
        self._accesses(layer, n, n_hits, False)
        where = self.hooks.where
        sid, token = where.seq or 0, where.token or 0
        ops: list[LayerOp] = []
        serial = plan.cpu_serial
        act = self.act_bytes
        prev: LayerOp | None = None
        seq = self._seq
        if cpu:
            for e in cpu:
                seq += 1
                op = LayerOp(CPU, "cpu_expert", seq, sid, token, layer, e)
                results.append(op)
                if serial and prev is not None:
                    prev.chain = op
                else:
                    ops.append(op)
                prev = op
            k = len(cpu)
            # whole byte counts: a sum of k equal terms is their product, to the last bit
            c.d2h_bytes += act * k
            c.h2d_bytes += act * k
            c.cpu_expert_evals += k
            sync = results[len(pre) :]
        else:
            sync = ()
        if items:
            prev = None
            for item in items:
                seq += 1
                op = LayerOp(CPU, "precalc", seq, sid, token, item[0], item[1])
                pc[item] = op
                if serial and prev is not None:
                    prev.chain = op
                else:
                    ops.append(op)
                prev = op
            k = len(items)
            c.d2h_bytes += act * k
            c.h2d_bytes += act * k
            c.cpu_precalc_evals += k
        self._seq = seq
        # -- _layer: this layer's requests at once in issue order, then the GPU stream
        resolve = self._resolve_plain
        rec = self.recorder
        # the commonest wait (one pre-calculated result, at most one new pre-calculation, no
        # recorder): _precalc_wait serves it without the request heap's loop
        wait1 = (
            rec is None
            and not cpu
            and len(results) == 1
            and results[0].end is None
            and len(ops) <= 1
            and (not ops or ops[0].chain is None)
        )
        p1: LayerOp | None = None
        e1 = 0.0
        if ops:
            heap = self._heap
            cfg = self._plain_cfg
            a_out = (cfg or self._plain_config())[3]  # the memoised one-token duration
            d2h = self._d2h.lane
            for op in ops:
                # _cpu_stage's first stage at ``now``: the activations to the host
                s = now if now > d2h.free_at else d2h.free_at
                e = d2h.free_at = s + a_out
                d2h.busy += a_out
                if rec is not None:
                    rec.op(d2h.name, "activation", sid, token, op.layer, op.expert, s, e, act)
                op.stage = 1
                if wait1:  # (the only one) handed to _precalc_wait below
                    p1, e1 = op, e
                    break
                heapq.heappush(heap, (e, op.seq, next(self._uid), op))
                if heap[0][0] <= now:  # a zero-length stage keeps its place
                    self._serve_plain(None, now)
        if wait1 and not self._precalc_wait(results[0], p1, e1) and p1 is not None:
            heap = self._heap  # not taken: p1 enters the heap as above
            heapq.heappush(heap, (e1, p1.seq, next(self._uid), p1))
            if heap[0][0] <= now:
                self._serve_plain(None, now)
        g = now
        if sync and plan.cpu_first:
            sync_end = -INF
            for op in sync:  # max() over their ends, without the generator
                t = op.end
                if t is None:
                    t = resolve(op)
                if t > sync_end:
                    sync_end = t
            if sync_end > now:
                c.cpu_wait += sync_end - now
                g = sync_end
        # the GPU experts by (ready time, expert), as _layer's all-timed branch runs them
        if rec is None:
            g = self._repeat_gpu(jobs, g)
        else:
            g = self._timed_gpu(jobs, g, None, sid, token, layer)
        end = g
        for op in results:
            t = op.end
            if t is None:
                self._serve_plain(op, INF)
                t = op.end
                assert t is not None
            if t > end:
                end = t
        if end > g:
            c.cpu_wait += end - g
        return end

    def _precalc_wait(self, o: LayerOp, p1: LayerOp | None, e1: float) -> bool:
        """``_serve_plain(o, INF)`` for the commonest state of a daop layer, without the heap's
        loop: ``o`` (a pre-calculation this layer consumes) is the shared CPU's only running
        call and the heap holds nothing but its current wake-up; ``p1`` (this layer's one new
        pre-calculation, or None) has its activations on the host at ``e1`` and is not in the
        heap yet. The same events are served in the same order with the same arithmetic: p1's
        call arrives first when ``e1`` is before the wake-up (at the same moment the wake-up
        goes first), then the CPU's next event; when it ends ``o``'s call, ``o``'s result
        goes back (it comes before any other request left: the other calls that end there
        were issued later, the next wake-up is later). What is left enters the heap as
        ``_serve_plain`` leaves it (the stale wake-up it would skip is dropped); push numbers
        never decide the heap's order. Returns False, changing nothing, when the state is
        another; any other outcome on the way goes to ``_serve_plain``."""
        heap = self._heap
        if len(heap) != 1 or o.stage != 1 or o.chain is not None:
            return False
        t, sq, _, w = heap[0]
        host = self._host
        if sq != -1 or w.n != host.version:
            return False
        active = host.active
        if len(active) != 1 or active[0].op is not o:
            return False
        work, share, dram, _, a_in, _, _, uid, _, h2d = (
            self._plain_locals or self._plain_locals_init()
        )
        heap.clear()  # the wake-up: served below, or stale once p1's call arrives
        push = heapq.heappush
        done: list[CpuJob] | None = None
        if p1 is not None and e1 < t:
            job = CpuJob(p1, p1.seq, e1, work, share, dram)
            j0 = active[0]
            step = host.arrive_then_end(e1, job)  # the commonest outcome, in one pass
            if step is None:
                t = host.submit_next(e1, job)
            else:
                t, nt = step
                done = [j0]
            p1 = None
        if done is not None:
            pass
        elif t == INF:  # (nothing can progress: _serve_plain words it)
            done = []
            nt = INF
        else:
            done, nt = host.wake_next(t)
        if not done or done[0].op is not o or nt <= t:
            # another outcome: into the heap as _serve_plain leaves it, and on from there
            for job in done:
                j = job.op
                j.stage = 2
                push(heap, (t, j.seq, next(uid), j))
            if nt != INF:
                push(heap, (nt, -1, next(uid), _Wake(host.version)))
            if p1 is not None:
                push(heap, (e1, p1.seq, next(uid), p1))
            self._serve_plain(o, INF)
            return True
        for job in done:
            job.op.stage = 2
        # o's result back (Lane.serve, inlined as in _serve_plain)
        s = t if t > h2d.free_at else h2d.free_at
        e = h2d.free_at = s + a_in
        h2d.busy += a_in
        o.end = e
        for job in done[1:]:
            j = job.op
            push(heap, (t, j.seq, next(uid), j))
        if nt != INF:
            push(heap, (nt, -1, next(uid), _Wake(host.version)))
        if p1 is not None:
            push(heap, (e1, p1.seq, next(uid), p1))
        return True

    def _resolve_plain(self, op: LayerOp) -> float:
        """``_resolve`` through ``_serve_plain``."""
        if op.end is None:
            self._serve_plain(op, INF)
        return op.end  # type: ignore[return-value]

    # -- the request heap -------------------------------------------------------------------
    def _push(self, t: float, op: LayerOp) -> None:
        heapq.heappush(self._heap, (t, op.seq, next(self._uid), op))

    def _serve(self) -> None:
        """Serve the next submitted request (or stage of one) in queueing-rule order."""
        t, _, _, op = heapq.heappop(self._heap)
        self._serve_op(t, op)

    def _serve_op(self, t: float, op: LayerOp) -> None:
        """Serve ``op`` (its current stage) submitted at ``t``; every earlier one was served."""
        kind = op.kind
        rec = self.recorder
        if kind == FETCH:
            res = self.res
            if op.stage == 0 and not res.take(t):
                res.waiters.append(op)  # waits for a slot
                return
            link = self._h2d
            lane = link.lane
            if op.gds:  # _ssd: the drive wrote the slot already (GPUDirect Storage)
                s = e = t
            else:
                # Lane.serve, inlined (the hot path of copy-heavy policies)
                s = t if t > lane.free_at else lane.free_at
                e = lane.free_at = s + link.expert_s
                lane.busy += link.expert_s
            if rec is not None and not op.gds:
                rec.op(lane.name, op.rkind, op.sid, op.token, op.layer, op.expert, s, e,
                       self.expert_bytes)  # fmt: skip
            slot = (op.layer, op.expert)
            res.ready_at[slot] = e
            del res.copying[slot]
            if self._unified and not op.gds:
                self._mem(s, e, self.expert_bytes)
            op.end = e
            if op.gpu:
                op.gpu = False
                heapq.heappush(self._gheap, (e, op.expert, -1))
                self._waiting -= 1
        elif kind == TEMP:
            link = self._h2d
            if op.low:
                dur, nbytes = self.machine.low_bit_s, self.machine.low_bit_bytes
            else:
                dur, nbytes = link.expert_s, self.expert_bytes
            if op.gds:  # _ssd: the drive wrote the buffer already (GPUDirect Storage)
                s = e = t
            else:
                s, e = link.lane.serve(t, dur)
            if rec is not None and not op.gds:
                rec.op(link.lane.name, "temp", op.sid, op.token, op.layer, op.expert, s, e,
                       nbytes)  # fmt: skip
            if self._unified and not op.gds:
                self._mem(s, e, nbytes)
            op.end = e
            if op.gpu:
                op.gpu = False
                heapq.heappush(self._gheap, (e, op.expert, op.buf))
                self._waiting -= 1
        elif kind == CPU:
            self._cpu_stage(t, op)
        elif kind == WAKE:
            if op.n == self._host.version:  # else a later change re-timed it
                self._cpu_wake(t)
        elif kind == WRITEBACK:
            if op.stage == 0:
                # issued on the loads' stream: it holds the H2D lane and the D2H lane together
                h2d, d2h = self._h2d.lane, self._d2h.lane
                s = max(t, h2d.free_at, d2h.free_at)
                dur = self._d2h.expert_s
                e = s + dur
                h2d.free_at = d2h.free_at = e
                d2h.busy += dur
                if rec is not None:
                    rec.op(d2h.name, "writeback", op.sid, op.token, op.layer, op.expert, s, e,
                           self.expert_bytes)  # fmt: skip
                if self._unified:
                    self._mem(s, e, self.expert_bytes)
                op.end = e
                op.stage = 1
                self._push(e, op)  # its slot is released when it ends
            else:
                self._release(t)

    def _free_slot(self, t: float) -> None:
        res = self.res
        if res.waiters or res.recorder is not None:
            self._release(t)
        else:
            res.occupancy -= 1

    def _release(self, t: float) -> None:
        res = self.res
        if res.waiters:
            op = res.waiters.popleft()
            op.stage = 1
            self._push(t, op)
        else:
            res.free(t)

    def _cpu_stage(self, t: float, op: LayerOp) -> None:
        """Activations to the host, the expert on a CPU worker, the result back."""
        rec = self.recorder
        if op.local and op.stage != 1:  # a CPU-resident layer's expert: no copies
            if op.stage == 0:
                op.stage = 1
            else:
                op.end = t
                if op.chain is not None:
                    self._push(t, op.chain)
                return
        stage = op.stage
        n = op.n
        if stage == 1:  # on the shared CPU; it ends when a wake-up says so
            self._host.submit(t, self.machine.cpu_job(op, op.seq, t, n))
            self._cpu_next()
            return
        link = self._d2h if stage == 0 else self._h2d
        s, e = link.lane.serve(t, link.activation_s(n))
        if rec is not None:
            rec.op(link.lane.name, "activation", op.sid, op.token, op.layer, op.expert, s, e,
                   self.act_bytes * n)  # fmt: skip
        if self._unified:
            self._mem(s, e, self.act_bytes * n)
        if stage == 0:
            op.stage = 1
            self._push(e, op)
            return
        op.end = e
        if op.chain is not None:
            nxt = op.chain  # _ssd: a chained CPU expert may still wait for its drive read
            self._push(e if e >= nxt.ssd_at else nxt.ssd_at, nxt)

    def _rearm(self) -> None:
        self._cpu_next()

    def _cpu_next(self) -> None:
        """Schedule the shared CPU's next event (ahead of requests submitted at that time)."""
        cpu = self._host
        t = cpu.next_event()
        if t != INF:
            heapq.heappush(self._heap, (t, -1, next(self._uid), _Wake(cpu.version)))

    def _cpu_wake(self, t: float) -> None:
        """The shared CPU's event at ``t``: calls that end there return their results."""
        rec = self.recorder
        for job in self._host.wake(t):
            op = job.op
            if rec is not None:
                name = self._host.lanes[job.worker].name
                rec.op(name, op.rkind, op.sid, op.token, op.layer, op.expert, job.start, t, 0)
            op.stage = 2
            self._push(t, op)
        self._cpu_next()

    def _mem(self, s: float, e: float, nbytes: int) -> None:
        """Unified memory: a copy from ``s`` to ``e`` takes its share of the DRAM."""
        self.machine.copy_load(s, e, nbytes)
        if self._host.active:
            self._cpu_next()

    def _gpu_mem(self, s: float, e: float, n: int) -> None:
        """Unified memory: a GPU expert kernel takes its share of the DRAM."""
        self.machine.gpu_load(s, e, n)
        if self._host.active:
            self._cpu_next()

    def _resolve(self, op: LayerOp) -> float:
        """Serve requests until ``op`` has its end time."""
        while op.end is None:
            if not self._heap:
                raise RuntimeError(f"engine: operation {op.rkind} can never complete")
            self._serve()
        return op.end

    def _gather_barrier(self, w: LayerWork) -> float:
        """When the last copy into a slot of ``w``'s layer that ``w`` issued lands (-1 if
        none): the layer's GPU experts start no earlier (Plan.barrier)."""
        bar = -1.0
        layer = w.layer
        for op in w.ops:
            if op.kind == FETCH and op.layer == layer:
                t = op.end if op.end is not None else self._resolve(op)
                if t > bar:
                    bar = t
        return bar

    # -- one layer -------------------------------------------------------------------------
    def _layer(self, w: LayerWork) -> float:
        """Time one layer's work; returns when the layer ends."""
        now = w.now
        c = self.c
        if not w.ops and not w.results and not w.deferred:
            # nothing submitted and nothing to wait for but copies already timed: the GPU
            # stream runs the experts by (ready time, expert) without touching the heap
            jobs = []
            for e, src in w.gpu:
                if src.__class__ is not float:
                    break
                jobs.append((src, e))
            else:
                return self._timed_gpu(jobs, now, w.counts, w.sid, w.token, w.layer)
        push = self._push
        n_temp = self.machine.buffers["temp"]
        tempq = self._tempq
        free_bufs = n_temp
        gheap: list[tuple[float, int, int]] = []
        waiting = 0
        heap = self._heap
        serve = self._serve_op
        # Everything submitted before ``now`` has been served, so this layer's requests (all
        # submitted at ``now``, in issue order) are served at once, without the heap.
        for op in w.ops:
            if op.kind == TEMP:
                if free_bufs:
                    free_bufs -= 1
                    op.buf = n_temp - free_bufs - 1
                    if op.ssd_at > now:  # _ssd: submitted when its drive read ends
                        push(op.ssd_at, op)
                    else:
                        serve(now, op)
                else:
                    tempq.append(op)  # submitted when a buffer frees up
            elif op.ssd_at > now:  # _ssd: submitted when its drive read ends
                push(op.ssd_at, op)
            else:
                serve(now, op)
            while heap and heap[0][0] <= now:  # a zero-length stage keeps its place
                self._serve()
        if w.barrier:
            bar = self._gather_barrier(w)
            for e, src in w.gpu:
                if src.__class__ is float:
                    gheap.append((src if src > bar else bar, e, -1))
                elif src.end is not None:
                    gheap.append((src.end if src.end > bar else bar, e, src.buf))
                elif not src.gpu:
                    src.gpu = True
                    waiting += 1
        for e, src in () if w.barrier else w.gpu:
            if src.__class__ is float:
                gheap.append((src, e, -1))
            elif src.end is not None:
                gheap.append((src.end, e, src.buf))
            elif not src.gpu:
                src.gpu = True
                waiting += 1
        self._gheap = gheap
        self._waiting = waiting
        heapq.heapify(gheap)
        g = now
        if w.cpu_first and w.sync:
            sync_end = max(self._resolve(op) for op in w.sync)
            if sync_end > now:
                c.cpu_wait += sync_end - now
                g = sync_end
        rec = self.recorder
        counts = w.counts
        gpu_s = self.machine.gpu_s
        fused = self.machine.fused_launch_s  # the layer's fused call, with its first expert
        host = self.machine.host_experts  # None when GPU expert calls cost the host nothing
        deferred = w.deferred
        layer = w.layer
        busy = 0.0
        one = self._one_stream
        if one:  # copies and kernels on one stream: the lanes the copies run on
            h2d_lane, d2h_lane = self._h2d.lane, self._d2h.lane
            late = list(deferred.values())  # copies issued after a computation
        while gheap or self._waiting:
            while self._waiting and heap and (not gheap or heap[0][0] < gheap[0][0]):
                self._serve()
            if not gheap:
                raise RuntimeError("engine: the GPU waits for a copy that can never start")
            ready, e, buf = heapq.heappop(gheap)
            drained = g
            if one:
                # the kernel is issued once its weights are there: every copy issued before
                # it (submitted by then) runs first, and it holds the copy lanes while it runs
                at = ready if ready > g else g
                while heap and heap[0][0] <= at:
                    self._serve()
                ready = at
                if h2d_lane.free_at > ready:
                    ready = h2d_lane.free_at
                if d2h_lane.free_at > ready:
                    ready = d2h_lane.free_at
            if ready > g:
                c.transfer_stall += ready - g
                g = ready
            n = int(counts[e]) if counts is not None else 1
            d = gpu_s(n) + fused
            fused = 0.0
            if host is not None:  # the stream may wait for the host thread to issue it
                wait = host.expert(drained, g, d) - d - g
                if wait > 0.0:
                    c.dispatch_stall += wait
                    g += wait  # the same sum as the reference engine's timeout
            if rec is not None:
                rec.op("gpu", "expert", w.sid, w.token, layer, e, g, g + d, 0)
            if self._unified:
                self._gpu_mem(g, g + d, n)
            g += d
            busy += d
            if one:
                h2d_lane.free_at = d2h_lane.free_at = g
            if deferred:
                wb = deferred.pop(e, None)
                if wb is not None:  # evicted while in use: written back after its compute
                    push(g, wb)
            if buf >= 0 and tempq:  # the buffer is free again: copy the next one in
                nxt = tempq.popleft()
                nxt.buf = buf
                push(g if g >= nxt.ssd_at else nxt.ssd_at, nxt)
        if one:
            # the stream runs the layer's copies before the next layer's kernels: the layer
            # ends once every copy it issued has ended
            last = g
            for op in w.ops:
                if op.kind != CPU:
                    t = op.end if op.end is not None else self._resolve(op)
                    if t > last:
                        last = t
            for op in late:
                t = op.end if op.end is not None else self._resolve(op)
                if t > last:
                    last = t
            if last > g:
                c.transfer_stall += last - g
                g = last
        end = g
        for op in w.results:
            t = op.end if op.end is not None else self._resolve(op)
            if t > end:
                end = t
        if end > g:
            c.cpu_wait += end - g
        c.gpu_expert_busy += busy
        self.machine.gpu.busy += busy
        return end
