"""What ``daopsim probe`` reads off this machine without measuring it: the CPU, its caches, the
memory and DIMMs (from /proc, /sys, lscpu, py-cpuinfo, psutil and dmidecode) and a GPU (NVML or
PyTorch). The parsers of what the OS prints are pure functions, unit-tested with recorded
outputs (tests/fixtures/probe/); every figure is put in the probe's result as ``detected`` with
where it was read.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daopsim.simulator.errors import UserError

if TYPE_CHECKING:
    from daopsim.simulator.probe import ProbeResult

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
