"""``daopsim experiment NAME``: run a named experiment (e.g. ``daop-paper``), print and write it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.errors import ExitCode, UserError
from daopsim.simulator.output import check_output_dir, value_paths


def resolve_or_none(trace: str) -> Path | None:
    """The file behind a trace name or path, or None when it does not resolve (the run will
    report that)."""
    from daopsim.simulator.data import resolve_trace

    try:
        return resolve_trace(trace)
    except UserError:
        return None


def _names(text: str | None, flag: str) -> list[str] | None:
    """A comma-separated list of names (None when the option was not given)."""
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UserError(f"{flag}: no names given")
    return items


#: Options only a leaderboard (a grid run through the sweep machinery) takes.
_GRID_OPTIONS = ("--runs", "--policies", "--extra-policies", "--hw", "--models", "--executor",
                 "--workers", "--scheduler", "--no-progress")  # fmt: skip


@click.command("experiment")
@click.argument("name", default="daop-paper")
@click.option(
    "--out",
    "-o",
    "out_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Folder for results.csv/.parquet, speedups.csv, summary.txt and tokens_per_s.png; "
    "for a leaderboard leaderboard.parquet, leaderboard.md, relative.png and pareto.png "
    "(default: ./<experiment>-results).",
)
@click.option(
    "--sequences",
    type=int,
    default=None,
    help="Evaluation sequences per run (default: the experiment file's 'sequences').",
)
@click.option(
    "--runs",
    type=click.Path(path_type=Path),
    default=None,
    help="Leaderboard: folder of its resumable sweep stores, one per model (default: "
    "./<experiment>-runs); run again to resume.",
)
@click.option("--policies", help="Leaderboard: only these policies (comma-separated).")
@click.option(
    "--extra-policies",
    help="Leaderboard: policies added to its own (a plugin, a policy under test).",
)
@click.option("--hw", help="Leaderboard: only these of its machines (comma-separated).")
@click.option("--models", help="Leaderboard: only these of its models (comma-separated).")
@click.option(
    "--executor", type=click.Choice(["local", "dask"]), default=None, help="Leaderboard: "
    "process pool (local, the default) or Dask."
)  # fmt: skip
@click.option("--workers", type=int, help="Leaderboard: worker processes (default: CPUs).")
@click.option("--scheduler", metavar="ADDRESS", help="Leaderboard: a Dask scheduler address.")
@click.option("--no-progress", is_flag=True, default=None, help="Leaderboard: no progress bar.")
@click.option("--list", "list_only", is_flag=True, help="List the bundled experiments and exit.")
@json_option
def experiment(
    name: str,
    out_dir: Path | None,
    sequences: int | None,
    list_only: bool,
    as_json: bool,
    runs: Path | None = None,
    policies: str | None = None,
    extra_policies: str | None = None,
    hw: str | None = None,
    models: str | None = None,
    executor: str | None = None,
    workers: int | None = None,
    scheduler: str | None = None,
    no_progress: bool | None = None,
) -> None:
    """Run experiment NAME (a bundled name such as daop-paper or leaderboard, or a TOML file).

    Every policy runs on the same trace, hardware profile and cost model; points whose
    expert budget does not fit in GPU memory are skipped and reported with the reason. A
    leaderboard (docs/leaderboard.md) runs every built-in policy on its grid of models,
    machines and budgets through the sweep machinery: resumable (--runs), in parallel
    (--workers, --executor dask).
    """
    from daopsim.simulator.experiments import (
        EXPERIMENT_REPLACES,
        bundled_experiments,
        load_experiment,
        run_experiment,
    )
    from daopsim.simulator.leaderboard import file_kind

    if list_only:
        names = {n: str(p) for n, p in bundled_experiments().items()}
        if as_json:
            echo_json(names)
        else:
            for n, p in names.items():
                click.echo(f"{n}  {p}")
        return
    path = bundled_experiments().get(name) or Path(name)
    grid_opts = (runs, policies, extra_policies, hw, models, executor, workers, scheduler,
                 no_progress)  # fmt: skip
    if path.is_file() and file_kind(path) == "leaderboard":
        _leaderboard(path, out_dir, sequences, as_json, *grid_opts)
        return
    given = [flag for flag, v in zip(_GRID_OPTIONS, grid_opts, strict=True) if v is not None]
    if given:
        raise UserError(f"{given[0]} applies to a leaderboard experiment only, not to {name!r}")
    exp = load_experiment(name)
    out = out_dir if out_dir is not None else Path(f"{exp.name}-results")
    traces = [resolve_or_none(m.trace) for m in exp.models]
    inputs = [exp.hw, *traces, *value_paths(exp.policies)]  # options may name files (model=)
    check_output_dir(out, EXPERIMENT_REPLACES, "--out", [exp.path, *inputs])

    def progress(msg: str) -> None:
        if not as_json:
            click.echo(f"  running {msg}", err=True)

    result = run_experiment(exp, sequences=sequences, progress=progress)
    paths = result.write(out, flag="--out", inputs=(exp.path, *inputs))
    if as_json:
        doc = result.summary()
        doc["outputs"] = {k: str(v) for k, v in paths.items()}
        echo_json(doc)
    else:
        click.echo(f"{exp.name}: {exp.description}")
        click.echo(result.format_table())
        click.echo(f"wrote {', '.join(str(p) for p in paths.values())}")


def _leaderboard(
    path: Path,
    out_dir: Path | None,
    sequences: int | None,
    as_json: bool,
    runs: Path | None,
    policies: str | None,
    extra_policies: str | None,
    hw: str | None,
    models: str | None,
    executor: str | None,
    workers: int | None,
    scheduler: str | None,
    no_progress: bool | None,
) -> None:
    """``experiment`` for a leaderboard file: run its grid, print the ranking, write the set."""
    import time

    from daopsim.simulator.leaderboard import LEADERBOARD_FILES, load_leaderboard, ranking

    board = load_leaderboard(path)
    out = out_dir if out_dir is not None else Path(f"{board.name}-results")
    check_output_dir(out, tuple(LEADERBOARD_FILES.values()), "--out", [path])
    if sequences is not None and sequences <= 0:
        raise UserError(f"--sequences must be a positive integer, got {sequences}")
    if workers is not None and workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    t0 = time.perf_counter()

    def on_model(label: str) -> None:
        if not as_json:
            click.echo(f"  {board.name}: {label}", err=True)

    try:
        result = _run(board, runs, extra_policies, policies, hw, models, sequences, executor,
                      workers, scheduler, no_progress, as_json, on_model)  # fmt: skip
    except KeyboardInterrupt:
        click.echo("interrupted: finished runs are kept; run the same command to resume", err=True)
        sys.exit(ExitCode.INTERRUPTED)
    paths = result.write(out, flag="--out")
    elapsed = time.perf_counter() - t0
    tab = result.table
    failed = tab[tab["status"] == "error"]
    if as_json:
        rk = ranking(tab)
        echo_json(
            {
                "experiment": board.name,
                "rows": len(tab),
                "ok": int((tab["status"] == "ok").sum()),
                "failed": len(failed),
                "elapsed_s": round(elapsed, 3),
                "ranking": rk.to_dict(orient="records"),
                "sweeps": result.summaries,
                "outputs": {k: str(v) for k, v in paths.items()},
            }
        )
    else:
        click.echo(f"{board.name}: {board.description}")
        rk = ranking(tab)
        for i, r in enumerate(rk[~rk["bound"]].itertuples(index=False), 1):
            click.echo(f"  {i:>2}. {r.policy:<20} score {r.score:.3f}  ({r.cells}/{r.of} cells)")
        click.echo(
            f"{len(tab)} rows, {len(failed)} failed; {elapsed:.0f} s; "
            f"wrote {', '.join(str(p) for p in paths.values())}"
        )
        for r in failed.itertuples(index=False):
            click.echo(f"failed: {r.policy} on {r.hw} ({r.model}, budget {r.budget}): {r.error}",
                       err=True)  # fmt: skip
    sys.exit(ExitCode.FAILED if len(failed) else ExitCode.OK)


def _run(
    board: Any,
    runs: Path | None,
    extra_policies: str | None,
    policies: str | None,
    hw: str | None,
    models: str | None,
    sequences: int | None,
    executor: str | None,
    workers: int | None,
    scheduler: str | None,
    no_progress: bool | None,
    as_json: bool,
    on_model: Any,
) -> Any:
    from daopsim.simulator.leaderboard import run_leaderboard

    return run_leaderboard(
        board,
        runs=runs if runs is not None else Path(f"{board.name}-runs"),
        extra_policies=_names(extra_policies, "--extra-policies"),
        policies=_names(policies, "--policies"),
        hw=_names(hw, "--hw"),
        models=_names(models, "--models"),
        sequences=sequences,
        executor=executor or "local",
        workers=workers,
        scheduler=scheduler,
        progress=not no_progress and not as_json,
        on_model=on_model,
    )
