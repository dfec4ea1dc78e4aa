"""The store on every kind of zarr store, as zarr-python tests its own stores: round trip,
resume of incomplete chunks, verify, checksums and repair, parametrised over MemoryStore,
LocalStore and the S3 store (fsspec) on a local moto server. Damage is done through the
zarr Store API (raw bytes), never through featcache."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import zarr
from zarr.buffer import default_buffer_prototype

import featcache
from featcache.errors import CorruptStoreError, IncompleteStoreError, SchemaMismatchError
from featcache.store import FeatureWriter, make_provenance, open_cache, write_features
from featcache.store.verify import VerifyReport, verify

GROUP = "features/pix/digits/train"
N, DIM, CHUNK = 200, 24, 50


@pytest.fixture(scope="module")
def s3_server(s3_bucket):
    return s3_bucket("backends")


class Backend:
    """A fresh featcache root on one kind of store, plus raw byte access through the Store API
    (on its own event loop and store instance, as another process would see it)."""

    def __init__(self, kind: str, tmp_path, s3_opts=None, name: str = "c.zarr"):
        self.kind = kind
        self.opts = None
        if kind == "memory":
            self.target = zarr.storage.MemoryStore()
        elif kind == "local":
            self.target = zarr.storage.LocalStore(tmp_path / name)
        else:
            self.target = f"s3://backends/{tmp_path.name}/{name}"
            self.opts = s3_opts

    def cache(self, mode: str = "a"):
        return open_cache(self.target, mode, storage_options=self.opts)

    def _raw_store(self):
        if self.kind == "memory":
            return self.target
        if self.kind == "local":
            return zarr.storage.LocalStore(self.target.root)
        return zarr.storage.FsspecStore.from_url(
            self.target, storage_options={**self.opts, "skip_instance_cache": True}
        )

    def _run(self, fn):
        async def go():
            return await fn(self._raw_store())

        return asyncio.run(go())

    def keys(self, prefix: str) -> list[str]:
        async def f(st):
            return sorted([k async for k in st.list_prefix(prefix)])

        return self._run(f)

    def get(self, key: str) -> bytes:
        async def f(st):
            b = await st.get(key, prototype=default_buffer_prototype())
            return None if b is None else b.to_bytes()

        return self._run(f)

    def set(self, key: str, data: bytes) -> None:
        async def f(st):
            await st.set(key, default_buffer_prototype().buffer.from_bytes(data))

        self._run(f)

    def delete(self, key: str) -> None:
        async def f(st):
            await st.delete(key)

        self._run(f)

    def snapshot(self, prefix: str = GROUP) -> dict[str, bytes]:
        snap = {k: self.get(k) for k in self.keys(f"{prefix}/") if "/c/" in k}
        assert snap
        assert all(v for v in snap.values())
        return snap


@pytest.fixture(params=["memory", "local", pytest.param("s3", marks=pytest.mark.slow)])  # S3: a moto server
def backend(request, tmp_path):
    opts = request.getfixturevalue("s3_server") if request.param == "s3" else None
    return Backend(request.param, tmp_path, opts)


@pytest.fixture(params=["memory", "local"])
def backend_fast(request, tmp_path):
    """The damage cases on in-process stores (each S3 round costs ~40 s of moto on 2 cores);
    S3 gets the round trip, resume and a bit flip."""
    return Backend(request.param, tmp_path)


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    X = d.data[:N, :DIM].astype(np.float32)
    return X, d.target[:N], [str(c) for c in d.target_names]


def _write(backend, digits, **kw):
    X, y, names = digits
    valid = np.ones(N, bool)
    valid[[3, 77]] = False  # two invalid rows, as failed images would be
    write_features(
        backend.cache(),
        backbone="pix",
        dataset="digits",
        split="train",
        X=X,
        ids=[f"d{i}" for i in range(N)],
        labels=y,
        class_names=names,
        chunk_rows=CHUNK,
        dtype="float16",
        valid=valid,
        **kw,
    )
    return valid


def test_round_trip_and_verify(backend, digits):
    valid = _write(backend, digits)
    f = backend.cache("r").load("pix", "digits", "train")
    X = digits[0].astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(f.X[valid], X[valid])
    assert np.isnan(f.X[~valid]).all()
    assert f.valid.tolist() == valid.tolist()
    assert f.complete
    assert verify(backend.target, backend.opts) == []
    codecs = [
        type(c).__name__ for c in zarr.open_array(backend.cache("r").root.store, path=f"{GROUP}/pooled").metadata.codecs
    ]
    assert codecs[-1] == "Crc32cCodec"
    # a second identical write is a no-op: chunk objects stay byte-identical
    before = backend.snapshot()
    _write(backend, digits)
    assert backend.snapshot() == before


def test_incomplete_chunks_then_resume(backend, digits):
    X, y, names = digits
    cache = backend.cache()
    meta = featcache.store.ensure_split(
        cache, "digits", "train", np.array([f"d{i}" for i in range(N)]), y, names, "array"
    )
    prov = make_provenance(
        backbone="pix",
        dataset="digits",
        split="train",
        kind="pooled",
        dim=DIM,
        n=N,
        dataset_fingerprint=meta.fingerprint,
        chunk_rows=CHUNK,
        dtype="float16",
    )
    w = FeatureWriter(cache, "pix", "digits", "train", {"pooled": prov}).prepare()
    w.write_chunk(1, {"pooled": X[50:100]}, np.ones(50, bool))
    w.release()  # the job dies
    with pytest.raises(IncompleteStoreError, match="3 of 4 row chunks unfinished"):
        backend.cache("r").load("pix", "digits", "train")
    part = backend.cache("r").load("pix", "digits", "train", allow_partial=True)
    assert part.valid.sum() == 50
    assert part.valid[50:100].all()
    assert any("3 of 4 chunks not marked done" in p for p in verify(backend.target, backend.opts))
    w2 = FeatureWriter(backend.cache(), "pix", "digits", "train", {"pooled": prov}).prepare()
    assert w2.pending_chunks() == [0, 2, 3]
    w2.release()
    _write(backend, digits)
    assert backend.cache("r").load("pix", "digits", "train").complete


def _flip_bit(backend, key: str, rng: random.Random) -> None:
    data = bytearray(backend.get(key))
    pos = rng.randrange(len(data) * 8)
    data[pos // 8] ^= 1 << (pos % 8)
    backend.set(key, bytes(data))


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_truncated_or_deleted_chunk(backend_fast, digits, damage):
    test_damaged_chunk_named_repaired_byte_identical(backend_fast, digits, damage)


@pytest.mark.parametrize("damage", ["bitflip"])
def test_damaged_chunk_named_repaired_byte_identical(backend, digits, damage):
    _write(backend, digits)
    good = backend.snapshot()
    key = f"{GROUP}/pooled/c/2/0"
    if damage == "bitflip":
        _flip_bit(backend, key, random.Random(0))
    elif damage == "truncate":
        backend.set(key, backend.get(key)[:-7])
    else:
        backend.delete(key)
    problems = verify(backend.target, backend.opts)
    assert len(problems) == 1
    assert "pooled" in problems[0]
    assert ("missing for marked chunks [2]" if damage == "delete" else "chunk 2 (rows 100-149) unreadable") in problems[
        0
    ]
    with pytest.raises(CorruptStoreError, match=r"pooled"):
        backend.cache("r").load("pix", "digits", "train")
    rep = VerifyReport()
    verify(backend.target, backend.opts, repair=True, report=rep)
    assert rep.to_recompute == {("pix", "digits", "train"): [2]}
    _write(backend, digits)  # the same "extract" again: recomputes chunk 2 only
    assert backend.snapshot() == good
    assert verify(backend.target, backend.opts) == []


@pytest.mark.parametrize("name", ["done", "valid", "error"])
def test_deleted_aux_array_recreated(backend_fast, digits, name):
    _write(backend_fast, digits)
    good = backend_fast.snapshot()
    for k in backend_fast.keys(f"{GROUP}/{name}/"):
        backend_fast.delete(k)
    problems = verify(backend_fast.target, backend_fast.opts)
    assert any(f"{GROUP}/{name}: array missing" in p for p in problems), problems
    with pytest.raises(CorruptStoreError):
        backend_fast.cache("r").load("pix", "digits", "train")
    assert backend_fast.cache("r").catalog()["complete"].to_list() == [False]
    _write(backend_fast, digits)  # a plain re-run recreates the array and recomputes what it must
    assert backend_fast.snapshot() == good
    assert verify(backend_fast.target, backend_fast.opts) == []


def test_label_corruption_detected_and_rewritten(backend_fast, digits):
    _write(backend_fast, digits)
    labels = zarr.open_array(backend_fast.cache().root.store, path="datasets/digits/train/labels", mode="r+")
    y = labels[:]
    labels[:10] = (y[:10] + 1) % 10
    problems = verify(backend_fast.target, backend_fast.opts)
    assert any("do not match the split's fingerprint" in p for p in problems), problems
    with pytest.raises(CorruptStoreError, match="fingerprint"):
        backend_fast.cache("r").load("pix", "digits", "train")
    _write(backend_fast, digits)  # re-running rewrites ids/labels from the data
    np.testing.assert_array_equal(backend_fast.cache("r").load("pix", "digits", "train").labels, digits[1])


def test_store_instance_and_top_level_open_cache(tmp_path, digits):
    store = zarr.storage.LocalStore(tmp_path / "s.zarr")
    X, y, names = digits
    write_features(
        featcache.open_cache(store, "a"),
        backbone="pix",
        dataset="digits",
        split="train",
        X=X,
        ids=[f"d{i}" for i in range(N)],
        labels=y,
        class_names=names,
    )
    assert featcache.open_cache(str(tmp_path / "s.zarr")).entries() == [("pix", "digits", "train")]


@pytest.mark.parametrize("bad", ["zarr.json", ".", "..", "a/b", ".zgroup", "x.json"])
def test_reserved_names_refused(tmp_path, digits, bad):
    X, y, names = digits
    with pytest.raises(SchemaMismatchError, match="invalid dataset name"):
        write_features(
            tmp_path / "r.zarr",
            backbone="pix",
            dataset=bad,
            split="train",
            X=X,
            ids=[f"d{i}" for i in range(N)],
            labels=y,
            class_names=names,
        )
