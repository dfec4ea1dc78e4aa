"""Multi-label targets under the ELEVATER protocols (issue 22 item 5): as the toolkit's linear
probe does for VOC 2007, a BCE-trained SGD head searched on validation mAP and scored on the
softmax of its outputs (Computer-Vision-in-the-Wild/Elevater_Toolkit_IC,
vision_benchmark/evaluation/full_model_finetune.py: train_task's BCEWithLogitsLoss for
MULTILABEL_DATASETS, validate's ``outputs.softmax(-1)``). Real data: lite0 digits features
with labels {digit, even}."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_spy import sorted_rows, spy_plan
from vision_evaluation_ref import elevater_map_11_points

from featcache.core.splits import elevater_holdout_multilabel
from featcache.errors import ProbeError
from featcache.probes import ProbeConfig, run_probes
from featcache.probes.solvers import SOLVERS, get_solver
from featcache.store import open_cache, write_features
from featcache.store.tasks import write_label_matrix, write_task_metric

LITE0 = "tf_efficientnet_lite0"
DS = "digits-even"
COLUMNS = [str(d) for d in range(10)] + ["even"]

ATTRS = ["even", "ge5", "prime", "le2", "mod3"]  # overlapping labels: no column partitions the rows


# --- ported from Computer-Vision-in-the-Wild/Elevater_Toolkit_IC (517fb02),
# vision_benchmark/evaluation/feature.py, get_dataloader -> train_val_dataset, its
# ``len(labels.shape) == 2`` branch (the toolkit's comment calls it "multi-class IC datasets")
def toolkit_train_val_multilabel(labels, val_split=0.2):
    labels = np.array(labels)  # the toolkit zeroes rows of its own fetched array
    val_target_count = np.ceil(np.sum(labels, axis=0) * val_split)
    next_targets = np.where(val_target_count > 0)[0]
    val_idx = []

    while next_targets.size > 0:
        target_cls = next_targets[0]
        next_sample = np.where(labels[:, target_cls] > 0)[0][0]
        val_idx.append(next_sample)
        val_target_count -= labels[next_sample]
        labels[next_sample] = 0
        next_targets = np.where(val_target_count > 0)[0]

    val_idx = np.asarray(val_idx).tolist()
    train_idx = set(list(range(len(labels)))) - set(val_idx)  # noqa: C414 (as the toolkit writes it)
    train_idx = list(train_idx)
    return train_idx, val_idx


# --- end of ported code -----------------------------------------------------------------


def _attrs(labels) -> np.ndarray:
    d = np.asarray(labels)
    return np.stack([d % 2 == 0, d >= 5, np.isin(d, [2, 3, 5, 7]), d <= 2, d % 3 == 0], 1).astype(np.int64)


def _matrix(labels) -> np.ndarray:
    labels = np.asarray(labels)
    return np.concatenate([np.eye(10, dtype=bool)[labels], (labels % 2 == 0)[:, None]], 1)


@pytest.fixture(scope="module")
def digits_even(digits_cache, tmp_path_factory):
    """digits features with an [N, 11] label matrix (the digit, and "even") in every split,
    stored as multi-label exports are (write_label_matrix), task metric ELEVATER's 11-point mAP."""
    c = open_cache(digits_cache)
    path = str(tmp_path_factory.mktemp("ml-elevater") / "c.zarr")
    feats = {}
    for split in ("train", "test"):
        f = feats[split] = c.load(LITE0, "digits", split)
        write_features(
            path, backbone=LITE0, dataset=DS, split=split, X=f.X, ids=f.ids, labels=f.labels, class_names=f.class_names
        )
        write_label_matrix(path, DS, split, _matrix(f.labels), COLUMNS)
    write_task_metric(path, DS, "map11_elevater")
    return path, feats


