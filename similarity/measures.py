"""Representational similarity measures as pure numpy functions on in-memory arrays.

Rows of ``X`` ``[n, dx]`` and ``Y`` ``[n, dy]`` describe the same ``n`` samples (aligned by
the caller, see :mod:`featcache.similarity.align`); the widths may differ. Everything is
computed in float64.

- CKA (Kornblith et al. 2019): :func:`cka` on two Gram matrices, :func:`linear_cka` in
  feature space (``[d, d]`` cross-products, never ``[n, n]``), with the biased HSIC or the
  unbiased one (``debiased=True``, Song et al. 2007 in Szekely & Rizzo's form), and
  :func:`rbf_cka` with the Gaussian kernel: bandwidth a fraction of the median distance
  (``threshold``, google-research's ``gram_rbf``) or a fixed ``sigma`` (thingsvision).
- RSA: :func:`rdm` (1 - Pearson correlation or 1 - cosine between rows) and :func:`rsa`
  (Spearman correlation of two RDMs' upper triangles).
"""

from __future__ import annotations

import numpy as np

from featcache.core.registry import Registry
from featcache.errors import DataError

__all__ = [
    "RDM_METHODS",
    "center_gram",
    "cka",
    "cka_ratio",
    "debiased_dot",
    "gram_linear",
    "gram_rbf",
    "linear_cka",
    "rbf_cka",
    "rdm",
    "rsa",
    "spearman",
]

#: RDM methods: each maps rows to the rows whose cosine similarity is the method's similarity;
#: its ``info`` names a row whose dissimilarities are undefined (a zero row after the map)
RDM_METHODS: Registry = Registry("RDM method", DataError)


@RDM_METHODS.register("correlation", note="1 - Pearson correlation", info="constant")
def _centred_rows(X: np.ndarray) -> np.ndarray:
    return X - X.mean(1, keepdims=True)


@RDM_METHODS.register("cosine", note="1 - cosine", info="all-zero")
def _rows(X: np.ndarray) -> np.ndarray:
    return X


def _f64(X: np.ndarray, what: str = "X") -> np.ndarray:
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2:
        raise DataError(f"{what} must be a 2-D [samples, features] array, got shape {X.shape}")
    if not np.isfinite(X).all():
        raise DataError(f"{what} holds NaN or inf; drop those rows (their images failed) before comparing")
    return X


def _pair(X: np.ndarray, Y: np.ndarray, min_n: int = 2) -> tuple[np.ndarray, np.ndarray]:
    X, Y = _f64(X, "X"), _f64(Y, "Y")
    if X.shape[0] != Y.shape[0]:
        raise DataError(f"X has {X.shape[0]} rows and Y {Y.shape[0]}; both must hold the same samples, aligned")
    if X.shape[0] < min_n:
        raise DataError(f"{X.shape[0]} samples; this measure needs at least {min_n}")
    return X, Y


def gram_linear(X: np.ndarray) -> np.ndarray:
    """The linear-kernel Gram matrix ``X X^T`` (``[n, n]``)."""
    X = _f64(X)
    return X @ X.T


def _sq_distances(X: np.ndarray) -> np.ndarray:
    G = X @ X.T
    sq = np.diag(G)
    return np.maximum(sq[:, None] + sq[None, :] - 2 * G, 0.0)


def gram_rbf(X: np.ndarray, threshold: float | None = 1.0, *, sigma: float | None = None) -> np.ndarray:
    """The Gaussian-kernel Gram matrix ``exp(-d_ij^2 / (2 s^2))``.

    ``sigma`` given: ``s = sigma`` (thingsvision's fixed width). Otherwise ``s^2 =
    threshold^2 * median(d^2)`` over all ``n^2`` entries, zeros of the diagonal included
    (google-research's ``gram_rbf`` median heuristic)."""
    X = _f64(X)
    d2 = _sq_distances(X)
    if sigma is not None:
        if not sigma > 0:
            raise DataError(f"RBF sigma must be positive, got {sigma!r}")
        return np.exp(-d2 / (2.0 * sigma**2))
    if threshold is None or not threshold > 0:
        raise DataError(f"RBF threshold (fraction of the median distance) must be positive, got {threshold!r}")
    med = float(np.median(d2))
    if med <= 0:
        raise DataError("the median squared distance between rows is 0 (mostly identical rows); give a fixed sigma")
    return np.exp(-d2 / (2.0 * threshold**2 * med))


def center_gram(K: np.ndarray, unbiased: bool = False) -> np.ndarray:
    """Double-centred copy of the symmetric ``K``; ``unbiased``: the U-statistic form whose
    inner product is ``n (n - 3)`` times the unbiased HSIC (diagonal zeroed)."""
    K = np.array(K, dtype=np.float64)
    n = K.shape[0]
    if K.ndim != 2 or K.shape[1] != n or not np.allclose(K, K.T):
        raise DataError(f"a Gram matrix must be square and symmetric, got shape {K.shape}")
    if unbiased:
        if n < 4:
            raise DataError(f"the unbiased HSIC needs at least 4 samples, got {n}")
        np.fill_diagonal(K, 0.0)
        means = K.sum(0) / (n - 2)
        means -= means.sum() / (2 * (n - 1))
    else:
        means = K.mean(0)
        means -= means.mean() / 2
    K -= means[:, None]
    K -= means[None, :]
    if unbiased:
        np.fill_diagonal(K, 0.0)
    return K


