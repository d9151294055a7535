"""Training the ``learned`` policy: imitation of Belady's MIN by DAgger through the environment.

``daopsim learn`` and :func:`learn` (docs/learned-policies.md). Each round plays every training
sequence at every budget through :class:`daopsim.simulator.gym_env.ExpertCacheEnv` and records, at
each eviction with more than one candidate, the candidates' features and Belady's choice there (the
candidates whose next use is farthest: several when they tie, e.g. never used again). Round 0
follows Belady's own choices; each later round follows the model fitted so far, so the data
covers the states the model itself reaches (DAgger: Ross, Gordon and Bagnell, AISTATS 2011).
After each round the scorer (policies/learned.py) is fitted on everything recorded: a softmax
over a decision's candidates' scores, trained by cross-entropy against Belady's choice (spread
evenly over tied candidates) with Adam. numpy only; seeded, so a run is reproducible.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from daopsim.policies.learned import Scorer
from daopsim.policies.observed import FEATURES
from daopsim.simulator.errors import UserError, check_seed

#: progress callback, called after each rollout: (rollouts done, rollouts in all, which one)
Progress = Callable[[int, int, str], None]


@dataclass
class LearnConfig:
    """What ``daopsim learn`` trains on and how."""

    trace: str | None = None  #: the trace (None: the bundled default, Mixtral-8x7B)
    #: training sequence ids; None: the first half of the trace's sequences (the rest held out)
    sequences: list[int] | None = None
    #: experts per layer to play at; None: 1.5, 2 and 2.5 x top-k (below the expert count)
    budgets: list[int] | None = None
    hw: str = "a100-80g-pcie4"  #: the machine (choices do not depend on timing; it must fit)
    rounds: int = 3  #: DAgger rounds (round 0 follows Belady)
    hidden: int = 16  #: hidden units of the scorer
    epochs: int = 20  #: passes over the data per fit
    batch: int = 1024  #: decisions per gradient step
    lr: float = 0.01  #: Adam's step size
    seed: int = 0  #: initial weights and shuffling


@dataclass
class LearnResult:
    """A trained scorer and how its training went."""

    scorer: Scorer
    config: dict[str, Any]  #: the resolved LearnConfig
    #: per round: decisions recorded, the rolled-out policy's agreement with Belady, the fit's
    #: final loss and its agreement on all data so far
    rounds: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def default_budgets(experts: int, top_k: int) -> list[int]:
    """1.5, 2 and 2.5 x top-k experts per layer, at most ``experts - 1``, distinct."""
    out = sorted({min(experts - 1, max(top_k + 1, round(f * top_k))) for f in (1.5, 2.0, 2.5)})
    return [b for b in out if b > top_k]


def resolve(config: LearnConfig) -> tuple[LearnConfig, Any]:
    """The config with its defaults filled in (sequences, budgets) and the trace's metadata."""
    from daopsim.simulator.data import DEFAULT_TRACE, resolve_trace
    from daopsim.simulator.trace_read import checked_sequence_ids, read_meta

    path = resolve_trace(config.trace)
    meta = read_meta(path)
    ids = checked_sequence_ids(path, meta)
    seqs = config.sequences
    if seqs is None:
        seqs = ids[: (len(ids) + 1) // 2]
    missing = sorted(set(seqs) - set(ids))
    if missing or not seqs:
        raise UserError(
            f"--sequences: {path} has no sequence {missing[0] if missing else '(none given)'}"
        )
    model = meta.model
    budgets = config.budgets or default_budgets(model.experts, model.top_k)
    for b in budgets:
        if not model.top_k < b < model.experts:
            raise UserError(
                f"--budgets: {b} experts per layer; give more than top-k ({model.top_k}) and "
                f"fewer than the experts ({model.experts}), or there is no choice to learn"
            )
    check_seed(config.seed)
    for key in ("rounds", "hidden", "epochs", "batch"):
        if getattr(config, key) < 1:
            raise UserError(f"--{key}: must be >= 1, got {getattr(config, key)}")
    if not config.lr > 0:
        raise UserError(f"--lr: must be > 0, got {config.lr}")
    # a bundled trace keeps its short name (the model file records it; no local paths)
    label = config.trace if config.trace is not None else DEFAULT_TRACE
    out = LearnConfig(**{**asdict(config), "trace": str(label), "sequences": sorted(set(seqs))})
    out.budgets = sorted(set(budgets))
    return out, meta


def scorer_action(scorer: Scorer) -> Callable[[dict[str, Any], dict[str, Any]], int]:
    """An environment agent making the ``learned`` policy's choices with ``scorer``."""

    def act(obs: dict[str, Any], info: dict[str, Any]) -> int:
        cands = np.flatnonzero(obs["action_mask"])
        if len(cands) == 1:
            return int(cands[0])
        return int(cands[int(np.argmax(scorer.scores(obs["features"][cands])))])

    return act


def _rollout(
    env: Any, seq: int, act: Callable[[dict[str, Any], dict[str, Any]], int] | None
) -> tuple[list[np.ndarray], list[np.ndarray], int, int]:
    """One episode; ``act`` None follows Belady. (features, targets, agreeing choices, choices)
    of the decisions with more than one candidate."""
    xs: list[np.ndarray] = []
    ts: list[np.ndarray] = []
    agree = n = 0
    obs, info = env.reset(options={"sequences": [seq]})
    while True:
        cands = np.flatnonzero(obs["action_mask"])
        nu = info["next_use"][cands]
        best = nu == nu.max()
        if act is None:
            action = int(cands[int(np.argmax(best))])
        else:
            action = act(obs, info)
        if len(cands) > 1:
            xs.append(obs["features"][cands])
            ts.append(best / best.sum())
            n += 1
            agree += bool(best[int(np.searchsorted(cands, action))])
        obs, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            return xs, ts, agree, n


def _pad(xs: list[np.ndarray], ts: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Decisions as [n, candidates, features] with a mask and targets (padding: 0)."""
    width = max(len(t) for t in ts)
    n = len(ts)
    X = np.zeros((n, width, len(FEATURES)))
    M = np.zeros((n, width), dtype=bool)
    T = np.zeros((n, width))
    for i, (x, t) in enumerate(zip(xs, ts, strict=True)):
        k = len(t)
        X[i, :k] = x
        M[i, :k] = True
        T[i, :k] = t
    return X, M, T


def fit(
    X: np.ndarray,
    M: np.ndarray,
    T: np.ndarray,
    hidden: int,
    epochs: int,
    batch: int,
    lr: float,
    seed: int,
) -> tuple[Scorer, float, float]:
    """Fit a scorer to decisions ``X`` (mask ``M``, targets ``T``); (scorer, the last epoch's
    mean loss, the share of decisions whose top score is a target candidate)."""
    rows = X[M]
    mean = rows.mean(axis=0)
    scale = rows.std(axis=0)
    scale[scale < 1e-9] = 1.0  # a constant feature (one budget, no prefill) carries nothing
    Z = np.where(M[..., None], (X - mean) / scale, 0.0)
    rng = np.random.default_rng(seed)
    nf = Z.shape[2]
    params = [
        rng.normal(0.0, 1.0 / np.sqrt(nf), (nf, hidden)),
        np.zeros(hidden),
        rng.normal(0.0, 1.0 / np.sqrt(hidden), hidden),
    ]
    m1 = [np.zeros_like(p) for p in params]
    m2 = [np.zeros_like(p) for p in params]
    b1_, b2_, eps = 0.9, 0.999, 1e-8
    step = 0
    n = len(Z)
    loss = 0.0
    for _ in range(epochs):
        perm = rng.permutation(n)
        total = 0.0
        for lo in range(0, n, batch):
            idx = perm[lo : lo + batch]
            z, m, t = Z[idx], M[idx], T[idx]
            w1, b1, w2 = params
            h = np.tanh(z @ w1 + b1)
            s = np.where(m, h @ w2, -np.inf)
            s -= s.max(axis=1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=1, keepdims=True)
            total += float(-(t * np.log(np.where(m, p, 1.0))).sum())
            ds = np.where(m, p - t, 0.0) / len(idx)
            da = (ds[..., None] * w2) * (1.0 - h * h)
            grads = [
                np.einsum("bcf,bch->fh", z, da),
                da.sum(axis=(0, 1)),
                np.einsum("bch,bc->h", h, ds),
            ]
            step += 1
            for i, g in enumerate(grads):
                m1[i] = b1_ * m1[i] + (1 - b1_) * g
                m2[i] = b2_ * m2[i] + (1 - b2_) * g * g
                mh = m1[i] / (1 - b1_**step)
                vh = m2[i] / (1 - b2_**step)
                params[i] = params[i] - lr * mh / (np.sqrt(vh) + eps)
        loss = total / n
    scorer = Scorer(mean=mean, scale=scale, w1=params[0], b1=params[1], w2=params[2])
    scores = np.where(M, np.tanh(Z @ params[0] + params[1]) @ params[2], -np.inf)
    top = np.argmax(scores, axis=1)
    agreement = float((T[np.arange(n), top] > 0).mean())
    return scorer, loss, agreement


def learn(config: LearnConfig, progress: Progress | None = None) -> LearnResult:
    """Train a scorer by DAgger (see the module docstring); deterministic for a config."""
    from daopsim.simulator.gym_env import ExpertCacheEnv

    t0 = time.perf_counter()
    cfg, meta = resolve(config)
    assert cfg.sequences is not None and cfg.budgets is not None
    n_layers = meta.model.moe_layers
    envs = {
        b: ExpertCacheEnv(trace=cfg.trace, hw=cfg.hw, gpu_experts=b * n_layers, oracle=True)
        for b in cfg.budgets
    }
    total = cfg.rounds * len(cfg.sequences) * len(cfg.budgets)
    done = 0
    xs: list[np.ndarray] = []
    ts: list[np.ndarray] = []
    rounds: list[dict[str, Any]] = []
    scorer: Scorer | None = None
    try:
        for r in range(cfg.rounds):
            act = None if scorer is None else scorer_action(scorer)
            agree = n = 0
            for b in cfg.budgets:
                for seq in cfg.sequences:
                    x, t, a, k = _rollout(envs[b], seq, act)
                    xs += x
                    ts += t
                    agree += a
                    n += k
                    done += 1
                    if progress is not None:
                        progress(done, total, f"round {r}, {b}/layer, sequence {seq}")
            if not ts:
                raise UserError("no eviction had a choice to learn from; give larger budgets")
            X, M, T = _pad(xs, ts)
            scorer, loss, fit_agree = fit(
                X, M, T, cfg.hidden, cfg.epochs, cfg.batch, cfg.lr, cfg.seed + r
            )
            rounds.append(
                {
                    "round": r,
                    "rolled_out": "belady" if act is None else "learned",
                    "decisions": n,
                    "rollout_agreement": a_share(agree, n),
                    "data": len(ts),
                    "loss": loss,
                    "fit_agreement": fit_agree,
                }
            )
    finally:
        for env in envs.values():
            env.close()
    assert scorer is not None
    resolved = asdict(cfg)
    scorer.trained = {
        "method": "DAgger imitation of Belady's MIN (daopsim learn)",
        **{k: resolved[k] for k in ("trace", "sequences", "budgets", "hw", "rounds", "hidden")},
        **{k: resolved[k] for k in ("epochs", "batch", "lr", "seed")},
        "decisions": len(ts),
    }
    return LearnResult(scorer, resolved, rounds, time.perf_counter() - t0)


def a_share(part: int, whole: int) -> float:
    """``part / whole``, NaN for an empty whole."""
    return part / whole if whole else float("nan")


def evaluate(
    trace: str,
    sequences: list[int],
    budgets: list[int],
    policies: tuple[str, ...] = ("lru", "lfu", "learned", "belady"),
    hw: str = "a100-80g-pcie4",
    model: str = "",
    progress: Progress | None = None,
) -> Any:
    """One run per policy, budget (experts per layer) and sequence: a DataFrame of each run's
    hit rate and tokens/s (``model``: the ``learned`` policy's model file, '' the bundled)."""
    import pandas as pd

    from daopsim.simulator.data import resolve_trace
    from daopsim.simulator.runner import simulate
    from daopsim.simulator.trace_read import read_meta

    n_layers = read_meta(resolve_trace(trace)).model.moe_layers
    rows = []
    total = len(policies) * len(budgets) * len(sequences)
    for b in budgets:
        for pol in policies:
            opts = {"model": model} if pol == "learned" else None
            for seq in sequences:
                r = simulate(
                    policy=pol,
                    trace=trace,
                    hw=hw,
                    gpu_experts=b * n_layers,
                    evaluate=[seq],
                    policy_options=opts,
                    record=False,
                )
                m = r.metrics
                rows.append(
                    {
                        "trace": trace,
                        "budget": b,
                        "policy": pol,
                        "sequence": seq,
                        "hit_rate": m["hit_rate"],
                        "tokens_per_s": m["tokens_per_s"],
                    }
                )
                if progress is not None:
                    progress(len(rows), total, f"{trace} {b}/layer {pol} sequence {seq}")
    return pd.DataFrame(rows)


def summarise(runs: Any) -> Any:
    """Mean and standard deviation over sequences of :func:`evaluate`'s runs, per trace,
    budget and policy (the sample standard deviation, ddof=1)."""
    g = runs.groupby(["trace", "budget", "policy"], sort=False)[["hit_rate", "tokens_per_s"]]
    out = g.agg(["mean", "std"])
    out.columns = [f"{a}_{b}" for a, b in out.columns]
    out["sequences"] = g.size()
    return out.reset_index()
