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

import daopsim.policies.registry as registry
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import make_trace

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
    assert res.metrics["decode_tokens"] == 12  # both sequences: the plugin uses no calibration
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


# --- broken plugins: each one is left out, with its error; everything else keeps working ------

BROKEN_MODULES = {
    "brk_import": 'raise ImportError("needs the package frobnicate")\n',
    "brk_exit": "import sys\nsys.exit(3)\n",
    "brk_notpolicy": "THING = 42\n",
    "brk_clash": (
        "from daopsim.policies.caching import CachingPolicy\n\n\n"
        "class FakeLRU(CachingPolicy):\n"
        '    name = "lru"\n\n'
        "    def choose_victim(self, layer, protected, step):\n"
        "        return min(e for e in self.cache[layer] if e not in protected)\n"
    ),
    "brk_half": (
        "from daopsim.policies.caching import CachingPolicy\n"
        "from daopsim.policies.registry import register\n\n\n"
        "@register\n"
        "class Half(CachingPolicy):\n"
        '    name = "half-registered"\n\n\n'
        'raise RuntimeError("failed after registering")\n'
    ),
}
BROKEN_ENTRY_POINTS = {
    "broken-import": "brk_import:Policy",
    "broken-exit": "brk_exit:Policy",
    "not-a-policy": "brk_notpolicy:THING",
    "lru-clash": "brk_clash:FakeLRU",
    "half": "brk_half:Half",
}


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder holding broken plugin modules and a dist-info declaring their entry points."""
    site = tmp_path_factory.mktemp("broken") / "site"
    info = site / "daopsim_broken_plugins-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: daopsim-broken-plugins\nVersion: 0.1\n", encoding="utf-8"
    )
    lines = [f"{name} = {target}" for name, target in BROKEN_ENTRY_POINTS.items()]
    (info / "entry_points.txt").write_text(
        "[daopsim.policies]\n" + "\n".join(lines) + "\n", encoding="utf-8"
    )
    for module, text in BROKEN_MODULES.items():
        (site / f"{module}.py").write_text(text, encoding="utf-8")
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    registry._LOADED = False
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        for module in BROKEN_MODULES:
            sys.modules.pop(module, None)
        importlib.invalidate_caches()
        registry._REGISTRY.pop("half-registered", None)
        registry._LOADED = False


def test_broken_plugins_are_listed_and_left_out(broken_site: Path) -> None:
    failed = registry.failed_plugins()
    assert set(failed) == set(BROKEN_ENTRY_POINTS)
    assert "ImportError: needs the package frobnicate" in failed["broken-import"].error
    assert "SystemExit" in failed["broken-exit"].error
    assert "not a Policy subclass" in failed["not-a-policy"].error
    assert (
        "'lru'" in failed["lru-clash"].error and "daopsim.policies.lru" in failed["lru-clash"].error
    )
    assert failed["half"].distribution == "daopsim-broken-plugins"
    names = registry.available()
    assert names["lru"].__module__ == "daopsim.policies.lru"  # the built-in keeps its name
    # a module that registered a class and then failed leaves nothing behind
    assert "half-registered" not in names
    assert not set(BROKEN_ENTRY_POINTS) & set(names)


def test_asking_for_a_broken_plugin_names_it(broken_site: Path) -> None:
    with pytest.raises(registry.UserError) as err:
        registry.get_policy_class("broken-import")
    text = str(err.value)
    assert "\n" not in text
    assert "'broken-import'" in text and "brk_import:Policy" in text
    assert "daopsim-broken-plugins" in text and "needs the package frobnicate" in text
    with pytest.raises(registry.UserError, match="unknown policy 'nope'"):
        registry.get_policy_class("nope")


def test_broken_plugins_leave_the_cli_working(broken_site: Path, trace: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(broken_site), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    cli = [sys.executable, "-m", "daopsim"]

    def daopsim(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args], capture_output=True, text=True, env=env, timeout=120)

    listing = daopsim("policies", "list", "--json")
    assert listing.returncode == 0, listing.stderr[-2000:]
    entries = {e["name"]: e for e in json.loads(listing.stdout)}
    assert entries["lru"]["error"] is None and entries["daop"]["error"] is None
    assert "frobnicate" in entries["broken-import"]["error"]
    assert entries["lru-clash"]["target"] == "brk_clash:FakeLRU"
    text = daopsim("policies", "list")
    assert text.returncode == 0
    assert any(
        line.startswith("broken-import") and "BROKEN" in line for line in text.stdout.splitlines()
    )
    run = ["run", "--trace", str(trace), "--gpu-experts", "12", "--no-progress", "--json"]
    ok = daopsim(*run, "--policy", "lru")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)["policy"] == "lru"
    bad = daopsim(*run, "--policy", "broken-import")
    # under --json the error is one JSON object on stdout (docs/cli.md), nothing on stderr
    assert bad.returncode == 2 and bad.stderr.strip() == ""
    error = json.loads(bad.stdout)["error"]
    assert error.startswith("policy plugin 'broken-import'") and "ImportError" in error
    plain = daopsim(*run[:-1], "--policy", "broken-import")
    assert plain.returncode == 2 and plain.stdout == ""
    lines = plain.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: policy plugin 'broken-import'")
