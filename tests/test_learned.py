"""The ``learned`` policy and ``daopsim learn``: a model file trained, written, loaded and played.

The policy plays the scorer's choices exactly as the environment's scorer agent does; the
command trains reproducibly, writes its file atomically and refuses bad input in one line; a
broken model file is named with its field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result

from daopsim.gym import ExpertCacheEnv, LearnConfig, learn, run_agent, scorer_action
from daopsim.policies.learned import BUNDLED_MODEL, Scorer
from daopsim.policies.registry import make_policy
from daopsim.simulator.errors import UserError
from daopsim.simulator.runner import simulate

RUN = {"trace": "ci-small", "hw": "a100-80g-pcie4", "gpu_experts": 4 * 32}
#: a quick training: one ci-small sequence, one budget, two rounds
QUICK = LearnConfig(trace="ci-small", sequences=[0], budgets=[4], rounds=2, epochs=3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    result = learn(QUICK)
    path = tmp_path_factory.mktemp("model") / "model.json"
    path.write_text(json.dumps(result.scorer.to_dict()))
    return path, result


def test_learn_is_reproducible_and_records_its_rounds(trained: tuple[Path, Any]) -> None:
    path, result = trained
    again = learn(QUICK)
    assert json.dumps(again.scorer.to_dict()) == path.read_text()
    assert [r["rolled_out"] for r in result.rounds] == ["belady", "learned"]
    assert result.rounds[0]["rollout_agreement"] == 1.0
    assert result.rounds[1]["data"] > result.rounds[0]["data"] > 0
    assert result.scorer.trained["sequences"] == [0]


def test_the_policy_plays_the_scorer_agents_choices(trained: tuple[Path, Any]) -> None:
    path, _ = trained
    env = ExpertCacheEnv(**RUN, oracle=False)
    _, _, result = run_agent(env, scorer_action(Scorer.load(path)), options={"sequences": [2, 3]})
    ref = simulate(
        policy="learned", policy_options={"model": str(path)}, evaluate=[2, 3], record=False, **RUN
    )
    for k, v in ref.metrics.items():
        w = result.metrics[k]
        assert v == w or (math.isnan(v) and math.isnan(w)), k


def test_the_bundled_model_sits_between_lru_and_belady_on_held_out_sequences() -> None:
    # the bundled model was trained on Mixtral sequences 0-3 (its file says so); 4-7 are unseen
    trained_on = Scorer.load(BUNDLED_MODEL).trained
    assert trained_on["trace"] == "mixtral-8x7b" and trained_on["sequences"] == [0, 1, 2, 3]
    run = {"trace": "mixtral-8x7b", "hw": "a100-80g-pcie4", "gpu_experts": 4 * 32}
    hits = {
        p: simulate(policy=p, evaluate=[5], record=False, **run).metrics["hit_rate"]
        for p in ("lru", "learned", "belady")
    }
    assert hits["lru"] < hits["learned"] < hits["belady"]


def test_cli_learn_then_run(cli: Callable[..., Result], tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    r = cli("learn", "--trace", "ci-small", "--sequences", "0-1", "--budgets", "4", "--rounds",
            "1", "--epochs", "2", "-o", out, "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["path"] == str(out) and doc["rounds"][0]["decisions"] > 0
    Scorer.load(out)
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed into place
    r = cli("run", "--policy", "learned", "--policy-opt", f"model={out}", "--trace", "ci-small",
            "--sequences", "1", "--hw", "a100-80g-pcie4", "--gpu-experts", "128",
            "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["policy_options"]["model"] == str(out)


def test_cli_learn_refuses_bad_input_without_writing(
    cli: Callable[..., Result], tmp_path: Path
) -> None:
    out = tmp_path / "m.json"
    for args, needle in (
        (("--budgets", "2"), "more than top-k"),
        (("--sequences", "0-x"), "--sequences"),
        (("--sequences", "99"), "no sequence 99"),
        (("--rounds", "0"), "--rounds"),
    ):
        r = cli("learn", "--trace", "ci-small", *args, "-o", out)
        assert r.exit_code == 2, (args, r.output)
        assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert not out.exists()
    r = cli("learn", "-o", tmp_path / "m.txt")
    assert r.exit_code == 2 and ".json" in r.stderr


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.pop("w1"), "w1"),
        (lambda d: d.update(format="other/1"), "format"),
        (lambda d: d.update(features=["x"]), "features"),
        (lambda d: d.update(b1=[0.0]), "w1"),
        (lambda d: d.update(scale=[0.0] * len(d["mean"])), "scale"),
        (lambda d: d.update(b2="x"), "b2"),
    ],
)
def test_a_broken_model_file_is_named_with_its_field(
    tmp_path: Path, edit: Callable[[dict[str, Any]], Any], field: str
) -> None:
    doc = json.loads(BUNDLED_MODEL.read_text())
    edit(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(UserError, match=rf"bad\.json: field {field}"):
        make_policy("learned", {"model": str(bad)})


def test_missing_or_unreadable_model_file(cli: Callable[..., Result], tmp_path: Path) -> None:
    r = cli("run", "--policy", "learned", "--policy-opt", f"model={tmp_path / 'no.json'}",
            "--trace", "ci-small", "--sequences", "1")  # fmt: skip
    assert r.exit_code == 2 and "no.json: model file not found" in r.stderr
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(UserError, match=r"x\.json: not a readable JSON"):
        make_policy("learned", {"model": str(tmp_path / "x.json")})


def test_the_typed_network_scores_as_the_formula_and_picks_the_same_victim() -> None:
    """The policy scores in typed loops (``Net``, compiled as C): its scores equal the
    network's formula in numpy to rounding, and its pick over a layer's candidates (whose
    last features are shared) is exactly the best of the rows scored one by one, the first
    on ties."""
    import numpy as np

    from daopsim.policies.learned import Net

    sc = Scorer.load(BUNDLED_MODEL)
    net = sc.net
    assert isinstance(net, Net)
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(2, 12))
        x = rng.normal(sc.mean, sc.scale * 2.0, size=(n, len(sc.mean)))
        x[:, 5:] = x[0, 5:]  # phase, layer and quota: the same for a layer's candidates
        if rng.random() < 0.3:
            x[1] = x[0]  # a tie: the first wins
        formula = np.tanh(((x - sc.mean) / sc.scale) @ sc.w1 + sc.b1) @ sc.w2 + sc.b2
        alone = [net.score(row) for row in x.tolist()]
        np.testing.assert_allclose(alone, formula, rtol=1e-12, atol=1e-12)
        assert net.best(x.tolist()) == int(np.argmax(alone))
        assert list(sc.scores(x)) == alone


def test_the_policy_pick_over_fed_features_is_the_networks_best_row() -> None:
    """``Pick`` (what the policy scores with, fed the features one by one as floats) chooses
    exactly the row ``Net.best`` chooses from the same features as rows, the first on ties."""
    import numpy as np

    from daopsim.policies.learned import Pick

    sc = Scorer.load(BUNDLED_MODEL)
    pick = Pick(sc.net)
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 10))
        x = rng.normal(sc.mean, sc.scale * 2.0, size=(n, len(sc.mean)))
        x[:, 5:] = x[0, 5:]
        if n > 1 and rng.random() < 0.3:
            x[-1] = x[0]  # a tie with the first: the first wins
        rows = x.tolist()
        pick.layer(rows[0][5], rows[0][6], rows[0][7])
        for row in rows:
            pick.expert(row[0], row[1], row[2], row[3], row[4])
        assert pick.best == sc.net.best(rows)
        assert pick.top == sc.net.score(rows[pick.best])


def test_remembered_decay_factors_and_log_ages_are_the_functions_values() -> None:
    """The policy's tables of decay factors and log ages give exactly ``math.pow`` and
    ``math.log1p`` of the same arguments, inside the table, past its end and below 0."""
    from daopsim.policies.observed import _DECAY, DECAY_TABLE

    pol: Any = make_policy("learned", {})
    pol.decay_table, pol.log_table = [], []
    for d in [5, 0, 3, 17, 4103, 2, DECAY_TABLE - 1, DECAY_TABLE, DECAY_TABLE + 7, -1, -3]:
        assert pol.decay_factor(d) == math.pow(_DECAY, float(d)), d
        if d > -1:
            assert pol.log_age(d) == math.log1p(d), d
    assert len(pol.decay_table) == len(pol.log_table) == DECAY_TABLE
