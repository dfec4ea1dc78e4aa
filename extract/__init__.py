"""The extract stage: images -> backbone -> feature store.

>>> from featcache.extract import ExtractConfig, extract  # doctest: +SKIP

Images and models come from the layers below every stage: :mod:`featcache.data` (readers,
decoding, preprocessing) and :mod:`featcache.models` (model sources, backbones, weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from featcache.core._lazy import lazy_exports

if TYPE_CHECKING:
    from featcache.extract.config import ExtractConfig
    from featcache.extract.pipeline import extract

__all__ = ["ExtractConfig", "extract"]

#: imported on first use so ``featcache extract --help`` imports no torch/numpy stack
__getattr__, __dir__ = lazy_exports(
    __name__,
    {"ExtractConfig": "featcache.extract.config", "extract": "featcache.extract.pipeline"},
)
