"""``daopsim probe``: describe this machine by measuring it.

The probe detects the parts (CPU model, sockets, cores, threads, caches, memory and, where the
OS lets it read them, the DIMMs; a GPU through NVML or PyTorch), then measures what the cost
model charges with short microbenchmarks (``daopsim.simulator.probe_bench``,
``daopsim.simulator.probe_modules``), and writes two profiles and the raw figures:

* ``NAME.toml``, a hardware profile (docs/hardware-profiles.md). Without a GPU its ``[gpu]``
  is the CPU itself running PyTorch on one thread, the device of ``daopsim check``'s closed
  loop, and its ``[link]`` a copy between two pools of host memory (``kind = "unified"``: one
  DRAM); ``[cpu]`` is the host CPU on all its cores. With ``--model``, a
  ``[measured."<model>"]`` table holds the device times of that model's own modules.
* ``NAME.runtime.toml``, a runtime profile (docs/cost-model.md, "Runtime profiles"): PyTorch
  eager's host time per module on this machine.
* ``NAME.probe.json``: every figure with its unit, how it was obtained (``measured`` and the
  method, ``derived`` from what, ``spec``, ``detected``) and its raw timings; what could not
  be measured here is listed with the reason.

Every number written says how it was obtained, in a comment tag: ``[M]`` measured (method),
``[X]`` detected (read from the OS), ``[D]`` derived (formula), ``[A]`` assumption.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daopsim.simulator.errors import UserError

# detection and the profile writers live in modules of their own; their public names are
# importable from here, where the probe's callers have always found them
from daopsim.simulator.probe_detect import (
    detect_cpu,
    detect_gpu,
    memory_channels,
    parse_dmidecode_memory,
    parse_lscpu,
    parse_meminfo,
    parse_proc_cpuinfo,
    parse_size,
    read_sys_caches,
    theoretical_dram_gbs,
)
from daopsim.simulator.probe_write import (
    FILES,
    hardware_toml,
    output_paths,
    runtime_toml,
    write_probe,
)


@dataclass
class Entry:
    """One figure of the probe: its value, unit, how it was obtained and the method."""

    value: Any
    unit: str
    how: str  # measured | detected | derived | spec | not measured
    method: str
    raw: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the probe's JSON)."""
        out = {"value": self.value, "unit": self.unit, "how": self.how, "method": self.method}
        if self.raw is not None:
            out["raw"] = self.raw
        return out