def cka(Kx: np.ndarray, Ky: np.ndarray, debiased: bool = False) -> float:
    """CKA of two Gram matrices: ``<Kx_c, Ky_c> / (||Kx_c|| ||Ky_c||)``."""
    a, b = center_gram(Kx, debiased), center_gram(Ky, debiased)
    return float(np.vdot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def debiased_dot(
    xty: float, rows_x: np.ndarray | float, rows_y: np.ndarray | float, sq_x: float, sq_y: float, n: int
) -> float:
    """``n (n - 3)`` times the unbiased linear HSIC from feature-space sums: ``xty`` =
    ``||X_c^T Y_c||_F^2``, ``rows_*`` the centred rows' squared norms (or their dot product
    as a number), ``sq_*`` their totals."""
    cross = float(np.dot(rows_x, rows_y))
    return float(xty - n / (n - 2.0) * cross + sq_x * sq_y / ((n - 1) * (n - 2)))


def linear_cka(X: np.ndarray, Y: np.ndarray, debiased: bool = False) -> float:
    """Linear CKA in feature space (``[dx, dy]`` products; equal to :func:`cka` on the
    linear Gram matrices)."""
    X, Y = _pair(X, Y, 4 if debiased else 2)
    X = X - X.mean(0, keepdims=True)
    Y = Y - Y.mean(0, keepdims=True)
    xty = float(np.linalg.norm(X.T @ Y) ** 2)
    xx = float(np.linalg.norm(X.T @ X) ** 2)
    yy = float(np.linalg.norm(Y.T @ Y) ** 2)
    if debiased:
        n = X.shape[0]
        rx, ry = np.einsum("ij,ij->i", X, X), np.einsum("ij,ij->i", Y, Y)
        sx, sy = float(rx.sum()), float(ry.sum())
        xty = debiased_dot(xty, rx, ry, sx, sy, n)
        xx = debiased_dot(xx, rx, rx, sx, sx, n)
        yy = debiased_dot(yy, ry, ry, sy, sy, n)
    return cka_ratio(xty, xx, yy)


def cka_ratio(xy: float, xx: float, yy: float) -> float:
    """CKA from its three HSIC terms: ``xy / sqrt(xx yy)``; a constant side is refused."""
    if not (xx > 0 and yy > 0):
        raise DataError("a representation is constant over the samples (zero variance); CKA is undefined")
    return float(xy / np.sqrt(xx * yy))


def rbf_cka(
    X: np.ndarray,
    Y: np.ndarray,
    threshold: float | None = 1.0,
    *,
    sigma: float | None = None,
    debiased: bool = False,
) -> float:
    """CKA with Gaussian kernels (:func:`gram_rbf`; ``[n, n]`` in memory)."""
    X, Y = _pair(X, Y, 4 if debiased else 2)
    return cka(gram_rbf(X, threshold, sigma=sigma), gram_rbf(Y, threshold, sigma=sigma), debiased)


def rdm(X: np.ndarray, method: str = "correlation") -> np.ndarray:
    """Representational dissimilarity matrix ``1 - similarity`` between rows:
    ``correlation`` (Pearson across each row's features) or ``cosine``."""
    if method not in RDM_METHODS:
        raise DataError(f"unknown RDM method {method!r}; choose one of {tuple(RDM_METHODS)}")
    entry = RDM_METHODS.entry(method)
    X = entry.load()(_f64(X))
    norms = np.linalg.norm(X, axis=1)
    if (norms == 0).any():
        kind = entry.info
        raise DataError(f"{int((norms == 0).sum())} row(s) are {kind}; their {method} dissimilarity is undefined")
    U = X / norms[:, None]
    return 1.0 - np.clip(U @ U.T, -1.0, 1.0)


def _ranks(v: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their positions), 1-based as scipy's rankdata."""
    order = np.argsort(v, kind="mergesort")
    sv = v[order]
    start = np.r_[True, sv[1:] != sv[:-1]]
    groups = np.cumsum(start) - 1
    first = np.flatnonzero(start)
    last = np.r_[first[1:], sv.size] - 1
    avg = (first + last) / 2.0 + 1.0
    out = np.empty(v.size, np.float64)
    out[order] = avg[groups]
    return out


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (Pearson on average ranks, as ``scipy.stats.spearmanr``)."""
    ra, rb = _ranks(np.asarray(a, np.float64)), _ranks(np.asarray(b, np.float64))
    ra -= ra.mean()
    rb -= rb.mean()
    den = np.sqrt(np.dot(ra, ra) * np.dot(rb, rb))
    if den == 0:
        raise DataError("an RDM is constant; its rank correlation is undefined")
    return float(np.dot(ra, rb) / den)


def rsa(X: np.ndarray, Y: np.ndarray, method: str = "correlation") -> float:
    """RSA: Spearman correlation of the upper triangles of ``rdm(X)`` and ``rdm(Y)``."""
    X, Y = _pair(X, Y, 3)
    iu = np.triu_indices(X.shape[0], k=1)
    return spearman(rdm(X, method)[iu], rdm(Y, method)[iu])
