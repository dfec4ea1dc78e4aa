"""rank --index-effect: Kendall tau-b of the backbones' scores under an approximate index
against exact search, per retrieval setting, from the results table alone."""

from __future__ import annotations

import itertools
import json

import numpy as np
import polars as pl
import pytest

from featcache.analysis.index_effect import index_rank_change
from featcache.errors import ResultsError


def _rows(scores: dict[str, float], index: str | None) -> list[dict]:
    hp = {} if index is None else {"index": {"factory": index, "requested": index}}
    return [
        {
            "kind": "retrieval",
            "backbone": b,
            "dataset": "d",
            "protocol": "semantic",
            "train_split": "train",
            "eval_split": "test",
            "metric": "map@10",
            "value": v,
            "hparams": json.dumps(hp),
        }
        for b, v in scores.items()
    ]


def _tau(x, y) -> float:
    """Brute force (no ties): (concordant - discordant) / pairs."""
    s = [np.sign(x[i] - x[j]) * np.sign(y[i] - y[j]) for i, j in itertools.combinations(range(len(x)), 2)]
    return float(np.mean(s))


def test_index_rank_change_tau_and_verdict():
    exact = {"a": 0.9, "b": 0.8, "c": 0.7, "d": 0.6}
    same = {"a": 0.85, "b": 0.7, "c": 0.69, "d": 0.5}  # lower, same order
    swapped = {"a": 0.7, "b": 0.8, "c": 0.65, "d": 0.66}  # a<->b and c<->d swapped
    df = pl.DataFrame(_rows(exact, None) + _rows(same, "HNSW32") + _rows(swapped, "IVF16,PQ8"))
    out = index_rank_change(df, "map@10").sort("index")
    assert out["index"].to_list() == ["HNSW32", "IVF16,PQ8"]
    b = sorted(exact)
    for r, sc in zip(out.iter_rows(named=True), (same, swapped)):
        assert r["kendall_tau"] == pytest.approx(_tau([exact[k] for k in b], [sc[k] for k in b]))
    assert out["ranking_changed"].to_list() == [False, True]
    assert out["index_order"][1] == "b > a > d > c"


def test_index_rank_change_needs_exact_rows():
    df = pl.DataFrame(_rows({"a": 0.5, "b": 0.4}, "HNSW32"))
    with pytest.raises(ResultsError, match="no exact rows"):
        index_rank_change(df, "map@10")
    with pytest.raises(ResultsError, match="no retrieval rows"):
        index_rank_change(df, "map")
