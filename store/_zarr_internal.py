"""The one featcache module that touches a zarr internal (``zarr.core``); everything else
goes through zarr's public API (``zarr.open_group``, ``zarr.storage``, ``zarr.abc.store``,
``zarr.buffer``...).

Why it is needed: a zarr 3 :class:`zarr.abc.store.Store` does its I/O (``get``, ``set``,
``delete``, ``list_prefix``) in coroutines only, and zarr has no public way to run one from
synchronous code. zarr's own synchronous API runs them on zarr's I/O event loop, in a thread
of its own, through the private ``zarr.core.sync.sync``; a store may be bound to that loop
(an fsspec filesystem is), so ``asyncio.run`` on a fresh loop is no substitute. zarr's issue
for synchronous store methods: https://github.com/zarr-developers/zarr-python/issues/3637
("ideas for improving the store API", open). When zarr gives stores public sync methods,
replace :func:`sync` with them. ``tests/store/test_zarr_internal.py`` fails when zarr moves or
changes what this module relies on.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["sync"]


def sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a store coroutine to its result on zarr's I/O loop, as zarr's synchronous API does."""
    from zarr.core.sync import sync as zarr_sync

    return zarr_sync(coro)
