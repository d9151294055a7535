"""The Gymnasium environment's step rate (run by `make bench`; docs/performance.md).

Decisions (``env.step`` calls) per CPU second of the process for one episode of the bundled
Mixtral trace (one sequence, the default machine and budget), stepped by the scripted LRU
agent, with and without the oracle's next-use info; and the same run as a plain ``lru`` run,
so the environment's own cost per decision is their difference. Target: at least 2,000
decisions per CPU second with the oracle (a training round of four sequences at three budgets,
about 150,000 decisions, then takes about a minute).
"""

from __future__ import annotations

import time

import pytest
from benchutil import save

from daopsim.gym import ExpertCacheEnv, lru_action, run_agent
from daopsim.simulator.runner import simulate

pytestmark = pytest.mark.bench

TARGET_STEPS_PER_S = 2_000
REPEATS = 2


def _best(fn: object) -> tuple[float, float, object]:
    """(CPU seconds, wall seconds, result) of the fastest of REPEATS calls."""
    best: tuple[float, float, object] | None = None
    for _ in range(REPEATS):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()  # type: ignore[operator]
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        if best is None or cpu < best[0]:
            best = (cpu, wall, out)
    assert best is not None
    return best


def test_env_step_rate() -> None:
    """Decisions per CPU second through the environment, and the plain run's time."""
    simulate(policy="lru", evaluate=[0], record=False)  # one-off start-up costs, untimed
    plain_cpu, _, _ = _best(lambda: simulate(policy="lru", evaluate=[0], record=False))
    rates = {}
    for oracle in (True, False):
        env = ExpertCacheEnv(oracle=oracle)
        cpu, wall, out = _best(
            lambda env=env: run_agent(env, lru_action, options={"sequences": [0]})
        )
        steps = out[1]  # type: ignore[index]
        rates["oracle" if oracle else "no_oracle"] = {
            "steps": steps,
            "steps_per_s": round(steps / cpu),
            "cpu_seconds": round(cpu, 2),
            "seconds": round(wall, 2),
            "us_per_step_over_plain_run": round((cpu - plain_cpu) / steps * 1e6, 1),
        }
        print(f"oracle={oracle}: {steps / cpu:,.0f} steps/s ({steps} steps, {cpu:.2f} s CPU)")
    rates["plain_lru_cpu_seconds"] = round(plain_cpu, 2)  # type: ignore[assignment]
    save("gym_step_rate", rates)
    assert rates["oracle"]["steps_per_s"] >= TARGET_STEPS_PER_S
