"""A self-contained HTML report (tables inline, plots embedded as base64 PNG, no network)."""

from __future__ import annotations

import base64
import html
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from featcache.errors import ResultsError

log = logging.getLogger(__name__)

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;
padding:0 1em;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.85em}
th,td{border:1px solid #ddd;padding:.25em .5em;text-align:right}
th{background:#f3f3f3}td.s,th.s{text-align:left}
.note{color:#775;font-size:.9em}.err{color:#a00}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}
"""


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.4g}"
    return html.escape(str(v))


def html_table(df, *, max_rows: int = 200, table_id: str | None = None) -> str:
    """Render a polars DataFrame as an HTML table (strings left-aligned)."""
    import polars as pl

    if df is None or df.height == 0:
        return '<p class="note">(empty)</p>'
    str_cols = {c for c, t in zip(df.columns, df.dtypes) if t == pl.Utf8}
    ident = f' id="{html.escape(table_id)}"' if table_id else ""
    head = "".join(f'<th class="{"s" if c in str_cols else ""}">{html.escape(c)}</th>' for c in df.columns)
    body = []
    for row in df.head(max_rows).iter_rows():
        cells = "".join(
            f'<td class="{"s" if c in str_cols else ""}">{_fmt(v)}</td>' for c, v in zip(df.columns, row)
        )
        body.append(f"<tr>{cells}</tr>")
    more = f'<p class="note">{df.height - max_rows} more rows not shown</p>' if df.height > max_rows else ""
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{more}"


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _results_pivot(raw, kinds: Sequence[str], metrics: Sequence[str] | None = None):
    """Long table per (kind, task, backbone, metric): median value over seeds, n_seeds, and a
    Clopper-Pearson interval of the median for proportion metrics with a known n_eval."""
    import polars as pl

    from featcache.analysis.tables import reduce_seeds, with_intervals

    sub = raw.filter(pl.col("kind").is_in(list(kinds)))
    if metrics is not None:
        sub = sub.filter(pl.col("metric").is_in(list(metrics)))
    if sub.height == 0:
        return None
    red = with_intervals(reduce_seeds(sub))
    return red.select("kind", "task", "backbone", "metric", "value", "ci_lo", "ci_hi", "n_eval", "n_seeds").sort(
        ["kind", "task", "metric", "value"], descending=[False, False, False, True]
    )


def _wide(long, metric: str):
    """backbone x (kind:task) table of ``metric`` as "value [lo, hi]" strings."""
    import polars as pl

    if long is None:
        return None
    sub = long.filter(pl.col("metric") == metric)
    if sub.height == 0:
        return None
    cell = pl.when(pl.col("ci_lo").is_not_null()).then(
        pl.format("{} [{}, {}]", pl.col("value").round(4), pl.col("ci_lo").round(3), pl.col("ci_hi").round(3))
    ).otherwise(pl.col("value").round(4).cast(pl.Utf8))
    sub = sub.with_columns(cell.alias("cell"), (pl.col("kind") + pl.lit(":") + pl.col("task")).alias("setting"))
    return sub.pivot(on="setting", index="backbone", values="cell").sort("backbone")


def write_report(
    out_html: str | os.PathLike,
    results_df=None,
    catalog_df=None,
    *,
    external: Sequence = (),
    provenance=None,
    shift_splits: tuple[str, str] | None = None,
    title: str = "featcache report",
    rank_kwargs: Mapping[str, Any] | None = None,
) -> Path:
    """Write one self-contained HTML page: store catalog (``catalog_df``, passed by the
    caller), probe and retrieval results, rankings (overall, good/better/best, z-score heatmap,
    linear vs fine-tune when fine-tune rows are given via ``external``), calibration,
    efficiency (``provenance``; defaults to ``catalog_df`` when it has images_per_s) and optionally a test-set shift (``shift_splits=(orig, new)``).

    Ranking problems (e.g. a single backbone) are shown in the page and logged rather than
    aborting the report. Returns the path written (atomically).
    """
    import polars as pl

    from featcache.analysis import api
    from featcache.analysis.tables import merge_tables

    out = Path(out_html)
    if provenance is None and catalog_df is not None and "images_per_s" in catalog_df.columns:
        if catalog_df["images_per_s"].drop_nulls().len():
            provenance = catalog_df  # the store catalog carries images_per_s / peak_memory_mb
    if out.suffix.lower() not in (".html", ".htm"):
        raise ResultsError(f"report path {out} should end in .html")
    tables = api._as_tables(results_df, external, percent=(rank_kwargs or {}).get("percent"),
                            external_kind=(rank_kwargs or {}).get("external_kind"), groups=(rank_kwargs or {}).get("groups"))
    raw, coverage = merge_tables(tables)
    parts: list[str] = []
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    from featcache import __version__

    parts.append(f"<h1>{html.escape(title)}</h1>")
    parts.append(
        f'<p class="note">featcache {html.escape(__version__)} &middot; {now} &middot; '
        f"{len(coverage.backbones)} backbone(s), {len(coverage.tasks)} task(s), {raw.height} result rows</p>"
    )
    parts.append('<h2 id="catalog">Store catalog</h2>')
    if catalog_df is not None:
        parts.append(html_table(catalog_df, table_id="catalog-table"))
    else:
        parts.append('<p class="note">No store catalog was given.</p>')

    parts.append('<h2 id="probe">Probe results</h2>')
    probe = _results_pivot(raw, ["probe", "knn"])
    if probe is not None:
        metric = (rank_kwargs or {}).get("metric", "top1")
        wide = _wide(probe, metric)
        parts.append(
            f'<p class="note">Median over seeds; 95% Clopper-Pearson interval for accuracies with known n_eval. '
            f"Overview of {html.escape(metric)}, then every metric.</p>"
            + (html_table(wide, table_id="probe-wide") if wide is not None else "")
            + "<details><summary>all probe metrics</summary>" + html_table(probe, table_id="probe-table") + "</details>"
        )
    else:
        parts.append('<p class="note">No probe rows.</p>')
    parts.append('<h2 id="retrieval">Retrieval results</h2>')
    ret = _results_pivot(raw, ["retrieval"])
    if ret is not None:
        wide = _wide(ret, (rank_kwargs or {}).get("retrieval_metric", "map"))
        parts.append((html_table(wide, table_id="retrieval-wide") if wide is not None else "") + html_table(ret, table_id="retrieval-table"))
    else:
        parts.append('<p class="note">No retrieval rows.</p>')
    ft = _results_pivot(raw, ["finetune"])
    if ft is not None:
        parts.append('<h2 id="finetune">Fine-tuning results</h2>' + html_table(ft, table_id="finetune-table"))

    parts.append('<h2 id="rankings">Rankings</h2>')
    with tempfile.TemporaryDirectory(prefix="featcache-report-") as tmp:
        kw = {"on_constant": "drop", "n_boot": 1000, **{k: v for k, v in (rank_kwargs or {}).items() if k not in ("percent", "external_kind")}}
        try:
            r = api.rank(results_df, external, tmp, provenance=provenance,
                         percent=(rank_kwargs or {}).get("percent"), external_kind=(rank_kwargs or {}).get("external_kind"), **kw)
        except ResultsError as exc:
            log.warning("report: no ranking: %s", exc)
            parts.append(f'<p class="err">No ranking could be computed: {html.escape(str(exc))}</p>')
            r = None
        if r is not None:
            boot = r["bootstrap"].filter(pl.col("aggregation") == "zscore").select(
                "backbone", pl.col("lo").alias("zscore_lo"), pl.col("hi").alias("zscore_hi")
            )
            overall = r["overall"].join(boot, on="backbone", how="left").sort("position")
            parts.append(
                "<p>Backbones ordered by the mean Battle-of-the-Backbones z-score over settings "
                f"(bootstrap 95% interval, resampling {html.escape(r['resample'])}).</p>"
            )
            parts.append(html_table(overall, table_id="overall-table"))
            parts.append("<h3>Good / better / best</h3>" + html_table(r["top3"], table_id="top3-table"))
            parts.append("<h3>Agreement between aggregations (Kendall tau-b)</h3>" + html_table(r["agreement"]))
            hm = Path(tmp) / "zscore_heatmap.png"
            if hm.exists():
                parts.append(_img(hm, "z-score heatmap"))
            if r["lin_ft"] is not None:
                lf = r["lin_ft"]
                parts.append(
                    f"<h3>Linear probe vs fine-tune</h3><p>Mean Kendall tau-b over {lf['n_tasks']} task(s): "
                    f"{_fmt(lf['mean_tau'])}.</p>" + html_table(lf["per_task"]) + html_table(lf["per_backbone"])
                )
                for name in ("tau_per_task.png", "linear_vs_finetune.png"):
                    if (Path(tmp) / name).exists():
                        parts.append(_img(Path(tmp) / name, name))
            if r.get("calibration") is not None:
                parts.append("<h3>Calibration</h3>" + html_table(r["calibration"]) + html_table(r["calibration_corr"]))
            if r.get("efficiency") is not None:
                parts.append(
                    "<h3>Efficiency</h3>" + html_table(r["efficiency"])
                    + f'<p class="note">Spearman rho(throughput, z-score) = {_fmt(r.get("efficiency_rho"))}</p>'
                )
                if (Path(tmp) / "efficiency.png").exists():
                    parts.append(_img(Path(tmp) / "efficiency.png", "efficiency"))
            notes = r["notes"] + coverage.lines()
            if notes:
                parts.append("<h3>Notes</h3><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
        if shift_splits is not None:
            parts.append(f'<h2 id="shift">Test-set shift: {html.escape(shift_splits[0])} &rarr; {html.escape(shift_splits[1])}</h2>')
            try:
                s = api.shift(results_df, shift_splits[0], shift_splits[1], Path(tmp) / "shift", external=external)
                parts.append(html_table(s["table"]) + html_table(s["fit"]))
                for f in s["files"]:
                    if f.suffix == ".png":
                        parts.append(_img(f, f.name))
            except ResultsError as exc:
                parts.append(f'<p class="err">No shift analysis: {html.escape(str(exc))}</p>')
    doc = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_CSS}</style></head><body>{''.join(parts)}</body></html>\n"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmpf = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        Path(tmpf).write_text(doc, encoding="utf-8")
        os.replace(tmpf, out)
    finally:
        if os.path.exists(tmpf):
            os.unlink(tmpf)
    log.info("report written to %s", out)
    return out
