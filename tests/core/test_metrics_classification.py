"""featcache.core.metrics vs brute-force references and scikit-learn, ties included."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from sklearn.metrics import (
    accuracy_score,
    balanced_accuracy_score,
    log_loss,
    top_k_accuracy_score,
)

from featcache.core.metrics import compute_all, ece, mean_per_class, nll, top1, top5, top_k


# ------------------------------------------------------------ brute-force references
def ref_topk(y, s, k):
    hits = 0
    for i in range(len(y)):
        order = sorted(range(s.shape[1]), key=lambda j: (-s[i, j], j))  # ties: lower index first
        hits += y[i] in order[:k]
    return hits / len(y)


def ref_mpc(y, p):
    accs = []
    for c in sorted(set(y.tolist())):
        idx = [i for i in range(len(y)) if y[i] == c]
        accs.append(sum(p[i] == c for i in idx) / len(idx))
    return sum(accs) / len(accs)


def ref_nll(y, P):
    return -sum(np.log(max(P[i, y[i]], np.finfo(float).eps)) for i in range(len(y))) / len(y)


def ref_ece(y, P, n_bins=15):
    edges = np.linspace(0, 1, n_bins + 1)
    conf = P.max(1)
    pred = np.array([min(range(P.shape[1]), key=lambda j: (-P[i, j], j)) for i in range(len(y))])
    total = 0.0
    for b in range(n_bins):
        lo, hi = edges[b], edges[b + 1]
        members = [i for i in range(len(y)) if (lo < conf[i] <= hi) or (b == 0 and conf[i] == 0)]
        if members:
            acc = np.mean([pred[i] == y[i] for i in members])
            cf = np.mean([conf[i] for i in members])
            total += len(members) / len(y) * abs(acc - cf)
    return total


def softmax(Z):
    Z = Z - Z.max(1, keepdims=True)
    E = np.exp(Z)
    return E / E.sum(1, keepdims=True)


@pytest.fixture(scope="module")
def tied():
    """Seeded scores quantised to 4 levels: many ties, some rows all-equal."""
    rng = np.random.default_rng(0)
    n, K = 400, 12
    s = rng.integers(0, 4, size=(n, K)).astype(float)
    s[:5] = 1.0  # fully tied rows
    y = rng.integers(0, K, size=n)
    return y, s


@pytest.fixture(scope="module")
def probs():
    rng = np.random.default_rng(1)
    n, K = 600, 10
    y = rng.integers(0, K, size=n)
    Z = rng.normal(size=(n, K)) * 2
    Z[np.arange(n), y] += 1.5
    P = softmax(Z)
    P[:10] = np.round(P[:10], 1)  # rounded rows: ties and exact bin edges
    P[:10] /= P[:10].sum(1, keepdims=True)
    return y, P


def test_top1_matches_brute_force_and_sklearn_on_ties(tied):
    y, s = tied
    assert top1(y, s) == pytest.approx(ref_topk(y, s, 1))
    assert top1(y, s) == pytest.approx(accuracy_score(y, s.argmax(1)))


@pytest.mark.parametrize("k", [1, 2, 5, 11])
def test_topk_matches_brute_force_on_ties(tied, k):
    y, s = tied
    assert top_k(y, s, k) == pytest.approx(ref_topk(y, s, k))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_topk_matches_sklearn(tied, probs, k):
    # no ties: identical to sklearn
    y, P = probs
    P = P[10:]
    y = y[10:]
    assert top_k(y, P, k) == pytest.approx(top_k_accuracy_score(y, P, k=k, labels=range(P.shape[1])))
    # ties: sklearn ranks the higher class index first; reversing the columns turns our
    # "lower index first" rule into sklearn's, so the two must agree exactly
    y, s = tied
    K = s.shape[1]
    ours = top_k(y, s, k)
    theirs = top_k_accuracy_score(K - 1 - y, s[:, ::-1], k=k, labels=range(K))
    assert ours == pytest.approx(theirs)


def test_top5_is_topk5(probs):
    y, P = probs
    assert top5(y, P) == top_k(y, P, 5)
    assert top5(y, P) >= top1(y, P)


def test_mean_per_class_vs_reference_and_balanced_accuracy(probs):
    y, P = probs
    p = P.argmax(1)
    assert mean_per_class(y, p) == pytest.approx(ref_mpc(y, p))
    assert mean_per_class(y, P) == pytest.approx(balanced_accuracy_score(y, p))


def test_mean_per_class_skips_absent_classes():
    y = np.array([0, 0, 0, 2, 2])
    p = np.array([0, 1, 1, 2, 1])  # class 1 predicted but absent from y_true: skipped
    assert mean_per_class(y, p) == pytest.approx((1 / 3 + 1 / 2) / 2)
    with pytest.warns(UserWarning, match="y_pred contains classes not in y_true"):  # sklearn's warning
        assert mean_per_class(y, p) == pytest.approx(balanced_accuracy_score(y, p))


def test_nll_vs_reference_and_sklearn(probs):
    y, P = probs
    assert nll(y, P) == pytest.approx(ref_nll(y, P), rel=1e-12)
    assert nll(y, P) == pytest.approx(log_loss(y, P, labels=range(P.shape[1])), rel=1e-9)


def test_nll_clips_zero_probability():
    y = np.array([0, 1])
    P = np.array([[1.0, 0.0], [1.0, 0.0]])
    assert nll(y, P) == pytest.approx(-np.log(np.finfo(float).eps) / 2)


def test_ece_vs_reference(probs):
    y, P = probs
    assert ece(y, P) == pytest.approx(ref_ece(y, P), abs=1e-12)
    assert ece(y, P, n_bins=7) == pytest.approx(ref_ece(y, P, 7), abs=1e-12)


def test_ece_bin_edges_are_right_closed():
    # confidence exactly 0.6 lies in bin (8/15, 9/15]: a hand-computed case
    y = np.array([0, 1, 0])
    P = np.array([[0.6, 0.4], [0.6, 0.4], [1.0, 0.0]])
    # bin with conf 0.6: acc 1/2, conf 0.6 -> |0.5-0.6| * 2/3 ; bin (14/15,1]: acc 1, conf 1 -> 0
    assert ece(y, P) == pytest.approx(0.1 * 2 / 3)


def test_ece_perfectly_calibrated_is_zero():
    y = np.array([0, 1, 1, 1])
    P = np.array([[0.75, 0.25]] * 4)  # conf 0.75, predicts 0, right 1/4 of the time -> 0.5
    assert ece(y, P) == pytest.approx(0.5)
    P2 = np.array([[0.25, 0.75]] * 4)  # predicts 1, right 3/4 = conf
    assert ece(y, P2) == pytest.approx(0.0)


def test_compute_all_skips_top5_for_few_classes(probs):
    y, P = probs
    assert set(compute_all(y, P)) == {"top1", "top5", "mean_per_class", "nll", "ece"}
    y3 = np.array([0, 1, 2])
    assert "top5" not in compute_all(y3, np.eye(3))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="integer"):
        top1(np.array([0.0, 1.0]), np.eye(2))
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        top1(np.array([0, 2]), np.eye(2))
    with pytest.raises(ValueError, match="N=3"):
        top1(np.array([0, 1, 1]), np.eye(2))


# ------------------------------------------------------------------ invariants
score_mats = (
    st.integers(2, 8)
    .flatmap(
        lambda K: st.tuples(
            arrays(np.int64, st.integers(1, 40), elements=st.integers(0, K - 1)),
            st.just(K),
        )
    )
    .flatmap(
        lambda t: st.tuples(
            st.just(t[0]),
            arrays(np.float64, (t[0].size, t[1]), elements=st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0])),
        )
    )
)


@settings(max_examples=60, deadline=None)
@given(score_mats)
def test_invariants(data):
    y, s = data
    K = s.shape[1]
    accs = [top_k(y, s, k) for k in range(1, K + 1)]
    assert all(0.0 <= a <= 1.0 for a in accs)
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(accs))  # monotone in k
    assert accs[-1] == 1.0  # top-K is always right
    assert top1(y, s) == pytest.approx(ref_topk(y, s, 1))
    assert top_k(y, s, 2) == pytest.approx(ref_topk(y, s, 2))
    # permuting samples changes nothing
    perm = np.random.default_rng(0).permutation(y.size)
    assert top1(y[perm], s[perm]) == pytest.approx(top1(y, s))
    assert mean_per_class(y[perm], s[perm]) == pytest.approx(mean_per_class(y, s))
    P = softmax(s)
    assert 0.0 <= ece(y, P) <= 1.0
    assert nll(y, P) >= 0.0
    assert ece(y, P) == pytest.approx(ref_ece(y, P), abs=1e-12)
