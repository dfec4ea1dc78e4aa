"""What a dataset's labels mean for evaluation: its declared task metric and, for
multi-label tasks, an ``[N, C]`` boolean target matrix per split.

Layout (additive to :mod:`featcache.store.schema`): ``datasets/<dataset>`` attrs
``featcache.task = {"metric": ...}``; ``datasets/<dataset>/<split>/label_matrix`` (bool
``[N, C]``, rows in the split's row order) with attrs ``{"class_names": [...], "sha256": ...}``.
The split's 1-D ``labels`` stay as they are (stratification, class checks).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from featcache.errors import NotInStoreError, SchemaMismatchError
from featcache.store.arrays import checksummed
from featcache.store.cache import FeatureCache, open_cache

if TYPE_CHECKING:
    CacheLike = str | os.PathLike | FeatureCache  # a store path, or an open FeatureCache

__all__ = ["TASK_KEY", "load_label_matrix", "task_metric", "write_label_matrix", "write_task_metric"]

TASK_KEY = "featcache.task"
LABEL_MATRIX = "label_matrix"


def _cache(path_or_cache: CacheLike, mode: str = "a") -> FeatureCache:
    return path_or_cache if isinstance(path_or_cache, FeatureCache) else open_cache(path_or_cache, mode)


def write_task_metric(path_or_cache: CacheLike, dataset: str, metric: str) -> None:
    """Declare ``dataset``'s task metric (``top1`` | ``mean_per_class`` | ``map11`` | ``roc_auc_macro``)."""
    from featcache.core.metrics import TASK_METRICS

    if metric not in TASK_METRICS:
        raise SchemaMismatchError(f"unknown task metric {metric!r}; choose one of {TASK_METRICS}")
    cache = _cache(path_or_cache)
    g = cache._group("datasets", dataset)
    if g is None:
        raise NotInStoreError(f"dataset {dataset!r} is not in {cache.path}; write its splits first")
    g.attrs[TASK_KEY] = {"metric": metric}


def task_metric(path_or_cache: CacheLike, dataset: str) -> str | None:
    """The metric declared for ``dataset``, or ``None`` when none is recorded."""
    cache = _cache(path_or_cache, "r")
    g = cache._group("datasets", dataset)
    if g is None:
        return None
    return dict(g.attrs.get(TASK_KEY, {})).get("metric")


def _sha(m: np.ndarray, names) -> str:
    h = hashlib.sha256(np.ascontiguousarray(m, dtype=bool).tobytes())
    h.update(repr(m.shape).encode())
    h.update("\n".join(names).encode())
    return h.hexdigest()[:16]


def write_label_matrix(
    path_or_cache: CacheLike, dataset: str, split: str, matrix: ArrayLike, class_names: Sequence[str]
) -> str:
    """Store multi-label targets ``[N, C]`` (bool/0-1) of an existing split; returns their
    sha256 prefix. Rows follow the split's rows; one column per name in ``class_names``."""
    cache = _cache(path_or_cache)
    ids, _, _meta = cache.split_rows(dataset, split)
    m = np.asarray(matrix)
    names = [str(n) for n in class_names]
    if m.ndim != 2 or m.shape != (len(ids), len(names)):
        raise SchemaMismatchError(
            f"label matrix of {dataset}/{split} must be [{len(ids)}, {len(names)}] (one row per "
            f"sample of the split, one column per class name), got shape {m.shape}"
        )
    if m.dtype != bool and not np.isin(m, (0, 1)).all():
        raise SchemaMismatchError("label matrix entries must be bool or 0/1")
    m = m.astype(bool)
    g = cache._existing("datasets", dataset, split)
    a = g.create_array(
        LABEL_MATRIX,
        shape=m.shape,
        dtype="bool",
        chunks=(min(65536, max(len(ids), 1)), max(len(names), 1)),
        compressors=checksummed(),
        overwrite=True,
    )
    a[:] = m
    sha = _sha(m, names)
    a.attrs["class_names"] = names
    a.attrs["sha256"] = sha
    return sha


def load_label_matrix(path_or_cache: CacheLike, dataset: str, split: str) -> tuple[np.ndarray, list[str], str] | None:
    """(targets [N, C] bool, class names, sha256 prefix) of a split, or ``None`` when the
    split has single-label targets only."""
    cache = _cache(path_or_cache, "r")
    cache.split_meta(dataset, split)  # NotInStoreError with the holdings when absent
    g = cache._existing("datasets", dataset, split)
    if LABEL_MATRIX not in g:
        return None
    a = g[LABEL_MATRIX]
    return np.asarray(a[:], dtype=bool), list(a.attrs["class_names"]), str(a.attrs["sha256"])
