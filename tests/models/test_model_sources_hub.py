"""Models by their hub names (issue 32, items 1-2): tiny models placed in the Hugging Face
hub cache layout load by name offline, with the revision and weight-file sha256 recorded; a
download through ``huggingface_hub`` from a loopback server speaking the hub's endpoints;
offline misses are one line naming the fetch command; a resume at another revision is refused."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from featcache.errors import FeatcacheError, WeightsNotFoundError
from featcache.extract import ExtractConfig, extract
from featcache.models import create_backbone

pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

from model_source_fixtures import HubServer, put_in_hub_cache, save_tiny_hf_clip

REPO = "featcache-test/tiny-clip"
COMMIT = hashlib.sha1(b"featcache tiny clip").hexdigest()


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_hf_clip(tmp_path_factory.mktemp("hub") / "clip")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    return cache


def _files(d: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted(d.iterdir()) if p.is_file()}


def _x():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def test_hf_hub_id_loads_from_the_cache_offline_with_its_revision(clip_dir, hub_cache, monkeypatch):
    put_in_hub_cache(hub_cache, REPO, _files(clip_dir), COMMIT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bb = create_backbone(f"hf:{REPO}", "dir")
    sha = hashlib.sha256((clip_dir / "model.safetensors").read_bytes()).hexdigest()
    assert bb.name == f"hf:{REPO}"
    assert bb.default_key == "hf-featcache-test_tiny-clip"
    assert bb.data_config["hub_id"] == REPO
    assert bb.data_config["revision"] == COMMIT
    assert bb.data_config["weight_files"] == {"model.safetensors": sha}
    assert bb.weights_sha256 == sha
    assert bb.data_config["library"] == "transformers"
    assert bb.data_config["library_version"]
    local = create_backbone(f"hf:{clip_dir}", "dir")
    with torch.inference_mode():
        np.testing.assert_array_equal(bb.embed(_x()).numpy(), local.embed(_x()).numpy())
    at = create_backbone(f"hf:{REPO}@{COMMIT}", "dir")  # a pinned revision, from the cache too
    assert at.data_config["revision"] == COMMIT


def test_offline_miss_is_one_line_with_the_fetch_command(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsNotFoundError) as e:
        create_backbone("hf:featcache-test/absent", "dir")
    msg = str(e.value)
    assert "\n" not in msg
    assert "featcache fetch-weights --model hf:featcache-test/absent" in msg
    assert str(hub_cache) in msg
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(WeightsNotFoundError, match="--offline"):  # the flag, as the variable
        create_backbone("hf:featcache-test/absent", "dir", offline=True)


def test_hf_hub_id_downloads_from_a_hub_endpoint(clip_dir, hub_cache, monkeypatch):
    """``huggingface_hub`` downloads from ``HF_ENDPOINT`` (a loopback server in the hub's
    layout) into the cache; the bytes are the served bytes; a second load offline reads them."""
    files = _files(clip_dir)
    with HubServer(REPO, files, COMMIT) as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        bb = create_backbone(f"hf:{REPO}", "dir")
    assert f"GET /api/models/{REPO}/revision/main" in srv.requests
    assert any(r.endswith(f"/resolve/{COMMIT}/model.safetensors") for r in srv.requests)
    snap = hub_cache / "models--featcache-test--tiny-clip" / "snapshots" / COMMIT
    for name, _src in files.items():
        assert hashlib.sha256((snap / name).read_bytes()).hexdigest() == srv.sha[name]
    assert (hub_cache / "models--featcache-test--tiny-clip" / "refs" / "main").read_text() == COMMIT
    assert bb.data_config["revision"] == COMMIT
    assert bb.data_config["weight_files"]["model.safetensors"] == srv.sha["model.safetensors"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = create_backbone(f"hf:{REPO}", "dir")  # the server is gone
    assert again.weights_sha256 == bb.weights_sha256


def test_resume_refuses_another_revision(clip_dir, hub_cache, monkeypatch, tmp_path):
    put_in_hub_cache(hub_cache, REPO, _files(clip_dir), COMMIT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = {"cache": str(tmp_path / "c.zarr"), "splits": ("test",), "limit": 4, "progress": False, "device": "cpu"}
    extract(ExtractConfig(f"hf:{REPO}", "dir", "digits", backbone_name="bb", **base))
    other = hashlib.sha1(b"another commit").hexdigest()
    put_in_hub_cache(hub_cache, REPO, _files(clip_dir), other)  # refs/main moves; same bytes
    with pytest.raises(FeatcacheError, match=r"revision"):
        extract(ExtractConfig(f"hf:{REPO}", "dir", "digits", backbone_name="bb", **base))


def test_timm_pretrained_name_loads_from_the_hub_cache_offline(hub_cache, monkeypatch, tmp_path):
    """``--weights pretrained``: timm's own pretrained=True, here served by the hub cache."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(4)
    ref = timm.create_model("test_vit", num_classes=0).eval()
    w = tmp_path / "model.safetensors"
    save_file(timm.create_model("test_vit").state_dict() | ref.state_dict(), str(w))
    put_in_hub_cache(hub_cache, "timm/test_vit.r160_in1k", {"model.safetensors": w}, COMMIT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bb = create_backbone("test_vit.r160_in1k", "pretrained")
    assert bb.data_config["revision"] == COMMIT
    assert (
        bb.weights_sha256
        == bb.data_config["weight_files"]["model.safetensors"]
        == hashlib.sha256(w.read_bytes()).hexdigest()
    )
    assert bb.data_config["library"] == "timm"
    assert bb.data_config["library_version"] == timm.__version__
    x = torch.randn(2, 3, 160, 160, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        np.testing.assert_array_equal(bb.embed(x).numpy(), ref(x).numpy())
    with pytest.raises(WeightsNotFoundError, match=r"fetch-weights --model test_resnet.r160_in1k --weights pretrained"):
        create_backbone("test_resnet.r160_in1k", "pretrained")


def test_open_clip_hf_hub_name_loads_from_the_hub_cache_offline(hub_cache, monkeypatch, tmp_path):
    """``open_clip:hf-hub:ORG/NAME``: open_clip reads its config and weights through
    huggingface_hub (whose cache and offline switch are read when the process starts, so the
    test sets them in huggingface_hub's constants as the environment would)."""
    import json

    import huggingface_hub.constants as hc
    import open_clip
    from model_source_fixtures import TINY_OPEN_CLIP

    torch.manual_seed(6)
    name = "featcache-test-oc"
    cfg_path = tmp_path / f"{name}.json"
    cfg_path.write_text(json.dumps(TINY_OPEN_CLIP))
    open_clip.add_model_config(cfg_path)
    ref = open_clip.create_model(name, pretrained=None).eval()
    wf = tmp_path / "open_clip_pytorch_model.bin"
    torch.save(ref.state_dict(), wf)
    (tmp_path / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_OPEN_CLIP}))
    files = {"open_clip_pytorch_model.bin": wf, "open_clip_config.json": tmp_path / "open_clip_config.json"}
    put_in_hub_cache(hub_cache, "featcache-test/tiny-oc", files, COMMIT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    bb = create_backbone("open_clip:hf-hub:featcache-test/tiny-oc", "timm")
    assert bb.data_config["revision"] == COMMIT
    assert bb.data_config["hub_id"] == "featcache-test/tiny-oc"
    assert bb.weights_sha256 == hashlib.sha256(wf.read_bytes()).hexdigest()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        np.testing.assert_array_equal(bb.embed(x).numpy(), ref.encode_image(x).numpy())


def test_fetch_weights_then_verify_offline(clip_dir, hub_cache, monkeypatch, tmp_path, capsys):
    """``featcache fetch-weights`` on a connected node (the loopback hub), then ``--verify``
    offline: the cached bytes' sha256 against the manifest; a changed file is named."""
    import json

    from featcache.cli import main

    manifest = tmp_path / "weights.json"
    with HubServer(REPO, _files(clip_dir), COMMIT) as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        assert main(["fetch-weights", "--model", f"hf:{REPO}", "--manifest", str(manifest)]) == 0
    (rec,) = json.loads(manifest.read_text())
    assert rec["revision"] == COMMIT
    assert rec["weight_files"] == {"model.safetensors": srv.sha["model.safetensors"]}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["fetch-weights", "--verify", str(manifest)]) == 0
    assert f"ok hf:{REPO} (dir)" in capsys.readouterr().out
    snap = hub_cache / "models--featcache-test--tiny-clip" / "snapshots" / COMMIT / "model.safetensors"
    data = bytearray(snap.read_bytes())
    data[-1] ^= 1  # one flipped bit in the last weight
    snap.unlink()
    snap.write_bytes(bytes(data))
    assert main(["fetch-weights", "--verify", str(manifest)]) == 1
    assert "weights_sha256, weight_files differ" in capsys.readouterr().err


