"""Calibration data (``--calibration none|self|PATH``), seeded sequence selection, the
look-ahead stand-in and run notes for what a trace does not record."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner, Result

from daopsim.simulator.calibration import select_sequences
from daopsim.simulator.cli import main
from daopsim.simulator.errors import UserError
from daopsim.simulator.runner import simulate
from daopsim.simulator.sweep_table import seed_summary
from daopsim.simulator.testing import (
    make_meta,
    make_trace,
    random_routing,
    routing_from_experts,
    tiny_model,
)
from daopsim.simulator.trace_read import read_meta
from daopsim.simulator.trace_write import write_trace


def _run_cli(*args: str) -> Result:
    """``daopsim run ARGS --no-bounds`` through click (output and exit code)."""
    return CliRunner().invoke(main, ["run", *args, "--no-bounds"])


def _skewed(path: Path, sequences: int = 8, tokens: int = 24) -> Path:
    """Decode-heavy routing that prefers high expert ids (7, 6, 5, 4) at every layer."""
    model = tiny_model()
    rng = np.random.default_rng(0)
    p = np.array([1, 1, 1, 1, 4, 6, 8, 10], dtype=float)
    p /= p.sum()
    seqs = []
    for s in range(sequences):
        ex = np.array(
            [[rng.choice(8, 2, replace=False, p=p) for _ in range(4)] for _ in range(tokens)]
        )
        seqs.append(routing_from_experts(model, ex, n_prefill=2, seq_id=s))
    return write_trace(path, make_meta(model), seqs)


def test_policy_without_calibration_evaluates_every_sequence() -> None:
    meta = read_meta(Path(__file__).parents[1] / "traces" / "ci-small.parquet")
    assert meta.calibration_sequences  # the bundled trace declares a hold-out
    lru = simulate(policy="lru", trace="ci-small", record=False)
    assert lru.config["sequences"] == meta.counts["sequences"]
    assert lru.config["calibration"] == "not used"
    none = simulate(policy="lru", trace="ci-small", calibration="none", record=False)
    assert none.config["sequence_ids"] == lru.config["sequence_ids"]
    assert none.config["calibration"] == "none"
    daop = simulate(policy="daop", trace="ci-small", sequences=1, record=False)
    assert daop.config["calibration"] == "held-out"


def test_calibration_none_self_and_errors(tmp_path: Path) -> None:
    trace = make_trace(tmp_path / "t.parquet", sequences=3, seed=1)
    with pytest.raises(UserError, match="--calibration none"):
        simulate(policy="static", trace=trace, calibration="none", cache_ratio=0.5)
    with pytest.raises(UserError, match="initial=popular"):
        simulate(
            policy="lru",
            trace=trace,
            calibration="none",
            policy_options={"initial": "popular"},
            cache_ratio=0.5,
        )
    r = simulate(policy="static", trace=trace, calibration="self", cache_ratio=0.5, record=False)
    assert r.config["calibration"] == "self (in-sample)"
    assert r.config["sequences"] == 3 and r.config["calibration_sequences"] == 3
    res = _run_cli("--policy", "lru", "--trace", str(trace), "--calibration", "none", "--json")
    assert res.exit_code == 0, res.output
    assert '"sequences": 3' in res.output


def test_initial_popular_changes_hits_on_a_skewed_trace(tmp_path: Path) -> None:
    trace = _skewed(tmp_path / "skewed.parquet")

    def hits(**opts: str) -> tuple[float, str]:
        r = simulate(policy="lfu", trace=trace, gpu_experts=8, policy_options=opts, record=False)
        return r.metrics["hit_rate"], r.config["calibration"]

    first, cal_first = hits()
    popular, cal_popular = hits(initial="popular")
    assert cal_first == "not used" and cal_popular == "held-out"
    # popular placement starts with experts 6 and 7 resident instead of 0 and 1
    assert popular > first


def test_seed_selects_the_evaluated_sequences(tmp_path: Path) -> None:
    pool = list(range(10))
    assert select_sequences(pool, 4, 0) == [0, 1, 2, 3]  # seed 0: today's first-N selection
    a, b = select_sequences(pool, 4, 1), select_sequences(pool, 4, 2)
    assert a != b and a == sorted(a) and len(set(a)) == 4
    assert select_sequences(pool, 4, 1) == a  # same seed, same selection
    trace = make_trace(tmp_path / "t.parquet", sequences=8, prefill=2, decode=4, seed=3)
    runs = [
        simulate(policy="lru", trace=trace, sequences=3, seed=s, cache_ratio=0.5, record=False)
        for s in (1, 2)
    ]
    assert runs[0].config["sequence_ids"] != runs[1].config["sequence_ids"]
    assert [r.config["seed"] for r in runs] == [1, 2]


def test_seed_summary_has_mean_and_spread() -> None:
    df = pd.DataFrame(
        {
            "status": ["ok"] * 4,
            "trace": ["t"] * 4,
            "hw": ["h"] * 4,
            "policy": ["lru", "lru", "fiddler", "fiddler"],
            "cache_ratio": [0.5] * 4,
            "seed": [1, 2, 1, 2],
            "tokens_per_s": [1.0, 3.0, 2.0, 2.0],
            "hit_rate": [0.5, 0.7, 0.4, 0.4],
        }
    )
    s = seed_summary(df).set_index("policy")
    assert s.loc["lru", "seeds"] == 2
    assert s.loc["lru", "tokens_per_s_mean"] == 2.0
    assert s.loc["lru", "tokens_per_s_std"] == pytest.approx(np.sqrt(2))
    assert s.loc["fiddler", "hit_rate_std"] == 0.0


def _no_view_trace(path: Path, prefill: int = 2) -> Path:
    model = tiny_model()
    meta = dataclasses.replace(make_meta(model), early_view_recorded=False)
    rng = np.random.default_rng(5)
    seqs = [random_routing(model, s, prefill, 6, rng) for s in range(3)]
    return write_trace(path, meta, seqs)


def test_lookahead_not_recorded_refuses_or_uses_the_stand_in(tmp_path: Path) -> None:
    trace = _no_view_trace(tmp_path / "nv.parquet")
    assert read_meta(trace).format_version() == 2
    with pytest.raises(UserError, match="--lookahead previous-token"):
        simulate(policy="daop", trace=trace, calibration="self", cache_ratio=0.5)
    r = simulate(
        policy="daop",
        trace=trace,
        calibration="self",
        cache_ratio=0.5,
        lookahead="previous-token",
        record=False,
    )
    assert r.config["lookahead"] == "previous-token (stand-in)"
    assert any("stand-in" in n for n in r.config["notes"])
    # a policy that does not read the view runs as before
    lru = simulate(policy="mixtral-offloading", trace=trace, cache_ratio=0.5, record=False)
    assert lru.config["lookahead"] == "not used"
    with pytest.raises(UserError, match="one-layer-early"):
        simulate(
            policy="mixtral-offloading",
            trace=trace,
            cache_ratio=0.5,
            policy_options={"prefetch": True},
        )


def test_decode_only_trace_is_reported(tmp_path: Path) -> None:
    trace = _no_view_trace(tmp_path / "dec.parquet", prefill=0)
    r = simulate(policy="fiddler", trace=trace, calibration="self", cache_ratio=0.5, record=False)
    assert any("no prefill" in n and "fiddler's prefill break-even" in n for n in r.config["notes"])
    res = _run_cli(
        "--policy",
        "daop",
        "--trace",
        str(trace),
        "--calibration",
        "self",
        "--lookahead",
        "previous-token",
        "--cache-ratio",
        "0.5",
    )
    assert res.exit_code == 0, res.output
    assert "note: trace has no prefill: daop's prefill swaps" in res.output


def test_sweep_over_seeds_with_self_calibration(tmp_path: Path) -> None:
    from daopsim.simulator.sweep import sweep

    trace = make_trace(tmp_path / "t.parquet", sequences=6, prefill=2, decode=4, seed=4)
    df = sweep(
        {
            "policies": ["fiddler", "lru"],
            "hw": ["a6000-pcie4"],
            "traces": [str(trace)],
            "cache_ratios": [0.5],
            "sequences": 2,
            "seeds": [1, 2, 3],
            "calibration": "self",
        }
    )
    assert (df["status"] == "ok").all(), df["error"].tolist()
    assert sorted(df["seed"].unique().tolist()) == [1, 2, 3]
    assert df["sequence_ids"].nunique() > 1  # seeds pick different sequences
    assert set(df["calibration"]) == {"self (in-sample)", "not used"}
    summary = seed_summary(df)
    assert (summary["seeds"] == 3).all() and len(summary) == 2


def test_sweep_lookahead_reaches_the_runs(tmp_path: Path) -> None:
    from daopsim.simulator.grid import Grid
    from daopsim.simulator.sweep import sweep
    from daopsim.simulator.sweep_expand import expand

    trace = _no_view_trace(tmp_path / "nv.parquet")
    grid = {
        "policies": ["daop"],
        "traces": [str(trace)],
        "cache_ratios": [0.5],
        "calibration": "self",
    }
    df = sweep(grid)
    assert df["status"].tolist() == ["error"] and "--lookahead" in df["error"][0]
    df = sweep({**grid, "lookahead": "previous-token"})
    assert df["status"].tolist() == ["ok"], df["error"].tolist()
    # the default keeps the configuration keys of sweeps made before the option existed
    plain = expand(Grid.from_dict(grid))[0]
    stand_in = expand(Grid.from_dict({**grid, "lookahead": "previous-token"}))[0]
    assert plain.key != stand_in.key and plain.lookahead == "recorded"
