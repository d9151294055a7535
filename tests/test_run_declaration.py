"""One declaration of a run, one registry of metrics: every surface follows them.

A run parameter added to the declaration (simulator/run_params.py) must be a keyword of
``simulate()`` (checked as declared) reported in the run's configuration and JSON, appear in
``daopsim run --help`` (with its doc line), be read from ``run --config``, be a key and an axis
of a sweep grid (and a ``daopsim sweep`` flag) with its row in docs/sweeps.md's generated table,
and be shared with every run of the bounds beside a run; a metric added
to the registry (simulator/metrics.py) must appear in ``run --json``, the ``run`` table, the
sweep table's columns, the golden store's records and docs/metrics.md's tables. Each test adds
an entry to the declaration or the registry and checks what each surface does with it (the
value given reaches ``simulate()``; the computed value reaches the output), not which code
path ran.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from dataclasses import make_dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from daopsim.simulator import metrics as metric_registry
from daopsim.simulator import run_params, runner
from daopsim.simulator.bounds import all_gpu_bound
from daopsim.simulator.commands import run_cmd, sweep_cmd
from daopsim.simulator.doc_tables import render_metrics, render_sweeps
from daopsim.simulator.errors import UserError
from daopsim.simulator.grid import Grid, grid_keys
from daopsim.simulator.metrics import Metric, section_table
from daopsim.simulator.run_params import RunParam
from daopsim.simulator.serving_config import serving_config
from daopsim.simulator.sweep import run_sweep
from daopsim.simulator.sweep_expand import expand
from daopsim.simulator.sweep_row import run_config
from daopsim.simulator.sweep_table import to_frame

RUN = ["--policy", "lru", "--trace", "ci-small", "--cache-ratio", "0.25", "--sequences", "1"]
DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
SWEEPS = DOC.parent / "sweeps.md"


def _positive(value: Any, label: str) -> None:
    if value < 1:
        raise UserError(f"{label} must be at least 1, got {value}")


#: a new run parameter: an integer knob with a flag, a grid axis and a share in the bounds
KNOB_META: dict[str, Any] = {
    "kind": int,
    "flag": "--knob",
    "grid": "knobs",
    "axis": True,
    "bounds": "given",
    "check": _positive,
}
KNOB_DOC = "Turns the test knob (a parameter the declaration gains in this test)."
KNOB = RunParam(name="knob", default=3, doc=KNOB_DOC, **KNOB_META)


@pytest.fixture
def knob(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """The declaration with a field ``knob`` added to ``RunRequest`` (so ``simulate()``
    takes it, as a field written in simulator/run_params.py would be; the engine does not
    use it); ``simulate()`` records the arguments of each call."""
    request = make_dataclass(
        "RunRequest",
        [("knob", int, run_params.param(3, KNOB_DOC, **KNOB_META))],
        bases=(run_params.RunRequest,),
    )
    declared = (*run_params._declared(request, "run"), *run_params.run_params("serving"))
    assert declared[len(run_params.run_params("run"))] == KNOB
    monkeypatch.setattr(run_params, "RunRequest", request)
    monkeypatch.setattr(run_params, "RUN_PARAMS", declared)
    calls: list[dict[str, Any]] = []
    real = runner.simulate

    def simulate(*args: Any, **kwargs: Any) -> Any:
        calls.append(dict(kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "simulate", simulate)
    yield calls


def _invoke(command: Any, args: list[str]) -> Any:
    return CliRunner().invoke(command, args, catch_exceptions=False)


def test_simulate_takes_exactly_the_declared_keywords() -> None:
    """simulate()'s signature is the declaration's "run" part, in order, with its defaults;
    its docstring has each parameter's doc line."""
    sig = inspect.signature(runner.simulate)
    declared = run_params.run_params("run")
    assert list(sig.parameters) == [p.name for p in declared]
    assert [sig.parameters[p.name].default for p in declared] == [p.default for p in declared]
    for p in declared:
        assert f"``{p.name}``: {p.doc}" in (runner.simulate.__doc__ or "")
    with pytest.raises(TypeError, match="simulate\\(\\) got an unexpected keyword argument 'nope'"):
        runner.simulate(nope=1)


def test_a_declared_parameter_is_a_run_option(knob: list[dict[str, Any]]) -> None:
    """The new field is a `daopsim run` flag with its doc line as help; its value reaches
    simulate(), and its default when not given."""
    cmd = run_cmd.build_run_command()
    help_text = " ".join(_invoke(cmd, ["--help"]).output.split())
    assert "--knob INTEGER" in help_text and KNOB.doc in help_text
    res = _invoke(cmd, [*RUN, "--knob", "5", "--no-bounds", "--json"])
    assert res.exit_code == 0, res.output
    assert knob[-1]["knob"] == 5 and json.loads(res.output)["policy"] == "lru"
    assert _invoke(cmd, [*RUN, "--no-bounds", "--json"]).exit_code == 0
    assert knob[-1]["knob"] == 3


