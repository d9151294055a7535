"""``daopsim experiment NAME``: run a named experiment (e.g. ``daop-paper``), print and write it."""

from __future__ import annotations

from pathlib import Path

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.errors import UserError
from daopsim.simulator.output import check_output_dir, value_paths


def resolve_or_none(trace: str) -> Path | None:
    """The file behind a trace name or path, or None when it does not resolve (the run will
    report that)."""
    from daopsim.simulator.data import resolve_trace

    try:
        return resolve_trace(trace)
    except UserError:
        return None


@click.command("experiment")
@click.argument("name", default="daop-paper")
@click.option(
    "--out",
    "-o",
    "out_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Folder for results.csv/.parquet, speedups.csv, summary.txt and tokens_per_s.png "
    "(default: ./<experiment>-results).",
)
@click.option(
    "--sequences",
    type=int,
    default=None,
    help="Evaluation sequences per run (default: the experiment file's 'sequences').",
)
@click.option("--list", "list_only", is_flag=True, help="List the bundled experiments and exit.")
@json_option
def experiment(
    name: str, out_dir: Path | None, sequences: int | None, list_only: bool, as_json: bool
) -> None:
    """Run experiment NAME (a bundled name such as daop-paper, or a TOML file).

    Every policy runs on the same trace, hardware profile and cost model; points whose
    expert budget does not fit in GPU memory are skipped and reported with the reason.
    """
    from daopsim.simulator.experiments import (
        EXPERIMENT_REPLACES,
        bundled_experiments,
        load_experiment,
        run_experiment,
    )

    if list_only:
        names = {n: str(p) for n, p in bundled_experiments().items()}
        if as_json:
            echo_json(names)
        else:
            for n, p in names.items():
                click.echo(f"{n}  {p}")
        return
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
