"""Model-source defects found when tried as a new user would (issue 32, item 6): each test
fails on the code before the fix. Tiny models built here, no network."""

from __future__ import annotations

import hashlib
import json
import logging
import sys

import numpy as np
import pytest
import torch

from featcache.errors import BackboneError
from featcache.extract import ExtractConfig
from featcache.models import create_backbone

pytest.importorskip("open_clip")
pytest.importorskip("transformers")

from model_source_fixtures import USER_MODULE, register_tiny_open_clip, save_tiny_hf_clip


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("defects")
    oc = register_tiny_open_clip(tmp / "oc")
    clip = save_tiny_hf_clip(tmp / "hfclip")
    mods = tmp / "usermods"
    mods.mkdir()
    (mods / "featcache_user_net.py").write_text(USER_MODULE)
    (mods / "featcache_bad_nets.py").write_text(BAD_NETS)
    sys.path.insert(0, str(mods))
    yield {"oc": oc, "clip": clip, "mods": mods}
    sys.path.remove(str(mods))
    for m in ("featcache_user_net", "featcache_bad_nets"):
        sys.modules.pop(m, None)


BAD_NETS = """
import torch
import torch.nn as nn


class Tuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.lin(x).mean(dim=(2, 3))
        return y, y


class Dict(Tuple):
    def forward(self, x):
        return {"feat": self.lin(x).mean(dim=(2, 3))}


class Map(Tuple):
    def forward(self, x):
        return self.lin(x)


class NoForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)


def make_int():
    return 3
"""


# ------------------------------------------------------------------ torchvision full checkpoint
def test_full_torchvision_state_dict_loads_without_its_classifier(tmp_path):
    """A full ``resnet18().state_dict()`` (with fc.weight/fc.bias) loads: the replaced head's
    keys are dropped as timm drops a num_classes=0 model's classifier; features equal the
    checkpointed model's pre-logits; no weights enum is recorded for a user checkpoint."""
    import torchvision

    torch.manual_seed(3)
    ref = torchvision.models.resnet18().eval()
    path = tmp_path / "r18.pth"
    torch.save(ref.state_dict(), path)
    bb = create_backbone("torchvision:resnet18", str(path))
    ref.fc = torch.nn.Identity()
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        np.testing.assert_array_equal(bb.embed(x).numpy(), ref(x).numpy())
    assert bb.weights_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert "weights_enum" not in bb.data_config  # was IMAGENET1K_V1 whatever the checkpoint


# ------------------------------------------------------------------ a module's output
@pytest.mark.parametrize(
    ("cls", "got"),
    [("Tuple", "got tuple"), ("Dict", "got dict"), ("Map", r"got 4-D tensor \[2, 4, 222, 222\]")],
)
def test_a_module_not_returning_b_by_d_is_refused_up_front(assets, cls, got):
    import featcache_bad_nets

    model = getattr(featcache_bad_nets, cls)()
    with pytest.raises(BackboneError, match=rf"must return a \[B, D\] tensor; {got}") as e:
        create_backbone(model, "module")
    one_line(e)


def test_a_module_without_forward_is_refused(assets):
    import featcache_bad_nets

    with pytest.raises(BackboneError, match=r"has no forward\(\)") as e:
        create_backbone(featcache_bad_nets.NoForward(), "module")
    one_line(e)


# ------------------------------------------------------------------ names
def test_an_unknown_source_is_named_with_the_registered_ones():
    with pytest.raises(BackboneError) as e:
        create_backbone("keras:resnet50", "random:0")
    assert one_line(e) == "unknown model source 'keras' (timm, torchvision, open_clip, hf, python)"
    with pytest.raises(BackboneError, match=r"did you mean open_clip:\?") as e:
        ExtractConfig("open-clip:ViT-B-32", "random:0", "digits", cache="c.zarr")  # refused before any data
    one_line(e)
    assert create_backbone("timm:test_resnet", "random:0").name == "test_resnet"  # timm: stays a timm name


def test_an_unknown_open_clip_architecture_is_one_line_with_close_names():
    with pytest.raises(BackboneError, match=r"unknown open_clip architecture 'ViT-Q-99'; did you mean .*ViT-") as e:
        create_backbone("open_clip:ViT-Q-99", "random:0")
    one_line(e)


