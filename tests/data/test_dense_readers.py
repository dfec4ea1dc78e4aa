"""The dense readers (``ade20k:``, ``voc:``, ``cityscapes:``, ``nyuv2:``, ``segfolder:``) on small
real files written in each dataset's own layout: scikit-image's photos (JPEG where the dataset
ships JPEG) with masks made from their pixels; the ids, sizes and target values (ADE20K's
reduce-zero-label, VOC's palette indices, Cityscapes' trainIds, NYU's millimetres and .mat
axes) and the one-line errors."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from PIL import Image

from featcache.core.dense import DenseInfo
from featcache.data.readers import open_dataset
from featcache.data.readers.dense import (
    ADE20K_CLASSES,
    CITYSCAPES_CLASSES,
    VOC_CLASSES,
    MaskFiles,
    read_depth_png,
    read_mask,
)
from featcache.errors import DataError


def _photos(n: int) -> list[np.ndarray]:
    """``n`` real RGB photos of different sizes (scikit-image's bundled images, reduced)."""
    from skimage import data

    srcs = (data.astronaut, data.chelsea, data.coffee, data.rocket, data.immunohistochemistry)
    return [np.asarray(Image.fromarray(srcs[i % len(srcs)]()).reduce(10 + i)) for i in range(n)]


def _ids_of(photo: np.ndarray, top: int) -> np.ndarray:
    """A mask made from a photo's pixels: its grey level cut into ids ``0..top``."""
    grey = photo.astype(np.int64).sum(2) // 3
    return (grey * (top + 1) // 256).astype(np.uint8)


def _save(path: Path, a: np.ndarray, **kw) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(a).save(path, **kw)


def _check_rows(s, photos_by_id: dict[str, Path], masks: dict[str, np.ndarray]) -> None:
    """Every row: the photo as DINOv3 decodes it (PIL ``convert("RGB")``, no EXIF rotation) and
    the target at the photo's own size with the expected ids."""
    assert sorted(s.ids.tolist()) == sorted(photos_by_id)
    assert (s.labels == 0).all()
    for i, rid in enumerate(s.ids.tolist()):
        im = s.load(i)
        with Image.open(photos_by_id[rid]) as ref:
            assert np.array_equal(np.asarray(im), np.asarray(ref.convert("RGB")))
        t = s.extra["target"](i)
        assert t.shape == (im.size[1], im.size[0])
        assert t.dtype == np.uint8
        assert np.array_equal(t, masks[rid])


# --------------------------------------------------------------------------- ADE20K
def _write_ade(root: Path) -> tuple[dict, dict]:
    photos, files, want = _photos(5), {}, {}
    for j, ph in enumerate(photos):
        folder, split = ("training", "train") if j < 3 else ("validation", "val")
        stem = f"ADE_{split}_{j:08d}"
        raw = _ids_of(ph, 150)  # 0 (other) .. 150
        _save(root / "ADEChallengeData2016" / "images" / folder / f"{stem}.jpg", ph, quality=90)
        _save(root / "ADEChallengeData2016" / "annotations" / folder / f"{stem}.png", raw)
        files[stem] = root / "ADEChallengeData2016" / "images" / folder / f"{stem}.jpg"
        want[stem] = np.where(raw == 0, 255, raw.astype(np.int64) - 1).astype(np.uint8)
    return files, want


def test_ade20k_reads_the_challenge_layout_with_reduce_zero_label(tmp_path):
    files, want = _write_ade(tmp_path)
    for arg in (tmp_path, tmp_path / "ADEChallengeData2016"):  # the folder or the one holding it
        got = open_dataset(f"ade20k:{arg}")
        assert list(got) == ["train", "val"]
        assert (len(got["train"]), len(got["val"])) == (3, 2)
        info: DenseInfo = got["val"].extra["dense"]
        assert (info.task, info.num_classes, info.ignore_index, info.reduce_zero_label) == ("seg", 150, 255, True)
        assert got["val"].class_names == list(ADE20K_CLASSES)
        assert ADE20K_CLASSES[:3] == ("wall", "building", "sky")
        for s in got.values():
            _check_rows(s, {k: v for k, v in files.items() if k in s.ids}, want)
    assert 255 in np.concatenate([m.ravel() for m in want.values()])  # some 0 pixels became ignore


def test_ade20k_refuses_an_image_without_its_annotation(tmp_path):
    _write_ade(tmp_path)
    (tmp_path / "ADEChallengeData2016" / "annotations" / "training" / "ADE_train_00000001.png").unlink()
    with pytest.raises(DataError, match=r"1 image\(s\) without a mask \(ADE_train_00000001\)") as err:
        open_dataset(f"ade20k:{tmp_path}")
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match="ADEChallengeData2016/images"):
        open_dataset(f"ade20k:{tmp_path / 'nothing'}")


def test_dense_images_keep_their_stored_orientation(tmp_path):
    """An EXIF rotation is not applied (DINOv3 reads the stored pixels): the mask stays paired."""
    files, _ = _write_ade(tmp_path)
    path = files["ADE_val_00000003"]
    with Image.open(path) as im:
        exif, pixels = im.getexif(), np.asarray(im.convert("RGB"))
    exif[0x0112] = 6  # rotate 90 degrees on display
    Image.fromarray(pixels).save(path, exif=exif, quality=95)
    s = open_dataset(f"ade20k:{tmp_path}")["val"]
    i = s.ids.tolist().index("ADE_val_00000003")
    assert s.load(i).size[::-1] == s.extra["target"](i).shape


# --------------------------------------------------------------------------- VOC
def _voc_palette() -> list[int]:
    """VOC's colour map (VOCdevkit's labelcolormap: bit-interleaved class ids)."""
    pal = []
    for k in range(256):
        r = g = b = 0
        c = k
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        pal += [r, g, b]
    return pal


def _write_voc(root: Path) -> tuple[Path, dict, dict]:
    base = root / "VOCdevkit" / "VOC2012"
    photos, files, want = _photos(4), {}, {}
    for j, ph in enumerate(photos):
        rid = f"2007_{j:06d}"
        ids = _ids_of(ph, 20)
        ids[:2, :] = 255  # a boundary band, as VOC marks object outlines
        mask = Image.frombytes("P", (ids.shape[1], ids.shape[0]), ids.tobytes())
        mask.putpalette(_voc_palette())
        (base / "SegmentationClass").mkdir(parents=True, exist_ok=True)
        mask.save(base / "SegmentationClass" / f"{rid}.png")
        _save(base / "JPEGImages" / f"{rid}.jpg", ph, quality=90)
        files[rid], want[rid] = base / "JPEGImages" / f"{rid}.jpg", ids
    lists = base / "ImageSets" / "Segmentation"
    lists.mkdir(parents=True)
    (lists / "train.txt").write_text("2007_000000\n2007_000001\n2007_000002\n")
    (lists / "val.txt").write_text("2007_000003\n")
    return base, files, want


def test_voc_reads_palette_indices_not_colours(tmp_path):
    base, files, want = _write_voc(tmp_path)
    with Image.open(base / "SegmentationClass" / "2007_000000.png") as m:
        assert m.mode == "P"
        assert np.asarray(m.convert("RGB")).max() > 20
    for arg in (tmp_path, tmp_path / "VOCdevkit", base):
        got = open_dataset(f"voc:{arg}")
        assert got["train"].ids.tolist() == ["2007_000000", "2007_000001", "2007_000002"]  # list order
        assert got["val"].ids.tolist() == ["2007_000003"]
        info = got["train"].extra["dense"]
        assert (info.num_classes, info.ignore_index, info.reduce_zero_label) == (21, 255, False)
        assert got["train"].class_names == list(VOC_CLASSES)
        assert VOC_CLASSES[15] == "person"
        for s in got.values():
            _check_rows(s, {k: files[k] for k in s.ids.tolist()}, want)


def test_voc_refuses_a_listed_id_without_its_mask(tmp_path):
    base, _, _ = _write_voc(tmp_path)
    (base / "SegmentationClass" / "2007_000001.png").unlink()
    with pytest.raises(DataError, match=r"lack JPEGImages/<id>.jpg or SegmentationClass/<id>.png \(2007_000001\)"):
        open_dataset(f"voc:{tmp_path}")
    with pytest.raises(DataError, match="is not a VOC2012 folder"):
        open_dataset(f"voc:{tmp_path / 'elsewhere'}")


# --------------------------------------------------------------------------- Cityscapes
def _write_cityscapes(root: Path, kind: str = "labelTrainIds") -> tuple[dict, dict]:
    photos, files, want = _photos(4), {}, {}
    for j, ph in enumerate(photos):
        split, city = ("train", "aachen") if j < 2 else ("val", "lindau") if j == 2 else ("test", "berlin")
        frame = f"{city}_{j:06d}_000019"
        ids = _ids_of(ph, 18)
        ids[-3:, :] = 255  # the ego vehicle (ignored)
        _save(root / "leftImg8bit" / split / city / f"{frame}_leftImg8bit.png", ph)
        _save(root / "gtFine" / split / city / f"{frame}_gtFine_{kind}.png", ids)
        files[f"{city}/{frame}"] = root / "leftImg8bit" / split / city / f"{frame}_leftImg8bit.png"
        want[f"{city}/{frame}"] = ids
    return files, want


def test_cityscapes_reads_train_ids(tmp_path):
    files, want = _write_cityscapes(tmp_path)
    got = open_dataset(f"cityscapes:{tmp_path}")
    assert list(got) == ["train", "val", "test"]
    assert got["train"].ids.tolist() == ["aachen/aachen_000000_000019", "aachen/aachen_000001_000019"]
    info = got["val"].extra["dense"]
    assert (info.num_classes, info.ignore_index) == (19, 255)
    assert got["val"].class_names == list(CITYSCAPES_CLASSES)
    for s in got.values():
        _check_rows(s, {k: files[k] for k in s.ids.tolist()}, want)


def test_cityscapes_with_only_label_ids_says_how_to_make_train_ids(tmp_path):
    _write_cityscapes(tmp_path, kind="labelIds")
    with pytest.raises(DataError, match="csCreateTrainIdLabelImgs") as err:
        open_dataset(f"cityscapes:{tmp_path}")
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- segfolder
def _write_segfolder(root: Path, top: int = 6, dtype=np.uint8) -> dict:
    photos, want = _photos(5), {}
    for j, ph in enumerate(photos):
        split = "train" if j < 3 else "val"
        ids = _ids_of(ph, min(top, 255)).astype(dtype)
        if dtype == np.uint16:
            ids[0, 0] = top
        _save(root / split / "images" / f"p{j}.png", ph)
        _save(root / split / "masks" / f"p{j}.png", ids)
        want[f"p{j}"] = ids
    return want


def test_segfolder_classes_from_the_masks_or_classes_txt(tmp_path):
    want = _write_segfolder(tmp_path)
    got = open_dataset(f"segfolder:{tmp_path}")
    assert list(got) == ["train", "val"]
    assert got["train"].ids.tolist() == ["p0", "p1", "p2"]
    top = max(int(m.max()) for m in want.values())
    assert got["val"].class_names == [str(k) for k in range(top + 1)]
    assert got["val"].extra["dense"].ignore_index == 255
    for s in got.values():
        _check_rows(s, {k: tmp_path / s.split / "images" / f"{k}.png" for k in s.ids.tolist()}, want)
    names = [f"c{k}" for k in range(9)]
    (tmp_path / "classes.txt").write_text("\n".join(names) + "\n")
    got = open_dataset(f"segfolder:{tmp_path}")
    assert got["train"].class_names == names
    assert got["train"].extra["dense"].num_classes == 9


def test_segfolder_reads_16bit_ids(tmp_path):
    want = _write_segfolder(tmp_path, top=300, dtype=np.uint16)
    s = open_dataset(f"segfolder:{tmp_path}")["train"]
    assert s.extra["dense"].num_classes == 301
    assert s.extra["dense"].mask_dtype == "uint16"
    t = s.extra["target"](0)
    assert t.dtype == np.uint16
    assert t[0, 0] == 300
    assert np.array_equal(t, want["p0"])
    (tmp_path / "classes.txt").write_text("a\nb\nc\n")  # 3 classes: uint8 masks, id 300 does not fit
    s = open_dataset(f"segfolder:{tmp_path}")["train"]
    with pytest.raises(DataError, match=r"p0.png holds id 300, outside 0..255 \(uint8\)"):
        s.extra["target"](0)


def test_segfolder_refuses_unmatched_stems_and_colour_masks(tmp_path):
    _write_segfolder(tmp_path)
    (tmp_path / "train" / "masks" / "p1.png").rename(tmp_path / "train" / "masks" / "q1.png")
    with pytest.raises(DataError, match=r"1 image\(s\) without a mask \(p1\) and 1 mask\(s\) without an image \(q1\)"):
        open_dataset(f"segfolder:{tmp_path}")
    (tmp_path / "train" / "masks" / "q1.png").rename(tmp_path / "train" / "masks" / "p1.png")
    (tmp_path / "classes.txt").write_text("a\nb\nc\nd\ne\nf\ng\n")
    _save(tmp_path / "train" / "masks" / "p1.png", _photos(2)[1])  # an RGB mask
    s = open_dataset(f"segfolder:{tmp_path}")["train"]
    with pytest.raises(DataError, match="is a RGB image; a mask is a single-channel PNG of class ids"):
        s.extra["target"](1)


# --------------------------------------------------------------------------- NYU Depth v2
def _depth_mm(ph: np.ndarray) -> np.ndarray:
    """Millimetres made from a photo's pixels (0.5-9.7 m), with an invalid (0) corner."""
    mm = (500 + ph.astype(np.int64).sum(2) * 12).astype(np.uint16)
    mm[:3, :4] = 0
    return mm


def test_nyuv2_folder_reads_millimetres_as_metres(tmp_path):
    photos, want = _photos(4), {}
    for j, ph in enumerate(photos):
        split = "train" if j < 3 else "test"
        _save(tmp_path / split / "rgb" / f"{j:05d}.jpg", ph, quality=90)
        _save(tmp_path / split / "depth" / f"{j:05d}.png", _depth_mm(ph))
        want[f"{j:05d}"] = _depth_mm(ph)
    got = open_dataset(f"nyuv2:{tmp_path}")
    assert list(got) == ["train", "test"]
    assert got["test"].ids.tolist() == ["00003"]
    info = got["train"].extra["dense"]
    assert (info.task, info.depth_range, info.depth_scale) == ("depth", (0.001, 10.0), 1000.0)
    for s in got.values():
        for i, rid in enumerate(s.ids.tolist()):
            d = s.extra["target"](i)
            assert d.dtype == np.float32
            assert d.shape == s.load(i).size[::-1]
            assert np.array_equal(d, want[rid].astype(np.float32) / np.float32(1000))  # float32, as DINOv3 divides
            assert (d[:3, :4] == 0).all()
    assert float(got["train"].extra["target"](0)[5, 5]) == pytest.approx(want["00000"][5, 5] / 1000, abs=1e-6)


def test_nyuv2_folder_refuses_8bit_depth(tmp_path):
    ph = _photos(1)[0]
    _save(tmp_path / "train" / "rgb" / "a.png", ph)
    _save(tmp_path / "train" / "depth" / "a.png", ph[..., 0])
    s = open_dataset(f"nyuv2:{tmp_path}")["train"]
    with pytest.raises(DataError, match="depth PNGs are 16-bit"):
        s.extra["target"](0)


def _nyu_arrays(n: int) -> tuple[np.ndarray, np.ndarray]:
    """MATLAB-order arrays as NYU's labeled .mat holds them: images [H, W, 3, N] uint8, depths
    [H, W, N] float32 metres (the same photo size for all, as NYU's 480 x 640)."""
    from skimage import data

    base = np.asarray(Image.fromarray(data.astronaut()).resize((20, 15)))
    imgs = np.stack([np.roll(base, 3 * k, axis=1) for k in range(n)], axis=3)
    depths = np.stack([_depth_mm(imgs[..., k]) / 1000.0 for k in range(n)], axis=2).astype(np.float32)
    return imgs, depths


def _write_splits(folder: Path, train: list[int], test: list[int]) -> None:
    from scipy.io import savemat

    savemat(folder / "splits.mat", {"trainNdxs": np.array(train)[:, None], "testNdxs": np.array(test)[:, None]})


def _check_mat(got, imgs: np.ndarray, depths: np.ndarray) -> None:
    assert got["train"].ids.tolist() == ["0001", "0003", "0004"]
    assert got["test"].ids.tolist() == ["0002", "0005"]
    for s in got.values():
        for i, rid in enumerate(s.ids.tolist()):
            k = int(rid) - 1  # ids are the 1-based MATLAB indices of splits.mat
            assert np.array_equal(np.asarray(s.load(i)), imgs[..., k])
            assert np.array_equal(s.extra["target"](i), depths[..., k])
    pickle.loads(pickle.dumps(got["test"].extra["target"]))(0)  # a used loader pickles without its file


def test_nyuv2_mat_v5_with_the_official_splits(tmp_path):
    from scipy.io import savemat

    imgs, depths = _nyu_arrays(5)
    savemat(tmp_path / "nyu_depth_v2_labeled.mat", {"images": imgs, "depths": depths})
    with pytest.raises(DataError, match=r"splits\.mat is missing; put splits\.mat .* beside the \.mat"):
        open_dataset(f"nyuv2:{tmp_path / 'nyu_depth_v2_labeled.mat'}")
    _write_splits(tmp_path, [1, 3, 4], [2, 5])
    _check_mat(open_dataset(f"nyuv2:{tmp_path / 'nyu_depth_v2_labeled.mat'}"), imgs, depths)
    _write_splits(tmp_path, [1, 3, 9], [2, 5])
    with pytest.raises(DataError, match=r"train index 9 is outside the \.mat's 5 images"):
        open_dataset(f"nyuv2:{tmp_path / 'nyu_depth_v2_labeled.mat'}")


def test_nyuv2_mat_v73_is_hdf5_with_transposed_axes(tmp_path):
    """MATLAB v7.3 writes HDF5 after a 512-byte header, each array with its axes reversed
    (``images`` [N, 3, W, H]); without h5py the reader says what to install."""
    imgs, depths = _nyu_arrays(5)
    path = tmp_path / "nyu_depth_v2_labeled.mat"
    _write_splits(tmp_path, [1, 3, 4], [2, 5])
    try:
        import h5py
    except ImportError:
        path.write_bytes(b"MATLAB 7.3 MAT-file".ljust(512, b" ") + b"\x89HDF\r\n\x1a\n" + bytes(64))
        with pytest.raises(DataError, match=r"MATLAB v7.3 \(HDF5\) file: reading it needs h5py \(pip install h5py\)"):
            open_dataset(f"nyuv2:{path}")
        return
    with h5py.File(path, "w", userblock_size=512) as f:
        f["images"], f["depths"] = imgs.transpose(3, 2, 1, 0), depths.transpose(2, 1, 0)
    _check_mat(open_dataset(f"nyuv2:{path}"), imgs, depths)


def test_dense_loaders_pickle(tmp_path):
    """DataLoader workers get the loaders by pickle: every reader's loaders survive it."""
    _files, want = _write_ade(tmp_path / "ade")
    s = open_dataset(f"ade20k:{tmp_path / 'ade'}")["train"]
    image, target = pickle.loads(pickle.dumps((s.loader, s.extra["target"])))
    assert np.array_equal(target(0), want[s.ids[0]])
    assert image(0).size == s.load(0).size


def test_nyuv2_dinov3_lists_in_the_references_order(tmp_path):
    """DINOv3's NYU root: ``nyu_{train,test}.txt`` lines ``/image /depth focal``, rows sorted as
    dinov3/data/datasets/nyu.py sorts the lines."""
    photos = _photos(3)
    lines = []
    for j, ph in enumerate(photos):
        room = f"{'kitchen' if j != 1 else 'bathroom'}_{j:04d}"
        _save(tmp_path / "sync" / room / "rgb_00000.jpg", ph, quality=90)
        _save(tmp_path / "sync" / room / "sync_depth_00000.png", _depth_mm(ph))
        lines.append(f"/sync/{room}/rgb_00000.jpg /sync/{room}/sync_depth_00000.png 518.8579\n")
    (tmp_path / "nyu_train.txt").write_text("".join(lines))
    (tmp_path / "nyu_test.txt").write_text(lines[0])
    got = open_dataset(f"nyuv2:{tmp_path}")
    assert got["train"].ids.tolist() == [
        "sync/bathroom_0001/rgb_00000.jpg",
        "sync/kitchen_0000/rgb_00000.jpg",
        "sync/kitchen_0002/rgb_00000.jpg",
    ]
    assert got["test"].ids.tolist() == ["sync/kitchen_0000/rgb_00000.jpg"]
    d = got["train"].extra["target"](0)
    assert np.array_equal(d, _depth_mm(photos[1]).astype(np.float32) / np.float32(1000))
    (tmp_path / "sync" / "kitchen_0002" / "sync_depth_00000.png").unlink()
    with pytest.raises(DataError, match=r"1 listed image\(s\) or depth map\(s\) missing \(sync/kitchen_0002"):
        open_dataset(f"nyuv2:{tmp_path}")


def test_a_target_of_another_size_than_its_image_is_refused(tmp_path):
    _write_segfolder(tmp_path)
    _save(tmp_path / "train" / "masks" / "p1.png", np.zeros((7, 9), np.uint8))
    s = open_dataset(f"segfolder:{tmp_path}")["train"]
    h, w = s.load(1).size[::-1]
    with pytest.raises(DataError, match=rf"p1.png is 7x9 \(h x w\) but its image .*p1.png is {h}x{w}"):
        s.extra["target"](1)


_shapes = st.tuples(st.integers(1, 12), st.integers(1, 12))


@settings(max_examples=30, deadline=None)
@given(st.data(), st.sampled_from(["L", "P", "I;16"]))
def test_mask_png_round_trip(tmp_path_factory, data, mode):
    """Any id map saved as an L, P (palette) or 16-bit PNG reads back as the same ids; through
    ADE20K's reduction every 0 becomes 255 and every other id k becomes k-1."""
    dtype = np.uint16 if mode == "I;16" else np.uint8
    ids = data.draw(arrays(dtype, _shapes, elements=st.integers(0, 700 if mode == "I;16" else 255)))
    path = tmp_path_factory.mktemp("m") / "m.png"
    if mode == "P":  # with its palette, as VOC's (Pillow remaps the indices of a P image without one)
        im = Image.frombytes("P", (ids.shape[1], ids.shape[0]), ids.tobytes())
        im.putpalette(_voc_palette())
    else:
        im = Image.fromarray(ids)
    im.save(path)
    assert np.array_equal(read_mask(path, "uint16"), ids)
    if mode != "I;16":
        got = MaskFiles([path], "uint8", reduce_zero=True)(0)
        assert np.array_equal(got, np.where(ids == 0, 255, np.where(ids == 255, 255, ids.astype(np.int64) - 1)))


@settings(max_examples=30, deadline=None)
@given(arrays(np.uint16, _shapes))
def test_depth_png_round_trip(tmp_path_factory, mm):
    """A 16-bit depth PNG reads back as its millimetres / 1000 in float32, 0 kept as 0."""
    path = tmp_path_factory.mktemp("d") / "d.png"
    Image.fromarray(mm).save(path)
    d = read_depth_png(path)
    assert d.dtype == np.float32
    assert np.array_equal(d, mm.astype(np.float32) / np.float32(1000))
    assert np.array_equal(d == 0, mm == 0)
    assert np.all(np.abs(d.astype(np.float64) - mm / 1000.0) <= 1e-7 * np.maximum(mm / 1000.0, 1))
