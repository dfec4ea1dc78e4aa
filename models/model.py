"""The :class:`Backbone` record every model source builds (timm models in
:mod:`featcache.models.backbones`, the other libraries in :mod:`featcache.models.sources`),
its eval preprocessing from a timm data config (:func:`make_transform`) and the device it
runs on."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from featcache.core.devices import resolve_device
from featcache.errors import BackboneError

logger = logging.getLogger(__name__)

__all__ = [
    "DATA_CONFIG_KEYS",
    "RESIZE_MODES",
    "VTAB_RESIZE",
    "Backbone",
    "TF1BilinearResize",
    "TFBilinearResize",
    "ToRGB",
    "backbone_device",
    "make_data_config",
    "make_transform",
    "resize_mode",
]

DATA_CONFIG_KEYS = ("input_size", "interpolation", "crop_pct", "crop_mode", "mean", "std")
#: the resize modes (``--resize``) -> what each does, in the words of the help and of a refused
#: resume; ``whole-tf1`` is VTAB's own ``tf.image.resize`` as task_adaptation runs it under
#: TensorFlow 1 (:class:`TF1BilinearResize`), ``whole-tf2`` TensorFlow 2's (half-pixel centres:
#: :class:`TFBilinearResize`), ``whole-tf`` kept so stores made with it resume
RESIZE_MODES: Mapping[str, str] = MappingProxyType(
    {
        "timm": "the model's eval transform: resize the short side, centre crop",
        "whole": "the whole image resized to the input size, no crop (PIL antialiased bilinear)",
        "whole-tf1": "the whole image resized by VTAB's own resize, TF1's tf.image.resize "
        "(legacy bilinear: no antialias, no half-pixel centres)",
        "whole-tf2": "the whole image resized by TF2's tf.image.resize, half-pixel centres",
        "whole-tf": "the earlier name of whole-tf2: TF2's tf.image.resize",
    }
)


def resize_help() -> str:
    """``--resize``'s help: each mode and what it does."""
    return " | ".join(f"{mode}: {text}" for mode, text in RESIZE_MODES.items())


#: the resize rule of VTAB's own pipeline (task_adaptation's ``data_loader.preprocess_fn``)
VTAB_RESIZE = "whole-tf1"


@dataclass
class Backbone:
    """A feature extractor and everything needed to reproduce its features."""

    name: str
    model: Any  # torch.nn.Module, eval mode
    data_config: dict[str, Any]
    transform: Callable[[Any], Any]
    weights_source: str
    weights_sha256: str
    feature_dim: int
    default_key: str
    keep_head: bool = False
    weights_file: str | None = None
    device: str = "cpu"
    #: non-timm sources: ``features_fn(x, kinds) -> {kind: [B, D]}`` and the kinds it offers
    features_fn: Callable[[Any, Any], dict[str, Any]] | None = None
    kinds: tuple[str, ...] = ()
    source: str = "timm"
    #: a text tower (``encode(list[str]) -> [N, D]``) where the source has one
    text_tower: Any = None
    #: non-timm sources: the :class:`~featcache.models.sources.layers.LayerSet` whose kinds
    #: ``features_fn`` computes (``--features layers:...``), None where it gives none
    layers: Any = None

    def embed(self, x: Any) -> Any:
        """Pooled pre-logits features ``[B, feature_dim]`` for a preprocessed batch ``x``."""
        if self.features_fn is not None:
            return self.features_fn(x, ["pooled"])["pooled"]
        if self.keep_head:
            return self.model.forward_head(self.model.forward_features(x), pre_logits=True)
        return self.model(x)


# --------------------------------------------------------------------------- preprocessing


class ToRGB:
    """PIL image -> RGB PIL image (grayscale/RGBA/palette datasets). Picklable for workers."""

    def __call__(self, img: Any) -> Any:
        return img if getattr(img, "mode", "RGB") == "RGB" else img.convert("RGB")

    def __repr__(self) -> str:
        return "ToRGB()"


