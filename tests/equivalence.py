"""Helpers of the reference-equivalence tests (tests/test_reference_engine.py, the mutants of
tests/test_mutants.py): run one configuration on the fast engine and on the reference engine
(simulator/reference/) and check that they agree on every operation, counter and busy time."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pandas as pd
import pytest

from daopsim.policies.base import Policy
from daopsim.policies.registry import get_policy_class
from daopsim.simulator.calibration import calibration_counts, split_sequences
from daopsim.simulator.core.loop import Engine
from daopsim.simulator.costs import cost_model, cpu_family_stream_gbs
from daopsim.simulator.data import resolve_trace
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.hardware_spec import HardwareProfile
from daopsim.simulator.hosttier import HostTierConfig
from daopsim.simulator.oracle import Oracle
from daopsim.simulator.recorder import Recorder
from daopsim.simulator.reference import ReferenceEngine
from daopsim.simulator.runtime_profiles import RuntimeProfile, get_runtime, with_costs
from daopsim.simulator.scheduler import step_oracle
from daopsim.simulator.serving import Serving
from daopsim.simulator.serving_config import ServingConfig
from daopsim.simulator.serving_requests import Request, dense, trim
from daopsim.simulator.testing import ChaosPolicy, random_routing, tiny_model
from daopsim.simulator.trace_format import SequenceRouting
from daopsim.simulator.trace_read import iter_sequences, read_meta, sequence_ids

#: seconds two engines may differ by on any start, end or counter
TOL = 1e-9
#: decode tokens kept per sequence (keeps the tests fast)
DECODE = 10
#: a runtime whose host thread is the bottleneck: dispatch far slower than the GPU kernels
SLOW_HOST = with_costs(get_runtime("hf-eager"), name="slow-host", dispatch_us=60.0, sync_us=40.0)
ENGINES = (Engine, ReferenceEngine)


def cut(r: SequenceRouting, decode: int) -> SequenceRouting:
    """The sequence's prompt and its first ``decode`` generated tokens."""
    n = r.n_prefill + decode
    arrays = {
        f.name: getattr(r, f.name)[:n]
        for f in dataclasses.fields(r)
        if isinstance(getattr(r, f.name), np.ndarray)
    }
    return dataclasses.replace(r, **arrays)


#: per-sequence calibration matrices of each trace (filled by ``inputs``)
EAMS: dict[str, list[np.ndarray]] = {}


@functools.cache
def inputs(trace: str) -> tuple[Any, list[SequenceRouting], np.ndarray, np.ndarray]:
    """Model, two cut evaluation sequences and calibration counts of a bundled trace."""
    path = resolve_trace(trace)
    meta = read_meta(path)
    ev, cal = split_sequences(meta, sequence_ids(path), None, False)
    seqs = [cut(r, DECODE) for r in iter_sequences(path, meta, sequences=set(ev[:2]))]
    dec, pre = calibration_counts(path, meta, cal, EAMS.setdefault(trace, []))
    return meta.model, seqs, dec, pre


def run_engine(
    cls: type,
    make: Any,
    model: Any,
    hw: HardwareProfile,
    budget: int,
    seqs: list[SequenceRouting],
    calib: tuple[Any, Any] = (None, None),
    runtime: str | RuntimeProfile | None = None,
    eams: tuple[np.ndarray, ...] | None = None,
    record: bool = True,
    **kw: Any,
) -> tuple[pd.DataFrame | None, Any, Any]:
    """Run ``make()`` on engine ``cls``; returns (timeline or None, RunStats, engine)."""
    pol = make()
    rt = get_runtime(pol.runtime_profile if runtime is None else runtime)
    if pol.resources().unlimited_memory:
        budget = model.total_experts
    oracle = None
    if pol.clairvoyant:
        oracle = Oracle(model.moe_layers, model.experts)
        for r in seqs:
            oracle.add(r)
    rec = Recorder() if record else None
    eng = cls(pol, model, cost_model(hw, model), budget, calib[0], calib[1], oracle, rec,
              runtime=rt, calibration_sequences=eams, **kw)  # fmt: skip
    if isinstance(pol, ChaosPolicy):
        pol.engine = eng
    stats = eng.run(iter(seqs))
    return (rec.timeline() if rec is not None else None), stats, eng


