"""Routing traces: the Parquet format, atomic writing, streaming reading and validation.

One row per (sequence, token position, MoE layer). The format is documented in
docs/trace-format.md; ``SCHEMA_VERSION`` goes in the file metadata under the key ``daopsim``.
Rows are ordered by sequence, then position, then layer, and every token has one row per MoE
layer, so a sequence reshapes to ``[tokens, layers, k]`` arrays without copying.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from simulator.errors import TraceError, UserError
from simulator.models import ModelShape

SCHEMA_VERSION = 1
META_KEY = b"daopsim"
PHASES = ("prefill", "decode")
#: Above this many experts per layer, only the top ``m`` router probabilities are stored.
ALL_PROBS_MAX_EXPERTS = 128

_INT = pa.int16()
_PROB = pa.float16()


def arrow_schema(top_m: bool) -> pa.Schema:
    """The Arrow schema of a trace; ``top_m`` adds the id columns for partial distributions."""
    fields = [
        pa.field("seq", pa.int32(), nullable=False),
        pa.field("pos", pa.int32(), nullable=False),
        pa.field("phase", pa.string(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("experts", pa.list_(_INT), nullable=False),
        pa.field("weights", pa.list_(pa.float32()), nullable=False),
        pa.field("probs", pa.list_(_PROB), nullable=False),
        pa.field("early_experts", pa.list_(_INT), nullable=True),
        pa.field("early_probs", pa.list_(_PROB), nullable=True),
    ]
    if top_m:
        fields.insert(7, pa.field("prob_ids", pa.list_(_INT), nullable=False))
        fields.append(pa.field("early_prob_ids", pa.list_(_INT), nullable=True))
    return pa.schema(fields)


REQUIRED_COLUMNS = tuple(arrow_schema(False).names)


@dataclass
class TraceMeta:
    """File-level metadata: model shape, provenance, counts and how probabilities are stored."""

    model: ModelShape
    provenance: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    probs_stored: int = 0  # experts per row in ``probs``: E (all) or m (top-m)
    moe_layer_ids: list[int] = field(default_factory=list)
    calibration_sequences: list[int] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    @property
    def top_m(self) -> bool:
        """True when only the top ``probs_stored`` probabilities (with ids) are stored."""
        return self.probs_stored < self.model.experts

    def to_json(self) -> str:
        """Serialise for the Parquet footer."""
        return json.dumps(
            {
                "schema_version": self.schema_version,
                "model": self.model.to_dict(),
                "provenance": self.provenance,
                "counts": self.counts,
                "probs_stored": self.probs_stored,
                "moe_layer_ids": self.moe_layer_ids,
                "calibration_sequences": self.calibration_sequences,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, path: object, text: str | bytes) -> TraceMeta:
        """Parse footer metadata; errors name the file and the missing or bad key."""
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError):
            raise TraceError(path, "file metadata 'daopsim' is not valid JSON") from None
        if not isinstance(data, dict):
            raise TraceError(path, "file metadata 'daopsim' is not a JSON object")
        for key in ("schema_version", "model", "provenance", "counts", "probs_stored"):
            if key not in data:
                raise TraceError(path, f"file metadata is missing key {key!r}")
        if data["schema_version"] != SCHEMA_VERSION:
            raise TraceError(
                path, f"schema_version {data['schema_version']!r} is not supported "
                f"(this daopsim reads {SCHEMA_VERSION})"
            )
        try:
            model = ModelShape.from_dict(data["model"])
        except (UserError, TypeError) as exc:
            raise TraceError(path, f"file metadata 'model' is invalid: {exc}") from None
        meta = cls(
            model=model,
            provenance=dict(data["provenance"]),
            counts={k: int(v) for k, v in dict(data["counts"]).items()},
            probs_stored=int(data["probs_stored"]),
            moe_layer_ids=list(data.get("moe_layer_ids") or range(model.moe_layers)),
            calibration_sequences=[int(s) for s in data.get("calibration_sequences") or []],
        )
        if not 0 < meta.probs_stored <= model.experts:
            raise TraceError(path, f"probs_stored {meta.probs_stored} outside 1..{model.experts}")
        return meta


@dataclass
class SequenceRouting:
    """The routing of one sequence, token-major: arrays shaped ``[tokens, layers, ...]``.

    ``early_*`` is layer l's router applied to layer l-1's router input (the one-layer-early
    view); for layer 0 it is absent (``early_experts`` = -1, ``early_probs`` = NaN).
    When ``prob_ids`` is None, ``probs[..., e]`` is expert e's probability; otherwise
    ``probs[..., j]`` belongs to expert ``prob_ids[..., j]``.
    """

    seq_id: int
    positions: np.ndarray  # int32 [T]
    n_prefill: int
    experts: np.ndarray  # int16 [T, L, k]
    weights: np.ndarray  # float32 [T, L, k]
    probs: np.ndarray  # float32 [T, L, P]
    early_experts: np.ndarray  # int16 [T, L, k]
    early_probs: np.ndarray  # float32 [T, L, P]
    prob_ids: np.ndarray | None = None
    early_prob_ids: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        """Prefill plus decode tokens."""
        return int(self.positions.shape[0])

    @property
    def n_decode(self) -> int:
        """Generated (decode) tokens."""
        return self.n_tokens - self.n_prefill

    def full_probs(self, experts: int, early: bool = False) -> np.ndarray:
        """Dense ``[T, L, E]`` probabilities (zeros for experts outside a stored top-m)."""
        probs = self.early_probs if early else self.probs
        ids = self.early_prob_ids if early else self.prob_ids
        if ids is None:
            return probs
        out = np.zeros(probs.shape[:2] + (experts,), dtype=np.float32)
        valid = ids >= 0
        t, l_, j = np.nonzero(valid)
        out[t, l_, ids[t, l_, j]] = probs[t, l_, j]
        return out


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _list_array(values: np.ndarray, typ: pa.DataType, null_rows: np.ndarray | None = None
                ) -> pa.Array:
    """A list column from a 2-D array (fixed length per row), optionally with null rows."""
    n, width = values.shape
    flat = pa.array(values.reshape(-1), type=typ)
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
    mask = None if null_rows is None or not null_rows.any() else pa.array(null_rows)
    return pa.ListArray.from_arrays(offsets, flat, mask=mask)


def sequence_table(routing: SequenceRouting, meta: TraceMeta) -> pa.Table:
    """The rows of one sequence as an Arrow table in file order."""
    t, n_layers, k = routing.experts.shape
    n = t * n_layers
    width = routing.probs.shape[2]
    layer = np.tile(np.arange(n_layers, dtype=np.int16), t)
    pos = np.repeat(routing.positions.astype(np.int32), n_layers)
    phase_idx = np.repeat((np.arange(t) >= routing.n_prefill).astype(np.int8), n_layers)
    phase = pa.DictionaryArray.from_arrays(pa.array(phase_idx), pa.array(PHASES)).cast(
        pa.string()
    )
    early_null = layer == 0
    cols: dict[str, pa.Array] = {
        "seq": pa.array(np.full(n, routing.seq_id, dtype=np.int32)),
        "pos": pa.array(pos),
        "phase": phase,
        "layer": pa.array(layer),
        "experts": _list_array(routing.experts.reshape(n, k).astype(np.int16), _INT),
        "weights": _list_array(routing.weights.reshape(n, k).astype(np.float32), pa.float32()),
        "probs": _list_array(routing.probs.reshape(n, width).astype(np.float16), _PROB),
    }
    if meta.top_m:
        assert routing.prob_ids is not None and routing.early_prob_ids is not None
        cols["prob_ids"] = _list_array(routing.prob_ids.reshape(n, width).astype(np.int16), _INT)
    cols["early_experts"] = _list_array(
        routing.early_experts.reshape(n, k).astype(np.int16), _INT, early_null
    )
    cols["early_probs"] = _list_array(
        np.nan_to_num(routing.early_probs.reshape(n, width)).astype(np.float16), _PROB, early_null
    )
    if meta.top_m:
        cols["early_prob_ids"] = _list_array(
            routing.early_prob_ids.reshape(n, width).astype(np.int16), _INT, early_null
        )
    return pa.Table.from_pydict(cols, schema=arrow_schema(meta.top_m))


def tool_versions() -> dict[str, str]:
    """Versions of the tools that shape a trace's content (recorded in provenance)."""
    import importlib.metadata as md

    out = {}
    for name in ("daopsim", "numpy", "pyarrow", "torch", "transformers"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    return out


class TraceWriter:
    """Stream sequences into a trace file; the file appears (atomically) only on success.

    Use as a context manager. Each ``write_sequence`` call appends one or more row groups;
    counts are accumulated and written to the footer metadata on close. If the block raises,
    the temporary file is removed and nothing is left at ``path``.
    """

    def __init__(self, path: str | os.PathLike[str], meta: TraceMeta,
                 row_group_rows: int = 65536, compression: str = "zstd") -> None:
        self.path = Path(path)
        self.meta = meta
        self.row_group_rows = row_group_rows
        self.compression = compression
        self._counts = {"rows": 0, "sequences": 0, "prefill_tokens": 0, "decode_tokens": 0}
        self._writer: pq.ParquetWriter | None = None
        self._tmp: str | None = None

    def __enter__(self) -> TraceWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp",
                                         dir=self.path.parent)
        os.close(fd)
        schema = arrow_schema(self.meta.top_m)
        self._writer = pq.ParquetWriter(self._tmp, schema, compression=self.compression,
                                        use_dictionary=["phase"])
        return self

    def write_sequence(self, routing: SequenceRouting) -> None:
        """Append one sequence (rows must follow the previous sequence's)."""
        assert self._writer is not None, "use TraceWriter as a context manager"
        table = sequence_table(routing, self.meta)
        self._writer.write_table(table, row_group_size=self.row_group_rows)
        self._counts["rows"] += table.num_rows
        self._counts["sequences"] += 1
        self._counts["prefill_tokens"] += routing.n_prefill
        self._counts["decode_tokens"] += routing.n_decode

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        assert self._writer is not None and self._tmp is not None
        try:
            if exc_type is None:
                self.meta.counts = dict(self._counts)
                if not self.meta.provenance.get("tool_versions"):
                    self.meta.provenance["tool_versions"] = tool_versions()
                self.meta.provenance.setdefault(
                    "created", _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
                )
                self._writer.add_key_value_metadata({META_KEY: self.meta.to_json().encode()})
            self._writer.close()
            if exc_type is None:
                os.replace(self._tmp, self.path)
        finally:
            if os.path.exists(self._tmp):
                os.unlink(self._tmp)


