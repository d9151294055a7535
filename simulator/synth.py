"""Synthetic routing traces that follow the mechanism of real MoE routing.

Each token carries a latent residual stream ``h`` that drifts from layer to layer
(``h_l = a_l * h_{l-1} + sqrt(1 - a_l^2) * u_l``). The fresh part ``u_l`` mixes three sources:

* a token-to-token AR(1) component (what makes consecutive tokens reuse experts),
* a per-sequence topic vector, redrawn partly when generation starts (``phase_keep``): the topic
  is why prefill predicts decode, the redraw is the phase effect that keeps the prefill/decode
  cosine below what independent routing would give,
* fresh noise.

Each MoE layer has a router: a projection ``W_l`` (fixed per model, from ``model_seed``), a
temperature and a per-expert popularity bias. Softmax gives probabilities, the top-k are
renormalised into gate weights. The one-layer-early view applies layer l's router to layer
l-1's latent, the way real next-layer predictors do.

Everything is vectorised numpy and deterministic: the same arguments give a byte-identical
file. Calibration (``PRESETS``) and ``fit_params`` are described in docs/synthetic-traces.md.

This module is the generator and the writing of a synthetic trace (its source is part of the
synthetic-trace cache key, simulator/trace_cache.py); it also holds the public names of
``synth_params`` (``SynthParams``, the calibrated ``PRESETS``) and ``synth_stats`` (the routing
statistics the presets are calibrated against).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from daopsim.simulator.errors import UserError, check_seed
from daopsim.simulator.models import ModelShape, get_model
from daopsim.simulator.synth_params import (
    PRESETS,
    SynthParams,
    SynthPreset,
    default_preset,
    get_preset,
    params_from_dict,
    parse_param_overrides,
)
from daopsim.simulator.synth_stats import (
    EXTRA_STAT_KEYS,
    POPULARITY_BUDGETS,
    STAT_KEYS,
    TRAFFIC_SHARE,
    routing_stats,
    traffic_concentration,
)
from daopsim.simulator.trace_format import (
    ALL_PROBS_MAX_EXPERTS,
    MAX_POSITION,
    SequenceRouting,
    TraceMeta,
)
from daopsim.simulator.trace_write import TraceWriter

#: Bumped whenever the generator's output for given parameters changes.
SYNTH_VERSION = "1"
GENERATOR = f"daopsim.synth v{SYNTH_VERSION}"


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


@dataclass
class _Router:
    """Per-model fixed parts: projections [L, E, D], biases [L, E], schedules [L]."""

    w: np.ndarray
    bias: np.ndarray
    retain: np.ndarray
    temporal: np.ndarray
    prefill_bias: np.ndarray | None = None  # extra [L, E] logit bias of prompt tokens


def _router(model: ModelShape, p: SynthParams) -> _Router:
    n_layers, n_exp, d = model.moe_layers, model.experts, p.latent_dim
    rng = np.random.default_rng([p.model_seed, n_layers, n_exp, d, 7919])
    w = rng.standard_normal((n_layers, n_exp, d)) / math.sqrt(d)
    z = rng.standard_normal((n_layers, n_exp))
    z -= z.mean(axis=1, keepdims=True)
    layer = np.arange(n_layers, dtype=np.float64)
    retain = p.drift - (p.drift - p.drift_first) * np.exp(-(layer - 1.0) / p.drift_tau)
    retain[0] = 0.0
    if n_layers > 2:
        retain[-1] = p.drift_last
    temporal = np.full(n_layers, p.temporal_share)
    temporal[0] *= p.temporal_first
    if n_layers > 1:
        temporal[-1] *= p.temporal_last
    temporal = np.clip(temporal, 0.0, 1.0 - p.topic_share)
    bias = p.bias_std * z
    if p.bias_first != 1.0:
        bias[0] *= p.bias_first
    pre = None
    if p.prefill_bias > 0:
        # its own stream, so the draws above (and traces without it) do not change
        prng = np.random.default_rng([p.model_seed, n_layers, n_exp, d, 7927])
        zp = prng.standard_normal((n_layers, n_exp))
        pre = p.prefill_bias * (zp - zp.mean(axis=1, keepdims=True))
    return _Router(w=w, bias=bias, retain=retain, temporal=temporal, prefill_bias=pre)


def _logits(h: np.ndarray, w: np.ndarray, bias: np.ndarray, temperature: float) -> np.ndarray:
    """Router logits [T, E] for one layer, by elementwise multiply-adds (no BLAS, so the
    result does not depend on thread count or BLAS build)."""
    out = np.zeros((h.shape[0], w.shape[0]))
    for j in range(w.shape[1]):
        out += h[:, j, None] * w[None, :, j]
    out /= temperature
    out += bias
    return out


def _route(
    logits: np.ndarray, k: int, m: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Softmax, top-k (descending) and renormalised weights; top-m probs when m < E."""
    z = logits - logits.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    n_exp = z.shape[-1]
    keep = max(k, m) if m < n_exp else n_exp
    if keep < n_exp:
        part = np.argpartition(-z, keep - 1, axis=-1)[..., :keep]
        vals = np.take_along_axis(z, part, axis=-1)
        order = np.argsort(-vals, axis=-1, kind="stable")
        ids = np.take_along_axis(part, order, axis=-1)
    else:
        ids = np.argsort(-z, axis=-1, kind="stable")
    top = ids[..., :k]
    top_p = np.take_along_axis(z, top, axis=-1)
    weights = top_p / top_p.sum(axis=-1, keepdims=True)
    if m < n_exp:
        pid = ids[..., :m]
        return top, weights, np.take_along_axis(z, pid, axis=-1), pid
    return top, weights, z, None


