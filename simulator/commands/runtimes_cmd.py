"""``daopsim runtimes``: the bundled runtime profiles (a framework's host overheads)."""

from __future__ import annotations

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.runtime_profiles import (
    FIELDS,
    STREAM_EFFICIENCY_MEANING,
    get_runtime,
    runtime_names,
)


@click.group("runtimes")
def runtimes() -> None:
    """Runtime profiles: per-kernel dispatch, syncs and kernel counts (`run --runtime`)."""


def _declared_by() -> dict[str, list[str]]:
    """Runtime name -> the built-in policies that declare it."""
    from daopsim.policies.registry import available

    out: dict[str, list[str]] = {}
    for name, cls in sorted(available().items()):
        out.setdefault(cls.runtime_profile, []).append(name)
    return out


@runtimes.command("list")
@json_option
def list_cmd(as_json: bool) -> None:
    """List the runtime profiles, their main costs and the policies that declare each."""
    users = _declared_by()
    rows = []
    for name in runtime_names():
        doc = get_runtime(name).to_dict()
        doc["policies"] = users.get(name, [])
        rows.append(doc)
    if as_json:
        echo_json(rows)
        return
    for r in rows:
        click.echo(
            f"{r['name']:<14} dispatch {r['dispatch_us']:>5.2f} us  sync {r['sync_us']:>4.1f} us  "
            f"{r['summary']}"
        )
        if r["policies"]:
            click.echo(f"{'':<14} declared by: {', '.join(r['policies'])}")


@runtimes.command("show")
@click.argument("name")
@json_option
def show_cmd(name: str, as_json: bool) -> None:
    """Every field of one runtime profile, with its source."""
    prof = get_runtime(name)
    doc = prof.to_dict()
    doc["policies"] = _declared_by().get(name, [])
    if as_json:
        echo_json(doc)
        return
    click.echo(f"{prof.name}: {prof.summary}")
    for field, _, meaning in FIELDS:
        click.echo(f"  {field:<18} {getattr(prof, field):>8}  {meaning}")
        if field in prof.sources:
            click.echo(f"  {'':<18} {'':>8}  source: {prof.sources[field]}")
    # the share field and the two non-numeric ones: fused MoE calls and the attention
    for field, meaning in (
        ("gpu_stream_efficiency", STREAM_EFFICIENCY_MEANING),
        ("fused_moe", "the GPU experts of a layer run as one fused MoE call"),
        ("attention", "fused (scores stay on chip) or eager (scores in device memory)"),
        ("logits_to_host", "each forward pass ends with its logits' copy to the host"),
    ):
        click.echo(f"  {field:<18} {getattr(prof, field)!s:>8}  {meaning}")
        if field in prof.sources:
            click.echo(f"  {'':<18} {'':>8}  source: {prof.sources[field]}")
    if doc["policies"]:
        click.echo(f"declared by: {', '.join(doc['policies'])}")
