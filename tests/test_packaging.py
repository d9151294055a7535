"""The installable package: one installed name, every data folder shipped, no data from the cwd.

Everything installs under ``daopsim``: the repository's folders simulator/, policies/,
hardware_profiles/ and traces/ are the packages ``daopsim.simulator`` ... (symlinks in daopsim/),
and no module is ever loaded under a top-level name of its own (``test_one_installed_name``).

``test_wheel_installs_and_runs_from_an_empty_directory`` builds the wheel from a copy of the
source (so the build writes only under tmp_path), installs it without dependencies into a fresh
venv, and makes the test venv's third-party packages visible through a plain path line in a
``.pth`` file. That line adds only a directory: the ``.pth`` files inside it (the editable
install's finder) are not run, so daopsim's own modules come from the wheel alone, which the test
checks. The wheel's only top-level name is ``daopsim`` (and its dist-info), and the build prints
no warning. Then ``daopsim`` runs from an empty directory: ``experiment --list``, ``validate`` on
one row and ``run``.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import daopsim
from daopsim.simulator import data

REPO = Path(__file__).resolve().parents[1]
#: the repository's folders that install as subpackages of daopsim, never as top-level names
SUBPACKAGES = ("simulator", "policies", "hardware_profiles", "traces")
#: what the build needs from the source tree (pyproject's packages, package-dir and readme)
SOURCES = (
    "pyproject.toml",
    "README.md",
    "daopsim",
    "simulator",
    "policies",
    "hardware_profiles",
    "traces",
    "experiments",
    "validation",
    "baselines",
)
#: pip of the test's interpreter, offline and quiet
PIP = (sys.executable, "-m", "pip", "--no-input", "--disable-pip-version-check", "-q")
#: a cheap validation row (one sequence of the bundled Mixtral trace)
ROW = "fiddler-a6000-mixtral-offloading"
#: a one-file policy (``--policy FILE.py:CLASS``)
MY_POLICY = """
from daopsim import CachingPolicy


class MyPolicy(CachingPolicy):
    name = "my-mru"

    def init_state(self, ctx):
        self.last = {}

    def touch(self, layer, expert, step, weight):
        self.last[layer, expert] = step

    def choose_victim(self, layer, protected, step):
        cands = [e for e in self.cache[layer] if e not in protected]
        return max(cands, key=lambda e: self.last.get((layer, e), -1))
"""


def test_public_api_names() -> None:
    from daopsim.policies.base import Action, Plan, Policy, View
    from daopsim.policies.registry import register
    from daopsim.simulator.runner import simulate
    from daopsim.simulator.sweep import sweep

    assert daopsim.simulate is simulate and daopsim.sweep is sweep
    assert daopsim.Policy is Policy and daopsim.register is register
    assert (daopsim.Plan, daopsim.Action, daopsim.View) == (Plan, Action, View)
    assert isinstance(daopsim.__version__, str) and daopsim.__version__
    assert set(daopsim.__all__) == set(daopsim._LAZY) | {"__version__"}
    assert set(daopsim.__all__) <= set(dir(daopsim))
    for name in daopsim.__all__:
        getattr(daopsim, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        daopsim.nope  # noqa: B018


def test_public_api_runs() -> None:
    res = daopsim.simulate(policy="lru", hw="a6000-pcie4", trace="ci-small", sequences=1)
    assert res.metrics["tokens_per_s"] > 0
    assert "lru" in daopsim.policies()


#: a session through the public API: a run, the policy list, every CLI command module
_THROUGH_DAOPSIM = """
import json, sys
import daopsim
daopsim.simulate(policy="lru", hw="a6000-pcie4", trace="ci-small", sequences=1)
assert "lru" in daopsim.policies() and "lru" in daopsim.policies.registry.available()
daopsim.list_profiles(), daopsim.bundled_traces(), daopsim.get_runtime("hf-eager")
from daopsim.simulator.cli import main
top = {"simulator", "policies", "hardware_profiles", "traces"}
print(json.dumps(sorted(m for m in sys.modules if m.partition(".")[0] in top)))
"""


def test_one_installed_name() -> None:
    """Every module has one name, under daopsim: after a session through ``daopsim``, no module
    named ``simulator``, ``policies``, ``hardware_profiles`` or ``traces`` (or a submodule) is
    loaded, here or in a fresh interpreter started in the repository (whose folders of those names
    are on sys.path there). Importing one of them by its folder's name fails with a pointer to the
    real name, so no source file can run twice as two modules."""
    top = set(SUBPACKAGES)
    assert not [m for m in sys.modules if m.partition(".")[0] in top]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", _THROUGH_DAOPSIM],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
    for pkg in SUBPACKAGES:
        proc = subprocess.run(
            [sys.executable, "-c", f"import {pkg}"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 1, (pkg, proc.stderr)
        assert f"is the package daopsim.{pkg}: import it by that name" in proc.stderr
    # the public API's policies() is the subpackage daopsim.policies, called
    assert daopsim.policies is sys.modules["daopsim.policies"]
    assert daopsim.policies() == daopsim.policies.registry.available()


def test_every_bundled_folder_is_found() -> None:
    for folder in (*data.SUBPACKAGES, *data.UNDER_DAOPSIM):
        path = data.bundled_dir(folder)
        assert path.is_dir() and any(path.iterdir()), folder
    assert (data.bundled_dir("validation") / "published.toml").is_file()
    assert (data.bundled_dir("baselines") / "policy-metrics.json").is_file()
    with pytest.raises(ValueError):
        data.bundled_dir("docs")


def test_a_same_named_folder_on_the_path_does_not_hide_bundled_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a checkout meets when the cwd (on sys.path under `python -m` or Jupyter) holds a
    # plain traces/ folder: Python resolves `traces` to that namespace package. The bundled
    # traces are daopsim.traces, which no top-level name can hide.
    decoy = tmp_path / "traces"
    decoy.mkdir()
    (decoy / "decoy.parquet").write_bytes(b"not a trace")
    spec = importlib.machinery.ModuleSpec("traces", None, is_package=True)
    spec.submodule_search_locations = [str(decoy)]
    fake = type(sys)("traces")
    fake.__spec__ = spec
    fake.__path__ = [str(decoy)]
    monkeypatch.setitem(sys.modules, "traces", fake)
    names = data.bundled_traces()
    assert "decoy" not in names and data.CI_TRACE in names
    assert data.traces_dir().resolve() == REPO / "traces"


#: A Python start-up that imports daopsim the way an editable install does: a meta-path finder
#: placed after the normal path finder maps the top-level name to the source tree. The current
#: directory is on sys.path (as under `python -c`, `python -m` or Jupyter), so plain traces/ and
#: hardware_profiles/ folders there are found as namespace packages of those names: the
#: situation that used to hide the bundled data when those were top-level packages.
_EDITABLE_LIKE = """
import importlib.machinery, importlib.util, sys
REPO, ARGS = sys.argv[1], sys.argv[2:]
NAMES = {"daopsim"}
class SourceTree:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in NAMES:
            return None
        init = f"{REPO}/{name}/__init__.py"
        return importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[f"{REPO}/{name}"])
