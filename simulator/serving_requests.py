"""The requests of a serving run and their routing: a :class:`Request` replays one trace
sequence (its prompt, then its generated tokens) and records what happened to it; the helpers
slice a sequence's routing for a request (trimmed to an arrival file's lengths, one token, a
prompt prefix) and lay it out densely for a batched step (docs/serving.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from daopsim.simulator.trace import SequenceRouting


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
