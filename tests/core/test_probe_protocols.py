"""Protocol parsing and seeded splits: exact sizes, stratification, determinism, errors."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits

from featcache.core.protocols import parse_protocol
from featcache.core.splits import (
    allocate,
    fewshot_split,
    sample_per_class,
    stratified_holdout,
    stratified_sample,
)
from featcache.errors import ProbeError


@pytest.fixture(scope="module")
def y():
    return load_digits().target  # 1797 real labels, 10 classes of 174-183


def test_parse_protocols():
    assert parse_protocol("full").name == "full"
    p = parse_protocol("fewshot:20")
    assert (p.name, p.shots, p.spec) == ("fewshot", 20, "fewshot:20")
    s = parse_protocol("subset:1%")
    assert (s.name, s.fraction, s.spec) == ("subset", 0.01, "subset:1%")
    assert parse_protocol("subset:10%").fraction == pytest.approx(0.1)
    assert parse_protocol("vtab1k").solver == "lbfgs"
    assert parse_protocol("salman").solver == "sgd"
    assert parse_protocol("vtab1k-sgd").solver == "sgd"


@pytest.mark.parametrize("bad", ["fewshot:1", "fewshot:0"])
def test_fewshot_one_is_an_error_that_says_why(bad):
    with pytest.raises(ProbeError, match="at least one training and one validation"):
        parse_protocol(bad)


@pytest.mark.parametrize("bad", ["nope", "subset:0%", "subset:100%", "fewshot:x", "subset:5"])
def test_unknown_protocol(bad):
    with pytest.raises(ProbeError):
        parse_protocol(bad)


def test_allocate_is_exact_and_proportional():
    counts = np.array([178, 182, 177, 183, 181, 182, 181, 179, 174, 180])
    for total in (1, 10, 18, 135, 1000, 1797):
        a = allocate(counts, total)
        assert a.sum() == total
        quota = counts * total / counts.sum()
        assert np.all(np.abs(a - quota) < 1)


def _class_counts(y, idx):
    return np.bincount(y[idx], minlength=10)


def test_holdout_10pct_exact_stratified_disjoint(y):
    tr, va = stratified_holdout(y, 0.1, seed=0)
    assert va.size == round(0.1 * y.size) == 180
    assert tr.size + va.size == y.size
    assert np.intersect1d(tr, va).size == 0
    share = _class_counts(y, va) / np.bincount(y)
    assert np.all(np.abs(_class_counts(y, va) - 0.1 * np.bincount(y)) < 1)
    assert share.min() > 0.05


def test_seeds_are_deterministic_and_differ(y):
    a = stratified_holdout(y, 0.1, seed=3)
    b = stratified_holdout(y, 0.1, seed=3)
    c = stratified_holdout(y, 0.1, seed=4)
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    assert not np.array_equal(a[1], c[1])
    assert np.array_equal(fewshot_split(y, 5, 1)[0], fewshot_split(y, 5, 1)[0])
    assert np.array_equal(stratified_sample(y, 1000, 2), stratified_sample(y, 1000, 2))


@pytest.mark.parametrize(("n", "n_tr", "n_va"), [(2, 1, 1), (5, 4, 1), (20, 16, 4), (50, 40, 10)])
def test_fewshot_counts_before_the_split(y, n, n_tr, n_va):
    tr, va = fewshot_split(y, n, seed=0)
    assert np.all(_class_counts(y, tr) == n_tr)
    assert np.all(_class_counts(y, va) == n_va)
    assert np.intersect1d(tr, va).size == 0


def test_fewshot_needs_enough_per_class(y):
    with pytest.raises(ProbeError, match="fewer"):
        sample_per_class(y, 500, seed=0)
    with pytest.raises(ProbeError, match="N >= 2"):
        fewshot_split(y, 1, seed=0)


def test_vtab_1000_then_800_200(y):
    idx = stratified_sample(y, 1000, seed=0)
    assert idx.size == 1000
    assert np.unique(idx).size == 1000
    assert np.all(np.abs(_class_counts(y, idx) - 1000 * np.bincount(y) / y.size) < 1)
    tr, va = stratified_holdout(y[idx], 0.2, seed=0)
    assert (tr.size, va.size) == (800, 200)
    with pytest.raises(ProbeError, match="needs 1000"):
        stratified_sample(y[:900], 1000, seed=0)


@pytest.mark.parametrize("frac", [0.01, 0.1])
def test_subset_keeps_label_distribution(y, frac):
    n = round(frac * y.size)
    idx = stratified_sample(y, n, seed=0, min_per_class=1)
    counts = _class_counts(y, idx)
    assert counts.min() >= 1
    assert idx.size == max(n, 10) if frac == 0.01 else idx.size == n
    if frac == 0.1:
        assert np.all(np.abs(counts - frac * np.bincount(y)) < 1)


def test_holdout_too_small_is_an_error():
    with pytest.raises(ProbeError, match="too few"):
        stratified_holdout(np.array([0, 1, 2, 3]), 0.1, seed=0)
