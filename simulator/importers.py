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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from simulator.errors import UserError
from simulator.models import ModelShape, get_model
from simulator.sweep import file_sha256
from simulator.trace import (
    ALL_PROBS_MAX_EXPERTS,
    DEFAULT_TOP_M,
    MAX_POSITION,
    SequenceRouting,
    TraceMeta,
    write_trace,
)

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


# --------------------------------------------------------------------------------------------
# checks shared by the formats
# --------------------------------------------------------------------------------------------


def _id_rows(
    path: object, where: object, name: str, value: Any, layers: int | None, k: int | None
) -> np.ndarray:
    """``[tokens][layers][k]`` nested lists of ints to an int64 array, or an ImportFault."""
    if not isinstance(value, list):
        raise ImportFault(
            path, where, f"{name} must be a list of tokens, got {type(value).__name__}"
        )
    rows = []
    for t, tok in enumerate(value):
        if not isinstance(tok, list) or (layers is not None and len(tok) != layers):
            got = len(tok) if isinstance(tok, list) else type(tok).__name__
            raise ImportFault(path, where, f"{name}[{t}]: expected {layers} layers, got {got}")
        for layer, ids in enumerate(tok):
            _check_ids(path, where, f"{name}[{t}][{layer}]", ids, k)
        layers = len(tok)
        k = len(tok[0]) if tok else k
        rows.append(tok)
    if not rows:
        return np.zeros((0, layers or 0, k or 0), dtype=np.int64)
    return np.asarray(rows, dtype=np.int64)


def _check_ids(path: object, where: object, name: str, ids: Any, k: int | None) -> None:
    if not isinstance(ids, list) or not ids:
        raise ImportFault(path, where, f"{name}: expected a list of expert ids, got {ids!r:.40}")
    if k is not None and len(ids) != k:
        raise ImportFault(path, where, f"{name}: expected {k} experts, got {len(ids)}")
    for e in ids:
        if not isinstance(e, int) or isinstance(e, bool):
            raise ImportFault(path, where, f"{name}: expert id {e!r:.20} is not an integer")


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


