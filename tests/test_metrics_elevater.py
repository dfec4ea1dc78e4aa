"""ELEVATER's classification metrics as its toolkit computes them, compared with the toolkit's
own code (ported below) and a brute-force reference on real data (sklearn's digits)."""

from __future__ import annotations

import numpy as np
import pytest
import sklearn.metrics as sm
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from vision_evaluation_ref import elevater_map_11_points

from featcache.core.metrics import map11, map11_elevater, mean_per_class


# --- ported from microsoft/vision-evaluation, vision_evaluation/evaluators.py (which
# Elevater_Toolkit_IC vision_benchmark/evaluation/metric.py balanced_accuracy_score calls); its
# 11-point mAP is in vision_evaluation_ref.py --------------------------------------------------
def elevater_balanced_accuracy(targets, predictions):
    """BalancedAccuracyScoreEvaluator._calculate (targets one-hot [N, K], predictions [N, K])."""
    single_targets = np.argmax(targets, axis=1)
    y_single_preds = np.argmax(predictions, axis=1)
    return sm.balanced_accuracy_score(single_targets, y_single_preds)


# --- end of ported code -------------------------------------------------------------------


def brute_ap11(pos, score, recall0_is_one: bool) -> float:
    """11-point AP by enumerating every score threshold (>= each distinct score)."""
    pts = []
    for t in np.unique(score):
        sel = score >= t
        tp = int((sel & pos).sum())
        pts.append((tp / pos.sum(), tp / sel.sum()))
    if recall0_is_one:
        pts.append((0.0, 1.0))
    return float(np.mean([max([p for r, p in pts if r >= k / 10 - 1e-12], default=0.0) for k in range(11)]))


@pytest.fixture(scope="module")
def digits_scores():
    """Held-out probabilities of a logistic regression on digits pixels, and digit attributes
    (multi-label: even, > 4, a closed loop, prime) of the same rows."""
    X, y = load_digits(return_X_y=True)
    clf = LogisticRegression(max_iter=200, C=1e-4).fit(X[::2], y[::2])  # weak on purpose: AP < 1
    S, yte = clf.predict_proba(X[1::2]), y[1::2]
    attrs = np.stack([yte % 2 == 0, yte > 4, np.isin(yte, (0, 6, 8, 9)), np.isin(yte, (2, 3, 5, 7))], 1)
    A = np.stack([S[:, 0::2].sum(1), S[:, 5:].sum(1), S[:, [0, 6, 8, 9]].sum(1), S[:, [2, 3, 5, 7]].sum(1)], 1)
    pixels = X[1::2][:, [20, 28, 36, 44]]  # raw intensities 0..16 as attribute scores: ties, negatives on top
    return S, yte, attrs, A, pixels


def test_map11_elevater_is_the_toolkits_on_real_scores(digits_scores):
    S, y, attrs, A, pixels = digits_scores
    onehot = np.eye(10, dtype=int)[y]
    for T, P in ((onehot, S), (attrs.astype(int), A), (onehot, np.round(S, 2)), (attrs.astype(int), pixels)):
        ours = map11_elevater(T, P)
        assert ours == pytest.approx(elevater_map_11_points(T, P), abs=1e-12)
        brute = np.mean([brute_ap11(T[:, c].astype(bool), P[:, c], True) for c in range(T.shape[1])])
        assert ours == pytest.approx(brute, abs=1e-12)
        voc = np.mean([brute_ap11(T[:, c].astype(bool), P[:, c], False) for c in range(T.shape[1])])
        assert map11(T, P) == pytest.approx(voc, abs=1e-12)
    # the two definitions differ on the same scores: by (1 - best precision) / 11 per class
    assert map11_elevater(attrs, pixels) - map11(attrs, pixels) == pytest.approx(0.0486, abs=1e-4)
    assert map11_elevater(attrs, A) == map11(attrs, A)  # every class's top score is a positive
    assert map11_elevater(y, S) == pytest.approx(map11_elevater(onehot, S), abs=0)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 40), st.integers(1, 4))
def test_map11_elevater_matches_the_toolkit_with_ties_and_empty_classes(seed, n, levels):
    rng = np.random.default_rng(seed)
    T = rng.random((n, 3)) < 0.3
    T[:, 2] = False  # a class without a positive (sklearn >= 1.1: recall 1, so AP 1/11)
    P = rng.integers(0, levels + 1, (n, 3)).astype(float)
    with pytest.warns(UserWarning, match="No positive class"):
        ref = elevater_map_11_points(T.astype(int), P)
    assert map11_elevater(T, P) == pytest.approx(ref, abs=1e-12)


def test_mean_per_class_is_elevaters_balanced_accuracy_with_a_class_absent_from_test(digits_scores):
    S, y = digits_scores[:2]
    keep = y != 3  # class 3 absent from the test rows, still a column of the scores
    S, y = S[keep], y[keep]
    assert (S.argmax(1) == 3).any()  # and predicted: sklearn drops its undefined recall
    with pytest.warns(UserWarning, match="y_pred contains classes not in y_true"):
        ref = elevater_balanced_accuracy(np.eye(10)[y], S)
    assert mean_per_class(y, S) == pytest.approx(ref, abs=1e-12)
    # the class-3 column counts nowhere: a mean over 10 classes with class 3 at 0 differs
    rec = [np.mean(S[y == c].argmax(1) == c) for c in range(10) if c != 3]
    assert mean_per_class(y, S) == pytest.approx(np.mean(rec), abs=1e-12)
    assert mean_per_class(y, S) != pytest.approx(np.sum(rec) / 10)
