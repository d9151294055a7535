"""Safe output: every file or folder a daopsim command writes goes through this module.

The rules (docs/cli.md, "Outputs"):

* An existing target is replaced only when it is of the kind expected: a regular file for a
  file output, a folder holding only files daopsim writes there for a folder output. Devices,
  FIFOs, sockets and directories in place of a file are refused, never replaced.
* An output may not be one of the same command's inputs (``sweep --traces t.parquet --out
  t.parquet``), and a folder output may not contain one. Two outputs of one command may not be
  the same file, and no output may lie inside another's folder (:func:`check_outputs`).
* A path through a symbolic link loop is refused with one line, never a ``RuntimeError``.
* A file is written to a temporary name in its folder and renamed over the target; a folder
  output is built as a new sibling folder and swapped in whole, so a reader sees the old set or
  the new set, never a mix, and a failure half way leaves the old set intact.
* Every ``OSError`` (missing parent, read-only file system, disk full, permission denied) is an
  :class:`~daopsim.simulator.errors.OutputError`: one line naming the path, exit code 3.
* The file format follows the suffix (:func:`output_format`); an unknown suffix is refused.
* Names read from files (an experiment's ``name``) become paths only via :func:`safe_name`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daopsim.simulator.errors import OutputError, UserError

PathLike = str | os.PathLike[str]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def _where(path: PathLike, flag: str | None) -> str:
    return f"{flag} {path}" if flag else str(path)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def describe_os_error(exc: OSError, path: PathLike) -> str:
    """The reason part of an OSError, naming the other file when it is not ``path``."""
    detail = exc.strerror or str(exc) or type(exc).__name__
    other = exc.filename
    if other is None or os.fspath(other) == os.fspath(path):
        return detail
    if Path(os.fspath(other)).name.startswith(f".{Path(path).name}."):
        return detail  # our own temporary or staging name says nothing to the user
    return f"{detail} ({os.fspath(other)})"


@contextlib.contextmanager
def os_errors(path: PathLike, flag: str | None = None) -> Iterator[None]:
    """Re-raise any OSError from the block as an OutputError about ``path`` (exit code 3)."""
    try:
        yield
    except OutputError:
        raise
    except OSError as exc:
        raise OutputError(
            f"{_where(path, flag)}: cannot write: {describe_os_error(exc, path)}"
        ) from None


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None  # a parent is a file: reported by the folder check
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None  # a link loop: reported by the folder check, with the flag
        raise


def _loop_error(where: str) -> OutputError:
    return OutputError(f"{where}: is a symbolic link loop, or runs through one")


def resolved(path: PathLike, where: str | None = None) -> Path:
    """``path`` made absolute with every symbolic link followed; a link loop is an
    :class:`OutputError` naming ``where`` (``Path.resolve`` raises ``RuntimeError`` there)."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError):
        raise _loop_error(where or str(path)) from None


def _nearest_existing(p: Path) -> Path:
    probe = p
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe


def _check_parent(target: Path, where: str) -> None:
    resolved(target, where)  # a loop anywhere on the way is refused here, in one line
    probe = _nearest_existing(target.parent)
    if not probe.is_dir():
        raise OutputError(f"{where}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{where}: cannot write: {probe} is not writable")
    # os.access only reads permission bits, which root passes everywhere, also on a file system
    # that refuses every new entry (/sys, a read-only mount): create and remove an entry named
    # like a staging folder (so one left by a kill is cleaned by the next write), before any work
    try:
        os.rmdir(
            tempfile.mkdtemp(prefix=_STAGE.format(name=target.name, pid=os.getpid()), dir=probe)
        )
    except OSError as exc:
        raise OutputError(
            f"{where}: cannot write in {probe}: {describe_os_error(exc, target)}"
        ) from None


def _same(a: Path, b: Path) -> bool:
    """The same file: by inode when both exist (hard links too), else by resolved path."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return _lenient(a) == _lenient(b)


def _lenient(p: Path) -> Path:
    """``p`` resolved, or made absolute when a link loop stops that (an input through a loop
    cannot be read, and the reader says so; it cannot be the same file as an output)."""
    try:
        return p.resolve()
    except (RuntimeError, OSError):
        return Path(os.path.abspath(p))


def _inputs(inputs: Iterable[PathLike | None], outputs: Collection[str] = ()) -> list[Path]:
    """The existing paths among ``inputs`` and every path the running command's own options
    and arguments name (:func:`command_line_paths`), except its outputs' (flags ``outputs``)."""
    given = [*inputs, *command_line_paths(outputs)]
    # only existing files can be clobbered; a bundled name such as "a6000-pcie4" is no path
    return [Path(p) for p in given if p is not None and str(p) != "" and os.path.lexists(p)]


