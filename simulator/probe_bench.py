"""Microbenchmarks of ``daopsim probe``: weight streams, copies, GEMMs and per-call host costs.

Every function times one thing the cost model charges, the way an inference runtime does it,
and returns seconds (or a rate) together with how it was timed:

* **Clocks.** One-thread measurements use the calling thread's CPU time (``time.thread_time``):
  on a machine others share, time the thread spends descheduled is not counted, while time it
  stalls on memory is. Several-thread measurements use wall time (``time.perf_counter``),
  because the work runs on other threads too. Each figure is the minimum over repeats, the
  least-disturbed run (a neighbour can slow a repeat, never speed it up).
* **Cold weights.** A weight stream is timed over a pool of buffers several times the CPU's
  last-level cache, visited in turn, so every call reads its weights from DRAM as inside a
  model whose weights do not fit in the cache. A matrix called again and again on its own runs
  from the cache instead and looks faster than it is in a model.
* **Width and host time.** The host time of a PyTorch module (Python, dispatch, allocation,
  the kernels' fixed costs) is its time at a width where the arithmetic is negligible (hidden
  size 64); the arithmetic of a module shaped like the model is its time at full width minus
  that (docs/cost-model.md, "A device on the host thread").

torch is imported lazily: without it only the numpy measurements run (the caller lists what
could not be measured).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

#: how many times the last-level cache a cold pool holds at least
COLD_POOL_LLC = 4
#: smallest cold pool, bytes (when the cache size is unknown or small)
MIN_POOL_BYTES = 128e6


@dataclass(frozen=True)
class Timing:
    """The minimum and median of repeated timings of one call, seconds, and how they were
    taken (``clock``: ``thread`` CPU time or ``wall`` time; ``repeats``)."""

    best: float
    median: float
    repeats: int
    clock: str

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the probe's JSON)."""
        return {
            "best_s": self.best,
            "median_s": self.median,
            "repeats": self.repeats,
            "clock": self.clock,
        }


def timed(fn: Callable[[], float], repeats: int) -> Timing:
    """Run ``fn`` (which returns the seconds of one measured pass) ``repeats`` times after one
    untimed warm-up pass; the minimum and median."""
    fn()
    runs = [fn() for _ in range(max(1, repeats))]
    return Timing(min(runs), statistics.median(runs), len(runs), "")


def clock(threads: int) -> tuple[Callable[[], float], str]:
    """The clock for work on ``threads`` threads: the thread's CPU time for one, wall time
    otherwise."""
    if threads <= 1:
        return time.thread_time, "thread"
    return time.perf_counter, "wall"


