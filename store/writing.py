"""Writing the parts of a featcache root other than feature chunks (those are
:mod:`featcache.store.writer`'s): dataset splits (ids, labels) and class and caption
embeddings, each checked against what is already stored."""

from __future__ import annotations

import logging
import os

import numpy as np
from numpy.typing import ArrayLike

from featcache.errors import CorruptStoreError, SchemaMismatchError
from featcache.store import manifest
from featcache.store.arrays import checksummed, create_row_array
from featcache.store.cache import FeatureCache, open_cache
from featcache.store.fingerprints import dataset_fingerprint
from featcache.store.locks import StoreLock
from featcache.store.metadata import translating
from featcache.store.root import now_iso, root_unrecorded
from featcache.store.schema import SCHEMA_VERSION, SPLIT_KEY, TEXT_PROVENANCE_KEY, SplitMeta, check_name

log = logging.getLogger(__name__)

__all__ = ["ensure_split", "write_caption_embeddings", "write_class_embeddings"]


def remove_group(cache: FeatureCache, *parts: str) -> None:
    """Delete a sub-group through the Store API (used by --overwrite, under the group's lock)."""
    parent = cache._group(*parts[:-1])
    if parent is not None and parts[-1] in parent:
        del parent[parts[-1]]


@translating
def ensure_split(
    cache: FeatureCache,
    dataset: str,
    split: str,
    ids: np.ndarray,
    labels: np.ndarray,
    class_names: list[str],
    source: str,
    chunk_rows: int = 65536,
) -> SplitMeta:
    """Create the dataset split (ids, labels) or check the existing one is identical.

    Safe under concurrent writers: creation happens under the split's lock, so a split
    without metadata is one whose writer died (never one another job is writing). Stored
    ids/labels that no longer match the fingerprint (damage) are rewritten from the data.
    """
    check_name("dataset", dataset)
    check_name("split", split)
    ids = np.asarray(ids).astype(str)
    labels = np.asarray(labels, dtype=np.int64)
    if len(ids) != len(labels):
        raise SchemaMismatchError(f"{len(ids)} ids but {len(labels)} labels")
    if len(set(ids.tolist())) != len(ids):
        raise SchemaMismatchError(f"sample ids of {dataset}/{split} are not unique; give each sample a distinct id")
    fp = dataset_fingerprint(ids, labels, class_names)
    unit = f"datasets/{dataset}/{split}"
    meta = _existing_split(cache, dataset, split, fp, len(ids))
    if meta is not None and not root_unrecorded(cache.root, unit):
        return meta
    with StoreLock(cache.root, unit, timeout=600, what=unit):
        meta = _existing_split(cache, dataset, split, fp, len(ids))  # another job may have written it
        if meta is not None:
            if root_unrecorded(cache.root, unit):  # its writer stopped before recording its digests
                manifest.record(cache.root, unit)
            return meta
        g = cache._group("datasets", dataset, split)
        if g is not None and SPLIT_KEY in g.attrs:  # metadata sound, arrays damaged: rewrite them
            log.warning("datasets/%s/%s: ids/labels damaged; rewriting them from the data", dataset, split)
            meta = SplitMeta.from_attrs(dict(g.attrs[SPLIT_KEY]), where=g.path)
            _write_rows(g, ids, labels, chunk_rows)
            manifest.record(cache.root, f"datasets/{dataset}/{split}")
            return meta
        if g is not None:
            log.info("datasets/%s/%s was left unfinished by a dead job; writing it again", dataset, split)
        meta = SplitMeta(SCHEMA_VERSION, dataset, split, len(ids), tuple(class_names), fp, source, now_iso())
        manifest.forget(cache.root, f"datasets/{dataset}/{split}")
        sg = cache.root.require_group(f"datasets/{dataset}/{split}")
        _write_rows(sg, ids, labels, chunk_rows)
        sg.attrs[SPLIT_KEY] = meta.to_attrs()  # written last: a split without attrs is unfinished
        manifest.record(cache.root, f"datasets/{dataset}/{split}")
    return meta


def _split_fix(stored: int, n: int) -> str:
    """How to go on when a split's rows differ from the stored ones (a --limit change)."""
    if stored == n:
        return "use another dataset name (--dataset-name / dataset_name=) or a new cache"
    return (
        f"a stored split does not grow or shrink in place (a different --limit / limit=?): to reuse "
        f"its features keep its {stored} rows (--limit {stored}, or the limit it was written with); "
        f"for {n} rows, extract every backbone again under another dataset name "
        "(--dataset-name / dataset_name=) or into a new cache"
    )


def _existing_split(cache: FeatureCache, dataset: str, split: str, fp: str, n: int) -> SplitMeta | None:
    """The stored split's metadata when it is finished, sound and identical; None to (re)write."""
    g = cache._group("datasets", dataset, split)
    if g is None or SPLIT_KEY not in g.attrs:
        return None
    meta = SplitMeta.from_attrs(dict(g.attrs[SPLIT_KEY]), where=g.path)
    if meta.fingerprint != fp:
        raise SchemaMismatchError(
            f"dataset {dataset!r} split {split!r} already exists in {cache.path} with different "
            f"rows (fingerprint {meta.fingerprint[:12]} vs {fp[:12]}, n {meta.n} vs {n}); " + _split_fix(meta.n, n)
        )
    try:
        cache.split_rows(dataset, split, check=True)
    except CorruptStoreError:
        return None
    return meta


