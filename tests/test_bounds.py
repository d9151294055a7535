"""The all-GPU bound holds by construction (docs/metrics.md, "Bounds"): no run, sweep row or
advise row is faster than the bound it reports, across the built-in policies, machine classes,
runtimes and precisions (a sample that covers each of them, on short traces)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from daopsim.policies.registry import available
from daopsim.simulator.bounds import all_gpu_bound, bound_for_result, bound_runtimes
from daopsim.simulator.errors import DoesNotFit, PolicyError, UserError
from daopsim.simulator.runner import simulate
from daopsim.simulator.runtime_profiles import runtime_names
from daopsim.simulator.testing import make_trace

#: one machine per class: workstation, desktop, datacenter, unified memory, a 12-channel EPYC
#: and an AMX Xeon host, a low-end card on PCIe 3, an L4 (its CPU streams half as fast as its
#: GPU), a desktop with an SSD tier in its profile
MACHINES = (
    "a6000-pcie4",
    "rtx4090-pcie4",
    "h100-sxm5",
    "jetson-orin-64g",
    "rtx4090-epyc9654-pcie4",
    "rtx4090-xeon6454s-pcie4",
    "rtx3060-pcie3",
    "l4-pcie4",
    "a100-80g-pcie4",
)
#: (GPU experts, host copies): equal, and a host copy smaller than the GPU's
PRECISIONS = (
    ("bf16", None),
    ("q4_k_m", None),
    ("int4_g128", None),
    ("mxfp4", None),
    ("bf16", "q4_k_m"),
    ("fp8", None),
    ("q8_0", "int4_g128"),
)
RATIOS = (None, 0.25, 0.5)
#: a case that beat the bound before the bound took the host copies' precision: CPU experts at
#: q4_k_m on an L4 host are faster than the L4's bf16 experts
REGRESSIONS = (
    ("llama-cpp-mmap", "l4-pcie4", "bf16", "q4_k_m", "llama.cpp", None, "mixtral"),
    ("vllm-cpu-offload", "a100-80g-pcie4", "q4_k_m", None, None, None, "mixtral"),
    ("lru", "h100-sxm5", "bf16", None, "cuda-graph", 1.0, "olmoe"),
    ("llama-cpp-layers", "rtx4090-pcie4", "q4_k_m", None, None, None, "olmoe"),
)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Short traces of a model that offloads (Mixtral) and of one that fits (OLMoE)."""
    folder = tmp_path_factory.mktemp("bounds")
    return {
        "mixtral": make_trace(
            folder / "mixtral.parquet", model="mixtral-8x7b", sequences=2, prefill=6, decode=8
        ),
        "olmoe": make_trace(
            folder / "olmoe.parquet", model="olmoe-1b-7b", sequences=2, prefill=6, decode=8
        ),
    }


def _built_in() -> set[str]:
    """The policies of the policies package (not plugins, not one-file policies other tests
    loaded)."""
    return {n for n, cls in available().items() if cls.__module__.startswith("daopsim.policies.")}


def _sample() -> list[tuple[Any, ...]]:
    """Every built-in policy once, on a walk over the other axes that reaches every machine,
    runtime and precision (steps coprime with each axis' length), so a failure is reproducible
    by its case."""
    policies = sorted(_built_in())
    runtimes = [*runtime_names(), None]
    out = [
        (
            pol,
            MACHINES[(i * 5) % len(MACHINES)],
            *PRECISIONS[(i * 3) % len(PRECISIONS)],
            runtimes[(i * 7) % len(runtimes)],
            RATIOS[i % len(RATIOS)],
            ("mixtral", "olmoe")[i % 2],
        )
        for i, pol in enumerate(policies)
    ]
    return [*out, *REGRESSIONS]


SAMPLE = _sample()


def test_the_sample_covers_every_axis() -> None:
    assert {s[0] for s in SAMPLE} >= _built_in()
    assert {s[1] for s in SAMPLE} == set(MACHINES)
    assert {s[4] for s in SAMPLE} >= set(runtime_names())
    assert {(s[2], s[3]) for s in SAMPLE} == set(PRECISIONS)


