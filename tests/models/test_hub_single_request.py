"""timm's and open_clip's own downloads, downloads on, against a hub in trouble (issue 50: they
retried for about a minute and ended in a sentence cut mid-way with no hint of ``--offline``).
featcache asks the hub once first (``hub.check_reachable``): one request, then one whole line
naming the hub, ``fetch-weights`` and ``--offline``.

Each case runs ``featcache fetch-weights`` in a fresh process whose environment points
huggingface_hub at a loopback hub (``HF_ENDPOINT``), as a user's would: huggingface_hub builds
its download URLs from a template it formats with ``HF_ENDPOINT`` when it is imported
(``constants.HUGGINGFACE_CO_URL_TEMPLATE``), so an endpoint changed inside a running process
(``monkeypatch`` of ``constants.ENDPOINT``) is not where its requests go. The loopback hub
counts the requests it gets; without the single request first, huggingface_hub's backoff asks
14 times (measured: ~60 s) before the library gives up."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

from model_source_fixtures import HubServer

CASES = {
    "timm": ("test_vit.r160_in1k", "pretrained", "/timm/test_vit.r160_in1k/resolve/"),
    "open_clip": ("open_clip:ViT-B-32", "laion2b_s34b_b79k", "/laion/CLIP-ViT-B-32-laion2B-s34B-b79K/resolve/"),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["500", "close"])
@pytest.mark.parametrize("library", list(CASES))
def test_a_hub_in_trouble_is_asked_once_then_one_line_with_offline(tmp_path, library, fault):
    if library == "open_clip":
        pytest.importorskip("open_clip")
    model, weights, resolve = CASES[library]
    (tmp_path / "f").write_bytes(b"x")
    manifest = tmp_path / "m.json"
    with HubServer("featcache-test/none", {"f": tmp_path / "f"}, hashlib.sha1(b"none").hexdigest()) as srv:
        srv.status = 500 if fault == "500" else "close"  # every request answered 500, or closed unanswered
        env = {
            **os.environ,
            "HF_ENDPOINT": srv.url,
            "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
            "TORCH_HOME": str(tmp_path / "torch"),
        }
        env.pop("HF_HUB_OFFLINE", None)
        argv = ["fetch-weights", "--model", model, "--weights", weights, "--manifest", str(manifest)]
        code = f"from featcache.cli import main; raise SystemExit(main({argv!r}))"
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    asked = [r for r in srv.requests if resolve in r]  # huggingface_hub's own registry fetch aside
    assert p.returncode == 1, p.stderr
    assert len(asked) == 1, asked  # before: 14 for a 500 (a minute of backoff), 2-3 for a closed connection
    assert asked[0].startswith("HEAD "), asked
    assert "Traceback" not in p.stderr, p.stderr
    errors = [line for line in p.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, p.stderr
    line = errors[0]
    assert f"the hub at {srv.url} did not answer as expected" in line, line
    assert "downloads are off" not in line, line
    assert f"featcache fetch-weights --model {model} --weights {weights}" in line, line
    assert line.endswith("(--offline reads only the cache, without waiting for the hub)"), line
    assert not manifest.exists()
    assert not [f for f in Path(tmp_path / "hf").rglob("*") if f.is_file() and "blobs" in f.parts]
