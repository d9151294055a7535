"""Set-up and step-loop shortcuts that must not change a result.

The calibration read of a small trace also assembles the evaluation sequences
(``daopsim.simulator.calibration._STASH_ROWS``), and the engine's ``View`` builds a decode
token's rows only when a policy reads them. Both are checked against the plain way here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import daopsim.simulator.calibration as calibration
import daopsim.simulator.runner as runner
from daopsim.policies.base import _LAZY, View
from daopsim.simulator.runner import simulate


def _same(a: Any, b: Any) -> bool:
    """Equal to the last bit (NaN equal to NaN), recursively."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b) and type(a) is type(b)


@pytest.mark.parametrize("policy", ["daop", "moe-infinity"])
def test_one_pass_set_up_gives_the_same_run(policy: str, monkeypatch: Any) -> None:
    """With and without the evaluation sequences kept by the calibration read."""
    reads: list[object] = []
    real = runner.iter_sequences

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(kwargs.get("sequences"))
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "iter_sequences", counted)
    monkeypatch.setattr(calibration, "iter_sequences", counted)
    kw: dict[str, Any] = {"policy": policy, "trace": "ci-small", "sequences": 2, "record": False}
    one_pass = simulate(**kw)
    n_one = len(reads)
    monkeypatch.setattr(calibration, "_STASH_ROWS", 0)  # no trace is small enough: read twice
    reads.clear()
    two_pass = simulate(**kw)
    assert n_one < len(reads)  # the shortcut was taken, and spared at least one read
    assert _same(one_pass.metrics, two_pass.metrics)
    assert one_pass.config["sequence_ids"] == two_pass.config["sequence_ids"]


def test_lazy_view_rows_are_the_token_rows() -> None:
    """Each lazy attribute is the row the engine used to assign; a setter overrides it."""
    rng = np.random.default_rng(0)
    n_layers, k, n_exp = 4, 2, 8
    w = rng.random((n_layers, k)).astype(np.float32)
    p = rng.random((n_layers, n_exp)).astype(np.float32)
    ee = rng.integers(0, n_exp, (n_layers, k))
    ep = rng.random((n_layers, n_exp)).astype(np.float32)
    v = View()
    v._rows = (w, p, ee, ep)
    for layer in range(n_layers):
        v.layer = layer
        v._weights = v._probs = v._next_experts = v._next_probs = _LAZY
        assert np.array_equal(v.weights, w[layer])
        assert v.weights is v.weights  # built once per layer
        assert np.array_equal(v.probs, p[layer])
        if layer < n_layers - 1:
            assert np.array_equal(v.next_experts, ee[layer + 1])
            assert np.array_equal(v.next_probs, ep[layer + 1])
        else:  # the last layer has no layer-early view
            assert v.next_experts is None and v.next_probs is None
    v._weights = _LAZY
    v.weights = np.zeros(k, dtype=np.float32)
    assert not v.weights.any()
