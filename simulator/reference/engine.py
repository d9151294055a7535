"""The reference engine: the step loop, plans into operations, and every operation as a SimPy
process on the reference's own resources (:mod:`daopsim.simulator.reference.resources`).

It shares with the rest of daopsim only the cost model, the policy API (the hooks called
through :class:`~daopsim.simulator.boundary.Hooks`, plans checked by ``check_plan``), the workload
(sequences, serving requests), the recorder and the result containers. Everything that turns
a plan into time is written here again, plainly, from docs/policy-api.md ("Timing rules"),
docs/cost-model.md and docs/serving.md: so the equivalence tests
(tests/test_reference_engine.py) check the fast engine against an independent model.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Generator, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import simpy

from daopsim.policies.base import Action, Plan, Policy, SetupContext, Slot, View
from daopsim.simulator.boundary import (
    Hooks,
    check_placement,
    check_plan,
    check_route,
    fill_layer_view,
    frozen,
)
from daopsim.simulator.core.ops import Counters
from daopsim.simulator.costs import CostModel
from daopsim.simulator.errors import UserError
from daopsim.simulator.models import ModelShape
from daopsim.simulator.recorder import Recorder
from daopsim.simulator.reference.memory import INF, HostMemory, Ledger
from daopsim.simulator.reference.resources import Clock, Engines, HostCpu, IssueThread, Lane, Pool
from daopsim.simulator.runstats import RunStats
from daopsim.simulator.runtime_profiles import RuntimeProfile
from daopsim.simulator.trace_format import SequenceRouting

if TYPE_CHECKING:
    from daopsim.simulator.hosttier import HostTierConfig
    from daopsim.simulator.multigpu import Placement

Proc = Generator[simpy.Event, Any, Any]

GPU, FETCH, TEMP, CPU, PRE = (int(a) for a in Action)
#: operation kinds that copy into a slot
SLOT_COPIES = ("fetch", "prefetch")


class Op:
    """One operation a layer issues: a copy, a write-back, a CPU call, an activation transfer.

    ``kind`` is the timeline's kind column; ``seq`` its issue number (the tie-break of the
    queueing rule); ``done`` fires when it ends (``end``). A serial CPU task chains its calls
    through ``chain``. ``read`` is the drive read it waits for (SSD tier); ``landing`` the
    copy a write-back waits for."""

    __slots__ = (
        "chain",
        "device",
        "done",
        "dst",
        "end",
        "expert",
        "gds",
        "kind",
        "landing",
        "layer",
        "local",
        "low",
        "n",
        "read",
        "seq",
        "sid",
        "src",
        "token",
        "warm",
    )

    def __init__(self, env: simpy.Environment, kind: str, seq: int, sid: int, token: int,
                 layer: int, expert: int, device: int) -> None:  # fmt: skip
        self.kind = kind
        self.seq = seq
        self.sid = sid
        self.token = token
        self.layer = layer
        self.expert = expert
        self.device = device
        self.n = 1
        self.low = False
        self.local = False
        self.gds = False
        self.warm = False  # into or out of the slot of an expert this layer computed
        self.read: simpy.Event | None = None
        #: a write-back of an expert evicted while its copy was in flight: that copy
        self.landing: Op | None = None
        self.chain: Op | None = None
        self.src = self.dst = -1
        self.end: float | None = None
        self.done = env.event()


class LayerRun:
    """One layer's checked plan as operations, everything submitted at its decision time."""

    def __init__(self, now: float, layer: int, sid: int, token: int, counts: Any) -> None:
        self.now = now
        self.layer = layer
        self.sid = sid
        self.token = token
        self.counts = counts  # tokens per expert (prefill, batches) or None (one token)
        self.ops: list[Op] = []  # in issue order (a serial CPU task by its first call)
        self.gpu: list[tuple[int, Op | float]] = []  # (expert, its copy or landing time)
        self.copied: set[int] = set()  # experts this layer copies in (fetches, temp copies)
        self.deferred: dict[int, Op] = {}  # in-use victims: written back after their compute
        self.cpu: list[Op] = []  # this layer's CPU experts (cpu_first waits for them)
        self.results: list[Op] = []  # the CPU results the layer needs
        self.late: list[Op] = []  # the in-use victims' write-backs, in issue order
        self.cpu_first = False
        self.barrier = False


class Device:
    """One GPU: its stream, its host uplink, its slots and temporary buffers, the thread that
    issues its expert kernels, and its own counters."""

    def __init__(self, gpu: Lane, h2d: Engines, d2h: Engines, slots: Pool, buffers: Pool,
                 thread: IssueThread | None, budget: int) -> None:  # fmt: skip
        self.gpu, self.h2d, self.d2h = gpu, h2d, d2h
        self.copy_lanes = [h2d] if h2d is d2h else [h2d, d2h]
        self.slots, self.buffers = slots, buffers
        self.thread = thread
        self.budget = budget
        self.taken_max = slots.taken
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.experts = 0


class Streams:
    """The GPU streams of one layer: when each becomes free, whether it opened, whether its
    fused MoE call is still to be charged."""

    def __init__(self, env: simpy.Environment, n: int, now: float) -> None:
        self.free = [now] * n
        self.opened = [env.event() for _ in range(n)]
        self.unfused = [True] * n
        self.busy = 0.0


