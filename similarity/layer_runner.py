"""``featcache similarity --layers``: layer-by-layer CKA grids written as results rows
(:func:`~featcache.similarity.runner.run_similarity` with ``layers`` set runs them).

For every backbone ``a`` with itself and every pair ``(a, b)``: linear and debiased CKA (and
minibatch CKA with ``--minibatch``) between each stored layer kind of ``a`` and each of ``b``
(:mod:`featcache.similarity.layers`), rows joined by sample id. One results row per layer pair
and measure: ``kind="similarity"``, ``backbone`` ``a``, ``protocol`` ``layers:vs:<b>``, the
layers in the hparams (``layer_a``, ``layer_b``, ``kind_a``, ``kind_b``) with the route the
sums took (``gram`` or ``features``) and the rows seen.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.core.layers import select_layers
from featcache.core.stagerun import finished, pending, write_rows
from featcache.errors import ConfigError, DataError
from featcache.similarity.align import align_ids
from featcache.similarity.config import SimilarityConfig
from featcache.similarity.layers import choose_route, grid_sums, minibatch_grid
from featcache.similarity.registry import MEASURES, Budget
from featcache.similarity.streaming import take_rows

if TYPE_CHECKING:
    from featcache.store import FeatureCache

log = logging.getLogger(__name__)

__all__ = ["MINIBATCH_METRIC", "compare_layers", "layer_grid_rows", "layer_grids"]

#: the metric name of minibatch CKA rows
MINIBATCH_METRIC = "cka_minibatch"

Layers = list[tuple[int, str]]


def _metrics(cfg: SimilarityConfig) -> tuple[str, ...]:
    return (*cfg.layer_measures, *((MINIBATCH_METRIC,) if cfg.minibatch else ()))


def _text(metric: str, cfg: SimilarityConfig) -> str:
    return f"minibatch CKA ({cfg.minibatch} rows)" if metric == MINIBATCH_METRIC else MEASURES[metric].text


def _run_ids(cfg: SimilarityConfig, a: str, b: str, layers: dict[str, Layers], fps) -> dict[tuple, str]:
    """``{(metric, position in a, position in b): run id}`` of one grid."""
    from featcache.core.results import make_run_id

    out = {}
    for m in _metrics(cfg):
        for (p, (i, ka)), (q, (j, kb)) in itertools.product(enumerate(layers[a]), enumerate(layers[b])):
            out[(m, p, q)] = make_run_id(
                kind="similarity",
                backbone_a=a,
                backbone_b=b,
                dataset=cfg.dataset,
                split=cfg.split,
                metric=m,
                layer_a=i,
                layer_b=j,
                kind_a=ka,
                kind_b=kb,
                store=[fps[a][ka], fps[b][kb]],
                **({"minibatch": cfg.minibatch} if m == MINIBATCH_METRIC else {}),
            )
    return out


def _views(cache, cfg: SimilarityConfig, b: str, layers: Layers) -> list[Any]:
    """``b``'s stored layer kinds (lazy); a kind that is not one vector per row is refused."""
    feats = [cache.load(b, cfg.dataset, cfg.split, k, lazy=True) for _, k in layers]
    for f, (_, k) in zip(feats, layers, strict=True):
        if len(f.X.shape) != 2:
            raise DataError(f"layer kind {k} of {b} holds {tuple(f.X.shape)}; layer CKA compares one vector per row")
    return feats


def _aligned(fa: list[Any], fb: list[Any] | None) -> tuple[list[Any], list[Any] | None]:
    """Both sides' layers on the rows valid in both, joined by sample id (lazy views)."""
    a0 = fa[0]
    if fb is None:
        ia = np.flatnonzero(np.asarray(a0.valid, bool))
        return [take_rows(f.X, ia) for f in fa], None
    b0 = fb[0]
    ia, ib = align_ids(a0.ids, b0.ids, a0.backbone, b0.backbone)
    ok = np.asarray(a0.valid, bool)[ia] & np.asarray(b0.valid, bool)[ib]
    if not ok.all():
        log.warning("%s vs %s: %d row(s) dropped (invalid in either)", a0.backbone, b0.backbone, int((~ok).sum()))
    return [take_rows(f.X, ia[ok]) for f in fa], [take_rows(f.X, ib[ok]) for f in fb]


