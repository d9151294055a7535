"""A device on the host thread (``host_device`` runtimes, the CPU standing in for a GPU) and
measured module times (``[measured."<model>"]`` device tables): the cost arithmetic, the
profiles' checks, and both engines agreeing on runs that use them."""

from __future__ import annotations

import dataclasses
import functools
import tomllib

import pytest
from equivalence import assert_same, inputs

from daopsim.policies.registry import get_policy_class
from daopsim.simulator.core.loop import Engine
from daopsim.simulator.costs import DeviceHostCosts, cost_model
from daopsim.simulator.errors import ProfileError, UserError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.hardware_schema import parse_profile
from daopsim.simulator.hardware_spec import MeasuredModel
from daopsim.simulator.recorder import Recorder
from daopsim.simulator.reference import ReferenceEngine
from daopsim.simulator.run_costs import runtime_cost_model
from daopsim.simulator.runtime_profiles import RuntimeProfile, parse_runtime

US, MS = 1e-6, 1e-3
TOKENS = (1, 2, 8)
LAYER_MS = (0.5, 0.7, 1.1)
EXPERT_MS = (0.2, 0.4, 0.8)
COPIED_MS = (0.05, 0.3, 0.7)
HOST = RuntimeProfile(
    "cpu-eager",
    host_device=True,
    step_host_us=300.0,
    attention_host_us=150.0,
    norm_host_us=20.0,
    router_host_us=15.0,
    layer_glue_host_us=45.0,
    expert_host_us=60.0,
)


def _measured(model: str, **extra: object) -> dict[str, MeasuredModel]:
    m = MeasuredModel(
        cpu_expert_ms=1.0,
        load_expert_ms=0.4,
        load_path="pinned",
        source="test",
        load_overrides_link=True,
        writeback_expert_ms=0.3,
        load_warm_expert_ms=0.1,
        writeback_warm_expert_ms=0.05,
        device_tokens=TOKENS,
        device_expert_ms=EXPERT_MS,
        device_layer_ms=LAYER_MS,
        device_copied_expert_ms=COPIED_MS,
    )
    return {model: dataclasses.replace(m, **extra)}  # type: ignore[arg-type]


def _hw(model: str = "olmoe-1b-7b", **extra: object):  # type: ignore[no-untyped-def]
    base = load_profile("a6000-pcie4")
    return dataclasses.replace(base, measured=_measured(model, **extra))


def test_host_time_adds_to_the_device_work() -> None:
    from daopsim.simulator.models import get_model

    model = get_model("olmoe-1b-7b")
    plain = cost_model("a6000-pcie4", model)
    host = DeviceHostCosts(step_us=320.0, block_us=250.0, expert_us=60.0)
    folded = cost_model("a6000-pcie4", model, device_host=host)
    per_layer = (250.0 * model.layers / model.moe_layers + 320.0 / model.moe_layers) * US
    assert folded.nonexpert_layer_s(1, 100) - plain.nonexpert_layer_s(1, 100) == pytest.approx(
        per_layer, abs=1e-15
    )
    assert folded.gpu_expert_s(3) - plain.gpu_expert_s(3) == pytest.approx(60 * US, abs=1e-15)
    assert folded.gpu_expert_s(0) == 0.0  # no call, no host time
    # the runtime's fields become exactly these host costs
    rt_cm = runtime_cost_model(plain.hw, model, HOST)
    assert rt_cm.device_host == DeviceHostCosts(300.0, 150 + 2 * 20 + 15 + 45, 60.0)
    assert HOST.free  # no host thread beside a device that is the host thread


def test_measured_tables_replace_the_roofline_for_their_model_only() -> None:
    from daopsim.simulator.models import get_model

    model = get_model("olmoe-1b-7b")
    cm = cost_model(_hw(), model)
    kv = model.kv_bytes_per_token / model.moe_layers
    bw = cm.hw.gpu.mem_bw_gbs * 1e9
    # at a measured count, the table; between two, linear; beyond the last, its slope
    assert cm.gpu_expert_s(2) == pytest.approx(0.4 * MS)
    assert cm.gpu_expert_s(5) == pytest.approx((0.4 + 0.4 * 3 / 6) * MS)
    assert cm.gpu_expert_s(14) == pytest.approx((0.8 + 0.4 / 6 * 6) * MS)
    assert cm.nonexpert_layer_s(1, 0) == pytest.approx(0.5 * MS)
    assert cm.nonexpert_layer_s(1, 64) == pytest.approx(0.5 * MS + kv * 64 / bw)
    assert cm.gpu_expert_after_copy_s(8) == pytest.approx(0.7 * MS)
    assert cm.d2h_expert_s(pinned=True) == pytest.approx(0.3 * MS)
    assert cm.h2d_expert_s(pinned=True) == pytest.approx(0.4 * MS)
    assert cm.h2d_expert_warm_s(pinned=True) == pytest.approx(0.1 * MS)
    assert cm.d2h_expert_warm_s(pinned=True) == pytest.approx(0.05 * MS)
    assert cm.h2d_expert_warm_s(pinned=False) == cm.h2d_expert_s(pinned=False)  # other path
    assert cm.uses_measured()["gpu_expert"] and cm.uses_measured()["nonexpert_layer"]
    assert "device_expert_ms" in cm.sources()["gpu_expert"]
    # another model, or another precision, keeps the formulas
    other = cost_model(_hw(), get_model("mixtral-8x7b"))
    assert not other.has_after_copy and not other.uses_measured()["gpu_expert"]
    fp8 = cost_model(_hw(), model.with_precision(dtype="fp8"))
    assert fp8.device_tables is None
    # without the copied table, a copied expert costs what any call costs
    plain = cost_model(_hw(device_copied_expert_ms=None), model)
    assert not plain.has_after_copy
    assert plain.gpu_expert_after_copy_s(2) == plain.gpu_expert_s(2)


