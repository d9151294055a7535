"""Errors that reach users as one clear line (never a traceback), and the CLI's exit codes.

``UserError`` and its subclasses mean "the input is wrong"; the CLI prints ``error: <message>``
and exits 2. ``OutputError`` means an output path cannot be used or written (exit 3).
``PolicyError`` means a policy asked for something the engine refuses; it names the policy,
sequence, token and layer so the plugin author can find the decision. docs/cli.md lists the
exit codes.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from enum import IntEnum


class ExitCode(IntEnum):
    """The exit codes of every ``daopsim`` command (docs/cli.md, "Exit codes")."""

    OK = 0
    #: the command ran but its verdict is negative: a sweep configuration failed, a regression
    #: moved, a validation row is out of tolerance
    FAILED = 1
    #: a user mistake: bad option, unreadable or invalid input, a policy breaking the rules
    USAGE = 2
    #: an output path cannot be used or written (not a regular file, an input, read-only,
    #: disk full, permission denied); nothing was replaced
    OUTPUT = 3
    #: interrupted (Ctrl-C); finished work is kept where the command says so
    INTERRUPTED = 130


def parse_key_values(
    items: tuple[str, ...] | list[str],
    flag: str,
    form: str = "key=value",
    allow_empty: bool = True,
) -> dict[str, str]:
    """``key=value`` option strings to a dict (values stay strings).

    The one key=value parser of the CLI. A malformed item (no ``=``, an empty key, or an empty
    value when ``allow_empty`` is false) is a UserError naming the flag and the expected
    ``form``; so is a key given twice (which of the two was meant is not for the parser to guess,
    as for a value repeated in a comma list).
    """
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not (allow_empty or value.strip()):
            raise UserError(f"{flag} {item!r}: expected {form}")
        if key.strip() in out:
            raise UserError(f"{flag}: {key.strip()!r} given twice")
        out[key.strip()] = value.strip()
    return out


def check_seed(seed: object, flag: str = "--seed") -> int:
    """``seed`` when it is a non-negative integer (what NumPy's generators take), else a
    UserError naming ``flag``: the one check behind every seed option."""
    try:
        value = operator.index(seed)  # type: ignore[call-overload]
    except TypeError:
        value = -1
    if isinstance(seed, bool) or value < 0:
        raise UserError(f"{flag} must be a non-negative integer, got {seed!r}")
    return value


class UserError(Exception):
    """A mistake in user input (file, option, value). Printed as one line; exit code 2."""

    exit_code: ExitCode = ExitCode.USAGE


class MissingExtra(UserError, ImportError):
    """An optional extra this needs is not installed (``pip install 'daopsim[NAME]'``): an
    ImportError for Python code, one line and exit 2 on the command line."""


class OutputError(UserError):
    """An output path cannot be used or written; printed as one line, exit code 3."""

    exit_code = ExitCode.OUTPUT


class DoesNotFit(UserError):
    """The requested experts (or the run itself) do not fit in the machine's GPU memory.

    ``max_experts`` is how many resident experts do fit (0 when none can); sweeps report such a
    configuration as skipped, not failed.
    """

    def __init__(self, max_experts: int, message: str) -> None:
        super().__init__(message)
        self.max_experts = max_experts


class TraceError(UserError):
    """A trace file is missing, unreadable or invalid; names the file, row and column."""

    def __init__(
        self, path: object, message: str, row: int | None = None, column: str | None = None
    ) -> None:
        where = str(path)
        if row is not None:
            where += f": row {row}"
        if column is not None:
            where += f": column {column!r}"
        super().__init__(f"{where}: {message}")
        self.path = str(path)
        self.row = row
        self.column = column
        self.detail = message


class ProfileError(UserError):
    """A hardware profile is missing or invalid; names the file and key."""

    def __init__(self, path: object, message: str, key: str | None = None) -> None:
        where = str(path)
        if key is not None:
            where += f": key {key!r}"
        super().__init__(f"{where}: {message}")
        self.path = str(path)
        self.key = key


class PolicyError(Exception):
    """A policy made an impossible decision or raised; names policy, sequence, token, layer."""

    def __init__(
        self,
        policy: str,
        message: str,
        seq: int | None = None,
        token: int | None = None,
        layer: int | None = None,
    ) -> None:
        where = [f"policy {policy!r}"]
        if seq is not None:
            where.append(f"sequence {seq}")
        if token is not None:
            where.append(f"token {token}")
        if layer is not None:
            where.append(f"layer {layer}")
        super().__init__(f"{', '.join(where)}: {message}")
        self.policy = policy
        self.seq = seq
        self.token = token
        self.layer = layer


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` naming the known names closest to ``name`` (at most three),
    or ``""`` when none is close: the tail of an "unknown name" error."""
    import difflib

    pool = list(known)
    close = difflib.get_close_matches(name, pool, n=3, cutoff=0.6)
    if not close:  # a prefix or a part of the name: "4090" for "rtx4090-pcie4"
        low = name.lower()
        close = [k for k in pool if low and (k.lower().startswith(low) or low in k.lower())][:3]
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"


#: set to 1 (or give ``daopsim --debug``) to see the traceback behind a one-line error
DEBUG_ENV = "DAOPSIM_DEBUG"


def debug_enabled() -> bool:
    """Whether ``--debug`` or ``DAOPSIM_DEBUG=1`` asks for tracebacks behind errors."""
    import os

    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def debug_traceback(exc: BaseException) -> str:
    """The traceback ``--debug`` prints for a one-line error: of the exception behind it (a
    policy's own exception, an import error), else of the error itself."""
    import traceback

    inner = exc.__cause__ or exc.__context__ or exc
    return "".join(traceback.format_exception(inner))
