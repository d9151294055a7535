"""learned: a per-layer cache whose victim a small trained scorer picks (imitating Belady).

Source: learned cache replacement by imitation of Belady's MIN (Parrot, Liu et al., ICML 2020;
docs/references.md#learned-replacement). The cache rule is ``lru``'s (policies/observed.py);
on each eviction a one-hidden-layer network scores every evictable expert from its features
(recency, frequency, the router's probability; ``daopsim.policies.observed.FEATURES``) and the
highest score is evicted, ties to the lowest id. Inference runs in typed loops over floats
(:class:`Net`; C in the compiled build), with no NumPy call per decision. The weights are a small
JSON file written by ``daopsim learn`` (docs/learned-policies.md); the default is the bundled
``learned_model.json``, trained on the first four sequences of the bundled Mixtral trace.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.observed import FEATURES, FeatureSink, ObservedCache
from daopsim.policies.options import Param
from daopsim.policies.registry import register
from daopsim.simulator.errors import UserError

#: the model file format this code reads and ``daopsim learn`` writes
FORMAT = "daopsim-learned/1"
#: the bundled model (package data beside this module; found through the package, because a
#: compiled module's ``__file__`` names the shared library of its build group instead)
BUNDLED_MODEL = Path(str(files(__name__.rpartition(".")[0]) / "learned_model.json"))
#: the largest model file read (a trained one is a few kB)
MAX_MODEL_BYTES = 16 * 2**20
#: bounds on a model's numbers that keep every score finite: features are standardised by
#: ``mean``/``scale`` (``daopsim learn`` floors a scale at 1e-9), so trained weights are small;
#: a larger magnitude comes from a damaged or hand-edited file, and 1e308 would pass a
#: finiteness check yet overflow to NaN scores
MAX_WEIGHT = 1e6
MIN_SCALE = 1e-9


@dataclass
class Scorer:
    """A one-hidden-layer network: standardised features -> tanh hidden units -> a score."""

    mean: np.ndarray  #: [features] subtracted first
    scale: np.ndarray  #: [features] divided by next
    w1: np.ndarray  #: [features, hidden]
    b1: np.ndarray  #: [hidden]
    w2: np.ndarray  #: [hidden]
    b2: float = 0.0
    #: how it was trained (trace, sequences, budgets, ...), kept in the file as given
    trained: dict[str, Any] = field(default_factory=dict)
    #: the same network in typed loops (:class:`Net`), what the policy and the agents score with
    net: Net = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.net = Net(
            self.mean.tolist(),
            self.scale.tolist(),
            self.w1.tolist(),
            self.b1.tolist(),
            self.w2.tolist(),
            float(self.b2),
        )

    def scores(self, x: np.ndarray) -> np.ndarray:
        """Scores of feature rows ``x`` ([n, features]); the highest is evicted."""
        net = self.net
        return np.array([net.score(row) for row in x.tolist()], dtype=np.float64)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of a model file."""
        return {
            "format": FORMAT,
            "features": list(FEATURES),
            "mean": self.mean.tolist(),
            "scale": self.scale.tolist(),
            "w1": self.w1.tolist(),
            "b1": self.b1.tolist(),
            "w2": self.w2.tolist(),
            "b2": float(self.b2),
            "trained": self.trained,
        }

    @classmethod
    def load(cls, path: str | Path) -> Scorer:
        """Read a model file; a missing, malformed or mismatched one is a one-line UserError."""
        from daopsim.simulator.data import read_input_text

        p = Path(path)
        if not os.path.lexists(p):
            raise UserError(f"{p}: model file not found")
        # a regular file of bounded size: a FIFO would block and /dev/zero never end
        text = read_input_text(p, "model", MAX_MODEL_BYTES)
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{p}: not a readable JSON model file ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise UserError(f"{p}: field format: expected {FORMAT!r}")
        if doc.get("features") != list(FEATURES):
            raise UserError(f"{p}: field features: expected {list(FEATURES)}")
        nf = len(FEATURES)
        arrays: dict[str, np.ndarray] = {}
        for key in ("mean", "scale", "w1", "b1", "w2"):
            try:
                arrays[key] = np.asarray(doc[key], dtype=np.float64)
            except (KeyError, TypeError, ValueError):
                raise UserError(f"{p}: field {key}: missing or not numbers") from None
        hidden = arrays["b1"].shape[0] if arrays["b1"].ndim == 1 else -1
        shapes = {"mean": (nf,), "scale": (nf,), "w1": (nf, hidden), "b1": (hidden,)}
        shapes["w2"] = (hidden,)
        for key, shape in shapes.items():
            a = arrays[key]
            if a.shape != shape or not np.isfinite(a).all():
                raise UserError(f"{p}: field {key}: expected finite numbers of shape {shape}")
            if (np.abs(a) > MAX_WEIGHT).any():
                raise UserError(
                    f"{p}: field {key}: entries must be at most {MAX_WEIGHT:g} in magnitude "
                    "(larger ones overflow the scores)"
                )
        if not (arrays["scale"] >= MIN_SCALE).all():
            raise UserError(f"{p}: field scale: every entry must be >= {MIN_SCALE:g}")
        b2 = doc.get("b2", 0.0)
        if not isinstance(b2, int | float) or isinstance(b2, bool) or not np.isfinite(b2):
            raise UserError(f"{p}: field b2: expected a finite number")
        if abs(b2) > MAX_WEIGHT:
            raise UserError(f"{p}: field b2: must be at most {MAX_WEIGHT:g} in magnitude")
        trained = doc.get("trained", {})
        return cls(**arrays, b2=float(b2), trained=trained if isinstance(trained, dict) else {})


