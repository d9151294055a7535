"""Shared machinery for replacement-cache policies (LRU, LFU, round-robin, Belady, ...).

Two cache shapes: :class:`CachingPolicy` (one cache per layer, each with its quota of the budget)
and :class:`GlobalCachingPolicy` (one cache over every ``(layer, expert)`` slot of the model).

A per-layer caching policy keeps, per layer, a set of resident experts of fixed capacity (a
per-layer quota of the budget). On a miss it fetches the expert into a slot, evicting a victim
that the subclass picks with :meth:`CachingPolicy.choose_victim`; a victim is never one of the
experts the same token needs in that layer (so the k experts of a token are served together).
A layer whose quota is smaller than the experts it needs at once serves the overflow from a
temporary buffer. Subclasses implement ``choose_victim`` and, if they keep statistics, ``touch``.

A global caching policy serves a token's experts by the same rule (hits judged before the
layer's insertions, a victim never one of the experts the same token needs in this layer), but
its victim may be a resident expert of ANY layer, so a layer may hold anywhere from none to all
of its experts.

Neither keeps a residency of its own: what is resident is the engine's (``View.resident``),
read at each decision, with the decision's own changes (the fetches, victims and prefetches
of the plan being built, which the engine applies once the plan is returned) laid over it
until the next decision. A subclass keeps only its order (recency, counts, scores) through
the hooks, and its victim is one of the engine's resident experts.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any, Final

import numpy as np

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import Action, Plan, Policy, SetupContext, Slot, View
from daopsim.policies.options import Param
from daopsim.policies.placement import per_layer_quota
from daopsim.simulator.errors import UserError
from daopsim.simulator.models import ModelShape

GPU: Final = Action.GPU
FETCH: Final = Action.FETCH
TEMP: Final = Action.TEMP


def per_layer_initial(ctx: SetupContext, mode: str, quota: list[int]) -> list[Slot]:
    """Each layer's quota of its first (or, ``popular``, most selected) experts, layer by layer.

    ``popular`` ranks by the calibration counts, ties to the lower expert id.
    """
    if mode == "empty":
        return []
    n_exp = ctx.model.experts
    slots: list[Slot] = []
    for layer, q in enumerate(quota):
        q = min(q, n_exp)
        if mode == "popular" and ctx.calibration is not None:
            order = np.lexsort((np.arange(n_exp), -ctx.calibration[layer]))[:q]
        else:
            order = np.arange(q)
        slots.extend((layer, int(e)) for e in order.tolist())
    return slots


def global_initial(ctx: SetupContext, mode: str, capacity: int) -> list[Slot]:
    """A shared cache's initial contents: ``popular`` = the ``capacity`` slots with the highest
    calibration counts over all layers (ties to the lower layer, then expert), otherwise the
    per-layer placement of ``mode`` with the capacity split evenly over the layers."""
    if mode == "popular" and ctx.calibration is not None:
        n_exp = ctx.model.experts
        flat = np.asarray(ctx.calibration, dtype=np.float64).reshape(-1)
        top = np.lexsort((np.arange(flat.size), -flat))[: min(capacity, flat.size)]
        return sorted((int(i) // n_exp, int(i) % n_exp) for i in top.tolist())
    return per_layer_initial(ctx, mode, per_layer_quota(capacity, ctx.model.moe_layers))


@mypyc_attr(allow_interpreted_subclasses=True)
class _FetchOnMiss(Policy):
    """What both cache shapes share: the ``initial`` option, when it needs calibration, and
    the engine's residency as a decision sees it.

    Residency is the engine's alone. At a decision the policy reads a layer's row of
    ``View.resident`` once, as a list, and lays the plan's own changes over it as it builds
    the plan (:meth:`_admit`, :meth:`_evict`); the next decision (another step or layer)
    starts again from the engine's rows, which by then hold what the plan did.
    """

    params = {
        "initial": Param(
            str,
            "first",
            "initial contents: 'first' experts of each layer "
            "(data-blind) or 'popular' by calibration counts",
            choices=("first", "popular", "empty"),
        ),
    }

    #: the view of the decision being served (one object the engine reuses), its step and
    #: layer; per layer, once read in this decision, the engine's row with the decision's
    #: changes (None: not read) and how many of its experts that row holds; the layers read
    _view: View | None = None
    _at_step: int = -1
    _at_layer: int = -1
    _rows: list[list[bool] | None]
    _held: list[int]
    _read: list[int]
    #: resident experts over every layer in the engine at this decision (-1: not counted
    #: yet), and the net change the plan being built has made to it
    _total: int = -1
    _changed: int = 0

    def uses_calibration(self) -> bool:
        """Calibration counts are read only for ``initial='popular'`` (or when the class says
        it always needs them)."""
        return self.needs_calibration or self.options.get("initial") == "popular"

    def _mode(self, ctx: SetupContext) -> str:
        mode = str(self.options.get("initial", "first"))
        if mode == "popular" and ctx.calibration is None:
            raise UserError(f"policy {self.name!r}: initial='popular' needs calibration counts")
        return mode

    def _forget_decision(self, n_layers: int) -> None:
        """No decision yet (``setup``): nothing read from the engine."""
        self._view = None
        self._at_step = self._at_layer = -1
        self._rows = [None] * n_layers
        self._held = [0] * n_layers
        self._read = []
        self._total = -1
        self._changed = 0

    def _decide(self, view: View) -> None:
        """``view`` is the decision being served: a new decision (another step or layer, or
        another view) starts from the engine's residency again."""
        if view is not self._view or view.step != self._at_step or view.layer != self._at_layer:
            self._view = view
            self._at_step = view.step
            self._at_layer = view.layer
            rows = self._rows
            for layer in self._read:
                rows[layer] = None
            self._read.clear()
            self._total = -1
            self._changed = 0

    def _row(self, layer: int) -> list[bool]:
        """``layer``'s residency in the decision being served: the engine's row with the
        decision's own changes."""
        view = self._view
        if view is None:
            raise RuntimeError("residency is read during a decision (the engine's View)")
        if view.step != self._at_step or view.layer != self._at_layer:
            self._decide(view)
        row = self._rows[layer]
        if row is None:
            row = view.resident[layer].tolist()
            self._rows[layer] = row
            self._held[layer] = row.count(True)
            self._read.append(layer)
        return row

    def is_resident(self, layer: int, expert: int) -> bool:
        """Whether ``(layer, expert)`` is resident in the decision being served (the engine's
        residency with the plan's own fetches, victims and prefetches so far)."""
        return self._row(layer)[expert]

    def residents(self, layer: int) -> list[int]:
        """``layer``'s resident experts in the decision being served, by ascending id (the
        engine's residency with the plan's own changes so far)."""
        row = self._row(layer)
        return [e for e in range(len(row)) if row[e]]

    def occupied(self, layer: int) -> int:
        """How many experts of ``layer`` are resident in the decision being served."""
        self._row(layer)
        return self._held[layer]

    def _resident_total(self) -> int:
        """Resident experts over every layer in the decision being served."""
        if self._view is not None and (
            self._view.step != self._at_step or self._view.layer != self._at_layer
        ):
            self._decide(self._view)
        if self._total < 0:
            view = self._view
            if view is None:
                raise RuntimeError("residency is read during a decision (the engine's View)")
            self._total = int(np.count_nonzero(view.resident))  # the engine's, once
        return self._total + self._changed

    def _mark(self, layer: int, expert: int, on: bool) -> None:
        """The plan being built puts ``(layer, expert)`` in (``on``) or out of the GPU."""
        row = self._row(layer)
        row[expert] = on
        step = 1 if on else -1
        self._held[layer] += step
        self._changed += step


