"""The model-source contract in other processes, for every registered source (and an
nn.Module object): an extraction SIGKILLed mid-way then resumed, and a two-rank torchrun run,
each byte-identical to an uninterrupted single-process run of the same source."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("open_clip")
pytest.importorskip("transformers")

import model_source_fixtures as M
from kill9 import chunk_bytes, group_arrays, kill_when, marked_chunks

from featcache.extract import extract
from featcache.models.sources import list_sources

GROUP = "features/bb/digits/test"
N_CHUNKS = M.ROWS // M.CHUNK
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    a = M.make_assets(tmp_path_factory.mktemp("assets"))
    M.activate(a)
    yield a
    sys.path.remove(a["usermods"])
    sys.modules.pop("featcache_user_net", None)


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """source -> an uninterrupted single-process store of the contract's rows."""
    import torch

    root, n = tmp_path_factory.mktemp("reference"), torch.get_num_threads()
    out = {}
    for s in M.PROCESS_SOURCES:
        out[s] = root / f"{s}.zarr"
        extract(M.source_config(s, assets, str(out[s])))
    torch.set_num_threads(n)
    return out


def _same_store(got: Path, want: Path) -> None:
    a, b = group_arrays(got / GROUP), group_arrays(want / GROUP)
    for k in b:
        np.testing.assert_array_equal(a[k], b[k])
    assert chunk_bytes(got / GROUP) == chunk_bytes(want / GROUP)  # byte-identical chunk objects


def test_every_registered_source_runs_in_processes():
    assert set(list_sources()) <= set(M.PROCESS_SOURCES)


@pytest.fixture(scope="module")
def forkserver():
    """Children forked from one server that imported the libraries once (a plain subprocess
    would import torch, timm, open_clip and transformers per kill)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "torch",
            "torchvision.models",
            "timm",
            "open_clip",
            "transformers",
            "sklearn.datasets",
            "featcache.extract.pipeline",
            *(f"featcache.models.sources.{s}_source" for s in ("torchvision", "open_clip", "hf", "python")),
        ]
    )
    return ctx


@pytest.mark.slow
@pytest.mark.parametrize("source", M.PROCESS_SOURCES)
def test_kill9_mid_extraction_then_resume_is_byte_identical(source, assets, reference, forkserver, tmp_path):
    import torch

    cache = tmp_path / "killed.zarr"
    pause = 0.2  # before each batch: 6 chunks of one batch take >= 1.2 s
    p = forkserver.Process(target=M.extract_slowly, args=(source, assets, str(cache), pause))
    p.start()
    marked = kill_when(p, lambda: marked_chunks(cache / GROUP), 2, random.uniform(0, pause))
    assert 2 <= marked < N_CHUNKS
    n = torch.get_num_threads()
    (rep,) = extract(M.source_config(source, assets, str(cache)))
    torch.set_num_threads(n)
    assert rep.chunks_computed == N_CHUNKS - marked  # only the unfinished chunks
    _same_store(cache, reference[source])


@pytest.fixture(scope="module")
def torchrun_stores(assets, tmp_path_factory):
    """One two-rank torchrun job (gloo, CPU) extracting every source in turn."""
    root = tmp_path_factory.mktemp("torchrun")
    (root / "assets.json").write_text(json.dumps(assets))
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", M.__file__, str(root / "assets.json"), str(root)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    for r in (0, 1):
        assert log.count(f"rank {r} computes 3 of the 6 pending chunks") == len(M.PROCESS_SOURCES), log[-4000:]
    return root


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")
@pytest.mark.parametrize("source", M.PROCESS_SOURCES)
def test_torchrun_two_ranks_equal_single_process(source, torchrun_stores, reference):
    _same_store(torchrun_stores / f"{source}.zarr", reference[source])
