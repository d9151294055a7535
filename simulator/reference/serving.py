"""The reference engine's serving loop (docs/serving.md): requests admitted by the workload's
scheduler, each step run on the reference's own layers.

Only the workload side of serving is shared: the requests and the helpers that slice a
request's routing (:mod:`daopsim.simulator.serving_requests`), the
:class:`~daopsim.simulator.scheduler.Scheduler`'s admission decisions and the extended schedule
(:func:`~daopsim.simulator.scheduler.plan_steps`). The steps themselves (a request's prefill
pass, one decode token, a batched step over the union of the batch's experts, a static batch's
prefill, a mixed step with a prompt chunk) are run here on
:class:`~daopsim.simulator.reference.engine.ReferenceEngine`'s layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from daopsim.simulator.boundary import check_plan, check_route, fill_layer_view
from daopsim.simulator.errors import UserError
from daopsim.simulator.scheduler import Step, plan_steps
from daopsim.simulator.serving_requests import Request, one_token, prefix

if TYPE_CHECKING:
    from daopsim.simulator.reference.engine import Proc, ReferenceEngine
    from daopsim.simulator.serving import Serving


def serve(eng: ReferenceEngine, plan: Serving, on_sequence: Callable[[Any], None] | None) -> Proc:
    """The serving loop over ``plan``'s requests (a process body)."""
    if eng.recorder is not None:
        eng.recorder.batches = {}
    if plan.config.extended:
        yield from _extended(eng, plan, on_sequence)
        return
    sched, hooks, pol, c = plan.sched, eng.hooks, eng.policy, eng.c
    where = hooks.where
    while sched.queue or sched.running:
        admitted = sched.admit(eng.now)
        prompts = [q for q in admitted if q.prompt]
        if plan.config.batched_prefill and len(prompts) > 1:
            # a static batch's prompts prefill together (Hugging Face generate's first pass)
            for q in admitted:
                where.seq, where.token, where.layer = q.rid, None, None
                eng.view.seq_id = q.rid
                hooks.call("on_sequence_start", pol.on_sequence_start, q.rid, q.prompt)
            t0 = eng.now
            yield from _prefill_batch(eng, plan, prompts)
            for q in admitted:
                if q.prompt:
                    q.first_token = eng.now
                c.ttft.append(eng.now - t0 if q.prompt else 0.0)
            for q in admitted:
                if not q.output:
                    _finish(eng, plan, q, on_sequence)
            admitted = []
        for q in admitted:
            where.seq, where.token, where.layer = q.rid, None, None
            eng.view.seq_id = q.rid
            hooks.call("on_sequence_start", pol.on_sequence_start, q.rid, q.prompt)
            t0 = eng.now
            if q.prompt:
                yield from eng.forward(q.routing, True)
                q.first_token = eng.now
            c.ttft.append(eng.now - t0)
            if not q.output:
                _finish(eng, plan, q, on_sequence)
        decoding = [q for q in sched.running if q.done < q.output]
        if not decoding:
            nxt = sched.next_arrival()
            if nxt is None:
                break
            if nxt > eng.now:  # idle until the next request arrives
                eng.now = float(nxt)
                yield from eng.until(eng.now)
            elif not sched.running and not sched.fits_empty():
                head = sched.queue[0]
                raise UserError(
                    f"request {head.rid} needs {head.kv_tokens} KV tokens, more than the KV "
                    f"cache holds ({sched.kv_capacity})"
                )
            continue
        if len(decoding) == 1:
            q = decoding[0]
            t = q.prompt + q.done
            where.seq = eng.view.seq_id = q.rid
            yield from eng.forward(one_token(q.routing, t), False, base=t)
        else:
            yield from _decode_batch(eng, plan, decoding)
        for q in decoding:
            q.done += 1
            if q.done == 1 and not q.prompt:
                q.first_token = eng.now
        for q in decoding:
            if q.done >= q.output:
                _finish(eng, plan, q, on_sequence)


