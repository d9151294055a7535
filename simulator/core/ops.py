"""Operations and counters: what a layer's plan submits, and what a run counts.

An :class:`Op` is one request on the machine (an expert copy, a write-back, a CPU expert call,
an activation transfer between GPUs); a :class:`LayerWork` is everything one layer's plan
submits at its decision time, in issue order. :class:`Counters` is what a run counts (read
into ``daopsim.simulator.runstats.RunStats`` once it is over).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

import numpy as np

from daopsim.simulator.heap import Keyed

# operation kinds (Op.kind); WAKE is the shared CPU's next event, not an operation
WRITEBACK: Final = 0
FETCH: Final = 1
TEMP: Final = 2
CPU: Final = 3
WAKE: Final = 4
PEER: Final = 5


@dataclass
class Counters:
    """Accumulators the metrics are computed from (no timeline needed)."""

    decode_accesses: int = 0
    decode_hits: int = 0
    prefill_accesses: int = 0
    prefill_hits: int = 0
    hits_per_layer: np.ndarray | None = None
    accesses_per_layer: np.ndarray | None = None
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_expert_copies: int = 0
    d2h_expert_copies: int = 0
    gpu_expert_busy: float = 0.0
    gpu_nonexpert_busy: float = 0.0
    transfer_stall: float = 0.0
    cpu_wait: float = 0.0
    #: GPU stream idle because the runtime's host thread had not issued the kernels yet
    dispatch_stall: float = 0.0
    cpu_expert_evals: int = 0
    cpu_precalc_evals: int = 0
    fetches: int = 0
    temp_copies: int = 0
    evictions: int = 0
    #: evictions of an expert whose copy was still in flight (its slot freed when it landed)
    evictions_in_flight: int = 0
    prefetches: int = 0
    prefetch_used: int = 0
    prefetch_wasted_bytes: int = 0
    precalc_wasted: int = 0
    true_accesses: int = 0
    replaced_mispredicted: int = 0
    replaced_degraded: int = 0
    gate_mass_total: float = 0.0
    gate_mass_kept: float = 0.0
    #: decode gate mass of experts computed from a low-precision copy (HOBBIT)
    gate_mass_low_bit: float = 0.0
    low_bit_copies: int = 0
    ttft: list[float] = field(default_factory=list)
    token_latency: list[float] = field(default_factory=list)
    decode_time: float = 0.0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    sequences: int = 0
    max_occupancy: int = 0
    #: blocking host syncs of the runtime's host threads
    host_syncs: int = 0
    #: seconds the host CPU ran CPU-resident layers' non-expert parts (ResourceSpec.gpu_blocks)
    cpu_nonexpert_busy: float = 0.0
    #: copies of a CPU-resident layer's non-expert weights to the GPU (prompt op offload)
    cpu_layer_weight_copies: int = 0
    #: streamed non-expert weights (ResourceSpec.nonexpert_streamed): copies and their bytes
    #: (also counted in ``h2d_bytes``)
    nonexpert_weight_copies: int = 0
    nonexpert_weight_bytes: int = 0

    def first_token(self, seconds: float) -> None:
        """A sequence's time to its first token (0 without a prompt)."""
        self.ttft.append(seconds)

    def decoded(self, seconds: float, tokens: int = 1) -> None:
        """A decode step of ``seconds`` produced ``tokens`` tokens (one per sequence it
        decoded): each token's latency is the step's."""
        self.token_latency.extend([seconds] * tokens)
        self.decode_time += seconds
        self.decode_tokens += tokens


