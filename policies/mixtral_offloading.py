"""mixtral-offloading: per-layer LRU with pinned buffers, write-back and optional prefetch.

Source: Eliseev & Mazur, "Fast Inference of Mixture-of-Experts Language Models with Offloading",
arXiv 2312.17238, code dvmazur/mixtral-offloading (``expert_cache.py``); as DAOP and Fiddler
ran it: 3 of 8 experts per layer, 4 pinned buffers, evicted expert copied back, no speculative
prefetch (docs/references.md#baselines).

Runtime ``hf-eager-attn``: the repository's requirements pin transformers 4.36.1 (and Fiddler's
copy of it for its baselines), whose Mixtral has no SDPA class, so a model built as the code
builds it runs transformers' eager attention: every head's scores are written to device memory
and softmaxed there (docs/cost-model.md "Eager attention"). It needs the model's
``attention_heads``, which every catalogue preset records.

- Each layer is an LRU "eviction group" of ``experts_per_layer`` GPU slots (default: the budget
  split evenly over the layers; the Colab default was 4 of 8, DAOP's runs 3 of 8).
- A miss swaps payloads: the expert is copied host -> device from pinned host memory and the
  evicted one device -> host (``writeback``); the ``b = 4`` shared device buffers are modelled as
  ``staging_buffers = 4`` so a fetch need not wait for the previous write-back.
- What a miss costs in the code Fiddler benchmarked (efeslab/fiddler
  benchmarks/mixtral_offloading/src: expert_cache.py ``_swap``, expert_wrapper.py,
  custom_layers.py ``SparseMoEWrapper``; eval-baseline.py ``quantized=False``, ``buffer_size=4``):
  each expert's w1/w2/w3 live in one contiguous ``UntypedStorage`` (352 MB bf16), so a swap is
  two ``copy_(..., non_blocking=True)`` calls: host -> device from pinned storage into one of the
  4 device buffers, then device -> host of the evicted expert into a pinned host buffer (the
  write-back happens even though weights never change). Both go on the current (default)
  stream, in that order, behind each other and behind the layer's kernels: the code creates no
  stream or event (docs/references.md, "Which stream its copies and kernels run on"). There is
  no explicit ``synchronize`` in the loop, but ``.unique().tolist()`` after the router and
  ``torch.where(...)`` + ``.tolist()`` per expert make the host wait for the stream, so the next
  layer's copies are issued only after this layer's work. This module models that: one pinned
  H2D + one pinned D2H per miss, sharing one FIFO (engine.py ``_evict``), and
  ``ResourceSpec.one_stream``: no expert kernel overlaps a copy and a layer ends once its copies
  have (docs/cost-model.md "One stream").
- ``copy_stream`` (default ``"default"``, as released): ``"side"`` is a what-if with the copies
  on a stream of their own, overlapping the kernels (and the only setting the multi-GPU
  executors accept).
- The code swaps on *every* miss. When a decode layer needs more experts than its group holds
  (top-2 with ``experts_per_layer = 1``), it evicts the group's least recently used expert even
  if this layer already used it: that expert's computation is ordered before its write-back on
  the stream, and the last expert loaded stays resident. ``evicts_in_use = True`` asks the
  engine for exactly that (the write-back is queued after the victim's computation, and its
  slot is held until then). Prefill takes the same path: ``SparseMoeWrapper`` calls
  ``load_experts`` with every expert the prompt routes to, and each non-resident one is swapped
  in (``_swap``: H2D plus the write-back of the group's least recently used expert, the pipeline
  window being ``buffer_size - 1`` loads), so a prompt that needs all 8 experts with 3 resident
  costs 5 swaps per layer, not 5 temporary copies. The engine issues a layer's swaps before its
  expert kernels (the code issues 3 first and the rest between kernels; on one stream the sum
  is the same).
- ``prefetch`` (default off, as in the released code, which has none; its pre-loads go on the
  same stream unless ``copy_stream = "side"``): speculative loading from the
  one-layer-early view. At layer l the top ``prefetch_k`` experts of ``view.next_experts`` (layer
  l+1's router applied to layer l's input) that are not resident are copied into layer l+1's
  group, evicting its least recently used expert that is not itself in ``view.next_experts`` and
  whose copy has landed, as the runtime knows from its copies' events (``View.ready``, the
  shared ``PendingCopies``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import Plan, ResourceSpec, SetupContext, Slot, View
from daopsim.policies.caching import PendingCopies
from daopsim.policies.lru import LRUPolicy
from daopsim.policies.options import Param
from daopsim.policies.registry import register
from daopsim.simulator.errors import UserError


@mypyc_attr(allow_interpreted_subclasses=True)
class MixtralOffloadingPolicy(LRUPolicy):
    """Per-layer LRU eviction groups, pinned swaps with write-back, optional prefetch."""

    name = "mixtral-offloading"
    summary = "per-layer LRU groups, pinned copies, evicted expert written back, opt. prefetch"
    source = "Mixtral-offloading (arXiv 2312.17238), dvmazur/mixtral-offloading expert_cache.py"
    # a PyTorch eager model (HF modules) on transformers 4.36.1, which has eager attention only
    runtime_profile = "hf-eager-attn"
    params = {
        "experts_per_layer": Param(
            int, 0, "GPU slots per layer (0: the budget split evenly over the layers)"
        ),
        "prefetch": Param(bool, False, "speculatively load layer l+1's experts at layer l"),
        "prefetch_k": Param(
            int,
            0,
            "experts of the one-layer-early view to prefetch (0: the model's top-k)",
            minimum=0,
        ),
        "copy_stream": Param(
            str,
            "default",
            "stream of the copies: 'default' (the kernels' stream, as released) or 'side'",
            choices=("default", "side"),
        ),
    }

    #: the prefetched experts whose copy is still in flight
    copies: PendingCopies

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        #: a decode plan may be changed after LRU's service (prefetches appended to it)
        self.do_prefetch = bool(self.options["prefetch"])
        self.copies = PendingCopies()

    def uses_lookahead(self) -> bool:
        """Only the optional prefetch reads the one-layer-early view."""
        return bool(self.options["prefetch"])

    def resources(self) -> ResourceSpec:
        """Pinned copies, write-back of evicted experts, in-use evictions, 4 staging buffers,
        copies and kernels on one stream."""
        return ResourceSpec(
            host_memory="pinned",
            writeback=True,
            evicts_in_use=True,
            staging_buffers=4,
            one_stream=self.options["copy_stream"] == "default",
        )

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """Every layer's group starts with its first experts (the code's initial offload)."""
        n = self.options["experts_per_layer"]
        n_layers = ctx.model.moe_layers
        if n < 0 or n > ctx.model.experts:
            raise UserError(
                f"policy {self.name!r}: option 'experts_per_layer' must be in "
                f"0..{ctx.model.experts}, got {n}"
            )
        if n and n * n_layers > ctx.budget:
            raise UserError(
                f"policy {self.name!r}: experts_per_layer={n} needs {n * n_layers} GPU experts, "
                f"the budget is {ctx.budget}"
            )
        self.k_pre = self.options["prefetch_k"] or ctx.model.top_k
        self.options = {**self.options, "initial": "first"}
        if n:
            ctx = dataclasses.replace(ctx, budget=n * n_layers)
        self.copies = PendingCopies()
        return super().setup(ctx)

    def unevictable(self, layer: int) -> set[int] | None:
        """Prefetched experts of the layer whose copy is still in flight."""
        return self.copies.in_layer(layer)

    def removed(self, layer: int, expert: int) -> None:
        """Forget an evicted expert (its recency, and a prefetch of it in flight)."""
        super().removed(layer, expert)
        self.copies.forget((layer, expert))

    def decode_layer(self, view: View) -> Plan:
        """LRU service of this layer, then (optionally) prefetch for the next one."""
        experts: list[int] = view.experts.tolist()
        if not self.do_prefetch:
            # nothing is ever pending: LRU's service alone
            return self.serve(view, experts)
        self.copies.begin(view)
        plan = self.serve(view, experts)
        if view.next_experts is not None:
            self._prefetch(view, plan)
        return plan

    def _prefetch(self, view: View, plan: Plan) -> None:
        """Copy the top ``prefetch_k`` experts of the one-layer-early view of layer+1 into its
        group, each evicting the victim :meth:`choose_victim` picks among the experts neither
        in that view nor still in flight; stops when there is none."""
        nl = view.layer + 1
        ahead = view.next_experts
        assert ahead is not None
        nxt = [e for e in ahead.tolist() if e >= 0]
        protected = set(nxt)
        pending = self.unevictable(nl)
        if pending:
            protected |= pending
        for e in nxt[: self.k_pre]:
            if self.is_resident(nl, e):
                continue
            if not self._prefetch_into(plan, nl, e, protected, view.step):
                break
            self.copies.prefetch((nl, e))


register(MixtralOffloadingPolicy)