def _extended(
    eng: ReferenceEngine, plan: Serving, on_sequence: Callable[[Any], None] | None
) -> Proc:
    """Chunked prefill and/or preemption: the steps of the extended schedule."""
    hooks, pol, c = eng.hooks, eng.policy, eng.c
    if plan.config.prefill_chunk is not None and eng.n_cpu_layers:
        raise UserError(
            f"--prefill-chunk is not modelled with CPU-resident layers (policy "
            f"{pol.name!r} runs {eng.n_cpu_layers} layers wholly on the CPU); drop "
            "--prefill-chunk or put every layer on the GPU"
        )
    where = hooks.where
    for kind, x in plan_steps(plan.sched, plan.config.prefill_chunk, lambda: eng.now):
        if kind == "step":
            yield from _step(eng, plan, x)
        elif kind == "admit":
            if not x.preemptions:  # a readmission continues the same sequence
                where.seq, where.token, where.layer = x.rid, None, None
                eng.view.seq_id = x.rid
                hooks.call("on_sequence_start", pol.on_sequence_start, x.rid, x.prompt)
        elif kind == "idle":
            eng.now = float(x)
            yield from eng.until(eng.now)
        elif kind == "finish":
            c.ttft.append(x.first_token - x.admitted if x.prompt else 0.0)
            _finish(eng, plan, x, on_sequence, leave=False)


def _step(eng: ReferenceEngine, plan: Serving, st: Step) -> Proc:
    where, v = eng.hooks.where, eng.view
    if st.whole:
        q = st.prefill
        assert q is not None
        where.seq, where.token, where.layer = q.rid, None, None
        v.seq_id = q.rid
        yield from eng.forward(prefix(q.routing, st.hi), True)
    elif st.prefill is not None:
        yield from _mixed(eng, plan, st)
    elif len(st.decoding) == 1:
        q, t = st.decoding[0], st.tokens[0]
        where.seq = v.seq_id = q.rid
        yield from eng.forward(one_token(q.routing, t), False, base=t)
    else:
        yield from _decode_batch(eng, plan, st.decoding)


def _finish(
    eng: ReferenceEngine,
    plan: Serving,
    q: Request,
    on_sequence: Callable[[Any], None] | None,
    leave: bool = True,
) -> None:
    hooks = eng.hooks
    hooks.where.seq, hooks.where.token = q.rid, None
    hooks.call("on_sequence_end", eng.policy.on_sequence_end, q.rid)
    eng.end_sequence()
    q.finish = eng.now
    q.finished += 1
    if leave:
        plan.sched.leave(q)
    if on_sequence is not None:
        on_sequence(q.routing)


def _counts(ex: np.ndarray, n_layers: int, n_exp: int) -> np.ndarray:
    """Tokens per (layer, expert) of a step's ``[tokens, layers, k]`` routing."""
    flat = (np.arange(n_layers)[None, :, None] * n_exp + ex).reshape(-1)
    return np.bincount(flat, minlength=n_layers * n_exp).reshape(n_layers, n_exp)


def _label(eng: ReferenceEngine, rids: list[int]) -> None:
    if eng.recorder is not None and eng.recorder.batches is not None:
        eng.recorder.batches[eng.step] = ",".join(str(r) for r in rids)


def _end_step(eng: ReferenceEngine) -> None:
    eng.step += 1
    eng.c.precalc_wasted += len(eng.precalc)
    eng.precalc.clear()