def _path_forms(text: str) -> Iterator[str]:
    """The paths a command-line value may name: itself, each comma-separated item, the value
    of a ``key=value`` item (``--policy-opt model=m.json``) and the file of ``FILE.py:CLASS``."""
    for item in {text, *text.split(",")}:
        item = item.strip()
        yield item
        _key, sep, value = item.partition("=")
        if sep:
            yield from (v.strip() for v in value.split(","))
        path, sep, _cls = item.rpartition(":")
        if sep and path:
            yield path


def value_paths(value: Any) -> list[str]:
    """Every path-like string in ``value`` (a string, a path, or lists, tuples and mappings
    of them, such as a policy's options read from a grid or experiment file), in the forms
    :func:`_path_forms` gives; whether each exists is checked by the caller."""
    if isinstance(value, str | os.PathLike):
        return list(_path_forms(os.fspath(value)))
    if isinstance(value, Mapping):
        return [p for v in value.values() for p in value_paths(v)]
    if isinstance(value, list | tuple | set | frozenset):
        return [p for v in value for p in value_paths(v)]
    return []


def command_line_paths(outputs: Collection[str] = ()) -> list[str]:
    """Every path the running ``daopsim`` command was given, by any option or argument except
    the output options named in ``outputs`` (their flags, such as ``--out``): the inputs of
    the command whatever it reads them for (a ``--config`` file, a learned policy's
    ``--policy-opt model=FILE``, a ``--policy FILE.py:CLASS``). Empty outside a command."""
    import click

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return []
    out: list[str] = []
    for param in ctx.command.params:
        if param.name is None or any(flag in param.opts for flag in outputs):
            continue
        out += value_paths(ctx.params.get(param.name))
    return out


def check_output_file(
    path: PathLike,
    flag: str | None = None,
    inputs: Iterable[PathLike | None] = (),
) -> Path:
    """Before any work: ``path`` can become a regular file that no input of the command is.

    Refuses an existing non-regular target (directory, device, FIFO, socket), an input of the
    same command, and a folder that is missing and cannot be created or is not writable.
    """
    target = Path(path)
    where = _where(path, flag)
    st = _stat(target)
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise OutputError(f"{where}: is a directory, expected a file path")
        if not stat.S_ISREG(st.st_mode):
            raise OutputError(f"{where}: is {_kind(st.st_mode)}; refusing to replace it")
    for inp in _inputs(inputs, (flag,) if flag else ()):
        if _same(target, inp):
            raise OutputError(f"{where}: is also an input of this command; choose another path")
    _check_parent(target, where)
    return target


def check_output_dir(
    path: PathLike,
    names: Collection[str],
    flag: str | None = None,
    inputs: Iterable[PathLike | None] = (),
) -> Path:
    """Before any work: ``path`` can become a folder of ``names`` (swapped in whole later).

    An existing folder may hold only files matching ``names`` (file names or glob patterns: a
    previous output set, or files derived from it), since the swap replaces the folder as a
    whole; an input of the command may not be inside it.
    """
    target = Path(path)
    where = _where(path, flag)
    real = resolved(target, where)
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        # swapping it would pull the folder out from under this process and the user's shell
        raise OutputError(f"{where}: is the current folder or holds it; choose a subfolder")
    st = _stat(target)
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise OutputError(
                f"{where}: is {_kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else 'a file'}"
                ", expected a folder"
            )
        try:
            foreign = sorted(
                p.name
                for p in target.iterdir()
                if not any(fnmatch.fnmatchcase(p.name, pattern) for pattern in names)
            )
        except OSError as exc:
            raise OutputError(f"{where}: cannot read: {describe_os_error(exc, target)}") from None
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise OutputError(
                f"{where}: holds files this command does not write ({shown}); the folder is "
                "replaced as a whole, so choose a new or empty folder"
            )
    for inp in _inputs(inputs, (flag,) if flag else ()):
        r = _lenient(inp)
        if r == real or real in r.parents:
            raise OutputError(f"{where}: contains an input of this command ({inp})")
    _check_parent(target, where)
    return target


