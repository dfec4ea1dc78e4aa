"""Store round-trips, provenance validation, completeness and the documented layout."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import featcache
from featcache.errors import (
    CacheNotWritableError,
    IncompleteStoreError,
    NotInStoreError,
    ProvenanceMismatchError,
    SchemaMismatchError,
)
from featcache.store import open_cache, write_class_embeddings, write_features
from featcache.store.schema import PROVENANCE_KEY, ROOT_KEY


@pytest.fixture
def digits_pixels():
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.data[:300].astype(np.float32), d.target[:300], [str(c) for c in d.target_names]


def _write(tmp_path, X, y, names, **kw):
    ids = [f"d{i}" for i in range(len(y))]
    write_features(
        tmp_path / "c.zarr",
        backbone="pix",
        dataset="digits",
        split="train",
        X=X,
        ids=ids,
        labels=y,
        class_names=names,
        **kw,
    )
    return str(tmp_path / "c.zarr"), ids


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 70),
    d=st.integers(1, 9),
    chunk=st.integers(1, 33),
    dtype=st.sampled_from(["float16", "float32"]),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_hypothesis(tmp_path_factory, n, d, chunk, dtype, seed):
    rng = np.random.default_rng(seed)
    X = (rng.standard_normal((n, d)) * 10).astype(np.float32)
    y = rng.integers(0, 4, n)
    ids = np.array([f"s{i}-{rng.integers(1e9)}" for i in range(n)])
    ids = np.array([f"{i}:{s}" for i, s in enumerate(ids)])  # unique
    valid = rng.random(n) > 0.2
    path = tmp_path_factory.mktemp("rt") / "c.zarr"
    write_features(
        path,
        backbone="b",
        dataset="ds",
        split="s",
        X=X,
        ids=ids,
        labels=y,
        class_names=["a", "b", "c", "d"],
        dtype=dtype,
        chunk_rows=chunk,
        valid=valid,
    )
    f = open_cache(path).load("b", "ds", "s")
    assert f.X.dtype == np.float32
    assert f.X.shape == (n, d)
    np.testing.assert_array_equal(f.X[valid], X[valid].astype(dtype).astype(np.float32))
    assert np.isnan(f.X[~valid]).all()
    np.testing.assert_array_equal(f.valid, valid)
    np.testing.assert_array_equal(f.labels, y)
    assert f.ids.tolist() == ids.tolist()
    assert f.class_names == ["a", "b", "c", "d"]
    assert f.provenance["dtype"] == dtype
    assert f.provenance["chunk_rows"] == chunk


def test_catalog_and_provenance(tmp_path, digits_pixels):
    X, y, names = digits_pixels
    path, _ = _write(tmp_path, X, y, names, model_name="pixels", weights_source="none")
    cache = featcache.open_cache(path)
    cat = cache.catalog()
    assert cat.columns[:9] == ["backbone", "dataset", "split", "kind", "n", "dim", "dtype", "complete", "n_invalid"]
    row = cat.row(0, named=True)
    assert (row["backbone"], row["dataset"], row["split"], row["n"], row["dim"]) == ("pix", "digits", "train", 300, 64)
    assert row["complete"] is True
    assert row["bytes"] > 0
    f = cache.load("pix", "digits", "train")
    for key in (
        "schema_version",
        "backbone",
        "weights_sha256",
        "timm_version",
        "torch_version",
        "featcache_version",
        "data_config",
        "dtype",
        "dataset_fingerprint",
        "created",
    ):
        assert key in f.provenance
    assert f.provenance["dataset_fingerprint"] == f.dataset_fingerprint
    # the features fingerprint changes when the data changes
    path2, _ = _write(tmp_path / "other", X[::-1].copy(), y[::-1].copy(), names)
    assert open_cache(path2).load("pix", "digits", "train").fingerprint != f.fingerprint


WRITE_WITHOUT_TORCH = """
import json, sys
import numpy as np
from featcache.store import open_cache, write_features
write_features(sys.argv[1], backbone="pix", dataset="d", split="s", X=np.ones((4, 2)), ids=list("abcd"),
               labels=np.zeros(4, int), class_names=["x"])
