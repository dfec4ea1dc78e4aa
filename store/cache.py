"""Reading a featcache root: :class:`FeatureCache` (listing, splits, features, catalog,
class and caption embeddings) and :func:`open_cache`. Writing lives in
:mod:`featcache.store.writing` (splits, embeddings) and :mod:`featcache.store.writer`
(feature chunks); see :mod:`featcache.store.schema` for the layout."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import DTypeLike

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
from featcache.store.blocks import DEFAULT_BLOCK_MEMORY
from featcache.store.fingerprints import dataset_fingerprint, features_fingerprint
from featcache.store.hub import hub_store, is_hub_url
from featcache.store.integrity import GroupScan, as_str, fill_problems, read_done, refuse_bad_shape, scan_group
from featcache.store.metadata import named_damage, translating
from featcache.store.root import create_root, open_or_create, root_unrecorded
from featcache.store.schema import (
    GROUP_KEY,
    PROVENANCE_KEY,
    ROOT_KEY,
    SPLIT_KEY,
    TEXT_PROVENANCE_KEY,
    FeatureGroupMeta,
    FeatureProvenance,
    RootMeta,
    SplitMeta,
)
from featcache.store.snapshot import damage_message, read_group, scan_group_lazy
from featcache.store.space import NO_SPACE_THEN, no_space

if TYPE_CHECKING:
    import polars as pl
    from zarr.storage import StoreLike

log = logging.getLogger(__name__)

__all__ = ["FeatureCache", "Features", "open_cache"]

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
        return sorted(k for k, _ in g.groups())

    @translating
    def backbones(self) -> list[str]:
        return self._children(self._group("features"))

    @translating
    def datasets(self) -> list[str]:
        return self._children(self._group("datasets"))

    @translating
    def splits(self, dataset: str) -> list[str]:
        return self._children(self._group("datasets", dataset))

    @translating
    def kinds(self, backbone: str, dataset: str, split: str) -> list[str]:
        g = self._group("features", backbone, dataset, split)
        if g is None or GROUP_KEY not in g.attrs:
            return []
        return list(FeatureGroupMeta.from_attrs(dict(g.attrs[GROUP_KEY]), where=g.path).kinds)

    @translating
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
    @translating
    def split_meta(self, dataset: str, split: str) -> SplitMeta:
        g = self._group("datasets", dataset, split)
        if g is None:
            raise NotInStoreError(
                f"dataset {dataset!r} split {split!r} is not in {self.path}; "
                f"datasets/splits present: { {d: self.splits(d) for d in self.datasets()} }"
            )
        return SplitMeta.from_attrs(dict(g.attrs.get(SPLIT_KEY, {})), where=g.path)

    @translating
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

    @translating
    def provenance(self, backbone: str, dataset: str, split: str, kind: str = "pooled") -> FeatureProvenance:
        g = self._feature_group(backbone, dataset, split)
        if kind not in g:
            present = self.kinds(backbone, dataset, split)
            raise NotInStoreError(
                f"feature kind {kind!r} not stored for {backbone}/{dataset}/{split}; kinds present: {present}; "
                f"add it with `featcache extract` on the same model and data with --features "
                f"{','.join([*present, kind])} (every kind from one forward) and --overwrite, or into "
                "another --backbone-name"
            )
        return FeatureProvenance.from_attrs(dict(g[kind].attrs.get(PROVENANCE_KEY, {})), where=g[kind].path)

    @translating
    def group_meta(self, backbone: str, dataset: str, split: str) -> FeatureGroupMeta:
        g = self._feature_group(backbone, dataset, split)
        return FeatureGroupMeta.from_attrs(dict(g.attrs[GROUP_KEY]), where=g.path)

    @translating
    def stored_fingerprint(self, backbone: str, dataset: str, split: str, kind: str = "pooled") -> str:
        """``load(...).fingerprint`` of complete features from their provenance record and their
        split's fingerprint alone, without reading a feature (what stages key their results by)."""
        prov = self.provenance(backbone, dataset, split, kind).to_attrs()
        return features_fingerprint(prov, self.split_meta(dataset, split).fingerprint)

    @translating
    def scan(self, backbone: str, dataset: str, split: str, kinds: Sequence[str] | None = None) -> GroupScan:
        """Read and check every marked chunk of a feature group (see :mod:`.integrity`)."""
        g = self._feature_group(backbone, dataset, split)
        gm = self.group_meta(backbone, dataset, split)
        return scan_group(g, gm.n, gm.chunk_rows, gm.n_chunks, gm.kinds if kinds is None else kinds)

    @translating
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

    @translating
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
        refuse_bad_shape(g, gm, {kind: prov}, smeta.n, self.path)
        self._check_kind(g, gm, prov, smeta, f"{backbone}/{dataset}/{split}", kind)
        finishing = self._check_place(g, gm, kind, prov)
        if lazy:
            X, valid, errors, sc = scan_group_lazy(g, gm, kind, check)
        else:
            X, valid, errors, sc = read_group(g, gm, kind, check, dtype)
        if finishing and sc.complete:  # every chunk marked, completion not recorded yet
            msg = (
                f"{backbone}/{dataset}/{split}: every row chunk is marked done but its writer has not recorded "
                "completion yet (an extract still finishing it, or one stopped just before): wait for it, or "
                "re-run that extract"
            )
            if not allow_partial:
                raise IncompleteStoreError(msg)
            log.warning(msg)
        if not sc.complete:
            msg = damage_message(f"{backbone}/{dataset}/{split}", sc)
            if not allow_partial:
                raise (CorruptStoreError if sc.damaged or sc.missing_arrays else IncompleteStoreError)(msg)
            log.warning(msg)
            bad = ~sc.done
            bad[sc.bad_chunks] = True
            row_bad = np.repeat(bad, gm.chunk_rows)[: gm.n]
            valid = valid & ~row_bad
            if isinstance(X, np.ndarray):  # eager (a lazy StoredRows view is masked through ``valid``)
                X[row_bad] = np.nan if X.dtype.kind == "f" else 0
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
            complete=sc.complete and not finishing,
        )

    @staticmethod
    def _check_kind(g, gm: FeatureGroupMeta, prov: FeatureProvenance, smeta: SplitMeta, where: str, kind: str) -> None:
        """Refuse a kind computed on other rows of the split, or whose array's shape is not
        ``(rows, *inner, dim)`` of its provenance."""
        if prov.dataset_fingerprint != smeta.fingerprint:
            raise SchemaMismatchError(
                f"features {where} were computed on a different version of "
                f"the split (fingerprint {prov.dataset_fingerprint[:12]} vs {smeta.fingerprint[:12]}); "
                "re-extract with --overwrite"
            )
        if g[kind].shape != (smeta.n, *prov.row_shape) or gm.n != smeta.n:
            raise CorruptStoreError(
                f"{where}/{kind}: shape {g[kind].shape} != {(smeta.n, *prov.row_shape)}; re-extract with --overwrite"
            )

    @translating
    def iter_blocks(
        self,
        backbone: str,
        dataset: str,
        split: str,
        kind: str = "pooled",
        *,
        max_memory: int = DEFAULT_BLOCK_MEMORY,
        rows: slice | tuple[int, int] | None = None,
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Stream a complete kind as ``(first row, float32 block)`` pairs, each block whole
        stored chunks (``[b, *inner, dim]``, cut only at the ends of ``rows``), in order, for
        readers of arrays larger than memory (``tokens``). Memory stays within ``max_memory``
        bytes (the block handed out, the one being read and one decoded chunk); a budget that
        cannot hold one chunk's block is refused in one line. Every chunk is checked as
        :meth:`load` checks it (checksum, row invariants, place); invalid rows are NaN (labels,
        ids and ``valid``: ``load(..., lazy=True)`` or :meth:`split_rows`). The same refusals
        as ``load`` for a group that is incomplete, damaged or being rewritten.

        >>> for start, X in cache.iter_blocks("vit", "digits", "train", "tokens", max_memory=1 << 28):  # doctest: +SKIP
        ...     head.partial_fit(X, y[start : start + len(X)])
        """
        from featcache.store.blocks import iter_planned, plan_blocks

        where = f"{backbone}/{dataset}/{split}"
        g = self._feature_group(backbone, dataset, split)
        gm = self.group_meta(backbone, dataset, split)
        prov = self.provenance(backbone, dataset, split, kind)
        self._check_kind(g, gm, prov, self.split_rows(dataset, split, check=True)[2], where, kind)
        plan = plan_blocks(g, gm, kind, where, max_memory, rows)
        finishing = self._check_place(g, gm, kind, prov)
        done = read_done(g, gm.n_chunks)
        if finishing or not done.all():
            raise IncompleteStoreError(
                f"{where}: {int((~done).sum())} of {gm.n_chunks} row chunks unfinished"
                + (" (its writer is recording completion)" if finishing else "")
                + "; streaming needs complete features: wait for the extract, or re-run the same `featcache extract`"
            )
        return iter_planned(plan)

    def _check_place(self, g, gm: FeatureGroupMeta, kind: str, prov: FeatureProvenance) -> bool:
        """Refuse a group whose documents or chunks were moved there from another path or
        backbone, a complete one without the summary that binds its chunks to it
        (:func:`~featcache.store.summary.check_place`), and an array whose fill value would
        read a lost chunk as data (:func:`~featcache.store.integrity.fill_problems`). True where
        every chunk is marked but the writer has recorded neither its summary nor its completion
        (it records the summary first): a writer finishing the group, not damage."""
        from featcache.store.summary import SUMMARY_KEY, check_place

        for name, why in fill_problems(g, (kind,)).items():
            raise CorruptStoreError(
                f"{g.path}/{name}: {why}; run `featcache verify --repair {self.path}` (it marks every chunk "
                "for recomputation), then re-run the extract that wrote it (it recreates the array)"
            )
        complete = bool(read_done(g, gm.n_chunks).all())
        finishing = complete and prov.completed is None and SUMMARY_KEY not in g.attrs
        found, _ = check_place(
            g, g.path, gm, (kind, "valid", "error"), complete=complete and not finishing, store=self.path
        )
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise CorruptStoreError(f"{found[0][1]}{more}; `featcache verify {self.path}` lists what is wrong")
        return finishing

    # ------------------------------------------------------------------ catalog
    def _completeness(self, b: str, d: str, s: str, g) -> tuple[bool, int, int]:
        """(complete, invalid rows, rows never computed) of a feature group: from its summary
        while that matches the chunk markers and checksums (:mod:`.summary`), else by reading
        every marked chunk (a lost or corrupt chunk makes the group incomplete). Invalid rows
        are rows of computed chunks (unreadable images); rows of chunks not marked done (an
        interrupted extract) are never computed, not invalid."""
        from featcache.store.summary import SUMMARY_KEY, trusted_summary

        gm = self.group_meta(b, d, s)
        summ = trusted_summary(g, gm.n, gm.n_chunks, gm.kinds)
        if summ is not None:
            return True, summ["rows"] - summ["valid"], 0
        sc = self.scan(b, d, s)
        complete = sc.complete
        if complete and not isinstance(g.attrs.get(SUMMARY_KEY), dict):  # bound to nothing: load refuses it
            log.warning("%s/%s/%s: complete but its summary is missing; run `featcache verify %s`", b, d, s, self.path)
            complete = False
        computed = np.repeat(sc.done, gm.chunk_rows)[: gm.n]
        invalid = ~np.asarray(g["valid"][:], dtype=bool) & computed
        return complete, int(invalid.sum()), int((~computed).sum())

    @translating
    def catalog(self) -> pl.DataFrame:
        """One row per backbone x dataset x split x kind, as a polars DataFrame (``shape``: the
        array's shape as ``rows x *inner x dim``)."""
        import polars as pl

        rows = []
        entries = self.entries()
        _warn_unlisted(self.root.store, entries)
        for b, d, s in entries:
            g = self._existing("features", b, d, s)
            try:  # the writer's summary while it matches the stored chunks, else read every marked chunk
                self.split_meta(d, s)  # features without their split are not usable
                complete, n_invalid, n_pending = self._completeness(b, d, s, g)
            except SchemaMismatchError as exc:
                log.warning("skipping %s/%s/%s: %s", b, d, s, exc)
                continue
            except Exception as exc:
                log.warning("%s/%s/%s is damaged (%s); run `featcache verify`", b, d, s, type(exc).__name__)
                complete, n_invalid, n_pending = False, None, None
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
                        "n_not_computed": n_pending,
                        "shape": "x".join(map(str, (prov.n, *prov.row_shape))),
                        "bytes": int(g[kind].nbytes_stored()),
                        "weights": prov.weights_source,
                        "images_per_s": prov.images_per_s,
                        "peak_memory_mb": prov.peak_memory_mb,
                        "extract_threads": _int_or_none((prov.extra or {}).get("threads")),
                        "load_avg": _float_or_none((prov.extra or {}).get("load_avg")),
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
            "n_not_computed": pl.Int64,
            "shape": pl.Utf8,  # rows x *inner x dim, e.g. 300x4x192 for blocks:4
            "bytes": pl.Int64,
            "weights": pl.Utf8,
            "images_per_s": pl.Float64,
            "peak_memory_mb": pl.Float64,
            "extract_threads": pl.Int64,  # torch CPU threads of the extraction (null on CUDA, older stores)
            "load_avg": pl.Float64,  # the 1-minute load average when the extraction started
            "created": pl.Utf8,
        }
        return pl.DataFrame(rows, schema=schema, orient="row" if rows else None)

    # ------------------------------------------------------------------ class embeddings
    @translating
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

    @translating
    def has_class_embeddings(self, dataset: str, name: str = "text", backbone: str | None = None) -> bool:
        """Whether a class-embedding matrix ``name`` is stored for ``dataset`` (``backbone``'s own
        when given, else the dataset-level one); no fallback from one to the other."""
        g = self._group("class_embeddings", dataset, *([backbone] if backbone else []))
        return g is not None and name in {k for k, _ in g.arrays()}

    @translating
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

    @translating
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


def open_cache(
    store: str | os.PathLike | StoreLike, mode: str = "r", storage_options: dict | None = None
) -> FeatureCache:
    """Open a featcache root.

    ``store`` is anything zarr accepts as a store: a local path, an fsspec URL
    (``s3://...``, with ``storage_options``) or a :class:`zarr.abc.store.Store` instance
    (``LocalStore``, ``MemoryStore``, ``FsspecStore``, ``ObjectStore``...).
    ``mode="r"`` opens an existing store read-only; ``"a"`` creates it if needed.
    """
    if mode not in ("r", "a"):
        raise ConfigError(f"open_cache(mode={mode!r}): mode must be 'r' (read) or 'a' (read and write)")
    with named_damage(os.fspath(store) if isinstance(store, (str, os.PathLike)) else None):
        return _open(store, mode, storage_options)


def _open(store: Any, mode: str, storage_options: dict | None) -> FeatureCache:
    """:func:`open_cache` once its arguments are checked."""
    import zarr
    from zarr import errors as zarr_errors

    label = str(store) if not isinstance(store, str) else store
    if hasattr(store, "__fspath__"):
        store = str(store)
    if is_hub_url(store):  # hf://datasets/ORG/NAME[@REV]: read through HfFileSystem (store/hub.py)
        store, storage_options = hub_store(store, mode), None
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
        root = open_or_create(store, kwargs)
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
    if ROOT_KEY not in root.attrs or root_unrecorded(root):
        with no_space(label, "the store's root metadata", 4096):
            root = create_root(root, label)
    return FeatureCache(root, label, "a")


def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _float_or_none(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
