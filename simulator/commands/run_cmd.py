"""``daopsim run``: one policy on one machine over a trace; a table, JSON and output files."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.errors import DoesNotFit, UserError, parse_key_values
from daopsim.simulator.metrics import table_rows
from daopsim.simulator.output import (
    TABLE_FORMATS,
    Output,
    check_outputs,
    output_format,
    scratch_dir,
    value_paths,
    write_table,
)
from daopsim.simulator.progress import lazy_progress
from daopsim.simulator.results import RUN_FILES


def parse_options(pairs: tuple[str, ...]) -> dict[str, str]:
    """``key=value`` strings to a dict (values stay strings; the policy coerces them)."""
    return parse_key_values(pairs, "--policy-opt")


def _fmt(value: Any, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, int):
        return f"{value:,}{unit}"
    if abs(value) >= 100:
        return f"{value:,.1f}{unit}"
    return f"{value:.4g}{unit}"


#: rows that add up each GPU stream's waiting (with several GPUs, more than the run's time)
PER_STREAM_ROWS = ("stall_s", "dispatch_stall_s")
#: rows shown only when the run has a host-memory budget (docs/serving.md, "An SSD tier")
SSD_ROWS = ("ssd_bytes", "ssd_stall_s", "host_memory_peak_bytes")


def compute_bounds(result: Any, **run_args: Any) -> dict[str, dict[str, Any]]:
    """The bounds shown beside a result, on the same trace, machine and sequences.

    all-gpu: every expert resident, at the run's precisions on its machine, under the fastest
    of the run's runtime and the bundled ones (:mod:`daopsim.simulator.bounds`; docs/metrics.md,
    "Bounds"). belady_per_layer: clairvoyant MIN replacement in per-layer caches sharing the run's
    GPU expert budget evenly (the bound of ``lru``, ``lfu``, ``round-robin``). belady_global
    (only beside a caching policy): clairvoyant MIN in one cache over all layers with the same
    budget (the bound of ``global-lru``, ``global-lfu``). ``belady`` repeats belady_per_layer
    for readers of older output. ``run_args``: the run's ``simulate()`` keywords (``hw`` and
    ``trace`` among them); the bounds share those the declaration marks for the bounds
    (simulator/run_params.py, ``bounds=``), the all-GPU bound and the Belady runs alike.
    """
    from daopsim.policies.caching import CachingPolicy, GlobalCachingPolicy
    from daopsim.policies.registry import get_policy_class
    from daopsim.simulator.bounds import bound_for_result
    from daopsim.simulator.run_params import bound_arguments
    from daopsim.simulator.runner import simulate

    shared = bound_arguments(run_args, result.config)
    common = {
        **shared,
        # the bounds evaluate exactly the run's sequences (they use no calibration data, so
        # their own default would evaluate every sequence)
        "evaluate": result.config["sequence_ids"],
        "record": False,
    }
    out: dict[str, dict[str, Any]] = {}
    own = result.config["policy"]
    out["all-gpu"] = bound_for_result(result, **shared).to_dict()
    budget = result.config["gpu_experts"]

    def belady(name: str, scope: str) -> dict[str, Any]:
        if own == name:
            run = result
        else:
            try:
                run = simulate(policy=name, gpu_experts=budget, **common)
            except DoesNotFit as exc:
                # a policy without a temporary buffer (ktransformers) may hold one expert more
                # than belady can: bound it at what fits beside belady's buffer instead
                if exc.max_experts <= 0:
                    raise
                run = simulate(policy=name, gpu_experts=exc.max_experts, **common)
        return {
            "hit_rate": run.metrics["hit_rate"],
            "policy": name,
            "scope": scope,
            "gpu_experts": run.config["gpu_experts"],
        }

    out["belady_per_layer"] = belady("belady", "per layer")
    if issubclass(get_policy_class(own), CachingPolicy | GlobalCachingPolicy):
        out["belady_global"] = belady("belady-global", "global")
    if result.metrics.get("routing_replaced_frac"):
        # the bounds replay the trace's routing; a run that replaced it (a prediction, a
        # substitution such as cache-conditional's) may hit more often than they do
        for key in ("belady_per_layer", "belady_global"):
            if key in out:
                out[key]["routing"] = REPLACED_ROUTING_NOTE
    out["belady"] = dict(out["belady_per_layer"])
    return out


#: what the Belady bounds say beside a run that replaced the trace's routing
REPLACED_ROUTING_NOTE = (
    "the trace's routing; this run replaced some of it, so its hit rate may exceed the bound"
)


def load_run_config(path: str, chosen: str | None = None) -> dict[str, Any]:
    """A ``run --config`` file: the keys of a sweep grid (docs/sweeps.md), each with one value
    (a one-point grid), as ``run`` parameters (``options``: the policy's options).

    The keys are the declared run parameters' grid keys (simulator/run_params.py). Relative
    paths are relative to the file, as in a grid file. A key with several values, or two
    memory points, is a one-line error naming the key. ``chosen`` is the policy given on the
    command line instead of the file's: options scoped to another policy stay with it (as
    ``sweep --policies`` drops the options of the policies it leaves out)."""
    from daopsim.simulator.grid import load_grid_file

    grid, out = load_grid_file(path)
    memory = [*grid.cache_ratios, *grid.gpu_experts]
    params = _one_value_each(path, grid, skip=("cache_ratio", "gpu_experts"))
    if len(memory) > 1:
        raise UserError(
            f"{path}: keys 'cache_ratios'/'gpu_experts' give {len(memory)} memory points; "
            "a run takes one"
        )
    for name in ("cache_ratio", "gpu_experts"):
        values = getattr(grid, name + "s" if name == "cache_ratio" else name)
        if values:
            params[name] = values[0]
    if out is not None:
        params["out_dir"] = out
    params["options"] = _config_options(path, grid, chosen or params.get("policy"), chosen)
    return params


def _one_value_each(path: str, grid: Any, skip: tuple[str, ...]) -> dict[str, Any]:
    """The grid's declared keys as one value each (an axis given several is an error); a
    scalar key at its default is left out, so the command line's default stands."""
    from daopsim.simulator.run_params import grid_params

    params: dict[str, Any] = {}
    for p in grid_params():
        if p.name in skip:
            continue
        value = getattr(grid, str(p.grid_attr))
        if p.axis:
            values = list(dict.fromkeys(value))
            if len(values) > 1:
                raise UserError(
                    f"{path}: key {p.grid!r} has {len(values)} values; a run takes one "
                    "(use `daopsim sweep` for several)"
                )
            if values:
                params[p.name] = values[0]
        elif value is not None and value != p.default:
            params[p.name] = value
    return params


