"""The contract of :class:`featcache.store.FeatureCache` on any zarr store, shipped as zarr-python
ships ``zarr.testing.store.StoreTests``: a store backend written outside this repository (a zarr
``Store`` subclass, an fsspec file system) runs it with a few lines of its own tests::

    import pytest
    from featcache.testing import FeatureCacheTests


    class TestMyStore(FeatureCacheTests):
        @pytest.fixture
        def target(self, tmp_path):
            return MyStore(tmp_path / "c")  # what open_cache takes: a path, a URL or a Store

        def raw(self, target):
            return MyStore(target.root)  # a fresh Store on the same bytes, for damage

Set ``opts`` for storage options (an endpoint, keys), ``KIND`` and ``INNER`` to run the contract
on an N-d kind (``tokens@2x2``, ``INNER = (4,)``). The tests write digits' pixels as features,
read them back, resume an unfinished write, and damage the store through the zarr Store API (raw
bytes, as another process would), never through featcache. Needs pytest (the ``testing`` extra:
``pip install 'featcache[testing]'``); featcache's own backends run it in
tests/store/test_store_contract.py."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from zarr.abc.store import Store
from zarr.buffer import default_buffer_prototype

from featcache.errors import (
    CorruptStoreError,
    IncompleteStoreError,
    NotInStoreError,
    SchemaMismatchError,
    UsageError,
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

__all__ = ["CHUNK", "DIM", "GROUP", "Digits", "FeatureCacheTests", "N"]

#: digits pixels as features, labels, class names
Digits = tuple[np.ndarray, np.ndarray, list[str]]
#: rows written, feature width, rows per chunk, and the group the features land in
N, DIM, CHUNK = 120, 16, 40
GROUP = "features/pix/digits/train"


class FeatureCacheTests:
    """The tests every store backend passes. A subclass sets the ``target`` fixture (what
    :func:`open_cache` takes), ``opts`` (its storage options) and ``raw`` (a fresh zarr Store
    instance on the same bytes, for damage)."""

    #: the storage options :func:`open_cache` gets (e.g. an S3 endpoint and keys)
    opts: dict | None = None
    #: the feature kind written and read, and its axes between rows and DIM (issue 46: an N-d
    #: kind, ``rows x *INNER x DIM``, passes the same contract)
    KIND = "pooled"
    INNER: tuple[int, ...] = ()

    @pytest.fixture
    def target(self, tmp_path: Path) -> Any:
        """What :func:`open_cache` takes for a fresh, empty store: a path, a URL or a zarr Store."""
        raise UsageError(f"{type(self).__name__} gives the `target` fixture: a fresh store for open_cache")

    def raw(self, target: Any) -> Store:
        """A fresh zarr Store on the same bytes as ``target`` (damage is done through it)."""
        raise UsageError(f"{type(self).__name__} defines raw(target): a zarr Store on the target's bytes")

    @pytest.fixture(scope="class")
    @classmethod
    def digits_pixels(cls) -> Digits:
        """The first N digits images' pixels (scikit-learn's copy, no download), labels, class names."""
        from sklearn.datasets import load_digits

        d: Any = load_digits()
        return d.data[:N].astype(np.float32), d.target[:N], [str(c) for c in d.target_names]

    @pytest.fixture
    def digits(self, digits_pixels: Digits) -> Digits:
        """Rows of KIND's shape from digits' pixels: ``[N, DIM]``, or ``[N, *INNER, DIM]``."""
        X, y, names = digits_pixels
        width = int(np.prod(self.INNER, dtype=int)) * DIM
        return X[:, :width].reshape(N, *self.INNER, DIM), y, names

    # ---------------------------------------------------------------- helpers
    def cache(self, target: Any, mode: str = "a") -> FeatureCache:
        """The store at ``target`` through featcache, in ``mode``."""
        return open_cache(target, mode, storage_options=self.opts)

    def _run(self, target: Any, fn: Callable[[Store], Awaitable[Any]]) -> Any:
        async def go():
            return await fn(self.raw(target))

        return asyncio.run(go())

    def get(self, target: Any, key: str) -> bytes | None:
        """The raw bytes at ``key`` (None: absent), read past featcache."""

        async def f(st):
            b = await st.get(key, prototype=default_buffer_prototype())
            return None if b is None else b.to_bytes()

        return self._run(target, f)

    def delete(self, target: Any, key: str) -> None:
        """Delete ``key`` past featcache (as another process would)."""

        async def f(st):
            await st.delete(key)

        self._run(target, f)

    def chunks(self, target: Any, prefix: str = GROUP) -> dict[str, bytes | None]:
        """Every chunk file under ``prefix``, key -> bytes."""

        async def f(st):
            return sorted([k async for k in st.list_prefix(f"{prefix}/")])

        return {k: self.get(target, k) for k in self._run(target, f) if "/c/" in k}

    def write(self, target: Any, digits: Digits, backbone: str = "pix", split: str = "train", **kw: Any) -> np.ndarray:
        """Write ``digits`` as KIND features of ``backbone`` (rows 5 and 61 invalid); the valid mask."""
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
    def test_round_trip(self, target: Any, digits: Digits) -> None:
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

    def test_listing_and_catalog(self, target: Any, digits: Digits) -> None:
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

    def test_stored_fingerprint_is_the_loaded_one(self, target: Any, digits: Digits) -> None:
        self.write(target, digits)
        self.write(target, digits, backbone="pix2", weights_source="random:1")
        c = self.cache(target, "r")
        fps = {b: c.stored_fingerprint(b, "digits", "train", self.KIND) for b in ("pix", "pix2")}
        assert fps["pix"] == c.load("pix", "digits", "train", kind=self.KIND).fingerprint
        assert fps["pix2"] == c.load("pix2", "digits", "train", kind=self.KIND).fingerprint
        assert fps["pix"] != fps["pix2"]  # another backbone identity, another fingerprint
        with pytest.raises(NotInStoreError, match=re.escape(self.KIND)):
            c.stored_fingerprint("pix", "digits", "train", "cls")

    def test_absent_features_are_named(self, target: Any, digits: Digits) -> None:
        self.write(target, digits)
        c = self.cache(target, "r")
        with pytest.raises(NotInStoreError, match=r"no features for backbone 'vit'.*featcache extract"):
            c.load("vit", "digits", "train", kind=self.KIND)
        with pytest.raises(NotInStoreError, match="split 'val'"):
            c.split_meta("digits", "val")

    def test_unfinished_chunks_then_resume(self, target: Any, digits: Digits) -> None:
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

    def test_rewrite_is_a_no_op(self, target: Any, digits: Digits) -> None:
        self.write(target, digits)
        before = self.chunks(target)
        self.write(target, digits)
        assert self.chunks(target) == before

    def test_other_rows_for_a_stored_split_are_refused(self, target: Any, digits: Digits) -> None:
        self.write(target, digits)
        _X, y, names = digits
        with pytest.raises(SchemaMismatchError, match="different rows"):
            ensure_split(self.cache(target), "digits", "train", np.array([f"e{i}" for i in range(N)]), y, names, "x")

    def test_read_only_cache_refuses_to_write(self, target: Any, digits: Digits) -> None:
        self.write(target, digits)
        c = self.cache(target, "r")
        prov = c.provenance("pix", "digits", "train", self.KIND)
        with pytest.raises(SchemaMismatchError, match="mode='a'"):
            FeatureWriter(c, "pix", "digits", "train", {self.KIND: prov})

    def test_class_embeddings_round_trip(self, target: Any, digits: Digits) -> None:
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

    def test_deleted_chunk_is_refused_and_recomputed(self, target: Any, digits: Digits) -> None:
        self.write(target, digits)
        good = self.chunks(target)
        self.delete(target, f"{GROUP}/{self.KIND}/c/1/" + "0/" * len(self.INNER) + "0")
        with pytest.raises(CorruptStoreError, match=re.escape(f"chunk files missing for {self.KIND}: [1]")):
            self.cache(target, "r").load("pix", "digits", "train", kind=self.KIND)
        self.write(target, digits)  # the same write again recomputes chunk 1 only
        assert self.chunks(target) == good

    def test_group_metadata_is_json_with_its_summary(self, target: Any, digits: Digits) -> None:
        self.write(target, digits)
        doc = self.get(target, f"{GROUP}/zarr.json")
        assert doc is not None
        attrs = json.loads(doc)["attributes"]
        assert attrs["featcache_features"]["n"] == N
        assert attrs["featcache_summary"]["rows"] == N
        assert attrs["featcache_summary"]["valid"] == N - 2

    def test_a_complete_group_without_its_summary_is_refused_then_recomputed(self, target: Any, digits: Digits) -> None:
        valid = self.write(target, digits)
        g = zarr.open_group(self.raw(target), path=GROUP, mode="r+")
        del g.attrs["featcache_summary"]  # nothing binds its chunks to this group any more
        with pytest.raises(CorruptStoreError, match="every row chunk is marked done but its summary"):
            self.cache(target, "r").load("pix", "digits", "train", kind=self.KIND)
        self.write(target, digits)  # the same write again recomputes every chunk
        f = self.cache(target, "r").load("pix", "digits", "train", kind=self.KIND)
        np.testing.assert_array_equal(f.X[valid], digits[0][valid])
