"""Results tables: reads during appends (real processes) and checksums under bit flips
(issue 26 items 2 and 3)."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from featcache.core.results import append_results, check_results_path, read_results
from featcache.errors import CorruptResultsError, ResultsError

N_APPENDERS = 2
APPENDS = 60


def _rows(writer: int, i: int) -> list[dict]:
    return [
        {
            "run_id": f"w{writer}-{i}",
            "kind": "probe",
            "backbone": f"b{writer}",
            "dataset": "digits",
            "protocol": "full",
            "metric": m,
            "value": float(i) / 100,
            "hparams": {"C": 0.1 * i},
        }
        for m in ("top1", "top5")
    ]


def _appender(path: str, writer: int, started) -> None:
    started.wait(timeout=60)
    for i in range(APPENDS):
        append_results(path, _rows(writer, i))


@pytest.mark.slow
def test_reads_during_appends_never_fail(tmp_path):
    """Appender processes replace the table over and over while this process reads it in
    a loop: every read sees one whole table (the figure in docs/store.md)."""
    path = tmp_path / "results.parquet"
    append_results(path, _rows(9, 0))
    ctx = mp.get_context("spawn")
    started = ctx.Barrier(N_APPENDERS + 1)
    procs = [ctx.Process(target=_appender, args=(str(path), w, started)) for w in range(N_APPENDERS)]
    for p in procs:
        p.start()
    started.wait(timeout=60)
    reads, errors, deadline = 0, [], time.monotonic() + 120
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        try:
            df = read_results(path)
            assert df["run_id"].n_unique() * 2 == len(df)  # whole runs only
        except Exception as exc:  # counted, not raised: the figure is errors / reads
            errors.append(f"{type(exc).__name__}: {exc}")
        reads += 1
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * N_APPENDERS
    print(f"{reads} reads during {N_APPENDERS * APPENDS} appends, {len(errors)} errors")
    assert reads >= 50
    assert errors == [], f"{len(errors)} of {reads} reads failed, e.g. {errors[0]}"
    assert len(read_results(path)) == 2 * (1 + N_APPENDERS * APPENDS)


@pytest.fixture
def table(tmp_path) -> Path:
    path = tmp_path / "results.parquet"
    for i in range(4):
        append_results(path, _rows(0, i))
    return path


def test_every_bit_flip_is_named_and_never_rewritten(table):
    """Random single-bit flips anywhere in the file: every one is a CorruptResultsError on
    read, and an append refuses the table and leaves its bytes as they were."""
    good = table.read_bytes()
    rng = np.random.default_rng(0)
    tried = detected = 0
    for _ in range(200):
        data = bytearray(good)
        at = int(rng.integers(len(data)))
        data[at] ^= 1 << int(rng.integers(8))
        table.write_bytes(bytes(data))
        tried += 1
        try:
            read_results(table)
        except CorruptResultsError as exc:
            detected += "Restore it from a copy" in str(exc)
        if tried % 20 == 0:  # the append path reads the same way; check it refuses too
            with pytest.raises(CorruptResultsError):
                append_results(table, _rows(1, 0))
            assert table.read_bytes() == bytes(data)
    table.write_bytes(good)
    assert len(read_results(table)) == 8
    assert (tried, detected) == (200, 200)


def test_damaged_table_refused_before_compute(table):
    data = bytearray(table.read_bytes())
    data[len(data) // 3] ^= 0x10
    table.write_bytes(bytes(data))
    with pytest.raises(CorruptResultsError, match="checksum"):
        check_results_path(table)


def test_table_without_checksum_still_reads_and_gains_one(table):
    """Tables written before checksums (or by hand) are read; the next append adds one."""
    pl.read_parquet(table).write_parquet(table)
    assert len(read_results(table)) == 8
    append_results(table, _rows(1, 0))
    data = bytearray(table.read_bytes())
    data[100] ^= 1
    table.write_bytes(bytes(data))
    with pytest.raises(CorruptResultsError):
        read_results(table)


def test_csv_is_still_not_parquet(tmp_path):
    p = tmp_path / "results.parquet"
    p.write_text("run_id,value\na,1\n")
    with pytest.raises(ResultsError, match="not a parquet") as info:
        read_results(p)
    assert not isinstance(info.value, CorruptResultsError)
