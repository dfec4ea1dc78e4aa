"""``featcache audit`` hardening (issue 60): it never writes over a table it does not own, refuses
N-d kinds, non-finite features and unwritable ``--out`` paths in one line, reaches the images of
a ``--limit``'d split, and says when a collapsed feature space makes its flags no evidence.

The stores are written through the writer API (as an extract) from scikit-learn's digits pixels,
so each case has the features it needs (tokens, NaN rows, a collapsed space)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from featcache.cli import main
from featcache.core.results import append_results, read_results
from featcache.store import FeatureWriter, ensure_split, make_provenance, open_cache

N_TRAIN, N_TEST = 300, 150


def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.float32), d.target, [str(c) for c in d.target_names]


def _store(path: Path, feats: dict[str, np.ndarray], source: str = "sklearn.datasets.load_digits[:600]") -> str:
    """Backbone ``pix`` on dataset ``digits``: train = rows [0, 300), test = [300, 450) of ``feats``
    (every kind), ids ``digits-<row>`` as the digits reader names them."""
    _, y, names = _digits()
    cache = open_cache(str(path), "a")
    for split, rows in (("train", np.arange(N_TRAIN)), ("test", np.arange(N_TRAIN, N_TRAIN + N_TEST))):
        ids = np.array([f"digits-{r}" for r in rows])
        meta = ensure_split(cache, "digits", split, ids, y[rows], names, source)
        provs = {
            k: make_provenance(
                backbone="pix",
                dataset="digits",
                split=split,
                kind=k,
                dim=x.shape[1:],
                n=len(rows),
                dataset_fingerprint=meta.fingerprint,
                chunk_rows=64,
                dtype="float32",
            )
            for k, x in feats.items()
        }
        w = FeatureWriter(cache, "pix", "digits", split, provs).prepare()
        for i in w.pending_chunks():
            s, e = w.chunk_range(i)
            w.write_chunk(i, {k: x[rows][s:e] for k, x in feats.items()}, np.ones(e - s, bool))
        w.mark_complete()
    return str(path)


@pytest.fixture(scope="module")
def pixels(tmp_path_factory) -> str:
    img, _, _ = _digits()
    n = N_TRAIN + N_TEST
    quads = img[:n].reshape(n, 2, 4, 2, 4).transpose(0, 1, 3, 2, 4).reshape(n, 4, 16)
    return _store(tmp_path_factory.mktemp("px") / "px.zarr", {"pooled": img[:n].reshape(n, 64), "tokens": quads})


def _audit(cache: str, out, *extra: str) -> list[str]:
    return ["audit", "--cache", cache, "--dataset", "digits", "--backbone", "pix", "--out", str(out), *extra]


def _probe_rows(p: Path) -> bytes:
    rows = [
        {"run_id": "probe-run", "kind": "probe", "backbone": "b", "dataset": "digits", "metric": "top1", "value": 0.9}
    ]
    append_results(p, rows)
    return p.read_bytes()


def test_out_equal_to_results_is_refused_before_anything_is_written(pixels, tmp_path, capsys):
    """Issue 60: ``audit --out X --results X`` replaced a probe's rows with the pairs table."""
    res = tmp_path / "results.parquet"
    before = _probe_rows(res)
    assert main(_audit(pixels, res, "--results", str(res))) == 1
    err = capsys.readouterr().err.strip()
    assert "is the --results table" in err
    assert len(err.splitlines()) == 1
    assert res.read_bytes() == before
    assert sorted(f.name for f in tmp_path.iterdir()) == [".results.parquet.lock", "results.parquet"]
    new = tmp_path / "new.parquet"  # neither exists yet: the same path is still one table
    assert main(_audit(pixels, new, "--results", str(tmp_path / "." / "new.parquet"))) == 1
    assert not new.exists()


@pytest.mark.parametrize("name", ["results.parquet", "notes.csv", "other.parquet"])
def test_an_existing_table_that_is_not_a_pairs_table_is_never_replaced(pixels, tmp_path, capsys, name):
    p = tmp_path / name
    if name == "results.parquet":
        before = _probe_rows(p)
    elif name == "notes.csv":
        p.write_text("a,b\n1,2\n")
        before = p.read_bytes()
    else:
        pl.DataFrame({"x": [1, 2]}).write_parquet(p)
        before = p.read_bytes()
    assert main(_audit(pixels, p)) == 1
    err = capsys.readouterr().err.strip()
    assert "is not an audit pairs table" in err
    assert len(err.splitlines()) == 1
    assert p.read_bytes() == before
    assert not (tmp_path / f"{p.stem}.nn.png").exists()
    if name == "results.parquet":
        assert read_results(p)["run_id"].to_list() == ["probe-run"]


def test_an_audit_pairs_table_is_replaced_and_a_killed_writers_tmp_removed(pixels, tmp_path, capsys):
    out = tmp_path / "pairs.csv"
    assert main(_audit(pixels, out, "--threshold", "0.95")) == 0
    first = pl.read_csv(out)
    orphan = tmp_path / ".pairs.csv.k1ll3d.tmp"
    orphan.write_bytes(b"partial")
    assert main(_audit(pixels, out, "--threshold", "0.99")) == 0  # its own table: replaced
    assert not orphan.exists()
    again = pl.read_csv(out)
    assert again.height <= first.height
    assert (again["cosine"] >= 0.99).all()
    capsys.readouterr()


