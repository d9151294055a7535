"""The modelled machine: named resources built from a hardware profile and a policy's spec.

A :class:`Machine` owns every resource an operation can occupy, each under a name:

* ``gpu``: the GPU compute stream (one lane);
* links (``links["h2d"]``, ``links["d2h"]``): a transfer path between two memories, with the
  copy engine (lane) it runs on and its cost function. ``link.copy_engines = 1`` puts both
  directions on one lane named ``copy``; two or more give each direction its own lane;
* pools (``pools["cpu"]``): identical serial workers (``cpu0``, ``cpu1``, ...);
* buffers (``buffers["temp"]``, ``buffers["slots"]``): counted GPU memory.

The engines look resources up by name, so a new tier or device is a new entry here plus its
cost function (docs/architecture.md, "How to add a resource").

A :class:`Lane` is a serial resource. The engines submit requests to it in the order of the
queueing rule (docs/policy-api.md): by submission time, ties by issue order; a request starts
at ``max(submitted, free)`` and holds the lane for its duration, exactly like
``simpy.Resource(capacity=1)`` fed in that order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from policies.base import ResourceSpec
from simulator.costs import CostModel


class Lane:
    """A serial resource holding one operation at a time (first come, first served)."""

    __slots__ = ("busy", "free_at", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.free_at = 0.0
        self.busy = 0.0

    def serve(self, submitted: float, duration: float) -> tuple[float, float]:
        """Serve a request submitted at ``submitted``; every earlier one was served first."""
        start = submitted if submitted > self.free_at else self.free_at
        end = start + duration
        self.free_at = end
        self.busy += duration
        return start, end


class Pool:
    """Identical serial workers; a request takes the one that became free first (lowest index
    on ties), so a worker idle since longer is preferred."""

    __slots__ = ("lanes", "name")

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.lanes = [Lane(f"{name}{i}") for i in range(max(1, size))]

    def pick(self) -> Lane:
        """The worker that becomes (or became) free first."""
        lanes = self.lanes
        best = lanes[0]
        for lane in lanes[1:]:
            if lane.free_at < best.free_at:
                best = lane
        return best

    @property
    def busy(self) -> float:
        """Summed busy time of all workers."""
        return sum(lane.busy for lane in self.lanes)


@dataclass
class Link:
    """A transfer path between two memories: the lane it runs on and what a copy costs."""

    name: str
    lane: Lane
    #: seconds to move one expert's weights over this link
    expert_s: float
    #: seconds to move the activations of n tokens
    activation_s: Callable[[int], float]


class Machine:
    """The resources of one run, by name, and their (memoised) cost functions."""

    def __init__(self, costs: CostModel, spec: ResourceSpec) -> None:
        self.costs = costs
        self.spec = spec
        self.gpu = Lane("gpu")
        pinned = spec.pinned
        act = _memo(costs.activation_copy_s)
        if costs.hw.link.copy_engines >= 2:
            h2d_lane, d2h_lane = Lane("h2d"), Lane("d2h")
        else:  # one copy engine: both directions share one FIFO lane
            h2d_lane = d2h_lane = Lane("copy")
        self.links: dict[str, Link] = {
            "h2d": Link("h2d", h2d_lane, costs.h2d_expert_s(pinned), act),
            "d2h": Link("d2h", d2h_lane, costs.d2h_expert_s(pinned), act),
        }
        self.pools: dict[str, Pool] = {"cpu": Pool("cpu", spec.cpu_workers)}
        self.buffers: dict[str, int] = {
            "temp": spec.temp_buffers,
            "staging": spec.staging_buffers,
        }
        self.gpu_s = _memo(costs.gpu_expert_s)
        self.cpu_s = _memo(costs.cpu_expert_s)
        self._ne: dict[tuple[int, int], float] = {}

    def nonexpert_s(self, n: int, context: int) -> float:
        """Non-expert GPU time of one layer for ``n`` tokens at ``context`` (memoised)."""
        key = (n, context)
        t = self._ne.get(key)
        if t is None:
            t = self._ne[key] = self.costs.nonexpert_layer_s(n, context)
        return t

    def lanes(self) -> dict[str, Lane]:
        """Every distinct lane by name (a shared copy lane appears once)."""
        out: dict[str, Lane] = {"gpu": self.gpu}
        for link in self.links.values():
            out[link.lane.name] = link.lane
        for pool in self.pools.values():
            for lane in pool.lanes:
                out[lane.name] = lane
        return out

    def busy(self) -> dict[str, float]:
        """Busy seconds per named resource: ``gpu``, each link, each pool (summed workers)."""
        out = {"gpu": self.gpu.busy}
        for name, link in self.links.items():
            out[name] = link.lane.busy
        for name, pool in self.pools.items():
            out[name] = pool.busy
        return out

    def workers(self) -> dict[str, int]:
        """Workers per pool."""
        return {name: len(pool.lanes) for name, pool in self.pools.items()}


def _memo(fn: Callable[[int], float]) -> Callable[[int], float]:
    """``fn`` memoised on its integer argument (a dict lookup on the hot path)."""
    cache: dict[int, float] = {}

    def get(n: int) -> float:
        t = cache.get(n)
        if t is None:
            t = cache[n] = fn(n)
        return t

    return get
