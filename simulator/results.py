"""Run results: the metrics (defined in docs/metrics.md), the timeline and their exports.

``RunResult`` is what ``simulate()`` returns: ``.metrics`` (a flat dict), ``.timeline`` (one row
per operation, pandas), ``.to_perfetto(path)`` (Chrome/Perfetto trace JSON), ``.plot_timeline()``
and ``.plot_hit_rate()`` (matplotlib), ``.write(out_dir)`` (all of them, swapped in as one set).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from daopsim.simulator import perfetto
from daopsim.simulator.output import output_dir, write_figure, write_file, write_text

if TYPE_CHECKING:
    from daopsim.simulator.hardware import HardwareProfile
    from daopsim.simulator.runstats import RunStats

#: The metrics every run reports, in display order (docs/metrics.md defines each).
METRIC_KEYS = (
    "tokens_per_s",
    "decode_tokens_per_s",
    "ttft_s",
    "tpot_mean_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "e2e_s",
    "hit_rate",
    "prefill_hit_rate",
    "decode_hits",
    "decode_accesses",
    "prefill_hits",
    "prefill_accesses",
    "h2d_bytes",
    "d2h_bytes",
    "gpu_busy_frac",
    "cpu_busy_frac",
    "h2d_busy_frac",
    "d2h_busy_frac",
    "stall_s",
    "transfer_stall_s",
    "cpu_wait_s",
    "dispatch_stall_s",
    "host_syncs",
    "gpu_expert_s",
    "gpu_nonexpert_s",
    "cpu_expert_evals",
    "cpu_precalc_evals",
    "cpu_precalc_wasted",
    "fetches",
    "temp_copies",
    "evictions",
    "prefetches",
    "prefetch_precision",
    "prefetch_wasted_bytes",
    "routing_replaced_frac",
    "replaced_mispredicted_frac",
    "replaced_degraded_frac",
    "gate_mass_preserved",
    "low_precision_gate_mass",
    "low_bit_copies",
    "energy_j",
    "tokens_per_kj",
    "energy_gpu_j",
    "energy_cpu_j",
    "energy_dram_j",
    "energy_device_j",
    "energy_wall_j",
    "tokens_per_kj_device",
    "tokens_per_kj_wall",
    "decode_tokens",
    "prefill_tokens",
    "sequences",
    "max_slots_held",
    # the SSD tier: only with a host-memory budget (docs/serving.md, "An SSD tier")
    "ssd_bytes",
    "ssd_reads",
    "ssd_stall_s",
    "ssd_busy_frac",
    "host_evictions",
    "host_memory_peak_bytes",
    "host_memory_budget_bytes",
)
#: metrics a run reports only when their mechanism is on (a host-memory budget): a sweep table
#: has their columns only if some row has them
OPTIONAL_METRIC_KEYS = frozenset(METRIC_KEYS[METRIC_KEYS.index("ssd_bytes") :])


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else float("nan")


def busy_frac(busy: float, after_end: float, servers: int, e2e: float) -> float:
    """A busy fraction: busy time within the run's window ``[0, e2e]`` over ``servers x e2e``.

    ``after_end`` is the work done after the last token ended (prefetches issued for a next
    token that never came); it is left out, so the fraction is at most 1. The clamp to [0, 1]
    only absorbs float rounding of sums of durations (docs/metrics.md, "Busy fractions").
    """
    den = float(servers) * float(e2e)
    if not den:
        return float("nan")
    return min(1.0, max(0.0, (float(busy) - float(after_end)) / den))


def compute_metrics(
    stats: RunStats,
    hw: HardwareProfile,
    after_end: Mapping[str, float] | None = None,
    servers: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """Metrics from the run's statistics (counters and busy time per named resource).

    ``after_end``: seconds of work each copy direction (``h2d``, ``d2h``) and the CPU pool
    (``cpu``) did after the run's end; ``servers``: how many lanes serve a copy direction (one
    per uplink with several GPUs). They default to none and one
    (each engine reports them in ``RunStats.after``).
    """
    c = stats.counters
    e2e = float(stats.e2e)
    late = dict(after_end or {})
    lanes = dict(servers or {})
    lat = np.asarray(c.token_latency, dtype=np.float64)
    busy = stats.busy
    workers = stats.workers["cpu"]
    n_gpus = stats.workers.get("gpu", 1)  # several GPUs (simulator/multigpu.py)
    cpu_busy = busy["cpu"]
    m: dict[str, float] = {
        "tokens_per_s": _ratio(c.decode_tokens, e2e),
        "decode_tokens_per_s": _ratio(c.decode_tokens, c.decode_time),
        "ttft_s": float(np.mean(c.ttft)) if c.ttft else float("nan"),
        "tpot_mean_s": float(lat.mean()) if lat.size else float("nan"),
        "tpot_p50_s": float(np.percentile(lat, 50)) if lat.size else float("nan"),
        "tpot_p99_s": float(np.percentile(lat, 99)) if lat.size else float("nan"),
        "e2e_s": e2e,
        "hit_rate": _ratio(c.decode_hits, c.decode_accesses),
        "prefill_hit_rate": _ratio(c.prefill_hits, c.prefill_accesses),
        "decode_hits": int(c.decode_hits),
        "decode_accesses": int(c.decode_accesses),
        "prefill_hits": int(c.prefill_hits),
        "prefill_accesses": int(c.prefill_accesses),
        "h2d_bytes": int(c.h2d_bytes),
        "d2h_bytes": int(c.d2h_bytes),
        "gpu_busy_frac": busy_frac(busy["gpu"], 0.0, n_gpus, e2e),
        "cpu_busy_frac": busy_frac(cpu_busy, late.get("cpu", 0.0), workers, e2e),
        "h2d_busy_frac": busy_frac(busy["h2d"], late.get("h2d", 0.0), lanes.get("h2d", 1), e2e),
        "d2h_busy_frac": busy_frac(busy["d2h"], late.get("d2h", 0.0), lanes.get("d2h", 1), e2e),
        "stall_s": c.transfer_stall + c.cpu_wait,
        "transfer_stall_s": c.transfer_stall,
        "cpu_wait_s": c.cpu_wait,
        "dispatch_stall_s": c.dispatch_stall,
        "host_syncs": int(c.host_syncs),
        "gpu_expert_s": c.gpu_expert_busy,
        "gpu_nonexpert_s": c.gpu_nonexpert_busy,
        "cpu_expert_evals": int(c.cpu_expert_evals + c.cpu_precalc_evals),
        "cpu_precalc_evals": int(c.cpu_precalc_evals),
        "cpu_precalc_wasted": int(c.precalc_wasted),
        "fetches": int(c.fetches),
        "temp_copies": int(c.temp_copies),
        "evictions": int(c.evictions),
        "prefetches": int(c.prefetches),
        "prefetch_precision": _ratio(c.prefetch_used, c.prefetches),
        "prefetch_wasted_bytes": int(c.prefetch_wasted_bytes),
        "routing_replaced_frac": _ratio(
            c.replaced_mispredicted + c.replaced_degraded, c.true_accesses
        ),
        "replaced_mispredicted_frac": _ratio(c.replaced_mispredicted, c.true_accesses),
        "replaced_degraded_frac": _ratio(c.replaced_degraded, c.true_accesses),
        "gate_mass_preserved": _ratio(c.gate_mass_kept, c.gate_mass_total),
        "low_precision_gate_mass": _ratio(c.gate_mass_low_bit, c.gate_mass_total),
        "low_bit_copies": int(c.low_bit_copies),
        "decode_tokens": int(c.decode_tokens),
        "prefill_tokens": int(c.prefill_tokens),
        "sequences": int(c.sequences),
        "max_slots_held": int(c.max_occupancy),
    }
    cpu_calls = int(c.cpu_expert_evals + c.cpu_precalc_evals)
    energy = energy_breakdown(hw, e2e, busy["gpu"], cpu_busy, n_gpus, cpu_calls)
    m.update(energy)
    tokens = c.decode_tokens
    m["tokens_per_kj"] = _ratio(tokens, energy["energy_j"] / 1000.0)
    m["tokens_per_kj_device"] = _ratio(tokens, energy["energy_device_j"] / 1000.0)
    m["tokens_per_kj_wall"] = _ratio(tokens, energy["energy_wall_j"] / 1000.0)
    return m


#: The energy keys of a run's metrics (all NaN when the profile has no [power] section).
ENERGY_KEYS = (
    "energy_gpu_j",
    "energy_cpu_j",
    "energy_dram_j",
    "energy_j",
    "energy_device_j",
    "energy_wall_j",
)


def energy_breakdown(
    hw: HardwareProfile,
    e2e: float,
    gpu_busy: float,
    cpu_busy: float,
    gpus: int = 1,
    cpu_calls: int = 0,
) -> dict[str, float]:
    """Energy over the run by part and level, joules (NaN everywhere without a [power] section).

    - GPU: the context-holding active idle for the whole run, plus (busy - active idle) while a
      kernel runs; with ``gpus`` GPUs, each idles for the whole run and ``gpu_busy`` is their
      summed busy time.
    - CPU package: the driving/spinning level for the whole run, plus (busy - wait) while CPU
      experts run and while their worker threads spin afterwards: ``cpu_calls`` calls each
      followed by up to ``cpu_spin_ms`` of spinning (capped at the run time: workers share one
      socket, and a spin that the next call cuts short is busy time already).
    - DRAM: its average power over the run.
    - ``energy_j`` = GPU + CPU package; ``energy_device_j`` adds DRAM; ``energy_wall_j`` adds
      the platform and divides by the power supply's efficiency.
    """
    power = getattr(hw, "power", None)
    if power is None:
        return dict.fromkeys(ENERGY_KEYS, float("nan"))
    p = power.resolved(hw.cpu.cores_used)
    assert p.gpu_active_idle_w is not None and p.cpu_wait_w is not None
    assert p.dram_w is not None and p.platform_w is not None and p.psu_efficiency is not None
    gpu = gpus * p.gpu_active_idle_w * e2e + (p.gpu_busy_w - p.gpu_active_idle_w) * min(
        gpu_busy, gpus * e2e
    )
    assert p.cpu_spin_ms is not None
    active = min(cpu_busy + cpu_calls * p.cpu_spin_ms * 1e-3, e2e)
    cpu = p.cpu_wait_w * e2e + (p.cpu_busy_w - p.cpu_wait_w) * active
    dram = p.dram_w * e2e
    device = gpu + cpu + dram
    wall = (device + p.platform_w * e2e) / p.psu_efficiency
    return {
        "energy_gpu_j": float(gpu),
        "energy_cpu_j": float(cpu),
        "energy_dram_j": float(dram),
        "energy_j": float(gpu + cpu),
        "energy_device_j": float(device),
        "energy_wall_j": float(wall),
    }


#: The files ``RunResult.write`` puts in its folder (and the older uncompressed Perfetto name,
#: so a folder written by an earlier version can be replaced).
RUN_FILES = (
    "metrics.json",
    "timeline.parquet",
    "trace.perfetto.json.gz",
    "gantt.png",
    "hit_rate.png",
    "trace.perfetto.json",
    "requests.parquet",
)

# The Perfetto export lives in simulator/perfetto.py; these names stay for existing callers.
TICKS_PER_US = perfetto.TICKS_PER_US
_lane_ticks = perfetto.lane_ticks
_resource_order = perfetto.resource_order


def _write_json(path: str, doc: Any, compress: bool) -> None:
    """Compact JSON, gzipped (fixed header time, so equal runs give equal bytes) if asked."""
    data = json.dumps(doc, separators=(",", ":")).encode()
    if compress:
        with (
            open(path, "wb") as raw,
            gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz,
        ):
            gz.write(data)
    else:
        with open(path, "wb") as fh:
            fh.write(data)


class _Timeline:
    """``RunResult.timeline``: a DataFrame, or a streamed timeline's Parquet file (a
    :class:`~pathlib.Path`, see simulator/recorder.py) read on first use and kept."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> pd.DataFrame | None:
        if obj is None:
            return None  # the dataclass field's default
        value = obj.__dict__.get(self.slot)
        if isinstance(value, Path):
            from daopsim.simulator.recorder import read_timeline

            value = obj.__dict__[self.slot] = read_timeline(value)
        return value  # type: ignore[no-any-return]

    def __set__(self, obj: Any, value: pd.DataFrame | Path | None) -> None:
        obj.__dict__[self.slot] = value
        obj.__dict__["_timeline_file"] = value if isinstance(value, Path) else None


