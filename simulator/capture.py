"""Record real routing traces by hooking a PyTorch (Hugging Face transformers 5.x) MoE model.

A forward hook on every MoE layer's router module (``model.model.layers[i].mlp.gate`` or
``.mlp.router``) sees the router's input and its output ``(logits, top-k weights, top-k ids)``,
which are exactly what the experts then use. From them each forward pass yields, per token and
MoE layer: the selected experts and their weights, the softmax of the logits over all experts
(the top ``m`` with ids when a layer has more than 128 experts), and the one-layer-early view:
layer l's router applied to layer l-1's router input, computed inside the same forward pass.

Generation runs through ``model.generate`` (greedy, several prompts per call, left padding);
the first forward of a call is the prefill, each later one a decode step. Rows are mapped back
to sequences, padding positions are dropped, and each sequence is streamed to the trace file
through :class:`daopsim.simulator.trace.TraceWriter`, which renames the file into place only on
success.

Decode convention: decode row i is the forward pass that consumes generated token i (what a
runtime executes once per generated token). To give ``max_new_tokens`` decode rows, generation
asks the model for one token more and discards it. By default ``min_new_tokens`` equals
``max_new_tokens`` (the DAOP measurement protocol), so an end-of-sequence token never cuts a
sequence short and every sequence has the same number of decode rows.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from daopsim.simulator.errors import UserError, check_seed
from daopsim.simulator.models import ModelShape
from daopsim.simulator.trace import (
    ALL_PROBS_MAX_EXPERTS,
    DEFAULT_TOP_M,
    RANK_ORDER_COLUMNS,
    SequenceRouting,
    TraceMeta,
    TraceWriter,
    tool_versions,
    write_valid_trace,
)

#: Router module class name -> family label, for every router this module knows how to read.
#: Each returns ``(router_logits, top_k_weights, top_k_indices)`` from its forward.
ROUTER_CLASSES: dict[str, str] = {
    "MixtralTopKRouter": "Mixtral",
    "Qwen2MoeTopKRouter": "Qwen2-MoE",
    "Qwen3MoeTopKRouter": "Qwen3-MoE",
    "OlmoeTopKRouter": "OLMoE",
    "PhimoeTopKRouter": "PhiMoE",
    "DeepseekV3TopkRouter": "DeepSeek-V3 style",
    "DeepseekV2TopkRouter": "DeepSeek-V3 style",
    "Glm4MoeTopkRouter": "DeepSeek-V3 style",
    "GptOssTopKRouter": "GPT-OSS",
}
SUPPORTED_FAMILIES = (
    "Mixtral",
    "Qwen2-MoE",
    "Qwen3-MoE",
    "OLMoE",
    "PhiMoE",
    "DeepSeek-V3 style",
    "GPT-OSS",
)
#: Families ``--random-init`` can build (HF ``model_type`` names).
RANDOM_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "deepseek_v3", "gpt_oss")
DTYPES = ("bf16", "fp16", "fp32")


class CaptureError(UserError):
    """Generation or recording failed; names the sequences (and prompt lines) involved."""


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise UserError(
            "capture needs torch and transformers: pip install 'daopsim[capture]'"
        ) from None
    return torch


def _torch_dtype(name: str) -> Any:
    torch = _torch()
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name not in table:
        raise UserError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return table[name]


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
# Model discovery and shape
# --------------------------------------------------------------------------------------------


@dataclass
class MoeLayer:
    """One MoE layer of a loaded model: where it is and its router."""

    layer_id: int  # index among all transformer blocks
    block: Any  # the MoE block (``layers[i].mlp``)
    router: Any  # the router module (``mlp.gate`` or ``mlp.router``)
    family: str


def _decoder_layers(model: Any) -> Sequence[Any] | None:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    if layers is None:
        layers = getattr(model, "layers", None)
    return layers


def find_moe_layers(model: Any) -> list[MoeLayer]:
    """The MoE layers of a supported model, in order; ``UserError`` for an unsupported one."""
    supported = ", ".join(SUPPORTED_FAMILIES)
    layers = _decoder_layers(model)
    if layers is None:
        raise UserError(
            f"model {type(model).__name__} has no model.layers; capture supports "
            f"decoder MoE models: {supported}"
        )
    found: list[MoeLayer] = []
    unknown: set[str] = set()
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            continue
        for attr in ("gate", "router"):
            router = getattr(mlp, attr, None)
            if router is None or not hasattr(router, "forward"):
                continue
            name = type(router).__name__
            if name in ROUTER_CLASSES:
                found.append(MoeLayer(i, mlp, router, ROUTER_CLASSES[name]))
                break
            if "router" in name.lower() or "gate" in name.lower():
                unknown.add(name)
    if not found:
        what = f" (router modules seen: {', '.join(sorted(unknown))})" if unknown else ""
        raise UserError(
            f"model {type(model).__name__} has no supported MoE router{what}; "
            f"supported families: {supported}"
        )
    return found


def _n_experts(router: Any) -> int:
    n = getattr(router, "num_experts", None)
    return int(n) if n else int(router.weight.shape[0])


def _head_dims(config: Any) -> dict[str, int]:
    """The query/key and value head widths a HF config states (``head_dim``; DeepSeek's MLA:
    ``qk_nope_head_dim + qk_rope_head_dim`` and ``v_head_dim``); 0 where it states none (the
    model shape then takes ``hidden / heads``)."""
    nope = int(getattr(config, "qk_nope_head_dim", 0) or 0)
    rope = int(getattr(config, "qk_rope_head_dim", 0) or 0)
    if nope or rope:
        return {"head_dim": nope + rope, "v_head_dim": int(getattr(config, "v_head_dim", 0) or 0)}
    return {"head_dim": int(getattr(config, "head_dim", 0) or 0), "v_head_dim": 0}


def _kv_bytes_per_token(config: Any, layers: int, nbytes: float) -> int:
    lora = getattr(config, "kv_lora_rank", None)
    if lora:  # multi-head latent attention caches one compressed vector plus the rope part
        return round(layers * (lora + int(getattr(config, "qk_rope_head_dim", 0))) * nbytes)
    heads = int(getattr(config, "num_attention_heads", 1))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return round(2 * layers * kv_heads * int(head_dim) * nbytes)


def model_shape(model: Any, moe: list[MoeLayer], name: str, dtype: str) -> ModelShape:
    """A :class:`ModelShape` from the HF config and the weights' sizes.

    Routed-expert parameters are counted from the expert modules' tensors; everything else
    (attention, embeddings, dense FFNs, shared experts, routers) is ``non_expert_params``.
    """
    from daopsim.simulator.models import dtype_bytes

    config = model.config
    first = moe[0]
    experts = _n_experts(first.router)
    top_k = int(getattr(first.router, "top_k", None) or config.num_experts_per_tok)
    hidden = int(config.hidden_size)
    ffn = int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
    notes: list[str] = []
    routed_total = 0
    per_expert = 0
    for layer in moe:
        mod = getattr(layer.block, "experts", None)
        n = sum(p.numel() for p in mod.parameters()) if mod is not None else 0
        routed_total += n
        per_expert = per_expert or n // experts
    extra = per_expert - 3 * hidden * ffn
    if extra < 0:  # packed or quantised weights: numel no longer counts parameters
        notes.append("expert weights are packed/quantised; expert size taken from the config")
        routed_total = 3 * hidden * ffn * experts * len(moe)
        extra = 0
    total = sum(p.numel() for p in model.parameters())
    shared_n, shared_ffn = 0, 0
    for attr in ("shared_expert", "shared_experts"):
        mod = getattr(first.block, attr, None)
        if mod is None:
            continue
        down = getattr(mod, "down_proj", None)
        width = int(down.in_features) if down is not None else ffn
        shared_n = int(getattr(config, "n_shared_experts", None) or 1)
        shared_ffn = width // shared_n
        notes.append("shared experts always run on every token (not routed, not in the trace)")
    emb = model.get_input_embeddings()
    layers = int(config.num_hidden_layers)
    return ModelShape(
        name=name,
        family=str(config.model_type),
        layers=layers,
        moe_layers=len(moe),
        hidden=hidden,
        expert_ffn=ffn,
        experts=experts,
        top_k=top_k,
        expert_matrices=3,
        expert_extra_params=int(extra),
        shared_experts=shared_n,
        shared_expert_ffn=shared_ffn,
        non_expert_params=int(total - routed_total),
        embedding_params=int(emb.weight.numel()) if emb is not None else 0,
        kv_bytes_per_token=_kv_bytes_per_token(config, layers, dtype_bytes(dtype)),
        dtype=dtype,
        # query heads, so a runtime with eager attention can charge a captured model's scores
        attention_heads=int(getattr(config, "num_attention_heads", 0) or 0),
        **_head_dims(config),
        source=f"captured ({first.family}; HF config and weight sizes)",
        first_moe_layer=moe[0].layer_id,
        notes="; ".join(notes),
    )


def model_name(model_id: str) -> str:
    """A short model name from a hub id or a local path (its last component, lower case)."""
    text = str(model_id).rstrip("/\\")
    return (text.replace("\\", "/").rsplit("/", 1)[-1] or text).lower()


# --------------------------------------------------------------------------------------------
# Rank order: rank 0 is the expert with the highest selection score
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankOrder:
    """How captured top-k rows are ordered, for the trace provenance.

    ``score`` says in words which score ranks the experts; ``columns`` lists the stored columns
    that are non-increasing along rank under it (what ``trace validate`` can check).
    """

    score: str
    columns: tuple[str, ...]


def selection_score(router: Any, logits: Any) -> Any:
    """The score ``router`` picked its top-k on, per expert (float32, ``[tokens, E]``).

    Routers with an ``e_score_correction_bias`` (DeepSeek-V3, GLM-4-MoE) select on
    ``sigmoid(logits) + bias``, computed here with the router's own operations; every other
    supported router selects on a monotone function of the logits (softmax, or the logits
    themselves), so the logits order the experts the same way.
    """
    torch = _torch()
    logits = logits.reshape(-1, logits.shape[-1]).float()
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is None:
        return logits
    return torch.sigmoid(logits) + bias.to(device=logits.device, dtype=torch.float32)


def sort_by_score(router: Any, logits: Any, ids: Any, *paired: Any) -> tuple[Any, ...]:
    """``ids`` (and tensors paired with them) reordered per row by descending selection score.

    Routers that take their top-k with ``sorted=False`` (DeepSeek) return the experts in no
    particular order; the trace promises rank 0 is the top expert. The sort is stable, so
    rows that are already in order (``torch.topk`` with ``sorted=True``) stay as they are.
    """
    torch = _torch()
    k = ids.shape[-1]
    ids = ids.reshape(-1, k)
    score = selection_score(router, logits).gather(1, ids.long())
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    return ids.gather(1, order), *(t.reshape(-1, k).gather(1, order) for t in paired)


def rank_order(moe: list[MoeLayer]) -> RankOrder:
    """What a capture's rank order follows, given the model's routers."""
    router = moe[0].router
    if getattr(router, "e_score_correction_bias", None) is not None:
        score = "selection score (sigmoid of router logits + e_score_correction_bias)"
        if all(not bool(m.router.e_score_correction_bias.any()) for m in moe):
            # a zero bias leaves the sigmoid order, which weights and probabilities follow
            return RankOrder(f"{score}; the bias is zero in every layer", RANK_ORDER_COLUMNS)
        return RankOrder(score, ())
    if type(router).__name__ == "PhimoeTopKRouter":
        # sparsemixer's weights come from differently masked softmaxes: not monotone in rank
        return RankOrder("router logit (sparsemixer picks in descending logit order)", ("probs",))
    return RankOrder(
        "router logit (the router's top-k of its logits or softmax)", RANK_ORDER_COLUMNS
    )


# --------------------------------------------------------------------------------------------
# Recording hooks
# --------------------------------------------------------------------------------------------


@dataclass
class StepRouting:
    """Routing of one forward pass, shaped ``[batch, tokens, layers, ...]`` (numpy)."""

    experts: np.ndarray
    weights: np.ndarray
    probs: np.ndarray
    prob_ids: np.ndarray | None
    early_experts: np.ndarray
    early_probs: np.ndarray
    early_prob_ids: np.ndarray | None


class RoutingRecorder:
    """Forward hooks on every MoE router; collects one :class:`StepRouting` per forward pass.

    Use as a context manager (hooks are removed on exit). The hooks only read: the model's
    outputs are unchanged. The one-layer-early view calls layer l's router ``forward`` directly
    (no hooks run) on layer l-1's router input from the same pass.
    """

    def __init__(self, moe: list[MoeLayer], top_m: int | None = None) -> None:
        self.moe = moe
        self.experts = _n_experts(moe[0].router)
        self.top_m = top_m if top_m is not None and top_m < self.experts else None
        self.steps: list[StepRouting] = []
        self._handles: list[Any] = []
        self._shape: tuple[int, int] | None = None
        self._prev_input: Any = None
        self._layer_parts: list[tuple[Any, ...]] = []

    def __enter__(self) -> RoutingRecorder:
        for j, layer in enumerate(self.moe):
            self._handles.append(
                layer.block.register_forward_pre_hook(self._block_pre_hook, with_kwargs=True)
            )
            self._handles.append(layer.router.register_forward_hook(self._make_hook(j)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._prev_input = None
        self._layer_parts = []

    def reset(self) -> None:
        """Forget recorded steps (start of a new batch)."""
        self.steps = []
        self._prev_input = None
        self._layer_parts = []

    def _block_pre_hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if hidden is not None and hidden.dim() == 3:
            self._shape = (int(hidden.shape[0]), int(hidden.shape[1]))

    def _probs(self, logits: Any) -> tuple[Any, Any]:
        torch = _torch()
        probs = torch.softmax(logits.float(), dim=-1)
        if self.top_m is None:
            return probs, None
        vals, ids = torch.topk(probs, self.top_m, dim=-1)
        return vals, ids

    def _make_hook(self, j: int) -> Callable[..., None]:
        torch = _torch()
        last = len(self.moe) - 1
        router = self.moe[j].router

        def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
            with torch.no_grad():
                x = args[0]
                x = x.reshape(-1, x.shape[-1])
                logits, weights, idx = output[0], output[1], output[2]
                idx, weights = sort_by_score(router, logits, idx, weights)
                probs, prob_ids = self._probs(logits)
                if j == 0 or self._prev_input is None:
                    e_idx = e_probs = e_ids = None
                else:
                    dev = next(router.parameters()).device
                    prev = self._prev_input.to(dev)
                    e_logits, _, e_idx = router.forward(prev)
                    (e_idx,) = sort_by_score(router, e_logits, e_idx)
                    e_probs, e_ids = self._probs(e_logits)
                self._layer_parts.append((idx, weights, probs, prob_ids, e_idx, e_probs, e_ids))
                self._prev_input = x
                if j == last:
                    self._finish_step()

        return hook

    def _finish_step(self) -> None:
        torch = _torch()
        parts, self._layer_parts = self._layer_parts, []
        self._prev_input = None
        if len(parts) != len(self.moe):
            raise RuntimeError(
                f"recorded {len(parts)} MoE layers in one forward pass, expected {len(self.moe)}"
            )
        n = int(parts[0][0].shape[0])
        b, s = self._shape if self._shape and self._shape[0] * self._shape[1] == n else (1, n)
        dev = parts[0][0].device
        k = int(parts[0][0].shape[-1])
        width = int(parts[0][2].shape[-1])

        def stack(i: int, dtype: Any, fill: float | None = None) -> np.ndarray | None:
            if parts[0][i] is None and fill is None:
                return None
            cols = []
            for part in parts:
                t = part[i]
                if t is None:  # the first MoE layer has no early view
                    shape = (n, width if i in (5, 6) else k)
                    t = torch.full(shape, fill, dtype=torch.float32, device=dev)
                cols.append(t.detach().to(device=dev, dtype=torch.float32))
            # one device-to-host copy per field and step, not one per layer
            out = torch.stack(cols, dim=1).cpu().numpy().astype(dtype, copy=False)
            return out.reshape(b, s, *out.shape[1:])

        ids_fill = -1.0 if self.top_m else None
        step = StepRouting(
            experts=stack(0, np.int16),
            weights=stack(1, np.float32),
            probs=stack(2, np.float32),
            prob_ids=stack(3, np.int16),
            early_experts=stack(4, np.int16, fill=-1.0),
            early_probs=stack(5, np.float32, fill=float("nan")),
            early_prob_ids=stack(6, np.int16, fill=ids_fill),
        )
        self.steps.append(step)


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


# --------------------------------------------------------------------------------------------
# Models: tiny random ones and real ones
# --------------------------------------------------------------------------------------------


def random_config(family: str) -> Any:
    """A tiny config of ``family`` (hidden 32, 4 layers, 8 experts, top-2, vocab 128)."""
    import transformers as tf

    common: dict[str, Any] = dict(
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    fam = family.strip().lower().replace("-", "_")
    if fam == "mixtral":
        return tf.MixtralConfig(
            intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, **common
        )
    if fam == "qwen2_moe":  # layer 0 dense: exercises skipping non-MoE layers
        return tf.Qwen2MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
            **common,
        )
    if fam == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=8,
            **common,
        )
    if fam == "olmoe":
        return tf.OlmoeConfig(intermediate_size=64, num_experts=8, num_experts_per_tok=2, **common)
    if fam == "phimoe":
        return tf.PhimoeConfig(
            intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, **common
        )
    if fam == "deepseek_v3":
        common["num_key_value_heads"] = common["num_attention_heads"]
        return tf.DeepseekV3Config(
            intermediate_size=64,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_shared_experts=1,
            **common,
        )
    if fam == "gpt_oss":
        del common["max_position_embeddings"]  # its YaRN defaults expect the stock context
        return tf.GptOssConfig(
            intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=8, **common
        )
    raise UserError(
        f"--random-init: unknown family {family!r}; known: {', '.join(RANDOM_FAMILIES)}"
    )


def random_model(family: str, seed: int = 0, dtype: str = "fp32") -> Any:
    """A tiny randomly initialised causal LM of ``family`` in eval mode."""
    torch = _torch()
    from transformers import AutoModelForCausalLM

    config = random_config(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(dtype))
    return model.eval()


def _offline(model_id: str) -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    return flag not in ("", "0", "false", "no", "off") or Path(model_id).is_dir()


def load_model(
    model_id: str, dtype: str, device: str, revision: str | None = None
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer or None)``; offline when HF_HUB_OFFLINE is set or it is a dir.

    A load failure is one line (``UserError``). With ``device="cuda"`` and ``accelerate``
    installed the weights are spread with ``device_map="auto"``.
    """
    torch = _torch()
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    looks_local = model_id.startswith(("/", ".", "~")) or model_id.count("/") > 1
    if looks_local and not Path(model_id).expanduser().is_dir():
        raise UserError(f"{model_id}: no such model directory")
    if looks_local:
        model_id = str(Path(model_id).expanduser())
    local = _offline(model_id)
    kwargs: dict[str, Any] = {"dtype": _torch_dtype(dtype), "local_files_only": local}
    if revision:
        kwargs["revision"] = revision
    if device == "cuda" and importlib.util.find_spec("accelerate") is not None:
        kwargs["device_map"] = "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(model_id, **kwargs)
    except (OSError, ValueError, ImportError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = " (offline: local files only)" if local else ""
        raise UserError(f"cannot load model {model_id!r}{where}: {first}") from None
    if "device_map" not in kwargs:
        model = model.to(device)
    model.eval()
    tok = None
    try:
        tok = AutoTokenizer.from_pretrained(
            model_id, local_files_only=local, **({"revision": revision} if revision else {})
        )
    except (OSError, ValueError, ImportError, KeyError, TypeError):
        tok = None  # fall back to the byte tokenizer; recorded in the provenance
    return model, tok


# --------------------------------------------------------------------------------------------
# The whole pipeline
# --------------------------------------------------------------------------------------------


@dataclass
class CaptureConfig:
    """Everything ``daopsim capture`` needs."""

    output: str
    prompts: str
    model: str | None = None
    random_init: str | None = None
    seed: int = 0
    revision: str | None = None
    device: str = "cpu"
    dtype: str | None = None  # default: bf16 on cuda, fp32 on cpu
    limit: int | None = None
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    top_m: int = DEFAULT_TOP_M
    progress: bool = True


@dataclass
class CaptureResult:
    """What a capture wrote."""

    path: Path
    meta: TraceMeta
    decode_tokens: list[int]


def creation_date() -> str:
    """Today's UTC date (``YYYY-MM-DD``), or that of ``SOURCE_DATE_EPOCH`` when it is set.

    A date rather than a timestamp, so captures made the same day are byte-identical;
    ``SOURCE_DATE_EPOCH`` (the reproducible-builds convention) pins it for any day.
    """
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if epoch:
        try:
            when = _dt.datetime.fromtimestamp(int(epoch), _dt.UTC)
        except (ValueError, OverflowError, OSError):
            raise UserError(f"SOURCE_DATE_EPOCH={epoch!r} is not a Unix time in seconds") from None
    else:
        when = _dt.datetime.now(_dt.UTC)
    return when.date().isoformat()


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_settings(cfg: CaptureConfig) -> None:
    g = cfg.generation
    if g.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if g.batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    if g.max_prompt_tokens is not None and g.max_prompt_tokens < 1:
        raise UserError("--max-prompt-tokens must be at least 1")
    if cfg.limit is not None and cfg.limit < 1:
        raise UserError("--limit must be at least 1")
    if cfg.device not in ("cpu", "cuda"):
        raise UserError(f"--device must be cpu or cuda, not {cfg.device!r}")
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():  # a CPU-only build, or no GPU visible
            raise UserError(
                "--device cuda: no CUDA device is available to this PyTorch "
                f"({torch.__version__}); use --device cpu"
            )
    if (cfg.model is None) == (cfg.random_init is None):
        raise UserError("give exactly one of --model and --random-init")
    if cfg.top_m < 1:
        raise UserError("--top-m must be at least 1")
    check_seed(cfg.seed)  # torch.manual_seed takes -1, and it would be a different run


def capture_model(
    model: Any,
    prompts: list[Prompt],
    output: str | os.PathLike[str],
    settings: GenerationSettings,
    name: str,
    dtype: str,
    tokenizer: Any = None,
    provenance: dict[str, Any] | None = None,
    top_m: int = DEFAULT_TOP_M,
    progress: Callable[[int], None] | None = None,
) -> CaptureResult:
    """Capture an already loaded model over ``prompts`` into the trace at ``output``."""
    moe = find_moe_layers(model)
    shape = model_shape(model, moe, name, dtype)
    tok = tokenizer or ByteTokenizer(int(model.config.vocab_size))
    token_lists = _prompt_tokens(prompts, tok, settings)
    pad = _pad_id(model)
    m = top_m if shape.experts > ALL_PROBS_MAX_EXPERTS else shape.experts
    stored_m = min(m, shape.experts)
    meta = TraceMeta(
        model=shape,
        provenance=_capture_provenance(moe, shape, tok, settings, stored_m, provenance),
        probs_stored=stored_m,
        moe_layer_ids=[layer.layer_id for layer in moe],
    )
    decode_tokens: list[int] = []

    def fill(tmp: Path) -> None:
        with TraceWriter(tmp, meta) as writer:
            for cap in iter_captures(
                model,
                moe,
                token_lists,
                settings,
                int(pad),
                top_m=stored_m if stored_m < shape.experts else None,
                lines=[p.line for p in prompts],
                on_batch=progress,
            ):
                writer.write_sequence(cap.routing)
                decode_tokens.append(cap.routing.n_decode)

    # what capture writes, `trace validate` accepts (the check import and synth share)
    write_valid_trace(output, fill, flag=None, what="captured")
    return CaptureResult(path=Path(output), meta=meta, decode_tokens=decode_tokens)


def _prompt_tokens(
    prompts: list[Prompt], tok: Any, settings: GenerationSettings
) -> list[list[int]]:
    """Each prompt's token ids, cut to ``settings.max_prompt_tokens``; a prompt with none is
    refused by its line."""
    token_lists: list[list[int]] = []
    for p in prompts:
        ids = tok.encode(p.text)
        if settings.max_prompt_tokens is not None:
            ids = ids[: settings.max_prompt_tokens]
        if not ids:
            raise UserError(f"prompt on line {p.line} has no tokens")
        token_lists.append(ids)
    return token_lists


def _pad_id(model: Any) -> Any:
    """The padding token: the generation config's, the model config's, else the first
    end-of-sequence id, else 0."""
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config, "pad_token_id", None)
    if pad is None:
        eos = _eos_ids(model)
        pad = eos[0] if eos else 0
    return pad


