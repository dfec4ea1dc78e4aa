"""The similarity measures are one registry: every registered measure computes on real digits
features (the built-in ones the values they had before the registry), streaming measures that
share a statistic share one pass, the recorded hparams and run ids are as they were, and a
measure written in one module of its own is in the help, taken by --measures, computed and
named in the report without another file edited."""

from __future__ import annotations

import importlib
import math
import sys
import textwrap

import numpy as np
import pytest

from featcache.errors import ConfigError, DataError
from featcache.similarity import MEASURES, RDM_METHODS, SimilarityConfig, compare, rbf_cka, rdm, register_measure
from featcache.similarity.runner import Budget, _run_ids

LITE0 = "tf_efficientnet_lite0"  # the conftest session stores' backbone
RANDOM = f"{LITE0}@random0"  # the second backbone of the two_backbones store (conftest.py)

#: each built-in measure on the digits test rows, lite0 vs lite0@random0, as computed before
#: the registry: all 450 rows within 2 GB ("full"), and three copies of them within 20 MiB
#: (1,350 rows: sigma 30 and cosine RDMs; RSA on a sample, recorded as an estimate). RBF CKA
#: there was the minibatch estimator's 0.4201619639499961 before issue 60: it is now the full
#: formula's value (None: computed by the test), accumulated in row blocks
TODAY = {
    "full": {
        "cka_linear": (0.4009302313478728, {"rows": 450, "block_rows": 8138}),
        "cka_debiased": (0.3613973277590283, {"rows": 450, "block_rows": 8138}),
        "cka_rbf": (0.44690893785642744, {"rbf_estimator": "full", "rows": 450}),
        "rsa_spearman": (0.18603830635201862, {"rows": 450}),
    },
    "tiled": {
        "cka_linear": (0.40093023134787287, {"rows": 1350, "block_rows": 256}),
        "cka_debiased": (0.3885003681779975, {"rows": 1350, "block_rows": 256}),
        "cka_rbf": (None, {"rbf_estimator": "blocks", "rows": 1350, "tile_rows": 256}),
        "rsa_spearman": (
            0.1790920468166526,
            {"rows": 660, "estimate": "RDMs of a sample of 660 of 1350 rows (seed 0)"},
        ),
    },
}


def _configs(cache: str, measures: tuple[str, ...]) -> dict[str, SimilarityConfig]:
    return {
        "full": SimilarityConfig(cache=cache, dataset="digits", measures=measures),
        "tiled": SimilarityConfig(
            cache=cache, dataset="digits", measures=measures, max_memory=20 * 1024**2, rdm="cosine", rbf_sigma=30.0
        ),
    }


@pytest.fixture(scope="module")
def digits_rows(two_backbones):
    """The two backbones' test rows: lazy stored views, and three copies of them in memory."""
    from featcache.store import open_cache

    cache = open_cache(two_backbones)
    la = cache.load(LITE0, "digits", "test", lazy=True)
    lb = cache.load(RANDOM, "digits", "test", lazy=True)
    X, Y = np.asarray(la.X, np.float64), np.asarray(lb.X, np.float64)
    return {"full": (la.X, lb.X), "tiled": (np.tile(X, (3, 1)), np.tile(Y, (3, 1)))}


@pytest.mark.parametrize("measure", list(MEASURES))
def test_every_registered_measure_computes_on_real_features(measure, two_backbones, digits_rows):
    """Alone and beside every other measure: the same value, a number, its details recorded;
    a built-in measure gives exactly the value it gave before the registry."""
    everything = compare(*digits_rows["full"], _configs(two_backbones, tuple(MEASURES))["full"])
    for case, cfg in _configs(two_backbones, (measure,)).items():
        got = compare(*digits_rows[case], cfg)
        assert list(got) == [measure]
        value, details = got[measure]
        assert math.isfinite(value)
        assert isinstance(details, dict)
        if case == "full":
            assert everything[measure] == (value, details)  # the shared pass changes nothing
        if measure in TODAY[case]:
            want, want_details = TODAY[case][measure]
            if want is None:  # the full formula on every row
                X, Y = (np.asarray(v, np.float64) for v in digits_rows[case])
                want = rbf_cka(X, Y, sigma=30.0)
            assert value == pytest.approx(want, rel=1e-12 if case == "full" else 1e-9, abs=0)
            assert details == want_details


def test_every_builtin_measure_is_pinned():
    assert set(TODAY["full"]) == set(TODAY["tiled"]) == {"cka_linear", "cka_debiased", "cka_rbf", "rsa_spearman"}
    assert set(TODAY["full"]) <= set(MEASURES)
    assert [m for m in MEASURES if m in TODAY["full"]] == list(TODAY["full"])  # the rows' order


def test_recorded_hparams_and_run_ids_are_as_before():
    """What a row records, and so its run id, is what it was before the registry (a table
    written then still counts its pairs as done)."""
    default, tiled = _configs("c", tuple(MEASURES)).values()
    fps = {"a": "fa", "b": "fb"}
    assert _run_ids(default, "a", "b", fps) == {
        "cka_linear": "649622a20d7858f3",
        "cka_debiased": "1d6b36924759de47",
        "cka_rbf": "d12add6c6d01db30",
        "rsa_spearman": "0be156afd4c1318c",
    }
    assert _run_ids(tiled, "a", "b", fps) == {
        "cka_linear": "649622a20d7858f3",
        "cka_debiased": "1d6b36924759de47",
        "cka_rbf": "7fb9042b5bc0d8fb",
        "rsa_spearman": "5cbec0082896f644",
    }
    assert {m: tiled.hparams(m) for m in tiled.measures} == {
        "cka_linear": {"feature_kind": "pooled"},
        "cka_debiased": {"feature_kind": "pooled"},
        "cka_rbf": {
            "feature_kind": "pooled",
            "rbf_threshold": None,
            "rbf_sigma": 30.0,
            "max_memory": 20971520,
            "seed": 0,
        },
        "rsa_spearman": {"feature_kind": "pooled", "max_memory": 20971520, "seed": 0, "rdm": "cosine"},
    }


