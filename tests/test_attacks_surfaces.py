"""Attack corpus, second round: the surfaces added after the first (import, serving outputs,
validate, regress, experiments, unified memory, sweeps, synth fit, capture).

Each test is one case of issue 28, run as a user would type it: it destroyed a file, said
something false, or printed a traceback. Now every command leaves its files intact, exits with
one ``error:`` line and the documented code (docs/cli.md: 2 for a bad option or input, 3 for an
output that cannot be used), or gives a correct, labelled result. Files a case would write or
destroy are copies inside the test's temporary folder; nothing outside it is touched.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from cli_checks import one_error
from click.testing import CliRunner, Result

import daopsim.simulator.regress
import daopsim.simulator.sweep
import daopsim.simulator.sweep_expand
import daopsim.simulator.sweep_table
from daopsim.simulator.cli import main
from daopsim.simulator.data import bundled_traces
from daopsim.simulator.errors import ExitCode, UserError
from daopsim.simulator.fit import expert_fit
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.models import get_model
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import make_trace
from daopsim.simulator.trace_read import read_meta, validate_trace

USAGE, OUTPUT = int(ExitCode.USAGE), int(ExitCode.OUTPUT)
REPO = Path(__file__).resolve().parent.parent
MODEL = "mixtral-8x7b"  # 32 MoE layers, 8 experts, top-2
ML, E, K = 32, 8, 2


def _cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def _ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """``[n, 32, 2]`` distinct top-2 expert ids of Mixtral."""
    return np.stack([[rng.choice(E, K, replace=False) for _ in range(ML)] for _ in range(n)])


def _copy_trace(dst: Path) -> Path:
    shutil.copyfile(bundled_traces()["ci-small"], dst)
    return dst


# --- files destroyed ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["npy", "jsonl", "npy-named-parquet"])
def test_d1_import_never_replaces_its_source(tmp_path: Path, fmt: str) -> None:
    rng = np.random.default_rng(0)
    if fmt == "jsonl":
        src = tmp_path / "rows.jsonl"
        rows = [
            {"seq": 0, "token": t, "layer": layer, "experts": ids.tolist()}
            for t, tok in enumerate(_ids(rng, 3))
            for layer, ids in enumerate(tok)
        ]
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        form, code = "jsonl", USAGE  # the suffix is refused first: a trace is .parquet
    else:
        src = tmp_path / ("ids.npy" if fmt == "npy" else "ids.parquet")
        with open(src, "wb") as fh:
            np.save(fh, _ids(rng, 3))
        form, code = "npy", USAGE if fmt == "npy" else OUTPUT
    before = src.read_bytes()
    res = _cli("trace", "import", form, src, "--model", MODEL, "-o", src)
    one_error(res, code, str(src))
    assert src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


def test_d2_requests_out_inside_run_out_is_refused(tmp_path: Path) -> None:
    trace = make_trace(tmp_path / "t.parquet", sequences=4, prefill=4, decode=6)
    out, beside = tmp_path / "ro", tmp_path / "req.csv"
    run = ["run", "--policy", "lru", "--trace", trace, "--batch", "2", "--no-progress"]
    first = _cli(*run, "--out", out, "--requests-out", beside)
    assert first.exit_code == 0, first.output
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for inside in ("timeline.parquet", "req.csv"):
        res = _cli(*run, "--out", out, "--requests-out", out / inside)
        one_error(res, OUTPUT, "--requests-out", "inside --out")
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the timeline is whole
    again = _cli(*run, "--out", out, "--requests-out", beside)  # the same command, again
    assert again.exit_code == 0, again.output
    assert len(pd.read_csv(beside)) == 4
    assert len(pd.read_parquet(out / "timeline.parquet")) > len(pd.read_csv(beside))


@pytest.mark.parametrize("subset", [["--rows", "daop-readme-a6000-mixtral"], ["--sequences", "1"]])
def test_d3_validate_markdown_never_writes_a_partial_table(
    tmp_path: Path, subset: list[str]
) -> None:
    doc = tmp_path / "validation.md"
    shutil.copyfile(REPO / "docs" / "validation.md", doc)  # the committed page, copied
    before = doc.read_bytes()
    res = _cli("validate", *subset, "--markdown", doc, "--no-progress")
    one_error(res, USAGE, "--markdown", subset[0])
    assert doc.read_bytes() == before


def test_d4_regress_update_never_rewrites_the_golden_store_from_a_custom_grid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    golden = tmp_path / "policy-metrics.json"  # stands for baselines/policy-metrics.json
    shutil.copyfile(REPO / "baselines" / "policy-metrics.json", golden)
    monkeypatch.setattr(daopsim.simulator.regress, "default_store", lambda: golden)
    before = golden.read_bytes()
    grid = tmp_path / "my.toml"
    grid.write_text(
        'trace = "ci-small"\npolicies = ["lru"]\ncache_ratios = [0.25]\n'
        'profiles = ["a6000-pcie4"]\nsequences = 1\n'
    )
    one_error(_cli("regress", "--grid", grid, "--update", "--no-progress"), USAGE, "golden store")
    one_error(
        _cli("regress", "--grid", grid, "--update", "--baseline", golden, "--no-progress"),
        USAGE,
        "golden store",
    )
    assert golden.read_bytes() == before
    own = tmp_path / "mine.json"  # the grid's own store is written, as asked
    res = _cli("regress", "--grid", grid, "--update", "--baseline", own, "--no-progress")
    assert res.exit_code == 0, res.output
    assert len(json.loads(own.read_text())["configurations"]) == 1
    # and the grid file is never its own store
    one_error(
        _cli("regress", "--grid", grid, "--update", "--baseline", grid, "--no-progress"),
        OUTPUT,
        "is also an input",
    )


# --- silently wrong ----------------------------------------------------------------------------


def test_s3_unified_memory_bounds_the_host_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DAOPSIM_CACHE", str(tmp_path / "cache"))  # the generated Kimi-K2 trace
    res = _cli(
        "run", "--policy", "lru", "--hw", "jetson-orin-64g", "--model", "kimi-k2", "--dtype",
        "q4_k_m", "--no-progress",
    )  # fmt: skip
    one_error(res, USAGE, "jetson-orin-64g", "kimi-k2", "unified memory")
    # what does run fits the one memory: GPU allocations plus the host's copies
    hw = load_profile("jetson-orin-64g")
    from daopsim.simulator.costs import cost_model

    for name, dtype in ((MODEL, "q4_k_m"), ("olmoe-1b-7b", "bf16")):
        costs = cost_model(hw, get_model(name).with_precision(dtype))
        fit = expert_fit(costs, 1, 128)
        gpu_side = (
            hw.gpu.workspace_gb * 1e9
            + costs.model.non_expert_bytes()
            + costs.model.kv_bytes_per_token * 128
            + (fit.max_experts + 1) * costs.expert_bytes
        )
        assert fit.max_experts > 0
        assert gpu_side + costs.unified_host_bytes() <= hw.gpu.usable_bytes


def test_s3_advise_ranks_no_impossible_row() -> None:
    base = ["advise", "--model", MODEL, "--hw", "jetson-orin-64g", "--trace", "ci-small"]
    res = _cli(*base, "--policies", "lru,fiddler", "--dtype", "bf16", "--workers", "1", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["rows"] == []  # 93 GB of bf16 weights never fit a 64 GB device
    res = _cli(*base, "--policies", "lru", "--dtype", "q4_k_m", "--workers", "1", "--json")
    rows = json.loads(res.stdout)["rows"]
    assert rows and all(r["dtype"] == "q4_k_m" for r in rows)


def test_s4_sweep_labels_follow_the_latest_request(tmp_path: Path) -> None:
    copy = _copy_trace(tmp_path / "cicopy.parquet")
    prof = tmp_path / "mya6000.toml"
    shutil.copyfile(REPO / "hardware_profiles" / "a6000-pcie4.toml", prof)
    out = tmp_path / "s.parquet"
    args = ["--policies", "lru", "--sequences", "1", "--cache-ratios", "0.25", "--no-progress"]
    first = _cli("sweep", *args, "--traces", copy, "--hw", prof, "--out", out)
    assert first.exit_code == 0, first.output
    second = _cli("sweep", *args, "--traces", "ci-small", "--hw", "a6000-pcie4", "--out", out)
    assert second.exit_code == 0 and "1 resumed" in second.output, second.output
    df = pd.read_parquet(out)
    assert list(df["trace"]) == ["ci-small"] and list(df["hw"]) == ["a6000-pcie4"]
    fig = _cli("plot", out, "--kind", "heatmap", "--hw", "a6000-pcie4", "-o", tmp_path / "h.png")
    assert fig.exit_code == 0, fig.output


@pytest.mark.parametrize(
    ("axis", "values"),
    [("--traces", "ci-small,{copy}"), ("--hw", "a6000-pcie4,{prof}")],
)
def test_s4_a_configuration_asked_for_twice_is_named(
    tmp_path: Path, axis: str, values: str
) -> None:
    copy = _copy_trace(tmp_path / "cicopy.parquet")
    prof = tmp_path / "mya6000.toml"
    shutil.copyfile(REPO / "hardware_profiles" / "a6000-pcie4.toml", prof)
    given = values.format(copy=copy, prof=prof)
    res = _cli(
        "sweep", "--policies", "lru", "--sequences", "1", "--cache-ratios", "0.25", axis, given,
        "--no-progress", "--out", tmp_path / "s.parquet",
    )  # fmt: skip
    one_error(res, USAGE, "same configuration twice", axis, given.split(",")[1])
    assert not (tmp_path / "s.parquet").exists()


def test_s4_sweep_rows_are_keyed_on_the_simulator_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edit to the cost model (simulator/costs.py) re-runs a resumed sweep's rows."""
    out = tmp_path / "s.parquet"
    args = ["sweep", "--policies", "lru", "--traces", "ci-small", "--sequences", "1"]
    args += ["--cache-ratios", "0.25", "--no-progress", "--out", str(out)]
    assert _cli(*args).exit_code == 0
    assert "1 resumed" in _cli(*args).output
    real = daopsim.simulator.sweep_expand.file_sha256

    def edited(path: str | os.PathLike[str]) -> str:
        return "edited" if Path(path).name == "costs.py" else real(path)

    monkeypatch.setattr(daopsim.simulator.sweep_expand, "file_sha256", edited)
    res = _cli(*args)
    assert res.exit_code == 0 and "0 resumed" in res.output, res.output


