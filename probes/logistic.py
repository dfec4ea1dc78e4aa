"""Multinomial logistic-regression probe with one meaning of C on every backend.

featcache's C is scikit-learn's: the fit minimises ``sum_i CE_i + 1/(2C) ||W||^2`` (the
intercept is not penalised; for two classes, the binary logistic loss with one weight
vector, exactly as :class:`sklearn.linear_model.LogisticRegression`). Backends:

``sklearn``  scikit-learn lbfgs (CPU, float64), the reference.
``torch``    featcache's batched float32 L-BFGS (:mod:`featcache.probes._solver`), CPU or CUDA.
``cuml``     RAPIDS cuML (GPU) through a thin adapter that maps C and checks stationarity.
``auto``     cuML when a GPU and cuML are present, else torch on the GPU, else torch on
             the CPU (parity-tested against sklearn and much faster for C sweeps).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from sklearn.base import BaseEstimator, ClassifierMixin

from featcache.core.protocols import C_GRID
from featcache.errors import ProbeError
from featcache.probes._estimator import (
    SoftmaxPredictMixin,
    check_labels,
    label_indices,
    softmax_proba,
    validate_fit_data,
)
from featcache.probes._stream import state_heads, use_streaming
from featcache.probes.backends import BACKENDS, cuda_available

log = logging.getLogger(__name__)

#: Kornblith et al. / DINOv2 grid: 45 values log-spaced over [1e-6, 1e5] (the protocols' grid)
DEFAULT_CS = C_GRID


def resolve_backend(backend: str = "auto") -> tuple[str, str]:
    """Return ``(backend, device)`` for a requested backend (:data:`~featcache.probes.backends.BACKENDS`);
    logs what ``auto`` chose."""
    if backend not in BACKENDS:
        raise ProbeError(BACKENDS.unknown(backend, what="unknown backend", known="choose one of"))
    cuda = cuda_available()
    choice = BACKENDS[backend](cuda)
    if choice[0] != backend:  # auto: say what it chose
        log.info(
            "probe backend %s -> %s on %s%s",
            backend,
            choice[0],
            choice[1],
            "" if cuda else " (no CUDA GPU found; CPU fallback)",
        )
    return choice


def _check_Xy(X, y, cast: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    X = np.asarray(X)
    if X.ndim != 2:
        raise ProbeError(f"features must be a 2-D array [n_samples, n_features], got shape {X.shape}")
    y = check_labels(y, X.shape[0])
    from featcache.probes._stream import check_finite_rows

    check_finite_rows(X)
    y_idx, classes = label_indices(y)
    if cast or X.dtype.kind != "f":
        X = X.astype(np.float32, copy=False)
    return X, y_idx, classes


def _is_lazy(X) -> bool:
    """An array-like read by slicing (zarr.Array, dask, h5py, featcache's StoredRows) rather
    than a numpy array."""
    return (
        not isinstance(X, np.ndarray)
        and hasattr(X, "dtype")
        and hasattr(X, "shape")
        and hasattr(X, "__getitem__")
        and len(X.shape) == 2
        and type(X).__module__.split(".")[0] in ("zarr", "dask", "h5py", "featcache")
    )


def _lazy_Xy(X: Any, y: ArrayLike) -> tuple[Any, np.ndarray, np.ndarray]:
    """(X, y_idx, classes) of a lazily read array, checked block by block; a view with a
    store order (StoredRows) is put in that order, labels alike, so every stored chunk is
    decoded once per pass (the objective is a sum over rows: the order changes nothing)."""
    from featcache.probes._stream import check_finite_rows

    y = check_labels(y, X.shape[0])
    if hasattr(X, "sorted_order"):
        order = X.sorted_order()
        X, y = X.take(order), y[order]
    check_finite_rows(X)
    y_idx, classes = label_indices(y)
    return X, y_idx, classes


def _validate_lazy(est, X: Any, y: ArrayLike) -> tuple[Any, np.ndarray, np.ndarray]:
    """Checks of :func:`validate_fit_data` for a lazily read array, block by block."""
    X, y_idx, classes = _lazy_Xy(X, y)
    est.n_features_in_ = int(X.shape[1])
    return X, y_idx, classes


def _prepare(X, standardize: bool, streamed: bool, device: str):
    """(scaler, solver input): standardised float32 features, or a row-block source over
    ``X`` in its stored dtype when ``streamed`` (statistics accumulated block by block)."""
    if not streamed:
        X = np.asarray(X[:] if _is_lazy(X) else X, np.float32)
        scaler = Scaler.fit(X, standardize)
        return scaler, scaler.transform(X)
    from featcache.probes._stream import RowSource, chunked_moments

    log.info(
        "streaming %d x %d %s features in row blocks (in-memory fit would exceed max_host_bytes)",
        X.shape[0],
        X.shape[1],
        X.dtype,
    )
    D = X.shape[1]
    if standardize:
        mu, sd = chunked_moments(X)
        sd[sd < 1e-12] = 1.0
        scaler = Scaler(mu, sd)
    else:
        scaler = Scaler(np.zeros(D, np.float64), np.ones(D, np.float64))
    return scaler, RowSource(X, scaler.mean, scaler.scale, device)


@dataclass
class Scaler:
    mean: np.ndarray
    scale: np.ndarray

    @classmethod
    def fit(cls, X: np.ndarray, enabled: bool) -> Scaler:
        D = X.shape[1]
        if not enabled:
            return cls(np.zeros(D, np.float64), np.ones(D, np.float64))
        mu = X.mean(axis=0, dtype=np.float64)
        sd = X.std(axis=0, dtype=np.float64)
        sd[sd < 1e-12] = 1.0
        return cls(mu, sd)

    def transform(self, X: np.ndarray) -> np.ndarray:
        return ((X - self.mean) / self.scale).astype(np.float32)

    # raw-space (coef [K, D], intercept [K]) <-> standardized-space (W [D, K], b [K])
    def to_raw(self, W: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        Wd = np.asarray(W, np.float64)
        coef = (Wd / self.scale[:, None]).T
        intercept = np.asarray(b, np.float64) - (self.mean / self.scale) @ Wd
        return coef, intercept

    def from_raw(self, coef: np.ndarray, intercept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        coef = np.asarray(coef, np.float64)
        W = coef.T * self.scale[:, None]
        b = np.asarray(intercept, np.float64) + self.mean @ coef.T
        return W, b


def _softmax_init(coef, intercept, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw-space init (sklearn layout: binary [1, D]) -> K-column softmax init."""
    coef = np.asarray(coef, np.float64)
    intercept = np.zeros(coef.shape[0]) if intercept is None else np.asarray(intercept, np.float64)
    if K == 2 and coef.shape[0] == 1:
        return np.vstack([-coef / 2, coef / 2]), np.array([-intercept[0] / 2, intercept[0] / 2])
    if coef.shape[0] != K:
        raise ProbeError(
            f"initial head has {coef.shape[0]} rows but the labels hold {K} classes; "
            "give one row per class, in the order of classes_"
        )
    return coef, intercept


def _softmax_to_sklearn(coef: np.ndarray, intercept: np.ndarray):
    if coef.shape[0] == 2:  # softmax with C/2 == binary logistic with C; w = w1 - w0
        return (coef[1] - coef[0])[None, :], np.array([intercept[1] - intercept[0]])
    return coef, intercept


class LogisticProbe(SoftmaxPredictMixin, ClassifierMixin, BaseEstimator):
    """L2-regularised logistic regression on frozen features: a scikit-learn classifier.

    Parameters
    ----------
    C : inverse L2 strength, scikit-learn's meaning on every backend.
    backend : ``auto`` | ``sklearn`` | ``cuml`` | ``torch``.
    max_iter, tol : solver limits (tol: max |gradient| of the 1/n-scaled objective, as lbfgs).
    standardize : z-score features with the training mean/std (folded into ``coef_``).
    head_init : optional [K, D] raw-feature-space class-embedding matrix (ELEVATER's
        language-initialised head): the solver starts from logits ``X @ head_init.T``.
        For a convex, converged fit it changes the path, not the optimum.
    max_host_bytes : torch backend: when the in-memory fit would allocate more than this
        (float32 features + one-hot labels + logits, see :mod:`featcache.probes._stream`),
        ``X`` stays in its stored dtype (e.g. float16) and the solver streams it in row
        blocks. ``X`` may also be a zarr array (e.g. a store's feature array): it is then
        read chunk by chunk on every pass and never held whole. ``None``: 1 GiB. The streamed fit agrees with the in-memory one to float32
        summation order.

    Attributes
    ----------
    classes_, n_features_in_, coef_ ([1, D] for two classes, else [K, D]), intercept_,
    n_iter_, converged_, grad_max_, backend_, device_, fit_seconds_, streamed_.
    """

    def __init__(
        self,
        C: float = 1.0,
        backend: str = "auto",
        max_iter: int = 1000,
        tol: float = 1e-4,
        standardize: bool = True,
        head_init: ArrayLike | None = None,
        max_host_bytes: int | None = None,
    ) -> None:
        self.C = C
        self.backend = backend
        self.max_iter = max_iter
        self.tol = tol
        self.standardize = standardize
        self.head_init = head_init
        self.max_host_bytes = max_host_bytes

    # ------------------------------------------------------------------ fit
    def fit(self, X: ArrayLike, y: ArrayLike, *, init: tuple[np.ndarray, np.ndarray] | None = None) -> LogisticProbe:
        """Fit on ``X [n, D]`` and labels ``y`` (any ints or strings).

        ``init=(coef, intercept)`` in raw feature space (e.g. another probe's ``coef_`` and
        ``intercept_``) warm-starts the solver; it overrides ``head_init``.
        """
        if not self.C > 0:
            raise ProbeError(f"C must be > 0, got {self.C}")
        if _is_lazy(X):  # a zarr/dask array: read row blocks on demand, never whole
            rows, yi, classes = _validate_lazy(self, X, y)
        else:
            rows, yi, classes = validate_fit_data(self, X, y, cast=False)
        self.classes_ = classes
        K = classes.size
        self.backend_, self.device_ = resolve_backend(self.backend)
        n, D = rows.shape[0], rows.shape[1]
        self.streamed_ = self.backend_ == "torch" and use_streaming(n, D, K, 1, self.max_host_bytes)
        scaler, Xs = _prepare(rows, self.standardize, self.streamed_, self.device_)
        W0, b0 = self._initial_head(scaler, init, K, D)
        t0 = time.perf_counter()
        W, b, n_iter, conv, gmax = self._solve(Xs, yi, K, W0, b0)
        self.fit_seconds_ = time.perf_counter() - t0
        coef, intercept = scaler.to_raw(W, b)
        self._softmax_coef, self._softmax_intercept = coef, intercept
        self.coef_, self.intercept_ = _softmax_to_sklearn(coef, intercept)
        self.n_iter_ = n_iter
        self.converged_ = conv
        self.grad_max_ = gmax
        if not conv:
            log.warning(
                "LogisticProbe(C=%g, backend=%s) did not converge in %d iterations "
                "(max|grad|=%.3g > tol=%g); raise max_iter or tol",
                self.C,
                self.backend_,
                n_iter,
                gmax,
                self.tol,
            )
        return self

    def _initial_head(self, scaler: Scaler, init, K: int, D: int):
        """Standardised-space (W0, b0) from ``init`` or ``head_init``; (None, None) = zeros."""
        if init is None and self.head_init is not None:
            init = (np.asarray(self.head_init, np.float64), None)
        if init is None:
            return None, None
        coef0, int0 = _softmax_init(init[0], init[1], K)
        if coef0.shape[1] != D:
            raise ProbeError(
                f"initial head has dimension {coef0.shape[1]} but the features "
                f"have {D}; use a class-embedding matrix of the same backbone"
            )
        return scaler.from_raw(coef0, int0)

    def _solve(self, Xs, yi, K: int, W0, b0) -> tuple[np.ndarray, np.ndarray, int, bool, float]:
        if self.backend_ == "torch":
            W, b, n_iter, conv, gmax = _fit_torch(Xs, yi, K, [self.C], self.device_, self.max_iter, self.tol, W0, b0)
            return W[0], b[0], int(n_iter[0]), bool(conv[0]), float(gmax[0])
        if self.backend_ == "sklearn":
            return _fit_sklearn(Xs, yi, K, self.C, self.max_iter, self.tol, W0, b0)
        return _fit_cuml(Xs, yi, K, self.C, self.max_iter, self.tol)


# ---------------------------------------------------------------- backends
def solver_threads() -> int:
    """Intra-op threads for the CPU solver: FEATCACHE_PROBE_THREADS, else half the cores.

    Small float32 GEMMs gain little from more threads, and on a shared machine torch's
    spinning worker threads can make a fit several times slower, so the default leaves
    cores to other work. Thread count can change float32 sums in the last bit.
    """
    env = os.environ.get("FEATCACHE_PROBE_THREADS")
    if env:
        return max(1, int(env))
    return max(1, (os.cpu_count() or 2) // 2)


@contextlib.contextmanager
def cpu_threads(device: str):
    """Limit torch's intra-op threads to :func:`solver_threads` while fitting on the CPU."""
    import torch

    prev = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(min(prev, solver_threads()))
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _fit_torch(Xs, yi, K, Cs, device, max_iter, tol, W0=None, b0=None, block=None):
    """Batched torch fit of one softmax head per C (binary: C/2, see module docstring)."""
    import torch

    from featcache.probes._solver import lbfgs_multihead

    X_t = torch.from_numpy(np.ascontiguousarray(Xs)).to(device) if isinstance(Xs, np.ndarray) else Xs
    y_t = torch.from_numpy(yi).to(device)
    Cs_eff = [c / 2 if K == 2 else c for c in Cs]
    theta0 = None
    if W0 is not None:
        assert b0 is not None  # a start head has both
        if np.ndim(W0) == 3:  # one start per head: [H, D, K], [H, K]
            theta0 = torch.from_numpy(np.concatenate([W0.reshape(len(W0), -1), b0], axis=1).astype(np.float32))
        else:
            theta0 = torch.from_numpy(np.concatenate([W0.reshape(-1), b0]).astype(np.float32))[None]
    with cpu_threads(device):
        r = lbfgs_multihead(X_t, y_t, Cs_eff, K, theta0=theta0, max_iter=max_iter, tol=tol, block=block)
    return (
        r.W.double().cpu().numpy(),
        r.b.double().cpu().numpy(),
        r.n_iter.numpy(),
        r.converged.numpy(),
        r.grad_max.double().cpu().numpy(),
    )


def _fit_sklearn(Xs, yi, K, C, max_iter, tol, W0=None, b0=None):
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(C=C, max_iter=max_iter, tol=tol, solver="lbfgs", warm_start=W0 is not None)
    if W0 is not None:
        assert b0 is not None  # a start head has both
        coef, inter = _softmax_to_sklearn(W0.T, b0)
        clf.coef_, clf.intercept_ = coef.copy(), inter.copy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        clf.fit(Xs.astype(np.float64), yi)
    not_conv = any(issubclass(w.category, ConvergenceWarning) for w in caught)
    n_iter = int(np.max(clf.n_iter_))
    coef, inter = np.asarray(clf.coef_), np.asarray(clf.intercept_)
    if K == 2:
        coef, inter = np.vstack([-coef / 2, coef / 2]), np.array([-inter[0] / 2, inter[0] / 2])
    W, b = coef.T, inter
    gmax = _grad_max(Xs, yi, W, b, C if K > 2 else C / 2)
    return W, b, n_iter, (not not_conv) and n_iter < max_iter, gmax


def cuml_C(C: float, n_samples: int, cuml_version: str) -> float:
    """featcache (= scikit-learn) C -> the C to hand cuML.

    cuML's Python layer passes ``l2 = 1/C`` to its quasi-Newton solver, which minimises the
    *mean* loss. Since cuML 0.15 (rapidsai/cuml#2494) the C++ layer divides the penalty by
    n_samples, which makes C mean scikit-learn's; older releases did not, and need C * n.
    """
    major, minor = (int(p) for p in cuml_version.split(".")[:2])
    return C if (major, minor) >= (0, 15) else C * n_samples


def _fit_cuml(Xs, yi, K, C, max_iter, tol):  # pragma: no cover - needs a GPU with cuML
    import cuml  # pyright: ignore[reportMissingImports]  # the optional gpu extra
    from cuml.linear_model import LogisticRegression  # pyright: ignore[reportMissingImports]

    clf = LogisticRegression(
        C=cuml_C(C, Xs.shape[0], cuml.__version__),
        penalty="l2",
        max_iter=max_iter,
        tol=tol,
        fit_intercept=True,
        output_type="numpy",
    )
    clf.fit(Xs, yi.astype(np.int32))
    coef = np.asarray(clf.coef_, np.float64).reshape(-1, Xs.shape[1])
    inter = np.asarray(clf.intercept_, np.float64).reshape(-1)
    if K == 2:
        coef, inter = np.vstack([-coef / 2, coef / 2]), np.array([-inter[0] / 2, inter[0] / 2])
    W, b = coef.T, inter
    n_iter = int(np.max(np.asarray(getattr(clf, "n_iter_", [max_iter]))))
    gmax = _grad_max(Xs, yi, W, b, C if K > 2 else C / 2)
    # the adapter's own check that cuML solved featcache's problem (catches a C scale mismatch)
    conv = n_iter < max_iter and gmax <= 10 * tol
    if gmax > 10 * tol:
        log.warning(
            "cuML solution is not stationary for featcache's objective at C=%g "
            "(max|grad|=%.3g); its C scaling may differ in cuML %s",
            C,
            gmax,
            cuml.__version__,
        )
    return W, b, n_iter, conv, gmax


def _grad_max(Xs, yi, W, b, C_softmax) -> float:
    """max |gradient| of the 1/n-scaled softmax objective at (W [D, K], b [K]) (float64)."""
    n = Xs.shape[0]
    Z = Xs.astype(np.float64) @ W + b
    Z -= Z.max(axis=1, keepdims=True)
    P = np.exp(Z)
    P /= P.sum(axis=1, keepdims=True)
    P[np.arange(n), yi] -= 1.0
    gW = Xs.T.astype(np.float64) @ P / n + W / (C_softmax * n)
    gb = P.sum(axis=0) / n
    return float(max(np.abs(gW).max(), np.abs(gb).max()))


# ------------------------------------------------------------------- sweep
@dataclass
class SweepResult:
    """Outcome of a C sweep: validation top-1 (and the selection metric) per C, the selected C."""

    Cs: list[float]
    val_top1: list[float]
    best_index: int
    n_iter: list[int]
    converged: list[bool]
    backend: str
    seconds: float
    heads: list = field(default_factory=list, repr=False)  # raw-space (coef, intercept) per C
    tol: float = 1e-3
    metric: str = "top1"  # the validation metric C was selected on
    val_scores: list[float] = field(default_factory=list)  # that metric per C
    info: dict = field(default_factory=dict)  # sweep schedule: mode, head-iterations, rounds

    @property
    def best_C(self) -> float:
        return self.Cs[self.best_index]


def select_index(val_scores) -> int:
    """Best validation score; ties go to the smallest C (strongest regularisation)."""
    s = np.asarray(val_scores, np.float64)
    return int(np.flatnonzero(s == s.max())[0])


def sweep_C(
    X_train: ArrayLike,
    y_train: ArrayLike,
    X_val: ArrayLike,
    y_val: ArrayLike,
    Cs: Iterable[float] = DEFAULT_CS,
    *,
    backend: str = "auto",
    max_iter: int = 1000,
    tol: float = 1e-4,
    standardize: bool = True,
    head_init: ArrayLike | None = None,
    sweep_tol: float | None = None,
    block: int | str | None = "auto",
    metric: str = "top1",
    max_host_bytes: int | None = None,
    sweep: str = "exhaustive",
    halving_climb: int = 2,
    halving_patience: int | None = 4,
    halving_scan_tol: float | None = None,
) -> SweepResult:
    """Fit every C on train, score ``metric`` (a single-label task metric, default top-1)
    on val (never test), return the selection.

    torch: all C values are one batched multi-head problem (one GEMM for all heads per
    iteration, per-head L-BFGS state, converged heads drop out); ``block`` heads iterate
    at once, activated in increasing-C order and warm-started from the largest finished C
    (``auto``: 8 on CPU, where the GEMMs are compute-bound, all 45 on a GPU). sklearn/cuML:
    a loop over C with warm starts along the increasing-C path.

    ``sweep_tol`` (default ``tol``) is the stopping tolerance of the sweep heads. A looser
    one (e.g. ``10 * tol``) is faster but can flip near-tied validation scores: on lite0
    Fashion-MNIST features it moved the selection one grid point away from scikit-learn's.

    ``sweep="halving"`` (torch, top-1; :mod:`featcache.probes._halving`): a scan, then a
    climb. The C grid is walked upwards one C at a time, each from its neighbour's
    coefficients, to the loose tolerance ``halving_scan_tol`` (default ``10 * sweep_tol``),
    stopping once ``halving_patience`` C values have scored more than 0.1 point below the
    best validation top-1 (a flat stretch does not count; ``None``: the whole grid); the
    scan's best then continues to ``sweep_tol`` and the path is walked from it at
    ``sweep_tol`` while validation top-1 improves by more than 0.1 point
    (``halving_climb`` C values without improvement end the walk). The selection is the
    smallest refined C within 0.1 point of the best refined one. C values never fitted
    have ``val_top1`` nan and ``heads`` None; ``info["status"]`` says, per C, whether it
    was refined, only scanned or never fitted.
    ``max_host_bytes``: stream the training rows in blocks above this in-memory footprint
    (see :class:`LogisticProbe`).
    """
    Cs = sorted(float(c) for c in Cs)
    metric_score = _selection_scorer(metric)
    name, device = resolve_backend(backend)
    stol = tol if sweep_tol is None else float(sweep_tol)
    sched = (halving_climb, halving_patience, 10 * stol if halving_scan_tol is None else float(halving_scan_tol))
    _check_sweep_mode(sweep, metric, name, sched, stol)
    X, yi, classes = _lazy_Xy(X_train, y_train) if _is_lazy(X_train) else _check_Xy(X_train, y_train, cast=False)
    Xv, yv = _check_val(X_val, y_val, classes)
    K = classes.size
    block, streamed = _blocks(block, device, name, X.shape, K, len(Cs), max_host_bytes)
    scaler, Xs = _prepare(X, standardize, streamed, device)
    W0 = b0 = None
    if head_init is not None:
        c0, i0 = _softmax_init(np.asarray(head_init, np.float64), None, K)
        W0, b0 = scaler.from_raw(c0, i0)
    score = _val_scorer(Xv, yv, scaler, streamed)
    t0 = time.perf_counter()
    info: dict = {"sweep": sweep, "streamed": bool(streamed)}
    if sweep == "halving":
        out = _halving(Xs, yi, K, Cs, device, max_iter, stol, W0, b0, block, score, sched)
        heads, n_iters, convs, val, best = (out.heads, out.n_iter, out.converged, out.val, out.best_index)
        scores = val
        info.update(_halving_info(out, sched))
    else:
        heads, n_iters, convs = _sweep_all(name, Xs, yi, K, Cs, device, max_iter, stol, W0, b0, block)
        val = score(range(len(heads)), heads)
        scores = val if metric == "top1" else _metric_scores(Xv, yv, scaler, heads, metric_score)
        best = select_index(scores)
        info["head_iters"] = int(sum(n_iters))
    seconds = time.perf_counter() - t0
    raw = [None if h is None else scaler.to_raw(*h) for h in heads]
    return SweepResult(
        Cs=Cs,
        val_top1=val,
        best_index=best,
        n_iter=n_iters,
        converged=convs,
        backend=name,
        seconds=seconds,
        heads=raw,
        tol=stol,
        info=info,
        metric=metric,
        val_scores=list(scores),
    )


def _check_sweep_mode(sweep: str, metric: str, backend: str, sched: tuple, stol: float) -> None:
    """ProbeError for a sweep mode the task or backend cannot run (and, for halving, a
    schedule ``(climb, patience, scan_tol)`` it cannot run), before any fitting."""
    if sweep not in ("exhaustive", "halving"):
        raise ProbeError(f"sweep must be 'exhaustive' or 'halving', got {sweep!r}")
    if sweep == "halving" and metric != "top1":
        raise ProbeError(
            f"sweep='halving' selects on validation top-1, but the task metric is {metric!r}; use sweep='exhaustive'"
        )
    if sweep == "halving" and backend != "torch":
        raise ProbeError(
            f"sweep='halving' needs the torch backend (got {backend!r}); pass backend='torch' or sweep='exhaustive'"
        )
    if sweep == "halving":
        from featcache.probes._halving import check_schedule

        check_schedule(sched[0], sched[1], sched[2], stol)


def _blocks(block, device: str, backend: str, shape, K: int, n_C: int, max_host_bytes) -> tuple:
    """Heads iterated at once (``auto``: 8 on CPU, all on a GPU) and whether the rows stream
    (then, with ``auto``, the per-head L-BFGS state must fit the memory bound too)."""
    auto = block == "auto"
    if auto:
        block = 8 if device == "cpu" else None
    heads_at_once = n_C if block is None else min(int(block), n_C)
    streamed = backend == "torch" and use_streaming(shape[0], shape[1], K, heads_at_once, max_host_bytes)
    if streamed and auto:
        block = max(1, min(heads_at_once, state_heads(shape[1], K, max_host_bytes)))
    return block, streamed


def _check_val(X_val, y_val, classes):
    Xv = np.asarray(X_val)
    if Xv.dtype.kind != "f":
        Xv = Xv.astype(np.float32)
    if not all(np.isfinite(np.asarray(Xv[s : s + 65536])).all() for s in range(0, len(Xv), 65536)):
        raise ProbeError("validation features contain NaN or inf; drop invalid rows first")
    pos = {c: i for i, c in enumerate(classes.tolist())}
    try:
        yv = np.array([pos[v] for v in np.asarray(y_val).tolist()], np.int64)
    except KeyError as exc:
        raise ProbeError(
            f"validation label {exc.args[0]!r} does not occur in train; the class "
            "sets of the splits differ: resample the split so every class is in train"
        ) from None
    return Xv, yv


def _val_scorer(Xv, yv, scaler: Scaler, streamed: bool):
    """score(idx, heads) -> val top-1 per standardised-space head; blockwise when streamed."""
    if streamed:
        from featcache.probes._stream import scores_blockwise

        return lambda idx, heads: scores_blockwise(Xv, scaler.mean, scaler.scale, heads, yv)
    Xvs = scaler.transform(np.asarray(Xv, np.float32)).astype(np.float64)
    return lambda idx, heads: [float(np.mean((Xvs @ Wh + bh).argmax(axis=1) == yv)) for Wh, bh in heads]


def _sweep_all(name, Xs, yi, K, Cs, device, max_iter, stol, W0, b0, block):
    """Every C fitted to convergence: (standardised heads, n_iter, converged) per C."""
    heads, n_iters, convs = [], [], []
    if name == "torch":
        W, b, n_iter, conv, _ = _fit_torch(Xs, yi, K, Cs, device, max_iter, stol, W0, b0, block=block)
        for h in range(len(Cs)):
            heads.append((W[h], b[h]))
        return heads, [int(v) for v in n_iter], [bool(v) for v in conv]
    for C in Cs:
        if name == "sklearn":
            Wh, bh, it, cv, _ = _fit_sklearn(Xs, yi, K, C, max_iter, stol, W0, b0)
        else:
            Wh, bh, it, cv, _ = _fit_cuml(Xs, yi, K, C, max_iter, stol)
        W0, b0 = Wh, bh  # warm start along the path
        heads.append((Wh, bh))
        n_iters.append(it)
        convs.append(cv)
    return heads, n_iters, convs


def _halving(Xs, yi, K, Cs, device, max_iter, stol, W0, b0, block, score, sched):
    from featcache.probes._halving import halving_sweep

    def fit(idx, Ws, bs, tol):  # Ws None: the scan's first C, from the initial head
        Wst, bst = (W0, b0) if Ws is None else (Ws, bs)
        W, b, n_iter, conv, _ = _fit_torch(
            Xs, yi, K, [Cs[i] for i in idx], device, max_iter, tol, Wst, bst, block=block
        )
        return W, b, n_iter, conv

    climb, patience, scan_tol = sched
    return halving_sweep(fit, score, len(Cs), tol=stol, scan_tol=scan_tol, patience=patience, climb_patience=climb)


def _halving_info(out, sched) -> dict:
    """What a halving sweep records (hparams ``halving_*`` and the per-round log)."""
    climb, patience, scan_tol = sched
    return {
        "head_iters": out.head_iters,
        "rounds": len(out.rounds),
        "halving_climb": int(climb),
        "halving_patience": patience,
        "halving_scan_tol": scan_tol,
        "round_log": out.rounds,
        "status": out.status,
    }


def _metric_scores(Xv, yv, scaler: Scaler, heads, metric_score) -> list[float]:
    """Validation score of a non-top-1 task metric per standardised-space head (softmax
    probabilities scored one-vs-rest, as result rows are)."""
    Xvs = scaler.transform(np.asarray(Xv, np.float32)).astype(np.float64)
    return [float(metric_score(yv, softmax_proba(Xvs @ Wh + bh))) for Wh, bh in heads]


def _selection_scorer(metric: str):
    """``metric(y_idx, proba) -> float`` of a task metric (higher is better); on integer
    labels the ranking metrics score the softmax probabilities one-vs-rest, as result rows do."""
    from featcache.core.metrics import METRICS, TASK_METRICS

    if metric not in TASK_METRICS:
        raise ProbeError(f"unknown selection metric {metric!r}; choose one of {TASK_METRICS}")
    return METRICS[metric]