class _Counting:
    """A streaming statistic that counts its instances and the rows it is fed."""

    made = 0

    def __init__(self) -> None:
        type(self).made += 1
        self.rows = 0
        self.blocks = 0

    def update(self, x: np.ndarray, y: np.ndarray) -> None:
        self.rows += x.shape[0]
        self.blocks += 1


def test_streaming_measures_sharing_a_statistic_share_one_pass():
    X, Y = np.random.default_rng(0).normal(size=(2, 600, 200))
    with MEASURES.restored():
        register_measure("rows_seen", text="rows", statistic=_Counting)(lambda s, cfg: float(s.rows))
        register_measure("blocks_seen", text="blocks", statistic=_Counting)(lambda s, cfg: float(s.blocks))
        cfg = SimilarityConfig(cache="c", dataset="d", measures="rows_seen,blocks_seen,cka_linear", max_memory="2MB")
        _Counting.made = 0
        got = compare(X, Y, cfg)
    assert _Counting.made == 1  # one accumulator for the two measures
    rows = Budget(cfg.memory, 200, 200).block_rows
    assert got["rows_seen"] == (600.0, {"rows": 600, "block_rows": rows})
    assert got["blocks_seen"][0] == math.ceil(600 / rows) > 1
    assert list(got) == ["cka_linear", "rows_seen", "blocks_seen"]  # the registry's order
    assert "rows_seen" not in MEASURES  # restored


def test_unknown_measures_and_rdm_methods_are_refused_with_the_registered_names():
    with pytest.raises(ConfigError, match=r"choose from \('cka_linear', 'cka_debiased', 'cka_rbf', 'rsa_spearman'\)"):
        SimilarityConfig(cache="c", dataset="d", measures="cka_lin")
    with pytest.raises(ConfigError, match="unknown similarity measure 'cka_rbff'; did you mean 'cka_rbf'"):
        MEASURES.entry("cka_rbff")
    with pytest.raises(ConfigError, match="--rdm euclid is invalid: choose correlation or cosine"):
        SimilarityConfig(cache="c", dataset="d", rdm="euclid")
    with pytest.raises(DataError, match=r"unknown RDM method 'euclid'; choose one of \('correlation', 'cosine'\)"):
        rdm(np.eye(3), "euclid")
    assert list(RDM_METHODS) == ["correlation", "cosine"]


def test_a_registered_rdm_method_is_computed():
    X = np.random.default_rng(1).normal(size=(5, 3))
    with RDM_METHODS.restored():
        RDM_METHODS.register("scaled", lambda rows: 2.0 * rows, info="all-zero")
        assert np.array_equal(rdm(X, "scaled"), rdm(X, "cosine"))  # cosine is scale free
    assert "scaled" not in RDM_METHODS


PLUGIN = '''
"""A similarity measure in one file of its own."""
from featcache.similarity import register_measure
from featcache.similarity.streaming import LinearCKAStream


@register_measure("cka_linear_squared", text="squared linear CKA (plug-in)", statistic=LinearCKAStream,
                  hparams=lambda cfg: {"power": 2})
def cka_linear_squared(stat, cfg):
    return stat.result() ** 2
'''


def _similarity_help() -> str:
    from featcache.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    return sub["similarity"].format_help()


def test_a_measure_in_one_module_is_listed_taken_computed_and_named_in_the_report(
    two_backbones, digits_rows, tmp_path, monkeypatch, capsys
):
    import polars as pl

    from featcache.analysis.report import write_report
    from featcache.cli import main
    from featcache.core.results import read_results

    (tmp_path / "plugin_measure.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    res = tmp_path / "r.parquet"
    with MEASURES.restored():
        importlib.import_module("plugin_measure")
        try:
            assert "cka_linear_squared" in _similarity_help()
            argv = ["similarity", "--cache", two_backbones, "--dataset", "digits", "--all", "--results", str(res)]
            assert main([*argv, "--measures", "cka_linear,cka_linear_squared", "--no-progress"]) == 0
            got = compare(*digits_rows["full"], _configs(two_backbones, ("cka_linear_squared",))["full"])
        finally:
            sys.modules.pop("plugin_measure", None)
    assert "cka_linear_squared" not in MEASURES
    assert "cka_linear_squared" not in _similarity_help()
    assert got["cka_linear_squared"][0] == pytest.approx(TODAY["full"]["cka_linear"][0] ** 2, rel=1e-12)
    rows = read_results(res).filter(pl.col("metric") == "cka_linear_squared")
    assert rows["value"].to_list() == [got["cka_linear_squared"][0]]
    assert '"power": 2' in rows["hparams"][0]
    assert '"measure_text": "squared linear CKA (plug-in)"' in rows["hparams"][0]
    capsys.readouterr()
    # the report, written with the measure no longer registered, names it from the table alone
    # (beside retrieval rows: a report needs a task's rows)
    from featcache.retrieval import RetrievalConfig, run_retrieval

    run_retrieval(
        RetrievalConfig(
            cache=two_backbones,
            dataset="digits",
            backbones=(LITE0, RANDOM),
            query_split="test",
            gallery_split="same",
            results_path=str(res),
            progress=False,
        )
    )
    html = write_report(tmp_path / "report.html", str(res)).read_text()
    assert html.count('alt="squared linear CKA (plug-in) on digits/test') == 1
    assert html.count('alt="linear CKA on digits/test') == 1
