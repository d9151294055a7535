"""A run's timeline as a Chrome/Perfetto trace (JSON trace events), written as a stream.

One track (thread) per resource, one complete event (``"ph": "X"``) per timeline row in the
timeline's order, and a counter (``"ph": "C"``) of GPU expert slots held. Timestamps are
multiples of 1/``TICKS_PER_US`` microseconds, each slice's end clipped to the next slice's start
on its track (:func:`lane_ticks`), so slices on one track never overlap in any viewer.

The timeline is read in blocks of ``BATCH_ROWS`` rows, from a DataFrame or straight from a
streamed timeline's Parquet file, in two passes: the first finds the few ends that need
clipping (for that only each track's last slice so far is kept), the second writes the events.
An event's text is put together from strings shared by every event of its kind, layer, expert
and track (made once) and the row's numbers; no per-row dict is built and the JSON encoder is
not used for events. The output is the same text as ``json.dumps`` of the whole document with
compact separators, gzip-compressed at ``GZIP_LEVEL`` for a path ending in ``.gz``.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pandas as pd

#: Perfetto timestamps are multiples of 1/TICKS_PER_US microseconds (about 1 ns): binary
#: fractions, so every ts and dur is exact in floating point and ts + dur of one slice never
#: passes the next slice's ts in any viewer, whether it rounds, truncates or adds floats.
TICKS_PER_US = 1024
#: gzip's own default level: about 2.5x quicker than 9 for a file about 6 % larger
GZIP_LEVEL = 6
#: timeline rows per block
BATCH_ROWS = 1 << 16

_SEP = (",", ":")
_SCALE = 1e6 * TICKS_PER_US


def lane_ticks(lanes: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[Any, Any]:
    """Start and end in ticks, each end clipped to the next start on the same lane (rows of
    one lane ordered by start tick, end tick, then position)."""
    t0 = np.rint(start * _SCALE).astype(np.int64)
    t1 = np.maximum(np.rint(end * _SCALE).astype(np.int64), t0)
    order = np.lexsort((t1, t0, lanes))
    s, e, lane = t0[order], t1[order], lanes[order]
    same = lane[1:] == lane[:-1]
    e[:-1] = np.where(same, np.minimum(e[:-1], s[1:]), e[:-1])
    out0, out1 = np.empty_like(t0), np.empty_like(t1)
    out0[order], out1[order] = s, e
    return out0, out1


def resource_order(name: str) -> tuple[int, str]:
    """Track order: the GPU, the links, the CPU workers, then the rest by name."""
    order = {"gpu": 0, "h2d": 1, "d2h": 2}
    return (order.get(name, 3 if name.startswith("cpu") else 4), name)


# -- reading the timeline in blocks ------------------------------------------------------------


class _Block:
    """Some consecutive timeline rows: names as (names, codes) pairs, numbers as arrays."""

    __slots__ = ("cols", "kinds", "n", "requests", "resources")

    def __init__(
        self,
        resources: tuple[list[str], np.ndarray],
        kinds: tuple[list[str], np.ndarray] | None,
        cols: dict[str, np.ndarray],
        requests: list[str] | None,
    ) -> None:
        self.resources, self.kinds, self.cols, self.requests = resources, kinds, cols, requests
        self.n = len(resources[1])


def _names_of(col: Any) -> tuple[list[str], np.ndarray]:
    """A pandas column as (names, codes)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        return [str(x) for x in col.cat.categories], col.cat.codes.to_numpy()
    codes, uniques = pd.factorize(col.astype(str))
    return [str(x) for x in uniques], codes


def _frame_blocks(tl: pd.DataFrame, columns: tuple[str, ...], rows: int) -> Iterator[_Block]:
    res = _names_of(tl["resource"])
    kinds = _names_of(tl["kind"]) if "kind" in columns else None
    cols = {c: tl[c].to_numpy() for c in columns if c not in ("resource", "kind", "requests")}
    served = "requests" in columns and "requests" in tl.columns
    req = tl["requests"].astype(str).tolist() if served else None
    for a in range(0, max(len(tl), 1), rows):
        b = a + rows
        yield _Block(
            (res[0], res[1][a:b]),
            None if kinds is None else (kinds[0], kinds[1][a:b]),
            {c: v[a:b] for c, v in cols.items()},
            None if req is None else req[a:b],
        )


