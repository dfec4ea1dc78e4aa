"""The ``dinov2`` protocol reproduces DINOv2's logistic-regression evaluation on real data
(digits pixels): its holdout, its C grid, raw features, the C it selects and its test top-1."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression

from featcache.core.protocols import DINOV2_C_GRID, get_protocol
from featcache.probes import ProbeConfig, run_probes

N_TRAIN, N_TEST = 400, 300
# The fit compares every 4th C of DINOv2's grid up to C = 10 (8 of 45: the suite stays fast). The C
# selected here (1.0) lies inside it, with a tie above it (10) checking "the first best C"; the larger
# C (100 .. 1e5) would only add the slowest fits, and the test asserts the selection stays bracketed.
EVERY, STOP = 4, 29


# Ported from facebookresearch/dinov2, dinov2/eval/log_regression.py: C_POWER_RANGE and the
# "10% of the train dataset" branch of eval_log_regression.
def dinov2_grid():
    return 10 ** torch.linspace(-6, 5, 45)


def dinov2_holdout(n):
    torch.manual_seed(0)
    indices = torch.randperm(n)
    return indices[n // 10 :].numpy(), indices[: n // 10].numpy()  # (train_index, finetune_index)


# Ported from dinov2/eval/log_regression.py, sweep_C_values + eval_log_regression: fit each C on
# train, keep the first C with the best top-1 on the finetune part, refit on train + finetune.
# cuML's LogisticRegression(penalty="l2", C, tol=1e-12, max_iter=1000) on float64 features is
# replaced by scikit-learn's with the same objective and settings.
def dinov2_log_regression(Xtr, ytr, Xte, yte):
    tr, ft = dinov2_holdout(len(ytr))
    best, best_C = -1.0, None
    for C in dinov2_grid()[:STOP:EVERY]:
        C = C.item()
        m = LogisticRegression(C=C, tol=1e-12, max_iter=1000).fit(Xtr[tr], ytr[tr])
        acc = float(np.mean(m.predict(Xtr[ft]) == ytr[ft]))
        if acc > best:
            best, best_C = acc, C
    final = LogisticRegression(C=best_C, tol=1e-12, max_iter=1000).fit(Xtr, ytr)
    return best_C, float(np.mean(final.predict(Xte) == yte)), ft


@pytest.fixture(scope="module")
def pix(tmp_path_factory):
    from featcache.store import write_features

    d = load_digits()
    X, y = d.data.astype(np.float64) / 16, d.target.astype(np.int64)  # pixels in [0, 1]
    X, y = X[: N_TRAIN + N_TEST], y[: N_TRAIN + N_TEST]
    ids = np.array([f"x{(i * 7919) % 10007:05d}" for i in range(y.size)])  # id order != row order
    path = str(tmp_path_factory.mktemp("dv2") / "c.zarr")
    kw = {"backbone": "pix", "dataset": "digits", "class_names": [str(i) for i in range(10)]}
    write_features(path, split="train", X=X[:N_TRAIN], ids=ids[:N_TRAIN], labels=y[:N_TRAIN], **kw)
    write_features(path, split="test", X=X[N_TRAIN:], ids=ids[N_TRAIN:], labels=y[N_TRAIN:], **kw)
    return path, X, y


def test_dinov2_grid_is_its_own():
    assert get_protocol("dinov2").grid.Cs == DINOV2_C_GRID
    np.testing.assert_allclose(DINOV2_C_GRID, dinov2_grid().numpy(), rtol=1e-6)


@pytest.mark.slow
def test_dinov2_protocol_matches_its_log_regression(pix, tmp_path):
    path, X, y = pix
    C_ref, top1_ref, ft = dinov2_log_regression(X[:N_TRAIN], y[:N_TRAIN], X[N_TRAIN:], y[N_TRAIN:])
    res = str(tmp_path / "r.parquet")
    Cs = DINOV2_C_GRID[:STOP:EVERY]
    assert Cs[0] < C_ref < Cs[-1]  # the selected C is bracketed by the compared grid
    df = run_probes(ProbeConfig(path, "pix", "digits", "dinov2", results_path=res, Cs=Cs, progress=False))
    row = df.filter(df["metric"] == "top1").row(0, named=True)
    hp = json.loads(row["hparams"])
    assert hp["standardize"] is False
    assert hp["tol"] == 1e-12
    assert hp["n_val"] == len(ft) == N_TRAIN // 10
    assert hp["C"] == pytest.approx(C_ref, rel=1e-6)
    # measured 2026-12-03 with OMP_NUM_THREADS=1 and =2, TEST_WORKERS=0: the same C (1.0) and the same top-1
    # (0.84667) as the port at both; the bar allows one test sample
    assert row["value"] == pytest.approx(top1_ref, abs=1 / N_TEST)
    full = run_probes(ProbeConfig(path, "pix", "digits", "full", results_path=res, Cs=Cs, progress=False))
    hf = json.loads(full["hparams"][0])
    assert hf["standardize"] is True  # full says in its row that it standardises
    assert hf["C"] != hp["C"]
