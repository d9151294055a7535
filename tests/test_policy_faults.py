"""Policies that break the rules get a PolicyError naming policy, sequence, token and layer.

Through ``simulate`` (the exception's fields), through ``daopsim run`` (exit 2, one line, no
output folder) and through a sweep (the configuration is recorded as an error, the others run).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from daopsim.policies import registry
from daopsim.policies.base import Action, Plan, Policy
from daopsim.simulator.cli import main
from daopsim.simulator.errors import PolicyError
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import make_trace

BUDGET = 4
#: tiny model: 4 layers, 8 experts, top-2; 3 sequences of 3 prefill + 4 decode tokens; the
#: runner holds the last sequence out for calibration, so sequences 0 and 1 are evaluated.


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "t.parquet"
    return make_trace(path, sequences=3, prefill=3, decode=4, seed=11)


class Temp(Policy):
    """Legal baseline: every routed expert through a temporary buffer."""

    name = "fault-temp"

    def decode_layer(self, view: Any) -> Plan:
        return Plan(actions={int(e): Action.TEMP for e in view.experts})


class OverBudget(Temp):
    name = "fault-over-budget"

    def decode_layer(self, view: Any) -> Plan:
        # fetches every miss and never names a victim: the slots run out
        return Plan(
            actions={
                int(e): Action.GPU if view.resident[view.layer, e] else Action.FETCH
                for e in view.experts
            }
        )


class EvictsAbsent(Temp):
    name = "fault-evicts-absent"

    def decode_layer(self, view: Any) -> Plan:
        plan = super().decode_layer(view)
        if view.token == 4 and view.layer == 2:
            absent = int(next(e for e in range(8) if not view.resident[2, e]))
            plan.evict.append((2, absent))
        return plan


class ReturnsGarbage(Temp):
    name = "fault-garbage"

    def decode_layer(self, view: Any) -> Any:
        return (
            "all on the GPU please"
            if view.token == 3 and view.layer == 1
            else super().decode_layer(view)
        )


class MalformedVictim(Temp):
    name = "fault-malformed-victim"

    def setup(self, ctx: Any) -> list[tuple[int, int]]:
        return [(0, 0), (1, 0), (2, 0), (3, 0)]

    def decode_layer(self, view: Any) -> Plan:
        if view.phase == "decode" and view.layer == 3:
            e = next(int(x) for x in view.experts if not view.resident[3, x])
            acts = {
                int(x): Action.GPU if view.resident[3, x] else Action.TEMP for x in view.experts
            }
            acts[e] = Action.FETCH
            return Plan(actions=acts, victims={e: "the cold one"})  # not a (layer, expert)
        return Plan(
            actions={
                int(x): Action.GPU if view.resident[view.layer, x] else Action.TEMP
                for x in view.experts
            }
        )


class RaisesLate(Temp):
    name = "fault-raises"

    def decode_layer(self, view: Any) -> Plan:
        if view.seq_id == 1 and view.token == 5 and view.layer == 3:
            raise KeyError("lost my table")
        return super().decode_layer(view)


class RaisesInSetup(Temp):
    name = "fault-raises-in-setup"

    def setup(self, ctx: Any) -> list[tuple[int, int]]:
        raise RuntimeError("cannot read calibration")


class SetupGarbage(Temp):
    name = "fault-setup-garbage"

    def setup(self, ctx: Any) -> Any:
        return [3, 4]  # not (layer, expert) pairs


class RaisesAtSequenceStart(Temp):
    name = "fault-raises-at-start"

    def on_sequence_start(self, seq_id: int, n_prefill: int) -> None:
        if seq_id == 1:
            raise ValueError("no room")


FAULTS: list[tuple[type[Policy], dict[str, Any], tuple[str, ...]]] = [
    (OverBudget, {"seq": 0}, ("slots full", "no victim")),
    (EvictsAbsent, {"seq": 0, "token": 4, "layer": 2}, ("evicts", "not resident")),
    (ReturnsGarbage, {"seq": 0, "token": 3, "layer": 1}, ("returned str", "expected a Plan")),
    (MalformedVictim, {"seq": 0, "token": 3, "layer": 3}, ("malformed plan",)),
    (RaisesLate, {"seq": 1, "token": 5, "layer": 3}, ("KeyError", "lost my table")),
    (RaisesInSetup, {}, ("setup raised RuntimeError", "cannot read calibration")),
    (SetupGarbage, {}, ("setup", "invalid initial placement")),
    (RaisesAtSequenceStart, {"seq": 1}, ("on_sequence_start raised ValueError", "no room")),
]


def _check(err: PolicyError, cls: type[Policy], where: dict[str, Any], words: tuple[str, ...]):
    text = str(err)
    assert "\n" not in text
    assert err.policy == cls.name and f"policy {cls.name!r}" in text
    for key, value in where.items():
        assert getattr(err, key) == value, (key, getattr(err, key), text)
    if "seq" in where:
        assert f"sequence {where['seq']}" in text
    if "token" in where:
        assert f"token {where['token']}" in text and f"layer {where['layer']}" in text
    for w in words:
        assert w in text, (w, text)


@pytest.mark.parametrize(("cls", "where", "words"), FAULTS, ids=[f[0].name for f in FAULTS])
def test_simulate_names_the_fault(trace: Path, cls: type[Policy], where: dict, words: tuple):
    with pytest.raises(PolicyError) as info:
        simulate(policy=cls(), trace=trace, gpu_experts=BUDGET, record=False)
    _check(info.value, cls, where, words)


def test_a_legal_policy_runs(trace: Path) -> None:
    res = simulate(policy=Temp(), trace=trace, gpu_experts=BUDGET, record=False)
    # every sequence is evaluated: the policy uses no calibration data
    assert res.metrics["temp_copies"] > 0 and res.metrics["decode_tokens"] == 12


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The faulty policies under their names, for the CLI and the sweep; removed afterwards."""
    registry.available()
    for cls, _, _ in FAULTS:
        monkeypatch.setitem(registry._REGISTRY, cls.name, cls)
    monkeypatch.setitem(registry._REGISTRY, Temp.name, Temp)
    yield


