"""``daopsim sweep``: run a grid of simulations (from flags or a TOML grid file) into one table.

Exit codes (docs/cli.md): 0 when every configuration ran or was skipped because its memory
budget does not fit the machine (a row with status "skipped"), 1 when any failed (a row with
status "error"), 2 for bad arguments (unknown policy, machine, trace or option; a locked results
file), 3 when the results file cannot be written (an input, a device, a read-only or full disk).
"""

from __future__ import annotations

import sys
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


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("grid_file", required=False, type=click.Path(dir_okay=False))
@click.option("--policies", help="Comma-separated policy names (e.g. lru,fiddler,daop).")
@click.option("--hw", help="Comma-separated machine profiles (default a6000-pcie4).")
@click.option("--traces", help="Comma-separated bundled trace names or paths.")
@click.option("--cache-ratios", help="Comma-separated cache ratios in (0, 1].")
@click.option("--gpu-experts", help="Comma-separated resident-expert counts.")
@click.option("--sequences", type=int, help="Evaluation sequences per run (default: all).")
@click.option(
    "--policy-opt",
    "policy_opts",
    multiple=True,
    metavar="[POLICY.]KEY=V[,V...]",
    help="A policy option; several values make an axis. Repeatable.",
)
@click.option("--seeds", help="Comma-separated seeds (default 0).")
@click.option(
    "--runtimes",
    help="Comma-separated runtime profiles, an axis (default: each policy's declared one).",
)
@click.option(
    "--calibration",
    metavar="none|self|PATH",
    help="Calibration data for every run, as for `daopsim run` (default: held-out sequences).",
)
@click.option("--dtype", help="Override the GPU expert precision of every trace.")
@click.option("--host-dtype", help="Precision of the host's expert copies (default: --dtype).")
@click.option("--nonexpert-dtype", help="Precision of the non-expert weights (default: bf16).")
@click.option(
    "--lookahead",
    type=click.Choice(["recorded", "previous-token"]),
    default=None,
    help="One-layer-early view for policies that read it, as for `daopsim run`.",
)
@click.option(
    "--out", "-o", "out", help="Results table: .parquet, or .csv (the format follows the suffix)."
)
@click.option(
    "--executor", type=click.Choice(["local", "dask"]), default="local", show_default=True
)
@click.option("--workers", type=int, help="Worker processes (default: number of CPUs).")
@click.option("--scheduler", metavar="ADDRESS", help="Dask scheduler (tcp://host:8786).")
@click.option(
    "--min-gate-mass",
    type=float,
    default=None,
    help="Leave out rows whose routing fidelity (gate_mass_preserved) is below this.",
)
@click.option(
    "--arrival-rates",
    help="Comma-separated Poisson arrival rates (requests/s): a serving axis, continuous "
    "batching (docs/serving.md).",
)
@click.option("--max-batch", type=int, help="Serving axis: most requests per batch (default 8).")
@click.option("--slo-ttft", type=float, help="Serving axis: time-to-first-token SLO (s).")
@click.option("--slo-tpot", type=float, help="Serving axis: time-per-output-token SLO (s).")
@click.option("--retry-errors", is_flag=True, help="Re-run configurations that failed before.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option(
    "--gpus",
    "gpus",
    help="Comma-separated GPU counts, an axis (a multi-GPU profile; default: 1).",
)
@click.option(
    "--multi-gpu",
    "multi_gpu",
    help="Comma-separated placements for the counts above 1: expert, pipeline (default: expert).",
)
@click.option(
    "--bounds/--no-bounds",
    default=True,
    show_default=True,
    help="Fill each row's all-GPU bound (bound_tokens_per_s; a few all-GPU runs per machine, "
    "trace and precision).",
)
@json_option
def sweep(
    grid_file: str | None,
    policies: str | None,
    hw: str | None,
    traces: str | None,
    cache_ratios: str | None,
    gpu_experts: str | None,
    sequences: int | None,
    policy_opts: tuple[str, ...],
    seeds: str | None,
    calibration: str | None,
    dtype: str | None,
    host_dtype: str | None,
    nonexpert_dtype: str | None,
    out: str | None,
    executor: str,
    workers: int | None,
    scheduler: str | None,
    retry_errors: bool,
    no_progress: bool,
    as_json: bool,
    lookahead: str | None = None,
    min_gate_mass: float | None = None,
    arrival_rates: str | None = None,
    max_batch: int | None = None,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    runtimes: str | None = None,
    gpus: str | None = None,
    multi_gpu: str | None = None,
    bounds: bool = True,
) -> None:
    """Run every combination of policies, machines, traces and memory budgets.

    Give the grid with flags, or as GRID_FILE (TOML, see docs/sweeps.md; or the name of a
    bundled grid, such as example-grid); flags override the file's keys. Finished
    configurations are kept in OUT.parts/, so an interrupted sweep resumes where it stopped
    when run again.
    """
    from daopsim.simulator.sweep import Grid, load_grid_file, parse_option_items, run_sweep

    flags: dict[str, Any] = {
        "policies": _split(policies, str, "--policies"),
        "hw": _split(hw, str, "--hw"),
        "traces": _split(traces, str, "--traces"),
        "cache_ratios": _split(cache_ratios, float, "--cache-ratios"),
        "gpu_experts": _split(gpu_experts, int, "--gpu-experts"),
        "seeds": _split(seeds, int, "--seeds"),
        "arrival_rates": _split(arrival_rates, float, "--arrival-rates"),
        "max_batch": max_batch,
        "slo_ttft": slo_ttft,
        "slo_tpot": slo_tpot,
        "runtimes": _split(runtimes, str, "--runtimes"),
        "gpus": _split(gpus, int, "--gpus"),
        "multi_gpu": _split(multi_gpu, str, "--multi-gpu"),
    }
    if grid_file is not None:
        grid, file_out = load_grid_file(grid_file)
    else:
        if flags["policies"] is None:
            raise UserError("give --policies (or a grid file)")
        grid, file_out = Grid(policies=flags["policies"]), None
    for key, value in flags.items():
        if value is not None:
            setattr(grid, key, value)
    if grid_file is not None and flags["policies"] is not None:
        # --policies replaces the file's: its options for the policies left out go too
        kept = set(grid.policies)
        grid.options = {
            k: v for k, v in grid.options.items() if "." not in k or k.rpartition(".")[0] in kept
        }
    if sequences is not None:
        if sequences <= 0:
            raise UserError(f"--sequences must be positive, got {sequences}")
        grid.sequences = sequences
    if policy_opts:
        grid.options.update(parse_option_items(policy_opts))
    if calibration is not None:
        grid.calibration = calibration
    if dtype is not None:
        grid.dtype = dtype
    if lookahead is not None:
        grid.lookahead = lookahead
    if host_dtype is not None:
        grid.host_dtype = host_dtype
    if nonexpert_dtype is not None:
        grid.nonexpert_dtype = nonexpert_dtype
    out = out or file_out
    if out is None:
        raise UserError("give --out RESULTS.parquet (or 'out' in the grid file)")
    check_output_file(out, "--out", inputs=[grid_file])
    try:
        table, summary = run_sweep(
            grid,
            executor=executor,
            workers=workers,
            out=out,
            progress=not no_progress,
            scheduler=scheduler,
            retry_errors=retry_errors,
            min_gate_mass=min_gate_mass,
            bounds=bounds,
        )
    except KeyboardInterrupt:
        click.echo("interrupted: finished runs are kept; run the same command to resume", err=True)
        sys.exit(ExitCode.INTERRUPTED)
    if as_json:
        echo_json(summary.to_dict())
    else:
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
        from daopsim.simulator.sweep import small_budget_note

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
                f"failed: {e['policy']} on {e['hw']} ({e['trace']}, {mem}): {e['error']}",
                err=True,
            )
    sys.exit(ExitCode.FAILED if summary.failed else ExitCode.OK)


def _print_seed_table(out: object) -> None:
    """Mean +- standard deviation over seeds of each configuration (the seeds axis)."""
    from daopsim.simulator.sweep import read_table, seed_summary

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
