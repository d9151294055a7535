"""``daopsim profiles``: list the bundled hardware profiles and show one with derived costs."""

from __future__ import annotations

from typing import Any

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.costs import DEFAULT_CONTEXT, cost_model
from daopsim.simulator.hardware import list_profiles, load_profile
from daopsim.simulator.hardware_spec import HardwareProfile
from daopsim.simulator.models import get_model
from daopsim.simulator.precisions import DTYPE_BYTES

DEFAULT_MODEL = "mixtral-8x7b"


@click.group("profiles")
def profiles() -> None:
    """Hardware profiles (TOML; see docs/hardware-profiles.md)."""


def _brief(p: HardwareProfile) -> dict[str, Any]:
    d = p.to_dict()
    return {k: d[k] for k in ("name", "description", "gpu", "link", "cpu", "power", "path")} | {
        "measured_models": sorted(p.measured),
        "multi_gpu": d["multi"],
    }


@profiles.command("list")
@json_option
def list_cmd(as_json: bool) -> None:
    """List the bundled profiles: GPU, memory, link, CPU, measured models."""
    rows = list_profiles()
    if as_json:
        echo_json([_brief(p) for p in rows])
        return
    # device memory in GiB, as vendors state it (a "24 GB" card has 24 GiB = 25.8 GB; the
    # profile's memory_gb is decimal GB, docs/hardware-profiles.md); rates in decimal GB/s
    table = [("NAME", "GPU", "MEM GiB", "GPU GB/s", "LINK", "H2D GB/s", "CPU", "MEASURED")]
    for p in rows:
        table.append(
            (
                p.name,
                (f"{p.multi.count}x " if p.multi is not None else "")
                + p.gpu.name.replace("NVIDIA ", ""),
                f"{p.gpu.memory_gb * 1e9 / 2**30:.1f}",
                f"{p.gpu.mem_bw_gbs:g}",
                p.link.kind,
                f"{p.link.h2d_pinned_gbs:g}",
                p.cpu.name,
                ", ".join(sorted(p.measured)) or "-",
            )
        )
    _print_table(table)


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


@profiles.command("show")
@click.argument("name_or_path")
@click.option(
    "--model",
    "model_name",
    default=DEFAULT_MODEL,
    show_default=True,
    help="Model preset whose derived costs to show (see `daopsim models list`).",
)
@click.option(
    "--dtype",
    type=click.Choice(sorted(DTYPE_BYTES)),
    default=None,
    help="GPU expert precision (default: the model's).",
)
@click.option(
    "--host-dtype",
    type=click.Choice(sorted(DTYPE_BYTES)),
    default=None,
    help="Precision of the host's expert copies: CPU compute and link bytes (default: --dtype).",
)
@click.option(
    "--nonexpert-dtype",
    type=click.Choice(sorted(DTYPE_BYTES)),
    default=None,
    help="Precision of the non-expert weights (default: the model's, bf16).",
)
@click.option(
    "--context",
    "context_tokens",
    type=click.IntRange(min=0),
    default=DEFAULT_CONTEXT,
    show_default=True,
    help="KV-cache context for nonexpert_layer_ms (one decode token).",
)
@click.option(
    "--policy",
    "policy_name",
    default="daop",
    show_default=True,
    help="Policy whose expert-sized buffers the GPU expert slots leave room for.",
)
@json_option
def show_cmd(
    name_or_path: str,
    model_name: str,
    dtype: str | None,
    host_dtype: str | None,
    nonexpert_dtype: str | None,
    context_tokens: int,
    policy_name: str,
    as_json: bool,
) -> None:
    """Show a profile (bundled NAME or a TOML PATH) and the model's derived costs on it."""
    from daopsim.policies.registry import make_policy
    from daopsim.simulator.fit import expert_fit, policy_buffers

    hw = load_profile(name_or_path)
    model = get_model(model_name).with_precision(dtype, host_dtype, nonexpert_dtype)
    policy = make_policy(policy_name)  # default options: the buffers it declares
    cm = cost_model(hw, model)
    summary = cm.summary(context_tokens)
    # the same fit `daopsim run` applies (KV cache for --context tokens, the policy's buffers)
    fit = expert_fit(cm, policy_buffers(policy), context_tokens, policy.resources())
    out = hw.to_dict() | {
        k: summary[k]
        for k in (
            "model",
            "dtype",
            "host_dtype",
            "nonexpert_dtype",
            "expert_bytes",
            "host_expert_bytes",
            "context_tokens",
        )
    }
    out |= {
        "policy": policy.name,
        "policy_buffers": fit.buffers,
        "gpu_expert_slots": fit.max_experts,
        "max_cache_ratio": fit.max_ratio(),
    }
    out |= {
        "costs": summary["costs"],
        "measured_costs": summary["measured"],
        "cost_sources": summary["sources"],
    }
    if as_json:
        echo_json(out)
        return
    _print_profile(hw)
    click.echo("")
    _print_costs(model, cm, summary, fit, policy.name, context_tokens)


