"""``daopsim probe``: measure this machine and write its hardware and runtime profiles."""

from __future__ import annotations

import itertools
import platform
import re
from collections.abc import Callable
from typing import Any

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.errors import UserError


def shape_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The model-shape options ``probe`` and ``check`` share (a catalogue model, scaled)."""
    opts = [
        click.option("--layers", type=int, default=None, help="Layers (default: the model's)."),
        click.option("--hidden", type=int, default=None, help="Hidden size."),
        click.option("--expert-ffn", type=int, default=None, help="Expert FFN width."),
        click.option("--experts", type=int, default=None, help="Routed experts per layer."),
        click.option("--top-k", type=int, default=None, help="Experts per token."),
        click.option(
            "--vocab", type=int, default=None, help="Vocabulary (default: at most 32000)."
        ),
        click.option(
            "--dtype",
            type=click.Choice(["fp32", "bf16"]),
            default="fp32",
            show_default=True,
            help="Weights precision of the random model.",
        ),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def make_shape(model: str, kw: dict[str, Any]) -> Any:
    """The LoopShape of ``--model`` and the shape options."""
    from daopsim.simulator.hf_models import scaled_shape

    return scaled_shape(
        model,
        layers=kw["layers"],
        hidden=kw["hidden"],
        expert_ffn=kw["expert_ffn"],
        experts=kw["experts"],
        top_k=kw["top_k"],
        vocab=kw["vocab"],
        dtype=kw["dtype"],
    )


def parse_tokens(text: str | None) -> tuple[int, ...] | None:
    """``--tokens 1,2,4,8``: strictly increasing token counts starting at 1."""
    if text is None:
        return None
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--tokens {text!r}: expected comma-separated integers") from None
    if not out or out[0] != 1 or any(b <= a for a, b in itertools.pairwise(out)):
        raise UserError(f"--tokens {text!r}: must start at 1 and increase strictly")
    return out


def default_name() -> str:
    """``probe-<host name>``, safe as a file name."""
    host = re.sub(r"[^A-Za-z0-9_.-]+", "-", platform.node() or "host").strip("-.") or "host"
    return f"probe-{host.lower()}"


@click.command("probe")
@click.option(
    "-o",
    "--output-dir",
    "out_dir",
    default=".",
    show_default=True,
    metavar="DIR",
    help="Folder for NAME.toml (hardware), NAME.runtime.toml and NAME.probe.json.",
)
@click.option("--name", default=None, help="Profile name [default: probe-<host name>].")
@click.option("--quick", is_flag=True, help="Fewer repeats, no thread sweep, fp32 only.")
@click.option(
    "--model",
    default=None,
    metavar="NAME",
    help="Also time the modules of this catalogue model (scaled by the shape options) and "
    'write them as [measured."<model>"] (what `daopsim check` uses).',
)
@shape_options
@click.option(
    "--tokens",
    default=None,
    metavar="N,N,...",
    help="Token counts of the model's module tables [default: 1,2,4,8,16,32,64].",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="auto: a GPU when PyTorch sees one, else the CPU stands in; cpu: the CPU even then.",
)
@click.option("--no-progress", is_flag=True, help="Do not show the progress bar.")
@json_option
def probe(
    out_dir: str,
    name: str | None,
    quick: bool,
    model: str | None,
    tokens: str | None,
    device: str,
    no_progress: bool,
    as_json: bool,
    **shape_kw: Any,
) -> None:
    """Measure this machine and write its profiles.

    Detects the CPU, memory and GPU, times weight streams, copies, GEMMs and PyTorch's host
    costs per module, and writes DIR/NAME.toml (use it as `--hw`), DIR/NAME.runtime.toml
    (`--runtime`) and DIR/NAME.probe.json. Without a GPU the CPU stands in for one: one
    PyTorch thread is the device, copies between two pools of host memory the link.
    docs/hardware-profiles.md, "Probing your machine".
    """
    from daopsim.simulator.probe import (
        ProbeOptions,
        output_paths,
        run_probe,
        steps,
        summary,
        write_probe,
    )
    from daopsim.simulator.progress import Progress

    name = name or default_name()
    output_paths(out_dir, name)  # a bundled name or folder fails before any work
    if model is None and any(v is not None for k, v in shape_kw.items() if k != "dtype"):
        raise UserError("--layers, --hidden, ... shape a --model; give --model too")
    shape = make_shape(model, shape_kw) if model is not None else None
    opts = ProbeOptions(quick=quick, model=shape, tokens=parse_tokens(tokens), device=device)
    with Progress(steps(opts), "probe", enabled=not no_progress) as bar:
        res = run_probe(opts, tick=bar.update)
    paths = write_probe(res, out_dir, name)
    files = {role: str(p) for role, p in paths.items()}
    if as_json:
        echo_json({"name": name, "files": files, "summary": summary(res), **res.to_dict()})
        return
    s = summary(res)
    click.echo(
        f"probe {name}: {s.get('cpu')} ({s.get('cores')} cores, {s.get('threads')} "
        f"threads, L3 {s.get('l3_mb', 0):.0f} MiB, {s.get('memory_gb', 0):.1f} GB), "
        f"device {res.device}, {res.elapsed_s:.0f} s"
    )
    for key, label in (
        ("standin_stream_gbs", "weight stream, 1 thread"),
        ("read_gbs_all_cores", "read stream, all cores"),
        ("standin_copy_gbs", "copy, 1 thread"),
    ):
        if key in s:
            click.echo(f"  {label:<26} {s[key]:8.2f} GB/s")
    for role, path in files.items():
        click.echo(f"  {role:<9} {path}")
    missing = res.not_measured()
    if missing:
        click.echo("  not measured here:")
        for key, why in sorted(missing.items()):
            click.echo(f"    {key}: {why}")
