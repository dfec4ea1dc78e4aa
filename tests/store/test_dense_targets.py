"""Dense targets in the store (issue 57): masks, depth maps and their tables keep their own dtypes
beside the model's kinds, with every guarantee of a feature group (chunk checksums, verify and
repair, kill -9 resume byte-identical, swapped folders refused, reads during writes).

The rows are real: 2 x 2 mosaics of Fashion-MNIST test garments (56 x 56), each garment pixel
(> 0) labelled with its class, the background class 10; tokens are each 14 x 14 patch's pixels
average-pooled to 4 x 4 (a 4 x 4 grid of 16-wide tokens); depth is made from the pixels
(1 + 9 * pixel / 255 metres where a garment is, 0 and invalid on the background)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from featcache.core.dense import DenseInfo, Geometry
from featcache.errors import CorruptStoreError, SchemaMismatchError
from featcache.store import FeatureWriter, ensure_split, make_provenance, open_cache

FMNIST = Path("/usr/share/datasets/fashion-mnist")
BACKGROUND = 10
N = 48
CHUNK = 4
SEG_DTYPES = {"tokens": "float16", "mask": "uint8", "full_mask": "uint8", "image_size": "int32"}
DEPTH_DTYPES = {"tokens": "float16", "depth": "float32", "depth_valid": "uint8"}
GEOMETRY = Geometry("resize", (56, 56), (4, 4), (56, 56), {"interpolation": "bilinear"})
SEG_INFO = DenseInfo("seg", num_classes=11, ignore_index=255, class_names=tuple(f"c{i}" for i in range(11)))
DEPTH_INFO = DenseInfo("depth", depth_range=(0.001, 10.0))


def mosaics(n: int = N, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` 2 x 2 mosaics of consecutive Fashion-MNIST test images (uint8 [n, 56, 56]) and their
    masks (class id where the garment's pixel is > 0, else :data:`BACKGROUND`)."""
    from featcache.data.readers.folders import read_idx

    imgs = read_idx(FMNIST / "t10k-images-idx3-ubyte.gz")[offset : offset + 4 * n].reshape(n, 2, 2, 28, 28)
    labels = read_idx(FMNIST / "t10k-labels-idx1-ubyte.gz")[offset : offset + 4 * n].reshape(n, 2, 2)
    img = imgs.transpose(0, 1, 3, 2, 4).reshape(n, 56, 56)
    cls = np.repeat(np.repeat(labels, 28, axis=1), 28, axis=2).astype(np.uint8)
    return img, np.where(img > 0, cls, BACKGROUND).astype(np.uint8)


def tokens_of(img: np.ndarray) -> np.ndarray:
    """[n, gh * gw, 16] float32: each 14 x 14 patch (row-major over the grid) pooled to 4 x 4."""
    n, h, w = img.shape
    gh, gw = h // 14, w // 14
    p = img.astype(np.float32).reshape(n, gh, 14, gw, 14).transpose(0, 1, 3, 2, 4)  # n, gh, gw, 14, 14
    p = p[..., :12, :12].reshape(n, gh, gw, 4, 3, 4, 3).mean(axis=(4, 6)) / 255.0  # each patch 4 x 4
    return p.reshape(n, gh * gw, 16)


def seg_rows(n: int = N, offset: int = 0) -> dict[str, np.ndarray]:
    img, mask = mosaics(n, offset)
    size = np.tile(np.array([56, 56, 56, 56], np.int32), (n, 1))
    return {"tokens": tokens_of(img), "mask": mask, "full_mask": mask.copy(), "image_size": size}


def depth_rows(n: int = N) -> dict[str, np.ndarray]:
    img, _ = mosaics(n)
    valid = (img > 0).astype(np.uint8)
    depth = np.where(valid > 0, 1.0 + 9.0 * img / 255.0, 0.0).astype(np.float32)
    return {"tokens": tokens_of(img), "depth": depth, "depth_valid": valid}


