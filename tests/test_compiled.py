"""The compiled build (mypyc) and its pure-Python fallback: identical results, and the right
modules run compiled.

simulator/native.py decides, per module, whether its extension runs: these tests check that both
builds give the same digests, to the last bit, over runs that exercise the core's features
(caching, CPU experts and pre-calculations, prefetch, streamed weights, serving batches, several
GPUs, unified memory, the SSD tier); that an edited or added module runs from its source with
exactly the compiled modules that import it (on the real import graph of the sources), while the
rest stays compiled; and that every command says so in one line on stderr. With a compiled build
installed, one test edits a policy in an installed copy and runs it: the core stays compiled.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from daopsim.simulator import native
from daopsim.simulator.cli import main
from daopsim.simulator.runner import simulate
from daopsim.simulator.serving_config import ServingConfig

REPO = Path(__file__).resolve().parents[1]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]

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


@pytest.mark.slow
def test_compiled_and_pure_python_give_identical_digests() -> None:
    """The installed build against its sources run in a fresh interpreter with
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


def test_the_fallback_imports_every_compiled_module_from_its_source() -> None:
    """With the variable set, each compiled module's ``__file__`` is its ``.py`` source."""
    code = (
        "import importlib, json, daopsim.simulator.native as n; "
        "print(json.dumps([importlib.import_module(m).__file__ for m in n.candidates()]))"
    )
    env = {**os.environ, native.ENV: "1"}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    files = json.loads(res.stdout)
    assert len(files) == len(native.candidates()) and all(f.endswith(".py") for f in files)


# -- the decision, on the real sources with stand-in extensions ------------------------------