# ------------------------------------------------------------------ open_clip's warning
def test_no_random_init_warning_when_a_checkpoint_is_loaded(assets, tmp_path, caplog):
    import open_clip

    torch.manual_seed(5)
    ref = open_clip.create_model(assets["oc"], pretrained=None).eval()
    path = tmp_path / "oc.pt"
    torch.save(ref.state_dict(), path)
    caplog.clear()  # the reference's own random init warned, rightly
    with caplog.at_level(logging.WARNING):
        bb = create_backbone(f"open_clip:{assets['oc']}", str(path))
    assert not [r for r in caplog.records if "No pretrained weights loaded" in r.getMessage()]
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        np.testing.assert_array_equal(bb.embed(x).numpy(), ref.encode_image(x).numpy())
    assert bb.default_key == f"open_clip-{assets['oc']}@oc"


# ------------------------------------------------------------------ seeds honoured and recorded
def test_hf_random_seed_builds_the_architecture_seeded(assets):
    """``hf:DIR --weights random:1`` used the directory's weights silently."""
    own = create_backbone(f"hf:{assets['clip']}", "dir")
    a, b = create_backbone(f"hf:{assets['clip']}", "random:1"), create_backbone(f"hf:{assets['clip']}", "random:1")
    assert a.weights_source == "random:1"
    assert a.weights_sha256 == hashlib.sha256(b"random:1").hexdigest() != own.weights_sha256
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        np.testing.assert_array_equal(a.embed(x).numpy(), b.embed(x).numpy())
        assert not np.allclose(a.embed(x).numpy(), own.embed(x).numpy())
    assert a.default_key.endswith("@random1")


def test_python_factory_seed_is_recorded(assets):
    bb = create_backbone("python:featcache_user_net:make", "random:2")
    assert bb.weights_source == "random:2"  # was "module"
    assert bb.default_key == "python-featcache_user_net_make@random2"


# ------------------------------------------------------------------ provenance
def test_hf_model_name_is_the_whole_path(assets):
    bb = create_backbone(f"hf:{assets['clip']}", "dir")
    assert bb.name == f"hf:{assets['clip'].resolve()}"  # was hf:hfclip
    assert bb.default_key == "hf-hfclip"  # the store key stays short
    assert bb.data_config["weight_files"] == {
        "model.safetensors": hashlib.sha256((assets["clip"] / "model.safetensors").read_bytes()).hexdigest()
    }


def test_resize_is_recorded_only_where_featcache_preprocesses(assets):
    base = {"data": "digits", "cache": "c.zarr"}
    assert ExtractConfig("test_resnet", "random:0", **base).recorded()["resize"] == "timm"
    assert ExtractConfig("python:featcache_user_net:make", "random:0", **base).recorded()["resize"] == "timm"
    for spec in (f"open_clip:{assets['oc']}", "torchvision:resnet18", f"hf:{assets['clip']}"):
        assert "resize" not in ExtractConfig(spec, "random:0", **base).recorded()


# ------------------------------------------------------------------ --input-size for python:
def test_input_size_applies_to_a_python_module_without_a_transform(assets):
    from PIL import Image

    bb = create_backbone("python:featcache_user_net:make", "random:2", input_size=64)
    assert bb.data_config["input_size"] == (3, 64, 64)
    assert tuple(bb.transform(Image.new("RGB", (100, 80))).shape) == (3, 64, 64)


def test_input_size_is_refused_for_a_library_transform_without_naming_python(assets):
    with pytest.raises(BackboneError) as e:
        create_backbone(f"open_clip:{assets['oc']}", "random:0", input_size=64)
    msg = one_line(e)
    assert "uses its library's own preprocessing" in msg
    assert "wrap the model with python:" not in msg


# ------------------------------------------------------------------ python: paths and callables
def test_python_file_path_is_accepted(tmp_path):
    f = tmp_path / "my_nets.py"
    f.write_text(USER_MODULE)
    bb = create_backbone(f"python:{f}:make", "random:0")
    assert bb.name == f"python:{f}:make"
    assert bb.feature_dim == 8


