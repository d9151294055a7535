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
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from daopsim.simulator.errors import UserError
from daopsim.simulator.fingerprints import file_sha256
from daopsim.simulator.models import ModelShape, get_model
from daopsim.simulator.trace import write_valid_trace
from daopsim.simulator.trace_format import (
    ALL_PROBS_MAX_EXPERTS,
    DEFAULT_TOP_M,
    MAX_POSITION,
    SequenceRouting,
    TraceMeta,
)
from daopsim.simulator.trace_read import weight_rises
from daopsim.simulator.trace_write import write_trace

FORMATS = ("vllm", "jsonl", "npy", "torch")
#: Version of the conversion rules; recorded in each imported trace's provenance.
IMPORTER_VERSION = 1
MISSING_RULES = ("fill", "skip")
#: Field names of the generic JSONL format (``--field NAME=KEY`` renames them).
JSONL_FIELDS = {
    "seq": "seq",
    "token": "token",
    "layer": "layer",
    "experts": "experts",
    "weights": "weights",
    "phase": "phase",
}


class ImportFault(UserError):
    """A bad source file: the message starts with ``FILE:LINE:`` (or ``FILE:ELEMENT:``)."""

    def __init__(self, path: object, where: object, msg: str) -> None:
        super().__init__(f"{path}:{where}: {msg}")


@dataclass
class _Seq:
    """One imported sequence; ``experts[t, l, 0] == -1`` marks a token-layer not recorded."""

    seq_id: int
    experts: np.ndarray  # int64 [T, L, k]
    weights: np.ndarray | None  # float32 [T, L, k]
    n_prefill: int
    positions: np.ndarray
    probs: np.ndarray | None = None  # float32 [T, L, E] (torch logits only)


@dataclass
class ImportOptions:
    """What ``trace import`` was asked for (also recorded in the provenance)."""

    model: str | None = None
    top_k: int | None = None
    fields: dict[str, str] = field(default_factory=dict)
    missing_layers: str = "fill"
    prefill: int = 0  # npy/torch: leading tokens of each sequence that are prompt tokens


#: The formats that read each format-specific option of ``trace import`` (the others refuse it:
#: an option silently ignored would leave the user believing it was applied).
OPTION_FORMATS = {"--field": ("jsonl",), "--top-k": ("torch",), "--prefill": ("npy", "torch")}


# --------------------------------------------------------------------------------------------
# checks shared by the formats
# --------------------------------------------------------------------------------------------


def _check_options_apply(fmt: str, opts: ImportOptions) -> None:
    """Refuse a format-specific option given to a format that does not read it."""
    given = {"--field": bool(opts.fields), "--top-k": opts.top_k is not None}
    given["--prefill"] = opts.prefill != 0  # 0, the default, means the same in every format
    for option, formats in OPTION_FORMATS.items():
        if given[option] and fmt not in formats:
            raise UserError(
                f"{option} does not apply to {fmt} imports (only to {', '.join(formats)})"
            )


def _check_prefill(path: Path, where: str, prefill: int, tokens: int) -> None:
    """--prefill longer than a sequence would turn it into a prompt without its decode."""
    if prefill > tokens:
        raise ImportFault(path, where, f"--prefill {prefill} exceeds its {tokens} tokens")


#: Largest expert id a trace can store (``experts`` is int16).
MAX_EXPERT_ID = 2**15 - 1
#: Most MoE layers a file may claim without ``--model`` (the largest catalogue model has <100).
MAX_LAYERS = 1024


def _id_rows(
    path: object,
    where: object,
    name: str,
    value: Any,
    layers: int | None,
    k: int | None,
    experts: int | None = None,
) -> np.ndarray:
    """``[tokens][layers][k]`` nested lists of ints to an int64 array, or an ImportFault."""
    if not isinstance(value, list):
        raise ImportFault(
            path, where, f"{name} must be a list of tokens, got {type(value).__name__}"
        )
    rows = []
    for t, tok in enumerate(value):
        if not isinstance(tok, list) or not tok or (layers is not None and len(tok) != layers):
            got = len(tok) if isinstance(tok, list) else type(tok).__name__
            want = layers if layers is not None else "one or more"
            raise ImportFault(path, where, f"{name}[{t}]: expected {want} layers, got {got}")
        if len(tok) > MAX_LAYERS:
            raise ImportFault(path, where, f"{name}[{t}]: {len(tok)} layers (at most {MAX_LAYERS})")
        for layer, ids in enumerate(tok):
            _check_ids(path, where, f"{name}[{t}][{layer}]", ids, k, experts)
            k = len(ids)  # every layer of every token has the same top-k
        layers = len(tok)
        rows.append(tok)
    if not rows:
        return np.zeros((0, layers or 0, k or 0), dtype=np.int64)
    return np.asarray(rows, dtype=np.int64)