def test_out_naming_a_folder_or_an_unwritable_place_is_one_line(pixels, tmp_path, capsys):
    (tmp_path / "dir.csv").mkdir()
    assert main(_audit(pixels, tmp_path / "dir.csv")) == 1
    err = capsys.readouterr().err.strip()
    assert "is a folder" in err
    assert len(err.splitlines()) == 1
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        target = ro / "pairs.csv"
    elif os.path.isdir("/proc"):
        target = Path("/proc/featcache-audit/pairs.csv")  # root ignores permission bits
    else:
        pytest.skip("no unwritable folder available")
    assert main(_audit(pixels, target)) == 1
    err = capsys.readouterr().err.strip()
    assert "cannot write --out" in err
    assert len(err.splitlines()) == 1


def test_an_nd_kind_is_refused_naming_the_vector_kinds(pixels, tmp_path, capsys):
    assert main(_audit(pixels, tmp_path / "p.csv", "--kind", "tokens")) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--kind tokens" in err
    assert "(pooled)" in err
    assert not list(tmp_path.iterdir())


def test_non_finite_features_are_named_with_their_rows(tmp_path, capsys):
    img, _, _ = _digits()
    X = img[: N_TRAIN + N_TEST].reshape(-1, 64).copy()
    X[[3, 17], 5] = np.nan
    X[N_TRAIN + 2, 0] = np.inf
    cache = _store(tmp_path / "nan.zarr", {"pooled": X})
    assert main(_audit(cache, tmp_path / "p.csv")) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "2 row(s) hold NaN or infinite features (digits-3, digits-17)" in err
    X[[3, 17], 5] = 0
    cache = _store(tmp_path / "inf.zarr", {"pooled": X})
    assert main(_audit(cache, tmp_path / "p.csv")) == 1
    assert f"digits-{N_TRAIN + 2}" in capsys.readouterr().err


def test_a_limited_digits_split_is_hashed(pixels, tmp_path, capsys):
    """Issue 60: ``sklearn.datasets.load_digits[:600]`` (extract --limit) was "images unreachable"."""
    assert main(_audit(pixels, tmp_path / "p.parquet")) == 0
    out = capsys.readouterr().out
    assert "exact duplicates checked by content hash" in out
    assert (tmp_path / "p.pairs.png").exists() or pl.read_parquet(tmp_path / "p.parquet").height == 0


def test_a_collapsed_space_is_named_in_the_output_the_results_and_the_report(tmp_path, capsys):
    """Issue 60: on a random-init ViT every neighbour is "near" (threshold 0.9998): the audit
    flags rows but must say those flags are no evidence, wherever it shows them."""
    img, _, _ = _digits()
    n = N_TRAIN + N_TEST
    rng = np.random.default_rng(0)
    common = rng.normal(size=64).astype(np.float32) * 100
    X = common + img[:n].reshape(n, 64) * 0.05  # every row a whisper around one direction
    cache = _store(tmp_path / "flat.zarr", {"pooled": X})
    res = tmp_path / "r.parquet"
    _probe_rows(res)  # a report needs a score to rank
    assert main(_audit(cache, tmp_path / "p.parquet", "--results", str(res))) == 0
    out = capsys.readouterr().out
    assert "collapsed feature space" in out
    assert "not evidence" in out
    rows = read_results(res).filter(pl.col("kind") == "audit")
    assert {json.loads(h)["collapsed"] for h in rows["hparams"]} == {True}
    assert rows.filter(pl.col("metric") == "random_pair_cosine")["value"][0] >= 0.95
    assert rows.filter(pl.col("metric") == "nn_cosine_median")["value"][0] >= 0.998
    html = tmp_path / "report.html"
    assert main(["report", "--results", str(res), "--out", str(html)]) == 0
    text = html.read_text()
    assert "collapsed feature space" in text.lower()
    assert "pix" in text


def test_a_real_space_is_not_called_collapsed(pixels, tmp_path, capsys):
    res = tmp_path / "r.parquet"
    assert main(_audit(pixels, tmp_path / "p.parquet", "--results", str(res))) == 0
    assert "collapsed" not in capsys.readouterr().out
    assert {json.loads(h)["collapsed"] for h in read_results(res)["hparams"]} == {False}


def test_a_healthy_space_full_of_real_copies_is_not_called_collapsed(tmp_path, capsys):
    """Every test row a copy of a training row: nearest neighbours at cosine 1, but random
    pairs far apart; the flags there are evidence, and the audit says nothing against them."""
    img, _, _ = _digits()
    X = img[: N_TRAIN + N_TEST].reshape(-1, 64).copy()
    X[N_TRAIN:] = X[:N_TEST]
    cache = _store(tmp_path / "copies.zarr", {"pooled": X})
    assert main(_audit(cache, tmp_path / "p.csv", "--threshold", "0.999")) == 0
    out = capsys.readouterr().out
    assert f"test: {N_TEST} of {N_TEST} rows flagged" in out
    assert "collapsed" not in out