def _print_costs(
    model: Any,
    cm: Any,
    summary: dict[str, Any],
    fit: Any,
    policy_name: str,
    context_tokens: int,
) -> None:
    """The model's derived costs on the profile as text, each measured one marked."""
    click.echo(
        f"costs for {model.name} ({model.dtype} experts, {cm.expert_bytes:,} bytes each; "
        + (
            f"host copies {model.host_precision}, {cm.host_expert_bytes:,} bytes; "
            if cm.split_precision
            else ""
        )
        + f"non-expert weights {model.nonexpert_dtype}; decode context {context_tokens} tokens)"
    )
    c = summary["costs"]
    meas = summary["measured"]
    lines = [
        ("h2d expert, pinned", f"{c['h2d_expert_ms_pinned']:.3f} ms", meas["h2d_expert_pinned"]),
        (
            "h2d expert, pageable",
            f"{c['h2d_expert_ms_pageable']:.3f} ms",
            meas["h2d_expert_pageable"],
        ),
        ("d2h expert, pinned", f"{c['d2h_expert_ms_pinned']:.3f} ms", False),
        ("GPU expert, 1 token", f"{c['gpu_expert_ms']:.3f} ms", False),
        ("CPU expert, 1 token", f"{c['cpu_expert_ms']:.3f} ms", meas["cpu_expert"]),
        ("activation copy, 1 token", f"{c['activation_copy_ms']:.4f} ms", False),
        ("non-expert part of a layer", f"{c['nonexpert_layer_ms']:.3f} ms", False),
        ("break-even tokens (pageable)", f"{c['breakeven_tokens']:.2f}", False),
        ("break-even tokens (pinned)", f"{c['breakeven_tokens_pinned']:.2f}", False),
        (
            f"GPU expert slots (for {policy_name})",
            f"{fit.max_experts} (--cache-ratio <= {fit.max_ratio():.3f})",
            False,
        ),
    ]
    width = max(len(n) for n, _, _ in lines)
    for name, value, was_measured in lines:
        tag = "  (measured)" if was_measured else ""
        click.echo(f"  {name.ljust(width)}  {value}{tag}")


def _print_profile(hw: HardwareProfile) -> None:
    click.echo(f"{hw.name}: {hw.description}")
    click.echo(f"  file: {hw.path}")
    for section in ("gpu", "link", "cpu", "power", "ssd"):
        spec = getattr(hw, section)
        if spec is None:
            continue
        items = ", ".join(f"{k}={v}" for k, v in spec.__dict__.items())
        click.echo(f"  [{section}] {items}")
    multi = hw.multi
    if multi is not None:  # several GPUs (docs/hardware-profiles.md, "[gpus] and [peer]")
        click.echo(
            f"  [gpus] count={multi.count}, shared_uplink={str(multi.shared_uplink).lower()}"
        )
        peer = f"  [peer] kind={multi.peer_kind}"
        if multi.peer_gbs is not None:
            peer += f", bandwidth_gbs={multi.peer_gbs:g}, latency_us={multi.peer_latency_us:g}"
        if multi.peer_pairs is not None:
            peer += f", pairs={[list(x) for x in multi.peer_pairs]}"
        click.echo(peer)
    for model, m in sorted(hw.measured.items()):
        click.echo(
            f"  [measured.{model}] cpu_expert_ms={m.cpu_expert_ms}, "
            f"load_expert_ms={m.load_expert_ms} ({m.load_path}, {m.dtype}); {m.source}"
        )
