"""``featcache dense`` as a library call: a dense protocol for each backbone and seed, one
results row per metric of the reported split (``kind="dense"``), in the results table every
stage writes (the one stage-run skeleton of :mod:`featcache.core.stagerun`).

A row's hparams record what the number depends on beyond its run id's fields: the groups
read (``train_groups``, the number of augmented ``views``), the split selected on
(``selected_on``) and its scores (``val_<metric>``), the training geometry, and the solver's
own choices (lr, iterations, how it evaluated: windows stitched or the resize rows).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from featcache.core.stagerun import Stage, collect, finished, pending, write_rows
from featcache.dense.config import DenseConfig
from featcache.dense.data import DenseSource, StoreSource, TaskPlan, build_task, plan_groups
from featcache.errors import DataError, UsageError

if TYPE_CHECKING:
    import polars as pl

    from featcache.core.protocols import Protocol

log = logging.getLogger(__name__)

__all__ = ["STAGE", "feature_kinds", "run_dense"]

#: the stage's identity for the shared run skeleton (registered in featcache.dense)
STAGE = Stage("dense", "featcache.dense:run_dense", "protocol")

_LAYER_TOKENS = re.compile(r"^layer(\d+)_tokens$")


def feature_kinds(protocol: Protocol, kind: str, stored: list[str]) -> tuple[str, ...]:
    """The kinds a protocol's head reads: ``kind`` alone, or (a grid with ``blocks`` > 1, DINOv2's
    "+ms" / "lin. 4") that many evenly spaced ``layer{i}_tokens`` kinds of those stored (of
    blocks 0..11: 2, 5, 8, 11, as DINOv2's ``get_intermediate_layers``; of 2, 5, 8, 11: all);
    a grid whose ``reads_cls`` is true (DINOv2's depth heads) also reads each block's class
    token (``tokens`` -> ``cls``, ``layer{i}_tokens`` -> ``layer{i}_cls``)."""
    kinds = _token_kinds(protocol, kind, stored)
    if not getattr(protocol.grid, "reads_cls", False):
        return kinds
    cls = tuple("cls" if k == "tokens" else k.removesuffix("_tokens") + "_cls" for k in kinds)
    missing = [k for k in cls if k not in stored]
    if missing:
        raise DataError(
            f"{protocol.spec} reads the class token of each block it reads; {', '.join(missing)} is not stored "
            f"(kinds: {sorted(stored)}): extract the blocks' class tokens beside their patch tokens"
        )
    return kinds + cls


def _token_kinds(protocol: Protocol, kind: str, stored: list[str]) -> tuple[str, ...]:
    n = int(getattr(protocol.grid, "blocks", 1))
    if n <= 1:
        if kind not in stored:
            raise DataError(f"--kind {kind} is not stored (kinds: {sorted(stored)}); extract it or pass --kind")
        return (kind,)
    layers = sorted(int(m[1]) for k in stored if (m := _LAYER_TOKENS.match(k)))
    if len(layers) < n:
        raise DataError(
            f"{protocol.spec} reads {n} blocks' tokens; the store holds {len(layers)} layer{{i}}_tokens kinds "
            f"({sorted(stored)}): extract with --layers naming {n} evenly spaced blocks (e.g. 2,5,8,11 of 12)"
        )
    picked = [layers[round((j + 1) * len(layers) / n) - 1] for j in range(n)]
    return tuple(f"layer{i}_tokens" for i in picked)


def _plan(source: DenseSource, cfg: DenseConfig, backbone: str) -> TaskPlan:
    where = f"{backbone}/{cfg.dataset} in {cfg.cache}"
    stored = source.splits(backbone, cfg.dataset)
    if not stored:
        raise DataError(
            f"no dense split of {cfg.dataset} for backbone {backbone} in {cfg.cache}; run featcache extract"
        )
    return plan_groups(stored, cfg.train_split, cfg.val_split, cfg.test_split, where)


def _fingerprint(source: DenseSource, cfg: DenseConfig, backbone: str, plan: TaskPlan, kind: str) -> str:
    from featcache.store import combine_fingerprints

    groups = [*plan.train_groups, plan.select_name or cfg.train_split, plan.eval_name]
    return combine_fingerprints(*(source.fingerprint(backbone, cfg.dataset, g, kind) for g in groups))


def _run_id(cfg: DenseConfig, protocol: Protocol, backbone: str, seed: int, plan: TaskPlan, fp: str) -> str:
    from dataclasses import asdict

    from featcache.core.results import make_run_id

    return make_run_id(
        kind="dense",
        backbone=backbone,
        dataset=cfg.dataset,
        protocol=protocol.spec,
        grid=asdict(protocol.grid),
        seed=seed,
        eval_split=plan.eval_split,
        selected_on=plan.selected_on,
        train_groups=plan.train_groups,
        store=fp,
        **cfg.run_options(),
    )


def _rows(cfg: DenseConfig, protocol: Protocol, backbone: str, seed: int, plan: TaskPlan, task, fit, rid: str, fp: str):
    """The result rows of one fitted run: one per metric of the reported split."""
    geometry = task.train[0].geometry.record() if task.train else {}
    hp: dict[str, Any] = {
        "feature_kinds": list(task.train[0].kinds) if task.train else [],
        "train_groups": plan.train_groups,
        "views": plan.views,
        "selected_on": plan.selected_on,
        "train_geometry": geometry,
        **{f"val_{m}": float(v) for m, v in fit.scores.get("val", {}).items()},
        **fit.hparams,
    }
    n_eval = len(task.test.rows)
    return [
        {
            "run_id": rid,
            "kind": "dense",
            "backbone": backbone,
            "dataset": cfg.dataset,
            "protocol": protocol.spec,
            "train_split": cfg.train_split if plan.select_name else f"{cfg.train_split}-holdout",
            "eval_split": plan.eval_split,
            "shots": -1,
            "seed": int(seed),
            "metric": m,
            "value": float(v),
            "n_eval": n_eval,
            "hparams": hp,
            "converged": True,
            "fit_seconds": float(fit.fit_seconds),
            "store_fingerprint": fp,
        }
        for m, v in fit.scores["test"].items()
    ]


def run_dense(config: DenseConfig, *, source: DenseSource | None = None) -> pl.DataFrame:
    """``config``'s dense protocol for every backbone and seed; the rows (polars), appended to
    ``config.results_path`` run by run. Runs already in the table are skipped unless
    ``config.force``. ``source``: where the groups come from (default: the store at
    ``config.cache``; an :class:`~featcache.dense.data.ArraySource` for arrays in memory)."""
    from featcache.core.progress import tqdm
    from featcache.core.results import check_results_path
    from featcache.dense.solvers import DENSE_SOLVERS

    if not isinstance(config, DenseConfig):
        raise UsageError(f"run_dense takes a DenseConfig, got {type(config).__name__}")
    cfg, protocol = config, config.get_protocol()
    if cfg.results_path is not None:
        check_results_path(cfg.results_path)
    if source is None:
        from featcache.store import open_cache

        source = StoreSource(open_cache(cfg.cache))
    plans = {b: _plan(source, cfg, b) for b in cfg.backbones}
    kinds = {b: feature_kinds(protocol, cfg.kind, source.kinds(b, cfg.dataset, plans[b].eval_name)) for b in plans}
    fps = {b: _fingerprint(source, cfg, b, plans[b], kinds[b][0]) for b in plans}
    ids = {(b, s): _run_id(cfg, protocol, b, s, plans[b], fps[b]) for b in cfg.backbones for s in cfg.seeds}
    todo = pending(
        {k: [r] for k, r in ids.items()},
        finished(cfg.results_path, cfg.force),
        lambda k: f"{protocol.spec} {k[0]} on {cfg.dataset} seed {k[1]}",
        cfg.results_path,
        log,
    )
    solver = DENSE_SOLVERS.resolve(protocol.solver)
    rows: list[dict[str, Any]] = []
    for b, seed in tqdm(todo, desc=f"dense {protocol.spec}", unit="run", disable=not cfg.progress):
        task = build_task(source, b, cfg.dataset, kinds[b], plans[b], seed, cfg)
        fit = solver(task, protocol, cfg, seed)
        new = _rows(cfg, protocol, b, seed, plans[b], task, fit, ids[(b, seed)], fps[b])
        write_rows(cfg.results_path, new)
        rows += new
        log.info("%s %s seed %d: %s", protocol.spec, b, seed, {m: round(v, 4) for m, v in fit.scores["test"].items()})
    return collect(STAGE, cfg.results_path, rows, list(ids.values()), protocol=protocol, append=False)
