"""The on-disk feature cache (Zarr v3). Layout: :mod:`featcache.store.schema`."""

from featcache.store.cache import (
    FeatureCache,
    Features,
    combine_fingerprints,
    dataset_fingerprint,
    ensure_split,
    open_cache,
    write_caption_embeddings,
    write_class_embeddings,
)
from featcache.store.schema import SCHEMA_VERSION, FeatureProvenance, SplitMeta
from featcache.store.writer import FeatureWriter, make_provenance, write_features

__all__ = [
    "SCHEMA_VERSION",
    "FeatureCache",
    "FeatureProvenance",
    "FeatureWriter",
    "Features",
    "SplitMeta",
    "combine_fingerprints",
    "dataset_fingerprint",
    "ensure_split",
    "make_provenance",
    "open_cache",
    "write_caption_embeddings",
    "write_class_embeddings",
    "write_features",
]
