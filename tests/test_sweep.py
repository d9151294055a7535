"""Sweeps: grid expansion and keys, the tidy table, failures, executors, resuming and locking."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pandas.testing as pdt
import pytest

from daopsim.simulator.errors import UserError
from daopsim.simulator.grid import Grid, load_grid_file, parse_option_items
from daopsim.simulator.results import METRIC_KEYS, OPTIONAL_METRIC_KEYS
from daopsim.simulator.sweep import run_sweep, sweep
from daopsim.simulator.sweep_expand import expand
from daopsim.simulator.sweep_row import run_config
from daopsim.simulator.sweep_table import parts_dir, read_table
from daopsim.simulator.testing import make_trace

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small trace of the tiny model (4 layers, 8 experts, top-2)."""
    path = tmp_path_factory.mktemp("sweep") / "tiny.parquet"
    return make_trace(path, sequences=4, prefill=6, decode=12, seed=3)


def _grid(trace: Path, **kw: object) -> Grid:
    base: dict[str, object] = {
        "policies": ["lru", "static", "all-gpu"],
        "hw": ["a6000-pcie4", "rtx4090-pcie4"],
        "traces": [str(trace)],
        "cache_ratios": [0.25, 0.5],
        "sequences": 2,
    }
    base.update(kw)
    return Grid(**base)  # type: ignore[arg-type]


def test_expand_order_and_bound_dedup(trace: Path) -> None:
    configs = expand(_grid(trace))
    # per machine: lru x 2 ratios, static x 2 ratios, all-gpu once (it ignores the budget)
    assert [(c.hw, c.policy, c.cache_ratio) for c in configs[:5]] == [
        ("a6000-pcie4", "lru", 0.25),
        ("a6000-pcie4", "lru", 0.5),
        ("a6000-pcie4", "static", 0.25),
        ("a6000-pcie4", "static", 0.5),
        ("a6000-pcie4", "all-gpu", None),
    ]
    assert len(configs) == 10
    assert len({c.key for c in configs}) == 10
    assert [c.index for c in configs] == list(range(10))


def test_keys_follow_content_not_names(trace: Path, tmp_path: Path) -> None:
    keys = [c.key for c in expand(_grid(trace))]
    assert keys == [c.key for c in expand(_grid(trace))]  # stable
    # the same bytes under another name: same keys
    copy = tmp_path / "copy.parquet"
    copy.write_bytes(trace.read_bytes())
    assert [c.key for c in expand(_grid(copy))] == keys
    # different bytes under the same name: all keys change
    other = tmp_path / "other.parquet"
    make_trace(other, sequences=4, prefill=6, decode=12, seed=4)
    assert not set(keys) & {c.key for c in expand(_grid(other))}
    # a profile file with the bundled content hashes like the bundled name
    from daopsim.simulator.data import profiles_dir

    prof = tmp_path / "mine.toml"
    text = (profiles_dir() / "a6000-pcie4.toml").read_text()
    prof.write_text(text)
    assert [c.key for c in expand(_grid(trace, hw=[str(prof)]))] == keys[:5]
    assert "copy_engines = 2" in text
    prof.write_text(text.replace("copy_engines = 2", "copy_engines = 1"))
    assert not set(keys) & {c.key for c in expand(_grid(trace, hw=[str(prof)]))}
    # sequences and seeds are part of the key
    assert not set(keys) & {c.key for c in expand(_grid(trace, sequences=3))}
    assert not set(keys) & {c.key for c in expand(_grid(trace, seeds=[1]))}