def test_models_lists_names_and_what_is_cached(clip_dir, hub_cache, monkeypatch, tmp_path, capsys):
    from featcache.cli import main

    w = tmp_path / "model.safetensors"
    w.write_bytes(b"not read by the listing")
    put_in_hub_cache(hub_cache, "timm/test_vit.r160_in1k", {"model.safetensors": w}, COMMIT)
    put_in_hub_cache(hub_cache, REPO, _files(clip_dir), COMMIT)
    assert main(["models", "test_*.r160_in1k", "--source", "timm"]) == 0
    rows = {line.split()[1]: line.split()[-1] for line in capsys.readouterr().out.splitlines()}
    assert rows["test_vit.r160_in1k"] == "cached"
    assert rows["test_resnet.r160_in1k"] == "-"
    assert main(["models", "--cached", "--source", "hf", "--source", "timm"]) == 0
    out = capsys.readouterr().out.split()
    assert f"hf:{REPO}" in out
    assert "test_vit.r160_in1k" in out
    assert "test_resnet.r160_in1k" not in out


def test_torchvision_weights_enum_offline_miss_and_unknown_names(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(WeightsNotFoundError) as e:
        create_backbone("torchvision:resnet18", "IMAGENET1K_V1", offline=True)
    msg = str(e.value)
    assert "\n" not in msg
    assert "featcache fetch-weights --model torchvision:resnet18 --weights IMAGENET1K_V1" in msg
    with pytest.raises(
        FeatcacheError, match=r"has no weights 'IMAGENET1K_V9'; its ResNet18_Weights offers IMAGENET1K_V1"
    ):
        create_backbone("torchvision:resnet18", "IMAGENET1K_V9")
