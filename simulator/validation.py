"""Validation against published measurements: the runs and the report.

The ``*.toml`` files of ``validation/``, read as one table (its row format and reading:
simulator/validation_table.py), list published measurements (tokens/s, s/token, hit rates,
ratios), each with its exact source, the setting it was measured in and the simulator
configuration that reproduces that setting. :func:`run_validation` simulates every modelled
row and compares; rows the simulator cannot model yet carry ``modelled = false`` and a reason.

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

Each test row says how complete its setting is: ``setting = "published"`` when the source states
every input the simulator needs, or ``setting = "assumed"`` with ``assumed = [...]`` naming each
input the row had to assume. A row of ``kind = "ranking"`` is a set of systems one source measured
on one machine (``[[row.member]]``, each a row id or an inline setting); it is scored by whether
the simulator orders them as the source does (docs/validation.md, "Ranking rows").

Synthetic traces (``[row.sim.synth]``: preset, sequences, prompt_tokens, output_tokens, seed) are
generated on first use into a user cache folder (``$DAOPSIM_CACHE`` or
``~/.cache/daopsim/validation``) and reused; they are never written into the repository.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from daopsim.simulator.errors import UserError
from daopsim.simulator.trace_cache import synth_trace

# the table's row format and reading live in validation_table.py; its public names are
# importable from here too
from daopsim.simulator.validation_table import (
    _METRIC_RE,
    BOUNDS,
    ENERGY_METRICS,
    HIGHER_IS_BETTER,
    KINDS,
    ROLES,
    SERVING_SIM_KEYS,
    SETTINGS,
    SIM_KEYS,
    UNITS,
    Member,
    Row,
    default_table,
    load_table,
    select,
    table_files,
    trace_seeds,
)

#: Markers around the generated table in docs/validation.md.
TABLE_START = "<!-- validation-table:start -->"
TABLE_END = "<!-- validation-table:end -->"


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
    #: a ranking row's simulated value of each member, in the row's member order
    member_values: list[float] = field(default_factory=list)

    @property
    def ran(self) -> bool:
        """True when the row produced a result (a value, or every member of a ranking)."""
        if self.row.is_ranking:
            return bool(self.member_values) and not self.error
        return self.simulated is not None

    def ranking(self) -> dict[str, Any] | None:
        """A ranking row's score: its pairs ordered as published, each member's ratio to the
        first member against the published ratio, and both orders (None for other rows)."""
        row = self.row
        if not row.is_ranking or not self.ran:
            return None
        pubs = [m.published for m in row.members]
        sims = self.member_values
        pairs = agree = 0
        wrong: list[list[str]] = []
        for i in range(len(pubs)):
            for j in range(i + 1, len(pubs)):
                if pubs[i] == pubs[j]:
                    continue  # the source gives no order
                pairs += 1
                if (sims[i] - sims[j]) * (pubs[i] - pubs[j]) > 0:
                    agree += 1
                else:
                    wrong.append([row.members[i].name, row.members[j].name])
        sign = -1.0 if row.higher_is_better else 1.0

        def order(values: list[float]) -> list[str]:
            ranked = sorted(range(len(values)), key=lambda k: sign * values[k])
            return [row.members[k].name for k in ranked]

        ratios: dict[str, float | None] = {}
        for m, pub, sim in zip(row.members[1:], pubs[1:], sims[1:], strict=True):
            base_pub, base_sim = pubs[0], sims[0]
            if base_sim == 0 or base_pub == 0 or pub == 0 or not math.isfinite(sim):
                ratios[m.name] = None
            else:
                ratios[m.name] = (sim / base_sim) / (pub / base_pub) - 1.0
        return {
            "pairs": pairs,
            "agree": agree,
            "disagree": wrong,
            "published_order": order(pubs),
            "simulated_order": order(sims),
            "ratio_errors": ratios,
        }

    @property
    def signed_gap(self) -> float | None:
        """(simulated - published) / published, for a point and a bound row alike."""
        pub = self.row.published
        if self.simulated is None or pub is None or pub == 0 or not math.isfinite(self.simulated):
            return None
        return (self.simulated - pub) / pub

    @property
    def rel_error(self) -> float | None:
        """(simulated - published) / published; None for a bound row, which has no point error
        (its :attr:`bound_ok` says whether it holds)."""
        return None if self.row.is_bound else self.signed_gap

    @property
    def bound_ok(self) -> bool | None:
        """A bound row's verdict: the simulated value lies on the published side of the bound
        (at least a lower bound, at most an upper one); None for a point row or no value."""
        gap = self.signed_gap
        if not self.row.is_bound or gap is None:
            return None
        return gap >= 0 if self.row.bound == "lower" else gap <= 0

    def to_dict(self) -> dict[str, Any]:
        """JSON form of one row."""
        r = self.row
        out = self._base_dict()
        if r.is_ranking:
            out["members"] = [
                {
                    "name": m.name,
                    "row": m.ref or None,
                    "published": m.published,
                    "simulated": self.member_values[i] if self.ran else None,
                    "setting": m.setting or None,
                }
                for i, m in enumerate(r.members)
            ]
            out["ranking"] = self.ranking()
        return out

    def _base_dict(self) -> dict[str, Any]:
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
            "bound": r.bound or None,
            "bound_ok": self.bound_ok,
            "bound_gap": self.signed_gap if r.is_bound else None,
            "retired": r.retired or None,
            "role": r.role,
            "kind": r.kind,
            "setting": r.setting or None,
            "assumed": list(r.assumed),
            "energy": r.energy or None,
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
        """The results of the measurement rows with this role (ranking rows apart)."""
        return [r for r in self.results if r.row.role == role and not r.row.is_ranking]

    def summary(self, role: str = "test") -> dict[str, Any]:
        """Count, median and worst absolute error and ids of the point rows of one role that
        ran (bound rows apart: :meth:`bound_summary`)."""
        return _summary(self.by_role(role))

    def bound_summary(self, role: str = "test") -> dict[str, Any]:
        """The bound rows of one role that ran: how many, how many hold, and each failing row's
        gap to its bound ((simulated - bound) / bound)."""
        rows = [r for r in self.by_role(role) if r.row.is_bound and r.bound_ok is not None]
        failing = {r.row.id: r.signed_gap for r in rows if not r.bound_ok}
        return {
            "rows": len(rows),
            "hold": len(rows) - len(failing),
            "ids": [r.row.id for r in rows],
            "failing": failing,
        }

    @property
    def retired(self) -> list[RowResult]:
        """Rows kept in the table with the reason they are not run (wrong ground truth)."""
        return [r for r in self.results if r.row.retired]

    def published_setting_summary(self) -> dict[str, Any]:
        """The error summary over the test rows whose source states every input
        (``setting = "published"``)."""
        return _summary([r for r in self.by_role("test") if r.row.setting == "published"])

    def rankings(self, role: str = "test") -> list[RowResult]:
        """The ranking rows of one role."""
        return [r for r in self.results if r.row.role == role and r.row.is_ranking]

    def ranking_summary(self, role: str = "test", setting: str | None = None) -> dict[str, Any]:
        """Pairs ordered as published over the ranking rows of one role that ran (only those
        of one ``setting`` when given): groups, pairs, agreeing pairs and their share."""
        groups = [
            r
            for r in self.rankings(role)
            if r.ran and (setting is None or r.row.setting == setting)
        ]
        scores = [r.ranking() or {} for r in groups]
        pairs = sum(int(sc.get("pairs", 0)) for sc in scores)
        agree = sum(int(sc.get("agree", 0)) for sc in scores)
        return {
            "groups": len(groups),
            "pairs": pairs,
            "agree": agree,
            "agreement": agree / pairs if pairs else None,
            "ids": [r.row.id for r in groups],
        }

    @property
    def median_abs_error(self) -> float | None:
        """Median absolute relative error over the test rows that ran."""
        return self.summary()["median_abs_error"]

    @property
    def max_abs_error(self) -> float | None:
        """Worst absolute relative error over the test rows that ran."""
        return self.summary()["max_abs_error"]

    @property
    def ranking_agreement(self) -> float | None:
        """Pairs ordered as published / pairs, over the test ranking rows that ran."""
        return self.ranking_summary()["agreement"]

    @property
    def not_modelled(self) -> list[RowResult]:
        """Rows without a result (not modelled yet, or failed to run); retired rows apart."""
        return [r for r in self.results if not r.ran and not r.row.retired]

    def worst(self, n: int = 3, role: str = "test") -> list[RowResult]:
        """The n rows of a role furthest off."""
        ran = [r for r in self.by_role(role) if r.rel_error is not None]
        return sorted(ran, key=lambda r: -abs(r.rel_error or 0.0))[:n]

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object (top-level errors are over test rows only)."""
        test = self.summary("test")
        ranks = self.ranking_summary("test")
        return {
            "rows": [r.to_dict() for r in self.results],
            "median_abs_error": test["median_abs_error"],
            "max_abs_error": test["max_abs_error"],
            "modelled_rows": test["modelled"],
            "test_rows": test,
            "published_setting_rows": self.published_setting_summary(),
            "bound_rows": self.bound_summary("test"),
            "calibration_rows": self.summary("calibration"),
            "ranking_agreement": ranks["agreement"],
            "rankings": ranks,
            "rankings_published_setting": self.ranking_summary("test", "published"),
            "not_modelled": [
                {"id": r.row.id, "reason": r.row.reason or r.error} for r in self.not_modelled
            ],
            "retired": [{"id": r.row.id, "reason": r.row.retired} for r in self.retired],
        }


