"""Readers of the dense (per-pixel target) dataset layouts, read offline from a local copy
(issue 57). Every split is a :class:`~featcache.data.source.SplitSource` like any other (labels
all 0; ``class_names``: the dataset's classes) with ``extra["dense"]`` a
:class:`~featcache.core.dense.DenseInfo` and ``extra["target"]`` a picklable loader of row
``i``'s target at the image's own size (masks: uint8/uint16 class ids after the dataset's own
reductions; depth: float32 metres, 0 where invalid).

==========================  ================================================================
spec                        layout
==========================  ================================================================
``ade20k:PATH``             ``ADEChallengeData2016/images/{training,validation}/*.jpg`` +
                            ``annotations/{training,validation}/*.png`` (PATH: the folder
                            itself or the one holding it); splits ``train``, ``val``; 150
                            classes (DINOv3's names); reduce-zero-label applied (0 -> 255,
                            k -> k-1) as the reference does. Ids: the file stems.
``voc:PATH``                Pascal VOC 2012: ``JPEGImages/<id>.jpg``,
                            ``SegmentationClass/<id>.png`` (palette indices, not colours),
                            ``ImageSets/Segmentation/{train,val}.txt`` (PATH: ``VOC2012``,
                            ``VOCdevkit`` or the folder holding it); 21 classes, 255 (the
                            object boundary) ignored. Ids: the image-set ids.
``cityscapes:PATH``         ``leftImg8bit/<split>/<city>/*_leftImg8bit.png`` +
                            ``gtFine/<split>/<city>/*_gtFine_labelTrainIds.png`` (made by
                            cityscapesScripts' ``createTrainIdLabelImgs``); 19 classes, 255
                            ignored. Ids: ``<city>/<frame>``.
``nyuv2:PATH``              NYU Depth v2: the labeled ``nyu_depth_v2_labeled.mat`` (MATLAB
                            v7.3 = HDF5, read with h5py row by row; v5 files with scipy) and
                            the official ``splits.mat`` beside it (795 train / 654 test; ids
                            the 1-based MATLAB indices, ``0001``), or a folder
                            ``PATH/{train,test}/rgb/*`` + ``PATH/{train,test}/depth/*.png``
                            (16-bit PNG millimetres, 0 = invalid), or DINOv3's lists
                            ``PATH/nyu_{train,test}.txt`` (lines ``image depth focal``,
                            sorted; ids the image paths). Metres, range 0.001-10 m as
                            DINOv3's NYU config.
``segfolder:PATH``          ``PATH/<split>/images/*`` + ``PATH/<split>/masks/*.png`` with
                            matching stems (class-id PNGs: L, P or 16-bit), 255 ignored;
                            classes: ``PATH/classes.txt`` (one name per line) if present,
                            else ``0..`` the largest id in the masks (255 excluded).
==========================  ================================================================

Images are read as DINOv3 reads them (no EXIF rotation: a mask carries none, so rotating the
photo alone would unpair them); a target is read only when its row is extracted.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from featcache.core.dense import DenseInfo
from featcache.core.dense_metrics import IGNORE_INDEX, reduce_zero_label
from featcache.data.decode import load_image_file
from featcache.data.readers.folders import IMAGE_EXTENSIONS
from featcache.data.readers.registry import register_format
from featcache.data.source import ReadOptions, SplitSource, escape_name
from featcache.errors import DataError

log = logging.getLogger(__name__)

__all__ = [
    "ADE20K_CLASSES",
    "CITYSCAPES_CLASSES",
    "DEPTH_CLASS_NAMES",
    "NYU_DEPTH_RANGE",
    "NYU_DEPTH_SCALE",
    "NYU_LIST_FILES",
    "VOC_CLASSES",
    "DepthFiles",
    "ImageFiles",
    "MaskFiles",
    "NyuMat",
    "ade20k",
    "cityscapes",
    "dense_source",
    "nyuv2",
    "read_depth_png",
    "read_mask",
    "segfolder",
    "voc",
]

# facebookresearch/dinov3 @ 6876159a11b4df116f30f667f8c9888617df0751,
# notebooks/dinotxt_segmentation_inference.ipynb, class Ade20k.CLASS_NAMES ("bed " stripped)
ADE20K_CLASSES = (
    "wall",
    "building",
    "sky",
    "floor",
    "tree",
    "ceiling",
    "road",
    "bed",
    "windowpane",
    "grass",
    "cabinet",
    "sidewalk",
    "person",
    "earth",
    "door",
    "table",
    "mountain",
    "plant",
    "curtain",
    "chair",
    "car",
    "water",
    "painting",
    "sofa",
    "shelf",
    "house",
    "sea",
    "mirror",
    "rug",
    "field",
    "armchair",
    "seat",
    "fence",
    "desk",
    "rock",
    "wardrobe",
    "lamp",
    "bathtub",
    "railing",
    "cushion",
    "base",
    "box",
    "column",
    "signboard",
    "chest of drawers",
    "counter",
    "sand",
    "sink",
    "skyscraper",
    "fireplace",
    "refrigerator",
    "grandstand",
    "path",
    "stairs",
    "runway",
    "case",
    "pool table",
    "pillow",
    "screen door",
    "stairway",
    "river",
    "bridge",
    "bookcase",
    "blind",
    "coffee table",
    "toilet",
    "flower",
    "book",
    "hill",
    "bench",
    "countertop",
    "stove",
    "palm",
    "kitchen island",
    "computer",
    "swivel chair",
    "boat",
    "bar",
    "arcade machine",
    "hovel",
    "bus",
    "towel",
    "light",
    "truck",
    "tower",
    "chandelier",
    "awning",
    "streetlight",
    "booth",
    "television receiver",
    "airplane",
    "dirt track",
    "apparel",
    "pole",
    "land",
    "bannister",
    "escalator",
    "ottoman",
    "bottle",
    "buffet",
    "poster",
    "stage",
    "van",
    "ship",
    "fountain",
    "conveyer belt",
    "canopy",
    "washer",
    "plaything",
    "swimming pool",
    "stool",
    "barrel",
    "basket",
    "waterfall",
    "tent",
    "bag",
    "minibike",
    "cradle",
    "oven",
    "ball",
    "food",
    "step",
    "tank",
    "trade name",
    "microwave",
    "pot",
    "animal",
    "bicycle",
    "lake",
    "dishwasher",
    "screen",
    "blanket",
    "sculpture",
    "hood",
    "sconce",
    "vase",
    "traffic light",
    "tray",
    "ashcan",
    "fan",
    "pier",
    "crt screen",
    "plate",
    "monitor",
    "bulletin board",
    "shower",
    "radiator",
    "glass",
    "clock",
    "flag",
)
# the same notebook, class Cityscapes.CLASS_NAMES (the 19 trainIds 0..18)
CITYSCAPES_CLASSES = (
    "road",
    "sidewalk",
    "building",
    "wall",
    "fence",
    "pole",
    "traffic light",
    "traffic sign",
    "vegetation",
    "terrain",
    "sky",
    "person",
    "rider",
    "car",
    "truck",
    "bus",
    "train",
    "motorcycle",
    "bicycle",
)
# VOC2012 devkit (VOCdevkit/devkit_doc): the 20 object classes after background, palette order
VOC_CLASSES = (
    "background",
    "aeroplane",
    "bicycle",
    "bird",
    "boat",
    "bottle",
    "bus",
    "car",
    "cat",
    "chair",
    "cow",
    "diningtable",
    "dog",
    "horse",
    "motorbike",
    "person",
    "pottedplant",
    "sheep",
    "sofa",
    "train",
    "tvmonitor",
)
#: dinov3/eval/depth/configs/config-nyu.yaml: decoder_head min_depth / max_depth
NYU_DEPTH_RANGE = (0.001, 10.0)
#: NYU's 16-bit PNG depth: metres = value / 1000
NYU_DEPTH_SCALE = 1000.0
#: a depth dataset's one "class" (labels are all 0)
DEPTH_CLASS_NAMES = ("scene",)
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


# --------------------------------------------------------------------------- files and loaders
def read_mask(path: str | Path, dtype: str = "uint8") -> np.ndarray:
    """The class ids of a mask PNG as ``dtype`` ``[H, W]``: an L image's values, a P (palette)
    image's indices (never its colours), a 16-bit image's values; anything else is refused."""
    from PIL import Image

    with Image.open(path) as im:
        if im.mode in ("L", "P"):
            a = np.asarray(im)
        elif im.mode in ("I;16", "I;16B", "I;16L", "I"):
            a = np.asarray(im).astype(np.int64)
        else:
            raise DataError(
                f"mask {escape_name(str(path))} is a {im.mode} image; a mask is a single-channel PNG of class ids "
                "(L, P or 16-bit): convert colour masks to ids first"
            )
    top = np.iinfo(dtype).max
    bad = int(a.min()) if a.size and a.min() < 0 else int(a.max()) if a.size and a.max() > top else None
    if bad is not None:
        raise DataError(
            f"mask {escape_name(str(path))} holds id {bad}, outside 0..{top} ({dtype}); "
            "number the classes 0..K-1 (255 = ignore) or list them in classes.txt"
        )
    return a.astype(dtype)


def read_depth_png(path: str | Path, scale: float = NYU_DEPTH_SCALE) -> np.ndarray:
    """A 16-bit depth PNG as float32 metres ``[H, W]``: ``value / scale`` divided in float32, as
    DINOv3's ``NormalizeDepth`` divides (dinov3/eval/depth/transforms.py:172); 0 stays 0 =
    invalid. An 8-bit PNG is refused (its depth would be cut to 255 steps)."""
    from PIL import Image

    with Image.open(path) as im:
        if im.mode not in ("I;16", "I;16B", "I;16L", "I"):
            raise DataError(
                f"depth {escape_name(str(path))} is a {im.mode} image; depth PNGs are 16-bit single-channel "
                f"(value = metres x {scale:g}, 0 = invalid)"
            )
        a = np.asarray(im).astype(np.float32)
    return a / np.float32(scale)


def _image_size(path: str) -> tuple[int, int]:
    """``(h, w)`` of an image file, read from its header only."""
    from PIL import Image

    with Image.open(path) as im:
        return im.size[1], im.size[0]


def _paired(target: np.ndarray, target_path: str, image_path: str | None) -> np.ndarray:
    """``target``, refused in one line when its size is not its image's (read from the header)."""
    if image_path is not None and target.shape[:2] != (hw := _image_size(image_path)):
        raise DataError(
            f"target {escape_name(target_path)} is {target.shape[0]}x{target.shape[1]} (h x w) but its image "
            f"{escape_name(image_path)} is {hw[0]}x{hw[1]}; a target is stored at its image's own size"
        )
    return target