class _Residents:
    """``policy.cache[layer]``: the layer's resident experts in the decision being served
    (:meth:`CachingPolicy.residents`), read from the engine, never stored."""

    def __init__(self, policy: CachingPolicy) -> None:
        self.policy = policy

    def __getitem__(self, layer: int) -> list[int]:
        return self.policy.residents(layer)


@mypyc_attr(allow_interpreted_subclasses=True)
class CachingPolicy(_FetchOnMiss):
    """Per-layer fetch-on-miss cache; subclasses choose victims.

    State subclasses may read: :meth:`residents` (a layer's resident experts, the engine's,
    by ascending id; also ``cache[layer]``), :meth:`is_resident`, :meth:`occupied`,
    ``quota[layer]`` (the layer's capacity) and ``evicts_in_use`` (the spec's flag). The hooks
    (docs/policy-api.md, "Hooks of the cache base classes"): :meth:`init_state`,
    :meth:`touch`, :meth:`inserted`, :meth:`removed`, :meth:`choose_victim`,
    :meth:`unevictable`, and :meth:`serve` for a subclass that serves some experts its own way.
    """

    model: ModelShape
    evicts_in_use: bool
    quota: list[int]

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """Fill each layer's quota with its first (or most popular) experts."""
        self.model = ctx.model
        self.evicts_in_use = self.resources().evicts_in_use
        n_layers = ctx.model.moe_layers
        self.quota = per_layer_quota(ctx.budget, n_layers)
        self._forget_decision(n_layers)
        self.init_state(ctx)
        slots = per_layer_initial(ctx, self._mode(ctx), self.quota)
        for layer, e in slots:
            self.inserted(layer, e, -1)
        return slots

    @property
    def cache(self) -> _Residents:
        """``cache[layer]``: :meth:`residents` of the layer (the engine's, by ascending id)."""
        return _Residents(self)

    def init_state(self, ctx: SetupContext) -> None:
        """Create per-policy statistics (called once by setup, before the initial placement)."""

    def touch(self, layer: int, expert: int, step: int, weight: int) -> None:
        """A resident expert was used (``weight`` tokens)."""

    def inserted(self, layer: int, expert: int, step: int) -> None:
        """An expert entered the cache."""

    def removed(self, layer: int, expert: int) -> None:
        """An expert left the cache."""

    def choose_victim(self, layer: int, protected: set[int], step: int) -> int:
        """The resident expert of ``layer`` to evict (never one in ``protected``)."""
        raise NotImplementedError

    def unevictable(self, layer: int) -> set[int] | None:
        """Resident experts of ``layer`` that must not be evicted now (e.g. still in flight)."""
        return None

    def _admit(self, layer: int, expert: int, step: int) -> None:
        """The plan being built puts ``expert`` in the layer's slots (then :meth:`inserted`)."""
        self._mark(layer, expert, True)
        self.inserted(layer, expert, step)

    def _evict(self, layer: int, expert: int) -> None:
        """The plan being built takes ``expert`` out of the layer's slots (then
        :meth:`removed`)."""
        self._mark(layer, expert, False)
        self.removed(layer, expert)

    def _prefetch_into(
        self, plan: Plan, layer: int, expert: int, keep: set[int], step: int
    ) -> bool:
        """Prefetch ``expert`` into ``layer``'s cache: when the layer is full, the resident
        :meth:`choose_victim` picks outside ``keep`` leaves first, and the prefetch names it in
        ``plan.prefetch``. False, with nothing done, when every resident is in ``keep``."""
        row = self._row(layer)
        victim: Slot | None = None
        if self._held[layer] >= self.quota[layer]:
            if not _any_outside(row, keep):
                return False
            out = self.choose_victim(layer, keep, step)
            self._evict(layer, out)
            victim = (layer, out)
        self._admit(layer, expert, step)
        plan.prefetch.append((layer, expert, victim))
        return True

    def decode_layer(self, view: View) -> Plan:
        """Hits run on the GPU; misses are fetched (evicting a victim) or use a temp buffer."""
        return self.serve(view, view.experts.tolist())

    def serve(self, view: View, experts: list[int]) -> Plan:
        """:meth:`decode_layer` for ``experts`` of the layer (a subclass may serve the others
        its own way): hits, then fetches with victims never among ``experts``, or TEMP."""
        layer = view.layer
        step = view.step
        counts = view.counts
        self._decide(view)
        resident = self._row(layer)
        actions: dict[int, Action] = {}
        misses: list[int] = []
        for e in experts:
            if resident[e]:
                actions[e] = GPU
                self.touch(layer, e, step, 1 if counts is None else int(counts[e]))
            else:
                misses.append(e)
        plan = Plan(actions=actions)
        if not misses:
            return plan
        protected = set(experts)
        extra = self.unevictable(layer)
        if extra:
            protected |= extra
        capacity = self.quota[layer]
        for e in misses:
            if self._held[layer] >= capacity:
                victim = self._victim(layer, protected, extra, step)
                if victim is None:
                    actions[e] = TEMP  # the quota cannot hold all experts this token needs
                    continue
                self._evict(layer, victim)
                plan.victims[e] = (layer, victim)
            actions[e] = FETCH
            self._admit(layer, e, step)
            self.touch(layer, e, step, 1 if counts is None else int(counts[e]))
        return plan

    def _victim(
        self, layer: int, protected: set[int], extra: set[int] | None, step: int
    ) -> int | None:
        """:meth:`choose_victim` among the residents outside ``protected``; with none, and
        in-use evictions allowed, among those outside ``extra`` (the swap-out of an expert this
        token already uses, computed before it leaves); None when there is no candidate."""
        row = self._row(layer)
        if not _any_outside(row, protected):
            if not self.evicts_in_use:
                return None
            protected = set(extra) if extra else set()
            if not _any_outside(row, protected):
                return None
        returned = _asked(self, layer, protected, step)
        victim = _expert_id(returned)
        if victim is None or not 0 <= victim < len(row) or not row[victim] or victim in protected:
            # a plugin's choose_victim broke its contract: say so, not a malformed plan later
            # (1.0 and True compare equal to the resident expert 1)
            candidates = [x for x in range(len(row)) if row[x] and x not in protected]
            raise ValueError(
                f"choose_victim returned {returned!r} for layer {layer}, which is not an "
                f"evictable resident expert id (an int; candidates: {candidates})"
            )
        return victim


