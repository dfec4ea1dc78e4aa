"""Analysis ranks each task on its declared metric (issue 12 item 6): declared_metric_rows
keeps, per run, the row named by hparams["task_metric"] and rank() ranks on it."""

from __future__ import annotations

import numpy as np
import pytest

from featcache.analysis.task_metric import TASK, declared_metric_rows
from featcache.core.results import rows_to_frame
from featcache.errors import ResultsError


def _rows(declared: dict[str, str | None], values: dict[tuple[str, str, str], float]):
    rows = []
    for (b, ds, m), v in values.items():
        hp = {} if declared[ds] is None else {"task_metric": declared[ds]}
        rows.append(
            {
                "run_id": f"{b}-{ds}",
                "kind": "probe",
                "backbone": b,
                "dataset": ds,
                "protocol": "full",
                "train_split": "train",
                "eval_split": "test",
                "shots": -1,
                "seed": 0,
                "metric": m,
                "value": v,
                "n_eval": 100,
                "hparams": hp,
                "converged": True,
                "fit_seconds": 1.0,
                "store_fingerprint": "x",
            }
        )
    return rows_to_frame(rows)


def test_each_task_is_ranked_on_its_declared_metric():
    from featcache.analysis.api import rank

    # aircraft declares mean_per_class: b2 wins on it though b1 has the better top-1;
    # an old table without task_metric (pets) counts as top-1
    vals = {}
    for b, (t1, mpc, pt1, pmpc) in {
        "b1": (0.9, 0.5, 0.7, 0.9),
        "b2": (0.8, 0.7, 0.6, 0.1),
        "b3": (0.1, 0.2, 0.5, 0.5),
    }.items():
        vals |= {
            (b, "aircraft", "top1"): t1,
            (b, "aircraft", "mean_per_class"): mpc,
            (b, "pets", "top1"): pt1,
            (b, "pets", "mean_per_class"): pmpc,
        }
    frame = _rows({"aircraft": "mean_per_class", "pets": None}, vals)
    sel = declared_metric_rows(frame)
    assert sel.height == 6
    assert set(sel["metric"]) == {TASK}
    got = {(r["backbone"], r["dataset"]): (r["task_metric"], r["value"]) for r in sel.iter_rows(named=True)}
    assert got[("b2", "aircraft")] == ("mean_per_class", 0.7)
    assert got[("b1", "pets")] == ("top1", 0.7)
    out = rank(sel, metric=TASK, n_boot=20, plots=False)
    scores = {r["backbone"]: r for r in out["scores"].iter_rows(named=True)}
    assert scores["b2"]["probe:aircraft"] == 0.7
    assert scores["b1"]["probe:aircraft"] == 0.5
    assert scores["b1"]["probe:pets"] == 0.7
    mean = dict(zip(out["overall"]["backbone"].to_list(), out["overall"]["mean"].to_list()))
    assert mean["b2"] == pytest.approx(np.mean([0.7, 0.6]))
    assert mean["b1"] == pytest.approx(np.mean([0.5, 0.7]))


def test_a_run_without_its_declared_metric_row_is_an_error():
    frame = _rows({"voc": "map11"}, {("b1", "voc", "top1"): 0.5})
    with pytest.raises(ResultsError, match="declared metric"):
        declared_metric_rows(frame)


def test_rank_auto_ranks_declared_metrics_else_top1():
    """metric='auto' (the CLI default): declared metrics when the results record them (an
    external table counts as top-1), else exactly the top-1 ranking."""
    import polars as pl

    from featcache.analysis.api import rank

    vals = {}
    for b, (t1, mpc, pt1, pmpc) in {
        "b1": (0.9, 0.5, 0.7, 0.9),
        "b2": (0.8, 0.7, 0.6, 0.1),
        "b3": (0.1, 0.2, 0.5, 0.5),
    }.items():
        vals |= {
            (b, "aircraft", "top1"): t1,
            (b, "aircraft", "mean_per_class"): mpc,
            (b, "pets", "top1"): pt1,
            (b, "pets", "mean_per_class"): pmpc,
        }
    ext = pl.DataFrame(
        {
            "backbone": ["b1", "b2", "b3"],
            "dataset": ["ext"] * 3,
            "metric": ["top1"] * 3,
            "value": [0.3, 0.2, 0.1],
            "kind": ["probe"] * 3,
        }
    )

    def scores(frame, metric, external=()):
        out = rank(frame, external, metric=metric, n_boot=20, plots=False)
        return out["metric"], {r["backbone"]: r for r in out["scores"].iter_rows(named=True)}

    metric, got = scores(_rows({"aircraft": "mean_per_class", "pets": None}, vals), "auto", [ext])
    assert metric == TASK
    assert got["b2"]["probe:aircraft"] == 0.7
    assert got["b1"]["probe:pets"] == 0.7
    assert got["b1"]["probe:ext"] == 0.3
    plain = _rows({"aircraft": None, "pets": None}, vals)
    metric, got = scores(plain, "auto")
    assert metric == "top1"
    assert got == scores(plain, "top1")[1]
    assert got["b1"]["probe:aircraft"] == 0.9
