"""Stored feature rows read on demand: a lazy ``[n, D]`` view for splits larger than memory.

:class:`StoredRows` is what ``FeatureCache.load(..., lazy=True)`` returns as ``X``: row
selections (a slice, an index array, a boolean mask) and :meth:`StoredRows.concatenate` give
new views without reading anything; ``np.asarray(view)`` reads the rows. Consumers that pass
over the rows block by block (the out-of-core probes) use :meth:`StoredRows.iter_raw`, which
decodes each stored chunk once per pass when the view's rows are in store order
(:meth:`StoredRows.sorted_order` gives that order).

Every chunk read is checked against its crc32c checksum by the zarr codec, as in ``load``.
What ``load``'s integrity scan learnt of each row (all values finite or not) travels with
the views: :meth:`StoredRows.known_nonfinite` answers without reading the rows again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np
from numpy.typing import ArrayLike

from featcache.errors import InternalError, SchemaMismatchError


class StoredRows:
    """Rows ``pos`` of stored arrays ``arrays[part]``, in this order (nothing read yet).

    ``finite``: per array, a mask of its rows known to hold only finite values (from a scan
    that read them), or None where that is unknown."""

    __slots__ = ("_arrays", "_finite", "_part", "_pos")

    def __init__(
        self,
        arrays: Sequence[Any],
        part: np.ndarray | None = None,
        pos: np.ndarray | None = None,
        finite: Sequence[np.ndarray | None] | None = None,
    ):
        self._arrays = tuple(arrays)
        self._finite = tuple(finite) if finite is not None else (None,) * len(self._arrays)
        if len(self._finite) != len(self._arrays):
            raise InternalError("finite needs one mask (or None) per stored array")
        if not self._arrays:
            raise SchemaMismatchError("StoredRows needs at least one stored array")
        d = {tuple(a.shape[1:]) for a in self._arrays}
        dt = {np.dtype(a.dtype) for a in self._arrays}
        if len(d) != 1 or len(dt) != 1:
            raise SchemaMismatchError(
                f"cannot join stored rows of different shapes or dtypes ({sorted(d)}, {sorted(map(str, dt))}): "
                "the splits come from different backbones, feature kinds or precisions; use one backbone's "
                "features of one kind, extracted with the same --precision"
            )
        if pos is None:
            n = self._arrays[0].shape[0]
            pos, part = np.arange(n, dtype=np.int64), np.zeros(n, np.int16)
        self._pos = np.asarray(pos, np.int64)
        self._part = np.zeros(self._pos.size, np.int16) if part is None else np.asarray(part, np.int16)

    # ------------------------------------------------------------------ array protocol
    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self._pos.size), *self._arrays[0].shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._arrays[0].dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def __len__(self) -> int:
        return int(self._pos.size)

    def __repr__(self) -> str:
        return f"StoredRows(shape={self.shape}, dtype={self.dtype}, arrays={len(self._arrays)})"

    def __getitem__(self, key):
        """A row selection (slice, integer array, boolean mask) is a new view; anything else
        (a single row, a column selection) is read."""
        if isinstance(key, slice) or (isinstance(key, (np.ndarray, list)) and np.ndim(key) == 1):
            idx = np.arange(len(self))[key] if isinstance(key, slice) else np.asarray(key)
            if idx.dtype == bool:
                if idx.size != len(self):
                    raise IndexError(f"boolean mask of {idx.size} entries for {len(self)} rows")
                idx = np.flatnonzero(idx)
            return StoredRows(self._arrays, self._part[idx], self._pos[idx], self._finite)
        if isinstance(key, (int, np.integer)):  # one row: read just its chunk
            return np.asarray(self[np.array([key])])[0]
        if isinstance(key, tuple) and key and not isinstance(key[0], (int, np.integer)):
            return np.asarray(self[key[0]])[(slice(None), *key[1:])]
        return np.asarray(self)[key]

    def take(self, idx: ArrayLike) -> StoredRows:
        return cast(StoredRows, self[np.asarray(idx)])  # a 1-D selection is always a view

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        for s, e, raw in self.iter_raw(max(1, len(self))):
            out[s:e] = raw
        return out if dtype is None else out.astype(dtype, copy=False)

    @classmethod
    def concatenate(cls, views: Sequence[StoredRows]) -> StoredRows:
        """The rows of ``views`` one after the other (one view over all their arrays)."""
        arrays, finite, parts, poss = [], [], [], []
        for v in views:
            ids = [next((j for j, a in enumerate(arrays) if a is b), None) for b in v._arrays]
            for j, b in enumerate(v._arrays):
                k = ids[j]
                if k is None:
                    ids[j] = len(arrays)
                    arrays.append(b)
                    finite.append(v._finite[j])
                elif finite[k] is not v._finite[j]:
                    finite[k] = None  # two views disagree on what is known: unknown
            parts.append(np.asarray(ids, np.int16)[v._part] if len(v) else v._part)
            poss.append(v._pos)
        return cls(arrays, np.concatenate(parts), np.concatenate(poss), finite)

    def known_nonfinite(self) -> np.ndarray | None:
        """Mask of this view's rows holding NaN/inf (or unread by the scan), from what the
        load's integrity scan found, without reading; None when no scan covered the rows."""
        finite = [f for f in self._finite if f is not None]
        if len(finite) != len(self._finite):
            return None
        out = np.zeros(len(self), bool)
        for p, fin in enumerate(finite):
            sel = self._part == p
            out[sel] = ~fin[self._pos[sel]]
        return out

    # ------------------------------------------------------------------ block reads
    def sorted_order(self) -> np.ndarray:
        """The permutation that puts the rows in store order (each chunk read once a pass)."""
        return np.lexsort((self._pos, self._part))

    def iter_raw(self, rows: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """``(start, end, rows start..end of the view as stored)`` in blocks of ``rows``.

        Each block is gathered from the stored chunks it touches; the last decoded chunk is
        kept, so rows in store order decode every chunk once per pass (any other order is
        correct, only slower).
        """
        n, rows = len(self), max(1, int(rows))
        last_key, last = None, None  # the last decoded chunk of this pass
        for s in range(0, n, rows):
            e = min(n, s + rows)
            part, pos = self._part[s:e], self._pos[s:e]
            out = np.empty((e - s, *self.shape[1:]), self.dtype)
            for p in np.unique(part):
                arr = self._arrays[p]
                cr = _chunk_rows(arr)
                sel = np.flatnonzero(part == p)
                chunk = pos[sel] // cr
                # chunks in order of first use, so a sorted view reuses the kept chunk
                _, first = np.unique(chunk, return_index=True)
                for c in chunk[np.sort(first)]:
                    if last_key != (p, c):
                        last = None  # drop the previous chunk before decoding the next
                        last, last_key = np.asarray(arr[c * cr : min(arr.shape[0], (c + 1) * cr)]), (p, c)
                    m = sel[chunk == c]
                    assert last is not None  # decoded above for this chunk or a previous block
                    out[m] = last[pos[m] - c * cr]
            yield s, e, out


def _chunk_rows(arr) -> int:
    chunks = getattr(arr, "chunks", None)
    return int(chunks[0]) if chunks else int(arr.shape[0]) or 1
