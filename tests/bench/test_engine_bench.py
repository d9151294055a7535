"""Engine speed and memory targets (run by `make bench`; results go in docs/performance.md).

- At least 100,000 decode token-layers per CPU second (process time) for every built-in
  policy on the bundled default trace, compiled, and no policy slower than before the engine
  core; the pure-Python fallback's rate is measured and reported beside it.
- `daopsim run` on the default trace (the `make run` job) finishes in under 20 s.
- A 10-million-row trace runs with peak memory under 1 GB (streaming).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from benchutil import child_json, save

pytestmark = pytest.mark.bench

TARGET_TOKEN_LAYERS_PER_S = 100_000
#: policies measured and reported but held to no rate (none: ``learned``, which scores every
#: eviction candidate with its network, does so in typed loops; docs/performance.md)
NO_RATE_TARGET: set[str] = set()
#: decode token-layers per CPU second of each policy before the engine core (issue 27): the
#: engine with its hand-specialised one-pass paths, bench run of 2026-12-03 16:49 (the
#: table docs/performance.md kept then); the compiled core must be at least as fast
BEFORE_CORE = {
    "accelerate": 119_668,
    "all-gpu": 323_150,
    "belady": 144_702,
    "belady-global": 110_091,
    "daop": 52_773,
    "fiddler": 140_417,
    "global-lfu": 110_973,
    "global-lru": 110_451,
    "hobbit": 100_345,
    "ktransformers": 133_256,
    "lfu": 133_677,
    "llama-cpp-cpu-moe": 146_079,
    "llama-cpp-layers": 195_958,
    "llama-cpp-mmap": 148_656,
    "lru": 121_100,
    "mixtral-offloading": 86_144,
    "moe-infinity": 60_744,
    "round-robin": 118_892,
    "static": 110_315,
    "stream-all": 96_605,
    "vllm-cpu-offload": 118_924,
}
REPEATS = 2

#: measures every policy in a fresh interpreter (so the compiled core or, with
#: DAOPSIM_PURE_PYTHON=1, its pure-Python fallback) and prints one JSON object
_MEASURE = """
import json, sys, time
from daopsim.policies.registry import available
from daopsim.simulator.native import status
from daopsim.simulator.runner import simulate

def rate(policy):
    # the fastest of REPEATS runs: another job on the machine can only slow a run down
    best = None
    for _ in range(REPEATS):
        t0, c0 = time.perf_counter(), time.process_time()
        r = simulate(policy=policy, hw="a6000-pcie4", record=False)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        x = (r.metrics["decode_tokens"] * 32 / cpu, cpu, wall)
        best = x if best is None or x[0] > best[0] else best
    return best

# the first simulation in a process pays one-off costs (lazy imports, first reads of the
# bundled trace and profiles) that belong to no policy
simulate(policy="lru", hw="a6000-pcie4", record=False)
out = {"build": status().describe(), "rates": {}}
for name, cls in available().items():
    if cls.__module__.startswith("daopsim.policies."):
        r, cpu, wall = rate(name)
        out["rates"][name] = {"token_layers_per_s": round(r), "cpu_seconds": round(cpu, 2),
                              "seconds": round(wall, 2)}
print(json.dumps(out))
"""


def _measure(pure: bool) -> dict[str, Any]:
    env = {"DAOPSIM_PURE_PYTHON": "1" if pure else "0"}
    return child_json(f"REPEATS = {REPEATS}\n" + _MEASURE, env)


def test_decode_throughput_per_policy() -> None:
    """Token-layers per CPU second (whole run incl. prefill and set-up) for every built-in
    policy, compiled and pure Python; the compiled core against the targets."""
    compiled, pure = _measure(pure=False), _measure(pure=True)
    print(f"{'policy':<20} {'compiled':>10} {'pure':>10} {'before':>10}  ({compiled['build']})")
    for name, r in compiled["rates"].items():
        p = pure["rates"][name]["token_layers_per_s"]
        c = r["token_layers_per_s"]
        print(f"{name:<20} {c:>10,} {p:>10,} {BEFORE_CORE.get(name, 0):>10,}")
    rates = compiled["rates"]
    slowest = min(rates, key=lambda n: rates[n]["token_layers_per_s"])
    print(f"slowest: {slowest} at {rates[slowest]['token_layers_per_s']:,} token-layers/s")
    save("throughput", {"compiled": compiled, "pure": pure, "before_core": BEFORE_CORE})
    assert compiled["build"].startswith("compiled"), compiled["build"]
    below = {
        n: (r["token_layers_per_s"], BEFORE_CORE[n])
        for n, r in rates.items()
        if r["token_layers_per_s"] < BEFORE_CORE.get(n, 0)
    }
    slow = {
        n: r["token_layers_per_s"]
        for n, r in rates.items()
        if r["token_layers_per_s"] < TARGET_TOKEN_LAYERS_PER_S and n not in NO_RATE_TARGET
    }
    assert not below, f"slower than before the engine core: {below}"
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
    save("make_run_seconds", round(dt, 2))
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
        "import time, json\n"
        "from daopsim.simulator.runner import simulate\n"
        "t = time.perf_counter()\n"
        f"r = simulate(policy='lru', hw='a6000-pcie4', trace={str(path)!r}, record=False)\n"
        "dt = time.perf_counter() - t\n"
        "from daopsim.simulator.testing import peak_rss_bytes\nrss = peak_rss_bytes()\n"
        "print(json.dumps({'rows': r.metrics['decode_tokens'] * 32, 'seconds': dt,"
        " 'peak_rss_bytes': rss}))\n"
    )
    stats = child_json(code)
    print(stats)
    save("ten_million_rows", stats)
    assert stats["peak_rss_bytes"] < 1e9
