"""The similarity tests' store: the digits store with a second backbone (lite0 with random:0
weights), shared by the stage's tests and the measures' contract."""

from __future__ import annotations

import shutil

import pytest

LITE0 = "tf_efficientnet_lite0"  # the conftest session stores' backbone
FIXTURE_INPUT_SIZE = 112  # their input size (tests/conftest.py)
RANDOM = f"{LITE0}@random0"


@pytest.fixture(scope="session")
def two_backbones(digits_cache, tmp_path_factory) -> str:
    """A copy of the digits store with a second backbone: lite0 with random:0 weights (test split)."""
    from featcache.extract import ExtractConfig, extract

    path = str(tmp_path_factory.mktemp("sim") / "digits2.zarr")
    shutil.copytree(digits_cache, path)
    extract(
        ExtractConfig(
            LITE0,
            "random:0",
            "digits",
            ["test"],
            path,
            input_size=FIXTURE_INPUT_SIZE,
            batch_size=64,
            workers=1,
            progress=False,
            chunk_rows=128,
            amp="fp32",  # the same features on every CPU: the measures' values are pinned on them
        )
    )
    return path
