"""Reading and validating routing traces: the footer metadata, the schema, streaming the
sequences by row group with flat memory, and the checks of every row (``validate_trace``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from daopsim.simulator.errors import TraceError
from daopsim.simulator.trace_format import (
    COUNT_KEYS,
    FILLED_KEY,
    MAX_POSITION,
    META_KEY,
    SequenceRouting,
    TraceMeta,
    blank_first_layer_view,
    schema_for,
)

#: What pyarrow (and the decoders under it) raise on damaged or foreign files.
_READ_ERRORS = (pa.ArrowException, OSError, ValueError, IndexError, OverflowError, MemoryError)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _open(path: str | os.PathLike[str]) -> pq.ParquetFile:
    p = Path(path)
    if not p.exists():
        raise TraceError(p, "no such file")
    if p.is_dir():
        raise TraceError(p, "is a directory, not a trace file")
    try:
        pf = pq.ParquetFile(p, pre_buffer=False)
        # touch the schema now so a damaged footer fails here, with the file named
        pf.schema_arrow  # noqa: B018
        return pf
    except _READ_ERRORS as exc:
        raise TraceError(p, f"not a readable Parquet file ({_first_line(exc)})") from None


def read_meta(path: str | os.PathLike[str]) -> TraceMeta:
    """Read and check a trace's footer metadata (fast: no row data)."""
    pf = _open(path)
    try:
        kv = pf.metadata.metadata or {}
    except _READ_ERRORS as exc:
        raise TraceError(path, f"unreadable file metadata ({_first_line(exc)})") from None
    if META_KEY not in kv:
        raise TraceError(path, "missing file metadata 'daopsim' (not a daopsim trace?)")
    return TraceMeta.from_json(path, kv[META_KEY])


def _column_type_ok(actual: pa.DataType, expected: pa.DataType) -> bool:
    if actual.equals(expected):
        return True
    if pa.types.is_dictionary(actual) and pa.types.is_string(expected):
        return pa.types.is_string(actual.value_type)
    if pa.types.is_list(actual) and pa.types.is_list(expected):
        a, e = actual.value_type, expected.value_type
        if pa.types.is_integer(e):
            return pa.types.is_integer(a)
        if pa.types.is_floating(e):
            return pa.types.is_floating(a)
    if pa.types.is_integer(expected):
        return pa.types.is_integer(actual)
    return False


def check_schema(path: object, schema: pa.Schema, meta: TraceMeta) -> None:
    """Every required column present with a compatible type; errors name the column."""
    expected = schema_for(meta)
    for f in expected:
        idx = schema.get_field_index(f.name)
        if idx < 0:
            raise TraceError(path, "missing column", column=f.name)
        actual = schema.field(idx).type
        if not _column_type_ok(actual, f.type):
            raise TraceError(path, f"has type {actual}, expected {f.type}", column=f.name)


