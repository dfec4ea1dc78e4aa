"""Layer-by-layer CKA: every layer of backbone A against every layer of backbone B (or of A
itself), from one pass over the rows that computes each layer's statistics once.

Linear CKA of layers ``i`` and ``j`` needs, of the centred rows ``Xc_i`` and ``Yc_j``, the
pair's ``||Xc_i^T Yc_j||_F^2`` and ``r_i . s_j`` (``r``, ``s``: the rows' squared norms, for
the debiased form) and per layer ``||Xc_i^T Xc_i||_F^2``, ``r_i . r_i`` and ``sum(r_i)``
(:class:`GridSums`). Two routes give these sums exactly (up to float64 rounding), chosen by
cost within the memory bound (:func:`choose_route`, recorded in each row):

- ``gram`` (few rows): each layer's centred ``[n, n]`` Gram matrix ``K_i = Xc_i Xc_i^T`` is
  formed once; every pair's ``<K_i, L_j> = ||Xc_i^T Yc_j||^2`` is then one matrix product of the
  stacked, flattened Gram matrices (``[L_A, n^2] @ [n^2, L_B]``). Memory: ``(L_A + L_B) n^2``
  floats; cost ``n^2 (sum d + L_A L_B)``.
- ``features`` (many rows): two streamed passes over row blocks (layer means, then centred
  sums); per block, the layers' centred rows side by side give every pair's cross-product in
  one ``[sum d_A, sum d_B]`` product, and each layer's own ``[d, d]`` product once (not once
  per pair as the pairwise loop does). Memory: ``(sum d_A)(sum d_B)`` floats (B's layers
  in groups, a pass each, when that does not fit); cost ``n (sum d_A)(sum d_B)``.

Minibatch CKA (:func:`minibatch_grid`, Nguyen et al. 2021, google-research's
``efficient_CKA.py``): per minibatch of ``N`` consecutive rows, each layer's unbiased-centred
Gram matrix; the pairs' inner products summed over minibatches; CKA the ratio of the sums. It
is not the full-data debiased CKA: it estimates ``E[HSIC_1(K, L)] / sqrt(E[HSIC_1(K, K)]
E[HSIC_1(L, L)])`` over minibatches of ``N`` rows, which equals it only when one minibatch
holds every row (``N >= n``). Its value depends on ``N`` (and on which rows share a
minibatch) and approaches the full debiased CKA as ``N`` grows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from featcache.errors import DataError
from featcache.similarity.measures import center_gram
from featcache.similarity.streaming import iter_blocks

__all__ = ["ROUTES", "GridSums", "choose_route", "grid_sums", "layer_blocks", "minibatch_grid"]

#: the ways the grid's sums are accumulated (module docstring)
ROUTES = ("gram", "features")


@dataclass(frozen=True)
class GridSums:
    """What linear CKA (biased and debiased) needs for every layer pair, over ``n`` rows."""

    n: int
    xy: np.ndarray  # [La, Lb] ||Xc_i^T Yc_j||^2
    rs: np.ndarray  # [La, Lb] r_i . s_j
    xx: np.ndarray  # [La] ||Xc_i^T Xc_i||^2
    rr: np.ndarray  # [La] r_i . r_i
    tx: np.ndarray  # [La] sum(r_i) = ||Xc_i||^2
    yy: np.ndarray
    ss: np.ndarray
    ty: np.ndarray

    def cka(self, debiased: bool = False) -> np.ndarray:
        """The ``[L_A, L_B]`` linear CKA matrix (``debiased``: with the unbiased HSIC)."""
        n = self.n
        if n < (4 if debiased else 2):
            raise DataError(f"{n} rows; CKA needs at least {4 if debiased else 2}")
        xy, xx, yy = self.xy, self.xx, self.yy
        if debiased:  # debiased_dot of featcache.similarity.measures, for every pair at once
            c = n / (n - 2.0)
            d = 1.0 / ((n - 1) * (n - 2))
            xy = xy - c * self.rs + np.outer(self.tx, self.ty) * d
            xx = xx - c * self.rr + self.tx * self.tx * d
            yy = yy - c * self.ss + self.ty * self.ty * d
        for side, v in (("A", xx), ("B", yy)):
            if not (v > 0).all():
                raise DataError(
                    f"layer(s) at position {np.flatnonzero(~(v > 0)).tolist()} of backbone {side} are constant over "
                    "the rows (zero variance); CKA is undefined: leave them out with --layers"
                )
        return xy / np.sqrt(np.outer(xx, yy))


def _f64(block: Any) -> np.ndarray:
    x = np.asarray(block, np.float64)
    if not np.isfinite(x).all():
        raise DataError("a block holds NaN or inf; drop those rows (their images failed) before comparing")
    return x


def layer_blocks(views: Sequence[Any], rows: int) -> Iterator[list[np.ndarray]]:
    """Row blocks of every layer side by side (the same rows of each, float64)."""
    its = [iter_blocks(v, rows) for v in views]
    for blocks in zip(*its, strict=True):
        yield [_f64(b) for b in blocks]


def _widths(views: Sequence[Any]) -> list[int]:
    return [int(v.shape[1]) for v in views]


def choose_route(n: int, dims_a: Sequence[int], dims_b: Sequence[int] | None, memory: int) -> str:
    """``gram`` when the layers' ``[n, n]`` Gram matrices (and one layer's rows) fit in half of
    ``memory`` and cost fewer operations than the feature-space cross-products, else ``features``."""
    db = dims_a if dims_b is None else dims_b
    grams = len(dims_a) + (0 if dims_b is None else len(db))
    gram_bytes = 8 * (grams * n * n + 2 * n * max([*dims_a, *db]))
    gram_ops = n * n * (sum(dims_a) + (0 if dims_b is None else sum(db)) + len(dims_a) * len(db))
    feat_ops = n * (sum(dims_a) * sum(db) + (0 if dims_b is None else sum(d * d for d in [*dims_a, *db])))
    return "gram" if gram_bytes <= memory // 2 and gram_ops < feat_ops else "features"


def grid_sums(A: Sequence[Any], B: Sequence[Any] | None, route: str, memory: int, rows: int) -> GridSums:
    """The :class:`GridSums` of layers ``A`` against layers ``B`` (``None``: A with itself;
    arrays or lazy stored views, the same rows in the same order) by ``route``."""
    if route not in ROUTES:
        raise DataError(f"unknown route {route!r}; choose one of {ROUTES}")
    n = int(A[0].shape[0])
    if any(int(v.shape[0]) != n for v in [*A, *(B or [])]):
        raise DataError("the layers hold different row counts; align them by sample id first")
    if route == "gram":
        return _gram_sums(A, B, rows)
    return _feature_sums(A, B, memory, rows)


# ------------------------------------------------------------------ the gram route
def _centred_grams(views: Sequence[Any], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Each layer's centred Gram matrix, flattened (``[L, n^2]``), and its diagonal (``[L, n]``)."""
    n = int(views[0].shape[0])
    G, k = np.empty((len(views), n * n)), np.empty((len(views), n))
    for i, v in enumerate(views):
        x = np.concatenate([_f64(b) for b in iter_blocks(v, rows)]) if n else np.empty((0, v.shape[1]))
        x -= x.mean(0)
        K = x @ x.T
        k[i] = np.diag(K)
        G[i] = K.ravel()
    return G, k


