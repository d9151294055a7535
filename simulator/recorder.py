"""The recorder: one row per operation on a resource, plus slot-occupancy samples.

Columns: resource, kind, seq, token, layer, expert, start, end, bytes. Times are simulated
seconds. A serving run (simulator/serving.py) adds a ``requests`` column: the request ids of
each row's step (one id, or several comma-separated for a batched step, whose rows carry seq -1
and the step number as token). The timeline is sorted by start time, then end time (stable:
rows that tie keep the order they were recorded in).

The engines call :meth:`Recorder.op` on their hot paths, so it only extends a flat staging list
by the row's nine values (no object per row survives the call, so the row costs the garbage
collector nothing). Every ``CHUNK_ROWS`` rows the list becomes one columnar chunk (a numpy array
per column, 40 bytes a row instead of about 400 as tuples). Without a destination the chunks
stay in memory and :meth:`Recorder.timeline` builds the DataFrame at the end. With one
(``Recorder(path)``, ``simulate(record=path)``, ``daopsim run --out``) memory stays flat: every
``RUN_ROWS`` rows the chunks are sorted and appended to a temporary Parquet file as row groups
(a sorted run); :meth:`Recorder.finish` merges the runs block by block into a second temporary
file, written as row groups of ``CHUNK_ROWS`` rows with pandas' metadata, and renames it to the
destination. Nothing is left at the destination if the run fails (:meth:`Recorder.discard`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from daopsim.simulator.output import os_errors, refuse_non_regular

COLUMNS = ("resource", "kind", "seq", "token", "layer", "expert", "start", "end", "bytes")
#: each column's dtype in the timeline (resource and kind are pandas categoricals)
DTYPES = {
    "seq": np.int32,
    "token": np.int32,
    "layer": np.int16,
    "expert": np.int16,
    "start": np.float64,
    "end": np.float64,
    "bytes": np.int64,
}
#: rows per columnar chunk (and per Parquet row group of a streamed timeline)
CHUNK_ROWS = 1 << 16
#: rows per sorted run of a streamed timeline (the most it holds in memory at once)
RUN_ROWS = 1 << 20

Chunk = dict[str, np.ndarray]


class Recorder:
    """Collects operation rows and occupancy samples during a run.

    ``path``: stream the timeline to this Parquet file as the run goes (see the module's
    docstring); None keeps it in memory.
    """

    __slots__ = (
        "_buf",
        "_chunks",
        "_held",
        "_limit",
        "_names",
        "_occ",
        "_occ_buf",
        "_open",
        "_runs",
        "_runs_file",
        "_runs_writer",
        "batches",
        "chunk_rows",
        "path",
        "rows_recorded",
        "run_rows",
    )

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        chunk_rows: int = CHUNK_ROWS,
        run_rows: int = RUN_ROWS,
    ) -> None:
        #: the staged rows, nine values each, and occupancy samples, two values each
        self._buf: list[Any] = []
        self._occ_buf: list[Any] = []
        self._occ: list[tuple[np.ndarray, np.ndarray]] = []
        self._chunks: list[Chunk] = []
        self._held = 0  # rows in self._chunks
        #: resource names and kind names -> their code in the chunks (first seen, first code)
        self._names: dict[str, dict[str, int]] = {"resource": {}, "kind": {}}
        self.chunk_rows = max(1, int(chunk_rows))
        self.run_rows = max(self.chunk_rows, int(run_rows))
        self._limit = len(COLUMNS) * self.chunk_rows
        #: serving runs: step number -> request ids of a batched step (None: not serving)
        self.batches: dict[int, str] | None = None
        #: the destination of a streamed timeline (None: in memory)
        self.path: Path | None = None if path is None else Path(path)
        self._open = self.path is not None  # a streamed timeline not finished yet
        self._runs: list[tuple[int, int]] = []  # each sorted run: (first row group, count)
        self._runs_file: str | None = None
        self._runs_writer: Any = None
        self.rows_recorded = 0

    # -- the hot path ------------------------------------------------------------------------
    def op(
        self,
        resource: str,
        kind: str,
        seq: int,
        token: int,
        layer: int,
        expert: int,
        start: float,
        end: float,
        nbytes: int,
    ) -> None:
        """Record one operation on a resource."""
        buf = self._buf
        buf.extend((resource, kind, seq, token, layer, expert, start, end, nbytes))
        if len(buf) >= self._limit:
            self._flush()

    def occupancy(self, time: float, slots: int) -> None:
        """Record the number of GPU expert slots held from ``time`` on."""
        buf = self._occ_buf
        buf.extend((time, slots))
        if len(buf) >= self._limit:
            self._flush_occupancy()

    # -- chunks ----------------------------------------------------------------------------
    def _code(self, values: list[str], column: str) -> np.ndarray:
        names = self._names[column]
        for name in set(values) - names.keys():
            names[name] = len(names)
        return np.fromiter(map(names.__getitem__, values), dtype=np.int16, count=len(values))

    def _flush(self) -> None:
        """The staged rows as one columnar chunk (types as pandas would infer, then cast)."""
        buf = self._buf
        if not buf:
            return
        width = len(COLUMNS)
        cols = [buf[i::width] for i in range(width)]
        buf.clear()
        n = len(cols[0])
        chunk: Chunk = {
            "resource": self._code(cols[0], "resource"),
            "kind": self._code(cols[1], "kind"),
        }
        for name, col in zip(COLUMNS[2:], cols[2:], strict=True):
            chunk[name] = np.array(col).astype(DTYPES[name], copy=False)
        self._chunks.append(chunk)
        self._held += n
        self.rows_recorded += n
        if self.path is not None and self._held >= self.run_rows:
            self._spill()

    def _flush_occupancy(self) -> None:
        occ = self._occ_buf
        if occ:
            t, n = occ[0::2], occ[1::2]
            occ.clear()
            self._occ.append((np.array(t, dtype=np.float64), np.array(n).astype(np.int64)))

    def _spill(self) -> None:
        """The chunks in memory, sorted, appended to the runs file as one sorted run."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._chunks:
            return
        run = _concat(self._chunks)
        self._chunks, self._held = [], 0
        run = _take(run, np.lexsort((run["end"], run["start"])))
        if self._runs_writer is None:
            assert self.path is not None
            self._runs_file = _temp_beside(self.path, "runs")
            schema = pa.schema(
                [(c, pa.from_numpy_dtype(run[c].dtype)) for c in ("resource", "kind", *COLUMNS[2:])]
            )
            self._runs_writer = pq.ParquetWriter(self._runs_file, schema, compression="snappy")
        first = sum(n for _, n in self._runs)
        n = 0
        for a in range(0, len(run["start"]), self.chunk_rows):
            part = {c: v[a : a + self.chunk_rows] for c, v in run.items()}
            self._runs_writer.write_batch(pa.record_batch(list(part.values()), names=list(part)))
            n += 1
        self._runs.append((first, n))

    def _categorical(self, codes: np.ndarray, column: str, every_name: bool) -> pd.Categorical:
        """A column's codes as a categorical: the names present (``every_name``: every name
        the column has had in the run), sorted, as ``astype("category")`` of the strings
        would give."""
        names = self._names[column]
        by_code = list(names)  # insertion order: code i is the i-th name
        if every_name:
            cats = sorted(by_code)
        else:
            cats = sorted(by_code[u] for u in np.unique(codes).tolist())
        lut = np.full(max(1, len(by_code)), -1, dtype=np.int32)
        for i, name in enumerate(cats):
            lut[names[name]] = i
        return pd.Categorical.from_codes(lut[codes], categories=cats)

    def _frame(self, chunk: Chunk, every_name: bool = False) -> pd.DataFrame:
        """A chunk as timeline rows, in its order."""
        data: dict[str, Any] = {}
        for c in COLUMNS:
            v = chunk[c]
            data[c] = self._categorical(v, c, every_name) if c in ("resource", "kind") else v
        df = pd.DataFrame(data)
        if self.batches is not None:
            batches = self.batches
            df["requests"] = [
                batches.get(tok, "") if seq == -1 else str(seq)
                for seq, tok in zip(df["seq"].tolist(), df["token"].tolist(), strict=True)
            ]
        return df

    # -- results -----------------------------------------------------------------------------
    def timeline(self) -> pd.DataFrame:
        """All operations as a DataFrame sorted by start time (stable). A streamed timeline
        is finished first and read back from its file."""
        if self.path is not None:
            return read_timeline(self.finish())
        self._flush()
        chunk = _concat(self._chunks) if self._chunks else _empty()
        df = self._frame(chunk)
        return df.sort_values(["start", "end"], kind="stable").reset_index(drop=True)

    def finish(self) -> Path:
        """A streamed timeline: merge the sorted runs into the destination (written under a
        temporary name, then renamed) and return its path. Idempotent."""
        if self.path is None:
            raise ValueError("this recorder keeps its timeline in memory")
        if not self._open:
            return self.path  # finished already
        self._flush()
        self._spill()
        where = str(self.path)
        with os_errors(self.path):
            final = _temp_beside(self.path, "new")
            try:
                self._merge(final)
                os.chmod(final, 0o666 & ~_umask())
                refuse_non_regular(self.path, where)
                os.replace(final, self.path)
            finally:
                if os.path.exists(final):
                    os.unlink(final)
                self._drop_runs()
        self._open = False
        return self.path

    def discard(self) -> None:
        """Remove a streamed timeline's temporary files (a failed run writes nothing)."""
        self._chunks, self._buf = [], []
        self._drop_runs()

    def _drop_runs(self) -> None:
        if self._runs_writer is not None:
            self._runs_writer.close()
            self._runs_writer = None
        if self._runs_file is not None and os.path.exists(self._runs_file):
            os.unlink(self._runs_file)
        self._runs_file = None

    def _merge(self, out: str) -> None:
        """Merge the sorted runs into ``out``: row groups of ``chunk_rows`` rows in timeline
        order, each a DataFrame's worth of pandas metadata and categoricals."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        writer: Any = None
        pending: list[Chunk] = []
        held = 0

        def write(chunks: list[Chunk]) -> None:
            nonlocal writer
            # every name in every row group: one dictionary, so the file reads back as one
            # categorical
            df = self._frame(_concat(chunks), every_name=True)
            table = pa.Table.from_pandas(df, preserve_index=False)
            if writer is None:
                writer = pq.ParquetWriter(out, table.schema)
            writer.write_table(table, row_group_size=self.chunk_rows)

        if self._runs_writer is not None:
            self._runs_writer.close()
            self._runs_writer = None
        blocks = _merge_runs(self._runs_file, self._runs) if self._runs_file else iter(())
        for block in blocks:
            pending.append(block)
            held += len(block["start"])
            while held >= self.chunk_rows:
                merged = _concat(pending)
                head = {c: v[: self.chunk_rows] for c, v in merged.items()}
                rest = {c: v[self.chunk_rows :] for c, v in merged.items()}
                write([head])
                pending = [rest]
                held -= self.chunk_rows
        if held or writer is None:
            write(pending if pending else [_empty()])
        writer.close()

    def occupancy_frame(self) -> pd.DataFrame:
        """Slot occupancy samples (time, slots) sorted by time (stable)."""
        self._flush_occupancy()
        if self._occ:
            t = np.concatenate([a for a, _ in self._occ])
            n = np.concatenate([b for _, b in self._occ])
            self._occ = [(t, n)]
        else:
            t, n = np.empty(0, dtype=np.float64), np.empty(0, dtype=np.int64)
        if len(t) > 1 and not bool((t[1:] >= t[:-1]).all()):  # samples come mostly in order
            order = np.argsort(t, kind="stable")
            t, n = t[order], n[order]
        return pd.DataFrame({"time": t, "slots": n}, copy=False)


def _empty() -> Chunk:
    chunk: Chunk = {"resource": np.empty(0, np.int16), "kind": np.empty(0, np.int16)}
    chunk.update({c: np.empty(0, DTYPES[c]) for c in COLUMNS[2:]})
    return chunk


def _concat(chunks: list[Chunk]) -> Chunk:
    if len(chunks) == 1:
        return chunks[0]
    return {c: np.concatenate([ch[c] for ch in chunks]) for c in chunks[0]}


def _take(chunk: Chunk, idx: np.ndarray) -> Chunk:
    return {c: v[idx] for c, v in chunk.items()}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temp_beside(path: Path, what: str) -> str:
    """A new temporary file in ``path``'s folder (hidden, named after it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{what}-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return tmp


