"""``daopsim probe``: its parsers on recorded outputs, detection on a fake machine, the profiles it
writes (valid, every number tagged with how it was obtained, usable by ``run``), its refusals,
and its GPU path run on the CPU stand-in (the GPU path is unverified on real GPUs)."""

from __future__ import annotations

import re
import sys
import tomllib
import types
from pathlib import Path
from typing import Any

import pytest

from daopsim.simulator.errors import UserError
from daopsim.simulator.hardware import read_profile
from daopsim.simulator.hardware_schema import parse_profile
from daopsim.simulator.probe import (
    ProbeOptions,
    ProbeResult,
    detect_cpu,
    detect_gpu,
    hardware_toml,
    memory_channels,
    output_paths,
    parse_dmidecode_memory,
    parse_lscpu,
    parse_meminfo,
    parse_proc_cpuinfo,
    parse_size,
    read_sys_caches,
    runtime_toml,
    theoretical_dram_gbs,
    write_probe,
)
from daopsim.simulator.runtime_profiles import parse_runtime, read_runtime

FIX = Path(__file__).parent / "fixtures" / "probe"
VM = FIX / "epyc-vm"


def test_sizes_as_the_os_writes_them() -> None:
    assert parse_size("32 MiB (1 instance)") == 32 << 20
    assert parse_size("32768K") == 32 << 20
    assert parse_size("24683772 kB") == 24683772 << 10
    assert parse_size("16 GB") == 16 << 30
    assert parse_size("1.5 MiB") == int(1.5 * (1 << 20))
    assert parse_size("") is None and parse_size("unknown") is None


def test_recorded_lscpu_cpuinfo_meminfo_and_caches() -> None:
    ls = parse_lscpu((VM / "lscpu.txt").read_text())
    assert ls["model_name"] == "AMD EPYC" and ls["sockets"] == 1
    assert ls["cores_per_socket"] == 2 and ls["threads_per_core"] == 1 and ls["logical"] == 2
    assert ls["l3_bytes"] == 32 << 20 and ls["l2_bytes"] == 2 << 20  # all instances together
    info = parse_proc_cpuinfo((VM / "proc" / "cpuinfo").read_text())
    assert info["logical"] == 2 and info["sockets"] == 1 and info["cores_per_socket"] == 2
    assert info["vendor"] == "AuthenticAMD" and "avx512f" in info["flags"]
    assert parse_meminfo((VM / "proc" / "meminfo").read_text()) == 24683772 << 10
    # one instance per level: the level-2 cache of one core, not lscpu's total
    assert read_sys_caches(VM) == {1: 32 << 10, 2: 1 << 20, 3: 32 << 20}


def test_dimms_channels_and_theoretical_bandwidth() -> None:
    dimms = parse_dmidecode_memory((FIX / "dmidecode-2ch-ddr4.txt").read_text())
    assert len(dimms) == 2  # the two empty slots are left out
    assert {d["channel"] for d in dimms} == {"A", "B"}
    assert all(d["configured_mts"] == 3200 and d["speed_mts"] == 3600 for d in dimms)
    assert memory_channels(dimms) == 2
    # 2 channels x 3200 MT/s x 8 B, at the configured (not the rated) speed
    assert theoretical_dram_gbs(dimms, 2) == pytest.approx(51.2)
    assert theoretical_dram_gbs(dimms, None) is None
    assert parse_dmidecode_memory((FIX / "dmidecode-no-root.txt").read_text()) == []
    # two DIMMs on one channel: one channel, not two
    one = [dict(d, channel="A") for d in dimms]
    assert memory_channels(one) == 1
    assert memory_channels([dict(d, channel=None) for d in dimms]) is None


def _runner(outputs: dict[str, tuple[int, str]]) -> Any:
    def run(argv: list[str]) -> tuple[int, str]:
        return outputs.get(argv[0], (-1, f"{argv[0]} is not installed"))

    return run


def test_detection_on_a_recorded_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cpuinfo", None)  # py-cpuinfo absent: the OS's name
    monkeypatch.setitem(sys.modules, "psutil", None)
    res = ProbeResult()
    run = _runner(
        {
            "lscpu": (0, (VM / "lscpu.txt").read_text()),
            "dmidecode": (0, (FIX / "dmidecode-2ch-ddr4.txt").read_text()),
        }
    )
    detect_cpu(res, VM, run)
    assert res.value("cpu.name") == "AMD EPYC" and res.entries["cpu.name"].how == "detected"
    assert res.value("cpu.cores") == 2 and res.value("cpu.sockets") == 1
    assert res.value("cpu.l3_bytes") == 32 << 20
    assert res.value("cpu.memory_bytes") == 24683772 << 10
    assert res.value("cpu.dram_gbs") == pytest.approx(51.2)
    assert res.entries["cpu.dram_gbs"].how == "derived"
    assert "avx512f" in res.value("cpu.isa")


