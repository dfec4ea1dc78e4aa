"""One sort per query row: the ranks of its relevant items under both tie rules.

A block of score rows is sorted once (descending; excluded items, the query itself and junk,
are set to -inf first, so they sort last and never count above an item). The relevance
flags gathered in that order give every relevant item's position, which is its rank:

* ``ties="index"`` (Battle of the Backbones' stable argsort of the negated scores): the
  position itself, and tp = 1..R;
* ``ties="block"`` (:mod:`featcache.retrieval.metrics`): the position of the last item of
  its tie group, and tp = the relevant items up to there.

The two differ only in rows where a relevant item's score equals a neighbour's in the sorted
row; those rows (rare with real features) are sorted again with a stable sort and their tie
groups found by binary search in the sorted scores. Every other row needs nothing more than
the unstable (SIMD) sort. The per-query metrics then come from cumulative counts over these
ranks (:func:`block_metrics`), shared by the numpy and the torch paths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from featcache.errors import InternalError
from featcache.retrieval.metrics import RankedRelevance, compute_metrics

__all__ = ["SortedRanks", "block_metrics", "rank_block", "rank_sorted", "tie_row_ranks"]


@dataclass
class SortedRanks:
    """Ranks of the relevant items of a block of b queries, CSR (``indptr`` [b + 1]), ranks
    ascending within a query: ``r_index``/``tp`` 1..R under ``ties="index"``; ``r_block``
    and ``tp_block`` under ``ties="block"`` (the same arrays where a block has no ties)."""

    indptr: np.ndarray
    r_index: np.ndarray
    r_block: np.ndarray
    tp_block: np.ndarray

    def tp_index(self) -> np.ndarray:
        counts = np.diff(self.indptr)
        return np.arange(self.r_index.size, dtype=np.int64) - np.repeat(self.indptr[:-1], counts) + 1

    def ranked(self, n_relevant: np.ndarray, ties: str) -> RankedRelevance:
        if ties == "index":
            return RankedRelevance(self.indptr, self.r_index, n_relevant, tp=None)
        return RankedRelevance(self.indptr, self.r_block, n_relevant, tp=self.tp_block)


def tie_row_ranks(neg_scores: np.ndarray, positive: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row with ties: ``(r_index, r_block, tp_block)`` of its relevant items.

    ``neg_scores``: the negated scores of the row (excluded items +inf); ``positive``: its
    relevance flags in gallery order. A stable ascending sort of the negated scores is
    Battle of the Backbones' order; a tie group ends where the sorted value changes."""
    order = np.argsort(neg_scores, kind="stable")
    pos = np.flatnonzero(positive[order])
    ss = neg_scores[order]
    end = np.searchsorted(ss, ss[pos], "right") - 1  # last position of each one's tie group
    tp = np.searchsorted(pos, end, "right")  # relevant items up to there
    return (pos + 1).astype(np.int64), (end + 1).astype(np.int64), tp.astype(np.int64)


#: group-bound steps walked per tied item before its row is ranked by a stable sort instead
MAX_STEPS = 64
#: (tied item, group member) pairs compared at once before rows go to the stable sort instead
MAX_PAIRS = 1 << 22


def _walk(val, flat: np.ndarray, c: np.ndarray, v: np.ndarray, n: int, step: int):
    """Walk from sorted positions ``c`` (row offsets ``flat``) while the neighbour's score
    equals ``v``: the first (step -1) or last (+1) position of each tie group, and which
    items needed more than :data:`MAX_STEPS` steps."""
    e = c.copy()
    active = np.arange(c.size)
    for _ in range(MAX_STEPS):
        nxt = e[active] + step
        inside = (nxt >= 0) & (nxt < n)
        same = np.zeros(active.size, bool)
        same[inside] = val(flat[active[inside]] + nxt[inside]) == v[active[inside]]
        active = active[same]
        e[active] += step
        if active.size == 0:
            break
    return e, active


