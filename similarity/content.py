"""The image bytes behind a split's sample ids, where the store's record of the split's source
reaches them: content hashes (exact duplicates) and thumbnails for the audit.

The store keeps features, ids and the split's ``source`` string, not images. Reachable here:

- scikit-learn's ``load_digits`` (``source`` ``sklearn.datasets.load_digits``, ids ``digits-<i>``);
- Fashion-MNIST / MNIST IDX files in a folder (ids ``train-00000`` / ``test-00000``), the
  split's ``source`` or ``--data-root``;
- image files whose ids are paths relative to the split's ``source`` folder or ``--data-root``
  (imagefolder and manifest stores).

Anything else gives ``None``: the audit then reports exact duplicates as unknown. IDX files are
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


def image_source(
    source: str, split: str, ids: Sequence[str] | np.ndarray, data_root: str | None = None
) -> ImageSource | None:
    """The :class:`ImageSource` of a split (its store ``source`` string and ids), or None."""
    ids = [str(i) for i in ids]
    if data_root is None and source == "sklearn.datasets.load_digits":
        return _digits_source()
    folder = Path(data_root or re.sub(r"\[[^\]]*\]$", "", source))  # "DIR[:2000]": a --limit'd split
    if not folder.is_dir():
        return None
    return _idx_source(folder, split, ids) or _file_source(folder, ids)


def content_hashes(src: ImageSource, ids: Sequence[str] | np.ndarray) -> np.ndarray:
    """sha256 hex digest of each id's image bytes (object array)."""
    return np.array([hashlib.sha256(src.raw(str(i))).hexdigest() for i in ids], dtype=object)
