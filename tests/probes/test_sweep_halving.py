"""The halving C sweep (loose early-stopped scan of the warm path, then a climb at full
tolerance): its round logic on a synthetic problem (Hypothesis invariants) and its
selection and cost against the exhaustive sweep on real lite0 features."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from featcache.errors import ProbeError
from featcache.probes import DEFAULT_CS, sweep_C
from featcache.probes._halving import KEPT, PAST_PEAK, SCANNED, halving_sweep

LITE0 = "tf_efficientnet_lite0"
TOL, SCAN_TOL, MARGIN = 1e-4, 1e-3, 1e-3


class Toy:
    """A fit whose head i is the scalar 'coefficients' (i, tol): its validation top-1 is
    ``curve[i]`` at the full tolerance and ``loose[i]`` at the scan's; it costs
    ``cost[i]`` iterations to the full tolerance and a third of that to the loose one."""

    def __init__(self, curve, loose=None, cost=None):
        self.curve = list(curve)
        self.loose = list(curve) if loose is None else list(loose)
        self.cost = [3 * (i % 5) + 3 for i in range(len(curve))] if cost is None else list(cost)
        self.calls = []

    def fit(self, idx, W0, b0, tol):
        self.calls.append((list(idx), tol, W0 is None))
        W = np.array([[[float(i), tol]] for i in idx])  # [h, D=1, K=2]
        it = np.array([self.cost[i] if tol == TOL else self.cost[i] // 3 for i in idx])
        return W, np.zeros((len(idx), 2)), it, np.full(len(idx), tol == TOL)

    def score(self, idx, heads):
        return [self.curve[i] if h[0][0, 1] == TOL else self.loose[i] for i, h in zip(idx, heads)]

    def run(self, **kw):
        return halving_sweep(self.fit, self.score, len(self.curve), tol=TOL, scan_tol=SCAN_TOL, **kw)


curves = st.lists(st.integers(0, 20).map(lambda v: v / 20), min_size=1, max_size=45)
schedules = st.fixed_dictionaries({"patience": st.none() | st.integers(1, 6), "climb_patience": st.integers(1, 4)})


@settings(max_examples=200, deadline=None)
@given(curve=curves, loose=st.randoms(use_true_random=False), sched=schedules)
def test_round_invariants(curve, loose, sched):
    n = len(curve)
    lv = [min(1.0, max(0.0, v + loose.choice([-0.1, 0.0, 0.05]))) for v in curve]
    toy = Toy(curve, lv)
    out = toy.run(**sched)
    # every C is refined, scanned only, or never fitted: each with its reason
    assert len(out.status) == n
    for i, s in enumerate(out.status):
        assert s in (KEPT, SCANNED, PAST_PEAK)
        assert (out.heads[i] is None) == (s == PAST_PEAK)
        assert (out.n_iter[i] == 0 and math.isnan(out.val[i])) if s == PAST_PEAK else out.n_iter[i] > 0
        assert out.converged[i] == (s == KEPT)
    # the scan is a prefix of the grid; the selected C is refined, the best refined one
    scanned = [i for i, s in enumerate(out.status) if s != PAST_PEAK or out.heads[i] is not None]
    assert out.status[out.best_index] == KEPT
    refined = [i for i, s in enumerate(out.status) if s == KEPT]
    # the smallest refined C within the margin of the best refined one
    top = max(curve[i] for i in refined)
    assert out.best_index == min(i for i in refined if curve[i] >= top - MARGIN)
    assert out.val[out.best_index] == curve[out.best_index]
    assert scanned == list(range(len(scanned)))
    # the refined C values are contiguous on the path (the climb walks neighbours)
    assert refined == list(range(refined[0], refined[-1] + 1))
    assert out.head_iters == sum(out.n_iter)
    assert out.rounds[-1]["head_iters"] == out.head_iters
    # deterministic: the same input gives the same selection and cost
    again = Toy(curve, lv).run(**sched)
    assert (again.best_index, again.n_iter, again.status) == (out.best_index, out.n_iter, out.status)


@settings(max_examples=100, deadline=None)
@given(curve=curves, p=st.integers(1, 5), c=st.integers(1, 3))
def test_cost_is_bounded_by_the_schedule(curve, p, c):
    """The scan costs more with more patience (it scans a longer prefix of the path); the
    climb refines the scan's best, the C values up to the selected one and at most
    ``climb_patience`` losers on each side."""
    scan = [Toy(curve).run(patience=q, climb_patience=c).rounds[0] for q in (p, p + 1, None)]
    assert scan[0]["head_iters"] <= scan[1]["head_iters"] <= scan[2]["head_iters"]
    out = Toy(curve).run(patience=p, climb_patience=c)
    refined = out.status.count(KEPT)
    assert refined <= 1 + abs(out.best_index - out.rounds[0]["best"]) + 2 * c


@settings(max_examples=100, deadline=None)
@given(peak=st.integers(0, 44), n=st.integers(1, 45), shift=st.integers(-3, 3), c=st.integers(1, 3))
def test_unimodal_curve_finds_the_exhaustive_peak(peak, n, shift, c):
    """On a strictly unimodal full-tolerance curve the climb reaches its peak from any scan
    peak that lies on the curve (the loose scan may peak up to 3 C values off)."""
    peak = min(peak, n - 1)
    curve = [1.0 - abs(i - peak) / 50 for i in range(n)]
    lp = min(max(peak + shift, 0), n - 1)
    loose = [0.5 - abs(i - lp) / 50 for i in range(n)]
    out = Toy(curve, loose).run(patience=4, climb_patience=c)
    assert out.best_index == peak


def test_scan_stops_after_patience_and_starts_from_the_initial_head():
    curve = [0.1, 0.5, 0.9, 0.8, 0.7, 0.6, 0.95, 0.2]  # a second, later peak the scan gives up on
    toy = Toy(curve)
    out = toy.run(patience=3, climb_patience=1)
    assert out.status[6:] == [PAST_PEAK, PAST_PEAK]
    assert out.best_index == 2
    assert toy.calls[0] == ([0], SCAN_TOL, True)  # only the first C starts from the sweep's head
    assert all(not first for _, _, first in toy.calls[1:])
    assert Toy(curve).run(patience=None, climb_patience=1).best_index == 6


def test_a_flat_start_or_plateau_does_not_stop_the_scan():
    """The smallest C values all predict the majority class (a flat start), and a plateau
    within the margin of the best is no loss: only clearly worse C values count."""
    curve = [0.1] * 10 + [0.1 + 0.04 * k for k in range(1, 11)] + [0.5, 0.5, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1]
    out = Toy(curve).run(patience=2, climb_patience=1)
    assert out.best_index == 19
    assert out.status[10:20].count(PAST_PEAK) == 0
    assert out.status[-2:] == [PAST_PEAK, PAST_PEAK]  # stopped 2 clearly worse C values past the plateau


def test_climb_walks_through_heads_that_did_not_move():
    """A C whose warm start already meets the tolerance (0 iterations) is a copy of its
    neighbour: it costs no patience, so the climb reaches the later, real improvement;
    a real tie (the head moved, the score did not) does cost patience."""
    curve = [0.1, 0.5, 0.9, 0.9, 0.9, 0.95, 0.3]
    loose = [0.1, 0.5, 0.9, 0.8, 0.8, 0.8, 0.3]  # the scan peaks at C index 2
    frozen = Toy(curve, loose, cost=[3, 3, 3, 0, 0, 3, 3])
    assert frozen.run(patience=None, climb_patience=1).best_index == 5
    moved = Toy(curve, loose, cost=[3, 3, 3, 3, 3, 3, 3])
    assert moved.run(patience=None, climb_patience=1).best_index == 2
    # within the margin the smaller C stays selected
    assert Toy([0.1, 0.9, 0.9005, 0.2]).run(patience=None, climb_patience=2).best_index == 1
    assert Toy([0.1, 0.9, 0.9011, 0.2]).run(patience=None, climb_patience=2).best_index == 2


def test_schedule_errors_say_what_to_change(digits16):
    X, y, tr, va = digits16
    args = (X[tr], y[tr], X[va], y[va], [1.0, 2.0])
    with pytest.raises(ProbeError, match="halving_climb"):
        sweep_C(*args, backend="torch", sweep="halving", halving_climb=0)
    with pytest.raises(ProbeError, match="halving_patience"):
        sweep_C(*args, backend="torch", sweep="halving", halving_patience=0)
    with pytest.raises(ProbeError, match="halving_scan_tol"):
        sweep_C(*args, backend="torch", sweep="halving", halving_scan_tol=1e-6)


@pytest.fixture(scope="module")
def fmnist_split(fmnist_cache):
    """lite0 Fashion-MNIST features: train for fitting, test (1,000 images) for selection."""
    from featcache.store import open_cache

    c = open_cache(fmnist_cache)
    tr = c.load(LITE0, "fashion-mnist-small", "train")
    te = c.load(LITE0, "fashion-mnist-small", "test")
    return tr.X, np.asarray(tr.labels), te.X, np.asarray(te.labels)


def _check_against_exhaustive(Xt, yt, Xv, yv):
    ex = sweep_C(Xt, yt, Xv, yv, DEFAULT_CS, backend="torch", block=1)
    hv = sweep_C(Xt, yt, Xv, yv, DEFAULT_CS, backend="torch", sweep="halving")
    # the same C, or one whose (exhaustive, converged) validation top-1 is within 0.1 point;
    # measured 2026-12-03 with OMP_NUM_THREADS=1 and =2, TEST_WORKERS=0: the same C on both data sets at both
    # (digits 0.01, Fashion-MNIST 0.00178), 5 heads kept, head iterations 265/334 and 327/462
    assert hv.best_C == ex.best_C or ex.val_top1[hv.best_index] >= max(ex.val_top1) - 1e-3
    assert hv.converged[hv.best_index]
    assert hv.heads[hv.best_index] is not None
    assert hv.info["head_iters"] < ex.info["head_iters"]
    st_ = hv.info["status"]
    assert st_.count(KEPT) >= 2  # the scan's best and at least one neighbour at full tolerance
    return ex, hv


def test_halving_selects_the_exhaustive_C_on_digits(digits16):
    X, y, tr, va = digits16
    ex, hv = _check_against_exhaustive(X[tr], y[tr], X[va], y[va])
    # the iteration counts follow the features, which differ in their float16 roundings from
    # one machine's extraction to another's: halving / exhaustive head iterations measured
    # 265/334 = 0.79 on these features and 259/312 = 0.83 on a copy with 2% of the roundings
    # flipped (the same C selected in both, 1 thread); the old bar 0.8 sat inside that spread
    assert hv.info["head_iters"] < 0.9 * ex.info["head_iters"]
    again = sweep_C(X[tr], y[tr], X[va], y[va], DEFAULT_CS, backend="torch", sweep="halving")
    assert (again.best_index, again.n_iter, again.info["status"]) == (hv.best_index, hv.n_iter, hv.info["status"])


def test_halving_selects_the_exhaustive_C_on_fashion_mnist(fmnist_split):
    _check_against_exhaustive(*fmnist_split)