def cpu_layers_of(spec: Any, model: ModelShape, budget: int) -> int:
    """Leading MoE layers a spec runs wholly on the CPU when the run did not size them
    (docs/policy-api.md, ``gpu_blocks``): N GPU blocks leave the others; -1 leaves the fewest
    whose GPU layers' experts fit the budget."""
    g = spec.gpu_blocks
    if g is None:
        return 0
    if g >= 0:
        return model.moe_layers - min(model.moe_layers, g)
    return max(0, model.moe_layers - budget // model.experts)


class ReferenceEngine:
    """Replays sequences through one host (or several GPUs, ``placement``) as SimPy processes.

    Same constructor, ``serving`` attribute and ``run`` as the fast engine
    (``simulator.engine.Engine``); slow, and written to be read: docs/architecture.md, "The
    reference engine".
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
        *,
        placement: Placement | None = None,
        budgets: list[int] | None = None,
    ) -> None:
        self.policy = policy
        self.hooks = Hooks(policy)
        spec = self.spec = self.hooks.call("resources", policy.resources)
        self.model, self.costs, self.recorder = model, costs, recorder
        self.budget = int(budget)
        self.n_layers, self.n_experts = model.moe_layers, model.experts
        self.env = env = Clock()
        self.c = Counters()
        self._hits = [0] * self.n_layers
        self._accesses = [0] * self.n_layers
        self.now = 0.0
        self.step = 0
        self._issue = itertools.count(1)
        #: batched or continuous serving (``daopsim.simulator.serving.Serving``, set by the runner)
        self.serving: Any = None
        #: submitted CPU pre-calculations not consumed yet: (layer, expert) -> the call
        self.precalc: dict[Slot, Op] = {}
        self.ledger = Ledger(self.n_layers, self.n_experts, self.budget)
        self.expert_bytes = costs.link_expert_bytes  # what one expert copy moves
        #: bytes of n tokens' hidden states, one way (the cost model's)
        self.act_bytes = functools.cache(costs.activation_bytes)
        self._bind_costs(runtime)
        self._occupied = 0
        self._occupied_max = 0

        v = self._make_view(calibration)
        calibration = v.calibration
        self.host_memory: HostMemory | None = None
        self._tier = host_tier
        if host_tier is not None:
            mem = HostMemory(env, host_tier, costs, self.n_layers, self.n_experts,
                             spec.ssd_access, recorder)  # fmt: skip
            v.host_resident = mem.holds.view()
            v.host_resident.flags.writeable = False
            if host_tier.uses_ssd:
                self.host_memory = mem
        n_cpu = cpu_layers_of(spec, model, self.budget) if cpu_layers is None else cpu_layers
        #: leading MoE layers run wholly on the CPU (ResourceSpec.gpu_blocks)
        self.n_cpu_layers = n_cpu
        self._cpu_layer_here = False
        ctx = SetupContext(
            model=model, budget=self.budget, costs=costs, calibration=calibration,
            calibration_prefill=frozen(calibration_prefill),
            oracle=oracle if policy.clairvoyant else None, seed=seed,
            calibration_sequences=calibration_sequences, cpu_layers=n_cpu,
        )  # fmt: skip
        placed = self.hooks.call("setup", policy.setup, ctx)
        slots = check_placement(self.hooks, placed, self.n_layers, self.n_experts, self.budget)
        self.ledger.place(slots)
        self.placement = placement
        if placement is not None:
            self._refuse_on_several_gpus()
        self._build_machine(runtime, slots, placement, budgets)
        self._show_in_flight(v)
        self._note_occupancy(0.0, len(slots))

    def _make_view(self, calibration: np.ndarray | None) -> View:
        """The policy's view: the model, the costs, the budget, the calibration statistics and
        the residency, read-only."""
        v = self.view = View()
        v.model, v.costs, v.budget = self.model, self.costs, self.budget
        v.calibration = frozen(calibration)
        v.resident = self.ledger.resident.view()
        v.resident.flags.writeable = False
        return v

    def _show_in_flight(self, v: View) -> None:
        """In-flight copies and their landing times (the same on one GPU), and the copy
        engines they queue on."""
        ready = self.ledger.ready_at.view()
        ready.flags.writeable = False
        v.ready = ready
        v._copy_free_times = lambda k: self.devices[k].h2d.drain_times()
        v._copy_seconds = [self.h2d_s] * len(self.devices)

    # -- the machine ------------------------------------------------------------------------
    def _bind_costs(self, runtime: RuntimeProfile | None) -> None:
        """The durations this run asks for, memoised (every one from the cost model)."""
        costs, spec = self.costs, self.spec
        pinned = spec.pinned
        fused = runtime is not None and runtime.fused_moe
        eager = runtime is not None and runtime.attention == "eager"
        self._runtime = runtime
        self.eager_attention = eager
        self.gpu_s = functools.cache(costs.fused_gpu_expert_s if fused else costs.gpu_expert_s)
        # an expert whose weights this layer copied in (a fetch or a temporary copy)
        after = not fused and costs.has_after_copy
        self.gpu_copied_s = functools.cache(costs.gpu_expert_after_copy_s) if after else self.gpu_s
        self.fused_launch_s = costs.fused_moe_layer_s() if fused else 0.0
        self.nonexpert_s = functools.cache(
            lambda n, ctx: costs.nonexpert_layer_s(n, ctx, eager_attention=eager)
        )
        self.cpu_s = functools.cache(costs.cpu_expert_s)
        self.cpu_share = functools.cache(costs.cpu_share)
        self.cpu_dram = functools.cache(costs.cpu_dram_share)
        self.activation_s = functools.cache(costs.activation_copy_s)
        self.peer_s = functools.cache(costs.peer_activation_s)
        self.h2d_s = costs.h2d_expert_s(pinned)
        self.d2h_s = costs.d2h_expert_s(pinned)
        self.h2d_warm_s = costs.h2d_expert_warm_s(pinned)
        self.d2h_warm_s = costs.d2h_expert_warm_s(pinned)
        low = spec.low_bit_dtype
        self.low_bit_s = costs.h2d_low_bit_expert_s(low, pinned) if low else 0.0
        self.low_bit_bytes = costs.low_bit_expert_bytes(low) if low else 0
        self.unified = costs.unified_memory
        self.streamed: tuple[tuple[int, float], tuple[int, float]] | None = None
        if spec.nonexpert_streamed:
            keep = spec.nonexpert_persist_numel
            lb = costs.streamed_layer_weight_bytes(keep)
            eb = costs.streamed_embedding_bytes(keep)
            self.streamed = ((lb, costs.weights_h2d_s(lb, pinned)),
                             (eb, costs.weights_h2d_s(eb, pinned)))  # fmt: skip

    def _thread(self) -> IssueThread | None:
        rt = self._runtime
        if rt is None or rt.free:  # a runtime with no host costs has no thread to model
            return None
        return IssueThread(rt, self.model.experts - self.model.top_k)

    def _build_machine(
        self,
        runtime: RuntimeProfile | None,
        placed: list[Slot],
        placement: Placement | None,
        budgets: list[int] | None,
    ) -> None:
        """The GPUs (one, or ``placement.n``), their uplinks, the peer lanes, the host CPU."""
        env, spec, hw = self.env, self.spec, self.costs.hw
        one_engine = hw.link.copy_engines < 2
        self.cpu = HostCpu(env, spec.cpu_workers)
        self.peers: dict[tuple[int, int], Engines] = {}
        # engines per copy direction: one on a single stream (it issues one copy at a time)
        per = 1 if spec.one_stream else hw.link.copy_engines_per_direction
        self.thread = self._thread()  # the main thread: non-expert parts, GPU 0's experts
        if placement is None:
            self.gpu_of: list[list[int]] = [[0] * self.n_experts for _ in range(self.n_layers)]
            self.home = [0] * self.n_layers
            h2d = Engines(env, "copy") if one_engine else Engines(env, "h2d", per)
            d2h = h2d if one_engine else Engines(env, "d2h", per)
            slots = Pool(env, self.budget + spec.staging_buffers, len(placed), self._slot_change)
            bufs = Pool(env, spec.temp_buffers)
            self.devices = [
                Device(Lane(env, "gpu"), h2d, d2h, slots, bufs, self.thread, self.budget)
            ]
            return
        assert budgets is not None
        multi = hw.multi
        assert multi is not None
        n = placement.n
        self.gpu_of, self.home = placement.gpu_of, list(placement.home)
        uplinks: list[tuple[Engines, Engines]] = []
        for k in range(1 if multi.shared_uplink else n):
            h = Engines(env, f"copy{k}") if one_engine else Engines(env, f"h2d{k}", per)
            uplinks.append((h, h if one_engine else Engines(env, f"d2h{k}", per)))
        held = [0] * n
        for layer, e in placed:
            held[placement.gpu_of[layer][e]] += 1
        self.devices = []
        for k in range(n):
            h2d, d2h = uplinks[0 if multi.shared_uplink else k]
            # every GPU but GPU 0 has a worker thread of its own issuing its expert kernels
            thread = self.thread if k == 0 else self._thread()
            slots = Pool(env, budgets[k] + spec.staging_buffers, held[k], self._slot_change)
            bufs = Pool(env, spec.temp_buffers)
            self.devices.append(
                Device(Lane(env, f"gpu{k}"), h2d, d2h, slots, bufs, thread, budgets[k])
            )
        if multi.peer_kind != "host":
            for a in range(n):
                for b in range(n):
                    if a != b and multi.direct(a, b):
                        self.peers[(a, b)] = Engines(env, f"peer{a}>{b}")
        self.peer_bytes: dict[str, int] = {}

    def _refuse_on_several_gpus(self) -> None:
        spec, name = self.spec, self.policy.name
        if spec.nonexpert_streamed:
            raise UserError(
                f"policy {name!r} streams its non-expert weights "
                "(ResourceSpec.nonexpert_streamed), which several GPUs do not model; "
                "run it on one GPU (stream-all: --policy-opt stream_nonexpert=false)"
            )
        if spec.one_stream:
            raise UserError(
                f"policy {name!r} issues its copies on its kernels' stream "
                "(one_stream); the multi-GPU executors do not model that"
            )

    def _slot_change(self, t: float, delta: int) -> None:
        self._note_occupancy(t, self._occupied + delta)

    def _note_occupancy(self, t: float, occupied: int) -> None:
        self._occupied = occupied
        self._occupied_max = max(self._occupied_max, occupied)
        for dev in self.devices:
            dev.taken_max = max(dev.taken_max, dev.slots.taken)
        if self.recorder is not None:
            self.recorder.occupancy(t, occupied)

    # -- views of the state (tests and the chaos policy read these) -------------------------
    @property
    def ready_at(self) -> np.ndarray:
        """When each resident expert's copy lands (infinity while it has not started)."""
        return self.ledger.ready_at

    @property
    def resident(self) -> np.ndarray:
        """The residency mask."""
        return self.ledger.resident

    # -- running ----------------------------------------------------------------------------
    def run(
        self, sequences: Iterable[SequenceRouting], on_sequence: Callable[[Any], None] | None = None
    ) -> RunStats:
        """Simulate the sequences back to back (or the serving plan); returns the statistics."""
        env = self.env
        if self.serving is not None:
            from daopsim.simulator.reference.serving import serve

            main = env.process(serve(self, self.serving, on_sequence))
        else:
            main = env.process(self._sequences(sequences, on_sequence))
        env.run(until=main)
        e2e = self.now
        env.run()  # background work still going when the last token is out
        return self._stats(e2e)

    def _sequences(
        self, sequences: Iterable[SequenceRouting], on_sequence: Callable[[Any], None] | None
    ) -> Proc:
        hooks, pol, c = self.hooks, self.policy, self.c
        where = hooks.where
        for r in sequences:
            sid = int(r.seq_id)
            where.seq, where.token, where.layer = sid, None, None
            self.view.seq_id = sid
            hooks.call("on_sequence_start", pol.on_sequence_start, sid, r.n_prefill)
            t0 = self.now
            if r.n_prefill:
                yield from self.forward(r, True)
            c.ttft.append(self.now - t0)
            yield from self.forward(r, False)
            where.token = None
            hooks.call("on_sequence_end", pol.on_sequence_end, sid)
            self.end_sequence()
            if on_sequence is not None:
                on_sequence(r)

    def end_sequence(self) -> None:
        """A sequence (request) ended: pre-calculations nobody consumed are wasted."""
        self.c.precalc_wasted += len(self.precalc)
        self.precalc.clear()
        self.c.sequences += 1

    def until(self, t: float) -> Proc:
        """Wait until time ``t`` (a process body)."""
        if t > self.env.now:
            yield self.env.at(t)

    def _stats(self, e2e: float) -> RunStats:
        c = self.c
        c.max_occupancy = self._occupied_max
        c.hits_per_layer = np.array(self._hits, dtype=np.int64)
        c.accesses_per_layer = np.array(self._accesses, dtype=np.int64)
        threads = {id(d.thread): d.thread for d in self.devices if d.thread is not None}
        if self.thread is not None:
            threads[id(self.thread)] = self.thread
        c.host_syncs = sum(t.syncs for t in threads.values())
        cpu_busy = sum(self.cpu.busy)
        if self.placement is None:
            dev = self.devices[0]
            busy = {"gpu": dev.gpu.busy, "h2d": dev.h2d.busy, "d2h": dev.d2h.busy, "cpu": cpu_busy}
            workers = {"cpu": len(self.cpu.names)}
        else:
            ups = {d.h2d.name: d.h2d.busy for d in self.devices}
            downs = {d.d2h.name: d.d2h.busy for d in self.devices}
            busy = {
                "gpu": sum(d.gpu.busy for d in self.devices),
                "h2d": sum(ups.values()),
                "d2h": sum(downs.values()),
                "cpu": cpu_busy,
            }
            for d in self.devices:
                busy.setdefault(d.gpu.name, d.gpu.busy)
            for d in self.devices:
                for e in d.h2d.engines + d.d2h.engines:
                    busy.setdefault(e.name, e.busy)
            for group in self.peers.values():
                for e in group.engines:
                    busy.setdefault(e.name, e.busy)
            for name, b in zip(self.cpu.names, self.cpu.busy, strict=True):
                busy.setdefault(name, b)
            workers = {"cpu": len(self.cpu.names), "gpu": len(self.devices)}
        stats = RunStats(counters=c, e2e=e2e, busy=busy, workers=workers)
        stats.after, stats.servers = self._work_after(e2e)
        if self._tier is not None:
            mem = self.host_memory
            if mem is None:  # every expert fits in host memory: the drive is never read
                cfg = self._tier
                stats.host_tier = {
                    "ssd_bytes": 0, "ssd_reads": 0, "ssd_stall_s": 0.0, "host_evictions": 0,
                    "host_memory_peak_bytes": cfg.nonexpert_bytes + cfg.total * cfg.expert_bytes,
                    "host_memory_budget_bytes": cfg.budget_bytes,
                }  # fmt: skip
                busy["ssd"] = 0.0
            else:
                stats.host_tier = mem.totals()
                busy["ssd"] = mem.drive.busy
        return stats

    def _work_after(self, e2e: float) -> tuple[dict[str, float], dict[str, int]]:
        """Work after the run's end: each copy direction's lanes, the CPU workers and the
        drive (``RunStats.after``), a lane busy at the end staying busy until its last hold
        ends; and the lanes behind each copy direction."""
        ups = [e for g in {id(d.h2d): d.h2d for d in self.devices}.values() for e in g.engines]
        downs = [e for g in {id(d.d2h): d.d2h for d in self.devices}.values() for e in g.engines]
        after = {
            "h2d": sum(max(0.0, lane.free_at - e2e) for lane in ups),
            "d2h": sum(max(0.0, lane.free_at - e2e) for lane in downs),
            "cpu": sum(max(0.0, t - e2e) for t in self.cpu.free_at),
        }
        if self.host_memory is not None:
            after["ssd"] = max(0.0, self.host_memory.drive.free_at - e2e)
        return after, {"h2d": len(ups), "d2h": len(downs)}

    def multi_metrics(self) -> dict[str, Any]:
        """Per-GPU and per-peer-path figures for ``run --json`` (several GPUs)."""
        pl = self.placement
        assert pl is not None
        per = []
        for k, d in enumerate(self.devices):
            per.append(
                {
                    "gpu": k,
                    "busy_s": d.gpu.busy,
                    "slots": d.budget,
                    "max_slots_used": d.taken_max,
                    "expert_computations": d.experts,
                    "h2d_expert_bytes": d.h2d_bytes,
                    "d2h_expert_bytes": d.d2h_bytes,
                    "uplink": d.h2d.name,
                    "layers": pl.layers_of[k][:1] + pl.layers_of[k][-1:],
                    "experts_per_layer": len(pl.experts_of[k]),
                    "experts": list(pl.experts_of[k]),
                }
            )
        multi = self.costs.hw.multi
        assert multi is not None
        return {
            "gpus": pl.n,
            "mode": pl.mode,
            "expert_placement": pl.rule,
            "peer_kind": multi.peer_kind,
            "per_gpu": per,
            "peer_bytes": dict(sorted(self.peer_bytes.items())),
            "peer_bytes_total": sum(self.peer_bytes.values()),
        }

    # -- one forward pass -------------------------------------------------------------------
    def forward(self, r: SequenceRouting, prefill: bool, base: int = 0) -> Proc:
        """A sequence's prefill pass (every prompt token per layer) or its decode tokens, one
        forward pass each, layer by layer. ``base`` is added to decode token numbers."""
        v, hooks = self.view, self.hooks
        where = hooks.where
        sid = where.seq
        n_exp = self.n_experts
        p = r.n_prefill
        if prefill:
            v.phase, v.n_tokens, v.context = "prefill", p, 0
            v.position = int(r.positions[0])
            v.next_experts = v.next_probs = None
            hook, decide = "prefill_layer", self.policy.prefill_layer
            tokens: Iterable[int] = (0,)
        else:
            v.phase, v.n_tokens, v.counts = "decode", 1, None
            hook, decide = "decode_layer", self.policy.decode_layer
            full = r.prob_ids is not None
            # read-only views: a policy reads rows of these, and must not change the routing
            probs = frozen(r.full_probs(n_exp) if full else r.probs)
            early = frozen(r.full_probs(n_exp, early=True) if full else r.early_probs)
            ro_experts, ro_weights = frozen(r.experts), frozen(r.weights)
            ro_early = frozen(r.early_experts)
            mass = r.weights.sum(axis=2).tolist()  # true gate mass per token and layer
            tokens = range(p, r.n_tokens)
        n_cpu = self.n_cpu_layers
        # a long enough prompt runs the CPU layers on the GPU, their weights copied (op offload)
        cpu_run = 0 if (n_cpu and prefill and 0 < self.spec.cpu_layer_offload_batch <= p) else n_cpu
        for t in tokens:
            t0 = self.now
            where.token = v.token = t + base
            v.step = self.step
            n = p if prefill else 1
            context = 0 if prefill else int(r.positions[t])
            if not prefill:
                v.position = v.context = context
            d_ne = self.nonexpert_s(n, context)
            for layer in range(self.n_layers):
                now = yield from self.front(
                    layer, n, cpu_run, self.costs.cpu_nonexpert_layer_s, (n, context), d_ne,
                    (sid or 0, t + base), (n, context), layer == 0,
                )  # fmt: skip
                yield from self.until(now)  # the decision: the routing is known
                v.layer = where.layer = layer
                v.now = now
                counts = None
                if prefill:
                    counts = np.bincount(r.experts[:p, layer, :].reshape(-1), minlength=n_exp)
                    experts, counts = fill_layer_view(
                        v, counts, r.weights[:p, layer, :], r.prompt_probs(layer, n_exp)
                    )
                else:
                    experts = ro_experts[t][layer]
                    v.experts = experts
                    v.weights = ro_weights[t][layer]
                    v.probs = probs[t][layer]
                    nxt = layer + 1 < self.n_layers
                    v.next_experts = ro_early[t][layer + 1] if nxt else None
                    v.next_probs = early[t][layer + 1] if nxt else None
                plan = hooks.call(hook, decide, v)
                refused = "during prefill" if prefill else ""
                route = check_route(hooks, plan, n_exp, layer, refused)
                routed = experts.tolist() if route is None else route
                order = check_plan(hooks, plan, layer, routed, self.ledger, self.spec, self.precalc)
                if not prefill:
                    self._fidelity(plan, route, experts, r.weights[t][layer], mass[t][layer])
                lw = self.translate(plan, layer, order, routed, counts, now, prefill)
                self.now = yield from self.run_layer(lw)
            if self.streamed is not None:  # ZeRO-3: the output matrix after the last layer
                self.now = yield from self.streamed_weights(self.now, -1)
            self.step += 1
            self._end_pass(prefill, p, t0)

    def _end_pass(self, prefill: bool, p: int, t0: float) -> None:
        """A forward pass that began at ``t0`` is done: the prompt's ``p`` tokens counted, or
        a decode token's latency, with the pre-calculations none of its layers used wasted."""
        c = self.c
        if prefill:
            c.prefill_tokens += p
        else:
            # a pre-calculation is for a coming layer of the same token
            c.precalc_wasted += len(self.precalc)
            self.precalc.clear()
            lat = self.now - t0
            c.token_latency.append(lat)
            c.decode_time += lat
            c.decode_tokens += 1

    def _fidelity(
        self, plan: Plan, route: list[int] | None, true_e: np.ndarray, true_w: Any, mass: float
    ) -> None:
        """A decode layer's routing fidelity: gate mass kept, experts replaced (mispredicted
        or degraded), and the mass computed from low-precision copies."""
        c = self.c
        c.true_accesses += true_e.shape[0]
        c.gate_mass_total += mass
        if route is None:
            c.gate_mass_kept += mass
        else:
            used = set(route)
            raw = set(np.asarray(plan.raw_route).tolist()) if plan.raw_route is not None else set()
            for e, w in zip(true_e.tolist(), true_w.tolist(), strict=False):
                if e in used:
                    c.gate_mass_kept += w
                elif e in raw:
                    c.replaced_degraded += 1
                else:
                    c.replaced_mispredicted += 1
        if plan.low_bit:
            for e, w in zip(true_e.tolist(), true_w.tolist(), strict=False):
                if e in plan.low_bit:
                    c.gate_mass_low_bit += w

    # -- the non-expert part of a layer -------------------------------------------------------
    def front(
        self,
        layer: int,
        n: int,
        cpu_run: int,
        cpu_cost: Callable[..., float],
        cpu_args: tuple[int, int],
        d_ne: float,
        row: tuple[int, int],
        dram: tuple[int, int],
        first: bool,
    ) -> Proc:
        """A layer's part before its experts, from the end of the layer before; returns the
        decision time. On the CPU for a CPU-resident layer (``layer < cpu_run``); else on the
        layer's home GPU, after the CPU layers' weights, the hidden states at the split or
        ZeRO-3's streamed weights have landed where they apply. ``row`` is the (seq, token)
        the GPU part is recorded with; ``dram`` the (tokens, context) its DRAM share is costed
        at on unified memory."""
        c, rec = self.c, self.recorder
        where = self.hooks.where
        start = self.now
        here = self._cpu_layer_here = layer < cpu_run
        if here:  # the part runs on the first CPU worker; the hidden states are on the host
            d = cpu_cost(*cpu_args)
            self.cpu.occupy_first(start, d)
            c.cpu_nonexpert_busy += d
            if rec is not None:
                rec.op(self.cpu.names[0], "nonexpert", where.seq or 0, where.token or 0, layer,
                       -1, start, start + d, 0)  # fmt: skip
            return start + d
        if self.n_cpu_layers and layer < self.n_cpu_layers:  # op offload: weights first
            nbytes = self.costs.cpu_layer_weight_bytes
            start = yield from self._step_copy(
                layer, "weights", self.costs.cpu_layer_weights_h2d_s(), nbytes
            )
            c.cpu_layer_weight_copies += 1
        elif layer and layer == cpu_run:  # the split: the hidden states cross to the GPU
            start = yield from self._step_copy(
                layer, "activation", self.activation_s(n), self.act_bytes(n)
            )
        if self.streamed is not None:
            start = yield from self.streamed_weights(start, layer)
        lane = self.devices[self.home[layer]].gpu
        if self.thread is None:
            now = start + d_ne
        else:  # the runtime's thread issues the part's kernels, maybe waits for the routing
            end, now = self.thread.nonexpert(start, d_ne, first)
            if end - d_ne > start:
                c.dispatch_stall += end - d_ne - start
                start = end - d_ne
        if rec is not None:
            rec.op(lane.name, "nonexpert", row[0], row[1], layer, -1, start, start + d_ne, 0)
        c.gpu_nonexpert_busy += d_ne
        lane.busy += d_ne
        if self.unified:
            self.cpu.take_dram(start, d_ne, self.costs.gpu_dram_share(*dram))
        return now

    def _step_copy(self, layer: int, kind: str, seconds: float, nbytes: int) -> Proc:
        """A copy the step loop makes to the GPU before a layer's part (CPU-resident layers);
        returns when it lands."""
        where = self.hooks.where
        group = self.devices[0].h2d
        self.c.h2d_bytes += nbytes
        key = (self.env.now, next(self._issue))
        start, lane = yield from self._move([group], key, seconds, nbytes)
        lane.busy += seconds
        if self.recorder is not None:
            self.recorder.op(lane.name, kind, where.seq or 0, where.token or 0, layer, -1,
                             start, self.env.now, nbytes)  # fmt: skip
        return self.env.now

    def streamed_weights(self, start: float, layer: int) -> Proc:
        """ZeRO-3's streamed non-expert weights (ResourceSpec.nonexpert_streamed): the copies
        issued at ``start`` before ``layer``'s part (at layer 0 the input embedding too), or
        with ``layer`` -1 the output matrix after the last layer; returns when they landed."""
        assert self.streamed is not None
        (lb, ls), (eb, es) = self.streamed
        if layer < 0:
            items = [("embedding", eb, es, self.n_layers - 1)]
        elif layer == 0:
            items = [("embedding", eb, es, 0), ("weights", lb, ls, 0)]
        else:
            items = [("weights", lb, ls, layer)]
        where, c = self.hooks.where, self.c
        copies = []
        for kind, nbytes, seconds, at in items:
            if nbytes <= 0:
                continue
            op = Op(self.env, kind, next(self._issue), where.seq or 0, where.token or 0, at,
                    -1, 0)  # fmt: skip
            c.h2d_bytes += nbytes
            c.nonexpert_weight_copies += 1
            c.nonexpert_weight_bytes += nbytes
            self.env.process(self._weights_copy(op, start, seconds, nbytes))
            copies.append(op)
        if not copies:
            return start
        yield self.env.all_of([op.done for op in copies])
        return max(op.end for op in copies)  # type: ignore[type-var]

    def _weights_copy(self, op: Op, submitted: float, seconds: float, nbytes: int) -> Proc:
        yield from self.until(submitted)
        s, lane = yield from self._move([self.devices[0].h2d], (submitted, op.seq), seconds, nbytes)
        lane.busy += seconds
        self._row(lane.name, op, s, nbytes)
        self._finish(op)

    # -- a checked plan into operations -----------------------------------------------------
    def _op(self, kind: str, layer: int, expert: int, lw: LayerRun, device: int) -> Op:
        return Op(self.env, kind, next(self._issue), lw.sid, lw.token, layer, expert, device)

    def translate(
        self,
        plan: Plan,
        layer: int,
        order: list[int],
        routed: list[int],
        counts: np.ndarray | None,
        now: float,
        prefill: bool,
    ) -> LayerRun:
        """A checked plan as the operations it issues, in issue order (docs/policy-api.md):
        evictions, hits, demand copies (each after its victim's eviction), temporary copies,
        prefetches, CPU experts, pre-calculations."""
        where = self.hooks.where
        lw = LayerRun(now, layer, where.seq or 0, where.token or 0, counts)
        c, led = self.c, self.ledger
        actions = plan.actions
        if actions is None:
            needed = set(routed)
        else:
            needed = {e for e in routed if actions[e] in (GPU, FETCH)}
        for slot in plan.evict:
            self._evict(slot, needed, lw)
        temps: list[int] = []
        cpus: list[int] = []
        hits = 0
        for e in order:
            a = GPU if actions is None else actions[e]
            if a == GPU:
                if led.prefetched[layer, e]:  # a prefetched expert, used
                    led.prefetched[layer, e] = False
                    c.prefetch_used += 1
                hits += 1
                copy = led.copy.get((layer, e))
                lw.gpu.append((e, copy if copy is not None else 0.0))
            elif a == FETCH:
                op = self._fetch((layer, e), "fetch", plan.victims.get(e), needed, lw)
                c.fetches += 1
                if plan.low_bit and e in plan.low_bit:  # the low-bit copy into a slot
                    op.low = True
                    c.low_bit_copies += 1
                    c.h2d_bytes += self.low_bit_bytes - self.expert_bytes
                lw.gpu.append((e, op))
                lw.copied.add(e)
            elif a == TEMP:
                temps.append(e)
            elif a == CPU:
                cpus.append(e)
            else:  # PRECOMPUTED: a CPU result submitted by an earlier layer
                lw.results.append(self.precalc.pop((layer, e)))
        self._count_accesses(layer, len(routed), hits, prefill)
        self._temp_copies(plan, layer, temps, lw)
        for pl, pe, victim in plan.prefetch:
            slot = (int(pl), int(pe))
            self._fetch(slot, "prefetch", victim, needed, lw)
            led.prefetched[slot] = True
            c.prefetches += 1
        prev: Op | None = None
        for e in cpus:
            op = self._cpu_op(
                layer, e, int(counts[e]) if counts is not None else 1, "cpu_expert", lw
            )
            c.cpu_expert_evals += 1
            lw.cpu.append(op)
            lw.results.append(op)
            prev = self._enqueue_cpu(op, prev, plan.cpu_serial, lw)
        prev = None
        for pl, pe in plan.precalc:
            slot = (int(pl), int(pe))
            op = self._cpu_op(slot[0], slot[1], 1, "precalc", lw)
            c.cpu_precalc_evals += 1
            self.precalc[slot] = op
            prev = self._enqueue_cpu(op, prev, plan.cpu_serial, lw)
        lw.late = list(lw.deferred.values())
        lw.cpu_first = plan.cpu_first
        lw.barrier = plan.barrier
        if self.host_memory is not None:
            self._stage_reads(lw)
        return lw

    def _count_accesses(self, layer: int, accesses: int, hits: int, prefill: bool) -> None:
        """A layer's routed experts and how many were on the GPU, by phase (and per layer in
        decode, ``per_layer_hit_rate``)."""
        c = self.c
        if prefill:
            c.prefill_accesses += accesses
            c.prefill_hits += hits
        else:
            c.decode_accesses += accesses
            c.decode_hits += hits
            self._hits[layer] += hits
            self._accesses[layer] += accesses

    def _temp_copies(self, plan: Plan, layer: int, temps: list[int], lw: LayerRun) -> None:
        """The layer's temporary copies (into a buffer, dropped after the compute), at full or
        low bit width, each an operation the layer's GPU compute waits for."""
        c = self.c
        for e in temps:
            op = self._op("temp", layer, e, lw, self.gpu_of[layer][e])
            c.temp_copies += 1
            c.h2d_expert_copies += 1
            if plan.low_bit and e in plan.low_bit:
                op.low = True
                c.low_bit_copies += 1
                c.h2d_bytes += self.low_bit_bytes
            else:
                c.h2d_bytes += self.expert_bytes
            lw.ops.append(op)
            lw.gpu.append((e, op))
            lw.copied.add(e)

    def _enqueue_cpu(self, op: Op, prev: Op | None, serial: bool, lw: LayerRun) -> Op:
        """A serial task runs its calls one after another: chained to the previous one."""
        if serial and prev is not None:
            prev.chain = op
        else:
            lw.ops.append(op)
        return op

    def _evict(self, slot: Any, needed: set[int], lw: LayerRun) -> None:
        """The expert leaves its slot; with write-back the slot is held until its copy to the
        host ends, and an expert this layer still uses is written back after its compute.
        A copy into the slot still in flight goes on (a DMA is not cancelled) but no longer
        lands a resident expert; the write-back, or the slot's release, waits for it."""
        led, c = self.ledger, self.c
        vl, ve = int(slot[0]), int(slot[1])
        led.resident[vl, ve] = False
        led.n_resident -= 1
        c.evictions += 1
        landing = None
        if led.ready_at[vl, ve] > lw.now:  # its copy has not landed
            led.ready_at[vl, ve] = INF
            landing = led.copy.pop((vl, ve))
            c.evictions_in_flight += 1
        if vl == lw.layer and ve in needed:
            wb = self._writeback_op(vl, ve, lw)
            wb.warm = True  # after this layer's computation of it
            lw.deferred[ve] = wb
            return
        if led.prefetched[vl, ve]:  # prefetched, never used
            led.prefetched[vl, ve] = False
            c.prefetch_wasted_bytes += self.expert_bytes
        dev = self.devices[self.gpu_of[vl][ve]]
        if self.spec.writeback:
            op = self._writeback_op(vl, ve, lw)
            op.landing = landing
            lw.ops.append(op)
        elif landing is None:
            dev.slots.give_back()
        else:
            self.env.process(self._release_after(landing, dev))

    def _release_after(self, copy: Op, dev: Device) -> Proc:
        """An expert evicted while its copy was in flight: its slot is free once it lands."""
        yield copy.done
        dev.slots.give_back()

    def _writeback_op(self, layer: int, expert: int, lw: LayerRun) -> Op:
        self.c.d2h_bytes += self.expert_bytes
        self.c.d2h_expert_copies += 1
        return self._op("writeback", layer, expert, lw, self.gpu_of[layer][expert])

    def _fetch(self, slot: Slot, kind: str, victim: Any, needed: set[int], lw: LayerRun) -> Op:
        warm = False
        if victim is not None:
            warm = int(victim[0]) == lw.layer and int(victim[1]) in needed
            self._evict(victim, needed, lw)
        op = self._op(kind, slot[0], slot[1], lw, self.gpu_of[slot[0]][slot[1]])
        op.warm = warm
        led = self.ledger
        led.resident[slot] = True
        led.ready_at[slot] = INF
        led.copy[slot] = op
        led.n_resident += 1
        self.c.h2d_bytes += self.expert_bytes
        self.c.h2d_expert_copies += 1
        lw.ops.append(op)
        return op

    def _cpu_op(self, layer: int, expert: int, n: int, kind: str, lw: LayerRun) -> Op:
        op = self._op(kind, layer, expert, lw, self.home[layer])
        op.n = n
        if self._cpu_layer_here:  # a CPU-resident layer: the hidden states are on the host
            op.local = True
        else:
            self.c.d2h_bytes += self.act_bytes(n)
            self.c.h2d_bytes += self.act_bytes(n)
        return op

    def _stage_reads(self, lw: LayerRun) -> None:
        """The SSD tier: every operation reading an expert's host copy gets the read it waits
        for (issued now, in issue order); write-backs leave host copies. The layer's SSD stall
        runs from the decision until its last routed expert is readable."""
        mem = self.host_memory
        assert mem is not None
        routed_reads = []
        for head in lw.ops:
            op: Op | None = head
            while op is not None:
                if op.kind == "writeback":
                    mem.written_back(op)
                else:
                    op.read, op.gds = mem.need(op, op.kind in ("fetch", "prefetch", "temp"))
                    if op.read is not None and op.kind not in ("prefetch", "precalc"):
                        routed_reads.append(op.read)
                op = op.chain
        for op in lw.deferred.values():
            mem.written_back(op)
        if routed_reads:
            self.env.process(self._ssd_stall(lw.now, routed_reads))

    def _ssd_stall(self, now: float, reads: list[simpy.Event]) -> Proc:
        yield self.env.all_of(reads)
        assert self.host_memory is not None
        self.host_memory.stall += self.env.now - now

    # -- operations as processes ------------------------------------------------------------
    def _finish(self, op: Op) -> None:
        op.end = self.env.now
        op.done.succeed()

    def _row(self, lane: str, op: Op, start: float, nbytes: int, kind: str | None = None) -> None:
        if self.recorder is not None:
            self.recorder.op(lane, kind or op.kind, op.sid, op.token, op.layer, op.expert,
                             start, self.env.now, nbytes)  # fmt: skip

    def _move(self, groups: list[Engines], key: Any, seconds: float, nbytes: int) -> Proc:
        """Hold an engine of each of ``groups`` (requested together with ``key``) for a copy
        of ``nbytes`` taking ``seconds``; on unified memory the copy takes its share of the
        DRAM. Returns its start and the first group's engine."""
        env = self.env
        grants = [group.request(key, seconds) for group in groups]
        yield grants[0] if len(grants) == 1 else env.all_of(grants)
        held = [g.value for g in grants]
        start = env.now
        if self.unified:
            self.cpu.take_dram(start, seconds, self.costs.copy_dram_share(nbytes, seconds))
        yield env.timeout(seconds)
        for group, engine in zip(groups, held, strict=True):
            group.release(engine)
        return start, held[0]

    def _process(self, op: Op) -> Proc:
        if op.kind == "writeback":
            return self._write_back(op)
        if op.kind in SLOT_COPIES:
            return self._copy_in(op)
        if op.kind == "temp":
            return self._temp_in(op)
        return self._cpu_task(op)

    def _wait_read(self, op: Op) -> Proc:
        if op.read is not None and not op.read.processed:
            yield op.read

    def _write_back(self, op: Op) -> Proc:
        """An evicted expert back to the host, issued on the loads' stream: it holds the H2D
        and the D2H lane together; its slot is free when it ends."""
        env = self.env
        dev = self.devices[op.device]
        if op.landing is not None and not op.landing.done.processed:
            yield op.landing.done  # evicted while its copy was in flight: after that copy
        d = self.d2h_warm_s if op.warm else self.d2h_s
        # the D2H engine does the copy; with one engine for both directions it is that one
        groups = [dev.d2h] if dev.h2d is dev.d2h else [dev.d2h, dev.h2d]
        s, engine = yield from self._move(groups, (env.now, op.seq), d, self.expert_bytes)
        engine.busy += d
        dev.d2h_bytes += self.expert_bytes
        self._row(engine.name, op, s, self.expert_bytes)
        self._finish(op)
        dev.slots.give_back()

    def _copy_in(self, op: Op) -> Proc:
        """A copy into a slot: its weights readable (SSD tier), a slot, then the H2D lane."""
        env = self.env
        yield from self._wait_read(op)
        dev = self.devices[op.device]
        got = dev.slots.take((env.now, op.seq))
        if not got.triggered:  # every slot is held: wait for a write-back to end
            yield got
        slot = (op.layer, op.expert)
        # a copy whose expert was evicted while it was in flight lands nothing resident
        if op.gds:  # GPUDirect Storage: the drive wrote the slot already
            if self.ledger.copy.get(slot) is op:
                self.ledger.ready_at[slot] = env.now
            self._finish(op)
            return
        # a slot of the low-bit copy's size holds that copy (ResourceSpec.low_bit_slots)
        # into the slot of an expert this layer computed: the measured warm copy
        full = self.h2d_warm_s if op.warm else self.h2d_s
        seconds, nbytes = (
            (self.low_bit_s, self.low_bit_bytes) if op.low else (full, self.expert_bytes)
        )
        group = dev.h2d
        lane = yield group.request((env.now, op.seq), seconds)
        s = env.now
        if self.ledger.copy.get(slot) is op:
            self.ledger.ready_at[slot] = s + seconds
        if self.unified:
            self.cpu.take_dram(s, seconds, self.costs.copy_dram_share(nbytes, seconds))
        yield env.timeout(seconds)
        group.release(lane)
        lane.busy += seconds
        dev.h2d_bytes += nbytes
        self._row(lane.name, op, s, nbytes)
        self._finish(op)

    def _temp_in(self, op: Op) -> Proc:
        """A copy into a temporary buffer: a buffer, its weights readable, the H2D lane."""
        env = self.env
        dev = self.devices[op.device]
        got = dev.buffers.take((env.now, op.seq))
        if not got.triggered:  # every buffer is in use: wait for a computation to end
            yield got
        yield from self._wait_read(op)
        if op.gds:
            self._finish(op)
            return
        # into the slot of an expert this layer computed: the measured warm copy
        full = self.h2d_warm_s if op.warm else self.h2d_s
        seconds, nbytes = (
            (self.low_bit_s, self.low_bit_bytes) if op.low else (full, self.expert_bytes)
        )
        s, lane = yield from self._move([dev.h2d], (env.now, op.seq), seconds, nbytes)
        lane.busy += seconds
        dev.h2d_bytes += nbytes
        self._row(lane.name, op, s, nbytes)
        self._finish(op)

    def _cpu_task(self, head: Op) -> Proc:
        """CPU calls one after another: each its activations to the host, a worker of the
        shared CPU, its result back (none of the copies for a CPU-resident layer)."""
        env = self.env
        op: Op | None = head
        while op is not None:
            yield from self._wait_read(op)
            dev = self.devices[op.device]
            n = op.n
            act = self.act_bytes(n)
            if not op.local:
                s, lane = yield from self._move([dev.d2h], (env.now, op.seq), self.activation_s(n),
                                                act)  # fmt: skip
                lane.busy += self.activation_s(n)
                self._row(lane.name, op, s, act, "activation")
            call = yield from self.cpu.call(
                (env.now, op.seq), self.cpu_s(n), self.cpu_share(n), self.cpu_dram(n)
            )
            if self.recorder is not None:
                self.recorder.op(self.cpu.names[call.worker], op.kind, op.sid, op.token,
                                 op.layer, op.expert, call.start, call.end, 0)  # fmt: skip
            if not op.local:
                s, lane = yield from self._move([dev.h2d], (env.now, op.seq), self.activation_s(n),
                                                act)  # fmt: skip
                lane.busy += self.activation_s(n)
                self._row(lane.name, op, s, act, "activation")
            self._finish(op)
            op = op.chain

    def _transfer(self, op: Op) -> Proc:
        """Hidden states from GPU ``op.src`` to GPU ``op.dst``: over a direct peer lane, or out
        through host memory on the sender's uplink and in on the receiver's."""
        env = self.env
        nbytes = self.act_bytes(op.n)
        direct = self.peers.get((op.src, op.dst))
        if direct is not None:
            legs = [(direct, self.peer_s(op.n))]
        else:
            legs = [(self.devices[op.src].d2h, self.activation_s(op.n)),
                    (self.devices[op.dst].h2d, self.activation_s(op.n))]  # fmt: skip
        for group, seconds in legs:
            s, lane = yield from self._move([group], (env.now, op.seq), seconds, 0)
            lane.busy += seconds
            self._row(lane.name, op, s, nbytes)
            self.peer_bytes[group.name] = self.peer_bytes.get(group.name, 0) + nbytes
        self._finish(op)

    # -- one layer's GPU work ---------------------------------------------------------------
    def run_layer(self, lw: LayerRun) -> Proc:
        """Submit the layer's operations, run its GPU experts stream by stream, and return when
        the layer ends: its last GPU expert (results back on the home GPU) and its last CPU
        result. Background work goes on."""
        env, c = self.env, self.c
        now, layer = lw.now, lw.layer
        for op in lw.ops:
            env.process(self._process(op))
        home = self.home[layer]
        st = Streams(env, len(self.devices), now)
        per: dict[int, list[tuple[int, Op | float]]] = {}
        for e, src in lw.gpu:
            per.setdefault(self.gpu_of[layer][e], []).append((e, src))
        # several GPUs: the activations go to every other GPU computing a routed expert
        sends: dict[int, tuple[Op, Op]] = {}
        for k in sorted(per):
            if k != home:
                n = self._peer_tokens(lw, [e for e, _ in per[k]])
                send, back = self._peer_op(lw, home, k, n), self._peer_op(lw, k, home, n)
                sends[k] = (send, back)
                env.process(self._transfer(send))
        gate = None
        if lw.cpu_first and lw.cpu:  # the GPU experts start once the CPU experts are back
            gate = env.all_of([op.done for op in lw.cpu])
        for k in {home, *per}:
            env.process(self._open_stream(st, k, now, sends.get(k, (None,))[0], gate, lw))
        barrier = None
        if lw.barrier:  # a gather: every copy into this layer's slots lands first
            barrier = env.all_of(
                [op.done for op in lw.ops if op.kind in SLOT_COPIES and op.layer == layer]
            )
        procs: dict[int, list[simpy.Process]] = {}
        for k, jobs in per.items():
            procs[k] = [env.process(self._expert(lw, st, k, e, src, barrier)) for e, src in jobs]
        for k, (_, back) in sends.items():
            env.process(self._results_back(back, procs[k]))
        if gate is not None:
            yield gate
            sync_end = max(op.end for op in lw.cpu)  # type: ignore[type-var]
            if sync_end > now:
                c.cpu_wait += sync_end - now
        if not st.opened[home].processed:
            yield st.opened[home]
        everything = [p for ps in procs.values() for p in ps]
        if everything:
            yield env.all_of(everything)
        g = st.free[home]
        for _, back in sends.values():
            if back.end is None:
                yield back.done
            g = max(g, back.end)  # type: ignore[type-var]
        if self.spec.one_stream:
            g = yield from self._stream_drained(lw, g)
        end = g
        pending = [op.done for op in lw.results if op.end is None]
        if pending:
            yield env.all_of(pending)
        for op in lw.results:
            end = max(end, op.end)  # type: ignore[type-var]
        if end > g:
            c.cpu_wait += end - g
        c.gpu_expert_busy += st.busy
        if layer + 1 < self.n_layers and self.home[layer + 1] != home:
            # pipeline: the hidden state crosses to the next stage's GPU
            n = 1 if lw.counts is None else max(1, int(lw.counts.sum()) // self.model.top_k)
            cross = self._peer_op(lw, home, self.home[layer + 1], n)
            yield from self.until(end)
            env.process(self._transfer(cross))
            yield cross.done
            end = cross.end  # type: ignore[assignment]
        yield from self.until(end)
        return end

    def _peer_op(self, lw: LayerRun, src: int, dst: int, n: int) -> Op:
        op = Op(self.env, "peer", next(self._issue), lw.sid, lw.token, lw.layer, -1, src)
        op.src, op.dst, op.n = src, dst, n
        return op

    def _peer_tokens(self, lw: LayerRun, experts: list[int]) -> int:
        """Tokens whose hidden states go to a GPU computing ``experts``: every token that
        chose one of them, at most the tokens of the step (docs/serving.md)."""
        if lw.counts is None:
            return 1
        tokens = int(lw.counts.sum()) // self.model.top_k
        return max(1, min(tokens, sum(int(lw.counts[e]) for e in experts)))

    def _open_stream(
        self,
        st: Streams,
        k: int,
        now: float,
        send: Op | None,
        gate: simpy.Event | None,
        lw: LayerRun,
    ) -> Proc:
        """GPU ``k``'s stream opens for the layer's experts once the activations are there
        and, with ``cpu_first``, once the CPU experts are back."""
        start = now
        if send is not None:
            if send.end is None:
                yield send.done
            start = max(start, send.end)  # type: ignore[type-var]
        if gate is not None:
            if not gate.processed:
                yield gate
            start = max([start] + [op.end for op in lw.cpu])  # type: ignore[type-var]
        st.free[k] = start
        st.opened[k].succeed()

    def _results_back(self, back: Op, procs: list[simpy.Process]) -> Proc:
        yield self.env.all_of(procs)
        yield from self._transfer(back)

    def _expert(
        self,
        lw: LayerRun,
        st: Streams,
        k: int,
        e: int,
        src: Op | float,
        barrier: simpy.Event | None,
    ) -> Proc:
        """One GPU expert on GPU ``k``'s stream. Its weights are ready when its copy lands
        (at least the gather barrier); it then requests the stream with key (ready, expert)
        and holds it while the runtime's thread issues its kernels and they run."""
        env, c = self.env, self.c
        if isinstance(src, Op):
            if src.end is None:
                yield src.done
            ready = src.end
        else:
            ready = src
        assert ready is not None
        if barrier is not None:
            if not barrier.processed:
                yield barrier
            for op in lw.ops:
                if op.kind in SLOT_COPIES and op.layer == lw.layer:
                    ready = max(ready, op.end)  # type: ignore[type-var]
        if not st.opened[k].processed:
            yield st.opened[k]
        yield from self.until(ready)
        dev = self.devices[k]
        yield dev.gpu.request((ready, e))
        copy_engines: list[tuple[Engines, Any]] = []
        if self.spec.one_stream:
            # one stream (one engine per direction): the kernel runs after every copy
            # submitted by now, and no copy runs beside it
            grants = [(g, g.request((env.now, INF))) for g in dev.copy_lanes]
            yield env.all_of([ev for _, ev in grants])
            copy_engines = [(g, ev.value) for g, ev in grants]
        s = env.now
        drained = st.free[k]
        if s > drained:
            c.transfer_stall += s - drained
        n = int(lw.counts[e]) if lw.counts is not None else 1
        d = self.gpu_copied_s(n) if e in lw.copied else self.gpu_s(n)
        if st.unfused[k]:  # the layer's fused MoE call is charged with the stream's first
            d += self.fused_launch_s
            st.unfused[k] = False
        if dev.thread is not None:
            wait = dev.thread.expert(drained, s, d) - d - s
            if wait > 0.0:  # the stream waits for the thread to issue the kernels
                c.dispatch_stall += wait
                yield env.timeout(wait)
                s = env.now
        if self.unified:
            self.cpu.take_dram(s, d, self.costs.gpu_dram_share(n))
        yield env.timeout(d)
        st.free[k] = env.now
        st.busy += d
        dev.gpu.busy += d
        dev.experts += 1
        dev.gpu.release()
        for group, engine in copy_engines:
            group.release(engine)
        if self.recorder is not None:
            self.recorder.op(dev.gpu.name, "expert", lw.sid, lw.token, lw.layer, e, s, env.now, 0)
        wb = lw.deferred.pop(e, None)
        if wb is not None:  # evicted while in use: written back after its computation
            env.process(self._write_back(wb))
        if isinstance(src, Op) and src.kind == "temp":
            dev.buffers.give_back()

    def _stream_drained(self, lw: LayerRun, g: float) -> Proc:
        """One stream (ResourceSpec.one_stream): the layer ends once every copy it issued has
        ended, its in-use victims' write-backs included; the wait is a transfer stall."""
        copies = [op for op in lw.ops if op.kind not in ("cpu_expert", "precalc")] + lw.late
        pending = [op.done for op in copies if op.end is None]
        if pending:
            yield self.env.all_of(pending)
        last = max([g] + [op.end for op in copies])  # type: ignore[type-var]
        if last > g:
            self.c.transfer_stall += last - g
        return last
