"""``retrieve --layers`` (issue 56): retrieval and k-NN on each stored layer, the layer selected
with the val split as queries (never the reported --query split), every layer's rows equal to a
single-layer run of its kind (test_vit, random weights, on digits: tests/layer_stores.py)."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from layer_stores import VIT, relabel_test, vit_layer_store

from featcache.errors import DataError
from featcache.retrieval import RetrievalConfig, run_retrieval

#: fits and searches of seconds on a store built per session (tests/layer_stores.py)
pytestmark = pytest.mark.slow

LAYERS = "0,3,5"


def _cfg(store: str, **kw) -> RetrievalConfig:
    base = {"cache": store, "dataset": "digits", "backbones": (VIT,), "query_split": "test", "gallery_split": "train"}
    return RetrievalConfig(**{**base, "knn_ks": (10,), "progress": False, **kw})


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return vit_layer_store(tmp_path_factory)


@pytest.fixture(scope="module")
def sweep(store, tmp_path_factory):
    res = str(tmp_path_factory.mktemp("r") / "res.parquet")
    return run_retrieval(_cfg(store, layers=LAYERS, results_path=res)), res


def _one(df: pl.DataFrame, kind: str, metric: str) -> pl.DataFrame:
    return df.filter((pl.col("kind") == kind) & (pl.col("metric") == metric))


def test_rows_equal_single_layer_runs_and_selection_reads_val(store, sweep):
    df, res = sweep
    assert pl.read_parquet(res).height == df.height
    for kind, metric in (("retrieval", "map"), ("knn", "top1")):
        rows = _one(df, kind, metric)
        marks = [json.loads(h) for h in rows["hparams"]]
        assert [m["layer"] for m in marks] == [0, 3, 5]
        vals = []
        for m, v in zip(marks, rows["value"]):
            one = run_retrieval(_cfg(store, kind=m["layer_kind"]))
            assert _one(one, kind, metric)["value"][0] == v  # the curve row is the single-layer run
            val = run_retrieval(_cfg(store, kind=m["layer_kind"], query_split="val"))
            vals.append(_one(val, kind, metric)["value"][0])
            assert m["layer_val_score"] == vals[-1]
        best = [0, 3, 5][int(np.argmax(vals))]
        assert {m["layer_selection"]["selected"] for m in marks} == {best}
        assert [m["layer_role"] for m in marks].count("selected") == 1


def test_test_labels_do_not_move_the_selection(store, sweep, tmp_path):
    df, _ = sweep
    flipped = run_retrieval(_cfg(relabel_test(store, str(tmp_path / "f.zarr"), None), layers=LAYERS))
    for kind, metric in (("retrieval", "map"), ("knn", "top1")):
        a, b = (
            json.loads(h) for h in (_one(df, kind, metric)["hparams"][0], _one(flipped, kind, metric)["hparams"][0])
        )
        assert a["layer_selection"] == b["layer_selection"]
    assert not np.array_equal(_one(df, "knn", "top1")["value"], _one(flipped, "knn", "top1")["value"])


def test_cli_and_refusals(store, tmp_path, capsys):
    from featcache.cli import main

    res = str(tmp_path / "cli.parquet")
    argv = ["retrieve", "--cache", store, "--dataset", "digits", "--backbone", VIT, "--query", "test"]
    assert main([*argv, "--gallery", "train", "--layers", "-1", "--layer-part", "mean", "--results", res]) == 0
    kinds = {json.loads(h)["layer_kind"] for h in pl.read_parquet(res)["hparams"]}
    assert kinds == {"layer5_mean"}
    with pytest.raises(DataError, match="is the reported --query split"):
        run_retrieval(_cfg(store, layers="0", layer_val_split="test"))
    with pytest.raises(DataError, match="drop --kind"):
        run_retrieval(_cfg(store, layers="0", kind="layer0_cls"))
