"""ELEVATER's linear-probe search on cached features (``elevater-fewshot:N``, ``elevater-full``).

For each of the grid's learning rates a coarse-to-fine weight-decay search
(:func:`search_weight_decay`), each trial an :class:`~featcache.probes.sgd.SGDProbe` trained
for ``search_epochs`` on the plan's train rows and scored by top-1 on its val rows; the
best (lr, wd) is retrained for ``final_epochs`` on train+val. The head sees L2-normalised
features times CLIP's logit scale 1/0.07 (the toolkit's ``NORMALIZE_VISUAL_FEATURE`` with
``LOGIT_SCALE_INIT='clip'``; ``ElevaterGrid.features="bn"`` gives its default channel
BatchNorm instead) and is zero-initialised or, with ``head_init``, starts from the
L2-normalised class text embeddings with a zero bias (ELEVATER's language-initialised head):
its argmax at step 0 is then exactly the zero-shot classifier's (:func:`zeroshot_logits`:
normalised features . normalised text).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from featcache.errors import ProbeError
from featcache.probes.solver_registry import FitOutcome, FitRequest, register_solver

__all__ = ["fit_elevater", "fit_elevater_multilabel", "l2_normalise", "search_weight_decay", "zeroshot_logits"]


def l2_normalise(X: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (all-zero rows stay zero)."""
    X = np.asarray(X, np.float64)
    n = np.linalg.norm(X, axis=1, keepdims=True)
    return X / np.where(n > 0, n, 1.0)


def zeroshot_logits(X: np.ndarray, text: np.ndarray) -> np.ndarray:
    """CLIP-style zero-shot logits: normalised features [n, D] . normalised text [K, D]^T."""
    return l2_normalise(X) @ l2_normalise(text).T


def search_weight_decay(
    score: Callable[[int], float], n_wds: int, coarse: Sequence[int], spans: Sequence[int]
) -> tuple[int, float, int]:
    """ELEVATER's coarse-to-fine search over weight-decay indices ``0..n_wds-1``: score the
    ``coarse`` indices, then for each span the neighbours ``peak -/+ span`` (clipped) of the
    best so far; a later candidate wins only when strictly better. Returns (best index, its
    score, number of distinct trials). Scores are cached (a clipped neighbour is not rerun)."""
    seen: dict[int, float] = {}

    def s(i: int) -> float:
        if i not in seen:
            seen[i] = score(i)
        return seen[i]

    peak, best = -1, -math.inf
    for i in coarse:
        if s(i) > best:
            peak, best = i, s(i)
    for span in spans:
        cands = [j for j in (max(peak - span, 0), min(peak + span, n_wds - 1)) if j != peak]
        for j in cands:
            if s(j) > best:
                peak, best = j, s(j)
    return peak, best, len(seen)


def _search(
    grid, val_score: Callable[[float, float], float], metric: str, epochs_of: dict
) -> tuple[tuple[float, float, float], list[dict[str, Any]], int]:
    """ELEVATER's (lr, wd) search: per lr of the grid the coarse-to-fine weight-decay search of
    ``val_score(lr, wd)``; returns ((score, lr, wd) of the best, per-lr records, trials)."""
    best: tuple[float, float, float] | None = None
    trials, per_lr = 0, []
    for lr in grid.lrs:
        i, sc, n = search_weight_decay(
            lambda k, lr=lr: val_score(lr, grid.wds[k]), len(grid.wds), grid.coarse, grid.spans
        )
        trials += n
        per_lr.append(
            {
                "lr": lr,
                "weight_decay": grid.wds[i],
                f"val_{metric}": sc,
                "best_epoch": epochs_of[(lr, grid.wds[i])],
                "trials": n,
            }
        )
        if sc > (-math.inf if best is None else best[0]):
            best = (sc, lr, grid.wds[i])
    if best is None:
        raise ProbeError(f"no (lr, weight decay) of the grid scored on validation (an empty grid, or NaN {metric})")
    return best, per_lr, trials


