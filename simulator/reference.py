"""The reference engine: the same plans timed by plain SimPy processes and resources.

It shares everything but the timing with the fast engine (step loop, hooks, plan checks,
residency, counters; :class:`~simulator.engine.EngineBase`) and implements the queueing rule
of docs/policy-api.md literally: every serial resource is a ``simpy.PriorityResource`` whose
requests carry the key (submission time, issue number), every operation is a process that
requests a resource at the moment its inputs are ready, slots are a ``simpy.Container`` and
temporary buffers a ``simpy.Store``. The shared host CPU (processor sharing: a running call's
end moves when another starts) is one SimPy process per call waiting on its own event, and
the CPU's next event is an urgent timeout re-armed on every change (stale ones are ignored),
so it comes before requests submitted at the same moment. It is slow (several events per
operation) and exists to check the fast engine: tests/test_reference_engine.py asserts both
give identical timelines. Select it with ``simulate(engine="reference")`` or
``daopsim run --engine reference``. With an SSD tier (simulator/hosttier.py) the drive is one
more ``PriorityResource``: each drive read is a process requesting it at its decision, and the
operation that needs the weights waits for that process (``_ssd_*``).
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
    WeightCopy,
)
from simulator.machine import Lane, SharedCpu
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
        self._host: SharedCpu = m.cpu
        self._unified = m.unified
        self._cpu_done: dict[int, simpy.Event] = {}
        res = self.res
        # SimPy refuses an empty container; with no slot at all nothing is ever fetched
        self._slots = simpy.Container(env, capacity=max(1, res.cap), init=res.cap - res.occupancy)
        self._buffers = simpy.Store(env)
        for i in range(m.buffers["temp"]):
            self._buffers.put(i)
        self._done: dict[LayerOp, simpy.Event] = {}
        #: the SSD tier: the drive read each operation issued, and the latest read that put
        #: each expert in host memory (operations finding it there wait for that one)
        self._ssd_reads: dict[LayerOp, simpy.Event] = {}
        self._ssd_landing: dict[tuple[int, int], simpy.Event] = {}
        if self._ssd is not None:
            self._ssd.record_reads = False  # timed and recorded here, as SimPy processes

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
                elif item.__class__ is WeightCopy:
                    end = yield from self._weights_copy(item)
                    item = gen.send(end)
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

    def _hold(self, lane: Lane, key: tuple[float, int], dur: float, nbytes: int) -> Proc:
        """Request ``lane`` with ``key``, hold it for a copy of ``nbytes`` taking ``dur``;
        returns (start, end)."""
        env = self.env
        with self._res[lane.name].request(priority=key) as req:
            yield req
            start = env.now
            self._mem(start, dur, nbytes)
            yield env.timeout(dur)
        lane.busy += dur
        lane.free_at = env.now
        return start, env.now

    def _weights_copy(self, op: WeightCopy) -> Proc:
        """A streamed weight copy (``EngineBase._weights_in``): requests the host-to-device
        lane at its submission time with its key, like any copy; returns when it lands."""
        env = self.env
        if op.t > env.now:
            yield env.timeout(op.t - env.now)
        lane = self._h2d.lane
        s, e = yield from self._hold(lane, (op.t, op.seq), op.dur, op.nbytes)
        if self.recorder is not None:
            self.recorder.op(lane.name, op.rkind, op.sid, op.token, op.layer, -1, s, e, op.nbytes)
        return e

    def _mem(self, start: float, dur: float, nbytes: int) -> None:
        """Unified memory: a copy starting now takes its share of the DRAM until it ends."""
        if self._unified:
            self.machine.copy_load(start, start + dur, nbytes)
            if self._host.active:
                self._cpu_arm()

    def _rearm(self) -> None:
        self._cpu_arm()

    def _cpu_arm(self) -> None:
        """Arm an urgent wake-up at the shared CPU's next event, tagged with its version."""
        cpu, env = self._host, self.env
        t = cpu.next_event()
        if t == float("inf"):
            return
        version = cpu.version
        ev = _Urgent(env, max(0.0, t - env.now))
        ev.callbacks.append(lambda _ev: self._cpu_wake(version))

    def _cpu_wake(self, version: int) -> None:
        cpu = self._host
        if version != cpu.version:
            return  # a later change re-timed the CPU
        for job in cpu.wake(self.env.now):
            self._cpu_done.pop(job.seq).succeed()
        self._cpu_arm()

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
        self._mem(s, dur, self.expert_bytes)
        yield env.timeout(dur)
        for lane, req in zip((h2d, d2h), reqs, strict=False):
            self._res[lane.name].release(req)
        d2h.busy += dur
        h2d.free_at = d2h.free_at = env.now
        self._record(d2h.name, op, "writeback", s, env.now, self.expert_bytes)
        op.end = env.now
        ev = self._done.pop(op, None)
        if ev is not None:  # a one-stream layer's end waits for it (_stream_drained)
            ev.succeed()
        self._slot_back()

    def _ssd_issue(self, op: LayerOp) -> None:
        """The SSD tier: the drive read ``op`` issued, as a process on the drive's resource
        requested now (in issue order); it ends the event the operation waits for."""
        ev = self._ssd_reads[op] = self.env.event()
        if not op.gds:
            self._ssd_landing[(op.layer, op.expert)] = ev
        self.env.process(self._ssd_read_proc(op, ev))

    def _ssd_read_proc(self, op: LayerOp, ev: simpy.Event) -> Proc:
        tier = self._ssd
        assert tier is not None
        env = self.env
        with self._res[tier.lane.name].request(priority=(env.now, op.seq)) as req:
            yield req
            s = env.now
            yield env.timeout(tier.read_s)
        kind = "gds_read" if op.gds else "ssd_read"
        self._record(tier.lane.name, op, kind, s, env.now, tier.expert_bytes)
        ev.succeed()

    def _ssd_wait(self, op: LayerOp) -> Proc:
        """The SSD tier: wait until the operation's weights are readable: its own drive read,
        or the read of an earlier operation that is putting the expert in host memory."""
        env = self.env
        if op.ssd_read:
            yield self._ssd_reads.pop(op)
            return
        ev = self._ssd_landing.get((op.layer, op.expert))
        if ev is not None and not ev.processed:
            yield ev
        elif op.ssd_at > env.now:
            yield env.timeout(op.ssd_at - env.now)

    def _copy_in(self, op: LayerOp) -> Proc:
        env = self.env
        if op.ssd_read or op.ssd_at > env.now:
            yield from self._ssd_wait(op)
        # no yield between submission and request when nothing blocks: requests made at the
        # same moment reach a resource in issue order (the tie-break of the rule)
        get = self._slots.get(1)
        if get.triggered:
            self.res.take(env.now)
        else:
            yield get
        link = self._h2d
        if op.gds:  # the drive wrote the slot already (GPUDirect Storage): no H2D copy
            self.res.copied((op.layer, op.expert), env.now)
            self._finish(op, env.now)
            return
        with self._res[link.lane.name].request(priority=(env.now, op.seq)) as req:
            yield req
            s = env.now
            self.res.copied((op.layer, op.expert), s + link.expert_s)
            self._mem(s, link.expert_s, self.expert_bytes)
            yield env.timeout(link.expert_s)
        link.lane.busy += link.expert_s
        link.lane.free_at = env.now  # the busy fractions' window (runner.window_work)
        self._record(link.lane.name, op, op.rkind, s, env.now, self.expert_bytes)
        self._finish(op, env.now)

    def _temp_in(self, op: LayerOp) -> Proc:
        env = self.env
        get = self._buffers.get()
        if not get.triggered:
            yield get
        op.buf = get.value
        if op.ssd_read or op.ssd_at > env.now:
            yield from self._ssd_wait(op)
        if op.gds:  # the drive wrote the buffer already (GPUDirect Storage): no H2D copy
            self._finish(op, env.now)
            return
        link = self._h2d
        m = self.machine
        dur, nbytes = (
            (m.low_bit_s, m.low_bit_bytes) if op.low else (link.expert_s, self.expert_bytes)
        )
        s, e = yield from self._hold(link.lane, (env.now, op.seq), dur, nbytes)
        self._record(link.lane.name, op, "temp", s, e, nbytes)
        self._finish(op, e)

    def _cpu_chain(self, op: LayerOp | None) -> Proc:
        """CPU jobs one after another: activations to the host, a worker, results back."""
        env = self.env
        while op is not None:
            if op.ssd_read or op.ssd_at > env.now:  # its weights are still being read
                yield from self._ssd_wait(op)
            n = op.n
            d2h, h2d = self._d2h, self._h2d
            act = self.act_bytes * n
            if not op.local:  # a CPU-resident layer's hidden states are on the host already
                s, e = yield from self._hold(d2h.lane, (env.now, op.seq), d2h.activation_s(n), act)
                self._record(d2h.lane.name, op, "activation", s, e, self.act_bytes * n)
            job = self.machine.cpu_job(op, op.seq, env.now, n)
            done = self._cpu_done[op.seq] = env.event()
            self._host.submit(env.now, job)
            self._cpu_arm()
            yield done
            self._record(self._host.lanes[job.worker].name, op, op.rkind, job.start, job.end, 0)
            if op.local:
                e = env.now
            else:
                s, e = yield from self._hold(h2d.lane, (env.now, op.seq), h2d.activation_s(n), act)
                self._record(h2d.lane.name, op, "activation", s, e, self.act_bytes * n)
            self._finish(op, e)
            op = op.chain

    # -- one layer -------------------------------------------------------------------------
    def _layer(self, w: LayerWork) -> Proc:
        env = self.env
        c = self.c
        now = w.now
        if self._ssd is not None:  # the layer's drive reads, requested now in issue order
            for head in w.ops:
                nxt: LayerOp | None = head
                while nxt is not None:
                    if nxt.ssd_read:
                        self._ssd_issue(nxt)
                    nxt = nxt.chain
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
        late = []
        if self.spec.one_stream:  # the in-use victims' write-backs, issued after a computation
            late = list(w.deferred.values())
            for op in late:
                self._event(op)
        state = {"g": now, "busy": 0.0}
        gate = None
        if w.cpu_first and w.sync:
            gate = env.all_of([self._event(op) for op in w.sync if op.end is None])
        known, waiting = yield from self._gpu_order(w)
        procs = [env.process(self._gpu(w, e, r, src, gate, state)) for r, e, src in known]
        procs += [env.process(self._gpu(w, e, None, src, gate, state)) for e, src in waiting]
        if gate is not None:
            yield gate
            sync_end = max(op.end for op in w.sync)  # type: ignore[type-var]
            if sync_end > now:
                c.cpu_wait += sync_end - now
                state["g"] = sync_end
        yield env.all_of(procs)
        if self.spec.one_stream:
            yield from self._stream_drained(w, late, state)
        end = yield from self._results_end(w, state["g"])
        c.gpu_expert_busy += state["busy"]
        self.machine.gpu.busy += state["busy"]
        return end

    def _gpu_order(self, w: LayerWork) -> Proc:
        """The layer's GPU experts in stream order: ``(ready, expert, copy)`` for those whose
        ready time is known, by (ready time, expert), and ``(expert, copy)`` for those whose
        copy is not timed yet (they join when it lands). A gather barrier first waits for
        every copy into the layer's slots and holds every ready time to the last of them."""
        bar = -1.0  # no barrier: every ready time stands
        if w.barrier:
            copies = [op for op in w.ops if op.kind == FETCH and op.layer == w.layer]
            pending = [self._event(op) for op in copies if op.end is None]
            if pending:
                yield self.env.all_of(pending)
            for op in copies:
                assert op.end is not None
                if op.end > bar:
                    bar = op.end
        known: list[tuple[float, int, LayerOp | None]] = []
        waiting: list[tuple[int, LayerOp]] = []
        for e, src in w.gpu:
            if src.__class__ is float:
                known.append((max(src, bar), e, None))
            elif src.end is not None:
                known.append((max(src.end, bar), e, src))
            else:
                waiting.append((e, src))
        known.sort(key=lambda x: (x[0], x[1]))
        return known, waiting

    def _stream_drained(self, w: LayerWork, late: list[LayerOp], state: dict[str, Any]) -> Proc:
        """One stream (ResourceSpec.one_stream): the layer ends once every copy it issued has
        ended (the next layer's kernels queue behind them); the wait is a transfer stall."""
        copies = [op for op in w.ops if op.kind != CPU] + late
        pending = [self._event(op) for op in copies if op.end is None]
        if pending:
            yield self.env.all_of(pending)
        g = last = state["g"]
        for op in copies:
            assert op.end is not None
            if op.end > last:
                last = op.end
        if last > g:
            self.c.transfer_stall += last - g
            state["g"] = last

    def _results_end(self, w: LayerWork, g: float) -> Proc:
        """Wait for the layer's CPU results; the layer ends at the later of them and ``g``
        (the GPU's end), and the GPU's wait for the CPU counts as ``cpu_wait``."""
        pending = [self._event(op) for op in w.results if op.end is None]
        if pending:
            yield self.env.all_of(pending)
        end = g
        for op in w.results:
            assert op.end is not None
            if op.end > end:
                end = op.end
        if end > g:
            self.c.cpu_wait += end - g
        return end

    def _gpu(
        self,
        w: LayerWork,
        e: int,
        ready: float | None,
        src: LayerOp | None,
        gate: simpy.Event | None,
        state: dict[str, Any],
        k: int = 0,
    ) -> Proc:
        """One expert on GPU ``k``'s stream, requested when its weights are there."""
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
        lane = self._gpu_lane(k)
        with self._res[lane.name].request(priority=(ready, e)) as req:
            yield req
            held = None
            if self.spec.one_stream:
                # one stream: the kernel is issued now, after every copy submitted by now (the
                # key sorts after theirs), and holds the copy lanes while it runs
                held = self._stream_hold()
                yield simpy.AllOf(env, [r for _, r in held])
            s = env.now
            g = self._gpu_clock(state, k)
            if s > g:
                self.c.transfer_stall += s - g
            n = int(w.counts[e]) if w.counts is not None else 1
            d = self.machine.gpu_s(n)
            fused = f"fused{k}"
            if not state.get(fused):  # the layer's fused call on GPU k, with its first expert
                d += self.machine.fused_launch_s
                state[fused] = 1.0
            host = self._gpu_host(k)
            if host is not None:  # the stream waits for the host thread to issue the kernels
                wait = host.expert(g, s, d) - d - s
                if wait > 0.0:
                    self.c.dispatch_stall += wait
                    yield env.timeout(wait)
                    s = env.now
            self._gpu_load(k, s, d, n)
            yield env.timeout(d)
            self._gpu_set_clock(state, k, env.now)
            state["busy"] += d
            if held is not None:
                for name, r in held:
                    self._res[name].release(r)
                for link in (self._h2d, self._d2h):
                    link.lane.free_at = env.now
                if src is not None and src.kind == TEMP:
                    # the next temporary copy is issued before the stream's next kernel (the
                    # fast engine pushes it before serving that kernel)
                    self._gpu_buffers(k).put(src.buf)
                    src = None
        self._gpu_done(k, lane, d)
        if self.recorder is not None:
            self.recorder.op(lane.name, "expert", w.sid, w.token, w.layer, e, s, env.now, 0)
        wb = w.deferred.pop(e, None)
        if wb is not None:  # evicted while in use: written back after its compute
            env.process(self._write_back(wb))
        if src is not None and src.kind == TEMP:
            self._gpu_buffers(k).put(src.buf)

    def _stream_hold(self) -> list[tuple[str, simpy.Event]]:
        """Requests for every copy lane, keyed after each copy submitted by now."""
        key = (self.env.now, float("inf"))
        names = dict.fromkeys(link.lane.name for link in (self._h2d, self._d2h))
        return [(name, self._res[name].request(priority=key)) for name in names]

    # -- per-GPU hooks of _gpu: one GPU here; simulator/multigpu.py overrides them ----------
    def _gpu_lane(self, k: int) -> Lane:
        """GPU ``k``'s stream lane."""
        return self.machine.gpu

    def _gpu_clock(self, state: dict[str, Any], k: int) -> float:
        """When GPU ``k``'s stream is free in this layer."""
        return state["g"]

    def _gpu_set_clock(self, state: dict[str, Any], k: int, t: float) -> None:
        """GPU ``k``'s stream is free from ``t``."""
        state["g"] = t

    def _gpu_host(self, k: int) -> Any:
        """The host thread issuing GPU ``k``'s expert kernels (None: free)."""
        return self.machine.host_experts

    def _gpu_load(self, k: int, s: float, d: float, n: int) -> None:
        """An expert computes on GPU ``k`` over [s, s+d): on unified memory it loads the DRAM."""
        if self._unified:
            self.machine.gpu_load(s, s + d, n)
            if self._host.active:
                self._cpu_arm()

    def _gpu_done(self, k: int, lane: Lane, d: float) -> None:
        """Per-GPU counters after an expert ran ``d`` seconds (one GPU: counted per layer)."""

    def _gpu_buffers(self, k: int) -> simpy.Store:
        """GPU ``k``'s temporary buffers."""
        return self._buffers


class _Urgent(simpy.events.Event):
    """A timeout processed before every ordinary event scheduled for the same moment."""

    def __init__(self, env: simpy.Environment, delay: float) -> None:
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, simpy.events.URGENT, delay)
