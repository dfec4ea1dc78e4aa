"""The analysis' inputs, read once: :func:`load_results` reads a featcache results table and any
external tables (each file once), resolves the ranked metric and merges them into a
:class:`LoadedResults` that :func:`~featcache.analysis.api.rank`,
:func:`~featcache.analysis.api.shift` and :func:`~featcache.analysis.report.write_report` take.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcache.analysis.tables import Coverage, load_table, merge_tables
from featcache.errors import ResultsError

__all__ = [
    "RETRIEVAL_METRIC_TEXT",
    "LoadedResults",
    "declares_metrics",
    "load_results",
    "resolve_metric",
    "resolve_retrieval_metric",
    "retrieval_metric_list",
    "retrieval_metric_text",
    "split_retrieval_metrics",
    "with_declared_rows",
]

if TYPE_CHECKING:
    import polars as pl

    from featcache.analysis.tables import TableLike


@dataclass(frozen=True)
class LoadedResults:
    """Merged analysis rows (:func:`~featcache.analysis.tables.merge_tables`: ``task`` and
    ``setting`` columns) for one ranked ``metric``, with the coverage report and what they were
    loaded from. ``metric`` is resolved: ``task`` (each run's declared metric, whose rows are
    added relabelled ``task``) or the metric named."""

    rows: Any  # polars DataFrame
    coverage: Coverage
    metric: str
    #: the featcache results table as read (hparams kept), or None, and its rows' source name
    results: Any = None
    results_source: str = "results"
    #: the external tables as loaded (analysis schema), with their source names
    external: tuple[Any, ...] = ()
    groups: Mapping[str, str] | None = None
    percent: bool | None = None
    external_kind: str | None = None

    @property
    def declares(self) -> bool:
        """Whether the featcache results record ``hparams.task_metric``."""
        return declares_metrics(self.results)

    def for_metric(self, metric: str) -> LoadedResults:
        """The same inputs merged for ``metric`` (no file is read again); ``self`` when equal."""
        metric = resolve_metric(metric, self.results)
        if metric == self.metric:
            return self
        return _merged(
            self.results, self.results_source, self.external, metric, self.groups, self.percent, self.external_kind
        )


def declares_metrics(results: TableLike | LoadedResults | None) -> bool:
    """Whether a featcache results table (path or DataFrame) records ``hparams.task_metric``."""
    import polars as pl

    if results is None:
        return False
    if isinstance(results, LoadedResults):
        results = results.results
    if isinstance(results, (str, os.PathLike)):
        results = _read_results(results)
    if not isinstance(results, pl.DataFrame) or "hparams" not in results.columns:
        return False
    return bool(results["hparams"].cast(pl.Utf8).str.json_path_match("$.task_metric").is_not_null().any())


def resolve_metric(metric: str, results: TableLike | LoadedResults | None) -> str:
    """``auto``: ``task`` (each task on its declared metric) when the results record
    ``hparams.task_metric``, else ``top1``; any other metric as given."""
    if metric != "auto":
        return metric
    from featcache.analysis.task_metric import TASK

    return TASK if declares_metrics(results) else "top1"


#: what each retrieval AP is, as the report names it
RETRIEVAL_METRIC_TEXT = {
    "map_bob": "map_bob: Battle of the Backbones' mAP (revisitop's trapezoidal AP, bob-retrieval's compute_map)",
    "map": "map: scikit-learn-style AP (mean precision at each relevant item)",
}


def resolve_retrieval_metric(metric: str, rows: pl.DataFrame) -> tuple[str, str | None]:
    """``auto``: ``map_bob`` (Battle of the Backbones' definition, written by ``featcache
    retrieve``) when every retrieval setting of ``rows`` records it, else ``map`` (the
    scikit-learn-style AP) with a note saying why; any other metric as given (no note)."""
    import polars as pl

    if metric != "auto":
        return metric, None
    ret = rows.filter(pl.col("kind") == "retrieval")
    if ret.height == 0:
        return "map", None
    have = set(ret.filter(pl.col("metric") == "map_bob")["setting"].to_list())
    lacking = sorted(set(ret["setting"].to_list()) - have)
    if not lacking:
        return "map_bob", None
    return "map", (
        f"retrieval ranked on map (scikit-learn-style AP), not Battle of the Backbones' map_bob: "
        f"{', '.join(lacking)} record no map_bob (re-run featcache retrieve without --top-k-only)"
    )


def retrieval_metric_list(metric: str) -> list[str]:
    """The metrics of a ``--retrieval-metric`` value (``map_bob,mrr_bob,recall@5``: three)."""
    return [m.strip() for m in metric.split(",") if m.strip()]


def retrieval_metric_text(metric: str) -> str:
    """How the report names the retrieval metric(s) ranked on."""
    names = retrieval_metric_list(metric)
    if len(names) <= 1:
        return RETRIEVAL_METRIC_TEXT.get(metric, metric)
    return (
        f"{len(names)} metrics, each (dataset, metric) z-scored as its own setting, then averaged "
        f"with the other settings: {'; '.join(RETRIEVAL_METRIC_TEXT.get(m, m) for m in names)}"
    )


def split_retrieval_metrics(rows: pl.DataFrame, metric: str) -> tuple[pl.DataFrame, str | None]:
    """Several retrieval metrics (``map_bob,mrr_bob,recall@5``) ranked at once, as Battle of
    the Backbones' ranking treats a task and metric: each retrieval setting and metric becomes
    its own setting (``retrieval:digits [mrr_bob]``), z-scored on its own like any setting, so
    the mean z-score averages over (dataset, metric) pairs. Those rows' ``metric`` becomes
    ``metric`` (the list as given), the name the ranking selects. One metric: ``rows`` as they
    are. Returns ``(rows, note)``; a metric no retrieval row holds is refused."""
    import polars as pl

    names = retrieval_metric_list(metric)
    if len(names) <= 1:
        return rows, None
    if len(set(names)) != len(names):
        raise ResultsError(f"--retrieval-metric {metric!r} names a metric twice")
    ret = pl.col("kind") == "retrieval"
    held = set(rows.filter(ret)["metric"].to_list())
    missing = [m for m in names if m not in held]
    if missing:
        raise ResultsError(
            f"no retrieval rows with metric(s) {missing}; those rows hold {sorted(held)} "
            "(choose with --retrieval-metric, comma-separated)"
        )
    picked = rows.filter(ret & pl.col("metric").is_in(names)).with_columns(
        (pl.col("setting") + " [" + pl.col("metric") + "]").alias("setting"), pl.lit(metric).alias("metric")
    )
    out = pl.concat([rows.filter(~ret), picked], how="vertical_relaxed")
    note = (
        f"retrieval ranked on {len(names)} metrics ({', '.join(names)}): each (dataset, metric) is "
        "one setting, z-scored on its own, then averaged with the other settings"
    )
    return out, note


def with_declared_rows(frame: pl.DataFrame, *, external: bool = False) -> pl.DataFrame:
    """``frame`` plus, per run, a copy of its declared-metric row with ``metric="task"``
    (:func:`~featcache.analysis.task_metric.declared_metric_rows`; ``external`` tables and
    tables without hparams declare top-1). The original rows stay (calibration reads ece/nll)."""
    import polars as pl

    from featcache.analysis.task_metric import TASK, declared_metric_rows

    if (frame["metric"] == TASK).any():  # already chosen (declared_metric_rows by the caller)
        return frame
    if not external and "hparams" in frame.columns and "run_id" in frame.columns:
        rows = declared_metric_rows(frame).drop("task_metric")
    else:
        rows = frame.filter((pl.col("metric") == "top1") & (pl.col("kind") != "retrieval"))
        rows = rows.with_columns(pl.lit(TASK).alias("metric"))
    return pl.concat([frame, rows.filter(pl.col("kind") != "retrieval")], how="vertical_relaxed")


def load_results(
    results: TableLike | LoadedResults | None = None,
    external: Sequence = (),
    *,
    metric: str = "auto",
    percent: bool | None = None,
    external_kind: str | None = None,
    groups: Mapping[str, str] | None = None,
) -> LoadedResults:
    """Read ``results`` (a featcache results parquet or DataFrame) and ``external`` tables
    (paths or DataFrames; ``percent``/``external_kind`` apply to them) once and merge them for
    ``metric`` (``auto``: declared metrics where the results record them, else top-1)."""
    if isinstance(results, LoadedResults):
        return results.for_metric(metric)
    import polars as pl

    frame, source = results, "results"
    if isinstance(results, (str, os.PathLike)):
        frame, source = _read_results(results), Path(results).name
    elif results is not None and not isinstance(results, pl.DataFrame):
        raise ResultsError(f"results must be a path or a polars DataFrame, got {type(results).__name__}")
    ext = []
    for i, e in enumerate(external or []):
        src = Path(e).name if isinstance(e, (str, os.PathLike)) else f"external[{i}]"
        ext.append(load_table(e, source=src, kind=external_kind, percent=percent, groups=groups))
    if frame is None and not ext:
        raise ResultsError("nothing to analyse: pass a results table and/or --external tables")
    return _merged(frame, source, tuple(ext), resolve_metric(metric, frame), groups, percent, external_kind)


def _scores_only(frame):
    """The rows that score a backbone on a task: similarity and audit rows
    (:data:`~featcache.core.results.NON_SCORE_KINDS`) are read by their own report sections, and
    so are a layer sweep's curve rows (:mod:`featcache.analysis.depth`; its selected layer's
    rows are the backbone's score)."""
    import polars as pl

    from featcache.analysis.depth import curve_rows
    from featcache.core.results import NON_SCORE_KINDS

    if "kind" not in frame.columns:
        return frame
    if "hparams" in frame.columns:
        frame = frame.filter(~curve_rows())
    return frame.filter(~pl.col("kind").is_in(list(NON_SCORE_KINDS)))


