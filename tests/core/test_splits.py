"""featcache.core.splits: exact sizes, stratification, determinism and errors on real digits labels."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from featcache.core import splits as S
from featcache.errors import DataError, ProbeError, SplitError


@pytest.fixture(scope="module")
def digits_y() -> np.ndarray:
    from featcache.data.readers import open_dataset

    tr = open_dataset("digits")["train"]
    return np.asarray(tr.labels)[S.canonical_order(tr.ids)]


def test_canonical_order_sorts_ids_stably():
    ids = np.array(["b", "a", "c", "a"])
    assert S.canonical_order(ids).tolist() == [1, 3, 0, 2]
    assert S.canonical_order(np.array([10, 9, 100])).tolist() == [0, 2, 1]  # "10" < "100" < "9"


def test_allocate_sums_exactly_and_is_proportional():
    counts = np.array([5, 3, 2])
    assert S.allocate(counts, 5).tolist() == [3, 1, 1]  # 2.5/1.5/1.0: tie broken by lower class
    per = S.allocate(np.array([178, 182, 177, 183, 181, 182, 181, 179, 174, 180]), 1000)
    assert per.sum() == 1000
    assert per.min() >= 96
    assert per.max() <= 102
    with pytest.raises(SplitError, match="cannot draw"):
        S.allocate(counts, 11)


def test_vtab1k_sizes_stratified_disjoint_deterministic(digits_y):
    tr, va = S.vtab1k_indices(digits_y, seed=0)
    assert tr.size == 800
    assert va.size == 200
    assert np.intersect1d(tr, va).size == 0
    assert np.all(np.diff(tr) > 0)
    assert np.all(np.diff(va) > 0)
    # stratified: every class's share of the 1000 is within one example of its share of train
    both = np.concatenate([tr, va])
    full = np.bincount(digits_y, minlength=10) / digits_y.size
    got = np.bincount(digits_y[both], minlength=10)
    assert np.all(np.abs(got - full * 1000) <= 1)
    vc = np.bincount(digits_y[va], minlength=10)
    assert np.all(np.abs(vc - got * 0.2) <= 1)
    tr2, va2 = S.vtab1k_indices(digits_y, seed=0)
    assert np.array_equal(tr, tr2)
    assert np.array_equal(va, va2)
    tr1, _ = S.vtab1k_indices(digits_y, seed=1)
    assert not np.array_equal(tr, tr1)


def test_full_holdout_and_subset(digits_y):
    t, v = S.full_holdout(digits_y, seed=3)
    assert v.size == round(0.1 * digits_y.size)
    assert t.size + v.size == digits_y.size
    assert np.union1d(t, v).size == digits_y.size
    sub = S.subset_indices(digits_y, 0.01, seed=0)
    assert sub.size >= 10
    assert set(digits_y[sub]) == set(range(10))
    with pytest.raises(SplitError, match="fraction"):
        S.subset_indices(digits_y, 1.5, seed=0)


def test_fewshot_counts_before_split(digits_y):
    t, v = S.fewshot_split(digits_y, 5, seed=0)
    assert np.bincount(digits_y[t]).tolist() == [4] * 10
    assert np.bincount(digits_y[v]).tolist() == [1] * 10
    with pytest.raises(SplitError, match="N >= 2"):
        S.fewshot_split(digits_y, 1, seed=0)


def test_errors_are_both_data_and_probe_errors(digits_y):
    with pytest.raises(SplitError, match="needs 1000 training examples"):
        S.vtab1k_indices(digits_y[:900], seed=0)
    with pytest.raises(DataError):
        S.sample_per_class(digits_y, 500, seed=0)
    with pytest.raises(ProbeError):
        S.stratified_holdout(np.array([0, 1]), 0.5, seed=0)


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(2, 40), min_size=2, max_size=8),
    frac=st.floats(0.05, 0.5),
    seed=st.integers(0, 2**31 - 1),
)
def test_holdout_invariants(counts, frac, seed):
    y = np.repeat(np.arange(len(counts)), counts)
    rng = np.random.default_rng(seed)
    y = y[rng.permutation(y.size)]
    n_val = round(frac * y.size)
    if n_val < 1 or y.size - n_val < len(counts):
        with pytest.raises(SplitError):
            S.stratified_holdout(y, frac, seed)
        return
    t, v = S.stratified_holdout(y, frac, seed)
    assert v.size == n_val
    assert t.size + v.size == y.size
    assert np.intersect1d(t, v).size == 0
    assert set(y[t]) == set(range(len(counts)))  # every class keeps a training example
    t2, v2 = S.stratified_holdout(y, frac, seed)
    assert np.array_equal(t, t2)
    assert np.array_equal(v, v2)