def provenances(meta, rows, dtypes, *, backbone="pix", split="val", geometry=GEOMETRY, info=SEG_INFO, chunk=CHUNK):
    """Each kind's provenance as a dense extract records it (geometry and dense info in ``extra``)."""
    extra = {"geometry": geometry.record(), "dense": info.record()}
    return {
        k: make_provenance(
            backbone=backbone, dataset="mosaic", split=split, kind=k, dim=x.shape[1:], n=len(x),
            dataset_fingerprint=meta.fingerprint, chunk_rows=chunk, dtype=dtypes[k], extra=dict(extra),
            weights_source=f"pixels:{backbone}",
        )
        for k, x in rows.items()
    }  # fmt: skip


def write_dense(
    path, rows, dtypes, *, backbone="pix", split="val", ids=None, valid=None, geometry=GEOMETRY, info=SEG_INFO
):
    """Every kind of ``rows`` into one group through the writer API, as a dense extract does."""
    n = len(next(iter(rows.values())))
    cache = open_cache(path, "a")
    ids = np.array([f"m{i}" for i in range(n)]) if ids is None else np.asarray(ids)
    meta = ensure_split(cache, "mosaic", split, ids, np.zeros(n, np.int64), ["image"], "mosaics")
    provs = provenances(meta, rows, dtypes, backbone=backbone, split=split, geometry=geometry, info=info)
    valid = np.ones(n, bool) if valid is None else valid
    w = FeatureWriter(cache, backbone, "mosaic", split, provs).prepare()
    for i in w.pending_chunks():
        s, e = w.chunk_range(i)
        w.write_chunk(i, {k: x[s:e] for k, x in rows.items()}, valid[s:e], ["unreadable"] * (e - s))
    w.mark_complete()
    return cache


def stored(rows, dtypes, valid):
    """What the store holds for ``rows``: the stored dtype, invalid rows at the fill (NaN or 0)."""
    out = {}
    for k, x in rows.items():
        y = x.astype(dtypes[k], copy=True)
        y[~valid] = np.nan if y.dtype.kind == "f" else 0
        out[k] = y
    return out


VALID = np.arange(N) % 13 != 7


@pytest.fixture(scope="module")
def seg_data(tmp_path_factory):
    rows = seg_rows()
    path = tmp_path_factory.mktemp("dense") / "rows.npz"
    np.savez(path, **rows)
    return str(path), rows


# ---------------------------------------------------------------- dtypes
def test_target_kinds_keep_their_dtypes_beside_the_model_kinds(tmp_path):
    from featcache.store.verify import verify

    rows, drows = seg_rows(), depth_rows()
    cache = write_dense(tmp_path / "c.zarr", rows, SEG_DTYPES, valid=VALID)
    write_dense(tmp_path / "c.zarr", drows, DEPTH_DTYPES, split="depth", valid=VALID, info=DEPTH_INFO)
    assert verify(str(tmp_path / "c.zarr")) == []
    for split, got_rows, dtypes in (("val", rows, SEG_DTYPES), ("depth", drows, DEPTH_DTYPES)):
        want = stored(got_rows, dtypes, VALID)
        for k, dt in dtypes.items():
            f = cache.load("pix", "mosaic", split, kind=k, dtype=None)
            assert (f.X.dtype, f.provenance["dtype"], f.complete) == (np.dtype(dt), dt, True)
            np.testing.assert_array_equal(f.X, want[k])
            np.testing.assert_array_equal(f.valid, VALID)
            lazy = cache.load("pix", "mosaic", split, kind=k, lazy=True)
            assert lazy.X.dtype == np.dtype(dt)
            np.testing.assert_array_equal(lazy.X[5:17], want[k][5:17])
        blocks = np.concatenate([x for _, x in cache.iter_blocks("pix", "mosaic", split, k)])  # the last target
        np.testing.assert_array_equal(blocks[VALID], want[k][VALID].astype(np.float32))
    assert cache.load("pix", "mosaic", "val", kind="mask").X.dtype == np.float32  # load's default, as for features
    assert set(np.unique(want_mask := stored(rows, SEG_DTYPES, VALID)["mask"][VALID])) <= set(range(11))
    assert (want_mask == BACKGROUND).any()  # background and garments both present
    assert (want_mask < BACKGROUND).any()


