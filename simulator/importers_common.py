"""What every ``trace import`` format shares: the options (``ImportOptions``), one imported
sequence (``_Seq``), the error that names the file and the line or element (``ImportFault``),
and the checks of imported values (expert ids, ranges, gate weights, the prompt length).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from daopsim.simulator.errors import UserError
from daopsim.simulator.trace_read import weight_rises


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__
