"""Policies own only their decisions: residency is the engine's, link timing the lane's.

- Every registered cache policy (per-layer and global) believes resident, at every decision
  and after each plan it builds, exactly what the engine holds (its base class reads the
  engine's residency, ``View.resident``, and lays the plan's own changes over it); the
  engine's residency changes between two decisions only by what the returned plan says.
- A hook cannot change the engine's residency but through its plan: writing the view is
  refused, and changing the list a policy reads its residency from changes nothing.
- ``View.copy_lands`` (what hybrimoe and dali ask when copies land) applies the lane rule of
  ``View.copy_end`` to the real lane, on one copy engine and on two.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from equivalence import engines_per_direction

from daopsim.policies.base import Action, Plan, Policy, View
from daopsim.policies.caching import CachingPolicy, GlobalCachingPolicy
from daopsim.policies.registry import available
from daopsim.simulator.errors import PolicyError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.runner import simulate
from daopsim.simulator.serving import ServingConfig
from daopsim.simulator.testing import make_trace

POLICIES = available()
CACHES = sorted(
    n for n, c in POLICIES.items() if issubclass(c, (CachingPolicy, GlobalCachingPolicy))
)
#: options that take a cache policy down its other paths (prefetches into the next layer,
#: copies still in flight when a victim is chosen)
VARIANTS: list[tuple[str, dict[str, Any]]] = [(n, {}) for n in CACHES] + [
    ("mixtral-offloading", {"prefetch": True, "copy_stream": "side"}),
    ("least-stale", {"prefetch": True}),
]
BUDGET = 12  # of the tiny model's 32 experts: every cache evicts


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny trace (4 layers, 8 experts, top-2) with prompts and decode tokens."""
    path = tmp_path_factory.mktemp("ownership") / "tiny.parquet"
    return make_trace(path, sequences=3, prefill=6, decode=12, seed=5)


def applied(resident: np.ndarray, layer: int, plan: Plan) -> np.ndarray:
    """``resident`` after ``plan`` (decided at ``layer``): what the engine must hold next,
    in the plan's issue order (evictions, each fetch after its victim, prefetches), so that a
    fetch whose expert a later fetch of the same plan evicts (an in-use swap) ends evicted."""
    out = resident.copy()
    for lay, e in plan.evict:
        out[lay, e] = False
    for e, action in (plan.actions or {}).items():
        if action == Action.FETCH:
            victim = plan.victims.get(e)
            if victim is not None:
                out[victim[0], victim[1]] = False
            out[layer, e] = True
    for lay, e, victim in plan.prefetch:
        if victim is not None:
            out[victim[0], victim[1]] = False
        out[lay, e] = True
    return out


def believed(policy: Any, n_layers: int) -> np.ndarray:
    """What ``policy`` believes resident now, as a ``[layers, experts]`` mask."""
    if isinstance(policy, GlobalCachingPolicy):
        return policy.cached
    mask = np.zeros((n_layers, policy.model.experts), dtype=bool)
    for layer in range(n_layers):
        mask[layer, policy.residents(layer)] = True
        assert policy.occupied(layer) == len(policy.cache[layer])
    return mask


def checked(cls: type[Policy], seen: list[int]) -> type[Policy]:
    """``cls`` checking, around each decision, its belief against the engine's residency."""

    class Checked(cls):  # type: ignore[valid-type,misc]
        expected: np.ndarray | None = None

        def _check(self, view: View, decide: Any) -> Plan:
            engine = np.array(view.resident)
            if self.expected is not None:
                # between two decisions the engine changed residency by the plan alone
                np.testing.assert_array_equal(engine, self.expected)
            plan = decide(view)
            # the policy's belief is the engine's with this plan applied (its base class
            # laid the plan's own changes over the engine's rows), never a copy of its own
            after = applied(engine, view.layer, plan)
            np.testing.assert_array_equal(believed(self, len(engine)), after)
            self.expected = after
            seen.append(int(after.sum()))
            return plan

        def decode_layer(self, view: View) -> Plan:
            return self._check(view, super().decode_layer)

        def prefill_layer(self, view: View) -> Plan:
            return self._check(view, super().prefill_layer)

        def batch_layer(self, view: View) -> Plan:
            return self._check(view, super().batch_layer)

    Checked.__name__ = cls.__name__
    return Checked


@pytest.mark.parametrize(("name", "opts"), VARIANTS, ids=lambda x: str(x))
def test_every_cache_policy_believes_the_engines_residency(
    name: str, opts: dict[str, Any], trace: Path
) -> None:
    """At every decision of a run (prompts and decode tokens), a registered cache policy's
    residency is the engine's, before its plan and, with the plan's changes, after it."""
    seen: list[int] = []
    res = simulate(
        policy=checked(POLICIES[name], seen)(**opts), trace=trace, gpu_experts=BUDGET,
        record=False, calibration="self",
    )  # fmt: skip
    assert res.metrics["evictions"] > 0  # the cache turned over: the check was not idle
    assert len(seen) >= 4 * res.metrics["decode_tokens"] > 0  # every decode token-layer
    assert max(seen) <= BUDGET


