"""Running a sweep: a grid's configurations (simulator/sweep_expand.py) run in parallel and
resumably into one tidy table (simulator/sweep_table.py).

Finished rows are stored one JSON file per configuration key in ``RESULTS.parquet.parts/``
(written atomically as each run completes), so a sweep killed at any moment and run again skips
what is done (and re-runs a policy whose code changed); the consolidated table is written
atomically at the end. Executors: ``local`` (a process pool; ``workers=1`` runs in this
process) and ``dask`` (``dask.distributed``: a ``LocalCluster`` or a scheduler address).
``simulate(record=False)`` is deterministic, so the table does not depend on the executor.
:func:`run_configs` runs the configurations of several grids in one pool (``advise``,
``compare``). See docs/sweeps.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from daopsim.simulator.errors import (
    UserError,
)
from daopsim.simulator.grid import Grid, load_grid_file
from daopsim.simulator.output import (
    TABLE_FORMATS,
    check_output_file,
    output_format,
    value_paths,
)
from daopsim.simulator.progress import Progress
from daopsim.simulator.run_params import grid_params
from daopsim.simulator.sweep_expand import Config, expand
from daopsim.simulator.sweep_row import _labels, add_bounds, run_config
from daopsim.simulator.sweep_table import (
    _isnan,
    _load_parts,
    _lock,
    _save_part,
    check_fidelity_floor,
    fidelity_floor,
    parts_dir,
    to_frame,
    write_table,
)
from daopsim.simulator.watchdog import watch_parent

EXECUTORS = ("local", "dask")


def pool_context() -> Any:
    """The multiprocessing context of the local executor.

    On Linux, ``fork``: a worker starts as a copy of the sweep process, so it never re-runs the
    calling script (``spawn`` and ``forkserver`` import ``__main__`` again in every worker, and a
    script that calls ``sweep()`` at top level, without an ``if __name__ == "__main__":`` guard,
    would then start a sweep inside each worker and fail). The copy also keeps policies
    registered by the script or notebook. The pool starts all its workers before its manager
    thread (``ProcessPoolExecutor`` does so for ``fork``), and a run is deterministic
    (``simulate(record=False)``), so the table is the same as with one worker. Elsewhere (macOS,
    Windows: ``fork`` is unsafe or missing) ``spawn``, which needs the guard in scripts.
    """
    import multiprocessing as mp

    if sys.platform.startswith("linux") and "fork" in mp.get_all_start_methods():
        return mp.get_context("fork")
    return mp.get_context("spawn")


def _run_local(todo: list[Config], workers: int, on_row: Callable[[dict[str, Any]], None]) -> None:
    if workers <= 1 or len(todo) <= 1:
        for cfg in todo:
            on_row(run_config(cfg))
        return
    import concurrent.futures as cf

    ctx = pool_context()
    with cf.ProcessPoolExecutor(
        max_workers=min(workers, len(todo)),
        mp_context=ctx,
        initializer=watch_parent,
        initargs=(os.getpid(),),
    ) as pool:
        futures = [pool.submit(run_config, cfg) for cfg in todo]
        try:
            for fut in cf.as_completed(futures):
                on_row(fut.result())
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def _run_dask(
    todo: list[Config],
    workers: int,
    scheduler: str | None,
    on_row: Callable[[dict[str, Any]], None],
) -> None:
    try:
        from distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise UserError(
            "--executor dask needs dask.distributed: pip install 'daopsim[dask]'"
        ) from None
    import logging

    cluster = None
    if scheduler:
        try:
            client = Client(scheduler, timeout="20s")
        except (OSError, TimeoutError) as exc:
            raise UserError(f"cannot reach the Dask scheduler at {scheduler}: {exc}") from None
    else:
        cluster = LocalCluster(
            n_workers=max(1, workers),
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=logging.ERROR,
        )
        client = Client(cluster)
        # the cluster's nannies and workers end themselves when this process dies
        from daopsim.simulator.dask_watchdog import WatchdogNannyPlugin, WatchdogWorkerPlugin

        client.register_plugin(WatchdogNannyPlugin(os.getpid()))
        client.register_plugin(WatchdogWorkerPlugin(os.getpid()))
    try:
        futures = [client.submit(run_config, cfg, pure=False) for cfg in todo]
        for fut in as_completed(futures):
            on_row(fut.result())
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def run_configs(
    configs: list[Config],
    executor: str = "local",
    workers: int | None = None,
    scheduler: str | None = None,
    progress: bool = False,
    bounds: bool = True,
    label: str = "runs",
) -> list[dict[str, Any]]:
    """Run configurations (from :func:`expand` of one or several grids) in one pool; returns
    their rows in the order given. A configuration given twice (the same key) runs once.
    Nothing is written: this is the core of a sweep without its table file (``advise``)."""
    if executor not in EXECUTORS:
        raise UserError(f"unknown executor {executor!r} (valid: {', '.join(EXECUTORS)})")
    n_workers = workers if workers is not None else (os.cpu_count() or 1)
    unique = list({c.key: c for c in configs}.values())
    done: dict[str, dict[str, Any]] = {}
    bar = Progress(len(unique), label, enabled=progress)

    def on_row(row: dict[str, Any]) -> None:
        done[row["key"]] = row
        bar.update(1)

    with bar:
        if executor == "dask":
            _run_dask(unique, n_workers, scheduler, on_row)
        else:
            _run_local(unique, n_workers, on_row)
    if bounds:
        add_bounds([done[c.key] for c in unique], unique)
    # the names asked for (a profile path, a trace name); a finished row keeps the runtime it
    # ran on when none was asked for
    return [
        {**done[c.key], **{k: v for k, v in _labels(c).items() if v is not None}} for c in configs
    ]


@dataclass
class SweepSummary:
    """What a sweep did: counts and the failed configurations.

    ``skipped`` counts configurations whose memory budget does not fit the machine (status
    "skipped"); they are not failures.
    """

    out: str | None
    configurations: int
    ok: int
    skipped: int
    failed: int
    resumed: int
    elapsed_s: float
    errors: list[dict[str, Any]]
    below_floor: int = 0  #: finished rows dropped by ``min_gate_mass``

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``daopsim sweep --json``)."""
        return dict(self.__dict__)