class ImageFiles:
    """Loader of row ``i``'s photo (RGB PIL) from an array of paths (picklable)."""

    def __init__(self, paths: list[Path], options: ReadOptions) -> None:
        self.paths = np.array([str(p) for p in paths])
        self.options = dataclasses.replace(options, exif_transpose=False)

    def __call__(self, i: int) -> Any:
        return load_image_file(str(self.paths[i]), self.options)


class MaskFiles:
    """Loader of row ``i``'s mask ids (picklable); ``reduce_zero``: ADE20K's relabelling;
    ``images``: the rows' photos, whose size each mask must have."""

    def __init__(self, paths: list[Path], dtype: str, reduce_zero: bool = False, images: list[Path] | None = None):
        self.paths = np.array([str(p) for p in paths])
        self.images = None if images is None else np.array([str(p) for p in images])
        self.dtype, self.reduce_zero = dtype, reduce_zero

    def __call__(self, i: int) -> np.ndarray:
        p = str(self.paths[i])
        if self.reduce_zero:
            m = reduce_zero_label(read_mask(p, "uint16"), IGNORE_INDEX).astype(self.dtype)
        else:
            m = read_mask(p, self.dtype)
        return _paired(m, p, None if self.images is None else str(self.images[i]))


class DepthFiles:
    """Loader of row ``i``'s depth in metres from 16-bit PNGs (picklable); ``images``: the rows'
    photos, whose size each depth map must have."""

    def __init__(self, paths: list[Path], scale: float, images: list[Path] | None = None) -> None:
        self.paths = np.array([str(p) for p in paths])
        self.images = None if images is None else np.array([str(p) for p in images])
        self.scale = float(scale)

    def __call__(self, i: int) -> np.ndarray:
        p = str(self.paths[i])
        return _paired(read_depth_png(p, self.scale), p, None if self.images is None else str(self.images[i]))


