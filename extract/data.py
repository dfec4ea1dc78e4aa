"""Image data readers. A data spec string names a source; each split of it is a
:class:`SplitSource` with stable string ids, integer labels, class names and a loader.

==========================  ================================================================
spec                        source
==========================  ================================================================
``digits``                  scikit-learn's bundled ``load_digits`` (8x8 grey digits, 1,797
                            images). Deterministic stratified split: ``train`` 1,347 /
                            ``test`` 450 (``train_test_split(test_size=0.25,
                            random_state=0, stratify=y)``). Ids ``digits-<index>``.
``fashion-mnist[:DIR]``     gzipped IDX files (Debian's ``dataset-fashion-mnist`` by
                            default: ``/usr/share/datasets/fashion-mnist``); ``train`` 60,000 /
                            ``test`` 10,000. Ids ``train-00000`` / ``test-00000``.
``imagefolder:DIR``         ``DIR/<class>/<image>``; with ``DIR/train|val|test/<class>/...``
                            those are the splits, otherwise one split ``all``. Classes are the
                            sorted union of class folders. Ids are POSIX paths relative to DIR.
``manifest:FILE``           CSV or parquet with ``path,label[,split][,id]``. Relative paths are
                            resolved against the manifest's folder; without ``split`` one split
                            ``all``; without ``id`` the path is the id. String labels get sorted
                            class names; integer labels keep their values as class indices.
                            Paths stay in compact numpy buffers (:class:`StringColumn`).
``webdataset:PATTERN``      uncompressed tar shards, brace/glob pattern (``::`` joins several).
                            A sample is the members sharing a ``__key__``: one image
                            (.jpg/.png/...), a label in ``.cls`` (int) or ``.json`` (``label``);
                            no labels at all -> class ``unlabeled``. Id = ``__key__``. Split =
                            shard-name prefix (``train-000.tar`` -> ``train``, ``val``,
                            ``test``), else ``all``. Shards are indexed once (headers only) and
                            read by byte offset, so chunks resume and ranks shard like any source.
``clip-benchmark:DIR``,     the layouts benchmarks are distributed in (CLIP_benchmark's
``hf:PATH``, ``vtab1k:DIR`` WebDataset export, Hugging Face ``datasets`` on disk, VTAB-1k file
                            lists): :mod:`featcache.extract.formats`.
==========================  ================================================================

Grey, palette, CMYK, 16-bit and RGBA images all become 8-bit RGB.

Input rules (checked before any work, one-line :class:`~featcache.errors.DataError`):
labels are integers >= 0 (a float label is accepted only when exactly integral, ``1.0`` -> 1;
NaN, infinities, ``1.5`` and booleans are refused) or class-name strings; integer labels make
``max + 1`` classes, at most ``max(rows, 100000)``. File names that are not valid UTF-8 get a
lossless escaped id (:func:`escape_name`). Per image (:class:`ReadOptions`): dangling symlinks
and images above ``max_image_pixels`` become invalid rows; EXIF orientation is applied unless
``exif_transpose=False``; class folders without images are an error unless
``allow_empty_classes``.
"""

from __future__ import annotations

import gzip
import logging
import os
import re
import struct
import threading
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from featcache.errors import DataError

log = logging.getLogger(__name__)

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
MIN_CLASS_BOUND = 100_000
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # PIL's Image.MAX_IMAGE_PIXELS
_EXIF_ORIENTATION = 0x0112
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
SPLIT_DIRS = ("train", "val", "test")


@dataclass(frozen=True)
class ReadOptions:
    """How image files are decoded (recorded in the feature provenance)."""

    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    exif_transpose: bool = True
    allow_empty_classes: bool = False
    decoder: str = "pil"  # pil | torchvision (JPEGs; resolved, see featcache.extract.decode)
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

    def load(self, i: int):
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


def to_rgb(img):
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


def decode_image(fp, options: ReadOptions | None = None):
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
            from featcache.extract.decode import torchvision_decode

            fast = torchvision_decode(im, fp, opts.exif_transpose)
            if fast is not None:
                return fast
        im.load()
        if opts.exif_transpose and im.getexif().get(_EXIF_ORIENTATION, 1) not in (0, 1):
            return to_rgb(ImageOps.exif_transpose(im))
        return to_rgb(im)


