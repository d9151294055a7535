"""Capture: routing recorded from tiny random transformers models matches the model exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from daopsim.simulator.capture import capture_model  # noqa: E402
from daopsim.simulator.capture_generate import (  # noqa: E402
    GenerationSettings,
    Prompt,
    iter_captures,
    load_prompts,
)
from daopsim.simulator.capture_layers import (  # noqa: E402
    CaptureError,
    find_moe_layers,
    load_model,
    model_name,
    random_config,
    random_model,
)
from daopsim.simulator.capture_recorder import RoutingRecorder  # noqa: E402
from daopsim.simulator.cli import main  # noqa: E402
from daopsim.simulator.errors import TraceError, UserError  # noqa: E402
from daopsim.simulator.trace_read import load_sequences, read_meta, validate_trace  # noqa: E402
from daopsim.simulator.trace_write import write_trace  # noqa: E402

#: several CPU-seconds a test: they run first (tests/conftest.py)
pytestmark = pytest.mark.slow

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
    # sparsemixer's weights do not follow its (logit) rank order; the probabilities do
    want = ["probs"] if family == "phimoe" else ["weights", "probs"]
    assert meta.provenance["rank_order_columns"] == want
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
        np.testing.assert_allclose(a.weights, b.weights, atol=1e-6)  # fp32: rounding only
        np.testing.assert_allclose(a.probs, b.probs, atol=2e-3)
        np.testing.assert_array_equal(a.early_experts, b.early_experts)
        np.testing.assert_allclose(a.early_probs, b.early_probs, atol=2e-3)


def _differs_only_by_near_ties(
    a: np.ndarray, b: np.ndarray, probs: np.ndarray, rows: np.ndarray, tol: float
) -> None:
    """Where rows of ``a`` and ``b`` differ, ``probs`` (of ``a``'s run) ranks both within tol."""
    for t, layer in np.argwhere(rows):
        p = probs[t, layer]
        np.testing.assert_allclose(p[a[t, layer]], p[b[t, layer]], atol=tol)


def test_bf16_batching_moves_only_near_tied_routing(tmp_path: Path):
    # In bf16 the batched model really computes differently (other matmul shapes and
    # reduction orders, rounded to 8 mantissa bits), unlike fp32 (test_batched_equals_unbatched).
    model = random_model("qwen2_moe", seed=1, dtype="bf16")
    runs = []
    for b in (1, 3):
        path = tmp_path / f"bf16-{b}.parquet"
        settings = GenerationSettings(max_new_tokens=8, batch_size=b)
        capture_model(model, PROMPTS, path, settings, "tiny", "bf16")
        runs.append(load_sequences(path)[1])
    rows = changed = 0
    weights_moved = False
    for one, three in zip(*runs, strict=True):
        # same tokens generated, so the rows line up
        assert (one.n_prefill, one.n_decode) == (three.n_prefill, three.n_decode)
        diff = (one.experts != three.experts).any(axis=-1)
        early = (one.early_experts != three.early_experts).any(axis=-1)
        rows += diff.size
        changed += int(diff.sum() + early.sum())
        # a changed row swaps experts the unbatched router scored equal up to bf16 rounding
        _differs_only_by_near_ties(one.experts, three.experts, one.probs, diff, tol=4e-3)
        _differs_only_by_near_ties(
            one.early_experts, three.early_experts, one.early_probs, early, tol=4e-3
        )
        same = ~diff
        np.testing.assert_allclose(one.weights[same], three.weights[same], atol=1e-2)
        weights_moved |= not np.array_equal(one.weights, three.weights)
    assert changed <= 0.02 * rows  # a few rows at most
    assert weights_moved  # bf16 batching is not bit-identical: the documented caveat


# --------------------------------------------------------------------------------------------
# DeepSeek-V3: experts come unsorted from the router (topk sorted=False); capture sorts them
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek32():
    """Tiny DeepSeek-V3: 32 routed experts in 4 groups (2 chosen), top-6, dense layer 0."""
    from transformers import AutoModelForCausalLM

    cfg = random_config("deepseek_v3")  # hidden 32, 4 layers, multi-head latent attention
    cfg.n_routed_experts, cfg.num_experts_per_tok = 32, 6
    cfg.n_group, cfg.topk_group, cfg.moe_intermediate_size = 4, 2, 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert model.model.layers[1].mlp.gate.weight.shape == (32, 32)
    return model


class RawRouter:
    """Records every router call's raw output and input, per forward pass (batch 1 only)."""

    def __init__(self, model) -> None:
        self.moe = find_moe_layers(model)
        self.calls: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.inputs: list[torch.Tensor] = []

    def __enter__(self) -> RawRouter:
        def keep(module, args, output):
            self.inputs.append(args[0].reshape(-1, args[0].shape[-1]).detach().clone())
            logits, weights, idx = (t.detach().float().numpy() for t in output)
            self.calls.append((logits, weights, idx.astype(np.int64)))

        self.handles = [m.router.register_forward_hook(keep) for m in self.moe]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()

    def per_layer(self, what: int) -> list[np.ndarray]:
        """Field ``what`` (0 logits, 1 weights, 2 ids) of each layer, rows of all passes."""
        n = len(self.moe)
        return [np.concatenate([c[what] for c in self.calls[j::n]]) for j in range(n)]

    def early(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer j's router applied to layer j-1's inputs of every pass: raw (logits, ids)."""
        n = len(self.moe)
        with torch.no_grad():
            out = [self.moe[j].router(x) for x in self.inputs[j - 1 :: n]]
        logits = np.concatenate([o[0].float().numpy() for o in out])
        return logits, np.concatenate([o[2].numpy() for o in out]).astype(np.int64)


def _ds_score(router, logits: np.ndarray) -> np.ndarray:
    """DeepSeek-V3's selection score, written out: sigmoid of the logits plus the bias."""
    bias = router.e_score_correction_bias.detach().numpy().astype(np.float64)
    return 1.0 / (1.0 + np.exp(-logits.astype(np.float64))) + bias


def _capture_raw(model, prompts, path: Path, new: int) -> tuple[list[RawRouter], list]:
    """Capture each prompt alone (batch 1), recording the raw router calls of each."""
    raws = []
    for i, prompt in enumerate(prompts):
        with RawRouter(model) as raw:
            capture_model(
                model,
                [prompt],
                path.with_suffix(f".{i}.parquet"),
                GenerationSettings(max_new_tokens=new),
                "ds",
                "fp32",
            )
        raws.append(raw)
    seqs = [load_sequences(path.with_suffix(f".{i}.parquet"))[1][0] for i in range(len(prompts))]
    return raws, seqs


def test_deepseek_rank_order_sorted_validated_and_in_stats(deepseek32, tmp_path: Path, cli):
    from daopsim.simulator.stats import trace_stats

    new = 5
    moe = find_moe_layers(deepseek32)
    assert not any(bool(m.router.e_score_correction_bias.any()) for m in moe)  # as initialised
    path = tmp_path / "ds.parquet"
    capture_model(deepseek32, PROMPTS, path, GenerationSettings(max_new_tokens=new), "ds", "fp32")
    meta, seqs = load_sequences(path)
    assert (meta.model.experts, meta.model.top_k) == (32, 6)
    assert "e_score_correction_bias" in meta.provenance["rank_order"]
    assert meta.provenance["rank_order_columns"] == ["weights", "probs"]
    result = cli("trace", "validate", path)
    assert result.exit_code == 0, result.output

    raws, alone = _capture_raw(deepseek32, PROMPTS, tmp_path / "alone.parquet", new)
    unsorted_rows = 0
    top1_raw: list[list[float]] = [[] for _ in moe]  # decode rows, rank 0 as the router gave it
    top1_sorted: list[list[float]] = [[] for _ in moe]
    for seq, single, raw in zip(seqs, alone, raws, strict=True):
        np.testing.assert_array_equal(seq.experts, single.experts)  # batch 1 either way
        assert len(raw.calls) == len(moe) * (1 + new)  # the prefill and one pass per token
        logits, weights, ids = raw.per_layer(0), raw.per_layer(1), raw.per_layer(2)
        for j, m in enumerate(moe):
            score = np.take_along_axis(_ds_score(m.router, logits[j]), ids[j], axis=1)
            unsorted_rows += int((score.argmax(axis=1) != 0).sum())
            # same experts, now in descending selection score, each with its own weight
            got = seq.experts[:, j].astype(np.int64)
            np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(ids[j], axis=1))
            got_score = np.take_along_axis(_ds_score(m.router, logits[j]), got, axis=1)
            assert (np.diff(got_score, axis=1) <= 1e-7).all()
            pos = np.argmax(ids[j][:, None, :] == got[:, :, None], axis=2)
            np.testing.assert_allclose(
                seq.weights[:, j], np.take_along_axis(weights[j], pos, axis=1), rtol=1e-6
            )
            dec = slice(seq.n_prefill, None)
            best = np.take_along_axis(weights[j], score.argmax(axis=1)[:, None], axis=1)[:, 0]
            total = weights[j].sum(axis=1)
            top1_sorted[j] += (best / total)[dec].tolist()
            top1_raw[j] += (weights[j][:, 0] / total)[dec].tolist()
            if j:  # the one-layer-early view is sorted the same way
                e_logits, e_ids = raw.early(j)
                e_got = seq.early_experts[:, j].astype(np.int64)
                np.testing.assert_array_equal(np.sort(e_got, axis=1), np.sort(e_ids, axis=1))
                e_score = np.take_along_axis(_ds_score(m.router, e_logits), e_got, axis=1)
                assert (np.diff(e_score, axis=1) <= 1e-7).all()
    assert unsorted_rows > 0  # the router really returns unsorted rows

    expected = float(np.mean([np.mean(v) for v in top1_sorted]))
    as_returned = float(np.mean([np.mean(v) for v in top1_raw]))
    assert trace_stats(path)["mean_top1_weight"] == pytest.approx(expected, rel=1e-6)
    assert expected > as_returned + 1e-3  # what stats reported before capture sorted
    result = cli("trace", "stats", path, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["mean_top1_weight"] == pytest.approx(expected, rel=1e-6)

    # the check is live: the router's own order fails validation, naming row and column
    first = seqs[0]
    raw_ids = raws[0].per_layer(2)
    raw_w = raws[0].per_layer(1)
    first.experts = np.stack(raw_ids, axis=1).astype(np.int16)
    first.weights = np.stack(raw_w, axis=1).astype(np.float32)
    bad = write_trace(tmp_path / "raw.parquet", meta, [first])
    with pytest.raises(TraceError, match=r"row \d+: column 'weights': not in rank order"):
        validate_trace(bad)


def test_deepseek_bias_correction_orders_rows(deepseek32, tmp_path: Path):
    moe = find_moe_layers(deepseek32)
    gen = torch.Generator().manual_seed(4)
    # as a trained model has: a bias large enough to move experts past each other
    biases = [0.05 * torch.randn(32, generator=gen) for _ in moe]
    try:
        for m, b in zip(moe, biases, strict=True):
            m.router.e_score_correction_bias.copy_(b)
        raws, (seq,) = _capture_raw(deepseek32, PROMPTS[:1], tmp_path / "b.parquet", 2)
    finally:
        for m in moe:
            m.router.e_score_correction_bias.zero_()
    meta = validate_trace(tmp_path / "b.0.parquet")
    assert meta.provenance["rank_order"] == (
        "selection score (sigmoid of router logits + e_score_correction_bias)"
    )
    assert meta.provenance["rank_order_columns"] == []  # nothing stored follows that score
    logits = raws[0].per_layer(0)
    weights_rise = False
    for j, b in enumerate(biases):
        score = 1.0 / (1.0 + np.exp(-logits[j].astype(np.float64))) + b.numpy()
        got = np.take_along_axis(score, seq.experts[:, j].astype(np.int64), axis=1)
        assert (np.diff(got, axis=1) <= 1e-7).all()
        weights_rise |= bool((np.diff(seq.weights[:, j], axis=1) > 0).any())
    assert weights_rise  # so the validator must not check weights for such a trace


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
    from daopsim.simulator.capture_layers import model_shape

    shape = model_shape(mixtral, find_moe_layers(mixtral), "tiny", "bf16")
    c = mixtral.config
    assert shape.params_per_expert == 3 * c.hidden_size * c.intermediate_size
    total = sum(p.numel() for p in mixtral.parameters())
    assert shape.non_expert_params == total - 4 * 8 * shape.params_per_expert
    assert shape.embedding_params == c.vocab_size * c.hidden_size
    assert shape.kv_bytes_per_token == 2 * 4 * 2 * (32 // 4) * 2
    assert (shape.experts, shape.top_k, shape.layers) == (8, 2, 4)
    # the query heads come from the config, so an eager runtime can charge a captured model
    assert shape.attention_heads == c.num_attention_heads > 0


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


def test_same_seed_same_day_gives_byte_identical_traces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\nthe quick brown fox\n")

    def capture(name: str, seed: int = 5) -> Path:
        out = tmp_path / name
        args = ["capture", "--random-init", "mixtral", "--prompts", str(prompts)]
        args += ["--max-new-tokens", "3", "--seed", str(seed), "--no-progress", "-o", str(out)]
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 0, res.output
        return out

    # created is a UTC date, not a timestamp: captures of one day are byte-identical
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    created = read_meta(capture("today.parquet")).provenance["created"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", created)
    # SOURCE_DATE_EPOCH pins the date (so this test cannot straddle midnight)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    a, b = capture("a.parquet"), capture("b.parquet")
    assert read_meta(a).provenance["created"] == "2023-11-14"
    assert a.read_bytes() == b.read_bytes()
    other = capture("c.parquet", seed=6)  # another seed is another model
    assert other.read_bytes() != a.read_bytes()
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    res = CliRunner().invoke(
        main,
        [
            "capture",
            "--random-init",
            "mixtral",
            "--prompts",
            str(prompts),
            "-o",
            str(tmp_path / "d.parquet"),
        ],
    )
    assert res.exit_code == 2 and "SOURCE_DATE_EPOCH='yesterday'" in res.output
    assert not (tmp_path / "d.parquet").exists()


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
    runner = pytest.importorskip("daopsim.simulator.runner")
    from daopsim.simulator.calibration import split_sequences

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
    evaluated, _ = split_sequences(read_meta(path), [0, 1, 2], None, False, hold_out=False)
    assert lru.metrics["sequences"] == len(evaluated) >= 2
    assert lru.metrics["decode_tokens"] == len(evaluated) * NEW
    assert 0 < lru.metrics["hit_rate"] < 1
    full = runner.simulate(policy="all-gpu", hw="a6000-pcie4", trace=path)
    assert full.metrics["hit_rate"] == 1
