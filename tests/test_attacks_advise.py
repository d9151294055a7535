"""Attack corpus: the surfaces of ``advise``, ``compare``, ``doctor``, ``--debug`` and policy
debugging. Each case once printed a traceback, gave no hint, or ended as if it had succeeded;
now each is one ``error:`` line with exit 2 (or the documented result)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_checks import one_error

import daopsim

ADVISE = ["advise", "--model", "mixtral-8x7b", "--trace", "ci-small", "--sequences", "1",
          "--workers", "1", "--no-progress"]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--hw", "rtx4090"], ["did you mean 'rtx4090-"]),
        (["--hw", "a6000-pcie4", "--policies", "daopp"], ["--policies", "did you mean 'daop'"]),
        (["--hw", "a6000-pcie4", "--dtype", "q4km"], ["did you mean"]),
        (["--hw", "a6000-pcie4", "--runtime", "llamacpp"], ["llamacpp", "llama.cpp"]),
        (["--hw", "a6000-pcie4,", "--policies", ","], ["--policies: no values"]),
        (["--hw", ",,"], ["--hw: no values"]),
        (["--hw", "a6000-pcie4,a6000-pcie4"], ["given twice"]),
        (["--hw", "a6000-pcie4", "--min-tokens-per-s", "inf"], ["--min-tokens-per-s"]),
        (["--hw", "a6000-pcie4", "--min-tokens-per-s", "0"], ["--min-tokens-per-s"]),
        (["--hw", "a6000-pcie4", "--price", "a6000-pcie4=-3"], ["--price", "non-negative"]),
        (["--hw", "a6000-pcie4", "--price", "a6000-pcie4=nan"], ["--price"]),
        (["--hw", "a6000-pcie4", "--price", "=3"], ["NAME=AMOUNT"]),
        (["--hw", "a6000-pcie4", "--policies", "nothere.py"], ["PATH.py:CLASS"]),
        (["--hw", "a6000-pcie4", "--sequences", "-2"], ["--sequences"]),
        (["--hw", "a6000-pcie4", "--sequences", "99"], []),  # more than the trace has: a row
    ],
)
def test_advise_bad_input(cli: Callable[..., Any], args: list[str], words: list[str]) -> None:
    res = cli(*ADVISE, *args)
    if not words:  # every run fails the same way: reported, not a traceback
        assert "Traceback" not in res.output + res.stderr
        return
    one_error(res, 2, *words)


HOOKS = """
import sys
from daopsim import Policy

class Quits(Policy):
    name = "quits"

    def decode_layer(self, view):
        sys.exit(0)

class Raises(Policy):
    name = "raises-base"

    def decode_layer(self, view):
        raise BaseException("not an Exception")
"""


@pytest.fixture(scope="module")
def hooks_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hooks") / "hooks.py"
    path.write_text(HOOKS)
    return path


@pytest.mark.parametrize(
    ("cls", "words"),
    [("Quits", ["SystemExit"]), ("Raises", ["BaseException", "not an Exception"])],
)
def test_a_hook_that_exits_is_a_policy_error_not_success(
    cli: Callable[..., Any], hooks_file: Path, tmp_path: Path, cls: str, words: list[str]
) -> None:
    out = tmp_path / "out"
    res = cli("run", "--policy", f"{hooks_file}:{cls}", "--trace", "ci-small", "--sequences",
              "1", "--no-progress", "-o", out)  # fmt: skip
    one_error(res, 2, "decode_layer raised", *words)
    assert not out.exists()


def test_a_sweep_keeps_the_other_rows_when_a_hook_exits(hooks_file: Path) -> None:
    df = daopsim.sweep(
        {"policies": [f"{hooks_file}:Quits", "lru"], "traces": ["ci-small"], "sequences": 1},
        workers=1,
        progress=False,
    )
    status = dict(zip(df["policy"], df["status"], strict=True))
    assert status == {f"{hooks_file}:Quits": "error", "lru": "ok"}
    assert "SystemExit" in df.set_index("policy").loc[f"{hooks_file}:Quits", "error"]


def test_ctrl_c_in_a_hook_is_still_an_interrupt(tmp_path: Path) -> None:
    path = tmp_path / "ctrlc.py"
    path.write_text(
        "from daopsim import Policy\n\nclass CtrlC(Policy):\n    name = 'ctrl-c'\n\n"
        "    def decode_layer(self, view):\n        raise KeyboardInterrupt\n"
    )
    with pytest.raises(KeyboardInterrupt):
        daopsim.simulate(policy=f"{path}:CtrlC", trace="ci-small", sequences=1, record=False)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--policies", "lru", "--model", "mixtral-8x7b", "--trace", "ci-small"], ["not both"]),
        (["--policies", "lru", "--hw", ","], ["--hw: no values"]),
        (["--policies", "lru", "--sequences", "0"], ["--sequences"]),
        (["--policies", "lru", "--policy-opt", "novalue"], ["--policy-opt"]),
        (["--policies", "lru", "--policy-opt", "nosuch.key=1"], ["nosuch"]),
        (["--policies", "lru", "--dtype", "bf17"], ["bf17"]),
    ],
)
def test_compare_bad_input(cli: Callable[..., Any], args: list[str], words: list[str]) -> None:
    one_error(cli("compare", *args, "--trace", "ci-small", "--no-progress"), 2, *words)


def test_compare_plot_onto_a_folder_is_refused_before_any_run(
    cli: Callable[..., Any], tmp_path: Path
) -> None:
    folder = tmp_path / "fig.png"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    res = cli("compare", "--policies", "lru", "--trace", "ci-small", "--plot", folder,
              "--no-progress")  # fmt: skip
    one_error(res, 3, "--plot")
    assert (folder / "keep.txt").read_text() == "mine"


def test_compare_exits_1_when_a_run_fails(cli: Callable[..., Any], hooks_file: Path) -> None:
    res = cli("compare", "--policies", f"lru,{hooks_file}:Quits", "--trace", "ci-small",
              "--sequences", "1", "--no-progress", "--json")  # fmt: skip
    assert res.exit_code == 1
    cols = json.loads(res.stdout)["columns"]
    assert [c["status"] for c in cols] == ["ok", "error"] and "SystemExit" in cols[1]["error"]


def test_debug_json_is_still_one_json_object(cli: Callable[..., Any]) -> None:
    res = cli("--debug", "run", "--policy", "lur", "--trace", "ci-small", "--json")
    assert res.exit_code == 2
    assert "did you mean 'lru'" in json.loads(res.stdout)["error"]


def test_doctor_with_an_unwritable_cache_env(
    cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DAOPSIM_CACHE", str(tmp_path / "missing" / "deeper"))
    res = cli("doctor", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["cache"]["files"] == 0
