"""The closed loop of ``daopsim check``: run a random-weight MoE for real, then simulate the
same run on this machine's probed profile, and compare.

A model shaped like a catalogue model (``daopsim.simulator.hf_models``) decodes greedily for
real on the installed PyTorch in several execution modes:

* ``all-resident``: every expert in place (transformers' own eager MoE block);
* ``slots-C``: an offloading runtime with ``C`` expert slots per layer: the experts live in a
  slow pool, and the slots are the only place an expert can run from. A miss copies the
  expert's weights into a slot, evicting the layer's least recently used expert (written back
  to the pool first, as Mixtral-offloading's swaps do); this is the ``mixtral-offloading``
  policy's rule, so its simulation makes the same decisions. On a machine without a GPU the
  "device" is the CPU running PyTorch on one thread and the "link" is a copy between two pools
  of host memory; with a GPU the slots are device memory and the copies cross PCIe (that path is
  written but unverified: no GPU run has been recorded).

Each mode is timed per token with the thread's CPU time (and wall time), over repeats, from
the same initial state each time; per token position the minimum over repeats is kept. The
routing of the same run (the same prompt, the same greedy tokens) is recorded by
``daopsim capture``'s router hooks in one more untimed run, written as a trace, and simulated
with the probed hardware and runtime profiles (``all-gpu`` for all-resident,
``mixtral-offloading`` with ``experts_per_layer = C`` for slots). Nothing the simulation uses is
fitted to these timings: the profiles come from ``daopsim probe``'s microbenchmarks.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from daopsim.simulator.errors import UserError
from daopsim.simulator.hf_models import LoopShape, build_model, daopsim_shape

#: default tolerances of the comparison (``done when`` of the closed loop)
TOKEN_TOLERANCE = 0.10
TTFT_TOLERANCE = 0.15
#: the label of the all-resident mode, and the prefix of the slot modes
ALL_RESIDENT = "all-resident"


def mode_name(slots: int | None) -> str:
    """``all-resident`` (None) or ``slots-C``."""
    return ALL_RESIDENT if slots is None else f"slots-{slots}"


@dataclass
class Timings:
    """One mode's measured run: TTFT and per-token latencies (s), thread CPU and wall time,
    each the minimum over repeats (per token position for the decode tokens)."""

    ttft_cpu: float
    ttft_wall: float
    tokens_cpu: list[float]
    tokens_wall: list[float]
    repeats: int
    #: per repeat: mean decode-token latency (thread CPU), to show the spread
    repeat_means: list[float] = field(default_factory=list)

    @property
    def token_cpu(self) -> float:
        """Mean per-token latency (thread CPU), s."""
        return float(np.mean(self.tokens_cpu))

    @property
    def token_wall(self) -> float:
        """Mean per-token latency (wall), s."""
        return float(np.mean(self.tokens_wall))


# --------------------------------------------------------------------------------------------
# the greedy loop
# --------------------------------------------------------------------------------------------
def _sync(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def greedy(
    model: Any,
    prompt: list[int],
    new_tokens: int,
    device: str = "cpu",
    before_pass: Callable[[], None] | None = None,
) -> tuple[list[int], list[float], list[float]]:
    """Greedy decoding: one prompt pass, then ``new_tokens`` decode passes, each consuming the
    token the previous pass picked (argmax of the last position's logits). Returns the picked
    tokens (``new_tokens + 1``), and per pass (prompt first) its thread CPU and wall seconds.
    The KV cache is made before the clock starts."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt], device=device)
    picked: list[int] = []
    cpu: list[float] = []
    wall: list[float] = []
    with torch.no_grad():
        for _ in range(new_tokens + 1):
            if before_pass is not None:
                before_pass()
            _sync(torch, device)
            c0, w0 = time.thread_time(), time.perf_counter()
            out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(torch, device)
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
            picked.append(int(ids))
    return picked, cpu, wall


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    """A random prompt of ``n`` tokens (ids 3 and up: 0-2 are pad, bos, eos)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, vocab, size=n)]


# --------------------------------------------------------------------------------------------
# offloading: C slots per layer
# --------------------------------------------------------------------------------------------
class SlotExperts:
    """A MoE layer's experts served from ``C`` slots (installed as the layer's ``mlp.experts``
    forward). The weights of every expert live in a pool (one flat buffer per expert, as
    Mixtral-offloading packs an expert into one storage); a miss copies the expert into a slot,
    evicting the least recently used expert of the layer not needed by this token (or, when
    every slot holds one it needs, the least recently used one after its computation), whose
    slot is first copied back to the pool. The order of service is the ``mixtral-offloading``
    policy's: a decode token's experts in rank order, a prompt's by descending token count;
    hits first, then each miss. The computation of one expert is transformers' eager loop body.
    """

    def __init__(self, experts: Any, slots: int, device: str, pinned: bool) -> None:
        import torch

        self.torch = torch
        self.n = int(experts.num_experts)
        self.act_fn = experts.act_fn
        gu, dn = experts.gate_up_proj.data, experts.down_proj.data
        self.gu_shape, self.dn_shape = tuple(gu.shape[1:]), tuple(dn.shape[1:])
        self.gu_numel = int(gu[0].numel())
        pool = []
        for e in range(self.n):
            flat = torch.cat([gu[e].reshape(-1), dn[e].reshape(-1)]).cpu()
            pool.append(flat.pin_memory() if pinned else flat)
        self.pool = pool
        self.cap = int(slots)
        self.slots = [torch.empty_like(pool[0], device=device) for _ in range(self.cap)]
        self.where: dict[int, int] = {}  # resident expert -> slot
        self.lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.fetches = self.writebacks = self.hits = 0
        self.label = False  # profiling: wrap copies and expert calls in record_function

    def reset(self) -> None:
        """The policy's initial state: experts 0..C-1 resident, 0 least recently used."""
        self.where.clear()
        self.lru.clear()
        for e in range(min(self.cap, self.n)):
            self.slots[e].copy_(self.pool[e])
            self.where[e] = e
            self.lru[e] = None
        self.fetches = self.writebacks = self.hits = 0

    def _views(self, slot: int) -> tuple[Any, Any]:
        buf = self.slots[slot]
        gu = buf[: self.gu_numel].view(self.gu_shape)
        dn = buf[self.gu_numel :].view(self.dn_shape)
        return gu, dn

    def _order(self, top_k_index: Any) -> list[int]:
        """The experts of this pass in the policy's order of service."""
        if top_k_index.shape[0] == 1:
            return [int(e) for e in top_k_index[0].tolist()]
        counts = np.bincount(top_k_index.reshape(-1).cpu().numpy(), minlength=self.n)
        hit = np.flatnonzero(counts)
        return [int(e) for e in hit[np.argsort(-counts[hit], kind="stable")]]

    def _victim(self, protected: set[int]) -> int:
        for e in self.lru:
            if e not in protected:
                return e
        return next(iter(self.lru))  # every slot holds an expert of this pass: in use

    def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        """transformers' eager experts loop, each expert served from its slot."""
        torch = self.torch
        F = torch.nn.functional
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=self.n + 1).permute(2, 1, 0)
            torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()  # the loop's hit list
        order = self._order(top_k_index)
        hits = [e for e in order if e in self.where]
        misses = [e for e in order if e not in self.where]
        for e in hits:
            self.lru.move_to_end(e)
        protected = set(order)
        for e in hits:
            self._compute(e, expert_mask, hidden_states, top_k_weights, final)
        for e in misses:
            slot = self._load(e, protected)
            self._compute(e, expert_mask, hidden_states, top_k_weights, final, slot)
        self.hits += len(hits)
        return final

    def _load(self, e: int, protected: set[int]) -> int:
        """Bring expert ``e`` into a slot (evicting and writing back a victim when full)."""
        torch = self.torch
        ctx = torch.profiler.record_function("daopsim::copy") if self.label else _nothing()
        with ctx:
            if len(self.where) >= self.cap:
                victim = self._victim(protected)
                slot = self.where.pop(victim)
                del self.lru[victim]
                self.pool[victim].copy_(self.slots[slot], non_blocking=True)  # write-back
                self.writebacks += 1
            else:
                slot = len(self.where)
            self.slots[slot].copy_(self.pool[e], non_blocking=True)
        self.where[e] = slot
        self.lru[e] = None
        self.fetches += 1
        return slot

    def _compute(
        self,
        e: int,
        expert_mask: Any,
        hidden: Any,
        weights: Any,
        final: Any,
        slot: int | None = None,
    ) -> None:
        torch = self.torch
        F = torch.nn.functional
        ctx = torch.profiler.record_function("daopsim::expert") if self.label else _nothing()
        with ctx:
            gu, dn = self._views(self.where[e] if slot is None else slot)
            top_k_pos, token_idx = torch.where(expert_mask[e])
            current = hidden[token_idx]
            gate, up = F.linear(current, gu).chunk(2, dim=-1)
            h = self.act_fn(gate) * up
            h = F.linear(h, dn)
            h = h * weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, h.to(final.dtype))