def _serving(sim: dict[str, Any]) -> Any:
    """The ``ServingConfig`` of a row's serving keys (None without any)."""
    from daopsim.simulator.serving_config import serving_config

    if not any(k in sim for k in SERVING_SIM_KEYS):
        return None
    return serving_config(
        batch=sim.get("batch"),
        max_batch=sim.get("max_batch"),
        kv_cache_gb=sim.get("kv_cache_gb"),
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
        from daopsim.simulator.runner import simulate

        kw = _sim_kwargs(sim, self.max_sequences)
        key = json.dumps(kw, sort_keys=True, default=str)
        if key not in self.memo:
            self.memo[key] = simulate(record=False, **kw)
        return self.memo[key]


def _with_seed(sim: dict[str, Any], seed: int) -> dict[str, Any]:
    spec = {k: v for k, v in sim["synth"].items() if k != "seeds"}
    return {**sim, "synth": {**spec, "seed": seed}}


def _value(
    metric: str, sim: dict[str, Any], baseline: dict[str, Any] | None, runner: _Runner
) -> float:
    value = _metric(runner.run(sim), metric)
    if baseline is not None:
        base = _metric(runner.run({**sim, **baseline}), metric)
        value = value / base if base else float("nan")
    return value


def _seeded(
    metric: str, sim: dict[str, Any], baseline: dict[str, Any] | None, runner: _Runner
) -> list[float] | None:
    """The value once per listed synthetic-trace seed (None when the setting lists none)."""
    seeds = trace_seeds(sim)
    if seeds is None:
        return None
    return [_value(metric, _with_seed(sim, s), baseline, runner) for s in seeds]


def run_row(row: Row, runner: _Runner | None = None) -> RowResult:
    """Simulate one row (a not-modelled row returns no value).

    A row whose synthetic trace lists several ``seeds`` runs once per seed: the value is the
    mean, and the result carries the per-seed values and their range. A ranking row runs each
    member (the mean over its seeds likewise).
    """
    if not row.modelled:
        return RowResult(row)
    runner = runner or _Runner(None)
    try:
        if row.is_ranking:
            values = []
            for m in row.members:
                per = _seeded(m.metric, m.sim, None, runner)
                values.append(
                    _value(m.metric, m.sim, None, runner) if per is None else statistics.fmean(per)
                )
            return RowResult(row, member_values=values)
        per_seed = _seeded(row.metric, row.sim, row.baseline, runner)
        if per_seed is None:
            return RowResult(row, _value(row.metric, row.sim, row.baseline, runner))
    except UserError as exc:
        # e.g. a setting this machine cannot run (the table was checked when it was read): say
        # so, keep going
        return RowResult(row, None, f"not yet runnable: {exc}")
    return RowResult(
        row,
        statistics.fmean(per_seed),
        spread=(min(per_seed), max(per_seed)),
        per_seed=per_seed,
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


TABLE_COLUMNS = ("id", "role", "setting", "published", "simulated", "unit", "error", "source")


def _simulated_text(r: RowResult) -> str:
    if r.simulated is None:
        return "not modelled"
    text = _fmt(r.simulated, r.row.unit)
    if r.spread is not None:
        lo, hi = r.spread
        text += f" ({_fmt(lo, r.row.unit)}-{_fmt(hi, r.row.unit)}, {len(r.per_seed)} seeds)"
    return text


def table_rows(report: Report) -> list[list[str]]:
    """Display rows of the measurement rows (ranking rows apart), in ``TABLE_COLUMNS`` order:
    id, role, setting, published, simulated, unit, relative error, source."""
    out = []
    for r in report.results:
        if r.row.is_ranking or r.row.retired:
            continue
        pub = _fmt(r.row.published, r.row.unit)
        if r.row.is_bound:
            pub = (">" if r.row.bound == "lower" else "<") + " " + pub
        if r.row.published_range:
            lo, hi = r.row.published_range
            pub += f" ({_fmt(lo, r.row.unit)}-{_fmt(hi, r.row.unit)})"
        out.append(
            [
                r.row.id,
                r.row.role,
                r.row.setting or "-",
                pub,
                _simulated_text(r),
                r.row.unit,
                _error_text(r),
                r.row.source,
            ]
        )
    return out


def _error_text(r: RowResult) -> str:
    """A point row's signed error; a bound row's verdict (and its gap when it fails)."""
    if not r.row.is_bound:
        return _pct(r.rel_error)
    if r.bound_ok is None:
        return "-"
    side = "above" if r.row.bound == "lower" else "below"
    return f"bound holds ({side})" if r.bound_ok else f"bound fails ({_pct(r.signed_gap)})"


#: Columns of the ranking table.
RANKING_COLUMNS = ("ranking", "role", "setting", "pairs", "published order", "simulated order")


def ranking_rows(report: Report) -> list[list[str]]:
    """Display rows of the ranking rows: id, role, setting, pairs ordered as published, the
    published and the simulated order (best first), the ratio errors, source."""
    out = []
    for r in report.results:
        if not r.row.is_ranking:
            continue
        score = r.ranking()
        if score is None:
            out.append([r.row.id, r.row.role, r.row.setting or "-", "not run", "-", "-", "-"])
            out[-1].append(r.row.source)
            continue
        ratios = ", ".join(f"{name} {_pct(e)}" for name, e in score["ratio_errors"].items())
        out.append(
            [
                r.row.id,
                r.row.role,
                r.row.setting or "-",
                f"{score['agree']}/{score['pairs']}",
                " > ".join(score["published_order"]),
                " > ".join(score["simulated_order"]),
                ratios,
                r.row.source,
            ]
        )
    return out


def _err_text(summ: dict[str, Any]) -> tuple[str, str]:
    return (
        _pct(summ["median_abs_error"]).lstrip("+"),
        _pct(summ["max_abs_error"]).lstrip("+"),
    )


def _summary_line(report: Report, role: str) -> str:
    summ = report.summary(role)
    what = "test rows (the reported error)" if role == "test" else "calibration rows (in-sample)"
    med, worst = _err_text(summ)
    return f"{what}: {summ['modelled']} modelled; median |error| {med}, worst |error| {worst}"


def _published_line(report: Report) -> str:
    summ = report.published_setting_summary()
    med, worst = _err_text(summ)
    return (
        f"test rows with a published setting: {summ['modelled']} modelled; median |error| "
        f"{med}, worst |error| {worst}"
    )


def _bound_line(report: Report) -> str:
    summ = report.bound_summary()
    failing = ", ".join(f"{k} ({_pct(v)})" for k, v in summ["failing"].items())
    return f"bound rows (test): {summ['hold']} of {summ['rows']} hold" + (
        f"; failing: {failing}" if failing else ""
    )


def _ranking_line(report: Report) -> str:
    summ = report.ranking_summary()
    pub = report.ranking_summary("test", "published")
    share = "-" if summ["agreement"] is None else f"{summ['agreement']:.2f}"
    pub_share = "-" if pub["agreement"] is None else f"{pub['agreement']:.2f}"
    return (
        f"rankings (test): {summ['agree']} of {summ['pairs']} pairs ordered as published "
        f"({share}) over {summ['groups']} groups; published-setting groups "
        f"{pub['agree']} of {pub['pairs']} ({pub_share}) over {pub['groups']}"
    )


def summary_lines(report: Report) -> list[str]:
    """Median/worst error over test rows (all, and those with a published setting),
    calibration rows apart, the rankings' agreement, and the rows not modelled."""
    lines = [
        _summary_line(report, "test"),
        _published_line(report),
        _bound_line(report),
        _summary_line(report, "calibration"),
    ]
    if report.rankings():
        lines.append(_ranking_line(report))
    worst = report.worst(3)
    if worst:
        lines.append(
            "furthest off (test): " + ", ".join(f"{r.row.id} ({_pct(r.rel_error)})" for r in worst)
        )
    if report.not_modelled:
        lines.append(f"not modelled ({len(report.not_modelled)}):")
        for r in report.not_modelled:
            lines.append(f"  {r.row.id}: {r.row.reason or r.error}")
    if report.retired:
        lines.append(f"retired ({len(report.retired)}):")
        for r in report.retired:
            lines.append(f"  {r.row.id}: {r.row.retired}")
    return lines


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def to_markdown(report: Report) -> str:
    """The tables as markdown (docs/validation.md embeds them between markers)."""
    out = _md_table(
        ["row", "role", "setting", "published", "simulated", "unit", "error", "source"],
        table_rows(report),
    )
    test = report.summary("test")
    pub = report.published_setting_summary()
    cal = report.summary("calibration")
    out += (
        f"\nTest rows (the reported error): {test['modelled']} modelled. Median absolute error "
        f"**{_err_text(test)[0]}**, worst **{_err_text(test)[1]}**.\n"
        f'\nTest rows whose source states every input (`setting = "published"`): '
        f"{pub['modelled']} modelled. Median absolute error **{_err_text(pub)[0]}**, worst "
        f"**{_err_text(pub)[1]}**.\n"
        f"\nCalibration rows (in-sample, not part of the reported error): {cal['modelled']} "
        f"modelled. Median absolute error {_err_text(cal)[0]}, worst {_err_text(cal)[1]}.\n"
    )
    bounds = report.bound_summary()
    if bounds["rows"]:
        out += (
            f'\nBound rows (a published "> x" or "< x", no point error): {bounds["hold"]} '
            f"of {bounds['rows']} hold.\n"
        )
    if report.rankings() or report.rankings("calibration"):
        out += "\nRankings (pairs ordered as published; ratio error of each member's ratio to "
        out += "the first member):\n\n"
        out += _md_table(
            [*RANKING_COLUMNS, "ratio errors", "source"],
            ranking_rows(report),
        )
        summ = report.ranking_summary()
        if summ["pairs"]:
            out += f"\n{_ranking_line(report)[0].upper()}{_ranking_line(report)[1:]}.\n"
    assumed = [r.row for r in report.by_role("test") if r.row.setting == "assumed"]
    assumed += [r.row for r in report.rankings() if r.row.setting == "assumed"]
    if assumed:
        out += "\nWhat each test row with an assumed setting assumed:\n\n" + "".join(
            f"- `{row.id}`: {'; '.join(row.assumed)}\n" for row in assumed
        )
    calibrated = [r.row for r in report.results if r.row.role == "calibration"]
    if calibrated:
        out += "\nWhat each calibration row was used for:\n\n" + "".join(
            f"- `{row.id}`: {row.calibrated}\n" for row in calibrated
        )
    nm = report.not_modelled
    if nm:
        out += "\nNot modelled yet:\n\n" + "".join(
            f"- `{r.row.id}`: {r.row.reason or r.error}\n" for r in nm
        )
    if report.retired:
        out += "\nRetired (kept for the record, never run):\n\n" + "".join(
            f"- `{r.row.id}` ({_fmt(r.row.published, r.row.unit)} {r.row.unit}): {r.row.retired}\n"
            for r in report.retired
        )
    return out


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
        "kind",
        "setting",
        "bound",
        "bound_ok",
        "retired",
    ]
    w.writerow(cols)
    for r in report.results:
        d = r.to_dict()
        w.writerow(["" if d[c] is None else d[c] for c in cols])
    return buf.getvalue()


def page_row_ids(doc: str) -> list[str]:
    """The row ids (first column) of the tables between the markers of a markdown document
    that :func:`splice_markdown` replaces, in page order (none without markers)."""
    a, b = doc.find(TABLE_START), doc.find(TABLE_END)
    if a < 0 or b < a:
        return []
    ids = []
    for line in doc[a + len(TABLE_START) : b].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or set(cells[0]) <= {"-", ":"}:
            continue
        if cells[0] not in ("row", RANKING_COLUMNS[0]):
            ids.append(cells[0])
    return ids


def splice_markdown(doc: str, table: str) -> str:
    """Replace the text between the table markers of a markdown document."""
    a, b = doc.find(TABLE_START), doc.find(TABLE_END)
    if a < 0 or b < a:
        raise UserError(f"the markdown file has no {TABLE_START} ... {TABLE_END} markers")
    return doc[: a + len(TABLE_START)] + "\n" + table + doc[b:]


#: this module's names and the table's (validation_table.py), importable from here
__all__ = [
    "BOUNDS",
    "ENERGY_METRICS",
    "HIGHER_IS_BETTER",
    "KINDS",
    "RANKING_COLUMNS",
    "ROLES",
    "SERVING_SIM_KEYS",
    "SETTINGS",
    "SIM_KEYS",
    "TABLE_COLUMNS",
    "TABLE_END",
    "TABLE_START",
    "UNITS",
    "Member",
    "Report",
    "Row",
    "RowResult",
    "default_table",
    "load_table",
    "page_row_ids",
    "ranking_rows",
    "run_row",
    "run_validation",
    "select",
    "splice_markdown",
    "summary_lines",
    "table_files",
    "table_rows",
    "to_csv",
    "to_markdown",
    "trace_seeds",
]