p = open_cache(sys.argv[1]).load("pix", "d", "s").provenance
print(json.dumps([p["torch_version"], p["timm_version"], "torch" in sys.modules, "timm" in sys.modules]))
"""


@pytest.mark.slow
def test_versions_recorded_without_importing_torch(tmp_path):
    """A process that writes features from elsewhere records the installed torch and timm from
    their metadata, without importing them; a process that imported them records their own
    ``__version__`` (with torch's build tag)."""
    import importlib.metadata
    import subprocess
    import sys

    import timm
    import torch

    run = subprocess.run(
        [sys.executable, "-c", WRITE_WITHOUT_TORCH, str(tmp_path / "a.zarr")], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    torch_v, timm_v, imported_torch, imported_timm = json.loads(run.stdout.strip().splitlines()[-1])
    assert (imported_torch, imported_timm) == (False, False)
    assert (torch_v, timm_v) == (importlib.metadata.version("torch"), importlib.metadata.version("timm"))
    assert torch.__version__.split("+")[0] == torch_v
    write_features(
        str(tmp_path / "b.zarr"),
        backbone="pix",
        dataset="d",
        split="s",
        X=np.ones((4, 2)),
        ids=list("abcd"),
        labels=np.zeros(4, int),
        class_names=["x"],
    )
    p = open_cache(str(tmp_path / "b.zarr")).load("pix", "d", "s").provenance
    assert (p["torch_version"], p["timm_version"]) == (torch.__version__, timm.__version__)


def test_plain_zarr_reads_documented_layout(tmp_path, digits_pixels):
    X, y, names = digits_pixels
    path, ids = _write(tmp_path, X, y, names)
    root = zarr.open_group(path, mode="r")
    assert root.attrs[ROOT_KEY]["schema_version"] == 1
    split = root["datasets/digits/train"]
    assert [str(s) for s in split["ids"][:5]] == ids[:5]
    np.testing.assert_array_equal(split["labels"][:], y)
    assert split.attrs["featcache_split"]["class_names"] == names
    g = root["features/pix/digits/train"]
    np.testing.assert_allclose(g["pooled"][:].astype(np.float32), X)
    assert g["valid"][:].all()
    assert g["done"][:].all()
    assert g["pooled"].attrs[PROVENANCE_KEY]["dim"] == 64
    assert json.dumps(dict(g["pooled"].attrs))  # plain JSON


def test_deleted_chunk_is_incomplete(tmp_path, digits_pixels):
    X, y, names = digits_pixels
    path, _ = _write(tmp_path, X, y, names, chunk_rows=64)
    os.remove(os.path.join(path, "features/pix/digits/train/pooled/c/2/0"))
    cache = open_cache(path)
    with pytest.raises(IncompleteStoreError, match="chunk files missing"):
        cache.load("pix", "digits", "train")
    f = cache.load("pix", "digits", "train", allow_partial=True)
    assert not f.valid[128:192].any()
    assert f.valid[:128].all()
    assert f.valid[192:].all()
    assert cache.catalog()["complete"].to_list() == [False]
    # an unmarked chunk is incomplete too
    root = zarr.open_group(path, mode="a")
    root["features/pix/digits/train/done"][0] = 0
    with pytest.raises(IncompleteStoreError, match="1 of 5 row chunks unfinished"):
        open_cache(path).load("pix", "digits", "train")


def test_unknown_schema_version(tmp_path, digits_pixels):
    X, y, names = digits_pixels
    path, _ = _write(tmp_path, X, y, names)
    root = zarr.open_group(path, mode="a")
    arr = root["features/pix/digits/train/pooled"]
    prov = dict(arr.attrs[PROVENANCE_KEY])
    prov["schema_version"] = 99
    arr.attrs[PROVENANCE_KEY] = prov
    with pytest.raises(SchemaMismatchError, match="schema version 99"):
        open_cache(path).load("pix", "digits", "train")
    meta = dict(root.attrs[ROOT_KEY])
    meta["schema_version"] = 2
    root.attrs[ROOT_KEY] = meta
    with pytest.raises(SchemaMismatchError, match="upgrade featcache"):
        open_cache(path)


def test_provenance_field_tampering(tmp_path, digits_pixels):
    X, y, names = digits_pixels
    path, _ = _write(tmp_path, X, y, names)
    root = zarr.open_group(path, mode="a")
    arr = root["features/pix/digits/train/pooled"]
    prov = dict(arr.attrs[PROVENANCE_KEY])
    del prov["weights_sha256"]
    prov["surprise"] = 1
    arr.attrs[PROVENANCE_KEY] = prov
    with pytest.raises(SchemaMismatchError, match="missing \\['weights_sha256'\\], unknown \\['surprise'\\]"):
        open_cache(path).load("pix", "digits", "train")


def test_absent_entries_list_holdings(tmp_path, digits_pixels):
    X, y, names = digits_pixels
    path, _ = _write(tmp_path, X, y, names)
    cache = open_cache(path)
    with pytest.raises(NotInStoreError, match="the store holds: pix/digits/train"):
        cache.load("resnet50", "digits", "train")
    with pytest.raises(KeyError):  # also a builtin KeyError
        cache.load("pix", "digits", "test")
    with pytest.raises(NotInStoreError, match="kinds present: \\['pooled'\\]"):
        cache.load("pix", "digits", "train", kind="cls")
    with pytest.raises(NotInStoreError, match="no feature cache"):
        open_cache(tmp_path / "nothing.zarr")


def test_refuses_other_settings_and_split_changes(tmp_path, digits_pixels):
    X, y, names = digits_pixels
    path, ids = _write(tmp_path, X, y, names)
    with pytest.raises(ProvenanceMismatchError, match="dtype: stored='float32' requested='float16'"):
        _write(tmp_path, X, y, names, dtype="float16")
    assert open_cache(path).load("pix", "digits", "train").provenance["dtype"] == "float32"  # untouched
    _write(tmp_path, X, y, names, dtype="float16", overwrite=True)
    assert open_cache(path).load("pix", "digits", "train").provenance["dtype"] == "float16"
    y2 = y.copy()
    y2[0] = (y2[0] + 1) % 10
    with pytest.raises(SchemaMismatchError, match=r"already exists .* with different rows"):
        _write(tmp_path, X, y2, names)
    with pytest.raises(SchemaMismatchError, match="not unique"):
        write_features(path, backbone="pix", dataset="dup", split="train", X=X[:2], ids=["a", "a"], labels=[0, 1])
    with pytest.raises(SchemaMismatchError, match="invalid backbone name"):
        write_features(path, backbone="a/b", dataset="digits", split="train", X=X, ids=ids, labels=y, class_names=names)


def test_not_a_featcache_store_and_not_writable(tmp_path):
    g = zarr.open_group(tmp_path / "other.zarr", mode="w")
    g.create_array("x", shape=(2,), dtype="int8")
    with pytest.raises(SchemaMismatchError, match="not a featcache store"):
        open_cache(tmp_path / "other.zarr")
    with pytest.raises(SchemaMismatchError, match="not a featcache store"):
        open_cache(tmp_path / "other.zarr", mode="a")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CacheNotWritableError, match="is a file"):
        open_cache(tmp_path / "file" / "c.zarr", mode="a")


def test_class_embeddings(tmp_path, digits_pixels):
    X, y, names = digits_pixels
    path, _ = _write(tmp_path, X, y, names)
    protos = np.stack([X[y == c].mean(0) for c in range(10)])
    write_class_embeddings(path, "digits", protos, name="prototypes")
    np.testing.assert_allclose(open_cache(path).load_class_embeddings("digits", "prototypes"), protos)
    with pytest.raises(NotInStoreError, match="present: \\['prototypes'\\]"):
        open_cache(path).load_class_embeddings("digits", "text")