def _toolkit_run(plan, search_epochs, final_epochs, text=None):
    """The toolkit's whole run on the plan's rows as the port runs it (elevater_toolkit_ref:
    ``full_model_finetune`` with its (lr, wd) search, then the final run on train+val, in one
    random stream seeded once, ``Classifier``'s channel BatchNorm, its ``nn.Linear`` drawn from
    that stream or the text-initialised head, SGD momentum 0.9 with weight decay,
    ``BCEWithLogitsLoss`` for ``MULTILABEL_DATASETS``, the DataLoader's batches); returns
    (selected lr, wd, ``scores(X)``: validate's softmax of the final head's outputs)."""
    import elevater_toolkit_ref as ref

    Xf, Y = np.asarray(plan.fin[0], np.float32), plan.Y[2].astype(np.float32)
    at = {r.tobytes(): i for i, r in enumerate(Xf)}
    ti, vi = ([at[r.tobytes()] for r in np.asarray(X, np.float32)] for X in (plan.tr[0], plan.va[0]))
    assert ti == sorted(ti)  # the toolkit's train Subset is list(set(...)): the dataset's order
    tr, va, te = ref.loaders(Xf, Y, ti, vi, Xf, Y)  # te: the final run's validate only
    train = {} if text is None else {"INIT_HEAD_WITH_TEXT_ENCODER": True, "TEXT": _unit(text)}
    cfg = ref.make_config(
        Xf.shape[1], Y.shape[1], dataset="voc-2007-classification", metric="11point_mAP",
        epochs=search_epochs, extra_final=final_epochs - search_epochs, **train,
    )  # fmt: skip
    _, info = ref.run_seeded(0, ref.full_model_finetune, tr, va, te, False, None, None, cfg)
    return info["lr"], info["wd"], lambda Z: ref.predict_proba(info["model"], Z)


def _unit(M):
    return (M / np.linalg.norm(M, axis=1, keepdims=True)).astype(np.float32)


def test_elevater_multilabel_trains_a_bce_sgd_head_scored_with_the_toolkits_map(digits_even, monkeypatch, tmp_path):
    path, feats = digits_even
    seen = {}
    solver = get_solver("elevater")
    assert solver.fit_multilabel is not None  # before: refused (elevater had no multi-label fitter)

    def spy(req):
        seen["req"], seen["out"] = req, solver.fit_multilabel(req)
        return seen["out"]

    monkeypatch.setitem(SOLVERS, "elevater", replace(solver, fit_multilabel=spy))
    cfg = ProbeConfig(
        path, LITE0, DS, "elevater-fewshot:10", seeds=[0], search_epochs=2, final_epochs=5, progress=False
    )
    df = run_probes(replace(cfg, results_path=tmp_path / "r.parquet"))
    # map_clip_benchmark: every multi-label probe row set carries CLIP_benchmark's mAP (issue 33 item 7)
    assert set(df["metric"]) == {"map11", "map11_elevater", "map_clip_benchmark", "roc_auc_macro"}
    hp = json.loads(df["hparams"][0])
    assert hp["solver"] == "elevater-sgd"
    assert hp["loss"] == "bce"
    assert hp["n_labels"] == len(COLUMNS)
    assert hp["task_metric"] == "map11_elevater"
    assert hp["selection"].startswith("val map11_elevater")
    assert hp["trials"] > len(hp["per_lr"])  # the coarse-to-fine search ran for every lr
    # (b) the reported value is the toolkit's 11-point mAP of the head's scores on test
    te = feats["test"]
    Yte = _matrix(te.labels)
    S = seen["out"].predict(np.asarray(te.X, np.float64))
    assert S.shape == (Yte.shape[0], len(COLUMNS))
    # validate's softmax(-1), not a sigmoid; in float32 as the toolkit computes it
    np.testing.assert_allclose(S.sum(1), 1.0, atol=1e-6)
    value = df.filter(pl.col("metric") == "map11_elevater")["value"][0]
    assert value == pytest.approx(elevater_map_11_points(Yte, S), abs=1e-12)
    assert 0.5 < value < 1.0
    # (a) the head is the toolkit's BCE-trained SGD head with the selected (lr, wd)
    plan = seen["req"].plan
    lr, wd, ref = _toolkit_run(plan, hp["search_epochs"], hp["final_epochs"])
    assert (hp["lr"], hp["weight_decay"]) == pytest.approx((lr, wd), rel=1e-14)
    assert plan.Y[2].shape == (100, len(COLUMNS))
    np.testing.assert_allclose(S, ref(np.asarray(te.X, np.float64)), atol=2e-5)
    assert math.isfinite(hp["val_map11_elevater"])


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 40), st.integers(1, 6), st.floats(0.05, 0.95))
def test_greedy_holdout_equals_the_toolkits(seed, n, c, p):
    rng = np.random.default_rng(seed)
    Y = (rng.random((n, c)) < p).astype(np.int64)
    t, v = elevater_holdout_multilabel(Y)
    ref_t, ref_v = toolkit_train_val_multilabel(Y)
    assert v.tolist() == sorted(ref_v)
    assert t.tolist() == sorted(ref_t)
    assert len(set(ref_v)) == len(ref_v)  # each row taken once


