"""Shared test fixtures: small valid traces and a CLI runner.

Build your own trace with ``make_trace(path, model=..., sequences=..., prefill=..., decode=...,
seed=...)`` (re-exported from daopsim.simulator.testing, importable as ``from
daopsim.simulator.testing import make_trace``), or use the ready fixtures below.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from daopsim.simulator import native
from daopsim.simulator.cli import main
from daopsim.simulator.testing import make_trace, routing_from_experts, tiny_model

__all__ = ["make_trace", "routing_from_experts", "tiny_model"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``pure`` patch the engine core's classes, which a compiled build does not
    allow: when any module runs compiled they are skipped here and run in `make test`'s second
    pass (DAOPSIM_PURE_PYTHON=1 pytest -m pure)."""
    if not native.status().compiled:
        return
    skip = pytest.mark.skip(reason="needs the interpreted core (make test's pure pass runs it)")
    for item in items:
        if "pure" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_trace(tmp_path: Path) -> Path:
    """A valid 2-sequence trace of the tiny model (4 layers, 8 experts, top-2)."""
    return make_trace(tmp_path / "tiny.parquet", sequences=2, prefill=4, decode=4, seed=1)


@pytest.fixture(scope="session")
def session_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A read-only valid trace shared by a whole session (do not modify it)."""
    path = tmp_path_factory.mktemp("traces") / "session.parquet"
    return make_trace(path, sequences=2, prefill=3, decode=3, seed=7, row_group_rows=40)


@pytest.fixture
def cli() -> Callable[..., Result]:
    """Run ``daopsim ARGS...`` in-process; returns click's Result (stdout/stderr separate)."""
    runner = CliRunner()

    def run(*args: object) -> Result:
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=True)

    return run
