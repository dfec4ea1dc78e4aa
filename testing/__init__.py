"""What a member written outside this repository runs to test itself, as ``zarr.testing`` ships
zarr's store contract:

- :class:`FeatureCacheTests` (:mod:`featcache.testing.store`): the contract every store backend
  passes; a test class that subclasses it and gives its ``target`` fixture and ``raw`` runs it
  (needs pytest: ``pip install 'featcache[testing]'``);
- :func:`check_source` (:mod:`featcache.testing.sources`): a model source's round trip, extract
  -> store -> load, checked against the library's own forward (:func:`source_batch` is the
  preprocessed batch it compares on).

``import featcache.testing`` imports neither pytest, zarr nor torch: each name is imported on
first use. featcache's own tests run the same code (tests/store/test_store_contract.py,
tests/models/test_model_sources.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from featcache.core._lazy import lazy_exports

if TYPE_CHECKING:
    from featcache.testing.sources import SourceCheck, check_source, source_batch
    from featcache.testing.store import FeatureCacheTests

__all__ = ["FeatureCacheTests", "SourceCheck", "check_source", "source_batch"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "FeatureCacheTests": "featcache.testing.store",
        "SourceCheck": "featcache.testing.sources",
        "check_source": "featcache.testing.sources",
        "source_batch": "featcache.testing.sources",
    },
)
