"""What fits on the GPU: how many resident experts a machine holds for a model, a policy and a
KV-cache reserve (:func:`expert_fit`, the one place that decides it for ``run``, sweeps and
``profiles show``), the budget a run asks for, the layers a whole-layer split leaves on the CPU,
and the one-line errors when something does not fit (docs/cost-model.md, "How many experts
fit").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from daopsim.policies.base import Policy, ResourceSpec
from daopsim.simulator.costs import CostModel
from daopsim.simulator.errors import DoesNotFit, UserError
from daopsim.simulator.serving_config import ServingConfig
from daopsim.simulator.trace import (
    TraceMeta,
)


def fixed_residency(policy: Policy, model: Any) -> int | None:
    """:meth:`Policy.fixed_residency` of ``policy`` for ``model``, checked: a count, or None
    when the policy fills its budget. A hook that raises or answers something else is the
    policy's fault (a one-line ``PolicyError``)."""
    from daopsim.simulator.boundary import Hooks

    hooks = Hooks(policy)
    got = hooks.call("fixed_residency", policy.fixed_residency, model)
    if got is None:
        return None
    if isinstance(got, bool) or not isinstance(got, int | np.integer) or got < 0:
        raise hooks.error(f"fixed_residency returned {got!r}, expected a count >= 0 or None")
    return int(got)


def options_text(policy: Policy) -> str:
    """The options of ``policy`` that differ from their defaults, as ``k=v`` (or "defaults")."""
    changed = [
        f"{k}={v}"
        for k, v in sorted(policy.options.items())
        if k in policy.params and v != policy.params[k].default
    ]
    return ", ".join(changed) or "its defaults"


def policy_buffers(policy: Policy) -> int:
    """Expert-sized GPU buffers a policy keeps beside its resident experts (temporary buffers
    for TEMP copies plus staging slots for fetches); they come out of the same memory."""
    spec = policy.resources()
    return int(spec.temp_buffers) + int(spec.staging_buffers)


def keeps_nothing_resident(policy: Policy | type[Policy]) -> bool:
    """True for a policy that keeps no expert on the GPU between uses (stream-all): its
    memory budget is scratch space, so a cache ratio means nothing to it."""
    return bool(getattr(policy, "keeps_nothing_resident", False))


def trace_context(meta: TraceMeta) -> int:
    """KV-cache tokens a run reserves: the trace's mean tokens per sequence (at least 1)."""
    tokens = meta.counts.get("prefill_tokens", 0) + meta.counts.get("decode_tokens", 0)
    return int(max(1, tokens) / max(1, meta.counts.get("sequences", 1)))


@dataclass(frozen=True)
class ExpertFit:
    """How many resident experts fit on a machine for a model, a policy and a KV context."""

    model: str
    total_experts: int
    expert_bytes: int
    free_bytes: float  #: GPU bytes left after non-expert weights, workspace and KV cache
    buffers: int  #: the policy's expert-sized buffers, taken from ``free_bytes`` first
    context_tokens: int
    #: unified memory: the host's holdings already taken from ``free_bytes`` (0 otherwise)
    host_bytes: int = 0
    #: unified memory: the host bytes one GPU-resident expert frees, for a system that holds
    #: each expert once (0: the host keeps its copy beside the GPU's; always 0 on a bus)
    refund: int = 0

    def room(self, experts: int, extra: float = 0.0) -> float:
        """Bytes left with ``experts`` resident beside the buffers (``extra`` bytes freed
        elsewhere); negative when they do not fit."""
        used = (self.buffers + experts) * self.expert_bytes - experts * self.refund
        return self.free_bytes + extra - used

    def fits(self, experts: int, extra: float = 0.0) -> bool:
        """Whether ``experts`` resident experts and the buffers fit (``extra`` bytes freed)."""
        if not self.refund:  # whole expert-sized slots, as :attr:`slots` counts them
            return math.floor((self.free_bytes + extra) / self.expert_bytes) - self.buffers >= (
                experts
            )
        return self.room(experts, extra) >= 0

    @property
    def slots(self) -> int:
        """Expert-sized slots in the free memory (negative when the weights do not fit)."""
        return math.floor(self.free_bytes / self.expert_bytes)

    @property
    def max_experts(self) -> int:
        """Resident experts that fit beside the buffers (0 when even those do not fit)."""
        if not self.refund:
            return max(0, min(self.total_experts, self.slots - self.buffers))
        slot = self.expert_bytes - self.refund
        if slot <= 0:  # a resident expert frees at least what it takes: all or none fit
            return self.total_experts if self.fits(self.total_experts) else 0
        left = self.free_bytes - self.buffers * self.expert_bytes
        return max(0, min(self.total_experts, math.floor(left / slot)))

    def weights_fit(self) -> bool:
        """Whether the run can hold its weights at all (buffers aside) with some number of
        resident experts (the room is linear in that number: its best is at 0 or all)."""
        best = max(self.room(0), self.room(self.total_experts))
        return best + self.buffers * self.expert_bytes >= 0

    def max_ratio(self, digits: int = 3) -> float:
        """The largest cache ratio (``digits`` decimals) whose budget fits, or 0 if none does."""
        scale = 10**digits
        k = math.floor((self.max_experts + 0.5) / self.total_experts * scale)
        # checked the way simulate() turns a ratio into a budget: round(ratio x total)
        while k > 0 and round(k / scale * self.total_experts) > self.max_experts:
            k -= 1
        return max(0, k) / scale


