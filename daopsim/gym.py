"""daopsim.gym: the Gymnasium environment over the simulator (the ``gym`` extra).

``ExpertCacheEnv`` (registered as ``daopsim/ExpertCache-v0``) asks an agent for each victim of
a per-layer expert cache during an ordinary simulated run; ``make_vector_env`` steps several
at once; ``lru_action``, ``lfu_action`` and ``belady_action`` (``SCRIPTED``) make the built-in
policies' choices; ``run_agent`` plays one episode; ``learn`` trains the ``learned`` policy's
scorer and ``evaluate``/``summarise`` judge it on held-out sequences. docs/learned-policies.md
defines the observation, the action and the reward. Needs ``pip install 'daopsim[gym]'``.
"""

from __future__ import annotations

from simulator.gym_env import (
    ENV_ID,
    REWARDS,
    SCRIPTED,
    AgentCache,
    ExpertCacheEnv,
    belady_action,
    lfu_action,
    lru_action,
    make_vector_env,
    run_agent,
)
from simulator.imitation import (
    LearnConfig,
    LearnResult,
    evaluate,
    learn,
    scorer_action,
    summarise,
)

__all__ = [
    "ENV_ID",
    "REWARDS",
    "SCRIPTED",
    "AgentCache",
    "ExpertCacheEnv",
    "LearnConfig",
    "LearnResult",
    "belady_action",
    "evaluate",
    "learn",
    "lfu_action",
    "lru_action",
    "make_vector_env",
    "run_agent",
    "scorer_action",
    "summarise",
]
