"""The metrics of a run: one registry, from which everything that lists them is derived.

Each :class:`Metric` names a metric once: its unit, its doc line (its definition in
docs/metrics.md), its section of that page, whether it is optional (reported only when its
mechanism is on: the SSD tier), how it is computed (a :class:`Counters` field, or a function of
the run's statistics), and its row in ``daopsim run``'s table. From :data:`METRICS` come:

- what a run computes (:func:`compute_metrics`, :func:`host_tier_metrics`),
- :func:`metric_keys` / :data:`METRIC_KEYS` and :data:`OPTIONAL_METRIC_KEYS`, hence the
  ``metrics`` of ``run --json`` (``RunResult.to_dict``), the golden store (``daopsim regress``
  stores that object) and the sweep table's metric columns,
- the rows of ``daopsim run``'s table (:func:`table_rows`),
- the metric tables of docs/metrics.md (:func:`section_table`; ``make docs-metrics``,
  simulator/doc_tables.py, rewrites them, and tests/test_run_declaration.py checks the
  committed page equals the generated one).

The code that derives a surface reads :data:`METRICS` when it runs, so a metric added here
reaches every surface (tests/test_run_declaration.py adds one). Definitions: docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from daopsim.simulator.hardware_spec import HardwareProfile
    from daopsim.simulator.runstats import RunStats

NAN = float("nan")


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else float("nan")


def busy_frac(busy: float, after_end: float, servers: int, e2e: float) -> float:
    """A busy fraction: busy time within the run's window ``[0, e2e]`` over ``servers x e2e``.

    ``after_end`` is the work done after the last token ended (prefetches issued for a next
    token that never came); it is left out, so the fraction is at most 1. The clamp to [0, 1]
    only absorbs float rounding of sums of durations (docs/metrics.md, "Busy fractions").
    """
    den = float(servers) * float(e2e)
    if not den:
        return float("nan")
    return min(1.0, max(0.0, (float(busy) - float(after_end)) / den))


#: The energy keys of a run's metrics (all NaN when the profile has no [power] section).
ENERGY_KEYS = (
    "energy_gpu_j",
    "energy_cpu_j",
    "energy_dram_j",
    "energy_j",
    "energy_device_j",
    "energy_wall_j",
)


def energy_breakdown(
    hw: HardwareProfile,
    e2e: float,
    gpu_busy: float,
    cpu_busy: float,
    gpus: int = 1,
    cpu_calls: int = 0,
) -> dict[str, float]:
    """Energy over the run by part and level, joules (NaN everywhere without a [power] section).

    - GPU: the context-holding active idle for the whole run, plus (busy - active idle) while a
      kernel runs; with ``gpus`` GPUs, each idles for the whole run and ``gpu_busy`` is their
      summed busy time.
    - CPU package: the driving/spinning level for the whole run, plus (busy - wait) while CPU
      experts run and while their worker threads spin afterwards: ``cpu_calls`` calls each
      followed by up to ``cpu_spin_ms`` of spinning (capped at the run time: workers share one
      socket, and a spin that the next call cuts short is busy time already).
    - DRAM: its average power over the run.
    - ``energy_j`` = GPU + CPU package; ``energy_device_j`` adds DRAM; ``energy_wall_j`` adds
      the platform and divides by the power supply's efficiency.
    """
    power = getattr(hw, "power", None)
    if power is None:
        return dict.fromkeys(ENERGY_KEYS, float("nan"))
    p = power.resolved(hw.cpu.cores_used)
    assert p.gpu_active_idle_w is not None and p.cpu_wait_w is not None
    assert p.dram_w is not None and p.platform_w is not None and p.psu_efficiency is not None
    gpu = gpus * p.gpu_active_idle_w * e2e + (p.gpu_busy_w - p.gpu_active_idle_w) * min(
        gpu_busy, gpus * e2e
    )
    assert p.cpu_spin_ms is not None
    active = min(cpu_busy + cpu_calls * p.cpu_spin_ms * 1e-3, e2e)
    cpu = p.cpu_wait_w * e2e + (p.cpu_busy_w - p.cpu_wait_w) * active
    dram = p.dram_w * e2e
    device = gpu + cpu + dram
    wall = (device + p.platform_w * e2e) / p.psu_efficiency
    return {
        "energy_gpu_j": float(gpu),
        "energy_cpu_j": float(cpu),
        "energy_dram_j": float(dram),
        "energy_j": float(gpu + cpu),
        "energy_device_j": float(device),
        "energy_wall_j": float(wall),
    }


class RunFigures:
    """What the metrics are computed from: a run's statistics (``RunStats``: the counters, the
    end-to-end time, busy time per named resource) and its machine (for energy).

    ``after_end``: seconds of work each copy direction (``h2d``, ``d2h``), the CPU pool
    (``cpu``) and the drive (``ssd``) did after the run's end; ``servers``: how many lanes serve
    a copy direction (one per uplink with several GPUs). Each engine reports both
    (``RunStats.after``, ``RunStats.servers``)."""

    def __init__(
        self,
        stats: RunStats,
        hw: HardwareProfile | None,
        after_end: Mapping[str, float] | None = None,
        servers: Mapping[str, int] | None = None,
    ) -> None:
        self.stats, self.hw = stats, hw
        self.c = stats.counters
        self.e2e = float(stats.e2e)
        self.late = dict(after_end or {})
        self.lanes = dict(servers or {})
        self.busy = stats.busy
        self.workers = stats.workers["cpu"]
        self.n_gpus = stats.workers.get("gpu", 1)  # several GPUs (simulator/multigpu.py)

    @cached_property
    def latency(self) -> np.ndarray:
        """Per-token decode latencies."""
        return np.asarray(self.c.token_latency, dtype=np.float64)

    @cached_property
    def energy(self) -> dict[str, float]:
        """The run's energy by part and level (:func:`energy_breakdown`)."""
        c = self.c
        cpu_calls = int(c.cpu_expert_evals + c.cpu_precalc_evals)
        assert self.hw is not None
        return energy_breakdown(
            self.hw, self.e2e, self.busy["gpu"], self.busy["cpu"], self.n_gpus, cpu_calls
        )

    def copy_busy(self, direction: str) -> float:
        """A copy direction's busy fraction over its lanes."""
        return busy_frac(
            self.busy[direction],
            self.late.get(direction, 0.0),
            self.lanes.get(direction, 1),
            self.e2e,
        )

    def per_kj(self, level: str) -> float:
        """Generated tokens per kJ of the energy at ``level`` (an ``energy_*`` key)."""
        return _ratio(self.c.decode_tokens, self.energy[level] / 1000.0)

    def host_tier(self, key: str) -> Any:
        """One of the SSD tier's totals (``RunStats.host_tier``, simulator/runstats.py)."""
        return self.stats.host_tier[key]


