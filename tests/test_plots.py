"""Sweep plots: every kind renders to a PNG (API and CLI), bounds and Pareto front are right."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from daopsim.simulator.errors import UserError
from daopsim.simulator.plots import breakdown_table, plot, plot_throughput, save_figure
from daopsim.simulator.plots_common import KINDS
from daopsim.simulator.plots_pareto import pareto_front
from daopsim.simulator.sweep import Grid, fidelity_floor, sweep
from daopsim.simulator.testing import make_trace

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


def _bound_line(fig: object) -> Any:
    ax = fig.axes[0]  # type: ignore[attr-defined]
    lines = [ln for ln in ax.get_lines() if "bound" in str(ln.get_label()).lower()]
    lines = [ln for ln in lines if "all-gpu" in str(ln.get_label()).lower()]
    return lines[0] if lines else None


def _drawn_bound(fig: Any) -> tuple[float, str] | None:
    """The all-GPU bound a throughput figure shows: its dotted line, or its note (far above)."""
    import re

    line = _bound_line(fig)
    if line is not None:
        return float(line.get_ydata()[0]), str(line.get_label())
    for t in _texts(fig):
        m = re.search(r"(all-GPU bound \(runtime [^)]+\)): ([\d,.]+) tokens/s", t)
        if m:
            return float(m.group(2).replace(",", "")), m.group(1)
    return None


def test_throughput_bound_is_the_rows_bound(results: Path) -> None:
    """The bound drawn is the largest all-GPU bound of the panel's rows (their precision, the
    fastest runtime), it names its runtime and no run is above it; a table without the bound
    column (an older sweep) gets the same bound computed from its rows."""
    df = pd.read_parquet(results)
    mine = df[(df["hw"] == "a6000-pcie4") & (df["status"] == "ok")]
    expected = float(mine["bound_tokens_per_s"].max())
    runtime = mine.loc[mine["bound_tokens_per_s"].idxmax(), "bound_runtime"]
    assert (mine["tokens_per_s"] <= mine["bound_tokens_per_s"]).all()
    old = df.drop(columns=["bound_tokens_per_s", "bound_runtime"])
    for table in (df, old):
        got = _drawn_bound(plot_throughput(table))
        assert got is not None and got[0] == pytest.approx(expected, rel=1e-3)
        assert f"runtime {runtime}" in got[1]
    # near the runs: a dotted line under them
    near = df.copy()
    near["bound_tokens_per_s"] = near["tokens_per_s"].max() * 1.2
    line = _bound_line(plot_throughput(near))
    assert line is not None and line.get_linestyle() == ":"
    assert float(line.get_ydata()[0]) == pytest.approx(near["bound_tokens_per_s"].iloc[0])
    # not computed: the table's all-gpu run, labelled as one run on one runtime, not a bound
    fig = plot_throughput(old, compute_bound=False)
    labels = [str(ln.get_label()) for ln in fig.axes[0].get_lines()]
    assert _drawn_bound(fig) is None
    assert any(lab.startswith("all-gpu run (runtime") for lab in labels) or any(
        "all-gpu run (runtime" in t for t in _texts(fig)
    )


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


def test_errors_only_table_says_what_failed(results: Path) -> None:
    df = pd.read_parquet(results)
    df["status"] = "error"
    df["error"] = "PolicyError: boom"
    # no figure of empty panels: one line saying what the rows are and why the first failed
    with pytest.raises(UserError, match="nothing to draw") as err:
        plot(df, "throughput")
    assert "error" in str(err.value) and "PolicyError: boom" in str(err.value)
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
    from daopsim.simulator.colors import POLICY_COLORS, policy_color

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
    df["bound_tokens_per_s"] *= 50
    fig = plot_throughput(df)
    ax = fig.axes[0]
    assert _bound_line(fig) is None
    assert any("all-GPU bound" in t and "off the scale" in t for t in _texts(fig))
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
    from daopsim.simulator import plots
    from daopsim.simulator.sweep_table import read_table

    df = read_table(results)
    df.loc[df["policy"] == "static", "gate_mass_preserved"] = 0.9
    for fig in (plots.plot_throughput(df, compute_bound=False), plots.plot_pareto(df)):
        labels = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
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


# --- awkward sweeps: what each figure says, read from the matplotlib objects ------------------


def _texts(fig: Any) -> list[str]:
    """Every piece of text a figure shows: titles, labels, notes, legend entries."""
    out = [fig._suptitle.get_text()] if fig._suptitle is not None else []
    out += [t.get_text() for t in fig.texts]
    out += [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    for ax in fig.axes:
        out += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        out += [t.get_text() for t in ax.texts]
        if ax.get_legend() is not None:
            out += [t.get_text() for t in ax.get_legend().get_texts()]
    return [t for t in out if t]


def _visible_texts(fig: Any) -> list[Any]:
    arts: list[Any] = [fig._suptitle] if fig._suptitle is not None else []
    arts += list(fig.texts) + list(fig.legends)
    for ax in fig.axes:
        arts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        lo, hi = sorted(ax.get_xlim())
        arts += [
            t for t in ax.get_xticklabels() if t.get_text() and lo <= t.get_position()[0] <= hi
        ]
        lo, hi = sorted(ax.get_ylim())
        arts += [
            t for t in ax.get_yticklabels() if t.get_text() and lo <= t.get_position()[1] <= hi
        ]
    return [a for a in arts if a.get_visible() and (not hasattr(a, "get_text") or a.get_text())]


def _data_axes(fig: Any) -> list[Any]:
    """The panels that draw data (not colour bars, not explained-empty panels)."""
    return [
        ax
        for ax in fig.axes
        if ax.get_lines() or ax.collections or ax.patches or ax.images
        if ax.get_label() != "<colorbar>"
    ]


def check_figure(fig: Any, rows: pd.DataFrame, kind: str) -> None:
    """What every figure must show (issue 29): inside the figure, legends off the data, units,
    the rows not drawn named, empty panels explained, bounds under the policies."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    box = fig.bbox
    for art in _visible_texts(fig):  # nothing cut off at the edges
        ext = art.get_window_extent(r)
        assert box.x0 - 2 <= ext.x0 and ext.x1 <= box.x1 + 2, (
            kind,
            getattr(art, "get_text", str)(),
        )
        assert box.y0 - 2 <= ext.y0 and ext.y1 <= box.y1 + 2, (
            kind,
            getattr(art, "get_text", str)(),
        )
    data_axes = _data_axes(fig)
    for leg in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]:
        lb = leg.get_window_extent(r)
        for ax in data_axes:  # a legend never sits on a panel
            assert not lb.overlaps(ax.get_window_extent(r)), kind
    text = " ".join(_texts(fig))
    for _, row in rows[rows["status"] != "ok"].iterrows():  # every point not drawn is named
        if kind in ("heatmap", "hit-rate", "pareto") and row["policy"] == "all-gpu":
            continue
        assert str(row["policy"]) in text and row["status"] in ("skipped", "error"), kind
        assert ("skipped" if row["status"] == "skipped" else "failed") in text, kind
    for ax in fig.axes:
        if ax.get_label() == "<colorbar>":
            assert "(" in ax.get_ylabel(), kind  # the colour bar has its unit
            continue
        if ax in data_axes:
            assert "(" in ax.get_xlabel(), (kind, ax.get_xlabel())  # a unit or a meaning
            if kind != "heatmap":
                assert "(" in ax.get_ylabel(), (kind, ax.get_ylabel())
        else:  # an empty panel says why
            assert any("nothing to draw" in t.get_text() for t in ax.texts), kind
    for ax in data_axes:
        lines = [ln for ln in ax.get_lines() if not str(ln.get_label()).startswith("_")]
        bounds = [ln for ln in lines if "bound" in str(ln.get_label())]
        others = [ln for ln in lines if "bound" not in str(ln.get_label())]
        for b in bounds:  # a policy on a bound is drawn over it
            assert all(b.get_zorder() < o.get_zorder() for o in others), kind


