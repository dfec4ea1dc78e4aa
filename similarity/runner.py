"""``featcache similarity`` as a library call: every backbone pair's CKA and RSA on one split,
written as results rows (``kind="similarity"``, one row per pair and measure).

A row's ``backbone`` is the pair's first backbone, ``protocol`` is ``vs:<second>``, and its
hparams name both (``backbone_a``, ``backbone_b``) with the estimator used and the rows it saw.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.core.stagerun import Stage, collect, finished, pending, write_rows
from featcache.errors import DataError, UsageError
from featcache.similarity.align import align_ids
from featcache.similarity.config import SimilarityConfig
from featcache.similarity.layer_runner import layer_grid_rows
from featcache.similarity.registry import MEASURES, Budget, Measure
from featcache.similarity.streaming import paired_blocks, take_rows

if TYPE_CHECKING:
    import polars as pl

log = logging.getLogger(__name__)

__all__ = ["STAGE", "Budget", "compare", "run_similarity"]

#: the stage's identity for the shared run skeleton (not a sweep stage)
STAGE = Stage("similarity", "featcache.similarity:run_similarity")


def compare(X: Any, Y: Any, cfg: SimilarityConfig) -> dict[str, tuple[float, dict[str, Any]]]:
    """``{measure: (value, estimator details)}`` for aligned rows ``X`` and ``Y`` (arrays or
    lazy stored views), each measure of ``cfg.measures`` in the registry's order."""
    if X.shape[0] != Y.shape[0]:
        raise DataError(f"X has {X.shape[0]} rows and Y {Y.shape[0]}; align them by sample id first")
    budget = Budget(cfg.memory, int(X.shape[1]), int(Y.shape[1]))
    chosen = {m: MEASURES[m] for m in MEASURES if m in cfg.measures}
    out = _streamed({m: ms for m, ms in chosen.items() if ms.streams}, X, Y, cfg, budget)
    out.update({m: ms.fn(X, Y, cfg, budget) for m, ms in chosen.items() if not ms.streams})
    return {m: out[m] for m in chosen}


def _streamed(
    measures: dict[str, Measure], X: Any, Y: Any, cfg: SimilarityConfig, budget: Budget
) -> dict[str, tuple[float, dict[str, Any]]]:
    """The streaming ``measures`` from one pass over the row blocks: one accumulator per
    statistic, shared by the measures that name it."""
    if not measures:
        return {}
    factories = dict.fromkeys(ms.statistic for ms in measures.values() if ms.statistic is not None)
    stats: dict[Any, Any] = {make: make() for make in factories}
    n = 0
    for bx, by in paired_blocks(X, Y, budget.block_rows):
        for s in stats.values():
            s.update(bx, by)
        n += int(bx.shape[0])
    info = {"rows": n, "block_rows": budget.block_rows}
    return {m: (ms.fn(stats[ms.statistic], cfg), info) for m, ms in measures.items()}


def _backbones(cfg: SimilarityConfig, cache) -> list[str]:
    held = list(dict.fromkeys(b for b, d, s in cache.entries() if d == cfg.dataset and s == cfg.split))
    if not held:
        splits = sorted({s for _, d, s in cache.entries() if d == cfg.dataset})
        raise DataError(
            f"no backbone in {cfg.cache} holds split {cfg.split!r} of {cfg.dataset} (its splits: {splits}); "
            "pass --split with one of them"
        )
    if cfg.backbones is None:
        if len(held) < (1 if cfg.layers is not None else 2):
            raise DataError(
                f"{len(held)} backbone(s) in {cfg.cache} hold {cfg.dataset}/{cfg.split} ({held}); similarity "
                "compares pairs: extract a second backbone on that split first"
            )
        return held
    missing = [b for b in cfg.backbones if b not in held]
    if missing:
        raise DataError(
            f"backbone(s) {missing} hold no features of {cfg.dataset}/{cfg.split} in {cfg.cache} "
            f"(those that do: {held}); fix --backbones or run `featcache extract`"
        )
    return list(cfg.backbones)


def _vectors(cache, cfg: SimilarityConfig, b: str):
    """``b``'s rows of ``cfg.kind`` (lazy); an N-d kind (tokens, blocks) is refused naming the
    vector kinds the store holds for it."""
    f = cache.load(b, cfg.dataset, cfg.split, cfg.kind, lazy=True)
    if len(f.X.shape) == 2:
        return f
    vec = [
        k
        for k in cache.kinds(b, cfg.dataset, cfg.split)
        if len(cache.load(b, cfg.dataset, cfg.split, k, lazy=True).X.shape) == 2
    ]
    raise DataError(
        f"--kind {cfg.kind} holds [rows, {', '.join(map(str, f.X.shape[1:]))}] per image for {b}; similarity "
        f"compares one vector per image: pass --kind with one of its vector kinds {vec} (pool tokens at extract)"
    )