@dataclass
class ProbeResult:
    """Everything one probe found, by key (``cpu.name``, ``standin.gemv_gbs``, ...)."""

    entries: dict[str, Entry] = field(default_factory=dict)
    model: Any = None  # the LoopShape of --model
    device: str = "cpu"
    versions: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0
    quick: bool = False

    def put(
        self,
        key: str,
        value: Any,
        unit: str,
        how: str,
        method: str,
        raw: dict[str, Any] | None = None,
    ) -> None:
        """Record one figure."""
        self.entries[key] = Entry(value, unit, how, method, raw)

    def value(self, key: str, default: Any = None) -> Any:
        """A figure's value (``default`` when absent or not measured)."""
        e = self.entries.get(key)
        return default if e is None or e.value is None else e.value

    def not_measured(self) -> dict[str, str]:
        """The figures that could not be obtained here, with the reason."""
        return {k: e.method for k, e in self.entries.items() if e.how == "not measured"}

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``probe --json`` and ``NAME.probe.json``)."""
        return {
            "device": self.device,
            "quick": self.quick,
            "elapsed_s": self.elapsed_s,
            "versions": self.versions,
            "model": None if self.model is None else self.model.to_dict(),
            "entries": {k: e.to_dict() for k, e in sorted(self.entries.items())},
            "not_measured": self.not_measured(),
        }


# --------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------
@dataclass
class ProbeOptions:
    """What to measure: ``quick`` (fewer repeats, no thread sweep, no extra precisions),
    ``model`` (a LoopShape whose modules to time), ``tokens`` (their token counts),
    ``device`` (``auto``, ``cpu``: the CPU stands in even with a GPU, ``cuda``)."""

    quick: bool = False
    model: Any = None
    tokens: tuple[int, ...] | None = None
    device: str = "auto"
    repeats: int | None = None


#: the weight-stream matrix of the generic figures (one decode-step linear)
STREAM_SHAPE = (4096, 4096)
#: bytes of the generic copy (about one mid-size expert)
COPY_BYTES = 16e6


def _thread_counts(usable: int) -> list[int]:
    out, t = [], 1
    while t < usable:
        out.append(t)
        t *= 2
    out.append(usable)
    return out


def measure_cpu(res: ProbeResult, torch: Any, opts: ProbeOptions, tick: Callable[[], None]) -> None:
    """The host CPU: weight streams per precision at 1, 2, 4, ... all threads, an all-core
    read stream, GEMM rates (and with no torch, what numpy can)."""
    from daopsim.simulator import probe_bench as pb

    llc = res.value("cpu.l3_bytes")
    reps = opts.repeats or (2 if opts.quick else 3)
    usable = int(res.value("cpu.usable_threads", 1))
    cores = int(min(res.value("cpu.cores", usable), usable))
    if torch is None:
        _measure_numpy(res, llc, reps)
        tick()
        return
    precisions = ["fp32"] if opts.quick else ["fp32", "bf16"]
    counts = [1, cores] if opts.quick else _thread_counts(cores)
    for dtype in precisions:
        for t_n in sorted(set(counts)):
            gbs, t = pb.gemv_stream(torch, dtype, t_n, STREAM_SHAPE, llc, reps)
            res.put(
                f"cpu.stream_gbs.torch_{dtype}.t{t_n}",
                gbs,
                "GB/s",
                "measured",
                f"torch.nn.functional.linear of one {dtype} row against "
                f"{STREAM_SHAPE[0]}x{STREAM_SHAPE[1]} {dtype} weights, pool of 4x the LLC, "
                f"{t_n} thread(s), {t.clock} time, min of {t.repeats}",
                t.to_dict(),
            )
            tick()
    if not opts.quick:
        _measure_int8_stream(res, torch, sorted({1, cores}), llc, reps)
        tick()
    res.put(
        "cpu.stream_gbs.ggml",
        None,
        "GB/s",
        "not measured",
        "ggml (llama.cpp) kernels are not part of this Python stack; measure a CPU-only "
        "llama.cpp decode (bytes per token x tokens/s) to set it",
    )
    gbs, t = pb.read_stream(torch, cores, max(512e6, 8 * (llc or 0)), reps)
    res.put(
        "cpu.read_gbs",
        gbs,
        "GB/s",
        "measured",
        f"torch sum over a 512 MB fp32 buffer on {cores} thread(s), wall time, min of "
        f"{t.repeats} (STREAM-like read)",
        t.to_dict(),
    )
    tick()
    for dtype in precisions:
        for t_n in sorted({1, cores}):
            gf, t = pb.gemm_rate(torch, dtype, t_n, 1024 if opts.quick else 2048, reps)
            res.put(
                f"cpu.gemm_gflops.{dtype}.t{t_n}",
                gf,
                "GFLOPS",
                "measured",
                f"torch.mm of two square {dtype} matrices ({'1024' if opts.quick else '2048'}),"
                f" {t_n} thread(s), {t.clock} time, min of {t.repeats}",
                t.to_dict(),
            )
    tick()


def _measure_int8_stream(
    res: ProbeResult, torch: Any, counts8: list[int], llc: float | None, reps: int
) -> None:
    """The dynamic int8 linear's weight stream at each thread count (not measured where the
    PyTorch build has no such kernel)."""
    from daopsim.simulator import probe_bench as pb

    got = pb.int8_stream(torch, counts8, STREAM_SHAPE, llc, reps)
    for t_n in counts8:
        if got is None:
            res.put(
                f"cpu.stream_gbs.torch_int8.t{t_n}",
                None,
                "GB/s",
                "not measured",
                "this PyTorch build has no dynamic int8 linear kernel",
            )
            continue
        gbs, t = got[t_n]
        res.put(
            f"cpu.stream_gbs.torch_int8.t{t_n}",
            gbs,
            "GB/s",
            "measured",
            "torch.ao.nn.quantized.dynamic.Linear (int8 weights, per-row scale) on one "
            f"row, pool of 4x the LLC, {t_n} thread(s), {t.clock} time",
            t.to_dict(),
        )


def _measure_numpy(res: ProbeResult, llc: float | None, reps: int) -> None:
    """Without PyTorch: what numpy measures on one thread (a read stream, a copy, an fp32
    GEMM through its BLAS); the rest is listed as not measured."""
    import time as _time

    import numpy as np

    from daopsim.simulator import probe_bench as pb

    why = "needs PyTorch (pip install 'daopsim[capture]')"
    how = "one thread, thread CPU time, min of repeats (no PyTorch: numpy)"
    gbs, t = pb.numpy_read_stream(max(pb.MIN_POOL_BYTES, 4 * (llc or 0)), reps)
    res.put(
        "cpu.read_gbs.t1", gbs, "GB/s", "measured", f"numpy sum over 4x the LLC, {how}", t.to_dict()
    )
    res.put(
        "standin.gemv_gbs",
        gbs,
        "GB/s",
        "measured",
        f"numpy sum over 4x the LLC (a read stream: no PyTorch linear to time), {how}",
        t.to_dict(),
    )
    gbs, t = pb.numpy_copy_rate(COPY_BYTES, llc, reps)
    res.put(
        "standin.copy_gbs",
        gbs,
        "GB/s",
        "measured",
        f"numpy.copyto of 16 MB from a pool of 4x the LLC, {how}",
        t.to_dict(),
    )
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)

    def one() -> float:
        t0 = _time.perf_counter()
        a @ a
        return _time.perf_counter() - t0

    t = pb.timed(one, reps)
    gf = 2 * 1024**3 / t.best / 1e9
    res.put(
        "cpu.gemm_gflops.numpy",
        gf,
        "GFLOPS",
        "measured",
        "numpy matmul of two 1024x1024 fp32 matrices (its BLAS's own threads), wall time, "
        "min of repeats",
        t.to_dict(),
    )
    res.put(
        "standin.gemm_gflops", gf, "GFLOPS", "measured", "as cpu.gemm_gflops.numpy", t.to_dict()
    )
    res.put("host.copy_call_us", 1.0, "us", "not measured", f"{why}; 1 us assumed")
    for key in ("cpu.stream_gbs", "cpu.gemm_gflops.bf16", "host.small_op_us", "runtime"):
        res.put(key, None, "", "not measured", why)


def measure_standin(
    res: ProbeResult, torch: Any, opts: ProbeOptions, tick: Callable[[], None]
) -> None:
    """The CPU as the closed loop's device (one PyTorch thread) and its link (copies between
    two pools of host memory), and the host costs of single calls."""
    from daopsim.simulator import probe_bench as pb

    llc = res.value("cpu.l3_bytes")
    reps = opts.repeats or (2 if opts.quick else 3)
    dtype = opts.model.dtype if opts.model is not None else "fp32"
    gbs, t = pb.gemv_stream(torch, dtype, 1, STREAM_SHAPE, llc, reps)
    res.put(
        "standin.gemv_gbs",
        gbs,
        "GB/s",
        "measured",
        f"one thread: torch.nn.functional.linear of one {dtype} row against "
        f"{STREAM_SHAPE[0]}x{STREAM_SHAPE[1]} weights, pool of 4x the LLC, thread CPU time, "
        f"min of {t.repeats}",
        t.to_dict(),
    )
    gf, t = pb.gemm_rate(torch, dtype, 1, 1024, reps)
    res.put(
        "standin.gemm_gflops",
        gf,
        "GFLOPS",
        "measured",
        f"one thread: torch.mm of two 1024x1024 {dtype} matrices, thread CPU time, min of "
        f"{t.repeats}",
        t.to_dict(),
    )
    nbytes = opts.model.expert_bytes if opts.model is not None else COPY_BYTES
    gbs, t = pb.copy_rate(torch, nbytes, llc, reps)
    what = "one expert of the model" if opts.model is not None else "16 MB"
    res.put(
        "standin.copy_gbs",
        gbs,
        "GB/s",
        "measured",
        f"one thread: Tensor.copy_ of {what} ({nbytes / 1e6:.2f} MB) from a pool of 4x the "
        f"LLC into one of two buffers, thread CPU time, min of {t.repeats}",
        t.to_dict(),
    )
    tick()
    calls = pb.host_calls(torch, reps, calls=500 if opts.quick else 2000)
    what = {
        "small_op": "an add of two 1x64 fp32 rows",
        "module_call": "an empty nn.Module call (nn.Identity)",
        "linear_module": "an nn.Linear(64, 64) module call on one row",
        "copy_call": "a copy_ of one 1x64 row",
        "item": "reading one value back to Python (.item(); on a GPU: a sync)",
    }
    for k, t in calls.items():
        res.put(
            f"host.{k}_us",
            t.best * 1e6,
            "us",
            "measured",
            f"one thread: {what[k]}, thread CPU time per call, min of {t.repeats}",
            t.to_dict(),
        )
    tick()


def measure_gpu(
    res: ProbeResult, torch: Any, opts: ProbeOptions, tick: Callable[[], None], device: str = "cuda"
) -> None:
    """A GPU: its weight stream and GEMM rate, host-to-device and device-to-host copies from
    pinned and pageable memory, and the host time of a small op and of a sync. Unverified on
    real GPUs (no GPU run recorded): ``device`` may be ``cpu`` to run the same code on the
    CPU (the tests do; pinned buffers then are ordinary ones)."""
    from daopsim.simulator import probe_bench as pb

    reps = opts.repeats or (2 if opts.quick else 3)
    gpu = device != "cpu"
    gbs, t = pb.gemv_stream(torch, "bf16", 1, STREAM_SHAPE, None, reps, device=device)
    res.put(
        "gpu.stream_gbs",
        gbs,
        "GB/s",
        "measured",
        f"torch.nn.functional.linear of one bf16 row against {STREAM_SHAPE[0]}x"
        f"{STREAM_SHAPE[1]} weights on {device}, a pool of 128 MB, wall time with a sync, "
        f"min of {t.repeats}",
        t.to_dict(),
    )
    gf, t = pb.gemm_rate(torch, "bf16", 1, 4096 if gpu else 512, reps, device=device)
    res.put(
        "gpu.gemm_tflops",
        gf / 1e3,
        "TFLOPS",
        "measured",
        f"torch.mm of two square bf16 matrices on {device}, wall time with a sync, min of "
        f"{t.repeats}",
        t.to_dict(),
    )
    tick()
    for direction, (src, dst) in (("h2d", ("cpu", device)), ("d2h", (device, "cpu"))):
        for pinned in (True, False):
            gbs, t = pb.copy_rate(
                torch, 64e6 if gpu else 8e6, None, reps, src, dst, pinned=pinned and gpu
            )
            kind = "pinned" if pinned else "pageable"
            res.put(
                f"link.{direction}_{kind}_gbs",
                gbs,
                "GB/s",
                "measured",
                f"Tensor.copy_ of 64 MB {src} -> {dst}, {kind} host buffers, wall time with "
                f"a sync, min of {t.repeats}",
                t.to_dict(),
            )
    tick()
    calls = pb.host_calls(torch, reps, calls=200, device=device)
    for key, label in (("small_op", "dispatch_us"), ("item", "sync_us"), ("copy_call", "copy_us")):
        t = calls[key]
        res.put(
            f"gpu.{label}",
            t.best * 1e6,
            "us",
            "measured",
            f"host thread CPU time of one {key.replace('_', ' ')} on {device}, min of {t.repeats}",
            t.to_dict(),
        )
    tick()


def measure_modules(
    res: ProbeResult, torch: Any, opts: ProbeOptions, tick: Callable[[], None]
) -> None:
    """PyTorch eager's host time per module class (tiny width) and, with ``--model``, the
    device times of the model's modules (daopsim.simulator.probe_modules)."""
    from daopsim.simulator import probe_modules as pm
    from daopsim.simulator.hf_models import scaled_shape

    try:
        import transformers
    except ImportError:
        res.put(
            "runtime",
            None,
            "",
            "not measured",
            "module host costs need transformers (pip install 'daopsim[capture]')",
        )
        return
    res.versions["transformers"] = transformers.__version__
    reps = opts.repeats or (5 if opts.quick else 9)
    shape = opts.model or scaled_shape("mixtral-8x7b", layers=8, hidden=1024, expert_ffn=1536)
    llc = res.value("cpu.l3_bytes")
    arch = f"{shape.family} architecture (transformers {transformers.__version__})"
    h = pm.host_costs(torch, shape, reps, llc, calls=10 if opts.quick else 40)
    tick()
    tr = pm.Traffic.of(shape, llc)
    how = f"one thread, thread CPU time per call, min of {reps} repeats, {arch} at hidden 64"
    _put_host_costs(res, h, tr, how)
    if opts.model is None:
        return
    _measure_model_modules(res, torch, opts, llc, h, tick)


