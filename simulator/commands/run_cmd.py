"""``daopsim run``: one policy on one machine over a trace; a table, JSON and output files."""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.errors import DoesNotFit, UserError, parse_key_values
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


#: (metric key, label, unit, scale) rows of the human-readable table
TABLE_ROWS = (
    ("tokens_per_s", "tokens/s (incl. prefill)", "", 1.0),
    ("decode_tokens_per_s", "decode tokens/s", "", 1.0),
    ("ttft_s", "time to first token", " s", 1.0),
    ("tpot_p50_s", "per-token latency p50", " ms", 1e3),
    ("tpot_p99_s", "per-token latency p99", " ms", 1e3),
    ("e2e_s", "end-to-end time (simulated)", " s", 1.0),
    ("hit_rate", "GPU hit rate (decode)", "", 1.0),
    ("h2d_bytes", "host-to-device", " GB", 1e-9),
    ("d2h_bytes", "device-to-host", " GB", 1e-9),
    ("gpu_busy_frac", "GPU busy", "", 1.0),
    ("cpu_busy_frac", "CPU busy", "", 1.0),
    ("h2d_busy_frac", "H2D link busy", "", 1.0),
    ("stall_s", "GPU stall (copies + CPU)", " s", 1.0),
    ("dispatch_stall_s", "GPU waiting for dispatch", " s", 1.0),
    ("host_syncs", "host syncs", "", 1.0),
    ("cpu_expert_evals", "CPU expert evaluations", "", 1.0),
    ("prefetch_precision", "prefetch precision", "", 1.0),
    ("routing_replaced_frac", "routing replaced", "", 1.0),
    ("gate_mass_preserved", "gate mass preserved", "", 1.0),
    ("low_precision_gate_mass", "gate mass in low precision", "", 1.0),
    ("ssd_bytes", "read from SSD", " GB", 1e-9),
    ("ssd_stall_s", "waiting for SSD reads", " s", 1.0),
    ("host_memory_peak_bytes", "host memory peak", " GB", 1e-9),
    ("energy_j", "energy", " kJ", 1e-3),
    ("tokens_per_kj", "tokens per kJ", "", 1.0),
)


#: rows that add up each GPU stream's waiting (with several GPUs, more than the run's time)
PER_STREAM_ROWS = ("stall_s", "dispatch_stall_s")
#: rows shown only when the run has a host-memory budget (docs/serving.md, "An SSD tier")
SSD_ROWS = ("ssd_bytes", "ssd_stall_s", "host_memory_peak_bytes")


def compute_bounds(
    result: Any, hw: str, trace: str | None, sequences: int | None, dtype: str | None, seed: int
) -> dict[str, dict[str, Any]]:
    """The bounds shown beside a result, on the same trace, machine and sequences.

    all-gpu: every expert resident, at the run's precisions on its machine, under the fastest
    of the run's runtime and the bundled ones (:mod:`daopsim.simulator.bounds`; docs/metrics.md,
    "Bounds"). belady_per_layer: clairvoyant MIN replacement in per-layer caches sharing the run's
    GPU expert budget evenly (the bound of ``lru``, ``lfu``, ``round-robin``). belady_global
    (only beside a caching policy): clairvoyant MIN in one cache over all layers with the same
    budget (the bound of ``global-lru``, ``global-lfu``). ``belady`` repeats belady_per_layer
    for readers of older output.
    """
    from daopsim.policies.caching import CachingPolicy, GlobalCachingPolicy
    from daopsim.policies.registry import get_policy_class
    from daopsim.simulator.bounds import bound_for_result
    from daopsim.simulator.runner import simulate

    # the bounds evaluate exactly the run's sequences (they use no calibration data, so
    # their own default would evaluate every sequence)
    common = {
        "hw": hw,
        "trace": trace,
        "evaluate": result.config["sequence_ids"],
        "dtype": dtype,
        "seed": seed,
        "record": False,
        # the bounds run at the result's precisions (host copies, non-expert weights)
        "host_dtype": result.config.get("host_dtype"),
        "nonexpert_dtype": result.config.get("nonexpert_dtype"),
    }
    out: dict[str, dict[str, Any]] = {}
    own = result.config["policy"]
    out["all-gpu"] = bound_for_result(result, hw, trace).to_dict()
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


