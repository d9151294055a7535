"""``daopsim regress``: re-run the golden grid and compare it with the golden store.

Exit 0 when nothing moved, 1 on any regression (a moved value, a new or missing configuration),
2 for bad arguments or a missing/damaged store, 3 when ``--update`` cannot write the store
(docs/cli.md). ``--update`` rewrites the whole store atomically, prints what changed and exits
0. See docs/regression.md.
"""

from __future__ import annotations

import sys

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.errors import ExitCode


@click.command("regress")
@click.option(
    "--baseline",
    default=None,
    metavar="FILE",
    help="Store JSON [default: the grid file's 'baseline', else the golden store "
    "baselines/policy-metrics.json].",
)
@click.option(
    "--update", is_flag=True, help="Rewrite the store (every configuration) with this run."
)
@click.option(
    "--only",
    multiple=True,
    metavar="GLOB",
    help="Run and compare only configurations whose key matches (repeatable), e.g. '* | lru | *'.",
)
@click.option(
    "--trace", default=None, help="Run a one-block grid on this trace (bundled name or path)."
)
@click.option(
    "--grid",
    "grid_file",
    default=None,
    metavar="FILE.toml",
    help="A custom grid: blocks of trace, policies, variants, budgets, profiles; "
    "see docs/regression.md.",
)
@click.option(
    "--tolerance-time",
    type=float,
    default=None,
    metavar="REL",
    help="Relative tolerance for times and rates [default: 1e-6]; counts and bytes are exact.",
)
@click.option("--no-progress", is_flag=True, help="Do not print each configuration as it runs.")
@json_option
def regress(
    baseline: str | None,
    update: bool,
    only: tuple[str, ...],
    trace: str | None,
    grid_file: str | None,
    tolerance_time: float | None,
    no_progress: bool,
    as_json: bool,
) -> None:
    """Re-run the golden grid (policies x machines x budgets x traces); fail if a number moved.

    \b
    Examples:
      daopsim regress                    # compare with the golden store
      daopsim regress --update           # accept the new numbers (review the diff!)
      daopsim regress --only '* | daop* | *'
      daopsim regress --grid ci/regress.toml --json
    """
    from daopsim.simulator.regress import default_store, with_trace
    from daopsim.simulator.regress import regress as run_regress
    from daopsim.simulator.regress_compare import DEFAULT_TOLERANCE, render_changes
    from daopsim.simulator.regress_grid import check_tolerance, default_grid, load_grid

    grid = load_grid(grid_file) if grid_file is not None else default_grid()
    if trace is not None:
        grid = with_trace(grid, trace)
    tol = tolerance_time if tolerance_time is not None else grid.tolerance_time
    tol = check_tolerance(tol) if tol is not None else DEFAULT_TOLERANCE
    path = baseline or grid.baseline or str(default_store())

    def progress(key: str) -> None:
        if not no_progress and not as_json:
            click.echo(f"  {key}", err=True)

    report = run_regress(
        grid, path, tolerance=tol, update=update, progress=progress, only=only, inputs=[grid_file]
    )
    if as_json:
        echo_json(report.to_dict())
    else:
        if report.changes:
            click.echo(render_changes(report.changes))
            click.echo("")
        n_moved = len(report.changes)
        n_cfg = len({c.config for c in report.changes})
        subset = " (--only)" if only else ""
        what = (
            f"{_count(report.configurations, 'configuration')}{subset}, "
            f"{report.compared:,} values, "
            f"{report.seconds:.1f} s, tolerance {tol:g} (relative, floats); ints exact"
        )
        if report.fresh:
            click.echo(f"wrote {path}: no readable store to compare with before ({what})")
        elif report.updated:
            click.echo(
                f"updated {path}: {_count(n_moved, 'change')} in "
                f"{_count(n_cfg, 'configuration')} ({what})"
            )
        elif report.ok:
            click.echo(f"regress OK against {path}: nothing moved ({what})")
        else:
            click.echo(
                f"regress FAILED against {path}: {_count(n_moved, 'change')} in "
                f"{_count(n_cfg, 'configuration')} ({what}); if intended, run "
                "`daopsim regress --update` and commit the store with the reason"
            )
    sys.exit(ExitCode.OK if report.ok or report.updated else ExitCode.FAILED)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
