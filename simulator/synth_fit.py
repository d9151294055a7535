"""Fitting the synthetic generator's parameters to a recording's statistics (``daopsim synth
fit``): a long synthetic twin of a short real trace.

The targets are what ``daopsim trace stats --json`` reports (entropy, concentration, overlap
by lag, hit-rate curves, ...); :func:`fit_params` moves the generator's parameters
(simulator/synth.py) until a trace of the recording's shape has the same statistics, measured
by the same code (docs/synthetic-traces.md, "Fitting to a recording"). Kept apart from the
generator, so an edit to the fit leaves the synthetic-trace cache (keyed by the generator's
source) valid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from daopsim.simulator.errors import UserError
from daopsim.simulator.models import ModelShape
from daopsim.simulator.reuse import CURVE_POLICIES
from daopsim.simulator.synth import GENERATOR, iter_synthetic
from daopsim.simulator.synth_checks import PARAM_BOUNDS
from daopsim.simulator.synth_params import SynthParams
from daopsim.simulator.synth_stats import EXTRA_STAT_KEYS, STAT_KEYS, routing_stats

#: Parameters ``fit_params`` moves by default, with their transform to an unbounded scale.
FIT_PARAMS: dict[str, str] = {
    "temperature": "log",
    "bias_std": "log",
    "bias_first": "log",
    "drift": "logit",
    "drift_first": "logit",
    "drift_last": "logit",
    "token_corr": "logit",
    "temporal_share": "logit",
    "temporal_first": "log",
    "temporal_last": "log",
    "topic_share": "logit",
    "phase_keep": "logit",
    "prefill_bias": "log",
    "repeat_prob": "logit",
    "topic_drift": "logit",
}
#: Reuse mechanisms that are off (0) unless a preset turns them on. The fit frees them when it
#: has reuse targets (overlap_by_lag, lru_curve), starting from these values if they are off.
REUSE_PARAMS = {"repeat_prob": 0.1, "topic_drift": 0.01}
#: Parameters that shape only the prompt's routing and how it relates to the generated
#: tokens', and the targets that measure them. Without such a target (a decode-only
#: recording has none) nothing pins these parameters: the fit leaves them at their start
#: values instead of letting sampling noise carry them off.
PREFILL_PARAMS = ("phase_keep", "prefill_bias")
PREFILL_TARGETS = ("prefill_decode_cosine",)
#: Vector-valued reuse statistics the fit can target (one target per lag or capacity).
REUSE_TARGETS = ("overlap_by_lag", "lru_curve", "lru_curve_cold", "belady_curve_cold")
#: Hit-rate curves by counting rule (docs/trace-format.md, "Reuse statistics"): the warm,
#: pooled rule (``lru_curve``) and the per-sequence cold-start rule (``*_cold``). A fit targets
#: the cold-start curves when the target has them: that rule replays each sequence alone from
#: an empty cache, so its value depends on the sequences' length, which the fit reproduces, and
#: not on how many sequences the recording has or on the cache's arbitrary first residents,
#: which the warm rule's value for a short recording does.
CURVE_RULES = {"warm": ("lru_curve",), "cold": ("lru_curve_cold", "belady_curve_cold")}
#: Sequences a cold-start fit draws at least (``synth fit`` without ``--sequences``): the rule
#: averages over sequences, so drawing more than a short recording has lowers the fit sample's
#: own noise without changing what it measures (a warm fit keeps the recording's count).
COLD_FIT_SEQUENCES = 32
#: How far off a statistic may be before it counts as one unit of misfit.
FIT_SCALE = {
    "entropy_bits": 0.02,
    "max_share": 0.01,
    "overlap_by_lag": 0.005,
    "lru_curve": 0.005,
    "lru_curve_cold": 0.005,
    "belady_curve_cold": 0.005,
}
_EPS = 1e-4


def _to_free(name: str, v: float) -> float:
    if FIT_PARAMS[name] == "log":
        return math.log(max(v, _EPS))
    v = min(max(v, _EPS), 1 - _EPS)
    return math.log(v / (1 - v))


def _from_free(name: str, x: float) -> float:
    """A free coordinate as the parameter's value, inside the bounds the generator's checks
    enforce (``synth_checks.PARAM_BOUNDS``; logit parameters are shares in [0, 1])."""
    if FIT_PARAMS[name] == "log":
        high = PARAM_BOUNDS[name][1]
        return math.exp(x) if x < math.log(high) else high
    return 1.0 / (1.0 + math.exp(-x))


@dataclass(frozen=True)
class _Target:
    """One fitted number: ``stats[key]`` (or ``per_layer[layer][key]``), then ``[sub]``."""

    key: str
    value: float
    layer: int | None = None
    sub: str | int | None = None  # a lag (str key of a dict) or a list index

    @property
    def label(self) -> str:
        """How the target is named in reports and preset files."""
        out = self.key
        if self.sub is not None:
            # lru_curve is listed by capacity (index + 1)
            out += f"[{self.sub + 1 if isinstance(self.sub, int) else self.sub}]"
        if self.layer is not None:
            out += f"[layer {self.layer}]"
        return out


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _curve_capacities(n_exp: int, top_k: int) -> list[int]:
    """Capacities of a full ``lru_curve`` the fit targets: every one below E for up to 16
    experts, else multiples of k (at most 16 of them), so the curve does not outweigh the
    rest. A curve with gaps is used wherever it has a value."""
    if n_exp <= 16:
        return list(range(1, n_exp))
    step = max(top_k, math.ceil((n_exp - 1) / 16 / top_k) * top_k)
    return list(range(top_k, n_exp, step))


def curve_rule(target: dict[str, Any]) -> str:
    """The counting rule a fit targets the hit-rate curves by: ``cold`` (per-sequence cold
    start, ``lru_curve_cold`` and ``belady_curve_cold``) when the stats have it, else ``warm``
    (the pooled ``lru_curve``, e.g. published points)."""
    cold = target.get("lru_curve_cold")
    return "cold" if isinstance(cold, list) and any(_finite(v) for v in cold) else "warm"


def _target_vector(target: dict[str, Any]) -> list[_Target]:
    """Every usable target in a `trace stats` JSON."""
    out: list[_Target] = []
    for key in STAT_KEYS + EXTRA_STAT_KEYS:
        v = target.get(key)
        if _finite(v):
            out.append(_Target(key, float(v)))
    lags = target.get("overlap_by_lag")
    if isinstance(lags, dict):
        out.extend(
            _Target("overlap_by_lag", float(v), sub=str(lag))
            for lag, v in lags.items()
            if _finite(v)
        )
    for key in CURVE_RULES[curve_rule(target)]:
        curve = target.get(key)
        if not (isinstance(curve, list) and curve):
            continue
        k = target.get("top_k") if isinstance(target.get("top_k"), int) else 1
        # a curve with gaps (published points only) is taken as given
        partial = any(not _finite(v) for v in curve[:-1])
        caps = range(1, len(curve)) if partial else _curve_capacities(len(curve), k)
        for cap in caps:
            if _finite(curve[cap - 1]):
                out.append(_Target(key, float(curve[cap - 1]), sub=cap - 1))
    per = target.get("per_layer")
    if isinstance(per, list) and len(per) > 2:
        first = per[0] if isinstance(per[0], dict) else {}
        last = per[-1] if isinstance(per[-1], dict) else {}
        second = per[1] if isinstance(per[1], dict) else {}
        for layer, row, key in (
            (0, first, "consecutive_overlap"),
            (len(per) - 1, last, "consecutive_overlap"),
            (1, second, "lookahead_precision"),
        ):
            v = row.get(key)
            if _finite(v):
                out.append(_Target(key, float(v), layer=layer))
    if not out:
        raise UserError(
            "target statistics have none of the keys "
            + ", ".join(STAT_KEYS + EXTRA_STAT_KEYS + REUSE_TARGETS)
        )
    return out


#: Short names ``--ignore`` accepts besides full keys and target labels.
IGNORE_ALIASES = {
    "lookahead": "lookahead_precision",
    "overlap": "consecutive_overlap",
    "cosine": "prefill_decode_cosine",
    "entropy": "entropy_bits",
    "lags": "overlap_by_lag",
    "lru": "lru_curve",
    "belady": "belady_curve",
    "popularity": "popularity_hit",
}


def _ignored_by(name: str, t: _Target) -> bool:
    if name == "per_layer":
        return t.layer is not None
    return t.label == name or t.key.startswith(name)


def _drop_ignored(targets: list[_Target], ignore: list[str]) -> list[_Target]:
    """Targets left after ``ignore``: each item is a target label (``lru_curve[3]``), a key
    or key prefix (``overlap_by_lag``, ``popularity_hit``), ``per_layer`` (the per-layer
    targets) or a short name from IGNORE_ALIASES (``lookahead``)."""
    keep = list(targets)
    for item in ignore:
        name = IGNORE_ALIASES.get(item.strip(), item.strip())
        hit = [t for t in keep if _ignored_by(name, t)]
        if not hit:
            known = sorted({t.key for t in targets} | set(IGNORE_ALIASES) | {"per_layer"})
            raise UserError(
                f"--ignore {item!r} matches no target of this stats file; known: "
                + ", ".join(known)
            )
        keep = [t for t in keep if t not in hit]
    if not keep:
        raise UserError("--ignore leaves no target to fit")
    return keep


def _measure(stats: dict[str, Any], targets: list[_Target]) -> np.ndarray:
    vals = []
    for t in targets:
        v = stats[t.key] if t.layer is None else stats["per_layer"][t.layer][t.key]
        if t.sub is not None and v is not None:
            v = v[t.sub] if isinstance(t.sub, str) or t.sub < len(v) else None
        vals.append(float("nan") if v is None else float(v))
    return np.array(vals)


@dataclass
class FitResult:
    """Fitted parameters, the targets, what the fitted parameters achieve and the errors."""

    params: SynthParams
    targets: dict[str, float]
    achieved: dict[str, float]
    iterations: int
    evaluations: int
    ignored: list[str] = field(default_factory=list)

    @property
    def errors(self) -> dict[str, float | None]:
        """Achieved minus target, per target (None where the fit could not measure it)."""
        out: dict[str, float | None] = {}
        for key, goal in self.targets.items():
            got = self.achieved.get(key)
            out[key] = None if got is None or not math.isfinite(got) else round(got - goal, 4)
        return out

    def to_dict(self, model: str) -> dict[str, Any]:
        """The preset file ``synth --preset`` reads."""
        return {
            "name": f"{model}-fit",
            "model": model,
            "params": self.params.to_dict(),
            "targets": self.targets,
            "achieved": self.achieved,
            "errors": self.errors,
            "ignored": self.ignored,
            "matches": "statistics fitted by daopsim synth fit",
            "assumes": "mechanism strengths not pinned by the targets keep their start values",
            "fit": {
                "iterations": self.iterations,
                "evaluations": self.evaluations,
                "generator": GENERATOR,
            },
        }


def fit_params(
    model: ModelShape,
    target: dict[str, Any],
    start: SynthParams | None = None,
    sequences: int = 12,
    prompt_tokens: int = 256,
    output_tokens: int = 512,
    seed: int = 12345,
    iterations: int = 10,
    free: list[str] | None = None,
    progress: Any = None,
    ignore: list[str] | None = None,
) -> FitResult:
    """Fit generator parameters so a trace of the given shape matches target statistics.

    Damped Gauss-Newton on transformed parameters with finite differences; every evaluation
    uses the same seed (common random numbers), so the objective is a deterministic function.
    A weak pull toward the start values keeps parameters that no target pins in place.
    ``ignore`` drops targets (see ``_drop_ignored``). With reuse targets (``overlap_by_lag``,
    ``lru_curve``) the short-memory and topic-drift mechanisms (``REUSE_PARAMS``) are freed by
    default, starting from small values if the start has them off.
    """
    start = start or SynthParams()
    all_targets = _target_vector(target)
    targets = _drop_ignored(all_targets, ignore or [])
    if model.moe_layers < 3:
        targets = [t for t in targets if t.layer is None]
    if not targets:
        raise UserError("no target left to fit (per-layer targets need 3 or more layers)")
    free, start = _free_params(free, start, targets)
    obj = _Objective(model, start, free, targets, (sequences, prompt_tokens, output_tokens, seed))
    x, it = _gauss_newton(obj.residual, obj.x0, iterations, progress, len(targets))
    p = obj.params_at(x)
    got = obj.stats_at(p)
    kept = set(targets)
    return FitResult(
        params=p,
        targets={t.label: t.value for t in targets},
        achieved={t.label: round(float(g), 4) for t, g in zip(targets, got, strict=True)},
        iterations=it,
        evaluations=obj.evals,
        ignored=[t.label for t in all_targets if t not in kept],
    )


def _free_params(
    free: list[str] | None, start: SynthParams, targets: list[Any]
) -> tuple[list[str], SynthParams]:
    """The parameters the fit moves (default: the fittable ones the start has on, the reuse
    mechanisms with reuse targets, the prompt's only with prompt targets), each checked, and
    the start with the freed reuse mechanisms switched on at small values."""
    reuse_targets = any(t.key in REUSE_TARGETS for t in targets)
    prefill_targets = any(t.key in PREFILL_TARGETS for t in targets)
    if free is None:
        free = [
            n
            for n in FIT_PARAMS
            if (n in REUSE_PARAMS and reuse_targets)
            or (n not in REUSE_PARAMS and (FIT_PARAMS[n] != "log" or getattr(start, n) > 0))
        ]
        if not prefill_targets:
            free = [n for n in free if n not in PREFILL_PARAMS]
    for name in free:
        if name not in FIT_PARAMS:
            raise UserError(f"cannot fit parameter {name!r}; fittable: {', '.join(FIT_PARAMS)}")
    start = start.replace(
        **{n: v for n, v in REUSE_PARAMS.items() if n in free and getattr(start, n) == 0}
    )
    return free, start


class _Objective:
    """The fit's objective: the scaled misfit of the statistics of a synthetic trace made with
    the free parameters at ``x`` (transformed), plus a weak pull toward the start. Every
    evaluation uses the same seed, so it is a deterministic function of ``x``."""

    def __init__(
        self,
        model: ModelShape,
        start: SynthParams,
        free: list[str],
        targets: list[Any],
        workload: tuple[int, int, int, int],
    ) -> None:
        self.model, self.start, self.free, self.targets = model, start, free, targets
        #: (sequences, prompt tokens, output tokens, seed) of each evaluation's trace
        self.workload = workload
        self.reuse = any(t.key in REUSE_TARGETS for t in targets)
        curve_keys = {t.key for t in targets if t.key.endswith(("_curve", "_curve_cold"))}
        self.caps = tuple(
            sorted({int(t.sub) + 1 for t in targets if t.key in curve_keys and t.sub is not None})
        )
        policies = tuple(p for p in CURVE_POLICIES if any(k.startswith(p) for k in curve_keys))
        self.curves = policies if self.caps else False
        self.rules = ("cold",) if any(k.endswith("_cold") for k in curve_keys) else ("warm",)
        self.goal = np.array([t.value for t in targets])
        self.scale = np.array([FIT_SCALE.get(t.key, 0.01) for t in targets])
        self.x0 = np.array([_to_free(n, getattr(start, n)) for n in free])
        self.evals = 0

    def params_at(self, x: np.ndarray) -> SynthParams:
        """The parameters at ``x``, the temporal and topic shares scaled to leave room for
        fresh noise."""
        p = self.start.replace(
            **{n: _from_free(n, float(v)) for n, v in zip(self.free, x, strict=True)}
        )
        if p.temporal_share + p.topic_share > 0.98:  # keep room for fresh noise
            f = 0.98 / (p.temporal_share + p.topic_share)
            p = p.replace(temporal_share=p.temporal_share * f, topic_share=p.topic_share * f)
        return p

    def stats_at(self, p: SynthParams) -> np.ndarray:
        """The target statistics of the trace ``p`` generates."""
        sequences, prompt_tokens, output_tokens, seed = self.workload
        seqs = list(iter_synthetic(self.model, p, sequences, prompt_tokens, output_tokens, seed))
        stats = routing_stats(
            self.model,
            seqs,
            reuse=self.reuse,
            curves=self.curves,
            capacities=self.caps or None,
            curve_rules=self.rules,
            stack_distance=False,
        )
        return _measure(stats, self.targets)

    def residual(self, x: np.ndarray) -> np.ndarray:
        """The scaled misfit at ``x`` (undefined statistics count 0) and the pull to the
        start."""
        self.evals += 1
        r = np.nan_to_num((self.stats_at(self.params_at(x)) - self.goal) / self.scale, nan=0.0)
        return np.concatenate([r, 0.05 * (x - self.x0)])


def _gauss_newton(
    residual: Any, x0: np.ndarray, iterations: int, progress: Any, n_goal: int
) -> tuple[np.ndarray, int]:
    """Damped Gauss-Newton with finite-difference Jacobians from ``x0``: at most
    ``iterations`` steps, stopping when a step improves nothing or the cost is small; the
    point reached and the iterations run."""
    x = x0.copy()
    r = residual(x)
    cost = float(r @ r)
    damping = 1.0
    it = 0
    for it in range(1, iterations + 1):
        step = 0.08
        jac = np.empty((r.size, x.size))
        for j in range(x.size):
            xj = x.copy()
            xj[j] += step
            jac[:, j] = (residual(xj) - r) / step
        improved = False
        for _ in range(4):
            a = jac.T @ jac + damping * np.diag(np.diag(jac.T @ jac) + 1e-3)
            dx = -np.linalg.solve(a, jac.T @ r)
            dx = np.clip(dx, -1.5, 1.5)
            r_new = residual(x + dx)
            c_new = float(r_new @ r_new)
            if c_new < cost:
                x, r, cost = x + dx, r_new, c_new
                damping = max(damping / 3.0, 1e-3)
                improved = True
                break
            damping *= 4.0
        if progress is not None:
            progress(it, cost)
        if not improved or cost < 0.05 * n_goal:
            break
    return x, it


def check_stats_model(model: ModelShape, target: dict[str, Any], where: str) -> None:
    """A UserError when the stats in ``target`` (``trace stats --json``) describe a model of
    another shape than ``model``: their per-layer and per-capacity lists would not line up."""
    name = target.get("model")
    facts = {
        "MoE layers": (
            len(target["per_layer"]) if isinstance(target.get("per_layer"), list) else None,
            model.moe_layers,
        ),
        "experts": (target.get("experts"), model.experts),
        "top-k": (target.get("top_k"), model.top_k),
    }
    if isinstance(target.get("lru_curve"), list):
        facts["LRU capacities"] = (len(target["lru_curve"]), model.experts)
    for what, (got, want) in facts.items():
        if isinstance(got, int) and not isinstance(got, bool) and got != want:
            of = f" ({name})" if isinstance(name, str) else ""
            raise UserError(
                f"{where}: the statistics are of a model with {got} {what}{of}, but "
                f"{model.name} has {want}; give --model a model of that shape"
            )


def shape_from_stats(target: dict[str, Any]) -> dict[str, int]:
    """Sequences and per-sequence prompt/output tokens recorded in a stats JSON, if any."""
    src = target.get("counts") if isinstance(target.get("counts"), dict) else target
    out: dict[str, int] = {}
    try:
        n = int(src["sequences"])
        if n > 0:
            out["sequences"] = n
            if "prefill_tokens" in src:
                out["prompt_tokens"] = max(1, round(int(src["prefill_tokens"]) / n))
            if "decode_tokens" in src:
                out["output_tokens"] = max(1, round(int(src["decode_tokens"]) / n))
    except (KeyError, TypeError, ValueError):
        pass
    return out
