"""The dense-evaluation vocabulary (issue 57), shared by the readers, the extraction, the store
and the dense protocols: what a dense dataset is (:class:`DenseInfo`), how a stored row was cut
from its image (:class:`Geometry`), and the names of the stored target arrays and split groups.

A dense split is stored as one or more feature groups of the same backbone, each a split of the
store (every guarantee of a feature group holds: chunk checksums, resume, verify, locks):

- ``{split}``: the split's images under the ``resize`` geometry (one row per image, ids = the
  reader's ids), the model's kinds plus the row's target at the input size (:data:`MASK_KIND` or
  :data:`DEPTH_KIND` + :data:`DEPTH_VALID_KIND`); an evaluation split also holds the image's
  target at its original resolution (:data:`FULL_PREFIX` kinds, zero/ignore padded to the split's
  largest image) and each image's original and resized size (:data:`SIZE_KIND`);
- ``{split}@win``: an evaluation split's sliding windows (``window`` geometry; row ids
  ``{image id}#w{j}``), the model's kinds, the window's target crop and the window table
  (:data:`WINDOW_KIND`);
- ``{split}@view{v}``: a training split's seeded augmented view ``v`` with its target transformed
  identically (``view`` geometry, the reader's ids);
- ``{split}@flip``: the horizontally flipped ``resize`` rows (test-time flip averaging).

>>> dense_split("val", "win")
'val@win'
>>> parse_dense_split("val@win"), parse_dense_split("train@view3"), parse_dense_split("val")
(('val', 'win'), ('train', 'view3'), ('val', 'resize'))
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from featcache.errors import ConfigError

__all__ = [
    "DEPTH_KIND",
    "DEPTH_VALID_KIND",
    "FULL_PREFIX",
    "GEOMETRIES",
    "MASK_KIND",
    "SIZE_FIELDS",
    "SIZE_KIND",
    "TARGET_KINDS",
    "TASKS",
    "WINDOW_FIELDS",
    "WINDOW_KIND",
    "DenseInfo",
    "Geometry",
    "dense_split",
    "is_target_kind",
    "parse_dense_split",
]

#: the dense tasks a reader can declare
TASKS = ("seg", "depth")
#: a segmentation row's class ids at the row's geometry: uint8 (<= 256 ids with the ignore index)
#: or uint16, ``[H, W]``
MASK_KIND = "mask"
#: a depth row's metres at the row's geometry: float32 ``[H, W]``, 0 where the sensor gave none
DEPTH_KIND = "depth"
#: a depth row's valid pixels: uint8 0/1 ``[H, W]`` (the reader's validity, before any range)
DEPTH_VALID_KIND = "depth_valid"
#: an evaluation image's target at its original resolution: ``full_mask`` / ``full_depth`` /
#: ``full_depth_valid``, ``[Hmax, Wmax]`` padded (ignore index / 0) to the split's largest image
FULL_PREFIX = "full_"
#: per ``resize`` row of an evaluation split: int32 ``[4]`` = :data:`SIZE_FIELDS`
SIZE_KIND = "image_size"
SIZE_FIELDS = ("orig_h", "orig_w", "resized_h", "resized_w")
#: per ``win`` row: int32 ``[7]`` = :data:`WINDOW_FIELDS` (``image_row``: the row of the image in
#: the ``{split}`` group; ``y0, x0``: the window's corner in the resized image)
WINDOW_KIND = "window"
WINDOW_FIELDS = ("image_row", "y0", "x0", "resized_h", "resized_w", "orig_h", "orig_w")
#: every target-like kind name (stored with its own dtype; never a model feature)
TARGET_KINDS = (
    MASK_KIND,
    DEPTH_KIND,
    DEPTH_VALID_KIND,
    FULL_PREFIX + MASK_KIND,
    FULL_PREFIX + DEPTH_KIND,
    FULL_PREFIX + DEPTH_VALID_KIND,
    SIZE_KIND,
    WINDOW_KIND,
)
#: the row geometries: how a stored row was cut from its image
GEOMETRIES = ("resize", "win", "view", "flip")
_SPLIT_RE = re.compile(r"^(?P<base>[^@]+)@(?P<g>win|flip|view\d+)$")


def is_target_kind(kind: str) -> bool:
    """Whether ``kind`` is a stored target array (not a model feature)."""
    return kind in TARGET_KINDS


def dense_split(split: str, geometry: str) -> str:
    """The store split name of ``split``'s rows under ``geometry`` (``resize``: the split itself;
    ``win``, ``flip``, ``view{v}``: ``split@...``)."""
    return split if geometry == "resize" else f"{split}@{geometry}"


def parse_dense_split(name: str) -> tuple[str, str]:
    """``(split, geometry)`` of a store split name (``val@win`` -> ``("val", "win")``,
    ``train@view3`` -> ``("train", "view3")``, any other name -> ``(name, "resize")``)."""
    m = _SPLIT_RE.match(name)
    return (name, "resize") if m is None else (m["base"], m["g"])


@dataclass(frozen=True)
class DenseInfo:
    """What a dense reader declares beside its splits (``SplitSource.extra["dense"]``); the row's
    target comes from ``SplitSource.extra["target"]``: ``fn(i) -> np.ndarray [H, W]`` at the
    image's own resolution (uint8/uint16 class ids; float32 metres with 0 where invalid).

    ``num_classes``: the classes scored (ids ``0..num_classes-1``; any other id is ignored);
    ``ignore_index``: the id never scored (255 for ADE20K, VOC, Cityscapes); ``reduce_zero_label``:
    whether the reader applied ADE20K's reduction (0 -> ignore, k -> k-1) as the reference does;
    ``depth_range``: the metres a depth protocol evaluates (min, max), the dataset's own."""

    task: str
    num_classes: int = 0
    ignore_index: int | None = None
    class_names: tuple[str, ...] = ()
    reduce_zero_label: bool = False
    depth_range: tuple[float, float] | None = None
    depth_scale: float | None = None  # PNG depth: metres = value / depth_scale (NYU folder: 1000)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"dense task must be one of {TASKS}, got {self.task!r}")
        if self.task == "seg" and self.num_classes < 1:
            raise ConfigError("a segmentation dataset needs num_classes >= 1")

    @property
    def mask_dtype(self) -> str:
        """The stored mask dtype: uint8 when every id (and the ignore index) fits, else uint16."""
        top = max(self.num_classes - 1, self.ignore_index or 0)
        return "uint8" if top <= 255 else "uint16"

    def record(self) -> dict[str, Any]:
        """JSON values for a provenance record."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Geometry:
    """How a stored row was cut from its image (recorded in every kind's provenance as
    ``extra["geometry"]``): ``name`` (one of :data:`GEOMETRIES`), the model's ``input_size``
    ``(h, w)``, the token ``grid`` ``(gh, gw)`` (``tokens`` holds ``gh * gw`` rows, row-major over
    gh), the target's ``target_size`` ``(h, w)``, and the recipe's parameters (``params``: e.g.
    ``short_side``, ``window``, ``stride``; a view's transform, seed and index)."""

    name: str
    input_size: tuple[int, int]
    grid: tuple[int, int]
    target_size: tuple[int, int]
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        base = re.sub(r"\d+$", "", self.name)
        if base not in GEOMETRIES:
            raise ConfigError(f"geometry must be one of {GEOMETRIES}, got {self.name!r}")

    def record(self) -> dict[str, Any]:
        """JSON values for a provenance record."""
        return {
            "name": self.name,
            "input_size": list(self.input_size),
            "grid": list(self.grid),
            "target_size": list(self.target_size),
            "params": dict(self.params),
        }

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> Geometry:
        """The geometry a provenance recorded (:meth:`record`)."""
        return cls(
            str(rec["name"]),
            tuple(int(x) for x in rec["input_size"]),  # pyright: ignore[reportArgumentType]
            tuple(int(x) for x in rec["grid"]),  # pyright: ignore[reportArgumentType]
            tuple(int(x) for x in rec["target_size"]),  # pyright: ignore[reportArgumentType]
            dict(rec.get("params", {})),
        )


@dataclass
class DenseRows:
    """One stored dense split group as a protocol reads it (built by
    :func:`featcache.store.dense.read_dense`, or from arrays in a test).

    ``kinds``: feature kind -> array-like ``[N, T, D]`` / ``[N, D]`` sliced by row blocks
    (``a[i:j]`` -> numpy; a zarr array or a numpy array); ``target``: ``[N, H, W]`` at the
    geometry's ``target_size`` (mask ids, or depth metres); ``target_valid``: depth's ``[N, H, W]``
    0/1 (None for masks); ``tables``: the small per-row int tables read whole (``window``,
    ``image_size``); ``full``: an evaluation split's original-resolution targets (``full_mask``,
    ``full_depth``, ``full_depth_valid``: ``[N, Hmax, Wmax]`` array-likes), empty otherwise."""

    split: str
    geometry: Geometry
    info: DenseInfo
    ids: Any  # np.ndarray [N] of str
    valid: Any  # np.ndarray [N] bool
    kinds: dict[str, Any]
    target: Any
    target_valid: Any = None
    tables: dict[str, Any] = field(default_factory=dict)
    full: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)
