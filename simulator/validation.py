"""Validation against published measurements: the table, the runs and the report.

``validation/published.toml`` lists published measurements (tokens/s, s/token, hit rates,
ratios), each with its exact source, the setting it was measured in and the simulator
configuration that reproduces that setting. :func:`run_validation` simulates every modelled row
and compares; rows the simulator cannot model yet carry ``modelled = false`` and a reason.

Row format (docs/validation.md has the full description)::

    [[row]]
    id = "fiddler-a6000-mixtral-offloading"
    source = "efeslab/fiddler benchmarks/results/RTX-A6000/... (commit ebdded3)"
    system = "Mixtral-offloading"       # hardware, model, precision, workload: free text
    published = 0.695
    unit = "tokens/s"                   # tokens/s | s/token | s | hit rate | ratio
    metric = "tokens_per_s"             # a RunResult metric, or per_layer_hit_rate[i]
    modelled = true
    [row.sim]                           # simulate() arguments
    policy = "mixtral-offloading"
    hw = "a6000-pcie4"
    trace = "mixtral-8x7b"              # bundled name, or [row.sim.synth]
    [row.baseline]                      # ratio rows: overrides of [row.sim] for the denominator

Synthetic traces (``[row.sim.synth]``: preset, sequences, prompt_tokens, output_tokens, seed) are
generated on first use into a user cache folder (``$DAOPSIM_CACHE`` or
``~/.cache/daopsim/validation``) and reused; they are never written into the repository.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import re
import statistics
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulator.data import bundled_dir, check_input_file
from simulator.errors import UserError

#: Units a row may use.
#: ``s`` is a duration in seconds, e.g. the time to the first token (``ttft_s``).
UNITS = ("tokens/s", "s/token", "s", "hit rate", "ratio")
#: What a row is for. A ``calibration`` row was looked at to choose a constant, preset or profile
#: value (its ``calibrated`` field says which); a ``test`` row was not. Errors are reported over
#: test rows only; calibration rows are listed separately.
ROLES = ("calibration", "test")
#: Keys of ``[row.sim]`` that are passed to :func:`simulator.runner.simulate`.
SIM_KEYS = (
    "policy",
    "hw",
    "trace",
    "cache_ratio",
    "gpu_experts",
    "sequences",
    "policy_options",
    "seed",
    "dtype",
    "host_dtype",
    "nonexpert_dtype",
    "runtime",
)
_REQUIRED = (
    "id",
    "source",
    "system",
    "hardware",
    "model",
    "precision",
    "workload",
    "unit",
    "role",
)
_METRIC_RE = re.compile(r"^([a-z_0-9]+)(?:\[(\d+)\])?$")
#: Markers around the generated table in docs/validation.md.
TABLE_START = "<!-- validation-table:start -->"
TABLE_END = "<!-- validation-table:end -->"


def default_table() -> Path:
    """The bundled table, validation/published.toml."""
    return bundled_dir("validation") / "published.toml"


def cache_dir() -> Path:
    """Where generated synthetic traces are cached (outside the repository)."""
    env = os.environ.get("DAOPSIM_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "daopsim"
    return base.expanduser() / "validation"


@dataclass
class Row:
    """One published measurement and the simulator setting that reproduces it."""

    id: str
    source: str
    system: str
    hardware: str
    model: str
    precision: str
    workload: str
    unit: str
    published: float | None
    metric: str
    modelled: bool
    role: str = "test"
    calibrated: str = ""
    reason: str = ""
    note: str = ""
    published_range: tuple[float, float] | None = None
    sim: dict[str, Any] = field(default_factory=dict)
    baseline: dict[str, Any] | None = None

    @property
    def is_ratio(self) -> bool:
        """True when the value is sim / baseline of two runs."""
        return self.baseline is not None


@dataclass
class RowResult:
    """A row with its simulated value and relative error (None when not modelled or failed).

    For a row run over several trace seeds, ``simulated`` is the mean and ``spread`` holds the
    lowest and highest per-seed value.
    """

    row: Row
    simulated: float | None = None
    error: str = ""
    spread: tuple[float, float] | None = None
    per_seed: list[float] = field(default_factory=list)

    @property
    def rel_error(self) -> float | None:
        """(simulated - published) / published."""
        pub = self.row.published
        if self.simulated is None or pub is None or pub == 0 or not math.isfinite(self.simulated):
            return None
        return (self.simulated - pub) / pub

    def to_dict(self) -> dict[str, Any]:
        """JSON form of one row."""
        r = self.row
        return {
            "id": r.id,
            "source": r.source,
            "system": r.system,
            "hardware": r.hardware,
            "model": r.model,
            "precision": r.precision,
            "workload": r.workload,
            "published": r.published,
            "published_range": list(r.published_range) if r.published_range else None,
            "simulated": self.simulated,
            "unit": r.unit,
            "metric": r.metric,
            "spread": list(self.spread) if self.spread else None,
            "per_seed": list(self.per_seed) or None,
            "rel_error": self.rel_error,
            "role": r.role,
            "calibrated": r.calibrated or None,
            "modelled": r.modelled and not self.error,
            "reason": r.reason if not r.modelled else self.error,
            "note": r.note,
        }


def _summary(results: list[RowResult]) -> dict[str, Any]:
    """Error summary of some rows: count, median and worst absolute error, the ids."""
    errs = [abs(e) for e in (r.rel_error for r in results) if e is not None]
    return {
        "modelled": len(errs),
        "median_abs_error": statistics.median(errs) if errs else None,
        "max_abs_error": max(errs) if errs else None,
        "ids": [r.row.id for r in results if r.rel_error is not None],
    }


@dataclass
class Report:
    """All rows of one validation run; the error summary is over the TEST rows that ran."""

    results: list[RowResult]

    def by_role(self, role: str) -> list[RowResult]:
        """The results of the rows with this role."""
        return [r for r in self.results if r.row.role == role]

    def summary(self, role: str = "test") -> dict[str, Any]:
        """Count, median and worst absolute error and ids of the rows of one role that ran."""
        return _summary(self.by_role(role))

    @property
    def median_abs_error(self) -> float | None:
        """Median absolute relative error over the test rows that ran."""
        return self.summary()["median_abs_error"]

    @property
    def max_abs_error(self) -> float | None:
        """Worst absolute relative error over the test rows that ran."""
        return self.summary()["max_abs_error"]

    @property
    def not_modelled(self) -> list[RowResult]:
        """Rows without a simulated value (not modelled yet, or failed to run)."""
        return [r for r in self.results if r.simulated is None]

    def worst(self, n: int = 3, role: str = "test") -> list[RowResult]:
        """The n rows of a role furthest off."""
        ran = [r for r in self.by_role(role) if r.rel_error is not None]
        return sorted(ran, key=lambda r: -abs(r.rel_error or 0.0))[:n]

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object (top-level errors are over test rows only)."""
        test = self.summary("test")
        return {
            "rows": [r.to_dict() for r in self.results],
            "median_abs_error": test["median_abs_error"],
            "max_abs_error": test["max_abs_error"],
            "modelled_rows": test["modelled"],
            "test_rows": test,
            "calibration_rows": self.summary("calibration"),
            "not_modelled": [
                {"id": r.row.id, "reason": r.row.reason or r.error} for r in self.not_modelled
            ],
        }


