"""The hardware-profile schema: each section's required and optional keys, their types and
ranges, and :func:`parse_profile`, which checks a TOML table against it and builds the
:class:`HardwareProfile`; a mistake is a :class:`ProfileError` naming the file and the key.
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from typing import Any

from daopsim.simulator.errors import ProfileError, did_you_mean
from daopsim.simulator.hardware_spec import (
    CPU_STREAM_FAMILIES,
    LINK_KINDS,
    LOAD_PATHS,
    MEMORY_TYPES,
    PEER_KINDS,
    CpuSpec,
    GpuSpec,
    HardwareProfile,
    LinkSpec,
    MeasuredModel,
    MultiGpuSpec,
    PowerSpec,
    SsdSpec,
)

# --- schema -------------------------------------------------------------------------------------
# (key, type) per section. "pos" = positive number (int or float), "nonneg" = number >= 0,
# "frac" = number in (0, 1], "int+" = positive integer, "str" = non-empty string, "tokens" = a
# list of token counts (1, then strictly increasing), "posarray" = a list of positive numbers,
# or a tuple of allowed strings.
_Schema = dict[str, Any]

_TOP: _Schema = {"name": "str", "description": "str"}
_GPU: _Schema = {
    "name": "str",
    "memory_gb": "pos",
    "usable_fraction": "frac",
    "mem_bw_gbs": "pos",
    "bf16_tflops": "pos",
    "launch_overhead_us": "nonneg",
    "workspace_gb": "pos",
    "spec_mem_bw_gbs": "pos",
    "memory_type": MEMORY_TYPES,
    "ggml_prompt_tflops": "pos",
}
_GPU_OPTIONAL = {"spec_mem_bw_gbs", "memory_type", "ggml_prompt_tflops"}
_LINK: _Schema = {
    "kind": LINK_KINDS,
    "h2d_pinned_gbs": "pos",
    "d2h_pinned_gbs": "pos",
    "h2d_pageable_gbs": "pos",
    "d2h_pageable_gbs": "pos",
    "copy_overhead_us": "pos",
    "copy_engines": "int+",
    "dram_bw_gbs": "pos",
    "copy_engines_per_direction": "int+",
}
_LINK_OPTIONAL = {"dram_bw_gbs", "copy_engines_per_direction"}
_CPU: _Schema = {
    "name": "str",
    "cores_used": "int+",
    "mem_bw_gbs": "pos",
    "dram_efficiency": "frac",
    "core_stream_gbs": "streams",
    "stream_gbs": "streams",
    "bf16_gflops": "pos",
    "fp32_gflops": "pos",
    "socket_bw_gbs": "pos",
    "memory_gb": "pos",
    "amx_bf16_gflops": "pos",
    "dram_gbs": "pos",
    "ggml_stream_gbs": "pos",
    "ggml_gemm_gflops": "pos",
}
_CPU_OPTIONAL = {
    "mem_bw_gbs",
    "dram_efficiency",
    "core_stream_gbs",
    "stream_gbs",
    "socket_bw_gbs",
    "memory_gb",
    "amx_bf16_gflops",
    "dram_gbs",
    "ggml_stream_gbs",
    "ggml_gemm_gflops",
}
_SSD: _Schema = {
    "name": "str",
    "seq_read_gbps": "pos",
    "rand4k_read_iops": "pos",
    "queue_depth": "int+",
    "read_latency_us": "pos",
}
_POWER: _Schema = {
    "gpu_idle_w": "pos",
    "gpu_busy_w": "pos",
    "cpu_idle_w": "pos",
    "cpu_busy_w": "pos",
    "gpu_active_idle_w": "pos",
    "cpu_wait_w": "pos",
    "dram_w": "pos",
    "platform_w": "pos",
    "psu_efficiency": "frac",
    "cpu_spin_ms": "pos",
}
_POWER_OPTIONAL = {
    "gpu_active_idle_w",
    "cpu_wait_w",
    "dram_w",
    "platform_w",
    "psu_efficiency",
    "cpu_spin_ms",
}
_MEASURED: _Schema = {
    "cpu_expert_ms": "pos",
    "load_expert_ms": "pos",
    "load_path": LOAD_PATHS,
    "source": "str",
    "dtype": "str",
    "load_overrides_link": "bool",
    "writeback_expert_ms": "pos",
    "load_warm_expert_ms": "pos",
    "writeback_warm_expert_ms": "pos",
    "device_tokens": "tokens",
    "device_expert_ms": "posarray",
    "device_layer_ms": "posarray",
    "device_copied_expert_ms": "posarray",
}
_MEASURED_OPTIONAL = {
    "dtype",
    "load_overrides_link",
    "writeback_expert_ms",
    "load_warm_expert_ms",
    "writeback_warm_expert_ms",
    "device_tokens",
    "device_expert_ms",
    "device_layer_ms",
    "device_copied_expert_ms",
}

#: Largest accepted value per key: generous physical bounds, an order of magnitude or more above
#: any machine built so far (docs/hardware-profiles.md, "Ranges"), so a typo such as
#: ``memory_gb = 1e300`` is a one-line error instead of overflowing the cost model later.
#: Measured constants are keyed ``measured.<field>`` whatever the model.
MAX_VALUES: dict[str, float] = {
    "gpu.memory_gb": 10_000,
    "gpu.mem_bw_gbs": 100_000,
    "gpu.spec_mem_bw_gbs": 100_000,
    "gpu.bf16_tflops": 100_000,
    "gpu.ggml_prompt_tflops": 100_000,
    "gpu.launch_overhead_us": 10_000,
    "gpu.workspace_gb": 10_000,
    "link.h2d_pinned_gbs": 10_000,
    "link.d2h_pinned_gbs": 10_000,
    "link.h2d_pageable_gbs": 10_000,
    "link.d2h_pageable_gbs": 10_000,
    "link.copy_overhead_us": 100_000,
    "link.copy_engines": 8,
    "link.copy_engines_per_direction": 4,
    "cpu.cores_used": 4096,
    "cpu.mem_bw_gbs": 10_000,
    "cpu.bf16_gflops": 1_000_000,
    "cpu.fp32_gflops": 1_000_000,
    "cpu.amx_bf16_gflops": 10_000_000,
    "cpu.dram_gbs": 10_000,
    "cpu.ggml_stream_gbs": 10_000,
    "cpu.core_stream_gbs": 10_000,
    "cpu.stream_gbs": 10_000,
    "cpu.ggml_gemm_gflops": 1_000_000,
    "power.gpu_idle_w": 100_000,
    "power.gpu_busy_w": 100_000,
    "power.cpu_idle_w": 100_000,
    "power.cpu_busy_w": 100_000,
    "power.gpu_active_idle_w": 100_000,
    "power.cpu_wait_w": 100_000,
    "power.dram_w": 100_000,
    "power.platform_w": 100_000,
    "power.cpu_spin_ms": 10_000,
    "cpu.memory_gb": 1_000_000,
    "ssd.seq_read_gbps": 1_000,
    "ssd.rand4k_read_iops": 1e9,
    "ssd.queue_depth": 65_536,
    "ssd.read_latency_us": 1e6,
    "measured.cpu_expert_ms": 1_000_000,
    "measured.load_expert_ms": 1_000_000,
    "measured.writeback_expert_ms": 1_000_000,
    "measured.load_warm_expert_ms": 1_000_000,
    "measured.writeback_warm_expert_ms": 1_000_000,
}


#: Smallest accepted value per rate (bandwidths, throughputs): generous bounds two orders of
#: magnitude or more below any machine's (a USB 2.0 link moves 0.06 GB/s), so a typo such as
#: ``h2d_pinned_gbs = 1e-9`` is a one-line error instead of a run whose clock reaches 1e10 s
#: (docs/hardware-profiles.md, "Ranges").
MIN_VALUES: dict[str, float] = {
    "gpu.mem_bw_gbs": 1.0,
    "gpu.spec_mem_bw_gbs": 1.0,
    "gpu.bf16_tflops": 0.01,
    "gpu.ggml_prompt_tflops": 0.01,
    "link.h2d_pinned_gbs": 0.01,
    "link.d2h_pinned_gbs": 0.01,
    "link.h2d_pageable_gbs": 0.01,
    "link.d2h_pageable_gbs": 0.01,
    "link.dram_bw_gbs": 0.1,
    "cpu.mem_bw_gbs": 0.1,
    "cpu.socket_bw_gbs": 0.1,
    "cpu.dram_gbs": 0.1,
    "cpu.ggml_stream_gbs": 0.1,
    "cpu.bf16_gflops": 0.1,
    "cpu.fp32_gflops": 0.1,
    "cpu.amx_bf16_gflops": 0.1,
    "cpu.ggml_gemm_gflops": 0.1,
    "ssd.seq_read_gbps": 0.001,
    "ssd.rand4k_read_iops": 10,
    "peer.bandwidth_gbs": 0.01,
}


def _check_range(path: Path, key: str, value: Any) -> None:
    """A number above its key's physical bound (MAX_VALUES), or a rate below its bound
    (MIN_VALUES), is a ProfileError."""
    parts = key.split(".")
    limit = MAX_VALUES.get(key)
    if limit is None and len(parts) == 3 and parts[0] == "cpu":
        limit = MAX_VALUES.get(f"cpu.{parts[1]}")
    if limit is None and parts[0] == "measured":
        limit = MAX_VALUES.get(f"measured.{parts[-1]}")
    if limit is not None and value > limit:
        raise ProfileError(path, f"{value:g} is above the physical bound {limit:g}", key)
    low = MIN_VALUES.get(key)
    if low is not None and value < low:
        raise ProfileError(path, f"{value:g} is below the physical bound {low:g}", key)


_SECTIONS = {"gpu", "link", "cpu", "power", "measured", "ssd", "gpus", "peer"}
_GPUS: _Schema = {"count": "int+", "shared_uplink": "bool"}
_PEER: _Schema = {"kind": PEER_KINDS, "bandwidth_gbs": "pos", "latency_us": "pos", "pairs": "pairs"}
_PEER_OPTIONAL = {"bandwidth_gbs", "latency_us", "pairs"}
MAX_VALUES.update({"gpus.count": 64, "peer.bandwidth_gbs": 10_000, "peer.latency_us": 100_000})


def _check_value(path: Path, key: str, kind: Any, value: Any) -> Any:
    """One value against its schema type; returns it (ints widened to float for numbers)."""
    if isinstance(kind, tuple):
        if not isinstance(value, str) or value not in kind:
            raise ProfileError(path, f"must be one of {', '.join(kind)}; got {value!r}", key)
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ProfileError(path, f"must be a string; got {type(value).__name__}", key)
        if not value.strip():
            raise ProfileError(path, "must not be empty", key)
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ProfileError(path, f"must be true or false; got {value!r}", key)
        return value
    if kind == "pairs":
        ok = isinstance(value, list) and all(
            isinstance(x, list)
            and len(x) == 2
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x)
            and x[0] != x[1]
            for x in value
        )
        if not ok:
            raise ProfileError(path, "must be a list of GPU index pairs, e.g. [[0, 1]]", key)
        return tuple(sorted((min(a, b), max(a, b)) for a, b in value))
    if kind == "streams":
        if not isinstance(value, dict) or not value:
            raise ProfileError(
                path,
                f"must be a table of kernel family = GB/s ({', '.join(CPU_STREAM_FAMILIES)})",
                key,
            )
        pairs = []
        for fam, v in value.items():
            if fam not in CPU_STREAM_FAMILIES:
                raise ProfileError(
                    path,
                    f"unknown kernel family (known: {', '.join(CPU_STREAM_FAMILIES)})",
                    f"{key}.{fam}",
                )
            number = _check_value(path, f"{key}.{fam}", "pos", v)
            _check_range(path, f"{key}.{fam}", number)
            pairs.append((fam, number))
        return tuple(sorted(pairs))
    if kind in ("tokens", "posarray"):
        return _check_array(path, key, kind, value)
    if kind == "int+":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProfileError(path, f"must be an integer; got {type(value).__name__}", key)
        if value <= 0:
            raise ProfileError(path, f"must be a positive integer; got {value}", key)
        return value
    # numbers
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProfileError(path, f"must be a number; got {type(value).__name__}", key)
    number = float(value)
    if kind == "nonneg":
        if not math.isfinite(number) or number < 0:
            raise ProfileError(path, f"must be a finite number >= 0; got {value}", key)
        return number
    if not math.isfinite(number) or number <= 0:
        raise ProfileError(path, f"must be a positive number; got {value}", key)
    if kind == "frac" and number > 1:
        raise ProfileError(path, f"must be in (0, 1]; got {value}", key)
    return number


def _check_array(path: Path, key: str, kind: str, value: Any) -> tuple[Any, ...]:
    """A non-empty list: ``tokens`` strictly increasing positive integers starting at 1,
    ``posarray`` positive finite numbers (at most the key's bound)."""
    if not isinstance(value, list) or not value:
        raise ProfileError(path, "must be a non-empty list of numbers", key)
    if kind == "tokens":
        if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise ProfileError(path, "must be a list of integers", key)
        if value[0] != 1 or any(b <= a for a, b in itertools.pairwise(value)):
            raise ProfileError(path, "must start at 1 and increase strictly", key)
        return tuple(value)
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ProfileError(path, f"must be a list of numbers; got {v!r}", key)
        if not math.isfinite(v) or v <= 0 or v > 1_000_000:
            raise ProfileError(path, f"must hold positive numbers up to 1e6; got {v!r}", key)
        out.append(float(v))
    return tuple(out)


def _section(
    path: Path,
    data: Any,
    schema: _Schema,
    prefix: str,
    optional: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Validate one table: no unknown keys, no missing keys, each value typed and in range."""
    if not isinstance(data, dict):
        raise ProfileError(path, f"must be a table; got {type(data).__name__}", prefix.rstrip("."))
    for key in data:
        if key not in schema:
            hint = ""
            if isinstance(data[key], dict):  # [measured.phi-3.5-moe] splits at the dots
                hint = '; quote table names that contain dots, e.g. [measured."phi-3.5-moe"]'
            hint = did_you_mean(str(key), schema) + hint
            raise ProfileError(
                path, f"unknown key{hint} (known: {', '.join(schema)})", f"{prefix}{key}"
            )
    out: dict[str, Any] = {}
    for key, kind in schema.items():
        if key not in data:
            if key in optional:
                continue
            raise ProfileError(path, "missing key", f"{prefix}{key}")
        out[key] = _check_value(path, f"{prefix}{key}", kind, data[key])
        if not isinstance(out[key], str | tuple | bool):
            _check_range(path, f"{prefix}{key}", out[key])
    return out


def parse_profile(data: dict[str, Any], path: str | os.PathLike[str]) -> HardwareProfile:
    """Validate a parsed TOML document and build the profile; ProfileError names file and key."""
    p = Path(path)
    for key in data:
        if key not in _TOP and key not in _SECTIONS:
            known = ", ".join([*_TOP, *sorted(_SECTIONS)])
            hint = did_you_mean(str(key), [*_TOP, *_SECTIONS])
            raise ProfileError(p, f"unknown key{hint} (known: {known})", key)
    top = {}
    for key, kind in _TOP.items():
        if key not in data:
            raise ProfileError(p, "missing key", key)
        top[key] = _check_value(p, key, kind, data[key])
    for sect in ("gpu", "link", "cpu"):
        if sect not in data:
            raise ProfileError(p, "missing section", sect)
    gpu = GpuSpec(**_section(p, data["gpu"], _GPU, "gpu.", _GPU_OPTIONAL))
    # a measured rate cannot beat the vendor's figure it is measured against
    if gpu.spec_mem_bw_gbs is not None and gpu.spec_mem_bw_gbs < gpu.mem_bw_gbs:
        raise ProfileError(
            p,
            f"must be >= gpu.mem_bw_gbs ({gpu.mem_bw_gbs:g}): the vendor figure bounds a "
            f"measured rate; got {gpu.spec_mem_bw_gbs:g}",
            "gpu.spec_mem_bw_gbs",
        )
    link = LinkSpec(**_section(p, data["link"], _LINK, "link.", _LINK_OPTIONAL))
    per = link.copy_engines_per_direction
    if per > 1 and link.copy_engines < 2 * per:
        raise ProfileError(
            p,
            f"needs link.copy_engines >= {2 * link.copy_engines_per_direction} (that many "
            f"engines in each direction); got copy_engines = {link.copy_engines}",
            "link.copy_engines_per_direction",
        )
    cpu = CpuSpec(**_section(p, data["cpu"], _CPU, "cpu.", _CPU_OPTIONAL))
    _check_cpu_stream(p, cpu)
    power = (
        PowerSpec(**_section(p, data["power"], _POWER, "power.", _POWER_OPTIONAL))
        if "power" in data
        else None
    )
    if power is not None:
        if power.gpu_busy_w < power.gpu_idle_w:
            raise ProfileError(p, "busy power below idle power", "power.gpu_busy_w")
        if power.cpu_busy_w < power.cpu_idle_w:
            raise ProfileError(p, "busy power below idle power", "power.cpu_busy_w")
        r = power.resolved(cpu.cores_used)
        assert r.gpu_active_idle_w is not None and r.cpu_wait_w is not None
        if not power.gpu_idle_w <= r.gpu_active_idle_w <= power.gpu_busy_w:
            raise ProfileError(
                p, "must lie between gpu_idle_w and gpu_busy_w", "power.gpu_active_idle_w"
            )
        if not power.cpu_idle_w <= r.cpu_wait_w <= power.cpu_busy_w:
            raise ProfileError(p, "must lie between cpu_idle_w and cpu_busy_w", "power.cpu_wait_w")
    measured: dict[str, MeasuredModel] = {}
    raw = data.get("measured", {})
    if not isinstance(raw, dict):
        raise ProfileError(p, f"must be a table; got {type(raw).__name__}", "measured")
    for model_name, table in raw.items():
        fields = _section(p, table, _MEASURED, f"measured.{model_name}.", _MEASURED_OPTIONAL)
        if "dtype" in fields:
            _check_dtype(p, f"measured.{model_name}.dtype", fields["dtype"])
        _check_device_tables(p, f"measured.{model_name}.", fields)
        measured[model_name.lower()] = MeasuredModel(**fields)
    ssd = SsdSpec(**_section(p, data["ssd"], _SSD, "ssd.")) if "ssd" in data else None
    multi = _multi(p, data)
    return HardwareProfile(
        name=top["name"],
        description=top["description"],
        gpu=gpu,
        link=link,
        cpu=cpu,
        power=power,
        measured=measured,
        path=str(p),
        ssd=ssd,
        multi=multi,
    )


def _check_cpu_stream(p: Path, cpu: CpuSpec) -> None:
    """The CPU's weight-stream fields are consistent: no achieved stream above the DRAM's
    theoretical bandwidth, a per-core rate only with a socket bound to cap it, and a PyTorch
    stream (``torch_bf16``: measured, or per core) for the CPU experts every runtime may run."""
    if cpu.dram_gbs is not None:
        for key in ("mem_bw_gbs", "socket_bw_gbs", "ggml_stream_gbs"):
            got = getattr(cpu, key)
            if got is not None and got > cpu.dram_gbs:
                raise ProfileError(p, "must not exceed cpu.dram_gbs (theoretical)", f"cpu.{key}")
        for fam, got in cpu.stream_gbs:
            if got > cpu.dram_gbs:
                raise ProfileError(
                    p, "must not exceed cpu.dram_gbs (theoretical)", f"cpu.stream_gbs.{fam}"
                )
    if cpu.dram_efficiency is not None and cpu.dram_gbs is None:
        raise ProfileError(p, "needs cpu.dram_gbs (it is a share of it)", "cpu.dram_efficiency")
    if cpu.core_stream_gbs and cpu.socket_bound_gbs is None:
        raise ProfileError(
            p,
            "a per-core stream needs the socket's bound: cpu.dram_gbs with cpu.dram_efficiency, "
            "or cpu.socket_bw_gbs",
            "cpu.core_stream_gbs",
        )
    families = dict(cpu.core_stream_gbs) | dict(cpu.stream_gbs)
    if cpu.mem_bw_gbs is None and "torch_bf16" not in families:
        raise ProfileError(
            p,
            "missing: give cpu.core_stream_gbs.torch_bf16 (GB/s per core, with cpu.dram_gbs and "
            "cpu.dram_efficiency) or a measured cpu.mem_bw_gbs",
            "cpu.core_stream_gbs.torch_bf16",
        )


def _multi(p: Path, data: dict[str, Any]) -> MultiGpuSpec | None:
    """The ``[gpus]`` and ``[peer]`` tables, checked together (both or neither)."""
    if "gpus" not in data and "peer" not in data:
        return None
    for sect in ("gpus", "peer"):
        if sect not in data:
            raise ProfileError(p, "missing section (give [gpus] and [peer] together)", sect)
    gpus = _section(p, data["gpus"], _GPUS, "gpus.")
    peer = _section(p, data["peer"], _PEER, "peer.", _PEER_OPTIONAL)
    if gpus["count"] < 2:
        raise ProfileError(p, "a multi-GPU profile has at least 2 GPUs", "gpus.count")
    if peer["kind"] != "host":
        for key in ("bandwidth_gbs", "latency_us"):
            if key not in peer:
                raise ProfileError(
                    p, f"missing key (needed for kind {peer['kind']!r})", f"peer.{key}"
                )
    pairs = peer.get("pairs")
    if pairs is not None and any(b >= gpus["count"] for _, b in pairs):
        raise ProfileError(p, f"names a GPU beyond gpus.count = {gpus['count']}", "peer.pairs")
    return MultiGpuSpec(
        count=gpus["count"],
        shared_uplink=gpus["shared_uplink"],
        peer_kind=peer["kind"],
        peer_gbs=peer.get("bandwidth_gbs"),
        peer_latency_us=peer.get("latency_us"),
        peer_pairs=pairs,
    )


def _check_device_tables(path: Path, prefix: str, fields: dict[str, Any]) -> None:
    """``device_expert_ms`` and ``device_layer_ms`` need ``device_tokens``, one value each."""
    tokens = fields.get("device_tokens")
    for key in ("device_expert_ms", "device_layer_ms", "device_copied_expert_ms"):
        table = fields.get(key)
        if table is None:
            continue
        if tokens is None:
            raise ProfileError(path, "needs device_tokens (the token counts it was measured at)",
                               f"{prefix}{key}")  # fmt: skip
        if len(table) != len(tokens):
            raise ProfileError(
                path, f"has {len(table)} values for {len(tokens)} device_tokens", f"{prefix}{key}"
            )


def _check_dtype(path: Path, key: str, dtype: str) -> None:
    from daopsim.simulator.precisions import DTYPE_BYTES

    if dtype not in DTYPE_BYTES:
        raise ProfileError(path, f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}", key)
