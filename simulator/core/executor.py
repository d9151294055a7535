"""The executor: times a layer's operations on the machine by one queueing rule.

Every serial resource serves requests in the order they are submitted in simulated time, ties
broken by issue number, without preemption (docs/policy-api.md, "Timing rules"). Submitted
requests wait in one heap keyed by (submission time, issue number) and are served lazily: only
as far as a layer needs a result. A request of several stages (a CPU expert: activations out,
the call, the result back; a write-back: the copy, then its slot's release) is pushed back
keyed by the time its next stage is submitted.

Within a layer, each GPU's stream runs that layer's expert computations in (ready time, expert)
order, each once its weights are there (its copy ended) and the stream is free; the time it
waits for a copy is transfer stall, for the runtime's host thread dispatch stall. The layer
ends when every GPU's computations, the results sent back to the layer's home GPU and the CPU
results it consumes are done.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from daopsim.simulator.core.machine import Link, Machine
from daopsim.simulator.core.ops import (
    CPU,
    FETCH,
    PEER,
    TEMP,
    WAKE,
    WRITEBACK,
    Counters,
    GpuJob,
    LayerWork,
    Op,
)
from daopsim.simulator.core.resources import INF, Lane, Lanes, Residency
from daopsim.simulator.heap import Heap


class Stream:
    """One GPU's stream within the current layer, and its totals over the run.

    ``lane``: the GPU's lane (its ``free_at``: when the stream is free); ``base``: no
    computation starts earlier (the layer's decision, then its activations' arrival from the
    home GPU); ``awaiting_input``: computations waiting for those activations (None once they
    are there); ``fused``: the layer's fused call is still to be charged (with its first
    computation); ``to_run``: computations still to run; ``free_bufs`` and ``tempq``:
    temporary buffers free, and copies waiting for one.
    """

    __slots__ = ("awaiting_input", "base", "d2h_bytes", "experts", "free_bufs",
                 "fused", "h2d_bytes", "lane", "tempq", "to_run")  # fmt: skip

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.awaiting_input: list[GpuJob] | None = None
        self.tempq: deque[Op] = deque()
        self.begin(0.0, 0)
        #: over the run: expert computations, expert bytes copied in and written back
        self.experts = self.h2d_bytes = self.d2h_bytes = 0

    def begin(self, now: float, buffers: int) -> None:
        """A new layer decided at ``now``."""
        self.base = now
        self.awaiting_input, self.fused, self.to_run = None, True, 0
        self.free_bufs = buffers

    def free(self) -> float:
        """When the stream can start the layer's next computation."""
        f = self.lane.free_at
        return f if f > self.base else self.base