def test_without_root_the_dimm_fields_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    res = ProbeResult()
    run = _runner(
        {
            "lscpu": (0, (VM / "lscpu.txt").read_text()),
            "dmidecode": (1, (FIX / "dmidecode-no-root.txt").read_text()),
        }
    )
    detect_cpu(res, VM, run)
    missing = res.not_measured()
    assert "Permission denied" in missing["cpu.dimms"] and "root" in missing["cpu.dimms"]
    assert "cpu.dram_gbs" in missing


def test_a_machine_it_cannot_read_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "cpuinfo", None)
    monkeypatch.setattr("platform.processor", lambda: "")
    with pytest.raises(UserError) as err:
        detect_cpu(ProbeResult(), tmp_path, _runner({}))
    assert "cannot read this machine's CPU" in str(err.value)
    assert "\n" not in str(err.value)


class _FakeNvml(types.ModuleType):
    """NVML as nvidia-ml-py exposes it, for one RTX 4090 on a Gen4 x16 link."""

    def __init__(self) -> None:
        super().__init__("pynvml")

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA GeForce RTX 4090"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return types.SimpleNamespace(total=25757220864)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return 4

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return 16


def test_gpu_detection_through_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml())
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
    res = ProbeResult()
    assert detect_gpu(res, fake_torch)
    assert res.value("gpu.name") == "NVIDIA GeForce RTX 4090"
    assert res.value("gpu.memory_bytes") == 25757220864 and res.value("gpu.pcie") == "Gen4 x16"
    # no NVML and no CUDA: the CPU stands in, and the result says so
    monkeypatch.setitem(sys.modules, "pynvml", None)
    res = ProbeResult()
    assert not detect_gpu(res, None)
    assert "stands in" in res.not_measured()["gpu.name"]


def _standin_result(model: Any = None) -> ProbeResult:
    """A probe of a CPU stand-in with plausible measured values (the writers' input)."""
    r = ProbeResult(model=model)
    r.versions.update(torch="2.13.0+cpu", transformers="5.25.0")
    put = r.put
    put("cpu.name", "AMD EPYC", "", "detected", "lscpu")
    put("cpu.cores", 2, "", "detected", "psutil")
    put("cpu.threads", 2, "", "detected", "os.cpu_count()")
    put("cpu.usable_threads", 2, "", "detected", "affinity")
    put("cpu.l3_bytes", 32 << 20, "B", "detected", "/sys")
    put("cpu.memory_bytes", 24e9, "B", "detected", "meminfo")
    put("cpu.dram_gbs", None, "GB/s", "not measured", "needs root")
    for t, v in ((1, 15.0), (2, 20.0)):
        put(f"cpu.stream_gbs.torch_fp32.t{t}", v, "GB/s", "measured", "linear")
        put(f"cpu.gemm_gflops.fp32.t{t}", 70.0 * t, "GFLOPS", "measured", "mm")
    put("cpu.read_gbs", 22.0, "GB/s", "measured", "sum")
    put("standin.gemv_gbs", 15.0, "GB/s", "measured", "linear, one thread")
    put("standin.gemm_gflops", 75.0, "GFLOPS", "measured", "mm, one thread")
    put("standin.copy_gbs", 13.0, "GB/s", "measured", "copy_, one thread")
    put("host.copy_call_us", 0.9, "us", "measured", "copy_ of one row")
    for k, v in (
        ("step_host_us", 300.0),
        ("attention_host_us", 160.0),
        ("norm_host_us", 20.0),
        ("router_host_us", 15.0),
        ("layer_glue_host_us", 60.0),
        ("expert_host_us", 60.0),
    ):
        put(f"runtime.{k}", v, "us", "measured", f"{k} at hidden 64")
    return r


def _tags_everywhere(text: str) -> None:
    """Every line that sets a number says how it was obtained."""
    for line in text.splitlines():
        if re.match(r"^\w+ = [\d.]", line):
            assert re.search(r"# \[(M|X|D|A)\] \S", line), line


