"""Reading (and low-level writing) of a featcache root. See :mod:`featcache.store.schema`
for the layout."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from featcache.errors import (
    CacheNotWritableError,
    IncompleteStoreError,
    NotInStoreError,
    SchemaMismatchError,
)
from featcache.store.schema import (
    GROUP_KEY,
    PROVENANCE_KEY,
    ROOT_KEY,
    SCHEMA_VERSION,
    SPLIT_KEY,
    FeatureGroupMeta,
    FeatureProvenance,
    RootMeta,
    SplitMeta,
    check_name,
)

log = logging.getLogger(__name__)

AUX_ARRAYS = ("valid", "error", "done")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def dataset_fingerprint(ids: np.ndarray, labels: np.ndarray, class_names: list[str] | tuple[str, ...]) -> str:
    """sha256 over ids, labels and class names: two splits with the same rows agree."""
    h = hashlib.sha256()
    h.update("\n".join(map(str, ids)).encode())
    h.update(b"\0")
    h.update(np.asarray(labels, dtype="<i8").tobytes())
    h.update(b"\0")
    h.update("\n".join(class_names).encode())
    return h.hexdigest()


def _as_str(a) -> np.ndarray:
    """zarr returns numpy's variable-width StringDType; hand out plain ``<U`` arrays."""
    a = np.asarray(a)
    if a.dtype.kind == "U":
        return a
    return np.asarray(a.astype(object), dtype=str) if a.size else np.asarray([], dtype=str)


def _is_url(path: str) -> bool:
    return "://" in str(path)


