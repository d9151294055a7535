"""Routing traces: the Parquet format, atomic writing, streaming reading and validation.

One row per (sequence, token position, MoE layer). The format is documented in
docs/trace-format.md; ``SCHEMA_VERSION`` goes in the file metadata under the key ``daopsim``.
Rows are ordered by sequence, then position, then layer, and every token has one row per MoE
layer, so a sequence reshapes to ``[tokens, layers, k]`` arrays without copying.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import itertools
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from daopsim.simulator.errors import TraceError, UserError
from daopsim.simulator.models import ModelShape

T = TypeVar("T")

#: The newest format version this daopsim writes; a file that needs no version-2 feature is
#: written as version 1, so old readers keep reading it (see docs/trace-format.md).
SCHEMA_VERSION = 2
#: Format versions this daopsim reads.
READ_VERSIONS = (1, 2)
META_KEY = b"daopsim"
PHASES = ("prefill", "decode")
#: Above this many experts per layer, only the top ``m`` router probabilities are stored.
ALL_PROBS_MAX_EXPERTS = 128
#: Probabilities stored per row above ``ALL_PROBS_MAX_EXPERTS`` experts, unless a tool is told m.
DEFAULT_TOP_M = 32

#: Largest position the format stores (``pos`` is int32 in the schema).
MAX_POSITION = 2**31 - 1
#: Model-shape keys that must be at least 1, and the bound every integer key must stay under
#: (beyond 2^53 byte counts stop being exact in float64 cost sums).
_POSITIVE_MODEL_KEYS = (
    "layers",
    "moe_layers",
    "hidden",
    "expert_ffn",
    "experts",
    "top_k",
    "expert_matrices",
)
_MAX_MODEL_INT = 2**53

_INT = pa.int16()
_PROB = pa.float16()


def arrow_schema(
    top_m: bool,
    *,
    early: bool = True,
    weights: bool = True,
    probs: bool = True,
    filled: bool = False,
) -> pa.Schema:
    """The Arrow schema of a trace; ``top_m`` adds the id columns for partial distributions.

    The keyword flags drop the columns a version-2 file does not record (``early``: the
    one-layer-early view, ``weights``: gate weights, ``probs``: router probabilities) and add
    the ``filled`` column of a file whose missing token-layers were filled.
    """
    fields = [
        pa.field("seq", pa.int32(), nullable=False),
        pa.field("pos", pa.int32(), nullable=False),
        pa.field("phase", pa.string(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("experts", pa.list_(_INT), nullable=False),
    ]
    if weights:
        fields.append(pa.field("weights", pa.list_(pa.float32()), nullable=False))
    if probs:
        fields.append(pa.field("probs", pa.list_(_PROB), nullable=False))
        if top_m:
            fields.append(pa.field("prob_ids", pa.list_(_INT), nullable=False))
    if early:
        fields.append(pa.field("early_experts", pa.list_(_INT), nullable=True))
        if probs:
            fields.append(pa.field("early_probs", pa.list_(_PROB), nullable=True))
            if top_m:
                fields.append(pa.field("early_prob_ids", pa.list_(_INT), nullable=True))
    if filled:
        fields.append(pa.field("filled", pa.bool_(), nullable=False))
    return pa.schema(fields)


def schema_for(meta: TraceMeta) -> pa.Schema:
    """The columns a trace with this metadata has (what readers require and writers write)."""
    return arrow_schema(
        meta.top_m,
        early=meta.early_view_recorded,
        weights=meta.weights_recorded,
        probs=meta.probs_stored > 0,
        filled=meta.filled_column,
    )


REQUIRED_COLUMNS = tuple(arrow_schema(False).names)
#: Keys of ``TraceMeta.counts`` that every trace carries and validation checks.
COUNT_KEYS = ("rows", "sequences", "prefill_tokens", "decode_tokens")
#: Count of token-layers filled by the missing-layer rule (version 2, with ``filled_column``).
FILLED_KEY = "missing_token_layers"


@dataclass
class TraceMeta:
    """File-level metadata: model shape, provenance, counts and how probabilities are stored."""

    model: ModelShape
    provenance: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    probs_stored: int = 0  # experts per row in ``probs``: E (all), m (top-m), 0 (none; v2)
    moe_layer_ids: list[int] = field(default_factory=list)
    calibration_sequences: list[int] = field(default_factory=list)
    #: version 2: False when the one-layer-early view was not recorded (no early_* columns)
    early_view_recorded: bool = True
    #: version 2: False for ids-only routing (no ``weights`` column; readers use 1/k)
    weights_recorded: bool = True
    #: version 2: the file has a ``filled`` column marking token-layers filled by the
    #: missing-layer rule (copied from the previous token at that layer)
    filled_column: bool = False
    schema_version: int = SCHEMA_VERSION

    @property
    def top_m(self) -> bool:
        """True when only the top ``probs_stored`` probabilities (with ids) are stored."""
        return 0 < self.probs_stored < self.model.experts

    @property
    def probs_recorded(self) -> bool:
        """False when the file stores no router probabilities (``probs_stored`` = 0)."""
        return self.probs_stored > 0

    def format_version(self) -> int:
        """The lowest format version that can express this file (what the writer records)."""
        v2 = (
            not self.early_view_recorded
            or not self.weights_recorded
            or not self.probs_recorded
            or self.filled_column
        )
        return 2 if v2 else 1

    def to_json(self) -> str:
        """Serialise for the Parquet footer (version-2 keys only in version-2 files)."""
        version = self.format_version()
        data: dict[str, Any] = {
            "schema_version": version,
            "model": self.model.to_dict(),
            "provenance": self.provenance,
            "counts": self.counts,
            "probs_stored": self.probs_stored,
            "moe_layer_ids": self.moe_layer_ids,
            "calibration_sequences": self.calibration_sequences,
        }
        if version >= 2:
            data["early_view_recorded"] = self.early_view_recorded
            data["weights_recorded"] = self.weights_recorded
            data["filled_column"] = self.filled_column
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, path: object, text: str | bytes) -> TraceMeta:
        """Parse footer metadata; errors name the file and the missing or bad key."""
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise TraceError(path, "file metadata 'daopsim' is not valid JSON") from None
        if not isinstance(data, dict):
            raise TraceError(path, "file metadata 'daopsim' is not a JSON object")
        for key in ("schema_version", "model", "provenance", "counts", "probs_stored"):
            if key not in data:
                raise TraceError(path, f"file metadata is missing key {key!r}")
        version = data["schema_version"]
        if not _is_int(version) or version not in READ_VERSIONS:
            raise TraceError(
                path,
                f"file metadata key 'schema_version': {version!r} is not "
                f"supported (this daopsim reads {', '.join(map(str, READ_VERSIONS))})",
            )
        model = _model_from_meta(path, data["model"])

        def bad(key: str, what: str) -> TraceError:
            return TraceError(path, f"file metadata key {key!r} must be {what}")

        if not isinstance(data["provenance"], dict):
            raise bad("provenance", "a JSON object")
        counts = data["counts"]
        if not isinstance(counts, dict) or not all(_is_int(v) and v >= 0 for v in counts.values()):
            raise bad("counts", "an object of non-negative integers")
        probs_stored = data["probs_stored"]
        low = 0 if version >= 2 else 1
        if not _is_int(probs_stored) or not low <= probs_stored <= model.experts:
            raise bad("probs_stored", f"an integer in {low}..{model.experts}")
        flags = {}
        for key in ("early_view_recorded", "weights_recorded", "filled_column"):
            value = data.get(key, key != "filled_column")
            if version < 2 and key in data:
                raise TraceError(path, f"file metadata key {key!r} needs schema_version 2")
            if not isinstance(value, bool):
                raise bad(key, "true or false")
            flags[key] = value
        if flags["filled_column"] and not _is_int(counts.get(FILLED_KEY)):
            raise TraceError(path, f"file metadata key 'counts' is missing {FILLED_KEY!r}")
        layer_ids = data.get("moe_layer_ids")
        if layer_ids is None or layer_ids == []:
            layer_ids = list(range(model.first_moe_layer, model.first_moe_layer + model.moe_layers))
        if (
            not isinstance(layer_ids, list)
            or len(layer_ids) != model.moe_layers
            or not all(_is_int(i) and 0 <= i < model.layers for i in layer_ids)
        ):
            raise bad(
                "moe_layer_ids",
                f"a list of {model.moe_layers} layer indices in 0..{model.layers - 1}",
            )
        calib = data.get("calibration_sequences") or []
        if not isinstance(calib, list) or not all(_is_int(s) and s >= 0 for s in calib):
            raise bad("calibration_sequences", "a list of sequence ids")
        return cls(
            model=model,
            provenance=dict(data["provenance"]),
            counts={str(k): int(v) for k, v in counts.items()},
            probs_stored=int(probs_stored),
            moe_layer_ids=[int(i) for i in layer_ids],
            calibration_sequences=[int(s) for s in calib],
            schema_version=int(version),
            **flags,
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _model_from_meta(path: object, data: object) -> ModelShape:
    """The ``model`` key of the footer as a ModelShape; a bad field names its key."""
    if not isinstance(data, dict):
        raise TraceError(path, "file metadata key 'model' must be a JSON object")
    for name, f in ModelShape.__dataclass_fields__.items():
        if name not in data:
            continue
        value = data[name]
        want_int = f.type in ("int", int)
        want_str = f.type in ("str", str)
        if (want_int and not _is_int(value)) or (want_str and not isinstance(value, str)):
            raise TraceError(
                path,
                f"file metadata key 'model.{name}' must be "
                f"{'an integer' if want_int else 'a string'}, got {value!r:.40}",
            )
        if want_int and value < 0:
            raise TraceError(path, f"file metadata key 'model.{name}' must not be negative")
        if want_int and value > _MAX_MODEL_INT:
            raise TraceError(
                path, f"file metadata key 'model.{name}' is out of range (at most 2^53)"
            )
        if want_int and value < 1 and name in _POSITIVE_MODEL_KEYS:
            raise TraceError(path, f"file metadata key 'model.{name}' must be at least 1")
    try:
        return ModelShape.from_dict(data)
    except (UserError, TypeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TraceError(path, f"file metadata key 'model' is invalid: {first}") from None


@dataclass
class SequenceRouting:
    """The routing of one sequence, token-major: arrays shaped ``[tokens, layers, ...]``.

    ``early_*`` is layer l's router applied to layer l-1's router input (the one-layer-early
    view); for layer 0 it is absent (``early_experts`` = -1, ``early_probs`` = NaN).
    When ``prob_ids`` is None, ``probs[..., e]`` is expert e's probability; otherwise
    ``probs[..., j]`` belongs to expert ``prob_ids[..., j]``.

    What a file did not record is replaced by documented stand-ins when read (the flags say
    which): no weights -> 1/k each; no probabilities -> ``probs`` = the weights with
    ``prob_ids`` = the experts (zero elsewhere); no one-layer-early view -> -1 / NaN
    everywhere (see :func:`previous_token_view` for the look-ahead stand-in). ``filled``
    marks token-layers the missing-layer rule filled (None: nothing was filled).
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
    early_recorded: bool = True
    weights_recorded: bool = True
    probs_recorded: bool = True
    filled: np.ndarray | None = None  # bool [T, L]

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
        out = np.zeros((*probs.shape[:2], experts), dtype=np.float32)
        valid = ids >= 0
        t, l_, j = np.nonzero(valid)
        out[t, l_, ids[t, l_, j]] = probs[t, l_, j]
        return out

    def prompt_probs(self, layer: int, experts: int) -> np.ndarray:
        """Dense ``[n_prefill, E]`` probabilities of the prompt rows at ``layer`` (zeros for
        experts outside a stored top-m, as :meth:`full_probs`)."""
        p = self.n_prefill
        probs = self.probs[:p, layer]
        ids = self.prob_ids
        if ids is None:
            return probs
        out = np.zeros((probs.shape[0], experts), dtype=np.float32)
        idx = ids[:p, layer]
        t, j = np.nonzero(idx >= 0)
        out[t, idx[t, j]] = probs[t, j]
        return out


