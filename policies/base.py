"""The policy seam: what a policy sees, what it may decide, and the base classes policies extend.

A policy is a class with a few hooks. The engine calls them with read-only views that hold only
what a real runtime knows at that moment, and turns the returned :class:`Plan` into timed
operations on the host's resources. Impossible plans (running an expert that is not resident,
evicting an expert that is not there, exceeding the slot budget, computing an expert twice) are
refused with a ``PolicyError`` naming the policy, sequence, token and layer.

See docs/policy-api.md for the full contract and a worked example.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from types import MappingProxyType
from typing import Any, ClassVar, Final, Protocol

import numpy as np

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.options import Param, coerce_option

# at run time: a compiled dataclass resolves its fields
from daopsim.simulator.costs import CostModel
from daopsim.simulator.errors import UserError
from daopsim.simulator.models import ModelShape


class Action(IntEnum):
    """Where one routed expert of a layer is computed."""

    GPU = 0  #: resident (or already in flight to a slot): run on the GPU
    FETCH = 1  #: copy into a resident slot (optionally evicting a victim), then run on the GPU
    TEMP = 2  #: copy into a temporary buffer, run on the GPU, drop the copy
    CPU = 3  #: run on the CPU now (activations go to the host and back)
    PRECOMPUTED = 4  #: a CPU pre-calculation submitted earlier with ``Plan.precalc``


Slot = tuple[int, int]  # (layer, expert)


@dataclass(slots=True, init=False)
class Plan:
    """A policy's decisions for one layer of one step (a decode token or a prefill pass).

    ``actions`` maps each routed expert to an :class:`Action`; ``None`` means "all on the GPU"
    (every routed expert must then be resident). ``route`` replaces the trace's routing
    (prediction, substitution); ``raw_route`` is the route before any
    degradation step, so the engine can split replaced routing into misprediction and
    degradation. ``victims`` names the slot a FETCH frees. ``prefetch`` entries are
    ``(layer, expert, victim or None)`` background copies into slots; ``precalc`` entries are
    ``(layer, expert)`` CPU computations for a coming layer, consumed later by PRECOMPUTED.
    ``victims``, ``prefetch``, ``precalc`` and ``evict`` given as None are empty.
    ``cpu_serial``: this plan's CPU experts (and, separately, its pre-calculations) run one
    after another as one task, not spread over the worker pool. ``cpu_first``: the GPU
    experts start only after this layer's ``CPU`` experts are done (the thread driving the GPU
    computed them synchronously). ``low_bit``: routed experts whose ``TEMP`` copy moves the
    host's low-precision copy (``ResourceSpec.low_bit_dtype``) and which therefore run in low
    precision (HOBBIT's mixed-precision loading); with ``ResourceSpec.low_bit_slots`` also
    ``FETCH`` experts whose copy into a slot moves that copy, and resident ``GPU`` experts
    that hold only it (both run in low precision: SliceMoE's bit slices). ``barrier``: the
    layer's GPU experts start only once every copy into a slot of this layer that the plan
    issues (its ``FETCH`` actions and its prefetches into ``layer``) has landed: a gather
    before the layer's forward, as DeepSpeed ZeRO-3 fetches a leaf module's parameters in its
    pre-forward hook. Temporary (``TEMP``) copies are not part of it.
    """

    # Each field is typed Any: a plan holds whatever the policy put in it, and the engine's
    # plan checks (simulator/boundary.py) refuse a malformed one with a message naming the
    # policy, the layer and the field (a compiled Plan must not refuse it first, and
    # differently). The intended types: actions dict[int, Action] | None, victims
    # dict[int, (layer, expert)], route and raw_route 1-D integer arrays (or sequences) or
    # None, prefetch list of (layer, expert, victim or None), precalc list of (layer, expert),
    # evict list of (layer, expert), low_bit a set of experts, the three flags bool.
    actions: Any = None
    victims: Any = field(default_factory=dict)
    route: Any = None
    raw_route: Any = None
    prefetch: Any = field(default_factory=list)
    precalc: Any = field(default_factory=list)
    evict: Any = field(default_factory=list)
    cpu_serial: Any = False
    cpu_first: Any = False
    low_bit: Any = frozenset()
    barrier: Any = False

    # Written out (``init=False`` above) so that mypyc compiles it: the dataclass-generated
    # constructor is interpreted, and a policy builds one plan per layer (about 0.5 us each).
    def __init__(
        self,
        actions: Any = None,
        victims: Any = None,
        route: Any = None,
        raw_route: Any = None,
        prefetch: Any = None,
        precalc: Any = None,
        evict: Any = None,
        cpu_serial: Any = False,
        cpu_first: Any = False,
        low_bit: Any = frozenset(),
        barrier: Any = False,
    ) -> None:
        self.actions = actions
        self.victims = {} if victims is None else victims
        self.route = route
        self.raw_route = raw_route
        self.prefetch = [] if prefetch is None else prefetch
        self.precalc = [] if precalc is None else precalc
        self.evict = [] if evict is None else evict
        self.cpu_serial = cpu_serial
        self.cpu_first = cpu_first
        self.low_bit = low_bit
        self.barrier = barrier

    def copy(self) -> Plan:
        """A new plan with this one's fields, its lists, dict and sets copied: the way to make a
        variant of a plan another method returned (a :class:`FrozenPlan` cannot change)."""
        actions = self.actions
        return Plan(
            actions=None if actions is None else dict(actions),
            victims=dict(self.victims),
            route=self.route,
            raw_route=self.raw_route,
            prefetch=list(self.prefetch),
            precalc=list(self.precalc),
            evict=list(self.evict),
            cpu_serial=self.cpu_serial,
            cpu_first=self.cpu_first,
            low_bit=frozenset(self.low_bit),
            barrier=self.barrier,
        )

    def frozen(self) -> Plan:
        """This plan as a :class:`FrozenPlan` (itself when it is one): a plan to return from
        more than one call."""
        if isinstance(self, FrozenPlan):
            return self
        return FrozenPlan(
            self.actions, self.victims, self.route, self.raw_route, self.prefetch,
            self.precalc, self.evict, self.cpu_serial, self.cpu_first, self.low_bit,
            self.barrier,
        )  # fmt: skip


#: what a frozen plan says to an attempt to change it
_FROZEN = (
    "is a FrozenPlan, shared by every call that returns it (ALL_GPU_PLAN: by every policy and "
    "run), and cannot be changed; make a variant with plan.copy() or build a Plan"
)


class FrozenPlan(Plan):
    """A :class:`Plan` that cannot be changed once made: a plan shared by several calls (the
    process-wide :data:`ALL_GPU_PLAN`, a policy's memoised static plans) is one of these, so no
    policy can change what another call, policy or run returns.

    Setting or deleting a field raises ``AttributeError``, and its containers are immutable:
    ``victims`` a read-only mapping, ``prefetch``/``precalc``/``evict`` tuples, ``low_bit`` a
    frozenset. ``actions`` stays a ``dict`` (the engine reads it as one; a frozen plan's is a
    private copy of the one it was made from). ``copy()`` gives a mutable variant.

    Compiled code (mypyc) that sets a field of a value typed ``Plan`` writes the slot directly
    and bypasses the refusal; the built-in policies never change a plan they did not build, and
    a policy written in Python (every user's) always goes through it.
    """

    _sealed: bool

    def __init__(
        self,
        actions: Any = None,
        victims: Any = None,
        route: Any = None,
        raw_route: Any = None,
        prefetch: Any = None,
        precalc: Any = None,
        evict: Any = None,
        cpu_serial: Any = False,
        cpu_first: Any = False,
        low_bit: Any = frozenset(),
        barrier: Any = False,
    ) -> None:
        super().__init__(
            None if actions is None else dict(actions),
            MappingProxyType(dict(victims or {})),
            route,
            raw_route,
            tuple(prefetch or ()),
            tuple(precalc or ()),
            tuple(evict or ()),
            cpu_serial,
            cpu_first,
            frozenset(low_bit),
            barrier,
        )
        # from here on every write is refused (compiled, the writes above went to the slots
        # directly; interpreted, through __setattr__ below while not sealed)
        self._sealed = True

    def __setattr__(self, name: str, value: object) -> None:
        if getattr(self, "_sealed", False):
            raise AttributeError(f"cannot set {name}: this plan {_FROZEN}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete {name}: this plan {_FROZEN}")


#: The plan "every routed expert on the GPU", one object shared by every policy and run (a
#: policy returns it without building a plan per layer). A :class:`FrozenPlan`: a policy that
#: tries to change it gets an ``AttributeError`` at the line that tries (a ``PolicyError``
#: naming it in a run); a variant is ``ALL_GPU_PLAN.copy()`` changed, or a ``Plan`` of its own.
ALL_GPU_PLAN: Final[Plan] = FrozenPlan()


#: a ``View`` row not built yet (see ``View._rows``)
_LAZY: Any = object()


class View:
    """What a real runtime knows when a layer's router has run (read-only for policies).

    Decode: ``experts``/``weights`` are this token's top-k for ``layer`` (rank order) and
    ``probs`` the dense router distribution (E). Prefill: ``counts`` holds how many prompt
    tokens chose each expert, and ``experts`` the experts with a non-zero count (descending
    count). ``next_experts``/``next_probs`` are the one-layer-early view of layer+1 (its router
    applied to this layer's router input), or None at the last layer. ``resident`` is the
    ``[layers, experts]`` residency mask (experts in flight to a slot count as resident), and
    ``ready`` when each resident expert's copy lands; :attr:`copy_free`, :attr:`copy_s` and
    :meth:`copy_end` say when the copies this GPU has queued, and copies issued now, land.
    """

    __slots__ = (
        "_copy_free_times",
        "_copy_seconds",
        "_next_experts",
        "_next_probs",
        "_probs",
        "_rows",
        "_weights",
        "budget",
        "calibration",
        "context",
        "costs",
        "counts",
        "experts",
        "gpu",
        "host_resident",
        "layer",
        "model",
        "n_tokens",
        "now",
        "phase",
        "position",
        "ready",
        "resident",
        "seq_id",
        "step",
        "token",
    )

    def __init__(self) -> None:
        self.seq_id = 0
        self.step = 0
        self.token = 0
        self.position = 0
        self.phase = "decode"
        self.layer = 0
        self.n_tokens = 1
        self.context = 0
        self.experts: np.ndarray = np.empty(0, dtype=np.int64)
        self._weights: Any = np.empty(0, dtype=np.float32)
        self._probs: Any = np.empty(0, dtype=np.float32)
        self.counts: np.ndarray | None = None
        self._next_experts: Any = None
        self._next_probs: Any = None
        #: a decode token's ``[layers, k]``/``[layers, E]`` rows (gate weights, router
        #: probabilities, layer-early experts and probabilities): the engine marks the four
        #: attributes ``_LAZY`` each layer and a row view is built only when a policy reads it
        self._rows: Any = None
        self.resident: np.ndarray = np.empty((0, 0), dtype=bool)
        self.budget = 0
        self.now = 0.0
        self.model: ModelShape | None = None
        self.costs: CostModel | None = None
        self.calibration: np.ndarray | None = None
        #: with a host-memory budget (docs/serving.md, "An SSD tier"): the ``[layers, experts]``
        #: mask of experts host memory holds (the rest are on the SSD); None when the host
        #: holds every expert
        self.host_resident: np.ndarray | None = None
        #: the ``[layers, experts]`` times at which each resident expert's weights land (a time
        #: <= ``now`` once landed; infinity while its copy waits for a slot or a buffer before
        #: it can start); a time > ``now`` is a copy in flight. What a runtime knows from its
        #: copy queue and its copies' events. Read-only, current during the call; None only
        #: outside the engine (a View made by hand)
        self.ready: np.ndarray | None = None
        #: the GPU this view's policy decides for (its index among the run's GPUs; 0 on one)
        self.gpu = 0
        #: set by the engine: GPU k -> when each of its host-to-device copy engines ends the
        #: work submitted to it so far, and each GPU's seconds per expert copy
        #: (:attr:`copy_free`, :attr:`copy_s`)
        self._copy_free_times: Any = None
        self._copy_seconds: list[float] = [0.0]

    @property
    def weights(self) -> np.ndarray:
        """This token's gate weights for ``experts`` (decode) or their prompt mean (prefill)."""
        x = self._weights
        if x is _LAZY:
            x = self._weights = self._rows[0][self.layer]
        return x

    @weights.setter
    def weights(self, value: np.ndarray) -> None:
        self._weights = value

    @property
    def probs(self) -> np.ndarray:
        """The dense router distribution of ``layer`` (decode) or its prompt mean (prefill)."""
        x = self._probs
        if x is _LAZY:
            x = self._probs = self._rows[1][self.layer]
        return x

    @probs.setter
    def probs(self, value: np.ndarray) -> None:
        self._probs = value

    @property
    def next_experts(self) -> np.ndarray | None:
        """The one-layer-early top-k of layer+1, or None (the last layer, prefill)."""
        x = self._next_experts
        if x is _LAZY:
            rows = self._rows[2]
            nl = self.layer + 1
            x = self._next_experts = rows[nl] if nl < len(rows) else None
        return x

    @next_experts.setter
    def next_experts(self, value: np.ndarray | None) -> None:
        self._next_experts = value

    @property
    def next_probs(self) -> np.ndarray | None:
        """The one-layer-early router distribution of layer+1, or None."""
        x = self._next_probs
        if x is _LAZY:
            rows = self._rows[3]
            nl = self.layer + 1
            x = self._next_probs = rows[nl] if nl < len(rows) else None
        return x

    @next_probs.setter
    def next_probs(self, value: np.ndarray | None) -> None:
        self._next_probs = value

    @property
    def copy_free(self) -> float:
        """When this GPU's host-to-device copy lane ends the work submitted to it so far (a
        time <= ``now`` when it is idle): the engine's own lane, so other GPUs' copies on a
        shared uplink, write-backs on a one-lane link and activation copies count. Copies
        still waiting for a slot or a buffer are not on it yet. With several copy engines
        per direction (``link.copy_engines_per_direction``), when the last of them does."""
        free: list[float] = self._copy_free_times(self.gpu)
        last = free[0]
        for t in free:
            if t > last:
                last = t
        return last

    @property
    def copy_s(self) -> float:
        """Seconds one expert copy holds this GPU's host-to-device lane (the engine's figure
        for the policy's host memory, ``ResourceSpec.host_memory``)."""
        return self._copy_seconds[self.gpu]

    def copy_end(self, n: int) -> float:
        """When the last of ``n`` expert copies issued now would land, queued behind the
        lane's work (:attr:`copy_free`) and before anything submitted later (0: when the lane
        is free for them): the engine's lane rule (each copy to the copy engine free first,
        the lowest index on ties, starting when that engine's work before it ends) applied to
        them, exact when nothing else is submitted first and the copies need not wait for a
        slot or a buffer."""
        now: float = self.now
        # typed, so that compiled code reads each time as a C double (the engine's callable
        # is untyped: a value through it would be a Python object per comparison)
        free: list[float] = self._copy_free_times(self.gpu)
        times = [t if t > now else now for t in free]
        return _lane_take(times, n, self.copy_s)

    def copy_lands(
        self, n: int, queued: int = 0, wait: float = 0.0, idle: bool = False
    ) -> list[float]:
        """Seconds from their issue until each of ``n`` expert copies lands, issued ``wait``
        seconds from now behind the lane's work and ``queued`` copies issued now: the lane
        rule of :meth:`copy_end` (each copy to the copy engine free first, one sum per copy).
        ``idle``: as if the lane had nothing queued now (an estimate that does not watch the
        copy queue, such as a schedule profiled at warm-up; it depends only on the arguments
        and the run, so a policy may keep it)."""
        now = self.now
        free = self._copy_free_times(self.gpu)
        if idle:
            times = [0.0] * len(free)
        else:
            times = [t - now if t > now else 0.0 for t in free]
        d = self.copy_s
        _lane_take(times, queued, d)
        if wait > 0.0:
            times = [t - wait if t > wait else 0.0 for t in times]
        return [_lane_take(times, 1, d) for _ in range(n)]

    @property
    def is_prefill(self) -> bool:
        """True during a prefill pass (many tokens per expert)."""
        return self.phase == "prefill"


def _lane_take(times: list[float], n: int, d: float) -> float:
    """``n`` copies of ``d`` seconds each onto copy engines free at ``times`` (changed in
    place): each to the engine free first, the lowest index on ties, one sum per copy as the
    lane adds them. Returns when the last of them ends (each ends no earlier than the one
    before, as each takes the engine free first); ``n = 0``: when the first engine is free."""
    last = times[0]
    for j in range(1, len(times)):  # min() would go through a generic builtin when compiled
        if times[j] < last:
            last = times[j]
    for _ in range(n):
        i = 0
        for j in range(1, len(times)):
            if times[j] < times[i]:
                i = j
        times[i] += d
        last = times[i]
    return last


#: ``ResourceSpec.host_copies`` choices
HOST_COPIES = ("all", "offloaded")


@dataclass(frozen=True)
class ResourceSpec:
    """The resources of the modelled system a policy runs on (one per policy instance).

    A policy returns it from :meth:`Policy.resources`; the engine builds the machine's
    buffers and worker pools from it and the runner sizes the slot budget with it.
    """

    #: "pinned" or "pageable": the host memory expert copies come from
    host_memory: str = "pinned"
    #: an evicted expert is copied back to the host (D2H) before its slot is reused
    writeback: bool = False
    #: GPU buffers for TEMP copies (a TEMP copy waits for a free one)
    temp_buffers: int = 1
    #: extra expert-sized GPU slots (beyond the budget) so a fetch need not wait for a write-back
    staging_buffers: int = 0
    #: CPU worker threads that run experts (their running calls share the host socket)
    cpu_workers: int = 1
    #: with ``writeback``: may evict an expert the current layer uses; its write-back is queued
    #: after that expert's computation (Mixtral-offloading's single-stream swap)
    evicts_in_use: bool = False
    #: places every expert whatever the budget (the all-GPU bound)
    unlimited_memory: bool = False
    #: the system issues its expert copies on the same CUDA stream as its kernels (PyTorch's
    #: default stream): the stream runs them in issue order, so no GPU computation overlaps a
    #: copy, and a layer ends only once every copy it issued has ended (Mixtral-offloading;
    #: docs/cost-model.md "One stream")
    one_stream: bool = False
    #: the host also holds every expert at this lower precision (a ``daopsim.simulator.models``
    #: dtype);
    #: a ``TEMP`` copy named in ``Plan.low_bit`` moves that copy instead (HOBBIT)
    low_bit_dtype: str | None = None
    #: with ``low_bit_dtype``: the system caches experts at the granularity of that low-bit
    #: copy (SliceMoE's bit slices): the run gives the engine ``floor(budget x B / B_low)``
    #: slots of the low-bit size instead of ``budget`` slots of full experts, a resident
    #: expert holds one of them, a ``FETCH`` named in ``Plan.low_bit`` copies the low-bit
    #: copy into it, and a ``GPU`` or ``FETCH`` expert named in ``Plan.low_bit`` runs in low
    #: precision. The policy keeps the rest of a full-precision expert's room free itself
    #: (``low_bit_slots_per_expert``); the engine counts slots, not bytes
    low_bit_slots: bool = False
    #: how the system reads experts that live on the SSD (docs/serving.md, "An SSD tier"):
    #: "read" (one large read each: the drive's sequential rate) or "mmap" (weights memory
    #: mapped, pages faulted in on first touch: the 4 KiB random-read rate; llama.cpp)
    ssd_access: str = "read"
    #: whole layers on the GPU (llama.cpp's ``-ngl``): None puts every layer there; N >= 0
    #: runs only the last N transformer blocks on the GPU and the ones before wholly on the
    #: CPU (non-expert part there too, experts from host memory; dense blocks taken to lead);
    #: -1 puts as many blocks on the GPU as their experts, weights and KV cache fit
    gpu_blocks: int | None = None
    #: with ``gpu_blocks``: a prefill pass of at least this many tokens runs a CPU layer's
    #: non-expert part on the GPU after copying its weights there (llama.cpp's op offload);
    #: 0 never does
    cpu_layer_offload_batch: int = 0
    #: GPU memory the modelled runtime keeps free of weights for activations and compute
    #: buffers, GB; None uses the hardware profile's ``gpu.workspace_gb`` (a PyTorch figure)
    workspace_gb: float | None = None
    #: the non-expert weights live in host memory and are copied to the GPU on every forward
    #: pass (DeepSpeed ZeRO-3 with ``offload_param``, docs/cost-model.md "Streamed non-expert
    #: weights"): before each layer's non-expert part its weights cross the host-to-device link,
    #: and the input embedding and the output matrix once per pass; a parameter of at most
    #: ``nonexpert_persist_numel`` elements stays on the GPU (norms, small routers)
    nonexpert_streamed: bool = False
    #: with ``nonexpert_streamed``: the largest parameter (elements) kept on the GPU
    #: (ZeRO-3's ``stage3_param_persistence_threshold``, default 1e5)
    nonexpert_persist_numel: int = 100_000
    #: which experts the host keeps a copy of (docs/cost-model.md, "Unified memory"):
    #: "all" (every expert: GPU copies are made from it and dropped on eviction, so a GPU
    #: resident expert is held twice; the caches), or "offloaded" (only the experts not
    #: resident on the GPU: each expert is held once, loaded straight into the buffer of the
    #: device that runs it, as llama.cpp's loader does, or moved rather than copied). A policy
    #: with ``writeback`` moves its experts, so it holds them once whatever this says. Only a
    #: unified-memory machine's fit reads it: there host and GPU copies share one memory
    host_copies: str = "all"

    def __post_init__(self) -> None:
        if self.ssd_access not in ("read", "mmap"):
            raise UserError(f"ssd_access must be 'read' or 'mmap', got {self.ssd_access!r}")
        if self.host_copies not in HOST_COPIES:
            raise UserError(
                f"host_copies must be one of {', '.join(HOST_COPIES)}, got {self.host_copies!r}"
            )
        if self.host_memory not in ("pinned", "pageable"):
            raise UserError(f"host_memory must be 'pinned' or 'pageable', got {self.host_memory!r}")
        if self.low_bit_dtype is not None:
            from daopsim.simulator.precisions import dtype_bytes

            dtype_bytes(self.low_bit_dtype)  # an unknown name is a one-line error
        if self.low_bit_slots and self.low_bit_dtype is None:
            raise UserError("low_bit_slots needs a low_bit_dtype (the precision of a slot)")
        for key in ("temp_buffers", "staging_buffers"):
            if getattr(self, key) < 0:
                raise UserError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.cpu_workers < 1:
            raise UserError(f"cpu_workers must be >= 1, got {self.cpu_workers}")
        if self.gpu_blocks is not None and self.gpu_blocks < -1:
            raise UserError(f"gpu_blocks must be None, -1 or >= 0, got {self.gpu_blocks}")
        if self.cpu_layer_offload_batch < 0:
            raise UserError(
                f"cpu_layer_offload_batch must be >= 0, got {self.cpu_layer_offload_batch}"
            )
        if self.workspace_gb is not None and not self.workspace_gb >= 0:
            raise UserError(f"workspace_gb must be >= 0, got {self.workspace_gb}")
        if self.nonexpert_persist_numel < 0:
            raise UserError(
                f"nonexpert_persist_numel must be >= 0, got {self.nonexpert_persist_numel}"
            )
        if self.nonexpert_streamed and self.gpu_blocks is not None:
            # both decide where the non-expert weights live; no modelled system does both
            raise UserError("nonexpert_streamed cannot be combined with gpu_blocks")
        if self.gpu_blocks is not None and self.one_stream:
            # CPU-resident layers run no GPU stream of their own to serialize with
            raise UserError("gpu_blocks (CPU-resident layers) cannot be combined with one_stream")
        if self.one_stream and self.nonexpert_streamed:
            # the streamed weights' copies are timed on the link alone, not on the one stream
            raise UserError("one_stream cannot be combined with nonexpert_streamed")
        if self.gpu_blocks is not None and self.writeback:
            # a CPU layer's timing assumes the links are idle when it starts (no background
            # copies); write-backs are background copies
            raise UserError("gpu_blocks (CPU-resident layers) cannot be combined with writeback")

    @property
    def pinned(self) -> bool:
        """True when expert copies come from pinned host memory."""
        return self.host_memory == "pinned"

    @property
    def experts_held_once(self) -> bool:
        """True when the host holds only the experts not resident on the GPU
        (``host_copies = "offloaded"``, or experts moved with ``writeback``)."""
        return self.host_copies == "offloaded" or self.writeback


class FutureAccesses(Protocol):
    """The oracle a clairvoyant policy gets as ``SetupContext.oracle``."""

    def next_use(self, layer: int, expert: int, after: int) -> float:
        """The first step after ``after`` that uses (layer, expert), or infinity."""
        ...


@dataclass(frozen=True)
class SetupContext:
    """What a policy knows at load time: shapes, budget, costs, calibration statistics."""

    model: ModelShape
    budget: int
    costs: CostModel
    calibration: np.ndarray | None  #: decode-time selection counts [layers, experts], or None
    calibration_prefill: np.ndarray | None  #: prefill-time counts [layers, experts], or None
    oracle: FutureAccesses | None = None  #: future accesses, given only to clairvoyant policies
    seed: int = 0
    #: per calibration sequence, its [layers, experts] selection counts (prompt and decode
    #: together, file order), or None; given with ``calibration``
    calibration_sequences: tuple[np.ndarray, ...] | None = None
    #: leading MoE layers that run wholly on the CPU (``ResourceSpec.gpu_blocks``, resolved)
    cpu_layers: int = 0


@mypyc_attr(allow_interpreted_subclasses=True)
class Policy:
    """Base class of every policy. Subclasses set ``name`` and override the hooks they need.

    Class attributes a policy may set:
    ``name`` (registry key), ``summary`` (one line), ``source`` (what it models),
    ``params`` (options: name -> :class:`Param`), ``clairvoyant`` (looks ahead in the trace;
    results are marked as a bound), ``bound`` (not realisable, e.g. all experts resident),
    ``needs_calibration`` (wants popularity counts), ``runtime_profile`` (the framework the
    modelled system runs on: its host overheads, docs/cost-model.md "Runtime profiles";
    ``--runtime`` overrides it). The resources the modelled system uses (host memory kind,
    write-back, buffers, CPU workers) come from :meth:`resources`.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    source: ClassVar[str] = ""
    params: ClassVar[dict[str, Param]] = {}
    clairvoyant: ClassVar[bool] = False
    bound: ClassVar[bool] = False
    needs_calibration: ClassVar[bool] = False
    #: the runtime profile of the modelled system (hardware_profiles/runtimes/NAME.toml)
    runtime_profile: ClassVar[str] = "ideal"

    def __init__(self, **options: Any) -> None:
        self.options = self.resolve_options(options)

    @classmethod
    def resolve_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """Defaults plus given options, type-checked; unknown or mistyped ones are UserErrors."""
        out = {k: p.default for k, p in cls.params.items()}
        for key, value in options.items():
            if key not in cls.params:
                known = ", ".join(sorted(cls.params)) or "none"
                raise UserError(f"policy {cls.name!r} has no option {key!r} (options: {known})")
            out[key] = coerce_option(cls.name, key, cls.params[key], value)
        return out

    # -- what the run must provide ------------------------------------------------------------
    def uses_calibration(self) -> bool:
        """True when this instance uses calibration counts (then the run provides them).

        Defaults to ``needs_calibration``; a policy that uses them only with some options
        (e.g. ``initial=popular``) overrides this. A policy that uses none is evaluated on
        every sequence of the trace (nothing is held out for it).
        """
        return self.needs_calibration

    def uses_lookahead(self) -> bool:
        """True when this instance reads the one-layer-early view (``View.next_experts``).

        A run on a trace without a recorded view then refuses, unless a stand-in is chosen
        (``simulate(lookahead="previous-token")``, ``--lookahead``).
        """
        return False

    #: what the policy does in prefill that a trace without prompt tokens skips (run notes)
    prefill_note: ClassVar[str] = ""

    def resources(self) -> ResourceSpec:
        """The resources this policy's system uses (may depend on the options)."""
        return ResourceSpec()

    def fixed_residency(self, model: ModelShape) -> int | None:
        """How many experts this instance keeps on the GPU whatever the budget, or None when
        the budget is what it fills (a cache).

        A policy whose placement its options fix (llama.cpp's ``--n-cpu-moe``, KTransformers'
        GPU experts) returns that count: the run then checks only that count against the
        machine's memory, so a budget the policy does not use is never a reason to refuse it
        (docs/policy-api.md, "Budgets").
        """
        return None

    # -- hooks ---------------------------------------------------------------------------------
    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """Initial placement: the (layer, expert) pairs resident at time 0 (at most budget)."""
        return []

    def on_sequence_start(self, seq_id: int, n_prefill: int) -> None:
        """A new sequence begins (its routing is not known yet)."""

    def prefill_layer(self, view: View) -> Plan:
        """Decide one layer of a prefill pass (``view.counts`` has per-expert token counts)."""
        return self.decode_layer(view)

    def decode_layer(self, view: View) -> Plan:
        """Decide one layer of one decode token."""
        raise NotImplementedError

    def batch_layer(self, view: View) -> Plan:
        """Decide one layer of a batched decode step: one token of each of several sequences,
        ``view.counts`` holding the batch's tokens per expert (the prefill view's shape, so
        the default is :meth:`prefill_layer`)."""
        return self.prefill_layer(view)

    def on_sequence_end(self, seq_id: int) -> None:
        """The sequence finished."""


@mypyc_attr(allow_interpreted_subclasses=True)
class StaticPlacementPolicy(Policy):
    """A policy whose residency never changes after ``setup`` (no plan of it fetches, evicts
    or prefetches): a decode plan then depends only on the layer and its routed experts, so
    :meth:`decode_layer` asks :meth:`static_plan` once per ``(layer, experts)`` and returns
    that plan again, frozen (:class:`FrozenPlan`), whenever the same experts come back.

    A subclass writes :meth:`static_plan` (and ``setup``, which must call
    :meth:`new_placement` so that a new run does not reuse the plans of another placement).
    ``fiddler``, ``static``, ``ktransformers`` and the llama.cpp splits are built on it.
    """

    #: (layer, *experts) -> the plan returned for them
    _plans: dict[tuple[int, ...], Plan]

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._plans = {}

    def new_placement(self) -> None:
        """A new placement (``setup``): the plans made for the last one are dropped."""
        self._plans = {}

    def static_plan(self, view: View, experts: list[int]) -> Plan:
        """The plan for ``experts`` (the routed experts, ``view.experts`` as a list) of
        ``view.layer``; called once per layer and set of experts, and frozen."""
        raise NotImplementedError

    def decode_layer(self, view: View) -> Plan:
        """The memoised :meth:`static_plan` of the layer's routed experts."""
        experts: list[int] = view.experts.tolist()
        key = (view.layer, *experts)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self.static_plan(view, experts).frozen()
        return plan
