"""``daopsim probe``: describe this machine by measuring it.

The probe detects the parts (CPU model, sockets, cores, threads, caches, memory and, where the
OS lets it read them, the DIMMs; a GPU through NVML or PyTorch), then measures what the cost
model charges with short microbenchmarks (``daopsim.simulator.probe_bench``,
``daopsim.simulator.probe_modules``), and writes two profiles and the raw figures:

* ``NAME.toml``, a hardware profile (docs/hardware-profiles.md). Without a GPU its ``[gpu]``
  is the CPU itself running PyTorch on one thread, the device of ``daopsim check``'s closed
  loop, and its ``[link]`` a copy between two pools of host memory (``kind = "unified"``: one
  DRAM); ``[cpu]`` is the host CPU on all its cores. With ``--model``, a
  ``[measured."<model>"]`` table holds the device times of that model's own modules.
* ``NAME.runtime.toml``, a runtime profile (docs/cost-model.md, "Runtime profiles"): PyTorch
  eager's host time per module on this machine.
* ``NAME.probe.json``: every figure with its unit, how it was obtained (``measured`` and the
  method, ``derived`` from what, ``spec``, ``detected``) and its raw timings; what could not
  be measured here is listed with the reason.

Every number written says how it was obtained, in a comment tag: ``[M]`` measured (method),
``[X]`` detected (read from the OS), ``[D]`` derived (formula), ``[A]`` assumption.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import shutil
import subprocess
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daopsim.simulator.errors import UserError
from daopsim.simulator.runtime_profiles import HOST_DEVICE_FIELDS

#: a probe's output files, by role (``NAME`` replaced)
FILES = {"hardware": "{name}.toml", "runtime": "{name}.runtime.toml", "json": "{name}.probe.json"}


@dataclass
class Entry:
    """One figure of the probe: its value, unit, how it was obtained and the method."""

    value: Any
    unit: str
    how: str  # measured | detected | derived | spec | not measured
    method: str
    raw: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the probe's JSON)."""
        out = {"value": self.value, "unit": self.unit, "how": self.how, "method": self.method}
        if self.raw is not None:
            out["raw"] = self.raw
        return out


@dataclass
class ProbeResult:
    """Everything one probe found, by key (``cpu.name``, ``standin.gemv_gbs``, ...)."""

    entries: dict[str, Entry] = field(default_factory=dict)
    model: Any = None  # the LoopShape of --model
    device: str = "cpu"
    versions: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0
    quick: bool = False

    def put(
        self,
        key: str,
        value: Any,
        unit: str,
        how: str,
        method: str,
        raw: dict[str, Any] | None = None,
    ) -> None:
        """Record one figure."""
        self.entries[key] = Entry(value, unit, how, method, raw)

    def value(self, key: str, default: Any = None) -> Any:
        """A figure's value (``default`` when absent or not measured)."""
        e = self.entries.get(key)
        return default if e is None or e.value is None else e.value

    def not_measured(self) -> dict[str, str]:
        """The figures that could not be obtained here, with the reason."""
        return {k: e.method for k, e in self.entries.items() if e.how == "not measured"}

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``probe --json`` and ``NAME.probe.json``)."""
        return {
            "device": self.device,
            "quick": self.quick,
            "elapsed_s": self.elapsed_s,
            "versions": self.versions,
            "model": None if self.model is None else self.model.to_dict(),
            "entries": {k: e.to_dict() for k, e in sorted(self.entries.items())},
            "not_measured": self.not_measured(),
        }


# --------------------------------------------------------------------------------------------
# parsers of what the OS says (unit-tested with recorded outputs: tests/fixtures/probe/)
# --------------------------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGT]?)(i?B)?", re.IGNORECASE)
_CHANNEL = re.compile(r"channel[\s_-]*([A-Z0-9]+)", re.IGNORECASE)


def parse_size(text: str) -> int | None:
    """Bytes of a size as lscpu, /sys and /proc write them (``32 MiB (1 instance)``,
    ``32768K``, ``1024 kB``, ``16 GB``); None when unreadable. K, M, G, T are binary."""
    m = _SIZE.match(text or "")
    if m is None:
        return None
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m[2].upper()]
    return int(float(m[1]) * mult)


def parse_key_values(text: str, sep: str = ":") -> dict[str, str]:
    """``key: value`` lines (lscpu, one /proc/cpuinfo block) into a dict, first key wins."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, s, value = line.partition(sep)
        if s and key.strip() and key.strip() not in out:
            out[key.strip()] = value.strip()
    return out


