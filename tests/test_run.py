"""`daopsim run` and `simulate()`: JSON keys, output files, budgets, calibration, bounds."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from simulator.cli import main
from simulator.recorder import COLUMNS
from simulator.runner import simulate, split_sequences
from simulator.testing import make_trace
from simulator.trace import read_meta

REQUIRED_TOP = ("policy", "hw", "model", "trace", "gpu_experts", "cache_ratio", "bound")
REQUIRED_METRICS = (
    "tokens_per_s",
    "decode_tokens_per_s",
    "ttft_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "e2e_s",
    "hit_rate",
    "h2d_bytes",
    "d2h_bytes",
    "gpu_busy_frac",
    "cpu_busy_frac",
    "h2d_busy_frac",
    "stall_s",
    "cpu_expert_evals",
    "prefetch_precision",
    "routing_replaced_frac",
    "gate_mass_preserved",
    "energy_j",
    "tokens_per_kj",
)


def _run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, ["run", "--no-progress", *args])
    return res.exit_code, res.stdout, res.stderr


@pytest.fixture(scope="module")
def lru_json() -> dict:
    """One `run --json` of lru on the CI trace, shared by the tests that read it."""
    code, out, err = _run(
        "--policy",
        "lru",
        "--trace",
        "ci-small",
        "--sequences",
        "1",
        "--cache-ratio",
        "0.375",
        "--json",
    )
    assert code == 0, err
    return json.loads(out)


def test_json_has_every_documented_key(lru_json: dict) -> None:
    """`run --json` carries the configuration keys and every metric the issue lists."""
    doc = lru_json
    for key in REQUIRED_TOP:
        assert key in doc, key
    for key in REQUIRED_METRICS:
        assert key in doc["metrics"], key
    assert doc["gpu_experts"] == 96 and doc["cache_ratio"] == pytest.approx(0.375)
    assert doc["bound"] is False
    m = doc["metrics"]
    assert 0 <= m["hit_rate"] <= 1
    assert m["e2e_s"] >= m["tpot_mean_s"] * m["decode_tokens"] * (1 - 1e-9)
    for frac in ("gpu_busy_frac", "cpu_busy_frac", "h2d_busy_frac"):
        assert 0 <= m[frac] <= 1 + 1e-9, frac
    assert m["routing_replaced_frac"] == 0 and m["gate_mass_preserved"] == pytest.approx(1)


def test_bounds_beside_the_result(lru_json: dict) -> None:
    """The all-GPU and Belady bounds come with a run (same trace, machine, budget)."""
    doc = lru_json
    b = doc["bounds"]
    assert b["all-gpu"]["tokens_per_s"] >= doc["metrics"]["tokens_per_s"]
    assert b["belady"]["hit_rate"] >= doc["metrics"]["hit_rate"]
    code, out, _ = _run(
        "--policy", "lru", "--trace", "ci-small", "--sequences", "1", "--no-bounds", "--json"
    )
    assert code == 0 and "bounds" not in json.loads(out)


def test_readable_table_names_the_run() -> None:
    code, out, _ = _run("--policy", "static", "--trace", "ci-small", "--sequences", "1")
    assert code == 0
    assert "policy static on a6000-pcie4" in out
    assert "tokens/s" in out and "GPU hit rate" in out


def test_out_writes_metrics_timeline_perfetto_and_plots(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    code, _, err = _run(
        "--policy", "fiddler", "--trace", "ci-small", "--sequences", "1", "--out", str(out_dir)
    )
    assert code == 0, err
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == [
        "gantt.png",
        "hit_rate.png",
        "metrics.json",
        "timeline.parquet",
        "trace.perfetto.json.gz",
    ]
    metrics = json.loads((out_dir / "metrics.json").read_text())
    # what the result was made from
    assert metrics["daopsim_version"] and metrics["policy_options"] is not None
    assert len(metrics["trace_sha256"]) == 64 and len(metrics["profile_sha256"]) == 64
    timeline = pd.read_parquet(out_dir / "timeline.parquet")
    assert list(timeline.columns) == list(COLUMNS)
    assert metrics["metrics"]["cpu_expert_evals"] == int(
        (timeline["kind"].astype(str) == "cpu_expert").sum()
    )
    with gzip.open(out_dir / "trace.perfetto.json.gz") as fh:
        perfetto = json.load(fh)
    tracks = {e["args"]["name"] for e in perfetto["traceEvents"] if e.get("name") == "thread_name"}
    assert {"gpu", "h2d", "d2h"} <= tracks and any(t.startswith("cpu") for t in tracks)
    spans = [e for e in perfetto["traceEvents"] if e.get("ph") == "X"]
    assert len(spans) == len(timeline)
    assert any(e.get("ph") == "C" for e in perfetto["traceEvents"])  # slot-occupancy counter
    for png in ("gantt.png", "hit_rate.png"):
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_budget_is_what_fits_in_memory() -> None:
    """Mixtral on the A6000 lands near DAOP's 120 of 256 experts."""
    r = simulate(policy="lru", hw="a6000-pcie4", trace="ci-small", sequences=1, record=False)
    assert 115 <= r.config["gpu_experts"] <= 125
    assert r.config["gpu_experts"] == r.config["max_gpu_experts"]


