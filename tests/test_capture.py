"""Capture: routing recorded from tiny random transformers models matches the model exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from simulator.capture import (  # noqa: E402
    CaptureError,
    GenerationSettings,
    Prompt,
    RoutingRecorder,
    capture_model,
    find_moe_layers,
    iter_captures,
    load_model,
    load_prompts,
    model_name,
    random_model,
)
from simulator.cli import main  # noqa: E402
from simulator.errors import UserError  # noqa: E402
from simulator.trace import load_sequences, read_meta, validate_trace  # noqa: E402

FAMILIES = ["mixtral", "qwen2_moe", "olmoe", "phimoe"]
PROMPTS = [
    Prompt("The quick brown fox jumps over the lazy dog.", 1),
    Prompt("hi", 2),
    Prompt("Mixture of experts routes each token to a few experts.", 3),
]
NEW = 4


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(family: str):
    return random_model(family, seed=1)


@pytest.fixture(scope="module")
def unbatched(model, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("cap") / "unbatched.parquet"
    settings = GenerationSettings(max_new_tokens=NEW, batch_size=1)
    result = capture_model(model, PROMPTS, path, settings, "tiny", "fp32")
    return result, *load_sequences(path)


def _ids(text: str, vocab: int) -> list[int]:
    return [b % vocab for b in text.encode()]


def _route(router, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's routing rule applied to logits, written out independently of capture."""
    if type(router).__name__ == "PhimoeTopKRouter":
        from transformers.models.phimoe.modeling_phimoe import sparsemixer

        return sparsemixer(
            logits, jitter_eps=router.router_jitter_noise, training=False, top_k=router.top_k
        )
    probs = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, router.top_k, dim=-1)
    if getattr(router, "norm_topk_prob", True):
        w = w / w.sum(dim=-1, keepdim=True)
    return w, idx


def _prefill_reference(model, ids: list[int]):
    """Router logits (output_router_logits) and router inputs of a plain forward pass."""
    moe = find_moe_layers(model)
    inputs: list[torch.Tensor] = []
    handles = [
        m.router.register_forward_pre_hook(
            lambda mod, args: inputs.append(args[0].reshape(-1, args[0].shape[-1]))
        )
        for m in moe
    ]
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_router_logits=True)
    finally:
        for h in handles:
            h.remove()
    return moe, out.router_logits, inputs


def test_trace_validates_and_names_moe_layers(family, model, unbatched):
    result, meta, _ = unbatched
    checked = validate_trace(result.path)
    assert checked.counts["sequences"] == len(PROMPTS)
    layers = find_moe_layers(model)
    assert meta.moe_layer_ids == [m.layer_id for m in layers]
    assert meta.model.moe_layers == len(layers)
    assert meta.model.family == model.config.model_type
    assert meta.probs_stored == meta.model.experts == 8
    assert meta.provenance["generation"]["min_new_tokens"] == NEW
    assert "tool_versions" in meta.provenance
    if family == "qwen2_moe":  # layer 0 is dense in the tiny config; shared expert noted
        assert meta.moe_layer_ids == [1, 2, 3]
        assert meta.model.shared_experts == 1
        assert meta.model.shared_expert_ffn == model.config.shared_expert_intermediate_size


def test_prefill_routing_matches_output_router_logits(model, unbatched):
    _, _, seqs = unbatched
    vocab = model.config.vocab_size
    for prompt, seq in zip(PROMPTS, seqs, strict=True):
        ids = _ids(prompt.text, vocab)
        assert seq.n_prefill == len(ids)
        moe, logits, _ = _prefill_reference(model, ids)
        assert len(logits) == len(moe) == seq.experts.shape[1]
        for j, (m, lg) in enumerate(zip(moe, logits, strict=True)):
            w, idx = _route(m.router, lg)
            np.testing.assert_array_equal(seq.experts[: seq.n_prefill, j], idx.numpy())
            np.testing.assert_allclose(
                seq.weights[: seq.n_prefill, j], w.float().numpy(), rtol=1e-5, atol=1e-6
            )
            probs = torch.softmax(lg.float(), dim=-1).numpy()
            np.testing.assert_allclose(seq.probs[: seq.n_prefill, j], probs, atol=1e-3)


