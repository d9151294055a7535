"""Writing routing traces: sequences into Parquet row groups, atomically (a temporary file
renamed into place only on success), with the counts and provenance in the footer.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from daopsim.simulator.trace_format import (
    _INT,
    _PROB,
    COUNT_KEYS,
    FILLED_KEY,
    META_KEY,
    PHASES,
    SequenceRouting,
    TraceMeta,
    schema_for,
)


def _list_array(
    values: np.ndarray, typ: pa.DataType, null_rows: np.ndarray | None = None
) -> pa.Array:
    """A list column from a 2-D array (fixed length per row), optionally with null rows."""
    n, width = values.shape
    flat = pa.array(values.reshape(-1), type=typ)
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
    mask = None if null_rows is None or not null_rows.any() else pa.array(null_rows)
    return pa.ListArray.from_arrays(offsets, flat, mask=mask)


def sequence_table(routing: SequenceRouting, meta: TraceMeta) -> pa.Table:
    """The rows of one sequence as an Arrow table in file order (the columns of ``meta``)."""
    t, n_layers, k = routing.experts.shape
    n = t * n_layers
    width = meta.probs_stored
    layer = np.tile(np.arange(n_layers, dtype=np.int16), t)
    pos = np.repeat(routing.positions.astype(np.int32), n_layers)
    phase_idx = np.repeat((np.arange(t) >= routing.n_prefill).astype(np.int8), n_layers)
    phase = pa.DictionaryArray.from_arrays(pa.array(phase_idx), pa.array(PHASES)).cast(pa.string())
    early_null = layer == 0
    cols: dict[str, pa.Array] = {
        "seq": pa.array(np.full(n, routing.seq_id, dtype=np.int32)),
        "pos": pa.array(pos),
        "phase": phase,
        "layer": pa.array(layer),
        "experts": _list_array(routing.experts.reshape(n, k).astype(np.int16), _INT),
    }
    if meta.weights_recorded:
        cols["weights"] = _list_array(
            routing.weights.reshape(n, k).astype(np.float32), pa.float32()
        )
    if width:
        cols["probs"] = _list_array(routing.probs.reshape(n, width).astype(np.float16), _PROB)
    if width and meta.top_m:
        assert routing.prob_ids is not None
        cols["prob_ids"] = _list_array(routing.prob_ids.reshape(n, width).astype(np.int16), _INT)
    if meta.early_view_recorded:
        cols["early_experts"] = _list_array(
            routing.early_experts.reshape(n, k).astype(np.int16), _INT, early_null
        )
    if meta.early_view_recorded and width:
        cols["early_probs"] = _list_array(
            np.nan_to_num(routing.early_probs.reshape(n, width)).astype(np.float16),
            _PROB,
            early_null,
        )
    if meta.early_view_recorded and width and meta.top_m:
        assert routing.early_prob_ids is not None
        cols["early_prob_ids"] = _list_array(
            routing.early_prob_ids.reshape(n, width).astype(np.int16), _INT, early_null
        )
    if meta.filled_column:
        filled = routing.filled if routing.filled is not None else np.zeros((t, n_layers), bool)
        cols["filled"] = pa.array(np.asarray(filled, dtype=bool).reshape(n))
    return pa.Table.from_pydict(cols, schema=schema_for(meta))


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

    Use as a context manager. ``write_sequence`` buffers rows and writes row groups of about
    ``row_group_rows`` rows (a sequence may span row groups, and a row group may hold several
    sequences), so readers stream with flat memory. Counts are accumulated and written to the
    footer metadata on close. If the block raises, the temporary file is removed and nothing
    is left at ``path``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        meta: TraceMeta,
        row_group_rows: int = 65536,
        compression: str = "zstd",
    ) -> None:
        self.path = Path(path)
        self.meta = meta
        self.row_group_rows = max(1, int(row_group_rows))
        self.compression = compression
        self._counts = dict.fromkeys(COUNT_KEYS, 0)
        if meta.filled_column:
            self._counts[FILLED_KEY] = 0
        self._writer: pq.ParquetWriter | None = None
        self._tmp: str | None = None
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._seen: set[int] = set()

    def __enter__(self) -> TraceWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(
            prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent
        )
        os.close(fd)
        # mkstemp makes the file private (0600); a trace should get the usual permissions.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self._tmp, 0o666 & ~umask)
        schema = schema_for(self.meta)
        self._writer = pq.ParquetWriter(
            self._tmp, schema, compression=self.compression, use_dictionary=["phase"]
        )
        return self

    def _check(self, routing: SequenceRouting) -> None:
        """Programming errors in the caller (wrong shapes, repeated id) fail early and loudly."""
        m = self.meta.model
        t = routing.positions.shape[0]
        want_k = (t, m.moe_layers, m.top_k)
        want_p = (t, m.moe_layers, self.meta.probs_stored)
        checks = [("experts", routing.experts, want_k)]
        if self.meta.weights_recorded:
            checks.append(("weights", routing.weights, want_k))
        if self.meta.early_view_recorded:
            checks.append(("early_experts", routing.early_experts, want_k))
        if self.meta.probs_recorded:
            checks.append(("probs", routing.probs, want_p))
        if self.meta.probs_recorded and self.meta.early_view_recorded:
            checks.append(("early_probs", routing.early_probs, want_p))
        if self.meta.filled_column and routing.filled is not None:
            checks.append(("filled", routing.filled, want_k[:2]))
        for name, arr, want in checks:
            if tuple(arr.shape) != want:
                raise ValueError(
                    f"sequence {routing.seq_id}: {name} has shape "
                    f"{tuple(arr.shape)}, expected {want}"
                )
        if self.meta.top_m and (
            routing.prob_ids is None
            or (self.meta.early_view_recorded and routing.early_prob_ids is None)
        ):
            raise ValueError(
                f"sequence {routing.seq_id}: top-m storage needs prob_ids and early_prob_ids"
            )
        if not 0 <= routing.n_prefill <= t:
            raise ValueError(
                f"sequence {routing.seq_id}: n_prefill {routing.n_prefill} outside 0..{t}"
            )
        if routing.seq_id in self._seen:
            raise ValueError(f"sequence {routing.seq_id} written twice")

    def write_sequence(self, routing: SequenceRouting) -> None:
        """Append one sequence (rows must follow the previous sequence's)."""
        assert self._writer is not None, "use TraceWriter as a context manager"
        self._check(routing)
        self._seen.add(routing.seq_id)
        table = sequence_table(routing, self.meta)
        self._pending.append(table)
        self._pending_rows += table.num_rows
        if self._pending_rows >= self.row_group_rows:
            self._flush(final=False)
        self._counts["rows"] += table.num_rows
        self._counts["sequences"] += 1
        self._counts["prefill_tokens"] += routing.n_prefill
        self._counts["decode_tokens"] += routing.n_decode
        if self.meta.filled_column and routing.filled is not None:
            self._counts[FILLED_KEY] += int(np.count_nonzero(routing.filled))

    def _flush(self, final: bool) -> None:
        """Write whole row groups from the buffer; the remainder waits unless ``final``."""
        assert self._writer is not None
        if not self._pending:
            return
        table = pa.concat_tables(self._pending)
        full = (table.num_rows // self.row_group_rows) * self.row_group_rows
        cut = table.num_rows if final else full
        if cut:
            self._writer.write_table(table.slice(0, cut), row_group_size=self.row_group_rows)
        rest = table.slice(cut)
        self._pending = [rest] if rest.num_rows else []
        self._pending_rows = rest.num_rows

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        assert self._writer is not None and self._tmp is not None
        try:
            if exc_type is None:
                self._flush(final=True)
                self.meta.counts = dict(self._counts)
                if not self.meta.provenance.get("tool_versions"):
                    self.meta.provenance["tool_versions"] = tool_versions()
                self.meta.provenance.setdefault(
                    "created", _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
                )
                self._writer.add_key_value_metadata({META_KEY: self.meta.to_json().encode()})
            self._writer.close()
            if exc_type is None:
                from daopsim.simulator.output import refuse_non_regular

                refuse_non_regular(self.path, str(self.path))
                os.replace(self._tmp, self.path)
        finally:
            self._pending = []
            if os.path.exists(self._tmp):
                os.unlink(self._tmp)


def write_trace(
    path: str | os.PathLike[str],
    meta: TraceMeta,
    sequences: list[SequenceRouting] | Iterator[SequenceRouting],
    row_group_rows: int = 65536,
) -> Path:
    """Write sequences to ``path`` atomically (temporary file, then rename); returns the path."""
    with TraceWriter(path, meta, row_group_rows=row_group_rows) as writer:
        for routing in sequences:
            writer.write_sequence(routing)
    return Path(path)
