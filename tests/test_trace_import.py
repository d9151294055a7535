"""``daopsim trace import``: each format from the CLI on fixture files, bad rows, provenance."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from daopsim.simulator.cli import main as cli
from daopsim.simulator.trace_read import iter_sequences, read_meta, validate_trace

E, K = 8, 2
MODEL = "mixtral-8x7b"  # 32 MoE layers, 8 experts, top-2: the shape of the fixtures
ML = 32


def _ids(rng: np.random.Generator, n: int) -> list[list[list[int]]]:
    return [[rng.choice(E, K, replace=False).tolist() for _ in range(ML)] for _ in range(n)]


def _run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, list(args))
    return res.exit_code, res.output


def _import(fmt: str, src: Path, out: Path, *extra: str) -> tuple[int, str]:
    return _run("trace", "import", fmt, str(src), "-o", str(out), "--model", MODEL, *extra)


def _response(rng: np.random.Generator, prompt: int, gen: int) -> dict:
    return {
        "id": "cmpl-x",
        "object": "text_completion",
        "prompt_routed_experts": _ids(rng, prompt),
        "choices": [{"index": 0, "text": "...", "routed_experts": _ids(rng, gen)}],
    }


def test_vllm_jsonl_and_json(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    a, b = _response(rng, 5, 7), _response(rng, 3, 4)
    jl = tmp_path / "out.jsonl"
    jl.write_text(json.dumps(a) + "\n" + json.dumps(b) + "\n")
    js = tmp_path / "out.json"
    js.write_text(json.dumps([a, b], indent=2))
    for src in (jl, js):
        out = tmp_path / f"{src.stem}{src.suffix}.parquet"
        code, text = _import("vllm", src, out)
        assert code == 0, text
        meta = validate_trace(out)
        assert meta.counts["sequences"] == 2
        assert meta.counts["prefill_tokens"] == 8 and meta.counts["decode_tokens"] == 11
        assert not meta.early_view_recorded and not meta.weights_recorded
        r = next(iter_sequences(out))
        assert r.n_prefill == 5
        np.testing.assert_array_equal(r.experts[:5], np.asarray(a["prompt_routed_experts"]))
        np.testing.assert_array_equal(r.experts[5:], np.asarray(a["choices"][0]["routed_experts"]))
        np.testing.assert_allclose(r.weights, 0.5)  # ids only: 1/k stand-in
        prov = meta.provenance
        assert prov["format"] == "vllm" and prov["source_file"] == src.name
        assert prov["source_sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
        assert prov["importer_version"] == 1 and prov["created"]


@pytest.mark.parametrize(
    ("mutate", "line", "message"),
    [
        (lambda r: r["choices"][0]["routed_experts"][2].pop(), 2, "expected 32 layers, got 31"),
        (lambda r: r["choices"][0]["routed_experts"][1][3].append(5), 2, "expected 2 experts"),
        (lambda r: r["prompt_routed_experts"][0][0].__setitem__(0, 9), 2, "outside 0..7"),
        (lambda r: r["prompt_routed_experts"][1][0].__setitem__(0, -1), 2, "id -1 outside 0..7"),
        (lambda r: r["prompt_routed_experts"][0][0].__setitem__(0, 1.5), 2, "not an integer"),
    ],
)
def test_vllm_bad_rows_name_the_line(tmp_path: Path, mutate, line: int, message: str) -> None:
    rng = np.random.default_rng(2)
    good, bad = _response(rng, 3, 3), _response(rng, 3, 3)
    bad["prompt_routed_experts"][0][0] = [0, 1]
    mutate(bad)
    src = tmp_path / "v.jsonl"
    src.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    code, text = _import("vllm", src, tmp_path / "o.parquet")
    assert code == 2
    assert text.startswith(f"error: {src}:{line}: ") and message in text, text
    assert len(text.strip().splitlines()) == 1
    assert not (tmp_path / "o.parquet").exists()


def test_malformed_json_line(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    src = tmp_path / "v.jsonl"
    src.write_text(json.dumps(_response(rng, 2, 2)) + "\n\n{not json\n")
    code, text = _import("vllm", src, tmp_path / "o.parquet")
    assert code == 2 and text.startswith(f"error: {src}:3: malformed JSON"), text


def _rows(rng: np.random.Generator, tokens: int, skip: set[tuple[int, int]] = frozenset()) -> list:
    rows = []
    for s in (0, 1):
        for t in range(tokens):
            for layer in range(ML):
                if (t, layer) in skip and s == 0:
                    continue
                ids = rng.choice(E, K, replace=False).tolist()
                rows.append(
                    {
                        "sid": s,
                        "tok": 100 + t,
                        "layer": layer,
                        "experts": ids,
                        "w": [0.7, 0.3],
                        "phase": "prefill" if t < 2 else "decode",
                    }
                )
    return rows


def test_jsonl_fields_weights_and_missing_layers(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    rows = _rows(rng, 5, skip={(3, 7), (0, 2)})
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.parquet"
    fields = ("--field", "seq=sid", "--field", "token=tok", "--field", "weights=w")
    code, text = _import("jsonl", src, out, *fields)
    assert code == 0, text
    assert "2 missing token-layers filled" in text
    meta = validate_trace(out)
    assert meta.weights_recorded and meta.counts["missing_token_layers"] == 2
    r = next(iter_sequences(out))
    assert r.positions.tolist() == [100, 101, 102, 103, 104] and r.n_prefill == 2
    assert r.filled is not None and r.filled[3, 7] and r.filled[0, 2] and r.filled.sum() == 2
    # fill rule: the previous token at that layer; a leading token takes the next one
    np.testing.assert_array_equal(r.experts[3, 7], r.experts[2, 7])
    np.testing.assert_array_equal(r.experts[0, 2], r.experts[1, 2])
    np.testing.assert_allclose(r.weights[0, 0], [0.7, 0.3])
    code, text = _run("trace", "stats", str(out), "--json")
    stats = json.loads(text)
    assert stats["missing_token_layers"] == 2
    assert stats["lookahead_precision"] is None and "lookahead" in stats["not_recorded"]
    assert stats["mean_top1_weight"] == pytest.approx(0.7)
    # skip rule: the two tokens are dropped instead
    out2 = tmp_path / "s.parquet"
    code, text = _import("jsonl", src, out2, *fields, "--missing-layers", "skip")
    assert code == 0, text
    r2 = next(iter_sequences(out2))
    assert r2.positions.tolist() == [101, 102, 104] and r2.n_prefill == 1


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.update(experts=[1, 2, 3]), "expected 2 experts, got 3"),
        (lambda r: r.update(experts=[1, 8]), "outside 0..7"),
        (lambda r: r.update(experts=[1, "a"]), "not an integer"),
        (lambda r: r.update(layer=40), "layer 40 outside 0..31"),
        (lambda r: r.update(tok=-1), "non-negative integer"),
    ],
)
def test_jsonl_bad_rows(tmp_path: Path, edit, message: str) -> None:
    rows = _rows(np.random.default_rng(5), 2)
    edit(rows[10])
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, text = _import(
        "jsonl", src, tmp_path / "o.parquet", "--field", "seq=sid", "--field", "token=tok"
    )
    assert code == 2 and text.startswith(f"error: {src}:11: ") and message in text, text


def test_npy_and_npz(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    arr = np.asarray(_ids(rng, 9))
    np.save(tmp_path / "a.npy", arr)
    code, text = _import("npy", tmp_path / "a.npy", tmp_path / "a.parquet", "--prefill", "3")
    assert code == 0, text
    r = next(iter_sequences(tmp_path / "a.parquet"))
    assert r.n_prefill == 3 and r.n_tokens == 9
    np.testing.assert_array_equal(r.experts, arr)
    w = np.tile([0.6, 0.4], (9, ML, 1))
    np.savez(tmp_path / "b.npz", experts=arr, weights=w, seq=np.array([3] * 4 + [5] * 5))
    code, text = _import("npy", tmp_path / "b.npz", tmp_path / "b.parquet")
    assert code == 0, text
    seqs = list(iter_sequences(tmp_path / "b.parquet"))
    assert [s.seq_id for s in seqs] == [3, 5] and [s.n_tokens for s in seqs] == [4, 5]
    np.testing.assert_allclose(seqs[1].weights, w[4:])
    np.savez(tmp_path / "c.npz", first=arr[:2], second=arr[2:])
    code, text = _import("npy", tmp_path / "c.npz", tmp_path / "c.parquet")
    assert code == 0 and read_meta(tmp_path / "c.parquet").counts["sequences"] == 2
    bad = arr.copy()
    bad[4, 6, 1] = 11
    np.save(tmp_path / "bad.npy", bad)
    code, text = _import("npy", tmp_path / "bad.npy", tmp_path / "x.parquet")
    assert code == 2 and text.startswith(f"error: {tmp_path / 'bad.npy'}:array: [4, 6]")
    assert "expert id 11 outside 0..7" in text
    np.save(tmp_path / "f.npy", arr.astype(np.float32))
    code, text = _import("npy", tmp_path / "f.npy", tmp_path / "x.parquet")
    assert code == 2 and "must be integers" in text


def test_torch_router_logits(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(6, E, generator=gen) for _ in range(ML))
    src = tmp_path / "logits.pt"
    torch.save({"router_logits": logits, "n_prefill": 2}, src)
    out = tmp_path / "t.parquet"
    code, text = _import("torch", src, out)
    assert code == 0, text
    meta = validate_trace(out)
    assert meta.probs_stored == E and meta.weights_recorded and not meta.early_view_recorded
    r = next(iter_sequences(out))
    probs = torch.softmax(torch.stack(logits, dim=1).double(), dim=-1).numpy()
    top = np.argsort(-probs, axis=-1, kind="stable")[..., :K]
    np.testing.assert_array_equal(np.sort(r.experts, axis=-1), np.sort(top, axis=-1))
    tp = np.take_along_axis(probs, r.experts.astype(np.int64), axis=-1)
    np.testing.assert_allclose(r.weights, tp / tp.sum(-1, keepdims=True), rtol=1e-5)
    assert r.n_prefill == 2
    torch.save([*(torch.randn(6, E) for _ in range(ML - 1)), torch.randn(5, E)], src)
    code, text = _import("torch", src, out)
    assert code == 2 and f"error: {src}:router_logits layer 31: shape [5, 8]" in text, text


def test_model_is_required_and_checked(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.tile(np.array([0, 1]), (3, 4, 1)))
    code, text = _run(
        "trace", "import", "npy", str(tmp_path / "a.npy"), "-o", str(tmp_path / "o.parquet")
    )
    assert code == 2 and "give --model PRESET" in text and "4 MoE layers" in text
    code, text = _import("npy", tmp_path / "a.npy", tmp_path / "o.parquet")
    assert code == 2 and "the data has 4 MoE layers" in text


def test_unwritable_output_is_one_line(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.tile(np.array([0, 1]), (3, ML, 1)))
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code, text = _import("npy", tmp_path / "a.npy", blocker / "out.parquet")
    # exit 3 like every unwritable output (docs/cli.md), naming the blocking file
    assert code == 3 and text.startswith("error: -o ") and "not a directory" in text, text
    assert len(text.strip().splitlines()) == 1
