"""CKA over any number of rows: the rows stream through in blocks.

:class:`LinearCKAStream` keeps only ``[dx, dx]``, ``[dy, dy]`` and ``[dx, dy]`` float64
cross-products and a few ``d``-vectors, so linear CKA and its debiased form over ``n`` rows
need ``O(d^2)`` memory whatever ``n`` is, and equal the in-memory formulas
(:func:`~featcache.similarity.measures.linear_cka`) up to float64 rounding: every sum the
full formula needs is a sum over rows. Rows are shifted by the first block's mean before
they are accumulated (centering is shift invariant), so the centering subtractions do not
cancel catastrophically.

:class:`MinibatchCKA` is the estimator of google-research's ``efficient_CKA.py``
(``MinibatchCKA``, Nguyen et al. 2021): per minibatch, the unbiased (U-statistic) centred
Gram matrices of both sides; their inner products summed over minibatches; CKA is the
ratio of the sums. It works with any kernel (here linear or Gaussian) in ``O(b^2)`` memory
for minibatches of ``b`` rows. It estimates the unbiased CKA of the population, not the
full-data CKA: it is a different number from ``rbf_cka`` on all rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from featcache.errors import DataError
from featcache.similarity.measures import center_gram, cka_ratio, debiased_dot, gram_linear, gram_rbf

__all__ = ["LinearCKAStream", "MinibatchCKA", "iter_blocks", "paired_blocks", "take_rows"]


def take_rows(X: Any, idx: ArrayLike) -> Any:
    """Rows ``idx`` of ``X``: an array's copy, or a lazy stored view's new view (nothing read)."""
    return X[np.asarray(idx)] if isinstance(X, np.ndarray) else X.take(idx)


def iter_blocks(X: Any, rows: int) -> Iterator[np.ndarray]:
    """Blocks of ``rows`` rows of ``X``: an array, or a lazy stored view with ``iter_raw``
    (each stored chunk decoded once a pass)."""
    rows = max(1, int(rows))
    if hasattr(X, "iter_raw"):
        for _, _, block in X.iter_raw(rows):
            yield block
        return
    for s in range(0, X.shape[0], rows):
        yield np.asarray(X[s : s + rows])


def paired_blocks(X: Any, Y: Any, rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Row blocks of ``X`` and ``Y`` side by side (same rows, same order)."""
    if X.shape[0] != Y.shape[0]:
        raise DataError(f"X has {X.shape[0]} rows and Y {Y.shape[0]}; align them by sample id first")
    yield from zip(iter_blocks(X, rows), iter_blocks(Y, rows), strict=True)


