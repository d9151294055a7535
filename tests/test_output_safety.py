"""Output safety: run outputs are built in a sibling folder and swapped in whole; a failing run
leaves no output; SIGKILL in the middle of rewriting a run's files leaves the previous set
intact. The attack corpus (tests/test_attacks.py) covers hostile targets and OS errors."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from daopsim.policies import registry
from daopsim.policies.base import Action, Plan, Policy
from daopsim.simulator.cli import main
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import make_trace


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("safety") / "t.parquet"
    return make_trace(path, sequences=4, prefill=8, decode=40, seed=9)


class FailsLate(Policy):
    """Runs fine for a while, then raises (after outputs could have been half written)."""

    name = "safety-fails-late"

    def decode_layer(self, view: Any) -> Plan:
        if view.seq_id == 1 and view.token == 20:
            raise RuntimeError("out of ideas")
        return Plan(actions={int(e): Action.TEMP for e in view.experts})


@pytest.fixture
def fails_late(monkeypatch: pytest.MonkeyPatch) -> str:
    registry.available()
    monkeypatch.setitem(registry._REGISTRY, FailsLate.name, FailsLate)
    return FailsLate.name


def test_run_outputs_are_built_beside_and_swapped_in_whole(
    trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staged: list[Path] = []
    real = os.replace

    def spy(src: Any, dst: Any) -> None:
        assert Path(src).parent == Path(dst).parent  # same folder: rename is atomic
        staged.append(Path(dst))
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    res = simulate(policy="lru", trace=trace, cache_ratio=0.25, record=True)
    out = tmp_path / "out"
    for _ in range(2):  # the second write replaces the first set
        res.write(out)
    files = sorted(p.name for p in out.iterdir())
    assert set(files) == {
        "metrics.json",
        "timeline.parquet",
        "trace.perfetto.json.gz",
        "gantt.png",
        "hit_rate.png",
    }
    # every file was written in a hidden sibling staging folder, never in place
    assert {p.name for p in staged} == set(files) and len(staged) == 2 * len(files)
    assert all(
        p.parent.parent == tmp_path and p.parent.name.startswith(".out.new-") for p in staged
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left


def test_failing_run_writes_nothing(trace: Path, tmp_path: Path, fails_late: str) -> None:
    out = tmp_path / "new"
    res = CliRunner().invoke(
        main,
        ["run", "--policy", fails_late, "--trace", str(trace), "--no-progress", "--out", str(out)],
    )
    assert res.exit_code == 2 and "token 20" in res.stderr
    assert not out.exists()


def test_failing_run_keeps_previous_outputs(trace: Path, tmp_path: Path, fails_late: str) -> None:
    out = tmp_path / "old"
    ok = CliRunner().invoke(
        main, ["run", "--policy", "lru", "--trace", str(trace), "--out", str(out)]
    )
    assert ok.exit_code == 0, ok.output
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    res = CliRunner().invoke(
        main,
        ["run", "--policy", fails_late, "--trace", str(trace), "--no-progress", "--out", str(out)],
    )
    assert res.exit_code == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


WRITER = """
import sys
from daopsim.simulator.runner import simulate
res = simulate(policy="lru", trace=sys.argv[1], cache_ratio=0.25, record=True)
res.write(sys.argv[2], plots=False)
print("ready", flush=True)
while True:
    res.write(sys.argv[2], plots=False)
"""


def test_sigkill_mid_write_leaves_previous_files_intact(trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    expected = simulate(policy="lru", trace=trace, cache_ratio=0.25, record=False)
    want = json.loads(expected.to_json())
    rng = random.Random(7)
    rows = None
    for _ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(trace), str(out)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.4))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        assert json.loads((out / "metrics.json").read_text()) == want
        n = pq.read_metadata(out / "timeline.parquet").num_rows
        assert rows is None or n == rows
        rows = n
        with gzip.open(out / "trace.perfetto.json.gz") as fh:
            json.load(fh)
    assert rows and rows > 1000  # a timeline big enough that a write takes a while
