"""``daopsim advise``: the ranked table of what to run for one model on one or more machines."""

from __future__ import annotations

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.errors import UserError


def _names(value: str | None, flag: str) -> list[str] | None:
    """A comma-separated list option (None when not given); an empty one is an error."""
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise UserError(f"{flag}: no values given")
    return names


def _prices(items: tuple[str, ...]) -> dict[str, float] | None:
    """``--price NAME=AMOUNT`` options (repeatable, or comma-separated) as a dict."""
    from daopsim.simulator.errors import parse_key_values

    if not items:
        return None
    pairs = [p for item in items for p in item.split(",") if p.strip()]
    out: dict[str, float] = {}
    for name, text in parse_key_values(pairs, "--price", "NAME=AMOUNT", False).items():
        try:
            out[name] = float(text)
        except ValueError:
            raise UserError(f"--price {name}={text}: the amount must be a number") from None
    return out


@click.command("advise", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", required=True, help="Model preset (see `daopsim models list`).")
@click.option(
    "--hw",
    required=True,
    help="Machine profile name or TOML path; several, comma-separated, to compare machines.",
)
@click.option("--trace", default=None, help="Trace to search on (default: bundled or synthetic).")
@click.option(
    "--dtype",
    "dtypes",
    default=None,
    help="Comma-separated expert precisions to try (default: the trace's, then q4_k_m).",
)
@click.option("--policies", default=None, help="Comma-separated policies to search (default: all).")
@click.option(
    "--runtime",
    "runtimes",
    default=None,
    metavar="NAME[,NAME]",
    help="Run every policy under these runtimes (`daopsim runtimes list`) instead of each "
    "policy's own, to compare policies rather than frameworks.",
)
@click.option(
    "--min-gate-mass",
    type=float,
    default=None,
    help="Drop configurations whose routing fidelity (gate_mass_preserved) is below this.",
)
@click.option(
    "--min-tokens-per-s",
    type=float,
    default=None,
    help="A target: leave out rows below it, say which machines reach it and the cheapest.",
)
@click.option(
    "--price",
    "prices",
    multiple=True,
    metavar="NAME=AMOUNT",
    help="What each machine costs you (any unit), to pick the cheapest that reaches "
    "--min-tokens-per-s (repeatable; default: by energy per token).",
)
@click.option(
    "--sequences",
    type=int,
    default=None,
    help="Evaluation sequences per run (default 2).",
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
@click.option("--no-progress", is_flag=True, help="Do not show a progress bar.")
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
    runtimes: str | None = None,
    min_tokens_per_s: float | None = None,
    prices: tuple[str, ...] = (),
    sequences: int | None = None,
    no_progress: bool = False,
) -> None:
    """Search policies, options, budgets and precisions on one or more machines; print them
    ranked by tokens/s, each with the `daopsim run` command that reproduces it."""
    from daopsim.simulator.advise import SEQUENCES
    from daopsim.simulator.advise import advise as run_advise
    from daopsim.simulator.advise_render import DEFAULT_TOP, render, to_csv
    from daopsim.simulator.progress import on_terminal

    if as_json and as_csv:
        raise UserError("give --json or --csv, not both")
    result = run_advise(
        model,
        _names(hw, "--hw") or [],
        trace=trace,
        dtypes=_names(dtypes, "--dtype"),
        min_gate_mass=min_gate_mass,
        policies=_names(policies, "--policies"),
        executor=executor,
        workers=workers,
        scheduler=scheduler,
        progress=not no_progress and on_terminal(),
        runtimes=_names(runtimes, "--runtime"),
        min_tokens_per_s=min_tokens_per_s,
        prices=_prices(prices),
        sequences=SEQUENCES if sequences is None else sequences,
    )
    if as_json:
        echo_json(result.to_dict())
    elif as_csv:
        click.echo(to_csv(result), nl=False)
    else:
        click.echo(render(result, top=DEFAULT_TOP if top is None else top))
