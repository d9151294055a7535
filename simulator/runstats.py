"""What a run returns: :class:`RunStats`, read from the engine core's state once it is over.

The core (``daopsim.simulator.core``) times a run and counts it in its ``Counters``; this module
reports it, once a run: each resource's busy seconds and its work after the end, the SSD tier's
totals and, on several GPUs, the per-GPU figures of ``run --json``. ``daopsim.simulator.results``
computes the metrics from a :class:`RunStats` only (docs/metrics.md); the reference engine
returns one too, filled by its own accounting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from daopsim.simulator.core.loop import Engine
    from daopsim.simulator.core.machine import Machine
    from daopsim.simulator.core.ops import Counters
    from daopsim.simulator.core.resources import Lane


@dataclass
class RunStats:
    """What a run returns to results.py: counters, end-to-end time and busy time per resource."""

    counters: Counters
    #: simulated seconds until the last token is out (background work does not extend it)
    e2e: float
    #: busy seconds per named resource: ``gpu``, each link (``h2d``, ``d2h``), each pool (``cpu``)
    busy: dict[str, float]
    #: workers per pool (``cpu``)
    workers: dict[str, int]
    #: with a host-memory budget: the SSD tier's totals (ssd_bytes, ssd_reads, ssd_stall_s,
    #: host_memory_peak_bytes, host_evictions); None when host memory is not modelled
    host_tier: dict[str, float] | None = None
    #: busy seconds after ``e2e`` of the copy directions (``h2d``, ``d2h``), the CPU workers
    #: (``cpu``) and the drive (``ssd``): work issued before the last token that ends after it,
    #: left out of the busy fractions (docs/metrics.md, "Busy fractions")
    after: dict[str, float] = field(default_factory=dict)
    #: lanes behind each copy direction (``h2d``, ``d2h``): one per GPU uplink
    servers: dict[str, int] = field(default_factory=dict)


def run_stats(eng: Engine, e2e: float) -> RunStats:
    """The statistics of ``eng``'s run once it is over (its last token out at ``e2e``)."""
    c, m = eng.c, eng.machine
    c.max_occupancy = eng.res.max_occupancy
    c.hits_per_layer = np.array(eng.applier.hits, dtype=np.int64)
    c.accesses_per_layer = np.array(eng.applier.accesses, dtype=np.int64)
    c.host_syncs = m.host.syncs if m.host is not None else 0
    c.host_syncs += sum(h.syncs for h in m.hosts[1:] if h is not None)
    stats = RunStats(counters=c, e2e=e2e, busy=busy(m), workers=workers(m))
    stats.after, stats.servers = work_after(m, e2e)
    if eng.ssd_cfg is not None:
        stats.host_tier = _ssd_totals(eng, stats.busy)
    return stats


def _ssd_totals(eng: Engine, busy: dict[str, float]) -> dict[str, float]:
    """The SSD tier's totals for the metrics (and the drive's busy time)."""
    cfg, tier = eng.ssd_cfg, eng.ssd
    if tier is None:  # every expert fits: the host holds them all, the drive is idle
        peak = cfg.nonexpert_bytes + cfg.total * cfg.expert_bytes
        out = {"ssd_bytes": 0, "ssd_reads": 0, "ssd_stall_s": 0.0, "host_evictions": 0}
        busy["ssd"] = 0.0
    else:
        peak = tier.peak_bytes
        out = {
            "ssd_bytes": tier.ssd_bytes,
            "ssd_reads": tier.ssd_reads,
            "ssd_stall_s": tier.ssd_stall,
            "host_evictions": tier.host_evictions,
        }
        busy["ssd"] = tier.lane.busy
    out["host_memory_peak_bytes"] = peak
    out["host_memory_budget_bytes"] = cfg.budget_bytes
    return out


