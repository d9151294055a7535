"""Feeding prompts through the model: the prompts file, the tokenizers (the model's own or a byte
tokenizer), and generation (greedy, several prompts per call, left padding), with each forward's
rows mapped back to their sequences (padding dropped) as one ``SequenceRouting`` per prompt.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from daopsim.simulator.capture_layers import CaptureError, MoeLayer, _torch
from daopsim.simulator.capture_recorder import RoutingRecorder, StepRouting
from daopsim.simulator.errors import UserError
from daopsim.simulator.trace_format import (
    SequenceRouting,
)

# --------------------------------------------------------------------------------------------
# Prompts and tokenisation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One prompt and where it came from (file line, for error messages)."""

    text: str
    line: int


def load_prompts(path: str | os.PathLike[str], limit: int | None = None) -> list[Prompt]:
    """Prompts from a ``.jsonl`` (``prompt`` or ``text`` field) or ``.txt`` (one per line).

    Blank lines are skipped. A bad line raises ``UserError`` naming the file and line.
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such prompts file")
    suffix = p.suffix.lower()
    if suffix not in (".jsonl", ".txt"):
        raise UserError(f"{p}: prompts must be a .jsonl or .txt file")
    out: list[Prompt] = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise UserError(f"{p}: not UTF-8 text ({exc.reason})") from None
    for n, raw in enumerate(lines, start=1):
        if limit is not None and len(out) >= limit:
            break
        if not raw.strip():
            continue
        if suffix == ".txt":
            out.append(Prompt(raw, n))
            continue
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            raise UserError(f"{p}: line {n}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise UserError(
                f"{p}: line {n}: expected a JSON object with a 'prompt' or 'text' field"
            )
        text = obj.get("prompt", obj.get("text"))
        if text is None:
            raise UserError(f"{p}: line {n}: no 'prompt' or 'text' field")
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"{p}: line {n}: the prompt must be a non-empty string")
        out.append(Prompt(text, n))
    if not out:
        raise UserError(f"{p}: no prompts found")
    return out


class ByteTokenizer:
    """Tokenizer-free fallback: UTF-8 bytes modulo the vocabulary size (deterministic)."""

    name = "bytes-mod-vocab"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return [b % self.vocab_size for b in text.encode("utf-8")]


class HFTokenizer:
    """A Hugging Face tokenizer behind the same one-method interface."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.name = f"hf:{type(tok).__name__}"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's usual special tokens)."""
        return list(self.tok(text)["input_ids"])


# --------------------------------------------------------------------------------------------
# Generation and mapping rows back to sequences
# --------------------------------------------------------------------------------------------


@dataclass
class GenerationSettings:
    """How sequences are generated (greedy always)."""

    max_new_tokens: int = 64
    stop_at_eos: bool = False  # default: min_new_tokens = max_new_tokens (DAOP protocol)
    batch_size: int = 1
    max_prompt_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """For the trace provenance."""
        return {
            "decoding": "greedy",
            "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": 0 if self.stop_at_eos else self.max_new_tokens,
            "stop_at_eos": self.stop_at_eos,
            "batch_size": self.batch_size,
            "max_prompt_tokens": self.max_prompt_tokens,
            "padding": "left",
            "decode_rows": "one per generated token: the forward pass that consumes it",
        }


@dataclass
class SequenceCapture:
    """One captured sequence: its routing plus the tokens that produced it."""

    routing: SequenceRouting
    prompt_ids: list[int]
    generated_ids: list[int]  # the tokens whose forward passes are the decode rows


def _eos_ids(model: Any) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]


def _input_device(model: Any) -> Any:
    emb = model.get_input_embeddings()
    return emb.weight.device


