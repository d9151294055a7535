"""Precisions: bytes per weight of every dtype, and the GPU / host / non-expert precision split."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from daopsim.simulator.costs import cost_model
from daopsim.simulator.errors import UserError
from daopsim.simulator.models import get_model
from daopsim.simulator.precisions import DTYPE_BYTES, DTYPES
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import make_trace

# Bits per weight by hand from the block structs of ggml/src/ggml-common.h (bytes of one block x
# 8 / weights in it; QK_K = 256) and the group layouts of AWQ/GPTQ, HQQ and MXFP4.
Q2_K = (16 + 64 + 4) * 8 / 256  # scales[16], qs[64], d + dmin
Q3_K = (32 + 64 + 12 + 2) * 8 / 256  # hmask[32], qs[64], scales[12], d
Q4_K = (4 + 12 + 128) * 8 / 256  # d + dmin, scales[12], qs[128]
Q5_K = (4 + 12 + 32 + 128) * 8 / 256  # + qh[32]
Q6_K = (128 + 64 + 16 + 2) * 8 / 256  # ql[128], qh[64], scales[16], d
HAND_BITS = {
    "fp32": 32.0,
    "bf16": 16.0,
    "fp16": 16.0,
    "fp8": 8.0,
    "int8": 8.0,
    "int4": 4.0,
    "int4_g128": 4 + 16 / 128 + 4 / 128,  # fp16 scale and packed 4-bit zero per 128
    "hqq2_g16": 2 + 8 / 16 + 8 / 16 + 32 / (128 * 16),  # 8-bit scale + zero, scales requantised
    "hqq3_g64": 3 + 8 / 64 + 8 / 64 + 32 / (128 * 64),
    "hqq4_g64": 4 + 8 / 64 + 8 / 64 + 32 / (256 * 64),  # Mixtral-offloading's attention config
    "mxfp4": (1 + 16) * 8 / 32,  # E8M0 scale + 32 E2M1 nibbles
    "q4_0": (2 + 16) * 8 / 32,
    "q8_0": (2 + 32) * 8 / 32,
    "q3_k_s": Q3_K,
    "q5_k_s": Q5_K,
    "q6_k": Q6_K,
    # mixes: gate and up at the base type, down upgraded in part of the layers
    "q2_k": (2 * Q2_K + Q3_K) / 3,
    "q3_k_m": (2 * Q3_K + (Q5_K / 16 + Q4_K * 15 / 16)) / 3,
    "q4_k_s": (2 * Q4_K + (Q5_K / 8 + Q4_K * 7 / 8)) / 3,
    "q4_k_m": (2 * Q4_K + (Q6_K + Q4_K) / 2) / 3,
    "q5_k_m": (2 * Q5_K + (Q6_K + Q5_K) / 2) / 3,
}


def test_every_dtype_has_a_hand_derivation() -> None:
    """No precision enters the table without a hand check here."""
    assert set(DTYPES) == set(HAND_BITS)


@pytest.mark.parametrize("name", sorted(HAND_BITS))
def test_bits_per_weight_match_the_block_layouts(name: str) -> None:
    """The table's bits and bytes per weight equal the hand arithmetic."""
    assert DTYPES[name].bits == pytest.approx(HAND_BITS[name], rel=1e-12)
    assert DTYPE_BYTES[name] == pytest.approx(HAND_BITS[name] / 8, rel=1e-12)


def test_the_published_rounded_figures() -> None:
    """Figures quoted in the literature: Q4_K 4.5, Q6_K 6.5625, MXFP4 4.25, Q4_K_M about 4.85."""
    assert Q4_K == 4.5 and Q6_K == 6.5625 and Q2_K == 2.625 and Q3_K == 3.4375
    assert DTYPES["mxfp4"].bits == 4.25
    assert DTYPES["q4_k_m"].bits == pytest.approx(4.85, abs=0.01)


def test_expert_bytes_at_q4_k_m() -> None:
    """A Qwen3-30B-A3B expert (4,718,592 weights) at Q4_K_M is 4.84375 / 8 bytes per weight."""
    model = get_model("qwen3-30b-a3b")
    assert model.params_per_expert == 3 * 2048 * 768
    assert model.expert_bytes("q4_k_m") == round(3 * 2048 * 768 * 4.84375 / 8)


def _split(dtype: str, host: str | None = None, nonexpert: str | None = None):
    model = get_model("mixtral-8x7b").with_precision(dtype, host, nonexpert)
    return cost_model("rtx4090-pcie4", model)


