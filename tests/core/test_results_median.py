"""featcache.core.results.median_rows / add_median_rows (shared by probes and fine-tuning) on real
vtab1k probe rows of lite0 digits features: brute-force medians, grouping, carried hparams."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from featcache.core.results import add_median_rows, make_run_id, median_rows, read_results

LITE0 = "tf_efficientnet_lite0"


@pytest.fixture(scope="module")
def seeded(digits_cache):
    from featcache.probes import ProbeConfig, run_probes

    df = run_probes(ProbeConfig(digits_cache, LITE0, "digits", "vtab1k", Cs=[1e-2, 1e-1], progress=False))
    return df.filter(pl.col("seed") >= 0)


def _brute(frame: pl.DataFrame, keys) -> dict:
    out = {}
    for r in frame.iter_rows(named=True):
        out.setdefault((*tuple(r[k] for k in keys), r["metric"]), []).append(r["value"])
    return {k: float(np.median(v)) for k, v in out.items()}


def test_probe_medians_match_the_runner_and_brute_force(seeded, digits_cache):
    from featcache.probes import ProbeConfig, run_probes

    rows = median_rows(seeded, "probe", ("val_source",))
    assert {r["seed"] for r in rows} == {-1}
    assert len(rows) == seeded["metric"].n_unique()
    ids = sorted(seeded["run_id"].unique().to_list())
    assert {r["run_id"] for r in rows} == {make_run_id(kind="probe", aggregate="median", runs=ids)}
    ref = _brute(seeded, ["backbone", "eval_split"])
    for r in rows:
        assert r["value"] == ref[(r["backbone"], r["eval_split"], r["metric"])]
        assert r["hparams"] == {
            "aggregate": "median",
            "seeds": [0, 1, 2],
            "run_ids": ids,
            "val_source": "split-800-200",
        }
        assert r["fit_seconds"] == pytest.approx(seeded.filter(pl.col("metric") == r["metric"])["fit_seconds"].sum())
    # the runner reports exactly these rows
    again = run_probes(ProbeConfig(digits_cache, LITE0, "digits", "vtab1k", Cs=[1e-2, 1e-1], progress=False))
    med = again.filter(pl.col("seed") == -1).sort("metric")
    assert med["value"].to_list() == [r["value"] for r in sorted(rows, key=lambda r: r["metric"])]


def test_groups_by_dataset_and_train_split_and_carries_hparams(seeded):
    def variant(df, **over):
        hp = [json.dumps(dict(json.loads(h), finetune_protocol="vtab1k-light", scaled=True)) for h in df["hparams"]]
        df = df.with_columns(
            pl.Series("hparams", hp),
            pl.lit("finetune").alias("kind"),
            (pl.col("run_id") + "-" + "-".join(over.values())).alias("run_id"),
        )
        return df.with_columns(*[pl.lit(v).alias(k) for k, v in over.items()])

    a = variant(seeded, dataset="digits")
    b = variant(seeded, dataset="digits-b").with_columns(pl.col("value") * 0.5)
    c = variant(seeded, train_split="train[1000]+other")
    c = c.with_columns(pl.when(pl.col("seed") == 0).then(0.0).otherwise(pl.col("value")).alias("value"))
    one = variant(seeded.filter(pl.col("seed") == 0), dataset="one-seed")
    frame = pl.concat([a, b, c, one])
    rows = median_rows(frame, "finetune", ("finetune_protocol", "scaled", "pairs_with"))
    keys = ["dataset", "train_split", "eval_split"]
    ref = _brute(frame.filter(pl.col("dataset") != "one-seed"), keys)
    assert len(rows) == len(ref) == 3 * seeded["metric"].n_unique()
    for r in rows:
        assert r["kind"] == "finetune"
        assert r["seed"] == -1
        assert r["value"] == ref[(r["dataset"], r["train_split"], r["eval_split"], r["metric"])]
        assert r["hparams"]["finetune_protocol"] == "vtab1k-light"
        assert r["hparams"]["scaled"] is True
        assert r["hparams"]["pairs_with"] is None
        assert "val_source" not in r["hparams"]
        assert len(r["hparams"]["run_ids"]) == 3
    assert len({r["run_id"] for r in rows}) == 3


def test_add_median_rows_appends_once(seeded, tmp_path):
    res = tmp_path / "r.parquet"
    out = add_median_rows(seeded, "probe", res, carry=("val_source",))
    n_med = seeded["metric"].n_unique()
    assert out.height == seeded.height + n_med
    add_median_rows(seeded, "probe", res, carry=("val_source",))
    table = read_results(res)
    assert table.height == n_med  # replaced, not duplicated
    assert out.filter(pl.col("seed") == -1).sort("metric")["value"].to_list() == table.sort("metric")["value"].to_list()
    single = seeded.filter(pl.col("seed") == 0)
    assert add_median_rows(single, "probe", None).equals(single)
