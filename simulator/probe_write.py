"""The profiles ``daopsim probe`` writes from what it found: ``NAME.toml`` (a hardware profile),
``NAME.runtime.toml`` (a runtime profile) and ``NAME.probe.json`` (every figure with how it was
obtained). Every number written carries a tag saying how it was obtained: ``[M]`` measured
(method), ``[X]`` detected, ``[D]`` derived (formula), ``[A]`` assumption. Both profiles are
parsed back before they are written, so what the probe writes always loads.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

from daopsim.simulator.errors import UserError
from daopsim.simulator.runtime_profiles import HOST_DEVICE_FIELDS

if TYPE_CHECKING:
    from daopsim.simulator.probe import ProbeResult

#: a probe's output files, by role (``NAME`` replaced)
FILES = {"hardware": "{name}.toml", "runtime": "{name}.runtime.toml", "json": "{name}.probe.json"}


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
    from daopsim.simulator.hardware_schema import parse_profile
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