def pool_count(item_bytes: float, llc_bytes: float | None, minimum: int = 2) -> int:
    """How many buffers of ``item_bytes`` a cold pool holds: at least ``COLD_POOL_LLC`` times
    the last-level cache (at least ``MIN_POOL_BYTES``)."""
    target = max(MIN_POOL_BYTES, COLD_POOL_LLC * (llc_bytes or 0.0))
    return max(minimum, int(target // max(1.0, item_bytes)) + 1)


def load_torch() -> Any:
    """The torch module, or None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch


@contextlib.contextmanager
def torch_threads(torch: Any, n: int) -> Iterator[None]:
    """PyTorch's intra-op threads set to ``n`` inside the block, restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def torch_dtype(torch: Any, name: str) -> Any:
    """The torch dtype of a precision name (``fp32``, ``bf16``, ``fp16``)."""
    return getattr(torch, TORCH_DTYPES[name])


# --- weight streams --------------------------------------------------------------------------
def gemv_stream(
    torch: Any,
    dtype: str,
    threads: int,
    shape: tuple[int, int],
    llc_bytes: float | None,
    repeats: int,
    device: str = "cpu",
) -> tuple[float, Timing]:
    """GB/s of one-token linear calls (``F.linear`` of one row against a ``rows x cols``
    weight, what a decode step does to every weight matrix) over a cold pool, on ``threads``
    threads; and the timing of one call."""
    rows, cols = shape
    td = torch_dtype(torch, dtype)
    nbytes = rows * cols * td.itemsize
    n = pool_count(nbytes, llc_bytes if device == "cpu" else None)
    with torch_threads(torch, threads):
        # the values do not change a linear's time: a constant fills fastest
        pool = torch.empty((n, rows, cols), dtype=td, device=device).fill_(1e-3)
        x = torch.randn(1, cols, dtype=td, device=device)
        now, name = clock(threads) if device == "cpu" else (time.perf_counter, "wall")
        lin = torch.nn.functional.linear

        def one_pass() -> float:
            sync(torch, device)
            t0 = now()
            with torch.no_grad():
                for i in range(n):
                    lin(x, pool[i])
            sync(torch, device)
            return (now() - t0) / n

        t = timed(one_pass, repeats)
    t = Timing(t.best, t.median, t.repeats, name)
    return nbytes / t.best / 1e9, t


def int8_stream(
    torch: Any,
    threads: list[int],
    shape: tuple[int, int],
    llc_bytes: float | None,
    repeats: int,
) -> dict[int, tuple[float, Timing]] | None:
    """GB/s of one-token calls of PyTorch's dynamically quantised int8 linear (fbgemm/onednn
    int8 weights, one scale per row) over a cold pool, at each thread count; None when this
    build has no such kernel. The bytes counted are the int8 weights."""
    import warnings

    rows, cols = shape
    out: dict[int, tuple[float, Timing]] = {}
    try:
        warnings.filterwarnings("ignore", message=".*quantize.*deprecated.*")
        qlin = torch.ao.nn.quantized.dynamic.Linear
        n = pool_count(rows * cols, llc_bytes)
        mods = [qlin(cols, rows, bias_=False, dtype=torch.qint8) for _ in range(n)]
        x = torch.randn(1, cols)
        for t_n in threads:
            with torch_threads(torch, t_n):
                now, name = clock(t_n)

                def one_pass(now: Callable[[], float] = now) -> float:
                    t0 = now()
                    with torch.no_grad():
                        for m in mods:
                            m(x)
                    return (now() - t0) / n

                t = timed(one_pass, repeats)
            t = Timing(t.best, t.median, t.repeats, name)
            out[t_n] = (rows * cols / t.best / 1e9, t)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return out


def read_stream(torch: Any, threads: int, nbytes: float, repeats: int) -> tuple[float, Timing]:
    """GB/s of a pure read stream (``sum`` over an fp32 buffer much larger than the caches) on
    ``threads`` threads: the bandwidth all of them together get from DRAM (STREAM-like)."""
    n = int(nbytes // 4)
    with torch_threads(torch, threads):
        buf = torch.empty(n, dtype=torch.float32).fill_(1.0)
        now, name = clock(threads)

        def one_pass() -> float:
            t0 = now()
            buf.sum()
            return now() - t0

        t = timed(one_pass, repeats)
    t = Timing(t.best, t.median, t.repeats, name)
    return n * 4 / t.best / 1e9, t


def copy_rate(
    torch: Any,
    nbytes: float,
    llc_bytes: float | None,
    repeats: int,
    src_device: str = "cpu",
    dst_device: str = "cpu",
    pinned: bool = False,
) -> tuple[float, Timing]:
    """GB/s of copying buffers of ``nbytes`` (bytes copied per second) from a cold pool into a
    few destination buffers, as an offloading runtime copies an expert into a slot: on one
    CPU thread between two pools of host memory (the stand-in's link), or host to device /
    device to host on a GPU (``pinned``: page-locked host buffers)."""
    n_el = int(nbytes // 4)
    host = src_device == "cpu"
    n = pool_count(nbytes, llc_bytes if host and dst_device == "cpu" else None)
    with torch_threads(torch, 1):
        src = [torch.empty(n_el, dtype=torch.float32, device=src_device) for _ in range(n)]
        for s in src:
            s.normal_() if s.device.type == "cpu" else s.zero_()
        if pinned and host:
            src = [s.pin_memory() for s in src]
        dst = [torch.empty(n_el, dtype=torch.float32, device=dst_device) for _ in range(2)]
        if pinned and dst_device == "cpu":
            dst = [d.pin_memory() for d in dst]
        gpu = "cuda" in (src_device + dst_device)
        now, name = (time.perf_counter, "wall") if gpu else clock(1)
        dev = dst_device if dst_device != "cpu" else src_device

        def one_pass() -> float:
            sync(torch, dev)
            t0 = now()
            for i in range(n):
                dst[i % 2].copy_(src[i], non_blocking=pinned)
            sync(torch, dev)
            return (now() - t0) / n

        t = timed(one_pass, repeats)
    t = Timing(t.best, t.median, t.repeats, name)
    return n_el * 4 / t.best / 1e9, t


def gemm_rate(
    torch: Any, dtype: str, threads: int, size: int, repeats: int, device: str = "cpu"
) -> tuple[float, Timing]:
    """GFLOPS of a square ``size x size`` matrix product at ``dtype`` on ``threads`` threads
    (compute-bound: the operands stay in the caches)."""
    td = torch_dtype(torch, dtype)
    with torch_threads(torch, threads):
        a = torch.randn(size, size, device=device).to(td)
        b = torch.randn(size, size, device=device).to(td)
        now, name = clock(threads) if device == "cpu" else (time.perf_counter, "wall")

        def one_pass() -> float:
            sync(torch, device)
            t0 = now()
            torch.mm(a, b)
            sync(torch, device)
            return now() - t0

        t = timed(one_pass, repeats)
    t = Timing(t.best, t.median, t.repeats, name)
    return 2.0 * size**3 / t.best / 1e9, t


# --- host costs of single calls ----------------------------------------------------------------
def per_call(
    fn: Callable[[], Any], calls: int, repeats: int, reset: Callable[[], Any] | None = None
) -> Timing:
    """Thread-CPU seconds of one call of ``fn`` (the minimum over repeats of ``calls`` calls;
    ``reset``, untimed, before each repeat: e.g. a KV cache back to its length)."""

    def one_pass() -> float:
        if reset is not None:
            reset()
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        return (time.thread_time() - t0) / calls

    t = timed(one_pass, repeats)
    return Timing(t.best, t.median, t.repeats, "thread")


def host_calls(
    torch: Any, repeats: int, calls: int = 2000, device: str = "cpu"
) -> dict[str, Timing]:
    """Host time of single calls with negligible arithmetic, on one thread: a small op (an
    add of two 64-wide rows), an empty module call, a tiny ``nn.Linear`` module call, a tiny
    ``copy_``, and reading one value back to Python (``.item()``: on a GPU the host waits for
    the stream there, a sync; on the CPU it is one more small op)."""
    with torch_threads(torch, 1):
        a = torch.randn(1, 64, device=device)
        b = torch.randn(1, 64, device=device)
        lin = torch.nn.Linear(64, 64, bias=False).to(device)
        empty = torch.nn.Identity()
        dst = torch.empty(1, 64, device=device)
        with torch.no_grad():
            return {
                "small_op": per_call(lambda: a + b, calls, repeats),
                "module_call": per_call(lambda: empty(a), calls, repeats),
                "linear_module": per_call(lambda: lin(a), calls, repeats),
                "copy_call": per_call(lambda: dst.copy_(a), calls, repeats),
                "item": per_call(lambda: (a + b)[0, 0].item(), calls, repeats),
            }


def sync(torch: Any, device: str) -> None:
    """Wait for a GPU's stream (nothing on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --- numpy fallbacks (no torch) ------------------------------------------------------------------
def numpy_read_stream(nbytes: float, repeats: int) -> tuple[float, Timing]:
    """GB/s of numpy's ``sum`` over a large fp32 buffer on the calling thread (one thread)."""
    import numpy as np

    buf = np.random.default_rng(0).standard_normal(int(nbytes // 4), dtype=np.float32)

    def one_pass() -> float:
        t0 = time.thread_time()
        buf.sum()
        return time.thread_time() - t0

    t = timed(one_pass, repeats)
    return buf.nbytes / t.best / 1e9, Timing(t.best, t.median, t.repeats, "thread")


def numpy_copy_rate(nbytes: float, llc_bytes: float | None, repeats: int) -> tuple[float, Timing]:
    """GB/s of ``numpy.copyto`` of ``nbytes`` buffers from a cold pool, one thread."""
    import numpy as np

    n = pool_count(nbytes, llc_bytes)
    n_el = int(nbytes // 4)
    src = [np.full(n_el, float(i), dtype=np.float32) for i in range(n)]
    dst = [np.empty(n_el, dtype=np.float32) for _ in range(2)]

    def one_pass() -> float:
        t0 = time.thread_time()
        for i in range(n):
            np.copyto(dst[i % 2], src[i])
        return (time.thread_time() - t0) / n

    t = timed(one_pass, repeats)
    return n_el * 4 / t.best / 1e9, Timing(t.best, t.median, t.repeats, "thread")
