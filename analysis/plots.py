"""Matplotlib plots (PNG) of the analysis results.

Built with matplotlib's object API (:class:`matplotlib.figure.Figure` saved through
``FigureCanvasAgg``): no pyplot state and no backend switch, so calling these from a notebook or
a GUI program leaves the caller's matplotlib set-up alone. Each function writes one file and
returns its path; every plot has labelled axes and a legend (or a labelled colour bar).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

_DPI = 110


def new_figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h))
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig, path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=_DPI, bbox_inches="tight", format="png")
    return p


def _colors(names) -> dict[str, tuple]:
    """One stable colour per backbone (sorted names), shared by every plot of a report."""
    from matplotlib import colormaps

    names = sorted(set(names))
    cmap = colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {b: cmap(i % cmap.N) for i, b in enumerate(names)}


def _short(name: str, n: int = 64) -> str:
    """A label as is up to ``n`` characters (backbone keys such as
    ``tf_efficientnet_lite0@random0`` stay whole; the saved figure grows to fit them)."""
    return name if len(name) <= n else name[: n - 1] + "…"


def _log_axis(axis, values) -> None:
    """A log axis labelled at 1, 2 and 5 per decade (at each decade only when the data span more
    than two); matplotlib's default also labels minor ticks inside a decade, and those overlap."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    v = np.asarray(values, float)
    v = v[np.isfinite(v) & (v > 0)]
    span = math.log10(v.max() / v.min()) if v.size else 0.0
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if span <= 2 else (1.0,)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _backbone_legend(ax, colors: dict, names, **kw) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker="o", ls="", color=colors[b], label=_short(b)) for b in names]
    ax.legend(handles=handles, title="backbone", fontsize=7, title_fontsize=8, **kw)


def overall_intervals(
    overall,
    path,
    *,
    score: str = "zscore",
    lo: str = "zscore_lo",
    hi: str = "zscore_hi",
    interval: str = "95% bootstrap interval",
) -> Path:
    """Overall ranking: one row per backbone (best on top), the aggregate score and its bootstrap
    interval as a horizontal error bar; ``interval`` names that interval in the legend (the
    report says which resampling it is, so it is not read as the headline's)."""
    names = overall["backbone"].to_list()
    v = overall[score].fill_null(np.nan).to_numpy().astype(float)
    lo_v = overall[lo].fill_null(np.nan).to_numpy().astype(float) if lo in overall.columns else v
    hi_v = overall[hi].fill_null(np.nan).to_numpy().astype(float) if hi in overall.columns else v
    fig = new_figure(6.4, max(2.2, 0.38 * len(names) + 1.2))
    ax = fig.add_subplot()
    y = np.arange(len(names))[::-1]
    err = np.vstack([np.nan_to_num(v - lo_v), np.nan_to_num(hi_v - v)])
    ax.errorbar(v, y, xerr=err, fmt="o", color="tab:blue", ecolor="tab:gray", capsize=3, label=interval)
    ax.plot(v, y, "o", color="tab:blue", label="mean z-score")
    ax.axvline(0, color="k", lw=0.6)
    ax.set_yticks(y, [_short(b) for b in names], fontsize=8)
    ax.set_xlabel("mean z-score over settings (higher is better)")
    ax.set_ylabel("backbone (best on top)")
    ax.set_title("Overall ranking")
    ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def tau_bars(per_task, path) -> Path:
    """Kendall tau between linear and fine-tune rankings per task (VTAB Figure 16)."""
    from matplotlib.patches import Patch

    tasks = per_task["task"].to_list()
    tau = per_task["tau"].to_numpy().astype(float)
    fig = new_figure(max(4.0, 0.5 * len(tasks) + 2), 3.6)
    ax = fig.add_subplot()
    x = np.arange(len(tasks))
    colors = ["tab:blue" if t >= 0 else "tab:red" for t in np.nan_to_num(tau)]
    ax.bar(x, np.nan_to_num(tau), color=colors)
    for i, t in enumerate(tau):
        if np.isnan(t):
            ax.text(i, 0.02, "n/a", ha="center", va="bottom", fontsize=8, rotation=90)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(
        x,
        [_short(t) for t in tasks],
        rotation=90 if len(tasks) > 3 else 0,
        fontsize=8,
    )
    ax.set_ylim(-1.05, 1.05)
    ax.set_xlabel("task")
    ax.set_ylabel("Kendall tau-b")
    ax.set_title("Linear vs fine-tune ranking agreement per task")
    ax.legend(
        handles=[
            Patch(color="tab:blue", label="same order (tau >= 0)"),
            Patch(color="tab:red", label="reversed (tau < 0)"),
        ],
        fontsize=7,
        loc="lower right",
    )
    return save_figure(fig, path)