def parse_proc_cpuinfo(text: str) -> dict[str, Any]:
    """Model name, vendor, logical CPUs, sockets, cores per socket and flags from
    /proc/cpuinfo (x86 and most others; missing fields are left out)."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    if not blocks:
        return {}
    first = parse_key_values(blocks[0])
    out: dict[str, Any] = {"logical": len(blocks)}
    name = first.get("model name") or first.get("Model") or first.get("cpu model")
    if name:
        out["model_name"] = name
    if "vendor_id" in first:
        out["vendor"] = first["vendor_id"]
    sockets = {parse_key_values(b).get("physical id") for b in blocks} - {None}
    if sockets:
        out["sockets"] = len(sockets)
    if "cpu cores" in first:
        out["cores_per_socket"] = int(first["cpu cores"])
    flags = first.get("flags") or first.get("Features")
    if flags:
        out["flags"] = flags.split()
    return out


def parse_lscpu(text: str) -> dict[str, Any]:
    """Model name, sockets, cores per socket, threads per core, CPUs and cache sizes (bytes,
    all instances together) from ``lscpu``."""
    kv = parse_key_values(text)
    out: dict[str, Any] = {}
    if kv.get("Model name"):
        out["model_name"] = kv["Model name"]
    for key, name in (
        ("Socket(s)", "sockets"),
        ("Core(s) per socket", "cores_per_socket"),
        ("Thread(s) per core", "threads_per_core"),
        ("CPU(s)", "logical"),
    ):
        if kv.get(key, "").isdigit():
            out[name] = int(kv[key])
    for key, name in (("L1d cache", "l1d"), ("L2 cache", "l2"), ("L3 cache", "l3")):
        size = parse_size(kv.get(key, ""))
        if size:
            out[f"{name}_bytes"] = size
    return out


def parse_meminfo(text: str) -> int | None:
    """Bytes of installed memory (``MemTotal``) from /proc/meminfo."""
    value = parse_key_values(text).get("MemTotal")
    return parse_size(value) if value else None


def parse_dmidecode_memory(text: str) -> list[dict[str, Any]]:
    """The populated memory devices of ``dmidecode -t memory``: size (GB), type, rated and
    configured speed (MT/s), locator. Empty slots are left out."""
    dimms = []
    for block in text.split("\n\n"):
        if "Memory Device" not in block:
            continue
        kv = parse_key_values(block)
        size = kv.get("Size", "")
        if not size or size.lower().startswith(("no module", "not installed", "unknown")):
            continue
        nbytes = parse_size(size)

        def mts(key: str, kv: dict[str, str] = kv) -> int | None:
            m = re.match(r"(\d+)\s*(MT/s|MHz)", kv.get(key, ""))
            return int(m[1]) if m else None

        where = f"{kv.get('Bank Locator', '')} {kv.get('Locator', '')}"
        chan = _CHANNEL.search(where)
        dimms.append(
            {
                "channel": chan[1].upper() if chan else None,
                "size_gb": None if nbytes is None else nbytes / 1e9,
                "type": kv.get("Type"),
                "speed_mts": mts("Speed"),
                "configured_mts": mts("Configured Memory Speed") or mts("Configured Clock Speed"),
                "locator": kv.get("Locator"),
                "bank": kv.get("Bank Locator"),
            }
        )
    return dimms


def memory_channels(dimms: list[dict[str, Any]]) -> int | None:
    """Populated memory channels: the distinct channel names of the DIMMs' locators (``P0
    CHANNEL A``, ``ChannelB-DIMM0``, ``_Channel1_``) when every DIMM names one, else None."""
    names = [d.get("channel") for d in dimms]
    if not names or any(n is None for n in names):
        return None
    return len(set(names))


def read_sys_caches(root: Path = Path("/")) -> dict[int, int]:
    """Largest data or unified cache size per level (bytes) of CPU 0, from
    ``/sys/devices/system/cpu/cpu0/cache/index*``."""
    base = root / "sys/devices/system/cpu/cpu0/cache"
    out: dict[int, int] = {}
    for idx in sorted(base.glob("index*")):
        try:
            level = int((idx / "level").read_text().strip())
            kind = (idx / "type").read_text().strip()
            size = parse_size((idx / "size").read_text().strip())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and size:
            out[level] = max(out.get(level, 0), size)
    return out


def theoretical_dram_gbs(dimms: list[dict[str, Any]], channels: int | None) -> float | None:
    """Channels x MT/s x 8 B (the configured speed of the slowest DIMM) when both are known."""
    speeds = [d.get("configured_mts") or d.get("speed_mts") for d in dimms]
    speeds = [s for s in speeds if s]
    if not speeds or not channels:
        return None
    return channels * min(speeds) * 8 / 1e3


# --------------------------------------------------------------------------------------------
# detection
# --------------------------------------------------------------------------------------------
def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _run(argv: list[str], timeout: float = 10.0) -> tuple[int, str]:
    """(exit code, stdout+stderr) of a command; (-1, reason) when it cannot run."""
    if shutil.which(argv[0]) is None:
        return -1, f"{argv[0]} is not installed"
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return -1, str(exc)
    return p.returncode, (p.stdout or "") + (p.stderr or "")


def detect_cpu(
    res: ProbeResult, root: Path = Path("/"), run: Callable[[list[str]], tuple[int, str]] = _run
) -> None:
    """The CPU and memory: model, sockets, cores, threads, caches, memory, DIMMs. A machine
    whose CPU cannot be read at all is a one-line ``UserError``."""
    info = parse_proc_cpuinfo(_read(root / "proc/cpuinfo") or "")
    code, text = run(["lscpu"])
    ls = parse_lscpu(text) if code == 0 else {}
    name, src = _cpu_name(info, ls)
    logical = os.cpu_count()
    if not name or not logical:
        raise UserError(
            "probe: cannot read this machine's CPU (no /proc/cpuinfo, lscpu or platform "
            "name); describe it by hand from a bundled profile (docs/hardware-profiles.md)"
        )
    res.put("cpu.name", name, "", "detected", src)
    _detect_cores(res, info, ls, logical)
    _detect_caches(res, root, info, ls)
    _detect_memory(res, root, run)


def _cpu_name(info: dict[str, Any], ls: dict[str, Any]) -> tuple[str | None, str]:
    """The CPU's name and where it was read: lscpu's or /proc/cpuinfo's, py-cpuinfo's brand
    when longer, else the platform's."""
    name = ls.get("model_name") or info.get("model_name")
    src = "lscpu" if ls.get("model_name") else "/proc/cpuinfo"
    try:
        import cpuinfo  # py-cpuinfo

        brand = cpuinfo.get_cpu_info().get("brand_raw")
        if brand and (not name or len(brand) > len(name)):
            name, src = brand, "py-cpuinfo"
    except Exception:  # optional; any failure leaves the OS's name
        pass
    if not name:
        name = platform.processor() or None
        src = "platform.processor()"
    return name, src


def _detect_cores(res: ProbeResult, info: dict[str, Any], ls: dict[str, Any], logical: int) -> None:
    """Sockets, physical cores, threads and the threads this process may use."""
    sockets = ls.get("sockets") or info.get("sockets") or 1
    res.put("cpu.sockets", sockets, "", "detected", "lscpu Socket(s) / /proc/cpuinfo physical id")
    per = ls.get("cores_per_socket") or info.get("cores_per_socket")
    cores = per * sockets if per else None
    try:
        import psutil

        cores = psutil.cpu_count(logical=False) or cores
    except ImportError:
        pass
    res.put(
        "cpu.cores",
        cores or logical,
        "",
        "detected",
        "psutil.cpu_count(logical=False), else lscpu cores per socket x sockets",
    )
    res.put("cpu.threads", logical, "", "detected", "os.cpu_count()")
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = logical
    res.put(
        "cpu.usable_threads",
        usable,
        "",
        "detected",
        "os.sched_getaffinity(0): the CPUs this process may run on",
    )


def _detect_caches(res: ProbeResult, root: Path, info: dict[str, Any], ls: dict[str, Any]) -> None:
    """Cache sizes (one instance of each level) and the vector instruction sets."""
    caches = read_sys_caches(root)
    for level, key in ((1, "l1d"), (2, "l2"), (3, "l3")):
        size = caches.get(level) or ls.get(f"{key}_bytes")
        if size:
            res.put(
                f"cpu.{key}_bytes",
                size,
                "B",
                "detected",
                "/sys/devices/system/cpu/cpu0/cache (one instance), else lscpu",
            )
    flags = set(info.get("flags", []))
    isa = [
        f
        for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma", "neon")
        if f in flags
    ]
    res.put("cpu.isa", isa, "", "detected", "/proc/cpuinfo flags")


def _detect_memory(
    res: ProbeResult, root: Path, run: Callable[[list[str]], tuple[int, str]]
) -> None:
    """Installed memory, and from dmidecode the DIMMs, channels and theoretical DRAM
    bandwidth (said to be not measured where dmidecode cannot read them)."""
    mem = None
    try:
        import psutil

        mem, how = psutil.virtual_memory().total, "psutil.virtual_memory().total"
    except ImportError:
        mem, how = parse_meminfo(_read(root / "proc/meminfo") or ""), "/proc/meminfo MemTotal"
    if mem:
        res.put("cpu.memory_bytes", mem, "B", "detected", how)
    code, text = run(["dmidecode", "-t", "memory"])
    dimms = parse_dmidecode_memory(text) if code == 0 else []
    if dimms:
        res.put("cpu.dimms", dimms, "", "detected", "dmidecode -t memory")
        channels = memory_channels(dimms)
        res.put(
            "cpu.memory_channels",
            channels,
            "",
            "detected" if channels else "not measured",
            "distinct channel names in the DIMMs' locators"
            if channels
            else "the DIMMs' locators name no channel",
        )
        dram = theoretical_dram_gbs(dimms, channels)
        res.put(
            "cpu.dram_gbs",
            dram,
            "GB/s",
            "derived" if dram else "not measured",
            "populated channels x the slowest DIMM's configured MT/s x 8 B"
            if dram
            else "dmidecode gave no speeds or no channels",
        )
    else:
        why = text.strip().splitlines()[-1] if text.strip() else "no output"
        res.put(
            "cpu.dimms",
            None,
            "",
            "not measured",
            f"DIMM speed and channels are not readable here (dmidecode: {why}); run "
            "`sudo dmidecode -t memory` to read them (root is needed on most systems)",
        )
        res.put(
            "cpu.dram_gbs",
            None,
            "GB/s",
            "not measured",
            "theoretical DRAM bandwidth needs the DIMM speed and channel count",
        )