class Op(Keyed):
    """One request a plan submits: a write-back, a copy, a CPU job or an activation transfer.

    ``seq`` is its issue number (the tie-break of the queueing rule); ``dev`` the GPU whose
    slots, buffers and uplink it uses. ``end`` is negative until the executor has timed it.
    CPU jobs of a serial chain point to the next one with ``chain``. A ``WRITEBACK`` created
    at ``stage`` 1 only releases its slot (an expert evicted while its copy was in flight,
    without write-back).
    """

    __slots__ = ("after", "at", "buf", "chain", "dev", "dst", "end", "expert", "gds", "gpu", "job",
                 "kind", "layer", "local", "low", "n", "row_kind", "seq", "sid", "src", "stage",
                 "token", "warm")  # fmt: skip

    def __init__(
        self, kind: int, row_kind: str, seq: int, sid: int, token: int, layer: int, expert: int
    ) -> None:
        super().__init__()
        self.kind = kind
        #: what its timeline rows call it (the "kind" column: fetch, prefetch, cpu_expert ...)
        self.row_kind = row_kind
        self.seq = seq
        self.sid = sid
        self.token = token
        self.layer = layer
        self.expert = expert
        self.n = 1
        self.dev = 0
        self.low = False  # a TEMP copy of the low-precision host copy (Plan.low_bit)
        #: a fetch into, or a write-back of, the slot of an expert this layer computed: its
        #: victim's weights are still in the caches (``costs.h2d_expert_warm_s``)
        self.warm = False
        self.buf = -1
        self.gpu = False  # a GPU computation of the current layer waits for this
        self.job: GpuJob | None = None  # ... that computation
        self.chain: Op | None = None
        self.end = -1.0
        self.stage = 0
        #: its first stage is submitted no earlier than this: its drive read ends (the SSD
        #: tier), or the copy its write-back waits for lands (INF: that copy submits it)
        self.at = 0.0
        #: a copy into a slot whose expert was evicted while it was in flight: the write-back
        #: or slot release submitted when it lands
        self.after: Op | None = None
        #: the SSD tier: a GPUDirect Storage read already put the weights in GPU memory
        self.gds = False
        self.local = False  # a CPU job of a CPU-resident layer: no activation copies
        self.src = 0  # PEER: the sending GPU
        self.dst = 0  # PEER: the receiving GPU


class GpuJob(Keyed):
    """A GPU expert computation of the current layer: its expert, the time its weights are
    there (``ready``) or the operation it waits for (``src``), the temporary buffer it frees
    (``buf``, -1: none), its GPU (``dev``) and whether this layer copied its weights
    (``copied``: a fetch or a temporary copy; costed by ``gpu_expert_after_copy_s``). In a
    GPU's stream it is keyed (start, ready, expert): streams run their computations by (ready
    time, expert)."""

    __slots__ = ("buf", "copied", "dev", "expert", "ready", "src")

    def __init__(self, expert: int, ready: float, src: Op | None, copied: bool = False) -> None:
        super().__init__()
        self.expert = expert
        self.ready = ready
        self.src = src
        self.buf = -1
        self.dev = 0
        self.copied = copied


class LayerWork:
    """A checked plan as operations: everything one layer submits at its decision time."""

    __slots__ = (
        "barrier",
        "counts",
        "cpu_first",
        "deferred",
        "gpu",
        "layer",
        "now",
        "ops",
        "results",
        "sid",
        "sync",
        "token",
    )

    def __init__(self, now: float, layer: int, sid: int, token: int, counts: object) -> None:
        self.now = now
        self.layer = layer
        self.sid = sid
        self.token = token
        self.counts = counts  # tokens per expert (prefill, batches); None: one token
        #: operations submitted at ``now``, in issue order
        self.ops: list[Op] = []
        #: GPU computations in issue order
        self.gpu: list[GpuJob] = []
        #: in-use victims: expert -> its write-back, submitted when its computation ends
        self.deferred: dict[int, Op] = {}
        #: this layer's CPU experts (``cpu_first`` waits for them before the GPU starts)
        self.sync: list[Op] = []
        #: CPU results the layer needs (its CPU experts and consumed pre-calculations)
        self.results: list[Op] = []
        self.cpu_first = False
        #: the GPU experts wait for every copy into this layer's slots (Plan.barrier)
        self.barrier = False
