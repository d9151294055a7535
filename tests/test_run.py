"""`daopsim run` and `simulate()`: JSON keys, output files, budgets, calibration, bounds."""

from __future__ import annotations

import gzip
import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from daopsim.simulator.calibration import split_sequences
from daopsim.simulator.cli import main
from daopsim.simulator.data import resolve_trace
from daopsim.simulator.recorder import COLUMNS
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import make_trace
from daopsim.simulator.trace_read import read_meta

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


# -- how many experts fit ----------------------------------------------------------------------


def _small_gpu(tmp_path: Path, memory_gb: float) -> Path:
    """The bundled RTX 4090 profile with another memory size."""
    from daopsim.simulator.data import profiles_dir

    text = (profiles_dir() / "rtx4090-pcie4.toml").read_text()
    text = re.sub(r"(?m)^memory_gb\s*=\s*[^#\n]*", f"memory_gb = {memory_gb} ", text, count=1)
    path = tmp_path / f"gpu-{memory_gb}.toml"
    path.write_text(text)
    return path


def test_too_large_ratio_names_the_largest_that_fits() -> None:
    code, _out, err = _run(
        "--policy", "lru", "--hw", "rtx4090-pcie4", "--cache-ratio", "0.25", "--trace", "ci-small"
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    m = re.search(r"at most (\d+) experts fit \(--cache-ratio <= ([0-9.]+)\)", lines[0])
    assert m, lines[0]
    n, ratio = int(m.group(1)), float(m.group(2))
    # the named ratio is the largest 3-decimal one that runs, with exactly n experts
    r = simulate("lru", "rtx4090-pcie4", "ci-small", cache_ratio=ratio, sequences=1, record=False)
    assert r.config["gpu_experts"] == n == r.config["max_gpu_experts"]
    code, _, err = _run(
        "--policy", "lru", "--hw", "rtx4090-pcie4", "--trace", "ci-small",
        "--cache-ratio", f"{ratio + 0.001:.3f}",
    )  # fmt: skip
    assert code == 2 and "do not fit" in err


def test_cache_ratio_one_works_where_everything_fits(tmp_path: Path) -> None:
    # the tiny model's 32 experts and a buffer fit easily: all 32 resident, not 31
    trace = make_trace(tmp_path / "t.parquet", sequences=2, prefill=4, decode=4)
    r = simulate("lru", "a6000-pcie4", trace, cache_ratio=1.0, sequences=1, record=False)
    assert r.config["gpu_experts"] == r.config["total_experts"] == r.config["max_gpu_experts"]
    assert r.metrics["hit_rate"] == pytest.approx(1.0)
    # and the default budget is every expert too
    d = simulate("lru", "a6000-pcie4", trace, sequences=1, record=False)
    assert d.config["gpu_experts"] == d.config["total_experts"]


def test_gpu_without_room_for_non_expert_weights_is_an_error(tmp_path: Path) -> None:
    tiny_gpu = _small_gpu(tmp_path, 2.0)  # Mixtral's non-expert weights alone are ~3 GB
    for policy in ("lru", "stream-all", "daop"):
        code, _out, err = _run("--policy", policy, "--hw", str(tiny_gpu), "--trace", "ci-small")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (policy, err)
        assert "non-expert weights" in lines[0] and "GB short" in lines[0]
    # the all-GPU bound does not model memory at all
    r = simulate("all-gpu", tiny_gpu, "ci-small", sequences=1, record=False)
    assert r.config["gpu_experts"] == r.config["total_experts"]


def test_gpu_without_room_for_the_buffers_is_an_error(tmp_path: Path) -> None:
    from daopsim.simulator.costs import cost_model
    from daopsim.simulator.fit import expert_fit, trace_context
    from daopsim.simulator.hardware import load_profile

    # find a memory size that holds the non-expert weights and 1 expert slot but not 5 buffers
    meta = read_meta(resolve_trace("ci-small"))
    for gb in (4.0, 4.2, 4.4, 4.6, 4.8, 5.0):
        path = _small_gpu(tmp_path, gb)
        fit = expert_fit(cost_model(load_profile(path), meta.model), 0, trace_context(meta))
        if 1 <= fit.slots < 5:
            break
    else:
        pytest.skip("no memory size in range gives 1..4 slots")
    # mixtral-offloading needs 1 temporary and 4 staging buffers
    code, _, err = _run("--policy", "mixtral-offloading", "--hw", str(path), "--trace", "ci-small")
    assert code == 2 and "buffers" in err and "fewer than" in err


def test_profiles_show_and_run_agree_on_the_fit() -> None:
    meta = read_meta(resolve_trace("ci-small"))
    context = meta.counts["prefill_tokens"] // meta.counts["sequences"] + (
        meta.counts["decode_tokens"] // meta.counts["sequences"]
    )
    for policy, hw in (("lru", "a6000-pcie4"), ("mixtral-offloading", "rtx4090-pcie4")):
        res = CliRunner().invoke(
            main,
            ["profiles", "show", hw, "--policy", policy, "--context", str(context), "--json"],
        )
        assert res.exit_code == 0, res.output
        shown = json.loads(res.stdout)
        r = simulate(policy, hw, "ci-small", sequences=1, record=False)
        assert shown["gpu_expert_slots"] == r.config["max_gpu_experts"] == r.config["gpu_experts"]


@pytest.mark.parametrize("total", [7, 32, 256, 1024, 8192])
def test_max_ratio_is_the_largest_three_decimal_ratio_that_fits(total: int) -> None:
    from daopsim.simulator.fit import ExpertFit

    for fit in range(0, total + 1, max(1, total // 50)):
        f = ExpertFit("m", total, expert_bytes=100, free_bytes=fit * 100.0, buffers=0,
                      context_tokens=0)  # fmt: skip
        r = f.max_ratio()
        assert f.max_experts == fit
        assert r == 0 or round(r * total) <= fit  # it fits ...
        nxt = round(r + 0.001, 3)
        assert nxt > 1 or round(nxt * total) > fit  # ... and the next one does not
