"""The serving scheduler: which waiting requests join the batch between steps (first come,
first served, while the batch has room and the KV cache can hold them; static or continuous
batching, chunked prefill, preemption), and the step schedule it gives when the order does not
depend on timing, from which a clairvoyant policy's oracle is built (docs/serving.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from daopsim.simulator.errors import UserError
from daopsim.simulator.serving_config import ServingConfig
from daopsim.simulator.serving_requests import Request


class Scheduler:
    """Admission: first come, first served, bounded by the batch size and the KV cache.

    ``kv_capacity`` is the KV cache in tokens (None: unbounded). A request holds its prompt
    plus output tokens from admission to its end. Static batches admit only when nothing is
    running; continuous batching admits at every step boundary. The head of the queue is never
    overtaken (a later, smaller request does not jump a waiting one).
    """

    def __init__(
        self,
        requests: list[Request],
        batch: int,
        continuous: bool,
        kv_capacity: int | None,
        incremental: bool = False,
    ) -> None:
        self.queue: deque[Request] = deque(sorted(requests, key=lambda q: q.arrival))
        self.running: list[Request] = []
        self.batch = batch
        self.continuous = continuous
        self.kv_capacity = kv_capacity
        self.kv_used = 0
        #: most KV tokens ever held at once
        self.kv_peak = 0
        #: KV allocated as tokens are written, with preemption (``ServingConfig.preempt``)
        self.incremental = incremental
        #: preemptions so far, and the KV tokens written then freed by them (prefilled again)
        self.preemptions = 0
        self.preempted_kv_tokens = 0

    def admit(self, now: float) -> list[Request]:
        """Requests admitted at ``now`` (they join ``running``)."""
        if self.running and not self.continuous:
            return []
        out = []
        q = self.queue
        cap = self.kv_capacity
        while q and q[0].arrival <= now and len(self.running) < self.batch:
            if self.incremental:
                head = q[0]
                if cap is not None and head.kv_tokens > cap:
                    # it could never finish: alone it would preempt itself for ever
                    raise UserError(
                        f"request {head.rid} needs {head.kv_tokens} KV tokens (prompt "
                        f"{head.prompt} + output {head.output}), more than the whole KV cache "
                        f"holds ({cap})"
                    )
                # the prompt (and, after a preemption, the tokens generated so far) is written
                # by its prefill; each decode token then allocates one more (vLLM, SOSP 2023)
                need = head.prompt + head.done
            else:
                need = q[0].kv_tokens
            if cap is not None:
                # preemption: also room for the next token of every running request and its
                # own (a one-step watermark, so an admission is not preempted at once)
                grow = len(self.running) + 1 if self.incremental else 0
                if self.kv_used + need + grow > cap:
                    break
            r = q.popleft()
            self.kv_used += need
            self.kv_peak = max(self.kv_peak, self.kv_used)
            if self.incremental:
                r.held = need
            if math.isnan(r.admitted):  # the first admission (queue_s is measured to it)
                r.admitted = now
            r.prefill_target = r.prompt + r.done
            r.prefilled = 0
            self.running.append(r)
            out.append(r)
        return out

    def fits_empty(self) -> bool:
        """The head of the queue fits in an empty KV cache (so an idle server admits it at the
        next step boundary; a request that ended at admission left the server idle)."""
        cap = self.kv_capacity
        return bool(self.queue) and (cap is None or self.queue[0].kv_tokens <= cap)

    def grow(self, decoding: list[Request]) -> None:
        """Each request in ``decoding`` writes one more KV token (allocation as written)."""
        for r in decoding:
            r.held += 1
        self.kv_used += len(decoding)
        self.kv_peak = max(self.kv_peak, self.kv_used)

    def preempt(self) -> Request:
        """Preempt the most recently admitted running request (vLLM's default, recompute): its
        KV cache is freed and it goes back to the head of the queue, to prefill its prompt and
        the tokens it generated again when readmitted."""
        r = self.running.pop()
        self.kv_used -= r.held
        # the tokens whose KV it had written (not prompt rows allocated but not yet prefilled)
        self.preempted_kv_tokens += r.held - (r.prefill_target - r.prefilled)
        r.held = 0
        r.preemptions += 1
        self.preemptions += 1
        self.queue.appendleft(r)
        return r

    def next_arrival(self) -> float | None:
        """When the head of the queue arrives (None when the queue is empty)."""
        return self.queue[0].arrival if self.queue else None

    def leave(self, r: Request) -> None:
        """``r`` finished: it leaves the batch and frees its KV cache."""
        self.running.remove(r)
        if self.incremental:
            self.kv_used -= r.held
            r.held = 0
        else:
            self.kv_used -= r.kv_tokens


@dataclass
class Step:
    """One step of the extended schedule (:func:`plan_steps`)."""

    #: the request whose prompt rows ``[lo, hi)`` run in this step (None: decode tokens only)
    prefill: Request | None
    lo: int
    hi: int
    #: the requests decoding one token each in this step, and each one's token row
    decoding: list[Request]
    tokens: list[int]
    #: the whole prompt as the engine's own prefill pass (no chunking)
    whole: bool = False


def plan_steps(
    sched: Scheduler, chunk: int | None, clock: Callable[[], float]
) -> Generator[tuple[str, Any], None, None]:
    """The schedule with chunked prefill and/or preemption (docs/serving.md), as events:
    ``("admit", request)``, ``("step", Step)``, ``("preempt", request)``, ``("idle", time)``
    and ``("finish", request)``. ``clock()`` is the simulated time; it is read after each step
    has run, so the simulation and the clairvoyant oracle (``clock`` always 0) share it.

    With ``chunk`` a step carries up to ``chunk`` prompt rows of the earliest-admitted request
    still prefilling, beside one decode token of every request that has finished its prefill
    (Sarathi-Serve's stall-free batching); without it each admitted prompt runs as a prefill
    step of its own, as in the plain schedule. With ``sched.incremental``, before each step the
    newest request is preempted while the decoding tokens would not fit in the KV cache.
    """
    while sched.queue or sched.running:
        for q in sched.admit(clock()):
            yield "admit", q
            if chunk is None and q.prefill_target:
                yield "step", Step(q, 0, q.prefill_target, [], [], whole=True)
                q.prefilled = q.prefill_target
                if math.isnan(q.first_token):
                    q.first_token = clock()
            if q.done >= q.output and q.prefilled >= q.prefill_target:
                yield "finish", q  # nothing to generate beyond the prompt's token
                sched.leave(q)
        running = sched.running
        pre = next((q for q in running if q.prefilled < q.prefill_target), None)
        decoding = [q for q in running if q.prefilled >= q.prefill_target and q.done < q.output]
        cap = sched.kv_capacity
        if sched.incremental and cap is not None:
            # alone, a request always fits (admission refuses one larger than the cache), so
            # this stops; the victim is the newest, so the oldest always makes progress
            while decoding and sched.kv_used + len(decoding) > cap:
                v = sched.preempt()
                yield "preempt", v
                decoding = [q for q in decoding if q is not v]
                if pre is v:  # the newest; nobody after it is prefilling
                    pre = None
            sched.grow(decoding)
        if pre is None and not decoding:
            nxt = sched.next_arrival()
            if nxt is None:
                break
            if nxt > clock():  # idle until the next request arrives
                yield "idle", nxt
            elif not running and not sched.fits_empty():
                head = sched.queue[0]
                raise UserError(
                    f"request {head.rid} needs {head.kv_tokens} KV tokens, more than the KV "
                    f"cache holds ({cap})"
                )
            continue
        lo = hi = 0
        if pre is not None:
            lo = pre.prefilled
            hi = min(pre.prefill_target, lo + (chunk or pre.prefill_target))
        yield "step", Step(pre, lo, hi, decoding, [q.prompt + q.done for q in decoding])
        now = clock()
        for q in decoding:
            q.done += 1
            if math.isnan(q.first_token):  # no prompt: the first decode token is the first
                q.first_token = now
        ended = list(decoding)
        if pre is not None:
            pre.prefilled = hi
            if hi == pre.prefill_target:
                if math.isnan(pre.first_token):
                    pre.first_token = now
                ended.append(pre)
        for q in ended:
            if q.done >= q.output and q.prefilled >= q.prefill_target:
                yield "finish", q
                sched.leave(q)


def schedule_steps(
    requests: list[Request],
    batch: int,
    continuous: bool,
    kv_capacity: int | None,
    batched_prefill: bool = False,
) -> Iterable[list[tuple[Request, int]]]:
    """The step sequence when every request is there at time 0 (so no step depends on
    timing): each step is ``[(request, token index)]``, a prefill step being one request at
    token -1, or with ``batched_prefill`` every admitted request with a prompt at token -1.
    Clairvoyant policies get their oracle from it."""
    sched = Scheduler([dataclasses.replace(q) for q in requests], batch, continuous, kv_capacity)
    while sched.queue or sched.running:
        admitted = [q for q in sched.admit(0.0) if q.prompt]
        if batched_prefill and admitted:
            yield [(q, -1) for q in admitted]
        else:
            for q in admitted:
                yield [(q, -1)]
        if not sched.running:
            raise UserError("a request can never be admitted (KV cache too small)")
        decoding = [q for q in sched.running if q.done < q.output]
        if decoding:
            yield [(q, q.prompt + q.done) for q in decoding]
        for q in decoding:
            q.done += 1
        for q in list(sched.running):
            if q.done >= q.output:
                sched.leave(q)


def extended_schedule_steps(
    requests: list[Request], config: ServingConfig, kv_capacity: int | None
) -> Iterable[list[tuple[Request, int | slice]]]:
    """:func:`schedule_steps` for chunked prefill or preemption (every request at time 0): a
    step's prompt rows are given as a slice."""
    sched = Scheduler(
        [dataclasses.replace(q) for q in requests],
        config.batch,
        config.continuous,
        kv_capacity,
        incremental=config.preempt,
    )
    for kind, x in plan_steps(sched, config.prefill_chunk, lambda: 0.0):
        if kind == "step":
            step: list[tuple[Request, int | slice]] = []
            if x.prefill is not None:
                step.append((x.prefill, slice(x.lo, x.hi)))
            step.extend(zip(x.decoding, x.tokens, strict=True))
            yield step


def step_oracle(
    requests: list[Request],
    batch: int,
    continuous: bool,
    kv_capacity: int | None,
    oracle: Any,
    config: ServingConfig | None = None,
) -> Any:
    """Fill ``oracle`` (``daopsim.simulator.oracle.Oracle``) with the accesses of each step."""
    steps: Iterable[list[tuple[Request, Any]]]
    if config is not None and config.extended:
        steps = extended_schedule_steps(requests, config, kv_capacity)
    else:
        # without a config: the default of ServingConfig(batch, continuous)
        batched = config.batched_prefill if config is not None else not continuous
        steps = schedule_steps(requests, batch, continuous, kv_capacity, batched)
    for step in steps:
        n = oracle.n_steps
        for q, t in step:
            r = q.routing
            if isinstance(t, slice):
                rows = r.experts[t]
            else:
                rows = r.experts[: r.n_prefill] if t < 0 else r.experts[t : t + 1]
            for layer in range(rows.shape[1]):
                steps = oracle.steps[layer]
                for e in np.unique(rows[:, layer, :]).tolist():
                    lst = steps[e]
                    if not lst or lst[-1] != n:
                        lst.append(n)
        oracle.n_steps = n + 1
    return oracle
