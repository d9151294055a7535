"""Named experiments: a TOML file describing a grid of runs, its comparison table and plots.

The bundled ``daop-paper`` experiment (experiments/daop-paper.toml) reproduces DAOP's setting:
two models, one machine, several expert cache ratios, DAOP against its baselines; every policy
runs on the same trace, profile and cost model. :func:`run_experiment` returns an
:class:`ExperimentResult` (a tidy table, skipped points with their reasons, speed-ups) and
:meth:`ExperimentResult.write` writes CSV, Parquet and a plot, each atomically.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from daopsim.policies.registry import get_policy_class
from daopsim.simulator.data import bundled_dir, check_input_file, read_toml, resolve_trace
from daopsim.simulator.errors import DoesNotFit, UserError
from daopsim.simulator.fit import keeps_nothing_resident
from daopsim.simulator.output import output_dir, safe_name, write_figure, write_file, write_text
from daopsim.simulator.runner import simulate
from daopsim.simulator.serving import ServingConfig
from daopsim.simulator.trace_read import read_meta

#: metrics kept per run in the results table
METRICS = (
    "tokens_per_s",
    "decode_tokens_per_s",
    "ttft_s",
    "hit_rate",
    "tokens_per_kj",
    "energy_j",
    "routing_replaced_frac",
    "gate_mass_preserved",
    "cpu_expert_evals",
    "cpu_precalc_evals",
    "h2d_bytes",
    "tpot_mean_s",
    "low_precision_gate_mass",
    "prefetches",
)
#: metrics a speed-up may compare that the table derives from others (``miss_rate``: 1 minus
#: the decode hit rate)
DERIVED = ("miss_rate",)


def lower_is_better(metric: str) -> bool:
    """True for a metric where less is better (a duration, a miss rate, energy): its
    speed-up is the baseline's value over the target's."""
    if metric in ("miss_rate", "energy_j"):
        return True
    return metric.endswith("_s") and not metric.endswith("per_s")


def experiments_dir() -> Path:
    """Folder of the bundled experiment files (experiments/*.toml)."""
    return bundled_dir("experiments")


def bundled_experiments() -> dict[str, Path]:
    """Bundled experiments by name (file stem)."""
    return {p.stem: p for p in sorted(experiments_dir().glob("*.toml"))}


@dataclass
class ModelSpec:
    """One model of an experiment: its trace (bundled name, path, or a synthetic trace of
    ``synth``: preset or model, sequences, prompt_tokens, output_tokens, seed; generated once
    into the cache, docs/validation.md) and the policies run at a fixed point."""

    trace: str
    fixed: dict[str, dict[str, Any]] = field(default_factory=dict)
    synth: dict[str, Any] | None = None

    def path(self) -> str:
        """The trace to run: the bundled name or path, or the cached synthetic trace."""
        if self.synth is None:
            return self.trace
        from daopsim.simulator.trace_cache import synth_trace

        return str(synth_trace(self.synth))


@dataclass
class Experiment:
    """A parsed experiment file."""

    name: str
    description: str
    hw: str
    dtype: str | None
    sequences: int | None
    cache_ratios: list[float]
    target: str
    policies: dict[str, dict[str, Any]]
    models: list[ModelSpec]
    path: Path
    #: the metrics the target's speed-ups compare (the first is ``vs_<baseline>``)
    metrics: list[str] = field(default_factory=lambda: ["tokens_per_s"])
    #: per policy, an option set to each point's cache ratio (e.g. kTransformers' GPU share)
    ratio_options: dict[str, str] = field(default_factory=dict)
    #: requests decoding together (static batches; None: one sequence after another)
    batch: int | None = None

    @property
    def baselines(self) -> list[str]:
        """Every policy but the target, in file order."""
        return [p for p in self.policies if p != self.target]


#: Keys of an experiment file and of each ``[[models]]`` table: anything else is a typo.
EXPERIMENT_KEYS = (
    "name",
    "description",
    "hw",
    "dtype",
    "sequences",
    "cache_ratios",
    "target",
    "policies",
    "models",
    "metrics",
    "ratio_options",
    "batch",
)
MODEL_KEYS = ("trace", "fixed", "synth")
SYNTH_KEYS = ("preset", "model", "sequences", "prompt_tokens", "output_tokens", "seed")


def _unknown(path: Path, where: str, keys: object, known: tuple[str, ...]) -> None:
    """A UserError for the first key not in ``known``, with the closest known one."""
    for key in keys:  # type: ignore[attr-defined]
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(f"{path}: {where}unknown key {key!r}{hint} (valid: {', '.join(known)})")


def _check_options(path: Path, where: str, policy: str, options: dict[str, Any]) -> None:
    """The policy's own option check (names, types, ranges), its error naming the file."""
    try:
        get_policy_class(policy).resolve_options(options)
    except UserError as exc:
        raise UserError(f"{path}: {where}: {exc}") from None


def load_experiment(name_or_path: str | os.PathLike[str]) -> Experiment:
    """A bundled experiment by name or a TOML path; a UserError names the file and key."""
    text = str(name_or_path)
    bundled = bundled_experiments()
    path = bundled.get(text) or Path(text)
    if path.exists():
        check_input_file(path, "experiment")
    if not path.is_file():
        raise UserError(
            f"unknown experiment {text!r}: not a file and not bundled ({', '.join(bundled)})"
        )
    doc = read_toml(path, "experiment")
    # a schema like the grids': a misspelt key would otherwise be ignored and the default run
    _unknown(path, "", doc, EXPERIMENT_KEYS)
    ratios = _need(path, doc, "cache_ratios", list)
    if not ratios:
        raise UserError(f"{path}: cache_ratios is empty (give at least one ratio in (0, 1])")
    for r in ratios:
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0 < r <= 1:
            raise UserError(f"{path}: cache_ratios must be numbers in (0, 1], got {r!r}")
    policies = _load_policies(path, doc)
    target = _need(path, doc, "target", str)
    if target not in policies:
        raise UserError(f"{path}: target {target!r} is not under [policies]")
    models = _load_models(path, _need(path, doc, "models", list), policies)
    seqs = doc.get("sequences")
    if seqs is not None and (not isinstance(seqs, int) or seqs <= 0):
        raise UserError(f"{path}: 'sequences' must be a positive integer")
    name = doc.get("name", path.stem)
    if not isinstance(name, str):
        raise UserError(f"{path}: key 'name' must be a string")
    for key in ("description", "dtype"):
        if key in doc and not isinstance(doc[key], str):
            raise UserError(f"{path}: key {key!r} must be a string")
    metrics = _load_metrics(path, doc)
    ratio_options = _load_ratio_options(path, doc, policies, ratios)
    batch = doc.get("batch")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise UserError(f"{path}: 'batch' must be a positive integer")
    from daopsim.simulator.precisions import DTYPES

    if doc.get("dtype") is not None and doc["dtype"] not in DTYPES:
        raise UserError(
            f"{path}: key 'dtype': unknown precision {doc['dtype']!r} (known: {', '.join(DTYPES)})"
        )
    return Experiment(
        name=safe_name(name, f"{path}: experiment name"),
        description=str(doc.get("description", "")),
        hw=_need(path, doc, "hw", str),
        dtype=doc.get("dtype"),
        sequences=seqs,
        cache_ratios=[float(r) for r in ratios],
        target=target,
        policies=policies,
        models=models,
        path=path,
        metrics=[str(x) for x in metrics],
        ratio_options={str(k): str(v) for k, v in ratio_options.items()},
        batch=batch,
    )


def _need(path: Path, doc: dict[str, Any], key: str, typ: type | tuple[type, ...]) -> Any:
    """The required key ``key`` of the experiment file, refused when missing or of another
    type."""
    if key not in doc:
        raise UserError(f"{path}: missing key {key!r}")
    if not isinstance(doc[key], typ):
        raise UserError(f"{path}: key {key!r} has the wrong type")
    return doc[key]


def _load_policies(path: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """The ``[policies]`` table, each policy's options checked now (names, types, ranges), not
    at the first run."""
    policies = _need(path, doc, "policies", dict)
    if not policies:
        raise UserError(f"{path}: [policies] is empty (name at least the target)")
    for pname, opts in policies.items():
        if not isinstance(opts, dict):
            raise UserError(f"{path}: policies.{pname} must be a table of options")
        _check_options(path, f"policies.{pname}", pname, opts)
    return policies


def _load_models(path: Path, entries: list[Any], policies: dict[str, Any]) -> list[ModelSpec]:
    """The ``[[models]]`` entries: each a trace or a synthetic one, its fixed points checked
    as the policy's options, each trace given once."""
    models: list[ModelSpec] = []
    for i, m in enumerate(entries):
        if isinstance(m, dict) and "synth" in m and "trace" not in m:
            synth = m["synth"]
            if not isinstance(synth, dict) or not ("model" in synth or "preset" in synth):
                raise UserError(f"{path}: models[{i}].synth must be a table with a model or preset")
            _unknown(path, f"models[{i}].synth: ", synth, SYNTH_KEYS)
            name = synth.get("preset", synth.get("model"))
            m = {**m, "trace": f"synth:{name}"}
        elif isinstance(m, dict) and "synth" in m:
            raise UserError(f"{path}: models[{i}] gives both 'trace' and 'synth'")
        if not isinstance(m, dict) or not isinstance(m.get("trace"), str):
            raise UserError(f"{path}: models[{i}] needs a 'trace' string or a 'synth' table")
        _unknown(path, f"models[{i}]: ", m, MODEL_KEYS)
        fixed = m.get("fixed", {})
        if not isinstance(fixed, dict) or any(p not in policies for p in fixed):
            raise UserError(f"{path}: models[{i}].fixed must name policies under [policies]")
        for pname, point in fixed.items():
            if not isinstance(point, dict):
                raise UserError(f"{path}: models[{i}].fixed.{pname} must be a table")
            # the point's options run as the policy's options (experts_per_layer too)
            _check_options(path, f"models[{i}].fixed.{pname}", pname, {**policies[pname], **point})
        # rows are labelled by the trace: a second entry of one label would repeat (or, for
        # two synthetic traces of one preset, be confused with) the first's rows
        first = next((j for j, prev in enumerate(models) if prev.trace == m["trace"]), None)
        if first is not None:
            raise UserError(
                f"{path}: models[{i}] repeats models[{first}] (trace {m['trace']!r}): "
                "give each trace once"
            )
        models.append(ModelSpec(trace=m["trace"], fixed=fixed, synth=m.get("synth")))
    if not models:
        raise UserError(f"{path}: no [[models]] (give at least one, with its trace)")
    return models


def _load_metrics(path: Path, doc: dict[str, Any]) -> list[Any]:
    """The metrics the speed-ups compare (default: tokens/s), each a known metric."""
    metrics = doc.get("metrics", ["tokens_per_s"])
    known = (*METRICS, *DERIVED)
    if not isinstance(metrics, list) or not metrics:
        raise UserError(f"{path}: key 'metrics' must be a non-empty list of metric names")
    for mname in metrics:
        if mname not in known:
            close = difflib.get_close_matches(str(mname), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(f"{path}: key 'metrics': unknown metric {mname!r}{hint}")
    return metrics


def _load_ratio_options(
    path: Path, doc: dict[str, Any], policies: dict[str, Any], ratios: list[Any]
) -> dict[str, Any]:
    """``ratio_options``: per policy under ``[policies]``, an option that takes each point's
    cache ratio (checked at the first ratio)."""
    ratio_options = doc.get("ratio_options", {})
    if not isinstance(ratio_options, dict):
        raise UserError(f"{path}: key 'ratio_options' must be a table of policy = option")
    for pname, opt in ratio_options.items():
        if pname not in policies:
            raise UserError(f"{path}: ratio_options names {pname!r}, which is not under [policies]")
        if not isinstance(opt, str):
            raise UserError(f"{path}: ratio_options.{pname} must be an option name")
        _check_options(
            path, f"ratio_options.{pname}", pname, {**policies[pname], opt: float(ratios[0])}
        )
    return ratio_options


def speedup_column(baseline: str, metric: str, index: int = 0) -> str:
    """The speed-up column of ``baseline`` for the experiment's ``index``-th metric:
    ``vs_<baseline>`` for the first, ``vs_<baseline>:<metric>`` for the others."""
    return f"vs_{baseline}" if index == 0 else f"vs_{baseline}:{metric}"


def _speedup(target: Any, same: pd.DataFrame, metric: str) -> float:
    """The target's gain over the baseline's run in ``same`` on ``metric`` (target over
    baseline, or baseline over target where less is better); NaN without a positive value."""
    if not len(same):
        return float("nan")
    t, b = float(target[metric]), float(same[metric].iloc[0])
    if lower_is_better(metric):
        t, b = b, t
    return t / b if b > 0 and t == t else float("nan")


def _ratio_text(ratio: Any) -> str:
    """A cache ratio for a note (a fixed point has none)."""
    return "its fixed point" if ratio is None or ratio != ratio else f"{float(ratio):.4g}"


@dataclass
class ExperimentResult:
    """Rows of one experiment: one per (model, cache ratio, policy), skipped ones included."""

    experiment: Experiment
    table: pd.DataFrame

    @property
    def ok(self) -> pd.DataFrame:
        """Rows that ran."""
        return self.table[self.table["status"] == "ok"]

    @property
    def skipped(self) -> pd.DataFrame:
        """Rows that did not run, with the reason."""
        return self.table[self.table["status"] != "ok"]

    def speedups(self) -> pd.DataFrame:
        """Target tokens/s over each baseline's, per model and cache ratio (and the mean).

        A baseline run at a fixed point (``fixed`` in the file) is compared at that point's
        throughput for every ratio, as the paper compares against one configuration of it.
        """
        exp = self.experiment
        ok = self.ok
        rows = []
        for model, sub in ok.groupby("model", sort=False):
            tgt = sub[sub["policy"] == exp.target]
            for _, t in tgt.iterrows():
                row: dict[str, Any] = {"model": model, "cache_ratio": t["cache_ratio"]}
                for b in exp.baselines:
                    bs = sub[sub["policy"] == b]
                    fixed = bs[bs["fixed"]]
                    same = fixed if len(fixed) else bs[bs["cache_ratio"] == t["cache_ratio"]]
                    for i, metric in enumerate(exp.metrics):
                        row[speedup_column(b, metric, i)] = _speedup(t, same, metric)
                rows.append(row)
        return pd.DataFrame(rows)

    def summary(self) -> dict[str, Any]:
        """The ``--json`` document: rows, skipped points, speed-ups and their means."""
        sp = self.speedups()
        means = {c: float(sp[c].mean()) for c in sp.columns if c.startswith("vs_")}
        ok = self.ok
        fidelity = {
            str(p): float(g["gate_mass_preserved"].min())
            for p, g in ok.groupby("policy", sort=False)
            if "gate_mass_preserved" in g and g["gate_mass_preserved"].notna().any()
        }
        return {
            "experiment": self.experiment.name,
            "hw": self.experiment.hw,
            "rows": self.ok.drop(columns=["status", "reason"]).to_dict(orient="records"),
            "skipped": self.skipped[["model", "cache_ratio", "policy", "reason"]].to_dict(
                orient="records"
            ),
            "speedups": sp.to_dict(orient="records"),
            "mean_speedups": means,
            "min_gate_mass_preserved": fidelity,
        }

    def format_table(self) -> str:
        """A plain-text table: tokens/s and tokens/kJ per policy, then the target's speed-ups."""
        ok = self.ok
        lines = []
        if len(ok):
            tps = ok.pivot_table(
                index=["model", "cache_ratio"], columns="policy", values="tokens_per_s"
            )
            kj = ok.pivot_table(
                index=["model", "cache_ratio"], columns="policy", values="tokens_per_kj"
            )
            fid = ok.pivot_table(
                index=["model", "cache_ratio"], columns="policy", values="gate_mass_preserved"
            )
            with pd.option_context("display.width", 200, "display.max_columns", 50):
                lines += ["tokens/s", tps.round(3).to_string(), ""]
                lines += ["tokens/kJ", kj.round(2).to_string(), ""]
                for metric in self.experiment.metrics:
                    if metric in ("tokens_per_s", "tokens_per_kj") or metric not in ok:
                        continue
                    piv = ok.pivot_table(
                        index=["model", "cache_ratio"], columns="policy", values=metric
                    )
                    lines += [metric, piv.round(4).to_string(), ""]
                # speed beside the routing it cost: 1 = exact routing (docs/metrics.md)
                lines += ["routing fidelity (gate mass preserved)", fid.round(3).to_string(), ""]
                sp = self.speedups()
                if len(sp):
                    lines += [f"speed-up of {self.experiment.target}", sp.round(2).to_string()]
                    means = {c: round(float(sp[c].mean()), 2) for c in sp if c.startswith("vs_")}
                    lines += [f"mean: {means}", ""]
        for _, r in self.skipped.iterrows():
            lines.append(
                f"skipped {r['model']} {r['policy']} at {r['cache_ratio']:.4g}: {r['reason']}"
            )
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`figure` (PNG, PDF or SVG by the suffix)."""
        import matplotlib

        matplotlib.use("Agg")
        return write_figure(self.figure(), path, dpi=110)

    def figure(self) -> Any:
        """Tokens/s against expert cache ratio, one panel per model, one line per policy (each
        policy in its fixed colour, ``plots.policy_color``), on a log axis with plain-number
        ticks; the skipped points are named under their panel."""
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        from daopsim.simulator.plots import policy_color
        from daopsim.simulator.plots_common import _finish, _legend, _note_under, fidelity_note

        ok = self.ok
        named = [m for m in [*ok["model"], *self.skipped["model"]] if isinstance(m, str)]
        models = list(dict.fromkeys(named)) or ["(none)"]
        fig, axes = plt.subplots(
            1, len(models), figsize=(5.5 * len(models), 3.8), squeeze=False, layout="constrained"
        )
        for ax, model in zip(axes[0], models, strict=True):
            sub = ok[ok["model"] == model]
            for pol, grp in sub.groupby("policy", sort=False):
                grp = grp.sort_values("cache_ratio")
                style = "s" if bool(grp["fixed"].iloc[0]) else "o-"
                ax.plot(
                    grp["cache_ratio"] * 100,
                    grp["tokens_per_s"],
                    style,
                    color=policy_color(str(pol)),
                    label=str(pol) + fidelity_note(grp),
                )
            if len(sub):
                ax.set_yscale("log")
                # 1-2-5 ticks as plain numbers ("0.5", "2"), not powers of ten
                ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.yaxis.set_minor_formatter(NullFormatter())
            else:
                ax.text(0.5, 0.5, "no point ran", ha="center", va="center", transform=ax.transAxes)
            ax.set_xlabel("expert cache ratio (% of all experts)")
            ax.set_ylabel("tokens/s, prefill included (simulated)")
            ax.set_title(f"{model} on {self.experiment.hw}")
            skipped = self.skipped[self.skipped["model"] == model]
            _note_under(
                ax,
                [
                    f"skipped: {r['policy']} @ {_ratio_text(r['cache_ratio'])}: {r['reason']}"
                    for _, r in skipped.iterrows()
                ],
            )
        _legend(fig, list(axes[0]))
        return _finish(fig, 3.8)

    def write(
        self,
        out_dir: str | os.PathLike[str],
        flag: str | None = None,
        inputs: tuple[str | os.PathLike[str] | None, ...] = (),
    ) -> dict[str, Path]:
        """results.csv, results.parquet, speedups.csv, summary.txt and tokens_per_s.png, as one
        set swapped in whole (simulator/output.py); ``out_dir`` may hold only these files."""
        target = Path(out_dir)
        tab = self.table
        sp = self.speedups()
        inputs = (self.experiment.path, *inputs)
        with output_dir(target, EXPERIMENT_REPLACES, flag=flag, inputs=inputs) as stage:
            write_file(stage / "results.csv", lambda t: tab.to_csv(t, index=False))
            write_file(stage / "results.parquet", lambda t: tab.to_parquet(t, index=False))
            write_file(stage / "speedups.csv", lambda t: sp.to_csv(t, index=False))
            write_text(stage / "summary.txt", self.format_table() + "\n")
            self.plot(stage / "tokens_per_s.png")
        return {k: target / v for k, v in EXPERIMENT_FILES.items()}


#: The files ``ExperimentResult.write`` puts in its folder, by role.
EXPERIMENT_FILES = {
    "csv": "results.csv",
    "parquet": "results.parquet",
    "speedups": "speedups.csv",
    "summary": "summary.txt",
    "plot": "tokens_per_s.png",
}
#: What may be in an experiment folder that is replaced: its files, and the figures `daopsim
#: plot` draws from them by default (results.<kind>.png), which are stale once results change.
EXPERIMENT_REPLACES = (
    *EXPERIMENT_FILES.values(),
    "results.*.png",
    "results.*.pdf",
    "results.*.svg",
)


def run_experiment(
    name_or_path: str | os.PathLike[str] | Experiment,
    sequences: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> ExperimentResult:
    """Run every (model, cache ratio, policy) point; points that do not fit are skipped."""
    exp = name_or_path if isinstance(name_or_path, Experiment) else load_experiment(name_or_path)
    for pname in exp.policies:  # fail before any run when a policy is missing
        try:
            get_policy_class(pname)
        except UserError as exc:
            raise UserError(f"{exp.path}: experiment needs policy {pname!r}: {exc}") from None
    n_seq = sequences if sequences is not None else exp.sequences
    rows: list[dict[str, Any]] = []
    for spec in exp.models:
        for pname, base_opts in exp.policies.items():
            for ratio, opts, fixed in _points(exp, spec, pname, base_opts):
                rows.append(_run_point(exp, spec, pname, ratio, opts, fixed, n_seq, progress))
    cols = ["model", "trace", "hw", "cache_ratio", "policy", "fixed", "gpu_experts", "sequences"]
    table = pd.DataFrame(rows)
    table = table[[c for c in cols if c in table] + [c for c in table if c not in cols]]
    return ExperimentResult(exp, table.reset_index(drop=True))


def _points(
    exp: Experiment, spec: ModelSpec, pname: str, base_opts: dict[str, Any]
) -> list[tuple[float | None, dict[str, Any], bool]]:
    """The (cache ratio, options, fixed) points one policy runs on one model: its fixed
    point, one run for a policy that keeps nothing resident, else one per cache ratio (with
    its ratio option set to the ratio)."""
    if pname in spec.fixed:
        return [(None, {**base_opts, **spec.fixed[pname]}, True)]
    if keeps_nothing_resident(get_policy_class(pname)):
        # the cache ratio means nothing to it: one run with the memory that fits,
        # compared with the target at every ratio (never skipped as "does not fit")
        return [(None, dict(base_opts), True)]
    linked = exp.ratio_options.get(pname)
    return [
        (r, {**base_opts, linked: r} if linked else dict(base_opts), False)
        for r in exp.cache_ratios
    ]


def _run_point(
    exp: Experiment,
    spec: ModelSpec,
    pname: str,
    ratio: float | None,
    opts: dict[str, Any],
    fixed: bool,
    n_seq: int | None,
    progress: Callable[[str], None] | None,
) -> dict[str, Any]:
    """One point's row: its metrics, or status ``skipped`` with the reason when it does not
    fit."""
    kwargs: dict[str, Any] = {}
    if fixed:
        per = int(opts.get("experts_per_layer", 0))
        if per:
            layers = read_meta(resolve_trace(spec.path())).model.moe_layers
            kwargs["gpu_experts"] = per * layers
    else:
        kwargs["cache_ratio"] = ratio
    row: dict[str, Any] = {
        "trace": spec.trace,
        "hw": exp.hw,
        "policy": pname,
        "fixed": fixed,
    }
    if progress is not None:
        where = "fixed point" if fixed else f"ratio {ratio:.4g}"
        progress(f"{spec.trace}: {pname} at {where}")
    if exp.batch is not None:
        kwargs["serving"] = ServingConfig(batch=exp.batch)
    try:
        res = simulate(
            pname,
            hw=exp.hw,
            trace=spec.path(),
            sequences=n_seq,
            policy_options=opts,
            dtype=exp.dtype,
            record=False,
            **kwargs,
        )
    except DoesNotFit as exc:
        # the model's name, as the rows that ran have it (the trace records it)
        model = read_meta(resolve_trace(spec.path())).model.name
        row.update(model=model, cache_ratio=ratio, status="skipped")
        row["reason"] = str(exc)
        return row
    row.update(
        model=res.config["model"],
        cache_ratio=res.config["cache_ratio"],
        gpu_experts=res.config["gpu_experts"],
        sequences=res.config["sequences"],
        bound=bool(res.config["bound"]),
        status="ok",
        reason="",
    )
    row.update({k: res.metrics.get(k) for k in METRICS})
    hit = res.metrics.get("hit_rate")
    row["miss_rate"] = None if hit is None else 1.0 - float(hit)
    return row
