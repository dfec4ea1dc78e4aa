"""Readers of the built-in folder and file layouts.

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
==========================  ================================================================

Per image (:class:`~featcache.data.source.ReadOptions`): dangling symlinks and images above
``max_image_pixels`` become invalid rows; EXIF orientation is applied unless
``exif_transpose=False``; class folders without images are an error unless
``allow_empty_classes``.
"""

from __future__ import annotations

import gzip
import logging
import os
import stat
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.data.decode import PathLoader, load_image_file
from featcache.data.readers.registry import register_format
from featcache.data.source import (
    ReadOptions,
    SplitSource,
    StringColumn,
    escape_name,
    integer_classes,
    integral_labels,
)
from featcache.errors import DataError

if TYPE_CHECKING:
    import polars as pl

log = logging.getLogger(__name__)

__all__ = [
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_DIR",
    "IMAGE_EXTENSIONS",
    "digits",
    "fashion_mnist",
    "imagefolder",
    "manifest",
    "manifest_label_matrix",
    "read_idx",
]

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
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
SPLIT_DIRS = ("train", "val", "test")


# --------------------------------------------------------------------------- digits
@register_format("digits", usage="digits", missing=None, name_of=None)
def digits(arg: str | None, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """scikit-learn's digits, split train 1,347 / test 450 (``arg`` is not used)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d: Any = load_digits()  # a Bunch (scikit-learn types it as Bunch or an (X, y) tuple)
    images = (d.images * (255.0 / 16.0)).round().astype(np.uint8)  # 0..16 -> 0..255
    y = d.target.astype(np.int64)
    idx = np.arange(len(y))
    tr, te = (np.asarray(a) for a in train_test_split(idx, test_size=0.25, random_state=0, stratify=y))
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


@register_format("fashion-mnist", "fashion_mnist", "fmnist", usage="fashion-mnist[:DIR]", missing=None, name_of=None)
def fashion_mnist(root: str | None, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """Fashion-MNIST's IDX files in ``root`` (default: Debian's package folder)."""
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
        st = os.stat(p)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"symlink {escape_name(p)} -> {_readlink(p)} cannot be followed ({exc.strerror or exc})"
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):  # opening a FIFO would block
        return f"symlink {escape_name(p)} -> {_readlink(p)} is not a regular file (a FIFO, socket or device); not read"
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
                elif not e.is_file(follow_symlinks=False):  # a fifo, socket or device named like an image:
                    log.warning(  # never opened (a FIFO would block the read)
                        "%s is not a regular file (a FIFO, socket or device); skipped, no row", escape_name(e.path)
                    )
                    continue
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


@register_format(
    "imagefolder",
    usage="imagefolder:DIR",
    missing="imagefolder needs a folder: --data imagefolder:DIR",
    name_of=lambda arg: Path(arg).resolve().name,
)
def imagefolder(root: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """Class folders ``root/<class>/<image>``, or ``root/train|val|test/<class>/...``."""
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


# --------------------------------------------------------------------------- manifest
@register_format(
    "manifest",
    usage="manifest:FILE",
    note="csv/parquet: path,label[,split][,id]",
    missing="manifest needs a file: --data manifest:FILE.csv",
    name_of=lambda arg: Path(arg).stem,
)
def manifest(file: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
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
        extra: dict[str, Any] = {"paths": paths}
        if multi is not None:  # the extraction stores them as the split's label matrix
            extra.update(label_matrix=multi[0][part["_row"].to_numpy()], label_names=multi[1])
        out[s] = SplitSource(
            name,
            s,
            StringColumn.from_polars(part["id"]).to_numpy(),
            part["_label"].to_numpy(),
            classes,
            PathLoader(paths, options),
            f"manifest:{f.resolve()}",
            extra=extra,
        )
    return out


def manifest_label_matrix(df: pl.DataFrame) -> tuple[np.ndarray, list[str]]:
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