def _check_ids(
    path: object, where: object, name: str, ids: Any, k: int | None, experts: int | None = None
) -> None:
    if not isinstance(ids, list) or not ids:
        raise ImportFault(path, where, f"{name}: expected a list of expert ids, got {ids!r:.40}")
    if k is not None and len(ids) != k:
        raise ImportFault(path, where, f"{name}: expected {k} experts, got {len(ids)}")
    top = MAX_EXPERT_ID if experts is None else experts - 1
    for e in ids:
        if not isinstance(e, int) or isinstance(e, bool):
            raise ImportFault(path, where, f"{name}: expert id {e!r:.20} is not an integer")
        if not 0 <= e <= top:
            shown = str(e) if len(str(e)) <= 20 else f"{str(e)[:17]}..."
            raise ImportFault(path, where, f"{name}: expert id {shown} outside 0..{top}")


def _check_range(path: object, where: object, name: str, ids: np.ndarray, experts: int) -> None:
    """Ids in 0..E-1 and no expert twice in one token-layer's top-k."""
    bad = (ids < 0) | (ids >= experts)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ImportFault(
            path, where, f"{name}{list(idx[:-1])}: expert id {ids[idx]} outside 0..{experts - 1}"
        )
    if ids.shape[-1] > 1:
        srt = np.sort(ids, axis=-1)
        dup = (srt[..., 1:] == srt[..., :-1]).any(axis=-1)
        if dup.any():
            idx = [int(i) for i in np.argwhere(dup)[0]]
            raise ImportFault(path, where, f"{name}{idx}: an expert is repeated in one top-k")


_F32_MAX = float(np.finfo(np.float32).max)


def _weights(
    path: object, where: object, name: str, value: Any, shape: tuple[int, ...]
) -> np.ndarray:
    """Gate weights as float32 ``shape``: finite in float32, >= 0, non-increasing along rank
    (the checks `trace validate` makes of the weights column), or an ImportFault."""
    try:
        w = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise ImportFault(path, where, f"{name}: not a list of numbers") from None
    if w.shape != shape:
        raise ImportFault(path, where, f"{name}: shape {list(w.shape)}, expected {list(shape)}")
    if not np.isfinite(w).all() or (w < 0).any() or (w > _F32_MAX).any():
        raise ImportFault(
            path, where, f"{name}: weights must be finite, >= 0 and at most {_F32_MAX:.3g}"
        )
    w32 = w.astype(np.float32)
    rises = weight_rises(w32)
    if rises.any():
        idx = [int(i) for i in np.argwhere(rises)[0]]
        raise ImportFault(
            path,
            where,
            f"{name}{idx[:-1]}: weight at rank {idx[-1] + 1} exceeds rank {idx[-1]}; list each "
            "token's experts from the largest weight down (rank 0 is the top expert)",
        )
    return w32


