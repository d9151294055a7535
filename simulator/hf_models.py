"""Random-weight Hugging Face MoE models shaped like a catalogue model, scaled to fit a machine.

``daopsim check`` runs one of these for real and ``daopsim probe --model`` times its modules;
both describe it with a :class:`LoopShape`: a catalogue model (``simulator/models.py``) whose
layers, hidden size, experts, expert FFN width, top-k and vocabulary may be scaled down. The
attention keeps the family's head width and its query-to-KV head ratio, so a scaled model is the
same architecture at a smaller size. Families whose transformers 5.x MoE block has the same
layout (``layers[i].mlp.gate`` a top-k router, ``layers[i].mlp.experts`` the experts as two 3D
tensors run by an eager loop over the experts that received tokens): ``mixtral``, ``qwen3_moe``
and ``olmoe``.

torch and transformers are imported on use (the ``capture`` extra).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from daopsim.simulator.errors import UserError
from daopsim.simulator.models import ModelShape, get_model

#: families the closed loop and the module probe can build, with each one's head width
FAMILY_HEAD_DIM = {"mixtral": 128, "qwen3_moe": 128, "olmoe": 128}
#: the precisions a loop model may have (its weights; the expert copies are the same)
LOOP_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class LoopShape:
    """A random-weight MoE model to build: a catalogue model's architecture at a given size."""

    base: str
    family: str
    layers: int
    hidden: int
    expert_ffn: int
    experts: int
    top_k: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        for key in (
            "layers",
            "hidden",
            "expert_ffn",
            "experts",
            "top_k",
            "heads",
            "kv_heads",
            "head_dim",
            "vocab",
        ):
            v = getattr(self, key)
            if not isinstance(v, int) or v <= 0:
                raise UserError(f"model shape: {key} must be a positive integer, got {v!r}")
        if self.top_k > self.experts:
            raise UserError(f"model shape: top-k {self.top_k} > experts {self.experts}")
        if self.heads % self.kv_heads:
            raise UserError(
                f"model shape: {self.heads} query heads are not a multiple of {self.kv_heads} "
                "KV heads"
            )
        if self.dtype not in LOOP_DTYPES:
            raise UserError(f"model shape: dtype must be one of {', '.join(LOOP_DTYPES)}")

    @property
    def name(self) -> str:
        """A name that says the size: ``mixtral-8x7b-l8-h1024-f1536-e8-k2-v32000-fp32``."""
        return (
            f"{self.base}-l{self.layers}-h{self.hidden}-f{self.expert_ffn}-e{self.experts}"
            f"-k{self.top_k}-v{self.vocab}-{self.dtype}"
        )

    @property
    def bytes_per_param(self) -> int:
        """Bytes of one weight at the model's precision."""
        return 4 if self.dtype == "fp32" else 2

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert (gate, up and down matrices)."""
        return 3 * self.hidden * self.expert_ffn * self.bytes_per_param

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the check's and the probe's JSON), with the name and expert bytes."""
        return {**dataclasses.asdict(self), "name": self.name, "expert_bytes": self.expert_bytes}

    def with_width(self, hidden: int, expert_ffn: int, vocab: int, layers: int) -> LoopShape:
        """The same architecture at another width (the module probe's tiny models): as many
        query and KV heads, each narrower (``hidden / heads``, at least 4)."""
        return dataclasses.replace(
            self,
            hidden=hidden,
            expert_ffn=expert_ffn,
            vocab=vocab,
            layers=layers,
            head_dim=max(4, min(self.head_dim, hidden // self.heads)),
        )

    def hf_config(self, init_std: float = 0.1) -> Any:
        """The transformers config of this shape (eager expert loop, SDPA attention)."""
        import transformers as tf

        common: dict[str, Any] = dict(
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            vocab_size=self.vocab,
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            initializer_range=init_std,
            tie_word_embeddings=False,
        )
        if self.family == "mixtral":
            cfg = tf.MixtralConfig(
                intermediate_size=self.expert_ffn,
                num_local_experts=self.experts,
                num_experts_per_tok=self.top_k,
                head_dim=self.head_dim,
                **common,
            )
        elif self.family == "qwen3_moe":
            cfg = tf.Qwen3MoeConfig(
                intermediate_size=self.expert_ffn,
                moe_intermediate_size=self.expert_ffn,
                num_experts=self.experts,
                num_experts_per_tok=self.top_k,
                head_dim=self.head_dim,
                norm_topk_prob=True,
                **common,
            )
        elif self.family == "olmoe":
            cfg = tf.OlmoeConfig(
                intermediate_size=self.expert_ffn,
                num_experts=self.experts,
                num_experts_per_tok=self.top_k,
                **common,
            )
        else:  # guarded by scaled_shape
            raise UserError(f"family {self.family!r} cannot be built")
        cfg._experts_implementation = "eager"
        cfg._attn_implementation = "sdpa"
        return cfg


def torch_dtype(torch: Any, name: str) -> Any:
    """The torch dtype of a loop precision."""
    return torch.float32 if name == "fp32" else torch.bfloat16


def build_model(shape: LoopShape, seed: int = 0, init_std: float = 0.1) -> Any:
    """The random-weight causal LM of ``shape`` in eval mode (weights normal with ``init_std``,
    large enough that greedy decoding does not repeat one token)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        shape.hf_config(init_std),
        dtype=torch_dtype(torch, shape.dtype),
        experts_implementation="eager",
        attn_implementation="sdpa",
    )
    return model.eval()


def daopsim_shape(shape: LoopShape) -> ModelShape:
    """The simulator's :class:`ModelShape` of ``shape``, counted from its parameters (a model
    built on PyTorch's meta device: no memory, no arithmetic)."""
    import torch
    from transformers import AutoModelForCausalLM

    from daopsim.simulator.capture_layers import find_moe_layers, model_shape

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            shape.hf_config(),
            dtype=torch_dtype(torch, shape.dtype),
            experts_implementation="eager",
        )
    moe = find_moe_layers(model)
    ms = model_shape(model, moe, shape.name, shape.dtype)
    return dataclasses.replace(
        ms, nonexpert_dtype=shape.dtype, source=f"daopsim check: {shape.name}"
    )


def _kv_heads(base: ModelShape, head_dim: int) -> int:
    """KV heads of a catalogue model from its KV bytes per token (bf16, every layer)."""
    per_layer = base.kv_bytes_per_token / (2 * 2 * base.layers)
    return max(1, round(per_layer / head_dim))


def scaled_shape(
    base: str,
    layers: int | None = None,
    hidden: int | None = None,
    expert_ffn: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    vocab: int | None = None,
    dtype: str = "fp32",
) -> LoopShape:
    """A catalogue model's architecture at the given size (None keeps the model's own value;
    the vocabulary is capped at 32,000 unless given). Query heads scale with the hidden size at
    the family's head width, KV heads keep the model's ratio."""
    m = get_model(base)
    if m.family not in FAMILY_HEAD_DIM:
        raise UserError(
            f"model {base!r} (family {m.family!r}): the closed loop builds the families "
            f"{', '.join(FAMILY_HEAD_DIM)} (e.g. mixtral-8x7b, qwen3-30b-a3b, olmoe-1b-7b)"
        )
    if m.shared_experts or m.first_moe_layer or m.moe_layers != m.layers:
        raise UserError(f"model {base!r}: dense or shared-expert layers are not built")
    head_dim = FAMILY_HEAD_DIM[m.family]
    heads0 = m.attention_heads or max(1, m.hidden // head_dim)
    ratio = max(1, heads0 // _kv_heads(m, head_dim))
    h = hidden or m.hidden
    heads = max(ratio, round(heads0 * h / m.hidden))
    heads -= heads % ratio
    vocab_base = m.embedding_params // m.hidden if m.embedding_params else 32000
    return LoopShape(
        base=base,
        family=m.family,
        layers=layers or m.layers,
        hidden=h,
        expert_ffn=expert_ffn or m.expert_ffn,
        experts=experts or m.experts,
        top_k=top_k or m.top_k,
        heads=heads,
        kv_heads=heads // ratio,
        head_dim=min(head_dim, h),
        vocab=vocab or min(vocab_base, 32000),
        dtype=dtype,
    )


_NAME = re.compile(
    r"^(?P<base>.+)-l(?P<l>\d+)-h(?P<h>\d+)-f(?P<f>\d+)-e(?P<e>\d+)-k(?P<k>\d+)-v(?P<v>\d+)"
    r"-(?P<d>fp32|bf16)$"
)


def parse_shape_name(name: str) -> LoopShape | None:
    """The shape a :attr:`LoopShape.name` describes (None for any other name)."""
    m = _NAME.match(name)
    if m is None:
        return None
    return scaled_shape(
        m["base"],
        layers=int(m["l"]),
        hidden=int(m["h"]),
        expert_ffn=int(m["f"]),
        experts=int(m["e"]),
        top_k=int(m["k"]),
        vocab=int(m["v"]),
        dtype=m["d"],
    )