def load_image_file(path: str | os.PathLike, options: ReadOptions | None = None):
    """:func:`decode_image` of a file; raises on any broken file."""
    return decode_image(os.fspath(path) if not isinstance(path, str) else str(path), options)


# --------------------------------------------------------------------------- digits
def _digits() -> dict[str, SplitSource]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    images = (d.images * (255.0 / 16.0)).round().astype(np.uint8)  # 0..16 -> 0..255
    y = d.target.astype(np.int64)
    idx = np.arange(len(y))
    tr, te = train_test_split(idx, test_size=0.25, random_state=0, stratify=y)
    tr.sort()
    te.sort()
    names = [str(c) for c in d.target_names]

    def make(split: str, rows: np.ndarray) -> SplitSource:
        def loader(i: int, rows=rows):
            from PIL import Image

            return Image.fromarray(images[rows[i]], mode="L")

        return SplitSource(
            "digits",
            split,
            np.array([f"digits-{r}" for r in rows]),
            y[rows],
            names,
            loader,
            "sklearn.datasets.load_digits",
        )

    return {"train": make("train", tr), "test": make("test", te)}


# --------------------------------------------------------------------------- fashion-mnist
def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read a (gzipped) IDX file into a numpy array."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(f"{path} is not an IDX file (bad magic number)")
    dtype = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}.get(data[2])
    if dtype is None:
        raise DataError(f"{path}: unknown IDX element type 0x{data[2]:02x}")
    ndim = data[3]
    shape = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    arr = np.frombuffer(data, dtype=dtype, offset=4 + 4 * ndim)
    if arr.size != int(np.prod(shape)):
        raise DataError(f"{path} is truncated: expected {int(np.prod(shape))} values, found {arr.size}")
    return arr.reshape(shape)


def _fashion_mnist(root: str | None) -> dict[str, SplitSource]:
    root = root or FASHION_MNIST_DIR
    d = Path(root)
    if not d.is_dir():
        raise DataError(
            f"Fashion-MNIST folder {root} not found; install it with `apt-get install dataset-fashion-mnist` "
            "or pass --data fashion-mnist:DIR with the four *-idx*-ubyte.gz files"
        )
    out = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        files = {}
        for what in ("images-idx3-ubyte", "labels-idx1-ubyte"):
            cands = [d / f"{prefix}-{what}.gz", d / f"{prefix}-{what}"]
            f = next((c for c in cands if c.exists()), None)
            if f is None:
                raise DataError(
                    f"{cands[0]} missing in {root}; the Fashion-MNIST folder needs train-* and t10k-* IDX files"
                )
            files[what] = f
        lab = files["labels-idx1-ubyte"]
        img = files["images-idx3-ubyte"]

        def loader(i: int, img=img, cache={}):  # noqa: B006 - per-split lazy image cache
            from PIL import Image

            if "a" not in cache:
                cache["a"] = read_idx(img)
            return Image.fromarray(cache["a"][i], mode="L")

        labels = read_idx(lab).astype(np.int64)
        ids = np.array([f"{split}-{i:05d}" for i in range(len(labels))])
        out[split] = SplitSource("fashion-mnist", split, ids, labels, list(FASHION_MNIST_CLASSES), loader, str(d))
    return out


# --------------------------------------------------------------------------- imagefolder
def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _link_problem(p: str, root: str, follow: bool) -> str | None:
    """Why the symlink ``p`` is not read (outside ``root``, a loop, not stat-able), or None
    (a dangling link inside ``root`` is read and fails with FileNotFoundError as a plain file)."""
    try:
        target = os.path.realpath(p)
    except OSError as exc:  # a link into /proc that this user may not resolve
        return f"symlink {escape_name(p)} -> {_readlink(p)} cannot be followed ({exc.strerror or exc})"
    if not follow and not _inside(target, root):
        return (
            f"symlink {escape_name(p)} points outside the image folder (to {escape_name(target)}); not followed "
            "(pass --follow-symlinks / follow_symlinks=True to read it)"
        )
    try:
        os.stat(p)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"symlink {escape_name(p)} -> {_readlink(p)} cannot be followed ({exc.strerror or exc})"
    return None