class LinearCKAStream:
    """Accumulates, block by block, what linear CKA (biased and debiased) needs.

    >>> s = LinearCKAStream()
    >>> for bx, by in paired_blocks(X, Y, 4096):  # doctest: +SKIP
    ...     s.update(bx, by)
    >>> s.result(debiased=True)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.n = 0
        self._shift: tuple[np.ndarray, np.ndarray] | None = None

    def _start(self, x: np.ndarray, y: np.ndarray) -> None:
        dx, dy = x.shape[1], y.shape[1]
        self._shift = (x.mean(0), y.mean(0))
        z = np.zeros
        self.sx, self.sy = z(dx), z(dy)  # sums of the shifted rows
        self.cxx, self.cyy, self.cxy = z((dx, dx)), z((dy, dy)), z((dx, dy))
        # a_i = |x_i|^2, b_i = |y_i|^2 of the shifted rows, and their products with the rows
        self.sa = self.sb = self.saa = self.sbb = self.sab = 0.0
        self.sax, self.sbx, self.say, self.sby = z(dx), z(dx), z(dy), z(dy)

    def update(self, x: np.ndarray, y: np.ndarray) -> LinearCKAStream:
        """Add the rows of one block (``x`` ``[b, dx]``, ``y`` ``[b, dy]``, same samples)."""
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
            raise DataError(f"blocks must be [rows, features] with the same rows, got {x.shape} and {y.shape}")
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            raise DataError("a block holds NaN or inf; drop those rows (their images failed) before comparing")
        if not x.shape[0]:
            return self
        if self._shift is None:
            self._start(x, y)
        elif x.shape[1] != self.sx.size or y.shape[1] != self.sy.size:
            raise DataError(f"block widths {x.shape[1]}, {y.shape[1]} differ from the first block's")
        assert self._shift is not None
        x = x - self._shift[0]
        y = y - self._shift[1]
        a, b = np.einsum("ij,ij->i", x, x), np.einsum("ij,ij->i", y, y)
        self.n += x.shape[0]
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.cxx += x.T @ x
        self.cyy += y.T @ y
        self.cxy += x.T @ y
        self.sa += a.sum()
        self.sb += b.sum()
        self.saa += a @ a
        self.sbb += b @ b
        self.sab += a @ b
        self.sax += a @ x
        self.sbx += b @ x
        self.say += a @ y
        self.sby += b @ y
        return self

    def _centred(self) -> dict[str, float]:
        """The full formula's sums from the accumulated ones (see the module docstring)."""
        n = self.n
        mx, my = self.sx / n, self.sy / n
        cxx = self.cxx - n * np.outer(mx, mx)
        cyy = self.cyy - n * np.outer(my, my)
        cxy = self.cxy - n * np.outer(mx, my)
        ux, uy = mx @ mx, my @ my
        # r_i = |x_i - mx|^2 = a_i - 2 x_i.mx + ux, likewise s_i for y
        rr = self.saa - 4 * (self.sax @ mx) + 4 * (mx @ self.cxx @ mx) + 2 * ux * self.sa
        rr += -4 * ux * (self.sx @ mx) + n * ux * ux
        ss = self.sbb - 4 * (self.sby @ my) + 4 * (my @ self.cyy @ my) + 2 * uy * self.sb
        ss += -4 * uy * (self.sy @ my) + n * uy * uy
        rs = self.sab - 2 * (self.say @ my) - 2 * (self.sbx @ mx) + 4 * (mx @ self.cxy @ my)
        rs += uy * self.sa + ux * self.sb - 2 * uy * (self.sx @ mx) - 2 * ux * (self.sy @ my) + n * ux * uy
        return {
            "xy": float(np.sum(cxy * cxy)),
            "xx": float(np.sum(cxx * cxx)),
            "yy": float(np.sum(cyy * cyy)),
            "tx": float(np.trace(cxx)),
            "ty": float(np.trace(cyy)),
            "rr": float(rr),
            "ss": float(ss),
            "rs": float(rs),
        }

    def result(self, debiased: bool = False) -> float:
        """Linear CKA of the rows seen so far (``debiased``: unbiased HSIC)."""
        n = self.n
        if n < (4 if debiased else 2):
            raise DataError(f"{n} samples streamed; CKA needs at least {4 if debiased else 2}")
        c = self._centred()
        if not debiased:
            return cka_ratio(c["xy"], c["xx"], c["yy"])
        xy = debiased_dot(c["xy"], c["rs"], 1.0, c["tx"], c["ty"], n)
        xx = debiased_dot(c["xx"], c["rr"], 1.0, c["tx"], c["tx"], n)
        yy = debiased_dot(c["yy"], c["ss"], 1.0, c["ty"], c["ty"], n)
        return cka_ratio(xy, xx, yy)


class MinibatchCKA:
    """google-research's minibatch CKA estimator for a linear or Gaussian kernel.

    ``kernel="rbf"``: each minibatch's Gram matrix by :func:`gram_rbf` (``threshold`` of the
    minibatch's median distance, or a fixed ``sigma``). Minibatches need at least 4 rows;
    a last one with fewer is skipped (logged by the caller through :attr:`skipped`).
    """

    def __init__(self, kernel: str = "linear", threshold: float | None = 1.0, sigma: float | None = None) -> None:
        if kernel not in ("linear", "rbf"):
            raise DataError(f"unknown kernel {kernel!r}; choose linear or rbf")
        self.kernel, self.threshold, self.sigma = kernel, threshold, sigma
        self.hxy = self.hxx = self.hyy = 0.0
        self.batches = self.skipped = 0

    def _gram(self, x: np.ndarray) -> np.ndarray:
        K = gram_linear(x) if self.kernel == "linear" else gram_rbf(x, self.threshold, sigma=self.sigma)
        return center_gram(K, unbiased=True)

    def update(self, x: np.ndarray, y: np.ndarray) -> MinibatchCKA:
        """Add one minibatch (the same samples' rows of both sides)."""
        if x.shape[0] != y.shape[0]:
            raise DataError(f"minibatch rows differ: {x.shape[0]} and {y.shape[0]}")
        if x.shape[0] < 4:
            self.skipped += x.shape[0]
            return self
        kx, ky = self._gram(x), self._gram(y)
        self.hxy += float(np.vdot(kx, ky))
        self.hxx += float(np.vdot(kx, kx))
        self.hyy += float(np.vdot(ky, ky))
        self.batches += 1
        return self

    def update_all(self, pairs: Iterable[tuple[np.ndarray, np.ndarray]]) -> MinibatchCKA:
        for x, y in pairs:
            self.update(x, y)
        return self

    def result(self) -> float:
        if not self.batches:
            raise DataError("no minibatch of at least 4 rows was seen; minibatch CKA needs one")
        return cka_ratio(self.hxy, self.hxx, self.hyy)
