"""The host CPU is one shared machine: concurrent CPU experts share its socket and DRAM.

Unit tests of :class:`~daopsim.simulator.core.resources.SharedCpu` (processor sharing, re-timing on
arrivals, the worker limit, DRAM taken by copies on unified memory), engine-level checks that
two concurrent CPU experts finish later than one alone and no earlier than the bandwidth bound,
that DAOP gains next to nothing from a second worker thread on a socket one call saturates, and
that a unified-memory profile no longer times like a PCIe copy of itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import pandas as pd
import pytest

from daopsim.policies.base import Action, Plan, Policy, ResourceSpec, SetupContext, Slot, View
from daopsim.simulator.core.loop import Engine
from daopsim.simulator.core.resources import CpuJob, SharedCpu
from daopsim.simulator.costs import cost_model
from daopsim.simulator.errors import ProfileError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.hardware_spec import HardwareProfile
from daopsim.simulator.recorder import Recorder
from daopsim.simulator.reference import ReferenceEngine
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import roomy, routing_from_experts, tiny_model


def _job(seq: int, t: float, work: float, share: float = 1.0, dram: float = 0.0) -> CpuJob:
    return CpuJob(None, seq, t, work, share, dram)


def _drain(cpu: SharedCpu) -> dict[int, float]:
    """Wake the CPU at each of its events until nothing runs; end time per job."""
    ends: dict[int, float] = {}
    while (t := cpu.next_event()) != float("inf"):
        for j in cpu.wake(t):
            ends[j.seq] = t
    return ends


def test_two_calls_share_the_socket() -> None:
    cpu = SharedCpu("cpu", 2)
    cpu.submit(0.0, _job(1, 0.0, 1.0))
    cpu.submit(0.0, _job(2, 0.0, 1.0))
    assert _drain(cpu) == pytest.approx({1: 2.0, 2: 2.0})


def test_a_later_arrival_re_times_a_running_call() -> None:
    cpu = SharedCpu("cpu", 2)
    cpu.submit(0.0, _job(1, 0.0, 1.0))
    assert cpu.next_event() == pytest.approx(1.0)
    for j in cpu.wake(0.5):  # nothing ends at 0.5: the second call arrives
        raise AssertionError(j)
    cpu.submit(0.5, _job(2, 0.5, 1.0))
    # half of call 1 is left and runs at half speed: it ends at 1.5; call 2 then runs alone
    assert _drain(cpu) == pytest.approx({1: 1.5, 2: 2.0})


def test_partial_shares_overlap_up_to_the_socket() -> None:
    cpu = SharedCpu("cpu", 2)
    cpu.submit(0.0, _job(1, 0.0, 1.0, share=0.6))
    cpu.submit(0.0, _job(2, 0.0, 1.0, share=0.6))
    # together they ask 1.2 of the socket: each runs at 1 / 1.2 of its alone speed
    assert _drain(cpu) == pytest.approx({1: 1.2, 2: 1.2})
    cpu = SharedCpu("cpu", 2)
    cpu.submit(0.0, _job(1, 0.0, 1.0, share=0.4))
    cpu.submit(0.0, _job(2, 0.0, 1.0, share=0.4))
    assert _drain(cpu) == pytest.approx({1: 1.0, 2: 1.0})  # room for both: no slowdown


def test_one_worker_serves_in_submission_order() -> None:
    cpu = SharedCpu("cpu", 1)
    cpu.submit(0.0, _job(1, 0.0, 1.0))
    cpu.submit(0.25, _job(2, 0.25, 1.0))
    cpu.submit(0.5, _job(3, 0.5, 1.0))
    # one thread: no sharing, each waits for the one before
    assert _drain(cpu) == pytest.approx({1: 1.0, 2: 2.0, 3: 3.0})
    # two threads: the third waits until one of the first two ends
    cpu = SharedCpu("cpu", 2)
    cpu.submit(0.0, _job(1, 0.0, 1.0))
    cpu.submit(0.0, _job(2, 0.0, 1.0))
    cpu.submit(0.5, _job(3, 0.5, 1.0))
    assert _drain(cpu) == pytest.approx({1: 2.0, 2: 2.0, 3: 3.0})


def test_a_copy_on_unified_memory_slows_a_cpu_call() -> None:
    cpu = SharedCpu("cpu", 1)
    cpu.submit(0.0, _job(1, 0.0, 1.0, share=1.0, dram=0.5))
    cpu.load(0.0, 1.0, 0.75)  # a copy takes 3/4 of the DRAM for one second
    # the call gets 1/4 of the DRAM, half of what it streams alone: half speed for 1 s
    assert _drain(cpu) == pytest.approx({1: 1.5})
    with pytest.raises(RuntimeError, match="past"):
        cpu.load(0.5, 2.0, 0.1)


class CpuPair(Policy):
    """Layer 0 pre-calculates ``k`` experts of layer 1 on the CPU at once; layer 1 uses them."""

    name = "cpu-pair"

    def __init__(self, k: int, workers: int) -> None:
        self.k = k
        self.workers = workers

    def resources(self) -> ResourceSpec:
        return ResourceSpec(cpu_workers=self.workers)

    def setup(self, ctx: SetupContext) -> Iterable[Slot]:
        return [(0, 0), (0, 1)]

    def decode_layer(self, view: View) -> Plan:
        if view.layer == 0:
            return Plan(actions={0: Action.GPU, 1: Action.GPU}, precalc=[(1, 2), (1, 3)][: self.k])
        if self.k == 2:
            return Plan(actions={2: Action.PRECOMPUTED, 3: Action.PRECOMPUTED})
        return Plan(actions={2: Action.PRECOMPUTED, 3: Action.FETCH})


def _cpu_rows(k: int, workers: int, hw: HardwareProfile, engine: type = Engine) -> pd.DataFrame:
    model = tiny_model(experts=4, top_k=2, moe_layers=2)
    r = routing_from_experts(model, [[[0, 1], [2, 3]]], seq_id=0, n_prefill=0)
    rec = Recorder()
    eng = engine(CpuPair(k, workers), model, cost_model(hw, model), 3, recorder=rec)
    eng.run(iter([r]))
    tl = rec.timeline().astype({"resource": str, "kind": str})
    return tl[tl["kind"] == "precalc"]


def _expert_bytes(hw: HardwareProfile) -> float:
    """Bytes of one tiny-model expert (what the bandwidth bound is computed from)."""
    return float(cost_model(hw, tiny_model(experts=4, top_k=2, moe_layers=2)).host_expert_bytes)


def _slow_cpu(socket: float | None = None) -> HardwareProfile:
    """The A6000 host with a CPU slow enough that the tiny model's calls overlap (the
    activation copies that start them are microseconds apart); ``socket``: its all-thread
    bandwidth as a multiple of what one call streams."""
    hw = load_profile("a6000-pcie4")
    bw = hw.cpu.mem_bw_gbs / 1e4
    sock = None if socket is None else bw * socket
    return dataclasses.replace(
        hw, cpu=dataclasses.replace(hw.cpu, mem_bw_gbs=bw, socket_bw_gbs=sock)
    )


@pytest.mark.parametrize("socket", [None, 1.6])
@pytest.mark.parametrize("engine", [Engine, ReferenceEngine])
def test_two_concurrent_experts_finish_later_than_one_and_within_the_bound(
    socket: float | None, engine: type
) -> None:
    hw = _slow_cpu(socket)
    alone = _cpu_rows(1, 2, hw, engine)
    pair = _cpu_rows(2, 2, hw, engine)
    one = float((alone["end"] - alone["start"]).iloc[0])
    assert one == pytest.approx(cost_model(hw, tiny_model(4, 2, 2)).cpu_expert_s(1))
    each = (pair["end"] - pair["start"]).to_numpy()
    span = float(pair["end"].max() - pair["start"].min())  # both calls, first start to last end
    assert len(each) == 2
    assert (each > one * (1 + 1e-6)).all()  # each later than one alone
    nbytes = _expert_bytes(hw)
    socket_bw = (hw.cpu.socket_bw_gbs or hw.cpu.mem_bw_gbs) * 1e9
    assert span >= 2 * nbytes / socket_bw * (1 - 1e-9)  # the socket's bandwidth bound
    if socket is None:  # one call takes the whole socket: together no faster than in turn
        assert span >= 2 * one * (1 - 1e-9)
    else:  # room for some overlap: faster than in turn, never past the bound
        assert span < 2 * one * 0.9


def test_one_worker_keeps_a_lone_call_at_its_measured_time() -> None:
    hw = _slow_cpu()
    pair = _cpu_rows(2, 1, hw)
    alone = _cpu_rows(1, 1, hw)
    one = float((alone["end"] - alone["start"]).iloc[0])
    d = (pair["end"] - pair["start"]).to_numpy()
    assert d == pytest.approx([one, one], rel=1e-12)  # serial: each alone
    assert pair["start"].iloc[1] == pytest.approx(pair["end"].iloc[0], abs=1e-12)


def _daop_tps(workers: int, trace: str, hw: str = "a6000-pcie4") -> float:
    res = simulate(
        policy="daop",
        trace=trace,
        hw=hw,
        sequences=1,
        cache_ratio=0.25,
        record=False,
        policy_options={"cpu_workers": workers},
    )
    return float(res.metrics["tokens_per_s"])


@pytest.mark.parametrize("trace", ["ci-small", "phi-3.5-moe"])
def test_daop_gains_little_from_a_second_cpu_thread(trace: str) -> None:
    # independent full-speed lanes gave +43 % (ci-small) and +41 % (phi-3.5-moe) here
    one, two = _daop_tps(1, trace), _daop_tps(2, trace)
    assert abs(two / one - 1) < 0.05


def test_unified_memory_changes_results() -> None:
    # bf16 Mixtral does not fit the 64 GB device: the same machine with room for it
    hw = roomy("jetson-orin-64g")
    # a CPU that streams 80 GB/s of the 204.8: with the copies' 2 x 76.4 the DRAM is oversubscribed
    hw = dataclasses.replace(
        hw, cpu=dataclasses.replace(hw.cpu, stream_gbs=(("torch_bf16", 80.0),))
    )
    pcie = dataclasses.replace(hw, link=dataclasses.replace(hw.link, kind="pcie"))
    kw = dict(policy="daop", trace="ci-small", sequences=1, cache_ratio=0.25, record=False)
    uni = simulate(hw=hw, **kw).metrics
    bus = simulate(hw=pcie, **kw).metrics
    # copies and CPU experts share the one DRAM: the CPU slows down while copies run
    assert uni["tokens_per_s"] < bus["tokens_per_s"] * (1 - 1e-3)
    assert uni["h2d_bytes"] == bus["h2d_bytes"]  # same decisions, different timing


def test_unified_dram_defaults_to_the_gpu_bandwidth() -> None:
    hw = load_profile("jetson-orin-64g")
    c = cost_model(hw, "mixtral-8x7b")
    assert c.dram_bw_gbs == hw.link.dram_bw_gbs or c.dram_bw_gbs == hw.gpu.mem_bw_gbs
    assert 0 < c.cpu_dram_share(1) <= 1
    assert c.copy_dram_share(1e9, 1.0) == pytest.approx(2.0 / c.dram_bw_gbs)
    a6000 = cost_model("a6000-pcie4", "mixtral-8x7b")
    assert a6000.cpu_dram_share(1) == 0.0 and a6000.copy_dram_share(1e9, 1.0) == 0.0


def test_socket_bandwidth_is_validated(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(
        'extends = "a6000-pcie4"\nname = "bad"\ndescription = "x"\n[cpu]\nsocket_bw_gbs = -1\n'
    )
    with pytest.raises(ProfileError, match="socket_bw_gbs"):
        load_profile(str(p))