def detect_gpu(res: ProbeResult, torch: Any) -> bool:
    """A GPU through NVML (nvidia-ml-py) or PyTorch; True when one is usable by PyTorch."""
    usable = bool(torch is not None and torch.cuda.is_available())
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else name
        mem = pynvml.nvmlDeviceGetMemoryInfo(h).total
        res.put("gpu.name", name, "", "detected", "NVML nvmlDeviceGetName")
        res.put("gpu.memory_bytes", int(mem), "B", "detected", "NVML nvmlDeviceGetMemoryInfo")
        try:
            gen = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)
            width = pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)
            res.put(
                "gpu.pcie",
                f"Gen{gen} x{width}",
                "",
                "detected",
                "NVML max PCIe link generation and width",
            )
        except Exception:  # older drivers lack the link queries
            pass
        return usable
    except Exception:  # no NVML, no driver, no GPU: PyTorch may still see one
        pass
    if usable:
        props = torch.cuda.get_device_properties(0)
        res.put("gpu.name", props.name, "", "detected", "torch.cuda.get_device_properties")
        res.put(
            "gpu.memory_bytes",
            int(props.total_memory),
            "B",
            "detected",
            "torch.cuda.get_device_properties(0).total_memory",
        )
    else:
        res.put(
            "gpu.name",
            None,
            "",
            "not measured",
            "no GPU visible (NVML and torch.cuda found none): the CPU stands in",
        )
    return usable


# --------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------
@dataclass
class ProbeOptions:
    """What to measure: ``quick`` (fewer repeats, no thread sweep, no extra precisions),
    ``model`` (a LoopShape whose modules to time), ``tokens`` (their token counts),
    ``device`` (``auto``, ``cpu``: the CPU stands in even with a GPU, ``cuda``)."""

    quick: bool = False
    model: Any = None
    tokens: tuple[int, ...] | None = None
    device: str = "auto"
    repeats: int | None = None


#: the weight-stream matrix of the generic figures (one decode-step linear)
STREAM_SHAPE = (4096, 4096)
#: bytes of the generic copy (about one mid-size expert)
COPY_BYTES = 16e6


def _thread_counts(usable: int) -> list[int]:
    out, t = [], 1
    while t < usable:
        out.append(t)
        t *= 2
    out.append(usable)
    return out


def measure_cpu(res: ProbeResult, torch: Any, opts: ProbeOptions, tick: Callable[[], None]) -> None:
    """The host CPU: weight streams per precision at 1, 2, 4, ... all threads, an all-core
    read stream, GEMM rates (and with no torch, what numpy can)."""
    from daopsim.simulator import probe_bench as pb

    llc = res.value("cpu.l3_bytes")
    reps = opts.repeats or (2 if opts.quick else 3)
    usable = int(res.value("cpu.usable_threads", 1))
    cores = int(min(res.value("cpu.cores", usable), usable))
    if torch is None:
        _measure_numpy(res, llc, reps)
        tick()
        return
    precisions = ["fp32"] if opts.quick else ["fp32", "bf16"]
    counts = [1, cores] if opts.quick else _thread_counts(cores)
    for dtype in precisions:
        for t_n in sorted(set(counts)):
            gbs, t = pb.gemv_stream(torch, dtype, t_n, STREAM_SHAPE, llc, reps)
            res.put(
                f"cpu.stream_gbs.torch_{dtype}.t{t_n}",
                gbs,
                "GB/s",
                "measured",
                f"torch.nn.functional.linear of one {dtype} row against "
                f"{STREAM_SHAPE[0]}x{STREAM_SHAPE[1]} {dtype} weights, pool of 4x the LLC, "
                f"{t_n} thread(s), {t.clock} time, min of {t.repeats}",
                t.to_dict(),
            )
            tick()
    if not opts.quick:
        _measure_int8_stream(res, torch, sorted({1, cores}), llc, reps)
        tick()
    res.put(
        "cpu.stream_gbs.ggml",
        None,
        "GB/s",
        "not measured",
        "ggml (llama.cpp) kernels are not part of this Python stack; measure a CPU-only "
        "llama.cpp decode (bytes per token x tokens/s) to set it",
    )
    gbs, t = pb.read_stream(torch, cores, max(512e6, 8 * (llc or 0)), reps)
    res.put(
        "cpu.read_gbs",
        gbs,
        "GB/s",
        "measured",
        f"torch sum over a 512 MB fp32 buffer on {cores} thread(s), wall time, min of "
        f"{t.repeats} (STREAM-like read)",
        t.to_dict(),
    )
    tick()
    for dtype in precisions:
        for t_n in sorted({1, cores}):
            gf, t = pb.gemm_rate(torch, dtype, t_n, 1024 if opts.quick else 2048, reps)
            res.put(
                f"cpu.gemm_gflops.{dtype}.t{t_n}",
                gf,
                "GFLOPS",
                "measured",
                f"torch.mm of two square {dtype} matrices ({'1024' if opts.quick else '2048'}),"
                f" {t_n} thread(s), {t.clock} time, min of {t.repeats}",
                t.to_dict(),
            )
    tick()


def _measure_int8_stream(
    res: ProbeResult, torch: Any, counts8: list[int], llc: float | None, reps: int
) -> None:
    """The dynamic int8 linear's weight stream at each thread count (not measured where the
    PyTorch build has no such kernel)."""
    from daopsim.simulator import probe_bench as pb

    got = pb.int8_stream(torch, counts8, STREAM_SHAPE, llc, reps)
    for t_n in counts8:
        if got is None:
            res.put(
                f"cpu.stream_gbs.torch_int8.t{t_n}",
                None,
                "GB/s",
                "not measured",
                "this PyTorch build has no dynamic int8 linear kernel",
            )
            continue
        gbs, t = got[t_n]
        res.put(
            f"cpu.stream_gbs.torch_int8.t{t_n}",
            gbs,
            "GB/s",
            "measured",
            "torch.ao.nn.quantized.dynamic.Linear (int8 weights, per-row scale) on one "
            f"row, pool of 4x the LLC, {t_n} thread(s), {t.clock} time",
            t.to_dict(),
        )


