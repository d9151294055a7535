"""Every overridable hook of every built-in policy is honoured (docs/policy-api.md, "Hooks").

For each built-in policy a subclass overrides the hooks, records its calls and, where a hook
decides something, decides differently. The run's results must show it: the number of calls
equals the number of decisions the run made (prefill layers, decode token-layers, batched
serving steps, each GPU's share on two GPUs), and the decisions the run executed are the
override's (its victims, its protected experts, its placement, its routes, its resources).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from daopsim.policies.base import Action, Plan, Policy, ResourceSpec, SetupContext, Slot, View
from daopsim.policies.caching import CachingPolicy, GlobalCachingPolicy
from daopsim.policies.registry import available
from daopsim.simulator.errors import PolicyError
from daopsim.simulator.results import RunResult
from daopsim.simulator.runner import simulate
from daopsim.simulator.serving_config import ServingConfig
from daopsim.simulator.testing import make_trace

BUILTIN = {n: c for n, c in available().items() if c.__module__.startswith("daopsim.policies.")}
PER_LAYER = sorted(n for n, c in BUILTIN.items() if issubclass(c, CachingPolicy))
GLOBAL = sorted(n for n, c in BUILTIN.items() if issubclass(c, GlobalCachingPolicy))
CACHES = PER_LAYER + GLOBAL

LAYERS, SEQUENCES, PREFILL, DECODE = 4, 4, 6, 10  # the tiny model's layers; the trace's shape
SETTINGS: dict[str, dict[str, Any]] = {
    "sequential": {},
    "batched": {"serving": ServingConfig(batch=2)},
    "two-gpus": {"hw": "2x-rtx4090-pcie4", "gpus": 2},
}
#: GPU expert slots (per GPU) of the generic runs and of the cache runs (which must evict)
BUDGET = {"sequential": 20, "batched": 20, "two-gpus": 10}
CACHE_BUDGET = {"sequential": 12, "batched": 12, "two-gpus": 6}
#: what a policy needs to run on two GPUs: its defaults are refused there (the multi-GPU
#: executors model neither one-stream copies nor streamed non-expert weights)
TWO_GPU_OPTIONS: dict[str, dict[str, Any]] = {
    "mixtral-offloading": {"copy_stream": "side"},
    "stream-all": {"stream_nonexpert": False},
}
#: refused on two GPUs whatever the options (CPU-resident layers, bit-slice slots)
NOT_ON_TWO_GPUS = {"llama-cpp-layers", "slicemoe"}
#: stream-all's default fetches every routed expert into a slot, which an override cannot drop
#: without changing the residency; gather=selected runs them from temporary buffers
DROP_OPTIONS: dict[str, dict[str, Any]] = {"stream-all": {"gather": "selected"}}
#: room for one of vllm-cpu-offload's layers to stay resident (its others fetch every expert)
DROP_BUDGET = 24
#: option variants whose extra paths the cache tests cover too
CACHE_VARIANTS: list[tuple[str, dict[str, Any]]] = [(n, {}) for n in CACHES] + [
    ("mixtral-offloading", {"prefetch": True, "copy_stream": "side"})
]


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny trace (4 layers, 8 experts, top-2) with prompts and decode tokens."""
    path = tmp_path_factory.mktemp("hooks") / "tiny.parquet"
    return make_trace(path, sequences=SEQUENCES, prefill=PREFILL, decode=DECODE, seed=3)


def options_for(name: str, setting: str) -> dict[str, Any]:
    """The policy's options for a setting (two GPUs need some), or a skip where unsupported."""
    if setting == "two-gpus":
        if name in NOT_ON_TWO_GPUS:
            pytest.skip(f"{name} does not run on several GPUs")
        return dict(TWO_GPU_OPTIONS.get(name, {}))
    return {}


def run(policy: Policy, trace: Path, setting: str, budget: int) -> RunResult:
    """One run of ``policy`` on the tiny trace, every sequence evaluated (calibration: self)."""
    return simulate(
        policy=policy,
        trace=trace,
        gpu_experts=budget,
        record=False,
        calibration="self",
        **SETTINGS[setting],
    )


