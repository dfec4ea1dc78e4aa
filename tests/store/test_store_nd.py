"""N-d feature kinds (issue 46): ``rows x *inner x D`` arrays (``blocks:K``, ``tokens``,
``tokens@GxG``) in the same store, with ``inner`` in the provenance, and every ``[N, D]``
store's documents, digests and fingerprints unchanged."""

from __future__ import annotations

import hashlib
import json
import re
import time

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zarr.storage import MemoryStore

from featcache.errors import SchemaMismatchError
from featcache.store import FeatureProvenance, FeatureWriter, ensure_split, make_provenance, open_cache, write_features
from featcache.store.arrays import create_feature_array
from featcache.store.fingerprints import features_fingerprint
from featcache.store.schema import PROVENANCE_DIGEST_KEY, PROVENANCE_KEY, provenance_digest


def digits_nd(n: int = 300) -> tuple[dict[str, np.ndarray], np.ndarray, list[str]]:
    """Real rows shaped like the new kinds, from scikit-learn's digits (8 x 8 pixels):
    ``tokens`` [n, 4, 16] (the four 4 x 4 quadrants) and ``tokens@3x3`` [n, 9, 32] (a 3 x 3 grid
    of 4 x 4 windows at stride 2, each with its squares), ``pooled`` [n, 64] (the pixels)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    img = d.images[:n].astype(np.float32)
    quads = img.reshape(n, 2, 4, 2, 4).transpose(0, 1, 3, 2, 4).reshape(n, 4, 16)
    win = np.stack([img[:, r : r + 4, c : c + 4].reshape(n, 16) for r in (0, 2, 4) for c in (0, 2, 4)], axis=1)
    feats = {
        "pooled": img.reshape(n, 64),
        "tokens": quads,
        "tokens@3x3": np.concatenate([win, win**2 / 16], axis=2),
    }
    return feats, d.target[:n], [str(c) for c in d.target_names]


def write_group(
    path, feats: dict[str, np.ndarray], y, names, *, chunk_rows: int = 64, dtype: str = "float16", valid=None
):
    """Every kind of ``feats`` into one group of ``path`` through the writer API (as an extract)."""
    n = len(y)
    cache = open_cache(path, "a")
    meta = ensure_split(cache, "digits", "train", np.array([f"d{i}" for i in range(n)]), y, names, "digits")
    provs = {
        k: make_provenance(
            backbone="pix",
            dataset="digits",
            split="train",
            kind=k,
            dim=x.shape[1:],
            n=n,
            dataset_fingerprint=meta.fingerprint,
            chunk_rows=chunk_rows,
            dtype=dtype,
        )
        for k, x in feats.items()
    }
    valid = np.ones(n, bool) if valid is None else valid
    w = FeatureWriter(cache, "pix", "digits", "train", provs).prepare()
    for i in w.pending_chunks():
        s, e = w.chunk_range(i)
        w.write_chunk(i, {k: x[s:e] for k, x in feats.items()}, valid[s:e])
    w.mark_complete()
    return cache


# ---------------------------------------------------------------- [N, D] stays byte-identical
#: a provenance with every field fixed, and what featcache wrote for it before ``inner`` existed
#: (computed with main at bd1a398, zarr 3.1.6): its digest, its fingerprint, its array's zarr.json
_FIXED = {
    "schema_version": 1,
    "backbone": "bb",
    "model_name": "m",
    "weights_source": "random:0",
    "weights_sha256": "ab" * 32,
    "timm_version": "1.0",
    "torch_version": "2.14.1",
    "featcache_version": "0.1",
    "data_config": {"input_size": [3, 32, 32]},
    "kind": "pooled",
    "pooling": "pooled",
    "dim": 16,
    "dtype": "float16",
    "dataset": "digits",
    "split": "train",
    "dataset_fingerprint": "cd" * 32,
    "n": 300,
    "chunk_rows": 64,
    "created": "2026-01-01T00:00:00Z",
}
_OLD_DIGEST = "9d945d6e716c7b8c1c6ff3bf072a5f43dbfb9db88caa1b88bbd48ed7e39d2b3e"
_OLD_FINGERPRINT = "0dd2f61b138dcfc1"
_OLD_ARRAY_DOC = "0253e04fd7b57466dcc9b2b9413c6a5322a73771e1d5ee634c19f661dca8c49a"


def test_a_2d_kind_writes_the_documents_digests_and_fingerprints_it_wrote_before_inner():
    prov = FeatureProvenance(**_FIXED)
    doc = prov.to_attrs()
    assert "inner" not in doc
    assert prov.inner == ()
    assert prov.row_shape == (16,)
    assert provenance_digest(doc) == _OLD_DIGEST
    assert features_fingerprint(doc, "ef" * 32) == _OLD_FINGERPRINT
    d: dict = {}
    g = zarr.create_group(store=MemoryStore(store_dict=d), zarr_format=3)
    a = create_feature_array(g, "pooled", 300, 64, 16, "float16")
    a.update_attributes({PROVENANCE_KEY: doc, PROVENANCE_DIGEST_KEY: provenance_digest(doc)})
    assert hashlib.sha256(d["pooled/zarr.json"].to_bytes()).hexdigest() == _OLD_ARRAY_DOC
    # a document that spells an empty inner reads as the same provenance (same identity)
    assert FeatureProvenance.from_attrs({**doc, "inner": []}).identity() == prov.identity()


def test_inner_is_recorded_validated_and_part_of_the_identity():
    prov = FeatureProvenance(**{**_FIXED, "kind": "blocks:4", "pooling": "blocks:4", "inner": (4,)})
    doc = prov.to_attrs()
    assert doc["inner"] == [4]
    assert prov.row_shape == (4, 16)
    back = FeatureProvenance.from_attrs(json.loads(json.dumps(doc)))
    assert back == prov
    assert back.inner == (4,)
    assert prov.identity()["inner"] == [4]
    other = FeatureProvenance(**{**_FIXED, "kind": "blocks:4", "pooling": "blocks:4", "inner": (8,)})
    assert prov.differences(other) == {"inner": ([4], [8])}
    flat = FeatureProvenance(**{**_FIXED, "kind": "blocks:4", "pooling": "blocks:4"})
    assert prov.differences(flat) == {"inner": ([4], [])}
    for bad in ([0], [-2], [True], ["4"], [1.5], 4, "4"):
        with pytest.raises(SchemaMismatchError, match="inner"):
            FeatureProvenance.from_attrs({**doc, "inner": bad})


def test_make_provenance_takes_a_per_row_shape_and_the_writer_refuses_a_bad_inner(tmp_path):
    kw = {"backbone": "b", "dataset": "d", "split": "s", "kind": "tokens", "n": 3, "dataset_fingerprint": "x"}
    kw["chunk_rows"] = 2
    p = make_provenance(dim=(196, 192), **kw)
    assert (p.inner, p.dim, p.row_shape) == ((196,), 192, (196, 192))
    assert make_provenance(dim=(192,), **kw).inner == ()
    assert make_provenance(dim=np.int64(192), **kw).dim == 192
    with pytest.raises(SchemaMismatchError, match="per-row shape"):
        make_provenance(dim=(), **kw)
    bad = make_provenance(dim=8, inner=(0,), **kw)
    with pytest.raises(SchemaMismatchError, match="inner"):
        FeatureWriter(open_cache(tmp_path / "c.zarr", "a"), "b", "d", "s", {"tokens": bad})


# ---------------------------------------------------------------- N-d round trips
def test_nd_kinds_are_listed_loaded_and_read_lazily_by_their_spelling(tmp_path):
    feats, y, names = digits_nd()
    feats["blocks:4"] = feats["tokens"][:, :, ::-1].copy()
    valid = np.ones(len(y), bool)
    valid[[3, 150]] = False
    cache = write_group(tmp_path / "c.zarr", feats, y, names, valid=valid)
    cache = open_cache(tmp_path / "c.zarr")
    assert cache.kinds("pix", "digits", "train") == ["pooled", "tokens", "tokens@3x3", "blocks:4"]
    for kind, x in feats.items():
        f = cache.load("pix", "digits", "train", kind=kind)
        assert f.X.shape == x.shape
        assert f.X.dtype == np.float32
        np.testing.assert_array_equal(f.X[valid], x[valid].astype(np.float16).astype(np.float32))
        assert np.isnan(f.X[~valid]).all()
        assert f.provenance.get("inner", []) == list(x.shape[1:-1])
        assert cache.provenance("pix", "digits", "train", kind).row_shape == x.shape[1:]
        lazy = cache.load("pix", "digits", "train", kind=kind, lazy=True)
        assert lazy.X.shape == x.shape
        assert lazy.X[160:230].shape == (70, *x.shape[1:])
        np.testing.assert_array_equal(np.asarray(lazy.X[160:230]), x[160:230].astype(np.float16))
        assert lazy.fingerprint == f.fingerprint == cache.stored_fingerprint("pix", "digits", "train", kind)
        arr = zarr.open_group(str(tmp_path / "c.zarr"), mode="r")[f"features/pix/digits/train/{kind}"]
        assert arr.chunks == (64, *x.shape[1:])
        assert str(arr.dtype) == "float16"
    cat = cache.catalog()
    shapes = dict(zip(cat["kind"].to_list(), cat["shape"].to_list(), strict=True))
    assert shapes == {"pooled": "300x64", "tokens": "300x4x16", "tokens@3x3": "300x9x32", "blocks:4": "300x4x16"}
    assert cat["dim"].to_list() == [64, 16, 32, 16]
    assert cat["complete"].all()


def test_ls_shows_each_arrays_shape(tmp_path, capsys):
    from featcache.cli import main

    feats, y, names = digits_nd(40)
    write_group(tmp_path / "c.zarr", {"pooled": feats["pooled"], "blocks:4": feats["tokens"]}, y, names, chunk_rows=16)
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "c.zarr")]) == 0
    out = capsys.readouterr().out
    assert "shape" in out
    assert "40x64" in out
    assert "40x4x16" in out


def test_write_chunk_refuses_rows_of_another_shape(tmp_path):
    feats, y, names = digits_nd(40)
    cache = open_cache(tmp_path / "c.zarr", "a")
    meta = ensure_split(cache, "digits", "train", np.array([f"d{i}" for i in range(40)]), y, names, "digits")
    p = make_provenance(
        backbone="pix", dataset="digits", split="train", kind="tokens", dim=(4, 16), n=40,
        dataset_fingerprint=meta.fingerprint, chunk_rows=64,
    )  # fmt: skip
    w = FeatureWriter(cache, "pix", "digits", "train", {"tokens": p}).prepare()
    try:
        with pytest.raises(SchemaMismatchError, match=r"expected \(40, 4, 16\)"):
            w.write_chunk(0, {"tokens": feats["tokens"][:, :2]}, np.ones(40, bool))
    finally:
        w.release()


def test_another_token_grid_for_a_stored_kind_is_refused_then_overwritten(tmp_path):
    from featcache.errors import ProvenanceMismatchError

    feats, y, names = digits_nd(40)
    kw = {"backbone": "pix", "dataset": "digits", "split": "train", "ids": [f"d{i}" for i in range(40)]}
    kw.update(labels=y, class_names=names, kind="tokens", dtype="float16", chunk_rows=16)
    write_features(tmp_path / "c.zarr", X=feats["tokens"], **kw)  # 2 x 2 quadrants: [40, 4, 16]
    grid3 = feats["tokens@3x3"][:, :, :16]  # a 3 x 3 grid: [40, 9, 16], the same D
    with pytest.raises(ProvenanceMismatchError, match=r"tokens\.inner: stored=\[4\] requested=\[9\]"):
        write_features(tmp_path / "c.zarr", X=grid3, **kw)
    np.testing.assert_array_equal(  # nothing written was lost
        open_cache(tmp_path / "c.zarr").load("pix", "digits", "train", kind="tokens").X,
        feats["tokens"].astype(np.float16).astype(np.float32),
    )
    write_features(tmp_path / "c.zarr", X=grid3, overwrite=True, **kw)
    assert open_cache(tmp_path / "c.zarr").load("pix", "digits", "train", kind="tokens").X.shape == (40, 9, 16)


@pytest.mark.parametrize("store", ["local", "memory"])
def test_write_features_takes_nd_rows(tmp_path, store):
    feats, y, names = digits_nd(90)
    where = tmp_path / "c.zarr" if store == "local" else MemoryStore()
    cache = write_features(
        where, backbone="pix", dataset="digits", split="train", X=feats["tokens@3x3"], ids=[f"d{i}" for i in range(90)],
        labels=y, class_names=names, kind="tokens@3x3", dtype="float16", chunk_rows=32,
    )  # fmt: skip
    f = cache.load("pix", "digits", "train", kind="tokens@3x3")
    np.testing.assert_array_equal(f.X, feats["tokens@3x3"].astype(np.float16).astype(np.float32))


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 50),
    inner=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    d=st.integers(1, 6),
    chunk=st.integers(1, 20),
    dtype=st.sampled_from(["float16", "float32"]),
    seed=st.integers(0, 2**16),
)
def test_nd_roundtrip_hypothesis(tmp_path_factory, n, inner, d, chunk, dtype, seed):
    rng = np.random.default_rng(seed)
    X = (rng.standard_normal((n, *inner, d)) * 10).astype(np.float32)
    y = rng.integers(0, 4, n)
    valid = rng.random(n) > 0.2
    path = tmp_path_factory.mktemp("nd") / "c.zarr"
    write_features(
        path, backbone="b", dataset="ds", split="s", X=X, ids=[f"s{i}" for i in range(n)], labels=y,
        class_names=list("abcd"), kind="tokens", dtype=dtype, chunk_rows=chunk, valid=valid,
    )  # fmt: skip
    cache = open_cache(path)
    f = cache.load("b", "ds", "s", kind="tokens")
    assert f.X.shape == (n, *inner, d)
    assert f.complete
    np.testing.assert_array_equal(f.X[valid], X[valid].astype(dtype).astype(np.float32))
    assert np.isnan(f.X[~valid]).all()
    np.testing.assert_array_equal(f.valid, valid)
    lazy = cache.load("b", "ds", "s", kind="tokens", lazy=True, dtype=None)
    np.testing.assert_array_equal(np.asarray(lazy.X), f.X.astype(dtype))


def test_pipeline_turns_each_kinds_dims_into_inner_and_dim():
    """The extract's provenances from ``FeatureHead.dims``: an int (a ``[N, D]`` kind, as
    before) or a per-row shape (``blocks:4`` -> inner (4,), ``tokens`` -> inner (T,))."""
    from types import SimpleNamespace

    from featcache.extract.pipeline import _provenances, _row_shape

    assert _row_shape(1280) == (1280,)
    assert _row_shape(np.int64(7)) == (7,)
    assert _row_shape((4, 192)) == (4, 192)
    assert _row_shape([196, 192]) == (196, 192)
    dims = {"pooled": 1280, "blocks:4": (4, 192), "tokens": (196, 192), "cls": (192,)}
    cfg = SimpleNamespace(recorded=dict, chunk_rows=64, dtype="float16", batch_size=32, channels_last=False)
    bb = SimpleNamespace(device="cuda:0", name="vit", weights_source="w", weights_sha256="s", data_config={})
    job = SimpleNamespace(
        bb=bb, cfg=cfg, record=None, backend="eager", decoder="pil", key="vit", amp="none",
        head=SimpleNamespace(kinds=list(dims)), dims=dims,
    )  # fmt: skip

    class Src:  # a split of 300 rows
        dataset, split, extra = "digits", "train", {}

        def __len__(self) -> int:
            return 300

    provs = _provenances(job, Src(), SimpleNamespace(fingerprint="f"), 1)
    got = {k: (p.inner, p.dim, p.row_shape) for k, p in provs.items()}
    assert got == {
        "pooled": ((), 1280, (1280,)),
        "blocks:4": ((4,), 192, (4, 192)),
        "tokens": ((196,), 192, (196, 192)),
        "cls": ((), 192, (192,)),
    }
    assert "inner" not in provs["pooled"].to_attrs()


# ---------------------------------------------------------------- streaming in row blocks
def test_iter_blocks_equals_load_in_whole_chunks_within_max_memory(tmp_path):
    import tracemalloc

    from featcache.store import block_bytes

    feats, y, names = digits_nd()
    valid = np.ones(len(y), bool)
    valid[[7, 200]] = False
    cache = write_group(tmp_path / "c.zarr", feats, y, names, chunk_rows=32, valid=valid)
    full = cache.load("pix", "digits", "train", kind="tokens@3x3").X
    for k in (1, 2, 3, 20):
        budget = block_bytes(k, 32, (9, 32), 2)
        it = cache.iter_blocks("pix", "digits", "train", "tokens@3x3", max_memory=budget)
        tracemalloc.start()
        try:
            got = [(s, x.shape[0]) for s, x in it]  # each block dropped before the next but one
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak <= budget, (k, peak, budget)
        step = min(k, 10) * 32
        assert got == [(s, min(step, 300 - s)) for s in range(0, 300, step)]
    blocks = list(cache.iter_blocks("pix", "digits", "train", "tokens@3x3", max_memory=4 << 20))
    assert all(x.dtype == np.float32 for _, x in blocks)
    np.testing.assert_array_equal(np.concatenate([x for _, x in blocks]), full)
    one = block_bytes(1, 32, (4, 16), 2)
    part = list(cache.iter_blocks("pix", "digits", "train", "tokens", max_memory=one, rows=slice(40, 250)))
    assert [s for s, _ in part][:3] == [40, 64, 96]  # cut at the range's ends only
    np.testing.assert_array_equal(
        np.concatenate([x for _, x in part]), cache.load("pix", "digits", "train", kind="tokens").X[40:250]
    )
    assert list(cache.iter_blocks("pix", "digits", "train", "pooled", rows=(5, 5))) == []


def test_iter_blocks_refuses_a_budget_below_one_chunk_and_bad_rows_in_one_line(tmp_path):
    from featcache.errors import ConfigError
    from featcache.store import block_bytes

    feats, y, names = digits_nd(64)
    cache = write_group(tmp_path / "c.zarr", {"tokens@3x3": feats["tokens@3x3"]}, y, names, chunk_rows=32)
    need = block_bytes(1, 32, (9, 32), 2)
    with pytest.raises(ConfigError, match=f"raise --max-memory to at least {need:,}") as exc:
        cache.iter_blocks("pix", "digits", "train", "tokens@3x3", max_memory=need - 1)
    assert "\n" not in str(exc.value)
    for rows in (slice(0, 10, 2), (10, 5), (0, 65), [0, 3]):
        with pytest.raises(ConfigError, match="rows="):
            cache.iter_blocks("pix", "digits", "train", "tokens@3x3", rows=rows)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="max_memory"):
            cache.iter_blocks("pix", "digits", "train", "tokens@3x3", max_memory=bad)


# ---------------------------------------------------------------- the store's guarantees on N-d arrays
#: a writer process: the kinds of an .npz (``k0``, ``k1``... named by argv[3]) into one group,
#: chunk by chunk (``pause`` seconds after each), resuming what a killed run left
_WRITER = """
import json, sys, time
import numpy as np
from featcache.store import FeatureWriter, ensure_split, make_provenance, open_cache
path, data, kinds, pause = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
z = np.load(data)
feats, y = {k: z[f"k{j}"] for j, k in enumerate(kinds)}, z["y"]
n = len(y)
cache = open_cache(path, "a")
meta = ensure_split(cache, "digits", "train", np.array([f"d{i}" for i in range(n)]), y, [str(c) for c in range(10)], "d")
provs = {k: make_provenance(backbone="pix", dataset="digits", split="train", kind=k, dim=x.shape[1:], n=n,
                            dataset_fingerprint=meta.fingerprint, chunk_rows=8, dtype="float16") for k, x in feats.items()}
