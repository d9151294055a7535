"""Where bundled data lives (package data, so an installed wheel finds it) and name lookup.

Five folders ship with daopsim, all inside the ``daopsim`` package. ``hardware_profiles`` and
``traces`` are its subpackages ``daopsim.hardware_profiles`` and ``daopsim.traces`` (the design's
top-level folders, through pyproject.toml's package-dir). ``experiments``, ``validation`` and
``baselines`` are installed as ``daopsim.data.<folder>`` (pyproject's ``package-dir``). Every
folder is found through ``importlib.resources`` under ``daopsim``, never through the working
directory or a top-level name: a ``traces/`` folder in the current directory (which Python may see
as a namespace package ``traces``) cannot hide the bundled one.
"""

from __future__ import annotations

import errno
import os
import stat
from importlib import resources
from pathlib import Path
from typing import Any

from daopsim.simulator.errors import UserError, did_you_mean

#: The bundled trace ``daopsim run`` uses when ``--trace`` is not given.
DEFAULT_TRACE = "mixtral-8x7b"
#: The small bundled trace that golden tests and ``daopsim regress`` use.
CI_TRACE = "ci-small"
#: Data folders that are subpackages of ``daopsim`` (``daopsim.hardware_profiles``, ...).
SUBPACKAGES = ("hardware_profiles", "traces")
#: Data folders installed under ``daopsim.data`` (plain folders in the source tree).
UNDER_DAOPSIM = ("experiments", "validation", "baselines")


def _source_root() -> Path:
    """The folder holding the real ``simulator/`` folder: the repository in a checkout that is
    not installed, where the plain data folders are."""
    return Path(str(resources.files("daopsim.simulator"))).resolve().parent


def bundled_dir(folder: str) -> Path:
    """One of the bundled data folders (``SUBPACKAGES`` or ``UNDER_DAOPSIM``)."""
    if folder in SUBPACKAGES:
        return Path(str(resources.files(f"daopsim.{folder}")))
    if folder in UNDER_DAOPSIM:
        try:
            return Path(str(resources.files(f"daopsim.data.{folder}")))
        except ModuleNotFoundError:  # a source checkout on sys.path, not installed
            return _source_root() / folder
    raise ValueError(f"not a bundled data folder: {folder!r}")


def profiles_dir() -> Path:
    """Folder of the bundled hardware profiles (hardware_profiles/*.toml)."""
    return bundled_dir("hardware_profiles")


def traces_dir() -> Path:
    """Folder of the bundled traces (traces/*.parquet)."""
    return bundled_dir("traces")


def bundled_traces() -> dict[str, Path]:
    """Bundled traces by short name (file stem)."""
    return {p.stem: p for p in sorted(traces_dir().glob("*.parquet"))}


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def non_regular_kind(path: str | os.PathLike[str]) -> str | None:
    """What an existing non-regular file is ("a FIFO", ...), or None for a regular or missing
    file. Symbolic links are followed."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def check_input_file(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a Path if it is an existing regular file; else a one-line UserError.

    Reading a FIFO or a character device would block forever or never end, so every input
    file (trace, profile, grid, table, baseline, preset) is refused unless it is regular.
    """
    p = Path(path).expanduser()
    try:
        os.stat(p)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(f"{p}: is a symbolic link loop, not a {what} file") from None
    kind = non_regular_kind(p)
    if kind is not None:
        raise UserError(f"{p}: is {kind}, not a regular {what} file")
    if not p.exists():
        raise UserError(f"{p}: no such {what} file")
    return p


#: The largest text input read whole into memory (a TOML grid, config, profile, experiment or
#: validation table, a JSON model or preset file): far above any real one, so a wrong path
#: such as a trace or a disk image is one line instead of filling the memory.
MAX_TEXT_INPUT_BYTES = 64 * 2**20


def read_input_text(
    path: str | os.PathLike[str], what: str, max_bytes: int = MAX_TEXT_INPUT_BYTES
) -> str:
    """The UTF-8 text of the regular file ``path`` (a ``what`` file); a UserError naming the
    file when it is missing, not a regular file (a FIFO would block, a device never end),
    larger than ``max_bytes``, unreadable or not UTF-8. The one reader of every text input."""
    p = check_input_file(path, what)
    try:
        with p.open("rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise UserError(f"{p}: cannot read the {what} file: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise UserError(f"{p}: larger than {max_bytes // 2**20} MiB; not a {what} file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{p}: the {what} file is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start})"
        ) from None


def read_toml(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """A TOML input file as a dict (:func:`read_input_text`); a syntax error is a one-line
    UserError naming the file, line and column."""
    import tomllib

    text = read_input_text(path, what)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{Path(path)}: not valid TOML: {exc}") from None


def resolve_trace(name_or_path: str | os.PathLike[str] | None) -> Path:
    """A bundled trace's short name, or a path; a clear error listing bundled names."""
    if name_or_path is None:
        name_or_path = DEFAULT_TRACE
    text = str(name_or_path)
    bundled = bundled_traces()
    if text in bundled:
        return bundled[text]
    path = Path(text).expanduser()
    if os.path.lexists(path) or text.endswith(".parquet") or os.sep in text:
        return check_input_file(path, "trace")
    names = ", ".join(bundled) or "(none)"
    hint = did_you_mean(text, bundled)
    raise UserError(f"unknown trace {text!r}: not a file and not a bundled trace{hint} ({names})")
