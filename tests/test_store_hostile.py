"""A store around hostile state: an odd lock folder, hostile image folders, a full disk and
damaged metadata. Every case ends in one named error (or an invalid row) and never loses a
finished chunk; see docs/store.md ("Faults around the chunks")."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import numpy as np
import pytest

from featcache.errors import CacheNotWritableError, LockStateError
from featcache.store import open_cache, write_features


@pytest.fixture
def digits_pixels():
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.data[:200].astype(np.float32), d.target[:200], [str(c) for c in d.target_names]


def _write(path, X, y, names, **kw):
    return write_features(
        path,
        backbone="pix",
        dataset="digits",
        split="train",
        X=X,
        ids=[f"d{i}" for i in range(len(y))],
        labels=y,
        class_names=names,
        chunk_rows=64,
        **kw,
    )


@contextlib.contextmanager
def _read_only_bind(path):
    """``path`` mounted read-only on itself (root only); skips where mounting is refused."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root (a chmod is ignored by root, so it proves nothing)")
    if subprocess.run(["mount", "--bind", path, path], capture_output=True).returncode != 0:
        pytest.skip("mount --bind refused here")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", path], capture_output=True).returncode != 0:
            pytest.skip("read-only remount refused here")
        yield path
    finally:
        subprocess.run(["umount", path], capture_output=True)


# ---------------------------------------------------------------- odd lock state
def test_lock_folder_that_is_a_file_is_named(tmp_path, digits_pixels):
    X, y, names = digits_pixels
    path = str(tmp_path / "c.zarr")
    _write(path, X, y, names)
    locks = tmp_path / "c.zarr" / ".featcache-locks"
    shutil.rmtree(locks)
    locks.write_text("not a folder")
    with pytest.raises(
        LockStateError, match=r"\.featcache-locks is a file, not the store's lock folder.*Move the file"
    ):
        _write(path, X, y, names, overwrite=True)
    assert issubclass(LockStateError, CacheNotWritableError)
    np.testing.assert_array_equal(open_cache(path).load("pix", "digits", "train").X, X)  # reading needs no lock


def test_unwritable_lock_folder_is_named_and_reading_needs_no_lock(tmp_path, digits_pixels):
    X, y, names = digits_pixels
    path = str(tmp_path / "c.zarr")
    _write(path, X, y, names)
    locks = os.path.join(path, ".featcache-locks")
    for f in os.listdir(locks):
        os.remove(os.path.join(locks, f))
    msg = r"cannot take the writer lock .*Read-only file system.*needs no lock"
    with _read_only_bind(locks), pytest.raises(LockStateError, match=msg):
        _write(path, X, y, names, overwrite=True)
    shutil.rmtree(locks)  # a read-only store without any lock folder still opens for reading
    with _read_only_bind(path):
        np.testing.assert_array_equal(open_cache(path).load("pix", "digits", "train").X, X)
        from featcache.store.verify import verify

        assert verify(path) == []