def _put_host_costs(res: ProbeResult, h: dict[str, Any], tr: Any, how: str) -> None:
    """The runtime profile's host costs per module call from the timed module calls ``h``
    (``how``: how they were timed), and every timed call as it was measured."""
    # the experts loop's fixed part: with 2 experts receiving the token, less 2 iterations
    fixed = max(0.0, 2 * h["experts_k2"].best - h["experts_k4"].best)
    glue = h["layer"].best - h["attention"].best - 2 * h["norm"].best - h["router"].best
    glue += fixed - h["experts_noop"].best
    inside = (
        "timed by forward hooks inside the decoder layer's call (a decode step at context "
        f"16, {tr.layer / 1e6:.1f} MB read before each layer: one layer's traffic)"
    )
    rows = [
        (
            "attention_host_us",
            h["attention"].best,
            "one attention module call (projections, rotary, cache update, SDPA, output "
            f"projection), {inside}",
        ),
        ("norm_host_us", h["norm"].best, f"one RMSNorm module call, {inside}"),
        (
            "router_host_us",
            h["router"].best,
            f"one router call (gate, softmax, top-k, renormalisation), {inside}",
        ),
        (
            "expert_host_us",
            h["expert_body"].best,
            "one iteration of the experts loop (transformers' eager body op for op) for one "
            f"token, {tr.expert / 1e6:.2f} MB read before each (one expert's weights)",
        ),
        (
            "layer_glue_host_us",
            max(0.0, glue),
            "the decoder layer's call with its experts replaced by an empty output (after one "
            "layer's traffic), minus its attention, 2 norms and router inside it, plus the "
            "experts loop's fixed part (2 x the loop with 2 experts receiving the token - with "
            "4, right after the router) minus the empty replacement's call",
        ),
        (
            "step_host_us",
            h["step_n1"].best,
            "one decode pass of a model with no layers (embedding, positions, mask, rotary "
            "tables, final norm, output head) and the greedy token pick, "
            f"{tr.token / 1e6:.1f} MB read before each (the model's traffic per token)",
        ),
    ]
    for key, v, what in rows:
        res.put(
            f"runtime.{key}",
            v * 1e6,
            "us",
            "measured",
            f"{what}; {how}",
            {k: t.to_dict() for k, t in h.items()} if key == "step_host_us" else None,
        )
    for key, t in h.items():
        res.put(
            f"host.module.{key}_us", t.best * 1e6, "us", "measured", f"{key}; {how}", t.to_dict()
        )
    res.put(
        "host.empty_expert_us",
        h["empty_expert"].best * 1e6,
        "us",
        "measured",
        "one iteration of the experts loop body for an expert with no token (what a loop over "
        f"every expert, e.g. transformers 4.51's Qwen3-MoE, pays per idle expert); {how}",
    )
    res.put(
        "host.step_prefill_us",
        h["step_n8"].best * 1e6,
        "us",
        "measured",
        f"the model's own code for an 8-token prompt pass; {how}",
    )


