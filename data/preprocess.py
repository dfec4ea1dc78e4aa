"""Fast path of the eval transform for bulk extraction: uint8 per image, float per batch.

timm's eval transform ends in ``ToTensor`` + ``Normalize``, run per image: a permute copy,
a float conversion, a division and the normalisation, each a pass over a float image, plus
per-image Python overhead. :func:`split_transform` cuts the same transform (built by
:func:`featcache.models.model.make_transform` from timm's resolved data config) into

* a per-image part, PIL image -> ``uint8`` array ``[H, W, 3]`` (the resize/crop steps), and
* :meth:`FastPreprocess.normalize`, run once per batch on the stacked ``uint8`` tensor with
  the same element-wise operations in the same order (``float``, ``/ 255``, ``- mean``,
  ``/ std``), so every value is bit-identical to ``transform(img)`` (tested). The batch comes
  out NHWC in memory, i.e. already ``channels_last``; on CUDA the ``uint8`` batch (4x
  smaller) is uploaded and normalised on the GPU.

Grayscale ('L') images are resized and cropped before the RGB conversion (one band instead
of three; PIL resamples each band with the same coefficients, so the values are identical).
The whole-image resize (``--resize whole``, VTAB: ``Resize((H, W))`` + ``ToTensor`` +
``Normalize``, no crop) has the same shape and takes the same path (tested bit-identical).
Transforms of any other shape are not split (:func:`split_transform` returns ``None``) and the
pipeline runs them per image as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from featcache.errors import DataError

__all__ = ["FastPreprocess", "split_transform"]


def _flatten(t: Any) -> list[Any]:
    inner = getattr(t, "transforms", None)
    if inner is None:
        return [t]
    return [s for step in inner for s in _flatten(step)]


class FastPreprocess:
    """PIL image -> ``uint8 [H, W, 3]`` (picklable for DataLoader workers), and the batched
    normalisation that completes the transform."""

    def __init__(
        self, to_rgb: Any, geometric: list[Any], mean: tuple[float, ...], std: tuple[float, ...], gray_first: bool
    ):
        self.to_rgb = to_rgb
        self.geometric = geometric
        self.mean = mean
        self.std = std
        self.gray_first = gray_first

    def __call__(self, img: Any) -> np.ndarray:
        if self.gray_first and getattr(img, "mode", None) == "L":
            for step in self.geometric:
                img = step(img)
            a = np.asarray(img, dtype=np.uint8)
            return np.stack([a, a, a], axis=-1)
        img = self.to_rgb(img)
        for step in self.geometric:
            img = step(img)
        if getattr(img, "mode", None) != "RGB":
            raise DataError(f"expected an RGB image after the transform, got mode {img.mode!r}")
        return np.array(img, dtype=np.uint8)  # a writable copy (torch.from_numpy)

    def normalize(self, x: Any, channels_last: bool = True) -> Any:
        """``uint8 [B, H, W, C]`` tensor -> normalised float32 ``[B, C, H, W]`` (NHWC memory
        when ``channels_last``), bit-identical to stacking ``transform(img)``.

        On the CPU each image is normalised on its own (it stays in cache through the four
        element-wise steps) as rows of ``W * C`` values against the mean and std repeated W
        times, so every inner loop is long and vectorised; on a GPU the whole batch at once.
        """
        import torch

        n, h, w, c = x.shape
        if x.device.type == "cpu":
            y = torch.empty((n, h, w, c), dtype=torch.float32)
            mean = torch.tensor(self.mean, dtype=torch.float32).repeat(w)
            std = torch.tensor(self.std, dtype=torch.float32).repeat(w)
            for i in range(n):
                yi = y[i].view(h, w * c)
                yi.copy_(x[i].reshape(h, w * c))
                yi.div_(255).sub_(mean).div_(std)
            y = y.permute(0, 3, 1, 2)
        else:
            y = x.permute(0, 3, 1, 2).to(torch.float32).div_(255)
            y.sub_(torch.tensor(self.mean, dtype=torch.float32, device=y.device).view(1, -1, 1, 1))
            y.div_(torch.tensor(self.std, dtype=torch.float32, device=y.device).view(1, -1, 1, 1))
        return y if channels_last else y.contiguous()

    def __repr__(self) -> str:
        return f"FastPreprocess({self.geometric}, mean={self.mean}, std={self.std}, gray_first={self.gray_first})"


def split_transform(transform: Any) -> FastPreprocess | None:
    """The fast form of ``transform`` if it is [ToRGB, (Resize | CenterCrop)*, ToTensor,
    Normalize] (what :func:`~featcache.models.model.make_transform` builds for timm's
    eval configs), else ``None``."""
    from torchvision import transforms as T

    from featcache.models.model import ToRGB

    steps = _flatten(transform)
    if len(steps) < 3 or not isinstance(steps[0], ToRGB):
        return None
    *middle, to_tensor, norm = steps[1:]
    if not isinstance(to_tensor, T.ToTensor) or not isinstance(norm, T.Normalize):
        return None
    if not all(type(s) in (T.Resize, T.CenterCrop) for s in middle):
        return None
    mean = tuple(float(v) for v in np.asarray(norm.mean, dtype=np.float64).ravel())
    std = tuple(float(v) for v in np.asarray(norm.std, dtype=np.float64).ravel())
    if len(mean) != 3 or len(std) != 3:
        return None
    return FastPreprocess(steps[0], list(middle), mean, std, gray_first=True)
