"""run_probes and `featcache probe` on real lite0 features: floors, protocols, results rows,
skip/force, determinism, and every bad-input error."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import numpy as np
import polars as pl
import pytest

from featcache.core.results import RESULT_COLUMNS
from featcache.errors import NotInStoreError, ProbeError
from featcache.probes import ProbeConfig, run_probes
from featcache.probes.store_lookup import run_ids

LITE0 = "tf_efficientnet_lite0"
SMALL_GRID = [1e-3, 1e-2, 1e-1, 1.0]  # keeps most tests quick; the default grid runs once


@pytest.fixture(scope="module")
def digits_feats(digits_cache):
    from featcache.store import open_cache

    c = open_cache(digits_cache)
    return c.load(LITE0, "digits", "train"), c.load(LITE0, "digits", "test")


def _store(path, feats, *, backbone=LITE0, dataset="digits", train=None, test=None):
    """Write (X, ids, labels[, valid, class_names]) splits built from real features."""
    from featcache.store import write_features

    tr, te = feats
    for split, f, over in (("train", tr, train), ("test", te, test)):
        over = over or {}
        write_features(
            str(path),
            backbone=backbone,
            dataset=dataset,
            split=split,
            X=over.get("X", f.X),
            ids=over.get("ids", f.ids),
            labels=over.get("labels", f.labels),
            class_names=over.get("class_names", f.class_names),
            valid=over.get("valid"),
        )
    return str(path)


def _top1(df, **where):
    sub = df.filter(pl.col("metric") == "top1")
    for k, v in where.items():
        sub = sub.filter(pl.col(k) == v)
    return sub["value"].to_list()


# ------------------------------------------------------------------ protocols on real data
def test_full_protocol_digits_default_grid(digits_cache, tmp_path):
    res = tmp_path / "r.parquet"
    df = run_probes(ProbeConfig(digits_cache, [LITE0], "digits", "full", results_path=res, progress=False))
    assert set(df["metric"]) == {"top1", "top5", "mean_per_class", "nll", "ece"}
    assert df.height == 5
    assert df["run_id"].n_unique() == 1
    for col in RESULT_COLUMNS:  # every column filled
        assert df[col].null_count() == 0, col
    row = df.row(0, named=True)
    assert (row["kind"], row["protocol"], row["eval_split"], row["shots"], row["n_eval"]) == (
        "probe",
        "full",
        "test",
        -1,
        450,
    )
    assert row["train_split"] == "train"  # no official val: 10% holdout, refit on all train
    hp = json.loads(row["hparams"])
    assert hp["n_grid"] == 45
    assert 1e-6 <= hp["C"] <= 1e5
    assert (hp["n_train"], hp["n_val"], hp["n_train_final"]) == (1212, 135, 1347)
    assert hp["n_invalid"] == {"train": 0, "test": 0}
    # a broken probe or selection falls below. Measured margin (of 450 test images):
    # 1 thread: top1 0.9422, mean_per_class 0.9419, ece 0.0424; 2 threads: the same
    assert _top1(df)[0] > 0.93
    assert df.filter(pl.col("metric") == "mean_per_class")["value"][0] > 0.93
    assert df.filter(pl.col("metric") == "ece")["value"][0] < 0.1
    assert df["converged"].all()
    stored = pl.read_parquet(res)
    assert stored.height == 5


def test_skip_existing_and_force(digits_cache, tmp_path, caplog):
    res = tmp_path / "r.parquet"
    a = run_probes(ProbeConfig(digits_cache, LITE0, "digits", "full", results_path=res, Cs=SMALL_GRID, progress=False))
    with caplog.at_level(logging.INFO, logger="featcache.probes.runner"):
        b = run_probes(
            ProbeConfig(digits_cache, LITE0, "digits", "full", results_path=res, Cs=SMALL_GRID, progress=False)
        )
    assert "skip" in caplog.text
    assert a.sort("metric")["created_at"].to_list() == b.sort("metric")["created_at"].to_list()
    c = run_probes(
        ProbeConfig(digits_cache, LITE0, "digits", "full", results_path=res, Cs=SMALL_GRID, force=True, progress=False)
    )
    # rerun gives the same numbers (deterministic) and the table holds the run once
    assert np.allclose(a.sort("metric")["value"].to_numpy(), c.sort("metric")["value"].to_numpy())
    assert pl.read_parquet(res).height == 5
    # a different grid is a different run
    d = run_probes(ProbeConfig(digits_cache, LITE0, "digits", "full", results_path=res, Cs=[1e-2, 1.0], progress=False))
    assert d["run_id"][0] != a["run_id"][0]
    assert pl.read_parquet(res).height == 10


def test_fewshot_seeds_shots_and_determinism(digits_cache):
    df = run_probes(ProbeConfig(digits_cache, LITE0, "digits", "fewshot:5", Cs=SMALL_GRID, progress=False))
    top = df.filter(pl.col("metric") == "top1").sort("seed")
    assert top["seed"].to_list() == [0, 1, 2]
    assert set(top["shots"]) == {5}
    assert set(top["train_split"]) == {"train[fewshot:5]"}
    hp = json.loads(top["hparams"][0])
    assert (hp["n_train"], hp["n_val"], hp["n_train_final"]) == (40, 10, 50)
    assert hp["shots_counted"] == "before-split"
    # 5 images per class; measured seeds 0/1/2: 1 thread 0.6467/0.6556/0.6578, 2 threads the same
    assert min(top["value"]) > 0.5
    again = run_probes(
        ProbeConfig(digits_cache, LITE0, "digits", "fewshot:5", seeds=[1], Cs=SMALL_GRID, progress=False)
    )
    assert _top1(again) == _top1(df, seed=1)


def test_vtab1k_sizes_and_median(digits_cache, tmp_path):
    res = tmp_path / "r.parquet"
    df = run_probes(
        ProbeConfig(digits_cache, LITE0, "digits", "vtab1k", results_path=res, Cs=SMALL_GRID, progress=False)
    )
    seeds = df.filter(pl.col("seed") >= 0)
    hp = json.loads(seeds["hparams"][0])
    assert (hp["n_train"], hp["n_val"], hp["n_train_final"]) == (800, 200, 1000)
    assert hp["val_source"] == "split-800-200"
    med = df.filter((pl.col("seed") == -1) & (pl.col("metric") == "top1"))
    assert med.height == 1
    assert med["value"][0] == pytest.approx(float(np.median(_top1(seeds))))
    assert json.loads(med["hparams"][0])["seeds"] == [0, 1, 2]
    assert pl.read_parquet(res).filter(pl.col("seed") == -1).height == df.filter(pl.col("seed") == -1).height
    with pytest.raises(ProbeError, match="official-val"):
        run_probes(
            ProbeConfig(
                digits_cache, LITE0, "digits", "vtab1k", val_source="official-val", Cs=SMALL_GRID, progress=False
            )
        )


def test_subset_10pct(digits_cache):
    df = run_probes(ProbeConfig(digits_cache, LITE0, "digits", "subset:10%", Cs=SMALL_GRID, progress=False))
    hp = json.loads(df["hparams"][0])
    assert hp["n_subset"] == 135
    assert hp["n_train_final"] == 135
    assert df["train_split"][0] == "train[subset:10%]"
    assert _top1(df)[0] > 0.72  # 135 images; measured 1 thread 0.7822, 2 threads 0.7822


def test_salman_sgd_short_schedule(digits_cache):
    df = run_probes(ProbeConfig(digits_cache, LITE0, "digits", "salman", sgd_epochs=6, progress=False))
    hp = json.loads(df["hparams"][0])
    assert hp["solver"] == "sgd"
    assert hp["epochs"] == 6
    assert hp["lr_decay_epochs"] == [2, 4]
    assert hp["lr"] in (0.01, 0.001)
    assert hp["batch_size"] == 64
    assert hp["momentum"] == 0.9
    assert hp["weight_decay"] == 5e-4
    assert _top1(df)[0] > 0.85  # measured 1 thread 0.8844, 2 threads 0.8844


def test_vtab1k_sgd_short_schedule(digits_cache):
    df = run_probes(
        ProbeConfig(digits_cache, LITE0, "digits", "vtab1k-sgd", seeds=[0], vtab_steps=(30,), progress=False)
    )
    hp = json.loads(df["hparams"][0])
    assert hp["batch_size"] == 512
    assert hp["weight_decay"] == 0.0
    assert hp["lr"] in (0.1, 0.01)
    assert hp["milestones"] == [10, 20, 27]
    assert hp["last_decay"] == 0.9
    assert _top1(df)[0] > 0.7  # measured 1 thread 0.8689, 2 threads 0.8689


def test_fmnist_full_floor(fmnist_cache):
    df = run_probes(ProbeConfig(fmnist_cache, LITE0, "fashion-mnist-small", "full", Cs=SMALL_GRID, progress=False))
    # lite0 @112 px, 2,000 train images: measured ~0.80
    assert _top1(df)[0] > 0.74
    assert df["n_eval"][0] == 1000


def test_head_init_from_stored_class_embeddings(digits_feats, tmp_path):
    from featcache.store import write_class_embeddings

    tr, _ = digits_feats
    path = _store(tmp_path / "c.zarr", digits_feats)
    protos = np.stack([tr.X[tr.labels == c].mean(0) for c in range(10)])
    write_class_embeddings(path, "digits", protos, name="protos")
    df = run_probes(ProbeConfig(path, LITE0, "digits", "full", Cs=SMALL_GRID, head_init="protos", progress=False))
    assert json.loads(df["hparams"][0])["head_init"] == "protos"
    assert _top1(df)[0] > 0.93
    write_class_embeddings(path, "digits", protos[:, :10], name="bad")
    with pytest.raises(ProbeError, match="one row per class"):
        run_probes(ProbeConfig(path, LITE0, "digits", "full", Cs=SMALL_GRID, head_init="bad", progress=False))


# ------------------------------------------------------------------ bad input
def test_invalid_rows_excluded_and_counted(digits_feats, tmp_path):
    tr, te = digits_feats
    X = tr.X.copy()
    valid = np.ones(len(X), bool)
    valid[:7] = False
    X[:7] = np.nan  # failed decodes: NaN rows marked invalid
    vt = np.ones(len(te.X), bool)
    vt[:3] = False
    Xt = te.X.copy()
    Xt[:3] = np.nan
    path = _store(tmp_path / "c.zarr", digits_feats, train={"X": X, "valid": valid}, test={"X": Xt, "valid": vt})
    df = run_probes(ProbeConfig(path, LITE0, "digits", "full", Cs=SMALL_GRID, progress=False))
    hp = json.loads(df["hparams"][0])
    assert hp["n_invalid"] == {"train": 7, "test": 3}
    assert hp["n_train_final"] == 1340
    assert df["n_eval"][0] == 447


def test_nan_in_valid_rows_is_an_error(digits_feats, tmp_path):
    X = digits_feats[0].X.copy()
    X[5, 0] = np.inf
    path = _store(tmp_path / "c.zarr", digits_feats, train={"X": X})
    with pytest.raises(ProbeError, match="NaN or inf"):
        run_probes(ProbeConfig(path, LITE0, "digits", "full", Cs=SMALL_GRID, progress=False))


def test_single_class_is_an_error(digits_feats, tmp_path):
    tr, _ = digits_feats
    path = _store(tmp_path / "c.zarr", digits_feats, train={"labels": np.zeros(len(tr.labels), np.int64)})
    with pytest.raises(ProbeError, match="single class"):
        run_probes(ProbeConfig(path, LITE0, "digits", "full", Cs=SMALL_GRID, progress=False))


def test_class_sets_differ_is_an_error(digits_feats, tmp_path):
    tr, te = digits_feats
    names = [*list(te.class_names), "ten"]
    labels = te.labels.copy()
    labels[:4] = 10
    path = _store(tmp_path / "c.zarr", digits_feats, test={"labels": labels, "class_names": names})
    with pytest.raises(ProbeError, match="class sets"):
        run_probes(ProbeConfig(path, LITE0, "digits", "full", Cs=SMALL_GRID, progress=False))
    # a class missing from the (few-shot) training sample but present in test
    m = tr.labels != 9
    path2 = _store(tmp_path / "c2.zarr", digits_feats, train={"X": tr.X[m], "ids": tr.ids[m], "labels": tr.labels[m]})
    with pytest.raises(ProbeError, match="class sets differ"):
        run_probes(ProbeConfig(path2, LITE0, "digits", "full", Cs=SMALL_GRID, progress=False))


def test_too_few_examples_for_protocol(digits_feats, tmp_path, digits_cache):
    tr, _ = digits_feats
    path = _store(
        tmp_path / "c.zarr", digits_feats, train={"X": tr.X[:600], "ids": tr.ids[:600], "labels": tr.labels[:600]}
    )
    with pytest.raises(ProbeError, match="needs 1000"):
        run_probes(ProbeConfig(path, LITE0, "digits", "vtab1k", Cs=SMALL_GRID, progress=False))
    with pytest.raises(ProbeError, match="fewer valid training examples"):
        run_probes(ProbeConfig(digits_cache, LITE0, "digits", "fewshot:200", Cs=SMALL_GRID, progress=False))
    with pytest.raises(ProbeError, match="N >= 2"):
        run_probes(ProbeConfig(digits_cache, LITE0, "digits", "fewshot:1", progress=False))


def test_backbones_not_aligned_by_id(digits_feats, tmp_path):
    tr, _ = digits_feats
    a = _store(tmp_path / "a.zarr", digits_feats, backbone="bb_a")
    ids = tr.ids.copy()
    ids[:5] = [f"other-{i}" for i in range(5)]
    b = _store(tmp_path / "b.zarr", digits_feats, backbone="bb_b", train={"ids": ids})
    with pytest.raises(ProbeError, match="do not align by id"):
        run_probes(ProbeConfig([a, b], ["bb_a", "bb_b"], "digits", "full", Cs=SMALL_GRID, progress=False))
    # the same images in another row order align (rows are matched by id)
    perm = np.random.default_rng(0).permutation(len(tr.ids))
    c = _store(
        tmp_path / "c.zarr",
        digits_feats,
        backbone="bb_c",
        train={"X": tr.X[perm], "ids": tr.ids[perm], "labels": tr.labels[perm]},
    )
    df = run_probes(
        ProbeConfig([a, c], ["bb_a", "bb_c"], "digits", "fewshot:5", seeds=[0], Cs=SMALL_GRID, progress=False)
    )
    # identical features, identical sampled images -> identical results
    assert _top1(df, backbone="bb_a") == _top1(df, backbone="bb_c")


def test_train_test_overlap_is_an_error(digits_feats, tmp_path):
    tr, te = digits_feats
    ids = te.ids.copy()
    ids[0] = tr.ids[0]
    path = _store(tmp_path / "c.zarr", digits_feats, test={"ids": ids})
    with pytest.raises(ProbeError, match="both"):
        run_probes(ProbeConfig(path, LITE0, "digits", "full", Cs=SMALL_GRID, progress=False))


def test_missing_things(digits_cache):
    with pytest.raises(NotInStoreError, match="extract"):
        run_probes(ProbeConfig(digits_cache, "vit_nope", "digits", "full", progress=False))
    with pytest.raises(NotInStoreError, match="test_v2"):
        run_probes(ProbeConfig(digits_cache, LITE0, "digits", "full", eval_splits=["test_v2"], progress=False))
    with pytest.raises(ProbeError, match="unknown protocol"):
        run_probes(ProbeConfig(digits_cache, LITE0, "digits", "linear", progress=False))


# ------------------------------------------------------------------ CLI
def test_cli_probe(digits_cache, tmp_path, capsys):
    from featcache.cli import main

    res = tmp_path / "r.parquet"
    rc = main(
        [
            "probe",
            "--cache",
            digits_cache,
            "--all",
            "--dataset",
            "digits",
            "--protocol",
            "fewshot:5",
            "--seeds",
            "0",
            "--results",
            str(res),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "top1" in out
    assert "fewshot:5" in out
    assert LITE0 in out
    assert pl.read_parquet(res).height == 5
    rc = main(
        [
            "probe",
            "--cache",
            digits_cache,
            "--backbone",
            LITE0,
            "--dataset",
            "digits",
            "--protocol",
            "fewshot:1",
            "--results",
            str(res),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert "N >= 2" in err
    rc = main(
        [
            "probe",
            "--cache",
            digits_cache,
            "--backbone",
            LITE0,
            "--dataset",
            "digits",
            "--seeds",
            "a,b",
            "--results",
            str(res),
        ]
    )
    assert rc == 1
    assert "--seeds" in capsys.readouterr().err


def test_official_val_split_is_used(digits_feats, tmp_path):
    """A dataset with its own val split: full selects on it and refits on train+val;
    vtab1k official-val fits on 1000 train images and selects on it."""
    from featcache.store import write_features

    tr, te = digits_feats
    path = str(tmp_path / "c.zarr")
    cut = 1100
    for split, f, sl in (("train", tr, slice(0, cut)), ("val", tr, slice(cut, None)), ("test", te, slice(None))):
        write_features(
            path,
            backbone=LITE0,
            dataset="digits",
            split=split,
            X=f.X[sl],
            ids=f.ids[sl],
            labels=f.labels[sl],
            class_names=f.class_names,
        )
    df = run_probes(ProbeConfig(path, LITE0, "digits", "full", Cs=SMALL_GRID, progress=False))
    hp = json.loads(df["hparams"][0])
    assert df["train_split"][0] == "train+val"
    assert (hp["val"], hp["n_train"], hp["n_val"], hp["n_train_final"]) == ("official", 1100, 247, 1347)
    assert _top1(df)[0] > 0.93
    # vtab1k (fixed, VTAB's rule): train[:800] + val[:200]; the stratified protocol keeps
    # the earlier reading (fit on a drawn 1000, select on the whole val split)
    v = run_probes(
        ProbeConfig(
            path, LITE0, "digits", "vtab1k", seeds=[0], val_source="official-val", Cs=SMALL_GRID, progress=False
        )
    )
    hv = json.loads(v["hparams"][0])
    assert (hv["val_source"], hv["n_train"], hv["n_val"], hv["n_train_final"]) == ("official-val", 800, 200, 1000)
    assert v["train_split"][0] == "train[:800]+val[:200]"
    assert hv["val"] == "val[:200]"
    st = run_probes(
        ProbeConfig(
            path,
            LITE0,
            "digits",
            "vtab1k-stratified",
            seeds=[0],
            val_source="official-val",
            Cs=SMALL_GRID,
            progress=False,
        )
    )
    hs = json.loads(st["hparams"][0])
    assert (hs["val_source"], hs["n_train"], hs["n_val"], hs["n_train_final"]) == ("official-val", 1000, 247, 1000)
    s = run_probes(
        ProbeConfig(
            path, LITE0, "digits", "vtab1k", seeds=[0], val_source="split-800-200", Cs=SMALL_GRID, progress=False
        )
    )
    hs = json.loads(s["hparams"][0])
    assert (hs["n_val"], hs["val"]) == (200, "train[800:1000]")  # split-800-200 ignores the val split
    assert s["run_id"][0] != v["run_id"][0]
    # issue 33 item 3: with a val split in the store, plain vtab1k selects on its first 200
    # (VTAB's val200) by default: the same run as official-val
    d = run_probes(ProbeConfig(path, LITE0, "digits", "vtab1k", seeds=[0], Cs=SMALL_GRID, progress=False))
    assert d["run_id"].to_list() == v["run_id"].to_list()
    assert json.loads(d["hparams"][0])["val_source"] == "official-val"


def test_vtab1k_selects_on_val200_by_default_where_the_store_holds_it(digits_feats, tmp_path):
    """Issue 33 item 3: plain ``vtab1k`` on a store with VTAB's 1k splits (``train800``,
    ``val200``) runs what ``--suite vtab-1k`` runs: fit on train800, select on val200."""
    from featcache.store import write_features

    tr, te = digits_feats
    path = str(tmp_path / "c.zarr")
    for split, f, sl in (("train800", tr, slice(0, 800)), ("val200", tr, slice(800, 1000)), ("test", te, slice(None))):
        write_features(
            path,
            backbone=LITE0,
            dataset="digits",
            split=split,
            X=f.X[sl],
            ids=f.ids[sl],
            labels=f.labels[sl],
            class_names=f.class_names,
        )
    base = ProbeConfig(path, LITE0, "digits", "vtab1k", seeds=[0], Cs=SMALL_GRID, progress=False)
    df = run_probes(base)
    hp = json.loads(df["hparams"][0])
    assert (hp["val_source"], hp["n_train"], hp["n_val"], hp["val"]) == ("official-val", 800, 200, "val200[:200]")
    assert df["train_split"][0] == "train800[:800]+val200[:200]"
    suite = replace(base, train_split="train800", val_split="val200", val_source="official-val")
    assert run_probes(suite)["run_id"].to_list() == df["run_id"].to_list()
    assert set(run_ids(base).values()) == set(df["run_id"].to_list())
