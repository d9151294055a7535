"""``daopsim advise``'s answer as text (the ranked table, the bounds, the best per precision, the
target's lines, each row's ``daopsim run`` command wrapped to the width) and as CSV.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from daopsim.simulator.advise_answer import Advice, AdviceRow

# -- text -------------------------------------------------------------------------------------
#: Ranked rows ``daopsim advise`` prints unless ``--top`` says otherwise.
DEFAULT_TOP = 10
#: Width of the text table when the terminal's is not known.
DEFAULT_WIDTH = 100


def _fidelity_text(exact: float | None, kept: float | None) -> str:
    """A fidelity cell: the exact share, or ``~`` and the routing's kept gate mass for
    experts at a lossy precision (docs/advise.md, "Fidelity")."""
    if exact is None:
        return "n/a"
    if exact == 0.0 and kept:
        return f"~{kept:.3f}"
    return f"{exact:.3f}"


def render(advice: Advice, top: int | None = DEFAULT_TOP, width: int | None = None) -> str:
    """The ranked table as text: the best ``top`` rows (``None`` or 0: all) with their tie
    groups, the reference lines, bounds, the best row per precision, the machines against
    the target, and each row's command, at most ``width`` characters a line where the
    pieces allow (default: the terminal's). ``--json``/``--csv`` have every row and column."""
    import shutil
    import textwrap

    width = max(80, width or shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)
    shown = advice.rows[:top] if top else list(advice.rows)
    several = "," in advice.hw
    table = _Table.fit([*shown, *advice.references], several, width)
    trace = advice.trace if advice.trace_synth else Path(advice.trace).name
    lines = textwrap.wrap(
        f"advise: {advice.model} on {advice.hw.replace(',', ', ')}, trace {trace}, "
        f"{advice.sequences} sequence{'s' * (advice.sequences != 1)} each, "
        f"{advice.runs} runs, ranked by tokens/s (simulated); %bound: share of the all-GPU "
        "bound at the same precision (docs/metrics.md); experts: the most kept resident",
        width,
    )
    lines += table.row("#", [h for h, _, _, _ in table.cols], "options")
    for r in shown:
        lines += table.entry(str(r.rank), r)
    if not advice.rows:
        lines.append("  (no configuration fits, passes the floors or reaches the target)")
    hidden = len(advice.rows) - len(shown)
    if hidden:
        lines += textwrap.wrap(
            f"  ... {_count(hidden, 'more ranked row')} (--top 0 shows all; --json or --csv "
            "has every row)",
            width,
        )
    if advice.references:
        lines.append("reference lines (bounds, not realisable):")
        for r in advice.references:
            lines += table.entry("-", r)
    lines += _bound_lines(advice, several, width)
    if advice.min_tokens_per_s is not None:
        lines += _target_lines(advice, width)
    lines += _closing_lines(advice, shown, width)
    return "\n".join(lines)


@dataclass
class _Table:
    """The ranked table's columns as they fit a terminal ``width`` characters wide, and its
    rows as lines."""

    #: (header, width, alignment, cell) per column
    cols: list[tuple[str, int, str, Callable[[AdviceRow], str]]]
    #: the options column's start and width
    lead: int
    opt_width: int
    width: int

    @classmethod
    def fit(cls, listed: list[AdviceRow], several: bool, width: int) -> _Table:
        """The columns for the rows ``listed`` (the name columns as wide as their values), the
        least needed dropped in turn while the options column would be under 12 characters."""

        def share(r: AdviceRow) -> str:
            return f"{r.of_bound:.0%}" if r.of_bound is not None else "n/a"

        def pol(r: AdviceRow) -> str:
            return r.policy + (f" +{len(r.tied)}" if r.tied else "")

        cols: list[tuple[str, int, str, Callable[[AdviceRow], str]]] = [
            ("tokens/s", 9, ">", lambda r: f"{r.tokens_per_s:.2f}"),
            ("%bound", 6, ">", share),
            ("TTFT s", 7, ">", lambda r: f"{r.ttft_s:.3f}"),
            ("fidelity", 8, ">", lambda r: _fidelity_text(r.fidelity, r.gate_mass_preserved)),
            ("bottleneck", 10, "<", lambda r: r.bottleneck),
        ]
        if several:
            cols.append(("machine", max([7, *(len(r.hw) for r in listed)]), "<", lambda r: r.hw))
        cols += [
            ("policy", max([6, *(len(pol(r)) for r in listed)]), "<", pol),
            ("runtime", max([7, *(len(r.runtime) for r in listed)]), "<", lambda r: r.runtime),
            ("dtype", max([5, *(len(r.dtype) for r in listed)]), "<", lambda r: r.dtype),
            ("experts", 7, ">", lambda r: str(r.resident_experts)),
        ]
        min_options = 12
        for drop in ("TTFT s", "bottleneck", "%bound"):  # narrow terminals: --json/--csv keep them
            if 5 + sum(w + 2 for _, w, _, _ in cols) + min_options <= width:
                break
            cols = [c for c in cols if c[0] != drop]
        lead = 5 + sum(w + 2 for _, w, _, _ in cols)
        return cls(cols, lead, max(min_options, width - lead), width)

    def row(self, tag: str, cells: list[str], options: str) -> list[str]:
        """One row's lines: its cells, then its options, never cut: the ones that do not fit
        go on lines of their own, under the options column."""
        parts = [f"{tag:>3}"] + [
            f"{c:{a}{w}}" for c, (_, w, a, _) in zip(cells, self.cols, strict=True)
        ]
        head = "  ".join(parts) + "  "
        pieces = options.split(",")
        out, cur = [], ""
        for i, piece in enumerate(pieces):
            piece += "," if i < len(pieces) - 1 else ""
            if cur and len(cur) + len(piece) > self.opt_width:
                out.append(cur)
                cur = ""
            cur += piece
        out.append(cur)
        lines = [(head + out[0]).rstrip() if len(out[0]) <= self.opt_width else head.rstrip()]
        for i, o in enumerate(out):
            if len(o) > self.opt_width:  # wider than the column: a line of its own, indented
                lines.append(" " * 8 + o)
            elif i:
                lines.append(" " * self.lead + o)
        return lines

    def entry(self, tag: str, r: AdviceRow) -> list[str]:
        """A result row's lines, with the rows tied with it and why."""
        import textwrap

        out = self.row(tag, [f(r) for _, _, _, f in self.cols], r.options_text)
        if r.tied:
            names = [_tie_label(t) for t in r.tied]
            out += textwrap.wrap(
                f"tied with {', '.join(names)}: {r.tie_reason}",
                self.width,
                initial_indent="      = ",
                subsequent_indent="        ",
            )
        return out


def _bound_lines(advice: Advice, several: bool, width: int) -> list[str]:
    """The all-GPU bound of each (machine, precision), and the best row of each precision
    when there are several."""
    import textwrap

    lines: list[str] = []
    bounds: dict[tuple[str, str], tuple[float, Any]] = {}
    for r in [*advice.rows, *advice.references]:
        if r.bound_tokens_per_s is not None:
            bounds.setdefault((r.hw, r.dtype), (r.bound_tokens_per_s, r.bound_runtime))
    for (h, dtype), (tps, rt) in bounds.items():
        on = f" on {h}" if several else ""
        lines += textwrap.wrap(
            f"all-GPU bound at {dtype}{on}: {tps:.2f} tokens/s (every expert resident, "
            f"runtime {rt})",
            width,
        )
    if len(advice.best_per_precision) > 1:
        lines.append("best per precision:")
        for b in advice.best_per_precision:
            on = f" on {b['hw']}" if several else ""
            fid = _fidelity_text(b["fidelity"], b["gate_mass_preserved"])
            lines.append(
                f"  {b['dtype']}{on}: #{b['rank']} {b['tokens_per_s']:.2f} tokens/s "
                f"({b['policy']}, fidelity {fid})"
            )
    return lines


def _closing_lines(advice: Advice, shown: list[AdviceRow], width: int) -> list[str]:
    """What was left out and why, the notes, how to make a synthetic trace, and each shown
    row's command."""
    import textwrap

    notes = [f"{_count(advice.skipped, 'run')} skipped (do not fit)"]
    if advice.below_floor:
        notes.append(f"{advice.below_floor} below --min-gate-mass {advice.min_gate_mass}")
    if advice.below_target:
        notes.append(f"{advice.below_target} below --min-tokens-per-s {advice.min_tokens_per_s}")
    if advice.failed:
        notes.append(f"{advice.failed} failed")
    lines = textwrap.wrap("; ".join(notes), width)
    for note in advice.notes:
        lines += textwrap.wrap(f"note: {note}", width, subsequent_indent="  ")
    if advice.trace_synth:
        lines += textwrap.wrap(
            f"the trace is synthetic: `--model {advice.model}` (in the commands below) makes "
            "the same one on any machine; to write it to a file:",
            width,
        )
        lines += _wrap_command("    ", advice.trace_synth, width)
    lines.append("commands:")
    for tag, r in [*((str(r.rank), r) for r in shown), *(("-", r) for r in advice.references)]:
        lines += _wrap_command(f"{tag:>3}  ", r.command, width)
    return lines


def _tie_label(t: dict[str, Any]) -> str:
    opts = ",".join(f"{k}={v}" for k, v in sorted(t["options"].items()))
    label = t["policy"] + (f" ({opts})" if opts else "")
    if t.get("cache_ratio") is not None:
        label += f" at ratio {t['cache_ratio']}"
    return label


def _target_lines(advice: Advice, width: int) -> list[str]:
    import textwrap

    target = advice.min_tokens_per_s
    meeting = [m for m in advice.machines if m.meets_target]
    lines = [
        f"target {target} tokens/s: {len(meeting)} of {_count(len(advice.machines), 'machine')} "
        "reach it"
    ]
    for m in advice.machines:
        best = (
            "no configuration fits"
            if m.best_tokens_per_s is None
            else (f"best {m.best_tokens_per_s:.2f} tokens/s")
        )
        extra = []
        if m.price is not None:
            extra.append(f"price {m.price:g}")
        if m.tokens_per_kj is not None:
            extra.append(f"{m.tokens_per_kj:.1f} tokens/kJ")
        mark = "yes" if m.meets_target else "no "
        rank = f" (#{m.best_rank})" if m.best_rank is not None else ""
        lines.append(f"  {mark} {m.hw}: {best}{rank}" + (f", {', '.join(extra)}" if extra else ""))
    if advice.answer is not None:
        lines += textwrap.wrap(
            f"cheapest machine that reaches it: {advice.answer} (machines ordered by "
            f"{advice.order})",
            width,
        )
    else:
        lines.append("no machine reaches the target")
    return lines


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _wrap_command(prefix: str, command: str, width: int) -> list[str]:
    """A shell command over several lines (``\\`` continuations), each at most ``width``
    characters when its pieces allow; an option stays on the line of its value."""
    words = [shlex.quote(w) for w in shlex.split(command)]
    pieces: list[str] = []
    for w in words:
        if pieces and pieces[-1].startswith("--") and " " not in pieces[-1] and w[0] != "-":
            pieces[-1] += " " + w
        else:
            pieces.append(w)
    out: list[str] = []
    cur = prefix
    indent = " " * (len(prefix) + 4)
    for piece in pieces:
        if cur.strip() and cur not in (prefix, indent) and len(cur) + len(piece) + 2 > width:
            out.append(cur.rstrip() + " \\")
            cur = indent
        cur += piece + " "
    out.append(cur.rstrip())
    return out


def to_csv(advice: Advice) -> str:
    """Every row (ranked, then the reference lines) as CSV, every column (``advise --csv``)."""
    import io

    skip = ("options", "tied")
    cols = [f for f in AdviceRow.__dataclass_fields__ if f not in skip]
    recs = []
    for r in [*advice.rows, *advice.references]:
        rec = {c: getattr(r, c) for c in cols}
        rec["options"] = r.options_text if r.options else ""
        rec["of_bound"] = r.of_bound
        rec["tied"] = ";".join(_tie_label(t) for t in r.tied)
        recs.append(rec)
    buf = io.StringIO()
    pd.DataFrame(recs, columns=[*cols, "options", "of_bound", "tied"]).to_csv(buf, index=False)
    return buf.getvalue()
