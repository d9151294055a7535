"""The CPU weight stream (docs/cost-model.md, "CPU weight stream"): cores x per-core stream,
bounded by the socket's DRAM, per kernel family, with measured all-core streams on top.

Checked by hand against each bundled profile, against the measurements the family rows of
docs/references.md ("CPU weight stream") are read from, and against physical invariants that a
mistaken rule would break (more cores never slower, never above the DRAM, a measurement wins).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from daopsim.simulator.costs import cost_model, cpu_family_stream_gbs, cpu_stream_family
from daopsim.simulator.errors import ProfileError, UserError
from daopsim.simulator.hardware import list_profiles, load_profile
from daopsim.simulator.hardware_spec import CPU_STREAM_FALLBACK, CPU_STREAM_FAMILIES, CpuSpec
from daopsim.simulator.models import get_model

PROFILES = [p.name for p in list_profiles()]


def _by_hand(cpu: CpuSpec, family: str) -> float:
    """The documented precedence, written out independently of the code under test."""
    measured, per_core = dict(cpu.stream_gbs), dict(cpu.core_stream_gbs)
    for name in (family, CPU_STREAM_FALLBACK.get(family, family)):
        legacy = cpu.ggml_stream_gbs if name == "ggml" else cpu.mem_bw_gbs
        bw = measured.get(name, legacy)
        if bw is not None:
            return bw if cpu.socket_bw_gbs is None else min(bw, cpu.socket_bw_gbs)
        if name in per_core:
            bound = cpu.socket_bw_gbs or cpu.dram_gbs * cpu.dram_efficiency
            return min(cpu.cores_used * per_core[name], bound)
    raise AssertionError(f"no stream for {family}")


@pytest.mark.parametrize("name", PROFILES)
def test_every_profile_streams_every_family_by_the_rule(name: str) -> None:
    """Every bundled profile states a stream for every kernel family (directly or by the
    documented fallback), each equal to the rule by hand and never above the DRAM."""
    cpu = load_profile(name).cpu
    for fam in CPU_STREAM_FAMILIES:
        got = cpu_family_stream_gbs(cpu, fam)
        assert got == pytest.approx(_by_hand(cpu, fam)), fam
        assert 0 < got <= cpu.dram_gbs, fam
        if cpu.socket_bound_gbs is not None:
            assert got <= cpu.socket_bound_gbs * (1 + 1e-12), fam


@pytest.mark.parametrize("name", PROFILES)
def test_more_cores_never_stream_slower_and_stop_at_the_socket(name: str) -> None:
    """The per-core term grows with the cores used until the socket's bound takes over."""
    hw = load_profile(name)
    for fam in CPU_STREAM_FAMILIES:
        prev = 0.0
        for cores in (1, 2, 4, 8, 16, 64, 512):
            cpu = dataclasses.replace(hw.cpu, cores_used=cores)
            got = cpu_family_stream_gbs(cpu, fam)
            assert got >= prev - 1e-12, (fam, cores)
            prev = got
        if not dict(hw.cpu.stream_gbs) and hw.cpu.mem_bw_gbs is None and fam != "ggml":
            # without a measurement, enough cores always reach the socket's bound
            assert prev == pytest.approx(hw.cpu.socket_bound_gbs)


def test_a_measurement_wins_over_the_mechanism_and_the_socket_caps_it() -> None:
    base = load_profile("rtx4090-pcie4").cpu
    assert cpu_family_stream_gbs(base, "torch_bf16") == pytest.approx(min(16 * 4.5, 0.97 * 83.2))
    m = dataclasses.replace(base, stream_gbs=(("torch_bf16", 20.0),))
    assert cpu_family_stream_gbs(m, "torch_bf16") == 20.0
    # torch_fp16 takes torch_bf16's measurement; torch_fp32 has its own per-core figure
    assert cpu_family_stream_gbs(m, "torch_fp16") == 20.0
    assert cpu_family_stream_gbs(m, "torch_fp32") == pytest.approx(min(16 * 11.4, 0.97 * 83.2))
    legacy = dataclasses.replace(base, mem_bw_gbs=30.0, ggml_stream_gbs=40.0)
    assert cpu_family_stream_gbs(legacy, "torch_int8") == 30.0
    assert cpu_family_stream_gbs(legacy, "ggml") == 40.0
    capped = dataclasses.replace(legacy, socket_bw_gbs=35.0)
    assert cpu_family_stream_gbs(capped, "ggml") == 35.0
    # the socket's measured bound also replaces dram_gbs x dram_efficiency in the mechanism
    sock = dataclasses.replace(base, socket_bw_gbs=50.0)
    assert cpu_family_stream_gbs(sock, "ggml") == 50.0