# --- the table ------------------------------------------------------------------------------------
def _num(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise UserError(f"{where} must be a finite number, got {v!r}")
    return float(v)


def _parse_row(raw: Any, i: int, path: Path) -> Row:
    where = f"{path}: row {i + 1}"
    if not isinstance(raw, dict):
        raise UserError(f"{where}: not a table")
    rid = raw.get("id")
    if isinstance(rid, str) and rid:
        where = f"{path}: row {rid!r}"
    for key in _REQUIRED:
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            raise UserError(f"{where}: missing or empty text field {key!r}")
    if raw["unit"] not in UNITS:
        raise UserError(f"{where}: unit {raw['unit']!r} is not one of {', '.join(UNITS)}")
    if raw["role"] not in ROLES:
        raise UserError(f"{where}: role {raw['role']!r} is not one of {', '.join(ROLES)}")
    calibrated = raw.get("calibrated", "")
    if not isinstance(calibrated, str):
        raise UserError(f"{where}: 'calibrated' must be text")
    if raw["role"] == "calibration" and not calibrated.strip():
        raise UserError(
            f"{where}: a calibration row needs 'calibrated': what was chosen by looking at it"
        )
    modelled = raw.get("modelled", True)
    if not isinstance(modelled, bool):
        raise UserError(f"{where}: 'modelled' must be true or false")
    reason = str(raw.get("reason", ""))
    if not modelled and not reason.strip():
        raise UserError(f"{where}: a row with modelled = false needs a 'reason'")
    pub = raw.get("published")
    published = None if pub is None else _num(pub, f"{where}: 'published'")
    if modelled and published is None:
        raise UserError(f"{where}: missing 'published'")
    rng = raw.get("published_range")
    prange = None
    if rng is not None:
        if not isinstance(rng, list) or len(rng) != 2:
            raise UserError(f"{where}: 'published_range' must be [low, high]")
        prange = (_num(rng[0], f"{where}: published_range"), _num(rng[1], f"{where}: range"))
    metric = raw.get("metric", "")
    if modelled and (not isinstance(metric, str) or not _METRIC_RE.match(metric)):
        raise UserError(f"{where}: 'metric' must name a run metric, e.g. tokens_per_s")
    sim = raw.get("sim", {})
    base = raw.get("baseline")
    if not isinstance(sim, dict) or (base is not None and not isinstance(base, dict)):
        raise UserError(f"{where}: 'sim' and 'baseline' must be tables")
    if modelled:
        for key in ("policy", "hw"):
            if key not in sim:
                raise UserError(f"{where}: [row.sim] needs {key!r}")
        if "trace" not in sim and "synth" not in sim:
            raise UserError(f"{where}: [row.sim] needs 'trace' or a [row.sim.synth] table")
        for key in list(sim) + list(base or {}):
            if key not in SIM_KEYS and key not in SERVING_SIM_KEYS and key != "synth":
                raise UserError(f"{where}: unknown simulator key {key!r}")
    if modelled and "synth" in sim:
        try:
            trace_seeds(sim)
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
    if (raw["unit"] == "ratio") != (base is not None) and modelled:
        raise UserError(f"{where}: a 'ratio' row needs [row.baseline], and only a ratio row")
    return Row(
        id=raw["id"],
        source=raw["source"],
        system=raw["system"],
        hardware=raw["hardware"],
        model=raw["model"],
        precision=raw["precision"],
        workload=raw["workload"],
        unit=raw["unit"],
        published=published,
        metric=str(metric),
        modelled=modelled,
        role=raw["role"],
        calibrated=calibrated.strip(),
        reason=reason,
        note=str(raw.get("note", "")),
        published_range=prange,
        sim=dict(sim),
        baseline=None if base is None else dict(base),
    )


def load_table(path: str | os.PathLike[str] | None = None) -> list[Row]:
    """Parse and check the table; a mistake raises UserError naming the file and the row."""
    p = Path(path) if path is not None else default_table()
    if p.exists():
        check_input_file(p, "validation table")
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise UserError(f"{p}: no such validation table") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{p}: not valid TOML: {exc}") from None
    raws = data.get("row")
    if not isinstance(raws, list) or not raws:
        raise UserError(f"{p}: no [[row]] entries")
    rows = [_parse_row(r, i, p) for i, r in enumerate(raws)]
    seen: set[str] = set()
    for r in rows:
        if r.id in seen:
            raise UserError(f"{p}: row id {r.id!r} appears twice")
        seen.add(r.id)
    return rows


def select(rows: list[Row], ids: str | None) -> list[Row]:
    """Rows whose id is in the comma-separated list (all when None; an empty list is a
    mistake, not "all")."""
    if ids is None:
        return rows
    want = [s.strip() for s in ids.split(",") if s.strip()]
    if not want:
        raise UserError(f"--rows {ids!r}: no row id given (leave --rows out to run every row)")
    known = {r.id for r in rows}
    bad = [w for w in want if w not in known]
    if bad:
        raise UserError(f"--rows: unknown row id(s) {', '.join(bad)}")
    return [r for r in rows if r.id in set(want)]


# --- running --------------------------------------------------------------------------------------
def _generator_digest() -> str:
    """SHA-256 of simulator/synth.py (part of the synthetic-trace cache key)."""
    from simulator import synth

    return hashlib.sha256(Path(synth.__file__).read_bytes()).hexdigest()[:16]


def synth_trace(spec: dict[str, Any]) -> Path:
    """A cached synthetic trace for ``{preset, sequences, prompt_tokens, output_tokens, seed}``.

    Instead of ``preset``, ``model`` names a catalogue model: its own preset if it has one, else
    the generator's default parameters (for a row whose result does not depend on which experts
    are routed, e.g. every routed expert on the CPU).
    """
    from simulator import synth
    from simulator.models import get_model
    from simulator.synth import SynthParams, SynthPreset, default_preset, get_preset

    if "preset" in spec or "model" not in spec:
        preset = str(spec.get("preset", ""))
        p = get_preset(preset)
        label: str | None = preset
    else:
        model = get_model(str(spec["model"])).name
        p = default_preset(model) or SynthPreset(
            name="", model=model, params=SynthParams(), matches="", assumes=""
        )
        preset = p.name or f"{model}-defaults"
        label = p.name or None
    n = int(spec.get("sequences", 8))
    prompt = int(spec.get("prompt_tokens", 256))
    out = int(spec.get("output_tokens", 512))
    seed = int(spec.get("seed", 0))
    # The key covers everything that shapes the trace: the preset's parameters, the generator
    # version and the generator's own source (so an edit that forgets to bump SYNTH_VERSION
    # still regenerates), and the numpy that draws the random numbers.
    key = json.dumps(
        [
            preset,
            p.model,
            p.params.to_dict(),
            n,
            prompt,
            out,
            seed,
            synth.GENERATOR,
            _generator_digest(),
            synth.np.__version__,
        ],
        sort_keys=True,
    ).encode()
    path = cache_dir() / f"{preset}-{hashlib.sha256(key).hexdigest()[:16]}.parquet"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        synth.write_synthetic(path, p.model, p.params, n, prompt, out, seed, preset=label)
    return path


#: Keys of ``[row.sim]`` that make the run a serving run (``daopsim run``'s options of the same
#: names, docs/serving.md): ``batch = 16`` is ``--batch 16``.
SERVING_SIM_KEYS = (
    "batch",
    "max_batch",
    "kv_cache_gb",
    "prefill_chunk",
    "preempt",
    "static_prefill",
)


def _serving(sim: dict[str, Any]) -> Any:
    """The ``ServingConfig`` of a row's serving keys (None without any)."""
    from simulator.serving import serving_config

    if not any(k in sim for k in SERVING_SIM_KEYS):
        return None
    return serving_config(
        sim.get("batch"),
        sim.get("max_batch"),
        None,
        None,
        sim.get("kv_cache_gb"),
        None,
        None,
        prefill_chunk=sim.get("prefill_chunk"),
        preempt=bool(sim.get("preempt", False)),
        static_prefill=sim.get("static_prefill"),
    )


def _sim_kwargs(sim: dict[str, Any], max_sequences: int | None) -> dict[str, Any]:
    kw = {k: v for k, v in sim.items() if k in SIM_KEYS}
    serving = _serving(sim)
    if serving is not None:
        kw["serving"] = serving
    if "synth" in sim:
        kw["trace"] = str(synth_trace(sim["synth"]))
    if max_sequences is not None and kw.get("sequences", max_sequences + 1) > max_sequences:
        kw["sequences"] = max_sequences
    return kw


def _metric(result: Any, metric: str) -> float:
    m = _METRIC_RE.match(metric)
    assert m is not None
    name, idx = m.group(1), m.group(2)
    if idx is not None:
        values = getattr(result, name, None)
        if values is None:
            raise UserError(f"unknown per-layer metric {name!r}")
        return float(values[int(idx)])
    if name not in result.metrics:
        raise UserError(f"unknown metric {name!r}")
    return float(result.metrics[name])


class _Runner:
    """Runs simulator configurations, reusing a result when two rows share one."""

    def __init__(self, max_sequences: int | None) -> None:
        self.max_sequences = max_sequences
        self.memo: dict[str, Any] = {}

    def run(self, sim: dict[str, Any]) -> Any:
        from simulator.runner import simulate

        kw = _sim_kwargs(sim, self.max_sequences)
        key = json.dumps(kw, sort_keys=True, default=str)
        if key not in self.memo:
            self.memo[key] = simulate(record=False, **kw)
        return self.memo[key]


def trace_seeds(sim: dict[str, Any]) -> list[int] | None:
    """The synthetic-trace seeds a row is run over (``[row.sim.synth] seeds = [...]``), or None."""
    spec = sim.get("synth")
    if not isinstance(spec, dict) or "seeds" not in spec:
        return None
    seeds = spec["seeds"]
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds)
    ):
        raise UserError(
            f"[row.sim.synth] seeds must be a non-empty list of integers, got {seeds!r}"
        )
    return list(seeds)


