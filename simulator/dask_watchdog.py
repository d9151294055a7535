"""Dask plugins that end a sweep's LocalCluster processes when the sweep process dies.

Imported only by the ``dask`` executor (it needs ``dask.distributed``). Each nanny and each
worker, including workers a nanny restarts later, starts
:func:`daopsim.simulator.watchdog.watch_parent` on the sweep's pid.
"""

from __future__ import annotations

from typing import Any

from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin


class _Watchdog:
    """Starts the watchdog on process ``pid`` in whatever process ``setup`` runs in."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def setup(self, *_args: Any, **_kwargs: Any) -> None:
        """Start the watchdog thread (Dask passes ``worker=`` or ``nanny=``)."""
        from daopsim.simulator.watchdog import watch_parent

        watch_parent(self.pid)


class WatchdogWorkerPlugin(_Watchdog, WorkerPlugin):
    """Every worker exits soon after process ``pid`` dies."""

    name = "daopsim-watchdog-worker"


class WatchdogNannyPlugin(_Watchdog, NannyPlugin):
    """Every nanny exits soon after process ``pid`` dies (so it cannot restart workers)."""

    name = "daopsim-watchdog-nanny"
