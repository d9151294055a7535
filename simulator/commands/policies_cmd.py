"""``daopsim policies``: the registered policies and their options."""

from __future__ import annotations

from typing import Any

import click

from daopsim.simulator.commands.common import echo_json, json_option


def describe(cls: Any) -> dict[str, Any]:
    """A policy class as a plain dict (name, flags, options with defaults and help)."""
    from daopsim.simulator.boundary import construct_policy

    return {
        "name": cls.name,
        "summary": cls.summary,
        "source": cls.source,
        "clairvoyant": bool(cls.clairvoyant),
        "bound": bool(cls.clairvoyant or cls.bound),
        "needs_calibration": bool(cls.needs_calibration),
        # with default options (an option may change it, e.g. static's host_memory)
        "host_memory": construct_policy(cls).resources().host_memory,
        "runtime": cls.runtime_profile,
        "params": {
            k: {
                "type": p.type.__name__,
                "default": p.default,
                "help": p.help,
                "choices": list(p.choices) if p.choices else None,
                "minimum": p.minimum,
                "maximum": p.maximum,
                "search": getattr(p, "search", None),
            }
            for k, p in cls.params.items()
        },
        "module": cls.__module__,
        "error": None,
    }


def values_text(p: dict[str, Any]) -> str:
    """The values ``daopsim advise`` tries for an option, as ``policies list`` shows them:
    the default, the choices (both values of a bool) and a searched integer range."""
    from daopsim.policies.options import SEARCH_RANGES

    text = f"default {p['default']!r}"
    if p["choices"]:
        text += "; one of " + ", ".join(repr(c) for c in p["choices"])
    elif p["type"] == "bool":
        text += "; True or False"
    if p.get("search"):
        text += f"; advise searches {SEARCH_RANGES.get(p['search'], p['search'])}"
    return text


@click.group("policies")
def policies() -> None:
    """List the policies and their options."""


@policies.command("list")
@json_option
def list_cmd(as_json: bool) -> None:
    """All registered policies (built-in and plugins), then plugins that failed to load.

    A broken plugin is listed with its error (in ``--json``: an entry whose ``error`` is set);
    it does not stop the other policies from working.
    """
    from daopsim.policies.registry import available, failed_plugins

    docs = [describe(cls) for cls in available().values()]
    broken = [f.to_dict() for f in failed_plugins().values()]
    if as_json:
        echo_json(docs + broken)
        return
    for d in docs:
        flags = [
            f for f, on in (("bound", d["bound"]), ("calibrated", d["needs_calibration"])) if on
        ]
        click.echo(f"{d['name']:<20} {d['summary']}" + (f"  [{', '.join(flags)}]" if flags else ""))
        for key, p in d["params"].items():
            click.echo(f"    --policy-opt {key}=<{p['type']}> ({values_text(p)}): {p['help']}")
    for b in broken:
        click.echo(f"{b['name']:<20} BROKEN plugin ({b['target']}): {b['error']}")


@policies.command("show")
@click.argument("name")
@json_option
def show_cmd(name: str, as_json: bool) -> None:
    """One policy: what it models and its options."""
    from daopsim.policies.registry import get_policy_class

    d = describe(get_policy_class(name))
    if as_json:
        echo_json(d)
        return
    click.echo(
        f"{d['name']}: {d['summary']}\nsource: {d['source']}\n"
        f"host memory: {d['host_memory']}; calibration: {d['needs_calibration']}; "
        f"bound: {d['bound']}; runtime: {d['runtime']}"
    )
    for key, p in d["params"].items():
        click.echo(f"  {key} ({p['type']}, default {p['default']!r}): {p['help']}")