def _as_grid(grid: Grid | Mapping[str, Any] | str | os.PathLike[str]) -> tuple[Grid, str | None]:
    if isinstance(grid, Grid):
        return grid, None
    if isinstance(grid, Mapping):
        g = Grid.from_dict(grid)
        return g, grid.get("out")
    return load_grid_file(grid)


def run_sweep(
    grid: Grid | Mapping[str, Any] | str | os.PathLike[str],
    executor: str = "local",
    workers: int | None = None,
    out: str | os.PathLike[str] | None = None,
    progress: bool = True,
    scheduler: str | None = None,
    retry_errors: bool = False,
    min_gate_mass: float | None = None,
    bounds: bool = True,
) -> tuple[pd.DataFrame, SweepSummary]:
    """Run a sweep; returns the table and a summary (``sweep()`` returns just the table).

    ``min_gate_mass`` leaves out of the table the finished rows below that routing fidelity
    (their parts stay, so a later run with another floor does not simulate them again).
    ``bounds``: fill the all-GPU bound columns (:data:`BOUND_COLUMNS`; a few all-GPU runs per
    machine, trace, sequences and precision, in this process)."""
    g, grid_out = _as_grid(grid)
    if out is None and grid_out is not None:
        out = grid_out
    if executor not in EXECUTORS:
        raise UserError(f"unknown executor {executor!r} (valid: {', '.join(EXECUTORS)})")
    if workers is not None and workers < 1:
        raise UserError(f"workers must be at least 1, got {workers}")
    if scheduler and executor != "dask":
        raise UserError("a scheduler address needs executor='dask'")
    n_workers = workers if workers is not None else (os.cpu_count() or 1)
    check_fidelity_floor(min_gate_mass)  # before any run, not after
    configs = expand(g)
    t0 = time.perf_counter()
    folder = _results_folder(g, configs, out)
    lock = _lock(folder, Path(str(out))) if folder is not None else contextlib.nullcontext()
    with lock:
        done = _load_parts(folder, {c.key for c in configs}) if folder is not None else {}
        if retry_errors:
            done = {k: r for k, r in done.items() if r.get("status") != "error"}
        resumed = len(done)
        todo = [c for c in configs if c.key not in done]
        _run_into(done, todo, len(configs), folder, executor, n_workers, scheduler, progress)
        if bounds:
            add_bounds([done[c.key] for c in configs], configs)
        # a stored row keeps its numbers but takes this request's labels (a key is content: the
        # same run may have been asked for under another file name or profile name before)
        rows = [{**done[c.key], **_labels(c)} for c in configs]
        df, below_floor = fidelity_floor(to_frame(rows), min_gate_mass)
        if out is not None:
            write_table(df, out)
    elapsed = time.perf_counter() - t0
    return df, _summary(df, out, len(configs), resumed, below_floor, elapsed)


