"""featcache: run every backbone over every image once, then probe, retrieve and rank from the cache.

>>> import featcache
>>> cache = featcache.open_cache("featcache-demo.zarr")  # doctest: +SKIP
>>> cache.catalog()  # doctest: +SKIP
"""

from __future__ import annotations

__version__ = "0.1.0"

from featcache.errors import (
    FeatcacheError,
    IncompleteStoreError,
    NotInStoreError,
    SchemaMismatchError,
)

__all__ = [
    "FeatcacheError",
    "IncompleteStoreError",
    "NotInStoreError",
    "SchemaMismatchError",
    "__version__",
    "open_cache",
]


def open_cache(store, mode: str = "r", storage_options: dict | None = None):
    """Open a feature cache root: a path, an fsspec URL or a zarr Store
    (see :func:`featcache.store.open_cache`)."""
    from featcache.store import open_cache as _open

    return _open(store, mode, storage_options=storage_options)