@dataclass
class Features:
    """Features of one backbone x dataset x split x kind, loaded into memory."""

    backbone: str
    dataset: str
    split: str
    kind: str
    X: np.ndarray
    labels: np.ndarray
    ids: np.ndarray
    valid: np.ndarray
    class_names: list[str]
    provenance: dict[str, Any]
    dataset_fingerprint: str
    errors: np.ndarray | None = None
    complete: bool = True
    fingerprint: str = field(default="")

    def __post_init__(self) -> None:
        if not self.fingerprint:
            blob = json.dumps(
                {
                    "identity": FeatureProvenance.from_attrs(self.provenance).identity()
                    if self.provenance
                    else {},
                    "dataset": self.dataset_fingerprint,
                    "complete": self.complete,
                },
                sort_keys=True,
                default=str,
            )
            self.fingerprint = hashlib.sha256(blob.encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return int(self.X.shape[0])

    def __repr__(self) -> str:
        return (
            f"Features({self.backbone!r}, {self.dataset!r}, {self.split!r}, kind={self.kind!r}, "
            f"X={self.X.shape}, valid={int(self.valid.sum())}/{len(self.valid)})"
        )


class FeatureCache:
    """A featcache root: many backbones x datasets x splits.

    >>> cache = open_cache("featcache-demo.zarr")  # doctest: +SKIP
    >>> f = cache.load("tf_efficientnet_lite0", "digits", "train")  # doctest: +SKIP
    >>> f.X.shape  # doctest: +SKIP
    (1347, 1280)
    """

    def __init__(self, root, path: str, mode: str):
        self.root = root
        self.path = str(path)
        self.mode = mode
        meta = root.attrs.get(ROOT_KEY)
        if meta is None:
            raise SchemaMismatchError(
                f"{path} is a zarr group but not a featcache store (no '{ROOT_KEY}' attribute); "
                "point --cache at a featcache root or a new path"
            )
        self.meta = RootMeta.from_attrs(dict(meta), where=str(path))

    # ------------------------------------------------------------------ listing
    def _group(self, *parts: str):
        g = self.root
        for p in parts:
            try:
                g = g[p]
            except KeyError:
                return None
        return g

    @staticmethod
    def _children(g) -> list[str]:
        if g is None:
            return []
        return sorted(k for k, _ in g.groups())

    def backbones(self) -> list[str]:
        return self._children(self._group("features"))

    def datasets(self) -> list[str]:
        return self._children(self._group("datasets"))

    def splits(self, dataset: str) -> list[str]:
        return self._children(self._group("datasets", dataset))

    def kinds(self, backbone: str, dataset: str, split: str) -> list[str]:
        g = self._group("features", backbone, dataset, split)
        if g is None:
            return []
        return list(FeatureGroupMeta.from_attrs(dict(g.attrs[GROUP_KEY]), where=g.path).kinds)

    def entries(self) -> list[tuple[str, str, str]]:
        out = []
        for b in self.backbones():
            for d in self._children(self._group("features", b)):
                for s in self._children(self._group("features", b, d)):
                    out.append((b, d, s))
        return out

    def _holdings(self) -> str:
        ents = self.entries()
        if not ents:
            dsets = {d: self.splits(d) for d in self.datasets()}
            return f"the store holds no features yet (datasets: {dsets or 'none'})"
        return "the store holds: " + ", ".join(f"{b}/{d}/{s}" for b, d, s in ents)

    # ------------------------------------------------------------------ split
    def split_meta(self, dataset: str, split: str) -> SplitMeta:
        g = self._group("datasets", dataset, split)
        if g is None:
            raise NotInStoreError(
                f"dataset {dataset!r} split {split!r} is not in {self.path}; "
                f"datasets/splits present: { {d: self.splits(d) for d in self.datasets()} }"
            )
        return SplitMeta.from_attrs(dict(g.attrs.get(SPLIT_KEY, {})), where=g.path)

    def split_rows(self, dataset: str, split: str) -> tuple[np.ndarray, np.ndarray, SplitMeta]:
        meta = self.split_meta(dataset, split)
        g = self._group("datasets", dataset, split)
        ids = _as_str(g["ids"][:])
        labels = np.asarray(g["labels"][:], dtype=np.int64)
        return ids, labels, meta

    # ------------------------------------------------------------------ features
    def _feature_group(self, backbone: str, dataset: str, split: str):
        g = self._group("features", backbone, dataset, split)
        if g is None:
            raise NotInStoreError(
                f"no features for backbone {backbone!r}, dataset {dataset!r}, split {split!r} in "
                f"{self.path}; {self._holdings()}. Run `featcache extract` to add them."
            )
        return g

    def provenance(self, backbone: str, dataset: str, split: str, kind: str = "pooled") -> FeatureProvenance:
        g = self._feature_group(backbone, dataset, split)
        if kind not in g:
            raise NotInStoreError(
                f"feature kind {kind!r} not stored for {backbone}/{dataset}/{split}; "
                f"kinds present: {self.kinds(backbone, dataset, split)}"
            )
        return FeatureProvenance.from_attrs(dict(g[kind].attrs.get(PROVENANCE_KEY, {})), where=g[kind].path)

    def chunk_status(self, backbone: str, dataset: str, split: str) -> dict[str, Any]:
        """Which row chunks are marked done, and which marked chunks lack files."""
        g = self._feature_group(backbone, dataset, split)
        gm = FeatureGroupMeta.from_attrs(dict(g.attrs[GROUP_KEY]), where=g.path)
        done = np.asarray(g["done"][:], dtype=bool)
        missing: dict[str, list[int]] = {}
        for name in (*gm.kinds, "valid", "error"):
            present = stored_row_chunks(g[name])
            lost = [int(i) for i in np.flatnonzero(done) if i not in present]
            if lost:
                missing[name] = lost
        return {
            "n_chunks": gm.n_chunks,
            "done": done,
            "missing_files": missing,
            "complete": bool(done.all()) and not missing,
        }

    def load(
        self,
        backbone: str,
        dataset: str,
        split: str,
        kind: str = "pooled",
        *,
        allow_partial: bool = False,
        dtype=np.float32,
    ) -> Features:
        """Load features as float32 (``dtype=None``: the stored dtype, e.g. float16 for
        out-of-core probes) with labels, ids, valid mask and provenance.

        Raises IncompleteStoreError when chunks are unfinished or missing, unless
        ``allow_partial`` (then unfinished rows have ``valid=False``).
        """
        g = self._feature_group(backbone, dataset, split)
        prov = self.provenance(backbone, dataset, split, kind)
        ids, labels, smeta = self.split_rows(dataset, split)
        if prov.dataset_fingerprint != smeta.fingerprint:
            raise SchemaMismatchError(
                f"features {backbone}/{dataset}/{split} were computed on a different version of "
                f"the split (fingerprint {prov.dataset_fingerprint[:12]} vs {smeta.fingerprint[:12]}); "
                "re-extract with --overwrite"
            )
        status = self.chunk_status(backbone, dataset, split)
        valid = np.asarray(g["valid"][:], dtype=bool)
        if not status["complete"]:
            todo = int((~status["done"]).sum())
            msg = (
                f"{backbone}/{dataset}/{split} is incomplete: {todo} of {status['n_chunks']} row "
                f"chunks unfinished"
            )
            if status["missing_files"]:
                msg += f", chunk files missing for {status['missing_files']}"
            msg += "; re-run the same `featcache extract` command to finish it, or pass allow_partial=True"
            if not allow_partial:
                raise IncompleteStoreError(msg)
            log.warning(msg)
            bad = ~status["done"]
            for lost in status["missing_files"].values():
                bad[lost] = True
            row_bad = np.repeat(bad, prov.chunk_rows)[: len(valid)]
            valid = valid & ~row_bad
        X = g[kind][:] if dtype is None else np.asarray(g[kind][:], dtype=dtype)
        errors = _as_str(g["error"][:])
        return Features(
            backbone=backbone,
            dataset=dataset,
            split=split,
            kind=kind,
            X=X,
            labels=labels,
            ids=ids,
            valid=valid,
            class_names=list(smeta.class_names),
            provenance=prov.to_attrs(),
            dataset_fingerprint=smeta.fingerprint,
            errors=errors,
            complete=status["complete"],
        )

    # ------------------------------------------------------------------ catalog
    def catalog(self):
        """One row per backbone x dataset x split x kind, as a polars DataFrame."""
        import polars as pl

        rows = []
        for b, d, s in self.entries():
            g = self._group("features", b, d, s)
            try:
                status = self.chunk_status(b, d, s)
            except SchemaMismatchError as exc:
                log.warning("skipping %s/%s/%s: %s", b, d, s, exc)
                continue
            n_invalid = int((~np.asarray(g["valid"][:], dtype=bool)).sum())
            for kind in self.kinds(b, d, s):
                prov = self.provenance(b, d, s, kind)
                rows.append(
                    {
                        "backbone": b,
                        "dataset": d,
                        "split": s,
                        "kind": kind,
                        "n": prov.n,
                        "dim": prov.dim,
                        "dtype": prov.dtype,
                        "complete": status["complete"],
                        "n_invalid": n_invalid,
                        "bytes": int(g[kind].nbytes_stored()),
                        "weights": prov.weights_source,
                        "images_per_s": prov.images_per_s,
                        "peak_memory_mb": prov.peak_memory_mb,
                        "created": prov.created,
                    }
                )
        schema = {
            "backbone": pl.Utf8,
            "dataset": pl.Utf8,
            "split": pl.Utf8,
            "kind": pl.Utf8,
            "n": pl.Int64,
            "dim": pl.Int64,
            "dtype": pl.Utf8,
            "complete": pl.Boolean,
            "n_invalid": pl.Int64,
            "bytes": pl.Int64,
            "weights": pl.Utf8,
            "images_per_s": pl.Float64,
            "peak_memory_mb": pl.Float64,
            "created": pl.Utf8,
        }
        return pl.DataFrame(rows, schema=schema, orient="row" if rows else None)

    # ------------------------------------------------------------------ class embeddings
    def load_class_embeddings(self, dataset: str, name: str = "text") -> np.ndarray:
        g = self._group("class_embeddings", dataset)
        if g is None or name not in g:
            have = [k for k, _ in g.arrays()] if g is not None else []
            raise NotInStoreError(
                f"no class embeddings {name!r} for dataset {dataset!r} (present: {have}); "
                "store them with featcache.store.write_class_embeddings"
            )
        return np.asarray(g[name][:], dtype=np.float32)

    def __repr__(self) -> str:
        return f"FeatureCache({self.path!r}, {len(self.entries())} feature groups)"


def stored_row_chunks(arr) -> set[int]:
    """Row-chunk indices of ``arr`` whose chunk objects exist in the store."""
    from zarr.core.array import _shards_initialized
    from zarr.core.sync import sync

    keys = sync(_shards_initialized(arr._async_array))
    out = set()
    for k in keys:
        parts = k.split("/")
        # default v3 chunk key encoding: "c/<row>/<col>..."
        if parts and parts[0] == "c" and len(parts) >= 2:
            out.add(int(parts[1]))
    return out


def _check_writable(path: str) -> None:
    if _is_url(path):
        return
    p = Path(path).resolve()
    probe = p
    while not probe.exists():
        probe = probe.parent
    if probe.is_file():
        raise CacheNotWritableError(
            f"cache path {path} cannot be created: {probe} is a file, not a directory; choose another --cache"
        )
    if not os.access(probe, os.W_OK):
        raise CacheNotWritableError(
            f"cache path {path} is not writable ({probe} denies writing); choose a writable --cache "
            "or fix the permissions"
        )


def open_cache(path: str | os.PathLike, mode: str = "r", storage_options: dict | None = None) -> FeatureCache:
    """Open a featcache root.

    ``mode="r"`` opens an existing store read-only; ``"a"`` creates it if needed.
    ``path`` may be a local directory or any fsspec URL zarr accepts (``s3://...``).
    """
    import zarr

    path = str(path)
    if mode not in ("r", "a"):
        raise ValueError("mode must be 'r' or 'a'")
    kwargs: dict[str, Any] = {}
    if storage_options:
        kwargs["storage_options"] = storage_options
    if mode == "r":
        if not _is_url(path) and not Path(path).exists():
            raise NotInStoreError(f"no feature cache at {path}; create one with `featcache extract --cache {path}`")
        try:
            root = zarr.open_group(path, mode="r", **kwargs)
        except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
            raise NotInStoreError(f"no feature cache at {path} ({exc}); create one with `featcache extract`") from exc
        return FeatureCache(root, path, "r")
    _check_writable(path)
    try:
        root = zarr.open_group(path, mode="a", zarr_format=3, **kwargs)
    except OSError as exc:
        raise CacheNotWritableError(f"cannot write the cache at {path}: {exc}; choose a writable --cache") from exc
    if ROOT_KEY not in root.attrs:
        if any(True for _ in root.keys()):
            raise SchemaMismatchError(
                f"{path} is a non-empty zarr group that is not a featcache store; choose a new --cache path"
            )
        from featcache import __version__

        root.attrs[ROOT_KEY] = RootMeta(SCHEMA_VERSION, __version__, now_iso()).to_attrs()
    return FeatureCache(root, path, "a")


def remove_group(cache: FeatureCache, *parts: str) -> None:
    """Delete a sub-group (used by --overwrite)."""
    parent = cache._group(*parts[:-1])
    if parent is not None and parts[-1] in parent:
        del parent[parts[-1]]
        if not _is_url(cache.path):  # LocalStore may leave empty dirs behind
            d = Path(cache.path, *parts)
            if d.exists():
                shutil.rmtree(d)


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
    """Create the dataset split (ids, labels) or check the existing one is identical."""
    check_name("dataset", dataset)
    check_name("split", split)
    ids = np.asarray(ids).astype(str)
    labels = np.asarray(labels, dtype=np.int64)
    if len(ids) != len(labels):
        raise SchemaMismatchError(f"{len(ids)} ids but {len(labels)} labels")
    if len(set(ids.tolist())) != len(ids):
        raise SchemaMismatchError(f"sample ids of {dataset}/{split} are not unique; give each sample a distinct id")
    fp = dataset_fingerprint(ids, labels, class_names)
    g = cache._group("datasets", dataset, split)
    if g is not None and SPLIT_KEY not in g.attrs:  # a run killed while writing the split: redo it
        log.info("datasets/%s/%s was left unfinished; writing it again", dataset, split)
        remove_group(cache, "datasets", dataset, split)
        g = None
    if g is not None:
        meta = SplitMeta.from_attrs(dict(g.attrs.get(SPLIT_KEY, {})), where=g.path)
        if meta.fingerprint != fp:
            raise SchemaMismatchError(
                f"dataset {dataset!r} split {split!r} already exists in {cache.path} with different "
                f"rows (fingerprint {meta.fingerprint[:12]} vs {fp[:12]}, n {meta.n} vs {len(ids)}); "
                "use another dataset name (--dataset-name) or a new cache"
            )
        return meta
    meta = SplitMeta(SCHEMA_VERSION, dataset, split, len(ids), tuple(class_names), fp, source, now_iso())
    sg = cache.root.require_group(f"datasets/{dataset}/{split}")
    n = max(len(ids), 1)
    a = sg.create_array("ids", shape=(len(ids),), dtype=str, chunks=(min(chunk_rows, n),), overwrite=True)
    if len(ids):
        a[:] = ids
    b = sg.create_array("labels", shape=(len(ids),), dtype="int64", chunks=(min(chunk_rows, n),), overwrite=True)
    if len(ids):
        b[:] = labels
    sg.attrs[SPLIT_KEY] = meta.to_attrs()  # written last: a split without attrs is unfinished
    return meta


def write_class_embeddings(path_or_cache, dataset: str, matrix: np.ndarray, name: str = "text") -> None:
    """Store a [C, D] class-embedding matrix beside ``dataset`` (ELEVATER language-initialised head)."""
    cache = path_or_cache if isinstance(path_or_cache, FeatureCache) else open_cache(path_or_cache, "a")
    check_name("dataset", dataset)
    check_name("embedding", name)
    m = np.asarray(matrix, dtype=np.float32)
    if m.ndim != 2:
        raise SchemaMismatchError(f"class embeddings must be [n_classes, dim], got shape {m.shape}")
    g = cache.root.require_group(f"class_embeddings/{dataset}")
    a = g.create_array(name, shape=m.shape, dtype="float32", chunks=m.shape, overwrite=True)
    a[:] = m
