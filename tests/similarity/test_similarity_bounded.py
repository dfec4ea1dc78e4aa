"""Issue 60: a memory bound changes no number unannounced. The same pair at several bounds
gives RBF CKA's exact value (the full formula, accumulated in row blocks) and RSA's exact
value or an estimate that the row records and the CLI names in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import similarity_refs as ref

from featcache.similarity import SimilarityConfig, compare
from featcache.similarity.blocked import blocked_rbf_cka, kth_smallest
from featcache.similarity.measures import rbf_cka
from featcache.similarity.registry import Budget

LITE0 = "tf_efficientnet_lite0"
RANDOM = f"{LITE0}@random0"
BOUNDS = ("1MiB", "2MB", "3MB", "16MB", "2GB")


@pytest.fixture(scope="module")
def pair(two_backbones):
    from featcache.store import open_cache

    cache = open_cache(two_backbones)
    la = cache.load(LITE0, "digits", "test", lazy=True)
    lb = cache.load(RANDOM, "digits", "test", lazy=True)
    return la.X, lb.X, np.asarray(la.X, np.float64), np.asarray(lb.X, np.float64)


@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("bandwidth", [{}, {"rbf_sigma": 30.0}, {"rbf_threshold": 0.5}])
def test_rbf_cka_is_the_full_formula_at_every_bound(pair, bound, bandwidth, two_backbones):
    lx, ly, X, Y = pair
    cfg = SimilarityConfig(cache=two_backbones, dataset="digits", max_memory=bound, measures="cka_rbf", **bandwidth)
    value, details = compare(lx, ly, cfg)["cka_rbf"]
    kw = {"sigma": 30.0} if "rbf_sigma" in bandwidth else {"threshold": bandwidth.get("rbf_threshold", 1.0)}
    assert value == pytest.approx(rbf_cka(X, Y, **kw), rel=1e-9)
    assert "estimate" not in details
    assert details["rows"] == 450
    fits = Budget(cfg.memory, 1280, 1280).gram_rows >= 450
    assert details["rbf_estimator"] == ("full" if fits else "blocks")


@pytest.mark.parametrize("bound", BOUNDS)
def test_rsa_is_exact_or_a_recorded_estimate(pair, bound, two_backbones):
    lx, ly, X, Y = pair
    cfg = SimilarityConfig(cache=two_backbones, dataset="digits", max_memory=bound, measures="rsa_spearman")
    value, details = compare(lx, ly, cfg)["rsa_spearman"]
    exact = ref.correlate_rdms(ref.compute_rdm(X, "correlation"), ref.compute_rdm(Y, "correlation"), "spearman")
    if details["rows"] == 450:
        assert value == pytest.approx(exact, rel=1e-9)
        assert "estimate" not in details
    else:
        assert details["estimate"] == f"RDMs of a sample of {details['rows']} of 450 rows (seed 0)"


def test_the_cli_names_the_estimates_in_one_line_and_the_rows_record_them(two_backbones, tmp_path, capsys):
    from featcache.cli import main
    from featcache.core.results import read_results

    res = tmp_path / "r.parquet"
    argv = ["similarity", "--cache", two_backbones, "--dataset", "digits", "--all", "--results", str(res)]
    assert main([*argv, "--max-memory", "2MB"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note: estimates")]
    assert len(notes) == 1
    assert "rsa_spearman: RDMs of a sample of" in notes[0]
    assert "cka_rbf" not in notes[0]
    hp = {r["metric"]: json.loads(r["hparams"]) for r in read_results(res).iter_rows(named=True)}
    assert hp["rsa_spearman"]["estimate"].startswith("RDMs of a sample of")
    assert hp["cka_rbf"]["rbf_estimator"] == "blocks"
    assert "estimate" not in hp["cka_rbf"]
    assert main([*argv[:-2], "--results", str(tmp_path / "full.parquet")]) == 0  # 2 GB: all exact
    assert "note: estimates" not in capsys.readouterr().out


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_kth_smallest_is_exact_with_ties_and_any_cap(n):
    rng = np.random.default_rng(n)
    v = np.round(rng.normal(size=n * 3), 1)  # many ties
    tiles = lambda: iter(np.array_split(v, 5))  # noqa: E731
    ks = tuple(sorted({0, (v.size - 1) // 2, v.size // 2, v.size - 1}))
    for cap in (1, 16, 10**6):
        assert kth_smallest(tiles, ks, cap, v.size) == [float(np.sort(v)[k]) for k in ks]


def test_blocked_rbf_cka_equals_the_full_formula_on_random_rows():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(301, 20))
    X[:9] = X[0]  # duplicated rows: zero distances besides the diagonal
    Y = X @ rng.normal(size=(20, 7)) + rng.normal(size=(301, 7))
    for memory in (1 << 20, 1 << 22, 1 << 30):
        assert blocked_rbf_cka(X, Y, 1.0, None, memory)[0] == pytest.approx(rbf_cka(X, Y), rel=1e-9)
