"""RetrievalConfig: the single source of the retrieve flags, run ids and hparams."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from featcache.errors import DataError
from featcache.retrieval import RetrievalConfig
from featcache.retrieval.cli import register
from featcache.retrieval.config import legacy_config


def _parse(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["retrieve", *argv])


def test_cli_builds_the_config():
    args = _parse(
        [
            "--cache",
            "c.zarr",
            "--backbone",
            "a",
            "--backbone",
            "b",
            "--dataset",
            "d",
            "--query",
            "test",
            "--gallery",
            "same",
            "--metric",
            "l2",
            "--k",
            "5,1,5",
            "--top-k-only",
            "--no-knn",
            "--revisited",
            "hard",
            "--results",
            "r.parquet",
        ]
    )
    cfg = RetrievalConfig.from_args(args)
    assert cfg == RetrievalConfig(
        cache="c.zarr",
        dataset="d",
        backbones=("a", "b"),
        query_split="test",
        gallery_split="same",
        metric="l2",
        ks=(1, 5),
        full=False,
        knn=False,
        revisited=("hard",),
        results_path="r.parquet",
    )
    dflt = RetrievalConfig.from_args(
        _parse(["--cache", "c", "--all", "--dataset", "d", "--query", "q", "--gallery", "g", "--results", "r"])
    )
    assert dflt.backbones is None
    assert dflt.full
    assert dflt.knn
    assert dflt.ks == (1, 5, 10, 100)
    assert dflt.revisited == ("medium", "hard")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.metric = "ip"


def test_every_cli_flag_is_a_config_field():
    args = vars(_parse(["--cache", "c", "--all", "--dataset", "d", "--query", "q", "--gallery", "g", "--results", "r"]))
    names = {f.name for f in dataclasses.fields(RetrievalConfig)}
    # --track is the experiment-tracker flag every stage shares (featcache.core.tracking): it
    # changes no result and no run id, so it is not a retrieval setting
    assert set(args) - {"backbone", "all", "func", "track"} <= names


def test_run_ids_and_hparams_come_from_the_config():
    a = RetrievalConfig(cache="c", dataset="d", backbones="b", ks=[100, 1, 5, 10])
    b = legacy_config("c", ["b"], "d", "test", "train", "cosine", (1, 5, 10, 100))
    assert a == b
    d = a.run_definition("b", "semantic", "", "fp")
    # the keys and values of the run definition used before the config existed (ids unchanged)
    assert d == {
        "kind": "retrieval",
        "backbone": "b",
        "dataset": "d",
        "protocol": "semantic",
        "query": "test",
        "gallery": "train",
        "metric": "cosine",
        "ks": [1, 5, 10, 100],
        "full": True,
        "relevance": "",
        "feature_kind": "pooled",
        "store": "fp",
    }
    hp = a.hparams(backend="numpy", relevance_sha="x", n_queries=3)
    assert hp["ks"] == [1, 5, 10, 100]
    assert hp["similarity"] == "cosine"
    assert hp["n_queries"] == 3
    assert dataclasses.replace(a, metric="l2").run_definition("b", "semantic", "", "fp") != d


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"ks": (0, 5)}, "positive integers"),
        ({"metric": "hamming"}, "similarity"),
        ({"backend": "annoy"}, "backend"),
        ({"revisited": ("extreme",)}, "revisited"),
    ],
)
def test_bad_config_is_a_clear_error(kw, match):
    with pytest.raises(DataError, match=match):
        RetrievalConfig(cache="c", dataset="d", **kw)


def test_legacy_call_rejects_duplicates():
    with pytest.raises(TypeError, match="multiple values"):
        legacy_config("c", "b", "d", "test", query_split="x")


def test_results_path_is_the_field_and_results_a_deprecated_alias():
    cfg = RetrievalConfig(cache="c", dataset="d", results_path="r.parquet")
    assert cfg.results_path == "r.parquet"
    with pytest.warns(DeprecationWarning, match="results_path"):
        old = RetrievalConfig(cache="c", dataset="d", results="r.parquet")
    assert old == cfg
    with pytest.warns(DeprecationWarning, match="results_path"):
        assert cfg.results == "r.parquet"
    with pytest.warns(DeprecationWarning, match="dataclasses.replace"):
        assert cfg.with_(metric="l2") == dataclasses.replace(cfg, metric="l2")
    with pytest.raises(TypeError, match="both results= and results_path="):
        RetrievalConfig(cache="c", dataset="d", results="a", results_path="b")
    assert legacy_config("c", None, "d", results_path="r.parquet") == cfg


def test_bad_value_is_a_config_error():
    from featcache.errors import ConfigError

    with pytest.raises(ConfigError, match="similarity"):
        RetrievalConfig(cache="c", dataset="d", metric="hamming")