@dataclass(frozen=True)
class Output:
    """One output of a command, for :func:`check_outputs`: a file (``names`` None) or a folder
    of ``names`` (file names or glob patterns) that is replaced as a whole."""

    path: PathLike
    flag: str | None = None
    names: Collection[str] | None = None

    @property
    def where(self) -> str:
        """How errors name it: the flag and the path."""
        return _where(self.path, self.flag)


def check_outputs(
    outputs: Iterable[Output | None], inputs: Iterable[PathLike | None] = ()
) -> list[Path]:
    """Before any work: every output of one command, checked alone and against each other.

    Each passes :func:`check_output_file` or :func:`check_output_dir` (never an input, never a
    special file, never through a link loop); and no two collide: two outputs may not be the
    same file, and nothing may be written inside a folder output (that folder is replaced as a
    whole, so the other output would vanish with the old set, or stop the next run). ``None``
    entries (options not given) are skipped. Returns the checked paths in order.
    """
    given = [o for o in outputs if o is not None]
    ins = list(inputs)
    real = [_lenient(Path(o.path)) for o in given]
    for i, a in enumerate(given):
        for j, b in enumerate(given):
            if i == j:
                continue
            if i < j and real[i] == real[j]:
                raise OutputError(f"{b.where}: is also {a.where}; give each output its own path")
            if b.names is not None and real[j] in real[i].parents:
                raise OutputError(
                    f"{a.where}: is inside {b.where}, a folder this command replaces as a "
                    "whole; choose a path outside it"
                )
    paths = []
    for o in given:
        if o.names is None:
            paths.append(check_output_file(o.path, o.flag, ins))
        else:
            paths.append(check_output_dir(o.path, o.names, o.flag, ins))
    return paths


def refuse_non_regular(target: Path, where: str) -> None:
    """An OutputError when ``target`` exists and is not a regular file (checked just before a
    rename, which would otherwise replace a device node, FIFO or socket)."""
    st = _stat(target)
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise OutputError(f"{where}: is a directory, expected a file path")
        raise OutputError(f"{where}: is {_kind(st.st_mode)}; refusing to replace it")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_file(path: PathLike, write: Callable[[str], None], flag: str | None = None) -> Path:
    """Call ``write(tmp)`` for a temporary file beside ``path``, then rename it into place.

    A non-regular target is refused (checked again here, not only before the work), no partial
    file is ever visible, and an OSError becomes an OutputError naming ``path``.
    """
    target = Path(path)
    where = _where(path, flag)
    refuse_non_regular(target, where)
    with os_errors(path, flag):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        try:
            write(tmp)
            # mkstemp creates 0600; give the file the permissions a plain open() would
            os.chmod(tmp, 0o666 & ~_umask())
            refuse_non_regular(target, where)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def write_text(path: PathLike, text: str, flag: str | None = None) -> Path:
    """Write text (UTF-8) atomically; see :func:`write_file`."""

    def _w(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)

    return write_file(path, _w, flag)


#: Figure formats by file suffix (matplotlib ``savefig`` format names).
FIGURE_FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg"}
#: Table formats by file suffix.
TABLE_FORMATS = {".parquet": "parquet", ".csv": "csv"}
#: Routing traces are Parquet only (``synth -o``, ``trace import -o``, ``capture -o``).
TRACE_FORMATS = {".parquet": "parquet"}


def output_format(path: PathLike, formats: Mapping[str, str], flag: str | None = None) -> str:
    """The format named by ``path``'s suffix, or an OutputError listing the suffixes allowed."""
    suffix = Path(path).suffix.lower()
    if suffix not in formats:
        valid = ", ".join(formats)
        got = f"suffix {suffix!r}" if suffix else "no suffix"
        raise UserError(f"{_where(path, flag)}: {got}; use one of {valid}")
    return formats[suffix]


def write_figure(fig: Any, path: PathLike, dpi: int = 120, flag: str | None = None) -> Path:
    """Write a matplotlib figure atomically in the format of the suffix, then close it."""
    import matplotlib.pyplot as plt

    try:
        fmt = output_format(path, FIGURE_FORMATS, flag)
        return write_file(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=fmt), flag)
    finally:
        plt.close(fig)


