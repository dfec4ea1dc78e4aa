"""The feature group's summary: `ls`/`catalog()` answer from it while it matches the stored
chunk markers and checksums, and read every marked chunk otherwise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from featcache.store import open_cache, write_features
from featcache.store.cache import FeatureCache
from featcache.store.summary import SUMMARY_KEY

G = "features/pix/digits/train"


@pytest.fixture
def store(tmp_path):
    from sklearn.datasets import load_digits

    d = load_digits()
    X, y = d.data[:300].astype(np.float32), d.target[:300]
    valid = np.ones(300, bool)
    valid[[3, 70, 200]] = False
    path = tmp_path / "c.zarr"
    write_features(
        path,
        backbone="pix",
        dataset="digits",
        split="train",
        X=X,
        ids=[f"d{i}" for i in range(300)],
        labels=y,
        class_names=[str(c) for c in d.target_names],
        chunk_rows=64,
        valid=valid,
    )
    return str(path)


def _no_scan(monkeypatch):
    calls = []
    real = FeatureCache.scan

    def counting(self, *a, **kw):
        calls.append(a)
        return real(self, *a, **kw)

    monkeypatch.setattr(FeatureCache, "scan", counting)
    return calls


def test_catalog_answers_from_the_writers_summary_without_reading_chunks(store, monkeypatch):
    s = dict(zarr.open_group(store, mode="r")[G].attrs[SUMMARY_KEY])
    assert (s["rows"], s["valid"], s["chunks"], s["done"]) == (300, 297, 5, 5)
    calls = _no_scan(monkeypatch)
    row = open_cache(store).catalog().row(0, named=True)
    assert (row["complete"], row["n_invalid"]) == (True, 3)
    assert calls == []  # no chunk was read


def test_a_chunk_rewritten_behind_the_writers_back_is_not_trusted(store, monkeypatch):
    # new bits in chunk 2 (valid, checksummed: only the checksum digest tells) -> the chunks are read
    zarr.open_group(store, mode="a")[G]["pooled"][128:192] = np.zeros((64, 64), np.float32)
    calls = _no_scan(monkeypatch)
    row = open_cache(store).catalog().row(0, named=True)
    assert (row["complete"], row["n_invalid"]) == (True, 3)
    assert len(calls) == 1


def test_a_flipped_byte_inside_a_chunk_is_verifys_to_find(store):
    """The summary digests the stored checksums, not the bytes they cover: a bit flipped inside
    a chunk after the write is found by `verify` (which decodes every chunk), and by load."""
    from featcache.errors import CorruptStoreError
    from featcache.store.verify import verify

    chunk = Path(store, G, "pooled", "c", "2", "0")
    raw = bytearray(chunk.read_bytes())
    raw[10] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    assert any("pooled" in p for p in verify(store))
    with pytest.raises(CorruptStoreError):
        open_cache(store).load("pix", "digits", "train")


def test_a_cleared_marker_is_not_trusted(store):
    zarr.open_group(store, mode="a")[G]["done"][4] = 0
    assert open_cache(store).catalog()["complete"].to_list() == [False]


def test_a_writer_reopening_the_group_to_write_chunks_drops_the_summary(store):
    from featcache.store.writer import FeatureWriter

    c = open_cache(store, "a")
    g = zarr.open_group(store, mode="a")[G]
    g["done"][1] = 0  # an interrupted re-run
    provs = {"pooled": c.provenance("pix", "digits", "train")}
    w = FeatureWriter(c, "pix", "digits", "train", provs).prepare()
    try:
        assert SUMMARY_KEY not in zarr.open_group(store, mode="r")[G].attrs
        assert w.pending_chunks() == [1]
    finally:
        w.release()
