"""The token feature kinds (issue 46): blocks:K, tokens, tokens@GxG from one forward pass,
against a port of DINOv2's own ``get_intermediate_layers`` on the same timm blocks, against the
libraries' own outputs (open_clip, Hugging Face), and the size check before any image is read."""

from __future__ import annotations

import shutil
from collections import namedtuple

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from timm.data import create_transform, resolve_model_data_config

from featcache.cli import main
from featcache.data.readers import open_dataset
from featcache.errors import ConfigError, FeatcacheError, NoSpaceError
from featcache.extract.features import FeatureHead
from featcache.extract.sizing import free_bytes, is_remote, plan_size
from featcache.models import backbones
from featcache.models.model import Backbone

N = 8


# --------------------------------------------------------------------------- DINOv2's reference, ported
# facebookresearch/dinov2 @ b8931f7, dinov2/models/vision_transformer.py:273-283
# (_get_intermediate_layers_not_chunked) and :299-323 (get_intermediate_layers), applied to a timm
# ViT: the only substitution is prepare_tokens_with_masks (:214-233), which is DINOv2's own patch and
# position embedding; the timm model's own embedding (patch_embed, _pos_embed, patch_drop, norm_pre)
# takes its place, and it lays tokens out as DINOv2 does (class token, register tokens, patches).
def _dinov2_intermediate_layers_not_chunked(model, x, n=1):
    x = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))  # prepare_tokens_with_masks
    # If n is an int, take the n last blocks. If it's a list, take them
    output, total_block_len = [], len(model.blocks)
    blocks_to_take = range(total_block_len - n, total_block_len) if isinstance(n, int) else n
    for i, blk in enumerate(model.blocks):
        x = blk(x)
        if i in blocks_to_take:
            output.append(x)
    assert len(output) == len(blocks_to_take), f"only {len(output)} / {len(blocks_to_take)} blocks found"
    return output


