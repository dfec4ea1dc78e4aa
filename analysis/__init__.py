"""Analysis stage: rank backbones from results tables (never features or images).

Public API (heavy libraries are imported lazily inside the functions)::

    from featcache.analysis import rank, shift, write_report
    out = rank(results_df, external=["finetune.csv"], out_dir="analysis-out")
    out["overall"]          # per backbone: zscore, mean, avg_rank, group_mean, n_settings
    out["lin_ft"]["per_task"]  # Kendall tau-b linear vs fine-tune per task

Lower-level pieces: :mod:`featcache.analysis.tables` (load/merge/coverage),
:mod:`featcache.analysis.stats` (Clopper-Pearson, Kendall tau-b and ranks via scipy, z-scores,
the bootstrap line fit), :mod:`featcache.analysis.rankings`, :mod:`featcache.analysis.shift`,
:mod:`featcache.analysis.plots` (matplotlib ``Figure``, no backend switch),
:mod:`featcache.formatting` (the one table formatter) and
:mod:`featcache.analysis.report` (jinja2 template ``templates/report.html.j2``).
"""

from __future__ import annotations

__all__ = ["load_table", "merge_tables", "rank", "shift", "write_report"]


def __getattr__(name: str):
    if name in ("rank", "shift"):
        from featcache.analysis import api

        return getattr(api, name)
    if name == "write_report":
        from featcache.analysis.report import write_report

        return write_report
    if name in ("load_table", "merge_tables"):
        from featcache.analysis import tables

        return getattr(tables, name)
    raise AttributeError(f"module 'featcache.analysis' has no attribute {name!r}")
