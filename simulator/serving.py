"""Serving: requests that arrive over time, decoded in static or continuous batches.

docs/serving.md describes each rule and its sources. In short:

* a *request* replays one trace sequence (its prompt, then its generated tokens); requests
  arrive all at time 0, by a seeded Poisson process (``--arrival-rate``) or at the times of an
  arrival file (:func:`read_arrivals`);
* the scheduler (:class:`Scheduler`) admits waiting requests first come, first served, while
  the batch has room (``--batch``/``--max-batch``) and the KV cache can hold the request's
  prompt plus output tokens; static batches admit only when the previous batch is done,
  continuous batching admits between any two steps (iteration-level scheduling);
* with continuous batching a newly admitted request's prompt runs as a prefill step of its own
  (the engine's prefill pass); the requests of a static batch prefill together in one step
  (:meth:`Serving._prefill_batch_step`, as Hugging Face ``generate`` runs a batch), unless
  ``static_prefill="per-request"``; then every running request decodes one token per step.
  One running request decodes through the engine's single-sequence path (so one request at a
  time reproduces an unbatched run exactly); several decode in one batched step
  (:meth:`Serving._batch_step`) in which each layer runs the union of the batch's experts,
  each over the number of tokens that chose it;
* per request: time to first token (from its arrival), time per output token, end-to-end
  latency; SLO attainment and goodput (:func:`summarise`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from daopsim.policies.base import Plan
from daopsim.simulator.boundary import fill_layer_view
from daopsim.simulator.core.loop import Step as CoreStep
from daopsim.simulator.errors import UserError
from daopsim.simulator.run_params import ServingOptions, ServingRequest, run_params
from daopsim.simulator.trace import SequenceRouting

if TYPE_CHECKING:
    from daopsim.simulator.core.loop import Engine

#: Columns of an arrival file (docs/serving.md, "Arrival file").
ARRIVAL_COLUMNS = ("request_id", "arrival_s", "prompt_tokens", "output_tokens", "sequence")
#: Percentiles reported for per-request latencies.
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, kw_only=True)
class ServingConfig(ServingOptions):
    """How requests arrive and are batched: the batch's size and kind, and the serving
    options as declared (:class:`~daopsim.simulator.run_params.ServingOptions`: arrivals,
    KV-cache reserve, SLOs, chunked prefill, preemption, static prefill), each checked as
    declared."""

    #: most requests decoding together
    batch: int = 1
    #: continuous (iteration-level) batching; False: static batches
    continuous: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.arrival_rate is not None and self.arrivals is not None:
            raise UserError("give --arrival-rate or --arrivals, not both")
        if self.static_prefill is not None:
            if self.continuous:
                raise UserError(
                    "--static-prefill applies to static batches (--batch), not to continuous "
                    "batching"
                )
            if self.static_prefill == "batched" and self.extended:
                raise UserError(
                    "--static-prefill batched is not modelled with --prefill-chunk or --preempt "
                    "(their prompts prefill one request at a time); use --static-prefill "
                    "per-request or drop them"
                )

    @property
    def extended(self) -> bool:
        """Chunked prefill or preemption: the schedule of :func:`plan_steps`."""
        return self.prefill_chunk is not None or self.preempt

    @property
    def batched_prefill(self) -> bool:
        """A static batch's prompts prefill together in one step (docs/serving.md)."""
        return not self.continuous and not self.extended and self.static_prefill != "per-request"

    @property
    def timed_arrivals(self) -> bool:
        """Requests arrive over time (the schedule then depends on the simulated clock)."""
        return self.arrival_rate is not None or self.arrivals is not None


#: The ``--static-prefill`` choices (docs/serving.md, "Static batches prefill together").
STATIC_PREFILL: tuple[str, ...] = next(
    p.choices or () for p in run_params("serving") if p.name == "static_prefill"
)

#: Most requests decoding together when requests arrive over time and no size is given.
DEFAULT_MAX_BATCH = 8


