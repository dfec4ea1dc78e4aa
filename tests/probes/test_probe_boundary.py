"""Issue 60: the probe's flags at the boundary: a protocol refuses another protocol's flag
in words about the protocol the user named; a batch larger than the data is capped."""

from __future__ import annotations

import pytest

from featcache.errors import ProbeError
from featcache.probes import ProbeConfig


@pytest.mark.parametrize("protocol", ["attentive:vjepa", "attentive:aim"])
@pytest.mark.parametrize(("option", "flag"), [("batch_size", "--batch-size"), ("epoch_length", "--epoch-length")])
def test_a_flag_of_another_protocol_is_refused_about_the_protocol_named(protocol, option, flag):
    with pytest.raises(ProbeError) as err:
        ProbeConfig(
            "c.zarr", ("a",), "d", protocol, kind="tokens@2x2", results_path="r.parquet", **{option: 64}
        ).resolve()
    msg = str(err.value)
    assert msg.startswith(f"--protocol {protocol} does not take {flag}: it fixes its own batches and schedule")
    assert f"drop {flag}" in msg
    assert "solver's options" not in msg  # the old wording, about dinov2-linear's schedule


def test_batch_cap_keeps_a_batch_within_the_data():
    from featcache.probes.runner import _cap_batch

    opts = {"batch_size": 10**9, "metric": "top1"}
    assert _cap_batch(opts, 270, "b") == (
        {"batch_size": 270, "metric": "top1"},
        {"batch_size_given": 10**9, "batch_size": 270},
    )
    assert _cap_batch({"batch_size": 64}, 270, "b") == ({"batch_size": 64}, {})
    assert _cap_batch({"Cs": [1.0]}, 270, "b") == ({"Cs": [1.0]}, {})


LITE0 = "tf_efficientnet_lite0"
HOLD = """
import sys, time, filelock
lock = filelock.FileLock(sys.argv[1], thread_local=False)
lock.acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_a_split_another_job_writes_is_named_as_such(digits_cache, tmp_path):
    """The probe said to re-run the extract when another job held the store's writer lock."""
    import os
    import shutil
    import subprocess
    import sys

    from featcache.probes.runner import _writer_busy
    from featcache.store import open_cache
    from featcache.store.locks import LOCK_DIR

    path = str(tmp_path / "s.zarr")
    shutil.copytree(digits_cache, path)
    cache = open_cache(path)
    assert _writer_busy(cache, LITE0, "digits") is None
    lock = os.path.join(path, LOCK_DIR, f"features~{LITE0}~digits~test.lock")
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, lock], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert _writer_busy(cache, LITE0, "digits") == "test"
    finally:
        proc.kill()
        proc.wait()
    assert _writer_busy(cache, LITE0, "digits") is None


def test_with_all_a_busy_backbone_is_skipped_and_the_others_probed(monkeypatch, caplog):
    from featcache.errors import IncompleteStoreError, StoreBusyError
    from featcache.probes import runner

    def load(caches, b, cfg, proto):
        if b == "busy":
            raise IncompleteStoreError("busy/d/train is incomplete: re-run the same `featcache extract` command")
        return f"data of {b}"

    monkeypatch.setattr(runner, "_load_backbone", load)
    monkeypatch.setattr(runner, "cache_for", lambda caches, b, ds: None)
    monkeypatch.setattr(runner, "_writer_busy", lambda cache, b, ds: "train" if b == "busy" else None)
    every = ProbeConfig("c.zarr", "all", "d", results_path="r.parquet")
    with caplog.at_level("WARNING"):
        assert runner._load_all([], ["busy", "b"], every, None) == {"b": "data of b"}
    assert "busy/d/train is being written by another job" in caplog.text
    assert "skipped, the other backbones are probed" in caplog.text
    named = ProbeConfig("c.zarr", ("busy", "b"), "d", results_path="r.parquet")
    with pytest.raises(StoreBusyError, match=r"busy/d/train is being written by another job .* run the probe again"):
        runner._load_all([], ["busy", "b"], named, None)


def test_an_attentive_probe_on_a_store_without_tokens_says_how_to_add_them(tmp_path):
    """Issue 60: the refusal names the kinds present and the extract that adds tokens."""
    import numpy as np

    from featcache.probes import run_probes
    from featcache.store import open_cache, write_features

    cache = str(tmp_path / "c.zarr")
    rng = np.random.default_rng(0)
    for split, n in (("train", 30), ("test", 15)):
        X = rng.normal(size=(n, 4)).astype(np.float32)
        ids = [f"{split}{i}" for i in range(n)]
        write_features(
            open_cache(cache, "a"), backbone="pix", dataset="toy", split=split, X=X, ids=ids, labels=np.arange(n) % 3
        )
    from featcache.errors import NotInStoreError

    with pytest.raises(NotInStoreError, match=r"kinds present: \['pooled'\]; add it with `featcache extract`") as err:
        run_probes(ProbeConfig(cache, ("pix",), "toy", "attentive:vjepa", progress=False))
    assert "--features pooled,tokens" in str(err.value)
    assert "--overwrite, or into another --backbone-name" in str(err.value)