def _test_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two throw-away policies with options, registered for one test only."""
    from daopsim.policies import registry
    from daopsim.policies.all_gpu import AllGPUPolicy
    from daopsim.policies.base import ResourceSpec
    from daopsim.policies.options import Param

    class A(AllGPUPolicy):
        name = "sweeptest-a"

        def resources(self) -> ResourceSpec:
            return ResourceSpec(temp_buffers=0)  # a budget like any other policy

        params = {"depth": Param(int, 1, "d"), "mode": Param(str, "x", "m", ("x", "y"))}

    class B(A):
        name = "sweeptest-b"
        params = {"depth": Param(int, 1, "d")}

    registry.available()
    monkeypatch.setitem(registry._REGISTRY, A.name, A)
    monkeypatch.setitem(registry._REGISTRY, B.name, B)


def test_options_scoped_unscoped_and_errors(trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _test_policies(monkeypatch)
    pols = ["sweeptest-a", "sweeptest-b", "all-gpu"]
    g = _grid(
        trace,
        policies=pols,
        hw=["a6000-pcie4"],
        cache_ratios=[0.5],
        options={"depth": ["1", "3"], "sweeptest-a.mode": ["y"]},
    )
    got = [(c.policy, dict(c.options)) for c in expand(g)]
    assert got == [
        ("sweeptest-a", {"depth": 1, "mode": "y"}),  # strings coerced to the option's type
        ("sweeptest-a", {"depth": 3, "mode": "y"}),
        ("sweeptest-b", {"depth": 1}),
        ("sweeptest-b", {"depth": 3}),
        ("all-gpu", {}),
    ]
    with pytest.raises(UserError, match="mode"):
        expand(_grid(trace, policies=pols, options={"sweeptest-a.mode": ["z"]}))
    with pytest.raises(UserError, match="depth"):
        expand(_grid(trace, policies=pols, options={"depth": ["deep"]}))
    with pytest.raises(UserError, match="no policy in the sweep has it"):
        expand(_grid(trace, options={"no_such_option": [1]}))
    with pytest.raises(UserError, match="not in the sweep"):
        expand(_grid(trace, options={"daop.swap_num": [1]}))
    with pytest.raises(UserError, match="host_memory"):
        expand(_grid(trace, options={"host_memory": ["nowhere"]}))
    with pytest.raises(UserError, match="unknown policy"):
        expand(_grid(trace, policies=["nope"]))
    with pytest.raises(UserError, match="unknown hardware profile"):
        expand(_grid(trace, hw=["nope"]))
    with pytest.raises(UserError, match="cache ratio"):
        expand(_grid(trace, cache_ratios=[1.5]))
    assert parse_option_items(["daop.swap_num=1,2", "x=a"]) == {
        "daop.swap_num": ["1", "2"],
        "x": ["a"],
    }
    with pytest.raises(UserError, match="expected"):
        parse_option_items(["novalue"])


def test_grid_file(trace: Path, tmp_path: Path) -> None:
    (tmp_path / "t.parquet").write_bytes(trace.read_bytes())
    f = tmp_path / "grid.toml"
    f.write_text(
        'policies = ["static", "all-gpu"]\nhw = ["a6000-pcie4"]\ntraces = ["t.parquet"]\n'
        'cache_ratios = [0.25, 0.5]\nsequences = 1\nout = "res.parquet"\n'
        '[options.static]\nhost_memory = ["pinned"]\n'
    )
    grid, out = load_grid_file(f)
    assert out == str(tmp_path / "res.parquet")
    assert grid.traces == [str(tmp_path / "t.parquet")]
    assert grid.options == {"static.host_memory": ["pinned"]}
    assert len(expand(grid)) == 3
    bad = tmp_path / "bad.toml"
    bad.write_text('policies = ["lru"]\ncache_ratio = [0.5]\n')
    with pytest.raises(UserError, match="unknown key 'cache_ratio'"):
        load_grid_file(bad)
    bad.write_text("policies = [")
    with pytest.raises(UserError, match="not valid TOML"):
        load_grid_file(bad)


def test_example_grid_file_is_valid() -> None:
    grid, out = load_grid_file(REPO / "experiments" / "example-grid.toml")
    assert out is not None and out.endswith(".parquet")
    assert expand(grid)


def test_table_rows_metrics_and_failures(trace: Path, tmp_path: Path) -> None:
    # 40 resident experts: more than the tiny model's 32, so those runs fail
    g = _grid(trace, gpu_experts=[40])
    df, summary = run_sweep(g, workers=1, out=tmp_path / "r.parquet", progress=False)
    assert len(df) == len(expand(g))
    failed = df[df["status"] == "error"]
    assert len(failed) == 4 and set(failed["gpu_experts"]) == {40}
    assert failed["error"].str.contains("gpu-experts").all()
    assert failed["tokens_per_s"].isna().all()
    ok = df[df["status"] == "ok"]
    assert (ok["tokens_per_s"] > 0).all() and ok["error"].isna().all()
    for col in ("policy", "hw", "trace", "cache_ratio", "gpu_experts", "bound", "key"):
        assert col in df.columns
    for m in METRIC_KEYS:
        # the SSD tier's metrics only appear when some run had a host-memory budget
        assert (m in df.columns) != (m in OPTIONAL_METRIC_KEYS)
    assert "opt.host_memory" in df.columns
    assert all(len(v) == 4 for v in ok["per_layer_hit_rate"])
    bound = ok[ok["policy"] == "all-gpu"]
    assert bound["bound"].all() and (bound["cache_ratio"] == 1.0).all()
    assert (bound["hit_rate"] == 1.0).all()
    assert not ok.loc[ok["policy"] == "lru", "bound"].any()
    # the metrics are those of simulate() for the same configuration
    from daopsim.simulator.runner import simulate

    row = ok[(ok["policy"] == "lru") & (ok["cache_ratio"] == 0.5)].iloc[0]
    ref = simulate("lru", row["hw"], trace, cache_ratio=0.5, sequences=2, record=False)
    for m in sorted(set(METRIC_KEYS) - OPTIONAL_METRIC_KEYS):
        assert row[m] == pytest.approx(ref.metrics[m], nan_ok=True)
    assert list(row["per_layer_hit_rate"]) == pytest.approx(ref.per_layer_hit_rate)
    # the table on disk is the returned one
    pdt.assert_frame_equal(read_table(tmp_path / "r.parquet"), df)
    assert summary.failed == 4 and summary.ok == len(df) - 4


def test_worker_refuses_a_changed_trace(trace: Path, tmp_path: Path) -> None:
    copy = tmp_path / "t.parquet"
    copy.write_bytes(trace.read_bytes())
    cfg = expand(_grid(copy, policies=["lru"], hw=["a6000-pcie4"]))[0]
    make_trace(copy, sequences=4, prefill=6, decode=12, seed=9)
    row = run_config(cfg)
    assert row["status"] == "error" and "differs" in row["error"]


def test_executors_give_identical_tables(trace: Path) -> None:
    g = _grid(trace)
    one = sweep(g, workers=1, progress=False)
    two = sweep(g, workers=2, progress=False)
    pdt.assert_frame_equal(one, two)
    dask = sweep(g, executor="dask", workers=2, progress=False)
    pdt.assert_frame_equal(one, dask)


def test_resume_skips_finished_and_retry_errors(
    trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "r.parquet"
    g = _grid(trace, gpu_experts=[40])
    first, s1 = run_sweep(g, workers=1, out=out, progress=False)
    assert s1.resumed == 0
    n_parts = len(list(parts_dir(out).glob("*.json")))
    assert n_parts == len(first)

    def boom(cfg: object) -> dict[str, object]:
        raise AssertionError("a finished configuration ran again")

    monkeypatch.setattr("daopsim.simulator.sweep.run_config", boom)
    again, s2 = run_sweep(g, workers=1, out=out, progress=False)
    assert s2.resumed == len(first)
    pdt.assert_frame_equal(first, again)
    # a larger grid only runs the new configurations
    calls: list[str] = []

    def counting(cfg: object) -> dict[str, object]:
        calls.append(cfg.key)  # type: ignore[attr-defined]
        return run_config(cfg)  # type: ignore[arg-type]

    monkeypatch.setattr("daopsim.simulator.sweep.run_config", counting)
    g.cache_ratios = [0.25, 0.5, 0.75]
    bigger, _ = run_sweep(g, workers=1, out=out, progress=False)
    assert len(calls) == 4  # lru and static on two machines at 0.75
    assert len(bigger) == len(first) + 4
    calls.clear()
    _, s4 = run_sweep(g, workers=1, out=out, progress=False, retry_errors=True)
    assert len(calls) == s4.failed == 4


def test_lock_refuses_a_second_writer(trace: Path, tmp_path: Path) -> None:
    fcntl = pytest.importorskip("fcntl")
    out = tmp_path / "r.parquet"
    folder = parts_dir(out)
    folder.mkdir()
    with open(folder / ".lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UserError, match="another sweep is writing"):
            sweep(_grid(trace), workers=1, out=out, progress=False)
    assert not out.exists()
    sweep(_grid(trace, policies=["lru"]), workers=1, out=out, progress=False)  # free again
    assert out.exists()


def _cli_args(trace: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "daopsim",
        "sweep",
        "--policies",
        "lru,static,all-gpu",
        "--hw",
        "a6000-pcie4,a100-80g-pcie4",
        "--cache-ratios",
        "0.125,0.25,0.375",
        "--traces",
        str(trace),
        "--out",
        str(out),
        "--workers",
        "1",
        "--no-progress",
        "--json",
    ]


def test_sigkill_midway_then_resume_equals_uninterrupted(tmp_path: Path) -> None:
    # a slower trace so the sweep is still running when it is killed
    big = make_trace(tmp_path / "mix.parquet", model="mixtral-8x7b", sequences=3, decode=48)
    killed_out = tmp_path / "killed.parquet"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        _cli_args(big, killed_out), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    folder = parts_dir(killed_out)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if folder.is_dir() and len(list(folder.glob("*.json"))) >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the sweep finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n_done = len(list(folder.glob("*.json")))
    assert 3 <= n_done < 14
    assert not killed_out.exists()
    again = subprocess.run(_cli_args(big, killed_out), env=env, capture_output=True, text=True)
    assert again.returncode in (0, 1), again.stderr
    summary = json.loads(again.stdout)
    assert summary["resumed"] >= n_done
    clean_out = tmp_path / "clean.parquet"
    clean = subprocess.run(_cli_args(big, clean_out), env=env, capture_output=True, text=True)
    assert clean.returncode == again.returncode, clean.stderr
    pdt.assert_frame_equal(pd.read_parquet(killed_out), pd.read_parquet(clean_out))


def test_cli_exit_codes_and_json(trace: Path, tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "r.parquet"
    base = ["sweep", "--traces", trace, "--hw", "a6000-pcie4", "--out", out, "--no-progress"]
    res = cli(*base, "--policies", "lru,all-gpu", "--cache-ratios", "0.25", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["configurations"] == 2 and data["failed"] == 0
    res = cli(*base, "--policies", "lru", "--gpu-experts", "8,40")
    assert res.exit_code == 1
    assert "1 failed" in res.stdout and "failed: lru" in res.stderr
    res = cli(*base, "--policies", "nope")
    assert res.exit_code == 2 and "error: unknown policy" in res.stderr
    res = cli(*base, "--policies", "lru", "--cache-ratios", "x")
    assert res.exit_code == 2 and "not a valid float" in res.stderr
    res = cli("sweep", "--policies", "lru", "--traces", trace)
    assert res.exit_code == 2 and "--out" in res.stderr
    res = cli(*base, "--policies", "lru", "--policy-opt", "bogus=1")
    assert res.exit_code == 2 and "bogus" in res.stderr


PLUGIN_SRC = '''
from daopsim.policies.lru import LRUPolicy
from daopsim.policies.registry import register


@register
class EditedLRU(LRUPolicy):
    """LRU under another name, in a module the test edits."""

    name = "edited-lru"
'''


def test_resume_reruns_a_policy_whose_source_changed(
    trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a policy module outside the package, as a user's plugin would be
    mod_dir = tmp_path / "mods"
    mod_dir.mkdir()
    module = mod_dir / "edited_lru_plugin.py"
    module.write_text(PLUGIN_SRC)
    monkeypatch.syspath_prepend(str(mod_dir))
    import importlib

    importlib.import_module("edited_lru_plugin")
    out = tmp_path / "r.parquet"
    g = _grid(trace, policies=["edited-lru", "lru"], hw=["a6000-pcie4"], cache_ratios=[0.5])
    first, _ = run_sweep(g, workers=1, out=out, progress=False)
    assert (first["status"] == "ok").all()
    calls: list[str] = []

    def counting(cfg: object) -> dict[str, object]:
        calls.append(cfg.policy)  # type: ignore[attr-defined]
        return run_config(cfg)  # type: ignore[arg-type]

    monkeypatch.setattr("daopsim.simulator.sweep.run_config", counting)
    _, same = run_sweep(g, workers=1, out=out, progress=False)
    assert calls == [] and same.resumed == 2
    # the plugin's source changes (a comment is enough: the code identity is its bytes)
    module.write_text(PLUGIN_SRC + "\n# tuned\n")
    again, s = run_sweep(g, workers=1, out=out, progress=False)
    assert calls == ["edited-lru"] and s.resumed == 1
    assert again.loc[again["policy"] == "edited-lru", "key"].iloc[0] != first["key"].iloc[0]
    assert again.loc[again["policy"] == "lru", "key"].iloc[0] == first["key"].iloc[1]


def test_code_identity_covers_base_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    from daopsim.policies.registry import get_policy_class
    from daopsim.simulator import sweep_expand as sweep_mod

    lru, all_gpu = get_policy_class("lru"), get_policy_class("all-gpu")
    before = sweep_mod.policy_code_sha256(lru)
    all_gpu_before = sweep_mod.policy_code_sha256(all_gpu)
    real = sweep_mod.file_sha256

    def edited_caching(path: str | os.PathLike[str]) -> str:
        # pretend policies/caching.py (LRU's base class module) was edited
        return "0" * 64 if Path(path).name == "caching.py" else real(path)

    monkeypatch.setattr(sweep_mod, "file_sha256", edited_caching)
    assert sweep_mod.policy_code_sha256(lru) != before
    # a policy that does not derive from the caching base keeps its identity
    assert sweep_mod.policy_code_sha256(all_gpu) == all_gpu_before


def _descendants(pid: int) -> list[Any]:
    psutil = pytest.importorskip("psutil")
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize(
    ("executor", "sig"),
    [("local", signal.SIGKILL), ("local", signal.SIGTERM), ("dask", signal.SIGKILL)],
    ids=["local-kill", "local-term", "dask-kill"],
)
def test_workers_exit_when_the_sweep_dies(tmp_path: Path, executor: str, sig: int) -> None:
    psutil = pytest.importorskip("psutil")
    if executor == "dask":
        pytest.importorskip("distributed")
    big = make_trace(tmp_path / "mix.parquet", model="mixtral-8x7b", sequences=3, decode=48)
    out = tmp_path / "r.parquet"
    args = _cli_args(big, out)
    args[args.index("--workers") + 1] = "2"
    args += ["--executor", executor]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[Any] = []
    try:
        # wait until the runs are under way: two workers busy (or a finished row)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            kids = _descendants(proc.pid)
            busy = [k for k in kids if _cpu_seconds(k) > 0.5]
            if len(busy) >= 2 or list(parts_dir(out).glob("*.json")):
                workers = kids
                break
            time.sleep(0.1)
        assert proc.poll() is None, "the sweep finished before it could be killed"
        assert workers, "no worker processes found"
        workers = _descendants(proc.pid)  # everything alive at the moment of the kill
        proc.send_signal(sig)
        proc.wait(timeout=30)
        _gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"{len(alive)} of {len(workers)} worker processes outlived the sweep"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in workers:  # never leave strays behind, even when the test fails
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def _cpu_seconds(p: Any) -> float:
    psutil = pytest.importorskip("psutil")
    try:
        t = p.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return float(t.user + t.system)


def test_budgets_that_do_not_fit_are_skipped_rows(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    # Mixtral on the 24 GB RTX 4090: at most 54 of 256 experts fit, so 0.25 and 0.5 do not
    mix = make_trace(tmp_path / "mix.parquet", model="mixtral-8x7b", sequences=2, decode=4)
    g = Grid(
        policies=["lru"],
        hw=["a6000-pcie4", "rtx4090-pcie4"],
        traces=[str(mix)],
        cache_ratios=[0.125, 0.25, 0.5],
        sequences=1,
    )
    df, summary = run_sweep(g, workers=1, out=tmp_path / "r.parquet", progress=False)
    keys = zip(df["hw"], df["cache_ratio"], strict=True)
    status = dict(zip(keys, df["status"], strict=True))
    assert status == {
        ("a6000-pcie4", 0.125): "ok",
        ("a6000-pcie4", 0.25): "ok",
        ("a6000-pcie4", 0.5): "skipped",
        ("rtx4090-pcie4", 0.125): "ok",
        ("rtx4090-pcie4", 0.25): "skipped",
        ("rtx4090-pcie4", 0.5): "skipped",
    }
    skipped = df[df["status"] == "skipped"]
    assert skipped["error"].str.fullmatch(r"does not fit \(at most \d+\)").all()
    at_most = skipped.set_index("hw")["max_gpu_experts"]
    assert int(at_most["a6000-pcie4"]) == int(
        df.loc[(df["hw"] == "a6000-pcie4") & (df["status"] == "ok"), "max_gpu_experts"].iloc[0]
    )
    assert skipped["tokens_per_s"].isna().all()
    assert (summary.skipped, summary.failed, summary.ok) == (3, 0, 3)
    # the CLI: skipped points are reported but the sweep succeeds (exit 0)
    res = cli(
        "sweep", "--policies", "lru", "--hw", "a6000-pcie4,rtx4090-pcie4", "--traces", mix,
        "--cache-ratios", "0.125,0.25,0.5", "--sequences", "1", "--out", tmp_path / "c.parquet",
        "--no-progress",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "3 skipped" in res.stdout and "0 failed" in res.stdout


def test_non_regular_trace_is_refused(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    fifo = tmp_path / "t.parquet"
    os.mkfifo(fifo)
    res = cli("sweep", "--policies", "lru", "--traces", fifo, "--out", tmp_path / "r.parquet")
    assert res.exit_code == 2 and "is a FIFO" in res.stderr
    grid = tmp_path / "g.toml"
    os.mkfifo(grid)
    res = cli("sweep", grid, "--out", tmp_path / "r.parquet")
    assert res.exit_code == 2 and "is a FIFO" in res.stderr


def test_sweep_from_a_plain_script_without_a_main_guard(tmp_path: Path) -> None:
    """``daopsim.sweep()`` with worker processes at the top level of a script file (no
    ``if __name__ == "__main__":``) runs once, and gives the table one worker gives."""
    script = tmp_path / "my_sweep.py"
    script.write_text(
        "import daopsim\n"
        'grid = {"policies": ["lru", "static"], "hw": ["a6000-pcie4"], "traces": ["ci-small"],\n'
        '        "cache_ratios": [0.25, 0.5], "sequences": 1}\n'
        "two = daopsim.sweep(grid, workers=2, progress=False)\n"
        "one = daopsim.sweep(grid, workers=1, progress=False)\n"
        "assert two.equals(one), (two, one)\n"
        'print("ran", len(two), "rows")\n'
    )
    env = {**os.environ, "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["ran 4 rows"]  # the workers did not run the script
    assert "Traceback" not in proc.stderr
