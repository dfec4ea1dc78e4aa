"""Input validation and prediction shared by the probe estimators (scikit-learn contract).

Both :class:`~featcache.probes.logistic.LogisticProbe` and :class:`~featcache.probes.sgd.SGDProbe`
validate through scikit-learn (``validate_data``, ``check_classification_targets``,
``check_is_fitted``) and raise featcache's :class:`~featcache.errors.ProbeError` with a message
that says what to do where the cause is in the caller's data.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.exceptions import NotFittedError
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

from featcache.errors import ProbeError


class ProbeNotFittedError(ProbeError, NotFittedError):
    """A probe was used before ``fit``; both featcache's ProbeError and sklearn's NotFittedError."""


def check_labels(y: Any, n: int | None, *, column: bool = False) -> np.ndarray:
    """``y`` as an array of ``n`` labels, one per feature row (``column``: a ``[n, 1]`` column
    passes too, as scikit-learn takes it); else a ProbeError saying the shape wanted."""
    y = np.asarray(y)
    if n is not None and (y.shape[0] != n if y.ndim else not column):
        raise ProbeError(f"labels must be 1-D with {n} entries (one per feature row), got shape {y.shape}")
    if y.ndim > 1 and not (column and y.ndim == 2 and y.shape[1] == 1):
        raise ProbeError(
            f"labels must be 1-D with {n} entries, got shape {y.shape}; multi-output targets are not supported"
        )
    return y


def label_indices(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(class index per row as int64, the sorted classes) of training labels with two classes or more."""
    classes, y_idx = np.unique(y, return_inverse=True)
    if classes.size < 2:
        raise ProbeError(
            f"the training labels hold a single class ({classes[0]!r}); one class is not enough, "
            "a classifier needs at least two: check the split/label column or sample more data"
        )
    return y_idx.astype(np.int64), classes


def validate_fit_data(est, X, y, cast: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate ``X [n, D]`` and labels ``y``; returns (X float32, class index per row, classes).

    ``cast=False`` keeps a floating ``X`` in its dtype (float16 for a streamed fit) and checks
    finiteness block by block instead of with one [n, D] mask.

    Sets ``n_features_in_`` (and ``feature_names_in_`` for a DataFrame) through
    scikit-learn's ``validate_data``.
    """
    if y is not None and not hasattr(X, "toarray"):  # length mismatch: featcache's message
        check_labels(y, len(X) if hasattr(X, "__len__") else None, column=True)
    # scikit-learn's validate_data is unannotated (its y defaults to the string "no_validation")
    y_in: Any = y
    validated: Any = validate_data(est, X, y_in, ensure_all_finite=False)
    X, y = validated
    if not cast:
        from featcache.probes._stream import check_finite_rows

        check_finite_rows(X)
    elif not np.isfinite(X).all():
        bad = int((~np.isfinite(X)).any(axis=1).sum())
        raise ProbeError(
            f"{bad} feature rows contain NaN or inf; drop them (rows with valid=False) or "
            "re-extract the features (`featcache verify` finds broken chunks)"
        )
    check_classification_targets(y)
    y_idx, classes = label_indices(y)
    if cast or X.dtype.kind != "f":
        X = X.astype(np.float32, copy=False)
    return X, y_idx, classes


def validate_predict_data(est, X) -> np.ndarray:
    """Fitted check plus ``X`` as float64 with the training width (scikit-learn's messages)."""
    try:
        check_is_fitted(est)
    except NotFittedError as exc:
        raise ProbeNotFittedError(f"this {type(est).__name__} is not fitted yet; call fit(X, y) first") from exc
    validated: Any = validate_data(est, X, reset=False, dtype=np.float64)  # unannotated in scikit-learn
    return validated


def softmax_decision(est, X) -> np.ndarray:
    """``decision_function`` from softmax logits: [n, K]; for two classes the margin [n]
    (logit of ``classes_[1]`` minus logit of ``classes_[0]``), as scikit-learn's classifiers."""
    Z = softmax_logits(est, X)
    return Z[:, 1] - Z[:, 0] if Z.shape[1] == 2 else Z


def softmax_logits(est, X) -> np.ndarray:
    X = validate_predict_data(est, X)
    return X @ est._softmax_coef.T + est._softmax_intercept


def softmax_proba(Z: np.ndarray) -> np.ndarray:
    Z = Z - Z.max(axis=1, keepdims=True)
    P = np.exp(Z)
    return P / P.sum(axis=1, keepdims=True)


class SoftmaxPredictMixin:
    """``decision_function``/``predict_proba``/``predict`` of a fitted softmax head
    (``classes_``, ``_softmax_coef``, ``_softmax_intercept``), shared by the probes."""

    classes_: np.ndarray  # set by the estimator's fit

    def decision_function(self, X) -> np.ndarray:
        """Softmax logits [n, K]; for two classes the margin [n], as scikit-learn's."""
        return softmax_decision(self, X)

    def predict_proba(self, X) -> np.ndarray:
        return softmax_proba(softmax_logits(self, X))

    def predict(self, X) -> np.ndarray:
        Z = softmax_logits(self, X)  # checks fitted first
        return self.classes_[Z.argmax(axis=1)]