def write_trace(path: str | os.PathLike[str], meta: TraceMeta,
                sequences: list[SequenceRouting] | Iterator[SequenceRouting],
                row_group_rows: int = 65536) -> Path:
    """Write sequences to ``path`` atomically (temporary file, then rename); returns the path."""
    with TraceWriter(path, meta, row_group_rows=row_group_rows) as writer:
        for routing in sequences:
            writer.write_sequence(routing)
    return Path(path)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _open(path: str | os.PathLike[str]) -> pq.ParquetFile:
    p = Path(path)
    if not p.exists():
        raise TraceError(p, "no such file")
    if p.is_dir():
        raise TraceError(p, "is a directory, not a trace file")
    try:
        return pq.ParquetFile(p)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TraceError(p, f"not a readable Parquet file ({first})") from None


def read_meta(path: str | os.PathLike[str]) -> TraceMeta:
    """Read and check a trace's footer metadata (fast: no row data)."""
    pf = _open(path)
    kv = pf.metadata.metadata or {}
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
    expected = arrow_schema(meta.top_m)
    for f in expected:
        idx = schema.get_field_index(f.name)
        if idx < 0:
            raise TraceError(path, "missing column", column=f.name)
        actual = schema.field(idx).type
        if not _column_type_ok(actual, f.type):
            raise TraceError(path, f"has type {actual}, expected {f.type}", column=f.name)