def _any_outside(row: list[bool], kept: set[int]) -> bool:
    """Whether ``row`` holds a resident expert outside ``kept``."""
    # a loop, not any(generator): compiled, a generator is an object per call
    for e in range(len(row)):  # noqa: SIM110
        if row[e] and e not in kept:
            return True
    return False


@mypyc_attr(allow_interpreted_subclasses=True)
class GlobalCachingPolicy(_FetchOnMiss):
    """One fetch-on-miss cache over every ``(layer, expert)`` slot; subclasses choose victims.

    Capacity: the whole budget, shared by all layers (no per-layer quota). Initial contents:
    ``first`` is the per-layer caches' placement (each layer's even share of its first experts,
    so both shapes start alike); ``popular`` the ``budget`` slots with the highest calibration
    counts over all layers (ties to the lower layer, then expert); ``empty`` nothing.

    Serving rule, as for the per-layer caches: the token's resident experts of this layer are
    hits (touched first); each miss is then fetched, evicting the slot ``choose_victim`` picks
    once the cache is full. The victim may be in any layer but is never an expert this token
    needs in this layer; when every resident slot is one of those, the miss goes through a
    temporary buffer and is not cached. These policies never prefetch, so every resident expert
    was copied for an earlier layer that waited for it: no victim is ever still in flight.

    What subclasses may read: :meth:`is_resident` and :meth:`residents` (the engine's
    residency with the plan's own changes), ``cached`` (the same as a ``[layers, experts]``
    mask, built when read), :meth:`size` and ``capacity`` (the budget). The hooks:
    :meth:`init_state`, :meth:`touch`, :meth:`inserted`, :meth:`removed`,
    :meth:`choose_victim`, and :meth:`serve` for a subclass that serves some experts its own
    way.
    """

    params = {
        "initial": Param(
            str,
            "first",
            "initial contents: 'first' experts of each layer (an even share, data-blind), "
            "'popular' = the budget's most selected slots over all layers by calibration counts",
            choices=("first", "popular", "empty"),
        ),
    }

    model: ModelShape
    capacity: int

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        """Place the initial contents (see the class docstring)."""
        self.model = ctx.model
        self.capacity = int(ctx.budget)
        self._forget_decision(ctx.model.moe_layers)
        self.init_state(ctx)
        slots = global_initial(ctx, self._mode(ctx), self.capacity)
        for layer, e in slots:
            self.inserted(layer, e, -1)
        return slots

    @property
    def cached(self) -> np.ndarray:
        """The ``[layers, experts]`` residency mask of the decision being served (a new array
        each time: the engine's with the plan's own changes)."""
        view = self._view
        if view is None:
            raise RuntimeError("residency is read during a decision (the engine's View)")
        self._row(view.layer)  # a new decision drops the last one's rows
        mask = np.array(view.resident, dtype=bool)
        for layer in self._read:
            mask[layer] = self._rows[layer]
        return mask

    def size(self) -> int:
        """Resident slots in the decision being served."""
        return self._resident_total()

    def init_state(self, ctx: SetupContext) -> None:
        """Create per-policy statistics (called once by setup, before the initial placement)."""

    def touch(self, layer: int, expert: int, step: int, weight: int) -> None:
        """A resident expert was used (``weight`` tokens)."""

    def inserted(self, layer: int, expert: int, step: int) -> None:
        """An expert entered the cache."""

    def removed(self, layer: int, expert: int) -> None:
        """An expert left the cache."""

    def choose_victim(self, layer: int, protected: set[int], step: int) -> Slot:
        """The resident slot to evict: any layer's, but not ``(layer, e)`` for ``e`` in
        ``protected`` (the caller guarantees one exists)."""
        raise NotImplementedError

    def _admit(self, layer: int, expert: int, step: int) -> None:
        """The plan being built puts (layer, expert) on the GPU (then :meth:`inserted`)."""
        self._mark(layer, expert, True)
        self.inserted(layer, expert, step)

    def _evict(self, slot: Slot) -> None:
        """The plan being built takes ``slot`` off the GPU (then :meth:`removed`)."""
        layer, expert = slot
        self._mark(layer, expert, False)
        self.removed(layer, expert)

    def decode_layer(self, view: View) -> Plan:
        """Hits run on the GPU; misses are fetched (evicting a victim of any layer) or use a
        temporary buffer when only this token's experts are resident."""
        return self.serve(view, view.experts.tolist())

    def serve(self, view: View, experts: list[int]) -> Plan:
        """:meth:`decode_layer` for ``experts`` of the layer (see the class docstring)."""
        layer = view.layer
        step = view.step
        counts = view.counts
        self._decide(view)
        row = self._row(layer)
        actions: dict[int, Action] = {}
        misses: list[int] = []
        for e in experts:
            if row[e]:
                actions[e] = GPU
                self.touch(layer, e, step, 1 if counts is None else int(counts[e]))
            else:
                misses.append(e)
        plan = Plan(actions=actions)
        if not misses:
            return plan
        protected = set(experts)
        shape = (len(self._view.resident), len(row))  # type: ignore[union-attr]
        for e in misses:
            size = self._resident_total()
            if size < self.capacity:
                pass
            elif size <= len(protected) and size == sum(1 for x in protected if row[x]):
                actions[e] = TEMP  # every resident slot holds an expert this token needs
                continue
            else:
                returned = _asked(self, layer, protected, step)
                ok = _slot(returned, shape)
                if (
                    ok is None
                    or not self.is_resident(ok[0], ok[1])
                    or (ok[0] == layer and ok[1] in protected)
                ):
                    # a plugin's choose_victim broke its contract: say so, not a KeyError later
                    raise ValueError(
                        f"choose_victim returned {returned!r} for layer {layer}, which is not an "
                        "evictable resident (layer, expert) slot (resident, and not one of this "
                        "token's experts at this layer)"
                    )
                self._evict(ok)
                plan.victims[e] = ok
            actions[e] = FETCH
            self._admit(layer, e, step)
            self.touch(layer, e, step, 1 if counts is None else int(counts[e]))
        return plan


