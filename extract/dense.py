"""Dense extraction (issue 57): a dense split (a :class:`~featcache.data.source.SplitSource`
whose ``extra`` holds ``"dense"``, a :class:`~featcache.core.dense.DenseInfo`, and ``"target"``,
``fn(i) -> [H, W]`` at the image's own size) is expanded into its store groups
(:mod:`featcache.core.dense`), each extracted like any split, its targets carried with the rows
through the DataLoader into the same ``write_chunk`` call as the model's kinds:

- ``{split}``: ``resize`` rows (:class:`~featcache.data.dense_geometry.ResizeRows`) with the
  target at the input size; an evaluation split (any but ``train``) also stores ``full_*``, the
  original-resolution target padded (ignore index / 0) to the split's largest image, and
  ``image_size``;
- ``{split}@win`` (``--windows``, evaluation splits): DINOv3's slide windows
  (:class:`~featcache.data.dense_geometry.WindowRows`), ids ``{id}#w{j}``, with ``window``;
- ``train@view{v}`` (``--views K``): DINOv3's seeded train views, targets moved identically;
- ``{split}@flip`` (``--flip``, evaluation splits): the ``resize`` rows flipped.

Every kind's provenance records ``extra["geometry"]`` (:class:`~featcache.core.dense.Geometry`,
the token grid at the input size) and ``extra["dense"]`` (``DenseInfo.record()``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from featcache.core.dense import (
    DEPTH_KIND,
    DEPTH_VALID_KIND,
    FULL_PREFIX,
    MASK_KIND,
    SIZE_KIND,
    WINDOW_KIND,
    DenseInfo,
    Geometry,
    dense_split,
)
from featcache.data.dense_geometry import DepthViewRows, ResizeRows, SegViewRows, WindowRows
from featcache.data.source import SplitSource
from featcache.errors import ConfigError, DataError

log = logging.getLogger(__name__)

__all__ = [
    "DenseGroup",
    "DenseImageRows",
    "check_dense_flags",
    "dense_collate",
    "image_sizes",
    "is_dense",
    "target_kinds",
    "token_grid_of",
    "with_dense",
]

#: the split dense views are made of; every other split is an evaluation split
TRAIN_SPLIT = "train"


def is_dense(src: SplitSource) -> bool:
    """Whether ``src`` is a dense split (a reader's ``extra["dense"]`` and ``extra["target"]``)."""
    return "dense" in src.extra and "target" in src.extra


@dataclass
class DenseGroup:
    """What one dense group's rows are: the transform, the geometry name, and for ``win`` the
    window table (``WINDOW_FIELDS`` per row); ``full``: the ``(Hmax, Wmax)`` of the
    original-resolution targets stored beside ``resize`` rows of an evaluation split."""

    info: DenseInfo
    transform: Any
    geometry: str
    windows: np.ndarray | None = None
    sizes: np.ndarray | None = None  # [n_images, 2] original (h, w), evaluation splits
    full: tuple[int, int] | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def image_row(self, r: int) -> int:
        return int(self.windows[r, 0]) if self.windows is not None else r


def target_kinds(group: DenseGroup, input_hw: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], str]]:
    """kind -> (per-row shape, dtype) of the targets the group stores."""
    info = group.info
    main = {MASK_KIND: info.mask_dtype} if info.task == "seg" else {DEPTH_KIND: "float32", DEPTH_VALID_KIND: "uint8"}
    out: dict[str, tuple[tuple[int, ...], str]] = {k: (tuple(input_hw), d) for k, d in main.items()}
    if group.full is not None:
        out.update({FULL_PREFIX + k: (tuple(group.full), d) for k, d in main.items()})
        out[SIZE_KIND] = ((4,), "int32")
    if group.windows is not None:
        out[WINDOW_KIND] = ((7,), "int32")
    return out


def image_sizes(src: SplitSource) -> np.ndarray:
    """``[n, 2]`` original (h, w) of every image, before any image is decoded: the reader's
    ``extra["image_size"](i)`` where it gives one, else the header of the image file where the
    loader holds file ``paths`` (PIL opens lazily), else the target's shape (the mask decoded)."""
    fn = src.extra.get("image_size")
    paths = getattr(src.loader, "paths", None)
    out = np.zeros((len(src), 2), np.int64)
    for i in range(len(src)):
        if fn is not None:
            out[i] = fn(i)
        elif paths is not None and len(paths) == len(src):
            out[i] = _header_size(str(paths[i]))
        else:
            out[i] = np.shape(src.extra["target"](i))[:2]
    return out


