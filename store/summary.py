"""A feature group's summary: what ``featcache ls`` / ``catalog()`` need without reading the rows.

The writer records, under the group's writer lock when it marks the group complete,
``rows``, ``valid`` (count), ``chunks`` and two digests: ``markers`` (sha256 of the ``done``
chunk markers) and ``checksums`` (sha256 of the crc32c checksum that ends every stored chunk
object of every array of the group, read as 4-byte suffixes). A writer that reopens the group
to compute chunks removes the summary first. A reader trusts it only while both digests
still match what is stored (a rewritten, lost or added chunk changes them): then the group is
complete with ``rows - valid`` invalid rows; otherwise the caller falls back to reading every
marked chunk. ``featcache verify`` never uses it.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

SUMMARY_KEY = "featcache_summary"


def _chunk_keys(arr) -> list[str]:
    """The store keys of every chunk object of ``arr``, in C order of the chunk grid."""
    enc = arr.metadata.encode_chunk_key
    return [f"{arr.path}/{enc(idx)}" for idx in np.ndindex(*arr.cdata_shape)]


def checksums_digest(g, names) -> str | None:
    """sha256 over the 4-byte crc32c suffix of every chunk object of ``names`` (None if any
    chunk object is missing): ranged reads, no chunk is decoded."""
    import asyncio

    from zarr.abc.store import SuffixByteRequest
    from zarr.buffer import default_buffer_prototype

    from featcache.store._zarr_internal import sync

    keys: list[tuple[Any, str]] = []
    for name in names:
        arr = g[name]
        keys += [(arr.store_path.store, k) for k in _chunk_keys(arr)]
    proto = default_buffer_prototype()

    async def read_all():
        req = SuffixByteRequest(4)
        return await asyncio.gather(*(st.get(k, prototype=proto, byte_range=req) for st, k in keys))

    h = hashlib.sha256()
    for buf in sync(read_all()):
        if buf is None:
            return None
        h.update(buf.to_bytes())
    return h.hexdigest()


def _markers_digest(done: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(done, dtype=np.uint8).tobytes()).hexdigest()


def _arrays(kinds) -> tuple[str, ...]:
    return (*kinds, "valid", "error", "done")


def write_summary(g, n: int, n_chunks: int, kinds, valid: np.ndarray) -> dict[str, Any]:
    """Record the group's summary (the writer, under its lock, once every chunk is marked)."""
    done = np.asarray(g["done"][:], dtype=np.uint8)
    summary = {
        "rows": int(n),
        "valid": int(np.asarray(valid, dtype=bool).sum()),
        "chunks": int(n_chunks),
        "done": int((done != 0).sum()),
        "markers": _markers_digest(done),
        "checksums": checksums_digest(g, _arrays(kinds)),
    }
    g.attrs[SUMMARY_KEY] = summary
    return summary


def clear_summary(g) -> None:
    """Drop the summary before chunks are (re)written (the writer, under its lock)."""
    if SUMMARY_KEY in g.attrs:
        del g.attrs[SUMMARY_KEY]


def trusted_summary(g, n: int, n_chunks: int, kinds) -> dict[str, Any] | None:
    """The group's summary if it still matches its chunk markers and chunk checksums, and
    says every chunk is done; else None (read the chunks instead)."""
    s = g.attrs.get(SUMMARY_KEY)
    if not isinstance(s, dict) or s.get("rows") != n or s.get("chunks") != n_chunks or s.get("done") != n_chunks:
        return None
    try:
        done = np.asarray(g["done"][:], dtype=np.uint8)
        if done.shape != (n_chunks,) or _markers_digest(done) != s.get("markers"):
            return None
        if checksums_digest(g, _arrays(kinds)) != s.get("checksums"):
            return None
    except Exception as exc:  # an unreadable marker or array: not trusted; the scan will say why
        log.debug("%s: summary not trusted (%s)", g.path, exc)
        return None
    return s
