"""Global caches: global-lru, global-lfu and belady-global against an independent counter.

A few lines of pure Python replay the evaluation sequences with ONE cache over all
``(layer, expert)`` slots and the engine's serving rule (a step's experts of a layer are served
together; hits are judged before that layer's insertions; a miss evicts a victim of any layer
that the step does not need in this layer; when every resident slot is needed the miss goes
through a temporary buffer and is not cached). Belady's reference scans the future accesses in
(step, layer) order itself instead of asking the runner's oracle. Their hit counts must equal
the engine's exactly. Then the bounds: per-layer Belady has at least the hits of every
per-layer cache, global Belady at least those of every global cache, at the same budget; and
the global and per-layer caches each win on some trace.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_conformance import HW, Step, eval_steps

from daopsim.policies.base import SetupContext
from daopsim.policies.placement import per_layer_quota
from daopsim.policies.registry import available, make_policy
from daopsim.simulator.cli import main
from daopsim.simulator.costs import cost_model
from daopsim.simulator.data import resolve_trace
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.models import ModelShape
from daopsim.simulator.oracle import Oracle
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import make_meta, make_trace, routing_from_experts, tiny_model
from daopsim.simulator.trace_read import read_meta
from daopsim.simulator.trace_write import write_trace

GLOBAL = ("global-lru", "global-lfu", "belady-global")
Slot = tuple[int, int]
NEVER = (float("inf"), float("inf"))


def count_global_hits(
    steps: list[Step], is_prefill: list[bool], n_layers: int, n_exp: int, budget: int, rule: str
) -> tuple[int, int, int, int]:
    """(decode hits, decode accesses, prefill hits, prefill accesses) of one global cache."""
    quota = per_layer_quota(budget, n_layers)
    cache: list[Slot] = [(la, e) for la in range(n_layers) for e in range(min(quota[la], n_exp))]
    clock = 0
    last: dict[Slot, int] = {}
    freq: dict[Slot, int] = {}
    for slot in cache:
        clock += 1
        last[slot] = clock
    uses: dict[Slot, list[tuple[int, int]]] = {}
    for s, step in enumerate(steps):
        for layer, (need, _w) in enumerate(step):
            for e in need:
                uses.setdefault((layer, e), []).append((s, layer))

    def next_use(slot: Slot, now: tuple[int, int]) -> tuple[float, float]:
        lst = uses.get(slot, [])
        i = bisect.bisect_right(lst, now)
        return lst[i] if i < len(lst) else NEVER

    dh = da = ph = pa = 0
    for s, step in enumerate(steps):
        for layer, (need, weight) in enumerate(step):
            for e, w in zip(need, weight, strict=True):
                freq[layer, e] = freq.get((layer, e), 0) + w
            hits = [e for e in need if (layer, e) in cache]
            for e in hits:
                clock += 1
                last[layer, e] = clock
            if is_prefill[s]:
                ph, pa = ph + len(hits), pa + len(need)
            else:
                dh, da = dh + len(hits), da + len(need)
            for e in need:
                if (layer, e) in cache:
                    continue
                if len(cache) >= budget:
                    cands = [x for x in cache if not (x[0] == layer and x[1] in need)]
                    if not cands:
                        continue  # temporary buffer, not cached
                    if rule == "global-lru":
                        v = min(cands, key=lambda x: last[x])
                    elif rule == "global-lfu":
                        v = min(cands, key=lambda x: (freq.get(x, 0), last[x]))
                    else:  # farthest next use; max() keeps the first, i.e. lowest (layer, e)
                        v = max(sorted(cands), key=lambda x: next_use(x, (s, layer)))
                    cache.remove(v)
                cache.append((layer, e))
                clock += 1
                last[layer, e] = clock
    return dh, da, ph, pa


def _write(path: Path, layers: list[list[list[int]]], prefill: int = 0) -> Path:
    """A one-sequence tiny-model trace (4 layers x 8 experts, top-2) from explicit routing."""
    m = tiny_model()
    return write_trace(path, make_meta(m), [routing_from_experts(m, layers, n_prefill=prefill)])


def skewed(path: Path, tokens: int = 60, seed: int = 0) -> Path:
    """Layer 0 picks 2 of 8 experts uniformly; layers 1-3 always use the same 2 experts."""
    rng = np.random.default_rng(seed)
    rows = [
        [sorted(rng.choice(8, 2, replace=False).tolist()), [0, 1], [2, 3], [4, 5]]
        for _ in range(tokens)
    ]
    return _write(path, rows, prefill=4)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[int]]]:
    """Random tiny traces (with prefill), a skewed one and the bundled ci-small, with budgets."""
    d = tmp_path_factory.mktemp("global")
    return {
        "tiny-11": (make_trace(d / "a.parquet", sequences=4, prefill=6, decode=12, seed=11), []),
        "tiny-12": (make_trace(d / "b.parquet", sequences=3, prefill=0, decode=20, seed=12), []),
        "skewed": (skewed(d / "skewed.parquet"), []),
        "ci-small": (resolve_trace("ci-small"), [40, 96, 120]),
    }


def _budgets(name: str, traces: dict[str, tuple[Path, list[int]]]) -> list[int]:
    # 1 and 2 slots force the temporary-buffer path (fewer slots than a token's experts)
    return traces[name][1] or [1, 2, 3, 6, 10, 17, 25]


@pytest.mark.parametrize("rule", GLOBAL)
@pytest.mark.parametrize("name", ["tiny-11", "tiny-12", "skewed", "ci-small"])
def test_engine_hits_equal_an_independent_counter(rule: str, name: str, traces: dict) -> None:
    path = traces[name][0]
    meta = read_meta(path)
    steps, pre = eval_steps(path)
    n_layers, n_exp = meta.model.moe_layers, meta.model.experts
    for b in _budgets(name, traces):
        m = simulate(rule, HW, path, gpu_experts=b, record=False).metrics
        dh, da, ph, pa = count_global_hits(steps, pre, n_layers, n_exp, b, rule)
        assert (m["decode_hits"], m["decode_accesses"]) == (dh, da), (name, b)
        assert (m["prefill_hits"], m["prefill_accesses"]) == (ph, pa), (name, b)
        assert m["fetches"] == (da - dh) + (pa - ph) - m["temp_copies"]
        if b == 1:
            assert m["temp_copies"] > 0  # the path where only this token's experts are cached


def test_global_counter_rules_differ() -> None:
    """The three counters are not one function (else the conformance test is weak)."""
    rng = np.random.default_rng(5)
    steps = [
        [(sorted(rng.choice(8, 2, replace=False).tolist()), [1, 1]) for _ in range(3)]
        for _ in range(300)
    ]
    pre = [False] * len(steps)
    got = {rule: count_global_hits(steps, pre, 3, 8, 9, rule)[0] for rule in GLOBAL}
    assert len(set(got.values())) == 3, got


def _total_hits(policy: str, path: Path, budget: int) -> int:
    m = simulate(policy, HW, path, gpu_experts=budget, record=False).metrics
    return int(m["decode_hits"] + m["prefill_hits"])


@pytest.mark.parametrize("name", ["tiny-11", "tiny-12", "skewed", "ci-small"])
def test_each_belady_bounds_its_caching_policies(name: str, traces: dict) -> None:
    """MIN minimises misses over all accesses (prefill and decode), so compare total hits."""
    path = traces[name][0]
    for b in (b for b in _budgets(name, traces) if b > 2):
        bel = _total_hits("belady", path, b)
        for pol in ("lru", "lfu", "round-robin"):
            assert bel >= _total_hits(pol, path, b), (name, b, pol)
        bel_g = _total_hits("belady-global", path, b)
        for pol in ("global-lru", "global-lfu"):
            assert bel_g >= _total_hits(pol, path, b), (name, b, pol)


def test_global_lru_wins_on_skewed_layers(traces: dict) -> None:
    """Three layers need only 2 experts each: a shared cache gives layer 0 the rest."""
    path = traces["skewed"][0]
    for b in (12, 16):
        glob = simulate("global-lru", HW, path, gpu_experts=b, record=False)
        per = simulate("lru", HW, path, gpu_experts=b, record=False)
        assert glob.metrics["decode_hits"] > per.metrics["decode_hits"], b
        # per-layer quotas of 3-4 cannot hold layer 0's 8 experts; one cache of 12 can
        assert glob.per_layer_hit_rate[0] > per.per_layer_hit_rate[0]


def test_global_lru_loses_on_uniform_layers(traces: dict) -> None:
    """Layers visited in a loop: the least recent slots belong to the layer about to run."""
    path = traces["ci-small"][0]
    glob = simulate("global-lru", HW, path, gpu_experts=96, record=False).metrics
    per = simulate("lru", HW, path, gpu_experts=96, record=False).metrics
    assert glob["decode_hits"] < per["decode_hits"]


def test_victims_may_come_from_another_layer(tmp_path: Path) -> None:
    """Budget 12 over 4 layers: layer 0 cycles over 3 pairs, layers 1-3 use experts 0-1."""
    rows = [[[e, e + 1], [0, 1], [0, 1], [0, 1]] for e in (3, 5, 1) * 3]
    path = _write(tmp_path / "t.parquet", rows)
    glob = simulate("global-lru", HW, path, gpu_experts=12, record=False)
    per = simulate("lru", HW, path, gpu_experts=12, record=False)
    # per layer, layer 0 has 3 slots and its three pairs evict each other in a loop; one cache
    # takes the slots of layers 1-3's unused experts 2 and holds all six
    assert per.per_layer_hit_rate[0] == 0
    assert glob.per_layer_hit_rate[0] == pytest.approx(6 / 9)
    assert glob.per_layer_hit_rate[1:] == per.per_layer_hit_rate[1:] == [1.0, 1.0, 1.0]


def _ctx(m: ModelShape, budget: int, **kw: object) -> SetupContext:
    costs = cost_model(load_profile(HW), m)
    return SetupContext(m, budget, costs, kw.pop("calibration", None), None, **kw)  # type: ignore[arg-type]


def test_belady_global_ties_and_order() -> None:
    """Never-used-again slots go first, lowest (layer, expert); a later layer of the current
    step is nearer than an earlier layer of the next step."""
    m = tiny_model(experts=4, top_k=1, moe_layers=3)
    # expert 0 of every layer at step 0 only; expert 1 at step 1 in every layer
    r = routing_from_experts(m, [[[0], [0], [0]], [[1], [1], [1]]])
    oracle = Oracle(3, 4)
    oracle.add(r)
    pol = make_policy("belady-global", {"initial": "empty"})
    pol.setup(_ctx(m, 6, oracle=oracle))
    for slot in ((2, 0), (1, 0), (2, 1), (1, 1), (0, 1)):
        pol.inserted(*slot, 0)
    # never used again: (1, 0) and (2, 0) -> the lower layer
    assert pol.choose_victim(0, {0}, 0) == (1, 0)
    pol.removed(1, 0)
    assert pol.choose_victim(0, {0}, 0) == (2, 0)
    pol.removed(2, 0)
    # all next used at step 1: layer 2 comes last in that step
    assert pol.choose_victim(0, {1}, 0) == (2, 1)
    # deciding at layer 1 of step 0: (2, 1) is protected only in its own layer
    assert pol.choose_victim(2, {1}, 0) == (1, 1)


def test_initial_popular_is_the_global_top() -> None:
    """initial=popular places the budget's most selected slots over all layers."""
    m = tiny_model()
    calib = np.zeros((4, 8), dtype=np.int64)
    calib[0, [5, 6, 7]] = [9, 8, 7]
    calib[2, 1] = 8
    pol = make_policy("global-lfu", {"initial": "popular"})
    assert pol.uses_calibration()
    slots = list(pol.setup(_ctx(m, 4, calibration=calib)))
    assert slots == [(0, 5), (0, 6), (0, 7), (2, 1)]
    first = make_policy("global-lfu", {})
    assert list(first.setup(_ctx(m, 6))) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (3, 0)]