def test_host_precision_sets_link_bytes_and_cpu_time() -> None:
    """Copies and CPU experts follow the host copy; GPU compute and slots follow the GPU copy."""
    same = _split("int4_g128")
    split = _split("int4_g128", host="bf16")
    hw = split.hw
    assert split.expert_bytes == same.expert_bytes  # GPU copy unchanged
    assert split.gpu_expert_s(1) == same.gpu_expert_s(1)
    assert split.gpu_expert_slots() == same.gpu_expert_slots()
    assert split.host_expert_bytes == split.link_expert_bytes == 352_321_536
    assert same.link_expert_bytes == same.expert_bytes
    # CPU: the bf16 copy streams 352 MB, the int4 one 91.5 MB
    # (both in PyTorch's bf16 kernel family: int4 weights are dequantised into bf16 passes)
    bw = split.cpu_stream_gbs("bf16") * 1e9
    assert same.cpu_stream_gbs("int4_g128") * 1e9 == bw
    assert split.cpu_expert_s(1) == pytest.approx(352_321_536 / bw)
    assert same.cpu_expert_s(1) == pytest.approx(same.expert_bytes / bw)
    # the copy moves the host bytes, then one GPU pass converts them
    convert = (352_321_536 + split.expert_bytes) / (hw.gpu.mem_bw_gbs * 1e9) + 5e-6
    assert split.convert_expert_s() == pytest.approx(convert)
    assert same.convert_expert_s() == 0.0
    expect = 6e-6 + 352_321_536 / (hw.link.h2d_pinned_gbs * 1e9) + convert
    assert split.h2d_expert_s(pinned=True) == pytest.approx(expect)
    assert split.d2h_expert_s(pinned=True) > same.d2h_expert_s(pinned=True)
    assert "host_expert_bytes" in split.sources()["h2d_expert_pinned"]
    assert "host_expert_bytes" not in same.sources()["h2d_expert_pinned"]


def test_quantised_host_copy_shortens_copies_and_the_cpu() -> None:
    """bf16 on the GPU, Q4_K_M on the host: 3.3x fewer link bytes, 3.3x less CPU streaming."""
    full = _split("bf16")
    split = _split("bf16", host="q4_k_m")
    ratio = 16 / DTYPES["q4_k_m"].bits
    assert full.link_expert_bytes / split.link_expert_bytes == pytest.approx(ratio, rel=1e-6)
    assert full.cpu_expert_s(1) / split.cpu_expert_s(1) == pytest.approx(ratio, rel=1e-6)
    assert split.h2d_expert_s(True) < full.h2d_expert_s(True)


def test_nonexpert_precision_frees_gpu_memory_and_time() -> None:
    """Q8_0 non-expert weights read fewer bytes per layer and leave room for more experts."""
    bf16 = _split("int4_g128")
    q8 = _split("int4_g128", nonexpert="q8_0")
    assert q8.nonexpert_layer_bytes == pytest.approx(
        bf16.nonexpert_layer_bytes * 8.5 / 16, rel=1e-6
    )
    assert q8.nonexpert_layer_s(1, 512) < bf16.nonexpert_layer_s(1, 512)
    assert q8.gpu_expert_slots() > bf16.gpu_expert_slots()


def test_measured_constants_need_one_precision_everywhere() -> None:
    """DAOP's bf16 constants do not apply once the host copy is at another precision."""
    model = get_model("mixtral-8x7b")
    assert cost_model("a6000-pcie4", model).measured is not None
    split = model.with_precision(host_dtype="int8")
    assert cost_model("a6000-pcie4", split).measured is None


def test_unknown_precision_names_the_field() -> None:
    """A bad host or non-expert dtype is one clear error naming the field."""
    with pytest.raises(UserError, match="host_dtype 'q4_k_z'"):
        get_model("mixtral-8x7b").with_precision(host_dtype="q4_k_z")
    with pytest.raises(UserError, match="nonexpert_dtype"):
        get_model("mixtral-8x7b").with_precision(nonexpert_dtype="int3")


def test_engine_counts_link_bytes_at_the_host_precision(tmp_path: Path) -> None:
    """Same policy and budget: the copy count is unchanged, each copy moves the host bytes."""
    trace = make_trace(tmp_path / "t.parquet", sequences=2, prefill=4, decode=6, seed=3)
    common = {"policy": "lru", "hw": "rtx4090-pcie4", "trace": trace, "gpu_experts": 12}
    base = simulate(dtype="bf16", record=False, **common)
    small = simulate(dtype="bf16", host_dtype="q4_0", record=False, **common)
    assert base.metrics["fetches"] == small.metrics["fetches"] > 0
    ratio = base.metrics["h2d_bytes"] / small.metrics["h2d_bytes"]
    model = read_model(trace)
    assert ratio == pytest.approx(model.expert_bytes("bf16") / model.expert_bytes("q4_0"))
    assert small.config["host_dtype"] == "q4_0" and small.config["dtype"] == "bf16"


def read_model(trace: Path):
    """The model shape a trace declares."""
    from daopsim.simulator.trace_read import read_meta

    return read_meta(trace).model


