"""Retrieval metrics, pure numpy.

Every metric is computed from the **ranks of a query's relevant items**, stored for many
queries at once in CSR form: ``indptr`` (``[Q + 1]``), ``ranks`` (1-based, non-decreasing
within a query) and ``tp`` (for each relevant item, the number of relevant items ranked at
or above it), plus ``n_relevant`` (``[Q]``, the number R of relevant gallery items of each
query, which can exceed the number of ranks known when only the top K was searched).

Tie policy (one, deterministic, the one of scikit-learn's ``average_precision_score``):
items with exactly equal similarity form a **tie group that is ranked as a block**; every
item of the group gets the rank of the group's last position. For a relevant item p with
similarity s_p (after removing the query itself, matched by id, and junk items):

    r_p  = #{items i : s_i >= s_p}                (its rank)
    tp_p = #{relevant items i : s_i >= s_p}       (relevant items ranked at or above it)

Without ties r_p is the usual rank and tp_p its position m among the relevant items. The
policy depends on similarities only: metrics do not change when the gallery is reordered,
and no backend's way of ordering equal scores can leak into them.

Definitions (R relevant items p with rank r_p and tp_p; "p in top k" means r_p <= k, i.e.
its whole tie group lies within the first k positions):

* ``map``         = AP = (1/R) * sum_p tp_p / r_p  (mean over queries). Without ties this is
  (1/R) sum_m m / r_m = sum_i P(i) rel(i) / R; with ties it is exactly
  ``sklearn.metrics.average_precision_score`` (precision taken at the end of each tie group).
* ``map@k``       = AP@k = (1/min(R, k)) * sum_{p : r_p <= k} tp_p / r_p.
* ``mrr``         = 1 / min_p r_p  (``mrr@k``: 0 when min_p r_p > k).
* ``recall@k``    = |{p : r_p <= k}| / R   (fraction of the relevant items found in the top k).
* ``hit@k``       = 1 if min_p r_p <= k else 0  (what many papers call "Recall@k").
* ``precision@k`` = |{p : r_p <= k}| / k. The denominator stays k when the gallery holds
  fewer than k items (missing positions are non-relevant, as in trec_eval's P@k).

Queries with R = 0 have no defined value (NaN per query): they are excluded from every mean
and counted (:func:`summarize`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from featcache.core.registry import Registry
from featcache.errors import MetricInputError

__all__ = [
    "RETRIEVAL_METRICS",
    "RankedRelevance",
    "RetrievalMetric",
    "average_precision",
    "compute_metrics",
    "hit_at_k",
    "precision_at_k",
    "ranks_from_hits",
    "ranks_from_scores",
    "recall_at_k",
    "reciprocal_rank",
    "register_retrieval_metric",
    "summarize",
    "written_metric_names",
]


class RankedRelevance:
    """Ranks (and tp counts) of the relevant items of Q queries, CSR, plus their numbers of
    relevant items.

    ``depth`` is how deep the ranking is known: ``None`` for the full ranking, K when only
    the top K was searched (entries only for ranks <= K; metrics needing more raise).
    ``tp=None`` means no ties: tp is the position among the query's entries (1, 2, ...).
    """

    __slots__ = ("depth", "indptr", "n_relevant", "ranks", "tp")

    def __init__(
        self,
        indptr: ArrayLike,
        ranks: ArrayLike,
        n_relevant: ArrayLike,
        depth: int | None = None,
        tp: ArrayLike | None = None,
    ):
        self.indptr = np.asarray(indptr, dtype=np.int64)
        self.ranks = np.asarray(ranks, dtype=np.int64)
        self.n_relevant = np.asarray(n_relevant, dtype=np.int64)
        self.depth = depth
        if self.indptr.ndim != 1 or self.indptr.size != self.n_relevant.size + 1:
            raise MetricInputError("indptr must have one entry more than n_relevant")
        if self.indptr[-1] != self.ranks.size:
            raise MetricInputError("indptr[-1] must equal the number of ranks")
        counts = np.diff(self.indptr)
        if np.any(counts > self.n_relevant):
            raise MetricInputError("a query has more ranked relevant items than n_relevant")
        if depth is None and np.any(counts != self.n_relevant):
            raise MetricInputError("a full ranking must rank every relevant item (counts != n_relevant)")
        if tp is None:
            tp = np.arange(self.ranks.size) - np.repeat(self.indptr[:-1], counts) + 1
        self.tp = np.asarray(tp, dtype=np.int64)
        if self.tp.shape != self.ranks.shape:
            raise MetricInputError("tp must have one entry per rank")
        if self.ranks.size:
            same_q = np.repeat(np.arange(counts.size), counts)
            step = np.diff(self.ranks)
            if np.any((step < 0) & (np.diff(same_q) == 0)):
                raise MetricInputError("ranks must be non-decreasing within each query")
            if np.any(self.tp > self.ranks) or np.any(self.ranks < 1):
                raise MetricInputError("need 1 <= tp <= rank for every entry")

    @property
    def n_queries(self) -> int:
        return int(self.n_relevant.size)

    def query_index(self) -> np.ndarray:
        """Query number of each entry of ``ranks``."""
        return np.repeat(np.arange(self.n_queries), np.diff(self.indptr))

    def _need(self, k: int | None, name: str) -> None:
        if self.depth is not None and (k is None or k > self.depth):
            raise MetricInputError(
                f"{name} needs ranks up to {k or 'the end'} but only the top {self.depth} were "
                "searched; search deeper or use the full ranking"
            )


def _group_end(scores: np.ndarray) -> np.ndarray:
    """For rows sorted by score descending: index of the last column of each column's tie group."""
    K = scores.shape[1]
    is_end = np.ones(scores.shape, bool)
    is_end[:, :-1] = scores[:, :-1] != scores[:, 1:]
    j = np.where(is_end, np.arange(K), K)
    return np.minimum.accumulate(j[:, ::-1], axis=1)[:, ::-1]