def write_table(df: Any, path: PathLike, flag: str | None = None) -> Path:
    """Write a DataFrame atomically as Parquet or CSV, chosen by the suffix."""
    fmt = output_format(path, TABLE_FORMATS, flag)
    if fmt == "csv":
        return write_file(path, lambda tmp: df.to_csv(tmp, index=False), flag)
    return write_file(path, lambda tmp: df.to_parquet(tmp, index=False), flag)


_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def safe_name(name: str, what: str) -> str:
    """``name`` when it is one plain file-name component, else a UserError saying why.

    Names read from files become folder names; ``../x``, ``/abs`` or hidden names would write
    outside the place the user chose.
    """
    if not _SAFE.fullmatch(name) or name in (".", ".."):
        raise UserError(
            f"{what} {name!r}: must be letters, digits, '.', '_' or '-' and not start with "
            "'.' or '-' (it names an output folder)"
        )
    return name


# --- folder outputs ---------------------------------------------------------------------------

_STAGE = ".{name}.new-{pid}-"


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False when unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False  # this file system cannot exchange: fall back to two renames
    raise OSError(err, os.strerror(err), os.fspath(b))


def _swap_in(stage: Path, target: Path) -> None:
    """Put ``stage`` at ``target``; the old folder (if any) is removed afterwards."""
    if not target.exists():
        os.rename(stage, target)
        return
    if _exchange(stage, target):
        shutil.rmtree(stage, ignore_errors=True)  # now holds the old set
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rmdir(old)
    os.rename(target, old)
    try:
        os.rename(stage, target)
    except OSError:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_stages(target: Path) -> None:
    """Staging folders of killed writers (their pid is gone) are removed."""
    prefix = f".{target.name}.new-"
    with contextlib.suppress(OSError):
        for p in target.parent.iterdir():
            if not p.name.startswith(prefix):
                continue
            pid = p.name[len(prefix) :].split("-", 1)[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def _named_for_target(stage: Path, target: Path) -> Iterator[None]:
    """Errors about a file in the staging folder name the file where the user will look."""
    try:
        yield
    except OutputError as exc:
        raise OutputError(str(exc).replace(str(stage), str(target))) from None


@contextlib.contextmanager
def output_dir(
    path: PathLike,
    names: Collection[str],
    flag: str | None = None,
    inputs: Iterable[PathLike | None] = (),
) -> Iterator[Path]:
    """Yield a new staging folder; on success it replaces ``path`` as a whole.

    Write every file of the set into the yielded folder. If the block raises, the staging
    folder is removed and ``path`` is untouched; OSErrors become OutputErrors.
    """
    target = check_output_dir(path, names, flag, inputs)
    if target.is_symlink():
        # update the folder the link points at, keep the link
        target = resolved(target, _where(path, flag))
    with os_errors(path, flag):
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_stages(target)
        stage = Path(
            tempfile.mkdtemp(
                prefix=_STAGE.format(name=target.name, pid=os.getpid()), dir=target.parent
            )
        )
    try:
        with _named_for_target(stage, target), os_errors(path, flag):
            os.chmod(stage, 0o777 & ~_umask())
            yield stage
            _swap_in(stage, target)
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)


@contextlib.contextmanager
def scratch_dir(path: PathLike, flag: str | None = None) -> Iterator[Path]:
    """A new hidden folder beside the folder output ``path``, removed on exit: for files made
    during a run that end up in the output (a streamed timeline). Named like a staging folder,
    so one left by a killed process is removed by the next write of ``path``."""
    target = Path(path)
    with os_errors(path, flag):
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(
            tempfile.mkdtemp(
                prefix=_STAGE.format(name=target.name, pid=os.getpid()), dir=target.parent
            )
        )
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


__all__ = [
    "FIGURE_FORMATS",
    "TABLE_FORMATS",
    "TRACE_FORMATS",
    "Output",
    "check_output_dir",
    "check_output_file",
    "check_outputs",
    "describe_os_error",
    "os_errors",
    "output_dir",
    "output_format",
    "refuse_non_regular",
    "resolved",
    "safe_name",
    "scratch_dir",
    "write_figure",
    "write_file",
    "write_table",
    "write_text",
]
