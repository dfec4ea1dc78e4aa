"""Statistics of the analysis stage against scipy, brute force and published numbers."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.stats as ss
from hypothesis import given, settings
from hypothesis import strategies as st

from featcache.analysis import stats
from featcache.errors import ResultsError

# ------------------------------------------------------------------ Clopper-Pearson


def test_clopper_pearson_golden_binomtest():
    lo, hi = stats.clopper_pearson(7, 50)
    assert round(float(lo), 4) == 0.0582
    assert round(float(hi), 4) == 0.2674
    ref = ss.binomtest(7, 50).proportion_ci(confidence_level=0.95, method="exact")
    assert float(lo) == pytest.approx(ref.low, abs=1e-12)
    assert float(hi) == pytest.approx(ref.high, abs=1e-12)


def test_clopper_pearson_matches_scipy_vectorised_including_edges():
    rng = np.random.default_rng(3)
    n = rng.integers(1, 400, size=60)
    k = (rng.random(60) * (n + 1)).astype(int).clip(0, n)
    k[:3] = 0
    k[3:6] = n[3:6]
    lo, hi = stats.clopper_pearson(k, n, alpha=0.1)
    for i in range(len(n)):
        ref = ss.binomtest(int(k[i]), int(n[i])).proportion_ci(confidence_level=0.9)
        assert lo[i] == pytest.approx(ref.low, abs=1e-10)
        assert hi[i] == pytest.approx(ref.high, abs=1e-10)
    assert np.all(lo[:3] == 0)
    assert np.all(hi[3:6] == 1)


@pytest.mark.parametrize(
    ("acc", "n", "published"),
    [  # Recht et al. Table 3.1 (CIFAR-10: 10,000 original / 2,000 new; ImageNet: 50,000 / 10,000)
        (0.984, 10_000, (98.1, 98.6)),
        (0.955, 2_000, (94.5, 96.4)),
        (0.775, 2_000, (75.7, 79.3)),
        (0.829, 50_000, (82.5, 83.2)),
        (0.722, 10_000, (71.3, 73.1)),
        (0.241, 10_000, (23.2, 24.9)),
    ],
)
def test_clopper_pearson_reproduces_recht_table(acc, n, published):
    lo, hi = stats.clopper_pearson(acc * n, n)
    # the paper rounds accuracies to 0.1 %, so k is only known to +-0.05 % -> allow 0.1 pt
    assert 100 * float(lo) == pytest.approx(published[0], abs=0.1)
    assert 100 * float(hi) == pytest.approx(published[1], abs=0.1)


@pytest.mark.parametrize(("k", "n", "alpha"), [(5, 3, 0.05), (1, 0, 0.05), (-1, 10, 0.05), (3, 10, 1.5)])
def test_clopper_pearson_rejects_bad_input(k, n, alpha):
    with pytest.raises(ResultsError):
        stats.clopper_pearson(k, n, alpha)


# ------------------------------------------------------------------ Kendall tau-b


def brute_tau_b(x, y):
    """O(n^2) textbook tau-b: (C - D) / sqrt((n0 - n1)(n0 - n2))."""
    c = d = tx = ty = 0
    n = len(x)
    for i, j in itertools.combinations(range(n), 2):
        dx, dy = x[i] - x[j], y[i] - y[j]
        if dx == 0 and dy == 0:
            tx += 1
            ty += 1
        elif dx == 0:
            tx += 1
        elif dy == 0:
            ty += 1
        elif dx * dy > 0:
            c += 1
        else:
            d += 1
    n0 = n * (n - 1) / 2
    den = math.sqrt((n0 - tx) * (n0 - ty))
    return float("nan") if den == 0 else (c - d) / den


def test_kendall_golden_against_scipy():
    x = [12, 2, 1, 12, 2]
    y = [1, 4, 7, 1, 0]
    tau, p = stats.kendall_tau_b(x, y)
    ref = ss.kendalltau(x, y)
    assert tau == pytest.approx(-0.47140452079103173)
    assert tau == pytest.approx(ref.statistic)
    assert p == pytest.approx(ref.pvalue)
    # untied, small n: exact permutation p-value like scipy
    x = np.array([0.1, 0.4, 0.35, 0.8, 0.6, 0.9, 0.2])
    y = np.array([0.2, 0.3, 0.5, 0.7, 0.9, 0.8, 0.1])
    tau, p = stats.kendall_tau_b(x, y, method="exact")
    ref = ss.kendalltau(x, y, method="exact")
    assert (tau, p) == pytest.approx((ref.statistic, ref.pvalue))
    tau, p = stats.kendall_tau_b(x, y, method="asymptotic")
    assert p == pytest.approx(ss.kendalltau(x, y, method="asymptotic").pvalue)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), min_size=2, max_size=25))
def test_kendall_tau_b_matches_brute_force_and_scipy_on_ties(pairs):
    x = np.array([p[0] for p in pairs], dtype=float)
    y = np.array([p[1] for p in pairs], dtype=float)
    tau, p = stats.kendall_tau_b(x, y)
    bf = brute_tau_b(x, y)
    if math.isnan(bf):
        assert math.isnan(tau)
        assert math.isnan(p)
        return
    assert tau == pytest.approx(bf, abs=1e-12)
    ref = ss.kendalltau(x, y)
    assert tau == pytest.approx(ref.statistic, abs=1e-12)
    assert p == pytest.approx(ref.pvalue, rel=1e-9, abs=1e-12)


def test_kendall_two_items_asymptotic():
    # scipy divides by n - 2 here; the normal approximation with Var(S) = 1 (two untied pairs)
    assert stats.kendall_tau_b([1, 2], [3, 4], method="asymptotic") == pytest.approx((1.0, math.erfc(1 / math.sqrt(2))))
    assert stats.kendall_tau_b([1, 2], [4, 3], method="asymptotic")[0] == -1.0
    assert stats.kendall_tau_b([1, 2], [3, 4]) == pytest.approx((1.0, ss.kendalltau([1, 2], [3, 4]).pvalue))


def test_kendall_constant_side_and_nan_pairs():
    assert all(math.isnan(v) for v in stats.kendall_tau_b([1, 1, 1], [1, 2, 3]))
    assert all(math.isnan(v) for v in stats.kendall_tau_b([1.0], [2.0]))
    tau, _ = stats.kendall_tau_b([1, 2, np.nan, 4], [1, 2, 9, 4])  # NaN pair dropped
    assert tau == pytest.approx(1.0)
    with pytest.raises(ResultsError):
        stats.kendall_tau_b([1, 2, 2], [1, 2, 3], method="exact")
    with pytest.raises(ResultsError):
        stats.kendall_tau_b([1, 2], [1, 2, 3])
    with pytest.raises(ResultsError):
        stats.kendall_tau_b([1, 2], [1, 2], method="magic")


# ------------------------------------------------------------------ z-scores and ranks


def test_zscores_by_hand_and_errors():
    v = [0.5, 0.7, 0.9, np.nan]
    z = stats.zscores(v)
    mu, sd = 0.7, math.sqrt(((0.2) ** 2 * 2) / 3)
    assert z[:3] == pytest.approx([(0.5 - mu) / sd, 0.0, (0.9 - mu) / sd])
    assert math.isnan(z[3])
    z1 = stats.zscores(v, ddof=1)
    assert z1[2] == pytest.approx(0.2 / math.sqrt(0.08 / 2))
    assert z == pytest.approx([*ss.zscore([0.5, 0.7, 0.9]).tolist(), np.nan], nan_ok=True)
    with pytest.raises(ResultsError, match="zero variance"):
        stats.zscores([0.8, 0.8, 0.8], label="setting 'x'")
    with pytest.raises(ResultsError, match="at least two"):
        stats.zscores([0.8, np.nan])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 5).map(float), st.just(float("nan"))), min_size=1, max_size=20))
def test_rankdata_matches_scipy(values):
    x = np.array(values)
    r = stats.rankdata(x)
    ok = ~np.isnan(x)
    assert np.all(np.isnan(r[~ok]))
    if ok.any():
        assert r[ok] == pytest.approx(ss.rankdata(-x[ok], method="average"))


def test_average_ranks_columns():
    m = np.array([[0.9, 0.1], [0.5, 0.1], [0.7, np.nan]])
    r = stats.average_ranks(m)
    assert r[:, 0].tolist() == [1.0, 3.0, 2.0]
    assert r[:2, 1].tolist() == [1.5, 1.5]
    assert math.isnan(r[2, 1])


# ------------------------------------------------------------------ bootstrap and line fit


def test_bootstrap_linear_fit_recovers_known_slope_and_offset():
    # Recht et al.'s CIFAR-10 line (a = 1.69, b = -72.7 %) with noise on 40 "models"
    rng = np.random.default_rng(1)
    x = rng.uniform(0.83, 0.985, size=40)
    y = 1.69 * x - 0.727 + rng.normal(0, 0.004, size=40)
    fit = stats.bootstrap_linear_fit(x, y, seed=0)  # default 100,000 resamples, vectorised
    assert fit["n_boot"] == 100_000
    assert fit["a"] == pytest.approx(1.69, abs=0.05)
    assert fit["b"] == pytest.approx(-0.727, abs=0.05)
    assert fit["a_lo"] < 1.69 < fit["a_hi"]
    assert fit["b_lo"] < -0.727 < fit["b_hi"]
    assert fit["a_hi"] - fit["a_lo"] < 0.2
    ref = ss.linregress(x, y)
    assert fit["a"] == pytest.approx(ref.slope)
    assert fit["b"] == pytest.approx(ref.intercept)
    again = stats.bootstrap_linear_fit(x, y, seed=0, n_boot=5000)
    assert again == stats.bootstrap_linear_fit(x, y, seed=0, n_boot=5000)


def test_bootstrap_linear_fit_degenerate_inputs():
    with pytest.raises(ResultsError, match="two distinct x"):
        stats.linear_fit([0.5, 0.5], [0.4, 0.3])
    with pytest.raises(ResultsError):
        stats.bootstrap_linear_fit([0.5], [0.4])
    fit = stats.bootstrap_linear_fit([0.5, 0.6], [0.4, 0.55], n_boot=2000)
    assert fit["n_degenerate"] > 0  # resamples drawing one point twice have no slope
    assert fit["a"] == pytest.approx(1.5)


def _mcnemar_brute(a, b):
    """McNemar's exact test by counting: twice the binomial tail of the smaller discordant count."""
    n01 = sum(1 for x, y in zip(a, b) if x and not y)
    n10 = sum(1 for x, y in zip(a, b) if y and not x)
    n = n01 + n10
    tail = sum(math.comb(n, i) for i in range(min(n01, n10) + 1)) / 2**n
    return n01, n10, min(1.0, 2 * tail)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=80))