def previous_token_view(r: SequenceRouting) -> SequenceRouting:
    """The look-ahead stand-in: the previous token's routing at the same layer.

    For a trace without a recorded one-layer-early view, the view of token t at layer l is
    token t-1's experts (and probabilities) at layer l; the first token of a sequence has no
    view (-1 / NaN), like layer 0. Returns a copy; ``r`` is not changed.
    """
    ee = np.full_like(r.experts, -1)
    ep = np.full(r.probs.shape, np.nan, dtype=np.float32)
    eids = None if r.prob_ids is None else np.full_like(r.prob_ids, -1)
    if r.n_tokens > 1:
        ee[1:] = r.experts[:-1]
        ep[1:] = r.probs[:-1]
        if eids is not None:
            assert r.prob_ids is not None
            eids[1:] = r.prob_ids[:-1]
    blank_first_layer_view(ee, ep, eids)
    return dataclasses.replace(r, early_experts=ee, early_probs=ep, early_prob_ids=eids)


def blank_first_layer_view(
    early_experts: np.ndarray, early_probs: np.ndarray, early_prob_ids: np.ndarray | None
) -> None:
    """Mark layer 0's one-layer-early view absent, in place (it has no earlier layer)."""
    early_experts[:, 0] = -1
    early_probs[:, 0] = np.nan
    if early_prob_ids is not None:
        early_prob_ids[:, 0] = -1


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


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


