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
from daopsim.simulator.serving import serving_config
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
    "serving": {"serving": serving_config(None, 2, None, None, None, None, None), "sequences": 3},
    "serving reference": {
        "serving": serving_config(None, 2, None, None, None, None, None),
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
