"""Pure numpy statistics used by the analysis stage.

Clopper-Pearson intervals, Kendall tau-b (with exact and tie-corrected asymptotic p-values),
z-scores, average ranks, seeded bootstraps and the bootstrap line fit of Recht et al.
Nothing here reads files or knows about result tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from featcache.errors import ResultsError

__all__ = [
    "clopper_pearson",
    "kendall_tau_b",
    "zscores",
    "average_ranks",
    "rankdata",
    "bootstrap_ci",
    "bootstrap_rows",
    "linear_fit",
    "bootstrap_linear_fit",
]


def clopper_pearson(k, n, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Exact (Clopper-Pearson) two-sided ``1 - alpha`` interval for ``k`` successes of ``n``.

    Vectorised over ``k`` and ``n``; returns ``(low, high)`` as fractions. ``k`` may be a float
    count (e.g. ``accuracy * n``); it is rounded to the nearest integer.

    >>> lo, hi = clopper_pearson(7, 50)
    >>> round(float(lo), 4), round(float(hi), 4)
    (0.0582, 0.2674)
    """
    from scipy.special import betaincinv

    k = np.rint(np.asarray(k, dtype=float))
    n = np.asarray(n, dtype=float)
    if np.any(n <= 0) or np.any(k < 0) or np.any(k > n):
        raise ResultsError(f"Clopper-Pearson needs 0 <= k <= n and n > 0; got k={k}, n={n}")
    if not 0 < alpha < 1:
        raise ResultsError(f"alpha must be in (0, 1), got {alpha}")
    with np.errstate(invalid="ignore", divide="ignore"):
        lo = np.where(k == 0, 0.0, betaincinv(k, n - k + 1, alpha / 2))
        hi = np.where(k == n, 1.0, betaincinv(k + 1, n - k, 1 - alpha / 2))
    return lo, hi


def rankdata(x, *, descending: bool = True, axis: int = -1) -> np.ndarray:
    """Average ranks along ``axis`` (1 = best when ``descending``); ties share their mean rank,
    NaN entries get NaN and are ignored by the others. Vectorised over the other axes."""
    v = np.moveaxis(np.asarray(x, dtype=float), axis, -1)
    if not descending:
        v = -v
    a = v[..., :, None]
    b = v[..., None, :]
    better = np.sum(b > a, axis=-1)  # NaN comparisons are False: NaN never counts
    ties = np.sum(b == a, axis=-1)  # includes itself
    r = 1.0 + better + (ties - 1) / 2.0
    r = np.where(np.isnan(v), np.nan, r)
    return np.moveaxis(r, -1, axis)


def _mahonian_cdf(n: int, c: int) -> float:
    """P(#discordant pairs <= c) for a random permutation of n items (no ties)."""
    # counts of permutations with k inversions, built with a sliding-window sum (floats: n<=170)
    m = n * (n - 1) // 2
    counts = np.zeros(m + 1)
    counts[0] = 1.0
    top = 0
    for j in range(1, n):  # insert element j+1: adds 0..j inversions
        top += j
        cs = np.cumsum(counts[: top + 1])
        new = cs.copy()
        new[j + 1 :] -= cs[: top + 1 - (j + 1)]
        counts[: top + 1] = new
    total = math.exp(math.lgamma(n + 1))
    return float(counts[: c + 1].sum() / total)