def _config_options(path: str, grid: Any, policy: str | None, chosen: str | None) -> dict[str, Any]:
    """The policy options of a ``run --config`` file, one value each."""
    declared: dict[str, Any] = {}
    if policy is not None:
        from daopsim.policies.registry import get_policy_class

        declared = get_policy_class(policy).params
    options: dict[str, Any] = {}
    for name, values in grid.options.items():
        scope, dot, opt = name.rpartition(".")
        if dot and scope != policy:
            if chosen is not None:
                continue  # the file's options of a policy the command line left out
            raise UserError(f"{path}: option {name!r} is for policy {scope!r}, not {policy!r}")
        if not dot and name not in declared:
            continue  # a grid applies an unscoped option to the policies that declare it
        if len(values) > 1:
            raise UserError(f"{path}: option {name!r} has {len(values)} values; a run takes one")
        options[opt if dot else name] = values[0]
    return options


def budget_line(doc: dict[str, Any]) -> str:
    """The header line on GPU experts: what the policy kept resident (the most slots it held
    at once, ``max_slots_held``) apart from the budget it was given, and what fits; with
    several GPUs the fit is per GPU and says so (docs/metrics.md, "Budget and residency")."""
    total, budget = doc["total_experts"], doc["gpu_experts"]
    held = (doc.get("metrics") or {}).get("max_slots_held")
    mg = doc.get("multi_gpu")
    fit = f"{doc['max_gpu_experts']} fit in {'each GPU' if mg else 'memory'}"
    line = "GPU experts: "
    if held is not None:
        line += f"{held} resident at most, "
    line += f"budget {budget} of {total}"
    if mg:
        line += f" over {mg['gpus']} GPUs"
    line += f" (cache ratio {doc['cache_ratio']:.3f}; {fit})"
    fixed = doc.get("fixed_residency")
    if fixed is not None:
        line += f"; the policy's options fix {fixed} resident experts"
        if fixed < budget:
            line += f", so {budget - fixed} of the budget go unused"
    return line