@pytest.fixture
def built(tmp_path: Path) -> Path:
    """A copy of simulator/ and policies/ as a compiled build leaves them: every module of
    :func:`native.candidates` with (empty stand-in) extension files and the build's record
    of the real sources' hashes and imports."""
    base = tmp_path / "pkg"
    for folder in native.FOLDERS:
        shutil.copytree(REPO / folder, base / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.json"))  # fmt: skip
    modules = native.candidates(base)
    for m in modules:
        for ext in (m, native.library(m)):
            folder = native.source_path(m, base).parent
            (folder / (ext.rpartition(".")[2] + SUFFIX)).write_bytes(b"")
    record = native.record(base, modules, {})
    native.manifest_path(base).write_text(json.dumps(record))
    return base


def _edit(base: Path, module: str) -> None:
    path = native.source_path(module, base)
    path.write_text(path.read_text() + "\n# edited\n")


def test_a_current_build_runs_every_module_compiled(built: Path) -> None:
    b = native.decide(built, {})
    assert b.state == "compiled" and b.compiled == set(native.candidates(built))
    assert b.core_compiled and not b.interpreted and not b.bypass
    assert b.announcement() is None and b.describe().startswith("compiled")


def test_an_edited_policy_runs_from_its_source_with_what_imports_it(built: Path) -> None:
    """lru is edited: lru and the policies built on it (hobbit, mixtral-offloading, ...: every
    policy file that imports it) run from their sources; the core, the policy API and every
    other policy stay compiled."""
    _edit(built, "daopsim.policies.lru")
    b = native.decide(built, {})
    assert b.state == "partial"
    users = {
        f"daopsim.policies.{p.stem}": "imports policies/lru.py"
        for p in sorted((REPO / "policies").glob("*.py"))
        if "from daopsim.policies.lru import" in p.read_text()
    }
    assert {"daopsim.policies.hobbit", "daopsim.policies.mixtral_offloading"} <= set(users)
    assert b.interpreted == {"daopsim.policies.lru": "edited since the build", **users}
    assert b.bypass == set(b.interpreted)
    assert b.core_compiled and "daopsim.policies.base" in b.compiled
    assert b.compiled | set(b.interpreted) == set(native.candidates(built))
    line = b.announcement()
    assert line is not None and "\n" not in line
    assert "policies/lru.py edited since the build" in line and "make native" in line


def test_an_edited_policy_api_takes_everything_that_imports_it(built: Path) -> None:
    """policies/base.py is compiled with the core (one library) and imported by every policy:
    all of them run from their sources, and nothing stays compiled."""
    _edit(built, "daopsim.policies.base")
    b = native.decide(built, {})
    assert set(b.interpreted) == set(native.candidates(built)) and not b.compiled
    assert b.interpreted["daopsim.policies.base"] == "edited since the build"
    assert b.interpreted["daopsim.simulator.heap"] == "is compiled with policies/base.py"
    assert b.interpreted["daopsim.policies.lru"] in (
        "imports policies/base.py", "imports policies/caching.py")  # fmt: skip
    assert b.state == "pure" and "policies/base.py edited" in (b.announcement() or "")


def test_an_edited_core_module_takes_its_library(built: Path) -> None:
    """The core group is one library: an edited executor takes the core group with it, the
    policy API included, and so every policy."""
    _edit(built, "daopsim.simulator.core.executor")
    b = native.decide(built, {})
    assert set(b.interpreted) == set(native.candidates(built)) and not b.compiled
    assert b.interpreted["daopsim.simulator.core.executor"] == "edited since the build"
    assert all(why.startswith(("imports ", "is compiled with ")) for m, why in
               b.interpreted.items() if m != "daopsim.simulator.core.executor")  # fmt: skip
    line = b.announcement() or ""
    assert "simulator/core/executor.py edited since the build" in line


def test_an_added_policy_runs_from_its_source_alone(built: Path) -> None:
    (built / "policies" / "my_lru.py").write_text("from daopsim.policies.lru import LRUPolicy\n")
    b = native.decide(built, {})
    assert b.interpreted == {"daopsim.policies.my_lru": "new since the build"}
    assert "daopsim.policies.my_lru" not in b.bypass  # no extension: the plain import finds it
    assert "policies/my_lru.py new since the build" in (b.announcement() or "")


def test_a_missing_extension_or_a_module_left_out(built: Path) -> None:
    ext = native.extension_path("daopsim.policies.caching__mypyc", built)
    assert ext is not None
    ext.unlink()
    record = json.loads(native.manifest_path(built).read_text())
    del record["modules"]["daopsim.policies.static"]
    record["skipped"] = {"daopsim.policies.static": "2 type errors"}
    native.manifest_path(built).write_text(json.dumps(record))
    b = native.decide(built, {})
    assert b.interpreted["daopsim.policies.caching"] == "has no extension"
    assert b.interpreted["daopsim.policies.lru"] == "imports policies/caching.py"
    assert b.interpreted["daopsim.policies.static"] == "not compiled: 2 type errors"
    assert "daopsim.policies.fiddler" in b.compiled and b.core_compiled


def test_a_build_with_part_of_the_core_group_runs_none_of_it(built: Path) -> None:
    """A build that left out one module of the core group (a type error, ``DAOPSIM_COMPILE``)
    must not run the rest of the group compiled: ops' jobs subclass heap's ``Keyed``, and an
    interpreted class cannot inherit from a compiled one. The whole group, and so every policy,
    runs from its source."""
    record = json.loads(native.manifest_path(built).read_text())
    del record["modules"]["daopsim.simulator.core.ops"]
    record["skipped"] = {"daopsim.simulator.core.ops": "3 type errors"}
    native.manifest_path(built).write_text(json.dumps(record))
    b = native.decide(built, {})
    assert b.interpreted["daopsim.simulator.core.ops"] == "not compiled: 3 type errors"
    assert b.interpreted["daopsim.simulator.heap"] == "is compiled with simulator/core/ops.py"
    assert set(b.interpreted) == set(native.candidates(built)) and not b.compiled
    assert b.state == "pure" and not b.core_compiled


def test_no_build_the_variable_or_a_broken_record_mean_pure_python(built: Path) -> None:
    off = native.decide(built, {native.ENV: "1"})
    assert off.state == "off" and not off.compiled and off.announcement() is None
    assert off.bypass == set(native.candidates(built))  # no stale extension is imported
    native.manifest_path(built).write_text("{not json")
    broken = native.decide(built, {})
    assert broken.state == "pure" and "unreadable" in broken.reason and not broken.compiled
    native.manifest_path(built).unlink()
    none = native.decide(built, {})
    assert none.state == "pure" and none.announcement() is None
    assert "make native" in none.describe()


def test_the_build_records_what_each_module_imports(tmp_path: Path) -> None:
    """The record's imports (the fallback's groups) come from the sources: every import of a
    compiled module, also one made only for the type checker, inside a function or relative."""
    mods = native.candidates(REPO)
    rec = native.record(REPO, mods, {})["modules"]
    assert rec["daopsim.policies.hobbit"]["imports"] == [
        "daopsim.policies.base", "daopsim.policies.lru", "daopsim.policies.options"]  # fmt: skip
    assert "daopsim.policies.base" in rec["daopsim.simulator.boundary"]["imports"]
    assert rec["daopsim.simulator.heap"]["imports"] == []
    src = tmp_path / "x.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "import numpy\n"
        "from daopsim.simulator import heap\n"
        "if TYPE_CHECKING:\n    from daopsim.simulator.core.loop import Engine\n"
        "def f():\n    import daopsim.policies.lru\n"
        "from .ops import Op\n"
        "from .. import boundary\n"
    )
    assert native.imports(src, "daopsim.simulator.core.apply", mods) == [
        "daopsim.policies.lru", "daopsim.simulator.boundary", "daopsim.simulator.core.loop",
        "daopsim.simulator.core.ops", "daopsim.simulator.heap"]  # fmt: skip