def _readlink(p: str) -> str:
    try:
        return os.readlink(p)
    except OSError:
        return "?"


def _list_images(d: Path, root: str, follow: bool, refused: dict[str, str]) -> list[Path]:
    """Image files under ``d`` (subfolder symlinks are not walked, so no loop); a file symlink
    that dangles, loops, cannot be stat-ed or points outside ``root`` is listed with its reason
    in ``refused`` (it becomes an invalid row). Entries that vanish during the walk are skipped;
    a subfolder that cannot be listed is refused with one DataError."""
    out: list[Path] = []
    stack = [str(d)]
    while stack:
        top = stack.pop()
        try:
            with os.scandir(top) as it:
                entries = list(it)
        except FileNotFoundError:
            continue  # vanished during the walk
        except OSError as exc:
            raise DataError(
                f"cannot list image subfolder {escape_name(top)} ({exc.strerror or exc}); make it readable "
                "or move it out of the image folder, then re-run"
            ) from None
        for e in entries:
            try:
                link = e.is_symlink()
                is_dir = not link and e.is_dir(follow_symlinks=False)
            except OSError:
                continue  # vanished between listing and lstat
            if is_dir:
                stack.append(e.path)
            elif os.path.splitext(e.name)[1].lower() in IMAGE_EXTENSIONS:
                if link:
                    why = _link_problem(e.path, root, follow)
                    if why is None and os.path.isdir(e.path):
                        continue  # a link to a folder named like an image
                    if why is not None:
                        refused[e.path] = why
                elif not e.is_file(follow_symlinks=False):
                    continue  # a fifo, socket or device named like an image
                out.append(Path(e.path))
    return sorted(out)


class _FileLoader:
    """Loader of row ``i`` from an array of file paths (picklable); ``refused`` maps the paths
    that are not read to the reason (stored as the invalid row's error text)."""

    def __init__(self, paths: np.ndarray, options: ReadOptions, refused: dict[str, str] | None = None):
        self.paths, self.options, self.refused = paths, options, refused or {}

    def __call__(self, i: int):
        p = str(self.paths[i])
        if p in self.refused:
            raise DataError(self.refused[p])
        return load_image_file(p, self.options)


def _class_dirs(base: Path, root: str, follow: bool) -> list[str]:
    """Class folder names in ``base``; a symlinked class folder is followed only inside ``root``
    (or when asked), else refused with one DataError."""
    try:
        with os.scandir(base) as it:
            entries = [e for e in it if not e.name.startswith(".")]
    except OSError as exc:
        raise DataError(f"cannot list image folder {base} ({exc.strerror or exc}); make it readable") from None
    names = []
    for e in entries:
        try:
            if e.is_symlink():
                why = _link_problem(e.path, root, follow)
                if why is not None:
                    raise DataError(f"class folder {why}; remove the link or copy the images in")
            if e.is_dir():
                names.append(e.name)
        except FileNotFoundError:
            continue  # vanished during the walk
    return names


