"""dali: DALI's greedy CPU/GPU assignment, layer-early prefetch and workload-aware cache.

Source: Zhu, Li, Wang, Mo, Pei, Song, Liang, Cheng, "DALI: A Workload-Aware Offloading Framework
for Efficient MoE Inference on Local PCs" (arXiv 2602.03495, 2026); facts in
docs/references.md#dali. Read: the abstract, a public reading note of the evaluation
(hardware, models, batch sizes, speed-ups, the greedy's 92 % of the optimum), and a public
re-implementation's description of the cache replacement (section 4.3, Algorithm 2). The
paper's body (its greedy, its residual vectors, its constants) was not reachable; no code is
public (the note says it is built on kTransformers, so it runs on that runtime profile).

- **Greedy Assignment** (``assign = "greedy"``): DALI writes the placement of a layer's routed
  experts as a 0-1 problem (minimise ``max(T_GPU, T_CPU)``) and solves it greedily at run time.
  Our greedy: each expert's GPU cost is ``gpu(n)``, and for a non-resident one its copy too
  (the GPU waits for it to land); its CPU cost ``cpu(n)`` (with the activations' round trip);
  experts are taken in decreasing order of what the GPU saves (``cpu - gpu``, less a copy)
  and each goes to the side whose finish time (the layer's ``max``) stays lower. The cost
  model gives the times (``CostModel.decision_split_times``; DALI profiles them at warm-up),
  and the engine's lane rule when copies land, from an idle lane (``View.copy_lands(...,
  idle=True)``, each copy ``View.copy_s``; the greedy does not watch the copy queue). A
  non-resident
  expert put on the GPU is copied into a temporary buffer: the cache changes only by the
  replacement below. ``assign = "cpu"``: every miss on the CPU (a static assignment, the
  ablation).
- **Workload-aware cache replacement** (``window``, ``swap``): per layer, each expert's
  workload (tokens routed to it) is summed over a window of ``window`` steps (a decode token
  or a prompt pass); at the window's end up to ``swap`` non-resident experts with the highest
  window workload (> 0) are copied in, each replacing the resident expert with the lowest
  (ties: the lower id), and the sums restart. ``window = 0``: no replacement (the placement
  stays the initial one). The defaults ``window = 4``, ``swap = 1`` are ours: the paper's were
  not readable.
- **Residual-based prefetching** (``prefetch``, default ``-1``: up to k per layer; 0 off):
  DALI predicts the next layer's high-workload experts by adding a per-layer residual vector,
  calibrated offline, to the current gate input. A routing trace records no hidden states, so
  this uses the one-layer-early view instead (layer ``l+1``'s router applied to layer ``l``'s
  router input, the prediction *without* DALI's residual correction, which the paper reports
  improves prefetch accuracy by 6.9 % on DeepSeek and 15.7 % on Qwen over HybriMoE's): its
  predicted experts that are not resident are copied into layer ``l+1``'s slots, replacing the
  lowest-workload resident outside the prediction and outside copies still in flight. A
  prompt pass or a batched serving step has no layer-early view, so it prefetches nothing
  (DALI's evaluation is batched: its prediction of a batch's high-workload experts is not
  modelled).
- Resources: pinned copies, one CPU worker (kTransformers' CPU call uses every core),
  ``temp_buffers`` (default 2) buffers for the copies of GPU-assigned misses.
"""

from __future__ import annotations

from typing import Any, Final

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import Action, Plan, ResourceSpec, SetupContext, Slot, View
from daopsim.policies.caching import CachingPolicy, PendingCopies
from daopsim.policies.options import Param
from daopsim.policies.registry import register
from daopsim.simulator.costs import CostModel

GPU: Final = Action.GPU
TEMP: Final = Action.TEMP
CPU: Final = Action.CPU


