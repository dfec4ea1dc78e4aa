"""A writer unit's documents checked against each other when its digests cannot vouch for them
(its digest file damaged or deleted): the rest of the unit is the evidence.

Each document is compared with what the writer's own constructors make from the unit's other
documents: a feature group's ``valid``/``error``/``done`` documents from its group metadata, a
feature array's from the group metadata and its provenance (itself covered by its own sha256),
a split's ``ids``/``labels`` from its row count, and every group metadata with the node path
it sits at and the rows of its split. A document that differs from what the corroborated
evidence makes is damaged and ``verify --repair`` rebuilds it from the constructors; where the
evidence itself disagrees (the group metadata against the split, the provenance against the
group metadata or its own digest, a group at another place) nothing says which is right:
``verify`` names both and ``verify --repair`` refuses to record digests for the unit (it never
records damage as truth).
"""

from __future__ import annotations

import json
from typing import Any

from featcache.store import manifest


def _attrs(store, rel: str) -> dict[str, Any] | None:
    raw = manifest.read_raw(store, manifest.doc_key(rel))
    try:
        meta = json.loads(raw or b"")
        return meta["attributes"] if isinstance(meta.get("attributes"), dict) else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _diff(have: bytes, want: bytes) -> str:
    """The first fields where two documents differ, as ``field: doc has A, evidence gives B``."""
    try:
        a, b = json.loads(have), json.loads(want)
    except ValueError:
        return "its bytes differ"
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    parts = []
    for k in keys[:3]:
        if k == "attributes":
            sub = sorted(x for x in set(a[k]) | set(b.get(k, {})) if a[k].get(x) != b.get(k, {}).get(x))
            parts.append(f"attributes {sub[:3]} differ")
        else:
            parts.append(
                f"{k}: the document has {json.dumps(a.get(k))[:60]}, the evidence gives {json.dumps(b.get(k))[:60]}"
            )
    return "; ".join(parts) or "its bytes differ (key order or spacing)"


def _line(rel: str, evidence: str, why: str) -> tuple[str, str]:
    from featcache.store.metadata import deletion_advice, where

    return rel, (
        f"{where(rel)} and {evidence} disagree ({why}) and no digest says which is right: "
        f"`verify --repair` records neither; {deletion_advice(rel)}"
    )


def _built(make) -> bytes:
    import zarr
    from zarr.storage import MemoryStore

    d: dict = {}
    g = zarr.create_group(store=MemoryStore(store_dict=d), zarr_format=3)
    a = make(g)
    return d[f"{a.basename}/zarr.json"].to_bytes()


#: fields of an array document that the evidence determines (rows, chunk rows, width): a
#: document that differs there disagrees with the evidence (which one is damaged is unknown)
_EVIDENCED = ("shape", "chunk_grid")


def _compare(store, rel: str, want: bytes, evidence: str, fixes: dict, out: list) -> None:
    from featcache.store.metadata import where

    have = manifest.read_raw(store, manifest.doc_key(rel))
    if have is None or have == want:
        return
    try:
        a, b = json.loads(have), json.loads(want)
        conflict = any(a.get(k) != b.get(k) for k in _EVIDENCED)
    except (ValueError, AttributeError):
        conflict = False
    if conflict:
        out.append(_line(rel, evidence, _diff(have, want)))
    else:
        fixes[rel] = (
            want,
            f"{where(rel)}: differs from what the writer's constructors make from {evidence} ({_diff(have, want)}); "
            "`featcache verify --repair` rebuilds it from them",
        )


def check_unit(store, unit: str, skip: set[str]) -> tuple[list[tuple[str, str]], dict[str, tuple[bytes, str]]]:
    """(conflicts, rebuilds) of a unit no digest vouches for: conflicts as (node path, problem
    line) where the unit's evidence disagrees with itself (then nothing of the unit is
    rebuilt or recorded); rebuilds as node path -> (the document's bytes as the writer's
    constructors make them from the corroborated evidence, problem line) for each document
    that differs from them. ``skip``: documents already named (zarr refuses them, or missing)."""
    out: list[tuple[str, str]] = []
    fixes: dict[str, tuple[bytes, str]] = {}
    if unit in skip:
        return out, fixes
    attrs = _attrs(store, unit)
    if attrs is None:
        return out, fixes
    raw = manifest.read_raw(store, manifest.doc_key(unit)) or b""
    if raw != manifest.group_doc(attrs):
        out.append(_line(unit, "featcache's group document form", "its bytes are not as featcache writes them"))
    try:
        if unit.startswith("features/"):
            _feature_unit(store, unit, attrs, skip, out, fixes)
        elif unit.startswith("datasets/"):
            _split_unit(store, unit, attrs, skip, out, fixes)
        else:
            from featcache.store.schema import ROOT_KEY, RootMeta

            RootMeta.from_attrs(dict(attrs.get(ROOT_KEY, {})), where=unit or "the root")
    except Exception as exc:  # a schema error: the document's own fields are unusable
        out.append(_line(unit, "featcache's schema", f"{type(exc).__name__}: {str(exc)[:160]}"))
    return out, ({} if out else fixes)


