"""Percentile-bootstrap intervals over images for the dense metrics (issue 57's evidence):
a split-level number (mIoU from areas summed over the split, Hummingbird's Hungarian mIoU,
a depth metric averaged over images) recomputed on images drawn with replacement.

The per-image parts come from the accumulators of :mod:`featcache.core.dense_metrics` built with
``keep_images=True`` (segmentation: ``[N, 3, C]`` areas; Hummingbird: ``[N, C, P]`` confusion
matrices) or from :class:`~featcache.core.dense_metrics.DepthAccumulator`'s per-image values.
A paired interval draws the same images for two backbones scored on the same images, so the
difference's interval reflects the images both saw.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from featcache.errors import MetricInputError

__all__ = [
    "Interval",
    "bootstrap_interval",
    "hbird_miou_from_confusions",
    "headline_interval",
    "miou_from_areas",
    "paired_bootstrap",
]


@dataclass(frozen=True)
class Interval:
    """A statistic on all images and its percentile-bootstrap interval."""

    value: float
    lo: float
    hi: float
    n_images: int
    n_boot: int
    level: float


def miou_from_areas(areas: ArrayLike) -> float:
    """mIoU (dinov3's: areas summed over images, ``nanmean`` over classes) of per-image
    ``[N, 3, C]`` (intersect, prediction, label) areas."""
    a = np.asarray(areas, dtype=np.int64).sum(axis=0)
    union = a[1] + a[2] - a[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        iou = a[0] / union
    return float(np.nanmean(iou)) if np.isfinite(iou).any() else float("nan")


def hbird_miou_from_confusions(confusions: ArrayLike) -> float:
    """Hummingbird's mIoU (Hungarian matching on the summed confusion) of per-image ``[N, C, P]``
    confusion matrices."""
    from featcache.core.dense_metrics import HummingbirdAccumulator

    c = np.asarray(confusions, dtype=np.int64).sum(axis=0)
    acc = HummingbirdAccumulator(c.shape[0], c.shape[1], ignore_index=None)
    acc.confusion = c
    return acc.compute()


def _draws(n: int, n_boot: int, seed: int) -> np.ndarray:
    if n < 1:
        raise MetricInputError("a bootstrap over images needs at least one image")
    if n_boot < 1:
        raise MetricInputError(f"n_boot must be >= 1, got {n_boot}")
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def _percentiles(values: np.ndarray, level: float) -> tuple[float, float]:
    if not 0 < level < 1:
        raise MetricInputError(f"level must lie in (0, 1), got {level}")
    v = values[np.isfinite(values)]
    if not v.size:
        return float("nan"), float("nan")
    lo, hi = np.percentile(v, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def bootstrap_interval(
    parts: ArrayLike,
    statistic: Callable[[np.ndarray], float],
    *,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """``statistic(parts)`` and its percentile interval over ``n_boot`` resamples of the images
    (the first axis of ``parts``), drawn by numpy's ``default_rng(seed)``."""
    p = np.asarray(parts)
    draws = _draws(len(p), n_boot, seed)
    vals = np.array([statistic(p[d]) for d in draws], dtype=np.float64)
    return Interval(statistic(p), *_percentiles(vals, level), len(p), n_boot, level)


def paired_bootstrap(
    parts_a: ArrayLike,
    parts_b: ArrayLike,
    statistic: Callable[[np.ndarray], float],
    *,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """The difference ``statistic(a) - statistic(b)`` of two backbones scored on the same images
    (row ``i`` of both is image ``i``) and its interval, the same images drawn for both."""
    a, b = np.asarray(parts_a), np.asarray(parts_b)
    if len(a) != len(b):
        raise MetricInputError(f"paired bootstrap needs the same images: {len(a)} vs {len(b)} rows")
    draws = _draws(len(a), n_boot, seed)
    vals = np.array([statistic(a[d]) - statistic(b[d]) for d in draws], dtype=np.float64)
    return Interval(statistic(a) - statistic(b), *_percentiles(vals, level), len(a), n_boot, level)


def _nanmean(values: np.ndarray) -> float:
    v = np.asarray(values, dtype=np.float64)
    return float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")


#: the headline metric of a dense run (the first its scores hold) -> how its per-image parts
#: (:attr:`featcache.dense.solvers.DenseFit.per_image`) make the split's number
HEADLINE_STATISTICS: dict[str, Callable[[np.ndarray], float]] = {
    "miou": miou_from_areas,
    "hbird_miou": hbird_miou_from_confusions,
    "rmse": _nanmean,
}


def headline_interval(
    metrics: Mapping[str, float], parts: ArrayLike | None, *, n_boot: int = 1000, seed: int = 0
) -> tuple[str, Interval] | None:
    """``(metric, interval)`` of a dense run's headline metric (``miou``, ``hbird_miou`` or
    ``rmse``, the first in ``metrics``) over its per-image ``parts``; None without parts or
    headline. The interval's value equals the run's own number (the parts are its images)."""
    name = next((m for m in HEADLINE_STATISTICS if m in metrics), None)
    if name is None or parts is None or not len(np.asarray(parts)):
        return None
    return name, bootstrap_interval(parts, HEADLINE_STATISTICS[name], n_boot=n_boot, seed=seed)