def test_no_run_exceeds_its_bound(traces: dict[str, Path]) -> None:
    ran = 0
    for pol, hw, dtype, host, runtime, ratio, model in SAMPLE:
        try:
            r = simulate(
                policy=pol,
                hw=hw,
                trace=traces[model],
                sequences=1,
                dtype=dtype,
                host_dtype=host,
                runtime=runtime,
                cache_ratio=ratio,
                record=False,
            )
        except (DoesNotFit, UserError, PolicyError):
            continue  # the machine cannot hold the point, or the policy refuses the setting
        ran += 1
        b = bound_for_result(r, hw, traces[model])
        case = (pol, hw, dtype, host, runtime, ratio, model, b.runtime, b.dtype)
        assert r.metrics["tokens_per_s"] <= b.tokens_per_s * (1 + 1e-9), case
        assert r.metrics["decode_tokens_per_s"] <= b.decode_tokens_per_s * (1 + 1e-9), case
        assert b.own_tokens_per_s <= b.tokens_per_s
    assert ran >= 0.7 * len(SAMPLE)


@pytest.mark.parametrize("own", ["hf-eager", "llama.cpp"])
def test_the_runtimes_left_out_cannot_be_faster(traces: dict[str, Path], own: str) -> None:
    """The bound skips runtimes another candidate is never slower than: each of them, run,
    stays at or under the bound."""
    b = all_gpu_bound("rtx4090-pcie4", traces["olmoe"], [0], own, dtype="q4_k_m")
    assert {r.name for r in bound_runtimes(own)} < set(runtime_names())
    for name in runtime_names():
        r = simulate(
            policy="all-gpu",
            hw="rtx4090-pcie4",
            trace=traces["olmoe"],
            evaluate=[0],
            dtype="q4_k_m",
            runtime=name,
            record=False,
        )
        assert r.metrics["tokens_per_s"] <= b.tokens_per_s * (1 + 1e-9), name


def test_sweep_rows_stay_under_their_bound(traces: dict[str, Path]) -> None:
    from daopsim.simulator.sweep import sweep

    df = sweep(
        {
            "policies": ["lru", "fiddler", "llama-cpp-layers", "vllm-cpu-offload"],
            "hw": ["rtx4090-pcie4"],
            "traces": [str(traces["olmoe"])],
            "runtimes": ["ideal", "cuda-graph", "llama.cpp"],
            "dtype": "q4_k_m",
            "sequences": 1,
        },
        workers=1,
        progress=False,
    )
    ok = df[df["status"] == "ok"]
    assert len(ok) >= 8 and ok["bound_tokens_per_s"].notna().all()
    assert (ok["tokens_per_s"] <= ok["bound_tokens_per_s"] * (1 + 1e-9)).all()
    assert set(ok["bound_runtime"]) <= set(runtime_names())


def test_advise_never_ranks_a_row_above_its_bound() -> None:
    from daopsim.simulator.advise import advise

    found = advise(
        "mixtral-8x7b",
        "a100-80g-pcie4",
        trace="ci-small",
        dtypes=["q4_k_m"],
        policies=["vllm-cpu-offload", "llama-cpp-layers", "lru", "all-gpu"],
        workers=1,
    )
    assert found.rows
    for r in [*found.rows, *found.references]:
        assert r.bound_tokens_per_s is not None and r.of_bound is not None
        assert r.tokens_per_s <= r.bound_tokens_per_s * (1 + 1e-9), r.command
        assert r.of_bound <= 1 + 1e-9


def test_the_issues_commands_report_at_most_100_percent(cli: Callable[..., Any]) -> None:
    """The two commands of issue 29 that reported 108 % and 207 % of the bound."""
    res = cli(
        "run",
        "--policy",
        "vllm-cpu-offload",
        "--hw",
        "a100-80g-pcie4",
        "--trace",
        "ci-small",
        "--sequences",
        "1",
        "--dtype",
        "q4_k_m",
        "--no-progress",
    )
    assert res.exit_code == 0, res.output
    share = float(re.search(r"this run: ([\d.]+)% of it", res.stdout).group(1))  # type: ignore[union-attr]
    assert 0 < share <= 100
    assert "every expert resident, runtime" in res.stdout
    # the second on the whole OLMoE trace, from Python (the same run and bound as the command,
    # without its Belady bounds)
    r = simulate(
        policy="lru",
        cache_ratio=1,
        hw="h100-sxm5",
        trace="olmoe-1b-7b",
        runtime="cuda-graph",
        record=False,
    )
    b = bound_for_result(r, "h100-sxm5", "olmoe-1b-7b")
    assert r.metrics["tokens_per_s"] <= b.tokens_per_s
    assert b.own_runtime == "cuda-graph" and b.own_tokens_per_s <= b.tokens_per_s