def test_a_uint16_mask_holds_ids_above_255(tmp_path):
    rows = seg_rows(24)
    rows["mask"] = rows["mask"].astype(np.uint16) * 300  # ids up to 3000 (ADE20K-full has 3688 classes)
    rows.pop("full_mask")
    cache = write_dense(tmp_path / "c.zarr", rows, {**SEG_DTYPES, "mask": "uint16"})
    np.testing.assert_array_equal(cache.load("pix", "mosaic", "val", kind="mask", dtype=None).X, rows["mask"])


@pytest.mark.parametrize(
    ("kind", "dtype", "says"),
    [
        ("mask", "float16", "target kind 'mask' cannot be stored as 'float16': give dtype 'uint8' or 'uint16'"),
        ("full_mask", "int32", "give dtype 'uint8' or 'uint16'"),
        ("depth", "float16", "target kind 'depth' cannot be stored as 'float16': give dtype 'float32'"),
        ("depth_valid", "bool", "give dtype 'uint8'"),
        ("window", "int64", "give dtype 'int32'"),
        ("tokens", "uint8", "feature kind 'tokens' cannot be stored as 'uint8': give dtype 'float16' or 'float32'"),
    ],
)
def test_a_wrong_dtype_is_refused_in_one_line_before_anything_is_written(tmp_path, kind, dtype, says):
    cache = open_cache(tmp_path / "c.zarr", "a")
    meta = ensure_split(cache, "mosaic", "val", np.array(["a", "b"]), np.zeros(2, np.int64), ["image"], "m")
    rows = {"tokens": np.zeros((2, 16, 16)), kind: np.zeros((2, 7) if kind == "window" else (2, 56, 56))}
    provs = provenances(meta, rows, {"tokens": "float16", kind: dtype})
    with pytest.raises(SchemaMismatchError, match=re.escape(says)) as exc:
        FeatureWriter(cache, "pix", "mosaic", "val", provs).prepare()
    assert "\n" not in str(exc.value)
    assert open_cache(tmp_path / "c.zarr").kinds("pix", "mosaic", "val") == []


def test_target_values_the_dtype_cannot_hold_are_refused_never_wrapped(tmp_path):
    cache = open_cache(tmp_path / "c.zarr", "a")
    rows = seg_rows(8)
    meta = ensure_split(
        cache, "mosaic", "val", np.array([f"m{i}" for i in range(8)]), np.zeros(8, np.int64), ["i"], "m"
    )
    w = FeatureWriter(cache, "pix", "mosaic", "val", provenances(meta, rows, SEG_DTYPES)).prepare()
    for bad, says in ((rows["mask"].astype(np.int64) + 250, r"values 25\d\.\.260 outside uint8's 0\.\.255"),
                      (rows["mask"] - 0.5, "non-integer values")):  # fmt: skip
        with pytest.raises(SchemaMismatchError, match=says):
            w.write_chunk(0, {**{k: x[:4] for k, x in rows.items()}, "mask": bad[:4]}, np.ones(4, bool))
    assert w.pending_chunks() == [0, 1]  # nothing marked done
    w.release()


