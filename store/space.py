"""A full disk (or quota) while the store writes: one :class:`~featcache.errors.NoSpaceError`
naming where, what and about how many bytes, instead of zarr's ``OSError: [Errno 28]``.

zarr's local store writes each object to a temporary file and renames it, deleting the
temporary file when the write fails, so a failed write leaves nothing half-written; the
writer sets a chunk's ``done`` flag only after the chunk's arrays, so a re-run resumes exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from featcache.errors import NoSpaceError

NO_SPACE_THEN = (
    "Free space (or extract into another --cache / cache=), then re-run the same command: finished "
    "chunks are kept and only the missing ones are computed."
)


@contextlib.contextmanager
def no_space(path: str, what: str, need: int, then: str = NO_SPACE_THEN) -> Iterator[None]:
    """A full disk while writing ``what`` under ``path`` becomes one NoSpaceError."""
    try:
        yield
    except NoSpaceError:
        raise
    except Exception as exc:
        if not NoSpaceError.caused_by(exc):
            raise
        raise NoSpaceError.about(path, what, need, then) from None
