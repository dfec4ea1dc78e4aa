"""Test helpers: catch the split plan ``run_probes`` fits on, and compare sets of feature rows."""

from __future__ import annotations

import numpy as np


def spy_plan(monkeypatch) -> dict:
    """After ``run_probes``, ``seen["plan"]`` is the last plan the runner built (its ``_Plan``)."""
    from featcache.probes import runner as PR

    seen: dict = {}
    real = PR._plan

    def spy(*a):
        seen["plan"] = real(*a)
        return seen["plan"]

    monkeypatch.setattr(PR, "_plan", spy)
    return seen


def sorted_rows(X) -> np.ndarray:
    """The rows of ``X`` in lexicographic order (two row sets are equal iff these are)."""
    X = np.asarray(X, np.float64)
    return X[np.lexsort(X.T[::-1])]
