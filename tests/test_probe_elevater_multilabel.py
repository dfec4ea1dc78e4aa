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
from vision_evaluation_ref import elevater_map_11_points

from featcache.probes import ProbeConfig, run_probes
from featcache.probes.solvers import SOLVERS, get_solver
from featcache.store import open_cache, write_features
from featcache.store.tasks import write_label_matrix, write_task_metric

LITE0 = "tf_efficientnet_lite0"
DS = "digits-even"
COLUMNS = [str(d) for d in range(10)] + ["even"]


# --- end of ported code -----------------------------------------------------------------


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


def _toolkit_final_head(X, Y, lr, wd, epochs, seed, batch_size=64):
    """The toolkit's final run (train_task / train_one: channel BatchNorm without affine,
    zero-initialised linear layer, SGD momentum 0.9 with weight decay, BCEWithLogitsLoss on the
    0/1 targets, constant lr) on featcache's seeded batch order (one torch.randperm per epoch);
    returns ``scores(X)``: validate's softmax of the outputs."""
    import torch

    mu, sd = X.mean(0), np.sqrt(X.var(0) + 1e-5)
    Xt = torch.tensor((X - mu) / sd, dtype=torch.float32)
    Yt = torch.tensor(Y, dtype=torch.float32)
    lin = torch.nn.Linear(X.shape[1], Y.shape[1])
    torch.nn.init.zeros_(lin.weight)
    torch.nn.init.zeros_(lin.bias)
    opt = torch.optim.SGD(lin.parameters(), lr=lr, momentum=0.9, weight_decay=wd)
    criterion = torch.nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(X), generator=gen)
        for s in range(0, len(X), batch_size):
            bi = perm[s : s + batch_size]
            opt.zero_grad()
            criterion(lin(Xt[bi]), Yt[bi]).backward()
            opt.step()
    W, b = lin.weight.detach().double().numpy(), lin.bias.detach().double().numpy()

    def scores(Z):
        z = ((Z - mu) / sd) @ W.T + b
        return torch.from_numpy(z).softmax(-1).numpy()

    return scores


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
    assert set(df["metric"]) == {"map11", "map11_elevater", "roc_auc_macro"}
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
    np.testing.assert_allclose(S.sum(1), 1.0, atol=1e-9)  # validate's softmax(-1), not a sigmoid
    value = df.filter(pl.col("metric") == "map11_elevater")["value"][0]
    assert value == pytest.approx(elevater_map_11_points(Yte, S), abs=1e-12)
    assert 0.5 < value < 1.0
    # (a) the head is the toolkit's BCE-trained SGD head with the selected (lr, wd)
    plan = seen["req"].plan
    ref = _toolkit_final_head(
        np.asarray(plan.fin[0], np.float64), plan.Y[2], hp["lr"], hp["weight_decay"], hp["final_epochs"], 0
    )
    assert plan.Y[2].shape == (100, len(COLUMNS))
    np.testing.assert_allclose(S, ref(np.asarray(te.X, np.float64)), atol=2e-5)
    assert math.isfinite(hp["val_map11_elevater"])