def kendall_tau_b(x, y, *, method: str = "auto") -> tuple[float, float]:
    """Kendall's tau-b between two score vectors and its two-sided p-value.

    ``method``: ``"exact"`` (permutation distribution; only without ties), ``"asymptotic"``
    (normal approximation with the tie-corrected variance), or ``"auto"`` (exact when there are
    no ties and ``n <= 33``, else asymptotic; scipy's rule). Pairs with a NaN are dropped.
    Returns ``(nan, nan)`` when fewer than 2 pairs remain or one side is constant (tau-b
    undefined); callers record why.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ResultsError(f"kendall_tau_b needs two 1-d vectors of equal length, got {x.shape}, {y.shape}")
    if method not in ("auto", "exact", "asymptotic"):
        raise ResultsError(f"method must be 'auto', 'exact' or 'asymptotic', got {method!r}")
    ok = ~(np.isnan(x) | np.isnan(y))
    x, y = x[ok], y[ok]
    n = len(x)
    if n < 2:
        return float("nan"), float("nan")
    iu = np.triu_indices(n, 1)
    sx = np.sign(x[:, None] - x[None, :])[iu]
    sy = np.sign(y[:, None] - y[None, :])[iu]
    s = float(np.sum(sx * sy))  # concordant - discordant
    n0 = n * (n - 1) / 2
    _, tx = np.unique(x, return_counts=True)
    _, ty = np.unique(y, return_counts=True)
    n1 = float(np.sum(tx * (tx - 1) / 2))
    n2 = float(np.sum(ty * (ty - 1) / 2))
    denom = math.sqrt((n0 - n1) * (n0 - n2))
    if denom == 0:
        return float("nan"), float("nan")
    tau = min(1.0, max(-1.0, s / denom))
    ties = n1 > 0 or n2 > 0
    if method == "exact" and ties:
        raise ResultsError("the exact Kendall p-value needs untied data; use method='asymptotic'")
    if method == "exact" or (method == "auto" and not ties and n <= 33):
        dis = int(round((n0 - s) / 2))
        c = min(dis, int(n0) - dis)
        if n <= 1 or n0 == 0:
            p = 1.0
        elif 2 * c == n0:
            p = 1.0
        else:
            p = min(1.0, 2.0 * _mahonian_cdf(n, c))
        return tau, p
    # tie-corrected variance of S (Kendall 1970, as in scipy)
    xt = tx.astype(float)
    yt = ty.astype(float)
    v0 = n * (n - 1) * (2 * n + 5)
    vt = np.sum(xt * (xt - 1) * (2 * xt + 5))
    vu = np.sum(yt * (yt - 1) * (2 * yt + 5))
    v1 = np.sum(xt * (xt - 1)) * np.sum(yt * (yt - 1))
    v2 = np.sum(xt * (xt - 1) * (xt - 2)) * np.sum(yt * (yt - 1) * (yt - 2))
    var = (v0 - vt - vu) / 18 + v1 / (2 * n * (n - 1)) + v2 / (9 * n * (n - 1) * (n - 2)) if n > 2 else (v0 - vt - vu) / 18 + v1 / (2 * n * (n - 1))
    if var <= 0:
        return tau, float("nan")
    from scipy.special import erfc

    z = s / math.sqrt(var)
    return tau, float(erfc(abs(z) / math.sqrt(2)))


def zscores(values, *, ddof: int = 0, label: str = "setting") -> np.ndarray:
    """Battle-of-the-Backbones z-scores ``(x - mean) / std`` of one setting (NaN entries ignored).

    ``ddof`` chooses the standard deviation (0: population, as scipy.stats.zscore; 1: sample).
    A setting with fewer than two values or zero variance raises :class:`ResultsError`: a z-score
    is undefined there and silently using 0 would distort every aggregate.
    """
    v = np.asarray(values, dtype=float)
    ok = ~np.isnan(v)
    if ok.sum() < max(2, ddof + 1):
        raise ResultsError(
            f"cannot z-score {label}: only {int(ok.sum())} backbone(s) have a value; "
            "z-scores need at least two (drop the setting or add backbones)"
        )
    mu = v[ok].mean()
    sd = v[ok].std(ddof=ddof)
    # exact constancy via the range: the float std of equal values can be ~1e-17, not 0
    if not np.isfinite(sd) or sd == 0 or np.ptp(v[ok]) == 0:
        raise ResultsError(
            f"cannot z-score {label}: all {int(ok.sum())} backbones score {mu:g} (zero variance); "
            "drop this setting (e.g. rank(..., on_constant='drop')) or check the results"
        )
    return (v - mu) / sd


def average_ranks(matrix: np.ndarray) -> np.ndarray:
    """Per-setting ranks (1 = best, ties averaged) of a ``[..., backbone, setting]`` array."""
    return rankdata(matrix, descending=True, axis=-2)


def bootstrap_rows(n_items: int, n_boot: int, seed: int) -> np.ndarray:
    """Seeded resampling indices ``[n_boot, n_items]`` (with replacement); the same indices are
    applied to every backbone so differences between backbones are paired."""
    if n_items < 1:
        raise ResultsError("cannot bootstrap an empty set (no tasks/seeds to resample)")
    if n_boot < 1:
        raise ResultsError(f"n_boot must be >= 1, got {n_boot}")
    rng = np.random.default_rng(seed)
    return rng.integers(0, n_items, size=(n_boot, n_items))


def bootstrap_ci(
    stat: Callable[[np.ndarray], np.ndarray],
    n_items: int,
    *,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Percentile interval of ``stat(indices)`` over seeded resamples of ``n_items`` items.

    ``stat`` takes an index vector (length ``n_items``) and returns an array of statistics.
    Returns ``(low, high, samples[n_boot, ...])``; NaN samples are ignored per statistic.
    """
    idx = bootstrap_rows(n_items, n_boot, seed)
    samples = np.stack([np.asarray(stat(row), dtype=float) for row in idx])
    a = (1 - level) / 2
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            lo = np.nanquantile(samples, a, axis=0)
            hi = np.nanquantile(samples, 1 - a, axis=0)
    return lo, hi, samples


