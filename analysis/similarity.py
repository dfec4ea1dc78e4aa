"""Backbone-similarity heatmaps and the near-duplicate audit table, read from a results table.

``featcache similarity`` writes one ``kind="similarity"`` row per backbone pair and measure
(``backbone`` the first, ``protocol`` ``vs:<second>``, the measure's name for the report in
its hparams' ``measure_text``: the analysis imports no stage, so a newly registered measure
needs nothing here); :func:`similarity_matrices` turns them into one symmetric matrix per
dataset, split and measure, :func:`similarity_heatmap` draws one. ``featcache audit --results`` writes ``kind="audit"`` rows; :func:`audit_table` lays them
out one line per backbone and split, with the change in top-1 when flagged rows are left out.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SimilarityMatrix", "audit_table", "similarity_heatmap", "similarity_matrices"]


@dataclass(frozen=True)
class SimilarityMatrix:
    """One measure between every pair of ``backbones`` on ``dataset``/``split`` (NaN: not run);
    ``text``: the measure's name in the report (its rows' ``measure_text``; empty: the metric)."""

    dataset: str
    split: str
    metric: str
    backbones: tuple[str, ...]
    values: np.ndarray
    text: str = ""

    @property
    def title(self) -> str:
        return f"{self.text or self.metric} on {self.dataset}/{self.split}"


def _measure_text(hparams: list[Any]) -> str:
    """The ``measure_text`` the rows recorded (the last that has one); "" in a table written
    before rows recorded it."""
    for h in reversed(hparams):
        hp = json.loads(h) if isinstance(h, str) else (h or {})
        if hp.get("measure_text"):
            return str(hp["measure_text"])
    return ""


def _latest(frame):
    """One row per (dataset, split, metric, pair): the most recent."""
    import polars as pl

    return (
        frame.sort("created_at")
        .unique(["dataset", "eval_split", "metric", "backbone", "protocol"], keep="last")
        .filter(pl.col("protocol").str.starts_with("vs:"))
    )


def similarity_matrices(frame: Any) -> list[SimilarityMatrix]:
    """The similarity rows of ``frame`` (a results table as read) as symmetric matrices, the
    diagonal 1 (a representation compared with itself), sorted by dataset, split and measure."""
    import polars as pl

    if frame is None or "kind" not in frame.columns:
        return []
    sim = frame.filter(pl.col("kind") == "similarity")
    if not sim.height:
        return []
    sim = _latest(sim)
    out = []
    for (ds, split, metric), g in sorted(sim.group_by(["dataset", "eval_split", "metric"]), key=lambda t: t[0]):
        a, b = g["backbone"].to_list(), [p[3:] for p in g["protocol"].to_list()]
        names = tuple(sorted(set(a) | set(b)))
        pos = {n: i for i, n in enumerate(names)}
        M = np.full((len(names), len(names)), np.nan)
        np.fill_diagonal(M, 1.0)
        for x, y, v in zip(a, b, g["value"].to_list(), strict=True):
            M[pos[x], pos[y]] = M[pos[y], pos[x]] = v
        text = _measure_text(g["hparams"].to_list()) if "hparams" in g.columns else ""
        out.append(SimilarityMatrix(str(ds), str(split), str(metric), names, M, text))
    return out


def similarity_heatmap(m: SimilarityMatrix, path: str | os.PathLike) -> Path:
    """``m`` as an annotated heatmap PNG at ``path`` (matplotlib Figure, no pyplot)."""
    from featcache.analysis import plots

    return plots.similarity_heatmap(m.backbones, m.values, path, title=m.title, label=m.metric)


def audit_table(frame: Any) -> Any:
    """One row per backbone, dataset and audited split of the ``kind="audit"`` rows: the
    fraction of rows flagged, kNN and 1-NN top-1 with and without them; None without rows."""
    import polars as pl

    if frame is None or "kind" not in frame.columns:
        return None
    au = frame.filter(pl.col("kind") == "audit")
    if not au.height:
        return None
    au = au.sort("created_at").unique(["backbone", "dataset", "eval_split", "metric"], keep="last")
    wide = au.pivot(on="metric", index=["backbone", "dataset", "eval_split"], values="value").sort(
        ["dataset", "eval_split", "backbone"]
    )
    if {"knn_top1", "knn_top1_clean"} <= set(wide.columns):
        wide = wide.with_columns((pl.col("knn_top1_clean") - pl.col("knn_top1")).alias("knn_top1_change"))
    return wide