def test_a_declared_parameter_is_a_config_key(knob: list[dict[str, Any]], tmp_path: Path) -> None:
    """`run --config` reads the new grid key (one value); the command line wins over it; two
    values are one line naming the key."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('policies = ["lru"]\ntraces = ["ci-small"]\nsequences = 1\nknobs = [7]\n')
    assert run_cmd.load_run_config(str(cfg))["knob"] == 7
    cmd = run_cmd.build_run_command()
    assert _invoke(cmd, ["--config", str(cfg), "--no-bounds", "--json"]).exit_code == 0
    assert knob[-1]["knob"] == 7 and knob[-1]["policy"] == "lru"
    assert _invoke(cmd, ["--config", str(cfg), "--knob", "9", "--no-bounds"]).exit_code == 0
    assert knob[-1]["knob"] == 9
    cfg.write_text('policies = ["lru"]\nknobs = [1, 2]\n')
    with pytest.raises(UserError, match="key 'knobs' has 2 values; a run takes one"):
        run_cmd.load_run_config(str(cfg))


def test_a_declared_parameter_is_a_sweep_axis(knob: list[dict[str, Any]]) -> None:
    """The new grid key is a Grid attribute and an axis: each value is a configuration with its
    own key, whose run gets the value and whose row names it (a table column); at its default
    the key is the one a grid without the parameter gives (earlier sweeps stay valid); its
    values are type-checked and checked as declared; `daopsim sweep` has a flag for it."""
    base = {"policies": ["lru"], "traces": ["ci-small"], "cache_ratios": [0.25], "sequences": 1}
    grid = Grid.from_dict({**base, "knobs": [1, 2]})
    assert grid.knobs == [1, 2] and Grid(policies=["lru"]).knobs == [3]
    configs = expand(grid)
    assert [c.knob for c in configs] == [1, 2] and configs[0].key != configs[1].key
    rows = [run_config(c) for c in configs]
    assert [r["status"] for r in rows] == ["ok", "ok"] and knob[-1]["knob"] == 2
    assert list(to_frame(rows)["knob"]) == [1, 2]  # a column of the sweep table
    at_default = expand(Grid.from_dict({**base, "knobs": [3]}))[0].key
    with pytest.MonkeyPatch.context() as m:
        m.setattr(run_params, "RUN_PARAMS", tuple(p for p in run_params.RUN_PARAMS if p != KNOB))
        assert expand(Grid.from_dict(base))[0].key == at_default
    with pytest.raises(UserError, match="key 'knobs': 'a' is not a int"):
        Grid.from_dict({**base, "knobs": ["a"]})
    with pytest.raises(UserError, match="--knobs must be at least 1, got 0"):
        expand(Grid.from_dict({**base, "knobs": [0]}))
    help_text = " ".join(_invoke(sweep_cmd.build_sweep_command(), ["--help"]).output.split())
    assert "--knobs TEXT" in help_text and KNOB.doc in help_text


def test_a_declared_parameter_reaches_the_bounds(knob: list[dict[str, Any]]) -> None:
    """A parameter declared with ``bounds="given"`` is passed, as the run was given it, to
    every run of the bounds beside it: the all-GPU bound's runs and the Belady runs."""
    result = runner.simulate("lru", "a6000-pcie4", "ci-small", 0.25, sequences=1, record=False)
    before = len(knob)
    bounds = run_cmd.compute_bounds(result, hw="a6000-pcie4", trace="ci-small", sequences=1, knob=6)
    bound_runs = knob[before:]
    policies = [c["policy"] for c in bound_runs]
    assert policies[-2:] == ["belady", "belady-global"] and "all-gpu" in policies[:-2]
    assert all(c["knob"] == 6 for c in bound_runs)
    assert bounds["all-gpu"]["tokens_per_s"] >= result.metrics["tokens_per_s"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        all_gpu_bound("a6000-pcie4", "ci-small", [0], nope=1)


def test_a_declared_parameter_is_a_simulate_keyword_and_in_the_json(
    knob: list[dict[str, Any]],
) -> None:
    """``simulate()`` takes the new keyword, checks it as declared (one line naming its
    flag), and the run's configuration (its JSON, `run --json`) reports the value."""
    run = {"policy": "lru", "trace": "ci-small", "cache_ratio": 0.25, "sequences": 1}
    r = runner.simulate(**run, record=False, knob=5)
    assert r.config["knob"] == 5 and json.loads(r.to_json())["knob"] == 5
    assert runner.simulate(**run, record=False).config["knob"] == 3
    with pytest.raises(UserError, match="--knob must be at least 1, got 0"):
        runner.simulate(**run, record=False, knob=0)
    res = _invoke(run_cmd.build_run_command(), [*RUN, "--knob", "4", "--no-bounds", "--json"])
    assert json.loads(res.output)["knob"] == 4


def test_a_declared_parameter_is_in_the_sweeps_doc(knob: list[dict[str, Any]]) -> None:
    """docs/sweeps.md's generated grid-key table gains a row for the new key: what it takes,
    its `daopsim sweep` flag, its `daopsim run` option and its doc line."""
    text = render_sweeps(SWEEPS.read_text(encoding="utf-8"))
    row = (
        f"| `knobs` | list of integers (an axis); default `3` | `--knobs A,B` | `--knob` | "
        f"{KNOB_DOC} |"
    )
    assert row in text.splitlines()


def test_the_sweeps_page_is_generated_from_the_declaration() -> None:
    """The committed docs/sweeps.md holds exactly the grid-key table the declaration
    generates (rewrite it with `make docs-metrics`), one row per grid key and per other key."""
    text = SWEEPS.read_text(encoding="utf-8")
    assert render_sweeps(text) == text, "docs/sweeps.md is stale: run `make docs-metrics`"
    table = text.split("<!-- grid-keys:start -->", 1)[1].split("<!-- grid-keys:end -->", 1)[0]
    keys = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert keys == grid_keys()


def test_every_serving_option_reaches_the_serving_configuration() -> None:
    """Each declared serving option given to ``serving_config`` (as `daopsim run` and the
    sweep give them) is the run's ServingConfig's value: the configuration inherits the
    declared options, it does not list them again."""
    given = {
        "arrival_rate": 0.5, "kv_cache_gb": 2.0, "slo_ttft": 1.5, "slo_tpot": 0.25,
        "prefill_chunk": 16, "preempt": True, "max_batch": 4,
    }  # fmt: skip
    declared = {p.name for p in run_params.run_params("serving")}
    assert set(given) | {"batch", "arrivals", "static_prefill"} == declared
    cfg = serving_config(**given)
    assert cfg is not None and cfg.batch == 4 and cfg.continuous
    for name, value in given.items():
        if name != "max_batch":
            assert getattr(cfg, name) == value, name
    with pytest.raises(UserError, match="--prefill-chunk must be a positive integer"):
        serving_config(batch=2, prefill_chunk=0)
    with pytest.raises(TypeError, match="serving_config\\(\\) got an unexpected keyword"):
        serving_config(nope=1)


#: a new metric: twice the generated tokens, with a row in the `run` table
DOUBLE = Metric(
    "double_tokens",
    "count",
    "counts",
    "twice the generated tokens (a metric the registry gains in this test)",
    compute=lambda r: 2 * int(r.c.decode_tokens),
    table=("double tokens", "", 1.0),
)


@pytest.fixture
def double(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metric_registry, "METRICS", (*metric_registry.METRICS, DOUBLE))


def test_a_registered_metric_is_in_a_runs_json_and_table(double: None) -> None:
    """The new metric is computed, in `run --json`'s metrics and in the `run` table."""
    res = _invoke(run_cmd.build_run_command(), [*RUN, "--no-bounds", "--json"])
    m = json.loads(res.output)["metrics"]
    assert m["double_tokens"] == 2 * m["decode_tokens"] > 0
    table = _invoke(run_cmd.build_run_command(), [*RUN, "--no-bounds"]).output
    want = ["double", "tokens", f"{2 * m['decode_tokens']:,}"]
    assert want in [line.split() for line in table.splitlines()]


def test_a_registered_metric_is_a_sweep_column_and_in_the_golden_store(double: None) -> None:
    """The new metric is a column of the sweep table, and in the record `daopsim regress`
    stores for a configuration."""
    from daopsim.simulator.regress import run_cell
    from daopsim.simulator.regress_compare import flatten
    from daopsim.simulator.regress_grid import Budget, Cell, GridBlock, PolicySpec

    grid = {"policies": ["lru"], "traces": ["ci-small"], "cache_ratios": [0.25], "sequences": 1}
    df, _ = run_sweep(grid, workers=1, progress=False, bounds=False)
    assert list(df["double_tokens"]) == [2 * df["decode_tokens"].iloc[0]]
    block = GridBlock(trace="ci-small", policies=["lru"], sequences=1)
    rec = run_cell(Cell(block, PolicySpec("lru"), "a6000-pcie4", Budget(0.25)))
    flat = flatten(rec)
    assert flat["metrics.double_tokens"] == 2 * flat["metrics.decode_tokens"]


def test_a_registered_metric_is_in_the_docs_table(double: None) -> None:
    """The generated docs/metrics.md has a row for the new metric in its section's table."""
    text = render_metrics(DOC.read_text(encoding="utf-8"))
    row = f"| `double_tokens` | count | {DOUBLE.doc} |"
    assert row in section_table("counts").splitlines() and row in text.splitlines()
    counts = text.split("## Counts", 1)[1].split("## ", 1)[0]
    assert row in counts


def test_the_metrics_page_is_generated_from_the_registry() -> None:
    """The committed docs/metrics.md holds exactly the tables the registry generates (rewrite
    them with `make docs-metrics`)."""
    text = DOC.read_text(encoding="utf-8")
    assert render_metrics(text) == text, "docs/metrics.md is stale: run `make docs-metrics`"