def serving_config(**options: Any) -> ServingConfig | None:
    """The serving configuration of ``run``'s serving options (the keywords are the fields of
    :class:`~daopsim.simulator.run_params.ServingRequest`), or None when none is given.

    ``batch=B``: static batches; ``max_batch=B``: continuous batching; neither: continuous
    batching of up to :data:`DEFAULT_MAX_BATCH` when requests arrive over time, else one
    request at a time.
    """
    try:
        req = ServingRequest(**options)
    except TypeError as exc:
        raise TypeError(str(exc).replace("ServingRequest.__init__()", "serving_config()")) from None
    given = [f.name for f in fields(req) if getattr(req, f.name) != f.default]
    if given in ([], ["static_prefill"]):
        if given:
            raise UserError("--static-prefill needs static batches (--batch B)")
        return None
    if req.batch is not None and req.max_batch is not None:
        raise UserError("give --batch (static batches) or --max-batch (continuous), not both")
    timed = req.arrival_rate is not None or req.arrivals is not None
    size = req.batch if req.batch is not None else req.max_batch
    if size is None:
        size = DEFAULT_MAX_BATCH if timed else 1
    shared = {f.name: getattr(req, f.name) for f in fields(ServingOptions)}
    return ServingConfig(
        batch=size, continuous=req.batch is None and (req.max_batch is not None or timed), **shared
    )


@dataclass
class Arrival:
    """One row of an arrival file."""

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    sequence: int
    row: int  #: 1-based data row, for error messages


@dataclass
class Request:
    """One request and what happened to it (times in simulated seconds)."""

    rid: int
    seq_id: int
    arrival: float
    prompt: int
    output: int
    routing: SequenceRouting
    admitted: float = math.nan
    first_token: float = math.nan
    finish: float = math.nan
    #: decode tokens generated so far
    done: int = 0
    finished: int = 0  #: times it finished (the invariant: exactly once)
    #: times it was preempted (its KV cache freed, its prefill redone on readmission)
    preemptions: int = 0
    #: KV-cache tokens it holds now (allocation as tokens are written, ``preempt``)
    held: int = 0
    #: prompt rows its current admission must prefill (prompt, plus generated tokens after a
    #: preemption) and how many of them are done
    prefill_target: int = 0
    prefilled: int = 0

    @property
    def kv_tokens(self) -> int:
        """KV-cache tokens it holds while admitted: its prompt and output (reserved whole)."""
        return self.prompt + self.output

    @property
    def tpot(self) -> float:
        """Time per output token after the first (NaN with fewer than two tokens)."""
        after = self.output if self.prompt else self.output - 1
        return (self.finish - self.first_token) / after if after > 0 else math.nan


#: The latest arrival time a run takes, s (about 11.6 days). The simulated clock is one float:
#: below this its resolution is 1.2e-10 s, so microsecond events keep their length to 1e-4;
#: epoch times (1.7e9 s) would round every event to 2.4e-7 s, and 1e14 s to 0.016 s.
MAX_CLOCK_S = 1e6


_BEYOND_CLOCK = (
    f"beyond the simulated clock's range of {MAX_CLOCK_S:g} s (about 11.6 days; past it, times "
    "lose their precision)"
)


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """``n`` arrival times of a Poisson process of ``rate`` per second (seeded; first > 0);
    a UserError when the last lies beyond :data:`MAX_CLOCK_S`."""
    gaps = np.random.default_rng([seed, 17]).exponential(1.0 / rate, size=n)
    times = np.cumsum(gaps)
    if n and times[-1] > MAX_CLOCK_S:
        raise UserError(
            f"--arrival-rate {rate:g}: the {n} requests arrive over {times[-1]:.4g} s, "
            f"{_BEYOND_CLOCK}; give a higher rate"
        )
    return times


def _int_field(path: Path, row: int, name: str, value: Any, low: int) -> int:
    if isinstance(value, float | np.floating) and float(value).is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise UserError(f"{path}: row {row}: field {name}: expected an integer, got {value!r}")
    if value < low:
        raise UserError(f"{path}: row {row}: field {name}: must be >= {low}, got {value}")
    return int(value)


