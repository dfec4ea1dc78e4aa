"""Streaming one feature kind in row blocks of whole stored chunks, in bounded memory
(:meth:`~featcache.store.FeatureCache.iter_blocks`): for readers that pass over ``tokens``
(``rows x T x D``) larger than memory. Each chunk is read once, checked as ``load`` checks it
(its crc32c checksum through the zarr codec, the row invariants against ``valid``/``error``),
and cast to float32 into the block handed out."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from featcache.errors import ConfigError, CorruptStoreError, IncompleteStoreError
from featcache.store.integrity import GroupScan, as_str, check_chunk_rows, is_integer, missing_chunks, short_error
from featcache.store.schema import FeatureGroupMeta
from featcache.store.snapshot import damage_message

#: ``max_memory`` of :meth:`FeatureCache.iter_blocks` when none is given (bytes)
DEFAULT_BLOCK_MEMORY = 1 << 30

__all__ = ["DEFAULT_BLOCK_MEMORY", "BlockPlan", "block_bytes", "iter_planned", "plan_blocks"]


#: bytes of reads besides their rows (array metadata documents, the bookkeeping of zarr's
#: asyncio reads: measured under 256 KiB with 32-row chunks)
_READ_OVERHEAD = 1 << 20


def block_bytes(chunks: int, chunk_rows: int, row_shape: tuple[int, ...], itemsize: int) -> int:
    """Peak bytes of streaming blocks of ``chunks`` stored chunks: the float32 block handed out
    and the one being filled (the caller still holds the last), plus the read of one chunk in
    the stored dtype (its compressed bytes, their decoding and the rows zarr returns: measured
    under 3.1 times the chunk's size at zarr 3.1, counted as 4)."""
    values = chunk_rows * int(np.prod(row_shape))
    return 2 * chunks * values * 4 + 4 * values * itemsize + _READ_OVERHEAD


@dataclass(frozen=True)
class BlockPlan:
    """What :func:`iter_planned` reads: rows ``start:stop`` of ``kind`` in blocks of
    ``chunks_per_block`` stored chunks."""

    group: Any
    meta: FeatureGroupMeta
    kind: str
    where: str
    start: int
    stop: int
    chunks_per_block: int


def plan_blocks(g: Any, gm: FeatureGroupMeta, kind: str, where: str, max_memory: int, rows: Any) -> BlockPlan:
    """Check ``max_memory`` and ``rows`` (None, a ``slice`` without step, or ``(start, stop)``)
    and size the blocks; a budget that cannot hold one chunk's block is refused in one line."""
    if isinstance(max_memory, bool) or not isinstance(max_memory, (int, np.integer)) or max_memory < 1:
        raise ConfigError(f"max_memory={max_memory!r}: give a positive number of bytes (e.g. 2 << 30 for 2 GiB)")
    start, stop = _row_range(rows, gm.n)
    arr = g[kind]
    row_shape = tuple(arr.shape[1:])
    one = block_bytes(1, gm.chunk_rows, row_shape, np.dtype(arr.dtype).itemsize)
    if one > max_memory:
        raise ConfigError(
            f"{where}/{kind}: one block of {gm.chunk_rows} rows x {row_shape} (one stored chunk, read as float32) "
            f"needs {one:,} bytes, more than max_memory {int(max_memory):,}; raise --max-memory to at least {one:,}"
        )
    per = one - block_bytes(0, gm.chunk_rows, row_shape, np.dtype(arr.dtype).itemsize)
    k = 1 + (int(max_memory) - one) // per
    return BlockPlan(g, gm, kind, where, start, stop, max(1, k))


def _row_range(rows: Any, n: int) -> tuple[int, int]:
    if rows is None:
        return 0, n
    if isinstance(rows, slice) and rows.step in (None, 1):
        start, stop, _ = rows.indices(n)
        return start, max(start, stop)
    if isinstance(rows, tuple) and len(rows) == 2 and all(isinstance(x, (int, np.integer)) for x in rows):
        lo, hi = int(rows[0]), int(rows[1])
        if 0 <= lo <= hi <= n:
            return lo, hi
    raise ConfigError(f"rows={rows!r}: give None (every row), a slice without a step, or (start, stop) within 0..{n}")


def iter_planned(plan: BlockPlan) -> Iterator[tuple[int, np.ndarray]]:
    """``(first row, float32 rows)`` per block of whole stored chunks (cut at ``rows``' ends).
    A chunk that fails its checksum or its row invariants raises CorruptStoreError naming it;
    a chunk no longer marked done (an ``--overwrite`` rewriting the group) IncompleteStoreError."""
    cr = plan.meta.chunk_rows
    if plan.stop <= plan.start:
        return
    first, last = plan.start // cr, (plan.stop - 1) // cr
    for c0 in range(first, last + 1, plan.chunks_per_block):
        c1 = min(last + 1, c0 + plan.chunks_per_block)
        s, e = max(c0 * cr, plan.start), min(c1 * cr, plan.stop)
        out = _read_block(plan, c0, c1, s, e)
        yield s, out
        del out  # the caller holds it now; drop this reference before the next block


def _read_block(plan: BlockPlan, c0: int, c1: int, s: int, e: int) -> np.ndarray:
    """Rows ``s:e`` (inside chunks ``c0:c1``) of the plan's kind, each chunk checked."""
    g, gm, kind, cr = plan.group, plan.meta, plan.kind, plan.meta.chunk_rows
    if not _done(g, c0, c1):
        raise _changed(plan)
    arrays = {name: g[name] for name in (kind, "valid", "error")}
    out = np.empty((e - s, *arrays[kind].shape[1:]), np.float32)
    scan = GroupScan(gm.n_chunks, np.ones(gm.n_chunks, bool))
    base = c0 * cr
    side = {}  # valid and error of the whole block in one read (small); per chunk when that fails
    for name in ("valid", "error"):
        try:
            side[name] = np.asarray(arrays[name][base : min(c1 * cr, gm.n)])
        except Exception:
            side[name] = None  # read chunk by chunk below, to name the chunk
    lost = set(missing_chunks(arrays[kind], range(c0, c1))) if is_integer(arrays[kind]) else set()
    for c in range(c0, c1):
        cs, ce = c * cr, min((c + 1) * cr, gm.n)
        if c in lost:
            scan.add(kind, c, "missing (chunk object not found)")
        data = {}
        for name, arr in arrays.items():
            try:
                got = side.get(name)
                data[name] = got[cs - base : ce - base] if got is not None else np.asarray(arr[cs:ce])
            except Exception as exc:
                scan.add(name, c, f"unreadable ({short_error(exc)})")
        if "error" in data:
            data["error"] = as_str(data["error"])
        check_chunk_rows(scan, c, data, (kind,))
        if scan.damaged:
            if not _done(g, c, c + 1):
                raise _changed(plan)
            raise CorruptStoreError(damage_message(plan.where, scan))
        lo, hi = max(cs, s), min(ce, e)
        out[lo - s : hi - s] = data.pop(kind)[lo - cs : hi - cs]
    if not _done(g, c0, c1):  # reset while read: what was read may be new rows
        raise _changed(plan)
    return out


def _done(g: Any, c0: int, c1: int) -> bool:
    """Whether chunks ``c0:c1`` are all marked done (only their markers are read)."""
    try:
        return bool(np.asarray(g["done"][c0:c1], dtype=bool).all())
    except Exception:  # a lost or damaged marker: not done
        return False


def _changed(plan: BlockPlan) -> IncompleteStoreError:
    return IncompleteStoreError(
        f"{plan.where} changed while it was streamed (an extract --overwrite is rewriting it); "
        "read it again when that extract has finished"
    )