def _write_rows(g, ids: np.ndarray, labels: np.ndarray, chunk_rows: int) -> None:
    a = create_row_array(g, "ids", len(ids), chunk_rows)
    if len(ids):
        a[:] = ids
    b = create_row_array(g, "labels", len(ids), chunk_rows)
    if len(ids):
        b[:] = labels


@translating
def write_class_embeddings(
    path_or_cache: str | os.PathLike | FeatureCache,
    dataset: str,
    matrix: np.ndarray,
    name: str = "text",
    backbone: str | None = None,
    provenance: dict | None = None,
) -> None:
    """Store a [C, D] class-embedding matrix beside ``dataset`` (ELEVATER language-initialised
    head, zero-shot). With ``backbone`` (its text tower's embeddings) it is stored for that
    backbone x dataset, under ``class_embeddings/<dataset>/<backbone>/<name>``, and refused
    when D differs from the width of the backbone's stored features of ``dataset``.
    ``provenance``: what made it (:meth:`FeatureCache.class_embeddings_provenance` returns it)."""
    cache = path_or_cache if isinstance(path_or_cache, FeatureCache) else open_cache(path_or_cache, "a")
    check_name("dataset", dataset)
    check_name("embedding", name)
    m = np.asarray(matrix, dtype=np.float32)
    if m.ndim != 2:
        raise SchemaMismatchError(f"class embeddings must be [n_classes, dim], got shape {m.shape}")
    where = f"class_embeddings/{dataset}"
    if backbone is not None:
        check_name("backbone", backbone)
        _check_embedding_width(cache, backbone, dataset, m.shape[1])
        where += f"/{backbone}"
    g = cache.root.require_group(where)
    a = g.create_array(name, shape=m.shape, dtype="float32", chunks=m.shape, compressors=checksummed(), overwrite=True)
    a[:] = m
    if provenance is not None:
        a.attrs[TEXT_PROVENANCE_KEY] = provenance


@translating
def write_caption_embeddings(
    cache: FeatureCache, dataset: str, split: str, backbone: str, emb: np.ndarray, image_ids: ArrayLike, prov: dict
) -> None:
    """Store caption embeddings ``[T, D]`` and the id of each caption's image (several captions
    may share one image) under ``caption_embeddings/<dataset>/<split>/<backbone>``, with ``prov``."""
    for what, v in (("dataset", dataset), ("split", split), ("backbone", backbone)):
        check_name(what, v)
    m = np.asarray(emb, dtype=np.float32)
    ids = np.asarray(image_ids).astype(str)
    if m.ndim != 2 or m.shape[0] != ids.shape[0] or m.shape[0] == 0:
        raise SchemaMismatchError(f"caption embeddings {m.shape} need one image id per row (got {ids.shape[0]})")
    _check_embedding_width(cache, backbone, dataset, m.shape[1])
    g = cache.root.require_group(f"caption_embeddings/{dataset}/{split}/{backbone}")
    a = g.create_array(
        "embeddings", shape=m.shape, dtype="float32", chunks=m.shape, compressors=checksummed(), overwrite=True
    )
    a[:] = m
    b = g.create_array(
        "image_ids", shape=ids.shape, dtype=str, chunks=ids.shape, compressors=checksummed(), overwrite=True
    )
    b[:] = ids
    a.attrs[TEXT_PROVENANCE_KEY] = prov


def _check_embedding_width(cache: FeatureCache, backbone: str, dataset: str, width: int) -> None:
    """Refuse class embeddings whose width differs from ``backbone``'s features of ``dataset``."""
    for b, d, split in cache.entries():
        if (b, d) == (backbone, dataset) and "pooled" in cache.kinds(b, d, split):
            dim = int(cache._feature_group(b, d, split)["pooled"].shape[1])
            if dim != width:
                raise SchemaMismatchError(
                    f"class embeddings of width {width} do not match {backbone}'s {dim}-d features "
                    f"of {dataset!r}; store the matrix of this backbone's own text tower "
                    f"(one row per class, {dim} columns)"
                )
            return


#: where the request each backbone x dataset was extracted with is kept (not a zarr node, as the manifest)
REQUESTS_DIR = ".featcache-requests"


def _request_key(backbone: str, dataset: str) -> str:
    return f"{REQUESTS_DIR}/{check_name('backbone', backbone)}~{check_name('dataset', dataset)}.json"


def read_request(cache: FeatureCache, backbone: str, dataset: str) -> dict | None:
    """The recorded extraction request of ``backbone`` x ``dataset`` (None: none, or unreadable)."""
    import json

    raw = manifest.read_raw(cache.root.store, _request_key(backbone, dataset))
    try:
        doc = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def write_request(cache: FeatureCache, backbone: str, dataset: str, request: dict) -> None:
    """Record the extraction request of ``backbone`` x ``dataset`` (its writer holds the lock)."""
    import json

    data = json.dumps(request, sort_keys=True).encode()
    manifest.write_raw(cache.root.store, _request_key(backbone, dataset), data)