#: grid keys (docs/sweeps.md) -> ``run`` parameters, for axes that take one value in a run
_CONFIG_AXES = {
    "policies": "policy",
    "hw": "hw",
    "traces": "trace",
    "seeds": "seed",
    "runtimes": "runtime",
    "arrival_rates": "arrival_rate",
    "gpus": "gpus",
    "multi_gpu": "multi_gpu",
}
#: grid keys that are one value in a grid too
_CONFIG_SCALARS = (
    "sequences",
    "calibration",
    "dtype",
    "lookahead",
    "host_dtype",
    "nonexpert_dtype",
    "max_batch",
    "slo_ttft",
    "slo_tpot",
)


def load_run_config(path: str, chosen: str | None = None) -> dict[str, Any]:
    """A ``run --config`` file: the keys of a sweep grid (docs/sweeps.md), each with one value
    (a one-point grid), as ``run`` parameters (``options``: the policy's options).

    Relative paths are relative to the file, as in a grid file. A key with several values, or
    two memory points, is a one-line error naming the key. ``chosen`` is the policy given on
    the command line instead of the file's: options scoped to another policy stay with it (as
    ``sweep --policies`` drops the options of the policies it leaves out)."""
    from daopsim.simulator.sweep import load_grid_file

    grid, out = load_grid_file(path)
    params: dict[str, Any] = {}
    for key, name in _CONFIG_AXES.items():
        values = list(dict.fromkeys(getattr(grid, key)))
        if len(values) > 1:
            file_key = "arrival_rate" if key == "arrival_rates" else key
            raise UserError(
                f"{path}: key {file_key!r} has {len(values)} values; a run takes one "
                "(use `daopsim sweep` for several)"
            )
        if values:
            params[name] = values[0]
    memory = [*grid.cache_ratios, *grid.gpu_experts]
    if len(memory) > 1:
        raise UserError(
            f"{path}: keys 'cache_ratios'/'gpu_experts' give {len(memory)} memory points; "
            "a run takes one"
        )
    if grid.cache_ratios:
        params["cache_ratio"] = grid.cache_ratios[0]
    if grid.gpu_experts:
        params["gpu_experts"] = grid.gpu_experts[0]
    for key in _CONFIG_SCALARS:
        value = getattr(grid, key)
        if value is not None and not (key == "lookahead" and value == "recorded"):
            params[key] = value
    if out is not None:
        params["out_dir"] = out
    policy = chosen if chosen is not None else params.get("policy")
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
    params["options"] = options
    return params


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
    for key, label, unit, scale in TABLE_ROWS:
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


