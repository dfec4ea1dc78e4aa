"""The dense extraction's joint image + target transforms (data/dense_geometry.py) against the
reference code that defines them: DINOv3's slide-window positions and its segmentation train
transform (facebookresearch/dinov3 6876159a11b4df116f30f667f8c9888617df0751), on Fashion-MNIST
mosaics."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from dense_mosaics import BACKGROUND, MosaicImage, MosaicMask, mosaic
from hypothesis import given, settings
from hypothesis import strategies as st

from featcache.data.dense_geometry import (
    DepthViewRows,
    ResizeRows,
    SegViewRows,
    WindowRows,
    default_stride,
    short_side_size,
    window_boxes,
)
from featcache.data.views import view_draw_seed
from featcache.errors import DataError

CFG = {
    "input_size": (3, 32, 32),
    "mean": (0.485, 0.456, 0.406),
    "std": (0.229, 0.224, 0.225),
    "interpolation": "bicubic",
}


def _pair(i: int, size=(56, 56)):
    return MosaicImage([size], i)(0), MosaicMask([size], i)(0)


# --- port of dinov3/eval/segmentation/inference.py:115-133 (slide_inference), positions only --------
def ref_slide_boxes(h_img, w_img, crop_size, stride):
    h_stride, w_stride = stride
    h_crop, w_crop = crop_size
    if h_crop > h_img and w_crop > w_img:
        h_crop, w_crop = min(h_img, w_img), min(h_img, w_img)
    h_grids = max(h_img - h_crop + h_stride - 1, 0) // h_stride + 1
    w_grids = max(w_img - w_crop + w_stride - 1, 0) // w_stride + 1
    out = []
    for h_idx in range(h_grids):
        for w_idx in range(w_grids):
            y1 = h_idx * h_stride
            x1 = w_idx * w_stride
            y2 = min(y1 + h_crop, h_img)
            x2 = min(x1 + w_crop, w_img)
            y1 = max(y2 - h_crop, 0)
            x1 = max(x2 - w_crop, 0)
            out.append((y1, x1, y2, x2))
    return out


@settings(max_examples=200, deadline=None)
@given(st.integers(8, 1500), st.integers(8, 1500), st.integers(16, 600), st.integers(16, 600))
def test_window_boxes_are_dinov3s_slide_positions(h, w, crop, stride_frac):
    stride = max(1, min(crop, stride_frac))
    assert window_boxes(h, w, (crop, crop), (stride, stride)) == ref_slide_boxes(h, w, (crop, crop), (stride, stride))


def test_ade_geometry_numbers():
    # FixedSideResize (transforms.py:177-184): (300, 400) -> (512, 683), the docstring's example
    assert short_side_size(300, 400, 512) == (512, 683)
    assert default_stride((512, 512)) == (341, 341)
    boxes = window_boxes(512, 683, (512, 512), (341, 341))
    assert boxes == [(0, 0, 512, 512), (0, 171, 512, 683)]


def test_each_window_is_the_same_crop_of_the_resized_image_and_target():
    img, mask = _pair(3, (56, 84))
    win = WindowRows(CFG)  # short side 32, windows 32 at stride 21
    rh, rw = win.resized(56, 84)
    assert (rh, rw) == (32, 48)
    full = WindowRows({**CFG, "input_size": (3, rh, rw)}, short_side=32)
    fx, ft = full(img, mask, 0, 0, 0)  # the whole resized image as one window
    boxes = win.boxes(56, 84)
    assert boxes == ref_slide_boxes(32, 48, (32, 32), (21, 21))
    for y1, x1, y2, x2 in boxes:
        x, t = win(img, mask, 0, y1, x1)
        assert x.shape == (3, 32, 32)
        assert t.shape == (32, 32)
        assert t.dtype == np.uint8
        np.testing.assert_array_equal(x, fx[:, y1:y2, x1:x2])
        np.testing.assert_array_equal(t, ft[y1:y2, x1:x2])


def test_resize_and_flip_rows():
    img, mask = _pair(5)
    x, t = ResizeRows(CFG)(img, mask, 0)
    xf, tf = ResizeRows(CFG, flip=True)(img, mask, 0)
    assert x.shape == (3, 32, 32)
    assert x.dtype == np.float32
    assert t.shape == (32, 32)
    # nearest: every target value is one of the mask's, at the nearest source pixel (torch's rule)
    idx = (np.arange(32) * 56) // 32
    np.testing.assert_array_equal(t, mask[idx][:, idx])
    np.testing.assert_array_equal(xf, x[:, :, ::-1])
    np.testing.assert_array_equal(tf, t[:, ::-1])
    with pytest.raises(DataError, match="its image's own size"):
        ResizeRows(CFG)(img, mask[:40], 0)


# --- port of dinov3/eval/segmentation/transforms.py: PhotoMetricDistortion (21-101),
# FixedSideResize (172-196), RandomCropWithLabel (257-309), MaybeApplyImageLabel (116-134),
# NormalizeImage (353-359), PadTensor (336-350), in make_segmentation_train_transforms' order
# (391-440); the global numpy stream, as the reference draws it ------------------------------------
def ref_seg_train(img, label, img_size, crop_size, mean, std, ignore_index=255):
    import torch
    import torch.nn.functional as F
    from torchvision import transforms as T
    from torchvision.transforms import functional as Fv

    label = torch.from_numpy(label)[None]  # MaskToTensor
    ratio = np.random.random_sample() * (2.0 - 0.5) + 0.5  # noqa: NPY002 (the reference draws from the global stream)
    small = int(img_size * ratio)
    init_width, init_height = img.size
    if init_height > init_width:
        new_width, new_height = small, int(small * init_height / init_width + 0.5)
    else:
        new_height, new_width = small, int(small * init_width / init_height + 0.5)
    img = T.Resize(size=(new_height, new_width), interpolation=T.InterpolationMode.BILINEAR)(img)
    label = T.Resize(size=(new_height, new_width), interpolation=T.InterpolationMode.NEAREST)(label)
    img = torch.from_numpy(np.array(img)).permute(2, 0, 1)  # PILToTensor

    def get_crop_bbox(im):
        margin_h = max(im.shape[-2] - crop_size[0], 0)
        margin_w = max(im.shape[-1] - crop_size[1], 0)
        offset_h = np.random.randint(0, margin_h + 1)  # noqa: NPY002 (the reference draws from the global stream)
        offset_w = np.random.randint(0, margin_w + 1)  # noqa: NPY002 (the reference draws from the global stream)
        return offset_h, offset_h + crop_size[0], offset_w, offset_w + crop_size[1]

    def crop(im, b):
        return im[:, b[0] : b[1], b[2] : b[3]]

    box = get_crop_bbox(img)
    for _ in range(10):
        labels, cnt = np.unique(crop(label, box), return_counts=True)
        cnt = cnt[labels != ignore_index]
        if len(cnt) > 1 and np.max(cnt) / np.sum(cnt) < 0.75:
            break
        box = get_crop_bbox(img)
    img, label = crop(img, box), crop(label, box)
    if np.random.rand() < 0.5:  # noqa: NPY002 (the reference draws from the global stream)
        img, label = Fv.hflip(img), Fv.hflip(label)
    img = ref_photometric(img.permute((1, 2, 0)).numpy())
    img = torch.tensor(img.astype(np.float32)).permute((2, 0, 1))
    img = T.Normalize(mean=[m * 255 for m in mean], std=[s * 255 for s in std])(img.float())
    h, w = img.shape[-2:]
    new_h, new_w = crop_size[0] - h, crop_size[1] - w
    img = F.pad(input=img, pad=(0, new_w, 0, new_h), mode="constant", value=0)
    label = F.pad(input=label, pad=(0, new_w, 0, new_h), mode="constant", value=ignore_index)
    return img.numpy(), label[0].numpy()


def ref_photometric(img):
    import torch
    from torchvision.transforms import functional as Fv

    def convert(im, alpha=1.0, beta=0.0):
        im = im.astype(np.float32) * alpha + beta
        return np.clip(im, 0, 255).astype(np.uint8)

    def contrast(im):
        if np.random.randint(2):  # noqa: NPY002 (the reference draws from the global stream)
            return convert(im, alpha=np.random.uniform(0.5, 1.5))  # noqa: NPY002 (the reference draws from the global stream)
        return im

    if np.random.randint(2):  # noqa: NPY002 (the reference draws from the global stream)
        img = convert(img, beta=np.random.uniform(-32, 32))  # noqa: NPY002 (the reference draws from the global stream)
    mode = np.random.randint(2)  # noqa: NPY002 (the reference draws from the global stream)
    if mode == 1:
        img = contrast(img)
    if np.random.randint(2):  # noqa: NPY002 (the reference draws from the global stream)
        f = np.random.uniform(0.5, 1.5)  # noqa: NPY002 (the reference draws from the global stream)
        img = Fv.adjust_saturation(torch.tensor(img.astype(np.uint8)).permute((2, 0, 1)), f).permute((1, 2, 0)).numpy()
    if np.random.randint(2):  # noqa: NPY002 (the reference draws from the global stream)
        f = np.random.uniform(-0.5, 0.5)  # noqa: NPY002 (the reference draws from the global stream)
        img = Fv.adjust_hue(torch.tensor(img.astype(np.uint8)).permute((2, 0, 1)), f).permute((1, 2, 0)).numpy()
    if mode == 0:
        img = contrast(img)
    return img


@pytest.mark.parametrize("threads", [1, 2])
def test_seg_view_equals_dinov3s_train_transform(threads):
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for row, size in enumerate([(56, 56), (56, 84), (70, 42), (56, 56), (56, 56), (48, 64)]):
            img, mask = _pair(row, size)
            view = SegViewRows(CFG, seed=7, view=2)
            x, t = view(img, mask, row)
            np.random.seed(view_draw_seed(7, 2, row) % 2**32)  # noqa: NPY002 (the reference draws from the global stream)
            rx, rt = ref_seg_train(img, mask, 32, (32, 32), CFG["mean"], CFG["std"])
            assert x.shape == (3, 32, 32)
            assert t.shape == (32, 32)
            np.testing.assert_array_equal(t, rt)
            np.testing.assert_array_equal(x, rx)
    finally:
        torch.set_num_threads(old)


def test_seg_views_pad_with_the_ignore_index_and_differ_by_view():
    img, mask = _pair(1)
    outs = [SegViewRows(CFG, seed=0, view=v)(img, mask, 0) for v in range(8)]
    assert any(not np.array_equal(outs[0][1], o[1]) for o in outs[1:])
    again = SegViewRows(CFG, seed=0, view=3)(img, mask, 0)
    np.testing.assert_array_equal(again[0], outs[3][0])
    for x, t in outs:  # padded where the random scale made the image smaller than the crop
        pad = t == 255
        assert set(np.unique(t[~pad])) <= set(np.unique(mask))
        assert np.all(x[:, pad] == 0)


def test_depth_view_moves_depth_with_the_image():
    from dense_mosaics import MosaicDepth

    size = (60, 80)
    img, depth = MosaicImage([size], 2)(0), MosaicDepth([size], 2)(0)
    cfg = {**CFG, "input_size": (3, 32, 40)}
    outs = [DepthViewRows(cfg, seed=1, view=v, nyu_crop=True)(img, depth, 0) for v in range(6)]
    values = set(np.unique(depth).tolist())
    for x, d in outs:
        assert x.shape == (3, 32, 40)
        assert d.shape == (32, 40)
        assert d.dtype == np.float32
        assert set(np.unique(d).tolist()) <= values  # nearest: no new depth values; 0 where rotated in
    again = DepthViewRows(cfg, seed=1, view=4)(img, depth, 0)
    np.testing.assert_array_equal(again[1], outs[4][1])
    assert any(not np.array_equal(outs[0][1], o[1]) for o in outs[1:])


def test_transforms_pickle():
    img, mask = _pair(0)
    for tf in (ResizeRows(CFG), WindowRows(CFG), SegViewRows(CFG, 0, 1), DepthViewRows(CFG, 0, 1)):
        back = pickle.loads(pickle.dumps(tf))
        assert back.spec() == tf.spec()
    a = SegViewRows(CFG, 0, 1)
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(a))(img, mask, 4)[1], a(img, mask, 4)[1])
    assert BACKGROUND in np.unique(mosaic(0)[1])