def _tanh(x: float) -> float:
    """tanh from ``math.exp`` (a C call in the compiled build, where ``math.tanh`` is a
    call through Python): the same function to a few units in the last place."""
    if x >= 0.0:
        t = math.exp(-2.0 * x)
        return (1.0 - t) / (1.0 + t)
    t = math.exp(2.0 * x)
    return (t - 1.0) / (t + 1.0)


class Unit:
    """One hidden unit of :class:`Net`: its weight from each of the eight :data:`FEATURES`,
    its bias and its output weight, as float attributes (the compiled build keeps them as C
    doubles in the object, where a list of floats would unbox one per read)."""

    def __init__(self, w: list[float], b: float, v: float) -> None:
        self.w0, self.w1, self.w2, self.w3 = w[0], w[1], w[2], w[3]
        self.w4, self.w5, self.w6, self.w7 = w[4], w[5], w[6], w[7]
        self.b = b
        self.v = v


class Net:
    """The scorer's network in typed loops over the eight :data:`FEATURES` (the compiled
    build runs them as C; a handful of candidates costs far less than numpy's per-call
    overhead): ``z = (x - mean) / scale``, hidden units ``tanh(sum_i z_i w1[i, j] + b1[j])``,
    then ``sum_j h_j w2[j] + b2``. Each hidden sum runs from the last feature to the first, so
    the share of the last three, which are the same for every expert of a layer (phase, layer,
    quota), is summed once per decision (:meth:`shared`) and each candidate adds its own five
    (:meth:`score_with`): exactly the score of each row alone."""

    def __init__(
        self,
        mean: list[float],
        scale: list[float],
        w1: list[list[float]],
        b1: list[float],
        w2: list[float],
        b2: float,
    ) -> None:
        if len(mean) != len(FEATURES):
            raise ValueError(f"the network reads {len(FEATURES)} features, got {len(mean)}")
        # each feature's mean and scale as float attributes, as the units' weights
        self.m0, self.m1, self.m2, self.m3, self.m4, self.m5, self.m6, self.m7 = mean
        self.s0, self.s1, self.s2, self.s3, self.s4, self.s5, self.s6, self.s7 = scale
        self.b2 = b2
        self.hidden = len(b1)
        #: the hidden units, each with its column of w1 (w1 is [features, hidden])
        self.units: list[Unit] = [
            Unit([row[j] for row in w1], b1[j], w2[j]) for j in range(self.hidden)
        ]
        #: :meth:`shared` by the three features' values (a run has a few: phase x layer)
        self.memo: dict[tuple[float, float, float], list[float]] = {}

    def shared(self, row: list[float]) -> list[float]:
        """Each hidden unit's sum over the last three features (phase, layer, quota) of
        ``row``, the last first."""
        return self.shared_of(row[5], row[6], row[7])

    def shared_of(self, x5: float, x6: float, x7: float) -> list[float]:
        """:meth:`shared` of the last three features' values."""
        z7 = (x7 - self.m7) / self.s7
        z6 = (x6 - self.m6) / self.s6
        z5 = (x5 - self.m5) / self.s5
        out: list[float] = []
        for u in self.units:
            acc = z7 * u.w7
            acc += z6 * u.w6
            acc += z5 * u.w5
            out.append(acc)
        return out

    def score_with(self, row: list[float], shared: list[float]) -> float:
        """The score of ``row`` whose last three features' sums are ``shared``."""
        return self.score_of(row[0], row[1], row[2], row[3], row[4], shared)

    def score_of(
        self, x0: float, x1: float, x2: float, x3: float, x4: float, shared: list[float]
    ) -> float:
        """:meth:`score_with` of the first five features' values."""
        z4 = (x4 - self.m4) / self.s4
        z3 = (x3 - self.m3) / self.s3
        z2 = (x2 - self.m2) / self.s2
        z1 = (x1 - self.m1) / self.s1
        z0 = (x0 - self.m0) / self.s0
        units = self.units
        out = 0.0
        for j in range(self.hidden):
            u = units[j]
            acc = shared[j]
            acc += z4 * u.w4
            acc += z3 * u.w3
            acc += z2 * u.w2
            acc += z1 * u.w1
            acc += z0 * u.w0
            out += _tanh(acc + u.b) * u.v
        return out + self.b2

    def score(self, row: list[float]) -> float:
        """The score of one feature row."""
        return self.score_with(row, self.shared(row))

    def shared_memo(self, x5: float, x6: float, x7: float) -> list[float]:
        """:meth:`shared_of`, remembered by the three values (do not modify)."""
        key = (x5, x6, x7)
        sh = self.memo.get(key)
        if sh is None:
            sh = self.memo[key] = self.shared_of(x5, x6, x7)
        return sh

    def best(self, rows: list[list[float]]) -> int:
        """The index of the highest-scoring row (the first on ties)."""
        first = rows[0]
        sh = self.shared_memo(first[5], first[6], first[7])
        best, top = 0, self.score_with(first, sh)
        for k in range(1, len(rows)):
            row = rows[k]
            same = row[5] == first[5] and row[6] == first[6] and row[7] == first[7]
            s = self.score_with(row, sh if same else self.shared(row))
            if s > top:
                best, top = k, s
        return best


