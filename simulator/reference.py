"""The reference engine: the same plans timed by plain SimPy processes and resources.

It shares everything but the timing with the fast engine (step loop, hooks, plan checks,
residency, counters; :class:`~simulator.engine.EngineBase`) and implements the queueing rule
of docs/policy-api.md literally: every serial resource is a ``simpy.PriorityResource`` whose
requests carry the key (submission time, issue number), every operation is a process that
requests a resource at the moment its inputs are ready, slots are a ``simpy.Container`` and
temporary buffers a ``simpy.Store``. It is slow (several events per operation) and exists to
check the fast engine: tests/test_reference_engine.py asserts both give identical timelines.
Select it with ``simulate(engine="reference")`` or ``daopsim run --engine reference``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from typing import Any

import simpy

from simulator.engine import (
    CPU,
    FETCH,
    TEMP,
    WRITEBACK,
    EngineBase,
    LayerOp,
    LayerWork,
    RunStats,
)
from simulator.machine import Lane
from simulator.trace import SequenceRouting

Proc = Generator[simpy.Event, Any, Any]


class ReferenceEngine(EngineBase):
    """Times each layer's operations as SimPy processes (slow; for checking the fast engine)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        env = self.env = simpy.Environment()
        m = self.machine
        # one PriorityResource per distinct lane (a shared copy lane is one resource)
        self._res: dict[str, simpy.PriorityResource] = {
            name: simpy.PriorityResource(env, capacity=1) for name in m.lanes()
        }
        self._h2d = m.links["h2d"]
        self._d2h = m.links["d2h"]
        pool = m.pools["cpu"]
        self._pool = pool
        self._pool_res = simpy.PriorityResource(env, capacity=len(pool.lanes))
        self._idle = [True] * len(pool.lanes)
        res = self.res
        # SimPy refuses an empty container; with no slot at all nothing is ever fetched
        self._slots = simpy.Container(env, capacity=max(1, res.cap), init=res.cap - res.occupancy)
        self._buffers = simpy.Store(env)
        for i in range(m.buffers["temp"]):
            self._buffers.put(i)
        self._done: dict[LayerOp, simpy.Event] = {}

    def run(
        self, sequences: Iterable[SequenceRouting], on_sequence: Callable[[Any], None] | None = None
    ) -> RunStats:
        """Simulate the sequences back to back; returns the run's statistics."""
        env = self.env
        proc = env.process(self._main(self.steps(sequences, on_sequence)))
        env.run(until=proc)
        e2e = self.now
        env.run()  # background work still running when the last token is out
        return self.stats(e2e)

    def _main(self, gen: Generator[Any, float | None, None]) -> Proc:
        env = self.env
        try:
            item = next(gen)
            while True:
                if item.__class__ is float:
                    if item > env.now:
                        yield env.timeout(item - env.now)
                    item = gen.send(None)
                else:
                    end = yield from self._layer(item)
                    item = gen.send(end)
        except StopIteration:
            return

    # -- helpers ---------------------------------------------------------------------------
    def _event(self, op: LayerOp) -> simpy.Event:
        ev = self._done.get(op)
        if ev is None:
            ev = self._done[op] = self.env.event()
        return ev

    def _finish(self, op: LayerOp, end: float) -> None:
        op.end = end
        self._event(op).succeed()
        del self._done[op]

    def _hold(self, lane: Lane, key: tuple[float, int], dur: float) -> Proc:
        """Request ``lane`` with ``key``, hold it for ``dur``; returns (start, end)."""
        env = self.env
        with self._res[lane.name].request(priority=key) as req:
            yield req
            start = env.now
            yield env.timeout(dur)
        lane.busy += dur
        lane.free_at = env.now
        return start, env.now

    def _record(self, lane: str, op: LayerOp, kind: str, s: float, e: float, nbytes: int) -> None:
        if self.recorder is not None:
            self.recorder.op(lane, kind, op.sid, op.token, op.layer, op.expert, s, e, nbytes)

    def _free_slot(self, t: float) -> None:
        self._slot_back()

    def _slot_back(self) -> None:
        """Give a slot back: to the first waiting fetch, else to the free pool."""
        if not self._slots.get_queue:
            self.res.free(self.env.now)
        self._slots.put(1)

    # -- operations ------------------------------------------------------------------------
    def _write_back(self, op: LayerOp) -> Proc:
        """Issued on the loads' stream: holds the H2D and D2H lanes together."""
        env = self.env
        key = (env.now, op.seq)
        h2d, d2h = self._h2d.lane, self._d2h.lane
        dur = self._d2h.expert_s
        reqs = [self._res[h2d.name].request(priority=key)]
        if d2h is not h2d:
            reqs.append(self._res[d2h.name].request(priority=key))
        yield simpy.AllOf(env, reqs)
        s = env.now
        yield env.timeout(dur)
        for lane, req in zip((h2d, d2h), reqs, strict=False):
            self._res[lane.name].release(req)
        d2h.busy += dur
        h2d.free_at = d2h.free_at = env.now
        self._record(d2h.name, op, "writeback", s, env.now, self.expert_bytes)
        op.end = env.now
        self._slot_back()

    def _copy_in(self, op: LayerOp) -> Proc:
        env = self.env
        # no yield between submission and request when nothing blocks: requests made at the
        # same moment reach a resource in issue order (the tie-break of the rule)
        get = self._slots.get(1)
        if get.triggered:
            self.res.take(env.now)
        else:
            yield get
        link = self._h2d
        with self._res[link.lane.name].request(priority=(env.now, op.seq)) as req:
            yield req
            s = env.now
            self.res.copied((op.layer, op.expert), s + link.expert_s)
            yield env.timeout(link.expert_s)
        link.lane.busy += link.expert_s
        self._record(link.lane.name, op, op.rkind, s, env.now, self.expert_bytes)
        self._finish(op, env.now)

    def _temp_in(self, op: LayerOp) -> Proc:
        env = self.env
        get = self._buffers.get()
        if not get.triggered:
            yield get
        op.buf = get.value
        link = self._h2d
        s, e = yield from self._hold(link.lane, (env.now, op.seq), link.expert_s)
        self._record(link.lane.name, op, "temp", s, e, self.expert_bytes)
        self._finish(op, e)

    def _cpu_chain(self, op: LayerOp | None) -> Proc:
        """CPU jobs one after another: activations to the host, a worker, results back."""
        env = self.env
        while op is not None:
            n = op.n
            d2h, h2d = self._d2h, self._h2d
            s, e = yield from self._hold(d2h.lane, (env.now, op.seq), d2h.activation_s(n))
            self._record(d2h.lane.name, op, "activation", s, e, self.act_bytes * n)
            with self._pool_res.request(priority=(env.now, op.seq)) as req:
                yield req
                # the idle worker that became free first (lowest index on ties)
                lanes = self._pool.lanes
                idle = [i for i in range(len(lanes)) if self._idle[i]]
                i = min(idle, key=lambda j: (lanes[j].free_at, j))
                self._idle[i] = False
                s = env.now
                dur = self.machine.cpu_s(n)
                yield env.timeout(dur)
                lanes[i].busy += dur
                lanes[i].free_at = env.now
                self._idle[i] = True
            self._record(lanes[i].name, op, op.rkind, s, env.now, 0)
            s, e = yield from self._hold(h2d.lane, (env.now, op.seq), h2d.activation_s(n))
            self._record(h2d.lane.name, op, "activation", s, e, self.act_bytes * n)
            self._finish(op, e)
            op = op.chain

    # -- one layer -------------------------------------------------------------------------
    def _layer(self, w: LayerWork) -> Proc:
        env = self.env
        c = self.c
        now = w.now
        for op in w.ops:
            self._event(op)  # GPU computations may wait on it before it starts
            if op.kind == FETCH:
                env.process(self._copy_in(op))
            elif op.kind == TEMP:
                env.process(self._temp_in(op))
            elif op.kind == CPU:
                env.process(self._cpu_chain(op))
            elif op.kind == WRITEBACK:
                env.process(self._write_back(op))
        for op in w.results:
            if op.end is None:
                self._event(op)
        state = {"g": now, "busy": 0.0}
        gate = None
        if w.cpu_first and w.sync:
            gate = env.all_of([self._event(op) for op in w.sync if op.end is None])
        # resident experts first, by (ready time, expert); copies join when they arrive
        known: list[tuple[float, int, LayerOp | None]] = []
        waiting: list[tuple[int, LayerOp]] = []
        for e, src in w.gpu:
            if src.__class__ is float:
                known.append((src, e, None))
            elif src.end is not None:
                known.append((src.end, e, src))
            else:
                waiting.append((e, src))
        known.sort(key=lambda x: (x[0], x[1]))
        procs = [env.process(self._gpu(w, e, r, src, gate, state)) for r, e, src in known]
        procs += [env.process(self._gpu(w, e, None, src, gate, state)) for e, src in waiting]
        if gate is not None:
            yield gate
            sync_end = max(op.end for op in w.sync)  # type: ignore[type-var]
            if sync_end > now:
                c.cpu_wait += sync_end - now
                state["g"] = sync_end
        yield env.all_of(procs)
        g = state["g"]
        pending = [self._event(op) for op in w.results if op.end is None]
        if pending:
            yield env.all_of(pending)
        end = g
        for op in w.results:
            assert op.end is not None
            if op.end > end:
                end = op.end
        if end > g:
            c.cpu_wait += end - g
        c.gpu_expert_busy += state["busy"]
        self.machine.gpu.busy += state["busy"]
        return end

    def _gpu(
        self,
        w: LayerWork,
        e: int,
        ready: float | None,
        src: LayerOp | None,
        gate: simpy.Event | None,
        state: dict[str, float],
    ) -> Proc:
        """One expert on the GPU stream, requested when its weights are there."""
        env = self.env
        if ready is None:
            assert src is not None
            if src.end is None:
                yield self._event(src)
            ready = src.end
        assert ready is not None
        if gate is not None and not gate.processed:
            yield gate
        if ready > env.now:
            yield env.timeout(ready - env.now)
        with self._res["gpu"].request(priority=(ready, e)) as req:
            yield req
            s = env.now
            g = state["g"]
            if s > g:
                self.c.transfer_stall += s - g
            d = self.machine.gpu_s(int(w.counts[e]) if w.counts is not None else 1)
            yield env.timeout(d)
            state["g"] = env.now
            state["busy"] += d
        if self.recorder is not None:
            self.recorder.op("gpu", "expert", w.sid, w.token, w.layer, e, s, env.now, 0)
        wb = w.deferred.pop(e, None)
        if wb is not None:  # evicted while in use: written back after its compute
            env.process(self._write_back(wb))
        if src is not None and src.kind == TEMP:
            self._buffers.put(src.buf)