def _measure_model_modules(
    res: ProbeResult,
    torch: Any,
    opts: ProbeOptions,
    llc: float | None,
    h: dict[str, Any],
    tick: Callable[[], None],
) -> None:
    """With ``--model``: the device tables of the model's modules at full width, one expert
    on the CPU, and an expert's copy and write-back (cold and warm)."""
    from daopsim.simulator import probe_modules as pm

    assert opts.model is not None
    tokens = opts.tokens or pm.DEFAULT_TOKENS
    reps_t = opts.repeats or (4 if opts.quick else 6)
    tables = pm.device_tables(
        torch, opts.model, tokens, llc, reps_t, h, on_step=tick, per_pass=4 if opts.quick else 8
    )
    res.put(
        "model.device_tables",
        tables,
        "ms",
        "measured",
        "each module of the model at full width (one thread, weights in pools: streamed from "
        "DRAM when the model exceeds the LLC; the model's traffic before each call; thread CPU "
        "time, min of repeats) minus the host time the runtime profile charges for the same "
        "code: an MoE layer's non-expert part at context 0 with 1/layers of the output head, "
        "and one routed expert's loop body, at each token count",
    )
    cpu_threads = int(min(res.value("cpu.cores", 1), res.value("cpu.usable_threads", 1)))

    eb = opts.model.expert_bytes
    ms, t = _expert_alone(torch, opts.model, cpu_threads, llc, opts.repeats or 3)
    res.put(
        "model.cpu_expert_ms",
        ms,
        "ms",
        "measured",
        f"one expert of the model for one token on the CPU, {cpu_threads} thread(s), pool of "
        f"4x the LLC, {t.clock} time, min of {t.repeats}",
        t.to_dict(),
    )
    res.put(
        "model.load_expert_ms",
        tables["load_expert_ms"],
        "ms",
        "measured",
        f"Tensor.copy_ of one expert ({eb / 1e6:.2f} MB, packed in one buffer) from a pool "
        "into a slot, after one expert's traffic, one thread, thread CPU time, min of repeats "
        "(probe_modules.swap_pass)",
    )
    for key, what in (
        ("load_warm_expert_ms", "the copy"),
        ("writeback_warm_expert_ms", "the write-back"),
    ):
        res.put(
            f"model.{key}",
            tables[key],
            "ms",
            "measured",
            f"{what} of a swap whose slot's expert was computed just before (one slot reused: "
            "an in-use victim's), one thread, thread CPU time, min of repeats "
            "(probe_modules.swap_pass)",
        )
    res.put(
        "model.writeback_expert_ms",
        tables["writeback_expert_ms"],
        "ms",
        "measured",
        "Tensor.copy_ of a slot computed one miss earlier back into the pool, one thread, "
        "thread CPU time, min of repeats (probe_modules.swap_pass)",
    )
    tick()