def _single_point_axes_read(fig: Any) -> None:
    """A single point does not sit on an axis a few thousandths wide, and y starts at 0."""
    for ax in _data_axes(fig):
        xs = [x for ln in ax.get_lines() for x in ln.get_xdata() if str(ln.get_label())[0] != "_"]
        if xs and len(set(xs)) == 1:
            lo, hi = ax.get_xlim()
            assert hi - lo >= 0.5 * abs(xs[0]) and lo <= xs[0] <= hi
        assert ax.get_ylim()[0] == 0


#: awkward sweeps on a small Mixtral-shaped trace: the RTX 4090 holds about a fifth of the
#: experts, so larger points are "skipped" rows
AWKWARD = {
    "one point": {"policies": ["lru"], "hw": ["a6000-pcie4"], "cache_ratios": [0.125]},
    "all skipped": {"policies": ["lru", "static"], "hw": ["rtx4090-pcie4"], "cache_ratios": [0.6]},
    "one policy": {
        "policies": ["lru"],
        "hw": ["a6000-pcie4", "rtx4090-pcie4"],
        "cache_ratios": [0.1, 0.6],
    },
    "many policies": {
        "policies": [
            "lru",
            "lfu",
            "static",
            "fiddler",
            "daop",
            "belady",
            "round-robin",
            "stream-all",
            "all-gpu",
        ],
        "hw": ["a6000-pcie4"],
        "cache_ratios": [0.125, 0.6],
    },
}


