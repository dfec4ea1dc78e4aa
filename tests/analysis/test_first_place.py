"""One verdict on first place (issue 49 item 2): separated only where the paired interval of
(first - runner-up) excludes 0 with each setting's test-set noise counted; the report's
headline and its certainty plot read the same numbers. Constructed tables whose answer is
known: a clear winner, a tie, a gap at the level of the test-set noise."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from featcache.analysis import api
from featcache.analysis.first_place import first_place
from featcache.analysis.report import first_place_verdict

BACKBONES = ("w", "x", "y", "z")


def _table(scores: dict[str, list[float]], datasets: list[str], n_eval: int | None) -> pl.DataFrame:
    """Probe top-1 rows: ``scores[backbone][j]`` on setting j (dataset ``datasets[j]``, its own
    protocol so one dataset can hold several settings)."""
    rows = [
        {
            "backbone": b,
            "dataset": d,
            "protocol": f"fewshot:{j + 2}",
            "metric": "top1",
            "value": v,
            "kind": "probe",
            "n_eval": n_eval,
            "seed": 0,
        }
        for b, vs in scores.items()
        for j, (d, v) in enumerate(zip(datasets, vs, strict=True))
    ]
    return pl.DataFrame(rows)


def _noise_level_gap(n_eval: int) -> pl.DataFrame:
    """The demo's case: 5 settings of one dataset, the first two 0.866 / 0.853 (+-0.004), the
    others well below; on 1,000 test images their Clopper-Pearson intervals overlap widely."""
    jitter = np.array([0.0, 0.002, -0.002, 0.004, -0.004])
    base = {"w": 0.866, "x": 0.853, "y": 0.70, "z": 0.55}
    return _table({b: list(v + jitter) for b, v in base.items()}, ["digits"] * 5, n_eval)


def test_a_clear_winner_is_separated():
    """Three datasets, the first 0.05 ahead everywhere on 10,000 test rows each."""
    df = _table({b: [0.9 - 0.05 * i] * 3 for i, b in enumerate(BACKBONES)}, ["a", "b", "c"], 10_000)
    fp = api.rank(df, n_boot=400).first_place
    assert (fp.best, fp.runner_up, fp.separated) == ("w", "x", True)
    assert fp.table["separated"].to_list() == [True, True, True]
    assert fp.n_datasets == 3
    assert "choice of settings" in fp.covers
    assert "is separated" in first_place_verdict(fp)


def test_a_tie_is_not_separated():
    """Two backbones with the same scores everywhere: the lead is 0 and its interval holds 0."""
    scores = {"w": [0.9, 0.8, 0.7], "x": [0.9, 0.8, 0.7], "y": [0.6, 0.5, 0.4], "z": [0.5, 0.4, 0.3]}
    fp = api.rank(_table(scores, ["a", "b", "c"], 2_000), n_boot=400).first_place
    row = fp.table.row(0, named=True)
    assert row["diff"] == pytest.approx(0.0, abs=1e-12)
    assert row["lo"] < 0 < row["hi"]
    assert not fp.separated
    assert "is not separated" in first_place_verdict(fp)


def test_a_gap_at_the_test_noise_level_is_not_separated_and_says_one_dataset():
    """0.866 vs 0.853 on 1,000 test images, 5 settings of one dataset: the settings bootstrap
    alone called this separated (every setting agrees); with the test-set noise it is not. The
    same gap on a million test rows is separated: the noise, not the gap, decides."""
    r = api.rank(_noise_level_gap(1_000), n_boot=1000)
    fp = r.first_place
    assert (fp.best, fp.runner_up) == ("w", "x")
    assert not fp.separated
    assert fp.n_datasets == 1
    assert fp.covers.endswith("; with one dataset the settings are not resampled")
    text = first_place_verdict(fp)
    assert "With one dataset the intervals cover its test-set noise only" in text
    # the settings-only bootstrap (no test noise) separates them: the two verdicts of before
    d = r.differences.filter((pl.col("aggregation") == "zscore") & (pl.col("a") == "w") & (pl.col("b") == "x"))
    assert d["lo"][0] > 0
    assert api.rank(_noise_level_gap(1_000_000), n_boot=1000).first_place.separated


def test_without_n_eval_the_verdict_says_it_counts_no_test_noise():
    """No test-set sizes: across datasets the settings are still resampled; within one dataset
    nothing is, and the verdict says first place cannot be judged (never "separated")."""
    df = _table({b: [0.9 - 0.05 * i] * 3 for i, b in enumerate(BACKBONES)}, ["a", "b", "c"], None)
    fp = api.rank(df, n_boot=200).first_place
    assert fp.noisy_settings == 0
    assert fp.covers.startswith("no test-set noise")
    fp = api.rank(_noise_level_gap(1_000).with_columns(pl.lit(None, pl.Int64).alias("n_eval")), n_boot=200).first_place
    assert fp.covers.startswith("nothing: one dataset")
    assert not fp.separated
    assert "cannot be judged" in first_place_verdict(fp)


def test_first_place_is_seeded_and_checks_its_input():
    values = np.array([[0.9, 0.8], [0.85, 0.7], [0.5, 0.4]])
    n = np.full(values.shape, 500.0)
    kw = {"n_eval": n, "datasets": ["a", "b"], "n_boot": 200}
    a = first_place(values, ["p", "q", "r"], ["p", "q", "r"], seed=3, **kw).table
    b = first_place(values, ["p", "q", "r"], ["p", "q", "r"], seed=3, **kw).table
    assert a.equals(b)
    from featcache.errors import ResultsError

    with pytest.raises(ResultsError, match="n_eval has shape"):
        first_place(values, ["p", "q", "r"], ["p", "q", "r"], n_eval=n[:, :1])


def test_the_headline_and_the_plot_read_the_same_numbers(tmp_path, monkeypatch):
    """The report's headline states the interval the certainty plot draws (one table)."""
    from featcache.analysis import plots
    from featcache.analysis.report import write_report

    seen = {}
    real = plots.best_vs_rest

    def spy(differences, best, path, **kw):
        seen["table"], seen["best"] = differences, best
        return real(differences, best, path, **kw)

    monkeypatch.setattr(plots, "best_vs_rest", spy)
    df = _noise_level_gap(1_000)
    text = write_report(tmp_path / "r.html", df, rank_kwargs={"n_boot": 300}).read_text()
    fp = api.rank(df, n_boot=300).first_place
    assert seen["best"] == "w"
    assert seen["table"].equals(fp.table)
    row = fp.table.row(0, named=True)
    assert f"[{row['lo']:+.2f}, {row['hi']:+.2f}]" in text
    assert "is not separated" in text
    assert "the data do not separate them clearly" not in text  # the marginal-interval verdict is gone
