"""The policy boundary: every hook call goes through one wrapper, every plan is checked here.

Faults are attributed by construction. :class:`Hooks` calls a policy's hooks (``setup``,
``on_sequence_start``/``end``, ``prefill_layer``, ``decode_layer``) and turns any exception
they raise into a one-line :class:`~simulator.errors.PolicyError` naming the policy, sequence,
token and layer. :func:`check_placement` and :func:`check_plan` refuse impossible or malformed
decisions *before* the engine applies anything, so every ``PolicyError`` about a plan comes from
this module, and anything raised later, inside the engine, is an engine bug that keeps its
traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from policies.base import Action, Plan, Policy, ResourceSpec, Slot
from simulator.errors import PolicyError, UserError

if TYPE_CHECKING:
    from simulator.residency import Residency

_GPU, _FETCH, _TEMP, _CPU, _PRE = (int(a) for a in Action)
_ACTIONS = frozenset(int(a) for a in Action)


class Where:
    """The point of the run a decision belongs to (sequence, token, layer)."""

    __slots__ = ("layer", "seq", "token")

    def __init__(self) -> None:
        self.seq: int | None = None
        self.token: int | None = None
        self.layer: int | None = None


class Hooks:
    """Calls a policy's hooks; an exception a hook raises becomes a ``PolicyError``.

    ``UserError`` (a bad option the policy reports) and ``PolicyError`` pass through unchanged.
    """

    __slots__ = ("name", "policy", "where")

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name or type(policy).__name__
        self.where = Where()

    def error(self, message: str, layer: int | None = None) -> PolicyError:
        """A PolicyError at the current sequence and token (and ``layer``)."""
        w = self.where
        return PolicyError(self.name, message, seq=w.seq, token=w.token, layer=layer)

    def call(self, hook: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; its exception is the policy's fault, reported as hook ``hook`` (with
        the current token and layer for the layer hooks)."""
        try:
            return fn(*args)
        except (PolicyError, UserError):
            raise
        except Exception as exc:
            raise self.fault(hook, exc) from exc

    def fault(self, hook: str, exc: Exception) -> PolicyError:
        """The PolicyError for ``exc`` raised by hook ``hook`` (callers that inline the call on
        the per-layer hot path raise this ``from exc``)."""
        text = " ".join(str(exc).split()) or "(no message)"
        w = self.where
        per_layer = hook.endswith("_layer")
        return PolicyError(
            self.name,
            f"{hook} raised {type(exc).__name__}: {text}",
            seq=w.seq,
            token=w.token if per_layer else None,
            layer=w.layer if per_layer else None,
        )


def _pair(x: Any) -> Slot | None:
    """``x`` as an int (layer, expert) pair, or None when it is not one."""
    if x.__class__ is tuple and len(x) == 2 and x[0].__class__ is int and x[1].__class__ is int:
        return x  # the common case, cheaply
    try:
        a, b = x
    except (TypeError, ValueError):
        return None
    if isinstance(a, (bool, np.bool_)) or isinstance(b, (bool, np.bool_)):
        return None
    if not isinstance(a, (int, np.integer)) or not isinstance(b, (int, np.integer)):
        return None
    return int(a), int(b)


def check_placement(
    hooks: Hooks, slots: Any, n_layers: int, n_experts: int, budget: int
) -> list[Slot]:
    """The initial placement as (layer, expert) pairs; refuses anything impossible."""
    try:
        items = list(slots)
    except TypeError:
        raise hooks.error(
            f"setup returned an invalid initial placement ({type(slots).__name__} is not "
            "a list of (layer, expert) pairs)"
        ) from None
    seen: set[Slot] = set()
    out: list[Slot] = []
    for item in items:
        p = _pair(item)
        if p is None:
            raise hooks.error(
                f"setup returned an invalid initial placement ({item!r} is not a "
                "(layer, expert) pair)"
            )
        layer, expert = p
        if not (0 <= layer < n_layers and 0 <= expert < n_experts):
            raise hooks.error(f"initial placement names ({layer}, {expert}), outside the model")
        if p in seen:
            raise hooks.error(f"initial placement names ({layer}, {expert}) twice")
        seen.add(p)
        out.append(p)
    if len(out) > budget:
        raise hooks.error(f"initial placement holds {len(out)} experts, budget is {budget}")
    return out


