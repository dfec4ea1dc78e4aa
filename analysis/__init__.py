"""Analysis stage: rank backbones from results tables (never features or images).

Public API (heavy libraries are imported lazily inside the functions)::

    from featcache.analysis import load_results, rank, shift, write_report
    loaded = load_results("results.parquet", external=["finetune.csv"])  # each file read once
    out = rank(loaded, out_dir="analysis-out")  # a Ranking
    out.overall          # per backbone: zscore, mean, avg_rank, group_mean, n_settings
    out.lin_ft.per_task  # Kendall tau-b linear vs fine-tune per task
    shift(loaded, "test", "test_v2")  # the same loaded rows

Lower-level pieces: :mod:`featcache.analysis.tables` (load/merge/coverage),
:mod:`featcache.analysis.stats` (Clopper-Pearson, Kendall tau-b and ranks via scipy, z-scores,
the bootstrap line fit), :mod:`featcache.analysis.rankings`, :mod:`featcache.analysis.shift`,
:mod:`featcache.analysis.plots` (matplotlib ``Figure``, no backend switch),
:mod:`featcache.formatting` (the one table formatter) and
:mod:`featcache.analysis.report` (jinja2 template ``templates/report.html.j2``).
"""

from __future__ import annotations

__all__ = [
    "LoadedResults",
    "Ranking",
    "load_results",
    "load_table",
    "merge_tables",
    "rank",
    "shift",
    "write_report",
]


def __getattr__(name: str):
    if name in ("rank", "shift", "load_results", "LoadedResults", "Ranking"):
        from featcache.analysis import api

        return getattr(api, name)
    if name == "write_report":
        from featcache.analysis.report import write_report

        return write_report
    if name in ("load_table", "merge_tables"):
        from featcache.analysis import tables

        return getattr(tables, name)
    raise AttributeError(f"module 'featcache.analysis' has no attribute {name!r}")