def test_a_resume_with_another_geometry_or_dense_info_is_refused_then_overwritten(tmp_path):
    """The geometry and the dense info join a dense kind's identity: masks of the same shape
    cut another way (another window stride, view seed, label reduction) never resume a group."""
    from featcache.errors import ProvenanceMismatchError

    rows = seg_rows(8)
    write_dense(tmp_path / "c.zarr", rows, SEG_DTYPES)
    other = Geometry("resize", (56, 56), (4, 4), (56, 56), {"interpolation": "nearest"})
    reduced = DenseInfo("seg", num_classes=11, ignore_index=255, reduce_zero_label=True)
    for kw, says in (({"geometry": other}, "mask.geometry"), ({"info": reduced}, "mask.dense")):
        with pytest.raises(ProvenanceMismatchError, match=re.escape(says)):
            write_dense(tmp_path / "c.zarr", rows, SEG_DTYPES, **kw)
    cache = open_cache(tmp_path / "c.zarr", "a")
    meta = cache.split_meta("mosaic", "val")
    w = FeatureWriter(cache, "pix", "mosaic", "val", provenances(meta, rows, SEG_DTYPES, geometry=other))
    w.prepare(overwrite=True).release()
    assert (
        open_cache(tmp_path / "c.zarr").provenance("pix", "mosaic", "val", "mask").extra["geometry"] == other.record()
    )


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 13),
    chunk=st.integers(1, 5),
    dtype=st.sampled_from(["uint8", "uint16"]),
    seed=st.integers(0, 2**16),
)
def test_mask_roundtrip_hypothesis(tmp_path_factory, n, chunk, dtype, seed):
    """Any masks (ids over the dtype's whole range) with any chunking and invalid rows read back
    exactly, invalid rows 0, and verify clean."""
    from featcache.store.verify import verify

    rng = np.random.default_rng(seed)
    top = np.iinfo(dtype).max
    rows = {"tokens": rng.normal(size=(n, 16, 4)), "mask": rng.integers(0, top + 1, (n, 5, 3), dtype=np.int64)}
    valid = rng.random(n) > 0.3
    path = tmp_path_factory.mktemp("hyp") / "c.zarr"
    cache = open_cache(path, "a")
    meta = ensure_split(
        cache, "mosaic", "val", np.array([f"m{i}" for i in range(n)]), np.zeros(n, np.int64), ["i"], "m"
    )
    geom = Geometry("resize", (20, 12), (4, 4), (5, 3))
    provs = provenances(meta, rows, {"tokens": "float32", "mask": dtype}, geometry=geom, chunk=chunk)
    w = FeatureWriter(cache, "pix", "mosaic", "val", provs).prepare()
    for i in w.pending_chunks():
        s, e = w.chunk_range(i)
        w.write_chunk(i, {k: x[s:e] for k, x in rows.items()}, valid[s:e])
    w.mark_complete()
    got = open_cache(path).load("pix", "mosaic", "val", kind="mask", dtype=None)
    np.testing.assert_array_equal(got.X, np.where(valid[:, None, None], rows["mask"], 0).astype(dtype))
    assert verify(str(path)) == []


# ---------------------------------------------------------------- the store's guarantees on targets
#: a writer process: the kinds of an .npz into one dense group, chunk by chunk (``pause`` seconds
#: after each), resuming what a killed run left
_WRITER = """
import json, sys, time
import numpy as np
from featcache.core.dense import DenseInfo, Geometry
from featcache.store import FeatureWriter, ensure_split, make_provenance, open_cache
path, data, dtypes, pause = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
z = np.load(data)
rows = {k: z[k] for k in dtypes}
n = len(rows["tokens"])
cache = open_cache(path, "a")
meta = ensure_split(cache, "mosaic", "val", np.array([f"m{i}" for i in range(n)]), np.zeros(n, np.int64), ["image"], "m")
extra = {"geometry": Geometry("resize", (56, 56), (4, 4), (56, 56)).record(),
         "dense": DenseInfo("seg", num_classes=11, ignore_index=255).record()}
provs = {k: make_provenance(backbone="pix", dataset="mosaic", split="val", kind=k, dim=x.shape[1:], n=n,
                            dataset_fingerprint=meta.fingerprint, chunk_rows=4, dtype=dtypes[k], extra=dict(extra))
         for k, x in rows.items()}
w = FeatureWriter(cache, "pix", "mosaic", "val", provs).prepare()
valid = np.arange(n) % 13 != 7
for i in w.pending_chunks():
    s, e = w.chunk_range(i)
    w.write_chunk(i, {k: x[s:e] for k, x in rows.items()}, valid[s:e], ["unreadable"] * (e - s))
    time.sleep(pause)
w.mark_complete()
"""
GROUP = "features/pix/mosaic/val"


