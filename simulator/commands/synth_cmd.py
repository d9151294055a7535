"""``daopsim synth``: generate calibrated synthetic routing traces, and ``synth fit``.

``daopsim synth --model NAME --sequences N --prompt-tokens P --output-tokens O --seed S -o PATH``
writes a trace; ``daopsim synth fit --target STATS.json -o PARAMS.json`` fits generator
parameters to the JSON of ``daopsim trace stats --json``; ``daopsim synth presets`` lists the
calibrated presets. See docs/synthetic-traces.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from daopsim.simulator.commands.common import dumps, echo_json, json_option
from daopsim.simulator.data import check_input_file
from daopsim.simulator.errors import UserError, check_seed
from daopsim.simulator.models import get_model
from daopsim.simulator.output import check_output_file, write_text
from daopsim.simulator.synth import synth as write_trace_file
from daopsim.simulator.synth_fit import (
    COLD_FIT_SEQUENCES,
    FIT_PARAMS,
    check_stats_model,
    curve_rule,
    fit_params,
    shape_from_stats,
)
from daopsim.simulator.synth_params import (
    PRESETS,
    SynthParams,
    default_preset,
    get_preset,
    params_from_dict,
    parse_param_overrides,
)


def _resolve_params(
    model: str, preset: str | None, overrides: tuple[str, ...]
) -> tuple[SynthParams, str | None]:
    """Preset (named, file, or the model's own) plus --param overrides."""
    chosen = get_preset(preset) if preset else default_preset(model)
    base = chosen.params if chosen else SynthParams()
    params = params_from_dict(parse_param_overrides(overrides), base=base, where="--param")
    return params, (chosen.name if chosen else None)


@click.group(invoke_without_command=True)
@click.option("--model", "model", help="Model shape name (see `daopsim models list`).")
@click.option("--sequences", type=int, default=None, help="Number of sequences.")
@click.option(
    "--prompt-tokens",
    type=int,
    default=256,
    show_default=True,
    help="Prompt (prefill) tokens per sequence (default with a `synth fit` preset file: the "
    "length it was fitted at).",
)
@click.option(
    "--output-tokens",
    type=int,
    default=512,
    show_default=True,
    help="Generated (decode) tokens per sequence (default with a `synth fit` preset file: "
    "the length it was fitted at).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed.")
@click.option(
    "-o",
    "--output",
    "output",
    help="Trace file to write (.parquet).",
)
@click.option(
    "--preset",
    help="Preset name or a preset file from `synth fit` "
    "(default: the model's own preset if it has one).",
)
@click.option(
    "--param",
    "params",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override one generator parameter (repeatable).",
)
@json_option
@click.pass_context
def synth(
    ctx: click.Context,
    model: str | None,
    sequences: int | None,
    prompt_tokens: int,
    output_tokens: int,
    seed: int,
    output: str | None,
    preset: str | None,
    params: tuple[str, ...],
    as_json: bool,
) -> None:
    """Generate a synthetic routing trace calibrated to real MoE routing.

    \b
    Example:
      daopsim synth --model mixtral-8x7b --sequences 30 --prompt-tokens 256 \\
          --output-tokens 512 --seed 1 -o mixtral.parquet
    """
    if ctx.invoked_subcommand is not None:
        return
    missing = [
        name
        for name, v in (("--model", model), ("--sequences", sequences), ("-o/--output", output))
        if v is None
    ]
    if missing:
        raise UserError(f"synth: missing option {', '.join(missing)} (see `daopsim synth --help`)")
    assert model is not None and sequences is not None and output is not None
    shape = get_model(model)
    chosen = get_preset(preset) if preset else default_preset(shape.name)
    preset_name = chosen.name if chosen else None
    # a preset file from `synth fit` records the lengths it was fitted at: they are the
    # defaults here (the routing statistics it matches depend on them); options still win
    from click.core import ParameterSource

    fitted = fitted_lengths(preset) if preset else {}
    from_fit = [
        name
        for name in ("prompt_tokens", "output_tokens")
        if name in fitted and ctx.get_parameter_source(name) is ParameterSource.DEFAULT
    ]
    prompt_tokens = fitted["prompt_tokens"] if "prompt_tokens" in from_fit else prompt_tokens
    output_tokens = fitted["output_tokens"] if "output_tokens" in from_fit else output_tokens
    fitted_note = ", ".join(f"{n.replace('_', ' ')} {fitted[n]}" for n in from_fit)
    meta = write_trace_file(
        output,
        shape.name,
        sequences,
        prompt_tokens,
        output_tokens,
        seed,
        preset=preset,
        params=parse_param_overrides(params),
    )
    summary = {
        "path": str(output),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "model": shape.name,
        "preset": preset_name,
        "seed": seed,
        "counts": meta.counts,
        "calibration_sequences": meta.calibration_sequences,
        "bytes": os.path.getsize(output),
    }
    if as_json:
        echo_json(summary)
    else:
        click.echo(
            f"wrote {output}: {shape.name}, {meta.counts['sequences']} sequences, "
            f"{meta.counts['rows']} rows, preset {preset_name or '(defaults)'}"
            + (f" ({fitted_note}, as the preset was fitted)" if from_fit else "")
        )


def fitted_lengths(preset: str) -> dict[str, int]:
    """The prompt and output lengths a ``synth fit`` preset file was fitted at (its ``fit``
    object), or {} for a named preset or a file without them."""
    import json
    from pathlib import Path

    from daopsim.simulator.synth_params import PRESETS

    if preset.strip().lower() in PRESETS:
        return {}
    path = Path(preset).expanduser()
    try:
        doc = json.loads(path.read_text()) if path.suffix != ".toml" else {}
    except (OSError, ValueError, UnicodeDecodeError):
        return {}  # get_preset has already read it, or reports why not
    fit = doc.get("fit") if isinstance(doc, dict) else None
    if not isinstance(fit, dict):
        return {}
    return {
        k: int(v)
        for k, v in fit.items()
        if k in ("prompt_tokens", "output_tokens")
        and isinstance(v, int)
        and not isinstance(v, bool)
        and v > 0
    }


@synth.command("presets")
@json_option
def presets_cmd(as_json: bool) -> None:
    """List the calibrated presets and what each matches."""
    rows = [
        {
            "name": p.name,
            "model": p.model,
            "matches": p.matches,
            "assumes": p.assumes,
            "calibration_rows": list(p.calibration_rows),
            "params": p.params.to_dict(),
        }
        for p in PRESETS.values()
    ]
    if as_json:
        echo_json(rows)
        return
    for r in rows:
        click.echo(
            f"{r['name']:<22} model {r['model']}\n  matches: {r['matches']}\n"
            f"  assumes: {r['assumes']}"
        )
        if r["calibration_rows"]:
            click.echo("  fitted to validation rows: " + ", ".join(r["calibration_rows"]))


def _load_target(path: str) -> dict[str, Any]:
    # a device or FIFO would be read without end (or block): refused like every input
    check_input_file(path, "stats")
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise UserError(
            f"{path}: not a readable JSON stats file ({str(exc).splitlines()[0]})"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object (the output of `trace stats --json`)")
    return data


@synth.command("fit")
@click.option(
    "--target",
    required=True,
    type=click.Path(dir_okay=False),
    help="Statistics to match: the JSON of `daopsim trace stats --json`.",
)
@click.option(
    "--model",
    "model",
    default=None,
    help="Model shape (default: the 'model' recorded in the stats, else mixtral-8x7b).",
)
@click.option("--preset", help="Start from this preset or preset file.")
@click.option(
    "--param",
    "params",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a start value (repeatable).",
)
@click.option(
    "--free",
    default=None,
    help=f"Comma-separated parameters to fit (default: {','.join(FIT_PARAMS)}).",
)
@click.option(
    "--sequences",
    type=click.IntRange(min=1),
    default=None,
    help="Sequences per fitting trace (default: 32 when the fit targets the cold-start "
    "curves, else from the stats, at most 12).",
)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Prompt tokens per sequence (default: from the stats, else 256).",
)
@click.option(
    "--output-tokens",
    type=click.IntRange(min=2),
    default=None,
    help="Generated tokens per sequence (default: from the stats, else 512).",
)
@click.option(
    "--ignore",
    default=None,
    metavar="NAMES",
    help="Comma-separated targets to leave out: keys or key prefixes (overlap_by_lag, "
    "lru_curve, popularity_hit), labels (lru_curve[3]), per_layer, or short names "
    "(lookahead, cosine, entropy, overlap, lags, lru, popularity).",
)
@click.option(
    "--iterations",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="Fitting iterations (0: measure the start values only).",
)
@click.option("--seed", type=int, default=12345, show_default=True)
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    help="Preset file to write (JSON), usable with `synth --preset`.",
)
@json_option
def fit_cmd(
    target: str,
    model: str | None,
    preset: str | None,
    params: tuple[str, ...],
    free: str | None,
    ignore: str | None,
    sequences: int | None,
    prompt_tokens: int | None,
    output_tokens: int | None,
    iterations: int,
    seed: int,
    output: str,
    as_json: bool,
) -> None:
    """Fit generator parameters to a stats file, for a long synthetic twin of a short trace.

    \b
    Example:
      daopsim trace stats real.parquet --json > real-stats.json
      daopsim synth fit --target real-stats.json --model mixtral-8x7b -o twin.json
      daopsim synth --model mixtral-8x7b --preset twin.json --sequences 30 -o twin.parquet
    """
    data = _load_target(target)
    check_output_file(output, "-o", inputs=[target, preset])
    model_name = model or (data.get("model") if isinstance(data.get("model"), str) else None)
    if model_name is None and isinstance(data.get("model"), dict):
        model_name = data["model"].get("name")
    shape = get_model(model_name or "mixtral-8x7b")
    check_stats_model(shape, data, target)
    check_seed(seed)
    start, _ = _resolve_params(shape.name, preset, params)
    n_seq, p_tok, o_tok = _fit_workload(data, sequences, prompt_tokens, output_tokens)
    free_list = [f.strip() for f in free.split(",") if f.strip()] if free else None
    ignore_list = [f.strip() for f in ignore.split(",") if f.strip()] if ignore else None

    def progress(it: int, cost: float) -> None:
        if not as_json:
            click.echo(f"iteration {it}: misfit {cost:.3f}", err=True)

    result = fit_params(
        shape,
        data,
        start=start,
        sequences=n_seq,
        prompt_tokens=p_tok,
        output_tokens=o_tok,
        seed=seed,
        iterations=iterations,
        free=free_list,
        progress=progress,
        ignore=ignore_list,
    )
    doc = result.to_dict(shape.name)
    doc["fit"].update(
        {
            "sequences": n_seq,
            "curve_rule": curve_rule(data),
            "prompt_tokens": p_tok,
            "output_tokens": o_tok,
            "seed": seed,
            "target_file": os.path.basename(target),
        }
    )
    write_text(output, dumps(doc) + "\n", "-o")
    if as_json:
        echo_json(doc)
    else:
        click.echo(f"wrote {output}")
        _print_fit(result)


