"""``featcache export``: a results table's runs written in a result format that another tool
reads (:data:`~featcache.interop.formats.RESULT_FORMATS`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from featcache.errors import FeatcacheError, ResultsError
from featcache.interop.formats import RESULT_FORMATS, ExportContext
from featcache.interop.runs import EXTERNAL, Run, group_runs, safe_name

log = logging.getLogger(__name__)

__all__ = ["ExportConfig", "ExportReport", "export_results"]


@dataclass(frozen=True)
class ExportConfig:
    """``results``: the featcache results parquet; ``out``: the folder written; ``format``: a
    registered result format; ``caches``: stores whose provenance gives each backbone's weights
    sha256 and source (optional); ``org``: the organisation in ``org/name`` model names;
    ``include_external``: also export rows that were imported (default: featcache's own only)."""

    results: str
    out: str
    format: str
    caches: tuple[str, ...] = ()
    org: str = "featcache"
    include_external: bool = False


@dataclass(frozen=True)
class ExportReport:
    files: tuple[Path, ...]
    runs: int
    skipped: tuple[str, ...]


def weights_of(caches: Sequence[str], runs) -> dict[str, tuple[str, str]]:
    """backbone -> (weights sha256, weights source), from the first store holding its features."""
    from featcache.store import open_cache

    out: dict[str, tuple[str, str]] = {}
    stores = [open_cache(c) for c in caches]
    for r in runs:
        for store in stores if r.backbone not in out else []:
            try:
                p = store.provenance(r.backbone, r.dataset, r.eval_split)
            except (FeatcacheError, KeyError, ValueError):
                continue
            out[r.backbone] = (p.weights_sha256, p.weights_source)
            break
    return out


def export_results(config: ExportConfig) -> ExportReport:
    """Write the runs of ``config.results`` in ``config.format`` under ``config.out``; a run the
    format has no place for is named in the report (and logged), never written half."""
    import polars as pl

    from featcache._version import __version__
    from featcache.core.results import read_results

    fmt = RESULT_FORMATS.resolve(config.format)
    if fmt.write is None:
        raise ResultsError(
            f"result format {config.format!r} is read only (featcache import); export writes "
            f"{', '.join(n for n in RESULT_FORMATS if RESULT_FORMATS[n].write is not None)}"
        )
    frame = read_results(config.results)
    if not config.include_external:
        frame = frame.filter(~pl.col("hparams").str.contains(f'"{EXTERNAL}":', literal=True))
    runs = group_runs(frame)
    if not runs:
        raise ResultsError(f"{config.results} holds no featcache runs to export (imported rows are left out)")
    runs = group_runs(frame, weights_of(config.caches, runs)) if config.caches else runs
    _refuse_name_clashes(runs, config.format)
    ctx = ExportContext(Path(config.out), config.org, __version__)
    files, skipped = fmt.write(runs, ctx)
    twice = sorted({str(f) for f in files if files.count(f) > 1})
    if twice:  # a clash safe_name does not see (a format's own spelling): never silent
        raise ResultsError(f"{config.format} wrote {', '.join(twice)} for more than one run group; rename a backbone")
    for line in skipped:
        log.info("not exported: %s", line)
    if skipped:
        log.warning("%d of %d run(s) have no place in %s (see -v for each)", len(skipped), len(runs), config.format)
    if not files:
        raise ResultsError(f"no run of {config.results} fits {config.format}: {skipped[0]}")
    return ExportReport(tuple(files), len(runs) - len(skipped), tuple(skipped))


def _refuse_name_clashes(runs: Sequence[Run], fmt: str) -> None:
    """Backbones the formats' file and model names spell alike (``a:b`` and ``a-b``) would
    overwrite each other's files: one line naming them, before anything is written."""
    seen: dict[str, set[str]] = {}
    for r in runs:
        seen.setdefault(safe_name(r.backbone), set()).add(r.backbone)
    clash = [sorted(v) for v in seen.values() if len(v) > 1]
    if clash:
        pairs = "; ".join(" and ".join(c) for c in clash)
        raise ResultsError(
            f"backbones {pairs} get the same name in {fmt}'s files, so one would overwrite the other; "
            "export them to separate --out folders (filter the results table) or rename one"
        )
