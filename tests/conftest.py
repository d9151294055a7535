"""Shared test fixtures: small valid traces and a CLI runner.

Build your own trace with ``make_trace(path, model=..., sequences=..., prefill=..., decode=...,
seed=...)`` (re-exported from daopsim.simulator.testing, importable as ``from
daopsim.simulator.testing import make_trace``), or use the ready fixtures below.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from daopsim.simulator import native
from daopsim.simulator.cli import main
from daopsim.simulator.testing import make_trace, routing_from_experts, tiny_model

__all__ = ["make_trace", "routing_from_experts", "tiny_model"]


#: markers whose tests `make test` runs in a pass of their own, collecting only the files in
#: which ``grep -l "mark.NAME"`` finds the marker (Makefile: PURE_TESTS, MEASURE_TESTS)
OWN_PASS_MARKERS = ("pure", "measure")


def own_pass_misses(items: list[pytest.Item]) -> list[str]:
    """Tests carrying an own-pass marker in a file whose text never names it as ``mark.NAME``:
    `make test`'s grep would not find the file, and its pass would silently skip them."""
    texts: dict[Path, str] = {}
    misses = []
    for item in items:
        for name in OWN_PASS_MARKERS:
            if item.get_closest_marker(name) is None:
                continue
            path = Path(item.path)
            if path not in texts:
                texts[path] = path.read_text(encoding="utf-8")
            if f"mark.{name}" not in texts[path]:
                misses.append(f"{item.nodeid}: marker {name!r} not written as `mark.{name}`")
    return misses


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``pure`` patch the engine core's classes, which a compiled build does not
    allow: when any module runs compiled they are skipped here and run in `make test`'s second
    pass (DAOPSIM_PURE_PYTHON=1 pytest -m pure). That pass, and the ``measure`` pass, collect
    only the files that name their marker: a test marked some other way fails collection."""
    misses = own_pass_misses(items)
    if misses:
        raise pytest.UsageError("\n".join(misses))
    # Tests marked ``slow`` (each several CPU-seconds or more) run first. pytest-xdist's
    # worksteal gives each worker a contiguous share of this order and an idle worker takes
    # tests from the END of the other's queue, so with the long tests first the last tests
    # of the run are short ones and both workers finish together. The sort is stable: each
    # module's tests keep their order, and their module-scoped fixtures are made once.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
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


@pytest.fixture(autouse=True)
def _policy_registry_restored() -> Iterator[None]:
    """Each test leaves the policy registry as it found it: a policy file a test runs in
    process (``--policy file.py:Class``) registers every class of that file, and one of them
    may be faulty on purpose, which would break ``policies list`` in a later test of the same
    worker."""
    from daopsim.policies import registry

    registry.available()  # the built-ins and plugins are loaded before the snapshot
    before = dict(registry._REGISTRY)
    yield
    if before != registry._REGISTRY:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(before)
