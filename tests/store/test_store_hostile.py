"""A store around hostile state: an odd lock folder, hostile image folders, a full disk and
damaged metadata. Every case ends in one named error (or an invalid row) and never loses a
finished chunk; see docs/store.md ("Faults around the chunks")."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from pathlib import Path

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


# ---------------------------------------------------------------- hostile image folders
def _png(path, size=(6, 4)):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (10, 200, 30)).save(path, "PNG")
    return path


# unresolvable where /proc/1 is another user's (or hidden), outside the folder where it resolves
PROC_LINK = r"cannot be followed \(Permission denied\)|points outside the image folder"


def _hostile_folder(root):
    """cat/ok.png, cat/sub/deep.png; links: into /proc, out of the folder, a file loop, a
    folder loop and a folder link named like an image."""
    _png(root / "cat" / "ok.png")
    _png(root / "cat" / "sub" / "deep.png")
    _png(root / "dog" / "ok.png")
    outside = _png(root.parent / "outside.png")
    os.symlink("/proc/1/cwd", root / "cat" / "proc.png")
    os.symlink(outside, root / "dog" / "out.png")
    os.symlink("loop2.png", root / "dog" / "loop1.png")
    os.symlink("loop1.png", root / "dog" / "loop2.png")
    os.symlink("..", root / "cat" / "sub" / "up")  # a folder loop: never walked
    os.symlink("/proc", root / "cat" / "sub" / "proc")  # not walked either
    os.symlink(root / "cat" / "sub", root / "dog" / "dir.png")  # a folder named like an image
    return {
        "cat/proc.png": PROC_LINK,
        "dog/loop1.png": "cannot be followed (Too many levels of symbolic links)",
        "dog/loop2.png": "cannot be followed (Too many levels of symbolic links)",
        "dog/out.png": "points outside the image folder",
    }


def test_hostile_folder_links_are_invalid_rows_never_followed_outside(tmp_path):
    from featcache.data.readers import open_dataset
    from featcache.data.source import ReadOptions
    from featcache.errors import DataError

    root = tmp_path / "folder"
    bad = _hostile_folder(root)
    (s,) = open_dataset(f"imagefolder:{root}").values()
    assert s.ids.tolist() == ["cat/ok.png", "cat/proc.png", "cat/sub/deep.png", *sorted([*[*bad][1:], "dog/ok.png"])]
    for i, rid in enumerate(s.ids.tolist()):
        if rid in bad:
            with pytest.raises(DataError, match=bad[rid] if rid == "cat/proc.png" else re.escape(bad[rid])):
                s.load(i)
        else:
            assert s.load(i).size == (6, 4)
    (f,) = open_dataset(f"imagefolder:{root}", options=ReadOptions(follow_symlinks=True)).values()
    assert f.load(f.ids.tolist().index("dog/out.png")).size == (6, 4)  # asked for: followed
    n = len(bad) + 3 + 1  # the bad links, the folder loop / folder link / /proc link never walked, the followed link
    assert len(s.ids) == len(bad) + 3  # the walked-past links add no row
    record_figures({"hostile-folder cases tried": n, "hostile-folder cases handled": n})


def test_hostile_class_folders_and_walk_errors_are_one_refusal(tmp_path, monkeypatch):
    from featcache.data.readers import open_dataset
    from featcache.errors import DataError

    root = tmp_path / "folder"
    _png(root / "cat" / "ok.png")
    _png(root / "cat" / "sub" / "a.png")
    _png(root / "cat" / "gone" / "b.png")
    os.symlink("/proc", root / "proc")
    with pytest.raises(
        DataError, match=r"class folder symlink .*/proc points outside the image folder.*remove the link"
    ):
        open_dataset(f"imagefolder:{root}")
    os.remove(root / "proc")
    os.symlink("proc2", root / "proc")
    os.symlink("proc", root / "proc2")
    with pytest.raises(DataError, match=r"class folder symlink .*cannot be followed \(Too many levels"):
        open_dataset(f"imagefolder:{root}")
    os.remove(root / "proc")
    os.remove(root / "proc2")
    real_scandir = os.scandir

    def hostile(path):
        if str(path).endswith("sub"):
            raise PermissionError(13, "Permission denied", str(path))
        if str(path).endswith("gone"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", hostile)
    with pytest.raises(
        DataError, match=r"cannot list image subfolder .*/cat/sub \(Permission denied\); make it readable"
    ):
        open_dataset(f"imagefolder:{root}")
    shutil.rmtree(root / "cat" / "sub")
    (s,) = open_dataset(f"imagefolder:{root}").values()  # a subfolder vanished mid-walk: skipped
    assert s.ids.tolist() == ["cat/ok.png"]
    record_figures({"hostile-folder cases tried": 4, "hostile-folder cases handled": 4})


@pytest.mark.slow
def test_hostile_folder_extracts_with_invalid_rows_and_no_traceback(tmp_path, capsys):
    from featcache.cli import main

    root = tmp_path / "folder"
    bad = _hostile_folder(root)
    argv = ["extract", "--model", "tf_efficientnet_lite0", "--weights", "random:0", "--data", f"imagefolder:{root}"]
    argv += [
        "--input-size",
        "32",
        "--chunk-rows",
        "4",
        "--workers",
        "0",
        "--no-progress",
        "--cache",
        str(tmp_path / "c"),
    ]
    assert main(argv) == 0
    assert "Traceback" not in capsys.readouterr().err
    f = open_cache(tmp_path / "c").load("tf_efficientnet_lite0@random0", "folder", "all")
    for rid, err, ok in zip(f.ids.tolist(), f.errors.tolist(), f.valid.tolist(), strict=True):
        assert ok == (rid not in bad), rid
        if rid in bad:
            assert re.search(bad[rid] if rid == "cat/proc.png" else re.escape(bad[rid]), err), (rid, err)
    record_figures({"hostile-folder cases tried": 1, "hostile-folder cases handled": 1})


# ---------------------------------------------------------------- a full disk
KEY = "tf_efficientnet_lite0@random0"
NO_SPACE = (
    r"^no space left on the device of .*{} while writing {} \(needs about [\d,]+ bytes more; [\d,]+ bytes free there\)"
)


def _cfg(cache, n=32, chunk=8):
    from featcache.extract import ExtractConfig

    return ExtractConfig(
        "tf_efficientnet_lite0",
        "random:0",
        "digits",
        ["test"],
        str(cache),
        limit={"test": n},
        input_size=32,
        batch_size=chunk,
        workers=0,
        progress=False,
        chunk_rows=chunk,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from featcache.extract import extract

    path = tmp_path_factory.mktemp("ref") / "ref.zarr"
    extract(_cfg(path))
    return open_cache(path).load(KEY, "digits", "test").X


def _finished_chunks_intact(path, ref, chunk=8) -> int:
    """Every chunk marked done holds exactly the reference rows; no temporary file is left."""
    import zarr

    assert not [f for _, _, fs in os.walk(path) for f in fs if f.endswith(".partial")]
    try:
        g = zarr.open_group(str(path), mode="r")[f"features/{KEY}/digits/test"]
        done = np.asarray(g["done"][:])
    except (KeyError, FileNotFoundError):
        return 0
    for i in np.flatnonzero(done):
        np.testing.assert_array_equal(
            np.asarray(g["pooled"][i * chunk : (i + 1) * chunk]), ref[i * chunk : (i + 1) * chunk]
        )
    return int(done.sum())


@contextlib.contextmanager
def _tmpfs(path, size):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    ).returncode:
        pytest.skip("mount -t tmpfs refused here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


@pytest.mark.slow
def test_full_disk_extract_is_one_line_and_resumes_exactly(tmp_path, capsys):
    from featcache.cli import main
    from featcache.extract import extract

    extract(_cfg(tmp_path / "ref96.zarr", n=96, chunk=16))
    ref = open_cache(tmp_path / "ref96.zarr").load(KEY, "digits", "test").X
    argv = ["extract", "--model", "tf_efficientnet_lite0", "--weights", "random:0", "--data", "digits", "--split"]
    argv += ["test", "--limit", "96", "--input-size", "32", "--chunk-rows", "16", "--workers", "0", "--no-progress"]
    with _tmpfs(tmp_path / "small", "160k") as small:
        cache = small / "c.zarr"
        capsys.readouterr()
        assert main([*argv, "--cache", str(cache)]) == 1  # the size check: refused before any image is read
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert "--no-size-check" in err.strip().splitlines()[-1]
        assert not cache.exists() or open_cache(cache).catalog().height == 0  # no feature written
        argv.append("--no-size-check")  # compression may make it fit: the writer's own full-disk path
        assert main([*argv, "--cache", str(cache)]) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err
        line = err.strip().splitlines()[-1].split("error: ", 1)[1]
        assert re.search(NO_SPACE.format(f"{KEY}/digits/test", r"chunk \d+ \(rows \d+-\d+\)"), line), line
        assert "re-run the same command" in line
        done = _finished_chunks_intact(cache, ref, chunk=16)
        assert 0 < done < 6
        subprocess.run(["mount", "-o", "remount,size=4m", str(small)], check=True)
        assert main([*argv, "--cache", str(cache)]) == 0
        assert f"{6 - done}/6 chunks computed" in capsys.readouterr().out
        X = open_cache(cache).load(KEY, "digits", "test").X
    np.testing.assert_array_equal(X, ref)


def _inject_enospc(monkeypatch, at: int) -> list[str]:
    """The store's I/O layer (zarr's LocalStore.set) fails with ENOSPC at its ``at``-th write."""
    import errno

    import zarr.storage

    seen: list[str] = []
    orig = zarr.storage.LocalStore.set

    async def full(self, key, value):
        seen.append(key)
        if len(seen) == at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return await orig(self, key, value)

    monkeypatch.setattr(zarr.storage.LocalStore, "set", full)
    return seen


def _orphans(path, wait: float = 10.0) -> list[str]:
    """Temporary files left under ``path``. A sibling write that zarr ran in a worker thread when
    the injected one failed may still be between its temporary file and its rename (seen under
    load): wait for those to finish; an orphan stays."""
    import time

    deadline = time.monotonic() + wait
    while True:
        left = [f for _, _, fs in os.walk(path) for f in fs if f.endswith(".partial")]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@pytest.mark.slow
def test_enospc_at_every_store_write_site(tmp_path, monkeypatch, digits_pixels):
    """Each write the store makes fails in turn: one NoSpaceError naming the path, nothing
    half-written, every chunk marked done intact, and a plain re-run byte-identical."""
    import zarr

    from featcache.errors import NoSpaceError
    from featcache.store.verify import verify

    X, y, names = digits_pixels
    with monkeypatch.context() as m:
        sites = _inject_enospc(m, 0)
        _write(tmp_path / "ref.zarr", X, y, names)
    assert len(sites) > 15
    resumed = 0
    for k in range(1, len(sites) + 1):
        path = tmp_path / f"k{k}.zarr"
        with monkeypatch.context() as m:
            _inject_enospc(m, k)
            with pytest.raises(
                NoSpaceError, match=r"^no space left on the device of .*k\d+\.zarr.* while writing .*re-run"
            ):
                _write(path, X, y, names)
        assert not _orphans(path), sites[k - 1]
        with contextlib.suppress(KeyError, FileNotFoundError):
            g = zarr.open_group(str(path), mode="r")["features/pix/digits/train"]
            for i in np.flatnonzero(np.asarray(g["done"][:])):
                np.testing.assert_array_equal(g["pooled"][i * 64 : (i + 1) * 64], X[i * 64 : (i + 1) * 64])
        _write(path, X, y, names)  # space freed: a plain re-run
        got = open_cache(path).load("pix", "digits", "train")
        np.testing.assert_array_equal(got.X, X)
        assert got.ids.tolist() == [f"d{i}" for i in range(len(y))]
        assert verify(path) == [], sites[k - 1]  # no stale metadata digest either
        resumed += 1
    assert resumed == len(sites), resumed
    record_figures({"ENOSPC points tried": len(sites), "ENOSPC resumed byte-identical": resumed})


def record_figures(counts: dict[str, int]) -> None:
    """Add ``counts`` to the figures file docs/store.md quotes (``FEATCACHE_FAULT_FIGURES``)."""
    import json

    dest = os.environ.get("FEATCACHE_FAULT_FIGURES")
    if not dest:
        return
    old = json.loads(Path(dest).read_text()) if os.path.exists(dest) else {}
    for k, v in counts.items():
        old[k] = old.get(k, 0) + v
    with open(dest, "w") as fh:
        json.dump(old, fh, indent=1, sort_keys=True)


def test_full_disk_results_append_is_one_line_and_keeps_the_table(tmp_path):
    import polars as pl

    from featcache.core.results import append_results, read_results
    from featcache.errors import NoSpaceError

    def rows(run: int) -> list[dict]:
        rng = np.random.default_rng(run)  # incompressible text: the disk fills in a few appends
        return [
            {
                "run_id": f"r{run}",
                "kind": "probe",
                "backbone": "b",
                "dataset": "d",
                "metric": f"m{i}",
                "value": float(i),
                "seed": run,
                "hparams": f'{{"h": "{rng.bytes(200).hex()}"}}',
            }
            for i in range(50)
        ]

    with _tmpfs(tmp_path / "small", "256k") as small:
        table = small / "results.parquet"
        before = None
        for run in range(40):
            try:
                append_results(table, rows(run))
            except NoSpaceError as exc:
                msg = str(exc)
                break
            before = read_results(table)
        else:
            pytest.fail("the disk never filled")
        assert re.match(NO_SPACE.format("results.parquet", r"50 new result rows"), msg), msg
        assert "The table is unchanged" in msg
        assert before is not None
        assert read_results(table).equals(before)  # intact, not a partial parquet
        assert sorted(os.listdir(small)) == [".results.parquet.lock", "results.parquet"]  # no orphan temp file
        subprocess.run(["mount", "-o", "remount,size=8m", str(small)], check=True)
        after = append_results(table, rows(run))
        assert after.equals(pl.concat([before, read_results(table).filter(pl.col("run_id") == f"r{run}")]))
        assert len(after) == len(before) + 50


# ---------------------------------------------------------------- damaged metadata
DOCS = (  # one document of each kind; each is rebuilt by verify --repair (its writer recorded it)
    "",
    "datasets/digits/train",
    "features/pix/digits/train",
    "features/pix/digits/train/pooled",
    "features/pix/digits/train/done",
    "features/pix/digits/train/valid",
)


def _damage(doc, how: str) -> None:
    raw = doc.read_bytes()
    if how == "truncate":
        doc.write_bytes(raw[: len(raw) // 2])
    else:  # one bit flipped in a key: valid JSON that zarr refuses
        key = b'"codecs"' if b'"codecs"' in raw else b'"node_type"'
        i = raw.index(key) + 2
        doc.write_bytes(raw[:i] + bytes([raw[i] ^ 0x04]) + raw[i + 1 :])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_metadata_is_named_per_document(tmp_path, digits_pixels, capsys, how):
    from featcache.cli import main

    X, y, names = digits_pixels
    ref = tmp_path / "ref.zarr"
    _write(ref, X, y, names)
    for i, node in enumerate(DOCS):
        path = tmp_path / f"c{i}.zarr"
        shutil.copytree(ref, path)
        _damage(path / node / "zarr.json", how)
        capsys.readouterr()
        assert main(["verify", str(path)]) == 1
        out = capsys.readouterr()
        assert "Traceback" not in out.err
        doc = f"{node + '/' if node else ''}zarr.json (metadata of {node or 'the store root'}): not valid"
        assert f"PROBLEM {doc}" in out.out, (node, out.out)
        assert f"run `featcache verify --repair {path}` (it rebuilds this document" in out.out
        assert main(["verify", "--repair", str(path)]) == 0  # every damaged document rebuilt: success
        out = capsys.readouterr()
        assert "Traceback" not in out.err
        assert f"REPAIRED {doc.split(': not valid')[0]}: rebuilt from the store's own metadata" in out.out, out.out
        assert main(["verify", str(path)]) == 0  # no re-run needed: the chunks were never lost
        np.testing.assert_array_equal(open_cache(path).load("pix", "digits", "train").X, X)


@pytest.mark.slow
def test_extract_rerun_on_damaged_metadata_is_one_line(tmp_path, capsys, reference):
    from featcache.cli import main
    from featcache.extract import extract

    path = tmp_path / "c.zarr"
    extract(_cfg(path))
    _damage(path / "features" / KEY / "digits" / "test" / "zarr.json", "truncate")
    argv = ["extract", "--model", "tf_efficientnet_lite0", "--weights", "random:0", "--data", "digits", "--split"]
    argv += ["test", "--limit", "32", "--input-size", "32", "--chunk-rows", "8", "--workers", "0", "--no-progress"]
    capsys.readouterr()
    assert main([*argv, "--cache", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"damaged metadata document features/{KEY}/digits/test/zarr.json" in err
    assert f"run `featcache verify --repair {path}`" in err
    assert main(["verify", "--repair", str(path)]) == 0  # what it says to do: all repaired
    assert main([*argv, "--cache", str(path)]) == 0
    np.testing.assert_array_equal(open_cache(path).load(KEY, "digits", "test").X, reference)