@pytest.mark.parametrize(("cls", "where", "words"), FAULTS, ids=[f[0].name for f in FAULTS])
def test_run_cli_one_line(
    trace: Path, tmp_path: Path, registered: None, cls: type[Policy], where: dict, words: tuple
) -> None:
    out = tmp_path / "out"
    res = CliRunner().invoke(
        main,
        [
            "run",
            "--policy",
            cls.name,
            "--trace",
            str(trace),
            "--gpu-experts",
            str(BUDGET),
            "--no-progress",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 2, (res.output, res.exception)
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: policy {cls.name!r}"), res.stderr
    assert "Traceback" not in res.output
    assert not out.exists()


def test_sweep_records_the_fault_and_carries_on(
    trace: Path, tmp_path: Path, registered: None
) -> None:
    from daopsim.simulator.sweep import run_sweep

    grid = {
        "policies": [RaisesLate.name, Temp.name, "lru"],
        "traces": [str(trace)],
        "gpu_experts": [BUDGET],
    }
    df, summary = run_sweep(grid, workers=1, out=tmp_path / "s.parquet", progress=False)
    by = {r["policy"]: r for r in df.to_dict("records")}
    assert by[RaisesLate.name]["status"] == "error"
    assert "sequence 1, token 5, layer 3" in by[RaisesLate.name]["error"]
    assert by[Temp.name]["status"] == "ok" and by["lru"]["status"] == "ok"
    assert summary.failed == 1 and summary.ok == 2


@pytest.mark.pure  # patches a core class: needs the interpreted core
def test_an_engine_fault_keeps_its_traceback(trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug inside the engine (here: the lane placement) is not blamed on the policy."""
    import traceback

    from daopsim.simulator.core.resources import Lane

    def broken(self: Lane, submitted: float, duration: float) -> tuple[float, float]:
        raise ZeroDivisionError("engine bug")

    monkeypatch.setattr(Lane, "serve", broken)
    with pytest.raises(ZeroDivisionError, match="engine bug") as info:
        simulate(policy="lru", trace=trace, gpu_experts=BUDGET)
    assert not isinstance(info.value, PolicyError)
    frames = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
    assert any("simulator/core/" in f for f in frames)
    assert frames[-1].endswith("test_policy_faults.py")  # raised where it happened


def test_a_hook_fault_names_the_hook_and_keeps_the_cause(trace: Path) -> None:
    """Every hook goes through one wrapper: the PolicyError chains the original exception."""
    with pytest.raises(PolicyError, match="decode_layer raised KeyError") as info:
        simulate(policy=RaisesLate(), trace=trace, gpu_experts=BUDGET)
    assert isinstance(info.value.__cause__, KeyError)


def test_a_plan_given_none_for_its_lists_holds_empty_ones() -> None:
    """None for victims, prefetch, precalc or evict is the default (empty), not a fault."""
    plan = Plan(victims=None, prefetch=None, precalc=None, evict=None)
    assert (plan.victims, plan.prefetch, plan.precalc, plan.evict) == ({}, [], [], [])
    assert plan == Plan()
    assert Plan().prefetch is not Plan().prefetch  # each plan its own list
