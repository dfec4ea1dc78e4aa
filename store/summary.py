"""A feature group's summary: what ``featcache ls`` / ``catalog()`` need without reading the rows.

The writer records, under the group's writer lock when it marks the group complete,
``rows``, ``valid`` (count), ``chunks`` and digests: ``markers`` (sha256 of the ``done``
chunk markers), ``checksums`` (sha256 of the crc32c checksum that ends every stored chunk
object of every array of the group, read as 4-byte suffixes), ``arrays`` (the same per array,
bound to the array's node path) and ``place`` (the group's node path and the identity of the
backbone of each kind). ``featcache verify`` and ``load`` check ``arrays`` and ``place``, so a
group or chunk folder moved or swapped from another backbone is named, never read as this
one's (:func:`check_place`). A writer that reopens the group
to compute chunks removes the summary first. A reader trusts it only while both digests
still match what is stored (a rewritten, lost or added chunk changes them): then the group is
complete with ``rows - valid`` invalid rows; otherwise the caller falls back to reading every
marked chunk."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

SUMMARY_KEY = "featcache_summary"


def _chunk_keys(arr) -> list[str]:
    """The store keys of every chunk object of ``arr``, in C order of the chunk grid."""
    enc = arr.metadata.encode_chunk_key
    return [f"{arr.path}/{enc(idx)}" for idx in np.ndindex(*arr.cdata_shape)]


def _suffixes(g, names) -> dict[str, list[bytes] | None]:
    """Per array of ``names``, the 4-byte crc32c suffix of every chunk object (None when one is
    missing): ranged reads, no chunk is decoded."""
    import asyncio

    from zarr.abc.store import SuffixByteRequest
    from zarr.buffer import default_buffer_prototype

    from featcache.store._zarr_internal import sync

    keys: list[tuple[str, Any, str]] = []
    for name in names:
        arr = g[name]
        keys += [(name, arr.store_path.store, k) for k in _chunk_keys(arr)]
    proto = default_buffer_prototype()

    async def read_all():
        req = SuffixByteRequest(4)
        return await asyncio.gather(*(st.get(k, prototype=proto, byte_range=req) for _, st, k in keys))

    out: dict[str, list[bytes] | None] = {name: [] for name in names}
    for (name, _, _), buf in zip(keys, sync(read_all()), strict=True):
        got = out[name]
        if got is not None:
            out[name] = None if buf is None else [*got, buf.to_bytes()]
    return out


def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for b in parts:
        h.update(b)
    return h.hexdigest()


def checksums_digest(g, names) -> str | None:
    """sha256 over the 4-byte crc32c suffix of every chunk object of ``names`` (None if any
    chunk object is missing): ranged reads, no chunk is decoded."""
    got = _suffixes(g, names)
    if any(v is None for v in got.values()):
        return None
    return _digest([b for name in names for b in got[name] or []])


def array_checksums(g, names) -> dict[str, str | None]:
    """Per array, the sha256 of its chunks' crc32c suffixes bound to the array's node path (a
    chunk folder moved from another array or group gives another digest); None: a chunk
    object is missing."""
    got = _suffixes(g, names)
    return {name: None if v is None else _digest([f"{g.path}/{name}".encode(), b"\0", *v]) for name, v in got.items()}


def place_digest(g, kinds) -> str:
    """sha256 of the group's node path and the identity of the backbone that computed each kind
    (model, weights, data config, pooling...): the documents of a group moved from another
    path or backbone give another digest."""
    import json

    from featcache.store.schema import PROVENANCE_KEY, FeatureProvenance

    ident = {}
    for k in kinds:
        prov = dict(g[k].attrs.get(PROVENANCE_KEY, {}))
        ident[k] = {f: prov.get(f) for f in ("backbone", "weights_source", *FeatureProvenance.IDENTITY)}
    blob = json.dumps({"node": g.path, "identity": ident}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _markers_digest(done: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(done, dtype=np.uint8).tobytes()).hexdigest()


def _arrays(kinds) -> tuple[str, ...]:
    return (*kinds, "valid", "error", "done")


def write_summary(g, n: int, n_chunks: int, kinds, valid: np.ndarray) -> dict[str, Any]:
    """Record the group's summary (the writer, under its lock, once every chunk is marked)."""
    done = np.asarray(g["done"][:], dtype=np.uint8)
    arrays = array_checksums(g, _arrays(kinds))
    summary = {
        "rows": int(n),
        "valid": int(np.asarray(valid, dtype=bool).sum()),
        "chunks": int(n_chunks),
        "done": int((done != 0).sum()),
        "markers": _markers_digest(done),
        "checksums": checksums_digest(g, _arrays(kinds)),
        "arrays": arrays,
        "place": place_digest(g, kinds),
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


#: problem name of a complete group without its summary: every chunk must be recomputed
UNBOUND = "summary"


def check_place(
    g: Any, where: str, gm: Any, names: Sequence[str], *, complete: bool = False, store: str = ""
) -> tuple[list[tuple[str, str]], str | None]:
    """(problems as (array name, "" for the group or :data:`UNBOUND`, line), note) binding a
    feature group at node ``where`` to its place: its group metadata must name this path, and,
    where its summary recorded them, the ``place`` digest (path + backbone identity) and each of
    ``names``' chunk digests must match what is stored. A ``complete`` group (every chunk marked
    done) must have its summary: its writer records it under its lock when it marks the last
    chunk, so a complete group without one lost it, and its chunks are bound to nothing.
    ``note``: what cannot be checked (a summary written before these digests, or none yet);
    ``store``: the store's path, for the command a problem line names."""
    parts = where.split("/")
    problems = []
    named = f"features/{gm.backbone}/{gm.dataset}/{gm.split}"
    if parts[1:4] != [gm.backbone, gm.dataset, gm.split]:
        problems.append(
            (
                "",
                f"{where}: its group metadata names {named} (the folder was moved or swapped with another "
                f"group's): move it back to {named}, or delete {where} and re-run its extract",
            )
        )
    s = g.attrs.get(SUMMARY_KEY)
    if not isinstance(s, dict) and complete:
        cmd = f"featcache verify --repair {store}".rstrip()
        line = (
            f"{where}: every row chunk is marked done but its summary ({SUMMARY_KEY}: the digests that bind "
            "its chunks to this place and backbone) is missing, so chunks moved here from another group "
            f"cannot be told from its own: run `{cmd}` (it marks every chunk for recomputation), then "
            "re-run the extract that wrote it"
        )
        return [*problems, (UNBOUND, line)], None
    if not isinstance(s, dict) or not isinstance(s.get("arrays"), dict) or "place" not in s:
        why = "it is not complete yet" if not isinstance(s, dict) else "its summary was written before them"
        return problems, f"{where}: chunks not bound to their place ({why}): a chunk folder moved here is not detected"
    if not problems and all(k in g for k in gm.kinds) and place_digest(g, gm.kinds) != s["place"]:
        problems.append(
            (
                "",
                f"{where}: its documents were written for another place or backbone (the place digest of its "
                "summary differs): a moved or swapped group; delete it and re-run its extract",
            )
        )
    done = np.asarray(g["done"][:], dtype=np.uint8) if "done" in g else None
    check = [
        n
        for n in names
        if n in s["arrays"] and n in g and (n != "done" or (done is not None and _markers_digest(done) == s["markers"]))
    ]
    for name, got in array_checksums(g, check).items():
        if got is not None and got != s["arrays"][name]:
            problems.append(
                (
                    name,
                    f"{where}/{name}: its chunk objects are not the ones written there (their checksums differ "
                    "from the group's summary: moved or swapped from another array or group, or replaced)",
                )
            )
    return problems, None