def render_table(doc: dict[str, Any]) -> str:
    """The readable summary printed by ``daopsim run``."""
    m = doc["metrics"]
    n_seq = doc["sequences"]
    head = (
        f"policy {doc['policy']} on {doc['hw']} | model {doc['model']} ({doc['dtype']}) | "
        f"trace {doc['trace']} ({n_seq} sequence{'' if n_seq == 1 else 's'})\n" + budget_line(doc)
    )
    if doc.get("bound"):
        head += "\nthis result is a BOUND (clairvoyant or unlimited memory), not a real policy"
    head += f"\ncalibration {doc.get('calibration')} | seed {doc.get('seed')}"
    if doc.get("runtime"):
        head += f" | runtime {doc['runtime']['name']}"
    mg = doc.get("multi_gpu")
    if mg:  # several GPUs: placement, peer path and each GPU's share
        shares = ", ".join(
            f"gpu{g['gpu']} {g['slots']} slots, busy {g['busy_s']:.3g} s" for g in mg["per_gpu"]
        )
        head += (
            f"\n{mg['gpus']} GPUs, {mg['mode']} placement, peer {mg['peer_kind']} "
            f"({mg['peer_bytes_total'] / 1e6:.1f} MB between GPUs): {shares}"
        )
    for note in doc.get("notes") or []:
        head += f"\nnote: {note}"
    lines = [head, "", "  simulated run (every time below is simulated time, not this computer's)"]
    n_gpus = int(mg["gpus"]) if mg else 1
    for key, label, unit, scale in table_rows():
        value = m.get(key)
        if key not in m and key in SSD_ROWS:  # no host-memory budget: no SSD tier rows
            continue
        if isinstance(value, int | float) and not isinstance(value, bool) and scale != 1:
            value = value * scale
        note = ""
        if key in PER_STREAM_ROWS and n_gpus > 1:
            # each GPU's stream waits on its own: the sum can exceed the run's time
            note = f"  (summed over the {n_gpus} GPUs' streams)"
        lines.append(f"  {label:<28} {_fmt(value, unit)}{note}")
    sv = doc.get("serving")
    if sv:
        lines += ["", f"  serving: {render_serving(sv)}"]
    b = doc.get("bounds")
    if b:
        ag = b["all-gpu"]
        gpu_tps = ag["tokens_per_s"]
        share = m["tokens_per_s"] / gpu_tps if gpu_tps else float("nan")
        lines += [
            "",
            "  bounds (same trace, machine and precisions)",
            f"  {'all-GPU tokens/s':<28} {_fmt(gpu_tps)}  (this run: {share:.1%} of it)",
        ]
        if "runtime" in ag:  # which runtime the bound ran on (docs/metrics.md, "Bounds")
            how = f"every expert resident, runtime {ag['runtime']}"
            if ag.get("dtype") not in (None, doc["dtype"]):
                how += f", experts at {ag['dtype']} (the host copies' precision)"
            if ag.get("own_runtime") not in (None, ag["runtime"]):
                how += (
                    f" (the fastest; on this run's runtime {ag['own_runtime']}: "
                    f"{_fmt(ag['own_tokens_per_s'])})"
                )
            lines.append(f"  {'':<28} {how}")
        per_layer = b.get("belady_per_layer") or b["belady"]
        lines.append(
            f"  {'belady (per layer) hit rate':<28} {_fmt(per_layer['hit_rate'])}"
            f"  (clairvoyant, per-layer caches sharing "
            f"{per_layer.get('gpu_experts', doc['gpu_experts'])} GPU experts)"
        )
        if "belady_global" in b:
            lines.append(
                f"  {'belady-global hit rate':<28} {_fmt(b['belady_global']['hit_rate'])}"
                f"  (clairvoyant, one cache of "
                f"{b['belady_global'].get('gpu_experts', doc['gpu_experts'])} GPU experts over "
                "all layers)"
            )
        if per_layer.get("routing"):
            lines.append(f"  {'':<28} Belady bounds: {per_layer['routing']}")
    return "\n".join(lines)


