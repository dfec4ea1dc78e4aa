"""Stores published as Hugging Face Hub datasets: ``hf://datasets/ORG/NAME[@REVISION][/PATH]``.

A published folder (``featcache publish``) holds the store in ``store.zarr/``; a URL without a
path opens that. Online the store is read through huggingface_hub's ``HfFileSystem`` (zarr's
fsspec store, read-only), so every chunk's crc32c checksum is checked on read as on a local
store; with ``HF_HUB_OFFLINE=1`` it is read from the local Hub cache
(``snapshot_download(local_files_only=True)``). ``HF_ENDPOINT`` (a mirror, or a loopback server
in the tests) and ``HF_HUB_OFFLINE`` are read when a store is opened, not only when
huggingface_hub is imported."""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any

from featcache.errors import ConfigError, NotInStoreError

__all__ = [
    "HF_PREFIX",
    "STORE_DIR",
    "HubPath",
    "hub_endpoint",
    "hub_offline",
    "hub_origin",
    "hub_snapshot",
    "hub_store",
    "is_hub_url",
]

HF_PREFIX = "hf://"
#: where ``featcache publish`` puts the store inside the published folder
STORE_DIR = "store.zarr"
_THEN = "check the network (or HF_ENDPOINT), or read the local Hub cache with HF_HUB_OFFLINE=1"
_URL = re.compile(r"^hf://datasets/(?P<org>[\w.-]+)/(?P<name>[\w.-]+)(?:@(?P<rev>[^/]+))?(?:/(?P<path>.*))?$")


@dataclass(frozen=True)
class HubPath:
    """``hf://datasets/ORG/NAME[@REVISION][/PATH]`` parsed; ``path`` is the store's folder."""

    repo_id: str
    revision: str | None
    path: str

    @classmethod
    def parse(cls, url: str) -> HubPath:
        m = _URL.match(url)
        if m is None:
            raise ConfigError(
                f"{url!r} is not a Hub dataset URL: write hf://datasets/ORG/NAME, hf://datasets/ORG/NAME@REVISION "
                "or hf://datasets/ORG/NAME@REVISION/FOLDER (the store's folder, store.zarr by default)"
            )
        rev = m["rev"]
        return cls(
            f"{m['org']}/{m['name']}", rev.replace("%2F", "/") if rev else None, (m["path"] or STORE_DIR).strip("/")
        )

    def fs_path(self) -> str:
        """The path ``HfFileSystem`` reads (a revision with ``/``, as ``refs/pr/1``, quoted)."""
        rev = f"@{self.revision.replace('/', '%2F')}" if self.revision else ""
        return f"datasets/{self.repo_id}{rev}/{self.path}"


def is_hub_url(store: Any) -> bool:
    return isinstance(store, str) and store.startswith(HF_PREFIX)


def hub_endpoint() -> str | None:
    """``HF_ENDPOINT`` as it is now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or None


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as it is now, or as huggingface_hub read it at import."""
    from huggingface_hub import constants

    now = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return now or bool(constants.HF_HUB_OFFLINE)


