"""Bad traces: every case gives one TraceError line (file, row, column) and CLI exit 2."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daopsim.simulator.data import bundled_traces
from daopsim.simulator.errors import TraceError
from daopsim.simulator.testing import make_meta, make_trace, random_routing, tiny_model
from daopsim.simulator.trace_format import DEFAULT_TOP_M, META_KEY
from daopsim.simulator.trace_read import read_meta, validate_trace
from daopsim.simulator.trace_write import write_trace

# The fixture every case starts from: tiny model (4 layers, 8 experts, top-2), 2 sequences of
# 3 prefill + 3 decode tokens, so row = (seq * 6 + token) * 4 + layer.
LAYERS, EXPERTS, K, TOKENS = 4, 8, 2, 6


def row_of(seq: int, token: int, layer: int) -> int:
    return (seq * TOKENS + token) * LAYERS + layer


def good_trace(tmp_path: Path) -> Path:
    return make_trace(tmp_path / "good.parquet", sequences=2, prefill=3, decode=3, seed=5)


def rewrite(
    src: Path,
    dst: Path,
    mutate: Callable[[dict[str, list[Any]]], None] | None = None,
    schema: pa.Schema | None = None,
    meta: Callable[[dict[str, Any]], None] | None = None,
    drop_meta: bool = False,
) -> Path:
    """Copy a trace through Python lists, applying a change to columns and/or metadata."""
    table = pq.read_table(src)
    data = table.to_pydict()
    if mutate:
        mutate(data)
    footer = json.loads(pq.read_metadata(src).metadata[META_KEY])
    if meta:
        meta(footer)
    # nullable, so a test can put a null where the format forbids one
    base = schema or table.schema.remove_metadata()
    out_schema = pa.schema([f.with_nullable(True) for f in base])
    out = pa.table({n: data[n] for n in out_schema.names}, schema=out_schema)
    if not drop_meta:
        out = out.replace_schema_metadata({META_KEY: json.dumps(footer).encode()})
    pq.write_table(out, dst)
    return dst


def expect_error(
    cli: Callable[..., Any],
    path: Path,
    row: int | None = None,
    column: str | None = None,
    words: str = "",
) -> TraceError:
    """The API raises TraceError with these fields; the CLI prints one line and exits 2."""
    with pytest.raises(TraceError) as info:
        validate_trace(path)
    err = info.value
    assert err.path == str(path)
    assert err.row == row
    assert err.column == column
    assert words.lower() in str(err).lower(), str(err)
    assert "\n" not in str(err)
    result = cli("trace", "validate", path)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert str(path) in lines[0]
    if row is not None:
        assert f"row {row}" in lines[0]
    if column is not None:
        assert repr(column) in lines[0]
    assert "Traceback" not in result.output + result.stderr
    assert result.stdout == ""
    return err


def test_good_trace_passes(tmp_path: Path, cli: Callable[..., Any]) -> None:
    path = good_trace(tmp_path)
    meta = validate_trace(path)
    assert meta.counts == {"rows": 48, "sequences": 2, "prefill_tokens": 6, "decode_tokens": 6}
    result = cli("trace", "validate", path)
    assert result.exit_code == 0
    assert result.stdout.startswith("OK ")
    assert "2 sequences" in result.stdout and "48 rows" in result.stdout


def test_missing_file(tmp_path: Path, cli: Callable[..., Any]) -> None:
    expect_error(cli, tmp_path / "nope.parquet", words="no such file")


def test_directory_is_not_a_trace(tmp_path: Path, cli: Callable[..., Any]) -> None:
    expect_error(cli, tmp_path, words="directory")


def test_not_parquet(tmp_path: Path, cli: Callable[..., Any]) -> None:
    path = tmp_path / "notes.parquet"
    path.write_text("seq,pos,layer\n0,0,0\n")
    expect_error(cli, path, words="not a readable Parquet file")


def test_empty_file(tmp_path: Path, cli: Callable[..., Any]) -> None:
    path = tmp_path / "empty.parquet"
    path.write_bytes(b"")
    expect_error(cli, path, words="not a readable Parquet file")


def test_truncated_file(tmp_path: Path, cli: Callable[..., Any]) -> None:
    data = good_trace(tmp_path).read_bytes()
    path = tmp_path / "cut.parquet"
    path.write_bytes(data[: len(data) // 2])
    expect_error(cli, path, words="not a readable Parquet file")


def test_missing_column(tmp_path: Path, cli: Callable[..., Any]) -> None:
    src = good_trace(tmp_path)
    schema = pq.read_schema(src).remove_metadata()
    schema = schema.remove(schema.get_field_index("weights"))
    path = rewrite(src, tmp_path / "bad.parquet", schema=schema)
    expect_error(cli, path, column="weights", words="missing column")


def test_mistyped_list_column(tmp_path: Path, cli: Callable[..., Any]) -> None:
    src = good_trace(tmp_path)
    schema = pq.read_schema(src).remove_metadata()
    i = schema.get_field_index("experts")
    schema = schema.set(i, pa.field("experts", pa.list_(pa.float32())))
    path = rewrite(src, tmp_path / "bad.parquet", schema=schema)
    expect_error(cli, path, column="experts", words="expected list<item: int16>")


def test_mistyped_scalar_column(tmp_path: Path, cli: Callable[..., Any]) -> None:
    src = good_trace(tmp_path)
    schema = pq.read_schema(src).remove_metadata()
    schema = schema.set(schema.get_field_index("layer"), pa.field("layer", pa.string()))

    def to_text(d: dict[str, list[Any]]) -> None:
        d["layer"] = [str(v) for v in d["layer"]]

    path = rewrite(src, tmp_path / "bad.parquet", to_text, schema=schema)
    expect_error(cli, path, column="layer", words="has type string")


def _set(column: str, row: int, value: Any) -> Callable[[dict[str, list[Any]]], None]:
    def mutate(d: dict[str, list[Any]]) -> None:
        d[column][row] = value

    return mutate


def test_expert_id_out_of_range(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(1, 2, 3)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", _set("experts", row, [0, 8]))
    expect_error(cli, path, row=row, column="experts", words="expert id 8 outside 0..7")


def test_negative_expert_id(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(0, 0, 0)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", _set("experts", row, [-3, 1]))
    expect_error(cli, path, row=row, column="experts", words="outside 0..7")


def test_repeated_expert_in_top_k(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(0, 4, 2)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", _set("experts", row, [5, 5]))
    expect_error(cli, path, row=row, column="experts", words="repeated")


def test_wrong_k(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(1, 0, 1)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", _set("experts", row, [1, 2, 3]))
    expect_error(cli, path, row=row, column="experts", words="has 3 values, expected 2")


def test_wrong_weight_count(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(0, 1, 0)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", _set("weights", row, [1.0]))
    expect_error(cli, path, row=row, column="weights", words="has 1 values, expected 2")


def test_wrong_probs_count(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(0, 3, 3)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", _set("probs", row, [0.5] * 7))
    expect_error(cli, path, row=row, column="probs", words="expected 8")


def test_nan_weight(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(1, 5, 2)
    path = rewrite(
        good_trace(tmp_path), tmp_path / "bad.parquet", _set("weights", row, [math.nan, 0.5])
    )
    expect_error(cli, path, row=row, column="weights", words="NaN")


def test_negative_weight(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(0, 2, 1)
    path = rewrite(
        good_trace(tmp_path), tmp_path / "bad.parquet", _set("weights", row, [0.9, -0.1])
    )
    expect_error(cli, path, row=row, column="weights", words="negative")


def test_probability_out_of_range(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(0, 0, 2)
    path = rewrite(
        good_trace(tmp_path), tmp_path / "bad.parquet", _set("probs", row, [2.0] + [0.0] * 7)
    )
    expect_error(cli, path, row=row, column="probs", words="outside [0, 1]")


def test_null_value(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(1, 1, 1)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", _set("weights", row, None))
    expect_error(cli, path, row=row, column="weights", words="is null")


def test_null_inside_list(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(1, 3, 0)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", _set("experts", row, [1, None]))
    expect_error(cli, path, row=row, column="experts", words="null value")


def test_positions_not_increasing(tmp_path: Path, cli: Callable[..., Any]) -> None:
    def mutate(d: dict[str, list[Any]]) -> None:
        # token 4 of sequence 1 gets position 2 (token 3 has position 3)
        for layer in range(LAYERS):
            d["pos"][row_of(1, 4, layer)] = 2

    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", mutate)
    expect_error(cli, path, row=row_of(1, 4, 0), column="pos", words="not increasing")


def test_position_changes_within_token(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(0, 2, 3)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", _set("pos", row, 9))
    expect_error(cli, path, row=row, column="pos", words="position changes")


def test_layer_out_of_range(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(1, 2, 3)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", _set("layer", row, 4))
    expect_error(cli, path, row=row, column="layer", words="layer 4 outside 0..3")


def test_layer_missing_from_token(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(0, 1, 2)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", _set("layer", row, 1))
    expect_error(cli, path, row=row, column="layer", words="expected layer 2")


def test_bad_phase(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(0, 0, 0)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", _set("phase", row, "train"))
    expect_error(cli, path, row=row, column="phase", words="'train'")


def test_prefill_after_decode(tmp_path: Path, cli: Callable[..., Any]) -> None:
    def mutate(d: dict[str, list[Any]]) -> None:
        for layer in range(LAYERS):
            d["phase"][row_of(0, 5, layer)] = "prefill"

    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", mutate)
    expect_error(cli, path, row=row_of(0, 5, 0), column="phase", words="prefill token follows")


def test_missing_early_view(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(1, 0, 2)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", _set("early_experts", row, None))
    expect_error(cli, path, row=row, column="early_experts", words="missing")


def _swap(column: str, row: int) -> Callable[[dict[str, list[Any]]], None]:
    """Reverse one row's top-k list (rank 0 becomes the last)."""

    def mutate(d: dict[str, list[Any]]) -> None:
        d[column][row] = list(reversed(d[column][row]))

    return mutate


