"""What a reader hands the extraction: one :class:`SplitSource` per split (stable string ids,
integer labels, class names and a loader of row ``i``'s image), the per-image
:class:`ReadOptions`, the compact :class:`StringColumn` of paths and the label checks every
reader shares.

Input rules (checked before any work, one-line :class:`~featcache.errors.DataError`):
labels are integers >= 0 (a float label is accepted only when exactly integral, ``1.0`` -> 1;
NaN, infinities, ``1.5`` and booleans are refused) or class-name strings; integer labels make
``max + 1`` classes, at most ``max(rows, 100000)``. File names that are not valid UTF-8 get a
lossless escaped id (:func:`escape_name`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, SupportsInt, overload

import numpy as np

from featcache.errors import DataError

if TYPE_CHECKING:
    import polars as pl

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ReadOptions",
    "SplitSource",
    "StringColumn",
    "escape_name",
    "integer_classes",
    "integral_labels",
]

MIN_CLASS_BOUND = 100_000
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # PIL's Image.MAX_IMAGE_PIXELS


@dataclass(frozen=True)
class ReadOptions:
    """How image files are decoded (recorded in the feature provenance)."""

    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    exif_transpose: bool = True
    allow_empty_classes: bool = False
    decoder: str = "pil"  # pil | torchvision (JPEGs; resolved, see featcache.data.decode)
    follow_symlinks: bool = False  # imagefolder: read symlinks that point outside the folder


def escape_name(name: str) -> str:
    """A printable, lossless id for a file name: bytes that are not UTF-8 (which Python keeps
    as surrogate escapes) become ``\\xNN`` and a backslash becomes ``\\\\``; other names are
    returned unchanged."""
    if "\\" not in name:
        try:
            name.encode("utf-8")
            return name
        except UnicodeEncodeError:
            pass
    raw = name.encode("utf-8", "surrogateescape").replace(b"\\", b"\\\\")
    return raw.decode("utf-8", "backslashreplace")


def integer_classes(labels: np.ndarray, where: str) -> list[str]:
    """Class names ``0..max`` of integer labels, refusing negative or absurd values."""
    if not labels.size:
        return []
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0:
        raise DataError(f"{where}: label {lo} is negative; labels must be integers >= 0 or class-name strings")
    bound = max(len(labels), MIN_CLASS_BOUND)
    if hi >= bound:
        raise DataError(
            f"{where}: integer label {hi} would make {hi + 1} classes for {len(labels)} rows (at most {bound}); "
            "number the classes 0..K-1 or give class names as strings"
        )
    return [str(i) for i in range(hi + 1)]


def integral_labels(values: np.ndarray, where: str) -> np.ndarray:
    """Float labels as int64 if every value is finite and exactly integral (``1.0`` -> 1)."""
    a = np.asarray(values, dtype=np.float64)
    bad = ~np.isfinite(a) | (a != np.round(a))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"{where}: label {float(a[row])} (row {row + 1}) is not an integer; "
            "labels must be integers >= 0 or class-name strings"
        )
    return a.astype(np.int64)


@dataclass
class SplitSource:
    """One split of a dataset: rows, labels and a way to load image ``i`` as RGB PIL."""

    dataset: str
    split: str
    ids: np.ndarray
    labels: np.ndarray
    class_names: list[str]
    loader: Callable[[int], Any]
    source: str
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def load(self, i: int) -> Any:
        return self.loader(int(i))

    def subset(self, n: int) -> SplitSource:
        """The first ``n`` rows (a deterministic prefix; recorded in ``source``)."""
        if n >= len(self):
            return self
        base = self.loader
        return SplitSource(
            self.dataset,
            self.split,
            self.ids[:n],
            self.labels[:n],
            self.class_names,
            base,
            f"{self.source}[:{n}]",
            dict(self.extra),
        )


# --------------------------------------------------------------------------- compact strings
class StringColumn:
    """Many strings in two numpy arrays (UTF-8 bytes + offsets), Arrow style.

    A million paths cost their bytes plus 8 bytes each, not a Python ``str`` object each; a
    row is decoded only when its image is loaded. Pickles cheaply to DataLoader workers.
    """

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data = np.ascontiguousarray(data, dtype=np.uint8)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)

    @classmethod
    def from_polars(cls, s: pl.Series) -> StringColumn:
        import polars as pl
        import pyarrow as pa

        arr = s.cast(pl.Utf8).to_arrow()
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        arr = arr.cast(pa.large_string())
        _, offs, data = arr.buffers()
        off = np.frombuffer(offs, dtype=np.int64, count=len(arr) + 1, offset=arr.offset * 8)
        buf = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
        return cls(buf[off[0] : off[-1]].copy(), off - off[0])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, i: slice) -> StringColumn: ...
    @overload
    def __getitem__(self, i: SupportsInt) -> str: ...
    def __getitem__(self, i: slice | SupportsInt) -> StringColumn | str:
        if isinstance(i, slice):
            lo, hi, step = i.indices(len(self))
            if step != 1:
                raise IndexError("StringColumn supports contiguous slices only")
            off = self.offsets[lo : hi + 1]
            return StringColumn(self.data[off[0] : off[-1]], off - off[0])
        i = int(i)
        return self.data[self.offsets[i] : self.offsets[i + 1]].tobytes().decode()

    def take(self, rows: np.ndarray) -> StringColumn:
        """Rows ``rows`` (e.g. one split) as a new column, vectorised."""
        rows = np.asarray(rows, dtype=np.int64)
        lens = self.offsets[rows + 1] - self.offsets[rows]
        off = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lens, out=off[1:])
        # byte positions to copy: starts repeated per byte + intra-string position
        src = np.repeat(self.offsets[rows] - off[:-1], lens) + np.arange(off[-1], dtype=np.int64)
        return StringColumn(self.data[src], off)

    def to_numpy(self, block: int = 65536) -> np.ndarray:
        """Fixed-width ``<U`` numpy array, built blockwise in numpy (ASCII) without a Python
        ``str`` per row; non-ASCII text goes through pyarrow's decoder."""
        n = len(self)
        lens = np.diff(self.offsets)
        width = int(lens.max()) if n else 1
        if n and self.data.size and self.data.max() >= 128:
            import pyarrow as pa

            arr = pa.LargeStringArray.from_buffers(n, pa.py_buffer(self.offsets), pa.py_buffer(self.data))
            return arr.to_numpy(zero_copy_only=False).astype(str)
        out = np.empty(n, dtype=f"<U{max(width, 1)}")
        col = np.arange(width, dtype=np.int64)
        for lo in range(0, n, block):
            hi = min(lo + block, n)
            idx = self.offsets[lo:hi, None] + col
            mask = col < lens[lo:hi, None]
            mat = np.where(mask, self.data[np.minimum(idx, max(self.data.size - 1, 0))] if self.data.size else 0, 0)
            out[lo:hi] = mat.astype(np.uint8).view(f"S{width}").ravel().astype(out.dtype)
        return out
