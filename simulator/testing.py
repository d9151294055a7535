"""Helpers that build small, valid routing traces for tests (this project's and plugin authors').

``make_trace`` writes a random but valid trace in one call; ``routing_from_experts`` turns
hand-written expert ids into a ``SequenceRouting`` so a test can state exact routing and check
exact results. Randomness comes only from the ``seed`` argument, so fixtures are reproducible.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from daopsim.policies.base import Action, Plan, Policy, ResourceSpec, SetupContext, Slot, View
from daopsim.simulator.hardware_spec import HardwareProfile
from daopsim.simulator.models import ModelShape, get_model
from daopsim.simulator.trace_format import (
    ALL_PROBS_MAX_EXPERTS,
    DEFAULT_TOP_M,
    SequenceRouting,
    TraceMeta,
    blank_first_layer_view,
)
from daopsim.simulator.trace_write import write_trace


def tiny_model(
    experts: int = 8, top_k: int = 2, moe_layers: int = 4, name: str = "tiny"
) -> ModelShape:
    """A small model shape (a few layers) so test traces stay tiny."""
    return ModelShape(
        name=name,
        family="test",
        layers=moe_layers,
        moe_layers=moe_layers,
        hidden=64,
        expert_ffn=128,
        experts=experts,
        top_k=top_k,
        non_expert_params=100_000,
        kv_bytes_per_token=1024,
        attention_heads=4,  # 4 heads of 16, so runtimes with eager attention run on it too
        source="daopsim.simulator.testing.tiny_model",
    )


def setup_context(
    moe_layers: int,
    experts: int,
    budget: int,
    calibration: np.ndarray | None = None,
    layers: int | None = None,
    top_k: int = 2,
    hw: str = "a6000-pcie4",
) -> SetupContext:
    """A policy's set-up context for a tiny model of this shape (to call ``setup`` directly)."""
    from daopsim.simulator.costs import cost_model
    from daopsim.simulator.hardware import load_profile

    model = dataclasses.replace(
        tiny_model(experts=experts, top_k=min(top_k, experts), moe_layers=moe_layers),
        layers=moe_layers if layers is None else layers,
    )
    costs = cost_model(load_profile(hw), model)
    return SetupContext(
        model=model, budget=budget, costs=costs, calibration=calibration, calibration_prefill=None
    )


def decode_view(
    layer: int,
    experts: Sequence[int],
    resident: np.ndarray | None = None,
    n_tokens: int = 1,
) -> View:
    """A policy's view of one layer's routing (to call ``decode_layer`` directly): every
    resident expert landed (``ready`` 0) and the copy lane idle, at time 0."""
    v = View()
    v.layer = layer
    v.experts = np.asarray(experts, dtype=np.int64)
    v.n_tokens = n_tokens
    if resident is not None:
        v.resident = resident
        v.ready = np.zeros(resident.shape)
    v._copy_free_times = _idle_lane
    return v


def _idle_lane(gpu: int) -> list[float]:
    """A copy lane (one engine) with nothing queued (``decode_view``)."""
    return [0.0]


def _resolve_model(model: str | ModelShape) -> ModelShape:
    return model if isinstance(model, ModelShape) else get_model(model)


def _probs_stored(model: ModelShape, top_m: int | None) -> int:
    if top_m is not None:
        return min(int(top_m), model.experts)
    if model.experts <= ALL_PROBS_MAX_EXPERTS:
        return model.experts
    return min(DEFAULT_TOP_M, model.experts)


