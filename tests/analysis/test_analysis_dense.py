"""Dense results in the analysis (analysis/dense.py): the per-task table (mean over seeds, the
headline metric's direction, the recorded interval over images), `featcache rank` and the HTML
report show them beside the other results."""

from __future__ import annotations

import json

import polars as pl
import pytest

from featcache.analysis import write_report
from featcache.analysis.dense import dense_figure, dense_table
from featcache.core.results import append_results, make_run_id, rows_to_frame

BACKBONES = ("lite0", "random0")
#: (protocol, metric -> value per backbone); seg and depth tasks, two seeds for seg-linear
SCORES = {
    ("seg-linear", 0): {"miou": (0.61, 0.32), "macc": (0.70, 0.41), "aacc": (0.90, 0.80)},
    ("seg-linear", 1): {"miou": (0.63, 0.30), "macc": (0.72, 0.39), "aacc": (0.91, 0.79)},
    ("hummingbird", 0): {"hbird_miou": (0.40, 0.45)},
    ("depth-linear", 0): {"rmse": (0.50, 0.30), "delta1": (0.7, 0.8)},
}


def _rows() -> list[dict]:
    rows = []
    for (protocol, seed), metrics in SCORES.items():
        for b, bb in enumerate(BACKBONES):
            ci = [metrics[next(iter(metrics))][b] - 0.05, metrics[next(iter(metrics))][b] + 0.05]
            rid = make_run_id(kind="dense", backbone=bb, protocol=protocol, seed=seed)
            for metric, vals in metrics.items():
                hp = {"views": 4, "ci95": ci} if protocol != "depth-linear" else {"views": 4}
                rows.append(
                    {
                        "run_id": rid,
                        "kind": "dense",
                        "backbone": bb,
                        "dataset": "mosaics",
                        "protocol": protocol,
                        "eval_split": "test",
                        "seed": seed,
                        "metric": metric,
                        "value": vals[b],
                        "hparams": json.dumps(hp),
                    }
                )
    # a probe task, so the ranking has something to rank beside the dense rows
    for b, bb in enumerate(BACKBONES):
        rid = make_run_id(kind="probe", backbone=bb, dataset="digits")
        for ds in ("digits", "mosaics"):
            rows.append(
                {
                    "run_id": rid + ds,
                    "kind": "probe",
                    "backbone": bb,
                    "dataset": ds,
                    "protocol": "full",
                    "eval_split": "test",
                    "metric": "top1",
                    "value": 0.9 - 0.2 * b,
                }
            )
    return rows


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("dense") / "res.parquet"
    append_results(path, _rows())
    return str(path)


def test_the_table_orders_each_task_by_its_headline_metric(results):
    t = dense_table(pl.read_parquet(results))
    seg = t.filter(pl.col("protocol") == "seg-linear")
    assert seg["ranked_by"].unique().to_list() == ["miou"]
    assert seg["backbone"].to_list() == ["lite0", "random0"]  # higher mIoU first
    assert seg["miou"].to_list() == pytest.approx([0.62, 0.31])  # mean over the two seeds
    assert seg["seeds"].to_list() == [2, 2]
    depth = t.filter(pl.col("protocol") == "depth-linear")
    assert depth["backbone"].to_list() == ["random0", "lite0"]  # lower RMSE first
    assert depth["ci95"].to_list() == ["", ""]  # none recorded
    hb = t.filter(pl.col("protocol") == "hummingbird")
    assert hb["ranked_by"].to_list() == ["hbird_miou", "hbird_miou"]
    assert hb["ci95"].to_list() == ["[0.4, 0.5]", "[0.35, 0.45]"]
    assert len(dense_figure(pl.read_parquet(results)).axes) == 3
    assert t.columns[:8] == ["dataset", "protocol", "eval_split", "ranked_by", "backbone", "score", "ci95", "seeds"]
    assert t.columns[8:] == ["miou", "macc", "aacc", "hbird_miou", "rmse", "delta1"]  # the references' order
    assert t["score"].to_list() == [*depth["rmse"], *hb["hbird_miou"], *seg["miou"]]  # tasks sorted by name


def test_no_dense_rows_no_table():
    assert dense_table(None) is None
    assert dense_table(rows_to_frame(_rows()[-2:])) is None


def test_rank_of_dense_rows_only_says_which_metric_to_rank_on(tmp_path, capsys):
    from featcache.cli import main

    path = tmp_path / "dense.parquet"
    append_results(path, [r for r in _rows() if r["kind"] == "dense"])
    assert main(["rank", "--results", str(path), "--out", str(tmp_path / "rank"), "--no-progress"]) == 0
    assert "rank them with --metric miou" in capsys.readouterr().out
    assert main(["rank", "--results", str(path), "--out", str(tmp_path / "r2"), "--metric", "rmse"]) == 0
    assert "random0" in capsys.readouterr().out.split("dense evaluation")[1]
    html = write_report(tmp_path / "r.html", str(path)).read_text()
    assert "the results hold dense rows only" in html
    assert 'id="dense-table"' in html


def test_rank_and_report_show_the_dense_results(results, tmp_path, capsys):
    from featcache.cli import main

    assert main(["rank", "--results", results, "--out", str(tmp_path / "rank"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "dense evaluation" in out
    csv = pl.read_csv(tmp_path / "rank" / "dense.csv")
    assert csv.height == 6
    assert (tmp_path / "rank" / "dense.png").stat().st_size > 0
    html = write_report(tmp_path / "r.html", results).read_text()
    section = html.split('<section id="dense">')[1].split("</section>")[0]
    assert 'id="dense-table"' in section
    assert section.count("<img") == 1
    assert "random0" in section