class TF1BilinearResize:
    """RGB PIL image -> float tensor ``[3, H, W]`` in [0, 1]: TensorFlow 1's
    ``tf.image.resize(img, (H, W))`` as VTAB's ``task_adaptation/data_loader.py``
    (``preprocess_fn``) runs it on the uint8 image, divided by 255, no rounding to uint8.
    TF1's resize is ``resize_bilinear(align_corners=False, half_pixel_centers=False)``: the
    legacy sampling ``in = out * (in_size / out_size)``, ``lower = floor(in)``, ``upper =
    min(ceil(in), in_size - 1)``, then the kernel's top/bottom interpolation in float32
    (``resize_bilinear_op.cc``), computed here with the same float32 operations."""

    def __init__(self, size: tuple[int, int]):
        self.size = (int(size[0]), int(size[1]))

    @staticmethod
    def _weights(out_size: int, in_size: int):
        import numpy as np

        scale = np.float32(in_size) / np.float32(out_size)
        x = np.arange(out_size, dtype=np.float32) * scale
        x_f = np.floor(x)
        lower = np.maximum(x_f.astype(np.int64), 0)
        upper = np.minimum(np.ceil(x).astype(np.int64), in_size - 1)
        return lower, upper, (x - x_f).astype(np.float32)

    def __call__(self, img: Any) -> Any:
        import numpy as np
        import torch

        a = np.asarray(img, dtype=np.uint8)
        a = a[:, :, None] if a.ndim == 2 else a
        h, w = self.size
        if a.shape[:2] == (h, w):  # the kernel's no-op resize: a cast
            out = a.astype(np.float32)
        else:
            ylo, yhi, yl = self._weights(h, a.shape[0])
            xlo, xhi, xl = self._weights(w, a.shape[1])
            f = a.astype(np.float32)
            xl3 = xl[None, :, None]
            top_rows, bottom_rows = f[ylo], f[yhi]
            top = top_rows[:, xlo] + (top_rows[:, xhi] - top_rows[:, xlo]) * xl3
            bottom = bottom_rows[:, xlo] + (bottom_rows[:, xhi] - bottom_rows[:, xlo]) * xl3
            out = top + (bottom - top) * yl[:, None, None]
        return torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1))) / 255.0

    def __repr__(self) -> str:
        return f"TF1BilinearResize(size={self.size})"


class TFBilinearResize:
    """RGB PIL image -> float tensor ``[3, H, W]`` in [0, 1]: TensorFlow 2's
    ``tf.image.resize(img, (H, W))`` (bilinear, ``antialias=False``: ``resize_bilinear`` with
    half-pixel centres) on the uint8 image, divided by 255; no rounding to uint8. VTAB's own
    pipeline ran under TensorFlow 1, whose resize has no half-pixel centres
    (:class:`TF1BilinearResize`, ``--resize whole-tf1``).
    torch's ``interpolate(bilinear, align_corners=False, antialias=False)`` samples the
    same points with the same weights (tested against a numpy port of TF's kernel)."""

    def __init__(self, size: tuple[int, int]):
        self.size = (int(size[0]), int(size[1]))

    def __call__(self, img: Any) -> Any:
        import numpy as np
        import torch
        import torch.nn.functional as F

        x = torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1)[None].to(torch.float32)
        y = F.interpolate(x, size=self.size, mode="bilinear", align_corners=False, antialias=False)
        return y[0] / 255.0

    def __repr__(self) -> str:
        return f"TFBilinearResize(size={self.size})"


