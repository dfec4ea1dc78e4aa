"""Dense results (``featcache dense``: seg-linear, depth-linear, hummingbird) read from a results
table: one table of every backbone's dense metrics per task (mean over seeds, the interval over
images where the run recorded one) and a figure of each task's headline metric.

A dense row is ``kind == "dense"``; its ``metric`` is one of the dense names
(:mod:`featcache.core.dense_metrics`: ``miou``/``macc``/``aacc``, the depth names, Hummingbird's
``hbird_miou``); the direction of each comes from
:data:`~featcache.core.dense_metrics.DENSE_LOWER_IS_BETTER`. An interval over images, when a run
wrote one, is in its hparams as ``ci95: [lo, hi]`` (:mod:`featcache.core.dense_intervals`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from featcache.core.dense_metrics import DENSE_LOWER_IS_BETTER, DEPTH_METRICS, SEG_METRICS

__all__ = ["DENSE_KIND", "HEADLINE", "dense_figure", "dense_plot", "dense_rows", "dense_table"]

#: the results-row kind the dense stage writes
DENSE_KIND = "dense"
#: the metric each dense task is ranked by, first found wins (a table column order too)
HEADLINE = ("miou", "hbird_miou", "rmse")
_ORDER = (*SEG_METRICS, "hbird_miou", *DEPTH_METRICS)
_KEYS = ["dataset", "protocol", "eval_split"]


def dense_rows(results: Any) -> Any:
    """The dense seed rows of a results table (median rows, ``seed < 0``, left out), or None."""
    import polars as pl

    if results is None or "kind" not in results.columns:
        return None
    sub = results.filter((pl.col("kind") == DENSE_KIND) & (pl.col("seed") >= 0))
    return sub if sub.height else None


def _ci(hparams: str | None) -> tuple[float, float] | None:
    try:
        ci = json.loads(hparams or "{}").get("ci95")
    except (json.JSONDecodeError, AttributeError):
        return None
    return (float(ci[0]), float(ci[1])) if isinstance(ci, list) and len(ci) == 2 else None


def _headline(metrics: set[str]) -> str:
    return next((m for m in HEADLINE if m in metrics), sorted(metrics)[0])


def dense_table(results: Any) -> Any:
    """One row per (dataset, protocol, eval split, backbone): each dense metric's mean over
    seeds as a column (in the references' order), ``seeds``, and the headline metric's interval
    over images (``ci95``) when its run recorded one; each task's backbones best first. None
    without dense rows."""
    import polars as pl

    sub = dense_rows(results)
    if sub is None:
        return None
    long = sub.group_by([*_KEYS, "backbone", "metric"]).agg(
        pl.col("value").mean(), pl.col("seed").n_unique().alias("seeds"), pl.col("hparams").first()
    )
    parts = []
    for key, g in long.sort([*_KEYS, "backbone"]).group_by(_KEYS, maintain_order=True):
        head = _headline(set(g["metric"].to_list()))
        wide = g.pivot(on="metric", index="backbone", values="value")
        cols = [m for m in _ORDER if m in wide.columns] + sorted(set(wide.columns) - {"backbone", *_ORDER})
        hp = g.filter(pl.col("metric") == head).select("backbone", "seeds", "hparams")
        ci = [_ci(h) for h in hp["hparams"].to_list()]
        hp = hp.with_columns(
            pl.Series("ci95", [f"[{c[0]:.4g}, {c[1]:.4g}]" if c else "" for c in ci], dtype=pl.Utf8)
        ).drop("hparams")
        wide = wide.join(hp, on="backbone", how="left").with_columns(pl.col(head).alias("score"))
        wide = wide.sort(head, descending=head not in DENSE_LOWER_IS_BETTER, nulls_last=True)
        lead = [pl.lit(str(v)).alias(k) for k, v in zip(_KEYS, key, strict=True)]
        parts.append(wide.select(*lead, pl.lit(head).alias("ranked_by"), "backbone", "score", "ci95", "seeds", *cols))
    out = pl.concat(parts, how="diagonal_relaxed")
    metrics = [m for m in _ORDER if m in out.columns] + sorted(
        set(out.columns) - {*_KEYS, "ranked_by", "backbone", "score", "ci95", "seeds", *_ORDER}
    )
    return out.select(*_KEYS, "ranked_by", "backbone", "score", "ci95", "seeds", *metrics)


def dense_figure(results: Any) -> Any:
    """A matplotlib Figure: one panel per dense task, a bar per backbone of its headline metric
    (mean over seeds), the interval over images drawn where recorded; None without dense rows."""
    from featcache.analysis.plots import new_figure

    table = dense_table(results)
    if table is None:
        return None
    tasks = table.partition_by(_KEYS, maintain_order=True)
    fig = new_figure(4.2 * len(tasks), 3.2)
    for i, t in enumerate(tasks):
        ax = fig.add_subplot(1, len(tasks), i + 1)
        head = str(t["ranked_by"][0])
        vals = t[head].to_list()
        err = [[0.0] * len(vals), [0.0] * len(vals)]
        for j, c in enumerate(t["ci95"].to_list()):
            if c:
                lo, hi = (float(x) for x in c.strip("[]").split(","))
                err[0][j], err[1][j] = max(vals[j] - lo, 0.0), max(hi - vals[j], 0.0)
        ax.bar(range(len(vals)), vals, yerr=err, capsize=3, color="#4c72b0")
        ax.set_xticks(range(len(vals)), t["backbone"].to_list(), rotation=30, ha="right", fontsize=8)
        arrow = "lower is better" if head in DENSE_LOWER_IS_BETTER else "higher is better"
        ax.set_title(f"{t['protocol'][0]} on {t['dataset'][0]}/{t['eval_split'][0]}", fontsize=9)
        ax.set_ylabel(f"{head} ({arrow})", fontsize=8)
    return fig


def dense_plot(results: Any, path: str | os.PathLike) -> Path | None:
    """:func:`dense_figure` saved as a PNG at ``path`` (None without dense rows)."""
    from featcache.analysis.plots import save_figure

    fig = dense_figure(results)
    return None if fig is None else save_figure(fig, path)
