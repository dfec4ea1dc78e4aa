"""Who is relevant to whom: same label (semantic retrieval) or an explicit table (content
retrieval, Oxford/Paris style). Also which gallery items are removed from a query's ranking
before scoring: the query itself (matched by **id**, never by position) and junk items."""

from __future__ import annotations

import abc
import logging
import os

import numpy as np
from numpy.typing import ArrayLike

from featcache.errors import DataError

log = logging.getLogger(__name__)

__all__ = [
    "ExplicitRelevance",
    "Relevance",
    "SemanticRelevance",
    "SharedLabelRelevance",
    "load_relevance_table",
    "self_exclusion",
]


def _csr_from_pairs(rows: np.ndarray, cols: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.lexsort((cols, rows))
    rows, cols = rows[order], cols[order]
    keep = np.ones(rows.size, bool)
    keep[1:] = (rows[1:] != rows[:-1]) | (cols[1:] != cols[:-1])
    rows, cols = rows[keep], cols[keep]
    indptr = np.zeros(n_rows + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=n_rows), out=indptr[1:])
    return indptr, cols.astype(np.int64)


def _gallery_positions(gallery_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Position of each of ``ids`` in ``gallery_ids`` (-1 where absent)."""
    gallery_ids = np.asarray(gallery_ids).astype(str)
    ids = np.asarray(ids).astype(str)
    order = np.argsort(gallery_ids, kind="stable")
    sorted_ids = gallery_ids[order]
    if sorted_ids.size > 1 and np.any(sorted_ids[1:] == sorted_ids[:-1]):
        dup = sorted_ids[1:][sorted_ids[1:] == sorted_ids[:-1]][:5].tolist()
        raise DataError(f"gallery ids are not unique (e.g. {dup}); re-extract the split with unique sample ids")
    if sorted_ids.size == 0:
        return np.full(ids.size, -1, np.int64)
    pos = np.searchsorted(sorted_ids, ids)
    pos_c = np.minimum(pos, sorted_ids.size - 1)
    found = sorted_ids[pos_c] == ids
    return np.where(found, order[pos_c], -1).astype(np.int64)


def self_exclusion(query_ids: np.ndarray, gallery_ids: np.ndarray) -> np.ndarray:
    """Gallery position of each query's own id (-1 if the query is not in the gallery)."""
    return _gallery_positions(gallery_ids, query_ids)


def _own_positions(query_ids, gallery_ids, exclude_self: bool) -> np.ndarray:
    """:func:`self_exclusion`, or no exclusion (all -1) when query and gallery are different
    splits: an equal id there is another image (e.g. WebDataset keys restarting per split)."""
    if exclude_self:
        return self_exclusion(query_ids, gallery_ids)
    _gallery_positions(gallery_ids, np.zeros(0, str))  # still checks the gallery ids are unique
    return np.full(np.asarray(query_ids).size, -1, np.int64)


class Relevance(abc.ABC):
    """Base: positives and exclusions of Q queries over a gallery of G items."""

    n_queries: int
    n_gallery: int
    #: CSR of excluded gallery positions per query (self + junk)
    excl_indptr: np.ndarray
    excl_cols: np.ndarray

    @abc.abstractmethod
    def positives(self, i: int) -> np.ndarray:
        """The gallery positions relevant to query ``i``."""

    @abc.abstractmethod
    def is_positive(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Vectorised relevance of (query row, gallery col) pairs; col -1 (FAISS's "no
        result") is never relevant."""

    @abc.abstractmethod
    def n_relevant(self) -> np.ndarray:
        """Per query: how many gallery items are relevant to it."""

    def excluded(self, i: int) -> np.ndarray:
        return self.excl_cols[self.excl_indptr[i] : self.excl_indptr[i + 1]]

    def positive_mask(self, start: int, stop: int) -> np.ndarray:
        """Relevance flags [stop - start, G] (bool) of the queries ``start:stop``."""
        out = np.zeros((stop - start, self.n_gallery), bool)
        for j, i in enumerate(range(start, stop)):
            out[j, self.positives(i)] = True
        return out

    def excluded_pairs(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """``(rows - start, cols)`` of the excluded items of the queries ``start:stop``."""
        lo, hi = self.excl_indptr[start], self.excl_indptr[stop]
        rows = np.repeat(np.arange(stop - start, dtype=np.int64), np.diff(self.excl_indptr[start : stop + 1]))
        return rows, self.excl_cols[lo:hi]

    def max_excluded(self) -> int:
        return int(np.diff(self.excl_indptr).max(initial=0))

    def is_excluded(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        cols = np.asarray(cols, np.int64)
        if self.excl_cols.size == 0:
            return np.zeros(np.broadcast(rows, cols).shape, bool)
        qi = np.repeat(np.arange(self.n_queries, dtype=np.int64), np.diff(self.excl_indptr))
        keys = qi * (self.n_gallery + 1) + self.excl_cols
        probe = rows * (self.n_gallery + 1) + cols
        return np.isin(probe, keys) & (cols >= 0)


class SemanticRelevance(Relevance):
    """A gallery item is relevant to a query when both carry the same label. The query's own
    id in the gallery (leave-one-out) is excluded when ``exclude_self`` (query and gallery
    are one split); duplicates under other ids stay."""

    def __init__(
        self,
        query_labels: ArrayLike,
        gallery_labels: ArrayLike,
        query_ids: ArrayLike,
        gallery_ids: ArrayLike,
        *,
        exclude_self: bool = True,
    ):
        self.query_labels = np.asarray(query_labels, np.int64)
        self.gallery_labels = np.asarray(gallery_labels, np.int64)
        self.n_queries = self.query_labels.size
        self.n_gallery = self.gallery_labels.size
        self.exclude_self = exclude_self
        own = _own_positions(query_ids, gallery_ids, exclude_self)
        has = own >= 0
        self.excl_indptr, self.excl_cols = _csr_from_pairs(
            np.flatnonzero(has).astype(np.int64), own[has], self.n_queries
        )
        self._own = own
        self._by_label = {int(c): np.flatnonzero(self.gallery_labels == c) for c in np.unique(self.query_labels)}
        top = max(int(self.query_labels.max(initial=0)), int(self.gallery_labels.max(initial=0)))
        counts = np.bincount(self.gallery_labels, minlength=top + 1)
        nr = counts[self.query_labels] if self.n_queries else np.zeros(0, np.int64)
        own_rel = has.copy()
        own_rel[has] = self.gallery_labels[own[has]] == self.query_labels[has]
        self._n_relevant = (nr - own_rel).astype(np.int64)

    def positives(self, i: int) -> np.ndarray:
        cols = self._by_label[int(self.query_labels[i])]
        o = self._own[i]
        if o >= 0:
            cols = cols[cols != o]
        return cols

    def positive_mask(self, start: int, stop: int) -> np.ndarray:
        """Relevance flags [stop - start, G]: one label comparison, the query's own id cleared."""
        out = self.gallery_labels[None, :] == self.query_labels[start:stop, None]
        own = self._own[start:stop]
        has = np.flatnonzero(own >= 0)
        out[has, own[has]] = False
        return out

    def is_positive(self, rows: ArrayLike, cols: ArrayLike) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        cols = np.asarray(cols, np.int64)
        safe = np.where(cols >= 0, cols, 0)
        same = self.gallery_labels[safe] == self.query_labels[rows]
        return same & (cols >= 0) & (cols != self._own[rows])

    def n_relevant(self) -> np.ndarray:
        return self._n_relevant


class SharedLabelRelevance(Relevance):
    """Multi-label semantic relevance: a gallery item is relevant to a query when the two
    share at least one label (``[Q, C]`` and ``[G, C]`` 0/1 label matrices, e.g. a
    CLIP_benchmark multi-label export). The query's own id is excluded as in
    :class:`SemanticRelevance`; a query without any label has no relevant item."""

    def __init__(
        self,
        query_matrix: ArrayLike,
        gallery_matrix: ArrayLike,
        query_ids: ArrayLike,
        gallery_ids: ArrayLike,
        *,
        exclude_self: bool = True,
    ):
        Yq = np.asarray(query_matrix).astype(bool)
        Yg = np.asarray(gallery_matrix).astype(bool)
        if Yq.ndim != 2 or Yg.ndim != 2 or Yq.shape[1] != Yg.shape[1]:
            raise DataError(f"label matrices [Q, C] and [G, C] need one C; got {Yq.shape} and {Yg.shape}")
        self.n_queries, self.n_gallery = Yq.shape[0], Yg.shape[0]
        self.exclude_self = exclude_self
        own = _own_positions(query_ids, gallery_ids, exclude_self)
        has = own >= 0
        self.excl_indptr, self.excl_cols = _csr_from_pairs(
            np.flatnonzero(has).astype(np.int64), own[has], self.n_queries
        )
        self._own = own
        self._Yq, self._Yg = Yq, Yg
        shared = Yq.astype(np.float32) @ Yg.T.astype(np.float32) > 0  # [Q, G]: exact for 0/1 counts
        if has.any():
            shared[np.flatnonzero(has), own[has]] = False
        self._pos_indptr = np.zeros(self.n_queries + 1, np.int64)
        np.cumsum(shared.sum(1), out=self._pos_indptr[1:])
        self._pos_cols = np.nonzero(shared)[1].astype(np.int64)

    def positives(self, i: int) -> np.ndarray:
        return self._pos_cols[self._pos_indptr[i] : self._pos_indptr[i + 1]]

    def is_positive(self, rows: ArrayLike, cols: ArrayLike) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        cols = np.asarray(cols, np.int64)
        safe = np.where(cols >= 0, cols, 0)
        share = np.any(self._Yq[rows] & self._Yg[safe], axis=-1)
        return share & (cols >= 0) & (cols != self._own[rows])

    def n_relevant(self) -> np.ndarray:
        return np.diff(self._pos_indptr)


class ExplicitRelevance(Relevance):
    """Relevance from (query, gallery, relevance) triples: ``positive`` items are relevant,
    ``junk`` items are removed from the ranking, everything else is non-relevant. The query's
    own id in the gallery is removed too when ``exclude_self`` (query and gallery are one split)."""

    def __init__(
        self,
        query_ids: ArrayLike,
        gallery_ids: ArrayLike,
        table_query_ids: ArrayLike,
        table_gallery_ids: ArrayLike,
        table_relevance: ArrayLike,
        *,
        exclude_self: bool = True,
    ):
        self.exclude_self = exclude_self
        query_ids = np.asarray(query_ids).astype(str)
        gallery_ids = np.asarray(gallery_ids).astype(str)
        self.n_queries, self.n_gallery = query_ids.size, gallery_ids.size
        tq = np.asarray(table_query_ids).astype(str)
        tg = np.asarray(table_gallery_ids).astype(str)
        rel = np.asarray(table_relevance).astype(str)
        bad = sorted(set(np.unique(rel).tolist()) - {"positive", "junk"})
        if bad:
            raise DataError(
                f"relevance values must be 'positive' or 'junk' (a revisited Oxford/Paris "
                f"file: 'easy', 'hard' or 'junk'), found {bad[:5]}"
            )
        qpos = _gallery_positions(query_ids, tq)
        gpos = _gallery_positions(gallery_ids, tg)
        unknown_q = np.unique(tq[qpos < 0])
        unknown_g = np.unique(tg[gpos < 0])
        if unknown_g.size:
            raise DataError(
                f"{unknown_g.size} gallery id(s) of the relevance table are not in the gallery split "
                f"(e.g. {unknown_g[:5].tolist()}); check --gallery and the table's gallery_id column"
            )
        if unknown_q.size == np.unique(tq).size and tq.size:
            raise DataError(
                f"no query id of the relevance table is in the query split (e.g. {unknown_q[:5].tolist()}); "
                "check --query and the table's query_id column"
            )
        if unknown_q.size:
            log.warning("%d query id(s) of the relevance table are not in the query split; ignored", unknown_q.size)
        ok = qpos >= 0
        qpos, gpos, rel = qpos[ok], gpos[ok], rel[ok]
        both = np.isin(qpos * (self.n_gallery + 1) + gpos, (qpos * (self.n_gallery + 1) + gpos)[rel == "junk"]) & (
            rel == "positive"
        )
        if both.any():
            raise DataError(
                f"{int(both.sum())} (query, gallery) pair(s) are both positive and junk in the relevance table"
            )
        own = _own_positions(query_ids, gallery_ids, exclude_self)
        has = own >= 0
        junk = rel == "junk"
        ex_rows = np.concatenate([qpos[junk], np.flatnonzero(has)])
        ex_cols = np.concatenate([gpos[junk], own[has]])
        self.excl_indptr, self.excl_cols = _csr_from_pairs(
            ex_rows.astype(np.int64), ex_cols.astype(np.int64), self.n_queries
        )
        pos = rel == "positive"
        prow, pcol = qpos[pos].astype(np.int64), gpos[pos].astype(np.int64)
        not_self = pcol != own[prow]
        self.pos_indptr, self.pos_cols = _csr_from_pairs(prow[not_self], pcol[not_self], self.n_queries)
        self._pos_keys = (
            np.repeat(np.arange(self.n_queries, dtype=np.int64), np.diff(self.pos_indptr)) * (self.n_gallery + 1)
            + self.pos_cols
        )

    def positives(self, i: int) -> np.ndarray:
        return self.pos_cols[self.pos_indptr[i] : self.pos_indptr[i + 1]]

    def is_positive(self, rows: ArrayLike, cols: ArrayLike) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        cols = np.asarray(cols, np.int64)
        return np.isin(rows * (self.n_gallery + 1) + cols, self._pos_keys) & (cols >= 0)

    def n_relevant(self) -> np.ndarray:
        return np.diff(self.pos_indptr)


def load_relevance_table(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read a relevance table (parquet or CSV) with columns query_id, gallery_id, relevance.

    Returns three numpy arrays of str."""
    import polars as pl

    p = str(path)
    if not os.path.exists(p):
        raise DataError(f"relevance file {p} does not exist")
    try:
        df = pl.read_parquet(p) if p.endswith((".parquet", ".pq")) else pl.read_csv(p, infer_schema_length=0)
    except Exception as exc:  # polars raises several types for unreadable files
        raise DataError(f"cannot read relevance file {p} ({exc}); give a parquet or CSV file") from exc
    need = ["query_id", "gallery_id", "relevance"]
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise DataError(f"relevance file {p} lacks column(s) {missing}; it needs {need}, has {df.columns}")
    df = df.select([pl.col(c).cast(pl.Utf8) for c in need])
    if df.null_count().sum_horizontal().item():
        raise DataError(f"relevance file {p} has empty cells; every row needs query_id, gallery_id, relevance")
    q, g, r = (df[c].to_numpy().astype(str) for c in need)
    return q, g, r
