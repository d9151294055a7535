"""Progress bars: on a terminal, click's bar on stderr; in a Jupyter notebook, a text bar in
the cell's output, updated in place; anywhere else (a pipe, a file, a CI log) none at all.

``Progress`` is a bar with a known total (sweep, capture, advise); ``lazy_progress`` opens one
on the first ``progress(done, total, ...)`` callback (run, validate), when the total becomes
known. The notebook bar needs nothing beyond IPython, which every Jupyter kernel has (no
widget library: it is one display output whose text and HTML ``<progress>`` are replaced).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import click


def on_terminal() -> bool:
    """Whether stderr is an interactive terminal (where click's bar is drawn)."""
    return sys.stderr.isatty()


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (an IPython shell with a kernel), where a bar is
    a cell output. Plain IPython in a terminal is not one (its stderr is a terminal)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:
        return False
    return shell is not None and getattr(shell, "kernel", None) is not None


def shows_progress() -> bool:
    """Whether a bar would be drawn here: on a terminal or in a notebook."""
    return on_terminal() or in_notebook()


class _NotebookBar:
    """A bar in a notebook cell's output: one display (text and an HTML ``<progress>``)
    replaced in place, at most every :data:`EVERY_S` seconds and at the end."""

    EVERY_S = 0.25

    def __init__(self, total: int, label: str, initial: int) -> None:
        from IPython.display import display

        self.total, self.label, self.done = max(0, total), label, initial
        self.note: str | None = None
        self.start = self.shown = time.monotonic()
        self.handle = display(self.bundle(), raw=True, display_id=True)

    def bundle(self) -> dict[str, str]:
        import html

        total = max(1, self.total)
        share = min(1.0, self.done / total)
        filled = round(28 * share)
        elapsed = time.monotonic() - self.start
        eta = ""
        if 0 < self.done < self.total:
            eta = f", ETA {elapsed / self.done * (self.total - self.done):.0f} s"
        text = (
            f"{self.label} [{'#' * filled}{'-' * (28 - filled)}] {self.done}/{self.total} "
            f"{share:.0%}{eta}" + (f", {self.note}" if self.note else "")
        )
        page = (
            f"<progress value='{self.done}' max='{total}' style='width:24em'></progress> "
            f"<code>{html.escape(text.split('] ', 1)[1])}</code> {html.escape(self.label)}"
        )
        return {"text/plain": text, "text/html": page}

    def update(self, n: int, note: str | None) -> None:
        self.done += n
        self.note = note
        now = time.monotonic()
        if now - self.shown >= self.EVERY_S or self.done >= self.total:
            self.shown = now
            self.handle.update(self.bundle(), raw=True)

    def close(self) -> None:
        self.handle.update(self.bundle(), raw=True)


class Progress:
    """A progress bar of ``total`` steps: on stderr on a terminal, in the cell's output in a
    notebook, nothing when disabled or elsewhere.

    ``update(n, note)`` advances it; ``note`` (e.g. "2 failed") is shown after the bar. Use it as
    a context manager, or call ``close``; both are safe to repeat.
    """

    def __init__(self, total: int, label: str, initial: int = 0, enabled: bool = True) -> None:
        self._bar: Any = None
        self._nb: _NotebookBar | None = None
        if enabled and not on_terminal() and in_notebook():
            self._nb = _NotebookBar(total, label, initial)
        elif enabled and on_terminal():
            self._bar = click.progressbar(
                length=total,
                label=label,
                file=sys.stderr,
                show_eta=True,
                show_pos=True,
                item_show_func=lambda note: note,
            )
            self._bar.__enter__()
            if initial:
                self._bar.update(initial)

    def update(self, n: int = 1, note: str | None = None) -> None:
        """Advance by ``n`` steps."""
        if self._bar is not None:
            self._bar.update(n, note)
        elif self._nb is not None:
            self._nb.update(n, note)

    def close(self) -> None:
        """Finish the bar (a newline on the terminal)."""
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.__exit__(None, None, None)
        if self._nb is not None:
            nb, self._nb = self._nb, None
            nb.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@contextlib.contextmanager
def lazy_progress(label: str, enabled: bool) -> Iterator[Callable[..., None]]:
    """A ``progress(done, total, *info)`` callback drawing a bar on stderr, opened on first use.

    The bar appears only once the total is known (the first call) and is closed on exit,
    also when the work raises.
    """
    bar: Progress | None = None

    def progress(done: int, total: int, *_info: object) -> None:
        nonlocal bar
        if not enabled:
            return
        if bar is None:
            bar = Progress(total, label)
        bar.update(1)

    try:
        yield progress
    finally:
        if bar is not None:
            bar.close()
