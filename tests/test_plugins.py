"""Third-party policies: a tiny out-of-tree package registers through ``daopsim.policies``.

The package in tests/fixtures/plugin_pkg is built and installed with pip into a temporary
folder (never into the venv, so nothing needs uninstalling and a failed run leaves no trace),
which is then put on ``sys.path``; ``importlib.metadata`` finds its entry point there. The
policy then runs through ``simulate()`` in process and through ``daopsim run`` and
``daopsim policies list`` in a subprocess with that folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import policies.registry as registry
from simulator.runner import simulate
from simulator.testing import make_trace

PKG = Path(__file__).parent / "fixtures" / "plugin_pkg"
NAME = "mru-plugin"
DAOPSIM = Path(sys.executable).parent / "daopsim"


def _reset_registry() -> None:
    registry._REGISTRY.pop(NAME, None)
    registry._LOADED = False


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The plugin installed into a temporary folder that is on sys.path during the tests."""
    tmp = tmp_path_factory.mktemp("plugin")
    src = tmp / "src"
    shutil.copytree(PKG, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = tmp / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    cmd += ["--no-build-isolation", "--no-index", "--target", str(target), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(target.glob("daopsim_mru_plugin*.dist-info")), "no dist-info installed"
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    _reset_registry()
    try:
        yield target
    finally:
        sys.path.remove(str(target))
        sys.modules.pop("daopsim_mru_plugin", None)
        importlib.invalidate_caches()
        _reset_registry()


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small tiny-model trace."""
    return make_trace(tmp_path_factory.mktemp("pt") / "t.parquet", sequences=2, decode=6)


def test_plugin_is_not_there_without_install() -> None:
    _reset_registry()
    assert NAME not in registry.available()


def test_plugin_registers_through_entry_point(site: Path) -> None:
    cls = registry.get_policy_class(NAME)
    assert cls.__module__ == "daopsim_mru_plugin"
    assert cls.name == NAME  # named after its entry point
    assert NAME in registry.available()
    assert "lru" in registry.available()  # built-ins still there


def test_plugin_runs_through_simulate(site: Path, trace: Path) -> None:
    cls = registry.get_policy_class(NAME)
    before = cls.calls  # type: ignore[attr-defined]
    res = simulate(NAME, "a6000-pcie4", trace, gpu_experts=12, record=True)
    assert res.config["policy"] == NAME
    assert res.metrics["decode_tokens"] == 6  # one evaluation sequence (the other calibrates)
    assert cls.calls > before  # type: ignore[attr-defined]
    assert res.timeline is not None and len(res.timeline) > 0
    lru = simulate("lru", "a6000-pcie4", trace, gpu_experts=12, record=False)
    assert res.metrics["decode_tokens"] == lru.metrics["decode_tokens"]


@pytest.mark.skipif(not DAOPSIM.exists(), reason="daopsim console script not installed")
def test_plugin_runs_through_the_cli(site: Path, trace: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    run = [str(DAOPSIM), "run", "--policy", NAME, "--trace", str(trace), "--gpu-experts", "12"]
    proc = subprocess.run(
        [*run, "--json", "--no-progress"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["policy"] == NAME and out["gpu_experts"] == 12
    assert out["metrics"]["hit_rate"] >= 0
    listing = subprocess.run(
        [str(DAOPSIM), "policies", "list", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if listing.returncode == 0:  # the policies command may not exist yet
        assert NAME in listing.stdout
    # without the plugin on the path the name is unknown: a one-line user error, exit 2
    bad = subprocess.run([*run, "--no-progress"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown policy" in bad.stderr
