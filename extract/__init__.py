"""The extract stage: images -> backbone -> feature store.

>>> from featcache.extract import ExtractConfig, extract  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

__all__ = ["ExtractConfig", "extract"]


def __getattr__(name: str) -> Any:  # lazy: `featcache extract --help` imports no torch/numpy stack
    if name == "ExtractConfig":
        from featcache.extract.config import ExtractConfig

        return ExtractConfig
    if name == "extract":
        from featcache.extract.pipeline import extract

        return extract
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
