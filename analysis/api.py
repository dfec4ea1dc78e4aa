"""High-level analysis entry points: :func:`rank` and :func:`shift` (tables + plots in a folder).

Both take featcache's tidy results (a polars DataFrame from
:func:`featcache.results.read_results`, or a path) and optional external tables (paths or
DataFrames with at least backbone, dataset, metric, value, kind).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from featcache.errors import ResultsError

log = logging.getLogger(__name__)


def _as_tables(results, external, *, percent, external_kind, groups) -> list:
    import polars as pl

    from featcache.analysis.tables import load_table

    tables = []
    if results is not None:
        if isinstance(results, (str, os.PathLike)):
            from featcache.results import read_results

            tables.append(load_table(read_results(results), source=Path(results).name, groups=groups))
        elif isinstance(results, pl.DataFrame):
            tables.append(load_table(results, source="results", groups=groups))
        else:
            raise ResultsError(f"results must be a path or a polars DataFrame, got {type(results).__name__}")
    for i, ext in enumerate(external or []):
        src = Path(ext).name if isinstance(ext, (str, os.PathLike)) else f"external[{i}]"
        tables.append(load_table(ext, source=src, kind=external_kind, percent=percent, groups=groups))
    if not tables:
        raise ResultsError("nothing to analyse: pass a results table and/or --external tables")
    return tables


def markdown_table(df, *, floatfmt: str = "{:.4g}", max_rows: int | None = None) -> str:
    """A GitHub-flavoured Markdown table of a polars DataFrame."""
    def fmt(v):
        if v is None:
            return ""
        if isinstance(v, float):
            return "nan" if v != v else floatfmt.format(v)
        if isinstance(v, (list, dict)):
            return json.dumps(v)
        return str(v).replace("|", "\\|")

    rows = df.rows() if max_rows is None else df.head(max_rows).rows()
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


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
        md.write_text(f"# {name}\n\n" + markdown_table(df))
        paths += [pq, md]
    return paths


def rank(
    results=None,
    external: Sequence = (),
    out_dir: str | os.PathLike | None = None,
    *,
    metric: str = "top1",
    retrieval_metric: str = "map",
    kinds: Sequence[str] | None = None,
    eval_splits: Sequence[str] | None = None,
    groups: Mapping[str, str] | None = None,
    percent: bool | None = None,
    external_kind: str | None = None,
    seed_reduce: str = "median",
    ddof: int = 0,
    on_constant: str = "error",
    n_boot: int = 1000,
    seed: int = 0,
    resample: str = "tasks",
    provenance=None,
    plots: bool = True,
) -> dict[str, Any]:
    """Which backbone should I choose, and would the answer change if I fine-tuned?

    Loads and merges the tables (coverage gaps are listed and logged), reduces seeds
    (median), ranks backbones across settings (``eval_splits`` restricts the eval splits used;
    by default every split is its own setting, e.g. ``probe:digits @test_v2``) (z-score, mean, average rank, group mean),
    bootstraps the aggregates and pairwise differences, compares linear probing with
    fine-tuning when both kinds are present, and summarises calibration (ece/nll rows) and
    efficiency (``provenance``: DataFrame with backbone, images_per_s[, peak_mem*]).

    With ``out_dir``, writes every table as parquet + Markdown, the plots as PNG and
    ``summary.json``. Returns a dict with the tables, ``coverage``, ``mean_tau``, ``notes``
    and ``files``.
    """
    import numpy as np
    import polars as pl

    from featcache.analysis import rankings
    from featcache.analysis.tables import merge_tables, reduce_seeds, with_intervals

    tables = _as_tables(results, external, percent=percent, external_kind=external_kind, groups=groups)
    raw, coverage = merge_tables(tables)
    if eval_splits:
        # rows without an eval split (typical for external tables) are kept
        keep = pl.col("eval_split").is_in(list(eval_splits)) | (pl.col("eval_split") == "")
        dropped = raw.filter(~keep)
        if dropped.height:
            log.info("rank: ignoring %d row(s) on eval split(s) %s", dropped.height, sorted(set(dropped["eval_split"].to_list())))
        raw = raw.filter(keep)
        if raw.height == 0:
            raise ResultsError(f"no rows on eval split(s) {list(eval_splits)}")
    reduced = reduce_seeds(raw, how=seed_reduce)
    sm = rankings.select_settings(reduced, metric=metric, retrieval_metric=retrieval_metric, kinds=kinds, groups=groups)
    # (setting, backbone) cells without a value of the ranked metric: listed, never hidden
    coverage.missing_cells = [
        (s, b) for j, s in enumerate(sm.settings) for i, b in enumerate(sm.backbones) if np.isnan(sm.values[i, j])
    ]
    if coverage.missing_cells:
        log.warning("coverage: %s", coverage.lines()[-1])
    agg = rankings.aggregate(sm, ddof=ddof, on_constant=on_constant)
    notes = list(agg["notes"]) + [f"dropped setting {k}: {v}" for k, v in agg["dropped"].items()]
    sm_kept = agg["matrix"]
    ranked_raw = raw.filter(
        pl.col("setting").is_in(sm_kept.settings)
        & (((pl.col("kind") == "retrieval") & (pl.col("metric") == retrieval_metric)) | ((pl.col("kind") != "retrieval") & (pl.col("metric") == metric)))
    )
    from featcache.analysis.tables import LOWER_IS_BETTER

    if metric in LOWER_IS_BETTER or retrieval_metric in LOWER_IS_BETTER:  # as in select_settings
        ranked_raw = ranked_raw.with_columns(
            pl.when(pl.col("metric").is_in(list(LOWER_IS_BETTER))).then(-pl.col("value")).otherwise(pl.col("value")).alias("value")
        )
    boot = rankings.bootstrap_aggregate(
        sm_kept, reduced=ranked_raw, resample=resample, n_boot=n_boot, seed=seed, ddof=ddof, seed_reduce=seed_reduce
    )
    out: dict[str, Any] = {
        "coverage": coverage,
        "overall": agg["overall"],
        "scores": sm_kept.frame(),
        "zscores": agg["zscores"],
        "ranks": agg["ranks"],
        "agreement": agg["agreement"].join(boot["agreement"], on=["a", "b"], how="left"),
        "top3": agg["top3"],
        "bootstrap": boot["scores"],
        "differences": boot["differences"],
        "intervals": with_intervals(raw).select(
            "source", "kind", "task", "backbone", "metric", "seed", "value", "n_eval", "ci_lo", "ci_hi"
        ),
        "lin_ft": None,
        "mean_tau": None,
        "notes": notes,
        "resample": resample,
    }
    kinds_present = set(reduced["kind"].to_list())
    if {"probe", "finetune"} <= kinds_present:
        lf = rankings.linear_vs_finetune(reduced, metric=metric, ddof=ddof)
        out["lin_ft"] = lf
        out["mean_tau"] = lf["mean_tau"]
    else:
        notes.append("linear vs fine-tune skipped: needs both probe and finetune rows (pass the fine-tuning table with --external)")
    try:
        acc_metric = metric if metric not in LOWER_IS_BETTER else "top1"
        cal, corr = rankings.calibration_summary(reduced, accuracy_metric=acc_metric)
        out["calibration"], out["calibration_corr"] = cal, corr
    except ResultsError as exc:
        out["calibration"] = out["calibration_corr"] = None
        notes.append(f"calibration skipped: {exc}")
    if provenance is not None:
        eff, rho, p = rankings.efficiency_summary(provenance, agg["overall"])
        out["efficiency"], out["efficiency_rho"], out["efficiency_p"] = eff, rho, p
    else:
        out["efficiency"] = None
    for n in notes:
        log.info("rank: %s", n)
    files: list[Path] = []
    if out_dir is not None:
        from featcache.analysis import plots as P

        outp = Path(out_dir)
        tbls = {k: out[k] for k in ("overall", "scores", "zscores", "ranks", "agreement", "top3", "bootstrap", "differences", "intervals", "calibration", "calibration_corr", "efficiency")}
        if out["lin_ft"] is not None:
            tbls["lin_ft_per_task"] = out["lin_ft"]["per_task"]
            tbls["lin_ft_per_backbone"] = out["lin_ft"]["per_backbone"]
            tbls["lin_ft_pairs"] = out["lin_ft"]["pairs"]
        files += write_tables(tbls, outp)
        if plots:
            files.append(P.zscore_heatmap(agg["zscores"], outp / "zscore_heatmap.png", order=agg["overall"]["backbone"].to_list()))
            if out["lin_ft"] is not None and out["lin_ft"]["per_task"].height:
                files.append(P.tau_bars(out["lin_ft"]["per_task"], outp / "tau_per_task.png"))
                files.append(P.linear_vs_finetune_scatter(out["lin_ft"]["pairs"], outp / "linear_vs_finetune.png"))
            if out["efficiency"] is not None and out["efficiency"].drop_nulls(["images_per_s", "zscore"]).height:
                files.append(P.efficiency_scatter(out["efficiency"], outp / "efficiency.png"))
        summary = {
            "coverage": coverage.as_dict(),
            "mean_tau": out["mean_tau"],
            "n_tau_tasks": out["lin_ft"]["n_tasks"] if out["lin_ft"] else 0,
            "lin_ft_missing": out["lin_ft"]["missing"] if out["lin_ft"] else None,
            "top3_overall": out["top3"].row(-1, named=True),
            "notes": notes,
            "options": {
                "metric": metric, "retrieval_metric": retrieval_metric, "seed_reduce": seed_reduce,
                "ddof": ddof, "n_boot": n_boot, "seed": seed, "resample": resample, "on_constant": on_constant,
            },
        }
        (outp / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        files.append(outp / "summary.json")
    out["files"] = files
    return out


def shift(
    results,
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
) -> dict[str, Any]:
    """Recht-style test-set shift between eval splits ``orig`` and ``new`` (see
    :mod:`featcache.analysis.shift`). With ``out_dir`` writes ``shift.{parquet,md}``,
    ``shift_fit.{parquet,md}`` and one ``shift_<dataset>.png`` per dataset."""
    import polars as pl

    from featcache.analysis.shift import shift_analysis
    from featcache.analysis.tables import merge_tables

    tables = _as_tables(results, external, percent=percent, external_kind=None, groups=None)
    raw, _ = merge_tables(tables)
    res = shift_analysis(raw, orig, new, metric=metric, kind=kind, n_boot=n_boot, seed=seed)
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
