"""Intervals over images for the dense metrics (core/dense_intervals.py): the per-image parts
the accumulators keep sum back to the split's numbers, the bootstrap equals a brute-force loop
and scipy's percentile bootstrap, and a paired interval draws the same images for both."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from featcache.core.dense_intervals import (
    bootstrap_interval,
    hbird_miou_from_confusions,
    miou_from_areas,
    paired_bootstrap,
)
from featcache.core.dense_metrics import HummingbirdAccumulator, SegmentationAccumulator
from featcache.errors import MetricInputError


def _maps(seed: int, n: int = 12, k: int = 5):
    rng = np.random.default_rng(seed)
    lab = rng.integers(0, k, size=(n, 9, 11))
    lab[rng.random(lab.shape) < 0.1] = 255
    pred = np.where(rng.random(lab.shape) < 0.6, lab, rng.integers(0, k, size=lab.shape))
    pred[pred == 255] = 0
    return lab, pred


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_per_image_areas_sum_to_the_split(seed: int) -> None:
    lab, pred = _maps(seed)
    split = SegmentationAccumulator(5)
    split.update(lab, pred)
    kept = SegmentationAccumulator(5, keep_images=True)
    for i in range(0, len(lab), 5):  # batches of images, as a solver streams them
        kept.update(lab[i : i + 5], pred[i : i + 5])
    assert kept.images is not None
    assert len(kept.images) == len(lab)
    assert kept.compute() == split.compute()
    assert miou_from_areas(np.stack(kept.images)) == split.compute()["miou"]
    hb, hk = HummingbirdAccumulator(5), HummingbirdAccumulator(5, keep_images=True)
    hb.update(lab, pred)
    hk.update(lab, pred)
    assert hk.images is not None
    assert hbird_miou_from_confusions(np.stack(hk.images)) == hb.compute()


def test_bootstrap_equals_a_brute_force_loop_and_scipy() -> None:
    from scipy import stats

    x = np.random.default_rng(3).normal(size=40)
    iv = bootstrap_interval(x, lambda p: float(p.mean()), n_boot=500, seed=7)
    rng = np.random.default_rng(7)
    idx = rng.integers(0, 40, size=(500, 40))
    brute = np.sort([x[i].mean() for i in idx])
    assert (iv.lo, iv.hi) == tuple(np.percentile(brute, [2.5, 97.5]))
    assert iv.value == x.mean()
    ref = stats.bootstrap((x,), np.mean, n_resamples=4000, method="percentile", random_state=1).confidence_interval
    assert abs(iv.lo - ref.low) < 0.1
    assert abs(iv.hi - ref.high) < 0.1


def test_paired_bootstrap_draws_the_same_images() -> None:
    lab, pred = _maps(1, n=30)
    a = SegmentationAccumulator(5, keep_images=True)
    a.update(lab, pred)
    assert a.images is not None
    areas = np.stack(a.images)
    same = paired_bootstrap(areas, areas, miou_from_areas, n_boot=200)
    assert same.value == same.lo == same.hi == 0.0  # identical images on both sides: no spread
    worse = areas.copy()
    worse[:, 0] //= 2  # half the intersections: lower IoU on every resample
    d = paired_bootstrap(areas, worse, miou_from_areas, n_boot=200)
    assert 0 < d.lo <= d.value <= d.hi


def test_bad_input_is_one_line() -> None:
    with pytest.raises(MetricInputError, match="same images"):
        paired_bootstrap(np.zeros(3), np.zeros(4), float)
    with pytest.raises(MetricInputError, match="at least one image"):
        bootstrap_interval(np.zeros(0), float)
    with pytest.raises(MetricInputError, match="level"):
        bootstrap_interval(np.ones(3), lambda p: float(p.mean()), level=1.5)


def test_headline_interval_is_the_runs_own_number() -> None:
    from featcache.core.dense_intervals import headline_interval

    lab, pred = _maps(5, n=20)
    acc = SegmentationAccumulator(5, keep_images=True)
    acc.update(lab, pred)
    assert acc.images is not None
    name, iv = headline_interval({"aacc": 0.0, **acc.compute()}, np.stack(acc.images), n_boot=100)
    assert (name, iv.value, iv.n_images) == ("miou", acc.compute()["miou"], 20)
    rmse = np.array([0.5, np.nan, 0.7, 0.9])  # an image without valid pixels is left out, as the mean does
    name, iv = headline_interval({"rmse": 0.7, "delta1": 0.9}, rmse, n_boot=100)
    assert (name, iv.value) == ("rmse", float(np.nanmean(rmse)))
    assert headline_interval({"macc": 0.5}, np.ones((3, 3, 5))) is None  # no headline metric
    assert headline_interval({"miou": 0.5}, None) is None  # no parts kept
