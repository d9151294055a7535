"""Which sequences of a trace a run evaluates and which it holds out, and the calibration
counts read from them (docs/metrics.md, "Calibration").

:func:`split_sequences` splits a trace's sequences into evaluated and held-out ones (seed 0: the
first N; another seed: a seeded sample); :func:`calibration_counts` counts each expert's
selections over sequences (per sequence too, for MoE-Infinity), and can keep the sequences it
reads for the run; :func:`routing_digest` and :func:`same_content` find calibration data that is
the evaluated data (in-sample).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from daopsim.simulator.errors import UserError
from daopsim.simulator.trace import (
    SequenceRouting,
    TraceMeta,
    iter_sequences,
)

#: ``calibration=`` values that are not paths (see docs/metrics.md, "Calibration").
CALIBRATION_MODES = ("none", "self")


#: a trace of at most this many rows has its evaluation sequences assembled by the calibration
#: read and kept in memory for the run (a few tens of MB at most), instead of read twice
_STASH_ROWS = 1 << 20


def select_sequences(pool: list[int], n_eval: int | None, seed: int) -> list[int]:
    """``n_eval`` ids of ``pool`` chosen by ``seed``, in file order.

    Seed 0 takes the first ``n_eval`` (the selection before seeds selected anything); another
    seed takes a seeded random sample without replacement. ``None`` takes the whole pool.
    """
    if n_eval is None:
        return list(pool)
    if n_eval <= 0:
        raise UserError(f"--sequences must be positive, got {n_eval}")
    if n_eval > len(pool):
        raise UserError(
            f"--sequences {n_eval}: the trace has only {len(pool)} evaluation sequences"
        )
    if seed == 0 or n_eval == len(pool):
        return pool[:n_eval]
    picked = np.random.default_rng(seed).choice(len(pool), size=n_eval, replace=False)
    return [pool[i] for i in sorted(picked.tolist())]


def split_sequences(
    meta: TraceMeta,
    seq_ids: list[int],
    n_eval: int | None,
    external_calibration: bool,
    hold_out: bool = True,
    seed: int = 0,
) -> tuple[list[int], list[int]]:
    """Evaluation ids (file order) and held-out calibration ids (disjoint).

    With ``hold_out`` (a policy that uses calibration counts from this trace), the trace's
    declared ``calibration_sequences`` are never evaluated; without a declaration the last
    quarter of the sequences (at least one, when there are two or more) is held out, unless
    an external calibration trace is given. Without ``hold_out`` every sequence is in the
    evaluation pool. ``n_eval`` and ``seed`` then pick from the pool (:func:`select_sequences`).
    """
    declared = [s for s in meta.calibration_sequences if s in set(seq_ids)]
    if not hold_out or external_calibration:
        calib = []
    elif declared:
        calib = declared
    elif len(seq_ids) < 2:
        calib = []
    else:
        calib = seq_ids[-max(1, len(seq_ids) // 4) :]
    held = set(calib)
    evaluation = select_sequences([s for s in seq_ids if s not in held], n_eval, seed)
    if not evaluation:
        raise UserError("the trace has no evaluation sequences (all are calibration)")
    return evaluation, calib


def calibration_counts(
    path: Path,
    meta: TraceMeta,
    ids: list[int],
    per_sequence: list[np.ndarray] | None = None,
    keep: dict[int, SequenceRouting] | None = None,
    keep_ids: set[int] | None = None,
    digests: set[bytes] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Decode-time and prefill-time selection counts [layers, experts] over ``ids``.

    With ``per_sequence`` (a list), each sequence's own counts (prompt and decode together,
    file order) are appended to it: the request-level activation matrices of MoE-Infinity.
    With ``keep`` and ``keep_ids``, the sequences of ``keep_ids`` are stored in ``keep`` as
    this read assembles them (file order): the same pass over the file serves a later read
    of them (the evaluation sequences of a small trace; see ``_STASH_ROWS``). With
    ``digests``, each counted sequence's :func:`routing_digest` is added to it.
    """
    n_layers, n_exp = meta.model.moe_layers, meta.model.experts
    dec = np.zeros((n_layers, n_exp), dtype=np.int64)
    pre = np.zeros((n_layers, n_exp), dtype=np.int64)
    wanted = set(ids)
    kept = keep_ids if keep is not None and keep_ids else set()
    for r in iter_sequences(path, meta, sequences=wanted | kept):
        sid = int(r.seq_id)
        if sid in kept:
            assert keep is not None
            keep[sid] = r
        if sid not in wanted:
            continue
        if digests is not None:
            digests.add(routing_digest(r))
        own = np.zeros((n_layers, n_exp), dtype=np.int64)
        for counts, part in ((pre, r.experts[: r.n_prefill]), (dec, r.experts[r.n_prefill :])):
            if part.size == 0:
                continue
            flat = (np.arange(n_layers)[None, :, None] * n_exp + part).reshape(-1)
            sel = np.bincount(flat, minlength=n_layers * n_exp).reshape(n_layers, n_exp)
            counts += sel
            own += sel
        if per_sequence is not None:
            per_sequence.append(own)
    return dec, pre


def routing_digest(r: SequenceRouting) -> bytes:
    """A digest of a sequence's routing (its prompt length and every token's experts): two
    sequences with equal digests route identically, whatever their ids or files."""
    h = hashlib.sha256(f"{r.n_prefill}:{r.experts.shape}:{r.experts.dtype}".encode())
    h.update(np.ascontiguousarray(r.experts).tobytes())
    return h.digest()


def same_content(a: Path, b: Path) -> bool:
    """Whether two trace files hold the same bytes (a copy under another name counts)."""
    from daopsim.simulator.fingerprints import file_sha256

    if os.path.getsize(a) != os.path.getsize(b):
        return False
    return file_sha256(a) == file_sha256(b)


def small_trace(meta: TraceMeta) -> bool:
    """A trace small enough to keep its evaluation sequences in memory for the run (the
    calibration read assembles them: ``keep`` of :func:`calibration_counts`)."""
    return meta.counts.get("rows", _STASH_ROWS + 1) <= _STASH_ROWS
