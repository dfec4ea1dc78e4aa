"""The evaluation grid on Dask: ``featcache sweep`` plans (backbones x datasets x protocols x
seeds, plus retrieval setups and fine-tunes) from the store catalog into idempotent work items,
each carrying its stage's own config and keyed by the stage's run ids, and runs them on
``dask.distributed`` (an in-process LocalCluster by default, or an existing scheduler).

>>> from featcache.sweep import SweepConfig, plan, run_sweep
>>> report = run_sweep(SweepConfig(cache="cache.zarr", results_path="results.parquet",
...                                protocols=("full", "fewshot:5")))  # doctest: +SKIP
"""

from __future__ import annotations

from featcache.sweep.executor import ItemOutcome, SweepReport, execute, run_item, run_sweep
from featcache.sweep.planner import Plan, SweepConfig, WorkItem, plan

__all__ = ["ItemOutcome", "Plan", "SweepConfig", "SweepReport", "WorkItem", "execute", "plan", "run_item", "run_sweep"]
