"""What a serving run reports: per-request time to first token, time per output token and
end-to-end latency, their percentiles, SLO attainment and goodput (docs/serving.md).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from daopsim.simulator.serving import Serving
from daopsim.simulator.serving_config import ServingConfig
from daopsim.simulator.serving_requests import Request

#: Percentiles reported for per-request latencies.
PERCENTILES = (50, 90, 99)


def _pcts(values: list[float]) -> dict[str, float | None]:
    arr = np.asarray([x for x in values if math.isfinite(x)], dtype=np.float64)
    return {f"p{p}": (float(np.percentile(arr, p)) if arr.size else None) for p in PERCENTILES}


def request_table(requests: list[Request], config: ServingConfig) -> pd.DataFrame:
    """One row per request: arrival, admission, first token, finish, latencies, SLO outcome."""
    rows = []
    for q in requests:
        ttft = q.first_token - q.arrival
        tpot = q.tpot
        rows.append(
            {
                "request_id": q.rid,
                "sequence": q.seq_id,
                "arrival_s": q.arrival,
                "admitted_s": q.admitted,
                "first_token_s": q.first_token,
                "finish_s": q.finish,
                "prompt_tokens": q.prompt,
                "output_tokens": q.output,
                "queue_s": q.admitted - q.arrival,
                "ttft_s": ttft,
                "tpot_s": tpot,
                "latency_s": q.finish - q.arrival,
                "meets_slo": meets_slo(ttft, tpot, config),
                "preemptions": q.preemptions,
            }
        )
    return pd.DataFrame(rows)


def meets_slo(ttft: float, tpot: float, config: ServingConfig) -> bool:
    """Both objectives met (an objective not given is met; a NaN TPOT, one output token after
    no prompt, meets any TPOT objective)."""
    if config.slo_ttft is not None and not ttft <= config.slo_ttft:
        return False
    return config.slo_tpot is None or math.isnan(tpot) or tpot <= config.slo_tpot


def summarise(
    serving: Serving, e2e: float, kv_capacity: int | None, kv_bytes_per_token: int
) -> dict[str, Any]:
    """The ``serving`` object of ``run --json`` (docs/serving.md defines each key)."""
    cfg = serving.config
    table = request_table(serving.requests, cfg)
    n = len(table)
    good = int(table["meets_slo"].sum()) if n else 0
    out_tokens = int(table["output_tokens"].sum()) if n else 0
    return {
        "mode": "continuous" if cfg.continuous else "static",
        "max_batch": cfg.batch,
        "arrivals": (
            f"poisson {cfg.arrival_rate}/s"
            if cfg.arrival_rate is not None
            else (cfg.arrivals if cfg.arrivals is not None else "all at 0")
        ),
        "requests": n,
        "batched_steps": serving.batch_steps,
        "mean_batch": (serving.batched_tokens / serving.batch_steps)
        if serving.batch_steps
        else 1.0,
        "throughput_tokens_per_s": out_tokens / e2e if e2e > 0 else None,
        "ttft_s": _pcts(table["ttft_s"].tolist()),
        "tpot_s": _pcts(table["tpot_s"].tolist()),
        "latency_s": _pcts(table["latency_s"].tolist()),
        "queue_s": _pcts(table["queue_s"].tolist()),
        "slo_ttft_s": cfg.slo_ttft,
        "slo_tpot_s": cfg.slo_tpot,
        "slo_attainment": good / n if n else None,
        "goodput_requests_per_s": good / e2e if e2e > 0 else None,
        "kv_cache_tokens": kv_capacity,
        "kv_cache_gb": None if kv_capacity is None else kv_capacity * kv_bytes_per_token / 1e9,
        "kv_peak_tokens": serving.sched.kv_peak,
        "prefill_chunk": cfg.prefill_chunk,
        "mixed_steps": serving.mixed_steps,
        "static_prefill": None
        if cfg.continuous
        else ("batched" if cfg.batched_prefill else "per-request"),
        "batched_prefills": serving.batched_prefills,
        "kv_allocation": "as written, preempt (recompute)" if cfg.preempt else "reserved whole",
        "preemptions": serving.sched.preemptions,
        "preempted_kv_tokens": serving.sched.preempted_kv_tokens,
    }
