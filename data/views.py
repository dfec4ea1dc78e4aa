"""Seeded augmented views of training images (issue 46): the DINOv2 / MAE train transform.

View ``v`` of an image is torchvision's ``RandomResizedCrop(size, scale=(0.08, 1), bicubic)``
then ``RandomHorizontalFlip(0.5)``, then the model's ``ToTensor`` + ``Normalize``. ``size``,
``mean`` and ``std`` come from the backbone's data config, the one
:func:`timm.data.resolve_model_data_config` resolved (never typed by hand); the normalisation
is :class:`~featcache.data.preprocess.FastPreprocess`'s batched one, bit-identical to
``ToTensor`` + ``Normalize``. The random draws of (``seed``, ``v``, row) come from torch's
global generator forked and seeded with :func:`view_draw_seed` for that one image, so a view
does not depend on the batch, the DataLoader worker, the torchrun rank or an earlier
interruption: a resumed or re-sharded extraction computes the same pixels.

>>> view_split("train", 3)
'train@view3'
>>> parse_view_split("train@view3")
('train', 3)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from featcache.errors import DataError

__all__ = [
    "VIEW_FLIP_P",
    "VIEW_RATIO",
    "VIEW_SCALE",
    "ViewTransform",
    "parse_view_split",
    "view_draw_seed",
    "view_split",
]

#: DINOv2's / MAE's linear-probe train transform: RandomResizedCrop's area and aspect ranges
VIEW_SCALE = (0.08, 1.0)
VIEW_RATIO = (3.0 / 4.0, 4.0 / 3.0)  # torchvision's default
VIEW_FLIP_P = 0.5
_VIEW_RE = re.compile(r"^(?P<base>.+)@view(?P<v>\d+)$")


def view_split(split: str, view: int) -> str:
    """The store split name of view ``view`` of ``split`` (``train@view0``)."""
    return f"{split}@view{int(view)}"


def parse_view_split(name: str) -> tuple[str, int] | None:
    """``(split, view)`` of a view split name, ``None`` for any other split."""
    m = _VIEW_RE.match(name)
    return None if m is None else (m["base"], int(m["v"]))


def view_draw_seed(seed: int, view: int, row: int) -> int:
    """The torch seed of one image's draws: a 64-bit hash of (``seed``, ``view``, ``row``)
    (numpy's ``SeedSequence``, so neighbouring rows and views get unrelated streams)."""
    return int(np.random.SeedSequence([int(seed), int(view), int(row)]).generate_state(1, np.uint64)[0])


class ViewTransform:
    """Row ``i``'s view: PIL image -> ``uint8 [H, W, 3]`` (seeded crop and flip), and the
    batched normalisation that completes it (:meth:`normalize`). Picklable (DataLoader workers).
    """

    def __init__(self, data_config: Mapping[str, Any], seed: int, view: int):
        from torchvision import transforms as T

        from featcache.data.preprocess import FastPreprocess
        from featcache.models.model import ToRGB

        missing = [k for k in ("input_size", "mean", "std") if k not in data_config]
        if missing:
            raise DataError(f"augmented views need the model's timm data config; it lacks {missing}")
        self.seed, self.view = int(seed), int(view)
        self.size = tuple(int(s) for s in data_config["input_size"][1:])
        pre = data_config.get("pre_resize")
        interp = T.InterpolationMode(data_config.get("interpolation") or "bilinear")
        self.pre = [T.Resize((int(pre), int(pre)), interpolation=interp)] if pre else []
        self.crop = T.RandomResizedCrop(
            self.size, scale=VIEW_SCALE, ratio=VIEW_RATIO, interpolation=T.InterpolationMode.BICUBIC
        )
        self.flip = T.RandomHorizontalFlip(VIEW_FLIP_P)
        mean = tuple(float(m) for m in data_config["mean"])
        std = tuple(float(s) for s in data_config["std"])
        self.fast = FastPreprocess(ToRGB(), [], mean, std, gray_first=False)

    def geometric(self, img: Any, row: int) -> Any:
        """Row ``row``'s crop and flip of an RGB PIL image (torch's global RNG is left as it was)."""
        import torch

        for step in self.pre:
            img = step(img)
        with torch.random.fork_rng(devices=[]):
            # the CPU generator only: torch.manual_seed would also queue lazy seeds of every
            # accelerator backend (a traceback captured per call, most of a view's time)
            torch.default_generator.manual_seed(view_draw_seed(self.seed, self.view, row))
            return self.flip(self.crop(img))

    def __call__(self, img: Any, row: int) -> np.ndarray:
        if getattr(img, "mode", None) == "L":  # one band resampled, then stacked: the same values
            a = np.asarray(self.geometric(img, row), dtype=np.uint8)  # as PIL gives each band of RGB
            return np.stack([a, a, a], axis=-1)
        img = self.geometric(self.fast.to_rgb(img), row)
        return np.array(img, dtype=np.uint8)  # a writable copy (torch.from_numpy)

    def normalize(self, x: Any, channels_last: bool = True) -> Any:
        """``uint8 [B, H, W, C]`` -> normalised float32 ``[B, C, H, W]`` (the model's mean/std)."""
        return self.fast.normalize(x, channels_last)

    def spec(self) -> dict[str, Any]:
        """What the view group's provenance records (JSON values): transform, seed, view index."""
        pre = [f"Resize({self.pre[0].size}, {self.pre[0].interpolation.value})"] if self.pre else []
        return {
            "transform": " + ".join(
                [
                    "ToRGB",
                    *pre,
                    f"RandomResizedCrop({list(self.size)}, scale={list(VIEW_SCALE)}, ratio=[3/4, 4/3], bicubic)",
                    f"RandomHorizontalFlip({VIEW_FLIP_P})",
                    "ToTensor",
                    f"Normalize(mean={list(self.fast.mean)}, std={list(self.fast.std)})",
                ]
            ),
            "seed": self.seed,
            "index": self.view,
            "draws": "torch.default_generator.manual_seed(SeedSequence([seed, index, row]).generate_state(1, uint64)) per image",
        }

    def __repr__(self) -> str:
        return f"ViewTransform(size={self.size}, seed={self.seed}, view={self.view})"
