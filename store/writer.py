"""Chunk-by-chunk writer of feature arrays, safe to resume and to share between ranks.

A row chunk is the unit of work: every array of a feature group is chunked by the same
``chunk_rows`` so one chunk index maps to one chunk object per array. A writer writes all
arrays of chunk ``i`` and only then sets ``done[i] = 1`` (its own chunk object), so a kill at
any moment leaves at worst an unmarked chunk that the next run recomputes. Ranks of a
distributed run own disjoint chunk sets, so no two writers ever touch the same object.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from featcache.errors import ProvenanceMismatchError, SchemaMismatchError
from featcache.store import manifest
from featcache.store.arrays import (  # re-exported: their old home
    create_aux_array,
    create_feature_array,
    kind_fill,
)
from featcache.store.cache import FeatureCache, open_cache
from featcache.store.integrity import fill_problems, read_done, refuse_bad_shape, scan_group
from featcache.store.locks import StoreLock, local_root
from featcache.store.metadata import translating
from featcache.store.root import now_iso
from featcache.store.schema import (
    GROUP_KEY,
    MAX_CHUNK_ROWS,
    MODEL_DTYPES,
    PROVENANCE_DIGEST_KEY,
    PROVENANCE_KEY,
    SCHEMA_VERSION,
    TARGET_DTYPES,
    FeatureGroupMeta,
    FeatureProvenance,
    check_name,
    kind_dtypes,
    provenance_digest,
)
from featcache.store.space import no_space
from featcache.store.summary import UNBOUND, check_place, clear_summary, write_summary
from featcache.store.writing import ensure_split

log = logging.getLogger(__name__)

#: the temporary file zarr's LocalStore writes a chunk into before renaming it (``<key>.<uuid4 hex>.partial``)
_ORPHAN_WRITE = re.compile(r"\.[0-9a-f]{32}\.partial$")

DTYPES = MODEL_DTYPES


def check_dtype(kind: str, dtype: str) -> None:
    """Refuse (one line, before anything is written) a dtype ``kind`` is not stored in."""
    allowed = kind_dtypes(kind)
    if dtype not in allowed:
        what = f"target kind {kind!r}" if kind in TARGET_DTYPES else f"feature kind {kind!r}"
        raise SchemaMismatchError(
            f"{what} cannot be stored as {dtype!r}: give dtype {' or '.join(repr(d) for d in allowed)}"
            + (
                " (a dense target keeps its own dtype, whatever the model kinds' --dtype)"
                if kind in TARGET_DTYPES
                else ""
            )
        )


def as_stored(x: np.ndarray, kind: str, dtype: str, valid: np.ndarray, chunk: int) -> np.ndarray:
    """``x`` in the kind's stored dtype, invalid rows set to its fill value (NaN, or 0 for an
    integer target). Integer targets must hold integers the dtype can represent: a class id
    that does not fit (a uint16 mask into uint8) is refused in one line, never wrapped."""
    want = np.dtype(dtype)
    if want.kind in "iu" and x.size:
        vals = x[valid]
        if vals.dtype.kind not in "iub" and not (np.isfinite(vals).all() and (vals == np.round(vals)).all()):
            raise SchemaMismatchError(f"chunk {chunk}: {kind} holds non-integer values; {dtype} stores integer ids")
        info = np.iinfo(want)
        if vals.size and (vals.min() < info.min or vals.max() > info.max):
            raise SchemaMismatchError(
                f"chunk {chunk}: {kind} holds values {vals.min()}..{vals.max()} outside {dtype}'s "
                f"{info.min}..{info.max}; store it as a wider dtype (uint16 for class ids above 255)"
            )
    out = x.astype(want, copy=True)
    out[~valid] = kind_fill(want)
    return out


class FeatureWriter:
    """Create (or resume) ``features/<backbone>/<dataset>/<split>`` and write row chunks.

    ``provenances`` maps each feature kind to its :class:`FeatureProvenance`; all share n and
    chunk_rows. A model kind is float16 or float32; a dense target kind has its own dtype
    (:data:`~featcache.store.schema.TARGET_DTYPES`: ``mask`` uint8/uint16, ``depth`` float32,
    ``depth_valid`` uint8, ``image_size``/``window`` int32), stored beside the model's kinds
    in the same row chunks, so every guarantee of the group covers it.
    """

    def __init__(
        self,
        cache: FeatureCache,
        backbone: str,
        dataset: str,
        split: str,
        provenances: dict[str, FeatureProvenance],
        *,
        lock_timeout: float = 0.0,
    ):
        if cache.mode != "a":
            raise SchemaMismatchError("open the cache with mode='a' to write features")
        for name, what in ((backbone, "backbone"), (dataset, "dataset"), (split, "split")):
            check_name(what, name)
        for k, prov in provenances.items():
            check_name("feature kind", k)
            if k in ("valid", "error", "done"):
                raise SchemaMismatchError(f"feature kind name {k!r} is reserved")
            check_dtype(k, prov.dtype)
            prov._check_values(f"feature kind {k!r}")  # what a reader checks, before anything is written
        first = next(iter(provenances.values()))
        if not 1 <= first.chunk_rows <= MAX_CHUNK_ROWS:
            raise SchemaMismatchError(
                f"chunk_rows {first.chunk_rows} is out of range: give 1..{MAX_CHUNK_ROWS} rows per chunk "
                "(one chunk of every array is held in memory)"
            )
        self.cache = cache
        self.backbone, self.dataset, self.split = backbone, dataset, split
        self.provenances = provenances
        self.n = first.n
        self.chunk_rows = first.chunk_rows
        self.n_chunks = max(1, -(-self.n // self.chunk_rows))
        self.group: Any = None  # the zarr group, from open()
        self._handles: dict = {}
        self._lock: StoreLock | None = None
        self.lock_timeout = lock_timeout

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

    @translating
    def prepare(self, *, overwrite: bool = False) -> FeatureWriter:
        """Take the group's writer lock, then create arrays, or validate and reuse existing
        ones (resume; missing ``valid``/``error``/``done`` arrays are recreated and their
        chunks recomputed). Rank 0 only; the lock is held until :meth:`mark_complete` or
        :meth:`release`. Another job writing the same group gets a clear refusal
        (:class:`~featcache.errors.StoreBusyError`) after ``lock_timeout`` seconds."""
        self._lock = StoreLock(self.cache.root, self.path, timeout=self.lock_timeout, what=self.path).acquire()
        try:
            with self.no_space("its arrays' metadata", 4096 * (3 + len(self.provenances))):
                self._prepare_locked(overwrite)
                manifest.record(self.cache.root, self.path)  # the documents as this writer leaves them
            return self
        except BaseException:
            self.release()
            raise

    def _prepare_locked(self, overwrite: bool) -> FeatureWriter:
        old = self.existing()
        if old is not None:
            listed = self._listed_kinds()
            lost = [k for k in listed if k not in old]  # feature arrays deleted from the group
            diffs: dict[str, Any] = {}
            if set(listed) != set(self.provenances):
                diffs["kinds"] = (sorted(listed), sorted(self.provenances))
            if lost:
                gm = FeatureGroupMeta.from_attrs(dict(self.cache.root[self.path].attrs[GROUP_KEY]), where=self.path)
                for name, a, b in (("n", gm.n, self.n), ("chunk_rows", gm.chunk_rows, self.chunk_rows)):
                    if a != b:
                        diffs[name] = (a, b)
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
                self._empty_group()
            else:
                self.group = self.cache.root[self.path]
                gm = FeatureGroupMeta.from_attrs(dict(self.group.attrs[GROUP_KEY]), where=self.path)
                refuse_bad_shape(self.group, gm, old, self.n, self.cache.path)  # resuming would misalign rows
                self._remove_orphan_writes()
                self._restore_aux_arrays()
                self._restore_lost_kinds(lost)
                self._recompute_unbound()
                if not read_done(self.group, self.n_chunks).all():  # chunks will be written
                    clear_summary(self.group)
                return self
        self._create()
        return self

    def _remove_orphan_writes(self) -> None:
        """Delete the temporary chunk files a killed writer left in a local store (zarr writes a
        chunk to ``<key>.<uuid>.partial`` and renames it; a kill between the two leaves the
        temporary file). Under the writer lock no other writer's temporary file can be live."""
        root = local_root(self.cache.root.store)
        if root is None:
            return
        base = os.path.join(root, *self.path.split("/"))
        gone = []
        for top, _, files in os.walk(base):
            for name in files:
                if _ORPHAN_WRITE.search(name):
                    os.unlink(os.path.join(top, name))
                    gone.append(os.path.relpath(os.path.join(top, name), base))
        if gone:
            log.info("%s: removed %d unfinished chunk write(s) of a killed run: %s", self.path, len(gone), gone[:5])

    def _empty_group(self) -> None:
        """Empty the group in place for a rewrite (``--overwrite``): its metadata goes first, in
        one write, so a concurrent reader sees a group being created (IncompleteStoreError),
        never a group whose metadata lists arrays that are gone, or no group at all."""
        g = self.cache.root[self.path]
        g.attrs.put({})
        for name in sorted(k for k, _ in g.members()):
            del g[name]

    def _listed_kinds(self) -> tuple[str, ...]:
        g = self.cache.root[self.path]
        return FeatureGroupMeta.from_attrs(dict(g.attrs[GROUP_KEY]), where=g.path).kinds

    def _restore_lost_kinds(self, lost: list[str]) -> None:
        """Recreate deleted feature arrays (their provenance went with them) with this run's
        settings, which matched every surviving kind's; every chunk is then recomputed."""
        for kind in lost:
            log.warning("%s: feature array %r is missing; recreating it (every chunk is recomputed)", self.path, kind)
            self._create_kind(self.group, kind, self.provenances[kind])
        if lost:
            self.group["done"][:] = 0
            clear_summary(self.group)

    def _recompute_unbound(self) -> None:
        """Recompute every chunk of a group whose chunks nothing binds to it: an array whose fill
        value would read a lost chunk as data (recreated with the writer's), a complete group
        without its summary, or chunks whose digests differ from its summary's (moved here).
        Resuming would record their digests as they are."""
        g = self.group
        gm = FeatureGroupMeta.from_attrs(dict(g.attrs[GROUP_KEY]), where=self.path)
        bad_fill = fill_problems(g, tuple(self.provenances))
        for name, why in bad_fill.items():
            log.warning("%s/%s: %s; recreating it (every chunk is recomputed)", self.path, name, why)
            if name in self.provenances:
                self._create_kind(g, name, self.provenances[name])
            else:
                create_aux_array(g, name, self.n, self.chunk_rows, self.n_chunks)
        unbound = []
        if read_done(g, self.n_chunks).all():  # else the summary is stale and goes: chunks will be written
            names = (*self.provenances, "valid", "error", "done")
            found, _ = check_place(g, self.path, gm, names, complete=True, store=self.cache.path)
            unbound = [line for name, line in found if name]
            if unbound and all(name != UNBOUND for name, _ in found if name):
                sc = scan_group(g, self.n, self.chunk_rows, self.n_chunks, tuple(self.provenances))
                if sc.damaged:  # a damaged chunk changes its array's digest too: recompute just those
                    unbound = []
        if bad_fill or unbound:
            for line in unbound[:3]:
                log.warning("%s; recomputing every chunk", line)
            g["done"][:] = 0
            clear_summary(g)

    def _create_kind(self, g, kind: str, prov: FeatureProvenance) -> None:
        a = create_feature_array(g, kind, self.n, self.chunk_rows, prov.dim, prov.dtype, prov.inner)
        doc = prov.to_attrs()
        a.update_attributes({PROVENANCE_KEY: doc, PROVENANCE_DIGEST_KEY: provenance_digest(doc)})

    def _restore_aux_arrays(self) -> None:
        """Recreate a lost ``valid``/``error``/``done`` array; every chunk is then recomputed
        (``done`` is recreated as zeros, or reset when ``valid``/``error`` had to be)."""
        lost = [name for name in ("valid", "error", "done") if name not in self.group]
        for name in lost:
            log.warning("%s: array %r is missing; recreating it (its chunks will be recomputed)", self.path, name)
            create_aux_array(self.group, name, self.n, self.chunk_rows, self.n_chunks)
        if ("valid" in lost or "error" in lost) and "done" not in lost:
            self.group["done"][:] = 0

    def release(self) -> None:
        """Release the group's writer lock (idempotent)."""
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()
            self._lock = None

    def _create(self) -> None:
        manifest.forget(self.cache.root, self.path)  # an older group's digests no longer apply
        g = self.cache.root.require_group(self.path)
        cr = self.chunk_rows
        n = self.n
        for kind, prov in self.provenances.items():
            self._create_kind(g, kind, prov)
        for name in ("valid", "error", "done"):
            create_aux_array(g, name, n, cr, self.n_chunks)
        meta = FeatureGroupMeta(
            SCHEMA_VERSION,
            self.backbone,
            self.dataset,
            self.split,
            n,
            cr,
            self.n_chunks,
            tuple(self.provenances),
            now_iso(),
        )
        g.attrs[GROUP_KEY] = meta.to_attrs()  # last: marks the group as created
        self.group = g

    @translating
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

    @translating
    def pending_chunks(self) -> list[int]:
        """Chunks not marked done, plus marked chunks that are damaged: missing, failing
        their checksum, or contradicting the arrays beside them (read chunk by chunk)."""
        sc = scan_group(self.group, self.n, self.chunk_rows, self.n_chunks, tuple(self.provenances))
        todo = set(np.flatnonzero(~sc.done).tolist()) | set(sc.bad_chunks)
        for name, chunks in sorted(sc.damaged.items()):
            log.warning(
                "%s: %d damaged chunk(s) of %r (%s); recomputing them",
                self.path,
                len(chunks),
                name,
                sc.reasons[name][chunks[0]],
            )
        return sorted(int(i) for i in todo)

    @translating
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
            raise SchemaMismatchError(f"chunk {i}: valid has shape {valid.shape}, expected ({rows},)")
        if set(features) != set(self.provenances):
            raise SchemaMismatchError(f"chunk {i}: kinds {sorted(features)} != {sorted(self.provenances)}")
        xs = {}
        for kind, x in features.items():
            x = np.asarray(x)
            prov = self.provenances[kind]
            if x.shape != (rows, *prov.row_shape):
                raise SchemaMismatchError(
                    f"chunk {i}: {kind} has shape {x.shape}, expected {(rows, *prov.row_shape)} "
                    "(rows x the kind's per-row shape)"
                )
            xs[kind] = as_stored(x, kind, prov.dtype, valid, i)
        errs = np.asarray([""] * rows if errors is None else [str(e) for e in errors], dtype=object)
        errs[valid] = ""
        errs[~valid & (errs == "")] = "marked invalid"  # invariant: invalid <=> error text
        errs = errs.astype(str)
        need = sum(x.nbytes for x in xs.values()) + valid.nbytes + errs.nbytes
        with self.no_space(f"chunk {i} (rows {start}-{stop - 1})", need):
            for kind, x in xs.items():
                self._arr(kind)[start:stop] = x
            self._arr("valid")[start:stop] = valid
            self._arr("error")[start:stop] = errs
            self._arr("done")[i] = 1  # only after every array of the chunk is written
        if self._lock is not None:
            self._lock.renew()

    def no_space(self, what: str, need: int) -> AbstractContextManager[None]:
        """:func:`no_space` for ``what`` of this group (zarr writes each object atomically, so
        nothing half-written stays, and ``done`` is set only after the chunk's arrays)."""
        return no_space(f"{self.cache.path}/{self.path}", what, need)

    @translating
    def mark_complete(self, **stats: Any) -> None:
        """Record run statistics (images/s, device, ...) in every kind's provenance. The lock
        holder records the group summary first: a reader that finds every chunk marked and
        neither a summary nor ``completed`` in the provenance sees a writer finishing, one that
        finds ``completed`` without a summary sees a summary lost (damage)."""
        valid = np.asarray(self.group["valid"][:], dtype=bool)
        n_invalid = int((~valid).sum())
        if self._lock is not None:  # the lock holder (rank 0) records what ls reads
            with self.no_space("the group summary", 4096):
                write_summary(self.group, self.n, self.n_chunks, tuple(self.provenances), valid)
        for kind in self.provenances:
            arr = self.group[kind]
            d = dict(arr.attrs[PROVENANCE_KEY])
            d.update({k: v for k, v in stats.items() if k in d})
            d["n_invalid"] = n_invalid
            d["completed"] = now_iso()
            FeatureProvenance.from_attrs(d, where=arr.path)  # validate before writing
            with self.no_space(f"{kind}'s provenance", 4096):
                arr.update_attributes({PROVENANCE_KEY: d, PROVENANCE_DIGEST_KEY: provenance_digest(d)})
        if self._lock is not None:
            with self.no_space("the store's manifest", 4096):
                manifest.record(self.cache.root, self.path)
        self.release()