def lanes(m: Machine) -> dict[str, Lane]:
    """Every distinct lane by name: GPU streams, uplinks, peer lanes, CPU workers, drives."""
    out: dict[str, Lane] = {lane.name: lane for lane in m.gpus}
    for h, d in m.uplinks:
        out.update((lane.name, lane) for lane in h.engines.lanes + d.engines.lanes)
    for link in m.peers.values():
        out.update((lane.name, lane) for lane in link.engines.lanes)
    for lane in m.cpu.lanes:
        out[lane.name] = lane
    out.update(m.drives)
    return out


def busy(m: Machine) -> dict[str, float]:
    """Busy seconds: ``gpu``, ``h2d``, ``d2h`` (summed over GPUs and distinct lanes) and
    ``cpu`` (summed workers); with several GPUs also every lane by its own name."""
    ups = {id(lane): lane for h, _ in m.uplinks for lane in h.engines.lanes}
    downs = {id(lane): lane for _, d in m.uplinks for lane in d.engines.lanes}
    out = {
        "gpu": sum(g.busy for g in m.gpus),
        "h2d": sum(lane.busy for lane in ups.values()),
        "d2h": sum(lane.busy for lane in downs.values()),
        "cpu": sum(lane.busy for lane in m.cpu.lanes),
    }
    if m.n_gpus > 1:
        for name, lane in lanes(m).items():
            out.setdefault(name, lane.busy)
    return out


def work_after(m: Machine, e2e: float) -> tuple[dict[str, float], dict[str, int]]:
    """Busy seconds each copy direction, the CPU workers and the drive spend after the run's
    end ``e2e``, and the lanes behind each copy direction. Every request is issued by the end
    and a lane serves its queue back to back, so a lane busy at ``e2e`` stays busy until its
    ``free_at``: its work after the end is ``max(0, free_at - e2e)``."""
    groups = {
        "h2d": list({id(lane): lane for h, _ in m.uplinks for lane in h.engines.lanes}.values()),
        "d2h": list({id(lane): lane for _, d in m.uplinks for lane in d.engines.lanes}.values()),
        "cpu": list(m.cpu.lanes),
    }
    for name, lane in m.drives.items():
        groups[name] = [lane]
    after = {n: sum(max(0.0, lane.free_at - e2e) for lane in ls) for n, ls in groups.items()}
    return after, {"h2d": len(groups["h2d"]), "d2h": len(groups["d2h"])}


def workers(m: Machine) -> dict[str, int]:
    """Workers per pool (``cpu``), and with several GPUs their number (``gpu``)."""
    out = {"cpu": len(m.cpu.lanes)}
    if m.n_gpus > 1:
        out["gpu"] = m.n_gpus
    return out


def multi_metrics(eng: Engine) -> dict[str, Any]:
    """Per-GPU and per-peer-path figures of a run on several GPUs (``run --json``)."""
    m, pl, ex, res = eng.machine, eng.placement, eng.ex, eng.res
    gpus = []
    for k, lane in enumerate(m.gpus):
        gpus.append(
            {
                "gpu": k,
                "busy_s": lane.busy,
                "slots": res.cap[k] - eng.spec.staging_buffers,
                "max_slots_used": res.peak[k],
                "expert_computations": ex.streams[k].experts,
                "h2d_expert_bytes": ex.streams[k].h2d_bytes,
                "d2h_expert_bytes": ex.streams[k].d2h_bytes,
                "uplink": m.uplinks[k][0].engines.name,
                "layers": pl.layers_of[k][:1] + pl.layers_of[k][-1:],
                "experts_per_layer": len(pl.experts_of[k]),
                "experts": list(pl.experts_of[k]),
            }
        )
    return {
        "gpus": pl.n,
        "mode": pl.mode,
        "expert_placement": pl.rule,
        "peer_kind": m.multi.peer_kind if m.multi is not None else None,
        "per_gpu": gpus,
        "peer_bytes": dict(sorted(ex.peer_bytes.items())),
        "peer_bytes_total": sum(ex.peer_bytes.values()),
    }