def test_bounds_are_marked() -> None:
    assert simulate(policy="all-gpu", trace="ci-small", sequences=1, record=False).bound
    assert simulate(
        policy="belady", trace="ci-small", sequences=1, cache_ratio=0.25, record=False
    ).bound
    assert not simulate(policy="lru", trace="ci-small", sequences=1, record=False).bound


def test_all_gpu_places_every_expert_and_never_misses() -> None:
    r = simulate(policy="all-gpu", trace="ci-small", sequences=1, record=False)
    assert r.config["gpu_experts"] == r.config["total_experts"]
    assert r.metrics["hit_rate"] == 1 and r.metrics["h2d_bytes"] == 0


def test_python_api_timeline_and_exports(tmp_path: Path) -> None:
    r = simulate(policy="lru", trace="ci-small", sequences=1, cache_ratio=0.375)
    assert isinstance(r.timeline, pd.DataFrame) and len(r.timeline) > 0
    assert (r.timeline["end"] >= r.timeline["start"]).all()
    assert r.timeline["end"].max() <= r.metrics["e2e_s"] + 1e-9 or r.metrics["prefetches"] > 0
    path = r.to_perfetto(tmp_path / "t.json")
    assert json.loads(path.read_text())["traceEvents"]
    ax = r.plot_timeline()
    assert ax.get_title()


def test_held_out_calibration_is_disjoint_from_evaluation(tmp_path: Path) -> None:
    meta = read_meta(Path(__file__).parents[1] / "traces" / "ci-small.parquet")
    ids = list(range(meta.counts["sequences"]))
    evaluation, calib = split_sequences(meta, ids, None, False)
    assert calib == meta.calibration_sequences
    assert not set(evaluation) & set(calib)
    r = simulate(policy="static", trace="ci-small", record=False)
    assert r.config["sequences"] == len(evaluation)


def test_external_calibration_trace(tmp_path: Path) -> None:
    trace = make_trace(tmp_path / "eval.parquet", sequences=2, seed=1)
    calib = make_trace(tmp_path / "calib.parquet", sequences=2, seed=2)
    r = simulate(
        policy="static",
        hw="a6000-pcie4",
        trace=trace,
        calibration=calib,
        cache_ratio=0.5,
        record=False,
    )
    assert r.config["calibration"] == str(calib)
    assert r.config["sequences"] == 2  # nothing held out when calibration comes from elsewhere


def test_policy_needing_calibration_without_any_is_a_clear_error(tmp_path: Path) -> None:
    trace = make_trace(tmp_path / "one.parquet", sequences=1)
    code, _, err = _run("--policy", "static", "--trace", str(trace), "--cache-ratio", "0.5")
    assert code == 2
    assert err.startswith("error:") and "calibration" in err and "Traceback" not in err


def test_record_off_gives_the_same_metrics() -> None:
    a = simulate(policy="daop", trace="ci-small", sequences=1, record=True)
    b = simulate(policy="daop", trace="ci-small", sequences=1, record=False)
    assert a.to_json() == b.to_json()
    assert b.timeline is None
    assert all(math.isfinite(v) or math.isnan(v) for v in b.metrics.values())
