"""Features as the search sees them: float32 rows, L2-normalised for cosine.

:func:`prepare` converts a whole array. :class:`PreparedRows` does the same lazily for rows
loaded in their stored dtype (float16): one pass checks them and computes the row norms,
then the search asks for float32 blocks (converted and normalised on the fly) while it
scores, so a gallery whose float32 copy exceeds the cache budget never exists as one; a
smaller one is prepared once and held. A block equals the same rows of :func:`prepare` bit
for bit: conversion, norm and division are per row.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.errors import DataError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["METRICS", "PreparedRows", "as_prepared", "prepare", "prepared_pair"]

METRICS = ("cosine", "ip", "l2")
#: float32 bytes of one streamed block (at most, unless MIN_BLOCK_ROWS rows are more)
BLOCK_BYTES = 32 * 1024**2
#: BLAS multiplies small operands with other kernels (GEMV for one row, small-matrix kernels
#: below a few thousand output cells) whose sums differ in the last bit from its large-GEMM
#: kernels. Streamed blocks are cut evenly from steps of at least this many rows (so each
#: has >= MIN_BLOCK_ROWS / 2), and score_block pads query blocks to 16 rows: a score is then
#: the same whichever blocks its query and gallery rows fall in.
MIN_BLOCK_ROWS = 1024
_NONFINITE = "features contain NaN/inf; drop invalid rows (Features.valid) before retrieval"


def _check(X: np.ndarray, metric: str) -> None:
    if metric not in METRICS:
        raise DataError(f"unknown similarity {metric!r}; choose one of {METRICS}")
    if np.ndim(X) != 2:
        raise DataError(f"features must be 2-d [N, D], got shape {np.shape(X)}")


def _warn_zero(n_zero: int) -> None:
    if n_zero:
        log.warning("%d all-zero feature vector(s): their cosine similarity is 0 to everything", n_zero)


def prepare(X: np.ndarray, metric: str) -> np.ndarray:
    """float32, C-contiguous, L2-normalised rows for cosine. Non-finite values are an error.

    The caller's array is never modified; a float16 input is converted once and normalised
    in place (one float32 copy at peak)."""
    _check(X, metric)
    given = X
    X = np.ascontiguousarray(X, dtype=np.float32)
    if not all(np.isfinite(X[s : s + 8192]).all() for s in range(0, X.shape[0], 8192)):  # bounded mask
        raise DataError(_NONFINITE)
    if metric == "cosine":
        norms = np.linalg.norm(X, axis=1, keepdims=True)
        _warn_zero(int((norms == 0).sum()))
        if np.may_share_memory(X, given):
            X = X / np.where(norms == 0, 1, norms)
        else:  # our own copy: normalised in place (the same float32 division)
            X /= np.where(norms == 0, 1, norms)
        X = np.ascontiguousarray(X, dtype=np.float32)
    return X


class PreparedRows:
    """Rows ``X`` [N, D] (any float dtype, kept as given) seen as :func:`prepare` ``(X, metric)``.

    ``cache_bytes``: when the float32 copy fits (or is None), it is made once and held;
    otherwise blocks of at most ``min(cache_bytes, BLOCK_BYTES)`` are made when asked for.
    ``prepared=True``: ``X`` is float32 already prepared (used as is, not checked).
    """

    def __init__(self, X: np.ndarray, metric: str, *, cache_bytes: int | None = None, prepared: bool = False):
        _check(X, metric)
        self.metric = metric
        self.shape = (int(X.shape[0]), int(X.shape[1]))
        self._sq: np.ndarray | None = None
        f32_bytes = self.shape[0] * self.shape[1] * 4
        self._raw: Any  # the rows as given while streamed (None when held whole)
        if prepared or cache_bytes is None or f32_bytes <= cache_bytes:
            self._full: np.ndarray | None = np.ascontiguousarray(X, np.float32) if prepared else prepare(X, metric)
            self._raw, self._div, self._step = None, None, max(1, self.shape[0])
            return
        self._full, self._raw = None, X
        self._step = max(MIN_BLOCK_ROWS, min(cache_bytes, BLOCK_BYTES) // max(1, 4 * self.shape[1]))
        self._div = self._scan()
        log.info(
            "features of %d x %d streamed in float32 blocks of <= %d rows (their float32 copy, %.2f GB, "
            "exceeds the %.2f GB held whole; a larger --max-memory holds more)",
            *self.shape,
            self._step,
            f32_bytes / 1e9,
            cache_bytes / 1e9,
        )

    @property
    def streamed(self) -> bool:
        """True when blocks are made on demand (no whole float32 copy is held)."""
        return self._full is None

    def __len__(self) -> int:
        return self.shape[0]

    def _scan(self) -> np.ndarray | None:
        """One pass: finiteness, and the row divisors of cosine (norm; 1 for all-zero rows)."""
        div = np.empty((self.shape[0], 1), np.float32) if self.metric == "cosine" else None
        n_zero = 0
        for lo, hi in self.bounds():
            Xb = np.ascontiguousarray(self._raw[lo:hi], dtype=np.float32)  # row sums as prepare() does
            if not np.isfinite(Xb).all():
                raise DataError(_NONFINITE)
            if div is not None:
                norms = np.linalg.norm(Xb, axis=1, keepdims=True)
                n_zero += int((norms == 0).sum())
                div[lo:hi] = np.where(norms == 0, 1, norms)
        _warn_zero(n_zero)
        return div

    def bounds(self) -> list[tuple[int, int]]:
        """Row ranges of the blocks: equal sizes, so no block is a sliver."""
        n = self.shape[0]
        cuts = np.linspace(0, n, -(-n // self._step) + 1).astype(np.int64) if n else np.zeros(1, np.int64)
        return [(int(a), int(b)) for a, b in itertools.pairwise(cuts)]

    def _convert(self, Xb: np.ndarray, div: np.ndarray | None) -> np.ndarray:
        Xb = np.array(Xb, dtype=np.float32, order="C")  # always our own copy
        if div is not None:
            Xb /= div
        return Xb

    def block(self, lo: int, hi: int) -> np.ndarray:
        """Prepared rows ``lo:hi`` (float32, C-contiguous; a view when held whole)."""
        if self._full is not None:
            return self._full[lo:hi]
        return self._convert(self._raw[lo:hi], None if self._div is None else self._div[lo:hi])

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Prepared rows at the indices ``rows``."""
        if self._full is not None:
            return self._full[rows]
        return self._convert(self._raw[rows], None if self._div is None else self._div[rows])

    def blocks(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """``(lo, hi, rows lo:hi prepared)`` over all rows; one block when held whole."""
        for lo, hi in self.bounds():
            yield lo, hi, self.block(lo, hi)

    def sq_norms(self) -> np.ndarray:
        """Squared norms [N] of the prepared rows (float32, computed once)."""
        if self._sq is None:
            self._sq = np.empty(self.shape[0], np.float32)
            for lo, hi, Xb in self.blocks():
                self._sq[lo:hi] = np.einsum("ij,ij->i", Xb, Xb)
        return self._sq

    def array(self) -> np.ndarray:
        """All prepared rows as one float32 array (a copy when streamed)."""
        if self._full is not None:
            return self._full
        return np.concatenate([b for _, _, b in self.blocks()]) if self.shape[0] else np.zeros(self.shape, np.float32)

    def to_torch(self, device: str | torch.device) -> torch.Tensor:
        """The prepared rows as one float32 tensor on ``device``, filled block by block (a
        streamed gallery travels to GPU memory without a whole float32 copy on the host)."""
        import torch

        if self._full is not None:
            return torch.from_numpy(self._full).to(device)
        out = torch.empty(self.shape, dtype=torch.float32, device=device)
        for lo, hi, Xb in self.blocks():
            out[lo:hi].copy_(torch.from_numpy(Xb))
        return out


def _same_metric(X: PreparedRows, metric: str) -> PreparedRows:
    if X.metric != metric:
        raise DataError(f"rows prepared for {X.metric!r} cannot be scored with {metric!r}; prepare them for {metric!r}")
    return X


def as_prepared(X: np.ndarray | PreparedRows, metric: str) -> PreparedRows:
    """``X`` itself when it is :class:`PreparedRows`, else rows already prepared (float32)."""
    return _same_metric(X, metric) if isinstance(X, PreparedRows) else PreparedRows(X, metric, prepared=True)


def prepared_pair(
    Xq: np.ndarray | PreparedRows, Xg: np.ndarray | PreparedRows, metric: str, cache_bytes: int | None = None
) -> tuple[PreparedRows, PreparedRows]:
    """Queries and gallery as :class:`PreparedRows` (given ones kept); one object when they
    are the same rows."""

    def rows(X) -> PreparedRows:
        if isinstance(X, PreparedRows):
            return _same_metric(X, metric)
        return PreparedRows(X, metric, cache_bytes=cache_bytes)

    Q = rows(Xq)
    return Q, (Q if Xg is Xq else rows(Xg))
