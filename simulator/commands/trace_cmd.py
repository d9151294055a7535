"""``daopsim trace``: validate a routing trace, show its metadata, compute routing statistics,
import one from another format (``trace list``, the bundled traces, is in traces_cmd.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.data import non_regular_kind
from daopsim.simulator.errors import UserError
from daopsim.simulator.stats import PHASE_CHOICES, STAT_KEYS, trace_stats
from daopsim.simulator.trace_format import TraceMeta
from daopsim.simulator.trace_read import read_meta, validate_trace


@click.group("trace")
def trace() -> None:
    """Routing traces: list the bundled ones, check, inspect and import (docs/trace-format.md)."""


def _path_arg() -> Any:
    # exists=False: a missing file must give our one-line TraceError, not click's usage text
    return click.argument("path", type=click.Path(dir_okay=True, exists=False), callback=_resolve)


def _resolve(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """A bundled trace's short name (see `daopsim trace list`) also works as PATH."""
    kind = non_regular_kind(value)
    if kind is not None and kind != "a directory":  # reading a FIFO or a device never ends
        raise UserError(f"{value}: is {kind}, not a regular trace file")
    if not Path(value).exists():
        # the resolver `run --trace` uses: a bundled name, or "did you mean" for a near one
        from daopsim.simulator.data import resolve_trace

        return str(resolve_trace(value))
    return value


def info_dict(path: str, meta: TraceMeta) -> dict[str, Any]:
    """What ``trace info --json`` prints: model shape, provenance, counts, storage."""
    m = meta.model
    return {
        "path": str(path),
        "schema_version": meta.schema_version,
        "model": m.to_dict(),
        "provenance": meta.provenance,
        "counts": meta.counts,
        "probs_stored": meta.probs_stored,
        "probs_storage": (
            "top-m with ids"
            if meta.top_m
            else ("all experts" if meta.probs_recorded else "not recorded")
        ),
        "early_view_recorded": meta.early_view_recorded,
        "weights_recorded": meta.weights_recorded,
        "filled_column": meta.filled_column,
        "moe_layer_ids": meta.moe_layer_ids,
        "calibration_sequences": meta.calibration_sequences,
    }


@trace.command("validate")
@_path_arg()
@json_option
def validate_cmd(path: str, as_json: bool) -> None:
    """Check every row of PATH; exit 0 if valid, else print one error line and exit 2.

    PATH is a trace file or the name of a bundled trace.
    """
    meta = validate_trace(path)
    c = meta.counts
    if as_json:
        echo_json({"path": str(path), "valid": True, "model": meta.model.name, "counts": c})
        return
    click.echo(
        f"OK {path}: {meta.model.name}, {c['sequences']} sequences, "
        f"{c['prefill_tokens']} prefill + {c['decode_tokens']} decode tokens, {c['rows']} rows"
    )


@trace.command("info")
@_path_arg()
@json_option
def info_cmd(path: str, as_json: bool) -> None:
    """Show PATH's metadata: model shape, provenance, counts, how probabilities are stored."""
    meta = read_meta(path)
    data = info_dict(path, meta)
    if as_json:
        echo_json(data)
        return
    m = meta.model
    c = meta.counts
    lines = [
        f"trace      {path} (schema {meta.schema_version})",
        f"model      {m.name} ({m.family}): {m.moe_layers} MoE layers of {m.layers}, "
        f"{m.experts} experts, top-{m.top_k}, hidden {m.hidden}, expert FFN {m.expert_ffn}, "
        f"{m.dtype}",
        f"counts     {c.get('sequences', '?')} sequences, {c.get('prefill_tokens', '?')} prefill"
        f" + {c.get('decode_tokens', '?')} decode tokens, {c.get('rows', '?')} rows",
        f"probs      {data['probs_storage']} ({meta.probs_stored} per row)",
    ]
    missing = [
        name
        for name, ok in (
            ("one-layer-early view", meta.early_view_recorded),
            ("gate weights", meta.weights_recorded),
        )
        if not ok
    ]
    if missing:
        lines.append(f"not recorded {', '.join(missing)}")
    if meta.filled_column:
        lines.append(f"filled     {c.get('missing_token_layers', '?')} missing token-layers")
    if meta.calibration_sequences:
        lines.append(f"calibration sequences {meta.calibration_sequences}")
    for key in sorted(meta.provenance):
        value = meta.provenance[key]
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in sorted(value.items()))
        lines.append(f"provenance {key}: {value}")
    click.echo("\n".join(lines))


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


