"""The extract stage: images -> backbone -> feature store.

>>> from featcache.extract import ExtractConfig, extract  # doctest: +SKIP

``create_backbone``, ``open_dataset``, ``default_name`` and ``split_transform`` are public for the
other stage that reads images (fine-tuning builds its backbone, reads its images and keeps them
as uint8 with them); ``detect_spec`` for the suites (the data spec of a task folder);
``register_format`` and ``format_help`` for a new data format and the ``--data`` help that
lists every registered one (:mod:`featcache.extract.readers`).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ExtractConfig",
    "create_backbone",
    "default_name",
    "detect_spec",
    "extract",
    "format_help",
    "open_dataset",
    "register_format",
    "split_transform",
]

#: imported on first use so ``featcache extract --help`` imports no torch/numpy stack
_LAZY = {
    "ExtractConfig": "featcache.extract.config",
    "extract": "featcache.extract.pipeline",
    "create_backbone": "featcache.extract.backbones",
    "default_name": "featcache.extract.readers",
    "detect_spec": "featcache.extract.readers",
    "format_help": "featcache.extract.readers",
    "open_dataset": "featcache.extract.readers",
    "register_format": "featcache.extract.readers",
    "split_transform": "featcache.extract.preprocess",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