def ranks_from_hits(
    hits: np.ndarray,
    n_relevant: np.ndarray,
    *,
    scores: np.ndarray | None = None,
    depth: int | None = None,
    full: bool = False,
) -> RankedRelevance:
    """:class:`RankedRelevance` from ranked lists: ``hits[q, i]`` is True when the item at
    list position i+1 of query q is relevant; ``scores[q, i]`` its similarity (rows sorted
    descending), used to apply the tie policy (``None``: no ties).

    ``depth``: the ranks known exactly (default: all columns, or the full ranking when
    ``full``). Pass one column more than ``depth`` so a tie group crossing the cut-off is
    seen; entries ranked beyond ``depth`` are dropped.
    """
    hits = np.asarray(hits, dtype=bool)
    if hits.ndim != 2:
        raise MetricInputError("hits must be 2-D [queries, ranks]")
    Q, K = hits.shape
    if depth is None:
        depth = K
    cum = np.cumsum(hits, axis=1)
    end = np.broadcast_to(np.arange(K), hits.shape) if scores is None else _group_end(np.asarray(scores))
    rank = end + 1
    tp = np.take_along_axis(cum, end, axis=1)
    keep = hits & (rank <= depth)
    q, col = np.nonzero(keep)  # row-major: by query, then position (ranks non-decreasing)
    indptr = np.zeros(Q + 1, dtype=np.int64)
    np.cumsum(keep.sum(axis=1), out=indptr[1:])
    return RankedRelevance(indptr, rank[q, col], n_relevant, depth=None if full else depth, tp=tp[q, col])