def write_valid_trace(
    path: str | os.PathLike[str],
    write: Callable[[Path], T],
    flag: str | None = "-o",
    what: str = "written",
    hint: str = "",
) -> T:
    """The one way a command writes a trace for the user (``synth``, ``trace import``,
    ``capture``): ``write(tmp)`` fills a temporary file beside ``path``, :func:`validate_trace`
    (what ``daopsim trace validate`` runs) reads it back, and only a valid trace is renamed into
    place (``daopsim.simulator.output.write_file``: a special file at ``path`` is refused, an
    OSError is one line with exit code 3). An invalid one is deleted and reported as one UserError
    naming ``path`` and the first problem; ``path`` is left as it was. Returns what ``write``
    returned.
    """
    from daopsim.simulator.output import write_file

    out: list[T] = []

    def _write(tmp: str) -> None:
        out.append(write(Path(tmp)))
        try:
            validate_trace(tmp)
        except TraceError as exc:
            where = "".join(
                (f"row {exc.row}: " if exc.row is not None else "")
                + (f"column {exc.column!r}: " if exc.column is not None else "")
            )
            label = f"{flag} {path}" if flag else str(path)
            raise UserError(
                f"{label}: the {what} trace fails validation ({where}{exc.detail}); "
                f"nothing was written{hint}"
            ) from None

    write_file(path, _write, flag)
    return out[0]


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


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
