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

This module holds the placement (:class:`Placement`: which GPU holds each expert and runs each
layer's non-expert part) and the policy side. Policies are unchanged: :class:`ShardedPolicy`
runs one instance of the policy per GPU, each seeing only that GPU's experts (a smaller model:
its layers, its experts, its budget) with local indices, and merges their plans into one. The
engine core times several GPUs as several resource sets of one machine
(``daopsim.simulator.core.machine``); the reference engine (:mod:`daopsim.simulator.reference`)
models them itself, and the two give identical timelines.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from daopsim.policies.base import (
    _LAZY,
    Action,
    Plan,
    Policy,
    ResourceSpec,
    SetupContext,
    Slot,
    View,
)
from daopsim.simulator.boundary import Hooks, check_gpu_budget, check_placement, frozen
from daopsim.simulator.errors import UserError
from daopsim.simulator.hardware_spec import HardwareProfile

MODES = ("expert", "pipeline")
#: expert-parallel placement rules (``--expert-placement``)
EXPERT_PLACEMENTS = ("mod", "balanced")


@dataclass(frozen=True)
class MultiGpuConfig:
    """How many GPUs a run uses and how the model is split over them."""

    gpus: int
    mode: str = "expert"
    #: expert parallel: ``mod`` (expert e on GPU e mod N) or ``balanced`` (by calibration
    #: popularity, :func:`balanced_experts`)
    placement: str = "mod"


def check_mode_has_gpus(mode_given: bool, most_gpus: int) -> None:
    """A multi-GPU mode needs a GPU count of 2 or more: without one it would be dropped in
    silence (one GPU runs). Shared by ``run`` and ``sweep`` (whose largest ``gpus`` counts)."""
    if mode_given and most_gpus < 2:
        raise UserError("--multi-gpu needs --gpus 2 or more")


def check_config(
    profile: HardwareProfile, gpus: int, mode: str | None, placement: str | None = None
) -> MultiGpuConfig | None:
    """The run's multi-GPU setting from ``--gpus``/``--multi-gpu``/``--expert-placement``
    (each value checked as declared, simulator/run_params.py); None for one GPU."""
    if placement is not None and (gpus < 2 or (mode or "expert") != "expert"):
        raise UserError("--expert-placement needs --gpus 2 or more and --multi-gpu expert")
    have = profile.multi.count if profile.multi is not None else 1
    if gpus > have:
        raise UserError(
            f"--gpus {gpus}: profile {profile.name!r} has {have} GPU{'s' if have > 1 else ''}"
        )
    check_mode_has_gpus(mode is not None, gpus)
    if gpus == 1:
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
        value = self._make()
        if isinstance(value, np.ndarray):
            value.flags.writeable = False  # as the engine's own view (boundary.frozen)
        return value

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
            placed = check_placement(
                Hooks(pol), pol.setup(sub), len(layers), len(experts), self.budgets[k],
                f"GPU {k}'s initial placement",
            )  # fmt: skip
            out.extend((layers[ll], experts[le]) for ll, le in placed)
        return out

    def on_sequence_start(self, seq_id: int, n_prefill: int) -> None:
        """Every instance is told."""
        for v in self._views:
            v.step = -1  # the next step's fields are copied into every GPU's view (_view)
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
        if v.step != view.step:  # a new step (numbered per run): its fields, once
            v.seq_id = view.seq_id
            v.step = view.step
            v.token = view.token
            v.position = view.position
            v.phase = view.phase
            v.n_tokens = view.n_tokens
            v.context = view.context
        v.now = view.now
        v.layer = self.pl.layer_at[k][view.layer]
        # its own GPU's copy lane (View.copy_free)
        v.gpu, v._copy_free_times, v._copy_seconds = k, view._copy_free_times, view._copy_seconds
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
        v.ready = ready_win.get(view.ready)
        counts = view.counts
        v.counts = None if counts is None else frozen(np.asarray(counts)[self.pl.expert_idx[k]])
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
                held = int(np.count_nonzero(v.resident))
                check_gpu_budget(self.name, view, k, held, plan, fetched, self.budgets[k])
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


class _LocalOracle:
    """A clairvoyant policy's oracle (``daopsim.simulator.oracle.Oracle``) seen from one GPU: local
    (layer, expert) indices mapped to the model's; steps are the run's steps."""

    def __init__(self, oracle: Any, layers: list[int], experts: list[int]) -> None:
        self.oracle, self.layers, self.experts = oracle, layers, experts

    def next_use(self, layer: int, expert: int, after: int) -> float:
        """First step > ``after`` at which the local (layer, expert) is used, or infinity."""
        return self.oracle.next_use(self.layers[layer], self.experts[expert], after)


def split_budget(placement: Placement, per_gpu: int) -> list[int]:
    """Each GPU's slot budget: ``per_gpu`` (one GPU's memory), at most what it can hold."""
    return [min(per_gpu, placement.capacity(k)) for k in range(placement.n)]


__all__: Iterable[str] = (
    "EXPERT_PLACEMENTS",
    "MODES",
    "MultiGpuConfig",
    "Placement",
    "ShardedPolicy",
    "balanced_experts",
    "check_config",
    "split_budget",
)
