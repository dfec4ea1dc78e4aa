"""Test-set shift (Recht et al.): a metric on an original and a new test split per backbone.

Per backbone: the metric on both splits (``acc_orig``/``acc_new``; any metric, named so for
Recht et al.'s accuracy) with 95% Clopper-Pearson intervals where the metric is binomial
(top-1, top-5; none for mean-per-class, ECE, NLL), the gap, the rank on each split in the
metric's direction (lower ECE/NLL ranks first) and the rank change; across backbones the fit ``acc_new = a * acc_orig + b`` with
bootstrap 95% intervals on ``a`` and ``b`` (resampling backbones, 100,000 samples by default).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from featcache.analysis import stats
from featcache.core.metrics import lower_is_better, proportion_metrics
from featcache.errors import ResultsError

log = logging.getLogger(__name__)


def shift_table(
    df,
    orig: str,
    new: str,
    *,
    metric: str = "top1",
    kind: str = "probe",
    seed_reduce: str = "median",
    alpha: float = 0.05,
):
    """Per (dataset, backbone) accuracy on the ``orig`` and ``new`` eval splits.

    ``df`` is an analysis table (:func:`featcache.analysis.tables.load_table`). Returns a polars
    DataFrame with dataset, backbone, acc_orig, orig_lo, orig_hi, n_orig, acc_new, new_lo,
    new_hi, n_new, gap (orig - new), rank_orig, rank_new (1 = best in the metric's direction),
    delta_rank (rank_orig - rank_new: negative = dropped, as in Recht et al.), and a list of
    backbones seen on one split only.
    """
    import polars as pl

    if orig == new:
        raise ResultsError(f"--orig and --new name the same split {orig!r}")
    sub = df.filter((pl.col("metric") == metric) & (pl.col("kind") == kind))
    splits = sorted(set(sub["eval_split"].to_list()))
    for s in (orig, new):
        if s not in splits:
            raise ResultsError(f"no {kind} rows with metric {metric!r} on eval split {s!r}; splits present: {splits}")
    sub = sub.filter(pl.col("eval_split").is_in([orig, new]))
    keys = ["dataset", "protocol", "backbone", "eval_split"]
    agg = pl.col("value").median() if seed_reduce == "median" else pl.col("value").mean()
    red = sub.group_by(keys).agg(agg.alias("value"), pl.col("n_eval").min().alias("n_eval"))
    o = red.filter(pl.col("eval_split") == orig).select(
        "dataset", "protocol", "backbone", pl.col("value").alias("acc_orig"), pl.col("n_eval").alias("n_orig")
    )
    n = red.filter(pl.col("eval_split") == new).select(
        "dataset", "protocol", "backbone", pl.col("value").alias("acc_new"), pl.col("n_eval").alias("n_new")
    )
    full = o.join(n, on=["dataset", "protocol", "backbone"], how="full", coalesce=True)
    one_side = full.filter(pl.col("acc_orig").is_null() | pl.col("acc_new").is_null())
    missing = [
        f"{r['dataset']}/{r['backbone']} (only on {'new' if r['acc_orig'] is None else 'orig'})"
        for r in one_side.iter_rows(named=True)
    ]
    if missing:
        log.warning("shift: backbones evaluated on one split only: %s", ", ".join(missing))
    higher = metric not in lower_is_better()  # ranks and row order follow the metric's direction
    t = full.drop_nulls(["acc_orig", "acc_new"]).sort(
        ["dataset", "protocol", "acc_orig"], descending=[False, False, higher]
    )
    if t.height == 0:
        raise ResultsError(f"no backbone has {metric!r} on both {orig!r} and {new!r}")
    t = _with_intervals(t, metric, alpha).with_columns((pl.col("acc_orig") - pl.col("acc_new")).alias("gap"))
    parts = []
    for _, g in t.group_by(["dataset", "protocol"], maintain_order=True):
        ro = stats.rankdata(g["acc_orig"].to_numpy(), descending=higher)
        rn = stats.rankdata(g["acc_new"].to_numpy(), descending=higher)
        parts.append(
            g.with_columns(pl.Series("rank_orig", ro), pl.Series("rank_new", rn), pl.Series("delta_rank", ro - rn))
        )
    t = pl.concat(parts)
    t = t.select(
        "dataset",
        "protocol",
        "backbone",
        "acc_orig",
        "orig_lo",
        "orig_hi",
        "n_orig",
        "acc_new",
        "new_lo",
        "new_hi",
        "n_new",
        "gap",
        "rank_orig",
        "rank_new",
        "delta_rank",
    )
    return t, missing


def _with_intervals(t, metric: str, alpha: float):
    """``{orig,new}_{lo,hi}``: Clopper-Pearson for binomial metrics (a count of correct test
    images: top-1, top-5) with a known n; null for the others (mean-per-class, ECE, NLL are
    not binomial proportions, and per-image values to bootstrap are not in a results table)."""
    import polars as pl

    binomial = proportion_metrics()  # metrics that count correct test images: Clopper-Pearson applies
    cols = {}
    for side in ("orig", "new"):
        acc = t[f"acc_{side}"].to_numpy().astype(float)
        nn = t[f"n_{side}"].fill_null(0).to_numpy().astype(float)
        lo = np.full(len(acc), np.nan)
        hi = np.full(len(acc), np.nan)
        ok = nn > 0
        if metric in binomial and ok.any():
            lo[ok], hi[ok] = stats.clopper_pearson(acc[ok] * nn[ok], nn[ok], alpha)
        cols[f"{side}_lo"] = lo
        cols[f"{side}_hi"] = hi
    if metric not in binomial:
        log.info(
            "shift: no intervals for %r (Clopper-Pearson applies to binomial metrics %s only)",
            metric,
            sorted(binomial),
        )
    return t.with_columns(*(pl.Series(k, v).fill_nan(None) for k, v in cols.items()))


def shift_fit(table, *, n_boot: int = 100_000, seed: int = 0, level: float = 0.95, progress: bool = False):
    """Fit ``acc_new = a * acc_orig + b`` per (dataset, protocol) with bootstrap intervals
    (``progress``: a bar per fit)."""
    import polars as pl

    rows = []
    for (ds, proto), g in table.group_by(["dataset", "protocol"], maintain_order=True):
        if g.height < 2:
            log.warning("shift fit on %s skipped: needs at least 2 backbones, has %d", ds, g.height)
            rows.append({"dataset": ds, "protocol": proto, "n_points": g.height, "reason": "fewer than 2 backbones"})
            continue
        try:
            fit = stats.bootstrap_linear_fit(
                g["acc_orig"].to_numpy(),
                g["acc_new"].to_numpy(),
                n_boot=n_boot,
                seed=seed,
                level=level,
                progress=progress,
            )
        except ResultsError as exc:
            log.warning("shift fit on %s skipped: %s", ds, exc)
            rows.append({"dataset": ds, "protocol": proto, "n_points": g.height, "reason": str(exc)})
            continue
        rows.append({"dataset": ds, "protocol": proto, **fit, "reason": None})
    schema = {
        "dataset": pl.Utf8,
        "protocol": pl.Utf8,
        "a": pl.Float64,
        "a_lo": pl.Float64,
        "a_hi": pl.Float64,
        "b": pl.Float64,
        "b_lo": pl.Float64,
        "b_hi": pl.Float64,
        "n_points": pl.Int64,
        "n_boot": pl.Int64,
        "n_degenerate": pl.Int64,
        "seed": pl.Int64,
        "reason": pl.Utf8,
    }
    return pl.DataFrame([{k: r.get(k) for k in schema} for r in rows], schema=schema)


def shift_analysis(
    df, orig: str, new: str, *, n_boot: int = 100_000, seed: int = 0, progress: bool = False, **kw
) -> dict[str, Any]:
    """:func:`shift_table` + :func:`shift_fit`; returns ``{"table", "fit", "missing"}``."""
    table, missing = shift_table(df, orig, new, **kw)
    return {"table": table, "fit": shift_fit(table, n_boot=n_boot, seed=seed, progress=progress), "missing": missing}
