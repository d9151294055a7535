"""ggml's measured CPU GEMM rate (``cpu.ggml_gemm_gflops``, ik_llama.cpp's repacked kernels;
docs/cost-model.md, "CPU GEMM by runtime"): times the runtime's share for the weight precision,
the compute roof of every format ggml runs under a ggml runtime on a host that measured it, and
nothing else."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from daopsim.simulator.costs import cost_model
from daopsim.simulator.data import profiles_dir
from daopsim.simulator.errors import UserError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.models import get_model
from daopsim.simulator.run_costs import runtime_cost_model
from daopsim.simulator.runtime_profiles import get_runtime, parse_runtime

GGUF = get_model("deepseek-v2-lite").with_precision("q4_0", "q4_0", "q4_0")
BF16 = get_model("deepseek-v2-lite").with_precision("bf16", "bf16", "bf16")


def test_the_7950x_profile_carries_its_measured_rate_with_a_source() -> None:
    hw = load_profile("rtx4080-pcie4")
    assert hw.cpu.ggml_gemm_gflops is not None
    assert hw.cpu.ggml_gemm_gflops > hw.cpu.bf16_gflops  # repacked Q4_0 beats the derived rate
    text = (profiles_dir() / "rtx4080-pcie4.toml").read_text()
    line = next(x for x in text.splitlines() if x.startswith("ggml_gemm_gflops"))
    assert "PR #119" in line
    # the host it was measured on only: the 4090 profile's derived rate stays
    assert load_profile("rtx4090-pcie4").cpu.ggml_gemm_gflops is None


def test_the_rate_is_the_roof_of_ggml_formats_under_ggml_only() -> None:
    ggml = cost_model("rtx4080-pcie4", GGUF, "ggml")
    rate = ggml.hw.cpu.ggml_gemm_gflops
    # without a runtime share table every format ggml runs gets the reference rate
    for dtype in ("q4_0", "mxfp4", "q6_k", "bf16", "fp32"):
        assert ggml.cpu_peak_gflops(dtype) == rate, dtype
    # a format ggml has no CPU type for stays PyTorch's, and a PyTorch runtime keeps bf16_gflops
    assert ggml.cpu_peak_gflops("int4_g128") == ggml.hw.cpu.bf16_gflops
    assert cost_model("rtx4080-pcie4", GGUF).cpu_peak_gflops("q4_0") == ggml.hw.cpu.bf16_gflops


def test_a_compute_bound_cpu_call_speeds_up_by_the_rate_ratio_and_a_stream_bound_one_not() -> None:
    hw = load_profile("rtx4080-pcie4")
    without = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, ggml_gemm_gflops=None))
    fast, slow = cost_model(hw, GGUF, "ggml"), cost_model(without, GGUF, "ggml")
    # one decode token streams weights: the FLOP roof does not bind
    assert fast.cpu_expert_s(1) == slow.cpu_expert_s(1)
    # a long prompt's call is FLOP-bound on both: the time scales by bf16 / ggml rate
    n = 4096
    assert fast.cpu_expert_s(n) == pytest.approx(
        slow.cpu_expert_s(n) * hw.cpu.bf16_gflops / hw.cpu.ggml_gemm_gflops, rel=1e-12
    )
    assert fast.cpu_nonexpert_layer_s(n, 0) < slow.cpu_nonexpert_layer_s(n, 0)
    # a PyTorch runtime does not run ggml's kernels: untouched
    assert cost_model(hw, BF16).cpu_expert_s(n) == cost_model(without, BF16).cpu_expert_s(n)


@pytest.mark.parametrize("bad", [0, -1.0, 2e6, "fast"])
def test_a_bad_rate_is_a_one_line_profile_error(tmp_path, bad) -> None:
    src = profiles_dir() / "rtx4090-pcie4.toml"
    data = tomllib.loads(src.read_text())
    lines = src.read_text().splitlines()
    i = lines.index("[cpu]")
    lines.insert(i + 1, f"ggml_gemm_gflops = {bad!r}".replace("'", '"'))
    path = tmp_path / "bad.toml"
    path.write_text("\n".join(lines) + "\n")
    assert data["cpu"].get("ggml_gemm_gflops") is None
    with pytest.raises(UserError, match="ggml_gemm_gflops"):
        load_profile(str(path))


# --- the runtime's share of the reference rate (ik_llama.cpp discussion #164, PRs #119-#134) ---

#: LLaMA-3.1-8B PP-512 on the Ryzen-7950X, t/s: (mainline, ik_llama.cpp -rtr), discussion #164
DISC_164 = {
    "bf16": (78.58, 256.90),
    "q8_0": (147.92, 268.19),
    "q4_0": (153.52, 273.54),
    "q2_k": (122.37, 269.96),
    "q4_k_m": (108.40, 269.60),
    "q6_k": (82.56, 259.21),
}


@pytest.mark.parametrize("dtype", sorted(DISC_164))
def test_the_runtime_shares_reproduce_the_author_table(dtype: str) -> None:
    """Each runtime's roof over ik_llama.cpp's repacked Q4_0 roof is the ratio of the two
    prompt rates the source measured on the same CPU (mainline's and the fork's, -rtr)."""
    hw = load_profile("rtx4080-pcie4")
    main, rtr = DISC_164[dtype]
    ref = DISC_164["q4_0"][1]
    for name, tps in (("llama.cpp", main), ("ik_llama.cpp-rtr", rtr)):
        cm = runtime_cost_model(hw, GGUF, get_runtime(name))
        share = cm.cpu_peak_gflops(dtype) / hw.cpu.ggml_gemm_gflops
        assert share == pytest.approx(tps / ref, abs=0.0006), (name, dtype)


def test_the_fork_without_repacking_sits_between_mainline_and_repacked() -> None:
    """PRs #119-#134: the fork's kernels on plain types run at 0.63-0.72 of its repacked Q4_0,
    above mainline and below its repacked types, for every format ggml runs here."""
    main, plain, rtr = (get_runtime(n) for n in ("llama.cpp", "ik_llama.cpp", "ik_llama.cpp-rtr"))
    for dtype in ("bf16", "q8_0", "q4_0", "q3_k_m", "q4_k_m", "q5_k_m", "q6_k", "mxfp4"):
        a, b, c = (r.cpu_gemm_share_of(dtype) for r in (main, plain, rtr))
        assert a < b <= c, dtype
    assert plain.cpu_gemm_share_of("q4_0") == pytest.approx(185.89 / 278.15, abs=0.0006)


def test_a_host_without_a_measured_rate_keeps_its_derived_roof_under_every_runtime() -> None:
    """The share scales the measured reference only: on a host with no ggml GEMM measurement the
    roof stays the profile's derived rate, whatever the runtime."""
    hw = load_profile("rtx4090-pcie4")
    for name in ("llama.cpp", "ik_llama.cpp", "ik_llama.cpp-rtr"):
        cm = runtime_cost_model(hw, GGUF, get_runtime(name))
        assert cm.cpu_peak_gflops("q4_0") == hw.cpu.bf16_gflops


