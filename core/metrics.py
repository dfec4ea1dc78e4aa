"""Classification metrics as pure numpy functions (stage-neutral: probes, fine-tuning).

Every function takes integer true labels ``y_true`` in ``[0, K)`` (column indices of the
score matrix) and either predicted labels or a score/probability matrix ``[N, K]``.
Accuracies are fractions in [0, 1].

Tie rule (documented, tested): when scores tie, the lower class index ranks first. This is
what ``np.argmax`` does (and the probes' ``LogisticProbe.predict``), so ``top1(y, s) ==
accuracy(y, s.argmax(1))`` always, and ``top_k`` counts the true class as a hit when fewer
than ``k`` classes rank before it (strictly higher score, or equal score and lower index).

Ranking metrics for multi-label tasks (``map11``, ``roc_auc_macro``) take a target matrix
``[N, C]`` (bool/0-1, one column per class) or integer labels (one-hot encoded) and a score
matrix ``[N, C]``; they average per-class values over the classes they are defined for.

Probes and fine-tuning both import them from here (one implementation for both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from featcache.core.registry import Registry
from featcache.errors import ConfigError, MetricInputError

__all__ = [
    "METRICS",
    "MULTILABEL_DEFAULT",
    "MULTILABEL_METRICS",
    "TASK_METRICS",
    "MetricInfo",
    "compute_all",
    "ece",
    "finetune_metrics",
    "lower_is_better",
    "map11",
    "map11_elevater",
    "map_clip_benchmark",
    "mean_per_class",
    "metric_info",
    "metric_names",
    "nll",
    "proportion_metrics",
    "register_metric",
    "roc_auc_macro",
    "top1",
    "top5",
    "top_k",
]


def _check_labels(y_true: ArrayLike) -> np.ndarray:
    y = np.asarray(y_true)
    if y.ndim != 1:
        raise MetricInputError(f"y_true must be 1-D, got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise MetricInputError("y_true must hold integer class indices (encode labels first)")
    return y


def _check(y_true: ArrayLike, scores: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    y = _check_labels(y_true)
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != y.shape[0]:
        raise MetricInputError(f"scores must be [N, K] with N={y.shape[0]}, got {s.shape}")
    if y.size and (y.min() < 0 or y.max() >= s.shape[1]):
        raise MetricInputError(f"labels must lie in [0, {s.shape[1]}) to index the score columns")
    return y, s


def top_k(y_true: ArrayLike, scores: ArrayLike, k: int) -> float:
    """Fraction of samples whose true class ranks among the first ``k`` (ties: lower index first)."""
    y, s = _check(y_true, scores)
    if y.size == 0:
        return float("nan")
    true_score = s[np.arange(y.size), y][:, None]
    idx = np.arange(s.shape[1])[None, :]
    ahead = (s > true_score) | ((s == true_score) & (idx < y[:, None]))
    rank = ahead.sum(axis=1)
    return float(np.mean(rank < k))


def top1(y_true: ArrayLike, scores: ArrayLike) -> float:
    """Top-1 accuracy from a score matrix (argmax; ties go to the lower class index)."""
    y, s = _check(y_true, scores)
    if y.size == 0:
        return float("nan")
    return float(np.mean(s.argmax(axis=1) == y))


def top5(y_true: ArrayLike, scores: ArrayLike) -> float:
    return top_k(y_true, scores, 5)


def mean_per_class(y_true: ArrayLike, y_pred_or_scores: ArrayLike) -> float:
    """Mean over classes present in ``y_true`` of TP_c / (TP_c + FN_c) (Salman et al.; sklearn's
    ``balanced_accuracy_score``).

    Classes absent from ``y_true`` are skipped. Accepts predicted labels [N] or scores [N, K];
    from scores the prediction is the argmax over the columns of the classes present in
    ``y_true`` only (ties: the lower index), as ELEVATER's toolkit computes it:
    vision-evaluation 0.2.9's ``calculate_score`` drops the all-zero target columns, scores
    included, before ``BalancedAccuracyScoreEvaluator`` takes the argmax. Predicted labels
    cannot be restricted: a prediction of an absent class counts as a miss.
    """
    y = _check_labels(y_true)
    p = np.asarray(y_pred_or_scores)
    if p.ndim == 2:
        if p.shape[0] != y.shape[0]:
            raise MetricInputError(f"scores have {p.shape[0]} rows but y_true has {y.shape[0]}")
        present = np.unique(y)
        if y.size and (present.min() < 0 or present.max() >= p.shape[1]):
            raise MetricInputError(f"labels must lie in 0..{p.shape[1] - 1} (one score column per class)")
        p = present[p[:, present].argmax(axis=1)] if y.size else p.argmax(axis=1)
    if p.shape != y.shape:
        raise MetricInputError(f"predictions shape {p.shape} != y_true shape {y.shape}")
    if y.size == 0:
        return float("nan")
    classes, inv, counts = np.unique(y, return_inverse=True, return_counts=True)
    hits = np.bincount(inv, weights=(p == y).astype(np.float64), minlength=classes.size)
    return float(np.mean(hits / counts))


def nll(y_true: ArrayLike, proba: ArrayLike, eps: float | None = None) -> float:
    """Mean negative log-likelihood of the true class; probabilities clipped to [eps, 1]."""
    y, p = _check(y_true, proba)
    if y.size == 0:
        return float("nan")
    lo = float(np.finfo(np.float64).eps) if eps is None else eps
    pt = np.clip(p[np.arange(y.size), y], lo, 1.0)
    return float(-np.mean(np.log(pt)))


def ece(y_true: ArrayLike, proba: ArrayLike, n_bins: int = 15) -> float:
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


def _check_multilabel(y_true: ArrayLike, scores: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """(targets [N, C] bool, scores [N, C] float64); integer labels [N] are one-hot encoded."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 2:
        raise MetricInputError(f"scores must be [N, C], got shape {s.shape}")
    y = np.asarray(y_true)
    if y.ndim == 1:
        y, _ = _check(y, s)
        y = np.arange(s.shape[1])[None, :] == y[:, None]
    if y.shape != s.shape:
        raise MetricInputError(f"targets {y.shape} and scores {s.shape} must both be [N, C]")
    if y.dtype != bool:
        if not np.isin(y, (0, 1)).all():
            raise MetricInputError("multi-label targets must be 0/1 or bool (one column per class)")
        y = y.astype(bool)
    return y, s