def test_s5_calibration_with_the_evaluated_trace_is_in_sample(tmp_path: Path) -> None:
    for cal in ("ci-small", str(_copy_trace(tmp_path / "copy.parquet"))):
        r = simulate(policy="daop", trace="ci-small", calibration=cal, sequences=1, record=False)
        assert "in-sample" in r.config["calibration"], r.config["calibration"]
        assert any("in-sample" in n for n in r.config["notes"])
    other = simulate(
        policy="daop", trace="ci-small", calibration="mixtral-8x7b", sequences=1, record=False
    )
    assert other.config["calibration"] == "mixtral-8x7b"  # another trace: held out


def test_s5_calibration_sharing_some_evaluated_sequences_is_partly_in_sample(
    tmp_path: Path,
) -> None:
    """A calibration file that holds some evaluated sequences under other ids (another file's
    bytes, so not the whole-file case) is labelled partly in-sample, naming how many."""
    import dataclasses

    from daopsim.simulator.trace_read import load_sequences
    from daopsim.simulator.trace_write import write_trace

    meta, rs = load_sequences(bundled_traces()["ci-small"])
    # sequences 0 and 1 of ci-small under new ids, beside two sequences of other routing
    other = [dataclasses.replace(r, experts=(r.experts + 1) % meta.model.experts) for r in rs[2:4]]
    cal_rs = [dataclasses.replace(r, seq_id=100 + i) for i, r in enumerate(rs[:2])] + [
        dataclasses.replace(r, seq_id=200 + i) for i, r in enumerate(other)
    ]
    cal = write_trace(tmp_path / "cal.parquet", meta, cal_rs)
    r = simulate(
        policy="daop", trace="ci-small", calibration=str(cal), evaluate=[0, 2], record=False
    )
    assert "partly in-sample: 1 evaluated sequence" in r.config["calibration"], r.config
    assert any("holds 1 of the evaluated sequences" in n for n in r.config["notes"])
    # evaluating sequences the file does not hold: held out, labelled as the path
    r2 = simulate(
        policy="daop", trace="ci-small", calibration=str(cal), evaluate=[2, 3], record=False
    )
    assert r2.config["calibration"] == str(cal), r2.config["calibration"]