_SHORT = {
    "entropy_bits": "entropy",
    "max_share": "max_sh",
    "consecutive_overlap": "overlap",
    "top1_repeat": "top1_rep",
    "same_set": "same_set",
    "any_shared": "any_sh",
    "mean_top1_weight": "top1_w",
    "lookahead_precision": "lookahead",
    "prefill_decode_cosine": "pf_dec_cos",
}


@trace.command("stats")
@_path_arg()
@json_option
@click.option(
    "--sequences",
    "max_sequences",
    type=click.IntRange(min=1),
    default=None,
    help="Use only the first N sequences.",
)
@click.option(
    "--phase",
    type=click.Choice(PHASE_CHOICES),
    default="decode",
    show_default=True,
    help="Tokens the popularity, pair, weight and look-ahead statistics use.",
)
@click.option(
    "--curves/--no-curves",
    default=True,
    show_default=True,
    help="Compute the per-layer LRU and Belady hit-rate curves (the slowest part).",
)
def stats_cmd(
    path: str, as_json: bool, max_sequences: int | None, phase: str, curves: bool
) -> None:
    """Routing statistics of PATH per layer and mean over layers (see docs/trace-format.md).

    Also reuse statistics over decode tokens: overlap against lag, reuse distances, working
    sets, and the LRU and Belady hit rates at every per-layer capacity.
    """
    s = trace_stats(path, max_sequences=max_sequences, phase=phase, curves=curves)
    if as_json:
        echo_json(s)
        return
    if s.get("not_recorded"):
        missing = ", ".join(s["not_recorded"])
        click.echo(f"note: not recorded in this trace: {missing} (statistics of them show '-')")
    if s.get("missing_token_layers"):
        click.echo(f"note: {s['missing_token_layers']} missing token-layers were filled on import")
    if s["phase_tokens"] == 0 and s["sequences"]:
        click.echo(f"note: no {phase} tokens in the sequences read; see --phase")
    click.echo(
        f"{path}: {s['model']}, {s['sequences']} sequences, {s['prefill_tokens']} prefill + "
        f"{s['decode_tokens']} decode tokens; statistics over {phase} tokens"
    )
    header = "layer " + " ".join(f"{_SHORT[k]:>10}" for k in STAT_KEYS)
    click.echo(header)
    for row in s["per_layer"]:
        click.echo(f"{row['layer']:>5} " + " ".join(f"{_fmt(row[k]):>10}" for k in STAT_KEYS))
    click.echo(" mean " + " ".join(f"{_fmt(s[k]):>10}" for k in STAT_KEYS))
    base = s["uniform_baseline"]
    cells = " ".join(f"{_fmt(base[k]) if k in base else '':>10}" for k in STAT_KEYS)
    click.echo(("chance" + cells).rstrip())
    _echo_reuse(s)


def _row(label: str, values: list[float | None]) -> str:
    return f"{label:<22}" + " ".join(f"{_fmt(v):>7}" for v in values)