def _measure_numpy(res: ProbeResult, llc: float | None, reps: int) -> None:
    """Without PyTorch: what numpy measures on one thread (a read stream, a copy, an fp32
    GEMM through its BLAS); the rest is listed as not measured."""
    import time as _time

    import numpy as np

    from daopsim.simulator import probe_bench as pb

    why = "needs PyTorch (pip install 'daopsim[capture]')"
    how = "one thread, thread CPU time, min of repeats (no PyTorch: numpy)"
    gbs, t = pb.numpy_read_stream(max(pb.MIN_POOL_BYTES, 4 * (llc or 0)), reps)
    res.put(
        "cpu.read_gbs.t1", gbs, "GB/s", "measured", f"numpy sum over 4x the LLC, {how}", t.to_dict()
    )
    res.put(
        "standin.gemv_gbs",
        gbs,
        "GB/s",
        "measured",
        f"numpy sum over 4x the LLC (a read stream: no PyTorch linear to time), {how}",
        t.to_dict(),
    )
    gbs, t = pb.numpy_copy_rate(COPY_BYTES, llc, reps)
    res.put(
        "standin.copy_gbs",
        gbs,
        "GB/s",
        "measured",
        f"numpy.copyto of 16 MB from a pool of 4x the LLC, {how}",
        t.to_dict(),
    )
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)

    def one() -> float:
        t0 = _time.perf_counter()
        a @ a
        return _time.perf_counter() - t0

    t = pb.timed(one, reps)
    gf = 2 * 1024**3 / t.best / 1e9
    res.put(
        "cpu.gemm_gflops.numpy",
        gf,
        "GFLOPS",
        "measured",
        "numpy matmul of two 1024x1024 fp32 matrices (its BLAS's own threads), wall time, "
        "min of repeats",
        t.to_dict(),
    )
    res.put(
        "standin.gemm_gflops", gf, "GFLOPS", "measured", "as cpu.gemm_gflops.numpy", t.to_dict()
    )
    res.put("host.copy_call_us", 1.0, "us", "not measured", f"{why}; 1 us assumed")
    for key in ("cpu.stream_gbs", "cpu.gemm_gflops.bf16", "host.small_op_us", "runtime"):
        res.put(key, None, "", "not measured", why)


def measure_standin(
    res: ProbeResult, torch: Any, opts: ProbeOptions, tick: Callable[[], None]
) -> None:
    """The CPU as the closed loop's device (one PyTorch thread) and its link (copies between
    two pools of host memory), and the host costs of single calls."""
    from daopsim.simulator import probe_bench as pb

    llc = res.value("cpu.l3_bytes")
    reps = opts.repeats or (2 if opts.quick else 3)
    dtype = opts.model.dtype if opts.model is not None else "fp32"
    gbs, t = pb.gemv_stream(torch, dtype, 1, STREAM_SHAPE, llc, reps)
    res.put(
        "standin.gemv_gbs",
        gbs,
        "GB/s",
        "measured",
        f"one thread: torch.nn.functional.linear of one {dtype} row against "
        f"{STREAM_SHAPE[0]}x{STREAM_SHAPE[1]} weights, pool of 4x the LLC, thread CPU time, "
        f"min of {t.repeats}",
        t.to_dict(),
    )
    gf, t = pb.gemm_rate(torch, dtype, 1, 1024, reps)
    res.put(
        "standin.gemm_gflops",
        gf,
        "GFLOPS",
        "measured",
        f"one thread: torch.mm of two 1024x1024 {dtype} matrices, thread CPU time, min of "
        f"{t.repeats}",
        t.to_dict(),
    )
    nbytes = opts.model.expert_bytes if opts.model is not None else COPY_BYTES
    gbs, t = pb.copy_rate(torch, nbytes, llc, reps)
    what = "one expert of the model" if opts.model is not None else "16 MB"
    res.put(
        "standin.copy_gbs",
        gbs,
        "GB/s",
        "measured",
        f"one thread: Tensor.copy_ of {what} ({nbytes / 1e6:.2f} MB) from a pool of 4x the "
        f"LLC into one of two buffers, thread CPU time, min of {t.repeats}",
        t.to_dict(),
    )
    tick()
    calls = pb.host_calls(torch, reps, calls=500 if opts.quick else 2000)
    what = {
        "small_op": "an add of two 1x64 fp32 rows",
        "module_call": "an empty nn.Module call (nn.Identity)",
        "linear_module": "an nn.Linear(64, 64) module call on one row",
        "copy_call": "a copy_ of one 1x64 row",
        "item": "reading one value back to Python (.item(); on a GPU: a sync)",
    }
    for k, t in calls.items():
        res.put(
            f"host.{k}_us",
            t.best * 1e6,
            "us",
            "measured",
            f"one thread: {what[k]}, thread CPU time per call, min of {t.repeats}",
            t.to_dict(),
        )
    tick()


def measure_gpu(
    res: ProbeResult, torch: Any, opts: ProbeOptions, tick: Callable[[], None], device: str = "cuda"
) -> None:
    """A GPU: its weight stream and GEMM rate, host-to-device and device-to-host copies from
    pinned and pageable memory, and the host time of a small op and of a sync. Unverified on
    real GPUs (no GPU run recorded): ``device`` may be ``cpu`` to run the same code on the
    CPU (the tests do; pinned buffers then are ordinary ones)."""
    from daopsim.simulator import probe_bench as pb

    reps = opts.repeats or (2 if opts.quick else 3)
    gpu = device != "cpu"
    gbs, t = pb.gemv_stream(torch, "bf16", 1, STREAM_SHAPE, None, reps, device=device)
    res.put(
        "gpu.stream_gbs",
        gbs,
        "GB/s",
        "measured",
        f"torch.nn.functional.linear of one bf16 row against {STREAM_SHAPE[0]}x"
        f"{STREAM_SHAPE[1]} weights on {device}, a pool of 128 MB, wall time with a sync, "
        f"min of {t.repeats}",
        t.to_dict(),
    )
    gf, t = pb.gemm_rate(torch, "bf16", 1, 4096 if gpu else 512, reps, device=device)
    res.put(
        "gpu.gemm_tflops",
        gf / 1e3,
        "TFLOPS",
        "measured",
        f"torch.mm of two square bf16 matrices on {device}, wall time with a sync, min of "
        f"{t.repeats}",
        t.to_dict(),
    )
    tick()
    for direction, (src, dst) in (("h2d", ("cpu", device)), ("d2h", (device, "cpu"))):
        for pinned in (True, False):
            gbs, t = pb.copy_rate(
                torch, 64e6 if gpu else 8e6, None, reps, src, dst, pinned=pinned and gpu
            )
            kind = "pinned" if pinned else "pageable"
            res.put(
                f"link.{direction}_{kind}_gbs",
                gbs,
                "GB/s",
                "measured",
                f"Tensor.copy_ of 64 MB {src} -> {dst}, {kind} host buffers, wall time with "
                f"a sync, min of {t.repeats}",
                t.to_dict(),
            )
    tick()
    calls = pb.host_calls(torch, reps, calls=200, device=device)
    for key, label in (("small_op", "dispatch_us"), ("item", "sync_us"), ("copy_call", "copy_us")):
        t = calls[key]
        res.put(
            f"gpu.{label}",
            t.best * 1e6,
            "us",
            "measured",
            f"host thread CPU time of one {key.replace('_', ' ')} on {device}, min of {t.repeats}",
            t.to_dict(),
        )
    tick()


def measure_modules(
    res: ProbeResult, torch: Any, opts: ProbeOptions, tick: Callable[[], None]
) -> None:
    """PyTorch eager's host time per module class (tiny width) and, with ``--model``, the
    device times of the model's modules (daopsim.simulator.probe_modules)."""
    from daopsim.simulator import probe_modules as pm
    from daopsim.simulator.hf_models import scaled_shape

    try:
        import transformers
    except ImportError:
        res.put(
            "runtime",
            None,
            "",
            "not measured",
            "module host costs need transformers (pip install 'daopsim[capture]')",
        )
        return
    res.versions["transformers"] = transformers.__version__
    reps = opts.repeats or (5 if opts.quick else 9)
    shape = opts.model or scaled_shape("mixtral-8x7b", layers=8, hidden=1024, expert_ffn=1536)
    llc = res.value("cpu.l3_bytes")
    arch = f"{shape.family} architecture (transformers {transformers.__version__})"
    h = pm.host_costs(torch, shape, reps, llc, calls=10 if opts.quick else 40)
    tick()
    tr = pm.Traffic.of(shape, llc)
    how = f"one thread, thread CPU time per call, min of {reps} repeats, {arch} at hidden 64"
    _put_host_costs(res, h, tr, how)
    if opts.model is None:
        return
    _measure_model_modules(res, torch, opts, llc, h, tick)


