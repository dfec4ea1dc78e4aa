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
==========================  ================================================================

Grey, palette, CMYK, 16-bit and RGBA images all become 8-bit RGB.
"""

from __future__ import annotations

import gzip
import logging
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from featcache.errors import DataError

log = logging.getLogger(__name__)

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
SPLIT_DIRS = ("train", "val", "test")


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
            self.dataset, self.split, self.ids[:n], self.labels[:n], self.class_names,
            base, f"{self.source}[:{n}]", dict(self.extra),
        )


def to_rgb(img):
    """8-bit RGB from any PIL mode (16-bit and 32-bit ints are rescaled, not clipped)."""
    from PIL import Image

    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        a = np.asarray(img, dtype=np.float64)
        hi = 65535.0 if img.mode.startswith("I;16") or a.max() > 255 else 255.0
        a = np.clip(a / hi * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return Image.fromarray(a, mode="L").convert("RGB")
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA"):
        bg = Image.new("RGB", img.size, (255, 255, 255))
        rgba = img.convert("RGBA")
        bg.paste(rgba, mask=rgba.getchannel("A"))
        return bg
    return img.convert("RGB")


def load_image_file(path: str | os.PathLike):
    """Open, fully decode and convert to RGB; raises on any broken file."""
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        return to_rgb(im)


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

            return Image.fromarray(images[rows[i]], mode="L").convert("RGB")

        return SplitSource("digits", split, np.array([f"digits-{r}" for r in rows]), y[rows], names,
                           loader, "sklearn.datasets.load_digits")

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
                raise DataError(f"{cands[0]} missing in {root}; the Fashion-MNIST folder needs train-* and t10k-* IDX files")
            files[what] = f
        lab = files["labels-idx1-ubyte"]
        img = files["images-idx3-ubyte"]

        def loader(i: int, img=img, cache={}):  # noqa: B006 - per-split lazy image cache
            from PIL import Image

            if "a" not in cache:
                cache["a"] = read_idx(img)
            return Image.fromarray(cache["a"][i], mode="L").convert("RGB")

        labels = read_idx(lab).astype(np.int64)
        ids = np.array([f"{split}-{i:05d}" for i in range(len(labels))])
        out[split] = SplitSource("fashion-mnist", split, ids, labels, list(FASHION_MNIST_CLASSES), loader, str(d))
    return out


# --------------------------------------------------------------------------- imagefolder
def _list_images(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def _imagefolder(root: str, name: str) -> dict[str, SplitSource]:
    d = Path(root)
    if not d.is_dir():
        raise DataError(f"image folder {root} does not exist or is not a directory")
    split_dirs = [s for s in SPLIT_DIRS if (d / s).is_dir()]
    layout = {s: d / s for s in split_dirs} if split_dirs else {"all": d}
    classes = sorted({c.name for base in layout.values() for c in base.iterdir() if c.is_dir() and not c.name.startswith(".")})
    if not classes:
        raise DataError(f"{root} has no class subfolders; expected {root}/<class>/<image> (or train/val/test/<class>/...)")
    index = {c: i for i, c in enumerate(classes)}
    out = {}
    for split, base in layout.items():
        paths, labels = [], []
        for c in classes:
            if (base / c).is_dir():
                for p in _list_images(base / c):
                    paths.append(p)
                    labels.append(index[c])
        if not paths:
            raise DataError(f"{base} holds no images with extensions {IMAGE_EXTENSIONS}")
        ids = np.array([p.relative_to(d).as_posix() for p in paths])
        path_arr = np.array([str(p) for p in paths])
        out[split] = SplitSource(name, split, ids, np.array(labels, np.int64), classes,
                                 lambda i, a=path_arr: load_image_file(a[i]), f"imagefolder:{d.resolve()}")
    return out


# --------------------------------------------------------------------------- manifest
def _manifest(file: str, name: str) -> dict[str, SplitSource]:
    import polars as pl

    f = Path(file)
    if not f.is_file():
        raise DataError(f"manifest {file} not found")
    try:
        df = pl.read_parquet(f) if f.suffix.lower() in (".parquet", ".pq") else pl.read_csv(f, infer_schema_length=10000)
    except Exception as exc:  # polars raises several error types for bad files
        raise DataError(f"cannot read manifest {file}: {exc}; give a CSV or parquet with columns path,label[,split][,id]") from exc
    missing = [c for c in ("path", "label") if c not in df.columns]
    if missing:
        raise DataError(f"manifest {file} lacks column(s) {missing}; it has {df.columns} (need path,label[,split][,id])")
    if df["path"].null_count() or df["label"].null_count():
        raise DataError(f"manifest {file} has empty path or label cells")
    if df["label"].dtype.is_integer():
        vals = sorted(set(df["label"].to_list()))
        if vals[0] < 0:
            raise DataError(f"manifest {file}: integer labels must be >= 0")
        classes = [str(i) for i in range(vals[-1] + 1)]
        labels_all = df["label"].cast(pl.Int64).to_numpy()
    else:
        lab = df["label"].cast(pl.Utf8)
        classes = sorted(set(lab.to_list()))
        index = {c: i for i, c in enumerate(classes)}
        labels_all = np.array([index[v] for v in lab.to_list()], np.int64)
    base = f.resolve().parent
    paths = np.array([str(p if os.path.isabs(p) else base / p) for p in df["path"].cast(pl.Utf8).to_list()])
    ids_all = df["id"].cast(pl.Utf8).to_numpy() if "id" in df.columns else df["path"].cast(pl.Utf8).to_numpy()
    splits = df["split"].cast(pl.Utf8).to_numpy() if "split" in df.columns else np.full(len(df), "all")
    out = {}
    for s in dict.fromkeys(splits.tolist()):
        m = splits == s
        p = paths[m]
        out[s] = SplitSource(name, s, ids_all[m].astype(str), labels_all[m], classes,
                             lambda i, a=p: load_image_file(a[i]), f"manifest:{f.resolve()}",
                             extra={"paths": p})
    return out


# --------------------------------------------------------------------------- entry point
def parse_spec(spec: str) -> tuple[str, str | None]:
    kind, _, arg = spec.partition(":")
    return kind.strip().lower(), (arg or None)


def default_name(spec: str) -> str:
    kind, arg = parse_spec(spec)
    if kind in ("imagefolder", "manifest") and arg:
        p = Path(arg)
        return (p.stem if kind == "manifest" else p.resolve().name) or kind
    return kind


def open_dataset(spec: str, name: str | None = None) -> dict[str, SplitSource]:
    """All splits of a data spec, keyed by split name.

    >>> splits = open_dataset("digits")
    >>> len(splits["train"]), len(splits["test"])
    (1347, 450)
    """
    kind, arg = parse_spec(spec)
    dname = name or default_name(spec)
    if kind == "digits":
        out = _digits()
    elif kind in ("fashion-mnist", "fashion_mnist", "fmnist"):
        out = _fashion_mnist(arg)
    elif kind == "imagefolder":
        if not arg:
            raise DataError("imagefolder needs a folder: --data imagefolder:DIR")
        out = _imagefolder(arg, dname)
    elif kind == "manifest":
        if not arg:
            raise DataError("manifest needs a file: --data manifest:FILE.csv")
        out = _manifest(arg, dname)
    else:
        raise DataError(
            f"unknown data spec {spec!r}; use digits, fashion-mnist[:DIR], imagefolder:DIR or manifest:FILE"
        )
    for s in out.values():
        s.dataset = dname
    return out


def select_splits(splits: dict[str, SplitSource], wanted: Sequence[str] | None) -> list[SplitSource]:
    if not wanted:
        return list(splits.values())
    missing = [w for w in wanted if w not in splits]
    if missing:
        raise DataError(f"split(s) {missing} do not exist in this dataset; available: {sorted(splits)}")
    return [splits[w] for w in wanted]
