"""Chunk-by-chunk writer of feature arrays, safe to resume and to share between ranks.

A row chunk is the unit of work: every array of a feature group is chunked by the same
``chunk_rows`` so one chunk index maps to one chunk object per array. A writer writes all
arrays of chunk ``i`` and only then sets ``done[i] = 1`` (its own chunk object), so a kill at
any moment leaves at worst an unmarked chunk that the next run recomputes. Ranks of a
distributed run own disjoint chunk sets, so no two writers ever touch the same object.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from featcache.errors import ProvenanceMismatchError, SchemaMismatchError
from featcache.store.cache import (
    FeatureCache,
    ensure_split,
    now_iso,
    open_cache,
    remove_group,
    stored_row_chunks,
)
from featcache.store.schema import (
    GROUP_KEY,
    PROVENANCE_KEY,
    SCHEMA_VERSION,
    FeatureGroupMeta,
    FeatureProvenance,
    check_name,
)

log = logging.getLogger(__name__)

DTYPES = ("float16", "float32")
_PARTIAL_RE = re.compile(r"\.[0-9a-f]{32}\.partial$")


def _compressor():
    from zarr.codecs import ZstdCodec

    return ZstdCodec(level=3)


class FeatureWriter:
    """Create (or resume) ``features/<backbone>/<dataset>/<split>`` and write row chunks.

    ``provenances`` maps each feature kind to its :class:`FeatureProvenance`; all share n,
    chunk_rows and dtype.
    """

    def __init__(
        self,
        cache: FeatureCache,
        backbone: str,
        dataset: str,
        split: str,
        provenances: dict[str, FeatureProvenance],
    ):
        if cache.mode != "a":
            raise SchemaMismatchError("open the cache with mode='a' to write features")
        for name, what in ((backbone, "backbone"), (dataset, "dataset"), (split, "split")):
            check_name(what, name)
        for k in provenances:
            check_name("feature kind", k)
            if k in ("valid", "error", "done"):
                raise SchemaMismatchError(f"feature kind name {k!r} is reserved")
        first = next(iter(provenances.values()))
        if first.dtype not in DTYPES:
            raise SchemaMismatchError(f"dtype must be one of {DTYPES}, got {first.dtype!r}")
        self.cache = cache
        self.backbone, self.dataset, self.split = backbone, dataset, split
        self.provenances = provenances
        self.n = first.n
        self.chunk_rows = first.chunk_rows
        self.n_chunks = max(1, -(-self.n // self.chunk_rows))
        self.group = None
        self._handles: dict = {}

    @property
    def path(self) -> str:
        return f"features/{self.backbone}/{self.dataset}/{self.split}"

    # ------------------------------------------------------------------ set-up
    def existing(self) -> dict[str, FeatureProvenance] | None:
        g = self.cache._group("features", self.backbone, self.dataset, self.split)
        if g is None or GROUP_KEY not in g.attrs:
            return None
        gm = FeatureGroupMeta.from_attrs(dict(g.attrs[GROUP_KEY]), where=g.path)
        return {
            k: FeatureProvenance.from_attrs(dict(g[k].attrs[PROVENANCE_KEY]), where=g[k].path)
            for k in gm.kinds
            if k in g
        }

    def prepare(self, *, overwrite: bool = False) -> FeatureWriter:
        """Create arrays, or validate and reuse existing ones (resume). Rank 0 only."""
        old = self.existing()
        if old is not None:
            diffs: dict[str, Any] = {}
            if set(old) != set(self.provenances):
                diffs["kinds"] = (sorted(old), sorted(self.provenances))
            for k in set(old) & set(self.provenances):
                for field, (a, b) in old[k].differences(self.provenances[k]).items():
                    diffs[f"{k}.{field}"] = (a, b)
            if diffs and not overwrite:
                lines = "\n".join(f"  {f}: stored={a!r} requested={b!r}" for f, (a, b) in sorted(diffs.items()))
                raise ProvenanceMismatchError(
                    f"{self.path} already holds features made with different settings:\n{lines}\n"
                    "Use another backbone key (--backbone-name), or --overwrite to replace them."
                )
            if diffs or overwrite:
                log.warning("overwriting %s (%s)", self.path, "settings changed" if diffs else "--overwrite")
                remove_group(self.cache, "features", self.backbone, self.dataset, self.split)
            else:
                self.group = self.cache.root[self.path]
                self.remove_partial_files()
                return self
        self.remove_partial_files()  # a run killed while creating the arrays
        self._create()
        return self

    def _create(self) -> None:
        g = self.cache.root.require_group(self.path)
        cr = self.chunk_rows
        n = self.n
        for kind, prov in self.provenances.items():
            a = g.create_array(
                kind,
                shape=(n, prov.dim),
                dtype=prov.dtype,
                chunks=(cr, prov.dim),
                fill_value=np.nan,
                compressors=_compressor(),
                config={"write_empty_chunks": True},
                overwrite=True,
            )
            a.attrs[PROVENANCE_KEY] = prov.to_attrs()
        g.create_array("valid", shape=(n,), dtype="bool", chunks=(cr,), fill_value=False,
                       config={"write_empty_chunks": True}, overwrite=True)
        g.create_array("error", shape=(n,), dtype=str, chunks=(cr,),
                       config={"write_empty_chunks": True}, overwrite=True)
        g.create_array("done", shape=(self.n_chunks,), dtype="uint8", chunks=(1,), fill_value=0,
                       overwrite=True)
        meta = FeatureGroupMeta(
            SCHEMA_VERSION, self.backbone, self.dataset, self.split, n, cr, self.n_chunks,
            tuple(self.provenances), now_iso(),
        )
        g.attrs[GROUP_KEY] = meta.to_attrs()  # last: marks the group as created
        self.group = g

    def remove_partial_files(self) -> int:
        """Delete temporary ``*.<hex>.partial`` files a killed run left in a local store.

        zarr's LocalStore writes each chunk to such a file and renames it into place, so a
        kill -9 mid-write leaves one behind (never a half-written chunk). Object stores write
        whole objects and leave nothing. Call only while no writer is active (rank 0, before
        the barrier)."""
        if "://" in self.cache.path:
            return 0
        from pathlib import Path

        root = Path(self.cache.path, self.path)
        n = 0
        for f in root.rglob("*.partial"):
            if _PARTIAL_RE.search(f.name):
                f.unlink(missing_ok=True)
                n += 1
        if n:
            log.info("%s: removed %d temporary file(s) left by an interrupted run", self.path, n)
        return n

    def attach(self) -> FeatureWriter:
        """Open arrays created by another rank; settings must match exactly."""
        old = self.existing()
        if old is None:
            raise SchemaMismatchError(f"{self.path} was not created; rank 0 must call prepare() first")
        for k, prov in self.provenances.items():
            if k not in old or old[k].differences(prov):
                raise ProvenanceMismatchError(f"{self.path}: rank settings differ from the stored ones for {k!r}")
        self.group = self.cache.root[self.path]
        return self

    # ------------------------------------------------------------------ chunks
    def _arr(self, name: str):
        """Array handle that stores every chunk, even one equal to the fill value: a chunk
        of all-invalid rows must still exist on disk to count as written. (zarr keeps this
        setting per handle, not in the metadata.)"""
        arr = self._handles.get(name)
        if arr is None:
            arr = self.group[name].with_config({"write_empty_chunks": True})
            self._handles[name] = arr
        return arr

    def chunk_range(self, i: int) -> tuple[int, int]:
        return i * self.chunk_rows, min((i + 1) * self.chunk_rows, self.n)

    def pending_chunks(self) -> list[int]:
        """Chunks not marked done, plus marked chunks whose objects have gone missing."""
        done = np.asarray(self.group["done"][:], dtype=bool)
        todo = set(np.flatnonzero(~done).tolist())
        marked = set(np.flatnonzero(done).tolist())
        if marked:
            for name in (*self.provenances, "valid", "error"):
                lost = marked - stored_row_chunks(self.group[name])
                if lost:
                    log.warning("%s: %d marked chunk(s) of %r are missing; recomputing them", self.path, len(lost), name)
                todo |= lost
        return sorted(int(i) for i in todo)

    def write_chunk(
        self,
        i: int,
        features: dict[str, np.ndarray],
        valid: np.ndarray,
        errors: list[str] | np.ndarray | None = None,
    ) -> None:
        start, stop = self.chunk_range(i)
        rows = stop - start
        valid = np.asarray(valid, dtype=bool)
        if valid.shape != (rows,):
            raise ValueError(f"chunk {i}: valid has shape {valid.shape}, expected ({rows},)")
        if set(features) != set(self.provenances):
            raise ValueError(f"chunk {i}: kinds {sorted(features)} != {sorted(self.provenances)}")
        for kind, x in features.items():
            x = np.asarray(x)
            prov = self.provenances[kind]
            if x.shape != (rows, prov.dim):
                raise ValueError(f"chunk {i}: {kind} has shape {x.shape}, expected ({rows}, {prov.dim})")
            x = x.astype(prov.dtype, copy=True)
            x[~valid] = np.nan
            self._arr(kind)[start:stop] = x
        self._arr("valid")[start:stop] = valid
        errs = np.asarray([""] * rows if errors is None else [str(e) for e in errors], dtype=object)
        self._arr("error")[start:stop] = errs.astype(str)
        self._arr("done")[i] = 1  # only after every array of the chunk is written

    def mark_complete(self, **stats: Any) -> None:
        """Record run statistics (images/s, device, ...) in every kind's provenance."""
        n_invalid = int((~np.asarray(self.group["valid"][:], dtype=bool)).sum())
        for kind in self.provenances:
            arr = self.group[kind]
            d = dict(arr.attrs[PROVENANCE_KEY])
            d.update({k: v for k, v in stats.items() if k in d})
            d["n_invalid"] = n_invalid
            d["completed"] = now_iso()
            FeatureProvenance.from_attrs(d, where=arr.path)  # validate before writing
            arr.attrs[PROVENANCE_KEY] = d