def _json_docs(path: Path) -> Iterator[tuple[int, Any]]:
    """(line, object) for each top-level JSON object: JSONL, a JSON list, or one object."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ImportFault(path, text_line(path, exc.start), "not UTF-8 text") from None
    stripped = text.lstrip()
    dec = json.JSONDecoder()
    if stripped.startswith("["):
        i = text.index("[") + 1
        while True:
            while i < len(text) and text[i] in " \t\r\n,":
                i += 1
            if i >= len(text):
                raise ImportFault(path, text.count("\n") + 1, "unterminated JSON list")
            if text[i] == "]":
                return
            line = text.count("\n", 0, i) + 1
            try:
                obj, i = dec.raw_decode(text, i)
            except json.JSONDecodeError as exc:
                raise ImportFault(path, exc.lineno, f"malformed JSON ({exc.msg})") from None
            except RecursionError:
                raise ImportFault(path, line, "JSON nested too deeply") from None
            yield line, obj
    lines = text.splitlines()
    if stripped.startswith("{") and len([ln for ln in lines if ln.strip()]) > 1:
        # one pretty-printed object, or JSONL: try the whole text first
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            pass
        else:
            yield text[: len(text) - len(stripped)].count("\n") + 1, doc
            return
    for n, ln in enumerate(lines, start=1):
        if not ln.strip():
            continue
        yield n, _json_line(path, n, ln)


def _json_line(path: Path, n: int, line: str) -> Any:
    """One JSON document on line ``n``, or an ImportFault naming the line."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ImportFault(path, n, f"malformed JSON line ({exc.msg})") from None
    except RecursionError:
        raise ImportFault(path, n, "JSON nested too deeply") from None


def text_line(path: Path, offset: int) -> int:
    """The 1-based line of a byte offset (for decoding errors)."""
    return path.read_bytes()[:offset].count(b"\n") + 1


# --------------------------------------------------------------------------------------------
# formats
# --------------------------------------------------------------------------------------------


def _read_vllm(path: Path, opts: ImportOptions, model: ModelShape | None) -> list[_Seq]:
    layers = model.moe_layers if model else None
    k = model.top_k if model else None
    seqs: list[_Seq] = []
    for line, doc in _json_docs(path):
        if not isinstance(doc, dict):
            raise ImportFault(path, line, "expected a completion response (a JSON object)")
        choices = doc.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ImportFault(path, line, "response has no 'choices' list")
        prompt_raw = doc.get("prompt_routed_experts")
        for c, choice in enumerate(choices):
            if not isinstance(choice, dict):
                raise ImportFault(path, line, f"choices[{c}] is not an object")
            p_raw = choice.get("prompt_routed_experts", prompt_raw)
            g_raw = choice.get("routed_experts", doc.get("routed_experts"))
            if p_raw is None and g_raw is None:
                raise ImportFault(
                    path,
                    line,
                    f"choices[{c}] has neither 'prompt_routed_experts' nor 'routed_experts' "
                    "(was the server started with routed-experts return enabled?)",
                )
            n_exp = model.experts if model else None
            p_raw = [] if p_raw is None else p_raw
            g_raw = [] if g_raw is None else g_raw
            prompt = _id_rows(path, line, "prompt_routed_experts", p_raw, layers, k, n_exp)
            if prompt.size:
                layers, k = prompt.shape[1], prompt.shape[2]
            gen = _id_rows(path, line, "routed_experts", g_raw, layers, k, n_exp)
            if gen.size:
                layers, k = gen.shape[1], gen.shape[2]
            if prompt.size and gen.size and prompt.shape[1:] != gen.shape[1:]:
                raise ImportFault(path, line, "prompt and generated routing differ in shape")
            parts = [a for a in (prompt, gen) if a.size]
            if not parts:
                raise ImportFault(path, line, f"choices[{c}]: no routed tokens (empty lists)")
            ex = np.concatenate(parts)
            if model is not None:
                _check_range(path, line, f"choices[{c}] routing", ex, model.experts)
            seqs.append(
                _Seq(
                    seq_id=len(seqs),
                    experts=ex,
                    weights=None,
                    n_prefill=prompt.shape[0],
                    positions=np.arange(ex.shape[0]),
                )
            )
    return seqs


