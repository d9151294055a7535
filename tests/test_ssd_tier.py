"""The SSD tier (docs/serving.md, "An SSD tier"): invariants that try to break it.

Host-memory budget never exceeded, every expert read from the drive at most once per host
residency, the drive lane serving one read at a time, no budget (or one that holds every
expert) identical to today, a smaller budget never reading less, GPUDirect Storage moving no
host-memory bytes, the fast and the reference engine agreeing on SSD runs, and bad input as
one-line errors.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from daopsim.policies.base import Plan, View
from daopsim.policies.lru import LRUPolicy
from daopsim.simulator.cli import main
from daopsim.simulator.costs import cost_model
from daopsim.simulator.data import resolve_trace
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.recorder import Recorder
from daopsim.simulator.runner import simulate
from daopsim.simulator.trace_read import read_meta

HW = "rtx4090-990pro-pcie4"  # 64 GB host memory, a Samsung 990 PRO
NOMEM = "rtx4090-pcie4"  # states no host memory and has no [ssd] table
TOL = 1e-9
SSD_KEYS = ("ssd_bytes", "ssd_reads", "ssd_stall_s", "host_memory_peak_bytes")


def _run(policy: str, hw: str = HW, **kw: Any) -> Any:
    kw.setdefault("sequences", 1)
    kw.setdefault("trace", "ci-small")
    return simulate(policy=policy, hw=hw, **kw)


def _raw_rows(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every recorded operation in the order the engine recorded it (issue order for the
    drive and the page cache), not sorted by start."""
    rows: list[tuple[Any, ...]] = []
    orig = Recorder.op

    def op(self: Recorder, *args: Any) -> None:
        rows.append(args)
        orig(self, *args)

    monkeypatch.setattr(Recorder, "op", op)
    return rows


def _sizes() -> tuple[int, int, int]:
    """Non-expert bytes, expert bytes and experts of ci-small's model at bf16."""
    model = read_meta(resolve_trace("ci-small")).model
    costs = cost_model(load_profile(HW), model)
    return costs.host_nonexpert_bytes, costs.host_expert_bytes, model.total_experts


@pytest.mark.parametrize(
    ("policy", "path", "gb"),
    [
        ("lru", "page-cache", 20.0),
        ("lru", "page-cache", 50.0),
        ("fiddler", "page-cache", 30.0),
        ("llama-cpp-mmap", "page-cache", 25.0),
        ("mixtral-offloading", "page-cache", 30.0),
        ("daop", "gds", 30.0),
    ],
)
def test_host_budget_never_exceeded_and_one_read_per_residency(
    monkeypatch: pytest.MonkeyPatch, policy: str, path: str, gb: float
) -> None:
    rows = _raw_rows(monkeypatch)
    r = _run(policy, host_memory_gb=gb, ssd_path=path)
    ne, eb, total = _sizes()
    budget = int(gb * 1e9)
    cap = r.config["host_expert_capacity"]
    assert 0 < cap < total
    assert r.metrics["host_memory_peak_bytes"] <= budget
    assert r.metrics["host_memory_budget_bytes"] == budget
    # replay the page cache from the recorded reads and evictions, in issue order
    n_exp = 8
    resident = {divmod(i, n_exp) for i in range(cap)}
    peak = len(resident)
    reads = evicts = 0
    for _resource, kind, _sid, _tok, layer, expert, *_ in rows:
        slot = (layer, expert)
        if kind == "host_evict":
            assert slot in resident, f"evicted {slot} which the host does not hold"
            resident.remove(slot)
            evicts += 1
        elif kind == "ssd_read":
            assert slot not in resident, f"read {slot} from the SSD while the host holds it"
            resident.add(slot)
            reads += 1
        elif kind == "gds_read":
            assert slot not in resident, f"read {slot} from the SSD while the host holds it"
            reads += 1
        elif kind == "host_insert":  # a write-back lands a host copy without a drive read
            assert slot not in resident
            resident.add(slot)
        peak = max(peak, len(resident))
        assert ne + len(resident) * eb <= budget
    assert reads == r.metrics["ssd_reads"] > 0
    assert evicts == r.metrics["host_evictions"]
    assert ne + peak * eb <= r.metrics["host_memory_peak_bytes"] <= budget


