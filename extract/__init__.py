"""The extract stage: images -> backbone -> feature store.

>>> from featcache.extract import ExtractConfig, extract  # doctest: +SKIP

``create_backbone``, ``open_dataset`` (a ``SplitSource`` per split), ``default_name`` and ``split_transform`` are public for the
other stage that reads images (fine-tuning builds its backbone, reads its images and keeps them
as uint8 with them); ``detect_spec`` for the suites (the data spec of a task folder);
``register_format`` and ``format_help`` for a new data format and the ``--data`` help that
lists every registered one (:mod:`featcache.extract.readers`); ``model_help`` and
``weights_help``, the ``--model`` / ``--weights`` help built from the model- and
weight-source registries (fine-tuning's flags show the same).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from featcache.core._lazy import lazy_exports

if TYPE_CHECKING:
    from featcache.extract.backbones import create_backbone, weights_help
    from featcache.extract.config import ExtractConfig
    from featcache.extract.pipeline import extract
    from featcache.extract.preprocess import split_transform
    from featcache.extract.readers import default_name, detect_spec, format_help, open_dataset, register_format
    from featcache.extract.source import SplitSource
    from featcache.extract.sources import model_help

__all__ = [
    "ExtractConfig",
    "SplitSource",
    "create_backbone",
    "default_name",
    "detect_spec",
    "extract",
    "format_help",
    "model_help",
    "open_dataset",
    "register_format",
    "split_transform",
    "weights_help",
]

#: imported on first use so ``featcache extract --help`` imports no torch/numpy stack
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ExtractConfig": "featcache.extract.config",
        "extract": "featcache.extract.pipeline",
        "create_backbone": "featcache.extract.backbones",
        "default_name": "featcache.extract.readers",
        "detect_spec": "featcache.extract.readers",
        "format_help": "featcache.extract.readers",
        "open_dataset": "featcache.extract.readers",
        "register_format": "featcache.extract.readers",
        "split_transform": "featcache.extract.preprocess",
        "SplitSource": "featcache.extract.source",
        "model_help": "featcache.extract.sources",
        "weights_help": "featcache.extract.backbones",
    },
)
