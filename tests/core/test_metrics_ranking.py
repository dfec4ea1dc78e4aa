"""map11 (VOC2007 11-point mAP) and roc_auc_macro vs brute-force references and scikit-learn,
ties included."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import precision_recall_curve, roc_auc_score

from featcache.core.metrics import compute_all, map11, metric_names, roc_auc_macro


# ------------------------------------------------------------ brute-force references
def ref_ap11(pos, score):
    """VOC07 devkit's 11-point AP, evaluated at every distinct score threshold."""
    pts = []
    for thr in sorted(set(score.tolist()), reverse=True):
        sel = [i for i in range(len(score)) if score[i] >= thr]
        tp = sum(bool(pos[i]) for i in sel)
        pts.append((tp / sum(bool(p) for p in pos), tp / len(sel)))  # (recall, precision)
    ap = 0.0
    for t in [i / 10 for i in range(11)]:
        ps = [p for r, p in pts if r >= t - 1e-12]
        ap += (max(ps) if ps else 0.0) / 11
    return ap


def ref_map11(Y, S):
    return np.mean([ref_ap11(Y[:, c], S[:, c]) for c in range(Y.shape[1]) if Y[:, c].any()])


def ref_auc(pos, score):
    """P(score_pos > score_neg) + 0.5 P(equal), over every positive/negative pair."""
    P = [s for s, p in zip(score, pos) if p]
    N = [s for s, p in zip(score, pos) if not p]
    return sum((a > b) + 0.5 * (a == b) for a in P for b in N) / (len(P) * len(N))


def sk_map11(Y, S):
    aps = []
    for c in range(Y.shape[1]):
        if not Y[:, c].any():
            continue
        prec, rec, _ = precision_recall_curve(Y[:, c], S[:, c])
        prec, rec = prec[:-1], rec[:-1]  # drop sklearn's artificial (recall 0, precision 1) end
        aps.append(
            np.mean([prec[rec >= t - 1e-12].max() if (rec >= t - 1e-12).any() else 0.0 for t in np.linspace(0, 1, 11)])
        )
    return float(np.mean(aps))


def _case(rng, n=60, c=4, levels=None):
    Y = rng.random((n, c)) < 0.35
    Y[0], Y[1] = True, False  # every class has a positive and a negative
    S = rng.random((n, c)) if levels is None else rng.integers(0, levels, (n, c)) / levels
    return Y, S


@pytest.mark.parametrize("levels", [None, 3, 7])  # None: distinct scores; else many ties
def test_map11_vs_brute_force_and_sklearn(levels):
    Y, S = _case(np.random.default_rng(levels or 0), levels=levels)
    assert map11(Y, S) == pytest.approx(ref_map11(Y, S), abs=1e-12)
    assert map11(Y, S) == pytest.approx(sk_map11(Y, S), abs=1e-12)


@pytest.mark.parametrize("levels", [None, 3, 7])
def test_roc_auc_macro_vs_brute_force_and_sklearn(levels):
    Y, S = _case(np.random.default_rng(10 + (levels or 0)), levels=levels)
    ref = np.mean([ref_auc(Y[:, c], S[:, c]) for c in range(Y.shape[1])])
    assert roc_auc_macro(Y, S) == pytest.approx(ref, abs=1e-12)
    assert roc_auc_macro(Y, S) == pytest.approx(roc_auc_score(Y, S, average="macro"), abs=1e-12)


def test_map11_known_values():
    # one positive at rank 2 of 4: precision 0.5 at recall 1 -> every point 0.5
    assert map11(np.array([[0], [1], [0], [0]]), np.array([[0.9], [0.8], [0.7], [0.6]])) == 0.5
    # perfect ranking
    assert map11(np.array([[1], [1], [0]]), np.array([[0.9], [0.8], [0.1]])) == 1.0
    # ties: both rows at one threshold, precision 1/2 at recall 1
    assert map11(np.array([[1], [0]]), np.array([[0.5], [0.5]])) == 0.5


def test_integer_labels_are_one_hot_and_binary_auc():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 80)
    p1 = rng.random(80)
    P = np.c_[1 - p1, p1]
    assert roc_auc_macro(y, P) == pytest.approx(roc_auc_score(y, p1), abs=1e-12)
    y3 = rng.integers(0, 3, 80)
    S3 = rng.random((80, 3))
    assert roc_auc_macro(y3, S3) == pytest.approx(roc_auc_score(np.eye(3)[y3], S3, average="macro"), abs=1e-12)
    assert map11(y3, S3) == pytest.approx(ref_map11(np.eye(3, dtype=bool)[y3], S3), abs=1e-12)