def _start(path, seg_data, pause: float = 0.0):
    import subprocess
    import sys

    argv = [sys.executable, "-c", _WRITER, str(path), seg_data[0], json.dumps(SEG_DTYPES), str(pause)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(path, seg_data, pause: float = 0.0) -> None:
    proc = _start(path, seg_data, pause)
    out = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, out[-3000:]


def _chunk_files(path) -> dict[str, bytes]:
    """Every chunk object of the group's arrays, by path (byte-identical groups: equal dicts)."""
    group = Path(path) / GROUP
    names = (*SEG_DTYPES, "valid", "error", "done")
    return {str(f.relative_to(group)): f.read_bytes() for a in names for f in sorted((group / a / "c").rglob("*")) if f.is_file()}  # fmt: skip


@pytest.fixture(scope="module")
def seg_reference(seg_data, tmp_path_factory):
    """The group written by one uninterrupted writer process, and its chunk objects."""
    path = tmp_path_factory.mktemp("ref") / "c.zarr"
    _finish(path, seg_data)
    return path, _chunk_files(path)


def _fresh_copy(seg_reference, tmp_path) -> Path:
    import shutil

    path = tmp_path / "c.zarr"
    shutil.copytree(seg_reference[0], path)
    return path


def _expect_rows(path, seg_data) -> None:
    want = stored(seg_data[1], SEG_DTYPES, VALID)
    for k in SEG_DTYPES:
        f = open_cache(path).load("pix", "mosaic", "val", kind=k, dtype=None)
        np.testing.assert_array_equal(f.valid, VALID)
        np.testing.assert_array_equal(f.X, want[k])


@pytest.mark.slow
def test_kill9_mid_write_then_resume_is_byte_identical(seg_data, seg_reference, tmp_path):
    """A writer process SIGKILLed at a random moment after some chunks, then the same writer
    again: every chunk object of the masks, tables and tokens equals the uninterrupted run's."""
    import random

    from kill9 import kill_when, marked_chunks

    from featcache.store.verify import verify

    path = tmp_path / "c.zarr"
    proc = _start(path, seg_data, pause=0.01)
    marks = kill_when(proc, lambda: marked_chunks(path / GROUP), 3, random.Random(0).uniform(0, 0.03))
    assert marks < N // CHUNK, "the writer finished before the kill"
    _finish(path, seg_data)
    assert _chunk_files(path) == seg_reference[1]
    assert verify(str(path)) == []
    _expect_rows(path, seg_data)


def _flip(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    f.write_bytes(bytes(raw))


def test_a_flipped_byte_in_a_mask_chunk_is_named_refused_and_recomputed_byte_identical(
    seg_data, seg_reference, tmp_path
):
    from featcache.store.verify import verify

    path = _fresh_copy(seg_reference, tmp_path)
    _flip(path / GROUP / "mask/c/3/0/0")
    with pytest.raises(CorruptStoreError, match=re.escape("mask chunk(s) [3] corrupt")):
        open_cache(path).load("pix", "mosaic", "val", kind="mask")
    with pytest.raises(CorruptStoreError, match=re.escape("mask chunk(s) [3] corrupt")):
        list(open_cache(path).iter_blocks("pix", "mosaic", "val", "mask"))
    problems = verify(str(path))
    assert any("val/mask: chunk 3 (rows 12-15)" in p for p in problems), problems
    np.testing.assert_array_equal(  # the group's other kinds still read
        open_cache(path).load("pix", "mosaic", "val", kind="full_mask", dtype=None).X,
        stored(seg_data[1], SEG_DTYPES, VALID)["full_mask"],
    )
    verify(str(path), repair=True)  # marks chunk 3 for recomputation
    assert open_cache(path).chunk_status("pix", "mosaic", "val")["done"].sum() == N // CHUNK - 1
    _finish(path, seg_data)
    assert _chunk_files(path) == seg_reference[1]
    assert verify(str(path)) == []


def test_a_deleted_mask_document_is_rebuilt_byte_identical(seg_reference, tmp_path):
    """``verify --repair`` rebuilds an integer target's zarr.json (its dtype, fill value 0, row
    chunks) from the group metadata and the kept provenance; the recorded digest accepts it."""
    from featcache.store.verify import verify

    path = _fresh_copy(seg_reference, tmp_path)
    doc = path / GROUP / "mask/zarr.json"
    good = doc.read_bytes()
    doc.unlink()
    assert any("val/mask/zarr.json" in p and "missing" in p for p in verify(str(path)))
    verify(str(path), repair=True)
    assert doc.read_bytes() == good
    assert verify(str(path)) == []


def test_a_lost_integer_target_chunk_is_named_though_it_reads_as_zeros(seg_data, seg_reference, tmp_path):
    """An integer target has no NaN: its lost chunk object reads as 0, a legal class id, so the
    store asks whether the object exists (load eager and lazy, streaming, verify)."""
    from featcache.store.verify import verify

    path = _fresh_copy(seg_reference, tmp_path)
    kind = "mask"
    (path / GROUP / kind / "c/5/0/0").unlink()
    says = re.escape(f"chunk files missing for {kind}: [5]")
    for lazy in (False, True):
        with pytest.raises(CorruptStoreError, match=says):
            open_cache(path).load("pix", "mosaic", "val", kind=kind, lazy=lazy)
    with pytest.raises(CorruptStoreError, match=says):
        list(open_cache(path).iter_blocks("pix", "mosaic", "val", kind))
    assert any(f"val/{kind}: chunk objects missing for marked chunks [5]" in p for p in verify(str(path)))
    verify(str(path), repair=True)
    _finish(path, seg_data)
    assert _chunk_files(path) == seg_reference[1]
    _expect_rows(path, seg_data)


def test_swapped_mask_chunk_folders_between_two_groups_are_refused(seg_data, seg_reference, tmp_path):
    """Two backbones' mask chunk folders exchanged (same shapes, other images' masks) never load
    as the other group's targets."""
    import os

    from featcache.store.verify import verify

    path = _fresh_copy(seg_reference, tmp_path)
    other = seg_rows(N, offset=4 * N)  # other garments
    write_dense(path, other, SEG_DTYPES, backbone="pix2")
    a, b = (path / f"features/{bb}/mosaic/val/mask/c" for bb in ("pix", "pix2"))
    os.rename(a, a.with_name("swap"))
    os.rename(b, a)
    os.rename(a.with_name("swap"), b)
    for bb in ("pix", "pix2"):
        with pytest.raises(CorruptStoreError, match=f"{bb}/mosaic/val"):
            open_cache(path).load(bb, "mosaic", "val", kind="mask")
    problems = verify(str(path))
    assert any("features/pix/mosaic/val/mask: " in p for p in problems), problems  # its invalid rows now hold masks
    assert any("features/pix2/mosaic/val/mask: its chunk objects are not the ones" in p for p in problems), problems


@pytest.mark.slow
def test_target_loads_during_a_write_are_snapshots(seg_data, tmp_path):
    """Loads of the masks in a loop while a writer process writes the group: every row a load
    calls valid holds its written mask, invalid rows hold 0, a complete load has every row."""
    from featcache.errors import FeatcacheError

    path = tmp_path / "c.zarr"
    proc = _start(path, seg_data, pause=0.03)
    want = stored(seg_data[1], SEG_DTYPES, VALID)["mask"]
    loads, early = 0, []
    deadline = time.monotonic() + 300
    while (proc.poll() is None or loads == 0) and proc.poll() in (None, 0) and time.monotonic() < deadline:
        try:
            f = open_cache(path).load("pix", "mosaic", "val", kind="mask", allow_partial=True, dtype=None)
        except FeatcacheError as exc:  # the root or group being created (named), never a wrong row
            early.append(str(exc))
            continue
        assert (f.valid <= VALID).all()
        np.testing.assert_array_equal(f.X[f.valid], want[f.valid])
        assert (f.X[~f.valid] == 0).all()
        assert not f.complete or (f.valid == VALID).all()
        loads += 1
    assert proc.wait(timeout=300) == 0
    named = ("no feature cache at", "not a featcache store", "being created", "no features for", "is not in", "changed")
    assert [e for e in early if not any(m in e for m in named)] == []
    assert loads >= 2
    _expect_rows(path, seg_data)
