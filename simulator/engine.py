"""The SimPy model of one inference host, replaying a routing trace under a policy.

Resources: the GPU compute stream, the host-to-device (H2D) and device-to-host (D2H) copy
engines, a CPU worker pool, GPU expert slots (the budget) and temporary GPU buffers.

One SimPy process runs the model: per sequence a prefill pass (all prompt tokens per layer, with
per-expert token counts) and then one decode step per generated token; per layer the non-expert
part and router run on the GPU stream, the policy decides, and the layer ends when its last
expert is done. Copies and CPU work run on their own serial resources and overlap GPU work; a
copy or CPU result that is not ready when the GPU needs it stalls the layer.

Serial resources (each copy engine, each CPU worker, each temporary buffer) are modelled as
FIFO lanes: a request starts at ``max(issued, lane free)`` and holds the lane for its duration.
This is exactly ``simpy.Resource(capacity=1)`` with first-come-first-served requests issued in
time order (tests/test_engine_invariants.py checks the equivalence), at a fraction of the events:
the process advances the SimPy clock once per layer. Costs come from simulator.costs only.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from policies.base import Action, Plan, Policy, SetupContext, Slot, View
from simulator.costs import CostModel
from simulator.errors import PolicyError
from simulator.models import ModelShape
from simulator.recorder import Recorder
from simulator.trace import SequenceRouting

_GPU, _FETCH, _TEMP, _CPU, _PRE = (int(a) for a in Action)


class Lane:
    """A serial resource (a copy engine, a CPU worker) holding one operation at a time.

    A request starts at the first moment at or after ``earliest`` when the lane is free for its
    whole duration. Requests issued in time order are therefore served first come, first
    served, exactly like ``simpy.Resource(capacity=1)``; a request booked for a later time (the
    return copy of a CPU result) does not block an earlier request that fits before it.
    """

    __slots__ = ("_iv", "busy", "free_at", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.free_at = 0.0
        self.busy = 0.0
        self._iv: list[tuple[float, float]] = []  # booked (start, end), sorted, not yet past

    def _place(self, earliest: float, duration: float) -> float:
        if earliest >= self.free_at:
            return earliest
        t = earliest
        for s, e in self._iv:
            if e <= t:
                continue
            if s > t and s - t >= duration:  # a real gap (FIFO never uses an empty one)
                return t
            t = e
        return t

    def _book(self, start: float, end: float) -> None:
        iv = self._iv
        if not iv or start >= iv[-1][0]:
            iv.append((start, end))
        else:
            bisect.insort(iv, (start, end))
        if end > self.free_at:
            self.free_at = end

    def reserve(self, earliest: float, duration: float) -> tuple[float, float]:
        """Hold the lane for ``duration`` from the first fitting free moment >= ``earliest``."""
        start = self._place(earliest, duration)
        end = start + duration
        self._book(start, end)
        self.busy += duration
        return start, end

    def hold(self, start: float, end: float) -> None:
        """Keep the lane unavailable over [start, end) without doing work (a stream waiting)."""
        if end > start:
            self._book(start, end)

    def prune(self, now: float) -> None:
        """Forget bookings that ended by ``now`` (no request can start before ``now``)."""
        iv = self._iv
        if iv and iv[0][1] <= now:
            self._iv = [x for x in iv if x[1] > now]


class Pool:
    """Identical lanes; a request takes the lane that frees first (lowest index on ties)."""

    __slots__ = ("lanes",)

    def __init__(self, name: str, size: int) -> None:
        self.lanes = [Lane(f"{name}{i}") for i in range(max(1, size))]

    def pick(self) -> Lane:
        """The lane that becomes free first."""
        best = self.lanes[0]
        for lane in self.lanes[1:]:
            if lane.free_at < best.free_at:
                best = lane
        return best

    @property
    def busy(self) -> float:
        """Summed busy time of all lanes."""
        return sum(lane.busy for lane in self.lanes)


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
    gpu_busy: float = 0.0
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
    prefetch_wasted: int = 0
    prefetch_wasted_bytes: int = 0
    precalc_wasted: int = 0
    true_accesses: int = 0
    replaced_mispredicted: int = 0
    replaced_degraded: int = 0
    gate_mass_total: float = 0.0
    gate_mass_kept: float = 0.0
    ttft: list[float] = field(default_factory=list)
    prefill_time: list[float] = field(default_factory=list)
    token_latency: list[float] = field(default_factory=list)
    decode_time: float = 0.0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    sequences: int = 0
    max_occupancy: int = 0


class Engine:
    """Replays sequences through one host under one policy. Use :meth:`run`."""

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
    ) -> None:
        self.policy = policy
        self.pname = policy.name or type(policy).__name__
        self.model = model
        self.costs = costs
        self.budget = int(budget)
        self.n_layers = model.moe_layers
        self.n_experts = model.experts
        self.k = model.top_k
        self.recorder = recorder
        self.env = simpy.Environment()
        self.gpu = Lane("gpu")
        # with a single copy engine both directions share one FIFO lane
        if costs.hw.link.copy_engines >= 2:
            self.h2d, self.d2h = Lane("h2d"), Lane("d2h")
        else:
            self.h2d = self.d2h = Lane("copy")
        self.cpu = Pool("cpu", policy.cpu_workers)
        self.temp_buffers = int(policy.temp_buffers)
        self._lanes = [self.h2d, *([self.d2h] if self.d2h is not self.h2d else []), *self.cpu.lanes]
        self.resident = np.zeros((self.n_layers, self.n_experts), dtype=bool)
        self.ready_at = np.zeros((self.n_layers, self.n_experts), dtype=np.float64)
        self.prefetched = np.zeros((self.n_layers, self.n_experts), dtype=bool)
        self.precalc: dict[Slot, float] = {}
        #: slots held: resident experts (and those in flight) plus evicted ones still being
        #: written back to the host
        self.occupancy = 0
        self._releases: list[float] = []  # end times of pending write-backs
        self._deferred: set[int] = set()  # this layer's in-use victims awaiting write-back
        self.c = Counters(
            hits_per_layer=np.zeros(self.n_layers, dtype=np.int64),
            accesses_per_layer=np.zeros(self.n_layers, dtype=np.int64),
        )
        self.pinned = policy.host_memory == "pinned"
        self.expert_bytes = costs.link_expert_bytes  # what one copy moves (host precision)
        self.t_h2d = costs.h2d_expert_s(self.pinned)
        self.t_d2h = costs.d2h_expert_s(self.pinned)
        self.t_act = costs.activation_copy_s(1)
        self.act_bytes = model.hidden * 2
        self._gpu_cost: dict[int, float] = {}
        self._cpu_cost: dict[int, float] = {}
        self._ne_cost: dict[tuple[int, int], float] = {}
        self.view = View()
        v = self.view
        v.model = model
        v.costs = costs
        v.budget = self.budget
        v.calibration = calibration
        v.resident = self.resident.view()
        v.resident.flags.writeable = False
        self.step = 0
        self.seq_id = 0
        self.token = 0
        ctx = SetupContext(
            model=model,
            budget=self.budget,
            costs=costs,
            calibration=calibration,
            calibration_prefill=calibration_prefill,
            oracle=oracle if policy.clairvoyant else None,
            seed=seed,
        )
        self._place(policy.setup(ctx))

    # -- errors and costs ------------------------------------------------------------------
    def _err(self, msg: str, layer: int | None = None) -> PolicyError:
        return PolicyError(self.pname, msg, seq=self.seq_id, token=self.token, layer=layer)

    def gpu_s(self, n: int) -> float:
        """GPU time of one expert for n tokens (memoised)."""
        t = self._gpu_cost.get(n)
        if t is None:
            t = self._gpu_cost[n] = self.costs.gpu_expert_s(n)
        return t

    def cpu_s(self, n: int) -> float:
        """CPU time of one expert for n tokens (memoised)."""
        t = self._cpu_cost.get(n)
        if t is None:
            t = self._cpu_cost[n] = self.costs.cpu_expert_s(n)
        return t

    def nonexpert_s(self, n: int, context: int) -> float:
        """Non-expert GPU time of one layer (memoised by tokens and context)."""
        key = (n, context)
        t = self._ne_cost.get(key)
        if t is None:
            t = self._ne_cost[key] = self.costs.nonexpert_layer_s(n, context)
        return t

    # -- placement -------------------------------------------------------------------------
    def _place(self, slots: Iterable[Slot]) -> None:
        for layer, expert in slots:
            layer, expert = int(layer), int(expert)
            if not (0 <= layer < self.n_layers and 0 <= expert < self.n_experts):
                raise self._err(f"initial placement names ({layer}, {expert}), outside the model")
            if self.resident[layer, expert]:
                raise self._err(f"initial placement names ({layer}, {expert}) twice")
            self.resident[layer, expert] = True
            self.occupancy += 1
        if self.occupancy > self.budget:
            raise self._err(
                f"initial placement holds {self.occupancy} experts, budget is {self.budget}"
            )
        self.c.max_occupancy = self.occupancy
        if self.recorder is not None:
            self.recorder.occupancy(0.0, self.occupancy)

    def _evict(self, slot: Slot, now: float, layer_needed: Any, layer: int) -> float:
        """Free a slot; with write-back the slot stays held until its D2H copy ends."""
        vl, ve = int(slot[0]), int(slot[1])
        if not (0 <= vl < self.n_layers and 0 <= ve < self.n_experts):
            raise self._err(f"evicts ({vl}, {ve}), outside the model", layer)
        if not self.resident[vl, ve]:
            raise self._err(f"evicts expert {ve} of layer {vl}, which is not resident", layer)
        in_use = vl == layer and layer_needed is not None and ve in layer_needed
        if in_use and not (self.policy.evicts_in_use and self.policy.writeback):
            raise self._err(f"evicts expert {ve} of layer {vl}, which this token needs", layer)
        if in_use:
            # The victim still runs in this layer: its write-back is queued on the stream
            # after its computation (see _layer), and its slot is held until then.
            self.resident[vl, ve] = False
            self.c.evictions += 1
            self._deferred.add(ve)
            return now
        if self.ready_at[vl, ve] > now:
            raise self._err(
                f"evicts expert {ve} of layer {vl} while it is still being copied", layer
            )
        self.resident[vl, ve] = False
        self.c.evictions += 1
        if self.prefetched[vl, ve]:
            self.prefetched[vl, ve] = False
            self.c.prefetch_wasted += 1
            self.c.prefetch_wasted_bytes += self.expert_bytes
        if self.policy.writeback:
            return self._writeback(vl, ve, now)
        self.occupancy -= 1
        if self.recorder is not None:
            self.recorder.occupancy(now, self.occupancy)
        return now

    def _writeback(self, layer: int, expert: int, at: float) -> float:
        """Copy an evicted expert back to the host from ``at``; its slot is held until then.

        The write-back goes on the same CUDA stream as the expert loads (Mixtral-offloading's
        expert_cache.py _swap issues both copy_ calls on the current stream), so it queues
        behind the pending loads and the next load queues behind it: a swap costs H2D + D2H.
        """
        s, e = self.d2h.reserve(max(at, self.h2d.free_at), self.t_d2h)
        if self.h2d is not self.d2h:
            self.h2d.hold(s, e)
        self.c.d2h_bytes += self.expert_bytes
        self.c.d2h_expert_copies += 1
        heapq.heappush(self._releases, e)
        if self.recorder is not None:
            self.recorder.op(
                self.d2h.name,
                "writeback",
                self.seq_id,
                self.token,
                layer,
                expert,
                s,
                e,
                self.expert_bytes,
            )
        return e

    def _slot_free_at(self, now: float) -> float:
        """When a slot is free for an incoming expert; takes it (waits for a write-back)."""
        releases = self._releases
        while releases and releases[0] <= now:
            heapq.heappop(releases)
            self.occupancy -= 1
        if self.occupancy < self.budget + self.policy.staging_buffers:
            return now
        if releases:
            self.occupancy -= 1
            return heapq.heappop(releases)
        return float("inf")

    def _fetch(
        self, layer: int, expert: int, victim: Slot | None, now: float, needed: Any, kind: str
    ) -> tuple[float, float]:
        """Copy an expert into a slot (evicting ``victim``); returns (copy start, copy end)."""
        if self.resident[layer, expert]:
            raise self._err(f"fetches expert {expert}, which is already resident", layer)
        if victim is not None:
            self._evict(victim, now, needed, layer)
        avail = self._slot_free_at(now)
        if avail == float("inf"):
            raise self._err(
                f"fetches expert {expert} of layer {layer} with all "
                f"{self.budget} slots full and no victim",
                layer,
            )
        start, end = self.h2d.reserve(avail, self.t_h2d)
        self.resident[layer, expert] = True
        self.ready_at[layer, expert] = end
        self.occupancy += 1
        held = self.occupancy
        resident = held - len(self._releases) - len(self._deferred)
        if resident > self.budget:
            raise self._err(
                f"holds {resident} resident experts, budget is {self.budget}",
                layer,
            )
        if held > self.c.max_occupancy:
            self.c.max_occupancy = held
        self._expert_copied(kind, layer, expert, start, end)
        if self.recorder is not None:
            self.recorder.occupancy(start, held)
        return start, end

    def _expert_copied(self, kind: str, layer: int, expert: int, start: float, end: float) -> None:
        """Count (and record) one expert copied host-to-device."""
        self.c.h2d_bytes += self.expert_bytes
        self.c.h2d_expert_copies += 1
        if self.recorder is not None:
            self.recorder.op(
                self.h2d.name,
                kind,
                self.seq_id,
                self.token,
                layer,
                expert,
                start,
                end,
                self.expert_bytes,
            )

    # -- one layer ---------------------------------------------------------------------------
    def _layer(
        self,
        now: float,
        layer: int,
        n_tokens: int,
        context: int,
        plan: Plan,
        experts: np.ndarray,
        counts: np.ndarray | None,
        prefill: bool,
    ) -> float:
        """Turn a plan into operations; returns the time the layer ends."""
        rec = self.recorder
        c = self.c
        seq, tok = self.seq_id, self.token
        actions = plan.actions
        # Experts that must stay in a slot while this layer runs (GPU or FETCH): a routed
        # expert the plan computes on the CPU or from a temporary copy may be evicted (DAOP's
        # prefill swaps send a cold expert that some prompt tokens chose back to the host).
        needed = (
            set(experts.tolist())
            if actions is None
            else {e for e in experts.tolist() if actions.get(e) in (_GPU, _FETCH)}
        )
        routed = len(experts)
        serial = plan.cpu_serial
        chain = now  # end of the previous CPU job when this layer's CPU work is serial
        sync_end = now  # last CPU result of this layer's Action.CPU jobs
        for lane in self._lanes:
            lane.prune(now)
        # 1. explicit evictions (no fetch attached)
        for slot in plan.evict:
            self._evict(slot, now, needed, layer)
        # 2. demand copies and CPU work, in routing order
        gpu_jobs: list[tuple[float, int, int]] = []  # (ready time, expert, temp buffer or -1)
        cpu_ends: list[float] = []
        temps: list[int] = []
        cpu_jobs: list[tuple[int, int]] = []
        n_hits = 0
        order = experts.tolist()
        if actions is not None:
            # hits are judged before this layer's insertions: resident experts first
            order = [e for e in order if actions.get(e) == _GPU] + [
                e for e in order if actions.get(e) != _GPU
            ]
        for e in order:
            n = int(counts[e]) if counts is not None else 1
            a = _GPU if actions is None else actions.get(e)
            if a is None:
                raise self._err(f"gives no action for routed expert {e}", layer)
            if a == _GPU:
                if not self.resident[layer, e]:
                    raise self._err(f"runs expert {e} on the GPU but it is not resident", layer)
                ready = self.ready_at[layer, e]
                if self.prefetched[layer, e]:
                    self.prefetched[layer, e] = False
                    c.prefetch_used += 1
                n_hits += 1
                gpu_jobs.append((ready, e, -1))
            elif a == _FETCH:
                victim = plan.victims.get(e)
                _, end = self._fetch(layer, e, victim, now, needed, "fetch")
                c.fetches += 1
                gpu_jobs.append((end, e, -1))
            elif a == _TEMP:
                if self.resident[layer, e]:
                    raise self._err(
                        f"copies expert {e} to a temporary buffer but it is resident", layer
                    )
                temps.append(e)
            elif a == _CPU:
                cpu_jobs.append((e, n))
            elif a == _PRE:
                ready = self.precalc.pop((layer, e), None)
                if ready is None:
                    raise self._err(
                        f"uses a CPU pre-calculation of expert {e} that was never submitted", layer
                    )
                cpu_ends.append(ready)
            else:
                raise self._err(f"returns unknown action {a!r} for expert {e}", layer)
        if actions is not None and len(actions) != routed:
            extra = sorted(set(actions) - set(experts.tolist()))
            raise self._err(f"gives actions for experts {extra} that are not routed", layer)
        if prefill:
            c.prefill_accesses += routed
            c.prefill_hits += n_hits
        else:
            c.decode_accesses += routed
            c.decode_hits += n_hits
            c.hits_per_layer[layer] += n_hits
            c.accesses_per_layer[layer] += routed
        # demand copies into temporary buffers: one per free buffer now, the rest as buffers
        # free up on the GPU stream (a buffer holds its expert until its computation ends)
        temp_queue = temps[::-1]
        if temps and self.temp_buffers < 1:
            raise self._err("copies to a temporary buffer but declares temp_buffers = 0", layer)
        for buf in range(min(self.temp_buffers, len(temps))):
            e = temp_queue.pop()
            gpu_jobs.append((self._temp_copy(now, layer, e), e, buf))
        # 3. background work for coming layers
        for pl, pe, victim in plan.prefetch:
            pl, pe = int(pl), int(pe)
            if not (0 <= pl < self.n_layers and 0 <= pe < self.n_experts):
                raise self._err(f"prefetches ({pl}, {pe}), outside the model", layer)
            if self.resident[pl, pe]:
                raise self._err(f"prefetches expert {pe} of layer {pl}, already resident", layer)
            self._fetch(pl, pe, victim, now, needed if pl == layer else None, "prefetch")
            self.prefetched[pl, pe] = True
            c.prefetches += 1
        for e, n in cpu_jobs:
            done = self._cpu_job(chain if serial else now, layer, e, n, "cpu_expert")
            if serial:
                chain = done
            if done > sync_end:
                sync_end = done
            cpu_ends.append(done)
            c.cpu_expert_evals += 1
        pchain = now
        for pl, pe in plan.precalc:
            pl, pe = int(pl), int(pe)
            if not (layer < pl < self.n_layers and 0 <= pe < self.n_experts):
                raise self._err(f"pre-calculates ({pl}, {pe}): must be a coming layer", layer)
            if (pl, pe) in self.precalc:
                raise self._err(f"pre-calculates expert {pe} of layer {pl} twice", layer)
            done = self._cpu_job(pchain if serial else now, pl, pe, 1, "precalc")
            if serial:
                pchain = done
            self.precalc[(pl, pe)] = done
            c.cpu_precalc_evals += 1
        # 4. the GPU stream: resident experts first, then in order of arrival; with
        # ``cpu_first`` the thread driving the GPU computed the CPU experts first
        g = now
        if plan.cpu_first and sync_end > now:
            c.cpu_wait += sync_end - now
            g = sync_end
        busy = 0.0
        heapq.heapify(gpu_jobs)
        while gpu_jobs:
            ready, e, buf = heapq.heappop(gpu_jobs)
            if ready > g:
                c.transfer_stall += ready - g
                g = ready
            n = int(counts[e]) if counts is not None else 1
            d = self.gpu_s(n)
            if rec is not None:
                rec.op("gpu", "expert", seq, tok, layer, e, g, g + d, 0)
            g += d
            busy += d
            if e in self._deferred:  # evicted while in use: written back after its compute
                self._deferred.discard(e)
                self._writeback(layer, e, g)
            if buf >= 0 and temp_queue:  # the buffer is free again: copy the next one in
                nxt = temp_queue.pop()
                heapq.heappush(gpu_jobs, (self._temp_copy(g, layer, nxt), nxt, buf))
        end = g
        for t in cpu_ends:
            if t > end:
                end = t
        if end > g:
            c.cpu_wait += end - g
        c.gpu_expert_busy += busy
        self.gpu.busy += busy
        return end

    def _temp_copy(self, at: float, layer: int, expert: int) -> float:
        """Copy an expert into a temporary buffer from ``at``; returns when it has arrived."""
        start, end = self.h2d.reserve(at, self.t_h2d)
        c = self.c
        c.temp_copies += 1
        self._expert_copied("temp", layer, expert, start, end)
        return end

    def _cpu_job(self, now: float, layer: int, expert: int, n: int, kind: str) -> float:
        """Activations to the host, the expert on a CPU worker, results back; returns arrival."""
        rec = self.recorder
        c = self.c
        act = self.act_bytes * n
        t_act = self.costs.activation_copy_s(n) if n != 1 else self.t_act
        s1, e1 = self.d2h.reserve(now, t_act)
        lane = self.cpu.pick()
        dur = self.cpu_s(n)
        s2, e2 = lane.reserve(e1, dur)
        s3, e3 = self.h2d.reserve(e2, t_act)
        c.d2h_bytes += act
        c.h2d_bytes += act
        if rec is not None:
            seq, tok = self.seq_id, self.token
            rec.op(self.d2h.name, "activation", seq, tok, layer, expert, s1, e1, act)
            rec.op(lane.name, kind, seq, tok, layer, expert, s2, e2, 0)
            rec.op(self.h2d.name, "activation", seq, tok, layer, expert, s3, e3, act)
        return e3

    # -- sequences ---------------------------------------------------------------------------
    def _routing_fidelity(
        self, plan: Plan, true_e: np.ndarray, true_w: np.ndarray, wsum: float, layer: int
    ) -> np.ndarray:
        """Check a substituted route and count how much of the true routing it replaced."""
        c = self.c
        route = plan.route
        c.true_accesses += true_e.shape[0]
        c.gate_mass_total += wsum
        if route is None:
            c.gate_mass_kept += wsum
            return true_e
        route = np.asarray(route)
        if route.ndim != 1:
            raise self._err("returns a malformed route (not one-dimensional)", layer)
        # plain Python on k-element lists: numpy's set routines cost more than the work here
        ids = route.tolist()
        if ids and (min(ids) < 0 or max(ids) >= self.n_experts):
            raise self._err(f"routes to expert ids outside 0..{self.n_experts - 1}", layer)
        used = set(ids)
        if len(used) != len(ids):
            raise self._err("routes to the same expert twice", layer)
        raw = set(plan.raw_route.tolist()) if plan.raw_route is not None else set()
        for e, w in zip(true_e.tolist(), true_w.tolist(), strict=True):
            if e in used:
                c.gate_mass_kept += w
            elif e in raw:
                c.replaced_degraded += 1
            else:
                c.replaced_mispredicted += 1
        return route

    def _prefill(self, r: SequenceRouting) -> Iterator[simpy.Event]:
        env, v, pol = self.env, self.view, self.policy
        p = r.n_prefill
        if p == 0:
            return
        start = env.now
        v.phase = "prefill"
        v.n_tokens = p
        v.context = 0
        v.token = 0
        v.position = int(r.positions[0])
        v.next_experts = v.next_probs = v.next_weights = None
        self.token = 0
        n_exp = self.n_experts
        for layer in range(self.n_layers):
            now = env.now
            sel = r.experts[:p, layer, :]
            counts = np.bincount(sel.reshape(-1), minlength=n_exp)
            experts = np.flatnonzero(counts)
            experts = experts[np.argsort(-counts[experts], kind="stable")]
            d_ne = self.nonexpert_s(p, 0)
            if self.recorder is not None:
                self.recorder.op("gpu", "nonexpert", self.seq_id, 0, layer, -1, now, now + d_ne, 0)
            self.c.gpu_nonexpert_busy += d_ne
            t = now + d_ne
            v.layer = layer
            v.now = t
            v.step = self.step
            v.experts = experts
            v.counts = counts
            v.weights = r.weights[:p, layer, :].mean(axis=0)
            v.probs = r.probs[:p, layer, :].mean(axis=0)
            try:
                plan = pol.prefill_layer(v)
            except PolicyError:
                raise
            except Exception as exc:
                raise self._err(f"raised {type(exc).__name__}: {exc}", layer) from exc
            if not isinstance(plan, Plan):
                raise self._err(f"returned {type(plan).__name__}, expected a Plan", layer)
            if plan.route is not None:
                raise self._err("substitutes routing during prefill (not supported)", layer)
            end = self._layer(t, layer, p, p, plan, experts, counts, prefill=True)
            self.gpu.busy += d_ne
            yield env.timeout(end - now)
        self.step += 1
        self.c.prefill_time.append(env.now - start)
        self.c.prefill_tokens += p

    def _decode(self, r: SequenceRouting) -> Iterator[simpy.Event]:
        env, v, pol = self.env, self.view, self.policy
        c = self.c
        v.phase = "decode"
        v.n_tokens = 1
        v.counts = None
        n_layers = self.n_layers
        last = n_layers - 1
        full = r.prob_ids is not None
        probs = r.full_probs(self.n_experts) if full else r.probs
        eprobs = r.full_probs(self.n_experts, early=True) if full else r.early_probs
        wsums = r.weights.sum(axis=2).tolist()  # true gate mass per token-layer
        for t in range(r.n_prefill, r.n_tokens):
            t0 = env.now
            self.token = t
            v.token = t
            v.position = int(r.positions[t])
            context = v.position  # tokens already in the KV cache
            v.context = context
            v.step = self.step
            ex_t, w_t, p_t = r.experts[t], r.weights[t], probs[t]
            ee_t, ep_t = r.early_experts[t], eprobs[t]
            ws_t = wsums[t]
            d_ne = self.nonexpert_s(1, context)
            for layer in range(n_layers):
                now = env.now
                if self.recorder is not None:
                    self.recorder.op(
                        "gpu", "nonexpert", self.seq_id, t, layer, -1, now, now + d_ne, 0
                    )
                c.gpu_nonexpert_busy += d_ne
                tr = now + d_ne
                true_e = ex_t[layer]
                v.layer = layer
                v.now = tr
                v.experts = true_e
                v.weights = w_t[layer]
                v.probs = p_t[layer]
                if layer < last:
                    v.next_experts = ee_t[layer + 1]
                    v.next_probs = ep_t[layer + 1]
                else:
                    v.next_experts = v.next_probs = None
                try:
                    plan = pol.decode_layer(v)
                except PolicyError:
                    raise
                except Exception as exc:
                    raise self._err(f"raised {type(exc).__name__}: {exc}", layer) from exc
                # exact-type test first: it is the common case and cheaper than isinstance
                if plan.__class__ is not Plan and not isinstance(plan, Plan):
                    raise self._err(f"returned {type(plan).__name__}, expected a Plan", layer)
                route = self._routing_fidelity(plan, true_e, w_t[layer], ws_t[layer], layer)
                end = self._layer(tr, layer, 1, context, plan, route, None, prefill=False)
                self.gpu.busy += d_ne
                yield env.timeout(end - now)
            # a pre-calculation is for a coming layer of the same token: one nobody consumed
            # by the token's end is wasted (e.g. DAOP's discarded last-layer result)
            if self.precalc:
                c.precalc_wasted += len(self.precalc)
                self.precalc.clear()
            lat = env.now - t0
            c.token_latency.append(lat)
            c.decode_time += lat
            c.decode_tokens += 1
            self.step += 1

    def _process(
        self, sequences: Iterable[SequenceRouting], on_sequence: Any = None
    ) -> Iterator[simpy.Event]:
        for r in sequences:
            self.seq_id = int(r.seq_id)
            self.view.seq_id = self.seq_id
            self.policy.on_sequence_start(self.seq_id, r.n_prefill)
            t0 = self.env.now
            yield from self._prefill(r)
            self.c.ttft.append(self.env.now - t0)
            yield from self._decode(r)
            self.policy.on_sequence_end(self.seq_id)
            # CPU pre-calculations nobody consumed (e.g. DAOP's last-layer quirk)
            self.c.precalc_wasted += len(self.precalc)
            self.precalc.clear()
            self.c.sequences += 1
            if on_sequence is not None:
                on_sequence(r)

    def run(self, sequences: Iterable[SequenceRouting], on_sequence: Any = None) -> Counters:
        """Simulate the sequences back to back; returns the accumulated counters."""
        proc = self.env.process(self._process(sequences, on_sequence))
        self.env.run(until=proc)
        # background work still running when the last token is out does not extend e2e
        self.c.gpu_busy = self.gpu.busy
        return self.c