def generate_sequence(
    model: ModelShape,
    p: SynthParams,
    seq_id: int,
    n_prefill: int,
    n_decode: int,
    seed: int,
    router: _Router | None = None,
) -> SequenceRouting:
    """One synthetic sequence; depends only on (model, params, seed, seq_id, lengths)."""
    router = router or _router(model, p)
    t = n_prefill + n_decode
    h = _hidden_states(model, p, router, seed, seq_id, n_prefill, n_decode)
    return SequenceRouting(
        seq_id=seq_id,
        positions=np.arange(t, dtype=np.int32),
        n_prefill=n_prefill,
        **_route_layers(model, p, router, h, n_prefill),
    )


def _hidden_states(
    model: ModelShape,
    p: SynthParams,
    router: _Router,
    seed: int,
    seq_id: int,
    n_prefill: int,
    n_decode: int,
) -> np.ndarray:
    """The latent router inputs ``[tokens, layers, latent_dim]`` of one sequence: a
    token-to-token AR(1) part, the prompt's and the answer's topic, noise, each layer keeping
    part of the previous layer's state; all drawn from the sequence's own streams."""
    n_layers, d = model.moe_layers, p.latent_dim
    t = n_prefill + n_decode
    rng = np.random.default_rng([seed, seq_id, 104729])
    # token-to-token AR(1) component, one independent stream per layer
    ar = rng.standard_normal((t, n_layers, d))
    rho = p.token_corr
    scale = math.sqrt(1.0 - rho * rho)
    for i in range(1, t):
        ar[i] *= scale
        ar[i] += rho * ar[i - 1]
    topic_p = rng.standard_normal(d)
    topic_d = math.sqrt(p.phase_keep) * topic_p + math.sqrt(
        1.0 - p.phase_keep
    ) * rng.standard_normal(d)
    topic = np.empty((t, 1, d))
    topic[:n_prefill, 0] = topic_p
    topic[n_prefill:, 0] = topic_d
    noise = rng.standard_normal((t, n_layers, d))
    # parameters added after v1 draw from their own stream, so traces without them keep bytes
    late = np.random.default_rng([seed, seq_id, 104729, 2]) if _uses_late(p) else None
    if late is not None and p.topic_drift > 0:
        _drift_topic(topic, n_prefill, p.topic_drift, p.phase_keep, late)
    ts = router.temporal[None, :, None]
    fresh = (
        np.sqrt(ts) * ar
        + math.sqrt(p.topic_share) * topic
        + np.sqrt(np.clip(1.0 - ts - p.topic_share, 0.0, None)) * noise
    )
    h = np.empty_like(fresh)
    h[:, 0] = fresh[:, 0]
    for layer in range(1, n_layers):
        a = router.retain[layer]
        h[:, layer] = a * h[:, layer - 1] + math.sqrt(1.0 - a * a) * fresh[:, layer]
    if late is not None and p.repeat_prob > 0 and t > 1:
        h = _repeat_previous(h, p.repeat_prob, late)
    return h