def test_mcnemar_equals_counting(pairs):
    a = np.array([p[0] for p in pairs])
    b = np.array([p[1] for p in pairs])
    n01, n10, p = stats.mcnemar(a, b)
    r01, r10, rp = _mcnemar_brute(a.tolist(), b.tolist())
    assert (n01, n10) == (r01, r10)
    assert p == pytest.approx(rp, rel=1e-9, abs=1e-15)
    assert stats.mcnemar(b, a)[2] == pytest.approx(p, rel=1e-12)  # symmetric


def test_mcnemar_on_two_digits_classifiers():
    """Two real classifiers on the digits test rows: the counts are the off-diagonal cells of
    scikit-learn's confusion matrix of the two correctness vectors."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import confusion_matrix
    from sklearn.neighbors import KNeighborsClassifier

    X, y = load_digits(return_X_y=True)
    tr, te = slice(0, 1000), slice(1000, None)
    ra = LogisticRegression(max_iter=200).fit(X[tr], y[tr]).predict(X[te]) == y[te]
    rb = KNeighborsClassifier(1).fit(X[tr], y[tr]).predict(X[te]) == y[te]
    cm = confusion_matrix(ra, rb, labels=[False, True])
    n01, n10, p = stats.mcnemar(ra, rb)
    assert (n01, n10) == (cm[1, 0], cm[0, 1])
    assert 0 < p <= 1


def test_mcnemar_refuses_misaligned_rows():
    with pytest.raises(ResultsError, match="same rows"):
        stats.mcnemar(np.ones(3, bool), np.ones(4, bool))
    with pytest.raises(ResultsError, match="booleans"):
        stats.mcnemar(np.ones(3), np.ones(3))