def _with_seed(sim: dict[str, Any], seed: int) -> dict[str, Any]:
    spec = {k: v for k, v in sim["synth"].items() if k != "seeds"}
    return {**sim, "synth": {**spec, "seed": seed}}


def _value(row: Row, sim: dict[str, Any], runner: _Runner) -> float:
    value = _metric(runner.run(sim), row.metric)
    if row.baseline is not None:
        base = _metric(runner.run({**sim, **row.baseline}), row.metric)
        value = value / base if base else float("nan")
    return value


def run_row(row: Row, runner: _Runner | None = None) -> RowResult:
    """Simulate one row (a not-modelled row returns no value).

    A row whose synthetic trace lists several ``seeds`` runs once per seed: the value is the
    mean, and the result carries the per-seed values and their range.
    """
    if not row.modelled:
        return RowResult(row)
    runner = runner or _Runner(None)
    try:
        seeds = trace_seeds(row.sim)
        if seeds is None:
            return RowResult(row, _value(row, row.sim, runner))
        values = [_value(row, _with_seed(row.sim, s), runner) for s in seeds]
    except UserError as exc:
        # e.g. a policy another engineer has not added yet: say so, keep going
        return RowResult(row, None, f"not yet runnable: {exc}")
    return RowResult(
        row, statistics.fmean(values), spread=(min(values), max(values)), per_seed=values
    )


