"""Golden numbers: every built-in policy on the bundled CI trace, compared exactly.

For each policy (and a few option variants) at two cache ratios on ``a6000-pcie4`` over the
bundled ``ci-small`` trace, the run's counts (hits and accesses, prefill and decode; H2D/D2H
bytes; fetches, temporary copies, evictions, prefetches; CPU expert evaluations) must equal
``tests/golden/policies.json`` exactly and its simulated times (end-to-end, tokens/s) to a
relative 1e-9. The file also records the trace's SHA-256, so a regenerated trace is reported as
such rather than as a policy change.

A changed number is a changed behaviour. When the change is intended, regenerate the file and
commit it in the same commit as the change, saying in the commit message which numbers moved
and why::

    .venv/bin/python -m tests.test_golden --update      # or: DAOPSIM_UPDATE_GOLDEN=1 pytest ...

A policy without golden numbers (e.g. a new one) fails until the file is regenerated.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

import simulator.runner as runner
from policies.registry import available
from simulator.data import resolve_trace
from simulator.engine import Counters, Engine

GOLDEN = Path(__file__).parent / "golden" / "policies.json"
TRACE = "ci-small"
HW = "a6000-pcie4"
RATIOS = (0.25, 0.375)
#: option variants worth pinning besides each policy's defaults
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-offloading+prefetch": ("mixtral-offloading", {"prefetch": True}),
    "stream-all+selected": ("stream-all", {"gather": "selected"}),
}
COUNTS = (
    "decode_hits",
    "decode_accesses",
    "prefill_hits",
    "prefill_accesses",
    "h2d_bytes",
    "d2h_bytes",
    "fetches",
    "temp_copies",
    "evictions",
    "prefetches",
    "cpu_expert_evals",
    "cpu_precalc_evals",
)
TIMES = ("e2e_s", "tokens_per_s")


def builtin_runs() -> dict[str, tuple[str, dict[str, Any]]]:
    """Run key -> (policy, options): every built-in policy with defaults, plus VARIANTS."""
    runs = {
        name: (name, {})
        for name, cls in available().items()
        if cls.__module__.startswith("policies.")
    }
    runs.update(VARIANTS)
    return runs


def trace_sha256(path: Path) -> str:
    """Fingerprint of the trace file the numbers were made on."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def measure(policy: str, options: dict[str, Any], ratio: float) -> dict[str, Any]:
    """One run's golden fields (counts from the engine's counters, times from the metrics)."""
    seen: list[Counters] = []

    class Capturing(Engine):
        def run(self, *args: Any, **kwargs: Any) -> Counters:
            c = super().run(*args, **kwargs)
            seen.append(c)
            return c

    saved = runner.Engine
    runner.Engine = Capturing  # type: ignore[misc]
    try:
        res = runner.simulate(
            policy, HW, TRACE, cache_ratio=ratio, policy_options=options, record=False
        )
    finally:
        runner.Engine = saved  # type: ignore[misc]
    c = seen[0]
    out: dict[str, Any] = {k: int(getattr(c, k)) for k in COUNTS}
    out.update({k: float(res.metrics[k]) for k in TIMES})
    out["gpu_experts"] = int(res.config["gpu_experts"])
    return out


def generate() -> dict[str, Any]:
    """Everything the golden file holds."""
    path = resolve_trace(TRACE)
    runs = {
        f"{key}@{ratio}": measure(pol, opts, ratio)
        for key, (pol, opts) in sorted(builtin_runs().items())
        for ratio in RATIOS
    }
    return {"trace": TRACE, "trace_sha256": trace_sha256(path), "hw": HW, "runs": runs}


def write(data: dict[str, Any]) -> None:
    """Write the golden file atomically."""
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    tmp = GOLDEN.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, GOLDEN)


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    """The committed golden numbers (regenerated first when DAOPSIM_UPDATE_GOLDEN is set)."""
    if os.environ.get("DAOPSIM_UPDATE_GOLDEN"):
        write(generate())
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN} is missing: run python -m tests.test_golden --update")
    data = json.loads(GOLDEN.read_text())
    sha = trace_sha256(resolve_trace(TRACE))
    if data["trace_sha256"] != sha:
        pytest.fail(
            f"bundled trace {TRACE!r} changed since the golden numbers were made; if that is "
            "intended, run python -m tests.test_golden --update and commit both"
        )
    return data


def _cases() -> list[tuple[str, float]]:
    return [(key, r) for key in sorted(builtin_runs()) for r in RATIOS]


@pytest.mark.parametrize(("key", "ratio"), _cases())
def test_policy_matches_golden(key: str, ratio: float, golden: dict[str, Any]) -> None:
    want = golden["runs"].get(f"{key}@{ratio}")
    if want is None:
        pytest.fail(
            f"no golden numbers for {key}@{ratio}: run python -m tests.test_golden --update"
        )
    pol, opts = builtin_runs()[key]
    got = measure(pol, opts, ratio)
    counts = {k: got[k] for k in (*COUNTS, "gpu_experts")}
    assert counts == {k: want[k] for k in counts}, key
    for k in TIMES:
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=0), (key, k)


def test_golden_covers_only_known_runs(golden: dict[str, Any]) -> None:
    """Stale entries (a removed or renamed policy) must be cleaned up with --update."""
    assert set(golden["runs"]) == {f"{k}@{r}" for k, r in _cases()}


def test_golden_numbers_tell_policies_apart(golden: dict[str, Any]) -> None:
    """Sanity of the file itself: the bound is fastest, stream-all moves the most bytes."""
    runs = golden["runs"]
    for r in RATIOS:
        fastest = min(runs[f"{k}@{r}"]["e2e_s"] for k in builtin_runs())
        assert runs[f"all-gpu@{r}"]["e2e_s"] == fastest
        most = max(runs[f"{k}@{r}"]["h2d_bytes"] for k in builtin_runs())
        assert runs[f"stream-all@{r}"]["h2d_bytes"] == most
        assert runs[f"all-gpu@{r}"]["decode_hits"] == runs[f"all-gpu@{r}"]["decode_accesses"]


if __name__ == "__main__":
    if "--update" not in sys.argv[1:]:
        sys.exit("usage: python -m tests.test_golden --update")
    write(generate())
    print(f"wrote {GOLDEN}")