def expert_fit(
    costs: CostModel, buffers: int, context_tokens: int, spec: ResourceSpec | None = None
) -> ExpertFit:
    """The one place that decides how many experts fit (``run``, sweeps, ``profiles show``).

    ``spec`` (the policy's resources) says what the host holds on a unified-memory machine: a
    copy of every expert (and HOBBIT's low-bit copies) that the GPU copies come from, or each
    expert once (``ResourceSpec.experts_held_once``); None is the former.
    """
    low = None if spec is None else spec.low_bit_dtype
    host = costs.unified_host_bytes(low)
    return ExpertFit(
        model=costs.model.name,
        total_experts=costs.model.total_experts,
        expert_bytes=costs.expert_bytes,
        free_bytes=costs.free_expert_bytes(context_tokens, host),
        buffers=buffers,
        context_tokens=context_tokens,
        host_bytes=host,
        refund=costs.unified_refund_bytes(spec is not None and spec.experts_held_once),
    )


def cpu_resident_layers(spec: ResourceSpec, costs: CostModel, fit: ExpertFit, kv: int) -> int:
    """Leading MoE layers a spec runs wholly on the CPU (``ResourceSpec.gpu_blocks``).

    N >= 0 GPU blocks leave the first ``moe_layers - N`` MoE layers on the CPU (dense blocks
    are taken to lead, so the last blocks are MoE ones). -1: the fewest CPU layers such that
    every GPU layer's experts fit beside the policy's buffers, once the CPU layers' non-expert
    weights and KV cache (``kv`` tokens) have moved to the host.
    """
    m = costs.model
    g = spec.gpu_blocks
    if g is None:
        return 0
    if g >= 0:
        return m.moe_layers - min(m.moe_layers, g)
    per_layer = costs.cpu_layer_freed_bytes(kv)
    for n in range(m.moe_layers + 1):
        if fit.fits((m.moe_layers - n) * m.experts, n * per_layer):
            return n
    return m.moe_layers


def check_fit(fit: ExpertFit, machine: str, budget: int | None, by_ratio: bool = False) -> None:
    """Raise :class:`DoesNotFit` when the weights, the buffers or ``budget`` experts do not fit.

    ``budget=None`` asks only whether the run can start at all (non-expert weights, workspace,
    KV cache and the policy's buffers).
    """
    gb = fit.expert_bytes / 1e9
    once = fit.refund > 0  # unified memory, each expert held once
    if once:
        host = (
            f", with every expert held once ({fit.host_bytes / 1e9:.1f} GB at the host's "
            "precision) in the same unified memory"
        )
    elif fit.host_bytes:
        host = (
            f", beside the host's expert copies ({fit.host_bytes / 1e9:.1f} GB) in the same "
            "unified memory"
        )
    else:
        host = ""
    if not fit.weights_fit():
        short = -(max(fit.room(0), fit.room(fit.total_experts)) + fit.buffers * fit.expert_bytes)
        raise DoesNotFit(
            0,
            f"{machine}'s GPU cannot hold {fit.model}'s non-expert weights, workspace and KV "
            f"cache for {fit.context_tokens} tokens{host} ({short / 1e9:.1f} GB short), so no "
            "expert fits",
        )
    if not (fit.fits(0) or fit.fits(fit.total_experts)):
        raise DoesNotFit(
            0,
            f"{machine}'s GPU has room for {fit.slots} {fit.model} experts "
            f"({gb:.2f} GB each) after the non-expert weights, workspace and KV cache{host}, "
            f"fewer than the policy's {_buffers(fit.buffers)}",
        )
    if budget is not None and (budget > fit.max_experts or not fit.fits(budget)):
        limit = (
            f"--cache-ratio <= {fit.max_ratio():.3f}"
            if by_ratio
            else f"--gpu-experts <= {fit.max_experts}"
        )
        raise DoesNotFit(
            fit.max_experts,
            f"{budget} resident experts of {fit.model} ({budget * gb:.1f} GB) do not fit in "
            f"{machine}'s GPU memory: at most {fit.max_experts} experts fit ({limit}) after "
            f"non-expert weights, KV cache and {_buffers(fit.buffers)}{host}",
        )


def serving_kv_reserve(serving: ServingConfig, model: Any, context: int) -> int:
    """KV-cache tokens reserved before the expert slots are sized (docs/serving.md, "GPU
    memory"): ``--kv-cache-gb`` of them, else one mean-length sequence per batch place."""
    per_token = model.kv_bytes_per_token
    if serving.kv_cache_gb is not None:
        if per_token <= 0:
            raise UserError(f"--kv-cache-gb: model {model.name} has no KV-cache size per token")
        return int(serving.kv_cache_gb * 1e9 // per_token)
    return serving.batch * context


def _buffers(n: int) -> str:
    return f"{n} buffer" if n == 1 else f"{n} buffers"


def requested_budget(cache_ratio: float | None, gpu_experts: int | None, total: int) -> int | None:
    """The expert budget asked for (None: the most that fits): each value's own range is
    declared (simulator/run_params.py); here what needs the model's expert count."""
    if cache_ratio is not None and gpu_experts is not None:
        raise UserError("give --cache-ratio or --gpu-experts, not both")
    if cache_ratio is not None:
        return round(cache_ratio * total)
    if gpu_experts is not None and gpu_experts > total:
        raise UserError(f"--gpu-experts must be in 0..{total}, got {gpu_experts}")
    return gpu_experts
