"""Fuzzing ``daopsim trace import``: random malformed files of every format (Hypothesis).

For each format (docs/trace-format.md, "Importing traces") random sources are drawn: mostly
well-formed routing with random damage (out-of-range or non-integer ids, wrong layer counts,
empty lists, bad weights, odd dtypes and shapes, bad sequence ids and prompt lengths), plus
arbitrary JSON, arbitrary bytes and truncated files. Every import must end one of two ways:

* exit 0, and ``daopsim trace validate`` accepts what it wrote;
* one ``error:`` line on stderr (exit 2), no traceback, and no output file (nor a temporary).

The example counts are small and derandomized, so the test is fast and the same every run.
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from daopsim.simulator.cli import main

MODEL = "mixtral-8x7b"  # 32 MoE layers, 8 experts, top-2
ML, E, K = 32, 8, 2
FUZZ = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- the check ---------------------------------------------------------------------------------


def _import_and_check(fmt: str, name: str, data: bytes, extra: tuple[str, ...] = ()) -> None:
    """Import ``data`` (saved as ``name``) and assert the contract of the module docstring."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = root / name
        src.write_bytes(data)
        out_dir = root / "out"
        out_dir.mkdir()
        out = out_dir / "t.parquet"
        res = CliRunner().invoke(
            main, ["trace", "import", fmt, str(src), "--model", MODEL, *extra, "-o", str(out)]
        )
        text = res.output + res.stderr
        assert "Traceback" not in text, text
        assert res.exit_code in (0, 2), (res.exit_code, res.exception, res.stderr)
        if res.exit_code == 0:
            check = CliRunner().invoke(main, ["trace", "validate", str(out)])
            assert check.exit_code == 0, check.output + check.stderr
            return
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
        assert list(out_dir.iterdir()) == [], "an output or temporary file was left"


# -- damage --------------------------------------------------------------------------------------

#: values a damaged leaf or list can become
ODD = st.sampled_from(
    [-1, E, 2**15, 2**40, 2**70, -(2**70), 1.5, float("nan"), "3", None, True, [], {}, [[1]]]
)


@st.composite
def damaged(draw: st.DrawFn, obj: Any) -> Any:
    """``obj`` (nested lists and dicts) with up to two random changes: a value replaced by an
    odd one, an element dropped or duplicated, or a key removed."""
    for _ in range(draw(st.integers(0, 2))):
        obj = _damage_once(draw, obj)
    return obj


def _damage_once(draw: st.DrawFn, obj: Any) -> Any:
    if isinstance(obj, list) and obj:
        i = draw(st.integers(0, len(obj) - 1))
        action = draw(st.sampled_from(["into", "into", "into", "replace", "drop", "dup"]))
        obj = list(obj)
        if action == "into":
            obj[i] = _damage_once(draw, obj[i])
        elif action == "replace":
            obj[i] = draw(ODD)
        elif action == "drop":
            del obj[i]
        else:
            obj.insert(i, obj[i])
        return obj
    if isinstance(obj, dict) and obj:
        key = draw(st.sampled_from(sorted(obj)))
        action = draw(st.sampled_from(["into", "into", "replace", "drop"]))
        obj = dict(obj)
        if action == "into":
            obj[key] = _damage_once(draw, obj[key])
        elif action == "replace":
            obj[key] = draw(ODD)
        else:
            del obj[key]
        return obj
    return draw(ODD)