def _arrow_names(arr: Any) -> tuple[list[str], np.ndarray]:
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_dictionary(arr.type):
        arr = pc.dictionary_encode(arr)
    names = [str(x) for x in arr.dictionary.to_pylist()]
    return names, arr.indices.to_numpy(zero_copy_only=False)


def _file_blocks(path: Path, columns: tuple[str, ...], rows: int) -> Iterator[_Block]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    have = set(pf.schema_arrow.names)
    wanted = [c for c in columns if c in have]
    for batch in pf.iter_batches(batch_size=rows, columns=wanted):
        got = dict(zip(batch.schema.names, batch.columns, strict=True))
        yield _Block(
            _arrow_names(got["resource"]),
            _arrow_names(got["kind"]) if "kind" in got else None,
            {
                c: got[c].to_numpy(zero_copy_only=False)
                for c in wanted
                if c not in ("resource", "kind", "requests")
            },
            [str(x) for x in got["requests"].to_pylist()] if "requests" in got else None,
        )


Source = pd.DataFrame | Path


def _blocks(source: Source, columns: tuple[str, ...], rows: int) -> Iterator[_Block]:
    if isinstance(source, pd.DataFrame):
        return _frame_blocks(source, columns, rows)
    return _file_blocks(source, columns, rows)


def _ids(names: list[str], ids: dict[str, int]) -> np.ndarray:
    """Per name, its id in ``ids`` (new names get the next ids)."""
    for x in names:
        if x not in ids:
            ids[x] = len(ids)
    return np.array([ids[x] for x in names], dtype=np.int64)


