"""RBF CKA on every row without an ``[n, n]`` matrix: the Gram statistics accumulated tile by tile.

Biased CKA needs, of the two Gram matrices ``K`` and ``L``, only ``sum(K * L)``, ``sum(K * K)``,
``sum(L * L)`` and their row sums: ``<HKH, HLH> = sum(K * L) - 2/n (K 1).(L 1) + (1'K1)(1'L1)/n^2``
(``H`` the centring matrix), each a sum over ``[b, b]`` tiles of rows ``i`` against rows ``j``.
The median heuristic's bandwidth needs the median of all ``n^2`` squared distances: found
exactly by :func:`kth_smallest`, a few counting passes over the same tiles that narrow an
interval around the wanted rank until the values inside it fit, then sorting those. The
result equals :func:`~featcache.similarity.measures.rbf_cka` on all rows up to float64
rounding, in memory of a few ``[b, b]`` tiles and ``n``-vectors whatever ``n`` is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from featcache.errors import DataError
from featcache.similarity.measures import cka_ratio
from featcache.similarity.streaming import iter_blocks

__all__ = ["blocked_rbf_cka", "kth_smallest", "tile_rows"]

#: interval edges per counting pass of the median search
EDGES = 2048


def tile_rows(memory: int, n: int, dx: int, dy: int) -> int:
    """Rows per tile: sixteen ``[b, b]`` float64 temporaries in half of ``memory``, and the
    four row blocks (two per side) in the other half."""
    by_tiles = int(np.sqrt(memory / 2 / (16 * 8)))
    by_rows = int(memory / 2 / (2 * 8 * (dx + dy)))
    return int(max(8, min(n, by_tiles, by_rows)))


def _tiles(X: Any, b: int) -> Iterator[tuple[int, np.ndarray, int, np.ndarray]]:
    """``(i, rows i.., j, rows j..)`` for every pair of ``b``-row blocks of ``X`` (float64)."""
    i = 0
    for xi in iter_blocks(X, b):
        xi = np.asarray(xi, np.float64)
        j = 0
        for xj in iter_blocks(X, b):
            xj = np.asarray(xj, np.float64)
            yield i, xi, j, xj
            j += xj.shape[0]
        i += xi.shape[0]


def _sq(xi: np.ndarray, xj: np.ndarray) -> np.ndarray:
    """Squared distances between the rows of two blocks (as ``_sq_distances`` computes them)."""
    si, sj = np.einsum("ij,ij->i", xi, xi), np.einsum("ij,ij->i", xj, xj)
    return np.maximum(si[:, None] + sj[None, :] - 2 * (xi @ xj.T), 0.0)


def _d2_tiles(X: Any, b: int) -> Callable[[], Iterator[np.ndarray]]:
    def tiles() -> Iterator[np.ndarray]:
        for _, xi, _, xj in _tiles(X, b):
            if not (np.isfinite(xi).all() and np.isfinite(xj).all()):
                raise DataError("X holds NaN or inf; drop those rows (their images failed) before comparing")
            yield _sq(xi, xj).ravel()

    return tiles


def _count_pass(
    tiles: Callable[[], Iterator[np.ndarray]], lo: float, hi: float, edges: np.ndarray, cap: int, expect: int
):
    """One pass: how many values are <= ``lo``; of those in ``(lo, hi)`` (about ``expect``),
    how many lie below and at most at each edge, a sample of about ``4 EDGES`` of them, and
    all of them while they number <= ``cap``."""
    below, inside = 0, 0
    lt, le = np.zeros(edges.size, np.int64), np.zeros(edges.size, np.int64)
    kept: list[np.ndarray] | None = []
    sample: list[np.ndarray] = []
    rng = np.random.default_rng(0)
    for v in tiles():
        below += int(np.count_nonzero(v <= lo))
        w = v[(v > lo) & (v < hi)]
        inside += w.size
        if edges.size and w.size:
            lt += np.bincount(np.searchsorted(edges, w, "right"), minlength=edges.size + 1)[: edges.size]
            le += np.bincount(np.searchsorted(edges, w, "left"), minlength=edges.size + 1)[: edges.size]
        if kept is not None:
            kept = [*kept, w] if inside <= cap else None
        if w.size:
            sample.append(w[rng.random(w.size) < 4 * EDGES / max(expect, 1)])
    # per value, "right" gives how many edges are <= it and "left" how many are < it: summed up
    # to edge j, the values below edge j (lt) and at most at edge j (le)
    return below, inside, np.cumsum(lt), np.cumsum(le), kept, np.concatenate(sample) if sample else np.empty(0)


def kth_smallest(tiles: Callable[[], Iterator[np.ndarray]], ks: tuple[int, ...], cap: int, total: int) -> list[float]:
    """The ``ks``-th smallest (0-based) of the ``total`` values each ``tiles()`` pass yields,
    exactly, holding at most ``cap`` of them (and a sample of ``4 EDGES``) at once. Close
    ranks (a median's middle two) are found by the same passes."""
    first = next(tiles(), np.empty(0))  # the first tile's spread gives the first pass its edges
    lo, hi, expect = -np.inf, np.inf, total
    edges = np.unique(np.quantile(first, np.linspace(0, 1, EDGES))) if first.size else np.empty(0)
    found: dict[int, float] = {}
    for _ in range(64):
        below, inside, lt, le, kept, sample = _count_pass(tiles, lo, hi, edges, cap, expect)
        if kept is not None:
            vals = np.sort(np.concatenate(kept) if kept else np.empty(0))
            return [found[k] if k in found else float(vals[k - below]) for k in ks]
        spans = []
        for k in (k for k in ks if k not in found):
            r = k - below  # the rank within (lo, hi)
            j = int(np.searchsorted(le, r, "right")) if edges.size else -1
            if 0 <= j < edges.size and lt[j] <= r:
                found[k] = float(edges[j])  # the value is this edge (ties included)
            elif edges.size:
                spans.append(j)
        if len(found) == len(set(ks)):
            return [found[k] for k in ks]
        if spans:
            j0, j1 = min(spans), max(spans)
            lo, hi = (float(edges[j0 - 1]) if j0 > 0 else lo), (float(edges[j1]) if j1 < edges.size else hi)
            expect = int((lt[j1] if j1 < edges.size else inside) - (le[j0 - 1] if j0 > 0 else 0))
        sample = sample[(sample > lo) & (sample < hi)]
        edges = np.unique(np.quantile(sample, np.linspace(0, 1, EDGES))) if sample.size else np.empty(0)
    raise DataError("the median search did not converge; give a fixed --rbf-sigma")  # pragma: no cover


def _bandwidth(X: Any, n: int, b: int, threshold: float | None, sigma: float | None, cap: int) -> float:
    """``2 s^2`` of :func:`~featcache.similarity.measures.gram_rbf` for all ``n`` rows of ``X``."""
    if sigma is not None:
        return 2.0 * sigma**2
    total = n * n
    a, c = kth_smallest(_d2_tiles(X, b), ((total - 1) // 2, total // 2), cap, total)
    med = (a + c) / 2.0  # numpy's median of an even count: the mean of the middle two
    if med <= 0:
        raise DataError("the median squared distance between rows is 0 (mostly identical rows); give a fixed sigma")
    assert threshold is not None  # a config gives one of sigma and threshold
    return 2.0 * float(threshold) ** 2 * med


def blocked_rbf_cka(
    X: Any, Y: Any, threshold: float | None, sigma: float | None, memory: int
) -> tuple[float, dict[str, Any]]:
    """RBF CKA of all rows of ``X`` and ``Y`` (arrays or lazy stored views) within ``memory``
    bytes; the value and ``tile_rows``."""
    n = int(X.shape[0])
    b = tile_rows(memory, n, int(X.shape[1]), int(Y.shape[1]))
    cap = max(1024, memory // 2 // (8 * 4))
    wx = _bandwidth(X, n, b, threshold, sigma, cap)
    wy = _bandwidth(Y, n, b, threshold, sigma, cap)
    rx, ry = np.zeros(n), np.zeros(n)
    kl = kk = ll = 0.0
    for (i, xi, _, xj), (_, yi, _, yj) in zip(_tiles(X, b), _tiles(Y, b), strict=True):
        K = np.exp(-_sq(xi, xj) / wx)
        L = np.exp(-_sq(yi, yj) / wy)
        kl += float(np.vdot(K, L))
        kk += float(np.vdot(K, K))
        ll += float(np.vdot(L, L))
        rx[i : i + K.shape[0]] += K.sum(1)
        ry[i : i + L.shape[0]] += L.sum(1)
    sx, sy = rx.sum(), ry.sum()
    xy = kl - 2.0 / n * float(rx @ ry) + sx * sy / n**2
    xx = kk - 2.0 / n * float(rx @ rx) + sx * sx / n**2
    yy = ll - 2.0 / n * float(ry @ ry) + sy * sy / n**2
    return cka_ratio(xy, xx, yy), {"tile_rows": b}