def _ap11_terms(pos: np.ndarray, score: np.ndarray) -> np.ndarray:
    """The 11 terms ``max_{recall >= k/10} precision`` (k = 0..10) of one class; tied scores
    enter as one threshold; recall compared exactly in integers (10*tp >= k*n_pos)."""
    order = np.argsort(-score, kind="stable")
    sc, tp = score[order], pos[order].astype(np.float64)
    last = np.r_[np.flatnonzero(np.diff(sc) != 0), sc.size - 1]  # end of each tie group
    ctp = np.cumsum(tp)[last]
    prec = ctp / (last + 1)
    terms = np.zeros(11)
    for k in range(11):
        p = prec[10 * ctp >= k * pos.sum()]
        terms[k] = p.max() if p.size else 0.0
    return terms


def _ap11_column(pos: np.ndarray, score: np.ndarray) -> float:
    """VOC2007 11-point interpolated AP of one class (the mean of :func:`_ap11_terms`)."""
    return float(sum(_ap11_terms(pos, score).tolist()) / 11.0)


def map11(y_true: ArrayLike, scores: ArrayLike) -> float:
    """The VOC07 devkit's 11-point mAP (``voc_ap(use_07_metric=True)``): mean over classes
    with a positive of ``AP = 1/11 sum_{t in 0, .1, .., 1} max_{recall >= t} precision``
    (ELEVATER's own differs: :func:`map11_elevater`). Tied scores form one threshold (as ``sklearn.metrics.precision_recall_curve``),
    so the value does not depend on row order. Recall >= k/10 is compared exactly (the devkit's
    float grid ``np.arange(0, 1.1, .1)`` misses recall 3/10 by one ulp). NaN when no class
    has a positive."""
    y, s = _check_multilabel(y_true, scores)
    aps = [_ap11_column(y[:, c], s[:, c]) for c in range(y.shape[1]) if y[:, c].any()]
    return float(np.mean(aps)) if aps else float("nan")


def _ap11_elevater_column(pos: np.ndarray, score: np.ndarray) -> float:
    """ELEVATER's 11-point AP of one class: the devkit's terms but a recall-0 term of 1
    (sklearn's ``precision_recall_curve`` ends with precision 1 at recall 0)."""
    terms = _ap11_terms(pos, score)
    terms[0] = 1.0
    return float(sum(terms.tolist()) / 11.0)