def _expert_alone(
    torch: Any, shape: Any, threads: int, llc: float | None, repeats: int
) -> tuple[float, Any]:
    """ms of one expert's three linears for one token on ``threads`` threads, cold pool."""
    import time as _time

    from daopsim.simulator import probe_bench as pb
    from daopsim.simulator.hf_models import torch_dtype

    dt = torch_dtype(torch, shape.dtype)
    n = pb.pool_count(shape.expert_bytes, llc)
    with pb.torch_threads(torch, threads):
        gu = torch.empty(n, 2 * shape.expert_ffn, shape.hidden, dtype=dt).normal_()
        dn = torch.empty(n, shape.hidden, shape.expert_ffn, dtype=dt).normal_()
        x = torch.randn(1, shape.hidden, dtype=dt)
        now, name = pb.clock(threads)
        F = torch.nn.functional

        def one() -> float:
            t0 = now()
            with torch.no_grad():
                for i in range(n):
                    g, u = F.linear(x, gu[i]).chunk(2, dim=-1)
                    F.linear(F.silu(g) * u, dn[i])
            return (now() - t0) / n

        t = pb.timed(one, repeats)
    del _time
    return t.best * 1e3, pb.Timing(t.best, t.median, t.repeats, name)


def steps(opts: ProbeOptions) -> int:
    """Progress-bar steps of a probe with these options (an estimate is fine)."""
    n = 2 + 2 + (4 if opts.quick else 8) + 1
    if opts.model is not None:
        n += len(opts.tokens or (1, 2, 4, 8, 16, 32, 64)) + 1
    return n


