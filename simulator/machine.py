"""The modelled machine: named resources built from a hardware profile and a policy's spec.

A :class:`Machine` owns every resource an operation can occupy, each under a name:

* ``gpu``: the GPU compute stream (one lane);
* links (``links["h2d"]``, ``links["d2h"]``): a transfer path between two memories, with the
  copy engine (lane) it runs on and its cost function. ``link.copy_engines = 1`` puts both
  directions on one lane named ``copy``; two or more give each direction its own lane;
* pools (``pools["cpu"]``): the host CPU, a :class:`SharedCpu`: worker threads (``cpu0``,
  ``cpu1``, ...) whose running expert calls share one socket by processor sharing (and, on
  unified memory, share the DRAM with copies);
* buffers (``buffers["temp"]``, ``buffers["slots"]``): counted GPU memory;
* ``host``: the host thread that issues the runtime's kernels and blocks at its syncs
  (:class:`~simulator.runtime_profiles.HostThread`), or None for a runtime with no overheads.

The engines look resources up by name, so a new tier or device is a new entry here plus its
cost function (docs/architecture.md, "How to add a resource").

A :class:`Lane` is a serial resource. The engines submit requests to it in the order of the
queueing rule (docs/policy-api.md): by submission time, ties by issue order; a request starts
at ``max(submitted, free)`` and holds the lane for its duration, exactly like
``simpy.Resource(capacity=1)`` fed in that order.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from policies.base import ResourceSpec
from simulator.costs import CostModel
from simulator.runtime_profiles import HostThread, RuntimeProfile


class Lane:
    """A serial resource holding one operation at a time (first come, first served)."""

    __slots__ = ("busy", "free_at", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.free_at = 0.0
        self.busy = 0.0

    def serve(self, submitted: float, duration: float) -> tuple[float, float]:
        """Serve a request submitted at ``submitted``; every earlier one was served first."""
        start = submitted if submitted > self.free_at else self.free_at
        end = start + duration
        self.free_at = end
        self.busy += duration
        return start, end


#: A CPU job is done once its remaining work is below this fraction of its work (the rounding
#: of piecewise progress; far below any duration the model resolves).
DONE_EPS = 1e-9
_NAN = math.nan


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
        self.start = _NAN
        self.end = _NAN
        self.worker = -1


def _by_seq(job: CpuJob) -> int:
    return job.seq


class SharedCpu:
    """The host CPU: worker threads whose running calls share one socket (processor sharing).

    At most ``size`` calls run at once (one per worker thread); more wait, served by
    (submission time, issue number). The running calls progress at one common rate, a fraction
    of their alone speed: ``min(1, 1 / sum(share))``, and on unified memory also at most
    ``(1 - copies' DRAM share) / sum(dram share)`` (docs/cost-model.md, "Shared host CPU").
    A lone call runs at its measured speed. A running call's end therefore depends on later
    arrivals: the engines call :meth:`submit` and :meth:`load` when those happen and
    :meth:`wake` at :meth:`next_event`, with stale wake-ups recognised by :attr:`version`.
    Both engines drive this one object, so they share its arithmetic.
    """

    def __init__(self, name: str, size: int) -> None:
        self.name = name
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

    @property
    def busy(self) -> float:
        """Summed seconds the workers held a running call."""
        return sum(lane.busy for lane in self.lanes)

    def submit(self, t: float, job: CpuJob) -> None:
        """A call is submitted at ``t`` (every earlier event has been applied)."""
        if self._loads:
            self._advance(t)
        else:  # _advance with no DRAM load change to apply
            self._progress(t)
        q = self._queue
        idle = self._idle
        if not q and True in idle:
            # nothing waits and a worker is idle: _admit would pop this very job at once
            self._start(job, t)
            if len(self.active) > 1:  # (one running call is in order)
                self._order_active()
            self._rerate()
        else:
            heapq.heappush(q, (job.submitted, job.seq, job))
            self._admit(t)
        self.version += 1

    def submit_next(self, t: float, job: CpuJob) -> float:
        """:meth:`submit` then :meth:`next_event`, in one call: the same arithmetic in the
        same order (progress, the worker pick, the issue order, the rate), written out for
        the commonest case (no DRAM load registered, nothing waiting, a worker idle); any
        other case calls the two."""
        idle = self._idle
        i = self._idle_worker()
        if i < 0 or self._loads or self._queue:
            self.submit(t, job)
            return self.next_event()
        active = self.active
        dt = t - self.t
        if dt > 0.0:  # _progress
            r = self.rate
            for j in active:
                j.rem -= r * dt
            self.t = t
        idle[i] = False
        job.worker = i
        job.start = t
        active.append(job)
        n = len(active)
        if n == 1:  # _rerate's sums (see there)
            share, dram = job.share, job.dram
        elif n == 2:
            a, b = active
            if a.seq > b.seq:  # _order_active
                active.reverse()
            share, dram = a.share + b.share, a.dram + b.dram
        else:
            active.sort(key=_by_seq)
            share = sum(j.share for j in active)
            dram = sum(j.dram for j in active)
        rate = 1.0 / share if share > 1.0 else 1.0
        if dram > 0.0:
            rate = min(rate, max(0.0, 1.0 - self.ext) / dram)
        self.rate = rate
        self.version += 1
        if rate > 0.0:  # next_event without a DRAM load
            rem = active[0].rem
            for j in active:
                if j.rem < rem:
                    rem = j.rem
            dep = self.t + (rem / rate if rem > 0.0 else 0.0)
            if dep < math.inf:
                return dep
        return math.inf

    def arrive_then_end(self, t1: float, job: CpuJob) -> tuple[float, float] | None:
        """``submit_next(t1, job)`` then ``wake_next`` at the time it returns, in one pass,
        when that wake-up ends the one call running before ``job`` and not ``job``: the
        commonest step of daop's pre-calculation chains (one call running, the next one
        arriving before it ends). Returns (the wake-up's time, the next event's time), with
        the state both calls leave; returns None, changing nothing, in any other case (more
        or fewer running calls, a waiting call, a DRAM load, no idle worker, another
        outcome). The same arithmetic in the same order: progress to ``t1``, the worker
        pick, the two calls' rate (``_rerate``'s sum of two terms), the next event, progress
        to it, the done test, the lone call's rate, the next event."""
        active = self.active
        if len(active) != 1 or self._loads or self._queue:
            return None
        idle, lanes = self._idle, self.lanes
        if len(lanes) > 2:
            return None
        i = self._idle_worker()
        if i < 0:
            return None
        j0 = active[0]
        rate = self.rate
        t = self.t
        rem0 = j0.rem
        dt = t1 - t
        if dt > 0.0:  # _progress to t1
            rem0 -= rate * dt
            t = t1
        rem1 = job.work  # job.rem as CpuJob sets it
        share = j0.share + job.share  # _rerate over two calls (a sum of two is either order)
        dram = j0.dram + job.dram
        rate = 1.0 / share if share > 1.0 else 1.0
        if dram > 0.0:
            rate = min(rate, max(0.0, 1.0 - self.ext) / dram)
        if not rate > 0.0:
            return None
        if j0.seq < job.seq:  # next_event's first smallest, in issue order
            rem = rem0 if not rem1 < rem0 else rem1
        else:
            rem = rem1 if not rem0 < rem1 else rem0
        te = t + (rem / rate if rem > 0.0 else 0.0)
        if not te < math.inf:
            return None
        dt = te - t
        if dt > 0.0:  # wake: _progress to te
            rem0 -= rate * dt
            rem1 -= rate * dt
            t = te
        if not rem0 <= DONE_EPS * j0.work or rem1 <= DONE_EPS * job.work:
            return None  # another outcome: submit_next and wake_next take it
        share1, dram1 = job.share, job.dram  # _rerate over the lone call
        rate1 = 1.0 / share1 if share1 > 1.0 else 1.0
        if dram1 > 0.0:
            rate1 = min(rate1, max(0.0, 1.0 - self.ext) / dram1)
        # -- the outcome is the common one: the state submit_next and wake_next leave
        j0.rem = rem0
        job.rem = rem1
        idle[i] = False
        job.worker = i
        job.start = t1
        active[0] = job
        j0.end = te
        w0 = j0.worker
        lane = lanes[w0]
        lane.busy += te - j0.start
        lane.free_at = te
        idle[w0] = True
        self.t = t
        self.rate = rate1
        self.version += 2
        if rate1 > 0.0:  # next_event over the lone call
            dep = t + (rem1 / rate1 if rem1 > 0.0 else 0.0)
            if dep < math.inf:
                return te, dep
        return te, math.inf

    def wake_next(self, t: float) -> tuple[list[CpuJob], float]:
        """:meth:`wake` then :meth:`next_event`, in one call (the same arithmetic), written
        out when no DRAM load is registered and nothing waits; else it calls the two."""
        if self._loads or self._queue:
            done = self.wake(t)
            return done, self.next_event()
        active = self.active
        dt = t - self.t
        if dt > 0.0:  # _progress
            r = self.rate
            for j in active:
                j.rem -= r * dt
            self.t = t
        done = []
        for j in active:
            if j.rem <= DONE_EPS * j.work:
                done.append(j)
        rate = self.rate
        if done:
            lanes, idle = self.lanes, self._idle
            for j in done:
                active.remove(j)
                j.end = t
                lane = lanes[j.worker]
                lane.busy += t - j.start
                lane.free_at = t
                idle[j.worker] = True
            n = len(active)  # _rerate (nothing waits, so _admit only re-rates)
            if n == 1:
                a = active[0]
                share, dram = a.share, a.dram
            elif n == 2:
                a, b = active
                share, dram = a.share + b.share, a.dram + b.dram
            else:
                share = sum(j.share for j in active)
                dram = sum(j.dram for j in active)
            rate = 1.0 / share if share > 1.0 else 1.0
            if dram > 0.0:
                rate = min(rate, max(0.0, 1.0 - self.ext) / dram)
            self.rate = rate
        self.version += 1
        if active and rate > 0.0:  # next_event without a DRAM load
            rem = active[0].rem
            for j in active:
                if j.rem < rem:
                    rem = j.rem
            dep = self.t + (rem / rate if rem > 0.0 else 0.0)
            if dep < math.inf:
                return done, dep
        return done, math.inf

    def load(self, start: float, end: float, share: float) -> None:
        """Unified memory: a copy takes ``share`` of the DRAM from ``start`` to ``end``."""
        if share <= 0.0 or end <= start:
            return
        if start < self.t:
            raise RuntimeError("shared CPU: a DRAM load was registered in its past")
        self._nload += 1
        heapq.heappush(self._loads, (start, self._nload, share))
        self._nload += 1
        heapq.heappush(self._loads, (end, self._nload, -share))
        self._advance(self.t)
        self._changed()

    def next_event(self) -> float:
        """When the next call ends or the rate changes (inf when nothing runs)."""
        active = self.active
        if not active:
            return math.inf
        nxt = self._loads[0][0] if self._loads else math.inf
        rate = self.rate
        if rate > 0.0:
            rem = active[0].rem
            for j in active:  # min(), without the generator: the first smallest
                if j.rem < rem:
                    rem = j.rem
            dep = self.t + (rem / rate if rem > 0.0 else 0.0)
            if dep < nxt:
                nxt = dep
        return nxt

    def wake(self, t: float) -> list[CpuJob]:
        """Advance to ``t``; returns the calls that end there (in issue order)."""
        if self._loads:
            self._advance(t)
        else:  # _advance with no DRAM load change to apply
            self._progress(t)
        active = self.active
        done = []  # (a loop: a comprehension's own frame costs more over one or two calls)
        for j in active:
            if j.rem <= DONE_EPS * j.work:
                done.append(j)
        if done:
            for j in done:
                active.remove(j)
                j.end = t
                lane = self.lanes[j.worker]
                lane.busy += t - j.start
                lane.free_at = t
                self._idle[j.worker] = True
            if self._queue:
                self._admit(t)  # re-rates
            else:  # _admit with nothing waiting: it only re-rates
                self._rerate()
        self.version += 1
        return done

    @property
    def idle(self) -> bool:
        """No call running or waiting and no DRAM load registered."""
        return not self.active and not self._queue and not self._loads

    def run_alone(self, t: float, job: CpuJob) -> float:
        """Run ``job``, submitted at ``t`` to an :attr:`idle` CPU, to its end with nothing else
        arriving meanwhile; returns its end.

        A shortcut for ``submit(t, job)`` followed by ``wake`` at each ``next_event()`` until
        the call returns, with the same arithmetic step by step (so the same end, to the last
        bit, and the same state afterwards): the engines use it when they know no other call
        or load can arrive before this one ends.
        """
        lanes = self.lanes
        if len(lanes) == 1:
            i = 0
        else:  # all idle: _admit's pick
            i = min(range(len(lanes)), key=lambda k: lanes[k].free_at)
        job.worker = i
        job.start = t
        if t > self.t:
            self.t = t
        self.rate = rate = self._lone_rate(job)
        while True:  # next_event() then wake(), until the call is done
            if rate <= 0.0:
                raise RuntimeError("shared CPU: a lone call can never progress")
            rem = job.rem
            end = self.t + (rem / rate if rem > 0.0 else 0.0)
            dt = end - self.t
            if dt > 0.0:
                job.rem -= rate * dt
                self.t = end
            if job.rem <= DONE_EPS * job.work:
                break
        job.end = end
        lane = lanes[i]
        lane.busy += end - t
        lane.free_at = end
        self.rate = 1.0  # _rerate over no call
        self.version += 2
        return end

    def run_queue(self, jobs: list[CpuJob]) -> None:
        """Run ``jobs`` (submitted at their ``submitted`` times, in issue order) on an
        :attr:`idle` one-worker CPU with nothing else arriving, first come first served;
        sets each job's ``start`` and ``end``.

        A shortcut for driving :meth:`submit` and :meth:`wake` in the order the engines'
        event queues call them (a wake-up before a submission at the same moment), with the
        same arithmetic step by step: an arrival progresses the running call to its time, so
        the running call's end is computed from there, exactly as ``next_event`` would.
        """
        assert len(self.lanes) == 1
        lane = self.lanes[0]
        t = self.t
        running: CpuJob | None = None
        rate = 1.0
        waiting: deque[CpuJob] = deque()
        i, n = 0, len(jobs)
        while True:
            nxt = math.inf  # next_event()
            if running is not None and rate > 0.0:
                rem = running.rem
                nxt = t + (rem / rate if rem > 0.0 else 0.0)
            if i < n and jobs[i].submitted < nxt:  # submit()
                job = jobs[i]
                i += 1
                dt = job.submitted - t
                if dt > 0.0:
                    if running is not None:
                        running.rem -= rate * dt
                    t = job.submitted
                if running is None:
                    running = job
                    job.worker, job.start = 0, t
                    rate = self._lone_rate(job)
                else:
                    waiting.append(job)
            elif nxt != math.inf:  # wake()
                assert running is not None
                dt = nxt - t
                if dt > 0.0:
                    running.rem -= rate * dt
                    t = nxt
                if running.rem <= DONE_EPS * running.work:
                    running.end = t
                    lane.busy += t - running.start
                    lane.free_at = t
                    running = waiting.popleft() if waiting else None
                    if running is not None:
                        running.worker, running.start = 0, t
                        rate = self._lone_rate(running)
            else:
                break
        self.t = t
        self.rate = 1.0  # _rerate over no call
        self.version += 2 * n

    def _lone_rate(self, job: CpuJob) -> float:
        """``_rerate`` with ``job`` the only running call (sum() of one term is exact)."""
        share, dram = job.share, job.dram
        rate = 1.0 / share if share > 1.0 else 1.0
        if dram > 0.0:
            rate = min(rate, max(0.0, 1.0 - self.ext) / dram)
        return rate

    def _idle_worker(self) -> int:
        """The idle worker free longest, the lowest index on ties; -1 if none is idle."""
        idle, lanes = self._idle, self.lanes
        if len(lanes) == 2:
            if idle[0]:
                return 1 if idle[1] and lanes[1].free_at < lanes[0].free_at else 0
            return 1 if idle[1] else -1
        if len(lanes) == 1:
            return 0 if idle[0] else -1
        i = -1
        best = 0.0
        for k, free in enumerate(idle):
            if free and (i < 0 or lanes[k].free_at < best):
                i, best = k, lanes[k].free_at
        return i

    def _start(self, job: CpuJob, t: float) -> None:
        """Start ``job`` at ``t`` on the idle worker free longest (the lowest index on ties)."""
        i = self._idle_worker()
        self._idle[i] = False
        job.worker = i
        job.start = t
        self.active.append(job)

    def _order_active(self) -> None:
        """The running calls in issue order (removals keep it; only admissions disturb it)."""
        active = self.active
        if len(active) == 2:  # sort() of two calls with distinct issue numbers
            if active[0].seq > active[1].seq:
                active.reverse()
        elif len(active) > 2:
            active.sort(key=_by_seq)

    def _admit(self, t: float) -> None:
        """Start waiting calls on idle workers (the one free longest first, lowest index)."""
        q = self._queue
        if q:
            idle = self._idle
            while q and True in idle:
                self._start(heapq.heappop(q)[2], t)
            self._order_active()
        # (without admissions the running calls keep their order: removals preserve it)
        self._rerate()

    def _advance(self, t: float) -> None:
        """Progress the running calls to ``t``, applying DRAM load changes on the way."""
        loads = self._loads
        while loads and loads[0][0] <= t:
            b, _, delta = heapq.heappop(loads)
            self._progress(b)
            self.ext += delta
            self._rerate()
        # the rate depends only on the running calls and the loads, and every change of
        # either re-rates at once, so it needs no update here
        self._progress(t)

    def _progress(self, t: float) -> None:
        dt = t - self.t
        if dt > 0.0:
            r = self.rate
            for j in self.active:
                j.rem -= r * dt
            self.t = t

    def _rerate(self) -> None:
        active = self.active
        rate = 1.0
        if len(active) == 1:  # sum() of one term, without the generator
            share, dram = active[0].share, active[0].dram
        elif len(active) == 2:  # sum() of two terms (0 + a + b), without the generator
            a, b = active
            share, dram = a.share + b.share, a.dram + b.dram
        else:
            share = sum(j.share for j in active)
            dram = sum(j.dram for j in active)
        if share > 1.0:
            rate = 1.0 / share
        if dram > 0.0:
            free = 1.0 - self.ext
            rate = min(rate, max(0.0, free) / dram)
        self.rate = rate

    def _changed(self) -> None:
        self.version += 1


