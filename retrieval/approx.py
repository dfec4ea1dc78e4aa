"""Approximate retrieval through a FAISS index: its top-k under the tie policy, the index
``--index auto`` chooses, and how far the approximate lists are from exact search (recall of
the approximate top-k against the exact one, and metric deltas, on a seeded query sample).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.retrieval.index import (
    AUTO,
    EF_GRID,
    NPROBE_GRID,
    BuiltIndex,
    build_index,
    candidate_factories,
    check_index_dir,
    estimated_index_bytes,
    index_dir,
    index_key,
    index_search,
    load_index,
    rows_digest,
    save_index,
    search_params,
    set_search_params,
    write_index_to,
)
from featcache.retrieval.metrics import compute_metrics, ranks_from_hits, summarize
from featcache.retrieval.prepared import PreparedRows
from featcache.retrieval.search import drop_excluded, policy_sort, search_depth, topk

if TYPE_CHECKING:
    from featcache.retrieval.relevance import Relevance

log = logging.getLogger(__name__)

__all__ = ["IndexSpec", "approx_topk", "choose_index", "compare_with_exact", "obtain_index", "topk_recall"]

#: the metrics whose approximate - exact differences are reported (per k for the @k ones)
DELTA_METRICS = ("map", "mrr", "recall")


@dataclass(frozen=True)
class IndexSpec:
    """What defines an index run: factory (or ``auto``), search parameters, training sample."""

    factory: str
    metric: str
    nprobe: int | None = None
    ef_search: int | None = None
    seed: int = 0
    n_train: int | None = None
    max_bytes: int = 2 * 1024**3
    min_recall: float = 0.95
    k: int = 10
    where: str | None = None

    def definition(self) -> dict:
        """The part of a run's definition (run id) the index adds."""
        d: dict[str, Any] = {"factory": self.factory, "nprobe": self.nprobe, "ef_search": self.ef_search}
        d.update(seed=self.seed, n_train=self.n_train)
        if self.factory == AUTO:
            d.update(max_bytes=self.max_bytes, min_recall=self.min_recall, k=self.k)
        return d


def approx_topk(
    index: Any, Q: PreparedRows, k: int, metric: str, relevance: Relevance | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The index's top-k of every query, policy-sorted, excluded items removed (as :func:`topk`)."""
    depth = search_depth(k, int(index.ntotal), relevance)
    sc, ix = policy_sort(*index_search(index, Q, depth, metric))
    sc, ix, _ = drop_excluded(sc, ix, k, relevance)
    return sc, ix


def topk_recall(approx_ix: np.ndarray, exact_ix: np.ndarray) -> np.ndarray:
    """Per query: the share of the exact top-k (its valid entries) found in the approximate
    top-k (NaN for a query whose exact list is empty)."""
    valid = exact_ix >= 0
    found = ((approx_ix[:, :, None] == exact_ix[:, None, :]) & (approx_ix[:, :, None] >= 0)).any(1) & valid
    n = valid.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, found.sum(1) / np.maximum(n, 1), np.nan)


def _grid(index: Any) -> tuple[str, list[int]]:
    """The search parameter tuned for ``index`` and its values (autofaiss's choice of knob:
    nprobe for IVF, efSearch for HNSW; both for IVF over an HNSW quantizer, efSearch=2*nprobe)."""
    params = search_params(index)
    if "nprobe" in params:
        import faiss

        nlist = int(faiss.extract_index_ivf(index).nlist)
        return "nprobe", [v for v in NPROBE_GRID if v < nlist] + [nlist]
    if "ef_search" in params:
        return "ef_search", list(EF_GRID)
    return "", [0]


def tune(
    built: BuiltIndex, Qh: PreparedRows, exact_ix: np.ndarray, k: int, metric: str, min_recall: float
) -> tuple[dict[str, int], float]:
    """The smallest search parameter whose mean recall@k on ``Qh`` reaches ``min_recall``
    (else the largest tried), and that recall; the index is left set to it."""
    knob, values = _grid(built.index)
    both = knob == "nprobe" and "ef_search" in search_params(built.index)
    recall = float("nan")
    for v in values:
        if knob:
            ef = max(2 * v, 16) if both else (v if knob == "ef_search" else None)
            set_search_params(built.index, built.factory, v if knob == "nprobe" else None, ef)
        _, ix = approx_topk(built.index, Qh, k, metric)
        recall = float(np.nanmean(topk_recall(ix, exact_ix)))
        if recall >= min_recall:
            break
    return search_params(built.index), recall


