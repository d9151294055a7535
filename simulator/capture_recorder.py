"""Recording the routing of each forward pass: forward hooks on every MoE layer's router collect
the selected experts and their weights, the softmax over all experts (or its top m), and the
one-layer-early view (layer l's router applied to layer l-1's router input); the rank order
that ties are broken by (docs/capture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from daopsim.simulator.capture_layers import MoeLayer, _n_experts, _torch
from daopsim.simulator.trace_read import RANK_ORDER_COLUMNS

# --------------------------------------------------------------------------------------------
# Rank order: rank 0 is the expert with the highest selection score
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankOrder:
    """How captured top-k rows are ordered, for the trace provenance.

    ``score`` says in words which score ranks the experts; ``columns`` lists the stored columns
    that are non-increasing along rank under it (what ``trace validate`` can check).
    """

    score: str
    columns: tuple[str, ...]


def selection_score(router: Any, logits: Any) -> Any:
    """The score ``router`` picked its top-k on, per expert (float32, ``[tokens, E]``).

    Routers with an ``e_score_correction_bias`` (DeepSeek-V3, GLM-4-MoE) select on
    ``sigmoid(logits) + bias``, computed here with the router's own operations; every other
    supported router selects on a monotone function of the logits (softmax, or the logits
    themselves), so the logits order the experts the same way.
    """
    torch = _torch()
    logits = logits.reshape(-1, logits.shape[-1]).float()
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is None:
        return logits
    return torch.sigmoid(logits) + bias.to(device=logits.device, dtype=torch.float32)


def sort_by_score(router: Any, logits: Any, ids: Any, *paired: Any) -> tuple[Any, ...]:
    """``ids`` (and tensors paired with them) reordered per row by descending selection score.

    Routers that take their top-k with ``sorted=False`` (DeepSeek) return the experts in no
    particular order; the trace promises rank 0 is the top expert. The sort is stable, so
    rows that are already in order (``torch.topk`` with ``sorted=True``) stay as they are.
    """
    torch = _torch()
    k = ids.shape[-1]
    ids = ids.reshape(-1, k)
    score = selection_score(router, logits).gather(1, ids.long())
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    return ids.gather(1, order), *(t.reshape(-1, k).gather(1, order) for t in paired)


def rank_order(moe: list[MoeLayer]) -> RankOrder:
    """What a capture's rank order follows, given the model's routers."""
    router = moe[0].router
    if getattr(router, "e_score_correction_bias", None) is not None:
        score = "selection score (sigmoid of router logits + e_score_correction_bias)"
        if all(not bool(m.router.e_score_correction_bias.any()) for m in moe):
            # a zero bias leaves the sigmoid order, which weights and probabilities follow
            return RankOrder(f"{score}; the bias is zero in every layer", RANK_ORDER_COLUMNS)
        return RankOrder(score, ())
    if type(router).__name__ == "PhimoeTopKRouter":
        # sparsemixer's weights come from differently masked softmaxes: not monotone in rank
        return RankOrder("router logit (sparsemixer picks in descending logit order)", ("probs",))
    return RankOrder(
        "router logit (the router's top-k of its logits or softmax)", RANK_ORDER_COLUMNS
    )


# --------------------------------------------------------------------------------------------
# Recording hooks
# --------------------------------------------------------------------------------------------


@dataclass
class StepRouting:
    """Routing of one forward pass, shaped ``[batch, tokens, layers, ...]`` (numpy)."""

    experts: np.ndarray
    weights: np.ndarray
    probs: np.ndarray
    prob_ids: np.ndarray | None
    early_experts: np.ndarray
    early_probs: np.ndarray
    early_prob_ids: np.ndarray | None


class RoutingRecorder:
    """Forward hooks on every MoE router; collects one :class:`StepRouting` per forward pass.

    Use as a context manager (hooks are removed on exit). The hooks only read: the model's
    outputs are unchanged. The one-layer-early view calls layer l's router ``forward`` directly
    (no hooks run) on layer l-1's router input from the same pass.
    """

    def __init__(self, moe: list[MoeLayer], top_m: int | None = None) -> None:
        self.moe = moe
        self.experts = _n_experts(moe[0].router)
        self.top_m = top_m if top_m is not None and top_m < self.experts else None
        self.steps: list[StepRouting] = []
        self._handles: list[Any] = []
        self._shape: tuple[int, int] | None = None
        self._prev_input: Any = None
        self._layer_parts: list[tuple[Any, ...]] = []

    def __enter__(self) -> RoutingRecorder:
        for j, layer in enumerate(self.moe):
            self._handles.append(
                layer.block.register_forward_pre_hook(self._block_pre_hook, with_kwargs=True)
            )
            self._handles.append(layer.router.register_forward_hook(self._make_hook(j)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._prev_input = None
        self._layer_parts = []

    def reset(self) -> None:
        """Forget recorded steps (start of a new batch)."""
        self.steps = []
        self._prev_input = None
        self._layer_parts = []

    def _block_pre_hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if hidden is not None and hidden.dim() == 3:
            self._shape = (int(hidden.shape[0]), int(hidden.shape[1]))

    def _probs(self, logits: Any) -> tuple[Any, Any]:
        torch = _torch()
        probs = torch.softmax(logits.float(), dim=-1)
        if self.top_m is None:
            return probs, None
        vals, ids = torch.topk(probs, self.top_m, dim=-1)
        return vals, ids

    def _make_hook(self, j: int) -> Callable[..., None]:
        torch = _torch()
        last = len(self.moe) - 1
        router = self.moe[j].router

        def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
            with torch.no_grad():
                x = args[0]
                x = x.reshape(-1, x.shape[-1])
                logits, weights, idx = output[0], output[1], output[2]
                idx, weights = sort_by_score(router, logits, idx, weights)
                probs, prob_ids = self._probs(logits)
                if j == 0 or self._prev_input is None:
                    e_idx = e_probs = e_ids = None
                else:
                    dev = next(router.parameters()).device
                    prev = self._prev_input.to(dev)
                    e_logits, _, e_idx = router.forward(prev)
                    (e_idx,) = sort_by_score(router, e_logits, e_idx)
                    e_probs, e_ids = self._probs(e_logits)
                self._layer_parts.append((idx, weights, probs, prob_ids, e_idx, e_probs, e_ids))
                self._prev_input = x
                if j == last:
                    self._finish_step()

        return hook

    def _finish_step(self) -> None:
        torch = _torch()
        parts, self._layer_parts = self._layer_parts, []
        self._prev_input = None
        if len(parts) != len(self.moe):
            raise RuntimeError(
                f"recorded {len(parts)} MoE layers in one forward pass, expected {len(self.moe)}"
            )
        n = int(parts[0][0].shape[0])
        b, s = self._shape if self._shape and self._shape[0] * self._shape[1] == n else (1, n)
        dev = parts[0][0].device
        k = int(parts[0][0].shape[-1])
        width = int(parts[0][2].shape[-1])

        def stack(i: int, dtype: Any, fill: float | None = None) -> np.ndarray | None:
            if parts[0][i] is None and fill is None:
                return None
            cols = []
            for part in parts:
                t = part[i]
                if t is None:  # the first MoE layer has no early view
                    shape = (n, width if i in (5, 6) else k)
                    t = torch.full(shape, fill, dtype=torch.float32, device=dev)
                cols.append(t.detach().to(device=dev, dtype=torch.float32))
            # one device-to-host copy per field and step, not one per layer
            out = torch.stack(cols, dim=1).cpu().numpy().astype(dtype, copy=False)
            return out.reshape(b, s, *out.shape[1:])

        ids_fill = -1.0 if self.top_m else None
        step = StepRouting(
            experts=stack(0, np.int16),
            weights=stack(1, np.float32),
            probs=stack(2, np.float32),
            prob_ids=stack(3, np.int16),
            early_experts=stack(4, np.int16, fill=-1.0),
            early_probs=stack(5, np.float32, fill=float("nan")),
            early_prob_ids=stack(6, np.int16, fill=ids_fill),
        )
        self.steps.append(step)
