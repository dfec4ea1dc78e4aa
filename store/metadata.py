"""Damaged zarr metadata (``zarr.json`` documents): named per document instead of zarr's raw
``JSONDecodeError`` / ``MetadataValidationError``.

:func:`damaged_documents` reads every metadata document of a local store and says, for each
one that does not parse as zarr v3 metadata, which document it is, what is wrong and what to
run. Nothing here rewrites a document: damaged metadata is not derivable from the chunks.
"""

from __future__ import annotations

import json
import os

from featcache.errors import CorruptStoreError

METADATA_ERRORS = ("JSONDecodeError", "MetadataValidationError", "UnicodeDecodeError")


AUX = ("valid", "error", "done")


def _what_to_run(rel: str) -> str:
    parts = rel.split("/")
    if parts[0] == "features" and len(parts) == 5 and parts[4] in AUX:
        return "run `featcache verify --repair` (it recreates this array), then re-run the same extract"
    if parts[0] == "features" and len(parts) >= 4:
        b, d, s = parts[1:4]
        g = "/".join(parts[:4])
        return f"not derivable: delete the folder {g}, then re-run the extract of {b} on {d}/{s}"
    if parts[0] == "datasets" and len(parts) >= 3:
        d, s = parts[1:3]
        return f"not derivable: delete datasets/{d}/{s} and features/*/{d}/{s}, then re-run their extracts"
    return "not derivable: restore it from a backup, or extract into a new --cache"


def repairable(rel: str) -> bool:
    """A damaged ``done``/``valid``/``error`` array document: the array is recreated by
    ``verify --repair`` (its chunks recomputed by the next extract)."""
    parts = rel.split("/")
    return parts[0] == "features" and len(parts) == 5 and parts[4] in AUX


def _problem(doc: str) -> str | None:
    """What is wrong with one zarr.json document, or None when zarr accepts it."""
    from zarr.core.group import GroupMetadata
    from zarr.core.metadata.v3 import ArrayV3Metadata

    try:
        with open(doc, "rb") as fh:
            meta = json.loads(fh.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"not valid JSON ({exc})"
    if not isinstance(meta, dict):
        return "not a JSON object"
    try:
        if meta.get("node_type") == "array":
            ArrayV3Metadata.from_dict(dict(meta))
        elif meta.get("node_type") == "group":
            GroupMetadata.from_dict(dict(meta))
        else:
            return f"not valid zarr v3 metadata (node_type {meta.get('node_type')!r}: neither 'array' nor 'group')"
    except Exception as exc:  # zarr's validation errors have several types
        return f"not valid zarr v3 metadata ({type(exc).__name__}: {exc})"
    return None


def damaged_documents(root: str) -> list[str]:
    """One problem line per damaged metadata document under the local store ``root``."""
    return [line for _, line in damaged(root)]


def damaged(root: str) -> list[tuple[str, str]]:
    """(node path, problem line) per damaged metadata document under ``root``."""
    out = []
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "c" and not d.startswith("."))  # chunk folders hold no metadata
        if "zarr.json" not in files:
            continue
        doc = os.path.join(top, "zarr.json")
        why = _problem(doc)
        if why is not None:
            rel = os.path.relpath(top, root).replace(os.sep, "/")
            rel = "" if rel == "." else rel
            where = f"{rel + '/' if rel else ''}zarr.json (metadata of {rel or 'the store root'})"
            out.append((rel, f"{where}: {why}; {_what_to_run(rel)}"))
    return out


def is_metadata_error(exc: BaseException) -> bool:
    return type(exc).__name__ in METADATA_ERRORS


def named_metadata_error(root: str | None, exc: BaseException) -> CorruptStoreError:
    """The one-line error for ``exc`` raised while reading a damaged metadata document."""
    found = damaged_documents(root) if root and os.path.isdir(root) else []
    if not found:
        return CorruptStoreError(
            f"{root}: damaged zarr metadata ({type(exc).__name__}: {exc}); run `featcache verify {root}`"
        )
    more = f" (and {len(found) - 1} more; `featcache verify {root}` lists them)" if len(found) > 1 else ""
    return CorruptStoreError(f"{root}: damaged metadata document {found[0]}{more}")
