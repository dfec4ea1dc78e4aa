"""A search backend is one registration: a module that registers one in ``BACKENDS`` is a
``--backend`` word of ``featcache retrieve`` and searches in :func:`topk`, no other file edited."""

from __future__ import annotations

import argparse
import importlib
import sys

import numpy as np
import pytest

from featcache.errors import DataError
from featcache.retrieval import search
from featcache.retrieval.config import RetrievalConfig, RetrievalConfigError

PLUGIN = """
from featcache.retrieval.search import BACKENDS, SearchBackend, _search_numpy

CALLS = []


def search(Q, G, k, metric, max_memory, bar):
    CALLS.append(k)
    return _search_numpy(Q, G, k, metric, max_memory, bar)


BACKENDS.register("numpy-twin", SearchBackend(search), note="a test's copy of numpy")
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "fc_search_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    with search.BACKENDS.restored():
        yield importlib.import_module("fc_search_plugin")
    sys.modules.pop("fc_search_plugin", None)


def test_a_backend_registered_in_its_own_module_is_a_flag_and_searches(plugin):
    p = argparse.ArgumentParser()
    RetrievalConfig.add_arguments(p)
    argv = "--cache c.zarr --dataset d --query test --gallery train --results r.parquet --all --backend numpy-twin"
    args = p.parse_args(argv.split())
    assert RetrievalConfig.from_args(args).backend == "numpy-twin"
    rng = np.random.default_rng(0)
    Q, G = rng.normal(size=(20, 8)).astype(np.float32), rng.normal(size=(50, 8)).astype(np.float32)
    sc, ix, used = search.topk(Q, G, 5, backend="numpy-twin")
    ref_sc, ref_ix, _ = search.topk(Q, G, 5, backend="numpy")
    assert used == "numpy-twin"
    assert plugin.CALLS
    np.testing.assert_array_equal(ix, ref_ix)
    np.testing.assert_array_equal(sc, ref_sc)


def test_an_unknown_backend_names_the_registered_ones(plugin):
    with pytest.raises(RetrievalConfigError, match="numpy-twin"):
        RetrievalConfig(cache="c.zarr", dataset="d", backend="nmupy-twin")
    with pytest.raises(DataError, match="did you mean 'numpy-twin'"):
        search.choose_backend("numpy-twn")
    with pytest.raises(DataError, match="give a searching one of"):
        search.raw_search(np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32), 1, "cosine", "auto")
