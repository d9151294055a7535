"""Attack corpus, third round: the engine's side of the policy boundary and its clock.

What a policy sees is read-only (a policy writing into ``View.counts`` once changed the run);
every view has the documented shapes whatever the trace stored (top-m probabilities, ids-only
imports); the simulated clock stays exact and every run ends. Each case failed on the code
before it: it changed a result silently, printed a traceback or never finished.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from daopsim.policies.base import Action, Plan, Policy
from daopsim.simulator.cli import main
from daopsim.simulator.errors import PolicyError
from daopsim.simulator.runner import simulate
from daopsim.simulator.serving_config import serving_config
from daopsim.simulator.testing import make_trace

#: View fields that are arrays a policy reads
ARRAY_FIELDS = (
    "counts",
    "weights",
    "probs",
    "experts",
    "next_experts",
    "next_probs",
    "resident",
    "calibration",
    "ready",
)


class Writer(Policy):
    """Tries to write one element of every array its views hold; records what it could."""

    name = "attack-view-writer"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.wrote: set[tuple[str, str]] = set()
        self.shapes: set[tuple[str, str, tuple[int, ...]]] = set()

    def decode_layer(self, view: Any) -> Plan:
        for attr in ARRAY_FIELDS:
            a = getattr(view, attr)
            if isinstance(a, np.ndarray) and a.size:
                try:
                    a.flat[0] = a.flat[0]
                except ValueError:
                    pass
                else:
                    self.wrote.add((view.phase, attr))
        for attr in ("probs", "weights"):
            self.shapes.add((view.phase, attr, np.shape(getattr(view, attr))))
        return Plan(actions={int(e): Action.TEMP for e in view.experts})


RUNS = {
    "fast": {},
    "reference": {"engine": "reference"},
    "serving": {"serving": serving_config(max_batch=2), "sequences": 3},
    "serving reference": {
        "serving": serving_config(max_batch=2),
        "sequences": 3,
        "engine": "reference",
    },
    "two GPUs": {"hw": "2x-rtx4090-pcie4", "gpus": 2},
}


@pytest.mark.parametrize("run", list(RUNS))
def test_every_view_array_is_read_only(run: str) -> None:
    policy = Writer()
    kw = {"sequences": 1, **RUNS[run]}
    simulate(policy=policy, trace="ci-small", record=False, **kw)
    assert policy.wrote == set()


class ZeroesCounts(Policy):
    """Zeroes ``view.counts`` in place at every prefill layer, then runs everything via TEMP."""

    name = "attack-zeroes-counts"

    def decode_layer(self, view: Any) -> Plan:
        if view.counts is not None:
            view.counts[:] = 0
        return Plan(actions={int(e): Action.TEMP for e in view.experts})


def test_a_policy_cannot_change_the_routing_it_is_shown() -> None:
    """Once, zeroing ``counts`` shortened the prefill (TTFT 2.6676 -> 2.5767 s); now the write
    is the policy's fault, one line naming it."""
    with pytest.raises(PolicyError, match=r"attack-zeroes-counts.*read-only"):
        simulate(policy=ZeroesCounts(), trace="ci-small", sequences=1, record=False)