def _put_host_costs(res: ProbeResult, h: dict[str, Any], tr: Any, how: str) -> None:
    """The runtime profile's host costs per module call from the timed module calls ``h``
    (``how``: how they were timed), and every timed call as it was measured."""
    # the experts loop's fixed part: with 2 experts receiving the token, less 2 iterations
    fixed = max(0.0, 2 * h["experts_k2"].best - h["experts_k4"].best)
    glue = h["layer"].best - h["attention"].best - 2 * h["norm"].best - h["router"].best
    glue += fixed - h["experts_noop"].best
    inside = (
        "timed by forward hooks inside the decoder layer's call (a decode step at context "
        f"16, {tr.layer / 1e6:.1f} MB read before each layer: one layer's traffic)"
    )
    rows = [
        (
            "attention_host_us",
            h["attention"].best,
            "one attention module call (projections, rotary, cache update, SDPA, output "
            f"projection), {inside}",
        ),
        ("norm_host_us", h["norm"].best, f"one RMSNorm module call, {inside}"),
        (
            "router_host_us",
            h["router"].best,
            f"one router call (gate, softmax, top-k, renormalisation), {inside}",
        ),
        (
            "expert_host_us",
            h["expert_body"].best,
            "one iteration of the experts loop (transformers' eager body op for op) for one "
            f"token, {tr.expert / 1e6:.2f} MB read before each (one expert's weights)",
        ),
        (
            "layer_glue_host_us",
            max(0.0, glue),
            "the decoder layer's call with its experts replaced by an empty output (after one "
            "layer's traffic), minus its attention, 2 norms and router inside it, plus the "
            "experts loop's fixed part (2 x the loop with 2 experts receiving the token - with "
            "4, right after the router) minus the empty replacement's call",
        ),
        (
            "step_host_us",
            h["step_n1"].best,
            "one decode pass of a model with no layers (embedding, positions, mask, rotary "
            "tables, final norm, output head) and the greedy token pick, "
            f"{tr.token / 1e6:.1f} MB read before each (the model's traffic per token)",
        ),
    ]
    for key, v, what in rows:
        res.put(
            f"runtime.{key}",
            v * 1e6,
            "us",
            "measured",
            f"{what}; {how}",
            {k: t.to_dict() for k, t in h.items()} if key == "step_host_us" else None,
        )
    for key, t in h.items():
        res.put(
            f"host.module.{key}_us", t.best * 1e6, "us", "measured", f"{key}; {how}", t.to_dict()
        )
    res.put(
        "host.empty_expert_us",
        h["empty_expert"].best * 1e6,
        "us",
        "measured",
        "one iteration of the experts loop body for an expert with no token (what a loop over "
        f"every expert, e.g. transformers 4.51's Qwen3-MoE, pays per idle expert); {how}",
    )
    res.put(
        "host.step_prefill_us",
        h["step_n8"].best * 1e6,
        "us",
        "measured",
        f"the model's own code for an 8-token prompt pass; {how}",
    )


def _measure_model_modules(
    res: ProbeResult,
    torch: Any,
    opts: ProbeOptions,
    llc: float | None,
    h: dict[str, Any],
    tick: Callable[[], None],
) -> None:
    """With ``--model``: the device tables of the model's modules at full width, one expert
    on the CPU, and an expert's copy and write-back (cold and warm)."""
    from daopsim.simulator import probe_modules as pm

    assert opts.model is not None
    tokens = opts.tokens or pm.DEFAULT_TOKENS
    reps_t = opts.repeats or (4 if opts.quick else 6)
    tables = pm.device_tables(
        torch, opts.model, tokens, llc, reps_t, h, on_step=tick, per_pass=4 if opts.quick else 8
    )
    res.put(
        "model.device_tables",
        tables,
        "ms",
        "measured",
        "each module of the model at full width (one thread, weights in pools: streamed from "
        "DRAM when the model exceeds the LLC; the model's traffic before each call; thread CPU "
        "time, min of repeats) minus the host time the runtime profile charges for the same "
        "code: an MoE layer's non-expert part at context 0 with 1/layers of the output head, "
        "and one routed expert's loop body, at each token count",
    )
    cpu_threads = int(min(res.value("cpu.cores", 1), res.value("cpu.usable_threads", 1)))

    eb = opts.model.expert_bytes
    ms, t = _expert_alone(torch, opts.model, cpu_threads, llc, opts.repeats or 3)
    res.put(
        "model.cpu_expert_ms",
        ms,
        "ms",
        "measured",
        f"one expert of the model for one token on the CPU, {cpu_threads} thread(s), pool of "
        f"4x the LLC, {t.clock} time, min of {t.repeats}",
        t.to_dict(),
    )
    res.put(
        "model.load_expert_ms",
        tables["load_expert_ms"],
        "ms",
        "measured",
        f"Tensor.copy_ of one expert ({eb / 1e6:.2f} MB, packed in one buffer) from a pool "
        "into a slot, after one expert's traffic, one thread, thread CPU time, min of repeats "
        "(probe_modules.swap_pass)",
    )
    for key, what in (
        ("load_warm_expert_ms", "the copy"),
        ("writeback_warm_expert_ms", "the write-back"),
    ):
        res.put(
            f"model.{key}",
            tables[key],
            "ms",
            "measured",
            f"{what} of a swap whose slot's expert was computed just before (one slot reused: "
            "an in-use victim's), one thread, thread CPU time, min of repeats "
            "(probe_modules.swap_pass)",
        )
    res.put(
        "model.writeback_expert_ms",
        tables["writeback_expert_ms"],
        "ms",
        "measured",
        "Tensor.copy_ of a slot computed one miss earlier back into the pool, one thread, "
        "thread CPU time, min of repeats (probe_modules.swap_pass)",
    )
    tick()


def _expert_alone(
    torch: Any, shape: Any, threads: int, llc: float | None, repeats: int
) -> tuple[float, Any]:
    """ms of one expert's three linears for one token on ``threads`` threads, cold pool."""
    import time as _time

    from daopsim.simulator import probe_bench as pb
    from daopsim.simulator.hf_models import torch_dtype

    dt = torch_dtype(torch, shape.dtype)
    n = pb.pool_count(shape.expert_bytes, llc)
    with pb.torch_threads(torch, threads):
        gu = torch.empty(n, 2 * shape.expert_ffn, shape.hidden, dtype=dt).normal_()
        dn = torch.empty(n, shape.hidden, shape.expert_ffn, dtype=dt).normal_()
        x = torch.randn(1, shape.hidden, dtype=dt)
        now, name = pb.clock(threads)
        F = torch.nn.functional

        def one() -> float:
            t0 = now()
            with torch.no_grad():
                for i in range(n):
                    g, u = F.linear(x, gu[i]).chunk(2, dim=-1)
                    F.linear(F.silu(g) * u, dn[i])
            return (now() - t0) / n

        t = pb.timed(one, repeats)
    del _time
    return t.best * 1e3, pb.Timing(t.best, t.median, t.repeats, name)


