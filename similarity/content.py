"""The image bytes behind a split's sample ids, where the store's record of the split's source
reaches them: content hashes (exact duplicates) and thumbnails for the audit.

The store keeps features, ids and the split's ``source`` string, not images. Reachable here:

- scikit-learn's ``load_digits`` (``source`` ``sklearn.datasets.load_digits``, ids ``digits-<i>``);
- Fashion-MNIST / MNIST IDX files in a folder (ids ``train-00000`` / ``test-00000``), the
  split's ``source`` or ``--data-root``;
- image files whose ids are paths relative to the split's ``source`` folder or ``--data-root``
  (imagefolder stores: ``imagefolder:DIR``);
- any other registered data format's ``KIND:ARG`` record (manifest, vtab1k, hf, webdataset...),
  read again through that format's reader (pixels hashed, not file bytes).

A ``[:N]`` suffix (``--limit``) is the same source. Anything else gives ``None``: the audit then reports exact duplicates as unknown. IDX files are
read by the data layer's reader (:func:`featcache.data.readers.folders.read_idx`).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from featcache.data.readers.folders import read_idx

log = logging.getLogger(__name__)

__all__ = ["ImageSource", "content_hashes", "image_source"]

_IDX_ID = re.compile(r"^(train|test)-(\d+)$")
_IDX_PREFIX = {"train": "train", "test": "t10k"}


class ImageSource:
    """Raw bytes (for hashing) and a small grey/RGB array (for thumbnails) per sample id."""

    def __init__(self, raw: Callable[[str], bytes], pixels: Callable[[str], np.ndarray], what: str) -> None:
        self.raw, self.pixels, self.what = raw, pixels, what


def _idx_source(folder: Path, split: str, ids: Sequence[str]) -> ImageSource | None:
    prefix = _IDX_PREFIX.get(split)
    if prefix is None or not ids or not all(_IDX_ID.match(str(i)) for i in ids[:100]):
        return None
    f = next(
        (c for c in (folder / f"{prefix}-images-idx3-ubyte.gz", folder / f"{prefix}-images-idx3-ubyte") if c.exists()),
        None,
    )
    if f is None:
        return None
    images = read_idx(f)

    def pixels(i: str) -> np.ndarray:
        return images[int(str(i).split("-")[1])]

    return ImageSource(lambda i: pixels(i).tobytes(), pixels, f"IDX file {f}")


def _digits_source() -> ImageSource:
    from sklearn.datasets import load_digits

    d: Any = load_digits()  # a Bunch (scikit-learn types it as Bunch or an (X, y) tuple)
    images = d.images.astype(np.uint8)

    def pixels(i: str) -> np.ndarray:
        return images[int(str(i).rsplit("-", 1)[1])]

    return ImageSource(lambda i: pixels(i).tobytes(), pixels, "sklearn.datasets.load_digits")


def _file_source(folder: Path, ids: Sequence[str]) -> ImageSource | None:
    probe = [folder / str(i) for i in ids[:20]]
    if not probe or not all(p.is_file() for p in probe):
        return None

    def pixels(i: str) -> np.ndarray:
        from PIL import Image

        with Image.open(folder / str(i)) as im:
            im.thumbnail((96, 96))
            return np.asarray(im.convert("RGB"))

    return ImageSource(lambda i: (folder / str(i)).read_bytes(), pixels, f"files under {folder}")


def _format_source(kind: str, arg: str, split: str, ids: Sequence[str]) -> ImageSource | None:
    """The images of a split recorded as ``KIND:ARG`` by a registered data format (manifest,
    vtab1k, hf, webdataset...), read again through that format's reader; None when it cannot
    (the files moved, the format needs options it did not record)."""
    from featcache.data.readers import FORMATS  # registers every built-in format
    from featcache.data.readers.registry import open_format
    from featcache.data.source import ReadOptions
    from featcache.errors import FeatcacheError

    if kind not in FORMATS.names(aliases=True):
        return None
    for a in dict.fromkeys((arg, str(Path(arg).parent))):  # vtab1k:DIR/split.txt, hf:DIR/split
        try:
            sp = open_format(kind, a, "audit", ReadOptions()).get(split)
        except (FeatcacheError, OSError, ValueError) as exc:
            log.debug("%s:%s not readable again: %s", kind, a, exc)
            continue
        if sp is None:
            continue
        row = {str(i): n for n, i in enumerate(sp.ids)}
        if not all(str(i) in row for i in ids[:100]):
            return None

        def pixels(i: str, sp=sp, row=row) -> np.ndarray:
            return np.asarray(sp.load(row[str(i)]))

        return ImageSource(lambda i: pixels(i).tobytes(), pixels, f"{kind}:{a} ({split})")
    return None


def image_source(
    source: str, split: str, ids: Sequence[str] | np.ndarray, data_root: str | None = None
) -> ImageSource | None:
    """The :class:`ImageSource` of a split (its store ``source`` string and ids), or None.

    A ``[:N]`` suffix (a split extracted with ``--limit``) names the same images' first N."""
    ids = [str(i) for i in ids]
    base = re.sub(r"\[[^\]]*\]$", "", source)  # "DIR[:2000]": a --limit'd split
    if data_root is None and base == "sklearn.datasets.load_digits":
        return _digits_source()
    kind, _, arg = base.partition(":")
    if data_root is None and kind == "imagefolder":  # imagefolder:DIR: ids are paths under DIR
        base = arg
    folder = Path(data_root or base)
    if folder.is_dir():
        return _idx_source(folder, split, ids) or _file_source(folder, ids)
    if data_root is None and arg and len(kind) > 1:  # KIND:ARG of another registered format
        return _format_source(kind.lower(), arg, split, ids)
    return None


def content_hashes(src: ImageSource, ids: Sequence[str] | np.ndarray) -> np.ndarray:
    """sha256 hex digest of each id's image bytes (object array)."""
    return np.array([hashlib.sha256(src.raw(str(i))).hexdigest() for i in ids], dtype=object)