def _header_size(path: str) -> tuple[int, int]:
    """``(h, w)`` from an image file's header (nothing decoded)."""
    from PIL import Image

    with Image.open(path) as im:
        w, h = im.size
    return int(h), int(w)


def _group_source(src: SplitSource, geometry: str, group: DenseGroup, ids: Any = None) -> SplitSource:
    n = len(src) if ids is None else len(ids)
    return dataclasses.replace(
        src,
        split=dense_split(src.split, geometry),
        ids=src.ids if ids is None else np.asarray(ids),
        labels=np.zeros(n, np.int64),
        extra={**src.extra, "dense_group": group, "dense_limited": True},
    )


def _windows(src: SplitSource, tf: WindowRows, sizes: np.ndarray) -> tuple[list[str], np.ndarray]:
    ids, rows = [], []
    for i, (h, w) in enumerate(sizes):
        rh, rw = tf.resized(int(h), int(w))
        for j, (y1, x1, _, _) in enumerate(tf.boxes(int(h), int(w))):
            ids.append(f"{src.ids[i]}#w{j}")
            rows.append((i, y1, x1, rh, rw, int(h), int(w)))
    return ids, np.asarray(rows, np.int32).reshape(-1, 7)


def expand_dense(src: SplitSource, cfg: Any, data_config: dict[str, Any]) -> list[SplitSource]:
    """The store groups of one (already row-limited) dense split (module docstring)."""
    info: DenseInfo = src.extra["dense"]
    train = src.split == TRAIN_SPLIT
    pad = info.ignore_index if info.task == "seg" and info.ignore_index is not None else 0
    sizes = None if train else image_sizes(src)
    full = None if sizes is None or not len(sizes) else (int(sizes[:, 0].max()), int(sizes[:, 1].max()))
    out = [_group_source(src, "resize", DenseGroup(info, ResizeRows(data_config), "resize", sizes=sizes, full=full))]
    if cfg.windows and not train:
        assert sizes is not None
        win = WindowRows(data_config, cfg.window_short_side, pad_value=pad)
        ids, table = _windows(src, win, sizes)
        out.append(_group_source(src, "win", DenseGroup(info, win, "win", windows=table), ids))
    if cfg.views and train:
        for v in range(cfg.views):
            tf = (
                SegViewRows(data_config, cfg.view_seed, v, pad)
                if info.task == "seg"
                else DepthViewRows(data_config, cfg.view_seed, v)
            )
            out.append(_group_source(src, f"view{v}", DenseGroup(info, tf, f"view{v}")))
    if cfg.flip and not train:
        out.append(_group_source(src, "flip", DenseGroup(info, ResizeRows(data_config, flip=True), "flip")))
    return out


def check_dense_flags(sources: list[SplitSource], cfg: Any) -> None:
    """One-line refusal (before the model is built) of ``--windows``/``--flip`` on splits
    without per-pixel targets."""
    if (cfg.windows or cfg.flip) and not any(is_dense(s) for s in sources):
        raise ConfigError(
            "--windows and --flip cut dense rows: this dataset has no per-pixel targets (use a dense reader: "
            "ade20k:, voc:, cityscapes:, nyuv2:, segfolder:)"
        )


def with_dense(sources: list[SplitSource], cfg: Any, bb: Any, limited: Any) -> list[SplitSource]:
    """``sources`` with every dense split expanded into its groups (``limited``: the row limit,
    applied to the images before windows are counted); other splits are kept as they are."""
    check_dense_flags(sources, cfg)
    if not any(is_dense(s) for s in sources):
        return sources
    if not all(k in bb.data_config for k in ("input_size", "mean", "std")):
        raise ConfigError(
            f"dense extraction of {bb.source}:{bb.name}: featcache builds the dense transforms from a timm data "
            "config (mean, std, input size), which this source does not give; use a timm or python: model"
        )
    out: list[SplitSource] = []
    for s in sources:
        out += expand_dense(limited(s), cfg, dict(bb.data_config)) if is_dense(s) else [s]
    log.info("dense groups: %s", ", ".join(f"{s.split} ({len(s)} rows)" for s in out))
    return out


