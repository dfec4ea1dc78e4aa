"""A self-contained HTML report (tables inline, plots embedded as base64 PNG, no script, no
network), rendered from ``templates/report.html.j2`` with jinja2's autoescape.

The page answers a user's questions in order: which backbone to use, whether fine-tuning
would change the answer, how sure the answer is, what it cost; then the details (metric pivot
tables, calibration, the store catalog) and, on request, a test-set shift. This module only
gathers the data of each section; the template lays them out.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcache.analysis.api import Ranking, load_results, overall_with_intervals, rank, shift
from featcache.analysis.loaded import (
    LoadedResults,
    resolve_retrieval_metric,
    retrieval_metric_list,
    retrieval_metric_text,
)
from featcache.analysis.rankings import BASELINE_SUFFIX, THROUGHPUT_CONDITIONS, random_baselines, throughput_note
from featcache.core.formatting import format_cell, table_cells
from featcache.errors import ResultsError

if TYPE_CHECKING:
    import polars as pl

    from featcache.analysis.tables import TableLike

log = logging.getLogger(__name__)

#: columns of the store catalog shown in the report (the rest stay in the parquet catalog)
CATALOG_COLUMNS = (
    "backbone",
    "dataset",
    "split",
    "kind",
    "n",
    "dim",
    "dtype",
    "complete",
    "n_invalid",
    "size_mib",
    "images_per_s",
    *THROUGHPUT_CONDITIONS,
)
#: pivot tables with more metric columns than this are split by cut-off (``recall@5`` -> recall, k=5)
_MAX_METRIC_COLUMNS = 8


def _figure(path: Path, caption: str) -> dict[str, str]:
    return {"data": base64.b64encode(Path(path).read_bytes()).decode("ascii"), "alt": caption, "caption": caption}


def _figures(tmp: Path, items: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    return [_figure(tmp / name, caption) for name, caption in items if (tmp / name).exists()]


def _interval_cell(v, lo, hi, fmt: str = "{:.3f}") -> str:
    if v is None or v != v:
        return ""
    if lo is None or hi is None or lo != lo or hi != hi:
        return fmt.format(v)
    return f"{fmt.format(v)} [{fmt.format(lo)}, {fmt.format(hi)}]"


# ----------------------------------------------------------------------------- ranking sections


def _choose(
    r: Ranking,
    tmp: Path,
    scaled: AbstractSet[tuple[str, str]] = frozenset(),
    baselines: AbstractSet[str] = frozenset(),
) -> dict[str, Any]:
    """The first section: the headline (:func:`_headline`), the ranking table with the lead of
    the first backbone and its paired interval (the headline's numbers, drawn by the plot below
    it), the weights, the per-setting differences and good/better/best."""
    import polars as pl

    ov = overall_with_intervals(r)
    lead = _lead_column(r)
    shown = ov.select(
        "position",
        "backbone",
        pl.col("zscore").map_elements(lambda v: _interval_cell(v, None, None, "{:+.2f}"), return_dtype=pl.Utf8),
        "mean",
        "avg_rank",
        "group_mean",
        *[c for c in ov.columns if c.startswith("mean[")],
        "n_settings",
    )
    if lead is not None:
        shown = shown.join(lead, on="backbone", how="left").select(
            "position", "backbone", "zscore", lead.columns[1], *shown.columns[3:]
        )
    if shown["group_mean"].null_count() == shown.height:
        shown = shown.drop("group_mean")
    figs = []
    fp = r.first_place
    if ov.height > 1 and fp is not None and fp.table.height:
        from featcache.analysis import plots as P

        best = ov["backbone"][0]
        P.best_vs_rest(fp.table, best, tmp / "best_vs_rest.png", interval=f"paired {100 * fp.level:.0f}% interval")
        figs = _figures(
            tmp,
            [
                (
                    "best_vs_rest.png",
                    f"The headline's interval: paired {100 * fp.level:.0f}% interval of the mean z-score lead of "
                    f"{best} over each other backbone, counting {fp.covers}",
                )
            ],
        )
    return {
        "answer": _headline(r, ov, scaled, baselines),
        "interval": _interval_statement(r),
        "n_settings": r.zscores.width - 1,
        "seeds": _seed_statement(r),
        "retrieval": _retrieval_statement(r),
        "overall": table_cells(shown, table_id="overall-table"),
        "top3": table_cells(r.top3, table_id="top3-table"),
        "weights": table_cells(_weights_marked(r.weights, scaled), table_id="weights-table")
        if r.weights is not None
        else None,
        "per_setting": table_cells(_per_setting_gaps(r), table_id="gaps-table") if 1 < ov.height <= 3 else None,
        "figures": figs + _figures(tmp, [("zscore_heatmap.png", "z-score of every backbone on every setting")]),
    }


def _lead_column(r: Ranking):
    """backbone -> "lead of the first over it [paired interval]" (the first place's table, the
    headline's numbers); None without a verdict."""
    import polars as pl

    fp = r.first_place
    if fp is None or fp.table.height == 0:
        return None
    name = f"lead of {fp.best} [paired {100 * fp.level:.0f}% interval]"
    return fp.table.select(
        pl.col("b").alias("backbone"),
        pl.struct("diff", "lo", "hi")
        .map_elements(lambda x: _interval_cell(x["diff"], x["lo"], x["hi"], "{:+.2f}"), return_dtype=pl.Utf8)
        .alias(name),
    )


def _interval_statement(r: Ranking) -> str:
    """Which interval the first section uses, said where it is used."""
    fp = r.first_place
    if fp is None or fp.runner_up is None:
        return "One backbone: there is no lead to give an interval for."
    return (
        f"The interval in the headline, in the ranking table's lead column and in the plot below is one: the "
        f"paired {100 * fp.level:.0f}% interval of the first backbone's mean z-score lead, counting {fp.covers}. "
        f"The bootstrap over {r.resample} in section 3 answers another question (how the aggregates move when "
        "the settings are redrawn) and is not used here."
    )


def _headline(r: Ranking, ov, scaled: AbstractSet[tuple[str, str]], baselines: AbstractSet[str]) -> str:
    """The answer to "which backbone?": the first backbone, unless it is a random-init baseline
    (then that no pretrained backbone beat it), the verdict on its lead and what few backbones
    or scaled-down schedules change."""
    import polars as pl

    best = ov.row(0, named=True)
    pretrained = ov.filter(~pl.col("backbone").is_in(sorted(baselines)))
    if best["backbone"] not in baselines:
        answer = f"Use {best['backbone']}: first by mean z-score ({best['zscore']:+.2f})"
    elif pretrained.height == 0:
        answer = (
            f"Every ranked backbone is a random-init baseline ({', '.join(ov['backbone'].to_list())}): there is "
            "no pretrained backbone to recommend"
        )
    else:
        p = pretrained.row(0, named=True)
        answer = (
            f"No pretrained backbone beat the random baseline: {best['backbone']} is first by mean z-score "
            f"({best['zscore']:+.2f}), the best pretrained backbone {p['backbone']} is #{p['position']} "
            f"({p['zscore']:+.2f}); do not use the random baseline, look at why the pretrained features do not "
            "help here (input size, data, too few images)"
        )
    verdict = r.first_place is not None and r.first_place.runner_up is not None
    if verdict:
        answer += "; " + first_place_verdict(r.first_place)
    if 1 < ov.height <= 3:
        few = _few_backbones(ov.height, best["backbone"], r.setting_differences)
        answer += (" Also, " if verdict else "; ") + few
    ranked_scaled = (
        sorted({s for s, _ in scaled} & set(r.weights["setting"].to_list())) if r.weights is not None else []
    )
    if ranked_scaled and r.weights is not None:
        share = r.weights.filter(pl.col("setting").is_in(ranked_scaled))["weight"].sum()
        answer += (
            f" Note: {len(ranked_scaled)} ranked setting(s) ran a scaled-down schedule (marked in the weights "
            f"table); they carry {100 * share:.0f}% of the z-score."
        )
    return answer


def _weights_marked(weights, scaled: AbstractSet[tuple[str, str]]):
    """The settings' weights with a ``scaled`` column: the setting's schedule was scaled down."""
    import polars as pl

    marked = sorted({s for s, _ in scaled})
    return weights.with_columns(pl.col("setting").is_in(marked).alias("scaled"))


def _retrieval_statement(r: Ranking) -> str | None:
    """Which AP the retrieval settings are ranked on (None without retrieval settings)."""
    if not any(s.startswith("retrieval:") for s in r.scores.columns):
        return None
    return f"Retrieval settings are ranked on {retrieval_metric_text(r.retrieval_metric)}."


def first_place_verdict(fp) -> str:
    """The headline's one statement on first place, from the same table as the certainty plot
    (:func:`~featcache.analysis.first_place.first_place`)."""
    row = fp.table.row(0, named=True)
    pct = f"{100 * fp.level:.0f}%"
    if fp.n_datasets == 1 and fp.noisy_settings == 0:
        return (
            f"whether its lead over the runner-up {fp.runner_up} ({row['diff']:+.2f} z) is more than noise "
            "cannot be judged: with one dataset and no test-set sizes (n_eval) there is nothing to resample."
        )
    interval = f"[{row['lo']:+.2f}, {row['hi']:+.2f}]"
    if fp.separated:
        text = (
            f"its lead over the runner-up {fp.runner_up} ({row['diff']:+.2f} z) is separated: the paired "
            f"{pct} interval {interval} excludes 0, counting {fp.covers}."
        )
    else:
        text = (
            f"its lead over the runner-up {fp.runner_up} ({row['diff']:+.2f} z) is not separated: the paired "
            f"{pct} interval {interval} includes 0 (counting {fp.covers}), so the data do not tell the "
            "two apart."
        )
    if fp.n_datasets == 1:
        text += (
            " With one dataset the intervals cover its test-set noise only, not how another dataset would order them."
        )
    return text


def _few_backbones(n: int, best: str, differences=None) -> str:
    """What a ranking of two or three backbones can and cannot say, and whether the per-setting
    differences have intervals of their own to judge by (``differences``: the ranking's
    :func:`~featcache.analysis.rankings.setting_differences`)."""
    if n == 2:
        what = (
            "with 2 backbones every z-score is +1 or -1, so the mean z-score only counts the settings "
            f"where {best} is ahead, its interval cannot separate the two and rank correlations are undefined"
        )
    else:
        what = "with 3 backbones the z-scores take few values and their intervals say little"
    total = differences["setting"].n_unique() if differences is not None else 0
    with_iv = differences.drop_nulls("lo")["setting"].n_unique() if differences is not None else 0
    if with_iv == 0:
        judge = (
            "the per-setting differences below have no interval of their own (every setting has one seed: "
            "nothing to pair); run more seeds (e.g. --seeds 0,1,2) to judge each setting"
        )
    elif with_iv < total:
        judge = (
            f"judge by the per-setting differences below: {with_iv} of {total} setting(s) have a paired "
            "interval over seeds (the others have one seed)"
        )
    else:
        judge = "judge by the per-setting differences below, each with its own paired interval over seeds"
    return f"{what}. Nothing about backbones in general follows from so few; {judge}."


def _per_setting_gaps(r: Ranking):
    """Per ranked setting: each backbone's score (with its binomial interval where the results
    give one), its difference to the first backbone and that difference's paired seed
    bootstrap interval (:func:`~featcache.analysis.rankings.setting_differences`)."""
    import polars as pl

    order = r.overall["backbone"].to_list()
    long = r.scores.unpivot(index="backbone", variable_name="setting", value_name="score")
    ci = _score_intervals(r)
    if ci is not None:
        long = long.join(ci, on=["setting", "backbone"], how="left")
    d = r.setting_differences.select(
        "setting",
        "backbone",
        pl.struct("diff", "lo", "hi")
        .map_elements(lambda x: _interval_cell(x["diff"], x["lo"], x["hi"], "{:+.4f}"), return_dtype=pl.Utf8)
        .alias(f"minus {order[0]} [95% interval]"),
        pl.col("interval").alias("difference interval"),
    )
    return long.join(d, on=["setting", "backbone"], how="left").sort("setting", "backbone")


def _score_intervals(r: Ranking):
    """95% interval of each (setting, backbone) score: the per-row binomial interval of a single
    seed's proportion (Clopper-Pearson), where the results give it; None when none do."""
    import polars as pl

    iv = r.intervals
    if iv is None or iv.height == 0:
        return None
    metric = r.metric if r.metric not in ("auto", "task") else "top1"
    one = iv.filter(pl.col("ci_lo").is_not_null() & (pl.col("metric") == metric))
    if one.height == 0:
        return None
    return (
        one.with_columns((pl.col("kind") + pl.lit(":") + pl.col("task")).alias("setting"))
        .group_by("setting", "backbone")
        .agg(pl.col("ci_lo").median(), pl.col("ci_hi").median())
    )


def _with_hparams(results):
    """``results`` as a DataFrame with an ``hparams`` column (a featcache results parquet or
    frame), else None: only featcache's own rows record how they were run."""
    import polars as pl

    from featcache.core.results import read_parquet_checked

    if isinstance(results, (str, os.PathLike)):
        results = read_parquet_checked(results) if str(results).lower().endswith(".parquet") else None
    if not isinstance(results, pl.DataFrame) or "hparams" not in results.columns:
        return None
    return results


def scaled_settings(results) -> set[tuple[str, str]]:
    """(setting, backbone) cells whose rows record a scaled-down schedule (``hparams.scaled``,
    as featcache's probes and fine-tunes write it); empty for tables without ``hparams``."""
    import polars as pl

    from featcache.analysis.tables import load_table, task_expr

    results = _with_hparams(results)
    if results is None:
        return set()
    flag = pl.col("hparams").cast(pl.Utf8).str.json_path_match("$.scaled") == "true"
    sub = results.filter(flag.fill_null(False))
    if sub.height == 0:
        return set()
    sub = load_table(sub.drop("hparams"), percent=False).with_columns(task_expr())
    keys = sub.select((pl.col("kind") + pl.lit(":") + pl.col("task")).alias("setting"), "backbone").unique()
    return set(keys.iter_rows())


def knn_gallery_notes(results) -> list[str]:
    """One note per (backbone, dataset) whose k-NN rows have k at or above the gallery size
    (``hparams.k_effective`` < k, or ``k_covers_gallery``): every gallery item votes there."""
    import polars as pl

    results = _with_hparams(results)
    if results is None or "kind" not in results.columns:
        return []
    hp = pl.col("hparams").cast(pl.Utf8)
    knn = results.filter(pl.col("kind") == "knn").with_columns(
        hp.str.json_path_match("$.k").cast(pl.Int64, strict=False).alias("_k"),
        hp.str.json_path_match("$.k_effective").cast(pl.Int64, strict=False).alias("_keff"),
        hp.str.json_path_match("$.n_gallery").cast(pl.Int64, strict=False).alias("_n"),
        (hp.str.json_path_match("$.k_covers_gallery") == "true").fill_null(False).alias("_cov"),
    )
    bad = knn.filter(pl.col("_cov") | (pl.col("_keff") < pl.col("_k")) | (pl.col("_k") >= pl.col("_n")))
    notes = []
    for (b, ds), g in bad.group_by(["backbone", "dataset"], maintain_order=True):
        ks = ", ".join(str(k) for k in sorted(set(g["_k"].drop_nulls().to_list())))
        notes.append(
            f"k-NN k={ks} for {b} on {ds}: k is at least the gallery size ({g['_n'].max()} item(s)), so "
            "every gallery item votes and those rows are a class-prior vote, not a k-NN classifier"
        )
    return notes


def _finetune_answer(r: Ranking, scaled: AbstractSet[tuple[str, str]]) -> str:
    """The fine-tuning answer: the order's agreement (mean tau), the mean gain per backbone, and
    flags for negative gains and scaled-down schedules with their weight in the headline."""
    import polars as pl

    lf = r.lin_ft
    assert lf is not None  # the caller checked
    if lf.n_tasks == 0:
        text = "Kendall tau-b is undefined on every setting (see the reasons below)."
    else:
        verdict = (
            "mostly keeps the linear-probe order"
            if lf.mean_tau >= 0.7
            else "partly changes the order"
            if lf.mean_tau >= 0.3
            else "changes the order"
        )
        text = (
            f"Mean Kendall tau-b over {lf.n_tasks} setting(s): {lf.mean_tau:.2f}. Fine-tuning {verdict} "
            "of the backbones; see the settings where the lines cross below."
        )
    pb = lf.per_backbone.drop_nulls("mean_gain").sort("backbone")
    if pb.height:
        gains = ", ".join(f"{b} {g:+.3f}" for b, g in pb.select("backbone", "mean_gain").iter_rows())
        text += f" Mean gain of fine-tuning over the linear probe: {gains}."
        neg = pb.filter(pl.col("mean_gain") < 0).height
        if neg:
            who = "every backbone" if neg == pb.height else f"{neg} of {pb.height} backbones"
            text += (
                f" Warning: fine-tuning scores below the linear probe for {who} (negative gain), so this "
                "fine-tuning is not a fair rival of the probe; the order it gives says little."
            )
    ft = {s for s, _ in scaled if s.startswith("finetune:")}
    if ft:
        w = r.weights.filter(pl.col("setting").is_in(sorted(ft)))["weight"].sum() if r.weights is not None else 0.0
        text += (
            f" Warning: the fine-tune schedule of {len(ft)} setting(s) was scaled down from the protocol "
            f"(rows record scaled/scaled_from); those settings weigh {100 * w:.0f}% of the headline z-score."
        )
    return text


def _finetune(
    r: Ranking, tmp: Path, ft_rows, scaled: AbstractSet[tuple[str, str]] = frozenset()
) -> dict[str, Any] | None:
    import polars as pl

    lf = r.lin_ft
    if lf is None:
        return None
    if ft_rows is not None and scaled:
        cells = pl.DataFrame(
            {"_s": [s for s, _ in scaled], "backbone": [b for _, b in scaled], "scaled": [True] * len(scaled)}
        )
        ft_rows = (
            ft_rows.with_columns((pl.col("kind") + pl.lit(":") + pl.col("task")).alias("_s"))
            .join(cells, on=["_s", "backbone"], how="left")
            .with_columns(pl.col("scaled").fill_null(False))
            .drop("_s")
        )
    return {
        "answer": _finetune_answer(r, scaled),
        "per_task": table_cells(lf.per_task, table_id="tau-table"),
        "per_backbone": table_cells(lf.per_backbone),
        "results": table_cells(ft_rows) if ft_rows is not None else None,
        "figures": _figures(
            tmp,
            [
                ("tau_per_task.png", "Kendall tau-b between linear-probe and fine-tune rankings per setting"),
                ("linear_vs_finetune_ranks.png", "Rank of each backbone under linear probing and under fine-tuning"),
                ("linear_vs_finetune.png", "Linear-probe score vs fine-tune score per backbone"),
            ],
        ),
    }


def _certainty(r: Ranking, tmp: Path) -> dict[str, Any]:
    import polars as pl

    b = r.bootstrap.with_columns(
        pl.struct("estimate", "lo", "hi")
        .map_elements(lambda s: _interval_cell(s["estimate"], s["lo"], s["hi"]), return_dtype=pl.Utf8)
        .alias("cell")
    )
    wide = b.pivot(on="aggregation", index="backbone", values="cell")
    order = r.overall["backbone"].to_list()
    wide = wide.join(pl.DataFrame({"backbone": order, "_o": range(len(order))}), on="backbone").sort("_o").drop("_o")
    figs = _figures(
        tmp,
        [
            (
                "overall.png",
                f"Mean z-score with its 95% bootstrap interval resampling {r.resample}: how each backbone's "
                "aggregate moves when the settings are redrawn. Overlap here or not, the first place is judged "
                "on the paired interval of section 1 (the headline's).",
            )
        ],
    )
    return {
        "resample": r.resample,
        "n_boot": r.n_boot,
        "seed": r.seed,
        "intervals": table_cells(wide, table_id="bootstrap-table"),
        "agreement": table_cells(r.agreement),
        "differences": table_cells(r.differences),
        "figures": figs,
    }


def _cost(r: Ranking | None, catalog_df, tmp: Path, provenance=None) -> tuple[dict[str, Any] | None, str]:
    """Throughput (with the threads and load it was measured at, and whether the backbones'
    figures are comparable) and peak memory (provenance) with the store size per backbone (catalog)."""
    import polars as pl

    from featcache.analysis import plots as P

    eff = r.efficiency if r else None
    size = None
    if catalog_df is not None and "bytes" in catalog_df.columns and catalog_df.height:
        size = catalog_df.group_by("backbone").agg((pl.col("bytes").sum() / 2**20).alias("store_mib"))
    if eff is None and size is None:
        return None, "no store catalog or provenance was given (pass --cache to featcache report)."
    if eff is not None:
        table = eff.drop([c for c in eff.columns if c.startswith("peak_mem")])
    else:
        assert size is not None  # one of them (returned above otherwise)
        table = size.select("backbone")
    notes = []
    mem = [c for c in (eff.columns if eff is not None else []) if c.startswith("peak_mem")]
    if eff is not None and mem and eff[mem[0]].drop_nulls().len():
        table = table.join(eff.select("backbone", pl.col(mem[0]).alias("peak_memory_mib")), on="backbone", how="left")
    else:
        notes.append(
            "Peak memory: not recorded for these features (extraction records the CUDA peak on a GPU; "
            "CPU runs record none)."
        )
    if size is not None:
        table = table.join(size, on="backbone", how="left")
    if "zscore" in table.columns:
        table = table.sort("zscore", descending=True, nulls_last=True)
    n_eff = table.height if eff is not None else 0
    if eff is not None and n_eff < 3:
        notes.append(
            f"Spearman rho(throughput, z-score) is not computed from {n_eff} backbone(s): a rank "
            "correlation needs at least 3 (and says little below 5)."
        )
    elif eff is not None and r is not None and r.efficiency_rho is not None:
        notes.append(
            f"Spearman rho(throughput, z-score) = {format_cell(r.efficiency_rho)} "
            "(Battle of the Backbones reports -0.41: faster backbones tend to rank lower)."
        )
    elif eff is None:
        notes.append("Throughput: not recorded (the catalog has no images_per_s).")
    if table.width > 1:
        P.cost_bars(table, tmp / "cost.png")
    figs = _figures(
        tmp,
        [
            (
                "cost.png",
                "Throughput (at the threads and load beside each bar), peak memory and store size per backbone",
            ),
            ("efficiency.png", "Mean z-score vs extraction throughput (threads and load: the table above)"),
        ],
    )
    comparable, same = throughput_note(provenance) if eff is not None and provenance is not None else ("", True)
    if not same:
        notes = [
            n + " The throughputs are not comparable (above), so neither is this correlation."
            if n.startswith("Spearman")
            else n
            for n in notes
        ]
    return {
        "table": table_cells(table, table_id="efficiency-table"),
        "comparable": comparable,
        "notes": notes,
        "figures": figs,
    }, ""


# ----------------------------------------------------------------------------- detail tables


def _reduced(raw, kinds: Sequence[str], seed_reduce: str = "auto"):
    """Seeds reduced per (kind, task, backbone, metric) as the ranking reduces them, with
    Clopper-Pearson intervals where the metric is a proportion with a known n_eval."""
    import polars as pl

    from featcache.analysis.tables import reduce_seeds, with_intervals

    sub = raw.filter(pl.col("kind").is_in(list(kinds)))
    return _task_intervals(with_intervals(reduce_seeds(sub, how=seed_reduce))) if sub.height else None


def _task_intervals(red):
    """``task`` rows (``--metric auto``: copies of each run's declared-metric row) take the
    interval of the row they copy (same setting, backbone and value), so the overview shows it."""
    import polars as pl

    src = (
        red.filter((pl.col("metric") != "task") & pl.col("ci_lo").is_not_null())
        .select("setting", "backbone", "value", pl.col("ci_lo").alias("_lo"), pl.col("ci_hi").alias("_hi"))
        .unique(["setting", "backbone", "value"])
    )
    if src.height == 0 or not (red["metric"] == "task").any():
        return red
    out = red.join(src, on=["setting", "backbone", "value"], how="left")
    is_task = pl.col("metric") == "task"
    return out.with_columns(
        pl.when(is_task).then(pl.col("ci_lo").fill_null(pl.col("_lo"))).otherwise(pl.col("ci_lo")).alias("ci_lo"),
        pl.when(is_task).then(pl.col("ci_hi").fill_null(pl.col("_hi"))).otherwise(pl.col("ci_hi")).alias("ci_hi"),
    ).drop("_lo", "_hi")


def _seed_caption(setting: str, g) -> str:
    """A setting's name with how its seeds were reduced (median of n, or mean +/- std of n)."""
    n = int(g["n_seeds"].max())
    if n <= 1:
        return setting
    if (g["seed_reduce"] == "mean").all():
        return f"{setting} (mean +/- std of {n} seeds, as ELEVATER reports)"
    return f"{setting} (median of {n} seed(s))"


def _with_std(g):
    """``value`` as "mean +/- std" text where the setting's seeds are averaged (ELEVATER)."""
    import polars as pl

    if not (g["seed_reduce"] == "mean").all() or int(g["n_seeds"].max()) <= 1:
        return g
    cell = pl.struct("value", "seed_std").map_elements(
        lambda s: format_cell(s["value"]) + ("" if s["seed_std"] is None else f" +/- {format_cell(s['seed_std'])}"),
        return_dtype=pl.Utf8,
    )
    return g.with_columns(cell.alias("value"))


def _with_interval(g):
    """``value`` as "value [lo, hi]" text (the 95% Clopper-Pearson interval the section
    promises) where a row has one and its value is not already a "mean +/- std" text."""
    import polars as pl

    if g["value"].dtype == pl.Utf8 or "ci_lo" not in g.columns or g["ci_lo"].null_count() == g.height:
        return g
    cell = pl.struct("value", "ci_lo", "ci_hi").map_elements(
        lambda s: (
            _interval_cell(s["value"], s["ci_lo"], s["ci_hi"], "{:.4f}")
            if s["ci_lo"] is not None
            else format_cell(s["value"])
        ),
        return_dtype=pl.Utf8,
    )
    return g.with_columns(cell.alias("value"))


def _seed_statement(r: Ranking) -> str:
    """How the seeds of the ranked settings were reduced, per rule (the report says it)."""
    from featcache.analysis.tables import SEED_RULE_TEXT

    parts = []
    multi = r.seed_rules.filter(r.seed_rules["n_seeds"] > 1)
    for rule in ("median", "mean"):
        n = multi.filter(multi["seed_reduce"] == rule).height
        if n:
            parts.append(f"{SEED_RULE_TEXT[rule]} on {n} setting(s)")
    single = r.seed_rules.height - multi.height
    if single:
        parts.append(f"{single} setting(s) have one seed")
    how = "each setting as its paper reports it" if r.seed_reduce == "auto" else f"--seed-reduce {r.seed_reduce}"
    return f"Seeds ({how}): " + "; ".join(parts) + "."


def _wide(long, metric: str, table_id: str):
    """backbone x setting table of ``metric`` as "value [lo, hi]" strings."""
    import polars as pl

    sub = long.filter(pl.col("metric") == metric)
    if sub.height == 0:
        return None
    cell = pl.struct("value", "ci_lo", "ci_hi").map_elements(
        lambda s: _interval_cell(s["value"], s["ci_lo"], s["ci_hi"]), return_dtype=pl.Utf8
    )
    sub = sub.with_columns(cell.alias("cell"))
    return sub.pivot(on="setting", index="backbone", values="cell").sort("backbone"), table_id


def _pivots(long) -> list[tuple[str, Any]]:
    """Per setting a backbone x metric table; metrics with cut-offs (``recall@5``) become one row
    per backbone and metric family with a column per k when there would be too many columns."""
    import polars as pl

    out = []
    for (setting,), g in long.sort("setting").group_by(["setting"], maintain_order=True):
        metrics = sorted(set(g["metric"].to_list()))
        caption, g = _seed_caption(setting, g), _with_interval(_with_std(g))
        if len(metrics) > _MAX_METRIC_COLUMNS and any("@" in m for m in metrics):
            g = g.with_columns(
                pl.col("metric").str.split("@").list.first().alias("metric family"),
                pl.when(pl.col("metric").str.contains("@"))
                .then(pl.lit("@") + pl.col("metric").str.split("@").list.last())
                .otherwise(pl.lit("full"))
                .alias("k"),
            )
            t = g.pivot(on="k", index=["backbone", "metric family"], values="value").sort(["metric family", "backbone"])
            ks = sorted((c for c in t.columns if c.startswith("@")), key=lambda c: int(c[1:]) if c[1:].isdigit() else 0)
            t = t.select("backbone", "metric family", *(["full"] if "full" in t.columns else []), *ks)
        else:
            t = g.pivot(on="metric", index="backbone", values="value").sort("backbone")
            t = t.select("backbone", *[m for m in metrics if m in t.columns])
        out.append((caption, table_cells(t)))
    return out


def _details(raw, r: Ranking | None, rank_kwargs: Mapping[str, Any], tmp: Path) -> dict[str, Any]:
    import polars as pl

    from featcache.analysis import plots as P

    ctx: dict[str, Any] = {"probe": None, "retrieval": None, "calibration": None, "calibration_absent": ""}
    metric = rank_kwargs.get("metric", "top1")
    seed_reduce = r.seed_reduce if r else rank_kwargs.get("seed_reduce", "auto")
    probe = _reduced(raw, ["probe", "knn"], seed_reduce)
    if probe is not None:
        w = _wide(probe, metric, "probe-wide")
        figs = []
        if w is not None:
            num = (
                probe.filter(pl.col("metric") == metric)
                .pivot(on="setting", index="backbone", values="value")
                .sort("backbone")
            )
            figs = [
                _figure(
                    P.task_scores(num, tmp / "probe_scores.png", metric=metric),
                    f"{metric} per probe/kNN setting and backbone",
                )
            ]
        ctx["probe"] = {
            "metric": metric,
            "wide": table_cells(w[0], table_id=w[1]) if w else None,
            "pivots": _pivots(probe),
            "figures": figs,
        }
    ret = _reduced(raw, ["retrieval"], seed_reduce)
    if ret is not None:
        rm = r.retrieval_metric if r else resolve_retrieval_metric(rank_kwargs.get("retrieval_metric", "auto"), raw)[0]
        shown = retrieval_metric_list(rm)[0]  # several ranked: the overview shows the first
        w = _wide(ret, shown, "retrieval-wide")
        ctx["retrieval"] = {
            "metric": rm,
            "metric_text": retrieval_metric_text(shown),
            "wide": table_cells(w[0], table_id=w[1]) if w else None,
            "pivots": _pivots(ret),
        }
    cal = r.calibration if r else None
    if r and cal is not None:
        cal_cols = [c for c in ("ece", "nll") if c in cal.columns]
        cal = cal.filter(pl.any_horizontal(pl.col(c).is_not_null() for c in cal_cols))  # kNN has no probabilities
        corr = r.calibration_corr.filter(pl.col("n") > 0)  # settings without ece/nll (kNN) say nothing
        ctx["calibration"] = {"table": table_cells(cal, table_id="calibration-table"), "corr": table_cells(corr)}
    else:
        ctx["calibration_absent"] = "the results hold no ece/nll rows." if r else "no ranking was computed."
    return ctx


def _named(table: Any, names: Mapping[str, str]) -> Any:
    """``table`` (a DataFrame or :class:`LoadedResults`) with each backbone of ``names`` renamed
    (a random-init baseline named as such, :func:`~featcache.analysis.rankings.random_baselines`),
    so every table and plot of the report that ranks it says so."""
    import dataclasses

    import polars as pl

    if not names or table is None:
        return table
    if isinstance(table, LoadedResults):
        cov = dataclasses.replace(table.coverage, backbones=[names.get(b, b) for b in table.coverage.backbones])
        return dataclasses.replace(table, rows=_named(table.rows, names), coverage=cov)
    if "backbone" not in table.columns:
        return table
    return table.with_columns(pl.col("backbone").replace(dict(names)))


def _settings_count(r: Ranking, raw) -> tuple[int, str]:
    """The header's count of settings: the ranked ones, as the ranking counts them (a setting is
    a kind:task; kNN's k values pool into one), and a note on the results' settings that are not
    ranked or were pooled."""
    ranked = r.zscores.columns[1:]
    pooled = [p for x in (r.weights["pools"].to_list() if r.weights is not None else []) if x for p in x.split(", ")]
    covered = set(ranked) | set(pooled)
    rest = sorted(
        s for s in set(raw["setting"].to_list()) if s not in covered and not any(c.startswith(s + " [") for c in ranked)
    )
    parts = []
    if pooled:
        parts.append(f"{len(pooled)} kNN k value(s) pooled into their setting")
    if rest:
        parts.append(f"{len(rest)} more in the results not ranked: {', '.join(rest)}")
    note = "ranked settings (kind:task), as the ranking and its plots count them" + (
        f"; {'; '.join(parts)}" if parts else ""
    )
    return len(ranked), note


def _catalog(catalog_df) -> dict[str, Any] | None:
    import polars as pl

    if catalog_df is None:
        return None
    t = catalog_df
    if "bytes" in t.columns:
        t = t.with_columns((pl.col("bytes") / 2**20).alias("size_mib"))
    if "images_per_s" in t.columns and t["images_per_s"].null_count() == t.height:
        t = t.drop("images_per_s", *[c for c in THROUGHPUT_CONDITIONS if c in t.columns])
    elif "images_per_s" in t.columns:  # every throughput with how it was measured, or that it was not recorded
        t = t.with_columns(
            pl.col(c).cast(pl.Utf8).fill_null("not recorded") if c in t.columns else pl.lit("not recorded").alias(c)
            for c in THROUGHPUT_CONDITIONS
        )
    t = t.select([c for c in CATALOG_COLUMNS if c in t.columns])
    return {
        "summary": f"{catalog_df.height} feature array(s) in the store",
        "table": table_cells(t, table_id="catalog-table"),
    }


def _shift(loaded: LoadedResults, shift_splits, tmp: Path) -> dict[str, Any]:
    ctx: dict[str, Any] = {"orig": shift_splits[0], "new": shift_splits[1], "error": None}
    try:
        s = shift(loaded, shift_splits[0], shift_splits[1], tmp / "shift")
    except ResultsError as exc:
        ctx["error"] = str(exc)
        return ctx
    ctx["table"] = table_cells(s["table"], table_id="shift-table")
    ctx["fit"] = table_cells(s["fit"])
    ctx["figures"] = [
        _figure(f, f"Score on {shift_splits[1]} vs {shift_splits[0]} ({f.stem[6:]})")
        for f in s["files"]
        if f.suffix == ".png"
    ]
    return ctx


def _similarity(results, tmp: Path) -> dict[str, Any]:
    """The similarity heatmaps and the near-duplicate audit table, from the results table's
    ``similarity`` and ``audit`` rows (:mod:`featcache.analysis.similarity`), and the layer
    CKA heatmaps (:func:`_layer_cka`)."""
    from featcache.analysis.similarity import audit_table, similarity_heatmap, similarity_matrices

    figs = []
    for i, m in enumerate(similarity_matrices(results)):
        path = similarity_heatmap(m, tmp / f"similarity_{i}.png")
        figs.append(_figure(path, f"{m.title}: {len(m.backbones)} backbones, rows joined by sample id"))
    audit = audit_table(results)
    return {
        "similarity": {"figures": figs} if figs else None,
        "audit": table_cells(audit, table_id="audit-table") if audit is not None else None,
        "audit_collapsed": _collapsed_audits(results) if audit is not None else [],
        **_layer_cka(results, tmp),
    }


def _depth(results, tmp: Path) -> dict[str, Any]:
    """Accuracy against depth per backbone (the layer sweeps' rows, :mod:`featcache.analysis.depth`):
    one figure and the curves' table, or None without sweep rows."""
    from featcache.analysis.depth import depth_curves, depth_plot, depth_table

    curves = depth_curves(results)
    if not curves:
        return {"depth": None}
    path = depth_plot(curves, tmp / "depth_curves.png")
    caption = (
        f"{len(curves)} layer sweep(s): the metric each sweep selected on against the layer it read, "
        "one line per backbone; the ring marks the layer chosen on validation data (never the split plotted)"
    )
    return {
        "depth": {
            "figures": [_figure(path, caption)],
            "table": table_cells(depth_table(curves), table_id="depth-table"),
        }
    }


def _dense(results, tmp: Path) -> dict[str, Any]:
    """The dense results (``featcache dense`` rows, :mod:`featcache.analysis.dense`): every
    backbone's dense metrics per task and a figure of the headline metrics, or None."""
    from featcache.analysis.dense import dense_plot, dense_table

    table = dense_table(results)
    if table is None:
        return {"dense": None}
    path = dense_plot(results, tmp / "dense.png")
    caption = (
        "each dense task's headline metric per backbone (mean over seeds; whiskers: the 95% bootstrap "
        "interval over images where the run recorded one)"
    )
    return {
        "dense": {
            "figures": [_figure(path, caption)] if path is not None else [],
            "table": table_cells(table, table_id="dense-table"),
        }
    }


def _no_ranking(results, exc: Exception) -> str:
    """Why the page has no overall ranking: a table of dense rows only is ranked per dense task
    (the Dense evaluation section), not by the classification metric the ranking reads."""
    from featcache.analysis.dense import DENSE_KIND

    if results is not None and "kind" in results.columns and set(results["kind"].unique()) == {DENSE_KIND}:
        return (
            "the results hold dense rows only: each dense task's backbones are ranked in Dense evaluation "
            "below (featcache rank --metric miou, hbird_miou or rmse ranks across tasks)"
        )
    return str(exc)


def _layer_cka(results, tmp: Path) -> dict[str, Any]:
    """The layer-by-layer CKA heatmaps (``featcache similarity --layers`` rows;
    :mod:`featcache.analysis.layer_cka`)."""
    from featcache.analysis.layer_cka import layer_cka_heatmap, layer_cka_matrices

    figs = []
    for i, m in enumerate(layer_cka_matrices(results)):
        path = layer_cka_heatmap(m, tmp / f"layer_cka_{i}.png")
        how = f"{len(m.layers_a)} x {len(m.layers_b)} layers, rows joined by sample id"
        figs.append(_figure(path, f"{m.title}: {how}" + (f" ({m.route} route)" if m.route else "")))
    return {"layer_cka": {"figures": figs} if figs else None}


def _collapsed_audits(results) -> list[str]:
    """``backbone on dataset/split`` of each audit whose rows record a collapsed feature space
    (hparams ``collapsed``: featcache audit found random pairs as alike as near-copies)."""
    import polars as pl

    if "hparams" not in results.columns:
        return []
    au = results.filter((pl.col("kind") == "audit") & pl.col("hparams").str.contains('"collapsed": true'))
    keys = au.select("backbone", "dataset", "eval_split").unique().sort(["backbone", "dataset", "eval_split"])
    return [f"{b} on {d}/{s}" for b, d, s in keys.rows()]


# ----------------------------------------------------------------------------- entry point


def is_numeric_text(value: Any) -> bool:
    """Whether a table cell reads as numbers ("0.7527", "+0.25 [-0.30, +0.79]", "0.81 +/- 0.02"): the template marks it ``class="n"``, which never wraps, so no number breaks
    mid-value however narrow the window."""
    t = re.sub(r"nan|inf|e(?=[+-]?\d)", "", str(value), flags=re.I)
    return any(ch.isdigit() for ch in t) and not any(ch.isalpha() for ch in t)


def _render(context: dict[str, Any]) -> str:
    from jinja2 import Environment, PackageLoader, StrictUndefined

    env = Environment(
        loader=PackageLoader("featcache.analysis", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.tests["numeric"] = is_numeric_text
    return env.get_template("report.html.j2").render(**context)


def _check_out(out: Path) -> None:
    """A report path that cannot be written: one line before the report is computed."""
    folder = out.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    why = (
        "it is a folder"
        if out.is_dir()
        else f"{folder} is not a folder"
        if not folder.is_dir()
        else f"{folder} is not writable"
        if not os.access(folder, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK))
        else ""
    )
    if why:
        raise ResultsError(f"cannot write the report to {out} ({why}); give --out a writable .html path")


def _write_atomic(out: Path, doc: str) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmpf = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as exc:
        raise ResultsError(
            f"cannot write the report to {out} ({exc.strerror}); give --out a writable .html path"
        ) from None
    os.close(fd)
    try:
        Path(tmpf).write_text(doc, encoding="utf-8")
        os.chmod(tmpf, out.stat().st_mode & 0o777 if out.exists() else 0o644)  # not mkstemp's 0600 (as results.py)
        os.replace(tmpf, out)
    finally:
        if os.path.exists(tmpf):
            os.unlink(tmpf)


def write_report(
    out_html: str | os.PathLike,
    results_df: TableLike | LoadedResults | None = None,
    catalog_df: pl.DataFrame | None = None,
    *,
    external: Sequence = (),
    provenance: pl.DataFrame | None = None,
    shift_splits: tuple[str, str] | None = None,
    title: str = "featcache report",
    rank_kwargs: Mapping[str, Any] | None = None,
) -> Path:
    """Write one self-contained HTML page answering: which backbone (overall ranking with
    intervals, good/better/best), would fine-tuning change it (Kendall tau per task; fine-tune
    rows come in ``results_df`` or via ``external``), how sure (bootstrap, agreement between
    aggregations), what it cost (``provenance``, defaulting to ``catalog_df`` when it has
    images_per_s; store size from ``catalog_df``); then metric pivot tables, calibration, the
    catalog and optionally a test-set shift (``shift_splits=(orig, new)``).

    Ranking problems (e.g. a single backbone) are shown in the page and logged rather than
    aborting the report. Returns the path written (atomically).
    """
    from featcache._version import __version__

    out = Path(out_html)
    if out.suffix.lower() not in (".html", ".htm"):
        raise ResultsError(f"report path {out} should end in .html")
    _check_out(out)
    kw_in = dict(rank_kwargs or {})
    if (
        provenance is None
        and catalog_df is not None
        and "images_per_s" in catalog_df.columns
        and catalog_df["images_per_s"].drop_nulls().len()
    ):
        provenance = catalog_df  # the store catalog carries images_per_s / peak_memory_mb
    load = {k: kw_in.pop(k, None) for k in ("percent", "external_kind", "groups")}
    loaded = load_results(results_df, external, metric=kw_in.pop("metric", "auto"), **load)  # auto: declared metrics
    names = {b: b + BASELINE_SUFFIX for b in random_baselines(loaded.coverage.backbones, catalog_df)}
    loaded, catalog_df, provenance = _named(loaded, names), _named(catalog_df, names), _named(provenance, names)
    raw, coverage = loaded.rows, loaded.coverage
    ctx: dict[str, Any] = {
        "title": title,
        "version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "n_backbones": len(coverage.backbones),
        "n_settings": raw["setting"].n_unique(),
        "settings_note": "",
        "n_datasets": raw["dataset"].n_unique(),
        "n_rows": raw.height,
        "rank_error": None,
        "choose": None,
        "finetune": None,
        "certainty": None,
        "cost": None,
        "finetune_absent": "",
        "cost_absent": "",
        "catalog": _catalog(catalog_df),
        "shift": None,
        "similarity": None,
        "audit": None,
        "depth": None,
        "notes": [],
    }
    kw = {"on_constant": "drop", "n_boot": 1000, "retrieval_metric": "auto", **kw_in}
    with tempfile.TemporaryDirectory(prefix="featcache-report-") as tmpd:
        tmp = Path(tmpd)
        r = None
        try:
            r = rank(loaded, out_dir=tmp, provenance=provenance, **kw)
        except ResultsError as exc:
            ctx["rank_error"] = _no_ranking(loaded.results, exc)
            log.warning("report: no ranking: %s", ctx["rank_error"])
        ft_rows = _reduced(raw, ["finetune"], r.seed_reduce if r else kw.get("seed_reduce", "auto"))
        scaled = {(s, names.get(b, b)) for s, b in scaled_settings(results_df)}
        if r is not None:
            ctx["n_settings"], ctx["settings_note"] = _settings_count(r, raw)
            ctx["choose"] = _choose(r, tmp, scaled, set(names.values()))
            ctx["finetune"] = _finetune(
                r, tmp, ft_rows.drop("setting", "seed_std", "seed_reduce") if ft_rows is not None else None, scaled
            )
            ctx["certainty"] = _certainty(r, tmp)
            ctx["notes"] = [*r.notes, *coverage.lines()]
        ctx["notes"] = [*ctx["notes"], *knn_gallery_notes(results_df)]
        if ctx["finetune"] is None:
            ctx["finetune_absent"] = (
                "the results hold no fine-tune rows (run `featcache finetune`, or pass its table with --external)."
                if ft_rows is None
                else "fine-tune rows are present but no ranking could be computed."
            )
        ctx["cost"], ctx["cost_absent"] = _cost(r, catalog_df, tmp, provenance)
        ctx.update(_details(raw, r, {"metric": loaded.metric, **kw}, tmp))
        if shift_splits is not None:
            ctx["shift"] = _shift(loaded, shift_splits, tmp)
        ctx.update(_similarity(loaded.results, tmp))
        ctx.update(_depth(loaded.results, tmp))
        ctx.update(_dense(loaded.results, tmp))
        doc = _render(ctx)
    _write_atomic(out, doc)
    log.info("report written to %s", out)
    return out
