"""Matplotlib plots (Agg backend, PNG) of the analysis results. Each function writes one file
and returns its path."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return p


def tau_bars(per_task, path) -> Path:
    """Kendall tau between linear and fine-tune rankings per task (VTAB Figure 16)."""
    plt = _plt()
    tasks = per_task["task"].to_list()
    tau = per_task["tau"].to_numpy().astype(float)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(tasks) + 2), 3.6))
    x = np.arange(len(tasks))
    colors = ["tab:blue" if t >= 0 else "tab:red" for t in np.nan_to_num(tau)]
    ax.bar(x, np.nan_to_num(tau), color=colors)
    for i, t in enumerate(tau):
        if np.isnan(t):
            ax.text(i, 0.02, "n/a", ha="center", va="bottom", fontsize=8, rotation=90)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(x, tasks, rotation=60, ha="right", fontsize=8)
    ax.set_ylim(-1.05, 1.05)
    ax.set_ylabel("Kendall tau-b")
    ax.set_title("Linear vs fine-tune ranking agreement per task")
    return _save(fig, path)


def linear_vs_finetune_scatter(pairs, path) -> Path:
    """One panel per task: linear accuracy (x) vs fine-tune accuracy (y) per backbone."""
    plt = _plt()
    tasks = sorted(set(pairs["task"].to_list()))
    k = max(1, len(tasks))
    ncol = min(4, k)
    nrow = math.ceil(k / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol, 3.0 * nrow), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        g = pairs.filter(pairs["task"] == task)
        x = g["linear"].to_numpy()
        y = g["finetune"].to_numpy()
        ax.scatter(x, y, s=18)
        for b, xi, yi in zip(g["backbone"].to_list(), x, y):
            ax.annotate(b[:18], (xi, yi), fontsize=6, alpha=0.7)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("linear", fontsize=8)
        ax.set_ylabel("fine-tune", fontsize=8)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.tight_layout()
    return _save(fig, path)


def zscore_heatmap(zscores, path, *, order=None) -> Path:
    """Backbone x task heatmap of BoB z-scores (rows in ``order`` if given)."""
    plt = _plt()
    df = zscores
    if order is not None:
        import polars as pl

        pos = {b: i for i, b in enumerate(order)}
        df = df.with_columns(pl.col("backbone").replace_strict(pos, default=len(pos)).alias("_o")).sort("_o").drop("_o")
    names = df["backbone"].to_list()
    cols = [c for c in df.columns if c != "backbone"]
    m = df.select(cols).to_numpy().astype(float)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(cols) + 3), max(2.5, 0.32 * len(names) + 1.5)))
    lim = max(1e-9, float(np.nanmax(np.abs(m)))) if np.isfinite(m).any() else 1.0
    im = ax.imshow(np.ma.masked_invalid(m), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_xticks(np.arange(len(cols)), cols, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(np.arange(len(names)), names, fontsize=7)
    fig.colorbar(im, ax=ax, label="z-score")
    ax.set_title("z-score per backbone and setting (blank: no result)")
    return _save(fig, path)


def shift_scatter(table, fit_row, path, *, title: str = "") -> Path:
    """acc_new vs acc_orig with Clopper-Pearson error bars, the y = x line and the fit."""
    plt = _plt()
    x = table["acc_orig"].to_numpy().astype(float)
    y = table["acc_new"].to_numpy().astype(float)
    fig, ax = plt.subplots(figsize=(4.6, 4.2))

    def err(col_lo, col_hi, v):
        lo = table[col_lo].fill_null(np.nan).to_numpy().astype(float)
        hi = table[col_hi].fill_null(np.nan).to_numpy().astype(float)
        return np.vstack([np.nan_to_num(v - lo), np.nan_to_num(hi - v)])

    ax.errorbar(x, y, xerr=err("orig_lo", "orig_hi", x), yerr=err("new_lo", "new_hi", y), fmt="o", ms=4, capsize=2)
    for b, xi, yi in zip(table["backbone"].to_list(), x, y):
        ax.annotate(b[:18], (xi, yi), fontsize=6, alpha=0.7)
    lo = float(min(x.min(), y.min())) - 0.02
    hi = float(max(x.max(), y.max())) + 0.02
    grid = np.linspace(lo, hi, 50)
    ax.plot(grid, grid, "k--", lw=0.8, label="y = x")
    if fit_row is not None and fit_row.get("a") is not None:
        a, b = fit_row["a"], fit_row["b"]
        ax.plot(grid, a * grid + b, "r-", lw=1.2, label=f"fit: {a:.2f} x {b:+.3f}")
    ax.set_xlabel("accuracy on original test split")
    ax.set_ylabel("accuracy on new test split")
    ax.set_title(title or "Test-set shift")
    ax.legend(fontsize=8)
    return _save(fig, path)


def efficiency_scatter(table, path) -> Path:
    """Throughput (images/s) vs overall z-score per backbone."""
    plt = _plt()
    t = table.drop_nulls(["images_per_s", "zscore"])
    fig, ax = plt.subplots(figsize=(4.6, 3.8))
    ax.scatter(t["images_per_s"].to_numpy(), t["zscore"].to_numpy())
    for b, xi, yi in zip(t["backbone"].to_list(), t["images_per_s"].to_numpy(), t["zscore"].to_numpy()):
        ax.annotate(b[:18], (xi, yi), fontsize=6)
    ax.set_xscale("log")
    ax.set_xlabel("images / s")
    ax.set_ylabel("mean z-score")
    ax.set_title("Performance vs speed")
    return _save(fig, path)
