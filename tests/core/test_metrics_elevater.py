"""ELEVATER's classification metrics as its toolkit computes them, compared with the toolkit's
own code (ported below) and a brute-force reference on real data (sklearn's digits)."""

from __future__ import annotations

import numpy as np
import pytest
import sklearn.metrics as sm
from elevater_toolkit_ref import balanced_accuracy_score, map_11_points
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from vision_evaluation_ref import elevater_map_11_points

from featcache.core.metrics import map11, map11_elevater, mean_per_class

# The toolkit's metrics (Elevater_Toolkit_IC vision_benchmark/evaluation/metric.py over
# vision-evaluation 0.2.9, the version its requirements.txt pins: tag 0.2.9 = commit
# 0f34dcbc7ebd037357698808d056f0dba442f03e) are ported in elevater_toolkit_ref.py; its
# ``calculate_score`` drops all-zero target columns before the metric runs.


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
    T[:, 2] = False  # a class without a positive: calculate_score drops its column
    P = rng.integers(0, levels + 1, (n, 3)).astype(float)
    assert map11_elevater(T, P) == pytest.approx(map_11_points(T.astype(int), P), abs=1e-12)
    if T[:, :2].any(axis=0).all():  # the kept columns alone: the same value
        assert map11_elevater(T, P) == pytest.approx(map11_elevater(T[:, :2], P[:, :2]), abs=1e-12)


def test_map11_elevater_drops_an_all_zero_label_column_as_calculate_score(digits_scores):
    """An attribute no test row has (before: it scored 1/11 and entered the mean: 0.4266
    where the toolkit gives 0.5106 here), and no positive at all: the toolkit's 0."""
    _, y, attrs, _, pixels = digits_scores
    T = np.concatenate([attrs, np.zeros((len(y), 1), bool)], 1)
    P = np.concatenate([pixels, pixels[:, :1]], 1)
    ours = map11_elevater(T, P)
    assert ours == pytest.approx(map_11_points(T.astype(int), P), abs=1e-12)
    assert ours == pytest.approx(map11_elevater(attrs, pixels), abs=1e-12)
    with pytest.warns(UserWarning, match="No positive class"):  # the unfiltered evaluator of later releases
        unfiltered = elevater_map_11_points(T.astype(int), P)
    assert unfiltered - ours == pytest.approx((1 / 11 - ours) / 5, abs=1e-12)
    assert (
        map11_elevater(np.zeros((4, 2), bool), np.ones((4, 2)))
        == 0.0
        == map_11_points(np.zeros((4, 2)), np.ones((4, 2)))
    )


def test_mean_per_class_is_elevaters_balanced_accuracy_with_a_class_absent_from_test(digits_scores):
    """A class absent from the labels but predicted: the toolkit's argmax runs over the
    columns of the classes present only (calculate_score drops the others, scores included).
    Before: sklearn's rule on the full argmax (a prediction of the absent class a miss)."""
    S, y = digits_scores[:2]
    for absent in ([3], [3, 5, 8]):
        keep = ~np.isin(y, absent)
        Sk, yk = S[keep], y[keep]
        assert np.isin(Sk.argmax(1), absent).any()  # the absent classes are predicted
        ref = balanced_accuracy_score(yk, Sk)
        assert mean_per_class(yk, Sk) == pytest.approx(ref, abs=1e-12)
        present = np.setdiff1d(np.arange(10), absent)
        pred = present[Sk[:, present].argmax(1)]
        rec = [np.mean(pred[yk == c] == c) for c in present]
        assert mean_per_class(yk, Sk) == pytest.approx(np.mean(rec), abs=1e-12)
        with pytest.warns(UserWarning, match="y_pred contains classes not in y_true"):
            full = sm.balanced_accuracy_score(yk, Sk.argmax(1))  # the rule before
        assert mean_per_class(yk, Sk) > full
        assert mean_per_class(yk, Sk.argmax(1)) == pytest.approx(full, abs=1e-12)  # labels: no restriction
    assert mean_per_class(y, S) == pytest.approx(balanced_accuracy_score(y, S), abs=1e-12)  # all present