def make_meta(
    model: str | ModelShape, top_m: int | None = None, provenance: dict[str, Any] | None = None
) -> TraceMeta:
    """Trace metadata for ``model`` with the storage rule of the format (all E or top-m)."""
    shape = _resolve_model(model)
    return TraceMeta(
        model=shape,
        provenance=dict(provenance or {"source": "test", "generator": "daopsim.simulator.testing"}),
        probs_stored=_probs_stored(shape, top_m),
        moe_layer_ids=list(range(shape.first_moe_layer, shape.first_moe_layer + shape.moe_layers)),
    )


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _stored(probs: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Full ``[..., E]`` probabilities to what a trace stores: all, or the top ``width`` + ids."""
    if width == probs.shape[-1]:
        return probs.astype(np.float32), None
    ids = np.argsort(-probs, axis=-1, kind="stable")[..., :width]
    return np.take_along_axis(probs, ids, axis=-1).astype(np.float32), ids.astype(np.int16)


def random_routing(
    model: ModelShape,
    seq_id: int,
    n_prefill: int,
    n_decode: int,
    rng: np.random.Generator,
    probs_stored: int | None = None,
    temperature: float = 1.0,
) -> SequenceRouting:
    """Independent random routing: each token-layer's router logits are i.i.d. normal.

    With i.i.d. logits the top-k set is uniform over all k-subsets, so the statistics of such
    a trace sit at their chance values (e.g. overlap k/E). The one-layer-early view is the
    same router on perturbed logits, so it agrees with the real top-k most of the time.
    """
    t, n_layers, n_exp, k = n_prefill + n_decode, model.moe_layers, model.experts, model.top_k
    width = probs_stored or _probs_stored(model, None)
    logits = rng.standard_normal((t, n_layers, n_exp)) / temperature
    early_logits = logits + 0.7 * rng.standard_normal(logits.shape) / temperature
    probs, early = _softmax(logits), _softmax(early_logits)
    experts = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    top = np.take_along_axis(probs, experts, axis=-1)
    weights = top / top.sum(axis=-1, keepdims=True)
    early_experts = np.argsort(-early, axis=-1, kind="stable")[..., :k]
    p_store, p_ids = _stored(probs, width)
    e_store, e_ids = _stored(early, width)
    early_experts = early_experts.astype(np.int16)
    blank_first_layer_view(early_experts, e_store, e_ids)
    return SequenceRouting(
        seq_id=seq_id,
        positions=np.arange(t, dtype=np.int32),
        n_prefill=n_prefill,
        experts=experts.astype(np.int16),
        weights=weights.astype(np.float32),
        probs=p_store,
        early_experts=early_experts,
        early_probs=e_store,
        prob_ids=p_ids,
        early_prob_ids=e_ids,
    )


def routing_from_experts(
    model: ModelShape,
    experts: Sequence[Any] | np.ndarray,
    n_prefill: int = 0,
    seq_id: int = 0,
    weights: Sequence[Any] | np.ndarray | None = None,
    early_experts: Sequence[Any] | np.ndarray | None = None,
    probs_stored: int | None = None,
) -> SequenceRouting:
    """A sequence from explicit expert ids shaped ``[tokens, layers, k]`` (exact tests).

    Weights default to a fixed descending split (0.6/0.4 for top-2; rank-proportional
    otherwise). ``early_experts`` defaults to the actual experts (a perfect one-layer-early
    view); layer 0's view is always absent. Probabilities put the gate weights on the selected
    experts and spread the rest evenly.
    """
    ex = np.asarray(experts, dtype=np.int16)
    t, n_layers, k = ex.shape
    assert n_layers == model.moe_layers and k == model.top_k, "shape must be [T, L, k]"
    n_exp = model.experts
    if weights is None:
        base = np.arange(k, 0, -1, dtype=np.float64) + (0.5 if k == 2 else 0.0)
        w = np.broadcast_to(base / base.sum(), ex.shape).astype(np.float32)
    else:
        w = np.asarray(weights, dtype=np.float32).reshape(ex.shape)
    ee = ex.copy() if early_experts is None else np.asarray(early_experts, np.int16).copy()
    width = probs_stored or _probs_stored(model, None)

    def probs_for(sel: np.ndarray) -> np.ndarray:
        full = np.full((t, n_layers, n_exp), 0.0, dtype=np.float64)
        if n_exp > k:
            full[:] = 0.1 / (n_exp - k)
        np.put_along_axis(full, sel.astype(np.int64), 0.9 * w if n_exp > k else w, axis=-1)
        return full

    p_store, p_ids = _stored(probs_for(ex), width)
    e_store, e_ids = _stored(probs_for(ee), width)
    blank_first_layer_view(ee, e_store, e_ids)
    return SequenceRouting(
        seq_id=seq_id,
        positions=np.arange(t, dtype=np.int32),
        n_prefill=n_prefill,
        experts=ex,
        weights=w,
        probs=p_store,
        early_experts=ee,
        early_probs=e_store,
        prob_ids=p_ids,
        early_prob_ids=e_ids,
    )


def make_trace(
    path: str | os.PathLike[str],
    model: str | ModelShape = "tiny",
    sequences: int = 2,
    prefill: int = 8,
    decode: int = 8,
    seed: int = 0,
    top_m: int | None = None,
    row_group_rows: int = 65536,
    provenance: dict[str, Any] | None = None,
) -> Path:
    """Write a small valid trace of random routing to ``path``; returns the path.

    ``model`` is a preset name, ``"tiny"`` (see ``tiny_model``) or a ``ModelShape``.
    Each of ``sequences`` sequences has ``prefill`` prompt and ``decode`` generated tokens.
    """
    shape = tiny_model() if model == "tiny" else _resolve_model(model)
    meta = make_meta(
        shape,
        top_m=top_m,
        provenance=provenance
        or {
            "source": "synthetic",
            "generator": "daopsim.simulator.testing.make_trace",
            "seed": seed,
        },
    )
    rng = np.random.default_rng(seed)
    routings = (
        random_routing(shape, s, prefill, decode, rng, probs_stored=meta.probs_stored)
        for s in range(sequences)
    )
    return write_trace(path, meta, routings, row_group_rows=row_group_rows)


class ChaosPolicy(Policy):
    """Random legal decisions (tests only): every action, prefetches, evictions, pre-calculations.

    It reads the engine under test (``engine.ready_at``, ``engine.precalc``) to know which
    copies have ended and which pre-calculations exist, so every plan it returns is legal.
    With ``in_flight`` its victims may be experts whose copy is still in flight.
    """

    name = "chaos"

    def __init__(
        self,
        rng: np.random.Generator,
        cpu_workers: int,
        temp_buffers: int,
        writeback: bool = False,
        staging_buffers: int = 0,
        one_stream: bool = False,
        flags: bool = False,
        in_flight: bool = False,
    ) -> None:
        super().__init__()
        self.rng = rng
        #: also name victims whose copy is still in flight (issued by an earlier plan or
        #: earlier in this one); without it every victim has landed
        self.in_flight = in_flight
        #: also draw the plan's flags (cpu_serial, cpu_first, barrier), "all on the GPU" as
        #: ``actions=None``, and numpy integers for slots (drawn after the rest, so a run
        #: without them replays the same plans as before they existed)
        self.flags = flags
        self.spec = ResourceSpec(
            cpu_workers=cpu_workers,
            temp_buffers=temp_buffers,
            writeback=writeback,
            staging_buffers=staging_buffers,
            one_stream=one_stream,
        )
        self.engine: Any = None  # the engine under test, set by the test after building it
        self.precomputed: list[tuple[int, int, int, int]] = []  # (seq, token, layer, expert)

    def resources(self) -> ResourceSpec:
        """The random worker and buffer counts."""
        return self.spec

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """A random initial placement within the budget."""
        n_l, n_e = ctx.model.moe_layers, ctx.model.experts
        total = n_l * n_e
        n = int(self.rng.integers(0, ctx.budget + 1))
        picks = self.rng.choice(total, size=min(n, total), replace=False)
        return [(int(i) // n_e, int(i) % n_e) for i in picks]

    def _ready(self, slot: Slot, now: float) -> bool:
        assert self.engine is not None
        return bool(self.engine.ready_at[slot] <= now)

    def decode_layer(self, view: View) -> Plan:
        """Random legal plan: maybe an eviction, an action per routed expert, maybe
        prefetches (two with ``in_flight``), maybe a pre-calculation, maybe flags."""
        eng = self.engine
        assert eng is not None
        rng, layer = self.rng, view.layer
        draft = _ChaosDraft(self, view)
        # explicit evictions of experts this layer does not route
        if rng.random() < 0.2:
            draft.evict_unrouted()
        for e in draft.routed:
            draft.act(e)
        # background work (with in_flight up to two prefetches: the second may evict the first)
        for _ in range(2 if self.in_flight else 1):
            if rng.random() >= 0.3:
                continue
            draft.prefetch_one()
        plan = draft.plan
        if layer + 1 < view.model.moe_layers and rng.random() < 0.3:  # type: ignore[union-attr]
            pl = int(rng.integers(layer + 1, view.model.moe_layers))  # type: ignore[union-attr]
            pe = int(rng.integers(view.model.experts))  # type: ignore[union-attr]
            if (pl, pe) not in eng.precalc and not self.spec.one_stream:
                plan.precalc.append((pl, pe))
        if self.flags:
            self._draw_flags(plan, layer, view.model)
        return plan

    def _draw_flags(self, plan: Plan, layer: int, model: Any) -> None:
        rng = self.rng
        eng = self.engine
        n_layers = model.moe_layers
        if layer + 1 < n_layers and not self.spec.one_stream and rng.random() < 0.3:
            # a second pre-calculation (a serial task chains the two)
            slot = (int(rng.integers(layer + 1, n_layers)), int(rng.integers(model.experts)))
            if slot not in eng.precalc and slot not in plan.precalc:
                plan.precalc.append(slot)
        plan.cpu_serial = bool(rng.random() < 0.5)
        plan.cpu_first = bool(rng.random() < 0.3)
        plan.barrier = bool(rng.random() < 0.3)
        assert plan.actions is not None
        if all(a == Action.GPU for a in plan.actions.values()) and rng.random() < 0.5:
            plan.actions = None
        if rng.random() < 0.3:  # slots as numpy integers (the plan checks accept them)
            plan.victims = {e: (np.int64(a), np.int64(b)) for e, (a, b) in plan.victims.items()}
            plan.evict = [(np.int64(a), np.int64(b)) for a, b in plan.evict]
            plan.prefetch = [(np.int64(a), np.int64(b), v) for a, b, v in plan.prefetch]


class _ChaosDraft:
    """One plan of :class:`ChaosPolicy` as it is drawn: the slots it evicts and fills so far
    and the budget they use, so that each further draw stays legal."""

    def __init__(self, policy: ChaosPolicy, view: View) -> None:
        self.policy, self.view = policy, view
        self.eng = policy.engine
        self.rng, self.layer, self.now = policy.rng, view.layer, view.now
        self.res = view.resident
        self.routed = [int(e) for e in view.experts.tolist()]
        self.held = int(self.res.sum())
        self.budget = view.budget
        self.taken: set[Slot] = set()  # slots evicted or newly filled in this plan
        self.filled: list[Slot] = []  # slots filled in this plan, in order
        self.gone: set[Slot] = set()  # slots evicted in this plan
        self.plan = Plan(actions={})

    def victim(self, exclude_layer_experts: set[int]) -> Slot | None:
        """A random evictable slot outside this layer's ``exclude_layer_experts``: with
        ``in_flight`` any resident one (half the time one still in flight), else one whose
        copy has landed and that this plan has not touched."""
        rng, res, layer, now = self.rng, self.res, self.layer, self.now
        ready = self.policy._ready
        if self.policy.in_flight:  # any resident expert, half the time one still in flight
            pool = [(int(a), int(b)) for a, b in zip(*np.nonzero(res), strict=True)]
            cands = [
                s
                for s in pool + self.filled
                if s not in self.gone and not (s[0] == layer and s[1] in exclude_layer_experts)
            ]
            flying = [s for s in cands if s in self.filled or not ready(s, now)]
            if flying and rng.random() < 0.5:
                cands = flying
        else:
            cands = [
                (int(a), int(b))
                for a, b in zip(*np.nonzero(res), strict=True)
                if (int(a), int(b)) not in self.taken
                and not (a == layer and int(b) in exclude_layer_experts)
                and ready((int(a), int(b)), now)
            ]
        if not cands:
            return None
        return cands[int(self.rng.integers(len(cands)))]

    def _evicted(self, v: Slot) -> None:
        self.taken.add(v)
        self.gone.add(v)

    def _filled(self, slot: Slot) -> None:
        self.taken.add(slot)
        self.filled.append(slot)

    def evict_unrouted(self) -> None:
        """An explicit eviction of an expert this layer does not route, if there is one."""
        v = self.victim(set(self.routed))
        if v is not None:
            self.plan.evict.append(v)
            self._evicted(v)
            self.held -= 1

    def act(self, e: int) -> None:
        """A random legal action for the routed expert ``e`` (a fetch past the budget
        evicts a victim, or becomes a temporary copy when there is none)."""
        rng, layer, plan = self.rng, self.layer, self.plan
        assert plan.actions is not None
        if self.res[layer, e] and (layer, e) not in self.taken:
            opts = [Action.GPU, Action.CPU]
        else:
            opts = [Action.FETCH, Action.TEMP, Action.CPU]
        if self.policy.spec.one_stream:  # a one-stream spec runs no expert on the CPU
            opts.pop()
        elif (layer, e) in self.eng.precalc:
            opts.append(Action.PRECOMPUTED)
        a = opts[int(rng.integers(len(opts)))]
        if a == Action.FETCH:
            if self.held < self.budget:
                self.held += 1
            else:
                v = self.victim(set(self.routed))
                if v is None:
                    a = Action.TEMP
                else:
                    plan.victims[e] = v
                    self._evicted(v)
            if a == Action.FETCH:
                self._filled((layer, e))
        if a == Action.PRECOMPUTED:
            self.policy.precomputed.append((self.view.seq_id, self.view.token, layer, e))
        plan.actions[e] = a

    def prefetch_one(self) -> None:
        """A prefetch of a random non-resident expert this layer does not route, evicting a
        victim when the budget is full."""
        rng, res, layer = self.rng, self.res, self.layer
        free = [
            (int(a), int(b))
            for a, b in zip(*np.nonzero(~res), strict=True)
            if (int(a), int(b)) not in self.taken and not (a == layer and int(b) in self.routed)
        ]
        if not free:
            return
        slot = free[int(rng.integers(len(free)))]
        if self.held < self.budget:
            self.plan.prefetch.append((slot[0], slot[1], None))
            self.held += 1
            self._filled(slot)
        else:
            v = self.victim(set(self.routed))
            if v is not None:
                self._evicted(v)
                self._filled(slot)
                self.plan.prefetch.append((slot[0], slot[1], v))


def perfetto_reference(timeline: Any, occupancy: Any, metadata: dict[str, Any]) -> dict[str, Any]:
    """The Perfetto document of a timeline built the plain way, one dict per event over all
    rows at once (what ``RunResult.to_perfetto`` wrote before it streamed): an oracle for
    tests and the bench of simulator/perfetto.py, slow on purpose."""
    import pandas as pd

    from daopsim.simulator.perfetto import TICKS_PER_US, lane_ticks, resource_order

    tl = timeline
    resources = sorted(tl["resource"].astype(str).unique(), key=resource_order)
    tids = {r: i + 1 for i, r in enumerate(resources)}
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "daopsim host"}}
    ]
    for r, tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": r}})
    res = tl["resource"].astype(str).to_numpy()
    kind = tl["kind"].astype(str).to_numpy()
    lanes = np.array([tids[r] for r in res], dtype=np.int64)
    t0, t1 = lane_ticks(lanes, tl["start"].to_numpy(np.float64), tl["end"].to_numpy(np.float64))
    cols = [tl[c].to_numpy() for c in ("seq", "token", "layer", "expert", "bytes")]
    served = tl["requests"].to_numpy() if "requests" in tl.columns else None
    tick = float(TICKS_PER_US)
    for i in range(len(tl)):
        seq, tok, layer, expert, nbytes = (col[i] for col in cols)
        args = {
            "seq": int(seq),
            "token": int(tok),
            "layer": int(layer),
            "expert": int(expert),
            "bytes": int(nbytes),
        }
        if served is not None:
            args["requests"] = str(served[i])
        events.append(
            {
                "name": kind[i] if expert < 0 else f"{kind[i]} L{layer}E{expert}",
                "cat": kind[i],
                "ph": "X",
                "pid": 1,
                "tid": int(lanes[i]),
                "ts": int(t0[i]) / tick,
                "dur": int(t1[i] - t0[i]) / tick,
                "args": args,
            }
        )
    if isinstance(occupancy, pd.DataFrame):
        for t, slots in occupancy.itertuples(index=False):
            events.append(
                {
                    "name": "gpu expert slots",
                    "ph": "C",
                    "pid": 1,
                    "ts": int(np.rint(float(t) * 1e6 * TICKS_PER_US)) / tick,
                    "args": {"slots": int(slots)},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata}


def one_row_table(path: str | os.PathLike[str], row_id: str) -> Path:
    """A validation table file at ``path`` holding only row ``row_id`` of the bundled table
    (``validate --table``: a subset whose ``--markdown`` is the whole of its table)."""
    from daopsim.simulator.validation import table_files

    blocks = [b for f in table_files() for b in f.read_text(encoding="utf-8").split("[[row]]")[1:]]
    block = next(b for b in blocks if f'id = "{row_id}"' in b)
    out = Path(path)
    out.write_text("[[row]]" + block, encoding="utf-8")
    return out


def roomy(profile: str | HardwareProfile, memory_gb: float = 256.0) -> HardwareProfile:
    """A profile with ``memory_gb`` of device memory: a unified-memory machine (whose device
    memory also bounds the host's copies) on which a bf16 test model fits, for tests of its
    timing rather than its capacity."""
    from daopsim.simulator.hardware import load_profile

    hw = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    return dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, memory_gb=memory_gb))


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes. Linux's ``VmHWM`` belongs to the
    process image, where ``ru_maxrss`` keeps the peak of the parent a child was forked from
    (so a benchmark child of a large test session would report the session's peak)."""
    import resource

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
