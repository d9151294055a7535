"""``daopsim models``: the bundled MoE model shapes (daopsim.simulator.models presets)."""

from __future__ import annotations

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.models import PRESETS, get_model
from daopsim.simulator.precisions import DTYPES


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
            "SHARED",
            "DTYPE",
            "EXPERT MB (bf16)",
            "NON-EXPERT GB",
            "TOTAL B",
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
                str(m.shared_experts),
                m.dtype,
                f"{m.expert_bytes('bf16') / 1e6:.1f}",
                f"{m.non_expert_bytes('bf16') / 1e9:.2f}",
                f"{m.total_params / 1e9:.1f}",
            )
        )
    _echo_table(rows)


def _echo_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


@models.command("dtypes")
@json_option
def dtypes_cmd(as_json: bool) -> None:
    """List the weight precisions (--dtype, --host-dtype, --nonexpert-dtype) and their sizes."""
    if as_json:
        echo_json([{**vars(d), "bytes_per_weight": d.bytes} for d in DTYPES.values()])
        return
    rows = [("NAME", "BITS/WEIGHT", "KIND", "LAYOUT")]
    rows += [(d.name, f"{d.bits:.4f}", d.kind, d.layout) for d in DTYPES.values()]
    _echo_table(rows)


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