def generate_batch(
    model: Any,
    recorder: RoutingRecorder,
    prompts: list[list[int]],
    seq_ids: list[int],
    settings: GenerationSettings,
    pad_id: int,
) -> list[SequenceCapture]:
    """Generate for a batch of tokenised prompts (left padding); one capture per prompt."""
    torch = _torch()
    b = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    dev = _input_device(model)
    n_new = settings.max_new_tokens + 1  # the extra token is discarded: see module docstring
    eos = _eos_ids(model)
    kwargs: dict[str, Any] = {
        "max_new_tokens": n_new,
        "min_new_tokens": 0 if settings.stop_at_eos else n_new,
        "do_sample": False,
        "num_beams": 1,
        "pad_token_id": pad_id,
        "use_cache": True,
    }
    if eos:
        kwargs["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    recorder.reset()
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **kwargs)
    steps = recorder.steps
    gen = out[:, width:].cpu().numpy()
    if not steps or steps[0].experts.shape[:2] != (b, width):
        raise RuntimeError("the first recorded forward pass is not the prefill of this batch")
    decode_steps = steps[1:]
    if any(d.experts.shape[:2] != (b, 1) for d in decode_steps):
        raise RuntimeError("a recorded decode step does not have one token per sequence")
    results = []
    for i, p in enumerate(prompts):
        n_dec = settings.max_new_tokens
        row = gen[i].tolist()
        if settings.stop_at_eos and eos:
            stops = [t for t, tok in enumerate(row) if tok in eos]
            if stops:
                n_dec = min(n_dec, stops[0])
        n_dec = min(n_dec, len(decode_steps))
        results.append(
            SequenceCapture(
                routing=_sequence(seq_ids[i], i, len(p), width, steps[0], decode_steps[:n_dec]),
                prompt_ids=list(p),
                generated_ids=[int(t) for t in row[:n_dec]],
            )
        )
    return results


def _sequence(
    seq_id: int, i: int, n_prompt: int, width: int, prefill: StepRouting, decode: list[StepRouting]
) -> SequenceRouting:
    """Rows of batch element ``i``: its prompt tokens (padding dropped) then its decode steps."""

    def cat(name: str) -> np.ndarray | None:
        first = getattr(prefill, name)
        if first is None:
            return None
        parts = [first[i, width - n_prompt :]]
        parts += [getattr(d, name)[i] for d in decode]
        return np.concatenate(parts, axis=0)

    n_tok = n_prompt + len(decode)
    return SequenceRouting(
        seq_id=seq_id,
        positions=np.arange(n_tok, dtype=np.int32),
        n_prefill=n_prompt,
        experts=cat("experts"),
        weights=cat("weights"),
        probs=cat("probs"),
        early_experts=cat("early_experts"),
        early_probs=cat("early_probs"),
        prob_ids=cat("prob_ids"),
        early_prob_ids=cat("early_prob_ids"),
    )


def iter_captures(
    model: Any,
    moe: list[MoeLayer],
    prompts: list[list[int]],
    settings: GenerationSettings,
    pad_id: int,
    top_m: int | None = None,
    lines: list[int] | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> Iterator[SequenceCapture]:
    """Capture every prompt batch by batch; yields sequences in prompt order.

    A failure inside generation raises :class:`CaptureError` naming the sequences (and prompt
    lines, when given) of the failing batch.
    """
    with RoutingRecorder(moe, top_m=top_m) as recorder:
        for start in range(0, len(prompts), settings.batch_size):
            batch = prompts[start : start + settings.batch_size]
            seq_ids = list(range(start, start + len(batch)))
            try:
                captured = generate_batch(model, recorder, batch, seq_ids, settings, pad_id)
            except Exception as exc:
                which = (
                    f"sequence {seq_ids[0]}"
                    if len(seq_ids) == 1
                    else f"sequences {seq_ids[0]}-{seq_ids[-1]}"
                )
                if lines:
                    ln = [lines[s] for s in seq_ids]
                    which += f" (prompt line{'s' if len(ln) > 1 else ''} "
                    which += f"{', '.join(map(str, ln))})"
                first = str(exc).splitlines()[0] if str(exc) else ""
                raise CaptureError(
                    f"capture failed on {which}: {type(exc).__name__}: {first}"
                ) from exc
            recorder.reset()  # free the batch's step arrays before the next generate
            yield from captured
            if on_batch is not None:
                on_batch(len(batch))