def _ids_only(tmp: Path) -> Path:
    """An imported recording that holds only expert ids (no probabilities, no weights)."""
    rng = np.random.default_rng(0)
    ids = np.stack([[rng.choice(8, 2, replace=False) for _ in range(32)] for _ in range(40)])
    np.save(tmp / "ids.npy", ids)
    out = tmp / "imported.parquet"
    res = CliRunner().invoke(
        main,
        ["trace", "import", "npy", str(tmp / "ids.npy"), "--model", "mixtral-8x7b",
         "--prefill", "8", "-o", str(out)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    return out


def _top_m(tmp: Path) -> Path:
    """A trace of a 128-expert model storing the top 8 router probabilities per row."""
    return make_trace(
        tmp / "topm.parquet", "qwen3-30b-a3b", sequences=3, prefill=4, decode=8, top_m=8
    )


TRACES = {"ids-only import": _ids_only, "top-m probabilities": _top_m}


@pytest.mark.parametrize("kind", list(TRACES))
@pytest.mark.parametrize("engine", ["fast", "reference"])
def test_views_hold_dense_probabilities_whatever_the_trace_stored(
    tmp_path: Path, kind: str, engine: str
) -> None:
    trace = TRACES[kind](tmp_path)
    policy = Writer()
    res = simulate(policy=policy, trace=trace, engine=engine, record=False)
    n = res.config["total_experts"] // len(res.per_layer_hit_rate)
    probs = {shape for phase, attr, shape in policy.shapes if attr == "probs"}
    assert probs == {(n,)}, policy.shapes  # prefill and decode alike: one per expert


@pytest.mark.parametrize("kind", list(TRACES))
def test_learned_learn_and_the_gym_run_on_any_trace(tmp_path: Path, kind: str) -> None:
    from daopsim.gym import ExpertCacheEnv, lru_action

    trace = TRACES[kind](tmp_path)
    res = CliRunner().invoke(
        main, ["run", "--policy", "learned", "--trace", str(trace), "--no-progress", "--json"]
    )
    assert res.exit_code == 0, res.output
    model = tmp_path / "m.json"
    res = CliRunner().invoke(
        main,
        ["learn", "--trace", str(trace), "--rounds", "1", "--epochs", "1", "--no-progress",
         "-o", str(model)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(
        main,
        ["run", "--policy", "learned", "--policy-opt", f"model={model}", "--trace", str(trace),
         "--no-progress"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    env = ExpertCacheEnv(trace=str(trace), hw="a100-80g-pcie4", gpu_experts=3 * 48)
    obs, _ = env.reset(seed=0)
    for _ in range(5):
        obs, _, done, _, _ = env.step(lru_action(obs))
        if done:
            break
    env.close()


# --- the clock ----------------------------------------------------------------------------------


@pytest.mark.parametrize("start", [0.0, 1e6, 1e9, 1e14])
def test_the_shared_cpu_always_moves_forward(start: float) -> None:
    """Processor sharing re-times a call's end at each change; once the work left fell below
    the clock's resolution, the next event landed at the current time and repeated forever
    (daop and fiddler never finished near 1e9 s). Every event now lies ahead, and the calls
    end in a bounded number of events."""
    from daopsim.simulator.core.resources import CpuJob, SharedCpu

    rng = np.random.default_rng(0)
    cpu = SharedCpu("cpu", 2)
    for i in range(6):  # six overlapping calls of uneven work and share
        cpu.submit(
            start + i * 1e-4,
            CpuJob(None, i, start + i * 1e-4, *rng.uniform(1e-4, 3e-3, 1), 0.7, 0.0),
        )
    events = 0
    while cpu.active:
        t = cpu.next_event()
        assert t > cpu.t
        cpu.wake(t)
        events += 1
        assert events < 1000


@pytest.mark.parametrize("start", [0.0, 1e9])
def test_the_reference_cpu_always_moves_forward(start: float) -> None:
    import simpy

    from daopsim.simulator.reference.resources import HostCpu

    env = simpy.Environment(initial_time=start)
    cpu = HostCpu(env, 2)
    rng = np.random.default_rng(0)
    done = []

    def one(i: int) -> Any:
        yield env.timeout(i * 1e-4)
        call = yield from cpu.call((env.now, i), float(rng.uniform(1e-4, 3e-3)), 0.7, 0.0)
        done.append(call)

    for i in range(6):
        env.process(one(i))
    steps = 0
    while env.peek() < float("inf"):
        env.step()
        steps += 1
        assert steps < 10_000
    assert len(done) == 6


def test_arrivals_beyond_the_clock_are_refused(tmp_path: Path) -> None:
    """Epoch arrival times shifted TTFT, 1e14 s added 68 % to latencies and 1e300 s gave zero:
    an arrival past 1e6 s (or a rate whose arrivals spread past it) is one line, exit 2."""
    from cli_checks import one_error

    run = ["run", "--policy", "daop", "--trace", "ci-small", "--no-progress", "--no-bounds"]
    for t in ("1.7e9", "1e14", "1e300"):
        f = tmp_path / f"a{t}.csv"
        f.write_text(
            f"request_id,arrival_s,prompt_tokens,output_tokens,sequence\n0,{t},8,4,0\n1,{t},8,4,1\n"
        )
        res = CliRunner().invoke(main, [*run, "--arrivals", str(f)])
        one_error(res, 2, f.name, "row 1", "arrival_s", "clock")
    res = CliRunner().invoke(main, [*run, "--sequences", "2", "--arrival-rate", "1e-9"])
    one_error(res, 2, "--arrival-rate", "clock")


@pytest.mark.parametrize("policy", ["daop", "fiddler"])
@pytest.mark.parametrize("engine", ["fast", "reference"])
def test_a_late_arrival_within_the_clock_is_timed_as_an_early_one(
    tmp_path: Path, policy: str, engine: str
) -> None:
    """The same request arriving at 0 s and at 9e5 s (inside the clock's range) gets the same
    time to first token and latency, to 1e-6 relative."""
    out = {}
    for t in ("0.0", "900000.0"):
        f = tmp_path / f"a{t}.csv"
        f.write_text(f"request_id,arrival_s,prompt_tokens,output_tokens,sequence\n0,{t},16,8,0\n")
        req = tmp_path / f"r{t}.csv"
        res = CliRunner().invoke(
            main,
            ["run", "--policy", policy, "--trace", "ci-small", "--engine", engine,
             "--arrivals", str(f), "--no-progress", "--requests-out", str(req)],
        )  # fmt: skip
        assert res.exit_code == 0, res.output
        import pandas as pd

        out[t] = pd.read_csv(req).iloc[0]
    for col in ("ttft_s", "latency_s"):
        assert out["900000.0"][col] == pytest.approx(out["0.0"][col], rel=1e-6)


def test_a_profile_with_a_crawling_link_is_refused(tmp_path: Path) -> None:
    """``h2d_pinned_gbs = 1e-9`` once made daop run for ever; rates have a floor now."""
    from cli_checks import one_error

    slow = tmp_path / "slow.toml"
    slow.write_text(
        'extends = "a6000-pcie4"\nname = "slow"\ndescription = "a crawling link"\n'
        "[link]\nh2d_pinned_gbs = 1e-9\n"
    )
    res = CliRunner().invoke(
        main, ["run", "--policy", "daop", "--hw", str(slow), "--trace", "ci-small", "--no-progress"]
    )
    one_error(res, 2, "slow.toml", "link.h2d_pinned_gbs", "below")
