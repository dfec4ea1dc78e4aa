"""Accuracy against depth: the curves of the layer sweeps (``featcache probe --layers``,
``featcache retrieve --layers``), read from a results table.

A sweep writes one run per layer, each row's hparams marked ``layer`` (the 0-based block or
stage), ``layer_kind``, ``layer_role`` (``selected`` for the layer chosen on validation data,
``curve`` for the others) and ``layer_selection`` (the rule, the metric it selected on, the
layer chosen). The rankings read the selected rows only (:func:`curve_rows` marks the others);
:func:`depth_curves` gathers every layer of a sweep into one :class:`DepthCurve` per backbone
and task, :func:`depth_figure` draws them (a matplotlib Figure, no pyplot) and
:func:`depth_table` lays them out for ``featcache rank``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DepthCurve", "curve_rows", "depth_curves", "depth_figure", "depth_plot", "depth_table"]


def curve_rows() -> Any:
    """Polars expression: a layer sweep's rows of a layer it did not select."""
    import polars as pl

    return pl.col("hparams").fill_null("").str.contains('"layer_role": "curve"', literal=True)


@dataclass(frozen=True)
class DepthCurve:
    """One backbone's sweep on one task: ``values[j]`` is ``metric`` (mean over seeds) at layer
    ``layers[j]``; ``selected`` the layer chosen on validation data by ``rule``."""

    kind: str
    dataset: str
    protocol: str
    eval_split: str
    metric: str
    backbone: str
    layers: tuple[int, ...]
    values: np.ndarray
    selected: int
    rule: str
    #: 95% Clopper-Pearson interval per layer (a proportion metric with a known ``n_eval`` and
    #: one seed; NaN elsewhere: a mean over seeds is no binomial proportion)
    lo: np.ndarray | None = None
    hi: np.ndarray | None = None

    @property
    def task(self) -> str:
        return f"{self.kind} {self.protocol} on {self.dataset}/{self.eval_split} ({self.metric})"


def _sweeps(frame) -> Any:
    """The sweep rows of ``frame`` (seed >= 0) with their marks as columns."""
    import polars as pl

    rows = frame.filter(pl.col("hparams").fill_null("").str.contains('"layer_role": ', literal=True))
    rows = rows.filter(pl.col("seed") >= 0)
    marks = [json.loads(h) for h in rows["hparams"].to_list()]
    return rows.with_columns(
        pl.Series("layer", [int(m["layer"]) for m in marks], pl.Int64),
        pl.Series("sel_metric", [m["layer_selection"]["metric"] for m in marks], pl.Utf8),
        pl.Series("selected", [int(m["layer_selection"]["selected"]) for m in marks], pl.Int64),
        pl.Series("rule", [m["layer_selection"]["rule"] for m in marks], pl.Utf8),
    )


def depth_curves(frame: Any, metric: str | None = None) -> list[DepthCurve]:
    """Every sweep of ``frame`` (a featcache results table as read) as curves, on ``metric``
    (``None``: the metric each sweep selected its layer on), sorted by task and backbone. The
    latest row of each run counts (a sweep run again replaces its rows)."""
    import polars as pl

    if frame is None or not {"hparams", "kind"} <= set(frame.columns) or not frame.height:
        return []
    rows = _sweeps(frame)
    if not rows.height:
        return []
    rows = rows.sort("created_at").unique(["run_id", "metric"], keep="last")
    rows = rows.filter(pl.col("metric") == (pl.col("sel_metric") if metric is None else pl.lit(metric)))
    keys = ["kind", "dataset", "protocol", "eval_split", "metric", "backbone"]
    out = []
    for key, g in sorted(rows.group_by(keys), key=lambda t: tuple(map(str, t[0]))):
        per = (
            g.group_by("layer")
            .agg(pl.col("value").mean(), pl.col("n_eval").min(), pl.col("seed").n_unique().alias("n_seeds"))
            .sort("layer")
        )
        values = per["value"].to_numpy().astype(float)
        lo, hi = _intervals(str(key[4]), values, per["n_eval"].fill_null(0).to_numpy(), per["n_seeds"].to_numpy())
        sel = g.sort("created_at")["selected"][-1]
        layers = tuple(per["layer"].to_list())
        kind, dataset, protocol, eval_split, metric_name, backbone = (str(k) for k in key)
        out.append(
            DepthCurve(
                kind,
                dataset,
                protocol,
                eval_split,
                metric_name,
                backbone,
                layers,
                values,
                int(sel),
                str(g["rule"][-1]),
                lo,
                hi,
            )
        )
    return out


def _intervals(metric: str, v: np.ndarray, n: np.ndarray, seeds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """95% Clopper-Pearson bounds where ``metric`` is a proportion of ``n`` rows from one seed."""
    from featcache.analysis.stats import clopper_pearson
    from featcache.core.metrics import proportion_metrics

    lo, hi = np.full(v.size, np.nan), np.full(v.size, np.nan)
    ok = (n > 0) & (seeds == 1) & np.isfinite(v) & (v >= 0) & (v <= 1) & (metric in proportion_metrics())
    if ok.any():
        lo[ok], hi[ok] = clopper_pearson(v[ok] * n[ok], n[ok])
    return lo, hi


def depth_table(curves: list[DepthCurve]) -> Any:
    """One row per curve: task, backbone, the layer selected and its value, then one column
    per layer index (``layer0`` ...; null where that backbone has no such layer)."""
    import polars as pl

    depth = max((max(c.layers) for c in curves), default=-1) + 1
    recs = []
    for c in curves:
        at = dict(zip(c.layers, c.values.tolist()))
        rec = {"task": c.task, "backbone": c.backbone, "selected": c.selected, "rule": c.rule}
        rec["selected_value"] = at.get(c.selected)
        if c.lo is not None and c.hi is not None and c.selected in c.layers:
            j = c.layers.index(c.selected)
            rec["selected_ci"] = f"[{c.lo[j]:.4f}, {c.hi[j]:.4f}]" if np.isfinite(c.lo[j]) else None
        rec.update({f"layer{i}": at.get(i) for i in range(depth)})
        recs.append(rec)
    schema = {"task": pl.Utf8, "backbone": pl.Utf8, "selected": pl.Int64, "rule": pl.Utf8}
    schema.update({"selected_value": pl.Float64, "selected_ci": pl.Utf8})
    schema.update({f"layer{i}": pl.Float64 for i in range(depth)})
    return pl.DataFrame(recs, schema=schema, orient="row")


def _panels(curves: list[DepthCurve]) -> list[tuple[str, str, list]]:
    tasks = sorted({c.task for c in curves})
    return [
        (
            task,
            task.rsplit("(", 1)[-1].rstrip(")"),
            [(c.backbone, c.layers, c.values, c.selected, c.lo, c.hi) for c in curves if c.task == task],
        )
        for task in tasks
    ]


def depth_figure(curves: list[DepthCurve]) -> Any:
    """A matplotlib Figure: one panel per task, a line per backbone (metric against layer
    index), the layer selected on validation data ringed (:func:`~featcache.analysis.plots.layer_curves_figure`)."""
    from featcache.analysis.plots import layer_curves_figure

    return layer_curves_figure(_panels(curves))


def depth_plot(curves: list[DepthCurve], path: str | os.PathLike) -> Path:
    """:func:`depth_figure` saved as a PNG at ``path``."""
    from featcache.analysis.plots import layer_curves

    return layer_curves(_panels(curves), path)
