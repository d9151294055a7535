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

This module is the capture run (:func:`capture_model`, :func:`run_capture`: the settings
checked, the trace written and validated, its provenance) and the public names of its parts:
``capture_layers`` (loading a model, finding its MoE routers, its shape), ``capture_recorder``
(the hooks that record each forward's routing) and ``capture_generate`` (prompts, tokenizers,
generation).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daopsim.simulator.capture_generate import (
    ByteTokenizer,
    GenerationSettings,
    HFTokenizer,
    Prompt,
    SequenceCapture,
    _eos_ids,
    generate_batch,
    iter_captures,
    load_prompts,
)
from daopsim.simulator.capture_layers import (
    DTYPES,
    RANDOM_FAMILIES,
    ROUTER_CLASSES,
    SUPPORTED_FAMILIES,
    CaptureError,
    MoeLayer,
    _torch_dtype,
    find_moe_layers,
    load_model,
    model_name,
    model_shape,
    random_config,
    random_model,
)
from daopsim.simulator.capture_recorder import (
    RankOrder,
    RoutingRecorder,
    StepRouting,
    rank_order,
    selection_score,
    sort_by_score,
)
from daopsim.simulator.errors import UserError, check_seed
from daopsim.simulator.trace import write_valid_trace
from daopsim.simulator.trace_format import (
    ALL_PROBS_MAX_EXPERTS,
    DEFAULT_TOP_M,
    TraceMeta,
)
from daopsim.simulator.trace_write import TraceWriter, tool_versions

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
    "DTYPES",
    "RANDOM_FAMILIES",
    "ROUTER_CLASSES",
    "SUPPORTED_FAMILIES",
    "ByteTokenizer",
    "CaptureConfig",
    "CaptureError",
    "CaptureResult",
    "GenerationSettings",
    "HFTokenizer",
    "MoeLayer",
    "Prompt",
    "RankOrder",
    "RoutingRecorder",
    "SequenceCapture",
    "StepRouting",
    "capture_model",
    "creation_date",
    "find_moe_layers",
    "generate_batch",
    "iter_captures",
    "load_model",
    "load_prompts",
    "model_name",
    "model_shape",
    "random_config",
    "random_model",
    "rank_order",
    "result_summary",
    "run_capture",
    "selection_score",
    "sort_by_score",
]