class Pick(FeatureSink):
    """The highest-scoring expert of a decision as :meth:`ObservedCache.feed` hands over its
    features (the first on ties): :meth:`Net.best` without rows of Python floats."""

    def __init__(self, net: Net) -> None:
        self.net = net
        self.shared: list[float] = []
        #: experts seen, the index of the best so far and its score
        self.seen = 0
        self.best = 0
        self.top = 0.0

    def layer(self, prefill: float, layer_frac: float, quota_frac: float) -> None:
        """A new decision: the layer's hidden sums."""
        self.shared = self.net.shared_memo(prefill, layer_frac, quota_frac)
        self.seen = 0
        self.best = 0

    def expert(
        self,
        lru_rank: float,
        log_age: float,
        freq_share: float,
        recent_share: float,
        router_prob: float,
    ) -> None:
        """Score the next expert; keep it if it beats the best so far."""
        s = self.net.score_of(lru_rank, log_age, freq_share, recent_share, router_prob, self.shared)
        if self.seen == 0 or s > self.top:
            self.best, self.top = self.seen, s
        self.seen += 1


@mypyc_attr(allow_interpreted_subclasses=True)
class LearnedPolicy(ObservedCache):
    """Evict the resident expert a trained scorer rates highest (imitating Belady's MIN)."""

    name = "learned"
    summary = "per-layer cache, victim picked by a small trained scorer (imitates Belady)"
    source = "learned replacement by imitation of Belady's MIN (Parrot, ICML 2020)"
    params = {
        **ObservedCache.params,
        "model": Param(str, "", "model file written by `daopsim learn` ('': the bundled one)"),
    }

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        path = self.options["model"] or BUNDLED_MODEL
        self.scorer = Scorer.load(path)
        self.pick = Pick(self.scorer.net)

    def decide(self, layer: int, candidates: list[int]) -> int:
        """The candidate with the highest score (the first, i.e. lowest id, on ties)."""
        if len(candidates) == 1:
            return candidates[0]
        pick = self.pick
        self.feed(layer, candidates, pick)
        return candidates[pick.best]


register(LearnedPolicy)