def _decode_batch(eng: ReferenceEngine, plan: Serving, batch: list[Request]) -> Proc:
    """One decode token of each request: each layer runs the union of their experts, each
    over the tokens that chose it."""
    c, v = eng.c, eng.view
    b = len(batch)
    toks = [q.prompt + q.done for q in batch]
    routes = [q.routing for q in batch]
    ex = np.stack([r.experts[t] for r, t in zip(routes, toks, strict=True)])
    wt = np.stack([r.weights[t] for r, t in zip(routes, toks, strict=True)])
    pr = np.stack([r.probs[t] for r, t in zip(routes, toks, strict=True)])
    counts = _counts(ex, eng.n_layers, eng.n_experts)
    mass = wt.sum(axis=(0, 2)).tolist()
    kv = sum(int(r.positions[t]) + 1 for r, t in zip(routes, toks, strict=True))
    d_ne = eng.costs.nonexpert_batch_layer_s(b, kv)
    _label(eng, [q.rid for q in batch])
    v.phase, v.n_tokens, v.context = "decode", b, kv - b
    v.position = int(routes[0].positions[toks[0]])
    v.seq_id, v.token, v.step = batch[0].rid, toks[0], eng.step
    v.next_experts = v.next_probs = None
    n_cpu = eng.n_cpu_layers
    cpu_run = 0 if n_cpu and 0 < eng.spec.cpu_layer_offload_batch <= b else n_cpu
    t0 = eng.now
    yield from _layers(
        eng, cpu_run, (eng.costs.cpu_nonexpert_batch_layer_s, (b, kv)), d_ne, b, kv, counts,
        wt, pr, (batch[0].rid, toks[0]), ("batch_layer", eng.policy.batch_layer), b * ex.shape[2],
        mass, False, "a batched step",
    )  # fmt: skip
    _end_step(eng)
    lat = eng.now - t0
    c.token_latency.extend([lat] * b)
    c.decode_time += lat
    c.decode_tokens += b
    plan.batch_steps += 1
    plan.batched_tokens += b


def _prefill_batch(eng: ReferenceEngine, plan: Serving, batch: list[Request]) -> Proc:
    """A static batch's prompts in one prefill step: each layer runs the union of all their
    tokens' experts; the non-expert part runs over the prompts padded to the longest."""
    c, v = eng.c, eng.view
    b = len(batch)
    lens = [q.prompt for q in batch]
    padded = max(lens)
    routes = [q.routing for q in batch]
    ex = np.concatenate([r.experts[:p] for r, p in zip(routes, lens, strict=True)])
    wt = np.concatenate([r.weights[:p] for r, p in zip(routes, lens, strict=True)])
    pr = np.concatenate([r.probs[:p] for r, p in zip(routes, lens, strict=True)])
    counts = _counts(ex, eng.n_layers, eng.n_experts)
    n_real = int(sum(lens))
    costs = eng.costs
    d_ne = costs.nonexpert_prefill_batch_layer_s(b, padded, eng.eager_attention)
    _label(eng, [q.rid for q in batch])
    v.phase, v.n_tokens, v.context = "prefill", n_real, 0
    v.position = int(routes[0].positions[0])
    v.seq_id, v.token, v.step = batch[0].rid, 0, eng.step
    v.next_experts = v.next_probs = None
    n_cpu = eng.n_cpu_layers
    cpu_run = 0 if n_cpu and 0 < eng.spec.cpu_layer_offload_batch <= n_real else n_cpu
    yield from _layers(
        eng, cpu_run, (costs.cpu_nonexpert_prefill_batch_layer_s, (b, padded)), d_ne, b * padded,
        0, counts, wt, pr, (batch[0].rid, 0), ("prefill_layer", eng.policy.prefill_layer), 0,
        None, True, "a batched prefill",
    )  # fmt: skip
    _end_step(eng)
    c.prefill_tokens += n_real
    plan.batched_prefills += 1