def run_probe(
    opts: ProbeOptions, tick: Callable[[], None] = lambda: None, root: Path = Path("/")
) -> ProbeResult:
    """Detect and measure this machine (see the module docstring)."""
    import time as _time

    from daopsim.simulator import probe_bench as pb

    t0 = _time.perf_counter()
    res = ProbeResult(model=opts.model, quick=opts.quick)
    res.versions["python"] = platform.python_version()
    torch = pb.load_torch()
    if torch is not None:
        res.versions["torch"] = torch.__version__
    detect_cpu(res, root)
    tick()
    gpu = detect_gpu(res, torch) if opts.device != "cpu" else False
    if opts.device == "cuda" and not gpu:
        raise UserError("probe --device cuda: no CUDA device is usable by this PyTorch")
    res.device = "cuda" if gpu else "cpu"
    tick()
    measure_cpu(res, torch, opts, tick)
    if torch is not None:
        if gpu:
            measure_gpu(res, torch, opts, tick)
        measure_standin(res, torch, opts, tick)
        measure_modules(res, torch, opts, tick)
    res.elapsed_s = _time.perf_counter() - t0
    return res


def summary(res: ProbeResult) -> dict[str, Any]:
    """The main figures, for the command's table."""
    out = {
        "cpu": res.value("cpu.name"),
        "cores": res.value("cpu.cores"),
        "threads": res.value("cpu.threads"),
        "l3_mb": (res.value("cpu.l3_bytes") or 0) / 2**20,
        "memory_gb": (res.value("cpu.memory_bytes") or 0) / 1e9,
        "device": res.device,
        "standin_stream_gbs": res.value("standin.gemv_gbs"),
        "standin_copy_gbs": res.value("standin.copy_gbs"),
        "read_gbs_all_cores": res.value("cpu.read_gbs"),
        "elapsed_s": res.elapsed_s,
    }
    return {k: v for k, v in out.items() if v is not None}


__all__ = [
    "FILES",
    "Entry",
    "ProbeOptions",
    "ProbeResult",
    "detect_cpu",
    "detect_gpu",
    "hardware_toml",
    "memory_channels",
    "output_paths",
    "parse_dmidecode_memory",
    "parse_lscpu",
    "parse_meminfo",
    "parse_proc_cpuinfo",
    "parse_size",
    "read_sys_caches",
    "run_probe",
    "runtime_toml",
    "theoretical_dram_gbs",
    "write_probe",
]