def test_early_view_matches_manual_computation(model, unbatched):
    _, _, seqs = unbatched
    seq = seqs[0]
    moe, _, inputs = _prefill_reference(model, _ids(PROMPTS[0].text, model.config.vocab_size))
    n = seq.n_prefill
    assert (seq.early_experts[:n, 0] == -1).all()
    assert np.isnan(seq.early_probs[:n, 0]).all()
    for j in range(1, len(moe)):
        router = moe[j].router
        with torch.no_grad():
            early_logits = torch.nn.functional.linear(
                inputs[j - 1], router.weight, getattr(router, "bias", None)
            )
            _, idx = _route(router, early_logits)
        np.testing.assert_array_equal(seq.early_experts[:n, j], idx.numpy())
        probs = torch.softmax(early_logits.float(), dim=-1).numpy()
        np.testing.assert_allclose(seq.early_probs[:n, j], probs, atol=1e-3)
    # the early view is a different router input, so it is not a copy of the exact routing
    assert not np.array_equal(seq.early_experts[:n, 1:], seq.experts[:n, 1:])


def test_hooks_leave_outputs_unchanged(model):
    ids = torch.tensor([_ids(PROMPTS[0].text, model.config.vocab_size)])
    with torch.no_grad():
        plain = model(ids).logits
        with RoutingRecorder(find_moe_layers(model)) as rec:
            hooked = model(ids).logits
        assert len(rec.steps) == 1
    assert torch.equal(plain, hooked)
    with torch.no_grad():
        after = model(ids).logits  # hooks are gone after the context
    assert torch.equal(plain, after)


def test_decode_rows_match_generated_tokens(model):
    vocab = model.config.vocab_size
    tokens = [_ids(p.text, vocab) for p in PROMPTS]
    caps = list(
        iter_captures(
            model,
            find_moe_layers(model),
            tokens,
            GenerationSettings(max_new_tokens=NEW, batch_size=2),
            pad_id=0,
        )
    )
    for toks, cap in zip(tokens, caps, strict=True):
        assert cap.routing.n_decode == len(cap.generated_ids) == NEW
        assert cap.routing.n_prefill == len(toks)
        np.testing.assert_array_equal(cap.routing.positions, np.arange(len(toks) + NEW))
        # the recorded generation is the model's own greedy continuation
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([toks]),
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                pad_token_id=0,
            )
        assert cap.generated_ids == ref[0, len(toks) :].tolist()


def test_decode_routing_matches_a_plain_forward_over_the_whole_sequence(model, unbatched):
    _, _, seqs = unbatched
    vocab = model.config.vocab_size
    toks = [_ids(PROMPTS[0].text, vocab)]
    cap = next(
        iter_captures(
            model, find_moe_layers(model), toks, GenerationSettings(max_new_tokens=NEW), pad_id=0
        )
    )
    full = toks[0] + cap.generated_ids
    moe, logits, _ = _prefill_reference(model, full)
    for j, (m, lg) in enumerate(zip(moe, logits, strict=True)):
        _, idx = _route(m.router, lg)
        np.testing.assert_array_equal(seqs[0].experts[:, j], idx.numpy())


def test_batched_equals_unbatched(model, unbatched, tmp_path: Path):
    _, _, single = unbatched
    path = tmp_path / "batched.parquet"
    capture_model(
        model, PROMPTS, path, GenerationSettings(max_new_tokens=NEW, batch_size=3), "tiny", "fp32"
    )
    _, batched = load_sequences(path)
    assert [s.seq_id for s in batched] == [0, 1, 2]
    for a, b in zip(single, batched, strict=True):
        assert (a.n_prefill, a.n_decode) == (b.n_prefill, b.n_decode)
        np.testing.assert_array_equal(a.positions, b.positions)
        np.testing.assert_array_equal(a.experts, b.experts)
        np.testing.assert_allclose(a.weights, b.weights, atol=1e-4)
        np.testing.assert_allclose(a.probs, b.probs, atol=2e-3)
        np.testing.assert_array_equal(a.early_experts, b.early_experts)
        np.testing.assert_allclose(a.early_probs, b.early_probs, atol=2e-3)


# --------------------------------------------------------------------------------------------
# Single-family checks
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixtral():
    return random_model("mixtral", seed=3)


