"""Progress bars on stderr: one implementation (click's), drawn only when stderr is a terminal.

``Progress`` is a bar with a known total (sweep, capture); ``lazy_progress`` opens one on the
first ``progress(done, total, ...)`` callback (run, validate), when the total becomes known.
Output piped to a file or a CI log gets no bar at all, so logs stay clean.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import click


def on_terminal() -> bool:
    """Whether stderr is an interactive terminal (the only place a bar is drawn)."""
    return sys.stderr.isatty()


class Progress:
    """A progress bar of ``total`` steps on stderr, or nothing when disabled or not a terminal.

    ``update(n, note)`` advances it; ``note`` (e.g. "2 failed") is shown after the bar. Use it as
    a context manager, or call ``close``; both are safe to repeat.
    """

    def __init__(self, total: int, label: str, initial: int = 0, enabled: bool = True) -> None:
        self._bar: Any = None
        if enabled and on_terminal():
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

    def close(self) -> None:
        """Finish the bar (a newline on the terminal)."""
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.__exit__(None, None, None)

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
