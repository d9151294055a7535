"""The notes of a run: one line per way the trace, the policy or the budget limits what the run
models (shown with the results, ``RunResult.config["notes"]``).
"""

from __future__ import annotations

from typing import Any

from daopsim.policies.base import Policy
from daopsim.simulator.trace import (
    TraceMeta,
)


def run_notes(
    pol: Policy, meta: TraceMeta, no_prefill: int, evaluated: int, stand_in: bool
) -> list[str]:
    """One line per way this trace limits what the run models (shown with the results)."""
    notes = []
    if no_prefill:
        which = (
            "has no prefill"
            if no_prefill == evaluated
            else (f"has {no_prefill} of {evaluated} sequences without prefill")
        )
        does_prefill = type(pol).prefill_layer is not Policy.prefill_layer
        what = pol.prefill_note or ("prefill_layer" if does_prefill else "")
        if what:
            notes.append(f"trace {which}: {pol.name}'s {what} did not run for those sequences")
        else:
            notes.append(f"trace {which}: time to first token covers no prompt")
    if stand_in:
        notes.append(
            "look-ahead stand-in: the one-layer-early view is the previous token's experts at "
            "the same layer (--lookahead previous-token)"
        )
    if not meta.weights_recorded:
        notes.append(
            "trace has no gate weights: policies saw 1/k per expert; gate mass not available"
        )
    return notes


def small_budget_note(pol: Policy, model: Any, budget: int) -> str:
    """The run note of a per-layer cache whose budget holds at most one token's experts per
    layer: every such cache then keeps exactly the last token's experts, so LRU, LFU, Belady
    and the others give the same hits ("" for a larger budget or another kind of policy)."""
    from daopsim.policies.caching import CachingPolicy

    per_layer = budget // max(1, model.moe_layers)
    if not isinstance(pol, CachingPolicy) or per_layer > model.top_k:
        return ""
    return (
        f"budget of {budget} experts is {per_layer} per layer, at most top-k ({model.top_k}): "
        "a per-layer cache then holds only the last token's experts, so every per-layer "
        "caching policy (lru, lfu, belady, ...) gives the same hits here; compare them from "
        f"{(model.top_k + 1) * model.moe_layers} experts ({model.top_k + 1} per layer)"
    )


def cpu_layers_note(model: Any, n_cpu: int) -> str:
    """The run note naming a whole-layer split (``ResourceSpec.gpu_blocks``)."""
    n = model.moe_layers
    if n_cpu == 0:
        return f"layer split: all {n} MoE layers wholly on the GPU"
    if n_cpu == n:
        return f"layer split: all {n} MoE layers wholly on the CPU (non-expert part and experts)"
    return (
        f"layer split: MoE layers 0-{n_cpu - 1} wholly on the CPU (non-expert part and "
        f"experts), {n_cpu}-{n - 1} wholly on the GPU; hidden states cross the link at layer "
        f"{n_cpu}"
    )
