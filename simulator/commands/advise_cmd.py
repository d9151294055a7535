"""``daopsim advise``: the ranked table of what to run for one model on one machine."""

from __future__ import annotations

import click

from daopsim.simulator.commands.common import echo_json, json_option


@click.command("advise", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", required=True, help="Model preset (see `daopsim models list`).")
@click.option("--hw", required=True, help="Machine profile name or path to a profile TOML.")
@click.option("--trace", default=None, help="Trace to search on (default: bundled or synthetic).")
@click.option(
    "--dtype",
    "dtypes",
    default=None,
    help="Comma-separated expert precisions to try (default: the trace's, then q4_k_m).",
)
@click.option("--policies", default=None, help="Comma-separated policies to search (default: all).")
@click.option(
    "--min-gate-mass",
    type=float,
    default=None,
    help="Drop configurations whose routing fidelity (gate_mass_preserved) is below this.",
)
@click.option(
    "--executor", type=click.Choice(["local", "dask"]), default="local", show_default=True
)
@click.option("--workers", type=int, help="Worker processes (default: number of CPUs).")
@click.option("--scheduler", metavar="ADDRESS", help="Dask scheduler (tcp://host:8786).")
@click.option(
    "--top",
    type=click.IntRange(min=0),
    default=None,
    help="Ranked rows to print (default 10; 0: all). --json and --csv have every row.",
)
@click.option("--csv", "as_csv", is_flag=True, help="Every row and column as CSV on stdout.")
@json_option
def advise(
    model: str,
    hw: str,
    trace: str | None,
    dtypes: str | None,
    min_gate_mass: float | None,
    policies: str | None,
    executor: str,
    workers: int | None,
    scheduler: str | None,
    as_json: bool,
    top: int | None = None,
    as_csv: bool = False,
) -> None:
    """Search policies, budgets, options and precisions; print them ranked by tokens/s."""
    from daopsim.simulator.advise import DEFAULT_TOP, render, to_csv
    from daopsim.simulator.advise import advise as run_advise
    from daopsim.simulator.errors import UserError

    if as_json and as_csv:
        raise UserError("give --json or --csv, not both")

    dtype_list = None
    if dtypes is not None:
        dtype_list = [d.strip() for d in dtypes.split(",") if d.strip()]
        if not dtype_list:
            raise UserError("--dtype: no values given")
    policy_list = None
    if policies is not None:
        policy_list = [p.strip() for p in policies.split(",") if p.strip()]
        if not policy_list:
            raise UserError("--policies: no values given")
    result = run_advise(
        model,
        hw,
        trace=trace,
        dtypes=dtype_list,
        min_gate_mass=min_gate_mass,
        policies=policy_list,
        executor=executor,
        workers=workers,
        scheduler=scheduler,
    )
    if as_json:
        echo_json(result.to_dict())
    elif as_csv:
        click.echo(to_csv(result), nl=False)
    else:
        click.echo(render(result, top=DEFAULT_TOP if top is None else top))
