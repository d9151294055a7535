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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from daopsim.simulator import perfetto

# the metrics (their registry, computation and energy model) live in simulator/metrics.py;
# these names stay importable from here for existing callers
from daopsim.simulator.metrics import ENERGY_KEYS as ENERGY_KEYS
from daopsim.simulator.metrics import METRIC_KEYS as METRIC_KEYS
from daopsim.simulator.metrics import OPTIONAL_METRIC_KEYS as OPTIONAL_METRIC_KEYS
from daopsim.simulator.metrics import busy_frac as busy_frac
from daopsim.simulator.metrics import compute_metrics as compute_metrics
from daopsim.simulator.metrics import energy_breakdown as energy_breakdown
from daopsim.simulator.metrics import host_tier_metrics as host_tier_metrics
from daopsim.simulator.metrics import metric_keys
from daopsim.simulator.output import output_dir, write_figure, write_file, write_text

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
        out["metrics"] = {k: self.metrics[k] for k in metric_keys() if k in self.metrics}
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
