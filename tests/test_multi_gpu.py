"""Multiple GPUs (--gpus, --multi-gpu): placement, per-GPU slots, peer links, both executors.

Each test tries to break one invariant of docs/serving.md, "Multiple GPUs".
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from daopsim.policies.base import Action, Plan, Policy, SetupContext, View
from daopsim.policies.registry import get_policy_class
from daopsim.simulator.cli import main
from daopsim.simulator.errors import PolicyError, UserError
from daopsim.simulator.models import get_model
from daopsim.simulator.multigpu import MultiGpuConfig, Placement, ShardedPolicy
from daopsim.simulator.runner import simulate

TRACE = "ci-small"


def run(policy: str | Policy = "lru", hw: str = "2x-rtx4090-pcie4", **kw: object):  # type: ignore[no-untyped-def]
    kw.setdefault("sequences", 1)
    kw.setdefault("gpu_experts", 40)
    return simulate(policy=policy, hw=hw, trace=TRACE, **kw)  # type: ignore[arg-type]


@pytest.mark.reference
@pytest.mark.parametrize("policy", ["lru", "daop"])
@pytest.mark.parametrize("mode", ["expert", "pipeline"])
@pytest.mark.parametrize("hw", ["2x-rtx4090-pcie4", "2x-rtx3090-nvlink"])
def test_fast_and_reference_timelines_agree(policy: str, mode: str, hw: str) -> None:
    """Every operation starts and ends at the same moment (1e-9 s) in both executors."""
    fast = run(policy, hw, gpus=2, multi_gpu=mode)
    ref = run(policy, hw, gpus=2, multi_gpu=mode, engine="reference")
    keys = ["resource", "start", "end", "kind", "layer", "expert", "token"]
    a = fast.timeline.sort_values(keys).reset_index(drop=True)
    b = ref.timeline.sort_values(keys).reset_index(drop=True)
    assert len(a) == len(b) > 0
    assert (a["resource"] == b["resource"]).all() and (a["kind"] == b["kind"]).all()
    assert np.abs(a["start"] - b["start"]).max() < 1e-9
    assert np.abs(a["end"] - b["end"]).max() < 1e-9
    assert fast.metrics["e2e_s"] == pytest.approx(ref.metrics["e2e_s"], abs=1e-9)
    # per-GPU busy time, slots held, bytes and peer bytes agree too
    fm, rm = fast.config["multi_gpu"], ref.config["multi_gpu"]
    assert fm["peer_bytes"] == rm["peer_bytes"]
    for f, r in zip(fm["per_gpu"], rm["per_gpu"], strict=True):
        assert f["busy_s"] == pytest.approx(r["busy_s"], rel=1e-12)
        assert {k: v for k, v in f.items() if k != "busy_s"} == {
            k: v for k, v in r.items() if k != "busy_s"
        }


@pytest.mark.reference
def test_four_gpus_two_nvlink_pairs_agree() -> None:
    """4x RTX 3090: pairs over NVLink, other pairs staged through the host; executors agree."""
    fast = run("lfu", "4x-rtx3090-nvlink", gpus=4, gpu_experts=20)
    ref = run("lfu", "4x-rtx3090-nvlink", gpus=4, gpu_experts=20, engine="reference")
    assert fast.metrics["e2e_s"] == pytest.approx(ref.metrics["e2e_s"], abs=1e-9)
    lanes = set(fast.timeline["resource"])
    assert {"peer0>1", "peer1>0", "peer2>3", "peer3>2"} >= {x for x in lanes if "peer" in x}
    assert "peer0>2" not in lanes  # no bridge between the pairs: through the host
    peer_rows = fast.timeline[fast.timeline["kind"] == "peer"]
    assert set(peer_rows["resource"]) & {"d2h0", "h2d0"}  # the staged transfers


def test_one_gpu_is_todays_run() -> None:
    """--gpus 1 gives exactly the single-GPU run (same metrics, same timeline)."""
    a = simulate(policy="daop", hw="a6000-pcie4", trace=TRACE, sequences=1, cache_ratio=0.25)
    b = simulate(
        policy="daop", hw="a6000-pcie4", trace=TRACE, sequences=1, cache_ratio=0.25, gpus=1
    )
    assert json.dumps(a.metrics, sort_keys=True) == json.dumps(b.metrics, sort_keys=True)
    pd.testing.assert_frame_equal(a.timeline, b.timeline)
    assert b.config["multi_gpu"] is None


def _held(tl: pd.DataFrame, pl: Placement) -> dict[int, list[tuple[float, int]]]:
    """Slot events per GPU from the timeline: +1 at a fetch's start, -1 at a write-back's end."""
    ev: dict[int, list[tuple[float, int]]] = {k: [] for k in range(pl.n)}
    for r in tl.itertuples():
        if r.kind in ("fetch", "prefetch"):
            ev[pl.gpu_of[r.layer][r.expert]].append((r.start, 1))
        elif r.kind == "writeback":
            ev[pl.gpu_of[r.layer][r.expert]].append((r.end, -1))
    return ev


def test_one_stream_is_refused_on_several_gpus() -> None:
    """mixtral-offloading as released (copies on its kernels' stream) is not modelled on the
    multi-GPU executors: a one-line error, not a silently different timing."""
    with pytest.raises(UserError, match="one_stream"):
        run("mixtral-offloading", gpus=2, multi_gpu="expert", gpu_experts=24)


@pytest.mark.parametrize("mode", ["expert", "pipeline"])
def test_slots_per_gpu_never_over_budget(mode: str) -> None:
    """A write-back policy that starts with every slot full: the slots a GPU holds (copies
    start holding one, write-backs release one when they end) never exceed its budget plus
    its staging buffer, at any moment."""
    # copies on a side stream: the multi-GPU executors refuse the one-stream declaration
    pol = get_policy_class("mixtral-offloading")(copy_stream="side")
    res = run(pol, gpus=2, multi_gpu=mode, gpu_experts=24)
    mg = res.config["multi_gpu"]
    pl = Placement(_cfg(2, mode), 32, 8)
    staging = get_policy_class("mixtral-offloading")().resources().staging_buffers
    for k, events in _held(res.timeline, pl).items():
        slots = mg["per_gpu"][k]["slots"]
        assert mg["per_gpu"][k]["max_slots_used"] <= slots + staging
        held = slots  # its initial placement fills the budget
        # a write-back ending when a copy starts has freed its slot first
        for _, delta in sorted(events, key=lambda x: (x[0], x[1])):
            held += delta
            assert held <= slots + staging
        assert any(d == 1 for _, d in events)


def _cfg(n: int, mode: str):  # type: ignore[no-untyped-def]
    from daopsim.simulator.multigpu import MultiGpuConfig

    return MultiGpuConfig(n, mode)


@pytest.mark.parametrize("mode", ["expert", "pipeline"])
def test_experts_run_where_they_live_exactly_once(mode: str) -> None:
    """Every routed decode expert is computed once per token and layer, on the GPU that holds
    it (or on the CPU), never on another GPU."""
    res = run("fiddler", gpus=2, multi_gpu=mode)
    pl = Placement(_cfg(2, mode), 32, 8)
    tl = res.timeline
    gpu_rows = tl[(tl["kind"] == "expert") & tl["resource"].str.startswith("gpu")]
    for r in gpu_rows.itertuples():
        assert r.resource == f"gpu{pl.gpu_of[r.layer][r.expert]}"
    comp = tl[tl["kind"].isin(["expert", "cpu_expert"])]
    dup = comp.groupby(["seq", "token", "layer", "expert"]).size()
    assert (dup == 1).all()
    # every layer of every decode token computed its top-k experts (Mixtral: 2)
    decode = comp[comp["token"] > 0]
    per_layer = decode.groupby(["token", "layer"]).size()
    assert (per_layer == 2).all()


@pytest.mark.parametrize("hw", ["2x-rtx3090-nvlink", "8x-h100-sxm5"])
def test_peer_lanes_one_copy_at_a_time_and_time_moves_forward(hw: str) -> None:
    """Per direction a peer lane never holds two transfers at once; no operation ends before
    it starts; each GPU stream is serial."""
    res = run("lru", hw, gpus=2 if hw.startswith("2x") else 8, gpu_experts=16)
    tl = res.timeline
    assert (tl["end"] >= tl["start"]).all()
    for lane, rows in tl.groupby("resource"):
        if str(lane).startswith(("peer", "gpu")):
            r = rows.sort_values("start")
            assert (r["start"].to_numpy()[1:] >= r["end"].to_numpy()[:-1] - 1e-12).all(), lane
    assert any(str(x).startswith("peer") for x in tl["resource"])


def test_two_gpus_more_slots_fewer_misses() -> None:
    """Same per-GPU memory: two GPUs hold twice the experts, so fewer copies than one."""
    one = run("lru", "2x-rtx4090-pcie4", gpus=1, gpu_experts=30)
    two = run("lru", "2x-rtx4090-pcie4", gpus=2, gpu_experts=30)
    assert two.config["gpu_experts"] == 60
    assert two.metrics["hit_rate"] > one.metrics["hit_rate"]
    assert (
        two.metrics["fetches"] + two.metrics["temp_copies"]
        < one.metrics["fetches"] + one.metrics["temp_copies"]
    )
    per = two.config["multi_gpu"]["per_gpu"]
    assert [g["slots"] for g in per] == [30, 30]
    assert all(g["expert_computations"] > 0 for g in per)


def test_pipeline_moves_activations_at_stage_boundaries_only() -> None:
    """Pipeline over 2 GPUs of 32 layers: the hidden state crosses after layer 15 only."""
    res = run("lru", "2x-rtx3090-nvlink", gpus=2, multi_gpu="pipeline")
    tl = res.timeline
    peer = tl[tl["kind"] == "peer"]
    assert len(peer) > 0 and set(peer["layer"]) == {15}
    assert set(peer["resource"]) == {"peer0>1"}
    ne = tl[tl["kind"] == "nonexpert"]
    assert set(ne[ne["layer"] < 16]["resource"]) == {"gpu0"}
    assert set(ne[ne["layer"] >= 16]["resource"]) == {"gpu1"}
    # the next stage's first layer starts only after the transfer ends
    for token, rows in peer.groupby("token"):
        nxt = ne[(ne["token"] == token) & (ne["layer"] == 16)]
        assert nxt["start"].min() >= rows["end"].max() - 1e-12


def test_expert_parallel_places_experts_on_both_gpus() -> None:
    """The done-when check: the default policy on 2x RTX 4090 uses both GPUs, a lane each."""
    res = simulate(hw="2x-rtx4090-pcie4", trace=TRACE, sequences=1, gpus=2)
    lanes = set(res.timeline["resource"])
    assert {"gpu0", "gpu1", "h2d0", "d2h0"} <= lanes
    per = res.config["multi_gpu"]["per_gpu"]
    assert all(g["busy_s"] > 0 for g in per)
    assert res.config["multi_gpu"]["peer_bytes_total"] > 0


def test_machine_lanes_per_gpu_and_uplink() -> None:
    """Separate uplinks give lanes h2dK/d2hK per GPU; a shared uplink one pair."""
    h100 = simulate(policy="lru", hw="8x-h100-sxm5", trace=TRACE, sequences=1, gpus=4,
                    gpu_experts=8)  # fmt: skip
    lanes = set(h100.timeline["resource"])
    assert {"gpu0", "gpu1", "gpu2", "gpu3"} <= lanes
    assert any(x.startswith("h2d") and x != "h2d0" for x in lanes)


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--gpus", "3", "--hw", "2x-rtx4090-pcie4"], "has 2 GPUs"),
        (["--gpus", "0"], "--gpus must be >= 1"),
        (["--gpus", "2"], "has 1 GPU"),
        (["--gpus", "2", "--hw", "2x-rtx4090-pcie4", "--multi-gpu", "ring"], "--multi-gpu"),
        (["--multi-gpu", "pipeline"], "needs --gpus 2"),
        (["--gpus", "2", "--hw", "2x-rtx4090-pcie4", "--host-memory-gb", "400"], "SSD tier"),
    ],
)
def test_bad_input_is_one_line(args: list[str], msg: str) -> None:
    """Impossible GPU counts and modes are one-line errors with a non-zero exit."""
    out = CliRunner().invoke(main, ["run", "--trace", TRACE, "--sequences", "1", *args])
    assert out.exit_code != 0
    text = out.output.strip()
    assert msg in text and "Traceback" not in text and len(text.splitlines()) == 1


def test_run_json_has_per_gpu_metrics() -> None:
    """run --json: per-GPU busy time, slots and bytes, and the peer bytes."""
    out = CliRunner().invoke(
        main,
        ["run", "--trace", TRACE, "--sequences", "1", "--hw", "2x-rtx3090-nvlink", "--gpus",
         "2", "--policy", "lru", "--gpu-experts", "40", "--json"],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    mg = doc["multi_gpu"]
    assert mg["gpus"] == 2 and mg["mode"] == "expert" and mg["peer_kind"] == "nvlink"
    assert {"busy_s", "slots", "h2d_expert_bytes"} <= set(mg["per_gpu"][0])
    assert mg["peer_bytes_total"] == sum(mg["peer_bytes"].values()) > 0


def test_sweep_gpus_axis(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A sweep compares 1 and 2 GPUs (both placements); one-GPU rows read gpus = 1."""
    from daopsim.simulator.grid import Grid
    from daopsim.simulator.sweep import run_sweep
    from daopsim.simulator.sweep_expand import expand

    grid = Grid(
        policies=["lru"], hw=["2x-rtx3090-nvlink"], traces=[TRACE], gpu_experts=[30],
        sequences=1, gpus=[1, 2], multi_gpu=["expert", "pipeline"],
    )  # fmt: skip
    cfgs = expand(grid)
    assert [(c.gpus, c.multi_gpu) for c in cfgs] == [(1, None), (2, "expert"), (2, "pipeline")]
    assert len({c.key for c in cfgs}) == 3
    df, _ = run_sweep(grid, out=tmp_path / "s.parquet", progress=False)
    assert list(df["gpus"]) == [1, 2, 2] and (df["status"] == "ok").all()
    assert list(df["gpu_experts"]) == [30, 60, 60]  # the total over the GPUs
    one = Grid(policies=["lru"], traces=[TRACE], gpu_experts=[30], sequences=1)
    assert expand(one)[0].key == expand(Grid(**{**one.__dict__, "gpus": [1]}))[0].key


class _Hoarder(Policy):
    """Fetches every miss and never evicts: goes over a GPU's budget once it is full."""

    name = "hoarder"

    def decode_layer(self, view: View) -> Plan:
        """Every routed expert resident or fetched."""
        res = view.resident[view.layer]
        return Plan(actions={int(e): Action.GPU if res[e] else Action.FETCH for e in view.experts})


def test_a_gpu_over_its_own_budget_is_refused() -> None:
    """Global room is not enough: a GPU's instance going over its own budget is an error."""
    with pytest.raises(PolicyError, match=r"GPU [01] would hold .* over its budget") as info:
        run(_Hoarder(), gpus=2, gpu_experts=4)
    assert info.value.policy == "hoarder" and info.value.layer is not None


def test_one_gpu_of_a_multi_gpu_profile_is_its_base_machine() -> None:
    """--gpus 1 on 2x-rtx4090-pcie4 times exactly like rtx4090-pcie4 (the [gpu] it repeats)."""
    a = run("lru", "rtx4090-pcie4", gpus=1)
    b = run("lru", "2x-rtx4090-pcie4", gpus=1)
    assert a.metrics["e2e_s"] == b.metrics["e2e_s"]
    assert a.metrics["hit_rate"] == b.metrics["hit_rate"]


@pytest.mark.reference
@pytest.mark.parametrize("mode", ["expert", "pipeline"])
def test_per_gpu_belady_bounds_lru(mode: str) -> None:
    """Each GPU's Belady instance sees its own experts' future: it never hits less than LRU
    on the same per-GPU caches, and both executors agree on it."""
    lru = run("lru", "2x-rtx3090-nvlink", gpus=2, multi_gpu=mode, gpu_experts=50, record=False)
    bel = run("belady", "2x-rtx3090-nvlink", gpus=2, multi_gpu=mode, gpu_experts=50, record=False)
    ref = run(
        "belady", "2x-rtx3090-nvlink", gpus=2, multi_gpu=mode, gpu_experts=50, record=False,
        engine="reference",
    )  # fmt: skip
    assert bel.metrics["hit_rate"] >= lru.metrics["hit_rate"]
    assert bel.metrics["e2e_s"] == pytest.approx(ref.metrics["e2e_s"], abs=1e-9)


@pytest.mark.reference
@pytest.mark.parametrize("mode", ["expert", "pipeline"])
@pytest.mark.parametrize("batch,rate", [(4, None), (None, 0.5)])
def test_batched_serving_on_two_gpus(mode: str, batch: int | None, rate: float | None) -> None:
    """Static and continuous batching over two GPUs: both executors give the same timeline,
    and the batched steps' non-expert parts run on the layers' home GPUs."""
    from daopsim.simulator.serving_config import serving_config

    sv = serving_config(batch=batch, max_batch=4 if rate else None, arrival_rate=rate)
    kw = {"gpus": 2, "multi_gpu": mode, "sequences": 4, "gpu_experts": 24, "serving": sv}
    fast = run("fiddler", **kw)
    ref = run("fiddler", engine="reference", **kw)
    keys = ["resource", "start", "end", "kind", "layer", "expert", "token"]
    a = fast.timeline.sort_values(keys).reset_index(drop=True)
    b = ref.timeline.sort_values(keys).reset_index(drop=True)
    assert len(a) == len(b) > 0 and (a["resource"] == b["resource"]).all()
    assert np.abs(a["start"] - b["start"]).max() < 1e-9
    assert np.abs(a["end"] - b["end"]).max() < 1e-9
    ne = a[a["kind"] == "nonexpert"]
    home = {0: "gpu0"} if mode == "expert" else {15: "gpu0", 16: "gpu1"}
    for layer, lane in home.items():
        assert set(ne[ne["layer"] == layer]["resource"]) == {lane}
    assert fast.serving is not None


def test_busy_fraction_and_energy_count_every_gpu() -> None:
    """gpu_busy_frac is a mean over the GPUs (never above 1); every GPU idles at its context
    power for the whole run, so two GPUs cost at least twice one GPU's idle energy."""
    from daopsim.simulator.hardware import load_profile

    res = run("lru", "8x-h100-sxm5", gpus=4, gpu_experts=16, record=False)
    m = res.metrics
    per = res.config["multi_gpu"]["per_gpu"]
    assert 0 < m["gpu_busy_frac"] <= 1
    assert m["gpu_busy_frac"] == pytest.approx(sum(g["busy_s"] for g in per) / (4 * m["e2e_s"]))
    p = load_profile("8x-h100-sxm5").power
    assert p is not None
    idle = p.resolved(1).gpu_active_idle_w
    assert idle is not None
    assert m["energy_gpu_j"] >= 4 * idle * m["e2e_s"]


def test_peer_copy_cost_from_the_profile() -> None:
    """A direct peer copy costs its latency plus the bytes at the per-direction bandwidth;
    a profile without peer access has no direct path to cost."""
    from daopsim.simulator.costs import cost_model
    from daopsim.simulator.hardware import load_profile
    from daopsim.simulator.models import get_model

    model = get_model("mixtral-8x7b")
    nv = cost_model(load_profile("2x-rtx3090-nvlink"), model)
    assert nv.peer_activation_s(1) == pytest.approx(6e-6 + model.hidden * 2 / 56.25e9)
    assert nv.peer_activation_s(64) - nv.peer_activation_s(1) == pytest.approx(
        63 * model.hidden * 2 / 56.25e9
    )
    with pytest.raises(ValueError):
        cost_model(load_profile("2x-rtx4090-pcie4"), model).peer_activation_s(1)


@pytest.mark.parametrize(
    "tables,msg",
    [
        ("[gpus]\ncount = 2\nshared_uplink = false\n", "peer"),
        ('[gpus]\ncount = 1\nshared_uplink = false\n[peer]\nkind = "host"\n', "at least 2"),
        ('[gpus]\ncount = 2\nshared_uplink = false\n[peer]\nkind = "nvlink"\n', "bandwidth_gbs"),
        (
            '[gpus]\ncount = 2\nshared_uplink = true\n[peer]\nkind = "nvlink"\n'
            "bandwidth_gbs = 50\nlatency_us = 5\npairs = [[0, 2]]\n",
            "beyond gpus.count",
        ),
        ('[gpus]\ncount = 2\nshared_uplink = 1\n[peer]\nkind = "host"\n', "true or false"),
        ('[gpus]\ncount = 2\nshared_uplink = true\n[peer]\nkind = "infiniband"\n', "one of"),
    ],
)
def test_bad_multi_gpu_tables_are_one_line_profile_errors(tmp_path, tables: str, msg: str) -> None:  # type: ignore[no-untyped-def]
    """[gpus] and [peer] are checked on load; a mistake names the file and the key."""
    from daopsim.simulator.errors import ProfileError
    from daopsim.simulator.hardware import load_profile

    f = tmp_path / "box.toml"
    f.write_text(f'extends = "rtx3090-pcie4"\nname = "box"\ndescription = "d"\n{tables}')
    with pytest.raises(ProfileError, match=msg):
        load_profile(str(f))


@pytest.mark.reference
@pytest.mark.parametrize("mode", ["expert", "pipeline"])
def test_gather_barrier_on_two_gpus(mode: str) -> None:
    """DeepSpeed's gather (stream-all gather=leaf, Plan.barrier): no GPU expert of a layer
    starts before the layer's last copy lands, and both executors agree."""
    # (the streamed non-expert weights are a one-GPU mechanism: kept resident here)
    kw = {
        "gpus": 2,
        "multi_gpu": mode,
        "policy_options": {"gather": "leaf", "stream_nonexpert": False},
    }
    fast = run("stream-all", **kw)
    ref = run("stream-all", engine="reference", **kw)
    assert fast.metrics["e2e_s"] == pytest.approx(ref.metrics["e2e_s"], abs=1e-9)
    tl = fast.timeline
    copies = tl[tl["kind"].isin(["fetch", "temp"])].groupby(["token", "layer"])["end"].max()
    starts = tl[tl["kind"] == "expert"].groupby(["token", "layer"])["start"].min()
    joined = pd.concat([copies.rename("copy"), starts.rename("start")], axis=1).dropna()
    assert len(joined) > 0
    assert (joined["start"] >= joined["copy"] - 1e-12).all()


def _agree(policy: str, hw: str, mode: str, **options: object) -> None:
    """Both executors run ``policy`` on two GPUs to the same end (1e-9 s) and timeline."""
    kw = {"gpus": 2, "multi_gpu": mode, "policy_options": options}
    fast = run(policy, hw, **kw)
    ref = run(policy, hw, engine="reference", **kw)
    assert fast.metrics["e2e_s"] == pytest.approx(ref.metrics["e2e_s"], abs=1e-9)
    assert len(fast.timeline) == len(ref.timeline) > 0


@pytest.mark.reference
@pytest.mark.parametrize(("policy", "options"), [("hobbit", {}), ("mixtral-offloading",
                                                  {"copy_stream": "side"})])  # fmt: skip
def test_several_gpus_keep_fused_moe_and_eager_attention(
    policy: str, options: dict[str, object]
) -> None:
    fast = run(policy, gpus=2, policy_options=options, record=False)
    ref = run(policy, gpus=2, policy_options=options, record=False, engine="reference")
    assert fast.metrics["e2e_s"] == pytest.approx(ref.metrics["e2e_s"], abs=1e-9)


def test_moe_infinity_on_a_shared_uplink_never_evicts_a_copy_in_flight() -> None:
    """Two GPUs on one uplink: each instance's own link ledger misses the other's copies (and
    the peer activations), so it once picked a victim still being copied and the engine
    refused the run; with View.ready every victim it names has landed."""
    victims: list[float] = []

    class Spy(get_policy_class("moe-infinity")):  # type: ignore[misc,valid-type]
        name = "moe-infinity"

        def decode_layer(self, view: View) -> Plan:
            plan = super().decode_layer(view)
            assert view.ready is not None
            gone = list(plan.victims.values()) + [v for *_, v in plan.prefetch if v is not None]
            victims.extend(float(view.ready[v]) - view.now for v in gone)
            return plan

    for mode in ("expert", "pipeline"):
        simulate(policy=Spy(), hw="2x-rtx4090-pcie4", trace=TRACE, sequences=1,
                 gpu_experts=40, gpus=2, multi_gpu=mode)  # fmt: skip
        _agree("moe-infinity", "2x-rtx4090-pcie4", mode)
    assert victims and max(victims) <= 0.0


def test_sharded_view_tells_each_gpu_when_its_copies_land() -> None:
    """ShardedPolicy hands each instance the landing times of its own GPU's slots only."""
    seen: list[tuple[int, tuple[int, int]]] = []

    class Spy(get_policy_class("lru")):  # type: ignore[misc,valid-type]
        name = "lru"

        def decode_layer(self, view: View) -> Plan:
            assert view.ready is not None and not view.ready.flags.writeable
            assert view.ready.shape == view.resident.shape
            # a slot not resident may hold a stale time; a resident one is known
            seen.append((id(self), view.ready.shape))
            return super().decode_layer(view)

    simulate(policy=Spy(), hw="2x-rtx4090-pcie4", trace=TRACE, sequences=1, gpu_experts=40,
             gpus=2)  # fmt: skip
    assert {shape for _, shape in seen} == {(32, 4)}
    assert len({i for i, _ in seen}) == 2


@pytest.mark.slow
@pytest.mark.reference
@pytest.mark.parametrize("mode", ["expert", "pipeline"])
def test_every_builtin_policy_runs_on_a_shared_uplink(mode: str) -> None:
    """Every registered built-in policy runs on 2x RTX 4090 (one uplink, peers via host) and
    both executors agree; the only refusals are a policy keeping layers on the CPU, one
    streaming its non-expert weights (stream-all, which runs with them kept resident), one
    issuing its copies on its kernels' stream (mixtral-offloading as released; it runs with
    its copies on a side stream) and one caching bit slices (slicemoe)."""
    from daopsim.simulator.leaderboard import builtin_policies

    # built-in only: a policy file another test loaded stays registered in this process
    for name in builtin_policies():
        if name == "llama-cpp-layers":  # CPU-resident layers: a one-line refusal (below)
            with pytest.raises(UserError, match="--gpus 1"):
                run(name, gpus=2, multi_gpu=mode)
            continue
        if name == "stream-all":  # ZeRO-3's streamed non-expert weights: one GPU only
            with pytest.raises(UserError, match="stream_nonexpert=false"):
                run(name, gpus=2, multi_gpu=mode)
            kw = {"policy_options": {"stream_nonexpert": False}}
            fast = run(name, "2x-rtx4090-pcie4", gpus=2, multi_gpu=mode, **kw)
            ref = run(name, "2x-rtx4090-pcie4", gpus=2, multi_gpu=mode, engine="reference", **kw)
            assert fast.metrics["e2e_s"] == pytest.approx(ref.metrics["e2e_s"], abs=1e-9)
            continue
        if name == "mixtral-offloading":
            with pytest.raises(UserError, match="one_stream"):
                run(name, gpus=2, multi_gpu=mode)
            _agree(name, "2x-rtx4090-pcie4", mode, copy_stream="side")
            continue
        if name == "slicemoe":  # slots of a bit slice's size: one GPU only
            with pytest.raises(UserError, match="low_bit_slots"):
                run(name, gpus=2, multi_gpu=mode)
            continue
        _agree(name, "2x-rtx4090-pcie4", mode)


def test_unified_memory_refused_in_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A unified-memory profile with a [gpus] table: --gpus 2 is a one-line error naming --hw."""
    from pathlib import Path

    base = Path(__file__).parent.parent / "hardware_profiles" / "jetson-orin-64g.toml"
    prof = tmp_path / "two-jetsons.toml"
    prof.write_text(
        base.read_text() + '\n[gpus]\ncount = 2\nshared_uplink = true\n\n[peer]\nkind = "host"\n'
    )
    out = CliRunner().invoke(
        main, ["run", "--trace", TRACE, "--sequences", "1", "--gpus", "2", "--hw", str(prof)]
    )
    text = out.output.strip()
    assert out.exit_code != 0 and "Traceback" not in text and len(text.splitlines()) == 1
    assert "unified memory" in text and "--hw" in text and "--gpus 1" in text


def test_cpu_layers_and_host_budget_refusals_name_the_option() -> None:
    """CPU-resident layers and a host-memory budget: one line each, naming what to change."""
    for args, want in (
        (["--policy", "llama-cpp-layers"], "--gpu-experts"),
        (["--host-memory-gb", "400"], "--host-memory-gb"),
    ):
        out = CliRunner().invoke(
            main,
            ["run", "--trace", TRACE, "--sequences", "1", "--gpus", "2", "--hw",
             "2x-rtx4090-pcie4", "--gpu-experts", "40", *args],
        )  # fmt: skip
        text = out.output.strip()
        assert out.exit_code != 0 and "Traceback" not in text and len(text.splitlines()) == 1
        assert want in text and "--gpus" in text


def _skewed_trace(path):  # type: ignore[no-untyped-def]
    """Tiny model (8 experts, top-2): experts 0 and 2 (both GPU 0 under ``mod``) are picked
    by most tokens of every layer, the rest at random."""
    from daopsim.simulator.testing import make_meta, routing_from_experts, tiny_model
    from daopsim.simulator.trace_write import write_trace

    model = tiny_model()
    rng = np.random.default_rng(3)
    seqs = []
    for s in range(8):
        ex = np.empty((12, model.moe_layers, 2), dtype=np.int64)
        for t in range(12):
            for lay in range(model.moe_layers):
                hot = rng.random() < 0.7
                ex[t, lay] = (0, 2) if hot else rng.choice(model.experts, 2, replace=False)
        seqs.append(routing_from_experts(model, ex, n_prefill=4, seq_id=s))
    return write_trace(path, make_meta(model), seqs)


@pytest.mark.reference
def test_balanced_expert_placement_evens_routed_traffic(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--expert-placement balanced`` splits the two hot experts over the GPUs, so the busiest
    GPU computes fewer experts than under ``mod``; both executors agree; slots unchanged."""
    trace = _skewed_trace(tmp_path / "skew.parquet")
    got = {}
    for rule in ("mod", "balanced"):
        kw = dict(policy="lru", hw="2x-rtx4090-pcie4", trace=trace, gpu_experts=8, gpus=2,
                  expert_placement=rule, calibration=None)  # fmt: skip
        fast = simulate(**kw)  # type: ignore[arg-type]
        ref = simulate(engine="reference", **kw)  # type: ignore[arg-type]
        assert fast.metrics["e2e_s"] == pytest.approx(ref.metrics["e2e_s"], abs=1e-9)
        mg = fast.config["multi_gpu"]
        assert mg["expert_placement"] == rule
        per = mg["per_gpu"]
        assert sorted(e for g in per for e in g["experts"]) == list(range(8))
        assert [len(g["experts"]) for g in per] == [4, 4]
        got[rule] = (max(g["expert_computations"] for g in per), per)
    assert got["mod"][1][0]["experts"] == [0, 2, 4, 6]
    hot_gpus = {k for k, g in enumerate(got["balanced"][1]) for e in (0, 2) if e in g["experts"]}
    assert hot_gpus == {0, 1}
    assert got["balanced"][0] < got["mod"][0]


def test_balanced_packing_largest_first_onto_least_loaded() -> None:
    """The greedy packing by hand: equal expert counts, hottest experts on different GPUs."""
    from daopsim.simulator.multigpu import balanced_experts

    pop = np.array([100, 1, 90, 1, 50, 40, 1, 1])
    # 0, 2, 4 (to GPU 1: 90 < 100), 5 (to GPU 0: 100 < 140), then the 1s alternate on ties
    assert balanced_experts(pop, 2) == [[0, 1, 5, 6], [2, 3, 4, 7]]
    # more GPUs than the counts split evenly: every expert placed once, counts as under mod
    out = balanced_experts(np.arange(7), 3)
    assert sorted(e for x in out for e in x) == list(range(7))
    assert [len(x) for x in out] == [3, 2, 2]


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--gpus", "2", "--hw", "2x-rtx4090-pcie4", "--expert-placement", "even"], "mod"),
        (
            [
                "--gpus",
                "2",
                "--hw",
                "2x-rtx4090-pcie4",
                "--multi-gpu",
                "pipeline",
                "--expert-placement",
                "balanced",
            ],
            "--multi-gpu expert",
        ),
        (["--expert-placement", "balanced"], "--gpus 2"),
    ],
)
def test_bad_expert_placement_is_one_line(args: list[str], msg: str) -> None:
    """An unknown rule, or a rule without expert parallelism, is a one-line error."""
    out = CliRunner().invoke(main, ["run", "--trace", TRACE, "--sequences", "1", *args])
    text = out.output.strip()
    assert out.exit_code != 0 and "Traceback" not in text and len(text.splitlines()) == 1
    assert msg in text and "--expert-placement" in text


