"""Damaged zarr metadata (``zarr.json`` documents): named per document instead of zarr's raw
``JSONDecodeError`` / ``MetadataValidationError``.

:func:`documents` reads every metadata document of a local store through zarr's public API
(``zarr.open_array`` / ``zarr.open_group``) and says, for each one zarr refuses, which document
it is, what is wrong and what to run. :func:`changed` compares each document a writer recorded
with its digest in the store's manifest (:mod:`featcache.store.manifest`), which also finds
damage that zarr accepts (a digit of a shape, a letter of a provenance value).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

from featcache.errors import CorruptStoreError
from featcache.store import manifest

F = TypeVar("F", bound=Callable[..., Any])

#: exception types zarr raises for a damaged metadata document (translated only when a
#: damaged document is found on disk)
METADATA_ERRORS = (
    "JSONDecodeError",
    "MetadataValidationError",
    "UnicodeDecodeError",
    "UnknownCodecError",
    "NodeTypeValidationError",
    "ValueError",
    "TypeError",
    "KeyError",
    "GroupNotFoundError",
    "ArrayNotFoundError",
    "NodeNotFoundError",
)


def where(rel: str) -> str:
    return f"{manifest.doc_key(rel)} (metadata of {rel or 'the store root'})"


def deletion_advice(rel: str) -> str:
    parts = rel.split("/")
    if parts[0] == "features" and len(parts) >= 4:
        b, d, s = parts[1:4]
        return f"delete the folder {'/'.join(parts[:4])}, then re-run the extract of {b} on {d}/{s}"
    if parts[0] == "datasets" and len(parts) >= 3:
        d, s = parts[1:3]
        return f"delete datasets/{d}/{s} and features/*/{d}/{s}, then re-run their extracts"
    return "restore it from a backup, or extract into a new --cache"


def advice(store, rel: str, entries: dict, path: str = "") -> tuple[bool, str]:
    """(derivable, what to run) for a damaged document of node ``rel``."""
    try:
        manifest.rebuild(store, rel, entries)
    except manifest.NotDerivable as exc:
        return False, f"not derivable ({exc}): {deletion_advice(rel)}"
    cmd = f"featcache verify --repair {path}".rstrip()
    return True, f"run `{cmd}` (it rebuilds this document from the store's own metadata)"


def problem(store, rel: str) -> str | None:
    """What is wrong with the document of node ``rel``, or None when zarr accepts it."""
    import zarr

    raw = manifest.read_raw(store, manifest.doc_key(rel))
    if raw is None:
        return None
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return f"not valid JSON ({exc})"
    if not isinstance(meta, dict):
        return "not a JSON object"
    kind = meta.get("node_type")
    if kind not in ("array", "group"):
        return f"not valid zarr v3 metadata (node_type {kind!r}: neither 'array' nor 'group')"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opener = zarr.open_array if kind == "array" else zarr.open_group
            opener(store=store, path=rel, mode="r", zarr_format=3)
    except Exception as exc:  # zarr's validation errors have several types
        return f"not valid zarr v3 metadata ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    return None


def local_nodes(root: str, unlisted: list[tuple[str, str]] | None = None) -> list[str]:
    """Node paths ("" for the root) of every metadata document under the local store ``root``;
    ``unlisted`` collects (node path, reason) per folder that cannot be listed (one that
    vanished during the walk is no node any more and is left out)."""

    def failed(exc: OSError) -> None:
        if unlisted is not None and not isinstance(exc, FileNotFoundError):
            rel = os.path.relpath(exc.filename or root, root).replace(os.sep, "/")
            unlisted.append(("" if rel == "." else rel, exc.strerror or str(exc)))

    out = []
    for top, dirs, files in os.walk(root, onerror=failed):
        dirs[:] = sorted(d for d in dirs if d != "c" and not d.startswith("."))  # chunk folders hold no metadata
        if "zarr.json" in files:
            rel = os.path.relpath(top, root).replace(os.sep, "/")
            out.append("" if rel == "." else rel)
    return out


def read_only_store(root: str):
    from zarr.storage import LocalStore

    return LocalStore(root, read_only=True)


def damaged(root: str) -> list[tuple[str, str]]:
    """(node path, problem line) per metadata document of the local store ``root`` that zarr refuses."""
    store = read_only_store(root)
    entries = all_entries(store)
    out = []
    for rel in local_nodes(root):
        why = problem(store, rel)
        if why is not None:
            out.append((rel, f"{where(rel)}: {why}; {advice(store, rel, entries, root)[1]}"))
    return out


def damaged_documents(root: str) -> list[str]:
    """One problem line per damaged metadata document under the local store ``root``."""
    return [line for _, line in damaged(root)]


def all_entries(store) -> dict[str, dict]:
    """Every recorded document of every sound manifest, by document key."""
    out: dict[str, dict] = {}
    for unit in manifest.units(store):
        try:
            body = manifest.load(store, unit)
        except ValueError:
            continue
        out.update((body or {}).get("documents", {}))
    return out


def is_metadata_error(exc: BaseException) -> bool:
    return type(exc).__name__ in METADATA_ERRORS


def named_metadata_error(root: str | None, exc: BaseException) -> CorruptStoreError | None:
    """The one-line error for ``exc`` raised while reading a damaged metadata document of the
    local store ``root``; None when no damaged document is found there (another error)."""
    found = damaged(os.fspath(root)) if root and os.path.isdir(root) else []
    if not found:
        if type(exc).__name__ in ("JSONDecodeError", "MetadataValidationError", "UnicodeDecodeError"):
            return CorruptStoreError(
                f"{root}: damaged zarr metadata ({type(exc).__name__}: {exc}); run `featcache verify {root}`"
            )
        return None
    more = f" (and {len(found) - 1} more; `featcache verify {root}` lists them)" if len(found) > 1 else ""
    return CorruptStoreError(f"{root}: damaged metadata document {found[0][1]}{more}")


def changed(store, skip: set[str], path: str = "") -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Documents that differ from the digest their writer recorded, as (node path, problem
    line), and damaged manifests, as (unit, problem line); ``skip``: nodes already named."""
    out, bad_units = [], []
    entries = all_entries(store)
    for unit in manifest.units(store):
        try:
            body = manifest.load(store, unit)
        except ValueError as exc:
            bad_units.append((unit, _manifest_line(unit, str(exc), path)))
            continue
        for key, entry in (body or {}).get("documents", {}).items():
            rel = key[: -len("/zarr.json")] if key != "zarr.json" else ""
            raw = manifest.read_raw(store, key)
            if rel in skip or (raw is not None and manifest.sha256(raw) == entry.get("sha256")):
                continue
            if raw is None:
                why = f"missing (deleted after it was written: {manifest.manifest_key(unit)} records it)"
            else:
                why = f"changed after it was written (its sha256 differs from the one recorded in {manifest.manifest_key(unit)})"
            out.append((rel, f"{where(rel)}: {why}; {advice(store, rel, entries, path)[1]}"))
    return out, bad_units