def _flat(
    col: pa.ChunkedArray | pa.Array,
    width: int,
    dtype: Any,
    name: str,
    path: object,
    row0: int,
    fill: float | int | None = None,
) -> np.ndarray:
    """A list column as a 2-D numpy array; a wrong length or null names the row.

    Null lists are allowed only when ``fill`` is given (their rows are filled with it).
    Works on offsets and the flat values buffer, so it costs a few array passes per batch.
    """
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    n = len(col)
    valid = None
    if col.null_count:
        valid = col.is_valid().to_numpy(zero_copy_only=False)
        if fill is None:
            bad = int(np.flatnonzero(~valid)[0])
            raise TraceError(path, "is null", row=row0 + bad, column=name)
    lengths = np.diff(col.offsets.to_numpy(zero_copy_only=False))
    wrong = lengths != width if valid is None else valid & (lengths != width)
    if n and wrong.any():
        bad = int(np.flatnonzero(wrong)[0])
        raise TraceError(
            path, f"has {lengths[bad]} values, expected {width}", row=row0 + bad, column=name
        )
    values = col.flatten()  # the values of valid rows only, in row order
    if values.null_count:
        first = int(np.flatnonzero(~values.is_valid().to_numpy(zero_copy_only=False))[0])
        rows = np.flatnonzero(valid) if valid is not None else np.arange(n)
        bad = int(rows[first // width])
        raise TraceError(path, "contains a null value", row=row0 + bad, column=name)
    arr = values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    if valid is None:
        return arr.reshape(n, width)
    out = np.full((n, width), fill, dtype=dtype)
    out[valid] = arr.reshape(-1, width)
    return out


@dataclass
class _Rows:
    seq: np.ndarray
    pos: np.ndarray
    decode: np.ndarray
    layer: np.ndarray
    experts: np.ndarray
    weights: np.ndarray
    probs: np.ndarray
    prob_ids: np.ndarray | None
    early_experts: np.ndarray
    early_probs: np.ndarray
    early_prob_ids: np.ndarray | None
    filled: np.ndarray | None
    row0: int


def _decode_batch(
    path: object, batch: pa.RecordBatch | pa.Table, meta: TraceMeta, row0: int
) -> _Rows:
    """Arrow rows to numpy with per-row shape checks (lengths, nulls, phase names)."""
    k, width = meta.model.top_k, meta.probs_stored
    tbl = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])

    def scalar(name: str, dtype: Any) -> np.ndarray:
        col = tbl.column(name)
        if col.null_count:
            bad = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise TraceError(path, "is null", row=row0 + bad, column=name)
        return col.to_numpy().astype(dtype, copy=False)

    is_decode = _decode_phases(path, tbl, row0)
    names = tbl.column_names
    n = tbl.num_rows
    early = meta.early_view_recorded
    # what the file does not record is a placeholder here; _assemble makes the stand-ins
    return _Rows(
        seq=scalar("seq", np.int64),
        pos=scalar("pos", np.int64),
        decode=is_decode,
        layer=scalar("layer", np.int64),
        experts=_flat(tbl.column("experts"), k, np.int64, "experts", path, row0),
        weights=(
            _flat(tbl.column("weights"), k, np.float32, "weights", path, row0)
            if meta.weights_recorded
            else np.full((n, k), 1.0 / k, dtype=np.float32)
        ),
        probs=(
            _flat(tbl.column("probs"), width, np.float32, "probs", path, row0)
            if width
            else np.zeros((n, 0), dtype=np.float32)
        ),
        prob_ids=(
            _flat(tbl.column("prob_ids"), width, np.int64, "prob_ids", path, row0)
            if meta.top_m and "prob_ids" in names
            else None
        ),
        early_experts=(
            _flat(tbl.column("early_experts"), k, np.int64, "early_experts", path, row0, fill=-1)
            if early
            else np.full((n, k), -1, dtype=np.int64)
        ),
        early_probs=(
            _flat(
                tbl.column("early_probs"),
                width,
                np.float32,
                "early_probs",
                path,
                row0,
                fill=float("nan"),
            )
            if early and width
            else np.full((n, width), np.nan, dtype=np.float32)
        ),
        early_prob_ids=(
            _flat(
                tbl.column("early_prob_ids"), width, np.int64, "early_prob_ids", path, row0, fill=-1
            )
            if early and meta.top_m and "early_prob_ids" in names
            else (np.full((n, width), -1, dtype=np.int64) if meta.top_m else None)
        ),
        filled=scalar("filled", bool) if meta.filled_column else None,
        row0=row0,
    )


def _decode_phases(path: object, tbl: pa.Table, row0: int) -> np.ndarray:
    """Which rows are decode tokens; a null phase or one other than ``prefill``/``decode`` is
    refused by its row."""
    phase_col = tbl.column("phase")
    if pa.types.is_dictionary(phase_col.type):
        phase_col = phase_col.cast(pa.string())
    if phase_col.null_count:
        bad = int(np.flatnonzero(phase_col.is_null().to_numpy(zero_copy_only=False))[0])
        raise TraceError(path, "is null", row=row0 + bad, column="phase")
    is_decode = np.asarray(pc.equal(phase_col, "decode").to_numpy(zero_copy_only=False))
    is_prefill = np.asarray(pc.equal(phase_col, "prefill").to_numpy(zero_copy_only=False))
    if not (is_decode | is_prefill).all():
        bad = int(np.flatnonzero(~(is_decode | is_prefill))[0])
        raise TraceError(
            path,
            f"is {phase_col[bad].as_py()!r}, expected 'prefill' or 'decode'",
            row=row0 + bad,
            column="phase",
        )
    return is_decode