w = FeatureWriter(cache, "pix", "digits", "train", provs).prepare()
valid = np.arange(n) % 37 != 5
for i in w.pending_chunks():
    s, e = w.chunk_range(i)
    w.write_chunk(i, {k: x[s:e] for k, x in feats.items()}, valid[s:e], ["unreadable"] * (e - s))
    time.sleep(pause)
w.mark_complete()
"""
ND_KINDS = ("blocks:4", "tokens@3x3")


@pytest.fixture(scope="module")
def nd_data(tmp_path_factory):
    """digits' N-d rows as the writer process reads them, and the rows themselves."""
    feats, y, _ = digits_nd()
    feats = {"blocks:4": feats["tokens"], "tokens@3x3": feats["tokens@3x3"]}
    path = tmp_path_factory.mktemp("nd") / "rows.npz"
    np.savez(path, y=y, **{f"k{j}": feats[k] for j, k in enumerate(ND_KINDS)})
    return str(path), feats, y


def _start(path, nd_data, pause: float = 0.0):
    import subprocess
    import sys

    argv = [sys.executable, "-c", _WRITER, str(path), nd_data[0], json.dumps(ND_KINDS), str(pause)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(path, nd_data, pause: float = 0.0) -> None:
    proc = _start(path, nd_data, pause)
    out = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, out[-3000:]


def _chunk_files(path) -> dict[str, bytes]:
    """Every chunk object of the group's arrays, by path (byte-identical groups: equal dicts)."""
    group = path / "features/pix/digits/train"
    names = (*ND_KINDS, "valid", "error", "done")
    return {
        str(f.relative_to(group)): f.read_bytes()
        for a in names
        for f in sorted((group / a / "c").rglob("*"))
        if f.is_file()
    }


@pytest.fixture(scope="module")
def nd_reference(nd_data, tmp_path_factory):
    """The group written by one uninterrupted writer process, and its chunk objects."""
    path = tmp_path_factory.mktemp("ref") / "c.zarr"
    _finish(path, nd_data)
    return path, _chunk_files(path)


def _fresh_copy(nd_reference, tmp_path):
    import shutil

    path = tmp_path / "c.zarr"
    shutil.copytree(nd_reference[0], path)
    return path


def _expect_rows(cache, kind: str, feats) -> None:
    f = cache.load("pix", "digits", "train", kind=kind)
    valid = np.arange(len(f.valid)) % 37 != 5
    np.testing.assert_array_equal(f.valid, valid)
    np.testing.assert_array_equal(f.X[valid], feats[kind][valid].astype(np.float16).astype(np.float32))


@pytest.mark.slow
@pytest.mark.parametrize(("min_done", "seed"), [(2, 0), (19, 1)])
def test_kill9_mid_write_then_resume_is_byte_identical(nd_data, nd_reference, tmp_path, min_done, seed):
    """A writer process SIGKILLed at a random moment after ``min_done`` chunks, then the same
    writer again: every chunk object equals the uninterrupted run's, and verify is clean."""
    import random

    from kill9 import kill_when, marked_chunks

    from featcache.store.verify import verify

    path = tmp_path / "c.zarr"
    proc = _start(path, nd_data, pause=0.005)
    group = path / "features/pix/digits/train"
    marks = kill_when(proc, lambda: marked_chunks(group), min_done, random.Random(seed).uniform(0, 0.03))
    assert marks < 38, "the writer finished before the kill"
    _finish(path, nd_data)
    assert _chunk_files(path) == nd_reference[1]
    assert verify(str(path)) == []
    for kind in ND_KINDS:
        _expect_rows(open_cache(path), kind, nd_data[1])


def _flip(f) -> None:
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    f.write_bytes(bytes(raw))


@pytest.mark.parametrize("kind", ["blocks:4", pytest.param("tokens@3x3", marks=pytest.mark.slow)])
def test_a_flipped_byte_in_one_nd_chunk_is_named_refused_repaired_byte_identical(nd_data, nd_reference, tmp_path, kind):
    from featcache.errors import CorruptStoreError
    from featcache.store.verify import verify

    path = _fresh_copy(nd_reference, tmp_path)
    _flip(path / f"features/pix/digits/train/{kind}/c/2/0/0")
    with pytest.raises(CorruptStoreError, match=re.escape(f"{kind} chunk(s) [2] corrupt")):
        open_cache(path).load("pix", "digits", "train", kind=kind)
    with pytest.raises(CorruptStoreError, match=re.escape(f"{kind} chunk(s) [2] corrupt")):
        list(open_cache(path).iter_blocks("pix", "digits", "train", kind, max_memory=4 << 20))
    other = next(k for k in ND_KINDS if k != kind)
    _expect_rows(open_cache(path), other, nd_data[1])  # the other kind of the group still reads
    problems = verify(str(path))
    assert any(kind in p and "chunk 2" in p for p in problems), problems
    verify(str(path), repair=True)  # marks chunk 2 for recomputation
    assert open_cache(path).chunk_status("pix", "digits", "train")["done"].sum() == 37
    _finish(path, nd_data)  # the same writer recomputes it
    assert _chunk_files(path) == nd_reference[1]
    assert verify(str(path)) == []


@pytest.mark.parametrize(
    "damage",
    [
        "deleted",
        pytest.param("garbled", marks=pytest.mark.slow),
        pytest.param("codec changed, digests deleted", marks=pytest.mark.slow),
    ],
)
def test_a_damaged_nd_array_document_is_rebuilt_byte_identical(nd_reference, tmp_path, damage):
    """``verify --repair`` rebuilds a kind's zarr.json (shape and chunks with ``inner``) from the
    group's metadata and the kept provenance; the digest recorded by the writer accepts it.
    Without digests, from the evidence (its provenance and the group metadata)."""
    from featcache.store.verify import verify

    path = _fresh_copy(nd_reference, tmp_path)
    doc = path / "features/pix/digits/train/blocks:4/zarr.json"
    good = doc.read_bytes()
    if damage == "deleted":
        doc.unlink()
    elif damage.startswith("codec"):
        (path / ".featcache-manifest/features~pix~digits~train.json").unlink()
        doc.write_bytes(good.replace(b'"level": 3', b'"level": 5'))
        assert doc.read_bytes() != good
    else:
        doc.write_bytes(good.replace(b'"shape": [\n    300,\n    4,', b'"shape": [\n    300,\n    5,'))
        assert doc.read_bytes() != good
    assert any("blocks:4" in p for p in verify(str(path)))
    verify(str(path), repair=True)
    assert doc.read_bytes() == good
    assert verify(str(path)) == []


def test_swapped_nd_chunk_folders_between_two_groups_are_refused(nd_data, nd_reference, tmp_path):
    """Issue 50's swapped-folder refusal on N-d arrays: the tokens chunks of two backbones'
    groups of the same shape exchanged never load as the other backbone's rows."""
    import os

    from featcache.errors import CorruptStoreError
    from featcache.store.verify import verify

    path = _fresh_copy(nd_reference, tmp_path)
    feats, y = nd_data[1], nd_data[2]
    write_features(
        path, backbone="pix2", dataset="digits", split="train", X=feats["tokens@3x3"] + 100,
        ids=[f"d{i}" for i in range(len(y))], labels=y, class_names=[str(c) for c in range(10)],
        kind="tokens@3x3", dtype="float16", chunk_rows=8, weights_source="random:2",
    )  # fmt: skip
    a, b = (path / f"features/{bb}/digits/train/tokens@3x3/c" for bb in ("pix", "pix2"))
    os.rename(a, a.with_name("swap"))
    os.rename(b, a)
    os.rename(a.with_name("swap"), b)
    for bb in ("pix", "pix2"):
        with pytest.raises(CorruptStoreError, match=f"{bb}/digits/train"):
            open_cache(path).load(bb, "digits", "train", kind="tokens@3x3")
        with pytest.raises(CorruptStoreError):
            open_cache(path).iter_blocks(bb, "digits", "train", "tokens@3x3")
    problems = verify(str(path))
    assert any("features/pix/digits/train" in p for p in problems), problems
    assert any("features/pix2/digits/train" in p for p in problems), problems


@pytest.mark.slow
def test_nd_loads_during_a_write_are_snapshots(nd_data, tmp_path):
    """Loads (eager, lazy, streamed) in a loop while a writer process writes the group: every
    row a load calls valid holds the written features, a complete load has every row, and a
    streamed read of an unfinished group is refused by name."""
    from featcache.errors import FeatcacheError, IncompleteStoreError

    path = tmp_path / "c.zarr"
    proc = _start(path, nd_data, pause=0.03)
    feats = nd_data[1]
    want = np.arange(300) % 37 != 5
    loads, streamed, refused, early = 0, 0, 0, []
    deadline = time.monotonic() + 300  # a writer that fails is reported below, not waited for
    while (proc.poll() is None or loads == 0) and (proc.poll() in (None, 0)) and time.monotonic() < deadline:
        for kind in ND_KINDS:
            try:
                f = open_cache(path).load("pix", "digits", "train", kind=kind, allow_partial=True)
            except FeatcacheError as exc:  # the root or group being created (named), never a wrong row
                early.append(str(exc))
                continue
            assert (f.valid <= want).all()
            np.testing.assert_array_equal(f.X[f.valid], feats[kind][f.valid].astype(np.float16).astype(np.float32))
            assert np.isnan(f.X[~f.valid]).all()
            assert not f.complete or (f.valid == want).all()
            loads += 1
            try:
                blocks = open_cache(path).iter_blocks("pix", "digits", "train", kind, max_memory=4 << 20)
                got = np.concatenate([x for _, x in blocks])
                np.testing.assert_array_equal(got[want], feats[kind][want].astype(np.float16).astype(np.float32))
                streamed += 1
            except IncompleteStoreError:
                refused += 1  # streaming an unfinished group: refused by name
    assert proc.wait(timeout=300) == 0
    named = (
        "no feature cache at",
        "not a featcache store",
        "being created",
        "no features for",
        "is not in",
        "changed while",
    )
    assert [e for e in early if not any(m in e for m in named)] == []
    assert loads >= 2
    assert refused >= 1
    for kind in ND_KINDS:
        _expect_rows(open_cache(path), kind, feats)