def _route_layers(
    model: ModelShape, p: SynthParams, router: _Router, h: np.ndarray, n_prefill: int
) -> dict[str, np.ndarray | None]:
    """Each layer's routing of the states ``h`` (experts, weights, stored probabilities and
    their ids) and the early view: layer l's router on layer l-1's state; the
    ``SequenceRouting`` fields by name."""
    t, n_layers, k = h.shape[0], model.moe_layers, model.top_k
    n_exp = model.experts
    m = n_exp if n_exp <= ALL_PROBS_MAX_EXPERTS else min(p.top_m, n_exp)
    width = m
    experts = np.empty((t, n_layers, k), dtype=np.int16)
    weights = np.empty((t, n_layers, k), dtype=np.float32)
    probs = np.empty((t, n_layers, width), dtype=np.float32)
    e_experts = np.full((t, n_layers, k), -1, dtype=np.int16)
    e_probs = np.full((t, n_layers, width), np.nan, dtype=np.float32)
    pids = np.empty((t, n_layers, width), dtype=np.int16) if m < n_exp else None
    e_pids = np.full((t, n_layers, width), -1, dtype=np.int16) if m < n_exp else None
    pre = router.prefill_bias
    for layer in range(n_layers):
        w, b = router.w[layer], router.bias[layer]
        logits = _logits(h[:, layer], w, b, p.temperature)
        if pre is not None:
            logits[:n_prefill] += pre[layer]
        top, wt, pr, pid = _route(logits, k, m)
        experts[:, layer], weights[:, layer], probs[:, layer] = top, wt, pr
        if pids is not None:
            pids[:, layer] = pid
        if layer > 0:
            logits = _logits(h[:, layer - 1], w, b, p.temperature)
            if pre is not None:
                logits[:n_prefill] += pre[layer]
            top, _, pr, pid = _route(logits, k, m)
            e_experts[:, layer], e_probs[:, layer] = top, pr
            if e_pids is not None:
                e_pids[:, layer] = pid
    return {
        "experts": experts,
        "weights": weights,
        "probs": probs,
        "early_experts": e_experts,
        "early_probs": e_probs,
        "prob_ids": pids,
        "early_prob_ids": e_pids,
    }


def _uses_late(p: SynthParams) -> bool:
    return p.repeat_prob > 0 or p.topic_drift > 0


def _drift_topic(
    topic: np.ndarray, n_prefill: int, drift: float, phase_keep: float, rng: np.random.Generator
) -> None:
    """Let the topic wander: an AR(1) over tokens that keeps unit variance.

    Each token keeps ``sqrt(1 - drift)`` of the previous token's topic and adds
    ``sqrt(drift)`` of a fresh draw, so the per-sequence leaning decorrelates over about
    ``1 / drift`` tokens instead of lasting the whole phase. The first generated token keeps
    ``sqrt(phase_keep)`` of the last prompt token's topic plus the same redrawn part as
    without drift (the phase effect).
    """
    t, _, d = topic.shape
    keep, add = math.sqrt(1.0 - drift), math.sqrt(drift)
    fresh = rng.standard_normal((t, d))
    redrawn = topic[n_prefill, 0] - math.sqrt(phase_keep) * topic[0, 0] if 0 < n_prefill < t else 0
    for i in range(1, t):
        if i == n_prefill:
            topic[i, 0] = math.sqrt(phase_keep) * topic[i - 1, 0] + redrawn
        else:
            topic[i, 0] = keep * topic[i - 1, 0] + add * fresh[i]


