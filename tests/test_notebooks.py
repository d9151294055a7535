"""The notebooks under notebooks/ execute top to bottom (nbclient) and are committed without
outputs. `make notebooks` runs this file."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest

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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebooks_execute(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nbclient import NotebookClient

    # a notebook whose full run takes minutes (04: training) has a quick setting for the tests
    monkeypatch.setenv("DAOPSIM_NOTEBOOK_QUICK", "1")
    if path.name.startswith("03-"):
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    nb = nbformat.read(path, as_version=4)
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
