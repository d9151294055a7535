"""The installable package: one installed name, every data folder shipped, no data from the cwd.

Everything installs under ``daopsim``: the repository's folders simulator/, policies/,
hardware_profiles/ and traces/ are the packages ``daopsim.simulator`` ... (pyproject.toml's
package-dir; the repository holds no symlink), and no module is ever loaded under a top-level
name of its own (``test_one_installed_name``).

The distribution tests build what a user downloads: ``python -m build --sdist`` on a copy of the
repository (so the build writes only under tmp_path; the copy holds the tests, docs and
notebooks too, which the sdist must leave out), then a wheel from that sdist, installed without
dependencies into a fresh venv that sees the test venv's third-party packages through a plain
path line in a ``.pth`` file. That line adds only a directory: the ``.pth`` files inside it (the
editable install's finder) are not run, so daopsim's own modules come from the wheel alone,
which the test checks. The wheel's only top-level name is ``daopsim`` (and its dist-info), and
the build prints no warning. Then ``daopsim`` runs from an empty directory: ``experiment
--list``, ``validate`` on one row and ``run``. A second wheel compiles one module from the same
sdist (``DAOPSIM_COMPILE``): the compiled build works from an sdist too, and the installed
package says which of its modules run compiled.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import daopsim
from daopsim.simulator import data

REPO = Path(__file__).resolve().parents[1]
#: the repository's folders that install as subpackages of daopsim, never as top-level names
SUBPACKAGES = ("simulator", "policies", "hardware_profiles", "traces")
#: what the build needs from the source tree (pyproject's packages, package-dir and readme,
#: setup.py, MANIFEST.in), and folders the sdist must leave out
SOURCES = (
    "pyproject.toml",
    "setup.py",
    "MANIFEST.in",
    "README.md",
    "daopsim",
    "simulator",
    "policies",
    "hardware_profiles",
    "traces",
    "experiments",
    "validation",
    "baselines",
    "tests",
    "docs",
    "notebooks",
)
#: what the sdist holds at its top (and nothing else)
SDIST_TOP = {
    "PKG-INFO", "setup.cfg", "daopsim.egg-info", "pyproject.toml", "setup.py", "MANIFEST.in",
    "README.md", "daopsim", "simulator", "policies", "hardware_profiles", "traces", "experiments",
    "validation", "baselines",
}  # fmt: skip
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


def test_cli_ignores_decoy_folders_in_the_cwd(tmp_path: Path) -> None:
    """``python -m daopsim`` from a folder holding plain traces/ and hardware_profiles/ folders
    (the current directory is on sys.path, so Python sees them as namespace packages of those
    names): the bundled files are listed, from the installed package, never the decoys."""
    for folder, name in (("traces", "decoy.parquet"), ("hardware_profiles", "decoy.toml")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text("decoy", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for args, bundled in ((["traces", "list"], "ci-small"), (["profiles", "list"], "a6000-pcie4")):
        proc = subprocess.run(
            [sys.executable, "-m", "daopsim", *args, "--json"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert bundled in proc.stdout and "decoy" not in proc.stdout
        assert str(data.bundled_dir("traces").parent) in proc.stdout  # the installed files


def _copy_sources(dest: Path) -> None:
    ignore = shutil.ignore_patterns(
        "__pycache__", "*.pyc", "*.egg-info", "build", "*.so", "native-build.json"
    )
    dest.mkdir()
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build --sdist`` on a copy of the repository."""
    tmp = tmp_path_factory.mktemp("sdist")
    _copy_sources(tmp / "src")
    build = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(tmp / "dist"),
         str(tmp / "src")],
        capture_output=True, text=True, timeout=600, cwd=tmp,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (tarball,) = (tmp / "dist").glob("daopsim-*.tar.gz")
    return tarball


@pytest.mark.slow
def test_the_sdist_carries_what_the_wheel_needs_and_nothing_else(sdist: Path) -> None:
    with tarfile.open(sdist) as tf:
        names = [m.name for m in tf.getmembers() if m.isfile()]
        link = [m.name for m in tf.getmembers() if m.issym() or m.islnk()]
        big = sum(m.size for m in tf.getmembers() if m.name.endswith(".parquet"))
    top = {n.split("/")[1] for n in names}
    assert top == SDIST_TOP, top ^ SDIST_TOP  # no tests, docs or notebooks
    assert not link and not [n for n in names if n.endswith((".so", ".pyc", "native-build.json"))]
    for rel in (
        "setup.py",
        "simulator/native.py",
        "traces/mixtral-8x7b.parquet",
        "policies/learned_model.json",
        "validation/published.toml",
    ):
        assert f"daopsim-0.1.0/{rel}" in names, rel
    # the bundled traces are most of it; the rest is small
    assert sdist.stat().st_size < big + 3_000_000


def _third_party_dirs() -> list[str]:
    dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    return sorted({d for d in dirs if Path(d).is_dir()})