def _repeat_previous(h: np.ndarray, prob: float, rng: np.random.Generator) -> np.ndarray:
    """With chance ``prob`` per (token, layer), the token reuses the previous token's latent.

    A reused latent routes exactly as the previous token did at that layer (a chain of
    repeats reuses the last fresh one), which is a short-memory reuse: it adds ``prob`` times
    the set's novelty at lag 1 and ``prob**n`` at lag n.
    """
    t, n_layers, _ = h.shape
    repeat = rng.random((t, n_layers)) < prob
    repeat[0] = False
    tok = np.arange(t)[:, None]
    src = np.maximum.accumulate(np.where(repeat, 0, tok), axis=0)
    return h[src, np.arange(n_layers)[None, :]]


#: The most memory one synthetic sequence may take to generate, bytes: its per-token arrays
#: (latent states, router outputs, the one-layer-early view) over every MoE layer.
MAX_SEQUENCE_BYTES = 8 * 2**30


def check_sequence_size(
    model: ModelShape, p: SynthParams, prompt_tokens: int, output_tokens: int
) -> None:
    """A UserError naming the options when one sequence of ``prompt_tokens + output_tokens``
    tokens would take more than :data:`MAX_SEQUENCE_BYTES` to generate (3e9 prompt tokens
    once asked NumPy for 5.6 TiB and printed its traceback), or overflow the trace format's
    positions; the message gives the most tokens that fit."""
    width = model.experts if model.experts <= ALL_PROBS_MAX_EXPERTS else min(p.top_m, model.experts)
    # per token and layer: two latent float64 vectors, probabilities, ids and the early view,
    # top-k ids and weights; per token: one layer's float64 logits at a time
    per_token = model.moe_layers * (16 * p.latent_dim + 12 * width + 8 * model.top_k)
    per_token += 16 * model.experts
    tokens = prompt_tokens + output_tokens
    most = min(MAX_SEQUENCE_BYTES // per_token, MAX_POSITION + 1)
    if tokens > most:
        raise UserError(
            f"--prompt-tokens {prompt_tokens} and --output-tokens {output_tokens}: a sequence "
            f"of {tokens:,} tokens of {model.name} would take {tokens * per_token / 1e9:.3g} GB "
            f"to generate; at most {most:,} tokens per sequence"
        )


def iter_synthetic(
    model: ModelShape,
    p: SynthParams,
    sequences: int,
    prompt_tokens: int,
    output_tokens: int,
    seed: int,
) -> Iterator[SequenceRouting]:
    """Sequences 0..sequences-1 (each independent of how many are asked for)."""
    check_seed(seed)
    p.check()
    check_sequence_size(model, p, prompt_tokens, output_tokens)
    router = _router(model, p)
    for s in range(sequences):
        yield generate_sequence(model, p, s, prompt_tokens, output_tokens, seed, router)


def calibration_split(sequences: int) -> list[int]:
    """Sequences held out as calibration data: the last quarter (at least one if > 1)."""
    if sequences < 2:
        return []
    n = max(1, sequences // 4)
    return list(range(sequences - n, sequences))


def synth_meta(
    model: ModelShape,
    p: SynthParams,
    sequences: int,
    prompt_tokens: int,
    output_tokens: int,
    seed: int,
    preset: str | None,
) -> TraceMeta:
    """Trace metadata saying plainly that the trace is synthetic, and how it was made."""
    m = model.experts if model.experts <= ALL_PROBS_MAX_EXPERTS else min(p.top_m, model.experts)
    args = {
        "model": model.name,
        "sequences": sequences,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "seed": seed,
        "preset": preset,
    }
    provenance = {
        "source": "synthetic",
        "generator": GENERATOR,
        "preset": preset,
        "parameters": p.to_dict(),
        "seed": seed,
        "arguments": args,
        # Fixed, not wall-clock, so the same arguments give the same bytes.
        "created": f"deterministic: synthetic trace, seed {seed}",
        # Only what shapes the bytes; daopsim's own version is left out on purpose.
        "tool_versions": {
            "synth": SYNTH_VERSION,
            "numpy": np.__version__,
            "pyarrow": pa.__version__,
        },
    }
    return TraceMeta(
        model=model,
        provenance=provenance,
        probs_stored=m,
        moe_layer_ids=[model.first_moe_layer + i for i in range(model.moe_layers)],
        calibration_sequences=calibration_split(sequences),
    )


def write_synthetic(
    path: str | os.PathLike[str],
    model: ModelShape | str,
    p: SynthParams,
    sequences: int,
    prompt_tokens: int,
    output_tokens: int,
    seed: int,
    preset: str | None = None,
) -> TraceMeta:
    """Generate and write a synthetic trace atomically; returns its metadata."""
    if isinstance(model, str):
        model = get_model(model)
    if sequences < 1:
        raise UserError("--sequences must be >= 1")
    if prompt_tokens < 1 or output_tokens < 1:
        raise UserError("--prompt-tokens and --output-tokens must be >= 1")
    p.check()
    meta = synth_meta(model, p, sequences, prompt_tokens, output_tokens, seed, preset)
    with TraceWriter(path, meta) as writer:
        for routing in iter_synthetic(model, p, sequences, prompt_tokens, output_tokens, seed):
            writer.write_sequence(routing)
    return meta


def synth(
    path: str | os.PathLike[str],
    model: str,
    sequences: int,
    prompt_tokens: int = 256,
    output_tokens: int = 512,
    seed: int = 0,
    preset: str | None = None,
    params: dict[str, object] | None = None,
) -> TraceMeta:
    """Write a synthetic trace, as ``daopsim synth`` does: the model's own preset (or
    ``preset``, a name or a file of ``synth fit``) with ``params`` overriding single generator
    parameters, validated, then renamed into place. Returns the trace's metadata."""
    from daopsim.simulator.models import get_model
    from daopsim.simulator.output import TRACE_FORMATS, check_output_file, os_errors, output_format
    from daopsim.simulator.synth_checks import write_validated

    shape = get_model(model)
    chosen = get_preset(preset) if preset else default_preset(shape.name)
    base = chosen.params if chosen else SynthParams()
    p = params_from_dict(dict(params or {}), base=base, where="--param")
    output_format(path, TRACE_FORMATS, "-o")
    check_output_file(path, "-o", inputs=[preset])
    name = chosen.name if chosen else None
    with os_errors(path, "-o"):
        return write_validated(
            path,
            lambda tmp: write_synthetic(
                tmp, shape, p, sequences, prompt_tokens, output_tokens, seed, preset=name
            ),
        )


__all__ = [
    "EXTRA_STAT_KEYS",
    "GENERATOR",
    "MAX_SEQUENCE_BYTES",
    "POPULARITY_BUDGETS",
    "PRESETS",
    "STAT_KEYS",
    "SYNTH_VERSION",
    "TRAFFIC_SHARE",
    "SynthParams",
    "SynthPreset",
    "calibration_split",
    "check_sequence_size",
    "default_preset",
    "generate_sequence",
    "get_preset",
    "iter_synthetic",
    "params_from_dict",
    "parse_param_overrides",
    "routing_stats",
    "synth",
    "synth_meta",
    "traffic_concentration",
    "write_synthetic",
]
