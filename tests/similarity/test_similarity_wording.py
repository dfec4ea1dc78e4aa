"""Issue 60's wording of the similarity stage: an N-d kind names the vector kinds it takes,
an absent split names the split asked and those present."""

from __future__ import annotations

import numpy as np
import pytest

from featcache.errors import DataError
from featcache.similarity import SimilarityConfig, run_similarity


@pytest.fixture
def token_store(tmp_path):
    """Two backbones of random ``tokens@2x2`` rows ([60, 4, 8]) on digits/test."""
    from featcache.store import open_cache, write_features

    path = str(tmp_path / "t.zarr")
    rng = np.random.default_rng(0)
    for b in ("a", "b"):
        write_features(
            open_cache(path, "a"),
            backbone=b,
            dataset="digits",
            split="test",
            X=rng.normal(size=(60, 4, 8)).astype(np.float32),
            ids=[f"d{i}" for i in range(60)],
            labels=np.arange(60) % 3,
            class_names=["0", "1", "2"],
            kind="tokens@2x2",
        )
    return path


def test_an_nd_kind_names_the_vector_kinds(token_store):
    """It said "blocks must be [rows, features]"."""
    with pytest.raises(
        DataError,
        match=r"--kind tokens@2x2 holds \[rows, 4, 8\] per image for a; similarity compares "
        r"one vector per image: pass --kind with one of its vector kinds \[\]",
    ):
        run_similarity(SimilarityConfig(cache=token_store, dataset="digits", kind="tokens@2x2"))


def test_an_absent_split_names_the_split_and_those_present(token_store):
    """It said that no backbone held the split and to extract a second backbone."""
    with pytest.raises(
        DataError,
        match=r"no backbone in .* holds split 'tst' of digits \(its splits: \['test'\]\); "
        "pass --split with one of them",
    ):
        run_similarity(SimilarityConfig(cache=token_store, dataset="digits", split="tst"))
