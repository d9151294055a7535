"""Ranking the rows ``daopsim advise`` found: identical results grouped as one row with the reason
(:func:`tie_reason`), the order by tokens/s, the best row of each precision and, with a target,
each machine's best and the cheapest machine that reaches it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from daopsim.simulator.advise_answer import Advice, AdviceRow, MachineAnswer


# -- ranking, ties, the target ----------------------------------------------------------------
def _result_key(r: AdviceRow) -> tuple[Any, ...]:
    """What two rows must share to tie: machine, precision, runtime and every result shown."""
    return (r.hw, r.dtype, r.runtime, r.tokens_per_s, r.ttft_s, r.gate_mass_preserved, r.fidelity)


def tie_reason(group: list[AdviceRow], shape: Any) -> str:
    """Why the configurations of ``group`` (identical results) tie, in one line."""
    from daopsim.policies.caching import CachingPolicy
    from daopsim.policies.registry import get_policy_class

    total = shape.total_experts
    one_policy = len({r.policy for r in group}) == 1
    if all(r.resident_experts >= total for r in group):
        what = "these option values do not matter" if one_policy else "the policy does not matter"
        return f"every expert fits and stays resident: {what}"
    per_layer = min(r.gpu_experts for r in group) // max(1, shape.moe_layers)
    caches = all(
        issubclass(get_policy_class(r.policy), CachingPolicy) for r in group if _is_name(r.policy)
    )
    if caches and per_layer <= shape.top_k:
        return (
            f"at most top-k ({shape.top_k}) experts per layer: per-layer caches hold only the "
            "last token's experts, so they cannot differ"
        )
    if one_policy:
        return "these option values do not change this policy's decisions here"
    return "these policies make the same decisions here"


def _is_name(policy: str) -> bool:
    from daopsim.policies.registry import is_policy_file

    return not is_policy_file(policy)


def _rank(
    advice: Advice,
    rows: list[AdviceRow],
    min_gate_mass: float | None,
    min_tokens_per_s: float | None,
    prices: dict[str, float] | None,
    shape: Any,
) -> None:
    """Floors, ranking, tie groups, the best row per precision, the machines' answers."""
    refs = [r for r in rows if r.reference]
    ranked = _unique_rows(rows)
    if min_gate_mass is not None:
        kept = [r for r in ranked if (r.gate_mass_preserved or 0.0) >= min_gate_mass]
        advice.below_floor = len(ranked) - len(kept)
        ranked = kept
    everything = list(ranked)
    if min_tokens_per_s is not None:
        kept = [r for r in ranked if r.tokens_per_s >= min_tokens_per_s]
        advice.below_target = len(ranked) - len(kept)
        ranked = kept
    ranked.sort(key=_rank_order)
    leaders = _tie_groups(ranked, shape)
    leaders.sort(key=_rank_order)
    for i, r in enumerate(leaders, 1):
        r.rank = i
    advice.rows = leaders
    advice.references = sorted(refs, key=lambda r: (r.hw, -r.tokens_per_s, r.policy, r.dtype))
    advice.best_per_precision.extend(_best_per_precision(leaders))
    _machines(advice, everything, leaders, min_tokens_per_s, prices)
    _notes(advice, leaders, shape)


def _unique_rows(rows: list[AdviceRow]) -> list[AdviceRow]:
    """The searched rows (not the references), one per distinct result of a configuration: a
    budget the policy does not use gives the largest budget's results again, and that one is
    kept."""
    # the largest budget first: its row stands for a smaller budget that changes nothing
    ranked = sorted((r for r in rows if not r.reference), key=lambda r: r.cache_ratio is not None)
    unique: dict[tuple[Any, ...], AdviceRow] = {}
    for r in ranked:
        ident = (r.hw, r.policy, r.runtime, r.dtype, r.options_text, _result_key(r))
        unique.setdefault(ident, r)
    return list(unique.values())


def _rank_order(r: AdviceRow) -> tuple[Any, ...]:
    """The ranking key: tokens/s first, then fidelity, gate mass, TTFT, fewer resident experts;
    among equal results the shortest command leads (fewer options, the default budget)."""
    return (
        -r.tokens_per_s,
        -(r.fidelity if r.fidelity is not None else -1.0),
        -(r.gate_mass_preserved if r.gate_mass_preserved is not None else -1.0),
        r.ttft_s,
        r.resident_experts,
        len(r.options),
        r.cache_ratio is not None,
        r.hw,
        r.policy,
        r.runtime,
        r.dtype,
        r.options_text,
    )