def read_arrivals(path: str | Path) -> list[Arrival]:
    """Read and validate an arrival file (CSV or Parquet), sorted by arrival time then row."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".csv", ".parquet"):
        raise UserError(f"{p}: arrival file must end in .csv or .parquet")
    try:
        df = pd.read_csv(p) if suffix == ".csv" else pd.read_parquet(p)
    except FileNotFoundError:
        raise UserError(f"{p}: no such arrival file") from None
    except Exception as exc:  # unreadable: say so in one line
        text = " ".join(str(exc).split())
        raise UserError(f"{p}: cannot read arrival file: {type(exc).__name__}: {text}") from None
    missing = [c for c in ARRIVAL_COLUMNS if c not in df.columns]
    if missing:
        raise UserError(
            f"{p}: missing column {missing[0]!r} (an arrival file has {', '.join(ARRIVAL_COLUMNS)})"
        )
    if df.empty:
        raise UserError(f"{p}: arrival file has no rows")
    out: list[Arrival] = []
    seen: dict[int, int] = {}
    records = df[list(ARRIVAL_COLUMNS)].to_dict("records")
    for i, rec in enumerate(records, start=1):
        for name in ARRIVAL_COLUMNS:
            v = rec[name]
            if v is None or (isinstance(v, float) and math.isnan(v)):
                raise UserError(f"{p}: row {i}: field {name}: empty")
        rid = _int_field(p, i, "request_id", rec["request_id"], 0)
        if rid in seen:
            raise UserError(f"{p}: row {i}: field request_id: {rid} repeats row {seen[rid]}'s id")
        seen[rid] = i
        t = rec["arrival_s"]
        try:
            t = float(t)
        except (TypeError, ValueError):
            raise UserError(f"{p}: row {i}: field arrival_s: not a number: {t!r}") from None
        if not math.isfinite(t) or t < 0:
            raise UserError(f"{p}: row {i}: field arrival_s: must be finite and >= 0, got {t}")
        if t > MAX_CLOCK_S:
            raise UserError(
                f"{p}: row {i}: field arrival_s: {t:.4g} s is {_BEYOND_CLOCK}; give times "
                "relative to the first request"
            )
        out.append(
            Arrival(
                request_id=rid,
                arrival_s=t,
                prompt_tokens=_int_field(p, i, "prompt_tokens", rec["prompt_tokens"], 0),
                output_tokens=_int_field(p, i, "output_tokens", rec["output_tokens"], 1),
                sequence=_int_field(p, i, "sequence", rec["sequence"], 0),
                row=i,
            )
        )
    out.sort(key=lambda a: a.arrival_s)  # stable: file order on ties
    return out


def dense(r: SequenceRouting, n_experts: int) -> SequenceRouting:
    """``r`` with dense probabilities (so one-token slices need no conversion)."""
    if r.prob_ids is None and r.early_prob_ids is None:
        return r
    return dataclasses.replace(
        r,
        probs=r.full_probs(n_experts),
        early_probs=r.full_probs(n_experts, early=True),
        prob_ids=None,
        early_prob_ids=None,
    )


def _rows(r: SequenceRouting, idx: slice | np.ndarray, n_prefill: int) -> SequenceRouting:
    """The token rows ``idx`` of every per-token array of ``r``, of which the first
    ``n_prefill`` are prompt (a slice gives views, an index array copies)."""

    def take(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[idx]

    return dataclasses.replace(
        r,
        positions=r.positions[idx],
        n_prefill=n_prefill,
        experts=r.experts[idx],
        weights=r.weights[idx],
        probs=r.probs[idx],
        early_experts=r.early_experts[idx],
        early_probs=r.early_probs[idx],
        prob_ids=take(r.prob_ids),
        early_prob_ids=take(r.early_prob_ids),
        filled=take(r.filled),
    )


def trim(r: SequenceRouting, prompt: int, output: int, rid: int) -> SequenceRouting:
    """The first ``prompt`` prompt tokens and first ``output`` generated tokens of ``r``,
    as sequence ``rid`` (a request's id names it to the policy and in the timeline)."""
    p0 = r.n_prefill
    if prompt == p0 and output == r.n_decode:
        return dataclasses.replace(r, seq_id=rid)
    return dataclasses.replace(_rows(r, np.r_[0:prompt, p0 : p0 + output], prompt), seq_id=rid)


def one_token(r: SequenceRouting, t: int) -> SequenceRouting:
    """Token ``t`` of ``r`` as a one-token decode-only routing (views, no copies)."""
    return _rows(r, slice(t, t + 1), 0)


def prefix(r: SequenceRouting, n: int) -> SequenceRouting:
    """The first ``n`` rows of ``r`` (its prompt, then generated tokens) as one prompt: what a
    request preempted after generating ``n - prompt`` tokens prefills again (views)."""
    if n == r.n_prefill:
        return r
    return _rows(r, slice(0, n), n)


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
    """Fill ``oracle`` (``daopsim.simulator.runner.Oracle``) with the accesses of each step."""
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


def _pcts(values: list[float]) -> dict[str, float | None]:
    arr = np.asarray([x for x in values if math.isfinite(x)], dtype=np.float64)
    return {f"p{p}": (float(np.percentile(arr, p)) if arr.size else None) for p in PERCENTILES}


def request_table(requests: list[Request], config: ServingConfig) -> pd.DataFrame:
    """One row per request: arrival, admission, first token, finish, latencies, SLO outcome."""
    rows = []
    for q in requests:
        ttft = q.first_token - q.arrival
        tpot = q.tpot
        rows.append(
            {
                "request_id": q.rid,
                "sequence": q.seq_id,
                "arrival_s": q.arrival,
                "admitted_s": q.admitted,
                "first_token_s": q.first_token,
                "finish_s": q.finish,
                "prompt_tokens": q.prompt,
                "output_tokens": q.output,
                "queue_s": q.admitted - q.arrival,
                "ttft_s": ttft,
                "tpot_s": tpot,
                "latency_s": q.finish - q.arrival,
                "meets_slo": meets_slo(ttft, tpot, config),
                "preemptions": q.preemptions,
            }
        )
    return pd.DataFrame(rows)


def meets_slo(ttft: float, tpot: float, config: ServingConfig) -> bool:
    """Both objectives met (an objective not given is met; a NaN TPOT, one output token after
    no prompt, meets any TPOT objective)."""
    if config.slo_ttft is not None and not ttft <= config.slo_ttft:
        return False
    return config.slo_tpot is None or math.isnan(tpot) or tpot <= config.slo_tpot


def summarise(
    serving: Serving, e2e: float, kv_capacity: int | None, kv_bytes_per_token: int
) -> dict[str, Any]:
    """The ``serving`` object of ``run --json`` (docs/serving.md defines each key)."""
    cfg = serving.config
    table = request_table(serving.requests, cfg)
    n = len(table)
    good = int(table["meets_slo"].sum()) if n else 0
    out_tokens = int(table["output_tokens"].sum()) if n else 0
    return {
        "mode": "continuous" if cfg.continuous else "static",
        "max_batch": cfg.batch,
        "arrivals": (
            f"poisson {cfg.arrival_rate}/s"
            if cfg.arrival_rate is not None
            else (cfg.arrivals if cfg.arrivals is not None else "all at 0")
        ),
        "requests": n,
        "batched_steps": serving.batch_steps,
        "mean_batch": (serving.batched_tokens / serving.batch_steps)
        if serving.batch_steps
        else 1.0,
        "throughput_tokens_per_s": out_tokens / e2e if e2e > 0 else None,
        "ttft_s": _pcts(table["ttft_s"].tolist()),
        "tpot_s": _pcts(table["tpot_s"].tolist()),
        "latency_s": _pcts(table["latency_s"].tolist()),
        "queue_s": _pcts(table["queue_s"].tolist()),
        "slo_ttft_s": cfg.slo_ttft,
        "slo_tpot_s": cfg.slo_tpot,
        "slo_attainment": good / n if n else None,
        "goodput_requests_per_s": good / e2e if e2e > 0 else None,
        "kv_cache_tokens": kv_capacity,
        "kv_cache_gb": None if kv_capacity is None else kv_capacity * kv_bytes_per_token / 1e9,
        "kv_peak_tokens": serving.sched.kv_peak,
        "prefill_chunk": cfg.prefill_chunk,
        "mixed_steps": serving.mixed_steps,
        "static_prefill": None
        if cfg.continuous
        else ("batched" if cfg.batched_prefill else "per-request"),
        "batched_prefills": serving.batched_prefills,
        "kv_allocation": "as written, preempt (recompute)" if cfg.preempt else "reserved whole",
        "preemptions": serving.sched.preemptions,
        "preempted_kv_tokens": serving.sched.preempted_kv_tokens,
    }
