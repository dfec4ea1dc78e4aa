"""Joint image + target transforms of the dense extraction (issue 57): how a stored dense row
is cut from its image and its per-pixel target, each a picklable class (DataLoader workers).

- :class:`ResizeRows` (``resize``): the image resized to the model's input size with the data
  config's interpolation (antialiased), the target resized by nearest to the same size, as
  open-hummingbird-eval evaluates (``hbird/utils/transforms.py:215-236``
  ``get_hbird_val_transforms`` and ``hbird/utils/image_transformations.py:52-68``
  ``_resize_pair``, vpariza/open-hummingbird-eval 5e79da2); ``flip=True`` is the ``flip``
  geometry: the same row flipped horizontally, image and target.
- :class:`WindowRows` (``win``): DINOv3's slide mode: the image's short side resized to
  ``short_side`` (``FixedSideResize``), windows of ``window`` at ``stride`` placed by
  :func:`window_boxes` (``dinov3/eval/segmentation/inference.py:115-132``); the target gets the
  same nearest resize and crop.
- :class:`SegViewRows` (``view``): DINOv3's segmentation train transform
  (``dinov3/eval/segmentation/transforms.py:391-440``: random short-side resize in
  ``[0.5, 2.0] x img_size``, random crop with ``cat_max_ratio`` 0.75, flip 0.5, photometric
  distortion, normalise, pad with 0 / the ignore index), scaled so ``img_size`` and the crop are
  the model's input size; :class:`DepthViewRows`: DINOv3's NYU depth train transform
  (``dinov3/eval/depth/transforms.py:306-355``: NYU fixed crop, rotation 2.5 deg p 0.5, flip,
  random crop 416 x 544, colour augmentation p 0.5 with brightness 0.75-1.25), the crop scaled
  to the input size. Geometric ops move the target identically (nearest), photometric ops touch
  the image only.

A view's draws come from a ``numpy.random.RandomState`` and torch's CPU generator, both seeded
with :func:`featcache.data.views.view_draw_seed` of (seed, view, row) (numpy's 32-bit seed: its
value mod 2**32), so a view does not depend on the batch, the worker or a resume; the numpy draws
are the reference's ``np.random`` calls in its order. Every transform returns the normalised
image ``float32 [3, H, W]`` and the target ``[H, W]`` (its dtype kept).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from featcache.data.views import view_draw_seed
from featcache.errors import DataError

__all__ = [
    "DepthViewRows",
    "ResizeRows",
    "SegViewRows",
    "WindowRows",
    "default_stride",
    "image_size",
    "photometric_distortion",
    "resize_target",
    "short_side_size",
    "window_boxes",
]

#: DINOv3's ADE20K linear recipe (``configs/config-ade20k-linear-training.yaml``)
SEG_RATIO_RANGE = (0.5, 2.0)
SEG_CAT_MAX_RATIO = 0.75
SEG_FLIP_P = 0.5
#: DINOv3's NYU recipe (``dinov3/eval/depth/configs/config-nyu.yaml``, ``transforms.py``)
NYU_CROP_BOX = (43, 45, 608, 472)  # x1, y1, x2, y2 of a 640 x 480 image
NYU_RANDOM_CROP = (416, 544)
DEPTH_ROTATION = 2.5
DEPTH_BRIGHTNESS = (0.75, 1.25)


def short_side_size(h: int, w: int, short: int) -> tuple[int, int]:
    """``(new_h, new_w)`` with the short side ``short``, as DINOv3's ``FixedSideResize._resize``
    (``dinov3/eval/segmentation/transforms.py:177-184``; a square image keeps ``short``)."""
    if h > w:
        return int(short * h / w + 0.5), short
    return short, int(short * w / h + 0.5)


def default_stride(window: Sequence[int]) -> tuple[int, int]:
    """DINOv3's stride for a window: two thirds of it (512 -> 341)."""
    return int(window[0]) * 2 // 3, int(window[1]) * 2 // 3


