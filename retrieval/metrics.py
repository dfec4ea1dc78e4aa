"""Retrieval metrics, pure numpy.

Every metric is computed from the **ranks of a query's relevant items** in its ranking of
the gallery, stored for many queries at once in CSR form: ``indptr`` (``[Q + 1]``) and
``ranks`` (1-based, strictly increasing within a query), plus ``n_relevant`` (``[Q]``, the
number R_q of relevant gallery items of query q, which can exceed the number of ranks known
when only the top K of the ranking was searched).

Definitions (q a query, R = R_q its number of relevant items, r_1 < r_2 < ... < r_R the
ranks of its relevant items, rel(i) = 1 if the item at rank i is relevant):

* ``precision@k`` = |{m : r_m <= k}| / k. The denominator is k even when the gallery holds
  fewer than k items (missing positions are non-relevant, as in trec_eval's P@k).
* ``recall@k``    = |{m : r_m <= k}| / R   (fraction of the relevant items found in the top k).
* ``hit@k``       = 1 if r_1 <= k else 0  (often also called "recall@k" in papers).
* ``mrr``         = 1 / r_1 (0 when no relevant item is ranked; ``mrr@k``: 0 when r_1 > k).
* ``map``         = AP = (1/R) * sum_m m / r_m  (mean over queries); this equals
  sum_i P(i) rel(i) / R with P(i) = precision at rank i, i.e. scikit-learn's
  ``average_precision_score`` on a ranking without ties.
* ``map@k``       = AP@k = (1/min(R, k)) * sum_{m : r_m <= k} m / r_m.

Queries with R = 0 have no defined value: they are excluded from every mean and counted
(:func:`summarize`).

Tie policy (the rankings are built by :mod:`featcache.retrieval.search` and
:mod:`featcache.retrieval.ranking`): gallery items are ordered by similarity, descending,
and items with exactly equal similarity by their **gallery index** (row order of the
gallery split, ascending). The query itself (matched by id) and junk items are removed
before ranks are counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "RankedRelevance",
    "ranks_from_hits",
    "ranks_from_scores",
    "precision_at_k",
    "recall_at_k",
    "hit_at_k",
    "reciprocal_rank",
    "average_precision",
    "compute_metrics",
    "summarize",
]


class RankedRelevance:
    """Ranks of the relevant items of Q queries (CSR) and their numbers of relevant items.

    ``depth`` is how deep the ranking is known: ``None`` for the full ranking, K when only
    the top K was searched (metrics needing ranks beyond K then raise).
    """

    __slots__ = ("indptr", "ranks", "n_relevant", "depth")

    def __init__(self, indptr, ranks, n_relevant, depth: int | None = None):
        self.indptr = np.asarray(indptr, dtype=np.int64)
        self.ranks = np.asarray(ranks, dtype=np.int64)
        self.n_relevant = np.asarray(n_relevant, dtype=np.int64)
        self.depth = depth
        if self.indptr.ndim != 1 or self.indptr.size != self.n_relevant.size + 1:
            raise ValueError("indptr must have one entry more than n_relevant")
        if self.indptr[-1] != self.ranks.size:
            raise ValueError("indptr[-1] must equal the number of ranks")
        counts = np.diff(self.indptr)
        if np.any(counts > self.n_relevant):
            raise ValueError("a query has more ranked relevant items than n_relevant")
        if depth is None and np.any(counts != self.n_relevant):
            raise ValueError("a full ranking must rank every relevant item (counts != n_relevant)")

    @property
    def n_queries(self) -> int:
        return int(self.n_relevant.size)

    def query_index(self) -> np.ndarray:
        """Query number of each entry of ``ranks``."""
        return np.repeat(np.arange(self.n_queries), np.diff(self.indptr))

    def position(self) -> np.ndarray:
        """m (1-based position among the query's relevant items) of each entry of ``ranks``."""
        return np.arange(self.ranks.size) - np.repeat(self.indptr[:-1], np.diff(self.indptr)) + 1

    def _need(self, k: int | None, name: str) -> None:
        if self.depth is not None and (k is None or k > self.depth):
            raise ValueError(
                f"{name} needs ranks up to {k or 'the end'} but only the top {self.depth} were "
                "searched; search deeper or use the full ranking"
            )


def ranks_from_hits(hits: np.ndarray, n_relevant: np.ndarray, *, full: bool = False) -> RankedRelevance:
    """Build :class:`RankedRelevance` from a boolean ``hits[q, i]`` (item at rank i+1 of query
    q is relevant). ``full=True`` when the rows are complete rankings of the gallery."""
    hits = np.asarray(hits, dtype=bool)
    if hits.ndim != 2:
        raise ValueError("hits must be 2-D [queries, ranks]")
    q, col = np.nonzero(hits)  # row-major: sorted by query then rank
    indptr = np.zeros(hits.shape[0] + 1, dtype=np.int64)
    np.cumsum(hits.sum(axis=1), out=indptr[1:])
    return RankedRelevance(indptr, col + 1, n_relevant, depth=None if full else hits.shape[1])


def ranks_from_scores(scores: np.ndarray, relevant: np.ndarray, exclude: np.ndarray | None = None) -> np.ndarray:
    """Reference (one query): ranks of the relevant items under the tie policy.

    ``scores`` [G] similarities, ``relevant`` [G] bool, ``exclude`` [G] bool (removed before
    ranking). Sorting key: (-score, gallery index). O(G log G); used for small cases and as
    the exact fallback when similarities tie.
    """
    scores = np.asarray(scores)
    keep = np.ones(scores.shape[0], bool) if exclude is None else ~np.asarray(exclude, bool)
    idx = np.flatnonzero(keep)
    order = idx[np.lexsort((idx, -scores[idx]))]
    return np.flatnonzero(np.asarray(relevant, bool)[order]) + 1


# ---------------------------------------------------------------- per-query metrics


def _count_within(rr: RankedRelevance, k: int) -> np.ndarray:
    return np.bincount(rr.query_index(), weights=rr.ranks <= k, minlength=rr.n_queries)


def precision_at_k(rr: RankedRelevance, k: int) -> np.ndarray:
    """Per query: |{m : r_m <= k}| / k (NaN where R = 0)."""
    rr._need(k, f"precision@{k}")
    return np.where(rr.n_relevant > 0, _count_within(rr, k) / float(k), np.nan)


def recall_at_k(rr: RankedRelevance, k: int) -> np.ndarray:
    """Per query: |{m : r_m <= k}| / R (NaN where R = 0)."""
    rr._need(k, f"recall@{k}")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(rr.n_relevant > 0, _count_within(rr, k) / rr.n_relevant, np.nan)


def hit_at_k(rr: RankedRelevance, k: int) -> np.ndarray:
    """Per query: 1 if r_1 <= k else 0 (NaN where R = 0)."""
    rr._need(k, f"hit@{k}")
    return np.where(rr.n_relevant > 0, (_count_within(rr, k) > 0).astype(float), np.nan)


def reciprocal_rank(rr: RankedRelevance, k: int | None = None) -> np.ndarray:
    """Per query: 1 / r_1, 0 if r_1 > k (or nothing ranked), NaN where R = 0.

    ``k=None``: the full ranking (needs ``depth=None``)."""
    if k is None:
        rr._need(None, "mrr")
    else:
        rr._need(k, f"mrr@{k}")
    counts = np.diff(rr.indptr)
    out = np.zeros(rr.n_queries)
    has = counts > 0
    first = rr.ranks[rr.indptr[:-1][has]]
    val = 1.0 / first
    if k is not None:
        val = np.where(first <= k, val, 0.0)
    out[has] = val
    return np.where(rr.n_relevant > 0, out, np.nan)


def average_precision(rr: RankedRelevance, k: int | None = None) -> np.ndarray:
    """Per query: AP = (1/R) sum_m m / r_m (``k=None``, full ranking) or
    AP@k = (1/min(R, k)) sum_{m : r_m <= k} m / r_m. NaN where R = 0."""
    if k is None:
        rr._need(None, "map")
        w = rr.position() / rr.ranks
        denom = rr.n_relevant.astype(float)
    else:
        rr._need(k, f"map@{k}")
        w = np.where(rr.ranks <= k, rr.position() / rr.ranks, 0.0)
        denom = np.minimum(rr.n_relevant, k).astype(float)
    s = np.bincount(rr.query_index(), weights=w, minlength=rr.n_queries)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(rr.n_relevant > 0, s / denom, np.nan)


def _metric_names(ks: Sequence[int], full: bool) -> list[str]:
    names = ["map", "mrr"] if full else []
    for k in ks:
        names += [f"map@{k}", f"mrr@{k}", f"recall@{k}", f"hit@{k}", f"precision@{k}"]
    return names


def compute_metrics(rr: RankedRelevance, ks: Iterable[int], *, full: bool | None = None) -> dict[str, np.ndarray]:
    """All metrics per query: ``map``/``mrr`` (full ranking only) and for each k
    ``map@k``, ``mrr@k``, ``recall@k``, ``hit@k``, ``precision@k``. Values are NaN for
    queries without relevant items."""
    ks = sorted({int(k) for k in ks})
    if any(k < 1 for k in ks):
        raise ValueError(f"k must be >= 1, got {ks}")
    full = rr.depth is None if full is None else full
    out: dict[str, np.ndarray] = {}
    if full:
        out["map"] = average_precision(rr)
        out["mrr"] = reciprocal_rank(rr)
    for k in ks:
        out[f"map@{k}"] = average_precision(rr, k)
        out[f"mrr@{k}"] = reciprocal_rank(rr, k)
        out[f"recall@{k}"] = recall_at_k(rr, k)
        out[f"hit@{k}"] = hit_at_k(rr, k)
        out[f"precision@{k}"] = precision_at_k(rr, k)
    return out


def summarize(per_query: dict[str, np.ndarray], n_relevant: np.ndarray) -> tuple[dict[str, float], int, int]:
    """Means over the queries that have at least one relevant item.

    Returns ``(means, n_scored, n_without_relevant)``."""
    n_relevant = np.asarray(n_relevant)
    scored = n_relevant > 0
    n_scored = int(scored.sum())
    means = {
        name: (float(np.mean(v[scored])) if n_scored else float("nan")) for name, v in per_query.items()
    }
    return means, n_scored, int((~scored).sum())
