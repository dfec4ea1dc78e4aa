"""Retrieval runs on cached features: metrics in memory (:func:`evaluate`) and rows in the
tidy results table (:func:`run_retrieval`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.errors import DataError, UsageError
from featcache.retrieval.config import (
    DEFAULT_KS,
    TIE_POLICY,
    RetrievalConfig,
    RetrievalConfigError,
    check_ks,
    legacy_config,
)
from featcache.retrieval.knn import knn_accuracy
from featcache.retrieval.metrics import compute_metrics, ranks_from_hits, summarize
from featcache.retrieval.prepared import PreparedRows
from featcache.retrieval.ranking import full_ranking, full_ranking_metrics
from featcache.retrieval.relevance import (
    ExplicitRelevance,
    Relevance,
    SemanticRelevance,
    SharedLabelRelevance,
    load_relevance_table,
)
from featcache.retrieval.revisited import (
    bob_mrr,
    is_revisited_table,
    revisited_ap,
    revisited_precision_at_k,
    revisited_table,
)
from featcache.retrieval.search import BACKENDS, choose_backend, parse_memory, prepared_pair, topk

if TYPE_CHECKING:
    import polars as pl

log = logging.getLogger(__name__)

BOB_TIES = "index"  # Battle of the Backbones' metrics rank exact ties in gallery order

__all__ = ["DEFAULT_KS", "TIE_POLICY", "RetrievalConfig", "evaluate", "run_retrieval"]


def _check_ks(ks: Iterable[int]) -> list[int]:
    return list(check_ks(ks))


def evaluate(
    Xq: np.ndarray,
    Xg: np.ndarray,
    relevance: Relevance,
    *,
    metric: str = "cosine",
    ks: Sequence[int] = DEFAULT_KS,
    full: bool = True,
    backend: str = "auto",
    max_memory: int | str = "2GB",
    progress: bool = False,
    exact_scores: bool = False,
    bob: bool = False,
) -> dict:
    """Retrieval metrics of queries ``Xq`` against gallery ``Xg``.

    ``full=True``: exact full ranking (``map``, ``mrr`` and every @k metric) by blockwise
    scoring; ``full=False``: top-max(ks) search only (@k metrics incl. ``mrr@K``).
    ``max_memory`` bounds the score blocks; features whose float32 copy exceeds a quarter of
    it stay in their dtype and are converted block by block as they are scored (host memory
    stays bounded with the numpy and CUDA backends; see :func:`~featcache.retrieval.topk`).
    ``exact_scores``: float64-rounded full-ranking scores (see :mod:`featcache.retrieval.ranking`);
    ``bob`` (full ranking): Battle of the Backbones' per-query values from the same sort, under
    ``"bob"`` (``map_bob``, ``mp@k``, ``rr_bob``).
    Returns ``{"means", "per_query", "n_queries", "n_scored", "n_without_relevant", "backend"}``.
    """
    ks = _check_ks(ks)
    mem = parse_memory(max_memory)
    if Xq.shape[0] != relevance.n_queries or Xg.shape[0] != relevance.n_gallery:
        raise DataError("relevance does not match the query/gallery sizes")
    Q, G = prepared_pair(Xq, Xg, metric, cache_bytes=mem // 4)
    if Q.shape[1] != G.shape[1]:
        raise DataError(f"query dim {Q.shape[1]} != gallery dim {G.shape[1]}; use one backbone's features")
    n_rel = relevance.n_relevant()
    if full:
        backend = _ranking_backend(backend)
        per_query = full_ranking_metrics(
            Q,
            G,
            relevance,
            metric,
            ks,
            max_memory=mem,
            backend=backend,
            progress=progress,
            exact_scores=exact_scores,
            bob=bob,
        )
        bob_q = {name: per_query.pop(name) for name in list(per_query) if name in _BOB_KEYS or name.startswith("mp@")}
    else:
        kmax = ks[-1]
        # one column more than needed: a tie group crossing rank kmax is seen (and excluded)
        sc, idx, backend = topk(
            Q,
            G,
            kmax + 1,
            metric,
            relevance=relevance,
            backend=backend,
            max_memory=mem,
            prepared=True,
            progress=progress,
        )
        rows = np.broadcast_to(np.arange(Q.shape[0])[:, None], idx.shape)
        rr = ranks_from_hits(relevance.is_positive(rows, idx), n_rel, scores=sc, depth=kmax)
        per_query = compute_metrics(rr, ks, full=False)
    means, n_scored, n_none = summarize(per_query, n_rel)
    if n_none:
        log.info("%d of %d queries have no relevant gallery item; excluded from the means", n_none, Q.shape[0])
    return {
        **({"bob": bob_q} if full and bob else {}),
        "means": means,
        "per_query": per_query,
        "n_queries": int(Q.shape[0]),
        "n_scored": n_scored,
        "n_without_relevant": n_none,
        "backend": backend,
    }


_BOB_KEYS = ("map_bob", "rr_bob")


def _ranking_backend(backend: str) -> str:
    """The full-ranking backend for a requested search backend (the name recorded): ``torch-DEV``
    for a backend ranking on a torch device (``SearchBackend.ranking_device``), else ``numpy``."""
    dev = BACKENDS[choose_backend(backend)].ranking_device
    if dev == "cuda" and not _cuda():
        dev = None
    return f"torch-{dev}" if dev else "numpy"


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _valid(f, what: str):
    ok = np.asarray(f.valid, bool)
    if not ok.all():
        log.warning("%s: dropping %d invalid row(s) (images that failed to decode)", what, int((~ok).sum()))
    X = f.X if ok.all() else f.X[ok]  # no copy when every row is valid
    return X, np.asarray(f.labels)[ok], np.asarray(f.ids).astype(str)[ok], int((~ok).sum())


def _file_hash(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def run_retrieval(config: RetrievalConfig | str | os.PathLike, *args: Any, **kwargs: Any) -> pl.DataFrame:
    """Retrieval (and k-NN classification) for each backbone of ``config``; returns the
    result rows as a polars DataFrame and appends them to ``config.results_path`` when set.

    Rows: ``kind="retrieval"`` with metrics ``map``, ``mrr``, ``map@k``, ``mrr@k``,
    ``recall@k``, ``hit@k``, ``precision@k`` (protocol ``semantic``, ``content`` or
    ``revisited-{setup}``, the last adding revisitop's ``map_revisitop`` and
    ``mp_revisitop@k``); ``kind="knn"`` with ``top1``/``top5`` per k (protocol ``knn-k{k}``).

    A backbone whose runs are all in ``config.results_path`` is skipped (its stored rows are
    returned; its run ids come from the provenance records, so no feature is read) unless
    ``config.force``, which recomputes them and replaces their rows.

    The older call ``run_retrieval(cache_path, backbones, dataset, query_split, ...)`` with
    the same keywords as :class:`RetrievalConfig` (``results_path`` for ``results``) still works.
    """
    from featcache.core.results import check_results_path
    from featcache.core.stagerun import collect, finished, pending

    if isinstance(config, RetrievalConfig) and (args or kwargs):
        raise UsageError("run_retrieval(config) takes no further arguments; use dataclasses.replace(config, ...)")
    cfg = config if isinstance(config, RetrievalConfig) else legacy_config(config, *args, **kwargs)
    if cfg.layers:  # a layer sweep: this function once per stored layer (retrieval.layer_sweep)
        from featcache.retrieval.layer_sweep import run_retrieval_layers

        return run_retrieval_layers(cfg, run_retrieval, _open_backbones)
    if cfg.results_path is not None:
        check_results_path(cfg.results_path)  # an unwritable table fails before any compute
    if cfg.shards and cfg.index != "exact":
        raise RetrievalConfigError("--shards searches exactly; drop --index (or --shards)")
    cache, backbones = _open_backbones(cfg)
    g_split = cfg.query_split if cfg.same_split else cfg.gallery_split
    labels = None if cfg.relevance is not None else _label_matrices(cache, cfg.dataset, cfg.query_split, g_split)
    setups = _relevance_setups(cfg, labels)
    done = finished(cfg.results_path, cfg.force)
    ids: dict[str, list[str]] = {}
    todo = backbones
    if done:  # run ids from the provenance records: a finished backbone reads no feature
        ids = {b: _run_ids(cfg, b, _stored_fingerprint(cfg, cache, b), setups) for b in backbones}
        todo = pending(
            ids, done, lambda b: f"retrieval {b}/{cfg.dataset} {cfg.query_split}->{g_split}", cfg.results_path, log
        )
    rows: list[dict] = []
    client, cluster = _shard_client(cfg, bool(todo))
    try:
        for b in todo:
            data = _load_pair(cfg, cache, b, any(rel is not None for _, rel, _ in setups), labels)
            data.client = client
            ids[b] = _run_ids(cfg, b, data.fingerprint, setups)  # the loaded features' own
            for protocol, table, rel_hash in setups:
                rows += _retrieval_rows(cfg, data, protocol, table, rel_hash)
            if cfg.knn:
                rows += _knn_rows(cfg, data)
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()
    return collect("retrieval", cfg.results_path, rows, [r for v in ids.values() for r in v])


def _shard_client(cfg: RetrievalConfig, needed: bool):
    """(Dask client, LocalCluster or None) for --shards, or (None, None)."""
    if not (cfg.shards and needed):
        return None, None
    from featcache.retrieval.sharded import dask_client

    return dask_client(cfg.scheduler, cfg.shards, cfg.shard_processes)


def _index_result(cfg: RetrievalConfig, d: _Pair, rel: Relevance) -> tuple[dict, dict]:
    """--index: @k metrics of the index's lists, and their recall and metric deltas against
    exact search on a query sample; the index is obtained once per backbone and metric."""
    from featcache.retrieval.approx import compare_with_exact, evaluate_index, obtain_index

    Q, G = d.prepared(cfg.metric, cfg.max_memory)
    spec = cfg.index_spec(max(cfg.ks))
    assert spec is not None  # index rows are made only when --index is given
    if cfg.metric not in d._indexes:
        where = {"backbone": d.backbone, "dataset": cfg.dataset, "split": d.g_split, "kind": cfg.kind}
        d._indexes[cfg.metric] = obtain_index(spec, G, d.g_fingerprint, cfg.cache, d.idg, where)
    built = d._indexes[cfg.metric]
    t0 = time.perf_counter()
    per_query, _, ix = evaluate_index(built.index, Q, rel, cfg.metric, cfg.ks)
    search_s = time.perf_counter() - t0
    means, n_scored, n_none = summarize(per_query, rel.n_relevant())
    cmp, info = compare_with_exact(
        (per_query, ix),
        Q,
        G,
        rel,
        cfg.metric,
        cfg.ks,
        n_sample=cfg.recall_queries,
        seed=cfg.index_seed,
        backend=cfg.backend,
        max_memory=cfg.max_memory,
    )
    log.info("%s index %s: %s", d.backbone, built.factory, {k: round(v, 4) for k, v in cmp.items()})
    below = _below_min_recall(cmp, spec.min_recall)
    if below:  # every factory, not only auto: its metrics are not exact search's
        log.warning(
            "%s index %s: %s below --min-recall %s; its metrics differ from exact search's by the "
            "absdelta_* rows (a positive delta_map is not better than exact: see docs/retrieval.md)",
            d.backbone, built.factory, ", ".join(f"{k} {v:.3f}" for k, v in below.items()), spec.min_recall,
        )  # fmt: skip
    p = built.provenance
    train_sha = hashlib.sha256(json.dumps(p.get("train_rows", [])).encode()).hexdigest()[:16]
    index_hp = {
        "factory": built.factory,
        "requested": cfg.index,
        **built.params,
        "sha256": p.get("sha256"),
        "bytes": p.get("bytes"),
        "n_train": p.get("n_train"),
        "train_rows_sha256": train_sha,
        "train_seed": p.get("train_seed"),
        "built_on": p.get("built_on"),
        "reused": built.reused,
        "key": p.get("key"),
    }
    if below:
        index_hp.update(min_recall=spec.min_recall, below_min_recall=below)
    res = {"means": {**means, **cmp}, "n_queries": int(Q.shape[0]), "n_scored": n_scored}
    res.update(n_without_relevant=n_none, backend="faiss-index")
    return res, {"index": index_hp, "index_search_seconds": search_s, **info}


def _below_min_recall(cmp: dict[str, float], min_recall: float) -> dict[str, float]:
    """The ``index_recall@k`` values under ``min_recall``."""
    return {k: v for k, v in cmp.items() if k.startswith("index_recall@") and v < min_recall}


def _sharded_result(cfg: RetrievalConfig, d: _Pair, rel: Relevance) -> tuple[dict, dict]:
    """--shards: the top-k-only metrics of :func:`evaluate`, the gallery searched on Dask workers."""
    from featcache.retrieval.sharded import shard_bounds, sharded_topk

    Q = d.queries(cfg.metric, cfg.max_memory)
    kmax = max(cfg.ks)
    sc, idx, used = sharded_topk(
        Q,
        d.source,
        kmax + 1,
        cfg.metric,
        d.client,
        cfg.shards,
        relevance=rel,
        backend=cfg.backend,
        max_memory=cfg.max_memory,
    )
    rows = np.broadcast_to(np.arange(Q.shape[0])[:, None], idx.shape)
    rr = ranks_from_hits(rel.is_positive(rows, idx), rel.n_relevant(), scores=sc, depth=kmax)
    means, n_scored, n_none = summarize(compute_metrics(rr, cfg.ks, full=False), rel.n_relevant())
    res = {"means": means, "n_queries": int(Q.shape[0]), "n_scored": n_scored, "n_without_relevant": n_none}
    res["backend"] = used
    return res, {"shards": len(shard_bounds(d.source.n, cfg.shards)), "scheduler": cfg.scheduler or "local"}


def _run_ids(cfg: RetrievalConfig, b: str, fingerprint: str, setups) -> list[str]:
    """The run ids of backbone ``b``'s rows: one per scored setup, then one per k-NN k."""
    from featcache.core.results import make_run_id

    out = [make_run_id(**cfg.run_definition(b, protocol, rel_hash, fingerprint)) for protocol, _, rel_hash in setups]
    if cfg.knn:
        out += [make_run_id(**cfg.knn_definition(b, k, fingerprint)) for k in cfg.knn_ks]
    return out


