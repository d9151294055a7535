"""A checked plan into operations, in issue order (docs/policy-api.md, "How a plan is applied").

The plan was checked first (``daopsim.simulator.boundary.check_plan``), so nothing here refuses it.
In issue order: the explicit evictions, then the routed experts (resident ones first: hits are
judged before the layer's insertions) as hits, fetches (each evicting its victim first),
temporary copies, CPU experts and consumed pre-calculations, then the prefetches and the
pre-calculations for coming layers. An evicted expert written back keeps its slot until its
copy to the host ends; one still running in this layer is written back after its computation.
"""

from __future__ import annotations

from typing import Any

from daopsim.policies.base import Plan
from daopsim.simulator.boundary import A_CPU, A_FETCH, A_GPU, A_TEMP
from daopsim.simulator.core.executor import Executor
from daopsim.simulator.core.ops import CPU, FETCH, TEMP, WRITEBACK, GpuJob, LayerWork, Op
from daopsim.simulator.core.resources import INF


def _int(x: Any) -> int:
    """A checked plan's integer (an int or a numpy integer) as an int; an int as it is
    (compiled, ``int(x)`` is a call of the int type even for an int)."""
    return x if type(x) is int else int(x)


class Applier:
    """Turns checked plans into a :class:`LayerWork` and keeps the residency and the
    counters of what the plans ask for."""

    def __init__(self, ex: Executor, n_layers: int, writeback: bool, ssd: Any) -> None:
        self.ex, self.m, self.res, self.c = ex, ex.m, ex.res, ex.c
        self.expert_bytes, self.act_bytes = ex.expert_bytes, ex.m.activation_bytes
        #: evicted experts are copied back to the host (ResourceSpec.writeback)
        self.writeback = writeback
        #: the SSD tier when some experts live on a drive (daopsim.simulator.hosttier.HostTier)
        self.ssd = ssd
        #: submitted CPU pre-calculations not consumed yet: (layer, expert) -> the job
        self.precalc: dict[tuple[int, int], Op] = {}
        #: decode hits and accesses per layer (plain lists; RunStats gets arrays)
        self.hits = [0] * n_layers
        self.accesses = [0] * n_layers

    def apply(
        self,
        plan: Plan,
        layer: int,
        order: list[int],
        routed: list[int],
        counts: Any,
        now: float,
        prefill: bool,
        label: tuple[int, int],
        cpu_layer: bool,
    ) -> LayerWork:
        """A checked plan as operations; ``label`` (sequence, token) names them in the
        timeline, ``cpu_layer`` says the layer runs on the CPU (its CPU experts need no
        activation copies)."""
        w = LayerWork(now, layer, label[0], label[1], counts)
        actions: dict[Any, Any] | None = plan.actions  # checked: None or a dict
        if actions is None:
            needed = set(routed)
        else:
            needed = {e for e in routed if actions[e] in (A_GPU, A_FETCH)}
        for victim in plan.evict:
            self._evict(_int(victim[0]), _int(victim[1]), needed, w)
        temps: list[int] = []
        cpu_jobs: list[int] = []
        hits = 0
        for e in order:
            a = A_GPU if actions is None else actions[e]  # an Action or its int (checked)
            if a == A_GPU:
                hits += 1
                w.gpu.append(self._hit(layer, e))
            elif a == A_FETCH:  # of the low-bit copy when low_bit names it (low_bit_slots)
                low = bool(plan.low_bit) and e in plan.low_bit
                op = self._fetch(layer, e, "fetch", plan.victims.get(e), needed, w, low)
                self.c.fetches += 1
                w.gpu.append(GpuJob(e, 0.0, op, True))
            elif a == A_TEMP:
                temps.append(e)
            elif a == A_CPU:
                cpu_jobs.append(e)
            else:  # a consumed pre-calculation
                w.results.append(self.precalc.pop((layer, e)))
        self._count_accesses(layer, len(routed), hits, prefill)
        for e in temps:
            w.gpu.append(GpuJob(e, 0.0, self._temp(layer, e, plan.low_bit, w), True))
        for entry in plan.prefetch:
            pl, pe = _int(entry[0]), _int(entry[1])
            self._fetch(pl, pe, "prefetch", entry[2], needed, w)
            self.res.prefetched[pl * self.res.n_experts + pe] = 1
            self.c.prefetches += 1
        self._cpu_work(plan, layer, cpu_jobs, counts, cpu_layer, w)
        w.cpu_first = plan.cpu_first
        w.barrier = plan.barrier
        if self.ssd is not None:
            self._ssd_stage(w)
        return w

    def _hit(self, layer: int, e: int) -> GpuJob:
        """A resident expert runs on the GPU: once its copy ends, or now if it has."""
        res = self.res
        i = layer * res.n_experts + e
        if res.prefetched[i]:
            res.prefetched[i] = 0
            self.c.prefetch_used += 1
        ready = res.ready[i]
        if ready != INF:
            return GpuJob(e, ready, None)
        return GpuJob(e, 0.0, res.copying[i])

    def _count_accesses(self, layer: int, n_routed: int, n_hits: int, prefill: bool) -> None:
        """Count a layer's expert accesses and hits (per phase; per layer for decode)."""
        c = self.c
        if prefill:
            c.prefill_accesses += n_routed
            c.prefill_hits += n_hits
        else:
            c.decode_accesses += n_routed
            c.decode_hits += n_hits
            self.hits[layer] += n_hits
            self.accesses[layer] += n_routed

    def _op(self, kind: int, row_kind: str, layer: int, expert: int, w: LayerWork) -> Op:
        op = Op(kind, row_kind, self.ex.next_seq(), w.sid, w.token, layer, expert)
        if kind == CPU:  # activations leave from, and return to, the layer's home GPU
            op.dev = 0 if self.m.home is None else self.m.home[layer]
        elif self.m.gpu_of is not None:
            op.dev = self.m.gpu_of[layer][expert]
        return op

    def _evict(self, layer: int, expert: int, needed: set[int], w: LayerWork) -> None:
        """Evict a resident expert; with write-back its slot stays held until its copy to
        the host ends (an expert still needed in this layer: after its computation). An
        expert whose copy is still in flight keeps its slot until that copy lands (a DMA in
        progress is not cancelled): its write-back, or its slot's release, follows it."""
        res, c = self.res, self.c
        i = layer * res.n_experts + expert
        landing, copy = res.remove(i, w.now)
        c.evictions += 1
        if landing > 0.0:
            c.evictions_in_flight += 1
        if layer == w.layer and expert in needed:
            wb = self._writeback_op(layer, expert, w)
            wb.warm = True  # written back after this layer's computation of it
            w.deferred[expert] = wb
            return
        if res.prefetched[i]:
            res.prefetched[i] = 0
            c.prefetch_wasted_bytes += self.expert_bytes
        if self.writeback:
            op = self._writeback_op(layer, expert, w)
            w.ops.append(op)
            if landing > 0.0:  # submitted when the copy lands (INF: that copy submits it)
                op.at = landing
                if copy is not None:
                    copy.after = op
        elif landing == 0.0:  # the slot is free at once
            k = 0 if self.m.gpu_of is None else self.m.gpu_of[layer][expert]
            self.ex.release(k, w.now)
        else:  # the slot is free once the copy into it lands
            op = self._op(WRITEBACK, "release", layer, expert, w)
            op.stage = 1
            if copy is None:
                self.ex.push(landing, op)
            else:
                copy.after = op

    def _writeback_op(self, layer: int, expert: int, w: LayerWork) -> Op:
        self.c.d2h_bytes += self.expert_bytes
        self.c.d2h_expert_copies += 1
        return self._op(WRITEBACK, "writeback", layer, expert, w)

    def _fetch(self, layer: int, expert: int, kind: str, victim: Any, needed: set[int],
               w: LayerWork, low: bool = False) -> Op:  # fmt: skip
        """Copy an expert into a slot (``kind``: a fetch or a prefetch), after its victim."""
        warm = False
        if victim is not None:
            vl, ve = _int(victim[0]), _int(victim[1])
            warm = vl == w.layer and ve in needed  # into the slot of an expert computed here
            self._evict(vl, ve, needed, w)
        op = self._op(FETCH, kind, layer, expert, w)
        op.warm = warm
        self.res.insert(layer * self.res.n_experts + expert, op)
        self._copied(op, low)
        w.ops.append(op)
        return op

    def _copied(self, op: Op, low: bool) -> None:
        """Count a copy to the GPU: of the host's low-precision copy when ``low``."""
        op.low = low
        self.c.low_bit_copies += low
        self.c.h2d_bytes += self.m.low_bit_bytes if low else self.expert_bytes
        self.c.h2d_expert_copies += 1

    def _temp(self, layer: int, e: int, low: Any, w: LayerWork) -> Op:
        """A copy into a temporary buffer (of the low-precision host copy if ``low`` names
        the expert); the buffer is free again once the computation ends."""
        op = self._op(TEMP, "temp", layer, e, w)
        self.c.temp_copies += 1
        self._copied(op, bool(low) and e in low)
        w.ops.append(op)
        return op

    def _cpu_work(
        self, plan: Plan, layer: int, experts: list[int], counts: Any, local: bool, w: LayerWork
    ) -> None:
        """The layer's CPU experts (the layer needs their results), then the
        pre-calculations of coming layers; a serial plan chains each kind one after another."""
        prev: Op | None = None
        for e in experts:
            op = self._cpu_op(layer, e, 1 if counts is None else int(counts[e]), "cpu_expert",
                              local, w)  # fmt: skip
            self.c.cpu_expert_evals += 1
            w.sync.append(op)
            w.results.append(op)
            prev = self._chain(plan.cpu_serial, prev, op, w)
        prev = None
        for pl, pe in plan.precalc:
            slot = (_int(pl), _int(pe))
            op = self._cpu_op(slot[0], slot[1], 1, "precalc", local, w)
            self.c.cpu_precalc_evals += 1
            self.precalc[slot] = op
            prev = self._chain(plan.cpu_serial, prev, op, w)

    def _chain(self, serial: bool, prev: Op | None, op: Op, w: LayerWork) -> Op:
        """Submit ``op`` now, or after ``prev`` in a serial chain; returns ``op``."""
        if serial and prev is not None:
            prev.chain = op
        else:
            w.ops.append(op)
        return op

    def _cpu_op(self, layer: int, e: int, n: int, kind: str, local: bool, w: LayerWork) -> Op:
        op = self._op(CPU, kind, layer, e, w)
        op.n = n
        if local:  # the hidden states are already on the host
            op.local = True
            return op
        nbytes = self.act_bytes(n)
        self.c.d2h_bytes += nbytes
        self.c.h2d_bytes += nbytes
        return op

    def _ssd_stage(self, w: LayerWork) -> None:
        """The SSD tier: each operation that reads an expert's host copy (a copy to the GPU,
        a CPU expert) gets the time its weights are there, read from the drive when host
        memory does not hold them; write-backs land host copies. The layer's SSD stall runs
        from the decision until its last routed expert is readable."""
        tier = self.ssd
        now = wait = w.now
        for head in w.ops:
            op: Op | None = head
            while op is not None:
                if op.kind == WRITEBACK:
                    tier.written_back(op, now)
                else:
                    op.at, op.gds = tier.read(op, now, op.kind != CPU)
                    if op.at > wait and op.row_kind != "prefetch" and op.row_kind != "precalc":
                        wait = op.at
                op = op.chain
        for op in w.deferred.values():
            tier.written_back(op, now)
        tier.ssd_stall += wait - now
