"""The JSON formats of ``trace import``: ``vllm`` (completion responses with the routed experts of
the prompt and of each choice: a JSON list, one object, or JSONL) and ``jsonl`` (one object per
sequence, token and layer, with configurable field names); errors name ``FILE:LINE``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from daopsim.simulator.errors import UserError
from daopsim.simulator.importers_common import (
    MAX_LAYERS,
    ImportFault,
    ImportOptions,
    _check_ids,
    _check_range,
    _id_rows,
    _Seq,
    _weights,
)
from daopsim.simulator.models import ModelShape
from daopsim.simulator.trace_format import (
    MAX_POSITION,
)

#: Field names of the generic JSONL format (``--field NAME=KEY`` renames them).
JSONL_FIELDS = {
    "seq": "seq",
    "token": "token",
    "layer": "layer",
    "experts": "experts",
    "weights": "weights",
    "phase": "phase",
}


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