def make_data_config(
    data_config: Mapping[str, Any],
    *,
    input_size: int | tuple[int, ...] | None = None,
    pre_resize: int | None = None,
    resize: str | None = None,
) -> dict[str, Any]:
    """Copy of a timm data config with ``input_size`` overridden and ``pre_resize`` recorded.

    ``input_size`` may be an int (square), ``(H, W)`` or ``(C, H, W)``. ``pre_resize=32`` first
    resizes every image to 32x32 (Salman et al.'s low-resolution variant). ``resize="whole"``
    (VTAB) is recorded as ``resize: whole``; timm's default transform records no ``resize`` key,
    so configs (and stores) made before the option existed keep their identity.
    """
    missing = [k for k in DATA_CONFIG_KEYS if k not in data_config]
    if missing:
        raise BackboneError(f"data config lacks {missing}; build it with timm.data.resolve_model_data_config(model)")
    cfg = {k: data_config[k] for k in DATA_CONFIG_KEYS}
    if input_size is not None:
        size = (input_size, input_size) if isinstance(input_size, int) else tuple(input_size)
        if len(size) == 2:
            size = (cfg["input_size"][0], *size)
        if len(size) != 3 or any(int(s) <= 0 for s in size):
            raise BackboneError(f"input_size must be an int, (H, W) or (C, H, W); got {input_size!r}")
        cfg["input_size"] = tuple(int(s) for s in size)
    if pre_resize is not None and (not isinstance(pre_resize, int) or pre_resize <= 0):
        raise BackboneError(f"pre_resize must be a positive int (e.g. 32); got {pre_resize!r}")
    cfg["pre_resize"] = pre_resize if pre_resize is not None else data_config.get("pre_resize")
    mode = resize if resize is not None else data_config.get("resize", "timm")
    if mode not in RESIZE_MODES:
        raise BackboneError(f"resize must be one of {', '.join(RESIZE_MODES)}; got {mode!r}")
    if mode != "timm":
        cfg["resize"] = mode
    return cfg


def resize_mode(data_config: Mapping[str, Any]) -> str:
    """The resize mode a (recorded) data config was made with (``timm`` when not recorded)."""
    return str(data_config.get("resize") or "timm")


def make_transform(
    data_config: Mapping[str, Any],
    *,
    input_size: int | tuple[int, ...] | None = None,
    pre_resize: int | None = None,
    resize: str | None = None,
) -> Callable[[Any], Any]:
    """Eval transform (PIL image -> float tensor ``[C, H, W]``) from a timm data config.

    Converts to RGB, optionally resizes to ``pre_resize`` x ``pre_resize`` first, then applies
    ``timm.data.create_transform`` (resize, center crop, normalise), or with ``resize="whole"``
    VTAB's geometry: the whole image resized to the input size (PIL's bilinear; no crop,
    aspect ratio not kept), ``ToTensor`` and the model's ``Normalize``; ``whole-tf1`` (VTAB's
    own TF1 resize), ``whole-tf2``/``whole-tf`` (TF2's) resize with TensorFlow's kernels.
    """
    from timm.data.transforms_factory import create_transform
    from torchvision import transforms as T

    cfg = make_data_config(data_config, input_size=input_size, pre_resize=pre_resize, resize=resize)
    steps: list[Any] = [ToRGB()]
    if cfg["pre_resize"]:
        interp = T.InterpolationMode(cfg["interpolation"] or "bilinear")
        steps.append(T.Resize((cfg["pre_resize"], cfg["pre_resize"]), interpolation=interp))
    tf_resize = {"whole-tf1": TF1BilinearResize, "whole-tf2": TFBilinearResize, "whole-tf": TFBilinearResize}
    if resize_mode(cfg) in tf_resize:
        resizer = tf_resize[resize_mode(cfg)](cfg["input_size"][1:])
        steps += [resizer, T.Normalize(mean=cfg["mean"], std=cfg["std"])]
        return T.Compose(steps)
    if resize_mode(cfg) == "whole":
        h, w = cfg["input_size"][1:]
        steps += [
            T.Resize((h, w), interpolation=T.InterpolationMode.BILINEAR),
            T.ToTensor(),
            T.Normalize(mean=cfg["mean"], std=cfg["std"]),
        ]
        return T.Compose(steps)
    steps.append(create_transform(**{k: cfg[k] for k in DATA_CONFIG_KEYS}, is_training=False))
    return T.Compose(steps)


def backbone_device(device: str) -> str:
    """The device a backbone runs on (``auto``: CUDA where available, else the CPU, logged)."""
    return resolve_device(device, cpu_note="no CUDA device; backbone runs on CPU", logger=logger)