def test_failure_mid_generation_leaves_no_file(mixtral, tmp_path: Path):
    calls = {"n": 0}

    def boom(module, args, output):
        calls["n"] += 1
        if calls["n"] == 8:  # during the second sequence's generation
            raise RuntimeError("simulated device fault")

    handle = mixtral.model.layers[2].register_forward_hook(boom)
    out = tmp_path / "t.parquet"
    try:
        with pytest.raises(CaptureError, match=r"sequence 1 \(prompt line 2\).*device fault"):
            capture_model(
                mixtral, PROMPTS, out, GenerationSettings(max_new_tokens=NEW), "tiny", "fp32"
            )
    finally:
        handle.remove()
    assert list(tmp_path.iterdir()) == []


def test_stop_at_eos_cuts_decode_rows(mixtral, tmp_path: Path):
    toks = [_ids(PROMPTS[0].text, 128)]
    with torch.no_grad():
        ref = mixtral.generate(
            torch.tensor(toks), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
        )[0, len(toks[0]) :].tolist()
    eos = ref[2]  # pretend the third generated token is end-of-sequence
    cut = ref.index(eos)
    old = mixtral.generation_config.eos_token_id
    mixtral.generation_config.eos_token_id = eos
    try:
        caps = list(
            iter_captures(
                mixtral,
                find_moe_layers(mixtral),
                toks,
                GenerationSettings(max_new_tokens=6, stop_at_eos=True),
                pad_id=0,
            )
        )
        forced = list(
            iter_captures(
                mixtral,
                find_moe_layers(mixtral),
                toks,
                GenerationSettings(max_new_tokens=6),
                pad_id=0,
            )
        )
    finally:
        mixtral.generation_config.eos_token_id = old
    assert caps[0].routing.n_decode == cut
    assert forced[0].routing.n_decode == 6