def make_provenance(
    *,
    backbone: str,
    dataset: str,
    split: str,
    kind: str,
    dim: int,
    n: int,
    dataset_fingerprint: str,
    chunk_rows: int,
    dtype: str = "float16",
    model_name: str = "",
    weights_source: str = "",
    weights_sha256: str = "",
    data_config: dict[str, Any] | None = None,
    pooling: str = "",
    **extra_fields: Any,
) -> FeatureProvenance:
    """Fill versions and timestamps; everything else comes from the caller."""
    from featcache import __version__

    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - features from elsewhere
        torch_version = ""
    try:
        import timm

        timm_version = timm.__version__
    except ImportError:  # pragma: no cover
        timm_version = ""
    return FeatureProvenance(
        schema_version=SCHEMA_VERSION,
        backbone=backbone,
        model_name=model_name or backbone,
        weights_source=weights_source,
        weights_sha256=weights_sha256,
        timm_version=timm_version,
        torch_version=torch_version,
        featcache_version=__version__,
        data_config=dict(data_config or {}),
        kind=kind,
        pooling=pooling or kind,
        dim=int(dim),
        dtype=dtype,
        dataset=dataset,
        split=split,
        dataset_fingerprint=dataset_fingerprint,
        n=int(n),
        chunk_rows=int(chunk_rows),
        created=now_iso(),
        **extra_fields,
    )


