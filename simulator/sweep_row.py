"""One configuration of a sweep run and its row: the ``simulate()`` call (in a worker process),
its metrics and labels as flat columns, a failure as a row with status ``error`` and a point
the machine cannot hold as a row with status ``skipped``; then each finished row's all-GPU
bound (docs/sweeps.md, "The table").
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from daopsim.simulator.data import (
    resolve_trace,
)
from daopsim.simulator.errors import (
    DoesNotFit,
    PolicyError,
    UserError,
    debug_enabled,
    debug_traceback,
)
from daopsim.simulator.fingerprints import file_sha256, profile_sha256
from daopsim.simulator.metrics import metric_keys
from daopsim.simulator.run_params import grid_params
from daopsim.simulator.sweep_expand import Config


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, UserError | PolicyError):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _base_row(cfg: Config) -> dict[str, Any]:
    row: dict[str, Any] = {
        "policy": cfg.policy,
        "hw": cfg.hw,
        "trace": cfg.trace,
        "cache_ratio": cfg.cache_ratio,
        "gpu_experts": cfg.gpu_experts,
        "sequences": cfg.sequences,
        "seed": cfg.seed,
        "runtime": cfg.runtime,
        "bound": None,
        "status": "error",
        "error": None,
        "key": cfg.key,
    }
    for k, v in cfg.options:
        row[f"opt.{k}"] = v
    for p in grid_params():  # another declared axis: its column, where not at its default
        if p.axis and p.name not in row and getattr(cfg, p.name) != p.default:
            row[p.name] = getattr(cfg, p.name)
    if cfg.gpus > 1:  # multi-GPU columns (absent from single-GPU sweeps)
        row["gpus"] = cfg.gpus
        row["multi_gpu"] = cfg.multi_gpu or "expert"
        # a budget asked for is per GPU; `gpu_experts` is the total, known once the run sized it
        row["gpu_experts_per_gpu"] = cfg.gpu_experts
        row["gpu_experts"] = None
    if cfg.arrival_rate is not None:
        row["arrival_rate"] = cfg.arrival_rate
        row["max_batch"] = cfg.serving().batch
    return row


def _labels(cfg: Config) -> dict[str, Any]:
    """The columns of a row that name what was asked for rather than what ran."""
    return {"hw": cfg.hw, "trace": cfg.trace, "runtime": cfg.runtime}


def run_config(cfg: Config) -> dict[str, Any]:
    """Run one configuration and return its row.

    A failure becomes a row with status "error"; a memory point the machine cannot hold a row
    with status "skipped" and error "does not fit (at most N)".
    """
    from daopsim.simulator.runner import simulate

    row = _base_row(cfg)
    try:
        path = _worker_trace(cfg)
        result = simulate(
            **{**cfg.run_args(), "trace": path},
            policy_options=dict(cfg.options),
            record=False,
            serving=cfg.serving(),
        )
    except DoesNotFit as exc:  # the machine is too small for this point: not a failure
        row["status"] = "skipped"
        row["error"] = f"does not fit (at most {exc.max_experts})"
        row["max_gpu_experts"] = exc.max_experts
        return row
    except Exception as exc:  # recorded, not raised: one bad configuration must not sink others
        row["error"] = _one_line(exc)
        if debug_enabled():  # --debug / DAOPSIM_DEBUG=1: the traceback behind the row's error
            sys.stderr.write(
                f"debug: {cfg.policy} on {cfg.hw}, {cfg.trace}: {row['error']}\n"
                + debug_traceback(exc)
            )
        return row
    row.update(_finished_row(cfg, path, result))
    return row


def _worker_trace(cfg: Config) -> Path:
    """The configuration's trace on this worker: a worker on another machine resolves bundled
    traces by name; the trace's bytes and the profile's content must be those planned."""
    path = resolve_trace(cfg.trace) if cfg.trace_bundled else Path(cfg.trace_path)
    if not path.exists():
        raise UserError(f"{path}: no such trace file on this worker")
    if file_sha256(path) != cfg.trace_sha:
        raise UserError(f"{path}: trace differs from the one the sweep was planned with")
    if profile_sha256(cfg.hw) != cfg.hw_sha:
        raise UserError(f"profile {cfg.hw}: differs from the one the sweep was planned with")
    return path


def _finished_row(cfg: Config, path: Path, result: Any) -> dict[str, Any]:
    """A finished run's columns: what it ran with, its metrics (the registry's,
    simulator/metrics.py), model facts and, in a serving run, the serving summary."""
    from daopsim.simulator.trace import read_meta

    c = result.config
    model = read_meta(path).model.with_precision(cfg.dtype, cfg.host_dtype, cfg.nonexpert_dtype)
    expert_bytes = int(model.expert_bytes())
    row: dict[str, Any] = {
        "cache_ratio": cfg.cache_ratio if cfg.cache_ratio is not None else c["cache_ratio"],
        "gpu_experts": int(c["gpu_experts"]),
        "sequences": int(c["sequences"]),
    }
    if c.get("gpu_experts_per_gpu") is not None:
        row["gpu_experts_per_gpu"] = int(c["gpu_experts_per_gpu"])
    row.update(
        sequence_ids=",".join(map(str, c["sequence_ids"])),
        calibration=c["calibration"],
        runtime=c["runtime"]["name"],
        bound=bool(c["bound"]),
        status="ok",
    )
    metrics = result.to_dict()["metrics"]
    row.update({k: metrics[k] for k in metric_keys() if k in metrics})
    row.update(
        model=c["model"],
        dtype=c["dtype"],
        total_experts=int(c["total_experts"]),
        max_gpu_experts=int(c["max_gpu_experts"]),
        expert_bytes=expert_bytes,
        # the memory the experts take: what the policy's options fix, else its budget
        expert_memory_gb=int(
            c["gpu_experts"] if c.get("fixed_residency") is None else c["fixed_residency"]
        )
        * expert_bytes
        / 1e9,
        per_layer_hit_rate=[float(x) for x in result.per_layer_hit_rate],
    )
    if result.serving is not None:
        row.update(serving_row(result.serving))
    return row


def add_bounds(rows: list[dict[str, Any]], configs: list[Config]) -> None:
    """Fill each finished one-sequence-at-a-time, one-GPU row's all-GPU bound (in place).

    The bound runs on the row's machine, trace, evaluated sequences and precisions, under the
    fastest of its runtime and the bundled ones (:func:`daopsim.simulator.bounds.all_gpu_bound`,
    which caches: rows sharing all of these cost one set of runs)."""
    from daopsim.simulator.bounds import all_gpu_bound
    from daopsim.simulator.run_params import bound_params

    for row, cfg in zip(rows, configs, strict=True):
        row["bound_tokens_per_s"], row["bound_runtime"] = None, None
        if row.get("status") != "ok" or cfg.arrival_rate is not None or cfg.gpus > 1:
            continue
        ids = [int(x) for x in str(row["sequence_ids"]).split(",") if x]
        path = resolve_trace(cfg.trace) if cfg.trace_bundled else Path(cfg.trace_path)
        values = dict(cfg.values)
        shared = {
            p.name: values.get(p.name, p.default)
            for p in bound_params()
            if p.name not in ("hw", "trace")
        }
        b = all_gpu_bound(cfg.hw, path, ids, str(row["runtime"]), **shared)
        row["bound_tokens_per_s"], row["bound_runtime"] = b.tokens_per_s, b.runtime


def serving_row(sv: dict[str, Any]) -> dict[str, Any]:
    """A serving run's summary as flat sweep columns (``SERVING_COLUMNS``)."""
    out = {
        "throughput_tokens_per_s": sv["throughput_tokens_per_s"],
        "slo_attainment": sv["slo_attainment"],
        "goodput_requests_per_s": sv["goodput_requests_per_s"],
    }
    for name, key in (("ttft", "ttft_s"), ("req_tpot", "tpot_s"), ("latency", "latency_s")):
        for p, v in sv[key].items():
            out[f"{name}_{p}_s"] = v
    return out