def _read_jsonl(path: Path, opts: ImportOptions, model: ModelShape | None) -> list[_Seq]:
    unknown = sorted(set(opts.fields) - set(JSONL_FIELDS))
    if unknown:
        raise UserError(f"--field {unknown[0]}: unknown field (fields: {', '.join(JSONL_FIELDS)})")
    f = {**JSONL_FIELDS, **opts.fields}
    k = model.top_k if model else None
    # sequence -> token -> layer -> (experts, weights, phase, line)
    data: dict[int, dict[int, dict[int, tuple[list[int], Any, Any, int]]]] = {}
    has_weights: bool | None = None
    for n, ln in enumerate(_utf8_text(path).split("\n"), start=1):
        if not ln.strip():
            continue
        row = _json_line(path, n, ln)
        if not isinstance(row, dict):
            raise ImportFault(path, n, "expected a JSON object")
        vals = _jsonl_position(path, n, row, f, model)
        ids = row.get(f["experts"])
        _check_ids(path, n, f"field {f['experts']!r}", ids, k, model.experts if model else None)
        k = len(ids)
        w = row.get(f["weights"])
        if has_weights is None:
            has_weights = w is not None
        elif has_weights != (w is not None):
            raise ImportFault(path, n, f"field {f['weights']!r} is on some rows only")
        if w is not None:
            w = _weights(path, n, f"field {f['weights']!r}", w, (k,)).tolist()
        phase = row.get(f["phase"], "decode")
        if not isinstance(phase, str) or phase not in ("prefill", "decode"):
            raise ImportFault(path, n, f"field {f['phase']!r}: {phase!r} is not prefill/decode")
        if model is not None:
            _check_range(path, n, f"field {f['experts']!r}", np.asarray([ids]), model.experts)
        toks = data.setdefault(vals["seq"], {}).setdefault(vals["token"], {})
        if vals["layer"] in toks:
            raise ImportFault(
                path,
                n,
                f"sequence {vals['seq']} token {vals['token']} layer {vals['layer']} "
                f"repeats line {toks[vals['layer']][3]}",
            )
        toks[vals["layer"]] = (ids, w, phase, n)
    if not data:
        raise UserError(f"{path}: no rows")
    return _jsonl_sequences(path, data, model, k, bool(has_weights))


def _utf8_text(path: Path) -> str:
    """The file's text, refused (with the line) where it is not UTF-8."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ImportFault(path, raw[: exc.start].count(b"\n") + 1, "not UTF-8 text") from None


def _jsonl_position(
    path: Path, n: int, row: dict[str, Any], f: dict[str, str], model: ModelShape | None
) -> dict[str, int]:
    """A row's sequence, token and layer (the sequence 0 when absent), each checked."""
    vals = {}
    for key in ("seq", "token", "layer"):
        v = row.get(f[key], 0 if key == "seq" else None)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ImportFault(
                path, n, f"field {f[key]!r} must be a non-negative integer, got {v!r:.30}"
            )
        vals[key] = v
    for key in ("seq", "token"):
        if vals[key] > MAX_POSITION:
            raise ImportFault(path, n, f"field {f[key]!r}: {vals[key]} exceeds 2^31-1")
    if vals["layer"] >= (model.moe_layers if model else MAX_LAYERS):
        top = model.moe_layers if model else MAX_LAYERS
        raise ImportFault(path, n, f"layer {vals['layer']} outside 0..{top - 1}")
    return vals


def _jsonl_sequences(
    path: Path,
    data: dict[int, dict[int, dict[int, tuple[list[int], Any, Any, int]]]],
    model: ModelShape | None,
    k: int | None,
    has_weights: bool,
) -> list[_Seq]:
    """The rows gathered by sequence, token and layer as sequences: token order by position,
    one phase per token, every prefill token before the first decode token."""
    n_layers = (
        model.moe_layers
        if model
        else 1 + max(layer for toks in data.values() for t in toks.values() for layer in t)
    )
    seqs = []
    for sid in sorted(data):
        toks = data[sid]
        positions = np.asarray(sorted(toks), dtype=np.int64)
        ex = np.full((len(positions), n_layers, k or 1), -1, dtype=np.int64)
        wt = np.zeros(ex.shape, dtype=np.float32) if has_weights else None
        phases = []
        for t, pos in enumerate(positions.tolist()):
            layer_rows = toks[pos]
            phase_set = {r[2] for r in layer_rows.values()}
            if len(phase_set) > 1:
                line = max(r[3] for r in layer_rows.values())
                raise ImportFault(path, line, f"sequence {sid} token {pos}: phase differs by layer")
            phases.append(phase_set.pop())
            for layer, (ids, w, _p, _n) in layer_rows.items():
                ex[t, layer] = ids
                if wt is not None:
                    wt[t, layer] = w
        is_pre = np.asarray([p == "prefill" for p in phases])
        n_pre = int(is_pre.sum())
        if is_pre[n_pre:].any():
            pos = int(positions[n_pre:][is_pre[n_pre:]][0])
            line = min(r[3] for r in toks[pos].values())
            raise ImportFault(path, line, f"sequence {sid}: a prefill token follows a decode token")
        seqs.append(_Seq(sid, ex, wt, n_pre, positions))
    return seqs


