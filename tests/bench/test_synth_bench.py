"""Speed of the synthetic trace generator (run with `make bench`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from daopsim.simulator.synth import write_synthetic
from daopsim.simulator.synth_params import PRESETS


@pytest.mark.bench
def test_mixtral_30_sequences_under_30_seconds(tmp_path: Path) -> None:
    start = time.perf_counter()
    meta = write_synthetic(
        tmp_path / "m.parquet", "mixtral-8x7b", PRESETS["mixtral-8x7b"].params, 30, 256, 512, seed=1
    )
    elapsed = time.perf_counter() - start
    assert meta.counts["rows"] == 30 * 768 * 32
    assert elapsed < 30.0, f"{elapsed:.1f} s"