@pytest.mark.parametrize(
    ("policy", "option"),
    [
        ("daop", "swap_threshold=nan"),
        ("daop", "t_cpu_ms=nan"),
        ("daop", "swap_threshold=inf"),
        ("ktransformers", "gpu_experts_ratio=nan"),
        ("ktransformers", "gpu_experts_ratio=-inf"),
    ],
)
def test_s6_nan_and_inf_options_are_refused(policy: str, option: str) -> None:
    res = _cli(
        "run", "--policy", policy, "--trace", "ci-small", "--sequences", "1", "--policy-opt",
        option, "--no-progress",
    )  # fmt: skip
    one_error(res, USAGE, option.split("=")[0], "finite")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_s6_nan_in_a_runtime_profile_is_refused(value: float) -> None:
    """The runtime profiles' own number check (hardware_profiles/runtimes/*.toml)."""
    from daopsim.simulator.errors import UserError
    from daopsim.simulator.runtime_profiles import parse_runtime

    with pytest.raises(UserError, match="'dispatch_us' must be a finite number"):
        parse_runtime({"name": "x", "dispatch_us": value}, "x.toml")


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (("", 'dtyp = "q4_k_m"\n'), ("'dtyp'", "did you mean 'dtype'")),
        (('trace = "ci-small"', 'trce = "x"\ntrace = "ci-small"'), ("models[0]", "'trce'")),
        (("[policies.lru]", "[policies.lru]\ninital = 'popular'"), ("'inital'",)),
        (("cache_ratios = [0.5]", "cache_ratios = []"), ("cache_ratios is empty",)),  # C9
    ],
)
def test_s7_experiment_files_are_checked_against_a_schema(
    tmp_path: Path, edit: tuple[str, str], words: tuple[str, ...]
) -> None:
    text = (
        'name = "t"\nhw = "a6000-pcie4"\ncache_ratios = [0.5]\ntarget = "lru"\n'
        '[policies.lru]\n[[models]]\ntrace = "ci-small"\n'
    )
    old, new = edit
    exp = tmp_path / "exp.toml"
    exp.write_text(new + text if not old else text.replace(old, new))
    res = _cli("experiment", exp, "--out", tmp_path / "out", "--sequences", "1")
    one_error(res, USAGE, str(exp), *words)
    assert not (tmp_path / "out").exists()


def test_busy_fractions_never_exceed_one() -> None:
    """vllm-cpu-offload prefetches weights for a next token that never comes: that tail is
    outside the run and no longer pushes h2d_busy_frac past 1; both engines agree."""
    kw = dict(
        policy="vllm-cpu-offload", hw="a100-80g-pcie4", trace="ci-small", sequences=2,
        gpu_experts=3 * ML, record=False,
    )  # fmt: skip
    fast, ref = simulate(**kw).metrics, simulate(engine="reference", **kw).metrics
    for key in ("gpu_busy_frac", "cpu_busy_frac", "h2d_busy_frac", "d2h_busy_frac"):
        assert 0 <= fast[key] <= 1, (key, fast[key])
        assert fast[key] == pytest.approx(ref[key], rel=1e-12, abs=1e-12)
    assert fast["h2d_busy_frac"] > 0.99  # the link is the bottleneck: nearly always busy


# --- bad input written as success -------------------------------------------------------------


def _torch_save(obj: object, path: Path) -> None:
    import torch

    torch.save(obj, path)


def _logits(tokens: int) -> list[object]:
    import torch

    return [torch.randn(tokens, E, generator=torch.Generator().manual_seed(1)) for _ in range(ML)]


def _npz(path: Path, **arrays: object) -> Path:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _torch_file(path: Path, obj: object) -> Path:
    _torch_save(obj, path)
    return path


def _npy(path: Path, arr: np.ndarray) -> Path:
    np.save(path, arr)
    return path


IDS = _ids(np.random.default_rng(3), 3)
RISING = np.stack([np.ones(IDS.shape[:-1]), np.full(IDS.shape[:-1], 2.0)], axis=-1)
GAPPY = "".join(  # layer 5 is missing from every token
    json.dumps({"seq": 0, "token": t, "layer": layer, "experts": IDS[t, layer].tolist()}) + "\n"
    for t in range(3)
    for layer in range(ML)
    if layer != 5
)
#: case -> (format, source builder in a folder, extra options, words of the error)
M1: dict[str, tuple[str, Callable[[Path], Path], tuple[str, ...], str]] = {
    "vllm empty lists": (
        "vllm",
        lambda d: _write(
            d / "empty.json", '{"choices": [{"routed_experts": []}], "prompt_routed_experts": []}'
        ),
        (),
        "no routed tokens",
    ),
    "npy 0 tokens": (
        "npy",
        lambda d: _npy(d / "z.npy", np.zeros((0, ML, K), np.int64)),
        (),
        "no tokens",
    ),
    "torch 0 tokens": (
        "torch",
        lambda d: _torch_file(d / "z.pt", {"router_logits": _logits(0), "top_k": K}),
        (),
        "no tokens",
    ),
    "skip drops every token": (
        "jsonl",
        lambda d: _write(d / "gappy.jsonl", GAPPY),
        ("--missing-layers", "skip"),
        "no tokens",
    ),
    "weights rise along rank": (
        "npy",
        lambda d: _npz(d / "rising.npz", experts=IDS, weights=RISING),
        (),
        "exceeds rank 0",
    ),
    "weights of 1e39": (
        "npy",
        lambda d: _npz(d / "huge.npz", experts=IDS, weights=np.full(IDS.shape, 1e39)),
        (),
        "finite",
    ),
    "negative sequence ids": (
        "npy",
        lambda d: _npz(d / "neg.npz", experts=IDS, seq=np.array([-1, -1, -1])),
        (),
        "sequence id -1",
    ),
    # the tracebacks C2-C6
    "C2 expert id 2**70": (
        "vllm",
        lambda d: _write(
            d / "big.json", json.dumps({"choices": [{"routed_experts": [[[2**70, 1]] * ML]}]})
        ),
        (),
        "outside 0..7",
    ),
    "C3 shape [3, 32, 0]": (
        "npy",
        lambda d: _npy(d / "nok.npy", np.zeros((3, ML, 0), np.int64)),
        (),
        "k >= 1",
    ),
    "C4 sequence id 2**40": (
        "npy",
        lambda d: _npz(d / "bigseq.npz", experts=IDS, seq=np.array([2**40] * 3)),
        (),
        "outside 0..2147483647",
    ),
    "C5 string weights": (
        "npy",
        lambda d: _npz(d / "strw.npz", experts=IDS, weights=np.full(IDS.shape, "a")),
        (),
        "not a list of numbers",
    ),
    "C6 n_prefill=-3": (
        "torch",
        lambda d: _torch_file(
            d / "negpre.pt", {"router_logits": _logits(4), "top_k": K, "n_prefill": -3}
        ),
        (),
        "n_prefill",
    ),
}