def _echo_reuse(s: dict[str, Any]) -> None:
    """The reuse statistics as a few compact lines (means over layers)."""
    lags = s["overlap_by_lag"]
    click.echo("\nreuse over decode tokens (mean over layers)")
    click.echo(_row("lag", []) + " ".join(f"{lag:>7}" for lag in lags))
    click.echo(_row("overlap", list(lags.values())))
    ws = s["working_set"]
    click.echo(_row("window (tokens)", []) + " ".join(f"{w:>7}" for w in ws))
    click.echo(_row("distinct experts", list(ws.values())))
    rd = s["reuse_distance"]
    if rd["share"] is not None:
        click.echo(_row("reuse distance", []) + " ".join(f"{b:>7}" for b in rd["bins"]))
        click.echo(_row("share of accesses", rd["share"]))
        click.echo(
            f"first use {_fmt(rd['first_use'])}, mean distance {_fmt(rd['mean'])} tokens, "
            f"median {_fmt(rd['p50'])}, p90 {_fmt(rd['p90'])}"
        )
    if s.get("lru_curve") is not None:
        n_exp, k = len(s["lru_curve"]), s["top_k"]
        # every capacity up to 16 experts, else a readable subset (--json has all of them)
        caps = (
            list(range(1, n_exp + 1))
            if n_exp <= 16
            else sorted({1, k, 2 * k, n_exp} | {n_exp * i // 8 for i in range(1, 8)})
        )
        click.echo(_row("capacity per layer", []) + " ".join(f"{c:>7}" for c in caps))
        for label, key in (
            ("LRU hit rate (warm)", "lru_curve"),
            ("Belady hit rate (warm)", "belady_curve"),
            ("LRU hit rate (cold)", "lru_curve_cold"),
            ("Belady hit rate (cold)", "belady_curve_cold"),
        ):
            if s.get(key) is not None:
                click.echo(_row(label, [s[key][c - 1] for c in caps]))
        click.echo(
            "warm: one cache per layer carried across the sequences, hits pooled; cold: each "
            "sequence from an empty cache, averaged over sequences and layers"
        )


@trace.command("import")
@click.argument("fmt", metavar="FORMAT", type=click.Choice(["vllm", "jsonl", "npy", "torch"]))
@click.argument("src", type=click.Path(dir_okay=False, exists=False))
@click.option(
    "-o", "--out", "out", required=True, type=click.Path(dir_okay=False), help="Trace to write."
)
@click.option(
    "--model", default=None, help="Model preset (shape and sizes; `daopsim models list`)."
)
@click.option(
    "--top-k", type=int, default=None, help="torch: experts per token (default: --model's)."
)
@click.option(
    "--field",
    "fields",
    multiple=True,
    metavar="NAME=KEY",
    help="jsonl: the JSON key of a field (seq, token, layer, experts, weights, phase); repeatable.",
)
@click.option(
    "--missing-layers",
    type=click.Choice(["fill", "skip"]),
    default="fill",
    show_default=True,
    help="A token without some layers: fill them from the previous token, or drop the token.",
)
@click.option(
    "--prefill",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="npy/torch: the first N tokens of each sequence are prompt tokens.",
)
@json_option
def import_cmd(
    fmt: str,
    src: str,
    out: str,
    model: str | None,
    top_k: int | None,
    fields: tuple[str, ...],
    missing_layers: str,
    prefill: int,
    as_json: bool,
) -> None:
    """Convert routing recorded by another tool (FORMAT: vllm, jsonl, npy, torch) to a trace.

    See docs/trace-format.md, "Importing traces", for each format's accepted shape.
    """
    from daopsim.simulator.errors import parse_key_values
    from daopsim.simulator.importers import import_trace
    from daopsim.simulator.importers_common import ImportOptions

    opts = ImportOptions(
        model=model,
        top_k=top_k,
        fields=parse_key_values(fields, "--field"),
        missing_layers=missing_layers,
        prefill=prefill,
    )
    meta = import_trace(fmt, src, out, opts)
    c = meta.counts
    if as_json:
        echo_json({"path": out, "counts": c, "provenance": meta.provenance})
        return
    filled = c.get("missing_token_layers", 0)
    click.echo(
        f"wrote {out}: {meta.model.name}, {c['sequences']} sequences, {c['prefill_tokens']} "
        f"prefill + {c['decode_tokens']} decode tokens"
        + (f", {filled} missing token-layers filled" if filled else "")
        + f" (from {fmt} {Path(src).name})"
    )
