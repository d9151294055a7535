"""``daopsim trace import``: routing recorded by other tools, converted to a daopsim trace.

Formats (docs/trace-format.md, "Importing traces"):

- ``vllm``: completion responses of a vLLM server started with routed-experts return enabled:
  ``prompt_routed_experts`` ``[prompt_len][moe_layers][top_k]`` on the response and
  ``routed_experts`` ``[gen_len][moe_layers][top_k]`` on each choice (one sequence per choice);
  a JSON list, one JSON object, or JSONL (one response per line).
- ``jsonl``: one JSON object per (sequence, token, layer) with configurable field names.
- ``npy``: NumPy ``.npy``/``.npz`` arrays of top-k ids ``[tokens, layers, k]``.
- ``torch``: router logits saved with ``torch.save`` (per-layer ``[tokens, E]`` tensors, as
  HF ``output_router_logits`` returns them), converted to top-k with softmax weights.

None of these records the one-layer-early view, so imported traces say so (format version 2).
Errors name the file and the line (JSON) or array element (NumPy/torch): ``FILE:LINE: ...``.

This module is the conversion (the options, the missing-layer rule, the model, the trace
written and validated with its provenance); the formats are read in ``importers_json``
(``vllm``, ``jsonl``) and ``importers_arrays`` (``npy``, ``torch``), on the shared checks of
``importers_common``.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path

import numpy as np

from daopsim.simulator.errors import UserError
from daopsim.simulator.fingerprints import file_sha256
from daopsim.simulator.importers_arrays import _read_npy, _read_torch
from daopsim.simulator.importers_common import (
    MAX_EXPERT_ID,
    MAX_LAYERS,
    ImportFault,
    ImportOptions,
    _Seq,
)
from daopsim.simulator.importers_json import JSONL_FIELDS, _read_jsonl, _read_vllm, text_line
from daopsim.simulator.models import ModelShape, get_model
from daopsim.simulator.trace import write_valid_trace
from daopsim.simulator.trace_format import (
    ALL_PROBS_MAX_EXPERTS,
    DEFAULT_TOP_M,
    MAX_POSITION,
    SequenceRouting,
    TraceMeta,
)
from daopsim.simulator.trace_write import write_trace

FORMATS = ("vllm", "jsonl", "npy", "torch")
#: Version of the conversion rules; recorded in each imported trace's provenance.
IMPORTER_VERSION = 1
MISSING_RULES = ("fill", "skip")


#: The formats that read each format-specific option of ``trace import`` (the others refuse it:
#: an option silently ignored would leave the user believing it was applied).
OPTION_FORMATS = {"--field": ("jsonl",), "--top-k": ("torch",), "--prefill": ("npy", "torch")}


def _check_options_apply(fmt: str, opts: ImportOptions) -> None:
    """Refuse a format-specific option given to a format that does not read it."""
    given = {"--field": bool(opts.fields), "--top-k": opts.top_k is not None}
    given["--prefill"] = opts.prefill != 0  # 0, the default, means the same in every format
    for option, formats in OPTION_FORMATS.items():
        if given[option] and fmt not in formats:
            raise UserError(
                f"{option} does not apply to {fmt} imports (only to {', '.join(formats)})"
            )


#: The reader of each format: ``(path, options, model or None) -> sequences``.
_READERS = {"vllm": _read_vllm, "jsonl": _read_jsonl, "npy": _read_npy, "torch": _read_torch}


# --------------------------------------------------------------------------------------------
# to a trace
# --------------------------------------------------------------------------------------------


def fill_missing(seq: _Seq, rule: str) -> tuple[_Seq, np.ndarray]:
    """Apply the missing-layer rule; returns the sequence and its filled mask ``[T, L]``.

    ``fill``: a token-layer not recorded takes the routing of the nearest earlier token of the
    sequence that has that layer (the nearest later one for leading tokens). ``skip``: tokens
    with any layer missing are dropped (positions keep their gaps).
    """
    missing = seq.experts[..., 0] < 0
    if not missing.any():
        return seq, missing
    if rule == "skip":
        keep = ~missing.any(axis=1)
        n_pre = int(keep[: seq.n_prefill].sum())
        return (
            _Seq(
                seq.seq_id,
                seq.experts[keep],
                None if seq.weights is None else seq.weights[keep],
                n_pre,
                seq.positions[keep],
                None if seq.probs is None else seq.probs[keep],
            ),
            np.zeros((int(keep.sum()), seq.experts.shape[1]), dtype=bool),
        )
    t_n, n_layers = missing.shape
    src = np.where(~missing, np.arange(t_n)[:, None], -1)
    src = np.maximum.accumulate(src, axis=0)  # last present token at or before t
    nxt = np.where(~missing, np.arange(t_n)[:, None], t_n)
    nxt = np.minimum.accumulate(nxt[::-1], axis=0)[::-1]  # first present at or after t
    src = np.where(src >= 0, src, nxt)
    if (src >= t_n).any():
        layer = int(np.flatnonzero((src >= t_n).any(axis=0))[0])
        raise UserError(f"sequence {seq.seq_id}: no token has layer {layer}; cannot fill it")
    cols = np.arange(n_layers)[None, :]
    experts = seq.experts[src, cols]
    weights = None if seq.weights is None else seq.weights[src, cols]
    return _Seq(seq.seq_id, experts, weights, seq.n_prefill, seq.positions), missing


def _resolve_model(opts: ImportOptions, seqs: list[_Seq], path: Path) -> ModelShape:
    shapes = {(s.experts.shape[1], s.experts.shape[2]) for s in seqs if s.experts.size}
    layers, k = next(iter(shapes)) if shapes else (0, 0)
    if len(shapes) > 1:
        raise UserError(f"{path}: sequences differ in layers or top-k: {sorted(shapes)}")
    top_id = max((int(s.experts.max()) for s in seqs if s.experts.size), default=-1)
    if opts.model is None:
        raise UserError(
            f"{path}: give --model PRESET: the data has {layers} MoE layers, top-{k} of at least "
            f"{top_id + 1} experts, but not the expert sizes the costs need (`daopsim models list`)"
        )
    model = get_model(opts.model)
    if shapes and (layers, k) != (model.moe_layers, model.top_k):
        raise UserError(
            f"{path}: the data has {layers} MoE layers and top-{k}; {model.name} has "
            f"{model.moe_layers} and top-{model.top_k}"
        )
    if top_id >= model.experts:
        raise UserError(f"{path}: expert id {top_id} outside 0..{model.experts - 1} ({model.name})")
    return model


def import_trace(
    fmt: str, src: str | os.PathLike[str], out: str | os.PathLike[str], opts: ImportOptions
) -> TraceMeta:
    """Convert ``src`` (format ``fmt``) to a daopsim trace at ``out``.

    The output goes through the output rules (``daopsim.simulator.output``: never the source file, a
    special file or a link loop; ``.parquet`` only) and the trace is validated before it is
    renamed into place (``daopsim.simulator.trace.write_valid_trace``), so what ``trace import``
    writes, ``trace validate`` accepts; anything else is one error and no file.
    """
    from daopsim.simulator.data import check_input_file
    from daopsim.simulator.output import TRACE_FORMATS, check_output_file, output_format

    if fmt not in FORMATS:
        raise UserError(f"unknown import format {fmt!r} (formats: {', '.join(FORMATS)})")
    if opts.missing_layers not in MISSING_RULES:
        raise UserError(f"--missing-layers must be one of {list(MISSING_RULES)}")
    _check_options_apply(fmt, opts)
    path = check_input_file(src, f"{fmt} source")
    if opts.prefill < 0:
        raise UserError(f"--prefill must be >= 0, got {opts.prefill}")
    if opts.top_k is not None and opts.top_k < 1:
        raise UserError(f"--top-k must be >= 1, got {opts.top_k}")
    output_format(out, TRACE_FORMATS, "-o")
    check_output_file(out, "-o", inputs=[path])
    preset = get_model(opts.model) if opts.model is not None else None
    seqs = _READERS[fmt](path, opts, preset)
    if not seqs:
        raise UserError(f"{path}: no sequences")
    _check_sequences(path, seqs, "in the file")
    model = _resolve_model(opts, seqs, path)
    filled: list[np.ndarray] = []
    done: list[_Seq] = []
    for s in seqs:
        try:
            s2, mask = fill_missing(s, opts.missing_layers)
        except UserError as exc:
            raise UserError(f"{path}: {exc}") from None
        done.append(s2)
        filled.append(mask)
    _check_sequences(path, done, f"after --missing-layers {opts.missing_layers}")
    n_filled = int(sum(int(m.sum()) for m in filled))
    has_probs = all(s.probs is not None for s in done)
    width = 0
    if has_probs:
        width = model.experts if model.experts <= ALL_PROBS_MAX_EXPERTS else DEFAULT_TOP_M
    has_weights = all(s.weights is not None for s in done)
    meta = TraceMeta(
        model=model,
        provenance={
            "source": "import",
            "format": fmt,
            "source_file": path.name,
            "source_sha256": file_sha256(path),
            "importer": "daopsim trace import",
            "importer_version": IMPORTER_VERSION,
            "created": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
            "options": {
                "model": opts.model,
                "top_k": opts.top_k,
                "fields": dict(opts.fields),
                "missing_layers": opts.missing_layers,
                "prefill": opts.prefill,
            },
        },
        probs_stored=width,
        moe_layer_ids=list(range(model.first_moe_layer, model.first_moe_layer + model.moe_layers)),
        early_view_recorded=False,
        weights_recorded=has_weights,
        filled_column=n_filled > 0,
    )
    routings = (_routing(s, m, model, width) for s, m in zip(done, filled, strict=True))
    write_valid_trace(out, lambda tmp: write_trace(tmp, meta, routings), flag="-o", what="imported")
    return meta


def _check_sequences(path: Path, seqs: list[_Seq], when: str) -> None:
    """What a trace needs of each sequence, named by source sequence: tokens, a prompt length
    within them, a storable and unique id."""
    seen: set[int] = set()
    for s in seqs:
        t = s.experts.shape[0]
        if t == 0:
            raise UserError(f"{path}: sequence {s.seq_id} has no tokens {when}")
        if not 0 <= s.n_prefill <= t:
            raise UserError(
                f"{path}: sequence {s.seq_id}: {s.n_prefill} prompt tokens outside 0..{t}"
            )
        if not 0 <= s.seq_id <= MAX_POSITION:
            raise UserError(f"{path}: sequence id {s.seq_id} outside 0..{MAX_POSITION}")
        if s.seq_id in seen:
            raise UserError(f"{path}: sequence id {s.seq_id} appears twice")
        seen.add(s.seq_id)


def _routing(s: _Seq, filled: np.ndarray, model: ModelShape, width: int) -> SequenceRouting:
    t, n_layers, k = s.experts.shape
    weights = s.weights if s.weights is not None else np.full(s.experts.shape, 1.0 / k, np.float32)
    probs = np.zeros((t, n_layers, width), dtype=np.float32)
    prob_ids = None
    if width and s.probs is not None:
        if width == model.experts:
            probs = s.probs
        else:
            prob_ids = np.argsort(-s.probs, axis=-1, kind="stable")[..., :width]
            probs = np.take_along_axis(s.probs, prob_ids, axis=-1)
            prob_ids = prob_ids.astype(np.int16)
    return SequenceRouting(
        seq_id=s.seq_id,
        positions=s.positions.astype(np.int32),
        n_prefill=s.n_prefill,
        experts=s.experts.astype(np.int16),
        weights=weights.astype(np.float32),
        probs=probs,
        early_experts=np.full(s.experts.shape, -1, dtype=np.int16),
        early_probs=np.full(probs.shape, np.nan, dtype=np.float32),
        prob_ids=prob_ids,
        early_prob_ids=None if prob_ids is None else np.full_like(prob_ids, -1),
        early_recorded=False,
        filled=filled,
    )


__all__ = [
    "FORMATS",
    "IMPORTER_VERSION",
    "JSONL_FIELDS",
    "MAX_EXPERT_ID",
    "MAX_LAYERS",
    "MISSING_RULES",
    "OPTION_FORMATS",
    "ImportFault",
    "ImportOptions",
    "fill_missing",
    "import_trace",
    "text_line",
]