class _quiet_stderr:
    """The profiler's C++ side writes its start and stop to file descriptor 2: silence it for
    the profiled run (Python's own ``sys.stderr`` writes are not affected by the profile)."""

    def __enter__(self) -> None:
        import os
        import sys

        sys.stderr.flush()
        self.saved = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)

    def __exit__(self, *exc: object) -> None:
        import os

        os.dup2(self.saved, 2)
        os.close(self.saved)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def install_slots(model: Any, slots: int, device: str) -> list[SlotExperts]:
    """Serve every MoE layer of ``model`` from ``slots`` slots (the experts' 3D weights are
    moved into the pool and released)."""
    import torch

    out = []
    pinned = device.startswith("cuda")
    for layer in model.model.layers:
        experts = layer.mlp.experts
        se = SlotExperts(experts, slots, device, pinned)
        experts.forward = se.forward
        experts._daopsim_slots = se
        # the 3D weights now live in the pool only
        experts.gate_up_proj = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        experts.down_proj = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        out.append(se)
    return out


def reslot(layers: list[SlotExperts], slots: int, device: str) -> None:
    """Give every layer ``slots`` slots (the pool is kept) and reset them."""
    import torch

    for se in layers:
        se.cap = slots
        se.slots = [torch.empty_like(se.pool[0], device=device) for _ in range(slots)]
        se.reset()