def test_a_family_without_any_figure_is_a_one_line_error() -> None:
    cpu = dataclasses.replace(
        load_profile("rtx4090-pcie4").cpu, core_stream_gbs=(("torch_bf16", 4.5),)
    )
    with pytest.raises(UserError, match=r"cpu\.core_stream_gbs\.ggml"):
        cpu_family_stream_gbs(cpu, "ggml")


@pytest.mark.parametrize(
    ("kernels", "dtype", "family"),
    [
        ("ggml", "q4_k_m", "ggml"),
        ("ggml", "mxfp4", "ggml"),
        ("ggml", "bf16", "ggml"),
        ("ggml", "fp32", "ggml"),
        ("ggml", "int4_g128", "torch_bf16"),  # ggml has no CPU type for it
        ("ggml", "int8", "torch_int8"),
        ("default", "q4_k_m", "torch_bf16"),  # PyTorch dequantises GGUF into bf16 passes
        ("default", "fp32", "torch_fp32"),
        ("default", "fp16", "torch_fp16"),
        ("default", "bf16", "torch_bf16"),
        ("default", "fp8", "torch_bf16"),
    ],
)
def test_the_runtime_and_precision_pick_the_family(kernels: str, dtype: str, family: str) -> None:
    assert cpu_stream_family(kernels, dtype) == family
    cm = cost_model("rtx4090-pcie4", get_model("mixtral-8x7b").with_dtype(dtype), kernels)
    assert cm.cpu_stream_gbs(dtype) == cpu_family_stream_gbs(cm.hw.cpu, family)


def test_the_cpu_expert_streams_at_the_family_rate() -> None:
    """A one-token CPU expert on the formula path is its bytes at its family's stream."""
    hw = load_profile("rtx4090-pcie4")
    for kernels, dtype in (("default", "bf16"), ("ggml", "q4_k_m"), ("default", "fp32")):
        cm = cost_model(hw, get_model("olmoe-1b-7b").with_dtype(dtype), kernels)
        fam = cpu_stream_family(kernels, dtype)
        stream = cm.host_expert_bytes / (cpu_family_stream_gbs(hw.cpu, fam) * 1e9)
        assert cm.expert_flops(1) / (cm.cpu_peak_gflops(dtype) * 1e9) < stream  # memory-bound
        assert cm.cpu_expert_s(1) == pytest.approx(stream)


# --- the family rows of docs/references.md reproduce their measurements ------------------------


def test_zen4_client_rows_reproduce_the_author_measurements() -> None:
    """Row G: 62.1 GB/s of LLaMA-3.1-8B Q8_0 weights (7.79 t/s x 7.97 GB, ik_llama.cpp PR #54)
    of the 64 GB/s the author states; row A: 2 threads of BF16 decode already stream 4.05 t/s x
    15.0 GB (discussion #164), so one core streams at least half of it."""
    cpu = load_profile("rtx4080-pcie4").cpu
    assert cpu.dram_gbs == 64.0
    assert cpu.dram_efficiency == pytest.approx(7.79 * 7.97 / 64.0, abs=0.005)
    assert dict(cpu.core_stream_gbs)["ggml"] == pytest.approx(4.05 * 15.0 / 2, abs=0.2)
    # 16 threads of ggml reach the DRAM bound: the decode rows' 62.1 GB/s
    assert cpu_family_stream_gbs(cpu, "ggml") == pytest.approx(62.1, abs=0.05)


