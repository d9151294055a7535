"""``daopsim check``: run a random-weight MoE for real on this machine, simulate the same run
on its probed profile, and compare (the closed loop: docs/cost-model.md, "Checking your
machine")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.commands.probe_cmd import make_shape, parse_tokens, shape_options
from daopsim.simulator.errors import ExitCode, UserError


def _slots(text: str) -> tuple[int, ...]:
    if not text.strip() or text.strip() == "none":
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--slots {text!r}: expected comma-separated integers") from None


def prompt_tokens_list(prompt: int) -> tuple[int, ...]:
    """Token counts of the module tables a prompt of ``prompt`` tokens needs: 1, 2, 4, ...
    and the prompt itself."""
    out, t = [1], 2
    while t < prompt:
        out.append(t)
        t *= 2
    if prompt > 1:
        out.append(prompt)
    return tuple(out)


@click.command("check")
@click.option(
    "--model",
    default="mixtral-8x7b",
    show_default=True,
    metavar="NAME",
    help="Catalogue model whose architecture to build (mixtral, qwen3_moe, olmoe families).",
)
@shape_options
@click.option("--prompt-tokens", type=int, default=32, show_default=True)
@click.option("--new-tokens", type=int, default=32, show_default=True, help="Decode passes.")
@click.option("--repeats", type=int, default=5, show_default=True, help="Timed runs per mode.")
@click.option(
    "--slots",
    default="4,2,1",
    show_default=True,
    help="Expert slots per layer of each offloading mode ('none': all-resident only).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--hw",
    default=None,
    metavar="FILE",
    help='A probed hardware profile with [measured."<model>"] (default: probe now).',
)
@click.option("--runtime", default=None, metavar="FILE", help="Its runtime profile (with --hw).")
@click.option("--quick-probe", is_flag=True, help="Probe with fewer repeats (tests).")
@click.option(
    "--token-tolerance", type=float, default=0.10, show_default=True, help="Per-token latency."
)
@click.option("--ttft-tolerance", type=float, default=0.15, show_default=True)
@click.option("--no-breakdown", is_flag=True, help="Skip the torch-profiler breakdown runs.")
@click.option(
    "-o",
    "--output-dir",
    "out_dir",
    default="daopsim-check",
    show_default=True,
    metavar="DIR",
    help="Folder for the probed profiles, the recorded trace and check.json.",
)
@click.option("--no-progress", is_flag=True, help="Do not print the stages.")
@json_option
def check(
    model: str,
    prompt_tokens: int,
    new_tokens: int,
    repeats: int,
    slots: str,
    seed: int,
    hw: str | None,
    runtime: str | None,
    quick_probe: bool,
    token_tolerance: float,
    ttft_tolerance: float,
    no_breakdown: bool,
    out_dir: str,
    no_progress: bool,
    as_json: bool,
    **shape_kw: Any,
) -> None:
    """Check daopsim's prediction on this machine (the closed loop).

    Builds a random-weight MoE shaped like --model (scaled by the shape options), probes its
    modules on this machine (unless --hw/--runtime give a probe's profiles), records its
    routing, decodes greedily for real all-resident and with each number of --slots per layer
    (misses copy the expert's weights into a slot), and simulates each run on the probed
    profiles. Compares per-token latency and time to first token in thread CPU time; exits 1
    when a mode is beyond a tolerance. Without a GPU the CPU stands in for one (one PyTorch
    thread is the device, copies between two pools of host memory the link).
    """
    from daopsim.simulator.closed_loop import CheckSpec, run_check
    from daopsim.simulator.runtime_profiles import get_runtime

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise UserError(
            "check needs torch and transformers: pip install 'daopsim[capture]'"
        ) from None
    shape = make_shape(model, shape_kw)
    spec = CheckSpec(
        shape=shape,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        repeats=repeats,
        slots=_slots(slots),
        seed=seed,
        token_tolerance=token_tolerance,
        ttft_tolerance=ttft_tolerance,
        breakdown=not no_breakdown,
    )
    if (hw is None) != (runtime is None):
        raise UserError("give --hw and --runtime together (both from one probe), or neither")
    out = Path(out_dir)
    from daopsim.simulator.output import os_errors

    with os_errors(out, "-o"):  # an unusable folder fails before minutes of work
        out.mkdir(parents=True, exist_ok=True)

    def say(what: str) -> None:
        if not no_progress:
            click.echo(f"check: {what}", err=True)

    if hw is None or runtime is None:
        say("probe this machine and the model's modules")
        hw, runtime = _probe_here(shape, quick_probe, prompt_tokens, out)
    hw_prof = _probed_profile(hw, shape, model)
    rt = get_runtime(runtime)
    result = run_check(spec, hw_prof, rt, out / "trace.parquet", hw, runtime, progress=say)
    from daopsim.simulator.commands.common import dumps
    from daopsim.simulator.output import write_text

    doc = result.to_dict()
    write_text(out / "check.json", dumps(doc) + "\n", "-o")
    if as_json:
        echo_json(doc)
    else:
        _table(doc)
    if not result.ok:
        raise SystemExit(int(ExitCode.FAILED))


def _probe_here(shape: Any, quick: bool, prompt_tokens: int, out: Path) -> tuple[str, str]:
    """Probe this machine and the model's modules (the CPU standing in for the device); the
    hardware and runtime profiles written under ``out/probe``."""
    from daopsim.simulator.probe import ProbeOptions, run_probe, write_probe

    opts = ProbeOptions(
        quick=quick,
        model=shape,
        tokens=parse_tokens(",".join(map(str, prompt_tokens_list(prompt_tokens)))),
        device="cpu",
    )
    res = run_probe(opts)
    paths = write_probe(res, out / "probe", "this-host")
    return str(paths["hardware"]), str(paths["runtime"])


def _probed_profile(hw: str, shape: Any, model: str) -> Any:
    """The hardware profile ``hw``, refused unless a probe measured this model's modules."""
    from daopsim.simulator.hardware import load_profile

    hw_prof = load_profile(hw)
    if hw_prof.measured.get(shape.name.lower()) is None:
        raise UserError(
            f'{hw}: no [measured."{shape.name}"] table; probe with --model {model} and the '
            "same shape options, or leave --hw out to probe now"
        )
    return hw_prof


def _table(doc: dict[str, Any]) -> None:
    m = doc["model"]
    click.echo(
        f"{m['name']}: {m['expert_bytes'] / 1e6:.2f} MB experts; prompt {doc['prompt_tokens']}, "
        f"{doc['new_tokens']} new tokens, {doc['repeats']} repeats; load "
        f"{doc['conditions']['before']['loadavg']} -> {doc['conditions']['after']['loadavg']}"
    )
    click.echo(f"compared in {doc['compared_in']}; profiles {doc['hw']}, {doc['runtime']}")
    click.echo(
        f"{'mode':<14}{'token ms':>10}{'sim':>9}{'err':>8}   {'TTFT ms':>9}{'sim':>9}{'err':>8}"
        f"   {'misses':>7}{'sim':>6}  ok"
    )
    for r in doc["modes"]:
        me, si = r["measured"], r["simulated"]
        click.echo(
            f"{r['mode']:<14}{me['token_ms_cpu']:>10.2f}{si['token_ms']:>9.2f}"
            f"{r['token_error'] * 100:>+7.1f}%   {me['ttft_ms_cpu']:>9.2f}{si['ttft_ms']:>9.2f}"
            f"{r['ttft_error'] * 100:>+7.1f}%   {me['fetches']:>7}{si['fetches']:>6}  "
            f"{'yes' if r['ok'] else 'NO'}"
        )
    click.echo(
        f"tolerance: token {doc['tolerance']['token']:.0%}, TTFT {doc['tolerance']['ttft']:.0%}"
    )
    rows = [r for r in doc["modes"] if "profiler_per_run_ms" in r["measured"]]
    if not rows:
        return
    click.echo(
        "where a run's time goes, share of the run (measured: torch profiler, wall time with "
        "its overhead / simulated: busy time)"
    )
    click.echo(f"{'mode':<14}{'experts':>16}{'copies':>16}{'the rest':>16}")
    for r in rows:
        me, si = r["measured"]["profiler_per_run_ms"], r["simulated"]["per_run_ms"]
        mt = max(1e-9, me["experts"] + me["copies"] + me["nonexpert"])
        st = max(1e-9, si["experts"] + si["copies"] + si["nonexpert"])
        cells = [f"{me[k] / mt:.0%} / {si[k] / st:.0%}" for k in ("experts", "copies", "nonexpert")]
        click.echo(f"{r['mode']:<14}" + "".join(f"{c:>16}" for c in cells))