def _weights(
    path: object, where: object, name: str, value: Any, shape: tuple[int, ...]
) -> np.ndarray:
    try:
        w = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ImportFault(path, where, f"{name}: not a list of numbers") from None
    if w.shape != shape:
        raise ImportFault(path, where, f"{name}: shape {list(w.shape)}, expected {list(shape)}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ImportFault(path, where, f"{name}: weights must be finite and >= 0")
    return w.astype(np.float32)


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
            yield line, obj
    lines = text.splitlines()
    if stripped.startswith("{") and len([ln for ln in lines if ln.strip()]) > 1:
        # one pretty-printed object, or JSONL: try the whole text first
        try:
            yield text[: len(text) - len(stripped)].count("\n") + 1, json.loads(text)
            return
        except json.JSONDecodeError:
            pass
    for n, ln in enumerate(lines, start=1):
        if not ln.strip():
            continue
        try:
            yield n, json.loads(ln)
        except json.JSONDecodeError as exc:
            raise ImportFault(path, n, f"malformed JSON line ({exc.msg})") from None


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
            prompt = _id_rows(path, line, "prompt_routed_experts", p_raw or [], layers, k)
            if prompt.size:
                layers, k = prompt.shape[1], prompt.shape[2]
            gen = _id_rows(path, line, "routed_experts", g_raw or [], layers, k)
            if gen.size:
                layers, k = gen.shape[1], gen.shape[2]
            if prompt.size and gen.size and prompt.shape[1:] != gen.shape[1:]:
                raise ImportFault(path, line, "prompt and generated routing differ in shape")
            parts = [a for a in (prompt, gen) if a.size]
            ex = np.concatenate(parts) if parts else np.zeros((0, layers or 0, k or 0), np.int64)
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
    try:
        fh = path.open(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    with fh:
        for n, ln in enumerate(fh, start=1):
            if not ln.strip():
                continue
            try:
                row = json.loads(ln)
            except json.JSONDecodeError as exc:
                raise ImportFault(path, n, f"malformed JSON line ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ImportFault(path, n, "expected a JSON object")
            vals = {}
            for key in ("seq", "token", "layer"):
                v = row.get(f[key], 0 if key == "seq" else None)
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise ImportFault(
                        path, n, f"field {f[key]!r} must be a non-negative integer, got {v!r:.30}"
                    )
                vals[key] = v
            if vals["token"] > MAX_POSITION:
                raise ImportFault(path, n, f"token index {vals['token']} exceeds 2^31-1")
            ids = row.get(f["experts"])
            _check_ids(path, n, f"field {f['experts']!r}", ids, k)
            k = len(ids)
            w = row.get(f["weights"])
            if has_weights is None:
                has_weights = w is not None
            elif has_weights != (w is not None):
                raise ImportFault(path, n, f"field {f['weights']!r} is on some rows only")
            if w is not None:
                w = _weights(path, n, f"field {f['weights']!r}", w, (k,)).tolist()
            phase = row.get(f["phase"], "decode")
            if phase not in ("prefill", "decode"):
                raise ImportFault(path, n, f"field {f['phase']!r}: {phase!r} is not prefill/decode")
            if model is not None:
                if vals["layer"] >= model.moe_layers:
                    raise ImportFault(
                        path, n, f"layer {vals['layer']} outside 0..{model.moe_layers - 1}"
                    )
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
    if arr.ndim != 3:
        raise ImportFault(path, name, f"expected [tokens, layers, k], got shape {list(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ImportFault(path, name, f"expert ids must be integers, got {arr.dtype}")
    arr = arr.astype(np.int64)
    if model is not None:
        _check_range(path, name, "", arr, model.experts)
    weights = None
    if w is not None:
        weights = _weights(path, name, "weights", np.asarray(w, dtype=np.float64), arr.shape)
    n_pre = min(opts.prefill, arr.shape[0])
    return _Seq(sid, arr, weights, n_pre, np.arange(arr.shape[0]))


def _read_npy(path: Path, opts: ImportOptions, model: ModelShape | None) -> list[_Seq]:
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{path}: not a NumPy .npy/.npz file ({str(exc).splitlines()[0]})"
        ) from None
    if isinstance(data, np.ndarray):
        return [_npy_seq(path, "array", data, None, 0, opts, model)]
    with data:
        names = list(data.files)
        if "experts" in names:
            ex = data["experts"]
            w = data["weights"] if "weights" in names else None
            if "seq" not in names:
                return [_npy_seq(path, "experts", ex, w, 0, opts, model)]
            seq = np.asarray(data["seq"])
            if seq.ndim != 1 or seq.shape[0] != np.asarray(ex).shape[0]:
                raise ImportFault(path, "seq", "must be one sequence id per token of 'experts'")
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
        if isinstance(item, dict):
            if "router_logits" in item:
                logits = item["router_logits"]
                top_k = top_k or _int_or_none(item.get("top_k"))
                n_pre = _int_or_none(item.get("n_prefill")) or n_pre
            else:  # {layer name: tensor}, in insertion order
                logits = list(item.values())
        top_k = top_k or (model.top_k if model else None)
        if top_k is None:
            raise UserError(f"{path}: give --top-k (or --model, or 'top_k' in the file)")
        if not isinstance(logits, list | tuple) or not logits:
            raise ImportFault(path, where, "expected a list/tuple of per-layer logit tensors")
        mats = []
        for layer, t in enumerate(logits):
            if not isinstance(t, torch.Tensor) or t.ndim not in (2, 3):
                raise ImportFault(path, f"{where} layer {layer}", "expected a [tokens, E] tensor")
            t = t.reshape(-1, t.shape[-1]) if t.ndim == 3 else t
            if mats and t.shape != mats[0].shape:
                raise ImportFault(
                    path,
                    f"{where} layer {layer}",
                    f"shape {list(t.shape)} differs from layer 0's {list(mats[0].shape)}",
                )
            mats.append(t.to(torch.float64))
        x = torch.stack(mats, dim=1)  # [T, L, E]
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
                n_prefill=min(n_pre, x.shape[0]),
                positions=np.arange(x.shape[0]),
                probs=probs.numpy().astype(np.float32),
            )
        )
    return out


def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


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
    """Convert ``src`` (format ``fmt``) to a daopsim trace at ``out`` (written atomically)."""
    if fmt not in FORMATS:
        raise UserError(f"unknown import format {fmt!r} (formats: {', '.join(FORMATS)})")
    if opts.missing_layers not in MISSING_RULES:
        raise UserError(f"--missing-layers must be one of {list(MISSING_RULES)}")
    path = Path(src)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    if opts.prefill < 0:
        raise UserError(f"--prefill must be >= 0, got {opts.prefill}")
    preset = get_model(opts.model) if opts.model is not None else None
    seqs = _READERS[fmt](path, opts, preset)
    if not seqs:
        raise UserError(f"{path}: no sequences")
    model = _resolve_model(opts, seqs, path)
    filled: list[np.ndarray] = []
    done: list[_Seq] = []
    for s in seqs:
        s2, mask = fill_missing(s, opts.missing_layers)
        done.append(s2)
        filled.append(mask)
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
    try:
        write_trace(out, meta, routings)
    except OSError as exc:
        raise UserError(f"-o {out}: cannot write the trace ({exc.strerror or exc})") from None
    return meta


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
