"""Digests and copies of a store's metadata documents (``zarr.json``), kept beside the root.

Every *writer unit* (the root, a dataset split, a feature group) has one manifest object,
``.featcache-manifest/<unit>.json``, that its writer rewrites under the unit's lock after it
changed one of the unit's documents: per document the sha256 of its bytes and a copy of its
attributes. ``featcache verify`` checks each document against its digest; ``verify --repair``
rebuilds a damaged one with the writer's own array constructors from the unit's metadata
(shape, chunks, dtype, codecs) and the kept attributes, and accepts the rebuilt bytes only
when their sha256 is the recorded one. The manifest goes through the store's own I/O (zarr's
Store API), so it exists on every kind of store; it is not a zarr node.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from featcache.errors import CorruptManifestError

log = logging.getLogger(__name__)

MANIFEST_DIR = ".featcache-manifest"
FORMAT = 1
#: root attribute of a store written with digests: every writer unit has a digest file, so a
#: missing one was deleted (a store without it was written before digests)
DIGESTS_KEY = "featcache_digests"
AUX = ("valid", "error", "done")
#: chunk rows of a split's ids/labels as :func:`~featcache.store.cache.ensure_split` writes them
SPLIT_CHUNK_ROWS = 65536


class NotDerivable(Exception):
    """A damaged document that cannot be rebuilt from what the store still holds."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def doc_key(rel: str) -> str:
    """Store key of the metadata document of node ``rel`` ("" is the root)."""
    return f"{rel}/zarr.json" if rel else "zarr.json"


def manifest_key(unit: str) -> str:
    return f"{MANIFEST_DIR}/{unit.replace('/', '~') if unit else 'root'}.json"


def unit_of(rel: str) -> str | None:
    """The writer unit owning node ``rel`` (None for folders between units and foreign nodes)."""
    parts = rel.split("/") if rel else []
    if not parts:
        return ""
    if parts[0] == "datasets" and len(parts) in (3, 4):
        return "/".join(parts[:3])
    if parts[0] == "features" and len(parts) in (4, 5):
        return "/".join(parts[:4])
    return None


# ---------------------------------------------------------------- raw I/O through the Store API
def read_raw(store, key: str) -> bytes | None:
    from zarr.buffer import default_buffer_prototype

    from featcache.store._zarr_internal import sync

    buf = sync(store.get(key, prototype=default_buffer_prototype()))
    return None if buf is None else buf.to_bytes()


def write_raw(store, key: str, data: bytes) -> None:
    from zarr.buffer import default_buffer_prototype

    from featcache.store._zarr_internal import sync

    sync(store.set(key, default_buffer_prototype().buffer.from_bytes(data)))


def delete_raw(store, key: str) -> None:
    from featcache.store._zarr_internal import sync

    sync(store.delete(key))


def units(store) -> list[str]:
    """Units that have a manifest object."""
    from featcache.store._zarr_internal import sync

    async def ls() -> list[str]:
        return [k async for k in store.list_prefix(MANIFEST_DIR + "/")]

    out = []
    for key in sorted(sync(ls())):
        name = key[len(MANIFEST_DIR) + 1 :]
        if name.endswith(".json") and "/" not in name:
            name = name[: -len(".json")]
            out.append("" if name == "root" else name.replace("~", "/"))
    return out


# ---------------------------------------------------------------- writing
def unit_documents(store, unit: str) -> list[str]:
    """Node paths of the documents a unit's writer wrote (the unit's group first)."""
    if not unit:
        return [""]
    if unit.startswith("datasets/"):
        return [unit, f"{unit}/ids", f"{unit}/labels"]
    from featcache.store.schema import GROUP_KEY

    raw = read_raw(store, doc_key(unit))
    kinds = list(json.loads(raw)["attributes"][GROUP_KEY]["kinds"]) if raw else []
    return [unit, *(f"{unit}/{k}" for k in (*kinds, *AUX))]


def record(root_group, unit: str) -> None:
    """Rewrite ``unit``'s manifest from its documents as they are now (its writer, under its lock)."""
    store = root_group.store
    docs: dict[str, Any] = {}
    for rel in unit_documents(store, unit):
        raw = read_raw(store, doc_key(rel))
        if raw is not None:
            docs[doc_key(rel)] = {"sha256": sha256(raw), "attributes": json.loads(raw).get("attributes", {})}
    body = {"featcache_manifest": FORMAT, "unit": unit, "documents": docs}
    body["sha256"] = _body_digest(body)
    write_raw(store, manifest_key(unit), json.dumps(body, indent=1).encode())


def forget(root_group, unit: str) -> None:
    """Drop a unit's manifest before its documents are written anew (its writer, under its lock)."""
    delete_raw(root_group.store, manifest_key(unit))


