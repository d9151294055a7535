"""hybrimoe: HybriMoE's hybrid CPU/GPU scheduling, MRS cache and impact-driven prefetch.

Source: Zhong, Sun, Liang, Wang, Huang, Li, "HybriMoE: Hybrid CPU-GPU Scheduling and Cache
Management for Efficient MoE Inference" (DAC 2025, arXiv 2504.05897), code PKU-SEC-Lab/HybriMoE
(HEAD 508a85b, ``ktransformers/operators/experts.py``: ``KExpertsCache.HSS``,
``KScoreAwareCache``; ``ktransformers/models/modeling_deepseek.py``: its construction); facts in
docs/references.md#hybrimoe. The paper's text was not reachable: the abstract, the README and
two public reading notes of sections IV-B to IV-D were (docs/references.md says which fact
comes from where). HybriMoE is built on kTransformers, so it runs on the ``ktransformers``
runtime profile.

- **Cache** (``cache = "mrs"``): one cache per layer of ``budget / L`` slots (the code's
  ``load_size`` per layer), filled with each layer's first experts at load (``init=True`` loads
  experts 0, 1, ... while the layer has free slots). Minus Recent Score: at every layer
  decision, the layer's router probabilities update ``S = alpha x s + (1 - alpha) x S`` for the
  ``top_p`` most probable experts and ``S = (1 - alpha) x S`` for the others; the victim is the
  layer's resident expert with the lowest ``S`` (ties: the least recently used, as the code's
  ``argmin`` over its insertion-ordered dict, where a hit re-inserts). ``alpha = 0.5`` and
  ``top_p = 2k`` are the code's (``KScoreAwareCache(num_layers, n_experts, 0.5, 2 * top_k)``).
  A prompt updates the scores with its mean probabilities (the code uses the first prompt
  token's). ``cache = "lru"``: least recently used instead (the MRS ablation).
- **Hybrid scheduling** (``schedule = "hybrid"``, the code's ``HSS``): the routed experts
  ordered as resident ones by load (tokens) descending, then non-resident ones by load
  descending; repeatedly the GPU side is offered the first of the list and the CPU side the
  last, and the one whose queue would finish earlier takes it. A GPU expert takes
  ``gpu(n)``; a non-resident one it takes must first be copied, so the GPU side waits until
  that copy lands (the copies issued so far plus this one); a CPU expert takes ``cpu(n)``.
  With ``constants = "model"`` (default) those are the cost model's own times
  (``CostModel.decision_split_times``: ``gpu_expert_s(n)``, and ``cpu_expert_s(n)`` plus the
  activations' round trip) and the copies land when the engine's lane rule says, from an idle
  lane (``View.copy_lands(..., idle=True)``, each copy ``View.copy_s``): the paper profiles
  CPU, GPU and transfer times at warm-up, and its schedule does not watch the copy queue.
  ``constants = "code"``: the released code's placeholders (GPU 0.5 per expert, CPU
  ``1 x tokens`` plus 0.79 for the first CPU expert, transfer 0.4179 per copy, one after
  another: relative units, no link, marked "need to be tested"). What runs is timed by the
  engine either way. A
  non-resident GPU expert is fetched into the cache (the MRS victim evicted) in decode, and in
  prefill into a free slot of its layer, else into a temporary buffer (the code's per-layer
  buffer); a batched serving step takes the decode rule with the batch's loads.
  ``schedule = "cpu"``: every miss on the CPU (kTransformers' rule, the scheduling ablation);
  ``"gpu"``: every miss fetched.
- **Impact-driven prefetching** (``prefetch``, default ``-1``: up to k experts per layer; 0
  off): at each decode layer, the experts the one-layer-early view predicts for layer ``l+1``
  (its router applied to layer ``l``'s input; HybriMoE reuses the gates of the next three
  layers, the trace records one) are scored by how much caching each would shorten layer
  ``l+1``'s simulated schedule (the same HSS); the highest positive gain is prefetched, the
  schedule re-simulated, and so on, each evicting the MRS victim of layer ``l+1`` outside the
  prediction and outside the copies still in flight. The released code prefetches the top
  ``prefetch_size`` experts by MRS score instead (default 0); this follows the paper.
- Resources: pinned host copies (the code's ``pin_memory`` storage), one CPU worker (one
  kTransformers CPU call per layer uses every core), ``temp_buffers`` (default 2) temporary
  buffers for prefill copies beyond the layer's slots (the code keeps one buffer per expert of
  a layer; two already double-buffer the link, and a copy cannot go faster).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import Action, Plan, ResourceSpec, SetupContext, Slot, View
from daopsim.policies.caching import PendingCopies
from daopsim.policies.lru import LRUPolicy
from daopsim.policies.options import Param
from daopsim.policies.registry import register
from daopsim.simulator.costs import CostModel

GPU: Final = Action.GPU
FETCH: Final = Action.FETCH
TEMP: Final = Action.TEMP
CPU: Final = Action.CPU
#: PKU-SEC-Lab/HybriMoE experts.py (HEAD 508a85b): model_gpu_time "0.5" per expert,
#: model_cpu_time "1 * token_num" with intercept 0.79 (first CPU expert), model_move_time
#: 0.41791011235117914; relative units the code marks "need to be tested"
CODE_GPU: Final = 0.5
CODE_CPU_PER_TOKEN: Final = 1.0
CODE_CPU_FIRST: Final = 0.79
CODE_MOVE: Final = 0.41791011235117914
#: modeling_deepseek.py: KScoreAwareCache(num_layers, n_experts, 0.5, 2 * self.top_k)
MRS_ALPHA: Final = 0.5


def hybrid_schedule(
    cached: list[int],
    uncached: list[int],
    load: Callable[[int], int],
    gpu_s: Callable[[int], float],
    cpu_s: Callable[[int], float],
    lands: list[float],
    cpu_first_s: float,
    ready: dict[int, float] | None = None,
) -> tuple[list[int], list[int], float]:
    """HybriMoE's HSS: (CPU experts, GPU experts, the simulated layer time). Resident experts
    go first by load (descending), then the others by load (descending); the GPU side is
    offered the list's first, the CPU side its last, and the side that would finish earlier
    takes it. The i-th non-resident expert the GPU side takes waits for its copy to land at
    ``lands[i]`` (at least one entry per non-resident expert); a resident one whose copy is
    still landing waits until its ``ready`` time (both relative to the layer's start; the
    prefetch's simulation of layer l+1)."""
    order = sorted(cached, key=load, reverse=True) + sorted(uncached, key=load, reverse=True)
    moving = set(uncached)
    gpu_t = cpu_t = 0.0
    moved = 0
    gpu_q: list[int] = []
    cpu_q: list[int] = []
    lo, hi = 0, len(order) - 1
    while lo <= hi:
        first, last = order[lo], order[hi]
        g = gpu_s(load(first))
        c = cpu_s(load(last))
        if not cpu_q:
            c += cpu_first_s
        m = 0
        if first in moving:
            m = 1
            land = lands[moved]
            if land > gpu_t:
                g += land - gpu_t
        elif ready is not None:
            r = ready.get(first, 0.0)
            if r > gpu_t:
                g += r - gpu_t
        if gpu_t + g <= cpu_t + c:
            moved += m
            gpu_t += g
            gpu_q.append(first)
            lo += 1
        else:
            cpu_t += c
            cpu_q.append(last)
            hi -= 1
    return cpu_q, gpu_q, max(gpu_t, cpu_t)


@mypyc_attr(allow_interpreted_subclasses=True)
class HybriMoEPolicy(LRUPolicy):
    """Per-layer MRS cache; each layer's routed experts split between CPU and GPU by their
    expected finish times; impact-driven prefetch of the next layer's predicted experts."""

    name = "hybrimoe"
    summary = (
        "HybriMoE: per-layer Minus-Recent-Score cache, CPU/GPU split of each layer by expected "
        "finish time (HSS), impact-driven prefetch from the layer-early view"
    )
    source = "HybriMoE (DAC'25, arXiv 2504.05897), code PKU-SEC-Lab/HybriMoE"
    runtime_profile = "ktransformers"
    params = {
        **LRUPolicy.params,
        "schedule": Param(
            str,
            "hybrid",
            "'hybrid': HSS; 'cpu': every miss on the CPU (kTransformers's rule); 'gpu': every "
            "miss fetched",
            choices=("hybrid", "cpu", "gpu"),
        ),
        "cache": Param(
            str, "mrs", "replacement: 'mrs' (Minus Recent Score) or 'lru'", choices=("mrs", "lru")
        ),
        "top_p": Param(int, 0, "MRS: experts whose score is accumulated (0: 2k)", minimum=0),
        "prefetch": Param(
            int,
            -1,
            "impact-driven prefetch: at most this many experts of layer l+1 per layer "
            "(-1: the model's top-k; 0: off)",
            minimum=-1,
        ),
        "constants": Param(
            str,
            "model",
            "HSS's time estimates: 'model' (the cost model's) or 'code' (the code's placeholders)",
            choices=("model", "code"),
        ),
        "temp_buffers": Param(
            int, 2, "temporary buffers for prefill copies beyond a layer's slots", minimum=1
        ),
    }

    #: per layer: the MRS score of each expert
    score: list[list[float]]
    copies: PendingCopies
    _costs: CostModel

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o = self.options
        self.sched = str(o["schedule"])
        self.mrs = o["cache"] == "mrs"
        self.top_p_opt = int(o["top_p"])
        self.prefetch_opt = int(o["prefetch"])
        self.code = o["constants"] == "code"
        self.buffers = int(o["temp_buffers"])
        self.top_p = 0
        self.n_pre = 0
        self.cpu_first_s = 0.0
        self.gpu1 = 0.0
        self.cpu1 = 0.0
        self.span = 0.0  #: the last split's simulated layer time
        self.moves = 0  #: the last split's copies into the GPU
        self.split_key = (0, 0)  #: the last split's (resident, missing) counts
        #: decode splits by (resident, missing) counts: (GPU experts, simulated time)
        self._split_memo: dict[tuple[int, int], tuple[int, float]] = {}
        #: prefetch counts by the split's counts and layer+1's (resident, missing) counts
        self._pre_memo: dict[tuple[int, int, int, int], int] = {}
        self.copies = PendingCopies()

    def uses_lookahead(self) -> bool:
        """The prefetch reads the one-layer-early view."""
        return self.prefetch_opt != 0

    def resources(self) -> ResourceSpec:
        """Pinned copies, one CPU worker (kTransformers' one call per layer), the buffers."""
        return ResourceSpec(host_memory="pinned", temp_buffers=self.buffers, cpu_workers=1)

    def setup(self, ctx: SetupContext) -> list[Slot]:
        """Each layer's first experts; scores at zero; the schedule's time estimates."""
        m, costs = ctx.model, ctx.costs
        self.top_p = min(m.experts, self.top_p_opt or 2 * m.top_k)
        self.n_pre = m.top_k if self.prefetch_opt < 0 else self.prefetch_opt
        self.score = [[0.0] * m.experts for _ in range(m.moe_layers)]
        self.copies = PendingCopies()
        self._split_memo = {}  # another model or machine: other times
        self._pre_memo = {}
        if self.code:
            self.cpu_first_s = CODE_CPU_FIRST
            self.gpu1, self.cpu1 = CODE_GPU, CODE_CPU_PER_TOKEN
        else:
            self.cpu_first_s = 0.0
            self.gpu1, self.cpu1 = costs.decision_split_times(1)
        self._costs = costs
        return list(super().setup(ctx))

    # -- the schedule's time estimates ------------------------------------------------------
    def gpu_s(self, n: int) -> float:
        """Expected GPU time of an expert with ``n`` tokens."""
        if self.code:
            return CODE_GPU
        return self.gpu1 if n == 1 else self._costs.decision_split_times(n)[0]

    def cpu_s(self, n: int) -> float:
        """Expected CPU time of an expert with ``n`` tokens (its activations' trip included)."""
        if self.code:
            return CODE_CPU_PER_TOKEN * n
        if n == 1:
            return self.cpu1
        return self._costs.decision_split_times(n)[1]

    def lands(self, view: View, n: int, queued: int = 0, wait: float = 0.0) -> list[float]:
        """When each of ``n`` copies issued ``wait`` after the decision lands, behind
        ``queued`` copies issued at it, relative to their issue: the engine's lane rule from
        an idle lane (``View.copy_lands``); ``constants = "code"``: the code's transfer
        placeholder per copy, one after another from ``queued`` of them."""
        if self.code:
            t = queued * CODE_MOVE - wait
            if t < 0.0:
                t = 0.0
            out: list[float] = []
            for _ in range(n):
                t += CODE_MOVE
                out.append(t)
            return out
        return view.copy_lands(n, queued, wait, idle=True)

    # -- MRS -----------------------------------------------------------------------------------
    def update_scores(self, layer: int, probs: list[float]) -> None:
        """``S = alpha x s + (1 - alpha) x S`` for the layer's ``top_p`` most probable experts,
        ``S = (1 - alpha) x S`` for the others."""
        row = self.score[layer]
        top = sorted(range(len(probs)), key=lambda e: (-probs[e], e))[: self.top_p]
        keep = 1.0 - MRS_ALPHA
        for e in range(len(row)):
            row[e] *= keep
        for e in top:
            row[e] += MRS_ALPHA * probs[e]

    def choose_victim(self, layer: int, protected: set[int], step: int) -> int:
        """The lowest MRS score outside ``protected`` (ties: least recently used); ``lru``."""
        if not self.mrs:
            return super().choose_victim(layer, protected, step)
        row = self.score[layer]
        best = -1
        low = 0.0
        for e in self.order[layer]:
            if e in protected:
                continue
            if best < 0 or row[e] < low:
                best, low = e, row[e]
        if best < 0:
            raise AssertionError("caller guarantees an unprotected resident expert")
        return best

    # -- decisions -----------------------------------------------------------------------------
    def split(self, view: View, experts: list[int]) -> tuple[list[int], list[int]]:
        """(CPU experts, GPU experts) of the layer's routed ``experts`` under ``schedule``;
        :attr:`span` is then the layer's simulated time and :attr:`moves` its copies."""
        resident: list[bool] = view.resident[view.layer].tolist()
        cached = [e for e in experts if resident[e]]
        missing = [e for e in experts if not resident[e]]
        counts = view.counts
        load: Callable[[int], int] = _one
        if counts is not None:
            n: list[int] = [int(x) for x in counts.tolist()]
            load = n.__getitem__
        self.split_key = (len(cached), len(missing))
        if self.sched == "hybrid" and missing and counts is None:
            # one token per expert: the schedule depends on the counts alone (memoised; the
            # equal loads keep the routing order, the CPU side taking the list from its end)
            hit = self._split_memo.get(self.split_key)
            if hit is None:
                cpu_q, gpu_q, self.span = hybrid_schedule(
                    cached, missing, load, self.gpu_s, self.cpu_s,
                    self.lands(view, len(missing)), self.cpu_first_s,
                )  # fmt: skip
                self._split_memo[self.split_key] = (len(gpu_q), self.span)
            else:
                order = cached + missing
                n_gpu, self.span = hit
                gpu_q = order[:n_gpu]
                cpu_q = order[n_gpu:][::-1]
        elif self.sched == "hybrid" and missing:
            cpu_q, gpu_q, self.span = hybrid_schedule(
                cached, missing, load, self.gpu_s, self.cpu_s,
                self.lands(view, len(missing)), self.cpu_first_s,
            )  # fmt: skip
        elif self.sched == "cpu":
            cpu_q, gpu_q = missing, cached
            self.span = self._serial(cached, missing, load)
        else:
            cpu_q, gpu_q = [], experts
            lands = self.lands(view, len(missing))
            self.span = self._serial(experts, [], load) + (lands[-1] if lands else 0.0)
        self.moves = sum(1 for e in gpu_q if not resident[e])
        return cpu_q, gpu_q

    def _serial(self, gpu: list[int], cpu: list[int], load: Callable[[int], int]) -> float:
        """The time of a layer whose ``gpu`` and ``cpu`` experts each run one after another on
        their side, the sides side by side (the ``cpu`` and ``gpu`` schedules' estimate)."""
        g = sum(self.gpu_s(load(e)) for e in gpu)
        c = sum(self.cpu_s(load(e)) for e in cpu) + (self.cpu_first_s if cpu else 0.0)
        return max(g, c)

    def decode_layer(self, view: View) -> Plan:
        """MRS update, the CPU/GPU split, the GPU part served by the cache, then prefetch."""
        layer = view.layer
        experts: list[int] = view.experts.tolist()
        if self.mrs:
            self.update_scores(layer, view.probs.tolist())
        self.copies.begin(view)
        cpu_q, gpu_q = self.split(view, experts)
        plan = self.serve(view, gpu_q)
        actions = plan.actions
        assert actions is not None
        for e in cpu_q:
            actions[e] = CPU
        if self.n_pre > 0 and view.counts is None:
            ahead = view.next_experts
            if ahead is not None:
                self._prefetch(view, plan, [int(e) for e in ahead.tolist() if e >= 0])
        return plan

    def batch_layer(self, view: View) -> Plan:
        """A batched decode step: the decode rule with the batch's loads (tokens per expert);
        the released code sends any step of more than one token through its prefill path,
        which never evicts (a cache that stops changing once full), so this follows the
        paper's decode rule instead."""
        return self.decode_layer(view)

    def prefill_layer(self, view: View) -> Plan:
        """The split with the prompt's loads; a GPU miss goes to a free slot of the layer,
        else to a temporary buffer (no eviction in prefill, as the code)."""
        layer = view.layer
        experts: list[int] = view.experts.tolist()
        if self.mrs:
            self.update_scores(layer, view.probs.tolist())
        cpu_q, gpu_q = self.split(view, experts)
        counts = view.counts
        resident: list[bool] = view.resident[layer].tolist()
        # the resident GPU experts are the cache's hits; the misses its own way
        plan = self.serve(view, [e for e in gpu_q if resident[e]])
        actions = plan.actions
        assert actions is not None
        cap = self.quota[layer]
        for e in gpu_q:
            if resident[e]:
                continue
            if self.occupied(layer) < cap:
                actions[e] = FETCH
                self._admit(layer, e, view.step)
                self.touch(layer, e, view.step, 1 if counts is None else int(counts[e]))
            else:
                actions[e] = TEMP
        for e in cpu_q:
            actions[e] = CPU
        return plan

    def _prefetch(self, view: View, plan: Plan, ahead: list[int]) -> None:
        """Impact-driven: prefetch the predicted experts of layer+1 whose copy shortens its
        simulated schedule most, one at a time, each evicting the MRS victim outside the
        prediction and outside the copies still in flight. A prefetch queues behind this
        layer's copies and earlier prefetches; layer+1 starts about when this layer's
        simulated schedule ends, so a copy that lands later keeps layer+1 waiting for it (and
        its own copies waiting behind it)."""
        nl = view.layer + 1
        resident: list[bool] = view.resident[nl].tolist()
        missing = [e for e in ahead if not resident[e]]
        if not missing:
            return
        key = (*self.split_key, len(ahead) - len(missing), len(missing))
        n = self._pre_memo.get(key)
        if n is None:
            n = self._pre_memo[key] = self._prefetch_count(
                view, len(ahead) - len(missing), len(missing)
            )
        if not n:
            return
        keep = set(ahead)
        extra = self.unevictable(nl)  # copies in flight (and an override's own)
        if extra:
            keep |= extra
        for e in missing[:n]:
            if not self._prefetch_into(plan, nl, e, keep, view.step):
                break
            self.copies.prefetch((nl, e))

    def _prefetch_count(self, view: View, n_cached: int, n_missing: int) -> int:
        """How many of layer+1's predicted experts the impact-driven greedy prefetches, with
        ``n_cached`` of them resident and ``n_missing`` not, after the current layer's split
        (:attr:`span`, :attr:`moves`). At one token per expert the candidates are alike, so
        each round's best is the first one left (the view's order). The copies land as
        :meth:`lands` says: the current layer's own copies first, then the prefetches, then
        (issued when layer+1 starts, :attr:`span` from now) layer+1's own."""
        cached = list(range(n_cached))
        missing = list(range(n_cached, n_cached + n_missing))
        lead = self.span
        queued = self.moves  # the current layer's own copies go first
        ready: dict[int, float] = {}
        n = 0
        for _ in range(self.n_pre):
            if not missing:
                break
            base = self._next_span(
                cached, missing, ready, self.lands(view, len(missing), queued, lead)
            )
            e = missing[0]
            ready[e] = max(0.0, self.lands(view, 1, queued)[0] - lead)
            after = self.lands(view, len(missing) - 1, queued + 1, lead)
            if base - self._next_span([*cached, e], missing[1:], ready, after) <= 0.0:
                break
            n += 1
            queued += 1
            cached.append(e)
            missing.remove(e)
        return n

    def _next_span(
        self, cached: list[int], missing: list[int], ready: dict[int, float], lands: list[float]
    ) -> float:
        """The simulated time of layer+1 at one token per expert, with ``cached`` resident
        (landing at ``ready``) and its own copies landing at ``lands``, under ``schedule``."""
        if self.sched == "hybrid":
            return hybrid_schedule(
                cached, missing, _one, self.gpu_s, self.cpu_s, lands, self.cpu_first_s, ready
            )[2]
        gpu_t = 0.0
        for e in cached:
            gpu_t = max(gpu_t, ready.get(e, 0.0)) + self.gpu_s(1)
        if self.sched == "cpu":
            cpu_t = self.cpu_s(1) * len(missing) + (self.cpu_first_s if missing else 0.0)
            return max(gpu_t, cpu_t)
        for i in range(len(missing)):
            gpu_t = max(gpu_t, lands[i]) + self.gpu_s(1)
        return gpu_t

    def unevictable(self, layer: int) -> set[int] | None:
        """Prefetched experts of the layer whose copy is still in flight."""
        return self.copies.in_layer(layer)

    def removed(self, layer: int, expert: int) -> None:
        """Forget an evicted expert (recency and a prefetch in flight)."""
        super().removed(layer, expert)
        self.copies.forget((layer, expert))


def _one(expert: int) -> int:
    """A decode token's load: one token per routed expert."""
    return 1


register(HybriMoEPolicy)