def _check_rows(path: object, r: _Rows, meta: TraceMeta) -> None:
    """Value checks on decoded rows; the first problem names its row and column."""
    m = meta.model
    n_layers, n_exp = m.moe_layers, m.experts

    def fail(mask: np.ndarray, column: str, msg: str) -> None:
        bad = (
            int(np.flatnonzero(mask)[0])
            if mask.ndim == 1
            else int(np.flatnonzero(mask.any(axis=1))[0])
        )
        raise TraceError(path, msg, row=r.row0 + bad, column=column)

    if (r.seq < 0).any():
        fail(r.seq < 0, "seq", "sequence id is negative")
    if (r.pos < 0).any():
        fail(r.pos < 0, "pos", "position is negative")
    if (r.pos > MAX_POSITION).any():
        i = int(np.flatnonzero(r.pos > MAX_POSITION)[0])
        fail(r.pos > MAX_POSITION, "pos", f"position {r.pos[i]} exceeds 2^31-1 (int32)")
    bad_layer = (r.layer < 0) | (r.layer >= n_layers)
    if bad_layer.any():
        i = int(np.flatnonzero(bad_layer)[0])
        fail(bad_layer, "layer", f"layer {r.layer[i]} outside 0..{n_layers - 1}")
    bad_e = (r.experts < 0) | (r.experts >= n_exp)
    if bad_e.any():
        i = int(np.flatnonzero(bad_e.any(axis=1))[0])
        fail(bad_e, "experts", f"expert id {r.experts[i][bad_e[i]][0]} outside 0..{n_exp - 1}")
    if m.top_k > 1:
        srt = np.sort(r.experts, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]).any(axis=1)
        if dup.any():
            fail(dup, "experts", "an expert is repeated within one token's top-k")
    w = r.weights
    bad_w = ~np.isfinite(w) | (w < 0)
    if bad_w.any():
        fail(bad_w, "weights", "gate weight is NaN, infinite or negative")
    p = r.probs
    bad_p = ~np.isfinite(p) | (p < 0) | (p > 1.001)
    if bad_p.any():
        fail(bad_p, "probs", "router probability is NaN, infinite or outside [0, 1]")
    if r.prob_ids is not None:
        bad_id = (r.prob_ids < -1) | (r.prob_ids >= n_exp)
        if bad_id.any():
            fail(bad_id, "prob_ids", f"expert id outside 0..{n_exp - 1}")
    check_rank_order(path, r, meta)
    if not meta.early_view_recorded:
        return
    # Layer 0 has no earlier layer; whatever a capture stored there is ignored (and dropped
    # by the reader), so only layers >= 1 are checked.
    checked = r.layer > 0
    missing = checked & (r.early_experts == -1).all(axis=1)
    if missing.any():
        fail(missing, "early_experts", "one-layer-early view is missing for a layer > 0")
    bad_ee = checked[:, None] & ((r.early_experts < 0) | (r.early_experts >= n_exp))
    if bad_ee.any():
        fail(bad_ee, "early_experts", f"expert id outside 0..{n_exp - 1}")
    if m.top_k > 1:
        srt = np.sort(r.early_experts, axis=1)
        dup = checked & (srt[:, 1:] == srt[:, :-1]).any(axis=1)
        if dup.any():
            fail(dup, "early_experts", "an expert is repeated within one token's early top-k")
    ep = r.early_probs
    bad_ep = checked[:, None] & (~np.isfinite(ep) | (ep < 0) | (ep > 1.001))
    if bad_ep.any():
        fail(bad_ep, "early_probs", "router probability is NaN, infinite or outside [0, 1]")
    if r.early_prob_ids is not None:
        bad_eid = checked[:, None] & ((r.early_prob_ids < -1) | (r.early_prob_ids >= n_exp))
        if bad_eid.any():
            fail(bad_eid, "early_prob_ids", f"expert id outside 0..{n_exp - 1}")