def test_classes_without_positives_or_negatives_are_skipped():
    Y = np.array([[1, 0, 1], [0, 0, 1], [1, 0, 1]], bool)
    S = np.array([[0.9, 0.1, 0.3], [0.2, 0.5, 0.4], [0.8, 0.3, 0.2]])
    assert map11(Y, S) == pytest.approx(np.mean([1.0, ref_ap11(Y[:, 2], S[:, 2])]))
    assert roc_auc_macro(Y, S) == pytest.approx(1.0)  # only class 0 has both
    assert np.isnan(roc_auc_macro(np.ones((3, 2), bool), S[:, :2]))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"\[N, C\]"):
        map11(np.zeros((3, 2), bool), np.zeros((3, 3)))
    with pytest.raises(ValueError, match="0/1"):
        roc_auc_macro(np.full((2, 2), 2), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="indices"):
        map11(np.array([0.5, 1.0]), np.zeros((2, 2)))


def test_metric_names_keep_single_label_rows_and_add_the_task_metric():
    assert metric_names(10) == ["top1", "top5", "mean_per_class", "nll", "ece"]
    assert metric_names(3) == ["top1", "mean_per_class", "nll", "ece"]
    assert metric_names(2, "roc_auc_macro")[-1] == "roc_auc_macro"
    assert metric_names(5, "map11", multilabel=True) == [
        "map11",
        "roc_auc_macro",
        "map11_elevater",
        "map_clip_benchmark",
    ]
    P = np.full((4, 3), 1 / 3)
    assert set(compute_all(np.array([0, 1, 2, 0]), P)) == {"top1", "mean_per_class", "nll", "ece"}


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 25), st.integers(1, 4), st.sampled_from([None, 2, 4]))
def test_invariants_vs_sklearn(seed, n, c, levels):
    rng = np.random.default_rng(seed)
    Y = rng.random((n, c)) < 0.5
    S = rng.random((n, c)) if levels is None else rng.integers(0, levels, (n, c)).astype(float)
    perm = rng.permutation(n)  # row order never matters
    assert map11(Y[perm], S[perm]) == pytest.approx(map11(Y, S), abs=1e-12, nan_ok=True)
    ok = [k for k in range(c) if 0 < Y[:, k].sum() < n]
    if ok:
        assert roc_auc_macro(Y, S) == pytest.approx(roc_auc_score(Y[:, ok], S[:, ok], average="macro"), abs=1e-12)
        assert map11(Y, S) == pytest.approx(sk_map11(Y, S), abs=1e-12)
        assert 0.0 <= map11(Y, S) <= 1.0


# Ported from LAION-AI/CLIP_benchmark, clip_benchmark/metrics/zeroshot_classification.py
# (commit b4b6a33c8dc01fe44acf24f24f71ac7585d52571), average_precision_per_class; evaluate()
# reports {"mean_average_precision": ap_per_class.mean().item()} for multi-label targets.
def clip_benchmark_average_precision_per_class(scores, targets):
    import torch

    ap = torch.zeros(scores.size(1))
    rg = torch.arange(1, scores.size(0) + 1).float()
    for k in range(scores.size(1)):
        scores_k = scores[:, k]
        targets_k = targets[:, k]
        _, sortind = torch.sort(scores_k, 0, True)
        truth = targets_k[sortind]
        tp = truth.float().cumsum(0)
        precision = tp.div(rg)
        ap[k] = precision[truth.bool()].sum() / max(float(truth.sum()), 1)
    return ap


def test_map_clip_benchmark_equals_the_toolkits_function_and_sklearn():
    """Issue 33 item 7: CLIP_benchmark's multi-label mAP, the task metric of its multi-label
    exports: equal to the toolkit's own function (float32 torch, so 1e-6) on untied scores,
    each class equal to sklearn's average_precision_score; a class without positives adds 0."""
    import torch
    from sklearn.metrics import average_precision_score

    from featcache.core.metrics import map_clip_benchmark

    rng = np.random.default_rng(0)
    Y = rng.random((300, 7)) < 0.3
    Y[:, 6] = False  # no positive: 0 in CLIP_benchmark's mean
    S = Y * 0.8 + rng.random((300, 7))
    want = clip_benchmark_average_precision_per_class(torch.from_numpy(S).float(), torch.from_numpy(Y)).mean().item()
    assert map_clip_benchmark(Y, S) == pytest.approx(want, abs=1e-6)
    sk = [average_precision_score(Y[:, c], S[:, c]) for c in range(6)]
    assert map_clip_benchmark(Y, S) == pytest.approx(sum(sk) / 7, abs=1e-12)
    assert "map_clip_benchmark" in metric_names(7, multilabel=True)