@dataclass(frozen=True)
class Metric:
    """One metric of a run."""

    name: str
    #: tokens/s, s, fraction, count, bytes, J, tokens/kJ
    unit: str
    #: the section of docs/metrics.md whose table defines it
    section: str
    #: its definition (metrics whose definition is the same text share a docs row)
    doc: str
    #: ``Counters`` field the metric is (as an integer), or None
    counter: str | None = None
    #: how it is computed from a run's figures, when it is not a counter
    compute: Callable[[RunFigures], Any] | None = None
    #: reported only when its mechanism is on (a host-memory budget: the SSD tier); a sweep
    #: table has its column only when some row has it
    optional: bool = False
    #: its row in ``daopsim run``'s table: (label, unit shown, scale), or None
    table: tuple[str, str, float] | None = None

    def value(self, run: RunFigures) -> Any:
        """The metric's value for one run."""
        if self.counter is not None:
            return int(getattr(run.c, self.counter))
        assert self.compute is not None, self.name
        return self.compute(run)


def _m(name: str, unit: str, section: str, doc: str, **how: Any) -> Metric:
    return Metric(name, unit, section, doc, **how)


_HITS = "the exact counts behind the two hit rates (integers, so `daopsim regress` compares them exactly)"  # noqa: E501
_TPOT = (
    "mean, median and 99th percentile of per-token decode latency (one decode step: all layers "
    "of one token; a batched step counts once per request in it)"
)
_LINK_BYTES = (
    "bytes over each PCIe direction: expert copies (fetch, prefetch, temporary, write-back) and "
    "activation copies to and from CPU experts. An expert copy moves the host's copy, at "
    "`--host-dtype` ([cost-model.md](cost-model.md#quantisation)). `h2d_bytes` also counts "
    "non-expert weight copies: a CPU-resident layer's prompt op offload, and with streamed "
    "non-expert weights (`ResourceSpec.nonexpert_streamed`, `stream-all`: ZeRO-3) every "
    "layer's non-expert weights plus the input embedding and the output matrix on every "
    "forward pass, at `--nonexpert-dtype` "
    "([cost-model.md](cost-model.md#streamed-non-expert-weights-zero-3))"
)
_COPY_BUSY = (
    "copy-engine busy time within the run / (copy lanes x `e2e_s`): one lane per copy engine "
    "of the direction (`link.copy_engines_per_direction`), on each uplink with several GPUs; "
    "with one copy engine both directions share it, so the two are equal"
)
_GPU_PARTS = (
    "GPU time in expert FFNs; in the non-expert part (attention, norms, router, lm_head share)"
)
_COPIES = "demand copies into slots; copies into temporary buffers; slots freed"
_PREFETCH = "background copies issued; share of them used by a later access before eviction"
_PER_KJ = "generated tokens / (energy at that level / 1000)"
_TIER = "only with a host-memory budget (docs/serving.md, 'An SSD tier')"