def library_version(name: str) -> str:
    """``name.__version__`` where this process imported it (the library that made the features,
    build tag included: ``2.14.1+cpu``); else the installed distribution's version, read from its
    metadata without importing it (a process that writes features from elsewhere does not pay
    seconds of ``import torch`` for a string); ``""`` where it is not installed."""
    import importlib.metadata
    import sys

    module = sys.modules.get(name)
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def make_provenance(
    *,
    backbone: str,
    dataset: str,
    split: str,
    kind: str,
    dim: int | Sequence[int],
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
    """Fill versions and timestamps; everything else comes from the caller.

    ``dim``: the width D of a ``[n, D]`` kind, or a kind's per-row shape ``(*inner, D)``
    (``blocks:4``: ``(4, D)``; ``tokens``: ``(T, D)``), recorded as ``inner`` and ``dim``."""
    from featcache._version import __version__

    if not isinstance(dim, (int, np.integer)):
        shape = tuple(int(x) for x in dim)
        if not shape or "inner" in extra_fields:
            raise SchemaMismatchError(
                f"make_provenance(kind={kind!r}): dim {dim!r} must be an int or a per-row shape (*inner, D), "
                "without a separate inner="
            )
        dim, extra_fields["inner"] = shape[-1], shape[:-1]

    return FeatureProvenance(
        schema_version=SCHEMA_VERSION,
        backbone=backbone,
        model_name=model_name or backbone,
        weights_source=weights_source,
        weights_sha256=weights_sha256,
        timm_version=library_version("timm"),
        torch_version=library_version("torch"),
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


@translating
def write_features(
    path: str | os.PathLike | FeatureCache,
    *,
    backbone: str,
    dataset: str,
    split: str,
    X: np.ndarray,
    ids: ArrayLike,
    labels: ArrayLike,
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
    if not 1 <= chunk_rows <= MAX_CHUNK_ROWS:  # before the split is written
        raise SchemaMismatchError(f"chunk_rows {chunk_rows} is out of range: give 1..{MAX_CHUNK_ROWS} rows per chunk")
    if X.ndim < 2:
        raise SchemaMismatchError(f"X must be [n, dim] or [n, *inner, dim], got shape {X.shape}")
    labels = np.asarray(labels, dtype=np.int64)
    if class_names is None:
        class_names = [str(c) for c in range(int(labels.max()) + 1 if len(labels) else 0)]
    with no_space(f"{cache.path}/datasets/{dataset}/{split}", "the split's ids and labels", 64 * len(labels)):
        meta = ensure_split(cache, dataset, split, np.asarray(ids), labels, list(class_names), source)
    prov = make_provenance(
        backbone=backbone,
        dataset=dataset,
        split=split,
        kind=kind,
        dim=tuple(X.shape[1:]),
        n=X.shape[0],
        dataset_fingerprint=meta.fingerprint,
        chunk_rows=chunk_rows,
        dtype=dtype,
        **provenance_fields,
    )
    w = FeatureWriter(cache, backbone, dataset, split, {kind: prov}).prepare(overwrite=overwrite)
    valid = np.ones(len(X), bool) if valid is None else np.asarray(valid, bool)
    try:
        for i in w.pending_chunks():
            s, e = w.chunk_range(i)
            w.write_chunk(i, {kind: X[s:e]}, valid[s:e])
        w.mark_complete()
    finally:
        w.release()
    return cache