def _imagefolder(root: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    d = Path(root)
    if not d.is_dir():
        raise DataError(f"image folder {root} does not exist or is not a directory")
    real = os.path.realpath(d)
    follow = options.follow_symlinks
    split_dirs = [s for s in SPLIT_DIRS if (d / s).is_dir()]
    layout = {s: d / s for s in split_dirs} if split_dirs else {"all": d}
    classes = sorted({c for base in layout.values() for c in _class_dirs(base, real, follow)})
    if not classes:
        raise DataError(
            f"{root} has no class subfolders; expected {root}/<class>/<image> (or train/val/test/<class>/...)"
        )
    index = {c: i for i, c in enumerate(classes)}
    out, empty = {}, []
    for split, base in layout.items():
        paths, labels, refused = [], [], {}
        for c in classes:
            if (base / c).is_dir():
                found = _list_images(base / c, real, follow, refused)
                if not found:
                    empty.append(escape_name(str(base / c)))
                for p in found:
                    paths.append(p)
                    labels.append(index[c])
        if not paths:
            raise DataError(f"{base} holds no images with extensions {IMAGE_EXTENSIONS}")
        if refused:
            log.warning(
                "%s: %d symlink(s) not followed (invalid rows): %s", base, len(refused), next(iter(refused.values()))
            )
        ids = np.array([escape_name(p.relative_to(d).as_posix()) for p in paths])
        path_arr = np.array([str(p) for p in paths])
        out[split] = SplitSource(
            name,
            split,
            ids,
            np.array(labels, np.int64),
            classes,
            _FileLoader(path_arr, options, refused),
            f"imagefolder:{d.resolve()}",
        )
    if empty and not options.allow_empty_classes:
        more = f" and {len(empty) - 5} more" if len(empty) > 5 else ""
        raise DataError(
            f"class folder(s) without images: {', '.join(empty[:5])}{more}; add images, remove the folder(s), "
            "or pass --allow-empty-classes to keep them as classes without examples"
        )
    return out


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
    def from_polars(cls, s) -> StringColumn:
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

    def __getitem__(self, i):
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


class _PathLoader:
    """Loader of row ``i`` from a :class:`StringColumn` of file paths (picklable)."""

    def __init__(self, paths: StringColumn, options: ReadOptions | None = None):
        self.paths = paths
        self.options = options

    def __call__(self, i: int):
        return load_image_file(self.paths[i], self.options)


# --------------------------------------------------------------------------- manifest
def _manifest(file: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """Read a manifest with polars; ids, labels and paths go straight to numpy buffers."""
    import polars as pl

    f = Path(file)
    if not f.is_file():
        raise DataError(f"manifest {file} not found")
    try:
        if f.suffix.lower() in (".parquet", ".pq"):
            df = pl.read_parquet(f)
        else:
            df = pl.read_csv(f, infer_schema_length=10000, schema_overrides={"path": pl.Utf8, "id": pl.Utf8})
    except Exception as exc:  # polars raises several error types for bad files
        raise DataError(
            f"cannot read manifest {file}: {exc}; give a CSV or parquet with columns path,label[,split][,id]"
        ) from exc
    if "label" not in df.columns and "caption" in df.columns:  # a captions manifest (image-text retrieval)
        df = df.with_columns(pl.lit("unlabeled").alias("label"))
    missing = [c for c in ("path", "label") if c not in df.columns]
    if missing:
        raise DataError(
            f"manifest {file} lacks column(s) {missing}; it has {df.columns} (need path,label[,split][,id])"
        )
    if df.height == 0:
        raise DataError(f"manifest {file} has a header but no rows; add one row per image (path,label[,split][,id])")
    if df["path"].null_count() or df["label"].null_count():
        raise DataError(f"manifest {file} has empty path or label cells")
    dt = df["label"].dtype
    if dt.is_integer() or dt.is_float():
        labels_all = (
            df["label"].cast(pl.Int64).to_numpy()
            if dt.is_integer()
            else integral_labels(df["label"].to_numpy(), f"manifest {file}")
        )
        classes = integer_classes(labels_all, f"manifest {file}")
    elif dt == pl.Boolean:
        raise DataError(f"manifest {file}: labels are true/false; give integers >= 0 or class-name strings")
    else:
        lab = df["label"].cast(pl.Utf8)
        classes = lab.unique().sort().to_list()
        labels_all = lab.cast(pl.Enum(classes)).to_physical().cast(pl.Int64).to_numpy()
    base = str(f.resolve().parent).rstrip("/") + "/"
    path = pl.col("path").cast(pl.Utf8)
    df = df.with_columns(pl.when(path.str.starts_with("/")).then(path).otherwise(pl.lit(base) + path).alias("_abs"))
    if "id" not in df.columns:
        df = df.with_columns(pl.col("path").alias("id"))
    df = df.with_columns(pl.Series("_label", labels_all))
    multi = manifest_label_matrix(df) if "labels" in df.columns else None
    if "split" not in df.columns:
        df = df.with_columns(pl.lit("all").alias("split"))
    df = df.with_row_index("_row").select(
        pl.col("_abs"), pl.col("id").cast(pl.Utf8), pl.col("_label"), pl.col("split").cast(pl.Utf8), pl.col("_row")
    )
    out = {}
    for s in df["split"].unique(maintain_order=True).to_list():
        part = df.filter(pl.col("split") == s)
        paths = StringColumn.from_polars(part["_abs"])
        extra = {"paths": paths}
        if multi is not None:  # the extraction stores them as the split's label matrix
            extra.update(label_matrix=multi[0][part["_row"].to_numpy()], label_names=multi[1])
        out[s] = SplitSource(
            name,
            s,
            StringColumn.from_polars(part["id"]).to_numpy(),
            part["_label"].to_numpy(),
            classes,
            _PathLoader(paths, options),
            f"manifest:{f.resolve()}",
            extra=extra,
        )
    return out


def manifest_label_matrix(df) -> tuple[np.ndarray, list[str]]:
    """Multi-label targets of a manifest's ``labels`` column (``;``-separated class names,
    empty = none): ([N, C] bool, the sorted class names)."""
    import polars as pl

    parts = (
        df.select(
            pl.int_range(pl.len()).alias("row"),
            pl.col("labels").cast(pl.Utf8).fill_null("").str.split(";").alias("name"),
        )
        .explode("name")
        .with_columns(pl.col("name").str.strip_chars())
        .filter(pl.col("name").is_not_null() & (pl.col("name") != ""))
    )
    names = sorted(parts["name"].unique().to_list())
    if not names:
        raise DataError(
            "manifest column 'labels' names no class; give ';'-separated class names "
            "per row (e.g. 'top;long_sleeves') or drop the column"
        )
    M = np.zeros((df.height, len(names)), bool)
    M[parts["row"].to_numpy(), parts["name"].cast(pl.Enum(names)).to_physical().to_numpy()] = True
    return M, names


# --------------------------------------------------------------------------- webdataset
WDS_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "tif", "tiff", "gif")
_WDS_SPLIT_RE = re.compile(r"^(train|val|valid|validation|test)(?=[-_.])")


class _TarMemberLoader:
    """Random access to image members of tar shards by (shard, byte offset, size).

    Keeps one open descriptor per shard (opened lazily, so it pickles to workers; reads use
    ``os.pread`` with explicit offsets, safe in forked workers sharing a descriptor)."""

    def __init__(
        self,
        shards: list[str],
        shard: np.ndarray,
        offset: np.ndarray,
        size: np.ndarray,
        options: ReadOptions | None = None,
    ):
        self.shards, self.shard, self.offset, self.size = shards, shard, offset, size
        self.options = options
        self._files: dict[int, Any] = {}

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_files"] = {}
        return d

    def __call__(self, i: int):
        import io

        if self.size[i] < 0:
            raise DataError("sample has no image member (.jpg/.png/...)")
        s = int(self.shard[i])
        fd = self._files.get(s)
        if fd is None:
            fd = self._files[s] = os.open(self.shards[s], os.O_RDONLY)
        # pread: no shared file offset, so forked workers that inherit the descriptor never race
        data = os.pread(fd, int(self.size[i]), int(self.offset[i]))
        return decode_image(io.BytesIO(data), self.options)


def _wds_label(ext: str, payload: bytes):
    if ext == "npy":  # CLIP_benchmark's multi-label exports: one [C] vector per sample
        import io

        return np.load(io.BytesIO(payload), allow_pickle=False)
    if ext == "cls":
        return int(payload.decode().strip())
    import json

    d = json.loads(payload)
    for k in ("label", "cls", "class"):
        if k in d:
            return d[k]
    return None


def _webdataset(pattern: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """Index tar shards (headers and label members only) for random access by row.

    Samples are grouped webdataset-style (``__key__`` = member path without extensions, via
    ``webdataset``'s own key splitting); the id of a row is its ``__key__``. The split is the
    shard name's prefix (``train-000.tar`` -> ``train``; ``val``/``test`` likewise), else ``all``.
    """
    try:
        from webdataset.shardlists import expand_urls
        from webdataset.tariterators import base_plus_ext
    except ImportError as exc:
        raise DataError("--data webdataset:... needs the webdataset package: pip install 'featcache[bulk]'") from exc

    shards = _wds_shards(pattern, expand_urls)
    idx = _wds_index(shards, base_plus_ext)
    if not idx["keys"]:
        raise DataError(f"webdataset shards {shards[:3]} hold no samples")
    raw = idx.pop("raw_labels")
    matrix = _wds_label_matrix(raw, idx["keys"], pattern)
    if matrix is None:
        classes, labels_all = _wds_labels(raw, idx["keys"], pattern)
    else:  # multi-label: the [N, C] matrix; the label column holds each row's first class
        classes, labels_all = [str(c) for c in range(matrix.shape[1])], matrix.argmax(axis=1).astype(np.int64)
    ids_all = np.asarray(idx.pop("keys"), dtype=str)
    splits_arr = np.asarray(idx["split_of"])
    shard_a = np.frombuffer(idx["shard_i"], dtype=np.int32)
    off_a, size_a = np.frombuffer(idx["off"], dtype=np.int64), np.frombuffer(idx["size"], dtype=np.int64)
    out = {}
    for s in dict.fromkeys(idx["split_of"]):
        rows = np.flatnonzero(splits_arr == s)
        out[s] = SplitSource(
            name,
            s,
            ids_all[rows],
            labels_all[rows],
            classes,
            _TarMemberLoader(shards, shard_a[rows], off_a[rows], size_a[rows], options),
            f"webdataset:{pattern}",
            {} if matrix is None else {"label_matrix": matrix[rows], "label_names": classes},
        )
    return out


def _wds_label_matrix(raw_labels: list, keys: list[str], pattern: str) -> np.ndarray | None:
    """The [N, C] bool label matrix of ``.npy`` label members (CLIP_benchmark's multi-label
    exports), or None when no sample has one. Every sample needs a 1-D vector of one length C."""
    if not any(isinstance(v, np.ndarray) for v in raw_labels):
        return None
    vec = [v for v in raw_labels if isinstance(v, np.ndarray)]
    n_cls = vec[0].size
    for key, v in zip(keys, raw_labels):
        ok = isinstance(v, np.ndarray) and v.ndim == 1 and v.size == n_cls and v.dtype.kind in "biuf"
        if not ok or not np.all(np.isfinite(v)):
            got = "no .npy label" if not isinstance(v, np.ndarray) else f"a {v.dtype} array of shape {v.shape}"
            raise DataError(
                f"webdataset {pattern}: sample {key!r} has {got}; a multi-label export needs a .npy "
                f"vector of {n_cls} numbers (0/1) for every sample: re-export that sample or drop it"
            )
    return np.stack(vec) > 0


def _wds_shards(pattern: str, expand_urls) -> list[str]:
    """The local tar files a webdataset pattern names (brace ranges and globs expanded)."""
    shards = []
    for u in expand_urls(pattern):
        if any(ch in u for ch in "*?["):
            shards.extend(
                sorted(str(p) for p in Path().glob(u))
                if not os.path.isabs(u)
                else sorted(str(p) for p in Path("/").glob(u.lstrip("/")))
            )
        else:
            shards.append(u)
    if not shards:
        raise DataError(
            f"webdataset pattern {pattern!r} matches no shard; give e.g. 'data/train-{{000000..000009}}.tar'"
        )
    lost = [u for u in shards if not os.path.isfile(u)]
    if lost:
        raise DataError(
            f"webdataset shard(s) not found: {lost[:5]} (of {len(shards)}); only local .tar files are supported"
        )
    return shards


def _wds_index(shards: list[str], base_plus_ext) -> dict:
    """One entry per sample: key, split, shard, image member offset/size and raw label
    (compact ``array`` columns: a million-row index holds no per-row Python objects but keys)."""
    import tarfile
    from array import array

    idx = {"keys": [], "split_of": [], "shard_i": array("i"), "off": array("q"), "size": array("q"), "raw_labels": []}
    for si, path in enumerate(shards):
        m = _WDS_SPLIT_RE.match(Path(path).name)
        split = m.group(1) if m else "all"
        try:
            tf = tarfile.open(path, "r:")  # noqa: SIM115 - closed below
        except (tarfile.TarError, OSError) as exc:
            raise DataError(f"{path} is not a readable (uncompressed) tar shard: {exc}") from exc
        try:
            with tf:
                _wds_index_shard(tf, si, split, base_plus_ext, idx)
                end = tf.offset
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise DataError(
                f"{path}: tar shard is damaged or truncated ({type(exc).__name__}: {exc}); "
                "re-copy or re-write the shard"
            ) from exc
        _wds_check_sizes(path, si, idx, end)
    return idx


def _wds_check_sizes(path: str, si: int, idx: dict, end: int) -> None:
    """A shard cut inside its last member's data, or at a member boundary (no end-of-archive
    block left), reads as a clean end of archive in ``tarfile``: catch both."""
    total = os.path.getsize(path)
    if total < end + 512:
        raise DataError(
            f"{path}: tar shard is truncated (no end-of-archive block after byte {end}, file has "
            f"{total} bytes); re-copy or re-write the shard"
        )
    for k in range(len(idx["shard_i"]) - 1, -1, -1):
        if idx["shard_i"][k] != si:
            break
        if idx["size"][k] >= 0 and idx["off"][k] + idx["size"][k] > total:
            raise DataError(
                f"{path}: tar shard is truncated (member of sample {idx['keys'][k]!r} ends at byte "
                f"{idx['off'][k] + idx['size'][k]}, the file has {total}); re-copy or re-write the shard"
            )


def _wds_index_shard(tf, si: int, split: str, base_plus_ext, idx: dict) -> None:
    keys, split_of, shard_i, off, size, raw_labels = (
        idx[k] for k in ("keys", "split_of", "shard_i", "off", "size", "raw_labels")
    )
    path, cur = tf.name, None
    for mem in tf:
        if not mem.isfile():
            continue
        key, ext = base_plus_ext(mem.name)
        if key is None or Path(mem.name).name.startswith("__"):
            continue
        ext = ext.lower()
        if key != cur:
            cur = key
            keys.append(escape_name(key))
            split_of.append(split)
            shard_i.append(si)
            off.append(0)
            size.append(-1)
            raw_labels.append(None)
        if ext in WDS_IMAGE_EXTS and size[-1] < 0:
            off[-1], size[-1] = mem.offset_data, mem.size
        elif ext in ("cls", "json", "npy") and raw_labels[-1] is None:
            fh = tf.extractfile(mem)
            try:
                raw_labels[-1] = _wds_label(ext, fh.read())
            except (ValueError, UnicodeDecodeError, EOFError) as exc:
                raise DataError(f"{path}: cannot parse label member {mem.name}: {exc}") from exc


def _wds_labels(raw_labels: list, keys: list[str], pattern: str) -> tuple[list[str], np.ndarray]:
    """Class names and label indices of the samples' raw .cls/.json labels (integers >= 0
    or class-name strings; none at all: one class 'unlabeled')."""
    nolabel = sum(v is None for v in raw_labels)
    if nolabel == len(raw_labels):
        log.info("webdataset %s: no .cls/.json labels; all rows get class 'unlabeled'", pattern)
        return ["unlabeled"], np.zeros(len(keys), np.int64)
    if nolabel:
        first = keys[next(i for i, v in enumerate(raw_labels) if v is None)]
        raise DataError(f"webdataset {pattern}: {nolabel} samples lack a .cls/.json label (e.g. {first!r})")
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in raw_labels):
        where = f"webdataset {pattern}"
        labels_all = (
            np.asarray(raw_labels, np.int64)
            if all(isinstance(v, int) for v in raw_labels)
            else integral_labels(np.asarray(raw_labels, np.float64), where)
        )
        return integer_classes(labels_all, where), labels_all
    if not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in raw_labels):
        odd = next(v for v in raw_labels if isinstance(v, bool) or not isinstance(v, (int, str)))
        raise DataError(f"webdataset {pattern}: label {odd!r} is neither an integer >= 0 nor a class-name string")
    strs = [str(v) for v in raw_labels]
    classes = sorted(set(strs))
    index = {c: i for i, c in enumerate(classes)}
    return classes, np.fromiter((index[v] for v in strs), np.int64, len(strs))