def run_validation(
    rows: list[Row],
    max_sequences: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> Report:
    """Run every row; ``max_sequences`` caps each run's evaluation sequences."""
    runner = _Runner(max_sequences)
    results: list[RowResult] = []
    for i, row in enumerate(rows):
        results.append(run_row(row, runner))
        if progress is not None:
            progress(i + 1, len(rows), row.id)
    return Report(results)


# --- output ---------------------------------------------------------------------------------------
def _fmt(v: float | None, unit: str = "") -> str:
    if v is None or not math.isfinite(v):
        return "-"
    if unit == "hit rate":
        return f"{100 * v:.1f} %"
    return f"{v:.3g}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.1f} %"


TABLE_COLUMNS = ("id", "role", "published", "simulated", "unit", "error", "source")


def _simulated_text(r: RowResult) -> str:
    if r.simulated is None:
        return "not modelled"
    text = _fmt(r.simulated, r.row.unit)
    if r.spread is not None:
        lo, hi = r.spread
        text += f" ({_fmt(lo, r.row.unit)}-{_fmt(hi, r.row.unit)}, {len(r.per_seed)} seeds)"
    return text


def table_rows(report: Report) -> list[list[str]]:
    """Display rows: id, role, published, simulated, unit, relative error, source."""
    out = []
    for r in report.results:
        pub = _fmt(r.row.published, r.row.unit)
        if r.row.published_range:
            lo, hi = r.row.published_range
            pub += f" ({_fmt(lo, r.row.unit)}-{_fmt(hi, r.row.unit)})"
        out.append(
            [
                r.row.id,
                r.row.role,
                pub,
                _simulated_text(r),
                r.row.unit,
                _pct(r.rel_error),
                r.row.source,
            ]
        )
    return out


def _summary_line(report: Report, role: str) -> str:
    summ = report.summary(role)
    what = "test rows (the reported error)" if role == "test" else "calibration rows (in-sample)"
    return (
        f"{what}: {summ['modelled']} modelled; median |error| "
        f"{_pct(summ['median_abs_error']).lstrip('+')}, worst |error| "
        f"{_pct(summ['max_abs_error']).lstrip('+')}"
    )


def summary_lines(report: Report) -> list[str]:
    """Median/worst error over test rows, calibration rows apart, and the rows not modelled."""
    lines = [_summary_line(report, "test"), _summary_line(report, "calibration")]
    worst = report.worst(3)
    if worst:
        lines.append(
            "furthest off (test): " + ", ".join(f"{r.row.id} ({_pct(r.rel_error)})" for r in worst)
        )
    if report.not_modelled:
        lines.append(f"not modelled ({len(report.not_modelled)}):")
        for r in report.not_modelled:
            lines.append(f"  {r.row.id}: {r.row.reason or r.error}")
    return lines


def to_markdown(report: Report) -> str:
    """The table as markdown (docs/validation.md embeds it between markers)."""
    head = (
        "| row | role | published | simulated | unit | error | source |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |\n" for row in table_rows(report)
    )
    test = report.summary("test")
    cal = report.summary("calibration")
    summ = (
        f"\nTest rows (the reported error): {test['modelled']} modelled. Median absolute error "
        f"**{_pct(test['median_abs_error']).lstrip('+')}**, worst "
        f"**{_pct(test['max_abs_error']).lstrip('+')}**.\n"
        f"\nCalibration rows (in-sample, not part of the reported error): {cal['modelled']} "
        f"modelled. Median absolute error {_pct(cal['median_abs_error']).lstrip('+')}, worst "
        f"{_pct(cal['max_abs_error']).lstrip('+')}.\n"
    )
    calibrated = [r.row for r in report.by_role("calibration")]
    if calibrated:
        summ += "\nWhat each calibration row was used for:\n\n" + "".join(
            f"- `{row.id}`: {row.calibrated}\n" for row in calibrated
        )
    nm = report.not_modelled
    if nm:
        summ += "\nNot modelled yet:\n\n" + "".join(
            f"- `{r.row.id}`: {r.row.reason or r.error}\n" for r in nm
        )
    return head + body + summ


def to_csv(report: Report) -> str:
    """The rows as CSV (numbers unformatted)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    cols = [
        "id",
        "role",
        "published",
        "simulated",
        "unit",
        "rel_error",
        "modelled",
        "reason",
        "source",
    ]
    w.writerow(cols)
    for r in report.results:
        d = r.to_dict()
        w.writerow(["" if d[c] is None else d[c] for c in cols])
    return buf.getvalue()


def splice_markdown(doc: str, table: str) -> str:
    """Replace the text between the table markers of a markdown document."""
    a, b = doc.find(TABLE_START), doc.find(TABLE_END)
    if a < 0 or b < a:
        raise UserError(f"the markdown file has no {TABLE_START} ... {TABLE_END} markers")
    return doc[: a + len(TABLE_START)] + "\n" + table + doc[b:]
