"""A Gymnasium environment over the simulator: an agent picks a per-layer cache's victims.

Public as ``daopsim.gym`` (needs the ``gymnasium`` package: ``pip install daopsim[gym]``);
docs/learned-policies.md defines the observation, action and reward.

How it steps the engine without touching it: an episode is one ordinary
:func:`daopsim.simulator.runner.simulate` run whose policy is a per-layer cache
(:class:`daopsim.policies.observed.ObservedCache`, ``lru``'s rule) that delegates each victim to the
agent. The run executes in a greenlet (a coroutine with its own stack, in the caller's thread):
at each decision the policy switches back to the environment with the observation, and
:meth:`ExpertCacheEnv.step` switches in again with the action. Only one of the two runs at any
time and no thread is involved, so an episode is as deterministic as a run: an agent that makes
``lru``'s choices gets ``daopsim run --policy lru``'s metrics to the last bit
(tests/test_gym_env.py). ``reset`` and ``close`` end an unfinished run by raising an exception
at its pending decision; an exception of the run surfaces in the environment's call. Use an
environment from one thread (greenlets do not cross threads); the vector form steps its
environments one after another.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

try:
    import greenlet
    import gymnasium as gym
    from gymnasium import spaces
except ImportError as exc:  # tests/test_first_use.py hides the extra to exercise it
    from daopsim.simulator.errors import MissingExtra

    raise MissingExtra(
        f"daopsim's Gymnasium environment (daopsim.gym, daopsim learn) needs the gym extra, "
        f"which is not installed ({exc}): pip install 'daopsim[gym]'"
    ) from exc

from daopsim.policies.observed import FEATURES, ObservedCache, as_probs
from daopsim.simulator.boundary import StopRun
from daopsim.simulator.calibration import select_sequences
from daopsim.simulator.data import resolve_trace
from daopsim.simulator.errors import UserError
from daopsim.simulator.oracle import Oracle
from daopsim.simulator.results import RunResult
from daopsim.simulator.runner import simulate
from daopsim.simulator.trace_read import checked_sequence_ids, iter_sequences, read_meta

#: the environment's Gymnasium id (``gymnasium.make(ENV_ID, ...)``, ``gymnasium.make_vec``)
ENV_ID = "daopsim/ExpertCache-v0"
#: ``reward=`` choices: minus the simulated seconds, or the hits, until the next decision
REWARDS = ("time", "hits")


class _Stop(StopRun):
    """Raised at an abandoned episode's pending decision to end its run (a ``StopRun``, so
    the engine's fault wrapper lets it through)."""


class AgentCache(ObservedCache):
    """The per-layer cache of an environment episode: each victim comes from ``ask``."""

    name = "gym-agent"
    summary = "per-layer cache whose victims an external agent chooses (daopsim.gym)"

    def __init__(self, ask: Callable[[dict[str, Any]], int], oracle: Oracle | None, **options: Any):
        super().__init__(**options)
        self.ask = ask
        self.oracle = oracle

    def decide(self, layer: int, candidates: list[int]) -> int:
        """Build the observation, hand it over, and wait for the victim."""
        view = self.view
        assert view is not None
        n_exp, step = self.n_experts, view.step
        routed = np.zeros(n_exp, dtype=np.int8)
        routed[view.experts] = 1
        resident = np.zeros(n_exp, dtype=np.int8)
        resident[self.residents(layer)] = 1
        mask = np.zeros(n_exp, dtype=np.int8)
        mask[candidates] = 1
        st = self.layer_stats(layer)
        obs = {
            "layer": np.int64(layer),
            "prefill": np.int64(view.is_prefill),
            "routed": routed,
            "resident": resident,
            "action_mask": mask,
            "lru_rank": st.lru_rank,
            "age": st.age.astype(np.float32),
            "frequency": st.freq.astype(np.float32),
            "recent": st.recent.astype(np.float32),
            "probs": as_probs(view.probs, n_exp),
            "early_probs": as_probs(view.next_probs, n_exp),
            "features": self.feature_matrix(layer),
        }
        info: dict[str, Any] = {
            "action_mask": mask.copy(),
            "now": float(view.now),
            "hits": self.hits,
            "step": int(step),
            "sequence": int(view.seq_id),
            "token": int(view.token),
            "layer": layer,
            "candidates": list(candidates),
        }
        if self.oracle is not None:
            nu = self.oracle.next_use
            info["next_use"] = np.array([nu(layer, e, step) for e in range(n_exp)])
        victim = self.ask({"obs": obs, "info": info})
        if victim not in candidates:  # the environment checks actions; this is a bug guard
            raise AssertionError(f"victim {victim} is not evictable")
        return victim