def check_route(hooks: Hooks, plan: Plan, n_experts: int, layer: int) -> list[int] | None:
    """A substituted decode route as a list of expert ids (None: the trace's routing)."""
    route = plan.route
    if route is None:
        return None
    arr = route if route.__class__ is np.ndarray else np.asarray(route)
    if arr.ndim != 1:
        raise hooks.error("returns a malformed route (not one-dimensional)", layer)
    if arr.size and arr.dtype.kind not in "iu":
        raise hooks.error("returns a malformed route (expert ids must be integers)", layer)
    ids = arr.tolist()
    if ids and (min(ids) < 0 or max(ids) >= n_experts):
        raise hooks.error(f"routes to expert ids outside 0..{n_experts - 1}", layer)
    if len(set(ids)) != len(ids):
        raise hooks.error("routes to the same expert twice", layer)
    if plan.raw_route is not None and np.asarray(plan.raw_route).ndim != 1:
        raise hooks.error("returns a malformed raw_route (not one-dimensional)", layer)
    return ids


def check_plan(
    hooks: Hooks,
    plan: Any,
    layer: int,
    routed: list[int],
    res: Residency,
    spec: ResourceSpec,
    precalc: Iterable[Slot],
    now: float,
) -> list[int]:
    """Refuse a plan the engine cannot apply; returns the routed experts in GPU-first order.

    The plan is checked in the order the engine applies it (evictions, then the routed experts
    with resident ones first, temporary copies, prefetches, pre-calculations) against a private
    copy of the residency changes, so a later step sees the effect of an earlier one.
    """
    if plan.__class__ is not Plan and not isinstance(plan, Plan):
        raise hooks.error(f"returned {type(plan).__name__}, expected a Plan", layer)
    if plan.low_bit:
        _check_low_bit(hooks, plan, layer, routed, spec)
    if spec.gpu_blocks is not None and (plan.prefetch or plan.precalc):
        # CPU-resident layers are timed as if nothing else used the CPU or the links then
        raise hooks.error(
            "asks for prefetches or pre-calculations, which a spec with gpu_blocks "
            "(CPU-resident layers) does not model",
            layer,
        )
    actions = plan.actions
    if spec.one_stream and (
        plan.precalc
        or (actions.__class__ is dict and any(a in (_CPU, _PRE) for a in actions.values()))
    ):
        # one stream orders the expert copies and kernels; CPU work and its activation
        # copies beside it are not modelled
        raise hooks.error(
            "runs experts on the CPU, which a spec with one_stream does not model", layer
        )
    if not (plan.evict or plan.prefetch or plan.precalc or plan.victims) and (
        actions is None or (actions.__class__ is dict and len(actions) == len(routed))
    ):
        # the common case, all routed experts resident and run on the GPU: nothing else to check
        row = res.resident[layer]
        if actions is None or all(actions.get(e) == _GPU for e in routed):
            for e in routed:
                if not row[e]:
                    raise hooks.error(f"runs expert {e} on the GPU but it is not resident", layer)
            return routed
    if not (plan.evict or plan.prefetch) and actions.__class__ is dict:
        # no explicit evictions or prefetches: one pass without the general bookkeeping
        order = _simple_actions(hooks, plan, layer, routed, res, spec, precalc, now)
        if order is not None:
            if plan.precalc:
                _check_precalc(hooks, plan.precalc, layer, res, precalc)
            return order
    err = hooks.error
    n_layers, n_experts = res.n_layers, res.n_experts
    resident = res.resident
    changed: dict[Slot, bool] = {}  # residency changes made earlier in this plan
    n_res = res.n_resident
    budget = res.budget
    actions = plan.actions

    def is_res(slot: Slot) -> bool:
        v = changed.get(slot)
        return bool(resident[slot]) if v is None else v

    if actions is None:
        needed = set(routed)
    else:
        if not isinstance(actions, dict):
            raise err(f"returned a malformed plan (actions is {type(actions).__name__})", layer)
        needed = {e for e in routed if actions.get(e) in (_GPU, _FETCH)}
    in_use_ok = spec.evicts_in_use and spec.writeback

    def evict(item: Any, what: str) -> None:
        nonlocal n_res
        slot = _pair(item)
        if slot is None:
            raise err(
                f"returned a malformed plan ({what} {item!r} is not a (layer, expert) pair)", layer
            )
        vl, ve = slot
        if not (0 <= vl < n_layers and 0 <= ve < n_experts):
            raise err(f"evicts ({vl}, {ve}), outside the model", layer)
        was = changed.get(slot)  # is_res, inlined (called for every eviction)
        if not (resident[slot] if was is None else was):
            raise err(f"evicts expert {ve} of layer {vl}, which is not resident", layer)
        in_use = vl == layer and ve in needed
        if in_use and not in_use_ok:
            raise err(f"evicts expert {ve} of layer {vl}, which this token needs", layer)
        if not in_use and (slot in changed or res.ready_at[slot] > now):
            raise err(f"evicts expert {ve} of layer {vl} while it is still being copied", layer)
        changed[slot] = False
        n_res -= 1

    def fetch(slot: Slot, victim: Any, what: str) -> None:
        nonlocal n_res
        if victim is not None:
            evict(victim, "victim")
        if n_res >= budget:
            raise err(
                f"{what} expert {slot[1]} of layer {slot[0]} with all {budget} slots full "
                "and no victim",
                layer,
            )
        changed[slot] = True
        n_res += 1

    if not isinstance(plan.evict, list) or not isinstance(plan.prefetch, list):
        raise err("returned a malformed plan (evict and prefetch must be lists)", layer)
    for item in plan.evict:
        evict(item, "evict entry")
    if actions is None:
        order = routed
        for e in routed:
            if not is_res((layer, e)):
                raise err(f"runs expert {e} on the GPU but it is not resident", layer)
    else:
        for a in actions.values():
            if a not in _ACTIONS:
                bad = next(e for e, x in actions.items() if x is a)
                raise err(f"returns unknown action {a!r} for expert {bad}", layer)
        # hits are judged before this layer's insertions: resident experts first
        order = [e for e in routed if actions.get(e) == _GPU] + [
            e for e in routed if actions.get(e) != _GPU
        ]
        victims = plan.victims
        pre = set(precalc)
        temps = 0
        for e in order:
            a = actions.get(e)
            if a is None:
                raise err(f"gives no action for routed expert {e}", layer)
            slot = (layer, e)
            if a == _GPU:
                if not is_res(slot):
                    raise err(f"runs expert {e} on the GPU but it is not resident", layer)
            elif a == _FETCH:
                if is_res(slot):
                    raise err(f"fetches expert {e}, which is already resident", layer)
                fetch(slot, victims.get(e), "fetches")
            elif a == _TEMP:
                if is_res(slot):
                    raise err(f"copies expert {e} to a temporary buffer but it is resident", layer)
                temps += 1
            elif a == _PRE and slot not in pre:
                raise err(
                    f"uses a CPU pre-calculation of expert {e} that was never submitted", layer
                )
        if len(actions) != len(routed):
            extra = sorted(set(actions) - set(routed))
            raise err(f"gives actions for experts {extra} that are not routed", layer)
        if temps and spec.temp_buffers < 1:
            raise err("copies to a temporary buffer but declares temp_buffers = 0", layer)
    for item in plan.prefetch:
        try:
            pl, pe, victim = item
        except (TypeError, ValueError):
            raise err(
                f"returned a malformed plan (prefetch entry {item!r} is not "
                "(layer, expert, victim))",
                layer,
            ) from None
        slot = _pair((pl, pe))
        if slot is None:
            raise err(f"returned a malformed plan (prefetch entry {item!r})", layer)
        pl, pe = slot
        if not (0 <= pl < n_layers and 0 <= pe < n_experts):
            raise err(f"prefetches ({pl}, {pe}), outside the model", layer)
        if is_res(slot):
            raise err(f"prefetches expert {pe} of layer {pl}, already resident", layer)
        fetch(slot, victim, "prefetches")
    if plan.precalc:
        _check_precalc(hooks, plan.precalc, layer, res, precalc)
    return order