def _fingerprint(cache, cfg: SimilarityConfig, b: str) -> str:
    """``cache.load(...).fingerprint`` from the provenance record alone (no feature read)."""
    return cache.stored_fingerprint(b, cfg.dataset, cfg.split, cfg.kind)


def _run_ids(cfg: SimilarityConfig, a: str, b: str, fps: dict[str, str]) -> dict[str, str]:
    from featcache.core.results import make_run_id

    return {
        m: make_run_id(
            kind="similarity",
            backbone_a=a,
            backbone_b=b,
            dataset=cfg.dataset,
            split=cfg.split,
            metric=m,
            store=[fps[a], fps[b]],
            **cfg.hparams(m),
        )
        for m in cfg.measures
    }


def _aligned(fa, fb):
    """The two backbones' valid rows joined by sample id (lazy views stay lazy)."""
    ia, ib = align_ids(fa.ids, fb.ids, fa.backbone, fb.backbone)
    ok = np.asarray(fa.valid, bool)[ia] & np.asarray(fb.valid, bool)[ib]
    if not ok.all():
        log.warning(
            "%s vs %s: %d row(s) dropped (invalid in either: images that failed)",
            fa.backbone,
            fb.backbone,
            int((~ok).sum()),
        )
    ia, ib = ia[ok], ib[ok]
    return take_rows(fa.X, ia), take_rows(fb.X, ib)


def _pair_rows(cfg: SimilarityConfig, fa, fb, run_ids: dict[str, str]) -> list[dict[str, Any]]:
    from featcache.store import combine_fingerprints

    t0 = time.perf_counter()
    X, Y = _aligned(fa, fb)
    got = compare(X, Y, cfg)
    secs = time.perf_counter() - t0
    rows = []
    for m, (value, info) in got.items():
        if info.get("estimate"):
            log.warning("%s of %s vs %s is an estimate: %s", m, fa.backbone, fb.backbone, info["estimate"])
        rows.append(
            {
                "run_id": run_ids[m],
                "kind": "similarity",
                "backbone": fa.backbone,
                "dataset": cfg.dataset,
                "protocol": f"vs:{fb.backbone}",
                "eval_split": cfg.split,
                "metric": m,
                "value": float(value),
                "n_eval": int(X.shape[0]),
                "hparams": {
                    "backbone_a": fa.backbone,
                    "backbone_b": fb.backbone,
                    **cfg.hparams(m),
                    **info,
                    "measure_text": MEASURES[m].text,  # the report's name for it (analysis/ reads it here)
                },
                "fit_seconds": secs,
                "store_fingerprint": combine_fingerprints(fa.fingerprint, fb.fingerprint),
            }
        )
    return rows


def run_similarity(config: SimilarityConfig) -> pl.DataFrame:
    """Every pair of ``config``'s backbones compared on ``config.split``; the rows (polars),
    appended to ``config.results_path`` pair by pair when it is set. Pairs whose rows are
    all in the table are skipped unless ``config.force``. With ``config.layers``: the
    layer-by-layer CKA grids (:mod:`featcache.similarity.layer_runner`)."""
    from featcache.core.progress import tqdm
    from featcache.core.results import check_results_path
    from featcache.store import open_cache

    if not isinstance(config, SimilarityConfig):
        raise UsageError(f"run_similarity takes a SimilarityConfig, got {type(config).__name__}")
    cfg = config
    if cfg.results_path is not None:
        check_results_path(cfg.results_path)
    cache = open_cache(cfg.cache)
    backbones = _backbones(cfg, cache)
    if cfg.layers is not None:  # layer-by-layer CKA grids (issue 56)
        rows, wanted = layer_grid_rows(cfg, cache, backbones)
        return collect(STAGE, cfg.results_path, rows, wanted, append=False)
    fps = {b: _fingerprint(cache, cfg, b) for b in backbones}
    ids = {(a, b): _run_ids(cfg, a, b, fps) for a, b in itertools.combinations(backbones, 2)}
    done = finished(cfg.results_path, cfg.force)
    todo = pending(
        {p: list(r.values()) for p, r in ids.items()},
        done,
        lambda p: f"similarity {p[0]} vs {p[1]} on {cfg.dataset}/{cfg.split}",
        cfg.results_path,
        log,
    )
    feats: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for a, b in tqdm(todo, desc="similarity pairs", unit="pair", disable=not cfg.progress):
        for name in (a, b):
            if name not in feats:
                feats[name] = _vectors(cache, cfg, name)
        new = _pair_rows(cfg, feats[a], feats[b], ids[(a, b)])
        write_rows(cfg.results_path, new)
        rows += new
    wanted = [r for p in ids.values() for r in p.values()]
    return collect(STAGE, cfg.results_path, rows, wanted, append=False)
