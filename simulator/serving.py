"""Serving: requests that arrive over time, decoded in static or continuous batches: the plan
of a serving run and its loop over the engine.

docs/serving.md describes each rule and its sources. The parts live in their own modules:
the configuration (simulator/serving_config.py), arrivals (simulator/arrivals.py), the requests
and their routing (simulator/serving_requests.py), the scheduler and its step schedule
(simulator/scheduler.py) and the summary (simulator/serving_summary.py). Here:

* :func:`serving_plan` builds a run's :class:`Serving` from the trace, the arrivals and the
  KV-cache capacity (a request longer than the cache is refused before the run);
* :class:`Serving` runs the requests through the engine's step loop: with continuous batching a
  newly admitted request's prompt runs as a prefill step of its own (the engine's prefill
  pass); the requests of a static batch prefill together in one step
  (:meth:`BatchStep.prefill_batch`, as Hugging Face ``generate`` runs a batch), unless
  ``static_prefill="per-request"``; then every running request decodes one token per step.
  One running request decodes through the engine's single-sequence path (so one request at a
  time reproduces an unbatched run exactly); several decode in one :class:`BatchStep` in which
  each layer runs the union of the batch's experts, each over the number of tokens that chose
  it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from daopsim.policies.base import Plan
from daopsim.simulator.arrivals import Arrival, poisson_arrivals
from daopsim.simulator.boundary import fill_layer_view
from daopsim.simulator.core.loop import Step as CoreStep
from daopsim.simulator.errors import UserError
from daopsim.simulator.scheduler import Scheduler, Step, plan_steps
from daopsim.simulator.serving_config import ServingConfig
from daopsim.simulator.serving_requests import Request, dense, one_token, prefix, trim
from daopsim.simulator.trace import (
    SequenceRouting,
    TraceMeta,
    iter_sequences,
    previous_token_view,
)

if TYPE_CHECKING:
    from daopsim.simulator.core.loop import Engine
    from daopsim.simulator.fit import ExpertFit


class Serving:
    """Runs a set of requests through an engine's step loop (``Engine.serving``)."""

    def __init__(
        self, requests: list[Request], config: ServingConfig, kv_capacity: int | None
    ) -> None:
        self.requests = requests
        self.config = config
        self.sched = Scheduler(
            requests, config.batch, config.continuous, kv_capacity, incremental=config.preempt
        )
        self.batch_steps = 0
        self.batched_tokens = 0
        #: steps that carried a prefill chunk beside decode tokens (``--prefill-chunk``)
        self.mixed_steps = 0
        #: static batches whose prompts prefilled together in one step
        self.batched_prefills = 0

    def run(self, eng: Engine, on_sequence: Callable[[Any], None] | None) -> None:
        """The serving loop: admissions, prefill steps, then decode steps of the running
        requests (one request alone on the single-sequence path), until all have finished."""
        if eng.recorder is not None:
            eng.recorder.batches = {}
        if self.config.extended:
            self._run_extended(eng, on_sequence)
            return
        sched = self.sched
        while sched.queue or sched.running:
            self._admit(eng, sched.admit(eng.now), on_sequence)
            decoding = [q for q in sched.running if q.done < q.output]
            if not decoding:
                nxt = sched.next_arrival()
                if nxt is None:
                    break
                if nxt > eng.now:  # idle until the next request arrives
                    eng.idle_until(float(nxt))
                elif not sched.running and not sched.fits_empty():
                    raise UserError(
                        f"request {sched.queue[0].rid} needs {sched.queue[0].kv_tokens} KV "
                        f"tokens, more than the KV cache holds ({sched.kv_capacity})"
                    )
                continue
            self._decode_step(eng, decoding)
            for q in decoding:
                q.done += 1
                if q.done == 1 and not q.prompt:
                    q.first_token = eng.now
            for q in decoding:
                if q.done >= q.output:
                    self._finish(eng, q, on_sequence)

    def _admit(
        self, eng: Engine, admitted: list[Request], on_sequence: Callable[[Any], None] | None
    ) -> None:
        """Admitted requests start and run their prompts: a static batch's prompts in one
        step (Hugging Face generate's first forward pass over the batch), else each alone."""
        prompts = [q for q in admitted if q.prompt]
        if self.config.batched_prefill and len(prompts) > 1:
            for q in admitted:
                eng.start_sequence(q.rid, q.prompt)
            t0 = eng.now
            eng.forward(BatchStep.prefill_batch(eng, prompts))
            self.batched_prefills += 1
            for q in admitted:
                if q.prompt:
                    q.first_token = eng.now
                eng.c.first_token(eng.now - t0 if q.prompt else 0.0)
            for q in admitted:
                if not q.output:  # nothing to generate beyond the prompt's token
                    self._finish(eng, q, on_sequence)
            return
        for q in admitted:
            eng.start_sequence(q.rid, q.prompt)
            t0 = eng.now
            if q.prompt:
                eng.prefill(q.routing)
                q.first_token = eng.now
            eng.c.first_token(eng.now - t0)
            if not q.output:
                self._finish(eng, q, on_sequence)

    def _decode_step(self, eng: Engine, decoding: list[Request]) -> None:
        """One decode token of each running request: alone on the single-sequence path,
        several in one batched step."""
        if len(decoding) == 1:
            q = decoding[0]
            t = q.prompt + q.done
            eng.hooks.where.seq = eng.view.seq_id = q.rid
            eng.decode(one_token(q.routing, t), base=t)
            return
        eng.forward(BatchStep.decode_batch(eng, decoding, [q.prompt + q.done for q in decoding]))
        self.batch_steps += 1
        self.batched_tokens += len(decoding)

    def _run_extended(self, eng: Engine, on_sequence: Callable[[Any], None] | None) -> None:
        """The serving loop with chunked prefill and/or preemption: runs :func:`plan_steps`."""
        if self.config.prefill_chunk is not None and eng.n_cpu_layers:
            # a mixed step's non-expert part is timed on the GPU only
            raise UserError(
                f"--prefill-chunk is not modelled with CPU-resident layers (policy "
                f"{eng.policy.name!r} runs {eng.n_cpu_layers} layers wholly on the CPU); drop "
                "--prefill-chunk or put every layer on the GPU"
            )
        for kind, x in plan_steps(self.sched, self.config.prefill_chunk, lambda: eng.now):
            if kind == "step":
                self._run_step(eng, x)
            elif kind == "admit":
                if not x.preemptions:  # a readmission continues the same sequence
                    eng.start_sequence(x.rid, x.prompt)
            elif kind == "idle":
                eng.idle_until(float(x))
            elif kind == "finish":
                eng.c.first_token(x.first_token - x.admitted if x.prompt else 0.0)
                self._finish(eng, x, on_sequence, leave=False)

    def _run_step(self, eng: Engine, st: Step) -> None:
        """One step of the extended schedule on the engine."""
        if st.whole:
            q = st.prefill
            assert q is not None
            where = eng.hooks.where
            where.seq, where.token, where.layer = q.rid, None, None
            eng.view.seq_id = q.rid
            eng.prefill(prefix(q.routing, st.hi))
        elif st.prefill is not None:
            eng.forward(BatchStep.mixed(eng, st))
            if st.decoding:
                self.mixed_steps += 1
                self.batch_steps += 1
                self.batched_tokens += len(st.decoding) + 1
        elif len(st.decoding) == 1:
            q, t = st.decoding[0], st.tokens[0]
            eng.hooks.where.seq = eng.view.seq_id = q.rid
            eng.decode(one_token(q.routing, t), base=t)
        else:
            eng.forward(BatchStep.decode_batch(eng, st.decoding, st.tokens))
            self.batch_steps += 1
            self.batched_tokens += len(st.decoding)

    def _finish(
        self,
        eng: Engine,
        q: Request,
        on_sequence: Callable[[Any], None] | None,
        leave: bool = True,
    ) -> None:
        eng.end_sequence(q.rid, on_sequence, q.routing)
        q.finish = eng.now
        q.finished += 1
        if leave:
            self.sched.leave(q)


