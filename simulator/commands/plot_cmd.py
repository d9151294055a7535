"""``daopsim plot``: draw a results table (a sweep's, or an experiment's results.parquet) as a
PNG, PDF or SVG (throughput, hit rate, breakdown, heatmap, Pareto front, latency vs load)."""

from __future__ import annotations

from pathlib import Path

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.output import FIGURE_FORMATS, check_output_file, output_format, write_figure


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("results")
@click.option(
    "--kind",
    type=click.Choice(["throughput", "hit-rate", "breakdown", "heatmap", "pareto", "latency-load"]),
    default="throughput",
    show_default=True,
)
@click.option(
    "-o",
    "--output",
    help="Figure to write: .png, .pdf or .svg, by suffix (default: RESULTS.<kind>.png beside "
    "the results).",
)
@click.option("--trace", help="Which trace of the table to draw (default: the first).")
@click.option("--hw", help="heatmap: one machine only.")
@click.option("--cache-ratio", type=float, help="breakdown: one cache ratio only.")
@click.option(
    "--no-compute-bound",
    is_flag=True,
    help="throughput: do not simulate the all-gpu line when the table has no all-gpu row.",
)
@click.option(
    "--min-gate-mass",
    type=float,
    default=None,
    help="Leave out rows whose routing fidelity (gate_mass_preserved) is below this.",
)
@json_option
def plot(
    results: str,
    kind: str,
    output: str | None,
    trace: str | None,
    hw: str | None,
    cache_ratio: float | None,
    no_compute_bound: bool,
    as_json: bool,
    min_gate_mass: float | None = None,
) -> None:
    """Plot a results table written by `daopsim sweep` or `daopsim experiment`."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from daopsim.simulator import plots
    from daopsim.simulator.sweep_table import fidelity_floor, read_table

    res = Path(results)
    target = Path(output) if output else res.with_name(f"{res.stem}.{kind}.png")
    output_format(target, FIGURE_FORMATS, "-o")
    check_output_file(target, "-o", inputs=[results])
    df, _ = fidelity_floor(read_table(results), min_gate_mass)
    kwargs: dict[str, object] = {"trace": trace}
    if kind == "heatmap":
        kwargs["hw"] = hw
    if kind == "breakdown":
        kwargs["cache_ratio"] = cache_ratio
    if kind == "throughput":
        kwargs["compute_bound"] = not no_compute_bound
    fig = plots.plot(df, kind, **kwargs)
    path = write_figure(fig, target, dpi=120, flag="-o")
    if as_json:
        echo_json({"kind": kind, "path": str(path), "bytes": path.stat().st_size})
    else:
        click.echo(f"wrote {path}")
