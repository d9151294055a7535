"""Conformance: the engine's cache accounting equals plain independent counters.

For lru, lfu and belady, a few lines of pure Python replay the same evaluation sequences with
the same per-layer capacity and the same rules (a step is a prefill pass or a decode token;
hits are judged before insertions; a miss is inserted, evicting a victim that the step does not
need; when every resident expert is needed the miss goes through a temporary buffer and is not
inserted). Their hit counts must equal the engine's exactly. Then two orderings that must hold
on any trace: Belady's hit rate is never below LRU's, and all-gpu is never slower than any policy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from daopsim.policies.placement import per_layer_quota
from daopsim.policies.registry import available
from daopsim.simulator.calibration import split_sequences
from daopsim.simulator.data import resolve_trace
from daopsim.simulator.errors import UserError
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import make_trace
from daopsim.simulator.trace_read import iter_sequences, read_meta, sequence_ids

HW = "a6000-pcie4"

# one step = (layer -> needed experts in service order, layer -> per-expert weight for LFU)
Step = list[tuple[list[int], list[int]]]


def eval_steps(path: Path) -> tuple[list[Step], list[bool]]:
    """Per step and layer: the needed experts in the engine's service order, and their weights."""
    meta = read_meta(path)
    # lru, lfu and belady use no calibration data, so every sequence is evaluated
    ids, _cal = split_sequences(meta, sequence_ids(path), None, False, hold_out=False)
    steps: list[Step] = []
    is_prefill: list[bool] = []
    for r in iter_sequences(path, meta, sequences=set(ids)):
        p = r.n_prefill
        if p:
            step: Step = []
            for layer in range(r.experts.shape[1]):
                c = np.bincount(r.experts[:p, layer, :].reshape(-1), minlength=meta.model.experts)
                order = sorted(np.flatnonzero(c).tolist(), key=lambda e: (-c[e], e))
                step.append((order, [int(c[e]) for e in order]))
            steps.append(step)
            is_prefill.append(True)
        for t in range(p, r.n_tokens):
            step = [(row.tolist(), [1] * len(row)) for row in r.experts[t]]
            steps.append(step)
            is_prefill.append(False)
    return steps, is_prefill