class Executor:
    """Serves requests on the machine's resources and times each layer's GPU work."""

    def __init__(self, machine: Machine, res: Residency, counters: Counters, recorder: Any,
                 one_stream: bool) -> None:  # fmt: skip
        self.m, self.res, self.c, self.rec = machine, res, counters, recorder
        #: bytes one expert copy moves
        self.expert_bytes: int = machine.costs.link_expert_bytes
        #: copies and kernels share one stream (ResourceSpec.one_stream)
        self.one_stream = one_stream
        #: submitted requests keyed (submission time, issue number, submission number)
        self.heap = Heap()
        self._uid = 0
        #: issue numbers: the queueing rule's tie-break, taken as operations are created
        self.seq = 0
        # the current layer: the GPU jobs ready to run and the sources still pending
        self.jobs = Heap()
        self.waiting = 0
        #: the current layer's gather barrier (Plan.barrier): no computation starts earlier
        self.bar = -1.0
        #: each GPU's stream
        self.streams = [Stream(lane) for lane in machine.gpus]
        #: every occupation of a lane goes through this
        self.lanes = Lanes(machine, recorder, self.cpu_next)
        #: bytes moved per peer lane
        self.peer_bytes: dict[str, int] = {}

    # -- the request heap ---------------------------------------------------------------------
    def next_seq(self) -> int:
        """A new issue number."""
        self.seq += 1
        return self.seq

    def push(self, t: float, op: Op) -> None:
        """Submit ``op`` (its next stage) at ``t``."""
        op.time, op.time2, op.rank, op.serial = t, 0.0, op.seq, self._uid
        self._uid += 1
        self.heap.push(op)

    def next_time(self) -> float:
        """When the next submitted request was submitted (inf: none)."""
        items = self.heap.items
        return items[0].time if items else INF

    def advance(self, now: float) -> None:
        """Serve every request submitted at or before ``now``."""
        while self.next_time() <= now:
            self.serve_next()

    def serve_next(self) -> None:
        """Serve the next submitted request (or stage of one) in queueing-rule order."""
        op = self.heap.pop()
        assert isinstance(op, Op)
        self.serve(op.time, op)

    def drain(self) -> None:
        """Serve everything still submitted (background work after the last token)."""
        while self.heap.items:
            self.serve_next()

    def resolve(self, op: Op) -> float:
        """Serve requests until ``op`` has its end time; returns it."""
        while op.end < 0.0:
            if not self.heap.items:
                raise RuntimeError(f"engine: operation {op.row_kind} can never complete")
            self.serve_next()
        return op.end

    def last_end(self, ops: list[Op], end: float) -> float:
        """When the last of ``ops`` ends (served as far as needed), or ``end`` if later."""
        for op in ops:
            t = self.resolve(op)
            if t > end:
                end = t
        return end

    def serve(self, t: float, op: Op) -> None:
        """Serve ``op`` (its current stage) submitted at ``t``; every earlier one was served."""
        kind = op.kind
        if kind == FETCH:
            self._copy_in(t, op)
        elif kind == TEMP:
            self._temp_in(t, op)
        elif kind == CPU:
            self._cpu_stage(t, op)
        elif kind == WAKE:
            if op.n == self.m.cpu.version:  # else a later change re-timed it
                self._cpu_wake(t)
        elif kind == WRITEBACK:
            self._write_back(t, op)
        else:
            self._peer(t, op)

    # -- copies and slots -----------------------------------------------------------------------
    def _copy_in(self, t: float, op: Op) -> None:
        """An expert's copy into a GPU slot: it claims a slot (or waits for one), then holds
        its GPU's host-to-device lane (a GPUDirect Storage read already put it there)."""
        k = op.dev
        res = self.res
        if op.stage == 0:
            if not res.take(k, t):
                res.waiters[k].append(op)
                return
            op.stage = 1
        link = self.m.uplinks[k][0]
        dur, nbytes = self._copy_size(op, link)
        e = self._copy(t, op, link, dur, nbytes, op.row_kind)
        res.copied(op.layer * res.n_experts + op.expert, op, e)
        if op.after is not None:  # its expert was evicted in flight: free the slot now
            self.push(e, op.after)
        self._landed(op, e)

    def _temp_in(self, t: float, op: Op) -> None:
        """A copy into a temporary buffer (a low-bit copy when ``op.low``)."""
        link = self.m.uplinks[op.dev][0]
        dur, nbytes = self._copy_size(op, link)
        self._copy(t, op, link, dur, nbytes, "temp")
        self._landed(op, op.end)

    def _copy_size(self, op: Op, link: Link) -> tuple[float, int]:
        """A copy's duration and bytes: the host's low-precision copy's when ``op.low``; into
        the slot of an expert this layer computed (``op.warm``), the measured warm copy's."""
        if op.low:
            return self.m.low_bit_s, self.m.low_bit_bytes
        return (link.warm_s if op.warm else link.expert_s), self.expert_bytes

    def _copy(self, t: float, op: Op, link: Link, dur: float, nbytes: int, kind: str) -> float:
        """Serve a host-to-device copy of ``op`` submitted at ``t``; returns its end."""
        if op.gds:  # the drive wrote the weights into GPU memory already (GPUDirect Storage)
            op.end = t
            return t
        op.end = e = self.lanes.serve(link.engines, t, dur, kind, op.sid, op.token, op.layer,
                                      op.expert, nbytes)  # fmt: skip
        self.streams[op.dev].h2d_bytes += nbytes
        return e

    def _landed(self, op: Op, end: float) -> None:
        """A copy a GPU computation of the current layer waits for has ended."""
        job = op.job
        if op.gpu and job is not None:
            op.gpu = False
            self.waiting -= 1
            job.ready = end if end > self.bar else self.bar
            job.buf = op.buf if op.kind == TEMP else -1
            self.add_job(job)

    def _write_back(self, t: float, op: Op) -> None:
        """An evicted expert's copy back to the host, issued on the loads' stream (it holds
        both copy lanes of its GPU together); its slot is released when it ends."""
        if op.stage == 1:
            self.release(op.dev, t)
            return
        up_h, up_d = self.m.uplinks[op.dev]
        dur = up_d.warm_s if op.warm else up_d.expert_s
        e = self.lanes.hold([up_d.engines, up_h.engines], t, dur, "writeback", op.sid,
                            op.token, op.layer, op.expert, self.expert_bytes)  # fmt: skip
        self.streams[op.dev].d2h_bytes += self.expert_bytes
        op.end, op.stage = e, 1
        self.push(e, op)

    def release(self, k: int, t: float) -> None:
        """A slot of GPU ``k`` is released at ``t``: its first waiting fetch takes it."""
        op = self.res.release(k, t)
        if op is not None:
            op.stage = 1
            self.push(t, op)

    # -- the shared CPU -------------------------------------------------------------------------
    def _cpu_stage(self, t: float, op: Op) -> None:
        """Activations to the host, the expert on a CPU worker, the result back (a
        CPU-resident layer's expert has its activations on the host already)."""
        if op.local and op.stage != 1:
            if op.stage == 0:
                op.stage = 1
            else:
                op.end = t
                self._chain_next(op, t)
                return
        if op.stage == 1:  # on the shared CPU; it ends when a wake-up says so
            self.m.cpu.submit(t, self.m.cpu_job(op, op.seq, t, op.n))
            self.cpu_next()
            return
        up_h, up_d = self.m.uplinks[op.dev]
        link = up_d if op.stage == 0 else up_h
        nbytes = self.m.activation_bytes(op.n)
        e = self.lanes.serve(link.engines, t, link.activation_s(op.n), "activation", op.sid,
                             op.token, op.layer, op.expert, nbytes)  # fmt: skip
        if op.stage == 0:
            op.stage = 1
            self.push(e, op)
            return
        op.end = e
        self._chain_next(op, e)

    def _chain_next(self, op: Op, t: float) -> None:
        """A serial CPU chain: the next call is submitted once ``op``'s result is in (at
        ``t``), and no earlier than its own drive read ends (the SSD tier)."""
        nxt = op.chain
        if nxt is not None:
            self.push(t if t >= nxt.at else nxt.at, nxt)

    def cpu_next(self) -> None:
        """Schedule the shared CPU's next event (ahead of requests submitted at that time)."""
        cpu = self.m.cpu
        t = cpu.next_event()
        if t != INF:  # ahead of requests submitted at the same time (issue number -1)
            wake = Op(WAKE, "wake", -1, 0, 0, 0, 0)
            wake.n = cpu.version
            self.push(t, wake)

    def _cpu_wake(self, t: float) -> None:
        """The shared CPU's event at ``t``: calls that end there return their results."""
        for job in self.lanes.cpu_done(t):
            op = job.op
            op.stage = 2
            self.push(t, op)
        self.cpu_next()

    # -- between GPUs ---------------------------------------------------------------------------
    def _peer(self, t: float, op: Op) -> None:
        """Activations from GPU ``op.src`` to ``op.dst``: over a direct peer lane, or staged
        through host memory (out on the sender's uplink, then in on the receiver's)."""
        m = self.m
        nbytes = m.activation_bytes(op.n)
        link = m.peers.get((op.src, op.dst))
        staged = link is None
        if link is None:
            link = m.uplinks[op.src][1] if op.stage == 0 else m.uplinks[op.dst][0]
        lanes = link.engines
        e = self.lanes.serve(lanes, t, link.activation_s(op.n), "peer", op.sid, op.token,
                             op.layer, op.expert, nbytes, False)  # fmt: skip
        name = lanes.name
        self.peer_bytes[name] = self.peer_bytes.get(name, 0) + nbytes
        if staged and op.stage == 0:
            op.stage = 1
            self.push(e, op)
            return
        op.end = e
        if op.gpu:  # the sent activations: the receiving GPU's computations may start
            op.gpu = False
            self.waiting -= 1
            st = self.streams[op.dst]
            if e > st.base:
                st.base = e
            held = st.awaiting_input
            st.awaiting_input = None
            for job in held or ():
                self.add_job(job)

    def peer_op(self, w: LayerWork, src: int, dst: int, n: int) -> Op:
        """An activation transfer of ``n`` tokens of ``w``'s layer between two GPUs."""
        op = Op(PEER, "peer", self.next_seq(), w.sid, w.token, w.layer, -1)
        op.src, op.dst, op.n = src, dst, n
        return op

    # -- one layer ------------------------------------------------------------------------------
    def add_job(self, job: GpuJob) -> None:
        """A GPU computation of the current layer, startable from ``job.ready`` on its GPU
        (and no earlier than the GPU's ``base``)."""
        st = self.streams[job.dev]
        if st.awaiting_input is not None:  # its GPU's activations are not there yet
            st.awaiting_input.append(job)
            return
        base = st.base
        job.time = job.ready if job.ready > base else base
        job.time2, job.rank = job.ready, job.expert
        self.jobs.push(job)

    def run_layer(self, w: LayerWork) -> float:
        """Time one layer's work; returns when the layer ends."""
        m = self.m
        home = 0 if m.home is None else m.home[w.layer]
        for st in self.streams:
            st.begin(w.now, m.temp_buffers)
        self.waiting = 0
        sends = self._sends(w, home) if m.n_gpus > 1 else None
        self._submit(w, sends)
        self._wait_cpu_first(w)
        self._gpu_sources(w)
        late = list(w.deferred.values()) if self.one_stream else []
        self._run_gpu(w, sends)
        st = self.streams[home]
        end = st.free()
        if self.one_stream:
            end = self._one_stream_tail(w, late, end)
        if sends is not None:
            end = self.last_end([back for _, back in sends.values()], end)
        gpu_end = end
        end = self.last_end(w.results, end)
        if end > gpu_end:
            self.c.cpu_wait += end - gpu_end
        return self._cross(w, end)

    def _sends(self, w: LayerWork, home: int) -> dict[int, tuple[Op, Op]]:
        """Several GPUs: for each GPU but the layer's home one that computes experts of it,
        the activations' trip there and the results' trip back (issue numbers taken now);
        ``left`` counts each GPU's computations still to run."""
        gpu_of = self.m.gpu_of
        assert gpu_of is not None
        row = gpu_of[w.layer]
        for job in w.gpu:
            self.streams[row[job.expert]].to_run += 1
        sends: dict[int, tuple[Op, Op]] = {}
        for k, st in enumerate(self.streams):
            if st.to_run and k != home:
                n = self._peer_tokens(w, k)
                sends[k] = (self.peer_op(w, home, k, n), self.peer_op(w, k, home, n))
                st.awaiting_input = []
        return sends

    def _peer_tokens(self, w: LayerWork, k: int) -> int:
        """Tokens whose activations go to GPU ``k`` for its experts of ``w``'s layer."""
        counts: Any = w.counts
        if counts is None:
            return 1
        gpu_of = self.m.gpu_of
        assert gpu_of is not None
        row = gpu_of[w.layer]
        p = int(counts.sum()) // self.m.costs.model.top_k
        mine = sum(int(counts[j.expert]) for j in w.gpu if row[j.expert] == k)
        return max(1, min(p, mine))

    def _submit(self, w: LayerWork, sends: dict[int, tuple[Op, Op]] | None) -> None:
        """Submit the layer's operations at its decision time in issue order (a temporary
        copy takes a free buffer of its GPU, else waits in ``tempq`` for one), then the
        activations sent to other GPUs."""
        now = w.now
        n_temp = self.m.temp_buffers
        # a slot the plan's evictions freed at once may have passed to a fetch waiting for
        # one: submitted earlier, it is served before the plan's own operations
        self.advance(now)
        for op in w.ops:
            if op.kind == TEMP:
                st = self.streams[op.dev]
                if not st.free_bufs:
                    st.tempq.append(op)  # submitted when a buffer frees up
                    continue
                st.free_bufs -= 1
                op.buf = n_temp - st.free_bufs - 1
            if op.at > now:  # when its drive read ends, or the copy it follows lands
                if op.at != INF:  # INF: that copy submits it when it lands
                    self.push(op.at, op)
            else:
                self.serve(now, op)
            self.advance(now)  # a zero-length stage keeps its place
        for send, _ in sends.values() if sends is not None else ():
            send.gpu = True  # the activations leave the home GPU now
            self.waiting += 1
            self.serve(now, send)
            self.advance(now)

    def _wait_cpu_first(self, w: LayerWork) -> None:
        """``Plan.cpu_first``: the GPU streams start once the layer's CPU experts are done."""
        if not (w.cpu_first and w.sync):
            return
        sync_end = self.last_end(w.sync, -1.0)
        if sync_end > w.now:
            self.c.cpu_wait += sync_end - w.now
            for st in self.streams:
                if sync_end > st.base:
                    st.base = sync_end
            for job in self.jobs.items:
                assert isinstance(job, GpuJob)
                job.time = max(job.ready, self.streams[job.dev].base)
            self.jobs.rebuild()

    def _gpu_sources(self, w: LayerWork) -> None:
        """Each GPU computation is startable once its weights are there; with a gather
        barrier (``Plan.barrier``) no earlier than the last copy into the layer's slots."""
        self.bar = bar = self._barrier(w) if w.barrier else -1.0
        gpu_of = self.m.gpu_of
        for job in w.gpu:
            job.dev = 0 if gpu_of is None else gpu_of[w.layer][job.expert]
            src = job.src
            if src is None:
                if bar > job.ready:
                    job.ready = bar
                self.add_job(job)
            elif src.end >= 0.0:
                job.ready = src.end if src.end > bar else bar
                job.buf = src.buf if src.kind == TEMP else -1
                self.add_job(job)
            elif not src.gpu:
                src.gpu = True
                src.job = job
                self.waiting += 1

    def _barrier(self, w: LayerWork) -> float:
        """When the last copy into a slot of ``w``'s layer that ``w`` issued lands (-1 if
        none)."""
        return self.last_end([op for op in w.ops if op.kind == FETCH and op.layer == w.layer], -1.0)

    def _run_gpu(self, w: LayerWork, sends: dict[int, tuple[Op, Op]] | None) -> None:
        """Run the layer's GPU computations: each GPU's stream by (ready time, expert).

        An in-use victim's write-back is submitted when its computation ends, a temporary
        copy waiting for a buffer when a computation frees one, and a GPU's results are sent
        back to the home GPU after its last computation."""
        m, c = self.m, self.c
        jobs = self.jobs.items
        counts: Any = w.counts
        total = 0.0
        while jobs or self.waiting:
            while self.waiting and self.next_time() < (jobs[0].time if jobs else INF):
                self.serve_next()
            if not jobs:
                raise RuntimeError("engine: the GPU waits for a copy that can never start")
            job = self.jobs.pop()
            assert isinstance(job, GpuJob)
            ready, e, k = job.ready, job.expert, job.dev
            st = self.streams[k]
            drained = gk = st.lane.free_at if st.lane.free_at > st.base else st.base
            if self.one_stream:
                ready = self._one_stream_ready(ready, gk, k)
            if ready > gk:
                gk = self.copy_wait(ready, gk)
            n = 1 if counts is None else int(counts[e])
            d = m.gpu_copied_s(n) if job.copied else m.gpu_s(n)
            if st.fused:  # the layer's fused call, charged with the GPU's first expert
                st.fused = False
                d += m.fused_launch_s
            host = m.hosts[k]
            if host is not None:  # the stream may wait for its thread to issue the kernels
                wait = host.expert(drained, gk, d) - d - gk
                if wait > 0.0:
                    c.dispatch_stall += wait
                    gk += wait
            gk = self.lanes.run(st.lane, gk, d, "expert", w.sid, w.token, w.layer, e, 0, n, -1,
                                True)  # fmt: skip
            total += d
            st.experts += 1
            if self.one_stream:  # the kernel held the copy engines
                up_h, up_d = m.uplinks[k]
                self.lanes.block([up_h.engines, up_d.engines], gk)
            self._after_job(w, job, st)
            if sends is not None and k in sends:
                st.to_run -= 1
                if st.to_run == 0:  # its results go back to the home GPU
                    self.push(gk, sends[k][1])
        c.gpu_expert_busy += total
        self.lanes.settle(m.gpus)

    def _after_job(self, w: LayerWork, job: GpuJob, st: Stream) -> None:
        """What a finished computation submits: its expert's deferred write-back, and the
        next temporary copy into the buffer it frees."""
        if w.deferred:
            wb = w.deferred.pop(job.expert, None)
            if wb is not None:  # evicted while in use: written back after its computation
                self.push(st.lane.free_at, wb)
        if job.buf >= 0 and st.tempq:
            nxt = st.tempq.popleft()
            nxt.buf = job.buf
            g = st.lane.free_at
            self.push(g if g >= nxt.at else nxt.at, nxt)

    def copy_wait(self, landed: float, free: float) -> float:
        """A GPU stream free at ``free`` waits for a copy that lands at ``landed``: the wait
        is transfer stall; returns when the stream can go on."""
        if landed > free:
            self.c.transfer_stall += landed - free
            return landed
        return free

    def _one_stream_ready(self, ready: float, g: float, k: int) -> float:
        """One stream for copies and kernels: a kernel is issued once its weights are
        there, after every copy issued before it (submitted by then) has run, and holds the
        copy lanes while it runs."""
        at = ready if ready > g else g
        self.advance(at)
        up_h, up_d = self.m.uplinks[k]
        return max(at, up_h.engines.all_free_at(), up_d.engines.all_free_at())

    def _one_stream_tail(self, w: LayerWork, late: list[Op], g: float) -> float:
        """One stream: the layer ends once every copy it issued has ended (the wait is
        transfer stall)."""
        return self.copy_wait(self.last_end([o for o in w.ops if o.kind != CPU] + late, g), g)

    def _cross(self, w: LayerWork, end: float) -> float:
        """Pipeline: after a stage's last layer the hidden states cross to the next GPU."""
        home = self.m.home
        if home is None or w.layer + 1 >= len(home) or home[w.layer + 1] == home[w.layer]:
            return end
        counts: Any = w.counts
        n = 1 if counts is None else max(1, int(counts.sum()) // self.m.costs.model.top_k)
        cross = self.peer_op(w, home[w.layer], home[w.layer + 1], n)
        self.push(end, cross)
        return self.resolve(cross)

    # -- streamed weights -----------------------------------------------------------------------
    def weights(self, t: float, nbytes: int, dur: float, kind: str, sid: int, token: int,
                layer: int) -> float:  # fmt: skip
        """A copy of non-expert weights submitted at ``t``: it queues on the host-to-device
        lane behind everything submitted before it; returns when it lands."""
        self.advance(t)
        return self.lanes.serve(self.m.links["h2d"].engines, t, dur, kind, sid, token, layer, -1,
                                nbytes)  # fmt: skip