def _mixed(eng: ReferenceEngine, plan: Serving, st: Step) -> Proc:
    """Prompt rows ``[lo, hi)`` of one request beside one decode token of each request in
    ``st.decoding`` (chunked prefill): each layer runs the union of all their experts."""
    c, v = eng.c, eng.view
    pre = st.prefill
    assert pre is not None
    batch, toks = st.decoding, st.tokens
    b = len(batch)
    chunk = st.hi - st.lo
    rows = slice(st.lo, st.hi)
    pr_r = pre.routing
    routes = [q.routing for q in batch]
    pairs = list(zip(routes, toks, strict=True))
    ex = np.concatenate([pr_r.experts[rows], *(r.experts[t : t + 1] for r, t in pairs)])
    wt = np.concatenate([pr_r.weights[rows], *(r.weights[t : t + 1] for r, t in pairs)])
    pr = np.concatenate([pr_r.probs[rows], *(r.probs[t : t + 1] for r, t in pairs)])
    counts = _counts(ex, eng.n_layers, eng.n_experts)
    # gate mass and accesses count the decode tokens, as a prefill pass counts none
    mass = wt[chunk:].sum(axis=(0, 2)).tolist() if b else [0.0] * eng.n_layers
    decode_kv = sum(int(r.positions[t]) + 1 for r, t in pairs)
    ctx = st.lo  # the request's rows already prefilled are in its KV cache
    d_ne = eng.costs.nonexpert_mixed_layer_s(chunk, ctx, b, decode_kv)
    n_tok = chunk + b
    _label(eng, [q.rid for q in (pre, *batch)])
    decoding = b > 0
    v.phase = "decode" if decoding else "prefill"
    v.n_tokens = n_tok
    v.context = ctx + decode_kv - b
    v.position = int(pr_r.positions[st.lo])
    v.seq_id, v.token, v.step = pre.rid, st.lo, eng.step
    v.next_experts = v.next_probs = None
    pol = eng.policy
    hook = ("batch_layer", pol.batch_layer) if decoding else ("prefill_layer", pol.prefill_layer)
    t0 = eng.now
    yield from _layers(
        eng, 0, None, d_ne, n_tok, ctx + chunk + decode_kv, counts, wt, pr, (pre.rid, st.lo),
        hook, b * ex.shape[2], mass, not decoding, "a mixed step",
    )  # fmt: skip
    _end_step(eng)
    c.prefill_tokens += chunk
    if decoding:
        lat = eng.now - t0
        c.token_latency.extend([lat] * b)
        c.decode_time += lat
        c.decode_tokens += b
        plan.mixed_steps += 1
        plan.batch_steps += 1
        plan.batched_tokens += b + 1


def _layers(
    eng: ReferenceEngine,
    cpu_run: int,
    cpu_cost: tuple[Callable[..., float], tuple[int, int]] | None,
    d_ne: float,
    n: int,
    kv: int,
    counts_all: np.ndarray,
    wt: np.ndarray,
    pr: np.ndarray,
    who: tuple[int, int],
    hook: tuple[str, Callable[..., Any]],
    accesses: int,
    mass: list[float] | None,
    prefill: bool,
    what: str,
) -> Proc:
    """Every layer of a step over ``n`` token rows at ``kv`` cached tokens: the non-expert
    part (recorded as the step's, on the CPU for the first ``cpu_run`` layers), then the
    policy's plan over the union of the step's experts; ``who`` is the (request, token) the
    policy is told about."""
    where, v, c, hooks = eng.hooks.where, eng.view, eng.c, eng.hooks
    step = eng.step
    cost, args = cpu_cost if cpu_cost is not None else (lambda *_: 0.0, (0, 0))
    for layer in range(eng.n_layers):
        where.seq, where.token = -1, step
        now = yield from eng.front(
            layer, n, cpu_run, cost, args, d_ne, (-1, step), (n, kv // n), layer == 0
        )
        yield from eng.until(now)
        where.seq, where.token = who
        v.layer = where.layer = layer
        v.now = now
        experts, counts = fill_layer_view(v, counts_all[layer], wt[:, layer, :], pr[:, layer, :])
        plan = hooks.call(hook[0], hook[1], v)
        check_route(hooks, plan, eng.n_experts, layer, f"in {what}")  # refuses a route
        routed = experts.tolist()
        order = check_plan(hooks, plan, layer, routed, eng.ledger, eng.spec, eng.precalc)
        c.true_accesses += accesses
        m = 0.0 if mass is None else mass[layer]
        c.gate_mass_total += m
        c.gate_mass_kept += m
        where.seq, where.token = -1, step  # the step's operations are labelled with the step
        lw = eng.translate(plan, layer, order, routed, counts, now, prefill)
        eng.now = yield from eng.run_layer(lw)
    if eng.streamed is not None:  # ZeRO-3: the output matrix after the last layer
        where.seq, where.token = -1, step
        eng.now = yield from eng.streamed_weights(eng.now, -1)