def _body_digest(body: dict) -> str:
    rest = {k: v for k, v in body.items() if k != "sha256"}
    return sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


def load(store, unit: str) -> dict[str, Any] | None:
    """A unit's manifest (None when it has none); ValueError naming what is wrong when damaged."""
    raw = read_raw(store, manifest_key(unit))
    if raw is None:
        return None
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptManifestError(f"not valid JSON ({exc})") from None
    if not isinstance(body, dict) or not isinstance(body.get("documents"), dict):
        raise CorruptManifestError("not a featcache manifest")
    if body.get("sha256") != _body_digest(body):
        raise CorruptManifestError("its content does not match its own digest")
    return body


# ---------------------------------------------------------------- rebuilding
def _memory_group():
    import zarr
    from zarr.storage import MemoryStore

    d: dict = {}
    return zarr.create_group(store=MemoryStore(store_dict=d), zarr_format=3), d


def group_doc(attrs: dict) -> bytes:
    import zarr
    from zarr.storage import MemoryStore

    d: dict = {}
    zarr.create_group(store=MemoryStore(store_dict=d), attributes=attrs, zarr_format=3)
    return d["zarr.json"].to_bytes()


def _attributes(store, rel: str, entries: dict) -> dict:
    """A node's attributes: the kept copy, else its document when that still parses."""
    entry = entries.get(doc_key(rel))
    if entry is not None:
        return entry["attributes"]
    try:
        return json.loads(read_raw(store, doc_key(rel)) or b"")["attributes"]
    except (ValueError, KeyError, TypeError):
        raise NotDerivable(f"{doc_key(rel)} is damaged too and no copy of it was kept") from None


def _array_doc(rel: str, store, entries: dict) -> bytes:
    from featcache.store.arrays import create_aux_array, create_feature_array, create_row_array
    from featcache.store.schema import GROUP_KEY, PROVENANCE_KEY, SPLIT_KEY, FeatureGroupMeta, FeatureProvenance

    parent, name = rel.rsplit("/", 1)
    entry = entries.get(doc_key(rel))
    g, d = _memory_group()
    try:
        if parent.startswith("datasets/"):
            n = int(_attributes(store, parent, entries)[SPLIT_KEY]["n"])
            a = create_row_array(g, name, n, SPLIT_CHUNK_ROWS)
        else:
            gm = FeatureGroupMeta.from_attrs(dict(_attributes(store, parent, entries)[GROUP_KEY]))
            if name in AUX:
                a = create_aux_array(g, name, gm.n, gm.chunk_rows, gm.n_chunks)
            elif entry is None:
                raise NotDerivable(
                    "its provenance was only in it: the store was written before metadata digests, so no copy was kept"
                )
            else:
                prov = FeatureProvenance.from_attrs(dict(entry["attributes"][PROVENANCE_KEY]))
                a = create_feature_array(g, name, gm.n, gm.chunk_rows, prov.dim, prov.dtype, prov.inner)
    except NotDerivable:
        raise
    except Exception as exc:  # damaged copies: a schema error, a missing key
        raise NotDerivable(f"the metadata it is derived from is unusable ({type(exc).__name__}: {exc})") from None
    if entry is not None and entry["attributes"]:
        a.update_attributes(entry["attributes"])
    return d[f"{name}/zarr.json"].to_bytes()


def rebuild(store, rel: str, entries: dict[str, dict]) -> bytes:
    """The bytes of node ``rel``'s document as its writer wrote them, or NotDerivable(reason).

    ``entries``: the documents recorded in the unit's manifest (empty when it has none); a
    recorded document is rebuilt only when the result has the recorded sha256."""
    parts = rel.split("/") if rel else []
    unit = unit_of(rel)
    entry = entries.get(doc_key(rel))
    if unit is None:
        if parts and parts[0] in ("datasets", "features") and len(parts) <= 3:
            return group_doc({})  # the folders between units hold no attributes of featcache's
        raise NotDerivable("it is not part of featcache's layout, so nothing says how it was made")
    if rel == unit:
        if entry is None:
            raise NotDerivable(
                "its attributes were only in it: the store was written before metadata digests, so no copy was kept"
            )
        out = group_doc(entry["attributes"])
    elif len(parts) == 4 and parts[0] == "datasets" and parts[3] not in ("ids", "labels"):
        raise NotDerivable("featcache's writer does not make this array, so nothing says how it was made")
    else:
        out = _array_doc(rel, store, entries)
    if entry is not None and sha256(out) != entry["sha256"]:
        raise NotDerivable("rebuilt from the store's metadata it differs from the document its writer recorded")
    return out
