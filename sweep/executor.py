"""Run planned work items on ``dask.distributed`` (or in this process with ``workers=0``).

Each item runs on a worker that reads its features from the store itself and appends its
rows to the results table (:func:`featcache.core.results.append_results` is safe for concurrent
writers). A failing item is reported with its run id; the others go on.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from featcache.errors import SweepError
from featcache.sweep.planner import Plan, SweepConfig, WorkItem, plan

if TYPE_CHECKING:
    from featcache.core.tracking import Tracking

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ItemOutcome:
    """What became of one item: ``status`` is ``ran``, ``skipped`` (the stage found every run
    already in the results) or ``failed`` (``error`` says why)."""

    run_id: str
    label: str
    status: str
    result_run_ids: tuple[str, ...] = ()
    seconds: float = 0.0
    host: str = ""
    error: str = ""


@dataclass(frozen=True)
class SweepReport:
    plan: Plan
    outcomes: tuple[ItemOutcome, ...]

    @property
    def failed(self) -> tuple[ItemOutcome, ...]:
        return tuple(o for o in self.outcomes if o.status == "failed")

    def summary(self) -> str:
        n = {s: sum(o.status == s for o in self.outcomes) for s in ("ran", "skipped", "failed")}
        return (
            f"{len(self.plan.items) + len(self.plan.done)} item(s): {n['ran']} ran, "
            f"{len(self.plan.done) + n['skipped']} already done, {n['failed']} failed"
        )


def call_stage(item: WorkItem):
    """The one adapter from a work item to its stage's public entry point (a lookup in
    :data:`featcache.core.stagerun.STAGES`), called with the item's own config; returns the rows
    of the run (polars DataFrame in the results schema), which the stage appends to the
    results."""
    from featcache.core.stagerun import get_stage

    return get_stage(item.kind).run(item.config)


def finish_medians(results: str, produced: list[tuple[WorkItem, list[str]]]) -> list[tuple[str, Any]]:
    """After every seed is in: the median-over-seeds rows (``seed=-1``) each stage adds when
    it runs its seeds together (:meth:`featcache.core.stagerun.Stage.wants_medians`: the VTAB
    protocols' probes, fine-tuning with two or more seeds), with the same carried hparams;
    ``(stage, its seed and median rows)`` per stage that has any."""
    from featcache.core.stagerun import STAGES, get_stage, medians_from_table

    ids: dict[str, set[str]] = {}
    for it, rs in produced:
        if get_stage(it.kind).wants_medians(it.protocol):
            ids.setdefault(it.kind, set()).update(rs)
    return [(kind, medians_from_table(results, kind, ids[kind])) for kind in STAGES if ids.get(kind)]


def run_item(item: WorkItem) -> ItemOutcome:
    """Run one item (on a Dask worker or here); never raises: a failure becomes an outcome."""
    from featcache.core.results import existing_run_ids

    t0 = time.perf_counter()
    host = f"{socket.gethostname()}:{os.getpid()}"
    try:
        before = set() if getattr(item.config, "force", False) else existing_run_ids(item.results)
        rows = call_stage(item)
        ids = sorted(set(rows.filter(rows["seed"] >= 0)["run_id"].to_list()))
        status = "skipped" if ids and set(ids) <= before else "ran"
        return ItemOutcome(item.run_id, item.label, status, tuple(ids), time.perf_counter() - t0, host)
    except Exception as exc:
        log.debug("item %s failed:\n%s", item.run_id, traceback.format_exc())
        return ItemOutcome(
            item.run_id, item.label, "failed", (), time.perf_counter() - t0, host, f"{type(exc).__name__}: {exc}"
        )


def _client(config: SweepConfig):
    """A dask.distributed Client and the LocalCluster it owns (None for an external one)."""
    from dask.distributed import Client, LocalCluster

    address = config.scheduler or os.environ.get("DASK_SCHEDULER_ADDRESS")
    if address:
        try:
            return Client(address, timeout=f"{config.connect_timeout}s"), None
        except (OSError, TimeoutError) as exc:
            raise SweepError(
                f"no Dask scheduler answers at {address} ({exc}); start one with "
                "`dask scheduler` + `dask worker ADDRESS`, or drop --scheduler to use "
                "a local cluster"
            ) from exc
    cluster = LocalCluster(
        n_workers=config.workers,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,  # pyright: ignore[reportArgumentType] (dask documents None: no dashboard; its stub says str)
    )
    return Client(cluster), cluster


def execute(
    items: Iterable[WorkItem],
    config: SweepConfig,
    *,
    progress: bool = True,
    on_done: Callable[[ItemOutcome], None] | None = None,
) -> list[ItemOutcome]:
    """Run ``items``; returns one outcome per item (in completion order), each also given to
    ``on_done`` as it arrives (the sweep's tracking)."""
    from featcache.core.progress import tqdm

    items = list(items)
    if not items:
        return []
    bar = tqdm(total=len(items), desc="sweep", disable=not progress)
    outcomes: list[ItemOutcome] = []

    def done(o: ItemOutcome) -> None:
        if o.status == "failed":
            log.error("item %s (%s) failed: %s", o.run_id, o.label, o.error)
        outcomes.append(o)
        if on_done is not None:
            on_done(o)
        bar.update()

    try:
        if config.workers == 0 and not (config.scheduler or os.environ.get("DASK_SCHEDULER_ADDRESS")):
            for it in items:
                done(run_item(it))
            return outcomes
        from dask.distributed import as_completed

        client, cluster = _client(config)
        try:
            futures = client.map(run_item, items, key=[f"sweep-{i.run_id}" for i in items], pure=False, retries=0)
            by_key = {f.key: it for f, it in zip(futures, items)}
            for fut in as_completed(futures):
                try:
                    done(fut.result())
                except Exception as exc:
                    it = by_key[fut.key]
                    done(ItemOutcome(it.run_id, it.label, "failed", error=f"{type(exc).__name__}: {exc}"))
        finally:
            client.close()
            if cluster is not None:
                cluster.close()
    finally:
        bar.close()
    return outcomes


def run_sweep(config: SweepConfig, *, progress: bool = True, tracking: Tracking | None = None) -> SweepReport:
    """Check the results path, plan, and run what is missing; with ``tracking`` (``--track``),
    each item's runs are logged as it finishes, nested under a parent run of the sweep
    (:mod:`featcache.sweep.tracking`)."""
    from featcache.core.results import check_results_path

    check_results_path(config.results_path)
    p = plan(config)
    tracked = None
    if tracking is not None:
        from featcache.sweep.tracking import SweepTracking

        tracked = SweepTracking(tracking, config, p)
        tracked.done_items()
    outcomes = execute(p.items, config, progress=progress, on_done=tracked.item if tracked else None)
    ok = {o.run_id: list(o.result_run_ids) for o in outcomes if o.status != "failed"}
    if any(i.run_id in ok for i in p.items):
        produced = [(i, ok[i.run_id]) for i in p.items if i.run_id in ok]
        produced += [(i, list(i.run_ids)) for i in p.done]
        medians = finish_medians(config.results_path, produced)
        if tracked is not None:
            tracked.medians(medians)
    if tracked is not None:
        tracked.finish(outcomes)
    report = SweepReport(p, tuple(outcomes))
    log.info("sweep: %s", report.summary())
    return report
