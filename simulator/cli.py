"""The ``daopsim`` command line: a click group whose subcommands live in simulator/commands/.

User mistakes (``UserError``, and click's usage errors in a subcommand) print one line,
``error: ...``, and exit 2; no traceback. A policy breaking the engine's rules (``PolicyError``)
also exits 2 with its one line. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from simulator.errors import PolicyError, UserError

#: (module under simulator.commands, attribute) for every subcommand; one line per command.
COMMANDS: list[tuple[str, str]] = [
    ("trace_cmd", "trace"),
    ("models_cmd", "models"),
    ("profiles_cmd", "profiles"),
    ("synth_cmd", "synth"),
    ("traces_cmd", "traces"),
    ("run_cmd", "run"),
    ("policies_cmd", "policies"),
    ("experiment_cmd", "experiment"),
    ("capture_cmd", "capture"),
    ("sweep_cmd", "sweep"),
    ("plot_cmd", "plot"),
    ("regress_cmd", "regress"),
    ("validate_cmd", "validate"),
]


class _Group(click.Group):
    """Turns user errors into one line and exit code 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (UserError, PolicyError) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except click.UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":
                raise  # a bare group name: click prints the group's help
            # a subcommand's bad option value: one line too (click's own form is four)
            where = exc.ctx.command_path if exc.ctx is not None else "daopsim"
            text = " ".join(exc.format_message().split())
            click.echo(f"error: {where}: {text} (see --help)", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="daopsim")
def main() -> None:
    """daopsim: trace-driven simulator for MoE expert-offloading policies."""


def _register() -> None:
    for module, attr in COMMANDS:
        try:
            mod = importlib.import_module(f"simulator.commands.{module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"simulator.commands.{module}":
                continue  # command not built yet
            raise
        main.add_command(getattr(mod, attr))


_register()

if __name__ == "__main__":
    main()
