"""Loading, validating and merging results tables for the analysis stage.

The analysis works on a *long* table with one row per (backbone, task, metric, seed, source):

==========  ========  =====================================================================
column      required  meaning
==========  ========  =====================================================================
backbone    yes       backbone name
dataset     yes       task name
metric      yes       ``top1``, ``map``, ``ece``, ``nll`` ...
value       yes       metric value (accuracies as fractions; ``percent=True`` converts %)
kind        yes       ``probe`` | ``knn`` | ``retrieval`` | ``finetune``
n_eval      no        evaluated samples (enables Clopper-Pearson intervals)
seed        no        repetition seed (default 0); seeds are reduced per setting (reduce_seeds)
group       no        task group (``natural`` / ``specialized`` / ``structured`` ...)
protocol    no        ``full``, ``fewshot:5``, ``vtab1k``... (part of the task name)
shots       no        examples per class (-1: all, 0: zero-shot)
eval_split  no        split evaluated (``test``, ``test_v2``...; part of the task name)
==========  ========  =====================================================================

featcache's own results parquet (see :mod:`featcache.core.results`) already has these columns
except ``group``. Nothing here reads features or images.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.core.metrics import lower_is_better, proportion_metrics
from featcache.core.results import KINDS, read_parquet_checked
from featcache.errors import ResultsError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import polars as pl

    #: a results table: a parquet/CSV path or a polars DataFrame
    TableLike = str | os.PathLike | pl.DataFrame


REQUIRED = ("backbone", "dataset", "metric", "value", "kind")
OPTIONAL_DEFAULTS: dict[str, Any] = {
    "n_eval": None,
    "seed": 0,
    "group": None,
    "protocol": "",
    "shots": -1,
    "eval_split": "",
}
ANALYSIS_COLUMNS = (*REQUIRED, *OPTIONAL_DEFAULTS, "source")
# a metric's direction (lower is better: never converted from percent, negated when ranked) and
# whether it is a binomial proportion (Clopper-Pearson applies when n_eval is known) are fields of
# its registration: featcache.core.metrics.lower_is_better() / proportion_metrics()


def _schema() -> dict[Any, Any]:
    import polars as pl

    return {
        "backbone": pl.Utf8,
        "dataset": pl.Utf8,
        "metric": pl.Utf8,
        "value": pl.Float64,
        "kind": pl.Utf8,
        "n_eval": pl.Int64,
        "seed": pl.Int64,
        "group": pl.Utf8,
        "protocol": pl.Utf8,
        "shots": pl.Int64,
        "eval_split": pl.Utf8,
        "source": pl.Utf8,
    }


def _read_any(path: str | os.PathLike):
    import polars as pl

    p = Path(path)
    if not p.exists():
        raise ResultsError(f"results table {p} does not exist; check the path")
    suffix = p.suffix.lower()
    if suffix == ".parquet":  # one file handle (appends replace the file), checksum verified
        return read_parquet_checked(p)
    if suffix in (".csv", ".tsv"):
        return pl.read_csv(
            p,
            separator="\t" if suffix == ".tsv" else ",",
            null_values=["", "-", "NA", "nan", "NaN"],
            infer_schema_length=10_000,
        )
    raise ResultsError(f"cannot read {p}: use a .parquet, .csv or .tsv table")


def load_table(
    table: TableLike,
    *,
    source: str | None = None,
    kind: str | None = None,
    percent: bool | None = None,
    groups: Mapping[str, str] | None = None,
) -> pl.DataFrame:
    """Read one results table (path or polars DataFrame) into the analysis schema.

    ``kind`` fills a missing ``kind`` column (e.g. ``"finetune"`` for a fine-tuning CSV).
    ``percent=True`` divides higher-is-better metrics by 100; when ``None`` a table whose
    accuracies exceed 1 is an error (the scale must be stated, not guessed). ``groups`` maps
    dataset -> task group and fills/overrides the ``group`` column. Rows with a missing value
    (e.g. "-" in a paper's table) are dropped *and logged*; their count is kept in
    ``df.attrs``-free form by :func:`merge_tables`' coverage report.
    """
    import polars as pl

    if isinstance(table, (str, os.PathLike)):
        src = source or Path(table).name
        df = _read_any(table)
    elif isinstance(table, pl.DataFrame):
        src = source or "table"
        df = table
    else:
        raise ResultsError(f"expected a path or a polars DataFrame, got {type(table).__name__}")
    if kind is not None:
        if kind not in KINDS:
            raise ResultsError(f"kind must be one of {KINDS}, got {kind!r}")
        if "kind" in df.columns:
            df = df.with_columns(pl.col("kind").fill_null(kind))
        else:
            df = df.with_columns(pl.lit(kind).alias("kind"))
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise ResultsError(
            f"{src}: missing column(s) {missing}; an analysis table needs {list(REQUIRED)} "
            f"(optional: {list(OPTIONAL_DEFAULTS)}). Add the column, or pass kind=... "
            "(CLI: --external-kind) for a table of one kind"
        )
    for col, default in OPTIONAL_DEFAULTS.items():
        if col not in df.columns:
            df = df.with_columns(pl.lit(default).alias(col))
    df = df.with_columns(pl.lit(src).alias("source"))
    try:
        df = df.select(list(ANALYSIS_COLUMNS)).cast(_schema())
    except Exception as exc:  # polars raises several cast errors
        raise ResultsError(f"{src}: a column has the wrong type ({exc}); values must be numeric") from exc
    df = df.with_columns(
        pl.col("protocol").fill_null(""),
        pl.col("eval_split").fill_null(""),
        pl.col("shots").fill_null(-1),
        pl.col("seed").fill_null(0),
    )
    for col in ("backbone", "dataset", "metric", "kind"):
        n_null = df[col].null_count()
        if n_null:
            raise ResultsError(f"{src}: {n_null} row(s) have an empty {col!r}; fill it in")
    bad = sorted(set(df["kind"].unique().to_list()) - set(KINDS))
    if bad:
        raise ResultsError(f"{src}: unknown kind(s) {bad}; kind must be one of {KINDS}")
    nulls = df.filter(pl.col("value").is_null() | pl.col("value").is_nan())
    if nulls.height:
        cells = [f"{r['backbone']}/{r['dataset']}/{r['metric']}" for r in nulls.iter_rows(named=True)]
        log.warning("%s: %d missing value(s) dropped: %s", src, nulls.height, ", ".join(cells))
        df = df.filter(pl.col("value").is_not_null() & ~pl.col("value").is_nan())
    hib = ~pl.col("metric").is_in(sorted(lower_is_better()))
    if percent:
        df = df.with_columns(pl.when(hib).then(pl.col("value") / 100).otherwise(pl.col("value")).alias("value"))
    elif df.filter(hib & (pl.col("value") > 1.0)).height:
        if percent is None:
            raise ResultsError(
                f"{src}: some accuracy-like values exceed 1 (percentages?); featcache stores "
                "fractions. Pass percent=True (CLI: --percent) to divide them by 100"
            )
        raise ResultsError(f"{src}: values > 1 with percent=False; accuracies must be fractions")
    if groups:
        df = df.with_columns(
            pl.col("dataset").replace_strict(dict(groups), default=pl.col("group"), return_dtype=pl.Utf8).alias("group")
        )
    return df


@dataclass
class Coverage:
    """What each table holds compared with the union of all tables."""

    backbones: list[str]
    tasks: list[str]
    #: source -> backbones present elsewhere but absent from this source
    missing_backbones: dict[str, list[str]] = field(default_factory=dict)
    #: source -> tasks present elsewhere but absent from this source
    missing_tasks: dict[str, list[str]] = field(default_factory=dict)
    #: (setting, backbone) cells without a value although both exist in the tables
    missing_cells: list[tuple[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "backbones": self.backbones,
            "tasks": self.tasks,
            "missing_backbones": self.missing_backbones,
            "missing_tasks": self.missing_tasks,
            "missing_cells": [list(c) for c in self.missing_cells],
        }

    def lines(self) -> list[str]:
        out = []
        for s, b in self.missing_backbones.items():
            if b:
                out.append(f"{s}: lacks backbone(s) {', '.join(b)}")
        for s, t in self.missing_tasks.items():
            if t:
                out.append(f"{s}: lacks task(s) {', '.join(t)}")
        if self.missing_cells:
            out.append(
                f"{len(self.missing_cells)} (setting, backbone) cell(s) without a value: "
                + ", ".join(f"{s}/{b}" for s, b in self.missing_cells)
            )
        return out


def _protocol(spec: str | None):
    """The registered probe protocol a results row's ``protocol`` names (a fine-tune row names
    its probe pair), or ``None`` (empty, ``knn``, a protocol registered elsewhere)."""
    from featcache.core.protocols import get_protocol
    from featcache.errors import ProtocolError

    try:
        return get_protocol(spec, "probe") if spec else None
    except ProtocolError:
        return None


def protocol_label(spec: str | None) -> str:
    """How a task names protocol ``spec`` after its dataset: the protocol's ``table_label``
    (``""`` for the default ``full``, ``zero-shot``, ELEVATER's name for its column), else the spec."""
    proto = _protocol(spec)
    return (spec or "") if proto is None or proto.table_label is None else proto.table_label


def task_expr():
    """Polars expression naming a task: dataset, plus protocol and eval split when they
    are not the defaults (``cifar10``, ``cifar10 (fewshot:5)``, ``cifar10 @test_v2``); a
    protocol reads as its :func:`protocol_label` (``cifar10 (zero-shot)``)."""
    import polars as pl

    proto = pl.col("protocol").map_elements(protocol_label, return_dtype=pl.Utf8, skip_nulls=True)
    split = pl.col("eval_split")
    return (
        pl.col("dataset")
        + pl.when(proto == "").then(pl.lit("")).otherwise(pl.lit(" (") + proto + pl.lit(")"))
        + pl.when(split.is_in(["", "test"])).then(pl.lit("")).otherwise(pl.lit(" @") + split)
    ).alias("task")


def merge_tables(tables: Sequence) -> tuple[Any, Coverage]:
    """Concatenate loaded tables and report what is missing where (logged, never dropped).

    Returns ``(df, coverage)``; ``df`` gains a ``task`` column and a ``setting`` column
    (``kind:task``).
    """
    import polars as pl

    if not tables:
        raise ResultsError("no results tables given")
    df = pl.concat([t.select(list(ANALYSIS_COLUMNS)) for t in tables], how="vertical")
    if df.height == 0:
        raise ResultsError("the results tables hold no rows with a value")
    df = df.with_columns(task_expr())
    df = df.with_columns((pl.col("kind") + pl.lit(":") + pl.col("task")).alias("setting"))
    # probes also store the VTAB median over seeds as a row with seed -1; where the per-seed rows
    # are present, analysis reduces them itself (and bootstraps seeds), so the aggregate goes
    cell = ["kind", "task", "backbone", "metric"]
    has_seeds = df.filter(pl.col("seed") >= 0).select(cell).unique()
    agg_rows = df.filter(pl.col("seed") < 0).join(has_seeds, on=cell, how="semi")
    if agg_rows.height:
        log.info("ignoring %d seed-aggregate row(s) (seed < 0) whose per-seed rows are present", agg_rows.height)
        df = df.join(agg_rows.select(*cell, "seed").unique(), on=[*cell, "seed"], how="anti")
    backbones = sorted(df["backbone"].unique().to_list())
    tasks = sorted(df["task"].unique().to_list())
    cov = Coverage(backbones=backbones, tasks=tasks)
    sources = df["source"].unique(maintain_order=True).to_list()
    if len(sources) > 1:
        for s in sources:
            sub = df.filter(pl.col("source") == s)
            cov.missing_backbones[s] = sorted(set(backbones) - set(sub["backbone"].to_list()))
            cov.missing_tasks[s] = sorted(set(tasks) - set(sub["task"].to_list()))
    for line in cov.lines():
        log.warning("coverage: %s", line)
    return df, cov


#: what each rule reports, as the report states it
SEED_RULE_TEXT = {
    "median": "median over seeds (VTAB's rule)",
    "mean": "mean +/- sample std over seeds (ELEVATER's tables)",
}
SEED_REDUCTIONS = ("auto", "median", "mean")


def seed_rule(protocol: str | None, how: str = "auto") -> str:
    """``median`` or ``mean`` for a setting of ``protocol``: ``how`` itself unless ``auto``,
    which follows the protocol's paper (its ``seed_rule``: ELEVATER's tables give mean +/- std
    over its three few-shot seeds, Li et al. 2022, Table 2; VTAB the median of 3 runs, also
    featcache's default and the rule of a protocol not registered here)."""
    if how != "auto":
        return how
    proto = _protocol(protocol)
    return "median" if proto is None else proto.seed_rule


def reduce_seeds(df, *, how: str = "median"):
    """One value per (kind, task, setting, backbone, metric): median (VTAB) or mean over seeds;
    ``auto``: each setting by its protocol's paper (:func:`seed_rule`: ELEVATER's mean, else
    the median).

    Keeps ``n_seeds``, ``n_eval`` (smallest over seeds) and ``group``, and adds ``seed_std``
    (sample std over seeds, null for one seed) and ``seed_reduce`` (the rule applied). Two rows
    of the same seed for one cell are an error (the table holds a run twice or mixes options).
    """
    import polars as pl

    if how not in SEED_REDUCTIONS:
        raise ResultsError(f"seed reduction must be one of {', '.join(SEED_REDUCTIONS)}, got {how!r}")
    keys = ["kind", "task", "setting", "backbone", "metric"]
    dup = (
        df.group_by([*keys, "seed"])
        .agg(pl.len().alias("n"), pl.col("source").unique().alias("sources"))
        .filter(pl.col("n") > 1)
    )
    if dup.height:
        ex = dup.row(0, named=True)
        raise ResultsError(
            f"{dup.height} cell(s) hold several rows for one seed, e.g. {ex['backbone']} on "
            f"{ex['setting']} ({ex['metric']}, seed {ex['seed']}, sources {ex['sources']}); "
            "deduplicate the tables or give the runs distinct protocols/seeds"
        )
    protocol = pl.col("protocol").fill_null("")
    rules = {p: seed_rule(p, how) for p in df.select(protocol.unique())["protocol"].to_list()}
    rule = protocol.replace_strict(rules, return_dtype=pl.Utf8)
    out = (
        df.group_by(keys, maintain_order=True)
        .agg(
            pl.col("value").median().alias("_median"),
            pl.col("value").mean().alias("_mean"),
            pl.col("value").std(ddof=1).alias("seed_std"),
            pl.len().alias("n_seeds"),
            pl.col("n_eval").min().alias("n_eval"),
            pl.col("group").drop_nulls().first().alias("group"),
            pl.col("dataset").first().alias("dataset"),
            rule.first().alias("seed_reduce"),
        )
        .sort(keys)
    )
    value = pl.when(pl.col("seed_reduce") == "mean").then(pl.col("_mean")).otherwise(pl.col("_median"))
    return out.with_columns(value.alias("value")).select(
        *keys, "value", "n_seeds", "n_eval", "group", "dataset", "seed_std", "seed_reduce"
    )


def negate_lower_is_better(df, *ranked: str):
    """``df`` with the ``value`` of every lower-is-better metric negated (so that higher is
    better for every metric ranked), when one of the ``ranked`` metrics is lower-is-better
    (:func:`~featcache.core.metrics.lower_is_better`); else ``df`` as it is."""
    import polars as pl

    lower = lower_is_better()
    if not lower.intersection(ranked):
        return df
    negated = pl.when(pl.col("metric").is_in(sorted(lower))).then(-pl.col("value")).otherwise(pl.col("value"))
    return df.with_columns(negated.alias("value"))


def score_matrix(reduced, *, settings: Sequence[str] | None = None, backbones: Sequence[str] | None = None):
    """Backbone x setting matrix (NaN where missing) from a seed-reduced table holding one
    metric per setting. Returns ``(backbones, settings, matrix)``."""
    backbones = list(backbones) if backbones is not None else sorted(reduced["backbone"].unique().to_list())
    settings = list(settings) if settings is not None else sorted(reduced["setting"].unique().to_list())
    bi = {b: i for i, b in enumerate(backbones)}
    si = {s: j for j, s in enumerate(settings)}
    m = np.full((len(backbones), len(settings)), np.nan)
    for b, s, v in zip(reduced["backbone"].to_list(), reduced["setting"].to_list(), reduced["value"].to_list()):
        if b in bi and s in si:
            m[bi[b], si[s]] = v
    return backbones, settings, m


def with_intervals(df, *, alpha: float = 0.05):
    """Add ``ci_lo``/``ci_hi``: Clopper-Pearson intervals for every proportion metric
    (top1, top5, accuracy) with a known ``n_eval``; null elsewhere."""
    import polars as pl

    from featcache.analysis.stats import clopper_pearson

    v = df["value"].to_numpy().astype(float)
    n = df["n_eval"].fill_null(0).to_numpy().astype(float)
    ok = df["metric"].is_in(sorted(proportion_metrics())).to_numpy() & (n > 0) & np.isfinite(v)
    ok &= (v >= 0) & (v <= 1)
    lo = np.full(len(v), np.nan)
    hi = np.full(len(v), np.nan)
    if ok.any():
        lo[ok], hi[ok] = clopper_pearson(v[ok] * n[ok], n[ok], alpha)
    return df.with_columns(pl.Series("ci_lo", lo).fill_nan(None), pl.Series("ci_hi", hi).fill_nan(None))


#: a hyper-parameter sweep recorded as one protocol per value (retrieval's kNN: ``knn-k10``)
_SWEPT_PROTOCOL = r"^knn-k\d+$"


def pool_hyperparameters(df) -> tuple[Any, dict[str, list[str]]]:
    """One setting per task family for ranking: kNN rows of every ``k`` (protocols ``knn-kN``)
    become one ``knn`` setting per (dataset, eval split, backbone, metric, seed) holding the mean
    over the k values, so a sweep over more k values changes no setting's weight in the ranking
    (Battle of the Backbones aggregates per task and setting, not per hyper-parameter value).

    Takes a merged table (:func:`merge_tables`); returns ``(df, pooled)`` where ``pooled`` maps
    each pooled setting to the settings it replaced (empty when nothing was pooled).
    """
    import polars as pl

    swept = (pl.col("kind") == "knn") & pl.col("protocol").str.contains(_SWEPT_PROTOCOL)
    sw = df.filter(swept)
    if sw.height == 0:
        return df, {}
    keys = [c for c in df.columns if c not in ("value", "n_eval", "protocol", "task", "setting", "source")]
    pooled = (
        sw.group_by(keys, maintain_order=True)
        .agg(
            pl.col("value").mean(),
            pl.col("n_eval").min(),
            pl.col("source").first(),
            pl.col("setting").unique().sort().alias("_from"),
        )
        .with_columns(pl.lit("knn").alias("protocol"))
        .with_columns(task_expr())
        .with_columns((pl.col("kind") + pl.lit(":") + pl.col("task")).alias("setting"))
    )
    mapping: dict[str, list[str]] = {}
    for s, frm in zip(pooled["setting"].to_list(), pooled["_from"].to_list()):
        mapping.setdefault(s, [])
        mapping[s] = sorted(set(mapping[s]) | set(frm))
    out = pl.concat([df.filter(~swept), pooled.select(df.columns)], how="vertical_relaxed")
    return out, mapping
