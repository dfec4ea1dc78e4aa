"""Nearest training rows by cosine, the near-duplicate threshold, and kNN top-1: pure numpy
functions for the audit (no other stage's code).

:func:`cosine_topk` scores query blocks against training blocks (``[bq, bg]`` at a time, never
``[nq, ng]``) and keeps each query's ``k`` best; :func:`default_threshold` picks the cosine
above which a query's nearest training row counts as a near-duplicate from the distribution
of those nearest-neighbour cosines; :func:`knn_top1` is the temperature-weighted kNN vote
(DINO's ``knn_classifier``: weights ``exp(s / T)``) on the neighbours found.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from featcache.core.metrics import top1
from featcache.errors import DataError

__all__ = ["NEAR_FRACTION", "cosine_topk", "default_threshold", "knn_top1", "unit_rows"]

#: a near-duplicate is closer than this fraction of the median nearest-neighbour distance
NEAR_FRACTION = 0.1


def unit_rows(X: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (float32; all-zero rows stay zero)."""
    X = np.asarray(X, np.float32)
    n = np.linalg.norm(X, axis=1, keepdims=True)
    return X / np.maximum(n, 1e-12)


def _blocks(X, rows: int) -> Iterator[tuple[int, np.ndarray]]:
    if hasattr(X, "iter_raw"):
        for s, _, block in X.iter_raw(rows):
            yield s, block
        return
    for s in range(0, X.shape[0], rows):
        yield s, np.asarray(X[s : s + rows])


def cosine_topk(Q: Any, G: Any, k: int, *, block_rows: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """``(cosines [nq, k], gallery rows [nq, k])``, best first, of each query row's ``k``
    nearest rows of ``G`` by cosine. ``Q`` and ``G`` are arrays or lazy stored views (read
    in blocks of ``block_rows``). Exactly tied cosines are kept in no particular order."""
    nq, ng = Q.shape[0], G.shape[0]
    if Q.shape[1] != G.shape[1]:
        raise DataError(f"query width {Q.shape[1]} != training width {G.shape[1]}; use one backbone's features")
    k = min(int(k), ng)
    if k < 1:
        raise DataError("the training split has no rows to search")
    best_s = np.full((nq, k), -np.inf, np.float32)
    best_i = np.zeros((nq, k), np.int64)
    for qs, qb in _blocks(Q, block_rows):
        q = unit_rows(qb)
        bs, bi = best_s[qs : qs + len(q)], best_i[qs : qs + len(q)]
        for gs, gb in _blocks(G, block_rows):
            S = q @ unit_rows(gb).T
            top = (
                np.argpartition(-S, k - 1, axis=1)[:, :k]
                if S.shape[1] > k
                else np.broadcast_to(np.arange(S.shape[1]), S.shape)
            )
            cand_s = np.concatenate([bs, np.take_along_axis(S, top, 1)], axis=1)
            cand_i = np.concatenate([bi, top + gs], axis=1)
            order = np.lexsort((cand_i, -cand_s), axis=1)[:, :k]  # by cosine, then lower row
            bs[:] = np.take_along_axis(cand_s, order, 1)
            bi[:] = np.take_along_axis(cand_i, order, 1)
    return best_s, best_i


def default_threshold(nn_cosines: np.ndarray) -> float:
    """The cosine above which a nearest training row is a near-duplicate: closer than a tenth
    of the median nearest-neighbour distance, ``1 - NEAR_FRACTION * median(1 - cos)``.

    Scaled by the data (a backbone whose neighbours are all close gets a higher threshold) and
    robust to duplicates (they move the median only when they are half the rows). An outlier
    fence (Q3 + 3 IQR) was rejected: with the spread of real nearest-neighbour cosines it lies
    above 1 and would flag nothing but identical features."""
    s = np.asarray(nn_cosines, np.float64)
    s = s[np.isfinite(s)]
    if not s.size:
        raise DataError("no nearest-neighbour cosine to choose a threshold from")
    return float(1.0 - NEAR_FRACTION * np.median(1.0 - np.clip(s, -1.0, 1.0)))


def knn_top1(
    cosines: np.ndarray, neighbours: np.ndarray, train_labels: np.ndarray, y: np.ndarray, k: int, T: float = 0.07
) -> float:
    """Top-1 of the weighted kNN vote over each query's first ``k`` neighbours (weights
    ``exp(cos / T)``, summed per class; ties go to the lower class index)."""
    if cosines.shape[1] < k:
        raise DataError(f"{cosines.shape[1]} neighbours per query, kNN needs {k}")
    y = np.asarray(y, np.int64)
    if not y.size:
        raise DataError("no query rows left to score")
    lab = np.asarray(train_labels, np.int64)[neighbours[:, :k]]
    n_cls = int(max(lab.max(), y.max())) + 1
    w = np.exp((cosines[:, :k].astype(np.float64) - 1.0) / T)  # shifted by 1: the same argmax, no overflow
    scores = np.zeros((y.size, n_cls))
    np.add.at(scores, (np.repeat(np.arange(y.size), k), lab.ravel()), w.ravel())
    return top1(y, scores)