def test_profiles_refuse_what_they_cannot_mean(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UserError, match="needs host_device"):
        parse_runtime({"name": "x", "expert_host_us": 5.0}, "x.toml")
    with pytest.raises(UserError, match="must be 0 with host_device"):
        parse_runtime({"name": "x", "host_device": True, "dispatch_us": 4.0}, "x.toml")
    with pytest.raises(UserError, match="fused_moe"):
        parse_runtime({"name": "x", "host_device": True, "fused_moe": True}, "x.toml")
    with open(load_profile("a6000-pcie4").path, "rb") as f:
        base = tomllib.load(f)
    table = dict(base["measured"]["mixtral-8x7b"])

    def with_table(**kw: object) -> None:
        data = {**base, "measured": {"mixtral-8x7b": {**table, **kw}}}
        parse_profile(data, tmp_path / "p.toml")

    with_table(device_tokens=[1, 4], device_expert_ms=[0.1, 0.2])  # fine
    with pytest.raises(ProfileError, match="needs device_tokens"):
        with_table(device_expert_ms=[0.1])
    with pytest.raises(ProfileError, match="2 values for 3"):
        with_table(device_tokens=[1, 2, 4], device_layer_ms=[0.1, 0.2])
    with pytest.raises(ProfileError, match="start at 1"):
        with_table(device_tokens=[2, 4], device_expert_ms=[0.1, 0.2])
    with pytest.raises(ProfileError, match="positive"):
        with_table(device_tokens=[1], device_expert_ms=[0.0])
    data = {**base, "gpu": {**base["gpu"], "launch_overhead_us": 0}}
    assert parse_profile(data, tmp_path / "p.toml").gpu.launch_overhead_us == 0.0
    with pytest.raises(ProfileError, match=">= 0"):
        parse_profile({**base, "gpu": {**base["gpu"], "launch_overhead_us": -1}}, "p.toml")


def _run(cls: type, policy: str, budget: int, **opts: object):  # type: ignore[no-untyped-def]
    model, seqs, dec, pre = inputs("olmoe-1b-7b")
    hw = _hw()
    costs = runtime_cost_model(hw, model, HOST)
    pol = functools.partial(get_policy_class(policy), **opts)()
    rec = Recorder()
    eng = cls(pol, model, costs, budget, dec, pre, None, rec, runtime=HOST)
    stats = eng.run(iter(seqs))
    return rec.timeline(), stats


@pytest.mark.reference
@pytest.mark.parametrize("per_layer", [1, 4])
def test_both_engines_agree_on_a_host_device_with_measured_tables(per_layer: int) -> None:
    model = inputs("olmoe-1b-7b")[0]
    budget = per_layer * model.moe_layers
    opts = {"experts_per_layer": per_layer}
    (ta, sa), (tb, sb) = (
        _run(cls, "mixtral-offloading", budget, **opts) for cls in (Engine, ReferenceEngine)
    )
    assert_same(ta, tb, sa, sb)
    # decode experts (one token) ran at the cost of a copied expert or of a resident one
    experts = ta[(ta["kind"] == "expert") & (ta["token"] >= model.top_k)]
    seconds = set((experts["end"] - experts["start"]).round(12))
    assert seconds <= {round((0.05 + 0.06) * MS, 12), round((0.2 + 0.06) * MS, 12)}
    assert len(seconds) == 2 and sa.counters.fetches > 0
    # a swap into the slot of an expert this layer ran (fewer slots than its 8 experts) is
    # the warm copy and write-back; one whose victim is an older expert's, the cold ones
    for kind, cold, warm in (("fetch", 0.4, 0.1), ("writeback", 0.3, 0.05)):
        rows = ta[ta["kind"] == kind]
        got = set((rows["end"] - rows["start"]).round(12))
        assert got <= {round(cold * MS, 12), round(warm * MS, 12)}, kind
        assert round(warm * MS, 12) in got, kind
        if per_layer == 4:
            assert round(cold * MS, 12) in got, kind


def test_a_device_on_the_host_thread_adds_up_its_parts() -> None:
    """All resident, one GPU stream, no host thread: a decode token takes exactly its layers'
    non-expert parts plus its experts' calls, each with its host time."""
    model, seqs, _, _ = inputs("olmoe-1b-7b")
    _, stats = _run(Engine, "all-gpu", model.total_experts)
    cm = runtime_cost_model(_hw(), model, HOST)
    r = seqs[0]
    t = r.n_prefill  # the first decode token
    context = int(r.positions[t])
    expected = model.moe_layers * cm.nonexpert_layer_s(1, context)
    expected += model.moe_layers * model.top_k * cm.gpu_expert_s(1)
    assert stats.counters.token_latency[0] == pytest.approx(expected, rel=1e-12)
    assert stats.counters.dispatch_stall == 0.0 and stats.counters.host_syncs == 0
