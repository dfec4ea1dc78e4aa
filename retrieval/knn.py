"""Weighted k-nearest-neighbour classification on frozen features (DINO's protocol).

For a query with neighbours j = 1..k (cosine similarity s_j, label y_j), class c gets the
vote sum_{j <= k, y_j = c} exp(s_j / T), T = 0.07; the prediction is the class with the
largest vote. Equal votes go to the lower class index. Missing neighbours (index -1, a
gallery smaller than k) vote nothing. Neighbours are the first k entries of the search list
(similarity desc, then gallery index asc; the query itself, matched by id, excluded).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from featcache.errors import MetricInputError

__all__ = ["KNN_KS", "KNN_TEMPERATURE", "knn_accuracy", "knn_predict", "knn_votes"]

KNN_KS = (10, 20, 100, 200)
KNN_TEMPERATURE = 0.07


def knn_votes(
    scores: np.ndarray,
    indices: np.ndarray,
    gallery_labels: np.ndarray,
    n_classes: int,
    k: int,
    temperature: float = KNN_TEMPERATURE,
) -> np.ndarray:
    """Votes [Q, C] from the first k neighbours (columns of ``scores``/``indices``)."""
    if k > scores.shape[1]:
        raise MetricInputError(f"k={k} exceeds the {scores.shape[1]} neighbours searched")
    s = scores[:, :k].astype(np.float64)
    idx = indices[:, :k]
    ok = idx >= 0
    w = np.where(ok, np.exp(np.where(ok, s, 0.0) / temperature), 0.0)
    lab = np.where(ok, np.asarray(gallery_labels)[np.where(ok, idx, 0)], 0)
    votes = np.zeros((scores.shape[0], n_classes))
    rows = np.broadcast_to(np.arange(scores.shape[0])[:, None], lab.shape)
    np.add.at(votes, (rows, lab), w)
    return votes


def knn_predict(votes: np.ndarray, top: int = 5) -> np.ndarray:
    """Class indices [Q, top] by decreasing vote; ties to the lower class index."""
    order = np.argsort(-votes, axis=1, kind="stable")
    return order[:, :top]


def knn_accuracy(
    scores: np.ndarray,
    indices: np.ndarray,
    gallery_labels: np.ndarray,
    query_labels: ArrayLike,
    n_classes: int,
    ks: Sequence[int] = KNN_KS,
    temperature: float = KNN_TEMPERATURE,
) -> dict[int, dict[str, float]]:
    """``{k: {"top1": acc, "top5": acc}}`` (top5 only when there are more than 5 classes)."""
    y = np.asarray(query_labels)
    out: dict[int, dict[str, float]] = {}
    for k in ks:
        pred = knn_predict(knn_votes(scores, indices, gallery_labels, n_classes, k, temperature))
        res = {"top1": float(np.mean(pred[:, 0] == y))}
        if n_classes > 5:
            res["top5"] = float(np.mean((pred[:, :5] == y[:, None]).any(1)))
        out[int(k)] = res
    return out
