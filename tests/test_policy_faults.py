"""Policies that break the rules get a PolicyError naming policy, sequence, token and layer.

Through ``simulate`` (the exception's fields), through ``daopsim run`` (exit 2, one line, no
output folder) and through a sweep (the configuration is recorded as an error, the others run).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from daopsim.policies import registry
from daopsim.policies.all_gpu import AllGPUPolicy
from daopsim.policies.base import ALL_GPU_PLAN, Action, Plan, Policy
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

    from daopsim.simulator.core.resources import Lanes

    def broken(self: Lanes, *args: object, **kwargs: object) -> float:
        raise ZeroDivisionError("engine bug")

    monkeypatch.setattr(Lanes, "serve", broken)
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


class ChangesTheSharedPlan(AllGPUPolicy):
    """A subclass that edits the plan its parent returns: the shared ALL_GPU_PLAN."""

    name = "fault-changes-shared-plan"

    def decode_layer(self, view: Any) -> Plan:
        plan = super().decode_layer(view)
        plan.cpu_serial = True
        return plan


class SpoilsTheSharedPlan(Temp):
    """Changes ALL_GPU_PLAN's lists in setup and never returns it: only later runs could
    notice, if it could be changed."""

    name = "fault-spoils-shared-plan"

    def setup(self, ctx: Any) -> Any:
        ALL_GPU_PLAN.evict.append((0, 0))
        return super().setup(ctx)


class VariesTheSharedPlan(AllGPUPolicy):
    """The way to a variant: a copy of the shared plan, changed."""

    name = "fault-varies-shared-plan"

    def decode_layer(self, view: Any) -> Plan:
        plan = super().decode_layer(view).copy()
        plan.cpu_serial = True
        return plan


def test_a_policy_cannot_change_the_shared_all_gpu_plan(trace: Path) -> None:
    """ALL_GPU_PLAN is one object for every policy and run, and cannot be changed: setting a
    field, deleting one or changing one of its lists fails at the line that tries (a
    PolicyError naming the hook and the field), the plan stays as new, and a later run's
    numbers stay those of a run before any attempt."""

    def all_gpu() -> str:  # NaN-safe equality of every metric
        res = simulate(policy="all-gpu", trace=trace, record=False)
        return json.dumps(res.metrics, sort_keys=True, default=str)

    before = all_gpu()
    with pytest.raises(PolicyError) as info:
        simulate(policy=ChangesTheSharedPlan(), trace=trace, record=False)
    text = str(info.value)
    assert "decode_layer raised AttributeError" in text and "cpu_serial" in text
    assert "FrozenPlan" in text
    assert info.value.policy == "fault-changes-shared-plan" and info.value.layer == 0
    with pytest.raises(PolicyError, match="setup raised AttributeError"):
        simulate(policy=SpoilsTheSharedPlan(), trace=trace, gpu_experts=BUDGET, record=False)
    for attempt in (
        lambda: setattr(ALL_GPU_PLAN, "actions", {}),
        lambda: delattr(ALL_GPU_PLAN, "barrier"),
        lambda: ALL_GPU_PLAN.prefetch.append((0, 0, None)),
        lambda: ALL_GPU_PLAN.precalc.append((1, 0)),
    ):
        with pytest.raises(AttributeError):
            attempt()
    with pytest.raises(TypeError):  # a read-only mapping
        ALL_GPU_PLAN.victims[0] = (0, 1)  # type: ignore[index]
    assert ALL_GPU_PLAN.copy() == Plan()  # every field still a new plan's
    assert all_gpu() == before
    # a copy is the policy's own: changed, it runs
    varied = simulate(policy=VariesTheSharedPlan(), trace=trace, record=False)
    assert varied.metrics["e2e_s"] > 0 and all_gpu() == before


# --- a policy file's own mistakes: one line naming it, exit 2, never a traceback or exit 0 ------

#: a policy file of mistakes that once gave a traceback (or a silent success); each class breaks
#: one thing the run reads before or between hooks
POLICY_FILE = """
from daopsim.policies.base import Action, Plan, Policy, ResourceSpec


class Ok(Policy):
    name = "pf-ok"

    def decode_layer(self, view):
        return Plan(actions={int(e): Action.TEMP for e in view.experts})


class ResourcesRaises(Ok):
    name = "pf-resources-raises"

    def resources(self):
        raise ValueError("no spec today")


class ResourcesString(Ok):
    name = "pf-resources-string"

    def resources(self):
        return "pinned"


class ResourcesInvalid(Ok):
    name = "pf-resources-invalid"

    def resources(self):
        return ResourceSpec(cpu_workers=0)


class CalibrationRaises(Ok):
    name = "pf-calibration-raises"

    def uses_calibration(self):
        raise ValueError("undecided")


class LookaheadRaises(Ok):
    name = "pf-lookahead-raises"

    def uses_lookahead(self):
        raise ValueError("undecided")


class LookaheadString(Ok):
    name = "pf-lookahead-string"

    def uses_lookahead(self):
        return "yes"


class ParamsFive(Ok):
    name = "pf-params-five"
    params = 5


class RuntimeFive(Ok):
    name = "pf-runtime-five"
    runtime_profile = 5


class NameFive(Ok):
    name = 5


class InitNeedsArgument(Ok):
    name = "pf-init-argument"

    def __init__(self, x, **options):
        super().__init__(**options)


class HookBaseException(Ok):
    name = "pf-hook-base-exception"

    def decode_layer(self, view):
        raise BaseException("bye")


class ResourcesBaseException(Ok):
    name = "pf-resources-base-exception"

    def resources(self):
        raise BaseException("bye")