def _ids(draw: st.DrawFn, tokens: int, layers: int = ML, k: int = K) -> np.ndarray:
    """``[tokens, layers, k]`` expert ids: distinct per token-layer, sometimes out of range."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    span = draw(st.sampled_from([E, E, E, E + 2]))  # E + 2: some ids out of range
    order = np.argsort(rng.random((tokens, layers, span)), axis=-1)
    return order[..., :k].astype(np.int64)


ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=12,
)
GARBAGE = st.binary(max_size=200)


def _truncated(draw: st.DrawFn, data: bytes) -> bytes:
    """Sometimes cut the file short (a partial download)."""
    if draw(st.integers(0, 4)) == 0 and data:
        return data[: draw(st.integers(0, len(data) - 1))]
    return data


# -- vllm ----------------------------------------------------------------------------------------


@st.composite
def vllm_files(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["responses", "responses", "responses", "json", "bytes"]))
    if kind == "json":
        return json.dumps(draw(ANY_JSON)).encode()
    if kind == "bytes":
        return draw(GARBAGE)
    docs = []
    lengths = st.sampled_from([0, 0, 1, 2, 3])  # empty lists often: a sequence of no tokens
    for _ in range(draw(st.integers(1, 2))):
        prompt = _ids(draw, draw(lengths)).tolist()
        choices = [
            {"index": c, "routed_experts": _ids(draw, draw(lengths)).tolist()}
            for c in range(draw(st.integers(1, 2)))
        ]
        docs.append(draw(damaged({"prompt_routed_experts": prompt, "choices": choices})))
    form = draw(st.sampled_from(["jsonl", "list", "one"]))
    if form == "jsonl":
        text = "".join(json.dumps(d) + "\n" for d in docs)
    elif form == "list":
        text = json.dumps(docs, indent=draw(st.sampled_from([None, 1])))
    else:
        text = json.dumps(docs[0], indent=1)
    return _truncated(draw, text.encode())


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def _npz_bytes(**arrays: Any) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


ONE = np.tile(np.array([1, 0]), (3, ML, 1))  # three tokens, experts 1 and 0 everywhere
#: the damage issue 28 found, always tried first (then the random examples)
VLLM_SEEN = [
    b'{"prompt_routed_experts": [], "choices": [{"routed_experts": []}]}',
    json.dumps({"choices": [{"routed_experts": [[[2**70, 1]] * ML]}]}).encode(),
]


@FUZZ
@example(data=VLLM_SEEN[0])
@example(data=VLLM_SEEN[1])
@given(data=vllm_files())
def test_fuzz_vllm(data: bytes) -> None:
    _import_and_check("vllm", "src.json", data)


# -- jsonl ---------------------------------------------------------------------------------------


@st.composite
def jsonl_files(draw: st.DrawFn) -> tuple[bytes, tuple[str, ...]]:
    rule = ("--missing-layers", draw(st.sampled_from(["fill", "skip"])))
    if draw(st.integers(0, 5)) == 0:
        return draw(GARBAGE), rule
    weights = draw(st.booleans())
    rows = []
    for seq in range(draw(st.integers(1, 2))):
        n_pre = draw(st.integers(0, 2))
        ids = _ids(draw, draw(st.integers(1, 3)))
        for t, tok in enumerate(ids):
            for layer, experts in enumerate(tok):
                row: dict[str, Any] = {
                    "seq": seq,
                    "token": t,
                    "layer": layer,
                    "experts": experts.tolist(),
                    "phase": "prefill" if t < n_pre else "decode",
                }
                if weights:
                    row["weights"] = [0.7, 0.3]
                rows.append(row)
    # damage a few rows, drop some (missing layers), shuffle the order a little
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(rows) - 1))
        rows[i] = draw(damaged(rows[i]))
    for _ in range(draw(st.integers(0, 2))):
        del rows[draw(st.integers(0, len(rows) - 1))]
        if not rows:
            break
    lines = [json.dumps(r) for r in rows]
    if draw(st.integers(0, 6)) == 0:
        lines.insert(0, draw(st.text(max_size=10)))  # a line that is not JSON
    return _truncated(draw, ("\n".join(lines) + "\n").encode()), rule


GAPPY = "".join(  # layer 5 missing from every token: --missing-layers skip drops them all
    json.dumps({"seq": 0, "token": t, "layer": layer, "experts": [1, 0]}) + "\n"
    for t in range(2)
    for layer in range(ML)
    if layer != 5
).encode()


@FUZZ
@example(case=(GAPPY, ("--missing-layers", "skip")))
@given(case=jsonl_files())
def test_fuzz_jsonl(case: tuple[bytes, tuple[str, ...]]) -> None:
    data, rule = case
    _import_and_check("jsonl", "src.jsonl", data, rule)


# -- npy -----------------------------------------------------------------------------------------

DTYPES = st.sampled_from(
    [np.int64, np.int64, np.int64, np.int16, np.uint8, np.uint64, np.float32, np.bool_, "<U2"]
)


def _array(draw: st.DrawFn, shape: tuple[int, ...]) -> np.ndarray:
    dtype = draw(DTYPES)
    elements: st.SearchStrategy[Any]
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        elements = st.integers(max(int(info.min), -3), min(int(info.max), 2**40))
    elif np.dtype(dtype).kind == "f":
        elements = st.floats(-2, 10, width=32) | st.sampled_from([np.nan, np.inf])
    elif np.dtype(dtype).kind == "b":
        elements = st.booleans()
    else:
        elements = st.text(max_size=2)
    return draw(hnp.arrays(dtype, shape, elements=elements))


@st.composite
def npy_files(draw: st.DrawFn) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["ids", "ids", "npz", "npz", "named", "odd", "bytes"]))
    buf = io.BytesIO()
    if kind == "bytes":
        return "src.npy", draw(GARBAGE)
    tokens = draw(st.integers(0, 4))
    if kind == "ids":
        arr = _ids(draw, tokens)
        if draw(st.booleans()):
            arr = arr.astype(draw(st.sampled_from([np.int16, np.uint8, np.float64])))
        np.save(buf, arr)
        return "src.npy", _truncated(draw, buf.getvalue())
    if kind == "odd":  # any dtype, any shape
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=4)))
        np.save(buf, _array(draw, shape))
        return "src.npy", buf.getvalue()
    if kind == "named":  # one array per sequence, with or without <name>_weights
        arrays: dict[str, np.ndarray] = {}
        for s in range(draw(st.integers(0, 2))):
            arrays[f"s{s}"] = _ids(draw, draw(st.integers(0, 3)))
            if draw(st.booleans()):
                w = np.sort(np.random.default_rng(s).random(arrays[f"s{s}"].shape), axis=-1)
                arrays[f"s{s}_weights"] = w[..., ::-1]
        np.savez(buf, **arrays)  # type: ignore[arg-type]
        return "src.npz", _truncated(draw, buf.getvalue())
    ids = _ids(draw, tokens)
    arrays = {"experts": ids}
    if draw(st.booleans()):
        w = np.sort(np.random.default_rng(1).random(ids.shape), axis=-1)[..., ::-1]
        arrays["weights"] = (
            w if draw(st.booleans()) else _array(draw, draw(st.sampled_from([ids.shape, (2,)])))
        )
    if draw(st.booleans()):
        seq = np.sort(
            np.asarray(draw(st.lists(st.integers(0, 3), min_size=tokens, max_size=tokens)))
        )
        arrays["seq"] = seq if draw(st.booleans()) else _array(draw, (tokens,))
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    return "src.npz", _truncated(draw, buf.getvalue())


@FUZZ
@example(case=("src.npy", _npy_bytes(np.zeros((3, ML, 0), np.int64))), prefill=0)
@example(case=("src.npz", _npz_bytes(experts=ONE, seq=np.array([2**40] * 3))), prefill=0)
@example(case=("src.npz", _npz_bytes(experts=ONE, seq=np.array([-1] * 3))), prefill=0)
@example(case=("src.npz", _npz_bytes(experts=ONE, weights=np.full(ONE.shape, "a"))), prefill=0)
@example(case=("src.npz", _npz_bytes(experts=ONE, weights=np.full(ONE.shape, 1e39))), prefill=0)
@given(case=npy_files(), prefill=st.integers(0, 3))
def test_fuzz_npy(case: tuple[str, bytes], prefill: int) -> None:
    name, data = case
    _import_and_check("npy", name, data, ("--prefill", str(prefill)))


# -- torch ---------------------------------------------------------------------------------------


@st.composite
def torch_files(draw: st.DrawFn) -> bytes:
    import torch

    kind = draw(st.sampled_from(["list", "dict", "dict", "per-seq", "odd", "bytes"]))
    if kind == "bytes":
        return draw(GARBAGE)
    tokens = draw(st.integers(0, 3))
    layers = draw(st.sampled_from([ML, ML, ML, 1, 0]))
    experts = draw(st.sampled_from([E, E, E, 7, 1, 0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def logits() -> list[Any]:
        out: list[Any] = [torch.randn(tokens, experts, generator=gen) for _ in range(layers)]
        if out and draw(st.integers(0, 4)) == 0:  # one odd layer
            i = draw(st.integers(0, len(out) - 1))
            out[i] = draw(
                st.sampled_from(
                    [
                        torch.full((tokens, experts), float("nan")),
                        torch.zeros(tokens + 1, experts),
                        torch.zeros(experts),
                        torch.zeros(1, tokens, experts),
                        torch.zeros(tokens, experts, dtype=torch.complex64),
                        "not a tensor",
                    ]
                )
            )
        return out

    def meta() -> dict[str, Any]:
        extra: dict[str, Any] = {}
        for key in ("top_k", "n_prefill"):
            if draw(st.booleans()):
                extra[key] = draw(st.sampled_from([K, 0, 1, -3, 9, 2**40, "2", 1.5, None]))
        return extra

    obj: Any
    if kind == "list":
        obj = logits()
    elif kind == "dict":
        obj = {"router_logits": logits(), **meta()}
    elif kind == "per-seq":
        obj = [{"router_logits": logits(), **meta()} for _ in range(draw(st.integers(1, 2)))]
    else:
        obj = draw(ANY_JSON)
    buf = io.BytesIO()
    torch.save(obj, buf)
    return _truncated(draw, buf.getvalue())


@FUZZ
@given(data=torch_files())
def test_fuzz_torch(data: bytes) -> None:
    _import_and_check("torch", "src.pt", data)