@pytest.mark.parametrize(("policy", "path"), [("lru", "page-cache"), ("fiddler", "gds")])
def test_drive_lane_serves_one_read_at_a_time(policy: str, path: str) -> None:
    r = _run(policy, host_memory_gb=30.0, ssd_path=path)
    tl = r.timeline
    ssd = tl[tl["resource"] == "ssd"].sort_values("start", kind="stable")
    assert len(ssd) == r.metrics["ssd_reads"] > 0
    starts, ends = ssd["start"].to_numpy(), ssd["end"].to_numpy()
    assert np.all(starts[1:] >= ends[:-1] - TOL), "two reads overlap on one drive"
    ssd_spec = load_profile(HW).ssd
    assert ssd_spec is not None
    dur = ends - starts
    _, eb, _ = _sizes()
    expected = ssd_spec.read_latency_us * 1e-6 + eb / (ssd_spec.seq_read_gbps * 1e9)
    assert np.allclose(dur, expected, rtol=1e-12)
    assert (ssd["bytes"] == eb).all()
    busy = float(dur.sum())
    assert r.metrics["ssd_busy_frac"] == pytest.approx(busy / r.metrics["e2e_s"])


@pytest.mark.parametrize("policy", ["lru", "fiddler", "llama-cpp-cpu-moe", "mixtral-offloading"])
def test_no_budget_or_a_budget_holding_everything_is_today(policy: str) -> None:
    today = _run(policy, hw=NOMEM)
    assert not any(k in today.metrics for k in SSD_KEYS)
    assert "host_memory_gb" not in today.config
    roomy = _run(policy, hw=NOMEM, host_memory_gb=1000.0)
    assert roomy.metrics["ssd_reads"] == 0 and roomy.metrics["ssd_bytes"] == 0
    ne, eb, total = _sizes()
    assert roomy.metrics["host_memory_peak_bytes"] == ne + total * eb
    for k, v in today.metrics.items():
        assert roomy.metrics[k] == v or (v != v and roomy.metrics[k] != roomy.metrics[k]), k
    pd.testing.assert_frame_equal(today.timeline, roomy.timeline)


@pytest.mark.parametrize("policy", ["lru", "llama-cpp-mmap"])
def test_smaller_host_budget_reads_more(policy: str) -> None:
    budgets = [15.0, 25.0, 40.0, 60.0, 80.0, 95.0]
    got = [_run(policy, host_memory_gb=gb, record=False).metrics for gb in budgets]
    read = [m["ssd_bytes"] for m in got]
    assert all(a >= b for a, b in itertools.pairwise(read)), read
    assert read[0] > read[-2] > 0 and read[-1] == 0  # 95 GB holds all of Mixtral at bf16
    e2e = [m["e2e_s"] for m in got]
    assert e2e[0] > e2e[-1]


def test_gds_moves_no_host_memory_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _raw_rows(monkeypatch)
    page = _run("lru", host_memory_gb=30.0, ssd_path="page-cache")
    n_page = len(rows)
    gds = _run("lru", host_memory_gb=30.0, ssd_path="gds")
    gds_rows = rows[n_page:]
    assert gds.metrics["ssd_reads"] > 0
    kinds = {row[1] for row in gds_rows}
    assert "ssd_read" not in kinds and "host_evict" not in kinds and "gds_read" in kinds
    assert gds.metrics["host_evictions"] == 0
    ne, eb, _ = _sizes()
    # the host holds exactly what it held at start: no page-cache page was ever added
    assert gds.metrics["host_memory_peak_bytes"] == ne + gds.config["host_expert_capacity"] * eb
    # a GDS read replaces the H2D copy: the link carries only the host-resident experts
    tl = gds.timeline
    h2d = tl[(tl["resource"] == "h2d") & tl["kind"].isin(["fetch", "prefetch", "temp"])]
    assert (
        len(h2d)
        == gds.metrics["fetches"]
        + gds.metrics["temp_copies"]
        - gds.metrics["ssd_reads"]
        + gds.metrics["prefetches"]
    )
    # the page-cache path grows the cache instead (and evicts to stay in the budget)
    assert page.metrics["host_evictions"] > 0
    assert gds.metrics["e2e_s"] < page.metrics["e2e_s"]