def render_serving(sv: dict[str, Any]) -> str:
    """The serving section of the table: batching, per-request percentiles, goodput."""

    def pcts(d: dict[str, Any], scale: float, unit: str) -> str:
        return " / ".join(
            _fmt(None if d[k] is None else d[k] * scale, unit) for k in ("p50", "p90", "p99")
        )

    slo = ", ".join(
        f"{name} <= {sv[key]} s"
        for name, key in (("TTFT", "slo_ttft_s"), ("TPOT", "slo_tpot_s"))
        if sv.get(key) is not None
    )
    rows = [
        f"{sv['mode']} batching, up to {sv['max_batch']} requests; arrivals {sv['arrivals']}",
        f"  {'requests':<28} {sv['requests']} (mean batch {sv['mean_batch']:.2f})",
        f"  {'generated tokens/s':<28} {_fmt(sv['throughput_tokens_per_s'])}",
        f"  {'TTFT p50/p90/p99':<28} {pcts(sv['ttft_s'], 1.0, ' s')}",
        f"  {'TPOT p50/p90/p99':<28} {pcts(sv['tpot_s'], 1e3, ' ms')}",
        f"  {'latency p50/p90/p99':<28} {pcts(sv['latency_s'], 1.0, ' s')}",
        f"  {'SLO attainment':<28} {_fmt(sv['slo_attainment'])}"
        + (f" ({slo})" if slo else " (no SLO given)"),
        f"  {'goodput':<28} {_fmt(sv['goodput_requests_per_s'])} requests/s",
        f"  {'KV cache':<28} {_fmt(sv['kv_cache_tokens'])} tokens, peak "
        f"{_fmt(sv['kv_peak_tokens'])}",
    ]
    if sv.get("static_prefill") is not None:
        rows.append(
            f"  {'static-batch prefill':<28} {sv['static_prefill']} "
            f"({sv.get('batched_prefills', 0)} batched prefill steps)"
        )
    if sv.get("prefill_chunk") is not None:
        rows.append(
            f"  {'chunked prefill':<28} {sv['prefill_chunk']} tokens per step, "
            f"{sv['mixed_steps']} mixed steps"
        )
    if sv.get("preemptions") or sv.get("kv_allocation", "").startswith("as written"):
        rows.append(
            f"  {'preemptions':<28} {sv['preemptions']} ({sv['preempted_kv_tokens']} KV "
            "tokens recomputed)"
        )
    return "\n".join(rows)


def declared_option(p: Any) -> Callable[[Any], Any]:
    """The click option of one declared run parameter (simulator/run_params.py): its flag,
    type, default and help text from the declaration."""
    kw: dict[str, Any] = {"default": p.default, "help": p.doc}
    if p.kind is bool:
        kw["is_flag"] = True
    elif p.choices is not None:
        kw["type"] = click.Choice(list(p.choices))
    elif p.kind is not None:
        kw["type"] = p.kind
    if p.show_default:
        kw["show_default"] = True
    if p.metavar is not None:
        kw["metavar"] = p.metavar
    return click.option(p.flag, p.name, **kw)


#: ``daopsim run``'s own options: what the command does with the run (its outputs, the
#: bounds beside it, the policy options as KEY=VALUE, a config file), not run parameters
COMMAND_OPTIONS: tuple[Callable[[Any], Any], ...] = (
    click.option(
        "--policy-opt", "policy_opts", multiple=True, metavar="KEY=VALUE",
        help="Policy option (repeatable).",
    ),
    click.option(
        "--out", "-o", "out_dir", default=None,
        help="Write metrics.json, timeline.parquet, a Perfetto trace and plots to this folder.",
    ),
    click.option("--no-progress", is_flag=True, help="Do not show a progress bar."),
    click.option(
        "--bounds/--no-bounds", default=True, show_default=True,
        help="Also report the all-GPU throughput bound and the Belady hit-rate bounds "
        "(per layer; and global, beside a caching policy).",
    ),
    click.option(
        "--requests-out", default=None, metavar="FILE",
        help="Write one row per request (.csv or .parquet) in a serving run.",
    ),
    click.option(
        "--config", "config", default=None, metavar="FILE.toml",
        help="Take the run from a TOML file with the keys of a sweep grid, one value each "
        "(docs/sweeps.md, 'Grid files'); options given here override it.",
    ),
    json_option,
)  # fmt: skip
#: the command options' parameter names
_COMMAND_NAMES = ("policy_opts", "out_dir", "no_progress", "bounds", "requests_out", "config")


def build_run_command() -> click.Command:
    """``daopsim run``: an option per declared run parameter with a flag, then the command's
    own options (built when called, from the declaration as it stands)."""
    from daopsim.simulator.run_params import run_params

    func: Any = _run
    for opt in reversed([*(declared_option(p) for p in run_params() if p.flag), *COMMAND_OPTIONS]):
        func = opt(func)
    return click.command("run")(func)