# --------------------------------------------------------------------------------------------
# measuring, capturing, simulating
# --------------------------------------------------------------------------------------------
def measure(
    model: Any,
    prompt: list[int],
    new_tokens: int,
    repeats: int,
    reset: Callable[[], None],
    device: str = "cpu",
    on_repeat: Callable[[], None] | None = None,
) -> tuple[Timings, list[int]]:
    """Time ``repeats`` runs (after one untimed warm-up), each from the state ``reset``
    restores; per pass the minimum over repeats. Returns the timings and the picked tokens."""
    reset()
    tokens, _, _ = greedy(model, prompt, new_tokens, device)  # warm-up (allocations, caches)
    cpu_runs, wall_runs = [], []
    for _ in range(repeats):
        reset()
        picked, cpu, wall = greedy(model, prompt, new_tokens, device)
        if picked != tokens:
            raise RuntimeError("greedy decoding picked other tokens in a repeat")
        cpu_runs.append(cpu)
        wall_runs.append(wall)
        if on_repeat is not None:
            on_repeat()
    c = np.min(np.array(cpu_runs), axis=0)
    w = np.min(np.array(wall_runs), axis=0)
    means = [float(np.mean(r[1:])) for r in cpu_runs]
    return (
        Timings(float(c[0]), float(w[0]), c[1:].tolist(), w[1:].tolist(), repeats, means),
        tokens,
    )


class _IdsTokenizer:
    """Prompts given as token ids (the capture's tokenizer interface)."""

    name = "token ids"


