"""``final_epoch="best-test"``: the ELEVATER toolkit's report of the final run (the best
epoch on the test split), offered as an option; the last epoch stays the default."""

from __future__ import annotations

import json

import pytest

from featcache.errors import ProbeError
from featcache.probes import ProbeConfig, run_probes

LITE0 = "tf_efficientnet_lite0"
KW = {"seeds": [0], "search_epochs": 1, "final_epochs": 4, "progress": False}


def _top1(df):
    top = df.filter(df["metric"] == "top1")
    return float(top["value"][0]), json.loads(top["hparams"][0]), top["run_id"][0]


# ported from Computer-Vision-in-the-Wild/Elevater_Toolkit_IC,
# vision_benchmark/evaluation/full_model_finetune.py, train_task: the value it returns for the
# final run (sweep_run=False) from the test metric of each epoch
def _toolkit_final_report(acc_per_epoch):
    best_acc1 = 0
    for acc1 in acc_per_epoch:
        best_acc1 = max(acc1, best_acc1)
    return best_acc1


def test_best_test_epoch_is_the_toolkits_rule_on_real_features(digits_cache):
    """The final run has a constant lr and seeded epoch permutations, so its first k epochs
    are the k-epoch run: the last-epoch values of final_epochs=1..4 are the per-epoch test
    values, and the best-test report equals the toolkit's max over them."""
    per_epoch = []
    for k in range(1, 5):
        v, hp, _ = _top1(
            run_probes(ProbeConfig(digits_cache, LITE0, "digits", "elevater-fewshot:20", **{**KW, "final_epochs": k}))
        )
        assert hp["report"].startswith("final epoch")
        assert "reported_epoch" not in hp
        per_epoch.append(v)
    v, hp, rid = _top1(
        run_probes(ProbeConfig(digits_cache, LITE0, "digits", "elevater-fewshot:20", final_epoch="best-test", **KW))
    )
    assert len(set(per_epoch)) > 1  # the test values move between epochs (lr 0.1 selected)
    assert v == _toolkit_final_report(per_epoch)
    assert hp["reported_epoch"] == per_epoch.index(max(per_epoch)) + 1
    assert hp["reported_epoch_split"] == "test"
    assert "test split" in hp["report"]
    _, _, rid_last = _top1(run_probes(ProbeConfig(digits_cache, LITE0, "digits", "elevater-fewshot:20", **KW)))
    assert rid != rid_last  # the rule enters the run id; the default keeps the ids of before


def test_the_option_says_it_selects_on_test_and_is_checked():
    from dataclasses import fields

    from featcache.probes.elevater import ElevaterOptions

    f = next(f for f in fields(ElevaterOptions) if f.name == "final_epoch")  # the elevater solver's option
    assert f.default == "last"
    assert "ON THE TEST SPLIT" in f.metadata["help"]
    with pytest.raises(ProbeError, match="best-test"):
        ProbeConfig("c", ("b",), "d", "elevater-full", final_epoch="best").resolve()
