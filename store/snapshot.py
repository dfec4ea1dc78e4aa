"""Reading one feature kind of a feature group as :meth:`~featcache.store.FeatureCache.load`
returns it: a consistent snapshot (eager) or a checked on-demand view (lazy), and the one
line that names what is unfinished or damaged."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from featcache.errors import IncompleteStoreError
from featcache.store.arrays import kind_fill
from featcache.store.integrity import (
    GroupScan,
    as_str,
    is_integer,
    missing_chunks,
    present_rows,
    read_done,
    row_all,
    scan_group,
)
from featcache.store.schema import FeatureGroupMeta

#: attempts of a whole-group read before a load says the group keeps changing under it
SNAPSHOT_TRIES = 8

__all__ = ["SNAPSHOT_TRIES", "damage_message", "read_group", "scan_group_lazy"]


def damage_message(where: str, sc: GroupScan) -> str:
    """One line: the unfinished chunks, the missing and corrupt chunk files and arrays, what to run."""
    parts = []
    todo = int((~sc.done).sum())
    if todo:
        parts.append(f"{todo} of {sc.n_chunks} row chunks unfinished")
    for name, chunks in sorted(sc.damaged.items()):
        reasons = sc.reasons.get(name, {})
        lost = [i for i in chunks if reasons.get(i, "").startswith("missing")]
        broken = [i for i in chunks if i not in lost]
        if lost:
            parts.append(f"chunk files missing for {name}: {lost[:10]}")
        if broken:
            parts.append(f"{name} chunk(s) {broken[:10]} corrupt ({reasons[broken[0]]})")
    if sc.missing_arrays:
        parts.append(f"arrays missing: {sc.missing_arrays}")
    return (
        f"{where} is incomplete: " + "; ".join(parts) + "; re-run the same `featcache extract` command "
        "to recompute exactly these chunks (or `featcache verify --repair`), or pass allow_partial=True"
    )


def read_chunks(
    g: Any, gm: FeatureGroupMeta, kind: str, sc: GroupScan, dtype: DTypeLike = np.float32
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read what is readable, chunk by chunk (damaged chunks become NaN / invalid / "")."""
    dt = np.dtype(dtype or g[kind].dtype)
    X = np.full((gm.n, *g[kind].shape[1:]), kind_fill(dt), dt)
    valid = np.zeros(gm.n, bool)
    errors = np.full(gm.n, "", dtype=object)
    bad = set(sc.bad_chunks) | set(np.flatnonzero(~sc.done).tolist())
    if sc.missing_arrays:
        bad = set(range(gm.n_chunks))
    for i in range(gm.n_chunks):
        if i in bad:
            continue
        s, e = i * gm.chunk_rows, min((i + 1) * gm.chunk_rows, gm.n)
        X[s:e] = g[kind][s:e]
        valid[s:e] = g["valid"][s:e]
        errors[s:e] = as_str(g["error"][s:e])
    return X, valid, errors.astype(str)


def scan_group_lazy(
    g: Any, gm: FeatureGroupMeta, kind: str, check: bool
) -> tuple[Any, np.ndarray, np.ndarray, GroupScan]:
    """(StoredRows view, valid, errors, scan): with ``check``, every marked chunk is
    read once, one at a time, and checked as :func:`scan_group` does."""
    from featcache.store.rows import StoredRows

    if check:
        sc = scan_group(g, gm.n, gm.chunk_rows, gm.n_chunks, (kind,), finite=True)
    else:
        sc = GroupScan(gm.n_chunks, read_done(g, gm.n_chunks))
    valid = np.asarray(g["valid"][:], dtype=bool)
    errors = as_str(g["error"][:])
    return StoredRows([g[kind]], finite=[sc.finite.get(kind)]), valid, errors, sc


def row_conflicts(X: np.ndarray, valid: np.ndarray, integer: bool) -> np.ndarray:
    """Rows whose values contradict ``valid``: features present on an invalid row or absent
    on a valid one (NaN rows); an integer target's invalid row holding other than 0."""
    if integer:
        return ~valid & ~row_all(np.asarray(X) == 0) if len(X) else np.zeros(0, bool)
    return present_rows(X) != valid


def read_group(
    g: Any, gm: FeatureGroupMeta, kind: str, check: bool, dtype: DTypeLike = np.float32
) -> tuple[np.ndarray, np.ndarray, np.ndarray, GroupScan]:
    """A consistent snapshot of a feature group: the chunks marked done before the arrays
    are read are the chunks the scan calls done (a writer marks a chunk only after its
    arrays, so their rows read afterwards are final). The read is retried when a chunk
    marked done is no longer marked after it (rewritten: ``--overwrite``) or breaks an
    invariant that a re-read no longer shows. On a decode failure or an invariant broken
    for good, a chunk-by-chunk scan names the damage (readable chunks are returned)."""
    for attempt in range(SNAPSHOT_TRIES):
        got = _read_once(g, gm, kind, check, dtype)
        if got is not None:
            return got
        time.sleep(0.01 * 2**attempt)  # let the writer finish its chunk
    raise IncompleteStoreError(
        f"{g.path} changed during {SNAPSHOT_TRIES} reads in a row (an extract is writing it); "
        "load it again when that extract has finished"
    )


def _read_once(g: Any, gm: FeatureGroupMeta, kind: str, check: bool, dtype: DTypeLike):
    """One snapshot attempt of :func:`read_group`; None when the group changed under it."""
    done = read_done(g, gm.n_chunks)
    try:
        X = np.asarray(g[kind][:], dtype=dtype or g[kind].dtype)
        valid = np.asarray(g["valid"][:], dtype=bool)
        errors = as_str(g["error"][:])
        if "done" not in g:
            raise IncompleteStoreError("the group has no done array")  # read chunk by chunk below
    except Exception:
        sc = scan_group(g, gm.n, gm.chunk_rows, gm.n_chunks, (kind,))
        got = read_chunks(g, gm, kind, sc, dtype)
        return (*got, sc) if read_done(g, gm.n_chunks)[sc.done].all() else None
    if not read_done(g, gm.n_chunks)[done].all():
        return None  # a chunk marked done was reset meanwhile (the group is being rewritten)
    sc = GroupScan(gm.n_chunks, done)
    if check:
        rows = row_conflicts(X, valid, is_integer(g[kind])) | ((errors != "") == valid)
        chunks = [i for i in np.unique(np.flatnonzero(rows) // gm.chunk_rows).tolist() if done[i]]
        if is_integer(g[kind]):  # a lost chunk object reads as 0, a legal value: ask the store
            chunks = sorted({*chunks, *missing_chunks(g[kind], np.flatnonzero(done))})
        if chunks:
            sc = scan_group(g, gm.n, gm.chunk_rows, gm.n_chunks, (kind,), chunks=chunks)
            if not sc.done[done].all() or not set(chunks) <= set(sc.bad_chunks):
                return None  # what was read is not what is stored now: read again
            sc.done = done  # chunks marked since the first read were not read whole
    return X, valid, errors, sc