def capture_routing(
    model: Any, shape: LoopShape, prompt: list[int], new_tokens: int, path: Path, device: str
) -> list[int]:
    """One more run with ``daopsim capture``'s router hooks on; writes its routing (one
    sequence: the prompt, then one decode row per decode pass) to the trace at ``path``.
    Returns the picked tokens (the timed runs must pick the same)."""
    from daopsim.simulator.capture import creation_date
    from daopsim.simulator.capture_generate import _sequence
    from daopsim.simulator.capture_layers import find_moe_layers
    from daopsim.simulator.capture_recorder import RoutingRecorder, rank_order
    from daopsim.simulator.trace import write_valid_trace
    from daopsim.simulator.trace_format import ALL_PROBS_MAX_EXPERTS, DEFAULT_TOP_M, TraceMeta
    from daopsim.simulator.trace_write import TraceWriter, tool_versions

    moe = find_moe_layers(model)
    ms = daopsim_shape(shape)
    stored = shape.experts if shape.experts <= ALL_PROBS_MAX_EXPERTS else DEFAULT_TOP_M
    with RoutingRecorder(moe, top_m=stored if stored < shape.experts else None) as rec:
        picked, _, _ = greedy(model, prompt, new_tokens, device)
        steps = list(rec.steps)
    if len(steps) != new_tokens + 1:
        raise RuntimeError(f"recorded {len(steps)} forward passes, expected {new_tokens + 1}")
    order = rank_order(moe)
    meta = TraceMeta(
        model=ms,
        provenance={
            "source": "daopsim check",
            "created": creation_date(),
            "router": type(moe[0].router).__name__,
            "router_family": moe[0].family,
            "tokenizer": _IdsTokenizer.name,
            "generation": {
                "decoding": "greedy",
                "new_tokens": new_tokens,
                "decode_rows": "one per decode pass",
            },
            "rank_order": order.score,
            "rank_order_columns": list(order.columns),
            "loop_shape": shape.to_dict(),
            "tool_versions": tool_versions(),
        },
        probs_stored=stored,
        moe_layer_ids=[layer.layer_id for layer in moe],
    )
    routing = _sequence(0, 0, len(prompt), len(prompt), steps[0], steps[1:])

    def fill(tmp: Path) -> None:
        with TraceWriter(tmp, meta) as w:
            w.write_sequence(routing)

    write_valid_trace(path, fill, flag=None, what="recorded")
    return picked


@dataclass
class Simulated:
    """One mode's simulation: TTFT, mean per-token latency (s), the busy seconds of each part
    per run, and the miss counts."""

    ttft: float
    token: float
    nonexpert_s: float
    expert_s: float
    copy_s: float
    fetches: int
    decode_tokens: int


def simulate_mode(hw: Any, runtime: Any, trace: Path, slots: int | None, layers: int) -> Simulated:
    """Simulate the recorded run: ``all-gpu`` (all resident) or ``mixtral-offloading`` with
    ``experts_per_layer = slots``, on the probed profiles."""
    from daopsim.simulator.runner import simulate

    if slots is None:
        r = simulate(
            policy="all-gpu", hw=hw, trace=trace, runtime=runtime, record=False, sequences=1
        )
    else:
        r = simulate(
            policy="mixtral-offloading",
            hw=hw,
            trace=trace,
            runtime=runtime,
            record=False,
            sequences=1,
            gpu_experts=slots * layers,
            policy_options={"experts_per_layer": slots},
        )
    m = r.metrics
    e2e = m["e2e_s"]
    from daopsim.simulator.hardware import load_profile
    from daopsim.simulator.hardware_spec import HardwareProfile

    prof = hw if isinstance(hw, HardwareProfile) else load_profile(hw)
    # one copy engine: both directions are one lane, and each fraction is that lane's
    lanes = (
        [m["h2d_busy_frac"]]
        if prof.link.copy_engines < 2
        else [m["h2d_busy_frac"], m["d2h_busy_frac"]]
    )
    copy = sum(lanes) * e2e
    return Simulated(
        ttft=float(m["ttft_s"]),
        token=float(m["tpot_mean_s"]),
        nonexpert_s=float(m["gpu_nonexpert_s"]),
        expert_s=float(m["gpu_expert_s"]),
        copy_s=float(copy),
        fetches=int(m["fetches"]),
        decode_tokens=int(m["decode_tokens"]),
    )


