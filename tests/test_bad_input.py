"""Bad input corpus: every case through the CLI gives exit 2, one ``error:`` line, no traceback.

Each case names the words the message must contain (what is wrong and where) and the output
paths (--out/-o) that must not exist afterwards. Cases build their inputs in a shared
workspace (``ws``): a valid tiny trace (4 MoE layers, 8 experts, top-2), damaged copies of it,
prompt files and grid files. Output paths that cannot be used or written (exit 3) are in
tests/test_attacks.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from daopsim.simulator.cli import main
from daopsim.simulator.testing import make_trace
from daopsim.simulator.trace_format import META_KEY

FIXTURES = Path(__file__).parent / "fixtures"
BAD_PROFILES = sorted((FIXTURES / "profiles").glob("bad-*.toml"))


@dataclass
class WS:
    """The shared workspace: a good trace and helpers to make bad inputs next to it."""

    root: Path
    good: Path
    made: dict[str, Path] = field(default_factory=dict)

    def file(self, name: str, text: str | bytes) -> Path:
        p = self.root / name
        if isinstance(text, bytes):
            p.write_bytes(text)
        else:
            p.write_text(text)
        return p

    def meta_edit(self, name: str, edit: Callable[[dict], None]) -> Path:
        """A copy of the good trace with edited metadata (rows unchanged)."""
        table = pq.read_table(self.good)
        footer = json.loads(pq.read_metadata(self.good).metadata[META_KEY])
        edit(footer)
        out = self.root / name
        table = table.replace_schema_metadata({META_KEY: json.dumps(footer).encode()})
        pq.write_table(table, out)
        return out

    def out(self, name: str) -> Path:
        """An output path that must not exist after the failing command."""
        return self.root / "outputs" / name


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> WS:
    root = tmp_path_factory.mktemp("bad_input")
    good = make_trace(root / "good.parquet", sequences=3, prefill=3, decode=3, seed=3)
    (root / "outputs").mkdir()
    (root / "a-directory").mkdir()
    return WS(root=root, good=good)


def _fewer_layers(meta: dict) -> None:
    meta["model"]["moe_layers"] = 3
    meta["model"]["layers"] = 3
    meta["moe_layer_ids"] = [0, 1, 2]


def _fewer_experts(meta: dict) -> None:
    meta["model"]["experts"] = 4
    meta["probs_stored"] = 4


@dataclass
class Case:
    """One bad input: CLI args from the workspace, words the error must contain, outputs."""

    args: Callable[[WS], list[object]]
    words: tuple[str, ...]
    outputs: Callable[[WS], list[Path]] = lambda ws: []


def run_args(*extra: object, out: str | None = None) -> Callable[[WS], list[object]]:
    """``daopsim run`` on the good trace plus ``extra``; ``--out`` under outputs/ if named."""

    def build(ws: WS) -> list[object]:
        args: list[object] = ["run", "--no-progress", "--policy", "lru", "--trace", ws.good]
        args += [a(ws) if callable(a) else a for a in extra]
        if out is not None:
            args += ["--out", ws.out(out)]
        return args

    return build


def outs(*names: str) -> Callable[[WS], list[Path]]:
    return lambda ws: [ws.out(n) for n in names]


def trace_case(make: Callable[[WS], Path], *words: str, name: str) -> Case:
    return Case(
        lambda ws: (
            ["run", "--no-progress", "--policy", "lru", "--trace", make(ws), "--out", ws.out(name)]
        ),
        words,
        outs(name),
    )


def synth_args(*extra: object, out: str = "synth.parquet") -> Callable[[WS], list[object]]:
    def build(ws: WS) -> list[object]:
        base: list[object] = ["synth", "--model", "olmoe-1b-7b", "--sequences", "1"]
        base += ["--prompt-tokens", "2", "--output-tokens", "2"]
        return base + [a(ws) if callable(a) else a for a in extra] + ["-o", ws.out(out)]

    return build


def capture_args(prompts: Callable[[WS], Path], *extra: str) -> Callable[[WS], list[object]]:
    return lambda ws: [
        "capture",
        "--prompts",
        prompts(ws),
        *extra,
        "--max-new-tokens",
        "2",
        "--no-progress",
        "-o",
        ws.out("capture.parquet"),
    ]


def sweep_args(grid: Callable[[WS], Path]) -> Callable[[WS], list[object]]:
    return lambda ws: ["sweep", grid(ws), "--no-progress", "-o", ws.out("sweep.parquet")]


def regress_args(*extra: object) -> Callable[[WS], list[object]]:
    return lambda ws: ["regress", "--no-progress", *[a(ws) if callable(a) else a for a in extra]]


def grid_file(name: str, text: str) -> Callable[[WS], Path]:
    return lambda ws: ws.file(name, text)


def _empty(key: str) -> str:
    """A grid (or one-run config) whose ``key`` is an empty list, the rest one value each."""
    keys = {"policies": '["lru"]', "traces": '["ci-small"]', "sequences": "1"}
    keys[key] = "[]"
    return "".join(f"{k} = {v}\n" for k, v in keys.items())


CASES: dict[str, Case] = {
    # -- traces (through run --trace; more in tests/test_trace_validation.py) ----------------
    "trace-empty-file": trace_case(
        lambda ws: ws.file("empty.parquet", b""), "empty.parquet", "Parquet", name="o1"
    ),
    "trace-is-directory": trace_case(
        lambda ws: ws.root / "a-directory", "a-directory", "directory", name="o2"
    ),
    "trace-missing": trace_case(
        lambda ws: ws.root / "nope.parquet", "nope.parquet", "no such", name="o3"
    ),
    "trace-unknown-name": trace_case(
        lambda ws: Path("no-such-bundled-trace"), "no-such-bundled-trace", "ci-small", name="o4"
    ),
    "trace-not-parquet": trace_case(
        lambda ws: ws.file("text.parquet", "seq,token\n1,2\n"), "text.parquet", name="o5"
    ),
    "trace-truncated": trace_case(
        lambda ws: ws.file("cut.parquet", ws.good.read_bytes()[:-300]), "cut.parquet", name="o6"
    ),
    "trace-more-moe-layers-than-metadata": trace_case(
        lambda ws: ws.meta_edit("layers.parquet", _fewer_layers),
        "layers.parquet",
        "layer",
        name="o7",
    ),
    "trace-more-experts-than-metadata": trace_case(
        lambda ws: ws.meta_edit("experts.parquet", _fewer_experts),
        "experts.parquet",
        "row",
        name="o8",
    ),
    "trace-metadata-not-json": trace_case(
        lambda ws: ws.meta_edit("meta.parquet", lambda m: m.clear()), "meta.parquet", name="o9"
    ),
    "calibration-missing": Case(
        run_args("--policy", "daop", "--calibration", lambda ws: ws.root / "cal.parquet"),
        ("cal.parquet", "no such"),
    ),
    "calibration-other-model": Case(
        run_args("--policy", "daop", "--calibration", "ci-small", out="o10"),
        ("calibration trace", "mixtral-8x7b"),
        outs("o10"),
    ),
    # -- hardware profiles (through run --hw PATH) -------------------------------------------
    **{
        f"profile-{p.stem}": Case(
            run_args("--hw", str(p), out=f"hw-{p.stem}"), (p.name,), outs(f"hw-{p.stem}")
        )
        for p in BAD_PROFILES
    },
    "profile-unknown-name": Case(
        run_args("--hw", "no-such-gpu", out="o11"), ("no-such-gpu", "a6000-pcie4"), outs("o11")
    ),
    "profile-is-directory": Case(
        run_args("--hw", lambda ws: str(ws.root / "a-directory") + os.sep, out="o12"),
        ("a-directory",),
        outs("o12"),
    ),
    # -- run options -------------------------------------------------------------------------
    "policy-unknown": Case(
        lambda ws: ["run", "--policy", "nope", "--trace", ws.good, "--out", ws.out("o13")],
        ("'nope'", "lru", "daop", "belady"),
        outs("o13"),
    ),
    "cache-ratio-zero": Case(run_args("--cache-ratio", "0", out="o14"), ("(0, 1]",), outs("o14")),
    "cache-ratio-negative": Case(run_args("--cache-ratio", "-0.5"), ("(0, 1]", "-0.5")),
    "cache-ratio-above-one": Case(run_args("--cache-ratio", "1.01"), ("(0, 1]", "1.01")),
    "cache-ratio-nan": Case(run_args("--cache-ratio", "nan"), ("(0, 1]",)),
    "cache-ratio-not-a-number": Case(run_args("--cache-ratio", "half"), ("--cache-ratio", "half")),
    "cache-ratio-and-gpu-experts": Case(
        run_args("--cache-ratio", "0.5", "--gpu-experts", "4", out="o15"),
        ("--cache-ratio", "--gpu-experts", "not both"),
        outs("o15"),
    ),
    "gpu-experts-negative": Case(run_args("--gpu-experts", "-1"), ("--gpu-experts", "-1")),
    "gpu-experts-above-total": Case(run_args("--gpu-experts", "33"), ("--gpu-experts", "33")),
    "sequences-zero": Case(run_args("--sequences", "0", out="o16"), ("--sequences",), outs("o16")),
    "sequences-negative": Case(run_args("--sequences", "-2"), ("--sequences", "-2")),
    "sequences-too-many": Case(run_args("--sequences", "50"), ("--sequences 50", "only")),
    "model-does-not-fit": Case(
        lambda ws: (
            [
                "run",
                "--trace",
                "ci-small",
                "--hw",
                "rtx4090-pcie4",
                "--policy",
                "lru",
                "--cache-ratio",
                "1",
                "--out",
                ws.out("o17"),
            ]
        ),
        ("mixtral-8x7b", "rtx4090-pcie4", "do not fit", "at most"),
        outs("o17"),
    ),
    "policy-opt-unknown-key": Case(
        run_args("--policy-opt", "speed=3", out="o18"), ("'lru'", "'speed'", "initial"), outs("o18")
    ),
    "policy-opt-wrong-type": Case(
        run_args("--policy", "daop", "--policy-opt", "swap_threshold=lots"),
        ("'daop'", "swap_threshold", "float", "lots"),
    ),
    "policy-opt-bad-choice": Case(
        run_args("--policy-opt", "initial=sideways"), ("initial", "sideways", "popular")
    ),
    "policy-opt-without-equals": Case(run_args("--policy-opt", "initial"), ("key=value",)),
    "policy-opt-empty-key": Case(run_args("--policy-opt", "=first"), ("key=value",)),
    "policy-opt-needs-more-memory": Case(
        run_args("--policy", "stream-all", "--gpu-experts", "2", "--policy-opt", "gather=layer"),
        ("stream-all", "gather"),
    ),
    "dtype-unknown": Case(run_args("--dtype", "fp7", out="o19"), ("fp7", "bf16"), outs("o19")),
    # -- synth -------------------------------------------------------------------------------
    "synth-negative-sequences": Case(
        lambda ws: (
            ["synth", "--model", "olmoe-1b-7b", "--sequences", "-1", "-o", ws.out("synth.parquet")]
        ),
        ("--sequences",),
        outs("synth.parquet"),
    ),
    "synth-negative-prompt-tokens": Case(
        synth_args("--prompt-tokens", "-5"), ("--prompt-tokens",), outs("synth.parquet")
    ),
    "synth-zero-output-tokens": Case(
        synth_args("--output-tokens", "0"), ("--output-tokens",), outs("synth.parquet")
    ),
    "synth-unknown-model": Case(
        lambda ws: ["synth", "--model", "gpt-9", "--sequences", "1", "-o", ws.out("s.parquet")],
        ("gpt-9", "mixtral-8x7b"),
        outs("s.parquet"),
    ),
    "synth-unknown-param": Case(
        synth_args("--param", "warp=9"), ("--param", "warp", "temperature"), outs("synth.parquet")
    ),
    "synth-param-wrong-type": Case(
        synth_args("--param", "temperature=hot"), ("temperature", "hot"), outs("synth.parquet")
    ),
    "synth-param-without-equals": Case(
        synth_args("--param", "temperature"), ("--param", "key=value"), outs("synth.parquet")
    ),
    "synth-unknown-preset": Case(
        synth_args("--preset", "nope"), ("nope", "preset"), outs("synth.parquet")
    ),
    "synth-missing-options": Case(lambda ws: ["synth", "--model", "olmoe-1b-7b"], ("--sequences",)),
    # -- capture (fails before any model is built) ------------------------------------------
    "capture-missing-prompts": Case(
        capture_args(lambda ws: ws.root / "none.jsonl", "--random-init", "mixtral"),
        ("none.jsonl", "no such prompts file"),
        outs("capture.parquet"),
    ),
    "capture-bad-jsonl-line": Case(
        capture_args(
            lambda ws: ws.file("bad.jsonl", '{"prompt": "hello"}\n{"prompt": \n'),
            "--random-init",
            "mixtral",
        ),
        ("bad.jsonl", "line 2", "JSON"),
        outs("capture.parquet"),
    ),
    "capture-prompt-without-text": Case(
        capture_args(lambda ws: ws.file("notext.jsonl", '{"id": 1}\n'), "--random-init", "mixtral"),
        ("notext.jsonl", "line 1", "'prompt'"),
        outs("capture.parquet"),
    ),
    "capture-prompts-wrong-suffix": Case(
        capture_args(lambda ws: ws.file("prompts.csv", "a,b\n"), "--random-init", "mixtral"),
        ("prompts.csv", ".jsonl"),
        outs("capture.parquet"),
    ),
    "capture-unknown-family": Case(
        capture_args(lambda ws: ws.file("ok.jsonl", '{"prompt": "hi"}\n'), "--random-init", "x"),
        ("--random-init", "'x'", "mixtral"),
        outs("capture.parquet"),
    ),
    # -- sweep grid files ---------------------------------------------------------------------
    "sweep-grid-missing": Case(
        sweep_args(lambda ws: ws.root / "nogrid.toml"),
        ("nogrid.toml", "no such"),
        outs("sweep.parquet"),
    ),
    "sweep-grid-not-toml": Case(
        sweep_args(grid_file("g1.toml", "policies = [lru\n")),
        ("g1.toml", "TOML"),
        outs("sweep.parquet"),
    ),
    "sweep-grid-unknown-key": Case(
        sweep_args(grid_file("g2.toml", 'policies = ["lru"]\ncolour = "red"\n')),
        ("g2.toml", "colour"),
        outs("sweep.parquet"),
    ),
    "sweep-grid-ratio-out-of-range": Case(
        sweep_args(grid_file("g3.toml", 'policies = ["lru"]\ncache_ratios = [1.5]\n')),
        ("1.5", "(0, 1]"),
        outs("sweep.parquet"),
    ),
    "sweep-grid-unknown-policy": Case(
        sweep_args(grid_file("g4.toml", 'policies = ["nope"]\n')),
        ("nope", "lru"),
        outs("sweep.parquet"),
    ),
    # -- regress ------------------------------------------------------------------------------
    "regress-baseline-missing": Case(
        regress_args("--baseline", lambda ws: ws.root / "nobase.json"),
        ("nobase.json", "--update"),
    ),
    "regress-grid-unknown-key": Case(
        regress_args("--grid", grid_file("r1.toml", 'policies = ["lru"]\nspeed = 1\n')),
        ("r1.toml", "speed"),
    ),
    "regress-grid-bad-ratio": Case(
        regress_args("--grid", grid_file("r2.toml", "cache_ratios = [0]\n")),
        ("r2.toml", "cache_ratios"),
    ),
    "regress-negative-tolerance": Case(
        regress_args("--tolerance-time", "-1"), ("--tolerance-time", "-1")
    ),
    # -- text inputs: one reader (regular files, bounded size, UTF-8) --------------------------
    **{
        f"non-utf8-toml-{kind}": Case(args, ("latin1.toml", "not UTF-8", "0xe9"), outs(out))
        for kind, args, out in (
            ("run-config", run_args("--config", lambda ws: _latin1(ws), out="u1"), "u1"),
            ("sweep-grid", sweep_args(lambda ws: _latin1(ws)), "sweep.parquet"),
            ("validate-table", lambda ws: ["validate", "--table", _latin1(ws)], "u2"),
            ("experiment", lambda ws: ["experiment", _latin1(ws), "-o", ws.out("u3")], "u3"),
            ("regress-grid", regress_args("--grid", lambda ws: _latin1(ws)), "u4"),
            ("profile", run_args("--hw", lambda ws: _latin1(ws), out="u5"), "u5"),
        )
    },
    # -- an empty list is never the default ----------------------------------------------------
    **{
        f"empty-list-{how}-{key}": Case(
            (
                run_args("--config", grid_file(f"empty-{key}.toml", _empty(key)), out=f"e-{key}")
                if how == "run-config"
                else sweep_args(grid_file(f"empty-{key}.toml", _empty(key)))
            ),
            (f"empty-{key}.toml", f"key {key!r} is an empty list"),
            outs(f"e-{key}" if how == "run-config" else "sweep.parquet"),
        )
        for key in ("traces", "policies", "seeds", "runtimes", "gpu_experts", "cache_ratios", "hw")
        for how in ("run-config", "sweep")
    },
    "learned-model-fifo": Case(
        run_args("--policy", "learned", "--policy-opt", lambda ws: f"model={_fifo(ws)}"),
        ("model.fifo", "FIFO", "not a regular model file"),
    ),
    "learned-model-character-device": Case(
        run_args("--policy", "learned", "--policy-opt", "model=/dev/zero"),
        ("/dev/zero", "character device", "not a regular model file"),
    ),
    "learned-model-huge": Case(
        run_args("--policy", "learned", "--policy-opt", lambda ws: f"model={_huge(ws)}"),
        ("huge.json", "larger than 16 MiB"),
    ),
    "learned-model-overflowing-weights": Case(
        run_args("--policy", "learned", "--policy-opt", lambda ws: f"model={_overflowing(ws)}"),
        ("big-weights.json", "field w2", "at most 1e+06"),
    ),
}


def _latin1(ws: WS) -> Path:
    """A TOML file whose comment is Latin-1, not UTF-8."""
    return ws.file("latin1.toml", 'policies = ["lru"]\n# caf\xe9 \xff\n'.encode("latin-1"))


def _fifo(ws: WS) -> Path:
    p = ws.root / "model.fifo"
    if not p.exists():
        os.mkfifo(p)
    return p


def _huge(ws: WS) -> Path:
    p = ws.root / "huge.json"
    with open(p, "wb") as fh:
        fh.truncate(16 * 2**20 + 1)  # sparse: no disk used
    return p


def _overflowing(ws: WS) -> Path:
    """The bundled model with weights that are finite but overflow a score to NaN."""
    from daopsim.policies.learned import BUNDLED_MODEL

    doc = json.loads(BUNDLED_MODEL.read_text())
    doc["w2"][0], doc["w2"][1] = 1e308, -1e308
    return ws.file("big-weights.json", json.dumps(doc))


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name: str, ws: WS) -> None:
    case = CASES[name]
    args = [str(a) for a in case.args(ws)]
    result = CliRunner().invoke(main, args, catch_exceptions=True)
    stderr = result.stderr
    assert "Traceback" not in result.output + stderr, stderr
    assert result.exit_code == 2, (result.exit_code, result.output, stderr, result.exception)
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    for w in case.words:
        assert w in lines[0], (w, lines[0])
    for p in case.outputs(ws):
        assert not p.exists(), f"{p} exists after a failed command"
    leftovers = [p for p in (ws.root / "outputs").rglob("*") if p.name.endswith(".tmp")]
    assert not leftovers, leftovers


def test_corpus_size() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize("policy", ["lru", "lfu", "fiddler", "daop", "mixtral-offloading"])
def test_budget_below_top_k_is_a_documented_fallback(policy: str, ws: WS) -> None:
    """One slot for a top-2 model: the policy runs, never holds more than the budget, and
    serves what does not fit some other way (temporary buffers or the CPU)."""
    from daopsim.policies.registry import get_policy_class
    from daopsim.simulator.runner import simulate

    res = simulate(policy=policy, trace=ws.good, gpu_experts=1, record=False)
    m = res.metrics
    # slots held = resident experts (the budget) plus the policy's declared staging buffers,
    # which hold an incoming expert while an evicted one is written back
    assert m["max_slots_held"] <= 1 + max(1, get_policy_class(policy)().resources().staging_buffers)
    assert m["hit_rate"] < 0.5
    assert m["temp_copies"] + m["cpu_expert_evals"] + m["fetches"] > 0


# -- random damage through `daopsim run --trace` ----------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    cuts=st.lists(
        st.tuples(st.floats(0, 1), st.integers(1, 64), st.integers(0, 255)), min_size=1, max_size=4
    ),
    truncate=st.booleans(),
)
def test_random_corruption_never_tracebacks_through_run(
    ws: WS, cuts: list[tuple[float, int, int]], truncate: bool
) -> None:
    data = bytearray(ws.good.read_bytes())
    for where, length, value in cuts:
        at = int(where * (len(data) - 1))
        data[at : at + length] = bytes([value]) * min(length, len(data) - at)
    if truncate:
        data = data[: len(data) // 2]
    bad = ws.root / "fuzz.parquet"
    bad.write_bytes(bytes(data))
    out = ws.out("fuzz-out")
    res = CliRunner().invoke(
        main,
        ["run", "--policy", "lru", "--trace", str(bad), "--no-progress", "--out", str(out)],
        catch_exceptions=True,
    )
    assert "Traceback" not in res.output + res.stderr
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    if res.exit_code == 0:  # the damage missed everything that is read
        import shutil

        shutil.rmtree(out)
    else:
        assert res.exit_code == 2, res.stderr
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
        assert not out.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--trace", "{fifo}"],
        ["run", "--trace", "ci-small", "--calibration", "{fifo}"],
        ["trace", "stats", "{fifo}"],
        ["trace", "validate", "{fifo}"],
        ["validate", "--table", "{fifo}"],
        ["regress", "--baseline", "{fifo}"],
        ["plot", "{fifo}"],
        ["experiment", "{fifo}"],
    ],
    ids=lambda a: "-".join(x for x in a if not x.startswith("{"))[:40],
)
def test_fifo_inputs_are_refused_not_read(tmp_path: Path, args: list[str]) -> None:
    """Reading a FIFO would block forever: every input path must be a regular file."""
    fifo = tmp_path / "input.parquet"
    os.mkfifo(fifo)
    res = CliRunner().invoke(main, [a.format(fifo=fifo) for a in args])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert lines[0].startswith("error: ") and "is a FIFO" in lines[0] and str(fifo) in lines[0]
