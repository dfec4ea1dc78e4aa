"""Each task's declared metric (issue 12 item 6): result rows record the metric a probe
selected its hyper-parameters on as ``hparams["task_metric"]``; ranking a task on it means
keeping, per run, the row whose ``metric`` is that one.

:func:`declared_metric_rows` does this on a results table (retrieval rows pass through); call
it before :func:`featcache.analysis.rankings.select_settings` with ``metric=TASK`` to rank
every (dataset, protocol) setting on its own declared metric (top-1 for Fashion-MNIST,
mean-per-class for Aircraft, 11-point mAP for VOC 2007, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from featcache.errors import ResultsError

if TYPE_CHECKING:
    import polars as pl

__all__ = ["TASK", "declared_metric_rows"]

#: the metric label of rows chosen by their task's declared metric
TASK = "task"


def declared_metric_rows(frame: pl.DataFrame, *, default: str = "top1", relabel: bool = True) -> pl.DataFrame:
    """Rows of each run's declared metric (``hparams["task_metric"]``; rows written before
    per-task metrics, e.g. fine-tune or kNN rows, count as ``default``). ``relabel``: the
    kept rows' ``metric`` becomes :data:`TASK` and the declared name moves to ``task_metric``."""
    import polars as pl

    missing = [c for c in ("kind", "metric", "hparams", "run_id") if c not in frame.columns]
    if missing:
        raise ResultsError(f"results table lacks column(s) {missing}; pass a featcache results table")
    declared = pl.col("hparams").str.json_path_match("$.task_metric").fill_null(default)
    is_ret = pl.col("kind") == "retrieval"
    out = frame.with_columns(declared.alias("task_metric")).filter(is_ret | (pl.col("metric") == pl.col("task_metric")))
    lost = set(frame.filter(~is_ret)["run_id"].to_list()) - set(out["run_id"].to_list())
    if lost:
        raise ResultsError(
            f"{len(lost)} run(s) have no row of their declared metric (e.g. {sorted(lost)[0]!r}); "
            "re-run them without --metrics, which restricts the metrics written"
        )
    if relabel:
        out = out.with_columns(pl.when(is_ret).then(pl.col("metric")).otherwise(pl.lit(TASK)).alias("metric"))
    return out
