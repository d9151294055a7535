"""daop: DAOP as its public code runs it (Zhang, Aggarwal, Mitra, DATE 2025, arXiv 2501.10375).

The rules follow the code, ecolab-nus/DAOP at commit 08fef33 (facts and sources in
docs/references.md#daop); docs/daop.md has the algorithm, every option and where code and
paper differ. In short:

* Load: per-layer quota ``floor(B/L)`` of the most popular experts, the rest by global rank
  (decode-time calibration counts).
* Prefill of each prompt, per layer: sequence-specific swaps of hot CPU-resident experts with
  cold GPU-resident ones (``count(hot) > swap_threshold x count(cold)``, strict), which persist
  across prompts; then each expert not on the GPU runs on the CPU when
  ``count x T_cpu < T_load`` and through a temporary GPU copy otherwise.
* Decode: layers below ``first_predict_layer`` route exactly and run CPU-resident experts
  synchronously; from there on the routing used is the one predicted one layer early (layer
  l+1's router on layer l's router input), whose CPU-resident experts were pre-calculated on a
  CPU worker pool while the GPU worked; graceful degradation keeps at most k-1 CPU experts per
  predicted layer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any, Final

import numpy as np

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import Action, Plan, Policy, ResourceSpec, SetupContext, Slot, View
from daopsim.policies.options import Param
from daopsim.policies.placement import quota_then_global
from daopsim.policies.registry import register
from daopsim.simulator.errors import UserError

_INF = float("inf")

GPU: Final = Action.GPU
FETCH: Final = Action.FETCH
TEMP: Final = Action.TEMP
CPU: Final = Action.CPU
PRE: Final = Action.PRECOMPUTED


#: What DAOP decided at layer l-1 for layer l of the current token (a tuple: cheaper to make
#: than an object): the route used (after degradation), the plain top-k prediction (before
#: degradation), the CPU-resident experts submitted for pre-calculation (in route order; k is
#: small, so a list's ``in`` costs no more than a set's), the route as a list, the residency
#: snapshot it was made under (``DAOPPolicy._memo_residency``, compared by identity), layer l's
#: actions for it (what ``decode_layer`` would build from that residency; None with
#: ``exact_fallback``) and the pre-calculation items of layer l-1's plan.
_Prediction = tuple[
    np.ndarray,
    np.ndarray,
    list[int],
    list[int],
    bytes,
    dict[int, Action] | None,
    list[tuple[int, int]],
]


def swap_pairs(
    counts: np.ndarray,
    on_gpu: np.ndarray,
    swap_num: int,
    threshold: float,
    n_tokens: int,
    candidates: str = "code",
) -> list[tuple[int, int]]:
    """DAOP's prefill swaps for one layer: (hot CPU expert, cold GPU expert) pairs to exchange.

    ``candidates="code"`` builds both lists as DAOP's code does, over all E experts with a
    masked score: hot ranks ``count if on CPU else 0`` (highest first), cold ranks
    ``count if on GPU else count x n_tokens`` (lowest first); ties go to the lower expert id.
    A pair is *ineligible*, and skipped (later pairs are still tried), when its hot candidate is
    not CPU-resident or its cold candidate is not GPU-resident: this happens when a layer has
    fewer than ``swap_num`` experts on one side, or when a CPU-resident expert no prompt token
    chose (masked cold score 0) ranks among the coldest. ``candidates="filtered"`` keeps only
    CPU-resident experts in the hot list and GPU-resident ones in the cold list (the paper's
    reading). An eligible pair swaps when ``count(hot) > threshold x count(cold)``.
    """
    n_exp = counts.shape[0]
    ids = np.arange(n_exp)
    counts = counts.astype(np.int64)
    if candidates == "filtered":
        cpu_ids, gpu_ids = ids[~on_gpu], ids[on_gpu]
        hot = cpu_ids[np.lexsort((cpu_ids, -counts[cpu_ids]))][:swap_num]
        cold = gpu_ids[np.lexsort((gpu_ids, counts[gpu_ids]))][:swap_num]
    else:
        hot_score = np.where(on_gpu, 0, counts)
        cold_score = np.where(on_gpu, counts, counts * n_tokens)
        hot = np.lexsort((ids, -hot_score))[:swap_num]
        cold = np.lexsort((ids, cold_score))[:swap_num]
    pairs = []
    for h, c in zip(hot.tolist(), cold.tolist(), strict=False):
        if on_gpu[h] or not on_gpu[c]:
            continue  # ineligible pair
        if counts[h] > threshold * counts[c]:
            pairs.append((h, c))
    return pairs


def degraded_expert(gpu_ids: list[int], probs: np.ndarray) -> int:
    """Graceful degradation's substitute: the GPU-resident expert of ``gpu_ids`` with the
    highest router probability (NaN as 0, +-infinity as the largest finite float, the first id
    on ties: np.argmax of np.nan_to_num over those entries)."""
    values: list[float] = np.asarray(probs, dtype=np.float64)[gpu_ids].tolist()
    big = sys.float_info.max
    best = -1
    top = 0.0
    for e, p in zip(gpu_ids, values, strict=True):
        v = 0.0 if p != p else (big if p == _INF else (-big if p == -_INF else p))
        if best < 0 or v > top:
            best, top = e, v
    return best


@mypyc_attr(allow_interpreted_subclasses=True)
class DAOPPolicy(Policy):
    """Data-aware placement with prefill swaps, one-layer-early prediction and CPU pre-calc."""

    name = "daop"
    summary = "DAOP: prefill swaps, predicted routing with CPU pre-calculation, degradation"
    source = "DAOP (arXiv 2501.10375), code github.com/ecolab-nus/DAOP"
    # DAOP runs HF transformers models in PyTorch eager mode
    runtime_profile = "hf-eager"
    needs_calibration = True
    params = {
        "swap_num": Param(
            int,
            -1,
            "hot/cold pairs considered per layer at prefill (-1: half the experts, E/2)",
            minimum=-1,
        ),
        "swap_threshold": Param(
            float,
            1.05,
            "swap when count(hot) > swap_threshold x count(cold) (SwapInOut)",
            minimum=0,
        ),
        "swap_candidates": Param(
            str,
            "code",
            "how hot/cold lists are built: 'code' (masked scores over all experts, as the "
            "code; ineligible pairs skipped) or 'filtered' (CPU-resident hot, GPU-resident cold)",
            choices=("code", "filtered"),
        ),
        "first_predict_layer": Param(
            int,
            5,
            "decode layers below it route exactly; from it on the prediction is used (>= 1: "
            "layer 0 has no earlier layer to predict it)",
            minimum=1,
        ),
        "cpu_workers": Param(
            int, 2, "CPU worker threads for pre-calculation (and prefill)", minimum=1
        ),
        "graceful_degradation": Param(
            bool,
            True,
            "when all k predicted experts are on the CPU, swap the lowest for the "
            "best GPU-resident expert",
        ),
        "last_layer_quirk": Param(
            bool,
            False,
            "reproduce the code's discarded last-layer CPU result (route keeps "
            "only the GPU experts; the pre-calculation is wasted)",
        ),
        "persist_placement": Param(
            bool,
            True,
            "prefill swaps persist across prompts (off: restore the initial "
            "placement at each sequence start, paying its copies)",
        ),
        "exact_fallback": Param(
            bool,
            False,
            "beyond the paper: also compute the true experts a prediction missed "
            "(routing stays exact)",
        ),
        "constants": Param(
            str,
            "measured",
            "what the prefill rule (count x T_cpu < T_load) believes: 'measured' = the "
            "profile's measured constants for this model (DAOP's own table on its hosts), "
            "else the cost model; 'model' = the cost model's one-token CPU time and pageable copy",
            choices=("measured", "model"),
        ),
        "t_cpu_ms": Param(
            float,
            -1.0,
            "T_cpu of the prefill rule in ms (-1: from 'constants')",
            minimum=0.0,
            unset=-1.0,
        ),
        "t_load_ms": Param(
            float,
            -1.0,
            "T_load of the prefill rule in ms (-1: from 'constants')",
            minimum=0.0,
            unset=-1.0,
        ),
    }

    prefill_note = "prefill swaps and CPU-or-copy rule"

    def uses_lookahead(self) -> bool:
        """The decode prediction reads the one-layer-early view."""
        return True

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o = self.options
        self.cpu_workers = int(o["cpu_workers"])
        self.swap_num_opt = int(o["swap_num"])
        self.threshold = float(o["swap_threshold"])
        self.candidates = str(o["swap_candidates"])
        self.first_predict = int(o["first_predict_layer"])
        self.degrade = bool(o["graceful_degradation"])
        self.quirk = bool(o["last_layer_quirk"])
        self.persist = bool(o["persist_placement"])
        self.exact_fallback = bool(o["exact_fallback"])
        #: predictions for layers of the current decode token, by layer
        self.pred: dict[int, _Prediction] = {}
        #: predictions made without degradation, by (layer, dtype code, raw top-k), valid
        #: for the residency ``_memo_residency`` (the mask's bytes at the current decode_layer
        #: call) they were made under: see _predict and decode_layer
        self._raw_predictions: dict[tuple[Any, ...], _Prediction] = {}
        #: the GPU experts of layer+1 for a top-k that degrades (same keys and validity)
        self._gpu_experts: dict[tuple[Any, ...], list[int]] = {}
        #: degraded predictions by (the same key, the GPU expert chosen)
        self._degraded_predictions: dict[tuple[Any, ...], _Prediction] = {}
        self._memo_residency = b""
        #: prefill swaps made so far: (layer, hot, cold)
        self.swaps: list[tuple[int, int, int]] = []
        self._restore = False

    def resources(self) -> ResourceSpec:
        """Pageable host memory (the code loads with load_state_dict), write-back of a prefill
        swap's cold expert, one temporary buffer, the ``cpu_workers`` option's pool."""
        # A prefill swap moves the cold expert back with ``experts[cold].to("cpu")`` before the
        # hot one goes up with ``.to(dev)``, both on the current stream (ecolab-nus/DAOP commit
        # 08fef33, model/modeling_daop.py L404-405): a real device-to-host copy, so write-back.
        return ResourceSpec(
            host_memory="pageable", writeback=True, temp_buffers=1, cpu_workers=self.cpu_workers
        )

    # -- load ----------------------------------------------------------------------------------
    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """Per-layer quota then global fill, by decode-time calibration popularity."""
        if ctx.calibration is None:
            raise UserError("policy 'daop' needs calibration counts")
        m = ctx.model
        self.n_layers, self.n_experts, self.k = m.moe_layers, m.experts, m.top_k
        self.swap_num = self.n_experts // 2 if self.swap_num_opt == -1 else self.swap_num_opt
        # Decision inputs, not execution times: the engine times the copy from the link model
        # and the CPU expert from the batched cost curve, whatever DAOP believes here.
        o, costs = self.options, ctx.costs
        t_cpu, t_load = costs.decision_times(o["constants"] == "measured")
        self.t_cpu = o["t_cpu_ms"] * 1e-3 if o["t_cpu_ms"] >= 0 else t_cpu
        self.t_load = o["t_load_ms"] * 1e-3 if o["t_load_ms"] >= 0 else t_load
        # a memo from an earlier set-up (another model's mask may have the same bytes)
        self._forget_predictions(b"")
        slots = quota_then_global(ctx.calibration, ctx.budget)
        self.initial = np.zeros((self.n_layers, self.n_experts), dtype=bool)
        for layer, e in slots:
            self.initial[layer, e] = True
        return slots

    def on_sequence_start(self, seq_id: int, n_prefill: int) -> None:
        """Without persistence the next prefill restores the initial placement first."""
        self.pred.clear()
        self._restore = not self.persist

    # -- prefill ---------------------------------------------------------------------------------
    def cpu_beats_copy(self, count: int) -> bool:
        """DAOP's per-expert prefill rule: the CPU when count x T_cpu < T_load (strict)."""
        return count * self.t_cpu < self.t_load

    def prefill_layer(self, view: View) -> Plan:
        """Swaps (hot CPU expert in, cold GPU expert out), then CPU or temporary copy."""
        layer = view.layer
        counts = np.asarray(view.counts)
        current = view.resident[layer].copy()
        target = self.initial[layer].copy() if self._restore else current.copy()
        for hot, cold in swap_pairs(
            counts, target, self.swap_num, self.threshold, view.n_tokens, self.candidates
        ):
            target[hot], target[cold] = True, False
            self.swaps.append((layer, hot, cold))
        if layer == self.n_layers - 1:
            self._restore = False
        plan = Plan(actions={}, cpu_serial=True)
        # the cold expert is copied back to the host (.to("cpu")); its slot frees when that ends
        plan.evict = [(layer, int(e)) for e in np.flatnonzero(current & ~target)]
        routed = view.experts.tolist()
        routed_set = set(routed)
        for e in np.flatnonzero(target & ~current).tolist():
            if e not in routed_set:  # restoring a placement: copy in the background
                plan.prefetch.append((layer, e, None))
        actions = plan.actions
        assert actions is not None
        for e in routed:
            if target[e]:
                actions[e] = GPU if current[e] else FETCH
            elif self.cpu_beats_copy(int(counts[e])):
                actions[e] = CPU
            else:
                actions[e] = TEMP
        return plan

    # -- decode ----------------------------------------------------------------------------------
    def _forget_predictions(self, residency: bytes) -> None:
        """Drop the memoised predictions: from now on they are made under ``residency``."""
        self._raw_predictions.clear()
        self._gpu_experts.clear()
        self._degraded_predictions.clear()
        self._memo_residency = residency

    def _predict(self, view: View) -> _Prediction | None:
        """The prediction for layer+1 from the one-layer-early router view."""
        nl = view.layer + 1
        ahead, ahead_probs = view.next_experts, view.next_probs
        if ahead is None or ahead_probs is None:
            return None
        raw_l: list[int] = ahead[: self.k].tolist()
        # A prediction depends on the layer, the top-k, the residency and, when degraded,
        # on which GPU expert the probabilities pick: memoised for the residency of this
        # decode_layer call (``_memo_residency``). The dtype's code is in the key because tolist()
        # of another dtype gives other Python types with equal hashes (1.0 == 1).
        key = (nl, ahead.dtype.char, *raw_l)
        pred = self._raw_predictions.get(key)
        if pred is not None:
            return pred
        res_at = view.resident.item  # k item reads cost less than a row view and a list
        gpu_ids = self._gpu_experts.get(key)  # the GPU experts, when this top-k degrades
        if gpu_ids is None:
            if not raw_l or min(raw_l) < 0:
                return None
            cpu = [e for e in raw_l if not res_at(nl, e)]
            on_gpu: list[bool] = view.resident[nl].tolist()
            if not (len(cpu) == len(raw_l) and self.degrade and True in on_gpu):
                # the route is the raw prediction (read-only to the plans that consume it)
                raw = np.asarray(raw_l, dtype=np.int64)
                pred = self._raw_predictions[key] = self._prediction(
                    nl, raw, raw, cpu, raw_l, res_at
                )
                return pred
            gpu_ids = self._gpu_experts[key] = [e for e, r in enumerate(on_gpu) if r]
        # graceful degradation: no predicted expert on the GPU
        best = degraded_expert(gpu_ids, ahead_probs)
        dkey = (*key, best)
        pred = self._degraded_predictions.get(dkey)
        if pred is None:
            route_l = [*raw_l[:-1], best]
            cpu = [e for e in route_l if not res_at(nl, e)]
            raw = np.asarray(raw_l, dtype=np.int64)
            route = np.asarray(route_l, dtype=np.int64)
            pred = self._degraded_predictions[dkey] = self._prediction(
                nl, route, raw, cpu, route_l, res_at
            )
        return pred

    def _prediction(
        self,
        nl: int,
        route: np.ndarray,
        raw: np.ndarray,
        cpu: list[int],
        route_l: list[int],
        res_at: Callable[[int, int], Any],
    ) -> _Prediction:
        """A memoised prediction for layer ``nl``: with layer nl's route and actions as
        decode_layer builds them under the current residency (every entry is resident or in
        ``cpu``, pre-calculated, so none is dropped) and layer nl-1's pre-calculation items.
        ``cpu`` is in route order: the pre-calculations are issued in that order. Plans share
        these objects (the engine never changes a plan)."""
        actions: dict[int, Action] | None = None
        if not self.exact_fallback:
            route, actions = self._route_actions(nl, route, route_l, cpu, res_at)
        items = [(nl, e) for e in cpu]
        return route, raw, cpu, route_l, self._memo_residency, actions, items

    @staticmethod
    def _route_actions(
        layer: int,
        route: np.ndarray,
        route_l: list[int],
        ready: list[int],
        res_at: Callable[[int, int], Any],
    ) -> tuple[np.ndarray, dict[int, Action]]:
        """A predicted route's actions at its layer: resident entries on the GPU, entries
        pre-calculated (in ``ready``) as PRECOMPUTED; an entry that is neither is dropped from
        the route (returned with them; the prediction's own array when nothing is dropped)."""
        actions: dict[int, Action] = {}
        for e in route_l:
            if res_at(layer, e):
                actions[e] = GPU
            elif e in ready:
                actions[e] = PRE
            else:
                keep = [i for i, x in enumerate(route_l) if res_at(layer, x) or x in ready]
                route = route[keep]
                actions.clear()
                for x in route.tolist():
                    actions[x] = GPU if res_at(layer, x) else PRE
                break
        return route, actions

    def decode_layer(self, view: View) -> Plan:
        """Exact routing below first_predict_layer; the layer-early prediction from there on."""
        layer = view.layer
        preds = self.pred
        if layer == 0:
            preds.clear()
        # the memoised predictions hold for one residency: a new one (a prefill's swaps)
        # forgets them (a fresh snapshot object, so no earlier prediction matches it)
        resident = view.resident
        snap = resident.tobytes()
        if snap != self._memo_residency:
            self._forget_predictions(snap)
        res_at = resident.item  # per-expert item reads: no row view, no list
        route: np.ndarray | None = None
        raw: np.ndarray | None = None
        actions: dict[int, Action] | None
        pred = preds.pop(layer, None) if layer >= self.first_predict else None
        if pred is None:
            actions = {}
            for e in view.experts.tolist():
                actions[e] = GPU if res_at(layer, e) else CPU
        else:
            route, raw, ready, route_l, made_under, actions, _ = pred
            last = self.quirk and layer == self.n_layers - 1
            if last:
                ready = []  # with the quirk the pre-calculated result is reset before use
            if self.exact_fallback:  # the trace's routing: no route of the plan's own
                route = raw = None
                actions = {}
                for e in view.experts.tolist():
                    actions[e] = GPU if res_at(layer, e) else (PRE if e in ready else CPU)
            elif actions is None or made_under is not self._memo_residency or last:
                # made under another residency: the actions are made again under this one
                route, actions = self._route_actions(layer, route, route_l, ready, res_at)
        precalc: list[tuple[int, int]] = []
        # prediction for layer+1, issued before this layer's experts run
        if self.first_predict - 1 <= layer <= self.n_layers - 2:
            nxt = self._predict(view)
            if nxt is not None:
                preds[layer + 1] = nxt
                precalc = nxt[6]
        # no victims, prefetches or evictions; serial and synchronous CPU work
        return Plan(
            actions=actions,
            route=route,
            raw_route=raw,
            precalc=precalc,
            cpu_serial=True,
            cpu_first=True,
        )


register(DAOPPolicy)
