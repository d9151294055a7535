"""The reference engine's memory state: GPU residency as policies see it, and host memory over
an NVMe drive (docs/serving.md, "An SSD tier").

:class:`Ledger` is what a plan is checked against (``daopsim.simulator.boundary.check_plan`` reads
its ``resident``, ``n_resident``, ``budget``, ``n_layers``, ``n_experts`` and ``ready_at``): the
resident mask changes when a plan is decided (a copy in flight counts as resident), the landing
times when the copies are timed. Slot *occupancy* (what a copy waits for) is the devices'
:class:`~daopsim.simulator.reference.resources.Pool` objects, not this.

:class:`HostMemory` holds the host's expert copies under a byte budget (least recently used
out first) and the drive's lane: a read is a SimPy process on the drive, requested when the
plan that needs it is decided; an operation waits for its read's event.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import simpy

from daopsim.simulator.reference.resources import Lane

if TYPE_CHECKING:
    from daopsim.simulator.costs import CostModel
    from daopsim.simulator.hosttier import HostTierConfig
    from daopsim.simulator.recorder import Recorder

INF = float("inf")
Slot = tuple[int, int]


class Ledger:
    """Resident experts, when their copies land, and the copy each slot waits for."""

    __slots__ = (
        "budget",
        "copy",
        "mask",
        "n_experts",
        "n_layers",
        "n_resident",
        "prefetched",
        "ready",
        "ready_at",
        "resident",
    )

    def __init__(self, n_layers: int, n_experts: int, budget: int) -> None:
        self.n_layers, self.n_experts, self.budget = n_layers, n_experts, int(budget)
        self.resident = np.zeros((n_layers, n_experts), dtype=bool)
        #: when each resident expert's copy lands: 0 for the initial placement, infinity while
        #: its copy has not started (docs/policy-api.md, View.ready)
        self.ready_at = np.zeros((n_layers, n_experts), dtype=np.float64)
        #: copied by a prefetch and not used or evicted since
        self.prefetched = np.zeros((n_layers, n_experts), dtype=bool)
        #: the same two arrays flat (``layer * n_experts + expert``), as the plan checks read them
        self.mask = self.resident.reshape(-1)
        self.ready = self.ready_at.reshape(-1)
        self.n_resident = 0
        #: the latest copy into each slot (an ``Op``); absent for the initial placement
        self.copy: dict[Slot, Any] = {}

    def place(self, slots: list[Slot]) -> None:
        """The initial placement: resident and landed at time 0."""
        for s in slots:
            self.resident[s] = True
        self.n_resident = len(slots)


class HostMemory:
    """Host memory holding expert copies (LRU) and the drive the others are read from."""

    def __init__(
        self,
        env: simpy.Environment,
        cfg: HostTierConfig,
        costs: CostModel,
        n_layers: int,
        n_experts: int,
        access: str,
        recorder: Recorder | None,
    ) -> None:
        self.env = env
        self.cfg = cfg
        self.recorder = recorder
        self.gds = cfg.path == "gds"
        self.drive = Lane(env, "ssd")
        self.read_s = costs.ssd_expert_s(access) if cfg.uses_ssd else 0.0
        self.holds = np.zeros((n_layers, n_experts), dtype=bool)  # View.host_resident
        #: least recently used first
        self.order: OrderedDict[Slot, None] = OrderedDict()
        #: the drive read still putting each host copy in place (absent: it is there)
        self.landing: dict[Slot, simpy.Event] = {}
        # a loader reading the checkpoint front to back leaves the first experts, the first
        # of them most recently used (so a larger budget holds a superset, same recency)
        n = min(cfg.capacity, n_layers * n_experts)
        for i in reversed(range(n)):
            slot = divmod(i, n_experts)
            self.holds[slot] = True
            self.order[slot] = None
        self.peak = n
        self.reads = 0
        self.read_bytes = 0
        self.evictions = 0
        self.stall = 0.0

    def need(self, op: Any, to_gpu: bool) -> tuple[simpy.Event | None, bool]:
        """``op`` needs its expert's host copy (decided now): the read it must wait for (None:
        none), and whether that read is a GPUDirect one that replaces its copy to the GPU."""
        slot = (op.layer, op.expert)
        if self.holds[slot]:
            self.order.move_to_end(slot)
            ev = self.landing.get(slot)
            return (ev if ev is not None and not ev.processed else None), False
        gds = self.gds and to_gpu
        ev = self.env.event()
        self.env.process(self._read(op, ev, gds))
        self.reads += 1
        self.read_bytes += self.cfg.expert_bytes
        if not gds:  # it lands in the page cache, which makes room first
            self._insert(slot, ev, op)
        return ev, gds

    def written_back(self, op: Any) -> None:
        """A write-back leaves a host copy of its expert (no drive read)."""
        slot = (op.layer, op.expert)
        if self.holds[slot]:
            self.order.move_to_end(slot)
            return
        self._insert(slot, None, op)
        self._row("pagecache", "host_insert", op, slot, self.env.now, self.env.now, 0)

    def _read(self, op: Any, ev: simpy.Event, gds: bool) -> Any:
        env = self.env
        yield self.drive.request((env.now, op.seq))
        start = env.now
        yield env.timeout(self.read_s)
        self.drive.release()
        self.drive.busy += self.read_s
        kind = "gds_read" if gds else "ssd_read"
        self._row("ssd", kind, op, (op.layer, op.expert), start, env.now, self.cfg.expert_bytes)
        ev.succeed()

    def _insert(self, slot: Slot, landing: simpy.Event | None, op: Any) -> None:
        while len(self.order) >= self.cfg.capacity:
            victim, _ = self.order.popitem(last=False)
            self.holds[victim] = False
            self.landing.pop(victim, None)
            self.evictions += 1
            self._row("pagecache", "host_evict", op, victim, self.env.now, self.env.now, 0)
        self.holds[slot] = True
        self.order[slot] = None
        if landing is not None:
            self.landing[slot] = landing
        else:
            self.landing.pop(slot, None)
        self.peak = max(self.peak, len(self.order))

    def _row(self, lane: str, kind: str, op: Any, slot: Slot, s: float, e: float, nb: int) -> None:
        if self.recorder is not None:
            self.recorder.op(lane, kind, op.sid, op.token, slot[0], slot[1], s, e, nb)

    def totals(self) -> dict[str, float]:
        """The tier's figures for the metrics (docs/metrics.md)."""
        cfg = self.cfg
        return {
            "ssd_bytes": self.read_bytes,
            "ssd_reads": self.reads,
            "ssd_stall_s": self.stall,
            "host_evictions": self.evictions,
            "host_memory_peak_bytes": cfg.nonexpert_bytes + self.peak * cfg.expert_bytes,
            "host_memory_budget_bytes": cfg.budget_bytes,
        }