class _Recorder(Policy):
    """Records a copy of everything its view holds at each decision (and decides nothing)."""

    name = "view-recorder"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.seen: list[dict[str, object]] = []

    def setup(self, ctx):  # type: ignore[no-untyped-def]
        return []

    def decode_layer(self, view: View) -> Plan:
        def grab(x: object) -> object:
            return None if x is None else np.array(x, copy=True)

        self.seen.append(
            {
                "layer": view.layer,
                "step": view.step,
                "now": view.now,
                "experts": grab(view.experts),
                "weights": grab(view.weights),
                "probs": grab(view.probs),
                "counts": grab(view.counts),
                "next_experts": grab(view.next_experts),
                "next_probs": grab(view.next_probs),
                "resident": grab(view.resident),
                "ready": grab(view.ready),
                "resident_writeable": view.resident.flags.writeable,
            }
        )
        return Plan()


@pytest.mark.parametrize(
    "mode,rule", [("expert", "mod"), ("expert", "balanced"), ("pipeline", "mod")]
)
def test_sharded_views_are_each_gpus_window_of_the_engines_view(mode: str, rule: str) -> None:
    """Each GPU's instance sees exactly its layers' and experts' part of the engine's view,
    as it is at that decision: the residency and landing times after the engine changed them
    in place between decisions, the gate weights of its routed experts, its experts' router
    probabilities and the layer-early view of layer+1 when that layer is also its own."""
    n_layers, n_experts, n = 6, 8, 2
    pop = np.arange(n_experts, dtype=np.float64)[::-1] ** 2  # balanced: uneven popularity
    pl = Placement(MultiGpuConfig(n, mode, rule), n_layers, n_experts, popularity=pop)
    sharded = ShardedPolicy(_Recorder(), pl, [24, 24])  # room for any residency
    model = replace(get_model("mixtral-8x7b"), moe_layers=n_layers, experts=n_experts)
    sharded.setup(SetupContext(model=model, budget=48, costs=None, calibration=None,  # type: ignore[arg-type]
                               calibration_prefill=None))  # fmt: skip
    rng = np.random.default_rng(1)
    res = np.zeros((n_layers, n_experts), dtype=bool)
    ready = np.zeros((n_layers, n_experts))
    src = View()
    src.resident, src.ready = res.view(), ready.view()
    src.resident.flags.writeable = src.ready.flags.writeable = False
    for step in range(3):
        for layer in range(n_layers):
            # the engine changes its arrays in place between decisions
            res[...] = rng.random(res.shape) < 0.5
            ready[...] = rng.random(ready.shape)
            routed = rng.choice(n_experts, size=3, replace=False)
            src.step, src.layer, src.now = step, layer, float(step * 10 + layer)
            src.experts = routed.astype(np.int64)
            src.weights = rng.random(3).astype(np.float32)
            src.probs = rng.random(n_experts).astype(np.float32)
            last = layer == n_layers - 1
            src.next_experts = None if last else rng.choice(n_experts, 2, replace=False)
            src.next_probs = None if last else rng.random(n_experts).astype(np.float32)
            sharded.decode_layer(src)
            for k, inner in enumerate(sharded.inner):
                if layer not in pl.layers_of[k]:
                    assert not inner.seen or inner.seen[-1]["now"] != src.now
                    continue
                got = inner.seen[-1]
                rows, cols = pl.layers_of[k], pl.experts_of[k]
                assert got["now"] == src.now and got["layer"] == rows.index(layer)
                assert np.array_equal(got["resident"], res[np.ix_(rows, cols)])
                assert np.array_equal(got["ready"], ready[np.ix_(rows, cols)])
                assert got["resident_writeable"] is False
                mine = [int(e) for e in routed if e in cols]
                assert got["experts"].tolist() == [cols.index(e) for e in mine]
                pos = [routed.tolist().index(e) for e in mine]
                assert np.array_equal(got["weights"], src.weights[pos])
                assert np.array_equal(got["probs"], src.probs[cols])
                assert got["counts"] is None
                if last or layer + 1 not in rows:
                    assert got["next_experts"] is None and got["next_probs"] is None
                else:
                    want = [cols.index(int(e)) for e in src.next_experts if int(e) in cols]
                    assert got["next_experts"].tolist() == want
                    assert np.array_equal(got["next_probs"], src.next_probs[cols])
