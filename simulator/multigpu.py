"""Several GPUs in one machine: expert-parallel or pipeline placement over peer links.

``daopsim run --gpus N --multi-gpu expert|pipeline`` (docs/serving.md, "Multiple GPUs"):

* **expert parallel**: expert ``e`` of every layer lives on GPU ``e mod N``; the non-expert
  part (attention, router) of every layer runs on GPU 0, which sends the layer's activations to
  each other GPU holding one of the routed experts and waits for the results to come back
  (the dispatch / combine of expert parallelism);
* **pipeline**: the MoE layers are split into ``N`` contiguous stages (earlier stages take the
  remainder); a layer's experts and its non-expert part run on its stage's GPU, and the hidden
  state crosses to the next stage's GPU after a stage's last layer.

Each GPU has its own stream (lane ``gpuK``), slot pool (the per-GPU budget), temporary buffers
and host uplink (lanes ``h2dK``/``d2hK``, or one uplink ``h2d0``/``d2h0`` all GPUs share when the
profile says so). Activations between GPUs use the profile's ``[peer]`` path: a direct lane per
direction (``peerA>B``) for NVLink or PCIe peer-to-peer, or, without peer access, a copy to host
memory on the sender's uplink and one from it on the receiver's.

Policies are unchanged: :class:`ShardedPolicy` runs one instance of the policy per GPU, each
seeing only that GPU's experts (a smaller model: its layers, its experts, its budget) with
local indices, and merges their plans into one for the engine. The fast executor is extended
here (:class:`MultiGpuEngine`); the reference engine (:mod:`simulator.reference`) models
several GPUs itself, and the two give identical timelines.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import sys
from collections import deque
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import simpy

from policies.base import _LAZY, Action, Plan, Policy, ResourceSpec, SetupContext, Slot, View
from simulator.costs import CostModel
from simulator.engine import CPU, FETCH, TEMP, WAKE, WRITEBACK, Engine, LayerOp, LayerWork
from simulator.errors import UserError
from simulator.hardware import HardwareProfile
from simulator.machine import Lane, Link, Machine, _memo
from simulator.reference import MultiGpuReference
from simulator.runtime_profiles import RuntimeProfile

MODES = ("expert", "pipeline")
#: expert-parallel placement rules (``--expert-placement``)
EXPERT_PLACEMENTS = ("mod", "balanced")
#: operation kind of an activation transfer between two GPUs (after the engine's kinds)
PEER = 5

Proc = Generator[simpy.Event, Any, Any]


@dataclass(frozen=True)
class MultiGpuConfig:
    """How many GPUs a run uses and how the model is split over them."""

    gpus: int
    mode: str = "expert"
    #: expert parallel: ``mod`` (expert e on GPU e mod N) or ``balanced`` (by calibration
    #: popularity, :func:`balanced_experts`)
    placement: str = "mod"


def check_config(
    profile: HardwareProfile, gpus: int, mode: str | None, placement: str | None = None
) -> MultiGpuConfig | None:
    """The run's multi-GPU setting from ``--gpus``/``--multi-gpu``/``--expert-placement``;
    None for one GPU."""
    if placement is not None:
        if placement not in EXPERT_PLACEMENTS:
            raise UserError(
                f"--expert-placement must be one of {list(EXPERT_PLACEMENTS)}, got {placement!r}"
            )
        if gpus < 2 or (mode or "expert") != "expert":
            raise UserError("--expert-placement needs --gpus 2 or more and --multi-gpu expert")
    if gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {gpus}")
    if mode is not None and mode not in MODES:
        raise UserError(f"--multi-gpu must be one of {list(MODES)}, got {mode!r}")
    have = profile.multi.count if profile.multi is not None else 1
    if gpus > have:
        raise UserError(
            f"--gpus {gpus}: profile {profile.name!r} has {have} GPU{'s' if have > 1 else ''}"
        )
    if gpus == 1:
        if mode is not None:
            raise UserError("--multi-gpu needs --gpus 2 or more")
        return None
    return MultiGpuConfig(gpus, mode or "expert", placement or "mod")


def balanced_experts(popularity: np.ndarray, n: int) -> list[list[int]]:
    """Experts per GPU, spreading routed traffic: largest-first onto the least-loaded GPU.

    ``popularity`` is each expert's calibration selection count summed over the layers (one
    assignment serves every layer, as ``mod`` does). Each GPU takes as many experts as under
    ``mod`` (so the slot capacity per GPU is unchanged); experts go in descending popularity
    (ties: lower index) to the GPU with the least assigned traffic that still has room (ties:
    lower GPU). This is the greedy balanced packing of expert-parallel load balancers
    (DeepSeek's EPLB, docs/references.md#multiple-gpus), without replicating experts.
    """
    e_total = len(popularity)
    room = [len(range(k, e_total, n)) for k in range(n)]
    load = [0.0] * n
    out: list[list[int]] = [[] for _ in range(n)]
    for e in sorted(range(e_total), key=lambda x: (-float(popularity[x]), x)):
        k = min((k for k in range(n) if room[k] > 0), key=lambda k: (load[k], k))
        out[k].append(e)
        load[k] += float(popularity[e])
        room[k] -= 1
    return [sorted(x) for x in out]


class Placement:
    """Which GPU holds each (layer, expert) and on which GPU each layer's non-expert part runs."""

    def __init__(
        self,
        cfg: MultiGpuConfig,
        n_layers: int,
        n_experts: int,
        popularity: np.ndarray | None = None,
    ) -> None:
        n = self.n = cfg.gpus
        self.mode = cfg.mode
        self.rule = cfg.placement if cfg.mode == "expert" else "stages"
        if cfg.mode == "expert":
            if n > n_experts:
                raise UserError(f"--gpus {n}: the model has only {n_experts} experts per layer")
            self.layers_of = [list(range(n_layers)) for _ in range(n)]
            if cfg.placement == "balanced":
                if popularity is None:
                    raise UserError(
                        "--expert-placement balanced needs calibration counts; use held-out "
                        "sequences (the default), --calibration self or --calibration PATH"
                    )
                self.experts_of = balanced_experts(np.asarray(popularity), n)
            else:
                self.experts_of = [list(range(k, n_experts, n)) for k in range(n)]
            self.home = [0] * n_layers
        else:
            if n > n_layers:
                raise UserError(f"--gpus {n}: the model has only {n_layers} MoE layers")
            base, extra = divmod(n_layers, n)
            self.layers_of, a = [], 0
            for k in range(n):
                b = a + base + (1 if k < extra else 0)
                self.layers_of.append(list(range(a, b)))
                a = b
            self.experts_of = [list(range(n_experts)) for _ in range(n)]
            self.home = [k for k in range(n) for _ in self.layers_of[k]]
        gpu = np.zeros((n_layers, n_experts), dtype=np.int64)
        for k in range(n):
            gpu[np.ix_(self.layers_of[k], self.experts_of[k])] = k
        self.gpu = gpu
        #: gpu_of[layer][expert], plain lists for the hot path
        self.gpu_of: list[list[int]] = gpu.tolist()
        self.local_layer = {
            (k, lay): i for k in range(n) for i, lay in enumerate(self.layers_of[k])
        }
        self.local_expert = [{e: i for i, e in enumerate(self.experts_of[k])} for k in range(n)]
        #: layer_at[k][layer] / expert_at[k][expert]: GPU k's local index, -1 where it holds none
        self.layer_at = [_local_index(self.layers_of[k], n_layers) for k in range(n)]
        self.expert_at = [_local_index(self.experts_of[k], n_experts) for k in range(n)]
        #: GPU k's rows and columns of a [layers, experts] array: a slice where they are
        #: evenly spaced (every placement rule but ``balanced``), else an index array
        self.layer_cut = [_cut(self.layers_of[k]) for k in range(n)]
        self.expert_cut = [_cut(self.experts_of[k]) for k in range(n)]
        #: GPU k's experts as an index array (a fancy index: a contiguous copy)
        self.expert_idx = [np.asarray(self.experts_of[k], dtype=np.intp) for k in range(n)]

    def capacity(self, k: int) -> int:
        """How many (layer, expert) slots GPU ``k`` can hold at most."""
        return len(self.layers_of[k]) * len(self.experts_of[k])

    def window(self, a: np.ndarray, k: int) -> np.ndarray:
        """GPU ``k``'s part of a ``[layers, experts]`` array: a view of ``a`` (no copy) when
        its rows and columns are slices, else a copy."""
        rows, cols = self.layer_cut[k], self.expert_cut[k]
        if isinstance(rows, slice) and isinstance(cols, slice):
            return a[rows, cols]
        return a[np.ix_(self.layers_of[k], self.experts_of[k])]


def _local_index(members: list[int], total: int) -> list[int]:
    """Position of each of ``range(total)`` in ``members``, -1 for the others."""
    at = [-1] * total
    for i, x in enumerate(members):
        at[x] = i
    return at


def _cut(members: list[int]) -> slice | np.ndarray:
    """``members`` (ascending) as a slice when evenly spaced, else as an index array."""
    if len(members) == 1:
        return slice(members[0], members[0] + 1)
    if members:
        step = members[1] - members[0]
        if step > 0 and members == list(range(members[0], members[-1] + 1, step)):
            return slice(members[0], members[-1] + 1, step)
    return np.asarray(members, dtype=np.intp)


# -- the policy side -------------------------------------------------------------------------


class _Window:
    """GPU ``k``'s part of one engine-owned ``[layers, experts]`` array (the residency mask or
    the copies' landing times), handed to its policy instance without a copy per layer.

    When the GPU's rows and columns are slices (every placement but ``balanced``) it is a live
    read-only view of the engine's array, made once: the engine changes the array only between
    decisions, so during a decision the view holds what a copy would. Otherwise it is a buffer
    of the window's shape, refilled in place at each decision (:meth:`get`).
    """

    __slots__ = ("_buf", "_cols", "_out", "_rows", "_src", "_take")

    def __init__(self, placement: Placement, k: int) -> None:
        self._rows = placement.layer_cut[k]
        self._cols = placement.expert_cut[k]
        self._take = not (isinstance(self._rows, slice) and isinstance(self._cols, slice))
        self._src: np.ndarray | None = None
        self._out: np.ndarray | None = None
        self._buf: np.ndarray | None = None

    def get(self, a: np.ndarray) -> np.ndarray:
        """The window of ``a`` as it is now (a refill of the buffer, if there is one)."""
        if a is not self._src:
            self._src = a
            if self._take:
                n_rows = len(np.arange(a.shape[0])[self._rows])
                n_cols = len(np.arange(a.shape[1])[self._cols])
                self._buf = np.empty((n_rows, n_cols), dtype=a.dtype)
                out = self._buf.view()
            else:
                out = a[self._rows, self._cols]
            out.flags.writeable = False
            self._out = out
        buf = self._buf
        if buf is not None:
            rows, cols = self._rows, self._cols
            if isinstance(rows, slice):
                np.take(a[rows], cols, axis=1, out=buf, mode="clip")
            elif isinstance(cols, slice):
                np.take(a[:, cols], rows, axis=0, out=buf, mode="clip")
            else:
                buf[...] = a[np.ix_(rows, cols)]
        assert self._out is not None
        return self._out


class _Shard:
    """GPU ``k``'s side of the current decision: the engine's view and the routed experts that
    live on the GPU. Its methods build the GPU's gate weights, router probabilities and
    layer-early view, which its :class:`View` reads through ``View._rows`` only when the
    policy asks (:class:`_LazyRow`)."""

    __slots__ = ("k", "mine", "pl", "src")

    def __init__(self, placement: Placement, k: int) -> None:
        self.pl, self.k = placement, k
        self.src = View()
        self.mine: list[int] = []

    def weights(self) -> np.ndarray:
        """Decode: the gate weights of this GPU's routed experts; prefill: the mean top-k
        weights, unchanged."""
        ex = self.src.experts.tolist()
        weights = np.asarray(self.src.weights)
        if len(weights) == len(ex):
            return weights[[ex.index(e) for e in self.mine]]
        return weights

    def probs(self) -> np.ndarray:
        """The router probabilities of this GPU's experts."""
        return np.asarray(self.src.probs)[self.pl.expert_idx[self.k]]

    def next_here(self) -> bool:
        """Whether layer+1 has a layer-early view and is on this GPU."""
        at = self.pl.layer_at[self.k]
        nl = self.src.layer + 1
        return nl < len(at) and at[nl] >= 0 and self.src.next_experts is not None

    def next_experts(self) -> np.ndarray | None:
        """The layer-early top-k of layer+1 that are this GPU's (local ids), or None."""
        if not self.next_here():
            return None
        local = self.pl.local_expert[self.k]
        nxt = np.asarray(self.src.next_experts).tolist()
        return np.array([local[int(e)] for e in nxt if int(e) in local], dtype=np.int64)

    def next_probs(self) -> np.ndarray | None:
        """The layer-early router probabilities of this GPU's experts, or None."""
        if not self.next_here():
            return None
        nprobs = self.src.next_probs
        return None if nprobs is None else np.asarray(nprobs)[self.pl.expert_idx[self.k]]


class _LazyRow:
    """A stand-in for one of ``View._rows``' arrays: indexing it (as the view's lazy
    properties do, by layer) builds the value for the current decision."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make

    def __getitem__(self, layer: int) -> Any:
        return self._make()

    def __len__(self) -> int:
        return sys.maxsize  # every layer has a value (None where the view has none)


class ShardedPolicy(Policy):
    """One instance of a policy per GPU, each deciding for its GPU's experts only.

    Instance ``k`` sees a model of GPU ``k``'s layers and experts (local indices), its budget,
    the matching slices of the resident mask, the router probabilities and the calibration
    counts; the routed experts it is asked about are those of this layer that live on GPU
    ``k``. A GPU none of whose experts is routed in a layer is not asked for that layer. The
    plans are mapped back to global indices and merged (GPU 0's decisions first).

    Each instance keeps one :class:`View`, updated per decision: the residency and landing
    times are windows of the engine's arrays (:class:`_Window`), and the gate weights, router
    probabilities and layer-early view are built only when the policy reads them, through
    the view's own lazy rows (:class:`_LazyRow`), so a layer costs no copy the policy does not
    read and the view is a plain :class:`View` (a compiled one, too).
    """

    def __init__(self, inner: Policy, placement: Placement, budgets: list[int]) -> None:
        self.inner = [inner] + [type(inner)(**inner.options) for _ in range(placement.n - 1)]
        self.options = inner.options
        self.name = inner.name  # type: ignore[misc]
        self.summary = inner.summary  # type: ignore[misc]
        self.clairvoyant = inner.clairvoyant  # type: ignore[misc]
        self.bound = inner.bound  # type: ignore[misc]
        self.needs_calibration = inner.needs_calibration  # type: ignore[misc]
        self.runtime_profile = inner.runtime_profile  # type: ignore[misc]
        self.prefill_note = inner.prefill_note  # type: ignore[misc]
        self.pl = placement
        self.budgets = budgets
        self._cal: list[np.ndarray | None] = [None] * placement.n
        self._models: list[Any] = [None] * placement.n
        #: per GPU: its side of the current decision, its view (one object, updated per
        #: decision), and its windows of the residency mask and landing times
        self._shards = [_Shard(placement, k) for k in range(placement.n)]
        self._views = [View() for _ in range(placement.n)]
        for sh, v in zip(self._shards, self._views, strict=True):
            # the gate weights, probabilities and layer-early view are built when read, through
            # View's lazy rows
            v._rows = (
                _LazyRow(sh.weights),
                _LazyRow(sh.probs),
                _LazyRow(sh.next_experts),
                _LazyRow(sh.next_probs),
            )
        self._windows = [(_Window(placement, k), _Window(placement, k)) for k in range(placement.n)]
        #: per hook name: each instance's bound method (looked up once)
        self._hooks: dict[str, list[Any]] = {}
        #: per layer: the GPUs whose policy instance is asked (pipeline: the stage's GPU)
        self._asked = [
            [k for k in range(placement.n) if placement.layer_at[k][lay] >= 0]
            for lay in range(len(placement.gpu_of))
        ]
        #: per GPU: routed experts (global ids) -> the view's local ``experts`` array
        self._experts: list[dict[tuple[int, ...], np.ndarray]] = [{} for _ in range(placement.n)]

    def uses_calibration(self) -> bool:
        """As the wrapped policy."""
        return self.inner[0].uses_calibration()

    def uses_lookahead(self) -> bool:
        """As the wrapped policy."""
        return self.inner[0].uses_lookahead()

    def resources(self) -> ResourceSpec:
        """The wrapped policy's resources (each GPU gets its own buffers of this spec)."""
        return self.inner[0].resources()

    def _slice(self, a: np.ndarray | None, k: int) -> np.ndarray | None:
        if a is None:
            return None
        return np.ascontiguousarray(a[np.ix_(self.pl.layers_of[k], self.pl.experts_of[k])])

    def setup(self, ctx: SetupContext) -> list[Slot]:
        """Each instance places its GPU's initial experts; mapped back to global slots."""
        pl = self.pl
        out: list[Slot] = []
        for k, pol in enumerate(self.inner):
            layers, experts = pl.layers_of[k], pl.experts_of[k]
            model = dataclasses.replace(
                ctx.model,
                moe_layers=len(layers),
                experts=len(experts),
                top_k=min(ctx.model.top_k, len(experts)),
            )
            self._models[k] = model
            self._cal[k] = self._slice(ctx.calibration, k)
            v = self._views[k]
            v.model, v.costs, v.budget, v.calibration = (
                model,
                ctx.costs,
                self.budgets[k],
                self._cal[k],
            )
            seqs = ctx.calibration_sequences
            sub = SetupContext(
                model=model,
                budget=self.budgets[k],
                costs=ctx.costs,
                calibration=self._cal[k],
                calibration_prefill=self._slice(ctx.calibration_prefill, k),
                oracle=None if ctx.oracle is None else _LocalOracle(ctx.oracle, layers, experts),
                seed=ctx.seed,
                calibration_sequences=(
                    tuple(self._slice(s, k) for s in seqs)  # type: ignore[misc]
                    if seqs is not None
                    else None
                ),
            )
            placed = list(pol.setup(sub))
            if len(placed) > self.budgets[k]:
                raise UserError(
                    f"policy {self.name!r}: GPU {k} placed {len(placed)} experts, over its "
                    f"budget of {self.budgets[k]}"
                )
            out.extend((layers[int(ll)], experts[int(le)]) for ll, le in placed)
        return out

    def on_sequence_start(self, seq_id: int, n_prefill: int) -> None:
        """Every instance is told."""
        for pol in self.inner:
            pol.on_sequence_start(seq_id, n_prefill)

    def on_sequence_end(self, seq_id: int) -> None:
        """Every instance is told."""
        for pol in self.inner:
            pol.on_sequence_end(seq_id)

    def decode_layer(self, view: View) -> Plan:
        """Ask each GPU holding a routed expert of this layer; merge the plans."""
        return self._decide(view, "decode_layer")

    def prefill_layer(self, view: View) -> Plan:
        """As :meth:`decode_layer`, with the prefill hook."""
        return self._decide(view, "prefill_layer")

    def batch_layer(self, view: View) -> Plan:
        """As :meth:`decode_layer`, with the batch hook."""
        return self._decide(view, "batch_layer")

    def _view(self, view: View, k: int, mine: list[int]) -> View:
        """GPU ``k``'s view of this layer (its experts in local indices): the instance's
        reused :class:`View`, pointed at ``view``."""
        sh = self._shards[k]
        sh.src = view
        sh.mine = mine
        v = self._views[k]
        v.seq_id = view.seq_id
        v.step = view.step
        v.token = view.token
        v.position = view.position
        v.phase = view.phase
        v.n_tokens = view.n_tokens
        v.context = view.context
        v.now = view.now
        v.layer = self.pl.layer_at[k][view.layer]
        v.costs = view.costs
        # the local expert ids, one read-only array per set of routed experts (a few per GPU)
        memo = self._experts[k]
        key = tuple(mine)
        ex = memo.get(key)
        if ex is None:
            at = self.pl.expert_at[k]
            ex = memo[key] = np.array([at[e] for e in mine], dtype=np.int64)
            ex.flags.writeable = False
        v.experts = ex
        res_win, ready_win = self._windows[k]
        v.resident = res_win.get(view.resident)
        ready = view.ready
        v.ready = None if ready is None else ready_win.get(ready)
        counts = view.counts
        v.counts = None if counts is None else np.asarray(counts)[self.pl.expert_idx[k]]
        v._weights = v._probs = v._next_experts = v._next_probs = _LAZY
        return v

    def _decide(self, view: View, hook: str) -> Plan:
        pl = self.pl
        layer = view.layer
        row = pl.gpu_of[layer]
        routed: list[int] = view.experts.tolist()
        calls = self._hooks.get(hook)
        if calls is None:
            calls = self._hooks[hook] = [getattr(pol, hook) for pol in self.inner]
        mines: list[list[int]] = [[] for _ in calls]
        for e in routed:
            mines[row[e]].append(e)
        merged = Plan(actions={})
        actions = merged.actions
        assert actions is not None
        asked: list[tuple[list[int], Plan, list[int]]] = []
        substituted = False
        gpu, fetch = Action.GPU, Action.FETCH
        for k in self._asked[layer]:
            # asked even with no routed expert of its own: policies that prefetch or track
            # their copies expect a call at every layer they hold
            mine = mines[k]
            v = self._view(view, k, mine)
            plan = calls[k](v)
            experts = pl.experts_of[k]
            asked.append((mine, plan, experts))
            if plan.route is not None:
                substituted = True
            acts = plan.actions
            fetched = 0
            if acts is None:
                for e in mine:
                    actions[e] = gpu
            else:
                for le, a in acts.items():
                    actions[experts[int(le)]] = a
                    if a == fetch:
                        fetched += 1
            if plan.victims or plan.prefetch or plan.precalc or plan.evict:
                self._merge_slots(merged, plan, pl.layers_of[k], experts)
            if plan.cpu_serial:
                merged.cpu_serial = True
            if plan.cpu_first:
                merged.cpu_first = True
            if getattr(plan, "barrier", False):
                merged.barrier = True
            if plan.low_bit:
                merged.low_bit = frozenset(merged.low_bit) | {experts[int(e)] for e in plan.low_bit}
            if fetched or plan.prefetch:  # a plan adding no expert keeps its GPU within budget
                self._check_budget(v, k, plan, fetched)
        if substituted:
            # a substituted route names its GPU's experts: the layer's route is the union
            routes: list[int] = []
            raws: list[int] = []
            for mine, plan, experts in asked:
                if plan.route is not None:
                    routes.extend(experts[int(e)] for e in np.asarray(plan.route).tolist())
                else:
                    routes.extend(mine)
                raw = plan.raw_route if plan.raw_route is not None else plan.route
                raws.extend(
                    mine if raw is None else [experts[int(e)] for e in np.asarray(raw).tolist()]
                )
            merged.route = np.asarray(routes, dtype=np.int64)
            merged.raw_route = np.asarray(raws, dtype=np.int64)
        return merged

    @staticmethod
    def _merge_slots(merged: Plan, plan: Plan, layers: list[int], experts: list[int]) -> None:
        """Append a GPU's victims, prefetches, pre-calculations and evictions to the merged
        plan, in global indices."""
        for le, (vl, ve) in plan.victims.items():
            merged.victims[experts[int(le)]] = (layers[int(vl)], experts[int(ve)])
        merged.prefetch.extend(
            (
                layers[int(pl_)],
                experts[int(pe)],
                None if vv is None else (layers[int(vv[0])], experts[int(vv[1])]),
            )
            for pl_, pe, vv in plan.prefetch
        )
        merged.precalc.extend((layers[int(a)], experts[int(b)]) for a, b in plan.precalc)
        merged.evict.extend((layers[int(a)], experts[int(b)]) for a, b in plan.evict)

    def _check_budget(self, v: View, k: int, plan: Plan, fetched: int) -> None:
        """A GPU's resident experts after its plan (``fetched`` FETCH actions and its
        prefetches) stay within its own budget (``v``: the GPU's view of the layer)."""
        held = int(np.count_nonzero(v.resident))
        after = held + fetched + len(plan.prefetch) - len(plan.victims) - len(plan.evict)
        if plan.prefetch:
            after -= sum(1 for *_, vv in plan.prefetch if vv is not None)
        if after > self.budgets[k]:
            raise UserError(
                f"policy {self.name!r}: GPU {k} would hold {after} experts at layer "
                f"{self._shards[k].src.layer}, over its budget of {self.budgets[k]}"
            )


class _LocalOracle:
    """A clairvoyant policy's oracle (``simulator.runner.Oracle``) seen from one GPU: local
    (layer, expert) indices mapped to the model's; steps are the run's steps."""

    def __init__(self, oracle: Any, layers: list[int], experts: list[int]) -> None:
        self.oracle, self.layers, self.experts = oracle, layers, experts

    def next_use(self, layer: int, expert: int, after: int) -> float:
        """First step > ``after`` at which the local (layer, expert) is used, or infinity."""
        return self.oracle.next_use(self.layers[layer], self.experts[expert], after)


# -- the machine -------------------------------------------------------------------------------


class MultiMachine(Machine):
    """A :class:`Machine` with one stream, uplink and slot pool per GPU and the peer lanes."""

    def __init__(
        self,
        costs: CostModel,
        spec: ResourceSpec,
        runtime: RuntimeProfile | None,
        placement: Placement,
    ) -> None:
        super().__init__(costs, spec, runtime)
        multi = costs.hw.multi
        assert multi is not None
        self.multi = multi
        n = placement.n
        self.gpus = [Lane(f"gpu{k}") for k in range(n)]
        self.gpu = self.gpus[0]
        act = _memo(costs.activation_copy_s)
        h2d_s, d2h_s = self.links["h2d"].expert_s, self.links["d2h"].expert_s
        ups: list[tuple[Link, Link]] = []
        for k in range(1 if multi.shared_uplink else n):
            if costs.hw.link.copy_engines >= 2:
                hl, dl = Lane(f"h2d{k}"), Lane(f"d2h{k}")
            else:
                hl = dl = Lane(f"copy{k}")
            ups.append((Link(f"h2d{k}", hl, h2d_s, act), Link(f"d2h{k}", dl, d2h_s, act)))
        #: each GPU's (h2d, d2h) uplink (the same objects for every GPU on a shared uplink)
        self.uplinks = [ups[0 if multi.shared_uplink else k] for k in range(n)]
        self.links = {"h2d": self.uplinks[0][0], "d2h": self.uplinks[0][1]}
        #: direct peer lanes by (source, destination)
        self.peers: dict[tuple[int, int], Link] = {}
        if multi.peer_kind != "host":
            peer_s = _memo(costs.peer_activation_s)
            for a in range(n):
                for b in range(n):
                    if a != b and multi.direct(a, b):
                        name = f"peer{a}>{b}"
                        self.peers[(a, b)] = Link(name, Lane(name), 0.0, peer_s)

    def lanes(self) -> dict[str, Lane]:
        """Every distinct lane by name: GPU streams, uplinks, peer lanes, CPU workers."""
        out: dict[str, Lane] = {lane.name: lane for lane in self.gpus}
        for h, d in self.uplinks:
            out[h.lane.name] = h.lane
            out[d.lane.name] = d.lane
        for link in self.peers.values():
            out[link.lane.name] = link.lane
        for pool in self.pools.values():
            for lane in pool.lanes:
                out[lane.name] = lane
        return out

    def workers(self) -> dict[str, int]:
        """Workers per pool, and the number of GPUs (``gpu``)."""
        return {**super().workers(), "gpu": len(self.gpus)}

    def busy(self) -> dict[str, float]:
        """Busy seconds: ``gpu``/``h2d``/``d2h`` summed over the GPUs, then every lane."""
        out = {"gpu": sum(g.busy for g in self.gpus)}
        ups = {id(h.lane): h.lane for h, _ in self.uplinks}
        downs = {id(d.lane): d.lane for _, d in self.uplinks}
        out["h2d"] = sum(lane.busy for lane in ups.values())
        out["d2h"] = sum(lane.busy for lane in downs.values())
        for name, pool in self.pools.items():
            out[name] = pool.busy
        for name, lane in self.lanes().items():
            out.setdefault(name, lane.busy)
        return out


class PeerOp(LayerOp):
    """An activation transfer from GPU ``src`` to GPU ``dst`` (``n`` tokens)."""

    __slots__ = ("dst", "src")

    def __init__(self, seq: int, w: LayerWork, src: int, dst: int, n: int) -> None:
        super().__init__(PEER, "peer", seq, w.sid, w.token, w.layer, -1)
        self.src, self.dst, self.n = src, dst, n


class _MultiBase:
    """What both multi-GPU executors share: placement, per-GPU slots, peer operations."""

    # set by the executors' __init__
    pl: Placement
    machine: MultiMachine
    _peer_home: list[Lane] | None

    def _peer_init(self, placement: Placement, budgets: list[int]) -> None:
        eng: Any = self
        if eng.spec.nonexpert_streamed:
            # the streamed weights would cross the home GPU's uplink; not modelled here
            raise UserError(
                f"policy {eng.policy.name!r} streams its non-expert weights "
                "(ResourceSpec.nonexpert_streamed), which several GPUs do not model; "
                "run it on one GPU (stream-all: --policy-opt stream_nonexpert=false)"
            )
        if eng.spec.one_stream:
            # the per-GPU streams here are timed without that serialization
            raise UserError(
                f"policy {eng.policy.name!r} issues its copies on its kernels' stream "
                "(one_stream); the multi-GPU executors do not model that"
            )
        self.pl = placement
        old = eng.machine
        m = eng.machine = MultiMachine(eng.costs, eng.spec, None, placement)
        m.host, m.host_experts = old.host, old.host_experts  # the same runtime's thread
        #: the thread issuing each GPU's expert kernels: the main thread for GPU 0, one worker
        #: thread of its own for every other GPU (None: expert calls cost the host nothing)
        self._peer_hosts: list[Any] = [m.host_experts]
        for _ in range(1, placement.n):
            h = None
            if m.host_experts is not None:
                h = copy.copy(m.host_experts)
                h.t, h.syncs = 0.0, 0
            self._peer_hosts.append(h)
        n = placement.n
        staging = eng.spec.staging_buffers
        self._peer_cap = [b + staging for b in budgets]
        self._peer_budgets = list(budgets)
        res = eng.res
        res.cap = sum(self._peer_cap)
        occ = [0] * n
        for lay, e in zip(*np.nonzero(res.resident), strict=True):
            occ[placement.gpu_of[int(lay)][int(e)]] += 1
        self._peer_occ = occ
        self._peer_max = list(occ)
        self._peer_k = 0
        self._peer_home = [m.gpus[k] for k in placement.home]
        #: policies see when each copy lands (View.ready): with several GPUs the copies of one
        #: GPU's policy instance share lanes with the others' copies and peer activations
        ready = res.ready_at.view()
        ready.flags.writeable = False
        eng.view.ready = ready
        #: per-GPU bytes: expert copies in, write-backs out; and bytes per peer path
        self.peer_h2d_bytes = [0] * n
        self.peer_d2h_bytes = [0] * n
        self.peer_experts = [0] * n
        self.peer_bytes: dict[str, int] = {}
        self._peer_n = 0

    def _peer_gpu(self, op: LayerOp) -> int:
        if op.kind == CPU:  # activations leave from (and return to) the layer's home GPU
            return self.pl.home[op.layer]
        return self.pl.gpu_of[op.layer][op.expert]

    def _evict(self, slot: Any, needed: set[int], w: LayerWork) -> None:
        self._peer_k = self.pl.gpu_of[int(slot[0])][int(slot[1])]
        super()._evict(slot, needed, w)  # type: ignore[misc]

    def _peer_tokens(self, w: LayerWork, experts: list[int]) -> int:
        """Tokens whose activations go to a GPU computing ``experts`` of this layer."""
        if w.counts is None:
            return 1
        p = int(w.counts.sum()) // self.model.top_k  # type: ignore[attr-defined]
        return max(1, min(p, sum(int(w.counts[e]) for e in experts)))

    def _peer_plan(
        self, w: LayerWork
    ) -> tuple[dict[int, list[int]], dict[int, tuple[PeerOp, PeerOp]]]:
        """A layer's GPU experts per GPU and, for each GPU but the home one, its send and
        return transfers (issue numbers taken now, GPUs in order, in both executors)."""
        eng: Any = self
        home = self.pl.home[w.layer]
        row = self.pl.gpu_of[w.layer]
        per: dict[int, list[int]] = {}
        for e, _ in w.gpu:
            per.setdefault(row[e], []).append(e)
        xfer: dict[int, tuple[PeerOp, PeerOp]] = {}
        for k in sorted(per):
            if k == home:
                continue
            n = self._peer_tokens(w, per[k])
            eng._seq += 1
            send = PeerOp(eng._seq, w, home, k, n)
            eng._seq += 1
            back = PeerOp(eng._seq, w, k, home, n)
            xfer[k] = (send, back)
        return per, xfer

    def _peer_cross(self, w: LayerWork) -> PeerOp | None:
        """Pipeline: the hidden state's transfer to the next stage after a stage's last layer."""
        eng: Any = self
        home = self.pl.home
        if w.layer + 1 >= len(home) or home[w.layer + 1] == home[w.layer]:
            return None
        n = 1 if w.counts is None else max(1, int(w.counts.sum()) // eng.model.top_k)
        eng._seq += 1
        return PeerOp(eng._seq, w, home[w.layer], home[w.layer + 1], n)

    def _peer_record(self, lane: Lane, op: LayerOp, s: float, e: float, nbytes: int) -> None:
        rec = getattr(self, "recorder", None)
        if rec is not None:
            rec.op(lane.name, "peer", op.sid, op.token, op.layer, op.expert, s, e, nbytes)
        self.peer_bytes[lane.name] = self.peer_bytes.get(lane.name, 0) + nbytes

    def _peer_take(self, k: int, t: float) -> bool:
        if self._peer_occ[k] >= self._peer_cap[k]:
            return False
        self._peer_occ[k] += 1
        if self._peer_occ[k] > self._peer_max[k]:
            self._peer_max[k] = self._peer_occ[k]
        ok = self.res.take(t)  # type: ignore[attr-defined]
        assert ok
        return True

    def stats(self, e2e: float) -> Any:
        """The run's statistics; host syncs include every GPU's worker thread."""
        out = super().stats(e2e)  # type: ignore[misc]
        out.counters.host_syncs += sum(h.syncs for h in self._peer_hosts[1:] if h is not None)
        return out

    def multi_metrics(self) -> dict[str, Any]:
        """Per-GPU and per-peer-path figures for ``run --json``."""
        m = self.machine
        gpus = []
        for k, lane in enumerate(m.gpus):
            h, _ = m.uplinks[k]
            gpus.append(
                {
                    "gpu": k,
                    "busy_s": lane.busy,
                    "slots": self._peer_budgets[k],
                    "max_slots_used": self._peer_max[k],
                    "expert_computations": self.peer_experts[k],
                    "h2d_expert_bytes": self.peer_h2d_bytes[k],
                    "d2h_expert_bytes": self.peer_d2h_bytes[k],
                    "uplink": h.lane.name,
                    "layers": self.pl.layers_of[k][:1] + self.pl.layers_of[k][-1:],
                    "experts_per_layer": len(self.pl.experts_of[k]),
                    "experts": list(self.pl.experts_of[k]),
                }
            )
        return {
            "gpus": self.pl.n,
            "mode": self.pl.mode,
            "expert_placement": self.pl.rule,
            "peer_kind": m.multi.peer_kind,
            "per_gpu": gpus,
            "peer_bytes": dict(sorted(self.peer_bytes.items())),
            "peer_bytes_total": sum(self.peer_bytes.values()),
        }


class MultiGpuEngine(_MultiBase, Engine):
    """The fast executor over several GPUs (the queueing rule of docs/policy-api.md)."""

    def __init__(self, *args: Any, placement: Placement, budgets: list[int], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._peer_init(placement, budgets)
        m = self.machine
        self._h2d, self._d2h = m.uplinks[0]
        self._host = m.cpu
        self._peer_wait: list[deque[LayerOp]] = [deque() for _ in range(placement.n)]

    def _hits_only(self, *args: Any) -> float | None:
        return None  # the general path times every GPU's stream

    def _copies_only(self, *args: Any) -> float | None:
        return None

    def _free_slot(self, t: float) -> None:
        self._peer_release(self._peer_k, t)

    def _peer_release(self, k: int, t: float) -> None:
        """GPU ``k``'s slot is released at ``t``: to its first waiting fetch, else free."""
        q = self._peer_wait[k]
        if q:
            op = q.popleft()
            op.stage = 1
            self._push(t, op)
        else:
            self._peer_occ[k] -= 1
            self.res.free(t)

    def _serve_op(self, t: float, op: LayerOp) -> None:
        kind = op.kind
        if kind == WAKE:
            super()._serve_op(t, op)
            return
        if kind == PEER:
            self._peer_serve(t, op)  # type: ignore[arg-type]
            return
        k = self._peer_gpu(op)
        self._h2d, self._d2h = self.machine.uplinks[k]
        if kind == FETCH:
            if op.stage == 0:
                if not self._peer_take(k, t):
                    self._peer_wait[k].append(op)
                    return
                op.stage = 1
            lane = self._h2d.lane
            s, e = lane.serve(t, self._h2d.expert_s)
            self._record_copy(lane, op, op.rkind, s, e, self.expert_bytes)
            slot = (op.layer, op.expert)
            self.res.ready_at[slot] = e
            del self.res.copying[slot]
            self.peer_h2d_bytes[k] += self.expert_bytes
            op.end = e
            self._peer_ready(op)
        elif kind == TEMP:
            m = self.machine
            dur, nbytes = (
                (m.low_bit_s, m.low_bit_bytes)
                if op.low
                else (self._h2d.expert_s, self.expert_bytes)
            )
            lane = self._h2d.lane
            s, e = lane.serve(t, dur)
            self._record_copy(lane, op, "temp", s, e, nbytes)
            self.peer_h2d_bytes[k] += nbytes
            op.end = e
            self._peer_ready(op)
        elif kind == WRITEBACK and op.stage == 1:
            self._peer_release(k, t)
        else:
            if kind == WRITEBACK:
                self.peer_d2h_bytes[k] += self.expert_bytes
            super()._serve_op(t, op)

    def _record_copy(self, lane: Lane, op: LayerOp, kind: str, s: float, e: float, nb: int) -> None:
        if self.recorder is not None:
            self.recorder.op(lane.name, kind, op.sid, op.token, op.layer, op.expert, s, e, nb)

    def _peer_serve(self, t: float, op: PeerOp) -> None:
        m = self.machine
        nbytes = self.act_bytes * op.n
        direct = m.peers.get((op.src, op.dst))
        if direct is not None:
            lane = direct.lane
            s, e = lane.serve(t, direct.activation_s(op.n))
        elif op.stage == 0:  # staged through host memory: out on the sender's uplink ...
            d2h = m.uplinks[op.src][1]
            s, e = d2h.lane.serve(t, d2h.activation_s(op.n))
            self._peer_record(d2h.lane, op, s, e, nbytes)
            op.stage = 1
            self._push(e, op)
            return
        else:  # ... and in on the receiver's
            h2d = m.uplinks[op.dst][0]
            lane = h2d.lane
            s, e = lane.serve(t, h2d.activation_s(op.n))
        self._peer_record(lane, op, s, e, nbytes)
        op.end = e
        self._peer_ready(op)

    def _peer_ready(self, op: LayerOp) -> None:
        """A copy or a send the current layer's GPU work waits for has ended."""
        if not op.gpu:
            return
        op.gpu = False
        self._waiting -= 1
        st = self._peer_state
        if op.kind == PEER:
            k = op.dst  # type: ignore[attr-defined]
            base = st["base"]
            base[k] = max(base[k], op.end)  # type: ignore[type-var]
            for ready, e, buf in st["held"][k]:
                heapq.heappush(self._gheap, (max(ready, base[k]), ready, e, buf, k))  # type: ignore[arg-type]
            st["held"][k] = None
            return
        k = self.pl.gpu_of[op.layer][op.expert]
        self._peer_job(k, op.end, op.expert, op.buf if op.kind == TEMP else -1)  # type: ignore[arg-type]

    def _peer_job(self, k: int, ready: float, e: int, buf: int) -> None:
        st = self._peer_state
        held = st["held"][k]
        if held is not None:  # its GPU's activations are not there yet
            held.append((ready, e, buf))
        else:
            base = st["base"][k]
            heapq.heappush(self._gheap, (max(ready, base), ready, e, buf, k))  # type: ignore[arg-type]

    def _layer(self, w: LayerWork) -> float:
        now = w.now
        c = self.c
        pl, m = self.pl, self.machine
        n = pl.n
        home = pl.home[w.layer]
        push = self._push
        heap = self._heap
        serve = self._serve_op
        n_temp = m.buffers["temp"]
        free_bufs = [n_temp] * n
        tempq: list[deque[LayerOp]] = [deque() for _ in range(n)]
        per, xfer = self._peer_plan(w)
        # every GPU stream starts no earlier than now (the gate below may delay them further)
        st: dict[str, Any] = {"base": [now] * n, "held": [None] * n}
        self._peer_state = st
        self._gheap = []
        self._waiting = 0
        for k in xfer:
            st["held"][k] = []
        for op in w.ops:
            if op.kind == TEMP:
                k = self._peer_gpu(op)
                if free_bufs[k]:
                    free_bufs[k] -= 1
                    op.buf = n_temp - free_bufs[k] - 1
                    serve(now, op)
                else:
                    tempq[k].append(op)
            else:
                serve(now, op)
            while heap and heap[0][0] <= now:
                self._serve()
        for send, _ in xfer.values():  # the activations leave the home GPU now
            send.gpu = True
            self._waiting += 1
            serve(now, send)
            while heap and heap[0][0] <= now:
                self._serve()
        if w.cpu_first and w.sync:
            sync_end = max(self._resolve(op) for op in w.sync)
            if sync_end > now:
                c.cpu_wait += sync_end - now
                base = st["base"] = [max(b, sync_end) for b in st["base"]]
                self._gheap = [(max(r, base[k]), r, e, b, k) for _, r, e, b, k in self._gheap]
                heapq.heapify(self._gheap)
        # a gather barrier (Plan.barrier): every copy into this layer's slots lands first
        bar = self._gather_barrier(w) if getattr(w, "barrier", False) else -1.0
        row = pl.gpu_of[w.layer]
        for e, src in w.gpu:
            k = row[e]
            if src.__class__ is float:
                self._peer_job(k, max(src, bar), e, -1)
            elif src.end is not None:
                self._peer_job(k, max(src.end, bar), e, src.buf if src.kind == TEMP else -1)
            elif not src.gpu:
                src.gpu = True
                self._waiting += 1
        gheap = self._gheap
        g = list(st["base"])
        left = {k: len(v) for k, v in per.items()}
        rec = self.recorder
        counts = w.counts
        gpu_s = m.gpu_s
        unfused = set(per)  # GPUs whose fused call is still to be charged (first expert)
        deferred = w.deferred
        layer = w.layer
        hosts = self._peer_hosts
        busy = 0.0
        while gheap or self._waiting:
            while self._waiting and heap and (not gheap or heap[0][0] < gheap[0][0]):
                self._serve()
            if not gheap:
                raise RuntimeError("engine: a GPU waits for a copy that can never start")
            _, ready, e, buf, k = heapq.heappop(gheap)
            gk = drained = max(g[k], st["base"][k])
            if ready > gk:
                c.transfer_stall += ready - gk
                gk = ready
            d = gpu_s(int(counts[e]) if counts is not None else 1)
            if k in unfused:  # the fused call of this layer on GPU k, with its first expert
                unfused.discard(k)
                d += m.fused_launch_s
            host = hosts[k]
            if host is not None:  # the stream may wait for its thread to issue the kernels
                wait = host.expert(drained, gk, d) - d - gk
                if wait > 0.0:
                    c.dispatch_stall += wait
                    gk += wait
            if rec is not None:
                rec.op(m.gpus[k].name, "expert", w.sid, w.token, layer, e, gk, gk + d, 0)
            gk += d
            g[k] = gk
            busy += d
            m.gpus[k].busy += d
            self.peer_experts[k] += 1
            if deferred:
                wb = deferred.pop(e, None)
                if wb is not None:
                    push(gk, wb)
            if buf >= 0 and tempq[k]:  # the buffer is free again: copy the next one in
                nxt = tempq[k].popleft()
                nxt.buf = buf
                push(gk, nxt)
            left[k] -= 1
            if left[k] == 0 and k in xfer:  # its results go back to the home GPU
                push(gk, xfer[k][1])
        end = max(g[home], st["base"][home])
        for _, back in xfer.values():
            t = back.end if back.end is not None else self._resolve(back)
            if t > end:
                end = t
        g_end = end
        for op in w.results:
            t = op.end if op.end is not None else self._resolve(op)
            if t > end:
                end = t
        if end > g_end:
            c.cpu_wait += end - g_end
        c.gpu_expert_busy += busy
        cross = self._peer_cross(w)
        if cross is not None:
            push(end, cross)
            end = self._resolve(cross)
        return end


def split_budget(placement: Placement, per_gpu: int) -> list[int]:
    """Each GPU's slot budget: ``per_gpu`` (one GPU's memory), at most what it can hold."""
    return [min(per_gpu, placement.capacity(k)) for k in range(placement.n)]


def engine_for(name: str) -> type[Engine] | type[MultiGpuReference]:
    """The multi-GPU executor for ``--engine NAME``."""
    return MultiGpuReference if name == "reference" else MultiGpuEngine


__all__: Iterable[str] = (
    "EXPERT_PLACEMENTS",
    "MODES",
    "MultiGpuConfig",
    "MultiGpuEngine",
    "MultiGpuReference",
    "Placement",
    "ShardedPolicy",
    "balanced_experts",
    "check_config",
    "engine_for",
    "split_budget",
)
