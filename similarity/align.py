"""Rows of two feature arrays joined by sample id: the same samples in the same order, or a
one-line error naming how many ids are duplicated or missing, never a silent misalignment."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from featcache.errors import DataError

__all__ = ["AlignmentError", "align_ids"]


class AlignmentError(DataError):
    """Two sides' sample ids do not match one to one (a DataError, so a ValueError too)."""


def _duplicates(ids: np.ndarray, name: str) -> None:
    uniq, counts = np.unique(ids, return_counts=True)
    dup = uniq[counts > 1]
    if dup.size:
        raise AlignmentError(
            f"{dup.size} sample id(s) occur more than once in {name} (e.g. {str(dup[0])!r}); "
            "rows cannot be joined by id: give every row a unique id (re-extract the split)"
        )


def align_ids(
    ids_a: ArrayLike, ids_b: ArrayLike, name_a: str = "a", name_b: str = "b"
) -> tuple[np.ndarray, np.ndarray]:
    """Index arrays ``(ia, ib)`` with ``ids_a[ia] == ids_b[ib]``, in the order of ``ids_a``.

    Refuses (:class:`AlignmentError`) duplicated ids on either side and ids present on one
    side only, naming the count and an example.
    """
    a, b = np.asarray(ids_a).astype(str), np.asarray(ids_b).astype(str)
    _duplicates(a, name_a)
    _duplicates(b, name_b)
    only_a, only_b = np.setdiff1d(a, b), np.setdiff1d(b, a)
    if only_a.size or only_b.size:
        parts = []
        if only_a.size:
            parts.append(f"{only_a.size} sample id(s) of {name_a} are missing from {name_b} (e.g. {str(only_a[0])!r})")
        if only_b.size:
            parts.append(f"{only_b.size} of {name_b} are missing from {name_a} (e.g. {str(only_b[0])!r})")
        raise AlignmentError(
            "; ".join(parts) + ": both sides must hold the same samples; compare splits extracted from the same data"
        )
    ib_sorted = np.argsort(b, kind="stable")
    ib = ib_sorted[np.searchsorted(b[ib_sorted], a)]
    return np.arange(a.size), ib
