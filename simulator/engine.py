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
from typing import Any

import numpy as np

from policies.base import Action, Plan, Policy, SetupContext, Slot, View
from simulator.boundary import Hooks, check_placement, check_plan, check_route
from simulator.costs import CostModel
from simulator.errors import PolicyError, UserError
from simulator.machine import Machine
from simulator.models import ModelShape
from simulator.recorder import Recorder
from simulator.residency import INF, Residency
from simulator.trace import SequenceRouting

_GPU, _FETCH, _TEMP, _CPU, _PRE = (int(a) for a in Action)

# operation kinds (LayerOp.kind); WAKE is the shared CPU's next event, not an operation
WRITEBACK, FETCH, TEMP, CPU, WAKE = range(5)


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
        "gpu",
        "kind",
        "layer",
        "low",
        "n",
        "rkind",
        "seq",
        "sid",
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


class LayerWork:
    """A checked plan as operations: everything one layer submits at its decision time."""

    __slots__ = (
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
        calibration_sequences: tuple[np.ndarray, ...] | None = None,
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
        self.machine = Machine(costs, self.spec)
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
        ctx = SetupContext(
            model=model,
            budget=self.budget,
            costs=costs,
            calibration=calibration,
            calibration_prefill=calibration_prefill,
            oracle=oracle if policy.clairvoyant else None,
            seed=seed,
            calibration_sequences=calibration_sequences,
        )
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
        return RunStats(counters=self.c, e2e=e2e, busy=m.busy(), workers=m.workers())

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
        last = n_layers - 1
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
        unified = m.unified
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
                ws_t = wsums[t]
                d_ne = nonexpert_s(1, context)
            for layer in range(n_layers):
                start = self.now
                if rec is not None:
                    rec.op("gpu", "nonexpert", sid, t, layer, -1, start, start + d_ne, 0)
                c.gpu_nonexpert_busy += d_ne
                gpu_lane.busy += d_ne
                now = start + d_ne
                if unified:
                    m.gpu_load(start, now, p if prefill else 1, context)
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
                    v.weights = w_t[layer]
                    v.probs = p_t[layer]
                    if layer < last:
                        v.next_experts = ee_t[layer + 1]
                        v.next_probs = ep_t[layer + 1]
                    else:
                        v.next_experts = v.next_probs = None
                try:  # Hooks.call, inlined on the per-layer path
                    plan = decide(v)
                except (PolicyError, UserError):
                    raise
                except Exception as exc:
                    raise hooks.fault(hook, exc) from exc
                if (
                    not prefill
                    and plan.__class__ is Plan
                    and plan.route is None
                    and not (
                        plan.evict or plan.prefetch or plan.precalc or plan.victims or plan.low_bit
                    )
                ):
                    # the common decode case: every routed expert resident and run on the GPU
                    end = self._hits_only(layer, experts.tolist(), plan.actions, now)
                    if end is not None:
                        c.true_accesses += len(experts)
                        ws = ws_t[layer]
                        c.gate_mass_total += ws
                        c.gate_mass_kept += ws
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
        for e, w in zip(true_e.tolist(), true_w.tolist(), strict=True):
            if e in used:
                c.gate_mass_kept += w
            elif e in raw:
                c.replaced_degraded += 1
            else:
                c.replaced_mispredicted += 1

    def _low_bit_mass(self, low: Any, true_e: np.ndarray, true_w: Any) -> None:
        """The true gate weight of experts computed from a low-precision copy."""
        for e, w in zip(true_e.tolist(), true_w.tolist(), strict=True):
            if e in low:
                self.c.gate_mass_low_bit += w

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
        return w


class Engine(EngineBase):
    """The fast executor: a heap of submitted requests served lazily in queueing-rule order."""

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
                else:
                    item = gen.send(self._layer(item))
        except StopIteration:
            pass
        e2e = self.now
        while heap:  # background work still running when the last token is out
            self._serve()
        return self.stats(e2e)

    def _due(self, now: float) -> bool:
        heap = self._heap
        return bool(heap) and heap[0][0] <= now

    def _hits_only(
        self, layer: int, routed: list[int], actions: dict[int, Any] | None, now: float
    ) -> float | None:
        # check_plan's common case, _apply's all-hit branch and _layer's all-timed branch,
        # fused: nothing is submitted, so nothing touches the heap
        if actions is not None and (actions.__class__ is not dict or len(actions) != len(routed)):
            return None
        res = self.res
        row = res.resident[layer]
        ready_row = res.ready_at[layer]
        jobs = []
        for e in routed:
            if actions is not None and actions.get(e) != _GPU:
                return None
            if not row[e]:
                return None  # the general check words the error
            ready = ready_row[e]
            if ready == INF:
                return None  # its copy is not timed yet
            jobs.append((float(ready), e))
        c = self.c
        pre = res.prefetched[layer]
        for e in routed:
            if pre[e]:
                pre[e] = False
                c.prefetch_used += 1
        n = len(routed)
        c.decode_accesses += n
        c.decode_hits += n
        self._hits[layer] += n
        self._acc[layer] += n
        where = self.hooks.where
        return self._timed_gpu(jobs, now, None, where.seq or 0, where.token or 0, layer)

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
        d = gpu_s(1)  # one decode token per expert
        for ready, e in jobs:
            if ready > g:
                c.transfer_stall += ready - g
                g = ready
            n = 1
            if counts is not None:
                n = int(counts[e])
                d = gpu_s(n)
            if rec is not None:
                rec.op("gpu", "expert", sid, token, layer, e, g, g + d, 0)
            if unified:  # the expert's weight reads share DRAM bandwidth with CPU experts
                self._gpu_mem(g, g + d, n)
            g += d
            busy += d
        c.gpu_expert_busy += busy
        self.machine.gpu.busy += busy
        return g

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
            # Lane.serve, inlined (the hot path of copy-heavy policies)
            s = t if t > lane.free_at else lane.free_at
            e = lane.free_at = s + link.expert_s
            lane.busy += link.expert_s
            if rec is not None:
                rec.op(lane.name, op.rkind, op.sid, op.token, op.layer, op.expert, s, e,
                       self.expert_bytes)  # fmt: skip
            slot = (op.layer, op.expert)
            res.ready_at[slot] = e
            del res.copying[slot]
            if self._unified:
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
            s, e = link.lane.serve(t, dur)
            if rec is not None:
                rec.op(link.lane.name, "temp", op.sid, op.token, op.layer, op.expert, s, e,
                       nbytes)  # fmt: skip
            if self._unified:
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
            self._push(e, op.chain)

    def _rearm(self) -> None:
        self._cpu_next()

    def _cpu_next(self) -> None:
        """Schedule the shared CPU's next event (ahead of requests submitted at that time)."""
        cpu = self._host
        t = cpu.next_event()
        if t != INF:
            wake = LayerOp(WAKE, "wake", -1, 0, 0, 0, 0)
            wake.n = cpu.version
            heapq.heappush(self._heap, (t, -1, next(self._uid), wake))

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
                    serve(now, op)
                else:
                    tempq.append(op)  # submitted when a buffer frees up
            else:
                serve(now, op)
            while heap and heap[0][0] <= now:  # a zero-length stage keeps its place
                self._serve()
        for e, src in w.gpu:
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
        deferred = w.deferred
        layer = w.layer
        busy = 0.0
        while gheap or self._waiting:
            while self._waiting and heap and (not gheap or heap[0][0] < gheap[0][0]):
                self._serve()
            if not gheap:
                raise RuntimeError("engine: the GPU waits for a copy that can never start")
            ready, e, buf = heapq.heappop(gheap)
            if ready > g:
                c.transfer_stall += ready - g
                g = ready
            n = int(counts[e]) if counts is not None else 1
            d = gpu_s(n)
            if rec is not None:
                rec.op("gpu", "expert", w.sid, w.token, layer, e, g, g + d, 0)
            if self._unified:
                self._gpu_mem(g, g + d, n)
            g += d
            busy += d
            if deferred:
                wb = deferred.pop(e, None)
                if wb is not None:  # evicted while in use: written back after its compute
                    push(g, wb)
            if buf >= 0 and tempq:  # the buffer is free again: copy the next one in
                nxt = tempq.popleft()
                nxt.buf = buf
                push(g, nxt)
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