def write_features(
    path,
    *,
    backbone: str,
    dataset: str,
    split: str,
    X: np.ndarray,
    ids,
    labels,
    class_names: list[str] | None = None,
    kind: str = "pooled",
    dtype: str = "float32",
    chunk_rows: int = 4096,
    valid: np.ndarray | None = None,
    overwrite: bool = False,
    source: str = "array",
    **provenance_fields: Any,
) -> FeatureCache:
    """Write a complete feature array from numpy (precomputed features, tests).

    >>> write_features("c.zarr", backbone="pix", dataset="digits", split="train",
    ...                X=X, ids=ids, labels=y, class_names=names)  # doctest: +SKIP
    """
    cache = path if isinstance(path, FeatureCache) else open_cache(path, "a")
    X = np.asarray(X)
    if X.ndim != 2:
        raise SchemaMismatchError(f"X must be [n, dim], got shape {X.shape}")
    labels = np.asarray(labels, dtype=np.int64)
    if class_names is None:
        class_names = [str(c) for c in range(int(labels.max()) + 1 if len(labels) else 0)]
    meta = ensure_split(cache, dataset, split, np.asarray(ids), labels, list(class_names), source)
    prov = make_provenance(
        backbone=backbone, dataset=dataset, split=split, kind=kind, dim=X.shape[1], n=X.shape[0],
        dataset_fingerprint=meta.fingerprint, chunk_rows=chunk_rows, dtype=dtype,
        **provenance_fields,
    )
    w = FeatureWriter(cache, backbone, dataset, split, {kind: prov}).prepare(overwrite=overwrite)
    valid = np.ones(len(X), bool) if valid is None else np.asarray(valid, bool)
    for i in w.pending_chunks():
        s, e = w.chunk_range(i)
        w.write_chunk(i, {kind: X[s:e]}, valid[s:e])
    w.mark_complete()
    return cache
