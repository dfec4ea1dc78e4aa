"""LogisticProbe and SGDProbe honour scikit-learn's estimator contract
(``parametrize_with_checks``, every check of scikit-learn 1.9 with legacy checks on).

No check is an expected failure: binary ``decision_function`` is the [n] margin and fit
validates through ``validate_data``/``check_classification_targets``, so nothing needs
listing in ``expected_failed_checks``. scikit-learn itself skips two kinds when their
optional inputs are unavailable here (pandas objects; array-API inputs without
``SCIPY_ARRAY_API``); they run where those are installed."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.utils.estimator_checks import parametrize_with_checks

from featcache.errors import ProbeError
from featcache.probes import LogisticProbe, SGDProbe


def _expected_failed_checks(estimator) -> dict[str, str]:
    """Checks that cannot apply, with why (none at present; keep the hook for new probes)."""
    return {}


@parametrize_with_checks(
    [LogisticProbe(backend="torch"), LogisticProbe(backend="sklearn"), SGDProbe(device="cpu")],
    expected_failed_checks=_expected_failed_checks,
)
def test_sklearn_estimator_contract(estimator, check):
    check(estimator)


@pytest.mark.parametrize("est", [LogisticProbe(backend="torch"), SGDProbe(device="cpu")])
def test_not_fitted_is_both_errors(est):
    X = np.eye(4, dtype=np.float32)
    with pytest.raises(ProbeError, match="not fitted"):
        est.predict(X)
    with pytest.raises(NotFittedError):
        clone(est).predict_proba(X)


@pytest.mark.gpu
def test_sgd_probe_on_cuda_matches_cpu():
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    g = SGDProbe(steps=300).fit(X[:1200], y[:1200])
    c = SGDProbe(steps=300, device="cpu").fit(X[:1200], y[:1200])
    assert g.device_ == "cuda"
    assert c.device_ == "cpu"
    assert np.mean(g.predict(X[1200:]) == c.predict(X[1200:])) >= 0.97
    assert g.score(X[1200:], y[1200:]) > 0.85  # CPU: 0.91