def steps(opts: ProbeOptions) -> int:
    """Progress-bar steps of a probe with these options (an estimate is fine)."""
    n = 2 + 2 + (4 if opts.quick else 8) + 1
    if opts.model is not None:
        n += len(opts.tokens or (1, 2, 4, 8, 16, 32, 64)) + 1
    return n


def run_probe(
    opts: ProbeOptions, tick: Callable[[], None] = lambda: None, root: Path = Path("/")
) -> ProbeResult:
    """Detect and measure this machine (see the module docstring)."""
    import time as _time

    from daopsim.simulator import probe_bench as pb

    t0 = _time.perf_counter()
    res = ProbeResult(model=opts.model, quick=opts.quick)
    res.versions["python"] = platform.python_version()
    torch = pb.load_torch()
    if torch is not None:
        res.versions["torch"] = torch.__version__
    detect_cpu(res, root)
    tick()
    gpu = detect_gpu(res, torch) if opts.device != "cpu" else False
    if opts.device == "cuda" and not gpu:
        raise UserError("probe --device cuda: no CUDA device is usable by this PyTorch")
    res.device = "cuda" if gpu else "cpu"
    tick()
    measure_cpu(res, torch, opts, tick)
    if torch is not None:
        if gpu:
            measure_gpu(res, torch, opts, tick)
        measure_standin(res, torch, opts, tick)
        measure_modules(res, torch, opts, tick)
    res.elapsed_s = _time.perf_counter() - t0
    return res


# --------------------------------------------------------------------------------------------
# writers
# --------------------------------------------------------------------------------------------
def _num(v: float, digits: int = 4) -> str:
    """A TOML float with ``digits`` significant digits."""
    if v == 0:
        return "0.0"
    text = f"{v:.{digits}g}"
    if "e" in text:
        text = f"{v:.{max(0, digits - 1)}e}"
    return text if any(c in text for c in ".e") else text + ".0"


def _line(key: str, value: str, tag: str, note: str) -> str:
    return f"{key} = {value:<14} # [{tag}] {note}"


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _stand_in_desc(res: ProbeResult) -> str:
    return (
        f"{res.value('cpu.name')}: the CPU stands in for a GPU (device = PyTorch "
        f"{res.versions.get('torch', '?')} on one CPU thread; link = copies between two pools "
        "of host memory); [cpu] is the CPU on all its cores"
    )


def _cpu_lines(res: ProbeResult) -> list[str]:
    """The ``[cpu]`` table, with the per-core weight-stream tables (docs/hardware-profiles.md)."""
    cores, prec, stream, fp32, bf16, read, numpy_only = _cpu_rates(res)
    lines = [
        "[cpu]",
        f"name = {_toml_str(str(res.value('cpu.name')))}   # [X] {res.entries['cpu.name'].method}",
    ]
    lines.append(
        _line(
            "cores_used",
            str(cores),
            "M",
            f"the thread count (of 1, 2, 4 ... the {res.value('cpu.cores', '?')} usable cores) "
            "whose weight stream was fastest",
        )
    )
    if stream is None or fp32 is None:
        raise UserError(
            "probe: no CPU weight stream or GEMM rate could be measured (needs "
            "PyTorch: pip install 'daopsim[capture]')"
        )
    mem_bw = stream if read is None else min(stream, read)
    lines.append(
        _line(
            "mem_bw_gbs",
            _num(mem_bw),
            "M",
            "numpy sum over 4x the LLC, one thread (no PyTorch: a read stream, not an "
            "expert kernel's)"
            if numpy_only
            else f"{prec} weight stream of one-row linears on {cores} thread(s), pool of "
            "4x the LLC (probe: cpu.stream_gbs)",
        )
    )
    gemm = "numpy fp32 matmul (no PyTorch)" if numpy_only else f"torch.mm fp32, {cores} thread(s)"
    lines.append(_line("fp32_gflops", _num(fp32), "M", gemm))
    lines.append(
        _line(
            "bf16_gflops",
            _num(bf16),
            "D" if numpy_only else "M",
            "the fp32 figure (no PyTorch to time bf16)"
            if numpy_only
            else f"torch.mm bf16, {cores} thread(s)",
        )
    )
    if read is not None:
        lines.append(
            _line(
                "socket_bw_gbs",
                _num(max(read, mem_bw)),
                "M",
                f"all-core read stream (torch sum over 512 MB, {cores} threads)",
            )
        )
    lines += _cpu_memory_lines(res, mem_bw, read)
    lines += _per_core_tables(res, cores)
    return lines


def _cpu_rates(
    res: ProbeResult,
) -> tuple[int, str, float | None, float | None, float | None, float | None, bool]:
    """What the ``[cpu]`` table is written from: the thread count whose weight stream was
    fastest, its precision, that stream, the fp32 and bf16 GEMM rates there, the all-core
    read stream, and whether only numpy measured (no PyTorch)."""
    usable = int(res.value("cpu.usable_threads", 1))
    cores = int(min(res.value("cpu.cores", usable), usable))
    prec = "bf16" if res.value(f"cpu.stream_gbs.torch_bf16.t{cores}") else "fp32"
    # the thread count whose weight stream was fastest (all cores on a quiet machine; fewer
    # where other work holds some of them): the expert kernels' cores
    sweep = {
        int(k.rsplit(".t", 1)[1]): e.value
        for k, e in res.entries.items()
        if k.startswith(f"cpu.stream_gbs.torch_{prec}.t") and e.value
    }
    if sweep:
        cores = max(sweep, key=lambda t: (sweep[t], t))
    stream = res.value(f"cpu.stream_gbs.torch_{prec}.t{cores}")
    fp32 = res.value(f"cpu.gemm_gflops.fp32.t{cores}") or res.value("cpu.gemm_gflops.fp32.t1")
    bf16 = res.value(f"cpu.gemm_gflops.bf16.t{cores}") or fp32
    read = res.value("cpu.read_gbs")
    numpy_only = stream is None and res.value("cpu.read_gbs.t1") is not None
    if numpy_only:  # no PyTorch: numpy's one-thread read stream and BLAS matmul
        stream, fp32 = res.value("cpu.read_gbs.t1"), res.value("cpu.gemm_gflops.numpy")
        bf16 = fp32
    return cores, prec, stream, fp32, bf16, read, numpy_only


def _cpu_memory_lines(res: ProbeResult, mem_bw: float, read: float | None) -> list[str]:
    """The ``[cpu]`` table's memory lines: installed memory, theoretical DRAM bandwidth and
    the read stream's share of it."""
    lines: list[str] = []
    mem = res.value("cpu.memory_bytes")
    if mem and res.device != "cpu":  # the stand-in's link is unified: [gpu] holds the memory
        lines.append(_line("memory_gb", _num(mem / 1e9), "X", "installed memory"))
    dram = res.value("cpu.dram_gbs")
    if dram:
        lines.append(
            _line(
                "dram_gbs",
                _num(max(dram, mem_bw, read or 0)),
                "D",
                res.entries["cpu.dram_gbs"].method,
            )
        )
    else:
        lines.append(f"# dram_gbs: not readable here ({res.entries['cpu.dram_gbs'].method})")
    if dram and read is not None:
        lines.append(
            _line(
                "dram_efficiency",
                _num(min(1.0, read / max(dram, read))),
                "M",
                "all-core read stream / dram_gbs",
            )
        )
    return lines