def _serialized_bytes(index: Any) -> int:
    return write_index_to(index, None)[0]  # counted as written, without a copy of the bytes


def choose_index(G: PreparedRows, spec: IndexSpec, n_holdout: int = 1000) -> BuiltIndex:
    """``--index auto``: the first of :func:`candidate_factories` (memory budget first) whose
    tuned recall@k on held-out gallery rows (a seeded sample, as autofaiss queries an index
    with its own vectors) reaches ``spec.min_recall``; else the one with the best recall."""
    n, d = G.shape
    cands = candidate_factories(n, d, spec.max_bytes)
    held = np.sort(np.random.default_rng(spec.seed + 1).permutation(n)[: min(n_holdout, n)])
    Qh = PreparedRows(G.take(held), spec.metric, prepared=True)
    k = min(spec.k, n)
    _, exact_ix, _ = topk(Qh, G, k, spec.metric, prepared=True, backend="numpy")
    trials, best = [], None
    for factory in cands:
        built = build_index(G, factory, spec.metric, seed=spec.seed, n_train=spec.n_train)
        params, recall = tune(built, Qh, exact_ix, k, spec.metric, spec.min_recall)
        size = _serialized_bytes(built.index)
        fits = size <= spec.max_bytes
        trials.append({"factory": factory, "params": params, "recall": recall, "bytes": size, "fits": fits})
        estimate = estimated_index_bytes(factory, n, d)
        log.info(
            "auto index: %s %s recall@%d=%.4f, %d bytes (estimated %d)", factory, params, k, recall, size, estimate
        )
        if fits and (best is None or recall > best[1]):
            best = (built, recall)
        if fits and recall >= spec.min_recall:
            break
    if best is None:
        from featcache.errors import ConfigError

        raise ConfigError(f"no candidate index fits --max-memory {spec.max_bytes} bytes: {trials}; raise --max-memory")
    built, recall = best
    if recall < spec.min_recall:
        log.warning(
            "auto index: no candidate reaches recall@%d >= %s; %s has %.4f", k, spec.min_recall, built.factory, recall
        )
    built.provenance["auto"] = {
        "candidates": cands,
        "trials": trials,
        "min_recall": spec.min_recall,
        "max_bytes": spec.max_bytes,
        "k": k,
        "holdout_rows": held.tolist(),
        "source": "autofaiss get_optimal_index_keys_v2 (criteo/autofaiss 709c6dba)",
    }
    return built


def obtain_index(
    spec: IndexSpec,
    G: PreparedRows,
    gallery_fingerprint: str,
    cache: str,
    gallery_ids: Any = None,
    gallery: dict | None = None,
) -> BuiltIndex:
    """The index of ``spec`` over gallery ``G``: read back from the store's index folder when
    its record names the same gallery (fingerprint, rows, width, row ids ``gallery_ids``) and
    spec, its checksum matches and the index itself holds those rows (:func:`load_index`),
    else built (or chosen, for ``auto``) and stored. ``gallery``: where the gallery lies in
    the store (backbone, dataset, split, kind), recorded so ``featcache verify`` can tell a
    stale index. User-given nprobe/efSearch are set last."""
    where = spec.where or index_dir(cache)
    if spec.factory != AUTO:  # a search flag the index lacks fails before anything is built or written
        import faiss

        from featcache.retrieval.index import check_factory, faiss_metric

        check_factory(spec.factory, G.shape[1], spec.metric)
        probe = faiss.index_factory(G.shape[1], spec.factory, faiss_metric(spec.metric))
        set_search_params(probe, spec.factory, spec.nprobe, spec.ef_search)
    extra = (spec.max_bytes, spec.min_recall, spec.k) if spec.factory == AUTO else None
    name = spec.factory if extra is None else f"{spec.factory}|{extra}"
    key = index_key(gallery_fingerprint, name, spec.metric, spec.seed, spec.n_train)
    expect = {
        "gallery_fingerprint": gallery_fingerprint,
        "metric": spec.metric,
        "n_gallery": int(G.shape[0]),
        "dim": int(G.shape[1]),
        "key": key,
        **({"factory": spec.factory} if spec.factory != AUTO else {}),
        **({"gallery_ids_sha256": rows_digest(gallery_ids)} if gallery_ids is not None else {}),
    }
    built = load_index(where, key, expect, G)
    if built is not None:
        log.info("reusing stored index %s (%s, sha256 %s)", key, built.factory, built.provenance["sha256"][:12])
        stored = built.provenance.get("search_params", {})
        set_search_params(built.index, built.factory, stored.get("nprobe"), stored.get("ef_search"))
    else:
        check_index_dir(where)  # before the (long) build
        built = (
            choose_index(G, spec)
            if spec.factory == AUTO
            else build_index(G, spec.factory, spec.metric, seed=spec.seed, n_train=spec.n_train)
        )
        binding = {"gallery": gallery} if gallery else {}
        save_index(built, where, key, {**expect, **binding, "search_params": search_params(built.index)})
    set_search_params(built.index, built.factory, spec.nprobe, spec.ef_search)
    return built


