"""``featcache probe --predictions``: each evaluated row's predicted class per run id, on real
lite0 digits features; the table agrees with the run's top-1, a forced re-run replaces its
rows, two protocols compare with McNemar on the same rows, and a bad path fails before a fit."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from featcache.analysis.stats import mcnemar
from featcache.errors import ResultsError
from featcache.probes import ProbeConfig, run_probes
from featcache.probes.predictions import PREDICTION_COLUMNS

LITE0 = "tf_efficientnet_lite0"
GRID = (1e-2, 1.0)


def _cfg(digits_cache, tmp_path, **kw):
    base = {
        "cache": digits_cache,
        "backbones": (LITE0,),
        "dataset": "digits",
        "results_path": str(tmp_path / "r.parquet"),
        "predictions": str(tmp_path / "p.parquet"),
        "Cs": GRID,
        "progress": False,
    }
    return ProbeConfig(**{**base, **kw})


def test_predictions_agree_with_top1_and_force_replaces_them(digits_cache, tmp_path):
    rows = run_probes(_cfg(digits_cache, tmp_path))
    P = pl.read_parquet(tmp_path / "p.parquet")
    assert list(P.columns) == list(PREDICTION_COLUMNS)
    top1 = rows.filter(pl.col("metric") == "top1")
    assert P.height == int(top1["n_eval"][0])
    assert P["id"].n_unique() == P.height
    assert P["run_id"].unique().to_list() == top1["run_id"].to_list()
    assert P["correct"].mean() == pytest.approx(float(top1["value"][0]), abs=1e-12)
    run_probes(_cfg(digits_cache, tmp_path, force=True))  # the same run again: rows replaced
    again = pl.read_parquet(tmp_path / "p.parquet")
    assert again.sort("id").equals(P.sort("id"))


def test_two_protocols_compared_on_the_same_rows(digits_cache, tmp_path):
    run_probes(_cfg(digits_cache, tmp_path))
    run_probes(_cfg(digits_cache, tmp_path, protocol="subset:10%", Cs=None))
    P = pl.read_parquet(tmp_path / "p.parquet")
    a, b = (P.filter(pl.col("protocol") == s).sort("id") for s in ("full", "subset:10%"))
    assert a["id"].to_list() == b["id"].to_list()
    n_a, n_b, p = mcnemar(a["correct"].to_numpy(), b["correct"].to_numpy())
    assert n_a + n_b > 0  # 10% of the training rows cannot classify every test row the same way
    assert n_a == int((a["correct"].to_numpy() & ~b["correct"].to_numpy()).sum())
    assert 0 < p <= 1


@pytest.mark.parametrize(
    ("name", "why"),
    [("dir", "is a folder"), ("p.csv", "does not end in .parquet"), ("r.parquet", "not a predictions table")],
)
def test_bad_predictions_path_fails_before_any_fit(digits_cache, tmp_path, name, why):
    (tmp_path / "dir").mkdir()
    pl.DataFrame({"x": np.arange(3)}).write_parquet(tmp_path / "r.parquet")
    cfg = _cfg(digits_cache, tmp_path, predictions=str(tmp_path / name), results_path=str(tmp_path / "res.parquet"))
    with pytest.raises(ResultsError, match=why):
        run_probes(cfg)
    assert not (tmp_path / "res.parquet").exists()  # nothing was fitted or written


def test_a_rerun_writes_predictions_the_table_lacks(digits_cache, tmp_path):
    """Issue 60: a run in the results table whose predictions are missing (lost to a concurrent
    writer, or --predictions not given the first time) is run again, not skipped as done."""
    first = run_probes(_cfg(digits_cache, tmp_path, predictions=None))
    assert not (tmp_path / "p.parquet").exists()
    again = run_probes(_cfg(digits_cache, tmp_path))
    P = pl.read_parquet(tmp_path / "p.parquet")
    assert P["run_id"].unique().to_list() == first.filter(pl.col("metric") == "top1")["run_id"].to_list()
    assert again.sort("metric")["value"].to_list() == first.sort("metric")["value"].to_list()
    before = (tmp_path / "p.parquet").stat().st_mtime_ns
    run_probes(_cfg(digits_cache, tmp_path))  # both tables hold the run now: skipped
    assert (tmp_path / "p.parquet").stat().st_mtime_ns == before