class NyuMat:
    """Loader of row ``i``'s photo (``field="images"``: RGB PIL) or depth (``"depths"``: float32
    metres) from NYU's labeled .mat (picklable; each process opens the file once). A v7.3 file is
    HDF5, whose datasets h5py sees transposed (``images`` [N, 3, W, H], ``depths`` [N, W, H]); a
    v5 file read by scipy keeps MATLAB's order (``images`` [H, W, 3, N], ``depths`` [H, W, N])."""

    def __init__(self, path: Path, rows: np.ndarray, field: str) -> None:
        self.path, self.rows, self.field = str(path), np.asarray(rows, np.int64), field
        self._data: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_data": None}

    def __call__(self, i: int) -> Any:
        if self._data is None:
            self._data = _open_mat(Path(self.path), self.field)
        data, hdf5 = self._data
        k = int(self.rows[i])
        if self.field == "images":
            a = np.transpose(data[k], (2, 1, 0)) if hdf5 else data[:, :, :, k]
            from PIL import Image

            return Image.fromarray(np.ascontiguousarray(a, np.uint8), "RGB")
        a = data[k].T if hdf5 else data[:, :, k]
        return np.ascontiguousarray(a, np.float32)


def _open_mat(path: Path, field: str) -> tuple[Any, bool]:
    """``(array-like of field, is_hdf5)`` of a .mat file (h5py for v7.3, scipy for v5)."""
    with open(path, "rb") as f:
        f.seek(512)
        hdf5 = f.read(8) == _HDF5_SIGNATURE
    if hdf5:
        try:
            import h5py  # pyright: ignore[reportMissingImports]  # optional: NYU's v7.3 .mat only
        except ImportError:
            raise DataError(f"{path} is a MATLAB v7.3 (HDF5) file: reading it needs h5py (pip install h5py)") from None
        return h5py.File(path, "r")[field], True
    from scipy.io import loadmat

    try:
        return loadmat(path, variable_names=[field])[field], False
    except (KeyError, ValueError, OSError) as exc:
        raise DataError(f"cannot read {field!r} from {path} ({exc}); give NYU's nyu_depth_v2_labeled.mat") from None