def layer_grids(A: list[Any], B: list[Any] | None, cfg: SimilarityConfig) -> tuple[dict[str, np.ndarray], dict]:
    """``{metric: [L_A, L_B] matrix}`` for aligned layers ``A`` and ``B`` (None: A with itself)
    and the details every row records (route, rows, block rows, minibatches)."""
    dims_a = [int(v.shape[1]) for v in A]
    dims_b = None if B is None else [int(v.shape[1]) for v in B]
    n = int(A[0].shape[0])
    route = choose_route(n, dims_a, dims_b, cfg.memory)
    rows = Budget(cfg.memory, sum(dims_a), sum(dims_a if dims_b is None else dims_b)).block_rows
    sums = grid_sums(A, B, route, cfg.memory, rows)
    out = {m: sums.cka(debiased=m == "cka_debiased") for m in cfg.layer_measures}
    info: dict[str, Any] = {"route": route, "rows": n, "block_rows": rows}
    if cfg.minibatch:
        grams = len(A) + (0 if B is None else len(B))
        need = 8 * grams * cfg.minibatch**2
        if need > cfg.memory:
            raise DataError(
                f"--minibatch {cfg.minibatch} holds {grams} [N, N] Gram matrices ({need / 2**20:.0f} MiB), more than "
                f"--max-memory {cfg.max_memory}: give --minibatch <= {math.isqrt(cfg.memory // (8 * grams))} or a "
                "larger --max-memory"
            )
        out[MINIBATCH_METRIC], mb = minibatch_grid(A, B, cfg.minibatch)
        info.update(mb)
    return out, info


def compare_layers(fa: list[Any], fb: list[Any] | None, cfg: SimilarityConfig) -> tuple[dict[str, np.ndarray], dict]:
    """:func:`layer_grids` of two backbones' layer features (``Features``, one per layer; ``fb``
    None: ``fa`` with itself) on the rows valid in both, joined by sample id."""
    A, B = _aligned(fa, fb)
    return layer_grids(A, B, cfg)


def _grid_rows(cfg: SimilarityConfig, cache, a: str, b: str, layers: dict[str, Layers], ids) -> list[dict]:
    from featcache.store import combine_fingerprints

    t0 = time.perf_counter()
    fa = _views(cache, cfg, a, layers[a])
    fb = None if a == b else _views(cache, cfg, b, layers[b])
    mats, info = compare_layers(fa, fb, cfg)
    secs = time.perf_counter() - t0
    fb = fa if fb is None else fb
    rows = []
    for (m, p, q), run_id in ids.items():
        (i, ka), (j, kb) = layers[a][p], layers[b][q]
        hp = {"backbone_a": a, "backbone_b": b, "layer_a": i, "layer_b": j, "kind_a": ka, "kind_b": kb}
        hp.update(layers=cfg.layers, layer_part=cfg.layer_part, measure_text=_text(m, cfg), **info)
        rows.append(
            {
                "run_id": run_id,
                "kind": "similarity",
                "backbone": a,
                "dataset": cfg.dataset,
                "protocol": f"layers:vs:{b}",
                "eval_split": cfg.split,
                "metric": m,
                "value": float(mats[m][p, q]),
                "n_eval": info["rows"],
                "hparams": hp,
                "fit_seconds": secs,
                "store_fingerprint": combine_fingerprints(fa[p].fingerprint, fb[q].fingerprint),
            }
        )
    return rows


def _stored_layers(cache: FeatureCache, cfg: SimilarityConfig, b: str) -> Layers:
    """``b``'s stored layers that ``cfg.layers`` names; a refusal names the backbone."""
    try:
        return select_layers(cache.kinds(b, cfg.dataset, cfg.split), cfg.layers or "all", cfg.layer_part)
    except ConfigError as exc:
        raise ConfigError(f"{b} on {cfg.dataset}/{cfg.split}: {exc}") from None


def layer_grid_rows(cfg: SimilarityConfig, cache: FeatureCache, backbones: list[str]) -> tuple[list[dict], list[str]]:
    """Every backbone's layers against its own and every other backbone's (``cfg.layers``),
    appended grid by grid to ``cfg.results_path`` when set (finished grids are skipped unless
    ``cfg.force``): the new rows and the run ids of every grid's rows."""
    from featcache.core.progress import tqdm

    layers = {b: _stored_layers(cache, cfg, b) for b in backbones}
    fps = {b: {k: cache.stored_fingerprint(b, cfg.dataset, cfg.split, k) for _, k in layers[b]} for b in backbones}
    pairs = [(a, a) for a in backbones] + list(itertools.combinations(backbones, 2))
    ids = {p: _run_ids(cfg, p[0], p[1], layers, fps) for p in pairs}
    todo = pending(
        {p: list(r.values()) for p, r in ids.items()},
        finished(cfg.results_path, cfg.force),
        lambda p: f"layer CKA {p[0]} vs {p[1]} on {cfg.dataset}/{cfg.split}",
        cfg.results_path,
        log,
    )
    rows: list[dict[str, Any]] = []
    for a, b in tqdm(todo, desc="layer CKA grids", unit="grid", disable=not cfg.progress):
        new = _grid_rows(cfg, cache, a, b, layers, ids[(a, b)])
        write_rows(cfg.results_path, new)
        rows += new
    return rows, [r for g in ids.values() for r in g.values()]
