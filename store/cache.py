"""Reading (and low-level writing) of a featcache root. See :mod:`featcache.store.schema`
for the layout."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from featcache.errors import (
    CacheNotWritableError,
    ConfigError,
    CorruptStoreError,
    IncompleteStoreError,
    NoSpaceError,
    NotInStoreError,
    SchemaMismatchError,
)
from featcache.store import manifest
from featcache.store.arrays import checksummed, create_row_array  # re-exported: their old home
from featcache.store.integrity import AUX_ARRAYS, GroupScan, as_str, present_rows, read_done, scan_group
from featcache.store.locks import StoreLock
from featcache.store.schema import (
    GROUP_KEY,
    PROVENANCE_KEY,
    ROOT_KEY,
    SCHEMA_VERSION,
    SPLIT_KEY,
    TEXT_PROVENANCE_KEY,
    FeatureGroupMeta,
    FeatureProvenance,
    RootMeta,
    SplitMeta,
    check_name,
)
from featcache.store.space import NO_SPACE_THEN, no_space

if TYPE_CHECKING:
    import polars as pl
    from zarr.storage import StoreLike

log = logging.getLogger(__name__)
#: attempts of a whole-group read before a load says the group keeps changing under it
SNAPSHOT_TRIES = 8

__all__ = ["AUX_ARRAYS", "FeatureCache", "Features", "open_cache"]


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


def combine_fingerprints(*fps: str) -> str:
    """One 16-hex-digit fingerprint of several (train, val, eval split...), in order."""
    return hashlib.sha256("|".join(fps).encode()).hexdigest()[:16]


_as_str = as_str


@dataclass
class Features:
    """Features of one backbone x dataset x split x kind: ``X`` in memory, or a
    :class:`~featcache.store.rows.StoredRows` view read on demand (``load(..., lazy=True)``)."""

    backbone: str
    dataset: str
    split: str
    kind: str
    X: Any  # np.ndarray, or StoredRows when loaded lazily
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
            self.fingerprint = features_fingerprint(self.provenance, self.dataset_fingerprint, self.complete)

    def __len__(self) -> int:
        return int(self.X.shape[0])

    def __repr__(self) -> str:
        return (
            f"Features({self.backbone!r}, {self.dataset!r}, {self.split!r}, kind={self.kind!r}, "
            f"X={self.X.shape}, valid={int(self.valid.sum())}/{len(self.valid)})"
        )


def features_fingerprint(provenance: dict[str, Any], dataset_fingerprint: str, complete: bool = True) -> str:
    """:attr:`Features.fingerprint` from the provenance record (``to_attrs()``) and the split's
    fingerprint alone, without reading the features (``complete``: every row chunk done, as
    :meth:`FeatureCache.load` requires unless ``allow_partial``)."""
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


class FeatureCache:
    """A featcache root: many backbones x datasets x splits.

    >>> cache = open_cache("featcache-demo.zarr")  # doctest: +SKIP
    >>> f = cache.load("tf_efficientnet_lite0", "digits", "train")  # doctest: +SKIP
    >>> f.X.shape  # doctest: +SKIP
    (1347, 1280)
    """

    def __init__(self, root: Any, path: str, mode: str):  # a zarr Group (its lookups return unions)
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
            except Exception as exc:
                raise self._damaged(exc) from None
        return g

    def _existing(self, *parts: str) -> Any:
        """The group at ``parts``, which a check before this found (NotInStoreError if it is gone)."""
        g = self._group(*parts)
        if g is None:
            raise NotInStoreError(f"{'/'.join(parts)} is not in the store at {self.path} (removed while reading?)")
        return g

    def _children(self, g) -> list[str]:
        if g is None:
            return []
        try:
            return sorted(k for k, _ in g.groups())
        except Exception as exc:
            raise self._damaged(exc) from None

    def _damaged(self, exc: Exception) -> Exception:
        """A damaged metadata document met while reading: one error naming it (local stores)."""
        from featcache.store.metadata import is_metadata_error, named_metadata_error

        named = named_metadata_error(self.path, exc) if is_metadata_error(exc) else None
        return named if named is not None else exc

    def backbones(self) -> list[str]:
        return self._children(self._group("features"))

    def datasets(self) -> list[str]:
        return self._children(self._group("datasets"))

    def splits(self, dataset: str) -> list[str]:
        return self._children(self._group("datasets", dataset))

    def kinds(self, backbone: str, dataset: str, split: str) -> list[str]:
        g = self._group("features", backbone, dataset, split)
        if g is None or GROUP_KEY not in g.attrs:
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

    def split_rows(self, dataset: str, split: str, *, check: bool = False) -> tuple[np.ndarray, np.ndarray, SplitMeta]:
        """ids, labels and metadata of a split; ``check`` recomputes the fingerprint."""
        meta = self.split_meta(dataset, split)
        g = self._existing("datasets", dataset, split)
        where = f"datasets/{dataset}/{split}"
        try:
            ids = _as_str(g["ids"][:])
            labels = np.asarray(g["labels"][:], dtype=np.int64)
        except KeyError as exc:
            raise CorruptStoreError(
                f"{where}: array {exc} is missing; re-run the same `featcache extract` to rewrite it"
            ) from None
        except Exception as exc:
            raise CorruptStoreError(
                f"{where}: ids/labels unreadable ({type(exc).__name__}: {exc}); re-run the same "
                "`featcache extract` to rewrite them"
            ) from None
        if len(ids) != meta.n or len(labels) != meta.n:
            raise CorruptStoreError(f"{where}: {len(ids)} ids, {len(labels)} labels, metadata says {meta.n}")
        if check and dataset_fingerprint(ids, labels, meta.class_names) != meta.fingerprint:
            raise CorruptStoreError(
                f"{where}: ids/labels do not match the split's fingerprint (changed after they were "
                "written); re-run the same `featcache extract` to rewrite them from the data"
            )
        return ids, labels, meta

    # ------------------------------------------------------------------ features
    def _feature_group(self, backbone: str, dataset: str, split: str):
        g = self._group("features", backbone, dataset, split)
        if g is None:
            raise NotInStoreError(
                f"no features for backbone {backbone!r}, dataset {dataset!r}, split {split!r} in "
                f"{self.path}; {self._holdings()}. Run `featcache extract` to add them."
            )
        if GROUP_KEY not in g.attrs:  # written last by the writer's create
            raise IncompleteStoreError(
                f"{backbone}/{dataset}/{split} in {self.path} is being created by an extract (or one "
                "was killed while creating it); wait for it to finish, or re-run the same `featcache extract`"
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

    def group_meta(self, backbone: str, dataset: str, split: str) -> FeatureGroupMeta:
        g = self._feature_group(backbone, dataset, split)
        return FeatureGroupMeta.from_attrs(dict(g.attrs[GROUP_KEY]), where=g.path)

    def scan(self, backbone: str, dataset: str, split: str, kinds: Sequence[str] | None = None) -> GroupScan:
        """Read and check every marked chunk of a feature group (see :mod:`.integrity`)."""
        g = self._feature_group(backbone, dataset, split)
        gm = self.group_meta(backbone, dataset, split)
        return scan_group(g, gm.n, gm.chunk_rows, gm.n_chunks, gm.kinds if kinds is None else kinds)

    def chunk_status(self, backbone: str, dataset: str, split: str) -> dict[str, Any]:
        """Which row chunks are marked done, and which marked chunks are damaged (missing,
        failing their checksum or contradicting the arrays beside them)."""
        sc = self.scan(backbone, dataset, split)
        return {
            "n_chunks": sc.n_chunks,
            "done": sc.done,
            "missing_files": sc.damaged,
            "damaged": sc.damaged,
            "reasons": sc.reasons,
            "missing_arrays": sc.missing_arrays,
            "complete": sc.complete,
        }

    def load(
        self,
        backbone: str,
        dataset: str,
        split: str,
        kind: str = "pooled",
        *,
        allow_partial: bool = False,
        check: bool = True,
        dtype: DTypeLike = np.float32,
        lazy: bool = False,
    ) -> Features:
        """Load features as float32 (``dtype=None``: the stored dtype, e.g. float16 for
        out-of-core probes) with labels, ids, valid mask and provenance.

        ``lazy``: ``X`` is a :class:`~featcache.store.rows.StoredRows` view in the stored
        dtype, read on demand (for splits larger than memory); the chunks are scanned
        once, one at a time, for the same damage checks. Rows that ``allow_partial`` marks
        invalid keep whatever they store (drop them with ``valid``).

        Every chunk is checksummed; ``check`` (default) also recomputes the split's
        fingerprint from its ids/labels and checks the row invariants. Raises
        IncompleteStoreError (CorruptStoreError for damage) unless ``allow_partial``
        (then unfinished or damaged rows have ``valid=False`` and NaN features). A group that
        an ``--overwrite`` rewrites during the load is IncompleteStoreError (or the complete
        old or new features), never a missing array or kind.
        """
        args = (backbone, dataset, split, kind, allow_partial, check, dtype, lazy)
        before = self._group_state(backbone, dataset, split)
        try:
            return self._load(*args)
        except (KeyError, NotInStoreError, SchemaMismatchError, CorruptStoreError) as exc:
            if before is None and self._group_state(backbone, dataset, split) is None:
                raise  # not in the store (an --overwrite never removes the group)
            if before is not None and GROUP_KEY in before and self._group_state(backbone, dataset, split) == before:
                try:  # the same state as before: a real problem, unless a rewrite ended meanwhile
                    return self._load(*args)
                except (KeyError, NotInStoreError, SchemaMismatchError, CorruptStoreError):
                    if self._group_state(backbone, dataset, split) == before:
                        raise exc from None
            raise IncompleteStoreError(
                f"{backbone}/{dataset}/{split} in {self.path} changed while it was read (an extract "
                "--overwrite is rewriting it); load it again when that extract has finished"
            ) from None

    def _group_state(self, backbone: str, dataset: str, split: str) -> Any:
        """The group's attributes as now stored (None when absent), to tell a rewrite from damage."""
        try:
            g = self._group("features", backbone, dataset, split)
            return None if g is None else dict(g.attrs)
        except Exception:  # damaged: the load names it
            return None

    def _load(
        self,
        backbone: str,
        dataset: str,
        split: str,
        kind: str,
        allow_partial: bool,
        check: bool,
        dtype: DTypeLike,
        lazy: bool,
    ) -> Features:
        """:meth:`load` once."""
        g = self._feature_group(backbone, dataset, split)
        gm = self.group_meta(backbone, dataset, split)
        prov = self.provenance(backbone, dataset, split, kind)
        ids, labels, smeta = self.split_rows(dataset, split, check=check)
        if prov.dataset_fingerprint != smeta.fingerprint:
            raise SchemaMismatchError(
                f"features {backbone}/{dataset}/{split} were computed on a different version of "
                f"the split (fingerprint {prov.dataset_fingerprint[:12]} vs {smeta.fingerprint[:12]}); "
                "re-extract with --overwrite"
            )
        if g[kind].shape != (smeta.n, prov.dim) or gm.n != smeta.n:
            raise CorruptStoreError(
                f"{backbone}/{dataset}/{split}/{kind}: shape {g[kind].shape} != ({smeta.n}, {prov.dim}); "
                "re-extract with --overwrite"
            )
        self._check_place(g, gm, kind)
        if lazy:
            X, valid, errors, sc = self._scan_group_lazy(g, gm, kind, check)
        else:
            X, valid, errors, sc = self._read_group(g, gm, kind, check, dtype)
        if not sc.complete:
            msg = _damage_message(f"{backbone}/{dataset}/{split}", sc)
            if not allow_partial:
                raise (CorruptStoreError if sc.damaged or sc.missing_arrays else IncompleteStoreError)(msg)
            log.warning(msg)
            bad = ~sc.done
            bad[sc.bad_chunks] = True
            row_bad = np.repeat(bad, gm.chunk_rows)[: gm.n]
            valid = valid & ~row_bad
            if isinstance(X, np.ndarray):  # eager (a lazy StoredRows view is masked through ``valid``)
                X[row_bad] = np.nan
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
            complete=sc.complete,
        )

    def _check_place(self, g, gm: FeatureGroupMeta, kind: str) -> None:
        """Refuse a group whose documents or chunks were moved there from another path or
        backbone (:func:`~featcache.store.summary.check_place`)."""
        from featcache.store.summary import check_place

        found, _ = check_place(g, g.path, gm, (kind, "valid", "error"))
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise CorruptStoreError(f"{found[0][1]}{more}; `featcache verify {self.path}` lists what is wrong")

    def _scan_group_lazy(self, g, gm: FeatureGroupMeta, kind: str, check: bool):
        """(StoredRows view, valid, errors, scan): with ``check``, every marked chunk is
        read once, one at a time, and checked as :func:`scan_group` does."""
        from featcache.store.rows import StoredRows

        if check:
            sc = scan_group(g, gm.n, gm.chunk_rows, gm.n_chunks, (kind,), finite=True)
        else:
            sc = GroupScan(gm.n_chunks, read_done(g, gm.n_chunks))
        valid = np.asarray(g["valid"][:], dtype=bool)
        errors = _as_str(g["error"][:])
        return StoredRows([g[kind]], finite=[sc.finite.get(kind)]), valid, errors, sc

    def _read_group(self, g, gm: FeatureGroupMeta, kind: str, check: bool, dtype: DTypeLike = np.float32):
        """A consistent snapshot of a feature group: the chunks marked done before the arrays
        are read are the chunks the scan calls done (a writer marks a chunk only after its
        arrays, so their rows read afterwards are final). The read is retried when a chunk
        marked done is no longer marked after it (rewritten: ``--overwrite``) or breaks an
        invariant that a re-read no longer shows. On a decode failure or an invariant broken
        for good, a chunk-by-chunk scan names the damage (readable chunks are returned)."""
        for attempt in range(SNAPSHOT_TRIES):
            got = self._read_once(g, gm, kind, check, dtype)
            if got is not None:
                return got
            time.sleep(0.01 * 2**attempt)  # let the writer finish its chunk
        raise IncompleteStoreError(
            f"{g.path} changed during {SNAPSHOT_TRIES} reads in a row (an extract is writing it); "
            "load it again when that extract has finished"
        )

    def _read_once(self, g, gm: FeatureGroupMeta, kind: str, check: bool, dtype):
        """One snapshot attempt of :meth:`_read_group`; None when the group changed under it."""
        done = read_done(g, gm.n_chunks)
        try:
            X = np.asarray(g[kind][:], dtype=dtype or g[kind].dtype)
            valid = np.asarray(g["valid"][:], dtype=bool)
            errors = _as_str(g["error"][:])
            if "done" not in g:
                raise IncompleteStoreError("the group has no done array")  # read chunk by chunk below
        except Exception:
            sc = scan_group(g, gm.n, gm.chunk_rows, gm.n_chunks, (kind,))
            got = _read_chunks(g, gm, kind, sc, dtype)
            return (*got, sc) if read_done(g, gm.n_chunks)[sc.done].all() else None
        if not read_done(g, gm.n_chunks)[done].all():
            return None  # a chunk marked done was reset meanwhile (the group is being rewritten)
        sc = GroupScan(gm.n_chunks, done)
        if check:
            rows = (present_rows(X) != valid) | ((errors != "") == valid)
            chunks = [i for i in np.unique(np.flatnonzero(rows) // gm.chunk_rows).tolist() if done[i]]
            if chunks:
                sc = scan_group(g, gm.n, gm.chunk_rows, gm.n_chunks, (kind,), chunks=chunks)
                if not sc.done[done].all() or not set(chunks) <= set(sc.bad_chunks):
                    return None  # what was read is not what is stored now: read again
                sc.done = done  # chunks marked since the first read were not read whole
        return X, valid, errors, sc

    # ------------------------------------------------------------------ catalog
    def _completeness(self, b: str, d: str, s: str, g) -> tuple[bool, int]:
        """(complete, invalid rows) of a feature group: from its summary while that matches the
        chunk markers and checksums (:mod:`.summary`), else by reading every marked chunk (a
        lost or corrupt chunk makes the group incomplete)."""
        from featcache.store.summary import trusted_summary

        gm = self.group_meta(b, d, s)
        summ = trusted_summary(g, gm.n, gm.n_chunks, gm.kinds)
        if summ is not None:
            return True, summ["rows"] - summ["valid"]
        complete = self.scan(b, d, s).complete
        return complete, int((~np.asarray(g["valid"][:], dtype=bool)).sum())

    def catalog(self) -> pl.DataFrame:
        """One row per backbone x dataset x split x kind, as a polars DataFrame."""
        import polars as pl

        rows = []
        entries = self.entries()
        _warn_unlisted(self.root.store, entries)
        for b, d, s in entries:
            g = self._existing("features", b, d, s)
            try:  # the writer's summary while it matches the stored chunks, else read every marked chunk
                self.split_meta(d, s)  # features without their split are not usable
                complete, n_invalid = self._completeness(b, d, s, g)
            except SchemaMismatchError as exc:
                log.warning("skipping %s/%s/%s: %s", b, d, s, exc)
                continue
            except Exception as exc:
                log.warning("%s/%s/%s is damaged (%s); run `featcache verify`", b, d, s, type(exc).__name__)
                complete, n_invalid = False, None
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
                        "complete": complete,
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
    def load_class_embeddings(self, dataset: str, name: str = "text", backbone: str | None = None) -> np.ndarray:
        """A [C, D] class-embedding matrix: ``backbone``'s own (its text tower's) when stored,
        else the dataset-level one (backbone-agnostic, older stores)."""
        for parts in ((("class_embeddings", dataset, backbone),) if backbone else ()) + (
            ("class_embeddings", dataset),
        ):
            g = self._group(*parts)
            if g is not None and name in {k for k, _ in g.arrays()}:
                return np.asarray(g[name][:], dtype=np.float32)
        g = self._group("class_embeddings", dataset)
        have = [k for k, _ in g.arrays()] if g is not None else []
        per_bb = [k for k, _ in g.groups()] if g is not None else []
        raise NotInStoreError(
            f"no class embeddings {name!r} for dataset {dataset!r}"
            + (f" and backbone {backbone!r}" if backbone else "")
            + f" (present: {have}; backbones with their own: {per_bb}); store them with "
            "featcache.store.write_class_embeddings(path, dataset, matrix, name, backbone=...)"
        )

    def class_embeddings_provenance(self, dataset: str, name: str = "text", backbone: str | None = None) -> dict:
        """What made the matrix :meth:`load_class_embeddings` returns (tower, weights hash,
        templates and their hash, as ``featcache embed-classes`` records it); ``{}`` when nothing
        was recorded (a matrix written with :func:`write_class_embeddings`)."""
        for parts in ((("class_embeddings", dataset, backbone),) if backbone else ()) + (
            ("class_embeddings", dataset),
        ):
            g = self._group(*parts)
            if g is not None and name in {k for k, _ in g.arrays()}:
                return dict(g[name].attrs.get(TEXT_PROVENANCE_KEY, {}))
        return {}

    def load_caption_embeddings(self, dataset: str, split: str, backbone: str) -> tuple[np.ndarray, np.ndarray, dict]:
        """``(embeddings [T, D] float32, image ids [T], provenance)`` of the captions of
        ``dataset``/``split`` embedded by ``backbone``'s text tower (:func:`write_caption_embeddings`)."""
        g = self._group("caption_embeddings", dataset, split, backbone)
        if g is None or "embeddings" not in {k for k, _ in g.arrays()}:
            raise NotInStoreError(
                f"no caption embeddings of {dataset}/{split} for backbone {backbone!r} in {self.path}; "
                "make them with `featcache embed-captions --captions SPEC ...`"
            )
        emb = np.asarray(g["embeddings"][:], dtype=np.float32)
        return emb, _as_str(g["image_ids"][:]), dict(g["embeddings"].attrs.get(TEXT_PROVENANCE_KEY, {}))

    def __repr__(self) -> str:
        return f"FeatureCache({self.path!r}, {len(self.entries())} feature groups)"


def _warn_unlisted(store, entries: list[tuple[str, str, str]]) -> None:
    """Feature groups the store's digests record whose metadata document is gone (zarr no
    longer lists them): one warning each, so a listing never looks whole without them."""
    have = {f"features/{b}/{d}/{s}" for b, d, s in entries}
    try:
        units = manifest.units(store)
    except Exception:  # a store that cannot list keys: nothing to compare
        return
    for unit in units:
        if unit.startswith("features/") and unit not in have:
            log.warning(
                "%s: its metadata document is missing (the store's digests record it); run `featcache verify`", unit
            )


def _damage_message(where: str, sc: GroupScan) -> str:
    parts = []
    todo = int((~sc.done).sum())
    if todo:
        parts.append(f"{todo} of {sc.n_chunks} row chunks unfinished")
    for name, chunks in sorted(sc.damaged.items()):
        reasons = sc.reasons.get(name, {})
        lost = [i for i in chunks if reasons.get(i, "").startswith("missing")]
        broken = [i for i in chunks if i not in lost]
        if lost:
            parts.append(f"chunk files missing for {name}: {lost[:10]}")
        if broken:
            parts.append(f"{name} chunk(s) {broken[:10]} corrupt ({reasons[broken[0]]})")
    if sc.missing_arrays:
        parts.append(f"arrays missing: {sc.missing_arrays}")
    return (
        f"{where} is incomplete: " + "; ".join(parts) + "; re-run the same `featcache extract` command "
        "to recompute exactly these chunks (or `featcache verify --repair`), or pass allow_partial=True"
    )


def _read_chunks(g, gm: FeatureGroupMeta, kind: str, sc: GroupScan, dtype: DTypeLike = np.float32):
    """Read what is readable, chunk by chunk (damaged chunks become NaN / invalid / "")."""
    X = np.full((gm.n, g[kind].shape[1]), np.nan, dtype or g[kind].dtype)
    valid = np.zeros(gm.n, bool)
    errors = np.full(gm.n, "", dtype=object)
    bad = set(sc.bad_chunks) | set(np.flatnonzero(~sc.done).tolist())
    if sc.missing_arrays:
        bad = set(range(gm.n_chunks))
    for i in range(gm.n_chunks):
        if i in bad:
            continue
        s, e = i * gm.chunk_rows, min((i + 1) * gm.chunk_rows, gm.n)
        X[s:e] = g[kind][s:e]
        valid[s:e] = g["valid"][s:e]
        errors[s:e] = _as_str(g["error"][s:e])
    return X, valid, errors.astype(str)


def _open_or_create(store, kwargs: dict):
    """``zarr.open_group(mode="a")``, which checks for a group and then creates one: a job
    that creates the same new store between the two makes it raise ContainsGroupError. The
    group exists then, and a second open finds it."""
    import zarr
    from zarr import errors as zarr_errors

    try:
        return zarr.open_group(store, mode="a", zarr_format=3, **kwargs)
    except zarr_errors.ContainsGroupError:
        return zarr.open_group(store, mode="a", zarr_format=3, **kwargs)


def open_cache(
    store: str | os.PathLike | StoreLike, mode: str = "r", storage_options: dict | None = None
) -> FeatureCache:
    """Open a featcache root.

    ``store`` is anything zarr accepts as a store: a local path, an fsspec URL
    (``s3://...``, with ``storage_options``) or a :class:`zarr.abc.store.Store` instance
    (``LocalStore``, ``MemoryStore``, ``FsspecStore``, ``ObjectStore``...).
    ``mode="r"`` opens an existing store read-only; ``"a"`` creates it if needed.
    """
    import zarr
    from zarr import errors as zarr_errors

    if mode not in ("r", "a"):
        raise ConfigError(f"open_cache(mode={mode!r}): mode must be 'r' (read) or 'a' (read and write)")
    label = str(store) if not isinstance(store, str) else store
    if hasattr(store, "__fspath__"):
        store = str(store)
    kwargs: dict[str, Any] = {"storage_options": storage_options} if storage_options else {}
    if mode == "r":
        try:
            root = zarr.open_group(store, mode="r", **kwargs)
        except (FileNotFoundError, NotADirectoryError, zarr_errors.GroupNotFoundError) as exc:
            raise NotInStoreError(
                f"no feature cache at {label} ({type(exc).__name__}); create one with `featcache extract`"
            ) from None
        return FeatureCache(root, label, "r")
    try:
        root = _open_or_create(store, kwargs)
    except NotADirectoryError as exc:
        raise CacheNotWritableError(
            f"cache path {label} cannot be created: a parent of it is a file, not a directory ({exc}); "
            "choose another --cache"
        ) from None
    except OSError as exc:
        if NoSpaceError.caused_by(exc):
            raise NoSpaceError.about(label, "the store's root metadata", 4096, NO_SPACE_THEN) from None
        raise CacheNotWritableError(
            f"cache path {label} is not writable ({exc}); choose a writable --cache or fix the permissions"
        ) from None
    if ROOT_KEY not in root.attrs or _root_unrecorded(root):
        with no_space(label, "the store's root metadata", 4096):
            root = _create_root(root, label)
    return FeatureCache(root, label, "a")


def _root_unrecorded(root, unit: str = "") -> bool:
    """A part of a store written with digests whose digest file is missing because its writer
    was stopped between the two writes (e.g. by a full disk): the next writer records it."""
    return manifest.DIGESTS_KEY in root.attrs and manifest.read_raw(root.store, manifest.manifest_key(unit)) is None


def _create_root(root, label: str):
    """Write the featcache root attributes once, under the root lock (another job may win)."""
    import zarr

    with StoreLock(root, "root", timeout=60, what=f"creating {label}"):
        root = zarr.open_group(root.store, mode="a", zarr_format=3)  # re-read: another job may have won
        if ROOT_KEY not in root.attrs:
            with warnings.catch_warnings():  # the lock folder is not a zarr node
                warnings.simplefilter("ignore")
                foreign = [k for k in root if k != "locks"]
            if foreign:
                raise SchemaMismatchError(
                    f"{label} is a non-empty zarr group that is not a featcache store; choose a new --cache path"
                )
            from featcache import __version__

            meta = RootMeta(SCHEMA_VERSION, __version__, now_iso()).to_attrs()
            root.update_attributes({ROOT_KEY: meta, manifest.DIGESTS_KEY: manifest.FORMAT})
            manifest.record(root, "")
        elif _root_unrecorded(root):
            manifest.record(root, "")
    return root


def remove_group(cache: FeatureCache, *parts: str) -> None:
    """Delete a sub-group through the Store API (used by --overwrite, under the group's lock)."""
    parent = cache._group(*parts[:-1])
    if parent is not None and parts[-1] in parent:
        del parent[parts[-1]]


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
    if meta is not None and not _root_unrecorded(cache.root, unit):
        return meta
    with StoreLock(cache.root, unit, timeout=600, what=unit):
        meta = _existing_split(cache, dataset, split, fp, len(ids))  # another job may have written it
        if meta is not None:
            if _root_unrecorded(cache.root, unit):  # its writer stopped before recording its digests
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


def write_class_embeddings(
    path_or_cache: str | os.PathLike | FeatureCache,
    dataset: str,
    matrix: np.ndarray,
    name: str = "text",
    backbone: str | None = None,
) -> None:
    """Store a [C, D] class-embedding matrix beside ``dataset`` (ELEVATER language-initialised
    head, zero-shot). With ``backbone`` (its text tower's embeddings) it is stored for that
    backbone x dataset, under ``class_embeddings/<dataset>/<backbone>/<name>``, and refused
    when D differs from the width of the backbone's stored features of ``dataset``."""
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