def breakdown(
    model: Any,
    prompt: list[int],
    new_tokens: int,
    reset: Callable[[], None],
    slot_layers: list[SlotExperts] | None,
    device: str,
) -> dict[str, float]:
    """Where one run's time goes, from the torch profiler (its own run, with the profiler's
    overhead; wall time, as the profiler's events are): seconds in the experts' calls, in
    copies, and the rest (the non-expert parts and the model's own code)."""
    import torch

    labels: list[Any] = []
    handles = []
    if slot_layers is None:
        for layer in model.model.layers:
            mod = layer.mlp.experts

            def pre(m: Any, a: Any) -> None:
                labels.append(torch.profiler.record_function("daopsim::expert").__enter__())

            def post(m: Any, a: Any, o: Any) -> None:
                labels.pop().__exit__(None, None, None)

            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    else:
        for se in slot_layers:
            se.label = True
    reset()
    try:
        with (
            _quiet_stderr(),
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
        ):
            t0 = time.perf_counter()  # the profiler's events are wall time: so is the total
            greedy(model, prompt, new_tokens, device)
            total = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
        for se in slot_layers or []:
            se.label = False
    sums = {"daopsim::expert": 0.0, "daopsim::copy": 0.0}
    for ev in prof.key_averages():
        if ev.key in sums:
            sums[ev.key] += ev.cpu_time_total * 1e-6
    experts, copies = sums["daopsim::expert"], sums["daopsim::copy"]
    return {
        "total_s": total,
        "experts_s": experts,
        "copies_s": copies,
        "nonexpert_s": max(0.0, total - experts - copies),
    }


# --------------------------------------------------------------------------------------------
# the check
# --------------------------------------------------------------------------------------------
@dataclass
class CheckSpec:
    """What ``daopsim check`` runs."""

    shape: LoopShape
    prompt_tokens: int = 32
    new_tokens: int = 32
    repeats: int = 3
    slots: tuple[int, ...] = (4, 2, 1)
    seed: int = 0
    device: str = "cpu"
    token_tolerance: float = TOKEN_TOLERANCE
    ttft_tolerance: float = TTFT_TOLERANCE
    breakdown: bool = True

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.new_tokens < 1 or self.repeats < 1:
            raise UserError("--prompt-tokens, --new-tokens and --repeats must be at least 1")
        for c in self.slots:
            if not 1 <= c <= self.shape.experts:
                raise UserError(f"--slots: {c} is not in 1..{self.shape.experts} experts")
        if self.device not in ("cpu", "cuda"):
            raise UserError(f"--device must be cpu or cuda, not {self.device!r}")