class BatchStep(CoreStep):
    """A batched step on the engine: a decode batch, a static batch's prompts, or a mixed
    step (a prompt chunk beside decode tokens). Each layer runs the union of the step's
    experts, an expert over as many of its tokens as chose it; its rows carry sequence -1
    and the step number, and ``recorder.batches`` maps the step to its requests."""

    def __init__(
        self,
        eng: Engine,
        rows: tuple[np.ndarray, np.ndarray, np.ndarray],
        n: int,
        kv: int,
        d_ne: float,
        who: tuple[int, int],
        rids: list[int],
        n_decode: int,
        what: str,
    ) -> None:
        super().__init__(n, kv, d_ne)
        ex, self.wt, self.pr = rows  # [tokens, layers, k]
        n_layers, n_exp = eng.n_layers, eng.n_experts
        flat = (np.arange(n_layers)[None, :, None] * n_exp + ex).reshape(-1)
        #: tokens per (layer, expert) over the step, all layers at once
        self.counts = np.bincount(flat, minlength=n_layers * n_exp).reshape(n_layers, n_exp)
        #: accesses and true gate mass per layer counted as decode (the decode tokens' rows)
        self.accesses = n_decode * ex.shape[2]
        self.mass = (
            self.wt[ex.shape[0] - n_decode :].sum(axis=(0, 2)).tolist() if n_decode else None
        )
        self.prefill = n_decode == 0
        self.hook = "prefill_layer" if self.prefill else "batch_layer"
        self.dram_key = (n, kv // n)
        self.nonexpert_ids = self.op_ids = (-1, eng.step)
        self.decision_ids = who
        self.what = what
        self.no_route = f"in {what}"
        if eng.recorder is not None and eng.recorder.batches is not None:
            eng.recorder.batches[eng.step] = ",".join(str(r) for r in rids)

    @classmethod
    def decode_batch(cls, eng: Engine, batch: list[Request], toks: list[int]) -> BatchStep:
        """One decode token of each request in ``batch`` (``toks``: each one's token row)."""
        routes = [q.routing for q in batch]
        pairs = list(zip(routes, toks, strict=True))
        rows = (
            np.stack([r.experts[t] for r, t in pairs]),
            np.stack([r.weights[t] for r, t in pairs]),
            np.stack([r.probs[t] for r, t in pairs]),
        )
        b = len(batch)
        kv = sum(int(r.positions[t]) + 1 for r, t in pairs)
        st = cls(eng, rows, b, kv, eng.costs.nonexpert_batch_layer_s(b, kv),
                 (batch[0].rid, toks[0]), [q.rid for q in batch], b, "a batched step")  # fmt: skip
        st.position = int(routes[0].positions[toks[0]])
        st.view_context = kv - b
        n_cpu = eng.n_cpu_layers
        st.n_cpu_run = 0 if n_cpu and 0 < eng.spec.cpu_layer_offload_batch <= b else n_cpu
        st.d_cpu = eng.costs.cpu_nonexpert_batch_layer_s(b, kv) if st.n_cpu_run else 0.0
        st.t0_latency = b
        return st

    @classmethod
    def prefill_batch(cls, eng: Engine, batch: list[Request]) -> BatchStep:
        """The prompts of a static batch in one step (docs/serving.md, "Static batches
        prefill together"): the non-expert part runs over the prompts padded to the longest
        (only real tokens are routed)."""
        lens = [q.prompt for q in batch]
        routes = [q.routing for q in batch]
        pairs = list(zip(routes, lens, strict=True))
        rows = (
            np.concatenate([r.experts[:p] for r, p in pairs]),
            np.concatenate([r.weights[:p] for r, p in pairs]),
            np.concatenate([r.probs[:p] for r, p in pairs]),
        )
        b, padded, n_real = len(batch), max(lens), int(sum(lens))
        costs = eng.costs
        d_ne = costs.nonexpert_prefill_batch_layer_s(b, padded, eng.machine.eager_attention)
        st = cls(eng, rows, b * padded, 0, d_ne, (batch[0].rid, 0), [q.rid for q in batch], 0,
                 "a batched prefill")  # fmt: skip
        st.position = int(routes[0].positions[0])
        st.view_context = 0
        st.view_tokens = n_real
        n_cpu = eng.n_cpu_layers
        st.n_cpu_run = 0 if n_cpu and 0 < eng.spec.cpu_layer_offload_batch <= n_real else n_cpu
        st.d_cpu = costs.cpu_nonexpert_prefill_batch_layer_s(b, padded) if st.n_cpu_run else 0.0
        st.prefill_tokens = n_real
        return st

    @classmethod
    def mixed(cls, eng: Engine, s: Step) -> BatchStep:
        """Prompt rows ``[lo, hi)`` of one request beside one decode token of each request in
        ``s.decoding`` (chunked prefill); gate mass and accesses count the decode tokens."""
        pre = s.prefill
        assert pre is not None
        pr_r, rows_ = pre.routing, slice(s.lo, s.hi)
        pairs = list(zip([q.routing for q in s.decoding], s.tokens, strict=True))
        rows = tuple(
            np.concatenate([getattr(pr_r, f)[rows_], *(getattr(r, f)[t : t + 1] for r, t in pairs)])
            for f in ("experts", "weights", "probs")
        )
        b, chunk = len(s.decoding), s.hi - s.lo
        decode_kv = sum(int(r.positions[t]) + 1 for r, t in pairs)
        ctx = s.lo  # the request's rows already prefilled are in its KV cache
        d_ne = eng.costs.nonexpert_mixed_layer_s(chunk, ctx, b, decode_kv)
        st = cls(eng, rows, chunk + b, ctx + chunk + decode_kv, d_ne, (pre.rid, s.lo),  # type: ignore[arg-type]
                 [pre.rid, *(q.rid for q in s.decoding)], b, "a mixed step")  # fmt: skip
        st.position = int(pr_r.positions[s.lo])
        st.view_context = ctx + decode_kv - b
        st.prefill_tokens = chunk
        st.t0_latency = b
        return st

    #: view fields: the first token's position, the cached tokens over the step, the tokens
    position = 0
    view_context = 0
    view_tokens = -1
    #: prompt tokens the step prefills; decode tokens whose latency it is
    prefill_tokens = 0
    t0_latency = 0

    def begin(self, eng: Engine) -> None:
        v = eng.view
        v.phase = "prefill" if self.prefill else "decode"
        v.n_tokens = self.n if self.view_tokens < 0 else self.view_tokens
        v.context = self.view_context
        v.position = self.position
        v.seq_id, v.token, v.step = self.decision_ids[0], self.decision_ids[1], eng.step
        v.next_experts = v.next_probs = None

    def enter(self, eng: Engine, layer: int) -> tuple[np.ndarray, Any]:
        return fill_layer_view(  # type: ignore[no-any-return]
            eng.view, self.counts[layer], self.wt[:, layer, :], self.pr[:, layer, :]
        )

    def account(
        self, eng: Engine, plan: Plan, route: list[int] | None, experts: list[int], layer: int
    ) -> None:
        c = eng.c
        mass = 0.0 if self.mass is None else self.mass[layer]
        c.true_accesses += self.accesses
        c.gate_mass_total += mass
        c.gate_mass_kept += mass

    def finish(self, eng: Engine, t0: float) -> None:
        c = eng.c
        eng.discard_precalc()
        c.prefill_tokens += self.prefill_tokens
        b = self.t0_latency
        if b:
            c.decoded(eng.now - t0, b)


def serving_plan(
    serving: ServingConfig,
    trace_path: Path,
    meta: TraceMeta,
    eval_ids: list[int],
    arrivals: list[Arrival] | None,
    fit: ExpertFit,
    budget: int,
    kv_reserve: int,
    unlimited: bool,
    stand_in: bool,
    seed: int,
) -> Serving:
    """The requests of a serving run, their arrival times and the KV-cache capacity.

    KV capacity: ``--kv-cache-gb`` exactly; otherwise the memory the expert slots and the
    policy's buffers leave (at least the reserve); unbounded for a policy whose memory is not
    modelled (all-gpu). Any request longer than the cache is refused before the run.
    """
    model = meta.model
    routes: dict[int, SequenceRouting] = {}
    for r in iter_sequences(trace_path, meta, sequences=set(eval_ids)):
        r = previous_token_view(r) if stand_in else r
        routes[int(r.seq_id)] = dense(r, model.experts)
    reqs: list[Request] = []
    if arrivals is not None:
        for a in arrivals:
            r = routes[a.sequence]
            for name, got, have in (
                ("prompt_tokens", a.prompt_tokens, r.n_prefill),
                ("output_tokens", a.output_tokens, r.n_decode),
            ):
                if got > have:
                    raise UserError(
                        f"{serving.arrivals}: row {a.row}: field {name}: {got} is more than "
                        f"sequence {a.sequence} has ({have})"
                    )
            reqs.append(
                Request(
                    a.request_id,
                    a.sequence,
                    a.arrival_s,
                    a.prompt_tokens,
                    a.output_tokens,
                    trim(r, a.prompt_tokens, a.output_tokens, a.request_id),
                )
            )
    else:
        times = (
            poisson_arrivals(len(eval_ids), serving.arrival_rate, seed).tolist()
            if serving.arrival_rate is not None
            else [0.0] * len(eval_ids)
        )
        for sid, t in zip(eval_ids, times, strict=True):
            r = routes[sid]
            reqs.append(Request(sid, sid, t, r.n_prefill, r.n_decode, r))
    per_token = model.kv_bytes_per_token
    capacity: int | None
    if unlimited or per_token <= 0:
        capacity = None
    elif serving.kv_cache_gb is not None:
        capacity = kv_reserve
    else:
        left = fit.room(budget)
        capacity = kv_reserve + max(0, int(left // per_token))
    if capacity is not None:
        fix = (
            "raise --kv-cache-gb"
            if serving.kv_cache_gb is not None
            else "lower the expert budget or give --kv-cache-gb"
        )
        for q in reqs:
            if q.kv_tokens > capacity:
                raise UserError(
                    f"request {q.rid} (sequence {q.seq_id}) needs {q.kv_tokens} KV-cache tokens "
                    f"({q.kv_tokens * per_token / 1e9:.2f} GB), more than the cache holds "
                    f"({capacity} tokens); {fix}"
                )
    return Serving(reqs, serving, capacity)