def _c(name: str, unit: str, section: str, doc: str, **kw: Any) -> Metric:
    """A metric that is a counter of the same name."""
    return Metric(name, unit, section, doc, counter=name, **kw)


def _tier(name: str, unit: str, doc: str, table: tuple[str, str, float] | None = None) -> Metric:
    """An SSD-tier metric: one of ``RunStats.host_tier``'s totals, optional."""
    return Metric(
        name, unit, "ssd", doc, compute=lambda r: r.host_tier(name), optional=True, table=table
    )


#: Every metric of a run, in display order (the order of ``run --json`` and sweep columns).
METRICS: tuple[Metric, ...] = (
    # -- throughput and latency
    _m("tokens_per_s", "tokens/s", "throughput",
       "generated tokens / `e2e_s`. Prefill time is included, as DAOP measures (generated "
       "tokens / whole `generate()` time). Generated tokens = decode rows of the trace.",
       compute=lambda r: _ratio(r.c.decode_tokens, r.e2e),
       table=("tokens/s (incl. prefill)", "", 1.0)),
    _m("decode_tokens_per_s", "tokens/s", "throughput",
       "generated tokens / time spent in decode steps (prefill excluded)",
       compute=lambda r: _ratio(r.c.decode_tokens, r.c.decode_time),
       table=("decode tokens/s", "", 1.0)),
    _m("ttft_s", "s", "throughput",
       "mean over sequences of the prefill pass's duration (time to first token; with "
       "`--prefill-chunk` or `--preempt`, from the request's admission to its first token; in "
       "a serving run the per-request TTFT from arrival is in `serving`)",
       compute=lambda r: float(np.mean(r.c.ttft)) if r.c.ttft else NAN,
       table=("time to first token", " s", 1.0)),
    _m("tpot_mean_s", "s", "throughput", _TPOT,
       compute=lambda r: float(r.latency.mean()) if r.latency.size else NAN),
    _m("tpot_p50_s", "s", "throughput", _TPOT,
       compute=lambda r: float(np.percentile(r.latency, 50)) if r.latency.size else NAN,
       table=("per-token latency p50", " ms", 1e3)),
    _m("tpot_p99_s", "s", "throughput", _TPOT,
       compute=lambda r: float(np.percentile(r.latency, 99)) if r.latency.size else NAN,
       table=("per-token latency p99", " ms", 1e3)),
    _m("e2e_s", "s", "throughput",
       "simulated time from the start of the first sequence to the end of the last token. "
       "Background work still running after the last token (an unused prefetch) does not "
       "extend it.",
       compute=lambda r: r.e2e, table=("end-to-end time (simulated)", " s", 1.0)),
    # -- expert placement and traffic
    _m("hit_rate", "fraction", "placement",
       "decode expert accesses served by a resident expert (Action GPU) / all decode accesses. "
       "An access is one routed expert of one token-layer (k per token-layer), judged before "
       "that layer's insertions; an expert still in flight from a prefetch counts as a hit "
       "(its wait is stall). For policies that substitute routing (DAOP) the accesses are "
       "those of the route actually used.",
       compute=lambda r: _ratio(r.c.decode_hits, r.c.decode_accesses),
       table=("GPU hit rate (decode)", "", 1.0)),
    _m("prefill_hit_rate", "fraction", "placement",
       "the same over prefill, counting each distinct expert of a layer's prefill pass once",
       compute=lambda r: _ratio(r.c.prefill_hits, r.c.prefill_accesses)),
    _c("decode_hits", "count", "placement", _HITS),
    _c("decode_accesses", "count", "placement", _HITS),
    _c("prefill_hits", "count", "placement", _HITS),
    _c("prefill_accesses", "count", "placement", _HITS),
    _c("h2d_bytes", "bytes", "placement", _LINK_BYTES, table=("host-to-device", " GB", 1e-9)),
    _c("d2h_bytes", "bytes", "placement", _LINK_BYTES, table=("device-to-host", " GB", 1e-9)),
    # -- resource use and stalls
    _m("gpu_busy_frac", "fraction", "resources",
       "GPU compute time (non-expert parts and experts) within the run / `e2e_s`; with several "
       "GPUs, the mean over them (docs/serving.md, \"Multiple GPUs\")",
       compute=lambda r: busy_frac(r.busy["gpu"], 0.0, r.n_gpus, r.e2e),
       table=("GPU busy", "", 1.0)),
    _m("cpu_busy_frac", "fraction", "resources",
       "summed CPU worker busy time within the run / (workers x `e2e_s`); a worker is busy "
       "while its call runs, also while it shares the socket with another",
       compute=lambda r: busy_frac(r.busy["cpu"], r.late.get("cpu", 0.0), r.workers, r.e2e),
       table=("CPU busy", "", 1.0)),
    _m("h2d_busy_frac", "fraction", "resources", _COPY_BUSY,
       compute=lambda r: r.copy_busy("h2d"), table=("H2D link busy", "", 1.0)),
    _m("d2h_busy_frac", "fraction", "resources", _COPY_BUSY,
       compute=lambda r: r.copy_busy("d2h")),
    _m("stall_s", "s", "resources",
       "`transfer_stall_s` + `cpu_wait_s`; with several GPUs each GPU's stream waits on its "
       "own and the times are summed over the GPUs, so it can exceed `e2e_s` (the `run` table "
       "says so beside it)",
       compute=lambda r: r.c.transfer_stall + r.c.cpu_wait,
       table=("GPU stall (copies + CPU)", " s", 1.0)),
    _m("transfer_stall_s", "s", "resources",
       "time the GPU stream waited for an expert copy to arrive (summed over the GPUs' "
       "streams, as `stall_s`)",
       compute=lambda r: r.c.transfer_stall),
    _m("cpu_wait_s", "s", "resources",
       "time a layer waited for CPU results after the GPU finished its share",
       compute=lambda r: r.c.cpu_wait),
    _m("dispatch_stall_s", "s", "resources",
       "time the GPU stream waited for the runtime's host thread to issue kernels (0 with the "
       "`ideal` runtime; summed over the GPUs' streams, as `stall_s`)",
       compute=lambda r: r.c.dispatch_stall, table=("GPU waiting for dispatch", " s", 1.0)),
    _c("host_syncs", "count", "resources",
       "blocking syncs of the runtime's host thread: one per forward pass, plus the routing "
       "and per-expert syncs its profile declares", table=("host syncs", "", 1.0)),
    _m("gpu_expert_s", "s", "resources", _GPU_PARTS, compute=lambda r: r.c.gpu_expert_busy),
    _m("cpu_nonexpert_s", "s", "resources",
       "host CPU time in the non-expert part of CPU-resident layers (`ResourceSpec.gpu_blocks`, "
       "llama.cpp's `-ngl`; also in `cpu_busy_frac`; docs/cost-model.md, \"CPU-resident "
       "layers\")",
       compute=lambda r: r.c.cpu_nonexpert_busy),
    _c("cpu_layer_weight_copies", "count", "resources",
       "copies of a CPU-resident layer's non-expert weights to the GPU for a prompt (op "
       "offload; their bytes are in `h2d_bytes`)"),
    _c("nonexpert_weight_copies", "count", "resources",
       "streamed non-expert weight copies (`ResourceSpec.nonexpert_streamed`, `stream-all`: "
       "ZeRO-3): each layer's per forward pass, plus the input embedding and the output "
       "matrix (docs/cost-model.md, \"Streamed non-expert weights\")"),
    _c("nonexpert_weight_bytes", "bytes", "resources",
       "the bytes of those copies (also in `h2d_bytes`)"),
    _m("gpu_nonexpert_s", "s", "resources", _GPU_PARTS,
       compute=lambda r: r.c.gpu_nonexpert_busy),
    _m("cpu_expert_evals", "count", "resources",
       "expert computations on the CPU (synchronous and pre-calculated)",
       compute=lambda r: int(r.c.cpu_expert_evals + r.c.cpu_precalc_evals),
       table=("CPU expert evaluations", "", 1.0)),
    _c("cpu_precalc_evals", "count", "resources",
       "of those, pre-calculations for a coming layer (DAOP)"),
    _m("cpu_precalc_wasted", "count", "resources",
       "pre-calculations never consumed: expired at the end of their token (e.g. DAOP's "
       "last-layer quirk, or a wrong prediction under `exact_fallback`)",
       counter="precalc_wasted"),
    _c("fetches", "count", "placement", _COPIES),
    _c("temp_copies", "count", "placement", _COPIES),
    _c("evictions", "count", "placement", _COPIES),
    _c("evictions_in_flight", "count", "placement",
       "of those, evictions of an expert whose copy had not landed yet (the copy runs to its "
       "end and its slot is freed, or written back, then; docs/policy-api.md)"),
    _c("h2d_expert_copies", "count", "placement",
       "expert copies host to device: demand, prefetched, temporary and low-bit copies (their "
       "bytes are in `h2d_bytes`)"),
    _c("d2h_expert_copies", "count", "placement",
       "expert write-backs device to host (`ResourceSpec.writeback`; their bytes are in "
       "`d2h_bytes`)"),
    _c("prefetches", "count", "placement", _PREFETCH),
    _m("prefetch_precision", "fraction", "placement", _PREFETCH,
       compute=lambda r: _ratio(r.c.prefetch_used, r.c.prefetches),
       table=("prefetch precision", "", 1.0)),
    _c("prefetch_wasted_bytes", "bytes", "placement",
       "bytes of prefetched experts evicted before any use"),
    # -- routing fidelity
    _m("routing_replaced_frac", "fraction", "fidelity",
       "true routed experts (token-layer-expert) not in the route the policy used / all true "
       "routed experts",
       compute=lambda r: _ratio(r.c.replaced_mispredicted + r.c.replaced_degraded,
                                r.c.true_accesses),
       table=("routing replaced", "", 1.0)),
    _m("replaced_mispredicted_frac", "fraction", "fidelity",
       "of those, experts missing from the policy's raw prediction",
       compute=lambda r: _ratio(r.c.replaced_mispredicted, r.c.true_accesses)),
    _m("replaced_degraded_frac", "fraction", "fidelity",
       "experts in the raw prediction but dropped by a degradation step",
       compute=lambda r: _ratio(r.c.replaced_degraded, r.c.true_accesses)),
    _m("gate_mass_preserved", "fraction", "fidelity",
       "sum over token-layers of the true gate weights of experts kept in the used route / "
       "total true gate mass",
       compute=lambda r: _ratio(r.c.gate_mass_kept, r.c.gate_mass_total),
       table=("gate mass preserved", "", 1.0)),
    _m("low_precision_gate_mass", "fraction", "fidelity",
       "sum over decode token-layers of the true gate weights of experts computed from a "
       "low-precision copy (`Plan.low_bit`: `hobbit`'s low-bit loads, `slicemoe`'s experts "
       "held as their high-order slice) / total true gate mass",
       compute=lambda r: _ratio(r.c.gate_mass_low_bit, r.c.gate_mass_total),
       table=("gate mass in low precision", "", 1.0)),
    _c("low_bit_copies", "count", "fidelity",
       "low-precision expert copies moved host to device (counted in `h2d_bytes` at the "
       "low-bit size)"),
    # -- energy
    _m("energy_j", "J", "energy",
       "`energy_gpu_j + energy_cpu_j`: GPU and CPU package, as before; the per-state powers "
       "below replace bare idle",
       compute=lambda r: r.energy["energy_j"], table=("energy", " kJ", 1e-3)),
    _m("tokens_per_kj", "tokens/kJ", "energy", _PER_KJ,
       compute=lambda r: r.per_kj("energy_j"), table=("tokens per kJ", "", 1.0)),
    _m("energy_gpu_j", "J", "energy",
       "`gpu_active_idle_w x e2e + (gpu_busy_w - gpu_active_idle_w) x GPU busy time`: a GPU "
       "holding a CUDA context never drops to bare idle during a run, so waiting on copies or "
       "on the CPU costs the context-holding power. With N GPUs: N × `gpu_active_idle_w x "
       "e2e` plus the busy term over their summed busy time",
       compute=lambda r: r.energy["energy_gpu_j"]),
    _m("energy_cpu_j", "J", "energy",
       "`cpu_wait_w x e2e + (cpu_busy_w - cpu_wait_w) x min(CPU busy time + CPU calls x "
       "cpu_spin_ms, e2e)`: the package drives the GPU (the dispatching thread) for the whole "
       "run, and is at busy power while CPU experts run and while their worker threads spin "
       "after each call before they sleep (`cpu_spin_ms`, 14 ms by default: libgomp's spin "
       "count at Skylake-and-later PAUSE latency, docs/hardware-profiles.md); a run whose CPU "
       "calls come closer together than that keeps the package busy throughout",
       compute=lambda r: r.energy["energy_cpu_j"]),
    _m("energy_dram_j", "J", "energy", "`dram_w x e2e`",
       compute=lambda r: r.energy["energy_dram_j"]),
    _m("energy_device_j", "J", "energy",
       "`energy_j + energy_dram_j` (GPU + CPU package + DRAM): compare with device-sum "
       "measurements",
       compute=lambda r: r.energy["energy_device_j"]),
    _m("energy_wall_j", "J", "energy",
       "`(energy_device_j + platform_w x e2e) / psu_efficiency`: compare with wall-meter "
       "measurements",
       compute=lambda r: r.energy["energy_wall_j"]),
    _m("tokens_per_kj_device", "tokens/kJ", "energy", _PER_KJ,
       compute=lambda r: r.per_kj("energy_device_j")),
    _m("tokens_per_kj_wall", "tokens/kJ", "energy", _PER_KJ,
       compute=lambda r: r.per_kj("energy_wall_j")),
    # -- counts
    _c("decode_tokens", "count", "counts",
       "generated tokens: decode rows of the trace run (in a serving run, over every request)"),
    _c("prefill_tokens", "count", "counts", "prompt tokens run through prefill passes"),
    _c("sequences", "count", "counts",
       "evaluation sequences (requests) run; the same number as the run configuration's "
       "`sequences`"),
    _m("max_slots_held", "count", "placement",
       "most expert slots held at once (resident, in flight, or waiting for a write-back)",
       counter="max_occupancy"),
    # -- the SSD tier: only with a host-memory budget (docs/serving.md, "An SSD tier")
    _tier("ssd_bytes", "bytes",
          "bytes read from the NVMe drive (host-precision expert bytes per read)",
          table=("read from SSD", " GB", 1e-9)),
    _tier("ssd_reads", "count",
          "expert reads from the drive (page cache and GPUDirect Storage together)"),
    _tier("ssd_stall_s", "s",
          "per layer, the time from the layer's decision until its last routed expert's "
          "weights are readable (in host memory, or with GDS in GPU memory), summed over "
          "layers; 0 when every routed expert was in host memory. Prefetches and "
          "pre-calculations do not count",
          table=("waiting for SSD reads", " s", 1.0)),
    Metric("ssd_busy_frac", "fraction", "ssd",
           "drive busy time within the run / `e2e_s` (background reads that continue after "
           "the last token are left out, as for the other busy fractions)",
           compute=lambda r: busy_frac(r.busy.get("ssd", 0.0), r.late.get("ssd", 0.0), 1, r.e2e)
           if r.e2e > 0 else 0.0,
           optional=True),
    _tier("host_evictions", "count",
          "expert copies dropped from host memory to make room (page-cache reclaim)"),
    _tier("host_memory_peak_bytes", "bytes",
          "the most host memory held at once: non-expert weights + expert copies (page-cache "
          "pages included; never above the budget)",
          table=("host memory peak", " GB", 1e-9)),
    _tier("host_memory_budget_bytes", "bytes",
          "the budget, bytes (`--host-memory-gb` x 10⁹)"),
)  # fmt: skip


