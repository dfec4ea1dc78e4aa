"""LogisticProbe and sweep_C on real lite0 features: accuracy floors, backend parity, C
meaning, sweep == individual fits, head_init, non-convergence, error paths."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from featcache.errors import BackendUnavailableError, ProbeError
from featcache.probes import DEFAULT_CS, LogisticProbe, resolve_backend, sweep_C
from featcache.probes.logistic import cuml_C

LITE0 = "tf_efficientnet_lite0"


@pytest.fixture(scope="module")
def digits(digits_cache):
    from featcache.store import open_cache

    c = open_cache(digits_cache)
    tr = c.load(LITE0, "digits", "train")
    te = c.load(LITE0, "digits", "test")
    return tr.X, tr.labels, te.X, te.labels


@pytest.fixture(scope="module")
def standardized(digits):
    Xtr, ytr, Xte, yte = digits
    mu, sd = Xtr.mean(0), Xtr.std(0)
    sd[sd < 1e-12] = 1
    return ((Xtr - mu) / sd).astype(np.float32), ytr, ((Xte - mu) / sd).astype(np.float32), yte


def test_default_grid():
    assert len(DEFAULT_CS) == 45
    assert DEFAULT_CS[0] == pytest.approx(1e-6)
    assert DEFAULT_CS[-1] == pytest.approx(1e5)
    assert np.allclose(np.diff(np.log10(DEFAULT_CS)), 0.25)


def test_lite0_digits_accuracy_floor(digits):
    Xtr, ytr, Xte, yte = digits
    p = LogisticProbe(C=1.0, backend="torch").fit(Xtr, ytr)
    assert p.fit(Xtr, ytr) is p
    assert p.converged_
    # ImageNet lite0 at 112 px, 1,347 train images (raw-pixel LR gets ~0.96); measured
    # 1 thread 0.9511, 2 threads 0.9511
    assert p.score(Xte, yte) > 0.93


@pytest.mark.parametrize("C", [0.01, 1.0])
def test_parity_sklearn_torch_on_standardized_real_features(standardized, C):
    Xtr, ytr, Xte, yte = standardized
    a = LogisticProbe(C=C, backend="torch", standardize=False).fit(Xtr, ytr)
    b = LogisticProbe(C=C, backend="sklearn", standardize=False).fit(Xtr, ytr)
    pa, pb = a.predict(Xte), b.predict(Xte)
    # measured |d top1|, agreement, rel: C=0.01: 0, 1.0, 0.0022; C=1: 0.0022, 0.9933, 0.051
    # (1 thread); 2 threads: the same
    assert abs(np.mean(pa == yte) - np.mean(pb == yte)) <= 0.005
    assert np.mean(pa == pb) >= 0.98
    # the same C means the same problem: the solutions are close (not just the predictions)
    # (both stop at max|grad| <= 1e-4, which pins weakly regularised solutions less tightly)
    rel = np.linalg.norm(a.coef_ - b.coef_) / np.linalg.norm(b.coef_)
    assert rel < (0.02 if C < 0.1 else 0.1)
    assert a.coef_.shape == b.coef_.shape == (10, Xtr.shape[1])


def test_c_meaning_is_sklearns_and_binary_matches(standardized):
    """Binary problem with string labels: torch's 2-class softmax at C/2 == sklearn's binary
    logistic regression at C (one weight vector, coef_ [1, D])."""
    Xtr, ytr, Xte, yte = standardized
    names = np.array(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"])
    m, mt = np.isin(ytr, [3, 8]), np.isin(yte, [3, 8])
    a = LogisticProbe(C=0.05, backend="torch", standardize=False).fit(Xtr[m], names[ytr[m]])
    b = LogisticProbe(C=0.05, backend="sklearn", standardize=False).fit(Xtr[m], names[ytr[m]])
    assert list(a.classes_) == ["eight", "three"]
    assert a.coef_.shape == (1, Xtr.shape[1])
    assert np.linalg.norm(a.coef_ - b.coef_) / np.linalg.norm(b.coef_) < 0.05
    assert np.mean(a.predict(Xte[mt]) == b.predict(Xte[mt])) >= 0.98
    assert set(a.predict(Xte[mt])) <= {"three", "eight"}
    # a 10x different C gives a clearly different solution (the check above can fail)
    c = LogisticProbe(C=0.5, backend="sklearn", standardize=False).fit(Xtr[m], names[ytr[m]])
    assert np.linalg.norm(a.coef_ - c.coef_) / np.linalg.norm(c.coef_) > 0.1


def test_standardize_is_folded_into_coef(digits):
    Xtr, ytr, Xte, _ = digits
    p = LogisticProbe(C=0.1, backend="torch").fit(Xtr, ytr)
    Z = Xte.astype(np.float64) @ p.coef_.T + p.intercept_
    assert np.allclose(Z, p.decision_function(Xte))
    P = p.predict_proba(Xte)
    assert np.allclose(P.sum(1), 1)
    assert np.array_equal(P.argmax(1), Z.argmax(1))


def test_sweep_heads_equal_individual_fits(digits):
    Xtr, ytr, _, _ = digits
    tr, va = np.arange(1100), np.arange(1100, 1347)
    Cs = [1e-4, 1e-2, 1.0, 100.0]
    sw = sweep_C(Xtr[tr], ytr[tr], Xtr[va], ytr[va], Cs, backend="torch", sweep_tol=1e-4)
    assert sw.Cs == Cs
    assert len(sw.val_top1) == 4
    for i, C in enumerate(Cs):
        single = LogisticProbe(C=C, backend="torch").fit(Xtr[tr], ytr[tr])
        coef, inter = sw.heads[i]
        ps = (Xtr[va] @ coef.T + inter).argmax(1)
        # measured 2026-12-03 with OMP_NUM_THREADS=1 and =2, TEST_WORKERS=0: 1.0 (every prediction the same) at all four C, both thread counts
        assert np.mean(ps == single.predict(Xtr[va])) >= 0.98
        assert sw.val_top1[i] == pytest.approx(np.mean(ps == ytr[va]))
    assert sw.best_index == int(np.flatnonzero(np.array(sw.val_top1) == max(sw.val_top1))[0])


def test_sweep_sklearn_backend_selects_like_torch(digits):
    Xtr, ytr, _, _ = digits
    tr, va = np.arange(1100), np.arange(1100, 1347)
    Cs = [1e-5, 1e-3, 1e-1]
    # converged (tol 1e-6), the two solvers reach the same heads: validation top-1 149, 215 and 224
    # of 247 for both ({M});
    # at the default tol 1e-4 they stop at different points near the optimum, 226 against 224 at
    # C=0.1, 2 of the 2.47 samples the bar allows, a margin that a machine's kernels can move
    a = sweep_C(Xtr[tr], ytr[tr], Xtr[va], ytr[va], Cs, backend="torch", tol=1e-6)
    b = sweep_C(Xtr[tr], ytr[tr], Xtr[va], ytr[va], Cs, backend="sklearn", tol=1e-6)
    assert np.allclose(a.val_top1, b.val_top1, atol=0.01)
    assert a.best_index == b.best_index
    assert a.backend == "torch"
    assert b.backend == "sklearn"


def test_head_init_is_used(digits):
    """max_iter=0 returns the initial head: class prototypes classify digits, zeros do not."""
    Xtr, ytr, Xte, yte = digits
    protos = np.stack([Xtr[ytr == c].mean(0) for c in range(10)])
    protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    p0 = LogisticProbe(C=1.0, backend="torch", max_iter=0, head_init=protos * 20).fit(Xtr, ytr)
    z0 = LogisticProbe(C=1.0, backend="torch", max_iter=0).fit(Xtr, ytr)
    # measured 2026-12-03 with OMP_NUM_THREADS=1 and =2, TEST_WORKERS=0: 0.784 and 0.100 at both
    assert p0.score(Xte, yte) > 0.5
    assert z0.score(Xte, yte) < 0.2
    assert not p0.converged_
    assert not z0.converged_
    # a converged fit reaches the same optimum from either start (convex problem)
    a = LogisticProbe(C=0.1, backend="torch", head_init=protos).fit(Xtr, ytr)
    b = LogisticProbe(C=0.1, backend="torch").fit(Xtr, ytr)
    assert np.mean(a.predict(Xte) == b.predict(Xte)) >= 0.98  # measured 0.9978 at 1 and 2 threads
    with pytest.raises(ProbeError, match="dimension"):
        LogisticProbe(head_init=protos[:, :10]).fit(Xtr, ytr)
    with pytest.raises(ProbeError, match="rows"):
        LogisticProbe(head_init=protos[:5]).fit(Xtr, ytr)


def test_non_convergence_is_recorded_and_logged(digits, caplog):
    Xtr, ytr, _, _ = digits
    with caplog.at_level(logging.WARNING, logger="featcache.probes.logistic"):
        p = LogisticProbe(C=100.0, backend="torch", max_iter=3).fit(Xtr, ytr)
        q = LogisticProbe(C=100.0, backend="sklearn", max_iter=3).fit(Xtr, ytr)
    assert p.converged_ is False
    assert p.n_iter_ == 3
    assert q.converged_ is False
    assert "did not converge" in caplog.text


def test_auto_backend_logs_choice(caplog):
    import torch

    with caplog.at_level(logging.INFO, logger="featcache.probes.logistic"):
        name, device = resolve_backend("auto")
    assert "probe backend auto ->" in caplog.text
    if not torch.cuda.is_available():
        assert (name, device) == ("torch", "cpu")
        assert "CPU fallback" in caplog.text


def test_cuml_without_gpu_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(BackendUnavailableError, match="CUDA GPU"):
        resolve_backend("cuml")
    with pytest.raises(BackendUnavailableError):
        LogisticProbe(backend="cuml").fit(np.eye(4, dtype=np.float32), [0, 1, 0, 1])
    with pytest.raises(ProbeError, match="unknown backend"):
        resolve_backend("jax")


def test_cuml_c_mapping():
    assert cuml_C(0.5, 1000, "24.12.0") == 0.5  # cuML >= 0.15 scales like scikit-learn
    assert cuml_C(0.5, 1000, "0.14.0") == 500.0  # older cuML needs C * n_samples


def test_bad_input_errors(digits):
    Xtr, ytr, _, _ = digits
    X = Xtr[:200].copy()
    y = ytr[:200]
    with pytest.raises(ProbeError, match="single class"):
        LogisticProbe().fit(X, np.zeros(200, int))
    X[7, 3] = np.nan
    with pytest.raises(ProbeError, match="NaN or inf"):
        LogisticProbe().fit(X, y)
    X[7, 3] = np.inf
    with pytest.raises(ProbeError, match="NaN or inf"):
        sweep_C(X, y, Xtr[200:300], ytr[200:300], [1.0])
    with pytest.raises(ProbeError, match="not fitted"):
        LogisticProbe().predict(Xtr[:3])
    with pytest.raises(ProbeError, match="C must be > 0"):
        LogisticProbe(C=0).fit(Xtr[:200], y)
    with pytest.raises(ProbeError, match="1-D"):
        LogisticProbe().fit(Xtr[:200], y[:100])
    m = ytr[:300] != 9
    with pytest.raises(ProbeError, match="does not occur in train"):
        sweep_C(Xtr[:300][m], ytr[:300][m], Xtr[300:400], ytr[300:400], [1.0])


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_parity_torch_cuda(standardized):
    Xtr, ytr, Xte, yte = standardized
    a = LogisticProbe(C=0.1, backend="torch", standardize=False).fit(Xtr, ytr)
    assert a.device_ == "cuda"
    b = LogisticProbe(C=0.1, backend="sklearn", standardize=False).fit(Xtr, ytr)
    pa, pb = a.predict(Xte), b.predict(Xte)
    assert abs(np.mean(pa == yte) - np.mean(pb == yte)) <= 0.005
    assert np.mean(pa == pb) >= 0.98


@pytest.mark.gpu
@pytest.mark.parametrize("C", [0.01, 1.0])
def test_parity_cuml(standardized, C):
    pytest.importorskip("cuml")
    Xtr, ytr, Xte, yte = standardized
    a = LogisticProbe(C=C, backend="cuml", standardize=False).fit(Xtr, ytr)
    b = LogisticProbe(C=C, backend="sklearn", standardize=False).fit(Xtr, ytr)
    pa, pb = a.predict(Xte), b.predict(Xte)
    assert abs(np.mean(pa == yte) - np.mean(pb == yte)) <= 0.005
    assert np.mean(pa == pb) >= 0.98
    assert a.converged_, f"cuML solution not stationary for featcache's objective (grad {a.grad_max_})"


def test_sgd_drop_remainder_trains_on_full_batches_only(standardized):
    """SGDProbe(drop_remainder=True): every step sees a full batch, the stream of seeded epoch
    permutations featcache's fine-tuning uses (VTAB's repeat + batch(drop_remainder=True));
    checked against a hand-written SGD loop over those batches on real features."""
    import torch

    from featcache.core.splits import batch_positions
    from featcache.probes import SGDProbe

    Xtr, ytr, _, _ = standardized
    X, y = Xtr[:50].astype(np.float64), ytr[:50]  # 50 rows, batch 16: epochs end mid-batch
    kw = {
        "lr": 0.05,
        "steps": 7,
        "batch_size": 16,
        "momentum": 0.9,
        "standardize": False,
        "device": "cpu",
        "random_state": 3,
    }
    full = SGDProbe(**kw, drop_remainder=True).fit(X, y)
    partial = SGDProbe(**kw).fit(X, y)
    classes = np.unique(y)
    lin = torch.nn.Linear(X.shape[1], classes.size)
    torch.nn.init.zeros_(lin.weight)
    torch.nn.init.zeros_(lin.bias)
    opt = torch.optim.SGD(lin.parameters(), lr=0.05, momentum=0.9)
    Xt, yt = torch.tensor(X, dtype=torch.float32), torch.tensor(np.searchsorted(classes, y))
    for step in range(7):
        bi = torch.from_numpy(batch_positions(50, 16, 3, step))
        assert bi.numel() == 16  # never a partial batch
        loss = torch.nn.functional.cross_entropy(lin(Xt[bi]), yt[bi])
        opt.zero_grad()
        loss.backward()
        opt.step()
    np.testing.assert_allclose(full.coef_, lin.weight.detach().double().numpy(), rtol=1e-5, atol=1e-7)
    assert not np.allclose(full.coef_, partial.coef_)  # the default keeps each epoch's partial batch
