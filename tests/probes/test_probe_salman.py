"""Salman et al.'s head: PyTorch's default ``nn.Linear`` initialisation, as
robust-models-transfer's ``src/utils/fine_tunify.py`` (``ft``) builds it
(``model_ft.fc = nn.Linear(num_ftrs, num_classes)``), seeded by the run's seed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from featcache.probes import ProbeConfig, run_probes
from featcache.probes.sgd import SGDProbe

LITE0 = "tf_efficientnet_lite0"


@pytest.fixture(scope="module")
def digits_train(digits_cache):
    from featcache.store import open_cache

    f = open_cache(digits_cache).load(LITE0, "digits", "train")
    return np.asarray(f.X[:300], np.float32), np.asarray(f.labels[:300])


@pytest.mark.parametrize("seed", [0, 7])
def test_head_starts_as_nn_linear_default(digits_train, seed):
    """No step taken: the head is exactly ``nn.Linear(D, K)`` drawn after
    ``torch.manual_seed(seed)``; the process's torch random state is left as it was."""
    import torch

    X, y = digits_train
    torch.manual_seed(123)
    before = torch.get_rng_state()
    p = SGDProbe(steps=0, init="torch-default", standardize=False, random_state=seed, device="cpu").fit(X, y)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(seed)
    ref = torch.nn.Linear(X.shape[1], 10)  # fine_tunify.py: nn.Linear(num_ftrs, num_classes)
    np.testing.assert_array_equal(p.coef_, ref.weight.detach().double().numpy())
    np.testing.assert_array_equal(p.intercept_, ref.bias.detach().double().numpy())


def test_zero_head_stays_the_default_elsewhere(digits_train):
    X, y = digits_train
    p = SGDProbe(steps=0, standardize=False, device="cpu").fit(X, y)
    assert not p.coef_.any()
    with pytest.raises(ValueError, match="torch-default"):
        SGDProbe(steps=0, init="normal", device="cpu").fit(X, y)


def test_salman_protocol_starts_from_the_default_init(digits_cache):
    from featcache.core.protocols import get_protocol

    assert get_protocol("salman").grid.init == "torch-default"
    assert get_protocol("vtab1k-sgd").grid.init == "zeros"  # VTAB's head: zeros, unchanged
    df = run_probes(ProbeConfig(digits_cache, LITE0, "digits", "salman", sgd_epochs=3, progress=False))
    hp = json.loads(df["hparams"][0])
    assert hp["init"] == "torch-default"
    assert df.filter(df["metric"] == "top1")["value"][0] > 0.8  # measured 0.8356 (1 thread, of 450)
