"""``daopsim policies``: the registered policies and their options."""

from __future__ import annotations

from typing import Any

import click

from simulator.commands.common import echo_json, json_option


def describe(cls: Any) -> dict[str, Any]:
    """A policy class as a plain dict (name, flags, options with defaults and help)."""
    return {
        "name": cls.name,
        "summary": cls.summary,
        "source": cls.source,
        "clairvoyant": bool(cls.clairvoyant),
        "bound": bool(cls.clairvoyant or cls.bound),
        "needs_calibration": bool(cls.needs_calibration),
        "host_memory": cls.host_memory,
        "params": {
            k: {
                "type": p.type.__name__,
                "default": p.default,
                "help": p.help,
                "choices": list(p.choices) if p.choices else None,
            }
            for k, p in cls.params.items()
        },
        "module": cls.__module__,
    }


@click.group("policies")
def policies() -> None:
    """List the policies and their options."""


@policies.command("list")
@json_option
def list_cmd(as_json: bool) -> None:
    """All registered policies (built-in and plugins)."""
    from policies.registry import available

    docs = [describe(cls) for cls in available().values()]
    if as_json:
        echo_json(docs)
        return
    for d in docs:
        flags = [
            f for f, on in (("bound", d["bound"]), ("calibrated", d["needs_calibration"])) if on
        ]
        click.echo(f"{d['name']:<20} {d['summary']}" + (f"  [{', '.join(flags)}]" if flags else ""))
        for key, p in d["params"].items():
            click.echo(
                f"    --policy-opt {key}=<{p['type']}> (default {p['default']!r}): {p['help']}"
            )


@policies.command("show")
@click.argument("name")
@json_option
def show_cmd(name: str, as_json: bool) -> None:
    """One policy: what it models and its options."""
    from policies.registry import get_policy_class

    d = describe(get_policy_class(name))
    if as_json:
        echo_json(d)
        return
    click.echo(
        f"{d['name']}: {d['summary']}\nsource: {d['source']}\n"
        f"host memory: {d['host_memory']}; calibration: {d['needs_calibration']}; "
        f"bound: {d['bound']}"
    )
    for key, p in d["params"].items():
        click.echo(f"  {key} ({p['type']}, default {p['default']!r}): {p['help']}")
