"""The array formats of ``trace import``: ``npy`` (NumPy ``.npy``/``.npz`` arrays of top-k ids
``[tokens, layers, k]``) and ``torch`` (router logits saved with ``torch.save``, per layer
``[tokens, E]``, converted to top-k with softmax weights); errors name ``FILE:ELEMENT``.
"""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from daopsim.simulator.errors import UserError
from daopsim.simulator.importers_common import (
    MAX_EXPERT_ID,
    MAX_LAYERS,
    ImportFault,
    ImportOptions,
    _check_prefill,
    _check_range,
    _first_line,
    _Seq,
    _weights,
)
from daopsim.simulator.models import ModelShape
from daopsim.simulator.trace_format import (
    MAX_POSITION,
)


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