def assert_same(a: pd.DataFrame | None, b: pd.DataFrame | None, sa: Any, sb: Any) -> None:
    """Identical operations (within TOL seconds), counters and busy times."""
    if a is not None and b is not None:
        key = ["resource", "kind", "seq", "token", "layer", "expert", "start"]
        a = a.astype({"resource": str, "kind": str}).sort_values(key, kind="stable")
        b = b.astype({"resource": str, "kind": str}).sort_values(key, kind="stable")
        assert len(a) == len(b) > 0
        cols = ["resource", "kind", "seq", "token", "layer", "expert", "bytes"]
        assert (a[cols].to_numpy() == b[cols].to_numpy()).all()
        np.testing.assert_allclose(a["start"].to_numpy(), b["start"].to_numpy(), rtol=0, atol=TOL)
        np.testing.assert_allclose(a["end"].to_numpy(), b["end"].to_numpy(), rtol=0, atol=TOL)
    ca, cb = dataclasses.asdict(sa.counters), dataclasses.asdict(sb.counters)
    for k, va in ca.items():
        np.testing.assert_allclose(
            np.asarray(va, float), np.asarray(cb[k], float), atol=TOL, rtol=0, err_msg=k
        )
    assert sa.e2e == pytest.approx(sb.e2e, abs=TOL, rel=0)
    assert sa.busy == pytest.approx(sb.busy, abs=1e-6, rel=0)
    assert sa.host_tier == (pytest.approx(sb.host_tier, abs=TOL) if sb.host_tier else None)


def both(
    policy: str,
    trace: str,
    ratio: float,
    hw: HardwareProfile,
    runtime: str | RuntimeProfile | None = None,
    record: bool = True,
    **opts: Any,
) -> pd.DataFrame | None:
    """A built-in policy on two cut sequences of a bundled trace, on both engines; they must
    agree. Returns the fast engine's timeline."""
    model, seqs, dec, pre = inputs(trace)
    budget = max(1, round(ratio * model.total_experts))
    make = functools.partial(get_policy_class(policy), **opts)
    eams = tuple(EAMS[trace])
    out = [run_engine(cls, make, model, hw, budget, seqs, (dec, pre), runtime, eams, record)
           for cls in ENGINES]  # fmt: skip
    (ta, sa, _), (tb, sb, _) = out
    assert_same(ta, tb, sa, sb)
    return ta


def one_copy_engine(name: str) -> HardwareProfile:
    """A bundled profile with both copy directions on one engine."""
    hw = load_profile(name)
    return dataclasses.replace(hw, link=dataclasses.replace(hw.link, copy_engines=1))


def engines_per_direction(hw: HardwareProfile, n: int = 2) -> HardwareProfile:
    """``hw`` with ``n`` copy engines in each direction (``2 n`` in all)."""
    link = dataclasses.replace(hw.link, copy_engines=2 * n, copy_engines_per_direction=n)
    return dataclasses.replace(hw, link=link)


def wide_socket(name: str, factor: float = 1.7) -> HardwareProfile:
    """A bundled profile whose socket streams ``factor`` x what one CPU call takes (partial
    shares: concurrent calls overlap before they slow each other down)."""
    hw = load_profile(name)
    stream = cpu_family_stream_gbs(hw.cpu, "torch_bf16")
    return dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, socket_bw_gbs=stream * factor))


def slow_cpu(hw: HardwareProfile, factor: float = 50.0) -> HardwareProfile:
    """``hw`` with a CPU ``factor`` times slower, so calls overlap copies and kernels."""
    stream = cpu_family_stream_gbs(hw.cpu, "torch_bf16")
    return dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, mem_bw_gbs=stream / factor))


def slow_link(hw: HardwareProfile, factor: float = 20.0) -> HardwareProfile:
    """``hw`` with a host link ``factor`` times slower, so copies outlast layers (a plan's
    victims may still be in flight)."""
    link = hw.link
    return dataclasses.replace(
        hw,
        link=dataclasses.replace(
            link,
            h2d_pinned_gbs=link.h2d_pinned_gbs / factor,
            d2h_pinned_gbs=link.d2h_pinned_gbs / factor,
            h2d_pageable_gbs=link.h2d_pageable_gbs / factor,
            d2h_pageable_gbs=link.d2h_pageable_gbs / factor,
            copy_overhead_us=link.copy_overhead_us * factor,
        ),
    )