class _Episode:
    """One ``simulate`` run in a greenlet, paused at each decision of its policy.

    The run executes in its own greenlet (a coroutine with its own stack, in the caller's
    thread): the policy's decision switches back to the environment with the observation, and
    the environment switches in again with the action. An exception of the run surfaces in the
    environment's call; :meth:`stop` raises :class:`_Stop` at the pending decision.
    """

    def __init__(self, run: Callable[[Callable[[dict[str, Any]], int]], RunResult]) -> None:
        self._run = run
        self.glet = greenlet.greenlet(self._main)
        #: the run waits at a decision for an action
        self.pending = False

    def _main(self) -> tuple[str, Any]:
        try:
            return "done", self._run(self._ask)
        except _Stop:
            return "stopped", None

    def _ask(self, decision: dict[str, Any]) -> int:
        # inside the run: hand the decision to the environment, resume with its action
        action = self.glet.parent.switch(("decision", decision))
        return int(action)

    def _switch(self, *value: Any, stop: bool = False) -> tuple[str, Any]:
        self.glet.parent = greenlet.getcurrent()  # whoever steps the environment
        self.pending = False
        try:
            msg = self.glet.throw(_Stop) if stop else self.glet.switch(*value)
        except BaseException:
            self.glet = greenlet.greenlet(_finished)  # the run is over, with its exception
            raise
        self.pending = msg[0] == "decision"
        return msg  # type: ignore[no-any-return]

    def start(self) -> tuple[str, Any]:
        """Run to the first decision (or the run's end)."""
        return self._switch()

    def send(self, victim: int) -> tuple[str, Any]:
        """Answer the pending decision; returns the next message."""
        return self._switch(victim)

    def stop(self) -> None:
        """End the run at its pending decision; safe to repeat."""
        if self.pending:
            self._switch(stop=True)

    def abandon(self) -> None:
        """:meth:`stop` for an environment being collected: a suspended greenlet is invisible
        to the garbage collector (its frames would keep the run alive), so it must be ended;
        from another thread it cannot be, and is left."""
        with contextlib.suppress(greenlet.error):
            self.stop()


def _expert_id(action: Any) -> int:
    """``action`` as an expert id: an integer (Python, NumPy, or a 0-d integer array), never a
    bool or a float (``int(1.5)`` and ``int(True)`` would both play expert 1)."""
    a = action
    if isinstance(a, np.ndarray) and a.ndim == 0:
        a = a[()]
    if isinstance(a, bool | np.bool_) or not isinstance(a, int | np.integer):
        raise gym.error.InvalidAction(
            f"step: the action must be an expert id (an integer), got {action!r} "
            f"({type(action).__name__})"
        )
    return int(a)


def _finished() -> tuple[str, Any]:
    raise RuntimeError("the episode is over")


def lru_action(obs: dict[str, Any], info: dict[str, Any] | None = None) -> int:
    """``lru``'s choice: the least recently used evictable expert."""
    mask = obs["action_mask"].astype(bool)
    return int(np.argmin(np.where(mask, obs["lru_rank"], np.iinfo(np.int64).max)))


def lfu_action(obs: dict[str, Any], info: dict[str, Any] | None = None) -> int:
    """``lfu``'s choice: the fewest accesses, ties to the least recently used."""
    cands = np.flatnonzero(obs["action_mask"])
    order = np.lexsort((obs["lru_rank"][cands], obs["frequency"][cands]))
    return int(cands[order[0]])


def belady_action(obs: dict[str, Any], info: dict[str, Any]) -> int:
    """``belady``'s choice (needs ``info["next_use"]``): the farthest next use, ties to the
    lowest id."""
    mask = obs["action_mask"].astype(bool)
    return int(np.argmax(np.where(mask, info["next_use"], -1.0)))


#: the scripted agents, by the policy whose choices they make
SCRIPTED = {"lru": lru_action, "lfu": lfu_action, "belady": belady_action}