def map11_elevater(y_true: ArrayLike, scores: ArrayLike) -> float:
    """ELEVATER's 11-point mAP (vision-evaluation's ``MeanAveragePrecisionNPointsEvaluator(11)``,
    which ELEVATER's ``map_11_points`` calls): per class ``1/11 sum_t max_{recall >= t}
    precision`` over sklearn's precision-recall curve, whose appended point (recall 0,
    precision 1) makes the t=0 term 1, so per class it is :func:`map11`'s AP plus ``(1 - max precision)/11``.
    The mean runs over the columns with a positive: ``calculate_score`` of the vision-evaluation
    version the toolkit pins (0.2.9) drops all-zero target columns before it calls the metric,
    and scores 0 when none is left. NaN for an empty input (no row or no column)."""
    y, s = _check_multilabel(y_true, scores)
    if y.size == 0:
        return float("nan")
    keep = np.flatnonzero(y.any(axis=0))
    if keep.size == 0:
        return 0.0
    return float(np.mean([_ap11_elevater_column(y[:, c], s[:, c]) for c in keep]))


def map_clip_benchmark(y_true: ArrayLike, scores: ArrayLike) -> float:
    """CLIP_benchmark's multi-label ``mean_average_precision`` (``metrics/
    zeroshot_classification.py``, ``average_precision_per_class``, after torchnet's APMeter):
    per class, rows sorted by decreasing score, the mean of the precision at each positive
    (``sum(precision[positives]) / max(#positives, 1)``, so a class without a positive scores
    0), then the mean over **every** class. Exactly tied scores keep row order (a stable sort;
    the toolkit's ``torch.sort`` leaves their order unspecified). Without ties each class's
    term is ``sklearn.metrics.average_precision_score``."""
    y, s = _check_multilabel(y_true, scores)
    if y.shape[1] == 0:
        return float("nan")
    rg = np.arange(1, y.shape[0] + 1, dtype=np.float64)
    aps = []
    for c in range(y.shape[1]):
        truth = y[np.argsort(-s[:, c], kind="stable"), c]
        precision = np.cumsum(truth) / rg
        aps.append(float(precision[truth].sum()) / max(float(truth.sum()), 1.0))
    return float(np.mean(aps))


#: the task metric a multi-label task takes when none is given or recorded: CLIP_benchmark's
#: mAP (a CLIP_benchmark multi-label export, e.g. voc2007_multilabel, declares no metric)
MULTILABEL_DEFAULT = "map_clip_benchmark"