def greedy_assign(
    experts: list[int],
    loads: list[int],
    resident: list[bool],
    gpu_s: list[float],
    cpu_s: list[float],
    copy_s: float,
    lands: list[float],
) -> tuple[list[int], list[int]]:
    """(CPU experts, GPU experts): experts in decreasing order of what the GPU saves (``cpu -
    gpu``, less ``copy_s`` for a non-resident one; ties: routing order), each to the side
    whose finish keeps ``max(T_GPU, T_CPU)`` lower (the GPU on ties). The i-th non-resident
    expert the GPU side takes waits for its copy to land at ``lands[i]`` (relative to the
    layer's start); ``gpu_s``/``cpu_s`` are per expert, in ``experts`` order."""
    idx = list(range(len(experts)))
    saved = [cpu_s[i] - gpu_s[i] - (0.0 if resident[experts[i]] else copy_s) for i in idx]
    idx.sort(key=lambda i: -saved[i])
    t_gpu = t_cpu = 0.0
    moved = 0
    gpu_q: list[int] = []
    cpu_q: list[int] = []
    for i in idx:
        e = experts[i]
        m = 0
        if resident[e]:
            g = t_gpu + gpu_s[i]
        else:
            m = 1
            g = max(t_gpu, lands[moved]) + gpu_s[i]
        c = t_cpu + cpu_s[i]
        if max(g, t_cpu) <= max(t_gpu, c):
            t_gpu = g
            moved += m
            gpu_q.append(e)
        else:
            t_cpu = c
            cpu_q.append(e)
    return cpu_q, gpu_q


