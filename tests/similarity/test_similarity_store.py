"""The similarity stage on real features: lite0 (ImageNet weights) and lite0 with random:0
weights on digits; the audit on the Fashion-MNIST store; the report's similarity heatmap."""

from __future__ import annotations

import numpy as np
import pytest
import similarity_refs as ref

from featcache.similarity import LinearCKAStream, SimilarityConfig, compare, run_similarity
from featcache.similarity.streaming import paired_blocks

LITE0 = "tf_efficientnet_lite0"  # the conftest session stores' backbone
RANDOM = f"{LITE0}@random0"  # the second backbone of the two_backbones store (conftest.py)


def _eager(path: str, b: str):
    from featcache.store import open_cache

    return open_cache(path).load(b, "digits", "test")


def test_streamed_cka_equals_the_full_formula_on_real_features(two_backbones):
    fa, fb = _eager(two_backbones, LITE0), _eager(two_backbones, RANDOM)
    assert (fa.ids == fb.ids).all()
    X, Y = fa.X.astype(np.float64), fb.X.astype(np.float64)
    for rows in (1, 50, 128, 10_000):
        s = LinearCKAStream()
        for bx, by in paired_blocks(fa.X, fb.X, rows):
            s.update(bx, by)
        assert s.result() == pytest.approx(ref.feature_space_linear_cka(X, Y), rel=1e-9)
        assert s.result(debiased=True) == pytest.approx(ref.feature_space_linear_cka(X, Y, True), rel=1e-9)
    assert ref.feature_space_linear_cka(X, Y) < 0.9  # random weights: a different representation


def test_compare_lazy_views_in_blocks_equals_in_memory(two_backbones):
    """The stage's own path: lazy stored views (chunks of 128 and 512 rows) streamed in blocks."""
    from featcache.store import open_cache

    cache = open_cache(two_backbones)
    la = cache.load(LITE0, "digits", "test", lazy=True)
    lb = cache.load(RANDOM, "digits", "test", lazy=True)
    cfg = SimilarityConfig(cache=two_backbones, dataset="digits", max_memory="16MB")
    got = compare(la.X, lb.X, cfg)
    X, Y = np.asarray(la.X, np.float64), np.asarray(lb.X, np.float64)
    assert got["cka_linear"][1]["block_rows"] < X.shape[0]  # several blocks
    assert got["cka_linear"][0] == pytest.approx(ref.feature_space_linear_cka(X, Y), rel=1e-9)
    assert got["cka_debiased"][0] == pytest.approx(ref.feature_space_linear_cka(X, Y, True), rel=1e-9)
    assert got["cka_rbf"][0] == pytest.approx(ref.cka(ref.gram_rbf(X), ref.gram_rbf(Y)), rel=1e-9)
    assert got["cka_rbf"][1]["rbf_estimator"] == "full"
    want = ref.correlate_rdms(ref.compute_rdm(X, "correlation"), ref.compute_rdm(Y, "correlation"), "spearman")
    assert got["rsa_spearman"][0] == pytest.approx(want, rel=1e-9)


def test_kernel_estimators_past_the_memory_bound(two_backbones, monkeypatch):
    """A bound too small for 1,350 x 1,350 Gram matrices: RBF CKA on every row in blocks (the
    full formula's value; before issue 60 the minibatch estimator, unannounced), and past
    EXACT_MAX_ROWS the minibatch estimator over a sample, recorded as an estimate."""
    from featcache.similarity import registry
    from featcache.similarity.measures import rbf_cka
    from featcache.store import open_cache

    cache = open_cache(two_backbones)
    la = cache.load(LITE0, "digits", "test", lazy=True)
    lb = cache.load(RANDOM, "digits", "test", lazy=True)
    cfg = SimilarityConfig(cache=two_backbones, dataset="digits", max_memory="16MB", measures="cka_rbf,rsa_spearman")
    small = compare(la.X[:400], lb.X[:400], cfg)
    assert small["cka_rbf"][1]["rbf_estimator"] == "full"
    cfg2 = SimilarityConfig(cache=two_backbones, dataset="digits", max_memory=20 * 1024**2, measures="cka_rbf")
    from featcache.similarity.runner import Budget

    assert Budget(cfg2.memory, 1280, 1280).gram_rows < 1000
    X, Y = np.asarray(la.X, np.float64), np.asarray(lb.X, np.float64)
    big_x, big_y = np.tile(X, (3, 1)), np.tile(Y, (3, 1))  # 1350 rows: past the bound
    got = compare(big_x, big_y, cfg2)["cka_rbf"]
    assert got[1]["rbf_estimator"] == "blocks"
    assert "estimate" not in got[1]
    assert got[0] == pytest.approx(rbf_cka(big_x, big_y), rel=1e-9)
    monkeypatch.setattr(registry, "EXACT_MAX_ROWS", 1000)
    got = compare(big_x, big_y, cfg2)["cka_rbf"]
    assert got[1]["rbf_estimator"] == "minibatch"
    assert got[1]["minibatch"] == Budget(cfg2.memory, 1280, 1280).gram_rows
    assert got[1]["estimate"].startswith("google-research's minibatch estimate on ")


