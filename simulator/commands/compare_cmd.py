"""``daopsim compare``: several policies (and machines) side by side on one trace."""

from __future__ import annotations

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.errors import UserError


def _names(value: str, flag: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise UserError(f"{flag}: no values given")
    return names


@click.command("compare", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--policies", required=True, help="Comma-separated policies (or PATH.py:CLASS) to compare."
)
@click.option(
    "--hw",
    default="a6000-pcie4",
    show_default=True,
    help="Machine profile(s), comma-separated: every policy runs on each.",
)
@click.option("--trace", default=None, help="Bundled trace name or path (default: Mixtral-8x7B).")
@click.option("--model", default=None, help="Without --trace: a catalogue model's synthetic trace.")
@click.option("--sequences", type=int, default=None, help="Evaluation sequences per run.")
@click.option("--cache-ratio", type=float, default=None, help="One budget for all, as a ratio.")
@click.option("--gpu-experts", type=int, default=None, help="One budget for all, in experts.")
@click.option("--dtype", default=None, help="GPU expert precision for all.")
@click.option("--runtime", default=None, help="One runtime for all (default: each policy's own).")
@click.option(
    "--policy-opt",
    "policy_opts",
    multiple=True,
    metavar="[POLICY.]KEY=VALUE",
    help="A policy option (repeatable); POLICY.KEY for one policy, KEY for every policy "
    "that has it.",
)
@click.option("--plot", "-o", "plot", default=None, metavar="FILE", help="Write the figure.")
@click.option("--workers", type=int, default=None, help="Worker processes (default: CPUs).")
@click.option("--no-progress", is_flag=True, help="Do not show a progress bar.")
@json_option
def compare(
    policies: str,
    hw: str,
    trace: str | None,
    model: str | None,
    sequences: int | None,
    cache_ratio: float | None,
    gpu_experts: int | None,
    dtype: str | None,
    runtime: str | None,
    policy_opts: tuple[str, ...],
    plot: str | None,
    workers: int | None,
    no_progress: bool,
    as_json: bool,
) -> None:
    """Run several policies (on one or more machines) over one trace: one side-by-side table
    (a column per configuration) and, with -o, one figure. Exit 1 when a run failed (its
    column says why); a budget a machine cannot hold is a skipped column, not a failure."""
    from daopsim.simulator.compare import compare as run_compare
    from daopsim.simulator.compare import render, write_figure
    from daopsim.simulator.errors import parse_key_values
    from daopsim.simulator.output import FIGURE_FORMATS, check_output_file, output_format
    from daopsim.simulator.progress import on_terminal

    if plot is not None:  # before any run: a bad output fails at once
        output_format(plot, FIGURE_FORMATS, "--plot")
        check_output_file(plot, "--plot", inputs=[t for t in (trace,) if t])
    opts = {k: [v] for k, v in parse_key_values(policy_opts, "--policy-opt").items()}
    result = run_compare(
        _names(policies, "--policies"),
        _names(hw, "--hw"),
        trace=trace,
        model=model,
        sequences=sequences,
        cache_ratio=cache_ratio,
        gpu_experts=gpu_experts,
        dtype=dtype,
        runtime=runtime,
        options=opts,
        workers=workers,
        progress=not no_progress and on_terminal(),
    )
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        write_figure(result, plot)
    if as_json:
        echo_json(result.to_dict())
    else:
        click.echo(render(result))
        if plot is not None:
            click.echo(f"wrote {plot}")
    if result.failed:  # as for a sweep: the command ran, and a configuration failed
        raise SystemExit(1)
