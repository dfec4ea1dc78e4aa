"""Figures that mislead without a word get one (issue 49 item 3): an approximate index below
--min-recall warns for every factory and reports |delta| beside the signed delta; k-NN rows
whose k covers the gallery are marked; the fine-tuning answer states the mean gain per
backbone and flags negative gains and scaled schedules; the results tables show the
intervals the text promises; the header counts settings and datasets as what they are."""

from __future__ import annotations

import json
import logging

import polars as pl
import pytest

from featcache.retrieval import RetrievalConfig, run_retrieval

LITE0 = "tf_efficientnet_lite0"


def _cfg(cache, tmp_path, **kw) -> RetrievalConfig:
    base = {
        "cache": cache,
        "dataset": "digits",
        "backbones": (LITE0,),
        "query_split": "test",
        "gallery_split": "train",
        "ks": (10,),
        "knn": False,
        "progress": False,
        "results_path": str(tmp_path / "r.parquet"),
    }
    return RetrievalConfig(**{**base, **kw})


def _values(df: pl.DataFrame) -> dict[str, float]:
    return dict(zip(df["metric"].to_list(), df["value"].to_list()))


def test_an_index_below_min_recall_warns_for_any_factory(digits_cache, tmp_path, caplog):
    """IVF16,Flat probing 1 of 16 lists (not ``auto``) misses part of the exact top-10: the run
    warns, records the shortfall, and every delta has its |delta| beside it."""
    cfg = _cfg(digits_cache, tmp_path, index="IVF16,Flat", nprobe=1, min_recall=0.999, recall_queries=200)
    with caplog.at_level(logging.WARNING, logger="featcache.retrieval.run"):
        df = run_retrieval(cfg)
    v = _values(df)
    assert v["index_recall@10"] < 0.999
    for name in ("map@10", "mrr@10", "recall@10"):
        assert v[f"absdelta_{name}"] == pytest.approx(abs(v[f"delta_{name}"]), abs=1e-15)
    warned = [r.getMessage() for r in caplog.records if "below --min-recall" in r.getMessage()]
    assert len(warned) == 1
    assert "IVF16,Flat" in warned[0]
    assert "absdelta_" in warned[0]
    hp = json.loads(df["hparams"][0])["index"]
    assert hp["min_recall"] == 0.999
    assert hp["below_min_recall"]["index_recall@10"] == pytest.approx(v["index_recall@10"])
    # probing every list is exact: no warning, no shortfall recorded
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="featcache.retrieval.run"):
        df = run_retrieval(_cfg(digits_cache, tmp_path, index="IVF16,Flat", nprobe=16, recall_queries=200))
    assert not [r for r in caplog.records if "below --min-recall" in r.getMessage()]
    assert "below_min_recall" not in json.loads(df["hparams"][0])["index"]


def test_knn_with_k_covering_the_gallery_is_marked(digits_cache, tmp_path, caplog):
    """k = 1347 on the 1347-row train gallery: every item votes; the row is marked, logged and
    named in the report's notes; k = 5 is not."""
    from featcache.analysis.report import knn_gallery_notes

    cfg = _cfg(digits_cache, tmp_path, knn=True, knn_ks=(5, 1347))
    with caplog.at_level(logging.WARNING, logger="featcache.retrieval.run"):
        df = run_retrieval(cfg)
    knn = df.filter(pl.col("kind") == "knn")
    marks = {json.loads(h)["k"]: json.loads(h).get("k_covers_gallery", False) for h in knn["hparams"]}
    assert marks == {5: False, 1347: True}
    warned = [r.getMessage() for r in caplog.records if "every item votes" in r.getMessage()]
    assert len(warned) == 1
    assert "k=1347" in warned[0]
    notes = knn_gallery_notes(df)
    assert len(notes) == 1
    assert "k=1347" in notes[0]
    assert "class-prior vote" in notes[0]


def _lin_ft_rows() -> pl.DataFrame:
    """4 backbones, one dataset: probe (two protocols) and a scaled-down fine-tune, whose every
    score is below its linear probe (the demo's case)."""
    rows = []
    for b, (lin, ft) in {"l0": (0.86, 0.60), "l1": (0.85, 0.50), "l2": (0.88, 0.55), "r": (0.50, 0.30)}.items():
        common = {"backbone": b, "dataset": "fm", "metric": "top1", "n_eval": 1000, "seed": 0}
        rows += [
            {**common, "protocol": "vtab1k", "value": lin, "kind": "probe", "hparams": "{}"},
            {**common, "protocol": "full", "value": lin + 0.01, "kind": "probe", "hparams": "{}"},
            {**common, "protocol": "vtab1k", "value": ft, "kind": "finetune", "hparams": '{"scaled": true}'},
        ]
    return pl.DataFrame(rows)


def test_the_finetune_answer_states_gains_and_flags_negative_and_scaled(tmp_path):
    from featcache.analysis.report import write_report

    text = write_report(tmp_path / "r.html", _lin_ft_rows(), rank_kwargs={"n_boot": 50}).read_text()
    assert "Mean gain of fine-tuning over the linear probe: l0 -0.260, l1 -0.350, l2 -0.330, r -0.200." in text
    assert "fine-tuning scores below the linear probe for every backbone (negative gain)" in text
    assert "the fine-tune schedule of 1 setting(s) was scaled down" in text
    assert "those settings weigh 33% of the headline z-score" in text  # 1 of 3 ranked settings
    assert '<th class="s">scaled</th>' in text  # the weights and fine-tune tables mark it
    assert "Note: 1 ranked setting(s) ran a scaled-down schedule" in text  # the main headline too
    # the header counts settings and datasets as what they are (was "3 task(s)")
    assert "4 backbone(s), 3 setting(s) on 1 dataset(s)" in text


def test_the_tables_show_the_intervals_the_text_promises(tmp_path):
    from featcache.analysis.report import write_report

    text = write_report(tmp_path / "r.html", _lin_ft_rows(), rank_kwargs={"n_boot": 50}).read_text()
    assert "95% Clopper-Pearson interval" in text
    table = text[text.index('id="probe-table"') :]
    assert "0.8700 [0.8476, 0.8902]" in table  # l0, full: 870 of 1000
