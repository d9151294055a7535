"""The compiled engine core (mypyc) and its pure-Python fallback give identical results.

simulator/native.py decides once per process whether the compiled extensions run; these tests
check that the choice is sound (the environment variable forces the fallback, an edited source
never runs its stale extension) and that both give the same digests, to the last bit, over
runs that exercise the core's features: caching, CPU experts and pre-calculations, prefetch,
streamed weights, serving batches, several GPUs, unified memory and the SSD tier.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from daopsim.simulator import native
from daopsim.simulator.runner import simulate
from daopsim.simulator.serving import ServingConfig

REPO = Path(__file__).resolve().parents[1]

#: runs covering the core's features (short: one sequence of the CI trace)
SETTINGS: dict[str, dict[str, Any]] = {
    "lru": {"policy": "lru"},
    "daop": {"policy": "daop"},
    "moe-infinity": {"policy": "moe-infinity"},
    "stream-all": {"policy": "stream-all"},
    "mixtral-offloading": {"policy": "mixtral-offloading", "policy_options": {"prefetch": True}},
    "fiddler-batch": {"policy": "fiddler", "sequences": 2, "serving": ServingConfig(batch=2)},
    "hobbit-two-gpus": {"policy": "hobbit", "hw": "2x-rtx3090-nvlink", "gpus": 2},
    "daop-unified": {"policy": "daop"},
    "lru-ssd": {"policy": "lru", "hw": "rtx4090-990pro-pcie4", "host_memory_gb": 40},
}


def digests() -> dict[str, str]:
    """A SHA-256 of each setting's metrics, token latencies, TTFTs and timeline."""
    out = {}
    for name, kw in SETTINGS.items():
        args = {"trace": "ci-small", "sequences": 1, "cache_ratio": 0.2, "record": True, **kw}
        if name == "daop-unified":  # bf16 Mixtral fits the device only with room to spare
            from daopsim.simulator.testing import roomy

            args["hw"] = roomy("jetson-orin-64g")
        r = simulate(**args)
        h = hashlib.sha256(json.dumps(r.metrics, sort_keys=True, default=repr).encode())
        h.update(np.asarray(r.token_latency, dtype=np.float64).tobytes())
        h.update(np.asarray(r.ttft, dtype=np.float64).tobytes())
        assert r.timeline is not None
        h.update(r.timeline.to_csv(index=False, float_format="%.17g").encode())
        out[name] = h.hexdigest()
    return out


def test_compiled_and_pure_python_give_identical_digests() -> None:
    """The installed core against its sources run in a fresh interpreter with
    ``DAOPSIM_PURE_PYTHON=1``: the same digest for every setting. Without a compiled build
    (no C compiler) both sides run the sources, and the test checks the fallback alone."""
    here = digests()
    code = "import json, test_compiled as t; print(json.dumps(t.digests()))"
    env = {**os.environ, native.ENV: "1", "PYTHONPATH": str(REPO / "tests")}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600, check=True,
    )  # fmt: skip
    pure = json.loads(res.stdout.strip().splitlines()[-1])
    assert pure == here


def test_the_environment_variable_forces_the_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ENV, "1")
    assert native._decide() == (False, f"{native.ENV} is set")


def test_an_edited_source_never_runs_its_stale_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled module whose source changed since the build (its recorded hash differs) is
    imported from the source, and so is every other compiled module."""
    monkeypatch.delenv(native.ENV, raising=False)
    if not native.status()[0]:
        pytest.skip("no compiled build installed: nothing can be stale")
    edited = {**native.source_hashes(), native.COMPILED[0]: "0" * 64}
    monkeypatch.setattr(native, "source_hashes", lambda: edited)
    ok, why = native._decide()
    assert not ok and "sources changed" in why


def test_the_fallback_imports_every_compiled_module_from_its_source() -> None:
    """With the variable set, each compiled module's ``__file__`` is its ``.py`` source."""
    code = (
        "import importlib, json, daopsim.simulator.native as n; "
        "print(json.dumps([importlib.import_module(m).__file__ for m in n.COMPILED]))"
    )
    env = {**os.environ, native.ENV: "1"}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    files = json.loads(res.stdout)
    assert len(files) == len(native.COMPILED) and all(f.endswith(".py") for f in files)