def hub_snapshot(hub: HubPath, *, cache_dir: str | None = None, offline: bool | None = None) -> str:
    """The store's folder in the local Hub cache, downloaded first unless offline (then the
    cache must hold it): ``snapshot_download`` of the store's files only."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    offline = hub_offline() if offline is None else offline
    where = f"hf://datasets/{hub.repo_id}" + (f"@{hub.revision}" if hub.revision else "")
    try:
        snap = snapshot_download(
            hub.repo_id,
            repo_type="dataset",
            revision=hub.revision,
            cache_dir=cache_dir,
            allow_patterns=[f"{hub.path}/**"],
            local_files_only=offline,
            endpoint=hub_endpoint(),
        )
    except LocalEntryNotFoundError:
        if offline:
            raise NotInStoreError(
                f"{where} is not in the local Hub cache (HF_HUB_OFFLINE is set): pull it once online "
                "(`featcache pull URL DEST`), or unset HF_HUB_OFFLINE"
            ) from None
        raise NotInStoreError(
            f"{where}: the Hub at {hub_endpoint() or 'huggingface.co'} could not be reached and the local Hub cache "
            "does not hold it: check the network (or HF_ENDPOINT) and pull again"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise NotInStoreError(f"{where}: {type(exc).__name__} on the Hub; check ORG/NAME and the revision") from None
    folder = os.path.join(snap, hub.path)
    if not os.path.isdir(folder):
        raise NotInStoreError(f"{where} has no folder {hub.path}/ (a store published by `featcache publish`)")
    return folder


def hub_store(url: str, mode: str = "r") -> Any:
    """What zarr opens for ``url``: a read-only fsspec store over ``HfFileSystem`` pinned to the
    commit the revision names now (online), or the folder in the local Hub cache (offline)."""
    if mode != "r":
        raise ConfigError(f"{url} is read-only here: a Hub dataset is written by `featcache publish` and an upload")
    hub = HubPath.parse(url)
    if hub_offline():
        return hub_snapshot(hub, offline=True)
    from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
    from huggingface_hub import HfFileSystem

    commit = _check_repo(hub, url)
    pinned = HubPath(hub.repo_id, commit, hub.path).fs_path()
    fs = HfFileSystem(endpoint=hub_endpoint())
    fs.resolve_path(pinned)  # the commit checked once here; every read below reuses it
    if not fs.find(pinned):  # one recursive listing, which also fills the cache every file open consults
        raise NotInStoreError(
            f"{url}: the dataset has no folder {hub.path}/ at commit {commit} (`featcache publish` puts the store in "
            f"{STORE_DIR}/; name another folder as hf://datasets/ORG/NAME@REVISION/FOLDER)"
        )
    return _pinned_store_class()(fs=AsyncFileSystemWrapper(fs, asynchronous=True), path=pinned, read_only=True)


def hub_origin(url: str, store: Any) -> str:
    """Where the store of ``url`` was read from (``store``: what zarr opened, ``hub_store``'s):
    the repo, the revision, the commit it named, and the Hub or the local Hub cache."""
    hub = HubPath.parse(url)
    rev = hub.revision or "main (the default)"
    folder = str(getattr(store, "root", ""))
    if folder:  # offline: the snapshot folder in the local Hub cache, named by its commit
        m = re.search(r"/snapshots/([^/]+)/", folder.replace(os.sep, "/"))
        where = f"offline, from the local Hub cache ({folder})"
    else:
        m = re.search(r"@([^/]+)/", str(getattr(store, "path", "")))
        where = f"through HfFileSystem from {hub_endpoint() or 'https://huggingface.co'}"
    commit = m[1] if m else "unknown"
    return f"repo {hub.repo_id}, revision {rev}, commit {commit}, folder {hub.path}/; read {where}"


@functools.cache  # zarr imported when a store is opened, not with this module
def _pinned_store_class() -> type:
    from zarr.storage import FsspecStore

    class PinnedHubStore(FsspecStore):
        """A Hub dataset at one commit: its files never change, so each metadata document
        (``*.json``) is fetched once (zarr and featcache read the group documents on every
        access: over HTTP 11 requests for ``features/zarr.json`` in one ``ls``); chunks are
        read, and their checksums checked, on every read."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._docs: dict[str, bytes | None] = {}

        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            if byte_range is not None or not key.endswith(".json"):
                return await super().get(key, prototype, byte_range)
            if key not in self._docs:
                buf = await super().get(key, prototype)
                self._docs[key] = None if buf is None else buf.to_bytes()
            raw = self._docs[key]
            return None if raw is None else prototype.buffer.from_bytes(raw)

    return PinnedHubStore


def _check_repo(hub: HubPath, url: str) -> str:
    """The commit sha the revision names now, from one ``dataset_info`` call, so that a missing
    repo or revision, or a Hub out of reach, is one line before zarr reads anything."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        sha = HfApi(endpoint=hub_endpoint()).dataset_info(hub.repo_id, revision=hub.revision).sha
        return sha or hub.revision or "main"
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise NotInStoreError(f"{url}: {type(exc).__name__} on the Hub; check ORG/NAME and the revision") from None
    except HfHubHTTPError as exc:
        code = exc.response.status_code
        if code in (401, 403, 404):
            raise NotInStoreError(
                f"{url}: the Hub answered {code} (no such dataset or revision, or a private one: log in with "
                "`hf auth login` or set HF_TOKEN); check ORG/NAME and the revision"
            ) from None
        raise NotInStoreError(f"{url}: the Hub answered {code}; {_THEN}") from None
    except Exception as exc:  # huggingface_hub's HTTP client's transport errors (connection refused, timeout)
        if not type(exc).__module__.startswith(("httpx", "httpcore", "requests", "urllib3")) and not isinstance(
            exc, OSError
        ):
            raise
        where = hub_endpoint() or "huggingface.co"
        raise NotInStoreError(
            f"{url}: the Hub at {where} could not be reached ({type(exc).__name__}: {exc}); {_THEN}"
        ) from None
