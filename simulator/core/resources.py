"""The machine's resources and how each serves a request (each rule written once).

* :class:`Lane`: a serial resource (a GPU stream, a copy engine, a drive), first come first
  served in the order the executor submits requests (docs/policy-api.md, "Timing rules");
* :class:`Engines`: the copy engines of one direction of a link (or one peer lane), lanes
  serving one queue;
* :class:`Lanes`: the one way any lane is occupied (serve one, hold several together, run a
  timed piece of work, a CPU call's end): it writes the lanes' state, records the timeline row
  and, on unified memory, registers the occupation's DRAM traffic;
* :class:`SharedCpu`: the host CPU, worker threads whose running calls share one socket by
  processor sharing (and, on unified memory, the DRAM with copies and GPU kernels);
* :class:`HostThread`: the runtime's thread that issues the GPU's kernels and blocks at its
  syncs (docs/cost-model.md, "Runtime profiles");
* :class:`Residency`: which experts are resident, when their copies end, and the GPU slots
  they hold (one pool per GPU, with the fetches waiting for a slot).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from daopsim.simulator.core.ops import Op

INF: Final = math.inf
#: A CPU job is done once its remaining work is below this fraction of its work (the rounding
#: of piecewise progress; far below any duration the model resolves).
DONE_EPS: Final = 1e-9


class Lane:
    """A serial resource holding one request at a time (first come, first served).

    ``free_at``: when it is free for the next request; ``busy``: seconds it worked (a GPU
    stream's kernels of one layer first sum into ``pending``, added when the layer ends).
    Only :class:`Lanes` (and the shared CPU, for its workers) writes them."""

    __slots__ = ("busy", "free_at", "name", "pending")

    def __init__(self, name: str) -> None:
        self.name = name
        self.free_at = 0.0
        self.busy = 0.0
        self.pending = 0.0


class Engines:
    """The copy engines of one direction of a link: ``n`` lanes serving one queue.

    A request goes to the engine free first (the lowest index on ties), so with requests
    served in queueing-rule order it starts at ``max(submitted, that engine's free_at)``:
    one copy per engine at a time. With one engine this is a :class:`Lane`. The engines are
    named ``name``, ``name.1``, ``name.2`` ...
    """

    __slots__ = ("lanes", "name")

    def __init__(self, name: str, n: int = 1) -> None:
        self.name = name
        self.lanes = [Lane(name if i == 0 else f"{name}.{i}") for i in range(max(1, n))]

    def pick(self) -> Lane:
        """The engine free first (the lowest index on ties)."""
        lanes = self.lanes
        best = lanes[0]
        for i in range(1, len(lanes)):
            if lanes[i].free_at < best.free_at:
                best = lanes[i]
        return best

    def all_free_at(self) -> float:
        """When every engine is free."""
        t = 0.0
        for lane in self.lanes:
            if lane.free_at > t:
                t = lane.free_at
        return t


class Lanes:
    """The one way the machine's lanes are occupied (docs/policy-api.md, "Timing rules").

    :meth:`serve` serves one request on an engine of a group (queueing rule: it starts when
    it is submitted or when the engine frees up, whichever is later); :meth:`hold` holds an
    engine of several groups together from the moment all are free (a write-back holds both
    copy directions of its link); :meth:`run` occupies a lane with work whose start the
    caller timed (a GPU kernel after its stream's order and its host thread, a step's part
    on an idle lane); :meth:`block` keeps lanes from serving until a time without working
    (one stream: a kernel holds the copy engines); :meth:`cpu_done` ends the shared CPU's
    calls. Each records its timeline row and, on unified memory, takes its share of the one
    DRAM from the shared CPU (``on_load`` then re-times the CPU's next event).
    """

    def __init__(self, machine: Any, recorder: Any, on_load: Callable[[], None]) -> None:
        self.cpu: SharedCpu = machine.cpu
        #: unified memory: the DRAM share of a copy (bytes, seconds) and of a GPU kernel
        #: (tokens, context or None); a bus-attached host has no shared DRAM to register
        self.unified: bool = machine.unified
        self.copy_share: Callable[[int, float], float] = machine.costs.copy_dram_share
        self.kernel_share: Callable[[int, int | None], float] = machine.dram_share
        self.rec = recorder
        self.on_load = on_load

    def serve(self, group: Engines, t: float, dur: float, kind: str, sid: int, token: int,
              layer: int, expert: int, nbytes: int, dram: bool = True) -> float:  # fmt: skip
        """A request of ``dur`` seconds submitted at ``t`` (every earlier one served first) on
        the engine of ``group`` free first; a copy of ``nbytes`` through the DRAM unless
        ``dram`` is False (a drive read, a peer transfer). Returns its end."""
        lanes = group.lanes
        lane = lanes[0] if len(lanes) == 1 else group.pick()
        start = t if t > lane.free_at else lane.free_at
        end = start + dur
        lane.free_at = end
        lane.busy += dur
        if self.rec is not None:
            self.rec.op(lane.name, kind, sid, token, layer, expert, start, end, nbytes)
        if dram and self.unified:
            self._traffic(start, end, nbytes, -1, -1)
        return end

    def hold(self, groups: list[Engines], t: float, dur: float, kind: str, sid: int,
             token: int, layer: int, expert: int, nbytes: int) -> float:  # fmt: skip
        """A copy of ``nbytes`` holding an engine of every group of ``groups`` together
        (the same group twice: one engine), from when all are free; the first group's engine
        does the work (its busy time and row). Returns its end."""
        held: list[Lane] = []
        start = t
        for g in groups:
            lane = g.pick()
            if lane not in held:
                held.append(lane)
                if lane.free_at > start:
                    start = lane.free_at
        end = start + dur
        for lane in held:
            lane.free_at = end
        held[0].busy += dur
        self._row(held[0], kind, sid, token, layer, expert, start, end, nbytes)
        if self.unified:
            self._traffic(start, end, nbytes, -1, -1)
        return end

    def run(self, lane: Lane, start: float, dur: float, kind: str, sid: int, token: int,
            layer: int, expert: int, nbytes: int, tokens: int = -1, context: int = -1,
            per_layer: bool = False) -> float:  # fmt: skip
        """``lane`` works ``dur`` seconds from ``start`` (the caller timed it: no earlier
        than ``lane.free_at``); returns its end. Its DRAM traffic on unified memory: a GPU
        kernel's over ``tokens`` (and ``context``, a layer's non-expert part) when
        ``tokens >= 0``, else a copy's of ``nbytes`` (none on a CPU worker: 0 bytes).
        ``per_layer``: its busy time joins the layer's sum (:meth:`settle`)."""
        end = start + dur
        lane.free_at = end
        if per_layer:
            lane.pending += dur
        else:
            lane.busy += dur
        if self.rec is not None:
            self.rec.op(lane.name, kind, sid, token, layer, expert, start, end, nbytes)
        if self.unified and (tokens >= 0 or nbytes > 0):
            self._traffic(start, end, nbytes, tokens, context)
        return end

    def settle(self, lanes: list[Lane]) -> None:
        """A layer ended: each lane's busy time grows by the sum of its layer's kernels (a
        stream's busy time accumulates layer by layer)."""
        for lane in lanes:
            lane.busy += lane.pending
            lane.pending = 0.0

    def block(self, groups: list[Engines], until: float) -> None:
        """Every engine of ``groups`` serves nothing before ``until`` (held, not working)."""
        for g in groups:
            for lane in g.lanes:
                lane.free_at = until

    def cpu_done(self, t: float) -> list[CpuJob]:
        """The shared CPU's event at ``t``: the calls that end there (in issue order), each
        recorded on its worker."""
        cpu = self.cpu
        done = cpu.wake(t)
        for job in done:
            op = job.op
            self._row(cpu.lanes[job.worker], op.row_kind, op.sid, op.token, op.layer,
                      op.expert, job.start, t, 0)  # fmt: skip
        return done

    def _traffic(self, start: float, end: float, nbytes: int, tokens: int, context: int) -> None:
        """Unified memory: an occupation from ``start`` to ``end`` takes its share of the DRAM,
        a GPU kernel's over ``tokens`` (``context``: a layer's non-expert part) when
        ``tokens >= 0``, else a copy's of ``nbytes``."""
        if tokens >= 0:
            share = self.kernel_share(tokens, context if context >= 0 else None)
        else:
            share = self.copy_share(nbytes, end - start)
        self.load(start, end, share)

    def load(self, start: float, end: float, share: float) -> None:
        """Unified memory: ``share`` of the DRAM is taken from ``start`` to ``end``; the
        shared CPU's rate may change, so its next event is timed again."""
        self.cpu.load(start, end, share)
        if self.cpu.active:
            self.on_load()

    def _row(self, lane: Lane, kind: str, sid: int, token: int, layer: int, expert: int,
             start: float, end: float, nbytes: int) -> None:  # fmt: skip
        if self.rec is not None:
            self.rec.op(lane.name, kind, sid, token, layer, expert, start, end, nbytes)


class CpuJob:
    """One CPU expert call on the shared host CPU: its work in alone-seconds and its shares."""

    __slots__ = ("dram", "end", "op", "rem", "seq", "share", "start", "submitted", "work", "worker")

    def __init__(
        self, op: Any, seq: int, submitted: float, work: float, share: float, dram: float
    ) -> None:
        self.op = op
        self.seq = seq
        self.submitted = submitted
        #: seconds the call takes alone on the whole socket
        self.work = work
        self.rem = work
        #: fraction of the socket (cores or bandwidth) it uses alone
        self.share = share
        #: fraction of the unified DRAM it streams alone (0 on a bus-attached host)
        self.dram = dram
        self.start = math.nan
        self.end = math.nan
        self.worker = -1


class SharedCpu:
    """The host CPU: worker threads whose running calls share one socket (processor sharing).

    At most one call runs per worker; more wait, served by (submission time, issue number).
    The running calls progress at one common rate, ``min(1, 1 / sum(share))`` of their alone
    speed, and on unified memory at most ``(1 - others' DRAM share) / sum(dram share)``
    (docs/cost-model.md, "Shared host CPU"). A running call's end depends on later arrivals,
    so the executor calls :meth:`submit` and :meth:`load` when those happen and :meth:`wake`
    at :meth:`next_event`, recognising stale wake-ups by :attr:`version`.
    """

    def __init__(self, name: str, size: int) -> None:
        self.lanes = [Lane(f"{name}{i}") for i in range(max(1, size))]
        self._idle = [True] * len(self.lanes)
        self.active: list[CpuJob] = []
        self._queue: list[tuple[float, int, CpuJob]] = []
        #: DRAM load changes of unified memory: (time, order, delta share)
        self._loads: list[tuple[float, int, float]] = []
        self._nload = 0
        self.ext = 0.0
        self.rate = 1.0
        self.t = 0.0
        self.version = 0

    def submit(self, t: float, job: CpuJob) -> None:
        """A call is submitted at ``t`` (every earlier event has been applied)."""
        self._advance(t)
        heapq.heappush(self._queue, (job.submitted, job.seq, job))
        self._admit(t)
        self.version += 1

    def load(self, start: float, end: float, share: float) -> None:
        """Unified memory: a copy or a kernel takes ``share`` of the DRAM from start to end."""
        if share <= 0.0 or end <= start:
            return
        if start < self.t:
            raise RuntimeError("shared CPU: a DRAM load was registered in its past")
        self._nload += 1
        heapq.heappush(self._loads, (start, self._nload, share))
        self._nload += 1
        heapq.heappush(self._loads, (end, self._nload, -share))
        self._advance(self.t)
        self.version += 1

    def next_event(self) -> float:
        """When the next call ends or the rate changes (inf when nothing runs)."""
        if not self.active:
            return INF
        nxt = self._loads[0][0] if self._loads else INF
        rate = self.rate
        if rate > 0.0:
            rem = self.active[0].rem
            for j in self.active:  # the first smallest
                if j.rem < rem:
                    rem = j.rem
            dep = self.t + (rem / rate if rem > 0.0 else 0.0)
            if rem > 0.0 and dep <= self.t:
                # the remaining work is below the clock's resolution at t: end it at the next
                # representable time, so the event always lies ahead (else it repeats forever)
                dep = math.nextafter(self.t, INF)
            if dep < nxt:
                nxt = dep
        return nxt

    def wake(self, t: float) -> list[CpuJob]:
        """Advance to ``t``; returns the calls that end there (in issue order)."""
        self._advance(t)
        done = [j for j in self.active if j.rem <= DONE_EPS * j.work]
        if done:
            for j in done:
                self.active.remove(j)
                j.end = t
                lane = self.lanes[j.worker]
                lane.busy += t - j.start
                lane.free_at = t
                self._idle[j.worker] = True
            self._admit(t)
        self.version += 1
        return done

    def _admit(self, t: float) -> None:
        """Start waiting calls on idle workers (the one free longest first, lowest index),
        keep the running calls in issue order, and re-rate."""
        q = self._queue
        while q and True in self._idle:
            job = heapq.heappop(q)[2]
            i = self._idle_worker()
            self._idle[i] = False
            job.worker = i
            job.start = t
            self.active.append(job)
        self.active.sort(key=_by_seq)
        self._rerate()

    def _idle_worker(self) -> int:
        """The idle worker free longest, the lowest index on ties (-1 if none is idle)."""
        i = -1
        best = 0.0
        for k, free in enumerate(self._idle):
            if free and (i < 0 or self.lanes[k].free_at < best):
                i, best = k, self.lanes[k].free_at
        return i

    def _advance(self, t: float) -> None:
        """Progress the running calls to ``t``, applying DRAM load changes on the way."""
        loads = self._loads
        while loads and loads[0][0] <= t:
            b, _, delta = heapq.heappop(loads)
            self._progress(b)
            self.ext += delta
            self._rerate()
        self._progress(t)

    def _progress(self, t: float) -> None:
        dt = t - self.t
        if dt > 0.0:
            r = self.rate
            for j in self.active:
                j.rem -= r * dt
            self.t = t

    def _rerate(self) -> None:
        share = dram = 0.0
        for j in self.active:
            share += j.share
            dram += j.dram
        rate = 1.0 / share if share > 1.0 else 1.0
        if dram > 0.0:
            rate = min(rate, max(0.0, 1.0 - self.ext) / dram)
        self.rate = rate


def _by_seq(job: CpuJob) -> int:
    return job.seq


class HostThread:
    """The host thread that issues a runtime's kernels and blocks at its syncs.

    It holds one clock, ``t``: when the thread is free to issue the next kernel. The GPU runs
    ahead of it until a sync, where the thread waits for the GPU to drain.

    A segment of ``k`` kernels with GPU time ``d`` (split evenly), issued from ``h`` at
    ``dispatch`` seconds each onto a stream free from ``g``, ends at
    ``max(g + d, h + dispatch + d, h + k * dispatch + d / k)``: GPU-bound, first-kernel-bound
    or dispatch-bound (the last kernel issued, then run).
    """

    __slots__ = ("dispatch", "expert_k", "expert_syncs", "idle_loop", "idle_syncs", "ne_k",
                 "routing_syncs", "step", "sync", "syncs", "t")  # fmt: skip

    def __init__(self, profile: Any, idle_experts: int = 0) -> None:
        self.dispatch: float = profile.dispatch_us * 1e-6
        self.sync: float = profile.sync_us * 1e-6
        self.step: float = profile.step_us * 1e-6
        self.ne_k: int = profile.nonexpert_kernels
        self.expert_k: int = profile.expert_kernels
        self.routing_syncs: int = profile.routing_syncs
        self.expert_syncs: int = profile.expert_syncs
        self.t = 0.0
        #: blocking syncs the thread made
        self.syncs = 0
        # The loop over the experts no token was routed to (``idle_experts`` per layer pass:
        # E - k for one decode token): host time and syncs, no GPU work, charged at the
        # routing point before the routed experts' calls.
        self.idle_syncs: int = idle_experts * profile.idle_expert_syncs
        self.idle_loop: float = idle_experts * (
            profile.idle_expert_kernels * self.dispatch + profile.idle_expert_syncs * self.sync
        )

    @property
    def per_expert(self) -> bool:
        """Whether a GPU expert call costs the host anything."""
        return bool(self.expert_k or self.expert_syncs)

    def issue(self, g: float, d: float, k: int) -> float:
        """Issue ``k`` kernels (GPU time ``d``, split evenly) from the thread's clock onto a
        stream free from ``g``; returns when they end on the GPU (the segment rule above)."""
        end = g + d
        if k:
            h = self.t
            disp = self.dispatch
            t = h + disp + d
            if t > end:
                end = t
            h += k * disp
            t = h + d / k
            if t > end:
                end = t
            self.t = h
        return end

    def nonexpert(self, g: float, d: float, first_layer: bool) -> tuple[float, float]:
        """A layer's non-expert part and router (GPU time ``d``) on a stream free from ``g``.

        Returns (when its GPU work ends, when the routing is known to the host: the decision
        time). With routing syncs the thread waits for the GPU and pays ``sync`` for each. The
        first layer of a forward pass waits for the stream (the previous pass's output token)
        and pays one sync and the per-pass ``step`` cost. Then the MoE loop passes over the
        experts with no token (``idle_loop``); with syncs in that loop the first one waits for
        the routing. The decision is when the thread is free again.
        """
        if first_layer:
            h = g if g > self.t else self.t
            self.t = h + (self.sync + self.step)
            self.syncs += 1
        end = self.issue(g, d, self.ne_k)
        n = self.routing_syncs
        ready = end
        if n:
            h = end if end > self.t else self.t
            self.t = ready = h + n * self.sync
            self.syncs += n
        if not self.idle_loop:
            return end, ready
        h = self.t
        if self.idle_syncs:
            if ready > h:
                h = ready
            self.syncs += self.idle_syncs
        self.t = h = h + self.idle_loop
        return end, (h if h > ready else ready)

    def expert(self, drained: float, start: float, d: float) -> float:
        """A GPU expert call of GPU time ``d`` that the stream could start at ``start`` (its
        weights there, ``drained`` the end of the stream's earlier work); returns its end."""
        n = self.expert_syncs
        if n:
            h = drained if drained > self.t else self.t
            self.t = h + n * self.sync
            self.syncs += n
        return self.issue(start, d, self.expert_k)


class Residency:
    """Which experts are resident and when their copies end; the GPU slots they hold.

    The policy-visible state (``resident``, experts in flight counting as resident) changes
    at decision time; the timed state (``ready_at``, slot occupancy) when the executor serves
    the copies. Each is stored once, flat (index ``layer * n_experts + expert``), and shown as
    a ``[layers, experts]`` numpy array over the same memory. Each GPU has ``cap`` slots (its
    expert budget plus staging buffers): a fetch claims one when one is free, else waits
    (first come, first served) for the next release; an evicted expert keeps its slot until
    its write-back ends.
    """

    def __init__(
        self, n_layers: int, n_experts: int, budget: int, caps: list[int], recorder: Any = None
    ) -> None:
        self.n_layers, self.n_experts = n_layers, n_experts
        self.budget = budget
        size = n_layers * n_experts
        #: resident flags, flat; ``resident`` is the same memory as a [layers, experts] array
        self.mask = bytearray(size)
        self.resident = np.frombuffer(self.mask, dtype=np.bool_).reshape(n_layers, n_experts)
        #: when each resident expert's copy ends (INF while its copy has not started), flat
        # a memoryview of doubles: its item writes are cheaper than an array's
        buf = bytearray(8 * size)
        self.ready = memoryview(buf).cast("d")
        self.ready_at = np.frombuffer(buf, dtype=np.float64).reshape(n_layers, n_experts)
        #: resident experts a prefetch brought that no layer has used yet, flat
        self.prefetched = bytearray(size)
        #: experts whose copy into a slot has been issued but not yet started -> the copy
        self.copying: dict[int, Op] = {}
        self.n_resident = 0
        #: per GPU: slots, slots held (resident experts whose copy has its slot, plus evicted
        #: ones being written back), the most held, fetches waiting for a slot
        self.cap = list(caps)
        self.held = [0] * len(caps)
        self.peak = [0] * len(caps)
        self.waiters: list[deque[Op]] = [deque() for _ in caps]
        #: slots held over every GPU, and the most at once
        self.occupancy = 0
        self.max_occupancy = 0
        self.recorder = recorder

    def place(self, slots: list[tuple[int, int]], gpu_of: list[list[int]] | None) -> None:
        """The initial placement (already checked): resident and ready at time 0."""
        for layer, e in slots:
            self.mask[layer * self.n_experts + e] = 1
            self.held[0 if gpu_of is None else gpu_of[layer][e]] += 1
        self.peak = list(self.held)
        self.n_resident = self.occupancy = self.max_occupancy = len(slots)
        if self.recorder is not None:
            self.recorder.occupancy(0.0, self.occupancy)

    def insert(self, i: int, copy: Op) -> None:
        """Expert ``i`` is resident from now on; its copy is issued, not started yet."""
        self.mask[i] = 1
        self.ready[i] = INF
        self.copying[i] = copy
        self.n_resident += 1

    def remove(self, i: int, now: float) -> tuple[float, Op | None]:
        """Expert ``i`` is no longer resident at ``now`` (its slot may stay held by a
        write-back). A copy into its slot still in flight is detached from the residency (it
        lands, but no longer makes ``i`` ready): returns when it lands (INF while it has not
        started; 0.0 when it has landed) and, if it has not started, the copy."""
        self.mask[i] = 0
        self.n_resident -= 1
        landing = self.ready[i]
        if landing <= now:
            return 0.0, None
        self.ready[i] = INF
        return landing, self.copying.pop(i, None)

    def copied(self, i: int, copy: Op, end: float) -> None:
        """``copy``, into expert ``i``'s slot, has started and ends at ``end`` (a copy
        detached by :meth:`remove` changes nothing)."""
        if self.copying.get(i) is copy:
            self.ready[i] = end
            del self.copying[i]

    def take(self, k: int, t: float) -> bool:
        """Claim a free slot of GPU ``k`` at ``t``; False when none is free (then wait)."""
        if self.held[k] >= self.cap[k]:
            return False
        self.held[k] += 1
        if self.held[k] > self.peak[k]:
            self.peak[k] = self.held[k]
        self.occupancy += 1
        if self.occupancy > self.max_occupancy:
            self.max_occupancy = self.occupancy
        if self.recorder is not None:
            self.recorder.occupancy(t, self.occupancy)
        return True

    def release(self, k: int, t: float) -> Op | None:
        """A slot of GPU ``k`` is released at ``t``: returns the first fetch waiting for one
        (the slot passes to it), else frees the slot and returns None."""
        if self.waiters[k]:
            return self.waiters[k].popleft()
        self.held[k] -= 1
        self.occupancy -= 1
        if self.recorder is not None:
            self.recorder.occupancy(t, self.occupancy)
        return None