def linear_fit(x, y) -> tuple[float, float]:
    """Least-squares ``y = a * x + b``; returns ``(a, b)``."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0:
        raise ResultsError(
            f"a line fit needs at least two distinct x values, got {len(x)} point(s) "
            f"with x={x.tolist()}"
        )
    xm, ym = x.mean(), y.mean()
    a = float(np.sum((x - xm) * (y - ym)) / np.sum((x - xm) ** 2))
    return a, float(ym - a * xm)


def bootstrap_linear_fit(
    x,
    y,
    *,
    n_boot: int = 100_000,
    seed: int = 0,
    level: float = 0.95,
    chunk: int = 20_000,
) -> dict[str, float]:
    """Fit ``y = a x + b`` and percentile bootstrap intervals on ``a`` and ``b`` (Recht et al.).

    Points are resampled with replacement; all ``n_boot`` fits are computed in vectorised chunks
    from resampled sums (no Python loop per sample). Resamples whose x values are all equal
    have no slope and are skipped (their count is returned as ``n_degenerate``).
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    a, b = linear_fit(x, y)
    rng = np.random.default_rng(seed)
    n = len(x)
    a_s = np.empty(n_boot)
    b_s = np.empty(n_boot)
    done = 0
    while done < n_boot:
        m = min(chunk, n_boot - done)
        idx = rng.integers(0, n, size=(m, n))
        xs, ys = x[idx], y[idx]
        xm = xs.mean(axis=1, keepdims=True)
        ym = ys.mean(axis=1, keepdims=True)
        sxx = np.sum((xs - xm) ** 2, axis=1)
        sxy = np.sum((xs - xm) * (ys - ym), axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            sl = np.where(sxx > 1e-15 * max(1.0, float(np.max(np.abs(x))) ** 2), sxy / sxx, np.nan)
        a_s[done : done + m] = sl
        b_s[done : done + m] = ym[:, 0] - sl * xm[:, 0]
        done += m
    good = ~np.isnan(a_s)
    q = (1 - level) / 2
    if good.sum() == 0:
        raise ResultsError("every bootstrap resample was degenerate (all x equal); add backbones")
    return {
        "a": a,
        "b": b,
        "a_lo": float(np.quantile(a_s[good], q)),
        "a_hi": float(np.quantile(a_s[good], 1 - q)),
        "b_lo": float(np.quantile(b_s[good], q)),
        "b_hi": float(np.quantile(b_s[good], 1 - q)),
        "n_points": n,
        "n_boot": n_boot,
        "n_degenerate": int((~good).sum()),
        "seed": seed,
    }
