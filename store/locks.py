"""Writer locks for a shared store: one writer per dataset split and per feature group.

* Local stores (:class:`zarr.storage.LocalStore`): an OS file lock (the ``filelock`` package)
  in ``<root>/.featcache-locks/``. The kernel releases it when the holder dies, so a
  ``kill -9`` never leaves a stale lock.
* Every other store (object stores, :class:`zarr.storage.MemoryStore`, ...): a *lease*, a
  small zarr group ``locks/<name>`` whose attributes name the holder and an expiry time. The
  holder renews it while it writes; a lease whose holder died expires after ``LEASE_SECONDS``.
  Object stores offer no atomic create through zarr, so the lease is a documented
  single-writer-per-split rule made visible, not a mutex: a second job is refused while the
  lease is alive, and the holder re-reads its lease before every renewal and stops if another
  job took it over.

A process that already holds a lock (e.g. a failed ``extract`` retried in the same notebook)
may take it again: locks are per process, not per call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from featcache.errors import LockStateError, StoreBusyError

log = logging.getLogger(__name__)

LOCK_DIR = ".featcache-locks"
LEASE_GROUP = "locks"
LEASE_SECONDS = 120.0
_OWNER = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
_held: dict[tuple[int, str], StoreLock] = {}
_held_lock = threading.Lock()


def _lock_name(name: str) -> str:
    return name.replace("/", "~")


def local_root(store) -> str | None:
    from zarr.storage import LocalStore

    return str(store.root) if isinstance(store, LocalStore) else None


class StoreLock:
    """Exclusive writer lock on ``name`` (e.g. ``features/<b>/<d>/<s>``) in one store."""

    def __init__(self, root_group: Any, name: str, *, timeout: float = 0.0, what: str = ""):
        self.root = root_group
        self.name = name
        self.timeout = timeout
        self.what = what or name
        self._file = None
        self._renewed = 0.0
        self._local = local_root(root_group.store)

    # ---------------------------------------------------------------- public
    def _key(self) -> tuple:
        # a local store is one folder however many times it is opened in this process
        return (self._local if self._local is not None else id(self.root.store), self.name)

    def acquire(self) -> StoreLock:
        key = self._key()
        with _held_lock:
            prev = _held.get(key)
        if prev is not None and prev is not self:
            prev.release()  # same process: an earlier, failed attempt; take over
        if self._local is not None:
            self._acquire_file()
        else:
            self._acquire_lease()
        with _held_lock:
            _held[key] = self
        return self

    def release(self) -> None:
        key = self._key()
        with _held_lock:
            if _held.get(key) is self:
                del _held[key]
        if self._file is not None:
            self._file.release()
            self._file = None
        elif self._local is None and self._renewed:
            self._renewed = 0.0
            g = self._lease_group()
            if g is not None and g.attrs.get("owner") == _OWNER:
                with contextlib.suppress(KeyError):  # already gone
                    del self.root[f"{LEASE_GROUP}/{_lock_name(self.name)}"]

    def renew(self) -> None:
        """Keep a lease alive (no-op for file locks); call between chunk writes."""
        if self._local is not None or not self._renewed:
            return
        if time.time() - self._renewed < LEASE_SECONDS / 4:
            return
        g = self._lease_group()
        owner = g.attrs.get("owner") if g is not None else None
        if owner != _OWNER:
            raise StoreBusyError(
                f"{self.what}: the writer lease was taken over by {owner!r} after it expired; this job "
                "stops so that two jobs never write the same chunks. Re-run it once the other job is done."
            )
        self._write_lease(g)

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # ---------------------------------------------------------------- file lock
    def _acquire_file(self) -> None:
        import filelock

        assert self._local is not None  # called for a local store only
        d = os.path.join(self._local, LOCK_DIR)
        if os.path.lexists(d) and not os.path.isdir(d):
            raise LockStateError(
                f"{d} is a file, not the store's lock folder: writing {self.what} needs that folder. "
                "Move the file away (nothing featcache needs is in it), then re-run this command; "
                "reading the store needs no lock."
            )
        path = os.path.join(d, _lock_name(self.name) + ".lock")
        try:
            os.makedirs(d, exist_ok=True)
            lock = filelock.FileLock(path, thread_local=False)
            lock.acquire(timeout=self.timeout)
        except filelock.Timeout:
            raise StoreBusyError(
                f"{self.what} is being written by another job (lock {path} held). Wait for that job to "
                "finish, then re-run this command: finished chunks are kept and only missing ones computed."
            ) from None
        except OSError as exc:
            raise LockStateError(
                f"cannot take the writer lock {path} for {self.what} ({exc.strerror or exc}): this user "
                f"cannot write the store's lock folder {d} (read-only mount or another user's store). "
                "Writing needs write permission there (fix the permissions, or extract into a store of "
                "your own); reading this store needs no lock and works as it is."
            ) from None
        self._file = lock

    # ---------------------------------------------------------------- lease
    def _lease_group(self):
        try:
            return self.root[f"{LEASE_GROUP}/{_lock_name(self.name)}"]
        except KeyError:
            return None

    def _write_lease(self, g) -> None:
        now = time.time()
        g.attrs.update({"owner": _OWNER, "lock": self.name, "expires": now + LEASE_SECONDS})
        self._renewed = now

    def _acquire_lease(self) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            g = self._lease_group()
            attrs = dict(g.attrs) if g is not None else {}
            alive = attrs.get("owner") not in (None, _OWNER) and float(attrs.get("expires", 0)) > time.time()
            if not alive:
                if g is None:
                    g = self.root.require_group(f"{LEASE_GROUP}/{_lock_name(self.name)}")
                self._write_lease(g)
                # last writer wins on object stores: read back and confirm the lease is ours
                time.sleep(0.05)
                g = self._lease_group()
                if g is not None and g.attrs.get("owner") == _OWNER:
                    return
                attrs = dict(g.attrs) if g is not None else attrs
            if time.monotonic() >= deadline:
                raise StoreBusyError(
                    f"{self.what} is being written by another job ({attrs.get('owner')}, lease until "
                    f"{time.strftime('%H:%M:%S', time.localtime(float(attrs.get('expires', 0))))}; "
                    f"one writer per split on this store). Wait for that job to finish (or for the lease "
                    f"of a dead job to expire, {LEASE_SECONDS:.0f} s), then re-run this command."
                )
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))

    def __repr__(self) -> str:
        return f"StoreLock({self.name!r}, {'file' if self._local else 'lease'})"