def dinov2_get_intermediate_layers(model, x, n=1, reshape=False, return_class_token=False, norm=True):
    outputs = _dinov2_intermediate_layers_not_chunked(model, x, n)
    if norm:
        outputs = [model.norm(out) for out in outputs]
    class_tokens = [out[:, 0] for out in outputs]
    outputs = [out[:, 1 + model.num_reg_tokens :] for out in outputs]  # DINOv2: self.num_register_tokens
    if reshape:
        B, _, w, h = x.shape
        p = model.patch_embed.patch_size[0]  # DINOv2: self.patch_size
        outputs = [out.reshape(B, w // p, h // p, -1).permute(0, 3, 1, 2).contiguous() for out in outputs]
    if return_class_token:
        return tuple(zip(outputs, class_tokens))
    return tuple(outputs)


# --------------------------------------------------------------------------- helpers
def _backbone(model: torch.nn.Module, name: str) -> Backbone:
    model = model.eval()
    cfg = resolve_model_data_config(model)
    if hasattr(model, "patch_embed"):  # a ViT built at a small img_size: its own size, no crop
        cfg = {**cfg, "input_size": (3, *model.patch_embed.img_size), "crop_pct": 1.0}
    return Backbone(
        name=name,
        model=model,
        data_config=cfg,
        transform=create_transform(**cfg),
        weights_source="random:0",
        weights_sha256="",
        feature_dim=int(model.num_features),
        default_key=name,
    )


def _digits(bb: Backbone, n: int = N) -> torch.Tensor:
    split = open_dataset("digits")["test"]
    return torch.stack([bb.transform(split.load(i).convert("RGB")) for i in range(n)])


def _run(bb: Backbone, kinds: list[str], x: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        return FeatureHead(bb, kinds)(x)


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    bb = _backbone(timm.create_model("vit_tiny_patch16_224", img_size=64, num_classes=0), "vit_tiny_patch16_224")
    return bb, _digits(bb)


# --------------------------------------------------------------------------- timm ViT
def test_vit_blocks_and_tokens_equal_dinov2_port_from_one_forward(vit):
    bb, x = vit
    kinds = ["pooled", "blocks:4", "blocks:1", "tokens", "tokens@2x2", "cls", "tokens_mean", "stage5_avg"]
    seen = []
    hook = bb.model.patch_embed.register_forward_hook(lambda m, i, o: seen.append(1))
    try:
        out = _run(bb, kinds, x)
    finally:
        hook.remove()
    assert len(seen) == 1  # every kind from one forward pass
    with torch.inference_mode():
        ref = dinov2_get_intermediate_layers(bb.model, x, n=4, return_class_token=True, norm=True)
        grid = dinov2_get_intermediate_layers(bb.model, x, n=1, reshape=True, norm=True)[0]
        alone = {k: FeatureHead(bb, [k])(x)[k] for k in ("pooled", "cls", "tokens_mean", "stage5_avg")}
    assert out["blocks:4"].shape == (N, 4, 192)
    assert torch.equal(out["blocks:4"], torch.stack([c for _, c in ref], dim=1))  # oldest block first
    assert torch.equal(out["blocks:1"][:, 0], ref[-1][1])
    assert out["tokens"].shape == (N, 16, 192)
    assert torch.equal(out["tokens"], ref[-1][0])
    want = F.adaptive_avg_pool2d(grid, 2).flatten(2).transpose(1, 2)
    np.testing.assert_allclose(out["tokens@2x2"].numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    for k, v in alone.items():  # the vector kinds are bit-identical to asking for them alone
        assert torch.equal(out[k], v), k
    assert FeatureHead(bb, kinds).dims((3, 64, 64)) == {
        "pooled": (192,), "blocks:4": (4, 192), "blocks:1": (1, 192), "tokens": (16, 192),
        "tokens@2x2": (4, 192), "cls": (192,), "tokens_mean": (192,), "stage5_avg": (192,),
    }  # fmt: skip
    assert not torch.equal(out["blocks:4"][:, 0], out["blocks:4"][:, 3])


def test_register_tokens_are_excluded():
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch14_reg4_dinov2", img_size=56, num_classes=0)
    bb = _backbone(model, "vit_small_patch14_reg4_dinov2")
    x = _digits(bb, 4)
    out = _run(bb, ["pooled", "blocks:2", "tokens", "tokens@4x4"], x)
    with torch.inference_mode():
        ref = dinov2_get_intermediate_layers(model, x, n=2, return_class_token=True, norm=True)
        final = model.forward_features(x)
    assert (model.num_reg_tokens, model.num_prefix_tokens) == (4, 5)
    assert out["tokens"].shape == (4, 16, 384)  # the 4 x 4 patches; no register token
    assert torch.equal(out["tokens"], ref[-1][0])
    assert torch.equal(out["tokens"], final[:, 5:])
    assert torch.equal(out["blocks:2"], torch.stack([c for _, c in ref], dim=1))
    assert torch.equal(out["blocks:2"][:, -1], final[:, 0])
    np.testing.assert_allclose(out["tokens@4x4"].numpy(), out["tokens"].numpy(), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- timm CNN
def test_cnn_tokens_are_the_final_map_positions():
    torch.manual_seed(0)
    bb = _backbone(timm.create_model("efficientnet_lite0", num_classes=0), "efficientnet_lite0")
    split = open_dataset("digits")["test"]
    tf = create_transform(**{**bb.data_config, "input_size": (3, 96, 96), "crop_pct": 1.0})
    x = torch.stack([tf(split.load(i).convert("RGB")) for i in range(N)])
    out = _run(bb, ["pooled", "tokens", "tokens@2x2", "tokens@1x1"], x)
    with torch.inference_mode():
        fmap = bb.model.forward_features(x)
        pooled = FeatureHead(bb, ["pooled"])(x)["pooled"]
    assert fmap.shape == (N, 1280, 3, 3)
    assert out["tokens"].shape == (N, 9, 1280)
    assert torch.equal(out["tokens"], fmap.flatten(2).transpose(1, 2))
    assert torch.equal(out["tokens"][:, 1], fmap[:, :, 0, 1])  # row-major over H then W
    want = F.adaptive_avg_pool2d(fmap, 2).flatten(2).transpose(1, 2)  # overlapping 2 x 2 windows of 3 x 3
    np.testing.assert_allclose(out["tokens@2x2"].numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["tokens@1x1"][:, 0].numpy(), pooled.numpy(), rtol=1e-5, atol=1e-6)
    assert torch.equal(out["pooled"], pooled)


# --------------------------------------------------------------------------- refusals
def _one_line(bb, kinds, shape, exc=ConfigError) -> str:
    with pytest.raises(exc) as e:
        FeatureHead(bb, kinds).dims(shape)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_refusals_are_one_line(vit):
    bb, _ = vit
    lite = _backbone(timm.create_model("efficientnet_lite0", num_classes=0), "efficientnet_lite0")
    msg = _one_line(lite, ["pooled", "blocks:4"], (3, 64, 64))
    assert all(s in msg for s in ("efficientnet_lite0 has no class token", "tokens@GxG", "pooled"))
    msg = _one_line(bb, ["blocks:13"], (3, 64, 64))
    assert all(s in msg for s in ("has 12 blocks", "K in 1..12"))
    msg = _one_line(bb, ["tokens@5x5"], (3, 64, 64))
    assert all(s in msg for s in ("patch grid is 4x4", "G in 1..4"))
    msg = _one_line(lite, ["tokens@3x3"], (3, 64, 64))
    assert "final feature map is 2x2" in msg
    for bad in ("blocks:0", "blocks:x", "blocks", "tokens@2x3", "tokens@0x0", "tokens@2"):
        assert "malformed" in _one_line(bb, [bad], (3, 64, 64)), bad
    assert "unknown feature kind 'tokenz'" in _one_line(bb, ["tokenz"], (3, 64, 64), FeatcacheError)


# --------------------------------------------------------------------------- open_clip and Hugging Face
def test_open_clip_and_hf_token_kinds_equal_the_libraries_own(tmp_path):
    pytest.importorskip("open_clip")
    pytest.importorskip("transformers")
    import open_clip
    from model_source_fixtures import register_tiny_open_clip, save_tiny_hf_clip, save_tiny_hf_dinov2
    from transformers import CLIPVisionModel, Dinov2Model

    oc = register_tiny_open_clip(tmp_path / "oc")
    clip_dir, dino_dir = save_tiny_hf_clip(tmp_path / "clip"), save_tiny_hf_dinov2(tmp_path / "dino")
    kinds = ["pooled", "blocks:2", "tokens", "tokens@2x2"]

    bb = backbones.create_backbone(f"open_clip:{oc}", "random:0")
    x = _digits(bb, 4)
    out = _run(bb, kinds, x)
    torch.manual_seed(0)
    ref = open_clip.create_model(oc, pretrained=None).eval()
    with torch.inference_mode():
        alone = ref.encode_image(x)
        ref.visual.output_tokens = True  # open_clip's own (pooled, ln_post tokens)
        pooled, tokens = ref.visual(x)
    assert torch.equal(out["pooled"], alone)
    assert torch.equal(out["tokens"], tokens)
    with torch.inference_mode():
        projected = out["blocks:2"][:, -1] @ ref.visual.proj  # the last block's class token, as open_clip pools
    torch.testing.assert_close(projected, pooled, rtol=1e-5, atol=1e-6)
    assert (out["blocks:2"].shape, out["tokens@2x2"].shape) == ((4, 2, 64), (4, 4, 64))

    for d, cls in ((clip_dir, CLIPVisionModel), (dino_dir, Dinov2Model)):
        bb = backbones.create_backbone(f"hf:{d}", "dir")
        x = _digits(bb, 4)
        out = _run(bb, kinds, x)
        with torch.inference_mode():
            own = cls.from_pretrained(d).eval()(pixel_values=x)
        assert torch.equal(out["blocks:2"][:, -1], own.pooler_output)  # the library's own class token path
        if cls is Dinov2Model:  # its last_hidden_state is through the final layernorm
            assert torch.equal(out["tokens"], own.last_hidden_state[:, 1:])
        assert out["tokens"].shape == (4, 16, 32)


# --------------------------------------------------------------------------- the store size, before any image
def test_size_plan_arithmetic():
    size = plan_size({"train": 1000, "test": 10}, {"pooled": (64,), "tokens": (100, 64), "w": 8}, "float16")
    assert size.total == (1000 + 10) * (64 + 100 * 64 + 8) * 2
    resumed = plan_size({"train": 1000}, {"tokens": (100, 64)}, "float32", {("train", "tokens"): 0.25})
    assert resumed.total == 750 * 100 * 64 * 4
    text = size.describe()
    assert all(s in text for s in ("uncompressed", "train: pooled 1,000 x (64,)", "tokens 10 x (100, 64)"))
    assert [is_remote(c) for c in ("s3://bucket/c.zarr", "/tmp/c.zarr", "file:///tmp/c")] == [True, False, False]


def test_free_space_is_measured_at_the_nearest_existing_parent(tmp_path):
    free, where = free_bytes(str(tmp_path / "not" / "yet" / "c.zarr"))
    assert where == str(tmp_path)
    assert free > 0


def test_extract_refuses_before_any_image_when_the_disk_cannot_hold_the_store(tmp_path, monkeypatch, capsys):
    n, t, d = 50, 100, 64  # test_vit at 160 px: 10 x 10 patches of 64-d
    need = n * d * 2 + n * t * d * 2
    DU = namedtuple("DU", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DU(10**9, 10**9 - need + 1, need - 1))  # 1 byte short
    seen: list[int] = []
    real = backbones.create_backbone

    def counted(*a, **k):
        bb = real(*a, **k)
        bb.model.patch_embed.register_forward_hook(lambda m, i, o: seen.append(int(i[0].shape[0])))
        return bb

    monkeypatch.setattr(backbones, "create_backbone", counted)
    cache = tmp_path / "c.zarr"
    args = ["extract", "--model", "test_vit", "--weights", "random:0", "--data", "digits", "--split", "test"]
    args += ["--cache", str(cache), "--limit", str(n), "--features", "pooled,tokens", "--no-progress"]
    assert main(args) == 1
    cap = capsys.readouterr()
    (line,) = [x for x in cap.err.splitlines() if "error:" in x]
    assert all(s in line for s in (f"{need:,} bytes", "tokens@GxG", "--no-size-check"))
    assert f"at most 646.4 kB ({need:,} bytes) uncompressed" in cap.out
    assert "test: pooled 50 x (64,) = 6.4 kB, tokens 50 x (100, 64) = 640.0 kB" in cap.out
    assert seen == [1]  # the dims probe only: no image was read
    assert not cache.exists()  # nothing written: the failed job leaves no empty store behind (issue 60)
    from featcache.extract import ExtractConfig, extract

    cfg = ExtractConfig("test_vit", "random:0", "digits", ["test"], str(cache), features=["pooled", "tokens"], limit=n)
    with pytest.raises(NoSpaceError):  # the library call refuses the same way (its figure in the log)
        extract(cfg)


def test_a_malformed_token_kind_is_refused_by_the_config_before_any_model(monkeypatch):
    from featcache.extract import ExtractConfig

    monkeypatch.setattr(backbones, "create_backbone", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ConfigError, match=r"^feature kind 'tokens@4x2' is malformed: spell tokens@GxG") as e:
        ExtractConfig("test_vit", "random:0", "digits", cache="c.zarr", features=("pooled", "tokens@4x2"))
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_extract_cli_pooled_blocks_tokens_on_digits(tmp_path, capsys):
    """`featcache extract --features pooled,blocks:2,tokens` on digits: N-d arrays in the store,
    read back as [n, K, D] / [n, T, D], equal to the DINOv2 port on the same images."""
    from featcache.store import open_cache

    n, cache = 24, tmp_path / "c.zarr"
    args = ["extract", "--model", "test_vit", "--weights", "random:0", "--data", "digits", "--split", "test"]
    args += ["--cache", str(cache), "--limit", str(n), "--features", "pooled,blocks:2,tokens", "--dtype", "float32"]
    args += ["--batch-size", "8", "--chunk-rows", "16", "--no-progress"]
    assert main(args) == 0
    assert (
        "test: pooled 24 x (64,) = 6.1 kB, blocks:2 24 x (2, 64) = 12.3 kB, tokens 24 x (100, 64)"
        in capsys.readouterr().out
    )
    c, key = open_cache(str(cache)), "test_vit@random0"
    assert c.kinds(key, "digits", "test") == ["pooled", "blocks:2", "tokens"]
    f = {k: c.load(key, "digits", "test", kind=k) for k in ("pooled", "blocks:2", "tokens")}
    assert [f[k].X.shape for k in f] == [(n, 64), (n, 2, 64), (n, 100, 64)]
    bb = backbones.create_backbone("test_vit", "random:0")
    split = open_dataset("digits")["test"]
    x = torch.stack([bb.transform(split.load(i)) for i in range(n)])
    with torch.inference_mode():
        ref = dinov2_get_intermediate_layers(bb.model, x, n=2, return_class_token=True, norm=True)
        pooled = FeatureHead(bb, ["pooled"])(x)["pooled"]
    np.testing.assert_allclose(f["blocks:2"].X, torch.stack([c for _, c in ref], 1).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f["tokens"].X, ref[-1][0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f["pooled"].X, pooled.numpy(), rtol=1e-5, atol=1e-5)
    assert all(f[k].valid.all() for k in f)
    assert main(args) == 0  # complete: nothing left to write, so nothing needed
    assert (
        "test: pooled 0 x (64,) = 0 B, blocks:2 0 x (2, 64) = 0 B, tokens 0 x (100, 64) = 0 B"
        in capsys.readouterr().out
    )
