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
(``simulator.core.machine``); the reference engine (:mod:`simulator.reference`) models them
itself, and the two give identical timelines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.base import Action, Plan, Policy, ResourceSpec, SetupContext, Slot, View
from simulator.errors import UserError
from simulator.hardware import HardwareProfile

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

    def capacity(self, k: int) -> int:
        """How many (layer, expert) slots GPU ``k`` can hold at most."""
        return len(self.layers_of[k]) * len(self.experts_of[k])


# -- the policy side -------------------------------------------------------------------------


class ShardedPolicy(Policy):
    """One instance of a policy per GPU, each deciding for its GPU's experts only.

    Instance ``k`` sees a model of GPU ``k``'s layers and experts (local indices), its budget,
    the matching slices of the resident mask, the router probabilities and the calibration
    counts; the routed experts it is asked about are those of this layer that live on GPU
    ``k``. A GPU none of whose experts is routed in a layer is not asked for that layer. The
    plans are mapped back to global indices and merged (GPU 0's decisions first).
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
        """GPU ``k``'s view of this layer: its experts in local indices."""
        pl = self.pl
        experts_k = pl.experts_of[k]
        local = pl.local_expert[k]
        layer = view.layer
        v = View()
        for name in ("seq_id", "step", "token", "position", "phase", "n_tokens", "context", "now"):
            setattr(v, name, getattr(view, name))
        v.layer = pl.local_layer[(k, layer)]
        v.model = self._models[k]
        v.costs = view.costs
        v.budget = self.budgets[k]
        v.calibration = self._cal[k]
        v.experts = np.array([local[e] for e in mine], dtype=np.int64)
        ex = view.experts.tolist()
        weights = np.asarray(view.weights)
        # decode: one gate weight per routed expert; prefill: the mean top-k weights, kept
        v.weights = weights[[ex.index(e) for e in mine]] if len(weights) == len(ex) else weights
        v.probs = np.asarray(view.probs)[experts_k]
        v.counts = None if view.counts is None else np.asarray(view.counts)[experts_k]
        resident = view.resident[np.ix_(pl.layers_of[k], experts_k)]
        resident.flags.writeable = False
        v.resident = resident
        # the runtime's own view of which copies are still in flight: on a shared uplink (or one
        # carrying peer activations) a policy's private ledger of its copies under-predicts
        ready = view.ready
        if ready is not None:
            ready = ready[np.ix_(pl.layers_of[k], experts_k)]
            ready.flags.writeable = False
        v.ready = ready
        nxt = view.next_experts
        if nxt is not None and (k, layer + 1) in pl.local_layer:
            v.next_experts = np.array(
                [local[int(e)] for e in np.asarray(nxt).tolist() if int(e) in local],
                dtype=np.int64,
            )
            v.next_probs = (
                None if view.next_probs is None else np.asarray(view.next_probs)[experts_k]
            )
        else:
            v.next_experts = v.next_probs = None
        return v

    def _decide(self, view: View, hook: str) -> Plan:
        pl = self.pl
        layer = view.layer
        row = pl.gpu_of[layer]
        routed = [int(e) for e in view.experts.tolist()]
        merged = Plan(actions={})
        actions = merged.actions
        assert actions is not None
        routes: list[int] = []
        raws: list[int] = []
        substituted = False
        for k, pol in enumerate(self.inner):
            if (k, layer) not in pl.local_layer:
                continue  # pipeline: another stage's layer
            # asked even with no routed expert of its own: policies that prefetch or track
            # their copies expect a call at every layer they hold
            mine = [e for e in routed if row[e] == k]
            plan = getattr(pol, hook)(self._view(view, k, mine))
            layers, experts = pl.layers_of[k], pl.experts_of[k]
            # a substituted route names this GPU's experts: the layer's route is the union
            if plan.route is not None:
                routes.extend(experts[int(e)] for e in np.asarray(plan.route).tolist())
                substituted = True
            else:
                routes.extend(mine)
            raw = plan.raw_route if plan.raw_route is not None else plan.route
            raws.extend(
                mine if raw is None else [experts[int(e)] for e in np.asarray(raw).tolist()]
            )

            def g(s: Any, layers: list[int] = layers, experts: list[int] = experts) -> Slot:
                return (layers[int(s[0])], experts[int(s[1])])

            if plan.actions is None:
                for e in mine:
                    actions[e] = Action.GPU
            else:
                for le, a in plan.actions.items():
                    actions[experts[int(le)]] = a
            for le, victim in plan.victims.items():
                merged.victims[experts[int(le)]] = g(victim)
            merged.prefetch.extend(
                (*g((pl_, pe)), None if v is None else g(v)) for pl_, pe, v in plan.prefetch
            )
            merged.precalc.extend(g(s) for s in plan.precalc)
            merged.evict.extend(g(s) for s in plan.evict)
            merged.cpu_serial = merged.cpu_serial or plan.cpu_serial
            merged.cpu_first = merged.cpu_first or plan.cpu_first
            merged.barrier = merged.barrier or getattr(plan, "barrier", False)
            if plan.low_bit:
                merged.low_bit = frozenset(merged.low_bit) | {experts[int(e)] for e in plan.low_bit}
            self._check_budget(view, k, plan)
        if substituted:
            merged.route = np.asarray(routes, dtype=np.int64)
            merged.raw_route = np.asarray(raws, dtype=np.int64)
        return merged

    def _check_budget(self, view: View, k: int, plan: Plan) -> None:
        """A GPU's resident experts after its plan stay within its own budget."""
        pl = self.pl
        held = int(view.resident[np.ix_(pl.layers_of[k], pl.experts_of[k])].sum())
        fetched = sum(1 for a in (plan.actions or {}).values() if a == Action.FETCH)
        after = held + fetched + len(plan.prefetch) - len(plan.victims) - len(plan.evict)
        after += sum(1 for *_, v in plan.prefetch if v is not None) * -1
        if after > self.budgets[k]:
            raise UserError(
                f"policy {self.name!r}: GPU {k} would hold {after} experts at layer "
                f"{view.layer}, over its budget of {self.budgets[k]}"
            )


class _LocalOracle:
    """A clairvoyant policy's oracle (``simulator.runner.Oracle``) seen from one GPU: local
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