def test_zen2_client_rows_reproduce_the_maintainer_measurements() -> None:
    """Rows B and H: the 3700X streams 18.18 GB per LLaMA-33B q4_0 token in 1.599 s on one
    thread and 0.52365 s on all 8 cores (JohannesGaessler's page)."""
    cpu = load_profile("rtx3090-3700x-pcie4").cpu
    assert dict(cpu.core_stream_gbs)["ggml"] == pytest.approx(18.177 / 1.599, abs=0.05)
    assert cpu.ggml_stream_gbs == pytest.approx(18.177 / 0.52365, abs=0.05)
    assert cpu.dram_efficiency == pytest.approx(cpu.ggml_stream_gbs / 51.2, abs=0.005)
    # the measurement and the mechanism agree on that machine
    mech = dataclasses.replace(cpu, ggml_stream_gbs=None)
    assert cpu_family_stream_gbs(mech, "ggml") == pytest.approx(cpu.ggml_stream_gbs, rel=0.01)


def test_daop_hosts_rows_are_their_measured_expert_over_the_cores() -> None:
    """Rows C and D: DAOP's Mixtral CPU expert (352.3 MB) in 8.5 ms on 18 i9-10980XE cores and
    in 5 ms on 16 Xeon 6326 cores, per core."""
    for name, ms, cores, row in (("a6000-pcie4", 8.5, 18, 2.30), ("a100-40g-pcie4", 5.0, 16, 4.41)):
        cpu = load_profile(name).cpu
        assert cpu.cores_used == cores
        assert cpu.mem_bw_gbs == pytest.approx(0.3523 / (ms * 1e-3), abs=0.1)
        assert dict(cpu.core_stream_gbs)["torch_bf16"] == pytest.approx(row)
        assert row == pytest.approx(cpu.mem_bw_gbs / cores, abs=0.01)


def test_server_cores_stream_less_per_core_than_desktop_cores() -> None:
    """What the family rows say (docs/references.md): a mesh server core keeps fewer bytes in
    flight than a desktop core, so a 16-core desktop and a 16-core server of the same DRAM get
    different streams from the same rule."""
    desk = dict(load_profile("rtx4090-pcie4").cpu.core_stream_gbs)
    server = dict(load_profile("rtx4090-xeon6454s-pcie4").cpu.core_stream_gbs)
    assert server["ggml"] < desk["ggml"] / 5


# --- profile validation ------------------------------------------------------------------------


def _write(tmp_path: Path, body: str) -> str:
    p = tmp_path / "p.toml"
    p.write_text('extends = "rtx4090-pcie4"\nname = "x"\ndescription = "x"\n' + body)
    return str(p)


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ("[cpu]\ndram_efficiency = 1.2\n", "cpu.dram_efficiency"),
        ("[cpu]\ndram_efficiency = 0\n", "cpu.dram_efficiency"),
        ("[cpu.core_stream_gbs]\nggml = -1\n", "cpu.core_stream_gbs.ggml"),
        ("[cpu.core_stream_gbs]\navx = 3.0\n", "cpu.core_stream_gbs.avx"),
        ("[cpu.stream_gbs]\nggml = 90.0\n", "cpu.stream_gbs.ggml"),
        ("[cpu]\ncore_stream_gbs = 3.0\n", "cpu.core_stream_gbs"),
    ],
)
def test_bad_stream_fields_name_the_key(tmp_path: Path, body: str, key: str) -> None:
    with pytest.raises(ProfileError, match=key.replace(".", r"\.")):
        load_profile(_write(tmp_path, body))


def test_a_per_core_rate_needs_a_bound_and_pytorch_needs_a_stream(tmp_path: Path) -> None:
    standalone = tmp_path / "s.toml"
    head = (
        'name = "s"\ndescription = "s"\n[gpu]\nname = "g"\nmemory_gb = 24.0\n'
        "usable_fraction = 0.9\nmem_bw_gbs = 900.0\nbf16_tflops = 100.0\n"
        'launch_overhead_us = 5.0\nworkspace_gb = 1.0\n[link]\nkind = "pcie"\n'
        "h2d_pinned_gbs = 25.0\nd2h_pinned_gbs = 25.0\nh2d_pageable_gbs = 12.0\n"
        "d2h_pageable_gbs = 9.0\ncopy_overhead_us = 6.0\ncopy_engines = 2\n"
        '[cpu]\nname = "c"\ncores_used = 8\nbf16_gflops = 500.0\nfp32_gflops = 500.0\n'
    )
    standalone.write_text(head + "[cpu.core_stream_gbs]\ntorch_bf16 = 3.0\n")
    with pytest.raises(ProfileError, match=r"cpu\.core_stream_gbs"):
        load_profile(str(standalone))
    standalone.write_text(head)
    with pytest.raises(ProfileError, match=r"cpu\.core_stream_gbs\.torch_bf16"):
        load_profile(str(standalone))
    standalone.write_text(head + "mem_bw_gbs = 20.0\n")
    cpu = load_profile(str(standalone)).cpu
    assert cpu_family_stream_gbs(cpu, "torch_fp32") == 20.0
    with pytest.raises(UserError, match="ggml"):
        cpu_family_stream_gbs(cpu, "ggml")
    standalone.write_text(
        head + "dram_gbs = 50.0\ndram_efficiency = 0.8\n[cpu.core_stream_gbs]\ntorch_bf16 = 3.0\n"
    )
    assert cpu_family_stream_gbs(load_profile(str(standalone)).cpu, "torch_bf16") == 24.0