def _metrics(sc, ix, relevance: Relevance, rows: np.ndarray, ks: Sequence[int]) -> dict[str, np.ndarray]:
    hits = relevance.is_positive(np.broadcast_to(rows[:, None], ix.shape), ix) & (ix >= 0)
    rr = ranks_from_hits(hits, relevance.n_relevant()[rows], scores=sc, depth=max(ks))
    return compute_metrics(rr, ks, full=False)


def evaluate_index(
    index: Any, Q: PreparedRows, relevance: Relevance, metric: str, ks: Sequence[int]
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Per-query @k metrics of the index's lists (one column more than max(ks), as the exact
    top-k path), and those lists."""
    sc, ix = approx_topk(index, Q, max(ks) + 1, metric, relevance)
    return _metrics(sc, ix, relevance, np.arange(Q.shape[0]), ks), sc, ix


def compare_with_exact(
    approx: tuple[dict[str, np.ndarray], np.ndarray],
    Q: PreparedRows,
    G: PreparedRows,
    relevance: Relevance,
    metric: str,
    ks: Sequence[int],
    *,
    n_sample: int = 1000,
    seed: int = 0,
    backend: str = "auto",
    max_memory: int | str = "2GB",
) -> tuple[dict[str, float], dict]:
    """``index_recall@k`` (approximate top-k against exact, excluded items removed in both),
    ``delta_{map,mrr,recall}@k`` (approximate minus exact mean) and beside each its distance
    from exact search ``absdelta_...`` (``|delta|``: a positive delta is not "better than
    exact", AP@k can rise when the index drops relevant items that exact search ranks low,
    since AP@k divides by the relevant items found in the top k) on a seeded sample of
    ``n_sample`` queries, searched exactly; and what was compared (for hparams)."""
    per_query, ix_a = approx
    nq = Q.shape[0]
    rows = np.sort(np.random.default_rng(seed).permutation(nq)[: min(n_sample, nq)])
    kk = max(ks) + 1
    depth = search_depth(kk, G.shape[0], relevance)
    Qs = PreparedRows(Q.take(rows), metric, prepared=True)
    sc_e, ix_e, used = topk(Qs, G, depth, metric, backend=backend, max_memory=max_memory, prepared=True)
    sc_e, ix_e, _ = drop_excluded(sc_e, ix_e, kk, relevance, rows)
    exact = summarize(_metrics(sc_e, ix_e, relevance, rows, ks), relevance.n_relevant()[rows])[0]
    approx_s = summarize({m: v[rows] for m, v in per_query.items()}, relevance.n_relevant()[rows])[0]
    out = {f"index_recall@{k}": float(np.nanmean(topk_recall(ix_a[rows, :k], ix_e[:, :k]))) for k in ks}
    for name, value in approx_s.items():
        if name.split("@")[0] in DELTA_METRICS:
            out[f"delta_{name}"] = value - exact[name]
            out[f"absdelta_{name}"] = abs(value - exact[name])
    return out, {"n_compared_queries": int(rows.size), "exact_backend": used}
