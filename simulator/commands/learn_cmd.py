"""``daopsim learn``: train the ``learned`` policy's scorer on a trace and write its model file.

DAgger imitation of Belady's MIN through the Gymnasium environment (simulator/imitation.py,
docs/learned-policies.md). Needs the ``gym`` extra (``pip install 'daopsim[gym]'``).
"""

from __future__ import annotations

import json
import sys

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.errors import UserError
from daopsim.simulator.output import check_output_file, write_text
from daopsim.simulator.progress import lazy_progress


def parse_ids(text: str | None, flag: str) -> list[int] | None:
    """``0,1,2`` or ``0-3`` (or both, ``0-2,5``) as a sorted id list; None for None."""
    if text is None:
        return None
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            if sep:
                a, b = int(lo), int(hi)
                if a > b:
                    raise ValueError(part)
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise UserError(f"{flag}: {part!r} is not an id or a range a-b") from None
    return sorted(out)


@click.command()
@click.option("--trace", default=None, help="Trace to train on (default: the bundled Mixtral).")
@click.option(
    "--sequences",
    default=None,
    metavar="IDS",
    help="Training sequence ids, e.g. 0-3 or 0,2,5 (default: the first half of the trace).",
)
@click.option(
    "--budgets",
    default=None,
    metavar="N,...",
    help="Experts per layer to play at (default: 1.5, 2 and 2.5 x top-k).",
)
@click.option(
    "--hw",
    default="a100-80g-pcie4",
    show_default=True,
    help="Machine of the rollouts (choices do not depend on timing; the budgets must fit).",
)
@click.option("--rounds", type=int, default=3, show_default=True, help="DAgger rounds.")
@click.option("--hidden", type=int, default=16, show_default=True, help="Hidden units.")
@click.option("--epochs", type=int, default=20, show_default=True, help="Epochs per fit.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of weights, shuffles.")
@click.option("-o", "--output", required=True, help="Model file to write (.json).")
@click.option("--no-progress", is_flag=True, help="Do not show a progress bar.")
@json_option
def learn(
    trace: str | None,
    sequences: str | None,
    budgets: str | None,
    hw: str,
    rounds: int,
    hidden: int,
    epochs: int,
    seed: int,
    output: str,
    no_progress: bool,
    as_json: bool,
) -> None:
    """Train the `learned` policy by imitating Belady's choices, and write its model file.

    \b
    Example:
      daopsim learn --trace mixtral-8x7b --sequences 0-3 -o model.json
      daopsim run --policy learned --policy-opt model=model.json --trace phi-3.5-moe
    """
    try:
        from daopsim.simulator.imitation import LearnConfig
        from daopsim.simulator.imitation import learn as train
    except ImportError:
        raise UserError("daopsim learn needs the gym extra: pip install 'daopsim[gym]'") from None
    if not output.endswith(".json"):
        raise UserError(f"-o {output}: a model file ends in .json")
    check_output_file(output, "-o", inputs=[trace] if trace else [])
    config = LearnConfig(
        trace=trace,
        sequences=parse_ids(sequences, "--sequences"),
        budgets=parse_ids(budgets, "--budgets"),
        hw=hw,
        rounds=rounds,
        hidden=hidden,
        epochs=epochs,
        seed=seed,
    )
    enabled = not no_progress and sys.stderr.isatty()
    with lazy_progress("learn", enabled) as progress:
        result = train(config, progress)
    write_text(output, json.dumps(result.scorer.to_dict(), indent=1) + "\n", "-o")
    summary = {
        "path": output,
        "config": result.config,
        "rounds": result.rounds,
        "seconds": result.seconds,
    }
    if as_json:
        echo_json(summary)
        return
    cfg = result.config
    click.echo(
        f"trained on {cfg['trace']} sequences {cfg['sequences']} at {cfg['budgets']} experts "
        f"per layer, {len(result.rounds)} DAgger rounds in {result.seconds:.0f} s"
    )
    for r in result.rounds:
        click.echo(
            f"  round {r['round']} ({r['rolled_out']}): {r['decisions']} decisions, agreement "
            f"with belady {r['rollout_agreement']:.3f}; fit on {r['data']}: loss "
            f"{r['loss']:.4f}, agreement {r['fit_agreement']:.3f}"
        )
    click.echo(f"wrote {output}")
