"""Debugging a policy of one's own: the error names the hook the author wrote (not the one the
engine called), the file and line the exception came from, ``--debug`` / ``DAOPSIM_DEBUG=1``
show the author's traceback, and a policy file named without its class suggests the form."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_checks import one_error

import daopsim
from daopsim.simulator.errors import PolicyError

BUGS = '''\
import numpy as np
from daopsim import Action, Plan, Policy


class DecodeBug(Policy):
    """Only decode_layer: the default prefill_layer calls it, and it fails."""

    name = "decode-bug"

    def decode_layer(self, view):
        return self.plan_for(view)

    def plan_for(self, view):
        return Plan(actions={int(e): Action.TEMP for e in view.experts[99:][0]})  # LINE-A


class NumpyBug(Policy):
    name = "numpy-bug"

    def decode_layer(self, view):
        bad = np.zeros((2, 2)) @ np.zeros(3)  # LINE-B
        return Plan()


class NoHooks(Policy):
    name = "no-hooks"


class SetupBug(Policy):
    name = "setup-bug"

    def setup(self, ctx):
        raise RuntimeError("placement table missing")  # LINE-C
'''

RUN = ["--trace", "ci-small", "--sequences", "1", "--no-progress", "--no-bounds"]


@pytest.fixture(scope="module")
def bugs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One bugs.py for the module: a policy name is registered once per file path."""
    folder = tmp_path_factory.mktemp("debugging")
    (folder / "bugs.py").write_text(BUGS)
    return folder


@pytest.fixture
def bugs(bugs_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """bugs.py in the current folder (the messages show its path relative to it)."""
    monkeypatch.chdir(bugs_dir)
    monkeypatch.delenv("DAOPSIM_DEBUG", raising=False)
    return bugs_dir / "bugs.py"


def _line(marker: str) -> int:
    return next(i for i, ln in enumerate(BUGS.splitlines(), 1) if marker in ln)


def test_the_error_names_the_hook_written_and_where(cli: Callable[..., Any], bugs: Path) -> None:
    line = one_error(cli("run", "--policy", "bugs.py:DecodeBug", *RUN), 2)
    # the engine called prefill_layer; the author wrote decode_layer (and a helper it calls)
    assert "decode_layer raised IndexError" in line and "prefill_layer" not in line
    assert f"(at bugs.py:{_line('LINE-A')})" in line
    assert "sequence 0, token 0, layer 0" in line


def test_an_exception_inside_a_library_points_at_the_author_s_line(
    cli: Callable[..., Any], bugs: Path
) -> None:
    line = one_error(cli("run", "--policy", "bugs.py:NumpyBug", *RUN), 2)
    assert "decode_layer raised ValueError" in line
    assert f"(at bugs.py:{_line('LINE-B')})" in line


def test_setup_faults_name_setup_and_the_line(cli: Callable[..., Any], bugs: Path) -> None:
    line = one_error(cli("run", "--policy", "bugs.py:SetupBug", *RUN), 2)
    assert "setup raised RuntimeError: placement table missing" in line
    assert f"(at bugs.py:{_line('LINE-C')})" in line


def test_a_missing_hook_is_named(cli: Callable[..., Any], bugs: Path) -> None:
    line = one_error(cli("run", "--policy", "bugs.py:NoHooks", *RUN), 2)
    assert "does not implement decode_layer" in line


def test_the_python_api_keeps_the_cause(bugs: Path) -> None:
    with pytest.raises(PolicyError, match="decode_layer raised IndexError") as info:
        daopsim.simulate(policy="bugs.py:DecodeBug", trace="ci-small", sequences=1, record=False)
    assert isinstance(info.value.__cause__, IndexError)


@pytest.mark.parametrize(
    "how", [("run", "--debug"), ("--debug", "run"), ("env",)], ids=["after", "before", "env"]
)
def test_debug_shows_the_author_s_traceback(
    cli: Callable[..., Any], bugs: Path, monkeypatch: pytest.MonkeyPatch, how: tuple[str, ...]
) -> None:
    if how == ("env",):
        monkeypatch.setenv("DAOPSIM_DEBUG", "1")
        args: tuple[str, ...] = ("run",)
    else:
        args = how
    res = cli(*args, "--policy", "bugs.py:DecodeBug", *RUN)
    assert res.exit_code == 2
    err = res.stderr
    assert "Traceback (most recent call last)" in err
    # the author's frames, by file and line, with the failing source line
    assert f'bugs.py", line {_line("LINE-A")}, in plan_for' in err
    assert "in decode_layer" in err and "view.experts[99:][0]" in err
    assert err.rstrip().splitlines()[-1].startswith("error: policy 'decode-bug'")


def test_without_debug_no_traceback(cli: Callable[..., Any], bugs: Path) -> None:
    res = cli("run", "--policy", "bugs.py:DecodeBug", *RUN)
    assert "Traceback" not in res.stderr


def test_debug_is_not_an_argument_after_a_double_dash(cli: Callable[..., Any]) -> None:
    """``--`` ends the options: a ``--debug`` after it is an argument like any other."""
    res = cli("trace", "stats", "--", "--debug")
    assert res.exit_code == 2 and "--debug" in res.stderr


def test_a_sweep_row_error_names_the_hook_and_debug_prints_the_traceback(
    bugs: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    grid = {"policies": ["bugs.py:DecodeBug", "lru"], "traces": ["ci-small"], "sequences": 1}
    df = daopsim.sweep(grid, workers=1)
    err = df.set_index("policy").loc["bugs.py:DecodeBug", "error"]
    assert "decode_layer raised IndexError" in err and "bugs.py:" in err
    assert df.set_index("policy").loc["lru", "status"] == "ok"
    monkeypatch.setenv("DAOPSIM_DEBUG", "1")
    daopsim.sweep(grid, workers=1)
    text = capfd.readouterr().err
    assert "debug: bugs.py:DecodeBug" in text and f"line {_line('LINE-A')}, in plan_for" in text


@pytest.mark.parametrize("spec", ["bugs.py", "bugs.py:", "./bugs.py"])
def test_a_policy_file_without_its_class_suggests_the_form(
    cli: Callable[..., Any], bugs: Path, spec: str
) -> None:
    line = one_error(cli("run", "--policy", spec, *RUN), 2, "PATH.py:CLASS")
    path = spec.rstrip(":")
    assert f"--policy {path}:SetupBug" in line
    assert "DecodeBug, NumpyBug, NoHooks, SetupBug" in line


def test_a_missing_policy_file_says_so(cli: Callable[..., Any], bugs: Path) -> None:
    one_error(cli("run", "--policy", "nothere.py", *RUN), 2, "no such file", "PATH.py:CLASS")