#: Stored columns that are non-increasing along rank when a trace does not say
#: (``provenance.rank_order_columns``): rank 0 is the top expert by gate weight and probability.
RANK_ORDER_COLUMNS = ("weights", "probs")
#: Slack for float rounding: float32 weights (relative), float16 probabilities (absolute).
_WEIGHT_RTOL, _PROB_ATOL = 1e-5, 1e-3


def weight_rises(w: np.ndarray) -> np.ndarray:
    """Where gate weights ``[..., k]`` rise along rank beyond float rounding (the rank-order
    check of ``weights``; importers use it to refuse data before writing it): a bool mask
    ``[..., k - 1]``, True at rank ``j + 1`` when it exceeds rank ``j``."""
    return w[..., 1:] > w[..., :-1] + (_WEIGHT_RTOL * np.abs(w[..., :-1]) + 1e-7)


def check_rank_order(path: object, r: _Rows, meta: TraceMeta) -> None:
    """Rank 0 must be the top expert: check ``experts``/``early_experts`` order where possible.

    ``provenance.rank_order_columns`` lists the stored columns that follow the router's
    selection score. ``weights`` there: gate weights are non-increasing along rank. ``probs``
    there: the router probabilities of ``experts`` (when the weights were not checked) and of
    ``early_experts`` (layers >= 1) are non-increasing along rank; with top-m storage an expert
    outside the stored m counts as the smallest stored probability (an upper bound on its
    own). A column the trace does not list is not checked: e.g. DeepSeek-V3 selects on sigmoid
    scores plus a bias correction that neither the weights nor the probabilities carry, so
    nothing stored can confirm its order.
    """
    cols = meta.provenance.get("rank_order_columns", RANK_ORDER_COLUMNS)
    if not isinstance(cols, list | tuple) or not all(c in RANK_ORDER_COLUMNS for c in cols):
        raise TraceError(
            path,
            "file metadata key 'provenance.rank_order_columns' must be a list of column "
            f"names out of {', '.join(repr(c) for c in RANK_ORDER_COLUMNS)}",
        )
    if meta.model.top_k < 2:
        return

    def check(
        values: np.ndarray, rows: np.ndarray, column: str, what: str, tol: np.ndarray
    ) -> None:
        rises = rows[:, None] & (values[:, 1:] > values[:, :-1] + tol)
        if rises.any():
            i = int(np.flatnonzero(rises.any(axis=1))[0])
            j = int(np.flatnonzero(rises[i])[0])
            raise TraceError(
                path,
                f"not in rank order: {what} at rank {j + 1} ({values[i, j + 1]:.6g}) exceeds "
                f"rank {j} ({values[i, j]:.6g}); rank 0 must be the top expert",
                row=r.row0 + i,
                column=column,
            )

    every = np.ones(r.layer.shape[0], dtype=bool)
    # what a version-2 file does not record cannot confirm the order (its stand-ins are flat)
    if not meta.weights_recorded:
        cols = [c for c in cols if c != "weights"]
    if not meta.probs_recorded:
        cols = [c for c in cols if c != "probs"]
    if "weights" in cols:
        w = r.weights
        check(w, every, "weights", "gate weight", _WEIGHT_RTOL * np.abs(w[:, :-1]) + 1e-7)
    if "probs" not in cols:
        return
    if "weights" not in cols:
        p = _ranked_probs(r.experts, r.probs, r.prob_ids)
        check(p, every, "experts", "router probability", np.float32(_PROB_ATOL))
    if not meta.early_view_recorded:
        return
    later = r.layer > 0  # layer 0 has no one-layer-early view
    ep = _ranked_probs(r.early_experts, r.early_probs, r.early_prob_ids)
    check(ep, later, "early_experts", "router probability", np.float32(_PROB_ATOL))


def _ranked_probs(experts: np.ndarray, probs: np.ndarray, ids: np.ndarray | None) -> np.ndarray:
    """Each ranked expert's stored probability; outside a top-m, the smallest stored one."""
    if ids is None:
        return np.take_along_axis(probs, np.clip(experts, 0, probs.shape[1] - 1), axis=1)
    match = ids[:, None, :] == experts[:, :, None]  # [rows, k, m]
    found = match.any(axis=2)
    at = np.take_along_axis(probs, match.argmax(axis=2), axis=1)
    return np.where(found, at, probs.min(axis=1, keepdims=True))