def _average_ranks(a: np.ndarray) -> np.ndarray:
    """1-based ranks of ``a``, ties sharing their average rank."""
    order = np.argsort(a, kind="stable")
    sa = a[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sa) != 0) + 1]
    ends = np.r_[starts[1:], sa.size]
    avg = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(a.size)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def roc_auc_macro(y_true: ArrayLike, scores: ArrayLike) -> float:
    """Unweighted mean over classes of one-vs-rest ROC-AUC (Mann-Whitney U with average
    ranks for ties, = ``sklearn.metrics.roc_auc_score(average="macro")``). Classes without
    both positives and negatives in ``y_true`` are skipped (their AUC is undefined); NaN
    when none is left. For integer labels of a binary task it equals the binary AUC."""
    y, s = _check_multilabel(y_true, scores)
    aucs = []
    for c in range(y.shape[1]):
        n_pos = int(y[:, c].sum())
        n_neg = y.shape[0] - n_pos
        if n_pos == 0 or n_neg == 0:
            continue
        r = _average_ranks(s[:, c])
        aucs.append((r[y[:, c]].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
    return float(np.mean(aucs)) if aucs else float("nan")


@dataclass(frozen=True)
class MetricInfo:
    """What a metric's registration records beside its function: ``task``: a task may declare
    it and the probes select on it; ``multilabel``: defined for multi-label targets;
    ``higher_is_better``: its direction (a lower-is-better metric is never converted from
    percent and is negated when ranked); ``proportion``: a binomial proportion of the rows
    scored (Clopper-Pearson intervals apply when their number is known); ``finetune``:
    fine-tuning selects on it too (computed from the val rows' class probabilities,
    single-label targets)."""

    task: bool = False
    multilabel: bool = False
    higher_is_better: bool = True
    proportion: bool = False
    finetune: bool = False


#: metric name -> function(y_true, proba) used for result rows; each entry's ``info`` is its
#: :class:`MetricInfo`; aliases are names other tools write for the same metric (read by the analysis)
METRICS: Registry[Callable[..., float]] = Registry("metric", ConfigError, idempotent=False)
#: the metrics a task can declare (hyper-parameters are selected on it; higher is better)
TASK_METRICS: tuple[str, ...] = ()
#: the metrics defined for multi-label targets [N, C]
MULTILABEL_METRICS: tuple[str, ...] = ()


def register_metric(
    name: str,
    fn: Callable[..., float],
    *,
    task: bool = False,
    multilabel: bool = False,
    higher_is_better: bool = True,
    proportion: bool = False,
    finetune: bool = False,
    aliases: tuple[str, ...] = (),
) -> None:
    """Register ``fn(y_true, scores) -> float`` as metric ``name`` (:data:`METRICS`); ``task``:
    a task may declare it, and the probes select hyper-parameters on it (higher is better;
    ``featcache probe --metric`` offers it); ``multilabel``: it is defined for multi-label
    targets; ``higher_is_better``, ``proportion``, ``finetune``: see :class:`MetricInfo`;
    ``aliases``: other names results tables use for it. A taken name is refused."""
    global TASK_METRICS, MULTILABEL_METRICS
    if task and not higher_is_better:
        raise ConfigError(f"metric {name!r}: a task metric is selected on, so higher must be better")
    if finetune and not task:
        raise ConfigError(f"metric {name!r}: fine-tuning selects on task metrics only; register it with task=True")
    info = MetricInfo(task, multilabel, higher_is_better, proportion, finetune)
    METRICS.register(name, fn, aliases=aliases, info=info)
    if task:
        TASK_METRICS = (*TASK_METRICS, name)
    if multilabel:
        MULTILABEL_METRICS = (*MULTILABEL_METRICS, name)


def metric_info(name: str) -> MetricInfo | None:
    """The registration record of metric ``name`` (or an alias); ``None`` for a name not registered."""
    entry = METRICS.get_entry(name)
    return None if entry is None else entry.info


def _infos() -> dict[str, MetricInfo]:
    return {n: METRICS.entry(n).info or MetricInfo() for n in METRICS.names(aliases=True)}


def lower_is_better() -> frozenset[str]:
    """Every registered metric name (aliases included) whose lower values are better, and the
    dense ones (:data:`featcache.core.dense_metrics.DENSE_LOWER_IS_BETTER`: RMSE, AbsRel, ...),
    which result rows carry though :data:`METRICS` does not register them."""
    from featcache.core.dense_metrics import DENSE_LOWER_IS_BETTER

    return frozenset(n for n, info in _infos().items() if not info.higher_is_better) | DENSE_LOWER_IS_BETTER


def finetune_metrics() -> tuple[str, ...]:
    """The task metrics fine-tuning selects on (registered with ``finetune=True``), in
    registration order."""
    return tuple(n for n in METRICS if (METRICS.entry(n).info or MetricInfo()).finetune)


def proportion_metrics() -> frozenset[str]:
    """Every registered metric name (aliases included) that is a binomial proportion."""
    return frozenset(n for n, info in _infos().items() if info.proportion)


# in the order a results row set lists them (metric_names); task and multi-label metrics in the
# order the --metric choices and multi-label rows list them
register_metric("top1", top1, task=True, proportion=True, finetune=True, aliases=("accuracy", "acc"))
register_metric("top5", top5, proportion=True)
register_metric("mean_per_class", mean_per_class, task=True, finetune=True)
register_metric("nll", nll, higher_is_better=False, aliases=("ce", "loss", "cross_entropy"))
register_metric("ece", ece, higher_is_better=False)
register_metric("map11", map11, task=True, multilabel=True)
register_metric("roc_auc_macro", roc_auc_macro, task=True, multilabel=True)
register_metric("map11_elevater", map11_elevater, task=True, multilabel=True)
register_metric("map_clip_benchmark", map_clip_benchmark, task=True, multilabel=True)


def metric_names(n_classes: int, task_metric: str = "top1", multilabel: bool = False) -> list[str]:
    """The metrics a result row set holds: multi-label tasks the ranking metrics; single-label
    tasks top1, top5 (K > 5), mean_per_class, nll, ece, plus the task's metric if not among them."""
    if multilabel:
        return list(MULTILABEL_METRICS)
    names = [n for n in METRICS if n not in MULTILABEL_METRICS and (n != "top5" or n_classes > 5)]
    return names + ([task_metric] if task_metric not in names else [])


def compute_all(y_true: ArrayLike, proba: ArrayLike, names: Iterable[str] | None = None) -> dict[str, float]:
    """All metrics in ``names`` (default: :func:`metric_names` of a single-label task)."""
    proba = np.asarray(proba)
    if names is None:
        names = metric_names(proba.shape[1])
    return {n: METRICS[n](y_true, proba) for n in names}