def _same_timeline(a: pd.DataFrame, b: pd.DataFrame) -> None:
    keys = ["resource", "kind", "seq", "token", "layer", "expert", "start"]
    a = a.astype({"resource": str, "kind": str}).sort_values(keys, kind="stable")
    b = b.astype({"resource": str, "kind": str}).sort_values(keys, kind="stable")
    assert len(a) == len(b)
    for col in ("resource", "kind", "seq", "token", "layer", "expert", "bytes"):
        assert (a[col].to_numpy() == b[col].to_numpy()).all(), col
    for col in ("start", "end"):
        assert np.abs(a[col].to_numpy() - b[col].to_numpy()).max() <= TOL, col


@pytest.mark.reference
@pytest.mark.parametrize(
    ("policy", "path", "gb"),
    [
        ("lru", "page-cache", 30.0),
        ("lru", "gds", 30.0),
        ("fiddler", "page-cache", 25.0),
        ("llama-cpp-mmap", "page-cache", 25.0),
        ("daop", "gds", 30.0),
        ("mixtral-offloading", "page-cache", 30.0),
    ],
)
def test_fast_and_reference_engines_agree_on_ssd_runs(policy: str, path: str, gb: float) -> None:
    fast = _run(policy, host_memory_gb=gb, ssd_path=path)
    ref = _run(policy, host_memory_gb=gb, ssd_path=path, engine="reference")
    assert fast.metrics["ssd_reads"] > 0
    assert (fast.timeline["resource"] == "ssd").any()
    _same_timeline(fast.timeline, ref.timeline)
    for k, v in fast.metrics.items():
        w = ref.metrics[k]
        if isinstance(v, float):
            assert w == pytest.approx(v, rel=1e-9, abs=1e-9, nan_ok=True), k
        else:
            assert w == v, k


class _Watcher(LRUPolicy):
    """LRU that records what it sees of the host tier."""

    name = "lru-watching-host"
    seen: list[int] = []

    def decode_layer(self, view: View) -> Plan:
        hr = view.host_resident
        assert hr is not None and not hr.flags.writeable
        self.seen.append(int(hr.sum()))
        return super().decode_layer(view)


def test_policies_see_the_host_tier() -> None:
    pol = _Watcher()
    r = _run(pol, host_memory_gb=30.0, record=False)
    cap = r.config["host_expert_capacity"]
    assert pol.seen and max(pol.seen) <= cap and min(pol.seen) == cap  # full from the start
    plain = LRUPolicy()
    _run(plain, hw=NOMEM, record=False)  # no budget: the view has no host tier