def test_elevater_full_holds_out_the_toolkits_greedy_rows_of_a_label_matrix(digits_cache, monkeypatch, tmp_path):
    """elevater-full on digits with five overlapping attribute labels: the validation rows are
    the toolkit's greedy fill over the stored label matrix in the store's row order (before:
    the first ceil(20%) per digit of the single-label column, other rows)."""

    c = open_cache(digits_cache)
    path = str(tmp_path / "c.zarr")
    for split in ("train", "test"):
        f = c.load(LITE0, "digits", split)
        write_features(
            path,
            backbone=LITE0,
            dataset="digits-attrs",
            split=split,
            X=f.X,
            ids=f.ids,
            labels=f.labels,
            class_names=f.class_names,
        )
        write_label_matrix(path, "digits-attrs", split, _attrs(f.labels).astype(bool), ATTRS)
    write_task_metric(path, "digits-attrs", "map11_elevater")
    stored = open_cache(path).load(LITE0, "digits-attrs", "train")
    Y = _attrs(stored.labels)
    _, ref_v = toolkit_train_val_multilabel(Y)
    seen = spy_plan(monkeypatch)
    cfg = ProbeConfig(path, LITE0, "digits-attrs", "elevater-full", search_epochs=1, final_epochs=1, progress=False)
    df = run_probes(cfg)
    plan = seen["plan"]
    np.testing.assert_array_equal(sorted_rows(plan.va[0]), sorted_rows(stored.X[sorted(ref_v)]))
    assert plan.Y[1].sum(0).tolist() >= np.ceil(0.2 * Y.sum(0)).tolist()
    per_digit = [idx[: int(np.ceil(0.2 * idx.size))] for d in range(10) for idx in [np.flatnonzero(stored.labels == d)]]
    assert sorted(ref_v) != sorted(np.concatenate(per_digit).tolist())  # the single-label rule takes others
    assert json.loads(df["hparams"][0])["val"] == "greedy-ceil-20%-per-label-of-train"


def test_elevater_fewshot_splits_its_drawn_rows_greedily(digits_even):
    """elevater-fewshot:N on a label matrix: the N per class drawn on the single-label column
    (as before) are split by the toolkit's greedy rule over their rows, in the store's order."""
    from featcache.core import protocols as P
    from featcache.probes import runner as PR

    path, _ = digits_even
    tr = PR._load_split(open_cache(path), LITE0, DS, "train", "pooled")
    Y = _attrs(tr.y)
    sp = P.get_protocol("elevater-fewshot:10").plan(tr.y, 0, rows=tr.rows, label_matrix=Y)
    drawn = np.sort(np.concatenate([sp.train, sp.val]))
    before = P.get_protocol("elevater-fewshot:10").plan(tr.y, 0, rows=tr.rows)
    assert drawn.tolist() == np.sort(np.concatenate([before.train, before.val])).tolist()  # the same draw
    own = drawn[np.argsort(tr.rows[drawn], kind="stable")]
    _, ref_v = toolkit_train_val_multilabel(Y[own])
    assert sp.val.tolist() == sorted(own[ref_v].tolist())
    assert sp.final.tolist() == drawn.tolist()
    one = P.get_protocol("elevater-fewshot:1").plan(tr.y, 0, rows=tr.rows, label_matrix=Y)
    assert one.final.tolist() == one.train.tolist()  # N = 1: 2 drawn, no merge, as the toolkit


