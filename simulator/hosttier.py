"""The host-memory tier and the NVMe drive behind it (issue 17 item 4; docs/serving.md,
"An SSD tier").

Without a host-memory budget the host holds a copy of every expert (the behaviour of every run
before this module existed). With one (``--host-memory-gb``, or the profile's
``cpu.memory_gb``), the host holds the non-expert weights plus as many expert copies as fit;
the rest live on the profile's NVMe drive (``[ssd]``) and are read when an operation needs them:

* ``page-cache`` (default): a read lands in host memory (the OS page cache) and takes its place
  among the host's expert copies, evicting the least recently used one when the budget is full;
  the H2D copy or the CPU expert then reads it from there;
* ``gds``: GPUDirect Storage, the drive writes a GPU-bound expert straight into GPU memory (no
  host copy, no host-memory bytes). CPU experts still need host memory and read through the
  page cache.

:class:`HostTier` is the state (which experts the host holds, their least-recently-used
order, when an in-flight read lands) and the drive's lane: one lane per drive, named ``ssd``,
serving one read at a time at the drive's full rate. Every read is submitted at the decision
that issued its operation, in issue order, and decisions never go back in time, so the fast
engine serves the lane at issue (exactly as ``simpy.Resource(capacity=1)`` fed in that order
would serve it) and submits the operation's first stage (its H2D copy, or its activations' trip
to the host) through its request heap when the read ends (``Op.at``). A GDS read
replaces the H2D copy (``LayerOp.gds``). The reference engine keeps its own model of the tier
(``simulator/reference/memory.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from daopsim.simulator.core.resources import Engines, Lanes
from daopsim.simulator.costs import CostModel
from daopsim.simulator.errors import UserError
from daopsim.simulator.hardware_spec import HardwareProfile
from daopsim.simulator.recorder import Recorder

#: ``--ssd-path`` choices
SSD_PATHS = ("page-cache", "gds")
#: the drive's lane in the timeline and in RunStats.busy
SSD_LANE = "ssd"


@dataclass(frozen=True)
class HostTierConfig:
    """A host-memory budget and how experts that do not fit are read from the drive."""

    budget_bytes: int
    #: ``page-cache`` or ``gds``
    path: str
    #: expert copies the budget holds beside the non-expert weights
    capacity: int
    #: the run's experts (the tier reads from the drive only when capacity is below it)
    total: int
    nonexpert_bytes: int
    expert_bytes: int

    @property
    def uses_ssd(self) -> bool:
        """Some experts do not fit in host memory: the drive is read."""
        return self.capacity < self.total


def host_tier_config(
    profile: HardwareProfile,
    costs: CostModel,
    host_memory_gb: float | None,
    ssd_path: str | None,
    access: str = "read",
) -> HostTierConfig | None:
    """The run's host tier from the options and the profile, or None (host memory unlimited).

    Bad input is a one-line :class:`UserError` naming the option or the profile field.
    """
    path = "page-cache" if ssd_path is None else ssd_path
    if path not in SSD_PATHS:
        raise UserError(f"--ssd-path must be one of {', '.join(SSD_PATHS)}; got {ssd_path!r}")
    if profile.link.unified and (host_memory_gb is not None or profile.cpu.memory_gb is not None):
        # the host's copies share the device memory, which already bounds them
        raise UserError(
            f"profile {profile.name} has unified memory: the host's expert copies live in the "
            "device memory (gpu.memory_gb), which bounds them; a separate host-memory budget "
            "(--host-memory-gb, cpu.memory_gb) does not apply"
        )
    if host_memory_gb is None:
        host_memory_gb = profile.cpu.memory_gb
        if host_memory_gb is None:
            if ssd_path is not None:
                raise UserError(
                    f"--ssd-path {ssd_path}: profile {profile.name} states no host memory "
                    "(cpu.memory_gb), so nothing is read from an SSD; give --host-memory-gb"
                )
            return None
    if isinstance(host_memory_gb, bool) or not isinstance(host_memory_gb, int | float):
        raise UserError(f"--host-memory-gb must be a number; got {host_memory_gb!r}")
    if not host_memory_gb > 0 or host_memory_gb != host_memory_gb or host_memory_gb == float("inf"):
        raise UserError(f"--host-memory-gb must be a positive number of GB; got {host_memory_gb}")
    budget = int(host_memory_gb * 1e9)
    model = costs.model
    ne = costs.host_nonexpert_bytes
    eb = costs.host_expert_bytes
    if budget < ne + eb:
        raise UserError(
            f"--host-memory-gb {host_memory_gb:g}: host memory too small for the non-expert "
            f"weights of {model.name} ({ne / 1e9:.2f} GB) plus one expert copy "
            f"({eb / 1e9:.3f} GB); give at least {(ne + eb) / 1e9:.2f}"
        )
    cfg = HostTierConfig(
        budget_bytes=budget,
        path=path,
        capacity=min(model.total_experts, (budget - ne) // eb),
        total=model.total_experts,
        nonexpert_bytes=ne,
        expert_bytes=eb,
    )
    if cfg.uses_ssd and profile.ssd is None:
        raise UserError(
            f"profile {profile.name} has no [ssd] table (field ssd), but --host-memory-gb "
            f"{host_memory_gb:g} holds only {cfg.capacity} of {cfg.total} experts: add an [ssd] "
            "table (docs/hardware-profiles.md) or give more host memory"
        )
    if cfg.uses_ssd and path == "gds" and access == "mmap":
        raise UserError(
            "--ssd-path gds: this policy reads weights through a memory map (the page cache), "
            "which GPUDirect Storage bypasses; use --ssd-path page-cache"
        )
    return cfg


class HostTier:
    """Which experts host memory holds (LRU), the drive lane, and the SSD counters."""

    def __init__(
        self,
        cfg: HostTierConfig,
        costs: CostModel,
        n_layers: int,
        n_experts: int,
        access: str,
        recorder: Recorder | None,
    ) -> None:
        self.cfg = cfg
        self.gds = cfg.path == "gds"
        self.recorder = recorder
        #: the drive (one lane), occupied through the engine's :class:`Lanes` (``lanes``,
        #: set by the engine before the first read)
        self.drive = Engines(SSD_LANE)
        self.lane = self.drive.lanes[0]
        self.lanes: Lanes | None = None
        self.read_s = costs.ssd_expert_s(access) if cfg.uses_ssd else 0.0
        self.expert_bytes = cfg.expert_bytes
        #: [layers, experts] host copies (the View's ``host_resident``)
        self.host = np.zeros((n_layers, n_experts), dtype=bool)
        #: when each host copy is complete (a read in flight lands later than its issue)
        self.ready = np.zeros((n_layers, n_experts))
        self.lru: OrderedDict[tuple[int, int], None] = OrderedDict()
        # at start the host holds the first ``capacity`` experts in (layer, expert) order, the
        # first of them the most recently used: a larger budget then holds a superset with the
        # same recency order, so LRU's inclusion property (a larger host never reads more from
        # the drive for the same accesses) holds from the first access on
        n = min(cfg.capacity, n_layers * n_experts)
        first = [divmod(i, n_experts) for i in range(n)]
        for slot in reversed(first):
            self.host[slot] = True
            self.lru[slot] = None
        self.n_host = n
        self.peak = n
        self.ssd_bytes = 0
        self.ssd_reads = 0
        self.ssd_stall = 0.0
        self.host_evictions = 0
        self._last = 0.0

    @property
    def peak_bytes(self) -> int:
        """The most host memory held at once: non-expert weights plus expert copies."""
        return self.cfg.nonexpert_bytes + self.peak * self.expert_bytes

    def read(self, op: Any, now: float, to_gpu: bool) -> tuple[float, bool]:
        """``op`` (issued at ``now``) needs its expert's weights: when they are where its next
        stage reads them, and whether a GDS read put them in GPU memory already."""
        slot = (op.layer, op.expert)
        if self.host[slot]:
            self.lru.move_to_end(slot)
            r = float(self.ready[slot])
            return (r if r > now else now), False
        if now < self._last:  # the lane is served at issue: decisions must not go back
            raise RuntimeError("host tier: a read was issued before an earlier one")
        self._last = now
        self.ssd_reads += 1
        self.ssd_bytes += self.expert_bytes
        gds = self.gds and to_gpu
        if not gds:  # the page cache makes room first (its evictions are recorded first)
            self._insert(slot, now, op, now)
        assert self.lanes is not None
        kind = "gds_read" if gds else "ssd_read"
        e = self.lanes.serve(self.drive, now, self.read_s, kind, op.sid, op.token, slot[0],
                             slot[1], self.expert_bytes, False)  # fmt: skip
        if not gds:
            self.ready[slot] = e
        return e, gds

    def written_back(self, op: Any, now: float) -> None:
        """A GPU write-back lands a host copy of ``op``'s expert (no drive read)."""
        slot = (op.layer, op.expert)
        if self.host[slot]:
            self.lru.move_to_end(slot)
        else:
            self._insert(slot, now, op, now)
            if self.recorder is not None:
                self.recorder.op("pagecache", "host_insert", op.sid, op.token, slot[0], slot[1],
                                 now, now, 0)  # fmt: skip

    def _insert(self, slot: tuple[int, int], ready: float, op: Any, t: float) -> None:
        """Take a host copy for ``slot``, evicting least recently used copies to make room."""
        while self.n_host >= self.cfg.capacity:
            victim, _ = self.lru.popitem(last=False)
            self.host[victim] = False
            self.n_host -= 1
            self.host_evictions += 1
            if self.recorder is not None:
                self.recorder.op("pagecache", "host_evict", op.sid, op.token, victim[0],
                                 victim[1], t, t, 0)  # fmt: skip
        self.host[slot] = True
        self.ready[slot] = ready
        self.lru[slot] = None
        self.n_host += 1
        if self.n_host > self.peak:
            self.peak = self.n_host