def rank_sorted(
    b: int,
    n: int,
    r: np.ndarray,
    c: np.ndarray,
    val: Callable[[np.ndarray], np.ndarray],
    idx: Callable[[np.ndarray], np.ndarray],
    tie_row: Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> SortedRanks:
    """:class:`SortedRanks` of b rows of n items sorted ascending by negated score (excluded
    items +inf, last) from the (row ``r``, position ``c``) of each relevant item, row-major.

    ``val(p)``/``idx(p)``: the negated score / gallery index at flat sorted positions ``p``
    (row * n + position; numpy or a device's lookups); ``tie_row(i)``: the exact
    :func:`tie_row_ranks` of row i. Ties are resolved where a relevant item's neighbour scores
    the same: the block rule ranks it at its group's end, the index rule orders the group by
    gallery index (counting the members with a smaller index)."""
    indptr = np.zeros(b + 1, np.int64)
    np.cumsum(np.bincount(r, minlength=b), out=indptr[1:])
    c = c.astype(np.int64)
    r_index = c + 1
    tp = np.arange(r_index.size, dtype=np.int64) - np.repeat(indptr[:-1], np.diff(indptr)) + 1
    if r.size == 0:
        return SortedRanks(indptr, r_index, r_index, tp)
    flat = r.astype(np.int64) * n
    v = val(flat + c)
    tied = np.zeros(c.size, bool)
    tied[c > 0] = val(flat[c > 0] + c[c > 0] - 1) == v[c > 0]
    last = c < n - 1
    tied[last] |= val(flat[last] + c[last] + 1) == v[last]
    t = np.flatnonzero(tied)
    if t.size == 0:
        return SortedRanks(indptr, r_index, r_index, tp)
    start, slow_a = _walk(val, flat[t], c[t], v[t], n, -1)
    end, slow_b = _walk(val, flat[t], c[t], v[t], n, +1)
    r_block = r_index.copy()
    keys = r.astype(np.int64) * (n + 1) + c  # ascending: row-major nonzero
    r_block[t] = end + 1
    tp[t] = np.searchsorted(keys, r[t] * (n + 1) + end, "right") - indptr[r[t]]
    sizes = end - start + 1
    slow = set(r[t[slow_a]].tolist()) | set(r[t[slow_b]].tolist())
    if int(sizes.sum()) > MAX_PAIRS:
        slow |= set(r[t].tolist())
    else:  # index rule: a member ranks after the group's members with a smaller gallery index
        rep = np.repeat(np.arange(t.size), sizes)
        offs = np.arange(rep.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        smaller = idx(flat[t][rep] + start[rep] + offs) < idx(flat[t] + c[t])[rep]
        ri = start + np.bincount(rep, weights=smaller, minlength=t.size).astype(np.int64) + 1
        r_index[t] = np.sort(r[t] * (n + 1) + ri) - r[t] * (n + 1)  # slots of a row's groups, ascending
    for i in sorted(slow):
        lo, hi = indptr[i], indptr[i + 1]
        ri, rb, tb = tie_row(i)
        if ri.size != hi - lo:
            raise InternalError("internal error: a tie row's relevant items changed count")
        r_index[lo:hi], r_block[lo:hi], tp[lo:hi] = ri, rb, tb
    return SortedRanks(indptr, r_index, r_block, tp)


def rank_block(neg_scores: np.ndarray, positive: np.ndarray) -> SortedRanks:
    """:class:`SortedRanks` of a block of rows, one sort each (numpy).

    ``neg_scores`` [b, G]: the negated scores, excluded items +inf (a scratch buffer: left
    as it is); ``positive`` [b, G] bool relevance flags in gallery order."""
    b, n = neg_scores.shape
    order = np.argsort(neg_scores, axis=1)  # ascending negated = descending scores; SIMD, unstable
    r, c = np.nonzero(np.take_along_axis(positive, order, axis=1))  # row-major: by row, then position
    of, sf = order.ravel(), neg_scores.ravel()

    def val(p):
        return sf[(p // n) * n + of[p]]

    def idx(p):
        return of[p]

    return rank_sorted(b, n, r, c, val, idx, lambda i: tie_row_ranks(neg_scores[i], positive[i]))


def block_metrics(
    sr: SortedRanks, n_relevant: np.ndarray, ks: Sequence[int], bob: bool = False
) -> dict[str, np.ndarray]:
    """Per-query metrics of a block from its ranks: featcache's (``map``, ``mrr`` and every @k
    one, under the block rule) and, with ``bob``, Battle of the Backbones' per query
    (``map_bob``, ``mp@k``, and ``rr_bob`` = 1/first rank, 0 without positives) under the
    index rule. AP is a cumulative sum of tp/r per row; @k metrics read the ranks <= max(ks)."""
    n_relevant = np.asarray(n_relevant, np.int64)
    b = n_relevant.size
    counts = np.diff(sr.indptr)
    if np.any(counts != n_relevant):
        raise InternalError("internal error: ranked relevant items != number of relevant items")
    q = np.repeat(np.arange(b), counts)
    has = counts > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        ap = np.bincount(q, weights=sr.tp_block / sr.r_block, minlength=b) / n_relevant
    first = np.zeros(b)
    first[has] = 1.0 / sr.r_block[sr.indptr[:-1][has]]
    out = {"map": np.where(has, ap, np.nan), "mrr": np.where(has, first, np.nan)}
    kmax = max(ks)
    cut = sr.r_block <= kmax
    indptr = np.zeros(b + 1, np.int64)
    np.cumsum(np.bincount(q[cut], minlength=b), out=indptr[1:])
    rr = RankedRelevance(indptr, sr.r_block[cut], n_relevant, depth=kmax, tp=sr.tp_block[cut])
    out.update(compute_metrics(rr, ks, full=False))
    if bob:
        out.update(_bob_metrics(sr, q, n_relevant, ks))
    return out


def _bob_metrics(sr: SortedRanks, q: np.ndarray, n_relevant: np.ndarray, ks: Sequence[int]) -> dict[str, np.ndarray]:
    """revisitop's trapezoidal AP, mP@k and the reciprocal first rank, in BoB's order (the
    formulas of :mod:`featcache.retrieval.revisited`)."""
    b = n_relevant.size
    has = n_relevant > 0
    r = (sr.r_index - 1).astype(np.float64)
    j = (sr.tp_index() - 1).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        p0 = np.where(r == 0, 1.0, j / np.where(r == 0, 1.0, r))
        s = np.bincount(q, weights=(p0 + (j + 1.0) / (r + 1.0)) / 2.0, minlength=b)
        out = {"map_bob": np.where(has, s / n_relevant, np.nan)}
    last = np.zeros(b, np.int64)
    last[has] = sr.r_index[sr.indptr[1:][has] - 1]
    kmax = max(ks)
    cut = sr.r_index <= kmax
    qc, rc = q[cut], sr.r_index[cut]
    for k in ks:
        kq = np.minimum(last, int(k))
        within = np.bincount(qc, weights=rc <= kq[qc], minlength=b)
        out[f"mp@{k}"] = np.where(has, within / np.maximum(kq, 1), np.nan)
    rr = np.zeros(b)
    rr[has] = 1.0 / sr.r_index[sr.indptr[:-1][has]]
    out["rr_bob"] = rr
    return out
