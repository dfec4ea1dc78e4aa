"""ELEVATER's linear-probe protocol: the toolkit's SGD search (6 lrs x coarse-to-fine weight
decay, 10 search epochs, 50-epoch final run on train+val) on real lite0 features."""

from __future__ import annotations

import json

import numpy as np
import pytest

from featcache import protocols as P
from featcache.probes import ProbeConfig, run_probes
from featcache.probes.elevater import search_weight_decay

LITE0 = "tf_efficientnet_lite0"


def test_grid_is_the_toolkits():
    g = P.get_protocol("elevater-fewshot:5").grid
    np.testing.assert_allclose(g.lrs, [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1])
    assert len(g.wds) == 97 and g.wds[0] == pytest.approx(1e-6) and g.wds[-1] == pytest.approx(1e6)
    np.testing.assert_allclose([g.wds[i] for i in g.coarse], np.logspace(-6, 6, 7))
    assert (g.search_epochs, g.final_epochs, g.batch_size, g.momentum, g.nesterov) == (10, 50, 32, 0.9, True)
    fs, full = P.get_protocol("elevater-fewshot:20"), P.get_protocol("elevater-full")
    assert (fs.split, fs.shots, fs.seeds, fs.solver) == ("fewshot", 20, (0, 1, 2), "elevater")
    assert (full.split, full.seeds, full.solver) == ("full", (0,), "elevater")
    with pytest.raises(P.ProtocolError, match="N >= 2"):
        P.get_protocol("elevater-fewshot:1")


def test_weight_decay_search_is_coarse_to_fine():
    visited = []

    def score(i):
        visited.append(i)
        return -abs(i - 37)

    best, sc, n = search_weight_decay(score, 97, range(0, 97, 16), (8, 4, 2, 1))
    # coarse 0..96 -> 32; span 8: 24, 40 -> 40; span 4: 36, 44 -> 36; span 2: 34, 38 (tie, keep 36);
    # span 1: 35, 37 -> 37
    assert visited == [0, 16, 32, 48, 64, 80, 96, 24, 40, 36, 44, 34, 38, 35, 37]
    assert (best, sc, n) == (37, 0, 15)


def test_elevater_fewshot_on_real_features(digits_cache):
    df = run_probes(ProbeConfig(digits_cache, LITE0, "digits", "elevater-fewshot:5", seeds=[0],
                                search_epochs=3, final_epochs=20, progress=False))
    top = df.filter(df["metric"] == "top1")
    hp = json.loads(top["hparams"][0])
    assert top["protocol"][0] == "elevater-fewshot:5" and top["train_split"][0] == "train[elevater-fewshot:5]"
    assert (hp["n_train"], hp["n_val"], hp["n_train_final"]) == (40, 10, 50)
    assert hp["solver"] == "elevater-sgd" and hp["lr"] in P.ELEVATER_SGD.lrs and hp["weight_decay"] in P.ELEVATER_SGD.wds
    assert 6 * 7 <= hp["trials"] <= 6 * 15 and len(hp["per_lr"]) == 6
    assert hp["scaled_from"] == {"search_epochs": 10, "final_epochs": 50} and hp["head"] == "zeros"
    assert top["value"][0] > 0.5  # chance 0.1; zero head, 3 + 20 epochs: measured 0.69


def test_lbfgs_protocols_say_they_are_dinov2_style():
    doc = P.__doc__
    assert "DINOv2" in doc and "elevater-fewshot" in doc
