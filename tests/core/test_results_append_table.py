"""The one locked, atomic append (:func:`featcache.core.results.append_table`) under concurrent
writer processes on a large existing table (issue 60): no writer loses rows, whatever the
table (results or ``probe --predictions``), and a file that is not the caller's table is
never replaced."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from featcache.core.results import append_results, append_table, read_results, rows_to_frame
from featcache.errors import ResultsError
from featcache.probes.predictions import prediction_frame, read_predictions, write_predictions

BIG = 200_000  # rows already in the table: each read-modify-replace takes a while
APPENDS = 3  # appends per writer


def _pred(run: str, n: int = 500) -> pl.DataFrame:
    ids = np.array([f"x{i}" for i in range(n)])
    return prediction_frame(run, "b", "full", 0, "test", ids, ids, ids)


def _result_rows(run: str) -> pl.DataFrame:
    return rows_to_frame(
        [{"run_id": run, "kind": "probe", "backbone": "b", "dataset": "d", "metric": m, "value": 0.5} for m in "ab"]
    )


def _big_results(p: Path) -> None:
    n = BIG // 2
    base = rows_to_frame([{"run_id": "r", "kind": "probe", "backbone": "b", "dataset": "d", "metric": "a", "value": 0}])
    big = pl.concat([base] * n).with_columns(
        pl.Series("run_id", [f"old{i}" for i in range(n)]), pl.Series("value", np.arange(n, dtype=float))
    )
    append_results(p, big)


def _writer(table: str, path: str, w: int, barrier) -> None:
    barrier.wait(timeout=60)
    for a in range(APPENDS):
        run = f"w{w}-a{a}"
        if table == "predictions":
            write_predictions(path, [_pred(run)])
        else:
            append_results(path, _result_rows(run))


def _race(table: str, path: Path, n_writers: int) -> None:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n_writers)
    procs = [ctx.Process(target=_writer, args=(table, str(path), w, barrier)) for w in range(n_writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * n_writers


def _expected(n_writers: int) -> set[str]:
    return {f"w{w}-a{a}" for w in range(n_writers) for a in range(APPENDS)}


@pytest.mark.parametrize("n_writers", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_concurrent_prediction_writers_lose_no_rows(tmp_path, n_writers):
    """Two probes writing one large --predictions table at once (issue 60: one run's
    predictions were gone 3 times in 3): every writer's rows and every earlier row stay."""
    p = tmp_path / "p.parquet"
    write_predictions(p, [_pred(f"old{i}", 1000) for i in range(BIG // 1000)])
    _race("predictions", p, n_writers)
    got = read_predictions(p)
    runs = set(got["run_id"].unique().to_list())
    assert _expected(n_writers) <= runs
    assert len(runs) == BIG // 1000 + n_writers * APPENDS
    assert got.height == BIG + n_writers * APPENDS * 500
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("n_writers", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_concurrent_result_writers_lose_no_rows(tmp_path, n_writers):
    p = tmp_path / "r.parquet"
    _big_results(p)
    _race("results", p, n_writers)
    got = read_results(p)
    assert got.height == BIG // 2 + n_writers * APPENDS * 2
    assert _expected(n_writers) <= set(got["run_id"].to_list())


def test_prediction_writes_clean_a_killed_writers_temporary_file(tmp_path):
    p = tmp_path / "p.parquet"
    write_predictions(p, [_pred("a")])
    orphan = tmp_path / ".p.parquet.k1ll3d.tmp"  # what a probe killed mid-write leaves
    orphan.write_bytes(b"partial")
    other = tmp_path / ".q.parquet.x.tmp"
    other.write_bytes(b"")
    write_predictions(p, [_pred("b")])
    assert not orphan.exists()
    assert other.exists()
    assert set(read_predictions(p)["run_id"].to_list()) == {"a", "b"}


def test_a_table_the_reader_refuses_is_never_replaced(tmp_path):
    """append_table reads what it would replace, under the lock: a results table swapped in
    where predictions were expected stays as it was."""
    p = tmp_path / "p.parquet"
    append_results(p, _result_rows("mine"))
    before = p.read_bytes()
    with pytest.raises(ResultsError, match="not a predictions table"):
        append_table(p, _pred("x"), read=read_predictions, keys=("run_id",))
    assert p.read_bytes() == before


def test_predictions_path_equal_to_the_results_path_is_refused(tmp_path):
    from featcache.probes.predictions import check_predictions_path

    with pytest.raises(ResultsError, match="is the results table"):
        check_predictions_path(tmp_path / "r.parquet", tmp_path / "." / "r.parquet")
    assert not (tmp_path / "r.parquet").exists()
