"""The contract of :class:`featcache.store.FeatureCache` on every kind of zarr store, as
zarr-python's ``StoreTests``: :class:`FeatureCacheTests` holds the tests, and each subclass
provides one kind of store (local folder, in-memory, S3 on a loopback moto server). A new
store backend passes when a five-line subclass of it does. Damage is done through the zarr
Store API (raw bytes, as another process would), never through featcache."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest
import zarr
from zarr.buffer import default_buffer_prototype

from featcache.errors import (
    CorruptStoreError,
    IncompleteStoreError,
    NotInStoreError,
    SchemaMismatchError,
)
from featcache.store import (
    FeatureCache,
    FeatureWriter,
    ensure_split,
    make_provenance,
    open_cache,
    write_class_embeddings,
    write_features,
)

N, DIM, CHUNK = 120, 16, 40
GROUP = "features/pix/digits/train"


@pytest.fixture(scope="module")
def digits_pixels():
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.data[:N].astype(np.float32), d.target[:N], [str(c) for c in d.target_names]


@pytest.fixture(scope="module")
def moto_s3(s3_bucket):
    """A bucket on the moto S3 server on loopback (tests/store/conftest.py)."""
    return s3_bucket("contract")


class FeatureCacheTests:
    """The tests every store backend passes. A subclass sets the ``target`` fixture (what
    :func:`open_cache` takes), ``opts`` (its storage options) and ``raw`` (a fresh zarr Store
    instance on the same bytes, for damage)."""

    opts: dict | None = None
    #: the feature kind written and read, and its axes between rows and DIM (issue 46: an N-d
    #: kind, ``rows x *INNER x DIM``, passes the same contract)
    KIND = "pooled"
    INNER: tuple[int, ...] = ()

    @pytest.fixture
    def target(self, tmp_path):
        raise NotImplementedError

    @pytest.fixture
    def digits(self, digits_pixels):
        """Rows of KIND's shape from digits' pixels: ``[N, DIM]``, or ``[N, *INNER, DIM]``."""
        X, y, names = digits_pixels
        width = int(np.prod(self.INNER, dtype=int)) * DIM
        return X[:, :width].reshape(N, *self.INNER, DIM), y, names

    def raw(self, target):
        raise NotImplementedError

    # ---------------------------------------------------------------- helpers
    def cache(self, target, mode: str = "a") -> FeatureCache:
        return open_cache(target, mode, storage_options=self.opts)

    def _run(self, target, fn):
        async def go():
            return await fn(self.raw(target))

        return asyncio.run(go())

    def get(self, target, key: str) -> bytes | None:
        async def f(st):
            b = await st.get(key, prototype=default_buffer_prototype())
            return None if b is None else b.to_bytes()

        return self._run(target, f)

    def delete(self, target, key: str) -> None:
        async def f(st):
            await st.delete(key)

        self._run(target, f)

    def chunks(self, target, prefix: str = GROUP) -> dict[str, bytes]:
        async def f(st):
            return sorted([k async for k in st.list_prefix(f"{prefix}/")])

        return {k: self.get(target, k) for k in self._run(target, f) if "/c/" in k}

    def write(self, target, digits, backbone: str = "pix", split: str = "train", **kw) -> np.ndarray:
        X, y, names = digits
        valid = np.ones(N, bool)
        valid[[5, 61]] = False
        write_features(
            self.cache(target),
            backbone=backbone,
            dataset="digits",
            split=split,
            X=X,
            ids=[f"d{i}" for i in range(N)],
            labels=y,
            class_names=names,
            chunk_rows=CHUNK,
            valid=valid,
            kind=self.KIND,
            **kw,
        )
        return valid

    # ---------------------------------------------------------------- the contract
    def test_round_trip(self, target, digits):
        valid = self.write(target, digits)
        f = self.cache(target, "r").load("pix", "digits", "train", kind=self.KIND)
        np.testing.assert_array_equal(f.X[valid], digits[0][valid])
        assert np.isnan(f.X[~valid]).all()
        assert f.valid.tolist() == valid.tolist()
        assert f.ids.tolist() == [f"d{i}" for i in range(N)]
        np.testing.assert_array_equal(f.labels, digits[1])
        assert f.complete
        assert f.class_names == digits[2]
        lazy = self.cache(target, "r").load("pix", "digits", "train", kind=self.KIND, lazy=True)
        np.testing.assert_array_equal(np.asarray(lazy.X[np.flatnonzero(valid)]), digits[0][valid])

    def test_listing_and_catalog(self, target, digits):
        self.write(target, digits)
        self.write(target, digits, split="test")
        c = self.cache(target, "r")
        assert c.backbones() == ["pix"]
        assert c.datasets() == ["digits"]
        assert c.splits("digits") == ["test", "train"]
        assert c.kinds("pix", "digits", "train") == [self.KIND]
        assert c.entries() == [("pix", "digits", "test"), ("pix", "digits", "train")]
        cat = c.catalog()
        assert cat["complete"].to_list() == [True, True]
        assert cat["n_invalid"].to_list() == [2, 2]
        assert cat["n"].to_list() == [N, N]
        assert cat["dim"].to_list() == [DIM, DIM]

    def test_stored_fingerprint_is_the_loaded_one(self, target, digits):
        self.write(target, digits)
        self.write(target, digits, backbone="pix2", weights_source="random:1")
        c = self.cache(target, "r")
        fps = {b: c.stored_fingerprint(b, "digits", "train", self.KIND) for b in ("pix", "pix2")}
        assert fps["pix"] == c.load("pix", "digits", "train", kind=self.KIND).fingerprint
        assert fps["pix2"] == c.load("pix2", "digits", "train", kind=self.KIND).fingerprint
        assert fps["pix"] != fps["pix2"]  # another backbone identity, another fingerprint
        with pytest.raises(NotInStoreError, match=re.escape(self.KIND)):
            c.stored_fingerprint("pix", "digits", "train", "cls")

    def test_absent_features_are_named(self, target, digits):
        self.write(target, digits)
        c = self.cache(target, "r")
        with pytest.raises(NotInStoreError, match=r"no features for backbone 'vit'.*featcache extract"):
            c.load("vit", "digits", "train", kind=self.KIND)
        with pytest.raises(NotInStoreError, match="split 'val'"):
            c.split_meta("digits", "val")

    def test_unfinished_chunks_then_resume(self, target, digits):
        X, y, names = digits
        c = self.cache(target)
        meta = ensure_split(c, "digits", "train", np.array([f"d{i}" for i in range(N)]), y, names, "array")
        prov = make_provenance(
            backbone="pix",
            dataset="digits",
            split="train",
            kind=self.KIND,
            dim=(*self.INNER, DIM),
            n=N,
            dataset_fingerprint=meta.fingerprint,
            chunk_rows=CHUNK,
            dtype="float32",
        )
        w = FeatureWriter(c, "pix", "digits", "train", {self.KIND: prov}).prepare()
        w.write_chunk(1, {self.KIND: X[40:80]}, np.ones(40, bool))
        w.release()  # the job dies
        with pytest.raises(IncompleteStoreError, match="2 of 3 row chunks unfinished"):
            self.cache(target, "r").load("pix", "digits", "train", kind=self.KIND)
        part = self.cache(target, "r").load("pix", "digits", "train", kind=self.KIND, allow_partial=True)
        assert part.valid.tolist() == [False] * 40 + [True] * 40 + [False] * 40
        assert not part.complete
        assert self.cache(target, "r").catalog()["complete"].to_list() == [False]
        valid = self.write(target, digits)
        f = self.cache(target, "r").load("pix", "digits", "train", kind=self.KIND)
        np.testing.assert_array_equal(f.X[valid], X[valid])

    def test_rewrite_is_a_no_op(self, target, digits):
        self.write(target, digits)
        before = self.chunks(target)
        self.write(target, digits)
        assert self.chunks(target) == before

    def test_other_rows_for_a_stored_split_are_refused(self, target, digits):
        self.write(target, digits)
        _X, y, names = digits
        with pytest.raises(SchemaMismatchError, match="different rows"):
            ensure_split(self.cache(target), "digits", "train", np.array([f"e{i}" for i in range(N)]), y, names, "x")

    def test_read_only_cache_refuses_to_write(self, target, digits):
        self.write(target, digits)
        c = self.cache(target, "r")
        prov = c.provenance("pix", "digits", "train", self.KIND)
        with pytest.raises(SchemaMismatchError, match="mode='a'"):
            FeatureWriter(c, "pix", "digits", "train", {self.KIND: prov})

    def test_class_embeddings_round_trip(self, target, digits):
        self.write(target, digits)
        m = np.arange(10 * DIM, dtype=np.float32).reshape(10, DIM)
        assert not self.cache(target, "r").has_class_embeddings("digits", backbone="pix")
        write_class_embeddings(self.cache(target), "digits", m, backbone="pix", provenance={"tower": "t"})
        c = self.cache(target, "r")
        np.testing.assert_array_equal(c.load_class_embeddings("digits", backbone="pix"), m)
        assert c.has_class_embeddings("digits", backbone="pix")
        assert not c.has_class_embeddings("digits")  # no dataset-level matrix: no fallback
        assert c.class_embeddings_provenance("digits", backbone="pix") == {"tower": "t"}
        if self.KIND == "pooled":  # the width is checked against pooled features
            with pytest.raises(SchemaMismatchError, match="width 3"):
                write_class_embeddings(self.cache(target), "digits", m[:, :3], backbone="pix")

    def test_deleted_chunk_is_refused_and_recomputed(self, target, digits):
        self.write(target, digits)
        good = self.chunks(target)
        self.delete(target, f"{GROUP}/{self.KIND}/c/1/" + "0/" * len(self.INNER) + "0")
        with pytest.raises(CorruptStoreError, match=re.escape(f"chunk files missing for {self.KIND}: [1]")):
            self.cache(target, "r").load("pix", "digits", "train", kind=self.KIND)
        self.write(target, digits)  # the same write again recomputes chunk 1 only
        assert self.chunks(target) == good

    def test_group_metadata_is_json_with_its_summary(self, target, digits):
        self.write(target, digits)
        attrs = json.loads(self.get(target, f"{GROUP}/zarr.json"))["attributes"]
        assert attrs["featcache_features"]["n"] == N
        assert attrs["featcache_summary"]["rows"] == N
        assert attrs["featcache_summary"]["valid"] == N - 2

    def test_a_complete_group_without_its_summary_is_refused_then_recomputed(self, target, digits):
        valid = self.write(target, digits)
        g = zarr.open_group(self.raw(target), path=GROUP, mode="r+")
        del g.attrs["featcache_summary"]  # nothing binds its chunks to this group any more
        with pytest.raises(CorruptStoreError, match="every row chunk is marked done but its summary"):
            self.cache(target, "r").load("pix", "digits", "train", kind=self.KIND)
        self.write(target, digits)  # the same write again recomputes every chunk
        f = self.cache(target, "r").load("pix", "digits", "train", kind=self.KIND)
        np.testing.assert_array_equal(f.X[valid], digits[0][valid])


class TestLocalStore(FeatureCacheTests):
    @pytest.fixture
    def target(self, tmp_path):
        return str(tmp_path / "c.zarr")

    def raw(self, target):
        return zarr.storage.LocalStore(target)


class TestMemoryStore(FeatureCacheTests):
    @pytest.fixture
    def target(self):
        return zarr.storage.MemoryStore()

    def raw(self, target):
        return target


@pytest.mark.slow
class TestS3Store(FeatureCacheTests):
    @pytest.fixture
    def target(self, tmp_path, moto_s3):
        self.opts = moto_s3
        return f"s3://contract/{tmp_path.name}/c.zarr"

    def raw(self, target):
        return zarr.storage.FsspecStore.from_url(
            target, storage_options={**(self.opts or {}), "skip_instance_cache": True}
        )


# ---------------------------------------------------------------- the contract on N-d kinds (issue 46)
class TestLocalStoreTokens(TestLocalStore):
    KIND = "tokens@2x2"
    INNER = (4,)


class TestMemoryStoreBlocks(TestMemoryStore):
    KIND = "blocks:4"
    INNER = (4,)


@pytest.mark.slow  # two inner axes; one inner axis runs in the fast tier
class TestLocalStoreTwoInnerAxes(TestLocalStore):
    KIND = "tokens"
    INNER = (2, 2)


class TestS3StoreTokens(TestS3Store):  # slow, as its parent: ':' and '@' in S3 keys
    KIND = "tokens@2x2"
    INNER = (4,)


class TestS3StoreBlocks(TestS3Store):
    KIND = "blocks:4"
    INNER = (4,)