@pytest.mark.parametrize("case", list(M1))
def test_m1_import_refuses_what_validate_would_reject(tmp_path: Path, case: str) -> None:
    fmt, build, extra, words = M1[case]
    src = build(tmp_path)
    out = tmp_path / "out" / "t.parquet"
    out.parent.mkdir()
    res = _cli("trace", "import", fmt, src, "--model", MODEL, *extra, "-o", out)
    one_error(res, USAGE, str(src), words)
    assert list(out.parent.iterdir()) == []  # nothing written, no temporary left


def test_m1_what_import_writes_validate_accepts(tmp_path: Path) -> None:
    src = tmp_path / "ok.npz"
    ids = _ids(np.random.default_rng(5), 4)
    w = np.sort(np.random.default_rng(6).random(ids.shape), axis=-1)[..., ::-1]
    np.savez(src, experts=ids, weights=w, seq=np.array([3, 3, 7, 7]))
    out = tmp_path / "t.parquet"
    res = _cli("trace", "import", "npy", src, "--model", MODEL, "--prefill", "1", "-o", out)
    assert res.exit_code == 0, res.output
    assert validate_trace(out).counts["sequences"] == 2
    assert _cli("trace", "validate", out).exit_code == 0


def _feed_fifo(fifo: Path, seconds: float = 10.0) -> threading.Thread:
    """Open ``fifo`` for writing once a reader appears, then close it (so a command that
    wrongly reads it sees EOF instead of blocking the test); gives up after ``seconds``."""

    def feed() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                    return
                time.sleep(0.05)
                continue
            os.close(fd)
            return

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_m2_synth_fit_refuses_special_targets(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "stats.json"
    if kind == "fifo":
        os.mkfifo(target)
        _feed_fifo(target)
        word = "FIFO"
    else:
        try:  # a /dev/null-like node inside the test's folder (reading it never errs)
            os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except OSError as exc:
            pytest.skip(f"cannot make a device node here ({exc.strerror})")
        word = "character device"
    res = _cli("synth", "fit", "--target", target, "-o", tmp_path / "fit.json")
    one_error(res, USAGE, str(target), word)
    assert not (tmp_path / "fit.json").exists()


# --- tracebacks --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--policy", "lru", "--trace", "ci-small", "--sequences", "2", "--seed", "-1"],
        ["synth", "--model", "olmoe-1b-7b", "--sequences", "1", "--seed", "-1", "-o", "{o}"],
        ["sweep", "--policies", "lru", "--traces", "ci-small", "--seeds", "-1", "--out", "{o}"],
    ],
    ids=["run", "synth", "sweep"],
)
def test_c1_negative_seeds_are_usage_errors(tmp_path: Path, args: list[str]) -> None:
    argv = [a.format(o=tmp_path / "o.parquet") for a in args] + ["--no-progress"] * (
        args[0] != "synth"
    )
    one_error(_cli(*argv), USAGE, "non-negative integer")
    assert not (tmp_path / "o.parquet").exists()
    if args[0] == "run":  # under --json: one JSON object on stdout, not an empty one
        res = _cli(*argv, "--json")
        assert res.exit_code == USAGE and json.loads(res.stdout)["exit_code"] == USAGE


def test_c7_synth_fit_refuses_stats_of_another_model(tmp_path: Path) -> None:
    stats = tmp_path / "mixtral-stats.json"
    res = _cli("trace", "stats", "ci-small", "--json", "--no-curves")
    stats.write_text(res.stdout)
    res = _cli(
        "synth", "fit", "--target", stats, "--model", "olmoe-1b-7b", "--iterations", "1",
        "--sequences", "1", "--prompt-tokens", "4", "--output-tokens", "4",
        "-o", tmp_path / "fit.json",
    )  # fmt: skip
    one_error(res, USAGE, "mixtral-8x7b", "olmoe-1b-7b")


def test_c8_symbolic_link_loops_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    os.symlink("loopB", "loopA")
    os.symlink("loopA", "loopB")
    res = _cli("run", "--policy", "lru", "--trace", "ci-small", "--sequences", "1", "--out",
               "loopA/x", "--no-progress")  # fmt: skip
    one_error(res, OUTPUT, "loopA/x", "symbolic link loop")
    one_error(_cli("plot", "loopA"), USAGE, "loopA", "symbolic link loop")
    one_error(_cli("run", "--trace", "loopA", "--no-progress"), USAGE, "symbolic link loop")


