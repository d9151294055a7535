"""ggml's measured CPU GEMM rate (``cpu.ggml_gemm_gflops``; docs/cost-model.md, "Kernel
efficiency"): the compute roof of ggml block formats under a ggml runtime on a host that
measured it, and nothing else."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from daopsim.simulator.costs import cost_model
from daopsim.simulator.data import profiles_dir
from daopsim.simulator.errors import UserError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.models import get_model

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
    assert ggml.cpu_peak_gflops("q4_0") == rate
    assert ggml.cpu_peak_gflops("mxfp4") == rate
    # bf16 and fp32 keep the profile's float rates; a PyTorch runtime keeps bf16_gflops
    assert ggml.cpu_peak_gflops("bf16") == ggml.hw.cpu.bf16_gflops
    assert ggml.cpu_peak_gflops("fp32") == ggml.hw.cpu.fp32_gflops
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
    # bf16 weights are not a ggml block format: untouched
    assert cost_model(hw, BF16, "ggml").cpu_expert_s(n) == cost_model(
        without, BF16, "ggml"
    ).cpu_expert_s(n)


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
