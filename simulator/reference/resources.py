"""The reference engine's resources, written as SimPy objects of its own.

Nothing here comes from the fast engine: a serial resource is :class:`Lane`, counted GPU
memory is :class:`Pool`, the host CPU is :class:`HostCpu` (worker threads sharing one socket
by processor sharing, and on unified memory the DRAM), and the runtime's host thread is
:class:`IssueThread`. They implement the rules of docs/policy-api.md ("Timing rules") and
docs/cost-model.md ("Shared host CPU", "Unified memory", "Runtime profiles") literally.

The queueing rule says a serial resource serves the requests submitted to it by (submission
time, issue number). SimPy processes the events of one instant in the order they were
scheduled, which is not issue order, so a :class:`Lane` never grants at once: it grants at the
*end of the instant*, once every other event of that moment has happened, to the smallest key
waiting. An event of priority :data:`LATE` (after SimPy's URGENT and NORMAL) marks that
moment.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Generator
from typing import Any

import simpy
from simpy.events import NORMAL, URGENT

from daopsim.simulator.runtime_profiles import RuntimeProfile

#: SimPy event priority processed after every URGENT and NORMAL event of the same instant
LATE = 2
#: a CPU call is done once its remaining work is below this share of its work: the rounding of
#: its piecewise progress, far below any duration the model resolves
DONE_SHARE = 1e-9

Proc = Generator[simpy.Event, Any, Any]
Key = tuple[float, float]

_uid = itertools.count()


class _Marker(simpy.events.Event):
    """An event that is already triggered, processed ``delay`` from now at ``priority``."""

    def __init__(self, env: simpy.Environment, priority: int, delay: float = 0.0) -> None:
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, priority, delay)  # type: ignore[arg-type]


class Clock(simpy.Environment):
    """A SimPy environment that can also wake a process at an absolute time (``at``), so a
    time computed elsewhere is reached exactly rather than as ``now + (t - now)``."""

    def at(self, t: float) -> simpy.Event:
        """An event processed at time ``t`` (now if ``t`` has passed)."""
        ev = simpy.Event(self)
        ev._ok = True
        ev._value = None
        heapq.heappush(self._queue, (max(t, self._now), NORMAL, next(self._eid), ev))  # type: ignore[attr-defined]
        return ev


def at_instant_end(env: simpy.Environment, fn: Callable[[simpy.Event], None]) -> None:
    """Call ``fn`` once everything else of the current instant has happened."""
    _Marker(env, LATE).callbacks.append(fn)  # type: ignore[union-attr]


def urgently(env: simpy.Environment, delay: float, fn: Callable[[simpy.Event], None]) -> None:
    """Call ``fn`` ``delay`` from now, before the ordinary events of that instant."""
    _Marker(env, URGENT, delay).callbacks.append(fn)  # type: ignore[union-attr]


class Lane:
    """A serial resource: one request at a time, the smallest key first (end of instant)."""

    def __init__(self, env: simpy.Environment, name: str) -> None:
        self.env = env
        self.name = name
        #: seconds it held a timed transfer or kernel (what ``RunStats.busy`` reports)
        self.busy = 0.0
        #: when its last hold ended (the work after the run's end: ``RunStats.after``)
        self.free_at = 0.0
        self._waiting: list[tuple[Any, int, simpy.Event, float]] = []
        self._held = False
        self._armed = False
        #: when the current hold ends, as its request said (``drain_at``)
        self._hold_end = 0.0

    def request(self, key: Any, seconds: float = 0.0) -> simpy.Event:
        """An event that fires when this request holds the lane; ``seconds``, how long it
        will hold it, is read only by :meth:`drain_at` (0: not known)."""
        ev = self.env.event()
        heapq.heappush(self._waiting, (key, next(_uid), ev, seconds))
        self._arm()
        return ev

    def drain_at(self) -> float:
        """When the lane ends the requests it holds and queues now (``View.copy_free``): the
        current hold's end, then each waiting request in grant order for the seconds it gave,
        one after another. A request that holds several lanes at once (a write-back) is taken
        to start when this lane reaches it, and a hold of unknown length (a one-stream
        kernel's) as 0 s; the policies that read it queue neither."""
        t = self.env.now
        if self._held and self._hold_end > t:
            t = self._hold_end
        for *_, seconds in sorted(self._waiting, key=lambda w: (w[0], w[1])):
            t += seconds
        return t

    def release(self) -> None:
        """The holder is done."""
        self._held = False
        self.free_at = self.env.now
        self._arm()

    def _arm(self) -> None:
        if not self._held and not self._armed and self._waiting:
            self._armed = True
            at_instant_end(self.env, self._grant)

    def _grant(self, _: simpy.Event) -> None:
        self._armed = False
        if self._held or not self._waiting:
            return
        _key, _uid, ev, seconds = heapq.heappop(self._waiting)
        self._held = True
        self._hold_end = self.env.now + seconds
        ev.succeed()


class Engine:
    """One copy engine of an :class:`Engines` group: its name, busy seconds, last release."""

    __slots__ = ("busy", "free_at", "held", "hold_end", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy = 0.0
        self.free_at = 0.0
        self.held = False
        #: when the current hold ends, as its request said (``drain_times``)
        self.hold_end = 0.0


class Engines:
    """A copy direction's ``n`` engines serving one queue: a request is granted (end of
    instant, smallest key first) an idle engine, the one that became free first (the lowest
    index on ties); the grant's value is that :class:`Engine`. Engines are named ``name``,
    ``name.1``, ``name.2`` ..."""

    def __init__(self, env: simpy.Environment, name: str, n: int = 1) -> None:
        self.env = env
        self.name = name
        self.engines = [Engine(name if i == 0 else f"{name}.{i}") for i in range(n)]
        self._waiting: list[tuple[Any, int, simpy.Event, float]] = []
        self._armed = False

    @property
    def busy(self) -> float:
        """Seconds the engines held timed copies, summed in engine order."""
        return sum(e.busy for e in self.engines)

    def request(self, key: Any, seconds: float = 0.0) -> simpy.Event:
        """An event that fires, with the engine, when this request holds one; ``seconds``,
        how long it will hold it, is read only by :meth:`drain_times` (0: not known)."""
        ev = self.env.event()
        heapq.heappush(self._waiting, (key, next(_uid), ev, seconds))
        self._arm()
        return ev

    def drain_times(self) -> list[float]:
        """When each engine ends the requests held and queued now (``View.copy_free``): a held
        engine at its hold's end, an idle one at its last release; then each waiting request
        in grant order goes to the engine free first, from now, for the seconds it gave. A
        request that holds several groups at once (a write-back) is taken to start when this
        group reaches it, and a hold of unknown length (a one-stream kernel's) as 0 s; the
        policies that read it queue neither."""
        now = self.env.now
        times = [e.hold_end if e.held and e.hold_end > now else e.free_at for e in self.engines]
        for *_, seconds in sorted(self._waiting, key=lambda w: (w[0], w[1])):
            i = min(range(len(times)), key=lambda j: times[j])
            times[i] = (times[i] if times[i] > now else now) + seconds
        return times

    def release(self, engine: Engine) -> None:
        """``engine``'s holder is done."""
        engine.held = False
        engine.free_at = self.env.now
        self._arm()

    def _idle(self) -> Engine | None:
        best: Engine | None = None
        for e in self.engines:
            if not e.held and (best is None or e.free_at < best.free_at):
                best = e
        return best

    def _arm(self) -> None:
        if not self._armed and self._waiting and self._idle() is not None:
            self._armed = True
            at_instant_end(self.env, self._grant)

    def _grant(self, _: simpy.Event) -> None:
        self._armed = False
        while self._waiting:
            engine = self._idle()
            if engine is None:
                return
            _, _, ev, seconds = heapq.heappop(self._waiting)
            engine.held = True
            engine.hold_end = self.env.now + seconds
            ev.succeed(engine)


def hold(
    env: simpy.Environment, lanes: list[Lane], key: Any, seconds: float
) -> Generator[simpy.Event, Any, float]:
    """Take every lane of ``lanes`` (requested together with ``key``), keep them ``seconds``,
    give them back; returns when the hold started."""
    grants = [lane.request(key, seconds) for lane in lanes]
    yield grants[0] if len(grants) == 1 else env.all_of(grants)
    start = env.now
    yield env.timeout(seconds)
    for lane in lanes:
        lane.release()
    return start


class Pool:
    """Counted GPU memory (expert slots, temporary buffers): a request takes one unit when one
    is free and nobody with a smaller key waits, else it waits; a unit given back goes to the
    waiting request with the smallest key (first come, first served), else back to the pool.
    ``on_change(t, delta)`` hears every unit taken (+1) or freed (-1) at time ``t``."""

    def __init__(
        self,
        env: simpy.Environment,
        units: int,
        taken: int = 0,
        on_change: Callable[[float, int], None] | None = None,
    ) -> None:
        self.env = env
        self.units = units
        self.taken = taken
        self.on_change = on_change
        self._waiting: list[tuple[Any, int, simpy.Event]] = []

    def take(self, key: Any) -> simpy.Event:
        """An event that fires when the request holds a unit."""
        ev = self.env.event()
        if self.taken < self.units and not self._waiting:
            self.taken += 1
            if self.on_change is not None:
                self.on_change(self.env.now, 1)
            ev.succeed()
        else:
            heapq.heappush(self._waiting, (key, next(_uid), ev))
        return ev

    def give_back(self) -> None:
        """A unit is free again: handed to the first waiting request, else to the pool."""
        if self._waiting:
            _, _, ev = heapq.heappop(self._waiting)
            ev.succeed()  # handed over: the number taken does not change
            return
        self.taken -= 1
        if self.on_change is not None:
            self.on_change(self.env.now, -1)


class CpuCall:
    """One expert call on the host CPU: its work (seconds alone), its shares, its outcome."""

    __slots__ = ("done", "dram", "end", "key", "left", "share", "start", "work", "worker")

    def __init__(self, key: Key, work: float, share: float, dram: float, done: simpy.Event):
        self.key = key
        self.work = work
        self.left = work
        self.share = share
        self.dram = dram
        self.done = done
        self.worker = -1
        self.start = math.nan
        self.end = math.nan


class HostCpu:
    """The host CPU: ``workers`` threads whose running calls share one socket.

    At most one call per worker runs; waiting calls start by key (submission time, issue
    number) on the idle worker that became free first (the lowest index on ties). The running
    calls progress together at ``rate = min(1, 1 / sum(share))`` of their alone speed and, on
    unified memory, at most ``(1 - load) / sum(dram share)``, where ``load`` is the DRAM share
    copies and GPU kernels take at the moment. Each change (a call starts or ends, a load
    starts or ends) brings every running call up to date and re-times the next completion: an
    URGENT wake-up, so a call ending at some moment ends before what is submitted then; a
    wake-up made stale by a later change is ignored.
    """

    def __init__(self, env: simpy.Environment, workers: int) -> None:
        self.env = env
        n = max(1, workers)
        self.names = [f"cpu{i}" for i in range(n)]
        self.free_at = [0.0] * n
        self.busy = [0.0] * n
        self.idle = [True] * n
        self.running: list[CpuCall] = []
        self._waiting: list[tuple[Key, int, CpuCall]] = []
        self._admitting = False
        self.load = 0.0
        self.rate = 1.0
        self.clock = 0.0
        self._wake = 0

    def call(self, key: Key, work: float, share: float, dram: float) -> Proc:
        """Run one call submitted now (a process body); returns the finished :class:`CpuCall`."""
        c = CpuCall(key, work, share, dram, self.env.event())
        heapq.heappush(self._waiting, (key, next(_uid), c))
        if not self._admitting:
            self._admitting = True
            at_instant_end(self.env, self._admit)
        yield c.done
        return c

    def take_dram(self, start: float, seconds: float, share: float) -> None:
        """Unified memory: something else streams ``share`` of the DRAM from ``start`` (now or
        later) for ``seconds``."""
        if share <= 0.0 or seconds <= 0.0:
            return
        env = self.env

        def begin(_: simpy.Event) -> None:
            self._change(share)
            urgently(env, seconds, lambda _e: self._change(-share))

        if start > env.now:
            urgently(env, start - env.now, begin)
        else:
            begin(None)  # type: ignore[arg-type]

    def occupy_first(self, start: float, seconds: float) -> None:
        """A CPU-resident layer's non-expert part on the first worker (nothing else runs on the
        CPU then: docs/cost-model.md, "CPU-resident layers")."""
        self.busy[0] += seconds
        self.free_at[0] = start + seconds

    # -- processor sharing ------------------------------------------------------------------
    def _change(self, load_delta: float) -> None:
        self._catch_up()
        self.load += load_delta
        self._retime()

    def _catch_up(self) -> None:
        """Every running call progresses from the last change to now at the current rate."""
        now = self.env.now
        dt = now - self.clock
        if dt > 0.0:
            for c in self.running:
                c.left -= self.rate * dt
            self.clock = now

    def _retime(self) -> None:
        share = 0.0
        dram = 0.0
        for c in self.running:  # in issue order
            share += c.share
            dram += c.dram
        rate = 1.0 / share if share > 1.0 else 1.0
        if dram > 0.0:
            rate = min(rate, max(0.0, 1.0 - self.load) / dram)
        self.rate = rate
        self._wake += 1
        if not self.running or rate <= 0.0:
            return  # nothing runs, or nothing can progress until a load ends
        left = min(c.left for c in self.running)
        wake = self._wake
        now = self.env.now
        delay = max(0.0, left) / rate
        if left > 0.0 and now + delay <= now:
            # below the clock's resolution at now: the next representable time (else the
            # wake-up lands at now, nothing progresses, and it repeats forever)
            delay = math.nextafter(now, math.inf) - now
        urgently(self.env, delay, lambda _e: self._finish(wake))

    def _finish(self, wake: int) -> None:
        if wake != self._wake:
            return  # re-timed since
        self._catch_up()
        now = self.env.now
        for c in [c for c in self.running if c.left <= DONE_SHARE * c.work]:
            self.running.remove(c)
            c.end = now
            self.busy[c.worker] += now - c.start
            self.free_at[c.worker] = now
            self.idle[c.worker] = True
            c.done.succeed(c)
        if self._waiting and not self._admitting:
            self._admitting = True
            at_instant_end(self.env, self._admit)
        self._retime()

    def _admit(self, _: simpy.Event) -> None:
        self._admitting = False
        started = False
        while self._waiting and True in self.idle:
            _, _, c = heapq.heappop(self._waiting)
            w = min(
                (i for i, free in enumerate(self.idle) if free),
                key=lambda i: (self.free_at[i], i),
            )
            if not started:
                self._catch_up()
                started = True
            self.idle[w] = False
            c.worker = w
            c.start = self.env.now
            self.running.append(c)
        if started:
            self.running.sort(key=lambda c: c.key[1])  # issue order
            self._retime()


class IssueThread:
    """The runtime's host thread (docs/cost-model.md, "The host thread"): one clock, ``h``,
    when it is free to issue the next kernel. It issues kernels one after another,
    ``dispatch`` seconds each, onto a stream that runs them in order, and blocks at a sync
    until the stream has drained."""

    def __init__(self, profile: RuntimeProfile, idle_experts: int) -> None:
        us = 1e-6
        self.dispatch = profile.dispatch_us * us
        self.sync = profile.sync_us * us
        self.step = profile.step_us * us
        self.p = profile
        self.idle_experts = idle_experts
        self.h = 0.0
        self.syncs = 0

    def _block(self, drained: float, n: int, extra: float = 0.0) -> None:
        """``n`` syncs: the thread waits for the stream to drain at ``drained``, pays them."""
        self.h = max(self.h, drained) + n * self.sync + extra
        self.syncs += n

    def kernels(self, stream_free: float, gpu_s: float, k: int) -> float:
        """Issue ``k`` kernels sharing ``gpu_s`` of GPU time onto a stream free from
        ``stream_free``; returns when the last one ends."""
        if k == 0:
            return stream_free + gpu_s
        each = gpu_s / k
        h = self.h
        # kernel i is issued at h + i * dispatch and the stream runs them back to back, so the
        # last ends when the latest of "issued, then it and every later one run" does
        end = stream_free + gpu_s
        for i in range(1, k + 1):
            end = max(end, h + i * self.dispatch + (k - i + 1) * each)
        self.h = h + k * self.dispatch
        return end

    def nonexpert(self, stream_free: float, gpu_s: float, first: bool) -> tuple[float, float]:
        """A layer's non-expert part and router: (its GPU end, the decision time). The first
        layer of a forward pass waits for the previous pass's token (one sync and the step)."""
        p = self.p
        if first:
            self._block(stream_free, 1, self.step)
        end = self.kernels(stream_free, gpu_s, p.nonexpert_kernels)
        routing = end
        if p.routing_syncs:
            self._block(end, p.routing_syncs)
            routing = self.h
        idle = self.idle_experts
        loop = idle * (p.idle_expert_kernels * self.dispatch + p.idle_expert_syncs * self.sync)
        if loop > 0.0:
            # the MoE loop's passes over experts no token chose: ops and syncs, no GPU work;
            # with syncs among them the first waits for the routing
            if p.idle_expert_syncs:
                self.h = max(self.h, routing)
                self.syncs += idle * p.idle_expert_syncs
            self.h += loop
            routing = max(self.h, routing)
        return end, routing

    def expert(self, drained: float, start: float, gpu_s: float) -> float:
        """A GPU expert call the stream could start at ``start`` (its earlier work done at
        ``drained``): its syncs, then its kernels; returns when it ends."""
        p = self.p
        if p.expert_syncs:
            self._block(drained, p.expert_syncs)
        return self.kernels(start, gpu_s, p.expert_kernels)


__all__ = [
    "LATE",
    "NORMAL",
    "CpuCall",
    "HostCpu",
    "IssueThread",
    "Lane",
    "Pool",
    "at_instant_end",
    "hold",
    "urgently",
]
