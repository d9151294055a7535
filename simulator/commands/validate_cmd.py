"""``daopsim validate``: the simulator against published measurements (validation/*.toml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from daopsim.simulator.commands.common import echo_json, json_option
from daopsim.simulator.progress import lazy_progress


def _columns(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip()]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return lines


def _render(report: Any) -> str:
    from daopsim.simulator.validation import ranking_rows, summary_lines, table_rows

    rows = [r[:7] for r in table_rows(report)]
    head = ["ROW", "ROLE", "SETTING", "PUBLISHED", "SIMULATED", "UNIT", "ERROR"]
    lines = _columns(head, rows) if rows else []
    ranks = [r[:6] for r in ranking_rows(report)]
    if ranks:
        lines += [
            "",
            *_columns(["RANKING", "ROLE", "SETTING", "PAIRS", "PUBLISHED", "SIMULATED"], ranks),
        ]
    return "\n".join([*lines, "", *summary_lines(report)])


#: The files ``validate --out`` writes (the folder is replaced as one set).
OUT_FILES = ("validation.csv", "validation.md")


@click.command("validate")
@click.option(
    "--table",
    type=click.Path(),
    default=None,
    help="Validation table: a TOML file, or a folder whose *.toml files are read as one table "
    "(default: the bundled folder validation/).",
)
@click.option("--rows", "row_ids", default=None, help="Only these row ids (comma-separated).")
@click.option(
    "--sequences",
    type=int,
    default=None,
    help="Cap every run at this many evaluation sequences (faster, noisier).",
)
@click.option(
    "--out",
    "-o",
    "out_dir",
    default=None,
    help="Write validation.csv and validation.md here.",
)
@click.option(
    "--markdown",
    "markdown_path",
    default=None,
    help="Regenerate the table between the markers of this markdown file (docs/validation.md).",
)
@click.option("--no-progress", is_flag=True, help="Do not show a progress bar.")
@json_option
def validate(
    table: str | None,
    row_ids: str | None,
    sequences: int | None,
    out_dir: str | None,
    markdown_path: str | None,
    no_progress: bool,
    as_json: bool,
) -> None:
    """Run every modelled row of the validation table; print published vs simulated.

    Rows on synthetic traces generate them once into the cache folder (the last line says
    where and how big; `daopsim doctor` too) and reuse them later."""
    from daopsim.simulator.errors import UserError
    from daopsim.simulator.output import check_output_dir, check_output_file, output_dir, write_text
    from daopsim.simulator.validation import (
        load_table,
        page_row_ids,
        run_validation,
        select,
        splice_markdown,
        to_csv,
        to_markdown,
    )

    if sequences is not None and sequences <= 0:
        raise UserError(f"--sequences must be positive, got {sequences}")
    if markdown_path is not None and (row_ids is not None or sequences is not None):
        # the page's table is the whole of --table at its own sequence counts; a subset
        # would silently replace it (docs/validation.md is regenerated this way)
        given = "--rows" if row_ids is not None else "--sequences"
        raise UserError(
            f"--markdown {markdown_path}: regenerates the file's whole table from every row of "
            f"the validation table at its own sequence counts, so {given} cannot be combined "
            "with it; write a subset with --out DIR"
        )
    if out_dir is not None:
        check_output_dir(out_dir, OUT_FILES, "--out", inputs=[table, markdown_path])
    if markdown_path is not None:
        # rewritten in place on purpose, so it is not checked against the inputs
        check_output_file(markdown_path, "--markdown", inputs=[table])
    rows = select(load_table(table), row_ids)
    doc_text = None
    if markdown_path is not None:
        try:
            doc_text = Path(markdown_path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"{markdown_path}: no such file") from None
        splice_markdown(doc_text, "")  # fail on missing markers before the long run
        # the page's table is replaced whole: never by a table lacking rows it lists (a
        # --table of one row would shrink the committed page to that row)
        have = {r.id for r in rows}
        dropped = [i for i in page_row_ids(doc_text) if i not in have]
        if dropped:
            shown = ", ".join(dropped[:3]) + (", ..." if len(dropped) > 3 else "")
            raise UserError(
                f"--markdown {markdown_path}: its table lists {len(dropped)} row(s) that the "
                f"validation table {table or '(bundled)'} does not have ({shown}); regenerating "
                "it would drop them, so write this table with --out DIR instead"
            )
    with lazy_progress("rows", enabled=not no_progress) as progress:
        report = run_validation(rows, max_sequences=sequences, progress=progress)
    if out_dir is not None:
        with output_dir(out_dir, OUT_FILES, "--out", inputs=[table, markdown_path]) as stage:
            write_text(stage / "validation.csv", to_csv(report))
            write_text(stage / "validation.md", to_markdown(report))
    if markdown_path is not None and doc_text is not None:
        write_text(markdown_path, splice_markdown(doc_text, to_markdown(report)), "--markdown")
    if as_json:
        echo_json(report.to_dict())
    else:
        click.echo(_render(report))
        if out_dir is not None:
            click.echo(f"\nwrote {out_dir}/validation.csv and validation.md")
        from daopsim.simulator.trace_cache import cache_summary

        click.echo(cache_summary())
