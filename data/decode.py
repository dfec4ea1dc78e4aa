"""Image decoding: every reader turns bytes or a file into a PIL image here.

:func:`decode_image` opens an image, checks its pixel count against
:attr:`~featcache.data.source.ReadOptions.max_image_pixels`, decodes it fully, applies the
EXIF orientation and converts it to 8-bit RGB (or 8-bit grayscale, left as one band): grey,
palette, CMYK, 16-bit and RGBA images all become 8-bit RGB. :class:`PathLoader` is the picklable
loader of row ``i`` from a column of file paths that readers hand to :class:`SplitSource`.

JPEGs may instead be decoded through ``torchvision.io.decode_jpeg`` (``--decoder``).

PIL and torchvision both decode JPEG with libjpeg-turbo (same IDCT, same fancy chroma
upsampling), so for baseline and progressive JPEGs in YCbCr or grayscale the decoded ``uint8``
pixels are identical (tested on Fashion-MNIST and scikit-image photos at 224-512 px, every
chroma subsampling). Everything after the decode (resize, crop, normalisation) is the shared
PIL pipeline of :mod:`featcache.data.preprocess`, so the features are bit-identical too.

Where the codecs do not agree the image is routed to PIL, per image:

* CMYK / YCCK JPEGs (PIL inverts Adobe CMYK and converts to RGB its own way; torchvision
  converts differently or refuses);
* JPEGs whose EXIF Orientation tag is not 1 while EXIF orientation is applied (PIL's
  ``ImageOps.exif_transpose`` stays the one implementation);
* any file that is not a JPEG, and any JPEG torchvision fails to decode (torchvision refuses
  truncated or corrupt data; PIL then decodes it or raises its own error, and the row becomes
  invalid exactly as with ``--decoder pil``).

torchvision 0.29 deprecates ``torchvision.io``'s decoders in favour of TorchCodec; should they
go away, every image falls back to PIL.

Decoders: ``pil``; ``torchvision`` (libjpeg-turbo on the CPU, in the DataLoader workers);
``auto``: torchvision where a short calibration on this CPU measures it faster than PIL, else
PIL. :func:`decode_jpeg_batch` decodes a list of JPEGs on a CUDA device with nvJPEG (batched);
nvJPEG's IDCT and upsampling differ from libjpeg-turbo, so its pixels are not PIL's (it is
not used by the extraction pipeline, whose decoding runs in CPU DataLoader workers).
"""

from __future__ import annotations

import functools
import io
import logging
import os
import threading
import time
import warnings
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any, cast

import numpy as np

from featcache.data.source import ReadOptions, StringColumn
from featcache.errors import DataError

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger(__name__)

DECODERS = ("auto", "pil", "torchvision")
_EXIF_ORIENTATION = 0x0112
__all__ = [
    "DECODERS",
    "PathLoader",
    "decode_image",
    "decode_jpeg_batch",
    "load_image_file",
    "resolve_decoder",
    "to_rgb",
    "torchvision_decode",
    "torchvision_faster",
]


