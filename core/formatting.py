"""The one table formatter (neutral: the analysis stage and the stages' commands use it): a polars DataFrame as aligned text (CLI),
GitHub Markdown (``NAME.md`` beside each parquet table) or cells for the report's HTML
template (:func:`table_cells`; the template escapes them).

Every style goes through :func:`format_cell`, so a number reads the same in the terminal, in
the Markdown files and in the report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from featcache.errors import ConfigError

STYLES = ("text", "markdown")


def format_cell(v: Any, floatfmt: str = "{:.4g}") -> str:
    """One cell as text: ``""`` for null, ``nan`` for NaN, floats with ``floatfmt``, lists and
    dicts as JSON."""
    if v is None:
        return ""
    if isinstance(v, float):
        return "nan" if v != v else floatfmt.format(v)
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


@dataclass(frozen=True)
class Table:
    """A DataFrame's cells as text, ready for any style: ``text[i]`` marks text columns
    (left-aligned), ``more`` counts rows left out by ``max_rows``."""

    columns: list[str]
    text: list[bool]
    rows: list[list[str]]
    more: int = 0
    id: str | None = None


def table_cells(df, *, floatfmt: str = "{:.4g}", max_rows: int | None = None, table_id: str | None = None) -> Table:
    """Format every cell of ``df`` with :func:`format_cell` (the report's template renders the
    result as HTML, with autoescape; :func:`format_table` as text or Markdown)."""
    import polars as pl

    shown = df if max_rows is None else df.head(max_rows)
    text = [t in (pl.Utf8, pl.Categorical, pl.Boolean) or isinstance(t, pl.List) for t in df.dtypes]
    rows = [[format_cell(v, floatfmt) for v in r] for r in shown.rows()]
    return Table(list(df.columns), text, rows, df.height - shown.height, table_id)


def format_table(df, style: str = "markdown", *, floatfmt: str = "{:.4g}", max_rows: int | None = None) -> str:
    """Render ``df`` as ``"markdown"`` (GitHub) or ``"text"`` (aligned columns for the CLI);
    ``max_rows`` keeps the first rows and says how many were left out."""
    if style not in STYLES:
        raise ConfigError(f"style must be one of {STYLES}, got {style!r}")
    if df is None or df.height == 0:
        return "(empty)\n"
    t = table_cells(df, floatfmt=floatfmt, max_rows=max_rows)
    if style == "markdown":
        lines = ["| " + " | ".join(t.columns) + " |", "|" + "|".join(":--" if x else "--:" for x in t.text) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in t.rows]
    else:
        widths = [max(len(c), *(len(r[i]) for r in t.rows)) for i, c in enumerate(t.columns)]

        def line(r):
            return "  ".join(v.ljust(w) if x else v.rjust(w) for v, w, x in zip(r, widths, t.text)).rstrip()

        lines = [line(t.columns)] + [line(r) for r in t.rows]
    if t.more:
        lines.append(f"({t.more} more rows not shown)")
    return "\n".join(lines) + "\n"
