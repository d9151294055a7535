"""Weight precisions: what one weight of each format costs in memory and over the link.

Every entry is derived from its format's block or group layout (docs/cost-model.md,
"Quantisation"); the model catalogue (``models.py``) and the cost model read them here.
"""

from __future__ import annotations

from dataclasses import dataclass

from daopsim.simulator.errors import UserError


@dataclass(frozen=True)
class Dtype:
    """One weight precision: its storage cost per weight, scales and zero points included.

    ``bits`` is what one weight costs in memory and over the link, averaged over the format's
    blocks (GGUF) or groups (AWQ/GPTQ, HQQ, MXFP4). ``kind`` groups the formats for tables.
    docs/cost-model.md ("Quantisation") derives every entry from its block layout.
    """

    name: str
    bits: float
    kind: str
    layout: str

    @property
    def bytes(self) -> float:
        """Bytes per weight."""
        return self.bits / 8.0


# GGUF block sizes from ggml's block structs (ggml/src/ggml-common.h): QK_K = 256 weights per
# super-block, 32 per legacy block; ggml_half is 2 bytes.
_QK_K = 256
_Q2_K = (_QK_K // 16 + _QK_K // 4 + 2 * 2) * 8 / _QK_K  # scales, quants, d + dmin: 2.625
_Q3_K = (_QK_K // 8 + _QK_K // 4 + 12 + 2) * 8 / _QK_K  # hmask, quants, scales, d: 3.4375
_Q4_K = (2 * 2 + 12 + _QK_K // 2) * 8 / _QK_K  # d + dmin, scales, quants: 4.5
_Q5_K = (2 * 2 + 12 + _QK_K // 8 + _QK_K // 2) * 8 / _QK_K  # + high bits: 5.5
_Q6_K = (_QK_K // 2 + _QK_K // 4 + _QK_K // 16 + 2) * 8 / _QK_K  # ql, qh, scales, d: 6.5625
_Q4_0 = (2 + 32 // 2) * 8 / 32  # d, nibbles: 4.5
_Q8_0 = (2 + 32) * 8 / 32  # d, int8 quants: 8.5


def _expert_mix(gate_up: float, down: float) -> float:
    """Bits per weight of an expert (gate, up, down: three equal matrices) in a GGUF mix."""
    return (2 * gate_up + down) / 3


# A GGUF "_S"/"_M" file mixes tensor types (llama.cpp src/llama-quant.cpp,
# llama_tensor_get_type_impl). For routed experts only ffn_down is upgraded: Q4_K_M and Q5_K_M
# use Q6_K in the half of the layers use_more_bits() picks (first and last eighth, every third
# in between); Q4_K_S uses Q5_K in the first eighth; Q3_K_M uses Q5_K in the first sixteenth and
# Q4_K elsewhere; Q2_K uses Q3_K. The average below is over an expert's three matrices.
_HQQ_META = 32  # fp16 scale + fp16 zero of one group of 8-bit quantised scales


def _hqq(nbits: int, group: int, scale_group: int) -> float:
    """HQQ with quant_zero and quant_scale: 8-bit scale and zero per group, scales requantised."""
    return nbits + 8 / group + 8 / group + _HQQ_META / (scale_group * group)


_DTYPES: list[Dtype] = [
    Dtype("fp32", 32.0, "float", "IEEE binary32"),
    Dtype("bf16", 16.0, "float", "bfloat16"),
    Dtype("fp16", 16.0, "float", "IEEE binary16"),
    Dtype("fp8", 8.0, "float", "E4M3, per-tensor or 128x128-block scale (negligible)"),
    Dtype("int8", 8.0, "int", "per-channel int8 (one scale per output row, negligible)"),
    Dtype("int4", 4.0, "int", "bare 4-bit weights, scales not counted (idealised)"),
    Dtype(
        "int4_g128", 4.0 + (16 + 4) / 128, "int", "AWQ/GPTQ: 4-bit, fp16 scale + 4-bit zero / 128"
    ),
    Dtype("hqq2_g16", _hqq(2, 16, 128), "hqq", "HQQ 2-bit, group 16, 8-bit scale/zero"),
    Dtype("hqq3_g64", _hqq(3, 64, 128), "hqq", "HQQ 3-bit, group 64, 8-bit scale/zero"),
    Dtype("hqq4_g64", _hqq(4, 64, 256), "hqq", "HQQ 4-bit, group 64, 8-bit scale/zero"),
    Dtype("mxfp4", (1 + 32 // 2) * 8 / 32, "mx", "OCP MXFP4: E2M1 x 32 + one E8M0 scale"),
    Dtype("q2_k", _expert_mix(_Q2_K, _Q3_K), "gguf", "Q2_K gate/up, Q3_K down"),
    Dtype("q3_k_s", _Q3_K, "gguf", "Q3_K"),
    Dtype("q3_k_m", _expert_mix(_Q3_K, (_Q5_K + 15 * _Q4_K) / 16), "gguf", "Q3_K; down Q4_K/Q5_K"),
    Dtype("q4_0", _Q4_0, "gguf", "Q4_0 (block 32, fp16 scale)"),
    Dtype("q4_k_s", _expert_mix(_Q4_K, (_Q5_K + 7 * _Q4_K) / 8), "gguf", "Q4_K; down 1/8 Q5_K"),
    Dtype("q4_k_m", _expert_mix(_Q4_K, (_Q6_K + _Q4_K) / 2), "gguf", "Q4_K; down 1/2 Q6_K"),
    Dtype("q5_k_s", _Q5_K, "gguf", "Q5_K"),
    Dtype("q5_k_m", _expert_mix(_Q5_K, (_Q6_K + _Q5_K) / 2), "gguf", "Q5_K; down 1/2 Q6_K"),
    Dtype("q6_k", _Q6_K, "gguf", "Q6_K"),
    Dtype("q8_0", _Q8_0, "gguf", "Q8_0 (block 32, fp16 scale)"),
]

#: Every supported precision by name (docs/cost-model.md, "Quantisation").
DTYPES: dict[str, Dtype] = {d.name: d for d in _DTYPES}

#: Bytes per weight of each precision, scales and zero points included (``int4`` alone is the
#: bare 4 bits; ``int4_g128`` is AWQ/GPTQ as stored).
DTYPE_BYTES: dict[str, float] = {d.name: d.bytes for d in _DTYPES}


def dtype_bytes(dtype: str) -> float:
    """Bytes per parameter of a precision name; a clear error for an unknown one."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise UserError(
            f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}"
        ) from None
