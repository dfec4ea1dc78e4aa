"""CKA and RSA as pure functions: the google-research notebook's golden values and its code
(ported in similarity_refs.py), thingsvision's code where its definitions match, the streamed
and minibatch forms against the full formulas, invariances, and alignment by sample id."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import similarity_refs as ref
from hypothesis import given, settings
from hypothesis import strategies as st

from featcache.errors import DataError
from featcache.similarity import (
    AlignmentError,
    LinearCKAStream,
    MinibatchCKA,
    align_ids,
    cka,
    gram_linear,
    gram_rbf,
    linear_cka,
    rbf_cka,
    rdm,
    rsa,
)
from featcache.similarity.measures import spearman
from featcache.similarity.streaming import paired_blocks


def _notebook_xy():
    rs = np.random.RandomState(1337)  # np.random.seed(1337)'s stream, draw for draw, as the notebook
    X = rs.randn(100, 10)
    Y = rs.randn(100, 10) + X
    return X, Y


def _pair(seed: int, n: int = 60, dx: int = 12, dy: int = 7):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, dx)) @ rng.normal(size=(dx, dx))
    Y = np.tanh(X[:, :dy] + 0.5 * rng.normal(size=(n, dy))) + 3.0
    return X, Y


# ------------------------------------------------------------------ golden values, references
def test_notebook_golden_values():
    X, Y = _notebook_xy()
    assert round(linear_cka(X, Y), 5) == 0.55761
    assert round(linear_cka(X, Y, debiased=True), 5) == 0.51346
    assert round(rbf_cka(X, Y, 0.5), 5) == 0.65483
    assert round(cka(gram_linear(X), gram_linear(Y)), 5) == 0.55761
    assert round(cka(gram_linear(X), gram_linear(Y), debiased=True), 5) == 0.51346


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_the_notebook_code(seed):
    X, Y = _pair(seed)
    assert linear_cka(X, Y) == pytest.approx(ref.feature_space_linear_cka(X, Y), rel=1e-12)
    assert linear_cka(X, Y, True) == pytest.approx(ref.feature_space_linear_cka(X, Y, True), rel=1e-12)
    assert linear_cka(X, Y, True) == pytest.approx(ref.cka(ref.gram_linear(X), ref.gram_linear(Y), True), rel=1e-9)
    for t in (0.2, 0.5, 1.0):
        assert rbf_cka(X, Y, t) == pytest.approx(ref.cka(ref.gram_rbf(X, t), ref.gram_rbf(Y, t)), rel=1e-12)
        want = ref.cka(ref.gram_rbf(X, t), ref.gram_rbf(Y, t), debiased=True)
        assert rbf_cka(X, Y, t, debiased=True) == pytest.approx(want, rel=1e-12)


def test_minibatch_equals_efficient_cka_port():
    X, Y = _pair(3, n=120)
    ours, theirs = MinibatchCKA("linear"), ref.MinibatchCKA()
    for bx, by in paired_blocks(X, Y, 30):
        ours.update(bx, by)
        theirs.update_state_across_models([bx.copy()], [by.copy()])
    assert ours.result() == pytest.approx(float(theirs.result()[0, 0]), rel=1e-12)
    # one minibatch of every row is the debiased CKA of the whole
    assert MinibatchCKA().update(X, Y).result() == pytest.approx(linear_cka(X, Y, True), rel=1e-10)


def test_minibatch_rbf_is_the_debiased_rbf_cka_per_minibatch():
    """featcache's extension: efficient_CKA's estimator on Gaussian Gram matrices, each
    minibatch with its own median bandwidth (or a fixed sigma)."""
    X, Y = _pair(12, n=90)
    one = MinibatchCKA("rbf", 0.5).update(X, Y).result()
    assert one == pytest.approx(ref.cka(ref.gram_rbf(X, 0.5), ref.gram_rbf(Y, 0.5), debiased=True), rel=1e-10)
    est = MinibatchCKA("rbf", sigma=2.0)
    parts = [(X[:45], Y[:45]), (X[45:], Y[45:])]
    est.update_all(parts)
    kx = [ref.center_gram(gram_rbf(a, sigma=2.0), unbiased=True) for a, _ in parts]
    ky = [ref.center_gram(gram_rbf(b, sigma=2.0), unbiased=True) for _, b in parts]
    xy = sum(np.vdot(a, b) for a, b in zip(kx, ky))
    want = xy / np.sqrt(sum(np.vdot(a, a) for a in kx) * sum(np.vdot(b, b) for b in ky))
    assert est.result() == pytest.approx(want, rel=1e-12)


def test_thingsvision_where_definitions_match():
    X, Y = _pair(4)
    tv = ref.CKANumPy(len(X), "linear")
    assert linear_cka(X, Y) == pytest.approx(tv.compare(X, Y), rel=1e-10)
    tvu = ref.CKANumPy(len(X), "linear", unbiased=True)
    assert linear_cka(X, Y, True) == pytest.approx(tvu.compare(X, Y), rel=1e-9)
    # thingsvision's rbf kernel: compare() always uses sigma=1.0 (apply_kernel passes no sigma)
    Xs, Ys = X / np.linalg.norm(X, axis=1).mean(), Y / np.linalg.norm(Y, axis=1).mean()
    tvr = ref.CKANumPy(len(X), "rbf", sigma=None)
    assert rbf_cka(Xs, Ys, sigma=1.0) == pytest.approx(tvr.compare(Xs, Ys), rel=1e-10)


def test_thingsvision_median_width_differs_from_google():
    """thingsvision's sigma=None takes the median of the nonzero squared distances (diagonal
    left out), google-research's the median over all n^2 entries (diagonal zeros in): the two
    bandwidths differ, so featcache offers google's heuristic and thingsvision's fixed sigma."""
    X, _ = _pair(5)
    d2 = np.maximum(np.diag(X @ X.T)[:, None] + np.diag(X @ X.T)[None] - 2 * X @ X.T, 0)
    tv_sigma = np.sqrt(np.median(d2[d2 != 0]))
    assert ref.CKANumPy(len(X), "rbf").rbf_kernel(X, None) == pytest.approx(gram_rbf(X, sigma=tv_sigma), rel=1e-9)
    assert not np.allclose(gram_rbf(X, 1.0), gram_rbf(X, sigma=tv_sigma))


@pytest.mark.parametrize("method", ["correlation", "cosine"])
def test_rsa_equals_thingsvision(method):
    X, Y = _pair(6)
    want = ref.correlate_rdms(ref.compute_rdm(X, method), ref.compute_rdm(Y, method), "spearman")
    assert rsa(X, Y, method) == pytest.approx(want, rel=1e-12)
    assert rdm(X, method) == pytest.approx(ref.compute_rdm(X, method), abs=1e-12)


def test_spearman_with_ties_equals_scipy():
    rng = np.random.default_rng(7)
    a, b = rng.integers(0, 5, 200).astype(float), rng.integers(0, 7, 200).astype(float)
    assert spearman(a, b) == pytest.approx(scipy.stats.spearmanr(a, b)[0], rel=1e-12)


# ------------------------------------------------------------------ streaming
@pytest.mark.parametrize("rows", [1, 7, 64, 1000])
def test_streamed_linear_equals_full(rows):
    X, Y = _pair(8, n=300, dx=20, dy=9)
    X = X + 1e4  # a large common offset: the shift keeps the centering exact
    s = LinearCKAStream()
    for bx, by in paired_blocks(X, Y, rows):
        s.update(bx, by)
    assert s.n == 300
    assert s.result() == pytest.approx(ref.feature_space_linear_cka(X, Y), rel=1e-9)
    assert s.result(debiased=True) == pytest.approx(ref.feature_space_linear_cka(X, Y, True), rel=1e-9)


def test_streamed_float16_rows_equal_full_on_the_same_values():
    X, Y = _pair(9, n=200)
    X16, Y16 = X.astype(np.float16), Y.astype(np.float16)
    s = LinearCKAStream()
    for bx, by in paired_blocks(X16, Y16, 33):
        s.update(bx, by)
    full = ref.feature_space_linear_cka(X16.astype(np.float64), Y16.astype(np.float64), True)
    assert s.result(True) == pytest.approx(full, rel=1e-9)


def test_stream_refuses_too_few_rows_and_nan():
    s = LinearCKAStream().update(np.ones((3, 2)), np.ones((3, 2)))
    with pytest.raises(DataError, match="at least 4"):
        s.result(debiased=True)
    with pytest.raises(DataError, match="NaN"):
        LinearCKAStream().update(np.full((2, 2), np.nan), np.ones((2, 2)))


# ------------------------------------------------------------------ invariances
def _orthogonal(seed: int, d: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(d, d)))
    return q * np.sign(np.diag(r))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cx=st.floats(1e-3, 1e3), cy=st.floats(1e-3, 1e3))
def test_invariant_to_orthogonal_transforms_and_isotropic_scaling(seed, cx, cy):
    X, Y = _pair(seed, n=40, dx=6, dy=5)
    X2, Y2 = cx * X @ _orthogonal(seed, 6), cy * Y @ _orthogonal(seed + 1, 5)
    for deb in (False, True):
        assert linear_cka(X2, Y2, deb) == pytest.approx(linear_cka(X, Y, deb), rel=1e-7)
    assert rbf_cka(X2, Y2, 0.5) == pytest.approx(rbf_cka(X, Y, 0.5), rel=1e-7)  # the median scales along
    assert rsa(X2, Y2, "cosine") == pytest.approx(rsa(X, Y, "cosine"), rel=1e-7)  # cosine RDMs: rotation free


def test_not_invariant_to_non_isotropic_scaling():
    X, Y = _pair(10, n=80, dx=6, dy=5)
    D = np.diag([10.0, 1, 1, 1, 1, 0.1])
    for deb in (False, True):
        assert abs(linear_cka(X @ D, Y, deb) - linear_cka(X, Y, deb)) > 0.01
    assert abs(rbf_cka(X @ D, Y, 0.5) - rbf_cka(X, Y, 0.5)) > 0.01


# ------------------------------------------------------------------ alignment
def test_shuffled_rows_are_realigned_by_id():
    X, Y = _pair(11, n=50)
    ids = np.array([f"img-{i:03d}" for i in range(50)])
    p = np.random.default_rng(0).permutation(50)
    ia, ib = align_ids(ids, ids[p])
    assert (ids[ia] == ids[p][ib]).all()
    assert linear_cka(X[ia], Y[p][ib]) == pytest.approx(linear_cka(X, Y), rel=1e-12)
    assert linear_cka(X, Y[p]) != pytest.approx(linear_cka(X, Y), rel=1e-3)  # unaligned would differ


def test_missing_and_duplicated_ids_are_refused_with_their_count():
    ids = np.array([f"img-{i}" for i in range(10)])
    with pytest.raises(AlignmentError, match=r"^2 sample id\(s\) of a are missing from b"):
        align_ids(ids, ids[:8])
    with pytest.raises(AlignmentError, match=r"1 of b are missing from a"):
        align_ids(ids[:9], np.r_[ids[:8], ["other"]])
    with pytest.raises(AlignmentError, match=r"^3 sample id\(s\) occur more than once in b"):
        align_ids(ids, np.r_[ids, ids[:3]])
    with pytest.raises(DataError):  # an AlignmentError is a DataError (and a ValueError)
        align_ids(ids, ids[::-1][:5])