def _read_results(path):
    from featcache.core.results import read_results

    return read_results(path)


def _merged(results, source, external, metric, groups, percent, external_kind) -> LoadedResults:
    from featcache.analysis.task_metric import TASK

    declared = metric == TASK
    tables = []
    if results is not None:
        f = _scores_only(results)
        f = with_declared_rows(f) if declared else f
        tables += _tables_by_source(f, source, groups)
    tables += [with_declared_rows(t, external=True) if declared else t for t in external]
    rows, coverage = merge_tables(tables)
    return LoadedResults(rows, coverage, metric, results, source, tuple(external), groups, percent, external_kind)


def _tables_by_source(frame, source: str, groups) -> list:
    """The results table's rows as analysis tables: featcache's own under ``source``, and the
    rows ``featcache import`` added (``hparams.external.source``) each under their file's name
    with `` (external)``, so rank and report name where a published number came from."""
    import polars as pl

    if "hparams" not in frame.columns:
        return [load_table(frame, source=source, groups=groups)]
    hp = pl.col("hparams").cast(pl.Utf8)
    ext = frame.with_columns(hp.str.json_path_match("$.external.source").alias("_ext"))
    own = ext.filter(pl.col("_ext").is_null()).drop("_ext")
    if "run_id" in frame.columns:  # a run exported and imported back is the run itself: counted once
        again = hp.str.json_path_match("$.external.run_id").is_in(own["run_id"].unique().to_list())
        ext = ext.filter(~(pl.col("_ext").is_not_null() & again.fill_null(False)))
    names = ext["_ext"].drop_nulls().unique(maintain_order=True).to_list()
    out = [load_table(own, source=source, groups=groups)] if own.height or not names else []
    for name in names:
        rows = ext.filter(pl.col("_ext") == name).drop("_ext")
        out.append(load_table(rows, source=f"{name} (external)", groups=groups))
    return out
