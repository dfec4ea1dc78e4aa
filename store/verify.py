"""Integrity check of a whole cache (``featcache verify``)."""

from __future__ import annotations

import logging

import numpy as np

from featcache.errors import FeatcacheError
from featcache.store.cache import open_cache
from featcache.store.schema import GROUP_KEY, FeatureGroupMeta

log = logging.getLogger(__name__)


def verify(path: str, storage_options: dict | None = None) -> list[str]:
    """Return a list of problems (empty when the store is sound): every chunk present and
    marked, shapes consistent, provenance valid, no NaN/inf in valid rows."""
    problems: list[str] = []
    try:
        cache = open_cache(path, storage_options=storage_options)
    except FeatcacheError as exc:
        return [str(exc)]
    for d in cache.datasets():
        for s in cache.splits(d):
            try:
                ids, labels, meta = cache.split_rows(d, s)
            except FeatcacheError as exc:
                problems.append(f"datasets/{d}/{s}: {exc}")
                continue
            if len(ids) != meta.n or len(labels) != meta.n:
                problems.append(f"datasets/{d}/{s}: {len(ids)} ids, {len(labels)} labels, metadata says {meta.n}")
            if len(labels) and (labels.min() < 0 or labels.max() >= len(meta.class_names)):
                problems.append(f"datasets/{d}/{s}: labels outside 0..{len(meta.class_names) - 1}")
    for b, d, s in cache.entries():
        where = f"features/{b}/{d}/{s}"
        try:
            g = cache._feature_group(b, d, s)
            gm = FeatureGroupMeta.from_attrs(dict(g.attrs[GROUP_KEY]), where=where)
            smeta = cache.split_meta(d, s)
            status = cache.chunk_status(b, d, s)
        except (FeatcacheError, KeyError) as exc:
            problems.append(f"{where}: {exc}")
            continue
        todo = np.flatnonzero(~status["done"]).tolist()
        if todo:
            problems.append(f"{where}: {len(todo)} of {gm.n_chunks} chunks not marked done (e.g. {todo[:5]}); re-run extract")
        for name, lost in status["missing_files"].items():
            problems.append(f"{where}/{name}: chunk objects missing for marked chunks {lost[:10]}; re-run extract to recompute")
        valid = np.asarray(g["valid"][:], dtype=bool)
        for name in ("valid", "error"):
            if g[name].shape != (gm.n,):
                problems.append(f"{where}/{name}: shape {g[name].shape} != ({gm.n},)")
        if gm.n != smeta.n:
            problems.append(f"{where}: {gm.n} rows but split has {smeta.n}")
        # rows to scan for NaN/inf: valid rows of chunks marked done (same for every kind)
        check = valid & np.repeat(status["done"], gm.chunk_rows)[: gm.n]
        for kind in gm.kinds:
            try:
                prov = cache.provenance(b, d, s, kind)
            except FeatcacheError as exc:
                problems.append(f"{where}/{kind}: {exc}")
                continue
            arr = g[kind]
            if arr.shape != (gm.n, prov.dim):
                problems.append(f"{where}/{kind}: shape {arr.shape} != ({gm.n}, {prov.dim})")
            if prov.dataset_fingerprint != smeta.fingerprint:
                problems.append(f"{where}/{kind}: computed on other rows of {d}/{s} (fingerprint mismatch)")
            for start in range(0, gm.n, gm.chunk_rows):
                stop = min(start + gm.chunk_rows, gm.n)
                if not check[start:stop].any():
                    continue
                x = np.asarray(arr[start:stop])[check[start:stop]]
                bad = ~np.isfinite(x).all(axis=1)
                if bad.any():
                    rows = (np.flatnonzero(check[start:stop])[bad] + start)[:5].tolist()
                    problems.append(f"{where}/{kind}: {int(bad.sum())} valid row(s) with NaN/inf (rows {rows})")
    for p in problems:
        log.warning("verify: %s", p)
    return problems
