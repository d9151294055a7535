"""Hardware profiles: one TOML file per machine (GPU, host link, CPU, power, measured constants).

A profile holds facts, never formulas: the cost model (simulator/costs.py) turns them into seconds.
Every key is validated on load; a mistake raises :class:`ProfileError` naming the file and the key
(``gpu.mem_bw_gbs``), so the CLI prints one line and exits 2. The format is documented in
docs/hardware-profiles.md.

This module reads profile files (a bundled name or a path, ``extends = "NAME"`` resolved) and
holds the public names of its parts: ``hardware_spec`` (what a profile holds: ``GpuSpec``,
``LinkSpec``, ``CpuSpec``, ..., ``HardwareProfile``) and ``hardware_schema`` (each key's type
and range, and :func:`parse_profile`, which checks a table and builds the profile).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from daopsim.simulator.data import non_regular_kind, profiles_dir, read_toml
from daopsim.simulator.errors import ProfileError, UserError, did_you_mean
from daopsim.simulator.hardware_schema import MAX_VALUES, MIN_VALUES, parse_profile
from daopsim.simulator.hardware_spec import (
    CONTEXT_STEP_W,
    CPU_STREAM_FALLBACK,
    CPU_STREAM_FAMILIES,
    DEFAULT_CPU_SPIN_MS,
    DEFAULT_DRAM_W,
    DEFAULT_PLATFORM_W,
    DEFAULT_PSU_EFFICIENCY,
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


def _read_toml(p: Path) -> dict[str, Any]:
    kind = non_regular_kind(p)
    if kind is not None:  # reading a FIFO or a device would block or never end
        raise ProfileError(p, f"is {kind}, not a regular profile file")
    if not p.is_file():
        raise ProfileError(p, "no such profile file")
    try:
        return read_toml(p, "profile")
    except UserError as exc:  # the shared reader's message, as a ProfileError
        raise ProfileError(p, str(exc).removeprefix(f"{p}: ")) from None


def _base_path(p: Path, base: Any) -> Path:
    """The file ``extends = NAME`` names: a bundled profile, or a path relative to ``p``."""
    if not isinstance(base, str) or not base.strip():
        raise ProfileError(p, f"must name a profile; got {base!r}", "extends")
    bundled = bundled_profiles()
    if base in bundled:
        return bundled[base]
    candidate = Path(base).expanduser()
    if not candidate.is_absolute():
        candidate = p.parent / candidate
    if candidate.suffix != ".toml":
        candidate = candidate.with_suffix(".toml")
    if not candidate.is_file():
        raise ProfileError(
            p, f"extends unknown profile {base!r} (not bundled, no file {candidate})", "extends"
        )
    return candidate


def _resolved(p: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The TOML document with its ``extends`` chain merged in (child keys win, table by table)."""
    data = _read_toml(p)
    if "extends" not in data:
        return data
    base_path = _base_path(p, data.pop("extends"))
    if base_path.resolve() in seen or base_path.resolve() == p.resolve():
        raise ProfileError(p, f"extends chain loops back to {base_path}", "extends")
    base = _resolved(base_path, (*seen, p.resolve()))
    merged: dict[str, Any] = {k: v for k, v in base.items() if k not in ("name", "description")}
    gpu_base, gpu_child = merged.get("gpu"), data.get("gpu")
    if (
        isinstance(gpu_base, dict)
        and isinstance(gpu_child, dict)
        and "mem_bw_gbs" in gpu_child
        and "spec_mem_bw_gbs" not in gpu_child
    ):
        # the spec figure qualifies the base's own mem_bw_gbs: a child naming another card's
        # bandwidth (rtx4080-pcie4 over rtx4090-pcie4) must not inherit it
        merged["gpu"] = {k: v for k, v in gpu_base.items() if k != "spec_mem_bw_gbs"}
    gpu_base = merged.get("gpu")
    if (
        isinstance(gpu_base, dict)
        and isinstance(gpu_child, dict)
        and "name" in gpu_child
        and gpu_child["name"] != gpu_base.get("name")
        and "ggml_prompt_tflops" not in gpu_child
    ):
        # a prompt rate measured on one card belongs to that card: a child naming another
        # card (rtx4080-pcie4 over rtx4090-pcie4) states its own or has none
        merged["gpu"] = {k: v for k, v in gpu_base.items() if k != "ggml_prompt_tflops"}
    for key, value in data.items():
        old = merged.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            # one level deep: for [measured], a child's model table replaces the base's whole;
            # the CPU's stream tables ([cpu.core_stream_gbs], [cpu.stream_gbs]) merge family by
            # family, so a child can restate one kernel family
            both = {**old, **value}
            if key == "cpu":
                for sub in ("core_stream_gbs", "stream_gbs"):
                    a, b = old.get(sub), value.get(sub)
                    if isinstance(a, dict) and isinstance(b, dict):
                        both[sub] = {**a, **b}
            merged[key] = both
        else:
            merged[key] = value
    return merged


def read_profile(path: str | os.PathLike[str]) -> HardwareProfile:
    """Load and validate one TOML file (following ``extends = "NAME"`` to its base profile)."""
    p = Path(path)
    return parse_profile(_resolved(p), p)


def bundled_profiles() -> dict[str, Path]:
    """Bundled profile files by name (file stem), sorted."""
    return {p.stem: p for p in sorted(profiles_dir().glob("*.toml"))}


def load_profile(name_or_path: str | os.PathLike[str]) -> HardwareProfile:
    """A bundled profile by name (``a6000-pcie4``) or a user TOML path."""
    text = str(name_or_path)
    bundled = bundled_profiles()
    if text in bundled:
        return read_profile(bundled[text])
    if text.lower() in bundled:
        return read_profile(bundled[text.lower()])
    if text.endswith(".toml") or os.sep in text or Path(text).expanduser().exists():
        return read_profile(Path(text).expanduser())
    raise UserError(
        f"unknown hardware profile {text!r}: not a file and not a bundled profile"
        f"{did_you_mean(text, bundled)} (valid: {', '.join(bundled) or '(none)'})"
    )


def list_profiles() -> list[HardwareProfile]:
    """Every bundled profile, loaded and validated, sorted by name."""
    return [read_profile(p) for p in bundled_profiles().values()]


__all__ = [
    "CONTEXT_STEP_W",
    "CPU_STREAM_FALLBACK",
    "CPU_STREAM_FAMILIES",
    "DEFAULT_CPU_SPIN_MS",
    "DEFAULT_DRAM_W",
    "DEFAULT_PLATFORM_W",
    "DEFAULT_PSU_EFFICIENCY",
    "LINK_KINDS",
    "LOAD_PATHS",
    "MAX_VALUES",
    "MEMORY_TYPES",
    "MIN_VALUES",
    "PEER_KINDS",
    "CpuSpec",
    "GpuSpec",
    "HardwareProfile",
    "LinkSpec",
    "MeasuredModel",
    "MultiGpuSpec",
    "PowerSpec",
    "SsdSpec",
    "bundled_profiles",
    "list_profiles",
    "load_profile",
    "parse_profile",
    "read_profile",
]
