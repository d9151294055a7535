"""The model a capture hooks: loading it (a Hugging Face checkpoint, or a random-weight model of a
supported family for tests and offline use), finding its MoE layers' router modules, and the
model's shape as a trace records it (docs/capture.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daopsim.simulator.errors import UserError
from daopsim.simulator.models import ModelShape

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
    from daopsim.simulator.precisions import dtype_bytes

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
