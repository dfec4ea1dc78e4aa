"""``featcache sweep --track``: one parent run for the sweep, each item's runs nested under it.

The sweep's own process does the tracking, not its Dask workers: as each item's outcome comes
back it reads that item's rows from the results table (written by the worker, always first) and
logs them under the parent run. So a worker needs no route to the tracker, a local SQLite
tracking store has one writer, and a tracker that goes away mid-sweep costs one warning line for
the whole sweep (:class:`~featcache.core.tracking.Tracking` stops after its first failure)
rather than one per worker, and never a row. The parent's id is a run id of the sweep's items
(those to run and those already done), so running the same sweep again updates the same parent.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from typing import Any

from featcache.core.tracking import TrackedRun, Tracking, config_params, runs_of_rows
from featcache.sweep.planner import Plan, SweepConfig, WorkItem

__all__ = ["SweepTracking"]


def _parent_run(config: SweepConfig, p: Plan, outcomes: Iterable[Any] = ()) -> TrackedRun:
    """The sweep's own run: its config, the plan (and, once finished, how many items ran)."""
    from featcache.core.results import make_run_id

    items = sorted(i.run_id for i in (*p.items, *p.done))
    run_id = make_run_id(kind="sweep", cache=str(config.cache), results=str(config.results_path), items=items)
    cfg = config_params(config)
    plan_md = "# sweep plan\n\n" + "".join(f"- run  {i.run_id}  {i.label}\n" for i in p.items)
    plan_md += "".join(f"- done {i.run_id}  {i.label}\n" for i in p.done)
    outcomes = list(outcomes)
    metrics = {"items": float(len(items))}
    if outcomes:
        for status in ("ran", "skipped", "failed"):
            metrics[f"items_{status}"] = float(sum(o.status == status for o in outcomes))
    files = {"config.json": json.dumps(cfg, indent=1, sort_keys=True), "plan.md": plan_md}
    params = {f"config.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in cfg.items()}
    name = f"sweep {len(items)} items -> {config.results_path}"
    return TrackedRun(run_id, "sweep", name, params, metrics, files, {"featcache.kind": "sweep"})


class SweepTracking:
    """A sweep's tracking: the parent run (logged when made), then :meth:`item` per outcome,
    :meth:`medians` for the median rows and :meth:`finish` with the outcomes."""

    def __init__(self, tracking: Tracking, config: SweepConfig, p: Plan) -> None:
        self.tracking, self.config, self.plan = tracking, config, p
        self.by_id: dict[str, WorkItem] = {i.run_id: i for i in (*p.items, *p.done)}
        ids = tracking.log([_parent_run(config, p)])
        self.parent: str | None = ids[0] if ids else None

    def _rows(self, run_ids: Iterable[str]) -> Any:
        import polars as pl

        from featcache.core.results import read_results

        table: Any = read_results(self.config.results_path)  # polars (the default backend)
        return table.filter(pl.col("run_id").is_in(sorted(run_ids)))

    def _log_item(self, item: WorkItem, run_ids: Iterable[str]) -> None:
        ids = tuple(run_ids)
        if ids and self.parent is not None:
            self.tracking.log(lambda: runs_of_rows(item.kind, self._rows(ids), item.config), self.parent)

    def item(self, outcome: Any) -> None:
        """Log the runs of one finished item (a failed item has none)."""
        if outcome.status != "failed" and outcome.run_id in self.by_id:
            self._log_item(self.by_id[outcome.run_id], outcome.result_run_ids)

    def done_items(self) -> None:
        """Log the runs of the items already in the results (their tracked runs updated)."""
        for item in self.plan.done:
            self._log_item(item, item.run_ids)

    def medians(self, frames: Iterable[tuple[str, Any]]) -> None:
        """Log the median-over-seeds rows (``seed=-1``) of each ``(stage, frame)``."""
        for kind, frame in frames:
            if self.parent is not None:
                medians = frame.filter(frame["seed"] < 0)
                self.tracking.log(functools.partial(runs_of_rows, kind, medians), self.parent)

    def finish(self, outcomes: Iterable[Any]) -> None:
        """Log the parent run again with how many items ran, were skipped or failed."""
        if self.parent is not None:
            self.tracking.log([_parent_run(self.config, self.plan, outcomes)])