def _run(as_json: bool, **given: Any) -> None:
    """Simulate one policy on one machine over a routing trace."""
    cmd = {k: given.pop(k) for k in _COMMAND_NAMES}
    options: dict[str, Any] = {}
    if cmd["config"] is not None:
        options = _apply_config(cmd, given)
    options.update(parse_options(cmd["policy_opts"]))
    policy = given["policy"]
    if "," in policy and not policy.endswith(".py") and ".py:" not in policy:
        raise UserError(
            f"--policy {policy}: run takes one policy; to run several side by side: "
            f"daopsim compare --policies {policy}"
        )
    if given["model"] is not None:  # the synthetic trace, so the bounds below run on it too
        from daopsim.simulator.trace_cache import model_trace

        given["trace"], given["model"] = model_trace(given["model"], given["trace"]), None
    result = _simulate_run(cmd, given, options)
    doc = result.to_dict()
    if as_json:
        echo_json(doc)
        return
    click.echo(render_table(doc))
    if cmd["out_dir"] is not None:
        click.echo(
            f"\nwrote {cmd['out_dir']}/: metrics.json timeline.parquet trace.perfetto.json.gz "
            "gantt.png hit_rate.png" + (" requests.parquet" if result.requests is not None else "")
        )


def _apply_config(cmd: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """Fill ``given`` (and ``cmd``'s ``out_dir``) from ``--config``: the command line wins over
    the file; a budget given on the command line replaces the file's other kind. Returns the
    file's policy options."""
    ctx = click.get_current_context()

    def on_line(name: str) -> bool:
        return ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE

    from_file = load_run_config(cmd["config"], given["policy"] if on_line("policy") else None)
    options: dict[str, Any] = from_file.pop("options")
    for name, value in from_file.items():
        target = cmd if name in cmd else given
        if not on_line(name):
            target[name] = value
    if on_line("cache_ratio") and "gpu_experts" in from_file:
        given["gpu_experts"] = None
    if on_line("gpu_experts") and "cache_ratio" in from_file:
        given["cache_ratio"] = None
    return options


def _simulate_run(cmd: dict[str, Any], given: dict[str, Any], options: dict[str, Any]) -> Any:
    """Check the outputs, run ``simulate()`` with the run parameters given (and the bounds
    beside it), write the outputs; returns the result."""
    from daopsim.simulator.run_params import run_params
    from daopsim.simulator.runner import simulate
    from daopsim.simulator.serving_config import serving_config

    serving = serving_config(**{p.name: given[p.name] for p in run_params("serving")})
    run_args = {p.name: given[p.name] for p in run_params("run") if p.flag}
    out_dir, requests_out = cmd["out_dir"], cmd["requests_out"]
    # a policy option naming a file (learned's model=FILE), from the command line or the
    # config file, is an input too
    inputs = (
        *(given[p.name] for p in run_params() if p.input), cmd["config"], *value_paths(options),
    )  # fmt: skip
    _check_run_outputs(serving, out_dir, requests_out, inputs)
    enabled = not cmd["no_progress"] and sys.stderr.isatty()
    with contextlib.ExitStack() as stack:
        record: bool | Path = False
        if out_dir is not None:
            # the timeline streams to a file beside the output as the run goes (memory stays
            # flat), and RunResult.write links it into the new set
            record = stack.enter_context(scratch_dir(out_dir, "--out")) / "timeline.parquet"
        with lazy_progress("sequences", enabled) as progress:
            result = simulate(
                **run_args, policy_options=options, record=record, progress=progress,
                serving=serving,
            )  # fmt: skip
        # the bounds are single-sequence, one-GPU runs
        if cmd["bounds"] and serving is None and run_args["gpus"] == 1:
            result.config["bounds"] = compute_bounds(result, **run_args)
        if out_dir is not None:
            result.write(out_dir, flag="--out", inputs=inputs)
    if requests_out is not None and result.requests is not None:
        write_table(result.requests, requests_out, "--requests-out")
    return result


def _check_run_outputs(
    serving: Any, out_dir: str | None, requests_out: str | None, inputs: tuple[Any, ...]
) -> None:
    """Every output before the run: never an input, never one inside the other (``--out`` is
    replaced as a whole, and already holds requests.parquet in a serving run)."""
    if requests_out is not None:
        if serving is None:
            raise UserError(
                "--requests-out needs a serving run (--batch, --max-batch, --arrival-rate, "
                "--arrivals or an SLO)"
            )
        output_format(requests_out, TABLE_FORMATS, "--requests-out")
    check_outputs(
        [
            Output(out_dir, "--out", RUN_FILES) if out_dir is not None else None,
            Output(requests_out, "--requests-out") if requests_out is not None else None,
        ],
        inputs,
    )


run = build_run_command()
