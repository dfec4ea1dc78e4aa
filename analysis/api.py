"""High-level analysis entry points: :func:`rank` and :func:`shift` (tables + plots in a folder).

Both take featcache's tidy results (a polars DataFrame from
:func:`featcache.core.results.read_results`, or a path) and optional external tables (paths or
DataFrames with at least backbone, dataset, metric, value, kind).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcache.analysis.loaded import (
    LoadedResults,
    declares_metrics,
    load_results,
    resolve_metric,
    resolve_retrieval_metric,
    split_retrieval_metrics,
    with_declared_rows,
)

if TYPE_CHECKING:
    import polars as pl

    from featcache.analysis.tables import TableLike
from featcache.analysis.rankings import ItemAccess, LinearVsFinetune
from featcache.analysis.tables import Coverage
from featcache.core.formatting import format_table
from featcache.errors import ResultsError

__all__ = [
    "LoadedResults",
    "Ranking",
    "declares_metrics",
    "load_results",
    "overall_with_intervals",
    "rank",
    "resolve_metric",
    "resolve_retrieval_metric",
    "shift",
    "with_declared_rows",
    "write_tables",
]

log = logging.getLogger(__name__)


def write_tables(tables: Mapping[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """Write every DataFrame as ``NAME.parquet`` and ``NAME.md`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, df in tables.items():
        if df is None:
            continue
        pq = out / f"{name}.parquet"
        md = out / f"{name}.md"
        df.write_parquet(pq)
        md.write_text(f"# {name}\n\n" + format_table(df, "markdown"))
        paths += [pq, md]
    return paths


@dataclass(frozen=True)
class Ranking(ItemAccess):
    """What :func:`rank` found: the tables (polars DataFrames), the linear-vs-fine-tune
    comparison, the calibration and efficiency summaries where their data are present, and
    the notes. ``r.overall`` and ``r["overall"]`` are the same table."""

    coverage: Coverage
    #: per backbone: position, zscore, mean, avg_rank, group_mean, mean[group]..., n_settings
    overall: Any
    #: backbone x setting score matrix, z-scores and ranks of the ranked settings
    scores: Any
    zscores: Any
    ranks: Any
    agreement: Any
    top3: Any
    #: bootstrap intervals of every aggregation and of the pairwise differences
    bootstrap: Any
    differences: Any
    #: every row with its Clopper-Pearson interval where the metric is binomial
    intervals: Any
    weights: Any
    #: per setting: each backbone's score minus the first's, with a paired seed bootstrap interval
    setting_differences: Any
    metric: str
    retrieval_metric: str
    seed_reduce: str
    #: per ranked setting: seed_reduce (the rule applied: median or mean) and n_seeds (most seeds of a backbone)
    seed_rules: Any
    resample: str
    n_boot: int
    seed: int
    notes: list[str] = field(default_factory=list)
    lin_ft: LinearVsFinetune | None = None
    mean_tau: float | None = None
    calibration: Any = None
    calibration_corr: Any = None
    efficiency: Any = None
    efficiency_rho: float | None = None
    efficiency_p: float | None = None
    #: the one verdict on first place (:func:`~featcache.analysis.first_place.first_place`):
    #: paired interval of the first's z-score lead with each setting's test-set noise
    first_place: Any = None
    files: list[Path] = field(default_factory=list)


def rank(
    results: TableLike | LoadedResults | None = None,
    external: Sequence = (),
    out_dir: str | os.PathLike | None = None,
    *,
    metric: str | None = None,
    retrieval_metric: str = "map",
    kinds: Sequence[str] | None = None,
    eval_splits: Sequence[str] | None = None,
    groups: Mapping[str, str] | None = None,
    percent: bool | None = None,
    external_kind: str | None = None,
    seed_reduce: str = "auto",
    ddof: int = 0,
    on_constant: str = "error",
    n_boot: int = 1000,
    seed: int = 0,
    resample: str = "tasks",
    provenance: pl.DataFrame | None = None,
    plots: bool = True,
    progress: bool = False,
) -> Ranking:
    """Which backbone should I choose, and would the answer change if I fine-tuned?

    ``results``: a featcache results table (path or DataFrame) or a :class:`LoadedResults`
    (:func:`load_results`; then ``external``, ``percent``, ``external_kind`` and ``groups``
    were given there). Loads and merges the tables (coverage gaps are listed and logged), reduces seeds
    (median), ranks backbones across settings (``eval_splits`` restricts the eval splits used;
    by default every split is its own setting, e.g. ``probe:digits @test_v2``) (z-score, mean, average rank, group mean),
    bootstraps the aggregates and pairwise differences, compares linear probing with
    fine-tuning when both kinds are present, and summarises calibration (ece/nll rows) and
    efficiency (``provenance``: DataFrame with backbone, images_per_s[, peak_mem*]).

    With ``out_dir``, writes every table as parquet + Markdown, the plots as PNG and
    ``summary.json``. Returns a :class:`Ranking` (``files``: what was written).

    ``seed_reduce``: ``auto`` reduces each setting's seeds as its paper does (ELEVATER's
    protocols: mean, shown with the std; the rest: the median, VTAB's rule), or ``median`` /
    ``mean`` for every setting. ``retrieval_metric="auto"`` ranks retrieval on Battle of the
    Backbones' ``map_bob`` (revisitop's trapezoidal AP) where every retrieval setting records
    it, else on ``map`` (the scikit-learn-style AP). Several comma-separated retrieval metrics
    (``"map_bob,mrr_bob,recall@5"``) make each (dataset, metric) its own setting, z-scored on
    its own and averaged with the rest (Battle of the Backbones' ranking; a note names them).

    ``metric`` (default ``top1``, or the metric :class:`LoadedResults` were loaded for):
    ``"auto"`` ranks each task on its declared metric (``hparams.task_metric``, e.g.
    mean-per-class for Aircraft; rows without one count as top-1) when the results record
    one, else on top-1; ``"task"`` always does; any other name ranks every task on it.
    """
    from featcache.analysis import rankings

    loaded = _loaded(results, external, metric, groups=groups, percent=percent, external_kind=external_kind)
    metric, groups = loaded.metric, loaded.groups
    raw = _restrict(loaded.rows, eval_splits)
    retrieval_metric, why = resolve_retrieval_metric(retrieval_metric, raw)
    raw, several = split_retrieval_metrics(raw, retrieval_metric)  # map_bob,mrr_bob: a setting per metric
    reduced = _reduce(raw, seed_reduce)
    coverage = replace(loaded.coverage)  # missing cells are this ranking's, not the loaded inputs'
    ranked_raw, ranked, weights = _pooled(raw, reduced, seed_reduce)
    sm = rankings.select_settings(ranked, metric=metric, retrieval_metric=retrieval_metric, kinds=kinds, groups=groups)
    _record_missing_cells(coverage, sm)
    agg = rankings.aggregate(sm, ddof=ddof, on_constant=on_constant)
    notes = _rank_notes(agg, why, weights, several)
    rules = _seed_rules(ranked, agg["matrix"], metric, retrieval_metric)
    ranked_rows = _ranked_rows(ranked_raw, agg["matrix"], metric, retrieval_metric)
    boot, differences = _bootstrapped(
        agg, ranked_rows, rules, resample=resample, n_boot=n_boot, seed=seed, ddof=ddof, progress=progress
    )
    out = _rank_result(raw, coverage, agg, boot, notes)
    out["setting_differences"] = differences
    out["first_place"] = _first_place(agg, ranked_rows, raw, n_boot=n_boot, seed=seed, ddof=ddof)
    out.update(
        weights=_setting_weights(agg["matrix"], weights),
        metric=metric,
        retrieval_metric=retrieval_metric,
        seed_reduce=seed_reduce,
        seed_rules=rules,
        resample=resample,
        n_boot=n_boot,
        seed=seed,
    )
    out.update(_secondary(reduced, agg, notes, metric=metric, ddof=ddof, provenance=provenance))
    r = Ranking(**out)
    for n in notes:
        log.info("rank: %s", n)
    if out_dir is not None:
        options = _rank_options(r, ddof=ddof, on_constant=on_constant)
        r = replace(r, files=_write_rank_outputs(r, Path(out_dir), options, plots=plots))
    return r


def _rank_notes(agg, why: str | None, pooled: dict[str, list[str]], several: str | None = None) -> list[str]:
    """What the ranking says beside its tables: the aggregation's notes, the dropped settings,
    why the retrieval metric was chosen, which retrieval metrics entered (``several``) and which
    settings pool several k values."""
    notes = list(agg["notes"]) + [f"dropped setting {k}: {v}" for k, v in agg["dropped"].items()]
    notes += [n for n in (why, several) if n]
    notes += [f"{s} is one setting: the mean over {len(frm)} k values ({', '.join(frm)})" for s, frm in pooled.items()]
    return notes


def _bootstrapped(agg, ranked_rows, rules, *, resample: str, n_boot: int, seed: int, ddof: int, progress: bool):
    """The bootstrap of the aggregates and pairwise differences, and each setting's paired seed
    bootstrap of every backbone minus the first; both apply each setting's seed rule."""
    from featcache.analysis import rankings

    seed_rule = dict(zip(rules["setting"].to_list(), rules["seed_reduce"].to_list()))
    boot = rankings.bootstrap_aggregate(
        agg["matrix"],
        reduced=ranked_rows,
        resample=resample,
        n_boot=n_boot,
        seed=seed,
        ddof=ddof,
        seed_reduce=seed_rule,
        progress=progress,
    )
    differences = rankings.setting_differences(
        ranked_rows, agg["matrix"], agg["overall"]["backbone"][0], rules=seed_rule, n_boot=n_boot, seed=seed
    )
    return boot, differences


def _first_place(agg, ranked_rows, raw, *, n_boot: int, seed: int, ddof: int):
    """The verdict on first place with test-set noise: each cell's ``n_eval`` where its ranked
    rows are proportions (top-1 ..., also under ``--metric auto``, whose ``task`` rows are
    copies of the declared metric's rows in ``raw``; the mean over seeds) and each setting's
    dataset from the ranked rows."""
    import numpy as np
    import polars as pl

    from featcache.analysis.first_place import first_place
    from featcache.core.metrics import proportion_metrics

    props = list(proportion_metrics())
    sm = agg["matrix"]
    n = np.full(sm.values.shape, np.nan)
    key = ["setting", "backbone", "seed", "value"]
    prop = raw.filter(pl.col("metric").is_in(props) & pl.col("n_eval").is_not_null()).select(*key, "n_eval").unique(key)
    is_prop = pl.col("metric").is_in(props)
    is_knn = (pl.col("kind") == "knn") & (pl.col("metric") == "task")  # k-NN declares top-1
    own = ranked_rows.filter((is_prop | is_knn) & pl.col("n_eval").is_not_null())
    if prop.height or own.height:  # own: proportions ranked as such (also k-NN's pooled k values)
        cells = (
            pl.concat([ranked_rows.select(key).join(prop, on=key, how="inner"), own.select(*key, "n_eval")])
            .unique(key)
            .group_by("backbone", "setting")
            .agg(pl.col("n_eval").mean())
        )
        bi = {b: i for i, b in enumerate(sm.backbones)}
        si = {s: j for j, s in enumerate(sm.settings)}
        for b, s, v in cells.iter_rows():
            if b in bi and s in si:
                n[bi[b], si[s]] = v
    ds = dict(ranked_rows.group_by("setting").agg(pl.col("dataset").first()).iter_rows())
    order = agg["overall"]["backbone"].to_list()
    return first_place(
        sm.values, sm.backbones, order, n_eval=n, datasets=[ds.get(s, s) for s in sm.settings],
        n_boot=n_boot, seed=seed, ddof=ddof,
    )  # fmt: skip


def _rank_options(r: Ranking, *, ddof: int, on_constant: str) -> dict[str, Any]:
    """The options a ranking was made with, as ``summary.json`` records them."""
    return {
        "metric": r.metric,
        "retrieval_metric": r.retrieval_metric,
        "seed_reduce": r.seed_reduce,
        "ddof": ddof,
        "n_boot": r.n_boot,
        "seed": r.seed,
        "resample": r.resample,
        "on_constant": on_constant,
    }


def _loaded(results, external, metric: str | None, **load) -> LoadedResults:
    """``results`` loaded (once) for ``metric``: a :class:`LoadedResults` as given (loading
    options belong to :func:`load_results`), anything else through :func:`load_results`."""
    if not isinstance(results, LoadedResults):
        return load_results(results, external, metric=metric or "top1", **load)
    given = [k for k, v in {"external": external, **load}.items() if v and v != getattr(results, k, None)]
    if given:
        raise ResultsError(
            f"{', '.join(given)} are options of load_results(); pass them there, not with loaded results"
        )
    return results.for_metric(metric or results.metric)


def _restrict(raw, eval_splits):
    """Keep ``eval_splits`` (rows without a split are kept: typical of external tables)."""
    import polars as pl

    if not eval_splits:
        return raw
    keep = pl.col("eval_split").is_in(list(eval_splits)) | (pl.col("eval_split") == "")
    dropped = raw.filter(~keep)
    if dropped.height:
        log.info(
            "rank: ignoring %d row(s) on eval split(s) %s",
            dropped.height,
            sorted(set(dropped["eval_split"].to_list())),
        )
    raw = raw.filter(keep)
    if raw.height == 0:
        raise ResultsError(f"no rows on eval split(s) {list(eval_splits)}")
    return raw


def _seed_rules(ranked, sm, metric: str, retrieval_metric: str):
    """setting, seed_reduce (the rule applied) and n_seeds (most of any backbone) per ranked setting."""
    import polars as pl

    is_ret = pl.col("kind") == "retrieval"
    want = (is_ret & (pl.col("metric") == retrieval_metric)) | (~is_ret & (pl.col("metric") == metric))
    rules = (
        ranked.filter(want & pl.col("setting").is_in(sm.settings))
        .group_by("setting")
        .agg(pl.col("seed_reduce").first(), pl.col("n_seeds").max())
    )
    order = pl.DataFrame({"setting": sm.settings, "_o": range(len(sm.settings))})
    return order.join(rules, on="setting", how="left").sort("_o").drop("_o")


def _reduce(raw, seed_reduce: str):
    from featcache.analysis.tables import reduce_seeds

    return reduce_seeds(raw, how=seed_reduce)


def _pooled(raw, reduced, seed_reduce: str):
    """The rows the ranking uses: kNN's k values pooled into one setting per task
    (:func:`~featcache.analysis.tables.pool_hyperparameters`). Returns ``(raw, reduced, pooled)``."""
    from featcache.analysis.tables import pool_hyperparameters, reduce_seeds

    ranked_raw, pooled = pool_hyperparameters(raw)
    if not pooled:
        return raw, reduced, pooled
    return ranked_raw, reduce_seeds(ranked_raw, how=seed_reduce), pooled


def _setting_weights(sm, pooled: dict[str, list[str]]):
    """Each ranked setting's weight in the mean z-score (1/T each) and what it stands for."""
    import polars as pl

    T = len(sm.settings)
    return pl.DataFrame(
        {
            "setting": sm.settings,
            "weight": [1.0 / T] * T,
            "pools": [", ".join(pooled.get(s, [])) or None for s in sm.settings],
        },
        schema={"setting": pl.Utf8, "weight": pl.Float64, "pools": pl.Utf8},
    )


def _record_missing_cells(coverage, sm) -> None:
    """(setting, backbone) cells without a value of the ranked metric: listed, never hidden."""
    import numpy as np

    coverage.missing_cells = [
        (s, b) for j, s in enumerate(sm.settings) for i, b in enumerate(sm.backbones) if np.isnan(sm.values[i, j])
    ]
    if coverage.missing_cells:
        log.warning("coverage: %s", coverage.lines()[-1])


def _ranked_rows(raw, sm_kept, metric: str, retrieval_metric: str):
    """The unreduced rows of the ranked metric in the kept settings, lower-is-better metrics
    negated (:func:`~featcache.analysis.tables.negate_lower_is_better`, as the ranking does;
    for the seed bootstrap)."""
    import polars as pl

    from featcache.analysis.tables import negate_lower_is_better

    is_ret = pl.col("kind") == "retrieval"
    ranked = raw.filter(
        pl.col("setting").is_in(sm_kept.settings)
        & ((is_ret & (pl.col("metric") == retrieval_metric)) | (~is_ret & (pl.col("metric") == metric)))
    )
    return negate_lower_is_better(ranked, metric, retrieval_metric)


def _rank_result(raw, coverage, agg, boot, notes) -> dict[str, Any]:
    from featcache.analysis.tables import with_intervals

    return {
        "coverage": coverage,
        "overall": agg["overall"],
        "scores": agg["matrix"].frame(),
        "zscores": agg["zscores"],
        "ranks": agg["ranks"],
        "agreement": agg["agreement"].join(boot["agreement"], on=["a", "b"], how="left"),
        "top3": agg["top3"],
        "bootstrap": boot["scores"],
        "differences": boot["differences"],
        "intervals": with_intervals(raw).select(
            "source", "kind", "task", "backbone", "metric", "seed", "value", "n_eval", "ci_lo", "ci_hi"
        ),
        "notes": notes,
    }


def _secondary(reduced, agg, notes, *, metric: str, ddof: int, provenance) -> dict[str, Any]:
    """Linear vs fine-tune, calibration and efficiency, each where its data are present (a note
    says why one is skipped)."""
    from featcache.analysis import rankings
    from featcache.core.metrics import lower_is_better

    out: dict[str, Any] = {}
    if {"probe", "finetune"} <= set(reduced["kind"].to_list()):
        lf = rankings.linear_vs_finetune(reduced, metric=metric, ddof=ddof)
        out["lin_ft"], out["mean_tau"] = lf, lf.mean_tau
    else:
        notes.append(
            "linear vs fine-tune skipped: needs both probe and finetune rows (pass the fine-tuning table with --external)"
        )
    try:
        acc_metric = metric if metric not in lower_is_better() and metric != "task" else "top1"
        out["calibration"], out["calibration_corr"] = rankings.calibration_summary(reduced, accuracy_metric=acc_metric)
    except ResultsError as exc:
        notes.append(f"calibration skipped: {exc}")
    if provenance is not None:
        out["efficiency"], out["efficiency_rho"], out["efficiency_p"] = rankings.efficiency_summary(
            provenance, agg["overall"]
        )
    return out


#: the tables of a :class:`Ranking` written by :func:`rank` with ``out_dir``
TABLES = (
    "overall",
    "scores",
    "zscores",
    "ranks",
    "agreement",
    "top3",
    "weights",
    "bootstrap",
    "differences",
    "setting_differences",
    "intervals",
    "calibration",
    "calibration_corr",
    "efficiency",
)


def _write_rank_outputs(r: Ranking, outp: Path, options: dict[str, Any], *, plots: bool) -> list[Path]:
    """Every table as parquet + Markdown, the plots as PNG and ``summary.json``."""
    tbls = {k: getattr(r, k) for k in TABLES}
    if r.first_place is not None:
        tbls["first_place"] = r.first_place.table
    lf = r.lin_ft
    if lf is not None:
        tbls["lin_ft_per_task"] = lf.per_task
        tbls["lin_ft_per_backbone"] = lf.per_backbone
        tbls["lin_ft_pairs"] = lf.pairs
    files = write_tables(tbls, outp)
    if plots:
        files += rank_plots(r, outp)
    summary = {
        "coverage": r.coverage.as_dict(),
        "mean_tau": r.mean_tau,
        "n_tau_tasks": lf.n_tasks if lf else 0,
        "lin_ft_missing": lf.missing if lf else None,
        "top3_overall": r.top3.row(-1, named=True),
        "first_place": _first_place_summary(r.first_place),
        "notes": r.notes,
        "options": options,
    }
    (outp / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return [*files, outp / "summary.json"]


def _first_place_summary(fp) -> dict[str, Any] | None:
    """summary.json's record of the verdict on first place."""
    if fp is None:
        return None
    return {
        "best": fp.best,
        "runner_up": fp.runner_up,
        "separated": fp.separated,
        "covers": fp.covers,
        "n_datasets": fp.n_datasets,
        "level": fp.level,
    }


def overall_with_intervals(r: Ranking) -> pl.DataFrame:
    """The overall table with the z-score's bootstrap interval (``zscore_lo``, ``zscore_hi``)."""
    import polars as pl

    boot = r.bootstrap.filter(pl.col("aggregation") == "zscore").select(
        "backbone", pl.col("lo").alias("zscore_lo"), pl.col("hi").alias("zscore_hi")
    )
    return r.overall.join(boot, on="backbone", how="left").sort("position")


def rank_plots(r: Ranking, outp: Path) -> list[Path]:
    """The ranking's plots (PNG) in ``outp``; each only where its data are present."""
    from featcache.analysis import plots as P

    files = [
        P.overall_intervals(
            overall_with_intervals(r), outp / "overall.png", interval=f"95% bootstrap interval, resampling {r.resample}"
        ),
        P.zscore_heatmap(r.zscores, outp / "zscore_heatmap.png", order=r.overall["backbone"].to_list()),
    ]
    lf = r.lin_ft
    if lf is not None and lf.per_task.height:
        files.append(P.tau_bars(lf.per_task, outp / "tau_per_task.png"))
        if lf.pairs.height:
            files.append(P.linear_vs_finetune_ranks(lf.pairs, outp / "linear_vs_finetune_ranks.png"))
            files.append(P.linear_vs_finetune_scatter(lf.pairs, outp / "linear_vs_finetune.png"))
    eff = r.efficiency
    if eff is not None and eff.drop_nulls(["images_per_s", "zscore"]).height:
        files.append(P.efficiency_scatter(eff, outp / "efficiency.png"))
    return files


def shift(
    results: TableLike | LoadedResults,
    orig: str,
    new: str,
    out_dir: str | os.PathLike | None = None,
    *,
    external: Sequence = (),
    metric: str = "top1",
    kind: str = "probe",
    n_boot: int = 100_000,
    seed: int = 0,
    percent: bool | None = None,
    plots: bool = True,
    progress: bool = False,
) -> dict[str, Any]:
    """Recht-style test-set shift between eval splits ``orig`` and ``new`` (see
    :mod:`featcache.analysis.shift`); ``results`` as for :func:`rank`. With ``out_dir`` writes ``shift.{parquet,md}``,
    ``shift_fit.{parquet,md}`` and one ``shift_<dataset>.png`` per dataset."""
    import polars as pl

    from featcache.analysis.shift import shift_analysis

    if isinstance(results, LoadedResults):
        if external or percent is not None:
            raise ResultsError("external and percent are options of load_results(); pass them there")
        raw = results.rows
    else:
        raw = load_results(results, external, metric="top1", percent=percent).rows
    res = shift_analysis(raw, orig, new, metric=metric, kind=kind, n_boot=n_boot, seed=seed, progress=progress)
    files: list[Path] = []
    if out_dir is not None:
        from featcache.analysis import plots as P

        outp = Path(out_dir)
        files += write_tables({"shift": res["table"], "shift_fit": res["fit"]}, outp)
        if plots:
            for (ds, proto), g in res["table"].group_by(["dataset", "protocol"], maintain_order=True):
                fr = res["fit"].filter((pl.col("dataset") == ds) & (pl.col("protocol") == proto))
                row = fr.row(0, named=True) if fr.height else None
                safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{ds}_{proto}".strip("_"))
                files.append(P.shift_scatter(g, row, outp / f"shift_{safe}.png", title=f"{ds}: {orig} -> {new}"))
        (outp / "shift_missing.json").write_text(json.dumps(res["missing"], indent=2))
        files.append(outp / "shift_missing.json")
    res["files"] = files
    return res
