"""Retrieval runs on cached features: metrics in memory (:func:`evaluate`) and rows in the
tidy results table (:func:`run_retrieval`)."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterable, Sequence

import numpy as np

from featcache.errors import DataError
from featcache.retrieval.knn import KNN_KS, KNN_TEMPERATURE, knn_accuracy
from featcache.retrieval.metrics import compute_metrics, ranks_from_hits, summarize
from featcache.retrieval.ranking import full_ranking_metrics
from featcache.retrieval.relevance import (
    ExplicitRelevance,
    Relevance,
    SemanticRelevance,
    load_relevance_table,
)
from featcache.retrieval.search import choose_backend, parse_memory, prepare, topk

log = logging.getLogger(__name__)

__all__ = ["TIE_POLICY", "evaluate", "run_retrieval", "DEFAULT_KS"]

DEFAULT_KS = (1, 5, 10, 100)
TIE_POLICY = "tie groups ranked as a block at their last position (sklearn AP convention)"


def _check_ks(ks: Iterable[int]) -> list[int]:
    try:
        out = sorted({int(k) for k in ks})
    except (TypeError, ValueError) as exc:
        raise DataError(f"ks must be positive integers, got {ks!r}") from exc
    if not out or out[0] < 1:
        raise DataError(f"ks must be positive integers, got {ks!r}")
    return out


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
) -> dict:
    """Retrieval metrics of queries ``Xq`` against gallery ``Xg``.

    ``full=True``: exact full ranking (``map``, ``mrr`` and every @k metric) by blockwise
    scoring; ``full=False``: top-max(ks) search only (@k metrics incl. ``mrr@K``).
    Returns ``{"means", "per_query", "n_queries", "n_scored", "n_without_relevant", "backend"}``.
    """
    ks = _check_ks(ks)
    mem = parse_memory(max_memory)
    if Xq.shape[0] != relevance.n_queries or Xg.shape[0] != relevance.n_gallery:
        raise DataError("relevance does not match the query/gallery sizes")
    Q, G = prepare(Xq, metric), prepare(Xg, metric)
    if Q.shape[1] != G.shape[1]:
        raise DataError(f"query dim {Q.shape[1]} != gallery dim {G.shape[1]}; use one backbone's features")
    n_rel = relevance.n_relevant()
    if full:
        chosen = choose_backend(backend)
        backend = {"faiss-gpu": "torch-cuda", "torch-cuda": "torch-cuda", "torch-cpu": "torch-cpu"}.get(chosen, "numpy")
        if chosen == "faiss-gpu" and not _cuda():
            backend = "numpy"
        per_query = full_ranking_metrics(Q, G, relevance, metric, ks, max_memory=mem, backend=backend,
                                         progress=progress)
    else:
        kmax = ks[-1]
        # one column more than needed: a tie group crossing rank kmax is seen (and excluded)
        sc, idx, backend = topk(Q, G, kmax + 1, metric, relevance=relevance, backend=backend,
                                max_memory=mem, prepared=True)
        rows = np.broadcast_to(np.arange(Q.shape[0])[:, None], idx.shape)
        rr = ranks_from_hits(relevance.is_positive(rows, idx), n_rel, scores=sc, depth=kmax)
        per_query = compute_metrics(rr, ks, full=False)
    means, n_scored, n_none = summarize(per_query, n_rel)
    if n_none:
        log.info("%d of %d queries have no relevant gallery item; excluded from the means", n_none, Q.shape[0])
    return {
        "means": means,
        "per_query": per_query,
        "n_queries": int(Q.shape[0]),
        "n_scored": n_scored,
        "n_without_relevant": n_none,
        "backend": backend,
    }


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
    return f.X[ok], np.asarray(f.labels)[ok], np.asarray(f.ids).astype(str)[ok], int((~ok).sum())


def _file_hash(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def run_retrieval(
    cache_path,
    backbones: str | Sequence[str] | None,
    dataset: str,
    query_split: str = "test",
    gallery_split: str = "train",
    metric: str = "cosine",
    ks: Sequence[int] = DEFAULT_KS,
    results_path: str | os.PathLike | None = None,
    knn: bool = True,
    *,
    relevance: str | os.PathLike | None = None,
    full: bool = True,
    max_memory: int | str = "2GB",
    backend: str = "auto",
    knn_ks: Sequence[int] = KNN_KS,
    temperature: float = KNN_TEMPERATURE,
    kind: str = "pooled",
    progress: bool = True,
):
    """Retrieval (and k-NN classification) for each backbone; returns the result rows as a
    polars DataFrame and appends them to ``results_path`` when given.

    ``backbones``: one name, a list, or ``None``/``"all"`` for every backbone holding the
    dataset. ``gallery_split="same"``: leave-one-out within ``query_split`` (each query
    excluded by id). ``relevance``: parquet/CSV of (query_id, gallery_id, relevance in
    {positive, junk}) for content retrieval; otherwise a match shares the query's label.
    Rows: ``kind="retrieval"`` with metrics ``map``, ``mrr``, ``map@k``, ``mrr@k``,
    ``recall@k``, ``hit@k``, ``precision@k``; ``kind="knn"`` with ``top1``/``top5`` per k
    (protocol ``knn-k{k}``).
    """
    from featcache.results import append_results, make_run_id, rows_to_frame
    from featcache.store import open_cache

    ks = _check_ks(ks)
    knn_ks = _check_ks(knn_ks) if knn else []
    mem = parse_memory(max_memory)
    cache = open_cache(cache_path)
    if backbones is None or backbones == "all" or backbones == ["all"]:
        backbones = list(dict.fromkeys(b for b, d, s in cache.entries() if d == dataset and s == query_split))
        if not backbones:
            raise DataError(f"no backbone in {cache_path} holds dataset {dataset!r}; run `featcache extract` first")
    elif isinstance(backbones, str):
        backbones = [backbones]
    same = gallery_split == "same"
    g_split = query_split if same else gallery_split
    rel_table = load_relevance_table(relevance) if relevance is not None else None
    rel_hash = _file_hash(relevance) if relevance is not None else ""
    protocol = "content" if rel_table is not None else "semantic"

    rows: list[dict] = []
    for b in backbones:
        t0 = time.perf_counter()
        fq = cache.load(b, dataset, query_split, kind)
        fg = fq if same else cache.load(b, dataset, g_split, kind)
        Xq, yq, idq, bad_q = _valid(fq, f"{b}/{dataset}/{query_split}")
        Xg, yg, idg, bad_g = (Xq, yq, idq, bad_q) if same else _valid(fg, f"{b}/{dataset}/{g_split}")
        if list(fq.class_names) != list(fg.class_names) and rel_table is None:
            raise DataError(
                f"{query_split} and {g_split} of {dataset} have different class lists; semantic "
                "retrieval needs one label space (or give --relevance)"
            )
        if Xg.shape[0] == 0 or Xq.shape[0] == 0:
            raise DataError(f"{b}/{dataset}: no valid query or gallery rows")
        sem = SemanticRelevance(yq, yg, idq, idg)
        rel = sem if rel_table is None else ExplicitRelevance(idq, idg, *rel_table)
        fp = hashlib.sha256((fq.fingerprint + "|" + fg.fingerprint).encode()).hexdigest()[:16]
        res = evaluate(Xq, Xg, rel, metric=metric, ks=ks, full=full, backend=backend,
                       max_memory=mem, progress=progress)
        seconds = time.perf_counter() - t0
        hp = {
            "similarity": metric, "gallery": gallery_split, "ks": ks, "full_ranking": full,
            "backend": res["backend"], "tie_policy": TIE_POLICY, "feature_kind": kind,
            "n_queries": res["n_queries"], "n_without_relevant": res["n_without_relevant"],
            "n_gallery": int(Xg.shape[0]), "n_invalid_dropped": bad_q + (0 if same else bad_g),
            "relevance_sha256": rel_hash,
        }
        definition = dict(kind="retrieval", backbone=b, dataset=dataset, protocol=protocol,
                          query=query_split, gallery=gallery_split, metric=metric, ks=ks, full=full,
                          relevance=rel_hash, feature_kind=kind, store=fp)
        run_id = make_run_id(**definition)
        for name, value in res["means"].items():
            rows.append(dict(run_id=run_id, kind="retrieval", backbone=b, dataset=dataset, protocol=protocol,
                             train_split=g_split, eval_split=query_split, metric=name, value=value,
                             n_eval=res["n_scored"], hparams=hp, fit_seconds=seconds, store_fingerprint=fp))
        log.info("%s %s: %s", b, dataset, ", ".join(f"{k}={v:.4f}" for k, v in res["means"].items()
                                                   if k in ("map", "mrr") or k.endswith("@5")))
        if knn:
            t1 = time.perf_counter()
            kk = max(knn_ks)
            Qc, Gc = prepare(Xq, "cosine"), prepare(Xg, "cosine")
            sc, ix, used = topk(Qc, Gc, kk, "cosine", relevance=sem, backend=backend, max_memory=mem, prepared=True)
            acc = knn_accuracy(sc, ix, yg, yq, len(fg.class_names), knn_ks, temperature)
            seconds = time.perf_counter() - t1
            for k, vals in acc.items():
                hpk = {"k": k, "temperature": temperature, "similarity": "cosine", "gallery": gallery_split,
                       "backend": used, "tie_policy": TIE_POLICY, "feature_kind": kind,
                       "n_gallery": int(Xg.shape[0]), "k_effective": int(min(k, Xg.shape[0] - (1 if same else 0)))}
                rid = make_run_id(kind="knn", backbone=b, dataset=dataset, protocol=f"knn-k{k}", query=query_split,
                                  gallery=gallery_split, T=temperature, feature_kind=kind, store=fp)
                for name, value in vals.items():
                    rows.append(dict(run_id=rid, kind="knn", backbone=b, dataset=dataset, protocol=f"knn-k{k}",
                                     train_split=g_split, eval_split=query_split, metric=name, value=value,
                                     n_eval=int(Xq.shape[0]), hparams=hpk, fit_seconds=seconds,
                                     store_fingerprint=fp))
            log.info("%s %s: kNN top1 %s", b, dataset, {k: round(v["top1"], 4) for k, v in acc.items()})
    frame = rows_to_frame(rows)
    if results_path is not None:
        append_results(results_path, frame)
    return frame