def test_cli_writes_rows_skips_finished_pairs_and_the_report_draws_them(two_backbones, tmp_path, capsys):
    import polars as pl

    from featcache.cli import main
    from featcache.core.results import read_results

    res = tmp_path / "r.parquet"
    argv = ["similarity", "--cache", two_backbones, "--dataset", "digits", "--all", "--results", str(res)]
    assert main(argv) == 0
    df = read_results(res)
    assert sorted(df["metric"].to_list()) == ["cka_debiased", "cka_linear", "cka_rbf", "rsa_spearman"]
    assert set(df["kind"]) == {"similarity"}
    assert df["n_eval"].to_list() == [450] * 4
    row = df.filter(pl.col("metric") == "cka_linear").row(0, named=True)
    assert row["backbone"] == LITE0
    assert row["protocol"] == f"vs:{RANDOM}"
    assert f'"backbone_b": "{RANDOM}"' in row["hparams"]
    X, Y = _eager(two_backbones, LITE0).X.astype(float), _eager(two_backbones, RANDOM).X.astype(float)
    assert row["value"] == pytest.approx(ref.feature_space_linear_cka(X, Y), rel=1e-9)
    created = df["created_at"].to_list()
    assert main(argv) == 0  # finished: skipped, nothing rewritten
    assert read_results(res)["created_at"].to_list() == created
    assert "cka_linear=" in capsys.readouterr().out


def test_one_backbone_and_unknown_backbones_are_refused(digits_cache, two_backbones):
    from featcache.errors import ConfigError, DataError

    with pytest.raises(DataError, match=r"1 backbone\(s\) .* hold digits/test"):
        run_similarity(SimilarityConfig(cache=digits_cache, dataset="digits"))
    with pytest.raises(DataError, match=r"\['nope'\] hold no features"):
        run_similarity(SimilarityConfig(cache=two_backbones, dataset="digits", backbones=("nope", LITE0)))
    with pytest.raises(ConfigError, match="at least two"):
        SimilarityConfig(cache=two_backbones, dataset="digits", backbones=(LITE0,))


def test_report_draws_the_heatmap_and_the_audit_table(two_backbones, tmp_path):
    """Similarity and audit rows beside real retrieval rows: the report shows a heatmap per
    measure and the audit table, and the ranking sees only the retrieval rows."""
    from featcache.analysis.loaded import load_results
    from featcache.analysis.report import write_report
    from featcache.retrieval import RetrievalConfig, run_retrieval
    from featcache.similarity import AuditConfig, run_audit

    res = str(tmp_path / "r.parquet")
    run_similarity(SimilarityConfig(cache=two_backbones, dataset="digits", results_path=res, progress=False))
    run_retrieval(
        RetrievalConfig(
            cache=two_backbones,
            dataset="digits",
            backbones=(LITE0, RANDOM),
            query_split="test",
            gallery_split="same",
            results_path=res,
            progress=False,
        )
    )
    run_audit(
        AuditConfig(
            cache=two_backbones, dataset="digits", backbone=LITE0, out=str(tmp_path / "a.csv"), results_path=res
        )
    )
    loaded = load_results(res)
    assert not set(loaded.rows["kind"].unique()) & {"similarity", "audit"}
    html = write_report(tmp_path / "report.html", res).read_text()
    assert html.count('alt="linear CKA on digits/test') == 1
    assert html.count("<figure><img alt=") >= 4
    assert 'id="audit-table"' in html
    assert "knn_top1_clean" in html
