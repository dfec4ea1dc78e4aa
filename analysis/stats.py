"""Statistics used by the analysis stage (numpy and scipy).

Clopper-Pearson intervals, McNemar's exact test of two classifiers on the same rows, Kendall
tau-b and ranks (scipy), BoB z-scores, average ranks and the bootstrap line fit of Recht et al.
Nothing here reads files or knows about result tables.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from featcache.errors import ResultsError

__all__ = [
    "average_ranks",
    "bootstrap_linear_fit",
    "clopper_pearson",
    "kendall_tau_b",
    "linear_fit",
    "mcnemar",
    "rankdata",
    "zscores",
]


def clopper_pearson(k: ArrayLike, n: ArrayLike, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
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


def mcnemar(correct_a: ArrayLike, correct_b: ArrayLike) -> tuple[int, int, float]:
    """McNemar's exact two-sided test of two classifiers scored on the same rows.

    ``correct_a`` / ``correct_b``: one boolean per row (the row's prediction was right). Returns
    ``(n_a_only, n_b_only, p)``: the discordant counts (rows only ``a`` got right, rows only ``b``
    got right) and the exact binomial p-value of ``n_a_only`` among the discordant rows under
    p = 1/2 (1.0 without discordant rows).

    >>> mcnemar([True, True, True, False], [False, False, True, False])
    (2, 0, 0.5)
    """
    from scipy.stats import binomtest

    a, b = np.asarray(correct_a), np.asarray(correct_b)
    if a.shape != b.shape or a.ndim != 1:
        raise ResultsError(
            f"McNemar compares two classifiers on the same rows: got shapes {a.shape} and {b.shape}; "
            "pass one boolean per evaluated row for each, in the same row order"
        )
    if a.dtype != bool or b.dtype != bool:
        raise ResultsError("McNemar takes booleans (prediction == label per row); compare the predictions first")
    n_a, n_b = int((a & ~b).sum()), int((~a & b).sum())
    p = float(binomtest(n_a, n_a + n_b, 0.5).pvalue) if n_a + n_b else 1.0
    return n_a, n_b, min(p, 1.0)


def rankdata(x: ArrayLike, *, descending: bool = True, axis: int = -1) -> np.ndarray:
    """Average ranks along ``axis`` (1 = best when ``descending``); ties share their mean rank,
    NaN entries get NaN and are ignored by the others (:func:`scipy.stats.rankdata`)."""
    from scipy.stats import rankdata as _rankdata

    v = np.asarray(x, dtype=float)
    return _rankdata(-v if descending else v, method="average", axis=axis, nan_policy="omit")


def kendall_tau_b(x: ArrayLike, y: ArrayLike, *, method: str = "auto") -> tuple[float, float]:
    """Kendall's tau-b between two score vectors and its two-sided p-value
    (:func:`scipy.stats.kendalltau`, ``variant="b"``).

    ``method``: ``"exact"`` (permutation distribution; only without ties), ``"asymptotic"``
    (normal approximation with the tie-corrected variance), or ``"auto"`` (scipy's rule: exact
    when there are no ties and ``n <= 33``). Pairs with a NaN are dropped. Returns
    ``(nan, nan)`` when fewer than 2 pairs remain or one side is constant (tau-b undefined);
    callers record why.
    """
    from scipy.stats import kendalltau

    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ResultsError(f"kendall_tau_b needs two 1-d vectors of equal length, got {x.shape}, {y.shape}")
    if method not in ("auto", "exact", "asymptotic"):
        raise ResultsError(f"method must be 'auto', 'exact' or 'asymptotic', got {method!r}")
    ok = ~(np.isnan(x) | np.isnan(y))
    x, y = x[ok], y[ok]
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan"), float("nan")
    if method == "exact" and (len(np.unique(x)) < len(x) or len(np.unique(y)) < len(y)):
        raise ResultsError("the exact Kendall p-value needs untied data; use method='asymptotic'")
    if len(x) == 2 and method == "asymptotic":
        # scipy's tie-corrected variance divides by n - 2; two untied pairs have Var(S) = 1
        from scipy.stats import norm

        return float(np.sign(x[1] - x[0]) * np.sign(y[1] - y[0])), float(2 * norm.sf(1.0))
    res = kendalltau(x, y, variant="b", method=method)
    return float(res.statistic), float(res.pvalue)  # pyright: ignore[reportAttributeAccessIssue]  # scipy's result class declares neither


def zscores(values: ArrayLike, *, ddof: int = 0, label: str = "setting") -> np.ndarray:
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


def linear_fit(x: ArrayLike, y: ArrayLike) -> tuple[float, float]:
    """Least-squares ``y = a * x + b``; returns ``(a, b)``."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0:
        raise ResultsError(
            f"a line fit needs at least two distinct x values, got {len(x)} point(s) with x={x.tolist()}"
        )
    xm, ym = x.mean(), y.mean()
    a = float(np.sum((x - xm) * (y - ym)) / np.sum((x - xm) ** 2))
    return a, float(ym - a * xm)


def bootstrap_linear_fit(
    x: ArrayLike,
    y: ArrayLike,
    *,
    n_boot: int = 100_000,
    seed: int = 0,
    level: float = 0.95,
    chunk: int = 20_000,
    progress: bool = False,
) -> dict[str, float]:
    """Fit ``y = a x + b`` and percentile bootstrap intervals on ``a`` and ``b`` (Recht et al.).

    Points are resampled with replacement; all ``n_boot`` fits are computed in vectorised chunks
    from resampled sums (no Python loop per sample). Resamples whose x values are all equal
    have no slope and are skipped (their count is returned as ``n_degenerate``).
    ``progress``: a bar over the resample chunks.
    """
    from featcache.core.progress import tqdm

    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    a, b = linear_fit(x, y)
    rng = np.random.default_rng(seed)
    n = len(x)
    a_s = np.empty(n_boot)
    b_s = np.empty(n_boot)
    done = 0
    bar = tqdm(total=n_boot, desc="bootstrap fit", unit="resample", disable=not progress, leave=False)
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
        bar.update(m)
    bar.close()
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