def to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB, or 8-bit grayscale ('L', left as one band: the backbone's transform converts
    it after resizing, which is cheaper and gives the same values), from any PIL mode (16-bit
    and 32-bit ints are rescaled, not clipped)."""
    from PIL import Image

    if img.mode in ("RGB", "L"):
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        a = np.asarray(img, dtype=np.float64)
        hi = 65535.0 if img.mode.startswith("I;16") or a.max() > 255 else 255.0
        a = np.clip(a / hi * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return Image.fromarray(a, mode="L")
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA"):
        bg = Image.new("RGB", img.size, (255, 255, 255))
        rgba = img.convert("RGBA")
        bg.paste(rgba, mask=rgba.getchannel("A"))
        return bg
    return img.convert("RGB")


_PIL_LIMIT_LOCK = threading.Lock()
_pil_limit_state: dict[str, Any] = {"users": 0, "saved": None}


@contextmanager
def _pil_pixel_limit(limit: int):
    """PIL refuses images above ``2 * Image.MAX_IMAGE_PIXELS`` at open, before our own check;
    while a decode with a higher ``--max-image-pixels`` runs, its bound is raised just enough and
    restored when the last such decode ends (our own check, not PIL's, enforces the limit)."""
    from PIL import Image

    cur = Image.MAX_IMAGE_PIXELS
    if cur is None or 2 * cur >= limit:
        yield
        return
    with _PIL_LIMIT_LOCK:
        st = _pil_limit_state
        if st["users"] == 0:
            st["saved"] = cur
        st["users"] += 1
        Image.MAX_IMAGE_PIXELS = max(Image.MAX_IMAGE_PIXELS or 0, limit)  # PIL refuses above twice this
    try:
        yield
    finally:
        with _PIL_LIMIT_LOCK:
            st["users"] -= 1
            if st["users"] == 0:
                Image.MAX_IMAGE_PIXELS = st["saved"]


def decode_image(fp: str | os.PathLike[str] | IO[bytes], options: ReadOptions | None = None) -> Image.Image:
    """Open, check the pixel count, fully decode, apply EXIF orientation and convert to RGB
    (or 8-bit grayscale); raises on any broken or oversized image."""
    opts = options or ReadOptions()
    with _pil_pixel_limit(opts.max_image_pixels):
        return _decode_opened(fp, opts)


def _decode_opened(fp, opts: ReadOptions):
    from PIL import Image, ImageOps

    with warnings.catch_warnings():  # the limit below replaces PIL's DecompressionBombWarning
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = Image.open(fp)
        except Image.DecompressionBombError as exc:
            raise DataError(f"{exc} (above --max-image-pixels {opts.max_image_pixels}; raise it if genuine)") from exc
    with im:
        w, h = im.size
        if w * h > opts.max_image_pixels:
            raise DataError(
                f"image is {w}x{h} = {w * h} pixels, above the limit of {opts.max_image_pixels} "
                "(raise --max-image-pixels if it is genuine)"
            )
        if opts.decoder == "torchvision":
            fast = torchvision_decode(im, fp, opts.exif_transpose)
            if fast is not None:
                return fast
        im.load()
        if opts.exif_transpose and im.getexif().get(_EXIF_ORIENTATION, 1) not in (0, 1):
            return to_rgb(ImageOps.exif_transpose(im))
        return to_rgb(im)


def load_image_file(path: str | os.PathLike, options: ReadOptions | None = None) -> Image.Image:
    """:func:`decode_image` of a file; raises on any broken file."""
    return decode_image(os.fspath(path) if not isinstance(path, str) else str(path), options)


class PathLoader:
    """Loader of row ``i`` from a :class:`StringColumn` of file paths (picklable)."""

    def __init__(self, paths: StringColumn, options: ReadOptions | None = None):
        self.paths = paths
        self.options = options

    def __call__(self, i: int) -> Image.Image:
        return load_image_file(self.paths[i], self.options)


def _read_bytes(fp: Any) -> bytes:
    if isinstance(fp, (bytes, bytearray)):
        return bytes(fp)
    if isinstance(fp, io.BytesIO):
        return fp.getvalue()
    if hasattr(fp, "read"):
        pos = fp.tell()
        fp.seek(0)
        data = fp.read()
        fp.seek(pos)
        return data
    with open(os.fspath(fp), "rb") as f:
        return f.read()


def torchvision_decode(im: Any, fp: Any, exif_transpose: bool = True) -> Any | None:
    """``im`` (an opened, not yet loaded PIL image of ``fp``) decoded by torchvision as an
    'RGB' or 'L' PIL image, or ``None`` where PIL must decode it (not a JPEG, CMYK/YCCK, an
    EXIF rotation to apply, or a torchvision decode error)."""
    if im.format != "JPEG" or im.mode not in ("RGB", "L"):
        return None
    if exif_transpose and im.getexif().get(_EXIF_ORIENTATION, 1) not in (0, 1):
        return None
    import torch
    from PIL import Image

    try:
        from torchvision.io import ImageReadMode, decode_jpeg

        data = _read_bytes(fp)
        mode = ImageReadMode.GRAY if im.mode == "L" else ImageReadMode.RGB
        with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders for TorchCodec
            warnings.simplefilter("ignore", DeprecationWarning)
            t = cast(
                torch.Tensor, decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=mode)
            )  # one image in, one tensor out
    except Exception as exc:  # PIL decodes it, or raises its own error
        log.debug("torchvision could not decode %s (%s); PIL decodes it", getattr(fp, "name", fp), exc)
        return None
    a = t.numpy()
    if a.shape[1:] != (im.size[1], im.size[0]):
        return None
    if im.mode == "L":
        return Image.fromarray(a[0], mode="L")
    return Image.fromarray(np.ascontiguousarray(a.transpose(1, 2, 0)), mode="RGB")


def decode_jpeg_batch(datas: list[bytes], device: str = "cuda") -> list[Any]:
    """JPEG byte strings -> ``uint8 [3, H, W]`` tensors on ``device``; on CUDA one batched
    nvJPEG call (pixels differ slightly from libjpeg-turbo's, see the module docstring)."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return list(decode_jpeg(tensors, mode=ImageReadMode.RGB, device=device))


def _calibration_jpeg() -> bytes:
    """A deterministic 384x320 photo-like JPEG (smooth shading, mild texture, an edge)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:320, 0:384].astype(np.float32)
    base = np.stack([x / 1.6, y / 1.4, 128 + 60 * np.sin(x / 23.0) * np.cos(y / 17.0)], axis=-1)
    base[y > x] *= 0.5
    img = np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@functools.lru_cache(maxsize=1)
def torchvision_faster(repeats: int = 5, n: int = 8) -> bool:
    """Whether the torchvision path of :func:`decode_image` (decode plus
    the hand-over to PIL for the shared resize) is at least 5 % faster than PIL's on this CPU:
    best of ``repeats`` timings of ``n`` decodes each; measured once per process."""
    try:
        import torchvision.io  # noqa: F401
    except Exception as exc:  # pragma: no cover - torchvision is a dependency
        log.info("torchvision.io is unavailable (%s); decoding with PIL", exc)
        return False
    data = _calibration_jpeg()
    opts = {d: ReadOptions(decoder=d) for d in ("pil", "torchvision")}
    best: dict[str, float] = {}
    for d in ("pil", "torchvision") * repeats:
        t0 = time.perf_counter()
        for _ in range(n):
            decode_image(io.BytesIO(data), opts[d])
        dt = time.perf_counter() - t0
        best[d] = min(dt, best.get(d, dt))
    faster = best["torchvision"] < 0.95 * best["pil"]
    log.info(
        "JPEG decode calibration: torchvision %.2f ms, PIL %.2f ms per image -> %s",
        best["torchvision"] / n * 1e3,
        best["pil"] / n * 1e3,
        "torchvision" if faster else "PIL",
    )
    return faster


def resolve_decoder(decoder: str, reads_files: bool = True) -> str:
    """``pil`` or ``torchvision``: the decoder that ``auto`` stands for on this CPU (``pil``
    without measuring when the data has no image files, e.g. digits or Fashion-MNIST arrays)."""
    if decoder not in DECODERS:
        from featcache.errors import ConfigError

        raise ConfigError(f"--decoder {decoder} is invalid: choose one of {', '.join(DECODERS)}")
    if decoder != "auto":
        return decoder
    if not reads_files:
        return "pil"
    return "torchvision" if torchvision_faster() else "pil"