@dataclass
class RunResult:
    """The outcome of one run: configuration, metrics, timeline and per-layer hit rates."""

    config: dict[str, Any]
    metrics: dict[str, float]
    per_layer_hit_rate: list[float]
    #: one row per operation; a run that streamed its timeline to a file (``simulate(record=
    #: path)``) reads it from there when first asked (``timeline_file``)
    timeline: pd.DataFrame | None = _Timeline()  # type: ignore[assignment]
    occupancy: pd.DataFrame | None = None
    token_latency: np.ndarray = field(default_factory=lambda: np.empty(0))
    ttft: np.ndarray = field(default_factory=lambda: np.empty(0))
    #: serving runs (docs/serving.md): the ``serving`` summary and one row per request
    serving: dict[str, Any] | None = None
    requests: pd.DataFrame | None = None

    @property
    def timeline_file(self) -> Path | None:
        """The Parquet file a streamed timeline was written to (None: kept in memory)."""
        return self.__dict__.get("_timeline_file")  # type: ignore[no-any-return]

    @property
    def bound(self) -> bool:
        """True for bounds (clairvoyant policies, all-GPU), not realisable policies."""
        return bool(self.config.get("bound"))

    def to_dict(self) -> dict[str, Any]:
        """The ``run --json`` object: configuration keys at top level, ``metrics`` inside."""
        out = {k: v for k, v in self.config.items()}
        out["metrics"] = {k: self.metrics[k] for k in METRIC_KEYS if k in self.metrics}
        out["energy"] = {
            "gpu_j": self.metrics.get("energy_gpu_j"),
            "cpu_j": self.metrics.get("energy_cpu_j"),
            "dram_j": self.metrics.get("energy_dram_j"),
            "device_j": self.metrics.get("energy_device_j"),
            "wall_j": self.metrics.get("energy_wall_j"),
        }
        out["per_layer_hit_rate"] = self.per_layer_hit_rate
        if self.serving is not None:
            out["serving"] = self.serving
        return out

    def to_json(self) -> str:
        """Deterministic JSON (sorted keys; NaN as null)."""
        return json.dumps(_json_safe(self.to_dict()), indent=2, sort_keys=True)

    def to_perfetto(self, path: str | os.PathLike[str]) -> Path:
        """Write a Chrome/Perfetto trace: one track per resource, a slot-occupancy counter.

        A path ending in ``.gz`` is written gzip-compressed (Perfetto and chrome://tracing open
        it as is). Slices on one track never overlap (see ``TICKS_PER_US``). A streamed
        timeline is read from its file block by block (simulator/perfetto.py).
        """
        source = self._timeline_source()
        if source is None:
            raise ValueError("this run was made with record=False: no timeline")
        meta = _json_safe({k: v for k, v in self.config.items() if k != "cost_sources"})
        write = perfetto.writer(source, self.occupancy, meta, perfetto.is_gzip_path(path))
        return write_file(path, write)

    def _timeline_source(self) -> pd.DataFrame | Path | None:
        """The timeline as loaded, else its file, else None (not recorded)."""
        loaded = self.__dict__.get("_timeline")
        if isinstance(loaded, pd.DataFrame) or loaded is None:
            return loaded
        return self.timeline_file

    def _timeline_window(
        self, tokens: tuple[int, int] | None, seq: int | None
    ) -> tuple[pd.DataFrame, tuple[int, int], int]:
        """The rows of ``plot_timeline``'s window, its tokens and sequence; from a streamed
        timeline's file only the rows of the window are read."""
        source = self._timeline_source()
        if source is None:
            raise ValueError("this run was made with record=False: no timeline")
        if isinstance(source, pd.DataFrame):
            keys = source[["seq", "token"]]
        else:
            keys = pd.read_parquet(source, columns=["seq", "token"])
        if seq is None:
            seq = int(keys["seq"].iloc[0]) if len(keys) else 0
        sub = keys[keys["seq"] == seq]
        if tokens is None:
            dec = sub[sub["token"] > sub["token"].min()] if len(sub) else sub
            first = int(dec["token"].min()) if len(dec) else 0
            tokens = (first, first + 3)
        if isinstance(source, pd.DataFrame):
            sub = source[source["seq"] == seq]
            win = sub[(sub["token"] >= tokens[0]) & (sub["token"] < tokens[1])]
        else:
            from daopsim.simulator.recorder import read_timeline

            win = read_timeline(
                source,
                filters=[("seq", "==", seq), ("token", ">=", tokens[0]), ("token", "<", tokens[1])],
            )
        return win, tokens, seq

    def plot_timeline(
        self, ax: Any = None, tokens: tuple[int, int] | None = None, seq: int | None = None
    ) -> Any:
        """Gantt chart of a window of decode tokens (default: the first 3 of the first sequence)."""
        import matplotlib.pyplot as plt

        win, tokens, seq = self._timeline_window(tokens, seq)
        if ax is None:
            _, ax = plt.subplots(figsize=(11, 4.0), layout="constrained")
        resources = sorted(win["resource"].astype(str).unique(), key=_resource_order)
        colors = {
            "nonexpert": "#9aa5b1",
            "expert": "#2f6fb0",
            "fetch": "#d9822b",
            "prefetch": "#f0b429",
            "temp": "#c23b22",
            "writeback": "#8e44ad",
            "activation": "#27ae60",
            "cpu_expert": "#16a085",
            "precalc": "#1abc9c",
            "weights": "#6c7a89",  # non-expert weight copies (ZeRO-3, op offload)
            "embedding": "#4b5563",
        }
        t0 = float(win["start"].min()) if len(win) else 0.0
        for y, r in enumerate(resources):
            rows = win[win["resource"].astype(str) == r]
            for kind, grp in rows.groupby(rows["kind"].astype(str), observed=True):
                spans = list(
                    zip((grp["start"] - t0) * 1e3, (grp["end"] - grp["start"]) * 1e3, strict=True)
                )
                ax.broken_barh(spans, (y - 0.4, 0.8), color=colors.get(kind, "#555"), label=kind)
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles, strict=True))
        if uniq:  # under the axes: over the bars it would hide operations
            ax.legend(
                uniq.values(),
                uniq.keys(),
                loc="upper center",
                bbox_to_anchor=(0.5, -0.22),
                fontsize=7,
                ncol=min(len(uniq), 8),
                frameon=False,
            )
        ax.set_yticks(range(len(resources)), resources)
        ax.set_xlabel("simulated time since window start (ms)")
        title = (
            f"{self.config.get('policy')} on {self.config.get('hw')}: sequence {seq},"
            f" tokens {tokens[0]}-{tokens[1] - 1}"
            f" (trace {Path(str(self.config.get('trace'))).name})"
        )
        ax.set_title(textwrap.fill(title, 100), fontsize=10)
        return ax

    def plot_hit_rate(self, ax: Any = None) -> Any:
        """Hit rate per layer (decode accesses)."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(8, 3.2), layout="constrained")
        from daopsim.simulator.colors import policy_color

        rates = self.per_layer_hit_rate
        policy = str(self.config.get("policy"))
        ax.bar(range(len(rates)), rates, color=policy_color(policy))
        ax.set_xlabel("MoE layer (index)")
        ax.set_ylabel("hit rate, decode (share of accesses)")
        ax.set_ylim(0, 1.04)
        title = (
            f"{policy} on {self.config.get('hw')}, {self.config.get('gpu_experts')} GPU experts "
            f"(trace {Path(str(self.config.get('trace'))).name})"
        )
        ax.set_title(textwrap.fill(title, 70), fontsize=10)
        return ax

    def write(
        self,
        out_dir: str | os.PathLike[str],
        plots: bool = True,
        flag: str | None = None,
        inputs: tuple[str | os.PathLike[str] | None, ...] = (),
    ) -> dict[str, Path]:
        """metrics.json, timeline.parquet, trace.perfetto.json.gz and PNG plots, as one set.

        The files are written into a new sibling folder that then replaces ``out_dir`` whole
        (simulator/output.py): a reader sees the previous set or this one, never a mix, and a
        failure leaves the previous set as it was. ``out_dir`` may hold only files of this set.
        """
        target = Path(out_dir)
        names: dict[str, str] = {"metrics": "metrics.json"}
        with output_dir(target, RUN_FILES, flag=flag, inputs=inputs) as stage:
            write_text(stage / "metrics.json", self.to_json() + "\n")
            source = self._timeline_source()
            if source is not None:
                if isinstance(source, Path):
                    write_file(stage / "timeline.parquet", lambda tmp: _link_or_copy(source, tmp))
                else:
                    tl = source
                    write_file(
                        stage / "timeline.parquet", lambda tmp: tl.to_parquet(tmp, index=False)
                    )
                self.to_perfetto(stage / "trace.perfetto.json.gz")
                names.update(timeline="timeline.parquet", perfetto="trace.perfetto.json.gz")
            if self.requests is not None:
                req = self.requests
                write_file(stage / "requests.parquet", lambda tmp: req.to_parquet(tmp, index=False))
                names["requests"] = "requests.parquet"
            if plots:
                import matplotlib

                matplotlib.use("Agg")

                if source is not None:
                    ax = self.plot_timeline()
                    write_figure(ax.figure, stage / "gantt.png", dpi=110)
                    names["gantt"] = "gantt.png"
                fig = self.plot_hit_rate().figure
                write_figure(fig, stage / "hit_rate.png", dpi=110)
                names["hit_rate"] = "hit_rate.png"
        if isinstance(self.__dict__.get("_timeline"), Path):
            # still not loaded: read it from the set just written from now on (the file it
            # came from may be a temporary one)
            self.timeline = target / "timeline.parquet"  # type: ignore[assignment]
        return {k: target / v for k, v in names.items()}


def _link_or_copy(src: Path, tmp: str) -> None:
    """``tmp`` becomes ``src``'s content: a hard link when the file system allows one."""
    os.unlink(tmp)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def host_tier_metrics(stats: Any, after_end: float = 0.0) -> dict[str, float]:
    """The SSD tier's metrics (docs/metrics.md) from a run's statistics; ``after_end`` is the
    drive's work after the run's end (background reads), left out of ``ssd_busy_frac``."""
    tier = dict(stats.host_tier)
    e2e = stats.e2e
    busy = stats.busy.get("ssd", 0.0)
    tier["ssd_busy_frac"] = busy_frac(busy, after_end, 1, e2e) if e2e > 0 else 0.0
    return tier
