"""One answer to "which backbone?": is the first place separated from the rest?

:func:`first_place` bootstraps the mean z-score lead of the first backbone over every other one,
paired (the same resample for both), and each resample draws every setting's **test-set noise**:
a proportion metric (top-1 ...) with a known ``n_eval`` is redrawn as ``Binomial(n_eval,
value) / n_eval`` per backbone. The draws are independent per backbone, which ignores that both
backbones are scored on the same test images; those errors are positively correlated in
practice, so the interval is wider than a paired (McNemar-style) one: conservative. Where the
ranked settings come from more than one dataset, each resample also draws the settings with
replacement (the same draw for every backbone); with one dataset the settings are kept, and the
interval covers test-set noise only. The first place is **separated** only where the interval
of (first - runner-up) excludes 0. The report's headline and its "How sure is the first place"
plot both read this one table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from featcache.errors import ResultsError

__all__ = ["FirstPlace", "first_place"]


@dataclass(frozen=True)
class FirstPlace:
    """:func:`first_place`'s verdict: ``table`` has the columns of the pairwise differences
    (``aggregation`` = ``zscore``, ``a`` = the first backbone, ``b`` = the other, ``diff``,
    ``lo``, ``hi``, ``p_le_0``) plus ``separated``, one row per other backbone in ranking order;
    ``covers`` says which noise the intervals include; ``n_datasets`` and ``noisy_settings``
    (settings with test-set noise) count what entered."""

    best: str
    runner_up: str | None
    separated: bool
    table: Any
    covers: str
    n_datasets: int
    noisy_settings: int
    n_settings: int
    level: float


def _zscore_means(values: np.ndarray, ddof: int) -> np.ndarray:
    """Mean over settings of the per-setting z-scores of a ``[..., B, T]`` array."""
    import warnings

    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        mu = np.nanmean(values, axis=-2, keepdims=True)
        sd = np.nanstd(values, axis=-2, ddof=ddof, keepdims=True)
        spread = np.nanmax(values, axis=-2, keepdims=True) - np.nanmin(values, axis=-2, keepdims=True)
        sd = np.where((sd > 0) & (spread > 0), sd, np.nan)
        return np.nanmean((values - mu) / sd, axis=-1)


def _noise_mask(values: np.ndarray, n_eval: np.ndarray | None) -> np.ndarray:
    """Cells whose value is a proportion with a known number of test rows."""
    if n_eval is None:
        return np.zeros(values.shape, bool)
    n = np.asarray(n_eval, float)
    if n.shape != values.shape:
        raise ResultsError(f"n_eval has shape {n.shape}, the score matrix {values.shape}")
    with np.errstate(invalid="ignore"):
        return np.isfinite(values) & np.isfinite(n) & (n > 0) & (values >= 0) & (values <= 1)


def _resamples(values, n_eval, noisy, resample_settings: bool, rng, n_boot: int) -> np.ndarray:
    """``[n_boot, B, T]``: the settings drawn with replacement (paired) when asked, then every
    noisy cell redrawn from its binomial."""
    T = values.shape[1]
    idx = rng.integers(0, T, size=(n_boot, T)) if resample_settings else np.broadcast_to(np.arange(T), (n_boot, T))
    vals = np.moveaxis(values[:, idx], 1, 0).copy()  # [n_boot, B, T]
    mask = np.moveaxis(noisy[:, idx], 1, 0)
    if mask.any():
        n = np.moveaxis(np.where(noisy, n_eval, 0).astype(np.int64)[:, idx], 1, 0)[mask]
        vals[mask] = rng.binomial(n, vals[mask]) / n
    return vals


def first_place(
    values: np.ndarray,
    backbones: Sequence[str],
    order: Sequence[str],
    *,
    n_eval: np.ndarray | None = None,
    datasets: Sequence[str] | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    ddof: int = 0,
) -> FirstPlace:
    """Paired bootstrap of the mean z-score lead of ``order[0]`` over every other backbone on a
    ``[B, T]`` score matrix (rows ``backbones``; higher is better), each resample with every
    proportion cell's test-set noise (``n_eval`` [B, T], NaN where unknown) and, when the
    settings' ``datasets`` name more than one dataset, the settings drawn with replacement.
    Same inputs and seed -> the same table."""
    import polars as pl

    values = np.asarray(values, float)
    if values.ndim != 2 or values.shape[0] != len(backbones):
        raise ResultsError(f"values must be [backbones, settings], got {values.shape} for {len(backbones)} backbones")
    n_ds = len(set(datasets)) if datasets is not None else values.shape[1]
    noisy = _noise_mask(values, n_eval)
    rng = np.random.default_rng(seed)
    boot = _zscore_means(_resamples(values, n_eval, noisy, n_ds > 1, rng, n_boot), ddof)  # [n_boot, B]
    point = _zscore_means(values, ddof)
    judged = n_ds > 1 or bool(noisy.any())  # else nothing was resampled: no interval to judge by
    at = {b: i for i, b in enumerate(backbones)}
    best, q = at[order[0]], (1 - level) / 2
    rows = []
    for other in order[1:]:
        d = boot[:, best] - boot[:, at[other]]
        lo, hi = float(np.nanquantile(d, q)), float(np.nanquantile(d, 1 - q))
        rows.append(
            {
                "aggregation": "zscore",
                "a": order[0],
                "b": other,
                "diff": float(point[best] - point[at[other]]),
                "lo": lo,
                "hi": hi,
                "p_le_0": float(np.nanmean(d <= 0)),
                "separated": bool(judged and lo > 0),
            }
        )
    schema = {
        "aggregation": pl.Utf8,
        "a": pl.Utf8,
        "b": pl.Utf8,
        **dict.fromkeys(("diff", "lo", "hi", "p_le_0"), pl.Float64),
    }
    schema["separated"] = pl.Boolean
    table = pl.DataFrame(rows, schema=schema).select("aggregation", "a", "b", "diff", "lo", "hi", "p_le_0", "separated")
    n_noisy = int(noisy.any(axis=0).sum())
    return FirstPlace(
        best=order[0],
        runner_up=order[1] if len(order) > 1 else None,
        separated=bool(rows and rows[0]["separated"]),
        table=table,
        covers=_covers(n_ds, n_noisy, values.shape[1]),
        n_datasets=n_ds,
        noisy_settings=n_noisy,
        n_settings=values.shape[1],
        level=level,
    )


def _covers(n_datasets: int, noisy: int, n_settings: int) -> str:
    """Which noise the intervals include, in words."""
    if noisy == 0 and n_datasets == 1:
        return (
            "nothing: one dataset and no setting reports a proportion with its number of test rows, "
            "so there is no noise to resample"
        )
    if noisy == 0:
        noise = "no test-set noise (no setting reports a proportion with its number of test rows)"
    elif noisy < n_settings:
        noise = f"the test-set noise of {noisy} of {n_settings} settings (the others report no proportion with n)"
    else:
        noise = "each setting's test-set noise"
    if n_datasets > 1:
        return f"{noise} and the choice of settings (drawn with replacement from {n_datasets} datasets)"
    return f"{noise}; with one dataset the settings are not resampled"
