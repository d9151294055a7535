"""Progress bars: one implementation (click's), on stderr, only on a terminal."""

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
