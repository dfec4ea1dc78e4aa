"""Extraction stage: backbones, image data, the extraction pipeline and its CLI."""

__all__ = ["create_backbone", "default_name", "open_dataset"]

#: public names other stages may use (fine-tuning builds its backbone and reads its images
#: with them); imported on first use so ``featcache extract`` starts fast
_LAZY = {"create_backbone": "featcache.extract.backbones", "default_name": "featcache.extract.data",
         "open_dataset": "featcache.extract.data"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'featcache.extract' has no attribute {name!r}")