def _asked(policy: Any, layer: int, protected: set[int], step: int) -> object:
    """What ``policy.choose_victim`` (perhaps a user's) returns, taken as any object: looked up
    and called through Python's generic protocol, so that a compiled caller does not convert it
    to the declared type first (a float, a bool or a NumPy integer would fail there with a bare
    TypeError in the compiled build and pass in the pure one); the caller checks it."""
    return policy.choose_victim(layer, protected, step)


def _expert_id(x: object) -> int | None:
    """``x`` as an expert id (an int or a NumPy integer, not a bool), or None when it is not one."""
    # a tuple, not ``bool | np.bool_``: compiled, the union is a new object at every call
    if isinstance(x, (bool, np.bool_)):
        return None
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        return None


def _slot(x: object, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``x`` as a (layer, expert) pair inside ``shape``, or None when it is not one."""
    pair: Any = x
    try:
        a, b = pair
    except (TypeError, ValueError):
        return None
    if isinstance(a, bool) or isinstance(b, bool):
        return None
    try:
        i, j = operator.index(a), operator.index(b)
    except TypeError:
        return None
    return (i, j) if 0 <= i < shape[0] and 0 <= j < shape[1] else None


class PendingCopies:
    """The slots a policy prefetched whose copies have not landed yet, by the engine's account.

    The engine says when each resident expert's copy lands (``View.ready``): a prefetched slot
    is pending until then. A policy calls :meth:`begin` at each decision, which drops the slots
    whose copy has landed, :meth:`prefetch` for each prefetch it issues (pending until the
    engine has applied the plan and says otherwise) and :meth:`forget` when a slot leaves its
    cache. :attr:`pending` maps each pending slot to its prefetch's number (issue order); a
    policy keeps its victims out of it (an expert still being copied is not worth evicting).
    """

    def __init__(self) -> None:
        self.issued = 0  #: prefetches issued so far
        self.pending: dict[Slot, int] = {}  #: slot -> its prefetch's number

    def begin(self, view: View) -> None:
        """A new decision: the slots whose copy has landed by ``view.now`` are no longer
        pending."""
        if self.pending:
            ready_at = view.ready.item  # type: ignore[union-attr]
            now = view.now
            self.pending = {s: n for s, n in self.pending.items() if ready_at(s[0], s[1]) > now}

    def prefetch(self, slot: Slot) -> None:
        """A prefetch of ``slot`` issued."""
        self.issued += 1
        self.pending[slot] = self.issued

    def forget(self, slot: Slot) -> None:
        """``slot`` left the cache (its prefetch no longer matters)."""
        self.pending.pop(slot, None)

    def in_layer(self, layer: int) -> set[int] | None:
        """The pending experts of ``layer`` (None: nothing is pending)."""
        if not self.pending:
            return None
        return {e for (pl, e) in self.pending if pl == layer}