def test_top_m_probabilities_when_many_experts(tmp_path: Path):
    from transformers import AutoModelForCausalLM, MixtralConfig

    cfg = MixtralConfig(
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=160,
        num_experts_per_tok=2,
        vocab_size=64,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path / "m.parquet"
    capture_model(
        model, PROMPTS[:1], path, GenerationSettings(max_new_tokens=2), "wide", "fp32", top_m=16
    )
    meta, (seq,) = load_sequences(path)
    assert meta.top_m and meta.probs_stored == 16
    validate_trace(path)
    # the selected experts are the highest-probability ones, listed first among the stored ids
    np.testing.assert_array_equal(seq.prob_ids[..., :2], seq.experts)
    assert (np.diff(seq.probs, axis=-1) <= 1e-3).all()  # stored in decreasing order
    assert (seq.early_prob_ids[:, 1] >= 0).all() and (seq.early_prob_ids[:, 0] == -1).all()


def test_model_shape_from_config_and_weights(mixtral):
    from simulator.capture import model_shape

    shape = model_shape(mixtral, find_moe_layers(mixtral), "tiny", "bf16")
    c = mixtral.config
    assert shape.params_per_expert == 3 * c.hidden_size * c.intermediate_size
    total = sum(p.numel() for p in mixtral.parameters())
    assert shape.non_expert_params == total - 4 * 8 * shape.params_per_expert
    assert shape.embedding_params == c.vocab_size * c.hidden_size
    assert shape.kv_bytes_per_token == 2 * 4 * 2 * (32 // 4) * 2
    assert (shape.experts, shape.top_k, shape.layers) == (8, 2, 4)


@pytest.mark.parametrize("fam", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_other_families_capture_and_validate(fam: str, tmp_path: Path):
    model = random_model(fam)
    path = tmp_path / f"{fam}.parquet"
    capture_model(
        model, PROMPTS[:2], path, GenerationSettings(max_new_tokens=2, batch_size=2), fam, "fp32"
    )
    meta = validate_trace(path)
    assert meta.counts["decode_tokens"] == 4
    if fam == "deepseek_v3":
        assert meta.moe_layer_ids == [1, 2, 3] and meta.model.shared_experts == 1
    if fam == "gpt_oss":  # expert biases counted with the expert
        assert meta.model.expert_extra_params == 2 * 32 + 32


def test_unsupported_model_lists_supported_families():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=64,
    )
    with pytest.raises(UserError, match="supported families: Mixtral, Qwen2-MoE"):
        find_moe_layers(AutoModelForCausalLM.from_config(cfg))


# --------------------------------------------------------------------------------------------
# Prompts, loading and the CLI
# --------------------------------------------------------------------------------------------


def test_load_prompts(tmp_path: Path):
    j = tmp_path / "p.jsonl"
    j.write_text('{"prompt": "a"}\n\n{"text": "b"}\n{"prompt": "c"}\n')
    assert [(p.text, p.line) for p in load_prompts(j)] == [("a", 1), ("b", 3), ("c", 4)]
    assert len(load_prompts(j, limit=2)) == 2
    t = tmp_path / "p.txt"
    t.write_text("one\n\ntwo\n")
    assert [p.text for p in load_prompts(t)] == ["one", "two"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    with pytest.raises(UserError, match=r"bad.jsonl: line 2: no 'prompt' or 'text'"):
        load_prompts(bad)
    bad.write_text('{"prompt": "ok"}\n{broken\n')
    with pytest.raises(UserError, match=r"line 2: not valid JSON"):
        load_prompts(bad)
    csv = tmp_path / "p.csv"
    csv.write_text("x\n")
    with pytest.raises(UserError, match=r"must be a \.jsonl or \.txt"):
        load_prompts(csv)


def test_model_name():
    assert model_name("mistralai/Mixtral-8x7B-v0.1") == "mixtral-8x7b-v0.1"
    assert model_name("/data/models/Qwen3-30B-A3B/") == "qwen3-30b-a3b"


def test_offline_load_errors_are_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match=r"cannot load model 'org/not-here' \(offline") as exc:
        load_model("org/not-here", "fp32", "cpu")
    assert "\n" not in str(exc.value)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(UserError, match="no such model directory"):
        load_model(str(tmp_path / "missing" / "model"), "fp32", "cpu")


def test_cli_random_init(tmp_path: Path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p.text}) + "\n" for p in PROMPTS))
    out = tmp_path / "t.parquet"
    res = CliRunner().invoke(
        main,
        [
            "capture",
            "--random-init",
            "olmoe",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "3",
            "--batch-size",
            "2",
            "--limit",
            "2",
            "-o",
            str(out),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["counts"]["sequences"] == 2 and summary["counts"]["decode_tokens"] == 6
    meta = validate_trace(out)
    assert meta.provenance["random_init"] == "olmoe"
    assert meta.provenance["prompts"]["sequences"] == 2
    assert meta.provenance["tokenizer"] == "bytes-mod-vocab"


def test_cli_local_model_dir(tmp_path: Path, mixtral, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    model_dir = tmp_path / "Tiny-Mixtral"
    mixtral.save_pretrained(model_dir)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\nworld\n")
    out = tmp_path / "t.parquet"
    res = CliRunner().invoke(
        main,
        [
            "capture",
            "--model",
            str(model_dir),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "2",
            "--no-progress",
            "-o",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    meta = read_meta(out)
    assert meta.model.name == "tiny-mixtral"
    assert meta.provenance["model_id"] == str(model_dir)


def test_cli_user_errors_exit_2(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n[1, 2]\n')
    out = tmp_path / "t.parquet"
    res = CliRunner().invoke(
        main, ["capture", "--random-init", "mixtral", "--prompts", str(bad), "-o", str(out)]
    )
    assert res.exit_code == 2
    assert f"{bad}: line 2" in res.output
    good = tmp_path / "good.txt"
    good.write_text("hello\n")
    res = CliRunner().invoke(
        main, ["capture", "--random-init", "llama", "--prompts", str(good), "-o", str(out)]
    )
    assert res.exit_code == 2 and "known: mixtral" in res.output
    assert not out.exists()


def test_captured_trace_replays_through_the_simulator(mixtral, tmp_path: Path):
    runner = pytest.importorskip("simulator.runner")
    path = tmp_path / "t.parquet"
    capture_model(
        mixtral,
        PROMPTS,
        path,
        GenerationSettings(max_new_tokens=NEW, batch_size=2),
        "tiny-mixtral",
        "bf16",
    )
    lru = runner.simulate(policy="lru", hw="a6000-pcie4", trace=path, cache_ratio=0.5)
    evaluated, _ = runner.split_sequences(read_meta(path), [0, 1, 2], None, False)
    assert lru.metrics["sequences"] == len(evaluated) >= 2
    assert lru.metrics["decode_tokens"] == len(evaluated) * NEW
    assert 0 < lru.metrics["hit_rate"] < 1
    full = runner.simulate(policy="all-gpu", hw="a6000-pcie4", trace=path)
    assert full.metrics["hit_rate"] == 1
