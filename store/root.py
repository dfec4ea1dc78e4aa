"""The root of a featcache store: opening or creating its zarr group and writing its root
document once (under the root lock), and telling a part whose digests its writer did not get
to record."""

from __future__ import annotations

import warnings
from datetime import datetime, timezone
from typing import Any

from featcache.errors import SchemaMismatchError
from featcache.store import manifest
from featcache.store.locks import StoreLock
from featcache.store.schema import ROOT_KEY, SCHEMA_VERSION, RootMeta

__all__ = ["create_root", "now_iso", "open_or_create", "root_unrecorded"]


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def open_or_create(store: Any, kwargs: dict) -> Any:
    """``zarr.open_group(mode="a")``, which checks for a group and then creates one: a job
    that creates the same new store between the two makes it raise ContainsGroupError. The
    group exists then, and a second open finds it."""
    import zarr
    from zarr import errors as zarr_errors

    try:
        return zarr.open_group(store, mode="a", zarr_format=3, **kwargs)
    except zarr_errors.ContainsGroupError:
        return zarr.open_group(store, mode="a", zarr_format=3, **kwargs)


def root_unrecorded(root: Any, unit: str = "") -> bool:
    """A part of a store written with digests whose digest file is missing because its writer
    was stopped between the two writes (e.g. by a full disk): the next writer records it."""
    return manifest.DIGESTS_KEY in root.attrs and manifest.read_raw(root.store, manifest.manifest_key(unit)) is None


def create_root(root: Any, label: str) -> Any:
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
            from featcache._version import __version__

            meta = RootMeta(SCHEMA_VERSION, __version__, now_iso()).to_attrs()
            root.update_attributes({ROOT_KEY: meta, manifest.DIGESTS_KEY: manifest.FORMAT})
            manifest.record(root, "")
        elif root_unrecorded(root):
            manifest.record(root, "")
    return root