def test_qwen3_run_at_q4_k_m(cli, tmp_path: Path) -> None:
    """`daopsim run` on a Qwen3-30B-A3B synthetic trace with GGUF Q4_K_M experts works."""
    trace = tmp_path / "qwen3.parquet"
    made = cli(
        "synth", "--model", "qwen3-30b-a3b", "--sequences", "2", "--prompt-tokens", "8",
        "--output-tokens", "8", "--seed", "1", "-o", trace,
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    res = cli(
        "run", "--no-progress", "--policy", "lru", "--trace", trace, "--hw", "rtx4090-pcie4",
        "--dtype", "q4_k_m", "--gpu-experts", "1000", "--json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["dtype"] == "q4_k_m" and doc["model"] == "qwen3-30b-a3b"
    assert math.isfinite(doc["metrics"]["tokens_per_s"]) and doc["metrics"]["tokens_per_s"] > 0
    bf16 = cli(
        "run", "--no-progress", "--policy", "lru", "--trace", trace, "--hw", "rtx4090-pcie4",
        "--gpu-experts", "1000", "--json", "--no-bounds",
    )  # fmt: skip
    assert bf16.exit_code == 0, bf16.output
    m4, m16 = doc["metrics"], json.loads(bf16.stdout)["metrics"]
    assert m4["h2d_bytes"] / m16["h2d_bytes"] == pytest.approx(4.84375 / 16, rel=1e-3)


def test_run_rejects_an_unknown_host_dtype(cli, tiny_trace: Path) -> None:
    """A typo in --host-dtype exits 2 with one line naming the field."""
    res = cli("run", "--no-progress", "--trace", tiny_trace, "--host-dtype", "q4_k_x")
    assert res.exit_code == 2
    assert res.stderr.startswith("error:") and "host_dtype" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_profiles_show_reports_the_split(cli) -> None:
    """`profiles show --host-dtype --nonexpert-dtype` reports both precisions and host bytes."""
    res = cli(
        "profiles", "show", "rtx4070-pcie4", "--model", "qwen3-30b-a3b", "--dtype", "int4_g128",
        "--host-dtype", "q4_k_m", "--nonexpert-dtype", "q8_0", "--json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    model = get_model("qwen3-30b-a3b")
    assert doc["dtype"] == "int4_g128" and doc["host_dtype"] == "q4_k_m"
    assert doc["nonexpert_dtype"] == "q8_0"
    assert doc["host_expert_bytes"] == model.expert_bytes("q4_k_m")
    assert doc["expert_bytes"] == model.expert_bytes("int4_g128")
    table = cli("profiles", "show", "rtx4070-pcie4", "--host-dtype", "q4_k_m")
    assert table.exit_code == 0 and "host copies q4_k_m" in table.stdout


def test_precisions_round_trip_through_trace_metadata() -> None:
    """Split precisions survive to_dict/from_dict; defaults are left out of the metadata."""
    from daopsim.simulator.models import ModelShape

    model = get_model("qwen3-30b-a3b")
    assert "host_dtype" not in model.to_dict() and "nonexpert_dtype" not in model.to_dict()
    split = model.with_precision("int4_g128", "q4_k_m", "q8_0")
    data = split.to_dict()
    assert (data["host_dtype"], data["nonexpert_dtype"]) == ("q4_k_m", "q8_0")
    assert ModelShape.from_dict(data) == split
    assert ModelShape.from_dict(model.to_dict()) == model


def test_sweep_grid_carries_the_precisions(tmp_path: Path) -> None:
    """A grid's host_dtype and nonexpert_dtype reach every run; keys differ from the default's."""
    from daopsim.simulator.grid import Grid
    from daopsim.simulator.sweep import run_sweep

    trace = make_trace(tmp_path / "t.parquet", sequences=2, prefill=3, decode=4, seed=2)
    base = {"policies": ["lru"], "hw": ["rtx4090-pcie4"], "traces": [str(trace)]}
    base |= {"gpu_experts": [12], "dtype": "bf16"}
    plain, _ = run_sweep(
        Grid.from_dict(base), workers=1, out=tmp_path / "a.parquet", progress=False
    )
    split_grid = Grid.from_dict(base | {"host_dtype": "q8_0", "nonexpert_dtype": "fp8"})
    split, _ = run_sweep(split_grid, workers=1, out=tmp_path / "b.parquet", progress=False)
    assert (plain["status"] == "ok").all() and (split["status"] == "ok").all()
    assert plain["key"][0] != split["key"][0]
    assert split["h2d_bytes"][0] / plain["h2d_bytes"][0] == pytest.approx(8.5 / 16, rel=1e-3)
    with pytest.raises(UserError, match="host_dtype"):
        Grid.from_dict(base | {"host_dtype": 4})


def test_models_dtypes_lists_every_precision(cli) -> None:
    """`daopsim models dtypes --json` is the DTYPES table; the plain table has a row each."""
    res = cli("models", "dtypes", "--json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert [r["name"] for r in rows] == list(DTYPES)
    assert {r["name"]: r["bits"] for r in rows} == {d.name: d.bits for d in DTYPES.values()}
    table = cli("models", "dtypes")
    assert table.exit_code == 0 and len(table.stdout.strip().splitlines()) == 1 + len(DTYPES)