class HookExitsZero(Ok):
    name = "pf-hook-exits-zero"

    def decode_layer(self, view):
        if view.token >= 4:
            raise SystemExit(0)
        return super().decode_layer(view)


class Unlimited(Ok):
    name = "pf-unlimited"

    def resources(self):
        return ResourceSpec(unlimited_memory=True)

    def setup(self, ctx):
        m = ctx.model
        return [(layer, e) for layer in range(m.moe_layers) for e in range(m.experts)]

    def decode_layer(self, view):
        return Plan()
"""

#: class -> words the one error line holds (the policy or file, and what went wrong)
FILE_FAULTS = {
    "ResourcesRaises": ("pf-resources-raises", "resources raised ValueError", "no spec today"),
    "ResourcesString": ("pf-resources-string", "resources returned str", "ResourceSpec"),
    "ResourcesInvalid": ("pf-resources-invalid", "resources", "cpu_workers must be >= 1"),
    "CalibrationRaises": ("pf-calibration-raises", "uses_calibration raised ValueError"),
    "LookaheadRaises": ("pf-lookahead-raises", "uses_lookahead raised ValueError"),
    "LookaheadString": ("pf-lookahead-string", "uses_lookahead returned 'yes'"),
    "ParamsFive": ("faulty.py", "ParamsFive", "'params'", "got 5"),
    "RuntimeFive": ("faulty.py", "RuntimeFive", "'runtime_profile'", "got 5"),
    "NameFive": ("faulty.py", "NameFive", "'name'", "got 5"),
    "InitNeedsArgument": ("pf-init-argument", "__init__ raised TypeError", "'x'"),
    "HookBaseException": ("pf-hook-base-exception", "raised BaseException: bye"),
    "ResourcesBaseException": ("pf-resources-base-exception", "resources raised BaseException"),
    "HookExitsZero": ("pf-hook-exits-zero", "raised SystemExit: 0"),
}


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("policy_file") / "faulty.py"
    path.write_text(POLICY_FILE)
    return path


def _one_line(res: Any, code: int, *words: str) -> None:
    from cli_checks import one_error

    one_error(res, code, *words)


@pytest.mark.parametrize("cls", sorted(FILE_FAULTS))
def test_a_policy_files_mistake_is_one_line(
    trace: Path, policy_file: Path, tmp_path: Path, cls: str
) -> None:
    out = tmp_path / "out"
    res = CliRunner().invoke(
        main,
        ["run", "--policy", f"{policy_file}:{cls}", "--trace", str(trace), "--gpu-experts",
         str(BUDGET), "--no-progress", "--no-bounds", "--out", str(out)],
    )  # fmt: skip
    _one_line(res, 2, *FILE_FAULTS[cls])
    assert not out.exists()


@pytest.mark.parametrize(
    "cls",
    ["ResourcesRaises", "ResourcesString", "ResourcesBaseException", "ParamsFive", "NameFive",
     "InitNeedsArgument"],
)  # fmt: skip
def test_policies_show_of_a_faulty_file_is_one_line(policy_file: Path, cls: str) -> None:
    res = CliRunner().invoke(main, ["policies", "show", f"{policy_file}:{cls}"])
    _one_line(res, 2, *FILE_FAULTS[cls][:2])


def test_a_policy_file_raising_base_exception_at_import(tmp_path: Path, trace: Path) -> None:
    path = tmp_path / "dies.py"
    path.write_text('raise BaseException("at import")\n')
    res = CliRunner().invoke(main, ["run", "--policy", f"{path}:X", "--trace", str(trace)])
    _one_line(res, 2, "dies.py", "failed to import", "BaseException: at import")


def test_system_exit_zero_in_a_hook_is_never_a_success(
    trace: Path, policy_file: Path, tmp_path: Path
) -> None:
    """``sys.exit(0)`` in a hook: run exits 2 with nothing written; a sweep records the row as
    failed (exit 1) and keeps the other policies' rows; an experiment exits 2."""
    spec = f"{policy_file}:HookExitsZero"
    table = tmp_path / "s.csv"
    res = CliRunner().invoke(
        main,
        ["sweep", "--policies", f"{spec},lru", "--traces", str(trace), "--gpu-experts",
         str(BUDGET), "--no-progress", "--workers", "1", "-o", str(table)],
    )  # fmt: skip
    assert res.exit_code == 1, (res.output, res.exception)
    import pandas as pd

    rows = {r["policy"]: r for r in pd.read_csv(table).to_dict("records")}
    assert rows["lru"]["status"] == "ok"
    assert rows[spec]["status"] == "error" and "SystemExit: 0" in rows[spec]["error"]
    exp = tmp_path / "e.toml"
    exp.write_text(
        f'name = "e"\nhw = "a6000-pcie4"\ncache_ratios = [0.125]\ntarget = "lru"\n'
        f'[policies.lru]\n[policies."{spec}"]\n[[models]]\ntrace = "{trace}"\n'
    )
    res = CliRunner().invoke(main, ["experiment", str(exp), "-o", str(tmp_path / "eo")])
    _one_line(res, 2, "pf-hook-exits-zero", "SystemExit: 0")
    assert not (tmp_path / "eo").exists()


def test_a_user_policy_with_unlimited_memory_is_a_bound(trace: Path, policy_file: Path) -> None:
    res = CliRunner().invoke(
        main,
        ["run", "--policy", f"{policy_file}:Unlimited", "--trace", str(trace), "--no-progress",
         "--no-bounds", "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    import json

    doc = json.loads(res.stdout)
    assert doc["bound"] is True and doc["gpu_experts"] == doc["total_experts"]
