"""``daopsim sweep``: run a grid of simulations (from flags or a TOML grid file) into one table.

Exit codes (docs/cli.md): 0 when every configuration ran or was skipped because its memory
budget does not fit the machine (a row with status "skipped"), 1 when any failed (a row with
status "error"), 2 for bad arguments (unknown policy, machine, trace or option; a locked results
file), 3 when the results file cannot be written (an input, a device, a read-only or full disk).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.errors import ExitCode, UserError
from daopsim.simulator.output import check_output_file


def _split(text: str | None, kind: type, flag: str) -> list[Any] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UserError(f"{flag}: no values given")
    try:
        values = [kind(t) for t in items]
    except ValueError:
        bad = next(t for t in items if not _parses(kind, t))
        raise UserError(f"{flag}: {bad!r} is not a valid {kind.__name__}") from None
    for i, v in enumerate(values):
        if v in values[:i]:  # as compare and advise refuse one: never merged or run twice
            raise UserError(f"{flag}: {items[i]!r} given twice")
    return values


def _parses(kind: type, text: str) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


def grid_option(p: Any) -> Callable[[Any], Any]:
    """``daopsim sweep``'s flag for one declared grid key (simulator/run_params.py): an axis
    takes comma-separated values, a one-value key its type; none given leaves the grid file's
    value (or the default)."""
    if p.axis:
        return click.option(
            str(p.sweep_flag), str(p.grid_attr), help=f"{p.doc} An axis: comma-separated values."
        )
    kind = click.Choice(list(p.choices)) if p.choices is not None else p.kind
    return click.option(
        str(p.sweep_flag), str(p.grid_attr), type=kind, default=None, metavar=p.metavar,
        help=p.doc,
    )  # fmt: skip


#: ``daopsim sweep``'s own options: the grid file's policy options, the results table, where
#: and how the runs go
COMMAND_OPTIONS: tuple[Callable[[Any], Any], ...] = (
    click.option(
        "--policy-opt", "policy_opts", multiple=True, metavar="[POLICY.]KEY=V[,V...]",
        help="A policy option; several values make an axis. Repeatable.",
    ),
    click.option(
        "--out", "-o", "out",
        help="Results table: .parquet, or .csv (the format follows the suffix).",
    ),
    click.option(
        "--executor", type=click.Choice(["local", "dask"]), default="local", show_default=True
    ),
    click.option("--workers", type=int, help="Worker processes (default: number of CPUs)."),
    click.option("--scheduler", metavar="ADDRESS", help="Dask scheduler (tcp://host:8786)."),
    click.option(
        "--min-gate-mass", type=float, default=None,
        help="Leave out rows whose routing fidelity (gate_mass_preserved) is below this.",
    ),
    click.option("--retry-errors", is_flag=True, help="Re-run configurations that failed before."),
    click.option("--no-progress", is_flag=True, help="No progress bar."),
    click.option(
        "--bounds/--no-bounds", default=True, show_default=True,
        help="Fill each row's all-GPU bound (bound_tokens_per_s; a few all-GPU runs per "
        "machine, trace and precision).",
    ),
    json_option,
)  # fmt: skip


def build_sweep_command() -> click.Command:
    """``daopsim sweep``: GRID_FILE, a flag per declared grid key, then its own options (built
    when called, from the declaration as it stands)."""
    from daopsim.simulator.run_params import grid_params

    func: Any = _sweep
    for opt in reversed([*(grid_option(p) for p in grid_params()), *COMMAND_OPTIONS]):
        func = opt(func)
    func = click.argument("grid_file", required=False, type=click.Path(dir_okay=False))(func)
    return click.command("sweep", context_settings={"help_option_names": ["-h", "--help"]})(func)


def _sweep(grid_file: str | None, **given: Any) -> None:
    """Run every combination of policies, machines, traces and memory budgets.

    Give the grid with flags, or as GRID_FILE (TOML, see docs/sweeps.md; or the name of a
    bundled grid, such as example-grid); flags override the file's keys. Finished
    configurations are kept in OUT.parts/, so an interrupted sweep resumes where it stopped
    when run again.
    """
    from daopsim.simulator.grid import parse_option_items
    from daopsim.simulator.sweep import run_sweep

    grid, file_out = _grid_of(grid_file, given)
    if given["policy_opts"]:
        grid.options.update(parse_option_items(given["policy_opts"]))
    out = given["out"] or file_out
    if out is None:
        raise UserError("give --out RESULTS.parquet (or 'out' in the grid file)")
    check_output_file(out, "--out", inputs=[grid_file])
    try:
        table, summary = run_sweep(
            grid,
            executor=given["executor"],
            workers=given["workers"],
            out=out,
            progress=not given["no_progress"],
            scheduler=given["scheduler"],
            retry_errors=given["retry_errors"],
            min_gate_mass=given["min_gate_mass"],
            bounds=given["bounds"],
        )
    except KeyboardInterrupt:
        click.echo("interrupted: finished runs are kept; run the same command to resume", err=True)
        sys.exit(ExitCode.INTERRUPTED)
    if given["as_json"]:
        echo_json(summary.to_dict())
    else:
        _print_summary(summary, table, grid, given["min_gate_mass"])
    sys.exit(ExitCode.FAILED if summary.failed else ExitCode.OK)


def _grid_of(grid_file: str | None, given: dict[str, Any]) -> tuple[Any, str | None]:
    """The grid of the file (or of the flags alone), with each grid flag given replacing the
    file's key; and the file's ``out``."""
    from daopsim.simulator.grid import Grid, load_grid_file
    from daopsim.simulator.run_params import grid_params

    flags: dict[str, Any] = {}
    for p in grid_params():
        attr = str(p.grid_attr)
        value = given[attr]
        if p.axis:
            value = _split(value, p.kind or str, str(p.sweep_flag))
        if value is not None:
            flags[attr] = p.checked(value, str(p.sweep_flag)) if not p.axis else value
    if grid_file is not None:
        grid, file_out = load_grid_file(grid_file)
    else:
        if "policies" not in flags:
            raise UserError("give --policies (or a grid file)")
        grid, file_out = Grid(policies=flags["policies"]), None
    for key, value in flags.items():
        setattr(grid, key, value)
    if grid_file is not None and "policies" in flags:
        # --policies replaces the file's: its options for the policies left out go too
        kept = set(grid.policies)
        grid.options = {
            k: v for k, v in grid.options.items() if "." not in k or k.rpartition(".")[0] in kept
        }
    return grid, file_out


def _print_summary(summary: Any, table: Any, grid: Any, min_gate_mass: float | None) -> None:
    """The sweep's one-line summary, the seed table, a small-budget note and each failure."""
    from daopsim.simulator.sweep_table import small_budget_note

    click.echo(
        f"wrote {summary.out}: {summary.configurations} configurations, {summary.ok} ok, "
        f"{summary.skipped} skipped (do not fit), {summary.failed} failed "
        f"({summary.resumed} resumed) in {summary.elapsed_s:.1f} s"
        + (
            f"; {summary.below_floor} below --min-gate-mass {min_gate_mass} left out"
            if summary.below_floor
            else ""
        )
    )
    if len(set(grid.seeds)) > 1:
        _print_seed_table(summary.out)
    note = small_budget_note(table)
    if note:
        click.echo(f"note: {note}")
    for e in summary.errors:
        if e.get("cache_ratio") is not None:
            mem = f"cache ratio {e['cache_ratio']}"
        elif e.get("gpu_experts") is not None:
            mem = f"{e['gpu_experts']} GPU experts"
        else:
            mem = "experts that fit"
        click.echo(
            f"failed: {e['policy']} on {e['hw']} ({e['trace']}, {mem}): {e['error']}", err=True
        )


sweep = build_sweep_command()


def _print_seed_table(out: object) -> None:
    """Mean +- standard deviation over seeds of each configuration (the seeds axis)."""
    from daopsim.simulator.sweep_table import read_table, seed_summary

    table = seed_summary(read_table(out))  # type: ignore[arg-type]
    if table.empty:
        return
    click.echo("mean +- std over seeds:")
    for row in table.to_dict("records"):
        mem = row.get("cache_ratio")
        cells = [f"{row['policy']} on {row['hw']} ({row['trace']}), cache ratio {mem}"]
        for m in ("tokens_per_s", "hit_rate"):
            if f"{m}_mean" in row:
                cells.append(f"{m} {row[f'{m}_mean']:.4g} +- {row[f'{m}_std']:.2g}")
        cells.append(f"{row['seeds']} seeds")
        click.echo("  " + ", ".join(cells))