class ExpertCacheEnv(gym.Env):  # type: ignore[misc]
    """Choose the victim of a per-layer expert cache at each miss of a simulated run.

    One episode is one run over ``episode_sequences`` sequences of ``trace`` (from ``pool``,
    default every sequence), picked by the seed (``reset(seed=s)`` takes
    ``daopsim.simulator.calibration.select_sequences(pool, n, s)``, the ids ``daopsim run
    --sequences n --seed s`` evaluates) or given by ``reset(options={"sequences": [...]})``.
    Each step is one eviction: the action is the expert (of the observation's layer) to evict,
    among those ``obs["action_mask"]`` marks; another action is replaced by the next marked id
    above it (cyclically) and ``info["invalid_action"]`` says so. ``reward="time"``: minus the
    simulated seconds from this decision to the next (or to the run's end), so an episode's
    return is minus its simulated time after the first decision; ``"hits"``: the accesses
    found resident in that span. ``oracle=True`` adds ``info["next_use"]``: each expert's next
    use (a step number, infinity for never), what Belady's MIN reads. ``run_options`` go to
    ``simulate`` (``runtime``, ``dtype``, ``calibration``, ...). The finished run is
    ``env.result`` and its metrics ``info["metrics"]`` on the last step.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        trace: str | None = None,
        hw: str = "a6000-pcie4",
        cache_ratio: float | None = None,
        gpu_experts: int | None = None,
        episode_sequences: int = 1,
        pool: Sequence[int] | None = None,
        reward: str = "time",
        initial: str = "first",
        oracle: bool = True,
        run_options: dict[str, Any] | None = None,
    ) -> None:
        if reward not in REWARDS:
            raise UserError(f"reward must be one of {list(REWARDS)}, got {reward!r}")
        self.trace_path = resolve_trace(trace)
        self.meta = read_meta(self.trace_path)
        ids = checked_sequence_ids(self.trace_path, self.meta)
        if pool is None:
            self.pool = list(ids)
        else:
            self.pool = sorted({int(s) for s in pool})
            missing = sorted(set(self.pool) - set(ids))
            if missing:
                raise UserError(f"{self.trace_path}: no sequence {missing[0]} (pool)")
        if not 1 <= episode_sequences <= len(self.pool):
            raise UserError(
                f"episode_sequences must be in 1..{len(self.pool)} (the pool), "
                f"got {episode_sequences}"
            )
        self.episode_sequences = int(episode_sequences)
        self.reward_mode = reward
        self.use_oracle = bool(oracle)
        self.initial = initial
        self.run_kwargs: dict[str, Any] = {
            **(run_options or {}),
            "trace": str(self.trace_path),
            "hw": hw,
            "cache_ratio": cache_ratio,
            "gpu_experts": gpu_experts,
            "record": False,
        }
        model = self.meta.model
        n_layers, n_exp = model.moe_layers, model.experts
        self.n_layers, self.n_experts = n_layers, n_exp
        # finite bounds: an episode has at most one step per sequence and decode token, and an
        # expert at most one access per token
        counts = self.meta.counts
        steps = float(counts.get("decode_tokens", 0) + counts.get("sequences", 0) + 1)
        tokens = float(counts.get("decode_tokens", 0) + counts.get("prefill_tokens", 0))
        prob = spaces.Box(0.0, 1.0, (n_exp,), np.float32)
        count = spaces.Box(0.0, tokens, (n_exp,), np.float32)
        top = max(float(n_exp), float(np.log1p(steps))) + 1.0
        self.observation_space = spaces.Dict(
            {
                "layer": spaces.Discrete(n_layers),
                "prefill": spaces.Discrete(2),
                "routed": spaces.MultiBinary(n_exp),
                "resident": spaces.MultiBinary(n_exp),
                "action_mask": spaces.MultiBinary(n_exp),
                "lru_rank": spaces.Box(0, n_exp, (n_exp,), np.int64),
                "age": spaces.Box(0.0, steps, (n_exp,), np.float32),
                "frequency": count,
                "recent": count,
                "probs": prob,
                "early_probs": prob,
                "features": spaces.Box(0.0, top, (n_exp, len(FEATURES)), np.float64),
            }
        )
        self.action_space = spaces.Discrete(n_exp)
        self.result: RunResult | None = None
        self.sequences: list[int] = []
        self._episode: _Episode | None = None
        self._finalizer: weakref.finalize | None = None
        self._policy: AgentCache | None = None
        self._last: dict[str, Any] | None = None
        self._oracles: dict[tuple[int, ...], Oracle] = {}

    # -- episodes -------------------------------------------------------------------------------
    def _oracle(self, ids: list[int]) -> Oracle:
        key = tuple(ids)
        if key not in self._oracles:
            o = Oracle(self.n_layers, self.n_experts)
            # the run's evaluation order is file order, as iter_sequences yields them
            for r in iter_sequences(self.trace_path, self.meta, sequences=set(ids)):
                o.add(r)
            self._oracles = {key: o}  # one episode's worth kept: episodes rarely repeat
        return self._oracles[key]

    def _pick(self, seed: int | None, options: dict[str, Any] | None) -> list[int]:
        given = (options or {}).get("sequences")
        if given is not None:
            ids = sorted({int(s) for s in given})
            unknown = sorted(set(ids) - set(self.pool))
            if not ids or unknown:
                raise UserError(f"reset: sequences must be ids of the pool, got {list(given)}")
            return ids
        if seed is None:
            seed = int(self.np_random.integers(2**31))
        return select_sequences(self.pool, self.episode_sequences, int(seed))

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Start an episode (stopping a running one) and return its first decision."""
        super().reset(seed=seed)
        self._end_episode()
        self.result = None
        ids = self._pick(seed, options)
        self.sequences = ids
        oracle = self._oracle(ids) if self.use_oracle else None
        kwargs = {**self.run_kwargs, "evaluate": ids}
        initial = self.initial
        holder: list[AgentCache] = []

        # the run must not reference the environment: its suspended frames would keep it alive
        def run(ask: Callable[[dict[str, Any]], int]) -> RunResult:
            policy = AgentCache(ask, oracle, initial=initial)
            holder.append(policy)
            return simulate(policy=policy, **kwargs)

        episode = _Episode(run)
        self._episode = episode
        # ends the run if the environment is dropped mid-episode (see _Episode.abandon)
        self._finalizer = weakref.finalize(self, episode.abandon)
        self._finalizer.atexit = False  # at exit the process ends the run anyway
        try:
            kind, payload = episode.start()
        except BaseException:
            self._end_episode()
            raise
        self._policy = holder[0]
        if kind != "decision":
            self._end_episode()
            raise UserError(
                f"sequences {ids}: the run made no eviction (the cache never filled), so the "
                "episode has no decision; give a smaller budget"
            )
        self._last = payload
        return self._observe(payload)

    def _observe(self, decision: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        return decision["obs"], dict(decision["info"])

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Evict ``action``; run to the next decision (or the run's end)."""
        episode, last = self._episode, self._last
        if episode is None or last is None or not episode.pending:
            raise gym.error.ResetNeeded("call reset() before step() (the episode is over)")
        mask = last["obs"]["action_mask"]
        victim = _expert_id(action)
        invalid = not (0 <= victim < self.n_experts and mask[victim])
        if invalid:
            cands = np.flatnonzero(mask)
            above = cands[cands > victim] if 0 <= victim < self.n_experts else cands[:0]
            victim = int(above[0] if above.size else cands[0])
        try:
            kind, payload = episode.send(victim)
        except BaseException:
            self._end_episode()
            raise
        info_last = last["info"]
        if kind == "decision":
            info = dict(payload["info"])
            elapsed = info["now"] - info_last["now"]
            hits = info["hits"] - info_last["hits"]
            obs = payload["obs"]
            self._last = payload
            terminated = False
        else:  # the run is over: the last decision's span ends with the run
            result: RunResult = payload
            self.result = result
            assert self._policy is not None
            info = {
                "action_mask": np.zeros(self.n_experts, dtype=np.int8),
                "metrics": dict(result.metrics),
                "sequences": list(self.sequences),
            }
            elapsed = result.metrics["e2e_s"] - info_last["now"]
            hits = self._policy.hits - info_last["hits"]
            obs = {k: np.copy(v) for k, v in last["obs"].items()}
            self._last = None
            self._end_episode()
            terminated = True
        info["elapsed_s"] = elapsed
        info["span_hits"] = hits
        info["invalid_action"] = invalid
        reward = -elapsed if self.reward_mode == "time" else float(hits)
        return obs, float(reward), terminated, False, info

    def action_masks(self) -> np.ndarray:
        """The current decision's valid actions (as boolean; all False between episodes)."""
        if self._last is None:
            return np.zeros(self.n_experts, dtype=bool)
        return self._last["obs"]["action_mask"].astype(bool)  # type: ignore[no-any-return]

    def _end_episode(self) -> None:
        episode, self._episode = self._episode, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if episode is not None:
            episode.stop()

    def close(self) -> None:
        """Stop a running episode; safe to repeat."""
        self._end_episode()
        self._last = None
        super().close()


def make_vector_env(num_envs: int, **env_kwargs: Any) -> gym.vector.SyncVectorEnv:
    """``num_envs`` environments stepped together (Gymnasium's vector API): one sequence
    set per environment, ``reset(seed=s)`` seeding environment ``i`` with ``s + i``."""
    if num_envs < 1:
        raise UserError(f"num_envs must be >= 1, got {num_envs}")
    fn = functools.partial(ExpertCacheEnv, **env_kwargs)
    return gym.vector.SyncVectorEnv([fn] * num_envs)


def run_agent(
    env: ExpertCacheEnv,
    agent: Callable[[dict[str, Any], dict[str, Any]], int],
    seed: int | None = None,
    options: dict[str, Any] | None = None,
) -> tuple[float, int, RunResult]:
    """Play one episode with ``agent(obs, info) -> action``: (return, decisions, the run)."""
    obs, info = env.reset(seed=seed, options=options)
    total, n = 0.0, 0
    while True:
        obs, reward, terminated, truncated, info = env.step(agent(obs, info))
        total += reward
        n += 1
        if terminated or truncated:
            assert env.result is not None
            return total, n, env.result


if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="daopsim.simulator.gym_env:ExpertCacheEnv")