# --------------------------------------------------------------------------- entry point
def parse_spec(spec: str) -> tuple[str, str | None]:
    kind, _, arg = spec.partition(":")
    return kind.strip().lower(), (arg or None)


def default_name(spec: str) -> str:
    kind, arg = parse_spec(spec)
    if kind in ("imagefolder", "manifest") and arg:
        p = Path(arg)
        return (p.stem if kind == "manifest" else p.resolve().name) or kind
    if kind in ("webdataset", "wds") and arg:
        name = Path(arg.split("::")[0]).parent.name
        return name or "webdataset"
    if arg and kind in _format_kinds():  # a task folder (or file) of the formats in .formats
        p = Path(arg).resolve()
        return (p.stem if p.is_file() else p.name) or kind
    return kind


def _format_kinds() -> tuple[str, ...]:
    from featcache.extract.formats import FORMATS

    return tuple(FORMATS)


def open_dataset(spec: str, name: str | None = None, *, options: ReadOptions | None = None) -> dict[str, SplitSource]:
    """All splits of a data spec, keyed by split name (``options``: how image files decode).

    >>> splits = open_dataset("digits")
    >>> len(splits["train"]), len(splits["test"])
    (1347, 450)
    """
    kind, arg = parse_spec(spec)
    dname = name or default_name(spec)
    options = options or ReadOptions()
    if kind == "digits":
        out = _digits()
    elif kind in ("fashion-mnist", "fashion_mnist", "fmnist"):
        out = _fashion_mnist(arg)
    elif kind == "imagefolder":
        if not arg:
            raise DataError("imagefolder needs a folder: --data imagefolder:DIR")
        out = _imagefolder(arg, dname, options)
    elif kind == "manifest":
        if not arg:
            raise DataError("manifest needs a file: --data manifest:FILE.csv")
        out = _manifest(arg, dname, options)
    elif kind in ("webdataset", "wds"):
        if not arg:
            raise DataError("webdataset needs shards: --data 'webdataset:DIR/train-{000000..000009}.tar'")
        out = _webdataset(arg, dname, options)
    elif kind in _format_kinds():
        from featcache.extract.formats import open_format

        out = open_format(kind, arg, dname, options)
    else:
        raise DataError(
            f"unknown data spec {spec!r}; {_path_hint(spec)}use digits, fashion-mnist[:DIR], imagefolder:DIR, "
            "manifest:FILE, webdataset:PATTERN, clip-benchmark:DIR, hf:PATH or vtab1k:DIR"
        )
    for s in out.values():
        s.dataset = dname
    return out


def _path_hint(spec: str) -> str:
    """A bare path given as a data spec: the scheme it most likely needs, as a suggestion."""
    p = Path(spec).expanduser()
    if p.is_dir():
        if any(c.is_dir() for c in p.iterdir()):
            return f"{spec!r} is a folder of folders: for class (or split/class) folders pass imagefolder:{spec}; "
        return f"{spec!r} is a folder without class folders: put images in one folder per class and pass imagefolder:{spec}; "
    if p.is_file() and p.suffix.lower() in (".csv", ".parquet"):
        return f"{spec!r} is a table: as a manifest (path, label[, split] columns) pass manifest:{spec}; "
    if p.is_file() and p.suffix.lower() == ".tar":
        return f"{spec!r} is a tar shard: pass webdataset:{spec}; "
    return ""


def select_splits(splits: dict[str, SplitSource], wanted: Sequence[str] | None) -> list[SplitSource]:
    if not wanted:
        return list(splits.values())
    missing = [w for w in wanted if w not in splits]
    if missing:
        raise DataError(f"split(s) {missing} do not exist in this dataset; available: {sorted(splits)}")
    return [splits[w] for w in wanted]