def ranks_from_scores(
    scores: np.ndarray, relevant: np.ndarray, exclude: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One query: ``(ranks, tp)`` of its relevant items under the tie policy, ranks sorted.

    ``scores`` [G] similarities, ``relevant`` [G] bool, ``exclude`` [G] bool (removed).
    """
    scores = np.asarray(scores)
    keep = np.ones(scores.shape[0], bool) if exclude is None else ~np.asarray(exclude, bool)
    rel = np.asarray(relevant, bool) & keep
    kept = np.sort(scores[keep])
    pv = np.sort(scores[rel])
    r = kept.size - np.searchsorted(kept, pv, "left")
    tp = pv.size - np.searchsorted(pv, pv, "left")
    return r[::-1].astype(np.int64), tp[::-1].astype(np.int64)


# ---------------------------------------------------------------- per-query metrics


def _count_within(rr: RankedRelevance, k: int) -> np.ndarray:
    return np.bincount(rr.query_index(), weights=rr.ranks <= k, minlength=rr.n_queries)


def precision_at_k(rr: RankedRelevance, k: int) -> np.ndarray:
    """Per query: |{p : r_p <= k}| / k (NaN where R = 0)."""
    rr._need(k, f"precision@{k}")
    return np.where(rr.n_relevant > 0, _count_within(rr, k) / float(k), np.nan)


def recall_at_k(rr: RankedRelevance, k: int) -> np.ndarray:
    """Per query: |{p : r_p <= k}| / R (NaN where R = 0)."""
    rr._need(k, f"recall@{k}")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(rr.n_relevant > 0, _count_within(rr, k) / rr.n_relevant, np.nan)


def hit_at_k(rr: RankedRelevance, k: int) -> np.ndarray:
    """Per query: 1 if min_p r_p <= k else 0 (NaN where R = 0)."""
    rr._need(k, f"hit@{k}")
    return np.where(rr.n_relevant > 0, (_count_within(rr, k) > 0).astype(float), np.nan)


def reciprocal_rank(rr: RankedRelevance, k: int | None = None) -> np.ndarray:
    """Per query: 1 / min_p r_p, 0 if that rank is > k (or nothing ranked), NaN where R = 0.

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
    """Per query: AP = (1/R) sum_p tp_p / r_p (``k=None``, full ranking) or
    AP@k = (1/min(R, k)) sum_{p : r_p <= k} tp_p / r_p. NaN where R = 0."""
    if k is None:
        rr._need(None, "map")
        w = rr.tp / rr.ranks
        denom = rr.n_relevant.astype(float)
    else:
        rr._need(k, f"map@{k}")
        w = np.where(rr.ranks <= k, rr.tp / rr.ranks, 0.0)
        denom = np.minimum(rr.n_relevant, k).astype(float)
    s = np.bincount(rr.query_index(), weights=w, minlength=rr.n_queries)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(rr.n_relevant > 0, s / denom, np.nan)


@dataclass(frozen=True)
class RetrievalMetric:
    """A registered retrieval metric: ``fn(rr)`` / ``fn(rr, k)`` gives its per-query values;
    ``full``: written as ``NAME`` on a full ranking; ``at_k``: written as ``NAME@k`` for each
    k; ``source``: ``"featcache"`` (:func:`compute_metrics` computes it) or ``"bob"`` (Battle
    of the Backbones' definitions, written beside them by ``featcache retrieve``)."""

    name: str
    fn: Callable[..., Any]
    full: bool
    at_k: bool
    source: str = "featcache"


#: registered retrieval metrics, in the order their values are written
RETRIEVAL_METRICS: Registry[RetrievalMetric] = Registry(
    "retrieval metric", MetricInputError, key=lambda m: m.fn, idempotent=False
)


def register_retrieval_metric(name: str, *, full: bool, at_k: bool, source: str = "featcache") -> Callable:
    """Decorator: register ``fn`` as retrieval metric ``name`` (a taken name is refused)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        usage = f"{name}[@k]" if full and at_k else f"{name}@k" if at_k else name
        note = "Battle of the Backbones" if source == "bob" else ""
        RETRIEVAL_METRICS.register(name, RetrievalMetric(name, fn, full, at_k, source), usage=usage, note=note)
        return fn

    return deco


def written_metric_names() -> tuple[str, ...]:
    """The metric names ``featcache retrieve`` writes, ``NAME`` or ``NAME@k`` (k any k):
    every registered metric, Battle of the Backbones' included (the package's ``__init__``
    imports :mod:`~featcache.retrieval.revisited`, where they register, before any module of
    the package runs: this registry imports none of its members)."""
    out: list[str] = []
    for m in RETRIEVAL_METRICS.values():
        out += [m.name] * m.full + [f"{m.name}@k"] * m.at_k
    return tuple(out)


register_retrieval_metric("map", full=True, at_k=True)(average_precision)
register_retrieval_metric("mrr", full=True, at_k=True)(reciprocal_rank)
register_retrieval_metric("recall", full=False, at_k=True)(recall_at_k)
register_retrieval_metric("hit", full=False, at_k=True)(hit_at_k)
register_retrieval_metric("precision", full=False, at_k=True)(precision_at_k)


def compute_metrics(rr: RankedRelevance, ks: Iterable[int], *, full: bool | None = None) -> dict[str, np.ndarray]:
    """Every registered featcache metric per query: those with ``full`` (``map``, ``mrr``) on
    a full ranking only, then for each k each ``at_k`` one (``map@k``, ``mrr@k``,
    ``recall@k``, ``hit@k``, ``precision@k``). Values are NaN for queries without relevant
    items."""
    ks = sorted({int(k) for k in ks})
    if any(k < 1 for k in ks):
        raise MetricInputError(f"k must be >= 1, got {ks}")
    full = rr.depth is None if full is None else full
    ours = [m for m in RETRIEVAL_METRICS.values() if m.source == "featcache"]
    out: dict[str, np.ndarray] = {}
    if full:
        out.update({m.name: m.fn(rr) for m in ours if m.full})
    for k in ks:
        out.update({f"{m.name}@{k}": m.fn(rr, k) for m in ours if m.at_k})
    return out


def summarize(per_query: dict[str, np.ndarray], n_relevant: np.ndarray) -> tuple[dict[str, float], int, int]:
    """Means over the queries that have at least one relevant item.

    Returns ``(means, n_scored, n_without_relevant)``."""
    n_relevant = np.asarray(n_relevant)
    scored = n_relevant > 0
    n_scored = int(scored.sum())
    means = {name: (float(np.mean(v[scored])) if n_scored else float("nan")) for name, v in per_query.items()}
    return means, n_scored, int((~scored).sum())
