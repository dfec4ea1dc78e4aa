"""Classification metrics as pure numpy functions (stage-neutral: probes, fine-tuning).

Every function takes integer true labels ``y_true`` in ``[0, K)`` (column indices of the
score matrix) and either predicted labels or a score/probability matrix ``[N, K]``.
Accuracies are fractions in [0, 1].

Tie rule (documented, tested): when scores tie, the lower class index ranks first. This is
what ``np.argmax`` does (and the probes' ``LogisticProbe.predict``), so ``top1(y, s) ==
accuracy(y, s.argmax(1))`` always, and ``top_k`` counts the true class as a hit when fewer
than ``k`` classes rank before it (strictly higher score, or equal score and lower index).

Probes and fine-tuning both import them from here (one implementation for both).
"""

from __future__ import annotations

import numpy as np

__all__ = ["top1", "top_k", "top5", "mean_per_class", "nll", "ece", "METRICS", "compute_all"]


def _check(y_true, scores=None) -> tuple[np.ndarray, np.ndarray | None]:
    y = np.asarray(y_true)
    if y.ndim != 1:
        raise ValueError(f"y_true must be 1-D, got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError("y_true must hold integer class indices (encode labels first)")
    if scores is None:
        return y, None
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != y.shape[0]:
        raise ValueError(f"scores must be [N, K] with N={y.shape[0]}, got {s.shape}")
    if y.size and (y.min() < 0 or y.max() >= s.shape[1]):
        raise ValueError(f"labels must lie in [0, {s.shape[1]}) to index the score columns")
    return y, s


def top_k(y_true, scores, k: int) -> float:
    """Fraction of samples whose true class ranks among the first ``k`` (ties: lower index first)."""
    y, s = _check(y_true, scores)
    if y.size == 0:
        return float("nan")
    true_score = s[np.arange(y.size), y][:, None]
    idx = np.arange(s.shape[1])[None, :]
    ahead = (s > true_score) | ((s == true_score) & (idx < y[:, None]))
    rank = ahead.sum(axis=1)
    return float(np.mean(rank < k))


def top1(y_true, scores) -> float:
    """Top-1 accuracy from a score matrix (argmax; ties go to the lower class index)."""
    y, s = _check(y_true, scores)
    if y.size == 0:
        return float("nan")
    return float(np.mean(s.argmax(axis=1) == y))


def top5(y_true, scores) -> float:
    return top_k(y_true, scores, 5)


def mean_per_class(y_true, y_pred_or_scores) -> float:
    """Mean over classes present in ``y_true`` of TP_c / (TP_c + FN_c) (Salman et al.).

    Classes absent from ``y_true`` are skipped. Accepts predicted labels [N] or scores [N, K].
    """
    y, _ = _check(y_true)
    p = np.asarray(y_pred_or_scores)
    if p.ndim == 2:
        p = p.argmax(axis=1)
    if p.shape != y.shape:
        raise ValueError(f"predictions shape {p.shape} != y_true shape {y.shape}")
    if y.size == 0:
        return float("nan")
    classes, inv, counts = np.unique(y, return_inverse=True, return_counts=True)
    hits = np.bincount(inv, weights=(p == y).astype(np.float64), minlength=classes.size)
    return float(np.mean(hits / counts))


def nll(y_true, proba, eps: float | None = None) -> float:
    """Mean negative log-likelihood of the true class; probabilities clipped to [eps, 1]."""
    y, p = _check(y_true, proba)
    if y.size == 0:
        return float("nan")
    eps = np.finfo(np.float64).eps if eps is None else eps
    pt = np.clip(p[np.arange(y.size), y], eps, 1.0)
    return float(-np.mean(np.log(pt)))


def ece(y_true, proba, n_bins: int = 15) -> float:
    """Expected calibration error with ``n_bins`` equal-width confidence bins.

    confidence = max probability, prediction = argmax (ties: lower index); bin b holds
    confidences in (b/n_bins, (b+1)/n_bins] (the first bin also holds 0).
    ECE = sum_b |B_b|/N * |acc(B_b) - conf(B_b)|.
    """
    y, p = _check(y_true, proba)
    if y.size == 0:
        return float("nan")
    conf = p.max(axis=1)
    correct = (p.argmax(axis=1) == y).astype(np.float64)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    b = np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, n_bins - 1)
    acc_sum = np.bincount(b, weights=correct, minlength=n_bins)
    conf_sum = np.bincount(b, weights=conf, minlength=n_bins)
    return float(np.sum(np.abs(acc_sum - conf_sum)) / y.size)


#: metric name -> function(y_true, proba) used for result rows
METRICS = {
    "top1": top1,
    "top5": top5,
    "mean_per_class": mean_per_class,
    "nll": nll,
    "ece": ece,
}


def compute_all(y_true, proba, names=None) -> dict[str, float]:
    """All metrics in ``names`` (default: every metric; ``top5`` only when K > 5)."""
    proba = np.asarray(proba)
    if names is None:
        names = [n for n in METRICS if n != "top5" or proba.shape[1] > 5]
    return {n: METRICS[n](y_true, proba) for n in names}
