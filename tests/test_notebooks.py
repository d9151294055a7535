"""The notebooks under notebooks/ execute top to bottom (nbclient), are committed without
outputs, import only the public API (``daopsim``), and what their text says about their own
output is true: each claim below is a phrase of a notebook's markdown and the code that checks
it in the executed kernel (appended as a last cell). `make notebooks` runs this file."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest

#: several CPU-seconds a test: they run first (tests/conftest.py)
pytestmark = pytest.mark.slow

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
#: Per-cell limit; each notebook is meant to run in well under a minute.
CELL_TIMEOUT_S = 300


def test_notebooks_exist() -> None:
    names = [p.name for p in NOTEBOOKS]
    for want in (
        "01-quickstart.ipynb",
        "02-parameter-sweep.ipynb",
        "03-capture-and-replay.ipynb",
        "04-learned-policy.ipynb",
    ):
        assert want in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebooks_committed_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: outputs not stripped"
            assert cell.execution_count is None, f"{path.name}: execution count not stripped"


#: the figure checks the claims share (run in the notebook's kernel)
_HELPERS = """
def _bound_lines(ax):
    return [ln for ln in ax.get_lines() if "all-GPU bound" in str(ln.get_label())]

def _notes(ax):
    return " ".join(t.get_text() for t in ax.texts)

def _dashed_under(fig, name):
    for ax in fig.axes:
        lines = [ln for ln in ax.get_lines() if not str(ln.get_label()).startswith("_")]
        bound = [ln for ln in lines if str(ln.get_label()).startswith(name)]
        assert bound, (name, [ln.get_label() for ln in lines])
        others = [ln for ln in lines if ln not in bound]
        assert all(ln.get_linestyle() == "--" for ln in bound)
        assert all(b.get_zorder() < o.get_zorder() for b in bound for o in others)
"""

#: notebook -> [(a phrase of its markdown, code that checks it after the notebook ran)]
CLAIMS: dict[str, list[tuple[str, str]]] = {
    "01-quickstart.ipynb": [
        (
            "Here `all-gpu` is the fastest of the three, and `lru` the slowest",
            "assert compare['tokens_per_s'].idxmax() == 'all-gpu'\n"
            "assert compare['tokens_per_s'].idxmin() == 'lru'",
        ),
        (
            "`daop` reaches less than half of it here",
            "assert 0 < share < 0.5 and bound.own_tokens_per_s <= bound.tokens_per_s",
        ),
    ],
    "02-parameter-sweep.ipynb": [
        (
            "Here: three policies and two bounds on three machines at three cache ratios",
            "assert len(grid['policies']) == 5 and len(grid['hw']) == 3\n"
            "assert len(grid['cache_ratios']) == 3",
        ),
        (
            "Configurations that cannot run are rows with status `skipped` and the reason",
            "bad = df[df['status'] != 'ok']\n"
            "assert len(bad) and set(bad['status']) == {'skipped'}\n"
            "assert bad['error'].str.startswith('does not fit').all()",
        ),
        (
            "a row with status `error`; there is none here",
            "assert not (df['status'] == 'error').any()",
        ),
        (
            "Three eighths of Mixtral's experts do not fit in an RTX 4090's 24 GB",
            "q = df[(df['hw'] == 'rtx4090-pcie4') & (df['cache_ratio'] == 0.375)]\n"
            "assert len(q) and (q['status'] == 'skipped').all()",
        ),
        (
            "one, three and almost four of each layer's 8 experts",
            "assert [round(r * 256 / 32, 2) for r in grid['cache_ratios']] == [1.5, 3.0, 3.75]",
        ),
        (
            "At 0.1875 (48 experts: one per layer, fewer than Mixtral's top-2) `lru` equals",
            "low = per.xs(0.1875, level='cache_ratio')\n"
            "assert (low['lru'] == low['belady']).all() and len(low) == 3",
        ),
        (
            "The policies part from 0.375 (three per layer) on.",
            "high = per.xs(0.375, level='cache_ratio')\n"
            "assert (high['lru'] < high['belady']).all() and len(high) == 2",
        ),
        (
            "so its `gate_mass_preserved` is below 1",
            "kept = per['gate mass kept by daop'].dropna()\n"
            "assert len(kept) == 7 and (kept < 1).all()",
        ),
        (
            "each panel names it in a note under the panel instead of drawing a line",
            "for ax in fig_throughput.axes:\n"
            "    assert not _bound_lines(ax) and 'all-GPU bound' in _notes(ax), _notes(ax)",
        ),
        (
            "the skipped RTX 4090 points are named under their panel",
            "ax = next(a for a in fig_throughput.axes if a.get_title() == 'rtx4090-pcie4')\n"
            "assert 'skipped' in _notes(ax) and '@ 0.375' in _notes(ax)",
        ),
        (
            "the clairvoyant bound of a per-layer cache of the routed experts, drawn dashed",
            "_dashed_under(fig_hit_rate, 'belady')",
        ),
    ],
    "03-capture-and-replay.ipynb": [
        (
            "In the plots belady is the dashed line, drawn under the policies",
            "_dashed_under(fig_captured, 'belady')\n_dashed_under(fig_synthetic, 'belady')",
        ),
    ],
    "04-learned-policy.ipynb": [
        (
            "the episode's metrics must equal the `lru` run's to the last bit",
            "assert same and steps > 0",
        ),
        (
            "Nothing below was used to train or tune the model",
            "for t, seqs, _ in HELD_OUT:\n"
            "    assert t != TRAIN.trace or not set(seqs) & set(TRAIN.sequences)",
        ),
        (
            "the table gives the mean and the standard deviation over them",
            "assert {'hit_rate_mean', 'hit_rate_std', 'sequences'} <= set(table.columns)\n"
            "assert set(table.policy) == {'lru', 'lfu', 'learned', 'belady'}",
        ),
    ],
}


def _prose(nb: object) -> str:
    """A notebook's markdown, whitespace folded (a claim may wrap over lines)."""
    text = " ".join(c.source for c in nb.cells if c.cell_type == "markdown")  # type: ignore[attr-defined]
    return " ".join(text.split())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebooks_import_only_daopsim(path: Path) -> None:
    import re

    nb = nbformat.read(path, as_version=4)
    private = re.compile(
        r"^\s*(from|import)\s+(daopsim\.)?(simulator|policies|hardware_profiles|traces)\b",
        re.MULTILINE,
    )
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not private.search(cell.source), cell.source
    assert path.name in CLAIMS  # every notebook's claims are listed


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebooks_execute(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nbclient import NotebookClient

    # a notebook whose full run takes minutes (04: training) has a quick setting for the tests
    monkeypatch.setenv("DAOPSIM_NOTEBOOK_QUICK", "1")
    if path.name.startswith("03-"):
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    nb = nbformat.read(path, as_version=4)
    prose = _prose(nb)
    claims = CLAIMS[path.name]
    for phrase, _ in claims:
        assert " ".join(phrase.split()) in prose, f"{path.name} no longer says: {phrase!r}"
    checks = "\n".join(f"# claim: {phrase}\n{code}" for phrase, code in claims)
    nb.cells.append(nbformat.v4.new_code_cell(_HELPERS + "\n" + checks))
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError with the cell and traceback on failure
    elapsed = time.perf_counter() - t0
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.get("output_type") == "error"
    ]
    assert not errors
    images = sum(
        1
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if "image/png" in out.get("data", {})
    )
    assert images >= 1, f"{path.name} drew no figure"
    print(f"{path.name}: {elapsed:.1f} s")
