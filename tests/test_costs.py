"""Cost model: arithmetic pinned against reference facts, measured overrides, dtypes, CLI output."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from daopsim.simulator.costs import CostModel, cost_model, expert_kernels
from daopsim.simulator.hardware import list_profiles, load_profile
from daopsim.simulator.models import PRESETS, get_model

FIXTURES = Path(__file__).parent / "fixtures" / "profiles"
MIXTRAL = get_model("mixtral-8x7b")


def test_mixtral_expert_bytes() -> None:
    """A Mixtral expert is 3 x 4096 x 14336 x 2 B = 352,321,536 bytes in bf16 (references.md)."""
    assert cost_model("a6000-pcie4", MIXTRAL).expert_bytes == 352_321_536
    assert cost_model("a6000-pcie4", MIXTRAL.with_dtype("int8")).expert_bytes == 176_160_768
    assert cost_model("a6000-pcie4", MIXTRAL.with_dtype("int4")).expert_bytes == 88_080_384


def test_pinned_copy_on_4090() -> None:
    """A pinned Mixtral expert copy on rtx4090-pcie4 takes about 13.3 ms (fiddler#7: 13.30 ms)."""
    t = cost_model("rtx4090-pcie4", MIXTRAL).h2d_expert_s(pinned=True)
    assert 13e-3 <= t <= 14e-3
    assert t == pytest.approx(13.30e-3, rel=0.01)


def test_gpu_token_on_a6000() -> None:
    """One token through one Mixtral expert on the A6000: roofline 0.46 ms plus 5 launches."""
    cm = cost_model("a6000-pcie4", MIXTRAL)
    t = cm.gpu_expert_s(1)
    assert 0.44e-3 <= t <= 0.50e-3
    roofline = 352.3e6 / 768e9  # docs/references.md#gpu-measurements: 0.46 ms roofline (A6000)
    assert t - 5 * 5e-6 == pytest.approx(roofline, rel=0.002)


def test_a6000_measured_load_is_a_decision_input_not_the_copy_time() -> None:
    """a6000: 8.5 ms CPU (measured, anchors execution); 210 ms load is what DAOP believes only."""
    cm = cost_model("a6000-pcie4", MIXTRAL)
    assert cm.cpu_expert_s(1) == pytest.approx(8.5e-3)
    assert cm.h2d_expert_s(pinned=False) == pytest.approx(6e-6 + 352_321_536 / 14.4e9)
    pinned = cm.h2d_expert_s(pinned=True)
    assert pinned == pytest.approx(6e-6 + 352_321_536 / 26.2e9)
    assert 13e-3 < pinned < 14e-3
    assert cm.decision_load_s() == pytest.approx(210e-3)
    assert cm.decision_cpu_expert_s() == pytest.approx(8.5e-3)
    used = cm.uses_measured()
    assert used["cpu_expert"] and not used["h2d_expert_pageable"]
    assert not used["h2d_expert_pinned"] and not used["gpu_expert"]
    assert cm.sources()["h2d_expert_pageable"].startswith("link")
    assert cm.sources()["h2d_expert_pinned"].startswith("link")


def test_daop_host_link_is_gen3() -> None:
    """DAOP's i9-10980XE host has PCIe 3.0 lanes: the copy takes what a Gen3 x16 link takes."""
    daop_host = cost_model("a6000-x299-pcie3", MIXTRAL)
    assert daop_host.hw.link.h2d_pinned_gbs == pytest.approx(12.6)
    assert daop_host.h2d_expert_s(True) == pytest.approx(6e-6 + 352_321_536 / 12.6e9)
    # everything but the link comes from the base profile
    base = cost_model("a6000-pcie4", MIXTRAL)
    assert daop_host.hw.gpu == base.hw.gpu and daop_host.hw.cpu == base.hw.cpu
    assert daop_host.decision_load_s() == pytest.approx(210e-3)


def test_cpu_expert_is_one_batched_call_anchored_at_the_measured_token() -> None:
    """n tokens: max(measured one-token time, 2 x params x n / CPU throughput), not n x 8.5 ms."""
    cm = cost_model("a6000-pcie4", MIXTRAL)
    assert cm.cpu_expert_s(1) == pytest.approx(8.5e-3)
    assert cm.cpu_expert_s(10) == pytest.approx(8.5e-3)  # still weight-stream bound
    n = 256
    assert cm.cpu_expert_s(n) == pytest.approx(2 * 176_160_768 * n / 864e9)
    assert cm.cpu_expert_s(n) < n * 8.5e-3 / 10
    # monotone in n, and a batch never costs more than running its tokens one by one
    times = [cm.cpu_expert_s(k) for k in range(1, 300)]
    assert all(b >= a for a, b in itertools.pairwise(times))
    assert all(t <= k * 8.5e-3 + 1e-12 for k, t in enumerate(times, start=1))
    nb = cm.breakeven_tokens(pinned=False)
    copy_then_gpu = cm.h2d_expert_s(False) + cm._gpu_expert(nb)
    assert cm._cpu_expert(nb) == pytest.approx(copy_then_gpu, rel=1e-6)
    assert cm.breakeven_tokens(pinned=True) < nb


def test_measured_constants_ignored_at_other_dtype() -> None:
    """Measured bf16 constants do not apply to int4 experts; the formulas do."""
    cm = cost_model("a6000-pcie4", MIXTRAL.with_dtype("int4"))
    assert cm.measured is None
    assert not any(cm.uses_measured().values())
    assert cm.h2d_expert_s(False) == pytest.approx(6e-6 + 88_080_384 / 14.4e9)


def test_phi_on_a100_uses_its_row() -> None:
    """A100 host: Phi-3.5-MoE 2.5 ms CPU, 25 ms load; Mixtral-8x22B 16 / 86."""
    phi = cost_model("a100-40g-pcie4", "phi-3.5-moe")
    assert phi.cpu_expert_s(1) == pytest.approx(2.5e-3)
    assert phi.decision_load_s() == pytest.approx(25e-3)
    big = cost_model("a100-40g-pcie4", "mixtral-8x22b")
    assert big.cpu_expert_s(1) == pytest.approx(16e-3)
    assert big.decision_cpu_expert_s() == pytest.approx(16e-3)
    assert big.decision_load_s() == pytest.approx(86e-3)


def test_user_profile_measured_pinned_load() -> None:
    """A measured load with load_overrides_link = true replaces the pinned copy only."""
    hw = load_profile(FIXTURES / "valid-custom.toml")
    cm = cost_model(hw, MIXTRAL)
    assert cm.h2d_expert_s(True) == pytest.approx(20e-3)
    assert cm.h2d_expert_s(False) == pytest.approx(10e-6 + 352_321_536 / 12.5e9)
    assert cm.d2h_expert_s() == pytest.approx(10e-6 + 352_321_536 / 25e9)
    assert cm.d2h_expert_s(pinned=False) == pytest.approx(10e-6 + 352_321_536 / 10e9)


def test_cpu_roofline_without_measurement() -> None:
    """Without a measured constant the CPU cost is max(bytes/bw, flops/throughput)."""
    cm = cost_model("rtx4090-pcie4", MIXTRAL)
    assert cm.measured is None
    # PyTorch bf16: 16 Zen 4 cores x 4.5 GB/s, under the socket's 0.97 x 83.2 GB/s
    assert cm.cpu_expert_s(1) == pytest.approx(352_321_536 / 72.0e9)
    big = 10_000
    assert cm.cpu_expert_s(big) == pytest.approx(2 * 176_160_768 * big / 2560e9)
    fp32 = cost_model("rtx4090-pcie4", MIXTRAL.with_dtype("fp32"))
    assert fp32.cpu_expert_s(big) == pytest.approx(2 * 176_160_768 * big / 1280e9)


def test_gpu_roofline_turns_compute_bound() -> None:
    """Many tokens make the GPU expert compute-bound: time grows with n at the profile's GEMM
    rate (the A6000's measured 123.3 TFLOPS, references.md#gpu-measurements; spec 154.8)."""
    cm = cost_model("a6000-pcie4", MIXTRAL)
    n = 4096
    flops_time = 2 * 176_160_768 * n / 123.3e12
    assert cm.gpu_expert_s(n) == pytest.approx(flops_time + 5 * 5e-6, rel=1e-9)
    assert cm.gpu_expert_s(0) == 0.0
    assert cm.gpu_expert_s(2) >= cm.gpu_expert_s(1)
    with pytest.raises(ValueError):
        cm.gpu_expert_s(-1)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantised_experts_copy_faster(dtype: str) -> None:
    """Int8/int4 experts move 2x/4x fewer bytes and read fewer bytes on the GPU."""
    bf = cost_model("rtx4090-pcie4", MIXTRAL)
    q = cost_model("rtx4090-pcie4", MIXTRAL.with_dtype(dtype))
    ratio = {"int8": 2, "int4": 4}[dtype]
    assert bf.expert_bytes == ratio * q.expert_bytes
    overhead = 6e-6
    assert (bf.h2d_expert_s(True) - overhead) == pytest.approx(
        ratio * (q.h2d_expert_s(True) - overhead)
    )
    assert q.gpu_expert_s(1) < bf.gpu_expert_s(1)


def test_activation_copy() -> None:
    """One hidden state (4096 x 2 B) costs the fixed overhead plus a few nanoseconds."""
    cm = cost_model("a6000-pcie4", MIXTRAL)
    assert cm.activation_copy_s(1) == pytest.approx(6e-6 + 8192 / 26.2e9)
    assert cm.activation_copy_s(0) == 0.0
    assert cm.activation_copy_s(100) > cm.activation_copy_s(1)


def test_nonexpert_layer_grows_with_context() -> None:
    """Non-expert part: weights per layer read once, KV reads grow with context."""
    cm = cost_model("a6000-pcie4", MIXTRAL)
    m = MIXTRAL
    per_layer_weights = (m.non_expert_params - m.embedding_params) * 2 / 32
    kv = m.kv_bytes_per_token / 32 * (512 + 1)
    expected = (per_layer_weights + kv) / 768e9 + 20 * 5e-6
    assert cm.nonexpert_layer_s(1, 512) == pytest.approx(expected, rel=1e-3)
    assert cm.nonexpert_layer_s(1, 32_000) > cm.nonexpert_layer_s(1, 512)
    # a 512-token prefill costs far less than 512 decode steps
    assert cm.nonexpert_layer_s(512, 0) < 512 * cm.nonexpert_layer_s(1, 0) / 10


def test_unified_memory_copies_are_dram_copies() -> None:
    """Jetson: a 'copy' is DRAM to DRAM at half the shared bandwidth, not a PCIe transfer."""
    cm = cost_model("jetson-orin-64g", MIXTRAL)
    assert cm.unified_memory
    assert cm.h2d_expert_s(True) == pytest.approx(6e-6 + 352_321_536 / (152.8e9 / 2), rel=1e-3)


def test_gpu_slots_match_fiddler_reports() -> None:
    """Mixtral experts that fit: Fiddler reports 56 on 24 GB (env 1) and 125 on 48 GB (env 2)."""
    assert cost_model("rtx6000-pcie3", MIXTRAL).gpu_expert_slots() == 56
    assert abs(cost_model("rtx6000ada-pcie4", MIXTRAL).gpu_expert_slots() - 125) <= 2
    # DAOP ran 120 of 256 on the A6000
    assert cost_model("a6000-pcie4", MIXTRAL).gpu_expert_slots() >= 120


def test_every_profile_and_model_gives_finite_positive_costs() -> None:
    """All bundled profiles x all presets: every cost is finite and positive."""
    for hw in list_profiles():
        for model in PRESETS.values():
            cm = cost_model(hw, model)
            s = cm.summary()
            for key, value in s["costs"].items():
                if key.startswith("breakeven_tokens"):
                    # 0.0 is documented: a copy wins at any count (a slow host CPU, e.g. a
                    # two-channel DDR4 desktop beside a Gen4 link)
                    assert value >= 0 and math.isfinite(value), (hw.name, model.name, key)
                else:
                    assert value > 0 and math.isfinite(value), (hw.name, model.name, key)
            assert set(cm.uses_measured()) == set(cm.sources())
            assert hw.power is not None and hw.power.gpu_busy_w > hw.power.gpu_idle_w


def test_cost_model_is_cached() -> None:
    """cost_model returns the same object for the same profile and model."""
    hw = load_profile("a6000-pcie4")
    assert cost_model(hw, MIXTRAL) is cost_model(load_profile("a6000-pcie4"), MIXTRAL)
    assert isinstance(cost_model(hw, MIXTRAL), CostModel)
    assert expert_kernels(get_model("switch-base-128")) == 3


def test_profiles_show_json(cli) -> None:
    """`profiles show --json` has the derived costs, expert_bytes at top level and provenance."""
    result = cli("profiles", "show", "a6000-pcie4", "--model", "mixtral-8x7b", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["expert_bytes"] == 352_321_536
    assert out["context_tokens"] == 512
    c = out["costs"]
    for key in (
        "h2d_expert_ms_pinned",
        "h2d_expert_ms_pageable",
        "gpu_expert_ms",
        "cpu_expert_ms",
        "nonexpert_layer_ms",
        "breakeven_tokens",
    ):
        assert key in c
    assert c["h2d_expert_ms_pageable"] == pytest.approx(6e-3 + 352_321_536 / 14.4e9 * 1e3)
    assert c["cpu_expert_ms"] == pytest.approx(8.5)
    assert out["measured_costs"]["cpu_expert"] is True
    assert out["gpu"]["name"] == "NVIDIA RTX A6000"


def test_profiles_show_dtype_and_context(cli) -> None:
    """--dtype int4 quarters the bytes; --context is echoed and changes the non-expert cost."""
    a = json.loads(cli("profiles", "show", "rtx4090-pcie4", "--dtype", "int4", "--json").stdout)
    b = json.loads(cli("profiles", "show", "rtx4090-pcie4", "--context", "8192", "--json").stdout)
    assert a["expert_bytes"] == 88_080_384 and a["dtype"] == "int4"
    assert b["context_tokens"] == 8192
    assert b["costs"]["nonexpert_layer_ms"] > a["costs"]["nonexpert_layer_ms"]


def test_profiles_show_table_and_bad_model(cli) -> None:
    """The readable output marks measured costs; an unknown model exits 2."""
    result = cli("profiles", "show", "a6000-pcie4")
    assert result.exit_code == 0
    assert "(measured)" in result.stdout and "break-even" in result.stdout
    bad = cli("profiles", "show", "a6000-pcie4", "--model", "gpt-5")
    assert bad.exit_code == 2 and "unknown model" in bad.stderr