def _per_core_tables(res: ProbeResult, cores: int) -> list[str]:
    """``[cpu.core_stream_gbs]`` and ``[cpu.stream_gbs]``: one-thread and all-thread weight
    streams per PyTorch precision the probe measured."""
    one, all_ = ["[cpu.core_stream_gbs]"], ["[cpu.stream_gbs]"]
    for prec in ("fp32", "bf16", "int8"):
        a = res.value(f"cpu.stream_gbs.torch_{prec}.t1")
        b = res.value(f"cpu.stream_gbs.torch_{prec}.t{cores}")
        if a:
            one.append(_line(f"torch_{prec}", _num(a), "M", "one thread, one-row linears, cold"))
        if b:
            all_.append(_line(f"torch_{prec}", _num(b), "M", f"{cores} threads, cold"))
    return ["", *one, "", *all_] if len(one) > 1 else []


def hardware_toml(res: ProbeResult, name: str) -> str:
    """The hardware profile text (see the module docstring)."""
    date = _dt.date.today().isoformat()
    head = [
        f"# Written by `daopsim probe` on {date} ({platform.node() or 'this host'}; "
        f"PyTorch {res.versions.get('torch', 'absent')}).",
        "# Tags: [M] measured (method given; one-thread figures in thread CPU time, several",
        "# threads in wall time, each the minimum over repeats), [X] detected (read from the",
        "# OS), [D] derived (formula given), [A] assumption. The raw figures: the .probe.json",
        '# beside this file. docs/hardware-profiles.md, "Probing your machine".',
        f"name = {_toml_str(name)}",
    ]
    lines: list[str] = []
    if res.device == "cuda":
        desc = f"{res.value('gpu.name')} with {res.value('cpu.name')}, measured by daopsim probe"
        head.append(f"description = {_toml_str(desc)}")
        lines += _gpu_lines(res)
    else:
        head.append(f"description = {_toml_str(_stand_in_desc(res))}")
        lines += _standin_lines(res)
    lines.append("")
    lines += _cpu_lines(res)
    if res.model is not None and res.value("model.device_tables") is not None:
        lines.append("")
        lines += _measured_lines(res)
    return "\n".join([*head, "", *lines]) + "\n"


def _standin_lines(res: ProbeResult) -> list[str]:
    mem = res.value("cpu.memory_bytes") or 8e9
    copy = res.value("standin.copy_gbs")
    copy_us = res.value("host.copy_call_us")
    dtype = res.model.dtype if res.model is not None else "fp32"
    read = res.value("cpu.read_gbs")
    lines = [
        "[gpu]",
        f"name = {_toml_str('CPU stand-in: ' + str(res.value('cpu.name')) + ', 1 PyTorch thread')}",
        _line(
            "memory_gb",
            _num(mem / 1e9),
            "X",
            "the host's memory: the stand-in's device memory is the host's",
        ),
        _line("usable_fraction", "0.9", "A", "assumption: the OS and other processes keep 10 %"),
        _measured(res, "mem_bw_gbs", "standin.gemv_gbs"),
        _line(
            "bf16_tflops",
            _num(res.value("standin.gemm_gflops") / 1e3, 4),
            "M",
            f"the stand-in's GEMM rate at its precision ({dtype}): "
            + res.entries["standin.gemm_gflops"].method,
        ),
        _line(
            "launch_overhead_us",
            "0.0",
            "D",
            "the device is the host thread: a kernel's call "
            "is host time, in the runtime profile's *_host_us fields",
        ),
        _line("workspace_gb", "0.5", "A", "assumption: activations and allocator reserve"),
        "",
        "[link]",
        _line(
            "kind",
            '"unified"',
            "D",
            'one DRAM: a "copy" is a memcpy between two pools of host memory on the one thread',
        ),
    ]
    method = res.entries["standin.copy_gbs"].method
    for key in ("h2d_pinned_gbs", "d2h_pinned_gbs", "h2d_pageable_gbs", "d2h_pageable_gbs"):
        lines.append(
            _line(
                key,
                _num(copy),
                "M",
                method
                if key == "h2d_pinned_gbs"
                else "the same copy (no pinned or pageable memory on the CPU)",
            )
        )
    lines += [
        _line(
            "copy_overhead_us",
            _num(copy_us),
            "M" if res.entries["host.copy_call_us"].how == "measured" else "A",
            res.entries["host.copy_call_us"].method,
        ),
        _line("copy_engines", "1", "D", "the thread that computes also copies: one copy at a time"),
    ]
    if read is not None:
        lines.append(_line("dram_bw_gbs", _num(read), "M", "all-core read stream (cpu.read_gbs)"))
    return lines


def _measured(res: ProbeResult, key: str, entry: str) -> str:
    """A profile line ``key`` holding the probe's measured ``entry``, tagged with how it was
    measured."""
    return _line(key, _num(res.value(entry)), "M", res.entries[entry].method)


def _gpu_lines(res: ProbeResult) -> list[str]:
    """``[gpu]`` and ``[link]`` of a real GPU (unverified: no GPU run has been recorded)."""
    mem = res.value("gpu.memory_bytes") or 0
    lines = [
        "# GPU figures: written by code that has run only on CPU stand-ins so far (unverified",
        '# on a real GPU; docs/hardware-profiles.md, "Probing your machine").',
        "[gpu]",
        f"name = {_toml_str(str(res.value('gpu.name')))}",
        _line("memory_gb", _num(mem / 1e9), "X", res.entries["gpu.memory_bytes"].method),
        _line("usable_fraction", "0.93", "A", "assumption: CUDA context and fragmentation"),
        _measured(res, "mem_bw_gbs", "gpu.stream_gbs"),
        _measured(res, "bf16_tflops", "gpu.gemm_tflops"),
        _line(
            "launch_overhead_us",
            _num(res.value("gpu.dispatch_us")),
            "M",
            "taken as the host time of one small op (a kernel cannot be issued faster)",
        ),
        _line("workspace_gb", "1.0", "A", "assumption: activations and allocator reserve"),
        "",
        "[link]",
        _line("kind", '"pcie"', "D", "a discrete GPU"),
    ]
    for key in ("h2d_pinned_gbs", "d2h_pinned_gbs", "h2d_pageable_gbs", "d2h_pageable_gbs"):
        lines.append(_measured(res, key, f"link.{key}"))
    lines += [
        _measured(res, "copy_overhead_us", "gpu.copy_us"),
        _line("copy_engines", "2", "A", "assumption: one copy engine per direction"),
    ]
    return lines


def _measured_lines(res: ProbeResult) -> list[str]:
    m = res.model
    tables = res.value("model.device_tables")
    lines = [
        f'[measured."{m.name}"]',
        _line("dtype", _toml_str(m.dtype), "D", "the model's precision"),
        _measured(res, "cpu_expert_ms", "model.cpu_expert_ms"),
        _measured(res, "load_expert_ms", "model.load_expert_ms"),
        _line("load_path", '"pinned"', "D", "the stand-in's copies have one path"),
        _line("load_overrides_link", "true", "D", "this copy of one expert is what a miss costs"),
        _measured(res, "writeback_expert_ms", "model.writeback_expert_ms"),
        _measured(res, "load_warm_expert_ms", "model.load_warm_expert_ms"),
        _measured(res, "writeback_warm_expert_ms", "model.writeback_warm_expert_ms"),
        "# device times of this model's modules, ms at each token count (probe_modules.py):",
        "# full width minus hidden 64, one thread, weights streamed from DRAM, min of repeats",
        "device_tokens = [" + ", ".join(str(t) for t in tables["tokens"]) + "]",
        "device_layer_ms = [" + ", ".join(_num(v) for v in tables["layer_ms"]) + "]",
        "device_expert_ms = [" + ", ".join(_num(v) for v in tables["expert_ms"]) + "]",
        "# the same call right after its copy into a slot (the copy leaves it in the caches):",
        "device_copied_expert_ms = ["
        + ", ".join(_num(v) for v in tables["copied_expert_ms"])
        + "]",
        f"source = {_toml_str('daopsim probe --model: module microbenchmarks on this host')}",
    ]
    return lines