def _split_unit(store, unit: str, attrs: dict, skip: set[str], out: list, fixes: dict) -> None:
    from featcache.store.arrays import create_row_array
    from featcache.store.schema import SPLIT_KEY, SplitMeta

    meta = SplitMeta.from_attrs(dict(attrs.get(SPLIT_KEY, {})), where=unit)
    if unit.split("/")[1:3] != [meta.dataset, meta.split]:
        out.append(_line(unit, f"its place {unit}", f"its metadata names datasets/{meta.dataset}/{meta.split}"))
    for name in ("ids", "labels"):
        rel = f"{unit}/{name}"
        if rel not in skip:
            want = _built(lambda g, name=name: create_row_array(g, name, meta.n, manifest.SPLIT_CHUNK_ROWS))
            _compare(store, rel, want, f"the split's row count in {manifest.doc_key(unit)}", fixes, out)


def _feature_unit(store, unit: str, attrs: dict, skip: set[str], out: list, fixes: dict) -> None:
    from featcache.store.schema import (
        GROUP_KEY,
        PROVENANCE_DIGEST_KEY,
        PROVENANCE_KEY,
        SPLIT_KEY,
        FeatureGroupMeta,
        FeatureProvenance,
        provenance_digest,
    )
    from featcache.store.writer import create_aux_array, create_feature_array

    gm = FeatureGroupMeta.from_attrs(dict(attrs.get(GROUP_KEY, {})), where=unit)
    gdoc = manifest.doc_key(unit)
    _, b, d, s = unit.split("/")
    if [b, d, s] != [gm.backbone, gm.dataset, gm.split]:
        out.append(
            _line(unit, f"its place {unit}", f"its metadata names features/{gm.backbone}/{gm.dataset}/{gm.split}")
        )
    if gm.n_chunks != max(1, -(-gm.n // gm.chunk_rows)):
        out.append(
            _line(unit, "its own rows and chunk rows", f"n_chunks {gm.n_chunks} for {gm.n} rows of {gm.chunk_rows}")
        )
    split = (_attrs(store, f"datasets/{d}/{s}") or {}).get(SPLIT_KEY, {})
    if isinstance(split, dict) and isinstance(split.get("n"), int) and split["n"] != gm.n:
        out.append(_line(unit, f"datasets/{d}/{s}/zarr.json", f"{gm.n} rows here, {split['n']} in the split"))
    for name in ("valid", "error", "done"):
        if f"{unit}/{name}" not in skip:
            want = _built(lambda g, name=name: create_aux_array(g, name, gm.n, gm.chunk_rows, gm.n_chunks))
            _compare(store, f"{unit}/{name}", want, f"the group metadata in {gdoc}", fixes, out)
    for kind in gm.kinds:
        rel = f"{unit}/{kind}"
        kattrs = _attrs(store, rel)
        if rel in skip or kattrs is None:
            continue
        prov_doc = dict(kattrs.get(PROVENANCE_KEY, {}))
        digest = kattrs.get(PROVENANCE_DIGEST_KEY)
        if digest != provenance_digest(prov_doc):
            why = "no digest kept" if digest is None else "the provenance was changed after writing"
            out.append(_line(rel, "its provenance digest", why))
            continue
        prov = FeatureProvenance.from_attrs(prov_doc, where=rel)
        for field in ("n", "chunk_rows"):
            if getattr(prov, field) != getattr(gm, field):
                out.append(
                    _line(rel, gdoc, f"{field} {getattr(prov, field)} in the provenance, {getattr(gm, field)} there")
                )

        def make(g, kind=kind, prov=prov, kattrs=kattrs):
            a = create_feature_array(g, kind, gm.n, gm.chunk_rows, prov.dim, prov.dtype, prov.inner)
            a.update_attributes({k: kattrs[k] for k in (PROVENANCE_KEY, PROVENANCE_DIGEST_KEY) if k in kattrs})
            return a

        _compare(store, rel, _built(make), f"its provenance and the group metadata in {gdoc}", fixes, out)
