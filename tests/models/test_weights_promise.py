"""Weights checked against what their source promised (issue 50, item 1): a Hugging Face blob
whose bytes are not its content address, a torch hub checkpoint whose bytes do not start with
the hash in its name, a hub download whose bytes differ from its ETag, a package file that
differs from its distribution's RECORD. Each is damaged here, the user's command is run, and
the test asserts the one line (the file, ``fetch-weights ... --force``) and that nothing was
written: no store, no manifest. Tiny models, loopback hub, no network."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

from model_source_fixtures import HubServer, put_in_hub_cache, save_tiny_hf_clip, save_tiny_hf_dinov2

from featcache.cli import main

REPO = "featcache-test/tiny-clip"
COMMIT = hashlib.sha1(b"featcache tiny clip").hexdigest()


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_hf_clip(tmp_path_factory.mktemp("promise") / "clip")


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    """Another model's weights (a DINOv2's safetensors): a whole-file substitution."""
    return save_tiny_hf_dinov2(tmp_path_factory.mktemp("promise") / "dino") / "model.safetensors"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    return cache


def _files(d: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted(d.iterdir()) if p.is_file()}


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


def _extract(model: str, weights: str, cache: Path, *more: str) -> int:
    args = ["extract", "--model", model, "--weights", weights, "--data", "digits", "--split", "test"]
    return main([*args, "--limit", "4", "--cache", str(cache), "--no-progress", "--offline", *more])


def _nothing_stored(cache: Path) -> bool:
    """No dataset or feature group written (the store's root document and locks at most)."""
    return not cache.exists() or all(p.name.startswith(".featcache-") or p.name == "zarr.json" for p in cache.iterdir())


def _flip(path: Path, at: int = -1) -> None:
    """One flipped bit in the file a link points to (the hub's blob), in place."""
    target = path.resolve()
    data = bytearray(target.read_bytes())
    data[at] ^= 1
    target.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flipped byte", "another model"])
def test_hf_blob_that_is_not_its_content_address_is_refused(clip_dir, other_weights, hub_cache, tmp_path, capsys, how):
    snap = put_in_hub_cache(hub_cache, REPO, _files(clip_dir), COMMIT)
    blob = (snap / "model.safetensors").resolve()
    if how == "flipped byte":
        _flip(snap / "model.safetensors")
    else:
        blob.write_bytes(other_weights.read_bytes())
    cache = tmp_path / "c.zarr"
    assert _extract(f"hf:{REPO}", "dir", cache) == 1
    line = _one_error_line(capsys)
    assert "model.safetensors" in line
    assert "Hugging Face blob name" in line
    assert f"featcache fetch-weights --model hf:{REPO} --force" in line
    assert _nothing_stored(cache)
    manifest = tmp_path / "m.json"  # fetch-weights records nothing either
    assert main(["fetch-weights", "--model", f"hf:{REPO}", "--manifest", str(manifest)]) == 1
    assert "--force" in _one_error_line(capsys)
    assert not manifest.exists()


def test_timm_cache_file_with_a_flipped_header_byte_is_refused(hub_cache, tmp_path, capsys):
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(4)
    w = tmp_path / "model.safetensors"
    save_file(timm.create_model("test_vit").state_dict(), str(w))
    snap = put_in_hub_cache(hub_cache, "timm/test_vit.r160_in1k", {"model.safetensors": w}, COMMIT)
    _flip(snap / "model.safetensors", at=20)  # inside the safetensors JSON header
    cache = tmp_path / "c.zarr"
    assert _extract("test_vit.r160_in1k", "pretrained", cache) == 1
    line = _one_error_line(capsys)
    assert "model.safetensors" in line
    assert "featcache fetch-weights --model test_vit.r160_in1k --weights pretrained --force" in line
    assert _nothing_stored(cache)
    manifest = tmp_path / "m.json"
    w_entry = [{"model": "test_vit.r160_in1k", "weights": "pretrained"}]
    manifest.write_text(json.dumps(w_entry))
    before = manifest.read_bytes()
    assert main(["fetch-weights", "--verify", str(manifest)]) == 1
    assert "--force" in _one_error_line(capsys)
    assert manifest.read_bytes() == before


def test_torchvision_checkpoint_whose_hash_prefix_lies_is_refused(hub_cache, tmp_path, capsys):
    """``mobilenet_v3_small-047dcff4.pth`` holding bytes whose sha256 does not start 047dcff4
    (a state dict that loads: on main it was used silently)."""
    import torchvision

    member = torchvision.models.MobileNet_V3_Small_Weights.IMAGENET1K_V1
    ckpt = tmp_path / "torch" / "hub" / "checkpoints"
    ckpt.mkdir(parents=True)
    path = ckpt / Path(member.url).name
    torch.manual_seed(0)
    torch.save(torchvision.models.mobilenet_v3_small().state_dict(), path)
    assert not hashlib.sha256(path.read_bytes()).hexdigest().startswith("047dcff4")
    cache = tmp_path / "c.zarr"
    assert _extract("torchvision:mobilenet_v3_small", "IMAGENET1K_V1", cache) == 1
    line = _one_error_line(capsys)
    assert path.name in line
    assert "hash prefix" in line
    assert "featcache fetch-weights --model torchvision:mobilenet_v3_small --weights IMAGENET1K_V1 --force" in line
    assert _nothing_stored(cache)


def test_download_that_differs_from_its_etag_is_never_recorded(clip_dir, other_weights, hub_cache, tmp_path, capsys):
    """The loopback hub serves other bytes under the true sha256 ETag: huggingface_hub names the
    blob by the ETag, the check refuses, no manifest is written; ``--force`` against a healthy
    hub replaces the bad blob and records the promised sha256."""
    manifest = tmp_path / "m.json"
    bad = {"model.safetensors": other_weights.read_bytes()}
    with HubServer(REPO, _files(clip_dir), COMMIT, served=bad) as srv:
        from unittest import mock

        with mock.patch.dict("os.environ", {"HF_ENDPOINT": srv.url}):
            args = ["fetch-weights", "--model", f"hf:{REPO}", "--manifest", str(manifest)]
            assert main(args) == 1
            line = _one_error_line(capsys)
            assert "model.safetensors" in line
            assert f"featcache fetch-weights --model hf:{REPO} --force" in line
            assert not manifest.exists()
            assert main(args) == 1  # the bad bytes stay refused until --force
            _one_error_line(capsys)
            srv.served.clear()
            assert main([*args, "--force"]) == 0
    (rec,) = json.loads(manifest.read_text())
    assert rec["weight_files"] == {"model.safetensors": srv.sha["model.safetensors"]}
    blob = hub_cache / "models--featcache-test--tiny-clip" / "blobs" / srv.sha["model.safetensors"]
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name


def test_package_checkpoint_that_differs_from_its_record_is_refused(tmp_path, monkeypatch, capsys):
    """A checkpoint package whose file is not what its distribution's RECORD says."""
    import timm

    site = tmp_path / "site"
    pkg = site / "featcache_fake_ckpt"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    torch.manual_seed(0)
    torch.save(timm.create_model("test_resnet").state_dict(), pkg / "weights.pth")
    promised = hashlib.sha256(b"the bytes the wheel shipped").digest()
    info = site / "featcache_fake_ckpt-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: featcache-fake-ckpt\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("featcache_fake_ckpt\n")
    b64 = base64.urlsafe_b64encode(promised).rstrip(b"=").decode()
    (info / "RECORD").write_text(
        f"featcache_fake_ckpt/weights.pth,sha256={b64},{(pkg / 'weights.pth').stat().st_size}\n"
    )
    monkeypatch.syspath_prepend(str(site))
    cache = tmp_path / "c.zarr"
    args = ["extract", "--model", "test_resnet", "--weights", "package:featcache_fake_ckpt", "--data", "digits"]
    rc = main([*args, "--split", "test", "--limit", "4", "--input-size", "32", "--cache", str(cache), "--no-progress"])
    assert rc == 1
    line = _one_error_line(capsys)
    assert "weights.pth" in line
    assert "RECORD" in line
    assert "--force-reinstall" in line
    assert _nothing_stored(cache)


def _hub_in_trouble(model: str, weights: str, url: str, tmp_path, capsys) -> None:
    manifest = tmp_path / "m.json"
    args = ["fetch-weights", "--model", model, "--weights", weights, "--manifest", str(manifest)]
    assert main(args) == 1
    line = _one_error_line(capsys)
    assert "downloads are off" not in line
    assert f"the hub at {url} did not answer" in line
    assert f"featcache fetch-weights --model {model}" in line
    assert "--offline" in line
    assert not manifest.exists()


@pytest.mark.parametrize("fault", ["500", "unreachable"])
def test_a_hub_in_trouble_is_not_called_offline(clip_dir, hub_cache, monkeypatch, tmp_path, capsys, fault):
    """Downloads on, the hub answers 500 (or nothing listens): the line says the hub did not
    answer and what to do, never that downloads are off, for huggingface_hub's snapshot and for
    timm's own download; nothing is cached or recorded."""

    with HubServer(REPO, _files(clip_dir), COMMIT) as srv:
        srv.status = 500
        url = srv.url if fault == "500" else "http://127.0.0.1:9"
        _point_hub_at(monkeypatch, url)
        _hub_in_trouble(f"hf:{REPO}", "dir", url, tmp_path, capsys)
        _hub_in_trouble("test_vit.r160_in1k", "pretrained", url, tmp_path, capsys)
    if fault == "500":  # asked at the loopback hub, not at huggingface.co (a DNS failure here)
        assert [r for r in srv.requests if "/timm/test_vit.r160_in1k/resolve/" in r], srv.requests
    assert not any(hub_cache.rglob("blobs/*"))


def _point_hub_at(monkeypatch, url: str) -> None:
    """huggingface_hub's endpoint as if HF_ENDPOINT had been set before it was imported: its
    ``ENDPOINT`` and the download URL template it formats from it at import (``hf_hub_url``
    only swaps a URL's prefix that equals the current ``ENDPOINT``)."""
    import huggingface_hub.constants as hc

    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setattr(hc, "ENDPOINT", url)
    monkeypatch.setattr(hc, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")


def test_an_empty_ref_is_named_not_blamed_on_the_image_processor(clip_dir, hub_cache, monkeypatch, tmp_path, capsys):
    put_in_hub_cache(hub_cache, REPO, _files(clip_dir), COMMIT)
    ref = hub_cache / "models--featcache-test--tiny-clip" / "refs" / "main"
    ref.write_text("")  # what a kill during the ref's write leaves
    cache = tmp_path / "c.zarr"
    assert _extract(f"hf:{REPO}", "dir", cache) == 1
    line = _one_error_line(capsys)
    assert "image processor" not in line
    assert f"{ref} is damaged" in line
    assert f"featcache fetch-weights --model hf:{REPO} --force" in line
    assert _nothing_stored(cache)
    with HubServer(REPO, _files(clip_dir), COMMIT) as srv:  # where the hub is reachable, --force mends it
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        assert main(["fetch-weights", "--model", f"hf:{REPO}", "--force"]) == 0
    assert ref.read_text() == COMMIT


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.unlink()  # a copy in the snapshot (no link): the file itself is damaged
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage", ["truncated copy", "empty copy", "deleted blob", "truncated local dir"])
@pytest.mark.parametrize("command", ["extract", "verify"])
def test_damaged_or_missing_weight_files_are_one_line(clip_dir, hub_cache, tmp_path, capsys, damage, command):
    """Damaged, truncated and missing weight files (Hugging Face cache, timm's hub file, a
    save_pretrained folder) in ``extract`` and ``fetch-weights --verify``: one line naming the
    file and how to get it back, no traceback, nothing stored."""
    import shutil

    import timm
    from safetensors.torch import save_file

    if damage == "truncated local dir":
        d = tmp_path / "clip"
        shutil.copytree(clip_dir, d)
        model, weights, target = f"hf:{d}", "dir", d / "model.safetensors"
        _truncate(target)
    elif damage == "deleted blob":
        snap = put_in_hub_cache(hub_cache, REPO, _files(clip_dir), COMMIT)
        model, weights, target = f"hf:{REPO}", "dir", snap / "model.safetensors"
        target.resolve().unlink()
    else:  # timm's pretrained file, in a cache laid out without links
        w = tmp_path / "model.safetensors"
        save_file(timm.create_model("test_vit").state_dict(), str(w))
        snap = put_in_hub_cache(hub_cache, "timm/test_vit.r160_in1k", {"model.safetensors": w}, COMMIT, link=False)
        model, weights, target = "test_vit.r160_in1k", "pretrained", snap / "model.safetensors"
        _truncate(target) if damage == "truncated copy" else target.write_bytes(b"")
    cache = tmp_path / "c.zarr"
    if command == "extract":
        assert _extract(model, weights, cache) == 1
    else:
        manifest = tmp_path / "m.json"
        manifest.write_text(json.dumps([{"model": model, "weights": weights}]))
        assert main(["fetch-weights", "--verify", str(manifest)]) == 1
    line = _one_error_line(capsys)
    assert f"cannot read weight file {str(target)!r}" in line
    assert "missing" in line if damage == "deleted blob" else "damaged or truncated" in line
    if damage == "truncated local dir":
        assert "replace it with an intact copy" in line
    else:
        assert f"featcache fetch-weights --model {model}" in line
        assert "--force" in line
    assert _nothing_stored(cache)


def test_torchvision_weights_without_network_are_one_line(hub_cache, tmp_path, monkeypatch, capsys):
    """Downloads on, nothing answers (a refused proxy stands for no network): one line, no
    URLError chain; nothing lands in torch hub's cache."""
    for var in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    cache = tmp_path / "c.zarr"
    args = ["extract", "--model", "torchvision:mobilenet_v3_small", "--weights", "IMAGENET1K_V1", "--data", "digits"]
    assert main([*args, "--split", "test", "--limit", "4", "--cache", str(cache), "--no-progress"]) == 1
    line = _one_error_line(capsys)
    assert "cannot download torchvision:mobilenet_v3_small weights IMAGENET1K_V1" in line
    assert "featcache fetch-weights --model torchvision:mobilenet_v3_small --weights IMAGENET1K_V1" in line
    assert "--offline" in line
    assert not list((tmp_path / "torch").rglob("*.pth"))
    assert _nothing_stored(cache)


def test_open_clip_download_from_a_hub_in_trouble_is_one_line(clip_dir, hub_cache, monkeypatch, tmp_path, capsys):
    """open_clip's pretrained tag, downloads on, the hub answering 500: one whole line with
    --offline, checked with one request before open_clip's own download (which retries)."""
    pytest.importorskip("open_clip")

    with HubServer(REPO, _files(clip_dir), COMMIT) as srv:
        srv.status = 500
        _point_hub_at(monkeypatch, srv.url)
        _hub_in_trouble("open_clip:ViT-B-32", "laion2b_s34b_b79k", srv.url, tmp_path, capsys)
    assert [r for r in srv.requests if "/laion/CLIP-ViT-B-32-laion2B-s34B-b79K/resolve/" in r], srv.requests
    assert not any(hub_cache.rglob("blobs/*"))
