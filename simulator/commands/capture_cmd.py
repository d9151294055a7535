"""``daopsim capture``: record a routing trace from a real (or tiny random) MoE model."""

from __future__ import annotations

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.output import TRACE_FORMATS, check_output_file, os_errors, output_format
from daopsim.simulator.trace_format import ALL_PROBS_MAX_EXPERTS, DEFAULT_TOP_M


@click.command("capture")
@click.option(
    "--model",
    "model",
    metavar="ID_OR_DIR",
    help="Hugging Face model id or local directory with the weights.",
)
@click.option(
    "--random-init",
    "random_init",
    metavar="FAMILY",
    help="Build a tiny random model of this family instead (mixtral, qwen2_moe, "
    "qwen3_moe, olmoe, phimoe, deepseek_v3, gpt_oss).",
)
@click.option(
    "--prompts",
    "prompts",
    required=True,
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="Prompts: .jsonl (a 'prompt' or 'text' field) or .txt (one per line).",
)
@click.option(
    "--max-new-tokens",
    default=64,
    show_default=True,
    type=int,
    help="Generated tokens per sequence (one decode row each).",
)
@click.option(
    "--batch-size",
    default=1,
    show_default=True,
    type=int,
    help="Prompts per generate call (left padding; padding rows are dropped).",
)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32"]),
    default=None,
    help="Weights precision [default: bf16 on cuda, fp32 on cpu].",
)
@click.option("--limit", type=int, default=None, help="Use only the first N prompts.")
@click.option(
    "--max-prompt-tokens", type=int, default=None, help="Cut each prompt to its first N tokens."
)
@click.option(
    "--stop-at-eos",
    is_flag=True,
    help="Let end-of-sequence end a sequence early (default: min = max new tokens, "
    "the DAOP protocol).",
)
@click.option(
    "--top-m",
    type=int,
    default=DEFAULT_TOP_M,
    show_default=True,
    help=f"Router probabilities kept per row when a layer has more than "
    f"{ALL_PROBS_MAX_EXPERTS} experts.",
)
@click.option("--revision", default=None, help="Model revision (branch, tag or commit).")
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed for --random-init weights."
)
@click.option("--no-progress", is_flag=True, help="Do not show the progress bar.")
@click.option(
    "-o",
    "--output",
    required=True,
    help="Trace file to write (Parquet; written atomically).",
)
@json_option
def capture(
    model: str | None,
    random_init: str | None,
    prompts: str,
    max_new_tokens: int,
    batch_size: int,
    device: str,
    dtype: str | None,
    limit: int | None,
    max_prompt_tokens: int | None,
    stop_at_eos: bool,
    top_m: int,
    revision: str | None,
    seed: int,
    no_progress: bool,
    output: str,
    as_json: bool,
) -> None:
    """Record prefill and decode routing of a MoE model into a trace.

    Hooks every MoE router while the model generates greedily for each prompt. Loading never
    reaches the network when HF_HUB_OFFLINE is set or --model is a local directory.
    """
    from daopsim.simulator.capture import CaptureConfig, result_summary, run_capture
    from daopsim.simulator.capture_generate import GenerationSettings

    cfg = CaptureConfig(
        output=output,
        prompts=prompts,
        model=model,
        random_init=random_init,
        seed=seed,
        revision=revision,
        device=device,
        dtype=dtype,
        limit=limit,
        generation=GenerationSettings(
            max_new_tokens=max_new_tokens,
            stop_at_eos=stop_at_eos,
            batch_size=batch_size,
            max_prompt_tokens=max_prompt_tokens,
        ),
        top_m=top_m,
        progress=not no_progress and not as_json,
    )
    output_format(output, TRACE_FORMATS, "-o")
    check_output_file(output, "-o", inputs=[prompts])
    with os_errors(output, "-o"):
        result = run_capture(cfg)
    if as_json:
        echo_json(result_summary(result))
        return
    c = result.meta.counts
    click.echo(
        f"wrote {result.path}: {c['sequences']} sequences, {c['prefill_tokens']} prefill and "
        f"{c['decode_tokens']} decode tokens, {result.meta.model.moe_layers} MoE layers "
        f"({result.meta.model.name}, {result.meta.model.experts} experts, "
        f"top-{result.meta.model.top_k})"
    )
