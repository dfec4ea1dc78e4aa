"""LogisticProbe and SGDProbe honour scikit-learn's estimator contract
(``parametrize_with_checks``); the few checks that cannot apply are listed with the reason."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.utils.estimator_checks import parametrize_with_checks

from featcache.errors import ProbeError
from featcache.probes import LogisticProbe, SGDProbe


def _expected_failed_checks(estimator) -> dict[str, str]:
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