@pytest.fixture(scope="module")
def awkward(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pd.DataFrame]:
    """The awkward sweeps' tables (a failed row added to the many-policies one)."""
    folder = tmp_path_factory.mktemp("awkward")
    trace = make_trace(
        folder / "mix.parquet", model="mixtral-8x7b", sequences=2, prefill=4, decode=6, seed=3
    )
    out = {}
    for name, grid in AWKWARD.items():
        out[name] = sweep(
            {**grid, "traces": [str(trace)], "sequences": 1}, workers=1, progress=False
        )
    many = out["many policies"]
    failed = many.iloc[[0]].copy()
    failed[["status", "error", "cache_ratio", "policy"]] = ["error", "PolicyError: x", 0.25, "lfu"]
    out["many policies"] = pd.concat([many, failed], ignore_index=True)
    return out


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "latency-load"])
@pytest.mark.parametrize("sweep_name", list(AWKWARD))
def test_awkward_sweeps_render_and_say_what_happened(
    awkward: dict[str, pd.DataFrame], sweep_name: str, kind: str
) -> None:
    import matplotlib.pyplot as plt

    table = awkward[sweep_name]
    if sweep_name == "all skipped":  # nothing to draw: one line with the reason, no figure
        with pytest.raises(UserError, match="does not fit"):
            plot(table, kind)
        return
    fig = plot(table, kind)
    try:
        check_figure(fig, table, kind)
        if kind in ("throughput", "hit-rate") and sweep_name == "one point":
            _single_point_axes_read(fig)
    finally:
        plt.close(fig)


def test_pareto_labels_do_not_overlap_and_stay_inside(awkward: dict[str, pd.DataFrame]) -> None:
    import matplotlib.pyplot as plt

    from daopsim.simulator.plots_common import realisable
    from daopsim.simulator.plots_pareto import pareto_front

    # many near points: the front of the many-policies sweep, stretched to crowd the labels
    table = awkward["many policies"]
    fig = plot(table, "pareto")
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    ax = fig.axes[0]
    numbers = [t for t in ax.texts if t.get_text().isdigit()]
    assert len(numbers) == len(pareto_front(realisable(table)))
    boxes = [t.get_window_extent(r) for t in numbers]
    for i, b in enumerate(boxes):
        assert ax.bbox.contains(b.x0, b.y0) and ax.bbox.contains(b.x1, b.y1)
        assert not any(b.overlaps(o) for o in boxes[i + 1 :])
    note = " ".join(_texts(fig))
    assert all(f"{n.get_text()} = " in note for n in numbers)  # each number explained
    plt.close(fig)


def test_experiment_figure_log_ticks_read_as_numbers(tmp_path: Path) -> None:
    """The experiment plot's log axis reads 0.5, 1, 2 (not 5x10^-1), and skipped points are
    named."""
    from daopsim.simulator.experiments import run_experiment

    trace = make_trace(
        tmp_path / "t.parquet", model="mixtral-8x7b", sequences=2, prefill=4, decode=6, seed=1
    )
    exp = tmp_path / "e.toml"
    exp.write_text(
        'name = "tiny"\nhw = "rtx4090-pcie4"\ncache_ratios = [0.1, 0.6]\ntarget = "lru"\n'
        f'[policies.lru]\n[policies.static]\n[[models]]\ntrace = "{trace}"\n'
    )
    fig = run_experiment(exp, sequences=1).figure()
    fig.canvas.draw()
    ticks = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels() if t.get_text()]
    assert ticks and not any("times" in t or "^" in t for t in ticks), ticks
    assert all(float(t.replace("\N{MINUS SIGN}", "-")) > 0 for t in ticks)
    assert "skipped: lru @ 0.6" in " ".join(_texts(fig))