def chaos(
    cls: type,
    seed: int,
    hw: HardwareProfile,
    budget: int,
    runtime: str | RuntimeProfile | None = "ideal",
    record: bool = True,
    host_tier: HostTierConfig | None = None,
    workers: int | None = None,
    **spec: Any,
) -> tuple[pd.DataFrame | None, Any, Any]:
    """Random legal plans (``ChaosPolicy``: every action, prefetch, eviction, pre-calculation)
    on a 3-layer, 6-expert model, seeded: workers (unless given) and buffers drawn from
    ``seed``."""
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    rng = np.random.default_rng(seed)
    drawn, bufs = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    workers = drawn if workers is None else workers
    seqs = [random_routing(model, s, 3, 5, rng) for s in range(2)]

    def make() -> Policy:
        return ChaosPolicy(rng, workers, bufs, **spec)

    return run_engine(cls, make, model, hw, budget, seqs, runtime=runtime, record=record,
                      host_tier=host_tier)  # fmt: skip


def chaos_both(seed: int, hw: HardwareProfile, budget: int, **kw: Any) -> Any:
    """``chaos`` on both engines; they must agree. Returns the fast engine's statistics."""
    (ta, sa, ea), (tb, sb, eb) = (chaos(cls, seed, hw, budget, **kw) for cls in ENGINES)
    assert_same(ta, tb, sa, sb)
    assert (ea.resident == eb.resident).all()  # the same experts resident at the end
    return sa


def in_flight_both(seed: int) -> Any:
    """``chaos_both`` with victims whose copy may still be in flight (``in_flight``), on a
    slow link so that copies outlast layers; the seed picks the machine (an A6000, or an RTX
    4090 with an SSD tier on odd seeds, through the page cache or GPUDirect Storage),
    write-back, staging slots, one stream, the plan flags and the runtime."""
    model = tiny_model(experts=6, top_k=2, moe_layers=3)
    host = ("a6000-pcie4", "rtx4090-990pro-pcie4")[seed % 2]
    hw = slow_link(load_profile(host))
    tier = host_tier(model, hw, 2 + seed % 3, ("page-cache", "gds")[seed // 2 % 2])
    return chaos_both(seed, hw, 3 + seed % 2, runtime=("ideal", "hf-eager", SLOW_HOST)[seed % 3],
                      host_tier=tier if seed % 2 else None, writeback=seed % 4 < 2,
                      staging_buffers=seed % 3 // 2, one_stream=seed == 6, flags=seed % 3 == 1,
                      in_flight=True)  # fmt: skip


def serving_run(
    cls: type,
    policy: str,
    hw: HardwareProfile,
    config: ServingConfig,
    arrivals: list[float],
    options: dict[str, Any] | None = None,
) -> tuple[pd.DataFrame, Any, Any]:
    """Batched steps (ci-small's two cut sequences, each replayed twice) on one engine."""
    model, seqs, dec, pre = inputs("ci-small")
    pol = get_policy_class(policy)(**(options or {}))
    budget = model.total_experts if pol.resources().unlimited_memory else model.total_experts // 4
    reqs = [
        Request(i, int(r.seq_id), t, r.n_prefill, r.n_decode,
                trim(dense(r, model.experts), r.n_prefill, r.n_decode, i))
        for i, (r, t) in enumerate(zip(seqs * 2, arrivals, strict=True))
    ]  # fmt: skip
    oracle = None
    if pol.clairvoyant:
        oracle = step_oracle(
            reqs, config.batch, config.continuous, None, Oracle(model.moe_layers, model.experts)
        )
    rec = Recorder()
    rt = get_runtime(pol.runtime_profile)  # the host thread in batched steps too
    eng = cls(pol, model, cost_model(hw, model), budget, dec, pre, oracle, rec,
              runtime=rt, calibration_sequences=tuple(EAMS["ci-small"]))  # fmt: skip
    eng.serving = Serving(reqs, config, None)
    stats = eng.run(iter(()))
    return rec.timeline(), stats, eng


def host_tier(model: Any, hw: HardwareProfile, capacity: int, path: str) -> HostTierConfig:
    """A host-memory budget holding ``capacity`` expert copies (the others on the drive)."""
    costs = cost_model(hw, model)
    eb, ne = costs.host_expert_bytes, costs.host_nonexpert_bytes
    return HostTierConfig(
        budget_bytes=ne + capacity * eb,
        path=path,
        capacity=capacity,
        total=model.total_experts,
        nonexpert_bytes=ne,
        expert_bytes=eb,
    )