def _manifest_line(unit: str, why: str, path: str) -> str:
    cmd = f"featcache verify --repair {path}".rstrip()
    return (
        f"{manifest.manifest_key(unit)} (metadata digests of {unit or 'the store root'}): {why}; run `{cmd}` "
        "(it records them again only from documents that agree with the rest of their part of the store)"
    )


def between_changed(store, rels: list[str], skip: set[str], path: str = "") -> list[tuple[str, str]]:
    """The folders between units (``datasets``, ``features/<b>`` ...) hold featcache's empty
    group document (``datasets/<d>`` may hold a declared task metric): any other bytes that
    zarr still reads are damage, as (node path, problem line)."""
    out = []
    for rel in rels:
        parts = rel.split("/") if rel else []
        if rel in skip or manifest.unit_of(rel) is not None or not parts or parts[0] not in ("datasets", "features"):
            continue
        raw = manifest.read_raw(store, manifest.doc_key(rel)) or b""
        try:
            attrs = json.loads(raw)["attributes"]
        except (ValueError, KeyError, TypeError):
            attrs = None
        allowed = {"featcache.task"} if parts[0] == "datasets" and len(parts) == 2 else set()
        if isinstance(attrs, dict) and set(attrs) <= allowed and raw == manifest.group_doc(attrs):
            continue
        why = "differs from the group document featcache writes there"
        out.append((rel, f"{where(rel)}: {why}; {advice(store, rel, {}, path)[1]}"))
    return out


def _root_of(obj: Any) -> str | None:
    """The local path of the store a store object works on (a FeatureCache, a FeatureWriter, a path)."""
    if isinstance(obj, (str, os.PathLike)):
        return os.fspath(obj)
    path = getattr(getattr(obj, "cache", obj), "path", None)
    return path if isinstance(path, str) else None


@contextlib.contextmanager
def named_damage(root: str | None) -> Iterator[None]:
    """Turn zarr's error for a damaged metadata document of the store at ``root`` into one
    :class:`~featcache.errors.CorruptStoreError` naming the document and what to run; every
    other error passes unchanged. The store's entry points are the one place this happens."""
    try:
        yield
    except Exception as exc:
        named = named_metadata_error(root, exc) if is_metadata_error(exc) else None
        if named is None:
            raise
        raise named from None


def translating(fn: F) -> F:
    """:func:`named_damage` around a store entry point (a method of a FeatureCache or a
    FeatureWriter, or a function whose first argument is a cache or its path)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with named_damage(_root_of(args[0]) if args else None):
            return fn(*args, **kwargs)

    return cast(F, wrapper)
