"""The pipeline's fast preprocessing (uint8 per image, normalised per batch) gives exactly the
values of the full per-image eval transform, for real images in every mode the readers meet."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from featcache.data.preprocess import split_transform
from featcache.data.readers import open_dataset, select_splits
from featcache.models.backbones import make_transform

LITE0_CFG = {
    "input_size": (3, 224, 224),
    "interpolation": "bicubic",
    "crop_pct": 0.875,
    "crop_mode": "center",
    "mean": (0.5, 0.5, 0.5),
    "std": (0.5, 0.5, 0.5),
}
IMAGENET_CFG = {
    "input_size": (3, 224, 224),
    "interpolation": "bilinear",
    "crop_pct": 0.95,
    "crop_mode": "center",
    "mean": (0.485, 0.456, 0.406),
    "std": (0.229, 0.224, 0.225),
}


def _real_images() -> list[Image.Image]:
    """Fashion-MNIST (grayscale 28x28) and digits images, and the modes files come in."""
    fm = select_splits(open_dataset("fashion-mnist"), ["test"])[0]
    dg = select_splits(open_dataset("digits"), None)[0]
    base = [fm.load(i) for i in range(6)] + [dg.load(i) for i in range(3)]
    big = fm.load(7).resize((61, 40), Image.BICUBIC)  # not square, not the target size
    rgb = Image.merge("RGB", [fm.load(8), fm.load(9), fm.load(10)])
    buf = io.BytesIO()
    rgb.save(buf, format="JPEG", quality=90)
    jpeg = Image.open(io.BytesIO(buf.getvalue()))
    arr16 = (np.asarray(fm.load(11), np.uint16) * 257).astype("<u2")
    img16 = Image.frombytes("I;16", arr16.shape[::-1], arr16.tobytes())
    extra = [
        big,
        rgb,
        jpeg,
        rgb.convert("RGBA"),
        rgb.convert("P", palette=Image.ADAPTIVE),
        rgb.convert("CMYK"),
        img16,
        big.convert("1"),
        big.convert("LA"),
    ]
    return base + extra


@pytest.mark.parametrize("cfg", [LITE0_CFG, IMAGENET_CFG], ids=["lite0", "imagenet"])
@pytest.mark.parametrize(("size", "pre_resize"), [(32, None), (112, None), (224, None), (112, 32)])
def test_fast_path_is_bit_identical_to_the_transform(cfg, size, pre_resize):
    t = make_transform(cfg, input_size=size, pre_resize=pre_resize)
    fast = split_transform(t)
    assert fast is not None, t
    imgs = _real_images()
    want = torch.stack([t(im) for im in imgs])
    u8 = torch.stack([torch.from_numpy(fast(im)) for im in imgs])
    assert u8.dtype == torch.uint8
    assert tuple(u8.shape) == (len(imgs), size, size, 3)
    for channels_last in (True, False):
        got = fast.normalize(u8, channels_last)
        assert got.dtype == torch.float32
        assert got.shape == want.shape
        assert got.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        assert torch.equal(got, want)  # bit for bit, every image and mode


def test_other_transforms_are_not_split():
    from torchvision import transforms as T

    assert split_transform(T.Compose([T.Resize(8), T.ToTensor()])) is None
    t = make_transform(LITE0_CFG, input_size=32)
    assert split_transform(T.Compose([t, T.RandomHorizontalFlip()])) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_normalisation_matches_cpu():
    t = make_transform(IMAGENET_CFG, input_size=112)
    fast = split_transform(t)
    u8 = torch.stack([torch.from_numpy(fast(im)) for im in _real_images()])
    assert torch.equal(fast.normalize(u8.cuda(), True).cpu(), fast.normalize(u8, True))
