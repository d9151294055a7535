"""The policy boundary: every hook call goes through one wrapper, every plan is checked here.

Faults are attributed by construction. :class:`Hooks` calls a policy's hooks (``setup``,
``on_sequence_start``/``end``, ``prefill_layer``, ``decode_layer``) and turns any exception
they raise into a one-line :class:`~daopsim.simulator.errors.PolicyError` naming the policy,
sequence, token and layer. :func:`check_placement` and :func:`check_plan` refuse impossible or
malformed decisions *before* the engine applies anything, so every ``PolicyError`` about a plan
comes from this module, and anything raised later, inside the engine, is an engine bug that keeps
its traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any, Final

import numpy as np

from daopsim.policies.base import (
    Action,
    Plan,
    Policy,
    ResourceSpec,
    Slot,
)
from daopsim.simulator.errors import PolicyError, UserError

# the actions as plain ints, Final so that compiled code reads each as a constant (not a
# module-dict lookup per use); the core's applier uses them too
A_GPU: Final = int(Action.GPU)
A_FETCH: Final = int(Action.FETCH)
A_TEMP: Final = int(Action.TEMP)
A_CPU: Final = int(Action.CPU)
A_PRE: Final = int(Action.PRECOMPUTED)
_ACTIONS = frozenset(int(a) for a in Action)


class Where:
    """The point of the run a decision belongs to (sequence, token, layer)."""

    __slots__ = ("layer", "seq", "token")

    def __init__(self) -> None:
        self.seq: int | None = None
        self.token: int | None = None
        self.layer: int | None = None


class StopRun(BaseException):
    """Ends a run from inside a hook on purpose (the gym environment's abandoned episode):
    :class:`Hooks` lets it through unchanged."""


def passes_through(exc: BaseException) -> bool:
    """True for what a hook's caller must not turn into a policy fault: an interrupt (Ctrl-C),
    a generator or greenlet being closed, a run stopped on purpose (:class:`StopRun`).
    Anything else a policy raises, ``SystemExit`` and bare ``BaseException`` included, is the
    policy's fault: ``sys.exit(0)`` in a hook must not end the command as a success."""
    if isinstance(exc, KeyboardInterrupt | GeneratorExit | StopRun):
        return True
    return type(exc).__module__.partition(".")[0] == "greenlet"  # GreenletExit


def _text(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or "(no message)"


def named_user_error(policy: str, hook: str, exc: UserError) -> UserError:
    """``exc`` itself when its message names the policy, else the same message naming the
    policy and the hook (``cpu_workers must be >= 1`` from a ``ResourceSpec``)."""
    if f"policy {policy!r}" in str(exc) or type(exc) is not UserError:
        return exc
    return UserError(f"policy {policy!r}: {hook}: {_text(exc)}")


class Hooks:
    """Calls a policy's hooks; an exception a hook raises becomes a ``PolicyError``.

    ``PolicyError`` passes through unchanged, and so does a ``UserError`` (a bad option the
    policy reports) that names the policy; one that does not (``ResourceSpec``'s checks) is
    re-raised naming the policy and the hook. Interrupts pass through (:func:`passes_through`).
    """

    __slots__ = ("checker", "name", "policy", "where")

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name or type(policy).__name__
        self.where = Where()
        #: the plan check, made at the first plan (:func:`check_plan`)
        self.checker: _PlanCheck | None = None

    def error(self, message: str, layer: int | None = None) -> PolicyError:
        """A PolicyError at the current sequence and token (and ``layer``)."""
        w = self.where
        return PolicyError(self.name, message, seq=w.seq, token=w.token, layer=layer)

    def call(self, hook: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; its exception is the policy's fault, reported as hook ``hook`` (with
        the current token and layer for the layer hooks)."""
        try:
            return fn(*args)
        except PolicyError:
            raise
        except UserError as exc:
            raise self.named(hook, exc) from None
        except BaseException as exc:
            if passes_through(exc):
                raise
            err = self.fault(hook, exc)
            # set by hand: mypyc-compiled callers lost the cause of `raise ... from exc`
            err.__cause__ = exc
            raise err from exc

    def named(self, hook: str, exc: UserError) -> UserError:
        """``exc`` naming the policy and the hook (:func:`named_user_error`)."""
        return named_user_error(self.name, hook, exc)

    def fault(self, hook: str, exc: BaseException) -> PolicyError:
        """The PolicyError for ``exc`` raised by hook ``hook`` (callers that inline the call on
        the per-layer hot path raise this ``from exc``).

        The message names the hook the exception came out of, which is not always the one
        the engine called (the default ``prefill_layer`` calls ``decode_layer``), and the file
        and line where it was raised in the policy's own code (:func:`fault_site`)."""
        text = _text(exc)
        w = self.where
        per_layer = hook.endswith("_layer")
        raised_in, site = fault_site(exc, self.policy, hook)
        if isinstance(exc, NotImplementedError) and site is None and raised_in in HOOK_NAMES:
            message = (
                f"does not implement {raised_in} (a Policy subclass must define it; "
                "docs/policy-api.md)"
            )
        else:
            message = f"{raised_in} raised {type(exc).__name__}: {text}"
            if site is not None:
                message += f" (at {site})"
        return PolicyError(
            self.name,
            message,
            seq=w.seq,
            token=w.token if per_layer else None,
            layer=w.layer if per_layer else None,
        )


#: the hooks a policy writes (docs/policy-api.md), innermost first when one calls another
HOOK_NAMES: Final = frozenset(
    (
        "resources",
        "fixed_residency",
        "setup",
        "on_sequence_start",
        "on_sequence_end",
        "prefill_layer",
        "decode_layer",
        "batch_layer",
        "choose_victim",
        "touch",
        "inserted",
        "removed",
        "uses_calibration",
        "uses_lookahead",
    )
)


def _library_dirs() -> tuple[str, ...]:
    """Folders whose frames are not the policy author's: the standard library, installed
    packages, the simulator itself (the engine and this boundary) and the policy API."""
    import os
    import sysconfig

    from daopsim.simulator.native import source_path

    # the sources, not __file__: a compiled module's file is its build group's library
    ours = source_path("daopsim.simulator.boundary").parent
    found = sysconfig.get_paths()
    paths = [found.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    paths += [str(ours), str(ours.parent / "policies" / "base.py")]
    return tuple(os.path.realpath(p) for p in paths if p)


def fault_site(exc: BaseException, policy: Any, called: str) -> tuple[str, str | None]:
    """Which hook ``exc`` came out of, and ``file:line`` where it was raised in code the policy
    author wrote (None when it was raised in a library or in daopsim's own code).

    The hook is the innermost frame of the traceback running one of :data:`HOOK_NAMES` on
    ``policy`` (``called`` when none is found: a compiled hook leaves no frame to read).
    The site is the innermost frame outside the standard library, installed packages and the
    simulator; a path under the current folder is shown relative to it."""
    import os

    hook = called
    site: str | None = None
    lib = _library_dirs()
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        if code.co_name in HOOK_NAMES and frame.f_locals.get("self", policy) is policy:
            hook = code.co_name
        path = os.path.realpath(code.co_filename)
        if not path.startswith(lib) and os.path.exists(path):
            shown = path
            try:
                rel = os.path.relpath(path)
                if not rel.startswith(".."):
                    shown = rel
            except ValueError:  # another drive (Windows)
                pass
            site = f"{shown}:{tb.tb_lineno}"
        tb = tb.tb_next
    return hook, site


def construct_policy(cls: type[Policy], options: dict[str, Any] | None = None) -> Policy:
    """``cls(**options)``, its declarations checked (:func:`check_declarations`); a fault of
    its ``__init__`` is a PolicyError naming the policy (a required argument, a raise)."""
    name = cls.name if isinstance(cls.name, str) and cls.name else cls.__name__
    try:
        policy = cls(**(options or {}))
    except PolicyError:
        raise
    except UserError as exc:
        raise named_user_error(name, "__init__", exc) from None
    except BaseException as exc:
        if passes_through(exc):
            raise
        raise PolicyError(name, f"__init__ raised {type(exc).__name__}: {_text(exc)}") from exc
    check_declarations(policy)
    return policy


def check_declarations(policy: Policy) -> None:
    """Call the methods a run reads before any hook (``resources``, ``uses_calibration``,
    ``uses_lookahead``) through :class:`Hooks`, and refuse what they return when it is not a
    ``ResourceSpec`` or a truth value: a PolicyError naming the policy and the method."""
    hooks = Hooks(policy)
    spec = hooks.call("resources", policy.resources)
    if not isinstance(spec, ResourceSpec):
        raise hooks.error(f"resources returned {type(spec).__name__}, expected a ResourceSpec")
    for method in ("uses_calibration", "uses_lookahead"):
        value = hooks.call(method, getattr(policy, method))
        if not isinstance(value, bool | np.bool_):
            raise hooks.error(f"{method} returned {value!r}, expected True or False")


def frozen(a: Any) -> Any:
    """A read-only view of the array ``a`` (None stays None): what the engine hands a policy.
    A policy writing into ``View.counts`` would otherwise change what the engine runs next."""
    if a is None:
        return None
    out = a.view()
    out.flags.writeable = False
    return out


def fill_layer_view(v: Any, counts: Any, weights: Any, probs: Any) -> Any:
    """Fill the view of one layer of a multi-token step (a prefill pass, a batched or mixed
    step) from its per-expert token ``counts`` and the step's ``[tokens, ...]`` gate weights
    and dense router probabilities at the layer: ``experts`` the experts with a non-zero count
    (descending count, ties to the lower id), ``weights``/``probs`` their means. Every array
    is read-only; returns ``(experts, counts)``, which the engine runs."""
    experts = np.flatnonzero(counts)
    experts = experts[np.argsort(-counts[experts], kind="stable")]
    experts.flags.writeable = False
    counts = frozen(counts)
    w = weights.mean(axis=0)
    w.flags.writeable = False
    p = probs.mean(axis=0)
    p.flags.writeable = False
    v.experts, v.counts, v.weights, v.probs = experts, counts, w, p
    return experts, counts


def _pair(x: Any) -> Slot | None:
    """``x`` as an int (layer, expert) pair, or None when it is not one."""
    if type(x) is tuple and len(x) == 2 and type(x[0]) is int and type(x[1]) is int:
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
    hooks: Hooks,
    slots: Any,
    n_layers: int,
    n_experts: int,
    budget: int,
    what: str = "initial placement",
) -> list[Slot]:
    """The initial placement as (layer, expert) pairs; refuses anything impossible. ``what``
    names it in the errors (with several GPUs: ``GPU k's initial placement``, in the GPU's
    local indices)."""
    try:
        items = list(slots)
    except TypeError:
        raise hooks.error(
            f"setup returned an invalid {what} ({type(slots).__name__} is not "
            "a list of (layer, expert) pairs)"
        ) from None
    seen: set[Slot] = set()
    out: list[Slot] = []
    for item in items:
        p = _pair(item)
        if p is None:
            raise hooks.error(
                f"setup returned an invalid {what} ({item!r} is not a (layer, expert) pair)"
            )
        layer, expert = p
        if not (0 <= layer < n_layers and 0 <= expert < n_experts):
            raise hooks.error(f"{what} names ({layer}, {expert}), outside the model")
        if p in seen:
            raise hooks.error(f"{what} names ({layer}, {expert}) twice")
        seen.add(p)
        out.append(p)
    if len(out) > budget:
        raise hooks.error(f"{what} holds {len(out)} experts, budget is {budget}")
    return out


def check_route(
    hooks: Hooks, plan: Any, n_experts: int, layer: int, refused: str = ""
) -> list[int] | None:
    """A substituted decode route as a list of expert ids (None: the trace's routing, or not a
    Plan: :func:`check_plan` refuses that). ``refused`` names a step that takes no substituted
    route (``"during prefill"``, ``"in a mixed step"``): a route there is refused."""
    if not isinstance(plan, Plan):
        return None
    route = plan.route
    if route is None:
        return None
    if refused:
        raise hooks.error(f"substitutes routing {refused} (not supported)", layer)
    arr = route if type(route) is np.ndarray else np.asarray(route)
    if arr.ndim != 1:
        raise hooks.error("returns a malformed route (not one-dimensional)", layer)
    if arr.size and arr.dtype.kind not in "iu":
        raise hooks.error("returns a malformed route (expert ids must be integers)", layer)
    ids = arr.tolist()
    if ids and (min(ids) < 0 or max(ids) >= n_experts):
        raise hooks.error(f"routes to expert ids outside 0..{n_experts - 1}", layer)
    if len(set(ids)) != len(ids):
        raise hooks.error("routes to the same expert twice", layer)
    raw = plan.raw_route
    if raw is not None and (raw if type(raw) is np.ndarray else np.asarray(raw)).ndim != 1:
        raise hooks.error("returns a malformed raw_route (not one-dimensional)", layer)
    return ids


def check_plan(
    hooks: Hooks,
    plan: Any,
    layer: int,
    routed: list[int],
    res: Any,
    spec: Any,
    precalc: Collection[Slot],
) -> list[int]:
    """Refuse a plan the engine cannot apply; returns the routed experts in GPU-first order.

    ``res`` is the engine's residency as policies see it: ``n_layers``, ``n_experts``,
    ``budget``, ``n_resident`` and ``mask`` (per expert, flat index ``layer * n_experts +
    expert``: resident or not; an expert whose copy is in flight counts as resident, and may
    be evicted: its slot is free once the copy lands).

    The plan is checked in the order the engine applies it (evictions, then the routed experts
    with resident ones first, temporary copies, prefetches, pre-calculations) against a private
    record of its residency changes, so a later step sees the effect of an earlier one.
    """
    if not isinstance(plan, Plan):
        raise hooks.error(f"returned {type(plan).__name__}, expected a Plan", layer)
    check = hooks.checker
    if check is None or check.res is not res:  # made once per engine, for its residency
        check = hooks.checker = _PlanCheck(hooks, res, spec)
    return check.run(plan, layer, routed, precalc)


class _PlanCheck:
    """The check of an engine's plans: the residency as a plan changes it, step by step. A
    plan's fields may hold any objects (``Plan``'s fields are typed ``Any``). Experts are
    named by their flat index ``layer * n_experts + expert``, as the residency stores them.
    Made once per engine (:attr:`Hooks.checker`): its per-plan state is reset by :meth:`run`.
    """

    def __init__(self, hooks: Hooks, res: Any, spec: Any) -> None:
        self.hooks, self.res, self.spec = hooks, res, spec
        # the residency's sizes and the spec's switches read once, typed
        self.n_layers: int = res.n_layers
        self.n_experts: int = res.n_experts
        self.budget: int = res.budget
        self.mask: Any = res.mask
        self.evicts_in_use: bool = bool(spec.evicts_in_use and spec.writeback)
        self.no_temp: bool = spec.temp_buffers < 1
        self.cpu_layers: bool = spec.gpu_blocks is not None
        self.one_stream: bool = bool(spec.one_stream)
        # the current plan
        self.plan = Plan()
        self.layer = 0
        self.routed: list[int] = []
        self.actions: dict[Any, Any] | None = None
        self.needed: set[int] = set()
        #: residency changes made earlier in this plan
        self.changed: dict[int, bool] = {}
        self.n_res = 0

    def run(
        self, plan: Plan, layer: int, routed: list[int], precalc: Collection[Slot]
    ) -> list[int]:
        """Check ``plan`` (see :func:`check_plan`); returns the routed experts' order."""
        self.plan, self.layer, self.routed = plan, layer, routed
        self.changed.clear()
        self.n_res = self.res.n_resident
        if plan.low_bit:
            _check_low_bit(self.hooks, plan, layer, routed, self.spec)
        self.check_spec()
        actions = plan.actions
        if actions is not None and not isinstance(actions, dict):
            raise self.err(f"returned a malformed plan (actions is {type(actions).__name__})")
        self.actions = actions
        if actions is None:
            self.needed = set(routed)
        else:
            self.needed = {e for e in routed if actions.get(e) in (A_GPU, A_FETCH)}
        # lists, or tuples (a FrozenPlan's); a tuple of types, not ``list | tuple``: compiled,
        # that union is a new object built at every call
        evict, prefetch = plan.evict, plan.prefetch
        if not isinstance(evict, (list, tuple)) or not isinstance(prefetch, (list, tuple)):
            raise self.err("returned a malformed plan (evict and prefetch must be lists)")
        for victim in evict:
            self.evict(victim, "evict entry")
        order = self.check_routed(precalc)
        for entry in prefetch:
            self.prefetch(entry)
        if plan.precalc:
            _check_precalc(self.hooks, plan.precalc, layer, self.res, precalc)
        return order

    def err(self, message: str) -> PolicyError:
        return self.hooks.error(message, self.layer)

    def check_spec(self) -> None:
        """Work a system's resources cannot model."""
        plan = self.plan
        if self.cpu_layers and (plan.prefetch or plan.precalc):
            # CPU-resident layers are timed as if nothing else used the CPU or the links then
            raise self.err(
                "asks for prefetches or pre-calculations, which a spec with gpu_blocks "
                "(CPU-resident layers) does not model"
            )
        actions = plan.actions
        if self.one_stream and (
            plan.precalc
            or (isinstance(actions, dict) and any(a in (A_CPU, A_PRE) for a in actions.values()))
        ):
            # one stream orders the expert copies and kernels; CPU work beside it is not modelled
            raise self.err("runs experts on the CPU, which a spec with one_stream does not model")

    def is_res(self, i: int) -> bool:
        v = self.changed.get(i)
        return bool(self.mask[i]) if v is None else v

    def evict(self, item: Any, what: str) -> None:
        """An eviction (or a fetch's victim): resident and not needed now (unless the spec
        evicts in use). An expert whose copy is still in flight may be evicted: its slot is
        free once the copy lands (the engines time that)."""
        slot = _pair(item)
        if slot is None:
            raise self.err(
                f"returned a malformed plan ({what} {item!r} is not a (layer, expert) pair)"
            )
        vl, ve = slot
        if not (0 <= vl < self.n_layers and 0 <= ve < self.n_experts):
            raise self.err(f"evicts ({vl}, {ve}), outside the model")
        i = vl * self.n_experts + ve
        if not self.is_res(i):
            raise self.err(f"evicts expert {ve} of layer {vl}, which is not resident")
        in_use = vl == self.layer and ve in self.needed
        if in_use and not self.evicts_in_use:
            raise self.err(f"evicts expert {ve} of layer {vl}, which this token needs")
        self.changed[i] = False
        self.n_res -= 1

    def fetch(self, layer: int, e: int, victim: Any, what: str) -> None:
        """A copy into a slot, after its victim's eviction; the budget must hold it."""
        if victim is not None:
            self.evict(victim, "victim")
        budget = self.budget
        if self.n_res >= budget:
            raise self.err(
                f"{what} expert {e} of layer {layer} with all {budget} slots full and no victim"
            )
        self.changed[layer * self.n_experts + e] = True
        self.n_res += 1

    def check_routed(self, precalc: Collection[Slot]) -> list[int]:
        """Each routed expert's action, resident experts first; returns that order."""
        actions, layer = self.actions, self.layer
        row = layer * self.n_experts
        if actions is None:
            for e in self.routed:
                if not self.is_res(row + e):
                    raise self.err(f"runs expert {e} on the GPU but it is not resident")
            return self.routed
        for value in actions.values():
            if value not in _ACTIONS:
                bad = next(e for e, x in actions.items() if x is value)
                raise self.err(f"returns unknown action {value!r} for expert {bad}")
        # hits are judged before this layer's insertions: resident experts first
        order = [e for e in self.routed if actions.get(e) == A_GPU]
        order += [e for e in self.routed if actions.get(e) != A_GPU]
        temps = 0
        for e in order:
            a = actions.get(e)
            if a is None:
                raise self.err(f"gives no action for routed expert {e}")
            if a == A_GPU and not self.is_res(row + e):
                raise self.err(f"runs expert {e} on the GPU but it is not resident")
            if a == A_FETCH:
                if self.is_res(row + e):
                    raise self.err(f"fetches expert {e}, which is already resident")
                self.fetch(layer, e, self.plan.victims.get(e), "fetches")
            elif a == A_TEMP:
                if self.is_res(row + e):
                    raise self.err(f"copies expert {e} to a temporary buffer but it is resident")
                temps += 1
            elif a == A_PRE and (layer, e) not in precalc:
                raise self.err(f"uses a CPU pre-calculation of expert {e} that was never submitted")
        if len(actions) != len(self.routed):
            extra = sorted(set(actions) - set(self.routed))
            raise self.err(f"gives actions for experts {extra} that are not routed")
        if temps and self.no_temp:
            raise self.err("copies to a temporary buffer but declares temp_buffers = 0")
        return order

    def prefetch(self, item: Any) -> None:
        """A prefetch: (layer, expert, victim) of an expert not resident yet."""
        try:
            pl, pe, victim = item
        except (TypeError, ValueError):
            raise self.err(
                f"returned a malformed plan (prefetch entry {item!r} is not "
                "(layer, expert, victim))"
            ) from None
        slot = _pair((pl, pe))
        if slot is None:
            raise self.err(f"returned a malformed plan (prefetch entry {item!r})")
        pl, pe = slot
        if not (0 <= pl < self.n_layers and 0 <= pe < self.n_experts):
            raise self.err(f"prefetches ({pl}, {pe}), outside the model")
        if self.is_res(pl * self.n_experts + pe):
            raise self.err(f"prefetches expert {pe} of layer {pl}, already resident")
        self.fetch(pl, pe, victim, "prefetches")


def check_gpu_budget(
    policy: str, view: Any, gpu: int, held: int, plan: Plan, fetched: int, budget: int
) -> None:
    """With several GPUs: GPU ``gpu``'s resident experts after its instance's plan (``held``
    now, ``fetched`` FETCH actions, its prefetches, less its victims and evictions) stay
    within its own ``budget``; ``view`` is the run's view of the layer (where the error
    points)."""
    after = held + fetched + len(plan.prefetch) - len(plan.victims) - len(plan.evict)
    if plan.prefetch:
        after -= sum(1 for *_, victim in plan.prefetch if victim is not None)
    if after > budget:
        raise PolicyError(
            policy,
            f"GPU {gpu} would hold {after} experts, over its budget of {budget}",
            seq=view.seq_id,
            token=view.token,
            layer=view.layer,
        )


def _check_low_bit(hooks: Hooks, plan: Any, layer: int, routed: list[int], spec: Any) -> None:
    """``Plan.low_bit`` names routed TEMP copies, on a system that holds low-bit copies; with
    ``low_bit_slots`` also routed FETCH and GPU experts (copied to, or held in, a slot as
    their low-bit copy)."""
    if spec.low_bit_dtype is None:
        raise hooks.error(
            "names low-bit copies (Plan.low_bit) but its resources declare no low_bit_dtype",
            layer,
        )
    actions = plan.actions
    if actions is not None and not isinstance(actions, dict):
        return  # refused as a malformed plan by the checks that follow
    allowed = (A_TEMP, A_FETCH, A_GPU) if spec.low_bit_slots else (A_TEMP,)
    for e in plan.low_bit:
        a = A_GPU if actions is None else actions.get(e)
        if e not in routed or a not in allowed:
            what = "a TEMP, FETCH or GPU expert" if spec.low_bit_slots else "a TEMP copy"
            raise hooks.error(f"names expert {e} as a low-bit copy but it is not {what}", layer)


def _check_precalc(hooks: Hooks, items: Any, layer: int, res: Any, precalc: Iterable[Slot]) -> None:
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