def _flat(col: pa.ChunkedArray | pa.Array, width: int, dtype: Any, name: str, path: object,
          row0: int, fill: float | int | None = None) -> np.ndarray:
    """A list column as a 2-D numpy array; a wrong length or null names the row."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    n = len(col)
    nulls = col.is_null()
    has_null = col.null_count > 0
    if has_null and fill is None:
        bad = int(np.flatnonzero(nulls.to_numpy(zero_copy_only=False))[0])
        raise TraceError(path, "is null", row=row0 + bad, column=name)
    lengths = col.value_lengths().fill_null(width).to_numpy(zero_copy_only=False)
    if n and (lengths != width).any():
        bad = int(np.flatnonzero(lengths != width)[0])
        raise TraceError(path, f"has {lengths[bad]} values, expected {width}", row=row0 + bad,
                         column=name)
    if has_null:
        col = col.fill_null(pa.array([[fill] * width], type=col.type)[0])
    values = col.flatten()
    if values.null_count:
        raise TraceError(path, "contains a null value", row=row0, column=name)
    arr = values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return arr.reshape(n, width)


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
    row0: int


def _decode_batch(path: object, batch: pa.RecordBatch | pa.Table, meta: TraceMeta, row0: int
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

    phase_col = tbl.column("phase")
    if pa.types.is_dictionary(phase_col.type):
        phase_col = phase_col.cast(pa.string())
    if phase_col.null_count:
        bad = int(np.flatnonzero(phase_col.is_null().to_numpy(zero_copy_only=False))[0])
        raise TraceError(path, "is null", row=row0 + bad, column="phase")
    is_decode = np.asarray(pa.compute.equal(phase_col, "decode").to_numpy(zero_copy_only=False))
    is_prefill = np.asarray(
        pa.compute.equal(phase_col, "prefill").to_numpy(zero_copy_only=False)
    )
    if not (is_decode | is_prefill).all():
        bad = int(np.flatnonzero(~(is_decode | is_prefill))[0])
        raise TraceError(path, f"is {phase_col[bad].as_py()!r}, expected 'prefill' or 'decode'",
                         row=row0 + bad, column="phase")
    names = tbl.column_names
    return _Rows(
        seq=scalar("seq", np.int64),
        pos=scalar("pos", np.int64),
        decode=is_decode,
        layer=scalar("layer", np.int64),
        experts=_flat(tbl.column("experts"), k, np.int64, "experts", path, row0),
        weights=_flat(tbl.column("weights"), k, np.float32, "weights", path, row0),
        probs=_flat(tbl.column("probs"), width, np.float32, "probs", path, row0),
        prob_ids=(_flat(tbl.column("prob_ids"), width, np.int64, "prob_ids", path, row0)
                  if meta.top_m and "prob_ids" in names else None),
        early_experts=_flat(tbl.column("early_experts"), k, np.int64, "early_experts", path,
                            row0, fill=-1),
        early_probs=_flat(tbl.column("early_probs"), width, np.float32, "early_probs", path,
                          row0, fill=float("nan")),
        early_prob_ids=(_flat(tbl.column("early_prob_ids"), width, np.int64, "early_prob_ids",
                              path, row0, fill=-1)
                        if meta.top_m and "early_prob_ids" in names else None),
        row0=row0,
    )


def _check_rows(path: object, r: _Rows, meta: TraceMeta) -> None:
    """Value checks on decoded rows; the first problem names its row and column."""
    m = meta.model
    n_layers, n_exp = m.moe_layers, m.experts

    def fail(mask: np.ndarray, column: str, msg: str) -> None:
        bad = int(np.flatnonzero(mask)[0]) if mask.ndim == 1 else int(
            np.flatnonzero(mask.any(axis=1))[0])
        raise TraceError(path, msg, row=r.row0 + bad, column=column)

    if (r.seq < 0).any():
        fail(r.seq < 0, "seq", "sequence id is negative")
    if (r.pos < 0).any():
        fail(r.pos < 0, "pos", "position is negative")
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
    has_early = r.early_experts[:, 0] >= 0
    if (has_early & (r.layer == 0)).any():
        pass  # an early view at layer 0 is tolerated (ignored): some captures record it
    missing = ~has_early & (r.layer > 0)
    if missing.any():
        fail(missing, "early_experts", "one-layer-early view is missing for a layer > 0")
    ee = r.early_experts[has_early]
    bad_ee = (ee < 0) | (ee >= n_exp)
    if bad_ee.any():
        sub = np.zeros_like(r.early_experts, dtype=bool)
        sub[has_early] = bad_ee
        fail(sub, "early_experts", f"expert id outside 0..{n_exp - 1}")
    ep = r.early_probs[has_early]
    bad_ep = ~np.isfinite(ep) | (ep < 0) | (ep > 1.001)
    if bad_ep.any():
        sub = np.zeros_like(r.early_probs, dtype=bool)
        sub[has_early] = bad_ep
        fail(sub, "early_probs", "probability is NaN, infinite or outside [0, 1]")


def _assemble(path: object, seq_id: int, parts: list[_Rows], meta: TraceMeta) -> SequenceRouting:
    """Rows of one sequence to token-major arrays; checks order and layer completeness."""

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts])

    layer, pos, decode = cat("layer"), cat("pos"), cat("decode")
    row0 = parts[0].row0
    n_layers = meta.model.moe_layers
    n = layer.shape[0]
    expected_layer = np.arange(n) % n_layers
    if n % n_layers or (layer != expected_layer).any():
        bad = np.flatnonzero(layer != expected_layer)
        i = int(bad[0]) if bad.size else n - 1
        raise TraceError(path, f"sequence {seq_id}: expected layer {expected_layer[i]} "
                         f"(each token needs layers 0..{n_layers - 1} in order)",
                         row=row0 + i, column="layer")
    t = n // n_layers
    pos2 = pos.reshape(t, n_layers)
    if (pos2 != pos2[:, :1]).any():
        i = int(np.flatnonzero((pos2 != pos2[:, :1]).reshape(-1))[0])
        raise TraceError(path, f"sequence {seq_id}: position changes within one token's layers",
                         row=row0 + i, column="pos")
    positions = pos2[:, 0]
    if t > 1 and (np.diff(positions) <= 0).any():
        i = int(np.flatnonzero(np.diff(positions) <= 0)[0]) + 1
        raise TraceError(path, f"sequence {seq_id}: positions not increasing",
                         row=row0 + i * n_layers, column="pos")
    dec = decode.reshape(t, n_layers)
    if (dec != dec[:, :1]).any():
        i = int(np.flatnonzero((dec != dec[:, :1]).reshape(-1))[0])
        raise TraceError(path, f"sequence {seq_id}: phase changes within one token's layers",
                         row=row0 + i, column="phase")
    tok_dec = dec[:, 0]
    n_prefill = int((~tok_dec).sum())
    if tok_dec[:n_prefill].any():
        i = int(np.flatnonzero(tok_dec[:n_prefill])[0])
        raise TraceError(path, f"sequence {seq_id}: a prefill token follows a decode token",
                         row=row0 + i * n_layers, column="phase")
    k, width = meta.model.top_k, meta.probs_stored
    ids = cat("prob_ids") if parts[0].prob_ids is not None else None
    eids = cat("early_prob_ids") if parts[0].early_prob_ids is not None else None
    return SequenceRouting(
        seq_id=seq_id,
        positions=positions.astype(np.int32),
        n_prefill=n_prefill,
        experts=cat("experts").astype(np.int16).reshape(t, n_layers, k),
        weights=cat("weights").reshape(t, n_layers, k),
        probs=cat("probs").reshape(t, n_layers, width),
        early_experts=cat("early_experts").astype(np.int16).reshape(t, n_layers, k),
        early_probs=cat("early_probs").reshape(t, n_layers, width),
        prob_ids=None if ids is None else ids.astype(np.int16).reshape(t, n_layers, width),
        early_prob_ids=None if eids is None else eids.astype(np.int16).reshape(t, n_layers, width),
    )


def iter_sequences(path: str | os.PathLike[str], meta: TraceMeta | None = None,
                   sequences: set[int] | None = None, batch_rows: int = 65536
                   ) -> Iterator[SequenceRouting]:
    """Stream a trace sequence by sequence (memory bounded by one sequence plus one batch).

    ``sequences`` restricts to those sequence ids (others are skipped without assembling).
    Raises ``TraceError`` naming the file, row and column of the first problem met.
    """
    meta = meta or read_meta(path)
    pf = _open(path)
    check_schema(path, pf.schema_arrow, meta)
    wanted = list(arrow_schema(meta.top_m).names)
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
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                if a == b:
                    continue
                sid = int(rows.seq[a])
                piece = _slice_rows(rows, a, b)
                if sid != current:
                    if current is not None and (sequences is None or current in sequences):
                        yield _assemble(path, current, parts, meta)
                    if sid in seen:
                        raise TraceError(path, f"sequence {sid} appears in two separate runs "
                                         "of rows (rows must be grouped by sequence)",
                                         row=piece.row0, column="seq")
                    seen.add(sid)
                    current, parts = sid, []
                if sequences is None or sid in sequences:
                    parts.append(piece)
        if current is not None and (sequences is None or current in sequences):
            yield _assemble(path, current, parts, meta)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TraceError(path, f"unreadable data near row {row0} ({first})") from None


def _slice_rows(r: _Rows, a: int, b: int) -> _Rows:
    def s(x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else x[a:b]

    return _Rows(seq=r.seq[a:b], pos=r.pos[a:b], decode=r.decode[a:b], layer=r.layer[a:b],
                 experts=r.experts[a:b], weights=r.weights[a:b], probs=r.probs[a:b],
                 prob_ids=s(r.prob_ids), early_experts=r.early_experts[a:b],
                 early_probs=r.early_probs[a:b], early_prob_ids=s(r.early_prob_ids),
                 row0=r.row0 + a)


def validate_trace(path: str | os.PathLike[str]) -> TraceMeta:
    """Check a whole trace (metadata, schema, every row, counts); returns its metadata.

    Raises ``TraceError`` naming the file, and where it applies the row and the column, of the
    first problem.
    """
    meta = read_meta(path)
    counts = {"rows": 0, "sequences": 0, "prefill_tokens": 0, "decode_tokens": 0}
    for routing in iter_sequences(path, meta):
        counts["rows"] += routing.n_tokens * meta.model.moe_layers
        counts["sequences"] += 1
        counts["prefill_tokens"] += routing.n_prefill
        counts["decode_tokens"] += routing.n_decode
    for key, value in counts.items():
        if key not in meta.counts:
            raise TraceError(path, f"file metadata counts is missing {key!r}")
        if meta.counts[key] != value:
            raise TraceError(path, f"metadata counts.{key} = {meta.counts[key]} but the file "
                             f"has {value}")
    return meta


def load_sequences(path: str | os.PathLike[str], sequences: set[int] | None = None
                   ) -> tuple[TraceMeta, list[SequenceRouting]]:
    """Read (selected) sequences of a trace into memory."""
    meta = read_meta(path)
    return meta, list(iter_sequences(path, meta, sequences=sequences))
