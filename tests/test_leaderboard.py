"""The leaderboard (docs/leaderboard.md): its grid, its table, its Markdown and its runs.

The bundled grid holds what the docs promise (every built-in policy, dense and fine-grained
models, four machines, three budgets above top-k that every machine holds for every policy);
a small grid runs end to end through the command (table, Markdown, figures), resumes without
simulating again, gives the same table on Dask, and refuses bad input in one line; and the
committed docs/leaderboard/leaderboard.md is exactly what the committed Parquet renders.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pandas.testing as pdt
import pytest
from click.testing import CliRunner

from daopsim.simulator.cli import main
from daopsim.simulator.leaderboard import (
    LEADERBOARD_FILES,
    builtin_policies,
    load_leaderboard,
    markdown,
    ranking,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "leaderboard"
TINY = """
name = "tiny-board"
kind = "leaderboard"
description = "two budgets of ci-small on one machine"
hw = ["a6000-pcie4"]
sequences = 1
policies = ["lru", "fiddler", "daop", "belady", "all-gpu"]
[[models]]
trace = "ci-small"
experts_per_layer = [2.5, 3]
"""


def _tiny(tmp_path: Path, text: str = TINY) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(text)
    return path


def _run(tmp_path: Path, *extra: str) -> tuple[int, dict, str]:
    res = CliRunner().invoke(
        main,
        ["experiment", str(_tiny(tmp_path)), "-o", str(tmp_path / "out"),
         "--runs", str(tmp_path / "runs"), "--workers", "1", "--json", *extra],
    )  # fmt: skip
    doc = json.loads(res.stdout) if res.exit_code == 0 else {}
    return res.exit_code, doc, res.output


def test_the_bundled_grid_is_the_documented_one() -> None:
    """Every built-in policy (from the registry), four models of which two dense-expert and
    two fine-grained, four machines, three budgets per model, each budget above top-k and
    below all experts per layer, and held by every machine beside every policy's buffers (so
    no cell is skipped)."""
    from daopsim.policies.registry import available
    from daopsim.simulator.costs import cost_model
    from daopsim.simulator.fit import expert_fit, policy_buffers, trace_context
    from daopsim.simulator.hardware import load_profile
    from daopsim.simulator.trace_read import read_meta

    board = load_leaderboard("leaderboard")
    assert board.policies is None  # "builtin": the registry decides
    builtin = builtin_policies()
    assert builtin == sorted(
        n for n, c in available().items() if c.__module__.startswith("daopsim.policies.")
    )
    assert {"lru", "daop", "belady", "belady-global", "all-gpu"} <= set(builtin)
    assert len(board.hw) >= 4 and len(board.models) >= 4
    buffers = max(policy_buffers(available()[p]()) for p in builtin)
    kinds = {"dense": 0, "fine": 0}
    for entry in board.models:
        meta = read_meta(entry.trace_path())
        m = meta.model
        kinds["fine" if m.experts >= 64 else "dense"] += m.experts <= 16 or m.experts >= 64
        assert len(entry.experts_per_layer) == 3
        assert all(m.top_k < x < m.experts for x in entry.experts_per_layer), entry.label
        most = max(entry.experts_per_layer) * m.moe_layers
        for hw in board.hw:
            fit = expert_fit(cost_model(load_profile(hw), m), buffers, trace_context(meta))
            assert fit.max_experts >= round(most), (entry.label, hw, fit.max_experts)
    assert kinds["dense"] >= 2 and kinds["fine"] >= 2


def test_a_small_grid_end_to_end_resumes_and_renders(tmp_path: Path) -> None:
    code, doc, out = _run(tmp_path)
    assert code == 0, out
    assert doc["sweeps"]["mixtral-8x7b"]["resumed"] == 0
    files = {k: tmp_path / "out" / v for k, v in LEADERBOARD_FILES.items()}
    assert all(p.is_file() and p.stat().st_size > 0 for p in files.values())
    table = pd.read_parquet(files["parquet"])
    # 4 realisable policies and belady at 2 budgets, all-gpu copied into both
    assert len(table) == 2 * 5 and (table["status"] == "ok").all()
    for _, cell in table.groupby(["model", "hw", "budget"]):
        real = cell[~cell["bound"]]
        exact = real[real["gate_mass_preserved"] >= 0.9995]
        assert exact["relative"].max() == 1.0  # the cell's best exact policy
        best = exact.loc[exact["relative"].idxmax(), "policy"]
        assert (cell["best"] == best).all()
        ag = cell[cell["policy"] == "all-gpu"].iloc[0]
        assert ag["bound"] and ag["relative"] > 1.0  # the all-GPU bound is above every policy
        assert (real["tokens_per_s"] <= ag["tokens_per_s"]).all()
    assert set(table[table["bound"]]["policy"]) == {"all-gpu", "belady"}
    assert list(table["experts_per_layer"].drop_duplicates()) == [2.5, 3.0]
    assert list(table["gpu_experts"][table["policy"] == "lru"]) == [80, 96]  # x 32 layers
    # the Markdown is a function of the table
    assert files["markdown"].read_text() == markdown(table, "tiny-board")
    rk = ranking(table)
    assert list(rk[~rk["bound"]]["policy"])[:2] == ["daop", "fiddler"]  # daop approximates
    assert not math.isnan(rk.set_index("policy").loc["lru", "score"])
    # again: every run comes from the store, the same table
    code, doc, out = _run(tmp_path)
    assert code == 0, out
    s = doc["sweeps"]["mixtral-8x7b"]
    assert s["resumed"] == s["configurations"] == 9
    pdt.assert_frame_equal(pd.read_parquet(files["parquet"]), table)


@pytest.mark.slow
def test_dask_gives_the_same_table(tmp_path: Path) -> None:
    """The grid through a Dask LocalCluster: the same table as the process pool."""
    from daopsim.simulator.leaderboard import run_leaderboard

    board = _tiny(tmp_path)
    kw = {"policies": ["lru", "all-gpu"], "progress": False, "workers": 1}
    local = run_leaderboard(board, runs=tmp_path / "a", **kw)  # type: ignore[arg-type]
    dask = run_leaderboard(board, runs=tmp_path / "b", executor="dask", **kw)  # type: ignore[arg-type]
    pdt.assert_frame_equal(local.table, dask.table)


def test_a_new_policy_joins_and_only_its_rows_run(tmp_path: Path) -> None:
    """--extra-policies adds a policy to the grid: the rows already in the store resume and
    only the new policy's run."""
    code, doc, out = _run(tmp_path, "--policies", "lru,all-gpu")
    assert code == 0, out
    code, doc, out = _run(tmp_path, "--policies", "lru,all-gpu", "--extra-policies", "lfu")
    assert code == 0, out
    s = doc["sweeps"]["mixtral-8x7b"]
    assert s["configurations"] == 5 and s["resumed"] == 3
    assert "lfu" in {r["policy"] for r in doc["ranking"]}


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--models", "qwen9"], "--models: 'qwen9' is not one of"),
        (["--hw", "rtx4090-pcie4"], "--hw: 'rtx4090-pcie4' is not one of"),
        (["--policies", "nope"], "nope"),
        (["--workers", "0"], "--workers must be at least 1"),
    ],
)
def test_bad_options_are_one_line(tmp_path: Path, args: list[str], words: str) -> None:
    code, _, out = _run(tmp_path, *args)
    assert code == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (("experts_per_layer = [2.5, 3]", "experts_per_layer = [0, 3]"), "is not a positive"),
        (("hw = [", "machines = ["), "unknown key 'machines'"),
        (('trace = "ci-small"', 'trace = "ci-small"\nsynth = { seed = 1 }'), "'synth' goes"),
        (("sequences = 1", "sequences = 0"), "'sequences' must be a positive integer"),
    ],
)
def test_a_bad_leaderboard_file_is_named(tmp_path: Path, edit: tuple[str, str], words: str) -> None:
    path = _tiny(tmp_path, TINY.replace(*edit))
    res = CliRunner().invoke(main, ["experiment", str(path), "-o", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "tiny.toml" in res.output and words in res.output


def test_grid_options_are_refused_for_a_comparison_experiment(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["experiment", "daop-paper", "--workers", "2"])
    assert res.exit_code == 2
    assert "--workers applies to a leaderboard experiment only" in res.output


def test_the_committed_markdown_is_what_the_committed_table_renders() -> None:
    """docs/leaderboard/ holds the full run's table and its Markdown: the Markdown must be
    exactly what the table renders (regenerate both with the command in docs/leaderboard.md),
    and the table must cover the bundled grid."""
    table = pd.read_parquet(DOCS / LEADERBOARD_FILES["parquet"])
    assert (DOCS / LEADERBOARD_FILES["markdown"]).read_text() == markdown(table, "leaderboard")
    board = load_leaderboard("leaderboard")
    assert set(table["model"]) == {m.label for m in board.models}
    assert set(table["hw"]) == set(board.hw)
    # a built-in policy added since the run is missing: run the command again (its rows only)
    assert set(table["policy"]) == set(builtin_policies())
    for name in ("heatmap", "pareto"):
        assert (DOCS / LEADERBOARD_FILES[name]).stat().st_size > 10_000
