"""moe-infinity: request-level activation matching, prefetch and activation-aware caching.

Source: Xue et al., "MoE-Infinity: Offloading-Efficient MoE Model Serving" (arXiv 2401.14361
v2; v3 retitled "Efficient MoE Inference on Personal Machines with Sparsity-Aware Expert
Cache"), and its code, github.com/EfficientMoE/MoE-Infinity (formerly TorchMoE) at commit
87eacf7 ("Release dev to main", the first release whose models call the predictor on every
forward). Facts and file names: docs/references.md#moe-infinity. The rules:

* **Expert Activation Matrix (EAM).** Per request, a ``[layers, experts]`` count of how often
  each expert was selected, prompt tokens included (``ExpertTracer.update_entry``,
  memory/expert_tracer.py). It starts at zero with each sequence.
* **EAM collection (EAMC).** The code loads a fixed collection of request EAMs recorded offline
  (``load_trace``; ``finish_entry``, which would add served requests, is never called) of at
  most ``trace_capacity`` = 1000 entries (utils/config.py). Here: the calibration sequences'
  EAMs (``SetupContext.calibration_sequences``), the first ``eamc_capacity`` of them.
* **Matching.** At each layer l the current EAM is matched to the collection by cosine
  similarity per layer averaged over layers, and the nearest entry wins
  (``find_most_similar``). The code overwrites the collection's layers ``<= l`` with a
  constant before comparing, so only layers ``> l`` tell entries apart: the match compares
  what this request did at the coming layers in its earlier tokens with each entry's counts
  there. Those rows do not change within a token, so this module matches once per token (at
  layer 0, for every layer) with the same result, keeping the dot products of the request's
  rows with the normalised collection rows up to date instead of recomputing them. Ties go to
  the first entry (``argmin``). During a prompt's pass the coming rows are still empty, so
  every entry ties and the first is used, as in the code.
* **Prefetch.** The matched entry's counts of the layers after l, weighted by layer proximity
  ``1 - (x - l) / (L + 1)`` (``ExpertPredictor.layer_decay_func``), in descending order, ties
  by layer then expert (``ExpertPrefetcher.prefetch_experts``' stable sort). Experts the entry
  never selected are left out (the code queues them last with a 1e-8 score) and so is the
  current layer (its experts are already being served). ``prefetch_depth`` limits the layers
  ahead (0: every later layer, as the code). The code's prefetch thread takes the head of this
  queue whenever the link is idle and each layer re-sorts the queue; modelled as: at each
  decision, issue prefetches in that order while the link would be idle before the next
  decision could come: one layer's non-expert part and k GPU experts after this layer can run
  (``next_decision_gap``), which is after its own misses have landed (the code's one copy
  thread per GPU, ``ArcherTaskPool::GPUThreadFunc``, takes the next queued prefetch as soon as
  they are done, so the next layer's misses wait for that copy; a layer that waits for an
  earlier prefetch still in flight comes later still, not counted). When the link is idle and
  when each copy would land is the engine's (``View.copy_end``: its own lane, with every copy
  already queued on it, other GPUs' on a shared uplink included).
  Copies are pinned (the runtime's host caching allocator).
* **Caching.** One cache over all ``(layer, expert)`` slots (the code's GPU expert cache has no
  per-layer quota). Activation-aware replacement (paper v2, "expert caching"): an expert's
  priority is its activation count in the current request times ``1 - l / L`` (shallow layers
  first: their prefetch has the least lead time); the lowest goes, ties to the deeper layer,
  then the lower expert id. (The paper's ratio count/tokens ranks the same way within a token.)
  A victim is never an expert this layer uses nor one whose copy is still in flight
  (``View.ready``, or a prefetch of this decision),
  and a prefetch never evicts an expert the matched entry predicts for the coming layers (the
  code protects its prefetch candidates with ``replace_cache_candidates``). A prefetch looks at
  most ``KEEP_SCAN`` (8) predicted experts past the cache's low end for a victim (a bound on
  the work per decision, not from the source); with none, prefetching stops for this
  decision. A miss with no evictable slot runs through a temporary buffer.

Known differences from the released code: its C++ eviction for prefetches
(``RemoveCachedSparseNode``, core/prefetch/task_scheduler.cpp) ranks by in-cache visit count,
not by the paper's priority; it issues tasks per tensor on several threads. Prefill uses the
same rules with the prompt's per-expert token counts, and so does a batched step (the code keeps
one EAM per request; here the EAM restarts when a request starts, so under batched serving it
counts the whole batch since the latest admission).

Runtime: ``moe-infinity`` (hardware_profiles/runtimes/moe-infinity.toml), counted from the
release whose README gives the A5000 figures (cca059c to d617801): an HF eager model whose MoE
block syncs once for the routing, runs each routed expert through the C++ expert dispatcher
and adds its output in with boolean-mask indexing, five syncs per expert in all.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterable
from itertools import chain, islice
from typing import Any, Final

import numpy as np

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import ALL_GPU_PLAN, Action, Plan, Policy, SetupContext, Slot, View
from daopsim.policies.caching import global_initial
from daopsim.policies.options import Param
from daopsim.policies.registry import register
from daopsim.simulator.errors import UserError

GPU: Final = Action.GPU
FETCH: Final = Action.FETCH
TEMP: Final = Action.TEMP

_add, _and = np.add, np.logical_and

#: a prefetch looks this far past predicted experts at the cache's low end for a victim
KEEP_SCAN = 8

#: the predicted set of a search without one (``MoEInfinityPolicy._victim``)
_NOTHING: frozenset[int] = frozenset()

#: a prefetch queue (``MoEInfinityPolicy._queue``)
_Queue = tuple[list[tuple[int, int, int]], frozenset[int], list[int]]


@mypyc_attr(allow_interpreted_subclasses=True)
class MoEInfinityPolicy(Policy):
    """Request-level EAM matching drives prefetch; activation-aware priority drives eviction."""

    name = "moe-infinity"
    summary = (
        "MoE-Infinity: request EAM matched to a calibration EAMC (cosine), prefetch by matched "
        "counts x layer proximity, activation-aware global cache"
    )
    source = "MoE-Infinity (arXiv 2401.14361), code EfficientMoE/MoE-Infinity commit 87eacf7"
    needs_calibration = True
    #: HF eager model, experts through the C++ dispatcher (hardware_profiles/runtimes/)
    runtime_profile = "moe-infinity"
    params = {
        "eamc_capacity": Param(
            int, 1000, "EAMs kept in the collection (the code's trace_capacity, 1000)", minimum=1
        ),
        "prefetch": Param(bool, True, "prefetch the matched entry's experts of later layers"),
        "prefetch_depth": Param(
            int,
            0,
            "layers ahead whose predicted experts are prefetched (0: all, as the code)",
            minimum=0,
        ),
        "initial": Param(
            str,
            "first",
            "initial contents: 'first' experts of each layer (an even share), 'popular' = the "
            "budget's most selected slots by calibration counts, or 'empty'",
            choices=("first", "popular", "empty"),
        ),
    }

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o = self.options
        self.do_prefetch = bool(o["prefetch"])
        self.depth = int(o["prefetch_depth"])

    # -- load ----------------------------------------------------------------------------------
    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """Build the EAMC from the calibration sequences; place the initial contents."""
        eams = ctx.calibration_sequences
        if not eams:
            raise UserError(
                "policy 'moe-infinity' needs calibration sequences (its EAM collection); "
                "use held-out sequences, --calibration self or --calibration PATH"
            )
        m = ctx.model
        n_layers, n_exp = m.moe_layers, m.experts
        self.n_layers, self.n_exp = n_layers, n_exp
        eamc = np.stack(
            [np.asarray(a, dtype=np.float64) for a in eams[: self.options["eamc_capacity"]]]
        )
        if eamc.shape[1:] != (n_layers, n_exp):
            raise UserError(
                f"policy 'moe-infinity': calibration matrices are {eamc.shape[1:]}, "
                f"the model has {(n_layers, n_exp)}"
            )
        self.eamc = eamc
        norms = np.sqrt((eamc * eamc).sum(axis=2, keepdims=True))
        #: collection rows scaled to unit length (a zero row stays zero: cosine 0)
        self.eamc_unit = np.divide(eamc, norms, out=np.zeros_like(eamc), where=norms > 0)
        self.n_entries = eamc.shape[0]
        self.weight = [1.0 - layer / n_layers for layer in range(n_layers)]
        #: (entry, layer) -> the prefetch queue as (layer, expert, flat index), its flat
        #: indices as a set and as a list (``_queue``)
        self.queues: dict[int, _Queue] = {}  # by entry * layers + layer
        #: per top-k, each decode selection's flat offset layer * experts (``_match``)
        self.offsets: dict[int, np.ndarray] = {}
        #: how soon after a layer runs the next decision can come: one layer's non-expert part
        #: and k GPU experts (the prefetch horizon, see the module doc)
        self.next_decision_gap = ctx.costs.nonexpert_layer_s(
            1, 0
        ) + m.top_k * ctx.costs.gpu_expert_s(1)
        #: the landing times of the current decision's view (View.ready)
        self.ready: np.ndarray = np.zeros((n_layers, n_exp))
        #: flat indices this decision prefetched: in flight, and not in ``ready`` yet
        self.issued: set[int] = set()
        self.capacity = int(ctx.budget)
        #: whether each expert is cached, by flat index layer * experts + expert (the prefetch
        #: queue is scanned through it at C speed)
        self.cached = [False] * (n_layers * n_exp)
        #: each flat index's (layer, expert) slot, made once (victims and in-flight keys)
        self.slots: list[Slot] = [(x, e) for x in range(n_layers) for e in range(n_exp)]
        slots = global_initial(ctx, str(self.options["initial"]), self.capacity)
        for layer, e in slots:
            self.cached[layer * n_exp + e] = True
        self.size = len(slots)
        self._reset_request()
        return slots

    def _reset_request(self) -> None:
        """A new request: an empty EAM, and every cached expert back to priority 0."""
        n_layers, n_exp = self.n_layers, self.n_exp
        #: this request's activation count of each expert, by flat index
        self.activations = [0] * (n_layers * n_exp)
        self.eam = np.zeros((n_layers, n_exp))
        self.eam_dot = np.zeros((self.n_entries, n_layers))
        self.uncounted: list[list[int]] = []  # this step's decode selections, by layer
        self.best = [0] * n_layers
        w = self.weight
        cached = self.cached
        #: the eviction order: one entry (priority, layer weight, expert, layer, flat index)
        #: per cached expert, sorted; an entry's priority is the one at its insertion (or a
        #: later requeue) and is brought up to date lazily (``_victim``)
        self.order = sorted(
            (0.0, w[layer], e, layer, layer * n_exp + e)
            for layer in range(n_layers)
            for e in range(n_exp)
            if cached[layer * n_exp + e]
        )

    def on_sequence_start(self, seq_id: int, n_prefill: int) -> None:
        """Each request has its own EAM."""
        self._reset_request()

    # -- matching --------------------------------------------------------------------------------
    def _match(self) -> None:
        """The nearest collection entry for every layer of this step (see the module doc)."""
        uncounted = self.uncounted
        if uncounted:
            if len(uncounted) == self.n_layers:
                k = len(uncounted[0])
                if all(len(p) == k for p in uncounted):
                    # the same element updates and sums as indexing [layers, experts] with
                    # (layer, expert) pairs, through the flat index layer * experts + expert
                    off = self.offsets.get(k)
                    if off is None:
                        off = self.offsets[k] = np.repeat(
                            np.arange(self.n_layers, dtype=np.int64) * self.n_exp, k
                        )
                    idx = np.fromiter(chain.from_iterable(uncounted), np.int64, off.size) + off
                    self.eam.reshape(-1)[idx] += 1.0
                    gathered = self.eamc_unit.reshape(self.n_entries, -1)[:, idx]
                    # ``sum(axis=2)``: the same ufunc reduction, without its Python wrapper
                    self.eam_dot += _add.reduce(
                        gathered.reshape(self.n_entries, self.n_layers, k), axis=2
                    )
                    uncounted = []
            for layer, exps in enumerate(uncounted):
                for e in exps:
                    self.eam[layer, e] += 1.0
                    self.eam_dot[:, layer] += self.eamc_unit[:, layer, e]
            self.uncounted = []
        if self.n_entries == 1:
            return
        # the ufuncs that ``sum``, ``all``, ``cumsum`` and ``np.argmax`` call, called directly
        # (the same reductions without the Python wrappers)
        cur = self.eam
        norm = np.sqrt(_add.reduce(cur * cur, axis=1))
        if _and.reduce(norm):  # no empty row to skip: the same quotients, without the mask
            cos = self.eam_dot / norm
        else:
            cos = np.divide(self.eam_dot, norm, out=np.zeros_like(self.eam_dot), where=norm > 0)
        # score of entry c at layer l: sum of its cosines over layers > l (accumulated from
        # the last layer; the argmax of each column, read back in layer order)
        best = _add.accumulate(cos[:, :0:-1], axis=1).argmax(axis=0).tolist()
        best.reverse()
        best.append(0)
        self.best = best

    def _queue(self, entry: int, layer: int) -> _Queue:
        """The entry's experts of the layers after ``layer`` in prefetch order, as (layer,
        expert, flat index layer * experts + expert), the flat indices as a set, and as a list
        in that order."""
        key = entry * self.n_layers + layer
        got = self.queues.get(key)
        if got is None:
            n_layers = self.n_layers
            last = n_layers - 1 if self.depth == 0 else min(n_layers - 1, layer + self.depth)
            items = []
            counts = self.eamc[entry]
            for x in range(layer + 1, last + 1):
                decay = 1.0 - (x - layer) / (n_layers + 1)
                for e in np.flatnonzero(counts[x]).tolist():
                    items.append((-(counts[x, e] * decay), x, e))
            items.sort()
            n_exp = self.n_exp
            queue = [(x, e, x * n_exp + e) for _, x, e in items]
            flat = [i for _, _, i in queue]
            got = self.queues[key] = (queue, frozenset(flat), flat)
        return got

    # -- cache -----------------------------------------------------------------------------------
    def _victim(
        self,
        now: float,
        layer: int,
        protect: set[int] | list[int],
        keep: frozenset[int] | None,
    ) -> Slot | None:
        """The lowest-priority evictable expert, never one in ``keep`` (flat indices; None if
        none); its entry leaves ``order``.

        ``order`` is scanned from its low end as a lazy min-heap of the same entries would pop
        them: an entry whose priority is out of date (a count only grows within a request) is
        moved to its current one and the scan goes on from the same place, an entry skipped
        (in use, in flight, or predicted) stays where it is. The entries are the heap's, so the
        victim and the number of entries skipped before it are too (ties included:
        tests/test_moe_infinity.py checks this against the heap)."""
        order, activations, cached = self.order, self.activations, self.cached
        issued = self.issued
        ready_at = self.ready.item  # a Python float per read, no numpy scalar
        if keep is None:
            keep = _NOTHING
        # ``j``: where the scan is, and as every entry before it was skipped (a change to
        # ``order`` moves or drops an entry without passing it), the number skipped so far
        j = 0
        while True:
            # a for loop over the entries from ``j`` (cheaper than indexing ``order[j]``); a
            # change to ``order`` ends it and the scan goes on from the same place
            for key, w, e, vl, i in order if j == 0 else islice(order, j, None):
                if not cached[i]:
                    del order[j]  # evicted since (a heap would drop it when popped)
                    break
                now_key = activations[i] * w
                if now_key != key:
                    # priorities only grow within a request: requeue at the current one
                    del order[j]
                    insort(order, (now_key, w, e, vl, i))
                    break
                if (
                    (vl == layer and e in protect)
                    # never evict an expert being copied: by the engine's account, or
                    # prefetched by this decision
                    or i in issued
                    or ready_at(vl, e) > now
                ):
                    j += 1
                    continue
                if i in keep:
                    j += 1
                    if j > KEEP_SCAN:
                        return None  # the cache's low end is all predicted: like for like
                    continue
                del order[j]
                return self.slots[i]
            else:
                return None

    def _make_room(
        self,
        now: float,
        layer: int,
        protect: set[int] | list[int],
        keep: frozenset[int] | None,
    ) -> tuple[bool, Slot | None]:
        """A slot for one more cached expert: (True, None) while the cache has room, (True,
        victim) once :meth:`_victim` found one (it leaves the cache), (False, None) when none
        may go."""
        if self.size < self.capacity:
            self.size += 1
            return True, None
        victim = self._victim(now, layer, protect, keep)
        if victim is None:
            return False, None
        self.cached[victim[0] * self.n_exp + victim[1]] = False
        return True, victim

    def _cache(self, layer: int, expert: int) -> None:
        """``expert`` of ``layer`` enters the cache at its current priority."""
        i = layer * self.n_exp + expert
        self.cached[i] = True
        w = self.weight[layer]
        insort(self.order, (self.activations[i] * w, w, expert, layer, i))

    def _count(self, view: View, experts: list[int]) -> None:
        """This step's selections of the layer into the request's EAM (a decode token's are
        added to the match's rows at the next token's layer 0, ``_match``)."""
        layer = view.layer
        counts = view.counts
        activations = self.activations
        base = layer * self.n_exp
        if counts is None:
            self.uncounted.append(experts)
            for e in experts:
                activations[base + e] += 1
        else:
            c = np.asarray(counts, dtype=np.float64)
            self.eam[layer] += c
            self.eam_dot[:, layer] += self.eamc_unit[:, layer, :] @ c
            for e in experts:
                activations[base + e] += int(counts[e])

    def decode_layer(self, view: View) -> Plan:
        """Count the step into the EAM, serve the layer from the cache, then prefetch."""
        layer = view.layer
        now = view.now
        ready = view.ready
        assert ready is not None  # the engine always gives it
        self.ready = ready
        if self.issued:
            self.issued = set()
        if layer == 0:
            self._match()
        experts: list[int] = view.experts.tolist()
        self._count(view, experts)
        cached = self.cached
        base = layer * self.n_exp
        prefetch = self.do_prefetch and layer < self.n_layers - 1
        misses = [e for e in experts if not cached[base + e]]
        if not misses:
            if prefetch:
                # the plan is made when a prefetch is issued: until then every routed expert
                # runs on the GPU, which the shared all-GPU plan says as well
                plan = self._prefetch(None, view, experts, experts, 0)
                if plan is not None:
                    return plan
            return ALL_GPU_PLAN
        # the hits first, in routing order
        actions: dict[int, Action] = {e: GPU for e in experts if cached[base + e]}
        plan = Plan(actions=actions)
        temp = False
        for e in misses:
            room, victim = self._make_room(now, layer, experts, None)
            if not room:
                actions[e] = TEMP
                temp = True
                continue
            if victim is not None:
                plan.victims[e] = victim
            actions[e] = FETCH
            self._cache(layer, e)
        # a temporary copy may wait for its buffer, so when the layer runs is not known: no
        # prefetch
        if prefetch and not temp:
            self._prefetch(plan, view, experts, experts, len(misses))
        return plan

    def _prefetch(
        self,
        plan: Plan | None,
        view: View,
        protect: set[int] | list[int],
        experts: list[int],
        n_demand: int,
    ) -> Plan | None:
        """Issue prefetches into ``plan`` (None: a plan of ``experts`` on the GPU, made at the
        first prefetch) until the link is busy past the next decision, one gap after the layer
        runs (when its ``n_demand`` misses land, as the engine's lane would serve them; now
        without misses); returns the plan, None if it was None and nothing was issued."""
        now, layer = view.now, view.layer
        landed = view.copy_end(n_demand)  # the misses' copies (none: when the lane is free)
        runs_at = landed if n_demand else now
        horizon = (runs_at if runs_at > now else now) + self.next_decision_gap
        if landed >= horizon:
            return plan
        queue, keep, flat = self._queue(self.best[layer], layer)
        cached, issued = self.cached, self.issued
        n_copies = n_demand
        # the queue's entries not cached, in order; each is read from ``cached`` when the scan
        # reaches it (after the changes of the prefetches before it). A typed loop over the
        # flat indices: compiled, a test is a list read (itertools.compress over
        # map(cached.__getitem__) made two calls through Python per entry)
        for k in range(len(flat)):
            i = flat[k]
            if cached[i]:
                continue
            x, e, _ = queue[k]
            room, victim = self._make_room(now, layer, protect, keep)
            if not room:
                break
            self._cache(x, e)
            issued.add(i)
            n_copies += 1
            if plan is None:
                plan = Plan(actions=dict.fromkeys(experts, GPU))
            plan.prefetch.append((x, e, victim))
            if view.copy_end(n_copies) >= horizon:
                break
        return plan


register(MoEInfinityPolicy)
