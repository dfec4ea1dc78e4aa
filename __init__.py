"""featcache: run every backbone over every image once, then probe, retrieve and rank from the cache.

>>> import featcache
>>> cache = featcache.open_cache("featcache-demo.zarr")  # doctest: +SKIP
>>> cache.catalog()  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from featcache._version import __version__
from featcache.core._lazy import lazy_exports
from featcache.errors import (
    FeatcacheError,
    IncompleteStoreError,
    NotInStoreError,
    SchemaMismatchError,
)

if TYPE_CHECKING:
    from featcache.store import open_cache

__all__ = [
    "FeatcacheError",
    "IncompleteStoreError",
    "NotInStoreError",
    "SchemaMismatchError",
    "__version__",
    "open_cache",
]

#: ``open_cache`` (:func:`featcache.store.open_cache`) imports zarr on first use
__getattr__, __dir__ = lazy_exports(__name__, {"open_cache": "featcache.store"})