class Log:
    """What the overrides of one run saw, per policy instance (one per GPU)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, Any]] = []  # (instance, hook, detail)
        self.depth: dict[int, int] = {}
        self.first_resident: dict[int, np.ndarray] = {}
        self.placed: dict[int, list[Slot]] = {}
        self.victims: dict[int, list[Slot]] = {}  # what choose_victim returned, in order
        self.executed: dict[int, list[Slot]] = {}  # the victims of the plans returned, in order

    def add(self, inst: object, hook: str, detail: Any = None) -> None:
        """Record one call."""
        self.calls.append((id(inst), hook, detail))

    def count(self, hook: str) -> dict[int, int]:
        """Calls of ``hook`` per instance."""
        out: dict[int, int] = {}
        for inst, h, _ in self.calls:
            if h == hook:
                out[inst] = out.get(inst, 0) + 1
        return out

    def details(self, hook: str) -> list[Any]:
        """The details of every call of ``hook``, in call order."""
        return [d for _, h, d in self.calls if h == hook]


def plan_victims(plan: Plan) -> list[Slot]:
    """The slots a plan evicts for its fetches and prefetches, in the order they are chosen."""
    out = list(plan.victims.values())
    out += [v for _, _, v in plan.prefetch if v is not None]
    return out


def recording(cls: type[Policy], log: Log) -> type[Policy]:
    """``cls`` with every engine-facing hook recorded (and otherwise unchanged).

    The layer hooks record only their outermost call (a default ``batch_layer`` calls
    ``prefill_layer``, which calls ``decode_layer``): one record per decision.
    """

    class Recording(cls):  # type: ignore[valid-type,misc]
        def resources(self) -> ResourceSpec:
            log.add(self, "resources")
            return super().resources()

        def setup(self, ctx: SetupContext) -> Iterable[Slot]:
            log.add(self, "setup")
            placed = list(super().setup(ctx))
            log.placed[id(self)] = placed
            return placed

        def on_sequence_start(self, seq_id: int, n_prefill: int) -> None:
            log.add(self, "on_sequence_start", seq_id)
            super().on_sequence_start(seq_id, n_prefill)

        def on_sequence_end(self, seq_id: int) -> None:
            log.add(self, "on_sequence_end", seq_id)
            super().on_sequence_end(seq_id)

        def _layer(self, hook: str, view: View, decide: Any) -> Plan:
            key = id(self)
            outer = log.depth.get(key, 0) == 0
            if outer:
                log.add(self, hook, (view.phase, view.seq_id, view.layer))
                log.first_resident.setdefault(key, view.resident.copy())
            log.depth[key] = log.depth.get(key, 0) + 1
            try:
                plan: Plan = decide(view)
            finally:
                log.depth[key] -= 1
            if outer:
                log.executed.setdefault(key, []).extend(plan_victims(plan))
            return plan

        def decode_layer(self, view: View) -> Plan:
            return self._layer("decode_layer", view, super().decode_layer)

        def prefill_layer(self, view: View) -> Plan:
            return self._layer("prefill_layer", view, super().prefill_layer)

        def batch_layer(self, view: View) -> Plan:
            return self._layer("batch_layer", view, super().batch_layer)

    Recording.__name__ = f"Recording{cls.__name__}"
    return Recording


def caching_recording(cls: type[Policy], log: Log) -> type[Policy]:
    """:func:`recording` plus the cache hooks (``serve`` too, where the class has it)."""

    class CacheRecording(recording(cls, log)):  # type: ignore[misc]
        def init_state(self, ctx: SetupContext) -> None:
            log.add(self, "init_state")
            super().init_state(ctx)

        def touch(self, layer: int, expert: int, step: int, weight: int) -> None:
            log.add(self, "touch", weight)
            super().touch(layer, expert, step, weight)

        def inserted(self, layer: int, expert: int, step: int) -> None:
            log.add(self, "inserted", (layer, expert))
            super().inserted(layer, expert, step)

        def removed(self, layer: int, expert: int) -> None:
            log.add(self, "removed", (layer, expert))
            super().removed(layer, expert)

        def choose_victim(self, layer: int, protected: set[int], step: int) -> Any:
            got = super().choose_victim(layer, protected, step)
            slot = got if isinstance(got, tuple) else (layer, got)
            log.victims.setdefault(id(self), []).append(slot)
            log.add(self, "choose_victim", slot)
            return got

        def unevictable(self, layer: int) -> set[int] | None:
            log.add(self, "unevictable", layer)
            return super().unevictable(layer)

        def serve(self, view: View, experts: list[int]) -> Plan:
            log.add(self, "serve", view.phase)
            return super().serve(view, experts)

    return CacheRecording


def decisions(res: RunResult, setting: str) -> dict[str, int]:
    """Layer decisions of each kind one policy instance makes in a run of ``setting``."""
    m = res.metrics
    if setting == "batched":
        s = res.serving
        assert s is not None
        # pairs of equal requests arriving together: every prompt pair is one batched prefill
        # and every decode step is batched
        return {
            "prefill_layer": s["batched_prefills"] * LAYERS,
            "decode_layer": 0,
            "batch_layer": s["batched_steps"] * LAYERS,
        }
    # one prefill pass per sequence; on two GPUs every instance is asked at every layer
    return {
        "prefill_layer": int(m["sequences"]) * LAYERS,
        "decode_layer": int(m["decode_tokens"]) * LAYERS,
        "batch_layer": 0,
    }


# -- the hooks every policy has ----------------------------------------------------------------


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_the_engine_calls_every_override_once_per_decision(
    name: str, setting: str, trace: Path
) -> None:
    """The layer hooks are called once per decision (prefill layer, decode token-layer,
    batched step-layer; on two GPUs by each GPU's instance), the sequence hooks once per
    sequence around its decisions, setup once per instance with its placement as the
    residency of the first decision."""
    log = Log()
    cls = recording(BUILTIN[name], log)
    res = run(cls(**options_for(name, setting)), trace, setting, BUDGET[setting])
    n_inst = 2 if setting == "two-gpus" else 1
    setups = log.count("setup")
    assert len(setups) == n_inst and set(setups.values()) == {1}
    assert log.count("resources")  # the runner sized the run with the override's spec
    for hook, n in decisions(res, setting).items():
        got = log.count(hook)
        assert all(got.get(i, 0) == n for i in setups), (hook, got, n)
    for hook in ("on_sequence_start", "on_sequence_end"):
        assert log.count(hook) == dict.fromkeys(setups, res.metrics["sequences"])
    for inst, placed in log.placed.items():
        mask = np.zeros_like(log.first_resident[inst])
        for layer, e in placed:
            mask[layer, e] = True
        assert np.array_equal(mask, log.first_resident[inst])
    if setting == "sequential":  # each sequence's decisions lie between its start and end
        open_seq = None
        for _, hook, detail in log.calls:
            if hook == "on_sequence_start":
                assert open_seq is None
                open_seq = detail
            elif hook == "on_sequence_end":
                assert detail == open_seq
                open_seq = None
            elif hook.endswith("_layer"):
                assert detail[1] == open_seq


def dropping(cls: type[Policy], log: Log) -> type[Policy]:
    """``cls`` whose ``decode_layer`` drops one true routed expert from each decode plan that
    runs one on the GPU, the CPU or a temporary buffer (no residency change), as a graceful
    degradation (``raw_route`` keeps it)."""

    droppable = (Action.GPU, Action.CPU, Action.TEMP)

    class Dropping(cls):  # type: ignore[valid-type,misc]
        def decode_layer(self, view: View) -> Plan:
            plan: Plan = super().decode_layer(view)
            if view.phase != "decode":
                return plan
            true = view.experts.tolist()
            route = true if plan.route is None else np.asarray(plan.route).tolist()
            actions = dict.fromkeys(route, Action.GPU) if plan.actions is None else plan.actions
            cands = [
                e for e in route if e in true and actions[e] in droppable and e not in plan.low_bit
            ]
            if len(route) < 2 or not cands:
                return plan
            drop = cands[-1]
            raw = route if plan.raw_route is None else np.asarray(plan.raw_route).tolist()
            log.add(self, "dropped", drop)
            return dataclasses.replace(  # a new plan: some policies hand out a plan again
                plan,
                actions={e: a for e, a in actions.items() if e != drop},
                route=np.asarray([e for e in route if e != drop], dtype=np.int64),
                raw_route=np.asarray(raw if drop in raw else [*raw, drop], dtype=np.int64),
            )

    return Dropping


def degraded(res: RunResult) -> int:
    """Routed experts the run's plans replaced by degradation (sequential decode)."""
    m = res.metrics
    true_accesses = m["decode_tokens"] * LAYERS * 2  # top-2
    return round(m["replaced_degraded_frac"] * true_accesses)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_the_plan_decode_layer_returns_is_the_one_the_run_executes(name: str, trace: Path) -> None:
    """Each expert an overriding decode_layer drops from its plan is one more degraded
    replacement in the run's routing fidelity than without the override."""
    opts = DROP_OPTIONS.get(name, {})
    base = run(BUILTIN[name](**opts), trace, "sequential", DROP_BUDGET)
    log = Log()
    res = run(dropping(BUILTIN[name], log)(**opts), trace, "sequential", DROP_BUDGET)
    drops = len(log.details("dropped"))
    assert drops > 0
    assert degraded(res) == degraded(base) + drops


def test_resources_override_sizes_the_run(trace: Path) -> None:
    """The run takes its memory model from the override's spec: with ``unlimited_memory`` set
    every policy gets every expert slot; all-gpu without it cannot place its experts in the
    budget it is given."""
    for name, cls in sorted(BUILTIN.items()):

        class Flipped(cls):  # type: ignore[valid-type,misc]
            def resources(self) -> ResourceSpec:
                spec = super().resources()
                return dataclasses.replace(spec, unlimited_memory=not spec.unlimited_memory)

        if cls().resources().unlimited_memory:
            with pytest.raises(PolicyError, match="budget"):
                run(Flipped(), trace, "sequential", BUDGET["sequential"])
        else:
            res = run(Flipped(), trace, "sequential", BUDGET["sequential"])
            assert res.config["gpu_experts"] == LAYERS * 8, name


# -- the cache base classes' hooks -------------------------------------------------------------


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize(("name", "opts"), CACHE_VARIANTS, ids=lambda x: str(x))
def test_cache_hooks_see_every_use_insertion_and_eviction(
    name: str, opts: dict[str, Any], setting: str, trace: Path
) -> None:
    """touch: once per hit and per fetched expert; inserted: once per expert that enters the
    cache (initial placement, fetches, prefetches); removed and choose_victim: once per
    eviction, and the victims the plans evict are choose_victim's, in order; init_state:
    once per instance, before the first insertion; serve (per-layer caches): once per
    decision."""
    log = Log()
    cls = caching_recording(BUILTIN[name], log)
    res = run(cls(**{**options_for(name, setting), **opts}), trace, setting, CACHE_BUDGET[setting])
    m = res.metrics
    total = lambda hook: sum(log.count(hook).values())  # noqa: E731
    assert m["evictions"] > 0
    assert total("touch") == m["decode_hits"] + m["prefill_hits"] + m["fetches"]
    placed = sum(len(p) for p in log.placed.values())
    assert total("inserted") == placed + m["fetches"] + m["prefetches"]
    assert total("removed") == total("choose_victim") == m["evictions"]
    assert log.victims == log.executed
    inits = log.count("init_state")
    assert set(inits.values()) == {1} and len(inits) == (2 if setting == "two-gpus" else 1)
    for inst in inits:
        hooks = [h for i, h, _ in log.calls if i == inst and h in ("init_state", "inserted")]
        assert hooks[0] == "init_state"
    if name in PER_LAYER:
        n = decisions(res, setting)
        assert log.count("serve") == dict.fromkeys(inits, sum(n.values()))
        assert total("unevictable") > 0


def highest_victim(cls: type[Policy], log: Log) -> type[Policy]:
    """``cls`` whose victim is the unprotected resident with the highest (layer, expert)."""

    class Highest(cls):  # type: ignore[valid-type,misc]
        def choose_victim(self, layer: int, protected: set[int], step: int) -> Any:
            if isinstance(self, GlobalCachingPolicy):
                slots = [(int(x), int(e)) for x, e in np.argwhere(self.cached)]
                slot = max(s for s in slots if not (s[0] == layer and s[1] in protected))
                log.victims.setdefault(id(self), []).append(slot)
                return slot
            e = max(x for x in self.cache[layer] if x not in protected)
            log.victims.setdefault(id(self), []).append((layer, e))
            return e

    return recording(Highest, log)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize(("name", "opts"), CACHE_VARIANTS, ids=lambda x: str(x))
def test_every_eviction_is_the_overriding_choose_victims_choice(
    name: str, opts: dict[str, Any], setting: str, trace: Path
) -> None:
    """An override of choose_victim that picks another victim than the policy's rule decides
    every eviction of the run, demand and prefetch, on every path."""
    opts = {**options_for(name, setting), **opts}
    base_log, log = Log(), Log()
    run(caching_recording(BUILTIN[name], base_log)(**opts), trace, setting, CACHE_BUDGET[setting])
    res = run(highest_victim(BUILTIN[name], log)(**opts), trace, setting, CACHE_BUDGET[setting])
    chosen = sum(len(v) for v in log.victims.values())
    assert chosen == res.metrics["evictions"] > 0
    assert log.victims == log.executed  # every victim the run evicted, in order
    assert log.victims != base_log.victims  # and they are not the policy's own


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize(
    ("name", "opts"), [v for v in CACHE_VARIANTS if v[0] in PER_LAYER], ids=lambda x: str(x)
)
def test_unevictable_experts_are_never_victims(
    name: str, opts: dict[str, Any], setting: str, trace: Path
) -> None:
    """Experts an overriding unevictable names are never evicted, though the policy's own
    choices evict them."""
    opts = {**options_for(name, setting), **opts}
    base_log = Log()
    run(caching_recording(BUILTIN[name], base_log)(**opts), trace, setting, CACHE_BUDGET[setting])
    # protect, in every layer, the expert the policy itself evicts most often
    evicted = [e for v in base_log.victims.values() for _, e in v]
    keep = max(set(evicted), key=evicted.count)
    log = Log()

    class Keeping(caching_recording(BUILTIN[name], log)):  # type: ignore[misc]
        def unevictable(self, layer: int) -> set[int] | None:
            return (super().unevictable(layer) or set()) | {keep}

    res = run(Keeping(**opts), trace, setting, CACHE_BUDGET[setting])
    executed = [e for v in log.executed.values() for _, e in v]
    assert res.metrics["evictions"] == len(executed) > 0
    assert keep not in executed


# -- each policy's own extension hooks -----------------------------------------------------------


@pytest.mark.parametrize("low_all", [False, True])
def test_hobbit_classify_decides_every_decode_token(low_all: bool, trace: Path) -> None:
    """classify is asked once per decode token-layer; loading nothing low-bit leaves no
    low-bit copy and no skipped expert, loading every miss low-bit leaves no decode fetch."""
    cls = BUILTIN["hobbit"]
    log = Log()

    class Classify(cls):  # type: ignore[valid-type,misc]
        def classify(
            self, experts: list[int], weights: list[float], resident: Any
        ) -> tuple[list[int], list[int]]:
            log.add(self, "classify")
            if low_all:
                return [e for e in experts if not resident[e]], []
            return [], []

    # thresholds at which this trace's tokens both load low-bit copies and skip experts
    opts = {"low_bit_threshold": 0.5, "skip_threshold": 0.6}
    base = run(cls(**opts), trace, "sequential", CACHE_BUDGET["sequential"])
    res = run(Classify(**opts), trace, "sequential", CACHE_BUDGET["sequential"])
    m = res.metrics
    assert len(log.details("classify")) == m["decode_tokens"] * LAYERS
    assert base.metrics["low_bit_copies"] > 0 and degraded(base) > 0
    assert degraded(res) == 0
    if low_all:  # every decode miss is a low-bit temporary copy
        assert m["low_bit_copies"] == m["decode_accesses"] - m["decode_hits"] > 0
    else:
        assert m["low_bit_copies"] == 0


@pytest.mark.parametrize("cpu", [False, True])
def test_daop_cpu_beats_copy_decides_every_prefill_expert(cpu: bool, trace: Path) -> None:
    """Every prefill expert that stays off the GPU runs where the overriding rule says: a
    temporary copy per call when it says copy, none when it says CPU."""
    cls = BUILTIN["daop"]
    log = Log()

    class Rule(cls):  # type: ignore[valid-type,misc]
        def cpu_beats_copy(self, count: int) -> bool:
            log.add(self, "cpu_beats_copy", count)
            return cpu

    m = run(Rule(), trace, "sequential", BUDGET["sequential"]).metrics
    calls = len(log.details("cpu_beats_copy"))
    assert calls > 0
    assert m["temp_copies"] == (0 if cpu else calls)


def test_ktransformers_gpu_expert_count_sets_the_placement(trace: Path) -> None:
    """The placement has as many GPU experts as an overriding gpu_expert_count asks for."""
    cls = BUILTIN["ktransformers"]

    class Eight(cls):  # type: ignore[valid-type,misc]
        def gpu_expert_count(self, moe_layers: int, experts: int) -> int:
            return 8

    log = Log()
    res = run(recording(Eight, log)(), trace, "sequential", BUDGET["sequential"])
    assert [len(p) for p in log.placed.values()] == [8]
    assert res.metrics["decode_hits"] > 0
    assert run(cls(), trace, "sequential", BUDGET["sequential"]).metrics["decode_hits"] == 0
