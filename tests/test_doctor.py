"""``daopsim doctor``: the installation as it is: version, build and why, cache and extras."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import daopsim
from daopsim.simulator.native import status


def test_doctor_reports_this_installation(
    cli: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DAOPSIM_CACHE", str(tmp_path))
    folder = tmp_path / "validation"
    folder.mkdir()
    (folder / "a.parquet").write_bytes(b"x" * 1000)
    (folder / "b.parquet").write_bytes(b"y" * 234)
    res = cli("doctor", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["version"] == daopsim.__version__
    build = status()
    assert doc["build"] == {
        "state": build.state,
        "describe": build.describe(),
        "interpreted": dict(build.interpreted),
        "pure_python_env": doc["build"]["pure_python_env"],
    }
    assert doc["cache"]["path"] == str(folder) and doc["cache"]["env"] == "DAOPSIM_CACHE"
    assert (doc["cache"]["files"], doc["cache"]["bytes"]) == (2, 1234)
    extras = {e["extra"]: e for e in doc["extras"]}
    assert set(extras) == {"capture", "dask", "gym", "notebook", "dev"}
    assert extras["gym"]["installed"] == all(
        __import__("importlib").util.find_spec(m) is not None for m in ("gymnasium", "greenlet")
    )
    text = cli("doctor")
    assert text.exit_code == 0
    assert f"daopsim {daopsim.__version__}" in text.stdout
    assert (
        build.describe() in text.stdout and str(folder) in text.stdout and "2 files" in text.stdout
    )


def test_a_missing_extra_says_how_to_install_it(
    cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # as if not installed
    import importlib.util

    real = importlib.util.find_spec

    def hidden(name: str, *a: Any) -> Any:
        return None if name == "gymnasium" else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    res = cli("doctor")
    assert res.exit_code == 0, res.output
    assert "no  gym" in res.stdout and "pip install 'daopsim[gym]'" in res.stdout
    assert "gymnasium missing" in res.stdout