# -- every command says so --------------------------------------------------------------------


def test_every_command_announces_a_stale_build_in_one_line(
    built: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With part of the build stale, every command (here with ``--help``) prints the notice as
    one line on stderr; ``--version`` names the build and the modules that run interpreted."""
    _edit(built, "daopsim.policies.lru")
    monkeypatch.setattr(native, "_choice", native.decide(built, {}))
    runner = CliRunner()
    notice = native.announcement()
    assert notice
    for name in sorted(main.commands):
        res = runner.invoke(main, [name, "--help"])
        assert res.exit_code == 0, (name, res.output)
        assert res.stderr.splitlines() == [notice], name
    version = runner.invoke(main, ["--version"])
    assert version.exit_code == 0
    assert "build: partial" in version.stdout and "policies/hobbit.py" in version.stdout
    monkeypatch.setattr(native, "_choice", native.decide(built, {native.ENV: "1"}))
    quiet = runner.invoke(main, ["policies", "--help"])
    assert quiet.stderr == ""


# -- a real compiled build, one policy edited --------------------------------------------------


def _installed_copy(dest: Path) -> Path:
    """The package laid out as installed under ``dest``, with this build's extensions."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "daopsim", dest / "daopsim", ignore=skip)
    for folder in ("simulator", "policies", "hardware_profiles", "traces"):
        shutil.copytree(REPO / folder, dest / "daopsim" / folder, ignore=skip)
    return dest


_PROBE = """
import json, sys, importlib
import daopsim
from daopsim.simulator import native
from daopsim.simulator.runner import simulate
mods = ["daopsim.simulator.core.loop", "daopsim.simulator.boundary", "daopsim.policies.base",
        "daopsim.policies.lru", "daopsim.policies.hobbit", "daopsim.policies.lfu"]
files = {m: importlib.import_module(m).__file__ for m in mods}
r = simulate(policy="lru", hw="a6000-pcie4", trace="ci-small", sequences=1, cache_ratio=0.2)
print(json.dumps({"files": files, "metrics": r.metrics, "root": daopsim.__file__}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not native.status().core_compiled, reason="no compiled build installed")
def test_editing_a_policy_leaves_the_compiled_core_in_use(tmp_path: Path) -> None:
    """An installed copy of this compiled build with policies/lru.py edited: lru, hobbit and
    mixtral-offloading run from their sources, the core and the other policies their
    extensions; lru's results are those of the compiled build; the command line says so."""
    root = _installed_copy(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop(native.ENV, None)

    def probe() -> dict:
        res = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
        return json.loads(res.stdout)

    before = probe()
    assert Path(before["root"]).is_relative_to(root)
    assert not any(f.endswith(".py") for f in before["files"].values())
    _edit(root / "daopsim", "daopsim.policies.lru")
    after = probe()
    ext = {m for m, f in after["files"].items() if not f.endswith(".py")}
    assert ext == {"daopsim.simulator.core.loop", "daopsim.simulator.boundary",
                   "daopsim.policies.base", "daopsim.policies.lfu"}  # fmt: skip
    assert after["metrics"] == before["metrics"]
    cli = [sys.executable, "-m", "daopsim"]
    run = subprocess.run([*cli, "run", "--policy", "lru", "--trace", "ci-small", "--sequences", "1",
                          "--no-progress", "--json"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    (line,) = run.stderr.splitlines()
    assert "policies/lru.py edited since the build" in line
    assert json.loads(run.stdout)["policy"] == "lru"
    version = subprocess.run([*cli, "--version"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120, check=True)  # fmt: skip
    assert "build: partial" in version.stdout and "policies/mixtral_offloading.py" in version.stdout
