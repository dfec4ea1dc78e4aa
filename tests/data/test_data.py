"""Data readers on real data: digits, Fashion-MNIST IDX, imagefolder and manifests of real PNGs."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from featcache.data.decode import to_rgb
from featcache.data.readers import open_dataset, select_splits
from featcache.data.readers.folders import FASHION_MNIST_CLASSES, read_idx
from featcache.errors import DataError

FMNIST = "/usr/share/datasets/fashion-mnist"


@pytest.fixture(scope="module")
def fmnist_arrays():
    return read_idx(f"{FMNIST}/t10k-images-idx3-ubyte.gz"), read_idx(f"{FMNIST}/t10k-labels-idx1-ubyte.gz")


def test_digits_split_is_deterministic_and_stratified():
    a, b = open_dataset("digits"), open_dataset("digits")
    assert len(a["train"]) == 1347
    assert len(a["test"]) == 450
    assert a["train"].ids.tolist() == b["train"].ids.tolist()
    assert not set(a["train"].ids) & set(a["test"].ids)
    tr = np.bincount(a["train"].labels) / len(a["train"])
    te = np.bincount(a["test"].labels) / len(a["test"])
    assert np.abs(tr - te).max() < 0.01
    img = a["test"].load(0)
    assert img.mode == "L"
    assert img.size == (8, 8)
    assert a["train"].class_names == [str(i) for i in range(10)]


def test_fashion_mnist_reader(fmnist_arrays):
    ds = open_dataset("fashion-mnist")
    assert len(ds["train"]) == 60000
    assert len(ds["test"]) == 10000
    assert ds["test"].class_names == list(FASHION_MNIST_CLASSES)
    images, labels = fmnist_arrays
    np.testing.assert_array_equal(ds["test"].labels, labels)
    img = ds["test"].load(7)
    assert img.mode == "L"
    assert img.size == (28, 28)
    np.testing.assert_array_equal(np.asarray(img), images[7])
    assert ds["test"].ids[7] == "test-00007"


def _write_pngs(root, images, labels, names, n=12):
    paths = []
    for i in range(n):
        c = names[labels[i]].replace("/", "-")
        p = root / c / f"img{i:03d}.png"
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i]).save(p)
        paths.append(p)
    return paths


def test_imagefolder_flat_and_split(tmp_path, fmnist_arrays):
    images, labels = fmnist_arrays
    names = list(FASHION_MNIST_CLASSES)
    _write_pngs(tmp_path / "flat", images, labels, names)
    ds = open_dataset(f"imagefolder:{tmp_path / 'flat'}")
    assert list(ds) == ["all"]
    s = ds["all"]
    assert len(s) == 12
    assert s.dataset == "flat"
    assert s.class_names == sorted({names[labels[i]].replace("/", "-") for i in range(12)})
    i = s.ids.tolist().index(next(x for x in s.ids if x.endswith("img000.png")))
    assert s.class_names[s.labels[i]] == names[labels[0]].replace("/", "-")
    np.testing.assert_array_equal(np.asarray(s.load(i).convert("RGB"))[..., 1], images[0])
    # split folders
    _write_pngs(tmp_path / "sp" / "train", images, labels, names, n=10)
    _write_pngs(tmp_path / "sp" / "test", images[10:], labels[10:], names, n=5)
    ds = open_dataset(f"imagefolder:{tmp_path / 'sp'}", name="mine")
    assert sorted(ds) == ["test", "train"]
    assert len(ds["train"]) == 10
    assert len(ds["test"]) == 5
    assert ds["train"].class_names == ds["test"].class_names  # union of class folders
    assert ds["test"].dataset == "mine"
    with pytest.raises(DataError, match="do not exist in this dataset; available: \\['test', 'train'\\]"):
        select_splits(ds, ["val"])


def test_manifest_csv_and_parquet(tmp_path, fmnist_arrays):
    import polars as pl

    images, labels = fmnist_arrays
    names = list(FASHION_MNIST_CLASSES)
    paths = _write_pngs(tmp_path / "imgs", images, labels, names, n=8)
    df = pl.DataFrame(
        {
            "path": [str(p.relative_to(tmp_path)) for p in paths],
            "label": [names[labels[i]] for i in range(8)],
            "split": ["train"] * 6 + ["test"] * 2,
            "id": [f"sample-{i}" for i in range(8)],
        }
    )
    df.write_csv(tmp_path / "m.csv")
    ds = open_dataset(f"manifest:{tmp_path / 'm.csv'}")
    assert sorted(ds) == ["test", "train"]
    assert ds["train"].dataset == "m"
    assert ds["test"].ids.tolist() == ["sample-6", "sample-7"]
    assert ds["train"].class_names == sorted(set(df["label"].to_list()))
    np.testing.assert_array_equal(np.asarray(ds["test"].load(1).convert("RGB"))[..., 2], images[7])
    # parquet, integer labels, no split/id columns
    df2 = pl.DataFrame({"path": [str(p) for p in paths], "label": labels[:8].astype(np.int64)})
    df2.write_parquet(tmp_path / "m2.parquet")
    ds2 = open_dataset(f"manifest:{tmp_path / 'm2.parquet'}")
    assert list(ds2) == ["all"]
    np.testing.assert_array_equal(ds2["all"].labels, labels[:8])
    assert ds2["all"].ids[0] == str(paths[0])
    (tmp_path / "bad.csv").write_text("file,cls\na.png,1\n")
    with pytest.raises(DataError, match="lacks column\\(s\\) \\['path', 'label'\\]"):
        open_dataset(f"manifest:{tmp_path / 'bad.csv'}")


def test_bad_specs(tmp_path):
    with pytest.raises(DataError, match="unknown data spec"):
        open_dataset("cifar")
    with pytest.raises(DataError, match="does not exist"):
        open_dataset(f"imagefolder:{tmp_path / 'missing'}")
    with pytest.raises(DataError, match="not found"):
        open_dataset(f"manifest:{tmp_path / 'missing.csv'}")
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        open_dataset(f"fashion-mnist:{tmp_path / 'nope'}")
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte\.gz missing"):
        open_dataset(f"fashion-mnist:{tmp_path}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no class subfolders"):
        open_dataset(f"imagefolder:{tmp_path / 'empty'}")


def test_to_rgb_modes():
    from skimage import data

    cat = Image.fromarray(data.chelsea())
    assert to_rgb(cat.convert("L")).mode == "L"  # 8-bit grayscale kept: the transform converts after resizing
    assert to_rgb(cat.convert("CMYK")).mode == "RGB"
    assert to_rgb(cat.convert("P")).mode == "RGB"
    rgba = cat.convert("RGBA")
    assert to_rgb(rgba).mode == "RGB"
    g16 = Image.fromarray(np.asarray(cat.convert("L"), dtype=np.uint16) * 257)
    assert g16.mode == "I;16"
    out = np.asarray(to_rgb(g16))
    assert to_rgb(g16).mode == "L"
    np.testing.assert_allclose(out, np.asarray(cat.convert("L")), atol=1)  # rescaled, not clipped


def test_header_only_manifest_is_an_error(tmp_path):
    (tmp_path / "empty.csv").write_text("path,label\n")
    with pytest.raises(DataError, match="header but no rows"):
        open_dataset(f"manifest:{tmp_path / 'empty.csv'}")


def test_max_image_pixels_above_pils_own_bound_decodes(tmp_path, monkeypatch, fmnist_arrays):
    """PIL refuses images above 2 * Image.MAX_IMAGE_PIXELS at open: a higher --max-image-pixels
    must still decode them, and PIL's own bound is back afterwards (no process-wide change).
    PIL's bound is scaled down here so that a real photo-sized image stands for a 180 MP one."""
    from featcache.data.decode import decode_image
    from featcache.data.source import ReadOptions

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)
    img = Image.fromarray(fmnist_arrays[0][0]).resize((56, 56))  # 3136 px > 2 * 500
    img.save(tmp_path / "big.png")
    out = decode_image(tmp_path / "big.png", ReadOptions(max_image_pixels=4000))
    assert out.size == (56, 56)
    assert Image.MAX_IMAGE_PIXELS == 500
    with pytest.raises(DataError, match="above the limit of 3000"):
        decode_image(tmp_path / "big.png", ReadOptions(max_image_pixels=3000))
    assert Image.MAX_IMAGE_PIXELS == 500
