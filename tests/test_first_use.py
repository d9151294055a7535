"""What a new user runs into first: a missing extra, a misspelt or singular key in a run
config, grid or profile, a fitted synth preset's lengths, where validate's cache goes."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_checks import one_error

import daopsim


def test_learn_without_the_gym_extra_is_one_line(
    cli: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # an import of it fails
    monkeypatch.delitem(sys.modules, "daopsim.simulator.gym_env", raising=False)
    args = ["--trace", "ci-small", "--sequences", "0-1", "--budgets", "4", "--rounds", "1"]
    res = cli("learn", *args, "--epochs", "1", "-o", tmp_path / "m.json", "--no-progress")
    one_error(res, 2, "gym extra", "pip install 'daopsim[gym]'")
    assert not (tmp_path / "m.json").exists()
    # from Python it is still an ImportError
    with pytest.raises(ImportError, match="gym extra"):
        import daopsim.simulator.gym_env  # noqa: F401


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('policies = ["lru"]\ncache_ratio = 0.3\n', "did you mean 'cache_ratios'? (a grid key"),
        ('policy = "lru"\n', "did you mean 'policies'?"),
        ('policies = ["lru"]\ntrace = "ci-small"\n', "did you mean 'traces'?"),
        ('policies = ["lru"]\nsequnces = 1\n', "did you mean 'sequences'"),
    ],
)
def test_a_run_config_key_gets_a_hint(
    cli: Callable[..., Any], tmp_path: Path, text: str, needle: str
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    one_error(cli("run", "--config", path, "--no-progress"), 2, str(path), needle)
    one_error(cli("sweep", path, "--no-progress"), 2, needle)


def test_a_profile_key_gets_a_hint(cli: Callable[..., Any], tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(
        'extends = "a6000-pcie4"\nname = "mine"\ndescription = "d"\n[gpu]\nmemry_gb = 3\n'
    )
    one_error(cli("profiles", "show", path), 2, "gpu.memry_gb", "did you mean 'memory_gb'")
    path.write_text('extends = "a6000-pcie4"\nname = "mine"\ndescription = "d"\n[gppu]\n')
    one_error(cli("profiles", "show", path), 2, "did you mean 'gpu'")


def test_synth_takes_a_fitted_preset_s_lengths(cli: Callable[..., Any], tmp_path: Path) -> None:
    preset = tmp_path / "twin.json"
    preset.write_text(json.dumps({
        "name": "twin", "model": "mixtral-8x7b", "params": {},
        "fit": {"prompt_tokens": 6, "output_tokens": 9},
    }))  # fmt: skip
    out = tmp_path / "twin.parquet"
    res = cli("synth", "--model", "mixtral-8x7b", "--preset", preset, "--sequences", "2",
              "-o", out, "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    counts = daopsim.read_meta(out).counts
    assert (counts["prefill_tokens"], counts["decode_tokens"]) == (12, 18)
    assert json.loads(res.stdout)["prompt_tokens"] == 6
    # a length given on the command line wins
    res = cli("synth", "--model", "mixtral-8x7b", "--preset", preset, "--sequences", "2",
              "--prompt-tokens", "4", "-o", out)  # fmt: skip
    assert res.exit_code == 0, res.output
    counts = daopsim.read_meta(out).counts
    assert (counts["prefill_tokens"], counts["decode_tokens"]) == (8, 18)
    assert "output tokens 9, as the preset was fitted" in res.stdout


def test_validate_says_where_its_cache_is(
    cli: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DAOPSIM_CACHE", str(tmp_path))
    res = cli("validate", "--rows", "daop-readme-a6000-mixtral", "--no-progress")
    assert res.exit_code in (0, 1), res.output
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith(f"synthetic traces are cached in {tmp_path / 'validation'}")
    assert "GB" in last and "DAOPSIM_CACHE" in last
