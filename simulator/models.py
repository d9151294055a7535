"""Model shapes of Mixture-of-Experts models: sizes that decide what moves and what computes.

Every preset cites docs/references.md#models (published model configurations). Byte counts are
derived here, in one place, from parameter counts and the precision's bytes per parameter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from daopsim.simulator.errors import UserError, did_you_mean
from daopsim.simulator.precisions import DTYPE_BYTES, dtype_bytes


@dataclass(frozen=True)
class ModelShape:
    """The shape of one MoE model as the simulator needs it.

    ``moe_layers`` counts the layers that have routed experts; traces index those layers
    0..moe_layers-1 in model order. ``layers`` counts every transformer block (dense ones too).
    ``non_expert_params`` is everything that is not a routed expert (attention, embeddings,
    lm_head, norms, routers, dense FFNs, shared experts); it always stays on the GPU, and a shared
    expert is computed for every token as part of it.

    Precisions: ``dtype`` is the routed experts' precision on the GPU; ``host_dtype`` the
    precision of the host's copy (what the CPU computes with and what crosses the link; ``None``:
    the same as ``dtype``); ``nonexpert_dtype`` that of the non-expert weights.
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
    host_dtype: str | None = None
    # offloading runtimes quantise the experts and keep the rest at bf16 (GPT-OSS ships so); a
    # GGUF file quantises it too
    nonexpert_dtype: str = "bf16"
    #: query heads of one attention block (0: not recorded); only a runtime with eager attention
    #: (scores materialised per head, docs/cost-model.md "Eager attention") needs it
    attention_heads: int = 0
    #: width of one query/key head and of one value head (``head_dim``, or DeepSeek's
    #: ``qk_nope_head_dim + qk_rope_head_dim`` and ``v_head_dim``, of the model's config.json);
    #: 0: ``hidden / attention_heads`` (the value head: the query/key head's). A prompt's
    #: attention FLOPs scale with them (:attr:`attention_width`; docs/cost-model.md)
    head_dim: int = 0
    v_head_dim: int = 0
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
        for key in ("dtype", "nonexpert_dtype"):
            _check_model_dtype(self.name, key, getattr(self, key))
        if self.host_dtype is not None:
            _check_model_dtype(self.name, "host_dtype", self.host_dtype)
        shared = self.shared_expert_params * self.moe_layers
        if shared > self.non_expert_params:
            raise UserError(
                f"model {self.name!r}: non_expert_params {self.non_expert_params} is smaller "
                f"than its shared experts ({shared} parameters)"
            )

    @property
    def attention_width(self) -> float:
        """Multiply-adds per query-key pair and transformer block, over the two attention
        products: ``(heads x head_dim + heads x v_head_dim) / 2``, so that ``4 x width`` FLOPs
        score a pair and weigh its value; ``hidden`` when the head widths are not recorded
        (every head ``hidden / heads`` wide)."""
        if self.attention_heads <= 0 or self.head_dim <= 0:
            return float(self.hidden)
        v = self.v_head_dim or self.head_dim
        return self.attention_heads * (self.head_dim + v) / 2

    @property
    def host_precision(self) -> str:
        """Precision of the host's copy of an expert (``host_dtype``, else ``dtype``)."""
        return self.host_dtype or self.dtype

    @property
    def shared_expert_params(self) -> int:
        """Parameters of one MoE layer's shared experts (part of ``non_expert_params``)."""
        return self.shared_experts * self.expert_matrices * self.hidden * self.shared_expert_ffn

    @property
    def params_per_expert(self) -> int:
        """Parameters of one routed expert (matrices plus biases, if any)."""
        return self.expert_matrices * self.hidden * self.expert_ffn + self.expert_extra_params

    @property
    def total_experts(self) -> int:
        """Routed experts over all MoE layers."""
        return self.moe_layers * self.experts

    @property
    def total_params(self) -> int:
        """Every parameter: routed experts plus the non-expert part."""
        return self.total_experts * self.params_per_expert + self.non_expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token uses: its top-k routed experts per MoE layer, and the rest."""
        return self.moe_layers * self.top_k * self.params_per_expert + self.non_expert_params

    def expert_bytes(self, dtype: str | None = None) -> int:
        """Bytes of one routed expert's weights at ``dtype`` (default: the GPU precision)."""
        return round(self.params_per_expert * dtype_bytes(dtype or self.dtype))

    def host_expert_bytes(self) -> int:
        """Bytes of the host's copy of one routed expert (at ``host_precision``)."""
        return self.expert_bytes(self.host_precision)

    def non_expert_bytes(self, dtype: str | None = None) -> int:
        """Bytes of everything that is not a routed expert (default: at ``nonexpert_dtype``)."""
        return round(self.non_expert_params * dtype_bytes(dtype or self.nonexpert_dtype))

    def non_expert_bytes_read_per_token(self, dtype: str | None = None) -> int:
        """Non-expert weight bytes one decode token reads (the input embedding is a lookup)."""
        params = self.non_expert_params - self.embedding_params
        return round(params * dtype_bytes(dtype or self.nonexpert_dtype))

    def with_dtype(self, dtype: str) -> ModelShape:
        """The same model with its GPU expert precision changed (the host copy follows it
        unless ``host_dtype`` is set)."""
        return self.with_precision(dtype=dtype)

    def with_precision(
        self,
        dtype: str | None = None,
        host_dtype: str | None = None,
        nonexpert_dtype: str | None = None,
    ) -> ModelShape:
        """The same model with any of its three precisions changed (``None`` keeps one)."""
        changes: dict[str, str] = {}
        if dtype is not None:
            changes["dtype"] = dtype
        if host_dtype is not None:
            changes["host_dtype"] = host_dtype
        if nonexpert_dtype is not None:
            changes["nonexpert_dtype"] = nonexpert_dtype
        return replace(self, **changes) if changes else self

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (trace metadata, JSON output).

        The two precision fields are left out at their defaults, so a trace written before they
        existed and the same trace written now carry byte-identical metadata.
        """
        data = asdict(self)
        for key, default in _PRECISION_DEFAULTS.items():
            if data[key] == default:
                del data[key]
        # the head count and widths are left out when they are the preset's (or 0), for the
        # same reason
        for key in _HEAD_FIELDS:
            if data[key] == _preset_value(self.name, key):
                del data[key]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelShape:
        """Inverse of :meth:`to_dict`; unknown keys are an error naming the key."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"model shape: unknown key {unknown[0]!r}")
        for key in _HEAD_FIELDS:  # written before the field, or the preset's value
            if key not in data:
                data = {**data, key: _preset_value(str(data.get("name", "")), key)}
        return cls(**data)

    def summary(self) -> dict[str, Any]:
        """Derived sizes users look at (``daopsim models show``)."""
        return {
            **self.to_dict(),
            # trace metadata leaves a preset's head count out; a user still wants to see it
            "attention_heads": self.attention_heads,
            "params_per_expert": self.params_per_expert,
            "total_experts": self.total_experts,
            "shared_expert_params_per_layer": self.shared_expert_params,
            "total_params": self.total_params,
            "active_params": self.active_params,
            "expert_bytes": {
                d: self.expert_bytes(d) for d in dict.fromkeys(("bf16", "int8", "int4", self.dtype))
            },
            "non_expert_bytes_bf16": self.non_expert_bytes("bf16"),
        }