def count_hits(
    steps: list[Step], is_prefill: list[bool], n_layers: int, budget: int, rule: str
) -> tuple[int, int, int, int]:
    """(decode hits, decode accesses, prefill hits, prefill accesses) of a per-layer cache."""
    quota = per_layer_quota(budget, n_layers)
    cache = [list(range(q)) for q in quota]
    clock = 0
    last: dict[tuple[int, int], int] = {}
    freq: dict[tuple[int, int], int] = {}
    for layer in range(n_layers):
        for e in cache[layer]:
            clock += 1
            last[layer, e] = clock

    def next_use(layer: int, e: int, now: int) -> float:
        for s in range(now + 1, len(steps)):
            if e in steps[s][layer][0]:
                return float(s)
        return float("inf")

    dh = da = ph = pa = 0
    for s, step in enumerate(steps):
        for layer, (need, weight) in enumerate(step):
            for e, w in zip(need, weight, strict=True):
                freq[layer, e] = freq.get((layer, e), 0) + w
            c = cache[layer]
            hits = [e for e in need if e in c]
            for e in hits:
                clock += 1
                last[layer, e] = clock
            if is_prefill[s]:
                ph, pa = ph + len(hits), pa + len(need)
            else:
                dh, da = dh + len(hits), da + len(need)
            for e in need:
                if e in c:
                    continue
                if len(c) >= quota[layer]:
                    cands = [x for x in c if x not in need]
                    if not cands:
                        continue  # temporary buffer, not cached
                    if rule == "lru":
                        v = min(cands, key=lambda x: last[layer, x])
                    elif rule == "lfu":
                        v = min(cands, key=lambda x: (freq.get((layer, x), 0), last[layer, x]))
                    else:
                        v = min(cands, key=lambda x: (-next_use(layer, x, s), x))
                    c.remove(v)
                c.append(e)
                clock += 1
                last[layer, e] = clock
    return dh, da, ph, pa


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 5-sequence trace of the tiny model (4 layers x 8 experts, top-2)."""
    path = tmp_path_factory.mktemp("conf") / "tiny.parquet"
    return make_trace(path, sequences=5, prefill=6, decode=10, seed=11)


def _traces(tiny: Path) -> list[tuple[Path, list[int]]]:
    return [(tiny, [3, 6, 10, 17]), (resolve_trace("ci-small"), [40, 96, 120])]


@pytest.mark.parametrize("rule", ["lru", "lfu", "belady"])
def test_engine_hits_equal_an_independent_counter(rule: str, tiny_path: Path) -> None:
    for path, budgets in _traces(tiny_path):
        meta = read_meta(path)
        steps, pre = eval_steps(path)
        for b in budgets:
            res = simulate(rule, HW, path, gpu_experts=b, record=False)
            m = res.metrics
            dh, da, ph, pa = count_hits(steps, pre, meta.model.moe_layers, b, rule)
            assert da == m["decode_tokens"] * meta.model.moe_layers * meta.model.top_k
            assert round(m["hit_rate"] * da) == dh, (path.name, b, m["hit_rate"], dh / da)
            assert m["hit_rate"] == pytest.approx(dh / da, rel=1e-12)
            if pa:
                assert m["prefill_hit_rate"] == pytest.approx(ph / pa, rel=1e-12)
            assert m["fetches"] == (da - dh) + (pa - ph) - m["temp_copies"]


def test_counter_rules_differ() -> None:
    """The three counters are not the same function (else the conformance test is weak)."""
    rng = np.random.default_rng(5)
    steps = [[(sorted(rng.choice(8, 2, replace=False).tolist()), [1, 1])] for _ in range(400)]
    pre = [False] * len(steps)
    got = {rule: count_hits(steps, pre, 1, 4, rule)[0] for rule in ("lru", "lfu", "belady")}
    assert len(set(got.values())) == 3, got


def test_belady_never_below_lru(tiny_path: Path) -> None:
    for path, budgets in _traces(tiny_path):
        for b in budgets:
            lru = simulate("lru", HW, path, gpu_experts=b, record=False).metrics["hit_rate"]
            bel = simulate("belady", HW, path, gpu_experts=b, record=False)
            assert bel.config["bound"] is True
            assert bel.metrics["hit_rate"] >= lru - 1e-12, (path.name, b)


@pytest.fixture(scope="module")
def mixtral_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random trace of the Mixtral-8x7B shape (realistic costs)."""
    path = tmp_path_factory.mktemp("conf") / "mixtral.parquet"
    return make_trace(path, model="mixtral-8x7b", sequences=4, prefill=8, decode=10, seed=3)


def _all_policies() -> list[str]:
    return [p for p in available() if p != "all-gpu"]


@pytest.mark.parametrize("policy", _all_policies())
def test_all_gpu_is_never_slower(policy: str, mixtral_path: Path) -> None:
    """On Mixtral-shaped traces. (On the toy tiny_model shape a CPU expert costs less than a
    GPU one's kernel launches, so CPU-GPU parallel policies can beat all-gpu there.)"""
    cases: list[tuple[Path, int]] = [(mixtral_path, 64), (mixtral_path, 110)]
    cases += [(resolve_trace("ci-small"), 64), (resolve_trace("ci-small"), 120)]
    ran = 0
    bound: Callable[[Path], float] = lambda p: simulate(  # noqa: E731
        "all-gpu", HW, p, record=False
    ).metrics["e2e_s"]
    cache: dict[Path, float] = {}
    for path, b in cases:
        try:
            m = simulate(policy, HW, path, gpu_experts=b, record=False).metrics
        except UserError:
            continue  # e.g. a mode that needs more slots than this budget
        if path not in cache:
            cache[path] = bound(path)
        assert cache[path] <= m["e2e_s"] * (1 + 1e-12), (policy, path.name, b)
        ran += 1
    assert ran >= 2, f"{policy} ran on fewer than two cases"