def _gram_sums(A: Sequence[Any], B: Sequence[Any] | None, rows: int) -> GridSums:
    n = int(A[0].shape[0])
    GA, ka = _centred_grams(A, rows)
    GB, kb = (GA, ka) if B is None else _centred_grams(B, rows)
    xy = GA @ GB.T
    xx = np.einsum("ij,ij->i", GA, GA)
    yy = xx if B is None else np.einsum("ij,ij->i", GB, GB)
    if B is None:  # exactly symmetric, the diagonal exactly the self terms
        xy = (xy + xy.T) / 2
        np.fill_diagonal(xy, xx)
    rs = ka @ kb.T
    return GridSums(n, xy, rs, xx, (ka * ka).sum(1), ka.sum(1), yy, (kb * kb).sum(1), kb.sum(1))


# ------------------------------------------------------------------ the feature route
def _means(views: Sequence[Any], rows: int) -> list[np.ndarray]:
    sums = [np.zeros(int(v.shape[1])) for v in views]
    n = 0
    for blocks in layer_blocks(views, rows):
        for s, b in zip(sums, blocks, strict=True):
            s += b.sum(0)
        n += blocks[0].shape[0]
    return [s / max(n, 1) for s in sums]


def _groups(dims_a: Sequence[int], dims_b: Sequence[int], memory: int) -> list[list[int]]:
    """B's layers in groups whose cross-products with all of A's fit in half of ``memory``."""
    room = max(1, memory // 2 // (8 * max(1, sum(dims_a))))
    groups: list[list[int]] = [[]]
    for j, d in enumerate(dims_b):
        if groups[-1] and sum(dims_b[i] for i in groups[-1]) + d > room:
            groups.append([])
        groups[-1].append(j)
    return groups


def _edges(dims: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(dims)]).astype(int)