def runtime_toml(res: ProbeResult, name: str) -> str:
    """The runtime profile text: PyTorch eager's host costs measured here."""
    date = _dt.date.today().isoformat()
    tv = res.versions.get("transformers", "?")
    torch_v = res.versions.get("torch", "?")
    if res.device == "cuda":
        return _gpu_runtime_toml(res, name, date)
    keys = HOST_DEVICE_FIELDS  # the runtime fields a host_device profile states
    if res.value(f"runtime.{keys[0]}") is None:
        raise UserError(
            "probe: module host costs need transformers (pip install 'daopsim[capture]')"
        )
    lines = [
        f"# Written by `daopsim probe` on {date}: PyTorch {res.versions.get('torch')} eager",
        f"# (transformers {tv}) on one CPU thread of {res.value('cpu.name')}, measured module by",
        '# module (docs/cost-model.md, "A device on the host thread"). The device is the host',
        "# thread: these host times add to the device's work.",
        f"name = {_toml_str(name)}",
        f"summary = {_toml_str(f'PyTorch {torch_v} eager on the CPU, measured by daopsim probe')}",
        "host_device = true",
        'attention = "fused"',
    ]
    for k in keys:
        lines.append(f"{k} = {_num(res.value(f'runtime.{k}'))}")
    lines.append(f"cpu_expert_call_us = {_num(res.value('runtime.expert_host_us'))}")
    lines += ["", "[source]"]
    lines.append('attention = "transformers SDPA attention (attn_implementation = \\"sdpa\\")"')
    lines.append('host_device = "daopsim probe: the closed loop\'s device is this CPU thread"')
    for k in keys:
        lines.append(f"{k} = {_toml_str('measured: ' + res.entries[f'runtime.{k}'].method)}")
    lines.append(
        "cpu_expert_call_us = "
        + _toml_str("measured: as expert_host_us (the same eager expert call)")
    )
    return "\n".join(lines) + "\n"


def _gpu_runtime_toml(res: ProbeResult, name: str, date: str) -> str:
    """An asynchronous runtime: per-op dispatch and sync measured, kernel counts from the
    bundled ``hf-eager`` profile (unverified: no GPU run recorded)."""
    from daopsim.simulator.runtime_profiles import get_runtime

    base = get_runtime("hf-eager")
    lines = [
        f"# Written by `daopsim probe` on {date} (GPU path: unverified, no GPU run recorded).",
        f"name = {_toml_str(name)}",
        f"summary = {_toml_str('HF eager on ' + str(res.value('gpu.name')) + ', measured')}",
        f"dispatch_us = {_num(res.value('gpu.dispatch_us'))}",
        f"sync_us = {_num(res.value('gpu.sync_us'))}",
        f"nonexpert_kernels = {base.nonexpert_kernels}",
        f"expert_kernels = {base.expert_kernels}",
        f"routing_syncs = {base.routing_syncs}",
        f"expert_syncs = {base.expert_syncs}",
        "",
        "[source]",
        f"dispatch_us = {_toml_str('measured: ' + res.entries['gpu.dispatch_us'].method)}",
        f"sync_us = {_toml_str('measured: ' + res.entries['gpu.sync_us'].method)}",
        'nonexpert_kernels = "the bundled hf-eager profile\'s count"',
        'expert_kernels = "the bundled hf-eager profile\'s count"',
        'routing_syncs = "the bundled hf-eager profile\'s count"',
        'expert_syncs = "the bundled hf-eager profile\'s count"',
    ]
    return "\n".join(lines) + "\n"


def output_paths(out_dir: str | os.PathLike[str], name: str) -> dict[str, Path]:
    """Where a probe named ``name`` writes, by role; a bundled profile's name or folder is
    refused (one line)."""
    from daopsim.simulator.data import profiles_dir
    from daopsim.simulator.hardware import bundled_profiles
    from daopsim.simulator.output import safe_name

    safe_name(name, "--name")
    if name in bundled_profiles():
        raise UserError(f"--name {name!r} is a bundled profile; the probe never overwrites one")
    out = Path(out_dir)
    bundled = profiles_dir().resolve()
    try:
        target = out.resolve()
    except OSError:
        target = out
    if target in (bundled, bundled / "runtimes"):
        raise UserError(f"-o {out}: the bundled profiles' folder; write your profile elsewhere")
    return {role: out / pattern.format(name=name) for role, pattern in FILES.items()}


def write_probe(res: ProbeResult, out_dir: str | os.PathLike[str], name: str) -> dict[str, Path]:
    """Write the hardware profile, the runtime profile and the JSON (each atomically); the
    written profiles are read back with the simulator's own parsers before they are kept."""
    from daopsim.simulator.commands.common import dumps
    from daopsim.simulator.hardware import parse_profile
    from daopsim.simulator.output import write_text
    from daopsim.simulator.runtime_profiles import parse_runtime

    paths = output_paths(out_dir, name)
    hw_text = hardware_toml(res, name)
    # without PyTorch and transformers there are no module host costs: no runtime profile
    has_runtime = res.device == "cuda" or res.value("runtime.step_host_us") is not None
    rt_text = runtime_toml(res, f"{name}.runtime") if has_runtime else None
    # a profile the simulator would refuse is a bug here, not the user's: check before writing
    parse_profile(tomllib.loads(hw_text), paths["hardware"])
    if rt_text is not None:
        parse_runtime(tomllib.loads(rt_text), str(paths["runtime"]))
    write_text(paths["hardware"], hw_text, "-o")
    if rt_text is not None:
        write_text(paths["runtime"], rt_text, "-o")
    else:
        del paths["runtime"]
    write_text(paths["json"], dumps({"name": name, **res.to_dict()}) + "\n", "-o")
    return paths


def summary(res: ProbeResult) -> dict[str, Any]:
    """The main figures, for the command's table."""
    out = {
        "cpu": res.value("cpu.name"),
        "cores": res.value("cpu.cores"),
        "threads": res.value("cpu.threads"),
        "l3_mb": (res.value("cpu.l3_bytes") or 0) / 2**20,
        "memory_gb": (res.value("cpu.memory_bytes") or 0) / 1e9,
        "device": res.device,
        "standin_stream_gbs": res.value("standin.gemv_gbs"),
        "standin_copy_gbs": res.value("standin.copy_gbs"),
        "read_gbs_all_cores": res.value("cpu.read_gbs"),
        "elapsed_s": res.elapsed_s,
    }
    return {k: v for k, v in out.items() if v is not None}


__all__ = [
    "Entry",
    "ProbeOptions",
    "ProbeResult",
    "detect_cpu",
    "detect_gpu",
    "hardware_toml",
    "memory_channels",
    "output_paths",
    "parse_dmidecode_memory",
    "parse_lscpu",
    "parse_meminfo",
    "parse_proc_cpuinfo",
    "parse_size",
    "read_sys_caches",
    "run_probe",
    "runtime_toml",
    "write_probe",
]
