"""Sweep plots: every kind renders to a PNG (API and CLI), bounds and Pareto front are right."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from simulator.errors import UserError
from simulator.plots import (
    KINDS,
    breakdown_table,
    pareto_front,
    plot,
    plot_throughput,
    save_figure,
)
from simulator.sweep import Grid, fidelity_floor, sweep
from simulator.testing import make_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small sweep table: 3 policies (one a bound) on 2 machines at 2 cache ratios."""
    folder = tmp_path_factory.mktemp("plots")
    trace = make_trace(folder / "tiny.parquet", sequences=3, prefill=6, decode=10, seed=5)
    out = folder / "r.parquet"
    sweep(
        Grid(
            policies=["lru", "static", "all-gpu"],
            hw=["a6000-pcie4", "rtx4090-pcie4"],
            traces=[str(trace)],
            cache_ratios=[0.25, 0.5],
            sequences=2,
        ),
        workers=1,
        out=out,
        progress=False,
    )
    return out


@pytest.fixture(scope="module")
def serving_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small serving sweep (an arrival-rate axis) for the latency-load plot."""
    folder = tmp_path_factory.mktemp("serving-plots")
    trace = make_trace(folder / "tiny.parquet", sequences=3, prefill=6, decode=10, seed=5)
    out = folder / "s.parquet"
    sweep(
        Grid(policies=["lru", "static"], traces=[str(trace)], arrival_rates=[10.0, 1000.0]),
        workers=1,
        out=out,
        progress=False,
    )
    return out


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    # IHDR: width and height, big-endian, right after the 8-byte magic and 8-byte chunk header
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_renders(
    results: Path, serving_results: Path, tmp_path: Path, kind: str
) -> None:
    target = tmp_path / f"{kind}.png"
    table = serving_results if kind == "latency-load" else results
    save_figure(plot(pd.read_parquet(table), kind), target)
    w, h = _png_size(target)
    assert 400 <= w <= 4000 and 250 <= h <= 3000
    assert 10_000 < target.stat().st_size < 2_000_000
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_cli_plot(results: Path, tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    target = tmp_path / "t.png"
    res = cli("plot", results, "--kind", "pareto", "-o", target, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["path"] == str(target)
    _png_size(target)
    res = cli("plot", results, "--kind", "heatmap")  # default output beside the results
    assert res.exit_code == 0, res.output
    _png_size(results.with_name("r.heatmap.png"))
    res = cli("plot", tmp_path / "missing.parquet")
    assert res.exit_code == 2 and "no such results file" in res.stderr
    res = cli("plot", results, "--trace", "nope")
    assert res.exit_code == 2 and "not in the results" in res.stderr
    res = cli("plot", results, "--kind", "bogus")
    assert res.exit_code == 2


def test_throughput_bound_line_from_table_or_computed(results: Path) -> None:
    df = pd.read_parquet(results)
    expected = df[(df["policy"] == "all-gpu") & (df["hw"] == "a6000-pcie4")]["tokens_per_s"]

    def bound_line(fig: object) -> float:
        ax = fig.axes[0]  # type: ignore[attr-defined]
        line = next(ln for ln in ax.get_lines() if ln.get_label() == "all-gpu (bound)")
        return float(line.get_ydata()[0])

    assert bound_line(plot_throughput(df)) == pytest.approx(float(expected.iloc[0]))
    # without the all-gpu rows it is simulated on the fly, to the same value
    no_bound = df[df["policy"] != "all-gpu"]
    assert bound_line(plot_throughput(no_bound)) == pytest.approx(float(expected.iloc[0]))
    fig = plot_throughput(no_bound, compute_bound=False)
    assert not [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "all-gpu (bound)"]


def test_pareto_front_and_breakdown_numbers() -> None:
    df = pd.DataFrame(
        {
            "expert_memory_gb": [1.0, 2.0, 2.0, 3.0, 4.0],
            "tokens_per_s": [5.0, 4.0, 7.0, 6.0, 9.0],
        }
    )
    front = pareto_front(df)
    assert list(front.index) == [0, 2, 4]
    row = pd.DataFrame(
        {
            "gpu_expert_s": [1.0],
            "gpu_nonexpert_s": [0.5],
            "cpu_wait_s": [0.25],
            "transfer_stall_s": [2.0],
            "e2e_s": [4.0],
            "decode_tokens": [10],
        }
    )
    parts = breakdown_table(row).iloc[0]
    assert parts["GPU compute"] == pytest.approx(150.0)  # ms per generated token
    assert parts["other"] == pytest.approx(25.0)
    assert math.isclose(parts.sum(), 400.0)


def test_errors_only_table_is_a_clear_error(results: Path) -> None:
    df = pd.read_parquet(results)
    df["status"] = "error"
    with pytest.raises(UserError, match="no successful runs"):
        plot(df, "throughput")
    with pytest.raises(UserError, match="unknown plot kind"):
        plot(df, "pie")


def _line_colors(fig: object) -> dict[str, str]:
    from matplotlib.colors import to_hex

    return {
        str(ln.get_label()): to_hex(ln.get_color())
        for ax in fig.axes  # type: ignore[attr-defined]
        for ln in ax.get_lines()
        if not str(ln.get_label()).startswith("_")
    }


def test_a_policy_has_one_colour_in_every_plot(results: Path) -> None:
    from simulator.plots import POLICY_COLORS, policy_color

    df = pd.read_parquet(results)
    thr = _line_colors(plot(df, "throughput"))
    hit = _line_colors(plot(df, "hit-rate"))
    only_lru = _line_colors(plot(df[df["policy"].isin(["lru", "all-gpu"])], "throughput"))
    for colors in (thr, hit, only_lru):
        assert colors["lru"] == POLICY_COLORS["lru"]
    assert thr["static"] == hit["static"] == POLICY_COLORS["static"]
    assert len(set(POLICY_COLORS[p] for p in POLICY_COLORS if p not in ("all-gpu", "belady"))) == 8
    # a plugin policy gets the same colour every time, from its name alone
    assert policy_color("my-plugin") == policy_color("my-plugin")


@pytest.mark.parametrize("kind", KINDS)
def test_titles_fit_in_the_figure(results: Path, serving_results: Path, kind: str) -> None:
    df = pd.read_parquet(serving_results if kind == "latency-load" else results)
    long_name = "a-rather-long-trace-name-that-used-to-push-the-title-off-the-figure.parquet"
    df["trace"] = "/some/deep/folder/" + long_name
    fig = plot(df, kind)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    texts = [fig._suptitle] if fig._suptitle is not None else []
    texts += [ax.title for ax in fig.axes]
    for t in texts:
        if not t.get_text():
            continue
        ext = t.get_window_extent(renderer)
        assert ext.x0 >= box.x0 - 1 and ext.x1 <= box.x1 + 1, (kind, t.get_text())
        assert ext.y1 <= box.y1 + 1, (kind, t.get_text())


def test_all_gpu_far_above_is_a_note_not_a_squashing_line(results: Path) -> None:
    df = pd.read_parquet(results)
    df.loc[df["policy"] == "all-gpu", "tokens_per_s"] *= 50
    fig = plot_throughput(df)
    ax = fig.axes[0]
    assert not [ln for ln in ax.get_lines() if ln.get_label() == "all-gpu (bound)"]
    notes = [t.get_text() for t in ax.texts]
    assert any("all-gpu bound" in n for n in notes)
    best = df[(df["policy"] != "all-gpu") & (df["hw"] == "a6000-pcie4")]["tokens_per_s"].max()
    assert ax.get_ylim()[1] < 2 * best  # the policies use the height of the panel


def test_plot_reads_an_experiment_table(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    trace = make_trace(tmp_path / "t.parquet", sequences=3, prefill=6, decode=10, seed=5)
    exp = tmp_path / "e.toml"
    exp.write_text(
        'name = "tiny"\nhw = "a6000-pcie4"\ncache_ratios = [0.25, 0.5]\ntarget = "lru"\n'
        f'[policies.lru]\n[policies.static]\n[[models]]\ntrace = "{trace}"\n'
    )
    out = tmp_path / "exp"
    res = cli("experiment", exp, "--out", out)
    assert res.exit_code == 0, res.output
    for kind in ("throughput", "hit-rate"):
        res = cli("plot", out / "results.parquet", "--kind", kind, "--no-compute-bound")
        assert res.exit_code == 0, res.output
        _png_size(out / f"results.{kind}.png")
    res = cli("plot", out / "results.parquet", "--kind", "breakdown")
    assert res.exit_code == 2 and "needs column" in res.stderr
    # the default figures beside the results do not block the next experiment run
    res = cli("experiment", exp, "--out", out)
    assert res.exit_code == 0, res.output
    assert not (out / "results.throughput.png").exists()


def test_approximate_routing_is_marked(results: Path, cli: Any, tmp_path: Path) -> None:
    """A run whose routing kept less than all the gate mass names its fidelity beside its speed,
    and ``--min-gate-mass`` leaves it out of the plot."""
    import matplotlib

    matplotlib.use("Agg")
    from simulator import plots
    from simulator.sweep import read_table

    df = read_table(results)
    df.loc[df["policy"] == "static", "gate_mass_preserved"] = 0.9
    for fig in (plots.plot_throughput(df, compute_bound=False), plots.plot_pareto(df)):
        labels = [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()]
        assert any("static" in t and "fidelity 0.900" in t for t in labels)
        assert not any("lru" in t and "fidelity" in t for t in labels)
    table = tmp_path / "approx.parquet"
    df.to_parquet(table)
    out = tmp_path / "p.png"
    res = cli("plot", table, "--kind", "pareto", "-o", out, "--min-gate-mass", "0.95")
    assert res.exit_code == 0, res.output
    kept, dropped = fidelity_floor(df, 0.95)
    assert dropped == int(((df["policy"] == "static") & (df["status"] == "ok")).sum()) > 0
    assert "static" not in set(kept[kept["status"] == "ok"]["policy"])
