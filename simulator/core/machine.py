"""The modelled machine: its named resources, built from a hardware profile and a policy's spec.

One resource set per GPU (its stream ``gpu``/``gpuK``, its host uplink of two copy lanes, its
slots and temporary buffers, the runtime's thread issuing its expert kernels), plus what the
GPUs share: the host CPU (``cpu``, a :class:`SharedCpu`), the lanes of direct peer paths
(``peerA>B``) and the NVMe drives of the SSD tier (``ssd``). With one copy engine a GPU's two
directions share one lane (``copy``); with more, each direction has
``link.copy_engines_per_direction`` engines (``h2d``, ``h2d.1`` ...). Every duration comes from
the cost model (``daopsim.simulator.costs``), bound here once per run and memoised; the executor
never computes a cost itself.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from typing import Any

from daopsim.simulator.core.resources import CpuJob, Engines, HostThread, Lane, SharedCpu


class Link:
    """A transfer path between two memories: the engines it runs on and what a copy costs."""

    __slots__ = ("activation_s", "engines", "expert_s", "name", "warm_s")

    def __init__(
        self,
        name: str,
        engines: Engines,
        expert_s: float,
        activation_s: Callable[[int], float],
        warm_s: float = -1.0,
    ) -> None:
        self.name = name
        self.engines = engines
        #: seconds to move one expert's weights over this link
        self.expert_s = expert_s
        #: the same into, or out of, the slot of an expert the layer computed (its weights still
        #: in the caches: ``costs.h2d_expert_warm_s``); negative: ``expert_s``
        self.warm_s = expert_s if warm_s < 0.0 else warm_s
        #: seconds to move the activations of n tokens
        self.activation_s = activation_s


class Machine:
    """The resources of one run, by name, and their (memoised) cost functions.

    ``placement`` (several GPUs; ``daopsim.simulator.multigpu.Placement``) says how many GPUs there
    are, which holds each expert (``gpu_of``) and where each layer's non-expert part runs
    (``home``); None is one GPU holding everything.
    """

    def __init__(self, costs: Any, spec: Any, runtime: Any = None, placement: Any = None) -> None:
        self.costs = costs
        self.n_gpus = n = 1 if placement is None else placement.n
        self.home: list[int] | None = None if placement is None else list(placement.home)
        self.gpu_of: list[list[int]] | None = None if placement is None else placement.gpu_of
        self.gpus = [Lane("gpu")] if n == 1 else [Lane(f"gpu{k}") for k in range(n)]
        self.multi = multi = costs.hw.multi if n > 1 else None
        pinned = spec.pinned
        #: each GPU's (h2d, d2h) uplink (the same objects for every GPU on a shared uplink)
        self.uplinks = _uplinks(costs, pinned, n, multi, spec.one_stream)
        self.links = {"h2d": self.uplinks[0][0], "d2h": self.uplinks[0][1]}
        #: direct peer lanes by (source, destination)
        self.peers = _peers(costs, n, multi)
        #: the runtime's host thread; None when it costs nothing
        idle = costs.model.experts - costs.model.top_k
        self.host = None if runtime is None or runtime.free else HostThread(runtime, idle)
        per_expert = self.host is not None and self.host.per_expert
        #: the thread issuing each GPU's expert kernels: the main thread for GPU 0, a worker
        #: thread of its own for every other GPU (None: expert calls cost the host nothing)
        self.hosts: list[HostThread | None] = [self.host if per_expert else None]
        for _ in range(1, n):
            self.hosts.append(HostThread(runtime, idle) if per_expert else None)
        #: HOBBIT's low-precision copies: seconds and bytes of one (0 without a low-bit dtype)
        low = spec.low_bit_dtype
        self.low_bit_s: float = costs.h2d_low_bit_expert_s(low, pinned) if low else 0.0
        self.low_bit_bytes: int = costs.low_bit_expert_bytes(low) if low else 0
        self.cpu = SharedCpu("cpu", spec.cpu_workers)
        self.temp_buffers: int = spec.temp_buffers
        #: a fused-MoE runtime: the layer's call launches once, with the first GPU expert the
        #: layer runs on each GPU stream
        fused = runtime is not None and runtime.fused_moe
        self.gpu_s = _memo(costs.fused_gpu_expert_s if fused else costs.gpu_expert_s)
        #: an expert this layer copied in (a fetch or a temporary copy): its own measured cost
        #: where the profile has one (the copy left its weights in a cache), else ``gpu_s``
        after = not fused and costs.has_after_copy
        self.gpu_copied_s = _memo(costs.gpu_expert_after_copy_s) if after else self.gpu_s
        self.fused_launch_s: float = costs.fused_moe_layer_s() if fused else 0.0
        self.cpu_s = _memo(costs.cpu_expert_s)
        #: bytes of n tokens' hidden states, one way (an activation copy or transfer)
        self.activation_bytes = _memo_bytes(costs.activation_bytes)
        self._cpu_share = _memo(costs.cpu_share)
        self._cpu_dram = _memo(costs.cpu_dram_share)
        #: unified memory: copies and GPU kernels register their DRAM share with the CPU
        self.unified: bool = costs.unified_memory
        self._gpu_dram = _memo(costs.gpu_dram_share)  # an expert's, on every computation
        self._layer_dram = cache(costs.gpu_dram_share)  # a layer's non-expert part
        #: eager attention writes every head's scores to device memory (costs.nonexpert_layer_s)
        self.eager_attention = eager = runtime is not None and runtime.attention == "eager"
        #: one layer's non-expert part for (tokens, context): GPU seconds, and host-CPU seconds
        #: of a CPU-resident layer
        self.nonexpert_s = cache(partial(costs.nonexpert_layer_s, eager_attention=eager))
        self.cpu_layer_nonexpert_s = cache(costs.cpu_nonexpert_layer_s)
        #: NVMe drives of the SSD tier, one lane each (registered by the host tier)
        self.drives: dict[str, Lane] = {}
        #: the copy of one CPU-resident layer's non-expert weights (prompt op offload)
        self.cpu_layer_weights_s: float = costs.cpu_layer_weights_h2d_s()
        #: ZeRO-3's streamed non-expert weights: (bytes, seconds) of one layer's copy and of the
        #: input embedding's (the output matrix is taken to be its size); None: they stay put
        self.streamed: tuple[tuple[int, float], tuple[int, float]] | None = None
        if spec.nonexpert_streamed:
            keep = spec.nonexpert_persist_numel
            lb = costs.streamed_layer_weight_bytes(keep)
            eb = costs.streamed_embedding_bytes(keep)
            self.streamed = (
                (lb, costs.weights_h2d_s(lb, pinned)),
                (eb, costs.weights_h2d_s(eb, pinned)),
            )

    def cpu_job(self, op: Any, seq: int, t: float, n: int) -> CpuJob:
        """A CPU expert call over ``n`` tokens submitted at ``t``, with its costs bound."""
        return CpuJob(op, seq, t, self.cpu_s(n), self._cpu_share(n), self._cpu_dram(n))

    def dram_share(self, n: int, context: int | None = None) -> float:
        """Unified memory: the share of the DRAM a GPU kernel takes while it runs (an expert
        over ``n`` tokens, or with ``context`` a layer's non-expert part)."""
        return self._gpu_dram(n) if context is None else self._layer_dram(n, context)


def _uplinks(
    costs: Any, pinned: bool, n: int, multi: Any, one_stream: bool
) -> list[tuple[Link, Link]]:
    """Each GPU's (host-to-device, device-to-host) links; one pair for a shared uplink. A
    direction has ``copy_engines_per_direction`` engines, one on a single stream (it issues
    one copy at a time)."""
    act = _memo(costs.activation_copy_s)
    h2d_s, d2h_s = costs.h2d_expert_s(pinned), costs.d2h_expert_s(pinned)
    h2d_w, d2h_w = costs.h2d_expert_warm_s(pinned), costs.d2h_expert_warm_s(pinned)
    ups: list[tuple[Link, Link]] = []
    for k in range(1 if multi is None or multi.shared_uplink else n):
        sfx = "" if n == 1 else str(k)
        if costs.hw.link.copy_engines >= 2:
            per = 1 if one_stream else costs.hw.link.copy_engines_per_direction
            hl, dl = Engines(f"h2d{sfx}", per), Engines(f"d2h{sfx}", per)
        else:  # one copy engine: both directions share one FIFO lane
            hl = dl = Engines(f"copy{sfx}")
        ups.append(
            (Link(f"h2d{sfx}", hl, h2d_s, act, h2d_w), Link(f"d2h{sfx}", dl, d2h_s, act, d2h_w))
        )
    return [ups[0 if len(ups) == 1 else k] for k in range(n)]


def _peers(costs: Any, n: int, multi: Any) -> dict[tuple[int, int], Link]:
    """The direct GPU-to-GPU links by (source, destination); none when peers go via the host."""
    peers: dict[tuple[int, int], Link] = {}
    if multi is not None and multi.peer_kind != "host":
        peer_s = _memo(costs.peer_activation_s)
        for a in range(n):
            for b in range(n):
                if a != b and multi.direct(a, b):
                    name = f"peer{a}>{b}"
                    peers[(a, b)] = Link(name, Engines(name), 0.0, peer_s)
    return peers


def _memo_bytes(fn: Callable[[int], int]) -> Callable[[int], int]:
    """``fn`` (a byte count) memoised on its integer argument, as :func:`_memo`."""
    memo: dict[int, int] = {}

    def get(n: int) -> int:
        b = memo.get(n)
        if b is None:
            b = memo[n] = fn(n)
        return b

    return get


def _memo(fn: Callable[[int], float]) -> Callable[[int], float]:
    """``fn`` memoised on its integer argument. Compiled, calling this closure is much
    cheaper than calling a ``functools.cache`` wrapper (no vectorcall: a tuple per call), and
    these run for every expert computation and copy."""
    memo: dict[int, float] = {}

    def get(n: int) -> float:
        t = memo.get(n)
        if t is None:
            t = memo[n] = fn(n)
        return t

    return get