def _wheel(sdist: Path, out: Path, **env: str) -> tuple[Path, str]:
    """A wheel built from the sdist with pip (offline); (the wheel, the build's log)."""
    # -v: the build backend's own output (its warnings) comes through; byte-compiling on, so a
    # PYTHONDONTWRITEBYTECODE of the caller's shell does not add warnings of its own
    build_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    build_env.update(env)
    build = subprocess.run(
        [*PIP, "wheel", "-v", str(sdist), "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(out)],
        capture_output=True, text=True, timeout=900, cwd=out.parent, env=build_env,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = out.glob("daopsim-*.whl")
    return wheel, build.stdout + build.stderr


def _venv(wheel: Path, venv: Path) -> Path:
    """A fresh venv with the wheel installed (no dependencies: the test venv's are visible
    through a path line); its python."""
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
    return py


def _clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.pop("DAOPSIM_PURE_PYTHON", None)
    env.update(
        DAOPSIM_CACHE=str(tmp_path / "cache"),
        MPLCONFIGDIR=str(tmp_path / "mpl"),
        HOME=str(tmp_path / "home"),
    )
    return env


@pytest.mark.slow
def test_wheel_from_the_sdist_installs_and_runs_from_an_empty_directory(
    sdist: Path, tmp_path: Path
) -> None:
    wheels, venv, empty = (tmp_path / n for n in ("wheels", "venv", "empty"))
    wheels.mkdir()
    # the uncompiled package: test_a_compiled_wheel_from_the_sdist compiles; what this test
    # checks (the files shipped, no warning, the workflows) is the same
    wheel, log = _wheel(sdist, wheels, DAOPSIM_PURE_PYTHON="1")
    warnings = [ln for ln in log.splitlines() if "warning" in ln.lower() and "pip" not in ln]
    assert not warnings, "\n".join(warnings)
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
    for pkg in SUBPACKAGES:
        for init in (REPO / pkg).rglob("__init__.py"):
            rel = init.relative_to(REPO).as_posix()
            assert f"daopsim/{rel}" in names, rel

    py = _venv(wheel, venv)
    empty.mkdir()
    env = _clean_env(tmp_path)

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


@pytest.mark.skipif(
    not any(shutil.which(c) for c in ("cc", "gcc", "clang")), reason="no C compiler"
)
@pytest.mark.slow
def test_a_compiled_wheel_from_the_sdist(sdist: Path, tmp_path: Path) -> None:
    """The sdist compiles too (mypyc from its staged sources, outside the repository): a wheel
    with only the core compiled (``DAOPSIM_COMPILE`` naming one module of the core group, which
    compiles whole; no policy, to keep the test short) ships its extensions and the build's
    record inside ``daopsim``; installed, the core runs compiled and the policies from their
    sources, which ``--version`` lists and every command announces in one line."""
    pytest.importorskip("mypyc")
    from daopsim.simulator.native import CORE_GROUP

    wheels, empty = tmp_path / "wheels", tmp_path / "empty"
    wheels.mkdir()
    wheel, _ = _wheel(sdist, wheels, DAOPSIM_COMPILE="daopsim.simulator.heap")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        record = json.loads(zf.read("daopsim/simulator/native-build.json"))
    assert {n.split("/")[0] for n in names} == {"daopsim", "daopsim-0.1.0.dist-info"}
    assert [n for n in names if n.startswith("daopsim/simulator/heap") and ".so" in n]
    assert sorted(record["modules"]) == sorted(CORE_GROUP)
    assert record["skipped"]["daopsim.policies.lru"] == "left out by DAOPSIM_COMPILE"
    py = _venv(wheel, tmp_path / "venv")
    empty.mkdir()
    env = _clean_env(tmp_path)
    probe = subprocess.run(
        [str(py), "-c", "import daopsim.simulator.heap as h, daopsim.policies.lru as o; "
         "print(h.__file__); print(o.__file__)"],
        cwd=empty, env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    heap, ops = probe.stdout.split()
    assert not heap.endswith(".py") and Path(heap).is_relative_to(tmp_path / "venv")
    assert ops.endswith(".py")
    exe = str(tmp_path / "venv" / "bin" / "daopsim")
    version = subprocess.run([exe, "--version"], cwd=empty, env=env, capture_output=True,
                             text=True, timeout=120, check=True)  # fmt: skip
    assert f"build: partial: {len(CORE_GROUP)} modules compiled" in version.stdout
    run = subprocess.run(
        [exe, "run", "--policy", "lru", "--sequences", "1", "--no-progress", "--json"],
        cwd=empty, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["metrics"]["tokens_per_s"] > 0
    (line,) = run.stderr.splitlines()
    assert "left out by DAOPSIM_COMPILE" in line and "make native" in line


def test_the_repository_holds_no_symlink() -> None:
    """A checkout without symbolic links (``core.symlinks=false``, Windows' default) is the same
    checkout: every package is a real folder, mapped by pyproject.toml's package-dir."""
    links = [
        str(p.relative_to(REPO))
        for name in SOURCES
        for p in [REPO / name, *((REPO / name).rglob("*") if (REPO / name).is_dir() else ())]
        if p.is_symlink()
    ]
    assert links == []


@pytest.mark.slow
def test_the_type_checker_sees_each_module_once(tmp_path: Path) -> None:
    """mypy with the committed configuration, on the sources laid out as installed (what
    ``make typecheck`` and mypyc read): every compiled module is checked once, by its one name
    daopsim.*, and without an error."""
    pytest.importorskip("mypy")
    from daopsim.simulator import native

    native.stage(REPO, tmp_path / "build" / "stage")
    res = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "cache"), "-v"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:]
    checked = re.findall(r"^LOG:  Processing SCC .*$|^LOG:  Parsing (\S+) \((\S+)\)$",
                         res.stderr, re.MULTILINE)  # fmt: skip
    names = [m for _, m in checked if m]
    ours = [n for n in names if n.startswith(("daopsim.", "simulator", "policies"))]
    assert len(ours) == len(set(ours)), "a module was read twice"
    assert not [n for n in ours if not n.startswith("daopsim")], "a module without daopsim."
    assert set(native.candidates(REPO)) <= set(ours)
    assert "Success: no issues found" in res.stdout