def _assemble(path: object, seq_id: int, parts: list[_Rows], meta: TraceMeta) -> SequenceRouting:
    """Rows of one sequence to token-major arrays; checks order and layer completeness."""

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts])

    positions, n_prefill = _token_order(
        path, seq_id, cat("layer"), cat("pos"), cat("decode"), parts[0].row0, meta
    )
    t, n_layers = positions.shape[0], meta.model.moe_layers
    k, width = meta.model.top_k, meta.probs_stored
    ids = cat("prob_ids") if parts[0].prob_ids is not None else None
    eids = cat("early_prob_ids") if parts[0].early_prob_ids is not None else None
    early_experts = cat("early_experts").astype(np.int16).reshape(t, n_layers, k)
    early_probs = cat("early_probs").reshape(t, n_layers, width)
    if eids is not None:
        eids = eids.astype(np.int16).reshape(t, n_layers, width)
    experts = cat("experts").astype(np.int16).reshape(t, n_layers, k)
    weights = cat("weights").reshape(t, n_layers, k)
    probs = cat("probs").reshape(t, n_layers, width)
    pids = None if ids is None else ids.astype(np.int16).reshape(t, n_layers, width)
    if not meta.probs_recorded:
        # stand-in: the (renormalised) gate weights on the selected experts, zero elsewhere
        total = weights.sum(axis=2, keepdims=True)
        probs = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
        pids = experts.copy()
        eids = early_experts.copy()
        early_probs = np.where(eids >= 0, np.float32(1.0 / k), np.float32(np.nan))
    # whatever a capture stored for layer 0's early view is dropped
    blank_first_layer_view(early_experts, early_probs, eids)
    filled = cat("filled").reshape(t, n_layers) if parts[0].filled is not None else None
    return SequenceRouting(
        seq_id=seq_id,
        positions=positions.astype(np.int32),
        n_prefill=n_prefill,
        experts=experts,
        weights=weights,
        probs=probs,
        early_experts=early_experts,
        early_probs=early_probs,
        prob_ids=pids,
        early_prob_ids=eids,
        early_recorded=meta.early_view_recorded,
        weights_recorded=meta.weights_recorded,
        probs_recorded=meta.probs_recorded,
        filled=filled,
    )


def _token_order(
    path: object,
    seq_id: int,
    layer: np.ndarray,
    pos: np.ndarray,
    decode: np.ndarray,
    row0: int,
    meta: TraceMeta,
) -> tuple[np.ndarray, int]:
    """One sequence's rows checked as tokens: every token has layers 0..L-1 in order, one
    position and one phase; positions increase; prefill tokens come first. Each token's
    position, and how many are prefill tokens."""
    n_layers = meta.model.moe_layers
    n = layer.shape[0]
    expected_layer = np.arange(n) % n_layers
    if n % n_layers or (layer != expected_layer).any():
        bad = np.flatnonzero(layer != expected_layer)
        i = int(bad[0]) if bad.size else n - 1
        raise TraceError(
            path,
            f"sequence {seq_id}: expected layer {expected_layer[i]} "
            f"(each token needs layers 0..{n_layers - 1} in order)",
            row=row0 + i,
            column="layer",
        )
    t = n // n_layers
    pos2 = pos.reshape(t, n_layers)
    if (pos2 != pos2[:, :1]).any():
        i = int(np.flatnonzero((pos2 != pos2[:, :1]).reshape(-1))[0])
        raise TraceError(
            path,
            f"sequence {seq_id}: position changes within one token's layers",
            row=row0 + i,
            column="pos",
        )
    positions = pos2[:, 0]
    if t > 1 and (np.diff(positions) <= 0).any():
        i = int(np.flatnonzero(np.diff(positions) <= 0)[0]) + 1
        raise TraceError(
            path,
            f"sequence {seq_id}: positions not increasing",
            row=row0 + i * n_layers,
            column="pos",
        )
    dec = decode.reshape(t, n_layers)
    if (dec != dec[:, :1]).any():
        i = int(np.flatnonzero((dec != dec[:, :1]).reshape(-1))[0])
        raise TraceError(
            path,
            f"sequence {seq_id}: phase changes within one token's layers",
            row=row0 + i,
            column="phase",
        )
    tok_dec = dec[:, 0]
    n_prefill = int((~tok_dec).sum())
    if tok_dec[:n_prefill].any():
        first_decode = int(np.argmax(tok_dec))
        i = first_decode + int(np.argmin(tok_dec[first_decode:]))  # first prefill after it
        raise TraceError(
            path,
            f"sequence {seq_id}: a prefill token follows a decode token",
            row=row0 + i * n_layers,
            column="phase",
        )
    return positions, n_prefill


