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
:mod:`featcache.core.formatting` (the one table formatter) and
:mod:`featcache.analysis.report` (jinja2 template ``templates/report.html.j2``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from featcache.core._lazy import lazy_exports

if TYPE_CHECKING:
    from featcache.analysis.api import LoadedResults, Ranking, load_results, rank, shift
    from featcache.analysis.report import write_report
    from featcache.analysis.tables import load_table, merge_tables

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

#: imported on first use (polars, scipy, matplotlib, jinja2)
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "LoadedResults": "featcache.analysis.api",
        "Ranking": "featcache.analysis.api",
        "load_results": "featcache.analysis.api",
        "rank": "featcache.analysis.api",
        "shift": "featcache.analysis.api",
        "write_report": "featcache.analysis.report",
        "load_table": "featcache.analysis.tables",
        "merge_tables": "featcache.analysis.tables",
    },
)