def _stored_fingerprint(cfg: RetrievalConfig, cache, b: str) -> str:
    """:attr:`_Pair.fingerprint` from the provenance records alone (no feature is read)."""
    q = cache.stored_fingerprint(b, cfg.dataset, cfg.query_split, cfg.kind)
    g = q if cfg.same_split else cache.stored_fingerprint(b, cfg.dataset, cfg.gallery_split, cfg.kind)
    return cfg.pair_fingerprint(q, g)


@dataclass
class _Pair:
    """Valid query and gallery rows of one backbone, and what identifies them."""

    backbone: str
    Xq: np.ndarray
    yq: np.ndarray
    idq: np.ndarray
    Xg: np.ndarray
    yg: np.ndarray
    idg: np.ndarray
    n_dropped: int
    n_classes: int
    fingerprint: str
    g_split: str
    seconds: float
    same_split: bool = True  # query and gallery are one split: a query's own id is excluded
    #: multi-label targets [rows, C] of the valid query / gallery rows (None: single-label)
    Yq: np.ndarray | None = None
    Yg: np.ndarray | None = None
    source: Any = None  # --shards: where the workers read the gallery (GallerySource)
    g_fingerprint: str = ""  # the gallery features' own fingerprint (names a stored index)
    client: Any = None  # --shards: the Dask client
    _prepared: dict = field(default_factory=dict, repr=False)
    _indexes: dict = field(default_factory=dict, repr=False)

    def prepared(self, metric: str, max_memory) -> tuple:
        """Queries and gallery as PreparedRows for ``metric``, made once and shared by every
        scored setup of this backbone x split (each revisited setup, revisited AP, k-NN)."""
        mem = parse_memory(max_memory)
        key = (metric, mem)
        if key not in self._prepared:
            self._prepared[key] = prepared_pair(self.Xq, self.Xg, metric, cache_bytes=mem // 4)
        return self._prepared[key]

    def queries(self, metric: str, max_memory) -> PreparedRows:
        """The queries alone as PreparedRows (--shards: the gallery is read by the workers)."""
        if self.source is None:
            return self.prepared(metric, max_memory)[0]
        mem = parse_memory(max_memory)
        key = ("q", metric, mem)
        if key not in self._prepared:
            self._prepared[key] = PreparedRows(self.Xq, metric, cache_bytes=mem // 4)
        return self._prepared[key]


def _open_backbones(cfg: RetrievalConfig):
    from featcache.store import open_cache

    cache = open_cache(cfg.cache)
    if cfg.backbones is not None:
        return cache, list(cfg.backbones)
    found = list(dict.fromkeys(b for b, d, s in cache.entries() if d == cfg.dataset and s == cfg.query_split))
    if not found:
        raise DataError(_not_held(cache, cfg))
    return cache, found


def _not_held(cache, cfg: RetrievalConfig) -> str:
    """Why no backbone holds the query split: the dataset is missing, or only that split."""
    ents = cache.entries()
    splits = sorted({s for _, d, s in ents if d == cfg.dataset})
    if not splits:
        have = sorted({d for _, d, _ in ents})
        return (
            f"no backbone in {cfg.cache} holds dataset {cfg.dataset!r} (datasets with features: {have}); "
            "pass one of them as --dataset (dataset=), or run `featcache extract` first"
        )
    return (
        f"dataset {cfg.dataset!r} in {cfg.cache} has no {cfg.query_split!r} split with features "
        f"(its splits: {splits}); pass one of them as --query (query_split=), or extract that split"
    )


def _label_matrices(cache, dataset: str, q_split: str, g_split: str):
    """Multi-label targets of the query and gallery splits (:mod:`featcache.store.tasks`, e.g. a
    CLIP_benchmark multi-label export): ``(query matrix, gallery matrix, hash)`` in the split's
    row order, or ``None`` when the splits are single-label."""
    from featcache.store import load_label_matrix

    q = load_label_matrix(cache, dataset, q_split)
    g = q if g_split == q_split else load_label_matrix(cache, dataset, g_split)
    if q is None and g is None:
        return None
    if q is None or g is None or q[1] != g[1]:
        raise DataError(
            f"{dataset}: semantic retrieval with multi-label targets needs a label matrix with the "
            f"same classes on both {q_split} and {g_split} (featcache.store.tasks.write_label_matrix)"
        )
    sha = q[2] if g_split == q_split else hashlib.sha256((q[2] + g[2]).encode()).hexdigest()[:16]
    return q[0], g[0], f"multilabel:{sha}"


def _rows_of(cache, dataset: str, split: str, ids: np.ndarray, M: np.ndarray) -> np.ndarray:
    """The label-matrix rows of the valid feature rows ``ids`` (matched by id)."""
    split_ids = np.asarray(cache.split_rows(dataset, split)[0]).astype(str)
    order = np.argsort(split_ids, kind="stable")
    pos = order[np.searchsorted(split_ids, ids, sorter=order)]
    return M[pos]


def _relevance_setups(cfg: RetrievalConfig, labels=None) -> list[tuple[str, tuple | None, str]]:
    """(protocol, positive/junk table or None, table hash) for each scored setup; semantic
    retrieval on multi-label targets (``labels``: :func:`_label_matrices`) carries their hash."""
    if cfg.relevance is None:
        return [("semantic", None, labels[2] if labels is not None else "")]
    table = load_relevance_table(cfg.relevance)
    rel_hash = _file_hash(cfg.relevance)
    if not is_revisited_table(table[2]):
        return [("content", table, rel_hash)]
    return [(f"revisited-{s}", revisited_table(*table, s), rel_hash) for s in cfg.revisited]


def _load_pair(cfg: RetrievalConfig, cache, b: str, explicit: bool, labels=None) -> _Pair:
    t0 = time.perf_counter()
    g_split = cfg.query_split if cfg.same_split else cfg.gallery_split
    # the stored dtype (float16): PreparedRows converts it, whole or block by block
    fq = cache.load(b, cfg.dataset, cfg.query_split, cfg.kind, dtype=None)
    # --shards: the workers read the gallery; here it stays a lazy view (labels and ids only)
    fg = fq if cfg.same_split else cache.load(b, cfg.dataset, g_split, cfg.kind, dtype=None, lazy=bool(cfg.shards))
    Xq, yq, idq, bad_q = _valid(fq, f"{b}/{cfg.dataset}/{cfg.query_split}")
    Xg, yg, idg, bad_g = (Xq, yq, idq, bad_q) if cfg.same_split else _valid(fg, f"{b}/{cfg.dataset}/{g_split}")
    source = None
    if cfg.shards:
        from featcache.retrieval.sharded import GallerySource

        rows = np.flatnonzero(np.asarray(fg.valid, bool))
        source = GallerySource(cfg.cache, b, cfg.dataset, g_split, cfg.kind, rows)
    if list(fq.class_names) != list(fg.class_names) and not explicit:
        raise DataError(
            f"{cfg.query_split} and {g_split} of {cfg.dataset} have different class lists; semantic "
            "retrieval needs one label space (or give --relevance)"
        )
    if Xg.shape[0] == 0 or Xq.shape[0] == 0:
        raise DataError(f"{b}/{cfg.dataset}: no valid query or gallery rows")
    fp = cfg.pair_fingerprint(fq.fingerprint, fg.fingerprint)
    Yq = Yg = None
    if labels is not None:  # every label of a multi-label export, not the argmax column
        Yq = _rows_of(cache, cfg.dataset, cfg.query_split, idq, labels[0])
        Yg = Yq if cfg.same_split else _rows_of(cache, cfg.dataset, g_split, idg, labels[1])
    return _Pair(
        b,
        Xq,
        yq,
        idq,
        Xg,
        yg,
        idg,
        bad_q + (0 if cfg.same_split else bad_g),
        len(fg.class_names),
        fp,
        g_split,
        time.perf_counter() - t0,
        cfg.same_split or g_split == cfg.query_split,
        Yq,
        Yg,
        source,
        fg.fingerprint,
    )


def _retrieval_rows(cfg: RetrievalConfig, d: _Pair, protocol: str, table, rel_hash: str) -> list[dict]:
    from featcache.core.results import make_run_id

    t0 = time.perf_counter()
    one = d.same_split
    if d.Yq is not None and d.Yg is not None:  # relevant: shares at least one label
        sem = SharedLabelRelevance(d.Yq, d.Yg, d.idq, d.idg, exclude_self=one)
    else:
        sem = SemanticRelevance(d.yq, d.yg, d.idq, d.idg, exclude_self=one)
    rel = sem if table is None else ExplicitRelevance(d.idq, d.idg, *table, exclude_self=one)
    extra_hp: dict = {}
    if cfg.index != "exact":
        res, extra_hp = _index_result(cfg, d, rel)
    elif cfg.shards:
        res, extra_hp = _sharded_result(cfg, d, rel)
    else:
        Q, G = d.prepared(cfg.metric, cfg.max_memory)
        res = evaluate(
            Q,
            G,
            rel,
            metric=cfg.metric,
            ks=cfg.ks,
            full=cfg.full_ranking,
            backend=cfg.backend,
            max_memory=cfg.max_memory,
            progress=cfg.progress,
            exact_scores=cfg.exact_scores,
            bob=True,
        )
    means = res["means"]
    if cfg.full_ranking:
        means = {**means, **_bob_means(cfg, d, rel, table, protocol.startswith("revisited-"), res.get("bob"))}
    elif protocol.startswith("revisited-"):
        raise DataError("revisited Oxford/Paris AP needs the full ranking; drop --top-k-only (full=False)")
    else:
        log.info("--top-k-only: Battle of the Backbones' map_bob, mp@k and mrr_bob need the full ranking; skipped")
    seconds = d.seconds + time.perf_counter() - t0
    hp = cfg.hparams(
        backend=res["backend"],
        relevance_sha=rel_hash,
        n_queries=res["n_queries"],
        n_without_relevant=res["n_without_relevant"],
        n_gallery=int(d.Xg.shape[0]),
        n_invalid_dropped=d.n_dropped,
        **extra_hp,
    )
    run_id = make_run_id(**cfg.run_definition(d.backbone, protocol, rel_hash, d.fingerprint))
    log.info(
        "%s %s %s: %s",
        d.backbone,
        cfg.dataset,
        protocol,
        ", ".join(f"{k}={v:.4f}" for k, v in means.items() if k in ("map", "mrr", "map_revisitop") or k.endswith("@5")),
    )
    return [
        {
            "run_id": run_id,
            "kind": "retrieval",
            "backbone": d.backbone,
            "dataset": cfg.dataset,
            "protocol": protocol,
            "train_split": d.g_split,
            "eval_split": cfg.query_split,
            "metric": name,
            "value": value,
            "n_eval": res["n_scored"],
            "hparams": hp,
            "fit_seconds": seconds,
            "store_fingerprint": d.fingerprint,
        }
        for name, value in means.items()
    ]


def _bob_means(cfg: RetrievalConfig, d: _Pair, rel, table, revisited: bool, per_query=None) -> dict[str, float]:
    """Battle of the Backbones' definitions (bob-retrieval ``compute_map``, revisitop's code)
    over the full ranking: ``map_bob`` (revisitop's trapezoidal AP), ``mp@k`` (revisitop's
    mP@k), ``mrr_bob`` (before junk removal, over all queries), ranked in BoB's order (its
    ``torch.argsort(-sim)``: exact ties in gallery order, ``ties="index"``), not featcache's
    block rule. Revisited Oxford/Paris keeps its older names ``map_revisitop`` and
    ``mp_revisitop@k`` (the same values) too. ``per_query``: those values already computed
    from the sort of :func:`evaluate` (``map_bob``, ``mp@k``, ``rr_bob``); otherwise (e.g.
    a results-only caller) the full ranking is computed here."""
    mem = parse_memory(cfg.max_memory)
    Q, G = d.prepared(cfg.metric, cfg.max_memory)

    def rank(r):
        backend = _ranking_backend(cfg.backend)
        return full_ranking(
            Q,
            G,
            r,
            cfg.metric,
            max_memory=mem,
            backend=backend,
            progress=cfg.progress,
            ties=BOB_TIES,
            exact_scores=cfg.exact_scores,
        )

    rr = None
    if per_query is None:
        rr = rank(rel)
        per_query = {"map_bob": revisited_ap(rr), "rr_bob": None}
        per_query.update({f"mp@{k}": revisited_precision_at_k(rr, k) for k in cfg.ks})
    per_query = dict(per_query)
    rr_bob = per_query.pop("rr_bob")
    if revisited:
        per_query["map_revisitop"] = per_query["map_bob"]
        per_query.update({f"mp_revisitop@{k}": per_query[f"mp@{k}"] for k in cfg.ks})
    means = summarize(per_query, rel.n_relevant())[0]
    if table is not None and bool(np.any(np.asarray(table[2]) == "junk")):  # BoB's MRR ranks junk items too
        keep = np.asarray(table[2]) != "junk"
        rel = ExplicitRelevance(d.idq, d.idg, *(np.asarray(c)[keep] for c in table), exclude_self=rel.exclude_self)
        means["mrr_bob"] = bob_mrr(rank(rel))
    elif rr is not None:
        means["mrr_bob"] = bob_mrr(rr)
    else:  # bob_mrr: the reciprocal first ranks summed over all queries / their number
        means["mrr_bob"] = float(np.sum(rr_bob) / rr_bob.size) if rr_bob.size else float("nan")
    return means


def _knn_rows(cfg: RetrievalConfig, d: _Pair) -> list[dict]:
    from featcache.core.results import make_run_id

    t1 = time.perf_counter()
    mem = parse_memory(cfg.max_memory)
    sem = SemanticRelevance(d.yq, d.yg, d.idq, d.idg, exclude_self=d.same_split)
    if d.source is not None:  # --shards
        from featcache.retrieval.sharded import sharded_topk

        Qc = d.queries("cosine", cfg.max_memory)
        sc, ix, used = sharded_topk(
            Qc,
            d.source,
            max(cfg.knn_ks),
            "cosine",
            d.client,
            cfg.shards,
            relevance=sem,
            backend=cfg.backend,
            max_memory=mem,
        )
    else:
        Qc, Gc = d.prepared("cosine", cfg.max_memory)
        sc, ix, used = topk(
            Qc,
            Gc,
            max(cfg.knn_ks),
            "cosine",
            relevance=sem,
            backend=cfg.backend,
            max_memory=mem,
            prepared=True,
            progress=cfg.progress,
        )
    acc = knn_accuracy(sc, ix, d.yg, d.yq, d.n_classes, list(cfg.knn_ks), cfg.temperature)
    seconds = time.perf_counter() - t1
    rows = []
    for k, vals in acc.items():
        hpk = cfg.knn_hparams(k, backend=used, n_gallery=int(d.Xg.shape[0]))
        if k >= hpk["n_gallery"] - (1 if cfg.same_split else 0):  # every gallery item votes
            hpk["k_covers_gallery"] = True
            log.warning(
                "%s %s: kNN k=%d with a gallery of %d item(s): every item votes, so this row is a "
                "class-prior vote, not a k-NN classifier; use k below the gallery size",
                d.backbone, cfg.dataset, k, hpk["n_gallery"],
            )  # fmt: skip
        rid = make_run_id(**cfg.knn_definition(d.backbone, k, d.fingerprint))
        for name, value in vals.items():
            rows.append(
                {
                    "run_id": rid,
                    "kind": "knn",
                    "backbone": d.backbone,
                    "dataset": cfg.dataset,
                    "protocol": f"knn-k{k}",
                    "train_split": d.g_split,
                    "eval_split": cfg.query_split,
                    "metric": name,
                    "value": value,
                    "n_eval": int(d.Xq.shape[0]),
                    "hparams": hpk,
                    "fit_seconds": seconds,
                    "store_fingerprint": d.fingerprint,
                }
            )
    log.info("%s %s: kNN top1 %s", d.backbone, cfg.dataset, {k: round(v["top1"], 4) for k, v in acc.items()})
    return rows