def _best_epoch(scores: list[float]) -> tuple[float, int]:
    """(best value, its 1-based epoch): the first strict maximum from 0 (0, 0 when none)."""
    best, at = 0.0, 0
    for e, v in enumerate(scores, 1):
        if v > best:
            best, at = v, e
    return best, at


def _hparams(req: FitRequest, device: str, best, per_lr, trials: int, best_epoch: int, head: str) -> dict:
    """The results-row record of one ELEVATER fit (single- or multi-label)."""
    grid, opts = req.proto.grid, req.opts
    sc, lr, wd = best
    metric = opts.get("metric") or "top1"
    se, fe = opts["search_epochs"], opts["final_epochs"]
    hp = {
        "solver": "elevater-sgd",
        "device": device,
        "lr": lr,
        "weight_decay": wd,
        f"val_{metric}": sc,
        "best_epoch": best_epoch,
        "selection": f"val {metric} at each trial's best search epoch (ties: earlier epoch, smaller lr, earlier probe)",
        "trials": trials,
        "per_lr": per_lr,
        "search_epochs": se,
        "final_epochs": fe,
        "batch_size": grid.batch_size,
        "momentum": grid.momentum,
        "nesterov": grid.nesterov,
        "features": grid.features,
        "logit_scale": grid.logit_scale,
        "head": head,
        "report": "best test epoch (selected on the test split, as the ELEVATER toolkit)"
        if opts.get("final_epoch") == "best-test"
        else "final epoch (not the best test epoch)",
    }
    scaled = {
        k: v
        for k, v, pub in (("search_epochs", se, grid.search_epochs), ("final_epochs", fe, grid.final_epochs))
        if v != pub
    }
    if scaled:
        hp["scaled"] = True
        hp["scaled_from"] = {k: getattr(grid, k) for k in scaled}
    return hp