def test_standin_profiles_are_valid_and_say_how(tmp_path: Path) -> None:
    res = _standin_result()
    hw = hardware_toml(res, "my-box")
    prof = parse_profile(tomllib.loads(hw), tmp_path / "my-box.toml")
    _tags_everywhere(hw)
    assert prof.link.unified and prof.link.copy_engines == 1
    assert prof.gpu.launch_overhead_us == 0.0  # its kernels' calls are host time
    assert prof.gpu.mem_bw_gbs == 15.0 and prof.gpu.bf16_tflops == pytest.approx(0.075)
    assert prof.cpu.cores_used == 2 and prof.cpu.fp32_gflops == 140.0
    assert "[M]" in hw and "stands in for a GPU" in hw
    assert "dram_gbs: not readable here" in hw  # left out, with the reason
    rt = parse_runtime(tomllib.loads(runtime_toml(res, "my-box.runtime")), "rt")
    assert rt.host_device and rt.free  # no host thread beside a device that is the host
    assert rt.block_host_us == pytest.approx(160 + 2 * 20 + 15 + 60)
    assert all(v.startswith("measured:") for k, v in rt.sources.items() if k.endswith("_us"))


def test_written_files_run_and_bundled_names_are_refused(tmp_path: Path) -> None:
    from daopsim import simulate

    paths = write_probe(_standin_result(), tmp_path, "my-box")
    assert {p.name for p in paths.values()} == {
        "my-box.toml",
        "my-box.runtime.toml",
        "my-box.probe.json",
    }
    hw = read_profile(paths["hardware"])
    rt = read_runtime(paths["runtime"])
    r = simulate(
        policy="all-gpu", hw=hw, trace="olmoe-1b-7b", sequences=1, runtime=rt, record=False
    )
    assert r.metrics["tokens_per_s"] > 0
    with pytest.raises(UserError, match="bundled profile"):
        output_paths(tmp_path, "a6000-pcie4")
    from daopsim.simulator.data import profiles_dir

    with pytest.raises(UserError, match="bundled profiles' folder"):
        output_paths(profiles_dir(), "mine")
    with pytest.raises(UserError, match="bundled profiles' folder"):
        output_paths(profiles_dir() / "runtimes", "mine")


def test_run_accepts_the_probed_files_on_the_command_line(cli: Any, tmp_path: Path) -> None:
    paths = write_probe(_standin_result(), tmp_path, "my-box")
    result = cli(
        "run",
        "--policy",
        "lru",
        "--hw",
        str(paths["hardware"]),
        "--runtime",
        str(paths["runtime"]),
        "--trace",
        "olmoe-1b-7b",
        "--sequences",
        "1",
        "--no-progress",
        "--no-bounds",
        "--json",
    )
    assert result.exit_code == 0, result.output
    assert '"host_device": true' in result.output


def test_gpu_path_runs_on_its_cpu_stand_in() -> None:
    """The GPU measurements, run with device "cpu" (no GPU here: unverified on real GPUs),
    give every figure the GPU profile needs, and the writers make valid profiles of them."""
    torch = pytest.importorskip("torch")
    from daopsim.simulator.probe import measure_gpu

    res = _standin_result()
    measure_gpu(res, torch, ProbeOptions(quick=True, repeats=1), lambda: None, device="cpu")
    for key in (
        "gpu.stream_gbs",
        "gpu.gemm_tflops",
        "gpu.dispatch_us",
        "gpu.sync_us",
        "gpu.copy_us",
        "link.h2d_pinned_gbs",
        "link.d2h_pageable_gbs",
    ):
        assert res.value(key) > 0, key
    res.device = "cuda"
    res.put("gpu.name", "NVIDIA GeForce RTX 4090", "", "detected", "NVML")
    res.put("gpu.memory_bytes", 25757220864, "B", "detected", "NVML")
    hw = hardware_toml(res, "gpu-box")
    prof = parse_profile(tomllib.loads(hw), "gpu-box.toml")
    assert prof.link.kind == "pcie" and "unverified" in hw
    _tags_everywhere(hw)
    rt = parse_runtime(tomllib.loads(runtime_toml(res, "gpu-box.runtime")), "rt")
    assert not rt.host_device and rt.dispatch_us > 0 and rt.nonexpert_kernels > 0


def test_without_pytorch_numpy_measures_what_it_can(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No PyTorch: a hardware profile from numpy's one-thread streams and BLAS matmul, no
    runtime profile, and the JSON says what could not be measured and why."""
    import json

    from daopsim.simulator import probe_bench
    from daopsim.simulator.probe import run_probe

    monkeypatch.setattr(probe_bench, "load_torch", lambda: None)
    res = run_probe(ProbeOptions(quick=True, repeats=1, device="cpu"))
    paths = write_probe(res, tmp_path, "no-torch")
    assert set(paths) == {"hardware", "json"}
    prof = read_profile(paths["hardware"])
    assert prof.cpu.mem_bw_gbs > 0 and prof.gpu.mem_bw_gbs > 0
    missing = json.loads(paths["json"].read_text())["not_measured"]
    assert "PyTorch" in missing["runtime"] and "PyTorch" in missing["cpu.stream_gbs"]
