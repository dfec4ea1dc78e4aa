"""The extract stage: images -> backbone -> feature store.

>>> from featcache.extract import ExtractConfig, extract  # doctest: +SKIP

``create_backbone``, ``open_dataset``, ``default_name`` and ``split_transform`` are public for the
other stage that reads images (fine-tuning builds its backbone, reads its images and keeps them
as uint8 with them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from featcache._lazy import lazy_exports

if TYPE_CHECKING:
    from featcache.extract.backbones import create_backbone
    from featcache.extract.config import ExtractConfig
    from featcache.extract.data import default_name, open_dataset
    from featcache.extract.pipeline import extract
    from featcache.extract.preprocess import split_transform

__all__ = ["ExtractConfig", "create_backbone", "default_name", "extract", "open_dataset", "split_transform"]

#: imported on first use so ``featcache extract --help`` imports no torch/numpy stack
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ExtractConfig": "featcache.extract.config",
        "extract": "featcache.extract.pipeline",
        "create_backbone": "featcache.extract.backbones",
        "default_name": "featcache.extract.data",
        "open_dataset": "featcache.extract.data",
        "split_transform": "featcache.extract.preprocess",
    },
)
