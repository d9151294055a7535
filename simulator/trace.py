"""Routing traces: the Parquet format, atomic writing, streaming reading and validation.

Each idea has its module: ``trace_format`` (the schema, ``TraceMeta``, ``SequenceRouting``),
``trace_write`` (``TraceWriter``, ``write_trace``) and ``trace_read`` (``read_meta``,
``iter_sequences``, ``validate_trace``). This module is their public names in one place (the
names docs/trace-format.md documents as ``daopsim.simulator.trace.X``) and
:func:`write_valid_trace`, which joins writing and validating: the one way a command writes a
trace for the user.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from daopsim.simulator.errors import TraceError, UserError
from daopsim.simulator.trace_format import (
    ALL_PROBS_MAX_EXPERTS,
    COUNT_KEYS,
    DEFAULT_TOP_M,
    FILLED_KEY,
    MAX_POSITION,
    META_KEY,
    PHASES,
    READ_VERSIONS,
    REQUIRED_COLUMNS,
    SCHEMA_VERSION,
    SequenceRouting,
    TraceMeta,
    arrow_schema,
    blank_first_layer_view,
    previous_token_view,
    schema_for,
)
from daopsim.simulator.trace_read import (
    EMPTY_TRACE,
    RANK_ORDER_COLUMNS,
    check_rank_order,
    check_schema,
    checked_sequence_ids,
    iter_sequences,
    load_sequences,
    read_meta,
    sequence_ids,
    validate_trace,
    weight_rises,
)
from daopsim.simulator.trace_write import TraceWriter, sequence_table, tool_versions, write_trace

T = TypeVar("T")


def write_valid_trace(
    path: str | os.PathLike[str],
    write: Callable[[Path], T],
    flag: str | None = "-o",
    what: str = "written",
    hint: str = "",
) -> T:
    """The one way a command writes a trace for the user (``synth``, ``trace import``,
    ``capture``): ``write(tmp)`` fills a temporary file beside ``path``, :func:`validate_trace`
    (what ``daopsim trace validate`` runs) reads it back, and only a valid trace is renamed into
    place (``daopsim.simulator.output.write_file``: a special file at ``path`` is refused, an
    OSError is one line with exit code 3). An invalid one is deleted and reported as one UserError
    naming ``path`` and the first problem; ``path`` is left as it was. Returns what ``write``
    returned.
    """
    from daopsim.simulator.output import write_file

    out: list[T] = []

    def _write(tmp: str) -> None:
        out.append(write(Path(tmp)))
        try:
            validate_trace(tmp)
        except TraceError as exc:
            where = "".join(
                (f"row {exc.row}: " if exc.row is not None else "")
                + (f"column {exc.column!r}: " if exc.column is not None else "")
            )
            label = f"{flag} {path}" if flag else str(path)
            raise UserError(
                f"{label}: the {what} trace fails validation ({where}{exc.detail}); "
                f"nothing was written{hint}"
            ) from None

    write_file(path, _write, flag)
    return out[0]


__all__ = [
    "ALL_PROBS_MAX_EXPERTS",
    "COUNT_KEYS",
    "DEFAULT_TOP_M",
    "EMPTY_TRACE",
    "FILLED_KEY",
    "MAX_POSITION",
    "META_KEY",
    "PHASES",
    "RANK_ORDER_COLUMNS",
    "READ_VERSIONS",
    "REQUIRED_COLUMNS",
    "SCHEMA_VERSION",
    "SequenceRouting",
    "TraceMeta",
    "TraceWriter",
    "arrow_schema",
    "blank_first_layer_view",
    "check_rank_order",
    "check_schema",
    "checked_sequence_ids",
    "iter_sequences",
    "load_sequences",
    "previous_token_view",
    "read_meta",
    "schema_for",
    "sequence_ids",
    "sequence_table",
    "tool_versions",
    "validate_trace",
    "weight_rises",
    "write_trace",
    "write_valid_trace",
]