@mypyc_attr(allow_interpreted_subclasses=True)
class DALIPolicy(CachingPolicy):
    """Per-layer cache replaced by windowed workload; greedy CPU/GPU split of each layer."""

    name = "dali"
    summary = (
        "DALI: greedy CPU/GPU assignment of each layer's experts, layer-early prefetch, "
        "per-layer cache replaced by windowed workload"
    )
    source = "DALI (arXiv 2602.03495), workload-aware offloading on local PCs"
    runtime_profile = "ktransformers"
    params = {
        **CachingPolicy.params,
        "assign": Param(
            str,
            "greedy",
            "'greedy': DALI's assignment; 'cpu': every miss on the CPU (static, the ablation)",
            choices=("greedy", "cpu"),
        ),
        "window": Param(int, 4, "steps per workload window (0: no replacement)", minimum=0),
        "swap": Param(int, 1, "experts swapped in per layer at a window's end", minimum=0),
        "prefetch": Param(
            int,
            -1,
            "prefetch at most this many predicted experts of layer l+1 per layer (-1: the "
            "model's top-k; 0: off)",
            minimum=-1,
        ),
        "temp_buffers": Param(int, 2, "buffers for copies of GPU-assigned misses", minimum=1),
    }

    #: per layer: the window's workload per expert, and the steps in the window so far
    work: list[list[int]]
    steps: list[int]
    copies: PendingCopies
    _costs: CostModel

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o = self.options
        self.greedy = o["assign"] == "greedy"
        self.window = int(o["window"])
        self.n_swap = int(o["swap"])
        self.prefetch_opt = int(o["prefetch"])
        self.buffers = int(o["temp_buffers"])
        self.n_pre = 0
        self.gpu1 = 0.0
        self.cpu1 = 0.0
        self.copies = PendingCopies()
        #: decode splits by which of the ranks are resident: (CPU ranks, GPU ranks)
        self._memo: dict[tuple[bool, ...], tuple[list[int], list[int]]] = {}

    def uses_lookahead(self) -> bool:
        """The prefetch reads the one-layer-early view."""
        return self.prefetch_opt != 0

    def resources(self) -> ResourceSpec:
        """Pinned copies, one CPU worker, the buffers for GPU-assigned misses."""
        return ResourceSpec(host_memory="pinned", temp_buffers=self.buffers, cpu_workers=1)

    def setup(self, ctx: SetupContext) -> list[Slot]:
        """The initial placement (``initial``); empty windows; the time estimates."""
        m, costs = ctx.model, ctx.costs
        self._costs = costs
        self.n_pre = m.top_k if self.prefetch_opt < 0 else self.prefetch_opt
        self.work = [[0] * m.experts for _ in range(m.moe_layers)]
        self.steps = [0] * m.moe_layers
        self.copies = PendingCopies()
        self._memo = {}  # another model or machine: other times
        self.gpu1, self.cpu1 = costs.decision_split_times(1)
        return list(super().setup(ctx))

    def unevictable(self, layer: int) -> set[int] | None:
        """Prefetched experts of the layer whose copy is still in flight."""
        return self.copies.in_layer(layer)

    def removed(self, layer: int, expert: int) -> None:
        """A prefetch of an evicted expert no longer matters."""
        self.copies.forget((layer, expert))

    def choose_victim(self, layer: int, protected: set[int], step: int) -> int:
        """The resident expert with the lowest window workload outside ``protected``
        (ties: the lower id)."""
        row = self.work[layer]
        cands = [e for e in self.residents(layer) if e not in protected]
        if not cands:
            raise AssertionError("caller guarantees an unprotected resident expert")
        return min(cands, key=lambda e: (row[e], e))

    def decode_layer(self, view: View) -> Plan:
        """The greedy split (misses on the GPU through temporary buffers), the window's
        workload and swap, then the prefetch for layer+1."""
        layer = view.layer
        experts: list[int] = view.experts.tolist()
        counts = view.counts
        self.copies.begin(view)
        resident: list[bool] = view.resident[layer].tolist()
        if counts is None:
            loads = [1] * len(experts)
        else:
            loads = [int(counts[e]) for e in experts]
        if not self.greedy:
            cpu_q = [e for e in experts if not resident[e]]
            gpu_q = [e for e in experts if resident[e]]
        elif counts is None:
            # one token per expert: the split depends only on which ranks are resident
            flags = tuple([resident[e] for e in experts])
            hit = self._memo.get(flags)
            if hit is None:
                hit = self._memo[flags] = greedy_assign(
                    list(range(len(experts))), loads, list(flags),
                    [self.gpu1] * len(experts), [self.cpu1] * len(experts), view.copy_s,
                    view.copy_lands(flags.count(False), idle=True),
                )  # fmt: skip
            cpu_q = [experts[i] for i in hit[0]]
            gpu_q = [experts[i] for i in hit[1]]
        else:
            cpu_q, gpu_q = greedy_assign(
                experts, loads, resident, [self.gpu_s(n) for n in loads],
                [self.cpu_s(n) for n in loads], view.copy_s,
                view.copy_lands(sum(1 for e in experts if not resident[e]), idle=True),
            )  # fmt: skip
        # the resident GPU experts are the cache's hits; the others its own way
        plan = self.serve(view, [e for e in gpu_q if resident[e]])
        actions = plan.actions
        assert actions is not None
        for e in gpu_q:
            if not resident[e]:
                actions[e] = TEMP
        for e in cpu_q:
            actions[e] = CPU
        row = self.work[layer]
        for e, n in zip(experts, loads, strict=True):
            row[e] += n
        self.steps[layer] += 1
        protected = set(experts)
        if self.window and self.steps[layer] >= self.window:
            self._swap(view, plan, layer, protected)
        if self.n_pre and layer + 1 < len(self.work):
            self._prefetch(view, plan)
        return plan

    def gpu_s(self, n: int) -> float:
        """Expected GPU time of an expert with ``n`` tokens."""
        return self.gpu1 if n == 1 else self._costs.decision_split_times(n)[0]

    def cpu_s(self, n: int) -> float:
        """Expected CPU time of an expert with ``n`` tokens (its activations' trip included)."""
        if n == 1:
            return self.cpu1
        return self._costs.decision_split_times(n)[1]

    def _swap(self, view: View, plan: Plan, layer: int, protected: set[int]) -> None:
        """The window's end: the highest-workload non-resident experts in, each replacing the
        lowest-workload resident (outside this token's experts and copies in flight)."""
        row = self.work[layer]
        resident = self._row(layer)  # the engine's, with this plan's changes
        keep = set(protected)
        extra = self.unevictable(layer)
        if extra:
            keep |= extra
        ins = sorted(
            (e for e in range(len(row)) if row[e] > 0 and not resident[e]),
            key=lambda e: (-row[e], e),
        )
        for e in ins[: self.n_swap]:
            if self.occupied(layer) >= self.quota[layer] and not any(
                row[x] < row[e] for x in self.residents(layer) if x not in keep
            ):
                break  # every evictable resident worked as much: nothing to gain
            if not self._prefetch_into(plan, layer, e, keep, view.step):
                break
            self.copies.prefetch((layer, e))
            keep.add(e)
        self.work[layer] = [0] * len(row)
        self.steps[layer] = 0

    def _prefetch(self, view: View, plan: Plan) -> None:
        """The predicted experts of layer+1 that are not resident, copied into its slots, each
        replacing its lowest-workload resident outside the prediction and the pending copies."""
        nl = view.layer + 1
        ahead = view.next_experts
        if ahead is None or view.counts is not None:
            return  # a prompt pass or a batched step has no layer-early view
        pred = [int(e) for e in ahead.tolist() if e >= 0]
        resident = self._row(nl)  # the engine's, with this plan's changes
        if all(resident[e] for e in pred[: self.n_pre]):
            return
        keep = set(pred)
        extra = self.unevictable(nl)
        if extra:
            keep |= extra
        for e in pred[: self.n_pre]:
            if resident[e]:
                continue
            if not self._prefetch_into(plan, nl, e, keep, view.step):
                break
            self.copies.prefetch((nl, e))


register(DALIPolicy)