def dense_source(
    name: str,
    split: str,
    ids: list[str] | np.ndarray,
    class_names: list[str] | tuple[str, ...],
    loader: Callable[[int], Any],
    target: Callable[[int], np.ndarray],
    source: str,
    info: DenseInfo,
) -> SplitSource:
    """One dense split: labels all 0, ``extra`` holding the :class:`DenseInfo` and the target loader."""
    ids = np.array([escape_name(str(x)) for x in ids])
    return SplitSource(
        name,
        split,
        ids,
        np.zeros(len(ids), np.int64),
        list(class_names),
        loader,
        source,
        {"dense": info, "target": target},
    )


def _some(names: list[str], n: int = 3) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(escape_name(x) for x in names[:n]) + more


def _images_by_stem(folder: Path, suffix: str = "") -> dict[str, Path]:
    """``{stem: path}`` of the image files in ``folder`` (``suffix``: a name ending the stem
    must carry, cut from the key); a stem given twice (a.jpg, a.png) is refused."""
    out: dict[str, Path] = {}
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        if p.suffix.lower() not in IMAGE_EXTENSIONS or not p.stem.endswith(suffix) or p.name.startswith("."):
            continue
        stem = p.stem[: len(p.stem) - len(suffix)]
        if stem in out:
            raise DataError(f"{folder} holds two images named {stem!r} ({out[stem].name}, {p.name}); keep one")
        out[stem] = p
    return out