def _ticks(cols: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    t0 = np.rint(np.asarray(cols["start"], dtype=np.float64) * _SCALE).astype(np.int64)
    t1 = np.rint(np.asarray(cols["end"], dtype=np.float64) * _SCALE).astype(np.int64)
    return t0, np.maximum(t1, t0)


# -- pass 1: which ends are clipped ------------------------------------------------------------


class _Clips:
    """The ends :func:`lane_ticks` clips, found block by block.

    Rows come in timeline order, so their start ticks never decrease: rows with a start tick
    below the current block's last are final in each lane's order, and the rows at the last
    tick wait for the next block (they may tie with its first rows, which the order breaks by
    end tick). Per lane only its last row so far is kept, to clip it against the lane's next.
    """

    def __init__(self) -> None:
        self.lane_ids: dict[str, int] = {}
        self.used: set[int] = set()
        self._last: dict[int, tuple[int, int]] = {}  # lane -> (row, end tick)
        self._rows: list[np.ndarray] = []
        self._ends: list[np.ndarray] = []
        self._held: tuple[np.ndarray, ...] | None = None
        self._top = -1  # the largest start tick so far
        self.ordered = True

    def add(self, block: _Block, first_row: int) -> None:
        names, codes = block.resources
        lane = _ids(names, self.lane_ids)[codes]
        self.used.update(np.unique(lane).tolist())
        t0, t1 = _ticks(block.cols)
        if block.n and (t0[0] < self._top or bool((t0[1:] < t0[:-1]).any())):
            self.ordered = False  # not in timeline order: the caller clips all rows at once
        if not self.ordered:
            return
        if block.n:
            self._top = int(t0[-1])
        row = np.arange(first_row, first_row + block.n, dtype=np.int64)
        parts = (lane, t0, t1, row)
        if self._held is not None:
            parts = tuple(np.concatenate([h, p]) for h, p in zip(self._held, parts, strict=True))
        if not len(parts[1]):
            return
        cut = int(np.searchsorted(parts[1], parts[1][-1], "left"))
        self._held = tuple(p[cut:] for p in parts)
        self._settle(*(p[:cut] for p in parts))

    def close(self) -> tuple[np.ndarray, np.ndarray]:
        """Every clipped row (ascending) and its clipped end tick."""
        if self._held is not None:
            self._settle(*self._held)
            self._held = None
        rows = np.concatenate(self._rows) if self._rows else np.empty(0, np.int64)
        ends = np.concatenate(self._ends) if self._ends else np.empty(0, np.int64)
        order = np.argsort(rows, kind="stable")
        return rows[order], ends[order]

    def _settle(self, lane: np.ndarray, t0: np.ndarray, t1: np.ndarray, row: np.ndarray) -> None:
        if not len(lane):
            return
        order = np.lexsort((t1, t0, lane))
        lane, s, e, row = lane[order], t0[order], t1[order], row[order]
        same = lane[1:] == lane[:-1]
        nxt = np.minimum(e[:-1], s[1:])
        hit = same & (nxt < e[:-1])
        if hit.any():
            self._rows.append(row[:-1][hit])
            self._ends.append(nxt[hit])
        firsts = np.flatnonzero(np.concatenate([[True], ~same])).tolist()
        lasts = np.flatnonzero(np.concatenate([~same, [True]])).tolist()
        last = self._last
        for f, la in zip(firsts, lasts, strict=True):
            key = int(lane[f])
            prev = last.get(key)
            if prev is not None and int(s[f]) < prev[1]:
                self._rows.append(np.array([prev[0]], dtype=np.int64))
                self._ends.append(np.array([s[f]], dtype=np.int64))
            last[key] = (int(row[la]), int(e[la]))


def _all_clips(source: Source, lane_ids: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """The clipped rows of a timeline not in timeline order, from all its rows at once."""
    lanes, starts, ends = [], [], []
    for block in _blocks(source, ("resource", "start", "end"), BATCH_ROWS):
        names, codes = block.resources
        lanes.append(_ids(names, lane_ids)[codes])
        starts.append(np.asarray(block.cols["start"], dtype=np.float64))
        ends.append(np.asarray(block.cols["end"], dtype=np.float64))
    start, end = np.concatenate(starts), np.concatenate(ends)
    _, t1 = _ticks({"start": start, "end": end})
    _, clipped = lane_ticks(np.concatenate(lanes), start, end)
    rows = np.flatnonzero(clipped != t1)
    return rows.astype(np.int64), clipped[rows]


# -- pass 2: the events ------------------------------------------------------------------------


class _Events:
    """Event text for blocks of rows, with the parts shared by many rows made once."""

    def __init__(self, tids: dict[str, int]) -> None:
        self.tids = tids
        self._parts: dict[int, tuple[str, str]] = {}
        self._kinds: dict[str, int] = {}
        self._requests: dict[str, str] = {}

    def _shared(self, kind: str, layer: int, expert: int, tid: int) -> tuple[str, str]:
        name = kind if expert < 0 else f"{kind} L{layer}E{expert}"
        head = (
            f'{{"name":{json.dumps(name)},"cat":{json.dumps(kind)},"ph":"X","pid":1,'
            f'"tid":{tid},"ts":'
        )
        return head, f',"layer":{layer},"expert":{expert},"bytes":'

    def text(self, block: _Block, t0: np.ndarray, t1: np.ndarray) -> str:
        """The events of a block (comma-separated, each preceded by a comma)."""
        if not block.n:
            return ""
        rnames, rcodes = block.resources
        tid_of = np.array([self.tids.get(x, 0) for x in rnames], dtype=np.int64)
        tid = tid_of[rcodes]
        assert block.kinds is not None
        knames, kcodes = block.kinds
        kind = _ids(knames, self._kinds)[kcodes]
        cols = block.cols
        layer = np.asarray(cols["layer"]).astype(np.int64)
        expert = np.asarray(cols["expert"]).astype(np.int64)
        # one key per (kind, layer, expert, track), 16 bits for each of the last three
        key = (kind << 48) | ((layer & 0xFFFF) << 32) | ((expert & 0xFFFF) << 16) | tid
        uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
        parts = self._parts
        heads: list[str] = []
        mids: list[str] = []
        kind_names = list(self._kinds)
        for k, i in zip(uniq.tolist(), first.tolist(), strict=True):
            got = parts.get(k)
            if got is None:
                got = parts[k] = self._shared(
                    kind_names[int(kind[i])], int(layer[i]), int(expert[i]), int(tid[i])
                )
            heads.append(got[0])
            mids.append(got[1])
        head = np.array(heads, dtype=object)[inv].tolist()
        mid = np.array(mids, dtype=object)[inv].tolist()
        tick = float(TICKS_PER_US)
        ts = (t0 / tick).tolist()
        # durations repeat (a few thousand distinct in a run): each formatted once
        dticks, dpos = np.unique(t1 - t0, return_inverse=True)
        dtext = [f',"dur":{d!r},"args":{{"seq":' for d in (dticks / tick).tolist()]
        dur = np.array(dtext, dtype=object)[dpos].tolist()
        seq = np.asarray(cols["seq"]).tolist()
        tok = np.asarray(cols["token"]).tolist()
        nb = np.asarray(cols["bytes"]).tolist()
        if block.requests is None:
            rows = zip(head, ts, dur, seq, tok, mid, nb, strict=True)
            return "".join(
                [f',{h}{a!r}{d}{s},"token":{k}{m}{b}}}}}' for h, a, d, s, k, m, b in rows]
            )
        reqs = self._requests
        req = []
        for r in block.requests:
            q = reqs.get(r)
            if q is None:
                q = reqs[r] = f',"requests":{json.dumps(r)}}}}}'
            req.append(q)
        rows2 = zip(head, ts, dur, seq, tok, mid, nb, req, strict=True)
        return "".join(
            [f',{h}{a!r}{d}{s},"token":{k}{m}{b}{q}' for h, a, d, s, k, m, b, q in rows2]
        )


def _occupancy_text(occupancy: pd.DataFrame | None) -> str:
    if occupancy is None or not len(occupancy):
        return ""
    t = occupancy.iloc[:, 0].to_numpy(np.float64)
    slots = occupancy.iloc[:, 1].to_numpy().tolist()
    ts = (np.rint(t * 1e6 * TICKS_PER_US).astype(np.int64) / float(TICKS_PER_US)).tolist()
    return "".join(
        [
            f',{{"name":"gpu expert slots","ph":"C","pid":1,"ts":{a!r},"args":{{"slots":{n}}}}}'
            for a, n in zip(ts, slots, strict=True)
        ]
    )


def write_events(
    out: BinaryIO,
    source: Source,
    occupancy: pd.DataFrame | None,
    metadata: dict[str, Any],
    batch_rows: int = BATCH_ROWS,
) -> None:
    """Write the trace document (one JSON object) to ``out``, block by block."""
    clips = _Clips()
    n = 0
    for block in _blocks(source, ("resource", "start", "end"), batch_rows):
        clips.add(block, n)
        n += block.n
    if clips.ordered:
        rows, ends = clips.close()
    else:
        rows, ends = _all_clips(source, clips.lane_ids)
    names = sorted((x for x, i in clips.lane_ids.items() if i in clips.used), key=resource_order)
    tids = {r: i + 1 for i, r in enumerate(names)}
    meta = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "daopsim host"}}]
    meta += [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": t, "args": {"name": r}}
        for r, t in tids.items()
    ]
    out.write(
        ('{"traceEvents":[' + ",".join(json.dumps(e, separators=_SEP) for e in meta)).encode()
    )
    events = _Events(tids)
    columns = ("resource", "kind", "seq", "token", "layer", "expert", "start", "end", "bytes")
    first = 0
    for block in _blocks(source, (*columns, "requests"), batch_rows):
        t0, t1 = _ticks(block.cols)
        a, b = np.searchsorted(rows, [first, first + block.n])
        if b > a:
            t1[rows[a:b] - first] = ends[a:b]
        out.write(events.text(block, t0, t1).encode())
        first += block.n
    out.write(_occupancy_text(occupancy).encode())
    out.write(
        (
            '],"displayTimeUnit":"ms","metadata":' + json.dumps(metadata, separators=_SEP) + "}"
        ).encode()
    )


def writer(
    source: Source, occupancy: pd.DataFrame | None, metadata: dict[str, Any], compress: bool
) -> Callable[[str], None]:
    """A function writing the trace to a (temporary) path, gzipped if ``compress`` (fixed
    header time, so equal runs give equal bytes)."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as raw:
            if compress:
                with gzip.GzipFile(
                    filename="", fileobj=raw, mode="wb", mtime=0, compresslevel=GZIP_LEVEL
                ) as gz:
                    write_events(gz, source, occupancy, metadata)  # type: ignore[arg-type]
            else:
                write_events(raw, source, occupancy, metadata)

    return write


def is_gzip_path(path: str | os.PathLike[str]) -> bool:
    """A path ending in ``.gz`` is written gzip-compressed."""
    return str(path).endswith(".gz")


__all__ = [
    "BATCH_ROWS",
    "GZIP_LEVEL",
    "TICKS_PER_US",
    "lane_ticks",
    "resource_order",
    "write_events",
    "writer",
]