def test_profile_default_host_memory_is_used() -> None:
    r = _run("lru", record=False)  # the profile's 64 GB
    assert r.config["host_memory_gb"] == 64.0
    assert r.metrics["ssd_reads"] > 0
    assert r.metrics["host_memory_peak_bytes"] <= 64e9


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, ["run", "--no-progress", "--no-bounds", *args])


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--host-memory-gb", "-4"], ["--host-memory-gb", "positive"]),
        (["--host-memory-gb", "0"], ["--host-memory-gb", "positive"]),
        (["--host-memory-gb", "1.5"], ["--host-memory-gb", "non-expert"]),
        (["--host-memory-gb", "30", "--ssd-path", "nfs"], ["--ssd-path", "page-cache"]),
        (["--host-memory-gb", "30", "--hw", NOMEM], ["[ssd]", NOMEM]),
        (["--ssd-path", "gds", "--hw", NOMEM], ["--ssd-path", "--host-memory-gb"]),
        (
            ["--host-memory-gb", "30", "--ssd-path", "gds", "--policy", "llama-cpp-mmap"],
            ["--ssd-path gds", "page-cache"],
        ),
        (["--model", "mixtral-8x7b", "--trace", "ci-small"], ["--model", "--trace"]),
    ],
)
def test_bad_input_is_one_line(args: list[str], words: list[str]) -> None:
    res = _cli("--trace", "ci-small", "--sequences", "1", "--policy", "lru", "--hw", HW, *args)
    assert res.exit_code == 2, (res.exit_code, res.output)
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_model_without_trace_runs_on_an_nvme_workstation(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DAOPSIM_CACHE", str(tmp_path / "cache"))
    res = CliRunner().invoke(
        main,
        ["run", "--model", "deepseek-v3", "--host-memory-gb", "128", "--hw",
         "rtx6000ada-t705-pcie4", "--policy", "lru", "--sequences", "1", "--no-progress",
         "--no-bounds", "--json", "--out", str(tmp_path / "out")],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["model"] == "deepseek-v3"
    assert str(tmp_path / "cache") in doc["trace"]  # generated into the cache, not the repo
    m = doc["metrics"]
    assert m["ssd_reads"] > 0 and m["ssd_bytes"] > 0 and m["ssd_stall_s"] > 0
    assert 0 < m["host_memory_peak_bytes"] <= 128e9
    tl = pd.read_parquet(tmp_path / "out" / "timeline.parquet")
    assert (tl["resource"].astype(str) == "ssd").any()


def test_read_time_follows_the_drive_and_the_access() -> None:
    model = read_meta(resolve_trace("ci-small")).model
    pro = cost_model(load_profile(HW), model)
    t705 = cost_model(load_profile("rtx6000ada-t705-pcie4"), model)
    eb = pro.host_expert_bytes
    assert pro.ssd_expert_s("read") == pytest.approx(60e-6 + eb / 7.45e9)
    assert pro.ssd_expert_s("mmap") == pytest.approx(60e-6 + eb / (1.4e6 * 4096))
    assert t705.ssd_expert_s("read") < pro.ssd_expert_s("read") < pro.ssd_expert_s("mmap")
    with pytest.raises(ValueError, match=r"\[ssd\]"):
        cost_model(load_profile(NOMEM), model).ssd_expert_s()
    # llama-cpp-mmap's faults go at the random-read rate, lru's reads at the sequential one
    mm = _run("llama-cpp-mmap", host_memory_gb=25.0)
    tl = mm.timeline[mm.timeline["resource"] == "ssd"]
    assert len(tl) > 0
    assert np.allclose(tl["end"] - tl["start"], pro.ssd_expert_s("mmap"), rtol=1e-12)


@pytest.mark.reference
@pytest.mark.parametrize(
    "mode", [{"batch": 2}, {"batch": 2, "continuous": True, "arrival_rate": 0.5}]
)
def test_engines_agree_on_batched_ssd_runs(mode: dict[str, Any]) -> None:
    from daopsim.simulator.serving_config import ServingConfig

    kw = {"host_memory_gb": 30.0, "sequences": 3, "serving": ServingConfig(**mode)}
    fast = _run("fiddler", **kw)
    ref = _run("fiddler", engine="reference", **kw)
    assert fast.metrics["ssd_reads"] > 0
    _same_timeline(fast.timeline, ref.timeline)
    assert fast.metrics["host_memory_peak_bytes"] <= 30e9


# -- evicting an expert whose copy is still in flight ------------------------------------------
@pytest.mark.reference
@pytest.mark.parametrize(
    ("policy", "path", "gb"),
    [
        ("moe-infinity", "page-cache", 40.0),
        ("moe-infinity", "gds", 25.0),
        ("stream-all", "gds", 40.0),
        ("vllm-cpu-offload", "gds", 40.0),
    ],
)
def test_policies_that_evict_copies_in_flight_run_on_an_ssd_tier(
    policy: str, path: str, gb: float
) -> None:
    """moe-infinity, stream-all and vllm-cpu-offload evict experts whose drive read or copy
    is still in flight when the drive delays their copies: each eviction waits for its copy
    (docs/policy-api.md, "Timing rules"), both engines alike, the host budget kept."""
    fast = _run(policy, host_memory_gb=gb, ssd_path=path)
    ref = _run(policy, host_memory_gb=gb, ssd_path=path, engine="reference")
    assert fast.metrics["ssd_reads"] > 0 and fast.metrics["tokens_per_s"] > 0
    assert fast.metrics["host_memory_peak_bytes"] <= gb * 1e9
    _same_timeline(fast.timeline, ref.timeline)
    assert ref.metrics["e2e_s"] == pytest.approx(fast.metrics["e2e_s"], rel=1e-12, abs=1e-9)


class _EvictInFlight(LRUPolicy):
    """One slot. Layer 0: its experts through temporary buffers and a prefetch of expert 2 of
    layer 0 (held in host memory: a slow H2D copy behind the two temporary ones). Layer 1: that
    prefetch evicted while it is still in flight, expert 0 of layer 1 fetched into its slot
    (from the drive by GPUDirect Storage: read long before the H2D copy lands)."""

    name = "evict-in-flight"

    def __init__(self, writeback: bool = False) -> None:
        super().__init__()
        self.writeback = writeback

    def resources(self) -> Any:
        from daopsim.policies.base import ResourceSpec

        return ResourceSpec(temp_buffers=2, writeback=self.writeback)

    def setup(self, ctx: Any) -> list[tuple[int, int]]:
        return []

    def decode_layer(self, view: View) -> Plan:
        from daopsim.policies.base import Action

        experts = [int(e) for e in view.experts.tolist()]
        plan = Plan(actions=dict.fromkeys(experts, Action.TEMP))
        assert plan.actions is not None
        if view.token == 0 and view.layer == 0:
            plan.prefetch = [(0, 2, None)]
        elif view.token == 0 and view.layer == 1:
            plan.evict = [(0, 2)]
            plan.actions[0] = Action.FETCH
        return plan


@pytest.mark.parametrize("writeback", [False, True])
def test_an_expert_evicted_in_flight_keeps_its_slot_until_its_copy_lands(writeback: bool) -> None:
    """The physical rule: a copy into a slot is not cancelled by its expert's eviction. The
    expert fetched into that one slot by GPUDirect Storage (its read done long before) is
    computed only once the evicted expert's H2D copy has landed; with write-back the evicted
    expert goes back to the host only after it has arrived. Both engines agree."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from equivalence import ENGINES, host_tier, slow_link

    from daopsim.simulator.testing import routing_from_experts, tiny_model

    model = tiny_model(experts=4, top_k=2, moe_layers=2)
    hw = slow_link(load_profile(HW), 50.0)
    tier = host_tier(model, hw, 4, "gds")  # the host holds layer 0; layer 1 is on the drive
    runs = []
    for cls in ENGINES:
        r = routing_from_experts(model, [[[0, 1], [0, 1]], [[2, 3], [2, 3]]], seq_id=0)
        rec = Recorder()
        eng = cls(_EvictInFlight(writeback), model, cost_model(hw, model), 1, recorder=rec,
                  host_tier=tier)  # fmt: skip
        stats = eng.run(iter([r]))
        runs.append((rec.timeline(), stats))
    (tl, stats), (tl_ref, stats_ref) = runs
    _same_timeline(tl, tl_ref)
    assert stats.counters.evictions_in_flight == stats_ref.counters.evictions_in_flight == 1
    tl = tl.astype({"resource": str, "kind": str})
    pre = tl[(tl["kind"] == "prefetch") & (tl["layer"] == 0) & (tl["expert"] == 2)]
    assert len(pre) == 1
    landed = float(pre["end"].iloc[0])
    read = tl[(tl["kind"] == "gds_read") & (tl["layer"] == 1) & (tl["expert"] == 0)]
    assert float(read["end"].iloc[0]) < landed  # the fetch's weights were there early ...
    run = tl[(tl["kind"] == "expert") & (tl["token"] == 0) & (tl["layer"] == 1)]
    run = run[run["expert"] == 0]
    assert float(run["start"].iloc[0]) >= landed - TOL  # ... but its slot was not
    wb = tl[tl["kind"] == "writeback"]
    if writeback:
        assert len(wb) == 1 and float(wb["start"].iloc[0]) >= landed - TOL
    else:
        assert len(wb) == 0
