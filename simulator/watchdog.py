"""The sweep's watchdog: a worker process exits soon after the sweep process dies, however it
dies (used by the local process pool and, through simulator/dask_watchdog.py, by Dask)."""

from __future__ import annotations

import os
import time
from pathlib import Path

#: Seconds between a worker's checks that the sweep process is still alive.
WATCHDOG_INTERVAL_S = 0.5


def _proc_identity(pid: int) -> str | None:
    """Start time of a live process (Linux), "" where it cannot be read, None if it is gone.

    A zombie (killed, not yet reaped) counts as gone; the start time tells a recycled pid
    from the original process.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None  # Linux, and the process is gone
    except OSError:
        pass
    else:
        fields = stat.rpartition(")")[2].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ""


def watch_parent(pid: int, interval: float = WATCHDOG_INTERVAL_S) -> None:
    """Exit this worker process soon after process ``pid`` (the sweep) dies, however it dies.

    A daemon thread polls ``pid``: SIGKILL or SIGTERM of the sweep leaves no cleanup code to
    stop its workers (a process pool's or a Dask LocalCluster's), which would otherwise run on
    for minutes. Safe to call more than once per process (the first watcher wins).
    """
    import threading

    global _WATCHED
    if _WATCHED is not None:
        return
    _WATCHED = pid
    ident = _proc_identity(pid)

    def loop() -> None:
        while True:
            time.sleep(interval)
            now = _proc_identity(pid)
            if now is None or (ident and now != ident):
                os._exit(3)

    threading.Thread(target=loop, name="daopsim-sweep-watchdog", daemon=True).start()


_WATCHED: int | None = None