def sequence_ids(path: str | os.PathLike[str]) -> list[int]:
    """Sequence ids in file order (reads only the ``seq`` column)."""
    # damaged pages must be a TraceError naming the file, like every other trace read
    pf = _open(path)
    ids: list[int] = []
    batches = pf.iter_batches(columns=["seq"], batch_size=1 << 20)
    while True:
        try:
            batch = next(batches, None)
            if batch is None:
                break
            arr = batch.column(0).to_numpy()
        except _READ_ERRORS as exc:
            raise TraceError(
                path, f"unreadable data in column 'seq' ({_first_line(exc)})"
            ) from None
        if arr.size == 0:
            continue
        cuts = np.flatnonzero(np.diff(arr)) + 1
        for v in arr[np.concatenate(([0], cuts))].tolist():
            if not ids or ids[-1] != v:
                ids.append(int(v))
    return ids


#: why a trace without rows is refused: every statistic and run over it would be empty
EMPTY_TRACE = "holds no sequences (0 rows); a trace needs at least one token of one sequence"


def checked_sequence_ids(path: str | os.PathLike[str], meta: TraceMeta) -> list[int]:
    """Sequence ids in file order, after checking the metadata counts against the rows.

    Reads only the ``seq``, ``layer`` and ``phase`` (and ``filled``) columns, so it is cheap
    next to a run; a count in the metadata that disagrees with the data is a ``TraceError``
    naming the key (the metadata is never trusted over the rows).
    """
    pf = _open(path)
    columns = ["seq", "layer", "phase"] + (["filled"] if meta.filled_column else [])
    check_schema(path, pf.schema_arrow, meta)
    ids: list[int] = []
    found = dict.fromkeys(COUNT_KEYS, 0)
    if meta.filled_column:
        found[FILLED_KEY] = 0
    try:
        for batch in pf.iter_batches(columns=columns, batch_size=1 << 20):
            seq = batch.column(0).to_numpy()
            if seq.size == 0:
                continue
            first = batch.column(1).to_numpy() == 0
            phase = batch.column(2)
            if pa.types.is_dictionary(phase.type):
                phase = phase.cast(pa.string())
            prefill = np.asarray(pc.equal(phase, "prefill").to_numpy(zero_copy_only=False))
            found["rows"] += int(seq.size)
            found["prefill_tokens"] += int(np.count_nonzero(first & prefill))
            found["decode_tokens"] += int(np.count_nonzero(first & ~prefill))
            if meta.filled_column:
                found[FILLED_KEY] += int(pc.sum(batch.column(3)).as_py() or 0)
            cuts = np.flatnonzero(np.diff(seq)) + 1
            for v in seq[np.concatenate(([0], cuts))].tolist():
                if not ids or ids[-1] != v:
                    ids.append(int(v))
    except _READ_ERRORS as exc:
        raise TraceError(path, f"unreadable data ({_first_line(exc)})") from None
    found["sequences"] = len(ids)
    for key, value in found.items():
        if key in meta.counts and meta.counts[key] != value:
            raise TraceError(
                path, f"file metadata counts.{key} = {meta.counts[key]} but the file has {value}"
            )
    if not ids:
        raise TraceError(path, EMPTY_TRACE)
    return ids


