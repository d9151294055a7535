"""Experiment files: the keys beyond daop-paper's (speed-ups on several metrics, an option
tied to each cache ratio, synthetic traces per model, static batches) and their refusals.
(tests/test_daop.py runs the bundled daop-paper experiment.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from daopsim.simulator.errors import UserError
from daopsim.simulator.experiments import (
    bundled_experiments,
    load_experiment,
    lower_is_better,
    run_experiment,
)

BASE = """
name = "t"
hw = "a6000-pcie4"
sequences = 1
cache_ratios = [0.25, 0.375]
target = "lru"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(text)
    return path


def test_speed_ups_on_several_metrics(tmp_path: Path) -> None:
    """The first metric's columns are vs_<baseline>; a duration's speed-up is the baseline's
    time over the target's, a rate's the target's over the baseline's."""
    path = _write(
        tmp_path,
        BASE
        + 'metrics = ["decode_tokens_per_s", "ttft_s", "miss_rate"]\n'
        + '[[models]]\ntrace = "ci-small"\n[policies.lru]\n[policies.static]\n',
    )
    res = run_experiment(path)
    sp = res.speedups()
    assert list(sp.columns) == [
        "model",
        "cache_ratio",
        "vs_static",
        "vs_static:ttft_s",
        "vs_static:miss_rate",
    ]
    ok = res.ok
    for _, row in sp.iterrows():
        at = ok[ok["cache_ratio"] == row["cache_ratio"]].set_index("policy")
        t, b = at.loc["lru"], at.loc["static"]
        assert row["vs_static"] == pytest.approx(
            t["decode_tokens_per_s"] / b["decode_tokens_per_s"]
        )
        assert row["vs_static:ttft_s"] == pytest.approx(b["ttft_s"] / t["ttft_s"])
        assert t["miss_rate"] == pytest.approx(1 - t["hit_rate"])
        assert row["vs_static:miss_rate"] == pytest.approx(b["miss_rate"] / t["miss_rate"])
    assert set(res.summary()["mean_speedups"]) == set(sp.columns[2:])


def test_an_option_follows_the_cache_ratio(tmp_path: Path) -> None:
    """ratio_options sets kTransformers' GPU share to each point's ratio: its runs differ."""
    path = _write(
        tmp_path,
        BASE
        + 'ratio_options = { ktransformers = "gpu_experts_ratio" }\n'
        + '[[models]]\ntrace = "ci-small"\n[policies.lru]\n'
        + '[policies.ktransformers]\nplacement = "front-loading"\n',
    )
    ok = run_experiment(path).ok
    kt = ok[ok["policy"] == "ktransformers"].sort_values("cache_ratio")
    # more experts on the GPU: fewer CPU evaluations
    assert kt["cpu_expert_evals"].tolist()[0] > kt["cpu_expert_evals"].tolist()[1]
    refused = BASE + 'ratio_options = { daop = "x" }\n[[models]]\ntrace = "ci-small"\n'
    with pytest.raises(UserError, match="not under"):
        load_experiment(_write(tmp_path, refused + "[policies.lru]\n"))


def test_synthetic_models_and_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAOPSIM_CACHE", str(tmp_path / "cache"))
    synth = 'synth = { model = "olmoe-1b-7b", sequences = 3, prompt_tokens = 8, output_tokens = 8 }'
    base = BASE.replace("sequences = 1", "sequences = 2")
    text = base + f"[[models]]\n{synth}\n[policies.lru]\n[policies.static]\n"
    alone = run_experiment(_write(tmp_path, text)).ok
    assert set(alone["trace"]) == {"synth:olmoe-1b-7b"} and set(alone["model"]) == {"olmoe-1b-7b"}
    batched = run_experiment(_write(tmp_path, "batch = 2\n" + text)).ok
    # two requests decode together: the same tokens in fewer, larger steps
    assert (batched["tokens_per_s"].to_numpy() != alone["tokens_per_s"].to_numpy()).all()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('metrics = ["tokens_per_sec"]\n', "did you mean 'tokens_per_s'"),
        ("metrics = []\n", "non-empty list"),
        ("batch = 0\n", "positive integer"),
    ],
)
def test_refusals_name_the_file_and_key(tmp_path: Path, extra: str, message: str) -> None:
    path = _write(tmp_path, BASE + extra + '[[models]]\ntrace = "ci-small"\n[policies.lru]\n')
    with pytest.raises(UserError, match=message) as err:
        load_experiment(path)
    assert str(path) in str(err.value)


def test_a_model_gives_a_trace_or_a_synthetic_one(tmp_path: Path) -> None:
    both = '[[models]]\ntrace = "ci-small"\nsynth = { model = "olmoe-1b-7b" }\n[policies.lru]\n'
    with pytest.raises(UserError, match="both 'trace' and 'synth'"):
        load_experiment(_write(tmp_path, BASE + both))
    bad = '[[models]]\nsynth = { model = "olmoe-1b-7b", promt_tokens = 8 }\n[policies.lru]\n'
    with pytest.raises(UserError, match="did you mean 'prompt_tokens'"):
        load_experiment(_write(tmp_path, BASE + bad))


def test_the_papers_experiments_load() -> None:
    """Each 2025-2026 paper's experiment is bundled and valid (its policies, options, metrics)."""
    names = bundled_experiments()
    for name in ("hybrimoe-paper", "dali-paper", "specmd-paper", "cache-conditional-paper",
                 "slicemoe-paper"):  # fmt: skip
        exp = load_experiment(names[name])
        assert exp.target in exp.policies and exp.metrics
    assert lower_is_better("ttft_s") and lower_is_better("miss_rate")
    assert not lower_is_better("tokens_per_s") and not lower_is_better("hit_rate")