def _merge_runs(runs_file: str, runs: list[tuple[int, int]]) -> Iterator[Chunk]:
    """The rows of sorted runs (row groups of one file) in (start, end) order, stable across
    runs (an earlier run's row first on ties), one block at a time.

    Each run is read one row group at a time. A block is every row whose (start, end) is
    below the smallest last key read so far of the runs that have more to read: no row read
    later can come before it.
    """
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(runs_file)
    nxt = [first for first, _ in runs]
    stop = [first + n for first, n in runs]
    pend: list[Chunk | None] = [None] * len(runs)

    def load(r: int) -> None:
        tbl = pf.read_row_group(nxt[r])
        nxt[r] += 1
        cols = {c: tbl.column(c).to_numpy() for c in tbl.column_names}
        p = pend[r]
        pend[r] = cols if p is None or not len(p["start"]) else _concat([p, cols])

    for r in range(len(runs)):
        if nxt[r] < stop[r]:
            load(r)
    while True:
        bound: tuple[float, float] | None = None
        for r, p in enumerate(pend):
            if p is not None and nxt[r] < stop[r]:
                key = (float(p["start"][-1]), float(p["end"][-1]))
                if bound is None or key < bound:
                    bound = key
        parts: list[Chunk] = []
        for r, p in enumerate(pend):
            if p is None or not len(p["start"]):
                continue
            if bound is None:
                n = len(p["start"])
            else:
                start, end = p["start"], p["end"]
                a = int(np.searchsorted(start, bound[0], "left"))
                b = int(np.searchsorted(start, bound[0], "right"))
                n = a + int(np.searchsorted(end[a:b], bound[1], "left"))
            if n:
                parts.append({c: v[:n] for c, v in p.items()})
                pend[r] = {c: v[n:] for c, v in p.items()}
        if parts:
            block = _concat(parts)
            yield _take(block, np.lexsort((block["end"], block["start"])))
        if bound is None:
            return
        for r, p in enumerate(pend):
            if nxt[r] < stop[r]:
                assert p is not None
                if not len(p["start"]) or (float(p["start"][-1]), float(p["end"][-1])) == bound:
                    load(r)


def read_timeline(path: str | os.PathLike[str], filters: Any = None) -> pd.DataFrame:
    """A timeline Parquet file (``Recorder`` or ``RunResult.write``) as the DataFrame a run
    in memory gives: categoricals of the names present, sorted, and the integer widths.
    ``filters``: only the rows they select (``pandas.read_parquet``'s filters)."""
    df = pd.read_parquet(path, filters=filters)
    for c in ("resource", "kind"):
        col = df[c]
        if isinstance(col.dtype, pd.CategoricalDtype):
            col = col.cat.remove_unused_categories()
            df[c] = col.cat.reorder_categories(sorted(col.cat.categories))
        else:
            col = col.astype(str)
            df[c] = col.astype(pd.CategoricalDtype(sorted(col.unique())))
    return df.astype({c: DTYPES[c] for c in COLUMNS[2:]})


__all__ = ["COLUMNS", "Recorder", "read_timeline"]