def _rank_columns(columns: Any) -> Callable[[dict[str, Any]], None]:
    def change(footer: dict[str, Any]) -> None:
        footer["provenance"]["rank_order_columns"] = columns

    return change


def test_weights_out_of_rank_order(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(1, 4, 2)
    path = rewrite(
        good_trace(tmp_path), tmp_path / "bad.parquet", _set("weights", row, [0.25, 0.75])
    )
    expect_error(
        cli,
        path,
        row=row,
        column="weights",
        words="not in rank order: gate weight at rank 1 (0.75) exceeds rank 0 (0.25)",
    )


def test_rank_order_allows_ties_and_rounding(tmp_path: Path) -> None:
    def mutate(d: dict[str, list[Any]]) -> None:
        d["weights"][row_of(0, 1, 1)] = [0.5, 0.5]
        d["weights"][row_of(0, 2, 1)] = [0.4, 0.4000001]  # float32 rounding, not an inversion

    validate_trace(rewrite(good_trace(tmp_path), tmp_path / "ties.parquet", mutate))


def test_experts_out_of_probability_order(tmp_path: Path, cli: Callable[..., Any]) -> None:
    # a trace whose weights do not follow the selection score (PhiMoE's sparsemixer) is
    # checked by the router probabilities of its experts instead
    src = rewrite(
        good_trace(tmp_path),
        tmp_path / "probs.parquet",
        _swap("weights", row_of(0, 0, 1)),
        meta=_rank_columns(["probs"]),
    )
    validate_trace(src)  # out-of-order weights are allowed when the trace says so
    row = row_of(1, 2, 3)
    path = rewrite(src, tmp_path / "bad.parquet", _swap("experts", row))
    expect_error(cli, path, row=row, column="experts", words="router probability at rank 1")


def test_early_experts_out_of_rank_order(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(0, 5, 1)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", _swap("early_experts", row))
    expect_error(cli, path, row=row, column="early_experts", words="not in rank order")


def test_rank_order_not_checkable_is_skipped(tmp_path: Path) -> None:
    # e.g. DeepSeek-V3: selection on sigmoid + bias, which no stored column carries
    def mutate(d: dict[str, list[Any]]) -> None:
        for column in ("experts", "weights", "early_experts"):
            _swap(column, row_of(1, 1, 2))(d)

    path = rewrite(good_trace(tmp_path), tmp_path / "any.parquet", mutate, meta=_rank_columns([]))
    validate_trace(path)


def test_bad_rank_order_columns(tmp_path: Path, cli: Callable[..., Any]) -> None:
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", meta=_rank_columns(["gates"]))
    expect_error(cli, path, words="'provenance.rank_order_columns' must be a list of")


def test_rank_order_by_top_m_probabilities(tmp_path: Path, cli: Callable[..., Any]) -> None:
    model = tiny_model(experts=160, top_k=4, moe_layers=2)
    meta = make_meta(model, provenance={"source": "test", "rank_order_columns": ["probs"]})
    r = random_routing(model, 0, 3, 2, np.random.default_rng(3), probs_stored=meta.probs_stored)
    path = write_trace(tmp_path / "ok.parquet", meta, [r])
    validate_trace(path)
    # rank 0 becomes an expert outside the stored top-m: below every stored probability
    assert r.prob_ids is not None
    outside = next(e for e in range(160) if e not in r.prob_ids[2, 1])
    r.experts[2, 1, 0] = outside
    path = write_trace(tmp_path / "bad.parquet", meta, [r])
    expect_error(cli, path, row=2 * 2 + 1, column="experts", words="rank 1")


@pytest.mark.parametrize("name", sorted(bundled_traces()))
def test_bundled_traces_are_in_rank_order(name: str, cli: Callable[..., Any]) -> None:
    result = cli("trace", "validate", name)
    assert result.exit_code == 0, result.output


def test_synthetic_top_m_trace_is_in_rank_order(tmp_path: Path) -> None:
    from daopsim.simulator.synth import write_synthetic
    from daopsim.simulator.synth_params import SynthParams

    path = tmp_path / "v3.parquet"
    meta = write_synthetic(path, "deepseek-v3", SynthParams(), 2, 6, 6, seed=3)
    assert meta.probs_stored == DEFAULT_TOP_M  # the one default top-m
    assert "rank_order_columns" not in meta.provenance  # so both weights and probs are checked
    validate_trace(path)


def test_sequence_split_in_two_runs(tmp_path: Path, cli: Callable[..., Any]) -> None:
    def mutate(d: dict[str, list[Any]]) -> None:
        # token 2 of sequence 0 is labelled sequence 1, so sequence 0 resumes after it
        for layer in range(LAYERS):
            d["seq"][row_of(0, 2, layer)] = 1

    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", mutate)
    expect_error(cli, path, row=row_of(0, 3, 0), column="seq", words="two separate runs")


def test_missing_metadata(tmp_path: Path, cli: Callable[..., Any]) -> None:
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", drop_meta=True)
    expect_error(cli, path, words="missing file metadata 'daopsim'")


def test_metadata_missing_key(tmp_path: Path, cli: Callable[..., Any]) -> None:
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", meta=lambda m: m.pop("model"))
    expect_error(cli, path, words="missing key 'model'")


def test_metadata_bad_model_field(tmp_path: Path, cli: Callable[..., Any]) -> None:
    def meta(m: dict[str, Any]) -> None:
        m["model"]["experts"] = "eight"

    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", meta=meta)
    expect_error(cli, path, words="'model.experts' must be an integer")


def test_metadata_unsupported_schema_version(tmp_path: Path, cli: Callable[..., Any]) -> None:
    def meta(m: dict[str, Any]) -> None:
        m["schema_version"] = 99

    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", meta=meta)
    expect_error(cli, path, words="99 is not supported")


def test_metadata_not_json(tmp_path: Path, cli: Callable[..., Any]) -> None:
    table = pq.read_table(good_trace(tmp_path))
    path = tmp_path / "bad.parquet"
    pq.write_table(table.replace_schema_metadata({META_KEY: b"{not json"}), path)
    expect_error(cli, path, words="not valid JSON")


def test_counts_disagree(tmp_path: Path, cli: Callable[..., Any]) -> None:
    def meta(m: dict[str, Any]) -> None:
        m["counts"]["decode_tokens"] += 1

    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", meta=meta)
    expect_error(cli, path, words="counts.decode_tokens = 7 but the file has 6")


def test_row_count_disagrees(tmp_path: Path, cli: Callable[..., Any]) -> None:
    def meta(m: dict[str, Any]) -> None:
        m["counts"]["rows"] = 40

    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", meta=meta)
    expect_error(cli, path, words="counts.rows = 40 but the file has 48")


def test_counts_key_missing(tmp_path: Path, cli: Callable[..., Any]) -> None:
    path = rewrite(
        good_trace(tmp_path), tmp_path / "bad.parquet", meta=lambda m: m["counts"].pop("sequences")
    )
    expect_error(cli, path, words="missing 'sequences'")


def test_info_and_stats_fail_the_same_way(tmp_path: Path, cli: Callable[..., Any]) -> None:
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", drop_meta=True)
    for command in ("info", "stats"):
        result = cli("trace", command, path)
        assert result.exit_code == 2
        assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1
    row = row_of(0, 4, 1)
    path = rewrite(good_trace(tmp_path), tmp_path / "bad2.parquet", _set("experts", row, [3, 3]))
    result = cli("trace", "stats", path)
    assert result.exit_code == 2
    assert f"row {row}" in result.stderr and "Traceback" not in result.output


# ---- random damage ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz") / "src.parquet"
    make_trace(path, sequences=2, prefill=3, decode=3, seed=11, row_group_rows=40)
    return path.read_bytes()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_damage_is_a_trace_error_or_a_valid_read(
    pristine: bytes, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    blob = bytearray(pristine)
    if data.draw(st.booleans(), label="truncate"):
        blob = blob[: data.draw(st.integers(0, len(blob) - 1), label="cut")]
    else:
        edits = data.draw(
            st.lists(
                st.tuples(st.integers(0, len(blob) - 1), st.integers(0, 255)),
                min_size=1,
                max_size=8,
            ),
            label="edits",
        )
        for at, value in edits:
            blob[at] = value
    path = tmp_path_factory.mktemp("damaged") / "t.parquet"
    path.write_bytes(bytes(blob))
    try:
        meta = validate_trace(path)
    except TraceError as err:
        assert "\n" not in str(err)
        assert str(path) in str(err)
    else:
        assert read_meta(path).counts == meta.counts


# --- whatever `trace validate` accepts, `run` runs; what it refuses, `run` refuses alike ----------


def _run_fails_like_validate(cli: Callable[..., Any], path: Path, words: str) -> None:
    """`run` on the file gives the same one-line trace error (not a crash, not the policy's)."""
    result = cli("run", "--policy", "lru", "--trace", path, "--cache-ratio", "0.5", "--no-bounds")
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}"), result.stderr
    assert words.lower() in lines[0].lower()


def test_position_beyond_int32(tmp_path: Path, cli: Callable[..., Any]) -> None:
    big = 2**31 + 5

    def mutate(d: dict[str, list[Any]]) -> None:
        for i in range(len(d["pos"])):
            if d["seq"][i] == 1:
                d["pos"][i] += big

    schema = pq.read_schema(good_trace(tmp_path)).remove_metadata()
    schema = schema.set(schema.get_field_index("pos"), pa.field("pos", pa.int64()))
    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", mutate, schema=schema)
    expect_error(cli, path, row=row_of(1, 0, 0), column="pos", words="exceeds 2^31-1")
    _run_fails_like_validate(cli, path, "exceeds 2^31-1")


def test_repeated_expert_in_early_view(tmp_path: Path, cli: Callable[..., Any]) -> None:
    row = row_of(1, 4, 2)
    path = rewrite(
        good_trace(tmp_path), tmp_path / "bad.parquet", _set("early_experts", row, [3, 3])
    )
    expect_error(cli, path, row=row, column="early_experts", words="repeated")
    result = cli("run", "--policy", "daop", "--trace", path, "--cache-ratio", "0.5", "--no-bounds")
    assert result.exit_code == 2 and "early_experts" in result.stderr
    assert "policy" not in result.stderr.split(":", 2)[1]


@pytest.mark.parametrize(
    ("key", "value"),
    [("decode_tokens", 7), ("prefill_tokens", 2), ("sequences", 3), ("rows", 40)],
)
def test_run_cross_checks_metadata_counts(
    tmp_path: Path, cli: Callable[..., Any], key: str, value: int
) -> None:
    def meta(m: dict[str, Any]) -> None:
        m["counts"][key] = value

    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", meta=meta)
    _run_fails_like_validate(cli, path, f"counts.{key} = {value} but the file has")


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("expert_matrices", 0, "'model.expert_matrices' must be at least 1"),
        ("hidden", 10**400, "'model.hidden' is out of range"),
        ("expert_ffn", 0, "'model.expert_ffn' must be at least 1"),
    ],
)
def test_metadata_model_ranges(
    tmp_path: Path, cli: Callable[..., Any], key: str, value: int, words: str
) -> None:
    def meta(m: dict[str, Any]) -> None:
        m["model"][key] = value

    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", meta=meta)
    expect_error(cli, path, words=words)
    _run_fails_like_validate(cli, path, words)


