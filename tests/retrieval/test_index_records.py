"""Index records that cannot lie (issue 50, item 2): a stored FAISS index is reused only if its
record and the index itself agree with the gallery (``ntotal``/``d``, fingerprint, row ids,
factory, and a sample of the gallery's rows finding themselves in it); anything else is
rebuilt with a warning. ``[]``/``null``/truncated records are rebuilt, not a traceback, and
``featcache verify`` names them. Each test damages, runs the user's command, and asserts the
line and the numbers (the rebuilt index scores as the honest one)."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest

pytest.importorskip("faiss")

from featcache.cli import main
from featcache.store import write_features

FACTORY = "IVF4,Flat"


def _digits(n_gallery: int, n_query: int = 60):
    from sklearn.datasets import load_digits

    d = load_digits()
    X = d.data.astype(np.float32)
    return X, d.target, [str(c) for c in d.target_names], n_gallery, n_query


def _store(path: Path, n_gallery: int = 200, backbones=("a", "b")) -> str:
    """Two backbones of the same width (two seeded projections of the pixels) over digits:
    ``train`` (the gallery, ``n_gallery`` rows) and ``test`` (60 queries)."""
    X, y, names, ng, nq = _digits(n_gallery)
    for seed, b in enumerate(backbones):
        W = np.random.default_rng(seed).standard_normal((X.shape[1], 24)).astype(np.float32)
        F = np.maximum(X @ W, 0)
        for split, lo, hi in (("train", 0, ng), ("test", 1000, 1000 + nq)):
            write_features(
                str(path),
                backbone=b,
                dataset="digits",
                split=split,
                X=F[lo:hi],
                ids=[f"d{i}" for i in range(lo, hi)],
                labels=y[lo:hi],
                class_names=names,
                chunk_rows=64,
            )
    return str(path)


def _retrieve(cache: str, results: Path, backbone: str = "a", *more: str) -> int:
    args = ["retrieve", "--cache", cache, "--dataset", "digits", "--query", "test", "--gallery", "train"]
    args += ["--backbone", backbone, "--index", FACTORY, "--k", "1,5", "--no-knn", "--top-k-only"]
    return main([*args, "--results", str(results), "--no-progress", *more])


def _values(results: Path) -> dict:
    df = pl.read_parquet(results)
    return dict(zip(df["metric"].to_list(), df["value"].to_list()))


def _reused(results: Path) -> bool:
    h = pl.read_parquet(results)["hparams"][0]
    return (json.loads(h) if isinstance(h, str) else h)["index"]["reused"]


def _pairs(cache: str) -> dict[str, Path]:
    """The stored index files by backbone: {backbone: <key>.faiss} (one index per backbone here)."""
    out = {}
    for rec in sorted(Path(cache + ".indexes").glob("*.json")):
        out[json.loads(rec.read_text())["gallery"]["backbone"]] = rec.with_suffix(".faiss")
    return out


def _forge(record: Path, blob_from: Path) -> None:
    """Put another index's bytes under ``record``'s key, its sha256/bytes recomputed."""
    data = blob_from.read_bytes()
    record.with_suffix(".faiss").write_bytes(data)
    rec = json.loads(record.read_text())
    rec.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    record.write_text(json.dumps(rec))


def test_another_backbones_index_under_the_key_is_rebuilt(tmp_path, caplog):
    cache = _store(tmp_path / "c.zarr")
    assert _retrieve(cache, tmp_path / "a.parquet", "a") == 0
    assert _retrieve(cache, tmp_path / "b.parquet", "b") == 0
    honest = _values(tmp_path / "a.parquet")
    blobs = _pairs(cache)
    _forge(blobs["a"].with_suffix(".json"), blobs["b"])  # same width, same row count: other features
    with caplog.at_level(logging.WARNING, logger="featcache.retrieval.index"):
        assert _retrieve(cache, tmp_path / "a2.parquet", "a") == 0
    assert "gallery rows find themselves" in caplog.text
    assert "rebuilding it" in caplog.text
    assert not _reused(tmp_path / "a2.parquet")
    assert _values(tmp_path / "a2.parquet") == honest
    assert _retrieve(cache, tmp_path / "a3.parquet", "a") == 0  # the rebuilt index is reused
    assert _reused(tmp_path / "a3.parquet")


def test_an_index_of_an_earlier_smaller_gallery_is_rebuilt(tmp_path, caplog):
    old = _store(tmp_path / "old.zarr", n_gallery=100, backbones=("a",))
    assert _retrieve(old, tmp_path / "old.parquet") == 0
    cache = _store(tmp_path / "c.zarr", n_gallery=200, backbones=("a",))
    assert _retrieve(cache, tmp_path / "r.parquet") == 0
    honest = _values(tmp_path / "r.parquet")
    (new_blob,) = _pairs(cache).values()
    (stale,) = _pairs(old).values()
    _forge(new_blob.with_suffix(".json"), stale)
    with caplog.at_level(logging.WARNING, logger="featcache.retrieval.index"):
        assert _retrieve(cache, tmp_path / "r2.parquet") == 0
    assert "holds 100 x 24 vectors but its record says 200 x 24" in caplog.text
    assert _values(tmp_path / "r2.parquet") == honest  # gallery rows 100-199 are found again


@pytest.mark.parametrize("damage", ["[]", "null", "truncated", "no sha256"])
def test_a_damaged_record_is_rebuilt_and_named_by_verify(tmp_path, caplog, capsys, damage):
    cache = _store(tmp_path / "c.zarr", backbones=("a",))
    assert _retrieve(cache, tmp_path / "r.parquet") == 0
    honest = _values(tmp_path / "r.parquet")
    (blob,) = _pairs(cache).values()
    record = blob.with_suffix(".json")
    text = record.read_text()
    record.write_text(
        {"[]": "[]", "null": "null", "truncated": text[: len(text) // 2]}.get(damage)
        or json.dumps({k: v for k, v in json.loads(text).items() if k != "sha256"})
    )
    capsys.readouterr()
    assert main(["verify", cache]) == 1
    out = capsys.readouterr().out
    assert f"PROBLEM stored index {Path(cache + '.indexes')}/{blob.stem}: record {blob.stem}.json is" in out
    assert "featcache verify --repair" in out
    with caplog.at_level(logging.WARNING, logger="featcache.retrieval.index"):
        assert _retrieve(cache, tmp_path / "r2.parquet") == 0
    assert "rebuilding the index" in caplog.text
    assert "Traceback" not in capsys.readouterr().err
    assert _values(tmp_path / "r2.parquet") == honest
    assert main(["verify", cache]) == 0  # the rebuilt record verifies


def test_verify_repair_removes_a_forged_index(tmp_path, capsys):
    cache = _store(tmp_path / "c.zarr", backbones=("a",))
    assert _retrieve(cache, tmp_path / "r.parquet") == 0
    (blob,) = _pairs(cache).values()
    rec = json.loads(blob.with_suffix(".json").read_text())
    blob.write_bytes(blob.read_bytes()[:-8])  # the bytes changed, the record not
    assert main(["verify", cache]) == 1
    assert "does not match its record's sha256/bytes" in capsys.readouterr().out
    assert main(["verify", "--repair", cache]) == 0
    assert "verifies OK now" in capsys.readouterr().out
    assert not blob.exists()
    assert not blob.with_suffix(".json").exists()
    assert rec["n_gallery"] == 200


def test_a_fresh_featcache_verify_checks_the_indexes_too(tmp_path):
    """``featcache verify`` in its own process (which builds the store's parser only) runs the
    retrieval stage's index check too: featcache.cli registers the BESIDE_STORE that retrieval/cli.py declares, not an earlier retrieve."""
    cache = _store(tmp_path / "c.zarr", backbones=("a",))
    assert _retrieve(cache, tmp_path / "r.parquet") == 0
    (blob,) = _pairs(cache).values()
    blob.write_bytes(blob.read_bytes()[:-8])  # the bytes changed, the record not
    run = subprocess.run([sys.executable, "-m", "featcache", "verify", cache], capture_output=True, text=True)
    assert run.returncode == 1, run.stderr
    assert "does not match its record's sha256/bytes" in run.stdout