at = sys.meta_path.index(importlib.machinery.PathFinder) + 1
sys.meta_path.insert(at, SourceTree)
sys.argv = ["daopsim", *ARGS]
from daopsim.simulator.cli import main
main()
"""


def test_cli_ignores_decoy_folders_in_the_cwd(tmp_path: Path) -> None:
    for folder, name in (("traces", "decoy.parquet"), ("hardware_profiles", "decoy.toml")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text("decoy", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for args, bundled in ((["traces", "list"], "ci-small"), (["profiles", "list"], "a6000-pcie4")):
        proc = subprocess.run(
            [sys.executable, "-c", _EDITABLE_LIKE, str(REPO), *args, "--json"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert bundled in proc.stdout and "decoy" not in proc.stdout
        assert str(REPO) in proc.stdout  # the bundled files, from the source tree


def _copy_sources(dest: Path) -> None:
    ignore = shutil.ignore_patterns(
        "__pycache__", "*.pyc", "*.egg-info", "build", "*.so", "native-build.json"
    )
    dest.mkdir()
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            # symlinks=True: daopsim/simulator stays a symlink to the copy's simulator/
            shutil.copytree(src, dest / name, ignore=ignore, symlinks=True)
        else:
            shutil.copy2(src, dest / name)


def _third_party_dirs() -> list[str]:
    dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    return sorted({d for d in dirs if Path(d).is_dir()})


def test_wheel_installs_and_runs_from_an_empty_directory(tmp_path: Path) -> None:
    src, wheels, venv, empty = (tmp_path / n for n in ("src", "wheels", "venv", "empty"))
    _copy_sources(src)
    # -v: the build backend's own output (its warnings) comes through; byte-compiling on, so a
    # PYTHONDONTWRITEBYTECODE of the caller's shell does not add warnings of its own
    build_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    # the uncompiled package: compiling takes minutes and tests/test_compiled.py checks the
    # compiled build; what this test checks (the files shipped, no warning) is the same
    build_env["DAOPSIM_PURE_PYTHON"] = "1"
    build = subprocess.run(
        [
            *PIP,
            "wheel",
            "-v",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(wheels),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=build_env,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    log = build.stdout + build.stderr
    warnings = [ln for ln in log.splitlines() if "warning" in ln.lower() and "pip" not in ln]
    assert not warnings, "\n".join(warnings)
    (wheel,) = wheels.glob("daopsim-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top_level = zf.read("daopsim-0.1.0.dist-info/top_level.txt").decode().split()
    # one installed name: daopsim (and its dist-info), the folders inside it
    assert {n.split("/")[0] for n in names} == {"daopsim", "daopsim-0.1.0.dist-info"}
    assert top_level == ["daopsim"]
    for pkg in SUBPACKAGES:
        assert f"daopsim/{pkg}/__init__.py" in names, pkg
    assert "daopsim/simulator/core/ops.py" in names and "daopsim/policies/lru.py" in names
    assert any(
        n.startswith("daopsim/hardware_profiles/runtimes/") and n.endswith(".toml") for n in names
    )
    assert "daopsim/traces/ci-small.parquet" in names
    assert "daopsim/__main__.py" in names
    # every package of the source tree is shipped, inside daopsim (a new subpackage missing
    # from pyproject's list would only fail when a command imports it)
    for init in Path(src).rglob("__init__.py"):
        rel = init.relative_to(src).as_posix()
        if rel.split("/")[0] in SUBPACKAGES:
            assert f"daopsim/{rel}" in names, rel

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    install = subprocess.run(
        [*PIP, "--python", str(py), "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "_shared_deps.pth").write_text(
        "\n".join(_third_party_dirs()) + "\n", encoding="utf-8"
    )

    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        DAOPSIM_CACHE=str(tmp_path / "cache"),
        MPLCONFIGDIR=str(tmp_path / "mpl"),
        HOME=str(tmp_path / "home"),
    )

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            list(args), cwd=empty, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, f"{args}: {proc.stderr[-3000:]}"
        return proc

    where = run(
        str(py), "-c", "import daopsim.simulator, daopsim.traces; print(daopsim.simulator.__file__)"
    )
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    # no top-level names: the other projects' `simulator`, `policies`, `traces` stay theirs
    for pkg in SUBPACKAGES:
        probe = subprocess.run(
            [str(py), "-c", f"import {pkg}"], cwd=empty, env=env, capture_output=True, text=True
        )
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, pkg
    exe = str(venv / "bin" / "daopsim")
    listing = run(exe, "experiment", "--list")
    assert "daop-paper" in listing.stdout and str(venv) in listing.stdout
    report = json.loads(run(exe, "validate", "--rows", ROW, "--sequences", "1", "--json").stdout)
    assert [r["id"] for r in report["rows"]] == [ROW]
    result = json.loads(
        run(exe, "run", "--policy", "lru", "--sequences", "1", "--no-progress", "--json").stdout
    )
    assert result["policy"] == "lru" and result["metrics"]["tokens_per_s"] > 0
    # the learned policy's bundled model file is package data
    args = ("--trace", "ci-small", "--sequences", "1", "--no-progress", "--json")
    learned = json.loads(run(exe, "run", "--policy", "learned", *args).stdout)
    assert learned["policy"] == "learned" and learned["metrics"]["hit_rate"] > 0
    version = run(str(py), "-c", "import daopsim; print(daopsim.__version__)")
    assert version.stdout.strip() == "0.1.0"
    assert list(empty.iterdir()) == []  # nothing written into the working directory

    # the workflows the docs name, from the installed wheel
    assert "Usage: daopsim" in run(str(py), "-m", "daopsim", "--help").stdout
    out = tmp_path / "out"
    run(
        exe,
        "run",
        "--policy",
        "lru",
        "--trace",
        "ci-small",
        "--sequences",
        "1",
        "--no-bounds",
        "--no-progress",
        "-o",
        str(out / "run"),
    )
    assert (out / "run" / "metrics.json").is_file()
    (tmp_path / "my_policy.py").write_text(MY_POLICY)
    doc = json.loads(
        run(
            exe,
            "run",
            "--policy",
            f"{tmp_path / 'my_policy.py'}:MyPolicy",
            "--trace",
            "ci-small",
            "--sequences",
            "1",
            "--cache-ratio",
            "0.25",
            "--no-progress",
            "--json",
        ).stdout
    )
    assert doc["policy"] == "my-mru"
    assert doc["metrics"]["tokens_per_s"] <= doc["bounds"]["all-gpu"]["tokens_per_s"]
    head = subprocess.run(
        ["bash", "-c", f'"{exe}" trace stats ci-small | head -1; exit ${{PIPESTATUS[0]}}'],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert head.returncode == 0 and head.stderr == "" and len(head.stdout.splitlines()) == 1
    run(
        exe,
        "sweep",
        "example-grid",
        "--policies",
        "lru",
        "--hw",
        "a6000-pcie4",
        "--cache-ratios",
        "0.125",
        "--sequences",
        "1",
        "--no-progress",
        "-o",
        str(out / "example.parquet"),
    )
    assert (out / "example.parquet").is_file()
    assert run(exe, "experiment", "--list").returncode == 0
    assert list(empty.iterdir()) == []