@pytest.mark.parametrize(
    ("table", "match"),
    [({"q4_0": 1.5}, r"cpu_gemm_share\.q4_0"), ({"q9_z": 0.5}, r"cpu_gemm_share\.q9_z")],
)
def test_a_bad_share_is_a_one_line_error(table: dict[str, float], match: str) -> None:
    with pytest.raises(UserError, match=match):
        parse_runtime({"name": "x", "cpu_gemm_share": table}, "x.toml")


def test_mainline_expert_products_run_below_dense_ones_where_tinyblas_serves_dense() -> None:
    """llama.cpp's MUL_MAT_ID multiplies row by row (vec_dot) where its dense product of the
    same precision takes llamafile's tiled kernels: a compute-bound CPU expert call is slower
    by exactly the ratio of the two shares, and the non-expert part (a dense product) is not."""
    hw = load_profile("rtx4080-pcie4")
    rt = get_runtime("llama.cpp")
    dense, expert = dict(rt.cpu_gemm_share), dict(rt.cpu_expert_gemm_share)
    assert expert, "the llama.cpp runtime states its expert shares"
    for dtype, share in expert.items():
        assert share < dense[dtype], dtype  # never faster than the tiled dense product
    # K-quants have no tiled kernel: their dense share is already the row-by-row one
    assert "q4_k_m" not in expert and "q6_k" not in expert
    with_table = runtime_cost_model(hw, GGUF, rt)
    without = runtime_cost_model(hw, GGUF, dataclasses.replace(rt, cpu_expert_gemm_share=()))
    n = 4096  # FLOP-bound
    ratio = with_table.cpu_expert_s(n) / without.cpu_expert_s(n)
    assert ratio == pytest.approx(dense["q4_0"] / expert["q4_0"], rel=1e-9)
    assert with_table.cpu_nonexpert_layer_s(n, 0) == without.cpu_nonexpert_layer_s(n, 0)
    # one decode token streams weights: no change
    assert with_table.cpu_expert_s(1) == without.cpu_expert_s(1)
    # a K-quant expert keeps the dense share
    km = get_model("deepseek-v2-lite").with_precision("q4_k_m", "q4_k_m", "q4_k_m")
    assert runtime_cost_model(hw, km, rt).cpu_peak_gflops("q4_k_m", expert=True) == (
        runtime_cost_model(hw, km, rt).cpu_peak_gflops("q4_k_m")
    )
    # ik_llama.cpp's own MoE kernels state no separate expert table
    assert get_runtime("ik_llama.cpp-rtr").cpu_expert_gemm_share == ()


def test_a_bad_expert_share_is_one_line_naming_the_field() -> None:
    with pytest.raises(UserError, match=r"cpu_expert_gemm_share\.q4_0"):
        parse_runtime({"name": "x", "cpu_expert_gemm_share": {"q4_0": 1.5}}, "x.toml")
    with pytest.raises(UserError, match=r"cpu_expert_gemm_share\.nope"):
        parse_runtime({"name": "x", "cpu_expert_gemm_share": {"nope": 0.5}}, "x.toml")