def test_version_1_file_with_version_2_key(tmp_path: Path, cli: Callable[..., Any]) -> None:
    def meta(m: dict[str, Any]) -> None:
        m["early_view_recorded"] = False

    path = rewrite(good_trace(tmp_path), tmp_path / "bad.parquet", meta=meta)
    expect_error(cli, path, words="needs schema_version 2")


def test_version_2_without_early_view_or_weights(tmp_path: Path, cli: Callable[..., Any]) -> None:
    """Absent columns and a metadata flag say "not recorded"; the reader's stand-ins apply."""
    from daopsim.simulator.trace_read import iter_sequences

    drop = {"early_experts", "early_probs", "weights", "probs"}
    src = good_trace(tmp_path)
    schema = pq.read_schema(src).remove_metadata()
    keep = pa.schema([f for f in schema if f.name not in drop])

    def meta(m: dict[str, Any]) -> None:
        m.update(schema_version=2, early_view_recorded=False, weights_recorded=False)
        m["probs_stored"] = 0

    path = rewrite(src, tmp_path / "v2.parquet", schema=keep, meta=meta)
    assert validate_trace(path).format_version() == 2
    r = next(iter_sequences(path))
    assert (r.early_experts == -1).all() and not r.early_recorded
    assert (r.weights == 0.5).all() and not r.weights_recorded
    # probabilities stand-in: the weights on the selected experts
    assert (r.prob_ids == r.experts).all() and (r.probs == 0.5).all()
    result = cli("trace", "stats", path, "--json")
    stats = json.loads(result.output)
    assert stats["lookahead_precision"] is None and stats["mean_top1_weight"] is None
    assert stats["not_recorded"] == ["lookahead", "weights", "probs"]
    result = cli("run", "--policy", "lru", "--trace", path, "--cache-ratio", "0.5", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["metrics"]["gate_mass_preserved"] is None


def test_filled_count_disagrees(tmp_path: Path, cli: Callable[..., Any]) -> None:
    """A version-2 file's missing_token_layers count is checked against its filled column."""

    def mutate(d: dict[str, list[Any]]) -> None:
        d["filled"] = [i == 5 for i in range(len(d["seq"]))]

    def meta(m: dict[str, Any]) -> None:
        m.update(schema_version=2, filled_column=True)
        m["counts"]["missing_token_layers"] = 2

    src = good_trace(tmp_path)
    schema = pq.read_schema(src).remove_metadata().append(pa.field("filled", pa.bool_()))
    path = rewrite(src, tmp_path / "bad.parquet", mutate, schema=schema, meta=meta)
    expect_error(cli, path, words="counts.missing_token_layers = 2 but the file has 1")
    _run_fails_like_validate(cli, path, "counts.missing_token_layers = 2 but the file has 1")


def test_rank_order_still_checked_without_early_view(
    tmp_path: Path, cli: Callable[..., Any]
) -> None:
    """A version-2 file without the early view still has its recorded weights' order checked."""
    drop = {"early_experts", "early_probs"}
    src = good_trace(tmp_path)
    schema = pq.read_schema(src).remove_metadata()
    keep = pa.schema([f for f in schema if f.name not in drop])
    row = row_of(0, 2, 1)

    def mutate(d: dict[str, list[Any]]) -> None:
        d["weights"][row] = list(reversed(d["weights"][row]))

    def meta(m: dict[str, Any]) -> None:
        m.update(schema_version=2, early_view_recorded=False)

    path = rewrite(src, tmp_path / "v2.parquet", mutate, schema=keep, meta=meta)
    expect_error(cli, path, row=row, column="weights", words="not in rank order")