def _results_folder(
    g: Grid, configs: list[Config], out: str | os.PathLike[str] | None
) -> Path | None:
    """The parts folder of the results table (None without one), once the table's path is
    checked: a table format, never one of the sweep's inputs."""
    if out is None:
        return None
    output_format(out, TABLE_FORMATS, "--out")
    inputs = {c.trace_path for c in configs}  # the traces as resolved
    for p in grid_params():  # the other declared parameters that name an input file
        if p.input and p.name != "trace":
            value = getattr(g, str(p.grid_attr))
            inputs |= set(value) if p.axis else {value}
    inputs |= set(value_paths(g.options))  # a policy option naming a file (model=FILE)
    check_output_file(out, "--out", inputs=sorted(str(i) for i in inputs if i))
    return parts_dir(out)


def _run_into(
    done: dict[str, dict[str, Any]],
    todo: list[Config],
    total: int,
    folder: Path | None,
    executor: str,
    n_workers: int,
    scheduler: str | None,
    progress: bool,
) -> None:
    """Run ``todo`` into ``done`` (by key), saving each row's part as it finishes, under a
    progress bar over all ``total`` configurations that counts the failures."""
    bar = Progress(total, "sweep", initial=len(done), enabled=progress)
    n_failed = [sum(1 for r in done.values() if r.get("status") == "error")]

    def on_row(row: dict[str, Any]) -> None:
        done[row["key"]] = row
        if folder is not None:
            _save_part(folder, row)
        n_failed[0] += row.get("status") == "error"
        bar.update(1, f"{n_failed[0]} failed" if n_failed[0] else None)

    with bar:
        if executor == "dask":
            _run_dask(todo, n_workers, scheduler, on_row)
        else:
            _run_local(todo, n_workers, on_row)


def _summary(
    df: pd.DataFrame,
    out: str | os.PathLike[str] | None,
    configurations: int,
    resumed: int,
    below_floor: int,
    elapsed: float,
) -> SweepSummary:
    """The sweep's counts and its failed configurations, from its table."""
    failed = df[df["status"] == "error"]
    return SweepSummary(
        out=str(out) if out is not None else None,
        configurations=configurations,
        ok=int((df["status"] == "ok").sum()) + below_floor,
        skipped=int((df["status"] == "skipped").sum()),
        failed=len(failed),
        resumed=resumed,
        elapsed_s=round(elapsed, 3),
        below_floor=below_floor,
        errors=[
            {
                k: (None if _isnan(v) else v)
                for k, v in r.items()
                if k in ("key", "policy", "hw", "trace", "cache_ratio", "gpu_experts", "error")
            }
            for r in failed.to_dict("records")
        ],
    )


def sweep(
    grid: Grid | Mapping[str, Any] | str | os.PathLike[str],
    executor: str = "local",
    workers: int | None = None,
    out: str | os.PathLike[str] | None = None,
    progress: bool = True,
    scheduler: str | None = None,
    retry_errors: bool = False,
    bounds: bool = True,
) -> pd.DataFrame:
    """Run every configuration of ``grid`` and return one tidy row per configuration.

    ``grid`` is a :class:`Grid`, a dict with the same keys, or a TOML grid file. With ``out``
    the sweep is resumable (see docs/sweeps.md). Failed configurations have status "error",
    memory points that do not fit the machine status "skipped". ``bounds``: fill each row's
    all-GPU bound (``bound_tokens_per_s``, ``bound_runtime``; docs/metrics.md, "Bounds").
    """
    df, _ = run_sweep(
        grid,
        executor=executor,
        workers=workers,
        out=out,
        progress=progress,
        scheduler=scheduler,
        retry_errors=retry_errors,
        bounds=bounds,
    )
    return df