def token_grid_of(bb: Any, hw: tuple[int, int]) -> tuple[int, int]:
    """The model's token grid ``(gh, gw)`` at input size ``hw``: a ViT's patch grid
    (``patch_embed.dynamic_feat_size``), else the final feature map's size (one blank forward)."""
    import torch

    pe = getattr(bb.model, "patch_embed", None)
    if pe is not None and hasattr(pe, "dynamic_feat_size"):
        gh, gw = pe.dynamic_feat_size(tuple(hw))
        return int(gh), int(gw)
    fwd = getattr(bb.model, "forward_features", None)
    if fwd is None:
        return 0, 0
    with torch.inference_mode():
        f = fwd(torch.zeros((1, 3, *hw), device=bb.device))
    if f.ndim != 4:
        return 0, 0
    nhwc = getattr(bb.model, "output_fmt", "NCHW") == "NHWC"
    return (int(f.shape[1]), int(f.shape[2])) if nhwc else (int(f.shape[2]), int(f.shape[3]))


def geometry_record(group: DenseGroup, bb: Any, grid: tuple[int, int]) -> dict[str, Any]:
    """``Geometry(...).record()`` of a group's rows (every target here is at the input size)."""
    hw = tuple(int(s) for s in bb.data_config["input_size"][-2:])
    params = {**group.transform.spec(), **group.params}
    return Geometry(group.geometry, hw, grid, hw, params).record()  # pyright: ignore[reportArgumentType]


class DenseImageRows:
    """Map-style dataset of one dense group: row -> (row, float32 ``[3, H, W]``, ok, error text,
    {target kind: array}); never raises per image (a failure is an invalid row, targets filled)."""

    def __init__(self, source: SplitSource, group: DenseGroup, shape: tuple[int, int, int]):
        self.source, self.group, self.shape = source, group, shape
        self.kinds = target_kinds(group, shape[1:])  # pyright: ignore[reportArgumentType]

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, r: int):
        import torch

        g = self.group
        i = g.image_row(r)
        try:
            img, tgt = self.source.load(i), np.asarray(self.source.extra["target"](i))
            if g.windows is not None:
                x, t = g.transform(img, tgt, i, int(g.windows[r, 1]), int(g.windows[r, 2]))
            else:
                x, t = g.transform(img, tgt, r)
            if x.shape != self.shape:
                raise DataError(f"the dense transform gave {x.shape}, expected {self.shape}")
            return r, torch.from_numpy(np.ascontiguousarray(x)), True, "", self._targets(r, t, tgt)
        except Exception as exc:  # any decode/transform failure becomes an invalid row
            blank = {k: np.zeros(s, d) for k, (s, d) in self.kinds.items()}
            return r, torch.zeros(self.shape), False, f"{type(exc).__name__}: {exc}"[:500], blank

    def _targets(self, r: int, t: np.ndarray, orig: np.ndarray) -> dict[str, np.ndarray]:
        g, info = self.group, self.group.info
        out = {}
        if info.task == "seg":
            out[MASK_KIND] = t.astype(info.mask_dtype)
        else:
            out[DEPTH_KIND] = t.astype(np.float32)
            out[DEPTH_VALID_KIND] = (t > 0).astype(np.uint8)
        if g.full is not None:
            pad = info.ignore_index if info.task == "seg" and info.ignore_index is not None else 0
            for k, v in list(out.items()):
                src = orig if k != DEPTH_VALID_KIND else (orig > 0)
                full = np.full(g.full, pad if k == MASK_KIND else 0, dtype=v.dtype)
                full[: src.shape[0], : src.shape[1]] = src
                out[FULL_PREFIX + k] = full
            h, w = orig.shape[:2]
            out[SIZE_KIND] = np.asarray([h, w, *self.shape[1:]], np.int32)
        if g.windows is not None:
            out[WINDOW_KIND] = g.windows[r].astype(np.int32)
        return out


def dense_collate(batch: list[Any]) -> tuple[Any, Any, Any, list[str], dict[str, np.ndarray]]:
    """Stack a dense batch: (rows, images, ok, errors, {target kind: stacked array})."""
    import torch

    rows = torch.tensor([b[0] for b in batch], dtype=torch.long)
    x = torch.stack([b[1] for b in batch])
    ok = torch.tensor([b[2] for b in batch], dtype=torch.bool)
    tgts = {k: np.stack([b[4][k] for b in batch]) for k in batch[0][4]}
    return rows, x, ok, [b[3] for b in batch], tgts
