"""The routing-trace format: its Arrow schema, the file metadata (``TraceMeta``) and the
routing of one sequence in memory (``SequenceRouting``), with the look-ahead stand-ins.

One row per (sequence, token position, MoE layer). The format is documented in
docs/trace-format.md; ``SCHEMA_VERSION`` goes in the file metadata under the key ``daopsim``.
Rows are ordered by sequence, then position, then layer, and every token has one row per MoE
layer, so a sequence reshapes to ``[tokens, layers, k]`` arrays without copying.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from daopsim.simulator.errors import TraceError, UserError
from daopsim.simulator.models import ModelShape

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