def _npy_seq(
    path: Path, name: str, ex: Any, w: Any, sid: int, opts: ImportOptions, model: ModelShape | None
) -> _Seq:
    arr = np.asarray(ex)
    if arr.ndim != 3 or 0 in arr.shape[1:]:
        raise ImportFault(
            path, name, f"expected [tokens, layers >= 1, k >= 1], got shape {list(arr.shape)}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise ImportFault(path, name, f"expert ids must be integers, got {arr.dtype}")
    if arr.shape[1] > MAX_LAYERS:
        raise ImportFault(path, name, f"{arr.shape[1]} layers (at most {MAX_LAYERS})")
    if arr.size and (arr.min() < 0 or arr.max() > MAX_EXPERT_ID):
        bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
        raise ImportFault(path, name, f"expert id {bad} outside 0..{MAX_EXPERT_ID}")
    arr = arr.astype(np.int64)
    if model is not None:
        _check_range(path, name, "", arr, model.experts)
    weights = None
    if w is not None:
        weights = _weights(path, name, "weights", w, arr.shape)
    _check_prefill(path, name, opts.prefill, arr.shape[0])
    return _Seq(sid, arr, weights, opts.prefill, np.arange(arr.shape[0]))


#: What NumPy raises for a damaged or foreign .npy/.npz (an .npz member is read lazily).
_NPY_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, KeyError)


def _read_npy(path: Path, opts: ImportOptions, model: ModelShape | None) -> list[_Seq]:
    try:
        data = np.load(path, allow_pickle=False)
    except _NPY_ERRORS as exc:
        raise UserError(f"{path}: not a NumPy .npy/.npz file ({_first_line(exc)})") from None
    if isinstance(data, np.ndarray):
        return [_npy_seq(path, "array", data, None, 0, opts, model)]
    try:
        with data:
            return _read_npz(path, data, opts, model)
    except _NPY_ERRORS as exc:
        raise UserError(f"{path}: not a readable .npz file ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__


def _read_npz(path: Path, data: Any, opts: ImportOptions, model: ModelShape | None) -> list[_Seq]:
    """The arrays of an open .npz: ``experts`` (+ ``weights``, ``seq``), or one per sequence."""
    names = list(data.files)
    if "experts" in names:
        ex = data["experts"]
        w = data["weights"] if "weights" in names else None
        if "seq" not in names:
            return [_npy_seq(path, "experts", ex, w, 0, opts, model)]
        seq = np.asarray(data["seq"])
        if seq.ndim != 1 or np.asarray(ex).ndim < 1 or seq.shape[0] != np.asarray(ex).shape[0]:
            raise ImportFault(path, "seq", "must be one sequence id per token of 'experts'")
        if not np.issubdtype(seq.dtype, np.integer):
            raise ImportFault(path, "seq", f"sequence ids must be integers, got {seq.dtype}")
        if not seq.size:
            raise ImportFault(path, "experts", "no tokens")
        if seq.size and (seq.min() < 0 or seq.max() > MAX_POSITION):
            at = int(np.flatnonzero((seq < 0) | (seq > MAX_POSITION))[0])
            raise ImportFault(
                path, f"seq[{at}]", f"sequence id {seq[at]} outside 0..{MAX_POSITION}"
            )
        if w is not None and np.asarray(w).shape[:1] != seq.shape:
            raise ImportFault(path, "weights", "must have one row per token of 'experts'")
        cuts = np.flatnonzero(np.diff(seq)) + 1
        out = []
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), seq.shape[0]], strict=True):
            sid = int(seq[a])
            if any(s.seq_id == sid for s in out):
                raise ImportFault(path, f"seq[{a}]", f"sequence {sid} is not contiguous")
            sub_w = None if w is None else w[a:b]
            out.append(_npy_seq(path, f"experts[{a}:{b}]", ex[a:b], sub_w, sid, opts, model))
        return out
    out = []
    for name in names:
        if name.endswith("_weights"):
            continue
        w = data[f"{name}_weights"] if f"{name}_weights" in names else None
        out.append(_npy_seq(path, name, data[name], w, len(out), opts, model))
    return out