def _task_grid(n: int, w: float = 3.2, h: float = 3.0):
    ncol = min(3, max(1, n))
    nrow = math.ceil(max(1, n) / ncol)
    fig = new_figure(w * ncol + 1.6, h * nrow)
    return fig, [fig.add_subplot(nrow, ncol, i + 1) for i in range(max(1, n))]


def linear_vs_finetune_scatter(pairs, path) -> Path:
    """One panel per task: linear accuracy (x) vs fine-tune accuracy (y), one colour per backbone."""
    tasks = sorted(set(pairs["task"].to_list()))
    names = sorted(set(pairs["backbone"].to_list()))
    colors = _colors(names)
    fig, axes = _task_grid(len(tasks))
    for ax, task in zip(axes, tasks):
        g = pairs.filter(pairs["task"] == task)
        for b, xi, yi in zip(g["backbone"].to_list(), g["linear"].to_numpy(), g["finetune"].to_numpy()):
            ax.scatter([xi], [yi], s=24, color=colors[b])
        ax.set_title(_short(task, 32), fontsize=9)
        ax.set_xlabel("linear probe score", fontsize=8)
        ax.set_ylabel("fine-tune score", fontsize=8)
    _backbone_legend(axes[-1], colors, names, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    return save_figure(fig, path)


def linear_vs_finetune_ranks(pairs, path) -> Path:
    """One panel per task: each backbone's rank under linear probing (left) joined to its rank
    under fine-tuning (right); crossing lines are where fine-tuning changes the answer."""
    from scipy.stats import rankdata

    tasks = sorted(set(pairs["task"].to_list()))
    names = sorted(set(pairs["backbone"].to_list()))
    colors = _colors(names)
    fig, axes = _task_grid(len(tasks), w=2.6, h=3.0)
    for ax, task in zip(axes, tasks):
        g = pairs.filter(pairs["task"] == task)
        rl = rankdata(-g["linear"].to_numpy().astype(float))
        rf = rankdata(-g["finetune"].to_numpy().astype(float))
        for b, a, c in zip(g["backbone"].to_list(), rl, rf):
            ax.plot([0, 1], [a, c], "-o", color=colors[b], ms=4)
        ax.set_xticks([0, 1], ["linear", "fine-tune"], fontsize=8)
        ax.set_xlim(-0.2, 1.2)
        ax.set_ylim(len(rl) + 0.5, 0.5)
        ax.set_xlabel("protocol", fontsize=8)
        ax.set_ylabel("rank (1 = best)", fontsize=8)
        ax.set_title(_short(task, 28), fontsize=9)
    _backbone_legend(axes[-1], colors, names, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    return save_figure(fig, path)


def zscore_heatmap(zscores, path, *, order=None) -> Path:
    """Backbone x setting heatmap of BoB z-scores (rows in ``order`` if given)."""
    df = zscores
    if order is not None:
        import polars as pl

        pos = {b: i for i, b in enumerate(order)}
        df = df.with_columns(pl.col("backbone").replace_strict(pos, default=len(pos)).alias("_o")).sort("_o").drop("_o")
    names = df["backbone"].to_list()
    cols = [c for c in df.columns if c != "backbone"]
    m = df.select(cols).fill_null(np.nan).to_numpy().astype(float)
    # setting names whole and upright-rotated (90 degrees: each label's extent is its own column,
    # so neighbours never overlap); the figure widens with the settings instead
    fig = new_figure(max(4.5, 0.25 * len(cols) + 3.5), max(2.5, 0.32 * len(names) + 2.0))
    ax = fig.add_subplot()
    lim = max(1e-9, float(np.nanmax(np.abs(m)))) if np.isfinite(m).any() else 1.0
    im = ax.imshow(np.ma.masked_invalid(m), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_xticks(np.arange(len(cols)), [_short(c) for c in cols], rotation=90, fontsize=7)
    ax.set_yticks(np.arange(len(names)), [_short(b) for b in names], fontsize=7)
    ax.set_xlabel("setting (kind:task)")
    ax.set_ylabel("backbone")
    fig.colorbar(im, ax=ax, label="z-score (blue: below mean, red: above)")
    ax.set_title("z-score per backbone and setting (blank: no result)")
    return save_figure(fig, path)


def shift_scatter(table, fit_row, path, *, title: str = "") -> Path:
    """acc_new vs acc_orig with Clopper-Pearson error bars, the y = x line and the fit."""
    x = table["acc_orig"].to_numpy().astype(float)
    y = table["acc_new"].to_numpy().astype(float)
    fig = new_figure(4.6, 4.2)
    ax = fig.add_subplot()

    def err(col_lo, col_hi, v):
        lo = table[col_lo].fill_null(np.nan).to_numpy().astype(float)
        hi = table[col_hi].fill_null(np.nan).to_numpy().astype(float)
        return np.vstack([np.nan_to_num(v - lo), np.nan_to_num(hi - v)])

    names = table["backbone"].to_list()
    colors = _colors(names)
    xerr, yerr = err("orig_lo", "orig_hi", x), err("new_lo", "new_hi", y)
    for i, b in enumerate(names):  # one colour per backbone, named whole in the legend (no labels on points)
        ax.errorbar(
            x[i : i + 1],
            y[i : i + 1],
            xerr=xerr[:, i : i + 1],
            yerr=yerr[:, i : i + 1],
            fmt="o",
            ms=4,
            capsize=2,
            color=colors[b],
        )
    lo = float(min(x.min(), y.min())) - 0.02
    hi = float(max(x.max(), y.max())) + 0.02
    grid = np.linspace(lo, hi, 50)
    ax.plot(grid, grid, "k--", lw=0.8, label="y = x")
    if fit_row is not None and fit_row.get("a") is not None:
        a, b = fit_row["a"], fit_row["b"]
        ax.plot(grid, a * grid + b, "r-", lw=1.2, label=f"fit: {a:.2f} x {b:+.3f}")
    ax.set_xlabel("score on original test split")
    ax.set_ylabel("score on new test split")
    ax.set_title(title or "Test-set shift")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker="o", ls="-", color="0.5", label="backbone (95% interval)")]
    ax.add_artist(ax.legend(handles=handles + ax.get_legend_handles_labels()[0], fontsize=8, loc="lower right"))
    _backbone_legend(ax, colors, names, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return save_figure(fig, path)


def efficiency_scatter(table, path) -> Path:
    """Throughput (images/s) vs overall z-score, one colour per backbone."""
    t = table.drop_nulls(["images_per_s", "zscore"])
    names = t["backbone"].to_list()
    colors = _colors(names)
    fig = new_figure(6.0, 3.8)
    ax = fig.add_subplot()
    for b, xi, yi in zip(names, t["images_per_s"].to_numpy(), t["zscore"].to_numpy()):
        ax.scatter([xi], [yi], color=colors[b], s=30)
    ax.set_xscale("log")
    _log_axis(ax.xaxis, t["images_per_s"].to_numpy())
    ax.set_xlabel("extraction throughput (images / s, log scale)")
    ax.set_ylabel("mean z-score")
    ax.set_title("Performance vs speed")
    _backbone_legend(ax, colors, names, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return save_figure(fig, path)


def cost_bars(table, path) -> Path:
    """Per backbone: extraction throughput and, where recorded, peak memory (MiB) and store size."""
    cols = [
        c
        for c in ("images_per_s", "peak_memory_mib", "store_mib")
        if c in table.columns and table[c].drop_nulls().len()
    ]
    labels = {"images_per_s": "images / s", "peak_memory_mib": "peak memory (MiB)", "store_mib": "store size (MiB)"}
    names = table["backbone"].to_list()
    colors = _colors(names)
    fig = new_figure(3.4 * len(cols) + 1.8, max(2.4, 0.32 * len(names) + 1.2))
    axes = [fig.add_subplot(1, len(cols), i + 1) for i in range(len(cols))]
    y = np.arange(len(names))[::-1]
    for k, (ax, c) in enumerate(zip(axes, cols)):
        v = table[c].cast(float).fill_null(np.nan).to_numpy()
        ax.barh(y, np.nan_to_num(v), color=[colors[b] for b in names])
        if c == "images_per_s":
            _throughput_conditions(ax, table, y, v)
        ax.set_yticks(y, [_short(b) for b in names] if k == 0 else [""] * len(names), fontsize=7)
        ax.set_xlabel(labels[c], fontsize=8)
        if k == 0:
            ax.set_ylabel("backbone")
        ax.set_title(labels[c].split(" (")[0], fontsize=9)
    _backbone_legend(axes[-1], colors, names, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    return save_figure(fig, path)


def _throughput_conditions(ax, table, y, v) -> None:
    """Each throughput bar labelled with the threads and load average it was measured at (a
    throughput is a property of the run, not of the backbone), or "not recorded"; the axis
    leaves room for the label."""
    t = table["extract_threads"].to_list() if "extract_threads" in table.columns else [None] * len(y)
    ld = table["load_avg"].to_list() if "load_avg" in table.columns else [None] * len(y)
    for yi, vi, ti, li in zip(y, np.nan_to_num(v), t, ld):
        text = (
            "not recorded" if ti in (None, "not recorded") and li in (None, "not recorded") else f"{ti} thr, load {li}"
        )
        ax.text(vi, yi, " " + text, va="center", ha="left", fontsize=6)
    ax.set_xlim(0, max(1.0, float(np.nanmax(v)) if np.isfinite(v).any() else 1.0) * 2.6)


def task_scores(wide, path, *, metric: str) -> Path:
    """Grouped horizontal bars: the ranked metric per setting (rows) for each backbone."""
    names = wide["backbone"].to_list()
    cols = [c for c in wide.columns if c != "backbone"]
    m = wide.select(cols).fill_null(np.nan).to_numpy().astype(float)  # [B, T]
    colors = _colors(names)
    fig = new_figure(7.0, max(2.6, 0.22 * len(names) * len(cols) + 1.4))
    ax = fig.add_subplot()
    h = 0.8 / max(1, len(names))
    y0 = np.arange(len(cols))[::-1]
    for i, b in enumerate(names):
        ax.barh(y0 + 0.4 - (i + 0.5) * h, np.nan_to_num(m[i]), height=h, color=colors[b], label=_short(b))
    ax.set_yticks(y0, [_short(c) for c in cols], fontsize=7)
    ax.set_xlabel(metric)
    ax.set_ylabel("setting (kind:task)")
    ax.set_title(f"{metric} per setting")
    ax.legend(title="backbone", fontsize=7, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return save_figure(fig, path)


def best_vs_rest(
    differences, best: str, path, *, aggregation: str = "zscore", interval: str = "95% bootstrap interval"
) -> Path:
    """Intervals of (best - other) in ``aggregation`` for every other backbone (``differences``:
    the pairwise table, or :class:`~featcache.analysis.first_place.FirstPlace`'s ``table``, the
    headline's numbers): an interval that excludes 0 means the data separate the two."""
    import polars as pl

    d = differences.filter((pl.col("aggregation") == aggregation) & ((pl.col("a") == best) | (pl.col("b") == best)))
    sign = np.where((d["a"] == best).to_numpy(), 1.0, -1.0)
    other = [b if a == best else a for a, b in zip(d["a"].to_list(), d["b"].to_list())]
    diff = d["diff"].to_numpy() * sign
    lo = np.where(sign > 0, d["lo"].to_numpy(), -d["hi"].to_numpy())
    hi = np.where(sign > 0, d["hi"].to_numpy(), -d["lo"].to_numpy())
    order = np.argsort(diff)
    fig = new_figure(6.4, max(2.2, 0.38 * len(other) + 1.2))
    ax = fig.add_subplot()
    y = np.arange(len(other))
    sep = lo[order] > 0
    ax.errorbar(
        diff[order][sep],
        y[sep],
        xerr=[diff[order][sep] - lo[order][sep], hi[order][sep] - diff[order][sep]],
        fmt="o",
        color="tab:green",
        capsize=3,
        label="separated (interval > 0)",
    )
    ax.errorbar(
        diff[order][~sep],
        y[~sep],
        xerr=[diff[order][~sep] - lo[order][~sep], hi[order][~sep] - diff[order][~sep]],
        fmt="o",
        color="tab:orange",
        capsize=3,
        label="not separated",
    )
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(y, [_short(other[i]) for i in order], fontsize=8)
    ax.set_xlabel(f"{_short(best)} minus backbone ({aggregation}, {interval})")
    ax.set_ylabel("compared backbone")
    ax.set_title(f"How sure is the first place of {_short(best)}?")
    ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def layer_curves_figure(panels):
    """Accuracy against depth (layer sweeps): one panel per ``(title, ylabel, lines)``, each line
    ``(backbone, layers, values, selected, lo, hi)`` drawn as its metric against the layer index
    with its interval shaded where ``lo``/``hi`` are finite, the selected layer ringed. Returns
    the Figure."""
    names = sorted({ln[0] for _, _, lines in panels for ln in lines})
    colors = _colors(names)
    cols = min(2, len(panels)) or 1
    rows = max(1, -(-len(panels) // cols))
    fig = new_figure(5.0 * cols, 3.4 * rows)
    for t, (title, ylabel, lines) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, t + 1)
        shaded = False
        for b, layers, values, selected, lo, hi in lines:
            ax.plot(layers, values, marker="o", ms=3, color=colors[b], label=_short(b))
            if lo is not None and np.isfinite(lo).any():
                ax.fill_between(layers, lo, hi, color=colors[b], alpha=0.15, lw=0)
                shaded = True
            if selected in layers:
                ax.plot(
                    [selected], [values[list(layers).index(selected)]], marker="o", ms=10, mfc="none", color=colors[b]
                )
        ax.set_xlabel("layer (0-based block / stage index)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=8)
        title = "backbone (ring: selected on val" + ("; band: 95% Clopper-Pearson)" if shaded else ")")
        ax.legend(title=title, fontsize=7, title_fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def layer_curves(panels, path) -> Path:
    """:func:`layer_curves_figure` saved as a PNG at ``path``."""
    return save_figure(layer_curves_figure(panels), path)


def similarity_heatmap(names, values, path, *, title: str, label: str) -> Path:
    """A symmetric backbone x backbone similarity matrix (CKA, RSA) with its values written in."""
    n = len(names)
    fig = new_figure(1.6 + 0.9 * n, 1.2 + 0.8 * n)
    ax = fig.add_subplot()
    im = ax.imshow(values, vmin=min(0.0, float(np.nanmin(values))), vmax=1.0, cmap="viridis")
    ax.set_xticks(range(n), names, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(n), names, fontsize=8)
    for i in range(n):
        for j in range(n):
            v = values[i, j]
            if np.isfinite(v):
                ax.text(j, i, f"{v:.3f}", ha="center", va="center", fontsize=7, color="w" if v < 0.6 else "k")
    fig.colorbar(im, ax=ax, label=label)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)