@dataclass
class ModeResult:
    """One mode's comparison."""

    mode: str
    measured: Timings
    simulated: Simulated
    real_fetches: int
    profile: dict[str, float] | None
    token_tolerance: float
    ttft_tolerance: float

    @property
    def token_error(self) -> float:
        """Signed relative error of the simulated mean per-token latency (thread CPU)."""
        return self.simulated.token / self.measured.token_cpu - 1.0

    @property
    def ttft_error(self) -> float:
        """Signed relative error of the simulated TTFT (thread CPU)."""
        return self.simulated.ttft / self.measured.ttft_cpu - 1.0

    @property
    def ok(self) -> bool:
        """Both within their tolerance."""
        return (
            abs(self.token_error) <= self.token_tolerance
            and abs(self.ttft_error) <= self.ttft_tolerance
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``check --json``)."""
        m, s = self.measured, self.simulated
        n = max(1, len(m.tokens_cpu))
        out: dict[str, Any] = {
            "mode": self.mode,
            "ok": self.ok,
            "measured": {
                "token_ms_cpu": m.token_cpu * 1e3,
                "token_ms_wall": m.token_wall * 1e3,
                "ttft_ms_cpu": m.ttft_cpu * 1e3,
                "ttft_ms_wall": m.ttft_wall * 1e3,
                "repeats": m.repeats,
                "repeat_token_ms_cpu": [x * 1e3 for x in m.repeat_means],
                "fetches": self.real_fetches,
            },
            "simulated": {
                "token_ms": s.token * 1e3,
                "ttft_ms": s.ttft * 1e3,
                "fetches": s.fetches,
                "per_run_ms": {
                    "nonexpert": s.nonexpert_s * 1e3,
                    "experts": s.expert_s * 1e3,
                    "copies": s.copy_s * 1e3,
                },
            },
            "token_error": self.token_error,
            "ttft_error": self.ttft_error,
        }
        if self.profile is not None:
            out["measured"]["profiler_per_run_ms"] = {
                k.removesuffix("_s"): v * 1e3 for k, v in self.profile.items()
            }
        out["measured"]["decode_tokens"] = n
        return out


@dataclass
class CheckResult:
    """Every mode's comparison, and the conditions of the run."""

    spec: CheckSpec
    modes: list[ModeResult]
    hw_path: str
    runtime_path: str
    trace_path: str
    conditions: dict[str, Any]

    @property
    def ok(self) -> bool:
        """Every mode within tolerance."""
        return all(m.ok for m in self.modes)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``check --json``)."""
        s = self.spec
        return {
            "ok": self.ok,
            "model": s.shape.to_dict(),
            "prompt_tokens": s.prompt_tokens,
            "new_tokens": s.new_tokens,
            "repeats": s.repeats,
            "device": s.device,
            "tolerance": {"token": s.token_tolerance, "ttft": s.ttft_tolerance},
            "compared_in": "thread CPU time (wall time reported beside it)",
            "hw": self.hw_path,
            "runtime": self.runtime_path,
            "trace": self.trace_path,
            "conditions": self.conditions,
            "modes": [m.to_dict() for m in self.modes],
        }


def conditions() -> dict[str, Any]:
    """What the machine was doing: load averages, logical CPUs, PyTorch threads."""
    import os

    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    return {
        "loadavg": [round(x, 2) for x in load],
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def run_check(
    spec: CheckSpec,
    hw: Any,
    runtime: Any,
    trace_path: Path,
    hw_path: str = "",
    runtime_path: str = "",
    progress: Callable[[str], None] | None = None,
) -> CheckResult:
    """Build the model, record its routing, time every mode and simulate it (see the module
    docstring). ``hw``/``runtime``: the profiles (objects or paths)."""
    import torch

    def say(what: str) -> None:
        if progress is not None:
            progress(what)

    shape = spec.shape
    torch.set_num_threads(1)
    model = build_model(shape, seed=spec.seed)
    if spec.device != "cpu":
        model = model.to(spec.device)
    prompt = prompt_ids(shape.vocab, spec.prompt_tokens, spec.seed)
    say("record routing")
    picked = capture_routing(model, shape, prompt, spec.new_tokens, trace_path, spec.device)
    cond_before = conditions()
    results: list[ModeResult] = []

    def compare(
        slots: int | None, reset: Callable[[], None], layers: list[SlotExperts] | None
    ) -> None:
        name = mode_name(slots)
        say(f"{name}: time")
        timings, tokens = measure(model, prompt, spec.new_tokens, spec.repeats, reset, spec.device)
        if tokens != picked:
            raise RuntimeError(f"{name}: greedy decoding picked other tokens than the recorded run")
        fetches = sum(se.fetches for se in layers) if layers else 0
        prof = None
        if spec.breakdown:
            say(f"{name}: profile")
            prof = breakdown(model, prompt, spec.new_tokens, reset, layers, spec.device)
        say(f"{name}: simulate")
        sim = simulate_mode(hw, runtime, trace_path, slots, shape.layers)
        results.append(
            ModeResult(name, timings, sim, fetches, prof, spec.token_tolerance, spec.ttft_tolerance)
        )

    compare(None, lambda: None, None)
    if spec.slots:
        layers = install_slots(model, max(spec.slots), spec.device)
        for c in spec.slots:
            reslot(layers, c, spec.device)
            compare(c, lambda: [se.reset() for se in layers] and None, layers)
    cond = {"before": cond_before, "after": conditions()}
    return CheckResult(spec, results, hw_path, runtime_path, str(trace_path), cond)
