"""Model shapes of Mixture-of-Experts models: sizes that decide what moves and what computes.

Every preset cites docs/references.md#models (published model configurations). Byte counts are
derived here, in one place, from parameter counts and the precision's bytes per parameter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from simulator.errors import UserError

#: Bytes per parameter for each supported precision (docs/references.md#models): int4 is 0.5 B
#: excluding group scales, MXFP4 is 4.25 bits including its E8M0 scale per 32 values.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
    "mxfp4": 4.25 / 8.0,
}


def dtype_bytes(dtype: str) -> float:
    """Bytes per parameter of a precision name; a clear error for an unknown one."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise UserError(
            f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}"
        ) from None


@dataclass(frozen=True)
class ModelShape:
    """The shape of one MoE model as the simulator needs it.

    ``moe_layers`` counts the layers that have routed experts; traces index those layers
    0..moe_layers-1 in model order. ``layers`` counts every transformer block (dense ones too).
    ``non_expert_params`` is everything that is not a routed expert (attention, embeddings,
    lm_head, norms, routers, dense FFNs, shared experts); it always stays on the GPU.
    """

    name: str
    family: str
    layers: int
    moe_layers: int
    hidden: int
    expert_ffn: int
    experts: int
    top_k: int
    expert_matrices: int = 3
    expert_extra_params: int = 0
    shared_experts: int = 0
    shared_expert_ffn: int = 0
    non_expert_params: int = 0
    embedding_params: int = 0
    kv_bytes_per_token: int = 0
    dtype: str = "bf16"
    source: str = ""
    first_moe_layer: int = 0
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for key in ("layers", "moe_layers", "hidden", "expert_ffn", "experts", "top_k"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise UserError(f"model {self.name!r}: {key} must be a positive integer")
        if self.top_k > self.experts:
            raise UserError(f"model {self.name!r}: top_k {self.top_k} > experts {self.experts}")
        if self.moe_layers > self.layers:
            raise UserError(f"model {self.name!r}: moe_layers > layers")
        dtype_bytes(self.dtype)

    @property
    def params_per_expert(self) -> int:
        """Parameters of one routed expert (matrices plus biases, if any)."""
        return self.expert_matrices * self.hidden * self.expert_ffn + self.expert_extra_params

    @property
    def total_experts(self) -> int:
        """Routed experts over all MoE layers."""
        return self.moe_layers * self.experts

    def expert_bytes(self, dtype: str | None = None) -> int:
        """Bytes of one routed expert's weights at ``dtype`` (default: the model's)."""
        return round(self.params_per_expert * dtype_bytes(dtype or self.dtype))

    def non_expert_bytes(self, dtype: str | None = None) -> int:
        """Bytes of everything that is not a routed expert (resident on the GPU)."""
        return round(self.non_expert_params * dtype_bytes(dtype or self.dtype))

    def non_expert_bytes_read_per_token(self, dtype: str | None = None) -> int:
        """Non-expert weight bytes one decode token reads (the input embedding is a lookup)."""
        params = self.non_expert_params - self.embedding_params
        return round(params * dtype_bytes(dtype or self.dtype))

    def with_dtype(self, dtype: str) -> ModelShape:
        """The same model at another precision."""
        dtype_bytes(dtype)
        return replace(self, dtype=dtype)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (trace metadata, JSON output)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelShape:
        """Inverse of :meth:`to_dict`; unknown keys are an error naming the key."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"model shape: unknown key {unknown[0]!r}")
        return cls(**data)

    def summary(self) -> dict[str, Any]:
        """Derived sizes users look at (``daopsim models show``)."""
        return {
            **self.to_dict(),
            "params_per_expert": self.params_per_expert,
            "total_experts": self.total_experts,
            "expert_bytes": {d: self.expert_bytes(d) for d in ("bf16", "int8", "int4")},
            "non_expert_bytes_bf16": self.non_expert_bytes("bf16"),
        }


def _kv(layers: int, kv_heads: int, head_dim: int, bytes_per: int = 2) -> int:
    """KV-cache bytes per token: K and V, every layer, bf16."""
    return 2 * layers * kv_heads * head_dim * bytes_per


_SRC = "docs/references.md#models"

PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in [
        ModelShape(
            name="mixtral-8x7b",
            family="mixtral",
            layers=32,
            moe_layers=32,
            hidden=4096,
            expert_ffn=14336,
            experts=8,
            top_k=2,
            non_expert_params=1_610_000_000,
            embedding_params=32000 * 4096,
            kv_bytes_per_token=_kv(32, 8, 128),
            source=f"{_SRC}: Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json; "
            "352.3 MB per bf16 expert)",
        ),
        ModelShape(
            name="mixtral-8x22b",
            family="mixtral",
            layers=56,
            moe_layers=56,
            hidden=6144,
            expert_ffn=16384,
            experts=8,
            top_k=2,
            non_expert_params=5_330_000_000,
            embedding_params=32000 * 6144,
            kv_bytes_per_token=_kv(56, 8, 128),
            source=f"{_SRC}: Mixtral-8x22B (Cerebras modelzoo params_mixtral_8x22b.yaml)",
        ),
        ModelShape(
            name="phi-3.5-moe",
            family="phimoe",
            layers=32,
            moe_layers=32,
            hidden=4096,
            expert_ffn=6400,
            experts=16,
            top_k=2,
            non_expert_params=1_610_000_000,
            embedding_params=32064 * 4096,
            kv_bytes_per_token=_kv(32, 8, 128),
            source=f"{_SRC}: Phi-3.5-MoE (microsoft/Phi-3.5-MoE-instruct config.json; "
            "157.3 MB per bf16 expert)",
        ),
        ModelShape(
            name="olmoe-1b-7b",
            family="olmoe",
            layers=16,
            moe_layers=16,
            hidden=2048,
            expert_ffn=1024,
            experts=64,
            top_k=8,
            non_expert_params=480_000_000,
            embedding_params=50304 * 2048,
            kv_bytes_per_token=_kv(16, 16, 128),
            source=f"{_SRC}: OLMoE-1B-7B-0924 config.json",
        ),
        ModelShape(
            name="qwen1.5-moe-a2.7b",
            family="qwen2_moe",
            layers=24,
            moe_layers=24,
            hidden=2048,
            expert_ffn=1408,
            experts=60,
            top_k=4,
            shared_experts=1,
            shared_expert_ffn=5632,
            non_expert_params=1_860_000_000,
            embedding_params=151936 * 2048,
            kv_bytes_per_token=_kv(24, 16, 128),
            source=f"{_SRC}: Qwen1.5-MoE-A2.7B (shared expert FFN 5632, counted as non-expert)",
        ),
        ModelShape(
            name="qwen3-30b-a3b",
            family="qwen3_moe",
            layers=48,
            moe_layers=48,
            hidden=2048,
            expert_ffn=768,
            experts=128,
            top_k=8,
            non_expert_params=1_540_000_000,
            embedding_params=151936 * 2048,
            kv_bytes_per_token=_kv(48, 4, 128),
            source=f"{_SRC}: Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json)",
        ),
        ModelShape(
            name="deepseek-v2-lite",
            family="deepseek_v2",
            layers=27,
            moe_layers=26,
            hidden=2048,
            expert_ffn=1408,
            experts=64,
            top_k=6,
            shared_experts=2,
            shared_expert_ffn=1408,
            non_expert_params=1_310_000_000,
            embedding_params=102400 * 2048,
            kv_bytes_per_token=2 * 27 * (512 + 64),
            first_moe_layer=1,
            source=f"{_SRC}: DeepSeek-V2-Lite (layer 0 dense; MLA cache 512+64 per layer)",
        ),
        ModelShape(
            name="deepseek-v3",
            family="deepseek_v3",
            layers=61,
            moe_layers=58,
            hidden=7168,
            expert_ffn=2048,
            experts=256,
            top_k=8,
            shared_experts=1,
            shared_expert_ffn=2048,
            non_expert_params=17_100_000_000,
            embedding_params=129280 * 7168,
            kv_bytes_per_token=2 * 61 * (512 + 64),
            first_moe_layer=3,
            source=f"{_SRC}: DeepSeek-V3 (first 3 layers dense; MLA cache 512+64 per layer)",
        ),
        ModelShape(
            name="gpt-oss-20b",
            family="gpt_oss",
            layers=24,
            moe_layers=24,
            hidden=2880,
            expert_ffn=2880,
            experts=32,
            top_k=4,
            expert_extra_params=3 * 2880,
            non_expert_params=1_800_000_000,
            embedding_params=201088 * 2880,
            kv_bytes_per_token=_kv(24, 8, 64),
            source=f"{_SRC}: GPT-OSS-20B (fused gate_up 2x2880 plus biases; MXFP4 as shipped)",
        ),
        ModelShape(
            name="gpt-oss-120b",
            family="gpt_oss",
            layers=36,
            moe_layers=36,
            hidden=2880,
            expert_ffn=2880,
            experts=128,
            top_k=4,
            expert_extra_params=3 * 2880,
            non_expert_params=2_100_000_000,
            embedding_params=201088 * 2880,
            kv_bytes_per_token=_kv(36, 8, 64),
            source=f"{_SRC}: GPT-OSS-120B (GptOssConfig defaults)",
        ),
        ModelShape(
            name="switch-base-128",
            family="switch",
            layers=24,
            moe_layers=12,
            hidden=768,
            expert_ffn=3072,
            experts=128,
            top_k=1,
            expert_matrices=2,
            non_expert_params=170_000_000,
            embedding_params=32128 * 768,
            kv_bytes_per_token=_kv(12, 12, 64),
            source=f"{_SRC}: Switch-base-128 (6 enc + 6 dec sparse layers, ReLU FFN, 2 matrices)",
        ),
    ]
}


def get_model(name: str) -> ModelShape:
    """A preset by name (case-insensitive); a clear error listing the known names."""
    key = name.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    raise UserError(f"unknown model {name!r}; known: {', '.join(sorted(PRESETS))}")