def _capture_provenance(
    moe: list[Any],
    shape: Any,
    tok: Any,
    settings: GenerationSettings,
    stored_m: int,
    provenance: dict[str, Any] | None,
) -> dict[str, Any]:
    """The trace's provenance: the caller's, with how the capture was made (router, tokenizer,
    generation settings, which probabilities are stored, the rank order, tool versions)."""
    order = rank_order(moe)
    prov = dict(provenance or {})
    prov.setdefault("created", creation_date())
    prov.update(
        {
            "source": "capture",
            "router": type(moe[0].router).__name__,
            "router_family": moe[0].family,
            "tokenizer": getattr(tok, "name", type(tok).__name__),
            "generation": settings.to_dict(),
            "probs": (
                "softmax of router logits over all experts"
                if stored_m == shape.experts
                else f"top-{stored_m} of the softmax of router logits, with expert ids"
            ),
            "early_view": "router of MoE layer l applied to the router input of MoE layer l-1, "
            "same forward pass",
            "rank_order": order.score,
            "rank_order_columns": list(order.columns),
            "shared_experts": shape.shared_experts,
            "tool_versions": tool_versions(),
        }
    )
    return prov


def run_capture(cfg: CaptureConfig) -> CaptureResult:
    """Load prompts and the model (or build a random one), capture, write the trace."""
    _check_settings(cfg)
    prompts = load_prompts(cfg.prompts, limit=cfg.limit)
    dtype = cfg.dtype or ("bf16" if cfg.device == "cuda" else "fp32")
    _torch_dtype(dtype)
    tokenizer = None
    prov: dict[str, Any] = {
        "prompts": {
            "path": str(cfg.prompts),
            "sequences": len(prompts),
            "sha256": _file_sha256(cfg.prompts),
            "limit": cfg.limit,
        },
        "dtype": dtype,
        "device": cfg.device,
        "created": creation_date(),  # before loading: a bad SOURCE_DATE_EPOCH fails at once
    }
    if cfg.random_init is not None:
        model = random_model(cfg.random_init, seed=cfg.seed, dtype=dtype)
        if cfg.device != "cpu":
            model = model.to(cfg.device)
        name = f"random-{model.config.model_type}"
        prov.update(
            {
                "model_id": None,
                "random_init": model.config.model_type,
                "seed": cfg.seed,
                "revision": None,
            }
        )
    else:
        assert cfg.model is not None
        model, hf_tok = load_model(cfg.model, dtype, cfg.device, cfg.revision)
        tokenizer = HFTokenizer(hf_tok) if hf_tok is not None else None
        name = model_name(cfg.model)
        prov.update(
            {
                "model_id": cfg.model,
                "revision": cfg.revision or getattr(model.config, "_commit_hash", None),
                "random_init": None,
            }
        )
    from daopsim.simulator.progress import Progress

    bar = Progress(len(prompts), "capture", enabled=cfg.progress)
    try:
        return capture_model(
            model,
            prompts,
            cfg.output,
            cfg.generation,
            name,
            dtype,
            tokenizer=tokenizer,
            provenance=prov,
            top_m=cfg.top_m,
            progress=bar.update,
        )
    finally:
        bar.close()


def result_summary(result: CaptureResult) -> dict[str, Any]:
    """A JSON-friendly summary of a capture (CLI ``--json``)."""
    meta = result.meta
    return {
        "path": str(result.path),
        "model": meta.model.to_dict(),
        "moe_layer_ids": meta.moe_layer_ids,
        "counts": meta.counts,
        "probs_stored": meta.probs_stored,
        "provenance": {k: v for k, v in meta.provenance.items() if k != "tool_versions"},
    }


__all__ = [
    "CaptureConfig",
    "CaptureError",
    "CaptureResult",
    "GenerationSettings",
    "MoeLayer",
    "Prompt",
    "RankOrder",
    "RoutingRecorder",
    "capture_model",
    "creation_date",
    "find_moe_layers",
    "load_model",
    "load_prompts",
    "model_shape",
    "random_model",
    "rank_order",
    "run_capture",
    "selection_score",
    "sort_by_score",
]