def iter_sequences(
    path: str | os.PathLike[str],
    meta: TraceMeta | None = None,
    sequences: set[int] | None = None,
    batch_rows: int = 65536,
) -> Iterator[SequenceRouting]:
    """Stream a trace sequence by sequence (memory bounded by one sequence plus one batch).

    ``sequences`` restricts to those sequence ids (others are skipped without assembling).
    Raises ``TraceError`` naming the file, row and column of the first problem met.
    """
    meta = meta or read_meta(path)
    pf = _open(path)
    check_schema(path, pf.schema_arrow, meta)
    wanted = list(schema_for(meta).names)
    parts: list[_Rows] = []
    current: int | None = None
    seen: set[int] = set()
    row0 = 0
    try:
        batches = pf.iter_batches(batch_size=batch_rows, columns=wanted)
        for batch in batches:
            rows = _decode_batch(path, batch, meta, row0)
            _check_rows(path, rows, meta)
            row0 += batch.num_rows
            # split the batch where the sequence id changes
            cuts = np.flatnonzero(np.diff(rows.seq)) + 1
            bounds = [0, *cuts.tolist(), len(rows.seq)]
            for a, b in itertools.pairwise(bounds):
                if a == b:
                    continue
                sid = int(rows.seq[a])
                piece = _slice_rows(rows, a, b)
                if sid != current:
                    if current is not None and (sequences is None or current in sequences):
                        yield _assemble(path, current, parts, meta)
                    if sid in seen:
                        raise TraceError(
                            path,
                            f"sequence {sid} appears in two separate runs "
                            "of rows (rows must be grouped by sequence)",
                            row=piece.row0,
                            column="seq",
                        )
                    seen.add(sid)
                    current, parts = sid, []
                if sequences is None or sid in sequences:
                    parts.append(piece)
        if current is not None and (sequences is None or current in sequences):
            yield _assemble(path, current, parts, meta)
        if current is None:
            raise TraceError(path, EMPTY_TRACE)
    except _READ_ERRORS as exc:
        raise TraceError(
            path,
            f"unreadable data near row {row0} ({_first_line(exc)})",
        ) from None


def _slice_rows(r: _Rows, a: int, b: int) -> _Rows:
    def s(x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else x[a:b]

    return _Rows(
        seq=r.seq[a:b],
        pos=r.pos[a:b],
        decode=r.decode[a:b],
        layer=r.layer[a:b],
        experts=r.experts[a:b],
        weights=r.weights[a:b],
        probs=r.probs[a:b],
        prob_ids=s(r.prob_ids),
        early_experts=r.early_experts[a:b],
        early_probs=r.early_probs[a:b],
        early_prob_ids=s(r.early_prob_ids),
        filled=s(r.filled),
        row0=r.row0 + a,
    )


def validate_trace(path: str | os.PathLike[str]) -> TraceMeta:
    """Check a whole trace (metadata, schema, every row, counts); returns its metadata.

    Raises ``TraceError`` naming the file, and where it applies the row (0-based, in file
    order) and the column, of the first problem. Streams by row group: memory stays flat.
    """
    meta = read_meta(path)
    for key in COUNT_KEYS:
        if key not in meta.counts:
            raise TraceError(path, f"file metadata key 'counts' is missing {key!r}")
    pf = _open(path)
    check_schema(path, pf.schema_arrow, meta)
    file_rows = pf.metadata.num_rows
    if meta.counts["rows"] != file_rows:
        raise TraceError(
            path,
            f"file metadata counts.rows = {meta.counts['rows']} but the file has {file_rows} rows",
        )
    counts = dict.fromkeys(COUNT_KEYS, 0)
    if meta.filled_column:
        counts[FILLED_KEY] = 0
    for routing in iter_sequences(path, meta):
        counts["rows"] += routing.n_tokens * meta.model.moe_layers
        counts["sequences"] += 1
        counts["prefill_tokens"] += routing.n_prefill
        counts["decode_tokens"] += routing.n_decode
        if routing.filled is not None:
            counts[FILLED_KEY] += int(np.count_nonzero(routing.filled))
    for key, value in counts.items():
        if meta.counts[key] != value:
            raise TraceError(
                path, f"file metadata counts.{key} = {meta.counts[key]} but the file has {value}"
            )
    if not counts["sequences"]:
        raise TraceError(path, EMPTY_TRACE)
    return meta


def load_sequences(
    path: str | os.PathLike[str], sequences: set[int] | None = None
) -> tuple[TraceMeta, list[SequenceRouting]]:
    """Read (selected) sequences of a trace into memory."""
    meta = read_meta(path)
    return meta, list(iter_sequences(path, meta, sequences=sequences))
