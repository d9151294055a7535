"""The validation table: its row format and how it is read (``validation/*.toml``).

Each row is one published measurement with its exact source, the setting it was measured in
and the simulator configuration that reproduces that setting (docs/validation.md has the row
format). :func:`load_table` reads every file of the table, checks each row (a mistake is one
line naming the file, the row and the field) and resolves ranking rows' members;
simulator/validation.py runs the rows and reports.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daopsim.simulator.data import bundled_dir, read_toml
from daopsim.simulator.errors import UserError, did_you_mean

#: Units a row may use.
#: ``s`` is a duration in seconds, e.g. the time to the first token (``ttft_s``).
UNITS = ("tokens/s", "s/token", "s", "hit rate", "ratio", "tokens/kJ")
#: Units whose larger value is the better one (a ranking orders its members by this).
HIGHER_IS_BETTER = frozenset({"tokens/s", "hit rate", "ratio", "tokens/kJ"})
#: What a row's setting is: every input the simulator needs stated by the source, or not.
SETTINGS = ("published", "assumed")
#: Row kinds: one published number, or a ranking of systems measured together.
KINDS = ("measurement", "ranking")
#: What a published value bounds (``bound``): ``lower`` for a source's "> x" (the true value is
#: at least x), ``upper`` for "< x". A bound row passes when the simulated value lies on the
#: stated side; it has no point error (docs/validation.md, "Bound rows").
BOUNDS = ("lower", "upper")
#: What a ``tokens/kJ`` row's energy covers (``energy``), and the run metric that measures it.
ENERGY_METRICS = {
    "wall": "tokens_per_kj_wall",
    "device": "tokens_per_kj_device",
    "gpu+cpu": "tokens_per_kj",
}
#: What a row is for. A ``calibration`` row was looked at to choose a constant, preset or profile
#: value (its ``calibrated`` field says which); a ``test`` row was not. Errors are reported over
#: test rows only; calibration rows are listed separately.
ROLES = ("calibration", "test")
#: Keys of ``[row.sim]`` that are passed to :func:`daopsim.simulator.runner.simulate`.
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


def default_table() -> Path:
    """The bundled table: the folder validation/, whose ``*.toml`` files are read as one table
    (row ids unique across them; a ranking row may name rows of any of them)."""
    return bundled_dir("validation")


def table_files(path: str | os.PathLike[str] | None = None) -> list[Path]:
    """The files of a table: ``path`` itself, or every ``*.toml`` in it (sorted by name) when it
    is a folder; the bundled folder when None."""
    p = Path(path) if path is not None else default_table()
    if p.is_dir():
        files = sorted(p.glob("*.toml"))
        if not files:
            raise UserError(f"{p}: no *.toml validation table files in this folder")
        return files
    return [p]


@dataclass
class Member:
    """One system of a ranking row: its published value and the setting that reproduces it.

    ``ref`` names the measurement row it was taken from (its ``sim``, or ``{**sim, **baseline}``
    for ``side = "baseline"``), or is empty for a member given inline.
    """

    name: str
    published: float
    sim: dict[str, Any]
    metric: str
    ref: str = ""
    setting: str = ""


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
    kind: str = "measurement"
    setting: str = ""
    assumed: tuple[str, ...] = ()
    energy: str = ""
    members: list[Member] = field(default_factory=list)
    #: "lower" / "upper" when the published value is a bound, not a point ("" for a point)
    bound: str = ""
    #: why the row is kept in the table but never run (its published figure is wrong, e.g.
    #: physically impossible for the stated setting); "" for a live row
    retired: str = ""

    @property
    def is_bound(self) -> bool:
        """True when the published value is a lower or upper bound, not a point."""
        return bool(self.bound)

    @property
    def is_ratio(self) -> bool:
        """True when the value is sim / baseline of two runs."""
        return self.baseline is not None

    @property
    def is_ranking(self) -> bool:
        """True for a ranking row (scored by order, not by one value)."""
        return self.kind == "ranking"

    @property
    def higher_is_better(self) -> bool:
        """Whether a larger value ranks first (by the row's unit)."""
        return self.unit in HIGHER_IS_BETTER


def _num(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise UserError(f"{where} must be a finite number, got {v!r}")
    return float(v)


#: Per-layer results a metric may index (``per_layer_hit_rate[i]``).
PER_LAYER_METRICS = ("per_layer_hit_rate",)


def _positive(v: Any, where: str) -> float:
    """A published value: a finite number above zero (the error divides by it; a measured
    speed, time, hit rate or ratio is never zero or negative)."""
    x = _num(v, where)
    if x <= 0:
        raise UserError(f"{where} must be above zero, got {v!r}")
    return x


def _check_metric(metric: str, where: str) -> None:
    """``metric`` (already of the metric form) names a run metric or a per-layer result."""
    from daopsim.simulator.results import METRIC_KEYS

    m = _METRIC_RE.match(metric)
    assert m is not None
    name, idx = m.group(1), m.group(2)
    known = PER_LAYER_METRICS if idx is not None else METRIC_KEYS
    if name not in known:
        hint = did_you_mean(name, known)
        kind = "per-layer metric" if idx is not None else "metric"
        raise UserError(f"{where}: unknown {kind} {name!r}{hint}")


def _parse_row(raw: Any, i: int, path: Path) -> Row:
    where = f"{path}: row {i + 1}"
    if not isinstance(raw, dict):
        raise UserError(f"{where}: not a table")
    rid = raw.get("id")
    if isinstance(rid, str) and rid:
        where = f"{path}: row {rid!r}"
    calibrated, kind, energy = _check_labels(raw, where)
    modelled, retired, bound, reason = _check_status(raw, where, kind)
    if kind == "ranking":
        return _parse_ranking(raw, where, calibrated, modelled, reason)
    pub = raw.get("published")
    published = None if pub is None else _positive(pub, f"{where}: 'published'")
    if retired:
        modelled = False  # kept for the record, never run
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
    if modelled:
        _check_metric(metric, where)
    if "member" in raw:
        raise UserError(f'{where}: [[row.member]] belongs to kind = "ranking" rows only')
    sim, base = _sim_tables(raw, where, modelled)
    setting, assumed = _parse_setting(raw, where)
    return Row(
        **_described(raw),
        bound=str(bound),
        retired=retired.strip(),
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
        kind=kind,
        setting=setting,
        assumed=assumed,
        energy=str(energy),
    )


def _check_labels(raw: dict[str, Any], where: str) -> tuple[Any, Any, Any]:
    """A row's descriptive fields: the required text fields, its unit and role (a calibration
    row says what was chosen by looking at it), its kind, and for a tokens/kJ row what the
    energy covers. Its ``calibrated``, ``kind`` and ``energy``."""
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
    kind = raw.get("kind", "measurement")
    if kind not in KINDS:
        raise UserError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    energy = raw.get("energy", "")
    if raw["unit"] == "tokens/kJ":
        if energy not in ENERGY_METRICS:
            raise UserError(
                f"{where}: a tokens/kJ row needs 'energy', what the figure covers: "
                + ", ".join(ENERGY_METRICS)
            )
        if raw.get("metric", ENERGY_METRICS[energy]) != ENERGY_METRICS[energy]:
            raise UserError(
                f"{where}: energy {energy!r} is measured by metric {ENERGY_METRICS[energy]!r}"
            )
    elif energy:
        raise UserError(f"{where}: 'energy' belongs to tokens/kJ rows only")
    return calibrated, kind, energy


def _check_status(raw: dict[str, Any], where: str, kind: Any) -> tuple[bool, str, Any, str]:
    """Whether a row runs: ``modelled`` (a row that is not says why), ``retired`` (says why,
    and is not run) and its ``bound`` (none on a ranking row). Its ``modelled``, ``retired``,
    ``bound`` and ``reason``."""
    modelled = raw.get("modelled", True)
    if not isinstance(modelled, bool):
        raise UserError(f"{where}: 'modelled' must be true or false")
    retired = raw.get("retired", "")
    if not isinstance(retired, str) or ("retired" in raw and not retired.strip()):
        raise UserError(f"{where}: 'retired' must say why the row is retired")
    if retired and modelled and "modelled" in raw:
        raise UserError(f"{where}: a retired row is not run: drop 'modelled'")
    bound = raw.get("bound", "")
    if bound and bound not in BOUNDS:
        raise UserError(f"{where}: bound {bound!r} is not one of {', '.join(BOUNDS)}")
    if bound and kind == "ranking":
        raise UserError(f"{where}: a ranking row has no bound of its own")
    reason = str(raw.get("reason", ""))
    if not modelled and not reason.strip():
        raise UserError(f"{where}: a row with modelled = false needs a 'reason'")
    return modelled, retired, bound, reason


def _sim_tables(
    raw: dict[str, Any], where: str, modelled: bool
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A row's ``[row.sim]`` and ``[row.baseline]`` tables: a modelled row names its policy,
    machine and trace (or synthetic trace); only a ratio row, and every one, has a
    baseline."""
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
    if modelled:
        _check_sim(sim, base, where)
    if (raw["unit"] == "ratio") != (base is not None) and modelled:
        raise UserError(f"{where}: a 'ratio' row needs [row.baseline], and only a ratio row")
    return sim, base


def _described(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields every row states about the measurement it stands for (checked already)."""
    keys = ("id", "source", "system", "hardware", "model", "precision", "workload", "unit")
    return {k: raw[k] for k in keys}


def _check_sim(sim: dict[str, Any], base: dict[str, Any] | None, where: str) -> None:
    """The simulator keys of a setting (and of a ratio's baseline) are known, and its synthetic
    trace's seeds are well formed."""
    for key in list(sim) + list(base or {}):
        if key not in SIM_KEYS and key not in SERVING_SIM_KEYS and key != "synth":
            raise UserError(f"{where}: unknown simulator key {key!r}")
    from daopsim.policies.registry import get_policy_class

    for part in (sim, base or {}):
        if "policy" in part:  # a misspelt name is the file's mistake, not a row "not runnable"
            try:
                get_policy_class(str(part["policy"]))
            except UserError as exc:
                raise UserError(f"{where}: {exc}") from None
    if "synth" in sim:
        try:
            trace_seeds(sim)
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None


def _parse_setting(raw: dict[str, Any], where: str) -> tuple[str, tuple[str, ...]]:
    """``setting`` and ``assumed`` of a row: required on test rows; ``assumed`` names each
    input the row assumed, and only an ``assumed`` setting has it."""
    setting = raw.get("setting", "")
    assumed = raw.get("assumed", [])
    if raw.get("role") == "test" and setting not in SETTINGS:
        raise UserError(f"{where}: a test row needs 'setting': {' or '.join(map(repr, SETTINGS))}")
    if setting and setting not in SETTINGS:
        raise UserError(f"{where}: setting {setting!r} is not one of {', '.join(SETTINGS)}")
    if not isinstance(assumed, list) or not all(isinstance(a, str) and a.strip() for a in assumed):
        raise UserError(f"{where}: 'assumed' must be a list of non-empty texts")
    if setting == "assumed" and not assumed:
        raise UserError(f"{where}: setting = \"assumed\" needs 'assumed', each assumed input")
    if setting == "published" and assumed:
        raise UserError(f"{where}: a published setting assumes nothing; drop 'assumed'")
    return str(setting), tuple(a.strip() for a in assumed)


def _parse_ranking(
    raw: dict[str, Any], where: str, calibrated: str, modelled: bool, reason: str
) -> Row:
    """A ``kind = "ranking"`` row: its members stay raw until :func:`load_table` resolves the
    rows they name."""
    members = raw.get("member")
    if not isinstance(members, list) or len(members) < 2:
        raise UserError(f"{where}: a ranking row needs two or more [[row.member]] tables")
    if "sim" in raw or "baseline" in raw or "published" in raw:
        raise UserError(
            f"{where}: a ranking row has no sim, baseline or published of its own; its members do"
        )
    metric = raw.get("metric", "")
    if metric and (not isinstance(metric, str) or not _METRIC_RE.match(metric)):
        raise UserError(f"{where}: 'metric' must name a run metric, e.g. tokens_per_s")
    setting, assumed = _parse_setting(raw, where)
    row = Row(
        **_described(raw),
        published=None,
        metric=str(metric),
        modelled=modelled,
        role=raw["role"],
        calibrated=calibrated.strip(),
        reason=reason,
        note=str(raw.get("note", "")),
        kind="ranking",
        setting=setting,
        assumed=assumed,
    )
    row.sim = {"member": members}  # resolved by _resolve_members
    return row


def _resolve_members(row: Row, rows: dict[str, Row], where: str) -> list[Member]:
    """A ranking row's members: each names a measurement row (its setting, and its published
    value when the units agree) or gives ``published`` and ``[row.member.sim]`` inline."""
    out: list[Member] = []
    names: set[str] = set()
    for i, raw in enumerate(row.sim.get("member", [])):
        here = f"{where}: member {i + 1}"
        if not isinstance(raw, dict):
            raise UserError(f"{here}: not a table")
        name = raw.get("name")
        if not isinstance(name, str) or not name.strip():
            raise UserError(f"{here}: missing or empty text field 'name'")
        here = f"{where}: member {name!r}"
        if name in names:
            raise UserError(f"{here}: appears twice")
        names.add(name)
        unknown = set(raw) - {"name", "row", "side", "published", "sim", "metric", "setting"}
        if unknown:
            raise UserError(f"{here}: unknown key(s) {', '.join(sorted(unknown))}")
        ref = raw.get("row", "")
        side = raw.get("side", "sim")
        pub = raw.get("published")
        published = None if pub is None else _positive(pub, f"{here}: 'published'")
        if ref:
            other = rows.get(ref)
            if other is None or other.is_ranking or not other.modelled:
                raise UserError(f"{here}: row {ref!r} is not a modelled measurement row")
            if "sim" in raw:
                raise UserError(f"{here}: give 'row' or [row.member.sim], not both")
            if side not in ("sim", "baseline"):
                raise UserError(f"{here}: side must be 'sim' or 'baseline', got {side!r}")
            if side == "baseline" and other.baseline is None:
                raise UserError(f"{here}: row {ref!r} has no baseline")
            sim = dict(other.sim) if side == "sim" else {**other.sim, **(other.baseline or {})}
            metric = raw.get("metric") or row.metric or other.metric
            if published is None:
                if side != "sim" or other.unit != row.unit or other.published is None:
                    raise UserError(
                        f"{here}: give 'published' (row {ref!r} is not in {row.unit!r})"
                    )
                published = other.published
            member_setting = str(raw.get("setting", other.setting))
        else:
            sim = raw.get("sim")
            if not isinstance(sim, dict):
                raise UserError(f"{here}: give 'row' or a [row.member.sim] table")
            for key in ("policy", "hw"):
                if key not in sim:
                    raise UserError(f"{here}: [row.member.sim] needs {key!r}")
            if "trace" not in sim and "synth" not in sim:
                raise UserError(f"{here}: [row.member.sim] needs 'trace' or a synth table")
            if published is None:
                raise UserError(f"{here}: missing 'published'")
            metric = raw.get("metric") or row.metric
            member_setting = str(raw.get("setting", ""))
        _check_sim(sim, None, here)
        if not isinstance(metric, str) or not _METRIC_RE.match(metric):
            raise UserError(f"{here}: no 'metric' (give one on the row or the member)")
        _check_metric(metric, here)
        if member_setting and member_setting not in SETTINGS:
            raise UserError(f"{here}: setting {member_setting!r} is not one of {SETTINGS}")
        out.append(Member(str(name), float(published), sim, metric, str(ref), member_setting))
    if len({m.published for m in out}) < 2:
        raise UserError(f"{where}: the members' published values give no order")
    return out


def _load_file(p: Path) -> list[tuple[Row, Path]]:
    if not os.path.lexists(p):
        raise UserError(f"{p}: no such validation table")
    data = read_toml(p, "validation table")
    raws = data.get("row")
    if not isinstance(raws, list) or not raws:
        raise UserError(f"{p}: no [[row]] entries")
    return [(_parse_row(r, i, p), p) for i, r in enumerate(raws)]


def load_table(path: str | os.PathLike[str] | None = None) -> list[Row]:
    """Parse and check the table (a file, or a folder of ``*.toml`` files read as one; the
    bundled folder when None); a mistake raises UserError naming the file and the row."""
    parsed = [rp for f in table_files(path) for rp in _load_file(f)]
    seen: dict[str, Path] = {}
    for r, p in parsed:
        if r.id in seen:
            also = "" if seen[r.id] == p else f" (also in {seen[r.id]})"
            raise UserError(f"{p}: row id {r.id!r} appears twice{also}")
        seen[r.id] = p
    rows = [r for r, _ in parsed]
    by_id = {r.id: r for r in rows}
    for r, p in parsed:
        if r.is_ranking:
            r.members = _resolve_members(r, by_id, f"{p}: row {r.id!r}")
            r.sim = {}
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