def _pngs_by_stem(folder: Path) -> dict[str, Path]:
    """``{stem: path}`` of the PNG files in ``folder`` (targets are lossless PNGs only)."""
    return {k: v for k, v in _images_by_stem(folder).items() if v.suffix.lower() == ".png"}


def _pair(images: dict[str, Path], masks: dict[str, Path], where: str) -> list[str]:
    """The sorted stems present in both; an image without its mask (or the reverse) is refused."""
    lone_i, lone_m = sorted(set(images) - set(masks)), sorted(set(masks) - set(images))
    if lone_i or lone_m:
        raise DataError(
            f"{where}: {len(lone_i)} image(s) without a mask ({_some(lone_i) or '-'}) and {len(lone_m)} mask(s) "
            f"without an image ({_some(lone_m) or '-'}); give every image a mask of the same stem"
        )
    return sorted(images)


# --------------------------------------------------------------------------- segmentation
ADE20K_SPLITS = {"training": "train", "validation": "val"}


@register_format("ade20k", usage="ade20k:PATH", note="ADEChallengeData2016 (150 classes, reduce-zero-label)")
def ade20k(arg: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """ADE20K's ``ADEChallengeData2016`` (``arg``: that folder or the one holding it)."""
    root = Path(arg)
    if (root / "ADEChallengeData2016").is_dir():
        root = root / "ADEChallengeData2016"
    info = DenseInfo("seg", len(ADE20K_CLASSES), IGNORE_INDEX, ADE20K_CLASSES, reduce_zero_label=True)
    out = {}
    for folder, split in ADE20K_SPLITS.items():
        images = _images_by_stem(root / "images" / folder)
        masks = _pngs_by_stem(root / "annotations" / folder)
        if not images and not masks:
            continue
        stems = _pair(images, masks, f"ade20k {root}/images/{folder}")
        out[split] = dense_source(
            name,
            split,
            stems,
            ADE20K_CLASSES,
            ImageFiles(photos := [images[s] for s in stems], options),
            MaskFiles([masks[s] for s in stems], info.mask_dtype, reduce_zero=True, images=photos),
            f"ade20k:{root.resolve()}",
            info,
        )
    if not out:
        raise DataError(
            f"{arg} holds no ADE20K split; expected ADEChallengeData2016/images/{{training,validation}}/*.jpg "
            "and annotations/{training,validation}/*.png"
        )
    return out


def _voc_root(arg: str) -> Path:
    for p in (Path(arg), Path(arg) / "VOC2012", Path(arg) / "VOCdevkit" / "VOC2012"):
        if (p / "ImageSets" / "Segmentation").is_dir():
            return p
    raise DataError(
        f"{arg} is not a VOC2012 folder; expected ImageSets/Segmentation/{{train,val}}.txt, JPEGImages/ and "
        "SegmentationClass/ (in PATH, PATH/VOC2012 or PATH/VOCdevkit/VOC2012)"
    )


@register_format("voc", usage="voc:PATH", note="Pascal VOC 2012 segmentation (21 classes)")
def voc(arg: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """Pascal VOC 2012's segmentation splits (``ImageSets/Segmentation/{train,val}.txt``)."""
    root = _voc_root(arg)
    info = DenseInfo("seg", len(VOC_CLASSES), IGNORE_INDEX, VOC_CLASSES)
    images = _images_by_stem(root / "JPEGImages")
    out = {}
    for split in ("train", "val"):
        listing = root / "ImageSets" / "Segmentation" / f"{split}.txt"
        if not listing.is_file():
            continue
        ids = [ln.split()[0] for ln in listing.read_text(encoding="utf-8").splitlines() if ln.strip()]
        masks = [root / "SegmentationClass" / f"{i}.png" for i in ids]
        lost = [i for i, m in zip(ids, masks, strict=True) if i not in images or not m.is_file()]
        if lost:
            raise DataError(
                f"voc {listing}: {len(lost)} listed id(s) lack JPEGImages/<id>.jpg or SegmentationClass/<id>.png "
                f"({_some(lost)}); restore the files or remove the ids from the list"
            )
        out[split] = dense_source(
            name,
            split,
            ids,
            VOC_CLASSES,
            ImageFiles(photos := [images[i] for i in ids], options),
            MaskFiles(masks, info.mask_dtype, images=photos),
            f"voc:{root.resolve()}",
            info,
        )
    if not out:
        raise DataError(f"{root}/ImageSets/Segmentation has neither train.txt nor val.txt; restore the VOC lists")
    return out


def _cityscapes_split(root: Path, split: str, name: str, options: ReadOptions, info: DenseInfo) -> SplitSource:
    """One Cityscapes split: every ``<city>/*_leftImg8bit.png`` with its labelTrainIds mask."""
    ids, images, masks, lost, raw = [], [], [], [], []
    for city in sorted(p for p in (root / "leftImg8bit" / split).iterdir() if p.is_dir()):
        for stem, img in _images_by_stem(city, "_leftImg8bit").items():
            gt = root / "gtFine" / split / city.name / f"{stem}_gtFine_labelTrainIds.png"
            if not gt.is_file():
                lost.append(f"{city.name}/{stem}")
                raw += [gt.with_name(f"{stem}_gtFine_labelIds.png").is_file()]
                continue
            ids.append(f"{city.name}/{stem}")
            images.append(img)
            masks.append(gt)
    if lost and any(raw):
        raise DataError(
            f"cityscapes {root}/gtFine/{split} has *_gtFine_labelIds.png but no *_gtFine_labelTrainIds.png; "
            "make them with cityscapesScripts: CITYSCAPES_DATASET=PATH csCreateTrainIdLabelImgs"
        )
    if lost:
        raise DataError(
            f"cityscapes {split}: {len(lost)} image(s) without gtFine/{split}/<city>/<frame>_gtFine_labelTrainIds.png "
            f"({_some(lost)}); restore the annotations"
        )
    return dense_source(
        name,
        split,
        ids,
        CITYSCAPES_CLASSES,
        ImageFiles(images, options),
        MaskFiles(masks, info.mask_dtype, images=images),
        f"cityscapes:{root.resolve()}",
        info,
    )


@register_format("cityscapes", usage="cityscapes:PATH", note="leftImg8bit + gtFine labelTrainIds (19 classes)")
def cityscapes(arg: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """Cityscapes' fine annotations: ``leftImg8bit/<split>`` with ``gtFine/<split>`` trainIds."""
    root = Path(arg)
    info = DenseInfo("seg", len(CITYSCAPES_CLASSES), IGNORE_INDEX, CITYSCAPES_CLASSES)
    splits = [s for s in ("train", "val", "test") if (root / "leftImg8bit" / s).is_dir()]
    without = [s for s in splits if not (root / "gtFine" / s).is_dir()]
    if without:
        log.warning("cityscapes %s: split(s) %s have no gtFine folder; left out", root, without)
    out = {s: _cityscapes_split(root, s, name, options, info) for s in splits if s not in without}
    if not out:
        raise DataError(
            f"{arg} holds no Cityscapes split; expected leftImg8bit/<split>/<city>/*_leftImg8bit.png and "
            "gtFine/<split>/<city>/*_gtFine_labelTrainIds.png"
        )
    return out


def _segfolder_classes(root: Path, masks: list[Path]) -> tuple[str, ...]:
    """``root/classes.txt`` (one name per line), else ``0..`` the largest id in ``masks`` (255,
    the ignore index, left out; every mask is read once to find it)."""
    listing = root / "classes.txt"
    if listing.is_file():
        names = tuple(ln.strip() for ln in listing.read_text(encoding="utf-8").splitlines() if ln.strip())
        if not names:
            raise DataError(f"{listing} is empty; list one class name per line (line k = id k) or remove it")
        return names
    top = -1
    for m in masks:
        a = read_mask(m, "uint16")
        ids = np.unique(a)
        ids = ids[ids != IGNORE_INDEX]
        top = max(top, int(ids.max()) if ids.size else -1)
    if top < 0:
        raise DataError(f"segfolder {root}: every mask pixel is 255 (ignore); give class ids or a classes.txt")
    log.info("segfolder %s: no classes.txt, classes 0..%d (the largest id in the masks)", root, top)
    return tuple(str(i) for i in range(top + 1))


@register_format("segfolder", usage="segfolder:PATH", note="PATH/<split>/images + PATH/<split>/masks (PNG ids)")
def segfolder(arg: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """A generic segmentation folder: ``PATH/<split>/images/*`` + ``PATH/<split>/masks/*.png``."""
    root = Path(arg)
    found = sorted(p.name for p in root.iterdir() if (p / "images").is_dir()) if root.is_dir() else []
    splits = [s for s in ("train", "val", "test") if s in found] + [
        s for s in found if s not in ("train", "val", "test")
    ]
    if not splits:
        raise DataError(f"{arg} holds no segfolder split; expected PATH/<split>/images/* and PATH/<split>/masks/*.png")
    pairs = {}
    for s in splits:
        images = _images_by_stem(root / s / "images")
        masks = _pngs_by_stem(root / s / "masks")
        stems = _pair(images, masks, f"segfolder {root / s}")
        if not stems:
            raise DataError(f"segfolder {root / s}/images holds no images; add images or remove the folder")
        pairs[s] = ([images[k] for k in stems], [masks[k] for k in stems], stems)
    names = _segfolder_classes(root, [m for _, ms, _ in pairs.values() for m in ms])
    info = DenseInfo("seg", len(names), IGNORE_INDEX, names)
    return {
        s: dense_source(
            name,
            s,
            stems,
            names,
            ImageFiles(im, options),
            MaskFiles(ms, info.mask_dtype, images=im),
            f"segfolder:{root.resolve()}",
            info,
        )
        for s, (im, ms, stems) in pairs.items()
    }


# --------------------------------------------------------------------------- depth
def _nyu_info() -> DenseInfo:
    return DenseInfo("depth", depth_range=NYU_DEPTH_RANGE, depth_scale=NYU_DEPTH_SCALE)


def _mat_rows(path: Path) -> int:
    """The number of images in NYU's labeled .mat (read from its header/shape only)."""
    with open(path, "rb") as f:
        f.seek(512)
        hdf5 = f.read(8) == _HDF5_SIGNATURE
    if hdf5:
        data, _ = _open_mat(path, "depths")
        return int(data.shape[0])
    from scipy.io import whosmat

    shapes = {n: s for n, s, _ in whosmat(path)}
    if "depths" not in shapes or "images" not in shapes:
        raise DataError(f"{path} lacks 'images' or 'depths'; give NYU's nyu_depth_v2_labeled.mat")
    return int(shapes["depths"][2]) if len(shapes["depths"]) == 3 else 1


def _nyu_splits(mat: Path, n: int) -> dict[str, np.ndarray]:
    """The official train/test rows (0-based) from ``splits.mat`` beside the labeled .mat."""
    from scipy.io import loadmat

    sp = mat.parent / "splits.mat"
    if not sp.is_file():
        raise DataError(
            f"NYU's official split file {sp} is missing; put splits.mat (trainNdxs/testNdxs, from the NYU Depth v2 "
            "toolbox page) beside the .mat, or use the folder layout PATH/{train,test}/{rgb,depth}"
        )
    try:
        d = loadmat(sp, variable_names=["trainNdxs", "testNdxs"])
        rows = {s: np.asarray(d[k], np.int64).ravel() - 1 for s, k in (("train", "trainNdxs"), ("test", "testNdxs"))}
    except (KeyError, ValueError, OSError) as exc:
        raise DataError(f"cannot read trainNdxs/testNdxs from {sp} ({exc}); give NYU's official splits.mat") from None
    for s, r in rows.items():
        if r.size and (r.min() < 0 or r.max() >= n):
            raise DataError(
                f"{sp}: {s} index {int(r.max()) + 1} is outside the .mat's {n} images; use the matching files"
            )
    return rows


def _nyu_mat(path: Path, name: str) -> dict[str, SplitSource]:
    rows = _nyu_splits(path, _mat_rows(path))
    info, src = _nyu_info(), f"nyuv2:{path.resolve()}"
    return {
        s: dense_source(
            name,
            s,
            [f"{k + 1:04d}" for k in r],
            DEPTH_CLASS_NAMES,
            NyuMat(path, r, "images"),
            NyuMat(path, r, "depths"),
            src,
            info,
        )
        for s, r in rows.items()
    }


def _nyu_folder(root: Path, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    info, out = _nyu_info(), {}
    for s in ("train", "test"):
        if not (root / s / "rgb").is_dir():
            continue
        images = _images_by_stem(root / s / "rgb")
        depths = _pngs_by_stem(root / s / "depth")
        stems = _pair(images, depths, f"nyuv2 {root / s}")
        out[s] = dense_source(
            name,
            s,
            stems,
            DEPTH_CLASS_NAMES,
            ImageFiles(photos := [images[k] for k in stems], options),
            DepthFiles([depths[k] for k in stems], NYU_DEPTH_SCALE, images=photos),
            f"nyuv2:{root.resolve()}",
            info,
        )
    if not out:
        raise DataError(
            f"{root} holds no NYU split; expected PATH/{{train,test}}/rgb/* + PATH/{{train,test}}/depth/*.png "
            "(16-bit millimetres), or pass the labeled .mat file"
        )
    return out


#: DINOv3's NYU list files (dinov3/data/datasets/nyu.py): lines ``image depth focal``
NYU_LIST_FILES = {"train": "nyu_train.txt", "test": "nyu_test.txt"}


def _nyu_lists(root: Path, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """DINOv3's NYU layout: ``nyu_{train,test}.txt`` lines ``image depth focal`` (paths relative
    to ``root``, a leading ``/`` dropped), rows in sorted line order as the reference sorts them."""
    info, out = _nyu_info(), {}
    for s, fname in NYU_LIST_FILES.items():
        if not (root / fname).is_file():
            continue
        lines = sorted(ln for ln in (root / fname).read_text(encoding="utf-8").splitlines(keepends=True) if ln.strip())
        pairs = [(ln.split()[0].strip("/"), ln.split()[1].strip("/")) for ln in lines if len(ln.split()) >= 2]
        if len(pairs) != len(lines):
            raise DataError(
                f"{root / fname}: every line is 'image depth focal' (paths relative to {root}); fix the list"
            )
        lost = [a for a, b in pairs if not ((root / a).is_file() and (root / b).is_file())]
        if lost:
            raise DataError(f"{root / fname}: {len(lost)} listed image(s) or depth map(s) missing ({_some(lost)})")
        photos = [root / a for a, _ in pairs]
        out[s] = dense_source(
            name,
            s,
            [a for a, _ in pairs],
            DEPTH_CLASS_NAMES,
            ImageFiles(photos, options),
            DepthFiles([root / b for _, b in pairs], NYU_DEPTH_SCALE, images=photos),
            f"nyuv2:{root.resolve()}",
            info,
        )
    return out


@register_format(
    "nyuv2", usage="nyuv2:PATH", note="NYU Depth v2: labeled .mat + splits.mat, or {train,test}/{rgb,depth}"
)
def nyuv2(arg: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """NYU Depth v2: the labeled .mat file (with ``splits.mat`` beside it), DINOv3's list files,
    or the RGB + 16-bit PNG folder layout; depth in metres."""
    p = Path(arg)
    if p.is_file():
        return _nyu_mat(p, name)
    if p.is_dir():
        return _nyu_lists(p, name, options) or _nyu_folder(p, name, options)
    raise DataError(
        f"{arg} does not exist; give nyu_depth_v2_labeled.mat or a folder PATH/{{train,test}}/{{rgb,depth}}"
    )
