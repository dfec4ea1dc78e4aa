"""Dense (per-pixel) metrics as pure numpy functions: semantic segmentation, depth, Hummingbird.

Each one equals a port of the code that defines its number (tests/core/test_dense_metrics.py):

- :class:`SegmentationAccumulator` / :func:`seg_metrics`: ``miou``, ``macc``, ``aacc`` as
  facebookresearch/dinov3 ``dinov3/eval/segmentation/metrics.py`` accumulates them:
  intersection, union, prediction and label areas per class summed over the whole split, then
  ``nanmean`` over classes (a class absent from labels and predictions is left out of mIoU; a
  class absent from the labels is left out of mAcc).
- :class:`DepthAccumulator` / :func:`depth_metrics`: RMSE, AbsRel, SqRel, RMSE-log, log10,
  delta1/2/3 (and the reference's SILog and MAE) per image, averaged over images, as
  ``dinov3/eval/depth/eval.py`` + ``metrics.py`` compute them (range to ignored value, Eigen
  crop, prediction clamp, in that order).
- :class:`HummingbirdAccumulator` / :func:`hbird_miou`: vpariza/open-hummingbird-eval
  ``hbird/utils/eval_metrics.py``'s ``PredsmIoU``: Hungarian matching of predicted to true ids
  on the split's IoU matrix, IoU averaged over all classes (absent classes count 0).

Every function takes the truth first (``label``/``gt``), then the prediction. Counts are int64
(exact); the references accumulate float32 areas, which round once a class passes 2**24 pixels.
The names are not registered in :data:`featcache.core.metrics.METRICS`: that registry's
contract is ``fn(y_true [N], scores [N, K]) -> float`` and every single-label result row computes
all of its members, while these take label maps and are computed once per split from
accumulated counts; :data:`DENSE_LOWER_IS_BETTER` names the direction of each.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from featcache.errors import MetricInputError

__all__ = [
    "DENSE_LOWER_IS_BETTER",
    "DEPTH_METRICS",
    "EIGEN_CROP",
    "IGNORE_INDEX",
    "SEG_METRICS",
    "DepthAccumulator",
    "HummingbirdAccumulator",
    "SegmentationAccumulator",
    "depth_image_metrics",
    "depth_metrics",
    "eigen_crop_mask",
    "hbird_miou",
    "reduce_zero_label",
    "seg_metrics",
]

#: the ignore index of the references (ADE20K, VOC, Cityscapes, Hummingbird)
IGNORE_INDEX = 255
#: segmentation metric names (dinov3's ``mIoU``, ``acc``, ``aAcc``)
SEG_METRICS = ("miou", "macc", "aacc")
#: depth metric names (dinov3's ``rmse``, ``abs_rel``, ``sq_rel``, ``rmse_log``, ``log_10``,
#: ``a1``..``a3``, ``silog``, ``mae``)
DEPTH_METRICS = ("rmse", "abs_rel", "sq_rel", "rmse_log", "log10", "delta1", "delta2", "delta3", "silog", "mae")
#: the dense metric names whose lower values are better (every other one: higher is better)
DENSE_LOWER_IS_BETTER = frozenset(DEPTH_METRICS) - {"delta1", "delta2", "delta3"}
#: Eigen crop rows y1:y2, cols x1:x2 of the 480 x 640 NYUv2 frame (dinov3 datasets_utils.py:27)
EIGEN_CROP = (45, 471, 41, 601, 480, 640)


def _int_maps(label: ArrayLike, pred: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    lab, prd = np.asarray(label), np.asarray(pred)
    if lab.shape != prd.shape:
        raise MetricInputError(
            f"label map shape {lab.shape} != prediction shape {prd.shape}; resize the prediction first"
        )
    for what, a in (("label", lab), ("prediction", prd)):
        if not (np.issubdtype(a.dtype, np.integer) or a.dtype == bool):
            raise MetricInputError(f"{what} map must hold integer class ids, got {a.dtype} (argmax the logits first)")
    return lab.astype(np.int64).ravel(), prd.astype(np.int64).ravel()


def _check_classes(num_classes: int) -> int:
    if int(num_classes) < 1:
        raise MetricInputError(f"num_classes must be >= 1, got {num_classes}")
    return int(num_classes)


def _hist(values: np.ndarray, k: int) -> np.ndarray:
    """``torch.histc(v, bins=k, min=0, max=k-1)`` on integer ids: out-of-range ids are dropped."""
    return np.bincount(values[(values >= 0) & (values < k)], minlength=k).astype(np.int64)


def reduce_zero_label(label: ArrayLike, ignore_index: int = IGNORE_INDEX) -> np.ndarray:
    """ADE20K's relabelling (dinov3 ``preprocess_nonzero_labels``): 0 -> ``ignore_index``,
    every other id minus 1, ``ignore_index`` kept."""
    lab = np.asarray(label).astype(np.int64)
    out = np.where(lab == ignore_index, lab + 1, lab) - 1
    out[out == -1] = ignore_index
    return out


class SegmentationAccumulator:
    """Per-class areas summed over a split, one batch at a time (dinov3's ``pre_eval`` results).

    ``update(label, pred)`` takes integer maps of one shape (any number of images); pixels whose
    label (after ``reduce_zero_label``, applied to the label only, as the reference does) is
    ``ignore_index`` are left out; ids outside ``[0, num_classes)`` drop out of their own area
    (``torch.histc``'s range), as in the reference."""

    def __init__(
        self,
        num_classes: int,
        *,
        ignore_index: int = IGNORE_INDEX,
        reduce_zero_label: bool = False,
        keep_images: bool = False,
    ) -> None:
        self.num_classes = _check_classes(num_classes)
        self.ignore_index = int(ignore_index)
        self.reduce_zero_label = bool(reduce_zero_label)
        self.intersect = np.zeros(self.num_classes, np.int64)
        self.pred_area = np.zeros(self.num_classes, np.int64)
        self.label_area = np.zeros(self.num_classes, np.int64)
        #: with ``keep_images``: each image's ``[3, C]`` (intersect, pred, label areas), in update
        #: order (``update`` then takes one ``(h, w)`` map or a batch ``(b, h, w)``), for intervals
        #: over images (:mod:`featcache.core.dense_intervals`)
        self.images: list[np.ndarray] | None = [] if keep_images else None

    @property
    def union(self) -> np.ndarray:
        return self.pred_area + self.label_area - self.intersect

    def update(self, label: ArrayLike, pred: ArrayLike) -> None:
        if self.images is not None and np.ndim(label) == 3:
            for lab_i, prd_i in zip(np.asarray(label), np.asarray(pred), strict=True):
                self.update(lab_i, prd_i)
            return
        before = np.stack([self.intersect, self.pred_area, self.label_area]) if self.images is not None else None
        self._add(label, pred)
        if before is not None and self.images is not None:
            self.images.append(np.stack([self.intersect, self.pred_area, self.label_area]) - before)

    def _add(self, label: ArrayLike, pred: ArrayLike) -> None:
        lab, prd = _int_maps(label, pred)
        if self.reduce_zero_label:
            lab = reduce_zero_label(lab, self.ignore_index)
        keep = lab != self.ignore_index
        lab, prd = lab[keep], prd[keep]
        k = self.num_classes
        self.intersect += _hist(prd[prd == lab], k)
        self.pred_area += _hist(prd, k)
        self.label_area += _hist(lab, k)

    def per_class(self) -> dict[str, np.ndarray]:
        """Per-class IoU and accuracy (NaN where the denominator is 0)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return {"iou": self.intersect / self.union, "acc": self.intersect / self.label_area}

    def compute(self) -> dict[str, float]:
        """``miou``, ``macc`` (nanmean over classes) and ``aacc`` (all pixels), fractions in [0, 1];
        NaN when no pixel was counted."""
        pc = self.per_class()
        total = self.label_area.sum()
        out = {}
        for name, v in (("miou", pc["iou"]), ("macc", pc["acc"])):
            out[name] = float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
        out["aacc"] = float(self.intersect.sum() / total) if total else float("nan")
        return out


def seg_metrics(
    label: ArrayLike,
    pred: ArrayLike,
    num_classes: int,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduce_zero_label: bool = False,
) -> dict[str, float]:
    """``miou``, ``macc``, ``aacc`` of a whole split held in memory (see
    :class:`SegmentationAccumulator`; stream a larger split through it instead)."""
    acc = SegmentationAccumulator(num_classes, ignore_index=ignore_index, reduce_zero_label=reduce_zero_label)
    acc.update(label, pred)
    return acc.compute()


def eigen_crop_mask(shape: tuple[int, int]) -> np.ndarray:
    """The Eigen crop scaled to an ``(h, w)`` map as dinov3 ``make_valid_mask`` scales it
    (``int(y1 / 480 * h)`` etc.; rows 45:471, cols 41:601 at 480 x 640)."""
    h, w = shape
    y1, y2, x1, x2, oh, ow = EIGEN_CROP
    mask = np.zeros((h, w), bool)
    mask[int((y1 / oh) * h) : int((y2 / oh) * h), int((x1 / ow) * w) : int((x2 / ow) * w)] = True
    return mask


def _depth_values(gt: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    """dinov3 ``calculate_depth_metrics`` on the valid pixels of one image (NaN when none)."""
    if gt.size == 0:
        return dict.fromkeys(DEPTH_METRICS, float("nan"))
    thresh = np.maximum(gt / pred, pred / gt)
    err = gt - pred
    sq = err**2
    elog = np.log(gt) - np.log(pred)
    silog = np.sqrt(np.mean(elog**2) - np.mean(elog) ** 2) * 100
    return {
        "rmse": float(np.sqrt(sq.mean())),
        "abs_rel": float(np.mean(np.abs(err) / gt)),
        "sq_rel": float(np.mean(sq / gt)),
        "rmse_log": float(np.sqrt(np.mean(elog**2))),
        "log10": float(np.mean(np.abs(np.log10(gt) - np.log10(pred)))),
        "delta1": float(np.mean(thresh < 1.25)),
        "delta2": float(np.mean(thresh < 1.25**2)),
        "delta3": float(np.mean(thresh < 1.25**3)),
        "silog": 0.0 if np.isnan(silog) else float(silog),  # the reference's NaN -> 0
        "mae": float(np.mean(np.abs(err))),
    }


def depth_image_metrics(
    gt: ArrayLike,
    pred: ArrayLike,
    *,
    min_depth: float = 1e-3,
    max_depth: float = 10.0,
    eigen_crop: bool = True,
    ignored_value: float = 0.0,
) -> dict[str, float]:
    """The depth metrics of one ``(h, w)`` image, in dinov3 ``eval.py``'s order: ground truth
    outside ``(min_depth, max_depth)`` set to ``ignored_value``; valid = Eigen crop (if asked) and
    gt != ``ignored_value`` and gt > 0; the prediction (already at the gt's size, bilinear as the
    reference resizes it) clamped to ``[min_depth, max_depth]``. NaN everywhere when no pixel is valid."""
    g = np.asarray(gt, dtype=np.float64)
    p = np.asarray(pred, dtype=np.float64)
    if g.ndim != 2 or g.shape != p.shape:
        raise MetricInputError(
            f"depth maps must be (h, w) of one shape, got gt {g.shape} and prediction {p.shape}; "
            "resize the prediction to the ground truth's size first (bilinear, align_corners=False)"
        )
    g = np.where((g >= max_depth) | (g <= min_depth), ignored_value, g)
    valid = g != ignored_value
    if eigen_crop:
        valid &= eigen_crop_mask(g.shape)
    p = np.clip(p, min_depth, max_depth)
    valid &= g > 0
    return _depth_values(g[valid], p[valid])


class DepthAccumulator:
    """Per-image depth metrics collected one batch at a time; :meth:`compute` averages them over
    images (``nanmean``: images without a valid pixel are left out), as dinov3 does — never
    pooled over pixels. Keyword arguments: see :func:`depth_image_metrics`."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        depth_image_metrics(np.ones((1, 1)), np.ones((1, 1)), **options)  # a bad option fails here
        self.values: dict[str, list[float]] = {m: [] for m in DEPTH_METRICS}

    def update(self, gt: ArrayLike, pred: ArrayLike) -> None:
        """One ``(h, w)`` image, or a batch ``(b, h, w)`` (``(b, 1, h, w)`` too)."""
        g, p = np.asarray(gt), np.asarray(pred)
        if g.ndim == 4 and g.shape[1] == 1 and p.shape == g.shape:
            g, p = g[:, 0], p[:, 0]
        if g.ndim == 3 and p.shape[:1] != g.shape[:1]:
            raise MetricInputError(f"{g.shape[0]} ground-truth maps but prediction shape {p.shape}")
        for gi, pi in zip(*((g, p) if g.ndim == 3 else ([g], [p])), strict=True):
            for name, v in depth_image_metrics(gi, pi, **self.options).items():
                self.values[name].append(v)

    @property
    def n_images(self) -> int:
        return len(self.values["rmse"])

    def compute(self) -> dict[str, float]:
        out = {}
        for name, vals in self.values.items():
            v = np.asarray(vals, dtype=np.float64)
            out[name] = float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
        return out


def depth_metrics(gts: Iterable[ArrayLike], preds: Iterable[ArrayLike], **options: float | bool) -> dict[str, float]:
    """Depth metrics of a split (images of any sizes, or one ``(n, h, w)`` array each), averaged
    over images; see :class:`DepthAccumulator`."""
    acc = DepthAccumulator(**options)
    for g, p in zip(gts, preds, strict=True):
        acc.update(g, p)
    return acc.compute()


class HummingbirdAccumulator:
    """open-hummingbird-eval's ``PredsmIoU``: a (true x predicted) confusion matrix summed over
    the split; pixels labelled ``ignore_index`` and ids out of range (either side) dropped."""

    def __init__(
        self,
        num_classes: int,
        num_pred_classes: int | None = None,
        *,
        ignore_index: int | None = IGNORE_INDEX,
        keep_images: bool = False,
    ) -> None:
        self.num_classes = _check_classes(num_classes)
        self.num_pred_classes = _check_classes(num_classes if num_pred_classes is None else num_pred_classes)
        self.ignore_index = ignore_index
        self.confusion = np.zeros((self.num_classes, self.num_pred_classes), np.int64)
        #: with ``keep_images``: each image's confusion matrix, in update order (``update`` then
        #: takes one ``(h, w)`` map or a batch ``(b, h, w)``), for intervals over images
        self.images: list[np.ndarray] | None = [] if keep_images else None

    def update(self, label: ArrayLike, pred: ArrayLike) -> None:
        if self.images is not None and np.ndim(label) == 3:
            for lab_i, prd_i in zip(np.asarray(label), np.asarray(pred), strict=True):
                self.update(lab_i, prd_i)
            return
        before = self.confusion.copy() if self.images is not None else None
        self._add(label, pred)
        if before is not None and self.images is not None:
            self.images.append(self.confusion - before)

    def _add(self, label: ArrayLike, pred: ArrayLike) -> None:
        lab, prd = _int_maps(label, pred)
        if self.ignore_index is not None:
            keep = lab != self.ignore_index
            lab, prd = lab[keep], prd[keep]
        g, p = self.num_classes, self.num_pred_classes
        ok = (lab >= 0) & (lab < g) & (prd >= 0) & (prd < p)
        self.confusion += np.bincount(lab[ok] * p + prd[ok], minlength=g * p).reshape(g, p)

    def mapping(self) -> np.ndarray:
        """Predicted id -> true id by the Hungarian assignment on 1 - IoU (unmatched -> 0)."""
        from scipy.optimize import linear_sum_assignment

        c = self.confusion.astype(np.float64)
        iou = c / np.maximum(c.sum(1, keepdims=True) + c.sum(0, keepdims=True) - c, 1e-8)
        rows, cols = linear_sum_assignment(1.0 - iou)
        out = np.zeros(self.num_pred_classes, np.int64)
        out[cols] = rows
        return out

    def per_class_iou(self) -> np.ndarray:
        """IoU of each true class after matching (0 where a class has no pixel either side)."""
        onehot = np.zeros((self.num_pred_classes, self.num_classes), np.int64)
        onehot[np.arange(self.num_pred_classes), self.mapping()] = 1
        cm = self.confusion @ onehot
        tp = np.diag(cm).astype(np.float64)
        fp, fn = cm.sum(0) - tp, cm.sum(1) - tp
        return tp / np.maximum(tp + fp + fn, 1e-8)

    def compute(self) -> float:
        """The Hummingbird mIoU: the mean over all ``num_classes`` true classes."""
        return float(self.per_class_iou().mean())


def hbird_miou(
    label: ArrayLike,
    pred: ArrayLike,
    num_classes: int,
    *,
    num_pred_classes: int | None = None,
    ignore_index: int | None = IGNORE_INDEX,
) -> float:
    """Hummingbird's mIoU of a split held in memory (see :class:`HummingbirdAccumulator`)."""
    acc = HummingbirdAccumulator(num_classes, num_pred_classes, ignore_index=ignore_index)
    acc.update(label, pred)
    return acc.compute()
