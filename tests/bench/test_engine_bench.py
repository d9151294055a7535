"""Engine speed and memory targets (run by `make bench`; results go in docs/performance.md).

- At least 100,000 decode token-layers per CPU second (process time) for every built-in
  policy on the bundled default trace (each is measured and printed; the slowest is reported).
- `daopsim run` on the default trace (the `make run` job) finishes in under 20 s.
- A 10-million-row trace runs with peak memory under 1 GB (streaming).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daopsim.policies.registry import available
from daopsim.simulator.runner import simulate

pytestmark = pytest.mark.bench

TARGET_TOKEN_LAYERS_PER_S = 100_000
RESULTS = Path(__file__).with_name("results.json")


REPEATS = 2


def _rate(policy: str) -> tuple[float, float, float]:
    """Token-layers per CPU second of the process (the machine may be shared: wall time
    would count other jobs), the CPU seconds and the wall seconds: the fastest of
    `REPEATS` runs, because another job on the machine can only slow a run down."""
    best: tuple[float, float, float] | None = None
    for _ in range(REPEATS):
        t0, c0 = time.perf_counter(), time.process_time()
        r = simulate(policy=policy, hw="a6000-pcie4", record=False)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        rate = r.metrics["decode_tokens"] * 32 / cpu
        if best is None or rate > best[0]:
            best = (rate, cpu, wall)
    assert best is not None
    return best


def _save(key: str, value: object) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[key] = value
    RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def test_decode_throughput_per_policy() -> None:
    """Token-layers per CPU second (whole run incl. prefill and set-up) for every policy."""
    # One untimed run first: the first simulation in a process pays one-off costs (imports
    # done lazily, first reads of the bundled trace and profiles) that belong to no policy.
    simulate(policy="lru", hw="a6000-pcie4", record=False)
    rates = {}
    for name in available():
        rate, cpu, wall = _rate(name)
        rates[name] = {
            "token_layers_per_s": round(rate),
            "cpu_seconds": round(cpu, 2),
            "seconds": round(wall, 2),
        }
        print(f"{name:<20} {rate:>10,.0f} token-layers/s  ({cpu:.2f} s CPU, {wall:.2f} s wall)")
    slowest = min(rates, key=lambda n: rates[n]["token_layers_per_s"])
    print(f"slowest: {slowest} at {rates[slowest]['token_layers_per_s']:,} token-layers/s")
    _save("throughput", rates)
    slow = {
        name: r["token_layers_per_s"]
        for name, r in rates.items()
        if available()[name].__module__.startswith("daopsim.policies.")
        and r["token_layers_per_s"] < TARGET_TOKEN_LAYERS_PER_S
    }
    assert not slow, f"below {TARGET_TOKEN_LAYERS_PER_S:,} token-layers/s: {slow}"


def test_make_run_under_20_s() -> None:
    """The `make run` job, as a user runs it (CLI start-up included)."""
    t0 = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "daopsim",
            "run",
            "--policy",
            "daop",
            "--hw",
            "a6000-pcie4",
            "--no-progress",
        ],
        check=True,
        capture_output=True,
    )
    dt = time.perf_counter() - t0
    _save("make_run_seconds", round(dt, 2))
    print(f"daopsim run --policy daop --hw a6000-pcie4: {dt:.1f} s")
    assert dt < 20


def test_ten_million_rows_peak_memory(tmp_path: Path) -> None:
    """A 10-million-row Mixtral trace streams through the engine in under 1 GB."""
    path = tmp_path / "big.parquet"
    # 40 sequences x (256 + 7556) tokens x 32 layers = 9,999,360 rows
    subprocess.run(
        [
            sys.executable,
            "-m",
            "daopsim",
            "synth",
            "--model",
            "mixtral-8x7b",
            "--sequences",
            "40",
            "--prompt-tokens",
            "256",
            "--output-tokens",
            "7556",
            "--seed",
            "3",
            "-o",
            str(path),
        ],
        check=True,
        capture_output=True,
    )
    code = (
        "import resource, time, json\n"
        "from daopsim.simulator.runner import simulate\n"
        "t = time.perf_counter()\n"
        f"r = simulate(policy='lru', hw='a6000-pcie4', trace={str(path)!r}, record=False)\n"
        "dt = time.perf_counter() - t\n"
        "rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "print(json.dumps({'rows': r.metrics['decode_tokens'] * 32, 'seconds': dt,"
        " 'peak_rss_bytes': rss}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    print(stats)
    _save("ten_million_rows", stats)
    assert stats["peak_rss_bytes"] < 1e9