class _SideStats:
    """Per-layer sums of one side: its ``[d, d]`` products' norms, ``r . r`` and ``sum r``."""

    def __init__(self, dims: Sequence[int]) -> None:
        self.dims = list(dims)
        self.cxx = [np.zeros((d, d)) for d in dims]
        self.rr, self.tx = np.zeros(len(dims)), np.zeros(len(dims))

    def update(self, xs: Sequence[np.ndarray], r: np.ndarray) -> None:
        for i, x in enumerate(xs):
            self.cxx[i] += x.T @ x
        self.rr += (r * r).sum(0)
        self.tx += r.sum(0)

    def norms(self) -> np.ndarray:
        return np.array([float(np.sum(c * c)) for c in self.cxx])


def _centred(blocks: Sequence[np.ndarray], means: Sequence[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
    xs = [b - m for b, m in zip(blocks, means, strict=True)]
    return xs, np.stack([np.einsum("ij,ij->i", x, x) for x in xs], 1)


def _feature_pass(A, B, ma, mb, group: list[int], rows: int, side_a, side_b):
    """One pass: the cross-products of A's layers with B's layers in ``group`` (and, when
    given, each side's own sums)."""
    ea = _edges(_widths(A))
    C = np.zeros((int(ea[-1]), sum(int(B[j].shape[1]) for j in group)))
    RS = np.zeros((len(A), len(group)))
    for blocks in layer_blocks([*A, *(B[j] for j in group)], rows):
        xs, r = _centred(blocks[: len(A)], ma)
        ys, s = _centred(blocks[len(A) :], [mb[j] for j in group])
        C += np.hstack(xs).T @ np.hstack(ys)
        RS += r.T @ s
        if side_a is not None:
            side_a.update(xs, r)
        if side_b is not None:
            side_b.update(ys, s)
    eb = _edges([int(B[j].shape[1]) for j in group])
    XY = np.array(
        [[np.sum(C[ea[i] : ea[i + 1], eb[j] : eb[j + 1]] ** 2) for j in range(len(group))] for i in range(len(A))]
    )
    return XY, RS


def _self_sums(A: Sequence[Any], rows: int) -> GridSums:
    """A with itself: one ``[sum d, sum d]`` product per block, symmetric by construction."""
    ma = _means(A, rows)
    ea = _edges(_widths(A))
    C, RS = np.zeros((int(ea[-1]), int(ea[-1]))), np.zeros((len(A), len(A)))
    n = 0
    for blocks in layer_blocks(A, rows):
        xs, r = _centred(blocks, ma)
        x = np.hstack(xs)
        C += x.T @ x
        RS += r.T @ r
        n += x.shape[0]
    L = len(A)
    XY = np.zeros((L, L))
    for i in range(L):
        for j in range(i, L):
            XY[i, j] = XY[j, i] = np.sum(C[ea[i] : ea[i + 1], ea[j] : ea[j + 1]] ** 2)
    RS = (RS + RS.T) / 2
    xx, rr, tx = (
        np.diag(XY).copy(),
        np.diag(RS).copy(),
        np.array([np.trace(C[ea[i] : ea[i + 1], ea[i] : ea[i + 1]]) for i in range(L)]),
    )
    return GridSums(n, XY, RS, xx, rr, tx, xx, rr, tx)


def _feature_sums(A: Sequence[Any], B: Sequence[Any] | None, memory: int, rows: int) -> GridSums:
    if B is None:
        return _self_sums(A, rows)
    ma, mb = _means(A, rows), _means(B, rows)
    side_a, side_b = _SideStats(_widths(A)), _SideStats(_widths(B))
    XY, RS = np.zeros((len(A), len(B))), np.zeros((len(A), len(B)))
    for g, group in enumerate(_groups(_widths(A), _widths(B), memory)):
        part = _SideStats([int(B[j].shape[1]) for j in group])
        XY[:, group], RS[:, group] = _feature_pass(A, B, ma, mb, group, rows, side_a if g == 0 else None, part)
        for k, j in enumerate(group):
            side_b.cxx[j], side_b.rr[j], side_b.tx[j] = part.cxx[k], part.rr[k], part.tx[k]
    n = int(A[0].shape[0])
    return GridSums(n, XY, RS, side_a.norms(), side_a.rr, side_a.tx, side_b.norms(), side_b.rr, side_b.tx)


# ------------------------------------------------------------------ minibatch CKA
def _unbiased_grams(blocks: Sequence[np.ndarray]) -> np.ndarray:
    return np.stack([center_gram(b @ b.T, unbiased=True).ravel() for b in blocks])


def minibatch_grid(A: Sequence[Any], B: Sequence[Any] | None, size: int) -> tuple[np.ndarray, dict[str, Any]]:
    """Minibatch CKA (module docstring) of layers ``A`` against ``B`` (``None``: A itself) over
    minibatches of ``size`` consecutive rows; a last minibatch of fewer than 4 rows is skipped
    (its rows counted in the details)."""
    if size < 4:
        raise DataError(f"--minibatch {size}: a minibatch needs at least 4 rows (the unbiased HSIC)")
    hxy = np.zeros((len(A), len(A if B is None else B)))
    hxx, hyy = np.zeros(len(A)), np.zeros(hxy.shape[1])
    batches = skipped = 0
    for blocks in layer_blocks([*A, *(B or [])], size):
        if blocks[0].shape[0] < 4:
            skipped += blocks[0].shape[0]
            continue
        ga = _unbiased_grams(blocks[: len(A)])
        gb = ga if B is None else _unbiased_grams(blocks[len(A) :])
        hxy += ga @ gb.T
        hxx += np.einsum("ij,ij->i", ga, ga)
        hyy += np.einsum("ij,ij->i", gb, gb)
        batches += 1
    if B is None:  # A with itself: exactly symmetric
        hxy = (hxy + hxy.T) / 2
        np.fill_diagonal(hxy, hxx)
    if not batches:
        raise DataError(f"no minibatch of at least 4 rows among {int(A[0].shape[0])} rows; minibatch CKA needs one")
    if not ((hxx > 0).all() and (hyy > 0).all()):
        raise DataError("a layer is constant within every minibatch; minibatch CKA is undefined for it")
    return hxy / np.sqrt(np.outer(hxx, hyy)), {"minibatch": size, "minibatches": batches, "minibatch_skipped": skipped}
