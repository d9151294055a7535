"""Attack corpus: hostile output targets and failing file systems, through the CLI.

Every case once replaced a device node, overwrote an input, wrote outside the chosen folder,
left a mixed output set or printed a traceback. Now each exits with exactly one ``error:``
line (or one JSON object under ``--json``) and the documented code (docs/cli.md: 2 for a bad
option or input, 3 for an output that cannot be used or written), and leaves every input and
every non-regular file as it was. Device nodes, FIFOs and sockets are made inside the test's
temporary folder; no test touches /dev, /proc or anything outside it. Failing file systems
(read-only, full, permission denied) are simulated by making the writer raise.
"""

from __future__ import annotations

import errno
import gzip
import itertools
import json
import os
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pytest
from cli_checks import one_error
from click.testing import CliRunner

import daopsim.simulator.experiments
import daopsim.simulator.output
import daopsim.simulator.results
from daopsim.simulator.cli import main
from daopsim.simulator.errors import ExitCode
from daopsim.simulator.testing import make_trace, one_row_table

USAGE, OUTPUT = int(ExitCode.USAGE), int(ExitCode.OUTPUT)
_REAL_WRITE_FILE = daopsim.simulator.output.write_file


def _sweep(trace: Path | str, out: Path | str, *extra: str) -> list[str]:
    """``daopsim sweep`` of lru over one trace into ``out``."""
    return [
        "sweep",
        "--policies",
        "lru",
        "--traces",
        str(trace),
        "--no-progress",
        *extra,
        "--out",
        str(out),
    ]


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workspace with a tiny trace, a sweep results table, a grid and an experiment file."""
    root = tmp_path_factory.mktemp("attacks")
    trace = make_trace(root / "t.parquet", sequences=3, prefill=6, decode=10, seed=3)
    res = CliRunner().invoke(
        main, _sweep(trace, root / "results.parquet", "--cache-ratios", "0.5", "--workers", "1")
    )
    assert res.exit_code == 0, res.output
    (root / "exp.toml").write_text(
        'name = "tiny"\nhw = "a6000-pcie4"\ncache_ratios = [0.5]\ntarget = "lru"\n'
        f'[policies.lru]\n[[models]]\ntrace = "{trace}"\n'
    )
    # synth fit's target: stats of the model it fits (olmoe-1b-7b), from a small trace of it
    olmoe = make_trace(root / "olmoe.parquet", "olmoe-1b-7b", sequences=2, prefill=4, decode=6)
    stats = CliRunner().invoke(main, ["trace", "stats", str(olmoe), "--json", "--no-curves"])
    assert stats.exit_code == 0, stats.output
    (root / "target.json").write_text(stats.stdout)
    (root / "prompts.jsonl").write_text('{"prompt": "hello"}\n')
    return root


# --- hostile targets --------------------------------------------------------------------------


def _device(path: Path) -> Path:
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here ({exc.strerror})")
    return path


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


@pytest.fixture
def _sockets() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    yield held
    for s in held:
        s.close()


def _kind(path: Path) -> int:
    return stat.S_IFMT(os.lstat(path).st_mode)


def _no_leftovers(folder: Path) -> None:
    hidden = [p.name for p in folder.iterdir() if p.name.startswith(".") and ".new-" in p.name]
    temps = [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
    assert not hidden and not temps, (hidden, temps)


def _commands(ws: Path) -> dict[str, Callable[[Path], list[str]]]:
    """Every command that writes, as a function of its output path."""
    t = str(ws / "t.parquet")
    return {
        "run --out": lambda o: ["run", "--trace", t, "--no-progress", "--out", str(o)],
        "sweep --out": lambda o: _sweep(t, o),
        "synth -o": lambda o: ["synth", "--model", "olmoe-1b-7b", "--sequences", "1", "-o", str(o)],
        "synth fit -o": lambda o: [
            "synth",
            "fit",
            "--target",
            str(ws / "target.json"),
            "--model",
            "olmoe-1b-7b",
            "--iterations",
            "1",
            "--sequences",
            "1",
            "--prompt-tokens",
            "4",
            "--output-tokens",
            "4",
            "-o",
            str(o),
        ],
        "plot -o": lambda o: ["plot", str(ws / "results.parquet"), "-o", str(o)],
        "experiment --out": lambda o: ["experiment", str(ws / "exp.toml"), "--out", str(o)],
        "validate --out": lambda o: ["validate", "--out", str(o)],
        "validate --markdown": lambda o: ["validate", "--markdown", str(o)],
        "regress --update --baseline": lambda o: ["regress", "--update", "--baseline", str(o)],
        "capture -o": lambda o: [
            "capture",
            "--random-init",
            "mixtral",
            "--prompts",
            str(ws / "prompts.jsonl"),
            "-o",
            str(o),
        ],
    }


COMMANDS = [
    "run --out",
    "sweep --out",
    "synth -o",
    "synth fit -o",
    "plot -o",
    "experiment --out",
    "validate --out",
    "validate --markdown",
    "regress --update --baseline",
    "capture -o",
]
#: the suffix each command's output needs (so the refusal is about the target, not the name)
SUFFIX = {
    "sweep --out": ".parquet",
    "synth -o": ".parquet",
    "plot -o": ".png",
    "capture -o": ".parquet",
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("make", ["device", "fifo", "socket"])
def test_non_regular_target_is_refused_and_kept(
    ws: Path, tmp_path: Path, command: str, make: str, _sockets: list[socket.socket]
) -> None:
    target = tmp_path / f"target{SUFFIX.get(command, '.out')}"
    if make == "device":
        _device(target)
    elif make == "fifo":
        _fifo(target)
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(target))
        _sockets.append(s)
    before = _kind(target)
    res = CliRunner().invoke(main, _commands(ws)[command](target))
    one_error(res, OUTPUT, str(target))
    assert _kind(target) == before  # still the device / FIFO / socket, never replaced
    _no_leftovers(tmp_path)


@pytest.mark.parametrize("command", ["sweep --out", "synth -o", "synth fit -o", "plot -o"])
def test_directory_where_a_file_is_expected(ws: Path, tmp_path: Path, command: str) -> None:
    target = tmp_path / f"folder{SUFFIX.get(command, '.json')}"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    res = CliRunner().invoke(main, _commands(ws)[command](target))
    one_error(res, OUTPUT, "is a directory")
    assert (target / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("command", ["run --out", "experiment --out", "validate --out"])
def test_a_file_where_a_folder_is_expected(ws: Path, tmp_path: Path, command: str) -> None:
    target = tmp_path / "a-file"
    target.write_text("mine")
    res = CliRunner().invoke(main, _commands(ws)[command](target))
    one_error(res, OUTPUT, "expected a folder")
    assert target.read_text() == "mine"


@pytest.mark.parametrize("command", ["run --out", "experiment --out", "validate --out"])
def test_folder_output_never_replaces_a_folder_of_other_files(
    ws: Path, tmp_path: Path, command: str
) -> None:
    """``--out .`` or ``--out ~`` must not swap away the user's files."""
    (tmp_path / "notes.txt").write_text("mine")
    res = CliRunner().invoke(main, _commands(ws)[command](tmp_path))
    one_error(res, OUTPUT, "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_folder_output_is_never_the_current_folder(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for out in (".", str(here), str(tmp_path)):
        res = CliRunner().invoke(main, _commands(ws)["run --out"](Path(out)))
        one_error(res, OUTPUT, "current folder")
    assert list(here.iterdir()) == []


def test_parent_is_a_file(ws: Path, tmp_path: Path) -> None:
    """Like /proc/x: the folder the output would go in cannot exist."""
    blocker = tmp_path / "plain-file"
    blocker.write_text("x")
    for command in ("sweep --out", "synth -o", "run --out"):
        res = CliRunner().invoke(main, _commands(ws)[command](blocker / "sub" / "o.parquet"))
        one_error(res, OUTPUT, "not a directory")
    assert blocker.read_text() == "x"


def test_unwritable_folder(ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder we may not write (root ignores permission bits, so os.access says no)."""
    real = os.access
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(os, "access", lambda p, m, **kw: Path(p) != ro and real(p, m, **kw))
    res = CliRunner().invoke(main, _commands(ws)["synth -o"](ro / "s.parquet"))
    one_error(res, OUTPUT, "not writable")
    assert list(ro.iterdir()) == []


def test_staging_folders_of_killed_writers_are_cleaned(ws: Path, tmp_path: Path) -> None:
    """A writer killed mid-way leaves .NAME.new-<pid>-*; the next write removes it (its pid is
    gone) but never a live writer's."""
    out = tmp_path / "out"
    dead = tmp_path / ".out.new-999999999-abc"  # no such pid
    live = tmp_path / f".out.new-{os.getpid()}-xyz"
    for d in (dead, live):
        d.mkdir()
        (d / "metrics.json").write_text("{}")
    res = CliRunner().invoke(
        main, ["run", "--trace", str(ws / "t.parquet"), "--no-progress", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert not dead.exists() and live.exists()
    assert json.loads((out / "metrics.json").read_text())["metrics"]


def test_folder_output_through_a_symlink_keeps_the_link(ws: Path, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    res = CliRunner().invoke(
        main, ["run", "--trace", str(ws / "t.parquet"), "--no-progress", "--out", str(link)]
    )
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and (real / "metrics.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


# --- inputs are never outputs -----------------------------------------------------------------


def test_sweep_output_is_its_input_trace(ws: Path, tmp_path: Path) -> None:
    trace = make_trace(tmp_path / "t.parquet", sequences=2, seed=1)
    before = trace.read_bytes()
    res = CliRunner().invoke(main, _sweep(trace, trace))
    one_error(res, OUTPUT, "is also an input")
    assert trace.read_bytes() == before
    assert not (tmp_path / "t.parquet.parts").exists()


def test_output_is_an_input_through_a_hard_link(ws: Path, tmp_path: Path) -> None:
    target = tmp_path / "target.json"
    target.write_text((ws / "target.json").read_text())
    before = target.read_bytes()
    link = tmp_path / "link.json"
    os.link(target, link)
    res = CliRunner().invoke(main, ["synth", "fit", "--target", str(target), "-o", str(link)])
    one_error(res, OUTPUT, "is also an input")
    assert target.read_bytes() == before


def test_run_output_folder_holding_the_input_trace(ws: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    trace = make_trace(out / "timeline.parquet", sequences=2, seed=1)  # a name run writes
    before = trace.read_bytes()
    res = CliRunner().invoke(
        main, ["run", "--trace", str(trace), "--no-progress", "--out", str(out)]
    )
    one_error(res, OUTPUT, "contains an input")
    assert trace.read_bytes() == before


def test_grid_file_out_is_the_grid_file(ws: Path, tmp_path: Path) -> None:
    grid = tmp_path / "g.parquet"  # an odd name, but the grid's 'out' points at the grid itself
    grid.write_text(f'policies = ["lru"]\ntraces = ["{ws / "t.parquet"}"]\nout = "g.parquet"\n')
    before = grid.read_bytes()
    res = CliRunner().invoke(main, ["sweep", str(grid), "--no-progress"])
    one_error(res, OUTPUT, "is also an input")
    assert grid.read_bytes() == before


def _model_file(path: Path) -> Path:
    """A valid learned-policy model file at ``path`` (whatever its name says)."""
    from daopsim.policies.learned import BUNDLED_MODEL

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(BUNDLED_MODEL.read_bytes())
    return path


def _learned_cases(ws: Path, tmp: Path) -> dict[str, tuple[Path, list[str]]]:
    """Each way of naming a file as a policy option and as an output: (the file, argv)."""
    t = str(ws / "t.parquet")
    run = ["run", "--policy", "learned", "--trace", t, "--no-progress", "--no-bounds"]
    folder, csv = tmp / "o", tmp / "m.csv"
    inside = folder / "metrics.json"
    grid, config = tmp / "g.toml", tmp / "c.toml"
    grid.write_text(
        f'policies = ["learned"]\ntraces = ["{t}"]\ncache_ratios = [0.5]\n'
        f'[options]\n"learned.model" = "{csv}"\n'
    )
    config.write_text(f'policies = ["learned"]\ntraces = ["{t}"]\n[options]\nmodel = "{inside}"\n')
    opt = ["--policy-opt", f"model={csv}"]
    return {
        "run --out (folder holds it)": (
            inside,
            [*run, "--policy-opt", f"model={inside}", "--out", str(folder)],
        ),
        "run --requests-out": (csv, [*run, *opt, "--max-batch", "2", "--requests-out", str(csv)]),
        "sweep --out": (csv, _sweep(t, csv, "--policy-opt", f"learned.model={csv}")),
        "sweep grid option": (csv, ["sweep", str(grid), "--no-progress", "-o", str(csv)]),
        "run --config option": (
            inside,
            ["run", "--config", str(config), "--no-progress", "--no-bounds", "-o", str(folder)],
        ),
    }


@pytest.mark.parametrize(
    "case",
    ["run --out (folder holds it)", "run --requests-out", "sweep --out", "sweep grid option",
     "run --config option"],
)  # fmt: skip
def test_a_file_a_policy_option_names_is_an_input(ws: Path, tmp_path: Path, case: str) -> None:
    model, argv = _learned_cases(ws, tmp_path)[case]
    _model_file(model)
    before = model.read_bytes()
    res = CliRunner().invoke(main, argv)
    one_error(res, OUTPUT, "input")
    assert model.read_bytes() == before


def test_the_config_file_is_an_input(ws: Path, tmp_path: Path) -> None:
    out = tmp_path / "c"
    out.mkdir()
    config = out / "metrics.json"  # a name `run --out` writes, holding a run config
    config.write_text(f'policies = ["lru"]\ntraces = ["{ws / "t.parquet"}"]\nsequences = 1\n')
    before = config.read_bytes()
    argv = ["run", "--config", str(config), "--no-progress", "--no-bounds", "--out", str(out)]
    one_error(CliRunner().invoke(main, argv), OUTPUT, "contains an input", str(config))
    assert config.read_bytes() == before


def test_validate_markdown_never_drops_rows_of_the_page(tmp_path: Path) -> None:
    from daopsim.simulator.data import bundled_dir

    repo = Path(__file__).resolve().parent.parent
    page = tmp_path / "validation.md"
    page.write_bytes((repo / "docs" / "validation.md").read_bytes())  # the committed page
    before = page.read_bytes()
    published = (bundled_dir("validation") / "published.toml").read_text()
    one_row = tmp_path / "one_row.toml"
    one_row.write_text("[[row]]" + published.split("[[row]]")[1])  # the first row alone
    res = CliRunner().invoke(
        main, ["validate", "--table", str(one_row), "--markdown", str(page), "--no-progress"]
    )
    one_error(res, USAGE, "--markdown", "would drop them", "--out")
    assert page.read_bytes() == before
    # the --rows refusal no longer recommends this
    res = CliRunner().invoke(
        main, ["validate", "--rows", "x", "--markdown", str(page), "--no-progress"]
    )
    assert "--table" not in one_error(res, USAGE, "--out DIR")


@pytest.mark.parametrize("name", ["results.parquet", "results.json", "notes.json"])
def test_regress_update_replaces_only_a_store(ws: Path, tmp_path: Path, name: str) -> None:
    grid = tmp_path / "grid.toml"
    grid.write_text(
        f'trace = "{ws / "t.parquet"}"\npolicies = ["lru"]\nprofiles = ["a6000-pcie4"]\n'
        "sequences = 1\ncache_ratios = [0.5]\n"
    )
    target = tmp_path / name
    if name == "notes.json":
        target.write_text('{"format": "something else"}\n')
    else:
        target.write_bytes((ws / "results.parquet").read_bytes())  # a sweep table
    before = target.read_bytes()
    argv = ["regress", "--grid", str(grid), "--update", "--baseline", str(target), "--no-progress"]
    res = CliRunner().invoke(main, argv)
    one_error(res, USAGE if name.endswith(".parquet") else OUTPUT, "--baseline")
    assert target.read_bytes() == before
    store = tmp_path / "store.json"  # a store is written, and rewritten
    for _ in range(2):
        argv[-2] = str(store)
        assert CliRunner().invoke(main, argv).exit_code == 0
    assert json.loads(store.read_text())["format"].startswith("daopsim-regress/")


def test_an_empty_axis_never_replaces_a_results_table(ws: Path, tmp_path: Path) -> None:
    """``seeds = []`` once expanded to no configuration and replaced the table with a header."""
    table = tmp_path / "r.csv"
    first = CliRunner().invoke(main, _sweep(ws / "t.parquet", table, "--workers", "1"))
    assert first.exit_code == 0, first.output
    before = table.read_bytes()
    grid = tmp_path / "g.toml"
    grid.write_text(f'policies = ["lru"]\ntraces = ["{ws / "t.parquet"}"]\nseeds = []\n')
    res = CliRunner().invoke(main, ["sweep", str(grid), "--no-progress", "-o", str(table)])
    one_error(res, USAGE, "g.toml", "'seeds' is an empty list")
    assert table.read_bytes() == before


# --- names from files -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../x", "/tmp/abs", ".hidden", "a/b", ".."])
def test_experiment_name_cannot_leave_the_working_folder(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    exp = deep / "evil.toml"
    exp.write_text((ws / "exp.toml").read_text().replace('name = "tiny"', f"name = {name!r}"))
    monkeypatch.chdir(deep)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    res = CliRunner().invoke(main, ["experiment", str(exp)])
    one_error(res, USAGE, "experiment name", "names an output folder")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


# --- failing file systems ---------------------------------------------------------------------


def _raise_after(n: int, err: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file write after the first ``n`` fails with ``err`` (a disk filling up)."""
    real = _REAL_WRITE_FILE
    calls = [0]

    def failing_os(path, write, flag=None):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] > n:

            def broken(tmp: str) -> None:
                raise OSError(err, os.strerror(err))

            return real(path, broken, flag)
        return real(path, write, flag)

    # every module that bound write_file at import (imported above, before any patch)
    for mod in (daopsim.simulator.output, daopsim.simulator.results, daopsim.simulator.experiments):
        monkeypatch.setattr(mod, "write_file", failing_os)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_full_disk_during_run_out_keeps_the_previous_set(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    t = str(ws / "t.parquet")
    first = CliRunner().invoke(main, ["run", "--policy", "lru", "--trace", t, "--out", str(out)])
    assert first.exit_code == 0, first.output
    before = _snapshot(out)
    _raise_after(1, errno.ENOSPC, monkeypatch)  # metrics.json fits, the timeline does not
    res = CliRunner().invoke(main, ["run", "--policy", "static", "--trace", t, "--out", str(out)])
    one_error(res, OUTPUT, str(out), "No space left on device")
    assert _snapshot(out) == before  # the old set, whole: no new metrics beside old plots
    _no_leftovers(tmp_path)


def test_full_disk_on_a_new_run_out_leaves_nothing(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "new"
    _raise_after(2, errno.ENOSPC, monkeypatch)
    res = CliRunner().invoke(
        main, ["run", "--trace", str(ws / "t.parquet"), "--no-progress", "--out", str(out)]
    )
    one_error(res, OUTPUT, "No space left on device")
    assert not out.exists()
    _no_leftovers(tmp_path)


def test_full_disk_during_experiment_keeps_the_previous_set(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "exp"
    first = CliRunner().invoke(main, ["experiment", str(ws / "exp.toml"), "--out", str(out)])
    assert first.exit_code == 0, first.output
    (out / "summary.txt").write_text("the old set\n")  # so old and new differ
    before = _snapshot(out)
    _raise_after(2, errno.ENOSPC, monkeypatch)
    res = CliRunner().invoke(main, ["experiment", str(ws / "exp.toml"), "--out", str(out)])
    one_error(res, OUTPUT, "No space left on device")
    assert _snapshot(out) == before


def test_failing_disk_during_validate_keeps_its_outputs(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["validate", "--rows", "fiddler-a6000-mixtral-offloading", "--sequences", "1"]
    out, md = tmp_path / "val", tmp_path / "doc.md"
    md.write_text("# doc\n<!-- validation-table:start -->\n<!-- validation-table:end -->\n")
    first = CliRunner().invoke(main, [*args, "--no-progress", "--out", str(out)])
    assert first.exit_code == 0, first.output
    (out / "validation.md").write_text("the old set\n")
    before, md_before = _snapshot(out), md.read_bytes()
    _raise_after(1, errno.ENOSPC, monkeypatch)
    res = CliRunner().invoke(main, [*args, "--no-progress", "--out", str(out)])
    one_error(res, OUTPUT, str(out), "No space left on device")
    assert _snapshot(out) == before
    _raise_after(0, errno.EROFS, monkeypatch)
    # --markdown writes a whole table: a one-row table file, not --rows
    table = one_row_table(tmp_path / "one.toml", "fiddler-a6000-mixtral-offloading")
    res = CliRunner().invoke(
        main, ["validate", "--table", str(table), "--no-progress", "--markdown", str(md)]
    )
    one_error(res, OUTPUT, str(md), "Read-only file system")
    assert md.read_bytes() == md_before
    _no_leftovers(tmp_path)


@pytest.mark.parametrize(
    ("err", "words"),
    [
        (errno.EROFS, "Read-only file system"),
        (errno.ENOSPC, "No space left on device"),
        (errno.EACCES, "Permission denied"),
    ],
)
@pytest.mark.parametrize("command", ["sweep --out", "plot -o", "synth fit -o"])
def test_os_errors_are_one_line_with_exit_3(
    ws: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    err: int,
    words: str,
) -> None:
    target = tmp_path / f"o{SUFFIX.get(command, '.json')}"
    if command == "plot -o":
        target.write_bytes(b"old figure")
    _raise_after(0, err, monkeypatch)
    res = CliRunner().invoke(main, _commands(ws)[command](target))
    one_error(res, OUTPUT, str(target), words)
    if command == "plot -o":
        assert target.read_bytes() == b"old figure"
    else:
        assert not target.exists()
    _no_leftovers(tmp_path)


def test_unexpected_os_error_is_still_one_line(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError no command anticipated (here while reading the trace) is exit 3, no trace."""

    def broken(*_a: object, **_k: object) -> None:
        raise OSError(errno.EIO, "Input/output error", str(ws / "t.parquet"))

    monkeypatch.setattr("daopsim.simulator.runner.read_meta", broken)
    res = CliRunner().invoke(main, ["run", "--trace", str(ws / "t.parquet"), "--no-progress"])
    one_error(res, OUTPUT, "t.parquet", "Input/output error")


# --- --json errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (lambda ws, tmp: ["run", "--bogus-option"], USAGE),
        (lambda ws, tmp: ["run", "--policy", "nope"], USAGE),
        (
            lambda ws, tmp: ["sweep", "--policies", "lru", "--out", str(_fifo(tmp / "f.parquet"))],
            OUTPUT,
        ),
        (lambda ws, tmp: ["plot", str(tmp / "missing.parquet")], USAGE),
        (lambda ws, tmp: ["experiment", str(tmp / "missing.toml")], USAGE),
        (lambda ws, tmp: ["trace", "stats", str(tmp / "missing.parquet")], USAGE),
    ],
)
def test_json_errors_are_one_json_object_on_stdout(
    ws: Path, tmp_path: Path, args: Callable[[Path, Path], list[str]], code: int
) -> None:
    res = CliRunner().invoke(main, [*args(ws, tmp_path), "--json"])
    assert res.exit_code == code, (res.stdout, res.stderr)
    assert "Traceback" not in res.output + res.stderr
    doc = json.loads(res.stdout)
    assert set(doc) == {"error", "exit_code"} and doc["exit_code"] == code
    assert doc["error"] and "\n" not in doc["error"]
    assert not res.stderr.strip()


# --- formats follow the suffix ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("suffix", "magic"), [(".png", b"\x89PNG"), (".pdf", b"%PDF"), (".svg", b"<?xml")]
)
def test_plot_format_follows_the_suffix(
    ws: Path, tmp_path: Path, suffix: str, magic: bytes
) -> None:
    target = tmp_path / f"fig{suffix}"
    res = CliRunner().invoke(
        main, ["plot", str(ws / "results.parquet"), "--no-compute-bound", "-o", str(target)]
    )
    assert res.exit_code == 0, res.output
    assert target.read_bytes().startswith(magic)
    _no_leftovers(tmp_path)


def test_sweep_csv_is_csv_and_plots(ws: Path, tmp_path: Path) -> None:
    out = tmp_path / "res.csv"
    res = CliRunner().invoke(main, _commands(ws)["sweep --out"](out))
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out)
    assert list(df["policy"]) == ["lru"] and (df["status"] == "ok").all()
    heat = tmp_path / "heat.png"
    res = CliRunner().invoke(main, ["plot", str(out), "--kind", "heatmap", "-o", str(heat)])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    "args",
    [
        lambda ws, tmp: ["plot", str(ws / "results.parquet"), "-o", str(tmp / "x.gif")],
        lambda ws, tmp: ["plot", str(ws / "results.parquet"), "-o", str(tmp / "noext")],
        lambda ws, tmp: _sweep(ws / "t.parquet", tmp / "r.txt"),
    ],
)
def test_unknown_suffix_is_refused(
    ws: Path, tmp_path: Path, args: Callable[[Path, Path], list[str]]
) -> None:
    res = CliRunner().invoke(main, args(ws, tmp_path))
    one_error(res, USAGE, "use one of")
    assert list(tmp_path.iterdir()) == []


# --- Perfetto ---------------------------------------------------------------------------------


def test_perfetto_is_gzipped_and_slices_never_overlap_on_a_track(ws: Path, tmp_path: Path) -> None:
    from daopsim.simulator.runner import simulate

    r = simulate(policy="fiddler", trace=ws / "t.parquet", cache_ratio=0.5)
    path = r.to_perfetto(tmp_path / "p.json.gz")
    with gzip.open(path) as fh:
        doc = json.load(fh)
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert len(spans) == len(r.timeline)
    by_lane: dict[int, list[tuple[float, float]]] = {}
    for e in spans:
        by_lane.setdefault(e["tid"], []).append((e["ts"], e["dur"]))
    for lane in by_lane.values():
        lane.sort()
        for (ts, dur), (nxt, _) in itertools.pairwise(lane):
            assert ts + dur <= nxt  # float arithmetic, as a JavaScript viewer does it
            # Perfetto's importer truncates ts * 1000 to integer nanoseconds
            assert int(ts * 1000) + int(dur * 1000) <= int(nxt * 1000)
    # the same run gives the same bytes (fixed gzip header time)
    assert r.to_perfetto(tmp_path / "q.json.gz").read_bytes() == path.read_bytes()