@click.command("run")
@click.option(
    "--policy",
    "policy",
    default="daop",
    show_default=True,
    help="Policy name (see `daopsim policies list`).",
)
@click.option(
    "--hw",
    default="a6000-pcie4",
    show_default=True,
    help="Hardware profile name or path to a profile TOML.",
)
@click.option(
    "--trace",
    "trace",
    default=None,
    help="Bundled trace name or path (default: the bundled Mixtral-8x7B trace).",
)
@click.option(
    "--cache-ratio",
    type=float,
    default=None,
    help="Fraction of all experts resident on the GPU (DAOP's ECR), in (0, 1].",
)
@click.option(
    "--gpu-experts",
    type=int,
    default=None,
    help="Resident expert slots (default: what fits in GPU memory).",
)
@click.option(
    "--sequences",
    type=int,
    default=None,
    help="Evaluate N sequences of the evaluation pool (seed 0: the first N; else a seeded sample).",
)
@click.option(
    "--calibration",
    default=None,
    metavar="none|self|PATH",
    help="Popularity data for policies that use it: none, self (the evaluated sequences, "
    "in-sample) or a trace PATH (default: held-out sequences of the trace).",
)
@click.option(
    "--lookahead",
    type=click.Choice(["recorded", "previous-token"]),
    default="recorded",
    show_default=True,
    help="One-layer-early view for policies that read it: the trace's, or the previous "
    "token's experts at the same layer (a stand-in for traces that do not record it).",
)
@click.option(
    "--policy-opt",
    "policy_opts",
    multiple=True,
    metavar="KEY=VALUE",
    help="Policy option (repeatable).",
)
@click.option(
    "--dtype", default=None, help="GPU expert precision (bf16, int4_g128, q4_k_m, mxfp4, ...)."
)
@click.option(
    "--host-dtype",
    default=None,
    help="Precision of the host's expert copies: CPU compute and link bytes (default: --dtype).",
)
@click.option(
    "--nonexpert-dtype", default=None, help="Precision of the non-expert weights (default: bf16)."
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed: which sequences --sequences N evaluates (0: the first N), and random choices.",
)
@click.option(
    "--out",
    "-o",
    "out_dir",
    default=None,
    help="Write metrics.json, timeline.parquet, a Perfetto trace and plots to this folder.",
)
@click.option("--no-progress", is_flag=True, help="Do not show a progress bar.")
@click.option(
    "--engine",
    type=click.Choice(["fast", "reference"]),
    default="fast",
    show_default=True,
    help="Timing engine: the fast one, or the plain-SimPy reference (same rules, slower).",
)
@click.option(
    "--runtime",
    default=None,
    metavar="NAME",
    help="Runtime profile (host dispatch and sync overheads; `daopsim runtimes list`). "
    "Default: the one the policy declares.",
)
@click.option(
    "--bounds/--no-bounds",
    default=True,
    show_default=True,
    help="Also report the all-GPU throughput bound and the Belady hit-rate bounds "
    "(per layer; and global, beside a caching policy).",
)
@click.option(
    "--batch",
    type=int,
    default=None,
    help="Static batches of up to B requests (a batch starts when the previous one is done).",
)
@click.option(
    "--max-batch",
    type=int,
    default=None,
    help="Continuous batching of up to B requests (requests join and leave between steps).",
)
@click.option(
    "--arrival-rate",
    type=float,
    default=None,
    help="Requests arrive by a Poisson process of R per second (seeded by --seed).",
)
@click.option(
    "--arrivals",
    default=None,
    metavar="FILE",
    help="Arrival file (CSV/Parquet: request_id, arrival_s, prompt_tokens, output_tokens, "
    "sequence).",
)
@click.option(
    "--kv-cache-gb",
    type=float,
    default=None,
    help="GPU memory reserved for the KV cache before expert slots are sized "
    "(default: one mean-length sequence per batch place, plus what the slots leave).",
)
@click.option("--slo-ttft", type=float, default=None, help="Time-to-first-token SLO (s).")
@click.option("--slo-tpot", type=float, default=None, help="Time-per-output-token SLO (s).")
@click.option(
    "--requests-out",
    default=None,
    metavar="FILE",
    help="Write one row per request (.csv or .parquet) in a serving run.",
)
@click.option(
    "--prefill-chunk",
    type=int,
    default=None,
    metavar="N",
    help="Chunked prefill: each step carries up to N prompt tokens of a joining request "
    "beside the running requests' decode tokens.",
)
@click.option(
    "--static-prefill",
    "static_prefill",
    type=str,
    default=None,
    metavar="batched|per-request",
    help="With --batch: a batch's prompts prefill together in one step (batched, the default, "
    "as Hugging Face generate runs a batch) or each in a step of its own (per-request).",
)
@click.option(
    "--preempt",
    is_flag=True,
    default=False,
    help="Allocate the KV cache as tokens are written and preempt the newest request "
    "(recompute) when it runs out, instead of reserving prompt + output at admission.",
)
@click.option(
    "--host-memory-gb",
    type=float,
    default=None,
    help="Host memory budget, GB: the non-expert weights and the experts that fit; the rest "
    "are read from the profile's NVMe drive (default: the profile's cpu.memory_gb, or "
    "unlimited).",
)
@click.option(
    "--ssd-path",
    default=None,
    metavar="page-cache|gds",
    help="How experts are read from the SSD: through the OS page cache (default) or "
    "GPUDirect Storage (NVMe to GPU, no host copy).",
)
@click.option(
    "--model",
    "model",
    default=None,
    help="Without --trace: generate (and cache) a small synthetic trace of this catalogue "
    "model (`daopsim models list`).",
)
@click.option(
    "--gpus",
    type=int,
    default=1,
    show_default=True,
    help="GPUs of a multi-GPU profile to use (docs/serving.md, 'Multiple GPUs'); the expert "
    "budget (--cache-ratio, --gpu-experts) is then per GPU.",
)
@click.option(
    "--multi-gpu",
    "multi_gpu",
    type=str,
    default=None,
    help="With --gpus > 1: 'expert' (expert e on GPU e mod N, attention on GPU 0; default) "
    "or 'pipeline' (contiguous layer stages).",
)
@click.option(
    "--expert-placement",
    "expert_placement",
    type=str,
    default=None,
    help="With --multi-gpu expert: 'mod' (expert e on GPU e mod N; default) or 'balanced' "
    "(calibration popularity spread evenly: largest first onto the least-loaded GPU).",
)
@click.option(
    "--config",
    "config",
    default=None,
    metavar="FILE.toml",
    help="Take the run from a TOML file with the keys of a sweep grid, one value each "
    "(docs/sweeps.md, 'Grid files'); options given here override it.",
)
@json_option
def run(
    policy: str,
    hw: str,
    trace: str | None,
    cache_ratio: float | None,
    gpu_experts: int | None,
    sequences: int | None,
    calibration: str | None,
    policy_opts: tuple[str, ...],
    dtype: str | None,
    host_dtype: str | None,
    nonexpert_dtype: str | None,
    seed: int,
    out_dir: str | None,
    no_progress: bool,
    engine: str,
    bounds: bool,
    as_json: bool,
    lookahead: str = "recorded",
    batch: int | None = None,
    max_batch: int | None = None,
    arrival_rate: float | None = None,
    arrivals: str | None = None,
    kv_cache_gb: float | None = None,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    requests_out: str | None = None,
    runtime: str | None = None,
    prefill_chunk: int | None = None,
    preempt: bool = False,
    static_prefill: str | None = None,
    host_memory_gb: float | None = None,
    ssd_path: str | None = None,
    model: str | None = None,
    gpus: int = 1,
    multi_gpu: str | None = None,
    expert_placement: str | None = None,
    config: str | None = None,
) -> None:
    """Simulate one policy on one machine over a routing trace."""
    from daopsim.simulator.runner import simulate
    from daopsim.simulator.serving import serving_config

    options: dict[str, Any] = {}
    if config is not None:
        ctx = click.get_current_context()
        on_line = ctx.get_parameter_source("policy") is ParameterSource.COMMANDLINE
        given = load_run_config(config, policy if on_line else None)
        options = given.pop("options")

        def pick(name: str, current: Any) -> Any:
            # the command line wins over the file
            if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE:
                return current
            return given.get(name, current)

        policy, hw, trace = pick("policy", policy), pick("hw", hw), pick("trace", trace)
        cache_ratio, gpu_experts = (
            pick("cache_ratio", cache_ratio),
            pick("gpu_experts", gpu_experts),
        )
        sequences, seed = pick("sequences", sequences), pick("seed", seed)
        calibration, lookahead = pick("calibration", calibration), pick("lookahead", lookahead)
        dtype, host_dtype = pick("dtype", dtype), pick("host_dtype", host_dtype)
        nonexpert_dtype, runtime = (
            pick("nonexpert_dtype", nonexpert_dtype),
            pick("runtime", runtime),
        )
        out_dir, arrival_rate = pick("out_dir", out_dir), pick("arrival_rate", arrival_rate)
        max_batch, gpus = pick("max_batch", max_batch), pick("gpus", gpus)
        slo_ttft, slo_tpot = pick("slo_ttft", slo_ttft), pick("slo_tpot", slo_tpot)
        multi_gpu = pick("multi_gpu", multi_gpu)
        if ctx.get_parameter_source("cache_ratio") is ParameterSource.COMMANDLINE:
            gpu_experts = None if "gpu_experts" in given else gpu_experts
        if ctx.get_parameter_source("gpu_experts") is ParameterSource.COMMANDLINE:
            cache_ratio = None if "cache_ratio" in given else cache_ratio
    options.update(parse_options(policy_opts))
    if "," in policy and not policy.endswith(".py") and ".py:" not in policy:
        raise UserError(
            f"--policy {policy}: run takes one policy; to run several side by side: "
            f"daopsim compare --policies {policy}"
        )
    if model is not None:  # the synthetic trace, so the bounds below run on it too
        from daopsim.simulator.trace_cache import model_trace

        trace = model_trace(model, trace)
    serving = serving_config(
        batch,
        max_batch,
        arrival_rate,
        arrivals,
        kv_cache_gb,
        slo_ttft,
        slo_tpot,
        prefill_chunk=prefill_chunk,
        preempt=preempt,
        static_prefill=static_prefill,
    )
    # a policy option naming a file (learned's model=FILE), from the command line or the
    # config file, is an input too
    inputs = (trace, calibration, hw, arrivals, config, *value_paths(options))
    if requests_out is not None:
        if serving is None:
            raise UserError(
                "--requests-out needs a serving run (--batch, --max-batch, --arrival-rate, "
                "--arrivals or an SLO)"
            )
        output_format(requests_out, TABLE_FORMATS, "--requests-out")
    # every output before the run: never an input, never one inside the other (--out is
    # replaced as a whole, and already holds requests.parquet in a serving run)
    check_outputs(
        [
            Output(out_dir, "--out", RUN_FILES) if out_dir is not None else None,
            Output(requests_out, "--requests-out") if requests_out is not None else None,
        ],
        inputs,
    )
    enabled = not no_progress and sys.stderr.isatty()
    with contextlib.ExitStack() as stack:
        record: bool | Path = False
        if out_dir is not None:
            # the timeline streams to a file beside the output as the run goes (memory stays
            # flat), and RunResult.write links it into the new set
            record = stack.enter_context(scratch_dir(out_dir, "--out")) / "timeline.parquet"
        with lazy_progress("sequences", enabled) as progress:
            result = simulate(
                policy=policy,
                hw=hw,
                trace=trace,
                cache_ratio=cache_ratio,
                gpu_experts=gpu_experts,
                sequences=sequences,
                calibration=calibration,
                policy_options=options,
                seed=seed,
                dtype=dtype,
                record=record,
                progress=progress,
                lookahead=lookahead,
                host_dtype=host_dtype,
                nonexpert_dtype=nonexpert_dtype,
                engine=engine,
                serving=serving,
                runtime=runtime,
                host_memory_gb=host_memory_gb,
                ssd_path=ssd_path,
                gpus=gpus,
                multi_gpu=multi_gpu,
                expert_placement=expert_placement,
            )
        if bounds and serving is None and gpus == 1:  # the bounds are single-sequence, one-GPU runs
            result.config["bounds"] = compute_bounds(result, hw, trace, sequences, dtype, seed)
        if out_dir is not None:
            result.write(out_dir, flag="--out", inputs=inputs)
    if requests_out is not None and result.requests is not None:
        write_table(result.requests, requests_out, "--requests-out")
    doc = result.to_dict()
    if as_json:
        echo_json(doc)
    else:
        click.echo(render_table(doc))
        if out_dir is not None:
            click.echo(
                f"\nwrote {out_dir}/: metrics.json timeline.parquet trace.perfetto.json.gz "
                "gantt.png hit_rate.png"
                + (" requests.parquet" if result.requests is not None else "")
            )
