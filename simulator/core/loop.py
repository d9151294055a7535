"""The step loop: sequences into forward passes, passes into layers, layers into decisions.

Every forward pass is a :class:`Step` (a sequence's prefill, one decode token, or, from
``daopsim.simulator.serving``, a batch): layer by layer, the non-expert part runs (on the GPU, or on
the CPU for a CPU-resident layer), everything submitted before the routing is known is
served, the policy decides from a :class:`~daopsim.policies.base.View`
(``daopsim.simulator.boundary`` calls the hook and checks the plan), the plan becomes operations
(``daopsim.simulator.core.apply``) and the executor times them
(``daopsim.simulator.core.executor``); the layer ends when its last result is in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import _LAZY, Plan, Policy, SetupContext, View
from daopsim.simulator.boundary import (
    Hooks,
    check_placement,
    check_plan,
    check_route,
    fill_layer_view,
    frozen,
)
from daopsim.simulator.core.apply import Applier
from daopsim.simulator.core.executor import Executor
from daopsim.simulator.core.machine import Machine
from daopsim.simulator.core.ops import Counters
from daopsim.simulator.core.resources import Residency
from daopsim.simulator.runstats import RunStats, multi_metrics, run_stats


def cpu_layers_for(spec: Any, model: Any, budget: int) -> int:
    """Leading MoE layers a spec runs wholly on the CPU when the run did not size them from
    memory (the runner does, ``daopsim.simulator.fit.cpu_resident_layers``): N GPU blocks leave
    ``moe_layers - N``; -1 leaves the fewest whose GPU layers' experts fit ``budget``."""
    g = spec.gpu_blocks
    n_layers: int = model.moe_layers
    if g is None:
        return 0
    if g >= 0:
        return n_layers - min(n_layers, g)
    return max(0, n_layers - budget // model.experts)


@mypyc_attr(allow_interpreted_subclasses=True)  # serving's batched steps subclass it
class Step:
    """One forward pass through every layer: what its non-expert parts cost, what each
    layer's view holds, and how its decisions are counted.

    ``n``/``context`` size the non-expert part (``d_ne`` GPU seconds a layer, ``d_cpu`` on
    the CPU for a CPU-resident layer, negative: the machine's memoised cost); the first
    ``n_cpu_run`` layers run on the CPU. Labels (sequence, token) name the step's rows in
    the timeline: ``nonexpert_ids`` its non-expert parts and weight copies, ``op_ids`` its
    operations; ``decision_ids`` is where its decisions' errors point (and the view's token).
    ``dram_key`` (tokens, context) sizes the non-expert part's DRAM share on unified memory.
    """

    prefill = False
    hook = "decode_layer"
    #: where a substituted route is refused (``check_route``): every step but a sequence's
    #: decode token
    no_route = "during prefill"

    def __init__(self, n: int, context: int, d_ne: float) -> None:
        self.n = n
        self.context = context
        self.d_ne = d_ne
        self.d_cpu = -1.0
        self.n_cpu_run = 0
        self.dram_key = (n, context)
        self.nonexpert_ids = self.op_ids = self.decision_ids = (0, 0)

    def begin(self, eng: Engine) -> None:
        """Set the view's step-wide fields."""

    def enter(self, eng: Engine, layer: int) -> tuple[np.ndarray, Any]:
        """Fill the view for ``layer``; returns its routed experts and per-expert counts."""
        raise NotImplementedError

    def account(
        self, eng: Engine, plan: Plan, route: list[int] | None, experts: list[int], layer: int
    ) -> None:
        """Count the routing the layer's plan kept (decode steps); ``experts`` is the trace's
        routing of the layer."""

    def finish(self, eng: Engine, t0: float) -> None:
        """Bookkeeping once every layer has run (the step started at ``t0``)."""


class PrefillStep(Step):
    """A sequence's prompt in one pass: each layer runs the union of its tokens' experts."""

    prefill = True
    hook = "prefill_layer"

    def __init__(self, eng: Engine, r: Any, base: int) -> None:
        p = r.n_prefill
        super().__init__(p, 0, eng.machine.nonexpert_s(p, 0))
        self.r = r
        offload = eng.n_cpu_layers and 0 < eng.spec.cpu_layer_offload_batch <= p
        self.n_cpu_run = 0 if offload else eng.n_cpu_layers
        self.nonexpert_ids = self.op_ids = self.decision_ids = (eng.hooks.where.seq or 0, base)

    def begin(self, eng: Engine) -> None:
        v = eng.view
        v.phase = "prefill"
        v.n_tokens = self.n
        v.context = 0
        v.position = int(self.r.positions[0])
        v.next_experts = v.next_probs = None

    def enter(self, eng: Engine, layer: int) -> tuple[np.ndarray, Any]:
        r, p = self.r, self.n
        counts = np.bincount(r.experts[:p, layer, :].reshape(-1), minlength=eng.n_experts)
        probs = r.prompt_probs(layer, eng.n_experts)
        return fill_layer_view(eng.view, counts, r.weights[:p, layer, :], probs)  # type: ignore[no-any-return]

    def finish(self, eng: Engine, t0: float) -> None:
        eng.c.prefill_tokens += self.n


class DecodePass:
    """A sequence's decode rows, prepared once: dense probabilities and gate-weight sums."""

    def __init__(self, r: Any, n_experts: int) -> None:
        self.r = r
        full = r.prob_ids is not None
        # read-only views: a policy reads rows of these, and must not change the routing
        self.probs = frozen(r.full_probs(n_experts) if full else r.probs)
        self.eprobs = frozen(r.full_probs(n_experts, early=True) if full else r.early_probs)
        self.experts = frozen(r.experts)
        self.weights = frozen(r.weights)
        self.early = frozen(r.early_experts)
        #: the true gate mass of each token-layer
        self.wsums: list[list[float]] = r.weights.sum(axis=2).tolist()


class DecodeStep(Step):
    """One generated token of one sequence."""

    no_route = ""

    def __init__(self, eng: Engine, dp: DecodePass, t: int, base: int) -> None:
        context = int(dp.r.positions[t])
        super().__init__(1, context, eng.machine.nonexpert_s(1, context))
        self.dp, self.t = dp, t
        self.n_cpu_run = eng.n_cpu_layers
        ids = (eng.hooks.where.seq or 0, t + base)
        self.nonexpert_ids = self.op_ids = self.decision_ids = ids
        self.experts_t = dp.experts[t]
        self.weights_t = dp.weights[t]
        self.weights_l: list[list[float]] | None = None  # the same as lists, made once
        self.wsums_t = dp.wsums[t]

    def begin(self, eng: Engine) -> None:
        v, dp, t = eng.view, self.dp, self.t
        v.phase = "decode"
        v.n_tokens = 1
        v.counts = None
        v.position = v.context = self.context
        # the rows a policy may read, built into arrays only when it reads them (View)
        v._rows = (self.weights_t, dp.probs[t], dp.early[t], dp.eprobs[t])

    def enter(self, eng: Engine, layer: int) -> tuple[np.ndarray, Any]:
        v = eng.view
        experts = self.experts_t[layer]
        v.experts = experts
        v._weights = v._probs = v._next_experts = v._next_probs = _LAZY
        return experts, None

    def account(
        self, eng: Engine, plan: Plan, route: list[int] | None, experts: list[int], layer: int
    ) -> None:
        c = eng.c
        ws = self.wsums_t[layer]
        c.true_accesses += len(experts)
        c.gate_mass_total += ws
        if route is None:
            c.gate_mass_kept += ws
        else:  # how much of the true routing the substituted route kept or replaced
            used = set(route)
            raw: set[int] | None = None  # built at the first replaced expert
            for e, w in zip(experts, self._weights(layer), strict=False):
                if e in used:
                    c.gate_mass_kept += w
                    continue
                if raw is None:
                    r = plan.raw_route
                    raw = set() if r is None else set(np.asarray(r).tolist())
                if e in raw:
                    c.replaced_degraded += 1
                else:
                    c.replaced_mispredicted += 1
        if plan.low_bit:  # the true gate weight of experts computed from a low-bit copy
            for e, w in zip(experts, self._weights(layer), strict=False):
                if e in plan.low_bit:
                    c.gate_mass_low_bit += w

    def _weights(self, layer: int) -> list[float]:
        """The token's true gate weights of ``layer``."""
        if self.weights_l is None:
            self.weights_l = self.weights_t.tolist()
        return self.weights_l[layer]

    def finish(self, eng: Engine, t0: float) -> None:
        eng.discard_precalc()
        eng.c.decoded(eng.now - t0)


class Engine:
    """Replays sequences through one host under one policy (docs/architecture.md).

    ``placement`` and ``budgets`` (several GPUs, ``daopsim.simulator.multigpu``): which GPU holds
    each expert and runs each layer's non-expert part, and each GPU's slot budget.
    """

    def __init__(
        self,
        policy: Policy,
        model: Any,
        costs: Any,
        budget: int,
        calibration: np.ndarray | None = None,
        calibration_prefill: np.ndarray | None = None,
        oracle: Any = None,
        recorder: Any = None,
        seed: int = 0,
        runtime: Any = None,
        calibration_sequences: tuple[np.ndarray, ...] | None = None,
        host_tier: Any = None,
        cpu_layers: int | None = None,
        placement: Any = None,
        budgets: list[int] | None = None,
    ) -> None:
        self.policy = policy
        self.hooks = Hooks(policy)
        self.spec = spec = self.hooks.call("resources", policy.resources)
        self.model, self.costs, self.recorder = model, costs, recorder
        self.budget = int(budget)
        self.n_layers, self.n_experts = model.moe_layers, model.experts
        self.placement = placement
        self.machine = m = Machine(costs, spec, runtime, placement)
        caps = [int(b) + spec.staging_buffers for b in (budgets or [self.budget])]
        self.res = Residency(self.n_layers, self.n_experts, self.budget, caps, recorder)
        self.c = Counters()
        self.ex = Executor(m, self.res, self.c, recorder, spec.one_stream)
        self.now = 0.0
        self.step = 0
        #: a ``daopsim.simulator.serving.Serving`` when requests are batched (set by the runner)
        self.serving: Any = None
        self.view = v = View()
        v.model, v.costs, v.budget = model, costs, self.budget
        v.calibration = calibration = frozen(calibration)
        v.resident = self.res.resident.view()
        v.resident.flags.writeable = False
        # in-flight copies and their landing times, the lanes they queue on
        v.ready = self.res.ready_at.view()
        v.ready.flags.writeable = False
        v._copy_free_times = self._copy_free_times
        v._copy_seconds = [up.expert_s for up, _ in m.uplinks]
        self.ssd_cfg, ssd = host_tier, None
        if host_tier is not None:
            from daopsim.simulator.hosttier import HostTier

            tier = HostTier(host_tier, costs, self.n_layers, self.n_experts, spec.ssd_access,
                            recorder)  # fmt: skip
            v.host_resident = tier.host.view()
            v.host_resident.flags.writeable = False
            tier.lanes = self.ex.lanes
            if host_tier.uses_ssd:
                ssd = tier
                m.drives[tier.lane.name] = tier.lane
        self.ssd = ssd
        self.applier = Applier(self.ex, self.n_layers, spec.writeback, ssd)
        # views of the state (tests and tools read these): when each resident expert's copy
        # ends (inf while not started), the residency mask, the CPU pre-calculations submitted
        # and not consumed yet
        self.ready_at, self.resident = self.res.ready_at, self.res.resident
        self.precalc = self.applier.precalc
        if cpu_layers is None:
            cpu_layers = cpu_layers_for(spec, model, self.budget)
        #: leading MoE layers run wholly on the CPU (ResourceSpec.gpu_blocks, resolved)
        self.n_cpu_layers = cpu_layers
        ctx = SetupContext(
            model=model, budget=self.budget, costs=costs, calibration=calibration,
            calibration_prefill=frozen(calibration_prefill),
            oracle=oracle if policy.clairvoyant else None, seed=seed,
            calibration_sequences=calibration_sequences, cpu_layers=cpu_layers,
        )  # fmt: skip
        placed = self.hooks.call("setup", policy.setup, ctx)
        slots = check_placement(self.hooks, placed, self.n_layers, self.n_experts, self.budget)
        self.res.place(slots, m.gpu_of)

    def _copy_free_times(self, k: int) -> list[float]:
        """When each of GPU ``k``'s host-to-device engines ends the work submitted so far
        (View.copy_free): every request submitted up to the decision has been served, so
        each engine's free time."""
        return [lane.free_at for lane in self.machine.uplinks[k][0].engines.lanes]

    # -- the run -----------------------------------------------------------------------------
    def run(
        self, sequences: Iterable[Any], on_sequence: Callable[[Any], None] | None = None
    ) -> RunStats:
        """Simulate the sequences (or the serving plan's requests); returns the statistics."""
        if self.serving is not None:  # batched or continuous serving: its schedule of steps
            self.serving.run(self, on_sequence)
        else:
            for r in sequences:
                self.sequence(r, on_sequence)
        e2e = self.now
        self.ex.drain()  # background work still running when the last token is out
        return run_stats(self, e2e)

    def multi_metrics(self) -> dict[str, Any]:
        """Per-GPU and per-peer-path figures of a run on several GPUs (``run --json``)."""
        return multi_metrics(self)

    def sequence(self, r: Any, on_sequence: Callable[[Any], None] | None) -> None:
        """A sequence on its own: its prefill pass, then one step per decode token."""
        sid = int(r.seq_id)
        self.start_sequence(sid, r.n_prefill)
        t0 = self.now
        if r.n_prefill:
            self.forward(PrefillStep(self, r, 0))
        self.c.first_token(self.now - t0)
        self.decode(r)
        self.end_sequence(sid, on_sequence, r)

    def start_sequence(self, sid: int, n_prefill: int) -> None:
        """The policy learns that sequence ``sid`` starts (``n_prefill`` prompt tokens)."""
        where = self.hooks.where
        where.seq, where.token, where.layer = sid, None, None
        self.view.seq_id = sid
        self.hooks.call("on_sequence_start", self.policy.on_sequence_start, sid, n_prefill)

    def end_sequence(self, sid: int, on_sequence: Callable[[Any], None] | None, r: Any) -> None:
        """The policy learns that sequence ``sid`` ended; its pre-calculations are wasted."""
        self.hooks.where.seq, self.hooks.where.token = sid, None
        self.hooks.call("on_sequence_end", self.policy.on_sequence_end, sid)
        self.discard_precalc()
        self.c.sequences += 1
        if on_sequence is not None:
            on_sequence(r)

    def decode(self, r: Any, base: int = 0) -> None:
        """The decode tokens of ``r``, one step each (``base`` is added to token numbers)."""
        dp = DecodePass(r, self.n_experts)
        for t in range(r.n_prefill, r.n_tokens):
            self.forward(DecodeStep(self, dp, t, base))

    def prefill(self, r: Any) -> None:
        """The prompt of ``r`` in one step."""
        self.forward(PrefillStep(self, r, 0))

    def idle_until(self, t: float) -> None:
        """Nothing to run until ``t`` (serving: the next arrival); the clock moves there."""
        self.now = t
        self.ex.advance(t)

    def discard_precalc(self) -> None:
        """A token ended: pre-calculations of it nobody consumed are wasted."""
        if self.precalc:
            self.c.precalc_wasted += len(self.precalc)
            self.precalc.clear()

    def forward(self, st: Step) -> None:
        """One forward pass through every layer."""
        t0 = self.now
        self.hooks.where.seq, self.hooks.where.token = st.decision_ids
        self.view.token = st.decision_ids[1]
        self.view.step = self.step
        st.begin(self)
        decide = getattr(self.policy, st.hook)  # the hook deciding the step's layers
        for layer in range(self.n_layers):
            now = self._nonexpert(st, layer)
            self.ex.advance(now)  # serve everything submitted before the decision
            self._decide(st, decide, layer, now)
        if self.machine.streamed is not None:  # the output matrix, after the last layer
            self.now = self._weights(st, self.now, -1)
        self.step += 1
        st.finish(self, t0)

    def _decide(self, st: Step, decide: Callable[[View], Any], layer: int, now: float) -> None:
        """The layer's decision from its view, checked, applied and timed."""
        v, where, hooks = self.view, self.hooks.where, self.hooks
        where.seq, where.token = st.decision_ids
        v.layer = where.layer = layer
        v.now = now
        experts, counts = st.enter(self, layer)
        plan = hooks.call(st.hook, decide, v)
        route = check_route(hooks, plan, self.n_experts, layer, st.no_route)
        true = experts.tolist()
        routed = true if route is None else route
        order = check_plan(hooks, plan, layer, routed, self.res, self.spec, self.precalc)
        st.account(self, plan, route, true, layer)  # a Plan: check_plan refuses anything else
        where.seq, where.token = st.op_ids
        work = self.applier.apply(plan, layer, order, routed, counts, now, st.prefill, st.op_ids,
                                  layer < st.n_cpu_run)  # fmt: skip
        self.now = self.ex.run_layer(work)

    # -- the non-expert part of a layer ------------------------------------------------------
    def _nonexpert(self, st: Step, layer: int) -> float:
        """A layer's non-expert part from the current time; returns the decision time."""
        start = self.now
        n_cpu = self.n_cpu_layers
        self.hooks.where.seq, self.hooks.where.token = st.nonexpert_ids
        if layer < st.n_cpu_run:  # a CPU-resident layer (ResourceSpec.gpu_blocks)
            return self._cpu_layer_part(st, start, layer)
        if n_cpu and layer < n_cpu:  # op offload: this layer's weights come first
            start = self._host_copy(st, start, layer, "weights")
        elif layer and layer == st.n_cpu_run:  # the split: hidden states to the GPU
            start = self._host_copy(st, start, layer, "activation")
        if self.machine.streamed is not None:  # the layer's weights land first (ZeRO-3)
            start = self._weights(st, start, layer)
        return self._gpu_part(st, start, layer)

    def _gpu_part(self, st: Step, start: float, layer: int) -> float:
        """The part on the layer's home GPU; the runtime's host thread issues its kernels
        (and may wait for the routing: a sync) before the decision."""
        m, c, d = self.machine, self.c, st.d_ne
        host = m.host
        if host is None:
            now = start + d
        else:
            end, now = host.nonexpert(start, d, layer == 0)
            if end - d > start:  # the stream waited for the thread to issue the part
                c.dispatch_stall += end - d - start
                start = end - d
        c.gpu_nonexpert_busy += d
        lane = m.gpus[0 if m.home is None else m.home[layer]]
        sid, token = st.nonexpert_ids
        n, context = st.dram_key
        self.ex.lanes.run(lane, start, d, "nonexpert", sid, token, layer, -1, 0, n, context)
        return now

    def _cpu_layer_part(self, st: Step, start: float, layer: int) -> float:
        """A CPU-resident layer's non-expert part on the host CPU's first worker; returns
        when its routing is known. CPU layers lead and a spec with ``gpu_blocks`` has no
        write-backs, prefetches or pre-calculations, so nothing else uses the CPU or the
        links when such a layer starts: timing it here, outside the executor, is exact."""
        m = self.machine
        d = st.d_cpu if st.d_cpu >= 0.0 else m.cpu_layer_nonexpert_s(st.n, st.context)
        self.c.cpu_nonexpert_busy += d
        sid, token = st.nonexpert_ids
        return self.ex.lanes.run(m.cpu.lanes[0], start, d, "nonexpert", sid, token, layer, -1, 0)

    def _host_copy(self, st: Step, start: float, layer: int, kind: str) -> float:
        """Around CPU-resident layers: a prompt's copy of a CPU layer's weights to the GPU
        (op offload, ``weights``), or the hidden states' copy at the split (``activation``);
        returns when it has landed (the link is idle then, as for ``_cpu_layer_part``)."""
        m, c = self.machine, self.c
        link = m.links["h2d"]
        if kind == "weights":
            d, nbytes = m.cpu_layer_weights_s, self.costs.cpu_layer_weight_bytes
            c.cpu_layer_weight_copies += 1
        else:
            d, nbytes = link.activation_s(st.n), m.activation_bytes(st.n)
        c.h2d_bytes += nbytes
        sid, token = st.nonexpert_ids
        return self.ex.lanes.serve(link.engines, start, d, kind, sid, token, layer, -1, nbytes)

    def _weights(self, st: Step, start: float, layer: int) -> float:
        """ZeRO-3's streamed non-expert weights (ResourceSpec.nonexpert_streamed): the copies
        issued at ``start`` before ``layer``'s part (at layer 0 the input embedding's first),
        or with ``layer`` -1 the output matrix's; returns when the last lands."""
        streamed = self.machine.streamed
        assert streamed is not None
        (lb, ls), (eb, es) = streamed
        if layer < 0:
            items = [("embedding", eb, es, self.n_layers - 1)]
        elif layer == 0:
            items = [("embedding", eb, es, 0), ("weights", lb, ls, 0)]
        else:
            items = [("weights", lb, ls, layer)]
        c, end = self.c, start
        sid, token = st.nonexpert_ids  # unpacked: a starred call is a call through Python
        for kind, nbytes, dur, lay in items:
            if nbytes <= 0:
                continue
            self.ex.next_seq()
            c.h2d_bytes += nbytes
            c.nonexpert_weight_copies += 1
            c.nonexpert_weight_bytes += nbytes
            e = self.ex.weights(start, nbytes, dur, kind, sid, token, lay)
            if e > end:  # on several copy engines a later copy may land first
                end = e
        return end
