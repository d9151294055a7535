"""Progress bars: click's on stderr on a terminal, an updating cell output in a notebook,
none elsewhere."""

from __future__ import annotations

import io
import sys

import pytest

from daopsim.simulator.progress import Progress, lazy_progress


class _Terminal(io.StringIO):
    """A stderr stand-in that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_no_bar_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(3, "sweep") as bar:
        bar.update(1, "1 failed")
        bar.update(2)
    with lazy_progress("rows", enabled=True) as progress:
        progress(1, 2)
    assert capsys.readouterr().err == ""


def test_bar_on_a_terminal_shows_label_position_and_note(monkeypatch: pytest.MonkeyPatch) -> None:
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with Progress(4, "sweep", initial=1) as bar:
        bar.update(1, "2 failed")
        bar.update(2)
    text = term.getvalue()
    assert "sweep" in text and "2 failed" in text and "4/4" in text
    bar.close()  # closing twice is harmless


def test_disabled_bars_draw_nothing_even_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with Progress(2, "capture", enabled=False) as bar:
        bar.update(2)
    with lazy_progress("sequences", enabled=False) as progress:
        progress(1, 1)
    assert term.getvalue() == ""


def test_lazy_bar_opens_on_first_call_and_closes_when_the_work_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with pytest.raises(RuntimeError), lazy_progress("rows", enabled=True) as progress:
        assert term.getvalue() == ""  # no total yet, no bar
        progress(1, 3)
        raise RuntimeError("boom")
    assert "rows" in term.getvalue() and term.getvalue().endswith("\n")


class _Handle:
    """An IPython display handle: records what each update shows."""

    def __init__(self, shown: list[dict[str, str]]) -> None:
        self.shown = shown

    def update(self, bundle: dict[str, str], raw: bool = False) -> None:
        assert raw
        self.shown.append(bundle)


def _fake_notebook(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str]]:
    """A Jupyter kernel as far as daopsim can tell: an IPython shell with a kernel, and a
    display() that returns a handle (stderr is not a terminal there)."""
    import types

    shown: list[dict[str, str]] = []
    ipython = types.ModuleType("IPython")
    shell = types.SimpleNamespace(kernel=object())
    ipython.get_ipython = lambda: shell  # type: ignore[attr-defined]
    display_mod = types.ModuleType("IPython.display")

    def display(bundle: dict[str, str], raw: bool = False, display_id: bool = False) -> _Handle:
        assert raw and display_id
        shown.append(bundle)
        return _Handle(shown)

    display_mod.display = display  # type: ignore[attr-defined]
    ipython.display = display_mod  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", display_mod)
    return shown


def test_a_notebook_gets_a_bar_in_the_cell_output(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from daopsim.simulator.progress import in_notebook

    assert not in_notebook()
    shown = _fake_notebook(monkeypatch)
    assert in_notebook()
    with Progress(4, "sweep") as bar:
        for _ in range(4):
            bar.update(1, "1 failed")
    assert capsys.readouterr().err == ""  # nothing on stderr: the bar is a display output
    last = shown[-1]
    assert last["text/plain"].startswith("sweep [") and "4/4 100%" in last["text/plain"]
    assert "1 failed" in last["text/plain"]
    assert "<progress value='4' max='4'" in last["text/html"]
    assert shown[0]["text/plain"].endswith("0/4 0%")  # drawn at once, before any step


def test_a_sweep_in_a_notebook_shows_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    import daopsim

    shown = _fake_notebook(monkeypatch)
    daopsim.sweep(
        {"policies": ["lru"], "traces": ["ci-small"], "cache_ratios": [0.25, 0.375],
         "sequences": 1},
        workers=1,
    )  # fmt: skip
    assert shown and "2/2 100%" in shown[-1]["text/plain"]
    shown.clear()
    daopsim.sweep({"policies": ["lru"], "traces": ["ci-small"], "sequences": 1}, workers=1,
                  progress=False)  # fmt: skip
    assert not shown