@pytest.mark.parametrize("spec", ["os:system", "subprocess:Popen", "builtins:exit", "featcache_bad_nets:make_int"])
def test_python_callables_not_giving_a_module_are_refused(assets, spec):
    with pytest.raises(BackboneError, match=rf"python:{spec} ") as e:  # builtins:exit raised SystemExit
        create_backbone(f"python:{spec}", "random:0")
    one_line(e)


# ------------------------------------------------------------------ hf: custom code
def test_hf_custom_code_is_not_run_without_trust_remote_code(assets, tmp_path):
    import shutil

    d = tmp_path / "custom"
    shutil.copytree(assets["clip"], d)
    marker = tmp_path / "ran"
    (d / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModel": "modeling_evil.EvilModel"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BackboneError, match=r"ships its own model code .*--trust-remote-code") as e:
        create_backbone(f"hf:{d}", "dir")
    one_line(e)
    assert not marker.exists()


# ------------------------------------------------------------------ split / splits
def test_split_and_splits_are_one_field():
    from featcache.cli import build_parser

    base = {"data": "digits", "cache": "c.zarr"}
    with pytest.warns(DeprecationWarning, match=r"split=\.\.\.\) is deprecated; use splits="):
        a = ExtractConfig("test_resnet", "random:0", split="test", **base)
    assert a.splits == ExtractConfig("test_resnet", "random:0", splits=("test",), **base).splits == ("test",)
    argv = ["extract", "--model", "test_resnet", "--data", "digits", "--cache", "c.zarr"]
    for flag in ("--split", "--splits"):
        args = build_parser().parse_args([*argv, flag, "train", flag, "test"])
        assert ExtractConfig.from_args(args).splits == ("train", "test")


# ------------------------------------------------------------------ embed-classes batching
def test_class_prompts_go_through_the_tower_in_bounded_batches():
    """800 prompts (10 classes x 80 templates) went through the tower in one forward; now at
    most PROMPTS_PER_BATCH at a time, with the same embeddings as encoding each class alone."""
    import torch.nn.functional as F

    from featcache.extract.text import PROMPTS_PER_BATCH, embed_classes

    g = torch.Generator().manual_seed(0)
    table = {}
    sizes = []

    def encode(texts):
        sizes.append(len(texts))
        return torch.stack([table.setdefault(t, torch.randn(16, generator=g)) for t in texts])

    classes = [f"class{i}" for i in range(13)]
    templates = [f"a photo {j} of a {{}}." for j in range(80)]
    got = embed_classes(encode, classes, templates)
    assert max(sizes) <= PROMPTS_PER_BATCH
    assert sum(sizes) == 13 * 80
    for c, row in zip(classes, got):
        e = F.normalize(torch.stack([table[t.format(c)] for t in templates]), dim=-1).mean(dim=0)
        np.testing.assert_allclose(row, (e / e.norm()).numpy(), atol=1e-6, rtol=0)


# ------------------------------------------------------------------ item 5: the text tower follows the backbone
def test_embed_classes_takes_the_model_from_the_backbones_provenance(assets, tmp_path):
    from featcache.cli import main
    from featcache.extract import extract
    from featcache.store import open_cache

    cache = str(tmp_path / "c.zarr")
    base = {"cache": cache, "splits": ("test",), "limit": 4, "progress": False, "device": "cpu"}
    extract(ExtractConfig(f"open_clip:{assets['oc']}", "random:3", "digits", backbone_name="clip", **base))
    argv = ["embed-classes", "--cache", cache, "--dataset", "digits", "--templates", "simple"]
    assert main([*argv, "--backbone", "clip"]) == 0  # no --model: the store knows it
    got = open_cache(cache, "r").load_class_embeddings("digits", backbone="clip")
    want = [*argv, "--backbone", "ref", "--model", f"open_clip:{assets['oc']}", "--weights", "random:3"]
    assert main(want) == 0
    np.testing.assert_array_equal(got, open_cache(cache, "r").load_class_embeddings("digits", backbone="ref"))
    assert main([*argv, "--backbone", "absent"]) == 1  # one line: extract it first
