"""Plan a sweep: expand backbones x datasets x protocols x seeds (+ retrieval setups) from
the store catalog into small, frozen, idempotent work items.

An item carries the arguments of ONE probe or retrieval run and the store path or URL, never
arrays. Its ``run_id`` hashes those arguments with the provenance fingerprints of the
features it reads, so it changes when the features change. A finished item leaves a marker
``<run_id>.json`` (listing the result run ids it produced) in the ledger folder
``<results>.sweep-done/``; the planner skips an item whose marker exists and whose result
rows are all still in the results table. Items without a marker (e.g. runs written by a plain
``featcache probe``) are dispatched, and the stage itself skips runs already in the results.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from featcache.errors import SweepError

log = logging.getLogger(__name__)

KINDS = ("probe", "retrieval")


@dataclass(frozen=True)
class SweepConfig:
    """What to sweep and where. Empty ``backbones``/``datasets`` mean "all in the store".
    ``protocols`` are probe protocol specs (``full``, ``fewshot:5``, ...); ``seeds=None`` uses
    each protocol's default seeds. ``retrieval`` adds one retrieval (+ k-NN) run per
    (backbone, dataset). ``scheduler``: address of a running Dask scheduler (default:
    ``DASK_SCHEDULER_ADDRESS``, else an in-process LocalCluster of ``workers`` processes;
    ``workers=0`` runs the items one by one in this process, without Dask);
    ``connect_timeout``: seconds to wait for that scheduler."""

    cache: str
    results: str
    backbones: tuple[str, ...] = ()
    datasets: tuple[str, ...] = ()
    protocols: tuple[str, ...] = ("full",)
    seeds: tuple[int, ...] | None = None
    retrieval: bool = False
    scheduler: str | None = None
    workers: int = 2
    force: bool = False
    train_split: str = "train"
    eval_split: str = "test"
    gallery_split: str = "train"
    feature_kind: str = "pooled"
    connect_timeout: float = 30.0

    def __post_init__(self):
        for name in ("backbones", "datasets", "protocols"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.seeds is not None:
            object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
            if not self.seeds:
                raise SweepError("seeds is empty; give at least one seed, e.g. --seeds 0,1,2")
        if self.workers < 0:
            raise SweepError(f"workers must be >= 0 (0: run in this process), got {self.workers}")
        if not self.protocols and not self.retrieval:
            raise SweepError("nothing to sweep: give --protocol P and/or --retrieval")


@dataclass(frozen=True)
class WorkItem:
    """One probe run (one backbone, dataset, protocol, seed) or one retrieval run."""

    kind: str
    run_id: str
    cache: str
    results: str
    backbone: str
    dataset: str
    protocol: str
    seed: int
    train_split: str
    eval_split: str
    feature_kind: str = "pooled"
    force: bool = False

    @property
    def label(self) -> str:
        extra = f" seed {self.seed}" if self.kind == "probe" else f" {self.eval_split}->{self.train_split}"
        return f"{self.kind} {self.backbone}/{self.dataset} {self.protocol}{extra}"


@dataclass(frozen=True)
class Plan:
    """Items to run, items skipped as already done, and requested cells the store lacks."""

    items: tuple[WorkItem, ...]
    done: tuple[WorkItem, ...] = ()
    not_in_store: tuple[str, ...] = field(default=())


def ledger_dir(results: str | os.PathLike) -> Path:
    """Folder of the markers of finished items, beside the results table."""
    p = Path(results)
    return p.parent / f"{p.name}.sweep-done"


def default_seeds(protocol: str) -> tuple[int, ...]:
    """Seeds a probe protocol runs by default (from the protocol registry)."""
    from featcache.protocols import get_protocol

    return tuple(get_protocol(protocol).seeds)


def _select(requested: Sequence[str], present: Sequence[str], what: str) -> list[str]:
    if not requested:
        return sorted(present)
    unknown = [r for r in requested if r not in present]
    if unknown:
        raise SweepError(f"{what} {unknown} not in the store; it holds {sorted(present)} "
                         "(run `featcache ls` to see the catalog)")
    return list(dict.fromkeys(requested))


def _fingerprints(cache, backbone: str, dataset: str, splits: Sequence[str], kind: str) -> list[str]:
    """Hashes of the provenance records of the features an item reads (they change when the
    features are re-extracted or the split's rows change)."""
    from featcache.results import make_run_id

    return [make_run_id(**cache.provenance(backbone, dataset, s, kind).to_attrs()) for s in splits]


def produced_run_ids(item: WorkItem) -> list[str]:
    """Result run ids a finished item recorded in its marker ([] without a readable marker)."""
    try:
        return list(json.loads((ledger_dir(item.results) / f"{item.run_id}.json").read_text())["result_run_ids"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _is_done(item: WorkItem, result_ids: set[str]) -> bool:
    produced = [] if item.force else produced_run_ids(item)
    return bool(produced) and set(produced) <= result_ids


def plan(config: SweepConfig) -> Plan:
    """Expand ``config`` against the store catalog into work items (see the module doc)."""
    from featcache.protocols import parse_protocol
    from featcache.results import existing_run_ids, make_run_id
    from featcache.store import open_cache

    for p in config.protocols:
        parse_protocol(p)  # an unknown protocol fails here, before anything runs
    cache = open_cache(config.cache)
    entries = set(cache.entries())
    datasets = _select(config.datasets, sorted({d for _, d, _ in entries}), "dataset(s)")
    backbones = _select(config.backbones, sorted({b for b, _, _ in entries}), "backbone(s)")
    result_ids = existing_run_ids(config.results)
    items: list[WorkItem] = []
    lacking: list[str] = []
    setups = [("probe", p, s, config.train_split) for p in config.protocols
              for s in (config.seeds or default_seeds(p))]
    if config.retrieval:
        setups.append(("retrieval", "semantic", 0, config.gallery_split))
    for d in datasets:
        for b in backbones:
            for kind, proto, seed, train in setups:
                splits = [config.eval_split] + ([] if train == "same" else [train])
                if not all((b, d, s) in entries for s in splits):
                    lacking.append(f"{b}/{d} ({'+'.join(splits)})")
                    continue
                fps = _fingerprints(cache, b, d, splits, config.feature_kind)
                rid = make_run_id(kind=f"sweep-{kind}", backbone=b, dataset=d, protocol=proto,
                                  seed=seed, train_split=train, eval_split=config.eval_split,
                                  feature_kind=config.feature_kind, features=fps)
                items.append(WorkItem(kind, rid, str(config.cache), str(config.results), b, d, proto,
                                      seed, train, config.eval_split, config.feature_kind, config.force))
    done = tuple(i for i in items if _is_done(i, result_ids))
    todo = tuple(i for i in items if i not in done)
    lacking = list(dict.fromkeys(lacking))
    if config.backbones and config.datasets and lacking:
        log.warning("the store lacks %d requested cell(s): %s", len(lacking), ", ".join(lacking[:10]))
    log.info("sweep plan: %d item(s) to run, %d already done", len(todo), len(done))
    return Plan(todo, done, tuple(lacking))