def _label_means(path, ds, Y):
    """A stand-in text head: the mean train feature of each label column (a real [C, D] matrix)."""
    X = np.asarray(open_cache(path).load(LITE0, ds, "train").X, np.float64)
    return np.stack([X[Y[:, j]].mean(0) for j in range(Y.shape[1])])


def test_elevater_multilabel_language_initialised_head(digits_even, monkeypatch, tmp_path):
    """--head-init text on multi-label targets (before: refused): the BCE head starts from one
    normalised embedding per label column, bias 0, as the toolkit's text-initialised head."""
    from featcache.store import write_class_embeddings

    path, feats = digits_even
    import shutil

    shutil.copytree(path, tmp_path / "c.zarr")
    path = str(tmp_path / "c.zarr")
    text = _label_means(path, DS, _matrix(feats["train"].labels))
    write_class_embeddings(path, DS, text, "text", backbone=LITE0)
    seen = {}
    solver = get_solver("elevater")

    def spy(req):
        seen["req"], seen["out"] = req, solver.fit_multilabel(req)
        return seen["out"]

    monkeypatch.setitem(SOLVERS, "elevater", replace(solver, fit_multilabel=spy))
    cfg = ProbeConfig(
        path,
        LITE0,
        DS,
        "elevater-fewshot:10",
        seeds=[0],
        search_epochs=2,
        final_epochs=5,
        head_init="text",
        progress=False,
    )
    df = run_probes(cfg)
    hp = json.loads(df["hparams"][0])
    assert hp["head"] == "text-initialised"
    assert hp["head_init"] == "text"
    plan, te = seen["req"].plan, feats["test"]
    lr, wd, ref = _toolkit_run(plan, hp["search_epochs"], hp["final_epochs"], text=text)
    assert (hp["lr"], hp["weight_decay"]) == pytest.approx((lr, wd), rel=1e-14)
    S = seen["out"].predict(np.asarray(te.X, np.float64))
    np.testing.assert_allclose(S, ref(np.asarray(te.X, np.float64)), atol=2e-5)
    *_, zero = _toolkit_run(plan, hp["search_epochs"], hp["final_epochs"])
    assert np.abs(S - zero(np.asarray(te.X, np.float64))).max() > 1e-3  # the start mattered
    # a wrong number of rows (one per digit class instead of per label column) is refused
    write_class_embeddings(path, DS, text[:10], "short", backbone=LITE0)
    with pytest.raises(ProbeError, match="one row per class"):
        run_probes(replace(cfg, head_init="short"))
    # one-vs-rest L-BFGS takes no class embeddings: refused with what to do
    with pytest.raises(ProbeError, match="drop --head-init"):
        run_probes(replace(cfg, protocol="fewshot:10"))


def test_zeroshot_on_multilabel_targets_ranks_the_text_scores(digits_even, tmp_path):
    """zeroshot on a label matrix: softmax(100 * normalised features . normalised text) per
    label column, scored by the task metric (the toolkit's 11-point mAP)."""
    import shutil

    from scipy.special import softmax

    from featcache.store import write_class_embeddings

    path, feats = digits_even
    shutil.copytree(path, tmp_path / "c.zarr")
    path = str(tmp_path / "c.zarr")
    text = _label_means(path, DS, _matrix(feats["train"].labels))
    write_class_embeddings(path, DS, text, "text", backbone=LITE0)
    df = run_probes(ProbeConfig(path, LITE0, DS, "zeroshot", progress=False))
    te = feats["test"]
    X = np.asarray(te.X, np.float64)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    T = text / np.linalg.norm(text, axis=1, keepdims=True)
    want = elevater_map_11_points(_matrix(te.labels), softmax(100 * X @ T.T, axis=1))
    got = df.filter(pl.col("metric") == "map11_elevater")["value"][0]
    assert got == pytest.approx(want, abs=1e-12)
