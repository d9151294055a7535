"""``daopsim models``: the bundled MoE model shapes (simulator.models presets)."""

from __future__ import annotations

import click

from simulator.commands.common import echo_json, json_option
from simulator.models import PRESETS, get_model


@click.group("models")
def models() -> None:
    """MoE model shapes: layers, experts, sizes (see simulator/models.py)."""


@models.command("list")
@json_option
def list_cmd(as_json: bool) -> None:
    """List the model presets with their main sizes."""
    shapes = [PRESETS[name] for name in sorted(PRESETS)]
    if as_json:
        echo_json([m.summary() for m in shapes])
        return
    rows = [
        (
            "NAME",
            "LAYERS",
            "MOE",
            "EXPERTS",
            "TOP-K",
            "HIDDEN",
            "FFN",
            "EXPERT MB (bf16)",
            "NON-EXPERT GB",
        )
    ]
    for m in shapes:
        rows.append(
            (
                m.name,
                str(m.layers),
                str(m.moe_layers),
                str(m.experts),
                str(m.top_k),
                str(m.hidden),
                str(m.expert_ffn),
                f"{m.expert_bytes('bf16') / 1e6:.1f}",
                f"{m.non_expert_bytes('bf16') / 1e9:.2f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


@models.command("show")
@click.argument("name")
@json_option
def show_cmd(name: str, as_json: bool) -> None:
    """Show one model's shape and derived sizes."""
    summary = get_model(name).summary()
    if as_json:
        echo_json(summary)
        return
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v:,}" for k, v in value.items())
        elif isinstance(value, int) and not isinstance(value, bool):
            value = f"{value:,}"
        click.echo(f"{key.ljust(width)}  {value}")