#: Precision fields :meth:`ModelShape.to_dict` omits when they hold these defaults.
_PRECISION_DEFAULTS: dict[str, str | None] = {"host_dtype": None, "nonexpert_dtype": "bf16"}


def _check_model_dtype(model: str, key: str, dtype: str) -> None:
    if dtype not in DTYPE_BYTES:
        raise UserError(
            f"model {model!r}: {key} {dtype!r} is not a known dtype; "
            f"known: {', '.join(sorted(DTYPE_BYTES))}"
        )


def _kv(layers: int, kv_heads: int, head_dim: int, bytes_per: int = 2) -> int:
    """KV-cache bytes per token: K and V, every layer, bf16."""
    return 2 * layers * kv_heads * head_dim * bytes_per


def _gqa(hidden: int, heads: int, kv_heads: int, head_dim: int, q_gate: bool = False) -> int:
    """Attention projections (q, k, v, o) of one grouped-query attention layer, no biases.

    ``q_gate``: the query projection also emits an output gate (Qwen3-Next), doubling it.
    """
    q = hidden * heads * head_dim * (2 if q_gate else 1)
    return q + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden


def _mla(hidden: int, heads: int, q_lora: int, kv_lora: int, nope: int, rope: int, v: int) -> int:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) projections of one layer."""
    q = (
        hidden * heads * (nope + rope)
        if q_lora == 0
        else hidden * q_lora + q_lora * heads * (nope + rope)
    )
    kv = hidden * (kv_lora + rope) + kv_lora * heads * (nope + v)
    return q + kv + heads * v * hidden


def _gated_deltanet(hidden: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int) -> int:
    """Qwen3-Next linear-attention (Gated DeltaNet) projections of one layer (conv ignored)."""
    qkvz = hidden * (2 * k_heads * k_dim + 2 * v_heads * v_dim)
    return qkvz + hidden * 2 * v_heads + v_heads * v_dim * hidden  # + beta/alpha, + out


def _ffn(hidden: int, ffn: int) -> int:
    """A gated (SwiGLU) feed-forward block: gate, up and down matrices."""
    return 3 * hidden * ffn


def _mla_kv(layers: int, kv_lora: int = 512, rope: int = 64) -> int:
    """MLA cache bytes per token: the compressed latent plus the shared RoPE key, bf16."""
    return 2 * layers * (kv_lora + rope)


_SRC = "docs/references.md#models"

# Non-expert parameters of the presets below, from each config.json (embeddings untied: input
# embedding + lm_head; routers; shared experts; dense FFN layers; attention). Norms and biases
# are below 0.01 % and left out.
_DSV2_LAYERS, _DSV2_MOE = 60, 59
_DSV2_NONEXPERT = (
    2 * 102400 * 5120
    + _DSV2_LAYERS * _mla(5120, 128, 1536, 512, 128, 64, 128)
    + _ffn(5120, 12288)  # layer 0 is dense
    + _DSV2_MOE * (2 * _ffn(5120, 1536) + 160 * 5120)  # 2 shared experts, router
)
_QWEN2_NONEXPERT = 2 * 151936 * 3584 + 28 * (
    _gqa(3584, 28, 4, 128) + (3584 + 2 * 512) + _ffn(3584, 20480) + 64 * 3584 + 3584
)  # q/k/v biases, one shared expert of FFN 20480 and its scalar gate, router
_QWEN3_235_NONEXPERT = 2 * 151936 * 4096 + 94 * (_gqa(4096, 64, 4, 128) + 128 * 4096)
_QWEN3_NEXT_NONEXPERT = (
    2 * 151936 * 2048
    + 48 * (_ffn(2048, 512) + 512 * 2048 + 2048)
    + (12 * _gqa(2048, 16, 2, 256, q_gate=True) + 36 * _gated_deltanet(2048, 16, 32, 128, 128))
)  # full attention in every 4th layer, Gated DeltaNet in the other three
_LLAMA4_ATTN = 48 * _gqa(5120, 40, 8, 128)
_LLAMA4_SCOUT_NONEXPERT = 2 * 202048 * 5120 + _LLAMA4_ATTN + 48 * (_ffn(5120, 8192) + 16 * 5120)
_LLAMA4_MAVERICK_NONEXPERT = (
    2 * 202048 * 5120
    + _LLAMA4_ATTN
    + 24 * (_ffn(5120, 8192) + 128 * 5120)  # MoE layers: shared expert, router
    + 24 * _ffn(5120, 16384)  # the other 24 layers are dense (intermediate_size_mlp)
)
_KIMI_NONEXPERT = (
    2 * 163840 * 7168
    + 61 * _mla(7168, 64, 1536, 512, 128, 64, 128)
    + _ffn(7168, 18432)  # layer 0 is dense
    + 60 * (_ffn(7168, 2048) + 384 * 7168)  # one shared expert, router
)

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
            attention_heads=32,
            head_dim=128,
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
            attention_heads=48,
            head_dim=128,
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
            attention_heads=32,
            head_dim=128,
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
            attention_heads=16,
            head_dim=128,
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
            attention_heads=16,
            head_dim=128,
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
            attention_heads=32,
            head_dim=128,
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
            kv_bytes_per_token=_mla_kv(27),
            attention_heads=16,
            head_dim=192,
            v_head_dim=128,
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
            kv_bytes_per_token=_mla_kv(61),
            attention_heads=128,
            head_dim=192,
            v_head_dim=128,
            first_moe_layer=3,
            source=f"{_SRC}: DeepSeek-V3 (first 3 layers dense; MLA cache 512+64 per layer)",
        ),
        ModelShape(
            name="deepseek-v2",
            family="deepseek_v2",
            layers=_DSV2_LAYERS,
            moe_layers=_DSV2_MOE,
            hidden=5120,
            expert_ffn=1536,
            experts=160,
            top_k=6,
            shared_experts=2,
            shared_expert_ffn=1536,
            non_expert_params=_DSV2_NONEXPERT,
            embedding_params=102400 * 5120,
            kv_bytes_per_token=_mla_kv(_DSV2_LAYERS),
            attention_heads=128,
            head_dim=192,
            v_head_dim=128,
            first_moe_layer=1,
            source=f"{_SRC}: DeepSeek-V2 (deepseek-ai/DeepSeek-V2 config.json; layer 0 dense, "
            "2 shared experts; 236 B total)",
        ),
        ModelShape(
            name="qwen2-57b-a14b",
            family="qwen2_moe",
            layers=28,
            moe_layers=28,
            hidden=3584,
            expert_ffn=2560,
            experts=64,
            top_k=8,
            shared_experts=1,
            shared_expert_ffn=20480,
            non_expert_params=_QWEN2_NONEXPERT,
            embedding_params=151936 * 3584,
            kv_bytes_per_token=_kv(28, 4, 128),
            attention_heads=28,
            head_dim=128,
            source=f"{_SRC}: Qwen2-57B-A14B (Qwen/Qwen2-57B-A14B config.json; shared expert FFN "
            "20480; 57 B total)",
        ),
        ModelShape(
            name="qwen3-235b-a22b",
            family="qwen3_moe",
            layers=94,
            moe_layers=94,
            hidden=4096,
            expert_ffn=1536,
            experts=128,
            top_k=8,
            non_expert_params=_QWEN3_235_NONEXPERT,
            embedding_params=151936 * 4096,
            kv_bytes_per_token=_kv(94, 4, 128),
            attention_heads=64,
            head_dim=128,
            source=f"{_SRC}: Qwen3-235B-A22B (Qwen/Qwen3-235B-A22B config.json; 235 B total)",
        ),
        ModelShape(
            name="qwen3-next-80b-a3b",
            family="qwen3_next",
            layers=48,
            moe_layers=48,
            hidden=2048,
            expert_ffn=512,
            experts=512,
            top_k=10,
            shared_experts=1,
            shared_expert_ffn=512,
            non_expert_params=_QWEN3_NEXT_NONEXPERT,
            embedding_params=151936 * 2048,
            kv_bytes_per_token=_kv(12, 2, 256),  # only the 12 full-attention layers cache K/V
            attention_heads=16,
            head_dim=256,
            source=f"{_SRC}: Qwen3-Next-80B-A3B (Qwen/Qwen3-Next-80B-A3B-Instruct config.json; "
            "hybrid attention, 1 shared expert; 79.67 B total)",
            notes="Gated DeltaNet layers keep a fixed-size state per sequence, not per token",
        ),
        ModelShape(
            name="llama-4-scout",
            family="llama4",
            layers=48,
            moe_layers=48,
            hidden=5120,
            expert_ffn=8192,
            experts=16,
            top_k=1,
            shared_experts=1,
            shared_expert_ffn=8192,
            non_expert_params=_LLAMA4_SCOUT_NONEXPERT,
            embedding_params=202048 * 5120,
            kv_bytes_per_token=_kv(48, 8, 128),
            attention_heads=40,
            head_dim=128,
            source=f"{_SRC}: Llama-4-Scout-17B-16E (meta-llama config.json text_config; every "
            "layer MoE, 1 shared expert; 109 B total with the vision encoder)",
            notes="three of four layers attend within 8192-token chunks: the KV cache is counted "
            "for every layer, an overestimate past 8192 tokens",
        ),
        ModelShape(
            name="llama-4-maverick",
            family="llama4",
            layers=48,
            moe_layers=24,
            hidden=5120,
            expert_ffn=8192,
            experts=128,
            top_k=1,
            shared_experts=1,
            shared_expert_ffn=8192,
            non_expert_params=_LLAMA4_MAVERICK_NONEXPERT,
            embedding_params=202048 * 5120,
            kv_bytes_per_token=_kv(48, 8, 128),
            attention_heads=40,
            head_dim=128,
            first_moe_layer=1,
            source=f"{_SRC}: Llama-4-Maverick-17B-128E (meta-llama config.json text_config; "
            "interleave_moe_layer_step 2: odd layers MoE, even layers dense FFN 16384; "
            "400 B total)",
            notes="three of four layers attend within 8192-token chunks: the KV cache is counted "
            "for every layer, an overestimate past 8192 tokens",
        ),
        ModelShape(
            name="kimi-k2",
            family="deepseek_v3",
            layers=61,
            moe_layers=60,
            hidden=7168,
            expert_ffn=2048,
            experts=384,
            top_k=8,
            shared_experts=1,
            shared_expert_ffn=2048,
            non_expert_params=_KIMI_NONEXPERT,
            embedding_params=163840 * 7168,
            kv_bytes_per_token=_mla_kv(61),
            attention_heads=64,
            head_dim=192,
            v_head_dim=128,
            first_moe_layer=1,
            source=f"{_SRC}: Kimi-K2 (moonshotai/Kimi-K2-Instruct config.json; DeepSeek-V3 "
            "architecture, 384 experts, layer 0 dense; 1.04 T total)",
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
            attention_heads=64,
            head_dim=64,
            dtype="mxfp4",
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
            attention_heads=64,
            head_dim=64,
            dtype="mxfp4",
            source=f"{_SRC}: GPT-OSS-120B (GptOssConfig defaults; MXFP4 experts as shipped)",
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
            attention_heads=12,
            head_dim=64,
            source=f"{_SRC}: Switch-base-128 (6 enc + 6 dec sparse layers, ReLU FFN, 2 matrices)",
        ),
        # Switch-large-128 (flaxformer switch_large.gin): 24 encoder + 24 decoder blocks, every
        # other FFN sparse (12 + 12 MoE layers), d_model 1024, MLP 4096, 16 heads of 64.
        # Non-expert: encoder 24 x 4 x 1024^2 attention + 12 dense FFNs of 2 x 1024 x 4096;
        # decoder 24 x 8 x 1024^2 (self + cross attention) + 12 dense FFNs; 24 routers of
        # 1024 x 128; one tied 32128 x 1024 embedding (as switch-base-128) = 539.4 M.
        ModelShape(
            name="switch-large-128",
            family="switch",
            layers=48,
            moe_layers=24,
            hidden=1024,
            expert_ffn=4096,
            experts=128,
            top_k=1,
            expert_matrices=2,
            non_expert_params=24 * 4 * 1024**2
            + 24 * 8 * 1024**2
            + 24 * 2 * 1024 * 4096
            + 24 * 1024 * 128
            + 32128 * 1024,
            embedding_params=32128 * 1024,
            kv_bytes_per_token=_kv(24, 16, 64),
            attention_heads=16,
            head_dim=64,
            source=f"{_SRC}: Switch-large-128 (12 enc + 12 dec sparse layers, ReLU FFN)",
        ),
        # The simulator runs one stack of layers for every token, so an encoder-decoder's decode
        # step is its decoder alone: the encoder runs once over the prompt and its output is
        # reused. This preset is that decoder (24 blocks, 12 MoE layers, the decoder's attention,
        # dense FFNs and routers plus the tied embedding = 336.5 M) for decode-time rows.
        ModelShape(
            name="switch-large-128-decoder",
            family="switch",
            layers=24,
            moe_layers=12,
            hidden=1024,
            expert_ffn=4096,
            experts=128,
            top_k=1,
            expert_matrices=2,
            non_expert_params=24 * 8 * 1024**2
            + 12 * 2 * 1024 * 4096
            + 12 * 1024 * 128
            + 32128 * 1024,
            embedding_params=32128 * 1024,
            kv_bytes_per_token=_kv(24, 16, 64),
            attention_heads=16,
            head_dim=64,
            source=(
                f"{_SRC}: Switch-large-128's decoder only (12 sparse layers): the decode step "
                "of the encoder-decoder; the encoder is not modelled"
            ),
        ),
    ]
}


#: attention fields a trace's model shape leaves out at the preset's values (and reads back so)
_HEAD_FIELDS = ("attention_heads", "head_dim", "v_head_dim")


def _preset_value(name: str, key: str) -> int:
    """Field ``key`` of the preset called ``name`` (0 for a model that is not one)."""
    preset = PRESETS.get(name.strip().lower())
    return int(getattr(preset, key)) if preset is not None else 0


def get_model(name: str) -> ModelShape:
    """A preset by name (case-insensitive); a clear error listing the known names."""
    key = name.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    hint = did_you_mean(key, PRESETS)
    raise UserError(f"unknown model {name!r}{hint} (known: {', '.join(sorted(PRESETS))})")
