"""The array constructors of featcache's writers: one definition of each array's shape,
chunks, dtype, fill value and codecs. The writers call them to create arrays, and
:mod:`featcache.store.manifest` calls them to rebuild a damaged metadata document byte for
byte, so this module sits below both (it imports neither)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.errors import SchemaMismatchError
from featcache.store.integrity import UNWRITTEN_ERROR

if TYPE_CHECKING:
    import zarr

__all__ = ["checksummed", "create_aux_array", "create_feature_array", "create_row_array", "kind_fill"]


def checksummed() -> tuple:
    """Compressors of every featcache array: zstd, then a crc32c checksum of the stored bytes
    (a flipped bit or a truncated chunk fails to decode instead of giving other numbers)."""
    from zarr.codecs import Crc32cCodec, ZstdCodec

    return (ZstdCodec(level=3), Crc32cCodec())


#: zarr's array config that writes every chunk, fill-valued ones too (a dict, as zarr takes it)
_WRITE_EMPTY_CHUNKS: Any = {"write_empty_chunks": True}


def create_row_array(g: zarr.Group, name: str, n: int, chunk_rows: int) -> zarr.Array:
    """(Re)create a split's ``ids`` (str) or ``labels`` (int64) array of ``n`` rows."""
    chunks = (min(chunk_rows, max(n, 1)),)
    dtype = {"ids": str, "labels": "int64"}[name]
    return g.create_array(name, shape=(n,), dtype=dtype, chunks=chunks, compressors=checksummed(), overwrite=True)


def create_aux_array(g: zarr.Group, name: str, n: int, chunk_rows: int, n_chunks: int) -> zarr.Array:
    """(Re)create one of the ``valid``/``error``/``done`` arrays of a feature group."""
    kw = {"compressors": checksummed(), "overwrite": True}
    if name == "valid":
        return g.create_array(
            "valid",
            shape=(n,),
            dtype="bool",
            chunks=(chunk_rows,),
            fill_value=False,
            config=_WRITE_EMPTY_CHUNKS,
            **kw,
        )
    if name == "error":
        return g.create_array(
            "error",
            shape=(n,),
            dtype=str,
            chunks=(chunk_rows,),
            fill_value=UNWRITTEN_ERROR,
            config=_WRITE_EMPTY_CHUNKS,
            **kw,
        )
    if name == "done":
        return g.create_array("done", shape=(n_chunks,), dtype="uint8", chunks=(1,), fill_value=0, **kw)
    raise SchemaMismatchError(f"not an auxiliary array: {name!r}")


def kind_fill(dtype: Any) -> Any:
    """The fill value of a feature or target array of ``dtype``: NaN for floats (a lost chunk
    reads as NaN rows, which breaks "valid <=> features"); 0 for the integer target kinds
    (uint8/uint16 masks, int32 tables), whose lost chunks are found by their missing chunk
    objects instead (:func:`~featcache.store.integrity.missing_chunks`)."""
    return np.nan if np.dtype(dtype).kind == "f" else 0


def create_feature_array(
    g: zarr.Group, kind: str, n: int, chunk_rows: int, dim: int, dtype: str, inner: tuple[int, ...] = ()
) -> zarr.Array:
    """(Re)create the ``[n, *inner, dim]`` array of one feature kind (its fill value until its
    chunks are written: :func:`kind_fill`); a chunk holds whole rows: ``(chunk_rows, *inner, dim)``."""
    return g.create_array(
        kind,
        shape=(n, *inner, dim),
        dtype=dtype,
        chunks=(chunk_rows, *inner, dim),
        fill_value=kind_fill(dtype),
        compressors=checksummed(),
        config=_WRITE_EMPTY_CHUNKS,
        overwrite=True,
    )