def _tie_groups(ranked: list[AdviceRow], shape: Any) -> list[AdviceRow]:
    """The leader of each group of rows with the same results (in ``ranked``'s order), the
    others listed on it as tied, with the reason they tie."""
    groups: dict[tuple[Any, ...], list[AdviceRow]] = {}
    for r in ranked:
        groups.setdefault(_result_key(r), []).append(r)
    leaders = []
    for group in groups.values():
        lead = group[0]
        if len(group) > 1:
            lead.tied = [
                {
                    "policy": r.policy,
                    "options": r.options,
                    "cache_ratio": r.cache_ratio,
                    "command": r.command,
                }
                for r in group[1:]
            ]
            lead.tie_reason = tie_reason(group, shape)
        leaders.append(lead)
    return leaders


def _best_per_precision(leaders: list[AdviceRow]) -> list[dict[str, Any]]:
    """The best ranked row of each (machine, precision), in rank order."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()
    for r in leaders:
        if (r.hw, r.dtype) not in seen:
            seen.add((r.hw, r.dtype))
            out.append(
                {
                    "hw": r.hw,
                    "dtype": r.dtype,
                    "rank": r.rank,
                    "tokens_per_s": r.tokens_per_s,
                    "fidelity": r.fidelity,
                    "gate_mass_preserved": r.gate_mass_preserved,
                    "policy": r.policy,
                    "runtime": r.runtime,
                    "command": r.command,
                }
            )
    return out


def _machines(
    advice: Advice,
    everything: list[AdviceRow],
    leaders: list[AdviceRow],
    target: float | None,
    prices: dict[str, float] | None,
) -> None:
    """Each machine's best row and, with a target, the cheapest machine that reaches it."""
    prices = prices or {}
    ranks = {id(r): r.rank for r in leaders}
    for h in advice.hw.split(","):
        mine = [r for r in everything if r.hw == h]
        best = max(mine, key=lambda r: r.tokens_per_s, default=None)
        advice.machines.append(
            MachineAnswer(
                hw=h,
                best_tokens_per_s=best.tokens_per_s if best else None,
                best_rank=ranks.get(id(best)) if best else None,
                best_command=best.command if best else None,
                meets_target=None if target is None else bool(best and best.tokens_per_s >= target),
                price=prices.get(h),
                tokens_per_kj=best.tokens_per_kj if best else None,
            )
        )
    if target is None:
        return
    if prices and len(prices) == len(advice.machines):
        advice.order = "price (--price)"
        key: Callable[[MachineAnswer], Any] = lambda m: (m.price, -(m.best_tokens_per_s or 0))  # noqa: E731
    else:
        advice.order = (
            "energy per generated token, tokens/kJ; --price for every machine orders by price"
        )
        key = lambda m: (-(m.tokens_per_kj or 0.0), -(m.best_tokens_per_s or 0))  # noqa: E731
    meeting = sorted((m for m in advice.machines if m.meets_target), key=key)
    rest = sorted(
        (m for m in advice.machines if not m.meets_target),
        key=lambda m: -(m.best_tokens_per_s or 0.0),
    )
    advice.machines = meeting + rest
    advice.answer = meeting[0].hw if meeting else None


def _notes(advice: Advice, leaders: list[AdviceRow], shape: Any) -> None:
    """One-line notes on what the ranking says and does not say."""
    top = leaders[:3]
    resident = bool(top) and all(r.resident_experts >= shape.total_experts for r in top)
    if resident and advice.runtimes is None and len({r.runtime for r in top}) > 1:
        advice.notes.append(
            "the best rows keep every expert resident: they differ by runtime, not by "
            "policy; --runtime NAME compares the policies under one runtime"
        )
    lossy = [r for r in leaders if r.fidelity == 0.0]
    if lossy:
        advice.notes.append(
            "fidelity 0 marked ~: experts at a lossy precision compute approximately (how much "
            "accuracy that costs is not modelled); ~ shows the routing's gate mass kept"
        )