def _fit_workload(
    data: dict[str, Any],
    sequences: int | None,
    prompt_tokens: int | None,
    output_tokens: int | None,
) -> tuple[int, int, int]:
    """The sequences, prompt and output tokens each fitting iteration generates: the options
    given, else the recorded trace's (at most 12 sequences; a cold curve takes
    ``COLD_FIT_SEQUENCES``)."""
    recorded = shape_from_stats(data)
    # `is None`, not `or`: an explicit 0 is refused by the option's range, never a default
    if sequences is not None:
        n_seq = sequences
    elif curve_rule(data) == "cold":
        n_seq = COLD_FIT_SEQUENCES
    else:
        n_seq = min(recorded.get("sequences", 12), 12)
    p_tok = prompt_tokens if prompt_tokens is not None else recorded.get("prompt_tokens", 256)
    o_tok = output_tokens if output_tokens is not None else recorded.get("output_tokens", 512)
    if n_seq < 1 or p_tok < 1 or o_tok < 2:
        raise UserError(
            "synth fit: need --sequences >= 1, --prompt-tokens >= 1, --output-tokens >= 2"
        )
    return n_seq, p_tok, o_tok


def _print_fit(result: Any) -> None:
    """Each fitted statistic's target, what the fit achieved and the error, as text."""
    errors = result.errors
    for key, goal in result.targets.items():
        err = errors[key]
        click.echo(
            f"  {key:<36} target {goal:.4f}  achieved {result.achieved[key]:.4f}  error "
            + ("-" if err is None else f"{err:+.4f}")
        )
    if result.ignored:
        click.echo("  ignored: " + ", ".join(result.ignored))
