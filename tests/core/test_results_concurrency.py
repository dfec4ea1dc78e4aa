"""featcache.core.results under concurrent writers and bad paths (issue 13 item 3, issue 14 item 7)."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import polars as pl
import pytest

from featcache.core.results import (
    RESULT_COLUMNS,
    append_results,
    check_results_path,
    existing_run_ids,
    read_results,
)
from featcache.errors import ResultsError

N_WRITERS = 4
N_REPS = 20
RUNS_PER_APPEND = 3


def _rows(writer: int, rep: int, run: int) -> list[dict]:
    rid = f"w{writer}-r{rep}-run{run}"
    return [
        {
            "run_id": rid,
            "kind": "probe",
            "backbone": f"b{writer}",
            "dataset": "d",
            "metric": m,
            "value": float(writer * 1000 + rep * 10 + run),
            "seed": run,
        }
        for m in ("top1", "top5")
    ]


def _writer(root: str, writer: int, barrier) -> None:
    for rep in range(N_REPS):
        target = Path(root) / f"rep{rep}" / "results.parquet"
        barrier.wait(timeout=60)
        for run in range(RUNS_PER_APPEND):
            append_results(target, _rows(writer, rep, run))
        # every writer also (re)writes one shared run: it must end up exactly once
        append_results(target, _rows(99, rep, 0), replace_runs=True)


@pytest.mark.slow
def test_concurrent_appends_lose_no_rows(tmp_path):
    """4 processes append into the same table at once, 20 repetitions (the "Must show"
    figure): every row present exactly once, the shared run once."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(N_WRITERS)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, barrier)) for w in range(N_WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0] * N_WRITERS
    lost = dup = 0
    for rep in range(N_REPS):
        df = read_results(tmp_path / f"rep{rep}" / "results.parquet")
        expected = {
            (r["run_id"], r["metric"])
            for w in range(N_WRITERS)
            for run in range(RUNS_PER_APPEND)
            for r in _rows(w, rep, run)
        }
        expected |= {(r["run_id"], r["metric"]) for r in _rows(99, rep, 0)}
        got = list(zip(df["run_id"].to_list(), df["metric"].to_list()))
        lost += len(expected - set(got))
        dup += len(got) - len(set(got))
        assert set(got) <= expected
        assert not list((tmp_path / f"rep{rep}").glob("*.tmp"))
    assert (lost, dup) == (0, 0)


def test_existing_csv_is_refused_and_untouched(tmp_path):
    csv = tmp_path / "results.csv"
    csv.write_text("run_id,value\na,1\n")
    with pytest.raises(ResultsError, match="not a parquet file"):
        check_results_path(csv)
    with pytest.raises(ResultsError, match="not a parquet file"):
        append_results(csv, _rows(0, 0, 0))
    assert csv.read_text() == "run_id,value\na,1\n"
    other = tmp_path / "results.parquet"
    other.write_bytes(b"not parquet at all")
    with pytest.raises(ResultsError, match="not a parquet file"):
        check_results_path(other)
    with pytest.raises(ResultsError, match=r"ends in '\.csv'"):
        check_results_path(tmp_path / "new.csv")


def test_parquet_without_schema_is_refused(tmp_path):
    p = tmp_path / "other.parquet"
    pl.DataFrame({"a": [1]}).write_parquet(p)
    with pytest.raises(ResultsError, match="missing columns"):
        check_results_path(p)


def test_parent_is_a_file_or_path_is_a_folder(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ResultsError, match="is a file, not a folder"):
        check_results_path(f / "sub" / "results.parquet")
    with pytest.raises(ResultsError, match="is a folder"):
        check_results_path(tmp_path)


def test_unwritable_folder_is_refused(tmp_path):
    # root ignores permission bits, so use a folder no one can create files in
    target = Path("/proc/featcache-results.parquet") if os.path.isdir("/proc") else None
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        target = ro / "results.parquet"
    if target is None:
        pytest.skip("no unwritable folder available")
    with pytest.raises(ResultsError, match="cannot write results"):
        check_results_path(target)


def test_missing_parents_are_created(tmp_path):
    p = check_results_path(tmp_path / "a" / "b" / "results.parquet")
    assert p.parent.is_dir()
    assert not p.exists()
    assert not list(p.parent.iterdir())  # the write probe leaves nothing behind


def test_extra_user_columns_survive_appends(tmp_path):
    p = tmp_path / "results.parquet"
    append_results(p, _rows(0, 0, 0))
    df = pl.read_parquet(p).with_columns(pl.lit("mine").alias("note"))
    df.write_parquet(p)
    append_results(p, _rows(1, 0, 0))
    out = read_results(p, extra_columns=True)
    assert out.columns == [*RESULT_COLUMNS, "note"]
    assert out.filter(pl.col("backbone") == "b0")["note"].to_list() == ["mine", "mine"]
    assert out.filter(pl.col("backbone") == "b1")["note"].to_list() == [None, None]
    assert read_results(p).columns == list(RESULT_COLUMNS)
    assert existing_run_ids(p) == {"w0-r0-run0", "w1-r0-run0"}


def test_orphan_temp_files_are_cleaned_on_next_write(tmp_path):
    p = tmp_path / "results.parquet"
    append_results(p, _rows(0, 0, 0))
    orphan = tmp_path / ".results.parquet.abc123.tmp"  # what a kill -9 mid-append leaves
    orphan.write_bytes(b"partial")
    unrelated = tmp_path / ".other.parquet.x.tmp"
    unrelated.write_bytes(b"")
    append_results(p, _rows(1, 0, 0))
    assert not orphan.exists()
    assert unrelated.exists()
    assert len(read_results(p)) == 4


@pytest.mark.parametrize(
    "command",
    [
        ["probe", "--cache", "CACHE", "--backbone", "b", "--dataset", "digits"],
        [
            "retrieve",
            "--cache",
            "CACHE",
            "--backbone",
            "b",
            "--dataset",
            "digits",
            "--query",
            "test",
            "--gallery",
            "train",
        ],
        ["finetune", "--model", "tf_efficientnet_lite0", "--data", "CACHE"],
    ],
)
def test_commands_refuse_a_bad_results_path_before_computing(tmp_path, capsys, command):
    from featcache.cli import main

    csv = tmp_path / "results.csv"
    csv.write_text("a,b\n1,2\n")
    cmd = [str(tmp_path / "no-such-store.zarr") if a == "CACHE" else a for a in command]
    assert main([*cmd, "--results", str(csv)]) == 1  # the store is never opened
    assert "not a parquet file" in capsys.readouterr().err
    assert csv.read_text() == "a,b\n1,2\n"
