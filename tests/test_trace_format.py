"""The trace format: round trips, storage rules, atomic writing, streaming, info and listing."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from daopsim.simulator.testing import make_meta, make_trace, random_routing, tiny_model
from daopsim.simulator.trace_format import DEFAULT_TOP_M, META_KEY
from daopsim.simulator.trace_read import iter_sequences, load_sequences, read_meta, validate_trace
from daopsim.simulator.trace_write import TraceWriter, write_trace


def _routings(model: Any, n: int, seed: int = 0, width: int | None = None) -> list[Any]:
    rng = np.random.default_rng(seed)
    return [random_routing(model, s, 3 + s, 4, rng, probs_stored=width) for s in range(n)]


def test_round_trip_all_probs(tmp_path: Path) -> None:
    model = tiny_model()
    meta = make_meta(model)
    written = _routings(model, 3)
    path = write_trace(tmp_path / "t.parquet", meta, written)
    back = list(iter_sequences(path))
    assert [r.seq_id for r in back] == [0, 1, 2]
    for w, r in zip(written, back, strict=True):
        assert r.n_prefill == w.n_prefill and r.n_decode == w.n_decode
        np.testing.assert_array_equal(r.positions, w.positions)
        np.testing.assert_array_equal(r.experts, w.experts)
        np.testing.assert_allclose(r.weights, w.weights, rtol=1e-6)
        # probabilities are stored as float16
        np.testing.assert_allclose(r.probs, w.probs, atol=1e-3)
        assert r.prob_ids is None and r.probs.shape[2] == model.experts
        np.testing.assert_array_equal(r.early_experts[:, 1:], w.early_experts[:, 1:])
        assert (r.early_experts[:, 0] == -1).all() and np.isnan(r.early_probs[:, 0]).all()
        assert r.experts.shape == (w.n_tokens, model.moe_layers, model.top_k)


def test_rows_are_sequence_position_layer_ordered(tmp_path: Path) -> None:
    path = make_trace(tmp_path / "t.parquet", sequences=2, prefill=2, decode=3)
    table = pq.read_table(path, columns=["seq", "pos", "layer", "phase"])
    seq = table["seq"].to_numpy()
    pos = table["pos"].to_numpy()
    layer = table["layer"].to_numpy()
    assert len(seq) == 2 * 5 * 4
    key = seq.astype(np.int64) * 10_000 + pos * 100 + layer
    assert (np.diff(key) > 0).all()
    phases = table["phase"].to_pylist()
    assert phases[:8] == ["prefill"] * 8 and phases[8:20] == ["decode"] * 12
    early = pq.read_table(path, columns=["early_experts"])["early_experts"]
    assert early.null_count == 2 * 5  # layer 0 of every token has no one-layer-early view


def test_top_m_storage_above_128_experts(tmp_path: Path) -> None:
    model = tiny_model(experts=160, top_k=4, moe_layers=2)
    meta = make_meta(model)
    assert meta.top_m and meta.probs_stored == DEFAULT_TOP_M == 32  # the one default
    path = write_trace(tmp_path / "t.parquet", meta, _routings(model, 2, width=DEFAULT_TOP_M))
    schema = pq.read_schema(path)
    assert "prob_ids" in schema.names and "early_prob_ids" in schema.names
    r = next(iter_sequences(path))
    assert r.prob_ids is not None and r.prob_ids.shape == (r.n_tokens, 2, DEFAULT_TOP_M)
    dense = r.full_probs(model.experts)
    assert dense.shape == (r.n_tokens, 2, 160)
    # the selected experts are among the stored top-m, with their stored probability
    chosen = np.take_along_axis(dense, r.experts.astype(np.int64), axis=-1)
    assert (chosen > 0).all()
    assert validate_trace(path).probs_stored == DEFAULT_TOP_M


def test_all_probs_up_to_128_experts(tmp_path: Path) -> None:
    meta = make_meta(tiny_model(experts=128, top_k=8))
    assert not meta.top_m and meta.probs_stored == 128


def test_metadata_keys(tmp_path: Path) -> None:
    path = make_trace(tmp_path / "t.parquet", sequences=2, prefill=2, decode=3, seed=4)
    raw = json.loads(pq.read_metadata(path).metadata[META_KEY])
    assert set(raw) == {
        "schema_version",
        "model",
        "provenance",
        "counts",
        "probs_stored",
        "moe_layer_ids",
        "calibration_sequences",
    }
    assert raw["schema_version"] == 1  # no version-2 feature used: written as version 1
    assert raw["counts"] == {"rows": 40, "sequences": 2, "prefill_tokens": 4, "decode_tokens": 6}
    assert raw["provenance"]["seed"] == 4
    assert "numpy" in raw["provenance"]["tool_versions"] and raw["provenance"]["created"]
    meta = read_meta(path)
    assert meta.model == tiny_model()
    assert meta.moe_layer_ids == [0, 1, 2, 3]


def test_writer_is_atomic(tmp_path: Path) -> None:
    model = tiny_model()
    target = tmp_path / "t.parquet"
    with pytest.raises(RuntimeError), TraceWriter(target, make_meta(model)) as w:
        w.write_sequence(_routings(model, 1)[0])
        raise RuntimeError("generator died")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_writer_replaces_old_file_only_on_success(tmp_path: Path) -> None:
    target = make_trace(tmp_path / "t.parquet", sequences=1)
    before = target.read_bytes()
    model = tiny_model()
    with (
        pytest.raises(ValueError, match="written twice"),
        TraceWriter(target, make_meta(model)) as w,
    ):
        r = _routings(model, 1)[0]
        w.write_sequence(r)
        w.write_sequence(r)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]


def test_written_file_has_normal_permissions(tmp_path: Path) -> None:
    path = make_trace(tmp_path / "t.parquet", sequences=1)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_row_groups_are_bounded_and_span_sequences(tmp_path: Path) -> None:
    # 5 sequences of 10 tokens x 4 layers = 40 rows each; groups of 64 rows
    path = make_trace(tmp_path / "t.parquet", sequences=5, prefill=4, decode=6, row_group_rows=64)
    md = pq.read_metadata(path)
    sizes = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
    assert sizes == [64, 64, 64, 8]
    assert [r.n_tokens for r in iter_sequences(path, batch_rows=16)] == [10] * 5
    validate_trace(path)


def test_iter_sequences_subset_and_load(tmp_path: Path) -> None:
    path = make_trace(tmp_path / "t.parquet", sequences=4, prefill=2, decode=2)
    assert [r.seq_id for r in iter_sequences(path, sequences={1, 3})] == [1, 3]
    meta, seqs = load_sequences(path, sequences={2})
    assert meta.counts["sequences"] == 4 and [r.seq_id for r in seqs] == [2]


def test_trace_readable_with_pandas(tmp_path: Path) -> None:
    import pandas as pd

    path = make_trace(tmp_path / "t.parquet", sequences=1, prefill=2, decode=2)
    df = pd.read_parquet(path)
    assert list(df.columns[:4]) == ["seq", "pos", "phase", "layer"]
    assert len(df) == 16 and len(df["experts"].iloc[0]) == 2


def test_cli_info(tmp_path: Path, cli: Callable[..., Any]) -> None:
    path = make_trace(tmp_path / "t.parquet", sequences=2, prefill=2, decode=3, seed=3)
    result = cli("trace", "info", path)
    assert result.exit_code == 0, result.output
    assert "tiny" in result.stdout and "all experts (8 per row)" in result.stdout
    assert "2 sequences" in result.stdout and "provenance seed: 3" in result.stdout
    data = json.loads(cli("trace", "info", path, "--json").stdout)
    assert data["model"]["experts"] == 8 and data["model"]["top_k"] == 2
    assert data["counts"]["decode_tokens"] == 6
    assert data["probs_stored"] == 8 and data["probs_storage"] == "all experts"
    assert data["provenance"]["generator"] == "daopsim.simulator.testing.make_trace"


def test_cli_validate_json(tmp_path: Path, cli: Callable[..., Any]) -> None:
    path = make_trace(tmp_path / "t.parquet", sequences=1, prefill=2, decode=3)
    data = json.loads(cli("trace", "validate", path, "--json").stdout)
    assert data["valid"] is True and data["counts"]["rows"] == 20


def test_cli_help(cli: Callable[..., Any]) -> None:
    for args in (["trace", "--help"], ["trace", "stats", "--help"], ["traces", "list", "--help"]):
        result = cli(*args)
        assert result.exit_code == 0 and "Usage" in result.stdout


def test_traces_list_none_bundled(cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("daopsim.simulator.commands.traces_cmd.bundled_traces", lambda: {})
    result = cli("traces", "list")
    assert result.exit_code == 0 and "no bundled traces" in result.stdout
    assert json.loads(cli("traces", "list", "--json").stdout) == []


def test_traces_list_reads_metadata(
    tmp_path: Path, cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    good = make_trace(tmp_path / "small.parquet", sequences=2, prefill=3, decode=5)
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    monkeypatch.setattr(
        "daopsim.simulator.commands.traces_cmd.bundled_traces",
        lambda: {"small": good, "broken": broken},
    )
    rows = json.loads(cli("traces", "list", "--json").stdout)
    small = next(r for r in rows if r["name"] == "small")
    assert small["model"] == "tiny" and small["sequences"] == 2 and small["tokens"] == 16
    assert small["source"] == "synthetic"
    assert "not a readable Parquet" in next(r for r in rows if r["name"] == "broken")["error"]
    text = cli("traces", "list")
    assert text.exit_code == 0 and "small" in text.stdout and "unreadable" in text.stdout


def test_traces_list_real_bundle(cli: Callable[..., Any]) -> None:
    result = cli("traces", "list", "--json")
    assert result.exit_code == 0
    for row in json.loads(result.stdout):
        assert "error" not in row, row


def test_trace_commands_accept_bundled_names(
    tmp_path: Path, cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_trace(tmp_path / "small.parquet", sequences=1, prefill=2, decode=2)
    monkeypatch.setattr("daopsim.simulator.data.bundled_traces", lambda: {"small": path})
    monkeypatch.chdir(tmp_path)
    for command in ("validate", "info", "stats"):
        result = cli("trace", command, "small")
        assert result.exit_code == 0, result.output
        assert str(path) in result.stdout
    missing = cli("trace", "info", "other")
    assert missing.exit_code == 2 and "unknown trace 'other'" in missing.stderr
    assert "(small)" in missing.stderr  # the bundled names, as run --trace lists them


# --- version 2: what a trace may leave out ----------------------------------------------------


def test_version_2_round_trip_without_view_weights_probs(tmp_path: Path) -> None:
    import dataclasses

    model = tiny_model()
    meta = dataclasses.replace(
        make_meta(model),
        early_view_recorded=False,
        weights_recorded=False,
        probs_stored=0,
        filled_column=True,
    )
    written = _routings(model, 2)
    filled = np.zeros(written[0].experts.shape[:2], dtype=bool)
    filled[1, 2] = True
    written[0] = dataclasses.replace(written[0], filled=filled)
    path = write_trace(tmp_path / "v2.parquet", meta, written)
    cols = set(pq.read_schema(path).names)
    assert cols == {"seq", "pos", "phase", "layer", "experts", "filled"}
    raw = json.loads(pq.read_metadata(path).metadata[META_KEY])
    assert raw["schema_version"] == 2 and raw["early_view_recorded"] is False
    assert raw["counts"]["missing_token_layers"] == 1
    back = validate_trace(path)
    assert back.format_version() == 2 and not back.probs_recorded
    r0, r1 = iter_sequences(path)
    np.testing.assert_array_equal(r0.experts, written[0].experts)
    assert r0.filled is not None and r0.filled.sum() == 1 and r0.filled[1, 2]
    assert r1.filled is not None and not r1.filled.any()
    assert not (r0.early_recorded or r0.weights_recorded or r0.probs_recorded)
    np.testing.assert_allclose(r0.weights, 0.5)
    dense = r0.full_probs(model.experts)
    np.testing.assert_allclose(dense.sum(axis=-1), 1.0)
    assert (np.take_along_axis(dense, r0.experts.astype(np.int64), axis=-1) == 0.5).all()


def test_top_m_storage_accepted_for_small_models(tmp_path: Path) -> None:
    # the docs and the validator agree: top-m with ids is valid for any E, not only E > 128
    path = make_trace(tmp_path / "m.parquet", top_m=3, sequences=1)
    meta = validate_trace(path)
    assert meta.top_m and meta.probs_stored == 3 and meta.format_version() == 1


def test_previous_token_view() -> None:
    from daopsim.simulator.trace_format import previous_token_view

    r = _routings(tiny_model(), 1)[0]
    v = previous_token_view(r)
    assert (v.early_experts[0] == -1).all() and (v.early_experts[:, 0] == -1).all()
    np.testing.assert_array_equal(v.early_experts[1:, 1:], r.experts[:-1, 1:])
    np.testing.assert_array_equal(v.early_probs[1:, 1:], r.probs[:-1, 1:])
    assert r.early_experts is not v.early_experts  # a copy: the input is unchanged
