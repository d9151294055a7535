"""``daopsim trace list``: the traces bundled with the package (metadata only, so it is fast).

``daopsim traces`` is the older spelling of the ``trace`` group, kept as a hidden alias: it has
the same subcommands (``traces list`` still works)."""

from __future__ import annotations

from typing import Any

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.commands.trace_cmd import trace
from daopsim.simulator.data import bundled_traces
from daopsim.simulator.errors import TraceError
from daopsim.simulator.trace_read import read_meta


def list_bundled() -> list[dict[str, Any]]:
    """One dict per bundled trace: name, path, model, counts, provenance source."""
    out = []
    for name, path in bundled_traces().items():
        entry: dict[str, Any] = {"name": name, "path": str(path)}
        try:
            meta = read_meta(path)
        except TraceError as exc:
            # one broken file should not hide the others; say what is wrong with it
            entry["error"] = exc.detail
            out.append(entry)
            continue
        c = meta.counts
        prov = meta.provenance
        entry.update(
            {
                "model": meta.model.name,
                "sequences": c.get("sequences"),
                "prefill_tokens": c.get("prefill_tokens"),
                "decode_tokens": c.get("decode_tokens"),
                "tokens": (c.get("prefill_tokens") or 0) + (c.get("decode_tokens") or 0),
                "source": prov.get("source") or prov.get("generator") or "unknown",
            }
        )
        out.append(entry)
    return out


@trace.command("list")
@json_option
def list_cmd(as_json: bool) -> None:
    """List the bundled traces with model, sequences, tokens and provenance source."""
    rows = list_bundled()
    if as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo("no bundled traces")
        return
    for r in rows:
        if "error" in r:
            click.echo(f"{r['name']:<20} unreadable: {r['error']}")
            continue
        click.echo(
            f"{r['name']:<20} {r['model']:<18} {r['sequences']:>4} seq "
            f"{r['prefill_tokens']:>7} prefill {r['decode_tokens']:>7} decode  {r['source']}"
        )


#: the older spelling: the same subcommands, not listed in ``daopsim --help``
traces = click.Group(
    "traces",
    commands=trace.commands,
    hidden=True,
    help="Older spelling of `daopsim trace` (same subcommands).",
)