def _check_low_bit(
    hooks: Hooks, plan: Plan, layer: int, routed: list[int], spec: ResourceSpec
) -> None:
    """``Plan.low_bit`` names routed TEMP copies, on a system that holds low-bit copies."""
    if spec.low_bit_dtype is None:
        raise hooks.error(
            "names low-bit copies (Plan.low_bit) but its resources declare no low_bit_dtype",
            layer,
        )
    actions = plan.actions or {}
    for e in plan.low_bit:
        if e not in routed or actions.get(e) != _TEMP:
            raise hooks.error(
                f"names expert {e} as a low-bit copy but it is not a TEMP copy", layer
            )


def _simple_actions(
    hooks: Hooks,
    plan: Plan,
    layer: int,
    routed: list[int],
    res: Residency,
    spec: ResourceSpec,
    precalc: Iterable[Slot],
    now: float,
) -> list[int] | None:
    """``check_plan`` for a plan whose only slot changes are this layer's fetches (with victims
    in this layer); returns the GPU-first order, or None to leave the plan to the general check.

    It checks in the same order and with the same messages as the general check: the GPU
    experts first, then the others in routing order.
    """
    actions = plan.actions
    assert actions is not None
    row = res.resident[layer]
    gpu: list[int] = []
    rest: list[int] = []
    for e in routed:
        a = actions.get(e)
        if a == _GPU:
            if not row[e]:
                raise hooks.error(f"runs expert {e} on the GPU but it is not resident", layer)
            gpu.append(e)
        elif a in _ACTIONS:
            rest.append(e)
        else:
            return None  # unknown or missing: the general check reports it
    temps = 0
    gone: set[int] = set()  # evicted earlier in this plan
    added: set[int] = set()  # fetched earlier in this plan
    needed: set[int] | None = None
    n_res = res.n_resident
    victims = plan.victims
    for e in rest:
        a = actions[e]
        if a == _CPU:
            continue
        if a == _PRE:
            if (layer, e) not in precalc:
                raise hooks.error(
                    f"uses a CPU pre-calculation of expert {e} that was never submitted", layer
                )
            continue
        here = e in added or (row[e] and e not in gone)
        if a == _TEMP:
            if here:
                raise hooks.error(
                    f"copies expert {e} to a temporary buffer but it is resident", layer
                )
            temps += 1
            continue
        # FETCH
        if here:
            raise hooks.error(f"fetches expert {e}, which is already resident", layer)
        v = victims.get(e)
        if v is not None:
            if not (v.__class__ is tuple and len(v) == 2 and v[0] == layer):
                return None  # another layer's slot or a malformed victim: the general check
            ve = v[1]
            if ve.__class__ is not int or not 0 <= ve < res.n_experts:
                return None
            if ve in added:
                return None  # evicting what this plan fetches: the general check words it
            if not row[ve] or ve in gone:
                raise hooks.error(
                    f"evicts expert {ve} of layer {layer}, which is not resident", layer
                )
            if needed is None:
                needed = {x for x in routed if actions.get(x) in (_GPU, _FETCH)}
            if ve in needed:
                if not (spec.evicts_in_use and spec.writeback):
                    raise hooks.error(
                        f"evicts expert {ve} of layer {layer}, which this token needs", layer
                    )
            elif res.ready_at[layer, ve] > now:
                raise hooks.error(
                    f"evicts expert {ve} of layer {layer} while it is still being copied", layer
                )
            gone.add(ve)
            n_res -= 1
        if n_res >= res.budget:
            raise hooks.error(
                f"fetches expert {e} of layer {layer} with all {res.budget} slots full "
                "and no victim",
                layer,
            )
        added.add(e)
        n_res += 1
    if len(actions) != len(routed):
        extra = sorted(set(actions) - set(routed))
        raise hooks.error(f"gives actions for experts {extra} that are not routed", layer)
    if temps and spec.temp_buffers < 1:
        raise hooks.error("copies to a temporary buffer but declares temp_buffers = 0", layer)
    return gpu + rest


def _check_precalc(
    hooks: Hooks, items: Any, layer: int, res: Residency, precalc: Iterable[Slot]
) -> None:
    """Pre-calculations must name coming layers of this token, each once."""
    seen = set(precalc)
    for item in items:
        slot = _pair(item)
        if slot is None:
            raise hooks.error(f"returned a malformed plan (precalc entry {item!r})", layer)
        pl, pe = slot
        if not (layer < pl < res.n_layers and 0 <= pe < res.n_experts):
            raise hooks.error(f"pre-calculates ({pl}, {pe}): must be a coming layer", layer)
        if slot in seen:
            raise hooks.error(f"pre-calculates expert {pe} of layer {pl} twice", layer)
        seen.add(slot)