def metric_keys() -> tuple[str, ...]:
    """Every metric's name, in display order (read from :data:`METRICS` when called)."""
    return tuple(m.name for m in METRICS)


def optional_metric_keys() -> frozenset[str]:
    """The metrics a run reports only when their mechanism is on."""
    return frozenset(m.name for m in METRICS if m.optional)


#: The metrics every run reports, in display order (docs/metrics.md defines each).
METRIC_KEYS = metric_keys()
#: metrics a run reports only when their mechanism is on (a host-memory budget): a sweep table
#: has their columns only if some row has them
OPTIONAL_METRIC_KEYS = optional_metric_keys()


def compute_metrics(
    stats: RunStats,
    hw: HardwareProfile,
    after_end: Mapping[str, float] | None = None,
    servers: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """The metrics every run reports (the registry's non-optional ones) from its statistics
    (counters and busy time per named resource); ``after_end`` and ``servers`` as
    :class:`RunFigures` takes them (each engine reports them in ``RunStats.after``)."""
    run = RunFigures(stats, hw, after_end, servers)
    return {m.name: m.value(run) for m in METRICS if not m.optional}


def host_tier_metrics(stats: Any, after_end: float = 0.0) -> dict[str, float]:
    """The SSD tier's metrics (the registry's optional ones) from a run's statistics;
    ``after_end`` is the drive's work after the run's end (background reads), left out of
    ``ssd_busy_frac``."""
    run = RunFigures(stats, None, {"ssd": after_end})
    return {m.name: m.value(run) for m in METRICS if m.optional}


def table_rows() -> list[tuple[str, str, str, float]]:
    """``daopsim run``'s table rows: (metric, label, unit shown, scale), in display order."""
    return [(m.name, *m.table) for m in METRICS if m.table is not None]


# -- docs/metrics.md ---------------------------------------------------------------------------
#: the docs page whose metric tables are generated, relative to the repository
DOC = "docs/metrics.md"


def section_table(section: str) -> str:
    """The Markdown table of one section: one row per definition (metrics sharing a
    definition share a row), in registry order."""
    rows: dict[str, list[Metric]] = {}
    for m in METRICS:
        if m.section == section:
            rows.setdefault(m.doc, []).append(m)
    lines = ["| metric | unit | definition |", "|---|---|---|"]
    for doc, ms in rows.items():
        names = ", ".join(f"`{m.name}`" for m in ms)
        units = ", ".join(dict.fromkeys(m.unit for m in ms))
        lines.append(f"| {names} | {units} | {doc} |")
    return "\n".join(lines)