def fit_elevater_multilabel(req: FitRequest) -> FitOutcome:
    """Multi-label targets (``plan.Y``, [n, C] 0/1) as the toolkit fits VOC 2007: the same
    (lr, wd) search and final run as :func:`fit_elevater`, but the head trained with
    BCE-with-logits and every epoch scored by the task metric (a ranking metric, e.g.
    ``map11_elevater``) of the softmax of its outputs. Source: Computer-Vision-in-the-Wild/
    Elevater_Toolkit_IC, vision_benchmark/evaluation/full_model_finetune.py: ``train_task``
    sets ``criterion = torch.nn.BCEWithLogitsLoss()`` for MULTILABEL_DATASETS
    (voc-2007-classification, chestx-ray8) and ``validate`` scores
    ``outputs.softmax(-1)`` (softmax, not sigmoid) with ``config.TEST.METRIC``; the predicted
    scores here are the same softmax."""
    from featcache.probes.logistic import cpu_threads, resolve_backend
    from featcache.probes.sgd import train_sgd_head

    grid, plan, opts, seed = req.proto.grid, req.plan, req.opts, req.seed
    device = resolve_backend("torch")[1]
    (Xtr, _), (Xva, _), (Xfin, _) = ((np.asarray(X, np.float64), y) for X, y in (plan.tr, plan.va, plan.fin))
    Ytr, Yva, Yfin = (np.asarray(Y, bool) for Y in plan.Y)
    metric = opts.get("metric") or "map11_elevater"
    # head_init: one normalised text embedding per label column, bias 0 (as for single-label)
    init = None if req.head_init is None else (l2_normalise(np.asarray(req.head_init)).T, np.zeros(Ytr.shape[1]))

    def train(X, Y, lr, wd, epochs, on_epoch=None):
        """(W [D, C], b [C], finite) of ``epochs`` BCE-SGD passes over (X, Y)."""
        with cpu_threads(device):
            return train_sgd_head(
                X,
                Y,
                Y.shape[1],
                lr=lr,
                steps=epochs * math.ceil(len(X) / grid.batch_size),
                batch_size=grid.batch_size,
                momentum=grid.momentum,
                weight_decay=wd,
                seed=seed,
                device=device,
                nesterov=grid.nesterov,
                on_epoch=on_epoch,
                loss="bce",
                init=init,
            )

    tr_bn = _ChannelBN(Xtr, grid.features, grid.logit_scale)
    Xtr_s, Xva_s = tr_bn(Xtr), tr_bn(Xva)
    epochs_of: dict[tuple[float, float], int] = {}

    def val_score(lr, wd) -> float:
        """The trial's best epoch on the task metric of the val softmax scores."""
        scores: list[float] = []
        *_, ok = train(
            Xtr_s,
            Ytr,
            lr,
            wd,
            opts["search_epochs"],
            lambda W, b: scores.append(_epoch_score(metric, Yva, Xva_s, W.T, b)),
        )
        best, at = _best_epoch(scores)
        epochs_of[(lr, wd)] = at
        return best if ok or at else -1.0

    t0 = time.perf_counter()
    best, per_lr, trials = _search(grid, val_score, metric, epochs_of)
    _, lr, wd = best
    heads: list[tuple[np.ndarray, np.ndarray]] = []
    best_test = opts.get("final_epoch") == "best-test"
    bn = _ChannelBN(Xfin, grid.features, grid.logit_scale)
    W, b, ok = train(
        bn(Xfin), Yfin, lr, wd, opts["final_epochs"], (lambda W, b: heads.append((W.T, b))) if best_test else None
    )
    hp = _hparams(
        req, device, best, per_lr, trials, epochs_of[(lr, wd)], "zeros" if init is None else "text-initialised"
    )
    hp.update(loss="bce", n_labels=int(Yfin.shape[1]), scores="softmax over the label columns (the toolkit's validate)")
    epochs = tuple(_softmax_head(bn, co, bi) for co, bi in heads)
    return FitOutcome(_softmax_head(bn, W.T, b), None, hp, ok, time.perf_counter() - t0, epochs)


