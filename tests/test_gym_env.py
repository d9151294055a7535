"""The Gymnasium environment (daopsim.gym): exact replays, the Gymnasium API, episode control.

Scripted agents making lru's, lfu's and belady's choices reproduce those policies' runs to the
last bit; rewards add up to the run's time and hits; reset, close and errors never leave a run
suspended; seeds pick sequences as ``daopsim run --sequences N --seed S`` does.
"""

from __future__ import annotations

import gc
import math
import warnings
import weakref
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from daopsim.gym import (
    ENV_ID,
    SCRIPTED,
    ExpertCacheEnv,
    lru_action,
    make_vector_env,
    run_agent,
)
from daopsim.simulator.errors import UserError
from daopsim.simulator.runner import simulate

# Mixtral routing (8 experts, top-2) at 4 experts per layer: every policy has choices to make
RUN = {"trace": "ci-small", "hw": "a100-80g-pcie4", "gpu_experts": 4 * 32}


def _env(**kw: Any) -> ExpertCacheEnv:
    return ExpertCacheEnv(**{**RUN, **kw})


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The metric names whose values differ (NaN equals NaN; floats compared exactly)."""
    assert a.keys() == b.keys()
    out = []
    for k, x in a.items():
        y = b[k]
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            continue
        if x != y:
            out.append(k)
    return out


@pytest.mark.parametrize("policy", ["lru", "lfu", "belady"])
def test_scripted_agent_reproduces_the_policy_bit_for_bit(policy: str) -> None:
    env = _env(episode_sequences=2)
    _, n, result = run_agent(env, SCRIPTED[policy], seed=3)
    ref = simulate(policy=policy, sequences=2, seed=3, record=False, **RUN)
    assert env.sequences == ref.config["sequence_ids"]  # seeds pick as `run --seed` does
    assert n > 100
    assert _same(result.metrics, ref.metrics) == []
    assert result.per_layer_hit_rate == ref.per_layer_hit_rate
    assert np.array_equal(result.token_latency, ref.token_latency)


def test_agents_differ_so_the_replay_test_can_fail() -> None:
    # a test of exactness means something only if the agents' choices change the outcome
    env = _env()
    hits = {p: run_agent(env, a, seed=0)[2].metrics["decode_hits"] for p, a in SCRIPTED.items()}
    assert len(set(hits.values())) == 3


def test_check_env_passes_without_warnings() -> None:
    env = gym.make(ENV_ID, **RUN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    env.close()


def test_rewards_sum_to_the_run_time_and_hits() -> None:
    for mode in ("time", "hits"):
        env = _env(reward=mode)
        obs, info = env.reset(seed=1)
        first = info
        total = 0.0
        while True:
            obs, reward, terminated, _, info = env.step(lru_action(obs))
            assert reward == (-info["elapsed_s"] if mode == "time" else info["span_hits"])
            total += reward
            if terminated:
                break
        m = info["metrics"]
        if mode == "time":
            assert total == pytest.approx(-(m["e2e_s"] - first["now"]), rel=1e-12)
            assert total < 0
        else:
            assert total + first["hits"] == m["decode_hits"] + m["prefill_hits"]


def test_observation_describes_the_decision() -> None:
    env = _env()
    obs, info = env.reset(seed=0)
    for _ in range(50):
        mask = obs["action_mask"].astype(bool)
        resident = obs["resident"].astype(bool)
        routed = obs["routed"].astype(bool)
        assert mask.any() and not (mask & ~resident).any() and not (mask & routed).any()
        assert list(np.flatnonzero(mask)) == info["candidates"]
        assert resident.sum() == 4  # the layer's quota is full at an eviction
        assert sorted(obs["lru_rank"][resident]) == [0, 1, 2, 3]
        assert obs["layer"] == info["layer"]
        assert np.all(info["next_use"] > info["step"])
        assert env.observation_space.contains(obs)
        assert np.array_equal(env.action_masks(), mask)
        obs, _, _, _, info = env.step(lru_action(obs))
    env.close()


def test_invalid_actions_are_replaced_and_flagged() -> None:
    env = _env()
    obs, _ = env.reset(seed=0)
    bad = int(np.flatnonzero(obs["action_mask"] == 0)[0])
    cands = np.flatnonzero(obs["action_mask"])
    expect = cands[cands > bad]
    expect = int(expect[0] if expect.size else cands[0])
    twin = _env()
    twin.reset(seed=0)
    _, r1, _, _, info = env.step(bad)
    _, r2, _, _, info2 = twin.step(expect)
    assert info["invalid_action"] and not info2["invalid_action"]
    assert r1 == r2 and info["now"] == info2["now"]
    env.close()
    twin.close()


def test_same_seed_same_episode_and_reset_mid_episode_leaves_no_trace() -> None:
    env = _env()
    obs, _ = env.reset(seed=5)
    for _ in range(30):
        obs, *_ = env.step(lru_action(obs))
    first = run_agent(env, lru_action, seed=4)  # reset while the seed-5 run is suspended
    again = run_agent(_env(), lru_action, seed=4)
    assert first[:2] == again[:2]
    assert _same(first[2].metrics, again[2].metrics) == []


def test_close_ends_the_run_and_steps_need_a_reset() -> None:
    env = _env()
    env.reset(seed=0)
    episode = env._episode
    assert episode is not None and not episode.glet.dead
    env.close()
    assert episode.glet.dead
    env.close()  # twice is fine
    with pytest.raises(gym.error.ResetNeeded):
        env.step(0)
    _, n, _ = run_agent(env, lru_action, seed=0)  # usable again after a reset
    assert n > 0
    with pytest.raises(gym.error.ResetNeeded):
        env.step(0)  # the episode is over


def test_a_dropped_env_ends_its_suspended_run() -> None:
    # a suspended greenlet is invisible to the garbage collector: the environment's finaliser
    # must end the run, or its frames (and the whole simulation) would stay in memory
    env = _env()
    env.reset(seed=0)
    assert env._episode is not None
    run = weakref.ref(env._episode.glet)
    del env
    gc.collect()
    assert run() is None


def test_an_error_in_the_run_surfaces_and_the_env_recovers() -> None:
    env = ExpertCacheEnv(trace="ci-small", hw="a6000-pcie4", gpu_experts=6 * 32)
    with pytest.raises(UserError, match="do not fit"):
        env.reset(seed=0)
    assert env._episode is None

    class Boom(Exception):
        pass

    def agent(obs: dict[str, Any], info: dict[str, Any]) -> int:
        raise Boom

    env = _env()
    with pytest.raises(Boom):
        run_agent(env, agent, seed=0)
    episode = env._episode
    env.close()
    assert episode is None or episode.glet.dead
    assert run_agent(env, lru_action, seed=0)[1] > 0


def test_bad_arguments_are_one_line_errors() -> None:
    with pytest.raises(UserError, match="reward"):
        _env(reward="speed")
    with pytest.raises(UserError, match="episode_sequences"):
        _env(episode_sequences=7)
    with pytest.raises(UserError, match="no sequence 9"):
        _env(pool=[0, 9])
    with pytest.raises(UserError, match="ids of the pool"):
        _env(pool=[0, 1]).reset(options={"sequences": [2]})


def test_vector_env_steps_many_sequences_exactly() -> None:
    venv = make_vector_env(2, **RUN)
    obs, infos = venv.reset(seed=10)
    done = [False, False]
    metrics: list[dict[str, Any] | None] = [None, None]
    seqs = [venv.envs[i].unwrapped.sequences for i in range(2)]
    while not all(done):
        actions = np.array([lru_action({k: v[i] for k, v in obs.items()}) for i in range(2)])
        obs, _, term, _, infos = venv.step(actions)
        for i in np.flatnonzero(term):
            if not done[i]:
                done[i] = True
                # the vector form gathers each info key over the environments
                metrics[i] = {
                    k: v[i].item() for k, v in infos["metrics"].items() if not k.startswith("_")
                }
    venv.close()
    assert seqs[0] != seqs[1]
    for i in range(2):
        ref = simulate(policy="lru", evaluate=seqs[i], record=False, **RUN)
        assert metrics[i] is not None
        assert _same(metrics[i], ref.metrics) == []