def _read_torch(path: Path, opts: ImportOptions, model: ModelShape | None) -> list[_Seq]:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency of daopsim
        raise UserError("trace import torch needs PyTorch (pip install torch)") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a foreign file
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{path}: not a torch.save file of tensors ({first})") from None
    items = obj if isinstance(obj, list) and obj and isinstance(obj[0], dict) else [obj]
    out = []
    for s, item in enumerate(items):
        top_k = opts.top_k
        n_pre = opts.prefill
        logits = item
        where = f"sequence {s}" if len(items) > 1 else "router_logits"
        file_pre = None
        if isinstance(item, dict):
            if "router_logits" in item:
                logits = item["router_logits"]
                top_k = top_k or _count(path, where, "top_k", item.get("top_k"), 1)
                file_pre = _count(path, where, "n_prefill", item.get("n_prefill"), 0)
            else:  # {layer name: tensor}, in insertion order
                logits = list(item.values())
        top_k = top_k or (model.top_k if model else None)
        if top_k is None:
            raise UserError(f"{path}: give --top-k (or --model, or 'top_k' in the file)")
        if not isinstance(logits, list | tuple) or not logits:
            raise ImportFault(path, where, "expected a list/tuple of per-layer logit tensors")
        if len(logits) > MAX_LAYERS:
            raise ImportFault(path, where, f"{len(logits)} layers (at most {MAX_LAYERS})")
        mats = []
        for layer, t in enumerate(logits):
            if not isinstance(t, torch.Tensor) or t.ndim not in (2, 3) or t.shape[-1] == 0:
                raise ImportFault(path, f"{where} layer {layer}", "expected a [tokens, E] tensor")
            t = t.reshape(-1, t.shape[-1]) if t.ndim == 3 else t
            if mats and t.shape != mats[0].shape:
                raise ImportFault(
                    path,
                    f"{where} layer {layer}",
                    f"shape {list(t.shape)} differs from layer 0's {list(mats[0].shape)}",
                )
            if t.is_complex() or t.layout != torch.strided:
                raise ImportFault(path, f"{where} layer {layer}", "expected dense real logits")
            mats.append(t.to(torch.float64))
        x = torch.stack(mats, dim=1)  # [T, L, E]
        if file_pre is not None:
            if file_pre > x.shape[0]:
                raise ImportFault(
                    path, where, f"n_prefill {file_pre} exceeds the {x.shape[0]} tokens"
                )
            n_pre = file_pre
        else:
            _check_prefill(path, where, n_pre, x.shape[0])
        if not torch.isfinite(x).all():
            raise ImportFault(path, where, "router logits contain NaN or infinity")
        n_exp = x.shape[-1]
        if model is not None and n_exp != model.experts:
            raise ImportFault(
                path, where, f"{n_exp} experts per layer, {model.name} has {model.experts}"
            )
        if not 0 < top_k <= n_exp:
            raise UserError(f"{path}: top-k {top_k} outside 1..{n_exp}")
        probs = torch.softmax(x, dim=-1)
        vals, ids = torch.topk(probs, top_k, dim=-1)
        weights = vals / vals.sum(dim=-1, keepdim=True)
        out.append(
            _Seq(
                seq_id=s,
                experts=ids.numpy().astype(np.int64),
                weights=weights.numpy().astype(np.float32),
                n_prefill=n_pre,
                positions=np.arange(x.shape[0]),
                probs=probs.numpy().astype(np.float32),
            )
        )
    return out


def _count(path: object, where: object, key: str, v: Any, low: int) -> int | None:
    """An optional integer field of a torch file (``top_k``, ``n_prefill``): None when absent,
    else an int >= ``low``, or an ImportFault naming the key."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ImportFault(path, where, f"'{key}' must be an integer >= {low}, got {v!r:.30}")
    return v


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