def test_a_child_profile_restates_one_family_and_keeps_the_rest(tmp_path: Path) -> None:
    child = load_profile(_write(tmp_path, "[cpu.core_stream_gbs]\nggml = 10.0\n"))
    base = load_profile("rtx4090-pcie4")
    assert dict(child.cpu.core_stream_gbs)["ggml"] == 10.0
    assert (
        dict(child.cpu.core_stream_gbs)["torch_bf16"]
        == dict(base.cpu.core_stream_gbs)["torch_bf16"]
    )
    assert cpu_family_stream_gbs(child.cpu, "ggml") == pytest.approx(min(16 * 10.0, 0.97 * 83.2))


def test_zen3_hedt_row_reproduces_the_author_measurements() -> None:
    """Row K (the Ryzen-5975WX of ik_llama.cpp's author): one thread streams LLaMA-3.1-8B BF16 at
    1.37 t/s x 15.0 GB (PR #175); 8 threads of Q8_0 decode stream 8.21 t/s x 7.97 GB (PR #54) over
    4 channels of DDR4 (PR #411); repacked Q4_0 prompt processing runs 251.00 t/s x 14.09 GFLOP
    (PR #119)."""
    cpu = load_profile("rtx4080-5975wx-pcie4").cpu
    assert dict(cpu.core_stream_gbs)["ggml"] == pytest.approx(1.37 * 15.0, abs=0.1)
    assert cpu.dram_gbs == pytest.approx(4 * 3200 * 8 / 1000)
    assert cpu.socket_bound_gbs == pytest.approx(8.21 * 7.97, rel=0.01)
    assert cpu.ggml_gemm_gflops == pytest.approx(251.00 * 14.09, rel=0.001)
    # 32 cores reach the socket bound, as the author says his decode saturates it
    assert cpu_family_stream_gbs(cpu, "ggml") == pytest.approx(cpu.socket_bound_gbs)
    # 2 threads stay below it (PR #175: 2.53 t/s x 15.0 GB = 38 GB/s, between 1 and 2 cores)
    two = dataclasses.replace(cpu, cores_used=2)
    assert 2.53 * 15.0 <= cpu_family_stream_gbs(two, "ggml") < cpu.socket_bound_gbs


def test_strix_halo_row_is_the_mlc_read_of_its_cpu_complex() -> None:
    """Row L: Intel MLC's all-thread read-only bandwidth on a Ryzen AI Max+ 395 is 117.9 GB/s of
    the 256 GB/s LPDDR5X: the CPU streams at most that, far below what the GPU side reads."""
    hw = load_profile("framework-desktop-395")
    assert hw.cpu.socket_bound_gbs == pytest.approx(117.9, rel=0.01)
    assert cpu_family_stream_gbs(hw.cpu, "ggml") == pytest.approx(hw.cpu.socket_bound_gbs)
    assert cpu_family_stream_gbs(hw.cpu, "ggml") < 0.5 * hw.gpu.mem_bw_gbs


def test_no_profile_reads_the_retired_share_of_theoretical_as_a_measurement() -> None:
    """The retired rule wrote mem_bw_gbs = 0.40 x dram_gbs, which the CPU-stream rule now reads as
    a measured override: no bundled profile may carry that product."""
    for name in PROFILES:
        cpu = load_profile(name).cpu
        if cpu.mem_bw_gbs is not None and cpu.dram_gbs is not None:
            assert cpu.mem_bw_gbs != pytest.approx(0.40 * cpu.dram_gbs, rel=0.01), name
