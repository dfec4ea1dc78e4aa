"""Fixtures of the probe tests only (the session stores they read are in tests/conftest.py)."""

from __future__ import annotations

import pytest

LITE0 = "tf_efficientnet_lite0"  # the backbone of tests/conftest.py's session stores


@pytest.fixture(scope="session")
def digits16(digits_cache):
    """lite0 digits train features as stored (float16), and a fixed 75/25 train/val split."""
    import numpy as np

    from featcache.store import open_cache

    tr = open_cache(digits_cache).load(LITE0, "digits", "train")
    X, y = tr.X.astype(np.float16), np.asarray(tr.labels)
    p = np.random.default_rng(0).permutation(y.size)
    k = int(0.75 * y.size)
    return X, y, p[:k], p[k:]
