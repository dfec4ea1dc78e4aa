"""The contract of :class:`featcache.store.FeatureCache` on every kind of zarr store featcache is
tested on, through the shipped :class:`featcache.testing.FeatureCacheTests` (as zarr-python's
``StoreTests``): each subclass provides one kind of store (local folder, in-memory, S3 on a
loopback moto server). A new store backend passes when a five-line subclass of it does, in
this repository or outside it."""

from __future__ import annotations

import pytest
import zarr

from featcache.testing import FeatureCacheTests


@pytest.fixture(scope="module")
def moto_s3(s3_bucket):
    """A bucket on the moto S3 server on loopback (tests/store/conftest.py)."""
    return s3_bucket("contract")


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