@register_solver(
    "elevater",
    options=("search_epochs", "final_epochs", "final_epoch"),
    fit_multilabel=fit_elevater_multilabel,
    multilabel_head_init=True,
)
def fit_elevater(req: FitRequest) -> FitOutcome:
    """Search (lr, wd) on ``plan.tr``/``plan.va``, refit on ``plan.fin``; ``head_init``: [C, D]
    class embeddings of the dataset's classes or ``None`` (zero head)."""
    from featcache.probes.logistic import resolve_backend
    from featcache.probes.sgd import SGDProbe

    grid, plan, opts, head_init, seed = req.proto.grid, req.plan, req.opts, req.head_init, req.seed
    device = resolve_backend("torch")[1]
    Xtr, ytr = plan.tr
    Xva, yva = plan.va
    classes = np.unique(ytr)
    if np.setdiff1d(np.concatenate([yva, plan.fin[1]]), classes).size:
        raise ProbeError(
            "validation/final training data hold classes absent from the selection "
            "train data; resample the split so every class is in train"
        )
    hi = None if head_init is None else l2_normalise(np.asarray(head_init)[classes])
    se, fe = opts["search_epochs"], opts["final_epochs"]

    def head(lr, wd, n: int, epochs: int, on_epoch=None) -> SGDProbe:
        """The SGD head of one trial or the final run: ``epochs`` passes over ``n`` rows."""
        return SGDProbe(
            lr=lr,
            steps=epochs * math.ceil(n / grid.batch_size),
            batch_size=grid.batch_size,
            momentum=grid.momentum,
            nesterov=grid.nesterov,
            weight_decay=wd,
            standardize=False,
            head_init=hi,
            random_state=seed,
            device=device,
            epoch_callback=on_epoch,
        )

    def fit(X, y, lr, wd, epochs, on_epoch=None):
        """(probe, channel standardiser) trained on (X, y)."""
        bn = _ChannelBN(X, grid.features, grid.logit_scale)
        return head(lr, wd, y.size, epochs, on_epoch).fit(bn(X), y, classes=classes), bn

    tr_bn = _ChannelBN(Xtr, grid.features, grid.logit_scale)
    Xtr_s, Xva_s = tr_bn(Xtr), tr_bn(Xva)

    metric = opts.get("metric") or "top1"
    yva_i = np.searchsorted(classes, yva)
    epochs_of: dict[tuple[float, float], int] = {}

    def val_score(lr, wd) -> float:
        """The trial's best epoch on the task metric (the toolkit's SEARCH_RESULT_ON_LAST_EPOCH
        =False: it validates after every epoch and keeps the first strict maximum, from 0)."""
        scores: list[float] = []
        p = head(lr, wd, ytr.size, se, lambda W, b: scores.append(_epoch_score(metric, yva_i, Xva_s, W, b)))
        p.fit(Xtr_s, ytr, classes=classes)
        best, at = _best_epoch(scores)
        epochs_of[(lr, wd)] = at
        return best if p.finite_ or at else -1.0

    t0 = time.perf_counter()
    best, per_lr, trials = _search(grid, val_score, metric, epochs_of)
    _, lr, wd = best
    best_test = opts.get("final_epoch") == "best-test"
    heads: list[tuple[np.ndarray, np.ndarray]] = []
    Xfin, yfin = plan.fin
    probe, bn = fit(Xfin, yfin, lr, wd, fe, (lambda W, b: heads.append((W, b))) if best_test else None)
    hp = _hparams(
        req, device, best, per_lr, trials, epochs_of[(lr, wd)], "text-initialised" if hi is not None else "zeros"
    )
    seconds = time.perf_counter() - t0
    epochs = tuple(_softmax_head(bn, W, b) for W, b in heads)
    return FitOutcome(lambda X: probe.predict_proba(bn(X)), classes, hp, probe.finite_, seconds, epochs)


def _softmax_head(bn, coef: np.ndarray, intercept: np.ndarray):
    """``predict(X)``: softmax probabilities of one epoch's head (raw-space coef [K, D])."""

    def predict(X: np.ndarray) -> np.ndarray:
        z = bn(X) @ coef.T + intercept
        z = np.exp(z - z.max(1, keepdims=True))
        return z / z.sum(1, keepdims=True)

    return predict


def _epoch_score(metric: str, y: np.ndarray, X: np.ndarray, coef: np.ndarray, intercept: np.ndarray) -> float:
    """The task metric of one epoch's head on (X, y) from its softmax probabilities, as the
    toolkit's ``validate`` scores ``outputs.softmax(-1)``; -1 when the head is not finite."""
    from featcache.metrics import METRICS

    z = X @ coef.T + intercept
    if not np.isfinite(z).all():
        return -1.0
    z = np.exp(z - z.max(1, keepdims=True))
    return float(METRICS[metric](y, z / z.sum(1, keepdims=True)))


class _ChannelBN:
    """The head's input transform. ``mode="bn"``: per-channel standardisation with the
    statistics of the rows it was built on (the toolkit's ``BatchNorm1d(affine=False)``);
    ``mode="l2"``: L2-normalised features times ``scale`` (the toolkit's
    ``NORMALIZE_VISUAL_FEATURE`` with logit scale ``scale``)."""

    def __init__(self, X: np.ndarray, mode: str = "l2", scale: float = 1.0):
        X = np.asarray(X, np.float64)
        self.mode, self.scale = mode, scale
        self.mu = X.mean(0)
        self.sd = np.sqrt(X.var(0) + 1e-5)  # BatchNorm's eps

    def __call__(self, X: np.ndarray) -> np.ndarray:
        if self.mode == "l2":
            return self.scale * l2_normalise(X)
        return (np.asarray(X, np.float64) - self.mu) / self.sd
