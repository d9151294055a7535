"""The ``daopsim`` command line: a click group whose subcommands live in simulator/commands/.

User mistakes (``UserError``, and click's usage errors in a subcommand) print one line,
``error: ...``, and exit 2; no traceback. A policy breaking the engine's rules (``PolicyError``)
also exits 2 with its one line. An output that cannot be written (``OutputError``, or any
``OSError`` a command did not handle) exits 3. With ``--json`` the same error is one JSON object
``{"error": ..., "exit_code": ...}`` on stdout instead. A reader that closes the pipe early
(``| head -1``) ends the command quietly with exit 0. Ctrl-C ends any command with
``error: interrupted`` and exit 130. Anything else is a bug and keeps its traceback.
docs/cli.md lists the exit codes.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

import click

from daopsim.simulator import native
from daopsim.simulator.errors import (
    DEBUG_ENV,
    ExitCode,
    PolicyError,
    UserError,
    debug_enabled,
    debug_traceback,
)
from daopsim.simulator.output import describe_os_error

#: (module under daopsim.simulator.commands, attribute) for every subcommand; one line per command.
COMMANDS: list[tuple[str, str]] = [
    ("traces_cmd", "trace"),  # the trace group, with `trace list` added by traces_cmd
    ("models_cmd", "models"),
    ("profiles_cmd", "profiles"),
    ("runtimes_cmd", "runtimes"),
    ("synth_cmd", "synth"),
    ("traces_cmd", "traces"),  # hidden alias of `trace`
    ("run_cmd", "run"),
    ("policies_cmd", "policies"),
    ("experiment_cmd", "experiment"),
    ("capture_cmd", "capture"),
    ("sweep_cmd", "sweep"),
    ("plot_cmd", "plot"),
    ("regress_cmd", "regress"),
    ("validate_cmd", "validate"),
    ("advise_cmd", "advise"),
    ("compare_cmd", "compare"),
    ("doctor_cmd", "doctor"),
    ("learn_cmd", "learn"),
    ("probe_cmd", "probe"),
    ("check_cmd", "check"),
]


def fail(message: str, code: ExitCode, as_json: bool) -> None:
    """Print one error (a line on stderr, or a JSON object on stdout) and exit with ``code``."""
    message = " ".join(message.split())  # one line, whatever the exception text held
    if as_json:
        click.echo(json.dumps({"error": message, "exit_code": int(code)}, sort_keys=True))
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(int(code))


class _Group(click.Group):
    """Turns user and output errors into one line (or one JSON object) and their exit code."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # the subcommand's own context is gone once it raises; remember its raw arguments
        ctx.meta["daopsim.json"] = "--json" in args
        # --debug anywhere before a `--` (daopsim --debug run ... or daopsim run ... --debug)
        end = args.index("--") if "--" in args else len(args)
        if "--debug" in args[:end]:
            args = [a for i, a in enumerate(args) if i >= end or a != "--debug"]
            ctx.meta["daopsim.debug"] = True
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        as_json = bool(ctx.meta.get("daopsim.json"))
        notice = native.announcement()  # part of the compiled build stale: one line, every time
        if notice:
            click.echo(notice, err=True)
        saved = os.environ.get(DEBUG_ENV)
        if ctx.meta.get("daopsim.debug"):
            os.environ[DEBUG_ENV] = "1"  # worker processes of a sweep inherit it
        try:
            out = super().invoke(ctx)
            sys.stdout.flush()  # a reader that left early (`| head`) shows up here, not at exit
            return out
        except BrokenPipeError:
            _quiet_closed_pipe()
        except KeyboardInterrupt:
            # Ctrl-C: one line and 130 from every command (click's own is "Aborted!" and 1);
            # a command that keeps finished work says so itself before this (sweep)
            fail("interrupted", ExitCode.INTERRUPTED, as_json)
        except (UserError, PolicyError) as exc:
            _debug(exc)
            fail(str(exc), getattr(exc, "exit_code", ExitCode.USAGE), as_json)
        except OSError as exc:
            _debug(exc)
            # a read or write the command did not expect to fail: still one line, not a trace
            where = exc.filename if exc.filename is not None else "daopsim"
            fail(f"{where}: {describe_os_error(exc, where)}", ExitCode.OUTPUT, as_json)
        except click.UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":
                raise  # a bare group name: click prints the group's help
            # a subcommand's bad option value: one line too (click's own form is four)
            where = exc.ctx.command_path if exc.ctx is not None else "daopsim"
            text = " ".join(exc.format_message().split())
            fail(f"{where}: {text} (see --help)", ExitCode.USAGE, as_json)
        finally:
            if ctx.meta.get("daopsim.debug"):
                if saved is None:
                    os.environ.pop(DEBUG_ENV, None)
                else:
                    os.environ[DEBUG_ENV] = saved


def _debug(exc: BaseException) -> None:
    """Under ``--debug`` or ``DAOPSIM_DEBUG=1``: the traceback behind a one-line error on
    stderr (a policy's own exception, with the file and line of each frame), before it."""
    if debug_enabled():
        click.echo(debug_traceback(exc).rstrip(), err=True)


def _quiet_closed_pipe() -> None:
    """Exit 0 without a word when the reader of stdout has gone (``daopsim ... | head -1``):
    what was wanted was read. stdout is pointed at /dev/null first, so the interpreter's own
    flush at exit does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    sys.exit(0)


def _version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``--version``: the package's version and which build runs (simulator/native.py)."""
    if not value or ctx.resilient_parsing:
        return
    from daopsim import __version__

    click.echo(f"daopsim, version {__version__}")
    click.echo(f"build: {native.status().describe()}")
    ctx.exit()


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_version,
    help="Show the version and which build runs (compiled, partly compiled or pure Python).",
)
@click.option(
    "--debug",
    is_flag=True,
    help="Show the traceback behind an error (a policy's own exception with its file and "
    "line); also DAOPSIM_DEBUG=1. May also follow the command: `daopsim run ... --debug`.",
)
def main(debug: bool = False) -> None:
    """daopsim: trace-driven simulator for MoE expert-offloading policies."""


def _register() -> None:
    for module, attr in COMMANDS:
        try:
            mod = importlib.import_module(f"daopsim.simulator.commands.{module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"daopsim.simulator.commands.{module}":
                continue  # command not built yet
            raise
        main.add_command(getattr(mod, attr))


_register()

if __name__ == "__main__":
    main()
