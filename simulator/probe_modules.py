"""Module microbenchmarks of ``daopsim probe``: PyTorch eager's host time per module, and the
device time of modules shaped like a model (``--model``), on the installed transformers.

Each module of a decoder block is timed on its own, on one thread (thread CPU time, the minimum
over repeats; docs/cost-model.md, "A device on the host thread"), the way the model calls it:

* **After the model's traffic.** Between two calls of the same code the model reads other data:
  a layer's attention and routed experts between two layers, one expert's weights between two
  expert calls, the whole model between two forward passes. That traffic evicts the caches the
  interpreter and PyTorch's dispatcher run from, and a call after it costs more host time than
  the same call repeated back to back (by 200 us a call when the last-level cache was flushed,
  on the machine these docs were written on). So before each timed call the probe reads as
  many bytes of a separate buffer (untimed) as the model reads between two such calls (at most
  twice the last-level cache): an expert call in context, not alone.
* **Host time** (runtime profile): the module at a width where its arithmetic is negligible
  (hidden size 64, expert FFN 16, a 128-token vocabulary, as many heads as the model): the
  attention (projections, rotary, cache update, SDPA, output projection), an RMSNorm, the
  router, the decoder layer with its experts replaced by an empty output (the layer's own code
  is the layer minus its modules), the experts loop with 2 and 4 experts receiving the token
  (its fixed part), one iteration of the loop's body for one expert (transformers' eager loop,
  op for op), the same body for an expert with no token (what a loop over every expert pays
  per idle expert), and the model's own code per forward pass (a model with no layers:
  embedding, positions, mask, rotary tables, final norm, output head, and the greedy pick).
* **Device time** (hardware profile, ``[measured."<model>"]``): the same code at the model's
  width minus its time at the tiny width under the same traffic, at each token count of a
  prompt: one MoE layer's non-expert part at context 0 (with its share of the output head) and
  one routed expert's loop body. Full-width weights are visited in pools (several times the
  last-level cache when the model's weights do not fit in it), so they stream from DRAM as in
  the model.

Nothing here runs the model whose numbers are predicted: only its modules, one call at a time.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daopsim.simulator.hf_models import LoopShape
from daopsim.simulator.probe_bench import Timing, pool_count, torch_threads

#: the tiny width host times are measured at
TINY_HIDDEN = 64
TINY_FFN = 16
TINY_VOCAB = 128
#: token counts the device tables are measured at (up to the prompt length)
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64)


def tiny(shape: LoopShape, layers: int = 1) -> LoopShape:
    """``shape`` at the width host times are measured at."""
    return shape.with_width(TINY_HIDDEN, TINY_FFN, TINY_VOCAB, layers)


@dataclass
class _Parts:
    """One model's modules at one width: a pool of layers (experts replaced by an empty
    output), of experts modules (one expert each) and of models with no layers."""

    layers: list[Any]
    rotary: Any
    config: Any
    experts: list[Any]
    top: list[Any]
    heads: list[Any]


@dataclass(frozen=True)
class Traffic:
    """Bytes the model reads between two calls of the same code (``shape`` decoding one token):
    ``layer`` between two layers' non-expert parts (a layer's attention, router and top-k
    experts), ``expert`` between two expert calls (one expert), ``token`` between two forward
    passes (every layer and the output head); each at most twice the last-level cache."""

    layer: float
    expert: float
    token: float

    @classmethod
    def of(cls, shape: LoopShape, llc: float | None) -> Traffic:
        bpp = shape.bytes_per_param
        attn = attention_bytes(shape)
        layer = attn + shape.experts * shape.hidden * bpp + shape.top_k * shape.expert_bytes
        token = shape.layers * layer + shape.vocab * shape.hidden * bpp
        # reading a little more than the cache evicts what it held: more only costs time
        cap = 1.25 * llc if llc else 64e6
        return cls(min(layer, cap), min(shape.expert_bytes, cap), min(token, cap))


def attention_bytes(shape: LoopShape) -> int:
    """Bytes of one layer's attention projections (q, k, v, o)."""
    proj = (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim * shape.hidden
    return proj * shape.bytes_per_param


class Reader:
    """Untimed reads of a buffer of host memory (at least four times the last-level cache, so
    what it reads is never in the cache), a window at a time, moving on after each read."""

    def __init__(self, torch: Any, llc: float | None) -> None:
        self.n = int(max(64e6, 4 * (llc or 16e6)) // 4)
        self.buf = torch.empty(self.n, dtype=torch.float32).normal_()
        self.at = 0

    def read(self, nbytes: float) -> None:
        k = int(nbytes // 4)
        if k <= 0:
            return
        if self.at + k > self.n:
            self.at = 0
        self.buf[self.at : self.at + k].sum()
        self.at += k


def calls_pass(
    calls: list[Callable[[], Any]],
    reader: Reader | None = None,
    traffic: float = 0.0,
    reset: Callable[[], Any] | None = None,
) -> Callable[[], float]:
    """One pass over ``calls``, each timed on its own (thread CPU time) after ``traffic``
    bytes read by ``reader`` (untimed); returns the mean seconds per call. ``reset``
    (untimed) before the pass."""

    def one_pass() -> float:
        if reset is not None:
            reset()
        total = 0.0
        for fn in calls:
            if reader is not None:
                reader.read(traffic)
            t0 = time.thread_time()
            fn()
            total += time.thread_time() - t0
        return total / len(calls)

    return one_pass


class Schedule:
    """Measurements whose repeats run round-robin: one warm-up pass of each, then the first
    timed pass of every measurement, the second of every one, ... So on a machine others
    share, a disturbed stretch spoils one repeat of several measurements rather than every
    repeat of one, and each measurement's minimum is over the whole measuring time."""

    def __init__(self) -> None:
        self.passes: dict[str, Callable[[], float | dict[str, float]]] = {}

    def add(self, key: str, one_pass: Callable[[], float | dict[str, float]]) -> None:
        """A measurement: ``one_pass`` runs one pass and returns its seconds (or several named
        ones, reported as ``key.name``)."""
        self.passes[key] = one_pass

    def run(self, repeats: int, on_round: Callable[[], None] | None = None) -> dict[str, Timing]:
        """The minimum and median of every measurement over ``repeats`` rounds."""
        got: dict[str, list[float]] = {}
        for r in range(repeats + 1):
            for key, one_pass in self.passes.items():
                v = one_pass()
                if not r:
                    continue  # the warm-up round
                for k, x in v.items() if isinstance(v, dict) else [("", v)]:
                    got.setdefault(f"{key}.{k}" if k else key, []).append(x)
            if on_round is not None:
                on_round()
        out = {}
        for key, runs in got.items():
            runs.sort()
            out[key] = Timing(runs[0], runs[len(runs) // 2], len(runs), "thread")
        return out


def _model_config(shape: LoopShape, layers: int, vocab: int, ffn: int, experts: int) -> Any:
    """The transformers config of ``shape`` with these sizes (``layers`` may be 0)."""
    s = dataclasses.replace(
        shape,
        layers=max(1, layers),
        vocab=vocab,
        expert_ffn=ffn,
        experts=experts,
        top_k=min(shape.top_k, experts),
    )
    cfg = s.hf_config()
    cfg.num_hidden_layers = layers
    return cfg


def _model(torch: Any, shape: LoopShape, layers: int, vocab: int, ffn: int, experts: int) -> Any:
    from transformers import AutoModelForCausalLM

    from daopsim.simulator.hf_models import torch_dtype

    cfg = _model_config(shape, layers, vocab, ffn, experts)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(
        cfg,
        dtype=torch_dtype(torch, shape.dtype),
        experts_implementation="eager",
        attn_implementation="sdpa",
    )
    return m.eval()


def _noop_experts(mod: Any) -> None:
    """Replace an experts module's forward by an empty output (the layer without experts)."""

    def forward(hidden: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        import torch

        return torch.zeros_like(hidden)

    mod.forward = forward


def model_weight_bytes(shape: LoopShape) -> int:
    """Bytes of every weight of ``shape``: attention, routers, experts, embedding, output head."""
    bpp = shape.bytes_per_param
    attn = (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim * shape.hidden
    per_layer = attn + shape.experts * (shape.hidden + 3 * shape.hidden * shape.expert_ffn)
    return (shape.layers * per_layer + 2 * shape.vocab * shape.hidden) * bpp


def pools(shape: LoopShape, llc: float | None) -> tuple[int, int, int]:
    """How many layers, experts (one per module) and output heads a pool of full-width modules
    holds. A model whose weights exceed the last-level cache streams them from DRAM (every
    weight is read once per token, in turn, so a cache smaller than the model keeps none of
    them): pools of at least 4x the cache. A model that fits stays in the cache: a pool as
    large as the model (its layers, its experts, one head)."""
    bpp = shape.bytes_per_param
    if llc is None or model_weight_bytes(shape) > llc:
        return (
            pool_count(attention_bytes(shape), llc),
            pool_count(shape.expert_bytes, llc),
            pool_count(shape.vocab * shape.hidden * bpp, llc, minimum=1),
        )
    return shape.layers, shape.layers * shape.experts, 1


def _init(torch: Any, module: Any, std: float = 0.1) -> Any:
    """Every parameter of ``module`` drawn from N(0, std) (norm weights too: only the time
    matters), in eval mode."""
    with torch.no_grad():
        for prm in module.parameters():
            prm.normal_(0.0, std)
    return module.eval()


def _stack(torch: Any, shape: LoopShape, n_layers: int, n_experts: int, n_top: int) -> _Parts:
    """The modules of ``shape``: ``n_layers`` decoder layers whose experts are replaced by an
    empty output (their non-expert parts), ``n_experts`` experts modules of one expert each,
    ``n_top`` models with no layers (the model's own top part); built module by module."""
    from daopsim.simulator.hf_models import torch_dtype

    dt = torch_dtype(torch, shape.dtype)
    top = _model(torch, shape, 0, shape.vocab, 1, shape.experts)
    one = _model(torch, shape, 1, TINY_VOCAB, 1, shape.experts)
    layer_cls = type(one.model.layers[0])
    experts_cls = type(one.model.layers[0].mlp.experts)
    cfg = one.config
    cfg.num_hidden_layers = n_layers
    layers = []
    for i in range(n_layers):
        layer = _init(torch, layer_cls(cfg, i).to(dt))
        _noop_experts(layer.mlp.experts)
        layers.append(layer)
    ecfg = _model_config(shape, 1, TINY_VOCAB, shape.expert_ffn, 1)
    experts = [_init(torch, experts_cls(ecfg).to(dt)) for _ in range(n_experts)]
    # one model's top part, with a pool of output heads put in turn (building whole models
    # for a pool would take longer than measuring them)
    heads = [top.lm_head.weight.data] + [
        torch.empty_like(top.lm_head.weight.data).normal_(0.0, 0.1) for _ in range(n_top - 1)
    ]
    return _Parts(
        layers=layers,
        rotary=one.model.rotary_emb,
        config=cfg,
        experts=experts,
        top=[top],
        heads=heads,
    )


def _cache(config: Any, layers: int = 0, ctx: int = 0, like: Any = None) -> Any:
    """A new KV cache; with ``ctx``, each of ``layers`` layers holds ``ctx`` tokens (``like``:
    a [1, kv_heads, ctx, head_dim] tensor)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i in range(layers if ctx else 0):
        cache.update(like, like.clone(), i)
    return cache


def _layer_calls(
    torch: Any, p: _Parts, shape: LoopShape, n: int, ctx: int, count: int
) -> tuple[list[Callable[[], Any]], Callable[[], Any]]:
    """Calls of the pool's layers (``count`` in all, in turn; non-expert part, experts empty)
    for n new tokens at context ``ctx``, and the reset giving them fresh caches."""
    from daopsim.simulator.hf_models import torch_dtype

    dt = torch_dtype(torch, shape.dtype)
    x = torch.randn(1, n, shape.hidden, dtype=dt)
    pos = torch.arange(ctx, ctx + n).unsqueeze(0)
    with torch.no_grad():
        pe = p.rotary(x, pos)
    like = torch.zeros(1, shape.kv_heads, ctx, shape.head_dim, dtype=dt)
    held: list[Any] = [None]

    def reset() -> None:
        held[0] = _cache(p.config, len(p.layers), ctx, like)

    def call(layer: Any) -> Callable[[], Any]:
        return lambda: layer(
            x,
            position_embeddings=pe,
            attention_mask=None,
            position_ids=pos,
            cache=held[0],
            use_cache=True,
        )

    return [call(p.layers[i % len(p.layers)]) for i in range(count)], reset


def expert_body(torch: Any, m: Any, n: int, e: int = 0) -> Callable[[], Any]:
    """One iteration of transformers 5.x's eager experts loop for expert ``e`` of module ``m``
    with ``n`` tokens (every token routes to it; ``e`` no token chose: an idle pass), op for
    op: the hit list's row and end check, the mask row's ``where``, the gather, the two
    linears, activation and product, the routing weight, the scatter-add."""
    F = torch.nn.functional
    dt = m.gate_up_proj.dtype
    x = torch.randn(n, m.hidden_dim, dtype=dt)
    idx = torch.zeros(n, 1, dtype=torch.long)
    mask = F.one_hot(idx, num_classes=m.num_experts + 1).permute(2, 1, 0)
    hit = torch.tensor([[e]])
    w = torch.ones(n, 1, dtype=dt)
    final = torch.zeros_like(x)

    def body() -> None:
        with torch.no_grad():
            expert_idx = hit[0][0]
            if expert_idx == m.num_experts:
                return
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            current = x[token_idx]
            gate, up = F.linear(current, m.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            h = m.act_fn(gate) * up
            h = F.linear(h, m.down_proj[expert_idx])
            h = h * w[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, h.to(final.dtype))

    return body


def _top_calls(
    torch: Any, p: _Parts, n: int, vocab: int, count: int
) -> tuple[list[Callable[[], Any]], Callable[[], Any]]:
    """Forward passes of the pool's models with no layers plus the greedy pick, as the loop
    does it (``logits_to_keep=1``); the reset makes their caches (before the clock)."""
    ids = torch.randint(3, vocab, (1, n))
    held: list[Any] = []

    top = p.top[0]

    def reset() -> None:
        held[:] = [_cache(top.config) for _ in range(count)]

    def call(i: int) -> Callable[[], Any]:
        head = p.heads[i % len(p.heads)]

        def run() -> None:
            top.lm_head.weight.data = head  # the pool's next output head (a pointer)
            with torch.no_grad():
                out = top(input_ids=ids, cache=held[i], use_cache=True, logits_to_keep=1)
                out.logits[:, -1].argmax(-1, keepdim=True)

        return run

    return [call(i) for i in range(count)], reset


def _module_clock(torch: Any, modules: dict[str, list[Any]]) -> tuple[dict[str, list[float]], Any]:
    """Forward hooks that add each named module's thread CPU time (per call) to a list, and a
    function removing them."""
    times: dict[str, list[float]] = {k: [] for k in modules}
    started: dict[int, float] = {}
    handles = []
    for name, mods in modules.items():
        for mod in mods:

            def pre(m: Any, *_: Any) -> None:
                started[id(m)] = time.thread_time()

            def post(m: Any, *_: Any, name: str = name) -> None:
                times[name].append(time.thread_time() - started.pop(id(m)))

            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    def remove() -> None:
        for h in handles:
            h.remove()

    return times, remove


def host_costs(
    torch: Any, shape: LoopShape, repeats: int, llc: float | None, calls: int = 40
) -> dict[str, Timing]:
    """Host time of each module class of ``shape``'s architecture at the tiny width (one
    thread), each as the model runs it: keys ``layer`` (a decoder layer's non-expert part, its
    experts replaced by an empty output, after one layer's traffic), ``attention``, ``norm``
    and ``router`` (those modules inside that layer call, timed by forward hooks in a pass of
    their own), ``experts_noop`` (the empty replacement's call), ``experts_k2`` and
    ``experts_k4`` (the experts module with 2 and 4 experts receiving the token, right after
    the router as in the block), ``expert_body`` (one loop iteration for one token after one
    expert's traffic), ``empty_expert`` (the same for an expert with no token), ``step_n1``
    and ``step_n8`` (the model's own code per pass, 1 and 8 tokens, after a token's traffic)."""
    from daopsim.simulator.hf_models import torch_dtype

    s = tiny(shape)
    tr = Traffic.of(shape, llc)
    dt = torch_dtype(torch, s.dtype)
    out: dict[str, Timing] = {}

    def no_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> None:
            with torch.no_grad():
                fn()

        return run

    with torch_threads(torch, 1):
        reader = Reader(torch, llc)
        p = _stack(torch, s, 1, 1, 1)
        layer = p.layers[0]
        x2 = torch.randn(1, s.hidden, dtype=dt)
        layer_calls, reset = _layer_calls(torch, p, s, 1, 16, calls)
        layer_calls = [no_grad(c) for c in layer_calls]
        sched = Schedule()
        sched.add("layer", calls_pass(layer_calls, reader, tr.layer, reset))
        parts = {
            "attention": [layer.self_attn],
            "norm": [layer.input_layernorm, layer.post_attention_layernorm],
            "router": [layer.mlp.gate],
        }

        def hooked() -> dict[str, float]:  # the same calls, modules timed inside them
            times, remove = _module_clock(torch, parts)
            try:
                calls_pass(layer_calls, reader, tr.layer, reset)()
            finally:
                remove()
            return {k: sum(v) / len(v) for k, v in times.items()}

        sched.add("in_layer", hooked)
        idx2 = torch.arange(2).view(1, 2)
        w2 = torch.full((1, 2), 0.5, dtype=dt)
        # the layer above ran this in place of its experts: the module call and its output
        sched.add(
            "experts_noop",
            calls_pass([no_grad(lambda: layer.mlp.experts(x2, idx2, w2))] * calls),
        )
        ex = _model(torch, s, 1, TINY_VOCAB, s.expert_ffn, s.experts).model.layers[0].mlp.experts
        for k in (2, 4):
            idx = torch.arange(k).view(1, k)
            w = torch.full((1, k), 1.0 / k, dtype=dt)
            sched.add(
                f"experts_k{k}", calls_pass([no_grad(lambda i=idx, w=w: ex(x2, i, w))] * calls)
            )
        sched.add("expert_body", calls_pass([expert_body(torch, ex, 1)] * calls, reader, tr.expert))
        sched.add(
            "empty_expert", calls_pass([expert_body(torch, ex, 1, e=1)] * calls, reader, tr.expert)
        )
        for n in (1, 8):
            tops, treset = _top_calls(torch, p, n, TINY_VOCAB, calls)
            sched.add(f"step_n{n}", calls_pass(tops, reader, tr.token, treset))
        got = sched.run(repeats)
    out = {k.removeprefix("in_layer."): v for k, v in got.items()}
    return out


def _slot_module(torch: Any, m: Any) -> tuple[Any, Any]:
    """An experts module like ``m`` (one expert) whose weights are views of one flat buffer
    (a slot, as an offloading runtime packs an expert), and that buffer."""
    import copy

    gu, dn = m.gate_up_proj.data, m.down_proj.data
    flat = torch.cat([gu.reshape(-1), dn.reshape(-1)])
    slot = copy.deepcopy(m)
    slot.gate_up_proj.data = flat[: gu.numel()].view(gu.shape)
    slot.down_proj.data = flat[gu.numel() :].view(dn.shape)
    return slot, flat


def swap_pass(
    torch: Any,
    experts: list[Any],
    n: int,
    reader: Reader,
    traffic: float,
    warm: bool = False,
    count: int = 24,
) -> Callable[[], dict[str, float]]:
    """One pass of what a miss does on a CPU standing in for a GPU, step by step, over the
    pool of experts (packed into flat buffers, as offloading runtimes keep them): the
    write-back of a slot into the pool, the copy of the next pool expert into that slot, and
    its loop body for ``n`` tokens from the slot; each timed on its own (thread CPU seconds,
    the mean over the pass). Cold (``warm`` false): the slot's expert was computed earlier and
    ``traffic`` bytes were read since (untimed), as when the victim is an expert of an earlier
    token. Warm: one slot, whose expert was computed just before, as when the victim is an
    expert this layer already ran (fewer slots than routed experts). ``count`` swaps a pass
    (about a decode step's)."""
    pool = [
        torch.cat([m.gate_up_proj.data.reshape(-1), m.down_proj.data.reshape(-1)]) for m in experts
    ]
    slots = [_slot_module(torch, experts[0]) for _ in range(1 if warm else 2)]
    bodies = [expert_body(torch, sm, n) for sm, _ in slots]
    count = max(count, len(pool))

    def one_pass() -> dict[str, float]:
        acc = {"writeback": 0.0, "copy": 0.0, "body": 0.0}
        for i in range(count):
            j = i % len(slots)
            flat = slots[j][1]
            if not warm:
                reader.read(traffic)
            t0 = time.thread_time()
            pool[(i - 2) % len(pool)].copy_(flat)  # the slot's previous expert, written back
            t1 = time.thread_time()
            flat.copy_(pool[i % len(pool)])
            t2 = time.thread_time()
            bodies[j]()
            t3 = time.thread_time()
            acc["writeback"] += t1 - t0
            acc["copy"] += t2 - t1
            acc["body"] += t3 - t2
        return {k: v / count for k, v in acc.items()}

    return one_pass


def device_tables(
    torch: Any,
    shape: LoopShape,
    tokens: tuple[int, ...],
    llc_bytes: float | None,
    repeats: int,
    host: dict[str, Timing],
    on_step: Callable[[], None] | None = None,
    per_pass: int = 8,
) -> dict[str, Any]:
    """Device time of ``shape``'s modules at each token count (ms): ``layer_ms`` (one MoE
    layer's non-expert part at context 0, plus its share of the model's top part: output head
    and final norm), ``expert_ms`` (one routed expert's loop body) and ``copied_expert_ms``
    (the same right after its copy into a slot), and the swaps' copies. Each table is the
    full-width time (one thread, pools of weights, the model's traffic before each call) minus
    the host time the runtime profile charges for the same code, ``host`` (what
    :func:`host_costs` measured: the layer, the loop body, the model's own code), so that the
    simulator's table plus host time is the measured call."""
    full_w = shape
    tr = Traffic.of(shape, llc_bytes)
    with torch_threads(torch, 1):
        reader = Reader(torch, llc_bytes)
        n_layers, n_experts, n_top = pools(full_w, llc_bytes)
        pf = _stack(torch, full_w, n_layers, n_experts, n_top)
        sched = _device_schedule(torch, shape, pf, (n_layers, n_top), tokens, tr, reader, per_pass)
        got = sched.run(repeats, on_round=on_step)
    top_full = got["top_full"].best
    raw = _best_by_tokens(got)
    copy_warm_ms = got["swap_warm.copy"].best * 1e3
    writeback_warm_ms = got["swap_warm.writeback"].best * 1e3
    # what the runtime profile charges for the same code (host_costs)
    layer_host, body_host = host["layer"].best, host["expert_body"].best
    step_host = host["step_n1"].best
    head = max(0.0, top_full - step_host)
    floor = 1e-6  # a table value is a positive time
    layer_ms = [
        max(floor, raw["layer_full"][n] - layer_host + head / shape.layers) * 1e3 for n in tokens
    ]
    expert_ms = [max(floor, raw["expert_full"][n] - body_host) * 1e3 for n in tokens]
    copied_ms = [max(floor, raw["copied_full"][n] - body_host) * 1e3 for n in tokens]
    # a copy does not depend on the tokens: the median of the token counts' measurements (each
    # the minimum over its repeats), not their minimum, so one quiet moment does not set it
    copy_ms = statistics.median(raw["copy"].values()) * 1e3
    writeback_ms = statistics.median(raw["writeback"].values()) * 1e3
    heavy = llc_bytes is None or model_weight_bytes(full_w) > llc_bytes
    return {
        "tokens": list(tokens),
        "layer_ms": layer_ms,
        "expert_ms": expert_ms,
        "copied_expert_ms": copied_ms,
        "load_expert_ms": copy_ms,
        "writeback_expert_ms": writeback_ms,
        "load_warm_expert_ms": copy_warm_ms,
        "writeback_warm_expert_ms": writeback_warm_ms,
        "head_ms": head * 1e3,
        "raw_s": {k: {str(n): v for n, v in d.items()} for k, d in raw.items()},
        "top_full_s": top_full,
        "host_subtracted_s": {"layer": layer_host, "expert_body": body_host, "step": step_host},
        "traffic_bytes": dataclasses.asdict(tr),
        "pools": {
            "layers": len(pf.layers),
            "experts": len(pf.experts),
            "output_heads": len(pf.heads),
            "model_weight_bytes": model_weight_bytes(full_w),
            "llc_bytes": llc_bytes,
            "weights": "from DRAM"
            if heavy
            else "in the cache (the model fits in the last-level cache)",
        },
    }


def _device_schedule(
    torch: Any,
    shape: LoopShape,
    pf: _Parts,
    counts: tuple[int, int],
    tokens: tuple[int, ...],
    tr: Traffic,
    reader: Reader,
    per_pass: int,
) -> Schedule:
    """The timed passes of :func:`device_tables` over the pools ``pf``: the model's top part,
    and at each token count a layer's non-expert part, an expert's loop body and a swap (copy,
    write-back, the copied expert's body); the warm swap once."""
    n_layers, n_top = counts
    bpp = shape.bytes_per_param
    count_l = max(per_pass, n_layers)
    count_t = max(per_pass, n_top)
    head_b = shape.vocab * shape.hidden * bpp
    attn_b = attention_bytes(shape)
    sched = Schedule()
    tops, reset = _top_calls(torch, pf, 1, shape.vocab, count_t)
    sched.add("top_full", calls_pass(tops, reader, max(0.0, tr.token - head_b), reset))
    for n in tokens:
        calls, reset = _layer_calls(torch, pf, shape, n, 0, count_l)
        sched.add(f"layer_full.{n}", calls_pass(calls, reader, max(0.0, tr.layer - attn_b), reset))
        bodies = [expert_body(torch, m, n) for m in pf.experts]
        if len(bodies) < per_pass:
            bodies = bodies * (per_pass // len(bodies) + 1)
        sched.add(
            f"expert_full.{n}",
            calls_pass(bodies, reader, max(0.0, tr.expert - shape.expert_bytes)),
        )
        sched.add(
            f"swap.{n}", swap_pass(torch, pf.experts, n, reader, tr.expert, count=3 * per_pass)
        )
    # a copy does not depend on the tokens: the warm swaps once, at one token
    sched.add(
        "swap_warm",
        swap_pass(torch, pf.experts, tokens[0], reader, tr.expert, warm=True, count=3 * per_pass),
    )
    return sched


def _best_by_tokens(got: dict[str, Timing]) -> dict[str, dict[int, float]]:
    """The per-token-count passes' best times (seconds) by table and token count."""
    raw: dict[str, dict[int, float]] = {}
    for key, t in got.items():
        if key.startswith(("layer_", "expert_")):
            name, n_text = key.rsplit(".", 1)
            raw.setdefault(name, {})[int(n_text)] = t.best
        elif key.startswith("swap."):
            _, n_text, part = key.split(".")
            name = {"body": "copied_full", "copy": "copy", "writeback": "writeback"}[part]
            raw.setdefault(name, {})[int(n_text)] = t.best
    return raw
