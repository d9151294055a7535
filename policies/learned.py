"""learned: a per-layer cache whose victim a small trained scorer picks (imitating Belady).

Source: learned cache replacement by imitation of Belady's MIN (Parrot, Liu et al., ICML 2020;
docs/references.md#learned-replacement). The cache rule is ``lru``'s (policies/observed.py);
on each eviction a one-hidden-layer network scores every evictable expert from its features
(recency, frequency, the router's probability; ``daopsim.policies.observed.FEATURES``) and the
highest score is evicted, ties to the lowest id. Inference is numpy only. The weights are a small
JSON file written by ``daopsim learn`` (docs/learned-policies.md); the default is the bundled
``learned_model.json``, trained on the first four sequences of the bundled Mixtral trace.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np

from daopsim.policies._mypyc import mypyc_attr
from daopsim.policies.base import Param
from daopsim.policies.observed import FEATURES, ObservedCache
from daopsim.policies.registry import register
from daopsim.simulator.errors import UserError

#: the model file format this code reads and ``daopsim learn`` writes
FORMAT = "daopsim-learned/1"
#: the bundled model (package data beside this module; found through the package, because a
#: compiled module's ``__file__`` names the shared library of its build group instead)
BUNDLED_MODEL = Path(str(files(__name__.rpartition(".")[0]) / "learned_model.json"))


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
        p = Path(path)
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"{p}: model file not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
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
        if not (arrays["scale"] > 0).all():
            raise UserError(f"{p}: field scale: every entry must be > 0")
        b2 = doc.get("b2", 0.0)
        if not isinstance(b2, int | float) or isinstance(b2, bool) or not np.isfinite(b2):
            raise UserError(f"{p}: field b2: expected a finite number")
        trained = doc.get("trained", {})
        return cls(**arrays, b2=float(b2), trained=trained if isinstance(trained, dict) else {})


class Net:
    """The scorer's network in typed loops (the compiled build runs them as C; a handful of
    candidates costs far less than numpy's per-call overhead): standardised features
    ``z = (x - mean) / scale``, hidden units ``tanh(sum_i z_i w1[i, j] + b1[j])`` with the sum
    taken from the last feature to the first, then ``sum_j h_j w2[j] + b2`` in order.

    The last features of a layer's candidates are the same for all of them (phase, layer,
    quota): :meth:`best` sums their share of each hidden unit once, which the order of the
    sum makes exactly the score of each row alone."""

    def __init__(
        self,
        mean: list[float],
        scale: list[float],
        w1: list[list[float]],
        b1: list[float],
        w2: list[float],
        b2: float,
    ) -> None:
        self.mean = mean
        self.scale = scale
        #: w1's columns: one weight vector per hidden unit
        self.cols: list[list[float]] = [[row[j] for row in w1] for j in range(len(b1))]
        self.b1 = b1
        self.w2 = w2
        self.b2 = b2

    def _z(self, row: list[float], n: int) -> list[float]:
        """The first ``n`` features of ``row``, standardised."""
        mean, scale = self.mean, self.scale
        return [(row[i] - mean[i]) / scale[i] for i in range(n)]

    def _tails(self, row: list[float], m: int) -> list[float]:
        """Each hidden unit's sum over the features from ``m`` on (last first)."""
        n = len(self.mean)
        z = self._z(row, n)
        out: list[float] = []
        for col in self.cols:
            acc = 0.0
            for i in range(n - 1, m - 1, -1):
                acc += z[i] * col[i]
            out.append(acc)
        return out

    def _finish(self, row: list[float], m: int, tails: list[float]) -> float:
        """The score of ``row`` whose hidden sums over the features from ``m`` on are
        ``tails``."""
        z = self._z(row, m)
        b1, w2 = self.b1, self.w2
        out = 0.0
        for j, col in enumerate(self.cols):
            acc = tails[j]
            for i in range(m - 1, -1, -1):
                acc += z[i] * col[i]
            out += math.tanh(acc + b1[j]) * w2[j]
        return out + self.b2

    def score(self, row: list[float]) -> float:
        """The score of one feature row."""
        return self._finish(row, 0, self._tails(row, 0))

    def best(self, rows: list[list[float]]) -> int:
        """The index of the highest-scoring row (the first on ties)."""
        first = rows[0]
        n = len(first)
        m = 0  # every row has the first row's features from m on
        for row in rows:
            k = n
            while k > 0 and row[k - 1] == first[k - 1]:
                k -= 1
            if k > m:
                m = k
        tails = self._tails(first, m)
        best, top = 0, self._finish(first, m, tails)
        for k in range(1, len(rows)):
            s = self._finish(rows[k], m, tails)
            if s > top:
                best, top = k, s
        return best


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

    def decide(self, layer: int, candidates: list[int]) -> int:
        """The candidate with the highest score (the first, i.e. lowest id, on ties)."""
        if len(candidates) == 1:
            return candidates[0]
        return candidates[self.scorer.net.best(self.features(layer, candidates))]


register(LearnedPolicy)