@dataclass
class Link:
    """A transfer path between two memories: the lane it runs on and what a copy costs."""

    name: str
    lane: Lane
    #: seconds to move one expert's weights over this link
    expert_s: float
    #: seconds to move the activations of n tokens
    activation_s: Callable[[int], float]


class Machine:
    """The resources of one run, by name, and their (memoised) cost functions."""

    def __init__(
        self, costs: CostModel, spec: ResourceSpec, runtime: RuntimeProfile | None = None
    ) -> None:
        self.costs = costs
        self.spec = spec
        self.gpu = Lane("gpu")
        #: the runtime's host thread; None when it costs nothing (the engines then skip it)
        self.host = (
            HostThread(runtime, costs.model.experts - costs.model.top_k)
            if runtime is not None and not runtime.free
            else None
        )
        #: the host thread when GPU expert calls cost it something (per-expert kernels or syncs)
        self.host_experts = self.host if self.host is not None and self.host.per_expert else None
        pinned = spec.pinned
        act = _memo(costs.activation_copy_s)
        if costs.hw.link.copy_engines >= 2:
            h2d_lane, d2h_lane = Lane("h2d"), Lane("d2h")
        else:  # one copy engine: both directions share one FIFO lane
            h2d_lane = d2h_lane = Lane("copy")
        self.links: dict[str, Link] = {
            "h2d": Link("h2d", h2d_lane, costs.h2d_expert_s(pinned), act),
            "d2h": Link("d2h", d2h_lane, costs.d2h_expert_s(pinned), act),
        }
        #: HOBBIT's low-precision copies: seconds and bytes of one (0 without a low-bit dtype)
        low = spec.low_bit_dtype
        self.low_bit_s = costs.h2d_low_bit_expert_s(low, pinned) if low else 0.0
        self.low_bit_bytes = costs.low_bit_expert_bytes(low) if low else 0
        self.cpu = SharedCpu("cpu", spec.cpu_workers)
        self.pools: dict[str, SharedCpu] = {"cpu": self.cpu}
        self.buffers: dict[str, int] = {
            "temp": spec.temp_buffers,
            "staging": spec.staging_buffers,
        }
        #: a fused-MoE runtime: each GPU expert costs its roofline, the layer's call its
        #: launches once, with the first GPU expert the layer runs on a GPU (a layer whose
        #: experts all run on the CPU launches no fused call)
        self.fused_moe = runtime is not None and runtime.fused_moe
        self.gpu_s = _memo(costs.fused_gpu_expert_s if self.fused_moe else costs.gpu_expert_s)
        #: the fused MoE call's launches of one layer (0 on other runtimes), added to the
        #: first GPU expert call of the layer on each GPU stream
        self.fused_launch_s = costs.fused_moe_layer_s() if self.fused_moe else 0.0
        self.cpu_s = _memo(costs.cpu_expert_s)
        self._cpu_share = _memo(costs.cpu_share)
        self._cpu_dram = _memo(costs.cpu_dram_share)
        #: unified memory: copies register their DRAM share with the CPU
        self.unified = costs.unified_memory
        self._gpu_dram = _memo(costs.gpu_dram_share)
        self._ne_dram: dict[tuple[int, int], float] = {}
        self._ne: dict[tuple[int, int], float] = {}
        #: a runtime with eager attention writes every head's scores to device memory: the
        #: non-expert part pays that traffic (costs.nonexpert_layer_s)
        self.eager_attention = runtime is not None and runtime.attention == "eager"
        #: NVMe drives of the SSD tier, one lane each (``ssd``); registered by
        #: :class:`simulator.hosttier.HostTier` when some experts live on a drive
        self.drives: dict[str, Lane] = {}
        #: CPU-resident layers (ResourceSpec.gpu_blocks): the non-expert part on the host CPU
        self._cpu_ne: dict[tuple[int, int], float] = {}
        #: ... and the copy of one such layer's non-expert weights (prompt op offload)
        self.cpu_layer_weights_s = costs.cpu_layer_weights_h2d_s()
        #: ZeRO-3's streamed non-expert weights (ResourceSpec.nonexpert_streamed): (bytes,
        #: seconds) of one layer's copy and of the input embedding's (the output matrix is
        #: taken to be its size); None when the weights stay on the GPU
        self.streamed: tuple[tuple[int, float], tuple[int, float]] | None = None
        if spec.nonexpert_streamed:
            keep = spec.nonexpert_persist_numel
            lb = costs.streamed_layer_weight_bytes(keep)
            eb = costs.streamed_embedding_bytes(keep)
            self.streamed = (
                (lb, costs.weights_h2d_s(lb, pinned)),
                (eb, costs.weights_h2d_s(eb, pinned)),
            )

    def cpu_job(self, op: Any, seq: int, t: float, n: int) -> CpuJob:
        """A CPU expert call over ``n`` tokens submitted at ``t``, with its costs bound."""
        return CpuJob(op, seq, t, self.cpu_s(n), self._cpu_share(n), self._cpu_dram(n))

    def copy_load(self, start: float, end: float, nbytes: int) -> None:
        """Unified memory: a copy of ``nbytes`` from ``start`` to ``end`` loads the DRAM."""
        self.cpu.load(start, end, self.costs.copy_dram_share(nbytes, end - start))

    def gpu_load(self, start: float, end: float, n: int, context: int | None = None) -> None:
        """Unified memory: a GPU kernel (an expert over ``n`` tokens, or with ``context`` a
        layer's non-expert part) takes its share of the DRAM from ``start`` to ``end``."""
        if context is None:
            share = self._gpu_dram(n)
        else:
            key = (n, context)
            share = self._ne_dram.get(key, -1.0)
            if share < 0:
                share = self._ne_dram[key] = self.costs.gpu_dram_share(n, context)
        self.cpu.load(start, end, share)

    def nonexpert_s(self, n: int, context: int) -> float:
        """Non-expert GPU time of one layer for ``n`` tokens at ``context`` (memoised)."""
        key = (n, context)
        t = self._ne.get(key)
        if t is None:
            t = self._ne[key] = self.costs.nonexpert_layer_s(
                n, context, eager_attention=self.eager_attention
            )
        return t

    def cpu_layer_nonexpert_s(self, n: int, context: int) -> float:
        """Host-CPU time of a CPU-resident layer's non-expert part (memoised)."""
        key = (n, context)
        t = self._cpu_ne.get(key)
        if t is None:
            t = self._cpu_ne[key] = self.costs.cpu_nonexpert_layer_s(n, context)
        return t

    def lanes(self) -> dict[str, Lane]:
        """Every distinct lane by name (a shared copy lane appears once)."""
        out: dict[str, Lane] = {"gpu": self.gpu}
        for link in self.links.values():
            out[link.lane.name] = link.lane
        for pool in self.pools.values():
            for lane in pool.lanes:
                out[lane.name] = lane
        out.update(self.drives)
        return out

    def busy(self) -> dict[str, float]:
        """Busy seconds per named resource: ``gpu``, each link, each pool (summed workers)."""
        out = {"gpu": self.gpu.busy}
        for name, link in self.links.items():
            out[name] = link.lane.busy
        for name, pool in self.pools.items():
            out[name] = pool.busy
        return out

    def workers(self) -> dict[str, int]:
        """Workers per pool."""
        return {name: len(pool.lanes) for name, pool in self.pools.items()}


def _memo(fn: Callable[[int], float]) -> Callable[[int], float]:
    """``fn`` memoised on its integer argument (a dict lookup on the hot path)."""
    cache: dict[int, float] = {}

    def get(n: int) -> float:
        t = cache.get(n)
        if t is None:
            t = cache[n] = fn(n)
        return t

    return get