def test_a_batched_serving_run_too(trace: Path) -> None:
    """Serving's batched steps (``batch_layer``) keep the same residency as the engine."""
    seen: list[int] = []
    simulate(
        policy=checked(POLICIES["lru"], seen)(), trace=trace, gpu_experts=BUDGET, record=False,
        calibration="self", serving=ServingConfig(batch=2),
    )  # fmt: skip
    assert seen


def test_a_hook_writing_the_view_is_refused(trace: Path) -> None:
    """The engine's residency is read-only to a policy: a hook that writes it is stopped
    (a PolicyError naming the hook), whatever the hook."""

    class Writer(POLICIES["lru"]):  # type: ignore[valid-type,misc]
        name = "writer"

        def touch(self, layer: int, expert: int, step: int, weight: int) -> None:
            assert self._view is not None
            self._view.resident[layer, expert] = False

    with pytest.raises(PolicyError, match="touch"):
        simulate(policy=Writer(), trace=trace, gpu_experts=BUDGET, record=False)


def test_changing_what_a_policy_reads_changes_nothing(trace: Path) -> None:
    """``cache[layer]`` is read from the engine each time: a hook that edits the list it got
    (as a subclass of the old base class could edit the cache the base class kept) changes
    neither the engine's residency nor any decision."""

    class Meddler(POLICIES["lru"]):  # type: ignore[valid-type,misc]
        name = "meddler"

        def inserted(self, layer: int, expert: int, step: int) -> None:
            super().inserted(layer, expert, step)
            if step >= 0:
                got = self.cache[layer]
                got.clear()
                got.append((expert + 1) % 8)

    kw: dict[str, Any] = {"trace": trace, "gpu_experts": BUDGET, "record": False}
    plain = simulate(policy="lru", **kw).metrics
    meddled = simulate(policy=Meddler(), **kw).metrics
    assert meddled["evictions"] > 0
    numbers = [k for k, v in plain.items() if isinstance(v, int | float)]
    np.testing.assert_equal({k: meddled[k] for k in numbers}, {k: plain[k] for k in numbers})


class LandProbe(POLICIES["mixtral-offloading"]):  # type: ignore[valid-type,misc]
    """mixtral-offloading with prefetches (copies still in flight at later decisions),
    recording what the view says about the copy lane at each decision."""

    name = "land-probe"

    def __init__(self, **options: Any) -> None:
        super().__init__(prefetch=True, copy_stream="side", **options)
        self.rows: list[tuple[float, list[float], list[float], list[float], float]] = []

    def decode_layer(self, view: View) -> Plan:
        lands = view.copy_lands(3)
        ends = [view.copy_end(n) for n in (1, 2, 3)]
        self.rows.append((view.now, lands, ends, view.copy_lands(3, idle=True), view.copy_s))
        return super().decode_layer(view)


@pytest.mark.parametrize("engines", [1, 2])
def test_copy_lands_is_copy_ends_lane_rule(engines: int, trace: Path) -> None:
    """At every decision of a run whose copies queue on the lane, ``copy_lands(n)`` is when
    ``copy_end`` says the first n copies land (relative to now), and with ``idle`` the lane
    rule from an idle lane: one copy after another on one engine, two at a time on two."""
    hw = load_profile("a6000-pcie4")
    # a link 1000 x slower than the card's: prefetches still in flight at later decisions
    slow = dataclasses.replace(
        hw.link,
        h2d_pinned_gbs=hw.link.h2d_pinned_gbs / 1000,
        d2h_pinned_gbs=hw.link.d2h_pinned_gbs / 1000,
    )
    hw = dataclasses.replace(hw, link=slow)
    if engines > 1:
        hw = engines_per_direction(hw, engines)
    probe = LandProbe()
    simulate(policy=probe, hw=hw, trace=trace, gpu_experts=4, record=False)
    busy = 0
    for now, lands, ends, idle, d in probe.rows:
        for n in (1, 2, 3):
            assert now + max(lands[:n]) == pytest.approx(ends[n - 1], rel=1e-12, abs=1e-15)
        busy += lands[0] > d * (1 + 1e-9)
        if engines == 1:
            assert idle == pytest.approx([d, 2 * d, 3 * d])
        else:
            assert idle == pytest.approx([d, d, 2 * d])
    assert busy > 0  # some decisions found the lane busy: the real lane was read
