"""Fingerprints of stored rows: a split's (ids, labels, class names), a feature group's (its
backbone's identity and its split's), and several combined. Pure functions of metadata."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from featcache.store.schema import FeatureProvenance

__all__ = ["combine_fingerprints", "dataset_fingerprint", "features_fingerprint"]


def dataset_fingerprint(ids: np.ndarray, labels: np.ndarray, class_names: list[str] | tuple[str, ...]) -> str:
    """sha256 over ids, labels and class names: two splits with the same rows agree."""
    h = hashlib.sha256()
    h.update("\n".join(map(str, ids)).encode())
    h.update(b"\0")
    h.update(np.asarray(labels, dtype="<i8").tobytes())
    h.update(b"\0")
    h.update("\n".join(class_names).encode())
    return h.hexdigest()


def combine_fingerprints(*fps: str) -> str:
    """One 16-hex-digit fingerprint of several (train, val, eval split...), in order."""
    return hashlib.sha256("|".join(fps).encode()).hexdigest()[:16]


def features_fingerprint(provenance: dict[str, Any], dataset_fingerprint: str, complete: bool = True) -> str:
    """:attr:`~featcache.store.Features.fingerprint` from the provenance record (``to_attrs()``)
    and the split's fingerprint alone, without reading the features (``complete``: every row
    chunk done, as :meth:`~featcache.store.FeatureCache.load` requires unless ``allow_partial``)."""
    blob = json.dumps(
        {
            "identity": FeatureProvenance.from_attrs(provenance).identity() if provenance else {},
            "dataset": dataset_fingerprint,
            "complete": complete,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
