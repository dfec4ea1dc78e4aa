"""The Battle of the Backbones suite (suites/bob.toml): BoB's classification tasks with featcache
protocol names, its retrieval tasks scored on the metrics `featcache retrieve` writes (map_bob,
mp@k, mrr_bob), ranked on map_bob."""

from __future__ import annotations

import numpy as np
import pytest

from featcache.core.protocols import get_protocol
from featcache.suites import METRICS, SuiteError, _suite, load_suite

# hsouri/bob-retrieval retrieval/scripts_bb.sh + main_ret.py's datasets (Objectnet in main_ret.py)
BOB_RETRIEVAL = {"cub200", "inaturalist", "objectnet", "instre", "roxford5k", "rparis6k", "gldv2", "copydays"}
# bob-classification timm_dataset.py num_classes + medical_chexpert (the paper's Table 4)
BOB_CLASSIFICATION = {
    "imagenet": 1000,
    "cifar100": 100,
    "eurosat": 10,
    "flowers102": 102,
    "aircraft": 100,
    "chexpert": 5,
}


def test_bob_suite_lists_the_toolkits_tasks_protocols_and_data():
    s = load_suite("bob")
    cls = {t.name: t for t in s.tasks if t.kind == "classification"}
    ret = {t.name: t for t in s.tasks if t.kind == "retrieval"}
    assert {n: t.num_classes for n, t in cls.items()} == BOB_CLASSIFICATION
    assert set(ret) == BOB_RETRIEVAL
    assert {t.metric for t in cls.values()} <= set(METRICS)
    assert cls["chexpert"].multilabel
    assert cls["chexpert"].metric == "roc_auc_macro"
    assert cls["imagenet"].protocols == ("bob-linear", "full", "subset:1%", "subset:10%")
    assert all(t.protocols[0] == "bob-linear" for t in cls.values() if not t.multilabel)
    for t in cls.values():
        assert t.protocols
        assert all(get_protocol(p).stage == "probe" for p in t.protocols)
    for t in ret.values():
        assert t.metric == "map_bob"
        assert {"mrr_bob", "mp@5"} <= set(t.metrics)
        assert t.relevance
        assert {"query", "gallery"} <= set(t.splits)
    assert "not bundled" in s.data
    assert all(t.data and t.data.startswith("not bundled") for t in s.tasks)


def test_suite_loader_refuses_unknown_protocols_and_retrieval_metrics():
    base = {"name": "x", "title": "x", "paper": "x", "groups": ["g"]}
    task = {"name": "t", "group": "g", "source": "s", "metric": "top1", "num_classes": 2, "protocols": ["nope"]}
    with pytest.raises(SuiteError, match="protocol 'nope' is not a probe protocol"):
        _suite({**base, "tasks": [task]}, "x.toml")
    ret = {"name": "r", "group": "g", "source": "s", "kind": "retrieval", "metric": "top1", "num_classes": 0}
    with pytest.raises(SuiteError, match="not one featcache retrieve writes"):
        _suite({**base, "tasks": [ret]}, "x.toml")
    with pytest.raises(SuiteError, match="not one featcache retrieve writes"):
        _suite({**base, "tasks": [{**ret, "metric": "map_bob", "metrics": ["mp@0"]}]}, "x.toml")


def test_bob_retrieval_metrics_are_written_by_retrieve_and_ranked_on(digits_cache, tmp_path):
    from featcache.analysis import rank
    from featcache.retrieval import RetrievalConfig, run_retrieval
    from featcache.store import open_cache, write_features

    res = str(tmp_path / "r.parquet")
    cfg = RetrievalConfig(cache=digits_cache, dataset="digits", ks=(1, 5, 10), knn=False, progress=False, results=res)
    written = set(run_retrieval(cfg)["metric"].to_list())
    ret = [t for t in load_suite("bob").tasks if t.kind == "retrieval"]
    assert {m for t in ret for m in (t.metric, *t.metrics)} <= written
    # a second backbone (raw pixels of the same images) so the ranking has two to compare
    c = open_cache(digits_cache)
    pix = str(tmp_path / "pix.zarr")
    from sklearn.datasets import load_digits

    X = load_digits().data.astype(np.float32)
    for split in ("train", "test"):
        ids, labels, _ = c.split_rows("digits", split)
        idx = np.array([int(str(i).rsplit("-", 1)[1]) for i in ids])  # ids digits-<index>
        write_features(pix, backbone="pix", dataset="digits", split=split, X=X[idx], ids=ids, labels=labels)
    run_retrieval(cfg.with_(cache=pix))
    r = rank(res, retrieval_metric="auto", plots=False, on_constant="drop")
    assert r.retrieval_metric == ret[0].metric == "map_bob"