def window_boxes(h_img: int, w_img: int, crop: Sequence[int], stride: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """The ``(y1, x1, y2, x2)`` windows of an ``h_img x w_img`` image, in DINOv3's order and
    arithmetic (``dinov3/eval/segmentation/inference.py:115-132``, ``slide_inference``).

    >>> window_boxes(512, 683, (512, 512), (341, 341))
    [(0, 0, 512, 512), (0, 171, 512, 683)]
    """
    h_stride, w_stride = int(stride[0]), int(stride[1])
    h_crop, w_crop = int(crop[0]), int(crop[1])
    if h_crop > h_img and w_crop > w_img:
        h_crop, w_crop = min(h_img, w_img), min(h_img, w_img)
    h_grids = max(h_img - h_crop + h_stride - 1, 0) // h_stride + 1
    w_grids = max(w_img - w_crop + w_stride - 1, 0) // w_stride + 1
    out = []
    for h_idx in range(h_grids):
        for w_idx in range(w_grids):
            y1, x1 = h_idx * h_stride, w_idx * w_stride
            y2, x2 = min(y1 + h_crop, h_img), min(x1 + w_crop, w_img)
            out.append((max(y2 - h_crop, 0), max(x2 - w_crop, 0), y2, x2))
    return out


def _interp(name: str | None) -> Any:
    from torchvision.transforms import InterpolationMode

    return InterpolationMode(name or "bilinear")


def _resize_image(img: Any, size: Sequence[int], interpolation: str | None) -> np.ndarray:
    """A PIL image resized to ``(h, w)`` (antialiased) -> ``uint8 [h, w, 3]``."""
    from torchvision.transforms import functional as F

    out = F.resize(img.convert("RGB"), [int(size[0]), int(size[1])], interpolation=_interp(interpolation))
    return np.array(out, dtype=np.uint8)


def resize_target(target: np.ndarray, size: Sequence[int]) -> np.ndarray:
    """``[H, W]`` target -> ``[h, w]`` by nearest (torchvision's tensor ``resize``, as both
    references resize their labels), dtype kept."""
    import torch
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    a = np.asarray(target)
    if tuple(a.shape) == (int(size[0]), int(size[1])):
        return a.copy()
    wide = a.astype(np.int32) if a.dtype == np.uint16 else a  # torch has no uint16 resize
    t = torch.from_numpy(np.ascontiguousarray(wide))[None]
    out = F.resize(t, [int(size[0]), int(size[1])], interpolation=InterpolationMode.NEAREST)[0].numpy()
    return out.astype(a.dtype, copy=False)


class _Normalise:
    """uint8 ``[H, W, 3]`` -> float32 ``[3, H, W]``: ``ToTensor`` + ``Normalize(mean, std)``."""

    def __init__(self, data_config: Mapping[str, Any]):
        missing = [k for k in ("input_size", "mean", "std") if k not in data_config]
        if missing:
            raise DataError(f"dense extraction needs the model's timm data config; it lacks {missing}")
        self.size = tuple(int(s) for s in data_config["input_size"][-2:])
        self.interpolation = data_config.get("interpolation") or "bilinear"
        self.mean = np.asarray(data_config["mean"], dtype=np.float32)
        self.std = np.asarray(data_config["std"], dtype=np.float32)
        # DINOv3's segmentation NormalizeImage: mean * 255 and std * 255 in Python, then float32
        self.mean255 = np.asarray([float(m) * 255 for m in data_config["mean"]], dtype=np.float32)
        self.std255 = np.asarray([float(s) * 255 for s in data_config["std"]], dtype=np.float32)

    def __call__(self, a: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(a.transpose(2, 0, 1)).astype(np.float32) / np.float32(255)
        return ((x - self.mean[:, None, None]) / self.std[:, None, None]).astype(np.float32)


class ResizeRows(_Normalise):
    """The ``resize`` geometry (``flip=True``: ``flip``): ``(img, target, row) -> (x, target)``."""

    def __init__(self, data_config: Mapping[str, Any], flip: bool = False):
        super().__init__(data_config)
        self.flip = bool(flip)
        self.name = "flip" if flip else "resize"

    def __call__(self, img: Any, target: np.ndarray, row: int = 0) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[override]
        image_size(img, target)
        a = _resize_image(img, self.size, self.interpolation)
        t = resize_target(target, self.size)
        if self.flip:
            a, t = a[:, ::-1], t[:, ::-1]
        return super().__call__(np.ascontiguousarray(a)), np.ascontiguousarray(t)

    def spec(self) -> dict[str, Any]:
        """What the group's provenance records (``Geometry.params``)."""
        steps = [f"Resize({list(self.size)}, {self.interpolation}, antialias) / target nearest"]
        return {"transform": " + ".join(steps + (["HorizontalFlip"] if self.flip else [])), "flip": self.flip}


class WindowRows(_Normalise):
    """The ``win`` geometry: image and target resized to ``short_side`` (DINOv3: bilinear image,
    nearest target), then window ``(y0, x0)`` cut; a window past a resized side (a non-square
    window on an image narrower than it) is padded with 0 (normalised) / ``pad_value``."""

    def __init__(
        self,
        data_config: Mapping[str, Any],
        short_side: int | None = None,
        stride: Sequence[int] | None = None,
        pad_value: float = 0,
    ):
        super().__init__(data_config)
        self.window = self.size
        self.short_side = int(short_side or min(self.size))
        self.stride = tuple(int(s) for s in (stride or default_stride(self.window)))
        self.pad_value = pad_value
        self.name = "win"
        self._last: tuple[int, np.ndarray, np.ndarray] | None = None  # one decoded image kept

    def resized(self, h: int, w: int) -> tuple[int, int]:
        """The resized size of an ``h x w`` image."""
        return short_side_size(h, w, self.short_side)

    def boxes(self, h: int, w: int) -> list[tuple[int, int, int, int]]:
        """The windows of an ``h x w`` original image (in resized coordinates)."""
        return window_boxes(*self.resized(h, w), self.window, self.stride)

    def __call__(
        self, img: Any, target: np.ndarray, row: int, y0: int = 0, x0: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[override]
        if self._last is None or self._last[0] != row:
            size = self.resized(*image_size(img, target))
            self._last = (row, _resize_image(img, size, "bilinear"), resize_target(target, size))
        _, a, t = self._last
        wh, ww = self.window
        x = super().__call__(np.ascontiguousarray(a[y0 : y0 + wh, x0 : x0 + ww]))
        t = t[y0 : y0 + wh, x0 : x0 + ww]
        if x.shape[1:] != (wh, ww):
            x = np.pad(x, ((0, 0), (0, wh - x.shape[1]), (0, ww - x.shape[2])))
            t = np.pad(t, ((0, wh - t.shape[0]), (0, ww - t.shape[1])), constant_values=self.pad_value)
        return x, np.ascontiguousarray(t)

    def spec(self) -> dict[str, Any]:
        """What the group's provenance records (``Geometry.params``)."""
        return {
            "transform": "FixedSideResize(short_side, bilinear) / target nearest + slide windows (DINOv3 slide mode)",
            "short_side": self.short_side,
            "window": list(self.window),
            "stride": list(self.stride),
        }


def image_size(img: Any, target: np.ndarray) -> tuple[int, int]:
    """``(h, w)`` of a PIL image, refused in one line when its target has another size."""
    w, h = img.size
    if tuple(np.shape(target)[:2]) != (h, w):
        raise DataError(
            f"the target is {np.shape(target)[1]}x{np.shape(target)[0]} but its image is {w}x{h}: a dense "
            "reader gives each target at its image's own size"
        )
    return int(h), int(w)


def _rngs(seed: int, view: int, row: int) -> tuple[np.random.RandomState, int]:
    s = view_draw_seed(seed, view, row)
    return np.random.RandomState(s % 2**32), s


class SegViewRows(_Normalise):
    """DINOv3's segmentation train transform at the model's input size (module docstring)."""

    def __init__(self, data_config: Mapping[str, Any], seed: int, view: int, ignore_index: int = 255):
        super().__init__(data_config)
        self.seed, self.view, self.ignore_index = int(seed), int(view), int(ignore_index)
        self.img_size = min(self.size)
        self.name = f"view{self.view}"

    def __call__(self, img: Any, target: np.ndarray, row: int) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[override]
        rng, _ = _rngs(self.seed, self.view, row)
        lo, hi = SEG_RATIO_RANGE
        small = int(self.img_size * (rng.random_sample() * (hi - lo) + lo))
        size = short_side_size(*image_size(img, target), small)
        a = _resize_image(img, size, "bilinear")
        t = resize_target(target, size)
        y1, y2, x1, x2 = self._crop_box(rng, t)
        a, t = a[y1:y2, x1:x2], t[y1:y2, x1:x2]
        if rng.rand() < SEG_FLIP_P:
            a, t = a[:, ::-1], t[:, ::-1]
        a = photometric_distortion(np.ascontiguousarray(a), rng)
        x = (a.transpose(2, 0, 1).astype(np.float32) - self.mean255[:, None, None]) / self.std255[:, None, None]
        ph, pw = self.size[0] - x.shape[1], self.size[1] - x.shape[2]
        x = np.pad(x, ((0, 0), (0, ph), (0, pw)))
        t = np.pad(t, ((0, ph), (0, pw)), constant_values=self.ignore_index)
        return x.astype(np.float32), np.ascontiguousarray(t)

    def _crop_box(self, rng: np.random.RandomState, label: np.ndarray) -> tuple[int, int, int, int]:
        """``RandomCropWithLabel`` (``transforms.py:276-309``): up to 10 redraws while one class
        holds ``cat_max_ratio`` or more of the crop's labelled pixels."""
        ch, cw = self.size

        def draw() -> tuple[int, int, int, int]:
            oh = rng.randint(0, max(label.shape[0] - ch, 0) + 1)
            ow = rng.randint(0, max(label.shape[1] - cw, 0) + 1)
            return oh, oh + ch, ow, ow + cw

        box = draw()
        for _ in range(10):
            ids, cnt = np.unique(label[box[0] : box[1], box[2] : box[3]], return_counts=True)
            cnt = cnt[ids != self.ignore_index]
            if len(cnt) > 1 and np.max(cnt) / np.sum(cnt) < SEG_CAT_MAX_RATIO:
                break
            box = draw()
        return box

    def spec(self) -> dict[str, Any]:
        """The transform, seed and index (as :meth:`ViewTransform.spec`)."""
        return {
            "transform": (
                f"DINOv3 segmentation train: FixedSideResize({self.img_size} x U{list(SEG_RATIO_RANGE)}, bilinear) "
                f"+ RandomCropWithLabel({list(self.size)}, cat_max_ratio={SEG_CAT_MAX_RATIO}) + HFlip({SEG_FLIP_P}) "
                f"+ PhotoMetricDistortion + Normalize + Pad(0 / {self.ignore_index})"
            ),
            "seed": self.seed,
            "index": self.view,
            "draws": "numpy RandomState(SeedSequence([seed, index, row]) mod 2**32) per image, in the reference's order",
        }


def photometric_distortion(img: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    """DINOv3's ``PhotoMetricDistortion`` (``transforms.py:21-101``) on ``uint8 [H, W, 3]``."""
    import torch
    from torchvision.transforms import functional as Fv

    def convert(a: np.ndarray, alpha: float = 1.0, beta: float = 0.0) -> np.ndarray:
        return np.clip(a.astype(np.float32) * alpha + beta, 0, 255).astype(np.uint8)

    def contrast(a: np.ndarray) -> np.ndarray:
        return convert(a, alpha=rng.uniform(0.5, 1.5)) if rng.randint(2) else a

    def tensor_op(a: np.ndarray, fn: Any, lo: float, hi: float) -> np.ndarray:
        if rng.randint(2):
            f = rng.uniform(lo, hi)
            return fn(torch.tensor(a.astype(np.uint8)).permute((2, 0, 1)), f).permute((1, 2, 0)).numpy()
        return a

    if rng.randint(2):
        img = convert(img, beta=rng.uniform(-32, 32))
    mode = rng.randint(2)
    if mode == 1:
        img = contrast(img)
    img = tensor_op(img, Fv.adjust_saturation, 0.5, 1.5)
    img = tensor_op(img, Fv.adjust_hue, -0.5, 0.5)
    if mode == 0:
        img = contrast(img)
    return img


class DepthViewRows(_Normalise):
    """DINOv3's NYU depth train transform, its random crop scaled to the input size (module
    docstring): ``(img, depth, row) -> (x, depth)``; depth moves by nearest, 0 where rotated in."""

    def __init__(self, data_config: Mapping[str, Any], seed: int, view: int, nyu_crop: bool = True):
        super().__init__(data_config)
        self.seed, self.view, self.nyu_crop = int(seed), int(view), bool(nyu_crop)
        self.name = f"view{self.view}"

    def __call__(self, img: Any, target: np.ndarray, row: int) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[override]
        import torch

        rng, s = _rngs(self.seed, self.view, row)
        image_size(img, target)
        a = np.array(img.convert("RGB"), dtype=np.uint8)
        d = np.asarray(target, dtype=np.float32)
        if self.nyu_crop:  # NYUCrop (transforms.py:180-205), scaled to the image's size
            h, w = d.shape
            x1, y1, x2, y2 = NYU_CROP_BOX
            ys, xs = slice(int(y1 / 480 * h), int(y2 / 480 * h)), slice(int(x1 / 640 * w), int(x2 / 640 * w))
            a, d = a[ys, xs], d[ys, xs]
        sh, sw = self.size[0] / NYU_RANDOM_CROP[0], self.size[1] / NYU_RANDOM_CROP[1]
        size = (max(self.size[0], round(d.shape[0] * sh)), max(self.size[1], round(d.shape[1] * sw)))
        a, d = _resize_image(_pil(a), size, "bilinear"), resize_target(d, size)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(s)
            a, d = self._geometric(rng, a, d)
        x = a.astype(np.float32).transpose(2, 0, 1) / np.float32(255)
        x = _colour_aug(x, rng)
        return ((x - self.mean[:, None, None]) / self.std[:, None, None]).astype(np.float32), np.ascontiguousarray(d)

    def _geometric(self, rng: np.random.RandomState, a: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rotation (p 0.5, bilinear image, nearest depth), flip 0.5, random crop: torch draws."""
        import torch
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms import functional as F

        if rng.rand() < 0.5:
            angle = float(torch.empty(1).uniform_(-DEPTH_ROTATION, DEPTH_ROTATION).item())
            a = np.asarray(F.rotate(_pil(a), angle, interpolation=InterpolationMode.BILINEAR), dtype=np.uint8)
            d = F.rotate(torch.from_numpy(d)[None], angle, interpolation=InterpolationMode.NEAREST)[0].numpy()
        if torch.rand(1) < 0.5:
            a, d = a[:, ::-1], d[:, ::-1]
        ch, cw = self.size
        i = int(torch.randint(0, d.shape[0] - ch + 1, size=(1,)).item())
        j = int(torch.randint(0, d.shape[1] - cw + 1, size=(1,)).item())
        return np.ascontiguousarray(a[i : i + ch, j : j + cw]), np.ascontiguousarray(d[i : i + ch, j : j + cw])

    def spec(self) -> dict[str, Any]:
        """The transform, seed and index (as :meth:`ViewTransform.spec`)."""
        return {
            "transform": (
                f"DINOv3 NYU depth train: NYUCrop{list(NYU_CROP_BOX) if self.nyu_crop else '(off)'} + Resize(x "
                f"{list(self.size)}/{list(NYU_RANDOM_CROP)}) + Rotate(+-{DEPTH_ROTATION}, p 0.5) + HFlip(0.5) + "
                f"RandomCrop({list(self.size)}) + ColorAug(p 0.5, brightness {list(DEPTH_BRIGHTNESS)}) + Normalize"
            ),
            "seed": self.seed,
            "index": self.view,
            "draws": "numpy RandomState and torch CPU generator seeded with SeedSequence([seed, index, row]) per image",
        }


def _pil(a: np.ndarray) -> Any:
    from PIL import Image

    return Image.fromarray(np.ascontiguousarray(a))


def _colour_aug(x: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    """DINOv3's depth ``ColorAug`` (``transforms.py:35-84``) on float ``[3, H, W]`` in [0, 1]."""
    if not rng.rand() < 0.5:
        return x
    image = x.transpose(1, 2, 0) * 255
    gamma = rng.uniform(0.9, 1.1)
    out = image**gamma * rng.uniform(*DEPTH_BRIGHTNESS)
    out = out * rng.uniform(0.9, 1.1, size=3)[None, None, :]
    return (np.clip(out, 0, 255) / 255).transpose(2, 0, 1).astype(np.float32)