def test_c10_capture_on_cuda_without_cuda_is_one_line(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    res = _cli("capture", "--random-init", "mixtral", "--prompts", prompts, "--device", "cuda",
               "-o", tmp_path / "c.parquet")  # fmt: skip
    one_error(res, USAGE, "--device cuda")
    assert not (tmp_path / "c.parquet").exists()


# --- unclear or inconsistent ------------------------------------------------------------------


def test_import_to_an_unwritable_path_is_exit_3(tmp_path: Path) -> None:
    src = tmp_path / "ids.npy"
    np.save(src, _ids(np.random.default_rng(1), 2))
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    res = _cli("trace", "import", "npy", src, "--model", MODEL, "-o", blocker / "x.parquet")
    line = one_error(res, OUTPUT, "not a directory")
    assert "File exists" not in line


@pytest.mark.parametrize("command", ["synth", "import"])
def test_traces_are_parquet_only(tmp_path: Path, command: str) -> None:
    out = tmp_path / "x.csv"
    if command == "synth":
        args: list[str | Path] = ["synth", "--model", "olmoe-1b-7b", "--sequences", "1"]
    else:
        src = tmp_path / "ids.npy"
        np.save(src, _ids(np.random.default_rng(1), 2))
        args = ["trace", "import", "npy", src, "--model", MODEL]
    one_error(_cli(*args, "-o", out), USAGE, "use one of .parquet")
    assert not out.exists()


@pytest.mark.parametrize(
    "option", [["--sequences", "0"], ["--output-tokens", "0"], ["--iterations", "-1"]]
)
def test_synth_fit_never_turns_a_bad_count_into_a_default(
    tmp_path: Path, option: list[str]
) -> None:
    stats = tmp_path / "stats.json"
    stats.write_text(_cli("trace", "stats", "ci-small", "--json", "--no-curves").stdout)
    res = _cli("synth", "fit", "--target", stats, *option, "-o", tmp_path / "f.json")
    one_error(res, USAGE, option[0])
    assert not (tmp_path / "f.json").exists()


def test_sweep_max_batch_zero_is_refused_like_run(tmp_path: Path) -> None:
    res = _cli(
        "sweep", "--policies", "lru", "--traces", "ci-small", "--arrival-rates", "1",
        "--max-batch", "0", "--no-progress", "--out", tmp_path / "s.parquet",
    )  # fmt: skip
    one_error(res, USAGE, "--max-batch")


def test_validate_empty_rows_is_refused() -> None:
    one_error(_cli("validate", "--rows", "", "--no-progress"), USAGE, "--rows")


@pytest.mark.parametrize("base", ["lru", "global-lru"])
def test_a_plugin_naming_a_non_resident_victim_is_named(base: str) -> None:
    from daopsim.policies.global_lru import GlobalLRUPolicy
    from daopsim.policies.lru import LRUPolicy
    from daopsim.simulator.errors import PolicyError

    parent: type = LRUPolicy if base == "lru" else GlobalLRUPolicy
    bad_victim: Callable[..., object] = (
        (lambda self, layer, protected, step: 99)
        if base == "lru"
        else (lambda self, layer, protected, step: (0, 99))
    )
    plugin = type("BadVictim", (parent,), {"name": "bad-victim", "choose_victim": bad_victim})
    with pytest.raises(PolicyError) as err:
        simulate(policy=plugin(), trace="ci-small", sequences=1, cache_ratio=0.25, record=False)
    text = str(err.value)
    assert "'bad-victim'" in text and "choose_victim returned" in text and "99" in text
    assert "list.remove" not in text


# --- round 3: interrupts -----------------------------------------------------------------------

#: each command and a function it calls for its long work (raising Ctrl-C there)
INTERRUPTIBLE = {
    "run": (["run", "--trace", "ci-small", "--no-progress"], "daopsim.simulator.runner.simulate"),
    "learn": (["learn", "-o", "m.json", "--no-progress"], "daopsim.simulator.imitation.learn"),
    "experiment": (
        ["experiment", "daop-paper", "-o", "exp"],
        "daopsim.simulator.experiments.run_experiment",
    ),
    "validate": (["validate", "--no-progress"], "daopsim.simulator.validation.run_validation"),
    "sweep": (
        ["sweep", "--policies", "lru", "--traces", "ci-small", "--no-progress", "-o", "s.csv"],
        "daopsim.simulator.sweep.run_sweep",
    ),
}


@pytest.mark.parametrize("command", list(INTERRUPTIBLE))
def test_ctrl_c_exits_130_everywhere(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C once gave click's "Aborted!" and exit 1 in run, learn, experiment and validate
    (docs/cli.md says 130; sweep was right): now every command ends with 130, one line."""
    argv, target = INTERRUPTIBLE[command]
    module, _, name = target.rpartition(".")

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(f"{module}.{name}", interrupted)
    monkeypatch.chdir(tmp_path)
    res = _cli(*argv)
    assert res.exit_code == int(ExitCode.INTERRUPTED), (res.output, res.exception)
    assert "Traceback" not in res.output + res.stderr and "Aborted" not in res.output
    assert res.stderr.splitlines()[-1].startswith(("error: interrupted", "interrupted"))
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] in (
        [],
        ["s.csv.parts"],
    )


def test_sigint_during_a_run_exits_130(tmp_path: Path) -> None:
    """The same through a real SIGINT to a running ``daopsim run``. The run's policy sleeps in
    every layer hook, so the signal lands inside the run however fast the machine is."""
    import signal
    import subprocess
    import sys

    slow = tmp_path / "slow.py"
    slow.write_text(
        "import time\n"
        "from daopsim.policies.lru import LRUPolicy\n\n\n"
        "class Slow(LRUPolicy):\n"
        "    name = 'slow-lru'\n\n"
        "    def decode_layer(self, view):\n"
        "        time.sleep(0.01)\n"
        "        return super().decode_layer(view)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "daopsim", "run", "--trace", "ci-small", "--no-progress",
         "--policy", f"{slow}:Slow", "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # a user's shell delivers Ctrl-C; a test worker (xdist) may ignore SIGINT, and an
        # ignored signal stays ignored in its children: restore the default for this one
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        time.sleep(6)  # imports, the trace, then well inside the run (minutes of sleeps)
        assert proc.poll() is None, proc.communicate()[1]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "error: interrupted", err
    assert not (tmp_path / "out").exists()


# --- round 3: inputs that gave an empty result, a traceback or a silent default ----------------


def test_plot_of_no_successful_rows_is_an_error_not_an_empty_figure(tmp_path: Path) -> None:
    """A table whose rows were all skipped once drew a figure of empty panels and exited 0: now
    every plot kind says there is nothing to draw, with the rows' statuses, and writes nothing."""
    table = tmp_path / "s.csv"
    res = _cli("sweep", "--policies", "lru", "--traces", "ci-small", "--cache-ratios", "0.5",
               "--no-progress", "-o", table)  # fmt: skip
    assert res.exit_code == 0, res.output
    df = pd.read_csv(table)
    assert list(df["status"]) == ["skipped"]  # Mixtral at this budget does not fit the default
    for kind in ("throughput", "hit-rate", "breakdown", "heatmap", "pareto"):
        fig = tmp_path / f"{kind}.png"
        res = _cli("plot", table, "--kind", kind, "-o", fig)
        one_error(res, USAGE, "no successful runs", "'ci-small'", "1 skipped", "nothing to draw")
        assert not fig.exists()


def test_plot_of_a_table_with_a_text_number_names_row_and_column(tmp_path: Path) -> None:
    """String cache ratios once reached matplotlib and printed its traceback: reading a results
    table now checks that every number column holds numbers (empty cells stay NaN)."""
    table = tmp_path / "s.csv"
    res = _cli("sweep", "--policies", "lru", "--traces", "ci-small", "--cache-ratios", "0.25",
               "--no-progress", "-o", table)  # fmt: skip
    assert res.exit_code == 0, res.output
    df = pd.read_csv(table)
    assert (df["status"] == "ok").all()
    good = daopsim.simulator.sweep_table.read_table(table)
    assert good["cache_ratio"].tolist() == [0.25]
    df["cache_ratio"] = df["cache_ratio"].astype(object)
    df.loc[0, "cache_ratio"] = "all"
    df.to_csv(table, index=False)
    fig = tmp_path / "t.png"
    one_error(_cli("plot", table, "-o", fig), USAGE, "s.csv", "row 1", "'cache_ratio'", "'all'")
    assert not fig.exists()


@pytest.mark.parametrize(
    "argv", [["trace", "stats"], ["trace", "validate"], ["run", "--no-progress", "--trace"]]
)
def test_a_trace_without_rows_is_refused(argv: list[str], tmp_path: Path) -> None:
    """``trace stats`` of a 0-row trace printed a table of dashes and ``trace validate`` said OK
    (exit 0): every reader now refuses a trace without rows, naming the file."""
    path = make_trace(tmp_path / "zero.parquet", model=MODEL, sequences=0)
    res = _cli(*argv, path, *(["--out", tmp_path / "o"] if argv[0] == "run" else []))
    one_error(res, USAGE, "zero.parquet", "0 rows")
    assert not (tmp_path / "o").exists()


def test_synth_refuses_a_sequence_too_large_to_generate(tmp_path: Path) -> None:
    """``synth --prompt-tokens 3000000000`` asked NumPy for terabytes and printed its
    traceback: the size is checked first, and the limit it gives is the one it enforces."""
    from daopsim.simulator.synth import check_sequence_size
    from daopsim.simulator.synth_params import SynthParams, get_preset

    out = tmp_path / "big.parquet"
    res = _cli("synth", "--model", MODEL, "--sequences", "1", "--prompt-tokens", "3000000000",
               "-o", out)  # fmt: skip
    line = one_error(res, USAGE, "--prompt-tokens 3000000000", "at most")
    assert not out.exists()
    most = int(line.split("at most ")[1].split()[0].replace(",", ""))
    preset = get_preset(MODEL)
    params: SynthParams = getattr(preset, "params", preset)
    check_sequence_size(get_model(MODEL), params, most - 8, 8)  # the limit itself passes
    with pytest.raises(UserError, match="at most"):
        check_sequence_size(get_model(MODEL), params, most - 7, 8)


def test_negative_seeds_are_refused_in_learn_and_capture(tmp_path: Path) -> None:
    """``learn --seed -1`` printed NumPy's traceback and ``capture --seed -1`` was accepted
    (torch takes it as another seed): both now say what a seed must be, and write nothing."""
    one_error(_cli("learn", "-o", tmp_path / "m.json", "--no-progress", "--seed", "-1"), USAGE,
              "--seed", "non-negative", "-1")  # fmt: skip
    assert not (tmp_path / "m.json").exists()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    res = _cli("capture", "--random-init", "mixtral", "--prompts", prompts, "--seed", "-1",
               "-o", tmp_path / "c.parquet")  # fmt: skip
    one_error(res, USAGE, "--seed", "non-negative", "-1")
    assert not (tmp_path / "c.parquet").exists()


def test_daop_t_load_below_zero_is_refused_and_minus_one_is_auto() -> None:
    """``t_load_ms=-5`` silently meant "from the constants" like -1: now only -1 (and values
    >= 0) are taken, and a set value changes the run while -1 equals the default."""
    run = {"trace": "ci-small", "hw": "a6000-pcie4", "sequences": 1}
    res = _cli("run", "--policy", "daop", "--trace", "ci-small", "--no-progress",
               "--policy-opt", "t_load_ms=-5")  # fmt: skip
    one_error(res, USAGE, "'daop'", "'t_load_ms'", ">= 0", "-1.0", "-5")
    default = simulate(policy="daop", **run).metrics
    auto = simulate(policy="daop", policy_options={"t_load_ms": -1}, **run).metrics
    fast = simulate(policy="daop", policy_options={"t_load_ms": 0.0}, **run).metrics
    assert repr(sorted(auto.items())) == repr(sorted(default.items()))  # NaN equals NaN here
    assert fast["ttft_s"] != default["ttft_s"]  # loading looks free: the prefill rule copies


@pytest.mark.parametrize("action", [1.5, True, np.float64(1.0), np.bool_(True), "1"])
def test_gym_step_takes_only_integer_expert_ids(action: object) -> None:
    """``step(1.5)`` and ``step(True)`` once played expert 1: a non-integer action is now
    Gymnasium's InvalidAction; NumPy integers (what ``action_space.sample()`` gives) still work."""
    gym = pytest.importorskip("gymnasium")
    from daopsim.gym import ExpertCacheEnv

    env = ExpertCacheEnv(trace="ci-small", hw="a100-80g-pcie4", gpu_experts=4 * 32)
    obs, _ = env.reset(seed=0)
    with pytest.raises(gym.error.InvalidAction, match="integer"):
        env.step(action)
    victim = int(np.flatnonzero(obs["action_mask"])[0])
    twin = ExpertCacheEnv(trace="ci-small", hw="a100-80g-pcie4", gpu_experts=4 * 32)
    twin.reset(seed=0)
    _, r1, _, _, info1 = env.step(np.int64(victim))
    _, r2, _, _, info2 = twin.step(victim)
    assert not info1["invalid_action"] and r1 == r2 and info1["now"] == info2["now"]
    env.close()
    twin.close()


# --- round 3: cases the audit found open --------------------------------------------------------


@pytest.mark.parametrize("fmt", ["npy", "npz"])
def test_import_prefill_longer_than_a_sequence_is_refused(tmp_path: Path, fmt: str) -> None:
    """``trace import npy six.npy --prefill 100`` wrote 6 prefill + 0 decode tokens and exited 0:
    a prompt longer than the sequence is refused, naming the option and the sequence's length;
    a prompt of exactly every token is still a valid import."""
    ids = _ids(np.random.default_rng(3), 6)
    src = tmp_path / f"six.{fmt}"
    with open(src, "wb") as fh:
        np.save(fh, ids) if fmt == "npy" else np.savez(fh, experts=ids)
    out = tmp_path / "six.parquet"
    res = _cli("trace", "import", "npy", src, "--model", MODEL, "--prefill", "100", "-o", out)
    one_error(res, USAGE, str(src), "--prefill 100", "6 tokens")
    assert not out.exists()
    res = _cli("trace", "import", "npy", src, "--model", MODEL, "--prefill", "6", "-o", out)
    assert res.exit_code == 0, res.output
    assert read_meta(out).counts["prefill_tokens"] == 6


@pytest.mark.parametrize(
    ("fmt", "option", "value"),
    [("npy", "--field", "seq=req"), ("npy", "--top-k", "2"), ("vllm", "--prefill", "3"),
     ("jsonl", "--top-k", "2"), ("torch", "--field", "seq=req")],
)  # fmt: skip
def test_import_refuses_options_its_format_does_not_read(
    tmp_path: Path, fmt: str, option: str, value: str
) -> None:
    """``trace import npy`` silently ignored ``--field`` and ``--top-k`` (and vllm/jsonl
    ``--prefill``): an option the format does not read is one line naming it and the format."""
    src = tmp_path / "src.bin"
    src.write_bytes(b"not read: the option is refused first")
    out = tmp_path / "o.parquet"
    res = _cli("trace", "import", fmt, src, "--model", MODEL, option, value, "-o", out)
    one_error(res, USAGE, option, fmt)
    assert not out.exists()


@pytest.mark.parametrize(
    "models",
    ['[[models]]\ntrace = "ci-small"\n[[models]]\ntrace = "ci-small"\n',
     '[[models]]\nsynth = { preset = "mixtral-8x7b", seed = 0 }\n'
     '[[models]]\nsynth = { preset = "mixtral-8x7b", seed = 1 }\n'],
)  # fmt: skip
def test_experiment_refuses_a_model_given_twice(tmp_path: Path, models: str) -> None:
    """The same trace twice under ``[[models]]`` gave each of its rows twice (and two synthetic
    traces of one preset share the label ``synth:NAME``, so their rows could not be told apart):
    refused before any run, naming the file and both entries."""
    exp = tmp_path / "exp.toml"
    exp.write_text(
        'name = "t"\nhw = "a6000-pcie4"\ncache_ratios = [0.5]\ntarget = "lru"\n[policies.lru]\n'
        + models
    )
    res = _cli("experiment", exp, "--out", tmp_path / "out", "--sequences", "1")
    one_error(res, USAGE, str(exp), "models[1]", "models[0]")
    assert not (tmp_path / "out").exists()


def test_experiment_checks_its_output_folder_can_be_made_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``experiment -o /sys/exp2`` as root ran every configuration and only then failed: root
    passes the permission check (``os.access``) on a file system that refuses every new entry.
    Simulated here: ``os.access`` says yes, creating anything in ``fs`` raises EPERM. The
    output is now tried before the first run: one line naming --out, no run, nothing left."""
    fs = tmp_path / "fs"
    fs.mkdir()
    real_mkdir, real_open = os.mkdir, os.open

    def refuse(real: Callable[..., object]) -> Callable[..., object]:
        def call(p: object, *args: object, **kw: object) -> object:
            if Path(os.fsdecode(p)).parent == fs:  # type: ignore[arg-type]
                raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), os.fsdecode(p))  # type: ignore[arg-type]
            return real(p, *args, **kw)

        return call

    monkeypatch.setattr(os, "mkdir", refuse(real_mkdir))
    monkeypatch.setattr(os, "open", refuse(real_open))
    exp = tmp_path / "exp.toml"
    exp.write_text(
        'name = "t"\nhw = "a6000-pcie4"\ncache_ratios = [0.5]\ntarget = "lru"\n[policies.lru]\n'
        '[[models]]\ntrace = "ci-small"\n'
    )
    res = _cli("experiment", exp, "-o", fs / "exp2", "--sequences", "1")
    one_error(res, OUTPUT, f"--out {fs / 'exp2'}", "cannot write", "not permitted")
    assert "running" not in res.stderr  # refused before the first configuration
    assert list(fs.iterdir()) == []


def test_run_config_options_of_another_policy_stay_with_it(tmp_path: Path) -> None:
    """``run --config point.toml --policy lru``, the file naming daop with ``[options.daop]
    swap_num = 2``, failed with "policy 'lru' has no option 'swap_num'": the file's options
    scoped to daop were applied to the policy chosen on the command line. They now stay with
    daop (as ``sweep --policies`` drops the options of the policies it leaves out), so the run
    equals the same run without the file's options; a file naming a policy and options scoped
    to another is still refused, naming the file."""
    cfg = tmp_path / "point.toml"
    head = 'hw = "a6000-pcie4"\ntraces = ["ci-small"]\ncache_ratios = [0.25]\nsequences = 1\n'
    cfg.write_text('policies = ["daop"]\n' + head + "[options.daop]\nswap_num = 2\n")
    res = _cli("run", "--config", cfg, "--policy", "lru", "--no-bounds", "--no-progress", "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)["metrics"]
    want = simulate(policy="lru", hw="a6000-pcie4", trace="ci-small", sequences=1,
                    cache_ratio=0.25, record=False).metrics  # fmt: skip
    assert got["tokens_per_s"] == pytest.approx(want["tokens_per_s"], rel=1e-12)
    res = _cli("run", "--config", cfg, "--no-bounds", "--no-progress", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["policy"] == "daop", res.output
    cfg.write_text('policies = ["lru"]\n' + head + "[options.daop]\nswap_num = 2\n")
    one_error(_cli("run", "--config", cfg, "--no-progress"), USAGE, str(cfg), "'daop.swap_num'")


def test_sweep_multi_gpu_without_gpus_is_refused_as_run_refuses_it(tmp_path: Path) -> None:
    """``sweep --hw 2x-rtx3090-nvlink --multi-gpu expert`` without ``--gpus`` ran one GPU and
    dropped the mode in silence, where ``run`` refuses: both now give the same line, and write
    nothing; a gpus axis that reaches 2 takes the mode for its multi-GPU points."""
    out = tmp_path / "s.parquet"
    common = ("--hw", "2x-rtx3090-nvlink", "--multi-gpu", "expert", "--no-progress")
    sweep = _cli("sweep", "--policies", "lru", "--traces", "ci-small", "--cache-ratios", "0.25",
                 "--sequences", "1", "-o", out, *common)  # fmt: skip
    run = _cli("run", "--policy", "lru", "--trace", "ci-small", "--sequences", "1", *common)
    assert one_error(sweep, USAGE, "--multi-gpu", "--gpus") == one_error(run, USAGE)
    assert not out.exists()


@pytest.mark.parametrize("base", ["lru", "global-lru"])
@pytest.mark.parametrize("victim", [1.0, True, "1", None])
def test_a_victim_of_the_wrong_type_names_choose_victim(base: str, victim: object) -> None:
    """``choose_victim`` returning ``1.0`` or ``True`` passed the per-layer cache's check
    (``1.0 == 1``) and surfaced later as a malformed plan; every such return now names
    ``choose_victim`` and what it returned."""
    from daopsim.policies.global_lru import GlobalLRUPolicy
    from daopsim.policies.lru import LRUPolicy
    from daopsim.simulator.errors import PolicyError

    parent: type = LRUPolicy if base == "lru" else GlobalLRUPolicy
    plugin = type(
        "OddVictim", (parent,), {"name": "odd-victim", "choose_victim": lambda *a: victim}
    )
    with pytest.raises(PolicyError) as err:
        simulate(policy=plugin(), trace="ci-small", sequences=1, cache_ratio=0.25, record=False)
    text = str(err.value)
    assert "'odd-victim'" in text and f"choose_victim returned {victim!r}" in text, text
    assert "malformed" not in text, text


def test_a_numpy_integer_victim_runs_as_the_int() -> None:
    """NumPy integers are expert ids (what ``np.argmin`` gives): such a victim runs exactly as
    the same id returned as an int."""
    from daopsim.policies.lru import LRUPolicy

    plain = type("Plain", (LRUPolicy,), {"name": "plain"})
    wide = type(
        "Wide",
        (LRUPolicy,),
        {"name": "wide", "choose_victim": lambda s, *a: np.int64(LRUPolicy.choose_victim(s, *a))},
    )
    run = dict(trace="ci-small", sequences=1, cache_ratio=0.25, record=False)
    got, want = simulate(policy=wide(), **run).metrics, simulate(policy=plain(), **run).metrics
    assert repr(sorted(got.items())) == repr(sorted(want.items()))  # NaN equals NaN here


@pytest.mark.parametrize("command", ["stats", "info", "validate"])
def test_trace_commands_suggest_the_bundled_name(command: str) -> None:
    """``trace stats ci_small`` said only "no such file" where ``run --trace ci_small`` asks
    "did you mean 'ci-small'": the trace commands resolve names through the same resolver."""
    line = one_error(_cli("trace", command, "ci_small"), USAGE, "'ci_small'", "'ci-small'")
    run = one_error(_cli("run", "--policy", "lru", "--trace", "ci_small", "--no-progress"), USAGE)
    assert line == run


_ROW = """[[row]]
id = "mine"
source = "s"
system = "s"
hardware = "h"
model = "m"
precision = "bf16"
workload = "w"
unit = "tokens/s"
role = "test"
setting = "published"
metric = "tokens_per_s"
published = 5.0
[row.sim]
policy = "lru"
hw = "a6000-pcie4"
trace = "ci-small"
sequences = 1
"""


@pytest.mark.parametrize(
    ("old", "new", "words"),
    [('policy = "lru"', 'policy = "lur"', ("'lur'", "did you mean 'lru'")),
     ('metric = "tokens_per_s"', 'metric = "tokens_per_sec"', ("'tokens_per_sec'",)),
     ('metric = "tokens_per_s"', 'metric = "per_layer_hits[3]"', ("'per_layer_hits'",)),
     ("published = 5.0", "published = -1", ("'published'", "-1")),
     ("published = 5.0", "published = 0", ("'published'", "0"))],
)  # fmt: skip
def test_validate_table_mistakes_are_user_errors(
    tmp_path: Path, old: str, new: str, words: tuple[str, ...]
) -> None:
    """``validate --table`` with an unknown policy or metric, or ``published = -1``, exited 0
    and listed the row as "not yet runnable": each is now a mistake in the file, one line naming
    the file and the row id, exit 2, before any run (the bundled table is unaffected)."""
    table = tmp_path / "one.toml"
    table.write_text(_ROW.replace(old, new))
    res = _cli("validate", "--table", table, "--no-progress")
    one_error(res, USAGE, str(table), "'mine'", *words)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--policies", "lru,lru"], "--policies: 'lru' given twice"),
        (["--policies", "lru", "--cache-ratios", "0.3,0.30"], "--cache-ratios: '0.30' given twice"),
        (["--policies", "lru", "--hw", "a6000-pcie4,a6000-pcie4"], "--hw: 'a6000-pcie4' given"),
        (["--policies", "lru", "--policy-opt", "initial=first", "--policy-opt", "initial=empty"],
         "--policy-opt: 'initial' given twice"),
    ],
)  # fmt: skip
def test_a_sweep_value_given_twice_is_refused_as_compare_and_advise_refuse_it(
    tmp_path: Path, args: list[str], named: str
) -> None:
    """A repeated list value or option key is one line naming it, never merged or run twice."""
    out = tmp_path / "s.parquet"
    res = _cli("sweep", *args, "--traces", "ci-small", "--sequences", "1", "--no-progress",
               "--out", out)  # fmt: skip
    one_error(res, USAGE, named)
    assert not out.exists()


def test_run_refuses_an_option_given_twice(tmp_path: Path) -> None:
    out = tmp_path / "o"
    twice = ["--policy-opt", "swap_num=1", "--policy-opt", "swap_num=2"]
    res = _cli("run", "--trace", "ci-small", "--sequences", "1", "--policy", "daop", *twice,
               "--out", out)  # fmt: skip
    one_error(res, USAGE, "--policy-opt: 'swap_num' given twice")
    assert not out.exists()