def test_policies_list_and_run_bounds(tmp_path: Path) -> None:
    """The three are listed; `daopsim run` names the per-layer and the global bound."""
    assert {"global-lru", "global-lfu", "belady-global"} <= set(available())
    assert available()["belady-global"].clairvoyant
    assert not available()["global-lru"].clairvoyant
    runner = CliRunner()
    out = runner.invoke(main, ["policies", "list"]).output
    for name in GLOBAL:
        assert name in out
    args = ["run", "--trace", "ci-small", "--sequences", "1", "--gpu-experts", "96"]
    res = runner.invoke(main, [*args, "--policy", "global-lru", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    b = doc["bounds"]
    assert b["belady_per_layer"]["scope"] == "per layer"
    assert b["belady_global"]["scope"] == "global"
    assert b["belady"]["hit_rate"] == b["belady_per_layer"]["hit_rate"]
    assert b["belady_global"]["hit_rate"] >= doc["metrics"]["hit_rate"]
    table = runner.invoke(main, [*args, "--policy", "global-lru"]).output
    assert "belady (per layer) hit rate" in table and "belady-global hit rate" in table
    # beside a policy that is not a cache, only the per-layer bound
    res = runner.invoke(main, [*args, "--policy", "static", "--json"])
    assert res.exit_code == 0, res.output
    assert "belady_global" not in json.loads(res.output)["bounds"]
